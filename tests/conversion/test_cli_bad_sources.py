# SPDX-License-Identifier: Apache-2.0
"""`dar convert` on broken and untrusted sources: a tiny Llama source with a tokenizer, the source's bytes hashed before
and after. Where what runs in a fresh process is the point (code in the source, the card's snippets, the DAR-MoE kind
without a prior import), as a user runs it: a fresh process with stdin closed (no step may wait on a prompt); the
refusals run the CLI's `main` in this process.

A broken source (a NaN weight, an invalid config) is one line on stderr and exit 1 with nothing written; a custom
model type is refused before transformers sees it; code in the source (an `auto_map` of the config or of the
tokenizer) never runs and never reaches the output; the model card's snippets run as written, without prompts.
"""

import errno
import json
import logging
import os
import re
import struct
import subprocess
import sys
import textwrap

import pytest
import torch
from safetensors.torch import load_file, save_file
from transformers import AutoModelForCausalLM, AutoTokenizer, LlamaForCausalLM

from conftest import (
    IDS, REPO, SHAPE, VOCAB, assert_refused_in_one_line, edit_json, logits, make_source, make_tokenizer,
    run_convert_in_process, save_source, spread_weights, tiny_llama_config, tree_digest,
)
from dar_transformers.conversion import api, upcycle, upcycle_model

EVIL_CODE = """
import pathlib
pathlib.Path(__file__).with_name("EVIL_CODE_RAN").write_text("the converter ran code from the source")
from transformers import LlamaConfig as EvilConfig, LlamaForCausalLM as EvilModel, PreTrainedTokenizerFast as EvilTokenizer
"""
PROMPT = "[y/N]"  # transformers' "Do you wish to run the custom code?" prompt


def run_dar(*args, cwd, timeout: int = 300) -> subprocess.CompletedProcess:
    """`python -m dar_transformers.cli ARGS` in a fresh process with stdin closed."""
    env = {**os.environ, "OMP_NUM_THREADS": "1", "HF_HUB_OFFLINE": "1"}
    return subprocess.run([sys.executable, "-m", "dar_transformers.cli", *map(str, args)], cwd=cwd, env=env,
                          stdin=subprocess.DEVNULL, capture_output=True, text=True, timeout=timeout)



def test_a_source_with_one_nan_weight_is_refused_naming_the_tensor(tmp_path):
    source = save_source(tmp_path / "source")
    state = load_file(source / "model.safetensors")
    state["model.layers.1.mlp.up_proj.weight"][3, 5] = float("nan")
    save_file(state, source / "model.safetensors", metadata={"format": "pt"})
    before = tree_digest(source)
    code, stderr = run_convert_in_process(source, tmp_path / "out", cwd=tmp_path)
    assert_refused_in_one_line(code, stderr, r"'model\.layers\.1\.mlp\.up_proj\.weight' holds NaN or infinite values")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["source"]  # nothing written, nothing staged
    assert tree_digest(source) == before


@pytest.mark.parametrize("fields, patterns", [
    ({"num_attention_heads": 5, "num_key_value_heads": 5},
     [r"config\.json", r"hidden size \(32\) is not a multiple of the number of attention heads \(5\)"]),
    ({"rms_norm_eps": "abc"}, [r"config\.json", r"'rms_norm_eps' expected float, got str"]),
    # Past transformers' config validation, a bare KeyError traceback in the model's constructor:
    ({"hidden_act": "swiglu"}, [r"config\.json: hidden_act 'swiglu' is not an activation transformers knows "
                                r"\(allowed: .*gelu_pytorch_tanh, .*silu"]),
    ({"rope_parameters": {"rope_type": "ntk", "rope_theta": 10000.0}},
     [r"config\.json: rope type 'ntk' \(rope_parameters / rope_scaling\) is not one transformers knows \(allowed: "
      r"default, linear, dynamic, yarn, longrope, llama3"]),
    ({"rope_scaling": {"type": "ntk", "factor": 2.0}, "rope_theta": 10000.0, "rope_parameters": None},
     [r"config\.json: rope type 'ntk'"]),
    # The source itself failed on every forward (a shape error, as a traceback after the tensors were written to the
    # staging folder): transformers' scaled ropes honour partial_rotary_factor, Llama's attention rotates whole heads.
    *[({"rope_parameters": {"rope_type": kind, "factor": 2.0, "rope_theta": 10000.0, "partial_rotary_factor": 0.5,
                            "original_max_position_embeddings": 32}},
       [rf"config\.json: its rope \(rope_type '{kind}', partial_rotary_factor 0\.5\) gives 4 rotary dimensions per "
        r"head, but .*LlamaForCausalLM.*'s attention rotates all head_dim=8 of them, so the source model fails on "
        r"every forward"]) for kind in ("linear", "yarn")],
    ({"num_key_value_heads": 3}, [r"config\.json: num_key_value_heads=3 does not divide num_attention_heads=4: "
                                  r".*LlamaForCausalLM.*'s attention repeats each key/value head"]),  # was SDPA's
    ({"rope_parameters": {"rope_type": "default", "rope_theta": 0.0}},  # the source's logits NaN: FAILED before
     [r"config\.json: rope_theta=0\.0 \(rope_parameters\) must be a positive finite number"]),
    ({"rms_norm_eps": -1.0}, [r"config\.json: rms_norm_eps=-1\.0 must be a finite number >= 0"]),
    # transformers reads it as 'ministral', which was named as if the file said so:
    ({"model_type": "mistral", "layer_types": ["full_attention"] * 3},
     [r"config\.json: transformers \S+ reads its model_type 'mistral' as 'ministral' \(a 'mistral' config with "
      r"layer_types: .*If every layer is 'full_attention', remove layer_types"]),
    ({"model_type": ["llama"]}, [r"Cannot convert model_type \['llama'\] \(.*config\.json\): DAR converts"]),  # was
    # "unhashable type: 'list'"; no decoder layers was blamed on --block-size ("must be an integer in [1, 0]"):
    ({"num_hidden_layers": 0}, [r"^dar convert: error: Invalid .*config\.json: num_hidden_layers is 0; a model to "
                                r"convert needs 1 or more decoder layers\.$"]),
])
def test_an_invalid_source_config_is_one_line_naming_the_file_and_the_field(tmp_path, fields, patterns):
    source = save_source(tmp_path / "source")
    edit_json(source / "config.json", **fields)
    before = tree_digest(source)
    assert_refused_in_one_line(*run_convert_in_process(source, tmp_path / "out", cwd=tmp_path), *patterns)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["source"]
    assert tree_digest(source) == before


