# SPDX-License-Identifier: Apache-2.0
"""DAR overhead against `LlamaForCausalLM` at identical dimensions, measured side by side in one run.

Models: Llama (the baseline), Block DAR (about 8 blocks) and Full DAR (K = 1), all built from one config, in
float32. Measurements are interleaved (Llama, Block, Full, Llama, ...) so machine noise hits all models alike:
  - train step: forward + backward + AdamW step on a [batch, seq] random batch with labels; with it the system CPU
    seconds and minor page faults of the step (`train_step_sys_s`, `train_step_page_faults`: the kernel zeroing
    fresh pages for the allocator, which glibc returns and maps again at its own thresholds; the environment
    variables MALLOC_TRIM_THRESHOLD_, MALLOC_TOP_PAD_ and MALLOC_MMAP_THRESHOLD_ fix them for a run);
  - prefill: forward of the prompt with a fresh KV cache;
  - decode: one-token forwards with the KV cache after the prompt (median per token);
  - saved activations: bytes of the tensors autograd keeps for backward in one training forward (deduplicated
    by storage; a deterministic measure of training activation memory that excludes weights and optimiser);
  - peak RSS: resident memory high-water mark of a fresh process doing one training step or one prefill.
  - saved activations in bf16 and fp32 (issue #11's measure): SmolLM2's dimensions with a vocabulary of 8192, one
    sequence of 512 tokens, weights in bf16 with DAR parameters in float32 (as `from_pretrained(dtype=bfloat16)`
    loads them), and the same in float32.
Medians and ratios to Llama are printed as a table and written to a JSON file, with the paired ratios of the timed
metrics: each repeat's DAR time over the Llama time of the same repeat, median and quartiles over the repeats
(the machine's drift between repeats cancels in each pair). `--metrics prefill,decode` times only those (no training
step, which also skips its compile: a run of many repeats for the inference ratios alone).

With `--compile` every model is compiled the same way (`torch.compile(model)`, inductor, the whole model, as
`Trainer(torch_compile=True)` does) and measured interleaved as above; decoding goes through HF's compiled static-
cache path (`generate(cache_implementation="static")` with a `CompileConfig`), timed per token by a streamer. The
first call of each mode (compile time included) is reported separately as `*_first_s`.

    python benchmarks/overhead.py                 # SmolLM2-135M shape (hidden 576, 30 layers, 9/3 heads)
    python benchmarks/overhead.py --shape small   # a smaller shape for a quick look
    python benchmarks/overhead.py --compile       # compiled Llama vs compiled Block DAR (about 11 minutes here)
    python benchmarks/overhead.py --compile --shape small --models llama,dar-block,dar-full
    python benchmarks/overhead.py --first-steps --models llama,dar-block,dar-block+operator+cpp   # compile time
    python benchmarks/overhead.py --compile --metrics prefill,decode --repeats 30   # inference ratios, paired

On a machine with a GPU the same command runs there (`--device cuda`, the default when CUDA is available): timings
synchronise the device, and peak memory is the CUDA allocator's high-water mark of one step.
"""

import argparse
import json
import os
import platform
import resource
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch
import torch._functorch.config
import torch._inductor.config
from transformers import CompileConfig, LlamaConfig, LlamaForCausalLM
from transformers.generation.streamers import BaseStreamer

from dar_transformers import DARConfig, DARForCausalLM
from dar_transformers.configuration_dar import DAR_COMPILED_READS
from dar_transformers.modeling_dar import OUTPUT_CACHE_FIELD, cache_keyword

SHAPES = {
    "smollm2-135m": dict(
        hidden_size=576, intermediate_size=1536, num_hidden_layers=30, num_attention_heads=9, num_key_value_heads=3,
        vocab_size=49152, tie_word_embeddings=True, rms_norm_eps=1e-5,
    ),
    "small": dict(
        hidden_size=256, intermediate_size=768, num_hidden_layers=8, num_attention_heads=4, num_key_value_heads=2,
        vocab_size=8192, tie_word_embeddings=True, rms_norm_eps=1e-5,
    ),
}


