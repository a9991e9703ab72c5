# SPDX-License-Identifier: Apache-2.0
# Copyright 2026 The dar-transformers authors.
"""Configuration of DAR-MoE: Dual Attention Residuals (arXiv 2607.18730) around a sparse mixture-of-experts MLP.

`DARMoeConfig` is `DARConfig` plus the MoE fields of HF's Qwen2-MoE/Qwen3-MoE configs, under the same names, so
HF's router and fused-experts modules read them unchanged (DESIGN.md section 4). They are declared here, not
inherited from `Qwen3MoeConfig`, because their defaults differ (chosen so that sparse upcycling is exact) and Qwen's
configs bring attention fields of their own (sliding window, layer types) that DARConfig already defines:

- `num_experts` E and `num_experts_per_tok` k: top-k routing over E experts.
- `moe_intermediate_size`: hidden width of each expert; `None` picks `intermediate_size`, the dense MLP's width,
  so that sparse upcycling can copy the dense MLP into every expert.
- `norm_topk_prob`: renormalise the k selected routing weights to sum to 1. True by default: sparse upcycling is
  exact only with it (DESIGN.md section 3; Mixtral always renormalises, Qwen-MoE only with this flag).
- `shared_expert_intermediate_size`: 0 for none, else the width of Qwen2-MoE's sigmoid-gated shared expert.
- `mlp_only_layers`, `decoder_sparse_step`: which layers keep a dense MLP (as in Qwen2/3-MoE): layer l is sparse
  iff l is not in `mlp_only_layers` and (l + 1) % decoder_sparse_step == 0.
- `output_router_logits`, `router_aux_loss_coef`: record the router logits and add
  coef * load-balancing loss (Switch Transformer eq. 4-6) to the LM loss.
"""

import math
from typing import ClassVar

from huggingface_hub.dataclasses import strict
from transformers.models.qwen3_moe.configuration_qwen3_moe import Qwen3MoeConfig

from .configuration_dar import DARConfig


