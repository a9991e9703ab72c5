# SPDX-License-Identifier: Apache-2.0
"""Dense conversion end to end (CPU, tiny models): Llama/Mistral/Qwen2/Qwen3 folders, GGUF files and in-memory
models convert exactly, the written folder is a complete repo equal to the in-memory conversion bit for bit, loads
with remote code without the package and under offloading, and no path of the converting machine reaches it."""

import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file
from transformers import AutoModelForCausalLM, AutoTokenizer, LlamaForCausalLM

from dar_transformers import DARForCausalLM
from dar_transformers.conversion import convert, upcycle, upcycle_model
from dar_transformers.conversion.verify import norms_in_input_dtype

from conftest import (
    FAST,
    IDS,
    REPO,
    VOCAB,
    assert_equals_in_memory,
    assert_same_state,
    logits,
    make_source,
    make_tokenizer,
    max_logit_difference,
    save_source,
    tree_digest,
    write_tiny_gguf,
)


def dar_parameter_names_of(folder: Path) -> set[str]:
    index = json.loads((folder / "model.safetensors.index.json").read_text())
    return {name for name in index["weight_map"] if "_residual." in name or "final_readout" in name}


@pytest.fixture(scope="module")
def converted_llama(tmp_path_factory):
    """A tied tiny Llama folder converted with all default verification prompts (text and chat)."""
    root = tmp_path_factory.mktemp("tied")
    source = save_source(root / "source")
    before = tree_digest(source)
    result = upcycle(source, root / "out", dar_block_size=2, tolerance=1e-5, progress=False)
    return root, source, before, result


def test_tied_llama_folder_converts_exactly_and_writes_a_complete_repo(converted_llama):
    root, source, before, result = converted_llama
    report = result.report
    assert report.passed and report.greedy_identical
    assert report.max_abs_logit_difference <= 1e-5
    assert max(check.max_abs_logit for check in report.checks) > 2  # the bar is tight relative to the logits
    assert [check.name for check in report.checks][-1].startswith("chat:")  # the chat template was exercised
    assert all(check.num_tokens >= 64 for check in report.checks[:-1])

    out = root / "out"
    names = {p.name for p in out.iterdir()}
    expected = {"config.json", "configuration_dar.py", "modeling_dar.py", "model.safetensors.index.json",
                "model-00001-of-00002.safetensors", "model-00002-of-00002.safetensors", "generation_config.json",
                "tokenizer.json", "tokenizer_config.json", "README.md"}
    assert expected <= names, names
    assert not [p for p in root.iterdir() if p.name.startswith(".out.")]  # no staging folder left behind
    umask = os.umask(0)
    os.umask(umask)
    assert (out.stat().st_mode & 0o777) == 0o777 & ~umask  # not mkdtemp's owner-only mode
    assert all((p.stat().st_mode & 0o777) == 0o666 & ~umask for p in out.iterdir())
    config = json.loads((out / "config.json").read_text())
    assert config["auto_map"]["AutoModelForCausalLM"] == "modeling_dar.DARForCausalLM"
    assert config["model_type"] == "dar" and config["dar_block_size"] == 2 and config["tie_word_embeddings"] is True
    template = (out / "chat_template.jinja").read_text() if "chat_template.jinja" in names else ""
    assert "<|im_start|>" in template + (out / "tokenizer_config.json").read_text()
    card = (out / "README.md").read_text()
    assert f"{report.max_abs_logit_difference:.3e}" in card and "PASSED" in card
    assert "trust_remote_code=True" in card and "Block DAR, 3 blocks" in card
    answers = [line for line in card.splitlines() if line.startswith(("| source |", "| converted |"))]
    assert len(answers) == 2 and answers[0].split("|")[2] == answers[1].split("|")[2]  # the same chat answer
    assert tree_digest(source) == before  # the source is never modified

    index = json.loads((out / "model.safetensors.index.json").read_text())
    dar_shard = {file for name, file in index["weight_map"].items() if "_residual." in name or "final_readout" in name}
    assert dar_shard == {"model-00002-of-00002.safetensors"}  # DAR's new parameters: a shard of their own
    assert set(load_file(out / "model-00002-of-00002.safetensors")) == dar_parameter_names_of(out)

    reloaded = AutoModelForCausalLM.from_pretrained(out).eval()
    assert isinstance(reloaded, DARForCausalLM)
    ids = torch.randint(0, VOCAB, (2, 20), generator=torch.Generator().manual_seed(1))
    source_model = LlamaForCausalLM.from_pretrained(source).eval()
    in_memory = upcycle_model(source_model, dar_block_size=2)  # the in-memory conversion: the same tensors, bit for bit
    assert_same_state(reloaded, in_memory)
    assert torch.equal(logits(reloaded, ids), logits(in_memory, ids))
    assert (logits(reloaded, ids) - logits(source_model, ids)).abs().max() <= 1e-5


