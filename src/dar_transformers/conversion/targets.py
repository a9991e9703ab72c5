# SPDX-License-Identifier: Apache-2.0
# Copyright 2026 The dar-transformers authors.
"""What a conversion produces: the target kinds, each saying how its config is built from the source's, how each of
its tensors is made from source tensors (from names and shapes alone), and which parameters it adds.

- **"dar"** (dense DAR): every shared tensor is its source tensor under the same name (`keymaps.DAR_KEY_MAP`); DAR
  adds its residual modules (`keymaps.DAR_NEW_PARAMETERS`).
- **"dar_moe"** (DAR-MoE, DESIGN.md sections 3 and 4), from two kinds of source:
  - *sparse upcycling* (Komatsuzaki et al., arXiv 2212.05055) of a dense Llama-family model: every expert of every
    sparse layer is a copy of that layer's dense MLP, the router is fresh (a new parameter), everything else is
    copied. Exact: whichever k experts the router picks, they all compute MLP(x), and with `norm_topk_prob=True` their
    weights sum to 1, so the block returns MLP(x). `expert_noise > 0` (Drop-Upcycling, arXiv 2502.19261)
    re-initialises that share of each expert's hidden units so that experts specialise: **no longer exact**.
  - *MoE sources* (Mixtral, Qwen2-MoE, Qwen3-MoE): the MoE weights keep their names, per-expert tensors are fused
    into HF's 3-D layout, the MoE config fields are copied (`families.MOE_CONFIG_FIELDS`): exact like dense DAR.

Both kinds take the source's architecture fields from `families.source_architecture` (one list, for both).
"""

import dataclasses
import operator
import re
from collections.abc import Callable, Mapping
from pathlib import Path

import torch
from huggingface_hub.errors import StrictDataclassError
from transformers import PreTrainedConfig, PreTrainedModel
from transformers.utils import logging

from ..configuration_dar import DARConfig
from ..configuration_dar_moe import DARMoeConfig
from ..modeling_dar import DAR_BRANCH_MODULES, DARForCausalLM
from ..modeling_dar_moe import DARMoeForCausalLM
from .families import (
    ALL_SOURCE_FAMILIES,
    MOE_CONFIG_FIELDS,
    DAR_SOURCE_TYPE,
    MOE_SOURCE_FAMILIES,
    SOURCE_FAMILIES,
    UnsupportedArchitectureError,
    source_architecture,
    source_family,
)
from .keymaps import (
    DAR_NEW_PARAMETERS,
    MOE_ROUTER_PARAMETERS,
    TensorInfo,
    TensorPlan,
    is_ignored_source_key,
    map_keys,
    moe_layout,
    per_expert_groups,
)

logger = logging.get_logger(__name__)


@dataclasses.dataclass(frozen=True)
class TargetKind:
    """A model kind a source converts into.

    `build_config(source_config, branch_family, dtype, fields)` returns the target config (validating `fields`, the
    kind's keyword arguments, e.g. `dar_block_size`); `plan_tensors(source_infos, target_config)` says how each
    shared target tensor is made from source tensors (`TensorPlan`: a concatenation of whole source tensors, or a
    transform of them), from names and shapes alone; `new_parameters` are regexes of the target parameters the
    source has no counterpart for, which get their `_init_weights` value.
    """

    model_class: type[PreTrainedModel]
    build_config: Callable[[PreTrainedConfig, str, torch.dtype, Mapping[str, object]], PreTrainedConfig]
    plan_tensors: Callable[[Mapping[str, TensorInfo], PreTrainedConfig], dict[str, TensorPlan]]
    new_parameters: tuple[str, ...]
    description: str
    exact: bool = True  # False: the target deliberately differs from the source (Drop-Upcycling)


def _option_fields(config_class: type[DARConfig]) -> frozenset[str]:
    """The DAR options a conversion may set (the architecture fields come from the source)."""
    return frozenset(field.name for field in dataclasses.fields(config_class)
                     if field.name.startswith("dar_") and field.name != "dar_branch_family")


