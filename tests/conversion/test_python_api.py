# SPDX-License-Identifier: Apache-2.0
"""The Python conversion API as a notebook calls it (CPU, tiny models): options of the wrong type are refused by
name before any work, not read as truthy or failing deep inside; a DAR-MoE tolerance given through the options
holds; a full temporary folder is one line naming $TMPDIR; task heads and base models are refused saying what
converts; rounding is claimed by value and a mixed-dtype card says what its load code computes; a relaxed bar is
named as the bar; a converted model is named by its source, never by a local path; an in-memory source (a dynamic
rope's state included) is left as it was. (Helpers' audits of the Python entry points and of conversions on 5.25.)"""

import copy
import errno
import json
import math
import os
import re
import tempfile

import pytest
import torch
from transformers import AutoModelForCausalLM, LlamaModel

from dar_transformers.conversion import (
    ConversionOptions, convert, convert_to_dar_moe, upcycle, upcycle_model, upcycle_to_dar_moe,
)
from dar_transformers.conversion import output as output_module
from dar_transformers.conversion.output import MANIFEST_NAME, OutputWriteError
from dar_transformers.conversion.report import VerificationError

from conftest import FAST, make_source, make_tokenizer, save_source


@pytest.mark.parametrize("name", ["overwrite", "verify", "progress", "full_greedy"])
def test_a_flag_that_is_not_a_bool_is_refused_by_name(name):
    """overwrite="no" (a truthy string) replaced a previous output; full_greedy="off" ran the greedy check."""
    with pytest.raises(ValueError, match=rf"^{name} must be True(, False or None| or False).*got 'no'"):
        ConversionOptions(**{name: "no"})
    ConversionOptions(**{name: False})


def test_overwrite_given_as_a_string_leaves_a_previous_output_as_it_was(tmp_path):
    source = save_source(tmp_path / "source")
    out = tmp_path / "out"
    upcycle(source, out, dar_block_size=2, tolerance=1e-5, **FAST)
    manifest = (out / MANIFEST_NAME).read_bytes()
    with pytest.raises(ValueError, match="overwrite must be True or False, got 'no'"):
        upcycle(source, out, overwrite="no", dar_block_size=1, **FAST)
    assert (out / MANIFEST_NAME).read_bytes() == manifest
    assert json.loads((out / "config.json").read_text())["dar_block_size"] == 2


def test_options_of_the_wrong_type_are_refused_by_name(tmp_path):
    source = save_source(tmp_path / "source")
    with pytest.raises(TypeError, match="options must be a ConversionOptions .*got dict"):
        upcycle(source, tmp_path / "out", {"dtype": "bfloat16"})
    with pytest.raises(ValueError, match="fields must be a mapping"):
        ConversionOptions(fields=None)
    with pytest.raises(TypeError, match=r"tokenizer must be a tokenizer object .*got str"):
        upcycle(source, tmp_path / "out", tokenizer=str(source))
    with pytest.raises(TypeError, match="output must be a folder path .*got int 123"):
        upcycle(source, 123)
    with pytest.raises(TypeError, match=r"Unknown option 'overwite' \(did you mean 'overwrite'\?\); the options "
                                        r"are"):
        upcycle(source, tmp_path / "out", overwite=True)
    assert sorted(path.name for path in tmp_path.iterdir()) == ["source"]


def test_fields_as_a_keyword_set_the_config_as_the_options_do(tmp_path):
    """The docstring's "its fields as keywords" includes `fields=`: it was taken for a DAR field named fields."""
    model = convert(make_source("llama", True), fields={"dar_block_size": 2}, dar_num_streams=2, verify=False)
    assert (model.config.dar_block_size, model.config.dar_num_streams) == (2, 2)