@pytest.mark.parametrize("kind", ["dar", "dar_moe"])
def test_an_in_memory_model_without_decoder_layers_is_refused_naming_num_hidden_layers(tmp_path, kind):
    """`upcycle_model` and `upcycle(model)`, with or without an output, on a model of 0 layers blamed DAR's block size
    ("must be an integer in [1, 0]"), a field the caller never set."""
    model = LlamaForCausalLM(tiny_llama_config(num_hidden_layers=0))
    message = (r"^The in-memory model's config\.num_hidden_layers is 0; a model to convert needs 1 or more decoder "
               r"layers\.$")
    with pytest.raises(ValueError, match=message):
        upcycle_model(model, kind)
    with pytest.raises(ValueError, match=message):
        upcycle(model, kind=kind, max_new_tokens=0, progress=False)
    with pytest.raises(ValueError, match=message):
        upcycle(model, tmp_path / "out", kind=kind, max_new_tokens=0, progress=False)
    assert not (tmp_path / "out").exists()


@pytest.mark.parametrize("fields, pattern", [
    ({"num_key_value_heads": 3}, r"num_key_value_heads=3 does not divide num_attention_heads=4"),
    ({"rope_parameters": {"rope_type": "yarn", "factor": 2.0, "rope_theta": 10000.0, "partial_rotary_factor": 0.5,
                          "original_max_position_embeddings": 32}},
     r"its rope \(rope_type 'yarn', partial_rotary_factor 0\.5\) gives 4 rotary dimensions per head"),
], ids=["kv_heads", "partial_rotary"])
def test_an_in_memory_model_that_cannot_run_is_refused_as_its_folder_is(tmp_path, fields, pattern):
    """A model built from a config that transformers accepts but cannot run (its own forward fails) was refused in one
    line as a folder, while `upcycle(model)`, `upcycle(model, out)` and `upcycle_model(model)` raised the shape error
    of the source's own forward, deep in the verification."""
    model = LlamaForCausalLM(tiny_llama_config(**fields))
    message = rf"^The in-memory model's config: {pattern}"
    with pytest.raises(ValueError, match=message):
        upcycle_model(model, "dar")
    with pytest.raises(ValueError, match=message):
        upcycle(model, tokenizer=make_tokenizer(), max_new_tokens=0, progress=False)
    with pytest.raises(ValueError, match=message):
        upcycle(model, tmp_path / "out", tokenizer=make_tokenizer(), max_new_tokens=0, progress=False)
    assert not (tmp_path / "out").exists()


def assert_index_refused(tmp_path, source, pattern: str) -> None:
    """Converting `source` into tmp_path/out is refused in one line matching `pattern`: nothing written, the source
    unchanged."""
    before = tree_digest(source)
    code, stderr = run_convert_in_process(source, tmp_path / "out", cwd=tmp_path)
    assert_refused_in_one_line(code, stderr, pattern)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["source"]
    assert tree_digest(source) == before


def written_tensors(folder) -> dict:
    return {name: tensor for file in folder.glob("*.safetensors") for name, tensor in load_file(file).items()}


def test_a_trained_head_under_a_tied_config_is_refused_not_dropped(tmp_path):
    """config.json ties the head (`tie_word_embeddings`) but the checkpoint holds its own, different `lm_head.weight`
    (an untied fine-tune under a copied config): transformers loads it untied and keeps that head; a conversion that
    tied it would drop it (and verify against its own tied reading of the source). Refused, naming the field; the same
    head equal to the embedding (a tied head written out) converts, and so does the folder once the config says
    untied. The in-memory path refuses the same model."""
    source = save_source(tmp_path / "source", tied=False)
    state = load_file(source / "model.safetensors")
    assert not torch.equal(state["lm_head.weight"], state["model.embed_tokens.weight"])
    edit_json(source / "config.json", tie_word_embeddings=True)
    before = tree_digest(source)
    code, stderr = run_convert_in_process(source, tmp_path / "out", cwd=tmp_path)
    assert_refused_in_one_line(code, stderr, r"tie_word_embeddings=true", r"lm_head\.weight differs from "
                               r"model\.embed_tokens\.weight", r'"tie_word_embeddings": false')
    assert sorted(p.name for p in tmp_path.iterdir()) == ["source"]
    assert tree_digest(source) == before

    model = LlamaForCausalLM.from_pretrained(source)  # untied by transformers (the values differ)
    model.config.tie_word_embeddings = True
    with pytest.raises(ValueError, match=r"its config says tie_word_embeddings=true, but its lm_head\.weight differs"
                                         r".*the model computes with that head.* false on its config.*tie_weights"):
        upcycle_model(model)
    tokenizer = AutoTokenizer.from_pretrained(source)
    with pytest.raises(ValueError, match=r"the in-memory model: .*lm_head\.weight differs.* false on its config"):
        api.upcycle(model, tmp_path / "from_memory", tokenizer=tokenizer)  # the write path checks the same
    assert not (tmp_path / "from_memory").exists()
    model.config.tie_word_embeddings = False

    edit_json(source / "config.json", tie_word_embeddings=False)  # the fix the message names
    code, stderr = run_convert_in_process(source, tmp_path / "untied", cwd=tmp_path)
    assert code == 0, stderr[-3000:]
    assert torch.equal(written_tensors(tmp_path / "untied")["lm_head.weight"], state["lm_head.weight"])

    state["lm_head.weight"] = state["model.embed_tokens.weight"].clone()  # a tied head written out: equal, dropped
    save_file(state, source / "model.safetensors", metadata={"format": "pt"})
    edit_json(source / "config.json", tie_word_embeddings=True)
    code, stderr = run_convert_in_process(source, tmp_path / "tied", cwd=tmp_path)
    assert code == 0, stderr[-3000:]
    assert "lm_head.weight" not in written_tensors(tmp_path / "tied")

    state["model.embed_tokens.weight"][3, 5] = state["lm_head.weight"][3, 5] = float("nan")  # equal, NaN in both
    save_file(state, source / "model.safetensors", metadata={"format": "pt"})
    code, stderr = run_convert_in_process(source, tmp_path / "nan", cwd=tmp_path)
    assert_refused_in_one_line(code, stderr, r"holds NaN or infinite values")  # the NaN refusal, not "differs"


