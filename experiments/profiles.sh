#!/usr/bin/env bash
# Analyse every model of experiments/profiles.json (or the NAMEs given), then collect their profiles
# into docs/results/profiles/ and render the "model-profiles" block of docs/functions.md from all of them.
#   experiments/profiles.sh [NAME ...]     (default: every model)
set -euo pipefail
cd "$(dirname "$0")/.."
export HF_HUB_OFFLINE=1 OMP_NUM_THREADS=1
names=("$@")
while IFS=$'\t' read -r name command; do
  if [ ${#names[@]} -gt 0 ] && [[ ! " ${names[*]} " =~ " ${name} " ]]; then continue; fi
  echo "== $name: $command"
  .venv/bin/$command --no-progress
done < <(.venv/bin/python -c 'import json; [print(m["name"], m["command"], sep="\t") for m in json.load(open("experiments/profiles.json"))["models"]]')
.venv/bin/python experiments/model_profiles.py "${names[@]}"