DAR_OPTION_FIELDS = _option_fields(DARConfig)
# Which layers sparse upcycling makes sparse (Qwen2/3-MoE's rule, `DARMoeConfig.is_sparse_layer`): the others keep
# their dense MLP as it is. An MoE source's layers are what they are (its own fields, which are not options).
SPARSE_LAYER_FIELDS = frozenset({"mlp_only_layers", "decoder_sparse_step"})
DAR_MOE_OPTION_FIELDS = (_option_fields(DARMoeConfig) | {"router_aux_loss_coef", "output_router_logits"}
                         | SPARSE_LAYER_FIELDS)


# Every config field a conversion keyword may set, of any target kind (`ConversionOptions.split` refuses others).
TARGET_FIELDS = DAR_OPTION_FIELDS | DAR_MOE_OPTION_FIELDS | {"num_experts", "num_experts_per_tok", "top_k"}


def _check_fields(fields: Mapping[str, object], allowed: frozenset[str], kind: str) -> None:
    unknown = sorted(set(fields) - allowed)
    if unknown:
        raise TypeError(f"Unknown {kind} field(s) {unknown}; allowed: {sorted(allowed)}.")


def validated_config(config_class: type[DARConfig], fields: Mapping[str, object]) -> DARConfig:
    """`config_class(**fields)`, its validator's message (field name, allowed values) as a one-line ValueError."""
    try:
        return config_class(**fields)
    except StrictDataclassError as error:
        raise ValueError(" ".join(str(error.__cause__ or error).split())) from error


def _finish(config: DARConfig, dtype: torch.dtype, architecture: str) -> DARConfig:
    config.dtype = dtype
    config.architectures = [architecture]
    return config


# --------------------------------------------------------------------------------------------------------------
# Dense DAR.


def build_dar_config(
    source_config: PreTrainedConfig, branch_family: str, dtype: torch.dtype, fields: Mapping[str, object]
) -> DARConfig:
    """The DAR config of a source: its architecture fields, the DAR fields from `fields` (validated)."""
    _check_fields(fields, DAR_OPTION_FIELDS, "DAR")
    if source_config.model_type == DAR_SOURCE_TYPE:
        raise UnsupportedArchitectureError(
            "The source is already a dense DAR model (model_type 'dar'); kind 'dar' converts Llama-family models. "
            "--kind dar_moe with --experts/--top-k (upcycle_to_dar_moe in Python) upcycles it to DAR-MoE, keeping its "
            "DAR parameters."
        )
    if source_config.model_type not in SOURCE_FAMILIES:  # an MoE family: DAR-MoE converts it
        raise UnsupportedArchitectureError(
            f"Kind 'dar' converts dense {sorted(SOURCE_FAMILIES)} models; model_type {source_config.model_type!r} is "
            "a mixture of experts: convert it to DAR-MoE with --kind dar_moe (upcycle_to_dar_moe in Python; "
            f"available kinds: {sorted(TARGET_KINDS)})."
        )
    architecture = source_architecture(source_config)
    config = validated_config(DARConfig, {**architecture, **fields, "dar_branch_family": branch_family})
    return _finish(config, dtype, "DARForCausalLM")


def plan_dar_tensors(source_infos: Mapping[str, TensorInfo], config: PreTrainedConfig) -> dict[str, TensorPlan]:
    """Kind "dar": every shared tensor is its source tensor under the same name."""
    return {
        target: TensorPlan(source_infos[source].shape, source_infos[source].dtype, (source,))
        for target, source in map_keys(source_infos).items()
    }


DAR_TARGET = TargetKind(
    model_class=DARForCausalLM,
    build_config=build_dar_config,
    plan_tensors=plan_dar_tensors,
    new_parameters=DAR_NEW_PARAMETERS,
    description="Dual Attention Residuals (dense)",
)


