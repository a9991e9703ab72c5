# SPDX-License-Identifier: Apache-2.0
# Copyright 2026 The dar-transformers authors.
"""Dual Attention Residuals (DAR; Yu, Li, Liu et al., arXiv 2607.18730) on an unchanged Llama-family decoder.

What differs from `LlamaModel` (DESIGN.md section 2): the residual path. The attention and MLP branches, their
input norms, the rotary embedding, the final `norm` and `lm_head` are HF's own modules with Llama's attribute
names, so a Llama state dict loads without renames. Instead of `h = h + F(h)`, every branch m

  1. reads a softmax mix over depth of each stream's history (AttnRes historical extraction), with reciprocal
     addressing: target stream j scores the sources with keys from stream kappa(j) and mixes values of stream
     nu(j) (`DARDepthAttention`), count-scaled by the number of sources N;
  2. mixes the two extractions with the read gate alpha (`DARReadGate`) into the branch input u;
  3. writes the branch output y into each stream's partial block state with per-channel gates beta, after the
     2x2 doubly stochastic transport rho of the partial states (`DARWriteGate`);
  4. commits the partial states as new history entries at the end of each block of K branches.
A final depth read (`DARReadout`) over all committed entries feeds Llama's `norm` and `lm_head`.

Two implementations share the modules and the state layout (`config.dar_implementation`):
  - "reference": the eager loop of DESIGN.md, every read re-normalising every source;
  - "fast": keys normalised once per committed entry (a per-token inverse RMS), committed entries copied into a
    depth-major buffer allocated once per forward, and one fused read per branch (`_DepthRead`: scores against a
    routed query matrix, depth softmax, read gate folded into per-value-stream coefficients, one batched product
    over the buffer). Its backward keeps only per-token scalars and adds the entries' gradients in place into one
    shared buffer (`DepthGradients`) that each entry's commit hands to autograd (`_Commit`).

Shape legend: B batch, T tokens, D hidden, S committed entries, N sources of one read (S, or S + 1 with the
partial), J streams.
Precision policy (`dar_compute_dtype`): history, depth softmax and mixing run in float32, or float64 for a
float64 model; the branch input is cast once to the model dtype and the branch output once back.
"""

import math
from collections.abc import Callable

import torch
import torch.nn.functional as F
from torch import nn
from transformers import initialization as init
from transformers.cache_utils import Cache, DynamicCache
from transformers.generation import GenerationMixin
from transformers.masking_utils import create_causal_mask, create_sliding_window_causal_mask
from transformers.modeling_layers import GenericForSequenceClassification, GradientCheckpointingLayer
from transformers.modeling_outputs import BaseModelOutputWithPast, CausalLMOutputWithPast
from transformers.modeling_utils import PreTrainedModel, slice_logits_to_keep
from transformers.models.llama.modeling_llama import (
    LlamaAttention,
    LlamaMLP,
    LlamaRMSNorm,
    LlamaRotaryEmbedding,
)
from transformers.processing_utils import Unpack
from transformers.utils import TransformersKwargs, can_return_tuple
from transformers.utils.generic import merge_with_config_defaults
from transformers.utils.output_capturing import OutputRecorder, capture_outputs

from .configuration_dar import ROUTING_KEY_VALUE_STREAMS, DARConfig



def dar_compute_dtype(model_dtype: torch.dtype) -> torch.dtype:
    """The dtype of the DAR state and depth mixing: float32, or wider if the model is wider."""
    return torch.promote_types(model_dtype, torch.float32)


def _without_autocast(tensor: torch.Tensor) -> torch.autocast:
    """Depth products stay in the compute dtype under mixed-precision autocast (the precision policy above)."""
    return torch.autocast(tensor.device.type, enabled=False)

# The unchanged branch modules per family: (attention class, MLP class). Data, not an if-ladder.
DAR_BRANCH_MODULES: dict[str, tuple[type[nn.Module], type[nn.Module]]] = {
    "llama": (LlamaAttention, LlamaMLP),
}


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


def inverse_rms(x: torch.Tensor, eps: float) -> torch.Tensor:
    """1 / RMS over the last axis, as in RMSNorm: [..., D] -> [...]."""
    return torch.rsqrt(x.pow(2).mean(-1) + eps)


def _streams(x: torch.Tensor, streams: tuple[int, ...], dim: int) -> torch.Tensor:
    """Pick streams along `dim` by a static routing tuple; a view unless the streams are swapped."""
    if streams == tuple(range(x.shape[dim])):
        return x
    if len(set(streams)) == 1:
        return x.narrow(dim, streams[0], 1).expand_as(x)
    return x.flip(dim)  # the only other routing on two streams is the swap


def stream_selector(streams: tuple[int, ...], like: torch.Tensor) -> torch.Tensor:
    """One-hot [J_source, J]: column j marks the stream streams[j] that target stream j reads (its key stream
    kappa(j) for the key routing, its value stream nu(j) for the value routing)."""
    return torch.eye(len(streams), dtype=like.dtype, device=like.device)[:, list(streams)]


