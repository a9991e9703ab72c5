# SPDX-License-Identifier: Apache-2.0
"""Families, key maps and targets (CPU): unsupported families and sliding-window layers are refused by name,
keys that have no place stop the conversion, per-expert MoE tensors fuse into HF's layout (two source tensors for one
parameter are refused), and each target's config validation names the field."""

import re

import pytest
import torch
from safetensors.torch import load_file, save_file
from transformers import (
    AutoConfig,
    GPT2Config,
    GPT2LMHeadModel,
    GemmaConfig,
    GemmaForCausalLM,
    MixtralConfig,
    MixtralForCausalLM,
    Qwen2Config,
    Qwen2ForCausalLM,
)

from dar_transformers import DARForCausalLM
from dar_transformers.configuration_dar import DAR_BRANCH_FAMILIES
from dar_transformers.conversion import (
    DAR_NEW_PARAMETERS,
    UnsupportedArchitectureError,
    convert_to_dar_moe,
    upcycle,
    upcycle_to_dar_moe,
)
from dar_transformers.conversion.families import MOE_SOURCE_FAMILIES, SOURCE_FAMILIES
from dar_transformers.conversion.keymaps import check_keys, fuse_expert_weights
from dar_transformers.conversion.targets import dar_moe_config_from_source
from dar_transformers.modeling_dar import DAR_BRANCH_MODULES, DAR_MODULE_NAMES

from conftest import (
    FAST,
    SHAPE,
    TINY_LLAMA_FIELDS,
    VOCAB,
    assert_nothing_written,
    dense_llama,
    make_tokenizer,
    save_source,
    tiny_dar_config,
)


def test_unsupported_architecture_is_refused_listing_the_supported_families(tmp_path):
    source = tmp_path / "gpt2"
    GPT2LMHeadModel(GPT2Config(n_embd=32, n_layer=2, n_head=4, vocab_size=VOCAB)).save_pretrained(source)
    make_tokenizer().save_pretrained(source)
    before = {p.name for p in tmp_path.iterdir()}
    with pytest.raises(UnsupportedArchitectureError, match=r"'gpt2'.*\['llama', 'mistral', 'qwen2', 'qwen3'\]"):
        upcycle(source, tmp_path / "out", progress=False)
    assert_nothing_written(tmp_path, before)
    with pytest.raises(UnsupportedArchitectureError, match="'gemma'"):
        upcycle(GemmaForCausalLM(GemmaConfig(**SHAPE, vocab_size=VOCAB, head_dim=8)), progress=False)
    mixtral = MixtralForCausalLM(MixtralConfig(**SHAPE, vocab_size=VOCAB, num_local_experts=2))
    with pytest.raises(UnsupportedArchitectureError, match="Kind 'dar' converts dense.*'mixtral' is a mixture of "
                                                           "experts: convert it to DAR-MoE with --kind dar_moe"):
        upcycle(mixtral, progress=False)


def test_qwen_sliding_window_layers_are_refused_rather_than_converted_inexactly():
    config = Qwen2Config(**SHAPE, vocab_size=VOCAB, use_sliding_window=True, sliding_window=4, max_window_layers=1)
    assert "sliding_attention" in config.layer_types
    with pytest.raises(UnsupportedArchitectureError, match="sliding-window attention layers"):
        upcycle(Qwen2ForCausalLM(config), progress=False)


def test_a_qwen_window_flag_that_leaves_every_layer_full_converts_exactly():
    """Qwen2 slides only from `max_window_layers` on: with it at the layer count, `use_sliding_window=True` leaves every
    layer full (`layer_types`, what transformers applies), and the conversion is exact; the flag alone refused it."""
    config = Qwen2Config(**SHAPE, vocab_size=VOCAB, use_sliding_window=True, sliding_window=4,
                         max_window_layers=SHAPE["num_hidden_layers"])
    assert set(config.layer_types) == {"full_attention"}
    torch.manual_seed(0)
    source = Qwen2ForCausalLM(config).eval()
    dar = upcycle(source, progress=False).model
    input_ids = torch.randint(0, VOCAB, (1, 12))  # longer than the window
    with torch.no_grad():
        torch.testing.assert_close(dar(input_ids).logits, source(input_ids).logits, rtol=1e-5, atol=1e-5)