# --------------------------------------------------------------------------------------------------------------
# DAR-MoE.


def dar_moe_config_from_source(
    source_config: PreTrainedConfig, num_experts: int | None = None, top_k: int | None = None, **dar_fields
) -> DARMoeConfig:
    """The DAR-MoE config of a source: its architecture fields, its MoE fields (MoE source) or E and k (upcycling).

    `dar_fields` sets any other DARMoeConfig option (e.g. `dar_block_size`; for upcycling, `mlp_only_layers` and
    `decoder_sparse_step`: the layers left dense); exactness holds for every DAR setting that DESIGN.md section 3
    calls exact.
    """
    _check_fields(dar_fields, DAR_MOE_OPTION_FIELDS, "DAR-MoE")
    model_type = source_config.model_type
    if model_type == DAR_SOURCE_TYPE:
        dar_fields = {**_kept_dar_fields(source_config, dar_fields), **dar_fields}
    elif model_type not in ALL_SOURCE_FAMILIES:
        raise UnsupportedArchitectureError(
            f"Cannot convert model_type {model_type!r} to DAR-MoE: the source must be one of "
            f"{sorted(SOURCE_FAMILIES) + sorted(MOE_SOURCE_FAMILIES)}."
        )
    fields = source_architecture(source_config)
    fields["dar_branch_family"] = source_family(source_config)
    if model_type == "qwen2_moe" and not source_config.qkv_bias:
        # Qwen2's attention always has q/k/v biases; without them it is Llama's attention (o_proj has none in both).
        fields.update(dar_branch_family="llama", attention_bias=False)
    if model_type in MOE_SOURCE_FAMILIES:
        chosen = sorted(SPARSE_LAYER_FIELDS & set(dar_fields))
        if chosen:
            raise ValueError(
                f"{', '.join(chosen)} choose which layers sparse upcycling makes sparse; the {model_type} source's "
                "layers are sparse or dense as it stores them (leave them unset)."
            )
        for name, source_value in MOE_CONFIG_FIELDS[model_type].items():
            fields[name] = getattr(source_config, source_value) if isinstance(source_value, str) else source_value
        if fields.get("mlp_only_layers"):  # transformers tests membership: an index of no layer selects nothing
            layers = range(source_config.num_hidden_layers)
            fields["mlp_only_layers"] = [index for index in fields["mlp_only_layers"] if index in layers]
        for name, requested in (("num_experts", num_experts), ("num_experts_per_tok", top_k)):
            if requested is not None and requested != fields[name]:
                raise ValueError(
                    f"{name}={requested} differs from the {model_type} source's {fields[name]}: an MoE source keeps "
                    "its experts and routing (leave experts/top_k unset)."
                )
    else:
        if num_experts is None or top_k is None:
            raise ValueError(
                f"Upcycling a dense {model_type} model needs num_experts and top_k (--experts and --top-k; got "
                f"{num_experts!r}, {top_k!r})."
            )
        if _mlp_has_biases(source_config):
            raise ValueError(
                f"Sparse upcycling needs a bias-free MLP (HF experts have no biases), but "
                f"{_config_file(source_config)} says mlp_bias=true: "
                + ("a dense DAR model with MLP biases has no DAR-MoE upcycle." if model_type == DAR_SOURCE_TYPE else
                   "this model converts to dense DAR only (leave out --experts/--top-k).")
            )
        fields.update(
            num_experts=num_experts,
            num_experts_per_tok=top_k,
            moe_intermediate_size=source_config.intermediate_size,
            norm_topk_prob=True,  # the top-k weights of identical experts must sum to 1 (DESIGN.md section 3)
            shared_expert_intermediate_size=0,
        )
    try:
        return validated_config(DARMoeConfig, {**fields, **dar_fields})
    except ValueError as error:
        blamed = _blamed_on_the_source(error, source_config, dar_fields)
        if blamed is error:
            raise
        raise blamed from error


