# SPDX-License-Identifier: Apache-2.0
"""`benchmarks/compiled_breakdown.py`: how it attributes a profile and measures bandwidth (the timings themselves are
benchmarks, not tests)."""

import json
import sys
from collections import namedtuple
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))
import compiled_breakdown  # noqa: E402

Event = namedtuple("Event", "key self_cpu_time_total count")  # what `key_averages()` rows carry that it reads


@pytest.mark.parametrize(
    ("name", "expected"),
    [
        ("graph_0_cpp_fused__unsafe_view_mul_silu_8", "generated kernels"),
        ("## Call CompiledFxGraph fabc123 ##", "generated wrapper (self)"),
        ("TorchDynamo Cache Lookup", "dynamo guards"),
        ("aten::mm", "BLAS products"),
        ("aten::bmm", "BLAS products"),
        ("aten::copy_", "other ATen"),
        ("ProfilerStep#1", "other"),
    ],
)
def test_each_profiler_event_is_attributed_to_who_spends_it(name, expected):
    assert compiled_breakdown.category(name) == expected


def test_kernels_of_the_same_operations_add_up_per_forward():
    """The same fused operations compiled for different blocks ("..._8", "..._9") are one group; times are per
    forward (the profile covers several), and every event's self time lands in exactly one category."""
    assert compiled_breakdown.kernel_group("graph_0_cpp_fused_mul_silu_8") == "cpp_fused_mul_silu"
    events = [
        Event("graph_0_cpp_fused_mul_silu_8", 3000.0, 30),
        Event("graph_0_cpp_fused_mul_silu_9", 1000.0, 10),
        Event("graph_0_cpp_fused_add_amax_exp_3", 2000.0, 10),
        Event("aten::mm", 40000.0, 200),
        Event("## Call CompiledFxGraph f0 ##", 8000.0, 10),
    ]
    by_category, kernels = compiled_breakdown.breakdown(events, calls=10)
    assert kernels == {"cpp_fused_mul_silu": [0.4, 4.0], "cpp_fused_add_amax_exp": [0.2, 1.0]}
    assert by_category["generated kernels"] == pytest.approx([0.6, 5.0])
    assert by_category["BLAS products"] == pytest.approx([4.0, 20.0])
    assert by_category["generated wrapper (self)"] == pytest.approx([0.8, 1.0])
    total = sum(ms for ms, _ in by_category.values())
    assert total == pytest.approx(sum(event.self_cpu_time_total for event in events) / 10 / 1e3)


def test_bandwidth_reports_every_measure_per_size():
    rows = compiled_breakdown.bandwidth([0.01, 0.02], repeats=3)
    assert [row["size_mib"] for row in rows] == [0.01, 0.02]
    assert all(row[f"{measure}_gbs"] > 0 for row in rows for measure in ("add", "copy", "sum"))


@pytest.mark.slow
def test_a_small_run_profiles_both_models_and_finds_dars_kernels(tmp_path, monkeypatch):
    """End to end at the small shape: both models compiled and profiled, the branches' products in both, DAR's
    depth path as generated kernels Llama does not have."""
    out = tmp_path / "breakdown.json"
    monkeypatch.setattr(sys, "argv", ["compiled_breakdown.py", "--shape", "small", "--tokens", "4", "--repeats", "1",
                                      "--profiled", "1", "--bandwidth-mib", "0.01", "--json", str(out)])
    compiled_breakdown.main()
    results = json.loads(out.read_text())
    llama, dar = results["models"]["llama"], results["models"]["dar-block"]
    assert llama["by_category"]["BLAS products"][0] > 0 and dar["by_category"]["BLAS products"][0] > 0
    assert dar["by_category"]["generated kernels"][1] > llama["by_category"]["generated kernels"][1]
    assert results["bandwidth"][0]["size_mib"] == 0.01


def test_models_are_measured_as_a_bf16_checkpoint_loads():
    """bf16 branches with DAR's parameters float32 (`_keep_in_fp32_modules_strict`), as `from_pretrained` gives."""
    import torch

    built = compiled_breakdown.build_model("dar-block", compiled_breakdown.SHAPES["small"])
    model = compiled_breakdown.as_loaded_in(built, torch.bfloat16)
    dar = {name for name, _ in model.named_parameters() if "_residual" in name or "final_readout" in name}
    assert dar and {model.get_parameter(name).dtype for name in dar} == {torch.float32}
    assert {p.dtype for name, p in model.named_parameters() if name not in dar} == {torch.bfloat16}