def routed_queries(query: torch.Tensor, key_streams: tuple[int, ...]) -> torch.Tensor:
    """query [J, D] -> [J_key * D, J]: column j holds target j's query in the rows of its key stream kappa(j),
    zeros elsewhere, so that (entry [.., J_key * D]) @ routed gives every target's key dot directly (any routing,
    no per-routing gather of the dots)."""
    streams, hidden = query.shape
    routed = query.T.unsqueeze(0) * stream_selector(key_streams, query)[:, None, :]  # [J_key, D, J]
    return routed.reshape(streams * hidden, streams)


def _by_value_stream(by_target: torch.Tensor, value_streams: tuple[int, ...]) -> torch.Tensor:
    """[..., J] indexed by target stream -> [..., J_val] indexed by value stream, summing the targets that read
    each value stream: out[..., v] = sum over j with nu(j) = v of x[..., j] (zero for a stream nobody reads)."""
    streams = by_target.shape[-1]
    if sorted(value_streams) == list(range(streams)):  # a permutation: identity or swap
        return _streams(by_target, tuple(value_streams.index(stream) for stream in range(streams)), by_target.dim() - 1)
    return by_target @ stream_selector(value_streams, by_target).T  # [J, J_val]: row j marks nu(j)


def _read_sources(history_buffer, inv_rms_buffer, entries, partial, eps):
    """The sources of one read in the buffers, the partial (if read) staged in the next free slot ->
    (history [N, B, T, J, D], inverse RMS [N, B, T, J], the partial's inverse RMS [B, T, J] or None)."""
    num_sources, partial_inv_rms = len(entries), None
    if partial is not None:
        partial_inv_rms = _write_slot(history_buffer, inv_rms_buffer, num_sources, partial, eps)
        num_sources += 1
    return history_buffer[:num_sources], inv_rms_buffer[:num_sources], partial_inv_rms


def _depth_read_forward(routed, gate, history, history_inv_rms, key_streams, value_streams):
    """One branch's fast read: softmax over depth of its sources, mixed straight into the branch input.

    routed [J * D, J] (`routed_queries`), gate [J] (read gate times scale), sources history [N, B, T, J, D] with
    their inverse RMS [N, B, T, J] -> (u [B, T, D], softmax weights [N, B, T, J], key dots [N, B, T, J]).
    """
    sources, batch, tokens, streams, hidden = history.shape
    keyed_dots = (history.reshape(-1, streams * hidden) @ routed).view(sources, batch, tokens, streams)
    scores = keyed_dots * _streams(history_inv_rms, key_streams, 3)  # [N, B, T, J]: key stream kappa(j)'s norm
    weights = scores.softmax(dim=0)  # [N, B, T, J]
    # u = sum_j gate_j sum_n w^j_n V^{nu(j)}_n: fold the read gate into per-value-stream coefficients, so the
    # per-stream extractions are never materialised; one product over tokens and streams reads the history.
    coefficients = _by_value_stream(weights * gate, value_streams)  # [N, B, T, J_val]
    values = history.view(sources, -1, hidden).transpose(0, 1)  # [BTJ_val, N, D], a view of the buffer
    # contiguous: a strided [1, N] operand sends bmm down a per-matrix copy loop on CPU.
    coefficients = coefficients.permute(1, 2, 3, 0).contiguous().view(-1, 1, sources)  # [BTJ_val, 1, N]
    mixed = torch.bmm(coefficients, values).view(batch, tokens, streams, hidden)  # [B, T, J_val, D]
    return mixed.sum(dim=2), weights, keyed_dots


class DepthGradients:
    """The committed entries' gradient, shared by all reads of one forward: [S_max, B, T, J, D], like the history.

    Every fused read's backward adds its contribution for the entries it read into their slots in place, and each
    entry's commit hands its slot to autograd once every read of that entry is done (autograd runs a node's
    backward only after all its consumers'). So no read allocates an entry-sized gradient per source and autograd
    sums no per-entry gradients; the buffer is allocated by the first backward that needs it and freed after
    entry 0, the last to be handed over.
    """

    def __init__(self):
        self.buffer: torch.Tensor | None = None

    def slots(self, history_buffer: torch.Tensor, count: int) -> torch.Tensor:
        if self.buffer is None:
            self.buffer = torch.zeros_like(history_buffer)
        return self.buffer[:count]  # [count, B, T, J, D]

    def take(self, slot: int) -> torch.Tensor | None:
        """The accumulated gradient of entry `slot`, leaving zeros behind (a second backward starts clean)."""
        if self.buffer is None:
            return None
        gradient = self.buffer[slot].clone()
        if slot == 0:
            self.buffer = None
        else:
            self.buffer[slot].zero_()
        return gradient


def _write_slot(history_buffer, inv_rms_buffer, slot: int, entry: torch.Tensor, eps: float) -> torch.Tensor:
    """Copy an entry (a commit) or the partial block state (staged in the slot where its block will be committed,
    so that a read is one product over buffer[: slot + 1]) into the buffers with its inverse RMS; returns that
    [B, T, J]. Through `.data`: the buffers are caches invisible to autograd, and writing through `.data` leaves
    their version counters alone, so reentrant checkpointing (which saves them as layer inputs) accepts later
    writes."""
    entry = entry.detach()
    entry_inv_rms = inverse_rms(entry, eps)
    history_buffer.data[slot].copy_(entry)
    inv_rms_buffer.data[slot].copy_(entry_inv_rms)
    return entry_inv_rms


