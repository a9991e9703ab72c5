# SPDX-License-Identifier: Apache-2.0
# Copyright 2026 The dar-transformers authors.
"""How DAR's residual state is read and written: backends behind one registry, as `ALL_ATTENTION_FUNCTIONS` picks
token attention.

The paper modules (`modeling_dar.py`) say *what* a branch reads and writes (DESIGN.md section 2); a backend says
*how*. Every backend has the same methods over the same state (`DepthState`):

  Backend(config).start(entry, keep_weights, residuals) -> state with history (B_0,) and no partial (B_0 = the
                                           embedding; keep_weights=False: no caller records depth weights, read may
                                           return None; residuals: the model's branch residuals in order)
  plan(state, *residuals)                -> phase 1 of the leading reads that see the same committed entries
  read(residual, state, read_partial, planned) -> (u [B, T, D], depth weights [N, B, T, J])   eq. (2)-(5)
  write(residual, state, y, commits)     -> state after transport+write and, if `commits`, commit   eq. (6)-(8)

Backends (`ALL_DEPTH_BACKENDS`, keyed by `config.dar_implementation`):
  - "reference": the plain equations, composed from the paper modules themselves (`DARDepthAttention`,
    `DARReadGate`, `DARWriteGate`); every read stacks its sources and normalises every key again. The oracle.
  - "fast" (the default; eager only): the fused eager path. Keys are normalised once per committed entry; committed
    entries are copied into a depth-major buffer allocated once per forward, and each branch reads it with one fused
    product (`_DepthRead`). Its backward keeps per-token scalars only and leaves the entries' gradients as per-token
    coefficients, added for a block's reads at once into one shared buffer (`DepthGradients`: each entry row read
    and written once per block, not once per read) that each entry's commit hands to autograd (`_Commit`); its
    partial states are rebuilt in backward as "two_phase" rebuilds them (`_LeanPartials`). That sharing
    between autograd nodes is invisible to a compiler, so a forward traced by `torch.compile` with "fast"
    configured runs "two_phase" (`depth_backend`). It stays beside "two_phase" because it is faster eagerly by more
    than issue 16 item 5's 5% (docs/overhead-log.md); its hand-written backwards refuse double backward.
  - A forward with gradients off, eager or compiled, runs `InferenceDepthBackend` for "fast" and "two_phase"
    (`depth_backend`): two-phase reads without autograd, phase 1 once per block, in few operations per branch
    (eager decoding is bound by them; a compiled graph reads the history once per block). With
    `config.dar_inference_kernel = "cpp"` its eager CPU forwards of a few tokens run C++ kernels instead
    (`cpu_kernels.py`: phase 1, the read of the partial, the write and the commit, one call each).
  - "two_phase" (opt-in eagerly, for Full DAR's leaner backward; what compiled training forwards run): two-phase
    depth reads (DESIGN.md section 7). At a commit the per-token inverse RMS of the new entry is computed once per
    stream and kept in the state. Phase 1, once per decoder layer for the reads of that layer that
    see the same committed entries (the attention and MLP branches inside a block): the folded queries w * gamma of
    both branches meet the stacked history in one product (scores, log-sum-exp L, softmax-weighted value sum Obar).
    Phase 2, per branch: the partial P joins by the log-sum-exp rule, x = N * (sigmoid(L - z) Obar + sigmoid(z - L)
    P), then the read gate. Eagerly, phase 1 is computed without autograd; one `autograd.Function` per read
    (`_TwoPhaseRead`) keeps per-token statistics only (softmax weights and key dots, [N, B, T, J]) besides the
    entries and the partial that are alive anyway, and rebuilds every gradient from them. The write is plain
    autograd with the branch output y kept in the model dtype. Phase 1 is per decoder layer rather than per block
    of K branches so that a layer reads no other layer's parameters: layer-streamed verification, offloading and
    regional compilation see self-contained layers.
    Traced for training by `torch.compile`, everything is plain differentiable code over the entries one by one,
    and autograd derives the gradient, which inductor fuses. An entry's inverse RMS is computed once, at its commit;
    phase 1's scores (softmax weights and L) once per block, for all of the block's reads (`depth_scores_by_entry`);
    each read's value sum and phase 2 inside an activation checkpoint (`_recomputed_read`), so that backward keeps
    the read's inputs (entries and partial, alive anyway, and per-token scores) and recomputes the value sum. A
    read's source count is static, so every block compiles kernels of its own.
    With `config.dar_compiled_read = "operator"` each read, its phase 1 and the entries' statistics included, is
    instead one custom operator (`traced_two_phase_read`) whose gradient is another (`read_gradients` behind it):
    opaque to the compiler, so inductor calls the same precompiled code for every read of every block and the first
    compiled step compiles far less, while the reads run unfused. With `config.dar_training_kernel = "cpp"` too, the
    operators are `traced_source_read` and its gradient, which run the C++ kernels on CPU (`cpu_kernels.py`:
    `read_sources`, one pass over each token's sources each way) and PyTorch operations elsewhere.

Shape legend: B batch, T tokens, D hidden, S committed entries, N sources of one read (S, or S + 1 with the
partial), R reads planned together, J streams. One layout for the history everywhere: depth-major, entry n of every
stream is [B, T, J, D], and the entries stacked on a leading depth axis are [N, B, T, J, D].
Precision policy (`dar_compute_dtype` and `dar_history_dtype`, the one place that says it): the DAR state and depth
mixing run in float32 (or float64 for a float64 model), also under autocast; a branch output y arrives in the model
dtype. `config.dar_history_dtype = "model"` stores the committed entries in the model dtype instead (as Llama stores
its residual stream); every read upcasts them, so statistics, softmax and mixing stay float32. The backends store a
commit in entry 0's dtype, which the model picks with `dar_history_dtype`.
"""

import math
import re
import weakref
from collections.abc import Callable, Iterator
from contextlib import contextmanager, nullcontext
from dataclasses import dataclass
from typing import Any, NamedTuple, Optional

import torch
from torch.autograd import forward_ad
from torch.nn.modules.module import (
    register_module_module_registration_hook,
    register_module_buffer_registration_hook,
    register_module_parameter_registration_hook,
)
from torch.nn.utils.parametrize import is_parametrized
from torch.optim.optimizer import register_optimizer_step_post_hook
from torch.utils.checkpoint import checkpoint
from transformers.utils import logging
from transformers.utils.generic import GeneralInterface

from .configuration_dar import check_backend_options, dar_routing
from .cpu_kernels import cpu_kernels

logger = logging.get_logger(__name__)

try:  # FSDP2's sharded parameters; a torch built without distributed support has none (isinstance(x, ()) is False)
    from torch.distributed.tensor import DTensor
except ImportError:
    DTensor = ()


DEPTH_KEY_NORM_MIN_EPS = 1e-12  # `depth_key_norm_eps`


def dar_compute_dtype(model_dtype: torch.dtype) -> torch.dtype:
    """The dtype of the DAR state and depth mixing: float32, or wider if the model is wider."""
    return torch.promote_types(model_dtype, torch.float32)


def dar_history_dtype(config, model_dtype: torch.dtype) -> torch.dtype:
    """The dtype the committed entries B_0 .. B_{n-1} are stored in (`config.dar_history_dtype`): the compute dtype
    ("float32"), or the model dtype ("model"). Partial, statistics and mixing are in the compute dtype either way.
    A float16 model keeps the compute dtype under "model" too, with a warning once: a committed entry is a block's
    sum of branch outputs, each scaled by its write gate (up to 2), which Llama's running residual never holds alone,
    so it can leave float16's range (65504) where Llama's stays inside, and became inf, then NaN (bfloat16 has
    float32's range)."""
    if config.dar_history_dtype != "model":
        return dar_compute_dtype(model_dtype)
    if model_dtype == torch.float16:
        if not torch.compiler.is_compiling():
            logger.warning_once(
                "dar_history_dtype='model' keeps the DAR history in float32 in a float16 model: a committed entry (a "
                "block's gated sum of branch outputs) can exceed float16's range where Llama's residual does not. "
                "Load the model in bfloat16 to store it in the model dtype."
            )
        return dar_compute_dtype(model_dtype)
    return model_dtype


def depth_key_norm_eps(config) -> float:
    """The eps of the depth keys' RMSNorm: `config.rms_norm_eps`, at least `DEPTH_KEY_NORM_MIN_EPS`. An all-zero entry
    (a padded position's branch output, its attention fully masked) then gets a zero key, where rms_norm_eps = 0, which
    a Llama config may hold (its own norms never see a zero vector), made it 0/0 = NaN, and the padded position's NaN
    reached real ones through the next attention's values. The floor keeps the backward finite too: the inverse RMS's
    derivative at a zero entry goes as eps^-1.5, 1e18 at this floor but inf at float32's smallest normal number (then
    0 x inf: NaN gradients). Against any real entry's mean square it changes nothing float32 resolves, and every eps
    above it is kept as is."""
    return max(float(config.rms_norm_eps), DEPTH_KEY_NORM_MIN_EPS)


@dataclass(frozen=True)
class DepthState:
    """The residual state between branches: the committed history B_0 .. B_{S-1} of every stream (a tuple of
    [B, T, J, D], depth-major), the partial block state P [B, T, J, D] (None at the start of a block), the per-token
    inverse RMS of every committed entry [S, B, T, J] (two-phase backend; computed at the commit, without autograd
    history; B_0's only in a forward traced for training, whose reads compute their own; None for the reference
    and for "fast", which keeps it in its own buffer), and the backend that reads and writes it.

    A decoder layer takes and returns it flattened (`as_args`), so that reentrant gradient checkpointing, which only
    sees positional tensors, tracks the partial and every entry.
    """

    backend: Any
    partial: torch.Tensor | None
    history: tuple[torch.Tensor, ...]
    history_inv_rms: torch.Tensor | None = None

    def as_args(self) -> tuple:
        return (self.backend, self.partial, self.history_inv_rms, *self.history)

    @classmethod
    def from_args(cls, backend, partial, history_inv_rms, *history) -> "DepthState":
        return cls(backend, partial, tuple(history), history_inv_rms)

    def sources(self, read_partial: bool) -> tuple[torch.Tensor, ...]:
        """S^j of DESIGN.md section 2: the committed entries, then the partial when the branch reads it."""
        return (*self.history, self.partial) if read_partial else self.history


# ---------------------------------------------------------------------------------------------------------------
# "reference": the equations as written, through the paper modules.


class ReferenceDepthBackend:
    """The plain equations: every read stacks its sources and re-normalises every key (DESIGN.md section 2)."""

    def __init__(self, config):
        pass

    def start(self, entry: torch.Tensor, keep_weights: bool = True, residuals=()) -> DepthState:
        return DepthState(self, None, (entry,))

    def plan(self, state: DepthState, *residuals) -> tuple[None, ...]:
        return (None,) * len(residuals)

    def keeping_partials_lean(self):
        return nullcontext()

    def read(self, residual, state: DepthState, read_partial: bool, planned=None, dtype=None) -> tuple:
        """(u [B, T, D] in the compute dtype, depth weights [N, B, T, J]). `dtype`: the branch's, which a backend
        may return u in already (the inference backend's kernels do); the caller converts u otherwise."""
        compute_dtype = dar_compute_dtype(state.history[0].dtype)
        with _without_autocast(state.history[0].device.type):  # the precision policy, also under autocast
            sources = torch.stack([source.to(compute_dtype) for source in state.sources(read_partial)])  # [N,B,T,J,D]
            extraction, weights = residual.depth_attention(sources)  # [B, T, J, D], [N, B, T, J]
            return residual.read_gate(extraction), weights  # u [B, T, D]

    def write(self, residual, state: DepthState, branch_output: torch.Tensor, commits: bool) -> DepthState:
        compute_dtype = dar_compute_dtype(state.history[0].dtype)
        with _without_autocast(state.history[0].device.type):
            partial = residual.write_gate(branch_output.to(compute_dtype), state.partial)  # [B, T, J, D]
        if commits:  # stored in the history's dtype (`dar_history_dtype`)
            return DepthState(self, None, (*state.history, partial.to(state.history[0].dtype)))
        return DepthState(self, partial, state.history)


# ---------------------------------------------------------------------------------------------------------------
# "two_phase": two-phase reads (DESIGN.md section 7).


def inverse_rms(x: torch.Tensor, eps: float) -> torch.Tensor:
    """1 / RMS over the last axis, as in RMSNorm: [..., D] -> [...]."""
    return torch.rsqrt(x.pow(2).mean(-1) + eps)


def inverse_rms_unfused(x: torch.Tensor, eps: float) -> torch.Tensor:
    """`inverse_rms` without an x-sized temporary (x.pow(2)), for code that runs op by op on whole histories."""
    return torch.linalg.vecdot(x, x).div_(x.shape[-1]).add_(eps).rsqrt_()


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
    """query [..., J, D] -> [..., J_key * D, J]: column j holds target j's query in the rows of its key stream
    kappa(j), zeros elsewhere, so that (entry [.., J_key * D]) @ routed gives every target's key dot directly (any
    routing, no per-routing gather of the dots); for any leading dimensions (stacked residuals)."""
    selector = stream_selector(key_streams, query)  # [J_key, J]
    routed = query.transpose(-1, -2).unsqueeze(-3) * selector[:, None, :]  # [..., J_key, D, J]
    return routed.flatten(-3, -2)


def routed_queries_wide(query: torch.Tensor, key_streams: tuple[int, ...]) -> torch.Tensor:
    """query [..., J, D] -> [..., J, J_key * D], contiguous: `routed_queries` transposed (row j holds target j's
    query in the columns of its key stream kappa(j), zeros elsewhere), for any leading dimensions."""
    selector = stream_selector(key_streams, query)  # [J_key, J]
    return (query.unsqueeze(-2) * selector.T.unsqueeze(-1)).flatten(-2)  # [..., J, J_key, D] -> [..., J, J_key * D]


def unrouted_queries(routed: torch.Tensor, selector: torch.Tensor) -> torch.Tensor:
    """[J_key * D, J] -> [J, D]: the rows `routed_queries` placed (selector [J_key, J], `stream_selector` of the key
    streams); applied to the routed query's gradient, the query's gradient (the placement's adjoint)."""
    streams = selector.shape[1]
    return (routed.view(streams, -1, streams) * selector[:, None, :]).sum(0).T


def wide_product(rows: torch.Tensor, weight_t: torch.Tensor, neutral: bool = False) -> torch.Tensor:
    """rows [n, k] @ weight_t.T for a narrow weight (weight_t [r, k], r a few columns): computed as
    (weight_t @ rows.T).T, a view [n, r]. CPU BLAS takes a [k, r] right operand several times slower per row than
    the same product with the wide operand on the right (1.3 us against 0.18 us per row at k = 1152, r = 2, with
    weight_t contiguous; 0.54 us with weight_t a transposed view).

    `neutral`: as products and sums, which autocast leaves in their dtype, for a training forward traced under
    autocast (`TwoPhaseDepthBackend.start`). A matrix product there, inside DAR's autocast-off region, has its
    backward traced with autocast on (PyTorch issue 179804): the depth path's gradients came out of bf16 products,
    1e-2 to 3e-2 off."""
    if neutral:
        return (rows.unsqueeze(-2) * weight_t).sum(-1)
    return (weight_t @ rows.T).T


def key_dots_of(rows: torch.Tensor, routed: torch.Tensor, neutral: bool = False) -> torch.Tensor:
    """rows [n, J * D] @ routed [J * D, r] (`routed_queries`, side by side for r / J reads) -> [n, r], taken wide
    (`wide_product`, routed transposed contiguous). Differentiable, and autograd's products are then wide too
    (d routed^T = g^T rows, d rows = g routed^T), where the narrow form's d routed = rows^T g is as slow as its
    forward; the same holds for the BLAS calls of a graph compiled by inductor."""
    return wide_product(rows, routed.T.contiguous(), neutral)


def _by_value_stream(by_target: torch.Tensor, value_streams: tuple[int, ...]) -> torch.Tensor:
    """[..., J] indexed by target stream -> [..., J_val] indexed by value stream, summing the targets that read
    each value stream: out[..., v] = sum over j with nu(j) = v of x[..., j] (zero for a stream nobody reads)."""
    streams = by_target.shape[-1]
    if sorted(value_streams) == list(range(streams)):  # a permutation: identity or swap
        return _streams(by_target, tuple(value_streams.index(stream) for stream in range(streams)), by_target.dim() - 1)
    return by_target @ stream_selector(value_streams, by_target).T  # [J, J_val]: row j marks nu(j)


@dataclass(frozen=True)
class PhaseOne:
    """Phase 1 of one read, against the committed entries only (DESIGN.md section 7), without autograd history:
    softmax weights [S, B, T, J], the log-sum-exp L of the scores [B, T, J] and the softmax-weighted value sum Obar
    [B, T, J, D] (values of stream nu(j)). Traced training plans the differentiable scores alone (`mean` None): each
    read forms its value sum itself (`_recomputed_read`)."""

    weights: torch.Tensor
    log_sum_exp: torch.Tensor
    mean: torch.Tensor | None


def phase_one(
    routed: torch.Tensor, history: torch.Tensor, history_inv_rms: torch.Tensor, key_streams, value_streams
) -> list[PhaseOne]:
    """Phase 1 of R reads in one pass over the history: routed [J * D, R * J] (`routed_queries` side by side),
    history [S, B, T, J, D], its inverse RMS [S, B, T, J] -> one `PhaseOne` per read."""
    sources, batch, tokens, streams, hidden = history.shape
    reads = routed.shape[1] // streams
    key_dots = key_dots_of(history.view(-1, streams * hidden), routed).view(sources, batch, tokens, reads, streams)
    weights, log_sum_exp = _depth_softmax(key_dots, history_inv_rms, key_streams)
    return _by_read(weights, log_sum_exp, _value_sums(weights, history, value_streams))