def test_a_folder_with_both_a_single_file_and_shards_is_refused_naming_both(tmp_path):
    """model.safetensors next to model.safetensors.index.json and its shards (two revisions downloaded into one
    folder): transformers reads model.safetensors, a converter reading the shards would convert (and verify) other
    weights than the ones the user runs. Refused, naming both; nothing written."""
    source = save_source(tmp_path / "source", shard="20KB")
    assert (source / "model.safetensors.index.json").is_file()
    other = save_source(tmp_path / "other")
    (other / "model.safetensors").rename(source / "model.safetensors")
    before = tree_digest(source)
    code, stderr = run_convert_in_process(source, tmp_path / "out", cwd=tmp_path)
    assert_refused_in_one_line(code, stderr, r"holds two checkpoints: model\.safetensors and the shards of "
                               r"model\.safetensors\.index\.json")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["other", "source"]
    assert tree_digest(source) == before


@pytest.mark.parametrize("weight_map", ["model-00001-of-00002.safetensors", [], None, {}, {"lm_head.weight": 1}])
def test_an_index_whose_weight_map_names_no_files_is_one_line_naming_it(tmp_path, weight_map):
    """A model.safetensors.index.json whose weight_map is not an object of tensor name -> file name (hand-edited, or
    written by a broken tool): a string, list or null was an AttributeError traceback, a number a TypeError that named
    no file, an empty map "has no safetensors weights" beside the shards. One line naming the index; nothing written."""
    source = save_source(tmp_path / "source", shard="20KB")
    edit_json(source / "model.safetensors.index.json", weight_map=weight_map)
    assert_index_refused(tmp_path, source, r"source/model\.safetensors\.index\.json is not a safetensors index: its "
                         r"weight_map must map each tensor name to the safetensors file that holds it")


@pytest.mark.parametrize("sharded", [False, True])
def test_a_weights_file_that_is_a_broken_symlink_is_named_as_one(tmp_path, sharded):
    """A Hub cache snapshot whose blob is missing (an interrupted download): model.safetensors, or a shard, is a symlink
    to nothing. A single file was reported as "model.safetensors (listed in model.safetensors.index.json) does not
    exist", an index the folder does not have. Named as the broken symlink it is; the index only when there is one."""
    source = save_source(tmp_path / "source", shard="20KB" if sharded else None)
    weights = sorted(source.glob("model-00002-of-*.safetensors") if sharded else [source / "model.safetensors"])[0]
    weights.unlink()
    weights.symlink_to(tmp_path / "blobs" / "0123abcd")
    code, stderr = run_convert_in_process(source, tmp_path / "out", cwd=tmp_path)
    listed = r" \(listed in .*model\.safetensors\.index\.json\)" if sharded else ""
    assert_refused_in_one_line(code, stderr,
                               rf"source/{weights.name}{listed} is a symlink to a missing file \(an incomplete download")
    assert "index" in stderr.splitlines()[-1] if sharded else "index" not in stderr.splitlines()[-1]
    assert sorted(p.name for p in tmp_path.iterdir()) == ["source"]


@pytest.mark.parametrize("broken", ["symlink to nothing", "folder"])
def test_an_index_that_is_no_file_is_named_not_passed_over(tmp_path, caplog, broken):
    """A Hub snapshot whose index blob is missing (or an index that is a folder): the converter took the folder for
    one without an index and read every *.safetensors in it, where transformers' from_pretrained refuses the folder.
    Refused in one line naming the index; beside model.safetensors, which transformers reads, it converts that and
    says why the index is passed over."""
    source = save_source(tmp_path / "source", shard="20KB")
    index = source / "model.safetensors.index.json"
    index.unlink()
    if broken == "folder":
        index.mkdir()
        pattern = r"source/model\.safetensors\.index\.json is a folder, not a file"
    else:
        index.symlink_to(tmp_path / "blobs" / "0123abcd")
        pattern = r"source/model\.safetensors\.index\.json is a symlink to a missing file \(an incomplete download"
    assert_index_refused(tmp_path, source, pattern)

    single = save_source(tmp_path / "single")
    (single / "model.safetensors.index.json").symlink_to(tmp_path / "blobs" / "0123abcd")
    code, stderr = run_convert_in_process(single, tmp_path / "out", "--max-new-tokens", "0", cwd=tmp_path)
    assert code == 0, stderr[-2000:]
    assert "model.safetensors.index.json is a symlink to a missing file (an incomplete download?); reading " \
           "model.safetensors, as transformers does." in caplog.text


