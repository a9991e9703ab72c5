# SPDX-License-Identifier: Apache-2.0
# Copyright 2026 The dar-transformers authors.
"""The layer-streamed forward of a causal LM whose weights stay on disk (DESIGN.md section 6): the model's *own*
`forward` runs on a model built on the meta device, and each decoder layer's weights are loaded from its checkpoint
just before the layer runs and dropped right after it (forward hooks), computing in float32 (or float64) whatever
the storage dtype. No forward is written here, so what is verified is the model's code as it is.

Prompts go through in right-padded batches: under causal attention a position never sees the padding after it, so
every real position's output is the unpadded prompt's. The source runs one batch (each layer read, or dequantised,
once); the converted model, whose depth history grows activations by the number of sources, in batches of at most
`TARGET_BATCH_TOKENS` padded tokens, re-reading its written layers per batch. The embedding reads
only the prompts' rows (`inputs_embeds`), the rotary embedding is built as `from_pretrained` builds it (`inv_freq`
in float32), and the logits are computed in vocabulary chunks of the LM head, so the peak is about one decoder layer
in the compute dtype plus one vocabulary chunk.

Shape legend: N prompts, T tokens (the longest prompt), D hidden, V vocabulary, C a vocabulary chunk.
"""

import contextlib
import ctypes
import ctypes.util
import dataclasses
import functools
import itertools
import math
from collections.abc import Callable, Iterator, Sequence

import torch
from transformers import PreTrainedModel
from transformers.utils import logging

from .checkpoints import Checkpoint

LM_HEAD_CHUNK_BYTES = 32 * 2**20  # one vocabulary chunk of the LM head in the compute dtype
EMBEDDING = "model.embed_tokens.weight"
# Padded tokens per forward of the converted model: the default prompts of a real tokenizer (70-110 tokens each) go
# in one batch; longer ones in groups, which bounds DAR's activations near those of a few prompts.
TARGET_BATCH_TOKENS = 768


