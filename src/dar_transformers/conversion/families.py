# SPDX-License-Identifier: Apache-2.0
# Copyright 2026 The dar-transformers authors.
"""Which sources convert, and which of their config fields a target takes over (data; the first stop of a conversion).

A source `model_type` converts when DAR composes its branches: the dense families are `DAR_BRANCH_FAMILIES`
(`configuration_dar.py`, the one list of them), each its own branch family; the MoE families convert to DAR-MoE
with the branches of their dense sibling. Everything else, a custom `model_type` with an `auto_map` included, is
refused by name before transformers is asked to build or load anything (no custom code ever runs).

The fields a target config copies from its source are `DARConfig`'s own Llama-part fields (`architecture_fields`),
for DAR and DAR-MoE alike; DAR-MoE adds the MoE fields of `MOE_CONFIG_FIELDS`.
"""

import copy
import dataclasses

from transformers import PreTrainedConfig
from transformers.utils import logging

from ..configuration_dar import DAR_BRANCH_FAMILIES, DARConfig

logger = logging.get_logger(__name__)

# Source model_type -> DAR branch family (the HF attention/MLP classes DAR composes, `modeling_dar.DAR_BRANCH_MODULES`).
SOURCE_FAMILIES: dict[str, str] = {family: family for family in DAR_BRANCH_FAMILIES}
# MoE sources convert to kind "dar_moe" only, with the branches of their dense sibling.
MOE_SOURCE_FAMILIES: dict[str, str] = {"mixtral": "mistral", "qwen2_moe": "qwen2", "qwen3_moe": "qwen3"}
ALL_SOURCE_FAMILIES: dict[str, str] = {**SOURCE_FAMILIES, **MOE_SOURCE_FAMILIES}
# A dense DAR checkpoint (say, one trained after conversion) converts to DAR-MoE only: sparse upcycling of its MLPs,
# every DAR parameter kept.
DAR_SOURCE_TYPE = "dar"
# Families whose sliding window applies only through `use_sliding_window` / `layer_types` (refused below).
LAYER_TYPED_FAMILIES = ("qwen2", "qwen3", "qwen2_moe", "qwen3_moe")
# Families whose attention reads `sliding_window` directly. Any other family's attention ignores the key (a stray one
# in a Llama config.json) and must not carry it: DAR builds a sliding mask whenever it is set.
SLIDING_WINDOW_FAMILIES = ("mistral", "mixtral")

# The MoE config fields of each MoE source: DARMoeConfig field -> source field (a name, or a fixed value).
MOE_CONFIG_FIELDS: dict[str, dict[str, object]] = {
    "mixtral": {
        "num_experts": "num_local_experts",
        "num_experts_per_tok": "num_experts_per_tok",
        "moe_intermediate_size": "intermediate_size",
        "norm_topk_prob": True,  # MixtralTopKRouter always renormalises the top-k weights
        "router_aux_loss_coef": "router_aux_loss_coef",
        "output_router_logits": "output_router_logits",  # training adds the auxiliary loss
    },
    "qwen2_moe": {
        "num_experts": "num_experts",
        "num_experts_per_tok": "num_experts_per_tok",
        "moe_intermediate_size": "moe_intermediate_size",
        "norm_topk_prob": "norm_topk_prob",
        "shared_expert_intermediate_size": "shared_expert_intermediate_size",
        "decoder_sparse_step": "decoder_sparse_step",
        "mlp_only_layers": "mlp_only_layers",
        "router_aux_loss_coef": "router_aux_loss_coef",
        "output_router_logits": "output_router_logits",  # training adds the auxiliary loss
    },
    "qwen3_moe": {
        "num_experts": "num_experts",
        "num_experts_per_tok": "num_experts_per_tok",
        "moe_intermediate_size": "moe_intermediate_size",
        "norm_topk_prob": "norm_topk_prob",
        "decoder_sparse_step": "decoder_sparse_step",
        "mlp_only_layers": "mlp_only_layers",
        "router_aux_loss_coef": "router_aux_loss_coef",
        "output_router_logits": "output_router_logits",  # training adds the auxiliary loss
    },
}


class UnsupportedArchitectureError(ValueError):
    """The source is not a causal LM of a family whose branches DAR reuses."""


def one_line(error: BaseException) -> str:
    """An error's message on one line: a validator's own message (field name, allowed values) when it wraps one."""
    cause = error.__cause__ if type(error).__name__.startswith("StrictDataclass") and error.__cause__ else error
    return " ".join(str(cause).split())


def supported_families_sentence() -> str:
    return (f"DAR converts model_type {sorted(SOURCE_FAMILIES)} (Llama, SmolLM, TinyLlama, Mistral, Qwen2, Qwen3) and, "
            f"to DAR-MoE, {sorted(MOE_SOURCE_FAMILIES)} and a dense {DAR_SOURCE_TYPE!r} checkpoint")


