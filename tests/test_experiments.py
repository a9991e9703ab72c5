# SPDX-License-Identifier: Apache-2.0
"""The replication's bookkeeping (CPU, no training): which runs `experiments/replicate.py` counts as done and which
runs `experiments/summarize.py` compares are decided by the same configuration key, so that a run is never skipped
for, nor compared with, a run of another corpus, vocabulary or weight decay."""

import argparse
import json
import subprocess
import sys
from pathlib import Path

import pytest

EXPERIMENTS = Path(__file__).resolve().parents[1] / "experiments"
sys.path.insert(0, str(EXPERIMENTS))

import replicate  # noqa: E402
import summarize  # noqa: E402


def record(variant, seed, loss, corpus="AAAA", vocab_size=4096, weight_decay=0.1):
    """A results line as replicate.py writes it (tokens, curve and timings made up)."""
    args = argparse.Namespace(train_tokens=640, batch_size=2, seq_len=32, lr=0.002, weight_decay=weight_decay,
                              vocab_size=vocab_size, corpus_tag=corpus)
    return {"key": replicate.run_key(variant, seed, args), "variant": variant, "seed": seed, "corpus": corpus,
            "requested_train_tokens": 640, "train_tokens": 640, "batch_size": 2, "seq_len": 32, "lr": 0.002,
            "weight_decay": weight_decay, "vocab_size": vocab_size, "val_loss": loss, "train_tokens_per_second": 1e3,
            "parameters": 1, "non_embedding_parameters": 1, "finished": f"{variant}-{seed}-{corpus}",
            "curve": [{"step": step, "tokens": 320 * step, "val_loss": loss + 0.1 / step, "train_loss_ema": loss}
                      for step in (1, 2)]}


def test_runs_on_another_corpus_vocabulary_or_weight_decay_are_another_configuration():
    """summarize.py grouped runs by budget, batch shape and learning rate only: a later replication of the residual
    baseline on another corpus replaced the first corpus's in the seed-by-seed comparison (DAR Block then read 10.8 %
    better than a baseline it never ran against, or 13.5 % worse in a real pair of tiny runs)."""
    first = [record("residual", seed, 4.20) for seed in (0, 1)] + [record("dar_block", seed, 4.10) for seed in (0, 1)]
    others = [record("residual", seed, 3.70, corpus="BBBB") for seed in (0, 1)]
    others += [record("residual", seed, 3.90, vocab_size=8192) for seed in (0, 1)]
    others += [record("residual", seed, 4.00, weight_decay=0.0) for seed in (0, 1)]
    budgets = {summarize.budget_of(run) for run in first + others}
    assert len(budgets) == 4 and len({summarize.budget_of(run) for run in first}) == 1
    row = summarize.summarise(first)["variants"]["dar_block"]
    assert row["paired_gain_vs_residual_pct"] == pytest.approx([100 * 0.1 / 4.2] * 2)
    with pytest.raises(SystemExit, match="two runs of residual seed 0 in one configuration"):
        summarize.summarise(first + [record("residual", 0, 4.30)])


def test_the_summary_of_a_results_file_compares_only_runs_of_one_configuration(tmp_path):
    results = tmp_path / "replication.jsonl"
    runs = [record(variant, seed, loss) for variant, loss in (("residual", 4.20), ("dar_block", 4.10))
            for seed in (0, 1, 2)]
    runs += [record("residual", seed, 3.70, corpus="BBBB") for seed in (0, 1)]
    results.write_text("".join(json.dumps(run) + "\n" for run in runs))
    out = tmp_path / "summary"
    completed = subprocess.run([sys.executable, str(EXPERIMENTS / "summarize.py"), "--results", str(results), "--out",
                                str(out)], capture_output=True, text=True, timeout=300)
    assert completed.returncode == 0, completed.stderr[-3000:]
    summary = json.loads((out / "replication_summary.json").read_text())
    assert summary["runs"] == 6 and summary["budget"].endswith("/corpusAAAA")
    assert summary["variants"]["residual"]["seeds"] == [0, 1, 2]
    assert summary["variants"]["dar_block"]["paired_gain_vs_residual_pct_mean"] == pytest.approx(100 * 0.1 / 4.2)


