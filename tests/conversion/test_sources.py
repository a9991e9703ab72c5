# SPDX-License-Identifier: Apache-2.0
"""Sources (CPU): bad weights, corrupt GGUF files and missing tokenizers are refused naming the file, and a GGUF
file is read tensor by tensor exactly as transformers loads it."""

import json
import re
import struct

import gguf as gguf_py
import numpy as np
import pytest
import torch
from safetensors import safe_open
from safetensors.torch import load_file, save_file
from transformers import (
    AutoModelForCausalLM, AutoTokenizer, LlamaConfig, LlamaForCausalLM, Qwen3MoeConfig, Qwen3MoeForCausalLM,
)
from transformers.integrations.ggml import GGUF_CONFIG_DEFAULTS_MAPPING
from transformers.modeling_gguf_pytorch_utils import Qwen2MoeTensorProcessor, get_gguf_hf_weights_map

from dar_transformers.conversion import VerificationError, api, checkpoints, plan, upcycle, upcycle_to_dar_moe
from dar_transformers.conversion.checkpoints import GGUFCheckpoint, SafetensorsCheckpoint
from dar_transformers.conversion.plan import meta_model
from dar_transformers.conversion.checkpoints import StateDictCheckpoint
from dar_transformers.cli import main as cli_main
from dar_transformers.conversion.sources import (
    exact_storage_dtype, gguf_parsed_once, load_source_config, plain_config, rounded_tensors,
)

from conftest import (
    FAST,
    SHAPE,
    VOCAB,
    assert_nothing_written,
    finish_gguf,
    gguf_writer,
    make_source,
    make_tokenizer,
    save_source,
    spread_weights,
    write_tiny_gguf,
    written_state,
)


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


GGUF_STORAGE = {"F32": {}, "F16": dict(matrices_dtype=np.float16),
                "BF16": dict(matrices_type=gguf_py.GGMLQuantizationType.BF16),
                "Q8_0": dict(matrices_type=gguf_py.GGMLQuantizationType.Q8_0),
                "Q4_1": dict(matrices_type=gguf_py.GGMLQuantizationType.Q4_1)}


