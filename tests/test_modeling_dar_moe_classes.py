# SPDX-License-Identifier: Apache-2.0
"""DAR-MoE's model classes are DAR's over the MoE backbone: depth weights, signatures, heads, registration.

Tiny random models on CPU (hidden 32, 2 layers, 4 experts, top-2). A DAR-MoE sparse-upcycled from a Llama, with the
same DAR parameters as a dense DAR upcycled from that Llama, computes the same function (every expert a copy of the
dense MLP, top-k weights renormalised: DESIGN.md section 3), so its depth weights are compared with the dense ones.
"""

import inspect

import pytest
import torch
from conftest import TINY_LLAMA_FIELDS, perturb_dar_parameters, random_input_ids, tiny_llama, upcycled_dar
from huggingface_hub.dataclasses import strict
from transformers import AutoModel
from transformers.modeling_layers import (
    GenericForQuestionAnswering,
    GenericForSequenceClassification,
    GenericForTokenClassification,
)
from transformers.modeling_outputs import MoeCausalLMOutputWithPast, MoeModelOutputWithPast

import dar_transformers
from dar_transformers import (
    DARConfig,
    DARForCausalLM,
    DARForQuestionAnswering,
    DARForSequenceClassification,
    DARForTokenClassification,
    DARMoeConfig,
    DARMoeForCausalLM,
    DARMoeForQuestionAnswering,
    DARMoeForSequenceClassification,
    DARMoeForTokenClassification,
    DARMoeModel,
    DARModel,
)
from dar_transformers.moe_upcycling import convert_to_dar_moe

pytestmark = pytest.mark.compat

HEADS = [
    (DARForSequenceClassification, DARMoeForSequenceClassification, GenericForSequenceClassification),
    (DARForQuestionAnswering, DARMoeForQuestionAnswering, GenericForQuestionAnswering),
    (DARForTokenClassification, DARMoeForTokenClassification, GenericForTokenClassification),
]


@pytest.fixture(scope="module")
def dense_and_sparse():
    """A dense DAR and a DAR-MoE upcycled from one Llama, with the same non-zero DAR parameters."""
    llama = tiny_llama(initializer_range=0.2)
    dense = upcycled_dar(llama, dar_block_size=3)
    sparse = convert_to_dar_moe(llama, num_experts=4, top_k=2, dar_block_size=3).eval()
    for model in (dense, sparse):
        perturb_dar_parameters(model, scale=0.5, seed=4)
    return dense, sparse


def test_dar_moe_returns_the_depth_weights_of_the_dense_dar_it_computes(dense_and_sparse):
    dense, sparse = dense_and_sparse
    input_ids = random_input_ids()
    with torch.no_grad():
        expected = dense(input_ids, output_depth_weights=True)
        output = sparse(input_ids, output_depth_weights=True, output_router_logits=True)
        backbone = sparse.model(input_ids, output_depth_weights=True)
    assert isinstance(output, MoeCausalLMOutputWithPast) and isinstance(backbone, MoeModelOutputWithPast)
    assert len(output.depth_weights) == sparse.config.dar_num_branches + 1 == len(expected.depth_weights)
    assert max(weights.shape[0] for weights in output.depth_weights) == 3  # the readout reads 3 committed entries
    assert len(output.router_logits) == sparse.config.num_hidden_layers and output.aux_loss is not None
    for read, (weights, dense_weights) in enumerate(zip(output.depth_weights, expected.depth_weights)):
        assert weights.shape == dense_weights.shape, read
        if dense_weights.shape[0] > 1:  # not uniform: the DAR parameters are perturbed
            assert (dense_weights - 1 / dense_weights.shape[0]).abs().max() > 0.01, read
        torch.testing.assert_close(weights, dense_weights, rtol=0, atol=1e-5)
        assert torch.equal(backbone.depth_weights[read], weights)
    torch.testing.assert_close(output.logits, expected.logits, rtol=0, atol=1e-5)
    assert sparse(input_ids).depth_weights is None  # recorded only when asked


