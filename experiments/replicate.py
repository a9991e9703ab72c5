# SPDX-License-Identifier: Apache-2.0
"""Miniature replication of the DAR claims (DESIGN.md section 1): tiny models trained from scratch on real text.

Every variant is the same 6-layer, d=128 decoder (12 branches) trained on the same token budget, schedule and,
for a given seed, the same batches (paired runs); only the residual path differs:

  residual               LlamaForCausalLM (plain residual)
  attnres_full/_block    Attention Residuals: one stream, K = 1 / K = 2 (6 blocks, the config's default)
  dar_full/_block        DAR, reciprocal routing, K = 1 / K = 2
  dar_selfkv/crossv/fixedkv   routing ablations, Block form (K = 2)
  two_stream_one_block   two streams, one block over the whole depth (K = 2 * layers): no depth selection,
                         the mHC-like control

One command runs everything, resumably: a run whose key (variant, seed and its configuration: budget, learning rate,
weight decay, vocabulary, corpus; `runs.py`) is already in the results
JSONL is skipped; each finished run appends one line. Data: the corpus of scripts/prepare_corpus.py (train.jsonl,
validation.jsonl), a byte-level BPE trained on the training split, token arrays cached beside the results (by
vocabulary size and a hash of the corpus: another corpus is tokenised anew).

  python experiments/replicate.py --corpus-dir data/corpus --train-tokens 600000 --seeds 0 1 2 --jobs 2
  python experiments/summarize.py            # table, curves, docs/results/replication_summary.json

Each run uses one thread (torch.set_num_threads(1)); `--jobs` runs that many at once.
"""

import argparse
import fcntl
import hashlib
import json
import math
import os
import subprocess
import sys
import time
from datetime import datetime, timezone
from pathlib import Path

