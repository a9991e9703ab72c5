# SPDX-License-Identifier: Apache-2.0
# Copyright 2026 The dar-transformers authors.
"""Dual Attention Residuals (DAR; Yu, Li, Liu et al., arXiv 2607.18730) on an unchanged Llama-family decoder.

What differs from `LlamaModel` (DESIGN.md section 2) is the residual path only. The attention and MLP branches,
their input norms, the rotary embedding, the final `norm` and `lm_head` are HF's own modules with Llama's attribute
names, so a Llama state dict loads without renames. Where Llama writes `h = h + F(norm(h))`, branch m of a DAR
decoder layer reads and writes a two-stream residual state through its `DARBranchResidual`:

  read    (2) s^j_r = w^j . RMSNorm_{gamma^j}(S^{kappa(j)}_r)    scores over depth, keys of stream kappa(j)
          (3) a^j   = softmax_r(s^j)                            depth weights
          (4) x^j   = N * sum_r a^j_r S^{nu(j)}_r               extraction, values of stream nu(j), count-scaled
          (5) u     = eta * (alpha x^0 + (1 - alpha) x^1)        read gate; y = F_m(u)
  write   (6) P^j   = rho P^j + (1 - rho) P^{1-j} + beta^j * y   transport + write (P^j = beta^j y opens a block)
          (7) beta^j = c * sigmoid(b^j), rho = sigmoid(r)
  commit  (8) at the end of a block of K branches: B^j_n = P^j, P^j = empty
  readout (9) one more read (2)-(5) over all committed entries feeds Llama's `norm` and `lm_head`.

Equation numbers are this docstring's, one per line of DESIGN.md section 2; the sources S^j of a read are the
committed entries B^j_0 .. B^j_{n-1} and, inside a block, the partial P^j. The modules below say *what* is read and
written; how (the plain equations, the fused fast path or two-phase reads) is a backend in `depth_backends.py`,
picked by `config.dar_implementation` the way `ALL_ATTENTION_FUNCTIONS` picks token attention.

Shape legend: B batch, T tokens, D hidden, N sources of one read, J streams. History is depth-major: sources
stacked on a leading depth axis are [N, B, T, J, D], depth weights [N, B, T, J].
Precision policy (`dar_compute_dtype`): the DAR state, depth softmax and mixing run in float32 (float64 for a
float64 model); the branch input u is cast once to the model dtype, the branch output y once back. The committed
entries may be stored in the model dtype instead (`config.dar_history_dtype`, `dar_history_dtype`).
"""

import inspect
import math
from dataclasses import dataclass
from itertools import islice

import torch
import torch.nn.functional as F
from torch import nn
from torch.nn.utils.spectral_norm import SpectralNorm
from torch.nn.utils.weight_norm import WeightNorm
from transformers import initialization as init
from transformers.cache_utils import Cache, DynamicCache
from transformers.generation import GenerationMixin
from transformers.masking_utils import create_causal_mask, create_sliding_window_causal_mask
from transformers.modeling_layers import (
    GenericForQuestionAnswering,
    GenericForSequenceClassification,
    GenericForTokenClassification,
    GradientCheckpointingLayer,
)
from transformers.modeling_outputs import BaseModelOutputWithPast, CausalLMOutputWithPast
from transformers.modeling_utils import PreTrainedModel
from transformers.models.auto.modeling_auto import (
    MODEL_FOR_CAUSAL_LM_MAPPING_NAMES,
    MODEL_FOR_QUESTION_ANSWERING_MAPPING_NAMES,
    MODEL_FOR_SEQUENCE_CLASSIFICATION_MAPPING_NAMES,
    MODEL_FOR_TOKEN_CLASSIFICATION_MAPPING_NAMES,
)
from transformers.models.llama.modeling_llama import (
    LlamaAttention,
    LlamaDecoderLayer,
    LlamaMLP,
    LlamaRMSNorm,
    LlamaRotaryEmbedding,
)
from transformers.processing_utils import Unpack
from transformers.utils import TransformersKwargs, can_return_tuple, logging
from transformers.utils.generic import merge_with_config_defaults
from transformers.utils.output_capturing import OutputRecorder, capture_outputs

from .configuration_dar import DARConfig, check_forward_fields, check_layout_unchanged, dar_layout, dar_routing
from .depth_backends import (
    DepthState, dar_compute_dtype, dar_history_dtype, depth_backend, depth_key_norm_eps, module_registrations,
)

logger = logging.get_logger(__name__)

# Every DAR-only parameter lives under a module of one of these names; everything else keeps Llama's names. The one
# list of them: the fp32 policy below, weight decay (`training.py`) and the converter's new parameters read it.
DAR_MODULE_NAMES = ("attn_residual", "mlp_residual", "final_readout")


def slice_last_positions(hidden_states: torch.Tensor, logits_to_keep: int | torch.Tensor) -> torch.Tensor:
    """hidden [B, T, D] -> [B, T', D]: an int keeps the last `logits_to_keep` positions (0 keeps all), a 1-D tensor
    picks those positions. Llama's slicing up to transformers 5.19, which has no `slice_logits_to_keep`."""
    indices = slice(-logits_to_keep, None) if isinstance(logits_to_keep, int) else logits_to_keep
    return hidden_states[:, indices, :]


try:  # transformers >= 5.20 (also takes per-row 2-D index tensors)
    from transformers.modeling_utils import slice_logits_to_keep
except ImportError:  # transformers 5.19, the newest vLLM's CPU build accepts
    slice_logits_to_keep = slice_last_positions


# The unchanged branch modules per family: (attention class, MLP class). Data, not an if-ladder.
DAR_BRANCH_MODULES: dict[str, tuple[type[nn.Module], type[nn.Module]]] = {
    "llama": (LlamaAttention, LlamaMLP),
}