def test_an_unexpected_key_reaching_check_keys_raises(tmp_path):
    check_keys(["model.layers.0.attn_residual.read_gate.logit"], [], DAR_NEW_PARAMETERS)  # new: fine
    with pytest.raises(ValueError, match=r"unexpected \['model\.layers\.0\.extra\.weight'\]"):
        check_keys([], ["model.layers.0.extra.weight"], DAR_NEW_PARAMETERS)
    with pytest.raises(ValueError, match=r"missing \['model\.norm\.weight'\]"):
        check_keys(["model.norm.weight"], [], DAR_NEW_PARAMETERS)
    source = save_source(tmp_path / "source")
    state = load_file(source / "model.safetensors")
    state["model.layers.0.mlp.extra_proj.weight"] = torch.zeros(2, 2)
    save_file(state, source / "model.safetensors", metadata={"format": "pt"})
    before = sorted(p.name for p in tmp_path.iterdir())
    with pytest.raises(ValueError, match=r"model\.layers\.0\.mlp\.extra_proj\.weight"):
        upcycle(source, tmp_path / "out", **FAST)
    assert sorted(p.name for p in tmp_path.iterdir()) == before


def test_block_size_that_does_not_fit_is_refused_before_loading(tmp_path):
    source = save_source(tmp_path / "source")
    before = {p.name for p in tmp_path.iterdir()}
    with pytest.raises(ValueError, match=r"dar_block_size must be an integer in \[1, 6\].*got 7"):
        upcycle(source, tmp_path / "out", dar_block_size=7, progress=False)
    with pytest.raises(TypeError, match=r"Unknown DAR field\(s\) \['dar_blocksize'\]"):
        upcycle(source, tmp_path / "out", dar_blocksize=2, progress=False)
    assert_nothing_written(tmp_path, before)


def test_per_expert_checkpoint_tensors_are_fused(tmp_path):
    torch.manual_seed(0)
    mixtral = MixtralForCausalLM(MixtralConfig(num_local_experts=4, num_experts_per_tok=2, **TINY_LLAMA_FIELDS)).eval()
    mixtral.save_pretrained(tmp_path)
    on_disk = load_file(str(tmp_path / "model.safetensors"))
    assert "model.layers.0.block_sparse_moe.experts.3.w1.weight" in on_disk  # HF saves Mixtral per expert
    fused = fuse_expert_weights(on_disk)
    assert fused.keys() == mixtral.state_dict().keys()
    for name, tensor in mixtral.state_dict().items():
        assert torch.equal(fused[name], tensor), name
    assert fuse_expert_weights(fused).keys() == fused.keys()  # already fused: unchanged
    qwen_style = {
        f"model.layers.0.mlp.experts.{expert}.{name}.weight": torch.full(shape, float(expert))
        for expert in range(3)
        for name, shape in (("gate_proj", (5, 4)), ("up_proj", (5, 4)), ("down_proj", (4, 5)))
    }
    qwen_fused = fuse_expert_weights(qwen_style)
    assert qwen_fused["model.layers.0.mlp.experts.gate_up_proj"].shape == (3, 10, 4)
    assert qwen_fused["model.layers.0.mlp.experts.down_proj"][2].eq(2.0).all()
    del qwen_style["model.layers.0.mlp.experts.1.up_proj.weight"]
    with pytest.raises(ValueError, match="incomplete"):
        fuse_expert_weights(qwen_style)


