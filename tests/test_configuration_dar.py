# SPDX-License-Identifier: Apache-2.0
"""DARConfig: every bad DAR value is refused with a message naming the field and the allowed values; `None`
defaults resolve as documented; a save/load round trip keeps every DAR field."""

import math
import re

import pytest
from conftest import tiny_dar_config
from huggingface_hub.errors import StrictDataclassError

from dar_transformers import DARConfig

# (bad fields, fragments the error message must contain: the field name and the allowed values)
BAD_VALUES = {
    "block_size_zero": ({"dar_block_size": 0}, ["dar_block_size", "[1, 4]"]),
    "block_size_above_num_branches": ({"dar_block_size": 5}, ["dar_block_size", "[1, 4]"]),
    "unknown_routing": ({"dar_routing": "x"}, ["dar_routing", "'dar', 'selfkv', 'crossv', 'fixedkv'"]),
    "three_streams": ({"dar_num_streams": 3}, ["dar_num_streams", "[1, 2]"]),
    "unknown_write_mode": ({"dar_write_mode": "x"}, ["dar_write_mode", "'duplicate', 'split'"]),
    "fixedkv_with_gate_delta": ({"dar_routing": "fixedkv", "dar_gate_delta": 0.5}, ["dar_gate_delta", "must be 0"]),
    "rho_init_zero": ({"dar_rho_init": 0.0}, ["dar_rho_init", "between 0 and 1"]),
    "rho_init_one": ({"dar_rho_init": 1.0}, ["dar_rho_init", "between 0 and 1"]),
    "one_stream_with_dar_routing": ({"dar_num_streams": 1, "dar_routing": "dar"}, ["dar_routing", "['selfkv']"]),
    "unknown_implementation": ({"dar_implementation": "x"}, ["dar_implementation", "'fast', 'two_phase', 'reference'"]),
    "unknown_history_dtype": ({"dar_history_dtype": "bfloat16"}, ["dar_history_dtype", "'float32', 'model'"]),
    "unknown_compiled_read": ({"dar_compiled_read": "fused"}, ["dar_compiled_read", "'inlined', 'operator'"]),
    "unknown_inference_kernel": ({"dar_inference_kernel": "cuda"}, ["dar_inference_kernel", "'torch', 'cpp'"]),
    "model_history_on_the_fast_path": (
        {"dar_history_dtype": "model", "dar_implementation": "fast"}, ["dar_history_dtype", "'two_phase'", "'fast'"]
    ),
    "unknown_branch_family": ({"dar_branch_family": "gpt2"}, ["dar_branch_family", "'llama'"]),
    "negative_gate_delta": ({"dar_gate_delta": -1.0}, ["dar_gate_delta", ">= 0"]),
}


@pytest.mark.parametrize("fields,fragments", BAD_VALUES.values(), ids=BAD_VALUES.keys())
def test_bad_value_is_refused_naming_field_and_allowed_values(fields, fragments):
    with pytest.raises(StrictDataclassError) as error:
        tiny_dar_config(**fields)  # 2 layers: M = 4 branches
    for fragment in fragments:
        assert fragment in str(error.value)


def test_bad_value_assigned_after_construction_is_refused_by_validate():
    config = tiny_dar_config()
    config.dar_write_mode = "x"
    with pytest.raises(StrictDataclassError, match="dar_write_mode"):
        config.validate()


@pytest.mark.parametrize("field, value, named", [
    ("dar_write_mode", "x", "dar_write_mode must be one of ['duplicate', 'split']"),  # built, ran as 'split'
    ("dar_rho_init", 2.0, "dar_rho_init must lie strictly between 0 and 1"),  # a bare "math domain error"
    ("dar_routing", "foo", "dar_routing must be one of"),  # a bare KeyError: 'foo'
    ("dar_block_size", 20, "dar_block_size must be an integer in [1, 4]"),  # built, ran as one block
])
def test_a_bad_value_set_before_the_model_is_built_is_refused_naming_the_field(field, value, named):
    """A config edited after construction, then given to a model: the model was built from it unchecked (only
    `save_pretrained` refused the config later), so a typo ran as another variant or failed without naming the field."""
    from dar_transformers import DARForCausalLM

    config = tiny_dar_config()
    setattr(config, field, value)
    with pytest.raises(StrictDataclassError, match=re.escape(named)):
        DARForCausalLM(config)


