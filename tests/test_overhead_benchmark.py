# SPDX-License-Identifier: Apache-2.0
"""`benchmarks/overhead.py`'s paired ratios and its `--metrics` choice (the timings themselves are benchmarks, not
tests)."""

import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))
import overhead  # noqa: E402


def test_paired_ratios_cancel_the_machines_drift_between_repeats():
    """Each DAR repeat is divided by the Llama time of the same repeat: a machine whose speed drifts by 2x
    between repeats gives the true 1.05x in every pair, so the quartiles close on it."""
    drift = [1.0, 2.0, 1.0, 2.0, 2.0]
    samples = {
        "llama": {"prefill_s": [0.4 * d for d in drift], "decode_token_s": [0.1] * 5},
        "dar-block": {"prefill_s": [0.42 * d for d in drift], "decode_token_s": [0.1, 0.2, 0.3, 0.4, 0.5]},
    }
    paired = overhead.paired_ratios(samples, ["prefill_s", "decode_token_s"])
    assert set(paired) == {"dar-block"}
    assert paired["dar-block"]["prefill_s"] == pytest.approx({"median": 1.05, "q1": 1.05, "q3": 1.05})
    # 1, 2, 3, 4, 5: median 3, quartiles 2 and 4 (inclusive method)
    assert paired["dar-block"]["decode_token_s"] == pytest.approx({"median": 3.0, "q1": 2.0, "q3": 4.0})

    # Negative control: shifted by one repeat, the pairs no longer share the machine's state.
    samples["dar-block"]["prefill_s"] = [0.42 * d for d in drift[1:] + drift[:1]]
    shifted = overhead.paired_ratios(samples, ["prefill_s"])["dar-block"]["prefill_s"]
    assert shifted["q3"] - shifted["q1"] > 0.5


def test_paired_ratios_need_llama_and_two_repeats():
    assert overhead.paired_ratios({"dar-block": {"prefill_s": [1.0, 2.0]}}, ["prefill_s"]) == {}
    one = {"llama": {"prefill_s": [1.0]}, "dar-block": {"prefill_s": [1.1]}}
    assert overhead.paired_ratios(one, ["prefill_s"]) == {}


@pytest.mark.parametrize("metrics", ["train,foo", "", "prefill,,decode"])
def test_metrics_outside_the_timed_ones_are_refused_by_name(monkeypatch, capsys, metrics):
    monkeypatch.setattr(sys, "argv", ["overhead.py", "--metrics", metrics])
    with pytest.raises(SystemExit):
        overhead.main()
    assert "--metrics takes a comma-separated subset of train, prefill, decode" in capsys.readouterr().err
