# SPDX-License-Identifier: Apache-2.0
# Copyright 2026 The dar-transformers authors.
"""Analyses of a DAR model (DESIGN.md section 1 claims; residual-methods.md section 6.8): what the depth reads do.

Instrumentation never changes the model math. For the duration of `record_depth_reads` the model runs its reference
backend (`config.dar_implementation = "reference"`, where every read goes through `DARDepthAttention`), and a forward
hook on each `DARDepthAttention` records what the module itself returns, its extraction and depth weights (the same
outputs `output_depth_weights=True` records), and (for the rescue intervention only) may swap the returned
extraction for another. Leaving the context removes the hooks and restores the backend.

  depth-weight maps   mean softmax weight a^j_r over tokens, per branch m and stream j, and its entropy
  cross-stream CKA    linear CKA (Kornblith et al. 2019) between x^0_m and x^1_n for every pair of depths m, n
  rescue gain         corrupt both extractions x^0_m, x^1_m at a branch with another sequence's, restore one
                      stream (or none), measure how much of the clean output comes back (docs/results.md)
  stream balance      RMS of each stream's history entries, their cosine, read gate alpha, write-gate spread, rho

Shape legend: B batch, T tokens, D hidden, S depth sources, J streams, M branches (+1 for the final readout). The
model's depth-major layout throughout: sources [S, B, T, J, D], depth weights [S, B, T, J], extractions [B, T, J, D].
Command line: `dar analyze MODEL --text FILE --out DIR` or `python -m dar_transformers.analysis MODEL ...`.
"""

import argparse
import errno
import fnmatch
import json
import math
import os
import shutil
import stat
import sys
import tempfile
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from itertools import islice
from pathlib import Path

import numpy
import torch
import torch.nn.functional as F
from transformers.utils import logging

from .configuration_dar import DAR_MODEL_TYPES, DARConfig
from .conversion.output import signals_held
from .modeling_dar import DARDepthAttention, DARReadGate, DARWriteGate

logger = logging.get_logger(__name__)

READOUT = "readout"
# A corruption whose logit distance is below this fraction of the clean logits' squared norm changed nothing but
# rounding (a donor sequence equal to its own): its rescue gains are NaN, not a ratio of rounding noise.
DEGENERATE_CORRUPTION = 1e-10


# ---------------------------------------------------------------------------------------------------------------
# Linear CKA


def linear_cka(x: torch.Tensor, y: torch.Tensor) -> float:
    """Linear CKA (Kornblith et al. 2019, eq. 5) between two representations of the same N examples.

    x [N, D1], y [N, D2]: CKA = ||Yc^T Xc||_F^2 / (||Xc^T Xc||_F ||Yc^T Yc||_F) with column-centred Xc, Yc.
    1 for representations equal up to an orthogonal transform and isotropic scaling; near 0 when independent.
    """
    x = x.double() - x.double().mean(0, keepdim=True)  # [N, D1]
    y = y.double() - y.double().mean(0, keepdim=True)  # [N, D2]
    cross = torch.linalg.matrix_norm(y.T @ x) ** 2
    denominator = torch.linalg.matrix_norm(x.T @ x) * torch.linalg.matrix_norm(y.T @ y)
    return float(cross / denominator) if denominator > 0 else float("nan")


def cka_matrix(xs: list[torch.Tensor], ys: list[torch.Tensor]) -> torch.Tensor:
    """CKA[m, n] = linear_cka(xs[m], ys[n]) for lists of [N, D] representations of the same N examples: [M, M'].

    Picks the cheaper of two exact forms: the feature form above (cost ~ M M' N D^2), or centred Gram matrices
    K = Xc Xc^T, with ||Yc^T Xc||_F^2 = <K_x, K_y>_F, so that the whole matrix is one product (~ (M + M') N^2 D).
    """
    size, width = xs[0].shape
    if len(xs) * len(ys) * width**2 <= (len(xs) + len(ys)) * size**2 + len(xs) * len(ys) * size:
        return torch.tensor([[linear_cka(x, y) for y in ys] for x in xs], dtype=torch.float64)

    # float64 unless that would need more than about 256 MB (SmolLM2-sized depth); CKA is clamped to [0, 1]. A
    # representation constant over the examples has no CKA (NaN in both forms; the Gram form said 0.0).
    dtype = torch.float64 if (len(xs) + len(ys)) * size**2 <= 2**25 else torch.float32

    def normalised_grams(representations: list[torch.Tensor]) -> torch.Tensor:
        grams = []
        for x in representations:
            x = x.double() - x.double().mean(0, keepdim=True)  # [N, D]
            gram = (x @ x.T).flatten()  # [N * N]
            grams.append((gram / torch.linalg.vector_norm(gram)).to(dtype))  # 0 / 0: NaN, as `linear_cka`'s
        return torch.stack(grams)  # [M, N * N]

    return (normalised_grams(xs) @ normalised_grams(ys).T).double().clamp(0.0, 1.0)  # [M, M']


# ---------------------------------------------------------------------------------------------------------------
# Instrumentation


@dataclass
class DepthRead:
    """One recorded depth read: the weights of every target stream and the extractions it returned."""

    name: str
    weights: torch.Tensor  # [S, B, T, J]
    extracted: torch.Tensor  # [B, T, J, D], count-scaled, as returned by the read (before any intervention)
    entry_rms: torch.Tensor | None = None  # [S, J] mean RMS of each source (kept for the final readout only)
    entry_cosine: torch.Tensor | None = None  # [S] mean cross-stream cosine of each source (final readout only)


@dataclass
class DARBranchModules:
    """The DAR modules around one depth read: branch m (or the final readout, with no write gate)."""

    name: str
    branch_index: int | None
    depth_attention: DARDepthAttention
    read_gate: DARReadGate
    write_gate: DARWriteGate | None


def is_dar_config(config: object) -> bool:
    """A DAR or DAR-MoE config, the package's own class or the copy a folder's remote code loads (a model from
    `from_pretrained(..., trust_remote_code=True)` before the package is imported: another class of the same name)."""
    return getattr(config, "model_type", None) in DAR_MODEL_TYPES and hasattr(config, "dar_implementation")


