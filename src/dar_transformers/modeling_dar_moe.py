# SPDX-License-Identifier: Apache-2.0
# Copyright 2026 The dar-transformers authors.
"""DAR-MoE: Dual Attention Residuals (arXiv 2607.18730) with a sparse mixture-of-experts MLP branch.

A diff against `modeling_dar` (STYLE.md item 11), in the shape of HF's Qwen3-MoE on Mixtral:
  - the MLP branch of a sparse layer is HF's sparse MoE block: a top-k router `gate`, fused 3-D `experts`
    (`gate_up_proj [E, 2I, D]`, `down_proj [E, D, I]`) dispatched through transformers' experts implementations
    (`grouped_mm` by default), and an optional sigmoid-gated `shared_expert` (Qwen2-MoE);
  - `mlp_only_layers` / `decoder_sparse_step` keep some layers dense, with the family's own MLP;
  - outputs are `MoeModelOutputWithPast` / `MoeCausalLMOutputWithPast`; with `output_router_logits` the head adds
    `router_aux_loss_coef * load_balancing_loss` (Switch Transformer eq. 4-6) to the LM loss.
The DAR residual (depth reads, read gate, write gates, readout) is untouched: the MoE block is just another branch
F_m (DESIGN.md section 2), so sparse upcycling and DAR upcycling compose (residual-methods.md section 5.3).

Known limit, shared with HF's Mixtral/Qwen3-MoE: router logits are recorded by output hooks, so under *reentrant*
gradient checkpointing (whose first forward runs without grad) the aux loss gets no gradient; the default
non-reentrant checkpointing is exact. `grouped_mm` experts take float32/bf16/fp16 only: run a float64 model with
`set_experts_implementation("batched_mm")` (the converter does so).

Shape legend: N tokens (B * T flattened), D hidden, E experts, k experts per token.
"""

import torch
import torch.nn.functional as F
from torch import nn
from transformers import initialization as init
from transformers.cache_utils import Cache
from transformers.generation import GenerationMixin
from transformers.integrations import use_experts_implementation
from transformers.modeling_outputs import MoeCausalLMOutputWithPast, MoeModelOutputWithPast
from transformers.modeling_utils import slice_logits_to_keep
from transformers.models.qwen2_moe.modeling_qwen2_moe import Qwen2MoeMLP
from transformers.models.qwen3_moe.modeling_qwen3_moe import (
    Qwen3MoeExperts,
    Qwen3MoeTopKRouter,
    load_balancing_loss_func,
)
from transformers.processing_utils import Unpack
from transformers.utils import TransformersKwargs, can_return_tuple
from transformers.utils.output_capturing import OutputRecorder

from .configuration_dar_moe import DARMoeConfig
from .modeling_dar import DARDecoderLayer, DARForCausalLM, DARModel, DARPreTrainedModel, dar_compute_dtype


# The decorator is applied here again (Qwen3MoeExperts already carries it) because transformers decides whether a
# model may use the fast experts kernels by grepping the *model's own module source* for "@use_experts_implementation"
# (`PreTrainedModel._can_set_experts_implementation`); without it every DAR-MoE would silently run the eager loop.
@use_experts_implementation
class DARMoeExperts(Qwen3MoeExperts):
    """HF's fused experts: E SwiGLU MLPs as 3-D weights, forward dispatched on `config._experts_implementation`."""