def depth_scores_by_entry(
    routed: torch.Tensor, entries: tuple[torch.Tensor, ...], history_inv_rms: torch.Tensor, key_streams,
    neutral: bool = False,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Phase 1's scores of R reads over the entries one by one, differentiable (traced training, once per block):
    routed [J * D, R * J], entries [B, T, J, D] each, their inverse RMS [S, B, T, J] -> softmax weights
    [S, B, T, R, J] and log-sum-exp L [B, T, R, J]. No stacked copy of the history; what autograd keeps besides the
    entries is per-token ([.., R, J]), and the product's gradient is wide too (`key_dots_of`)."""
    batch, tokens, streams, hidden = entries[0].shape
    reads = routed.shape[1] // streams
    routed_t = routed.T.contiguous()  # [R * J, J * D]: each entry's key dots a wide product
    key_dots = torch.stack(
        [wide_product(entry.to(routed.dtype).reshape(-1, streams * hidden), routed_t, neutral) for entry in entries]
    )
    return _depth_softmax(key_dots.view(len(entries), batch, tokens, reads, streams), history_inv_rms, key_streams)


def value_sum_by_entry(weights: torch.Tensor, entries: tuple[torch.Tensor, ...], value_streams, dtype) -> torch.Tensor:
    """Obar^j = sum_s weights[s, .., j] B_s^{nu(j)} of one read over the entries one by one: weights [S, B, T, J] ->
    [B, T, J, D] in `dtype` (of R reads: weights [S, R, B, T, J] -> [R, B, T, J, D]); inductor fuses the sum over the
    entries into one kernel."""
    return sum(
        weights[source].unsqueeze(-1) * _streams(entry.to(dtype), value_streams, 2)
        for source, entry in enumerate(entries)
    )


def _depth_softmax(key_dots, history_inv_rms, key_streams) -> tuple[torch.Tensor, torch.Tensor]:
    """Key dots [S, B, T, R, J] times the key stream's inverse RMS [S, B, T, J] -> softmax weights over depth
    [S, B, T, R, J] and the log-sum-exp L of the scores [B, T, R, J]."""
    scores = key_dots * _streams(history_inv_rms, key_streams, 3).unsqueeze(3)
    # Softmax weights, not exp(scores - L): those sum to 1 only to eps |L|, and a confident read's score gradient,
    # a (g.v - sum a g.v), cancels to that error (float32 gradients 80x the reference's off with scores of O(100)).
    # L from the softmax's own max, exponentials and sum (inductor shares them): `logsumexp` beside `softmax` compiled
    # to a second reduction and backward chain (+4 % on a compiled training step at hidden 256, this form within
    # noise). The max is a constant of the gradient (it cancels from L), as in torch's logsumexp.
    top = scores.detach().amax(0)
    return scores.softmax(0), top + torch.log(torch.exp(scores - top).sum(0))


def _by_read(weights, log_sum_exp, means) -> list[PhaseOne]:
    """Phase 1 of R reads (weights [S, B, T, R, J], L [B, T, R, J], Obar [B, T, J, R, D]) -> one `PhaseOne` each."""
    return [
        PhaseOne(weights[:, :, :, read], log_sum_exp[:, :, read], means[:, :, :, read])
        for read in range(weights.shape[3])
    ]


def _value_sums(weights: torch.Tensor, history: torch.Tensor, value_streams: tuple[int, ...]) -> torch.Tensor:
    """Obar^j_r = sum_s weights[s, .., r, j] B_s^{nu(j)}: weights [S, B, T, R, J], history [S, B, T, J, D] ->
    [B, T, J, R, D]. One batched product per token and value stream over a strided view of the history (no copy of
    it; einsum would copy or loop per token here)."""
    sources, batch, tokens, reads, streams = weights.shape
    hidden = history.shape[-1]
    if len(set(value_streams)) < streams:  # fixedkv: every target reads one stream
        values = history[:, :, :, value_streams[0]].reshape(sources, -1, hidden).transpose(0, 1)  # [BT, S, D]
        rows = weights.permute(1, 2, 3, 4, 0).reshape(-1, reads * streams, sources).contiguous()  # [BT, R * J, S]
        means = torch.bmm(rows, values).view(batch, tokens, reads, streams, hidden)
        return means.transpose(2, 3)  # [B, T, J, R, D]
    # a permutation: reorder the targets by value stream, read every value stream once
    by_value = _streams(weights, tuple(value_streams.index(stream) for stream in range(streams)), 4)
    # contiguous: a strided operand (even one with a size-1 axis) sends CPU bmm down a per-matrix copy loop
    rows = by_value.permute(1, 2, 4, 3, 0).reshape(-1, reads, sources).contiguous()  # [B T J_val, R, S]
    values = history.view(sources, -1, hidden).transpose(0, 1)  # [B T J_val, S, D], a view
    means = torch.bmm(rows, values).view(batch, tokens, streams, reads, hidden)  # by value stream
    return _streams(means, value_streams, 2)  # [B, T, J, R, D] by target


def _fused_value_sums(weights: torch.Tensor, history: torch.Tensor, value_streams: tuple[int, ...]) -> torch.Tensor:
    """`_value_sums` as a sum over the S entries (a traced forward with gradients off): inductor fuses it with the
    softmax's normalisation and the gated sum into one pass, where the batched product costs 50-120 us per block at
    decoding sizes (S columns per token; docs/overhead-log.md)."""
    by_read = weights.permute(0, 3, 1, 2, 4)  # [S, R, B, T, J]
    return value_sum_by_entry(by_read, history.unbind(0), value_streams, history.dtype).permute(1, 2, 3, 0, 4)


def phase_two(phase: PhaseOne, routed, gate, partial, partial_inv_rms, key_streams, value_streams, neutral=False):
    """Phase 2 of one read: the partial (if read) joins phase 1 by the log-sum-exp rule, then the read gate.

    routed [J * D, J], gate [J] (read gate times read and count scaling), partial [B, T, J, D] or None with its
    inverse RMS [B, T, J] -> (u [B, T, D], softmax weights [N, B, T, J]).
    """
    if partial is None:
        extraction, weights = phase.mean, phase.weights  # [B, T, J, D], [S, B, T, J]
    else:
        batch, tokens, streams, hidden = partial.shape
        partial_rows = partial.reshape(-1, streams * hidden)
        partial_dots = key_dots_of(partial_rows, routed, neutral).view(batch, tokens, streams)  # [B, T, J]
        score = partial_dots * _streams(partial_inv_rms, key_streams, 2)  # z [B, T, J]
        share = torch.sigmoid(score - phase.log_sum_exp)  # the partial's softmax weight e^z / (e^L + e^z)
        # the entries' share as sigmoid(L - z), not 1 - sigmoid(z - L), and the mix as rest Obar + share P, not
        # lerp(Obar, P, share) = Obar + share (P - Obar): both cancel when the partial dominates, leaving rounding of
        # the size of Obar where the reference's is of the size of P (255x its float32 error with entries 1e4 P)
        rest = torch.sigmoid(phase.log_sum_exp - score)  # [B, T, J]
        values = _streams(partial, value_streams, 2)  # [B, T, J, D]: P^{nu(j)}
        extraction = torch.addcmul(phase.mean * rest.unsqueeze(-1), values, share.unsqueeze(-1))  # [B, T, J, D]
        weights = torch.cat([phase.weights * rest, share.unsqueeze(0)])
    branch_input = (extraction * gate.unsqueeze(-1)).sum(-2)  # [B, T, D]: sum_j gate_j x^j
    return branch_input, weights


def gated_write(partial, rho, beta, branch_output):
    """(6) of one branch output y [B, T, D] in the model dtype: P = beta * y at the start of a block (partial None),
    else rho P + (1 - rho) swap(P) + beta * y -> [B, T, J, D] in beta's dtype. The swap is applied after the product,
    so autograd keeps P itself (once) and y in the model dtype, nothing else entry-sized. One stream: rho is None
    after the first branch too, and P + y (beta = 1)."""
    written = beta * branch_output.unsqueeze(-2)  # [B, T, J, D]
    if partial is None:
        return written
    if rho is None:
        return partial + written
    return rho * partial + ((1.0 - rho) * partial).flip(-2) + written


READ_BACKWARD_ENTRY_CHUNK = 8  # committed entries stacked at once by a read's backward


def refuses_double_backward(backward):
    """A hand-written backward that refuses to build a differentiable gradient: a backward with `create_graph=True`
    (a second derivative, a Hessian-vector product, a gradient penalty through the model) raises at once, naming the
    way out. torch's `once_differentiable` attaches its error to the outputs instead, where a second backward with
    explicit inputs (`torch.autograd.grad(penalty, weight)`, `backward(inputs=...)`) never reaches it, and where it
    attaches none (the incoming gradients not requiring grad) the second derivative comes out silently partial (this
    backward also reads saved tensors that require grad: gates, queries, the shared entry buffer). A backward called
    inside an autocast region (`loss.backward()` within `torch.autocast`) runs with autocast off, as its forward
    did: its products mix float32 operands that autocast would otherwise cast apart. (Without create_graph a backward
    runs with gradients off already, so torch's decorator would add nothing here.)"""
    name = backward.__qualname__.split(".")[0]

    def wrapper(ctx, *grads):
        if torch.is_grad_enabled():  # create_graph=True: the caller asks for a differentiable gradient
            raise RuntimeError(
                f"DAR's hand-written backward {name} is differentiable once only (once_differentiable), so a backward "
                "with create_graph=True through it (a second derivative, a Hessian-vector product, a gradient penalty) "
                "would be wrong. Use config.dar_implementation = 'reference' (plain autograd) and "
                "config.dar_training_kernel = 'torch' for it."
            )
        device_type = next((grad.device.type for grad in grads if isinstance(grad, torch.Tensor)), "cpu")
        if torch.is_autocast_enabled(device_type):  # backward called inside autocast: the precision policy holds
            with torch.autocast(device_type, enabled=False):
                return backward(ctx, *grads)
        return backward(ctx, *grads)

    return wrapper


class _TwoPhaseRead(torch.autograd.Function):
    """One branch's read (phase 2 on a phase 1 computed without autograd), with the gradient of the whole read.

    Saves per-token statistics (softmax weights [N, B, T, J], inverse RMS) and references to the committed entries
    and the partial, which are alive anyway; nothing entry-sized of its own. Backward stacks the entries again, in
    chunks of `READ_BACKWARD_ENTRY_CHUNK` (a pass for the dots, a pass for the gradients when there are several),
    recomputes the key dots (one product per chunk) and rebuilds every gradient from them, including the key
    normalisation's, d rms^-1 / d h = -rms^-3 h / D. Its inputs are its only state, so `torch.compile` traces it like
    plain code.
    """

    @staticmethod
    def forward(ctx, routed, gate, partial, history_inv_rms, weights, log_sum_exp, mean, routing, eps, *entries):
        phase = PhaseOne(weights, log_sum_exp, mean)
        partial_inv_rms = None if partial is None else inverse_rms(partial, eps)
        branch_input, weights = phase_two(phase, routed, gate, partial, partial_inv_rms, *routing)
        ctx.save_for_backward(routed, gate, weights, partial, partial_inv_rms, history_inv_rms, *entries)
        ctx.routing = routing
        ctx.mark_non_differentiable(weights)
        return branch_input, weights

    @staticmethod
    @refuses_double_backward  # hand-written: a second derivative through it would be silently wrong
    def backward(ctx, grad_input, _grad_weights):
        routed, gate, weights, partial, partial_inv_rms, history_inv_rms, *entries = ctx.saved_tensors
        grad_routed, grad_gate, grad_partial, grad_chunks = read_gradients(
            grad_input, routed, gate, weights, partial, partial_inv_rms, history_inv_rms, entries, ctx.routing,
            *ctx.needs_input_grad[:2],
        )
        unused = (None,) * 6  # history_inv_rms, phase 1, routing, eps: no gradient
        grad_entries = [grad for chunk in grad_chunks for grad in chunk.unbind(0)]
        return (grad_routed, grad_gate, grad_partial, *unused, *grad_entries)


def read_gradients(grad_input, routed, gate, weights, partial, partial_inv_rms, history_inv_rms, entries, routing,
                   needs_routed: bool = True, needs_gate: bool = True, separate: bool = False):
    """The gradient of one two-phase read (`_TwoPhaseRead`, and the traced read `traced_two_phase_read`) from its
    per-token statistics: -> (d routed [J * D, J] or None, d gate [J] or None, d partial or None, the entries'
    gradients in the history dtype: in chunks [C, B, T, J, D] of `READ_BACKWARD_ENTRY_CHUNK`, or with `separate`
    one tensor [1, B, T, J, D] per entry, none a view of another's storage)."""
    key_streams, value_streams = routing
    sources, (batch, tokens, streams, hidden) = len(entries), entries[0].shape
    # The entries in chunks: what backward holds beyond the entries and their gradients is one chunk's stack and
    # temporaries, not the whole history's (Full DAR's final readout sees up to M + 1 entries).
    chunks = [slice(start, min(start + READ_BACKWARD_ENTRY_CHUNK, sources))
              for start in range(0, sources, READ_BACKWARD_ENTRY_CHUNK)]

    def stacked(chunk: slice) -> torch.Tensor:  # [C, B, T, J, D], recomputed, in the compute dtype
        return torch.stack(entries[chunk]).to(routed.dtype)

    # g . B^v_r per value stream: one product per token and stream over a strided view of the history
    grad_rows = grad_input.unsqueeze(2).expand(batch, tokens, streams, hidden).reshape(-1, hidden, 1)  # [BTJ, D, 1]
    key_dots, value_dots = [], []
    for chunk in chunks:
        history = stacked(chunk)
        size = history.shape[0]
        key_dots.append(key_dots_of(history.view(-1, streams * hidden), routed).view(size, batch, tokens, streams))
        dots = torch.bmm(history.view(size, -1, hidden).transpose(0, 1), grad_rows)  # [BTJ, C, 1]
        value_dots.append(dots.view(batch, tokens, streams, size).permute(3, 0, 1, 2))  # [C, B, T, J_val]
    key_dots = key_dots[0] if len(chunks) == 1 else torch.cat(key_dots)  # recomputed, [S, B, T, J]
    value_dots = value_dots[0] if len(chunks) == 1 else torch.cat(value_dots)
    if partial is not None:
        partial_dots = key_dots_of(partial.reshape(-1, streams * hidden), routed).view(1, batch, tokens, streams)
        key_dots = torch.cat([key_dots, partial_dots])  # [N, B, T, J]
    key_inv_rms = _streams(history_inv_rms, key_streams, 3)  # [S, B, T, J]
    if partial is not None:
        partial_value_dots = (partial * grad_input.unsqueeze(2)).sum(-1)  # [B, T, J_val]
        value_dots = torch.cat([value_dots, partial_value_dots.unsqueeze(0)])
        key_inv_rms = torch.cat([key_inv_rms, _streams(partial_inv_rms, key_streams, 2).unsqueeze(0)])
    target_value_dots = _streams(value_dots, value_streams, 3)  # [N, B, T, J]: g . V^{nu(j)}_n
    grad_gate = (weights * target_value_dots).sum((0, 1, 2)) if needs_gate else None  # [J]
    grad_weights = gate * target_value_dots  # [N, B, T, J]
    grad_scores = weights * (grad_weights - (weights * grad_weights).sum(0))  # softmax backward over depth
    grad_keyed = grad_scores * key_inv_rms  # [N, B, T, J]: d/d key dots
    selector = stream_selector(key_streams, weights)  # [J_key, J]
    grad_inv_rms = (grad_scores * key_dots) @ selector.T  # [N, B, T, J_key]
    queries = unrouted_queries(routed, selector)  # [J, D]
    coefficients = _by_value_stream(weights * gate, value_streams)  # [N, B, T, J_val]

    keys_permuted = sorted(key_streams) == list(range(streams))  # each key stream keys exactly one target
    if keys_permuted:  # per key stream: its target's key-dot gradient and query
        grad_keyed_by_stream = _by_value_stream(grad_keyed, key_streams)  # [N, B, T, J_key]
        queries_by_stream = _by_value_stream(queries.T, key_streams).T  # [J_key, D]

    def source_gradient(source, index, source_inv_rms):  # value, key and key-norm paths: [..., J, D]
        grad = coefficients[index].unsqueeze(-1) * grad_input.unsqueeze(-2)  # the one entry-sized temporary
        norm_coefficient = grad_inv_rms[index] * source_inv_rms.pow(3) / -hidden  # [..., J]
        grad.addcmul_(source, norm_coefficient.unsqueeze(-1))
        if keys_permuted:
            return grad.addcmul_(grad_keyed_by_stream[index].unsqueeze(-1), queries_by_stream)
        return grad.add_((grad_keyed[index].unsqueeze(-2) * selector) @ queries)  # [..., J_key, J] @ [J, D]

    grad_chunks, grad_routed = [], None
    for chunk in chunks:
        if len(chunks) > 1:
            history = stacked(chunk)  # again: one chunk at a time is what backward holds
        if separate:  # a compiled graph adds each into its entry's gradient: one kernel for any entry and depth
            grad_chunks += [source_gradient(history[index : index + 1], slice(start, start + 1),
                                            history_inv_rms[start : start + 1]).to(entries[0].dtype)
                            for index, start in enumerate(range(chunk.start, chunk.stop))]
        else:
            grad_history = source_gradient(history, chunk, history_inv_rms[chunk])  # [C, B, T, J, D]
            grad_chunks.append(grad_history.to(entries[0].dtype))  # in the entries' own (history) dtype
        if needs_routed:  # (g^T H)^T: a wide product, several times faster than H^T g on CPU
            part = grad_keyed[chunk].reshape(-1, streams).T @ history.reshape(-1, streams * hidden)
            grad_routed = part if grad_routed is None else grad_routed + part
    grad_partial = source_gradient(partial, sources, partial_inv_rms) if partial is not None else None
    if needs_routed:
        if partial is not None:
            grad_routed = grad_routed + grad_keyed[sources].reshape(-1, streams).T @ partial.reshape(
                -1, streams * hidden
            )
        grad_routed = grad_routed.T
    return grad_routed, grad_gate, grad_partial, grad_chunks


def two_phase_read(
    routed: torch.Tensor,
    gate: torch.Tensor,
    state: "DepthState",
    partial: torch.Tensor | None,
    phase: PhaseOne,
    key_streams: tuple[int, ...],
    value_streams: tuple[int, ...],
    eps: float,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Phase 2 of one read -> (u [B, T, D], depth weights [N, B, T, J]), with `_TwoPhaseRead`'s gradient when
    training, plainly otherwise."""
    inputs = (routed, gate, partial, *state.history)
    if torch.is_grad_enabled() and any(tensor is not None and tensor.requires_grad for tensor in inputs):
        return _TwoPhaseRead.apply(
            routed, gate, partial, state.history_inv_rms, phase.weights, phase.log_sum_exp, phase.mean,
            (key_streams, value_streams), eps, *state.history,
        )
    partial_inv_rms = None if partial is None else inverse_rms(partial, eps)
    branch_input, weights = phase_two(phase, routed, gate, partial, partial_inv_rms, key_streams, value_streams)
    return branch_input, weights


def _traced_training() -> bool:
    """A forward traced by `torch.compile` with gradients on: its reads run `_recomputed_read` in a checkpoint, or
    the custom operator `traced_two_phase_read` (`dar_compiled_read`)."""
    return torch.compiler.is_compiling() and torch.is_grad_enabled()


def _recomputed_read(weights, log_sum_exp, routed, gate, partial, routing, eps, neutral, *entries):
    """Phase 2 of one read in plain differentiable operations, the value sum of phase 1 included: what a training
    forward traced by `torch.compile` runs, inside an activation checkpoint, after its block's scores
    (`depth_scores_by_entry`, once per block): backward keeps the read's inputs only (the entries, alive as the
    history, the partial, the block's per-token weights, the query and gate) and recomputes the value sum
    [B, T, J, D] instead of keeping it per read; autograd derives the gradient, which inductor then fuses (the
    hand-written `_TwoPhaseRead.backward` compiles to kernels that recompute per-token coefficients for every
    element)."""
    key_streams, value_streams = routing
    phase = PhaseOne(weights, log_sum_exp, value_sum_by_entry(weights, entries, value_streams, routed.dtype))
    partial_inv_rms = None if partial is None else inverse_rms(partial, eps)
    return phase_two(phase, routed, gate, partial, partial_inv_rms, key_streams, value_streams, neutral)


# `dar_compiled_read = "operator"`: the traced training read and its gradient as two custom operators, opaque to the
# compiler: inductor calls them as they are instead of generating kernels for them, so every read of every block runs
# the same code (inlined, each block's reads compile kernels of their own: their source count is static). The
# namespace is this module's, so that a copy loaded as a Hub folder's remote code registers its own.
_OPERATORS = re.sub(r"\W", "_", __name__)


@torch.library.custom_op(f"{_OPERATORS}::two_phase_read", mutates_args=())
def traced_two_phase_read(
    routed: torch.Tensor, gate: torch.Tensor, partial: Optional[torch.Tensor], entries: list[torch.Tensor],
    key_streams: list[int], value_streams: list[int], eps: float,
) -> tuple[torch.Tensor, torch.Tensor]:  # `Optional`: what every torch >= 2.4 parses
    """One read as `_TwoPhaseRead` computes it, phase 1 included (the entries' key statistics recomputed from them),
    for a forward traced for training: -> (u [B, T, D], depth weights [N, B, T, J]). Autograd keeps its inputs
    (entries and partial, alive anyway) and the softmax weights; the gradient is `read_gradients`, also opaque."""
    routing = (tuple(key_streams), tuple(value_streams))
    history = torch.stack(entries).to(routed.dtype)  # [S, B, T, J, D]
    phase = phase_one(routed, history, inverse_rms_unfused(history, eps), *routing)[0]
    partial_inv_rms = None if partial is None else inverse_rms_unfused(partial, eps)
    branch_input, weights = phase_two(phase, routed, gate, partial, partial_inv_rms, *routing)
    return branch_input, weights.contiguous()  # the strides its fake (below) promises the compiler


@traced_two_phase_read.register_fake
def _(routed, gate, partial, entries, key_streams, value_streams, eps):
    batch, tokens, streams, hidden = entries[0].shape
    sources = len(entries) + int(partial is not None)
    return routed.new_empty(batch, tokens, hidden), routed.new_empty(sources, batch, tokens, streams)


@torch.library.custom_op(f"{_OPERATORS}::two_phase_read_backward", mutates_args=())
def _traced_read_backward(
    grad_input: torch.Tensor, routed: torch.Tensor, gate: torch.Tensor, weights: torch.Tensor,
    partial: Optional[torch.Tensor], entries: list[torch.Tensor], key_streams: list[int], value_streams: list[int],
    eps: float, needs_routed: bool, needs_gate: bool,
) -> list[torch.Tensor]:
    """`read_gradients` of `traced_two_phase_read`: [d routed, d gate, d partial (if any), one [1, B, T, J, D] per
    entry] (an empty tensor for a gradient not needed; custom operators return no None)."""
    history_inv_rms = torch.stack([inverse_rms_unfused(entry.to(routed.dtype), eps) for entry in entries])
    partial_inv_rms = None if partial is None else inverse_rms_unfused(partial, eps)
    grad_routed, grad_gate, grad_partial, grad_chunks = read_gradients(
        grad_input, routed, gate, weights, partial, partial_inv_rms, history_inv_rms, entries,
        (tuple(key_streams), tuple(value_streams)), needs_routed, needs_gate, separate=True,
    )
    grads = [routed.new_empty(0) if grad_routed is None else grad_routed.contiguous(),  # one empty each: returns
             routed.new_empty(0) if grad_gate is None else grad_gate]  # of a custom operator may not alias
    return grads + ([grad_partial] if partial is not None else []) + grad_chunks


@_traced_read_backward.register_fake
def _(grad_input, routed, gate, weights, partial, entries, key_streams, value_streams, eps, needs_routed, needs_gate):
    grads = [torch.empty_like(routed) if needs_routed else routed.new_empty(0),
             torch.empty_like(gate) if needs_gate else routed.new_empty(0)]
    grads += [torch.empty_like(partial)] if partial is not None else []
    return grads + [entry.new_empty(1, *entry.shape) for entry in entries]


def _setup_traced_read(ctx, inputs, output) -> None:
    routed, gate, partial, entries, key_streams, value_streams, eps = inputs
    ctx.save_for_backward(routed, gate, output[1], partial, *entries)
    ctx.arguments = (key_streams, value_streams, eps)
    ctx.mark_non_differentiable(output[1])


def _traced_read_gradient(ctx, grad_input, _grad_weights):
    routed, gate, weights, partial, *entries = ctx.saved_tensors
    needs_routed, needs_gate, needs_partial = ctx.needs_input_grad[:3]
    grads = _traced_read_backward(grad_input.contiguous(), routed, gate, weights, partial, entries, *ctx.arguments,
                                  needs_routed, needs_gate)
    grad_routed, grad_gate = (grads[0] if needs_routed else None), (grads[1] if needs_gate else None)
    grad_partial = grads[2] if partial is not None and needs_partial else None
    grad_entries = [grad[0] for grad in (grads[3:] if partial is not None else grads[2:])]
    return grad_routed, grad_gate, grad_partial, grad_entries, None, None, None


traced_two_phase_read.register_autograd(_traced_read_gradient, setup_context=_setup_traced_read)


# `dar_compiled_read = "operator"` with `dar_training_kernel = "cpp"`: the traced training read and two-stream write
# as the C++ kernels (`cpu_kernels.py`: `read_sources`, `read_sources_backward`, `write_*`) on CPU in float32 /
# float64, one pass over each token's sources each way, the sources' key statistics computed in the read's pass;
# elsewhere (or where the kernels cannot be built) the same outputs from PyTorch operations. The read takes the folded
# query [J, D] and the sources as one list (the committed entries, then the partial if read), since the kernels treat
# the partial as one more source.


@torch.library.custom_op(f"{_OPERATORS}::source_read", mutates_args=())
def traced_source_read(
    query: torch.Tensor, gate: torch.Tensor, sources: list[torch.Tensor], key_streams: list[int],
    value_streams: list[int], eps: float,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """One read of `sources` (each [B, T, J, D]) -> (u [B, T, D], depth weights, key dots, the sources' inverse RMS
    [N, B, T, J]), in the query's dtype; autograd keeps the sources (alive anyway) and the three statistics."""
    sources = [source.to(query.dtype).contiguous() for source in sources]
    kernels = training_cpu_kernels(query)
    if kernels is not None:
        return tuple(kernels.read_sources(query.contiguous(), gate.contiguous(), sources, key_streams, value_streams,
                                          eps))
    history = torch.stack(sources)  # [N, B, T, J, D]
    history_inv_rms = inverse_rms_unfused(history, eps)
    routed = routed_queries(query, tuple(key_streams))
    branch_input, weights, key_dots = _depth_read_forward(
        routed, gate, history, history_inv_rms, tuple(key_streams), tuple(value_streams)
    )
    return branch_input.contiguous(), weights.contiguous(), key_dots.contiguous(), history_inv_rms


@traced_source_read.register_fake
def _(query, gate, sources, key_streams, value_streams, eps):
    batch, tokens, streams, hidden = sources[0].shape
    statistics = query.new_empty(len(sources), batch, tokens, streams)
    return query.new_empty(batch, tokens, hidden), statistics, torch.empty_like(statistics), torch.empty_like(statistics)


@torch.library.custom_op(f"{_OPERATORS}::source_read_backward", mutates_args=())
def _traced_source_read_backward(
    grad_input: torch.Tensor, query: torch.Tensor, gate: torch.Tensor, sources: list[torch.Tensor],
    weights: torch.Tensor, key_dots: torch.Tensor, inv_rms: torch.Tensor, key_streams: list[int],
    value_streams: list[int],
) -> list[torch.Tensor]:
    """The gradient of `traced_source_read`: [d query [J, D], d gate [J], one d source [B, T, J, D] per source], in
    the query's dtype."""
    dtype = query.dtype
    sources = [source.to(dtype).contiguous() for source in sources]
    grad_input = grad_input.to(dtype).contiguous()
    kernels = training_cpu_kernels(query)
    if kernels is not None:
        return kernels.read_sources_backward(grad_input, query.contiguous(), gate.contiguous(), sources, inv_rms,
                                             weights, key_dots, key_streams, value_streams)
    routing = (tuple(key_streams), tuple(value_streams))
    grad_routed, grad_gate, _, grad_chunks = read_gradients(
        grad_input, routed_queries(query, routing[0]), gate, weights, None, None, inv_rms, sources, routing,
        separate=True,
    )
    grad_query = unrouted_queries(grad_routed, stream_selector(routing[0], query)).contiguous()
    return [grad_query, grad_gate, *(grad[0] for grad in grad_chunks)]


@_traced_source_read_backward.register_fake
def _(grad_input, query, gate, sources, weights, key_dots, inv_rms, key_streams, value_streams):
    return [torch.empty_like(query), torch.empty_like(gate), *(query.new_empty(source.shape) for source in sources)]


def _setup_source_read(ctx, inputs, output) -> None:
    query, gate, sources, key_streams, value_streams, _eps = inputs
    _branch_input, weights, key_dots, inv_rms = output
    ctx.save_for_backward(query, gate, weights, key_dots, inv_rms, *sources)
    ctx.arguments = (key_streams, value_streams)
    ctx.mark_non_differentiable(weights, key_dots, inv_rms)


def _source_read_gradient(ctx, grad_input, _grad_weights, _grad_key_dots, _grad_inv_rms):
    query, gate, weights, key_dots, inv_rms, *sources = ctx.saved_tensors
    grad_query, grad_gate, *grad_sources = _traced_source_read_backward(
        grad_input, query, gate, sources, weights, key_dots, inv_rms, *ctx.arguments
    )
    grad_sources = [grad.to(source.dtype) for grad, source in zip(grad_sources, sources)]
    return grad_query, grad_gate, grad_sources, None, None, None


traced_source_read.register_autograd(_source_read_gradient, setup_context=_setup_source_read)


@torch.library.custom_op(f"{_OPERATORS}::source_write", mutates_args=())
def traced_source_write(
    partial: Optional[torch.Tensor], rho: Optional[torch.Tensor], beta: torch.Tensor, branch_output: torch.Tensor,
) -> torch.Tensor:
    """A two-stream write (6) traced for training with the kernel reads: `write_first` (partial None) or
    `write_partial` on CPU, `cast_gated_write` elsewhere -> P' [B, T, 2, D] in beta's dtype; autograd keeps P, the
    gates and y in the model dtype, as `_TransportWrite` does."""
    kernels = training_cpu_kernels(beta)
    if kernels is None:
        return cast_gated_write(partial, rho, beta, branch_output)
    if partial is None:
        return kernels.write_first(beta.contiguous(), branch_output.contiguous())
    return kernels.write_partial(partial.contiguous(), rho, beta.contiguous(), branch_output.contiguous())


@traced_source_write.register_fake
def _(partial, rho, beta, branch_output):
    return beta.new_empty(*branch_output.shape[:-1], *beta.shape)


@torch.library.custom_op(f"{_OPERATORS}::source_write_backward", mutates_args=())
def _traced_source_write_backward(
    grad: torch.Tensor, partial: Optional[torch.Tensor], rho: Optional[torch.Tensor], beta: torch.Tensor,
    branch_output: torch.Tensor,
) -> list[torch.Tensor]:
    """The gradient of `traced_source_write`: [d P, d rho (empty tensors without a partial), d beta, d y]."""
    kernels = training_cpu_kernels(beta)
    if kernels is not None:
        grads = kernels.write_backward(grad.to(beta.dtype).contiguous(),
                                       None if partial is None else partial.contiguous(), rho, beta.contiguous(),
                                       branch_output.contiguous())
    else:
        grads = transport_write_gradients(grad.to(beta.dtype), partial, rho, beta, branch_output)
    if partial is None:
        grads = [beta.new_empty(0), beta.new_empty(0), *grads[2:]]
    return list(grads)


@_traced_source_write_backward.register_fake
def _(grad, partial, rho, beta, branch_output):
    if partial is None:
        grads = [beta.new_empty(0), beta.new_empty(0)]
    else:
        grads = [torch.empty_like(partial), torch.empty_like(rho)]
    return grads + [torch.empty_like(beta), torch.empty_like(branch_output)]


def _setup_source_write(ctx, inputs, output) -> None:
    ctx.save_for_backward(*inputs)


def _source_write_gradient(ctx, grad):
    partial, rho, beta, branch_output = ctx.saved_tensors
    grad_partial, grad_rho, grad_beta, grad_output = _traced_source_write_backward(grad, partial, rho, beta,
                                                                                   branch_output)
    if partial is None:
        grad_partial = grad_rho = None
    return grad_partial, grad_rho, grad_beta, grad_output


traced_source_write.register_autograd(_source_write_gradient, setup_context=_setup_source_write)


@contextmanager
def _onloaded(module: torch.nn.Module) -> Iterator[None]:
    """The weights of `module` and its submodules, loaded if accelerate offloaded them (`device_map` with "disk" or
    CPU offload): accelerate's hooks load a module's weights only around its own forward, so reading them outside
    it runs the same hooks around the read."""
    hooked = [
        submodule for submodule in module.modules()
        if "_hf_hook" in submodule.__dict__
        and any(getattr(hook, "offload", False) for hook in getattr(submodule._hf_hook, "hooks", [submodule._hf_hook]))
    ]
    for submodule in hooked:
        submodule._hf_hook.pre_forward(submodule)
    try:
        yield
    finally:
        for submodule in hooked:
            submodule._hf_hook.post_forward(submodule, None)


class _OptimizerSteps:
    """Counts every optimiser step in the process (a global post-step hook, registered once): part of every memo
    stamp, because fused optimisers (`AdamW(fused=True)`, the Trainer's default on GPU) update parameters in place
    without bumping their version counters, in eager and compiled training alike."""

    count = 0

    @classmethod
    def hook(cls, optimizer, args, kwargs) -> None:
        cls.count += 1


register_optimizer_step_post_hook(_OptimizerSteps.hook)


class _Registrations:
    """Counts every submodule, parameter and buffer registered in the process (global registration hooks, registered
    once): part of every memo stamp, so that a submodule assigned after a memo was filled (module surgery, a
    parametrization's `parametrizations` container, a parameter object replaced, a parameter frozen as a buffer)
    makes each memoising module list its submodules again (`_memo_stamp`). Models are built before they run, so
    forwards see the count change rarely."""

    count = 0

    @classmethod
    def hook(cls, module, name, value) -> None:
        if not torch.compiler.is_compiling():  # `torch.export` registers its root inside the trace: no side effect
            cls.count += 1


register_module_module_registration_hook(_Registrations.hook)
register_module_parameter_registration_hook(_Registrations.hook)
register_module_buffer_registration_hook(_Registrations.hook)


def module_registrations() -> int:
    """How many submodules and parameters the process has registered so far (`_Registrations`)."""
    return _Registrations.count


def _derived(module: torch.nn.Module, name: str, like: torch.Tensor, compute: Callable[[], torch.Tensor]):
    """A small tensor the two-phase backend derives from a module's own parameters outside its forward (gates, folded
    queries), in the dtype and on the device of `like`: computed with the module's weights onloaded (`_onloaded`),
    and memoised for inference.

    Decoding runs every branch once per token on tiny tensors, where recomputing sigmoids and stacks costs more than
    the depth mixing itself. With gradients off, a derived tensor is memoised under a key of the parameters'
    version counters and storages (an in-place update, a load or a move invalidates it), the number of optimiser
    steps taken in the process (`_OptimizerSteps`: fused optimisers bump no version counter) and `like`'s dtype and
    device (so the parameter-free one-stream read gate follows the model too), and a memo hit reads no weight at
    all. With gradients on it is always recomputed, so training is untouched, and the module's memo is dropped.
    A write no version counter sees (`p.data.mul_(2)`, an EMA update through `.data`) is caught by comparing the
    parameters' values with a copy taken with the memo (`_Contents`).
    """
    if torch.compiler.is_compiling():  # a compiled graph reads the parameters; no Python memo in it
        return compute()
    stamp = _memo_stamp((module,), like) if not torch.is_grad_enabled() else None
    contents = None
    if stamp is not None:
        memo = module.__dict__.setdefault("_dar_fast_memo", {})
        cached = memo.get(name)
        if cached is not None and cached[0] == stamp and cached[3].unchanged():
            return cached[1]
        contents = _Contents.of(_stamped_parameters((module,)))
    if contents is None:  # gradients on, or parameters no stamp or copy can vouch for
        module.__dict__.pop("_dar_fast_memo", None)
    with _onloaded(module):
        value = compute()
    if contents is not None:
        memo[name] = (stamp, value, _pinned(module), contents)
    return value


# Where a derivation reads the parameters of the module it derives from (a branch residual, the readout, or one of
# their depth attentions and gates), by attribute, as the derivation itself looks them up.
DERIVED_FROM = tuple(tuple(path.split(".")) for path in (
    "pseudo_query", "key_norm.weight", "logit", "transport_logit", "depth_attention.pseudo_query",
    "depth_attention.key_norm.weight", "read_gate.logit", "write_gate.logit", "write_gate.transport_logit",
))


def _attribute_path(module, path: tuple[str, ...]):
    for name in path:
        module = getattr(module, name, None)
        if module is None:
            return None
    return module


def _derivation_parameters(module: torch.nn.Module) -> list:
    """The parameters a derivation from `module` reads (`DERIVED_FROM`), looked up through its attributes at every
    call, as the derivation looks them up: through a wrapper, the copy it forwards to now (PEFT's
    `ModulesToSaveWrapper` after `disable_adapter()` or `set_adapter()`). Which paths exist is remembered per module,
    and found again when one of them no longer resolves."""
    paths = module.__dict__.get("_dar_memo_paths")
    if paths is not None:
        found = [_attribute_path(module, path) for path in paths]
        if all(parameter is not None for parameter in found):
            return found
    found = [(path, _attribute_path(module, path)) for path in DERIVED_FROM]
    module.__dict__["_dar_memo_paths"] = tuple(path for path, parameter in found if parameter is not None)
    return [parameter for _, parameter in found if parameter is not None]


def _plain_submodules(module: torch.nn.Module) -> tuple | None:
    """`module` and its submodules when each is a plain module (attribute lookup as `nn.Module`'s, no
    parametrization) and what a derivation reads are its parameters; None where a wrapper or a parametrization stands
    in between, or a derivation reads a tensor that is no parameter (one frozen as a buffer): then
    `_derivation_parameters` looks them up the way the derivation does, and `_memo_stamp` keeps no memo of a
    non-parameter."""
    submodules = tuple(module.modules())
    for submodule in submodules:
        if type(submodule).__getattr__ is not torch.nn.Module.__getattr__ or is_parametrized(submodule):
            return None
    if not all(isinstance(tensor, torch.nn.Parameter) for tensor in _derivation_parameters(module)):
        return None
    return submodules


def _children(submodules: tuple) -> tuple:
    """The direct children of each listed submodule, in order: what a write into `_modules` (module surgery that runs
    no registration hook) changes."""
    return tuple(child for submodule in submodules for child in submodule._modules.values())


def _memo_stamp(modules, like: torch.Tensor) -> tuple | None:
    """What a memo of tensors derived from `modules`' parameters is valid for (`_derived`): `like`'s dtype and device,
    the optimiser steps and module registrations in the process, and every parameter's version counter and storage.

    Each module's submodules are listed once per registration count (walking `parameters()` at every lookup costs
    more than a decode step's mixing), and again where their children changed without a registration (a direct
    `_modules` write); their parameters are read at every lookup. A module behind a wrapper or a
    parametrization is stamped by the parameters its derivation reaches through attributes
    (`_derivation_parameters`), by identity too, and its memo entry pins them (`_pinned`) so that no identity is
    reused while the entry lives. None where no stamp can vouch for a memo: a parameter computed at each lookup (a
    parametrization: a fresh tensor's storage and version may repeat a freed one's), or an inference tensor
    (`torch.inference_mode`), which counts no versions. Those modules are derived at every forward."""
    stamp = [like.dtype, like.device, _OptimizerSteps.count, _Registrations.count]
    try:
        for module in modules:
            listed = module.__dict__.get("_dar_memo_modules")
            if listed is None or listed[0] != _Registrations.count or (
                listed[1] is not None and _children(listed[1]) != listed[2]  # a `_modules[name] = ...` write
            ):
                submodules = _plain_submodules(module)
                listed = module.__dict__["_dar_memo_modules"] = (
                    _Registrations.count, submodules, None if submodules is None else _children(submodules)
                )
            if listed[1] is not None:
                stamp += [(p._version, p.data_ptr()) for sub in listed[1] for p in sub._parameters.values()
                          if p is not None]
                continue
            for parameter in _derivation_parameters(module):
                if not isinstance(parameter, torch.nn.Parameter):
                    return None
                stamp += (id(parameter), parameter._version, parameter.data_ptr())
    except RuntimeError:  # "Inference tensors do not track version counter"
        return None
    return tuple(stamp)


def _stamped_parameters(modules) -> list:
    """The parameters `_memo_stamp` stamped for `modules` (call after it, which lists them)."""
    parameters = []
    for module in modules:
        submodules = module.__dict__["_dar_memo_modules"][1]
        parameters += ([p for sub in submodules for p in sub._parameters.values() if p is not None]
                       if submodules is not None else _derivation_parameters(module))
    return parameters


class _Contents:
    """A copy of the values of the parameters a memo was derived from, compared at every lookup: a write that bumps
    no version counter (`p.data.add_(...)`, an EMA or a hand-written SGD step through `.data`, a write through another
    tensor on the same storage) leaves the memo stamp as it was, and the memo served the old values (logits 3e-2
    off the reference after one such step). One concatenation into a buffer and one comparison per device: 0.17 ms per
    forward at the SmolLM2 shape (700 KB of DAR parameters), 10 MB of copies at the 8B shape."""

    def __init__(self, groups: list[tuple[list[torch.Tensor], torch.Tensor, torch.Tensor]]):
        self.groups = groups  # per device: (flat views of the parameters, their values then, a buffer)

    @classmethod
    def of(cls, parameters) -> "_Contents | None":
        """None where a parameter is not contiguous (no flat view of it to compare through)."""
        by_device: dict[torch.device, list[torch.Tensor]] = {}
        for parameter in parameters:
            if parameter.is_meta:  # no values to change; its onloaded copy is another tensor at each forward
                continue
            if not parameter.is_contiguous():
                return None
            by_device.setdefault(parameter.device, []).append(parameter.detach().view(-1))
        groups = []
        with torch.inference_mode(False):  # filled in inference mode, they are still written in a no-grad forward
            for views in by_device.values():
                values = torch.cat(views)
                groups.append((views, values, torch.empty_like(values)))
        return cls(groups)

    def unchanged(self) -> bool:
        return all(torch.equal(torch.cat(views, out=buffer), values) for views, values, buffer in self.groups)


def _pinned(*modules) -> tuple:
    """The parameters reached by attribute from `modules` (`_derivation_parameters`), kept alive with a memo entry
    whose stamp names them by identity (`_memo_stamp`)."""
    return tuple(parameter for module in modules if module.__dict__["_dar_memo_modules"][1] is None
                 for parameter in _derivation_parameters(module))


def _model_memo(residuals, like: torch.Tensor) -> dict:
    """A memo of derived tensors for all of a model's branch residuals at once, kept on the first of them under one
    stamp of all their parameters (`_memo_stamp`): a no-grad eager forward then checks one stamp instead of one per
    residual (0.8 of the 3.7 ms that DAR's depth path adds to a SmolLM2-shape decoding step, measured with the
    branches stubbed out). Valid as `_derived`'s memo is; call with gradients off and not compiling."""
    owner = residuals[0].__dict__
    stamp = _memo_stamp(residuals, like)
    memo = owner.get("_dar_model_memo")
    if stamp is not None and memo is not None and memo[0] == stamp and memo[3].unchanged():
        return memo[1]
    contents = None if stamp is None else _Contents.of(_stamped_parameters(residuals))
    if contents is None:  # parameters no stamp or copy can vouch for: a memo for this forward only
        owner.pop("_dar_model_memo", None)
        return {}
    memo = owner["_dar_model_memo"] = (stamp, {}, _pinned(*residuals), contents)
    return memo[1]


class _BlockPartials:
    """The partial states P_1 .. P_{K-1} of one block, rebuilt for backward from what autograd keeps anyway (the
    branch outputs y in the model dtype and the gates) instead of being kept in float32 (DESIGN.md section 7).

    `add` records one write (beta, rho, y); `rebuild(k)` replays the block's writes 0 .. k without autograd (the
    same ops in the same order, so the same values bit for bit) and keeps them until every kept reference to the
    block's partials has been unpacked once, so one backward replays the block once. `dtype`: that of a committed
    entry rebuilt this way (a block of one write, `_LeanPartials.record_entry`), None for partials. `write`: the
    forward's own write, (P or None, rho, beta, y) -> P' (the fast path's `cast_gated_write` or its C++ kernels: each
    rounds in its own order); None for the two-phase backend's `gated_write`.
    """

    def __init__(self, dtype: torch.dtype | None = None, write: Callable | None = None):
        self.writes: list[tuple] = []
        self.rebuilt: list[torch.Tensor] | None = None
        self.pending = 0
        self.dtype = dtype
        self.write = write

    def add(self, beta, rho, branch_output) -> int:
        self.writes.append((beta.detach(), None if rho is None else rho.detach(), branch_output.detach()))
        return len(self.writes) - 1

    def rebuild(self, index: int) -> torch.Tensor:
        if self.rebuilt is None or len(self.rebuilt) <= index:
            with torch.no_grad():
                partial, self.rebuilt = None, []
                write = gated_write if self.write is None else self.write
                for beta, rho, branch_output in self.writes:
                    partial = write(partial, rho, beta, branch_output)
                    self.rebuilt.append(partial if self.dtype is None else partial.to(self.dtype))
        partial = self.rebuilt[index]
        self.pending -= 1
        if self.pending <= 0:
            self.rebuilt = None
        return partial


class _LeanPartials:
    """Saved-tensor hooks of one training forward (eager): a kept reference to a partial state that is not committed
    becomes a (block, index) handle, unpacked by replaying the block's writes (`_BlockPartials`); so does a committed
    entry written by one branch alone (`record_entry`: Full DAR's every entry, beta * y). Everything else is
    kept as autograd keeps it, through the hooks that were active around the forward (`save_on_cpu`, a memory
    measurement), which are chained rather than replaced. Gradient checkpointing's own hooks take precedence inside a
    checkpointed layer."""

    def __init__(self):
        self.block: _BlockPartials | None = None
        self.partials: dict[int, tuple] = {}  # id(P) -> (weak reference to P, block, index)
        # The enclosing saved-tensor hooks (torch keeps only the innermost active): everything else goes through them.
        outer = torch._C._autograd._top_saved_tensors_default_hooks(False)
        self.outer_pack, self.outer_unpack = outer if outer is not None else (None, None)

    def record(self, partial, beta, rho, branch_output, opens_block: bool, write: Callable | None = None) -> None:
        """One write of a partial that is not committed: call for every one, those without gradients too (a block is
        replayed from its first write; where the embedding and a block's first branches were frozen, as under LoRA on
        the MLPs only, their writes went unrecorded and a later write was replayed from no partial: gradients 4e-2 to
        0.8 off). Keeping a frozen branch's y costs a fraction of keeping the block's float32 partials."""
        if opens_block or self.block is None:
            self.block = _BlockPartials(write=write)
        index = self.block.add(beta, rho, branch_output)
        self.partials[id(partial)] = (weakref.ref(partial), self.block, index)

    def record_entry(self, entry, beta, branch_output) -> None:
        """A committed entry that one write made alone (a block of one branch): (beta * y) in the history's dtype,
        rebuilt from the y autograd keeps anyway. Every later read keeps a reference to it, so the rebuild is done
        at the first unpack in backward and dropped after the last (`_BlockPartials.pending`)."""
        block = _BlockPartials(entry.dtype)
        self.partials[id(entry)] = (weakref.ref(entry), block, block.add(beta, None, branch_output))

    def pack(self, tensor):
        found = self.partials.get(id(tensor))
        if found is None or found[0]() is not tensor:
            return ("kept", tensor if self.outer_pack is None else self.outer_pack(tensor))
        _, block, index = found
        block.pending += 1
        return ("rebuilt", (block, index))

    def unpack(self, packed):
        how, value = packed
        if how == "rebuilt":
            block, index = value
            return block.rebuild(index)
        return value if self.outer_unpack is None else self.outer_unpack(value)


def reads_planned_together(residuals) -> list:
    """The leading residuals whose reads see the same committed entries: up to and including the first that commits."""
    planned = [residuals[0]]
    for previous, residual in zip(residuals, residuals[1:]):
        if previous.commits:
            break
        planned.append(residual)
    return planned


def reads_ahead(residuals: tuple, first, block_size: int, limit: int) -> list:
    """The reads from `first` to the end of its block, at most `limit` (they see the same committed entries), when
    `residuals` are the model's branch residuals in order and their parameters are here: plain tensors, not on the
    meta device of a layer-streamed or offloaded model nor shards of FSDP2 (a DTensor outside its layer's forward);
    else none."""
    index = getattr(first, "branch_index", None)
    if index is None or index >= len(residuals) or residuals[index] is not first:
        return []
    block_end = min((index // block_size + 1) * block_size, len(residuals))
    group = list(residuals[index : min(block_end, index + limit)])
    return group if parameters_here(group) else []


def parameters_here(residuals) -> bool:
    """Whether the parameters of `residuals` can be read outside their own layers' forwards: plain tensors, not on
    the meta device (a layer-streamed or offloaded model) nor shards of FSDP2 (a DTensor outside its layer's
    forward)."""
    return not any(
        residual.depth_attention.pseudo_query.is_meta or isinstance(residual.depth_attention.pseudo_query, DTensor)
        for residual in residuals
    )


def _without_autocast(device_type: str):
    """The precision policy also under autocast: autocast off around depth mixing (a no-op context when it is off)."""
    return torch.autocast(device_type, enabled=False) if torch.is_autocast_enabled(device_type) else nullcontext()


def read_source_counts(residuals, block_size: int) -> list[int]:
    """How many sources each of the model's branch residuals (in order) reads: B_0, the blocks finished before its
    own, and the partial where it reads one (what its read gate's count scaling is for)."""
    return [1 + index // block_size + int(residual.reads_partial) for index, residual in enumerate(residuals)]


class StackedDerivations(NamedTuple):
    """`stacked_derivations` of R residuals: folded queries w * gamma [R, J, D], read gates with their read and count
    scaling [R, J] (or [R, 1]), the two-stream write gates beta [R_w, J, D] and rho [R_t, 1] (None where none has one),
    and per residual whether it has a beta (`writes`) and a rho (`transports`), in the order of the rows."""

    query: torch.Tensor
    gate: torch.Tensor
    beta: torch.Tensor | None
    rho: torch.Tensor | None
    writes: list[bool]
    transports: list[bool]


def stacked_derivations(residuals, num_sources: list[int], like: torch.Tensor) -> StackedDerivations:
    """What the reads and writes of `residuals` derive from their parameters (each read of its `num_sources`
    sources), from the parameters stacked, in `like`'s dtype and on its device: a few operations for the whole model
    where the per-residual derivations (`_derived`) take a few each. The readout has no write gate."""
    like = dict(dtype=like.dtype, device=like.device)
    attentions = [residual.depth_attention for residual in residuals]
    query = attentions[0].fold_key_norm(
        torch.stack([a.pseudo_query for a in attentions]), torch.stack([a.key_norm.weight for a in attentions])
    ).to(**like)  # [R, J, D]
    read_gates = [residual.read_gate for residual in residuals]
    scales = torch.tensor(  # [R, 1]: read and count scaling
        [[g.read_scale * a.count_scale(n)] for g, a, n in zip(read_gates, attentions, num_sources)], **like
    )
    if hasattr(read_gates[0], "logit"):
        gate = read_gates[0].stream_weights_of(torch.stack([g.logit for g in read_gates])).to(**like) * scales
    else:  # one stream
        gate = scales  # [R, 1]
    write_gates = [getattr(residual, "write_gate", None) for residual in residuals]
    writes = [g is not None and g.num_streams == 2 for g in write_gates]
    transports = [w and hasattr(g, "transport_logit") for g, w in zip(write_gates, writes)]
    two_streams = [g for g, w in zip(write_gates, writes) if w]
    transported = [g for g, t in zip(write_gates, transports) if t]
    beta = two_streams[0].beta_of(torch.stack([g.logit for g in two_streams]), two_streams[0].write_scale).to(
        **like) if two_streams else None
    rho = (transported[0].rho_of(torch.stack([g.transport_logit for g in transported])).to(**like) if transported
           else None)
    return StackedDerivations(query, gate, beta, rho, writes, transports)


@torch.library.custom_op(f"{_OPERATORS}::rows", mutates_args=())
def traced_rows(stacked: torch.Tensor) -> list[torch.Tensor]:
    """The rows of `stacked` as tensors of their own (not views at an offset, which inductor writes into the code
    of every kernel that reads one, so that the same operations on different rows compile to different kernels)."""
    return [row.clone() for row in stacked.unbind(0)]


@traced_rows.register_fake
def _(stacked):
    return [stacked.new_empty(stacked.shape[1:]) for _ in range(stacked.shape[0])]


@torch.library.custom_op(f"{_OPERATORS}::stacked_rows", mutates_args=())
def _stacked_rows(rows: list[torch.Tensor]) -> torch.Tensor:
    return torch.stack(rows)


@_stacked_rows.register_fake
def _(rows):
    return rows[0].new_empty(len(rows), *rows[0].shape)


def _rows_gradient(ctx, grads):
    return _stacked_rows([torch.zeros(ctx.row_shape, dtype=ctx.dtype, device=ctx.device) if grad is None else grad
                          for grad in grads])


def _setup_rows(ctx, inputs, output) -> None:
    ctx.row_shape, ctx.dtype, ctx.device = inputs[0].shape[1:], inputs[0].dtype, inputs[0].device


traced_rows.register_autograd(_rows_gradient, setup_context=_setup_rows)


class _TracedConstants(NamedTuple):
    """A residual's derived tensors in a traced training forward (`TwoPhaseDepthBackend._derive_traced`): the
    source count its read gate is scaled for, the routed query [J * D, J], the folded query [J, D], the read gate [J]
    and the write gates beta [J, D] and rho (1,) (None where the residual has none)."""

    sources: int
    routed: torch.Tensor
    query: torch.Tensor
    gate: torch.Tensor
    beta: torch.Tensor | None
    rho: torch.Tensor | None


class TwoPhaseDepthBackend:
    """Two-phase depth reads (DESIGN.md section 7); stateless apart from the model's configuration."""

    def __init__(self, config):
        self.eps = depth_key_norm_eps(config)
        self.compiled_read = config.dar_compiled_read
        self.training_kernel = config.dar_training_kernel
        self.lean: _LeanPartials | None = None
        self.block_size = config.dar_block_size
        self.residuals: tuple = ()  # the model's branch residuals in order (`start`), for a traced block's scores
        self.scored: dict = {}  # traced training: the scores of reads ahead in the open block, by residual
        self.layers_traced = False  # the decoder layers compiled on their own (`depth_backend`'s `traced`)
        self.traced_start = False  # the forward started traced, reading inline (`start`): see `_statistics`
        self.under_autocast = False  # the forward runs under autocast (`start`): traced reads take `neutral` products
        self.derived: dict = {}  # traced training: every residual's gates and queries, by residual (`_derive_traced`)

    def _traced_inlined(self) -> bool:
        """A forward traced for training whose reads are plain code (`_recomputed_read`), not custom operators."""
        return _traced_training() and self.compiled_read != "operator"

    def _traced_kernels(self) -> bool:
        """A forward traced for training whose reads and two-stream writes are the source operators (which run the
        C++ kernels on CPU): `dar_compiled_read="operator"` with `dar_training_kernel="cpp"`."""
        return _traced_training() and self.compiled_read == "operator" and self.training_kernel == "cpp"

    def keeping_partials_lean(self):
        """Context of a training forward: autograd keeps no float32 partial state (only the committed entries, and
        not those of blocks of one write, which are beta * y); each block's partials are rebuilt in backward from the
        branch outputs it keeps anyway. Eager only: a compiled graph plans its own saved tensors (so do decoder layers
        compiled on their own, `layers_traced`)."""
        if torch.compiler.is_compiling() or not torch.is_grad_enabled() or self.layers_traced:
            return nullcontext()
        self.lean = _LeanPartials()
        return torch.autograd.graph.saved_tensors_hooks(self.lean.pack, self.lean.unpack)

    def start(self, entry: torch.Tensor, keep_weights: bool = True, residuals=()) -> DepthState:
        self.residuals = tuple(residuals)
        # Outside DAR's autocast-off regions, where autocast still shows: a traced training forward under autocast
        # takes products that autocast leaves alone (`wide_product`'s `neutral`), forward and backward.
        self.under_autocast = torch.is_autocast_enabled(entry.device.type)
        self.traced_start = self._traced_inlined()
        with self._statistics():  # in the compute dtype, whatever the history's dtype
            entry_inv_rms = inverse_rms(entry.to(dar_compute_dtype(entry.dtype)), self.eps).unsqueeze(0)  # [1, B, T, J]
        if self.residuals and _traced_training() and not torch.compiler.is_exporting() and parameters_here(
            self.residuals
        ):  # (`torch.export` keeps the per-residual derivations: no custom operator in an exported program)
            self.derived = self._derive_traced(self.residuals, entry_inv_rms)
        return DepthState(self, None, (entry,), entry_inv_rms)

    def _derive_traced(self, residuals, like: torch.Tensor) -> dict:
        """A training forward traced by `torch.compile` derives every residual's folded query, read gate (with its
        read and count scaling) and write gates from their parameters stacked (`stacked_derivations`), and hands each
        residual its rows as tensors of their own (`traced_rows`). Derived per residual (or read at an offset of the
        stacks), each residual's derivation and its gradient lands in kernels that inductor fuses with the residual's
        neighbours differently: dozens of distinct kernels, each a C++ compile in the first compiled step (90 against
        47 at the SmolLM2 shape; docs/overhead-log.md). Same operations, so the same values and gradients. A read
        checks the source count its gate was scaled for (`_TracedConstants.sources`); another count derives its own."""
        sources = read_source_counts(residuals, self.block_size)
        with torch.autocast(like.device.type, enabled=False):
            derived = stacked_derivations(residuals, sources, like)
            routed = routed_queries(derived.query, residuals[0].depth_attention.key_streams)  # [R, J * D, J]
            routed, gate = traced_rows(routed), traced_rows(derived.gate)  # [J * D, J] and [J] each
            query = traced_rows(derived.query) if self._traced_kernels() else [None] * len(residuals)
            betas = iter(() if derived.beta is None else traced_rows(derived.beta))
            rhos = iter(() if derived.rho is None else traced_rows(derived.rho))
        return {
            residual: _TracedConstants(
                sources[index], routed[index], query[index], gate[index],
                next(betas) if writes else None, next(rhos) if transports else None,
            )
            for index, (residual, writes, transports) in enumerate(zip(residuals, derived.writes, derived.transports))
        }

    def _statistics(self):
        """Where an entry's inverse RMS is computed at its commit: without autograd eagerly (`_TwoPhaseRead` derives
        its gradient), differentiably in a traced training forward, whose reads take the key-norm gradient through
        it (computed once per entry instead of once per read); so is B_0's, computed eagerly, when the decoder layers
        are compiled on their own (their reads are traced). A forward that started traced keeps computing them
        differentiably where its code runs eagerly (`traced_start`): dynamo runs a checkpointed decoder layer that
        has a graph break inside (a branch's module, a hook, a print) eagerly around the frames it compiles, so
        traced reads (the final readout) read entries committed by eager code, which without autograd in their
        statistics lost the key-norm term of their gradient (0.08 off at the embedding; the eager reads' own
        backward gives the statistics no gradient, so none is counted twice)."""
        traced_reads = self._traced_inlined() or (
            (self.layers_traced or self.traced_start) and self.compiled_read != "operator" and torch.is_grad_enabled()
        )
        return nullcontext() if traced_reads else torch.no_grad()

    def _with_statistics(self, state: DepthState) -> DepthState:
        """The state with the inverse RMS of every committed entry: an eager read (the final readout of a model whose
        decoder layers are compiled on their own) of entries that traced operator reads committed, which compute
        their own statistics and leave the state's as they were."""
        like, known = state.history_inv_rms, state.history_inv_rms.shape[0]
        with torch.no_grad(), torch.autocast(like.device.type, enabled=False):
            missing = [inverse_rms(entry.to(like.dtype), self.eps) for entry in state.history[known:]]
        return DepthState(self, state.partial, state.history, torch.cat([like, torch.stack(missing)]))

    def _routed(self, residual, like: torch.Tensor) -> torch.Tensor:
        derived = self.derived.get(residual)
        if derived is not None:
            return derived.routed
        attention = residual.depth_attention
        return _derived(
            attention, "routed_query", like,
            lambda: routed_queries(attention.scoring_query().to(like), attention.key_streams),
        )  # [J * D, J]

    def plan(self, state: DepthState, *residuals) -> tuple[PhaseOne | None, ...]:
        """Phase 1 of the leading residuals whose reads see the state's committed entries (up to and including the
        first that commits); None for the rest, which plan their own read."""
        if self._traced_inlined():
            return self._traced_plan(state, residuals)
        if _traced_training():
            return (None,) * len(residuals)  # the operators: each read computes its phase 1 in its own call
        planned = reads_planned_together(residuals)
        like = state.history_inv_rms
        with torch.autocast(like.device.type, enabled=False):  # outside no_grad: the memo is for inference only
            routed = torch.cat([self._routed(residual, like) for residual in planned], dim=1)  # [J * D, R * J]
        with torch.no_grad(), torch.autocast(like.device.type, enabled=False):
            routed = routed.detach()
            attention = planned[0].depth_attention
            phases = phase_one(
                routed, torch.stack(state.history).to(like.dtype), like, attention.key_streams, attention.value_streams
            )
        return (*phases, *(None for _ in residuals[len(planned):]))

    def _traced_plan(self, state: DepthState, residuals) -> tuple[PhaseOne | None, ...]:
        """Traced training: phase 1's scores (softmax weights and L, no value sums) of the reads from `residuals[0]`
        to the end of its block in one differentiable pass over the entries (`depth_scores_by_entry`); each read
        forms its value sum in its own checkpoint (`_recomputed_read`). What autograd keeps of a block's scores is
        per-token ([S, B, T, R, J] float32, a few of them), where keeping the block's value sums would cost D times
        that."""
        first = residuals[0]
        if first in self.scored:
            return tuple(self.scored.pop(residual, None) for residual in residuals)
        group = reads_ahead(self.residuals, first, self.block_size, len(self.residuals))
        group = group or reads_planned_together(residuals)
        like = state.history_inv_rms
        with torch.autocast(like.device.type, enabled=False):
            routed = torch.cat([self._routed(residual, like) for residual in group], dim=1)  # [J * D, R * J]
            weights, log_sum_exp = depth_scores_by_entry(
                routed, state.history, like, group[0].depth_attention.key_streams, self.under_autocast
            )
        scored = {
            residual: PhaseOne(weights[:, :, :, read], log_sum_exp[:, :, read], None)
            for read, residual in enumerate(group)
        }
        planned = tuple(scored.pop(residual, None) for residual in residuals)
        # Reads of later layers, kept for them: only where the model gave its residuals, i.e. no layer is
        # checkpointed (work of a checkpointed layer must not leave it: dynamo loses gradients through the dict).
        if scored:
            self.scored.update(scored)
        return planned

    def read(self, residual, state: DepthState, read_partial: bool, planned: PhaseOne | None = None, dtype=None):
        attention, read_gate = residual.depth_attention, residual.read_gate
        traced = _traced_training()
        if not traced and state.history_inv_rms.shape[0] < len(state.history):
            state = self._with_statistics(state)
        like, num_sources = state.history_inv_rms, len(state.history) + int(read_partial)
        if planned is None and (not traced or self._traced_inlined()):
            planned = self.plan(state, residual)[0]
        with torch.autocast(like.device.type, enabled=False):  # the precision policy, also under autocast
            derived = self.derived.get(residual)
            if derived is not None and derived.sources == num_sources:
                gate = derived.gate
            else:
                scale = read_gate.read_scale * attention.count_scale(num_sources)
                gate = _derived(
                    read_gate, f"gate_{num_sources}", like, lambda: read_gate.stream_weights().to(like) * scale
                )  # [J]: (alpha, 1 - alpha) times read and count scaling
            if self._traced_kernels():
                sources = [*state.history, *([state.partial] if read_partial else [])]
                query = attention.scoring_query().to(like) if derived is None else derived.query
                branch_input, weights, _, _ = traced_source_read(
                    query, gate, sources, list(attention.key_streams),
                    list(attention.value_streams), self.eps,
                )
                return branch_input, weights
            routed = self._routed(residual, like)
            if traced and self.compiled_read == "operator":
                return traced_two_phase_read(
                    routed, gate, state.partial if read_partial else None, list(state.history),
                    list(attention.key_streams), list(attention.value_streams), self.eps,
                )
            if traced:
                arguments = (planned.weights, planned.log_sum_exp, routed, gate, state.partial if read_partial else None,
                             (attention.key_streams, attention.value_streams), self.eps, self.under_autocast,
                             *state.history)
                if torch.compiler.is_exporting():  # strict `torch.export` (ExecuTorch's recipe) takes no checkpoint
                    return _recomputed_read(*arguments)
                return checkpoint(_recomputed_read, *arguments, use_reentrant=False)
            return two_phase_read(
                routed, gate, state, state.partial if read_partial else None, planned, attention.key_streams,
                attention.value_streams, self.eps,
            )

    def write(self, residual, state: DepthState, branch_output: torch.Tensor, commits: bool) -> DepthState:
        write_gate, like = residual.write_gate, state.history_inv_rms
        derived = self.derived.get(residual)
        with torch.autocast(like.device.type, enabled=False):
            if write_gate.num_streams == 1:  # AttnRes writes y unchanged: beta = 1, no transport
                beta, rho = like.new_ones(1, 1), None
            elif derived is not None and (state.partial is None or derived.rho is not None):
                beta, rho = derived.beta, (None if state.partial is None else derived.rho)
            else:
                beta = _derived(write_gate, "beta", like, lambda: write_gate.beta().to(like))  # [J, D]
                rho = None
                if state.partial is not None:
                    rho = _derived(write_gate, "rho", like, lambda: write_gate.rho().to(like))  # (1,)
            # y stays in the model dtype: autograd keeps it as the branch produced it
            if write_gate.num_streams == 2 and self._traced_kernels():
                partial = traced_source_write(state.partial, rho, beta, branch_output)
            else:
                partial = gated_write(state.partial, rho, beta, branch_output)  # [B, T, J, D], compute dtype
        lean = self.lean is not None and partial.requires_grad
        if self.lean is not None and not commits:
            self.lean.record(partial, beta, rho, branch_output, opens_block=state.partial is None)
        if commits:
            entry = partial.to(state.history[0].dtype)  # stored in the history's dtype (`dar_history_dtype`)
            if lean and state.partial is None:  # a block of one write: the entry is beta * y
                self.lean.record_entry(entry, beta, branch_output)
            if _traced_training() and not self._traced_inlined():  # an operator computes its entries' statistics
                return DepthState(self, None, (*state.history, entry), like)
            with self._statistics():  # of the stored entry, so that every later read sees the same key
                entry_inv_rms = inverse_rms(entry.to(like.dtype), self.eps).unsqueeze(0)  # [1, B, T, J]
            history_inv_rms = torch.cat([state.history_inv_rms, entry_inv_rms])
            return DepthState(self, None, (*state.history, entry), history_inv_rms)
        return DepthState(self, partial, state.history, state.history_inv_rms)


# ---------------------------------------------------------------------------------------------------------------
# Inference: two-phase reads with gradients off, in the fewest operations per branch.


def eager_cpu_kernels(entry: torch.Tensor):
    """The C++ kernels (`cpu_kernels.py`) for a forward whose history starts with `entry`, where it may run them: on
    CPU and eagerly (a graph traced by `torch.compile`, `torch.export` or `torch.jit` computes the same passes in its
    own code), outside forward-mode AD (`torch.autograd.forward_ad.dual_level`: the kernels are called directly, not
    through the dispatcher, and would drop every tangent); else None, and None where they cannot be built (warned
    once)."""
    if (entry.device.type != "cpu" or torch.compiler.is_compiling() or torch.jit.is_tracing()
            or forward_ad._current_level >= 0):
        return None
    return cpu_kernels()


def training_cpu_kernels(like: torch.Tensor):
    """The C++ kernels where the training kernels may run on tensors like `like`: as `eager_cpu_kernels`, and in
    float32 or float64 (they compute in one dtype, the depth state's)."""
    if like.dtype not in (torch.float32, torch.float64):
        return None
    return eager_cpu_kernels(like)


def _store_slot(buffer: torch.Tensor, slot: int, value: torch.Tensor) -> None:
    """buffer[slot] = value, cast to the buffer's dtype. In a forward traced by `torch.compile`, by `index_put_`, which
    inductor lowers to a write of the slot alone: a copy into the slot's view becomes a `select_scatter`, which
    inductor lowers to a pass that reads and writes the whole buffer (the history: S_max entries twice per commit; at
    8B, a 4096-token prefill's nine 134 MB slots, 21.7 GB per forward; docs/overhead-log.md)."""
    if torch.compiler.is_compiling():
        buffer.index_put_((torch.tensor([slot], device=buffer.device),), value.to(buffer.dtype).unsqueeze(0))
    else:
        buffer[slot] = value


# Where a gradient-free forward's depth path moves bytes rather than dispatching operations: from this many elements
# per [B, T, D] operand (2^15: 57 tokens at the SmolLM2 width, 8 at Llama-3-8B's), the eager inference backend takes
# the forms that pass over its operands and allocate fewest times, at a few more calls per read and write
# (`InferenceDepthBackend.bytes_bound`); below it (decoding), the forms with the fewest calls. Measured at the SmolLM2
# shape (docs/overhead-log.md): 64 tokens 6 ms faster per forward with them, 32 tokens 1 ms slower.
BYTES_BOUND_ELEMENTS = 1 << 15


class _InferenceConstants(NamedTuple):
    """What one read and write of a residual needs from its parameters, derived once per parameter version
    (`_derived`): the routed queries scaled by sqrt(D), transposed [J, J * D] (a score is then a dot times
    rsqrt(sum h^2 + D eps), the inverse RMS without a mean; and `wide_product` takes the weight wide), the same
    queries by target stream [J, D] (the C++ kernels' form), the read gate times read and count scaling [J], and the
    write gates beta [J, D] and rho (1,) (None where the branch has none)."""

    routed_t: torch.Tensor
    query: torch.Tensor
    gate: torch.Tensor
    beta: torch.Tensor | None
    rho: torch.Tensor | None


class _PlannedRead(NamedTuple):  # a NamedTuple: decoding builds two per layer, and a frozen dataclass costs more
    """Phase 1 of one read with the read gate applied: gated [B, T, D] = sum_j gate_j Obar^j (the branch input when
    the partial is not read), Obar [B, T, J, D], log-sum-exp L [B, T, J], softmax weights [S, B, T, J]. From the
    C++ kernels, only what the read uses: gated without the partial, Obar and L with it; no weights."""

    gated: torch.Tensor | None
    mean: torch.Tensor | None
    log_sum_exp: torch.Tensor | None
    weights: torch.Tensor | None


class InferenceDepthBackend:
    """Two-phase reads (DESIGN.md section 7) with gradients off: what a forward without autograd runs, eager or
    compiled, when "fast" or "two_phase" is configured (`depth_backend`): `generate`, pipelines, evaluation, vLLM
    (eager and compiled), HF's compiled static-cache decoding, `torch.export`.

    Decoding runs every branch on a few tokens, where a branch costs the operations it dispatches, and prefill on
    many, where it costs the bytes it moves; so:
    - committed entries live in one depth-major buffer allocated per forward (no stack per read), each with the
      per-token key scale 1 / sqrt(sum h^2 + D eps) of its key stream, computed once at its commit (a traced commit
      writes its slot with `index_put_`, `_store_slot`, which inductor does not turn into a pass over the buffer);
    - per residual, the folded queries (times sqrt(D)), the read gate with its count scaling and the write gates are
      derived once per parameter version (`_InferenceConstants`, `_derived`) and looked up once per forward; a
      compiled graph, which holds no memo, derives them at every call, for all the model's residuals at once from
      their stacked parameters (`_derive`);
    - phase 1 runs once per block for the block's reads that are still ahead (`_reads_ahead`; once per decoder layer
      where the model's later parameters are not at hand): one product for the scores, a softmax that yields its
      log-sum-exp, one batched value sum (traced: a sum over the entries, `_fused_value_sums`, which inductor fuses),
      and the read gate folded in, so a read that does not see the partial costs nothing more;
    - a read of the partial adds its score and the log-sum-exp merge,
      u = sum_j gate_j (sigmoid(L_j - z_j) Obar^j + sigmoid(z_j - L_j) P^{nu(j)}) (not gate_j Obar^j plus a
      correction, which cancels when the partial dominates: `phase_two`);
    - the depth weights are formed only when a caller records them (`keep_weights`);
    - an eager forward over many tokens (`bytes_bound`: prefill, where each pass over [B, T, D] operands costs its
      bytes, and a fresh temporary its pages) sums gates in phase 1 only for the reads that do not see the partial
      (as a traced forward does; few tokens sum them for every read in one operation), transports the partial without a
      flipped copy, and takes key scales in one reduction; few tokens (decoding) take the forms with fewest calls;
    - with `config.dar_inference_kernel = "cpp"`, an eager forward on CPU that records no depth weights runs phase
      1, each read of the partial and each two-stream write as one C++ call each (`cpu_kernels.py`, same equations;
      decoding and prefill alike: over many tokens the rows are split over torch's threads).
    """

    def __init__(self, config):
        self.eps = depth_key_norm_eps(config)
        self.wants_kernels = config.dar_inference_kernel == "cpp"
        self.kernels = None  # the C++ kernels, where this forward runs them (`start`)
        self.num_slots = 1 + math.ceil(config.dar_num_branches / config.dar_block_size)  # embedding + one per block
        self.key_streams, self.value_streams = dar_routing(config)  # every residual's (config-wide)
        self.keep_weights = True
        self.history_buffer = self.inv_rms_buffer = None
        self.constants: dict[torch.nn.Module, _InferenceConstants] = {}  # this forward's, by residual
        self.derived: dict = {}  # a compiled forward's (sources, `_derive`) of all the model's residuals, by residual
        self.stacks = None  # and the routed queries and gates of them all, stacked, with each residual's index
        self.model_memo: dict | None = None  # the residuals' constants across forwards (`_model_memo`), by residual
        self.planned: dict[torch.nn.Module, _PlannedRead] = {}  # phase 1 of reads ahead in the open block
        self.block_size = config.dar_block_size
        self.residuals: tuple = ()
        self.autocast = False  # whether autocast is on for the history's device (`start`: read once per forward)
        self.dtype_likes: dict[torch.dtype, torch.Tensor] = {}  # empty tensors naming a branch dtype, for the kernels
        self.bytes_bound = False  # an eager forward over many tokens (`BYTES_BOUND_ELEMENTS`; set by `start`)

    def start(self, entry: torch.Tensor, keep_weights: bool = True, residuals=()) -> DepthState:
        """entry B_0 [B, T, J, D] in the history dtype; `keep_weights=False` when no caller records depth weights;
        `residuals`: the model's branch residuals in order (empty: phase 1 per decoder layer only)."""
        self.keep_weights, self.residuals = keep_weights, tuple(residuals)
        self.bytes_bound = (not torch.compiler.is_compiling()  # first: a traced size comparison is a shape guard
                            and entry.numel() // entry.shape[-2] >= BYTES_BOUND_ELEMENTS)  # B T D
        if self.wants_kernels and not keep_weights:
            self.kernels = eager_cpu_kernels(entry)
        compute_dtype = dar_compute_dtype(entry.dtype)
        self.autocast = torch.is_autocast_enabled(entry.device.type)
        self.history_buffer = entry.new_empty(self.num_slots, *entry.shape)  # [S_max, B, T, J, D]
        # [S_max, B, T, J], in the compute dtype
        self.inv_rms_buffer = entry.new_empty(self.num_slots, *entry.shape[:-1], dtype=compute_dtype)
        if self.residuals and not torch.is_grad_enabled() and not torch.compiler.is_compiling():
            self.model_memo = _model_memo(self.residuals, self.inv_rms_buffer)
        elif self.residuals and torch.compiler.is_compiling() and parameters_here(self.residuals):
            sources = read_source_counts(self.residuals, self.block_size)
            derived, routed_t, gate = self._derive(self.residuals, sources)
            self.derived = dict(zip(self.residuals, zip(sources, derived)))
            self.stacks = (routed_t, gate, {residual: index for index, residual in enumerate(self.residuals)})
        if self.autocast:
            with self._autocast_off():
                return DepthState(self, None, (self._commit(entry, 0),))
        return DepthState(self, None, (self._commit(entry, 0),))

    def plan(self, state: DepthState, *residuals) -> tuple[_PlannedRead | None, ...]:
        """Phase 1 of `residuals` that see the state's committed entries; None for the rest, which plan their own
        read. A read not planned yet plans the rest of its block with it (`_reads_ahead`)."""
        planned, first = self.planned, residuals[0]
        if first not in planned:
            group = self._reads_ahead(first) or reads_planned_together(residuals)
            if self.autocast:
                with self._autocast_off():
                    planned.update(zip(group, self._phase_one(state, group)))
            else:
                planned.update(zip(group, self._phase_one(state, group)))
        return tuple(map(planned.pop, residuals, (None,) * len(residuals)))  # dict.pop(residual, None), from C

    # The hot methods below branch on `self.autocast` instead of entering a no-op context when it is off: two Python
    # calls fewer per read and write, which a decoding step pays 120 times with cold caches (docs/overhead-log.md).
    def _autocast_off(self):
        """The precision policy also under autocast (`_without_autocast`), as of the forward's start."""
        return torch.autocast(self.history_buffer.device.type, enabled=False)

    def _reads_ahead(self, first) -> list:
        """The reads from `first` to the end of its block (they see the same committed entries), when the model gave
        its residuals and their parameters are here (not on the meta device of a layer-streamed or offloaded model):
        the history is then read once per block instead of once per decoder layer. At most as many reads as the
        history has slots, so that phase 1's sums [B, T, J, R, D] never outgrow the history buffer. Kept in the model's
        memo, whose stamp covers where every parameter lives (a meta tensor's data pointer is 0)."""
        memo = self.model_memo
        if memo is None:
            return self._find_reads_ahead(first)
        group = memo.get((first, "reads ahead"))
        if group is None:
            group = memo[(first, "reads ahead")] = self._find_reads_ahead(first)
        return group

    def _find_reads_ahead(self, first) -> list:
        return reads_ahead(self.residuals, first, self.block_size, max(2, self.num_slots))

    def keeping_partials_lean(self):
        return nullcontext()

    def _key_scale(self, entry: torch.Tensor) -> torch.Tensor:
        """1 / sqrt(sum_d h^2 + D eps) [..., J] of entries [..., J, D]: the inverse RMS divided by sqrt(D). Over many
        tokens from the norm, one reduction (`vecdot` multiplies into a temporary the size of `entry`, then sums)."""
        if self.bytes_bound and not torch.compiler.is_compiling():
            squares = torch.linalg.vector_norm(entry, dim=-1).square_()
        else:
            squares = torch.linalg.vecdot(entry, entry)
        return squares.add_(entry.shape[-1] * self.eps).rsqrt_()

    def _commit(self, entry: torch.Tensor, slot: int) -> torch.Tensor:
        """Store a committed entry and its key scale, by target stream: slot j holds the scale of j's key stream."""
        stored = self.history_buffer[slot]
        if self.kernels is not None and entry.is_contiguous() and entry.dtype == self.inv_rms_buffer.dtype:
            self.kernels.commit(entry, self.history_buffer, slot, self.inv_rms_buffer, self.key_streams, self.eps)
            return stored
        _store_slot(self.history_buffer, slot, entry)  # in the history's dtype
        key_scale = self._key_scale(stored.to(self.inv_rms_buffer.dtype))  # [B, T, J]; of the stored value
        _store_slot(self.inv_rms_buffer, slot, _streams(key_scale, self.key_streams, 2))
        return stored

    def _constants(self, residual, num_sources: int) -> _InferenceConstants:
        """The residual's constants, looked up once per forward (its read and write see the same sources count):
        from the model's memo for the model's residuals (`start`), else from the residual's own (`_derived`)."""
        constants = self.constants.get(residual)
        if constants is None:
            key = (residual, num_sources)
            sources, derived = self.derived.get(residual, (None, None))
            if sources == num_sources:
                constants = derived
            elif self.model_memo is not None and key in self.model_memo:
                constants = self.model_memo[key]
            elif self.model_memo is not None and residual in self.residuals:
                with _onloaded(residual):
                    constants = self.model_memo[key] = self._derive([residual], [num_sources])[0][0]
            else:
                constants = _derived(residual, f"inference_{num_sources}", self.inv_rms_buffer,
                                     lambda: self._derive([residual], [num_sources])[0][0])
            self.constants[residual] = constants
        return constants

    def _derive(self, residuals, num_sources: list[int]) -> tuple[list[_InferenceConstants], torch.Tensor, ...]:
        """The constants of `residuals`, each for a read of its `num_sources` sources, in the compute dtype, derived
        from the residuals' parameters stacked, and the stacks of their routed queries [R, J, J * D] and gates [R, J]:
        a compiled forward, which holds no memo (`_derived`) and so derives every residual's at every call, does it
        for the whole model in a few operations (`start`), not a few per residual (docs/overhead-log.md)."""
        derived = stacked_derivations(residuals, num_sources, self.inv_rms_buffer)
        query = derived.query * math.sqrt(derived.query.shape[-1])  # [R, J, D]
        routed_t = routed_queries_wide(query, self.key_streams)  # [R, J, J * D]
        betas = iter(() if derived.beta is None else derived.beta)
        rhos = iter(() if derived.rho is None else derived.rho)
        constants = [
            _InferenceConstants(
                routed_t[index], query[index], derived.gate[index],
                next(betas) if writes else None, next(rhos) if transports else None,
            )
            for index, (writes, transports) in enumerate(zip(derived.writes, derived.transports))
        ]
        return constants, routed_t, derived.gate

    def _phase_one(self, state: DepthState, residuals) -> list[_PlannedRead]:
        """Phase 1 of the reads of `residuals` (all see the state's committed entries) in one pass over the buffer."""
        sources = len(state.history)
        sees_partial = [getattr(r, "reads_partial", False) for r in residuals]  # the readout has no partial
        constants = [self._constants(r, sources + int(partial)) for r, partial in zip(residuals, sees_partial)]
        if self.kernels is not None:
            return self._phase_one_kernel(sources, constants, sees_partial)
        history = self.history_buffer[:sources].to(self.inv_rms_buffer.dtype)  # [S, B, T, J, D], no copy in float32
        _, batch, tokens, streams, hidden = history.shape
        routed_t, gates = self._stacked(residuals, constants)  # [R * J, J * D], [R, J]
        reads = len(constants)
        key_dots = wide_product(history.view(-1, streams * hidden), routed_t)
        key_dots = key_dots.view(sources, batch, tokens, reads, streams)
        scores = key_dots * self.inv_rms_buffer[:sources].unsqueeze(3)  # [S, B, T, R, J]
        # softmax over depth with its log-sum-exp (fewer dispatches than logsumexp, which costs 15 us on a few values)
        top = scores.amax(0)  # [B, T, R, J]
        weights = scores.sub_(top).exp_()  # [S, B, T, R, J], unnormalised
        total = weights.sum(0)
        weights.div_(total)
        log_sum_exp = total.log_().add_(top)  # [B, T, R, J]
        if torch.compiler.is_compiling():
            means = _fused_value_sums(weights, history, self.value_streams)  # [B, T, J, R, D]
            return self._regrouped_plans(means, log_sum_exp, weights, gates, sees_partial)
        means = _value_sums(weights, history, self.value_streams)  # [B, T, J, R, D]
        if self.bytes_bound:
            return self._regrouped_plans(means, log_sum_exp, weights, gates, sees_partial)
        # sum_j gate_j Obar^j [B, T, R, D], one stream at a time: a sum over the strided stream axis of `means`
        # costs ten times the whole value sum on CPU
        gated = means[:, :, 0] * gates[:, :1]
        for stream in range(1, streams):
            gated.addcmul_(means[:, :, stream], gates[:, stream : stream + 1])
        return list(map(_PlannedRead, gated.unbind(2), means.unbind(3), log_sum_exp.unbind(2), weights.unbind(3)))

    @staticmethod
    def _regrouped_plans(means, log_sum_exp, weights, gates, sees_partial: list[bool]) -> list[_PlannedRead]:
        """Phase 1's plans in a traced forward, or an eager one over many tokens (`bytes_bound`): the gated sum only
        for a read that does not see the partial (the branch input); a read of the partial forms its own from Obar
        (`_regrouped_branch_input`). Inductor writes a gated sum it is given to memory and reads it back at the read:
        that is 2 x 4 D bytes per token and read more, and measured 7 ms of a compiled 1 x 128 fp32 prefill at the
        SmolLM2 shape (docs/overhead-log.md)."""
        plans = []
        for read, (partial, mean) in enumerate(zip(sees_partial, means.unbind(3))):  # Obar [B, T, J, D]
            gated = None
            if not partial:
                gated = mean[:, :, 0] * gates[read, 0]
                for stream in range(1, mean.shape[2]):
                    gated = gated + mean[:, :, stream] * gates[read, stream]
            plans.append(_PlannedRead(gated, mean, log_sum_exp[:, :, read], weights[:, :, :, read]))
        return plans

    def _stacked(self, residuals, constants: list[_InferenceConstants]) -> tuple[torch.Tensor, torch.Tensor]:
        """The routed queries [R * J, J * D] and gates [R, J] of the reads of `residuals` side by side: in a compiled
        forward, views of `start`'s stacks where the reads are consecutive there and use its constants (no copy per
        block); else stacked here."""
        if self.stacks is not None:
            routed_t, gate, index = self.stacks
            first = index.get(residuals[0])
            if first is not None and all(
                index.get(residual) == first + offset and own is self.derived[residual][1]
                for offset, (residual, own) in enumerate(zip(residuals, constants))
            ):
                return routed_t[first : first + len(residuals)].flatten(0, 1), gate[first : first + len(residuals)]
        if len(constants) == 1:
            return constants[0].routed_t, constants[0].gate.unsqueeze(0)
        return torch.cat([c.routed_t for c in constants]), torch.stack([c.gate for c in constants])

    def _phase_one_kernel(self, sources: int, constants, sees_partial: list[bool]) -> list[_PlannedRead]:
        """A read that sees the partial gets Obar and L (its kernel read forms the gated sum from Obar), any other
        its gated sum alone: the kernel writes nothing else (a third of the bytes at K = 8)."""
        gated, means, log_sum_exp = self.kernels.phase_one(
            self.history_buffer, sources, self.inv_rms_buffer, [c.query for c in constants],
            [c.gate for c in constants], self.key_streams, self.value_streams, sees_partial,
        )  # [R_g, B, T, D], [R_p, B, T, J, D], [R_p, B, T, J], each in read order
        gated, means, log_sum_exp = iter(gated), iter(means), iter(log_sum_exp)
        return [
            _PlannedRead(None, next(means), next(log_sum_exp), None) if partial
            else _PlannedRead(next(gated), None, None, None)
            for partial in sees_partial
        ]

    def read(self, residual, state: DepthState, read_partial: bool, planned: _PlannedRead | None = None,
             dtype: torch.dtype | None = None):
        """u [B, T, D] in the compute dtype, or already in `dtype` (the branch's) where the kernels write it so."""
        if planned is None:
            planned = self.plan(state, residual)[0]
        if not read_partial:
            return planned.gated, (planned.weights if self.keep_weights else None)
        if self.autocast:
            with self._autocast_off():
                return self._read_with_partial(residual, state, planned, dtype)
        return self._read_with_partial(residual, state, planned, dtype)

    def _read_with_partial(self, residual, state: DepthState, planned: _PlannedRead, dtype: torch.dtype | None):
        partial = state.partial
        constants = self.constants.get(residual) or self._constants(residual, len(state.history) + 1)
        if self.kernels is not None:
            dtype = dtype or partial.dtype
            like = self.dtype_likes.get(dtype)
            if like is None:
                like = self.dtype_likes[dtype] = partial.new_empty(0, dtype=dtype)
            branch_input = self.kernels.read_partial(
                partial, constants.query, constants.gate, planned.mean, planned.log_sum_exp,
                self.key_streams, self.value_streams, self.eps, like,
            )  # [B, T, D] in `dtype`: rounded as `.to(dtype)` would round it
            return branch_input, None
        traced = torch.compiler.is_compiling()
        batch, tokens, streams, hidden = partial.shape
        if traced:  # a reduction inductor fuses with the key scale's, not a BLAS call per read
            partial_dots = torch.linalg.vecdot(_streams(partial, self.key_streams, 2), constants.query)  # [B, T, J]
        else:
            partial_dots = wide_product(partial.view(-1, streams * hidden), constants.routed_t)
            partial_dots = partial_dots.view(batch, tokens, streams)
        score = partial_dots * _streams(self._key_scale(partial), self.key_streams, 2)  # z [B, T, J]
        share = torch.sigmoid(score - planned.log_sum_exp)  # the partial's softmax weight e^z / (e^L + e^z)
        rest = torch.sigmoid(planned.log_sum_exp - score)  # the entries' (not 1 - share: `phase_two`)
        values = _streams(partial, self.value_streams, 2)  # [B, T, J, D]: P^{nu(j)}
        branch_input = self._regrouped_branch_input(constants.gate, share, rest, values, planned.mean)
        weights = None
        if self.keep_weights:
            weights = torch.cat([planned.weights * rest, share.unsqueeze(0)])
        return branch_input, weights

    @staticmethod
    def _regrouped_branch_input(gate, share, rest, values, mean) -> torch.Tensor:
        """The branch input of a read of the partial, from Obar and P (a gated sum of Obar would cancel against the
        partial's term when the partial dominates: `phase_two`; so phase 1 of a traced or bytes-bound forward writes
        none for it, `_regrouped_plans`):
          u = sum_j gate_j rest_j Obar^j + gate_j share_j P^{nu(j)}.
        gate [J], share and rest [B, T, J], values P^{nu(j)} and mean Obar [B, T, J, D] -> u [B, T, D]. One stream
        at a time: a batched product over the streams loops over tokens on CPU, a sum over the strided stream axis is
        slower."""
        partial_weight = (share * gate).unsqueeze(-1)  # [B, T, J, 1]
        mean_weight = (rest * gate).unsqueeze(-1)  # [B, T, J, 1]
        # accumulated in place: eagerly no temporary per term (a traced forward's functionalisation makes the same sums)
        branch_input = (mean[:, :, 0] * mean_weight[:, :, 0]).addcmul_(values[:, :, 0], partial_weight[:, :, 0])
        for stream in range(1, values.shape[2]):
            branch_input.addcmul_(mean[:, :, stream], mean_weight[:, :, stream])
            branch_input.addcmul_(values[:, :, stream], partial_weight[:, :, stream])
        return branch_input

    def write(self, residual, state: DepthState, branch_output: torch.Tensor, commits: bool) -> DepthState:
        constants = self.constants.get(residual) or self._constants(
            residual, len(state.history) + int(residual.reads_partial)
        )
        if self.autocast:  # the commit's key scale too (a `vecdot` autocast would run in bf16)
            with self._autocast_off():
                return self._written(constants, state, branch_output, commits)
        return self._written(constants, state, branch_output, commits)

    def _written(self, constants: _InferenceConstants, state: DepthState, branch_output, commits: bool) -> DepthState:
        partial = self._write(constants, state.partial, branch_output)  # y [B, T, D] in the model dtype
        if commits:
            return DepthState(self, None, (*state.history, self._commit(partial, len(state.history))))
        return DepthState(self, partial, state.history)

    def _write(self, constants: _InferenceConstants, partial, branch_output) -> torch.Tensor:
        if self.kernels is not None and constants.beta is not None:  # two streams
            branch_output = branch_output.contiguous()
            if partial is None:
                return self.kernels.write_first(constants.beta, branch_output)
            return self.kernels.write_partial(partial, constants.rho, constants.beta, branch_output)
        written = branch_output.unsqueeze(-2)  # y [B, T, 1, D]
        if constants.beta is None:  # one stream (AttnRes): y unchanged
            partial = written.to(self.inv_rms_buffer.dtype) if partial is None else partial + written
        elif partial is None:
            partial = constants.beta * written  # [B, T, J, D], promoted to the compute dtype
        elif self.bytes_bound and not torch.compiler.is_compiling():  # over many tokens: no flipped copy of P
            partial = transport_write(partial, constants.rho, constants.beta, written)
        else:  # [[rho, 1-rho], [1-rho, rho]] P + beta * y from the flipped copy: one call fewer (decoding)
            partial = torch.lerp(partial.flip(-2), partial, constants.rho).addcmul_(constants.beta, written)
        return partial


# ---------------------------------------------------------------------------------------------------------------
# "fast": the fused eager path (one product per read over a depth-major buffer, shared entry gradients).


def _depth_read_forward(routed, gate, history, history_inv_rms, key_streams, value_streams):
    """One branch's fast read: softmax over depth of its sources, mixed straight into the branch input.

    routed [J * D, J] (`routed_queries`), gate [J] (read gate times scale), sources history [N, B, T, J, D] with
    their inverse RMS [N, B, T, J] -> (u [B, T, D], softmax weights [N, B, T, J], key dots [N, B, T, J]).
    """
    sources, batch, tokens, streams, hidden = history.shape
    keyed_dots = key_dots_of(history.reshape(-1, streams * hidden), routed).view(sources, batch, tokens, streams)
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

    Every fused read's backward leaves its entries' gradients as per-token coefficients (`defer`), added with those
    of the other reads deferred so far at the next `take`, and each entry's commit takes its slot once every read of
    that entry is done (autograd runs a node's backward only after all its consumers'). So the reads of a block are
    added together, each entry row read and written once per block instead of once per read, no read allocates an
    entry-sized gradient per source and autograd sums no per-entry gradients; the buffer is allocated by the first
    `take` and freed after entry 0, the last to be handed over.
    """

    def __init__(self):
        self.buffer: torch.Tensor | None = None
        self.deferred: list[tuple] = []  # the reads' entry gradients not added yet (`defer`)
        self.committed: set[int] = set()  # the history slots that hold a committed entry (`_Commit`)

    def defer(self, kernels, history_buffer, key_streams, grad_input, query, entry_coefficients) -> None:
        """A read's entry gradients as per-token coefficients [n, B, T, 3, J] of its n entries (value, key and key
        norm: `train_read_backward`'s, or `_DepthRead`'s in the same layout), its u gradient [B, T, D] and folded
        query [J, D]; added at the next `take` by the C++ kernel (`kernels`) or `add_entry_gradients`."""
        self.deferred.append((grad_input, query, entry_coefficients))
        self.kernels, self.history_buffer, self.key_streams = kernels, history_buffer, key_streams

    def take(self, slot: int) -> torch.Tensor | None:
        """The accumulated gradient of entry `slot`, leaving zeros behind (a second backward starts clean)."""
        if self.deferred:
            grads_input, queries, coefficients = map(list, zip(*self.deferred))
            self.deferred = []
            if self.buffer is None:
                self.buffer = torch.zeros_like(self.history_buffer)  # [S_max, B, T, J, D]
            add = add_entry_gradients if self.kernels is None else self.kernels.train_read_entry_gradients
            add(self.history_buffer, self.buffer, grads_input, queries, coefficients, list(self.key_streams))
        if self.buffer is None:
            return None
        gradient = self.buffer[slot].clone()
        if slot == 0:
            self.buffer = None
        else:
            self.buffer[slot].zero_()
        return gradient


def add_entry_gradients(history, grad_entries, grads_input, queries, coefficients, key_streams) -> None:
    """`train_read_entry_gradients` in PyTorch operations: the entries' gradients of R reads (deferred by
    `DepthGradients.defer`) added into grad_entries [S_max, B, T, J, D], history [S_max, B, T, J, D] the committed
    entries. Read r of n_r entries, coefficients [n_r, B, T, 3, J], adds to entry s < n_r, stream v:
      c^v_rs g_r + sum_{j: kappa(j) = v} gk^j_rs q^j_r + k^v_rs B^v_s.
    The reads of one entry count are added together: per group, one batched product for the value terms (each
    token's gradients of u), one product for the key terms (the queries) and one pass for the key norm's, each over
    the group's entries once, not once per read."""
    hidden = history.shape[-1]
    streams = history.shape[3]
    selector = stream_selector(tuple(key_streams), history)  # [J_key, J]
    groups: dict[int, list[int]] = {}
    for read, coefficient in enumerate(coefficients):
        groups.setdefault(coefficient.shape[0], []).append(read)
    for count, reads in groups.items():
        grads = grad_entries[:count]  # [n, B, T, J, D]
        stacked = torch.stack([coefficients[read] for read in reads], -1)  # [n, B, T, 3, J, R]
        value, key, norm = stacked.unbind(3)  # [n, B, T, J, R] each
        # value terms: per token, [n * J, R] coefficients times the R gradients of u [R, D]
        rows = value.permute(1, 2, 0, 3, 4).reshape(-1, count * streams, len(reads))  # [B T, n J, R]
        grads_u = torch.stack([grads_input[read] for read in reads], 2).reshape(-1, len(reads), hidden)  # [BT, R, D]
        terms = torch.bmm(rows, grads_u).view(grads.shape[1], grads.shape[2], count, streams, hidden)
        grads.add_(terms.permute(2, 0, 1, 3, 4))
        # key terms: rows (entry, token, key stream) times the R reads' queries of every target [R * J, D]
        by_key_stream = key.unsqueeze(3) * selector.unsqueeze(-1)  # [n, B, T, J_key, J, R]
        read_queries = torch.stack([queries[read] for read in reads])  # [R, J, D]
        grads.view(-1, hidden).addmm_(by_key_stream.transpose(-1, -2).reshape(-1, len(reads) * streams),
                                      read_queries.reshape(-1, hidden))
        grads.addcmul_(history[:count], norm.sum(-1).unsqueeze(-1))


def _write_slot(history_buffer, inv_rms_buffer, slot: int, entry: torch.Tensor, eps: float) -> torch.Tensor:
    """Copy an entry (a commit) or the partial block state (staged in the slot where its block will be committed,
    so that a read is one product over buffer[: slot + 1]) into the buffers with its inverse RMS; returns that
    [B, T, J]. Through `.data`: the buffers are caches invisible to autograd, and writing through `.data` leaves
    their version counters alone, so a checkpointed replay may rewrite them."""
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
        gradients.committed.add(slot)
        ctx.slot, ctx.gradients = slot, gradients
        return entry.view_as(entry)

    @staticmethod
    @refuses_double_backward  # hand-written: a second derivative through it would be silently wrong
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


def _read_sources(history_buffer, inv_rms_buffer, entries, partial, eps):
    """The sources of one read in the buffers, the partial (if read) staged in the next free slot ->
    (history [N, B, T, J, D], inverse RMS [N, B, T, J], the partial's inverse RMS [B, T, J] or None)."""
    num_sources, partial_inv_rms = len(entries), None
    if partial is not None:
        partial_inv_rms = _write_slot(history_buffer, inv_rms_buffer, num_sources, partial, eps)
        num_sources += 1
    return history_buffer[:num_sources], inv_rms_buffer[:num_sources], partial_inv_rms


class _DepthRead(torch.autograd.Function):
    """One branch's depth read and read gate (eq. 2-5), fused; returns u and the (non-differentiable) weights.

    The committed entries are read from the preallocated depth-major buffer; they are inputs only so that autograd
    runs this backward before their commits' (`_Commit`), which take what this backward defers to the shared
    `DepthGradients` (the entries' gradients as per-token coefficients, added with the block's other reads'). The
    partial block state is an ordinary input. Backward keeps only per-token scalars (the key dots, N per token and
    stream, from which it recomputes the softmax weights) and the partial (rebuilt in backward under the lean hooks,
    `FastDepthBackend.keeping_partials_lean`), and rebuilds every gradient from the buffer, including the key
    normalisation's, d rms^-1 / d h = -rms^-3 h / D. Neither the per-stream extractions nor normalised keys are
    stored.
    """

    @staticmethod
    def forward(ctx, routed, gate, history_buffer, inv_rms_buffer, routing, eps, gradients, partial, *entries):
        # A checkpointed layer recomputed in backward stages its partial in the slot its block has committed since
        # (the forward staged it there before the commit), and non-reentrant checkpointing stops the recompute before
        # the commit writes it again: the committed entry is kept aside and put back after the read, else a later
        # backward through a retained graph (or a read not recomputed, such as the final readout) reads the partial.
        slot = len(entries)
        kept = None
        if partial is not None and slot in gradients.committed:
            kept = history_buffer[slot].clone(), inv_rms_buffer[slot].clone()
        sources, sources_inv_rms, partial_inv_rms = _read_sources(history_buffer, inv_rms_buffer, entries, partial, eps)
        branch_input, weights, keyed_dots = _depth_read_forward(routed, gate, sources, sources_inv_rms, *routing)
        if kept is not None:
            history_buffer.data[slot].copy_(kept[0])
            inv_rms_buffer.data[slot].copy_(kept[1])
        # The partial's slot is overwritten by later partials: backward reads the partial itself (kept anyway).
        # The softmax weights are not kept: backward recomputes them from the key dots (the same values).
        ctx.save_for_backward(routed, gate, keyed_dots, partial, partial_inv_rms)
        ctx.history, ctx.history_inv_rms = history_buffer[: len(entries)], inv_rms_buffer[: len(entries)]
        ctx.history_buffer, ctx.routing, ctx.gradients = history_buffer, routing, gradients
        ctx.mark_non_differentiable(weights)
        return branch_input, weights

    @staticmethod
    @refuses_double_backward  # hand-written: a second derivative through it would be silently wrong
    def backward(ctx, grad_input, _grad_weights):
        routed, gate, keyed_dots, partial, partial_inv_rms = ctx.saved_tensors
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
        weights = (keyed_dots * key_inv_rms).softmax(dim=0)  # [N, B, T, J]: the forward's, recomputed
        target_value_dots = _streams(value_dots, value_streams, 3)  # [N, B, T, J]: g . V^{nu(j)}_n
        grad_gate = (weights * target_value_dots).sum((0, 1, 2)) if ctx.needs_input_grad[1] else None  # [J]
        grad_weights = gate * target_value_dots  # [N, B, T, J]
        grad_scores = weights * (grad_weights - (weights * grad_weights).sum(0))  # softmax backward over depth
        grad_keyed = grad_scores * key_inv_rms  # [N, B, T, J]
        selector = stream_selector(key_streams, weights)  # [J_key, J]
        grad_inv_rms = (grad_scores * keyed_dots) @ selector.T  # [N, B, T, J_key]
        queries = unrouted_queries(routed, selector)  # [J, D]
        coefficients = _by_value_stream(weights * gate, value_streams)  # [N, B, T, J_val]

        # Committed entries: values, keys and key norm as per-token coefficients, added with the other reads of the
        # block into their slots of the shared gradient (`DepthGradients.take`).
        norm_coefficient = grad_inv_rms[:sources] * history_inv_rms.pow(3) / -hidden  # [S, B, T, J_key]
        entry_coefficients = torch.stack([coefficients[:sources], grad_keyed[:sources], norm_coefficient], 3)
        ctx.gradients.defer(None, ctx.history_buffer, key_streams, grad_input, queries, entry_coefficients)

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
) -> tuple[torch.Tensor, torch.Tensor]:
    """The fast path's read of one branch: u = sum_j gate_j x^j with x^j the depth attention of target stream j.

    routed [J * D, J] (`routed_queries` of pseudo-query times key-norm weight); gate [J] (the read gate's
    (alpha, 1 - alpha), or (1,) for one stream, times read and count scaling); the committed entries, each
    [B, T, J, D], also copied into history_buffer [S_max, B, T, J, D] with their inverse RMS in inv_rms_buffer
    [S_max, B, T, J]; the partial block state [B, T, J, D] when the branch reads it -> (u [B, T, D], weights
    [N, B, T, J]), compute dtype. Scores are w . RMSNorm_gamma(k) = ((w * gamma) . k) / rms(k): normalised keys are
    never materialised.
    """
    routing = (key_streams, value_streams)
    with torch.autocast(history_buffer.device.type, enabled=False):  # the precision policy, also under autocast
        inputs = (routed, gate, partial, *entries)
        if torch.is_grad_enabled() and any(tensor is not None and tensor.requires_grad for tensor in inputs):
            if gradients is None:
                raise ValueError("depth_read needs the forward's DepthGradients to train (see FastDepthBackend).")
            return _DepthRead.apply(
                routed, gate, history_buffer, inv_rms_buffer, routing, eps, gradients, partial, *entries
            )
        sources, sources_inv_rms, _ = _read_sources(history_buffer, inv_rms_buffer, entries, partial, eps)
        branch_input, weights, _ = _depth_read_forward(routed, gate, sources, sources_inv_rms, *routing)
        return branch_input, weights


def transport_write(partial, rho, beta, branch_output):
    """P [B, T, J, D], rho (1,), beta [J, D], y [B, T, 1, D] -> [[rho, 1-rho], [1-rho, rho]] P + beta * y. Without
    autograd (the fast path's forward and its replays, the operators' eager bodies) each stream is lerped into its
    half of the result, then y added in place: the values of lerp(swap(P), P, rho) + beta * y bit for bit without a
    flipped copy of P or a second temporary (two passes over [B, T, J, D] fewer)."""
    if torch.is_grad_enabled() and any(tensor.requires_grad for tensor in (partial, rho, beta, branch_output)):
        return torch.addcmul(torch.lerp(partial.flip(-2), partial, rho), beta, branch_output)  # differentiable
    written = torch.empty_like(partial, dtype=torch.promote_types(partial.dtype, beta.dtype))
    torch.lerp(partial[..., 1, :], partial[..., 0, :], rho, out=written[..., 0, :])
    torch.lerp(partial[..., 0, :], partial[..., 1, :], rho, out=written[..., 1, :])
    return written.addcmul_(beta, branch_output)


def cast_gated_write(partial, rho, beta, branch_output):
    """The write of a branch output y [B, T, D] in the model dtype: beta * y at the start of a block (partial None),
    else `transport_write` -> [B, T, J, D] in beta's dtype."""
    written = branch_output.to(beta.dtype).unsqueeze(-2)  # [B, T, 1, D]
    if partial is None:
        return beta * written  # [B, T, J, D]
    return transport_write(partial, rho, beta, written)  # [B, T, J, D]


class _TransportWrite(torch.autograd.Function):
    """`transport_write` with the cast of y fused in: y arrives in the model dtype and backward keeps it there
    (bf16 training keeps no float32 copy of it), with P (kept by the next read anyway); the gate gradients are dot
    products, with no full-size temporaries. Without a partial (the first branch of a block) it is beta * y."""

    @staticmethod
    def forward(ctx, partial, rho, beta, branch_output):
        ctx.save_for_backward(partial, rho, beta, branch_output)
        return cast_gated_write(partial, rho, beta, branch_output)

    @staticmethod
    @refuses_double_backward  # hand-written: a second derivative through it would be silently wrong
    def backward(ctx, grad):
        return transport_write_gradients(grad, *ctx.saved_tensors, needs=ctx.needs_input_grad)


def transport_write_gradients(grad, partial, rho, beta, branch_output, needs=(True,) * 4):
    """The gradients of `cast_gated_write` from P, the gates and y in the model dtype: (d P, d rho, d beta, d y),
    None for those not in `needs` and, without a partial, for P and rho."""
    grad_partial = grad_rho = None
    if partial is not None:
        swapped = grad.flip(-2)  # the transport matrix is symmetric: dL/dP = [[rho, 1-rho], [1-rho, rho]] g
        grad_partial = torch.lerp(swapped, grad, rho) if needs[0] else None
        if needs[1]:  # dL/drho = sum g . (P - swap P) = sum (g - swap g) . P
            flat_partial = partial.flatten()
            grad_rho = torch.vdot(grad.flatten(), flat_partial) - torch.vdot(swapped.flatten(), flat_partial)
            grad_rho = grad_rho.reshape(rho.shape)
    written = branch_output.to(beta.dtype).unsqueeze(-2)  # [B, T, 1, D], recomputed from the kept model dtype
    grad_beta = (grad * written).sum((0, 1)) if needs[2] else None  # [J, D]
    grad_output = (grad * beta).sum(-2).to(branch_output.dtype) if needs[3] else None  # [B, T, D]
    return grad_partial, grad_rho, grad_beta, grad_output


class _KernelDepthRead(torch.autograd.Function):
    """`_DepthRead` as C++ calls (`cpu_kernels.py`: `train_read`, `train_read_backward`), token by token over the
    sources, so that each reads a token's sources from memory once instead of once per operation; the committed
    entries' gradients are deferred as per-token coefficients and added for a block's reads at once
    (`DepthGradients.defer`). Takes the folded query [J, D] (not the routed [J * D, J]) and reads the partial where
    it is (not staged in the buffer); saves what `_DepthRead` saves."""

    @staticmethod
    def forward(ctx, query, gate, history_buffer, inv_rms_buffer, routing, eps, kernels, gradients, partial, *entries):
        if partial is not None:
            partial = partial.contiguous()  # a no-op for the writes' outputs
        branch_input, weights, keyed_dots, partial_inv_rms = kernels.train_read(
            query, gate, history_buffer, inv_rms_buffer, len(entries), partial, *routing, eps
        )
        ctx.save_for_backward(query, gate, weights, keyed_dots, partial, partial_inv_rms)
        ctx.history_buffer, ctx.inv_rms_buffer, ctx.routing = history_buffer, inv_rms_buffer, routing
        ctx.kernels, ctx.gradients, ctx.num_entries = kernels, gradients, len(entries)
        ctx.mark_non_differentiable(weights)
        return branch_input, weights

    @staticmethod
    @refuses_double_backward  # hand-written: a second derivative through it would be silently wrong
    def backward(ctx, grad_input, _grad_weights):
        query, gate, weights, keyed_dots, partial, partial_inv_rms = ctx.saved_tensors
        grad_input = grad_input.to(query.dtype).contiguous()  # no-ops for u's own gradient
        grad_query, grad_gate, grad_partial, entry_coefficients = ctx.kernels.train_read_backward(
            grad_input, query, gate, ctx.history_buffer, ctx.inv_rms_buffer, ctx.num_entries, partial,
            partial_inv_rms if partial is not None else None, weights, keyed_dots, *ctx.routing,
        )
        ctx.gradients.defer(ctx.kernels, ctx.history_buffer, ctx.routing[0], grad_input, query, entry_coefficients)
        if ctx.num_entries + (partial is not None) == 1:  # a softmax over one source: the query's gradient is zero,
            grad_query.zero_()  # where the kernel's rounding leaves about 1e-12 (AdamW would move the query on it)
        needs = ctx.needs_input_grad
        return (
            grad_query if needs[0] else None, grad_gate if needs[1] else None, None, None, None, None, None, None,
            grad_partial if partial is not None and needs[8] else None, *(None for _ in range(ctx.num_entries)),
        )


class _KernelTransportWrite(torch.autograd.Function):
    """`_TransportWrite` (two streams) as C++ calls: `write_first` / `write_partial` forward, `write_backward`
    (one pass for every gradient); keeps what `_TransportWrite` keeps."""

    @staticmethod
    def forward(ctx, partial, rho, beta, branch_output, kernels):
        branch_output = branch_output.contiguous()
        if partial is not None:
            partial = partial.contiguous()
        ctx.save_for_backward(partial, rho, beta, branch_output)
        ctx.kernels = kernels
        if partial is None:
            return kernels.write_first(beta, branch_output)
        return kernels.write_partial(partial, rho, beta, branch_output)

    @staticmethod
    @refuses_double_backward  # hand-written: a second derivative through it would be silently wrong
    def backward(ctx, grad):
        partial, rho, beta, branch_output = ctx.saved_tensors
        grad_partial, grad_rho, grad_beta, grad_output = ctx.kernels.write_backward(
            grad.to(beta.dtype).contiguous(), partial, rho, beta, branch_output
        )
        needs = ctx.needs_input_grad
        if partial is None:
            grad_partial = grad_rho = None
        return (
            grad_partial if needs[0] else None, grad_rho if needs[1] else None, grad_beta if needs[2] else None,
            grad_output if needs[3] else None, None,
        )


class FastDepthBackend:
    """The fused eager path, one instance per forward: it owns the depth-major buffers (history [S_max, B, T, J, D],
    inverse RMS [S_max, B, T, J]) and the shared entry gradients. With `config.dar_training_kernel = "cpp"` on CPU
    (float32 or float64 buffers) every read runs `_KernelDepthRead` and every two-stream write
    `_KernelTransportWrite`: the same equations and saved tensors, one C++ call each way."""

    def __init__(self, config):
        if getattr(config, "dar_history_dtype", "float32") != "float32":  # also when set after the config was built
            raise ValueError(
                f"DARConfig.dar_history_dtype={config.dar_history_dtype!r} needs dar_implementation 'two_phase' or "
                "'reference'; the fused 'fast' path keeps its depth buffers in float32."
            )
        self.num_slots = 1 + math.ceil(config.dar_num_branches / config.dar_block_size)  # embedding + one per block
        self.eps = depth_key_norm_eps(config)
        self.history_buffer = self.inv_rms_buffer = None
        self.gradients = DepthGradients()
        self.wants_kernels = config.dar_training_kernel == "cpp"
        self.kernels = None  # the C++ kernels, where this forward runs them (`start`)
        self.lean: _LeanPartials | None = None

    def start(self, entry: torch.Tensor, keep_weights: bool = True, residuals=()) -> DepthState:
        if self.wants_kernels:
            self.kernels = training_cpu_kernels(entry)
        self.history_buffer = entry.new_empty(self.num_slots, *entry.shape)  # [S_max, B, T, J, D]
        self.inv_rms_buffer = entry.new_empty(self.num_slots, *entry.shape[:-1])  # [S_max, B, T, J]
        return DepthState(self, None, (self._commit(entry, 0),))

    def plan(self, state: DepthState, *residuals) -> tuple[None, ...]:
        return (None,) * len(residuals)  # every read is one fused product over the buffer: nothing to share

    def keeping_partials_lean(self):
        """Context of a training forward, as `TwoPhaseDepthBackend.keeping_partials_lean`: autograd keeps no float32
        partial state of a two-stream model (the reads and writes keep P), each block's partials rebuilt in backward
        by replaying the block's writes from the y kept anyway, with this path's own write (`_replayed_write`), so
        the values are those of the forward bit for bit. The committed entries live in the history buffer."""
        if torch.compiler.is_compiling() or not torch.is_grad_enabled():
            return nullcontext()
        self.lean = _LeanPartials()
        return torch.autograd.graph.saved_tensors_hooks(self.lean.pack, self.lean.unpack)

    def _replayed_write(self, partial, rho, beta, branch_output):
        """The two-stream write of the forward (`_KernelTransportWrite` or `_TransportWrite`), without autograd."""
        if self.kernels is not None:
            branch_output = branch_output.contiguous()
            if partial is None:
                return self.kernels.write_first(beta, branch_output)
            return self.kernels.write_partial(partial.contiguous(), rho, beta, branch_output)
        return cast_gated_write(partial, rho, beta, branch_output)

    def _commit(self, entry: torch.Tensor, slot: int) -> torch.Tensor:
        return commit_entry(entry, self.history_buffer, self.inv_rms_buffer, slot, self.eps, self.gradients)

    def read(self, residual, state: DepthState, read_partial: bool, planned=None, dtype=None) -> tuple:
        attention, read_gate = residual.depth_attention, residual.read_gate
        like, num_sources = self.history_buffer, len(state.history) + int(read_partial)
        stream_weights = _derived(read_gate, "stream_weights", like, lambda: read_gate.stream_weights().to(like))
        gate = stream_weights * (read_gate.read_scale * attention.count_scale(num_sources))  # [J]
        if self.kernels is not None:  # C++ computes in the buffers' dtype whether or not autocast is on
            query = _derived(attention, "scoring_query", like, lambda: attention.scoring_query().to(like))  # [J, D]
            return _KernelDepthRead.apply(
                query, gate, self.history_buffer, self.inv_rms_buffer, (attention.key_streams, attention.value_streams),
                self.eps, self.kernels, self.gradients, state.partial if read_partial else None, *state.history,
            )
        routed = _derived(
            attention, "routed_query", like,
            lambda: routed_queries(attention.scoring_query().to(like), attention.key_streams),
        )  # [J * D, J]
        return depth_read(
            routed, gate, self.history_buffer, self.inv_rms_buffer, state.history,
            state.partial if read_partial else None, attention.key_streams, attention.value_streams, self.eps,
            self.gradients,
        )

    def write(self, residual, state: DepthState, branch_output: torch.Tensor, commits: bool) -> DepthState:
        write_gate, like = residual.write_gate, self.history_buffer
        if write_gate.num_streams == 1:  # AttnRes writes y unchanged
            partial = residual.write_gate(branch_output.to(like.dtype), state.partial)
        else:
            beta = _derived(write_gate, "beta", like, lambda: write_gate.beta().to(like))  # [J, D]
            rho = None
            if state.partial is not None:
                rho = _derived(write_gate, "rho", like, lambda: write_gate.rho().to(like))  # (1,)
            if self.kernels is not None:
                partial = _KernelTransportWrite.apply(state.partial, rho, beta, branch_output, self.kernels)
            elif torch.is_grad_enabled():
                partial = _TransportWrite.apply(state.partial, rho, beta, branch_output)  # [B, T, J, D]
            else:
                partial = cast_gated_write(state.partial, rho, beta, branch_output)
            if self.lean is not None and not commits:
                self.lean.record(partial, beta, rho, branch_output, state.partial is None, self._replayed_write)
        if commits:
            return DepthState(self, None, (*state.history, self._commit(partial, len(state.history))))
        return DepthState(self, partial, state.history)


class DARDepthBackendInterface(GeneralInterface):
    """Name -> backend class, like transformers' `AttentionInterface`; `register` adds one library-wide."""

    _global_mapping = {
        "reference": ReferenceDepthBackend,
        "fast": FastDepthBackend,
        "two_phase": TwoPhaseDepthBackend,
    }


ALL_DEPTH_BACKENDS = DARDepthBackendInterface()


def depth_backend(config, traced: bool = False, recorded_weights: bool = False):
    """The backend of one forward. A forward traced by `torch.compile` reads "fast" as "two_phase": the fused path's
    shared gradient buffer is state between autograd nodes that a compiler cannot see (DESIGN.md section 6), while
    the two-phase read keeps no state outside its inputs and outputs; so does an eager forward whose decoder layers
    are compiled on their own (`traced`: regional compilation traces the reads and writes), with gradients off too.
    Any other forward with gradients off, eager or traced as a whole, reads either as `InferenceDepthBackend`: the
    same two-phase equations without autograd, in fewer operations. (Its history entries are views of one buffer;
    handed to a layer compiled for training, torch 2.13's dynamo fails building the recompiled graph's shape guards.)

    An eager forward with gradients on that records its depth weights (`output_depth_weights=True`,
    `recorded_weights`) takes the reference backend, whatever the config names: the others return the weights
    without gradients (their backward has no term for them), so a loss that used them (a depth-entropy regulariser)
    would silently lose its gradient. As transformers' attention falls back to eager for `output_attentions`. So does a forward under a
    `torch.func` transform (`grad`, `vmap`)."""
    implementation = config.dar_implementation
    if implementation not in ALL_DEPTH_BACKENDS:  # a value set on the config after it was validated
        raise ValueError(f"config.dar_implementation must name a depth backend, one of {sorted(ALL_DEPTH_BACKENDS)}, "
                         f"got {implementation!r}.")
    check_backend_options(config, owner="config")  # values set on a built model's config
    if not torch.compiler.is_compiling() and torch._C._functorch.peek_interpreter_stack() is not None:
        # torch.func transforms (grad, vmap: per-sample gradients, model ensembles): the optimised backends' custom
        # autograd functions define no `setup_context`, their saved-tensor hooks are refused under `grad`, and the C++
        # kernels take no batched tensors; the reference backend is plain PyTorch operations, which the transforms take
        return ReferenceDepthBackend(config)
    if recorded_weights and torch.is_grad_enabled() and not torch.compiler.is_compiling():
        # (a forward traced whole takes plain operations, whose weights carry gradients: no fallback, and no log call,
        # which dynamo cannot trace)
        if implementation != "reference":
            logger.warning_once(
                f"output_depth_weights=True with gradients on: this forward takes the reference depth backend (its depth "
                f"weights are differentiable; dar_implementation={implementation!r} returns them without gradients), "
                "which is slower. Record them under torch.no_grad() to keep the configured backend."
            )
        return ReferenceDepthBackend(config)
    if implementation in ("fast", "two_phase") and not torch.is_grad_enabled() and not traced:
        return InferenceDepthBackend(config)
    if implementation == "fast" and (traced or torch.compiler.is_compiling()):
        implementation = "two_phase"
    backend = ALL_DEPTH_BACKENDS[implementation](config)
    if traced and isinstance(backend, TwoPhaseDepthBackend):
        backend.layers_traced = True
    if recorded_weights and torch.is_grad_enabled() and isinstance(backend, TwoPhaseDepthBackend):
        # The read operators (`dar_compiled_read="operator"`) return the depth weights without a gradient: a traced
        # forward that records them reads inline, so that a loss on them (a depth-entropy regulariser) keeps its term
        # (it was dropped: gradients 1.1 relative off)
        backend.compiled_read = "inlined"
    return backend


__all__ = [
    "ALL_DEPTH_BACKENDS",
    "DARDepthBackendInterface",
    "DepthState",
    "FastDepthBackend",
    "InferenceDepthBackend",
    "PhaseOne",
    "ReferenceDepthBackend",
    "TwoPhaseDepthBackend",
    "dar_compute_dtype",
    "dar_history_dtype",
    "depth_backend",
    "depth_key_norm_eps",
    "module_registrations",
]