def check_model_type(model_type: object, where: str) -> str:
    """The branch family of a source `model_type` read from `where`, or a one-line error listing the supported ones."""
    if model_type == DAR_SOURCE_TYPE:  # a dense DAR upcycles to DAR-MoE (its branch family: its config's)
        return DAR_SOURCE_TYPE
    if model_type == "dar_moe":
        raise UnsupportedArchitectureError(
            f"Cannot convert model_type {model_type!r} ({where}): it is already a DAR-MoE checkpoint; "
            f"{supported_families_sentence()}."
        )
    if not isinstance(model_type, str) or model_type not in ALL_SOURCE_FAMILIES:  # a list or object is no type either
        raise UnsupportedArchitectureError(
            f"Cannot convert model_type {model_type!r} ({where}): {supported_families_sentence()}; custom model code is "
            "never run."
        )
    return ALL_SOURCE_FAMILIES[model_type]


def source_family(config: PreTrainedConfig) -> str:
    """The DAR branch family of a source config, or a clear error listing the supported ones."""
    architectures = getattr(config, "architectures", None) or [type(config).__name__]
    where = ", ".join(map(str, architectures)) if isinstance(architectures, (list, tuple)) else str(architectures)
    family = check_model_type(config.model_type, where)
    check_causal(config, f"The {where} source's config sets is_causal={getattr(config, 'is_causal', None)!r}")
    return config.dar_branch_family if family == DAR_SOURCE_TYPE else family


def check_causal(config: PreTrainedConfig, where: str) -> None:
    """Refuse a source whose config sets `is_causal` false (`where` says who sets it): transformers' masks then let
    every token attend to the ones after it (`masking_utils.create_causal_mask`), a field its config class does not
    define and a conversion would drop."""
    if not getattr(config, "is_causal", True):
        raise ValueError(
            f"{where}: transformers' attention masks then let every token attend to the tokens after it "
            "(bidirectional attention, as in an embedding model made from a causal LM), which DAR, a causal language "
            "model, does not compute; nothing is converted. Convert a causal model (is_causal true or absent)."
        )


def check_full_attention(source_config: PreTrainedConfig) -> None:
    """Qwen sliding layers need per-layer masks that DAR does not build; refuse rather than drift. Each family is
    decided by what its model reads: Qwen2, Qwen3 and Qwen2-MoE window the layers `layer_types` marks sliding (Qwen2:
    only from `max_window_layers` on, so the flag alone may leave every layer full; a config without layer types is
    decided by its flag), Qwen3-MoE windows every layer when its `sliding_window` is set (its config keeps one only
    with `use_sliding_window`) and has no layer types: a `layer_types` in its config.json is never read."""
    if source_config.model_type == "qwen3_moe":
        window = getattr(source_config, "sliding_window", None)
        if window is not None:
            raise UnsupportedArchitectureError(
                f"The qwen3_moe source uses sliding-window attention in every layer (use_sliding_window=True, "
                f"sliding_window={window}); DAR converts only full-attention Qwen models."
            )
        return
    layer_types = source_config.to_dict().get("layer_types")
    if layer_types is None:
        layer_types = ["sliding_attention"] if getattr(source_config, "use_sliding_window", False) else []
    if "sliding_attention" in layer_types:
        raise UnsupportedArchitectureError(
            f"The {source_config.model_type} source uses sliding-window attention layers (use_sliding_window=True, "
            "layer_types has 'sliding_attention'); DAR converts only full-attention Qwen models."
        )


def architecture_fields() -> tuple[str, ...]:
    """The fields a target config takes over from its source: DARConfig's own, less the generic and the DAR ones."""
    generic = {field.name for field in dataclasses.fields(PreTrainedConfig)}
    return tuple(
        field.name
        for field in dataclasses.fields(DARConfig)
        if field.name not in generic and not field.name.startswith("dar_")
    )


def effective_rope(config: PreTrainedConfig) -> PreTrainedConfig:
    """A copy of `config` whose `rope_parameters` are those its model is built with. A config.json may keep
    `original_max_position_embeddings` beside the rope parameters (Phi-3's layout), a field the config class does not
    define: the rope of a `llama3`, `yarn` or `longrope` model takes it from there (`standardize_rope_params`, called
    when the model builds its rope), while the config's own `rope_parameters` still hold `max_position_embeddings`."""
    config = copy.deepcopy(config)
    if getattr(config, "rope_parameters", None) and hasattr(config, "standardize_rope_params"):
        config.standardize_rope_params()
    return config


