#!/usr/bin/env bash
# Reproduce Voita et al. 2019 on the bundled Multi30k models: a thin wrapper around
# `python -m reproduction` (all settings are in experiments/reproduce.json), run from the
# repository root with the Python that has headlab installed. Resumable: rerun it after an
# interruption and finished stages are skipped. Extra arguments are passed on, e.g.
#   experiments/reproduce.sh --models multi30k-en-de --stages importance,functions,report
#   experiments/reproduce.sh --docs-only
set -euo pipefail
cd "$(dirname "$0")/.."
export OMP_NUM_THREADS="${OMP_NUM_THREADS:-1}" HF_HUB_OFFLINE=1 TOKENIZERS_PARALLELISM=false
PYTHON="${PYTHON:-python3}"
if [ -x .venv/bin/python ] && ! "$PYTHON" -c "import headlab" >/dev/null 2>&1; then PYTHON=.venv/bin/python; fi
exec "$PYTHON" -m reproduction --config experiments/reproduce.json "$@"