def dar_parameter_dtype() -> torch.dtype:
    """The dtype DAR's parameters are created in: the compute dtype of the default dtype (`dar_compute_dtype`:
    float32, or float64 under a float64 default, as in the exactness checks), never a half dtype even when the model
    is built under one. Set in `__init__`, as transformers 5.24 checks of every `_keep_in_fp32_modules_strict`
    parameter."""
    return dar_compute_dtype(torch.get_default_dtype())


def kv_cache_argument(past_key_values: Cache | None, kwargs: dict) -> Cache | None:
    """The KV cache, whichever name the installed transformers passes it under: `past_key_values` up to 5.23,
    `cache` from 5.24 (`generate` and the heads pass `cache=`). Popped from `kwargs`, so that it reaches the decoder
    layers once; they hand it to the branch modules under the name those take (`cache_keyword`). Up to 5.23 a
    `cache` that is no `Cache` is an attention function's (continuous batching's paged cache, which Llama's
    attention passes on in its keyword arguments, never updating it as a KV cache): it stays in `kwargs`."""
    if LAYER_CACHE_KEYWORD != "cache" and not isinstance(kwargs.get("cache"), Cache):
        return past_key_values
    cache = kwargs.pop("cache", None)
    if cache is not None and past_key_values is not None:
        raise ValueError(
            "DARModel.forward got both `cache` and `past_key_values`; pass the KV cache once (transformers 5.24+ "
            "names it `cache`; PEFT's prompt learning, prefix tuning, passes `past_key_values` beside generate's "
            "`cache` before peft 0.22, and Llama's forward then drops the prefix without a word)."
        )
    return past_key_values if past_key_values is not None else cache


def cache_keyword(function) -> str:
    """The name `function` takes the KV cache under: `cache` from transformers 5.24, whose attention modules and mask
    functions still accept `past_key_values` through a shim that warns (FutureWarning) and costs a call each time;
    `past_key_values` up to 5.23. Read from the signature (`inspect` follows the shim's `__wrapped__`)."""
    return "cache" if "cache" in inspect.signature(function).parameters else "past_key_values"


MASK_CACHE_KEYWORD = cache_keyword(create_causal_mask)  # create_sliding_window_causal_mask's is the same
# The decoder layers take it under Llama's decoder layer's name: `GradientCheckpointingLayer` drops a cache passed
# under that name while it checkpoints (a backward that replays the layer would write it again), whatever the release.
LAYER_CACHE_KEYWORD = cache_keyword(LlamaDecoderLayer.forward)
# The output field holding it (5.24 renamed it too; the old name is accepted with a logged warning).
OUTPUT_CACHE_FIELD = "cache" if "cache" in BaseModelOutputWithPast.__dataclass_fields__ else "past_key_values"


def _register_branch_family(name: str, attention_class: type[nn.Module], mlp_class: type[nn.Module]) -> None:
    DAR_BRANCH_MODULES[name] = (attention_class, mlp_class)


def _register_optional_families() -> None:
    """Mistral/Qwen2/Qwen3 branches, imported lazily so the Llama path never depends on them."""
    from transformers.models.mistral.modeling_mistral import MistralAttention, MistralMLP
    from transformers.models.qwen2.modeling_qwen2 import Qwen2Attention, Qwen2MLP
    from transformers.models.qwen3.modeling_qwen3 import Qwen3Attention, Qwen3MLP

    _register_branch_family("mistral", MistralAttention, MistralMLP)
    _register_branch_family("qwen2", Qwen2Attention, Qwen2MLP)
    _register_branch_family("qwen3", Qwen3Attention, Qwen3MLP)


_register_optional_families()


@dataclass
class DARModelOutputWithPast(BaseModelOutputWithPast):
    r"""
    depth_weights (`tuple(torch.FloatTensor)`, *optional*, returned when `output_depth_weights=True`):
        The softmax weights over depth a^j of every read, in forward order (branch 0, 1, ..., then the final
        readout), each [N, B, T, J] for a read of N sources.
    """

    depth_weights: tuple[torch.FloatTensor, ...] | None = None


@dataclass
class DARCausalLMOutputWithPast(CausalLMOutputWithPast):
    r"""
    depth_weights (`tuple(torch.FloatTensor)`, *optional*, returned when `output_depth_weights=True`):
        As in `DARModelOutputWithPast`.
    """

    depth_weights: tuple[torch.FloatTensor, ...] | None = None


class DARStreamRMSNorm(nn.Module):
    """RMSNorm_{gamma^j} of the depth keys, one weight per target stream j: keys [..., J, D] -> [..., J, D]."""

    def __init__(self, num_streams: int, hidden_size: int, eps: float):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(num_streams, hidden_size, dtype=dar_parameter_dtype()))
        self.variance_epsilon = eps

    def forward(self, keys: torch.Tensor) -> torch.Tensor:
        normed = F.rms_norm(keys, (keys.shape[-1],), eps=self.variance_epsilon)  # [..., J, D]
        return normed * self.weight.to(keys.dtype)