@pytest.mark.parametrize("layers", [0, -1])
def test_a_model_without_decoder_layers_is_refused_naming_num_hidden_layers(layers):
    """It blamed `dar_block_size`, a field the caller never set, with the empty range [1, 0]."""
    from dar_transformers import DARMoeConfig

    with pytest.raises(StrictDataclassError, match=re.escape("DARConfig.num_hidden_layers must be a positive "
                                                             "integer (DAR mixes")) as error:
        tiny_dar_config(num_hidden_layers=layers)
    assert "dar_block_size" not in str(error.value)
    with pytest.raises(StrictDataclassError, match=re.escape("DARMoeConfig.num_hidden_layers must be a positive")):
        DARMoeConfig(**{**tiny_dar_config().to_dict(), "num_hidden_layers": layers})


@pytest.mark.parametrize("field, value", [("dar_routing", "crossv"), ("dar_block_size", 2), ("rms_norm_eps", 1e-3),
                                          ("dar_count_scaling", False)])
def test_a_layout_field_changed_on_a_built_model_is_refused_at_its_forward(field, value):
    """The modules read these fields when the model is built, the depth backends at each forward: a sweep that reused
    one config object (or an edit of model.config) had a model compute another function with gradients off (logits
    0.1-0.3 off the reference) and raise an IndexError for a larger block. A backend option still changes freely."""
    import torch

    from dar_transformers import DARForCausalLM

    config = tiny_dar_config(dar_block_size=1)
    model = DARForCausalLM(config).eval()
    ids = torch.tensor([[1, 2, 3, 4]])
    with torch.no_grad():
        expected = model(ids).logits
    model.config.dar_implementation = "two_phase"  # a backend option: read at each forward
    with torch.no_grad():
        torch.testing.assert_close(model(ids).logits, expected)
    was = getattr(config, field)
    setattr(config, field, value)
    with pytest.raises(ValueError, match=re.escape(f"DARConfig.{field} was changed on a built model ({was!r} -> "
                                                   f"{value!r}); its modules were built for {was!r}.")):
        model(ids)
    setattr(config, field, was)
    with torch.no_grad():
        torch.testing.assert_close(model(ids).logits, expected)


@pytest.mark.parametrize("num_layers", [1, 2, 4, 5, 8, 12])
def test_default_block_size_is_about_eight_blocks(num_layers):
    config = tiny_dar_config(num_hidden_layers=num_layers)
    assert config.dar_block_size == math.ceil(2 * num_layers / 8)
    assert config.dar_num_branches == 2 * num_layers


def test_default_routing_is_dar_for_two_streams_and_selfkv_for_one():
    assert tiny_dar_config().dar_routing == "dar"
    assert tiny_dar_config(dar_num_streams=1).dar_routing == "selfkv"


def test_default_gate_delta_is_0_7_and_zero_for_fixedkv():
    assert tiny_dar_config().dar_gate_delta == 0.7
    assert tiny_dar_config(dar_routing="crossv").dar_gate_delta == 0.7
    assert tiny_dar_config(dar_routing="fixedkv").dar_gate_delta == 0.0


def test_write_mode_sets_write_read_and_embedding_scales():
    duplicate, split = tiny_dar_config(dar_write_mode="duplicate"), tiny_dar_config(dar_write_mode="split")
    assert (duplicate.dar_write_scale, duplicate.dar_read_scale, duplicate.dar_embedding_scale) == (2.0, 1.0, 1.0)
    assert (split.dar_write_scale, split.dar_read_scale, split.dar_embedding_scale) == (1.0, 2.0, 0.5)


@pytest.mark.parametrize("fields,fragments", BAD_VALUES.values(), ids=BAD_VALUES.keys())
def test_bad_value_given_to_from_pretrained_is_refused_naming_field(tmp_path, fields, fragments):
    """`from_pretrained(folder, **overrides)` sets the overrides on the built config, which checked their types only:
    `dar_block_size=0` failed at the first forward with a ZeroDivisionError, `dar_block_size=99` loaded with trained
    write gates re-initialised as missing, an unknown implementation failed in a KeyError. Now refused at load like
    the constructor's."""
    tiny_dar_config().save_pretrained(tmp_path)
    with pytest.raises(StrictDataclassError) as error:
        DARConfig.from_pretrained(tmp_path, **fields)
    for fragment in fragments:
        assert fragment in str(error.value)


