# SPDX-License-Identifier: Apache-2.0
"""Verification (CPU, tiny models): what is verified is what is written, and verdicts fail when they must: a
wrong DAR init, an inexact setting, greedy or top-1 disagreement, rounding beyond the bar (unless relaxed)."""

import json
import math
import platform
import shutil
import subprocess
import sys

import pytest
import torch
from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer, LlamaForCausalLM

from dar_transformers import DARForCausalLM
from dar_transformers.conversion import (
    ConversionOptions,
    VerificationError,
    VerificationReport,
    api as conversion_api,
    plan as conversion_plan,
    upcycle,
    upcycle_model,
    write as conversion_write,
)
from dar_transformers.conversion.checkpoints import SafetensorsCheckpoint
from dar_transformers.conversion.plan import meta_model
from dar_transformers.conversion.report import PromptCheck
from dar_transformers.conversion.verify import raise_unless_passed
from dar_transformers.conversion import streamed
from dar_transformers.conversion.streamed import StreamedModel, streamed_hidden_states, streamed_logits, token_budget_groups

from conftest import FAST, IDS, assert_nothing_written, make_source, make_tokenizer, save_bf16_source, save_source


def test_streamed_verification_catches_a_wrong_dar_init_and_writes_nothing(tmp_path, monkeypatch):
    source = save_source(tmp_path / "source")
    right = conversion_plan.new_parameter_values

    def wrong(model_class, config, names):  # negative control: the read gates off their exact init alpha = 1/2
        values = right(model_class, config, names)
        return {name: value + 0.3 if name.endswith("read_gate.logit") else value for name, value in values.items()}

    monkeypatch.setattr(conversion_plan, "new_parameter_values", wrong)
    before = sorted(p.name for p in tmp_path.iterdir())
    with pytest.raises(VerificationError, match="nothing was written") as caught:
        upcycle(source, tmp_path / "out", dar_block_size=2, **FAST)
    assert caught.value.report.max_abs_logit_difference > 1e-3
    assert sorted(p.name for p in tmp_path.iterdir()) == before


def test_the_model_verified_is_the_model_written(tmp_path):
    """The streamed check reads the written folder: its DAR logits are those of `from_pretrained(out)` in float32,
    whose rotary `inv_freq` and other buffers are what `from_pretrained(out, dtype="auto")` builds (float32)."""
    source = save_bf16_source(tmp_path / "source")
    upcycle(source, tmp_path / "out", dar_block_size=2, **FAST)
    out = tmp_path / "out"
    source_model = AutoModelForCausalLM.from_pretrained(source, dtype=torch.float32).eval()
    reloaded32 = AutoModelForCausalLM.from_pretrained(out, dtype=torch.float32).eval()
    reloaded_auto = AutoModelForCausalLM.from_pretrained(out, dtype="auto").eval()
    for (name, buffer32), (_, buffer_auto) in zip(reloaded32.named_buffers(), reloaded_auto.named_buffers()):
        assert buffer_auto.dtype == buffer32.dtype == torch.float32 and torch.equal(buffer_auto, buffer32), name
    written = SafetensorsCheckpoint(out)
    sources = SafetensorsCheckpoint(source)
    streamed_source, streamed_target = streamed_logits(
        StreamedModel(meta_model(LlamaForCausalLM, source_model.config), sources),
        StreamedModel(meta_model(DARForCausalLM, reloaded32.config), written),
        [IDS[:1]], torch.float32,
    )
    with torch.no_grad():
        assert torch.allclose(streamed_target[0], reloaded32(IDS[:1]).logits, atol=1e-6, rtol=0)
        assert torch.allclose(streamed_source[0], source_model(IDS[:1]).logits, atol=1e-6, rtol=0)
    # The in-memory path builds the model as from_pretrained does: no bf16 rotary frequencies (the old bug).
    in_memory = upcycle_model(make_source("llama").to(torch.bfloat16), dar_block_size=2)
    assert in_memory.model.rotary_emb.inv_freq.dtype == torch.float32