def dar_branches(model: torch.nn.Module) -> list[DARBranchModules]:
    """Every depth read of a DAR model in execution order: L{l}.attn, L{l}.mlp for each layer, then the readout. A
    PEFT model is read through the model it adapts."""
    if hasattr(model, "get_base_model"):  # PeftModel: its `base_model` is the LoRA wrapper, not the DAR backbone
        model = model.get_base_model()
    base = model.base_model
    if not is_dar_config(getattr(base, "config", None)):
        raise TypeError(f"Expected a DAR model (model_type 'dar' or 'dar_moe'), got {type(model).__name__} of "
                        f"model_type {getattr(getattr(model, 'config', None), 'model_type', None)!r}.")
    branches = []  # the layers the forward runs (`num_hidden_layers` may be lowered to run fewer, as an early exit)
    for layer_index, layer in enumerate(islice(base.layers, base.config.num_hidden_layers)):
        for kind, residual in (("attn", layer.attn_residual), ("mlp", layer.mlp_residual)):
            branches.append(
                DARBranchModules(
                    f"L{layer_index}.{kind}", residual.branch_index, residual.depth_attention, residual.read_gate,
                    residual.write_gate,
                )
            )
    readout = base.final_readout
    branches.append(DARBranchModules(READOUT, None, readout.depth_attention, readout.read_gate, None))
    return branches


def over_real_tokens(tensor: torch.Tensor, tokens: torch.Tensor | None, dim: int = 0) -> torch.Tensor:
    """`tensor` whose dimensions `dim`, `dim + 1` are [B, T], with those two made one of the real tokens [N]
    (`tokens`: [B, T] bool, the real ones; None: every token)."""
    if tokens is None:
        return tensor.flatten(dim, dim + 1)
    return tensor[(slice(None),) * dim + (tokens.to(tensor.device),)]


def _source_statistics(sources: torch.Tensor, tokens: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor | None]:
    """sources [S, B, T, J, D], tokens [B, T] (bool: the real ones; None: every token) -> mean RMS of every source
    and stream over the real tokens [S, J], and the mean cross-stream cosine of every source [S] (None for one
    stream)."""
    sources = over_real_tokens(sources, tokens, dim=1)  # [S, N, J, D]
    entry_rms = sources.pow(2).mean(-1).sqrt().mean(1)  # [S, J]
    if sources.shape[-2] < 2:
        return entry_rms, None
    cosine = F.cosine_similarity(sources[..., 0, :], sources[..., 1, :], dim=-1).mean(1)  # [S]
    return entry_rms, cosine


@contextmanager
def record_depth_reads(
    model: torch.nn.Module,
    interventions: dict[str, Callable[[torch.Tensor], torch.Tensor]] | None = None,
    tokens: torch.Tensor | None = None,
) -> Iterator[dict[str, DepthRead]]:
    """Run `model` through its reference backend and record every depth read (keyed by branch name).

    interventions: branch name -> function of the read's extraction [B, T, J, D] returning the extraction the branch
    should use instead (the recorded `extracted` stays the original). Without interventions the outputs are the
    model's own (the reference backend agrees with the fast path to fp32 rounding; DESIGN.md section 4).
    tokens: [B, T] bool, the real tokens (not padding) the readout's entry statistics average over; None: all.
    """
    interventions = interventions or {}
    reads: dict[str, DepthRead] = {}
    branches = dar_branches(model)
    unknown = set(interventions) - {branch.name for branch in branches}
    if unknown:
        raise KeyError(f"No depth read named {sorted(unknown)}; names are L<layer>.attn, L<layer>.mlp, {READOUT}.")
    configs = {
        id(module.config): module.config
        for module in model.modules()
        if is_dar_config(getattr(module, "config", None))
    }
    previous = {key: config.dar_implementation for key, config in configs.items()}

    def recorder(branch: DARBranchModules):
        def record(module, args, output):
            sources, (extracted, weights) = args[0], output  # [S, B, T, J, D]; [B, T, J, D], [S, B, T, J]
            read = DepthRead(branch.name, weights.detach(), extracted.detach())
            if branch.name == READOUT:
                read.entry_rms, read.entry_cosine = _source_statistics(sources.detach(), tokens)
            reads[branch.name] = read
            intervention = interventions.get(branch.name)
            return None if intervention is None else (intervention(extracted), weights)

        return record

    handles = []
    try:
        for config in configs.values():
            config.dar_implementation = "reference"
        handles = [branch.depth_attention.register_forward_hook(recorder(branch)) for branch in branches]
        yield reads
    finally:
        for handle in handles:
            handle.remove()
        for key, config in configs.items():
            config.dar_implementation = previous[key]


# ---------------------------------------------------------------------------------------------------------------
# The analyses


def token_losses(logits: torch.Tensor, input_ids: torch.Tensor) -> torch.Tensor:
    """Next-token cross-entropy per predicted token: logits [B, T, V], input_ids [B, T] -> [B, T - 1]."""
    return F.cross_entropy(_upcast(logits[:, :-1].transpose(1, 2)), input_ids[:, 1:], reduction="none")


def mean_loss(logits: torch.Tensor, input_ids: torch.Tensor, predicted: torch.Tensor) -> float:
    """The mean next-token loss over the `predicted` positions ([B, T - 1] bool, `predicted_tokens`)."""
    return token_losses(logits, input_ids)[predicted].mean().item()


def real_tokens(input_ids: torch.Tensor, attention_mask: torch.Tensor | None = None) -> torch.Tensor:
    """[B, T] bool: the tokens every analysis averages over, the attention mask's ones (every token without one).
    Padding would otherwise enter every mean: a pad token's reads, its extractions in CKA, its loss."""
    if attention_mask is None:
        return torch.ones(input_ids.shape, dtype=torch.bool, device=input_ids.device)
    return torch.as_tensor(attention_mask).bool()


def check_analysed_batch(input_ids: torch.Tensor, attention_mask) -> torch.Tensor | None:
    """Refuse, naming the problem, a batch the analyses cannot average over (sequences of one token, a mask of
    another shape or of values other than 0 and 1, no two real tokens in a row); returns the mask as a tensor."""
    if input_ids.dim() != 2 or input_ids.shape[1] < 2:
        raise ValueError(f"The analyses take input_ids [batch, tokens] with at least 2 tokens per sequence (the loss "
                         f"and the rescue gain compare next-token predictions); got shape {list(input_ids.shape)}.")
    if attention_mask is None:
        return None
    attention_mask = torch.as_tensor(attention_mask, device=input_ids.device)
    if attention_mask.shape != input_ids.shape:
        raise ValueError(f"attention_mask has shape {list(attention_mask.shape)}; input_ids has "
                         f"{list(input_ids.shape)}: they must match (a [batch, tokens] mask, 1 for real tokens).")
    if not ((attention_mask == 0) | (attention_mask == 1)).all():
        raise ValueError("attention_mask must hold 0 (padding) and 1 (real tokens) only, as a tokenizer's does.")
    if not predicted_tokens(attention_mask.bool()).any():
        raise ValueError("attention_mask leaves no sequence two real tokens in a row: nothing to predict.")
    return attention_mask