@pytest.mark.slow  # test_remote_code.py (converted_dar) loads a converted folder through every Auto class
def test_converted_folder_loads_with_remote_code_where_the_package_is_not_importable(converted_llama, tmp_path):
    root, _, _, result = converted_llama
    model = AutoModelForCausalLM.from_pretrained(root / "out").eval()
    ids = torch.randint(0, VOCAB, (2, 20), generator=torch.Generator().manual_seed(2))
    torch.save(ids, tmp_path / "ids.pt")
    script = textwrap.dedent(
        f"""
        import importlib.util, os, sys
        sys.path[:] = [p for p in sys.path if os.path.realpath(p) != {str(REPO / "src")!r} and p not in ("", ".")]
        assert importlib.util.find_spec("dar_transformers") is None, "the package must not be importable here"
        import torch
        from transformers import AutoModelForCausalLM
        model = AutoModelForCausalLM.from_pretrained({str(root / "out")!r}, trust_remote_code=True).eval()
        assert type(model).__module__.startswith("transformers_modules"), type(model).__module__
        assert "dar_transformers" not in sys.modules
        with torch.no_grad():
            torch.save(model(torch.load({str(tmp_path / "ids.pt")!r})).logits, {str(tmp_path / "logits.pt")!r})
        """
    )
    env = {"PATH": os.environ.get("PATH", ""), "HOME": str(tmp_path), "HF_HOME": str(tmp_path / "hf"),
           "HF_HUB_OFFLINE": "1", "OMP_NUM_THREADS": str(torch.get_num_threads())}
    completed = subprocess.run([sys.executable, "-I", "-c", script], cwd=tmp_path, env=env, capture_output=True, text=True)
    assert completed.returncode == 0, completed.stderr[-3000:]
    remote_logits = torch.load(tmp_path / "logits.pt")
    assert torch.equal(remote_logits, logits(model, ids))


def test_untied_sharded_llama_folder_converts_to_a_sharded_exact_repo(tmp_path):
    source = save_source(tmp_path / "source", tied=False, shard="40KB")
    assert (source / "model.safetensors.index.json").is_file()
    result = upcycle(source, tmp_path / "out", dar_block_size=3, tolerance=1e-5, max_shard_size="40KB", **FAST)
    assert result.report.max_abs_logit_difference <= 1e-5 and result.report.greedy_identical
    out = tmp_path / "out"
    assert (out / "model.safetensors.index.json").is_file() and len(list(out.glob("model-*.safetensors"))) > 1
    reloaded = AutoModelForCausalLM.from_pretrained(out).eval()
    assert not reloaded.config.tie_word_embeddings
    assert not torch.equal(reloaded.lm_head.weight, reloaded.model.embed_tokens.weight)
    ids = torch.randint(0, VOCAB, (1, 24), generator=torch.Generator().manual_seed(3))
    source_model = LlamaForCausalLM.from_pretrained(source).eval()
    assert (logits(reloaded, ids) - logits(source_model, ids)).abs().max() <= 1e-5