def test_the_streamed_check_runs_the_code_path_of_a_loaded_model(tmp_path, monkeypatch):
    """With only the running layer's weights loaded, the depth backend found no parameters for the reads ahead in a
    block and planned one layer at a time, where a model loaded by `from_pretrained` plans a block's reads at once: the
    check ran another code path than the one users run, and a fault in that path passed it (a helper's repro). The
    residual modules are loaded for the whole pass: the same phase-1 groups, and such a fault is caught."""
    from collections import Counter

    from dar_transformers import depth_backends

    source = save_source(tmp_path / "source")
    groups = Counter()
    planned = depth_backends.InferenceDepthBackend._phase_one

    def counted(self, state, residuals):
        groups[len(residuals)] += 1
        return planned(self, state, residuals)

    monkeypatch.setattr(depth_backends.InferenceDepthBackend, "_phase_one", counted)
    upcycle(source, tmp_path / "out", dar_block_size=4, prompts=["Hello world"], full_greedy=False, tolerance=1e-5,
            progress=False)
    checked, groups = groups, Counter()
    with torch.no_grad():
        AutoModelForCausalLM.from_pretrained(tmp_path / "out").eval()(IDS[:1])
    assert checked == groups and max(groups) == 3  # a block of 4 reads: the three that see the same entries at once

    def faulty(self, state, residuals):  # a fault in the block-planned path only (three reads or more)
        plans = planned(self, state, residuals)
        if len(residuals) > 2:
            plans[-1] = plans[-1]._replace(mean=None if plans[-1].mean is None else plans[-1].mean + 0.05)
        return plans

    monkeypatch.setattr(depth_backends.InferenceDepthBackend, "_phase_one", faulty)
    with pytest.raises(VerificationError, match="nothing was written"):
        upcycle(source, tmp_path / "faulty", dar_block_size=4, prompts=["Hello world"], full_greedy=False,
                tolerance=1e-5, progress=False)


def report_with(max_difference: float, greedy: bool | None, agreed: int = 5) -> VerificationReport:
    check = PromptCheck("p", 5, 3.0, max_difference, 5, agreed, greedy, [1, 2], [1, 2] if greedy else [1, 3])
    return VerificationReport("float32", 2e-4, 2e-4, 2, [check])


@pytest.mark.parametrize("family, fields, says", [
    ("mistral", {"sliding_window": 1024}, "sliding_window=1024"),
    ("llama", {"max_position_embeddings": 1024, "rope_parameters": {"rope_type": "dynamic", "rope_theta": 10000.0,
                                                                    "factor": 4.0}},
     "the dynamic rope's scaling past max_position_embeddings=1024"),
    ("llama", {"max_position_embeddings": 8192, "rope_parameters": {
        "rope_type": "longrope", "rope_theta": 10000.0, "original_max_position_embeddings": 2048,
        "short_factor": [1.0] * 4, "long_factor": [4.0] * 4}},
     "longrope's long factors past original_max_position_embeddings=2048"),
    ("mistral", {"sliding_window": 5}, None),  # shorter than the prompts: exercised
])
def test_the_report_names_the_settings_no_checked_sequence_reaches(tmp_path, family, fields, says):
    """A window of 1024 tokens, a dynamic rope past 1024, longrope's long factors past 2048: the check's prompts (a
    few hundred tokens) never reach them, so a conversion that lost them passed (a helper's repro, 5.6-7.6 logits
    off at 1500 tokens). The report and the card now say which settings went unexercised, and at what length."""
    source = save_source(tmp_path / "source", family=family)
    config = json.loads((source / "config.json").read_text())
    config.update(fields)
    (source / "config.json").write_text(json.dumps(config))
    result = upcycle(source, tmp_path / "out", max_new_tokens=2, tolerance=1e-5, progress=False)
    card = " ".join((tmp_path / "out" / "README.md").read_text().split())
    longest = max(check.num_tokens for check in result.report.checks) + 2
    if says is None:
        assert "Not exercised" not in result.report.table() and "Not exercised" not in card
        return
    sentence = (f"Not exercised, since no checked sequence reaches them (the longest has {longest} tokens): {says}; "
                "the converted config sets them as the source's does.")
    assert sentence in result.report.table() and sentence in card


