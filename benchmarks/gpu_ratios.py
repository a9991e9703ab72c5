# SPDX-License-Identifier: Apache-2.0
"""DAR / Llama ratios on a GPU in bf16, for the bytes on paper (issue 16 item 6): what `bytes_on_paper.py` projects,
measured side by side in one run.

Models per shape, one config, weights in bf16 (DAR parameters float32, as `from_pretrained(dtype=bfloat16)` keeps
them): Llama, Block DAR (about 8 blocks) with the float32 state, Block DAR with `dar_history_dtype="model"`.
Measured, interleaved (Llama, DAR, DAR model-history, Llama, ...), medians of --repeats:
  - train step: forward + backward + AdamW step on [batch, seq] random tokens with labels;
  - decode: per-token time of greedy `generate` with the KV cache after a prompt of --prompt tokens (default
    --seq, the context `bytes_on_paper.py --context` projects at), at batch 1 and at --decode-batch;
  - saved activations: bytes autograd keeps in one training forward (deduplicated by storage, parameters left out,
    as `overhead.py` counts them);
  - peak CUDA memory of one training step above what was allocated before it (all three models' weights and the
    optimiser states of the models warmed up so far stay on the device, and are not the step's).
Shapes: SmolLM2-135M and Llama-3.2-1B (vocabulary kept; random weights, nothing downloaded). The table and --output
are written after each shape, so that a run stopped in the second keeps the first.

    python benchmarks/gpu_ratios.py --output benchmarks/results/gpu_ratios.json   # about 5 minutes on an H100
"""

import argparse
import json
import statistics
import time

import torch
from transformers import LlamaConfig, LlamaForCausalLM

from dar_transformers import DARConfig, DARForCausalLM

SHAPES = {
    "SmolLM2-135M": dict(hidden_size=576, intermediate_size=1536, num_hidden_layers=30, num_attention_heads=9,
                         num_key_value_heads=3, vocab_size=49152, tie_word_embeddings=True, rms_norm_eps=1e-5),
    "Llama-3.2-1B": dict(hidden_size=2048, intermediate_size=8192, num_hidden_layers=16, num_attention_heads=32,
                         num_key_value_heads=8, vocab_size=128256, tie_word_embeddings=True, rms_norm_eps=1e-5),
    "tiny": dict(hidden_size=64, intermediate_size=128, num_hidden_layers=4, num_attention_heads=4,
                 num_key_value_heads=2, vocab_size=256, tie_word_embeddings=True),  # a CPU smoke run
}
MODELS = ("llama", "dar", "dar-model-history")


def build(name: str, shape: dict, device) -> torch.nn.Module:
    torch.manual_seed(0)
    if name == "llama":
        model = LlamaForCausalLM(LlamaConfig(**shape))
    else:
        history = "model" if name == "dar-model-history" else "float32"
        model = DARForCausalLM(DARConfig(**shape, dar_history_dtype=history, dar_implementation="two_phase"))
    model = model.to(device=device, dtype=torch.bfloat16)
    for module_name, module in model.named_modules():  # DAR parameters stay float32
        if module_name.endswith(("attn_residual", "mlp_residual", "final_readout")):
            module.float()
    return model


def synchronize(device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def timed(function, device) -> float:
    synchronize(device)
    start = time.perf_counter()
    function()
    synchronize(device)
    return time.perf_counter() - start


def train_step(model, optimizer, batch):
    model(input_ids=batch, labels=batch).loss.backward()
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)


def saved_bytes(model, batch) -> int:
    saved = {}

    def pack(tensor):
        saved[tensor.untyped_storage().data_ptr()] = tensor.untyped_storage().nbytes()
        return tensor

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda tensor: tensor):
        loss = model(input_ids=batch, labels=batch).loss
    del loss
    parameters = {parameter.untyped_storage().data_ptr() for parameter in model.parameters()}
    return sum(size for pointer, size in saved.items() if pointer not in parameters)