class DARDepthAttention(nn.Module):
    """Depth-wise softmax attention over the sources of one read, eq. (2)-(4) (AttnRes eq. 2-4, routed).

    s^j_r = w^j . RMSNorm_{gamma^j}(S^{kappa(j)}_r),  a^j = softmax_r(s^j),  x^j = N * sum_r a^j_r S^{nu(j)}_r.
    The pseudo-query w is input independent and zero at init (uniform weights); there is no 1/sqrt(d). Target
    stream j takes its keys from stream kappa(j) and its values from stream nu(j) (reciprocal for "dar").
    """

    def __init__(self, config: DARConfig):
        super().__init__()
        self.num_streams = config.dar_num_streams
        streams, hidden = config.dar_num_streams, config.hidden_size
        self.pseudo_query = nn.Parameter(torch.zeros(streams, hidden, dtype=dar_parameter_dtype()))
        self.key_norm = DARStreamRMSNorm(config.dar_num_streams, config.hidden_size, depth_key_norm_eps(config))
        self.key_streams, self.value_streams = dar_routing(config)
        self.count_scaling = config.dar_count_scaling

    def count_scale(self, num_sources: int) -> float:
        """lambda = N turns the uniform mean at zero queries back into the residual sum (DESIGN.md section 3)."""
        return float(num_sources) if self.count_scaling else 1.0

    def scoring_query(self) -> torch.Tensor:
        """w * gamma [J, D]: s^j_r = (w^j * gamma^j) . k / rms(k), the key norm's weight folded into the query."""
        return self.fold_key_norm(self.pseudo_query, self.key_norm.weight)

    @staticmethod
    def fold_key_norm(pseudo_query: torch.Tensor, key_norm_weight: torch.Tensor) -> torch.Tensor:
        """`scoring_query` of any number of residuals' parameters stacked alike ([..., J, D])."""
        return pseudo_query * key_norm_weight

    def forward(self, sources: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """sources [N, B, T, J, D] (compute dtype) -> (extraction x [B, T, J, D], depth weights a [N, B, T, J])."""
        keys = self.key_norm(sources[..., self.key_streams, :])  # [N, B, T, J, D]: key stream kappa(j) per target
        # Products and sums, not einsum (a bmm): the reference backend runs them with autocast off (the precision
        # policy), but AOTAutograd traces their backward with autocast on (PyTorch issue 179804), where a bmm runs in
        # bf16: compiled training under bf16 autocast then had depth gradients up to 0.18 off eager's.
        scores = (keys * self.pseudo_query.to(sources.dtype)).sum(-1)  # (2) [N, B, T, J]
        weights = scores.softmax(dim=0)  # (3) [N, B, T, J]
        values = sources[..., self.value_streams, :]  # [N, B, T, J, D]: value stream nu(j) per target
        extraction = (weights.unsqueeze(-1) * values).sum(0)  # (4) [B, T, J, D]
        return self.count_scale(sources.shape[0]) * extraction, weights


class DARReadGate(nn.Module):
    """The read gate, eq. (5): u = eta * (alpha x^0 + (1 - alpha) x^1), alpha = sigmoid(a), a = 0 at init.

    With one stream (AttnRes) u = eta * x^0 and there is no parameter.
    """

    def __init__(self, config: DARConfig):
        super().__init__()
        self.read_scale = config.dar_read_scale
        if config.dar_num_streams == 2:
            # (1,), not (): FSDP2 cannot shard 0-dim parameters
            self.logit = nn.Parameter(torch.zeros(1, dtype=dar_parameter_dtype()))

    def stream_weights(self) -> torch.Tensor:
        """(alpha, 1 - alpha) [2], or (1,) for one stream: each stream's extraction's weight in u / eta."""
        if not hasattr(self, "logit"):
            return torch.ones(1)
        return self.stream_weights_of(self.logit)

    @staticmethod
    def stream_weights_of(logit: torch.Tensor) -> torch.Tensor:
        """`stream_weights` of two-stream gates' logits stacked alike: [..., 1] -> [..., 2]."""
        alpha = torch.sigmoid(logit)
        return torch.cat([alpha, 1.0 - alpha], dim=-1)

    def forward(self, extraction: torch.Tensor) -> torch.Tensor:
        """x [B, T, J, D] -> u [B, T, D], in x's dtype."""
        if extraction.shape[-2] == 1:
            return self.read_scale * extraction[..., 0, :]
        alpha = torch.sigmoid(self.logit.to(extraction.dtype))
        first, second = extraction.unbind(-2)  # x^0, x^1: [B, T, D] each
        return self.read_scale * torch.lerp(second, first, alpha)  # alpha x^0 + (1 - alpha) x^1


class DARWriteGate(nn.Module):
    """Transport and gated write of the partial block state, eq. (6)-(7), one DESIGN.md line ("transport+write").

    P^j <- rho P^j + (1 - rho) P^{1-j} + beta^j * y, beta^j = c * sigmoid(b^j) per channel, rho = sigmoid(r): the
    2x2 doubly stochastic transport of the partial states, then the write. The first branch of a block opens the
    partial with beta * y, so rho exists only where a partial is carried. One stream (AttnRes) writes y unchanged.
    """

    def __init__(self, config: DARConfig, branch_index: int):
        super().__init__()
        self.branch_index = branch_index
        self.num_streams = config.dar_num_streams
        self.write_scale = config.dar_write_scale
        self.starts_block = branch_index % config.dar_block_size == 0
        if config.dar_num_streams == 2:
            self.logit = nn.Parameter(torch.zeros(2, config.hidden_size, dtype=dar_parameter_dtype()))
            if not self.starts_block:
                self.transport_logit = nn.Parameter(torch.zeros(1, dtype=dar_parameter_dtype()))

    def beta(self) -> torch.Tensor:
        """(7) beta [J, D] = c * sigmoid(b)."""
        return self.beta_of(self.logit, self.write_scale)

    @staticmethod
    def beta_of(logit: torch.Tensor, write_scale: float) -> torch.Tensor:
        """`beta` of write gates' logits stacked alike ([..., J, D])."""
        return write_scale * torch.sigmoid(logit)

    def rho(self) -> torch.Tensor:
        """(7) rho (1,) = sigmoid(r)."""
        return self.rho_of(self.transport_logit)

    @staticmethod
    def rho_of(transport_logit: torch.Tensor) -> torch.Tensor:
        """`rho` of transport logits stacked alike."""
        return torch.sigmoid(transport_logit)

    def forward(self, branch_output: torch.Tensor, partial: torch.Tensor | None) -> torch.Tensor:
        """y [B, T, D] and the partial P [B, T, J, D] (None when y opens a block), compute dtype -> new P [B, T, J, D]."""
        written = branch_output.unsqueeze(-2)  # [B, T, 1, D]
        if self.num_streams == 1:
            return written if partial is None else partial + written
        written = self.beta().to(written.dtype) * written  # [B, T, J, D]
        if partial is None:
            return written
        rho = self.rho().to(partial.dtype)
        return rho * partial + (1.0 - rho) * partial.flip(-2) + written  # (6); flip swaps the two streams


# The modules that hold DAR's parameters, which the optimised backends read without calling their forwards.
DAR_PARAMETER_MODULES = (DARStreamRMSNorm, DARDepthAttention, DARReadGate, DARWriteGate)


class DARBranchResidual(nn.Module):
    """The residual connection around one branch m (hyper-connections' width/depth split): `read` gives the
    branch input u, eq. (2)-(5); `write` puts the branch output y into the state, eq. (6)-(8).

    Where this branch stands in its block is fixed by the config: it reads the partial P when it is not the first
    branch of a block (and `dar_include_partial`), and commits P when it is the last one or the last branch.
    """

    def __init__(self, config: DARConfig, branch_index: int):
        super().__init__()
        self.branch_index = branch_index
        self.depth_attention = DARDepthAttention(config)
        self.read_gate = DARReadGate(config)
        self.write_gate = DARWriteGate(config, branch_index)
        block_size = config.dar_block_size
        self.reads_partial = config.dar_include_partial and branch_index % block_size != 0
        self.commits = (branch_index + 1) % block_size == 0 or branch_index == config.dar_num_branches - 1

    def forward(self, state: DepthState, dtype: torch.dtype, planned=None) -> tuple[torch.Tensor, torch.Tensor]:
        """The read: (u [B, T, D] in `dtype`, depth weights [N, B, T, J]). A forward, so that `output_hidden_states`
        and `output_depth_weights` record them. `planned`: this read's phase 1, if the backend planned it with
        others (`plan`)."""
        branch_input, weights = state.backend.read(self, state, self.reads_partial, planned, dtype)
        return (branch_input if branch_input.dtype == dtype else branch_input.to(dtype)), weights

    def read(self, state: DepthState, dtype: torch.dtype, planned=None) -> torch.Tensor:
        """u [B, T, D] in the model dtype, eq. (2)-(5)."""
        return self(state, dtype, planned)[0]

    def write(self, state: DepthState, branch_output: torch.Tensor) -> DepthState:
        """y [B, T, D] in the model dtype -> the state after eq. (6)-(8). The last branch of a forward that runs a
        prefix of the layers commits too (`DARModel.initial_state`)."""
        commits = self.commits or self.branch_index == getattr(state.backend, "final_branch", None)
        return state.backend.write(self, state, branch_output, commits)


class DARReadout(nn.Module):
    """The final read, eq. (9): eq. (2)-(5) over all committed entries (own queries, key norms, read gate)."""

    def __init__(self, config: DARConfig):
        super().__init__()
        self.depth_attention = DARDepthAttention(config)
        self.read_gate = DARReadGate(config)

    def forward(self, *state) -> tuple[torch.Tensor, torch.Tensor]:
        """The flattened final state -> (u_F [B, T, D] in the compute dtype, depth weights [S, B, T, J])."""
        state = DepthState.from_args(*state)
        return state.backend.read(self, state, False)


def self_contained(layer: nn.Module) -> bool:
    """Whether a training forward may compute this decoder layer's reads before the layer runs: not when its
    forward is checkpointed (HF's gradient checkpointing, or a wrapper such as torch's `checkpoint_wrapper`), whose
    recompute in backward would not see work done outside it, nor when it is compiled on its own (`compiled_alone`),
    whose graph would hand such work to a later layer's graph outside autograd."""
    return (isinstance(layer, GradientCheckpointingLayer) and not (layer.gradient_checkpointing and layer.training)
            and not compiled_alone(layer))


def recompile_limit() -> int:
    """dynamo's limit of graphs per frame: `recompile_limit` since torch 2.7, `cache_size_limit` before."""
    config = torch._dynamo.config
    return getattr(config, "recompile_limit", None) or config.cache_size_limit


def warn_per_layer_graphs(compiled: int) -> None:
    """Regional compilation of DAR traces one graph per decoder layer: each layer's place in the depth history (its
    entry count, whether its branches open, read or commit a block's partial) is Python state its graph guards on,
    where Llama's layers share one graph. Past dynamo's `recompile_limit` the other layers run eagerly, which dynamo
    reports in its own words only; say why, and what to set."""
    logger.warning_once(
        f"{compiled} DAR decoder layers are compiled on their own (regional compilation). Each has its own place in "
        "the depth history, so dynamo traces one graph per layer (not one for all, as for Llama), and past "
        f"torch._dynamo.config.recompile_limit ({recompile_limit()}) it runs the remaining layers "
        f"eagerly. Set torch._dynamo.config.recompile_limit = {2 * compiled} (one graph per layer with gradients on "
        "and one with them off), or compile the whole model (torch.compile(model): one graph)."
    )


def check_layers_in_place(residuals) -> None:
    """Refuse decoder layers that are not the model's first layers in order (a layer deleted or moved, as Llama's
    layer-pruning recipes do), from their branch residuals in order: each branch's place in the depth history (which
    block it reads and commits, its write gate's sign) was fixed when it was built, so a layer elsewhere reads a
    partial that is not there, or a block is never committed and its branches are left out of every later read."""
    for position, residual in enumerate(residuals):  # plain attributes: a few microseconds per forward
        if residual.branch_index != position:
            index, built = position // 2, residual.branch_index - position % 2
            raise ValueError(
                f"Decoder layer {index} of this DAR model was built as layer {built // 2} (branches {built} and "
                f"{built + 1} of its depth history): a layer before it was removed or the layers were reordered. Each "
                "DAR branch reads and commits depth blocks at the place it was built for, so DAR's layers run only "
                "as the model's first layers, in order. Trailing layers can be dropped in place (deleted, or "
                "config.num_hidden_layers lowered); after any other change, save the model and load it back "
                "(from_pretrained builds each layer at its new place)."
            )


def warn_reentrant_recorded_outputs(layers, names: list[str]) -> None:
    """`output_hidden_states` / `output_depth_weights` / `output_router_logits` (DAR-MoE's load-balancing loss) are
    recorded by hooks on modules inside each decoder layer (Llama records the layer's output, which its checkpoint
    returns). Reentrant activation checkpointing runs the layer's forward without gradients and rebuilds it in
    backward, so what those hooks recorded carries no gradient: a loss on it trains nothing through it, silently (the
    routers' gradient 0.27 off with the aux loss, as in Qwen3-MoE). Non-reentrant checkpointing (transformers'
    default) is exact."""
    for layer in layers:
        function = getattr(layer, "_gradient_checkpointing_func", None)
        if getattr(layer, "gradient_checkpointing", False) and getattr(function, "keywords", {}).get("use_reentrant"):
            logger.warning_once(
                f"{' and '.join(f'output_{name}' for name in names)} of a DAR model are recorded inside its decoder "
                "layers, which reentrant activation checkpointing (use_reentrant=True) runs without gradients: the "
                "recorded tensors carry no gradient, so a loss on them adds nothing to any parameter's gradient. "
                "Use non-reentrant checkpointing (use_reentrant=False, transformers' default where it is not given) "
                "for such a loss; the logits' loss is exact either way."
            )
            return


def refuse_forward_only_adapters(model: nn.Module) -> None:
    """Refuse a DAR module wrapped by an adapter that acts in the module's forward (PEFT's LoRA on parameters,
    `LoraConfig(target_parameters=...)`: a `ParamWrapper` whose `base_layer` is the DAR module), or reparametrised by
    a forward pre-hook (the legacy `torch.nn.utils.weight_norm` / `spectral_norm`). The optimised and
    inference backends read the depth attentions' and gates' parameters directly and never call those forwards, so
    such an adapter was ignored with gradients off (logits unchanged) and training failed in an AttributeError. The
    reference backend calls them. An eager forward checks again only when modules were registered since
    (`module_registrations`); a traced one checks while tracing (dynamo guards on the module tree anyway)."""
    if model.config.dar_implementation == "reference":
        return
    traced = torch.compiler.is_compiling()
    key = None if traced else module_registrations()
    if key is not None and model.__dict__.get("_dar_adapters_checked") == key:
        return
    residuals = [(f"layers.{index}.{name}", layer._modules.get(name)) for index, layer in enumerate(model.layers)
                 for name in ("attn_residual", "mlp_residual")]
    for prefix, residual in [*residuals, ("final_readout", model._modules.get("final_readout"))]:
        for child in ("depth_attention", "read_gate", "write_gate"):
            module = getattr(residual, child, None)  # through a wrapper of the residual, what the backends reach
            if module is None:
                continue
            hooked = [
                hook for submodule in module.modules() for hook in submodule._forward_pre_hooks.values()
                if isinstance(hook, (WeightNorm, SpectralNorm))
            ]
            if hooked:  # the legacy forms compute the parameter in a forward pre-hook; parametrizations are read
                raise ValueError(
                    f"{prefix}.{child} is reparametrised by {type(hooked[0]).__name__} "
                    "(torch.nn.utils.weight_norm / spectral_norm), which computes the parameter in the module's "
                    "forward pre-hook; DAR's 'fast' and 'two_phase' backends read the parameter directly and never "
                    "call that forward, so they would use a stale value. Use torch.nn.utils.parametrizations."
                    "weight_norm / spectral_norm (a parametrization, which they read), or set "
                    "config.dar_implementation = 'reference' (which calls it; slower)."
                )
            wrapped = [(name, wrapper) for name, wrapper in module.named_modules()  # the key norm inside too
                       if isinstance(wrapper._modules.get("base_layer"), DAR_PARAMETER_MODULES)]
            if wrapped:
                name, wrapper = wrapped[0]
                adapted = ".".join(part for part in (prefix, child, name, getattr(wrapper, "parameter_name", None)
                                                     or "base_layer") if part)
                raise ValueError(
                    f"{adapted} is adapted by {type(wrapper).__name__}, which applies its update in the wrapped "
                    "module's forward; DAR's 'fast' and 'two_phase' backends read that module's parameters directly "
                    "and never call it, so they cannot run it (the update was ignored with gradients off, and "
                    "training failed; merge_and_unload() gives a model they run). "
                    "Train DAR parameters fully next to the LoRA adapters instead (modules_to_save, as the "
                    "dar-transformers package's peft_utils.dar_lora_config(train_dar=True) sets), or set "
                    "config.dar_implementation = 'reference' (the readable equations, which call it; slower)."
                )
    if key is not None:
        model.__dict__["_dar_adapters_checked"] = key


def compiled_alone(layer: nn.Module) -> bool:
    """Whether a decoder layer is compiled on its own while the model runs eagerly (regional compilation:
    `layer.compile()`, or the layer replaced by `torch.compile(layer)` as accelerate's `compile_regions` does)."""
    return getattr(layer, "_compiled_call_impl", None) is not None or isinstance(layer, torch._dynamo.OptimizedModule)


class DARDecoderLayer(GradientCheckpointingLayer):
    """`LlamaDecoderLayer` with its two residual adds replaced by DAR reads and writes.

    The DAR state goes in and comes out flattened (`DepthState.as_args`: backend, partial, committed entries), so
    that reentrant checkpointing sees every tensor of it; `forward` is pure in everything autograd observes.
    """

    def __init__(self, config: DARConfig, layer_idx: int):
        super().__init__()
        self.hidden_size = config.hidden_size
        attention_class, _ = DAR_BRANCH_MODULES[config.dar_branch_family]
        self.self_attn = attention_class(config=config, layer_idx=layer_idx)
        self.mlp = self.build_mlp(config, layer_idx)
        self.input_layernorm = LlamaRMSNorm(config.hidden_size, eps=config.rms_norm_eps)
        self.post_attention_layernorm = LlamaRMSNorm(config.hidden_size, eps=config.rms_norm_eps)
        self.cache_keyword = cache_keyword(attention_class.forward)
        self.attn_residual = DARBranchResidual(config, branch_index=2 * layer_idx)
        self.mlp_residual = DARBranchResidual(config, branch_index=2 * layer_idx + 1)

    def build_mlp(self, config: DARConfig, layer_idx: int) -> nn.Module:
        """The MLP branch: the family's dense MLP (the MoE variant overrides this with a sparse MoE block)."""
        return DAR_BRANCH_MODULES[config.dar_branch_family][1](config)

    def forward(
        self,
        *state,
        attention_mask: torch.Tensor | None = None,
        position_ids: torch.LongTensor | None = None,
        use_cache: bool | None = False,
        position_embeddings: tuple[torch.Tensor, torch.Tensor] | None = None,
        **kwargs: Unpack[TransformersKwargs],
    ) -> tuple:
        past_key_values = kwargs.pop(LAYER_CACHE_KEYWORD, None)  # the KV cache, under Llama's layer's name
        state = DepthState.from_args(*state)
        dtype = self.input_layernorm.weight.dtype
        attn_residual, mlp_residual = self.attn_residual, self.mlp_residual  # one module lookup each per token
        # Phase 1 of both reads at once when the attention branch does not commit (DESIGN.md section 7).
        attn_read, mlp_read = state.backend.plan(state, attn_residual, mlp_residual)

        hidden_states = attn_residual.read(state, dtype, attn_read)  # [B, T, D]
        hidden_states, _ = self.self_attn(
            hidden_states=self.input_layernorm(hidden_states),
            attention_mask=attention_mask,
            position_ids=position_ids,
            use_cache=use_cache,
            position_embeddings=position_embeddings,
            **{self.cache_keyword: past_key_values},
            **kwargs,
        )
        state = attn_residual.write(state, hidden_states)

        hidden_states = mlp_residual.read(state, dtype, mlp_read)  # [B, T, D]
        hidden_states = self.mlp(self.post_attention_layernorm(hidden_states))
        state = mlp_residual.write(state, hidden_states)
        return state.as_args()


class DARPreTrainedModel(PreTrainedModel):
    config: DARConfig
    base_model_prefix = "model"
    supports_gradient_checkpointing = True
    _no_split_modules = ["DARDecoderLayer"]
    _skip_keys_device_placement = ["past_key_values", "cache"]  # "cache" from transformers 5.24
    _supports_flash_attn = True
    _supports_sdpa = True
    _supports_flex_attn = True
    _can_compile_fullgraph = True
    _supports_attention_backend = True
    # DAR parameters stay float32 when the model is loaded in half precision (DESIGN.md section 4).
    _keep_in_fp32_modules_strict = list(DAR_MODULE_NAMES)
    # hidden_states[l] is the input u of layer l's attention branch (the embedding for l = 0, Llama's residual
    # stream at upcycling), then the final readout (replaced by `last_hidden_state` after `norm`).
    _can_record_outputs = {
        "hidden_states": [
            OutputRecorder(DARBranchResidual, index=0, layer_name="attn_residual", capture_initial_hidden_state=False),
            OutputRecorder(DARReadout, index=0, capture_initial_hidden_state=False),
        ],
        "attentions": "self_attn",
        # a^j of every read in forward order (branches, then the readout): the analyses' depth-weight maps.
        "depth_weights": [OutputRecorder(DARBranchResidual, index=1), OutputRecorder(DARReadout, index=1)],
    }

    @classmethod
    def _can_set_attn_implementation(cls) -> bool:
        # The branches are HF attention modules that dispatch through ALL_ATTENTION_FUNCTIONS, so switching the
        # backend works; HF's source heuristic would take `DARDepthAttention` (a softmax over depth) for a
        # hand-written token attention and refuse `set_attn_implementation`.
        return True

    @torch.no_grad()
    def _init_weights(self, module):
        super()._init_weights(module)
        config = self.config
        if isinstance(module, DARDepthAttention):
            init.zeros_(module.pseudo_query)  # uniform depth weights: the count-scaled read is the residual sum
            init.ones_(module.key_norm.weight)  # irrelevant while the query is zero
        elif isinstance(module, DARReadGate) and config.dar_num_streams == 2:
            init.zeros_(module.logit)  # alpha = 1/2: u is the standard residual state
        elif isinstance(module, DARWriteGate) and config.dar_num_streams == 2:
            # b^0 = +delta xi, b^1 = -delta xi: beta^0 + beta^1 = c per channel (exact), streams differ in direction.
            generator = torch.Generator().manual_seed(module.branch_index)
            signs = torch.randint(0, 2, (config.hidden_size,), generator=generator).mul(2).sub(1)
            gate = config.dar_gate_delta * torch.stack([signs, -signs]).to(module.logit.dtype)
            init.copy_(module.logit, gate)
            if not module.starts_block:
                rho = config.dar_rho_init
                init.constant_(module.transport_logit, math.log(rho / (1.0 - rho)))  # any rho keeps the reduction


class DARModel(DARPreTrainedModel):
    decoder_layer_class = DARDecoderLayer
    output_class = DARModelOutputWithPast  # DAR-MoE's adds the router logits

    def __init__(self, config: DARConfig):
        config.validate()  # a field set after the config was built (`config.dar_write_mode = "x"`): named here
        super().__init__(config)
        self.padding_idx = config.pad_token_id
        self.vocab_size = config.vocab_size

        self.embed_tokens = nn.Embedding(config.vocab_size, config.hidden_size, self.padding_idx)
        self.layers = nn.ModuleList(
            [self.decoder_layer_class(config, layer_idx) for layer_idx in range(config.num_hidden_layers)]
        )
        self.final_readout = DARReadout(config)
        self.norm = LlamaRMSNorm(config.hidden_size, eps=config.rms_norm_eps)
        self.rotary_emb = LlamaRotaryEmbedding(config=config)
        self.gradient_checkpointing = False
        self.dar_layout = dar_layout(config)  # what the modules were built for (`check_layout_unchanged`)

        self.post_init()

    def initial_state(self, inputs_embeds: torch.Tensor, keep_depth_weights: bool = False) -> tuple:
        """The DAR state before branch 0, flattened for the decoder layers (`DepthState.as_args`): no partial, and
        one committed entry per stream, the embedding (times 1/J for split writes), B^j_0 [B, T, J, D].
        `keep_depth_weights=True` records every read's depth weights (`output_depth_weights`); with gradients on,
        the reference backend then computes them (`depth_backend`), so that they are differentiable."""
        config = self.config
        check_layout_unchanged(config, self.dar_layout)
        check_forward_fields(config)
        refuse_forward_only_adapters(self)
        history_dtype = dar_history_dtype(config, inputs_embeds.dtype)  # the backends store every commit in it
        embedding = inputs_embeds.to(history_dtype) * config.dar_embedding_scale  # [B, T, D]
        entry = embedding.unsqueeze(-2).expand(-1, -1, config.dar_num_streams, -1)  # [B, T, J, D]
        layers = list(islice(self.layers, config.num_hidden_layers))  # islice: a ModuleList slice registers them again
        residuals = [residual for layer in layers for residual in (layer.attn_residual, layer.mlp_residual)]
        check_layers_in_place(residuals)
        last_commits = residuals[-1].commits
        if torch.is_grad_enabled() and not all(self_contained(layer) for layer in layers):
            residuals = []  # a backend given them may compute a layer's reads in an earlier layer (a block's phase 1)
        # Layers compiled on their own trace the backend's reads and writes: it must be one a compiler can trace.
        compiled = sum(compiled_alone(layer) for layer in layers)
        traced = compiled > 0
        if compiled and 2 * compiled > recompile_limit():  # a graph per layer, with gradients on and off
            warn_per_layer_graphs(compiled)
        backend = depth_backend(config, traced=traced, recorded_weights=keep_depth_weights)
        if not last_commits:
            # A prefix of the layers (`config.num_hidden_layers` lowered, as `generate(assistant_early_exit=L)` does,
            # or the trailing layers deleted): its last branch commits the open block, as the last branch of a model
            # of that many layers does.
            backend.final_branch = 2 * len(layers) - 1
        return backend.start(entry, keep_weights=keep_depth_weights, residuals=residuals).as_args()

    @merge_with_config_defaults
    @capture_outputs
    def forward(
        self,
        input_ids: torch.LongTensor | None = None,
        attention_mask: torch.Tensor | None = None,
        position_ids: torch.LongTensor | None = None,
        past_key_values: Cache | None = None,
        inputs_embeds: torch.FloatTensor | None = None,
        use_cache: bool | None = None,
        **kwargs: Unpack[TransformersKwargs],
    ) -> DARModelOutputWithPast:
        if (input_ids is None) ^ (inputs_embeds is not None):
            raise ValueError("You must specify exactly one of input_ids or inputs_embeds")
        past_key_values = kv_cache_argument(past_key_values, kwargs)

        if inputs_embeds is None:
            inputs_embeds = self.embed_tokens(input_ids)

        if use_cache and past_key_values is None:
            past_key_values = DynamicCache(config=self.config)

        if position_ids is None:
            past_seen_tokens = past_key_values.get_seq_length() if past_key_values is not None else 0
            position_ids = torch.arange(inputs_embeds.shape[1], device=inputs_embeds.device) + past_seen_tokens
            position_ids = position_ids.unsqueeze(0)

        # Mistral branches with a window get its sliding mask, exactly as `MistralModel` picks it.
        mask_function = create_causal_mask if self.config.sliding_window is None else create_sliding_window_causal_mask
        causal_mask = mask_function(
            config=self.config,
            inputs_embeds=inputs_embeds,
            attention_mask=attention_mask,
            position_ids=position_ids,
            **{MASK_CACHE_KEYWORD: past_key_values},
        )
        position_embeddings = self.rotary_emb(inputs_embeds, position_ids=position_ids)

        recorded = kwargs.get("output_depth_weights", getattr(self.config, "output_depth_weights", False))
        if self.training and torch.is_grad_enabled():
            wanted = [name for name in ("hidden_states", "depth_weights", "router_logits")  # (DAR-MoE's aux loss)
                      if kwargs.get(f"output_{name}", getattr(self.config, f"output_{name}", False))]
            if wanted:
                warn_reentrant_recorded_outputs(self.layers, wanted)
        state = self.initial_state(inputs_embeds, keep_depth_weights=bool(recorded))
        with state[0].keeping_partials_lean():  # the backend decides what backward keeps of the DAR state
            for decoder_layer in islice(self.layers, self.config.num_hidden_layers):  # as `initial_state`
                state = decoder_layer(
                    *state,
                    attention_mask=causal_mask,
                    position_embeddings=position_embeddings,
                    position_ids=position_ids,
                    use_cache=use_cache,
                    **{LAYER_CACHE_KEYWORD: past_key_values},
                    **kwargs,
                )
            readout, _ = self.final_readout(*state)  # [B, T, D], compute dtype
        hidden_states = self.norm(readout.to(inputs_embeds.dtype))
        return self.output_class(last_hidden_state=hidden_states, **{OUTPUT_CACHE_FIELD: past_key_values})


class DARForCausalLM(DARPreTrainedModel, GenerationMixin):
    """Llama's causal-LM head over the DAR backbone; the recorded outputs of the backbone (hidden states, attentions,
    depth weights, and router logits for DAR-MoE) pass through to `output_class`."""

    _tied_weights_keys = {"lm_head.weight": "model.embed_tokens.weight"}
    _tp_plan = {"lm_head": "colwise_gather_output"}
    _pp_plan = None  # no pipeline-parallel plan: see DARConfig.base_model_pp_plan
    _fsdp_plan = {"lm_head": "keep_full_weight"}
    backbone_class = DARModel
    output_class = DARCausalLMOutputWithPast

    def __init__(self, config: DARConfig):
        super().__init__(config)
        self.model = self.backbone_class(config)
        self.vocab_size = config.vocab_size
        self.lm_head = nn.Linear(config.hidden_size, config.vocab_size, bias=False)

        self.post_init()

    @can_return_tuple
    def forward(
        self,
        input_ids: torch.LongTensor | None = None,
        attention_mask: torch.Tensor | None = None,
        position_ids: torch.LongTensor | None = None,
        past_key_values: Cache | None = None,
        inputs_embeds: torch.FloatTensor | None = None,
        labels: torch.LongTensor | None = None,
        use_cache: bool | None = None,
        logits_to_keep: int | torch.Tensor = 0,
        **kwargs: Unpack[TransformersKwargs],
    ) -> DARCausalLMOutputWithPast:
        outputs: DARModelOutputWithPast = self.model(
            input_ids=input_ids,
            attention_mask=attention_mask,
            position_ids=position_ids,
            past_key_values=past_key_values,
            inputs_embeds=inputs_embeds,
            use_cache=use_cache,
            **kwargs,
        )

        hidden_states = slice_logits_to_keep(outputs.last_hidden_state, logits_to_keep)
        logits = self.lm_head(hidden_states)

        loss = None
        if labels is not None:
            loss = self.loss_function(logits=logits, labels=labels, vocab_size=self.config.vocab_size, **kwargs)

        recorded = {name: value for name, value in outputs.items() if name != "last_hidden_state"}
        return self.output_class(loss=loss, logits=logits, **recorded)

    def _validate_model_kwargs(self, model_kwargs: dict) -> None:
        """`generate` returns no depth weights (its outputs have no field for them): transformers refused
        `output_depth_weights=True` as "not used by the model", and `config.output_depth_weights` made every step
        record weights that were then dropped. Both are said as what they are; a token's depth weights depend on it
        and the tokens before it only, so one forward over the generated sequences gives every step's."""
        how = ("run the model on the generated sequences with output_depth_weights=True: a token's depth weights "
               "depend on it and the tokens before it only, so that one forward gives every decoding step's")
        if model_kwargs.get("output_depth_weights"):
            raise ValueError(f"generate() does not return depth weights (output_depth_weights=True); {how}.")
        if getattr(self.config, "output_depth_weights", False):
            logger.warning_once(f"config.output_depth_weights=True: every decoding step records its depth weights, "
                                f"which generate() does not return; {how}.")
        super()._validate_model_kwargs(model_kwargs)


# Task heads as Llama's: transformers' generic heads (forward, pooling, loss) over DARModel, with the backbone under
# `model` (Llama's question-answering head keeps a legacy `transformer`), so an upcycled causal-LM checkpoint starts
# every head. The generic constructors build the backbone with `AutoModel.from_config(config)`, which cannot find it
# under `trust_remote_code=True`: the config is then an instance of the class from the config file's own dynamic
# module (transformers loads each remote file under its own hash), which no registration made at import can name.
# So each head builds its `backbone_class` itself, skipping only the generic constructor (`super(GenericFor..., self)`),
# and adds the generic head's own layers.
class DARForSequenceClassification(GenericForSequenceClassification, DARPreTrainedModel):
    backbone_class = DARModel

    def __init__(self, config: DARConfig):
        super(GenericForSequenceClassification, self).__init__(config)
        self.num_labels = config.num_labels
        self.model = self.backbone_class(config)
        self.score = nn.Linear(config.hidden_size, self.num_labels, bias=False)

        self.post_init()


class DARForQuestionAnswering(GenericForQuestionAnswering, DARPreTrainedModel):
    backbone_class = DARModel

    def __init__(self, config: DARConfig):
        super(GenericForQuestionAnswering, self).__init__(config)
        self.model = self.backbone_class(config)
        self.qa_outputs = nn.Linear(config.hidden_size, 2)

        self.post_init()


class DARForTokenClassification(GenericForTokenClassification, DARPreTrainedModel):
    backbone_class = DARModel

    def __init__(self, config: DARConfig):
        super(GenericForTokenClassification, self).__init__(config)
        self.num_labels = config.num_labels
        self.model = self.backbone_class(config)
        # The generic head's dropout: an optional `classifier_dropout` or `hidden_dropout` a user put in the config.
        dropout = getattr(config, "classifier_dropout", None)
        dropout = getattr(config, "hidden_dropout", None) if dropout is None else dropout
        self.dropout = nn.Dropout(0.1 if dropout is None else dropout)
        bias = getattr(config, "token_classification_bias", True)
        self.score = nn.Linear(config.hidden_size, config.num_labels, bias=bias)

        self.post_init()


# transformers' tables of task class names, by the generic head a class is.
TASK_CLASS_TABLES = (
    (GenerationMixin, MODEL_FOR_CAUSAL_LM_MAPPING_NAMES),
    (GenericForSequenceClassification, MODEL_FOR_SEQUENCE_CLASSIFICATION_MAPPING_NAMES),
    (GenericForTokenClassification, MODEL_FOR_TOKEN_CLASSIFICATION_MAPPING_NAMES),
    (GenericForQuestionAnswering, MODEL_FOR_QUESTION_ANSWERING_MAPPING_NAMES),
)


def declare_task_classes(model_type: str, *model_classes: type) -> None:
    """List each head in transformers' table of class names of its task (`MODEL_FOR_*_MAPPING_NAMES`). Code that
    asks what task a model does reads those fixed tables, which registering an Auto class does not extend: Trainer's
    label smoother shifts the labels only for a causal LM listed there (DAR was trained with label smoothing to
    predict the token it reads), and Trainer's model card names a task, and shows its evaluation results, only for
    a listed class. This module runs it at import, so the folder's remote code declares its classes as well."""
    for model_class in model_classes:
        for base, table in TASK_CLASS_TABLES:
            if issubclass(model_class, base):
                table.setdefault(model_type, model_class.__name__)


declare_task_classes(DARConfig.model_type, DARForCausalLM, DARForSequenceClassification, DARForTokenClassification,
                     DARForQuestionAnswering)


__all__ = [
    "DARPreTrainedModel",
    "DARModel",
    "DARForCausalLM",
    "DARForSequenceClassification",
    "DARForQuestionAnswering",
    "DARForTokenClassification",
]