def test_a_divergence_is_a_tie_only_under_a_finite_tolerance():
    """Drop-Upcycling's conversion (tolerance inf: differences reported only) labelled every greedy divergence a "tie"
    ("the source's top-1/top-2 margin is 1.1e+00 (<= 2 x tolerance) and the logits differ by 3.8e+00"): every margin
    is at most twice an infinite tolerance (a helper's repro)."""
    check = PromptCheck("p", 5, 3.0, 3.8, 5, 4, False, [1, 2], [1, 3], greedy_divergence=(1, 1.1, 3.8))
    assert not check.diverged_at_near_tie(math.inf)
    assert "| NO: first differs at new token 2" in VerificationReport("float32", math.inf, 2e-4, 2, [check]).table()
    near = PromptCheck("p", 5, 3.0, 1e-5, 5, 5, False, [1, 2], [1, 3], greedy_divergence=(1, 1e-4, 1e-5))
    assert near.diverged_at_near_tie(2e-4)  # the rule itself, at a finite bar
    # A relaxed finite bar (--tolerance 10 on Drop-Upcycling) judges ties at the default tolerance: NO, not a tie.
    relaxed = VerificationReport("float32", 10.0, 2e-4, 2, [check]).table()
    assert "| NO: first differs at new token 2, where the source's top-1/top-2 margin is 1.1e+00 (> 2 x the default " \
           "tolerance)" in relaxed
    assert "| tie: first differs" in VerificationReport("float32", 2e-4, 2e-4, 2, [near]).table()


def test_logits_within_tolerance_but_different_greedy_tokens_do_not_pass_and_write_nothing(tmp_path, monkeypatch):
    assert report_with(1e-6, True).passed
    assert not report_with(1e-6, False).passed  # greedy continuations differ
    assert not report_with(1e-6, None, agreed=4).passed  # a teacher-forced top-1 disagreement
    assert not report_with(1e-3, True).passed
    source = save_source(tmp_path / "source")
    monkeypatch.setattr(conversion_api, "verify_written", lambda *args, **kwargs: report_with(1e-6, False))
    before = sorted(p.name for p in tmp_path.iterdir())
    with pytest.raises(VerificationError, match="nothing was written"):
        upcycle(source, tmp_path / "out", **FAST)
    assert sorted(p.name for p in tmp_path.iterdir()) == before


def test_a_conversion_that_is_not_exact_is_refused_and_nothing_written(tmp_path):
    source = save_source(tmp_path / "source")
    before = {p.name for p in tmp_path.iterdir()}
    # Without the partial block as a source the reduction fails (DESIGN.md section 3 negative control).
    with pytest.raises(VerificationError, match="nothing was written") as caught:
        upcycle(source, tmp_path / "out", dar_block_size=2, dar_include_partial=False, tolerance=1e-5, **FAST)
    assert caught.value.report.max_abs_logit_difference > 1e-2
    assert_nothing_written(tmp_path, before)


def test_bfloat16_needs_an_explicit_lower_bar_which_the_card_records(tmp_path):
    source = save_source(tmp_path / "source")
    with pytest.raises(VerificationError, match="--tolerance"):
        upcycle(source, tmp_path / "out", dtype="bfloat16", **FAST)
    assert not (tmp_path / "out").exists()
    result = upcycle(source, tmp_path / "out", dtype="bfloat16", tolerance=10.0, **FAST)
    assert result.report.relaxed
    assert "RELAXED" in (tmp_path / "out" / "README.md").read_text()
    reloaded = AutoModelForCausalLM.from_pretrained(tmp_path / "out")
    assert reloaded.model.embed_tokens.weight.dtype == torch.bfloat16
    assert reloaded.model.layers[0].attn_residual.write_gate.logit.dtype == torch.float32


def test_float64_verification_runs_hf_norms_in_float64_and_restores_them():
    """HF's RMSNorm rounds through float32 even in float64; the float64 verification lifts that on both models, for
    its duration only."""
    from conftest import tiny_llama

    from dar_transformers.convert import norms_in_input_dtype

    llama = tiny_llama(dtype=torch.float64)
    norm = llama.model.norm
    generator = torch.Generator().manual_seed(0)
    hidden = torch.randn(2, 3, llama.config.hidden_size, dtype=torch.float64, generator=generator)
    exact = norm.weight * hidden * torch.rsqrt(hidden.pow(2).mean(-1, keepdim=True) + norm.variance_epsilon)
    assert (norm(hidden) - exact).abs().max() > 1e-12  # HF's own: float32 inside
    with norms_in_input_dtype(llama):
        torch.testing.assert_close(norm(hidden), exact, rtol=1e-15, atol=1e-15)
        assert all("forward" in vars(layer.input_layernorm) for layer in llama.model.layers)
    assert not any("forward" in vars(module) for module in llama.modules())
    assert (norm(hidden) - exact).abs().max() > 1e-12