def test_gguf_file_converts_exactly_with_its_tokenizer_and_chat_template(tmp_path):
    source_model, tokenizer = make_source("llama", tied=True), make_tokenizer()
    (tmp_path / "gguf").mkdir()
    gguf_path = write_tiny_gguf(tmp_path / "gguf" / "tiny.gguf", source_model, tokenizer)
    before = tree_digest(tmp_path / "gguf")
    result = upcycle(gguf_path, tmp_path / "out", dar_block_size=2, tolerance=1e-5, **FAST)
    assert result.report.passed and result.report.checks[-1].name.startswith("chat:")
    out = tmp_path / "out"
    config = json.loads((out / "config.json").read_text())
    assert "quantization_config" not in config and config["tie_word_embeddings"] is True
    reloaded = AutoModelForCausalLM.from_pretrained(out).eval()
    ids = torch.randint(0, VOCAB, (2, 40), generator=torch.Generator().manual_seed(4))
    assert (logits(reloaded, ids) - logits(source_model, ids)).abs().max() <= 1e-5  # against the HF original
    written = AutoTokenizer.from_pretrained(out)
    text = "The capital of France is Paris. Hello"
    assert written(text)["input_ids"] == tokenizer(text)["input_ids"]
    assert written.chat_template == tokenizer.chat_template
    assert tree_digest(tmp_path / "gguf") == before


def test_an_f16_gguf_is_not_said_to_be_rounded_where_float16_holds_it(tmp_path, caplog):
    """A GGUF of F16 matrices and F32 norms (llama.cpp's --outtype f16) converted with --dtype float16: every tensor is
    read as float32, so the warning and the card said all of them were rounded to float16, though the matrices are
    written bit for bit; only the norms are rounded, and only they are named."""
    import numpy as np

    source_model, tokenizer = make_source("llama", tied=True), make_tokenizer()
    (tmp_path / "gguf").mkdir()
    gguf_path = write_tiny_gguf(tmp_path / "gguf" / "tiny.gguf", source_model, tokenizer, matrices_dtype=np.float16)
    upcycle(gguf_path, tmp_path / "out", dtype="float16", tolerance=1e-2, **FAST)
    norms = [name for name, _ in source_model.named_parameters() if name.endswith("norm.weight")]
    assert f"--dtype float16 may round {len(norms)} source tensor(s) stored in float32 (model.layers.0.input_layernorm" \
        in caplog.text
    written = load_file(tmp_path / "out" / "model-00001-of-00002.safetensors")
    embedding = source_model.model.embed_tokens.weight.detach().half()
    assert torch.equal(written["model.embed_tokens.weight"], embedding)  # F16 values, written as they are


def test_a_quantised_gguf_tensor_is_said_stored_as_its_type_not_in_float32(tmp_path, caplog):
    """A Q8_0 GGUF (quantised matrices, F32 norms) converted with --dtype bfloat16: the warning, the report and the
    card said every rounded tensor was "stored in float32", which is how it is read, not how the file stores it."""
    import gguf

    (tmp_path / "gguf").mkdir()
    gguf_path = write_tiny_gguf(tmp_path / "gguf" / "tiny.gguf", make_source("llama", tied=True), make_tokenizer(),
                                matrices_type=gguf.GGMLQuantizationType.Q8_0)
    report = upcycle(gguf_path, tmp_path / "out", dtype="bfloat16", tolerance=1.0, **FAST).report
    said = "source tensor(s) stored in float32 or as Q8_0, dequantised to float32 ("
    assert "--dtype bfloat16 may round" in caplog.text and said in caplog.text
    assert said in report.rounding and said in (tmp_path / "out" / "README.md").read_text()
    assert "stored in float32 (" not in caplog.text + report.rounding