def build_model(name: str, shape: dict) -> torch.nn.Module:
    """Build "llama", "dar-block" or "dar-full", the DAR ones with an optional "@backend" (`dar_implementation`, e.g.
    "dar-block@two_phase"; the default "fast" otherwise) and optional "+option"s, each a value of
    `dar_compiled_read`, or "cpp" for the C++ kernels (`dar_inference_kernel` and `dar_training_kernel`), e.g.
    "dar-block+operator", "dar-block+cpp", so that the variants run side by side in one run."""
    torch.manual_seed(0)
    if name == "llama":
        return LlamaForCausalLM(LlamaConfig(**shape))
    name, *options = name.split("+")
    name, _, implementation = name.partition("@")
    fields = {}
    for option in options:
        if option in DAR_COMPILED_READS:
            fields["dar_compiled_read"] = option
        else:  # an unknown option is refused by DARConfig's validation, naming the field
            fields["dar_inference_kernel"] = fields["dar_training_kernel"] = option
    num_branches = 2 * shape["num_hidden_layers"]
    block_size = 1 if name == "dar-full" else None  # None: about 8 blocks
    config = DARConfig(**shape, dar_block_size=block_size, dar_implementation=implementation or "fast", **fields)
    assert config.dar_block_size <= num_branches
    return DARForCausalLM(config)


# Wall-clock time by default; `--clock process` times this process's CPU time instead, which on a CPU shared with
# other jobs (one thread: the process runs or waits) moves far less than wall time between interleaved repeats.
clock = time.perf_counter


def synchronize(device: torch.device) -> None:
    """Wait for queued device work, so that wall-clock timings cover it (a no-op on CPU)."""
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def kernel_work() -> tuple[float, int]:
    """This process's system CPU seconds and minor page faults so far: mostly the kernel handing the allocator fresh
    zeroed pages, which a training step's process CPU time (`--clock process`) includes and which moves with the
    allocator's state (glibc returns freed memory to the system and maps it again) more than with the model's work."""
    usage = resource.getrusage(resource.RUSAGE_SELF)
    return usage.ru_stime, usage.ru_minflt


def time_train_step(model, optimizer, batch) -> float:
    synchronize(batch.device)
    start = clock()
    loss = model(input_ids=batch, labels=batch).loss
    loss.backward()
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)
    synchronize(batch.device)
    return clock() - start


@torch.no_grad()
def time_prefill(model, prompt) -> float:
    synchronize(prompt.device)
    start = clock()
    model(input_ids=prompt, use_cache=True)
    synchronize(prompt.device)
    return clock() - start


@torch.no_grad()
def time_decode(model, prompt, new_tokens: int) -> float:
    """Median seconds per decoded token (one-token forwards with the KV cache)."""
    # The cache under the names the installed transformers uses (5.24 renamed it; the old names still work, with a
    # warning and a shim call per token on Llama's side only).
    keyword = cache_keyword(getattr(model, "_orig_mod", model).forward)
    output = model(input_ids=prompt, use_cache=True)
    cache, token = output[OUTPUT_CACHE_FIELD], output.logits[:, -1:].argmax(-1)
    times = []
    for _ in range(new_tokens):
        synchronize(prompt.device)
        start = clock()
        output = model(input_ids=token, use_cache=True, **{keyword: cache})
        synchronize(prompt.device)
        times.append(clock() - start)
        cache, token = output[OUTPUT_CACHE_FIELD], output.logits[:, -1:].argmax(-1)
    return statistics.median(times)


def saved_activation_bytes(model, batch) -> int:
    """Bytes of distinct storages autograd keeps for backward in one training forward (parameters excluded). DAR's
    two-phase backend chains its own saved-tensor hooks to this one, so what it keeps is counted and the partial
    states it rebuilds in backward are not; the fast backend's depth-major buffers, which its fused reads keep
    outside the saved-tensor mechanism, are added, so that its count is complete too."""
    storages = {}

    def record(tensor):
        if not tensor.is_meta and not isinstance(tensor, torch.nn.Parameter):
            storage = tensor.untyped_storage()
            storages[storage.data_ptr()] = storage.nbytes()
        return tensor

    backbone = getattr(model, "model", None)
    initial_state = getattr(backbone, "initial_state", None)
    if initial_state is not None:  # DAR: the flattened state starts with its backend, which may own buffers
        def recording_initial_state(*args, **kwargs):
            state = initial_state(*args, **kwargs)
            for buffer in (getattr(state[0], "history_buffer", None), getattr(state[0], "inv_rms_buffer", None)):
                if buffer is not None:
                    record(buffer)
            return state

        backbone.initial_state = recording_initial_state
    parameters = {p.untyped_storage().data_ptr() for p in model.parameters()}
    try:
        with torch.autograd.graph.saved_tensors_hooks(record, lambda tensor: tensor):
            loss = model(input_ids=batch, labels=batch).loss
    finally:
        if initial_state is not None:
            del backbone.initial_state
    del loss
    return sum(size for pointer, size in storages.items() if pointer not in parameters)