# ---------------------------------------------------------------------------------------------------------------
# A check that compared nothing, or compared NaNs, does not pass.


def test_a_verification_that_compared_nothing_is_not_passed():
    empty = VerificationReport("float32", 2e-4, 2e-4, 0, [])
    assert not empty.passed and "FAILED: nothing was compared (no prompt was run)" in empty.table()
    undecided = VerificationReport("float32", 2e-4, 2e-4, 0, [PromptCheck("p", 5, 3.0, 0.0, 0, 0, None, [], [])])
    assert not undecided.passed and "no next token was compared" in undecided.table()
    # A relaxed check compares logits only (Drop-Upcycling): it needs prompts, not decided positions; without any it
    # passes unverified, at inf as at a finite bar no margin reaches (1e30 read PASSED with 0/0 positions compared).
    for tolerance, bar in ((math.inf, "inf"), (1e30, "1.0e+30")):
        relaxed = VerificationReport("float32", tolerance, 2e-4, 0, [PromptCheck("p", 5, 3.0, 0.5, 0, 0, None, [], [])])
        assert relaxed.passed and not relaxed.verified
        assert "PASSED" not in relaxed.table() and f"NOT VERIFIED (tolerance {bar}: differences reported only" in \
            relaxed.table()
    decided = VerificationReport("float32", 0.5, 2e-4, 0, [PromptCheck("p", 5, 3.0, 0.25, 2, 2, None, [], [])])
    assert decided.verified and "\nPASSED: " in decided.table()
    nan = VerificationReport("float32", 2e-4, 2e-4, 0, [PromptCheck("p", 5, 3.0, math.nan, 5, 5, None, [], [])])
    assert not nan.passed and math.isnan(nan.max_abs_logit_difference)
    # No prompt: no claim that greedy continuations ran, and the refusal says nothing was verified, not that the
    # model differs.
    assert not empty.greedy_ran and "no full greedy continuations" in empty.table()
    with pytest.raises(VerificationError) as refused:
        raise_unless_passed(empty, torch.float32)
    assert str(refused.value).startswith("The converted model could not be verified (no prompt was run); nothing was")
    with pytest.raises(VerificationError, match="^The converted model does not reproduce the source;"):
        raise_unless_passed(nan, torch.float32)


def test_an_empty_list_of_prompts_is_refused_before_any_work():
    with pytest.raises(ValueError, match=r"prompts must hold at least one text \(None: the default prompts\), got \[\]"):
        ConversionOptions(prompts=[])


def overflowing_source(folder):
    """A source whose weights are finite but whose layer 1 overflows: its MLP output is ~1e38 * 64 = inf."""
    model = make_source("llama", tied=False)
    with torch.no_grad():
        model.model.layers[1].mlp.down_proj.weight.fill_(1e38)
    model.save_pretrained(folder)
    return model


def test_non_finite_outputs_fail_the_streamed_check_naming_the_first_layer(tmp_path):
    source = tmp_path / "source"
    overflowing_source(source)
    make_tokenizer().save_pretrained(source)
    with pytest.raises(VerificationError, match="nothing was written") as caught:
        upcycle(source, tmp_path / "out", dar_block_size=2, **FAST)
    report = caught.value.report
    assert report.first_nonfinite == "source model.layers.1" and not report.passed
    assert "non-finite values (NaN or inf) first appear in the output of source model.layers.1" in str(caught.value)
    assert not (tmp_path / "out").exists()


def test_non_finite_outputs_fail_the_in_memory_check_naming_the_first_layer(tmp_path):
    source = overflowing_source(tmp_path / "source")
    with pytest.raises(VerificationError) as caught:
        upcycle(source, dar_block_size=2, prompts=None, max_new_tokens=0, progress=False)
    assert caught.value.report.first_nonfinite == "source model.layers.1"