def test_the_report_says_which_weights_the_storage_dtype_rounded_and_whether_the_check_saw_it(tmp_path):
    """A float64 source stored in float32: both models are computed in float32 from the same rounded weights, so the
    check PASSED with the difference of an unrounded conversion, and only a warning said the values "may" be rounded.
    The report (printed, and in the card) says they were, and that the check does not see it; a float64 check does."""
    source, model = tmp_path / "source", make_source("llama").double()
    with torch.no_grad():
        for parameter in model.parameters():
            parameter.mul_(1 + 1e-10)  # values float32 does not hold
    model.save_pretrained(source)
    make_tokenizer().save_pretrained(source)
    report = upcycle(source, tmp_path / "out", dtype="float32", **FAST).report
    assert report.passed
    blind = "the check computes both models in float32 from those rounded weights, so the difference above does " \
            "not include that rounding (--verify-dtype float64 measures it)."
    assert report.rounding.startswith("The output stores the weights in float32, which rounds ")
    assert report.rounding.endswith(blind) and blind in report.table()
    card = (tmp_path / "out" / "README.md").read_text()
    assert blind in card
    # The card's claim about the function says the same: the check did not bound the distance from the source as
    # stored (it claimed it did, a few lines above the report that says otherwise).
    bounds = "the check bounds its distance from the source as stored by its tolerance"
    assert bounds not in card
    assert "the check computed both models in float32 from those rounded weights, so it does not measure that " \
           "distance (a check with --verify-dtype float64 does)." in card
    seen = upcycle(source, tmp_path / "seen", dtype="float32", verify_dtype="float64", tolerance=1.0, **FAST).report
    assert seen.rounding.endswith("; the difference above includes that rounding.")
    unverified = (tmp_path / "seen" / "README.md").read_text()  # a bar of 1.0 compares no next token: no bound
    assert "which this conversion did NOT verify" in unverified and bounds not in unverified
    upcycle(source, tmp_path / "bounded", dtype="float32", verify_dtype="float64", tolerance=1e-4, **FAST)
    assert bounds in (tmp_path / "bounded" / "README.md").read_text()
    assert not upcycle(save_source(tmp_path / "f32"), tmp_path / "exact", dtype="float32", **FAST).report.rounding


def test_a_gguf_files_end_of_turn_token_ends_generation_in_the_written_folder(tmp_path):
    """llama.cpp stops at `tokenizer.ggml.eot_token_id` / `eom_token_id` as at the end-of-sequence token; transformers'
    GGUF reader keeps only the last, so a converted chat model decoded past the end of its turn."""
    from dar_transformers.conversion.sources import load_source

    source_model, tokenizer = make_source("llama", tied=True), make_tokenizer()
    (tmp_path / "gguf").mkdir()
    metadata = {"tokenizer.ggml.eot_token_id": 4, "tokenizer.ggml.eom_token_id": 2}  # <|im_end|>; eom = eos
    gguf_path = write_tiny_gguf(tmp_path / "gguf" / "tiny.gguf", source_model, tokenizer, extra_metadata=metadata)
    plain_path = write_tiny_gguf(tmp_path / "gguf" / "plain.gguf", source_model, tokenizer)
    for path, ends in ((gguf_path, [2, 4]), (plain_path, 2)):
        out = tmp_path / f"out-{path.stem}"
        assert upcycle(path, out, dar_block_size=2, tolerance=1e-5, **FAST).report.passed
        assert json.loads((out / "generation_config.json").read_text())["eos_token_id"] == ends
        assert AutoModelForCausalLM.from_pretrained(out).generation_config.eos_token_id == ends
        assert load_source(path, torch.float32).model.generation_config.eos_token_id == ends  # chat / fine-tune
    far = write_tiny_gguf(tmp_path / "gguf" / "far.gguf", source_model, tokenizer,
                          extra_metadata={"tokenizer.ggml.eot_token_id": 10**6})  # no such token: not added
    assert load_source(far, torch.float32).model.generation_config.eos_token_id == 2