def predicted_tokens(tokens: torch.Tensor) -> torch.Tensor:
    """[B, T] real tokens -> [B, T - 1] bool: the positions whose input and next token are both real, those that
    `token_losses` and the rescue distances average over."""
    return tokens[:, :-1] & tokens[:, 1:]


def model_inputs(input_ids: torch.Tensor, attention_mask: torch.Tensor | None) -> dict:
    """The forward's inputs: with a mask, the positions count real tokens only (as `generate` counts them), so a
    left-padded sequence is computed at the positions it has alone."""
    if attention_mask is None:
        return {"input_ids": input_ids}
    position_ids = (attention_mask.long().cumsum(-1) - 1).clamp_min(0)  # [B, T]
    return {"input_ids": input_ids, "attention_mask": attention_mask, "position_ids": position_ids}


def depth_weight_maps(reads: dict[str, DepthRead], branches: list[DARBranchModules], config: DARConfig,
                      tokens: torch.Tensor | None = None) -> dict:
    """Mean depth weight per (branch, stream, source) and mean per-token entropy, over the real tokens ([B, T]
    bool; None: every token).

    Sources are laid out on a common axis: committed entries 0..E-1 (0 = embedding, e = block e's sum, or branch
    e's output for Full DAR), then one column for the current partial block (empty where a read has none).
    """
    num_committed = 1 + math.ceil(config.dar_num_branches / config.dar_block_size)
    streams = config.dar_num_streams
    maps = torch.full((streams, len(branches), num_committed + 1), float("nan"))  # [J, M + 1, E + 1]
    entropy = torch.zeros(streams, len(branches))  # [J, M + 1]
    normalised_entropy = torch.zeros(streams, len(branches))  # [J, M + 1]
    for row, branch in enumerate(branches):
        weights = over_real_tokens(reads[branch.name].weights.float(), tokens, dim=1)  # [S, B, T, J] -> [S, N, J]
        num_sources = weights.shape[0]
        if branch.branch_index is None:
            committed, has_partial = num_sources, False
        else:
            committed = 1 + branch.branch_index // config.dar_block_size
            has_partial = config.dar_include_partial and branch.branch_index % config.dar_block_size != 0
        if committed + int(has_partial) != num_sources:
            raise RuntimeError(f"{branch.name}: {num_sources} sources, expected {committed} + partial {has_partial}.")
        mean = weights.mean(1).T  # [J, S]
        maps[:, row, :committed] = mean[:, :committed]
        if has_partial:
            maps[:, row, -1] = mean[:, -1]
        token_entropy = -(weights * weights.clamp_min(1e-30).log()).sum(0)  # [N, J]
        entropy[:, row] = token_entropy.mean(0)
        normalised_entropy[:, row] = entropy[:, row] / math.log(num_sources) if num_sources > 1 else 0.0
    return {
        "source_labels": [f"e{index}" for index in range(num_committed)] + ["partial"],
        "mean_weight": _nan_to_none(maps.tolist()),
        "entropy_nats": entropy.tolist(),
        "entropy_normalised": normalised_entropy.tolist(),
    }


def cross_stream_cka(reads: dict[str, DepthRead], branches: list[DARBranchModules], max_tokens: int = 1024,
                     tokens: torch.Tensor | None = None) -> dict:
    """CKA[m][n] = CKA(x^0_m, x^1_n) over the real tokens ([B, T] bool; None: every token), for every pair of depth
    reads (rows stream 0, columns stream 1).

    Uses at most `max_tokens` tokens (the same random subset at every depth) to bound the cost on large models.
    """
    flat = [over_real_tokens(reads[branch.name].extracted, tokens) for branch in branches]  # each [N, J, D]
    _require_two_streams(flat[0].shape[1], "cross_stream_cka")
    count = flat[0].shape[0]
    if count > max_tokens:
        keep = torch.randperm(count, generator=torch.Generator().manual_seed(0))[:max_tokens]
        flat = [x[keep] for x in flat]
    matrix = cka_matrix([x[:, 0] for x in flat], [x[:, 1] for x in flat])  # [M + 1, M + 1]
    # The same comparison inside stream 0, the reference for "how similar are different depths anyway".
    within = cka_matrix([x[:, 0] for x in flat], [x[:, 0] for x in flat])  # [M + 1, M + 1]
    # A read of one source (the first branch's: the embedding alone; every read before the first commit without
    # `dar_include_partial`) gives both streams the same entry, scaled: the CKA of two such reads is 1 by
    # construction, says nothing about the streams or the depths, and is left out of the means.
    mixed = torch.tensor([reads[branch.name].weights.shape[0] > 1 for branch in branches])
    off = ~torch.eye(len(flat), dtype=torch.bool) & (mixed[:, None] | mixed[None, :])  # [M + 1, M + 1]
    matched = matrix.diagonal()
    return {
        "tokens": int(flat[0].shape[0]),
        "matrix": _nan_to_none(matrix.tolist()),  # None: a read constant over the tokens (CKA undefined)
        "matched_depth": _nan_to_none(matched.tolist()),
        "matched_depth_mean": float(matched[mixed].nanmean()) if mixed.any() else float("nan"),  # reads of 2+ sources
        "off_diagonal_mean": float(matrix[off].nanmean()) if off.any() else float("nan"),
        "within_stream0_off_diagonal_mean": float(within[off].nanmean()) if off.any() else float("nan"),
    }


def _require_two_streams(streams: int, analysis: str) -> None:
    if streams < 2:
        raise ValueError(f"{analysis} compares the two residual streams; this model has {streams} (dar_num_streams=1: "
                         "Attention Residuals). `analyze` leaves it out for such a model.")


