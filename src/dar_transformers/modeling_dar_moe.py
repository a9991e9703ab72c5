# SPDX-License-Identifier: Apache-2.0
# Copyright 2026 The dar-transformers authors.
"""DAR-MoE: Dual Attention Residuals (arXiv 2607.18730) with a sparse mixture-of-experts MLP branch.

A diff against `modeling_dar` (STYLE.md item 11), written the way HF's modular files are: the MoE pieces are
transformers' Qwen3-MoE / Qwen2-MoE classes, subclassed only where DAR-MoE differs.
  - the MLP branch of a sparse layer is Qwen3-MoE's sparse block: a top-k router `gate` and fused 3-D `experts`
    (`Qwen3MoeExperts`: `gate_up_proj [E, 2I, D]`, `down_proj [E, D, I]`, dispatched through transformers' experts
    implementations, `grouped_mm` by default), plus Qwen2-MoE's sigmoid-gated `shared_expert` when configured;
  - `mlp_only_layers` / `decoder_sparse_step` keep some layers dense, with the family's own MLP;
  - experts and routers get Qwen3-MoE's `_init_weights`, after DAR's (one cooperative `super()` chain);
  - outputs are Qwen3-MoE's (`MoeModelOutputWithPast` / `MoeCausalLMOutputWithPast`) plus DAR's depth weights; with
    `output_router_logits` the head adds `router_aux_loss_coef * load_balancing_loss` (Switch Transformer eq. 4-6)
    to DAR's LM loss, padding masked out;
  - the model and every head are DAR's with the DAR-MoE backbone (`backbone_class`, `output_class`).
The DAR residual (depth reads, read gate, write gates, readout) is untouched: the MoE block is just another branch
F_m (DESIGN.md section 2), so sparse upcycling and DAR upcycling compose (residual-methods.md section 5.3).

This file is also the remote-code copy (`trust_remote_code=True`): it imports only torch, transformers (whose
Qwen-MoE classes it subclasses) and its flat siblings, so no generated flat file is needed.

Known limit, shared with HF's Mixtral/Qwen3-MoE: router logits are recorded by output hooks, so under *reentrant*
gradient checkpointing (whose first forward runs without grad) the aux loss gets no gradient; the default
non-reentrant checkpointing is exact. `grouped_mm` experts take float32/bf16/fp16 only: a float64 model built without
an experts implementation requested takes `batched_mm` (`get_correct_experts_implementation`); one cast to float64
later needs `set_experts_implementation("batched_mm")`.

Shape legend: N tokens (B * T flattened), D hidden, E experts, k experts per token.
"""

from dataclasses import dataclass

import torch
from torch import nn
from transformers.cache_utils import Cache
from transformers.modeling_outputs import MoeCausalLMOutputWithPast, MoeModelOutputWithPast
from transformers.models.qwen2_moe.modeling_qwen2_moe import Qwen2MoeMLP
from transformers.models.qwen3_moe.modeling_qwen3_moe import (
    Qwen3MoePreTrainedModel,
    Qwen3MoeSparseMoeBlock,
    Qwen3MoeTopKRouter,
    load_balancing_loss_func,
)
from transformers.processing_utils import Unpack
from transformers.utils import TransformersKwargs, can_return_tuple

from .configuration_dar_moe import DARMoeConfig
from .modeling_dar import (
    DARDecoderLayer,
    DARForCausalLM,
    DARForQuestionAnswering,
    DARForSequenceClassification,
    DARForTokenClassification,
    DARModel,
    DARPreTrainedModel,
    declare_task_classes,
)


@dataclass
class DARMoeModelOutputWithPast(MoeModelOutputWithPast):
    r"""
    depth_weights (`tuple(torch.FloatTensor)`, *optional*, returned when `output_depth_weights=True`):
        As in `DARModelOutputWithPast`: the depth weights of every read, in forward order.
    """

    depth_weights: tuple[torch.FloatTensor, ...] | None = None


@dataclass
class DARMoeCausalLMOutputWithPast(MoeCausalLMOutputWithPast):
    r"""
    depth_weights (`tuple(torch.FloatTensor)`, *optional*, returned when `output_depth_weights=True`):
        As in `DARModelOutputWithPast`.
    """

    depth_weights: tuple[torch.FloatTensor, ...] | None = None