def decode_per_token(model, prompt, new_tokens: int) -> float:
    def run(tokens):
        return lambda: model.generate(prompt, max_new_tokens=tokens, min_new_tokens=tokens, do_sample=False,
                                      pad_token_id=0)

    long, short = timed(run(new_tokens + 1), prompt.device), timed(run(1), prompt.device)
    return (long - short) / new_tokens  # the prompt's prefill cancels


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--shapes", nargs="+", default=["SmolLM2-135M", "Llama-3.2-1B"], choices=list(SHAPES))
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--seq", type=int, default=1024)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--decode-batch", type=int, default=32)
    parser.add_argument("--new-tokens", type=int, default=32)
    parser.add_argument("--prompt", type=int, default=None, help="decode prompt length (default: --seq)")
    parser.add_argument("--output", default=None)
    arguments = parser.parse_args()
    device = torch.device(arguments.device)
    cuda = device.type == "cuda"
    results = {}
    for shape_name in arguments.shapes:
        shape = SHAPES[shape_name]
        generator = torch.Generator().manual_seed(0)
        batch = torch.randint(0, shape["vocab_size"], (arguments.batch, arguments.seq), generator=generator).to(device)
        prompt_length = arguments.prompt or arguments.seq
        prompts = {size: torch.randint(3, shape["vocab_size"], (size, prompt_length), generator=generator).to(device)
                   for size in (1, arguments.decode_batch)}
        models = {name: build(name, shape, device) for name in MODELS}
        optimizers = {name: torch.optim.AdamW(model.parameters(), lr=1e-5) for name, model in models.items()}
        record = {name: dict(train_step_s=[], decode_1_s=[], decode_batch_s=[]) for name in MODELS}
        for name, model in models.items():  # warm-up, memory
            model.train()
            train_step(model, optimizers[name], batch)
            before = 0
            if cuda:
                torch.cuda.reset_peak_memory_stats(device)
                before = torch.cuda.memory_allocated(device)
            train_step(model, optimizers[name], batch)
            record[name]["peak_train_mib"] = (
                (torch.cuda.max_memory_allocated(device) - before) / 2**20 if cuda else float("nan"))
            record[name]["saved_activations_mib"] = saved_bytes(model, batch) / 2**20
        for _ in range(arguments.repeats):
            for name, model in models.items():  # interleaved
                model.train()
                record[name]["train_step_s"].append(timed(lambda: train_step(model, optimizers[name], batch), device))
                model.eval()
                with torch.no_grad():
                    record[name]["decode_1_s"].append(decode_per_token(model, prompts[1], arguments.new_tokens))
                    record[name]["decode_batch_s"].append(
                        decode_per_token(model, prompts[arguments.decode_batch], arguments.new_tokens))
        results[shape_name] = {name: {metric: statistics.median(values) if isinstance(values, list) else values
                                      for metric, values in metrics.items()} for name, metrics in record.items()}
        del models, optimizers
        if cuda:
            torch.cuda.empty_cache()
        report(results, arguments, device)


def report(results: dict, arguments, device) -> None:
    """Print the table of the shapes measured so far and write them to --output (after each shape)."""
    device_name = torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu"
    print(f"device: {device_name}; bf16; train batch {arguments.batch} x {arguments.seq}; decode batch 1 and "
          f"{arguments.decode_batch} after {arguments.prompt or arguments.seq} prompt tokens\n")
    print("| shape | metric | Llama | DAR (float32 state) / Llama | DAR (model-dtype history) / Llama |")
    print("|---|---|---:|---:|---:|")
    for shape_name, by_model in results.items():
        for metric in ("train_step_s", "decode_1_s", "decode_batch_s", "saved_activations_mib", "peak_train_mib"):
            llama = by_model["llama"][metric]
            ratios = " | ".join(f"{by_model[name][metric] / llama:.3f}x" for name in MODELS[1:])
            print(f"| {shape_name} | {metric} | {llama:.4g} | {ratios} |", flush=True)
    if arguments.output:
        with open(arguments.output, "w") as handle:
            json.dump(dict(device=device_name, arguments=vars(arguments), results=results), handle, indent=1)


if __name__ == "__main__":
    main()
