#!/usr/bin/env bash
# The device tool sends the working tree (tracked files, untracked ones git does not ignore, and
# the carried paths) and refuses more than 64 MiB; the tracked files alone are about 135 MB. This
# moves the tracked files no GPU job of experiments/device.sh reads out of the tree, and back:
#
#   experiments/device-tree.sh out     # before the first call: moves them to ../device-stash, prints the size
#   experiments/device-tree.sh out lm  # the same for experiments/heavy_lifting_gpu.sh with the CUDA tests and the
#                                      # GPU benchmark: every bundled model but models/english-lm leaves (it and the
#                                      # EWT test file stay: the heavy-lifting runs read them)
#   experiments/device-tree.sh size    # what would travel (with .carry and .whl), in MiB
#   experiments/device-tree.sh back    # after the last call (before any commit): puts them back
#
# Nothing is committed while they are out: `git status` shows them deleted until `back`.
set -euo pipefail
cd "$(dirname "$0")/.."
STASH=../device-stash
AWAY=(models/multi30k-en-de-pruned-enc models/multi30k-en-de-pruned-all models/english-lm models/ewt-parser
      models/news-en-de docs/img data/ud-english-ewt/en_ewt-ud-test.conllu)
size() {
  { git ls-files -z --cached --others --exclude-standard; find .carry .whl -type f -print0 2>/dev/null || true; } \
    | { xargs -0 stat -c %s 2>/dev/null || true; } \
    | awk '{s += $1} END {printf "%.1f MiB would travel (limit 64)\n", s / 1048576}'  # moved-out files: no size
}
if [ "${2:-}" = lm ]; then
  AWAY=(models/multi30k-en-de models/multi30k-en-fr models/news-en-de models/multi30k-en-de-pruned-enc
        models/multi30k-en-de-pruned-all models/ewt-parser docs/img)
elif [ "$#" -gt 1 ]; then
  echo "unknown set $2: out [lm]" >&2; exit 2
fi
case ${1:?usage: experiments/device-tree.sh out [lm] | size | back} in
  out)
    for path in "${AWAY[@]}"; do
      if [ -e "$path" ]; then mkdir -p "$STASH/$(dirname "$path")"; mv "$path" "$STASH/$path"; fi
    done
    size ;;
  size) size ;;
  back)  # whichever set went out
    for path in models/multi30k-en-de models/multi30k-en-fr models/news-en-de models/multi30k-en-de-pruned-enc \
        models/multi30k-en-de-pruned-all models/english-lm models/ewt-parser docs/img data/ud-english-ewt/en_ewt-ud-test.conllu; do
      if [ -e "$STASH/$path" ]; then mkdir -p "$(dirname "$path")"; mv "$STASH/$path" "$path"; fi
    done
    git status --short -- models docs/img data ;;
  *) echo "unknown command $1: out [lm] | size | back" >&2; exit 2 ;;
esac