def test_a_shard_that_is_a_folder_or_lacks_its_header_fields_is_named_as_such(tmp_path):
    """A listed shard that is a folder was "does not exist"; a header entry without its dtype was a bare KeyError
    ("not a valid safetensors file ('dtype')")."""
    source = save_source(tmp_path / "source", shard="20KB")
    shard = sorted(source.glob("model-00002-of-*.safetensors"))[0]
    content = shard.read_bytes()
    shard.unlink()
    shard.mkdir()
    assert_index_refused(tmp_path, source, rf"source/{shard.name} \(listed in .*\) is a folder, not a file")
    shard.rmdir()
    (header_size,) = struct.unpack("<Q", content[:8])
    header = json.loads(content[8:8 + header_size])
    name = next(key for key in header if key != "__metadata__")
    del header[name]["dtype"]
    header_bytes = json.dumps(header, separators=(",", ":")).encode().ljust(header_size)  # same data offsets
    shard.write_bytes(content[:8] + header_bytes + content[8 + header_size:])
    assert_index_refused(tmp_path, source, rf"{shard.name} is not a valid safetensors file \(tensor '{name}''s header "
                         r"entry is .*, not an object with dtype, shape and data_offsets\)")


def test_a_tensor_the_index_places_in_a_shard_that_lacks_it_is_named_with_the_shard(tmp_path):
    """A shard replaced by one without a tensor the index lists in it: refused (the model needs it) with a message
    that blamed config.json alone; it names the index's entry and the shard too."""
    source = save_source(tmp_path / "source", shard="20KB")
    weight_map = json.loads((source / "model.safetensors.index.json").read_text())["weight_map"]
    name = "model.layers.1.mlp.down_proj.weight"
    shard = source / weight_map[name]
    tensors = load_file(shard)
    del tensors[name]
    save_file(tensors, shard, metadata={"format": "pt"})
    assert_index_refused(tmp_path, source, rf"missing \['{re.escape(name)}'\].* model\.safetensors\.index\.json lists 1 "
                         rf"tensor\(s\) that the file named for each does not hold \({re.escape(name)} in "
                         rf"{weight_map[name]}\): a damaged or replaced shard\?")

    # A base model's folder (names without `model.`, read with the prefix): a tensor missing from the index too is
    # no damaged shard; the hint compared the index's names with the prefixed ones and named every tensor.
    base = tmp_path / "base"
    make_source("llama").model.save_pretrained(base, max_shard_size="20KB")
    make_tokenizer().save_pretrained(base)
    index = json.loads((base / "model.safetensors.index.json").read_text())
    shard = base / index["weight_map"].pop("layers.1.mlp.down_proj.weight")
    tensors = load_file(shard)
    del tensors["layers.1.mlp.down_proj.weight"]
    save_file(tensors, shard, metadata={"format": "pt"})
    (base / "model.safetensors.index.json").write_text(json.dumps(index))
    code, stderr = run_convert_in_process(base, tmp_path / "base-out", cwd=tmp_path)
    assert_refused_in_one_line(code, stderr, r"missing \['model\.layers\.1\.mlp\.down_proj\.weight'\] \(of 1\)")
    assert "lists" not in stderr.strip().splitlines()[-1]


def test_an_index_of_model_safetensors_itself_is_one_checkpoint_not_two(tmp_path):
    """model.safetensors with a model.safetensors.index.json whose weight_map names model.safetensors alone (mlx-lm
    writes such an index for a one-file model): refused as "two checkpoints", telling the user to move one of them
    out, though both describe the same file. It converts, as transformers loads it."""
    source = save_source(tmp_path / "source")
    names = load_file(source / "model.safetensors").keys()
    (source / "model.safetensors.index.json").write_text(
        json.dumps({"metadata": {}, "weight_map": {name: "model.safetensors" for name in names}}))
    code, stderr = run_convert_in_process(source, tmp_path / "out", "--max-new-tokens", "0", cwd=tmp_path)
    assert code == 0, stderr[-3000:]
    norm = load_file(source / "model.safetensors")["model.norm.weight"]
    assert written_tensors(tmp_path / "out")["model.norm.weight"].equal(norm)


def test_other_safetensors_files_next_to_model_safetensors_are_not_read_and_are_named(tmp_path, caplog):
    """Without an index a folder's weights are model.safetensors, as transformers reads it: a LoRA adapter or a backup
    copy beside it is not read (it was, and refused the folder with a message blaming a valid file), and the warning
    names it. Without model.safetensors, every *.safetensors is read; a tensor in two of them names both files."""
    source = save_source(tmp_path / "source")
    state = load_file(source / "model.safetensors")
    save_file({"base_model.model.model.layers.0.self_attn.q_proj.lora_A.weight": torch.zeros(4, 32)},
              source / "adapter_model.safetensors")
    save_file(state, source / "model_backup.safetensors")
    code, stderr = run_convert_in_process(source, tmp_path / "out", "--max-new-tokens", "0", cwd=tmp_path)
    assert code == 0, stderr[-3000:]
    assert "not read: adapter_model.safetensors, model_backup.safetensors" in caplog.text

    (source / "adapter_model.safetensors").unlink()
    (source / "model.safetensors").rename(source / "weights.safetensors")
    code, stderr = run_convert_in_process(source, tmp_path / "out2", cwd=tmp_path)
    assert_refused_in_one_line(code, stderr, r"tensor '[\w.]+' is in both model_backup\.safetensors and "
                               r"weights\.safetensors")