@pytest.mark.parametrize("overrides", [
    dict(dar_num_streams=1),  # routing derived from it: "selfkv"
    dict(dar_routing="fixedkv"),  # gate spread derived from it: 0
    dict(num_hidden_layers=2),  # block size derived from it: about 8 blocks of 4 branches -> 1
    dict(num_hidden_layers=2, dar_block_size=2, dar_num_streams=1, dar_gate_delta=0.5),
])
def test_from_pretrained_overrides_give_the_config_the_constructor_gives(tmp_path, overrides):
    """`from_pretrained(folder, **overrides)` of a Llama folder (the upcycling source) or of a DAR one equals
    `DARConfig(**fields, **overrides)`: the defaults that depend on an overridden field follow it. HF sets overrides
    after building the config, so `dar_num_streams=1` failed ("dar_routing must be one of ['selfkv']"),
    `dar_routing="fixedkv"` failed on the gate spread, and `num_hidden_layers` kept the folder's block size."""
    from transformers import LlamaConfig

    fields = dict(hidden_size=32, intermediate_size=64, num_hidden_layers=16, num_attention_heads=4,
                  num_key_value_heads=2, vocab_size=97)
    LlamaConfig(**fields).save_pretrained(tmp_path / "llama")
    expected = DARConfig(**{**fields, **overrides})
    loaded = DARConfig.from_pretrained(tmp_path / "llama", **overrides)
    for field in ("num_hidden_layers", "dar_block_size", "dar_num_streams", "dar_routing", "dar_gate_delta"):
        assert getattr(loaded, field) == getattr(expected, field), field
    DARConfig(**fields, dar_block_size=8).save_pretrained(tmp_path / "dar")  # a saved block size stays as saved
    assert DARConfig.from_pretrained(tmp_path / "dar", num_hidden_layers=4).dar_block_size == 8


def test_a_mistyped_dar_field_is_refused_naming_it_wherever_it_is_given(tmp_path):
    """A name with DAR's prefix that is no field (`dar_blocksize`, `dar_include_partials`): HF keeps an unknown key of
    config.json or of the constructor as an attribute, and hands an unknown `from_pretrained` keyword back unused
    (`AutoConfig.from_pretrained` drops it), so the model loaded with the field's default and no word said (a helper's
    audit: a config.json with `dar_include_partials` gave logits 0.013 off the saved model's). Refused everywhere,
    naming the key and the field it is closest to."""
    import json

    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    from dar_transformers import DARForCausalLM, DARMoeConfig

    def refused(name, close):
        return pytest.raises(ValueError, match=re.escape(f"has no field {name} ({name}: did you mean {close}?)"))

    with refused("dar_blocksize", "dar_block_size"):
        tiny_dar_config(dar_blocksize=1)
    with refused("dar_num_expert", "dar_num_streams"):  # DAR-MoE's fields are its own (num_experts)
        DARMoeConfig(hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
                     dar_num_expert=4)
    DARForCausalLM(tiny_dar_config(dar_include_partial=False)).save_pretrained(tmp_path)
    for load in (DARConfig.from_pretrained, AutoConfig.from_pretrained, AutoModelForCausalLM.from_pretrained):
        with refused("dar_blocksize", "dar_block_size"):
            load(tmp_path, dar_blocksize=1)
    config = json.loads((tmp_path / "config.json").read_text())
    config["dar_include_partials"] = config.pop("dar_include_partial")
    (tmp_path / "config.json").write_text(json.dumps(config))
    for load in (AutoConfig.from_pretrained, AutoModelForCausalLM.from_pretrained):
        with refused("dar_include_partials", "dar_include_partial"):
            load(tmp_path, dtype=torch.float32) if load is AutoModelForCausalLM.from_pretrained else load(tmp_path)


def test_a_saved_config_missing_a_dar_field_warns_naming_it_and_takes_whole_numbers_for_floats(tmp_path):
    """A saved config holds every DAR field; one without (edited by hand, or older than the field) loaded the default
    without a word, and a float field written as a whole number (`"dar_gate_delta": 0`, as JSON tools rewrite 0.0)
    was refused as a type error. Now the first warns naming the field and the default, the second loads as the
    float."""
    import json

    from transformers.testing_utils import CaptureLogger
    from transformers.utils import logging

    tiny_dar_config(dar_routing="fixedkv", dar_include_partial=False).save_pretrained(tmp_path)
    config = json.loads((tmp_path / "config.json").read_text())
    assert config["dar_gate_delta"] == 0.0
    config["dar_gate_delta"] = 0
    del config["dar_include_partial"]
    (tmp_path / "config.json").write_text(json.dumps(config))
    with CaptureLogger(logging.get_logger("dar_transformers.configuration_dar")) as captured:
        loaded = DARConfig.from_pretrained(tmp_path)
    assert type(loaded.dar_gate_delta) is float and loaded.dar_gate_delta == 0.0
    assert loaded.dar_include_partial is True  # the default, said:
    assert "This dar config has no dar_include_partial, which dar-transformers writes in every config; the " \
           "defaults are taken (dar_include_partial=True" in captured.out
    with CaptureLogger(logging.get_logger("dar_transformers.configuration_dar")) as captured:
        DARConfig.from_dict(tiny_dar_config().to_dict())
    assert captured.out == ""  # a complete config says nothing


