#!/bin/sh
# The replication run of docs/results.md (this session's budget; see there for the full-size command).
# Resumable: rerunning skips runs already in experiments/results/replication.jsonl.
cd "$(dirname "$0")/.." || exit 1
export OMP_NUM_THREADS=1
exec .venv/bin/python experiments/replicate.py --corpus-dir "${CORPUS_DIR:-data/corpus}" \
    --train-tokens "${TRAIN_TOKENS:-327680}" --lr 3e-3 --seeds 0 1 2 --jobs 2 \
    --val-windows 96 --curve-windows 16 --curve-points 8 \
    --save-checkpoints dar_block/0 dar_full/0 attnres_block/0 "$@"