@pytest.mark.parametrize("failure", ["EIO", "truncated"])
def test_a_source_that_fails_to_read_is_named_as_the_source_not_the_output(tmp_path, monkeypatch, failure):
    """An I/O error reading the source (a failing disk or mount) or a source file that shrinks mid-run (a download or
    sync still writing it) is one line naming the source file: it read as "Could not write OUT" (an I/O error) or
    named no file (end of file). Nothing written, the source unchanged apart from what the test itself did."""
    source = save_source(tmp_path / "source")
    weights = (source / "model.safetensors").resolve()
    write_folder = api.write_converted_folder

    def failing_write(*args, **kwargs):  # after planning: the write is the source's one full read
        if failure == "truncated":
            with open(weights, "r+b") as file:
                file.truncate(weights.stat().st_size - 4096)
        else:
            preadv = os.preadv

            def eio_on_the_source(fd, buffers, offset):
                if os.readlink(f"/proc/self/fd/{fd}") == str(weights):
                    raise OSError(errno.EIO, os.strerror(errno.EIO))
                return preadv(fd, buffers, offset)

            monkeypatch.setattr(os, "preadv", eio_on_the_source)
        return write_folder(*args, **kwargs)

    monkeypatch.setattr(api, "write_converted_folder", failing_write)
    code, stderr = run_convert_in_process(source, tmp_path / "out", "--max-new-tokens", "0", cwd=tmp_path)
    reason = "Input/output error" if failure == "EIO" else "the file is shorter than its header says"
    assert_refused_in_one_line(code, stderr, rf"Could not read the source file {re.escape(str(weights))}: .*{reason}")
    assert "Could not write" not in stderr
    assert sorted(p.name for p in tmp_path.iterdir()) == ["source"]


@pytest.mark.parametrize("spelling", ["every", "some", "single"])
def test_an_index_that_names_its_shards_with_a_leading_dot_slash_reads_each_once(tmp_path, caplog, spelling):
    """An index naming its files "./model-00001-of-00005.safetensors" (as transformers reads, the shards beside it)
    converted, but warned that the shards it had just read were "not read"; one that spelled some entries each way was
    refused for a tensor "in both" a file and itself, and mlx's index of "./model.safetensors" as two checkpoints."""
    source = save_source(tmp_path / "source", tied=False, shard=None if spelling == "single" else "20KB")
    index = source / "model.safetensors.index.json"
    if spelling == "single":
        weight_map = {name: "./model.safetensors" for name in load_file(source / "model.safetensors")}
    else:
        weight_map = json.loads(index.read_text())["weight_map"]
        weight_map = {name: ("./" if spelling == "every" or number % 2 else "") + file
                      for number, (name, file) in enumerate(weight_map.items())}
    index.write_text(json.dumps({"metadata": {}, "weight_map": weight_map}))
    code, stderr = run_convert_in_process(source, tmp_path / "out", "--max-new-tokens", "0", cwd=tmp_path)
    assert code == 0, stderr[-3000:]
    assert "not read" not in caplog.text
    assert written_tensors(tmp_path / "out")["lm_head.weight"].equal(
        AutoModelForCausalLM.from_pretrained(source).lm_head.weight)


def test_a_safetensors_file_beside_an_index_that_does_not_list_it_is_named_not_read(tmp_path, caplog):
    """A sharded folder with a stale shard of an earlier save (another lm_head) beside the index's shards: not read,
    as transformers reads the folder, and the warning names it (it was passed over without a word, where a stray
    file beside model.safetensors was named)."""
    source = save_source(tmp_path / "source", tied=False, shard="20KB")
    listed = sorted(set(json.loads((source / "model.safetensors.index.json").read_text())["weight_map"].values()))
    assert len(listed) > 1
    save_file({"lm_head.weight": torch.ones(97, 32)}, source / "model-00099-of-00099.safetensors")
    code, stderr = run_convert_in_process(source, tmp_path / "out", "--max-new-tokens", "0", cwd=tmp_path)
    assert code == 0, stderr[-3000:]
    assert (f"Reading the {len(listed)} file(s) of {source / 'model.safetensors.index.json'} only, as transformers "
            "does; not read: model-00099-of-00099.safetensors." in caplog.text)


def test_a_custom_model_type_is_refused_before_any_code_runs(tmp_path):
    source = save_source(tmp_path / "source")
    (source / "evil.py").write_text(EVIL_CODE)
    edit_json(source / "config.json", model_type="evil_llama",
              auto_map={"AutoConfig": "evil.EvilConfig", "AutoModelForCausalLM": "evil.EvilModel"})
    before = tree_digest(source)
    code, stderr = run_convert_in_process(source, tmp_path / "out", cwd=tmp_path)
    assert_refused_in_one_line(code, stderr, r"model_type 'evil_llama'", r"\['llama', 'mistral', 'qwen2', 'qwen3'\]")
    assert not (source / "EVIL_CODE_RAN").exists()
    assert sorted(p.name for p in tmp_path.iterdir()) == ["source"]
    assert tree_digest(source) == before


def test_a_dar_folder_as_the_source_of_dense_dar_is_refused_saying_what_converts_instead(tmp_path):
    """A converted DAR folder given back to the converter without MoE flags is refused in one line that says it
    already is DAR and names the route that does convert it (DAR-MoE, `test_convert_dar_to_moe.py`), not the generic
    "custom model code" refusal; nothing is written and the folder is untouched."""
    from conftest import tiny_dar_config

    from dar_transformers import DARForCausalLM

    DARForCausalLM(tiny_dar_config()).save_pretrained(tmp_path / "dar")
    before = tree_digest(tmp_path / "dar")
    code, stderr = run_convert_in_process(tmp_path / "dar", tmp_path / "out", cwd=tmp_path)
    assert_refused_in_one_line(code, stderr, r"model_type 'dar'", r"already a dense DAR model",
                               r"--kind dar_moe with --experts/--top-k")
    assert "custom model code" not in stderr
    assert sorted(p.name for p in tmp_path.iterdir()) == ["dar"]
    assert tree_digest(tmp_path / "dar") == before


