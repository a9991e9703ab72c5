# SPDX-License-Identifier: Apache-2.0
"""Summarise the replication JSONL: the table (mean and spread over seeds, paired differences), loss curves.

  python experiments/summarize.py [--results experiments/results/replication.jsonl] [--out docs/results]

Writes replication_table.md, replication_summary.json and loss_curves.png under --out, and prints the table.
Relative differences are (L_baseline - L_variant) / L_baseline in percent: positive means the variant's validation
loss is lower (the paper's "2.03%-5.12% lower loss" convention). "Paired" differences are taken seed by seed
(the runs of one seed saw the same batches) and then averaged.
"""

import argparse
import json
import statistics
from collections import defaultdict
from pathlib import Path

from runs import configuration_key, record_configuration, record_key

REPO = Path(__file__).resolve().parents[1]
ORDER = ("residual", "attnres_full", "attnres_block", "dar_full", "dar_block", "dar_selfkv", "dar_crossv",
         "dar_fixedkv", "two_stream_one_block")
BASELINES = ("residual", "attnres_block", "dar_block")


def budget_of(record: dict) -> str:
    """The configuration a run belongs to (`runs.configuration_key`): only runs of one are compared. Budget, batch
    shape and learning rate alone merged runs on two corpora (or vocabularies), the later corpus's baseline runs
    overwriting the earlier's in the seed-by-seed comparison."""
    return configuration_key(record_configuration(record))


def spread(values: list[float]) -> float:
    return statistics.stdev(values) if len(values) > 1 else float("nan")


def relative_gain(baseline: float, value: float) -> float:
    return 100.0 * (baseline - value) / baseline


def summarise(records: list[dict]) -> dict:
    by_variant: dict[str, dict[int, dict]] = defaultdict(dict)
    for record in records:
        earlier = by_variant[record["variant"]].get(record["seed"])
        if earlier is not None:  # one would silently stand for the other in every mean and pairing
            raise SystemExit(f"summarize.py: error: two runs of {record['variant']} seed {record['seed']} in one "
                             f"configuration ({record_key(record)}: finished {earlier.get('finished')} and "
                             f"{record.get('finished')}); remove one from the results file.")
        by_variant[record["variant"]][record["seed"]] = record
    rows = {}
    for variant in [v for v in ORDER if v in by_variant]:
        runs = by_variant[variant]
        losses = [run["val_loss"] for run in runs.values()]
        row = {
            "seeds": sorted(runs),
            "val_loss_mean": statistics.fmean(losses),
            "val_loss_std": spread(losses),
            "val_loss_min": min(losses),
            "val_loss_max": max(losses),
            "tokens_per_second_mean": statistics.fmean(run["train_tokens_per_second"] for run in runs.values()),
            "parameters": next(iter(runs.values()))["parameters"],
            "non_embedding_parameters": next(iter(runs.values()))["non_embedding_parameters"],
        }
        for baseline in BASELINES:
            if baseline not in by_variant or baseline == variant:
                continue
            base_runs = by_variant[baseline]
            paired = [relative_gain(base_runs[s]["val_loss"], runs[s]["val_loss"]) for s in runs if s in base_runs]
            base_mean = statistics.fmean(run["val_loss"] for run in base_runs.values())
            row[f"gain_vs_{baseline}_pct"] = relative_gain(base_mean, row["val_loss_mean"])
            row[f"paired_gain_vs_{baseline}_pct"] = paired
            row[f"paired_gain_vs_{baseline}_pct_mean"] = statistics.fmean(paired) if paired else float("nan")
            row[f"paired_gain_vs_{baseline}_pct_std"] = spread(paired) if paired else float("nan")
            base_speed = statistics.fmean(run["train_tokens_per_second"] for run in base_runs.values())
            row[f"throughput_vs_{baseline}"] = row["tokens_per_second_mean"] / base_speed
        rows[variant] = row
    noise = {v: 100.0 * r["val_loss_std"] / r["val_loss_mean"] for v, r in rows.items() if len(r["seeds"]) > 1}
    return {"variants": rows, "seed_noise_pct": noise}