@pytest.mark.parametrize("eos,fields,expected", [
    (None, {"tokenizer.ggml.eot_token_id": 5}, 5),  # no end-of-sequence token: the end of turn alone
    (2, {"tokenizer.ggml.eot_token_id": 5, "tokenizer.ggml.eom_token_id": 6}, [2, 5, 6]),
    ([2, 5], {"tokenizer.ggml.eot_token_id": 5}, [2, 5]),  # already there
    (2, {"tokenizer.ggml.eot_token_id": 300}, 2),  # past the vocabulary: no such token
])
def test_the_gguf_end_tokens_join_the_generation_configs(eos, fields, expected):
    from transformers import GenerationConfig

    from dar_transformers.conversion.sources import with_gguf_end_tokens

    class Field:
        def __init__(self, value):
            self.value = value

        def contents(self):
            return self.value

    config = with_gguf_end_tokens(GenerationConfig(eos_token_id=eos), 256,
                                  {key: Field(value) for key, value in fields.items()})
    assert config.eos_token_id == expected


@pytest.mark.parametrize("family", ["mistral", "qwen2", "qwen3"])
@pytest.mark.parametrize("tied", [True, False])
def test_family_converts_exactly_with_its_own_branch_modules(family, tied):
    source = make_source(family, tied).train()  # a model in training mode is copied, not switched to eval
    before = {name: tensor.clone() for name, tensor in source.state_dict().items()}
    result = upcycle(source, dar_block_size=2, tolerance=1e-5, max_new_tokens=12, progress=False)
    report = result.report
    assert report.max_abs_logit_difference <= 1e-5, report.table()
    assert report.greedy_identical and max(check.max_abs_logit for check in report.checks) > 2
    dar = result.model
    source_attention = type(source.model.layers[0].self_attn)
    assert type(dar.model.layers[0].self_attn) is source_attention and dar.config.dar_branch_family == family
    family_keys = {"qwen2": "self_attn.q_proj.bias", "qwen3": "self_attn.q_norm.weight"}
    if family in family_keys:  # the family's own parameters arrived
        key = f"model.layers.1.{family_keys[family]}"
        assert torch.equal(dar.state_dict()[key], source.state_dict()[key])
    if family == "mistral":
        assert dar.config.sliding_window == 5  # prompts are 64 tokens: the window matters and is kept
    assert all(torch.equal(before[name], tensor) for name, tensor in source.state_dict().items())
    assert source.training


@pytest.mark.parametrize("family", ["mistral", "qwen2", "qwen3", "llama"])
def test_heads_that_do_not_divide_the_hidden_size_convert_where_the_family_builds_them(tmp_path, family):
    """3 heads of 16 at hidden size 32: transformers builds Mistral, Qwen2 and Qwen3 models of such configs (their
    attention takes `head_dim`), but DARConfig inherited LlamaConfig's rule that the hidden size be a multiple of
    the heads, so their conversion was refused blaming the source's config (a helper's repro). Llama keeps its rule."""
    from conftest import FAMILIES, SHAPE

    config_class, model_class, extra = FAMILIES[family]
    fields = {**SHAPE, **extra, "num_attention_heads": 3, "num_key_value_heads": 1, "head_dim": 16}
    if family == "llama":  # transformers' StrictDataclassClassValidationError, for LlamaConfig and DARConfig alike
        from dar_transformers import DARConfig

        for config in (config_class, DARConfig):
            with pytest.raises(Exception, match=r"not a multiple of the number of attention heads"):
                config(**fields, vocab_size=VOCAB)
        return
    torch.manual_seed(0)
    source = model_class(config_class(**fields, vocab_size=VOCAB, bos_token_id=1, eos_token_id=2)).eval()
    result = upcycle(source, tmp_path / "out", tokenizer=make_tokenizer(), dar_block_size=2, tolerance=1e-5,
                     max_new_tokens=4, progress=False)
    assert result.report.passed and result.report.greedy_identical
    reloaded = AutoModelForCausalLM.from_pretrained(tmp_path / "out").eval()
    assert reloaded.config.num_attention_heads == 3 and reloaded.config.head_dim == 16
    torch.testing.assert_close(logits(reloaded, IDS), logits(source, IDS), rtol=0, atol=1e-5)