@pytest.fixture(scope="module")
def converted_with_auto_maps(tmp_path_factory):
    """A Llama source whose config and tokenizer both carry an `auto_map` to code in the folder, converted by the
    CLI: the code must never run, and the output must not point to it."""
    root = tmp_path_factory.mktemp("auto-maps")
    source = save_source(root / "source")
    (source / "evil.py").write_text(EVIL_CODE)
    (source / "tokenization_evil.py").write_text(EVIL_CODE)
    edit_json(source / "config.json", auto_map={"AutoConfig": "evil.EvilConfig", "AutoModelForCausalLM": "evil.EvilModel"})
    edit_json(source / "tokenizer_config.json", auto_map={"AutoTokenizer": [None, "tokenization_evil.EvilTokenizer"]})
    before = tree_digest(source)
    completed = run_dar("convert", source, root / "out", "--max-new-tokens", "4", "--tolerance", "1e-5", cwd=root)
    return root, source, before, completed


def test_code_in_the_source_never_runs_and_never_reaches_the_output(converted_with_auto_maps):
    root, source, before, completed = converted_with_auto_maps
    assert completed.returncode == 0, completed.stderr[-3000:]
    assert "PASSED" in completed.stdout and PROMPT not in completed.stdout + completed.stderr
    assert not (source / "EVIL_CODE_RAN").exists()
    assert tree_digest(source) == before
    out = root / "out"
    assert not list(out.glob("*evil*"))
    tokenizer_config = json.loads((out / "tokenizer_config.json").read_text())
    assert "auto_map" not in tokenizer_config  # self-contained: no pointer to code that is not there
    assert re.search(r"tokenization_evil\.EvilTokenizer.*dropped from tokenizer_config\.json", completed.stderr)
    # The conversion reproduces transformers' built-in class, not the source's own code: the run and the card say so
    # (the card claimed "the source model's function, verified below" while the source's code could differ).
    assert re.search(r"config\.json maps the model to code in the source \(auto_map: AutoConfig: evil\.EvilConfig; "
                     r"AutoModelForCausalLM: evil\.EvilModel\), which the converter never runs: the conversion "
                     r"reproduces, and is verified against, transformers' built-in `LlamaForCausalLM` for model_type "
                     r"'llama'", completed.stderr)
    card = (out / "README.md").read_text()
    assert "computes the source model's function" not in card
    assert ("**at conversion the model computes the function of transformers' built-in `LlamaForCausalLM` with the "
            "source's weights and config**, verified below.") in " ".join(card.split())
    assert "(auto_map: `AutoConfig: evil.EvilConfig`; `AutoModelForCausalLM: evil.EvilModel`), which the conversion " \
           "neither ran nor reproduces" in " ".join(card.split())
    config = json.loads((out / "config.json").read_text())
    assert set(config["auto_map"].values()) <= {f"{module}.{name}" for module in ("configuration_dar", "modeling_dar")
                                                for name in ("DARConfig", "DARModel", "DARForCausalLM",
                                                             "DARForSequenceClassification", "DARForQuestionAnswering",
                                                             "DARForTokenClassification")}


def card_snippets(card: str) -> dict[str, str]:
    """The card's Python blocks by the sentence that introduces them."""
    blocks = re.findall(r"([^\n]*)\n\n```python\n(.*?)```", card, flags=re.S)
    return {intro: code for intro, code in blocks}


def test_the_cards_snippets_run_as_written_without_the_package_and_without_prompts(converted_with_auto_maps):
    root, _, _, completed = converted_with_auto_maps
    assert completed.returncode == 0, completed.stderr[-3000:]
    out = root / "out"
    snippets = card_snippets((out / "README.md").read_text())
    (without,) = [code for intro, code in snippets.items() if intro.startswith("Without the package")]
    (chat,) = [code for intro, code in snippets.items() if "Chat:" in intro]
    # The snippets name the repo "<this repo or folder>"; everything else runs as written.
    script = textwrap.dedent(f"""
        import importlib.util, os, sys
        sys.path[:] = [p for p in sys.path if os.path.realpath(p) != {str(REPO / "src")!r} and p not in ("", ".")]
        assert importlib.util.find_spec("dar_transformers") is None, "the package must not be importable here"
    """) + (without + chat).replace("<this repo or folder>", str(out))
    env = {"PATH": os.environ.get("PATH", ""), "HOME": str(root), "HF_HOME": str(root / "hf"), "HF_HUB_OFFLINE": "1",
           "OMP_NUM_THREADS": "1"}
    ran = subprocess.run([sys.executable, "-I", "-c", script], cwd=root, env=env, stdin=subprocess.DEVNULL,
                         capture_output=True, text=True, timeout=300)
    assert ran.returncode == 0, ran.stderr[-3000:]
    assert PROMPT not in ran.stdout + ran.stderr
    assert ran.stdout.strip()  # the chat answer was printed


