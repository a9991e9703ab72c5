# SPDX-License-Identifier: Apache-2.0
# Copyright 2026 The dar-transformers authors.
"""What a source tensor becomes (data, as transformers' `conversion_mapping.py` and torchtitan's state-dict adapters
keep it): the key map, the source keys that are no weights, the target parameters a source has no counterpart for,
and the fusion of per-expert MoE tensors into HF's 3-D layout. A plan is made of `TensorPlan`s (what each target
tensor is built from), from `TensorInfo`s (names, shapes and dtypes: nothing is read to plan).
"""

import dataclasses
import math
import re
from collections.abc import Callable, Iterable, Sequence

import torch

from ..modeling_dar import DAR_MODULE_NAMES

# Source key (regex, full match) -> DAR key (template). DAR keeps Llama's attribute names, so each row maps a
# shared parameter onto itself; a source key that matches no row is "unexpected" and stops the conversion.
DAR_KEY_MAP: tuple[tuple[str, str], ...] = (
    (r"model\.embed_tokens\.weight", r"\g<0>"),
    (r"model\.layers\.\d+\.self_attn\.[qkvo]_proj\.(weight|bias)", r"\g<0>"),  # Qwen2: q/k/v biases
    (r"model\.layers\.\d+\.self_attn\.[qk]_norm\.weight", r"\g<0>"),  # Qwen3: per-head q/k RMSNorm
    (r"model\.layers\.\d+\.mlp\.(gate|up|down)_proj\.(weight|bias)", r"\g<0>"),
    (r"model\.layers\.\d+\.(input|post_attention)_layernorm\.weight", r"\g<0>"),
    (r"model\.norm\.weight", r"\g<0>"),
    (r"lm_head\.weight", r"\g<0>"),
)
# Source keys that are no weights (old Llama checkpoints saved the rotary frequencies); transformers ignores them too.
SOURCE_KEYS_IGNORED: tuple[str, ...] = (r"(model\.)?layers\.\d+\.self_attn\.rotary_emb\.inv_freq", r"model\.rotary_emb\.inv_freq")

# The DAR parameters a source has no counterpart for (depth queries, key norms, read and write gates of every
# branch and of the final readout); `_init_weights` gives them the exact-reduction init.
DAR_NEW_PARAMETERS: tuple[str, ...] = (rf"model\.(layers\.\d+\.)?({'|'.join(DAR_MODULE_NAMES)})\..+",)
# A dense source has no router: sparse upcycling adds a fresh one per sparse layer (an MoE source brings its own).
MOE_ROUTER_PARAMETERS: tuple[str, ...] = (r"model\.layers\.\d+\.mlp\.gate\.weight",)

# Per-expert checkpoint tensor names -> part of the fused SwiGLU expert (Mixtral: w1 gate, w3 up, w2 down).
PER_EXPERT_PARTS = {"w1": "gate", "w3": "up", "w2": "down", "gate_proj": "gate", "up_proj": "up", "down_proj": "down"}
PER_EXPERT_KEY = re.compile(
    r"^(?P<prefix>.*\.)(?:block_sparse_moe|mlp)\.experts\.(?P<expert>\d+)\."
    r"(?P<name>w1|w2|w3|gate_proj|up_proj|down_proj)\.weight$"
)


@dataclasses.dataclass(frozen=True)
class TensorInfo:
    shape: tuple[int, ...]
    dtype: torch.dtype

    @property
    def nbytes(self) -> int:
        return math.prod(self.shape) * self.dtype.itemsize


@dataclasses.dataclass(frozen=True)
class TensorPlan:
    """One target tensor: the flat concatenation of whole source tensors `parts` (in order), viewed as `shape`, in
    `dtype`; or `transform(parts)` when given (e.g. Drop-Upcycling noise), or the fixed `value` (a new parameter)."""

    shape: tuple[int, ...]
    dtype: torch.dtype
    parts: tuple[str, ...] = ()
    transform: Callable[[Sequence[torch.Tensor]], torch.Tensor] | None = None
    value: torch.Tensor | None = None

    @property
    def nbytes(self) -> int:
        return math.prod(self.shape) * self.dtype.itemsize


# The names of quantized tensors, where a quantized checkpoint's config.json lacks its quantization_config
# (AutoGPTQ writes quantize_config.json instead): GPTQ/AWQ packed weights and their zeros, scales and group indices;
# bitsandbytes' statistics and quantization state; FP8 weights' scales.
QUANTIZED_TENSOR_KEY = (r".*\.(qweight|qzeros|scales|g_idx|weight_scale(_inv)?|input_scale|SCB|weight_format|absmax|"
                        r"quant_map|nested_absmax|nested_quant_map|quant_state\..*)")


def is_ignored_source_key(key: str) -> bool:
    return any(re.fullmatch(pattern, key) for pattern in SOURCE_KEYS_IGNORED)


def map_keys(source_keys: Iterable[str], key_map: Sequence[tuple[str, str]] = DAR_KEY_MAP) -> dict[str, str]:
    """Target key -> source key through `key_map`; a source key that matches no row raises, naming it."""
    mapped, unexpected = {}, []
    for key in source_keys:
        if is_ignored_source_key(key):
            continue
        for pattern, template in key_map:
            if re.fullmatch(pattern, key):
                mapped[re.sub(pattern, template, key)] = key
                break
        else:
            unexpected.append(key)
    quantized = [key for key in unexpected if re.fullmatch(QUANTIZED_TENSOR_KEY, key)]
    if quantized:  # its config.json lacks the quantization_config that names them (refused where it has one)
        raise ValueError(
            f"The source holds quantized weights: {len(quantized)} tensor(s) of a quantized layout such as "
            f"{quantized[:4]} (GPTQ/AWQ packed integers, bitsandbytes or FP8 scales) beside or instead of the "
            "weights, which the converter reads only as GGUF files. Convert the unquantized checkpoint it was made "
            "from, or a dequantized copy of it."
        )
    if unexpected:
        raise ValueError(
            f"The source has {len(unexpected)} parameter(s) that DAR has no place for: {unexpected[:8]}. Only the "
            "Llama-layout keys of the supported families convert (see dar_transformers.conversion.keymaps.DAR_KEY_MAP)."
        )
    return mapped