@torch.no_grad()
def rescue_gain(
    model: torch.nn.Module,
    input_ids: torch.Tensor,
    branch_names: list[str] | None = None,
    clean_logits: torch.Tensor | None = None,
    clean_reads: dict[str, DepthRead] | None = None,
    attention_mask: torch.Tensor | None = None,
) -> dict:
    """The rescue-gain intervention at each named depth read (default: every read).

    For a read m: the clean run gives logits z and extractions x^j_m. The corrupted run replaces both x^0_m and x^1_m
    of sequence b by those of sequence b - 1 (a real state of another input; the batch rolled by one, so B >= 2).
    The restore-j run keeps stream j's own clean extraction and corrupts the other. With d(z') the mean over
    predicted tokens of ||z' - z||^2 and L the mean next-token loss:

      rescue_gain_j      = 1 - d(restore j) / d(corrupted)          (logit distance; 1 = stream j alone restores all)
      rescue_gain_loss_j = (L(corrupted) - L(restore j)) / (L(corrupted) - L(clean))

    Only read m's extraction is replaced; the model runs as it is otherwise, so the reads after m see what the
    changed branch m made. With `attention_mask`, a position is corrupted where its own token and its donor's are
    real (not padding), and d and L average over the predicted positions of real tokens.
    """
    if input_ids.shape[0] < 2:
        raise ValueError("rescue_gain needs a batch of at least 2 sequences (the donor is another sequence).")
    attention_mask = check_analysed_batch(input_ids, attention_mask)
    config = model.get_base_model().config if hasattr(model, "get_base_model") else model.config
    _require_two_streams(config.dar_num_streams, "rescue_gain")
    tokens = real_tokens(input_ids, attention_mask)  # [B, T]
    predicted = predicted_tokens(tokens)  # [B, T - 1]
    swapped = tokens & tokens.roll(1, dims=0)  # [B, T]: own token and donor's real

    def run(interventions=None) -> tuple[torch.Tensor, dict[str, DepthRead]]:
        with record_depth_reads(model, interventions, tokens) as reads:
            return _upcast(model(**model_inputs(input_ids, attention_mask)).logits), reads

    def distance(logits: torch.Tensor) -> float:  # mean over predicted real tokens of ||z' - z||^2
        return (logits - clean_logits)[:, :-1].pow(2).sum(-1)[predicted].mean().item()

    if clean_logits is None or clean_reads is None:
        clean_logits, clean_reads = run()
    clean_loss = mean_loss(clean_logits, input_ids, predicted)
    clean_scale = clean_logits[:, :-1].pow(2).sum(-1)[predicted].mean().item()  # d's scale: the clean logits' own
    names = branch_names or [branch.name for branch in dar_branches(model)]
    results, moved = {}, []  # moved: the reads whose corruption changed the output
    for name in names:
        donor = clean_reads[name].extracted.roll(1, dims=0)  # [B, T, J, D]: sequence b - 1's extraction

        def corrupt(streams: tuple[int, ...]) -> Callable[[torch.Tensor], torch.Tensor]:
            def intervention(extracted: torch.Tensor) -> torch.Tensor:
                changed = extracted.clone()  # [B, T, J, D]
                where = swapped.to(extracted.device)[..., None, None]  # [B, T, 1, 1]
                changed[..., list(streams), :] = torch.where(
                    where, donor[..., list(streams), :].to(changed.dtype), extracted[..., list(streams), :])
                return changed

            return intervention

        outcome = {}
        for label, streams in (("corrupted", (0, 1)), ("restore0", (1,)), ("restore1", (0,))):
            logits, _ = run({name: corrupt(streams)})
            outcome[label] = (distance(logits), mean_loss(logits, input_ids, predicted))
        corrupted_distance, corrupted_loss = outcome["corrupted"]
        # The donor's state changed nothing but rounding (identical sequences): each ratio would be rounding noise
        # over rounding noise, so the gains are NaN and the pooled sums leave the read out (its distances are kept
        # as measured).
        changed = corrupted_distance > DEGENERATE_CORRUPTION * clean_scale
        if changed:
            moved.append(name)
        entry = {
            "logit_distance_corrupted": corrupted_distance, "loss_clean": clean_loss, "loss_corrupted": corrupted_loss
        }
        for stream in (0, 1):
            restored_distance, loss = outcome[f"restore{stream}"]
            entry[f"logit_distance_restore{stream}"] = restored_distance
            entry[f"loss_restore{stream}"] = loss
            entry[f"rescue_gain{stream}"] = 1.0 - restored_distance / corrupted_distance if changed else float("nan")
            damage = corrupted_loss - clean_loss
            entry[f"rescue_gain_loss{stream}"] = (
                (corrupted_loss - loss) / damage if damage != 0 and changed else float("nan")
            )
        results[name] = entry
    exact = dict(dtype=torch.float64)  # the per-read figures are Python floats: no float32 rounding of them here
    gains = torch.tensor([[results[n]["rescue_gain0"], results[n]["rescue_gain1"]] for n in names], **exact)  # [M', 2]
    corrupted = torch.tensor([results[n]["logit_distance_corrupted"] for n in moved], **exact)  # [M'']
    restored = torch.tensor([[results[n][f"logit_distance_restore{j}"] for j in (0, 1)] for n in moved], **exact)
    # Pooled over reads: 1 - sum_m d_m(restore j) / sum_m d_m(corrupted). Reads whose corruption barely moves the
    # output (where the per-read ratio is noise) weigh little; this is the headline number.
    pooled = 1.0 - restored.sum(0) / corrupted.sum() if moved else torch.full((2,), math.nan)  # [2]
    return {
        "definition": "rescue_gain_j = 1 - d(restore j)/d(corrupted), d = mean squared logit distance to the clean run",
        "branches": results,
        "mean_rescue_gain": gains.nanmean(0).tolist(),
        "median_rescue_gain": numpy.nanmedian(gains.numpy(), axis=0).tolist(),  # torch's: the lower middle value
        "pooled_rescue_gain": pooled.tolist(),
        # balance in [0, 1]: 1 when both streams rescue equally, 0 when one stream rescues nothing.
        "pooled_balance": float((pooled.min() / pooled.max().clamp_min(1e-12)).clamp(0, 1)),
        "mean_balance": float((gains.min(1).values / gains.max(1).values.clamp_min(1e-12)).clamp(0, 1).nanmean()),
    }