def rope_folded_fields(config: PreTrainedConfig) -> tuple[str, ...]:
    """The fields of `config` outside its rope parameters that its rope reads: those whose value `effective_rope`
    moves into the rope parameters (transformers' own rule), so that the converted config carries them there."""
    rope = getattr(effective_rope(config), "rope_parameters", None) or {}
    name = "original_max_position_embeddings"
    return (name,) if hasattr(config, name) and rope.get(name) == getattr(config, name) else ()


def cache_only_windows(config: PreTrainedConfig) -> dict[str, object]:
    """The fields of `config` with which transformers' generation cache keeps only a window of tokens in layers whose
    attention applies no such window, with their values ({} when the cache and the attention agree). The cache reads
    `layer_types`, else `sliding_window`, else `attention_chunk_size` (`get_layer_types_and_kwargs`); Llama's
    attention reads none of them (a stray key: Llama-ified Mistral fine-tunes, merged configs), Mistral's and
    Mixtral's read `sliding_window`, and so does DAR's whatever its branch family; Qwen's attention and cache both
    follow `layer_types` (a sliding one is refused). With such fields the model's cached `generate` departs from its
    own forward past the window (or fails: sliding layer types without a window), so the converted model, which
    reproduces the forward, is checked against the source decoded with a full cache."""
    model_type = config.model_type
    if model_type in LAYER_TYPED_FAMILIES:
        return {}
    window = getattr(config, "sliding_window", None)
    attention_window = window if model_type in SLIDING_WINDOW_FAMILIES or model_type == DAR_SOURCE_TYPE else None
    layer_types = getattr(config, "layer_types", None)
    if layer_types is not None:
        expected = "full_attention" if attention_window is None else "sliding_attention"
        agree = all(kind == expected for kind in layer_types)
    else:
        agree = (window if window is not None else getattr(config, "attention_chunk_size", None)) == attention_window
    if agree:
        return {}
    names = ["layer_types", "attention_chunk_size"] + ([] if attention_window is not None else ["sliding_window"])
    return {name: getattr(config, name) for name in names if getattr(config, name, None) is not None}


def source_architecture(source_config: PreTrainedConfig) -> dict[str, object]:
    """The architecture fields of a source (those its config has, None included), checked for full attention. A dense
    DAR source's attention is that of its branch family (a Mistral-branch DAR keeps its sliding window)."""
    model_type = source_config.model_type
    if model_type == DAR_SOURCE_TYPE:
        model_type = source_config.dar_branch_family
    if model_type in LAYER_TYPED_FAMILIES:
        check_full_attention(source_config)
    values = effective_rope(source_config).to_dict()
    fields = {name: values[name] for name in architecture_fields() if name in values}
    if model_type not in SLIDING_WINDOW_FAMILIES and source_config.model_type != DAR_SOURCE_TYPE:
        # Qwen: only with use_sliding_window (refused above); Llama's attention ignores it (`cache_only_windows`)
        fields.pop("sliding_window", None)
    return fields


def warn_cache_only_windows(source_config: PreTrainedConfig) -> None:
    """Say, once per conversion, which window fields of the source its attention ignores (`cache_only_windows`): the
    converted config does not carry them (DAR would build a sliding mask from `sliding_window`)."""
    fields = cache_only_windows(source_config)
    if fields:
        named = ", ".join(f"{name}={value}" for name, value in fields.items())
        logger.warning(
            f"The {source_config.model_type} source's {named} is not carried: its attention ignores it (the converted "
            "model reproduces that full attention), though transformers' generation cache keeps only a window of "
            "tokens for such a config, so the source's own `generate` departs from its forward past the window or "
            "fails (the verification decodes the source with a full cache); remove it from the source's config.json."
        )


def warn_not_carried(source_config: PreTrainedConfig) -> None:
    """Say, once per conversion, what of the source the converted config does not carry: window fields its attention
    ignores (`warn_cache_only_windows`) and a router's training-only jitter (it was said per config built: twice)."""
    warn_cache_only_windows(source_config)
    if source_config.model_type in MOE_SOURCE_FAMILIES and getattr(source_config, "router_jitter_noise", 0.0):
        logger.warning("The source's router_jitter_noise (training only) is dropped: DAR-MoE routers have none.")


__all__ = [
    "ALL_SOURCE_FAMILIES",
    "MOE_CONFIG_FIELDS",
    "MOE_SOURCE_FAMILIES",
    "SOURCE_FAMILIES",
    "UnsupportedArchitectureError",
    "architecture_fields",
    "cache_only_windows",
    "check_causal",
    "check_model_type",
    "effective_rope",
    "one_line",
    "rope_folded_fields",
    "source_architecture",
    "source_family",
    "warn_cache_only_windows",
    "warn_not_carried",
]