def test_float64_conversion_meets_the_1e_8_default_and_leaves_the_source_in_float32():
    source = make_source("llama", tied=False)
    result = upcycle(source, dtype="float64", dar_block_size=1, max_new_tokens=12, progress=False)
    assert result.model.dtype == torch.float64 and source.dtype == torch.float32
    assert result.report.tolerance == 1e-8 and result.report.max_abs_logit_difference <= 1e-8
    assert result.report.greedy_identical


def test_convert_returns_a_dar_model_with_the_keyword_fields():
    dar = convert(make_source(), dar_block_size=1, dar_routing="crossv", dar_gate_delta=0.5, tolerance=1e-5,
                  max_new_tokens=4, progress=False)
    assert isinstance(dar, DARForCausalLM)
    assert (dar.config.dar_block_size, dar.config.dar_routing, dar.config.dar_gate_delta) == (1, "crossv", 0.5)


@pytest.mark.parametrize("family, tied", [("llama", False), ("mistral", True), ("qwen2", False), ("qwen3", True)])
def test_streamed_conversion_equals_the_in_memory_one_and_the_source(tmp_path, family, tied):
    source = save_source(tmp_path / "source", family=family, tied=tied, shard="30KB")
    result = upcycle(source, tmp_path / "out", dar_block_size=2, tolerance=1e-5, max_shard_size="30KB", **FAST)
    report = result.report
    assert report.passed and report.method == "layer-streamed" and report.greedy_ran
    assert report.max_abs_logit_difference <= 1e-5 and max(c.max_abs_logit for c in report.checks) > 2
    assert all(check.top1_checked > 0 and check.top1_agreed == check.top1_checked for check in report.checks)
    source_model = AutoModelForCausalLM.from_pretrained(source).eval()
    assert_equals_in_memory(tmp_path / "out", upcycle_model(source_model, dar_block_size=2))
    reloaded = AutoModelForCausalLM.from_pretrained(tmp_path / "out").eval()
    assert max_logit_difference(reloaded, source_model, IDS) <= 1e-5


def test_float64_streamed_conversion_meets_1e_8(tmp_path):
    source = save_source(tmp_path / "source", family="qwen3", tied=False)
    result = upcycle(source, tmp_path / "out", dtype="float64", dar_block_size=1, **FAST)
    assert result.report.dtype == "float64" and result.report.tolerance == 1e-8
    assert result.report.max_abs_logit_difference <= 1e-8 and result.report.passed
    reloaded = AutoModelForCausalLM.from_pretrained(tmp_path / "out", dtype="auto").eval()
    assert reloaded.dtype == torch.float64
    source_model = AutoModelForCausalLM.from_pretrained(source, dtype=torch.float64).eval()
    with norms_in_input_dtype(reloaded, source_model):
        assert max_logit_difference(reloaded, source_model, IDS) <= 1e-8


def save_bf16_source(folder: Path, family: str = "llama") -> Path:
    model = make_source(family, tied=False).to(torch.bfloat16)
    model.save_pretrained(folder)
    make_tokenizer().save_pretrained(folder)
    return folder


def test_a_bf16_source_verifies_at_the_float32_bar_and_stays_bf16(tmp_path):
    source = save_bf16_source(tmp_path / "source")
    result = upcycle(source, tmp_path / "out", dar_block_size=2, **FAST)  # dtype "auto", no tolerance
    report = result.report
    assert report.passed and not report.relaxed and report.tolerance == 2e-4 and report.dtype == "float32"
    assert report.storage_dtype == "bfloat16" and "from bfloat16 weights" in report.table()
    assert report.max_abs_logit_difference <= 2e-4
    assert json.loads((tmp_path / "out" / "config.json").read_text())["dtype"] == "bfloat16"
    source_bytes = sum(p.stat().st_size for p in source.glob("*.safetensors"))
    written_bytes = sum(p.stat().st_size for p in (tmp_path / "out").glob("*.safetensors"))
    assert written_bytes < 1.2 * source_bytes  # bf16 stays bf16 (plus the small float32 DAR shard)
    reloaded = AutoModelForCausalLM.from_pretrained(tmp_path / "out", dtype="auto")
    assert reloaded.model.embed_tokens.weight.dtype == torch.bfloat16
    assert reloaded.model.layers[0].attn_residual.write_gate.logit.dtype == torch.float32