def test_a_budget_named_as_the_docs_name_it_is_found_and_one_that_matches_nothing_is_refused(tmp_path):
    """docs/results.md names a budget by its leading part (tok640/bs2x32/lr0.002), which the configuration key
    extends (weight decay, vocabulary, corpus): the lookup matched no run, and summarize.py wrote an empty table, JSON
    and plot over the published ones and exited 0. The leading part now picks its one configuration; a name that
    matches none or several is refused naming the keys, and nothing is written."""
    results = tmp_path / "replication.jsonl"
    runs = [record(variant, seed, loss) for variant, loss in (("residual", 4.20), ("dar_block", 4.10))
            for seed in (0, 1)]
    results.write_text("".join(json.dumps(run) + "\n" for run in runs))

    def summarise_budget(budget, out):
        return subprocess.run([sys.executable, str(EXPERIMENTS / "summarize.py"), "--results", str(results), "--out",
                               str(out), "--budget", budget], capture_output=True, text=True, timeout=300)

    completed = summarise_budget("tok640/bs2x32/lr0.002", tmp_path / "short")
    assert completed.returncode == 0, completed.stderr[-3000:]
    assert json.loads((tmp_path / "short" / "replication_summary.json").read_text())["runs"] == 4
    results.write_text(results.read_text() + json.dumps(record("residual", 0, 3.7, corpus="BBBB")) + "\n")
    for budget, matches in (("tok999/bs2x32/lr0.002", "no"), ("tok640/bs2x32/lr0.002", "2")):
        completed = summarise_budget(budget, tmp_path / "refused")
        assert completed.returncode != 0 and f"matches {matches} configuration(s)" in completed.stderr
        assert not (tmp_path / "refused").exists()


def test_a_run_is_done_only_for_its_own_configuration_and_old_records_still_count(tmp_path):
    """replicate.py's run key left out the vocabulary size and weight decay: a replication with another one printed
    "0 runs to do" and summarised the earlier runs as the new ones. A record written under the old key (no corpus or
    asked-for budget fields) counts as done for its own configuration, so no finished run is repeated."""
    args = argparse.Namespace(train_tokens=640, batch_size=2, seq_len=32, lr=0.002, weight_decay=0.1, vocab_size=4096,
                              corpus_tag="AAAA")
    old = {"key": "dar_block/seed0/tok640/bs2x32/lr0.002/corpusAAAA", "variant": "dar_block", "seed": 0,
           "train_tokens": 576, "batch_size": 2, "seq_len": 32, "lr": 0.002, "weight_decay": 0.1, "vocab_size": 4096}
    results = tmp_path / "replication.jsonl"
    results.write_text(json.dumps(old) + "\n" + json.dumps(record("residual", 0, 4.2)) + "\n")
    done = replicate.finished_keys(results)
    assert replicate.run_key("dar_block", 0, args) in done and replicate.run_key("residual", 0, args) in done
    for changed in (dict(vocab_size=8192), dict(weight_decay=0.0), dict(corpus_tag="BBBB"), dict(lr=0.001)):
        other = argparse.Namespace(**{**vars(args), **changed})
        assert replicate.run_key("dar_block", 0, other) not in done, changed


def test_analyze_trained_refuses_when_no_checkpoint_matches():
    """analyze_trained.sh globbed `*-seed0-tok327680`, which replicate.py's checkpoint names (a configuration hash
    after the budget) never match: it analysed nothing and exited 0. It now matches them, and says so and fails when
    nothing matches (here a glob of no checkpoint)."""
    completed = subprocess.run(["sh", str(EXPERIMENTS / "analyze_trained.sh")], capture_output=True, text=True,
                               timeout=60, env={"PATH": "/usr/bin:/bin", "ANALYSE": "no-such-checkpoint-*"})
    assert completed.returncode == 1 and "no checkpoint matches" in completed.stderr
