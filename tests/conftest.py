# SPDX-License-Identifier: Apache-2.0
"""Shared tiny-model builders for the CPU test suite.

Every model here is built from random weights in a fraction of a second: hidden 32, 2 decoder layers (M = 4 branches),
GQA with 4 query and 2 key/value heads, a 97-token vocabulary. Import the plain functions from other test files
(`from conftest import tiny_llama, upcycled_dar`); they take keyword overrides of any config field.
"""

import torch
from transformers import LlamaConfig, LlamaForCausalLM

from dar_transformers import DARConfig, DARForCausalLM

TINY_LLAMA_FIELDS = dict(
    vocab_size=97,
    hidden_size=32,
    intermediate_size=64,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    max_position_embeddings=64,
    bos_token_id=1,
    eos_token_id=2,
    pad_token_id=0,
)

# Every DAR-only parameter lives under one of these module names (the rest keeps Llama's names).
DAR_MODULE_NAMES = ("attn_residual", "mlp_residual", "final_readout")


def tiny_llama_config(**overrides) -> LlamaConfig:
    return LlamaConfig(**{**TINY_LLAMA_FIELDS, **overrides})


def tiny_dar_config(**overrides) -> DARConfig:
    return DARConfig(**{**TINY_LLAMA_FIELDS, **overrides})


def tiny_llama(seed: int = 0, dtype: torch.dtype = torch.float32, **overrides) -> LlamaForCausalLM:
    """A random tiny LlamaForCausalLM in eval mode; `seed` fixes its weights."""
    torch.manual_seed(seed)
    return LlamaForCausalLM(tiny_llama_config(**overrides)).to(dtype).eval()


def is_dar_parameter(name: str) -> bool:
    return any(part in DAR_MODULE_NAMES for part in name.split("."))


def dar_parameter_names(model: torch.nn.Module) -> set[str]:
    return {name for name, _ in model.named_parameters() if is_dar_parameter(name)}


def load_llama_into_dar(llama: LlamaForCausalLM, dar: DARForCausalLM):
    """Load the Llama state dict into a DAR model (non-strict: the DAR parameters keep their init).

    Returns the `load_state_dict` result (missing_keys, unexpected_keys) for the caller to check.
    """
    return dar.load_state_dict(llama.state_dict(), strict=False)


def upcycled_dar(llama: LlamaForCausalLM, **dar_overrides) -> DARForCausalLM:
    """A DARForCausalLM with the Llama weights and the upcycling init of the DAR parameters, in Llama's dtype."""
    config = tiny_dar_config(**{**_llama_fields(llama.config), **dar_overrides})
    dar = DARForCausalLM(config).to(llama.dtype).eval()
    load_llama_into_dar(llama, dar)
    return dar


def _llama_fields(config: LlamaConfig) -> dict:
    return {name: getattr(config, name) for name in TINY_LLAMA_FIELDS} | {
        "rms_norm_eps": config.rms_norm_eps,
        "initializer_range": config.initializer_range,
    }


def perturb_dar_parameters(model: torch.nn.Module, scale: float = 0.5, seed: int = 0) -> None:
    """Add scale * randn to every DAR parameter, so that no depth read is uniform and no gate is at its init."""
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, parameter in sorted(model.named_parameters()):
            if is_dar_parameter(name):
                noise = torch.randn(parameter.shape, generator=generator, dtype=torch.float64)
                parameter.add_(scale * noise.to(parameter.dtype))


def random_input_ids(batch: int = 2, length: int = 9, vocab_size: int = 97, seed: int = 0) -> torch.LongTensor:
    """Token ids drawn from 3 .. vocab_size - 1, so no pad, bos or eos token appears by chance."""
    generator = torch.Generator().manual_seed(seed)
    return torch.randint(3, vocab_size, (batch, length), generator=generator)
