#!/usr/bin/env bash
# Train the UD English EWT dependency parser that `headlab parse` uses (issue 17.9): spaCy 3.8,
# tok2vec + morphologizer (UPOS, FEATS) + arc-eager parser, CPU, one thread, no pretrained vectors,
# nothing downloaded. Dev scores pick model-best (patience in config.cfg); then the test scores.
# To bundle it: cp -r $OUT/training/model-best models/ewt-parser, then the evaluate.py command of its card.
#   experiments/parser/train.sh                 (writes $OUT, default /work/runs/ewt-parser)
#   TRAIN=path/en_ewt-ud-train.conllu.gz OUT=dir MAX_STEPS=N MAX_MINUTES=M experiments/parser/train.sh
# Needs the `parse` extra: pip install -e ".[parse]".
set -euo pipefail
cd "$(dirname "$0")/../.."
PY=${PY:-.venv/bin/python}
TRAIN=${TRAIN:-../shared/data/ud-english-ewt/en_ewt-ud-train.conllu.gz}
OUT=${OUT:-/work/runs/ewt-parser}
MAX_STEPS=${MAX_STEPS:-20000}
# spaCy has no time limit: SIGINT after MAX_MINUTES ends training the way Ctrl-C does (model-best is
# already on disk from the last dev improvement; model-last is saved on the way out).
MAX_MINUTES=${MAX_MINUTES:-40}
export OMP_NUM_THREADS=1 BLIS_NUM_THREADS=1 MKL_NUM_THREADS=1
mkdir -p "$OUT/conllu" "$OUT/corpus"
# `spacy convert` reads plain files; 10 sentences per document so the parser also sees sentence breaks.
gzip -dc "$TRAIN" > "$OUT/conllu/en_ewt-ud-train.conllu"
cp data/ud-english-ewt/en_ewt-ud-dev.conllu data/ud-english-ewt/en_ewt-ud-test.conllu "$OUT/conllu/"
for split in train dev test; do
  "$PY" -m spacy convert "$OUT/conllu/en_ewt-ud-$split.conllu" "$OUT/corpus" --converter conllu -n 10
done
status=0
timeout -s INT "${MAX_MINUTES}m" "$PY" -m spacy train experiments/parser/config.cfg --output "$OUT/training" \
  --paths.train "$OUT/corpus/en_ewt-ud-train.spacy" --paths.dev "$OUT/corpus/en_ewt-ud-dev.spacy" \
  --training.max_steps "$MAX_STEPS" || status=$?
if [ "$status" -ne 0 ] && [ "$status" -ne 124 ]; then exit "$status"; fi
# Raw text (spaCy's tokenizer, scored through its alignment) and gold tokens (the usual UD setting).
"$PY" -m spacy evaluate "$OUT/training/model-best" "$OUT/corpus/en_ewt-ud-test.spacy" --output "$OUT/test-scores.json"
"$PY" -m spacy evaluate "$OUT/training/model-best" "$OUT/corpus/en_ewt-ud-test.spacy" --gold-preproc \
  --output "$OUT/test-scores-gold-tokens.json"
# The scores of the card (models/ewt-parser/README.md): gold words, one sentence per parse, punctuation counted.
PYTHONPATH="$PWD/src${PYTHONPATH:+:$PYTHONPATH}" "$PY" experiments/parser/evaluate.py "$OUT/training/model-best" data/ud-english-ewt/en_ewt-ud-test.conllu \
  --out "$OUT/eval_results.json"