def test_tuple_return_keeps_qwen3_moes_order_then_the_depth_weights(dense_and_sparse):
    _, sparse = dense_and_sparse
    input_ids = random_input_ids()
    with torch.no_grad():
        output = sparse(input_ids, labels=input_ids, output_router_logits=True, output_depth_weights=True)
        as_tuple = sparse(input_ids, labels=input_ids, output_router_logits=True, output_depth_weights=True,
                          return_dict=False)
    assert torch.equal(as_tuple[0], output.loss) and torch.equal(as_tuple[1], output.aux_loss)
    assert torch.equal(as_tuple[2], output.logits) and as_tuple[-1] is not None
    assert len(as_tuple[-1]) == len(output.depth_weights)


def test_dar_moe_forward_signatures_are_the_models_own():
    """Trainer, generate and transformers' common tests read the signature: no `*args` hides it."""
    for model_class in (DARMoeModel, DARMoeForCausalLM):
        parameters = list(inspect.signature(model_class.forward).parameters.values())
        assert [parameter.name for parameter in parameters[:2]] == ["self", "input_ids"], model_class
        assert not any(parameter.kind is inspect.Parameter.VAR_POSITIONAL for parameter in parameters), model_class
    assert DARMoeModel.forward is DARModel.forward
    assert "output_router_logits" in inspect.signature(DARMoeForCausalLM.forward).parameters


@pytest.mark.parametrize("dense_head, sparse_head, generic_head", HEADS)
def test_heads_derive_from_dars_and_keep_the_generic_forward(dense_head, sparse_head, generic_head):
    assert issubclass(sparse_head, dense_head) and sparse_head.forward is generic_head.forward
    assert sparse_head.backbone_class is DARMoeModel and dense_head.backbone_class is DARModel
    assert issubclass(DARMoeForCausalLM, DARForCausalLM) and DARMoeForCausalLM.backbone_class is DARMoeModel
    assert sparse_head.config_class is DARMoeConfig and dense_head.config_class is DARConfig


@strict
class UnregisteredDARConfig(DARConfig):
    """Stands in for the config class of a remote-code folder: the same fields, a class no Auto class knows."""


@strict
class UnregisteredDARMoeConfig(DARMoeConfig):
    """As above, for DAR-MoE."""


@pytest.mark.parametrize("family", ["dar", "dar_moe"])
@pytest.mark.parametrize("head_index", range(len(HEADS)))
def test_heads_build_their_backbone_for_an_unregistered_config_class_without_registering_it(family, head_index):
    dense_head, sparse_head, _ = HEADS[head_index]
    head_class, config_class = (
        (dense_head, UnregisteredDARConfig) if family == "dar" else (sparse_head, UnregisteredDARMoeConfig)
    )
    extra = {} if family == "dar" else dict(num_experts=4, num_experts_per_tok=2)
    head = head_class(config_class(**TINY_LLAMA_FIELDS, **extra, num_labels=3)).eval()
    assert type(head.model) is head_class.backbone_class
    assert config_class not in AutoModel._model_mapping  # the Auto registry is left as the package's import made it
    with torch.no_grad():
        output = head(random_input_ids())
    assert torch.isfinite(output.logits if hasattr(output, "logits") else output.start_logits).all()


def test_registration_is_one_table_and_import_is_idempotent():
    """Importing again (as `analysis.py` re-runs it) registers nothing twice and changes no mapping."""
    before = {auto_class: dict(auto_class._model_mapping._extra_content) for auto_class in
              {auto_class for row in dar_transformers.AUTO_CLASSES.values() for auto_class in row}}
    dar_transformers._register_auto_classes()
    for auto_class, mapping in before.items():
        assert auto_class._model_mapping._extra_content == mapping
    for config_class, row in dar_transformers.AUTO_CLASSES.items():
        for auto_class, model_class in row.items():
            assert auto_class._model_mapping[config_class] is model_class
            assert model_class._auto_class == auto_class.__name__


def test_no_model_of_the_family_claims_a_pipeline_parallel_plan(dense_and_sparse):
    """Llama's plan says a decoder layer maps hidden_states to hidden_states; a DAR stage boundary would have to carry
    the whole depth state, so DAR and DAR-MoE (and their heads) declare none: `supports_pp_plan` is False, which
    frameworks consult before splitting a model into stages. Control: the Llama they come from has one."""
    llama = tiny_llama()
    assert llama.supports_pp_plan
    dense, sparse = dense_and_sparse
    for model in (dense, sparse, HEADS[0][0](dense.config), HEADS[0][1](sparse.config)):
        assert not model.supports_pp_plan, type(model).__name__
        assert model.config.base_model_pp_plan is None