os.environ.setdefault("OMP_NUM_THREADS", "1")
os.environ.setdefault("RAYON_NUM_THREADS", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

import numpy as np  # noqa: E402
import torch  # noqa: E402
from runs import CONFIGURATION, configuration_hash, configuration_key, record_key  # noqa: E402

REPO = Path(__file__).resolve().parents[1]
RESULTS = REPO / "experiments" / "results"
END_OF_TEXT = "<|endoftext|>"

MODEL_FIELDS = dict(
    hidden_size=128,
    intermediate_size=352,
    num_hidden_layers=6,
    num_attention_heads=4,
    num_key_value_heads=4,
    max_position_embeddings=256,
    tie_word_embeddings=True,
    rms_norm_eps=1e-5,
)
BLOCK_SIZE = 2  # branches per block: 6 blocks of one decoder layer each (DARConfig's default for 12 branches)

# variant -> DARConfig fields (None: the plain LlamaForCausalLM). Data, not an if-ladder.
VARIANTS: dict[str, dict | None] = {
    "residual": None,
    "attnres_full": dict(dar_num_streams=1, dar_block_size=1),
    "attnres_block": dict(dar_num_streams=1, dar_block_size=BLOCK_SIZE),
    "dar_full": dict(dar_block_size=1),
    "dar_block": dict(dar_block_size=BLOCK_SIZE),
    "dar_selfkv": dict(dar_block_size=BLOCK_SIZE, dar_routing="selfkv"),
    "dar_crossv": dict(dar_block_size=BLOCK_SIZE, dar_routing="crossv"),
    "dar_fixedkv": dict(dar_block_size=BLOCK_SIZE, dar_routing="fixedkv"),
    "two_stream_one_block": dict(dar_block_size=2 * MODEL_FIELDS["num_hidden_layers"]),
}
# The order runs are launched in, so that a budget cut short still leaves the most useful comparisons.
MAIN_VARIANTS = ("residual", "attnres_block", "dar_block")
ABLATION_VARIANTS = ("dar_selfkv", "dar_crossv", "dar_fixedkv", "two_stream_one_block")
FULL_VARIANTS = ("attnres_full", "dar_full")


# ---------------------------------------------------------------------------------------------------------------
# Data


def corpus_tag(corpus_dir: Path) -> str:
    """A short hash of the corpus's two splits (their bytes): the token cache and every run key carry it, so that
    another corpus (or an edited one) is tokenised and trained on anew instead of reusing another's tokens and runs.
    "missing" where a split is not there (a dry run needs no corpus)."""
    digest = hashlib.sha256()
    for split in ("train", "validation"):
        try:
            with open(corpus_dir / f"{split}.jsonl", "rb") as handle:
                for chunk in iter(lambda: handle.read(1 << 24), b""):
                    digest.update(chunk)
        except FileNotFoundError:
            return "missing"
    return digest.hexdigest()[:12]


def data_cache(args: argparse.Namespace) -> Path:
    """Where the tokenizer and token arrays of this corpus and vocabulary size are cached."""
    return RESULTS / f"data-bpe{args.vocab_size}-{args.corpus_tag}"


def prepare_data(corpus_dir: Path, cache: Path, vocab_size: int) -> Path:
    """Train the BPE on the training split and cache both splits as uint16 token arrays in `cache`."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    if (cache / "validation.npy").exists():
        return cache
    cache.mkdir(parents=True, exist_ok=True)

    def documents(split: str):
        with open(corpus_dir / f"{split}.jsonl") as handle:
            for line in handle:
                yield json.loads(line)["text"]

    started = time.time()
    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size, special_tokens=[END_OF_TEXT], initial_alphabet=pre_tokenizers.ByteLevel.alphabet()
    )
    tokenizer.train_from_iterator(documents("train"), trainer=trainer)
    tokenizer.save(str(cache / "tokenizer.json"))
    end_of_text = tokenizer.token_to_id(END_OF_TEXT)
    for split in ("train", "validation"):
        ids: list[int] = []
        batch: list[str] = []
        for text in documents(split):
            batch.append(text)
            if len(batch) == 256:
                for encoding in tokenizer.encode_batch(batch):
                    ids.extend(encoding.ids + [end_of_text])
                batch = []
        for encoding in tokenizer.encode_batch(batch):
            ids.extend(encoding.ids + [end_of_text])
        np.save(cache / f"{split}.npy", np.asarray(ids, dtype=np.uint16))
        print(f"{split}: {len(ids):,} tokens", flush=True)
    print(f"tokenizer and token arrays in {cache} ({time.time() - started:.0f} s)", flush=True)
    return cache


def training_batches(train: np.ndarray, seed: int, steps: int, batch_size: int, seq_len: int):
    """The batch sequence of a seed: random windows of seq_len + 1 tokens. Identical for every variant (paired)."""
    rng = np.random.default_rng(seed)
    for _ in range(steps):
        starts = rng.integers(0, len(train) - seq_len - 1, size=batch_size)
        windows = np.stack([train[start : start + seq_len + 1] for start in starts]).astype(np.int64)
        yield torch.from_numpy(windows)


def validation_windows(validation: np.ndarray, seq_len: int, count: int) -> torch.Tensor:
    """The first `count` non-overlapping windows of the validation split: [count, seq_len + 1]."""
    count = min(count, len(validation) // (seq_len + 1))
    windows = validation[: count * (seq_len + 1)].reshape(count, seq_len + 1).astype(np.int64)
    return torch.from_numpy(windows)


# ---------------------------------------------------------------------------------------------------------------
# Models and training


def build_model(variant: str, vocab_size: int, seed: int) -> torch.nn.Module:
    from transformers import LlamaConfig, LlamaForCausalLM

    from dar_transformers import DARConfig, DARForCausalLM

    torch.manual_seed(seed)
    fields = dict(MODEL_FIELDS, vocab_size=vocab_size, bos_token_id=0, eos_token_id=0, pad_token_id=0)
    dar_fields = VARIANTS[variant]
    if dar_fields is None:
        return LlamaForCausalLM(LlamaConfig(**fields))
    return DARForCausalLM(DARConfig(**fields, **dar_fields))


def is_dar_parameter(name: str) -> bool:
    return any(part in ("attn_residual", "mlp_residual", "final_readout") for part in name.split("."))


def optimizer_for(model: torch.nn.Module, lr: float, weight_decay: float) -> torch.optim.Optimizer:
    """AdamW; weight decay only on the branch matrices (not embeddings, norms or DAR parameters: DESIGN.md 4)."""
    decayed, kept = [], []
    for name, parameter in model.named_parameters():
        if parameter.ndim >= 2 and "embed_tokens" not in name and not is_dar_parameter(name):
            decayed.append(parameter)
        else:
            kept.append(parameter)
    groups = [{"params": decayed, "weight_decay": weight_decay}, {"params": kept, "weight_decay": 0.0}]
    return torch.optim.AdamW(groups, lr=lr, betas=(0.9, 0.95), eps=1e-8)


def learning_rate(step: int, steps: int, peak: float, warmup: int) -> float:
    """Linear warm-up, then cosine decay to 10% of the peak."""
    if step < warmup:
        return peak * (step + 1) / warmup
    progress = (step - warmup) / max(1, steps - warmup)
    return peak * (0.1 + 0.9 * 0.5 * (1.0 + math.cos(math.pi * progress)))


@torch.no_grad()
def evaluate(model: torch.nn.Module, windows: torch.Tensor, batch_size: int) -> float:
    """Mean next-token cross-entropy (nats) over all predicted tokens of the windows."""
    model.eval()
    total, count = 0.0, 0
    for start in range(0, len(windows), batch_size):
        batch = windows[start : start + batch_size]
        logits = model(input_ids=batch[:, :-1]).logits
        loss = torch.nn.functional.cross_entropy(
            logits.reshape(-1, logits.shape[-1]).float(), batch[:, 1:].reshape(-1), reduction="sum"
        )
        total += loss.item()
        count += batch[:, 1:].numel()
    model.train()
    return total / count


def configuration_of(args: argparse.Namespace) -> dict[str, object]:
    """The `runs.CONFIGURATION` settings of this command's runs."""
    return {name: args.corpus_tag if name == "corpus" else getattr(args, name) for name in CONFIGURATION}


def run_key(variant: str, seed: int, args: argparse.Namespace) -> str:
    """What a finished run is known by (`runs.record_key` of its record): variant, seed and every setting that makes
    its loss what it is; the key left out the vocabulary size and weight decay, so a run with another one was
    skipped as done and summarised as the earlier one."""
    return f"{variant}/seed{seed}/{configuration_key(configuration_of(args))}"


def train_one(variant: str, seed: int, args: argparse.Namespace) -> dict:
    torch.set_num_threads(1)
    cache = data_cache(args)
    train = np.load(cache / "train.npy", mmap_mode="r")
    validation = np.load(cache / "validation.npy", mmap_mode="r")
    final_windows = validation_windows(validation, args.seq_len, args.val_windows)
    curve_windows = final_windows[: args.curve_windows]

    model = build_model(variant, args.vocab_size, seed)
    model.train()
    parameters = sum(p.numel() for p in model.parameters())
    embedding = model.get_input_embeddings().weight.numel()
    optimizer = optimizer_for(model, args.lr, args.weight_decay)
    steps = args.train_tokens // (args.batch_size * args.seq_len)
    warmup = max(1, int(0.05 * steps))
    eval_every = max(1, steps // args.curve_points)

    curve, smoothed, train_seconds, completed = [], None, 0.0, 0
    started = time.time()
    for step, batch in enumerate(training_batches(train, seed, steps, args.batch_size, args.seq_len)):
        step_started = time.time()
        for group in optimizer.param_groups:
            group["lr"] = learning_rate(step, steps, args.lr, warmup)
        loss = model(input_ids=batch[:, :-1], labels=batch[:, :-1]).loss  # HF shifts labels inside
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        train_seconds += time.time() - step_started
        smoothed = loss.item() if smoothed is None else 0.9 * smoothed + 0.1 * loss.item()
        if not math.isfinite(loss.item()):  # the record says where it stopped (it gave the planned steps)
            break
        completed = step + 1
        if (step + 1) % eval_every == 0 and step + 1 < steps:
            tokens = (step + 1) * args.batch_size * args.seq_len
            curve.append({"step": step + 1, "tokens": tokens, "train_loss_ema": smoothed,
                          "val_loss": evaluate(model, curve_windows, args.eval_batch_size)})
    tokens = completed * args.batch_size * args.seq_len
    final = evaluate(model, final_windows, args.eval_batch_size)
    curve.append({"step": completed, "tokens": tokens, "train_loss_ema": smoothed,
                  "val_loss": evaluate(model, curve_windows, args.eval_batch_size)})

    if f"{variant}/{seed}" in args.save_checkpoints:
        save_checkpoint(model, variant, seed, args)
    return {
        "key": run_key(variant, seed, args),
        "variant": variant,
        "seed": seed,
        "corpus": args.corpus_tag,
        "requested_train_tokens": args.train_tokens,
        "train_tokens": tokens,
        "steps": completed,
        "planned_steps": steps,
        "batch_size": args.batch_size,
        "seq_len": args.seq_len,
        "lr": args.lr,
        "weight_decay": args.weight_decay,
        "vocab_size": args.vocab_size,
        "model_fields": MODEL_FIELDS,
        "dar_fields": VARIANTS[variant],
        "parameters": parameters,
        "non_embedding_parameters": parameters - embedding,
        "val_loss": final,
        "val_tokens": int(final_windows[:, 1:].numel()),
        "curve_val_tokens": int(curve_windows[:, 1:].numel()),
        "curve": curve,
        "train_tokens_per_second": tokens / train_seconds,
        "wall_seconds": time.time() - started,
        "finished": datetime.now(timezone.utc).isoformat(timespec="seconds"),
        "git_commit": _git_commit(),
        "torch": torch.__version__,
    }


def save_checkpoint(model: torch.nn.Module, variant: str, seed: int, args: argparse.Namespace) -> None:
    from transformers import PreTrainedTokenizerFast

    # The configuration's hash too: runs of another learning rate, vocabulary or corpus overwrote each other's folder.
    directory = (RESULTS / "checkpoints" /
                 f"{variant}-seed{seed}-tok{args.train_tokens}-{configuration_hash(configuration_of(args))}")
    model.save_pretrained(directory)
    tokenizer = PreTrainedTokenizerFast(
        tokenizer_file=str(data_cache(args) / "tokenizer.json"),
        eos_token=END_OF_TEXT, bos_token=END_OF_TEXT, pad_token=END_OF_TEXT,
    )
    tokenizer.save_pretrained(directory)


def _git_commit() -> str:
    try:
        return subprocess.run(["git", "rev-parse", "HEAD"], cwd=REPO, capture_output=True, text=True).stdout.strip()
    except OSError:
        return "unknown"


def append_result(path: Path, record: dict) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path, "a") as handle:
        fcntl.flock(handle, fcntl.LOCK_EX)
        handle.write(json.dumps(record) + "\n")
        fcntl.flock(handle, fcntl.LOCK_UN)


def finished_keys(path: Path) -> set[str]:
    """The keys of the runs in the results JSONL, rebuilt from each record (`runs.record_key`): a record of an earlier
    version of the key counts as done under the key it has now."""
    if not path.exists():
        return set()
    return {record_key(json.loads(line)) for line in path.read_text().splitlines() if line.strip()}


# ---------------------------------------------------------------------------------------------------------------
# Orchestration


def planned_runs(args: argparse.Namespace) -> list[tuple[str, int]]:
    """Main variants at the first seed, the ablations, the main variants' other seeds, then the Full variants."""
    chosen = [variant for variant in VARIANTS if variant in args.variants]
    first, rest = args.seeds[0], args.seeds[1:]
    plan = [(v, first) for v in MAIN_VARIANTS + ABLATION_VARIANTS if v in chosen]
    plan += [(v, seed) for seed in rest for v in MAIN_VARIANTS if v in chosen]
    plan += [(v, first) for v in FULL_VARIANTS if v in chosen]
    if args.all_seeds:
        plan += [(v, seed) for seed in rest for v in ABLATION_VARIANTS if v in chosen]
        plan += [(v, seed) for seed in rest for v in FULL_VARIANTS if v in chosen]
    return plan


def worker_command(variant: str, seed: int, argv: list[str]) -> list[str]:
    return [sys.executable, __file__, *argv, "--run-one", f"{variant}/{seed}"]


def main(argv: list[str] | None = None) -> None:
    argv = sys.argv[1:] if argv is None else argv
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--corpus-dir", type=Path, default=REPO / "data" / "corpus")
    parser.add_argument("--results", type=Path, default=RESULTS / "replication.jsonl")
    parser.add_argument("--vocab-size", type=int, default=4096)
    parser.add_argument("--train-tokens", type=int, default=600_000)
    parser.add_argument("--batch-size", type=int, default=8)
    parser.add_argument("--seq-len", type=int, default=256)
    parser.add_argument("--lr", type=float, default=2e-3)
    parser.add_argument("--weight-decay", type=float, default=0.1)
    parser.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2])
    parser.add_argument("--all-seeds", action="store_true", help="every variant at every seed (default: main three)")
    parser.add_argument("--variants", nargs="+", default=list(VARIANTS), choices=list(VARIANTS))
    parser.add_argument("--val-windows", type=int, default=128, help="final validation: windows of seq_len tokens")
    parser.add_argument("--curve-windows", type=int, default=24, help="validation windows for the loss curve")
    parser.add_argument("--curve-points", type=int, default=10)
    parser.add_argument("--eval-batch-size", type=int, default=16)
    parser.add_argument("--jobs", type=int, default=2, help="runs at once (each on one thread)")
    parser.add_argument("--save-checkpoints", nargs="*", default=["dar_block/0", "dar_full/0"],
                        help="variant/seed pairs whose trained model is saved under experiments/results/checkpoints")
    parser.add_argument("--dry-run", action="store_true", help="print the plan and exit")
    parser.add_argument("--run-one", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    args.corpus_tag = corpus_tag(args.corpus_dir)

    if args.run_one:
        variant, seed = args.run_one.split("/")
        record = train_one(variant, int(seed), args)
        append_result(args.results, record)
        print(f"{record['key']}: val_loss {record['val_loss']:.4f}, {record['train_tokens_per_second']:.0f} tok/s, "
              f"{record['wall_seconds']:.0f} s", flush=True)
        return

    done = finished_keys(args.results)
    todo = [(v, s) for v, s in planned_runs(args) if run_key(v, s, args) not in done]
    print(f"{len(todo)} runs to do ({len(done)} keys already in {args.results})", flush=True)
    for variant, seed in todo:
        print(f"  {run_key(variant, seed, args)}", flush=True)
    if args.dry_run:
        return
    if args.corpus_tag == "missing":
        raise SystemExit(f"replicate.py: error: {args.corpus_dir} has no train.jsonl and validation.jsonl (make them "
                         "with scripts/prepare_corpus.py).")
    prepare_data(args.corpus_dir, data_cache(args), args.vocab_size)
    forwarded = [a for a in argv if a != "--dry-run"]
    running: list[tuple[subprocess.Popen, str]] = []
    while todo or running:
        while todo and len(running) < args.jobs:
            variant, seed = todo.pop(0)
            print(f"{datetime.now(timezone.utc):%H:%M:%S} start {variant}/{seed}", flush=True)
            running.append((subprocess.Popen(worker_command(variant, seed, forwarded)), f"{variant}/{seed}"))
        time.sleep(2)
        for process, name in list(running):
            if process.poll() is not None:
                running.remove((process, name))
                print(f"{datetime.now(timezone.utc):%H:%M:%S} end {name} (exit {process.returncode})", flush=True)


if __name__ == "__main__":
    main()