class _Commit(torch.autograd.Function):
    """Commit an entry into the buffers; its backward adds the reads' gradient accumulated in `DepthGradients`."""

    @staticmethod
    def forward(ctx, entry, history_buffer, inv_rms_buffer, slot, eps, gradients):
        _write_slot(history_buffer, inv_rms_buffer, slot, entry, eps)
        ctx.slot, ctx.gradients = slot, gradients
        return entry.view_as(entry)

    @staticmethod
    def backward(ctx, grad):
        accumulated = ctx.gradients.take(ctx.slot)
        if accumulated is not None and grad is not None:
            accumulated += grad
        return (grad if accumulated is None else accumulated), None, None, None, None, None


def commit_entry(entry, history_buffer, inv_rms_buffer, slot: int, eps: float, gradients: "DepthGradients | None"):
    """Write `entry` into slot `slot` of the buffers; with gradients, through `_Commit` so that the fused reads'
    gradients reach it. Returns the entry to keep in the tuple of committed entries."""
    if gradients is not None and torch.is_grad_enabled() and entry.requires_grad:
        return _Commit.apply(entry, history_buffer, inv_rms_buffer, slot, eps, gradients)
    with torch.no_grad():
        _write_slot(history_buffer, inv_rms_buffer, slot, entry, eps)
    return entry


class _DepthRead(torch.autograd.Function):
    """One branch's depth read and read gate (AttnRes eq. 2-4 routed per DESIGN.md, then alpha), fused.

    The committed entries are read from the preallocated depth-major buffer; they are inputs only so that autograd
    runs this backward before their commits' (`_Commit`), which hand on what this backward adds into their slots of
    the shared `DepthGradients`. The partial block state is an ordinary input. Backward keeps only per-token scalars
    (softmax weights and key dots, N per token and stream) and the partial (which the write keeps anyway), and
    rebuilds every gradient from the buffer, including the key normalisation's, d rms^-1 / d h = -rms^-3 h / D.
    Neither the per-stream extractions nor normalised keys are stored.
    """

    @staticmethod
    def forward(ctx, routed, gate, history_buffer, inv_rms_buffer, routing, eps, gradients, partial, *entries):
        sources, sources_inv_rms, partial_inv_rms = _read_sources(history_buffer, inv_rms_buffer, entries, partial, eps)
        branch_input, weights, keyed_dots = _depth_read_forward(routed, gate, sources, sources_inv_rms, *routing)
        # The partial's slot is overwritten by later partials: backward reads the partial itself (kept anyway).
        ctx.save_for_backward(routed, gate, weights, keyed_dots, partial, partial_inv_rms)
        ctx.history, ctx.history_inv_rms = history_buffer[: len(entries)], inv_rms_buffer[: len(entries)]
        ctx.history_buffer, ctx.routing, ctx.gradients = history_buffer, routing, gradients
        return branch_input

    @staticmethod
    def backward(ctx, grad_input):
        routed, gate, weights, keyed_dots, partial, partial_inv_rms = ctx.saved_tensors
        history, history_inv_rms, (key_streams, value_streams) = ctx.history, ctx.history_inv_rms, ctx.routing
        sources, batch, tokens, streams, hidden = history.shape
        grad_rows = grad_input.unsqueeze(2).expand(batch, tokens, streams, hidden).reshape(-1, 1, hidden)  # [BTJ, 1, D]
        values = history.view(sources, -1, hidden).transpose(0, 1)  # [BTJ_val, S, D]
        value_dots = torch.bmm(values, grad_rows.transpose(1, 2)).view(batch, tokens, streams, sources)
        value_dots = value_dots.permute(3, 0, 1, 2)  # [S, B, T, J_val]: g . V_n
        key_inv_rms = _streams(history_inv_rms, key_streams, 3)  # [S, B, T, J]
        if partial is not None:
            value_dots = torch.cat([value_dots, (partial * grad_input.unsqueeze(2)).sum(-1).unsqueeze(0)])
            key_inv_rms = torch.cat([key_inv_rms, _streams(partial_inv_rms, key_streams, 2).unsqueeze(0)])
        target_value_dots = _streams(value_dots, value_streams, 3)  # [N, B, T, J]: g . V^{nu(j)}_n
        grad_gate = (weights * target_value_dots).sum((0, 1, 2)) if ctx.needs_input_grad[1] else None  # [J]
        grad_weights = gate * target_value_dots  # [N, B, T, J]
        grad_scores = weights * (grad_weights - (weights * grad_weights).sum(0))  # softmax backward over depth
        grad_keyed = grad_scores * key_inv_rms  # [N, B, T, J]
        selector = stream_selector(key_streams, weights)  # [J_key, J]
        grad_inv_rms = (grad_scores * keyed_dots) @ selector.T  # [N, B, T, J_key]
        queries = (routed.view(streams, hidden, streams) * selector[:, None, :]).sum(0).T  # [J, D], unrouted
        coefficients = _by_value_stream(weights * gate, value_streams)  # [N, B, T, J_val]

        # Committed entries: values, keys and key norm, added in place into their slots of the shared gradient.
        grad_entries = ctx.gradients.slots(ctx.history_buffer, sources)  # [S, B, T, J, D]
        grad_entries.addcmul_(coefficients[:sources].unsqueeze(-1), grad_input.unsqueeze(0).unsqueeze(3))
        grad_dots = grad_keyed[:sources].unsqueeze(3) * selector  # [S, B, T, J_key, J]: at each target's key stream
        grad_entries.view(-1, hidden).addmm_(grad_dots.reshape(-1, streams), queries)
        norm_coefficient = grad_inv_rms[:sources] * history_inv_rms.pow(3) / -hidden  # [S, B, T, J]
        grad_entries.addcmul_(history, norm_coefficient.unsqueeze(-1))

        grad_partial = None
        if partial is not None:
            grad_partial = coefficients[sources].unsqueeze(-1) * grad_input.unsqueeze(2)  # [B, T, J, D]
            partial_dots = grad_keyed[sources].unsqueeze(2) * selector  # [B, T, J_key, J]
            grad_partial.view(-1, hidden).addmm_(partial_dots.reshape(-1, streams), queries)
            norm_coefficient = grad_inv_rms[sources] * partial_inv_rms.pow(3) / -hidden  # [B, T, J]
            grad_partial.addcmul_(partial, norm_coefficient.unsqueeze(-1))
        grad_routed = None
        if ctx.needs_input_grad[0]:  # (g^T H)^T: a wide product, several times faster than H^T g on CPU
            grad_routed = grad_keyed[:sources].reshape(-1, streams).T @ history.reshape(-1, streams * hidden)
            if partial is not None:
                grad_routed.addmm_(grad_keyed[sources].reshape(-1, streams).T, partial.reshape(-1, streams * hidden))
            grad_routed = grad_routed.T
        return (grad_routed, grad_gate, None, None, None, None, None, grad_partial, *(None for _ in range(sources)))