def test_the_streamed_forward_gives_each_prompt_its_unpadded_output_in_any_batching(tmp_path):
    """Right padding never reaches a real position (causal attention): one batch, groups, or one prompt at a time
    give the same hidden states, and the same as the reloaded model's own forward on the unpadded prompt."""
    source = save_source(tmp_path / "source")
    upcycle(source, tmp_path / "out", dar_block_size=2, tolerance=1e-5, **FAST)
    reloaded = AutoModelForCausalLM.from_pretrained(tmp_path / "out", dtype=torch.float32).eval()
    side = StreamedModel(meta_model(DARForCausalLM, reloaded.config), SafetensorsCheckpoint(tmp_path / "out"))
    prompts = [IDS[:1, :24], IDS[1:, :7], IDS[:1, 3:15]]
    assert token_budget_groups([24, 7, 12], 30) == [[0], [1, 2]]
    runs = [streamed_hidden_states(side, prompts, torch.float32, max_batch_tokens=budget)[0] for budget in (None, 30, 1)]
    with torch.no_grad():
        for index, ids in enumerate(prompts):
            own = reloaded.model(ids).last_hidden_state
            for run in runs:
                assert run[index].shape == own.shape and torch.allclose(run[index], own, atol=1e-5, rtol=0)


RELEASE_SCRIPT = """
import torch
from dar_transformers.conversion.streamed import release_freed_heap
def anon():
    return next(int(line.split()[1]) for line in open("/proc/self/status") if line.startswith("RssAnon:")) / 1024
big = torch.empty(16 * 2**20, dtype=torch.uint8).fill_(1)
del big  # freeing a 16 MiB mapped block raises glibc's mmap threshold to 16 MiB: smaller blocks go to the heap
blocks = [torch.empty(8 * 2**20, dtype=torch.uint8).fill_(1) for _ in range(32)]  # a layer's tensors
live = torch.empty(2**20, dtype=torch.uint8).fill_(1)  # a block still in use above them: the heap's top stays
held = anon()
del blocks
freed = anon()
release_freed_heap()
print(held, freed, anon())
"""


@pytest.mark.skipif(not sys.platform.startswith("linux") or platform.libc_ver()[0] != "glibc", reason="glibc's heap")
def test_a_layer_streamed_pass_hands_each_layers_freed_heap_back(tmp_path, monkeypatch):
    """glibc keeps a freed layer's heap blocks resident (the control: freeing 256 MiB leaves RssAnon where it was),
    which grew a layer-streamed verification by about a layer's small tensors per layer (TinyLlama shape: 1.83 GiB
    peak); `release_freed_heap` returns them, and the streamed forward calls it after every decoder layer."""
    completed = subprocess.run([sys.executable, "-c", RELEASE_SCRIPT], capture_output=True, text=True, check=True)
    held, freed, released = map(float, completed.stdout.split())
    assert freed > held - 32, (held, freed)  # MiB: not returned by freeing alone
    assert released < freed - 200, (freed, released)

    calls = []
    monkeypatch.setattr(streamed, "release_freed_heap", lambda: calls.append(1))
    source = save_source(tmp_path / "source")
    side = StreamedModel(meta_model(LlamaForCausalLM, AutoConfig.from_pretrained(source)), SafetensorsCheckpoint(source))
    streamed_hidden_states(side, [IDS[:1, :8]], torch.float32)
    assert len(calls) == side.model.config.num_hidden_layers


def lowercase_everything(folder):  # a normalizer the source's tokenizer.json does not have
    spec = json.loads((folder / "tokenizer.json").read_text())
    spec["normalizer"] = {"type": "Lowercase"}
    (folder / "tokenizer.json").write_text(json.dumps(spec))


def drop_the_chat_template(folder):
    (folder / "chat_template.jinja").unlink(missing_ok=True)
    fields = json.loads((folder / "tokenizer_config.json").read_text())
    fields.pop("chat_template", None)
    (folder / "tokenizer_config.json").write_text(json.dumps(fields))


def another_eos_token(folder):
    fields = json.loads((folder / "tokenizer_config.json").read_text())
    fields["eos_token"] = "<|im_end|>"
    (folder / "tokenizer_config.json").write_text(json.dumps(fields))


