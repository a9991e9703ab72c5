# SPDX-License-Identifier: Apache-2.0
"""DARMoeConfig (CPU): defaults and round trip, one-line errors naming the field, and which layers are sparse."""

import pytest
from transformers import AutoConfig
from transformers.modeling_outputs import MoeCausalLMOutputWithPast, MoeModelOutputWithPast

from dar_transformers import DARMoeConfig
from dar_transformers.modeling_dar_moe import DARMoeSparseMoeBlock

from conftest import TINY_LLAMA_FIELDS, TINY_MOE, random_input_ids, tiny_dar_moe


def test_config_defaults_and_round_trip():
    config = DARMoeConfig(**TINY_LLAMA_FIELDS)
    assert config.model_type == "dar_moe"
    assert config.moe_intermediate_size == config.intermediate_size  # None -> the dense MLP width (upcycling)
    assert config.norm_topk_prob is True and config.shared_expert_intermediate_size == 0
    assert config.moe_layer_indices == [0, 1]
    reloaded = AutoConfig.for_model(**config.to_dict())
    assert isinstance(reloaded, DARMoeConfig) and reloaded.to_dict() == config.to_dict()
    sparse_every_second = DARMoeConfig(
        **{**TINY_MOE, "num_hidden_layers": 4, "decoder_sparse_step": 2, "mlp_only_layers": [3]}
    )
    assert sparse_every_second.moe_layer_indices == [1]


@pytest.mark.parametrize(
    "field, value, message",
    [
        ("num_experts", 0, "num_experts must be an integer >= 1"),
        ("num_experts_per_tok", 5, "num_experts_per_tok must be an integer in [1, num_experts=4]"),
        ("moe_intermediate_size", 0, "moe_intermediate_size must be None"),
        ("shared_expert_intermediate_size", -1, "shared_expert_intermediate_size must be 0"),
        ("decoder_sparse_step", 0, "decoder_sparse_step must be an integer >= 1"),
        ("mlp_only_layers", [2], "mlp_only_layers must hold layer indices in [0, 1]"),
        ("mlp_only_layers", [0, 1], "leave no sparse layer"),
        ("router_aux_loss_coef", -0.1, "router_aux_loss_coef must be a finite number >= 0"),
        ("dar_routing", "nope", "dar_routing must be one of"),  # the inherited DAR validation still runs
    ],
)
def test_config_rejects_bad_values_naming_the_field(field, value, message):
    with pytest.raises(Exception, match=message.replace("[", r"\[").replace("]", r"\]")) as error:
        DARMoeConfig(**{**TINY_MOE, field: value})
    assert field in str(error.value)


def test_sparse_and_dense_layers_follow_the_config():
    model = tiny_dar_moe(
        num_hidden_layers=4, decoder_sparse_step=2, mlp_only_layers=[3], shared_expert_intermediate_size=16
    )
    kinds = [type(layer.mlp).__name__ for layer in model.model.layers]
    assert kinds == ["LlamaMLP", "DARMoeSparseMoeBlock", "LlamaMLP", "LlamaMLP"]
    block = model.model.layers[1].mlp
    assert isinstance(block, DARMoeSparseMoeBlock) and block.has_shared_expert
    assert block.experts.gate_up_proj.shape == (4, 2 * 64, 32) and block.experts.down_proj.shape == (4, 32, 64)
    assert block.shared_expert.gate_proj.weight.shape == (16, 32)
    output = model(random_input_ids(length=10), output_router_logits=True)
    assert isinstance(output, MoeCausalLMOutputWithPast)
    assert len(output.router_logits) == 1 and output.router_logits[0].shape == (2 * 10, 4)
    base = model.model(random_input_ids(length=10), output_router_logits=True)
    assert isinstance(base, MoeModelOutputWithPast) and len(base.router_logits) == 1
