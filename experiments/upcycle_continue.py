# SPDX-License-Identifier: Apache-2.0
"""Upcycling in practice: continue training SmolLM2-135M-Instruct and its DAR upcycle on the same tokens.

Three runs of `examples/finetune.py` on the Debian-documentation corpus (`scripts/prepare_corpus.py`), same seed,
same batches in the same order, same schedule and held-out blocks; only the model differs:

  llama              the source LlamaForCausalLM itself (`--no-upcycle`)
  dar                its Block DAR upcycle (K = 8), every parameter at the same learning rate
  dar_lr_dar_1e-3    the same upcycle, DAR's own parameters (queries, gates) at learning rate 1e-3

Step 0 is the same model in all three (the upcycle is exact), so the held-out curves start at the same loss
and any difference is what training did with DAR's extra freedom. Resumable: a run whose results.json exists is
skipped. Each run uses one thread; `--jobs 2` runs two at once on a 2-core machine.

    python experiments/upcycle_continue.py                    # all three, then the table
    python experiments/upcycle_continue.py --table            # only print the table of finished runs
    python experiments/upcycle_continue.py --table --plot docs/results/upcycle_curves.png
"""

import argparse
import json
import os
import subprocess
import sys
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
VARIANTS = {
    "llama": ["--no-upcycle"],
    "dar": [],
    "dar_lr_dar_1e-3": ["--dar-learning-rate", "1e-3"],
}


def parse_arguments() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--output-dir", type=Path, default=REPO / "experiments" / "results" / "upcycle")
    parser.add_argument("--corpus-dir", type=Path, default=REPO / "data" / "corpus")
    parser.add_argument("--variants", nargs="+", choices=list(VARIANTS), default=list(VARIANTS))
    parser.add_argument("--max-steps", type=int, default=200)
    parser.add_argument("--eval-steps", type=int, default=50)
    parser.add_argument("--batch-size", type=int, default=4)
    parser.add_argument("--sequence-length", type=int, default=128)
    parser.add_argument("--learning-rate", type=float, default=1e-4)
    parser.add_argument("--eval-blocks", type=int, default=64)
    parser.add_argument("--jobs", type=int, default=2)
    parser.add_argument("--table", action="store_true", help="print the table of finished runs and exit")
    parser.add_argument("--plot", type=Path, default=None, help="also plot the held-out curves to this PNG")
    return parser.parse_args()


def run(variant: str, arguments: argparse.Namespace) -> None:
    directory = arguments.output_dir / variant
    if (directory / "results.json").is_file():
        print(f"{variant}: done already ({directory / 'results.json'})", flush=True)
        return
    command = [
        sys.executable, str(REPO / "examples" / "finetune.py"), "--output-dir", str(directory),
        "--corpus-dir", str(arguments.corpus_dir), "--max-steps", str(arguments.max_steps),
        "--eval-steps", str(arguments.eval_steps), "--batch-size", str(arguments.batch_size),
        "--sequence-length", str(arguments.sequence_length), "--learning-rate", str(arguments.learning_rate),
        "--eval-blocks", str(arguments.eval_blocks), "--train-documents", "1000", "--eval-documents", "175",
        "--logging-steps", "25", *VARIANTS[variant],
    ]
    directory.mkdir(parents=True, exist_ok=True)
    environment = {**os.environ, "OMP_NUM_THREADS": "1", "TOKENIZERS_PARALLELISM": "false"}
    with open(directory / "log.txt", "w") as log:
        print(f"{variant}: running, log in {directory / 'log.txt'}", flush=True)
        subprocess.run(command, env=environment, stdout=log, stderr=subprocess.STDOUT, check=True, cwd=REPO)


def table(arguments: argparse.Namespace) -> str:
    rows = []
    for variant in VARIANTS:
        path = arguments.output_dir / variant / "results.json"
        if path.is_file():
            rows.append((variant, json.loads(path.read_text())))
    if not rows:
        return "no finished runs"
    steps = [step for step, _ in rows[0][1]["eval_curve"]]
    baseline = dict(rows).get("llama")
    lines = ["| run | tokens | " + " | ".join(f"held-out loss @ {step}" for step in steps)
             + " | vs llama at the end % | runtime s |", "|---" * (len(steps) + 4) + "|"]
    for variant, result in rows:
        losses = [loss for _, loss in result["eval_curve"]]
        relative = "-" if baseline is None or variant == "llama" else (
            f"{100 * (baseline['eval_curve'][-1][1] - losses[-1]) / baseline['eval_curve'][-1][1]:+.2f}")
        lines.append(f"| {variant} | {result['train_tokens']:,} | " + " | ".join(f"{loss:.4f}" for loss in losses)
                     + f" | {relative} | {result['train_runtime_s']:.0f} |")
    return "\n".join(lines)


def plot(arguments: argparse.Namespace) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    figure, axis = plt.subplots(figsize=(6, 4))
    for variant in VARIANTS:
        path = arguments.output_dir / variant / "results.json"
        if path.is_file():
            result = json.loads(path.read_text())
            tokens_per_step = result["train_tokens"] / result["steps"]
            steps, losses = zip(*result["eval_curve"])
            axis.plot([step * tokens_per_step for step in steps], losses, marker="o", label=variant)
    axis.set_xlabel("training tokens")
    axis.set_ylabel("held-out loss (nats)")
    axis.set_title("SmolLM2-135M-Instruct vs its DAR upcycle, continued training")
    axis.legend()
    figure.tight_layout()
    arguments.plot.parent.mkdir(parents=True, exist_ok=True)
    figure.savefig(arguments.plot, dpi=120)
    plt.close(figure)


def main() -> None:
    arguments = parse_arguments()
    if not arguments.table:
        with ThreadPoolExecutor(arguments.jobs) as pool:
            list(pool.map(lambda variant: run(variant, arguments), arguments.variants))
    print(table(arguments))
    if arguments.plot is not None:
        plot(arguments)


if __name__ == "__main__":
    main()
