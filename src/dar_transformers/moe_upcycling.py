# SPDX-License-Identifier: Apache-2.0
# Copyright 2026 The dar-transformers authors.
"""Conversion to DAR-MoE: sparse upcycling of dense checkpoints, and Mixtral / Qwen2-MoE / Qwen3-MoE checkpoints.

`dar convert SOURCE OUT --experts E --top-k k [--expert-noise X]` (or `--kind dar_moe` for an MoE source) and
`upcycle_to_dar_moe` run it through `dar_transformers.convert` as the "dar_moe" target kind, so it gets the dense
converter's sources (HF folder, GGUF, in-memory model), key checks, verification (max |logit difference| and greedy
continuations on the same prompts and tolerances) and Hub-ready output folder. Two sources, one target:

- **Sparse upcycling** (Komatsuzaki et al., arXiv 2212.05055) of a dense Llama-family model (Llama, Mistral,
  Qwen2, Qwen3): every expert of every sparse layer is a copy of that layer's dense MLP, the router is fresh and
  random, everything else is copied. Why this is exact at conversion (DESIGN.md section 3): whichever k experts the
  router picks, they all compute MLP(x), and with `norm_topk_prob=True` their weights sum to 1, so the block returns
  sum_e p_e MLP(x) = MLP(x). There is no capacity dropping (HF's experts are dropless), no router jitter and no
  shared expert. The DAR residual is exact on its own (zero queries, count scaling, anti-symmetric write gates), and
  the two compose because the MoE block is just another unchanged branch F_m.
  `expert_noise > 0` (Drop-Upcycling, arXiv 2502.19261) re-initialises that fraction of each expert's hidden units
  so that experts differ and specialise in training. **The result is then no longer exact**: its logits differ
  from the source's, and the verification reports that instead of failing.
- **MoE sources**: the MoE weights keep their names (`mlp.gate`, `mlp.experts.gate_up_proj`/`down_proj`,
  `mlp.shared_expert`, `mlp.shared_expert_gate`), the MoE config fields are copied (Mixtral always renormalises,
  so `norm_topk_prob=True`; Qwen keeps its own flag), so the conversion is exact like the dense DAR upcycle.
  Per-expert tensors (`experts.N.w1/w2/w3`, `experts.N.gate_proj/up_proj/down_proj`, Mixtral's
  `block_sparse_moe`) are fused into the 3-D layout by `fuse_expert_weights`.

The conversion is data plus a small function (STYLE.md item 10): the tables below, the list of new parameters
(`dar_moe_target_kind`), and the converter's check that nothing else is missing or unexpected.
"""

import dataclasses
import math
import os
import re
from collections.abc import Mapping

import torch
from huggingface_hub.errors import StrictDataclassError
from transformers import PreTrainedModel, PretrainedConfig
from transformers.utils import logging

from .checkpoint_io import StateDictCheckpoint, TensorInfo, TensorPlan, materialise
from .configuration_dar_moe import DARMoeConfig
from .convert import (
    DAR_NEW_PARAMETERS,
    MOE_SOURCE_FAMILIES,
    SOURCE_FAMILIES,
    ConversionResult,
    TargetKind,
    is_ignored_source_key,
    register_target_kind,
    upcycle,
    upcycle_model,
)
from .modeling_dar_moe import DARMoeForCausalLM

logger = logging.get_logger(__name__)

# Source model_type -> the DAR branch family whose attention module reproduces it.
SOURCE_BRANCH_FAMILIES = {**SOURCE_FAMILIES, **MOE_SOURCE_FAMILIES}
MOE_SOURCE_TYPES = tuple(MOE_SOURCE_FAMILIES)

