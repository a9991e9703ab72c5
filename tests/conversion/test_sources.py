# SPDX-License-Identifier: Apache-2.0
"""Sources (CPU): bad weights, corrupt GGUF files and missing tokenizers are refused naming the file, and a GGUF
file is read tensor by tensor exactly as transformers loads it."""

import pytest
import torch
from safetensors.torch import load_file, save_file
from transformers import AutoModelForCausalLM, LlamaForCausalLM

from dar_transformers.conversion import checkpoints, plan, upcycle
from dar_transformers.conversion.checkpoints import GGUFCheckpoint
from dar_transformers.conversion.plan import meta_model
from dar_transformers.conversion.sources import plain_config

from conftest import assert_nothing_written, make_source, make_tokenizer, save_source, write_tiny_gguf


@pytest.mark.parametrize("damage", ["missing", "corrupt", "incomplete"])
def test_bad_weights_are_refused_naming_the_folder(tmp_path, damage):
    source = save_source(tmp_path / "source")
    weights = source / "model.safetensors"
    if damage == "missing":
        weights.unlink()
        expected = "no safetensors weights"
    elif damage == "corrupt":
        weights.write_bytes(b"\x00\x01not a safetensors file" * 8)
        expected = "Could not load the weights in"
    else:
        state = load_file(weights)
        del state["model.layers.1.mlp.up_proj.weight"]
        save_file(state, weights, metadata={"format": "pt"})
        expected = r"do not match its config.json.*model\.layers\.1\.mlp\.up_proj\.weight"
    before = {p.name for p in tmp_path.iterdir()}
    with pytest.raises((ValueError, FileNotFoundError), match=expected) as caught:
        upcycle(source, tmp_path / "out", progress=False)
    assert str(source) in str(caught.value)
    assert_nothing_written(tmp_path, before)


def test_corrupt_gguf_is_refused_naming_the_file(tmp_path):
    gguf_path = tmp_path / "broken.gguf"
    gguf_path.write_bytes(b"GGUF\x03\x00\x00\x00truncated")
    with pytest.raises(ValueError, match=f"Could not read the GGUF metadata of {gguf_path}"):
        upcycle(gguf_path, tmp_path / "out", progress=False)  # an output next to a GGUF file is allowed
    assert [p.name for p in tmp_path.iterdir()] == ["broken.gguf"]


def test_missing_tokenizer_is_refused(tmp_path):
    source = tmp_path / "source"
    make_source().save_pretrained(source)
    before = {p.name for p in tmp_path.iterdir()}
    with pytest.raises(FileNotFoundError, match=r"has no tokenizer \(looked for tokenizer.json"):
        upcycle(source, tmp_path / "out", progress=False)
    assert_nothing_written(tmp_path, before)
    with pytest.raises(ValueError, match="tokenizer is required"):
        upcycle(make_source(), tmp_path / "out", progress=False)
    assert_nothing_written(tmp_path, before)


def test_the_gguf_source_is_read_tensor_by_tensor_as_transformers_loads_it(tmp_path):
    from transformers.modeling_gguf_pytorch_utils import load_gguf_checkpoint

    model = make_source("llama", tied=False)
    gguf = write_tiny_gguf(tmp_path / "tiny.gguf", model, make_tokenizer())
    config = AutoModelForCausalLM.from_pretrained(tmp_path, gguf_file="tiny.gguf").config
    meta = meta_model(LlamaForCausalLM, plain_config(config))
    streamed = GGUFCheckpoint(gguf, config, meta)
    whole = load_gguf_checkpoint(str(gguf), return_tensors=True, model_to_load=meta)["tensors"]
    assert streamed.infos().keys() == whole.keys()
    for name, tensor in whole.items():
        assert torch.equal(streamed.read(name), tensor), name
    assert torch.equal(streamed.read_rows("model.embed_tokens.weight", torch.tensor([7, 3, 7])),
                       whole["model.embed_tokens.weight"][[7, 3, 7]])


def test_a_gguf_tensor_read_in_row_chunks_is_dequantised_once(tmp_path, monkeypatch):
    gguf_path = write_tiny_gguf(tmp_path / "tiny.gguf", make_source("llama", tied=False), make_tokenizer())
    config = AutoModelForCausalLM.from_pretrained(tmp_path, gguf_file="tiny.gguf").config
    checkpoint = GGUFCheckpoint(gguf_path, config, meta_model(LlamaForCausalLM, plain_config(config)))
    calls = []
    dequantize = checkpoints.gguf.dequantize
    monkeypatch.setattr(checkpoints.gguf, "dequantize", lambda *args: calls.append(args[1]) or dequantize(*args))
    name = "model.embed_tokens.weight"
    whole = checkpoint.read(name)
    chunks = [checkpoint.read(name, slice(start, start + 7)) for start in range(0, whole.shape[0], 7)]
    assert torch.equal(torch.cat(chunks), whole) and len(calls) == 1  # 46 chunks, one dequantisation
    # The NaN check and the writer read every tensor in chunks: still one dequantisation per tensor.
    checkpoint.close()
    checkpoint = GGUFCheckpoint(gguf_path, config, meta_model(LlamaForCausalLM, plain_config(config)))
    monkeypatch.setattr(plan, "FINITE_CHECK_BYTES", 1024)
    calls.clear()
    plan.check_finite(checkpoint)
    assert len(calls) == len(checkpoint.infos())


def test_a_nan_in_a_source_is_refused_at_planning_naming_the_tensor(tmp_path):
    model = make_source("llama", tied=False)
    with torch.no_grad():
        model.lm_head.weight[300, 1] = float("inf")
    before = {p.name for p in tmp_path.iterdir()}
    with pytest.raises(ValueError, match=r"the in-memory model: tensor 'lm_head\.weight' holds NaN or infinite values "
                                         r"\(in rows 0\.\.\d+\)"):
        upcycle(model, progress=False)
    with pytest.raises(ValueError, match=r"tensor 'lm_head\.weight' holds NaN or infinite values"):
        upcycle(model, tmp_path / "out", tokenizer=make_tokenizer(), progress=False)
    assert_nothing_written(tmp_path, before)