@pytest.mark.parametrize("tamper, named", [
    (lowercase_everything, r"ids of 'Hello world': the source's \[\d+(, \d+)*\], the written one's \["),
    (drop_the_chat_template, r"chat template: the source's \"\{% for m in messages.*, the written one's None"),
    (another_eos_token, r"eos_token: the source's \('</s>', 2\), the written one's \('<\|im_end\|>', 4\)"),
])
def test_a_written_tokenizer_that_loads_back_differently_is_refused_and_nothing_is_written(tmp_path, monkeypatch,
                                                                                          tamper, named):
    """The logits check feeds both models ids that the source's tokenizer made, so a tokenizer that `save_pretrained`
    wrote differently (another normalizer, no chat template, another end-of-sequence token: a user's generations
    would differ) passed it. The written tokenizer is loaded back with AutoTokenizer and compared; a difference is
    refused naming it, and nothing is written. Both ways a tokenizer is written: a folder's copied as its files (the
    tampering after the copy), an in-memory model's saved by transformers."""
    source = save_source(tmp_path / "source")
    for writer, in_memory in (("name_tokenizer_class", False), ("write_tokenizer", True)):
        written = getattr(conversion_write, writer)

        def tampered(folder, tokenizer, written=written):
            written(folder, tokenizer)
            tamper(folder)

        monkeypatch.setattr(conversion_write, writer, tampered)
        given = dict(source=source)
        if in_memory:
            given = dict(source=AutoModelForCausalLM.from_pretrained(source),
                         tokenizer=AutoTokenizer.from_pretrained(source))
        before = {p.name for p in tmp_path.iterdir()}
        with pytest.raises(ValueError, match=r"The tokenizer written for the output, loaded back with AutoTokenizer, "
                                             rf"differs from the source's: {named}.*nothing is written\.$"):
            upcycle(output=tmp_path / "out", dar_block_size=2, progress=False, **given)
        assert_nothing_written(tmp_path, before)
        monkeypatch.setattr(conversion_write, writer, written)  # the control: as written, it converts
        converted = upcycle(output=tmp_path / "out", dar_block_size=2, max_new_tokens=0, progress=False, **given)
        assert converted.report.passed
        shutil.rmtree(tmp_path / "out")


def corrupting_writes(monkeypatch, name: str, row: int, value: float = 5.0) -> None:
    """After the write, row `row` of the written tensor `name` (float32, in one of the shards) holds `value`: a writer
    that went wrong where no verification prompt looks."""
    import struct

    write_checkpoint = conversion_write.write_checkpoint

    def corrupted(folder, plans, *args, **kwargs):
        index = write_checkpoint(folder, plans, *args, **kwargs)
        path = folder / index["weight_map"][name]
        with open(path, "r+b") as shard:
            (header_size,) = struct.unpack("<Q", shard.read(8))
            entry = json.loads(shard.read(header_size))[name]
            row_elements = math.prod(entry["shape"][1:])
            assert entry["dtype"] == "F32"
            shard.seek(8 + header_size + entry["data_offsets"][0] + row * row_elements * 4)
            shard.write(torch.full((row_elements,), value).numpy().tobytes())
        return index

    monkeypatch.setattr(conversion_write, "write_checkpoint", corrupted)


def test_an_embedding_row_no_prompt_reads_is_compared_and_a_corrupt_one_refused(tmp_path, monkeypatch):
    """The logit check reads the embedding rows of its prompts' tokens only; every written tensor is also compared
    with the source bit for bit (`check_written_tensors`), so a row of a token no prompt holds that was written wrong
    fails the conversion, named, and nothing is written (it was reported PASSED at 3e-6 while that token's logits
    were 3.3 off)."""
    source = save_source(tmp_path / "source", tied=False)
    prompt_tokens = set(IDS.reshape(-1).tolist())
    tokenizer = make_tokenizer()
    used = {token for text in FAST["prompts"] for token in tokenizer(text)["input_ids"]}
    row = next(token for token in range(3, 300) if token not in used | prompt_tokens)
    corrupting_writes(monkeypatch, "model.embed_tokens.weight", row)
    before = sorted(p.name for p in tmp_path.iterdir())
    with pytest.raises(VerificationError, match=rf"'model.embed_tokens.weight'.*row {row}\b.*nothing was written"):
        upcycle(source, tmp_path / "out", dar_block_size=2, **FAST)
    assert sorted(p.name for p in tmp_path.iterdir()) == before