@pytest.mark.parametrize("added, copy_of, named", [  # named: the two tensors the refusal names (regexes)
    ("mlp.gate.weight", "block_sparse_moe.gate.weight",  # a legacy and a current router
     (r"block_sparse_moe\.gate\.weight", r"mlp\.gate\.weight")),
    ("mlp.experts.0.gate_proj.weight", "block_sparse_moe.experts.0.w1.weight",  # one expert's part, two names
     (r"block_sparse_moe\.experts\.0\.w1\.weight", r"mlp\.experts\.0\.gate_proj\.weight")),
    ("mlp.experts.gate_up_proj", None,  # fused experts (and down_proj) beside per-expert ones
     (r"block_sparse_moe\.experts\.0\.w[12]\.weight", r"mlp\.experts\.(gate_up|down)_proj")),
])
def test_two_source_tensors_that_become_one_moe_tensor_are_refused_naming_both(tmp_path, added, copy_of, named):
    """A Mixtral folder with a second tensor for one of its model's tensors: the plan kept one and dropped the other,
    and the conversion said PASSED (transformers' loader keeps the other one). Refused naming both, by the plan and by
    the fusion; nothing written."""
    torch.manual_seed(0)
    fields = {**TINY_LLAMA_FIELDS, "vocab_size": VOCAB}
    mixtral = MixtralForCausalLM(MixtralConfig(num_local_experts=4, num_experts_per_tok=2, **fields))
    mixtral.save_pretrained(tmp_path / "source")
    make_tokenizer().save_pretrained(tmp_path / "source")
    state = load_file(tmp_path / "source" / "model.safetensors")
    if copy_of is None:  # the fused experts, as the model holds them
        state.update({name: tensor for name, tensor in mixtral.state_dict().items() if ".experts." in name})
    else:  # another value under the second name
        state[f"model.layers.0.{added}"] = -state[f"model.layers.0.{copy_of}"]
    save_file(state, tmp_path / "source" / "model.safetensors", metadata={"format": "pt"})
    both = "".join(rf"(?=.*'model\.layers\.0\.{pattern}')" for pattern in named)
    before = {p.name for p in tmp_path.iterdir()}
    with pytest.raises(ValueError, match=both + r".*one tensor per parameter"):
        upcycle_to_dar_moe(tmp_path / "source", tmp_path / "out", **FAST)
    assert_nothing_written(tmp_path, before)
    with pytest.raises(ValueError, match=both):
        fuse_expert_weights(state)


def test_conversion_rejects_bad_inputs():
    llama = dense_llama()
    with pytest.raises(ValueError, match="needs num_experts and top_k"):
        convert_to_dar_moe(llama)
    with pytest.raises(ValueError, match="expert_noise must be a fraction in"):
        convert_to_dar_moe(llama, num_experts=4, top_k=2, expert_noise=1.5)
    with pytest.raises(Exception, match="num_experts_per_tok must be an integer in"):
        convert_to_dar_moe(llama, num_experts=2, top_k=3)
    mixtral_config = MixtralConfig(num_local_experts=4, num_experts_per_tok=2, **TINY_LLAMA_FIELDS)
    with pytest.raises(ValueError, match="differs from the mixtral source"):
        dar_moe_config_from_source(mixtral_config, num_experts=8)
    with pytest.raises(ValueError, match="Cannot convert model_type 'gpt2' to DAR-MoE"):
        dar_moe_config_from_source(AutoConfig.for_model("gpt2"), num_experts=4, top_k=2)


def test_families_and_dar_module_names_are_written_once():
    """The converter's families are the config's branch families (each with its modules in the model), and the new
    parameters are exactly the parameters under DAR's module names."""
    assert tuple(SOURCE_FAMILIES) == DAR_BRANCH_FAMILIES == tuple(DAR_BRANCH_MODULES)
    assert set(MOE_SOURCE_FAMILIES.values()) <= set(DAR_BRANCH_FAMILIES)
    model = DARForCausalLM(tiny_dar_config())
    new = {name for name in model.state_dict() if any(re.fullmatch(p, name) for p in DAR_NEW_PARAMETERS)}
    assert new == {name for name in model.state_dict() if set(name.split(".")) & set(DAR_MODULE_NAMES)} != set()
    assert DARForCausalLM._keep_in_fp32_modules_strict == list(DAR_MODULE_NAMES)