@pytest.mark.parametrize("storage", list(GGUF_STORAGE))
def test_a_gguf_tensor_dequantised_rows_at_a_time_is_transformers_tensor_bit_for_bit(tmp_path, monkeypatch, storage):
    """Rows are dequantised a chunk at a time (7 rows here: 46 chunks for the embedding, the last one short; the q/k
    un-permutation after them), and every tensor is the one transformers' whole-file loader makes."""
    from transformers.modeling_gguf_pytorch_utils import load_gguf_checkpoint

    gguf_path = write_tiny_gguf(tmp_path / "tiny.gguf", make_source("llama", tied=False), make_tokenizer(),
                                **GGUF_STORAGE[storage])
    config = AutoModelForCausalLM.from_pretrained(tmp_path, gguf_file="tiny.gguf").config
    meta = meta_model(LlamaForCausalLM, plain_config(config))
    monkeypatch.setattr(checkpoints, "GGUF_DEQUANTISE_CHUNK_BYTES", 7 * SHAPE["hidden_size"] * 4)
    calls = []
    dequantize = checkpoints.gguf.dequantize
    monkeypatch.setattr(checkpoints.gguf, "dequantize", lambda *args: calls.append(args[0].shape) or dequantize(*args))
    streamed = GGUFCheckpoint(gguf_path, config, meta)
    whole = load_gguf_checkpoint(str(gguf_path), return_tensors=True, model_to_load=meta)["tensors"]
    assert streamed.infos().keys() == whole.keys()
    for name, tensor in whole.items():
        calls.clear()
        assert torch.equal(streamed.read(name), tensor), name
        rows, width = (tensor.shape[0], tensor.shape[1]) if tensor.dim() == 2 else (1, tensor.shape[0])
        assert len(calls) == -(-rows // max(1, 7 * SHAPE["hidden_size"] // width)), name
    assert len(whole["model.embed_tokens.weight"]) == 320 and VOCAB == 320  # 46 chunks
    source = make_source("llama", tied=False).model.embed_tokens.weight.detach()
    assert torch.equal(whole["model.embed_tokens.weight"], source) == (storage == "F32")  # stored as said


def test_a_gguf_tensor_is_dequantised_in_about_its_own_float32_memory(tmp_path, monkeypatch):
    """gguf-py's `dequantize` holds every group's output before concatenating them: twice the tensor in float32 beside
    the quantised bytes. Read a chunk of rows at a time, a Q8_0 embedding (2 MiB in float32) costs itself and a few
    chunks (64 KiB here); numpy's buffers and the bytes read are traced by `tracemalloc`."""
    import tracemalloc

    from transformers import LlamaConfig

    config = LlamaConfig(**SHAPE, vocab_size=16384, tie_word_embeddings=True, bos_token_id=1, eos_token_id=2)
    torch.manual_seed(0)
    gguf_path = write_tiny_gguf(tmp_path / "wide.gguf", LlamaForCausalLM(config), make_tokenizer(),
                                matrices_type=gguf_py.GGMLQuantizationType.Q8_0)
    config = AutoModelForCausalLM.from_pretrained(tmp_path, gguf_file="wide.gguf").config
    checkpoint = GGUFCheckpoint(gguf_path, config, meta_model(LlamaForCausalLM, plain_config(config)))
    monkeypatch.setattr(checkpoints, "GGUF_DEQUANTISE_CHUNK_BYTES", 64 << 10, raising=False)
    float32_bytes = 16384 * SHAPE["hidden_size"] * 4
    tracemalloc.start()
    try:
        tensor = checkpoint.read("model.embed_tokens.weight")
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    assert tensor.shape == (16384, SHAPE["hidden_size"]) and tensor.dtype == torch.float32
    assert float32_bytes <= peak < 1.25 * float32_bytes, (peak, float32_bytes)


def test_a_gguf_conversion_dequantises_each_tensor_once_before_verifying(tmp_path, monkeypatch):
    """The conversion write is the one read of the source (its NaN/inf check included): one dequantisation per GGUF
    tensor by the write, one more by the comparison of the written tensors with the source
    (`check_written_tensors`), up to the verification (which streams the source again, layer by layer)."""
    (tmp_path / "gguf").mkdir()
    gguf_path = write_tiny_gguf(tmp_path / "gguf" / "tiny.gguf", make_source("llama", tied=False), make_tokenizer())
    calls, at_verification = [], []
    dequantize = checkpoints.gguf.dequantize
    monkeypatch.setattr(checkpoints.gguf, "dequantize", lambda *args: calls.append(args[0].shape) or dequantize(*args))
    verify_written = api.verify_written
    monkeypatch.setattr(api, "verify_written", lambda source, *args: at_verification.append(
        (len(calls), len(source.checkpoint.infos()), source.checkpoint.dequantised)) or verify_written(source, *args))
    upcycle(gguf_path, tmp_path / "out", dar_block_size=2, tolerance=1e-5, full_greedy=False, prompts=["Hello"],
            progress=False)
    (dequantised, tensors, counted), = at_verification
    assert tensors == 3 + 3 * 9 and dequantised == counted == 2 * tensors  # embedding, norm, head; 9 per layer (3)


def test_a_gguf_source_is_parsed_once_per_conversion(tmp_path, monkeypatch):
    """Its config, this package's metadata checks, the tokenizer, the tensors' key map and their reader each made a
    `gguf.GGUFReader` of their own (transformers' loaders most of them): seven parses of the file per `dar convert`,
    about 4 s each for SmolLM2's (a quarter of the conversion). One now, by the API and by the CLI (whose MoE check
    reads the file first); gguf's own class is back afterwards."""
    (tmp_path / "gguf").mkdir()
    gguf_path = write_tiny_gguf(tmp_path / "gguf" / "tiny.gguf", make_source("llama", tied=False), make_tokenizer())
    original = gguf_py.GGUFReader
    parses = []
    parse = original.__init__
    monkeypatch.setattr(original, "__init__", lambda self, *args, **keywords: parses.append(args[0]) or
                        parse(self, *args, **keywords))
    upcycle(gguf_path, tmp_path / "api", dar_block_size=2, tolerance=1e-5, full_greedy=True, **FAST)
    assert parses == [str(gguf_path)]
    assert cli_main(["convert", str(gguf_path), str(tmp_path / "cli"), "--block-size", "2", "--tolerance", "1e-5",
                     "--max-new-tokens", "2"]) == 0
    assert parses == [str(gguf_path)] * 2
    assert gguf_py.GGUFReader is original
    assert {path.name for path in (tmp_path / "cli").iterdir()} == {path.name for path in (tmp_path / "api").iterdir()}


def test_readers_of_a_gguf_file_are_shared_only_while_it_is_unchanged(tmp_path):
    """Sharing is for the same bytes: a file rewritten meanwhile is parsed again, a writable map is the caller's
    own, nested uses share one cache, and the class is gguf's again when the outermost ends."""
    first = write_tiny_gguf(tmp_path / "first.gguf", make_source("llama", tied=False), make_tokenizer())
    original = gguf_py.GGUFReader
    with gguf_parsed_once():
        reader = gguf_py.GGUFReader(first)
        with gguf_parsed_once():
            assert gguf_py.GGUFReader(str(first)) is reader and gguf_py.GGUFReader(first, "r") is reader
        assert gguf_py.GGUFReader is not original and gguf_py.GGUFReader(first, "r+") is not reader
        write_tiny_gguf(first, make_source("llama", tied=True), make_tokenizer())
        rewritten = gguf_py.GGUFReader(first)
        assert rewritten is not reader and len(rewritten.tensors) == len(reader.tensors) - 1  # no output.weight
        with pytest.raises(FileNotFoundError):
            gguf_py.GGUFReader(tmp_path / "missing.gguf")
    assert gguf_py.GGUFReader is original and gguf_py.GGUFReader(first) is not rewritten
    # The swapped class, kept past the block (`from gguf import GGUFReader` in a module first imported meanwhile, or
    # another thread): it raised "'NoneType' object is not callable" at every use; it reads as gguf's own class now.
    with gguf_parsed_once():
        kept = gguf_py.GGUFReader
    assert kept is not original
    fresh = kept(first)
    assert type(fresh) is original and fresh is not kept(first) and len(fresh.tensors) == len(rewritten.tensors)


def test_a_gguf_tensor_the_model_has_no_parameter_for_is_refused_not_dropped(tmp_path):
    """A Llama GGUF with attention biases (which a Llama config without attention_bias has no parameter for):
    transformers' GGUF loader skips them, and so did the converter, verifying PASSED against the same bias-less
    reading. Refused like a safetensors source's unplaceable tensors, naming them; nothing written."""
    biases = {f"blk.{layer}.attn_{name}.bias": np.full(rows, 0.5, dtype=np.float32)
              for layer in range(2) for name, rows in (("q", 32), ("k", 16))}
    assert_gguf_refused(tmp_path, r"holds 4 tensor\(s\) that LlamaForCausalLM of its config has no parameter for: "
                                  r"\['blk\.0\.attn_q\.bias', 'blk\.0\.attn_k\.bias'", extra_tensors=biases)


def write_tiny_moe_gguf(path, extra_tensors=None, moe_intermediate_size=768):
    """A float32 Qwen3-MoE GGUF without a tokenizer (pass one), its tensors named by the inverse of transformers' own
    key map, the experts as llama.cpp stores them (`blk.N.ffn_{gate,up,down}_exps.weight`, gate and up apart);
    `extra_tensors` ({GGUF name: array}) after them. Its metadata carries the expert width as llama.cpp writes it
    (`expert_feed_forward_length`, which transformers' reader drops: 768, Qwen3MoeConfig's default, reads back)."""
    config = Qwen3MoeConfig(**SHAPE, vocab_size=VOCAB, head_dim=16, num_experts=2, num_experts_per_tok=2,
                            moe_intermediate_size=moe_intermediate_size, tie_word_embeddings=False)
    torch.manual_seed(0)
    model = spread_weights(Qwen3MoeForCausalLM(config))
    writer = gguf_writer(path, "qwen3moe", config)
    writer.add_key_length(config.head_dim)
    writer.add_value_length(config.head_dim)
    writer.add_expert_count(config.num_experts)
    writer.add_expert_used_count(config.num_experts_per_tok)
    writer.add_expert_feed_forward_length(config.moe_intermediate_size)
    gguf_names = {hf: name for name, hf in get_gguf_hf_weights_map(model, Qwen2MoeTensorProcessor()).items()}
    for name, tensor in model.state_dict().items():
        layer = name.split(".")[2] if name.startswith("model.layers.") else None
        if name.endswith("experts.gate_up_proj"):  # [E, 2I, D]: gate rows, then up rows
            gate, up = np.split(tensor.numpy(), 2, axis=1)
            writer.add_tensor(f"blk.{layer}.ffn_gate_exps.weight", np.ascontiguousarray(gate))
            writer.add_tensor(f"blk.{layer}.ffn_up_exps.weight", np.ascontiguousarray(up))
        else:  # the key map names an expert tensor without ".weight"
            gguf_name = gguf_names[name]
            writer.add_tensor(gguf_name if gguf_name.endswith((".weight", ".bias")) else f"{gguf_name}.weight",
                              tensor.numpy())
    finish_gguf(writer, extra_tensors)
    return path


def test_a_moe_gguf_tensor_the_model_has_no_parameter_for_is_refused_not_dropped(tmp_path):
    """As for a dense GGUF (above), for an MoE GGUF, which transformers' whole-file loader reads: a Qwen3-MoE file with
    an attention bias (Qwen3 has none) converted without it, PASSED. Refused in the dense path's words, nothing
    written; its expert tensors, which transformers' key map names without `.weight`, have their place: the file
    without the bias converts exactly."""
    assert_moe_gguf_refused(tmp_path, r"tiny\.gguf: the file holds 1 tensor\(s\) that Qwen3MoeForCausalLM of its "
                                      r"config has no parameter for: \['blk\.0\.attn_q\.bias'\]\. transformers' "
                                      r"GGUF loader skips them .*nothing is converted\.$",
                            extra_tensors={"blk.0.attn_q.bias": np.full(64, 0.5, np.float32)})
    result = upcycle_to_dar_moe(write_tiny_moe_gguf(tmp_path / "gguf" / "clean.gguf"), tmp_path / "out",
                                tokenizer=make_tokenizer(), tolerance=1e-5, full_greedy=False, prompts=["Hello"],
                                progress=False)
    assert result.report.passed


def test_a_moe_gguf_whose_expert_width_transformers_does_not_read_is_refused_naming_it(tmp_path):
    """A Qwen3-MoE GGUF of experts 24 wide: transformers' GGUF reader drops `expert_feed_forward_length` and builds
    experts 768 wide (Qwen3MoeConfig's default), and the conversion was refused by the plan saying the weights "do not
    match its config.json" (a GGUF file has none), with no word of why. Refused when its metadata is read, naming the
    key, its value and the config field transformers holds instead; nothing written."""
    assert_moe_gguf_refused(tmp_path, r"tiny\.gguf: its metadata qwen3moe\.expert_feed_forward_length = 24, but "
                                      r"transformers' GGUF reader drops it and builds the model with "
                                      r"moe_intermediate_size = 768, .*nothing is converted\.", moe_intermediate_size=24)


def test_a_moe_gguf_is_read_with_the_routing_llama_cpp_computes_for_its_architecture(tmp_path, monkeypatch):
    """llama.cpp's qwen3moe graph renormalises the top-k expert weights whatever the file's metadata says; transformers'
    GGUF reader builds the same only through its per-architecture defaults (Qwen3MoeConfig's own default is False).
    The tiny file is read so; without that default (a transformers release that drops it), refused naming the field
    and both values, nothing written. The tiny file's top 2 of 2 experts would convert PASSED either way (the
    renormalisation divides by 1), so only this check catches it."""
    (tmp_path / "gguf").mkdir()
    gguf_path = write_tiny_moe_gguf(tmp_path / "gguf" / "tiny.gguf")
    assert load_source_config(gguf_path).norm_topk_prob is True
    monkeypatch.delitem(GGUF_CONFIG_DEFAULTS_MAPPING, "qwen3_moe")
    before = {p.name for p in tmp_path.iterdir()}
    with pytest.raises(ValueError, match=r"tiny\.gguf: llama\.cpp's qwen3moe model computes norm_topk_prob = True "
                                         r"whatever the file says, but transformers' GGUF reader builds the model "
                                         r"with norm_topk_prob = False, .*nothing is converted\."):
        upcycle_to_dar_moe(gguf_path, tmp_path / "out", tokenizer=make_tokenizer(), progress=False)
    assert_nothing_written(tmp_path, before)


def assert_moe_gguf_refused(tmp_path, match: str, **gguf_fields) -> None:
    """A tiny Qwen3-MoE GGUF written with `gguf_fields` (`write_tiny_moe_gguf`'s) is refused by `upcycle_to_dar_moe`
    with an error matching `match`, and nothing is written."""
    (tmp_path / "gguf").mkdir()
    gguf_path = write_tiny_moe_gguf(tmp_path / "gguf" / "tiny.gguf", **gguf_fields)
    before = {p.name for p in tmp_path.iterdir()}
    with pytest.raises(ValueError, match=match):
        upcycle_to_dar_moe(gguf_path, tmp_path / "out", tokenizer=make_tokenizer(), progress=False)
    assert_nothing_written(tmp_path, before)


def test_a_gguf_head_size_that_transformers_does_not_read_is_refused_naming_it(tmp_path):
    """A Llama GGUF whose key length is not hidden size / heads: transformers' reader drops the key and computes the
    head dimension from the shape. Refused naming the key and the head dimension transformers uses."""
    assert_gguf_refused(tmp_path, r"tiny\.gguf: its metadata llama\.attention\.key_length = 16, but transformers' GGUF "
                                  r"reader drops it and builds the model with head_dim = 8, ",
                        extra_metadata={"llama.attention.key_length": 16})


def test_a_gguf_tensor_of_a_type_gguf_cannot_dequantise_is_refused_naming_it(tmp_path, monkeypatch):
    """A GGUF tensor stored in a GGML type that gguf-py's `dequantize` does not implement (Q8_1 here; F64, the
    integer types and Q1_0 alike): the metadata, the config and the plan went through, and the write stopped on that
    tensor with a NotImplementedError traceback. Refused in one line naming the file, the tensor and its type; the
    staging folder is removed."""
    add_tensor = gguf_py.GGUFWriter.add_tensor

    def values_in_q8_1(self, name, array, *args, **kwargs):
        if name == "blk.0.attn_v.weight":  # [16, 32]: one Q8_1 block (32 values, 40 bytes) per row
            raw = np.zeros((array.shape[0], 40), dtype=np.uint8)
            return add_tensor(self, name, raw, raw_dtype=gguf_py.GGMLQuantizationType.Q8_1)
        return add_tensor(self, name, array, *args, **kwargs)

    monkeypatch.setattr(gguf_py.GGUFWriter, "add_tensor", values_in_q8_1)
    assert_gguf_refused(tmp_path, r"GGUF file .*tiny\.gguf: tensor blk\.0\.attn_v\.weight is stored as Q8_1, which the "
                                  r"gguf package .* cannot dequantise .*Convert a GGUF file whose tensors are")


def assert_gguf_refused(tmp_path, match: str, metadata_fields=None, **gguf_fields) -> None:
    """A tiny untied Llama GGUF written with `gguf_fields` (`write_tiny_gguf`'s extras), its metadata written from
    the config with `metadata_fields` set (the tensors unchanged), is refused by `upcycle` with an error matching
    `match`, and nothing is written."""
    (tmp_path / "gguf").mkdir()
    model = make_source("llama", tied=False)
    for field, value in (metadata_fields or {}).items():
        setattr(model.config, field, value)
    gguf_path = write_tiny_gguf(tmp_path / "gguf" / "tiny.gguf", model, make_tokenizer(), **gguf_fields)
    before = {p.name for p in tmp_path.iterdir()}
    with pytest.raises(ValueError, match=match):
        upcycle(gguf_path, tmp_path / "out", dar_block_size=2, progress=False)
    assert_nothing_written(tmp_path, before)


@pytest.mark.parametrize("metadata_fields, match", [
    # "do not match its config.json", for a source that has none:
    ({"intermediate_size": 48}, r"^The weights in GGUF file .*tiny\.gguf do not match its GGUF metadata: shapes "
                                r"\(found, expected\) \{'model\.layers\.0\.mlp\.gate_proj\.weight': "
                                r"\(\(64, 32\), \(48, 32\)\)"),
    # blamed on the block size ("dar_block_size must be an integer in [1, 0]"):
    ({"num_hidden_layers": 0}, r"^GGUF file .*tiny\.gguf: its metadata block_count is 0; a model to convert needs 1 "
                               r"or more decoder layers\.$"),
])
def test_a_gguf_whose_metadata_does_not_fit_its_tensors_is_refused_naming_the_metadata(tmp_path, metadata_fields,
                                                                                          match):
    assert_gguf_refused(tmp_path, match, metadata_fields)


def test_a_row_outside_a_tensor_is_an_error_naming_it_not_an_empty_read(tmp_path):
    """Rows are read at their byte offsets: a row past the end came back empty (or would be the next tensor's
    bytes), and the error surfaced later as a shape mismatch that named nothing."""
    source = save_source(tmp_path / "source")
    folder = SafetensorsCheckpoint(source)
    in_memory = StateDictCheckpoint(load_file(source / "model.safetensors"))
    try:
        for checkpoint in (folder, in_memory):
            assert checkpoint.read_rows("model.embed_tokens.weight", torch.tensor([3, 0, 3])).shape == (3, 32)
            for row in (320, -1):
                with pytest.raises(IndexError, match=rf"row {row} of tensor 'model\.embed_tokens\.weight' is out of "
                                                     r"range \(it has 320 rows\)"):
                    checkpoint.read_rows("model.embed_tokens.weight", torch.tensor([5, row]))
    finally:
        folder.close()


def rewrite_safetensors(path, edit_header, pad_front: int = 0, pad_back: int = 0) -> None:
    """Rewrite a safetensors file's header with `edit_header(header)`, its data buffer padded with zero bytes."""
    raw = path.read_bytes()
    (size,) = struct.unpack("<Q", raw[:8])
    header = json.loads(raw[8:8 + size])
    edit_header(header)
    encoded = json.dumps(header, separators=(",", ":")).encode()
    encoded += b" " * (-len(encoded) % 8)
    path.write_bytes(struct.pack("<Q", len(encoded)) + encoded + bytes(pad_front) + raw[8 + size:] + bytes(pad_back))


def point_layer_1_norm_at_layer_0s(header):
    header["model.layers.1.input_layernorm.weight"]["data_offsets"] = \
        header["model.layers.0.input_layernorm.weight"]["data_offsets"]


def shift_every_tensor(header):
    for name, entry in header.items():
        if name != "__metadata__":
            entry["data_offsets"] = [offset + 8 for offset in entry["data_offsets"]]


@pytest.mark.parametrize("damage, edit, pad_front, pad_back, expected", [
    ("overlapping", point_layer_1_norm_at_layer_0s, 0, 0,
     r"tensor 'model\.layers\.1\.input_layernorm\.weight': data offsets \d+\.\.\d+ overlap tensor "
     r"'model\.layers\.0\.input_layernorm\.weight', which ends at \d+"),
    ("not from 0", shift_every_tensor, 8, 0, r"tensor '[\w.]+': data offsets 8\.\.\d+ do not start the data buffer at 0"),
    ("trailing bytes", lambda header: None, 0, 16, r"its tensors' data ends at byte (\d+) of a \d+-byte data buffer"),
])
def test_a_safetensors_header_whose_tensors_do_not_tile_the_data_is_refused_as_the_library_does(
        tmp_path, damage, edit, pad_front, pad_back, expected):
    """Each tensor's byte length and end were checked, not that the tensors tile the data buffer: a header pointing
    layer 1's norm at layer 0's bytes, which the safetensors library and transformers refuse ("invalid offset"),
    converted PASSED with layer 0's norm in layer 1. Refused as the library does, naming the file and the tensor."""
    source = save_source(tmp_path / "source")
    weights = source / "model.safetensors"
    rewrite_safetensors(weights, edit, pad_front, pad_back)
    with pytest.raises(Exception):  # the library's own verdict on the same file
        with safe_open(str(weights), "pt") as file:
            file.get_tensor("model.norm.weight")
    before = {p.name for p in tmp_path.iterdir()}
    with pytest.raises(ValueError, match=rf"Could not load the weights in .*source: model\.safetensors is not a valid "
                                         rf"safetensors file \({expected}\)"):
        upcycle(source, tmp_path / "out", dar_block_size=2, progress=False)
    assert_nothing_written(tmp_path, before)


@pytest.mark.parametrize("metadata, named", [
    ({"llama.rope.scaling.type": "linear", "llama.rope.scaling.factor": 4.0}, r"llama\.rope\.scaling\.factor = 4\.0"),
    ({"llama.rope.scaling.type": "yarn", "llama.rope.scaling.factor": 4.0}, r"llama\.rope\.scaling\.type = 'yarn'"),
    ({"llama.rope.scaling.factor": 4.0}, r"llama\.rope\.scaling\.factor = 4\.0"),
    ({"llama.attention.sliding_window": 16}, r"llama\.attention\.sliding_window = 16"),
    ({"llama.logit_scale": 0.25}, r"llama\.logit_scale = 0\.25"),
    ({"llama.attention.causal": False}, r"llama\.attention\.causal = False"),
])
def test_gguf_metadata_that_transformers_drops_but_changes_the_function_is_refused(tmp_path, metadata, named):
    """Rope scaling (a context-extended GGUF), a sliding window, a logit scale or bidirectional attention (`causal`
    false: an embedding model exported as a Llama) in a Llama GGUF's metadata: llama.cpp applies them, transformers'
    GGUF config reader drops them, and the converter used to verify PASSED against that default reading (5.6 logits
    away from the file's model for the rope; a causal model for a bidirectional one). Refused before any weight is
    read, naming the key and its value; nothing written."""
    assert_gguf_refused(tmp_path, rf"GGUF file .*tiny\.gguf: its metadata {named} changes what the model computes in "
                                  r"llama\.cpp, and transformers' GGUF reader drops it", extra_metadata=metadata)


@pytest.mark.parametrize("scaling", [
    {"llama.rope.scaling.type": "none", "llama.rope.scaling.factor": 1.0},
    {"llama.rope.scaling.type": "none", "llama.rope.scaling.factor": 4.0},  # "none" scales by nothing in llama.cpp
    {"llama.rope.scaling.type": "linear", "llama.rope.scaling.factor": 1.0},  # both were refused as changing the model
    {"llama.rope.scaling.type": "linear"},
])
def test_gguf_metadata_at_its_neutral_values_is_read_as_transformers_reads_it(tmp_path, scaling):
    """The same keys at the values under which dropping them changes nothing (scaling "none" whatever its factor,
    linear by 1 or by no factor, window 0)."""
    (tmp_path / "gguf").mkdir()
    neutral = {**scaling, "llama.attention.sliding_window": 0, "llama.attention.key_length": 8,
               "llama.attention.causal": True}
    gguf_path = write_tiny_gguf(tmp_path / "gguf" / "tiny.gguf", make_source("llama", tied=False), make_tokenizer(),
                                extra_metadata=neutral)
    assert load_source_config(gguf_path).model_type == "llama"


@pytest.mark.parametrize("method, value, named", [
    ("add_head_count_kv", 3, r"num_key_value_heads=3 does not divide num_attention_heads=4"),  # SDPA's traceback
    ("add_head_count_kv", 0, r"cannot be built from it \(ZeroDivisionError"),  # a traceback in open_source
    ("add_rope_freq_base", 0.0, r"rope_theta=0\.0 \(rope_parameters\) must be a positive finite number"),  # FAILED
    ("add_layer_norm_rms_eps", -1.0, r"rms_norm_eps=-1\.0 must be a finite number >= 0"),  # FAILED, NaN
], ids=["kv_heads", "kv_heads_zero", "rope_theta_zero", "eps_negative"])
def test_gguf_metadata_no_forward_runs_with_is_refused_as_a_folders_config_is(tmp_path, monkeypatch, method, value,
                                                                               named):
    """The config transformers reads from a GGUF file's metadata was checked for what transformers drops, not for
    what it cannot run: key/value heads that do not divide the heads, or none, ended in tracebacks; a zero rope base
    or a negative norm eps made the source itself NaN, reported as a FAILED check. Refused as a folder's config.json
    is (`check_model_builds`), naming the file. The metadata key is written with `value`, the tensors as they are."""
    write = getattr(gguf_py.GGUFWriter, method)
    monkeypatch.setattr(gguf_py.GGUFWriter, method, lambda self, _: write(self, value))
    assert_gguf_refused(tmp_path, rf"Invalid GGUF file .*tiny\.gguf \(the config transformers reads from its "
                                  rf"metadata\): .*{named}")


def test_a_llama_gguf_without_head_count_kv_is_refused(tmp_path, monkeypatch):
    """llama.cpp's converter writes no head_count_kv for a config.json without num_key_value_heads (Llama-1-era):
    llama.cpp then takes as many key/value heads as heads, while transformers' reader leaves q and k in llama.cpp's
    rotary layout. The conversion verified PASSED against that reading, 13.4 logits away from the file's model."""
    monkeypatch.setattr(gguf_py.GGUFWriter, "add_head_count_kv", lambda self, count: None)
    assert_gguf_refused(tmp_path, r"GGUF file .*tiny\.gguf has no llama\.attention\.head_count_kv: llama\.cpp then "
                                  r"gives the model as many key/value heads as heads")



def test_a_llama_gguf_whose_rotary_does_not_span_its_heads_is_refused_naming_the_key(tmp_path, monkeypatch):
    """A llama GGUF without `attention.key_length` whose `rope.dimension_count` (4) is not embedding_length /
    head_count (8): llama.cpp refuses it (invalid n_rot), and transformers' reader takes the rotary for the head size.
    It was refused with a 643-character list of mismatched projection shapes that named no metadata."""
    add_rotary = gguf_py.GGUFWriter.add_rope_dimension_count
    monkeypatch.setattr(gguf_py.GGUFWriter, "add_rope_dimension_count",
                        lambda self, count: add_rotary(self, count // 2))
    assert_gguf_refused(tmp_path, r"^GGUF file .*tiny\.gguf: its metadata llama\.rope\.dimension_count = 4 is not "
                                  r"its head size 8 \(llama\.embedding_length 32 / llama\.attention\.head_count 4; it "
                                  r"has no llama\.attention\.key_length\): llama\.cpp refuses such a llama file "
                                  r".*nothing is converted\.$")



def test_a_llama_gguf_whose_heads_are_as_wide_as_its_rotary_converts(tmp_path):
    """The control of the refusal above, from a review: a Mistral-Nemo-shaped file (head_dim 16, not hidden 32 / 4
    heads) written without key_length, whose rotary (16) spans its heads as transformers reads them and whose
    tensors fit them. It converted exactly before the check existed; the check refused it, saying the tensors did not
    fit. It converts."""
    (tmp_path / "gguf").mkdir()
    torch.manual_seed(0)
    model = spread_weights(LlamaForCausalLM(LlamaConfig(**SHAPE, head_dim=16, vocab_size=VOCAB,
                                                        tie_word_embeddings=False, bos_token_id=1, eos_token_id=2)))
    gguf_path = write_tiny_gguf(tmp_path / "gguf" / "nemo.gguf", model, make_tokenizer())
    assert upcycle(gguf_path, tmp_path / "out", dar_block_size=2, max_new_tokens=0, progress=False).report.passed

def test_a_gguf_special_token_past_its_vocabulary_is_named_in_the_tokenizer_error(tmp_path, monkeypatch):
    """transformers' GGUF tokenizer reader fails on a special token id past the token list with "list index out of
    range", which named no key; the refusal names the key, its value and the list's length. Nothing is written."""
    add_eos = gguf_py.GGUFWriter.add_eos_token_id
    monkeypatch.setattr(gguf_py.GGUFWriter, "add_eos_token_id", lambda self, token: add_eos(self, 100000))
    assert_gguf_refused(tmp_path, r"Could not load the tokenizer of .*gguf from tiny\.gguf .*: .* \(its metadata "
                                  r"tokenizer\.ggml\.eos_token_id = 100000: past the 320 tokens of "
                                  r"tokenizer\.ggml\.tokens\)$")


@pytest.mark.parametrize("used", [3, 0])
def test_a_moe_gguf_routing_to_more_experts_than_it_has_is_refused_naming_both_keys(tmp_path, monkeypatch, used):
    """An MoE GGUF whose expert_used_count is not 1 to its expert_count (llama.cpp asserts it): the refusal named
    DARMoeConfig's num_experts_per_tok ("the source's config", 3 or 0 of 2), as if the converter had chosen the
    value. Named by both metadata keys; nothing is written."""
    monkeypatch.setattr(gguf_py.GGUFWriter, "add_expert_used_count",
                        lambda self, count, add=gguf_py.GGUFWriter.add_expert_used_count: add(self, used))
    assert_moe_gguf_refused(tmp_path, rf"^GGUF file .*tiny\.gguf: its metadata qwen3moe\.expert_used_count = {used} is "
                                      r"not between 1 and qwen3moe\.expert_count = 2 .*nothing is converted\.$")

def test_a_gguf_file_with_an_upper_case_suffix_converts_as_transformers_reads_it(tmp_path):
    """"MODEL.GGUF" (an upper-case suffix, as some downloads are named) was refused as "not a .gguf file", though
    transformers reads it as one. It converts exactly; a file of another suffix is still refused."""
    (tmp_path / "gguf").mkdir()
    gguf_path = write_tiny_gguf(tmp_path / "gguf" / "TINY.GGUF", make_source("llama", tied=False), make_tokenizer())
    result = upcycle(gguf_path, tmp_path / "out", max_new_tokens=0)
    assert result.report.passed and (tmp_path / "out" / "config.json").is_file()
    other = gguf_path.with_suffix(".bin")
    gguf_path.rename(other)
    with pytest.raises(ValueError, match=r"is not a \.gguf file"):
        upcycle(other, tmp_path / "out2", max_new_tokens=0)


def mixed_precision_source(folder):
    """A source of bf16 matrices with float32 norms whose values bf16 does not hold (1 + 3e-6 noise, as a checkpoint
    saved with `_keep_in_fp32_modules` holds them), config.json saying bfloat16."""
    source = save_source(folder)
    generator = torch.Generator().manual_seed(0)
    state = {name: (tensor + 3e-6 * torch.randn(tensor.shape, generator=generator)) if "norm" in name
             else tensor.to(torch.bfloat16) for name, tensor in load_file(source / "model.safetensors").items()}
    save_file(state, source / "model.safetensors", metadata={"format": "pt"})
    config = json.loads((source / "config.json").read_text())
    (source / "config.json").write_text(json.dumps({**config, "dtype": "bfloat16"}))
    return source, state


def test_a_mixed_precision_source_keeps_every_tensor_as_stored_under_auto(tmp_path):
    """bf16 matrices with float32 norms under the default dtype ("auto"): every tensor was cast to the dtype of most
    bytes (bf16), rounding the norms, and the conversion still PASSED (within the bar) with a card saying "weights
    dtype bfloat16" and nothing of the rounding. Now each source tensor is written as the source stores it, bit for
    bit: the norms float32, the matrices bf16, the config bf16 (as the source's); the card and the check line say
    both dtypes. An explicit --dtype bfloat16 still rounds them, as asked: the next test."""
    source, state = mixed_precision_source(tmp_path / "source")
    result = upcycle(source, tmp_path / "out", dar_block_size=2, full_greedy=False, progress=False)
    assert result.report.passed and result.config.dtype == torch.bfloat16
    written = written_state(tmp_path / "out")
    norms = [name for name in state if "norm" in name]
    assert len(norms) == 7  # 3 layers x 2, and the final norm
    for name, tensor in state.items():
        assert written[name].dtype == tensor.dtype and torch.equal(written[name], tensor), name
    assert not any(torch.equal(state[name], state[name].to(torch.bfloat16).float()) for name in norms)  # bf16 rounds
    card = (tmp_path / "out" / "README.md").read_text()
    assert re.search(r"\| weights dtype \| bfloat16; 7 tensor\(s\) in float32 as the source stores them "
                     r"\(model\.layers\.0\.input_layernorm\.weight, model\.layers\.0\.post_attention_layernorm"
                     r"\.weight, \.\.\.\); DAR's own parameters float32, as they load \|", card)
    assert "from bfloat16 and float32 weights" in result.report.table() + card


def test_a_gguf_files_license_metadata_reaches_the_card(tmp_path):
    """A GGUF file carries its license in `general.license*` (llama.cpp's converter copies the model card's); the card
    said `license: other`. Its front matter now has the file's license, name and link; a file without them still
    gives `license: other`, never a made-up license."""
    (tmp_path / "gguf").mkdir()
    licensed = write_tiny_gguf(tmp_path / "gguf" / "licensed.gguf", make_source("llama", tied=False), make_tokenizer(),
                               extra_metadata={"general.license": "llama3.2", "general.license.name": "llama3.2",
                                               "general.license.link": "https://example.com/LICENSE"})
    upcycle(licensed, tmp_path / "out", max_new_tokens=0, progress=False)
    card = (tmp_path / "out" / "README.md").read_text()
    front_matter = card.split("---\n")[1].splitlines()
    assert {"license: llama3.2", "license_name: llama3.2", "license_link: https://example.com/LICENSE"} <= set(
        front_matter)
    # and how the file stored its weights, which the weights dtype row (float32, dequantised) alone does not say
    assert re.search(r"\(GGUF file licensed\.gguf: F32 x \d+ tensors, dequantised to float32\) converted into", card)
    plain = write_tiny_gguf(tmp_path / "gguf" / "plain.gguf", make_source("llama", tied=False), make_tokenizer())
    upcycle(plain, tmp_path / "out2", max_new_tokens=0, progress=False)
    assert "license: other" in (tmp_path / "out2" / "README.md").read_text().split("---\n")[1].splitlines()


def test_a_gguf_files_named_chat_templates_travel_with_the_tokenizer(tmp_path):
    """A GGUF file's named chat templates (`tokenizer.chat_template.tool_use`, as llama.cpp writes a card's named
    templates): transformers' GGUF tokenizer reader keeps the default one only, and the conversion dropped the rest
    without a word. They are written beside the default (additional_chat_templates/) and load back by name."""
    (tmp_path / "gguf").mkdir()
    tool_use = "TOOLS {% for message in messages %}{{ message['content'] }}{% endfor %}"
    gguf_path = write_tiny_gguf(tmp_path / "gguf" / "tiny.gguf", make_source("llama", tied=False), make_tokenizer(),
                                extra_metadata={"tokenizer.chat_template.tool_use": tool_use})
    upcycle(gguf_path, tmp_path / "out", max_new_tokens=0, progress=False)
    assert (tmp_path / "out" / "additional_chat_templates" / "tool_use.jinja").read_text() == tool_use
    templates = AutoTokenizer.from_pretrained(tmp_path / "out").chat_template
    assert templates == {"default": make_tokenizer().chat_template, "tool_use": tool_use}
    # Named templates without a default one (an empty tokenizer.chat_template): they travel; the chat prompt, which
    # needs a default, is left out of the verification (the named templates made it fail before).
    no_default = make_tokenizer()
    no_default.chat_template = ""
    named_only = write_tiny_gguf(tmp_path / "gguf" / "named_only.gguf", make_source("llama", tied=False), no_default,
                                 extra_metadata={"tokenizer.chat_template.tool_use": tool_use})
    result = upcycle(named_only, tmp_path / "out_named", max_new_tokens=0, progress=False)
    assert result.report.passed and not any(check.name.startswith("chat") for check in result.report.checks)
    assert AutoTokenizer.from_pretrained(tmp_path / "out_named").chat_template == {"tool_use": tool_use}
    # A name that is a path would be written outside additional_chat_templates/: refused naming the key.
    hostile = write_tiny_gguf(tmp_path / "gguf" / "hostile.gguf", make_source("llama", tied=False), make_tokenizer(),
                              extra_metadata={"tokenizer.chat_template.../../evil": tool_use})
    before = {p.name for p in tmp_path.iterdir()}
    with pytest.raises(ValueError, match=r"hostile\.gguf: its chat template 'tokenizer\.chat_template\.\.\./\.\./evil' "
                                         r"has a name that is no file name"):
        upcycle(hostile, tmp_path / "out2", max_new_tokens=0, progress=False)
    assert_nothing_written(tmp_path, before)
    assert not list(tmp_path.rglob("evil*"))
    # A template named "default" is how transformers names the default one: where it differs from the file's default
    # template (or there is none), one of the two would be lost (the named one replaced the default): refused.
    for tokenizer, label in ((make_tokenizer(), "its default one"), (no_default, "its (absent) default one")):
        clash = write_tiny_gguf(tmp_path / "gguf" / "clash.gguf", make_source("llama", tied=False), tokenizer,
                                extra_metadata={"tokenizer.chat_template.default": tool_use})
        with pytest.raises(ValueError, match=rf"clash\.gguf: its chat template 'tokenizer\.chat_template\.default' "
                                             rf"differs from {re.escape(label)}"):
            upcycle(clash, tmp_path / "out2", max_new_tokens=0, progress=False)
        assert_nothing_written(tmp_path, before | {"gguf"})
    same = write_tiny_gguf(tmp_path / "gguf" / "same.gguf", make_source("llama", tied=False), make_tokenizer(),
                           extra_metadata={"tokenizer.chat_template.default": make_tokenizer().chat_template})
    upcycle(same, tmp_path / "out_same", max_new_tokens=0, progress=False)
    assert AutoTokenizer.from_pretrained(tmp_path / "out_same").chat_template == make_tokenizer().chat_template


def test_a_float8_source_converts_exactly_under_auto(tmp_path):
    """float8 matrices (plain values, no scales) with bf16 norms: "auto" took float8, the dtype of most bytes, as the
    model's and failed with "couldn't find storage object Float8_e4m3fnStorage". bfloat16 holds every float8 value, so
    "auto" widens them to it, exactly, and the conversion passes. The card says the source was float8 (its weights
    dtype row alone said bfloat16, as if the source were)."""
    source = save_source(tmp_path / "source")
    state = {name: tensor.to(torch.bfloat16 if "norm" in name else torch.float8_e4m3fn).contiguous()
             for name, tensor in load_file(source / "model.safetensors").items()}
    save_file(state, source / "model.safetensors", metadata={"format": "pt"})
    result = upcycle(source, tmp_path / "out", dar_block_size=2, full_greedy=False, progress=False)
    assert result.report.passed and result.config.dtype == torch.bfloat16
    written = written_state(tmp_path / "out")
    for name, tensor in state.items():
        assert written[name].dtype == torch.bfloat16 and torch.equal(written[name].float(), tensor.float()), name
    floats8 = sum(tensor.dtype == torch.float8_e4m3fn for tensor in state.values())
    card = (tmp_path / "out" / "README.md").read_text()
    assert (f"(HF folder source: float8_e4m3fn x {floats8}, bfloat16 x {len(state) - floats8} tensors, float8 widened "
            f"exactly)") in card


def test_an_in_memory_mixed_precision_model_keeps_its_dtypes_and_a_cast_one_is_told_why_it_fails():
    """In memory, as written: bf16 matrices with float32 norms (parameters cast, buffers not) convert with every tensor
    in the dtype the source holds it in, and verify. A model cast whole by `model.to(torch.bfloat16)` has bf16 rotary
    frequencies, which the converted model (built as from_pretrained builds it) keeps float32: the check fails, and
    said "The weights were rounded to bfloat16"; it now names the rounded rotary buffers and what to do."""
    source = make_source("llama")
    generator = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for name, parameter in source.named_parameters():
            parameter.data = (parameter.data + 3e-6 * torch.randn(parameter.shape, generator=generator)
                              if "norm" in name else parameter.data.to(torch.bfloat16))
    result = upcycle(source, None, tokenizer=make_tokenizer(), dar_block_size=2, full_greedy=False, progress=False)
    assert result.report.passed and "from bfloat16 and float32 weights" in result.report.table()
    converted = result.model.state_dict()
    for name, tensor in source.state_dict().items():
        if name in converted:
            assert converted[name].dtype == tensor.dtype and torch.equal(converted[name], tensor), name
    with pytest.raises(VerificationError, match=r"The source's rotary frequencies \(model\.rotary_emb\.inv_freq, "
                                                r"model\.rotary_emb\.original_inv_freq\) are bfloat16: "
                                                r"model\.to\(dtype\) rounds them"):
        upcycle(make_source("llama").to(torch.bfloat16), None, tokenizer=make_tokenizer(), dar_block_size=2,
                full_greedy=False, progress=False)


def test_a_mixed_precision_source_refused_by_rounding_is_pointed_to_the_exact_dtype(tmp_path):
    """The same source with --dtype bfloat16 rounds the norms, which verification refuses (noise 1e-5); the refusal
    names the rounded tensors and --dtype float32, which converts exactly (before, it suggested only a larger
    tolerance, which writes the rounded norms)."""
    source = save_source(tmp_path / "source")
    state = {name: tensor if "norm" in name else tensor.to(torch.bfloat16)
             for name, tensor in load_file(source / "model.safetensors").items()}
    save_file(state, source / "model.safetensors", metadata={"format": "pt"})
    with pytest.raises(VerificationError, match=r"source tensor\(s\) hold values that bfloat16 rounds "
                                                r"\(model\.layers\.0\.input_layernorm\.weight.*--dtype float32"):
        upcycle(source, tmp_path / "out", dar_block_size=2, full_greedy=False, progress=False, dtype=torch.bfloat16)
    assert not (tmp_path / "out").exists()
    upcycle(source, tmp_path / "out", dar_block_size=2, full_greedy=False, progress=False, dtype=torch.float32)


def test_the_rounding_hint_counts_only_lossy_casts_and_names_the_dtype_that_is_exact():
    """Widening is exact (bf16 or fp16 into float32, float32 into float64), so it is never called rounding; bf16 and
    fp16 round each other, so a source holding both is exact only in float32."""
    def infos(*dtypes):
        return StateDictCheckpoint({f"t{i}": torch.zeros(2, dtype=dtype) for i, dtype in enumerate(dtypes)})

    bf16_only, mixed, half_mix = infos(torch.bfloat16), infos(torch.bfloat16, torch.float32), infos(torch.bfloat16,
                                                                                                     torch.float16)
    assert rounded_tensors(bf16_only, torch.float32) == [] and exact_storage_dtype(bf16_only) == torch.bfloat16
    assert rounded_tensors(mixed, torch.bfloat16) == [("t1", torch.float32)]
    assert exact_storage_dtype(mixed) == torch.float32
    assert rounded_tensors(half_mix, torch.float16) == [("t0", torch.bfloat16)]
    assert exact_storage_dtype(half_mix) == torch.float32


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


@pytest.mark.parametrize("source_kind, dtype", [("safetensors", None), ("safetensors", "bfloat16"), ("gguf", None)])
def test_a_non_finite_weight_is_refused_by_the_write_in_its_staging_folder(tmp_path, monkeypatch, source_kind, dtype):
    """The check is the writer's one read (a byte-for-byte copy, a cast, a dequantised GGUF tensor): it stops the write
    part-way, with shards already in the staging folder, which is removed; nothing reaches the output's parent."""
    model = make_source("llama", tied=False)
    with torch.no_grad():
        model.model.layers[2].mlp.down_proj.weight[5, 7] = float("-inf")  # late: earlier shards are written first
    if source_kind == "gguf":
        (tmp_path / "source").mkdir()
        source = write_tiny_gguf(tmp_path / "source" / "tiny.gguf", model, make_tokenizer())
    else:
        model.save_pretrained(tmp_path / "source")
        make_tokenizer().save_pretrained(tmp_path / "source")
        source = tmp_path / "source"
    staged = []
    write_converted_folder = api.write_converted_folder

    def spy(folder, *args):
        staged.append(folder)
        try:
            write_converted_folder(folder, *args)
        finally:
            staged.append(sorted(path.name for path in folder.iterdir()))

    monkeypatch.setattr(api, "write_converted_folder", spy)
    with pytest.raises(ValueError, match=r"tensor 'model\.layers\.2\.mlp\.down_proj\.weight' holds NaN or infinite "
                                         r"values \(in rows 0\.\.\d+\); a broken source is not converted"):
        upcycle(source, tmp_path / "out", dtype=dtype, max_shard_size="20KB", progress=False)
    folder, written = staged
    assert folder.parent == tmp_path and folder.name != "out" and len(written) > 1  # shards were being staged
    assert not folder.exists() and sorted(p.name for p in tmp_path.iterdir()) == ["source"]


def test_a_byte_copied_tensor_that_fails_to_read_names_the_source_file(tmp_path):
    """A non-floating tensor is copied by the kernel (`copy_file_range`), falling back to a read through user space;
    a source that shrank under that copy is named as the source by the fallback's read, as by every other read."""
    from dar_transformers.conversion import write
    from dar_transformers.conversion.checkpoints import FiniteCheckpoint, SafetensorsCheckpoint
    from dar_transformers.conversion.keymaps import TensorPlan

    folder = tmp_path / "source"
    folder.mkdir()
    save_file({"steps": torch.arange(4096, dtype=torch.int64)}, folder / "model.safetensors")
    checkpoint = SafetensorsCheckpoint(folder)
    plan_ = TensorPlan((4096,), torch.int64, parts=("steps",))
    with open(tmp_path / "copy", "wb") as target:  # intact: copied as it is
        write._write_tensor(plan_, FiniteCheckpoint(checkpoint), checkpoint.infos(), target)
    assert torch.equal(torch.frombuffer(bytearray((tmp_path / "copy").read_bytes()), dtype=torch.int64),
                       torch.arange(4096))
    with open(folder / "model.safetensors", "r+b") as file:
        file.truncate((folder / "model.safetensors").stat().st_size - 1024)
    with open(tmp_path / "copy2", "wb") as target, pytest.raises(
            OSError, match=rf"Could not read the source file {folder.resolve() / 'model.safetensors'}: .*shorter"):
        write._write_tensor(plan_, FiniteCheckpoint(checkpoint), checkpoint.infos(), target)
    checkpoint.close()
