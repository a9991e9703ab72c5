# SPDX-License-Identifier: Apache-2.0
# Copyright 2026 The dar-transformers authors.
"""Layer-streamed verification of a written conversion (DESIGN.md section 6): the source's residual forward and
DAR's forward run side by side, one decoder layer's weights in memory at a time, computing in float32 (or float64)
whatever the storage dtype.

Both models exist only on the meta device. For each decoder layer the source layer is materialised from the source
checkpoint and the DAR layer from the *written* checkpoint (so what is verified is what was written); a written
tensor equal to its source tensor shares its memory. Every prompt goes through the layer, then both layers go back
to meta. The rotary embedding and masks are built as the models build them (rotary `inv_freq` in float32, as
`from_pretrained` keeps it), the embedding reads only the prompts' rows, and the logits are computed in vocabulary
chunks, so the peak is about one decoder layer in the compute dtype plus a vocabulary chunk of the LM head.

Shape legend: T tokens of one prompt (batch 1), D hidden, V vocabulary, C a vocabulary chunk.
"""

import dataclasses
from collections.abc import Callable, Mapping, Sequence

import torch
from transformers import PreTrainedModel
from transformers.masking_utils import create_causal_mask, create_sliding_window_causal_mask
from transformers.utils import logging

from .checkpoint_io import Checkpoint

LM_HEAD_CHUNK_BYTES = 32 * 2**20  # one vocabulary chunk of the LM head in the compute dtype


def dar_forward_steps(dar_model: torch.nn.Module):
    """DAR's forward in three steps, the only code here that knows DARModel's state API: `start(inputs_embeds)`
    -> state, `layer(decoder_layer, state, **layer_kwargs)` -> state, `finish(state)` -> the readout u [1, T, D]
    in the compute dtype (before `norm`). The state is opaque and passed on positionally."""

    def start(inputs_embeds):
        return dar_model.initial_state(inputs_embeds)

    def layer(decoder_layer, state, **layer_kwargs):
        return decoder_layer(*state, **layer_kwargs)

    def finish(state):
        readout, _ = dar_model.final_readout(*state)  # (u_F, depth weights)
        return readout

    return start, layer, finish


@dataclasses.dataclass
class StreamedModel:
    """One side of the comparison: a causal LM on the meta device and the checkpoint its weights come from.

    `to_model_layout` turns the checkpoint's tensors of one module into the model's parameter names (per-expert MoE
    tensors fused); identity for DAR checkpoints, which are written in the model's layout."""

    model: PreTrainedModel
    checkpoint: Checkpoint
    to_model_layout: Callable[[dict[str, torch.Tensor]], dict[str, torch.Tensor]] = lambda state: state

    def module_state(self, prefix: str, dtype: torch.dtype, share_with: Mapping[str, torch.Tensor] = {}):
        """The tensors under `prefix` (names relative to it) in `dtype`; one equal to `share_with[name]` is that
        tensor (one copy in memory for both models)."""
        names = [name for name in self.checkpoint.infos() if name.startswith(prefix)]
        state = self.to_model_layout({name: self.checkpoint.read(name).to(dtype) for name in names})  # one at a time
        result = {}
        for name, tensor in state.items():
            key = name.removeprefix(prefix)
            shared = share_with.get(key)
            if shared is not None and shared.shape == tensor.shape and torch.equal(shared, tensor):
                tensor = shared
            result[key] = tensor
        return result

    def output_embedding_name(self) -> str:
        return "model.embed_tokens.weight" if self.model.config.tie_word_embeddings else "lm_head.weight"


def _attention_mask(config, inputs_embeds: torch.Tensor, position_ids: torch.Tensor):
    """The mask the model builds for an unpadded prompt: sliding-window for Mistral-style configs with a window (and
    DAR's Mistral branches), causal otherwise (Qwen-style `layer_types` sources are full-attention only here)."""
    sliding = getattr(config, "layer_types", None) is None and getattr(config, "sliding_window", None) is not None
    function = create_sliding_window_causal_mask if sliding else create_causal_mask
    return function(config=config, inputs_embeds=inputs_embeds, attention_mask=None, past_key_values=None,
                    position_ids=position_ids)


def _materialise(module: torch.nn.Module, state: dict[str, torch.Tensor]) -> None:
    module.load_state_dict(state, strict=True, assign=True)