def _blamed_on_the_source(error: ValueError, source_config: PreTrainedConfig, dar_fields: Mapping) -> ValueError:
    """DARMoeConfig's refusal of a value an MoE source's config.json gave (`num_experts_per_tok` above its experts, a
    negative `router_aux_loss_coef`, `mlp_only_layers` covering every layer), said of the source's file and field:
    it read as a refusal of the converter's own config. A value passed as an option is left as it is."""
    model_type = source_config.model_type
    named = re.match(r"DARMoeConfig\.([a-z_]+)((?: and [a-z_]+)*)", str(error))
    source_fields = MOE_CONFIG_FIELDS.get(model_type, {})
    fields = [] if named is None else [named[1], *named[2].split(" and ")[1:]]
    if not fields or any(field not in source_fields or field in dar_fields for field in fields):
        return error
    values = ", ".join(f"{source_fields[field]}={getattr(source_config, source_fields[field], None)!r}"
                       for field in fields if isinstance(source_fields[field], str))
    if "mlp_only_layers" in fields:  # every layer dense: no experts to convert, and dense DAR takes no MoE type
        return ValueError(
            f"{_config_file(source_config)}: the {model_type} source has no sparse layer ({values}): it has no "
            f"experts, so it has no DAR-MoE upcycle, and dense DAR converts no mixture-of-experts model type."
        )
    return ValueError(f"{_config_file(source_config)}: the {model_type} source's {values} is not a setting DAR-MoE "
                      f"runs: {error}")


# What a run of a model may choose for itself (backend, kernels, history precision): everything else of a dense DAR
# source's DAR configuration shapes or initialised its DAR parameters, which its DAR-MoE upcycle keeps.
DAR_RUNTIME_FIELDS = frozenset({"dar_implementation", "dar_history_dtype", "dar_compiled_read",
                                "dar_inference_kernel", "dar_training_kernel"})


def _kept_dar_fields(source_config: DARConfig, requested: Mapping[str, object]) -> dict[str, object]:
    """The DAR fields of a dense DAR source, which its DAR-MoE upcycle keeps with its DAR parameters; a requested
    structural field (`dar_block_size`, `dar_routing`, ...) that differs from the source's is refused, naming both."""
    kept = {field: getattr(source_config, field) for field in _option_fields(DARConfig)}
    for field, value in requested.items():
        if field in kept and field not in DAR_RUNTIME_FIELDS and value != kept[field]:
            raise ValueError(
                f"{field}={value!r} differs from the dense DAR source's {kept[field]!r}: upcycling a DAR model to "
                f"DAR-MoE keeps its DAR parameters, which that setting shapes; leave {field} unset. Only "
                f"{sorted(DAR_RUNTIME_FIELDS)} may be chosen anew."
            )
    return kept


def _mlp_has_biases(source_config: PreTrainedConfig) -> bool:
    """Whether a dense source's MLP has biases: Llama's reads `mlp_bias`, while Mistral's and Qwen's have none whatever
    their config.json says (a stray `mlp_bias: true` there is no reason to refuse). Asked of the family's own MLP,
    built on the meta device."""
    mlp_class = DAR_BRANCH_MODULES[source_family(source_config)][1]
    with torch.device("meta"):
        mlp = mlp_class(source_config)
    return any(name.rsplit(".", 1)[-1] == "bias" for name, _ in mlp.named_parameters())


def _config_file(source_config: PreTrainedConfig) -> str:
    """The config.json a folder source's config was read from (its `name_or_path`), for messages."""
    config_file = Path(source_config.name_or_path or "") / "config.json"
    return str(config_file) if source_config.name_or_path and config_file.is_file() else "the source's config"