OFFLOADED_HEAD = {"model.embed_tokens": "cpu", "model.layers": "cpu", "model.final_readout": "cpu", "model.norm": "disk",
                  "model.rotary_emb": "cpu", "lm_head": "disk"}


OFFLOADED_LAYERS = {**OFFLOADED_HEAD, "model.layers": "disk"}


@pytest.mark.parametrize("device_map,implementation", [
    ("auto", "fast"),  # max_memory fits everything here: a plain CPU placement through accelerate
    (OFFLOADED_HEAD, "fast"),
    # Whole decoder layers on disk: accelerate loads a module's weights only around its own forward; the fast
    # backend derives gates and queries outside those forwards and onloads them itself (`_onloaded`).
    (OFFLOADED_LAYERS, "fast"),
    (OFFLOADED_LAYERS, "two_phase"),
    (OFFLOADED_LAYERS, "reference"),
])
def test_offloaded_loading_generates_the_tokens_of_a_plain_load(tmp_path, device_map, implementation):
    source = save_source(tmp_path / "source", tied=False)
    upcycle(source, tmp_path / "out", dar_block_size=2, tolerance=1e-5, **FAST)
    plain = AutoModelForCausalLM.from_pretrained(tmp_path / "out").eval()
    offloaded = AutoModelForCausalLM.from_pretrained(
        tmp_path / "out", dar_implementation=implementation, device_map=device_map, max_memory={"cpu": "10MB"},
        offload_folder=tmp_path / "offload",
    ).eval()
    if device_map != "auto":
        assert "disk" in set(offloaded.hf_device_map.values())  # part of the model really lives on disk
    ids = IDS[:1, :10]
    kwargs = dict(max_new_tokens=8, do_sample=False, attention_mask=torch.ones_like(ids))
    assert torch.equal(plain.generate(ids, **kwargs), offloaded.generate(ids, **kwargs))


def test_no_absolute_path_of_the_converting_machine_reaches_the_written_folder(tmp_path):
    source = save_source(tmp_path / "source")
    (tmp_path / "gguf").mkdir()
    gguf = write_tiny_gguf(tmp_path / "gguf" / "tiny.gguf", make_source("llama"), make_tokenizer())
    for name, origin in (("from-folder", source), ("from-gguf", gguf)):
        upcycle(origin, tmp_path / name, dar_block_size=2, tolerance=1e-5, **FAST)
        for path in (tmp_path / name).iterdir():
            if path.suffix in (".json", ".md", ".jinja", ".py"):
                text = path.read_text()
                assert str(tmp_path) not in text and str(Path.home()) + "/" not in text, path.name
        card = (tmp_path / name / "README.md").read_text()
        assert (origin.name if origin.is_dir() else origin.name) in card


def near_tie_source(folder: Path) -> Path:
    """A Llama source whose output rows of tokens 5 and 7 are equal to 1e-6 and dominant: free greedy decoding meets
    ties that the float32 rounding of two summation orders breaks differently."""
    model = make_source("llama", tied=False)
    with torch.no_grad():
        head = model.lm_head.weight
        head[5] *= 2.5
        head[7] = head[5] + 1e-6 * torch.randn(head.shape[1], generator=torch.Generator().manual_seed(0))
    model.save_pretrained(folder)
    make_tokenizer().save_pretrained(folder)
    return folder


