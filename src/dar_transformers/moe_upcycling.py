# SPDX-License-Identifier: Apache-2.0
# Copyright 2026 The dar-transformers authors.
"""Conversion to DAR-MoE: sparse upcycling of dense checkpoints, and Mixtral / Qwen2-MoE / Qwen3-MoE checkpoints.

Two sources, one target (`DARMoeForCausalLM`), one verification (logits and greedy tokens against the source):

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

The conversion is data plus a small function (STYLE.md item 10): the tables below, the list of new parameters,
a check that nothing else is missing or unexpected, and a numerical verification.
"""

import dataclasses
import math
import re

import torch
from transformers import AutoModelForCausalLM, PreTrainedModel, PretrainedConfig
from transformers.utils import logging

from .configuration_dar_moe import DARMoeConfig
from .modeling_dar_moe import DARMoeForCausalLM

logger = logging.get_logger(__name__)

# Source model_type -> the DAR branch family whose attention module reproduces it.
SOURCE_BRANCH_FAMILIES = {
    "llama": "llama",
    "mistral": "mistral",
    "qwen2": "qwen2",
    "qwen3": "qwen3",
    "mixtral": "mistral",
    "qwen2_moe": "qwen2",
    "qwen3_moe": "qwen3",
}
MOE_SOURCE_TYPES = ("mixtral", "qwen2_moe", "qwen3_moe")

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
    r"^(?P<prefix>.*\.)(?:block_sparse_moe|mlp)\.experts\.(?P<expert>\d+)\.(?P<name>w1|w2|w3|gate_proj|up_proj|down_proj)"
    r"\.weight$"
)
# Parameters the conversion creates: DAR's residual modules (initialised by `_init_weights` to the exact reduction),
# and, when upcycling a dense model, the routers (random, as in sparse upcycling).
DAR_PARAMETER = re.compile(r"(^|\.)(attn_residual|mlp_residual|final_readout)\.")
ROUTER_PARAMETER = re.compile(r"(^|\.)layers\.\d+\.mlp\.gate\.weight$")