@pytest.mark.parametrize("change", ["a tensor added", "a tensor's header reshaped"])
def test_the_written_headers_are_the_planned_tensors_dtypes_and_shapes(tmp_path, monkeypatch, change):
    """The written-tensor check compared each planned tensor's bytes only: a writer that added a tensor, or wrote a
    planned tensor's bytes under a header of another shape, passed it. Both are refused now, named."""
    from safetensors.torch import load_file, save_file

    write_checkpoint = conversion_write.write_checkpoint

    def rewritten(folder, plans, *args, **kwargs):
        index = write_checkpoint(folder, plans, *args, **kwargs)
        shard = folder / index["weight_map"]["model.norm.weight"]
        tensors = load_file(shard)
        if change == "a tensor added":
            tensors["model.extra.weight"] = torch.zeros(4)
            index["weight_map"]["model.extra.weight"] = shard.name
            index_file = next(folder.glob("*.safetensors.index.json"), None)
            if index_file is not None:
                listed = json.loads(index_file.read_text())
                index_file.write_text(json.dumps({**listed, "weight_map": index["weight_map"]}))
        else:  # the same bytes, another shape
            tensors["model.norm.weight"] = tensors["model.norm.weight"].reshape(2, -1)
        save_file(tensors, shard, metadata={"format": "pt"})
        return index

    monkeypatch.setattr(conversion_write, "write_checkpoint", rewritten)
    source = save_source(tmp_path / "source")
    expected = (r"other tensors than the conversion planned \(not planned: 'model\.extra\.weight'\)"
                if change == "a tensor added" else
                r"'model\.norm\.weight'.*its header \(float32 \[2, \d+\] where \[\d+\] was planned\)")
    with pytest.raises(VerificationError, match=expected + ".*nothing was written"):
        upcycle(source, tmp_path / "out", dar_block_size=2, **FAST)
    assert not (tmp_path / "out").exists()


def test_every_expert_is_compared_whatever_the_prompts_routing_reaches(tmp_path, monkeypatch):
    """Mixtral's per-expert tensors fused into one written tensor: a corrupt slice of it is named by the source
    tensor it came from, whatever the prompts' routing reaches."""
    from transformers import MixtralConfig, MixtralForCausalLM

    from conftest import SHAPE, VOCAB, spread_weights
    from dar_transformers.conversion import upcycle_to_dar_moe

    torch.manual_seed(0)
    model = spread_weights(MixtralForCausalLM(MixtralConfig(**SHAPE, vocab_size=VOCAB, num_local_experts=4,
                                                            num_experts_per_tok=2)))
    model.save_pretrained(tmp_path / "source")
    make_tokenizer().save_pretrained(tmp_path / "source")
    corrupting_writes(monkeypatch, "model.layers.1.mlp.experts.gate_up_proj", 2)  # [E, 2 I, D]: rows of expert 2
    with pytest.raises(VerificationError, match=r"gate_up_proj'.*'model\.layers\.1\.block_sparse_moe\.experts\.2\.w1\."
                                                r"weight', row 0\b"):
        upcycle_to_dar_moe(tmp_path / "source", tmp_path / "out", dar_block_size=2, tolerance=1e-5, **FAST)
    assert not (tmp_path / "out").exists()


def test_a_computed_tensor_is_compared_again_whole(tmp_path, monkeypatch):
    """Drop-Upcycling's noised experts (a transform of the source's MLP, seeded per layer) and DAR's new parameters
    are computed again and compared whole: a corrupt one is refused too."""
    from dar_transformers.conversion import upcycle_to_dar_moe

    source = save_source(tmp_path / "source", tied=False)
    corrupting_writes(monkeypatch, "model.layers.0.mlp.experts.down_proj", 1)
    with pytest.raises(VerificationError, match=r"'model\.layers\.0\.mlp\.experts\.down_proj'.*its computed values"):
        upcycle_to_dar_moe(source, tmp_path / "out", num_experts=4, top_k=2, expert_noise=0.5, dar_block_size=2,
                           tolerance=1e3, **FAST)
    monkeypatch.undo()
    corrupting_writes(monkeypatch, "model.layers.0.attn_residual.read_gate.logit", 0, 0.25)
    with pytest.raises(VerificationError, match=r"read_gate\.logit'.*its computed values"):
        upcycle(source, tmp_path / "out2", dar_block_size=2, **FAST)


