#!/bin/sh
# `dar analyze` on the trained replication checkpoints (saved by replicate.py --save-checkpoints), on the first
# 8 x 256 tokens of the validation split; PNGs and summary.json go to docs/results/analysis/<checkpoint>/ (replacing
# the committed ones: --overwrite).
cd "$(dirname "$0")/.." || exit 1
export OMP_NUM_THREADS=1
TEXT=${TEXT:-data/corpus/validation.txt}
# replicate.py names a checkpoint <variant>-seed0-tok<tokens>-<configuration hash>; the output folder leaves the hash
# out, as the committed analyses are named (one configuration's checkpoints at a time: ANALYSE a longer glob if there
# are several).
FOUND=0
for CHECKPOINT in experiments/results/checkpoints/${ANALYSE:-*-seed0-tok"${TRAIN_TOKENS:-327680}"-*}; do
    [ -f "$CHECKPOINT/config.json" ] || continue
    NAME=$(basename "$CHECKPOINT" | sed 's/-[0-9a-f]\{8\}$//')
    .venv/bin/dar analyze "$CHECKPOINT" --text "$TEXT" --out "docs/results/analysis/$NAME" \
        --seq-len 256 --num-sequences 8 --max-rescue-branches 0 --overwrite || exit 1
    FOUND=$((FOUND + 1))
done
if [ "$FOUND" -eq 0 ]; then
    echo "analyze_trained.sh: no checkpoint matches experiments/results/checkpoints/${ANALYSE:-*-seed0-tok${TRAIN_TOKENS:-327680}-*} (replicate.py --save-checkpoints writes them)" >&2
    exit 1
fi