@dataclasses.dataclass
class MoeConversionReport:
    """What `verify_conversion` measured: the target against its source on the same tokens."""

    max_abs_logit_diff: float
    greedy_identical: bool
    exact_by_construction: bool  # False with expert_noise > 0 (Drop-Upcycling breaks the reduction on purpose)
    dtype: str


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
    model_type = source_config.model_type
    if model_type not in SOURCE_BRANCH_FAMILIES:
        raise ValueError(
            f"source model_type must be one of {list(SOURCE_BRANCH_FAMILIES)} for DAR-MoE conversion, got {model_type!r}."
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
    return DARMoeConfig(**{**fields, **dar_fields})


def fuse_expert_weights(state_dict: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """Per-expert tensors -> HF's fused layout; fused state dicts pass through unchanged.

    `...experts.N.{w1,w3}` / `{gate,up}_proj` -> `...mlp.experts.gate_up_proj [E, 2I, D]` (gate rows first),
    `...experts.N.{w2,down_proj}` -> `...mlp.experts.down_proj [E, D, I]`; Mixtral's `block_sparse_moe.gate` -> `mlp.gate`.
    """
    fused: dict[str, torch.Tensor] = {}
    experts: dict[str, dict[str, dict[int, torch.Tensor]]] = {}
    for key, tensor in state_dict.items():
        match = PER_EXPERT_KEY.match(key)
        if match is None:
            fused[key.replace(".block_sparse_moe.", ".mlp.")] = tensor
            continue
        parts = experts.setdefault(match["prefix"], {"gate": {}, "up": {}, "down": {}})
        parts[PER_EXPERT_PARTS[match["name"]]][int(match["expert"])] = tensor
    for prefix, parts in experts.items():
        indices = sorted(parts["down"])
        if not (indices == list(range(len(indices))) and sorted(parts["gate"]) == indices == sorted(parts["up"])):
            raise ValueError(f"Per-expert tensors under {prefix!r} are incomplete: experts {indices}.")
        fused[f"{prefix}mlp.experts.gate_up_proj"] = torch.stack(
            [torch.cat([parts["gate"][index], parts["up"][index]]) for index in indices]
        )  # [E, 2I, D]
        fused[f"{prefix}mlp.experts.down_proj"] = torch.stack([parts["down"][index] for index in indices])  # [E, D, I]
    return fused


def upcycle_dense_mlps(
    state_dict: dict[str, torch.Tensor],
    config: DARMoeConfig,
    expert_noise: float = 0.0,
    seed: int = 0,
) -> dict[str, torch.Tensor]:
    """Sparse upcycling of a dense state dict: each sparse layer's MLP is copied into all E experts.

    `expert_noise` r in [0, 1]: Drop-Upcycling, each expert re-draws a random fraction r of its hidden units (rows of
    gate and up, columns of down) from a normal with the dense matrix's mean and std. r > 0 is not exact.
    """
    if not (isinstance(expert_noise, (int, float)) and 0.0 <= expert_noise <= 1.0):
        raise ValueError(
            f"expert_noise must be a fraction in [0, 1] (share of each expert's hidden units re-initialised, "
            f"Drop-Upcycling), got {expert_noise!r}."
        )
    generator = torch.Generator().manual_seed(seed)
    num_experts, hidden_units = config.num_experts, config.moe_intermediate_size
    upcycled = dict(state_dict)
    for layer_idx in config.moe_layer_indices:
        prefix = f"model.layers.{layer_idx}.mlp."
        gate, up, down = (upcycled.pop(f"{prefix}{name}.weight") for name in ("gate_proj", "up_proj", "down_proj"))
        gate_up_proj = torch.cat([gate, up]).expand(num_experts, -1, -1).clone()  # [E, 2I, D]
        down_proj = down.expand(num_experts, -1, -1).clone()  # [E, D, I]
        if expert_noise > 0.0:
            num_dropped = round(expert_noise * hidden_units)
            for expert in range(num_experts):
                dropped = torch.randperm(hidden_units, generator=generator)[:num_dropped]  # [r * I]
                for rows, dense in ((dropped, gate), (dropped + hidden_units, up)):
                    noise = torch.randn(num_dropped, dense.shape[1], generator=generator, dtype=dense.dtype)
                    gate_up_proj[expert, rows] = dense.mean() + dense.std() * noise  # [r * I, D]
                noise = torch.randn(down.shape[0], num_dropped, generator=generator, dtype=down.dtype)
                down_proj[expert][:, dropped] = down.mean() + down.std() * noise  # [D, r * I]
        upcycled[f"{prefix}experts.gate_up_proj"] = gate_up_proj
        upcycled[f"{prefix}experts.down_proj"] = down_proj
    return upcycled


def _is_new_parameter(key: str, upcycled: bool) -> bool:
    return bool(DAR_PARAMETER.search(key) or (upcycled and ROUTER_PARAMETER.search(key)))


def convert_to_dar_moe(
    source: PreTrainedModel,
    num_experts: int | None = None,
    top_k: int | None = None,
    expert_noise: float = 0.0,
    seed: int = 0,
    **dar_fields,
) -> DARMoeForCausalLM:
    """A DAR-MoE model with the source's weights: sparse upcycling (dense source) or an MoE source converted as is.

    The target runs in float32, or float64 for a float64 source. Raises if any source tensor would be dropped or any
    target parameter other than the new ones (DAR residual modules; routers when upcycling) would stay unloaded.
    """
    config = dar_moe_config_from_source(source.config, num_experts, top_k, **dar_fields)
    is_moe_source = source.config.model_type in MOE_SOURCE_TYPES
    if is_moe_source and expert_noise:
        raise ValueError("expert_noise applies to sparse upcycling of a dense model only, not to an MoE source.")
    state_dict = fuse_expert_weights(source.state_dict())
    if not is_moe_source:
        state_dict = upcycle_dense_mlps(state_dict, config, expert_noise=expert_noise, seed=seed)

    dtype = torch.promote_types(source.dtype, torch.float32)
    target = DARMoeForCausalLM(config).to(dtype)
    missing, unexpected = target.load_state_dict(state_dict, strict=False)
    unexplained = [key for key in missing if not _is_new_parameter(key, upcycled=not is_moe_source)]
    if unexplained or unexpected:
        raise ValueError(
            f"Conversion of {source.config.model_type} to DAR-MoE left target parameters unloaded {unexplained} or "
            f"source tensors unused {list(unexpected)}."
        )
    if dtype == torch.float64:
        # transformers' grouped_mm experts kernel takes float32/bf16/fp16 only; batched_mm is its float64-capable peer.
        target.set_experts_implementation("batched_mm")
    if expert_noise > 0.0:
        logger.warning(
            f"expert_noise={expert_noise}: each expert re-initialised {expert_noise:.0%} of its hidden units "
            "(Drop-Upcycling). The converted model is NOT function-preserving: its logits differ from the source's."
        )
    return target.eval()


@torch.no_grad()
def verify_conversion(
    source: PreTrainedModel,
    target: DARMoeForCausalLM,
    input_ids: torch.LongTensor,
    max_new_tokens: int = 8,
    exact_by_construction: bool = True,
) -> MoeConversionReport:
    """Max |logit difference| on `input_ids` and whether greedy continuations agree (DESIGN.md section 3 checks)."""
    source_logits = source(input_ids).logits
    target_logits = target(input_ids).logits
    max_abs_logit_diff = (source_logits.double() - target_logits.double()).abs().max().item()
    greedy = dict(max_new_tokens=max_new_tokens, do_sample=False, pad_token_id=source.config.eos_token_id)
    source_tokens = source.generate(input_ids, **greedy)
    target_tokens = target.generate(input_ids, **greedy)
    greedy_identical = source_tokens.shape == target_tokens.shape and bool((source_tokens == target_tokens).all())
    return MoeConversionReport(max_abs_logit_diff, greedy_identical, exact_by_construction, str(target_logits.dtype))


def convert_checkpoint_to_dar_moe(
    source_path: str,
    output_dir: str,
    num_experts: int | None = None,
    top_k: int | None = None,
    expert_noise: float = 0.0,
    seed: int = 0,
    gguf_file: str | None = None,
    tolerance: float = 2e-4,
    verify_input_ids: torch.LongTensor | None = None,
    **dar_fields,
) -> MoeConversionReport:
    """Load a source checkpoint (folder, or GGUF), convert it to DAR-MoE, verify, and `save_pretrained` it.

    Raises if an exact conversion misses `tolerance` in float32 or changes greedy tokens; with `expert_noise > 0`
    the differences are reported (logged), not raised, because that conversion is deliberately not exact.
    """
    source = AutoModelForCausalLM.from_pretrained(source_path, gguf_file=gguf_file, dtype=torch.float32).eval()
    target = convert_to_dar_moe(source, num_experts, top_k, expert_noise=expert_noise, seed=seed, **dar_fields)
    if verify_input_ids is None:
        verify_input_ids = torch.arange(1, 17).unsqueeze(0) % source.config.vocab_size  # [1, 16] fixed token ids
    report = verify_conversion(source, target, verify_input_ids, exact_by_construction=expert_noise == 0.0)
    logger.warning(
        f"DAR-MoE conversion check: max |logit diff| {report.max_abs_logit_diff:.3g} ({report.dtype}), "
        f"greedy continuation identical: {report.greedy_identical}."
    )
    if report.exact_by_construction and not (
        math.isfinite(report.max_abs_logit_diff)
        and report.max_abs_logit_diff <= tolerance
        and report.greedy_identical
    ):
        raise RuntimeError(
            f"DAR-MoE conversion is not exact: max |logit diff| {report.max_abs_logit_diff:.3g} > {tolerance} or "
            f"greedy continuations differ ({report.greedy_identical=})."
        )
    target.save_pretrained(output_dir)
    return report


__all__ = [
    "MoeConversionReport",
    "dar_moe_config_from_source",
    "fuse_expert_weights",
    "upcycle_dense_mlps",
    "convert_to_dar_moe",
    "verify_conversion",
    "convert_checkpoint_to_dar_moe",
]