def test_in_memory_entry_points_say_what_they_take():
    source = make_source("llama", True)
    with pytest.raises(TypeError, match="converts an in-memory model; got the path"):
        upcycle_model("some/folder")
    with pytest.raises(TypeError, match="converts an in-memory model; got the path"):
        convert_to_dar_moe("some/folder", 4, 2)
    model = upcycle_model(source, "dar", "bfloat16")  # a dtype by name, as everywhere else
    assert model.model.embed_tokens.weight.dtype == torch.bfloat16
    assert convert_to_dar_moe(source, 2, 1, dtype="float32").dtype == torch.float32
    head = LlamaModel(source.config)  # no generation config: upcycle(model, output) failed in an AttributeError
    with pytest.raises(TypeError, match="LlamaModel, which has no language-model head"):
        convert(head, verify=False)
    with pytest.raises(TypeError, match="LlamaModel, which has no language-model head"):
        upcycle(head, "unused", tokenizer=make_tokenizer())


def test_upcycle_with_kind_dar_moe_takes_top_k_as_upcycle_to_dar_moe_does(tmp_path):
    """upcycle(kind="dar_moe", num_experts=4, top_k=2): the missing-field message names top_k, which then failed in
    a TypeError (multiple values for 'top_k')."""
    source = save_source(tmp_path / "source")
    result = upcycle(source, kind="dar_moe", num_experts=2, top_k=1, **FAST)
    assert (result.config.num_experts, result.config.num_experts_per_tok) == (2, 1)
    with pytest.raises(ValueError, match="both name the experts per token"):
        upcycle(source, kind="dar_moe", num_experts=2, top_k=1, num_experts_per_tok=2, **FAST)
    with pytest.raises(ValueError, match="upcycle_to_dar_moe converts to DAR-MoE, so it takes no kind"):
        upcycle_to_dar_moe(source, num_experts=2, top_k=1, kind="dar", **FAST)


def test_a_tolerance_in_the_options_holds_for_perturbed_experts(tmp_path):
    """upcycle_to_dar_moe(expert_noise > 0) relaxes the check to "report only" unless a tolerance is given; one
    given through options=ConversionOptions(tolerance=...) was ignored, and a conversion that exceeded it was
    written as "NOT VERIFIED"."""
    source = save_source(tmp_path / "source")
    options = ConversionOptions(tolerance=1e-9, **FAST)
    with pytest.raises(VerificationError, match="does not reproduce the source; nothing was written"):
        upcycle_to_dar_moe(source, tmp_path / "out", num_experts=2, top_k=1, expert_noise=0.5, options=options)
    assert not (tmp_path / "out").exists()
    relaxed = upcycle_to_dar_moe(source, num_experts=2, top_k=1, expert_noise=0.5, **FAST)
    assert relaxed.report.tolerance == math.inf


def test_a_relaxed_report_gives_the_top1_agreement_of_every_position(tmp_path):
    """At Drop-Upcycling's tolerance inf no position is decided at the bar, so the teacher-forced top-1 column read
    "0/0" for every prompt: a researcher learnt nothing of how far the noised experts move the argmax. A relaxed
    report now gives the agreement over all positions beside it, as the two models' logits give it."""
    from dar_transformers.conversion.verify import build_prompts

    source_folder = save_source(tmp_path / "source")
    relaxed = upcycle_to_dar_moe(source_folder, tmp_path / "moe", num_experts=4, top_k=2, expert_noise=0.5, **FAST)
    source, converted = (AutoModelForCausalLM.from_pretrained(folder) for folder in (source_folder, tmp_path / "moe"))
    table = relaxed.report.table()
    prompts = build_prompts(relaxed.tokenizer, source.config.vocab_size, FAST["prompts"])
    disagreements = 0
    for (name, input_ids), check in zip(prompts, relaxed.report.checks, strict=True):
        assert name == check.name and check.top1_checked == 0
        with torch.no_grad():
            same = source(input_ids).logits.argmax(-1) == converted(input_ids).logits.argmax(-1)
        assert check.top1_agreed_anywhere == int(same.sum())
        assert f"| 0/0 (all positions: {int(same.sum())}/{check.num_tokens}) |" in table
        disagreements += check.num_tokens - int(same.sum())
    assert disagreements > 0  # the noise moves some argmax: the count is not all positions by construction
    checks = relaxed.report.checks_run()  # it counted "the 0 of N positions" and explained near ties, never at inf
    assert "top-1 agreement at all" in checks and "near tie" not in checks and "the 0 of" not in checks
    exact = upcycle(source_folder, **FAST).report
    assert "all positions" not in exact.table()  # a check at the bar keeps its one figure
    assert all(words in exact.checks_run() for words in ("whose source top-1/top-2 margin exceeds", "near tie"))
    assert "margin is within 2 x tolerance and" in exact.checks_run()
    loose = upcycle(source_folder, tolerance=1e-3, **FAST).report  # a relaxed bar judges near ties at the default's
    assert loose.relaxed and "margin is within 2 x the default tolerance (2.0e-04) and" in loose.checks_run()