def stream_balance(reads: dict[str, DepthRead], branches: list[DARBranchModules], config: DARConfig,
                   tokens: torch.Tensor | None = None) -> dict:
    """Norms of the streams' entries, their cross-stream cosine, read-gate alpha, write-gate spread and rho; token
    averages over the real tokens ([B, T] bool; None: every token)."""
    readout = reads[READOUT]

    balance = {
        "entry_rms": readout.entry_rms.tolist(),  # [S][J]
        "entry_cross_stream_cosine": readout.entry_cosine.tolist() if readout.entry_cosine is not None else None,
        # as the branch receives it: count-scaled, N x the weighted mean of the read's N sources
        "extraction_rms": [over_real_tokens(reads[b.name].extracted, tokens).pow(2).mean(-1).sqrt().mean(0).tolist()
                           for b in branches],  # [N, J, D] -> [J] each
    }
    if config.dar_num_streams == 2:
        balance["alpha"] = [torch.sigmoid(b.read_gate.logit.detach().float()).item() for b in branches]
        writers = [b.write_gate for b in branches if b.write_gate is not None]
        beta = [config.dar_write_scale * torch.sigmoid(gate.logit.detach().float()) for gate in writers]  # [J, D] each
        balance["beta_mean"] = [gate.mean(-1).tolist() for gate in beta]
        # spread: mean |beta^0 - beta^1| / c per channel (0: identical gates, 1: each channel written to one stream)
        balance["beta_spread"] = [((gate[0] - gate[1]).abs().mean() / config.dar_write_scale).item() for gate in beta]
        # rho exists only where a partial block is carried (not at a block's first branch): None there.
        balance["rho"] = [
            torch.sigmoid(gate.transport_logit.detach().float()).item() if not gate.starts_block else None
            for gate in writers
        ]
    return balance


@torch.no_grad()
def analyze(model: torch.nn.Module, input_ids: torch.Tensor, rescue_branches: list[str] | None = None,
            attention_mask: torch.Tensor | None = None) -> dict:
    """Every analysis on one batch of token ids [B, T] (in eval mode; the model's mode is restored after);
    returns a JSON-serialisable summary. A padded batch needs its `attention_mask` (a tokenizer's, [B, T], 1 for
    real tokens): every average is then over the real tokens only, and the positions count real tokens."""
    attention_mask = check_analysed_batch(input_ids, attention_mask)
    training = model.training
    model.eval()
    try:
        return _analyze(model, input_ids, rescue_branches, attention_mask)
    finally:
        model.train(training)


def _analyze(model: torch.nn.Module, input_ids: torch.Tensor, rescue_branches: list[str] | None,
             attention_mask: torch.Tensor | None) -> dict:
    config = model.config
    branches = dar_branches(model)
    tokens = real_tokens(input_ids, attention_mask)  # [B, T]
    predicted = predicted_tokens(tokens)  # [B, T - 1]
    with record_depth_reads(model, tokens=tokens) as reads:
        logits = _upcast(model(**model_inputs(input_ids, attention_mask)).logits)
    summary = {
        "model_type": config.model_type,
        "num_streams": config.dar_num_streams,
        "block_size": config.dar_block_size,
        "routing": config.dar_routing,
        "num_hidden_layers": config.num_hidden_layers,
        "tokens": int(tokens.sum()),  # real tokens (padding left out)
        "predicted_tokens": int(predicted.sum()),  # positions the loss averages over
        "batch": list(input_ids.shape),
        "loss": mean_loss(logits, input_ids, predicted),
        "branches": [branch.name for branch in branches],
        "depth_weights": depth_weight_maps(reads, branches, config, tokens),
        "stream_balance": stream_balance(reads, branches, config, tokens),
    }
    if config.dar_num_streams == 2:
        summary["cross_stream_cka"] = cross_stream_cka(reads, branches, tokens=tokens)
        summary["rescue_gain"] = rescue_gain(model, input_ids, rescue_branches, logits, reads, attention_mask)
    else:
        logger.info("One-stream model: cross-stream CKA and rescue gain need two streams and are skipped.")
    return summary


# ---------------------------------------------------------------------------------------------------------------
# Plots (matplotlib, Agg backend, saved files only)