def build_dar_moe_config(
    source_config: PreTrainedConfig, branch_family: str, dtype: torch.dtype, fields: Mapping[str, object]
) -> DARMoeConfig:
    """`TargetKind.build_config` of "dar_moe": `fields` holds num_experts, num_experts_per_tok and DAR options."""
    fields = dict(fields)
    top_k, alias = fields.pop("num_experts_per_tok", None), fields.pop("top_k", None)  # `upcycle_to_dar_moe`'s name
    if alias is not None and top_k is not None and alias != top_k:
        raise ValueError(f"top_k={alias!r} and num_experts_per_tok={top_k!r} both name the experts per token; give "
                         "one of them.")
    config = dar_moe_config_from_source(
        source_config, fields.pop("num_experts", None), alias if top_k is None else top_k, **fields
    )
    if dtype == torch.float64:
        # transformers' grouped_mm experts kernel takes float32/bf16/fp16 only; batched_mm is its float64-capable peer.
        config._experts_implementation = "batched_mm"
    return _finish(config, dtype, "DARMoeForCausalLM")


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
        if num_dropped == 0:  # the experts would stay identical copies, yet be reported as not exact
            raise ValueError(
                f"expert_noise={expert_noise} re-initialises round({expert_noise} x {hidden_units}) = 0 of the "
                f"{hidden_units} hidden units of each expert, which leaves the experts identical; use 0 (exact "
                f"upcycling) or at least {1 / hidden_units:.3g}."
            )
        for expert in range(num_experts):
            dropped = torch.randperm(hidden_units, generator=generator)[:num_dropped]  # [r * I]
            for rows, dense in ((dropped, gate), (dropped + hidden_units, up)):
                noise = torch.randn(num_dropped, dense.shape[1], generator=generator, dtype=dense.dtype)
                gate_up_proj[expert, rows] = dense.mean() + dense.std() * noise  # [r * I, D]
            noise = torch.randn(down.shape[0], num_dropped, generator=generator, dtype=down.dtype)
            down_proj[expert][:, dropped] = down.mean() + down.std() * noise  # [D, r * I]
    return gate_up_proj, down_proj


def _generator_seed(seed) -> int:
    """Drop-Upcycling's `seed` as an int (numpy's integers too), refused by name unless it seeds every layer's
    generator (`seed * 1_000_003 + layer`, below 2**63)."""
    bound = 2**63 // 1_000_003 - 1_000_003
    try:
        value = None if isinstance(seed, bool) else operator.index(seed)
    except TypeError:
        value = None
    if value is None or not 0 <= value < bound:
        raise ValueError(f"seed must be an integer in [0, {bound}) (Drop-Upcycling's re-drawn hidden units, a "
                         f"generator seed per layer), got {seed!r}.")
    return value