def test_a_full_temporary_folder_is_one_line_naming_it_and_leaves_nothing(tmp_path, monkeypatch):
    """upcycle(path) and convert(path) write into $TMPDIR: a full one raised a bare OSError naming no file (or the
    hidden staging path)."""
    source = save_source(tmp_path / "source")
    scratch = tmp_path / "tmp"
    scratch.mkdir()
    monkeypatch.setattr(tempfile, "tempdir", str(scratch))

    def full(*arguments, **keywords):
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))

    monkeypatch.setattr("dar_transformers.conversion.api.check_written_tensors", full)
    for call in (lambda: upcycle(source, **FAST), lambda: convert(source, **FAST)):
        with pytest.raises(OutputWriteError, match=r"Could not write the conversion's temporary folder .*No space left "
                                                   r"on device\. .*\(the temporary folder, \$TMPDIR\).*set TMPDIR") \
                as caught:
            call()
        assert caught.value.errno == errno.ENOSPC and "\n" not in str(caught.value)
        assert list(scratch.iterdir()) == []
    monkeypatch.setattr(output_module, "_marked_folder", full)
    with pytest.raises(OutputWriteError, match=rf"temporary folder {scratch}: No space left on device"):
        upcycle(source, **FAST)


def test_a_source_read_error_during_a_conversion_without_output_is_not_blamed_on_the_temporary_folder(
    tmp_path, monkeypatch
):
    source = save_source(tmp_path / "source")

    def unreadable(*arguments, **keywords):
        raise PermissionError(errno.EACCES, os.strerror(errno.EACCES), str(source / "model.safetensors"))

    monkeypatch.setattr("dar_transformers.conversion.api.check_written_tensors", unreadable)
    with pytest.raises(PermissionError) as caught:
        upcycle(source, **FAST)
    assert not isinstance(caught.value, OutputWriteError)


def test_a_narrower_dtype_that_changes_no_value_is_not_said_to_round(tmp_path, caplog):
    """A float32 source whose values are all bfloat16 values, converted with dtype="bfloat16": nothing changed, yet
    the warning and the card said the weights were rounded (by dtype, not by value). The write notes which values
    its casts change; a source with a value that bfloat16 does not hold is still named, with the tensor."""
    import logging

    from transformers import AutoModelForCausalLM

    source = save_source(tmp_path / "source")
    model = AutoModelForCausalLM.from_pretrained(source)
    for parameter in model.parameters():
        parameter.data = parameter.data.bfloat16().float()
    model.save_pretrained(source)
    with caplog.at_level(logging.INFO, logger="dar_transformers"):
        upcycle(source, tmp_path / "exact", dtype="bfloat16", **FAST)
    card = (tmp_path / "exact" / "README.md").read_text()
    assert "computes the source model's function**, verified below" in card and "rounded" not in card
    assert "changed no value: every source tensor is stored exactly" in caplog.text
    model.model.norm.weight.data[0] = 1 + 2**-12  # one value bfloat16 rounds
    model.save_pretrained(source)
    upcycle(source, tmp_path / "rounded", dtype="bfloat16", tolerance=1.0, **FAST)
    card = (tmp_path / "rounded" / "README.md").read_text()
    assert "with its weights rounded to bfloat16" in card
    assert "rounded 1 source tensor(s) stored in float32 (model.norm.weight)" in card


def save_in_dtypes(model, folder, matrices: torch.dtype | None = None, vectors: torch.dtype | None = None) -> None:
    """Save `model` into `folder` with its matrices and its vectors (norms) in the dtypes given (a mixed source)."""
    for parameter in model.parameters():
        dtype = matrices if parameter.dim() == 2 else vectors
        if dtype is not None:
            parameter.data = parameter.data.to(dtype)
    model.save_pretrained(folder)