def test_continuations_that_first_differ_at_a_near_tie_pass_and_the_table_says_where(tmp_path):
    """An exact conversion (logits 5e-6 apart) whose greedy continuation of a prompt first differs at a token the
    source does not decide at the bar (top-1/top-2 margin within 2 x tolerance: the teacher-forced check's own rule)
    passes, and the table names the token, the margin and the logit difference there; it was refused as FAILED.
    Negative control: the same report at a 1000 times smaller tolerance, where that margin decides the token, fails."""
    result = upcycle(near_tie_source(tmp_path / "source"), tmp_path / "out", progress=False)
    report = result.report
    ties = [check for check in report.checks if check.greedy_identical is False]
    assert report.passed and report.verified and ties, report.table()
    for check in ties:
        index, margin, difference = check.greedy_divergence
        assert check.source_continuation[:index] == check.target_continuation[:index]
        assert check.source_continuation[index] != check.target_continuation[index]
        assert margin <= 2 * report.tolerance and difference <= report.tolerance
        assert f"tie: first differs at new token {index + 1}" in report.table()
    report.tolerance = margin / 1000
    assert not report.passed and "NO: first differs" in report.table()


def test_convert_of_a_path_without_verification_says_what_to_do_instead(tmp_path):
    """`convert(path, verify=False)` was refused with "verify=False cannot write an output folder", though the caller
    asked for no folder (the one it meant was convert's hidden temporary one). The refusal now says why a path source
    is verified and that an in-memory model converts without it, which it does."""
    from conftest import save_source

    source = save_source(tmp_path / "source")
    with pytest.raises(ValueError, match=r"convert\(path, verify=False\): .*convert\(model, verify=False\)"):
        convert(source, verify=False)
    with pytest.raises(ValueError, match=r"verify=False cannot write an output folder"):  # a folder asked for
        upcycle(source, tmp_path / "out", verify=False)
    assert sorted(path.name for path in tmp_path.iterdir()) == ["source"]
    model = convert(AutoModelForCausalLM.from_pretrained(source), verify=False)
    assert isinstance(model, DARForCausalLM)


def test_a_conversion_without_output_leaves_nothing_in_the_temporary_folder(tmp_path, monkeypatch):
    """`convert(path)` and `upcycle(path)` (no output) write into `$TMPDIR`. A run killed there (SIGKILL, the
    out-of-memory killer) left an unmarked `dar-convert-*` folder, a model's size, that nothing removed; and the model
    `convert` returned stayed mapped onto the shards of the folder it had just removed (disk space no listing shows,
    until the model goes). The folder is marked now, so the next run without output removes it, and the model is read
    into memory."""
    import tempfile

    source = save_source(tmp_path / "source")
    scratch = tmp_path / "tmp"
    scratch.mkdir()
    killed = subprocess.run([sys.executable, "-c", textwrap.dedent(f"""
        import os, signal, tempfile
        from dar_transformers.conversion import api
        tempfile.tempdir = {str(scratch)!r}
        def killed(*arguments, **keywords):
            os.kill(os.getpid(), signal.SIGKILL)
        api.verify_written = killed  # killed once the folder is written
        api.upcycle({str(source)!r}, max_new_tokens=1, progress=False)
    """)], capture_output=True, text=True, timeout=300, env={**os.environ, "OMP_NUM_THREADS": "1"})
    assert killed.returncode == -9, killed.stderr
    (left,) = scratch.iterdir()
    assert left.name.startswith(".dar-convert.") and left.name.endswith(".partial"), left.name
    assert list(left.rglob("*.safetensors")), list(left.rglob("*"))  # a model's size

    monkeypatch.setattr(tempfile, "tempdir", str(scratch))
    model = convert(source, tolerance=1e-5, **FAST)
    assert list(scratch.iterdir()) == []  # the killed run's folder and this run's own are gone
    assert isinstance(model, DARForCausalLM)
    with open("/proc/self/maps") as maps:
        assert not [line for line in maps if str(scratch) in line], "the returned model maps removed files"
    torch.testing.assert_close(logits(model, IDS), logits(AutoModelForCausalLM.from_pretrained(source), IDS),
                               atol=1e-5, rtol=0)