@strict
class DARMoeConfig(DARConfig):
    r"""
    `DARConfig` plus the sparse-MoE fields (see the module docstring).

    ```python
    >>> from dar_transformers import DARMoeConfig, DARMoeForCausalLM
    >>> config = DARMoeConfig(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
    ...                       vocab_size=128, num_experts=4, num_experts_per_tok=2)
    >>> model = DARMoeForCausalLM(config)
    ```"""

    model_type = "dar_moe"
    remote_code_auto_map: ClassVar[dict[str, str]] = {  # `DARConfig.remote_code_auto_map`
        "AutoConfig": "configuration_dar_moe.DARMoeConfig",
        "AutoModel": "modeling_dar_moe.DARMoeModel",
        "AutoModelForCausalLM": "modeling_dar_moe.DARMoeForCausalLM",
        "AutoModelForSequenceClassification": "modeling_dar_moe.DARMoeForSequenceClassification",
        "AutoModelForQuestionAnswering": "modeling_dar_moe.DARMoeForQuestionAnswering",
        "AutoModelForTokenClassification": "modeling_dar_moe.DARMoeForTokenClassification",
    }

    # Tensor/expert parallel plans: Qwen3-MoE's for the experts (the same modules), as the installed release has them
    # (5.19's tensor-parallel plan shards the experts, 5.25's leaves them to the expert-parallel plan), Llama's for
    # attention and MLPs.
    base_model_tp_plan = {
        **DARConfig.base_model_tp_plan,
        **{name: plan for name, plan in Qwen3MoeConfig.base_model_tp_plan.items() if ".mlp.experts" in name},
    }
    base_model_ep_plan = dict(Qwen3MoeConfig.base_model_ep_plan)

    num_experts: int = 8
    num_experts_per_tok: int = 2
    moe_intermediate_size: int | None = None
    norm_topk_prob: bool = True
    shared_expert_intermediate_size: int = 0
    decoder_sparse_step: int = 1
    mlp_only_layers: list[int] | None = None
    output_router_logits: bool = False
    router_aux_loss_coef: float = 0.001

    # `from_dict` builds these overrides in (`DARConfig.derivation_fields`): the expert width follows the MLP's.
    derivation_fields: ClassVar[tuple[str, ...]] = (
        *DARConfig.derivation_fields, "intermediate_size", "moe_intermediate_size", "mlp_only_layers",
    )

    function_fields: ClassVar[tuple[str, ...]] = (  # `DARConfig.function_fields`
        *DARConfig.function_fields, "num_experts", "num_experts_per_tok", "moe_intermediate_size", "norm_topk_prob",
        "shared_expert_intermediate_size", "decoder_sparse_step", "mlp_only_layers",
    )

    def __post_init__(self, **kwargs):
        if self.moe_intermediate_size is None:
            self.moe_intermediate_size = self.intermediate_size
        if self.mlp_only_layers is None:
            self.mlp_only_layers = []
        super().__post_init__(**kwargs)

    def validate_moe(self):
        """Part of `@strict` validation: every MoE field, with the field name and the allowed values."""
        if isinstance(self.num_experts, bool) or self.num_experts < 1:
            raise ValueError(f"DARMoeConfig.num_experts must be an integer >= 1, got {self.num_experts!r}.")
        if isinstance(self.num_experts_per_tok, bool) or not 1 <= self.num_experts_per_tok <= self.num_experts:
            raise ValueError(
                f"DARMoeConfig.num_experts_per_tok must be an integer in [1, num_experts={self.num_experts}], "
                f"got {self.num_experts_per_tok!r}."
            )
        if isinstance(self.moe_intermediate_size, bool) or self.moe_intermediate_size < 1:
            raise ValueError(
                f"DARMoeConfig.moe_intermediate_size must be None (= intermediate_size) or an integer >= 1, "
                f"got {self.moe_intermediate_size!r}."
            )
        if isinstance(self.shared_expert_intermediate_size, bool) or self.shared_expert_intermediate_size < 0:
            raise ValueError(
                "DARMoeConfig.shared_expert_intermediate_size must be 0 (no shared expert) or an integer >= 1, "
                f"got {self.shared_expert_intermediate_size!r}."
            )
        if isinstance(self.decoder_sparse_step, bool) or self.decoder_sparse_step < 1:
            raise ValueError(
                f"DARMoeConfig.decoder_sparse_step must be an integer >= 1, got {self.decoder_sparse_step!r}."
            )
        layers = range(self.num_hidden_layers)
        if any(isinstance(index, bool) or index not in layers for index in self.mlp_only_layers):
            raise ValueError(
                f"DARMoeConfig.mlp_only_layers must hold layer indices in [0, {self.num_hidden_layers - 1}], "
                f"got {self.mlp_only_layers!r}."
            )
        if not self.moe_layer_indices:
            raise ValueError(
                "DARMoeConfig.mlp_only_layers and decoder_sparse_step leave no sparse layer "
                f"(mlp_only_layers={self.mlp_only_layers!r}, decoder_sparse_step={self.decoder_sparse_step}); "
                "use DARConfig for a dense model."
            )
        if not (math.isfinite(self.router_aux_loss_coef) and self.router_aux_loss_coef >= 0.0):
            raise ValueError(
                f"DARMoeConfig.router_aux_loss_coef must be a finite number >= 0, got {self.router_aux_loss_coef!r}."
            )

    def is_moe_layer(self, layer_idx: int) -> bool:
        """Qwen2/3-MoE's rule: sparse unless listed in `mlp_only_layers` or off the `decoder_sparse_step` grid."""
        return layer_idx not in self.mlp_only_layers and (layer_idx + 1) % self.decoder_sparse_step == 0

    @property
    def moe_layer_indices(self) -> list[int]:
        return [index for index in range(self.num_hidden_layers) if self.is_moe_layer(index)]


__all__ = ["DARMoeConfig"]