class TokenClock(BaseStreamer):
    """Timestamps every chunk `generate` streams: the prompt, then one call per generated token."""

    def __init__(self, device: torch.device):
        self.device, self.times = device, []

    def put(self, value):
        synchronize(self.device)
        self.times.append(clock())

    def end(self):
        pass


def time_compiled_decode(model, prompt, new_tokens: int) -> float:
    """Median seconds per decoded token through HF's compiled static-cache decoding (prefill stays eager, as in
    `generate`); the gaps between streamed tokens after the first generated one."""
    compile_config = CompileConfig(fullgraph=False)
    compile_config._compile_all_devices = True  # generate compiles on CUDA by default; on CPU only when asked
    clock = TokenClock(prompt.device)
    model.generate(prompt, max_new_tokens=new_tokens + 1, min_new_tokens=new_tokens + 1, do_sample=False,
                   cache_implementation="static", compile_config=compile_config, streamer=clock, pad_token_id=0)
    gaps = [later - earlier for earlier, later in zip(clock.times[2:], clock.times[3:])]
    return statistics.median(gaps)


def as_loaded_in(model: torch.nn.Module, dtype: torch.dtype) -> torch.nn.Module:
    """The model in `dtype` with DAR's parameters float32 (`_keep_in_fp32_modules_strict`), as a
    `from_pretrained(dtype=...)` loads them."""
    model = model.to(dtype)
    keep_in_fp32 = tuple(model._keep_in_fp32_modules_strict or ())
    for module_name, module in model.named_modules():
        if keep_in_fp32 and module_name.endswith(keep_in_fp32):
            module.float()
    return model


def saved_activations_by_dtype(shape: dict, names: list[str], seq: int = 512, vocab: int = 8192) -> dict:
    """Saved activations (MiB) of one training forward in bf16 (DAR parameters float32) and in float32."""
    shape = {**shape, "vocab_size": vocab}
    batch = torch.randint(0, vocab, (1, seq), generator=torch.Generator().manual_seed(1))
    result = {}
    for dtype_name, dtype in (("bf16", torch.bfloat16), ("fp32", torch.float32)):
        for name in names:
            model = as_loaded_in(build_model(name, shape), dtype)
            model.train()
            result.setdefault(name, {})[f"saved_activation_{dtype_name}_mib"] = saved_activation_bytes(model, batch) / 2**20
            del model
    return result


def peak_rss_subprocess(name: str, shape_name: str, mode: str, batch: int, seq: int) -> float:
    """Peak resident MiB of a fresh process that builds the model and runs one `mode` step ('train': forward,
    backward and an AdamW step; 'prefill': a no-grad forward with the KV cache)."""
    code = f"""
import sys, torch
sys.path.insert(0, {str(Path(__file__).parent)!r})
from overhead import SHAPES, build_model
model = build_model({name!r}, SHAPES[{shape_name!r}])
batch = torch.randint(0, 1000, ({batch}, {seq}))
if {mode!r} == "train":
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-5)
    model.train()
    model(input_ids=batch, labels=batch).loss.backward()
    optimizer.step()
else:
    model.eval()
    with torch.no_grad():
        model(input_ids=batch, use_cache=True)
# VmHWM, not ru_maxrss: Linux carries ru_maxrss over from the (large) parent process through fork and exec.
high_water = next(line for line in open("/proc/self/status") if line.startswith("VmHWM:"))
print(int(high_water.split()[1]) / 1024)
"""
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    return float(result.stdout.strip().splitlines()[-1])