@pytest.mark.parametrize("field, value", [("num_hidden_layers", 0), ("sliding_window", 0), ("sliding_window", -2)])
def test_a_layer_count_or_window_set_on_a_built_model_that_construction_refuses_is_refused_at_its_forward(field,
                                                                                                          value):
    """A built model's config set to a value `DARConfig(...)` refuses: 0 layers failed as an IndexError, a window of 0
    as a shape error in the mask, and a window of -2 ran with logits 0.19 off (a helper's audit)."""
    import torch

    from dar_transformers import DARForCausalLM

    model = DARForCausalLM(tiny_dar_config()).eval()
    setattr(model.config, field, value)
    with pytest.raises(ValueError, match=re.escape(f"config.{field} must be ")):
        model(torch.tensor([[1, 2, 3, 4]]))


def test_dar_moe_overrides_give_the_config_the_constructor_gives(tmp_path):
    """The expert width follows an `intermediate_size` override, as in `DARMoeConfig(...)`."""
    from transformers import LlamaConfig

    from dar_transformers import DARMoeConfig

    fields = dict(hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
                  num_key_value_heads=2, vocab_size=97)
    LlamaConfig(**fields).save_pretrained(tmp_path)
    loaded = DARMoeConfig.from_pretrained(tmp_path, intermediate_size=128, num_experts=4)
    assert loaded.moe_intermediate_size == DARMoeConfig(**{**fields, "intermediate_size": 128}).moe_intermediate_size
    assert loaded.moe_intermediate_size == 128 and loaded.num_experts == 4


def test_an_unknown_implementation_set_after_loading_names_the_field_at_the_forward():
    import torch

    from dar_transformers import DARForCausalLM

    model = DARForCausalLM(tiny_dar_config()).eval()
    model.config.dar_implementation = "refernce"
    with pytest.raises(ValueError, match=r"config\.dar_implementation must name a depth backend, one of \['fast', "
                                         r"'reference', 'two_phase'\], got 'refernce'"):
        model(torch.zeros(1, 3, dtype=torch.long))


@pytest.mark.parametrize("field, value", [("dar_inference_kernel", "c++"), ("dar_training_kernel", "CPP"),
                                          ("dar_compiled_read", "operators"), ("dar_history_dtype", "bfloat16")])
@pytest.mark.parametrize("grad", [False, True])
def test_an_unknown_option_set_after_loading_names_the_field_at_the_forward(field, value, grad):
    """The README's recipe sets options on a built model (`model.config.dar_training_kernel = "cpp"`); a typo there
    was read as the default by the backends' `==` checks, silently, until `save_pretrained` refused the config,
    perhaps after a whole training run."""
    import torch

    from dar_transformers import DARForCausalLM

    model = DARForCausalLM(tiny_dar_config()).train(grad)
    setattr(model.config, field, value)
    with torch.set_grad_enabled(grad), pytest.raises(ValueError, match=rf"config\.{field} must be one of \[.*\], got "
                                                                       rf"'{re.escape(value)}'"):
        model(torch.zeros(1, 3, dtype=torch.long))


def test_save_load_round_trip_keeps_every_dar_field(tmp_path):
    fields = dict(
        num_hidden_layers=3,
        dar_block_size=4,
        dar_num_streams=2,
        dar_routing="crossv",
        dar_write_mode="split",
        dar_gate_delta=0.25,
        dar_rho_init=0.6,
        dar_include_partial=False,
        dar_count_scaling=False,
        dar_branch_family="qwen2",
        dar_implementation="reference",
        dar_history_dtype="model",
        dar_compiled_read="operator",
        dar_inference_kernel="cpp",
    )
    tiny_dar_config(**fields).save_pretrained(tmp_path)
    loaded = DARConfig.from_pretrained(tmp_path)
    assert loaded.model_type == "dar"
    for name, value in fields.items():
        assert getattr(loaded, name) == value, name