def depth_read(
    routed: torch.Tensor,
    gate: torch.Tensor,
    history_buffer: torch.Tensor,
    inv_rms_buffer: torch.Tensor,
    entries: tuple[torch.Tensor, ...],
    partial: torch.Tensor | None,
    key_streams: tuple[int, ...],
    value_streams: tuple[int, ...],
    eps: float,
    gradients: DepthGradients | None = None,
) -> torch.Tensor:
    """The fast path's read of one branch: u = sum_j gate_j x^j with x^j the depth attention of target stream j.

    routed [J * D, J] (`routed_queries` of pseudo-query times key-norm weight); gate [J] (the read gate's
    (alpha, 1 - alpha), or (1,) for one stream, times read and count scaling); the committed entries, each
    [B, T, J, D], also copied into history_buffer [S_max, B, T, J, D] with their inverse RMS in inv_rms_buffer
    [S_max, B, T, J]; the partial block state [B, T, J, D] when the branch reads it -> u [B, T, D], compute dtype.
    Scores are w . RMSNorm_gamma(k) = ((w * gamma) . k) / rms(k): normalised keys are never materialised.
    """
    routing = (key_streams, value_streams)
    with _without_autocast(history_buffer):
        inputs = (routed, gate, partial, *entries)
        if torch.is_grad_enabled() and any(tensor is not None and tensor.requires_grad for tensor in inputs):
            if gradients is None:
                raise ValueError("depth_read needs the forward's DepthGradients to train (see DARModel.initial_state).")
            return _DepthRead.apply(
                routed, gate, history_buffer, inv_rms_buffer, routing, eps, gradients, partial, *entries
            )
        sources, sources_inv_rms, _ = _read_sources(history_buffer, inv_rms_buffer, entries, partial, eps)
        return _depth_read_forward(routed, gate, sources, sources_inv_rms, *routing)[0]


class DARParameterMemo:
    """Inference memo for small tensors derived from a module's own parameters (gates, folded queries).

    Decoding runs every branch once per token on tiny tensors, where recomputing sigmoids and stacks costs more than
    the depth mixing itself. With gradients off and outside `torch.compile`, a derived tensor is memoised under a
    key of the parameters' version counters and storages (an in-place update, a load or a move invalidates it) and
    the requested dtype. With gradients on it is always recomputed, so training is untouched.
    """

    def memoised(self, name: str, dtype: torch.dtype, compute: Callable[[], torch.Tensor]) -> torch.Tensor:
        if torch.is_grad_enabled() or torch.compiler.is_compiling():
            return compute()
        stamp = (dtype, *((p._version, p.data_ptr()) for p in self.parameters()))
        memo = self.__dict__.setdefault("_dar_memo", {})
        cached = memo.get(name)
        if cached is None or cached[0] != stamp:
            cached = memo[name] = (stamp, compute())
        return cached[1]


class DARStreamRMSNorm(nn.Module):
    """One RMSNorm weight per target stream for the depth keys (gamma^j_m): weight [J, D]."""

    def __init__(self, num_streams: int, hidden_size: int, eps: float):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(num_streams, hidden_size))
        self.variance_epsilon = eps