def first_compiled_step_subprocess(name: str, shape_name: str, batch: int, seq: int, clock_name: str,
                                   device: str) -> float:
    """Seconds of the first compiled training step (compile included, cold caches) of a fresh process that builds
    only this model: in one process, a model compiled after others can take up to twice as long (dynamo's caches
    of the shared forward code and the process's state carry over), so `--first-steps` compares models each alone.
    Each process gets an empty inductor cache folder of its own (`TORCHINDUCTOR_CACHE_DIR`): with graph caches off,
    inductor still reuses the C++ kernels an earlier process built, so a model measured after Llama found the kernels
    both share already built (a tiny shape: DAR alone and cold 36-37 s, after Llama 27 s). DAR's own C++ extension
    (`dar_training_kernel="cpp"`) is built once per installation, outside that folder, and not counted."""
    code = f"""
import sys, time, torch
import torch._functorch.config, torch._inductor.config
sys.path.insert(0, {str(Path(__file__).parent)!r})
import overhead
overhead.clock = time.process_time if {clock_name!r} == "process" else time.perf_counter
torch._inductor.config.fx_graph_cache = False
torch._functorch.config.enable_autograd_cache = False
model = overhead.build_model({name!r}, overhead.SHAPES[{shape_name!r}]).to({device!r}).train()
optimizer = torch.optim.AdamW(model.parameters(), lr=1e-5)
batch = torch.randint(0, 1000, ({batch}, {seq})).to({device!r})
print(overhead.time_train_step(torch.compile(model), optimizer, batch))
"""
    with tempfile.TemporaryDirectory(prefix="inductor-cold-") as cache:
        result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True,
                                env={**os.environ, "TORCHINDUCTOR_CACHE_DIR": cache})
    return float(result.stdout.strip().splitlines()[-1])


def first_steps(args, names: list[str]) -> None:
    """`--first-steps`: the first compiled training step of each model, each alone in a fresh process."""
    results = {}
    for name in names:
        results[name] = first_compiled_step_subprocess(name, args.shape, args.batch, args.seq, args.clock,
                                                       args.device)
        ratio = f" ({results[name] / results['llama']:.2f}x Llama)" if "llama" in results else ""
        print(f"{name}: first compiled training step {results[name]:.1f} s{ratio}", flush=True)
    args.output.parent.mkdir(parents=True, exist_ok=True)
    record = {"shape": args.shape, "batch": args.batch, "seq": args.seq, "clock": args.clock, "device": args.device,
              "torch": torch.__version__, "train_step_first_s": results}
    args.output.write_text(json.dumps(record, indent=2))
    print(f"wrote {args.output}")


TIMED_METRICS = {  # `--metrics` name -> the samples it records, its time first (the one paired with Llama's)
    "train": ("train_step_s", "train_step_sys_s", "train_step_page_faults"),
    "prefill": ("prefill_s",),
    "decode": ("decode_token_s",),
}


def paired_ratios(samples: dict, metrics: list[str]) -> dict:
    """Per model other than Llama and per metric: each repeat's time over Llama's of the same repeat (the models run
    one after the other, seconds apart), as median and quartiles {"median", "q1", "q3"}; empty without Llama or with
    fewer than 2 repeats."""
    if "llama" not in samples:
        return {}
    paired = {}
    for name, by_metric in samples.items():
        if name == "llama":
            continue
        for metric in metrics:
            ratios = [ours / base for ours, base in zip(by_metric[metric], samples["llama"][metric]) if base]
            if len(ratios) >= 2:
                q1, median, q3 = statistics.quantiles(ratios, n=4, method="inclusive")
                paired.setdefault(name, {})[metric] = {"median": median, "q1": q1, "q3": q3}
    return paired


