# SPDX-License-Identifier: Apache-2.0
"""Planning (CPU): the new parameters get exactly the values of the model's own `_init_weights`, no source tensor is
left out, and options are validated before any work."""

import dataclasses

import pytest
import torch

from dar_transformers import DARConfig, DARForCausalLM
from dar_transformers.conversion import DAR_NEW_PARAMETERS, convert, new_parameter_values, upcycle
from dar_transformers.conversion.keymaps import TensorInfo
from dar_transformers.conversion.plan import plan_conversion
from dar_transformers.conversion.targets import DAR_TARGET, plan_dar_tensors

from conftest import SHAPE, VOCAB, make_source, make_tokenizer


@pytest.mark.parametrize("fields", [dict(dar_block_size=2), dict(dar_block_size=1, dar_num_streams=1),
                                    dict(dar_block_size=4, dar_write_mode="split", dar_gate_delta=0.3)])
def test_new_parameter_values_are_what_init_weights_gives(fields):
    """One source of truth: the streamed values equal a freshly built DARForCausalLM's, bit for bit."""
    config = DARConfig(**SHAPE, vocab_size=VOCAB, **fields)
    torch.manual_seed(123)
    built = DARForCausalLM(config).state_dict()
    names = [name for name in built if any(__import__("re").fullmatch(p, name) for p in DAR_NEW_PARAMETERS)]
    assert names and len(names) == len(set(names))
    values = new_parameter_values(DARForCausalLM, config, names)
    for name in names:
        assert values[name].dtype == torch.float32 and torch.equal(values[name], built[name]), name


@pytest.mark.parametrize("tolerance", [0, -1e-5, 0.0])
def test_a_tolerance_that_is_not_positive_is_refused_before_any_work(tmp_path, tolerance):
    with pytest.raises(ValueError, match="tolerance must be a positive number"):
        upcycle(tmp_path / "does-not-exist", tmp_path / "out", tolerance=tolerance)
    assert not (tmp_path / "out").exists()


@pytest.mark.parametrize("prompts", ["The capital of France is Paris.", [123], ["Hello", None]])
def test_prompts_that_are_not_a_list_of_texts_are_refused_before_any_work(tmp_path, prompts):
    """A str is a Sequence: `prompts="one text"` verified each character as a one-token prompt and said PASSED; a
    non-str item failed in the tokenizer with a message that did not say which option."""
    with pytest.raises(ValueError, match=r"^prompts must be a list of texts \(str\), got "):
        upcycle(tmp_path / "does-not-exist", tmp_path / "out", prompts=prompts)
    assert not (tmp_path / "out").exists()


def test_a_source_tensor_that_no_planned_tensor_is_made_from_is_refused_naming_it():
    """The plan's general guard: a target kind whose plan leaves a source tensor out (here `model.norm.weight`, which
    the kind says is new, so no target key is missing) is refused, naming it, not dropped silently. Ignored keys (old
    checkpoints' rotary `inv_freq`) and a tied head (`check_tied_output_head` compared it) are the only exceptions."""
    source = make_source("llama", tied=True)
    infos = {name: TensorInfo(tuple(tensor.shape), tensor.dtype) for name, tensor in source.state_dict().items()}
    infos["model.layers.0.self_attn.rotary_emb.inv_freq"] = TensorInfo((4,), torch.float32)
    assert "lm_head.weight" in infos  # tied: the state dict holds the head, the plan the embedding only
    config = DAR_TARGET.build_config(source.config, "llama", torch.float32, {})
    plans, _ = plan_conversion(DAR_TARGET, config, infos, torch.float32)
    assert "model.norm.weight" in plans
    dropping_norm = dataclasses.replace(
        DAR_TARGET,
        plan_tensors=lambda infos, config: {name: plan for name, plan in plan_dar_tensors(infos, config).items()
                                            if name != "model.norm.weight"},
        new_parameters=(*DAR_NEW_PARAMETERS, r"model\.norm\.weight"),
    )
    with pytest.raises(ValueError, match=r"^the source: 1 tensor\(s\) that no converted tensor is made from: "
                                         r"\['model\.norm\.weight'\]"):
        plan_conversion(dropping_norm, config, infos, torch.float32)


