#!/usr/bin/env bash
# SPDX-License-Identifier: Apache-2.0
# The prepared GPU check of issues #11 and #16, for a CUDA machine. Not yet run on a GPU (none was lent since it was
# written); dry-run on CPU (every step, CUDA's branches with torch.cuda faked) on 2026-12-07.
#
# What it checks and prints, in this order (each step under its own timeout; a step that fails or times out is
# reported and the next one runs; every step's whole output is kept in benchmarks/results/, copied to $OUT if set):
#   0. the versions it runs with, after installing the wheels carried in benchmarks/wheels/ if there are any;
#   1. compiled = eager on CUDA: tests/test_compile.py's gradient checks re-run on the GPU (DAR and DAR-MoE with
#      aot_eager, DAR with inductor; fp32 and bf16): every parameter's gradient through torch.compile(fullgraph=True)
#      against eager (DAR_TEST_DEVICE=cuda; the default test run never needs CUDA), at most 150 s;
#   2. the overhead benchmark, eager (`benchmarks/overhead.py --device cuda`, SmolLM2-135M shape, batch 8 x 512):
#      ratios to LlamaForCausalLM measured side by side, peak CUDA memory per step, at most 180 s;
#   2c. (not in the default steps) the same compiled, Llama and Block DAR: its first steps compile for minutes;
#   3. one table of steps 2 and 2c (benchmarks/results/gpu_check.md), of the runs that finished;
#   4. the bytes on paper (issue 16 item 6), measured: `benchmarks/gpu_ratios.py`, bf16, Llama against Block DAR with
#      the float32 state and with `dar_history_dtype="model"`, at the SmolLM2-135M and Llama-3.2-1B shapes: training
#      step, decode per token (batch 1 and 32, after 1024 prompt tokens), saved activations, peak memory (eager,
#      interleaved; written after each shape), then the projection of `benchmarks/bytes_on_paper.py --no-measure` at
#      the same context (benchmarks/results/gpu_bytes.md), at most 240 s.
# The default steps (0 1 2 3 4) take at most about 9.5 minutes, one call of the device tool (600 s per command, 15
# minutes of device time per session, the machine's start included). The compiled run is a second call:
# GPU_CHECK_STEPS="2c 3".
#
# The lent machines' image has torch 2.11 and transformers 5.17 (below this package's 5.19) and no gguf, and nothing
# can be fetched there: `make gpu-wheels` here downloads transformers 5.25 and what it needs that the image may lack
# (about 50 MB, Python 3.12 wheels) into benchmarks/wheels/, which the call carries:
#   run(command="bash benchmarks/gpu_check.sh", carry=["benchmarks/wheels"], timeout_s=600)
# PY=/path/to/python chooses the interpreter (default: .venv's if present, else python3); the package itself is put
# on the path from this checkout (no install).
set -uo pipefail
cd "$(dirname "$0")/.."
PY="${PY:-$([ -x .venv/bin/python ] && echo .venv/bin/python || echo python3)}"
export PYTHONPATH="$PWD/src${PYTHONPATH:+:$PYTHONPATH}"
RESULTS=benchmarks/results
mkdir -p "$RESULTS"
STEPS="${GPU_CHECK_STEPS:-0 1 2 3 4}"
step() { [[ " $STEPS " == *" $1 "* ]]; }
FAILED=()
# run NAME TIMEOUT COMMAND...: the command's whole output to $RESULTS/NAME.log and the screen; a failure is noted.
run() {
    local name=$1 limit=$2
    shift 2
    timeout "$limit" "$@" > >(tee "$RESULTS/$name.log") 2>&1
    local code=$?
    wait  # (the tee)
    if [ "$code" -ne 0 ]; then
        echo "!! step $name failed with exit code $code$([ "$code" -eq 124 ] && echo " (timed out after $limit s)")"
        FAILED+=("$name:$code")
    fi
    return 0
}
save() { [ -n "${OUT:-}" ] && cp -r "$RESULTS/." "$OUT/" 2>/dev/null; return 0; }
trap save EXIT