def peak_cuda_mib(step) -> float:
    """The CUDA allocator's high-water mark (MiB) during `step`, over what was allocated before it."""
    torch.cuda.empty_cache()
    torch.cuda.reset_peak_memory_stats()
    before = torch.cuda.memory_allocated()
    step()
    return (torch.cuda.max_memory_allocated() - before) / 2**20


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--shape", choices=sorted(SHAPES), default="smollm2-135m")
    parser.add_argument("--batch", type=int, default=2)
    parser.add_argument("--seq", type=int, default=128, help="training / prefill sequence length")
    parser.add_argument("--repeats", type=int, default=5, help="interleaved repetitions of each measurement")
    parser.add_argument("--decode-tokens", type=int, default=16)
    parser.add_argument("--models", default=None,
                        help="comma-separated, a DAR model optionally with @backend and +compiled read, e.g. dar-block@two_phase, "
                        "dar-block+operator (default: llama,dar-block,dar-full; with --compile llama,dar-block, "
                        "since compiling Full DAR at the SmolLM2 shape alone takes longer than the rest together "
                        "on 2 CPU cores: add it explicitly, or measure it at --shape small)")
    parser.add_argument("--no-rss", action="store_true", help="skip the peak-RSS subprocesses")
    parser.add_argument("--compile", action="store_true", help="compile every model with torch.compile (inductor)")
    parser.add_argument("--no-dtype-activations", action="store_true",
                        help="skip the bf16/fp32 saved-activation measure (1 x 512 tokens, vocabulary 8192)")
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu",
                        help="where the models run (default: cuda when available); on cuda, peak memory is the "
                        "allocator's high-water mark of one training step / prefill instead of process RSS")
    parser.add_argument("--clock", choices=("wall", "process"), default="wall",
                        help="wall-clock time, or this process's CPU time (CPU only; for a loaded shared machine)")
    parser.add_argument("--first-steps", action="store_true",
                        help="only the first compiled training step (compile included) of each model, each in a fresh "
                        "process, in the order given (implies --compile; time it with --clock wall: inductor compiles "
                        "in worker processes, which a process clock does not count)")
    parser.add_argument("--metrics", default="train,prefill,decode",
                        help="comma-separated, the timed measurements to run: train, prefill, decode (default all; the "
                        "saved activations need train)")
    parser.add_argument("--output", type=Path, default=None,
                        help="JSON results (default: results/overhead.json, or overhead_compile.json with --compile)")
    args = parser.parse_args()

    global clock
    clock = time.process_time if args.clock == "process" else time.perf_counter
    shape = SHAPES[args.shape]
    if args.output is None:
        stem = "overhead_first_steps" if args.first_steps else "overhead_compile" if args.compile else "overhead"
        args.output = Path(__file__).parent / "results" / f"{stem}.json"
    if args.models is None:
        args.models = "llama,dar-block" if args.compile or args.first_steps else "llama,dar-block,dar-full"
    names = args.models.split(",")
    timed = args.metrics.split(",")
    if set(timed) - set(TIMED_METRICS):  # "" splits to [""], refused here too
        parser.error(f"--metrics takes a comma-separated subset of {', '.join(TIMED_METRICS)}, got {args.metrics!r}")
    if args.first_steps:
        return first_steps(args, names)
    device = torch.device(args.device)
    models = {name: build_model(name, shape).to(device) for name in names}
    if args.compile:
        # The models share transformers' forward code objects, and each (model, grad mode, cache kind) is one dynamo
        # cache entry of them: past the default limit of 8, later models would silently run eagerly.
        torch._dynamo.config.recompile_limit = 64
        # Compile time is measured cold: no graph reused from an earlier run's on-disk caches.
        torch._inductor.config.fx_graph_cache = False
        torch._functorch.config.enable_autograd_cache = False
    runners = {name: torch.compile(model) if args.compile else model for name, model in models.items()}
    optimizers = {name: torch.optim.AdamW(model.parameters(), lr=1e-5) for name, model in models.items()}
    generator = torch.Generator().manual_seed(0)
    batch = torch.randint(0, shape["vocab_size"], (args.batch, args.seq), generator=generator).to(device)
    prompt = batch[:1]
    block_sizes = {name: getattr(model.config, "dar_block_size", None) for name, model in models.items()}
    print(f"shape {args.shape}: {shape}; batch {args.batch} x {args.seq}; device {device}; "
          f"threads {torch.get_num_threads()}")
    print(f"block sizes (branches): {block_sizes}")

    keys = [key for metric in timed for key in TIMED_METRICS[metric]]
    samples = {name: {key: [] for key in keys} for name in names}
    decode = time_compiled_decode if args.compile else time_decode
    first = {}
    for name in names:  # warm-up: first calls allocate, pick kernels and (with --compile) compile
        first[name] = {}
        if "train" in timed:
            models[name].train()
            first[name]["train_step_first_s"] = time_train_step(runners[name], optimizers[name], batch)
        models[name].eval()
        if "prefill" in timed:
            first[name]["prefill_first_s"] = time_prefill(runners[name], prompt)
        if "decode" in timed:
            start = clock()
            decode(models[name], prompt, 2)
            first[name]["decode_first_s"] = clock() - start
        print(f"warm-up {name}: " + ", ".join(f"{key} {value:.1f} s" for key, value in first[name].items()), flush=True)
    for _ in range(args.repeats):
        for name in names:
            model = models[name]
            if "train" in timed:
                model.train()
                system_before, faults_before = kernel_work()
                samples[name]["train_step_s"].append(time_train_step(runners[name], optimizers[name], batch))
                system_after, faults_after = kernel_work()
                samples[name]["train_step_sys_s"].append(system_after - system_before)
                samples[name]["train_step_page_faults"].append(faults_after - faults_before)
            model.eval()
            if "prefill" in timed:
                samples[name]["prefill_s"].append(time_prefill(runners[name], prompt))
            if "decode" in timed:
                samples[name]["decode_token_s"].append(decode(model, prompt, args.decode_tokens))

    results = {}
    for name in names:
        model = models[name]
        model.train()
        results[name] = {key: statistics.median(values) for key, values in samples[name].items()}
        results[name].update(first[name] if args.compile else {})
        if "train" in timed and not args.compile:  # saved-tensor hooks do not see what a compiled graph keeps
            results[name]["saved_activation_mib"] = saved_activation_bytes(model, batch) / 2**20
        if device.type == "cuda":  # of the models timed: the compiled ones under --compile
            runner = runners[name]
            if "train" in timed:
                train_step = lambda: time_train_step(runner, optimizers[name], batch)  # noqa: E731
                results[name]["peak_cuda_train_mib"] = peak_cuda_mib(train_step)
            model.eval()
            if "prefill" in timed:
                results[name]["peak_cuda_prefill_mib"] = peak_cuda_mib(lambda: time_prefill(runner, prompt))
        elif not args.no_rss:
            if "train" in timed:
                results[name]["peak_rss_train_mib"] = peak_rss_subprocess(name, args.shape, "train", args.batch,
                                                                          args.seq)
            if "prefill" in timed:
                results[name]["peak_rss_prefill_mib"] = peak_rss_subprocess(name, args.shape, "prefill", 1, args.seq)
        results[name]["parameters"] = sum(p.numel() for p in model.parameters())
    if not args.no_dtype_activations and device.type == "cpu" and "train" in timed:
        for name, figures in saved_activations_by_dtype(shape, names).items():
            results[name].update(figures)

    metrics = [key for key in results[names[0]] if key != "parameters"]
    width = {name: max(14, len(name) + 2) for name in names}  # columns fit names such as dar-block@two_phase
    ratio_width = {name: max(18, len(name) + 8) for name in names}
    header = f"{'metric':<24}" + "".join(f"{name:>{width[name]}}" for name in names) + "".join(
        f"{name + '/llama':>{ratio_width[name]}}" for name in names if name != "llama"
    )
    print(header)
    for metric in metrics:
        row = f"{metric:<24}" + "".join(f"{results[name][metric]:>{width[name]}.4f}" for name in names)
        if "llama" in results:
            row += "".join(
                f"{results[name][metric] / results['llama'][metric]:>{ratio_width[name] - 1}.3f}x"
                if results["llama"][metric] else f"{'-':>{ratio_width[name]}}"  # no system time (a GPU step)
                for name in names if name != "llama"
            )
        print(row)
    paired = paired_ratios(samples, [TIMED_METRICS[metric][0] for metric in timed])
    if paired:
        print(f"paired ratios to llama over {args.repeats} repeats: median [quartiles]")
        for name, by_metric in paired.items():
            for metric, figures in by_metric.items():
                print(f"  {name:<22}{metric:<18}{figures['median']:.3f}x [{figures['q1']:.3f}x, {figures['q3']:.3f}x]")

    args.output.parent.mkdir(parents=True, exist_ok=True)
    record = {
        "shape": args.shape, "dims": shape, "compile": args.compile, "batch": args.batch, "seq": args.seq,
        "repeats": args.repeats, "clock": args.clock,
        "threads": torch.get_num_threads(), "torch": torch.__version__,
        "machine": platform.processor() or platform.machine(),
        "device": torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu",
        "block_sizes": block_sizes, "results": results, "samples": samples, "paired_ratios": paired,
    }
    args.output.write_text(json.dumps(record, indent=2))
    print(f"wrote {args.output}")


if __name__ == "__main__":
    main()
