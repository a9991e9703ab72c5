# SPDX-License-Identifier: Apache-2.0
"""bf16 training with the history in the model dtype against the float32 state (`dar_history_dtype`, issue 16 item 6).

Two runs of one small Block DAR model on the Debian-documentation corpus (`scripts/prepare_corpus.py`), same seed,
same initial weights, same batches in the same order; only `dar_history_dtype` differs:

  float32   the committed entries in float32 (DESIGN.md section 4's precision policy, the default)
  model     the committed entries in bf16 (the model dtype); partial, statistics and mixing still float32

The model is stored and run in bf16 (DAR parameters float32, as `from_pretrained(dtype=torch.bfloat16)` keeps them),
with float32 master weights for AdamW (as FSDP's mixed precision or DeepSpeed's bf16 mode train): so the embedding
arrives in bf16, and "model" stores bf16 entries. Under plain autocast with float32 weights the model dtype is
float32 and the two settings are the same computation.

A byte-level BPE (4096 tokens) is trained on the first 2 MB of the training split; the training text is packed into
blocks of --sequence-length tokens and drawn in a seeded order; the validation loss is the mean over --eval-blocks
held-out blocks. Each run uses one thread; both run at once.

    python experiments/history_dtype_loss.py                      # both runs, then the table -> results JSON
    python experiments/history_dtype_loss.py --steps 20           # smoke run
"""

import argparse
import json
import math
import os
import statistics
import sys
import time
from concurrent.futures import ProcessPoolExecutor
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
VARIANTS = ("float32", "model")


def parse_arguments(argv=None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--corpus-dir", type=Path, default=REPO / "data" / "corpus")
    parser.add_argument("--output", type=Path, default=REPO / "experiments" / "results" / "history_dtype.json")
    parser.add_argument("--steps", type=int, default=500)
    parser.add_argument("--batch-size", type=int, default=4)
    parser.add_argument("--sequence-length", type=int, default=128)
    parser.add_argument("--learning-rate", type=float, default=3e-3)
    parser.add_argument("--eval-blocks", type=int, default=64)
    parser.add_argument("--seed", type=int, default=0)
    return parser.parse_args(argv)


def tokenizer_and_blocks(corpus_dir: Path, sequence_length: int):
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    train_text = (corpus_dir / "train.txt").read_text()
    validation_text = (corpus_dir / "validation.txt").read_text()
    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=4096, initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
                                  show_progress=False)
    tokenizer.train_from_iterator([train_text[:2_000_000]], trainer=trainer)

    def blocks(text):
        ids = [token for document in text.split("\n\n") for token in tokenizer.encode(document).ids]
        usable = len(ids) // sequence_length * sequence_length
        return ids[:usable], tokenizer.get_vocab_size()

    return blocks(train_text[:4_000_000]), blocks(validation_text)