def check_expert_noise(expert_noise: float) -> None:
    if isinstance(expert_noise, bool) or not (isinstance(expert_noise, (int, float)) and 0.0 <= expert_noise <= 1.0):
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
    check_expert_noise(expert_noise)
    names = [name for name in source_infos if not is_ignored_source_key(name)]
    kept, groups = moe_layout(names)
    moe_source = _has_experts(names)
    if moe_source and expert_noise:
        raise ValueError("expert_noise applies to sparse upcycling of a dense model only, not to an MoE source.")
    plans = {
        target: TensorPlan(source_infos[name].shape, source_infos[name].dtype, (name,)) for target, name in kept.items()
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


def _has_experts(names) -> bool:
    """Whether tensor names are an MoE checkpoint's (per-expert or fused experts), not a dense model's."""
    return bool(per_expert_groups(names)[0]) or any(".experts." in name or ".block_sparse_moe." in name
                                                    for name in names)


def untrained_router_note(config) -> str:
    """What sparse upcycling to top-1 leaves untrained, or "": the one chosen expert's renormalised weight is 1
    whatever the router's logits, so the language-modelling loss gives the new routers no gradient (measured: about
    1e-11 against 1e-3 at top-2); only the load-balancing loss trains them, and it is off unless
    `output_router_logits` is set. Said as the conversion plans (a warning) and in the model card."""
    if getattr(config, "num_experts_per_tok", None) != 1 or not config.moe_layer_indices:
        return ""
    aux = ("only the load-balancing loss trains them (output_router_logits=True, router_aux_loss_coef="
           f"{config.router_aux_loss_coef})" if config.output_router_logits else
           "the load-balancing loss is off (output_router_logits=False), so nothing trains them: set "
           "`model.config.output_router_logits = True` before training (router_aux_loss_coef="
           f"{config.router_aux_loss_coef}), or upcycle with top-k 2 or more")
    return ("With top-k 1 the chosen expert's renormalised weight is always 1, so the language-modelling loss gives "
            f"the new routers no gradient; {aux}.")


def dar_moe_target_kind(expert_noise: float = 0.0, seed: int = 0) -> TargetKind:
    """The DAR-MoE target; `expert_noise > 0` is Drop-Upcycling (not exact: its verification only reports)."""
    check_expert_noise(expert_noise)
    seed = _generator_seed(seed)

    def build_config(source_config, branch_family, dtype, fields):
        if expert_noise and source_config.model_type in MOE_SOURCE_FAMILIES:  # before the plan warns of the noise
            raise ValueError(
                f"expert_noise={expert_noise} re-draws part of the experts that sparse upcycling copies from a dense "
                f"model's MLP (Drop-Upcycling); the {source_config.model_type} source ({_config_file(source_config)}) "
                "has experts of its own, which its DAR-MoE conversion keeps as they are: leave expert_noise unset."
            )
        return build_dar_moe_config(source_config, branch_family, dtype, fields)

    def plan_tensors(source_infos, config):
        if expert_noise:  # said as the conversion plans the noise, not before a refusal of its inputs
            logger.warning(
                f"expert_noise={expert_noise}: each expert re-initialised {expert_noise:.0%} of its hidden units "
                "(Drop-Upcycling). The converted model is NOT function-preserving: its logits differ from the source's."
            )
        plans = plan_dar_moe_tensors(source_infos, config, expert_noise, seed)
        note = "" if _has_experts(list(source_infos)) else untrained_router_note(config)
        if note:
            logger.warning(note)
        return plans

    return TargetKind(
        model_class=DARMoeForCausalLM,
        build_config=build_config,
        plan_tensors=plan_tensors,
        # The routers are new when upcycling a dense model; an MoE source supplies them, so they are never missing.
        new_parameters=(*DAR_NEW_PARAMETERS, *MOE_ROUTER_PARAMETERS),
        description="DAR-MoE (Dual Attention Residuals, sparse mixture of experts)"
        + (f", Drop-Upcycling expert_noise={expert_noise}, seed {seed} (not exact)" if expert_noise else ""),
        exact=not expert_noise,
    )


# --------------------------------------------------------------------------------------------------------------
# The kinds by name (`dar convert --kind`).

TARGET_KINDS: dict[str, TargetKind] = {"dar": DAR_TARGET, "dar_moe": dar_moe_target_kind()}


def register_target_kind(name: str, kind: TargetKind) -> None:
    """Make `upcycle(..., kind=name)` (and `dar convert --kind name`) available; idempotent."""
    TARGET_KINDS[name] = kind


def target_kind(kind: str | TargetKind) -> TargetKind:
    if isinstance(kind, TargetKind):
        return kind
    if kind not in TARGET_KINDS:
        raise ValueError(f"kind must be one of {sorted(TARGET_KINDS)}, got {kind!r}.")
    return TARGET_KINDS[kind]


__all__ = [
    "DAR_TARGET",
    "TARGET_KINDS",
    "TargetKind",
    "build_dar_config",
    "dar_moe_config_from_source",
    "dar_moe_target_kind",
    "drop_upcycled_experts",
    "plan_dar_moe_tensors",
    "plan_dar_tensors",
    "register_target_kind",
    "target_kind",
]
