#!/usr/bin/env bash
# Issue 35, item 1 on a lent GPU (the amendment of 2026-11-26 in experiments/heavy_lifting_lm.md):
# every configuration of experiments/heavy_lifting_lm.py, JOBS drivers side by side on the one
# GPU (each its own configurations, dealt round-robin in plan order), stopped after MINUTES.
# $OUT/heavy-lifting.tar.gz holds each configuration's eval.json, log, trajectory and pruning
# record (no weights), the drivers' logs and the report. Before the call, here:
#   mkdir -p .carry/heavy && cp ../shared/data/wmt-news-en-de/{news-train,tatoeba,newstest2019}.en.gz \
#     ../shared/data/ud-english-ewt/en_ewt-ud-train.conllu.gz .carry/heavy/
# and carry [".whl", ".carry"] (experiments/device.sh says how to fill .whl). A configuration
# without eval.json in the archive did not finish: run it again (next call, or on the CPU with
# the README's command in docs/results/heavy-lifting/).
set -uo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:?OUT: the folder whose files come back}
MINUTES=${MINUTES:-7}
JOBS=${JOBS:-6}
PY=${PYTHON:-python3}
EXTRA=${EXTRA:-}   # testing the script: EXTRA='--max-steps 2' LIMIT=3 (the first configurations only)
LIMIT=${LIMIT:-1000}
EPOCHS=${EPOCHS:-1}   # the plan's second-epoch step: EPOCHS=2 CONFIGS='gates-keep6 least-6 ...' ROOT=/tmp/heavy-lifting-e2
CONFIGS=${CONFIGS:-}  # default: every configuration of the plan
if [ -d .whl ] && ! "$PY" -c "import conllu" 2>/dev/null; then
  "$PY" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --target /tmp/site .whl/*.whl
  export PYTHONPATH="/tmp/site${PYTHONPATH:+:$PYTHONPATH}"
fi
export PYTHONPATH="$PWD/src${PYTHONPATH:+:$PYTHONPATH}" HF_HUB_OFFLINE=1 TOKENIZERS_PARALLELISM=false PYTHONUNBUFFERED=1
"$PY" -c "import torch, transformers; print('device:', torch.cuda.get_device_name(0) if torch.cuda.is_available() else 'cpu', 'transformers', transformers.__version__)"
DATA=.carry/heavy
ROOT=${ROOT:-/tmp/heavy-lifting}
LABELS=docs/results/heavy-lifting/labels.json
DEADLINE=$(date -u -d "+$((MINUTES * 60)) sec" +%Y-%m-%dT%H:%M:%SZ)
COMMON=(--labels "$LABELS" --train data/multi30k/train.en.gz "$DATA/news-train.en.gz" "$DATA/tatoeba.en.gz"
        "$DATA/en_ewt-ud-train.conllu.gz"
        --eval "newstest2019=$DATA/newstest2019.en.gz" ewt-test=data/ud-english-ewt/en_ewt-ud-test.conllu)
mkdir -p "$ROOT"
pack() {
  tar czf "$OUT/heavy-lifting.tar.gz" -C "$(dirname "$ROOT")" --exclude='*.safetensors' --exclude='*.pt' \
    --exclude='tokenizer*' --exclude='*.txt.gz' --exclude=data "$(basename "$ROOT")"
  ls -la "$OUT"
}
# The reference first: it also writes the fine-tuning text every driver reads.
"$PY" experiments/heavy_lifting_lm.py run --root "$ROOT" "${COMMON[@]}" --only full --deadline "$DEADLINE" \
  > "$ROOT/driver-full.log" 2>&1
tail -3 "$ROOT/driver-full.log"
NAMES=$("$PY" experiments/heavy_lifting_lm.py plan --labels "$LABELS" \
  | "$PY" -c 'import json, sys; print("\n".join(json.loads(l)["name"] for l in sys.stdin if json.loads(l)["name"] != "full"))' | head -n "$LIMIT")
if [ -n "$CONFIGS" ]; then NAMES=$(echo "$CONFIGS" | tr ' ,' '\n\n' | grep .); fi
for j in $(seq 0 $((JOBS - 1))); do
  ONLY=$(echo "$NAMES" | awk -v j="$j" -v n="$JOBS" '(NR - 1) % n == j' | paste -sd,)
  [ -n "$ONLY" ] || continue  # more drivers than configurations (an empty --only would mean all)
  "$PY" experiments/heavy_lifting_lm.py run --root "$ROOT" "${COMMON[@]}" --only "$ONLY" --deadline "$DEADLINE" --epochs "$EPOCHS" \
    ${EXTRA:+--extra-train-args "$EXTRA"} > "$ROOT/driver-$j.log" 2>&1 &
done
wait
date -u
ls "$ROOT"/*/eval.json | wc -l
"$PY" experiments/heavy_lifting_lm.py report --root "$ROOT" --labels "$LABELS" --out "$ROOT/report" > "$ROOT/report.log" 2>&1
tail -20 "$ROOT/report.log"
pack
