#!/bin/sh
# `dar analyze` on the trained replication checkpoints (saved by replicate.py --save-checkpoints), on the first
# 8 x 256 tokens of the validation split; PNGs and summary.json go to docs/results/analysis/<checkpoint>/ (replacing
# the committed ones: --overwrite).
cd "$(dirname "$0")/.." || exit 1
export OMP_NUM_THREADS=1
TEXT=${TEXT:-data/corpus/validation.txt}
for CHECKPOINT in experiments/results/checkpoints/*-seed0-tok"${TRAIN_TOKENS:-327680}"; do
    [ -f "$CHECKPOINT/config.json" ] || continue
    .venv/bin/dar analyze "$CHECKPOINT" --text "$TEXT" --out "docs/results/analysis/$(basename "$CHECKPOINT")" \
        --seq-len 256 --num-sequences 8 --max-rescue-branches 0 --overwrite || exit 1
done