# Llama-part config fields copied from the source when it has them (None values leave DARConfig's default).
SHARED_CONFIG_FIELDS = (
    "vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads",
    "num_key_value_heads", "head_dim", "hidden_act", "max_position_embeddings", "initializer_range", "rms_norm_eps",
    "rope_parameters", "attention_bias", "attention_dropout", "tie_word_embeddings", "pad_token_id", "bos_token_id",
    "eos_token_id", "sliding_window",
)
# MoE config fields of each MoE source: DARMoeConfig field -> source field (a name, or a fixed value).
MOE_CONFIG_FIELDS = {
    "mixtral": {
        "num_experts": "num_local_experts",
        "num_experts_per_tok": "num_experts_per_tok",
        "moe_intermediate_size": "intermediate_size",
        "norm_topk_prob": True,  # MixtralTopKRouter always renormalises the top-k weights
        "router_aux_loss_coef": "router_aux_loss_coef",
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
    },
    "qwen3_moe": {
        "num_experts": "num_experts",
        "num_experts_per_tok": "num_experts_per_tok",
        "moe_intermediate_size": "moe_intermediate_size",
        "norm_topk_prob": "norm_topk_prob",
        "decoder_sparse_step": "decoder_sparse_step",
        "mlp_only_layers": "mlp_only_layers",
        "router_aux_loss_coef": "router_aux_loss_coef",
    },
}

# Per-expert checkpoint tensor names -> part of the fused SwiGLU expert (Mixtral: w1 gate, w3 up, w2 down).
PER_EXPERT_PARTS = {"w1": "gate", "w3": "up", "w2": "down", "gate_proj": "gate", "up_proj": "up", "down_proj": "down"}
PER_EXPERT_KEY = re.compile(
    r"^(?P<prefix>.*\.)(?:block_sparse_moe|mlp)\.experts\.(?P<expert>\d+)\."
    r"(?P<name>w1|w2|w3|gate_proj|up_proj|down_proj)\.weight$"
)
# The DAR options a conversion may set (the architecture and MoE fields come from the source).
DAR_OPTION_FIELDS = frozenset(
    field.name
    for field in dataclasses.fields(DARMoeConfig)
    if field.name.startswith("dar_") and field.name != "dar_branch_family"
) | {"router_aux_loss_coef", "output_router_logits"}


def dar_moe_config_from_source(
    source_config: PretrainedConfig,
    num_experts: int | None = None,
    top_k: int | None = None,
    **dar_fields,
) -> DARMoeConfig:
    """The DAR-MoE config of a source: its Llama-part fields, its MoE fields (MoE source) or E and k (upcycling).

    `dar_fields` sets any other DARMoeConfig field (e.g. `dar_block_size`); exactness holds for every DAR setting
    that DESIGN.md section 3 calls exact.
    """
    unknown = sorted(name for name in dar_fields if name not in DAR_OPTION_FIELDS)
    if unknown:
        raise TypeError(f"Unknown DAR-MoE field(s) {unknown}; allowed: {sorted(DAR_OPTION_FIELDS)}.")
    model_type = source_config.model_type
    if model_type not in SOURCE_BRANCH_FAMILIES:
        raise ValueError(
            f"source model_type must be one of {list(SOURCE_BRANCH_FAMILIES)} for DAR-MoE conversion, "
            f"got {model_type!r}."
        )
    if getattr(source_config, "use_sliding_window", False):
        raise ValueError(
            f"{model_type} sources with use_sliding_window=True are not supported: DAR's Qwen branches attend fully."
        )
    fields = {
        name: getattr(source_config, name)
        for name in SHARED_CONFIG_FIELDS
        if getattr(source_config, name, None) is not None
    }
    if model_type in ("qwen2", "qwen2_moe", "qwen3", "qwen3_moe"):
        fields.pop("sliding_window", None)  # only active with use_sliding_window, refused above
    fields["dar_branch_family"] = SOURCE_BRANCH_FAMILIES[model_type]
    if model_type == "qwen2_moe" and not source_config.qkv_bias:
        # Qwen2's attention always has q/k/v biases; without them it is Llama's attention (o_proj has none in both).
        fields.update(dar_branch_family="llama", attention_bias=False)

    if model_type in MOE_SOURCE_TYPES:
        for name, source_value in MOE_CONFIG_FIELDS[model_type].items():
            fields[name] = getattr(source_config, source_value) if isinstance(source_value, str) else source_value
        for name, requested in (("num_experts", num_experts), ("num_experts_per_tok", top_k)):
            if requested is not None and requested != fields[name]:
                raise ValueError(
                    f"{name}={requested} differs from the {model_type} source's {fields[name]}: an MoE source keeps "
                    "its experts and routing (leave experts/top_k unset)."
                )
        if getattr(source_config, "router_jitter_noise", 0.0):
            logger.warning("The source's router_jitter_noise (training only) is dropped: DAR-MoE routers have none.")
    else:
        if num_experts is None or top_k is None:
            raise ValueError(
                f"Upcycling a dense {model_type} model needs num_experts and top_k (got {num_experts!r}, {top_k!r})."
            )
        if getattr(source_config, "mlp_bias", False):
            raise ValueError("Sparse upcycling needs a bias-free MLP (mlp_bias=False): HF experts have no biases.")
        fields.update(
            num_experts=num_experts,
            num_experts_per_tok=top_k,
            moe_intermediate_size=source_config.intermediate_size,
            norm_topk_prob=True,  # the top-k weights of identical experts must sum to 1 (DESIGN.md section 3)
            shared_expert_intermediate_size=0,
        )
    try:
        return DARMoeConfig(**{**fields, **dar_fields})
    except StrictDataclassError as error:  # the validator's own message names the field and the allowed values
        raise ValueError(str(error.__cause__ or error)) from error


