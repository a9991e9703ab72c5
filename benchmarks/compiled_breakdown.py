# SPDX-License-Identifier: Apache-2.0
"""Where a compiled forward's time goes, Llama beside DAR, and what the machine's memory can stream.

`overhead.py` gives the ratios; this says where DAR's extra time in a compiled gradient-free forward (prefill,
decoding, a vLLM step) is spent, and how far it is from the bytes limit:
  1. each model is compiled (`torch.compile`, inductor) and its forward timed (median of `--repeats`), then run
     under `torch.profiler` with inductor's kernel profile, and the profile is grouped by who spends the time:
     the BLAS products (the branches' matrix products, and DAR's nine phase-1 key-dot products), the kernels
     inductor generated (per group of kernels of the same name), the generated wrapper's own Python (buffer
     allocations, input size checks, kernel calls), dynamo's guards, other ATen operations;
  2. the machine's one-thread bandwidth is measured on arrays of several sizes (an out-of-place add, a copy, a sum),
     so that DAR's extra kernel time can be set against the bytes its path moves (README, "Bytes on paper").

    python benchmarks/compiled_breakdown.py                      # 1 x 128 tokens, fp32 (overhead.py's prefill)
    python benchmarks/compiled_breakdown.py --tokens 16 --dtype bfloat16   # a 16-request vLLM decoding step
    python benchmarks/compiled_breakdown.py --tokens 1           # one decoding token (no cache: DAR's part of it)

The profiler inflates per-call costs (the wrapper's and the guards' most); the forward times are measured without it,
one model after the other (for ratios, `overhead.py`'s interleaved, paired measurement).
In bf16 the DAR parameters stay float32, as a bf16 `from_pretrained` loads them. One thread unless `--threads`.
"""

import argparse
import collections
import json
import re
import statistics
import sys
import time
from pathlib import Path

import torch
import torch._inductor.config

sys.path.insert(0, str(Path(__file__).resolve().parent))
from overhead import SHAPES, as_loaded_in, build_model  # noqa: E402

BLAS_OPS = {"aten::mm", "aten::addmm", "aten::bmm", "aten::baddbmm", "aten::matmul", "aten::linear"}
CATEGORIES = ("BLAS products", "generated kernels", "generated wrapper (self)", "dynamo guards", "other ATen", "other")


def category(event_name: str) -> str:
    """Who spends a profiler event's self time (the categories of `CATEGORIES`)."""
    if "cpp_fused" in event_name or "triton_" in event_name:
        return "generated kernels"
    if "CompiledFxGraph" in event_name:
        return "generated wrapper (self)"
    if "Cache Lookup" in event_name:
        return "dynamo guards"
    if event_name in BLAS_OPS:
        return "BLAS products"
    if event_name.startswith("aten::"):
        return "other ATen"
    return "other"


def kernel_group(event_name: str) -> str:
    """A generated kernel's name without its graph prefix and its index, so that the kernels inductor generated
    from the same operations (the same residual's read in different blocks) add up: "graph_0_cpp_fused_mul_silu_8"
    -> "cpp_fused_mul_silu"."""
    return re.sub(r"_\d+$", "", re.sub(r"^graph_\d+_", "", event_name))


def breakdown(events, calls: int) -> tuple[dict, dict]:
    """Self time in ms and calls per forward by category, and by generated-kernel group, from `key_averages()`."""
    by_category = {name: [0.0, 0.0] for name in CATEGORIES}
    kernels = collections.defaultdict(lambda: [0.0, 0.0])
    for event in events:
        name = category(event.key)
        ms, count = event.self_cpu_time_total / calls / 1e3, event.count / calls
        totals = [by_category[name]] + ([kernels[kernel_group(event.key)]] if name == "generated kernels" else [])
        for total in totals:
            total[0] += ms
            total[1] += count
    return by_category, dict(kernels)


