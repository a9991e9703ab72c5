# SPDX-License-Identifier: Apache-2.0
"""`dar convert` at scale: peak memory and time of a streamed conversion of a synthetic 1B-8B Llama checkpoint.

Writes a random bf16 Llama checkpoint of a real model's shape without building a model (tensor by tensor, in row
chunks, sharded as `save_pretrained` shards it), plus a small BPE tokenizer with a chat template trained locally, then
runs `dar convert SOURCE OUTPUT` (defaults: dtype auto = bf16, block size about 8 blocks, layer-streamed verification
in float32) in a subprocess while sampling its /proc status (VmRSS, VmHWM, RssFile, RssAnon: file-backed pages of
mapped files count). Prints the peak RSS, the wall time and the verification table, and removes what it wrote.

    python benchmarks/convert_scale.py --shape tinyllama-1.1b            # 2.2 GB source
    python benchmarks/convert_scale.py --shape llama-3-8b --workdir /tmp  # 16 GB source; needs about 35 GB of disk
"""

import argparse
import json
import math
import os
import resource
import shutil
import struct
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

import torch

SHAPES = {
    "tinyllama-1.1b": dict(hidden_size=2048, num_hidden_layers=22, intermediate_size=5632, num_attention_heads=32,
                           num_key_value_heads=4, vocab_size=32000, tie_word_embeddings=False, shard="1GB"),
    "llama-3-8b": dict(hidden_size=4096, num_hidden_layers=32, intermediate_size=14336, num_attention_heads=32,
                       num_key_value_heads=8, vocab_size=128256, tie_word_embeddings=False, rope_theta=500000.0,
                       shard="5GB"),
    "tiny": dict(hidden_size=64, num_hidden_layers=4, intermediate_size=128, num_attention_heads=4,
                 num_key_value_heads=2, vocab_size=1024, tie_word_embeddings=False, shard="100KB"),
}
CHAT_TEMPLATE = (
    "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)


def write_tokenizer(folder: Path) -> None:
    """A byte-level BPE tokenizer (1000 tokens, every id below the model's vocabulary) with a chat template."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    from dar_transformers.convert import DEFAULT_PROMPTS

    tokenizer = Tokenizer(models.BPE(unk_token="<unk>"))
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=1000, special_tokens=["<unk>", "<s>", "</s>", "<|im_start|>", "<|im_end|>"],
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tokenizer.train_from_iterator(list(DEFAULT_PROMPTS) * 4, trainer)
    PreTrainedTokenizerFast(tokenizer_object=tokenizer, bos_token="<s>", eos_token="</s>", unk_token="<unk>",
                            chat_template=CHAT_TEMPLATE).save_pretrained(folder)


def write_synthetic_checkpoint(folder: Path, shape: dict, seed: int = 0) -> int:
    """A random bf16 Llama of `shape` as sharded safetensors, one tensor (in row chunks) at a time; returns bytes."""
    from transformers import LlamaConfig, LlamaForCausalLM
    from transformers.utils.hub import convert_file_size_to_int

    fields = {key: value for key, value in shape.items() if key not in ("shard", "rope_theta")}
    if "rope_theta" in shape:
        fields["rope_parameters"] = {"rope_type": "default", "rope_theta": shape["rope_theta"]}
    config = LlamaConfig(**fields, bos_token_id=1, eos_token_id=2, max_position_embeddings=4096)
    config.dtype = torch.bfloat16
    folder.mkdir(parents=True)
    config.save_pretrained(folder)
    with torch.device("meta"):
        names = {name: tuple(tensor.shape) for name, tensor in LlamaForCausalLM(config).state_dict().items()}
    max_bytes = convert_file_size_to_int(shape["shard"])
    shards, current, size = [], [], 0
    for name, tensor_shape in names.items():
        nbytes = math.prod(tensor_shape) * 2
        if current and size + nbytes > max_bytes:
            shards.append(current)
            current, size = [], 0
        current.append(name)
        size += nbytes
    shards.append(current)
    generator = torch.Generator().manual_seed(seed)
    weight_map, total = {}, 0
    for number, shard in enumerate(shards, start=1):
        file_name = f"model-{number:05d}-of-{len(shards):05d}.safetensors"
        header, offset = {}, 0
        for name in shard:
            nbytes = math.prod(names[name]) * 2
            header[name] = {"dtype": "BF16", "shape": list(names[name]), "data_offsets": [offset, offset + nbytes]}
            offset += nbytes
            weight_map[name] = file_name
        header["__metadata__"] = {"format": "pt"}
        encoded = json.dumps(header).encode()
        encoded += b" " * (-len(encoded) % 8)
        with open(folder / file_name, "wb") as handle:
            handle.write(struct.pack("<Q", len(encoded)) + encoded)
            for name in shard:
                tensor_shape = names[name]
                rows = tensor_shape[0]
                columns = math.prod(tensor_shape[1:])
                step = max(1, 2**24 // max(columns, 1))
                for start in range(0, rows, step):
                    count = min(step, rows - start)
                    if "norm" in name:  # RMSNorm gains near 1
                        chunk = 1.0 + 0.1 * torch.randn(count, columns, generator=generator)
                    elif "embed_tokens" in name:
                        chunk = torch.randn(count, columns, generator=generator)
                    else:  # projections: std 0.02, as Llama's initializer_range
                        chunk = 0.02 * torch.randn(count, columns, generator=generator)
                    handle.write(chunk.to(torch.bfloat16).view(torch.uint8).numpy().tobytes())
        total += offset
    index = {"metadata": {"total_size": total}, "weight_map": weight_map}
    (folder / "model.safetensors.index.json").write_text(json.dumps(index, indent=2))
    write_tokenizer(folder)
    return total


def read_status(pid: int) -> dict[str, int]:
    """VmRSS, VmHWM, RssAnon, RssFile of a process in KiB (empty once it has exited)."""
    values = {}
    try:
        with open(f"/proc/{pid}/status") as handle:
            for line in handle:
                key, _, rest = line.partition(":")
                if key in ("VmRSS", "VmHWM", "RssAnon", "RssFile"):
                    values[key] = int(rest.split()[0])
    except (FileNotFoundError, ProcessLookupError):
        pass
    return values


def run_monitored(command: list[str], interval: float = 0.1) -> dict:
    """Run `command`, sampling its /proc status every `interval` s; the peak is the largest VmHWM seen, checked
    against the kernel's ru_maxrss of the child after it exits."""
    start = time.perf_counter()
    process = subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    peaks = {"VmRSS": 0, "VmHWM": 0, "RssAnon": 0, "RssFile": 0}
    output: list[str] = []
    reader = threading.Thread(target=lambda: output.extend(process.stdout), daemon=True)
    reader.start()
    while process.poll() is None:
        for key, value in read_status(process.pid).items():
            peaks[key] = max(peaks[key], value)
        time.sleep(interval)
    reader.join()
    wall = time.perf_counter() - start
    maxrss = resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss  # KiB, largest child so far
    return dict(returncode=process.returncode, wall_s=wall, peak_kib=max(peaks["VmHWM"], maxrss),
                peaks_kib=peaks, ru_maxrss_kib=maxrss, output="".join(output))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--shape", choices=sorted(SHAPES), default="tinyllama-1.1b")
    parser.add_argument("--workdir", type=Path, default=None, help="where the source and output go (default: a "
                        "temporary folder under /tmp); removed afterwards unless --keep")
    parser.add_argument("--keep", action="store_true")
    parser.add_argument("--threads", type=int, default=None, help="OMP_NUM_THREADS of the conversion")
    parser.add_argument("convert_args", nargs="*", help="extra `dar convert` options (after --)")
    args = parser.parse_args()

    if args.workdir is not None:
        if args.workdir.exists() and not args.workdir.is_dir():
            parser.error(f"--workdir {args.workdir} is not a folder")
        args.workdir.mkdir(parents=True, exist_ok=True)  # the run's own temporary folder goes inside it
    workdir = Path(tempfile.mkdtemp(prefix="dar-scale-", dir=args.workdir))
    try:
        source, output = workdir / f"{args.shape}-bf16", workdir / f"{args.shape}-dar"
        begin = time.perf_counter()
        total = write_synthetic_checkpoint(source, SHAPES[args.shape])
        print(f"Wrote a synthetic bf16 {args.shape} checkpoint: {total / 1e9:.2f} GB in "
              f"{time.perf_counter() - begin:.0f} s ({source})", flush=True)
        command = [sys.executable, "-m", "dar_transformers.cli", "convert", str(source), str(output),
                   *args.convert_args]
        if args.threads:
            os.environ["OMP_NUM_THREADS"] = str(args.threads)
        os.environ.setdefault("TQDM_DISABLE", "1")
        print("$ dar convert " + " ".join(command[4:]), flush=True)
        result = run_monitored(command)
        print(result["output"][-6000:])
        written = sum(path.stat().st_size for path in output.glob("*.safetensors")) if output.exists() else 0
        peaks = result["peaks_kib"]
        print(f"exit code {result['returncode']}; wall time {result['wall_s']:.0f} s "
              f"({result['wall_s'] / 60:.1f} min); peak RSS {result['peak_kib'] / 2**20:.2f} GiB "
              f"({result['peak_kib'] * 1024 / 1e9:.2f} GB; sampled VmHWM {peaks['VmHWM'] / 2**20:.2f} GiB, "
              f"RssAnon {peaks['RssAnon'] / 2**20:.2f} GiB, RssFile {peaks['RssFile'] / 2**20:.2f} GiB, "
              f"ru_maxrss {result['ru_maxrss_kib'] / 2**20:.2f} GiB); output {written / 1e9:.2f} GB; "
              f"load average {os.getloadavg()}")
        sys.exit(result["returncode"])
    finally:
        if not args.keep:
            shutil.rmtree(workdir, ignore_errors=True)


if __name__ == "__main__":
    main()