def save_plots(summary: dict, out_dir: Path) -> list[Path]:
    """Heatmaps and bar charts of a summary from `analyze` in `out_dir` (made if missing); returns the PNG paths. A
    file of a plot's name is replaced; a symbolic link of that name is replaced by the plot, its target untouched (it
    was written through: a link to a file outside the folder got the PNG's bytes)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    names = summary["branches"]
    written = []

    def finish(figure, filename: str) -> None:
        figure.tight_layout()
        path = out_dir / filename
        if path.is_symlink():
            path.unlink()
        figure.savefig(path, dpi=120)
        plt.close(figure)
        written.append(path)

    maps = summary["depth_weights"]
    for stream, rows in enumerate(maps["mean_weight"]):
        values = torch.tensor([[math.nan if v is None else v for v in row] for row in rows])
        figure, axis = plt.subplots(figsize=(1.2 + 0.45 * values.shape[1], 1.2 + 0.3 * values.shape[0]))
        image = axis.imshow(values.numpy(), cmap="viridis", vmin=0.0, aspect="auto")
        axis.set_xticks(range(len(maps["source_labels"])), maps["source_labels"], rotation=90, fontsize=7)
        axis.set_yticks(range(len(names)), names, fontsize=7)
        axis.set_xlabel("depth source")
        axis.set_title(f"stream {stream}: mean depth weight", fontsize=9)
        figure.colorbar(image, ax=axis)
        finish(figure, f"depth_weights_stream{stream}.png")

    figure, axis = plt.subplots(figsize=(6, 3))
    for stream, values in enumerate(maps["entropy_normalised"]):
        axis.plot(range(len(names)), values, marker="o", label=f"stream {stream}")
    axis.set_xticks(range(len(names)), names, rotation=90, fontsize=7)
    axis.set_ylabel("entropy / log N")
    axis.set_ylim(0, 1.05)
    axis.legend()
    finish(figure, "depth_entropy.png")

    if "cross_stream_cka" in summary:
        matrix = torch.tensor([[math.nan if value is None else value for value in row]
                               for row in summary["cross_stream_cka"]["matrix"]])  # None: undefined, drawn blank
        figure, axis = plt.subplots(figsize=(2 + 0.3 * len(names), 1.5 + 0.3 * len(names)))
        image = axis.imshow(matrix.numpy(), cmap="magma", vmin=0.0, vmax=1.0)
        axis.set_xticks(range(len(names)), names, rotation=90, fontsize=7)
        axis.set_yticks(range(len(names)), names, fontsize=7)
        axis.set_xlabel("stream 1 extraction x^1 at depth")
        axis.set_ylabel("stream 0 extraction x^0 at depth")
        axis.set_title("cross-stream linear CKA", fontsize=9)
        figure.colorbar(image, ax=axis)
        finish(figure, "cross_stream_cka.png")

        gains = summary["rescue_gain"]["branches"]
        rescue_names = list(gains)
        figure, axis = plt.subplots(figsize=(max(4, 0.35 * len(rescue_names)), 3))
        positions = torch.arange(len(rescue_names)).float()
        for stream, offset in ((0, -0.2), (1, 0.2)):
            axis.bar(positions + offset, [gains[n][f"rescue_gain{stream}"] for n in rescue_names], 0.4,
                     label=f"restore stream {stream}")
        axis.set_xticks(positions.tolist(), rescue_names, rotation=90, fontsize=7)
        axis.set_ylabel("rescue gain (logit distance)")
        axis.axhline(0, color="black", linewidth=0.5)
        axis.legend(fontsize=7)
        finish(figure, "rescue_gain.png")

    balance = summary["stream_balance"]
    panels = 3 if "alpha" in balance else 1
    figure, axes = plt.subplots(1, panels, figsize=(4 * panels, 3), squeeze=False)
    rms = torch.tensor(balance["entry_rms"])  # [S, J]
    for stream in range(rms.shape[1]):
        axes[0][0].plot(rms[:, stream].numpy(), marker="o", label=f"stream {stream}")
    axes[0][0].set_xlabel("committed entry")
    axes[0][0].set_ylabel("mean RMS")
    axes[0][0].set_yscale("log")
    axes[0][0].legend(fontsize=7)
    if panels == 3:
        axes[0][1].plot(balance["alpha"], marker="o")
        axes[0][1].axhline(0.5, color="grey", linewidth=0.5)
        axes[0][1].set_ylim(0, 1)
        axes[0][1].set_xlabel("depth read")
        axes[0][1].set_ylabel("read gate alpha")
        axes[0][2].plot(balance["beta_spread"], marker="o")
        axes[0][2].ticklabel_format(axis="y", useOffset=False)
        axes[0][2].set_xlabel("branch")
        axes[0][2].set_ylabel("write-gate spread mean|beta0-beta1|/c")
    finish(figure, "stream_balance.png")
    return written


# ---------------------------------------------------------------------------------------------------------------
# Command line


def evenly_spaced(names: list[str], count: int) -> list[str]:
    """At most `count` names spread over the depth, keeping the first, and the last where count > 1."""
    if count <= 0 or count >= len(names):
        return list(names)
    picks = sorted({round(index * (len(names) - 1) / (count - 1)) for index in range(count)}) if count > 1 else [0]
    return [names[index] for index in picks]


def text_batch(tokenizer, text: str, num_sequences: int, seq_len: int) -> torch.Tensor:
    """The first num_sequences x seq_len tokens of `text` as [B, T] (fewer sequences if the text is short)."""
    window = num_sequences * seq_len * 16  # characters: enough for most tokenizers; grown where tokens are longer
    while True:
        ids = tokenizer(text[:window], add_special_tokens=False)["input_ids"]
        if len(ids) > num_sequences * seq_len or window >= len(text):
            break
        window *= 4
    available = len(ids) // seq_len
    if available < 2:
        raise ValueError(f"The text gives {len(ids)} tokens; the analysis needs at least 2 x {seq_len}.")
    if available < num_sequences:
        logger.warning(f"The text gives only {available} sequences of {seq_len} tokens (asked for {num_sequences}).")
    count = min(available, num_sequences)
    return torch.tensor(ids[: count * seq_len]).view(count, seq_len)


def check_token_ids(input_ids: torch.Tensor, vocab_size: int, tokenizer_name: object) -> None:
    """Refuse token ids the model has no embedding for (a tokenizer of another model), naming both sizes; else the
    embedding raised a bare IndexError."""
    largest = int(input_ids.max()) if input_ids.numel() else -1
    if largest >= vocab_size:
        raise ValueError(f"the tokenizer of {tokenizer_name} gives token id {largest}, but the model's vocabulary has "
                         f"{vocab_size} ids (vocab_size): a tokenizer of another model? Pass the model's own.")


def at_least(minimum, kind=int, maximum=None):
    """An argparse type: a finite `kind` value of at least `minimum` (and at most `maximum`, if given), else the usual
    one-line usage error naming both ("nan" and "inf" parse as floats and compare false or true to anything)."""

    def parse(text: str):
        value = kind(text)
        if not math.isfinite(value):
            raise argparse.ArgumentTypeError(f"{text} is not a finite number")
        if value < minimum:
            raise argparse.ArgumentTypeError(f"{text} is below {minimum}, the least it takes")
        if maximum is not None and value > maximum:
            raise argparse.ArgumentTypeError(f"{text} is above {maximum}, the most it takes")
        return value

    parse.__name__ = kind.__name__  # argparse names the type in its "invalid ... value" message
    return parse


def given_path(text: str) -> Path:
    """A path named on the command line: "~" expanded (quoted, the shell left it; `--out=~/x` too), where it was
    written into a folder named "~" in the working directory while the message named the home folder; an empty one
    (an unset shell variable) refused, where `Path("")` was the working directory."""
    if not text.strip():
        raise argparse.ArgumentTypeError("an empty path (an unset shell variable?); name the file or folder")
    return Path(os.path.expanduser(text))


given_path.__name__ = "path"  # argparse names the type in its "invalid ... value" message


def add_arguments(parser: argparse.ArgumentParser) -> argparse.ArgumentParser:
    """The `analyze` arguments (shared by `dar analyze` and `python -m dar_transformers.analysis`)."""
    parser.add_argument("model", help="a DAR checkpoint directory (or anything from_pretrained accepts locally)")
    parser.add_argument("--text", type=given_path, required=True, help="a UTF-8 text file to run the model on")
    parser.add_argument("--out", type=given_path, required=True, help="output directory for summary.json and the PNGs")
    parser.add_argument("--tokenizer", help="tokenizer location if the checkpoint has none")
    parser.add_argument("--seq-len", type=at_least(2), default=256, help="at least 2 (a next-token loss)")
    parser.add_argument("--num-sequences", type=at_least(2), default=8, help="at least 2 (rescue gain compares them)")
    parser.add_argument("--max-rescue-branches", type=at_least(0), default=16,
                        help="rescue gain at this many depth reads spread over the depth (0 = all)")
    parser.add_argument("--dtype", default="float32", choices=("float32", "float64", "bfloat16"))
    parser.add_argument("--trust-remote-code", action="store_true")
    parser.add_argument("--overwrite", action="store_true",
                        help="replace the files of an earlier analysis in --out (never anything else there)")
    return parser


# The staging folder an analysis writes into inside --out before its files are put in place (`write_analysis`).
ANALYSIS_STAGING_PREFIX, ANALYSIS_STAGING_SUFFIX = ".dar-analyze.", ".partial"

# What an analysis writes into --out: the summary and the plots of `save_plots`.
ANALYSIS_FILES = ("summary.json", "depth_weights_stream[0-9].png", "depth_entropy.png", "cross_stream_cka.png",
                  "rescue_gain.png", "stream_balance.png")


def check_analysis_output(out: Path, overwrite: bool) -> list[str]:
    """Before any work: refuse an --out that cannot be a folder the analysis writes into (a file, a path under a
    file, a folder or nearest existing parent it may not write), and one that already holds entries of the names an
    analysis writes (`ANALYSIS_FILES`: an earlier analysis's, or the user's own; symbolic links too, dangling or not)
    unless `overwrite`, naming them. Returns those names: with `overwrite` they are replaced once the new analysis is
    written (`write_analysis`), a link by a file (its target untouched), and those the new analysis does not write
    again (another stream count, no rescue branches) are removed then, so that the folder holds one analysis. Other
    entries are never touched, and a failed run touches none."""
    if os.path.lexists(out) and not out.is_dir():
        raise ValueError(f"--out {out} exists and is not a folder")
    existing = out
    while not os.path.lexists(existing) and existing != existing.parent:
        existing = existing.parent  # the nearest existing parent: the folders below it are made
    if not existing.is_dir():
        raise ValueError(f"--out {out}: {existing} is not a folder, so no folder can be made under it")
    if not os.access(existing, os.W_OK | os.X_OK):
        raise ValueError(f"--out {out}: {'the folder' if existing == out else f'its parent {existing}'} is not "
                         "writable")
    if not out.is_dir():
        return []
    taken = sorted(name for name in os.listdir(out)
                   if any(fnmatch.fnmatch(name, pattern) for pattern in ANALYSIS_FILES))
    folders = [name for name in taken if stat.S_ISDIR(os.lstat(out / name).st_mode)]
    if folders:  # never removed: it is not a file an analysis wrote
        these = "them" if len(folders) > 1 else "it"
        raise ValueError(f"--out {out} holds {'folders' if len(folders) > 1 else 'a folder'} named "
                         f"{', '.join(folders)}, where the analysis writes a file; move {these} away or pass another "
                         "--out.")
    if taken and not overwrite:
        raise ValueError(f"--out {out} already holds {', '.join(taken)}, which the analysis would replace; pass "
                         "--overwrite to replace them (nothing else in the folder is touched), or another --out.")
    return taken


@contextmanager
def output_folder(out: Path) -> Iterator[None]:
    """--out made now, with its missing parents, before any work (a path the user may not make, such as one under
    /proc, fails here, naming it); the folders made are removed again, if still empty, when the run fails."""
    made = []
    try:
        for folder in reversed([out, *out.parents]):
            if not os.path.lexists(folder):
                folder.mkdir()
                made.append(folder)
    except OSError as error:
        remove_empty_folders(made)
        raise ValueError(f"--out {out}: cannot make the folder {error.filename} ({error.strerror})") from error
    try:
        yield
    except BaseException:
        remove_empty_folders(made)
        raise


def remove_empty_folders(made: list[Path]) -> None:
    for folder in reversed(made):
        try:
            folder.rmdir()  # only an empty one: never what the user put there meanwhile
        except OSError:
            return


def write_analysis(out: Path, summary: dict, replaced: list[str]) -> list[Path]:
    """Write the summary and the plots into a hidden staging folder inside `out`, then put them in place: the earlier
    analysis's files (`replaced`, and any of the new files' names) are moved aside into the staging folder, the new
    ones moved in (a link is replaced, not written through), and the staging folder with the earlier files is removed.
    A failure while writing (a full disk) or while moving (an error, or a signal: held meanwhile) leaves `out` as it
    was; returns the PNGs' paths."""
    staging = Path(tempfile.mkdtemp(prefix=ANALYSIS_STAGING_PREFIX, suffix=ANALYSIS_STAGING_SUFFIX, dir=out))
    try:
        (staging / "summary.json").write_text(json.dumps(_nan_to_none(summary), indent=1, allow_nan=False))
        staged = [staging / "summary.json", *save_plots(summary, staging)]
        earlier = staging / "replaced"
        earlier.mkdir()
    except BaseException as error:
        shutil.rmtree(staging)
        if not isinstance(error, OSError):
            raise
        raise ValueError(f"--out {out}: could not write the analysis ({error.strerror or error}); nothing in it was "
                         "changed") from error
    names = [path.name for path in staged]
    moved_aside, moved_in = [], []

    def undo() -> str | None:  # every move back, as far as each goes; what failed, the earlier files kept in `earlier`
        failed = []
        for source, target in [*((out / name, staging / name) for name in reversed(moved_in)),
                               *((earlier / name, out / name) for name in reversed(moved_aside))]:
            try:
                os.replace(source, target)
            except OSError as error:
                failed.append(f"{target.name} ({error.strerror or error})")
        if failed:
            return (f"--out {out}: could not put the analysis in place, nor move back {', '.join(failed)}: the "
                    f"earlier analysis's files are in {earlier}; move them back into --out.")
        shutil.rmtree(staging)
        return None

    written = False  # for an interrupt: False (out as it was), True (the analysis in place), None (neither)
    try:
        with signals_held() as received:  # a few renames: an interrupt waits for them and their undoing
            aside = sorted(name for name in {*replaced, *names} if os.path.lexists(out / name))
            try:
                for name in aside:
                    if stat.S_ISDIR(os.lstat(out / name).st_mode):  # made since it was checked: never removed
                        raise IsADirectoryError(errno.EISDIR, "a folder where the analysis writes a file",
                                                str(out / name))
                    os.replace(out / name, earlier / name)
                    moved_aside.append(name)
                for name in names:
                    os.replace(staging / name, out / name)
                    moved_in.append(name)
            except OSError as error:
                failure = undo()
                if failure and received:  # the interrupt, raised as the block ends, replaces the error: said now
                    logger.error(failure)
                    written = None
                raise ValueError(failure or f"--out {out}: could not put the analysis in place "
                                 f"({error.strerror or error}); nothing in it was changed") from error
            if received:  # raised as the block ends: an analysis interrupted before it was in place changes nothing
                failure = undo()
                if failure:
                    logger.error(failure)
                    written = None
                return []
            written = True
            shutil.rmtree(staging)  # the earlier analysis's files and links (never a link's target; folders refused)
    except KeyboardInterrupt as interrupt:  # the held one, raised as the block ends: `dar analyze` says where --out
        if written is not None:  # stands (the analysis in place, or out as it was)
            interrupt.output_written = written
        raise
    for name in sorted(set(replaced) - set(names)):
        logger.info(f"removed {out / name} (of the analysis this one replaces)")
    return [out / name for name in names[1:]]