def _per_expert_groups(names) -> tuple[dict[str, dict[str, dict[int, str]]], list[str]]:
    """Per-expert checkpoint names grouped as {prefix: {"gate"|"up"|"down": {expert: name}}}, and the other names."""
    groups: dict[str, dict[str, dict[int, str]]] = {}
    others = []
    for name in names:
        match = PER_EXPERT_KEY.match(name)
        if match is None:
            others.append(name)
            continue
        parts = groups.setdefault(match["prefix"], {"gate": {}, "up": {}, "down": {}})
        parts[PER_EXPERT_PARTS[match["name"]]][int(match["expert"])] = name
    for prefix, parts in groups.items():
        indices = sorted(parts["down"])
        if not (indices == list(range(len(indices))) and sorted(parts["gate"]) == indices == sorted(parts["up"])):
            raise ValueError(f"Per-expert tensors under {prefix!r} are incomplete: experts {indices}.")
    return groups, others


def fuse_expert_weights(state_dict: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """Per-expert tensors -> HF's fused layout; fused state dicts pass through unchanged.

    `...experts.N.{w1,w3}` / `{gate,up}_proj` -> `...mlp.experts.gate_up_proj [E, 2I, D]` (gate rows first),
    `...experts.N.{w2,down_proj}` -> `...mlp.experts.down_proj [E, D, I]`;
    Mixtral's `block_sparse_moe.gate` -> `mlp.gate`.
    """
    groups, others = _per_expert_groups(state_dict)
    fused = {key.replace(".block_sparse_moe.", ".mlp."): state_dict[key] for key in others}
    for prefix, parts in groups.items():
        indices = sorted(parts["down"])
        fused[f"{prefix}mlp.experts.gate_up_proj"] = torch.stack(
            [torch.cat([state_dict[parts["gate"][index]], state_dict[parts["up"][index]]]) for index in indices]
        )  # [E, 2I, D]
        fused[f"{prefix}mlp.experts.down_proj"] = torch.stack(
            [state_dict[parts["down"][index]] for index in indices]
        )  # [E, D, I]
    return fused


def drop_upcycled_experts(
    gate: torch.Tensor, up: torch.Tensor, down: torch.Tensor, num_experts: int, expert_noise: float, seed: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """One layer's dense MLP copied into E experts: gate_up_proj [E, 2I, D] (gate rows first), down_proj [E, D, I].

    `expert_noise` r in [0, 1]: Drop-Upcycling, each expert re-draws a random fraction r of its hidden units (rows of
    gate and up, columns of down) from a normal with the dense matrix's mean and std, from a generator seeded by
    `seed` (one per layer). r > 0 is not exact.
    """
    hidden_units = gate.shape[0]
    gate_up_proj = torch.cat([gate, up]).expand(num_experts, -1, -1).clone()  # [E, 2I, D]
    down_proj = down.expand(num_experts, -1, -1).clone()  # [E, D, I]
    if expert_noise > 0.0:
        generator = torch.Generator().manual_seed(seed)
        num_dropped = round(expert_noise * hidden_units)
        for expert in range(num_experts):
            dropped = torch.randperm(hidden_units, generator=generator)[:num_dropped]  # [r * I]
            for rows, dense in ((dropped, gate), (dropped + hidden_units, up)):
                noise = torch.randn(num_dropped, dense.shape[1], generator=generator, dtype=dense.dtype)
                gate_up_proj[expert, rows] = dense.mean() + dense.std() * noise  # [r * I, D]
            noise = torch.randn(down.shape[0], num_dropped, generator=generator, dtype=down.dtype)
            down_proj[expert][:, dropped] = down.mean() + down.std() * noise  # [D, r * I]
    return gate_up_proj, down_proj


def _check_expert_noise(expert_noise: float) -> None:
    if not (isinstance(expert_noise, (int, float)) and 0.0 <= expert_noise <= 1.0):
        raise ValueError(
            f"expert_noise must be a fraction in [0, 1] (share of each expert's hidden units re-initialised, "
            f"Drop-Upcycling), got {expert_noise!r}."
        )


def plan_dar_moe_tensors(
    source_infos: Mapping[str, TensorInfo], config: DARMoeConfig, expert_noise: float = 0.0, seed: int = 0
) -> dict[str, TensorPlan]:
    """`TargetKind.plan_tensors` of "dar_moe", from names and shapes only.

    MoE source: per-expert tensors become the fused 3-D experts as byte concatenations (expert by expert, gate rows
    then up rows), Mixtral's `block_sparse_moe` becomes `mlp`, everything else keeps its name. Dense source: every
    sparse layer's `mlp.{gate,up,down}_proj` becomes E copies (`experts.gate_up_proj` = (gate, up) x E,
    `experts.down_proj` = down x E); with `expert_noise` a Drop-Upcycling transform of the three (per-layer seed).
    """
    _check_expert_noise(expert_noise)
    names = [name for name in source_infos if not is_ignored_source_key(name)]
    groups, others = _per_expert_groups(names)
    moe_source = bool(groups) or any(".experts." in name or ".block_sparse_moe." in name for name in names)
    if moe_source and expert_noise:
        raise ValueError("expert_noise applies to sparse upcycling of a dense model only, not to an MoE source.")
    plans = {
        name.replace(".block_sparse_moe.", ".mlp."): TensorPlan(source_infos[name].shape, source_infos[name].dtype, (name,))
        for name in others
    }
    for prefix, parts in groups.items():
        indices = sorted(parts["down"])
        gate, up, down = (source_infos[parts[part][0]] for part in ("gate", "up", "down"))
        plans[f"{prefix}mlp.experts.gate_up_proj"] = TensorPlan(
            (len(indices), gate.shape[0] + up.shape[0], *gate.shape[1:]), gate.dtype,
            tuple(name for index in indices for name in (parts["gate"][index], parts["up"][index])),
        )
        plans[f"{prefix}mlp.experts.down_proj"] = TensorPlan(
            (len(indices), *down.shape), down.dtype, tuple(parts["down"][index] for index in indices)
        )
    if moe_source:
        return plans
    num_experts = config.num_experts
    for layer_idx in config.moe_layer_indices:
        prefix = f"model.layers.{layer_idx}.mlp."
        dense = [plans.pop(f"{prefix}{name}.weight", None) for name in ("gate_proj", "up_proj", "down_proj")]
        if any(plan is None for plan in dense):
            raise ValueError(f"The dense MLP of layer {layer_idx} ({prefix}gate_proj/up_proj/down_proj) is missing.")
        (gate_name,), (up_name,), (down_name,) = (plan.parts for plan in dense)
        gate_up_shape = (num_experts, dense[0].shape[0] + dense[1].shape[0], dense[0].shape[1])
        down_shape = (num_experts, *dense[2].shape)
        if expert_noise:
            layer_seed = seed * 1_000_003 + layer_idx

            def noisy(which: int, layer_seed: int = layer_seed):
                return lambda tensors: drop_upcycled_experts(*tensors, num_experts, expert_noise, layer_seed)[which]

            parts = (gate_name, up_name, down_name)
            plans[f"{prefix}experts.gate_up_proj"] = TensorPlan(gate_up_shape, dense[0].dtype, parts, noisy(0))
            plans[f"{prefix}experts.down_proj"] = TensorPlan(down_shape, dense[2].dtype, parts, noisy(1))
        else:
            plans[f"{prefix}experts.gate_up_proj"] = TensorPlan(
                gate_up_shape, dense[0].dtype, (gate_name, up_name) * num_experts
            )
            plans[f"{prefix}experts.down_proj"] = TensorPlan(down_shape, dense[2].dtype, (down_name,) * num_experts)
    return plans


def map_dar_moe_state_dict(
    source_state: dict[str, torch.Tensor], config: DARMoeConfig, expert_noise: float = 0.0, seed: int = 0
) -> dict[str, torch.Tensor]:
    """Source state dict -> DAR-MoE state dict of the shared parameters, through `plan_dar_moe_tensors`."""
    checkpoint = StateDictCheckpoint(source_state)
    plans = plan_dar_moe_tensors(checkpoint.infos(), config, expert_noise, seed)
    return {name: materialise(plan, checkpoint) for name, plan in plans.items()}


def upcycle_dense_mlps(
    state_dict: dict[str, torch.Tensor],
    config: DARMoeConfig,
    expert_noise: float = 0.0,
    seed: int = 0,
) -> dict[str, torch.Tensor]:
    """Sparse upcycling of a dense state dict: each sparse layer's MLP is copied into all E experts
    (`drop_upcycled_experts`, Drop-Upcycling noise with `expert_noise > 0`)."""
    upcycled = map_dar_moe_state_dict(state_dict, config, expert_noise, seed)
    if expert_noise > 0.0:
        _warn_not_exact(expert_noise)
    return upcycled


def _warn_not_exact(expert_noise: float) -> None:
    logger.warning(
        f"expert_noise={expert_noise}: each expert re-initialised {expert_noise:.0%} of its hidden units "
        "(Drop-Upcycling). The converted model is NOT function-preserving: its logits differ from the source's."
    )


def build_dar_moe_target_config(
    source_config: PretrainedConfig, branch_family: str, dtype: torch.dtype, fields: dict
) -> DARMoeConfig:
    """`TargetKind.build_config` of "dar_moe": `fields` holds num_experts, num_experts_per_tok and DAR options.

    `branch_family` is the converter's `source_family`; `dar_moe_config_from_source` derives the same one (and
    Llama's attention for a Qwen2-MoE source without q/k/v biases).
    """
    fields = dict(fields)
    config = dar_moe_config_from_source(
        source_config, fields.pop("num_experts", None), fields.pop("num_experts_per_tok", None), **fields
    )
    if dtype == torch.float64:
        # transformers' grouped_mm experts kernel takes float32/bf16/fp16 only; batched_mm is its float64-capable peer.
        config._experts_implementation = "batched_mm"
    config.dtype = dtype
    config.architectures = ["DARMoeForCausalLM"]
    return config


def dar_moe_target_kind(expert_noise: float = 0.0, seed: int = 0) -> TargetKind:
    """The DAR-MoE target of `dar_transformers.convert`; `expert_noise > 0` is Drop-Upcycling (not exact)."""
    return TargetKind(
        model_class=DARMoeForCausalLM,
        build_config=build_dar_moe_target_config,
        plan_tensors=lambda source_infos, config: plan_dar_moe_tensors(source_infos, config, expert_noise, seed),
        # The routers are new when upcycling a dense model; an MoE source supplies them, so they are never missing.
        new_parameters=(*DAR_NEW_PARAMETERS, r"model\.layers\.\d+\.mlp\.gate\.weight"),
        description="DAR-MoE (Dual Attention Residuals, sparse mixture of experts)"
        + (f", Drop-Upcycling expert_noise={expert_noise} (not exact)" if expert_noise else ""),
    )


register_target_kind("dar_moe", dar_moe_target_kind())
DROP_UPCYCLING_KIND = "dar_moe_drop_upcycling"  # registered per call with the requested noise and seed


def convert_to_dar_moe(
    source: PreTrainedModel,
    num_experts: int | None = None,
    top_k: int | None = None,
    expert_noise: float = 0.0,
    seed: int = 0,
    dtype: torch.dtype | None = None,
    **dar_fields,
) -> DARMoeForCausalLM:
    """An in-memory source -> DAR-MoE, unverified: sparse upcycling (dense source) or an MoE source as is.

    Raises if any source tensor would be dropped or any target parameter other than the new ones (DAR residual
    modules; routers when upcycling) would stay unloaded. For a verified, written conversion use `upcycle_to_dar_moe`.
    """
    kind = _kind_for(expert_noise, seed)
    fields = dict(num_experts=num_experts, num_experts_per_tok=top_k, **dar_fields)
    return upcycle_model(source, kind, dtype, **fields)


def upcycle_to_dar_moe(
    source: PreTrainedModel | str | os.PathLike,
    output: str | os.PathLike | None = None,
    *,
    num_experts: int | None = None,
    top_k: int | None = None,
    expert_noise: float = 0.0,
    seed: int = 0,
    **options,
) -> ConversionResult:
    """`dar convert --experts E --top-k k [--expert-noise X]`: convert, verify and write, as the dense converter.

    A dense source is sparse-upcycled (E and k required); an MoE source (Mixtral, Qwen2-MoE, Qwen3-MoE) keeps its
    experts and routing. `options` are those of `dar_transformers.convert.upcycle` (dtype, tolerance, tokenizer,
    DAR fields, ...). With `expert_noise > 0` the result is deliberately not exact: unless a tolerance is given, the
    verification only reports the differences (a relaxed check, recorded in the model card) instead of refusing.

    ```python
    >>> from dar_transformers.moe_upcycling import upcycle_to_dar_moe
    >>> result = upcycle_to_dar_moe("SmolLM2-135M-Instruct.Q4_1.gguf", "smollm2-dar-moe", num_experts=4, top_k=2)
    ```
    """
    if expert_noise and options.get("tolerance") is None:
        options["tolerance"] = math.inf
    kind = _kind_for(expert_noise, seed)
    return upcycle(source, output, kind=kind, num_experts=num_experts, num_experts_per_tok=top_k, **options)


def _kind_for(expert_noise: float, seed: int) -> str:
    _check_expert_noise(expert_noise)
    if expert_noise:
        _warn_not_exact(expert_noise)
    if not expert_noise:
        return "dar_moe"
    register_target_kind(DROP_UPCYCLING_KIND, dar_moe_target_kind(expert_noise, seed))
    return DROP_UPCYCLING_KIND


__all__ = [
    "dar_moe_config_from_source",
    "fuse_expert_weights",
    "upcycle_dense_mlps",
    "map_dar_moe_state_dict",
    "dar_moe_target_kind",
    "convert_to_dar_moe",
    "upcycle_to_dar_moe",
]