def test_the_card_of_a_mixed_dtype_source_says_what_its_load_code_rounds(tmp_path):
    """bf16 matrices with float32 norms, stored as they are (dtype auto): the card's `from_pretrained(repo)` loads
    every tensor in the config's bfloat16, rounding the norms (0.13 off the verified logits on a tiny model), which
    the card did not say; it names them and the load that computes the verified function."""
    from transformers import AutoModelForCausalLM

    source = save_source(tmp_path / "source")
    model = AutoModelForCausalLM.from_pretrained(source)
    save_in_dtypes(model, source, matrices=torch.bfloat16)
    upcycle(source, tmp_path / "out", **FAST)
    card = (tmp_path / "out" / "README.md").read_text()
    assert re.search(r"\n\nThe weights mix dtypes: \d+ tensor\(s\) in float32 as the source stores them \(model\.layers"
                     r"\.0\.input_layernorm\.weight, .*\), beside bfloat16\. The code above loads every tensor in "
                     r"bfloat16, the config's dtype, which rounds those tensors \(as `from_pretrained` loads the source "
                     r"too\)", card)
    assert "`from_pretrained(..., dtype=torch.float32)` computes with every tensor as stored (the function checked " \
           "above, in float32)" in card
    loaded = AutoModelForCausalLM.from_pretrained(tmp_path / "out")
    exact = AutoModelForCausalLM.from_pretrained(tmp_path / "out", dtype=torch.float32)
    assert loaded.model.norm.weight.dtype == torch.bfloat16 and exact.model.norm.weight.dtype == torch.float32
    float32_source = save_source(tmp_path / "float32")  # one dtype: no note
    upcycle(float32_source, tmp_path / "plain", **FAST)
    assert "The weights mix dtypes" not in (tmp_path / "plain" / "README.md").read_text()
    model = AutoModelForCausalLM.from_pretrained(float32_source)  # float64 norms beside float32: load in float64
    save_in_dtypes(model, float32_source, vectors=torch.float64)
    upcycle(float32_source, tmp_path / "wide", **FAST)
    card = (tmp_path / "wide" / "README.md").read_text()
    assert "beside float32" in card and "`from_pretrained(..., dtype=torch.float64)` computes with every tensor" in card
    # a config.json that declares another dtype than the stored one: the source itself loads in that one
    save_in_dtypes(model, float32_source, matrices=torch.bfloat16, vectors=torch.float32)
    config = json.loads((float32_source / "config.json").read_text())
    (float32_source / "config.json").write_text(json.dumps({**config, "dtype": "float32"}))
    upcycle(float32_source, tmp_path / "declared", **FAST)
    card = " ".join((tmp_path / "declared" / "README.md").read_text().split())
    assert ("loads every tensor in bfloat16, the config's dtype, which rounds those tensors (while `from_pretrained` "
            "loads the source in float32, the dtype its config.json declares)") in card


def test_a_relaxed_bar_is_named_as_the_bar_not_as_an_inexact_conversion(tmp_path):
    """An exact float32 conversion run with tolerance=1e-3 measured a few 1e-6, yet the card said "it is not an exact
    conversion"; and a rounded one said it approximates "the source model's function with its weights rounded"
    within the bar, which the check measured against the source as stored."""
    source = save_source(tmp_path / "source")
    result = upcycle(source, tmp_path / "out", tolerance=1e-3, **FAST)
    assert result.report.max_abs_logit_difference < result.report.default_tolerance  # exact, at a relaxed bar
    card = " ".join((tmp_path / "out" / "README.md").read_text().split())
    assert "verified below at that bar, not as an exact conversion" in card
    assert "it is not an exact conversion" not in card