@torch.no_grad()
def streamed_hidden_states(
    source: StreamedModel,
    target: StreamedModel,
    prompts: Sequence[torch.Tensor],
    dtype: torch.dtype,
    progress: bool = False,
) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
    """The final hidden states (after `norm`) [1, T, D] of every prompt, source and DAR, in `dtype`."""
    source_inner, target_inner = source.model.model, target.model.model
    num_layers = source.model.config.num_hidden_layers
    embedding = "model.embed_tokens.weight"
    source_rotary = type(source_inner.rotary_emb)(config=source.model.config)  # on CPU, inv_freq in float32
    target_rotary = type(target_inner.rotary_emb)(config=target.model.config)
    start, run_layer, finish = dar_forward_steps(target_inner)

    source_runs, target_runs = [], []  # per prompt: (hidden or state, layer keyword arguments)
    for input_ids in prompts:
        ids = input_ids.reshape(-1)
        positions = torch.arange(ids.numel())[None]  # [1, T]
        for side, rotary, runs in ((source, source_rotary, source_runs), (target, target_rotary, target_runs)):
            hidden = side.checkpoint.read_rows(embedding, ids).to(dtype)[None]  # [1, T, D]
            layer_kwargs = dict(
                attention_mask=_attention_mask(side.model.config, hidden, positions),
                position_ids=positions,
                position_embeddings=rotary(hidden, position_ids=positions),
            )
            runs.append([hidden if side is source else start(hidden), layer_kwargs])

    bar = logging.tqdm(total=num_layers, desc="Verifying layer by layer (source vs DAR)", disable=not progress)
    for index in range(num_layers):
        prefix = f"model.layers.{index}."
        source_layer, target_layer = source_inner.layers[index], target_inner.layers[index]
        source_state = source.module_state(prefix, dtype)
        _materialise(source_layer, source_state)
        _materialise(target_layer, target.module_state(prefix, dtype, share_with=source_state))
        del source_state
        for run in source_runs:
            run[0] = source_layer(run[0], **run[1])
        for run in target_runs:
            run[0] = run_layer(target_layer, run[0], **run[1])
        source_layer.to("meta")
        target_layer.to("meta")
        bar.update()
    bar.close()

    source_norm = source.module_state("model.norm.", dtype)
    _materialise(source_inner.norm, source_norm)
    _materialise(target_inner.norm, target.module_state("model.norm.", dtype, share_with=source_norm))
    _materialise(target_inner.final_readout, target.module_state("model.final_readout.", dtype))
    source_hidden = [source_inner.norm(hidden) for hidden, _ in source_runs]
    target_hidden = [target_inner.norm(finish(state).to(dtype)) for state, _ in target_runs]
    for module in (source_inner.norm, target_inner.norm, target_inner.final_readout):
        module.to("meta")
    return source_hidden, target_hidden


@torch.no_grad()
def lm_head_chunks(source: StreamedModel, target: StreamedModel, dtype: torch.dtype):
    """(start, source rows, target rows) of the LM heads [C, D] in `dtype`, one vocabulary chunk at a time (the
    tied embedding for tied models); equal chunks are one tensor."""
    source_name, target_name = source.output_embedding_name(), target.output_embedding_name()
    vocab_size, hidden_size = source.checkpoint.infos()[source_name].shape
    step = max(1, LM_HEAD_CHUNK_BYTES // (hidden_size * dtype.itemsize))
    for begin in range(0, vocab_size, step):
        rows = slice(begin, begin + step)
        source_rows = source.checkpoint.read(source_name, rows).to(dtype)  # [C, D]
        target_rows = target.checkpoint.read(target_name, rows).to(dtype)  # [C, D]
        if torch.equal(source_rows, target_rows):
            target_rows = source_rows
        yield begin, source_rows, target_rows


@dataclasses.dataclass
class LogitStatistics:
    """Per prompt, accumulated over vocabulary chunks without keeping the logits."""

    max_abs_logit: float = 0.0
    max_abs_logit_difference: float = 0.0
    source_top2: torch.Tensor | None = None  # values [T, 2]
    source_top2_index: torch.Tensor | None = None  # [T, 2]
    target_top1_value: torch.Tensor | None = None  # [T]
    target_top1_index: torch.Tensor | None = None  # [T]

    def update(self, begin: int, source_logits: torch.Tensor, target_logits: torch.Tensor) -> None:
        """source_logits, target_logits [T, C] of vocabulary rows begin .. begin + C."""
        self.max_abs_logit = max(self.max_abs_logit, source_logits.abs().max().item())
        difference = (target_logits.double() - source_logits.double()).abs().max().item()
        self.max_abs_logit_difference = max(self.max_abs_logit_difference, difference)
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

    def top1_agreement(self, tolerance: float) -> tuple[int, int]:
        decided = (self.source_top2[:, 0] - self.source_top2[:, 1]) > 2 * tolerance  # [T]
        agreed = decided & (self.target_top1_index == self.source_top2_index[:, 0])
        return int(decided.sum()), int(agreed.sum())


@torch.no_grad()
def streamed_logit_statistics(
    source: StreamedModel, target: StreamedModel, prompts: Sequence[torch.Tensor], dtype: torch.dtype,
    progress: bool = False,
) -> list[LogitStatistics]:
    source_hidden, target_hidden = streamed_hidden_states(source, target, prompts, dtype, progress)
    statistics = [LogitStatistics() for _ in prompts]
    for begin, source_rows, target_rows in lm_head_chunks(source, target, dtype):
        for stats, source_h, target_h in zip(statistics, source_hidden, target_hidden):
            stats.update(begin, source_h[0] @ source_rows.T, target_h[0] @ target_rows.T)  # [T, C] each
    return statistics


@torch.no_grad()
def streamed_logits(
    source: StreamedModel, target: StreamedModel, prompts: Sequence[torch.Tensor], dtype: torch.dtype
) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
    """Full logits [1, T, V] of both sides (small models and tests; the verification keeps statistics only)."""
    source_hidden, target_hidden = streamed_hidden_states(source, target, prompts, dtype)
    chunks = list(lm_head_chunks(source, target, dtype))
    source_logits = [torch.cat([h @ rows.T for _, rows, _ in chunks], dim=-1) for h in source_hidden]
    target_logits = [torch.cat([h @ rows.T for _, _, rows in chunks], dim=-1) for h in target_hidden]
    return source_logits, target_logits