class DARDepthAttention(DARParameterMemo, nn.Module):
    """Depth-wise softmax attention over a history (AttnRes eq. 2-4, routed per DESIGN.md section 2).

    s^j_r = w^j . RMSNorm_{gamma^j}(S^{kappa(j)}_r),  a^j = softmax_r(s^j),  x^j = N * sum_r a^j_r S^{nu(j)}_r.
    The pseudo-query w is input independent and zero at init (uniform weights); there is no 1/sqrt(d).
    """

    def __init__(self, config: DARConfig):
        super().__init__()
        self.num_streams = config.dar_num_streams
        self.pseudo_query = nn.Parameter(torch.zeros(config.dar_num_streams, config.hidden_size))
        self.key_norm = DARStreamRMSNorm(config.dar_num_streams, config.hidden_size, config.rms_norm_eps)
        self.key_streams, self.value_streams = _routing(config)
        self.count_scaling = config.dar_count_scaling

    def scoring_query(self, dtype: torch.dtype) -> torch.Tensor:
        """w * gamma [J, D] in the compute dtype: the key norm weight folded into the query."""
        return self.memoised("scoring_query", dtype, lambda: (self.pseudo_query * self.key_norm.weight).to(dtype))

    def routed_query(self, dtype: torch.dtype) -> torch.Tensor:
        """`routed_queries` of the folded query: [J * D, J], the fused read's scoring operand."""
        return self.memoised(
            "routed_query", dtype, lambda: routed_queries(self.scoring_query(dtype), self.key_streams)
        )

    def count_scale(self, num_sources: int) -> float:
        """lambda = N turns the uniform mean at zero queries back into the residual sum (DESIGN.md section 3)."""
        return float(num_sources) if self.count_scaling else 1.0

    def reference(self, sources: torch.Tensor) -> torch.Tensor:
        """The readable eager read: sources [B, T, S, J, D] -> count-scaled extraction x [B, T, J, D]."""
        extractions = []
        for target in range(self.num_streams):
            keys = F.rms_norm(
                sources[:, :, :, self.key_streams[target]],
                (sources.shape[-1],),
                weight=self.key_norm.weight[target].to(sources.dtype),
                eps=self.key_norm.variance_epsilon,
            )  # [B, T, S, D]
            scores = torch.einsum("d,btsd->bts", self.pseudo_query[target].to(sources.dtype), keys)  # [B, T, S]
            weights = scores.softmax(dim=-1)  # [B, T, S]
            values = sources[:, :, :, self.value_streams[target]]  # [B, T, S, D]
            extractions.append(torch.einsum("bts,btsd->btd", weights, values))  # [B, T, D]
        return self.count_scale(sources.shape[2]) * torch.stack(extractions, dim=2)  # [B, T, J, D]


