#!/usr/bin/env bash
# Reproduce Voita et al. 2019 on the bundled Multi30k models: a thin wrapper around
# `headlab reproduce` (all settings are in experiments/reproduce.json). Resumable: rerun it after
# an interruption and finished stages are skipped. Extra arguments are passed on, e.g.
#   experiments/reproduce.sh --models multi30k-en-de --stages importance,functions,report
#   experiments/reproduce.sh --docs-only
set -euo pipefail
cd "$(dirname "$0")/.."
export OMP_NUM_THREADS="${OMP_NUM_THREADS:-1}" HF_HUB_OFFLINE=1 TOKENIZERS_PARALLELISM=false
HEADLAB="${HEADLAB:-headlab}"
if ! command -v "$HEADLAB" >/dev/null 2>&1 && [ -x .venv/bin/headlab ]; then HEADLAB=.venv/bin/headlab; fi
exec "$HEADLAB" reproduce --config experiments/reproduce.json "$@"