def check_keys(missing: Sequence[str], unexpected: Sequence[str], new_parameters: Sequence[str]) -> None:
    """After mapping: every missing key must be a new parameter, and nothing may be unexpected."""
    not_new = [key for key in missing if not any(re.fullmatch(pattern, key) for pattern in new_parameters)]
    if not_new or unexpected:
        raise ValueError(
            f"The converted state dict does not match the target model: missing {not_new[:8]} (of {len(not_new)}), "
            f"unexpected {list(unexpected)[:8]} (of {len(unexpected)})."
        )


def _one_source(first: str, second: str, target: str) -> ValueError:
    return ValueError(
        f"source tensors {first!r} and {second!r} both become {target}; a checkpoint holds one tensor per parameter "
        "(Mixtral's `block_sparse_moe.` names or the `mlp.` ones, per-expert or fused experts, not both). Remove the "
        "one the model does not use."
    )


def per_expert_groups(names: Iterable[str]) -> tuple[dict[str, dict[str, dict[int, str]]], list[str]]:
    """Per-expert checkpoint names grouped as {prefix: {"gate"|"up"|"down": {expert: name}}}, and the other names.
    Raises, naming both, on two names for one expert's part (`w1` and `gate_proj`)."""
    groups: dict[str, dict[str, dict[int, str]]] = {}
    others = []
    for name in names:
        match = PER_EXPERT_KEY.match(name)
        if match is None:
            others.append(name)
            continue
        part, expert = PER_EXPERT_PARTS[match["name"]], int(match["expert"])
        experts = groups.setdefault(match["prefix"], {"gate": {}, "up": {}, "down": {}})[part]
        if expert in experts:
            raise _one_source(experts[expert], name, f"{match['prefix']}mlp.experts (expert {expert}, {part})")
        experts[expert] = name
    for prefix, parts in groups.items():
        indices = sorted(parts["down"])
        if not (indices == list(range(len(indices))) and sorted(parts["gate"]) == indices == sorted(parts["up"])):
            raise ValueError(f"Per-expert tensors under {prefix!r} are incomplete: experts {indices}.")
    return groups, others


def moe_layout(names: Iterable[str]) -> tuple[dict[str, str], dict[str, dict[str, dict[int, str]]]]:
    """An MoE checkpoint's names in its model's layout: {model name: source name} of the tensors kept whole (Mixtral's
    `block_sparse_moe.` read as `mlp.`), and the per-expert groups (`per_expert_groups`), each fused into
    `{prefix}mlp.experts.gate_up_proj` and `down_proj`. Raises, naming both, when two source tensors become one model
    tensor: transformers' loader keeps one of them, so keeping either would drop the other silently."""
    groups, others = per_expert_groups(names)
    fused = {f"{prefix}mlp.experts.{target}": parts[part][0] for prefix, parts in groups.items()
             for target, part in (("gate_up_proj", "gate"), ("down_proj", "down"))}  # named by expert 0's tensor
    kept: dict[str, str] = {}
    for name in others:
        target = name.replace(".block_sparse_moe.", ".mlp.")
        first = kept.get(target) or fused.get(target)
        if first is not None:
            raise _one_source(first, name, target)
        kept[target] = name
    return kept, groups


def fuse_expert_weights(state_dict: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """Per-expert tensors -> HF's fused layout; fused state dicts pass through unchanged.

    `...experts.N.{w1,w3}` / `{gate,up}_proj` -> `...mlp.experts.gate_up_proj [E, 2I, D]` (gate rows first),
    `...experts.N.{w2,down_proj}` -> `...mlp.experts.down_proj [E, D, I]`;
    Mixtral's `block_sparse_moe.gate` -> `mlp.gate`.
    """
    kept, groups = moe_layout(state_dict)
    fused = {target: state_dict[name] for target, name in kept.items()}
    for prefix, parts in groups.items():
        indices = sorted(parts["down"])
        fused[f"{prefix}mlp.experts.gate_up_proj"] = torch.stack(
            [torch.cat([state_dict[parts["gate"][index]], state_dict[parts["up"][index]]]) for index in indices]
        )  # [E, 2I, D]
        fused[f"{prefix}mlp.experts.down_proj"] = torch.stack(
            [state_dict[parts["down"][index]] for index in indices]
        )  # [E, D, I]
    return fused


def to_model_layout(state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """A source checkpoint's tensors in its model's parameter names: ignored keys dropped, per-expert MoE tensors
    fused (as transformers' loader fuses them)."""
    return fuse_expert_weights({key: tensor for key, tensor in state.items() if not is_ignored_source_key(key)})


__all__ = [
    "DAR_KEY_MAP",
    "DAR_NEW_PARAMETERS",
    "MOE_ROUTER_PARAMETERS",
    "SOURCE_KEYS_IGNORED",
    "TensorInfo",
    "TensorPlan",
    "check_keys",
    "fuse_expert_weights",
    "is_ignored_source_key",
    "map_keys",
    "moe_layout",
    "per_expert_groups",
    "to_model_layout",
]
