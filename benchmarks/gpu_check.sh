#!/usr/bin/env bash
# SPDX-License-Identifier: Apache-2.0
# The prepared GPU check of issues #11 and #16, for a CUDA machine: each step has a timeout (240 + 150 + 300 + 240 s);
# steps 1-3 take about 10 minutes, step 4 about 3 more; GPU_CHECK_STEPS="4" runs step 4 alone. Not yet run on a GPU
# (none was lent when it was written).
#
# What it checks and prints, in this order:
#   1. compiled = eager on CUDA: tests/test_compile.py's gradient checks re-run on the GPU (DAR and DAR-MoE, inductor,
#      fp32 and bf16): every parameter's gradient through torch.compile(fullgraph=True) against eager
#      (DAR_TEST_DEVICE=cuda; the default test run never needs CUDA);
#   2. the overhead benchmark eager and compiled (`benchmarks/overhead.py --device cuda [--compile]`, SmolLM2-135M
#      shape, batch 8 x 512; compiled: Llama and Block DAR), ratios to LlamaForCausalLM measured side by side, peak
#      CUDA memory per step;
#   3. one table of both runs (benchmarks/results/gpu_check.md);
#   4. the bytes on paper (issue 16 item 6), measured: `benchmarks/gpu_ratios.py`, bf16, Llama against Block DAR with
#      the float32 state and with `dar_history_dtype="model"`, at the SmolLM2-135M and Llama-3.2-1B shapes: training
#      step, decode per token (batch 1 and 32), saved activations, peak memory (eager, interleaved); then the
#      projection of `benchmarks/bytes_on_paper.py --no-measure` beside it (benchmarks/results/gpu_bytes.md).
# Usage: bash benchmarks/gpu_check.sh   (PY=/path/to/python to choose the interpreter)
# The interpreter needs a CUDA build of torch and the package's dependencies (transformers, accelerate, pytest,
# datasets); the package itself is put on the path from this checkout (no install, no network needed).
set -euo pipefail
cd "$(dirname "$0")/.."
PY="${PY:-$([ -x .venv/bin/python ] && echo .venv/bin/python || echo python3)}"
export PYTHONPATH="$PWD/src${PYTHONPATH:+:$PYTHONPATH}"
$PY -c "import torch; assert torch.cuda.is_available(), 'no CUDA device (or a CPU build of torch): this check is for a GPU machine'"
mkdir -p benchmarks/results
STEPS="${GPU_CHECK_STEPS:-1 2 3 4}"
step() { [[ " $STEPS " == *" $1 "* ]]; }

if step 1; then
echo "== 1. compiled vs eager gradients on CUDA (fp32, bf16)"
DAR_TEST_DEVICE=cuda timeout 240 $PY -m pytest -q tests/test_compile.py \
    -k "inductor or bf16 or float64 or static_cache" 2>&1 | tail -5
fi

if step 2; then
echo "== 2. overhead, eager and compiled"
timeout 200 $PY benchmarks/overhead.py --device cuda --batch 8 --seq 512 --repeats 5 \
    --models llama,dar-block,dar-block@two_phase,dar-full \
    --output benchmarks/results/gpu_eager.json | tail -26
timeout 300 $PY benchmarks/overhead.py --device cuda --batch 8 --seq 512 --repeats 5 --compile \
    --output benchmarks/results/gpu_compile.json | tail -18
fi

if step 3; then
echo "== 3. table"
$PY - <<'EOF' | tee benchmarks/results/gpu_check.md
import json
rows = []
for mode in ("eager", "compile"):
    record = json.load(open(f"benchmarks/results/gpu_{mode}.json"))
    results = record["results"]
    for metric in ("train_step_s", "prefill_s", "decode_token_s", "peak_cuda_train_mib", "train_step_first_s"):
        if metric in results["llama"]:
            ratios = " | ".join(f"{results[name][metric] / results['llama'][metric]:.3f}x" if name in results else "-"
                                for name in ("dar-block", "dar-full"))
            rows.append(f"| {mode} | {metric} | {results['llama'][metric]:.4g} | {ratios} |")
print(f"device: {record['device']}\n")
print("| mode | metric | Llama | Block DAR / Llama | Full DAR / Llama |\n|---|---|---:|---:|---:|")
print("\n".join(rows))
EOF
fi

if step 4; then
echo "== 4. bytes on paper, measured: DAR (float32 state, model-dtype history) / Llama in bf16"
{
    timeout 240 $PY benchmarks/gpu_ratios.py --batch 8 --seq 1024 --repeats 3 --decode-batch 32 \
        --output benchmarks/results/gpu_ratios.json
    echo
    echo "Projected (H100-class, benchmarks/bytes_on_paper.py; compare the ratios, not the absolute numbers):"
    $PY benchmarks/bytes_on_paper.py --no-measure --tokens-per-step 8192 --context 1024 --decode-batch 1 32 | tail -8
} 2>&1 | tee benchmarks/results/gpu_bytes.md
fi