@pytest.mark.parametrize("change", ["rms_norm_eps edited", "forward hook", "model.to(bfloat16)", "none"])
def test_a_written_in_memory_source_is_checked_against_the_model_object_itself(tmp_path, change):
    """An in-memory model written to a folder was checked against a model rebuilt from its config and state dict: a
    model that computes something else (a config edited after construction, a forward hook, rotary frequencies
    rounded by `model.to(dtype)`) was reported PASSED at 3e-6 while the written model was 2-3.4 logits (0.006 for the
    rounding) away from the caller's. The check now runs the object itself (the in-memory path always did), and a
    refusal names the likely causes; an unchanged model converts exactly."""
    source = make_source("llama", tied=False)
    if change == "rms_norm_eps edited":
        source.config.rms_norm_eps = 0.5  # the norms keep the value of their construction
    elif change == "forward hook":
        source.model.layers[1].mlp.register_forward_hook(lambda module, args, output: 2 * output)
    elif change == "model.to(bfloat16)":
        source = source.to(torch.bfloat16)  # rounds the rotary inv_freq too
    before = {name: tensor.clone() for name, tensor in source.state_dict().items()}
    options = dict(tokenizer=make_tokenizer(), dar_block_size=2, full_greedy=False, prompts=FAST["prompts"],
                   progress=False)
    if change == "none":
        assert upcycle(source, tmp_path / "out", **options).report.passed
    else:
        match = "rotary frequencies" if change == "model.to(bfloat16)" else "compared with the in-memory model itself"
        with pytest.raises(VerificationError, match=match):
            upcycle(source, tmp_path / "out", **options)
        assert not (tmp_path / "out").exists()
        with pytest.raises(VerificationError, match=match):  # converted in memory: the same causes, named too
            upcycle(source, **options)
    assert all(torch.equal(tensor, source.state_dict()[name]) for name, tensor in before.items())


def test_a_source_rewritten_during_the_conversion_is_named_as_a_possible_cause(tmp_path, monkeypatch):
    """A source rewritten in place while it was converted (a save or a download into it still running): the read-back
    comparison refused the output, rightly, but said only that "the write is corrupt ... a bug or a fault of the
    disk" (a helper's repro). It names the source's change as the other cause."""
    from safetensors.torch import load_file, save

    source = save_source(tmp_path / "source")
    check = conversion_api.check_written_tensors

    def source_rewritten(folder, plans, checkpoint, *args):
        state = load_file(source / "model.safetensors")
        state["model.norm.weight"] = state["model.norm.weight"] + 1.0
        with open(source / "model.safetensors", "r+b") as handle:  # in place, as a writer still running does
            handle.write(save(state, metadata={"format": "pt"}))
        return check(folder, plans, checkpoint, *args)

    monkeypatch.setattr(conversion_api, "check_written_tensors", source_rewritten)
    with pytest.raises(VerificationError, match=r"'model\.norm\.weight' differs .* Either the source's files changed "
                                                r"while the conversion read them"):
        upcycle(source, tmp_path / "out", **FAST)
    assert not (tmp_path / "out").exists()


def test_a_refusal_at_large_logits_says_the_difference_is_float32_rounding_of_them():
    """A model whose logits reach 230 misses the absolute float32 bar (2e-4) by rounding alone (1.4e-3, 6e-6 of its
    largest logit, every next token agreeing): the refusal only showed the table. It now says so and names
    --verify-dtype float64; a larger difference, or a disagreeing token, gets no such sentence."""
    def report(difference, agreed=5, greedy=True):
        check = PromptCheck("p", 5, 230.9, difference, 5, agreed, greedy, [1, 2], [1, 2] if greedy else [1, 3])
        return VerificationReport("float32", 2e-4, 2e-4, 2, [check])

    said = r"the difference 1\.4e-03 is 6e-06 of the largest logit \(230\.9\).*--verify-dtype float64"
    with pytest.raises(VerificationError, match=said):
        raise_unless_passed(report(1.41e-3), torch.float32)
    for failed in (report(5e-3), report(1.41e-3, agreed=4), report(1.41e-3, greedy=False)):
        with pytest.raises(VerificationError) as caught:
            raise_unless_passed(failed, torch.float32)
        assert "--verify-dtype float64 measures" not in str(caught.value)