def stale_staging_folders(out: Path) -> list[Path]:
    """Staging folders of analyses into `out` that did not finish (killed: SIGKILL, the out-of-memory killer), or
    that run now; named on the log, never removed (another analysis may be writing into one)."""
    if not out.is_dir():
        return []
    return sorted(entry for entry in out.iterdir() if entry.name.startswith(ANALYSIS_STAGING_PREFIX)
                  and entry.name.endswith(ANALYSIS_STAGING_SUFFIX) and entry.is_dir() and not entry.is_symlink())


def load_analysed_model(args: argparse.Namespace):
    """(model, tokenizer) of `args.model`, checked for DAR by its config before the weights are read, each load's
    failure one line naming the folder (a truncated safetensors file, a config its class refuses)."""
    from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer

    from .cli import load_error, model_location

    location = model_location(str(args.model))
    try:
        config = AutoConfig.from_pretrained(location, trust_remote_code=args.trust_remote_code)
    except Exception as error:
        raise ValueError(f"cannot load the config of {args.model}: {load_error(error)}") from error
    if not is_dar_config(config):
        raise ValueError(f"Expected a DAR model (model_type 'dar' or 'dar_moe'), got {args.model} of model_type "
                         f"{getattr(config, 'model_type', None)!r}.")
    tokenizer_location = model_location(str(args.tokenizer)) if args.tokenizer else location
    try:
        tokenizer = AutoTokenizer.from_pretrained(tokenizer_location)
    except Exception as error:  # a checkpoint saved without its tokenizer, most often
        hint = "" if args.tokenizer else " (a checkpoint saved without one: pass --tokenizer)"
        raise ValueError(f"cannot load a tokenizer from {args.tokenizer or args.model}{hint}: "
                         f"{load_error(error)}") from error
    try:
        model = AutoModelForCausalLM.from_pretrained(location, dtype=getattr(torch, args.dtype),
                                                     trust_remote_code=args.trust_remote_code)
    except Exception as error:
        raise ValueError(f"cannot load {args.model}: {load_error(error)}") from error
    return model, tokenizer