def train(variant: str, arguments: argparse.Namespace) -> dict:
    os.environ["OMP_NUM_THREADS"] = "1"
    import torch

    sys.path.insert(0, str(REPO / "src"))
    from dar_transformers import DARConfig, DARForCausalLM

    torch.set_num_threads(1)
    (train_ids, vocab_size), (validation_ids, _) = tokenizer_and_blocks(arguments.corpus_dir, arguments.sequence_length)
    train_blocks = torch.tensor(train_ids).view(-1, arguments.sequence_length)
    validation_blocks = torch.tensor(validation_ids).view(-1, arguments.sequence_length)[: arguments.eval_blocks]

    torch.manual_seed(arguments.seed)
    config = DARConfig(
        vocab_size=vocab_size, hidden_size=128, intermediate_size=352, num_hidden_layers=8, num_attention_heads=4,
        num_key_value_heads=2, max_position_embeddings=arguments.sequence_length, dar_block_size=2,
        dar_history_dtype=variant, dar_implementation="two_phase", tie_word_embeddings=True,
    )  # M = 16 branches, K = 2: 8 blocks
    model = DARForCausalLM(config)
    masters = [parameter.detach().clone().float() for parameter in model.parameters()]  # float32 master weights
    model.to(torch.bfloat16)
    for name, module in model.named_modules():  # DAR parameters stay float32 (`_keep_in_fp32_modules_strict`)
        if name.endswith(("attn_residual", "mlp_residual", "final_readout")):
            module.float()
    for master in masters:
        master.requires_grad_(True)
    optimizer = torch.optim.AdamW(masters, lr=arguments.learning_rate, weight_decay=0.0, betas=(0.9, 0.95))
    warmup = 20
    schedule = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda step: min(1.0, (step + 1) / warmup) * 0.5 * (
        1 + math.cos(math.pi * min(step, arguments.steps) / arguments.steps)))
    order = torch.randperm(len(train_blocks), generator=torch.Generator().manual_seed(arguments.seed))

    losses, started = [], time.time()
    model.train()
    for step in range(arguments.steps):
        indices = order[(step * arguments.batch_size + torch.arange(arguments.batch_size)) % len(order)]
        batch = train_blocks[indices]
        loss = model(batch, labels=batch).loss
        loss.backward()
        for master, parameter in zip(masters, model.parameters()):
            master.grad = parameter.grad.float()
            parameter.grad = None
        torch.nn.utils.clip_grad_norm_(masters, 1.0)
        optimizer.step()
        schedule.step()
        optimizer.zero_grad(set_to_none=True)
        with torch.no_grad():
            for master, parameter in zip(masters, model.parameters()):
                parameter.copy_(master)
        losses.append(loss.item())
        if step % 50 == 0:
            print(f"{variant}: step {step} loss {loss.item():.4f} ({time.time() - started:.0f} s)", flush=True)
    model.eval()
    with torch.no_grad():
        validation = sum(model(block[None], labels=block[None]).loss.item() for block in validation_blocks)
    history_dtypes = sorted({str(tensor.dtype) for tensor in model.model.initial_state(
        model.model.embed_tokens(train_blocks[:1]))[3:]})
    return {"variant": variant, "train_losses": losses, "validation_loss": validation / len(validation_blocks),
            "history_dtypes": history_dtypes, "seconds": time.time() - started, "config": config.to_diff_dict()}


def moving_average(values, window=20):
    return [sum(values[max(0, i - window + 1) : i + 1]) / (i + 1 - max(0, i - window + 1)) for i in range(len(values))]


def main(argv=None):
    arguments = parse_arguments(argv)
    if not (arguments.corpus_dir / "train.txt").is_file():
        raise SystemExit(f"no corpus at {arguments.corpus_dir}: run `python scripts/prepare_corpus.py` first")
    with ProcessPoolExecutor(len(VARIANTS)) as pool:
        runs = dict(zip(VARIANTS, pool.map(train, VARIANTS, [arguments] * len(VARIANTS))))
    float32, model = runs["float32"]["train_losses"], runs["model"]["train_losses"]
    gaps = [abs(a - b) for a, b in zip(float32, model)]
    smoothed_gaps = [abs(a - b) for a, b in zip(moving_average(float32), moving_average(model))]
    summary = {
        "steps": arguments.steps,
        "final_train_loss_mean_last_20": {
            name: statistics.mean(run["train_losses"][-20:]) for name, run in runs.items()
        },
        "validation_loss": {name: run["validation_loss"] for name, run in runs.items()},
        "max_gap_per_step": max(gaps),
        "max_gap_per_step_at": gaps.index(max(gaps)),
        "max_gap_20_step_average": max(smoothed_gaps),
        "history_dtypes": {name: run["history_dtypes"] for name, run in runs.items()},
        "seconds": {name: run["seconds"] for name, run in runs.items()},
    }
    print(json.dumps(summary, indent=1))
    arguments.output.parent.mkdir(parents=True, exist_ok=True)
    arguments.output.write_text(json.dumps({"summary": summary, "runs": runs}, indent=1))


if __name__ == "__main__":
    main()