def test_the_dar_moe_kind_exists_in_a_fresh_process_and_its_card_shows_experts_and_top_k(tmp_path):
    source = save_source(tmp_path / "source")
    before = tree_digest(source)
    script = textwrap.dedent(f"""
        import dar_transformers.convert as convert_module
        assert "dar_moe" in convert_module.TARGET_KINDS, sorted(convert_module.TARGET_KINDS)
        convert_module.convert({str(source)!r}, {str(tmp_path / "moe")!r}, kind="dar_moe", num_experts=3,
                               num_experts_per_tok=2, max_new_tokens=4, tolerance=1e-5, progress=False)
    """)
    env = {**os.environ, "OMP_NUM_THREADS": "1", "HF_HUB_OFFLINE": "1"}
    ran = subprocess.run([sys.executable, "-c", script], cwd=tmp_path, env=env, stdin=subprocess.DEVNULL,
                         capture_output=True, text=True, timeout=300)
    assert ran.returncode == 0, ran.stderr[-3000:]
    assert json.loads((tmp_path / "moe" / "config.json").read_text())["model_type"] == "dar_moe"
    card = (tmp_path / "moe" / "README.md").read_text()
    assert "| experts E (sparse layers) | 3 (3 of 3 layers) |" in card
    assert "| experts per token (top-k) | 2 |" in card
    assert tree_digest(source) == before


@pytest.mark.parametrize("escape", ["../elsewhere/{name}", "/tmp/{name}"])
def test_an_index_listing_weights_outside_the_source_folder_is_refused(tmp_path, escape):
    """An index entry that leaves the folder (`..` or an absolute path) was read as transformers reads it, beyond the
    source folder whose overlap with the output the converter checks: with that folder as the output, --overwrite
    could replace a shard the source reads. Refused naming the index and the entry; nothing written."""
    source = save_source(tmp_path / "source", shard="20KB")
    index = json.loads((source / "model.safetensors.index.json").read_text())
    moved = sorted(set(index["weight_map"].values()))[-1]
    entry = escape.format(name=moved)
    edit_json(source / "model.safetensors.index.json",
              weight_map={name: entry if file == moved else file for name, file in index["weight_map"].items()})
    assert_index_refused(tmp_path, source, r"model\.safetensors\.index\.json lists weights outside the source folder "
                         rf"\('{re.escape(entry)}'\)")


def test_a_config_field_transformers_does_not_define_is_named_as_not_carried(tmp_path, caplog):
    """A field added to config.json by hand or by a tool (`my_custom_field`) was left out of the output's config
    without a word; the conversion names it (the model never reads it, so the conversion is still exact)."""
    source = save_source(tmp_path / "source")
    config = json.loads((source / "config.json").read_text())
    (source / "config.json").write_text(json.dumps({**config, "my_custom_field": 123}))
    code, stderr = run_convert_in_process(source, tmp_path / "out", "--max-new-tokens", "0", cwd=tmp_path)
    assert code == 0, stderr[-3000:]
    assert ("config.json has field(s) that transformers' LlamaConfig does not define: my_custom_field. Its model "
            "never reads them" in caplog.text)
    assert "my_custom_field" not in (tmp_path / "out" / "config.json").read_text()
    caplog.clear()
    code, stderr = run_convert_in_process(save_source(tmp_path / "plain"), tmp_path / "out2", "--max-new-tokens", "0",
                                          cwd=tmp_path)
    assert code == 0 and "does not define" not in caplog.text  # a config of defined fields only: no warning


def test_a_field_the_converted_config_carries_is_not_named_as_dropped(tmp_path, caplog):
    """Qwen2Config defines no `head_dim`, yet Qwen2's attention reads it (`getattr`) and the converted config carries
    it: the warning said the model never reads it and the output's config.json does not carry it, both false (every
    Qwen3-MoE checkpoint, whose config class has no `head_dim` either, drew it)."""
    from transformers import Qwen2Config, Qwen2ForCausalLM

    torch.manual_seed(0)
    config = Qwen2Config(**{**SHAPE, "head_dim": 16}, vocab_size=VOCAB, bos_token_id=1, eos_token_id=2)
    source = tmp_path / "source"
    spread_weights(Qwen2ForCausalLM(config), 0).save_pretrained(source)
    make_tokenizer().save_pretrained(source)
    assert "head_dim" not in Qwen2Config().to_dict() and "head_dim" in json.loads((source / "config.json").read_text())
    code, stderr = run_convert_in_process(source, tmp_path / "out", "--max-new-tokens", "0", cwd=tmp_path)
    assert code == 0, stderr[-3000:]
    assert "does not define" not in caplog.text
    assert json.loads((tmp_path / "out" / "config.json").read_text())["head_dim"] == 16


def test_a_quantized_folder_is_refused_as_quantized_before_reading_its_tensors(tmp_path, caplog):
    """A block-FP8 release (float8 weights, `weight_scale_inv` beside them, a `quantization_config`): the converter
    first said the config's `quantization_config` was a field the model "never reads", so the conversion "computes the
    same without" it (transformers' loader dequantises with it), then refused the scales as parameters "DAR has no
    place for", never saying the folder is quantized."""
    source = save_source(tmp_path / "source")
    quantized = {}
    for name, tensor in load_file(source / "model.safetensors").items():
        if name.endswith("proj.weight"):
            scale = tensor.abs().amax() / 448
            quantized[name] = (tensor / scale).to(torch.float8_e4m3fn)
            quantized[name.replace(".weight", ".weight_scale_inv")] = scale.reshape(1, 1)
        else:
            quantized[name] = tensor.bfloat16()
    save_file(quantized, source / "model.safetensors", metadata={"format": "pt"})
    edit_json(source / "config.json", quantization_config={"quant_method": "fp8", "fmt": "e4m3",
                                                           "weight_block_size": [128, 128]})
    code, stderr = run_convert_in_process(source, tmp_path / "out", cwd=tmp_path)
    assert_refused_in_one_line(code, stderr, r"config\.json has a quantization_config \(quant_method 'fp8'\)",
                               r"quantized weights", r"unquantized checkpoint")
    assert "never reads" not in caplog.text
    assert sorted(p.name for p in tmp_path.iterdir()) == ["source"]