def median_seconds(run, repeats: int) -> float:
    """Median wall seconds of `repeats` calls of `run`."""
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        run()
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def profile_compiled_forward(model, input_ids, repeats: int, profiled_calls: int) -> dict:
    """Compile the model, time its forward (median seconds, no profiler), then profile `profiled_calls` forwards."""
    compiled = torch.compile(model)
    with torch.no_grad():
        for _ in range(3):  # compile, then warm
            compiled(input_ids=input_ids, use_cache=False)
        seconds = median_seconds(lambda: compiled(input_ids=input_ids, use_cache=False), repeats)
        with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as profile:
            for _ in range(profiled_calls):
                compiled(input_ids=input_ids, use_cache=False)
    by_category, kernels = breakdown(profile.key_averages(), profiled_calls)
    return {"forward_ms": 1e3 * seconds, "by_category": by_category, "kernels": kernels}


def bandwidth(sizes_mib, repeats: int = 30) -> list[dict]:
    """GB/s of one thread streaming float32 arrays of each size: c = a + 0.5 b (3 arrays), c = a (2), a.sum() (1)."""
    rows = []
    for size in sizes_mib:
        numel = int(size * 2**20 / 4)
        a, b, c = torch.randn(numel), torch.randn(numel), torch.empty(numel)
        measures = {"add": (lambda: torch.add(a, b, alpha=0.5, out=c), 3), "copy": (lambda: c.copy_(a), 2),
                    "sum": (lambda: a.sum(), 1)}
        row = {"size_mib": size}
        for measure, (run, arrays) in measures.items():
            run()  # warm
            row[f"{measure}_gbs"] = arrays * size * 2**20 / median_seconds(run, repeats) / 1e9
        rows.append(row)
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--shape", default="smollm2-135m", choices=sorted(SHAPES))
    parser.add_argument("--models", default="llama,dar-block", help="comma-separated, as overhead.py names them")
    parser.add_argument("--tokens", type=int, default=128)
    parser.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
    parser.add_argument("--repeats", type=int, default=20, help="timed forwards per model, without the profiler")
    parser.add_argument("--profiled", type=int, default=10, help="forwards per model under the profiler")
    parser.add_argument("--top", type=int, default=8, help="generated-kernel groups listed per model")
    parser.add_argument("--bandwidth-mib", default="0.5,2,8,32,128",
                        help="comma-separated array sizes in MiB for the bandwidth measurement ('' skips it)")
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--json", type=Path, default=None)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    torch._inductor.config.cpp.enable_kernel_profile = True  # each generated C++ kernel a profiler event
    shape, dtype = SHAPES[args.shape], getattr(torch, args.dtype)
    input_ids = torch.randint(0, shape["vocab_size"], (1, args.tokens), generator=torch.Generator().manual_seed(0))
    results = {"args": {k: str(v) for k, v in vars(args).items()}, "models": {}}
    for name in args.models.split(","):
        model = as_loaded_in(build_model(name, shape), dtype).eval()
        results["models"][name] = profile_compiled_forward(model, input_ids, args.repeats, args.profiled)
    names = list(results["models"])
    print(f"compiled forward, {args.shape}, 1 x {args.tokens} tokens, {args.dtype}, {args.threads} thread(s)")
    print(f"{'':<28}" + "".join(f"{name:>22}" for name in names))
    print(f"{'forward, no profiler (ms)':<28}" + "".join(f"{results['models'][n]['forward_ms']:>22.2f}" for n in names))
    print("self time per forward, profiled (ms / calls):")
    for name in CATEGORIES:
        cells = [results["models"][n]["by_category"][name] for n in names]
        print(f"  {name:<26}" + "".join(f"{ms:>14.3f} / {count:>5.0f}" for ms, count in cells))
    for model_name in names:
        kernels = sorted(results["models"][model_name]["kernels"].items(), key=lambda item: -item[1][0])
        print(f"{model_name}: generated kernels by group (ms per forward, calls)")
        for group, (ms, count) in kernels[: args.top]:
            print(f"  {ms:9.3f} {count:6.0f}  {group[:110]}")
    if args.bandwidth_mib:
        results["bandwidth"] = bandwidth([float(size) for size in args.bandwidth_mib.split(",")])
        print("one-thread bandwidth, float32 (GB/s):  size MiB      add     copy      sum")
        for row in results["bandwidth"]:
            speeds = "".join(f"{row[f'{measure}_gbs']:>9.1f}" for measure in ("add", "copy", "sum"))
            print(f"{'':<38}{row['size_mib']:>9.1f}{speeds}")
    if args.json:
        args.json.write_text(json.dumps(results, indent=2))


if __name__ == "__main__":
    main()