if step 0; then
echo "== 0. versions"
if compgen -G "benchmarks/wheels/*.whl" > /dev/null; then
    # The versions `make gpu-wheels` downloads, pinned: unpinned, pip keeps the image's transformers when 5.25's
    # requirements do not resolve from the folder, and exits 0.
    run wheels 120 $PY -m pip install --quiet --no-index --find-links benchmarks/wheels transformers==5.25.0 gguf \
        peft==0.21.2
fi
run versions 60 $PY -c "
import sys, torch, transformers, accelerate
print('python', sys.version.split()[0], '| torch', torch.__version__, '| transformers', transformers.__version__,
      '| accelerate', accelerate.__version__)
print('device', torch.cuda.get_device_name() if torch.cuda.is_available() else None)
assert torch.cuda.is_available(), 'no CUDA device (or a CPU build of torch): this check is for a GPU machine'
import dar_transformers
"
if [[ " ${FAILED[*]} " == *" versions:"* || " ${FAILED[*]} " == *" wheels:"* ]]; then
    echo "!! stopping: the carried wheels did not install, no CUDA, or the package does not import (see above)"
    exit 1
fi
fi

if step 1; then
echo "== 1. compiled vs eager gradients on CUDA (fp32, bf16)"
DAR_TEST_DEVICE=cuda run step1_compile_tests 150 $PY -m pytest -q -rfE -p no:cacheprovider tests/test_compile.py \
    -k "inductor or bf16 or float64 or static_cache"
fi

if step 2; then
echo "== 2. overhead, eager"
run step2_overhead_eager 180 $PY benchmarks/overhead.py --device cuda --batch 8 --seq 512 --repeats 5 \
    --models llama,dar-block,dar-block@two_phase,dar-full --output "$RESULTS/gpu_eager.json"
fi

if step 2c; then
echo "== 2c. overhead, compiled"
run step2c_overhead_compiled 540 $PY benchmarks/overhead.py --device cuda --batch 8 --seq 512 --repeats 5 \
    --compile --output "$RESULTS/gpu_compile.json"
fi

if step 3; then
echo "== 3. table"
run step3_table 60 $PY - <<'EOF'
import json, os
rows, device = [], None
for mode in ("eager", "compile"):
    path = f"benchmarks/results/gpu_{mode}.json"
    if not os.path.exists(path):
        rows.append(f"| {mode} | (no {path}: the run did not finish) | | | |")
        continue
    record = json.load(open(path))
    results, device = record["results"], record["device"]
    for metric in ("train_step_s", "prefill_s", "decode_token_s", "peak_cuda_train_mib", "train_step_first_s"):
        if metric in results.get("llama", {}):
            ratios = " | ".join(f"{results[name][metric] / results['llama'][metric]:.3f}x" if name in results else "-"
                                for name in ("dar-block", "dar-full"))
            rows.append(f"| {mode} | {metric} | {results['llama'][metric]:.4g} | {ratios} |")
table = (f"device: {device}\n\n| mode | metric | Llama | Block DAR / Llama | Full DAR / Llama |\n|---|---|---:|---:|---:|\n"
         + "\n".join(rows))
print(table)
open("benchmarks/results/gpu_check.md", "w").write(table + "\n")
EOF
fi

if step 4; then
echo "== 4. bytes on paper, measured: DAR (float32 state, model-dtype history) / Llama in bf16"
run step4_gpu_ratios 240 $PY benchmarks/gpu_ratios.py --batch 8 --seq 1024 --prompt 1024 --repeats 3 \
    --decode-batch 32 --output "$RESULTS/gpu_ratios.json"
run step4_projection 60 $PY benchmarks/bytes_on_paper.py --no-measure --tokens-per-step 8192 --context 1024 \
    --decode-batch 1 32
{
    cat "$RESULTS/step4_gpu_ratios.log"
    echo
    echo "Projected (H100-class, benchmarks/bytes_on_paper.py; compare the ratios, not the absolute numbers):"
    sed -n '/^Projection/,$p' "$RESULTS/step4_projection.log"
} > "$RESULTS/gpu_bytes.md"
fi

echo "== done; failed steps: ${FAILED[*]:-none}; outputs in $RESULTS/${OUT:+ (copied to \$OUT)}"
[ ${#FAILED[@]} -eq 0 ]