@pytest.mark.parametrize("layout", ["gptq", "fp8"])
def test_quantized_weights_without_a_quantization_config_are_refused_as_quantized(tmp_path, layout):
    """AutoGPTQ's layout (packed `qweight`, `qzeros`, `scales`, `g_idx`, and `quantize_config.json` instead of a
    `quantization_config`) or FP8 weights with their `weight_scale_inv` and no `quantization_config`: refused as
    parameters "DAR has no place for", which blamed the converter; now named as quantized weights."""
    source = save_source(tmp_path / "source")
    tensors = {}
    for name, tensor in load_file(source / "model.safetensors").items():
        base = name.removesuffix(".weight")
        if not name.endswith("proj.weight"):
            tensors[name] = tensor
        elif layout == "gptq":
            rows, columns = tensor.shape
            tensors |= {f"{base}.qweight": torch.zeros(columns // 8, rows, dtype=torch.int32),
                        f"{base}.qzeros": torch.zeros(1, rows // 8, dtype=torch.int32),
                        f"{base}.scales": torch.ones(1, rows, dtype=torch.float16),
                        f"{base}.g_idx": torch.zeros(columns, dtype=torch.int32)}
        else:
            tensors |= {name: tensor.to(torch.float8_e4m3fn), f"{name}_scale_inv": torch.ones(1, 1)}
    save_file(tensors, source / "model.safetensors", metadata={"format": "pt"})
    if layout == "gptq":
        (source / "quantize_config.json").write_text(json.dumps({"bits": 4, "group_size": 128, "quant_method": "gptq"}))
    code, stderr = run_convert_in_process(source, tmp_path / "out", cwd=tmp_path)
    assert_refused_in_one_line(code, stderr, r"holds quantized weights", "qweight" if layout == "gptq" else
                               "weight_scale_inv", r"unquantized checkpoint")
    assert "no place for" not in stderr
    assert sorted(p.name for p in tmp_path.iterdir()) == ["source"]


def test_a_folder_of_pytorch_pickles_is_refused_naming_them_and_the_way_out(tmp_path):
    """A folder with `pytorch_model.bin` only (which transformers loads): "has no safetensors weights", without a word
    of the file that is there or what to do with it."""
    source = save_source(tmp_path / "source")
    torch.save(load_file(source / "model.safetensors"), source / "pytorch_model.bin")  # as transformers 4 saved
    (source / "model.safetensors").unlink()
    assert AutoModelForCausalLM.from_pretrained(source) is not None  # transformers loads it
    code, stderr = run_convert_in_process(source, tmp_path / "out", cwd=tmp_path)
    assert_refused_in_one_line(code, stderr, r"has no safetensors weights", r"It holds pytorch_model\.bin",
                               r"save the model as safetensors first")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["source"]


@pytest.mark.parametrize("with_base_config", [False, True])
def test_an_unmerged_peft_adapter_folder_is_refused_as_one(tmp_path, with_base_config):
    """A LoRA adapter folder (adapter_config.json, adapter_model.safetensors) as the source: "has no config.json; it
    is not a Hugging Face model folder", or, with the base model's config.json copied in, "The dense MLP of layer 0 is
    missing" (its adapter weights read as the model's). Named as an adapter, with the way to merge it."""
    base = save_source(tmp_path / "base")
    adapter = tmp_path / "adapter"
    adapter.mkdir()
    (adapter / "adapter_config.json").write_text(json.dumps({"peft_type": "LORA", "r": 2, "target_modules": ["q_proj"],
                                                             "base_model_name_or_path": str(base)}))
    save_file({"base_model.model.model.layers.0.self_attn.q_proj.lora_A.weight": torch.zeros(2, SHAPE["hidden_size"]),
               "base_model.model.model.layers.0.self_attn.q_proj.lora_B.weight": torch.zeros(SHAPE["hidden_size"], 2)},
              adapter / "adapter_model.safetensors", metadata={"format": "pt"})
    if with_base_config:
        (adapter / "config.json").write_bytes((base / "config.json").read_bytes())
        make_tokenizer().save_pretrained(adapter)
    code, stderr = run_convert_in_process(adapter, tmp_path / "out", cwd=tmp_path)
    assert_refused_in_one_line(code, stderr, r"is a PEFT adapter \(adapter_config\.json\), not a model",
                               r"merge_and_unload\(\)")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["adapter", "base"]


def test_a_stale_index_beside_model_safetensors_is_named_and_the_model_read_as_transformers_reads_it(tmp_path, caplog):
    """A sharded folder (every conversion output is one) into which a trained model was saved again unsharded:
    `save_pretrained` removes the shards, not their index. transformers reads model.safetensors; the converter refused
    the folder as holding "two checkpoints", naming shards that no longer exist."""
    source = save_source(tmp_path / "source", shard="20KB")
    assert (source / "model.safetensors.index.json").is_file()
    index = (source / "model.safetensors.index.json").read_bytes()
    trained = make_source("llama", True, seed=5)
    for shard in source.glob("model-*.safetensors"):
        shard.unlink()
    trained.save_pretrained(source)  # unsharded: model.safetensors
    (source / "model.safetensors.index.json").write_bytes(index)  # as an earlier sharded save left it
    assert torch.equal(logits(AutoModelForCausalLM.from_pretrained(source).eval(), IDS[:1, :12]),
                       logits(trained.eval(), IDS[:1, :12]))
    with caplog.at_level(logging.WARNING):
        code, stderr = run_convert_in_process(source, tmp_path / "out", "--max-new-tokens", "2", cwd=tmp_path)
    assert code == 0, stderr[-3000:]
    assert "lists none of the files" in caplog.text and "a stale index" in caplog.text
    torch.testing.assert_close(logits(AutoModelForCausalLM.from_pretrained(tmp_path / "out").eval(), IDS[:1, :12]),
                               logits(trained, IDS[:1, :12]), atol=1e-5, rtol=0)