class DARMoeTopKRouter(Qwen3MoeTopKRouter):
    """Qwen3-MoE's top-k softmax router; in a float64 model the top-k weights are renormalised again in float64.

    HF takes the routing softmax and the top-k renormalisation in float32 whatever the model dtype, so in a float64
    model the k weights sum to 1 only to float32 rounding (~1e-7), and a float64 upcycling check, whose output is
    (sum of the weights) * MLP(x) with every expert a copy of the dense MLP, cannot reach 1e-8 (DESIGN.md section 3).
    Float32 and half-precision models get HF's computation unchanged.
    """

    def forward(self, hidden_states: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        router_logits, top_weights, top_index = super().forward(hidden_states)  # [N, E], [N, k], [N, k]
        if self.norm_topk_prob and top_weights.dtype == torch.float64:
            top_weights = top_weights / top_weights.sum(dim=-1, keepdim=True)  # [N, k], sums to 1 in float64
        return router_logits, top_weights, top_index


class DARMoeSparseMoeBlock(Qwen3MoeSparseMoeBlock):
    """Qwen3-MoE's sparse block with the DAR router, plus Qwen2-MoE's sigmoid-gated shared expert when configured.

    y = sum_{e in top-k(x)} p_e Expert_e(x)  [+ sigmoid(g . x) SharedExpert(x)].
    Attribute names follow Qwen2/3-MoE (`gate`, `experts`, `shared_expert`, `shared_expert_gate`), so their
    checkpoints load without renames. Qwen2-MoE's own block always has the shared expert, hence the optional one here.
    """

    def __init__(self, config: DARMoeConfig):
        super().__init__(config)
        self.gate = DARMoeTopKRouter(config)
        self.has_shared_expert = config.shared_expert_intermediate_size > 0
        if self.has_shared_expert:
            self.shared_expert = Qwen2MoeMLP(config, intermediate_size=config.shared_expert_intermediate_size)
            self.shared_expert_gate = nn.Linear(config.hidden_size, 1, bias=False)

    def forward(self, hidden_states: torch.Tensor) -> torch.Tensor:
        output = super().forward(hidden_states)  # [B, T, D]
        if self.has_shared_expert:  # as Qwen2MoeSparseMoeBlock
            output = output + torch.sigmoid(self.shared_expert_gate(hidden_states)) * self.shared_expert(hidden_states)
        return output


class DARMoeDecoderLayer(DARDecoderLayer):
    """A DAR decoder layer whose MLP branch is the sparse MoE block on sparse layers (`config.is_moe_layer`)."""

    def build_mlp(self, config: DARMoeConfig, layer_idx: int) -> nn.Module:
        if config.is_moe_layer(layer_idx):
            return DARMoeSparseMoeBlock(config)
        return super().build_mlp(config, layer_idx)


class DARMoePreTrainedModel(DARPreTrainedModel, Qwen3MoePreTrainedModel):
    """DAR's settings first in the MRO; `DARPreTrainedModel._init_weights` calls `super()._init_weights`, which is
    Qwen3-MoE's here: experts and routers normal(0, initializer_range) (sparse upcycling then overwrites the experts
    with copies of the dense MLP and keeps the random router), everything else HF's generic init."""

    config: DARMoeConfig
    _no_split_modules = ["DARMoeDecoderLayer"]
    _can_record_outputs = {
        **DARPreTrainedModel._can_record_outputs,
        "router_logits": Qwen3MoePreTrainedModel._can_record_outputs["router_logits"],  # any Qwen3MoeTopKRouter
    }

    @classmethod
    def _can_set_experts_implementation(cls) -> bool:
        # The experts are transformers' own `Qwen3MoeExperts`, which carry the experts-kernel decorator
        # (`integrations.use_experts_implementation`) where transformers defines them. HF's heuristic looks for that
        # decorator in the source of the *model class's* module and caches the answer on the class (where DARMoeModel
        # would inherit DARModel's False); this module imports the experts rather than redefining them, so it answers
        # directly, as DARPreTrainedModel does for `_can_set_attn_implementation`. Without this, every DAR-MoE would
        # silently run the eager experts loop.
        return True

    def get_correct_experts_implementation(self, requested_experts: str | None) -> str:
        # transformers' default `grouped_mm` takes float32/bf16/fp16 only: a float64 model built without a request (a
        # float64 folder the converter wrote, loaded by `from_pretrained`) takes `batched_mm`, its float64 peer.
        if requested_experts is None and torch.get_default_dtype() == torch.float64:
            requested_experts = "batched_mm"
        return super().get_correct_experts_implementation(requested_experts)


class DARMoeModel(DARMoePreTrainedModel, DARModel):
    """`DARModel` with the MoE decoder layer; `_can_record_outputs` adds the router logits to its output when
    `output_router_logits` is set."""

    decoder_layer_class = DARMoeDecoderLayer
    output_class = DARMoeModelOutputWithPast


class DARMoeForCausalLM(DARMoePreTrainedModel, DARForCausalLM):
    """`DARForCausalLM` over `DARMoeModel`, plus the load-balancing loss when the router logits are recorded."""

    backbone_class = DARMoeModel
    output_class = DARMoeCausalLMOutputWithPast

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
        output_router_logits: bool | None = None,
        logits_to_keep: int | torch.Tensor = 0,
        **kwargs: Unpack[TransformersKwargs],
    ) -> DARMoeCausalLMOutputWithPast:
        if output_router_logits is None:
            output_router_logits = self.config.output_router_logits
        outputs = super().forward(
            input_ids=input_ids,
            attention_mask=attention_mask,
            position_ids=position_ids,
            past_key_values=past_key_values,
            inputs_embeds=inputs_embeds,
            labels=labels,
            use_cache=use_cache,
            output_router_logits=output_router_logits,
            logits_to_keep=logits_to_keep,
            return_dict=True,
            **kwargs,
        )
        if not output_router_logits:
            return outputs

        # Padded tokens (attention_mask 0) are left out of the routing fractions and probabilities. A cached step's
        # mask covers the past tokens too, its router logits the new ones only: the mask's last columns are theirs
        # (a batched, padded `generate` with output_router_logits died here, as transformers' own MoE models do).
        # A 4-D mask (static-cache `generate` passes the prepared one) names no padded token per row: no mask then.
        mask = attention_mask if attention_mask is not None and attention_mask.dim() == 2 else None
        if mask is not None and outputs.router_logits:
            mask = mask[:, mask.shape[1] - outputs.router_logits[0].shape[0] // mask.shape[0]:]
        aux_loss = load_balancing_loss_func(
            outputs.router_logits, self.config.num_experts, self.config.num_experts_per_tok, mask
        )
        loss = outputs.loss
        if labels is not None:
            loss = loss + self.config.router_aux_loss_coef * aux_loss.to(loss.device)
        return self.output_class(**{**outputs, "loss": loss, "aux_loss": aux_loss})


# Task heads as Qwen3-MoE's: DAR's heads (transformers' generic ones) over DARMoeModel. Like Qwen3-MoE's heads they
# train on the task loss alone (no load-balancing term).
class DARMoeForSequenceClassification(DARMoePreTrainedModel, DARForSequenceClassification):
    backbone_class = DARMoeModel


class DARMoeForQuestionAnswering(DARMoePreTrainedModel, DARForQuestionAnswering):
    backbone_class = DARMoeModel


class DARMoeForTokenClassification(DARMoePreTrainedModel, DARForTokenClassification):
    backbone_class = DARMoeModel


declare_task_classes(DARMoeConfig.model_type, DARMoeForCausalLM, DARMoeForSequenceClassification,
                     DARMoeForTokenClassification, DARMoeForQuestionAnswering)


__all__ = [
    "DARMoePreTrainedModel",
    "DARMoeModel",
    "DARMoeForCausalLM",
    "DARMoeForSequenceClassification",
    "DARMoeForQuestionAnswering",
    "DARMoeForTokenClassification",
    "DARMoeSparseMoeBlock",
    "DARMoeTopKRouter",
]
