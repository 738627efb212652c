#!/usr/bin/env bash
# Issue 35, items 2 and 3 on a lent GPU: the configurations of experiments/heavy_lifting_nmt.py
# (plan: experiments/heavy_lifting_nmt.md), JOBS drivers side by side on the one GPU (each its own
# configurations, dealt round-robin in plan order), stopped after MINUTES. Everything it reads is
# in the checkout (data/multi30k, models/multi30k-en-de, docs/results/...); carry [".whl"] when the
# machine's Python lacks headlab's dependencies (experiments/device.sh says how to fill .whl).
# $OUT/heavy-lifting-nmt.tar.gz holds each configuration's eval.json, log, rows, development
# curve and translations (no weights), the drivers' logs and the report. A configuration without
# eval.json did not finish: the next call (same ROOT on a warm machine) or the CPU goes on.
#   testing: EXTRA='--limit 40 --eval-limit 10' CONTROL='--finetune-steps 2 --dev-every 1' \
#            SCRATCH='--scratch-epochs 1 --scratch-average-last 1' LIMIT=3
set -uo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:?OUT: the folder whose files come back}
MINUTES=${MINUTES:-8}
JOBS=${JOBS:-8}
PY=${PYTHON:-python3}
STAGE=${STAGE:-1}
LIMIT=${LIMIT:-1000}
CONFIGS=${CONFIGS:-}  # default: every configuration of the stage
EXTRA=${EXTRA:-}
CONTROL=${CONTROL:-}
SCRATCH=${SCRATCH:-}
if [ -d .whl ] && ! "$PY" -c "import sacrebleu" 2>/dev/null; then
  "$PY" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --target /tmp/site .whl/*.whl
  export PYTHONPATH="/tmp/site${PYTHONPATH:+:$PYTHONPATH}"
fi
export PYTHONPATH="$PWD/src${PYTHONPATH:+:$PYTHONPATH}" HF_HUB_OFFLINE=1 TOKENIZERS_PARALLELISM=false PYTHONUNBUFFERED=1
"$PY" -c "import torch, transformers; print('device:', torch.cuda.get_device_name(0) if torch.cuda.is_available() else 'cpu', 'transformers', transformers.__version__)"
ROOT=${ROOT:-/tmp/heavy-lifting-nmt}
LABELS=docs/results/heavy-lifting-nmt/labels.json
COMMON=(--root "$ROOT" --labels "$LABELS" --stage "$STAGE" --data "$PWD/data/multi30k"
        --results "$PWD/docs/results/reproduction/multi30k-en-de")
DEADLINE=$(date -u -d "+$((MINUTES * 60)) sec" +%Y-%m-%dT%H:%M:%SZ)
mkdir -p "$ROOT"
NAMES=$("$PY" experiments/heavy_lifting_nmt.py plan --labels "$LABELS" --stage "$STAGE" \
  | "$PY" -c 'import json, sys; print("\n".join(json.loads(l)["name"] for l in sys.stdin))' | head -n "$LIMIT")
if [ -n "$CONFIGS" ]; then NAMES=$(echo "$CONFIGS" | tr ' ,' '\n\n' | grep .); fi
for j in $(seq 0 $((JOBS - 1))); do
  ONLY=$(echo "$NAMES" | awk -v j="$j" -v n="$JOBS" '(NR - 1) % n == j' | paste -sd,)
  [ -n "$ONLY" ] || continue  # more drivers than configurations (an empty --only would mean all)
  "$PY" experiments/heavy_lifting_nmt.py run "${COMMON[@]}" --model "$PWD/models/multi30k-en-de" --only "$ONLY" \
    --deadline "$DEADLINE" ${EXTRA:+--extra-train-args "$EXTRA"} ${CONTROL:+--extra-control-args "$CONTROL"} \
    ${SCRATCH:+--extra-scratch-args "$SCRATCH"} > "$ROOT/driver-$j.log" 2>&1 &
done
wait
date -u
ls "$ROOT"/*/eval*.json 2>/dev/null | wc -l
"$PY" experiments/heavy_lifting_nmt.py report "${COMMON[@]}" --out "$ROOT/report" > "$ROOT/report.log" 2>&1
tail -30 "$ROOT/report.log"
tar czf "$OUT/heavy-lifting-nmt.tar.gz" -C "$(dirname "$ROOT")" --exclude='*.safetensors' --exclude='*.pt' \
  --exclude='tokenizer*' --exclude='last' --exclude='averaged' --exclude='epochs' "$(basename "$ROOT")"
ls -la "$OUT"