class DARMoeTopKRouter(Qwen3MoeTopKRouter):
    """HF's top-k softmax router (Qwen3-MoE), with the routing softmax in the DAR compute dtype.

    Qwen3-MoE and Mixtral take the softmax in float32 even for a float64 model; then the renormalised top-k weights
    sum to 1 only to float32 rounding, and a float64 upcycling check cannot reach 1e-8 (DESIGN.md section 3).
    For float32 and half-precision models this is the HF computation unchanged.
    """

    def forward(self, hidden_states: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        hidden_states = hidden_states.reshape(-1, self.hidden_dim)  # [N, D]
        router_logits = F.linear(hidden_states, self.weight)  # [N, E]
        router_probs = router_logits.softmax(dim=-1, dtype=dar_compute_dtype(router_logits.dtype))  # [N, E]
        top_weights, top_index = torch.topk(router_probs, self.top_k, dim=-1)  # [N, k]
        if self.norm_topk_prob:
            top_weights = top_weights / top_weights.sum(dim=-1, keepdim=True)  # [N, k], sums to 1
        return router_logits, top_weights.to(router_logits.dtype), top_index


class DARMoeSparseMoeBlock(nn.Module):
    """HF's sparse MoE block (Qwen3-MoE), plus Qwen2-MoE's sigmoid-gated shared expert when configured.

    y = sum_{e in top-k(x)} p_e Expert_e(x)  [+ sigmoid(g . x) SharedExpert(x)].
    Attribute names follow Qwen2/3-MoE (`gate`, `experts`, `shared_expert`, `shared_expert_gate`), so their
    checkpoints load without renames.
    """

    def __init__(self, config: DARMoeConfig):
        super().__init__()
        self.gate = DARMoeTopKRouter(config)
        self.experts = DARMoeExperts(config)
        self.has_shared_expert = config.shared_expert_intermediate_size > 0
        if self.has_shared_expert:
            self.shared_expert = Qwen2MoeMLP(config, intermediate_size=config.shared_expert_intermediate_size)
            self.shared_expert_gate = nn.Linear(config.hidden_size, 1, bias=False)

    def forward(self, hidden_states: torch.Tensor) -> torch.Tensor:
        batch_size, sequence_length, hidden_dim = hidden_states.shape
        tokens = hidden_states.reshape(-1, hidden_dim)  # [N, D]
        _, routing_weights, selected_experts = self.gate(tokens)  # [N, k], [N, k]
        output = self.experts(tokens, selected_experts, routing_weights)  # [N, D]
        if self.has_shared_expert:
            output = output + torch.sigmoid(self.shared_expert_gate(tokens)) * self.shared_expert(tokens)  # [N, D]
        return output.reshape(batch_size, sequence_length, hidden_dim)


class DARMoeDecoderLayer(DARDecoderLayer):
    """A DAR decoder layer whose MLP branch is the sparse MoE block on sparse layers (`config.is_moe_layer`)."""

    def build_mlp(self, config: DARMoeConfig, layer_idx: int) -> nn.Module:
        if config.is_moe_layer(layer_idx):
            return DARMoeSparseMoeBlock(config)
        return super().build_mlp(config, layer_idx)


class DARMoePreTrainedModel(DARPreTrainedModel):
    config: DARMoeConfig
    _no_split_modules = ["DARMoeDecoderLayer"]
    # transformers caches its "@use_experts_implementation in the module source" check on the class it ran for.
    # DARMoeModel also derives from DARModel, whose cached answer is False (the dense module has no experts), so
    # without a slot of our own the MoE model would inherit that False once a dense DARModel had been built.
    _can_set_experts_implementation_cached_value = None
    _can_record_outputs = {
        **DARPreTrainedModel._can_record_outputs,
        "router_logits": OutputRecorder(DARMoeTopKRouter, index=0),
    }

    @torch.no_grad()
    def _init_weights(self, module):
        super()._init_weights(module)  # the DAR parameters and HF's standard modules
        std = self.config.initializer_range
        if isinstance(module, DARMoeExperts):
            init.normal_(module.gate_up_proj, mean=0.0, std=std)  # as Qwen3-MoE; upcycling overwrites with MLP copies
            init.normal_(module.down_proj, mean=0.0, std=std)
        elif isinstance(module, DARMoeTopKRouter):
            init.normal_(module.weight, mean=0.0, std=std)  # a fresh random router, as in sparse upcycling


class DARMoeModel(DARMoePreTrainedModel, DARModel):
    decoder_layer_class = DARMoeDecoderLayer

    @can_return_tuple
    def forward(
        self,
        input_ids: torch.LongTensor | None = None,
        attention_mask: torch.Tensor | None = None,
        position_ids: torch.LongTensor | None = None,
        past_key_values: Cache | None = None,
        inputs_embeds: torch.FloatTensor | None = None,
        use_cache: bool | None = None,
        **kwargs: Unpack[TransformersKwargs],
    ) -> MoeModelOutputWithPast:
        """`DARModel.forward` with the MoE output type; `_can_record_outputs` captures the router logits."""
        outputs = super().forward(
            input_ids=input_ids,
            attention_mask=attention_mask,
            position_ids=position_ids,
            past_key_values=past_key_values,
            inputs_embeds=inputs_embeds,
            use_cache=use_cache,
            return_dict=True,
            **kwargs,
        )
        return MoeModelOutputWithPast(**outputs)


class DARMoeForCausalLM(DARMoePreTrainedModel, GenerationMixin):
    _tied_weights_keys = DARForCausalLM._tied_weights_keys
    _tp_plan = DARForCausalLM._tp_plan
    _pp_plan = DARForCausalLM._pp_plan
    _fsdp_plan = DARForCausalLM._fsdp_plan

    def __init__(self, config: DARMoeConfig):
        super().__init__(config)
        self.model = DARMoeModel(config)
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
        output_router_logits: bool | None = None,
        logits_to_keep: int | torch.Tensor = 0,
        **kwargs: Unpack[TransformersKwargs],
    ) -> MoeCausalLMOutputWithPast:
        if output_router_logits is None:
            output_router_logits = self.config.output_router_logits
        outputs: MoeModelOutputWithPast = self.model(
            input_ids=input_ids,
            attention_mask=attention_mask,
            position_ids=position_ids,
            past_key_values=past_key_values,
            inputs_embeds=inputs_embeds,
            use_cache=use_cache,
            output_router_logits=output_router_logits,
            **kwargs,
        )

        hidden_states = slice_logits_to_keep(outputs.last_hidden_state, logits_to_keep)
        logits = self.lm_head(hidden_states)

        loss = None
        if labels is not None:
            loss = self.loss_function(logits=logits, labels=labels, vocab_size=self.config.vocab_size, **kwargs)

        aux_loss = None
        if output_router_logits:
            aux_loss = load_balancing_loss_func(
                outputs.router_logits, self.config.num_experts, self.config.num_experts_per_tok, attention_mask
            )
            if labels is not None:
                loss = loss + self.config.router_aux_loss_coef * aux_loss.to(loss.device)

        return MoeCausalLMOutputWithPast(
            loss=loss,
            aux_loss=aux_loss,
            logits=logits,
            past_key_values=outputs.past_key_values,
            hidden_states=outputs.hidden_states,
            attentions=outputs.attentions,
            router_logits=outputs.router_logits,
        )


__all__ = [
    "DARMoePreTrainedModel",
    "DARMoeModel",
    "DARMoeForCausalLM",
    "DARMoeSparseMoeBlock",
    "DARMoeExperts",
    "DARMoeTopKRouter",
]