def _identity(state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    return state


@dataclasses.dataclass
class StreamedModel:
    """A causal LM on the meta device and the checkpoint its weights come from.

    `to_model_layout` turns the checkpoint's tensors of one module into the model's parameter names (per-expert MoE
    tensors fused); identity for DAR checkpoints, which are written in the model's layout."""

    model: PreTrainedModel
    checkpoint: Checkpoint
    to_model_layout: Callable[[dict[str, torch.Tensor]], dict[str, torch.Tensor]] = _identity

    def module_state(self, prefix: str, dtype: torch.dtype) -> dict[str, torch.Tensor]:
        """The tensors under `prefix` (names relative to it) in `dtype`, read one at a time."""
        names = [name for name in self.checkpoint.infos() if name.startswith(prefix)]
        state = self.to_model_layout({name: self.checkpoint.read(name).to(dtype) for name in names})
        return {name.removeprefix(prefix): tensor for name, tensor in state.items()}

    def output_embedding_name(self) -> str:
        return EMBEDDING if self.model.config.tie_word_embeddings else "lm_head.weight"


@functools.cache
def _malloc_trim() -> Callable[[int], int] | None:
    """glibc's `malloc_trim`, None where the C library has none (macOS, musl)."""
    try:
        return ctypes.CDLL(ctypes.util.find_library("c") or None).malloc_trim
    except (OSError, AttributeError):
        return None


def release_freed_heap() -> None:
    """Hand the heap's free pages back to the system (glibc). A layer's tensors under 32 MiB are heap blocks once
    glibc's dynamic mmap threshold has risen (it rises to the size of each large block freed), and the heap keeps
    them after they are freed: without this, the resident size of a layer-streamed pass grew by about one layer's
    worth of small tensors per layer (TinyLlama shape: peak 1.83 GiB, 0.70 GiB with it)."""
    trim = _malloc_trim()
    if trim is not None:
        trim(0)


def _load(module: torch.nn.Module, state: dict[str, torch.Tensor]) -> None:
    module.load_state_dict(state, strict=True, assign=True)


def all_finite(output) -> bool:
    tensors = output if isinstance(output, (tuple, list)) else (output,)
    return all(torch.isfinite(tensor).all() for tensor in tensors if isinstance(tensor, torch.Tensor))


# A DAR decoder layer's residual modules: a few vectors per branch (queries, gates, key norms; 0.6 MiB for all 64
# branches at the 8B width), loaded for the whole streamed pass, so that the depth backend finds the parameters of
# the reads ahead in a block and plans them at once, as in a model loaded by `from_pretrained` (with only the
# running layer's there it planned per layer: another code path than the one users run, so not the one verified).
RESIDENT_LAYER_MODULES = ("attn_residual", "mlp_residual")


@contextlib.contextmanager
def streamed_weights(side: StreamedModel, dtype: torch.dtype, nonfinite: list[str]) -> Iterator[torch.nn.Module]:
    """The backbone of `side.model`, ready to run its own forward: its small modules (final norm, DAR's readout) and
    every layer's DAR residual modules (`RESIDENT_LAYER_MODULES`) loaded, its rotary embedding built on the CPU, the
    rest of each decoder layer loaded by a forward pre-hook and sent back to the meta device by a forward hook. The
    name of every module whose output is not finite is appended to `nonfinite`, in forward order. Everything goes
    back to meta on exit."""
    backbone = side.model.model
    meta_rotary = backbone.rotary_emb
    backbone.rotary_emb = type(meta_rotary)(config=side.model.config)  # CPU, inv_freq float32 as from_pretrained
    small = [(name, child) for name, child in backbone.named_children()
             if name not in ("layers", "embed_tokens", "rotary_emb")]
    hooks = []

    def check(name):
        def hook(module, args, output):
            if not all_finite(output):
                nonfinite.append(name)
        return hook

    def load(parts):
        def hook(module, args):
            for prefix, part in parts:
                _load(part, side.module_state(prefix, dtype))
        return hook

    def unload(parts):
        def hook(module, args, output):
            for _, part in parts:
                part.to("meta")
            release_freed_heap()
        return hook

    try:
        for name, child in small:
            _load(child, side.module_state(f"model.{name}.", dtype))
            hooks.append(child.register_forward_hook(check(f"model.{name}")))
        for index, layer in enumerate(backbone.layers):
            prefix = f"model.layers.{index}."
            children = dict(layer.named_children())
            resident = [name for name in RESIDENT_LAYER_MODULES if name in children]
            for name in resident:  # loaded for the whole pass
                _load(children[name], side.module_state(f"{prefix}{name}.", dtype))
            # The rest, loaded for the layer's forward: a DAR layer's other modules (written in the model's layout),
            # a source's layer whole (`to_model_layout` maps its checkpoint's tensors of the layer).
            parts = ([(f"{prefix}{name}.", child) for name, child in children.items() if name not in resident]
                     if resident else [(prefix, layer)])
            hooks.append(layer.register_forward_pre_hook(load(parts)))
            hooks.append(layer.register_forward_hook(check(f"model.layers.{index}")))
            hooks.append(layer.register_forward_hook(unload(parts)))
        yield backbone
    finally:
        for hook in hooks:
            hook.remove()
        backbone.rotary_emb = meta_rotary
        for _, child in small:
            child.to("meta")
        backbone.layers.to("meta")


def right_padded(prompts: Sequence[torch.Tensor]) -> tuple[torch.Tensor, list[int]]:
    """The prompts [1, T_i] as one batch [N, T] padded on the right with token 0, and their lengths."""
    lengths = [ids.shape[-1] for ids in prompts]
    batch = torch.zeros(len(prompts), max(lengths), dtype=torch.long)  # [N, T]
    for row, ids in enumerate(prompts):
        batch[row, : lengths[row]] = ids.reshape(-1)
    return batch, lengths


def token_budget_groups(lengths: Sequence[int], max_batch_tokens: int | None) -> list[list[int]]:
    """Prompt indices in order, grouped so that each group's padded batch holds at most `max_batch_tokens` tokens
    (a longer prompt goes alone); one group when the budget is None."""
    groups: list[list[int]] = []
    for index, length in enumerate(lengths):
        group = groups[-1] if groups else None
        if group is not None and (max_batch_tokens is None
                                  or (len(group) + 1) * max(length, *(lengths[i] for i in group)) <= max_batch_tokens):
            group.append(index)
        else:
            groups.append([index])
    return groups


@torch.no_grad()
def streamed_hidden_states(
    side: StreamedModel, prompts: Sequence[torch.Tensor], dtype: torch.dtype, progress: bool = False,
    description: str = "model", max_batch_tokens: int | None = None,
) -> tuple[list[torch.Tensor], str | None]:
    """The final hidden states (after `norm`) [1, T_i, D] of every prompt in `dtype`, from the model's own forward,
    and the first module ("embedding", "model.layers.3", ...) whose output is not finite (None if all are).

    The prompts run in right-padded batches of at most `max_batch_tokens` padded tokens (None: one batch), each
    batch reading every layer once: a smaller budget bounds the activations, a larger one reads the layers fewer
    times."""
    lengths = [ids.shape[-1] for ids in prompts]
    groups = token_budget_groups(lengths, max_batch_tokens)
    hidden: list[torch.Tensor | None] = [None] * len(prompts)
    nonfinite: list[str] = []
    bar = logging.tqdm(total=len(groups) * side.model.config.num_hidden_layers,
                       desc=f"Verifying layer by layer ({description})", disable=not progress)

    def advance(module, args, output) -> None:  # a forward hook that returned a value would replace the output
        bar.update()

    for group in groups:
        batch, group_lengths = right_padded([prompts[index] for index in group])
        embeds = side.checkpoint.read_rows(EMBEDDING, batch.reshape(-1)).to(dtype).reshape(*batch.shape, -1)  # [N, T, D]
        if not torch.isfinite(embeds).all():
            nonfinite.append("embedding")
        with streamed_weights(side, dtype, nonfinite) as backbone:
            handles = [layer.register_forward_hook(advance) for layer in backbone.layers]
            try:
                output = backbone(inputs_embeds=embeds, use_cache=False).last_hidden_state  # [N, T, D]
            finally:
                for handle in handles:
                    handle.remove()
        for row, (index, length) in enumerate(zip(group, group_lengths)):
            hidden[index] = output[row : row + 1, :length]
    bar.close()
    return hidden, (nonfinite or [None])[0]


@torch.no_grad()
def lm_head_chunks(side: StreamedModel, dtype: torch.dtype) -> Iterator[tuple[int, torch.Tensor]]:
    """(start, rows [C, D]) of the LM head in `dtype`, one vocabulary chunk at a time (the tied embedding for tied
    models)."""
    name = side.output_embedding_name()
    vocab_size, hidden_size = side.checkpoint.infos()[name].shape
    step = max(1, LM_HEAD_CHUNK_BYTES // (hidden_size * dtype.itemsize))
    for begin in range(0, vocab_size, step):
        yield begin, side.checkpoint.read(name, slice(begin, begin + step)).to(dtype)


def _nan_max(a: float, b: float) -> float:
    """max that keeps a NaN (Python's max(0.0, nan) is 0.0: a NaN logit must not read as a zero difference)."""
    return math.nan if math.isnan(a) or math.isnan(b) else max(a, b)


@dataclasses.dataclass
class LogitStatistics:
    """Per prompt, accumulated over vocabulary chunks without keeping the logits."""

    max_abs_logit: float = 0.0
    max_abs_logit_difference: float = 0.0
    nonfinite: bool = False  # a logit of either side is NaN or infinite
    source_top2: torch.Tensor | None = None  # values [T, 2]
    source_top2_index: torch.Tensor | None = None  # [T, 2]
    target_top1_value: torch.Tensor | None = None  # [T]
    target_top1_index: torch.Tensor | None = None  # [T]

    def update(self, begin: int, source_logits: torch.Tensor, target_logits: torch.Tensor) -> None:
        """source_logits, target_logits [T, C] of vocabulary rows begin .. begin + C."""
        self.nonfinite |= not (torch.isfinite(source_logits).all() and torch.isfinite(target_logits).all())
        self.max_abs_logit = _nan_max(self.max_abs_logit, source_logits.abs().max().item())
        difference = (target_logits.double() - source_logits.double()).abs().max().item()
        self.max_abs_logit_difference = _nan_max(self.max_abs_logit_difference, difference)
        top = source_logits.topk(min(2, source_logits.shape[-1]), dim=-1)
        values, indices = top.values, top.indices + begin  # [T, 2]
        if self.source_top2 is not None:
            values = torch.cat([self.source_top2, values], dim=-1)
            indices = torch.cat([self.source_top2_index, indices], dim=-1)
            order = values.topk(2, dim=-1).indices  # [T, 2]
            values, indices = values.gather(-1, order), indices.gather(-1, order)
        self.source_top2, self.source_top2_index = values, indices
        target_value, target_index = target_logits.max(dim=-1)  # [T]
        target_index = target_index + begin
        if self.target_top1_value is not None:
            better = target_value > self.target_top1_value  # the first maximum wins, as argmax
            target_value = torch.where(better, target_value, self.target_top1_value)
            target_index = torch.where(better, target_index, self.target_top1_index)
        self.target_top1_value, self.target_top1_index = target_value, target_index

    def top1_agreement(self, tolerance: float) -> tuple[int, int, int]:
        """As `verify.top1_agreement`: (decided positions, those agreeing, positions agreeing of all)."""
        decided = (self.source_top2[:, 0] - self.source_top2[:, 1]) > 2 * tolerance  # [T]
        same = self.target_top1_index == self.source_top2_index[:, 0]
        return int(decided.sum()), int((decided & same).sum()), int(same.sum())


@dataclasses.dataclass
class StreamedComparison:
    statistics: list[LogitStatistics]
    first_nonfinite: str | None  # "source model.layers.3", "converted embedding", ... or None


def length_dependent_rope(config) -> bool:
    """True when the rotary frequencies depend on the sequence length (HF's `dynamic_rope_update` types)."""
    rope_type = (getattr(config, "rope_parameters", None) or {}).get("rope_type", "default")
    return "dynamic" in rope_type or rope_type == "longrope"


@torch.no_grad()
def streamed_logit_statistics(
    source: StreamedModel, target: StreamedModel, prompts: Sequence[torch.Tensor], dtype: torch.dtype,
    progress: bool = False, source_logits: Sequence[torch.Tensor] | None = None,
) -> StreamedComparison:
    """Both sides' logits compared prompt by prompt, one side's layer in memory at a time. `source_logits` ([T_i, V]
    per prompt, an in-memory source's own) stand for the source side's, which then does not run."""
    # The source (possibly GGUF: a layer read is a dequantisation) runs all prompts in one batch; DAR's activations
    # grow with its depth history (T x S x J x D), so it runs in groups, re-reading its written layers per group.
    # A rope whose frequencies depend on the sequence length (dynamic NTK, longrope) takes that length from the batch's
    # longest row: padding then changes every shorter prompt's positions, so such models run one prompt per batch.
    alone = length_dependent_rope(source.model.config) or length_dependent_rope(target.model.config)
    source_nonfinite = None
    if source_logits is None:
        source_hidden, source_nonfinite = streamed_hidden_states(source, prompts, dtype, progress, "source",
                                                                 1 if alone else None)
    target_hidden, target_nonfinite = streamed_hidden_states(target, prompts, dtype, progress, "converted",
                                                             1 if alone else TARGET_BATCH_TOKENS)
    statistics = [LogitStatistics() for _ in prompts]
    source_chunks = lm_head_chunks(source, dtype) if source_logits is None else itertools.repeat(None)
    for (begin, target_rows), source_chunk in zip(lm_head_chunks(target, dtype), source_chunks):
        for index, (stats, target_h) in enumerate(zip(statistics, target_hidden)):
            if source_logits is None:
                source_part = source_hidden[index][0] @ source_chunk[1].T  # [T, C]
            else:
                source_part = source_logits[index][:, begin : begin + target_rows.shape[0]]
            stats.update(begin, source_part, target_h[0] @ target_rows.T)
    first = (f"source {source_nonfinite}" if source_nonfinite
             else f"converted {target_nonfinite}" if target_nonfinite else None)
    if first is None and any(stats.nonfinite for stats in statistics):
        first = "LM head (logits)"
    return StreamedComparison(statistics, first)


@torch.no_grad()
def streamed_logits(
    source: StreamedModel, target: StreamedModel, prompts: Sequence[torch.Tensor], dtype: torch.dtype
) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
    """Full logits [1, T, V] of both sides (small models and tests; the verification keeps statistics only)."""
    logits = []
    for side in (source, target):
        hidden, _ = streamed_hidden_states(side, prompts, dtype)
        rows = torch.cat([chunk for _, chunk in lm_head_chunks(side, dtype)])  # [V, D]
        logits.append([h @ rows.T for h in hidden])
    return logits[0], logits[1]


__all__ = ["LogitStatistics", "StreamedModel", "streamed_hidden_states", "streamed_logit_statistics", "streamed_logits"]
