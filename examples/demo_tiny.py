# SPDX-License-Identifier: Apache-2.0
"""Tiny demo: a random Llama, its exact DAR upcycle (state dict loaded as is), and greedy generation from both."""

import torch
from transformers import LlamaConfig, LlamaForCausalLM

from dar_transformers import DARConfig, DARForCausalLM


def main() -> None:
    torch.manual_seed(0)
    shape = dict(hidden_size=64, intermediate_size=128, num_hidden_layers=4, num_attention_heads=4,
                 num_key_value_heads=2, vocab_size=256)
    llama = LlamaForCausalLM(LlamaConfig(**shape)).eval()
    dar = DARForCausalLM(DARConfig(**shape, dar_block_size=2)).eval()
    dar.load_state_dict(llama.state_dict(), strict=False)
    prompt = torch.randint(0, 256, (1, 12))
    with torch.no_grad():
        difference = (dar(prompt).logits - llama(prompt).logits).abs().max().item()
        llama_tokens = llama.generate(prompt, max_new_tokens=16, do_sample=False)
        dar_tokens = dar.generate(prompt, max_new_tokens=16, do_sample=False)
    print(f"max |logit difference| = {difference:.2e}")
    print("llama:", llama_tokens[0, 12:].tolist())
    print("dar:  ", dar_tokens[0, 12:].tolist())
    print("identical greedy continuations:", torch.equal(llama_tokens, dar_tokens))


if __name__ == "__main__":
    main()