class DARReadGate(DARParameterMemo, nn.Module):
    """Mixes the per-stream extractions into the branch input: u = eta * (alpha x^0 + (1 - alpha) x^1).

    alpha = sigmoid(a), a = 0 at init. With one stream u = eta * x^0 and there is no parameter.
    """

    def __init__(self, config: DARConfig):
        super().__init__()
        self.read_scale = config.dar_read_scale
        if config.dar_num_streams == 2:
            self.logit = nn.Parameter(torch.zeros(1))  # shape (1,), not (): FSDP2 cannot shard 0-dim parameters

    def stream_weights(self, dtype: torch.dtype) -> torch.Tensor:
        """(alpha, 1 - alpha) [2], or (1,) for one stream: the weights of the streams' extractions in u / eta."""
        return self.memoised("stream_weights", dtype, lambda: self._stream_weights(dtype))

    def _stream_weights(self, dtype: torch.dtype) -> torch.Tensor:
        if not hasattr(self, "logit"):
            return torch.ones(1, dtype=dtype)
        alpha = torch.sigmoid(self.logit.to(dtype))  # (1,)
        return torch.cat([alpha, 1.0 - alpha])

    def forward(self, extracted: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
        """extracted [B, T, J, D] in the compute dtype (the reference path) -> branch input u [B, T, D] in the model
        dtype. The fast path mixes the streams inside its fused read and passes u [B, T, D] here to be cast; either
        way u goes through this module, where `output_hidden_states` records it."""
        if extracted.dim() == 3:
            return extracted.to(dtype)
        if extracted.shape[-2] == 1:
            return (self.read_scale * extracted[..., 0, :]).to(dtype)
        alpha = torch.sigmoid(self.logit.to(extracted.dtype))
        first, second = extracted.unbind(-2)  # [B, T, D] each
        return (self.read_scale * torch.lerp(second, first, alpha)).to(dtype)  # [B, T, D]


class DARWriteGate(DARParameterMemo, nn.Module):
    """Transport then gated write of the partial block state (DESIGN.md section 2, "transport+write").

    P^j <- rho P^j + (1 - rho) P^{1-j} + beta^j * y, beta^j = c * sigmoid(b^j) per channel, rho = sigmoid(r).
    The first branch of a block starts the partial from beta * y, so rho exists only where a partial is carried.
    """

    def __init__(self, config: DARConfig, branch_index: int):
        super().__init__()
        self.branch_index = branch_index
        self.write_scale = config.dar_write_scale
        self.starts_block = branch_index % config.dar_block_size == 0
        if config.dar_num_streams == 2:
            self.logit = nn.Parameter(torch.zeros(2, config.hidden_size))
            if not self.starts_block:
                self.transport_logit = nn.Parameter(torch.zeros(1))

    def forward(self, branch_output: torch.Tensor, partial: torch.Tensor) -> torch.Tensor:
        """branch_output y [B, T, D] in the compute dtype, partial [B, T, J, D] (ignored at a block start) -> new partial."""
        branch_output = branch_output.unsqueeze(-2)  # [B, T, 1, D]
        if partial.shape[-2] == 1:  # AttnRes writes y unchanged
            return branch_output if self.starts_block else partial + branch_output
        beta = self.memoised("beta", partial.dtype, lambda: self.write_scale * torch.sigmoid(self.logit.to(partial.dtype)))
        if self.starts_block:
            return beta * branch_output  # [B, T, J, D]
        rho = self.memoised("rho", partial.dtype, lambda: torch.sigmoid(self.transport_logit.to(partial.dtype)))
        if torch.is_grad_enabled():
            return _TransportWrite.apply(partial, rho, beta, branch_output)  # [B, T, J, D]
        return transport_write(partial, rho, beta, branch_output)  # [B, T, J, D]


def transport_write(partial, rho, beta, branch_output):
    """P [B, T, J, D], rho (1,), beta [J, D], y [B, T, 1, D] -> [[rho, 1-rho], [1-rho, rho]] P + beta * y."""
    return torch.addcmul(torch.lerp(partial.flip(-2), partial, rho), beta, branch_output)


class _TransportWrite(torch.autograd.Function):
    """`transport_write` with a backward that keeps only its two inputs P and y (autograd would also keep the
    swapped copy of P) and computes the gate gradients as dot products, without full-size temporaries."""

    @staticmethod
    def forward(ctx, partial, rho, beta, branch_output):
        ctx.save_for_backward(partial, rho, beta, branch_output)
        return transport_write(partial, rho, beta, branch_output)

    @staticmethod
    def backward(ctx, grad):
        partial, rho, beta, branch_output = ctx.saved_tensors
        swapped = grad.flip(-2)  # the transport matrix is symmetric: dL/dP = [[rho, 1-rho], [1-rho, rho]] g
        grad_partial = torch.lerp(swapped, grad, rho) if ctx.needs_input_grad[0] else None
        grad_rho = None
        if ctx.needs_input_grad[1]:  # dL/drho = sum g . (P - swap P) = sum (g - swap g) . P
            flat_partial = partial.flatten()
            grad_rho = torch.vdot(grad.flatten(), flat_partial) - torch.vdot(swapped.flatten(), flat_partial)
            grad_rho = grad_rho.reshape(rho.shape)
        grad_beta = (grad * branch_output).sum((0, 1)) if ctx.needs_input_grad[2] else None  # [J, D]
        grad_output = (grad * beta).sum(-2, keepdim=True) if ctx.needs_input_grad[3] else None  # [B, T, 1, D]
        return grad_partial, grad_rho, grad_beta, grad_output


def read_branch_input(attention, read_gate, entries, partial, buffers, eps: float, dtype, implementation: str):
    """u [B, T, D] in `dtype` for one read (a branch's, or the final readout's): the depth attention over the
    committed entries (and the partial, when given) mixed by the read gate, with the reference loop or the fused
    fast path (`depth_read` over the buffers (history, inverse RMS, DepthGradients))."""
    sources = (*entries, partial) if partial is not None else entries
    if implementation == "reference":
        return read_gate(attention.reference(torch.stack(sources, dim=2)), dtype)
    history_buffer, inv_rms_buffer, gradients = buffers
    compute_dtype = history_buffer.dtype
    gate = read_gate.stream_weights(compute_dtype) * (read_gate.read_scale * attention.count_scale(len(sources)))
    branch_input = depth_read(
        attention.routed_query(compute_dtype), gate, history_buffer, inv_rms_buffer, entries, partial,
        attention.key_streams, attention.value_streams, eps, gradients,
    )  # [B, T, D]
    return read_gate(branch_input, dtype)  # recorded there as a hidden state


class DARBranchResidual(nn.Module):
    """The DAR residual around one branch: its depth read, read gate and write gate."""

    def __init__(self, config: DARConfig, branch_index: int):
        super().__init__()
        self.branch_index = branch_index
        self.depth_attention = DARDepthAttention(config)
        self.read_gate = DARReadGate(config)
        self.write_gate = DARWriteGate(config, branch_index)


class DARReadout(nn.Module):
    """The final depth read over all committed entries before Llama's `norm` (own queries, key norms, read gate)."""

    def __init__(self, config: DARConfig):
        super().__init__()
        self.config = config
        self.depth_attention = DARDepthAttention(config)
        self.read_gate = DARReadGate(config)

    def forward(self, history_buffer, inv_rms_buffer, entries: tuple[torch.Tensor, ...], dtype, gradients=None):
        """All committed entries (each [B, T, J, D], copied in the buffers) -> u_F [B, T, D] in `dtype`."""
        return read_branch_input(
            self.depth_attention, self.read_gate, entries, None, (history_buffer, inv_rms_buffer, gradients),
            self.config.rms_norm_eps, dtype, self.config.dar_implementation,
        )


def _routing(config: DARConfig) -> tuple[tuple[int, ...], tuple[int, ...]]:
    """(key streams, value streams) indexed by target stream."""
    if config.dar_num_streams == 1:
        return (0,), (0,)
    pairs = ROUTING_KEY_VALUE_STREAMS[config.dar_routing]
    return tuple(key for key, _ in pairs), tuple(value for _, value in pairs)


class DARDecoderLayer(GradientCheckpointingLayer):
    """A Llama decoder layer whose two residual adds are replaced by DAR reads and writes.

    The DAR state goes in and comes out positionally (so that reentrant checkpointing sees it): the partial block
    state [B, T, J, D] and the committed entries, each [B, T, J, D]. The fast path also reads the entries' copies in
    a depth-major buffer [S_max, B, T, J, D] (with their inverse RMS [S_max, B, T, J]) that the model allocates
    once per forward; a commit writes the detached entry into its slot, and the partial is staged in the next free
    slot before a read. Autograd never sees the buffer, and a checkpointed replay rewrites the same values, so
    `forward` stays pure in everything autograd can observe. In backward the reads add the entries' gradients
    into the forward's `DepthGradients` (passed as `depth_gradients`), which the commits hand on.
    """

    def __init__(self, config: DARConfig, layer_idx: int):
        super().__init__()
        self.config = config
        self.hidden_size = config.hidden_size
        attention_class, _ = DAR_BRANCH_MODULES[config.dar_branch_family]
        self.self_attn = attention_class(config=config, layer_idx=layer_idx)
        self.mlp = self.build_mlp(config, layer_idx)
        self.input_layernorm = LlamaRMSNorm(config.hidden_size, eps=config.rms_norm_eps)
        self.post_attention_layernorm = LlamaRMSNorm(config.hidden_size, eps=config.rms_norm_eps)
        self.attn_residual = DARBranchResidual(config, branch_index=2 * layer_idx)
        self.mlp_residual = DARBranchResidual(config, branch_index=2 * layer_idx + 1)
        self.block_size = config.dar_block_size
        self.num_branches = config.dar_num_branches
        self.include_partial = config.dar_include_partial
        self.eps = config.rms_norm_eps

    def build_mlp(self, config: DARConfig, layer_idx: int) -> nn.Module:
        """The MLP branch: the family's dense MLP (the MoE variant overrides this with a sparse MoE block)."""
        return DAR_BRANCH_MODULES[config.dar_branch_family][1](config)

    def _commits(self, branch_index: int) -> bool:
        return (branch_index + 1) % self.block_size == 0 or branch_index == self.num_branches - 1

    def _reads_partial(self, branch_index: int) -> bool:
        return self.include_partial and branch_index % self.block_size != 0

    def _read(self, residual, partial, entries, buffers, dtype) -> torch.Tensor:
        """The branch input u [B, T, D]: the depth read over the committed entries and, inside a block, the partial."""
        partial = partial if self._reads_partial(residual.branch_index) else None
        return read_branch_input(
            residual.depth_attention, residual.read_gate, entries, partial, buffers, self.eps, dtype,
            self.config.dar_implementation,
        )

    def _write(self, residual, branch_output, partial, entries, buffers):
        partial = residual.write_gate(branch_output.to(partial.dtype), partial)  # [B, T, J, D]
        if self._commits(residual.branch_index):
            history_buffer, inv_rms_buffer, gradients = buffers
            partial = commit_entry(partial, history_buffer, inv_rms_buffer, len(entries), self.eps, gradients)
            entries = (*entries, partial)
        return partial, entries

    def forward(
        self,
        partial: torch.Tensor,
        history_buffer: torch.Tensor,
        inv_rms_buffer: torch.Tensor,
        *entries: torch.Tensor,
        attention_mask: torch.Tensor | None = None,
        position_ids: torch.LongTensor | None = None,
        past_key_values: Cache | None = None,
        use_cache: bool | None = False,
        position_embeddings: tuple[torch.Tensor, torch.Tensor] | None = None,
        depth_gradients: DepthGradients | None = None,
        **kwargs: Unpack[TransformersKwargs],
    ) -> tuple[torch.Tensor, ...]:
        dtype = self.input_layernorm.weight.dtype
        buffers = (history_buffer, inv_rms_buffer, depth_gradients)

        branch_input = self._read(self.attn_residual, partial, entries, buffers, dtype)  # [B, T, D]
        branch_output, _ = self.self_attn(
            hidden_states=self.input_layernorm(branch_input),
            attention_mask=attention_mask,
            position_ids=position_ids,
            past_key_values=past_key_values,
            use_cache=use_cache,
            position_embeddings=position_embeddings,
            **kwargs,
        )
        partial, entries = self._write(self.attn_residual, branch_output, partial, entries, buffers)

        # A block committed by the attention branch is already among the entries (and in the buffer).
        branch_input = self._read(self.mlp_residual, partial, entries, buffers, dtype)  # [B, T, D]
        branch_output = self.mlp(self.post_attention_layernorm(branch_input))
        partial, entries = self._write(self.mlp_residual, branch_output, partial, entries, buffers)
        return (partial, *entries)


class DARPreTrainedModel(PreTrainedModel):
    config: DARConfig
    base_model_prefix = "model"
    supports_gradient_checkpointing = True
    _no_split_modules = ["DARDecoderLayer"]
    _skip_keys_device_placement = ["past_key_values"]
    _supports_flash_attn = True
    _supports_sdpa = True
    _supports_flex_attn = True
    _can_compile_fullgraph = True
    _supports_attention_backend = True
    # DAR parameters stay float32 when the model is loaded in half precision (DESIGN.md section 4).
    _keep_in_fp32_modules_strict = ["attn_residual", "mlp_residual", "final_readout"]
    # hidden_states[l] is the input u of layer l's attention branch (the embedding for l = 0, Llama's residual
    # stream at upcycling), then the final readout (replaced by `last_hidden_state` after `norm`).
    _can_record_outputs = {
        "hidden_states": [
            OutputRecorder(DARReadGate, layer_name="attn_residual", capture_initial_hidden_state=False),
            OutputRecorder(DARReadGate, layer_name="final_readout", capture_initial_hidden_state=False),
        ],
        "attentions": "self_attn",
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

    def __init__(self, config: DARConfig):
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

        self.post_init()

    def initial_state(self, inputs_embeds: torch.Tensor) -> tuple:
        """(partial, history buffer, inverse-RMS buffer, depth gradients, entry 0): entry 0 of every stream is the
        embedding (times 1/J for split writes); the buffers hold one slot per committed entry (the embedding and one
        per block); `DepthGradients` collects the reads' gradients of the entries in backward."""
        config = self.config
        embedding = inputs_embeds.to(dar_compute_dtype(inputs_embeds.dtype)) * config.dar_embedding_scale  # [B, T, D]
        entry = embedding.unsqueeze(-2).expand(-1, -1, config.dar_num_streams, -1)  # [B, T, J, D]
        num_slots = 1 + math.ceil(config.dar_num_branches / config.dar_block_size)
        history_buffer = entry.new_empty(num_slots, *entry.shape)  # [S_max, B, T, J, D]
        inv_rms_buffer = entry.new_empty(num_slots, *entry.shape[:-1])  # [S_max, B, T, J]
        gradients = DepthGradients()
        entry = commit_entry(entry, history_buffer, inv_rms_buffer, 0, config.rms_norm_eps, gradients)
        return entry, history_buffer, inv_rms_buffer, gradients, entry  # the first branch starts a block

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
    ) -> BaseModelOutputWithPast:
        if (input_ids is None) ^ (inputs_embeds is not None):
            raise ValueError("You must specify exactly one of input_ids or inputs_embeds")

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
            past_key_values=past_key_values,
            position_ids=position_ids,
        )
        position_embeddings = self.rotary_emb(inputs_embeds, position_ids=position_ids)

        partial, history_buffer, inv_rms_buffer, depth_gradients, *entries = self.initial_state(inputs_embeds)
        for decoder_layer in self.layers[: self.config.num_hidden_layers]:
            partial, *entries = decoder_layer(
                partial,
                history_buffer,
                inv_rms_buffer,
                *entries,
                attention_mask=causal_mask,
                position_embeddings=position_embeddings,
                position_ids=position_ids,
                past_key_values=past_key_values,
                use_cache=use_cache,
                depth_gradients=depth_gradients,
                **kwargs,
            )

        readout = self.final_readout(
            history_buffer, inv_rms_buffer, tuple(entries), inputs_embeds.dtype, depth_gradients
        )
        hidden_states = self.norm(readout)
        return BaseModelOutputWithPast(last_hidden_state=hidden_states, past_key_values=past_key_values)


class DARForCausalLM(DARPreTrainedModel, GenerationMixin):
    _tied_weights_keys = {"lm_head.weight": "model.embed_tokens.weight"}
    _tp_plan = {"lm_head": "colwise_gather_output"}
    _pp_plan = {"lm_head": (["hidden_states"], ["logits"])}
    _fsdp_plan = {"lm_head": "keep_full_weight"}

    def __init__(self, config: DARConfig):
        super().__init__(config)
        self.model = DARModel(config)
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
    ) -> CausalLMOutputWithPast:
        outputs: BaseModelOutputWithPast = self.model(
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

        return CausalLMOutputWithPast(
            loss=loss,
            logits=logits,
            past_key_values=outputs.past_key_values,
            hidden_states=outputs.hidden_states,
            attentions=outputs.attentions,
        )


class DARForSequenceClassification(GenericForSequenceClassification, DARPreTrainedModel): ...


__all__ = ["DARPreTrainedModel", "DARModel", "DARForCausalLM", "DARForSequenceClassification"]