def run_from_arguments(args: argparse.Namespace) -> tuple[dict, list[Path]]:
    """Analyse `args.model` on `args.text`; returns the summary and the files written into `args.out`."""
    from . import _register_auto_classes

    try:  # the plots come last, after minutes of work: a missing matplotlib is said before any
        import matplotlib  # noqa: F401
    except ImportError as error:
        raise ValueError("the plots need matplotlib, which is not installed: pip install matplotlib (or the "
                         "package's extra, dar-transformers[analysis])") from error
    from .cli import missing_model_folder

    problem = missing_model_folder(str(args.model))
    if problem is not None:
        raise ValueError(problem)
    try:
        text = args.text.read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as error:
        raise ValueError(f"--text {args.text}: {getattr(error, 'strerror', None) or error}") from error
    replaced = check_analysis_output(args.out, args.overwrite)
    for folder in stale_staging_folders(args.out):
        earlier = sorted(path.name for path in (folder / "replaced").glob("*"))
        if earlier:  # killed between its moves: the only copy of the analysis it was replacing
            logger.warning(f"{folder} is the staging folder of an analysis killed while it replaced another: "
                           f"{folder / 'replaced'} holds the earlier analysis's {', '.join(earlier)}, its only copy; "
                           f"move them back into {args.out} (or keep them elsewhere) before removing the folder.")
        else:
            logger.warning(f"{folder} is the staging folder of an analysis that did not finish (killed) or runs now: "
                           "it holds none of your files; remove it once no analysis writes into this folder.")
    with output_folder(args.out):
        _register_auto_classes()
        model, tokenizer = load_analysed_model(args)
        input_ids = text_batch(tokenizer, text, args.num_sequences, args.seq_len)
        check_token_ids(input_ids, model.config.vocab_size, args.tokenizer or args.model)
        names = evenly_spaced([branch.name for branch in dar_branches(model)], args.max_rescue_branches)
        summary = analyze(model, input_ids, rescue_branches=names)
        summary["model"] = str(args.model)
        summary["text"] = str(args.text)
        plots = write_analysis(args.out, summary, replaced)
    for path in plots:
        logger.info(f"wrote {path}")
    logger.info(f"wrote {args.out / 'summary.json'}")
    return summary, plots


def run_command(args: argparse.Namespace) -> int:
    """The `dar analyze` subcommand: exit status 0 and the written files on stdout (command-line output, like the
    other `dar` subcommands), or 1 with a message on stderr for a model that is not DAR or unreadable input."""
    try:
        summary, plots = run_from_arguments(args)
    except (TypeError, ValueError, OSError) as error:
        print(f"dar analyze: error: {' '.join(str(error).split())}", file=sys.stderr)
        return 1
    try:
        print(f"loss {summary['loss']:.4f} over {summary['predicted_tokens']} predicted tokens; wrote "
              f"{args.out}/summary.json and {len(plots)} PNGs", flush=True)
    except OSError as error:  # the analysis is in place; only its line was lost (`| head`, `> /dev/full`)
        from .cli import report_not_printed

        report_not_printed("dar analyze", args.out, "its summary line", error)
    return 0


def main(argv: list[str] | None = None) -> int:
    from .cli import interrupted, interrupts_raised

    parser = add_arguments(argparse.ArgumentParser(prog="python -m dar_transformers.analysis", description=__doc__,
                                                   formatter_class=argparse.RawDescriptionHelpFormatter))
    args = parser.parse_args(argv)
    try:
        with interrupts_raised():  # SIGTERM and SIGHUP clean up as Ctrl-C does (they left the staging folder)
            return run_command(args)
    except KeyboardInterrupt as interrupt:
        return interrupted(parser.prog, interrupt, args.out)


def _nan_to_none(values):
    """NaN -> None (JSON null; bare NaN is not JSON) in nested lists and dicts."""
    if isinstance(values, dict):
        return {key: _nan_to_none(value) for key, value in values.items()}
    if isinstance(values, list):
        return [_nan_to_none(value) for value in values]
    return None if isinstance(values, float) and math.isnan(values) else values


def _upcast(logits: torch.Tensor) -> torch.Tensor:
    """Logits in float32 at least: a float64 model's stay float64."""
    return logits.to(torch.promote_types(logits.dtype, torch.float32))


if __name__ == "__main__":
    raise SystemExit(main())


__all__ = [
    "DepthRead",
    "analyze",
    "cka_matrix",
    "cross_stream_cka",
    "dar_branches",
    "depth_weight_maps",
    "linear_cka",
    "record_depth_reads",
    "rescue_gain",
    "save_plots",
    "stream_balance",
]