def test_a_converted_model_is_named_by_its_source_for_the_cards_of_its_fine_tunes(tmp_path):
    """`convert(path)` loads the model back from a temporary folder it then removes; the model kept that path as its
    name_or_path, which a Trainer's model card would name; no local path is named (a card would keep it once the
    folder is gone), a Hub cache snapshot by its Hub id. An in-memory conversion keeps the source model's name (a Hub
    id: the card's base model), where it was "" and the string "None" (PEFT's adapter config then named a Hub repo
    "None")."""
    import shutil

    source = save_source(tmp_path / "source")
    model = convert(source, **FAST)
    assert model.name_or_path == model.config.name_or_path == ""
    snapshot = tmp_path / "hub" / "models--acme--tiny" / "snapshots" / ("0" * 40)
    shutil.copytree(source, snapshot)
    assert convert(snapshot, **FAST).name_or_path == "acme/tiny"
    llama = make_source("llama", True)
    llama.name_or_path = llama.config.name_or_path = "HuggingFaceTB/SmolLM2-135M"
    for converted in (convert(llama, verify=False), upcycle_model(llama), convert_to_dar_moe(llama, 2, 1)):
        assert converted.name_or_path == converted.config.name_or_path == "HuggingFaceTB/SmolLM2-135M"


def test_load_source_of_an_in_memory_model_keeps_its_rotary_frequencies_as_a_path_source_does(tmp_path):
    """load_source(model, bfloat16) copied the model with `.to(dtype)`, which rounds the rotary `inv_freq` buffer
    that `from_pretrained(..., dtype=bfloat16)` keeps float32: the same weights computed 0.07 logits apart."""
    from dar_transformers.conversion import load_source

    source = save_source(tmp_path / "source")
    from_path = load_source(source, torch.bfloat16).model
    in_memory = load_source(copy.deepcopy(from_path).float(), torch.bfloat16, tokenizer=make_tokenizer()).model
    assert in_memory.model.rotary_emb.inv_freq.dtype == torch.float32
    ids = torch.arange(3, 40).unsqueeze(0)
    with torch.no_grad():
        assert torch.equal(from_path(ids).logits, in_memory(ids).logits)


def test_only_source_values_a_cast_changes_count_as_rounded(tmp_path, caplog):
    """The rounding note compares the source tensors' own values: Drop-Upcycling's noised experts (a transform of
    the source MLP) counted as rounding of a source that bfloat16 holds exactly; and a failed check whose write
    changed no value said "The weights were rounded to bfloat16" (the by-dtype guess) where the in-memory model's
    forward hook was the cause."""
    import logging

    source = make_source("llama", tied=False).to(torch.bfloat16).to(torch.float32)  # values bfloat16 holds
    with caplog.at_level(logging.INFO, logger="dar_transformers"):
        upcycle_to_dar_moe(source, tmp_path / "moe", num_experts=2, top_k=1, expert_noise=0.5, dtype="bfloat16",
                           tokenizer=make_tokenizer(), **FAST)
    assert "changed no value: every source tensor is stored exactly" in caplog.text
    source.model.layers[1].mlp.register_forward_hook(lambda module, args, output: 1.5 * output)
    with pytest.raises(VerificationError) as caught:
        upcycle(source, tmp_path / "hooked", tokenizer=make_tokenizer(), dtype="bfloat16", **FAST)
    assert "rounded" not in str(caught.value) and "compared with the in-memory model itself" in str(caught.value)


def test_a_registered_target_kind_takes_its_own_fields_as_keywords(tmp_path, monkeypatch):
    """Keywords that are neither options nor DAR's fields go to the target kind (a registered one's own fields); only
    one spelt nearly as an option is refused there (it refused every keyword outside DAR's and DAR-MoE's fields)."""
    import dataclasses

    from dar_transformers.conversion import register_target_kind
    from dar_transformers.conversion import targets

    seen = {}

    def build_config(source_config, family, dtype, fields):
        fields = dict(fields)
        seen["my_tag"] = fields.pop("my_tag", None)
        return targets.DAR_TARGET.build_config(source_config, family, dtype, fields)

    monkeypatch.setattr(targets, "TARGET_KINDS", dict(targets.TARGET_KINDS))
    register_target_kind("tagged_dar", dataclasses.replace(targets.DAR_TARGET, build_config=build_config))
    upcycle(save_source(tmp_path / "source"), kind="tagged_dar", my_tag="x", **FAST)
    assert seen == {"my_tag": "x"}