def markdown_table(summary: dict) -> str:
    def number(value: float, digits: int = 2, signed: bool = False) -> str:
        if value != value:  # nan
            return "-"
        return f"{value:+.{digits}f}" if signed else f"{value:.{digits}f}"

    lines = [
        "| variant | seeds | val loss mean | std | min-max | vs residual % (paired mean ± std) "
        "| vs AttnRes Block % (paired) | vs DAR Block % (paired) | tokens/s (shared CPU) |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for variant, row in summary["variants"].items():
        def versus(baseline: str) -> str:
            if f"paired_gain_vs_{baseline}_pct_mean" not in row:
                return "-"
            mean = number(row[f"paired_gain_vs_{baseline}_pct_mean"], signed=True)
            std = row[f"paired_gain_vs_{baseline}_pct_std"]
            return mean if std != std else f"{mean} ± {number(std)}"

        lines.append(
            f"| {variant} | {len(row['seeds'])} | {number(row['val_loss_mean'], 4)} | {number(row['val_loss_std'], 4)} "
            f"| {number(row['val_loss_min'], 4)}-{number(row['val_loss_max'], 4)} | {versus('residual')} "
            f"| {versus('attnres_block')} | {versus('dar_block')} | {number(row['tokens_per_second_mean'], 0)} |"
        )
    return "\n".join(lines)


def plot_curves(records: list[dict], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    by_variant: dict[str, list[dict]] = defaultdict(list)
    for record in records:
        by_variant[record["variant"]].append(record)
    figure, axes = plt.subplots(1, 2, figsize=(12, 4.5))
    for variant in [v for v in ORDER if v in by_variant]:
        runs = by_variant[variant]
        length = min(len(run["curve"]) for run in runs)
        tokens = [point["tokens"] / 1e6 for point in runs[0]["curve"][:length]]
        for axis, key in zip(axes, ("val_loss", "train_loss_ema")):
            mean = [statistics.fmean(run["curve"][i][key] for run in runs) for i in range(length)]
            axis.plot(tokens, mean, marker=".", label=f"{variant} (n={len(runs)})")
    for axis, title in zip(axes, ("validation loss (curve subset)", "training loss (EMA)")):
        axis.set_xlabel("training tokens (M)")
        axis.set_ylabel("loss (nats)")
        axis.set_title(title, fontsize=10)
        axis.grid(alpha=0.3)
    # The late part of training, where the differences are: zoom both panels to the last 60% of the curve.
    for axis in axes:
        lines = axis.get_lines()
        if lines:
            tail = [y for line in lines for x, y in zip(*line.get_data()) if x >= 0.4 * max(line.get_xdata())]
            axis.set_ylim(min(tail) - 0.05, max(tail) + 0.05)
    axes[0].legend(fontsize=7)
    figure.tight_layout()
    figure.savefig(path, dpi=120)
    plt.close(figure)


def choose_budget(asked: str | None, budgets: dict[str, list]) -> str:
    """The configuration key `--budget` names: the key itself, or the one key it begins (a key carries weight decay,
    vocabulary and corpus after budget, batch and learning rate, which older commands leave out). A name that matches
    none, or several, is refused, listing the keys: a lookup that matched nothing wrote an empty table over the
    published one and exited 0."""
    if asked is None:
        return max(budgets, key=lambda key: len(budgets[key]))
    matching = [key for key in budgets if key == asked or key.startswith(asked.rstrip("/") + "/")]
    if len(matching) != 1:
        raise SystemExit(f"summarize.py: error: --budget {asked} matches {len(matching) or 'no'} configuration(s) of "
                         f"the results ({', '.join(sorted(matching or budgets))}); give one of them.")
    return matching[0]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--results", type=Path, default=REPO / "experiments" / "results" / "replication.jsonl")
    parser.add_argument("--out", type=Path, default=REPO / "docs" / "results")
    parser.add_argument("--budget", help="which configuration to summarise, its key or a leading part of it "
                        "(tok1310720/bs8x256/lr0.003); default: the one with the most runs")
    args = parser.parse_args()

    records = [json.loads(line) for line in args.results.read_text().splitlines() if line.strip()]
    budgets = defaultdict(list)
    for record in records:
        budgets[budget_of(record)].append(record)
    if not budgets:
        parser.error(f"{args.results} holds no runs")
    budget = choose_budget(args.budget, budgets)
    chosen = budgets[budget]
    summary = {"budget": budget, "runs": len(chosen), **summarise(chosen)}
    args.out.mkdir(parents=True, exist_ok=True)
    table = markdown_table(summary)
    (args.out / "replication_table.md").write_text(f"Budget {budget}, {len(chosen)} runs.\n\n{table}\n")
    (args.out / "replication_summary.json").write_text(json.dumps(summary, indent=1))
    plot_curves(chosen, args.out / "loss_curves.png")
    print(f"budget {budget}: {len(chosen)} runs (other budgets: {sorted(set(budgets) - {budget})})")
    print(table)
    print("seed noise (std / mean, %):", {k: round(v, 2) for k, v in summary["seed_noise_pct"].items()})


if __name__ == "__main__":
    main()