def test_a_tied_checkpoint_that_stores_the_head_only_is_refused_saying_how_to_convert_it():
    """A tied model whose checkpoint holds `lm_head.weight` and no embedding (transformers loads it, tying the
    embedding to it): refused with what to do, not "missing ['model.embed_tokens.weight']"."""
    source = make_source("llama", tied=True)
    infos = {name: TensorInfo(tuple(tensor.shape), tensor.dtype) for name, tensor in source.state_dict().items()
             if name != "model.embed_tokens.weight"}
    config = DAR_TARGET.build_config(source.config, "llama", torch.float32, {})
    with pytest.raises(ValueError, match=r"stores its tied embedding as lm_head\.weight only .* save it again"):
        plan_conversion(DAR_TARGET, config, infos, torch.float32)


def test_a_scalar_tensor_is_written_and_compared_in_any_dtype(tmp_path):
    """A 0-dim source tensor cast on its way (the chunked write viewed it as bytes without flattening: "self.dim()
    cannot be 0 to view Float as Byte") and compared back by `check_written_tensors`."""
    from safetensors.torch import save_file

    from dar_transformers.conversion.checkpoints import SafetensorsCheckpoint
    from dar_transformers.conversion.keymaps import TensorPlan
    from dar_transformers.conversion.verify import check_written_tensors
    from dar_transformers.conversion.write import write_checkpoint

    (tmp_path / "source").mkdir()
    (tmp_path / "out").mkdir()
    save_file({"scale": torch.tensor(3.5), "matrix": torch.randn(3, 2)}, tmp_path / "source" / "model.safetensors")
    source = SafetensorsCheckpoint(tmp_path / "source")
    plans = {"scale": TensorPlan((), torch.bfloat16, ("scale",)), "matrix": TensorPlan((3, 2), torch.bfloat16,
                                                                                         ("matrix",))}
    write_checkpoint(tmp_path / "out", plans, source, 2**30)
    check_written_tensors(tmp_path / "out", plans, source)
    written = SafetensorsCheckpoint(tmp_path / "out", written=True)
    assert written.read("scale").dtype == torch.bfloat16 and written.read("scale").item() == 3.5


def test_in_memory_sources_as_users_hold_them(tmp_path):
    """A model compiled by `torch.compile` converts as the model it compiles; a PEFT model (adapters unmerged) and
    weights on the meta device (accelerate's offloading, a model built without weights) are refused saying what to
    do, as is any other object (they failed inside pathlib, or on `.item()` of a meta tensor)."""
    from peft import LoraConfig, get_peft_model

    from dar_transformers.conversion import upcycle_model

    source = make_source("llama", tied=False)
    converted = upcycle_model(torch.compile(source), dar_block_size=2)
    ids = torch.randint(3, VOCAB, (1, 9), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        assert (converted(ids).logits - source(ids).logits).abs().max() <= 1e-5
    # convert() took every non-PreTrainedModel for a path: "tokenizer is required", then a TypeError inside pathlib
    for model in (convert(torch.compile(source), dar_block_size=2, max_new_tokens=4, progress=False),
                  convert(torch.compile(source), tmp_path / "compiled", tokenizer=make_tokenizer(), dar_block_size=2,
                          max_new_tokens=4, progress=False)):
        with torch.no_grad():
            assert (model(ids).logits - source(ids).logits).abs().max() <= 1e-5
    with pytest.raises(TypeError, match="must be a transformers PreTrainedModel, an HF folder or a .gguf file"):
        convert(torch.nn.Linear(2, 2))
    peft_model = get_peft_model(make_source("llama", tied=False), LoraConfig(target_modules=["q_proj"], r=2))
    with pytest.raises(ValueError, match=r"PEFT adapters \(PeftModel\).*merge_and_unload"):
        upcycle(peft_model, tmp_path / "out", tokenizer=None)
    with torch.device("meta"):
        empty = type(source)(source.config)
    with pytest.raises(ValueError, match=r"weight\(s\) on the meta device .*offloaded by accelerate"):
        upcycle_model(empty, dar_block_size=2)
    with pytest.raises(TypeError, match="must be a transformers PreTrainedModel, an HF folder or a .gguf file"):
        upcycle_model(torch.nn.Linear(2, 2))
    assert not (tmp_path / "out").exists()
    assert sorted(path.name for path in tmp_path.iterdir()) == ["compiled"]