def test_the_check_leaves_an_in_memory_source_with_a_dynamic_rope_as_it_was():
    """A dynamic rope keeps the longest length it has run: the check's prompts, past the model's
    max_position_embeddings, were run through the caller's own model (already in the check's dtype and eval mode)
    and through the returned one, which then computed otherwise than before (5.7 logits at 300 tokens)."""
    source = make_source("llama", True)
    source.config.rope_parameters = {"rope_type": "dynamic", "factor": 2.0, "rope_theta": 10000.0}
    source.config.max_position_embeddings = 16
    source = type(source)(source.config).eval()  # built with the dynamic rope
    rotary = source.model.rotary_emb
    before = (rotary.max_seq_len_cached, rotary.inv_freq.clone())
    model = convert(source, tokenizer=make_tokenizer(), **FAST)  # prompts of more than 16 tokens
    assert rotary.max_seq_len_cached == before[0] and torch.equal(rotary.inv_freq, before[1])
    assert model.model.rotary_emb.max_seq_len_cached == 16


def test_a_conversion_from_a_folder_leaves_the_callers_random_generator_as_it_was(tmp_path):
    """The full-greedy check builds the source model from its config, whose random initialisation (overwritten by the
    weights) advanced torch's generator: a script that seeds torch, converts and then trains drew another stream after
    a folder or GGUF conversion than after an in-memory one."""
    source = save_source(tmp_path / "source")
    torch.manual_seed(0)
    expected = torch.rand(3)
    torch.manual_seed(0)
    upcycle(source, tmp_path / "out", dar_block_size=2, full_greedy=True, **FAST)
    assert torch.equal(torch.rand(3), expected)


@pytest.mark.parametrize("seed", ["x", 1.5, None, True, -1, 2**60])
def test_a_drop_upcycling_seed_that_is_no_generator_seed_is_refused_by_name(seed):
    """`seed` was never checked: 'x' built a million-character string and failed on a concatenation, 1.5 and 2**60
    in torch's manual_seed, None in a multiplication, none of them naming the argument."""
    with pytest.raises(ValueError, match=r"^seed must be an integer in \[0, \d+\) \(Drop-Upcycling's"):
        convert_to_dar_moe(make_source("llama"), num_experts=2, top_k=1, expert_noise=0.5, seed=seed)


def test_a_numpy_integer_seed_is_a_seed():
    import numpy

    noisy = convert_to_dar_moe(make_source("llama"), num_experts=2, top_k=1, expert_noise=0.5, seed=numpy.int64(3))
    again = convert_to_dar_moe(make_source("llama"), num_experts=2, top_k=1, expert_noise=0.5, seed=3)
    assert all(torch.equal(a, b) for a, b in zip(noisy.state_dict().values(), again.state_dict().values()))


def test_expert_noise_given_as_a_bool_is_refused():
    with pytest.raises(ValueError, match=r"expert_noise must be a fraction in \[0, 1\]"):
        convert_to_dar_moe(make_source("llama"), num_experts=2, top_k=1, expert_noise=True)


def test_options_that_are_no_conversion_options_and_a_field_given_twice_are_refused(tmp_path):
    """`convert(path, options={...})` failed with "'dict' object has no attribute 'verify'" before `upcycle`'s own
    refusal could name the argument; `fields={'dar_block_size': 2}` beside `dar_block_size=3` used 3 silently."""
    source = save_source(tmp_path / "source")
    with pytest.raises(TypeError, match=r"^options must be a ConversionOptions \(or None\), got dict"):
        convert(source, options={"verify": False})
    with pytest.raises(ValueError, match=r"^dar_block_size given twice, in fields= and as a keyword, with other "
                                         r"values \(dar_block_size=2 and 3\): give each once\.$"):
        upcycle(make_source("llama"), tokenizer=make_tokenizer(), fields={"dar_block_size": 2}, dar_block_size=3)
    assert upcycle(make_source("llama"), tokenizer=make_tokenizer(), fields={"dar_block_size": 3}, dar_block_size=3,
                   **FAST).config.dar_block_size == 3
