# SPDX-License-Identifier: Apache-2.0
"""`dar convert` on valid sources with quirks the verification prompts do not reach: config keys the source family
ignores, weights outside the storage dtype's range, decoding settings in generation_config.json, length-dependent
rope. A tiny Llama source with a tokenizer (`save_source`), edited on disk, converted through the CLI's `main`.

Each quirk either converts to a model that reproduces the source through `from_pretrained`, or is refused in one line
naming the tensor or field; never a PASSED over a different function, never a FAILED over an exact one.
"""

import filecmp
import json
import re
import shlex

import pytest
import torch
from safetensors.torch import load_file, save_file
from transformers import AutoModelForCausalLM, AutoTokenizer, DynamicCache, GenerationConfig

from dar_transformers.cli import main as cli_main
from dar_transformers.conversion import upcycle
from dar_transformers.conversion.verify import GENERATE_CACHE_KEYWORD

from conftest import (
    VOCAB, assert_refused_in_one_line, edit_json, logits, make_source, make_tokenizer, run_convert_in_process,
    save_source,
)



def random_tokens(length: int, seed: int = 0) -> torch.LongTensor:
    return torch.randint(3, VOCAB, (1, length), generator=torch.Generator().manual_seed(seed))


@pytest.mark.parametrize("fields, named, decodes", [
    ({"sliding_window": 8}, "sliding_window=8", True),
    ({"attention_chunk_size": 8}, "attention_chunk_size=8", True),  # a chunked cache layer
    ({"layer_types": ["full_attention", "sliding_attention", "full_attention"]},  # no window: generate fails
     "layer_types=['full_attention', 'sliding_attention', 'full_attention']", False),
], ids=["sliding_window", "attention_chunk_size", "layer_types"])
def test_a_stray_cache_window_in_a_llama_config_is_not_carried(tmp_path, caplog, fields, named, decodes):
    """A Llama config.json holding `sliding_window`, `attention_chunk_size` or `layer_types` (Llama-ified Mistral
    fine-tunes, merged configs): Llama's attention ignores them, DAR would build a sliding mask from the window (8,
    shorter than the prompts: carrying it fails the check). transformers' generation cache does read them, so the
    source's own `generate` is not its forward past the window (shown below), or fails (sliding layer types without a
    window). Dropped with one warning naming the field; the check decodes the source with a full cache and passes with
    greedy decoding on (it failed as "does not reproduce the source", or in a traceback, before)."""
    source = save_source(tmp_path / "source")
    edit_json(source / "config.json", **fields)
    code, stderr = run_convert_in_process(source, tmp_path / "out", "--max-new-tokens", "24", cwd=tmp_path)
    assert code == 0, stderr[-3000:]
    assert caplog.text.count(f"{named} is not carried") == 1  # was twice: the target config is built twice
    assert "never reads them" not in caplog.text  # not the undefined-fields warning: the cache reads them
    written = json.loads((tmp_path / "out" / "config.json").read_text())
    assert not set(fields) & {name for name, value in written.items() if value is not None}
    ids = random_tokens(64)
    source_model = AutoModelForCausalLM.from_pretrained(source).eval()
    for output in (None, tmp_path / "in-memory"):  # an in-memory source: `upcycle_model`, or a written folder
        caplog.clear()
        upcycle(source_model, output, tokenizer=make_tokenizer(), max_new_tokens=0, progress=False)
        assert caplog.text.count(f"{named} is not carried") == 1
    dar = AutoModelForCausalLM.from_pretrained(tmp_path / "out").eval()
    with torch.no_grad():  # no cache: the source's, built from its layer types, fails without a window
        torch.testing.assert_close(dar(ids).logits, source_model(ids, use_cache=False).logits, atol=1e-5, rtol=0)
    greedy = {"max_new_tokens": 24, "do_sample": False}
    with torch.no_grad():
        full = source_model.generate(ids[:, :16], **{GENERATE_CACHE_KEYWORD: DynamicCache()}, **greedy)
        assert torch.equal(dar.generate(ids[:, :16], **greedy), full)
        if decodes:  # the quirk is real: the cached decoding departs from the forward
            assert not torch.equal(source_model.generate(ids[:, :16], **greedy), full)


def test_a_weight_outside_float16s_range_is_refused_naming_the_tensor_not_written_as_inf(tmp_path):
    """An untied float32 source with one embedding value (1e5) beyond float16's 65504, in a row no verification
    prompt uses (token 317): `--dtype float16` cast it to inf, which the source's NaN/inf check (run before the cast)
    and the verification (which reads the prompts' rows only) both missed, and the run said PASSED."""
    model = make_source(tied=False)
    with torch.no_grad():
        model.model.embed_tokens.weight[317, 0] = 1e5
    model.save_pretrained(tmp_path / "source")
    make_tokenizer().save_pretrained(tmp_path / "source")
    code, stderr = run_convert_in_process(tmp_path / "source", tmp_path / "out", "--dtype", "float16", "--tolerance",
                                          "1e-2", "--max-new-tokens", "2", cwd=tmp_path)
    assert_refused_in_one_line(code, stderr, r"'model\.embed_tokens\.weight' \(row 317\) holds the value 1e\+05, "
                               r"outside the range of float16", r"bfloat16 or float32 \(--dtype\)")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["source"]  # nothing written, nothing staged


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_a_float64_value_beyond_float32s_range_is_refused_suggesting_float64(tmp_path, dtype):
    """A float64 source holding 1e39 (past float32's and bfloat16's 3.4e38) converted with --dtype float32 or
    bfloat16: refused, but the message suggested "convert to bfloat16 or float32", the very dtypes that overflow."""
    model = make_source(tied=False).double()
    with torch.no_grad():
        model.model.layers[1].mlp.up_proj.weight[3, 5] = 1e39
    model.save_pretrained(tmp_path / "source")
    make_tokenizer().save_pretrained(tmp_path / "source")
    code, stderr = run_convert_in_process(tmp_path / "source", tmp_path / "out", "--dtype", dtype, cwd=tmp_path)
    assert_refused_in_one_line(code, stderr, rf"'model\.layers\.1\.mlp\.up_proj\.weight' \(row 3\) holds the value "
                               rf"1e\+39, outside the range of {dtype} \(it would be written as inf\); convert to "
                               r"float64 \(--dtype\)\.$")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["source"]


def test_a_repetition_penalty_in_generation_config_applies_to_both_sides_of_the_greedy_check(tmp_path, capsys):
    """generation_config.json with `repetition_penalty` (common in chat models): the written folder carries the file
    and `from_pretrained(folder)` decodes with it, while the source side of the greedy check was built from its
    config alone, without it. An exact conversion was refused ("greedy continuation identical: NO" on every prompt);
    `from_pretrained(source)` loads the file, so both sides decode alike."""
    source = save_source(tmp_path / "source")
    GenerationConfig(bos_token_id=1, eos_token_id=2, repetition_penalty=1.3).save_pretrained(source)
    code = cli_main(["convert", str(source), str(tmp_path / "out"), "--max-new-tokens", "8"])
    captured = capsys.readouterr()
    assert code == 0, captured.err[-3000:]
    rows = [line for line in captured.out.splitlines() if line.startswith("| ") and "tokens)" in line]
    assert rows and all(row.endswith("| yes (8 tokens) |") for row in rows), rows


def test_generation_settings_kept_in_config_json_travel_as_from_pretrained_reads_them(tmp_path, capsys):
    """A folder without generation_config.json whose config.json holds generation settings (saved before that file
    existed, or edited by hand): `from_pretrained` builds the generation config from config.json's own fields, but the
    converter built it from the config object, which drops them. The output decoded without the repetition penalty
    and n-gram block (other tokens than the source's `generate`), and the greedy check, built the same way on both
    sides, said "yes". The output now carries them, and both sides of the check decode with them."""
    source = save_source(tmp_path / "source")
    (source / "generation_config.json").unlink(missing_ok=True)
    settings = {"repetition_penalty": 1.5, "no_repeat_ngram_size": 2, "max_length": 60}
    edit_json(source / "config.json", **settings)
    code = cli_main(["convert", str(source), str(tmp_path / "out"), "--max-new-tokens", "8"])
    captured = capsys.readouterr()
    assert code == 0, captured.err[-3000:]
    rows = [line for line in captured.out.splitlines() if line.startswith("| ") and "tokens)" in line]
    assert rows and all(row.endswith("| yes (8 tokens) |") for row in rows), rows
    written = json.loads((tmp_path / "out" / "generation_config.json").read_text())
    assert written.items() >= settings.items()
    loaded = [AutoModelForCausalLM.from_pretrained(folder).generation_config.to_diff_dict()
              for folder in (source, tmp_path / "out")]
    assert loaded[0] == loaded[1] and loaded[0].items() >= settings.items()

@pytest.mark.parametrize("fields", [
    {"stop_strings": ["<|im_end|>"]},
    {"num_beams": 2},
    {"num_return_sequences": 2, "do_sample": True},
    {"max_time": 1e-9, "return_dict_in_generate": True},
    {"exponential_decay_length_penalty": [2, 1.5]},  # was a RuntimeError traceback ("infer dtype of NoneType")
], ids=["stop_strings", "num_beams", "num_return_sequences", "max_time", "exponential_decay_length_penalty"])
def test_a_search_setting_in_generation_config_leaves_the_greedy_check_plain_greedy(tmp_path, capsys, fields):
    """Valid generation_config.json settings that are not plain greedy search: the greedy check copied them, and
    generate() raised about arguments the user never passed (stop strings without a tokenizer, beam search with a
    streamer, two sequences without sampling, an EOS length penalty without the EOS the check unsets), exit code 1
    for an exact conversion. The check runs plain greedy
    search on both sides whatever the file says (max_time would stop them at different lengths)."""
    source = save_source(tmp_path / "source")
    (source / "generation_config.json").write_text(json.dumps({"bos_token_id": 1, "eos_token_id": 2, **fields}))
    code = cli_main(["convert", str(source), str(tmp_path / "out"), "--max-new-tokens", "4"])
    captured = capsys.readouterr()
    assert code == 0, captured.err[-3000:]
    assert re.search(r"^PASSED: ", captured.out, flags=re.M)
    rows = [line for line in captured.out.splitlines() if line.startswith("| ") and "tokens)" in line]
    assert rows and all(row.endswith("| yes (4 tokens) |") for row in rows), rows
    assert json.loads((tmp_path / "out" / "generation_config.json").read_text()).items() >= fields.items()


def test_an_architectures_field_that_is_not_a_list_converts(tmp_path):
    """config.json with `"architectures": "LlamaForCausalLM"` or a number (hand-edited configs), which transformers
    loads: the family check joined it as a list of names for its message, and refused the source with "can only join
    an iterable" (a number) before any check. The field is only named in messages; the conversion runs."""
    source = save_source(tmp_path / "source")
    edit_json(source / "config.json", architectures=5)
    code, stderr = run_convert_in_process(source, tmp_path / "out", "--max-new-tokens", "0", cwd=tmp_path)
    assert code == 0, stderr[-3000:]
    ids = random_tokens(32)
    torch.testing.assert_close(logits(AutoModelForCausalLM.from_pretrained(tmp_path / "out").eval(), ids),
                               logits(AutoModelForCausalLM.from_pretrained(source).eval(), ids), atol=1e-5, rtol=0)


@pytest.mark.parametrize("family, tied", [("llama", True), ("qwen2", True), ("llama", False)])
def test_a_base_models_weights_convert_as_transformers_loads_them(tmp_path, family, tied):
    """A folder saved from the base model (`LlamaModel.save_pretrained`: `embed_tokens.weight`, `layers.0. ...`,
    architectures ["LlamaModel"]; untied, `lm_head.weight` beside them), which `AutoModelForCausalLM.from_pretrained`
    loads with nothing missing or unexpected by putting `model.` before each name: refused as "parameters that DAR
    has no place for". Its tensors are read under the names transformers gives them; the output computes the causal
    LM transformers loads, to float32 rounding."""
    causal = make_source(family, tied)
    source = tmp_path / "source"
    causal.model.save_pretrained(source)
    make_tokenizer().save_pretrained(source)
    if not tied:  # the head beside the base model's weights, at the top level, as transformers names it
        weights = load_file(source / "model.safetensors")
        save_file({**weights, "lm_head.weight": causal.lm_head.weight.detach().contiguous()},
                  source / "model.safetensors", metadata={"format": "pt"})
        edit_json(source / "config.json", tie_word_embeddings=False)
    loaded, info = AutoModelForCausalLM.from_pretrained(source, output_loading_info=True)
    assert not any(info.values())  # transformers reads the whole causal LM from it
    code, stderr = run_convert_in_process(source, tmp_path / "out", "--max-new-tokens", "4", cwd=tmp_path)
    assert code == 0, stderr[-3000:]
    ids = random_tokens(32)
    torch.testing.assert_close(logits(AutoModelForCausalLM.from_pretrained(tmp_path / "out").eval(), ids),
                               logits(causal.eval(), ids), atol=1e-5, rtol=0)
    assert torch.equal(logits(loaded.eval(), ids), logits(causal, ids))


def test_the_sources_license_and_vocabulary_files_travel_with_the_weights(tmp_path):
    """A source folder with a license in its card's front matter, LICENSE / NOTICE / USE_POLICY.md and the tokenizer's
    own vocabulary files (tokenizer.model of Llama-2 / Mistral repos, vocab.json and merges.txt of Qwen2 repos): the
    card said `license: apache-2.0` whatever the source's terms, and every one of these files was dropped (the
    tokenizer's `save_pretrained` writes tokenizer.json only). They are copied byte for byte; the tokenizer reloads
    the same."""
    source = save_source(tmp_path / "source")
    (source / "README.md").write_text("---\nlicense: llama3.2\nlicense_link: https://example.com/LICENSE\n---\n# x\n")
    vocabulary = json.loads((source / "tokenizer.json").read_text())["model"]
    side_files = {"LICENSE": b"LLAMA 3.2 COMMUNITY LICENSE AGREEMENT\n", "NOTICE": b"Notice\n",
                  "USE_POLICY.md": b"# Acceptable use\n", "tokenizer.model": bytes(range(256)),
                  "vocab.json": json.dumps(vocabulary["vocab"]).encode(),
                  "merges.txt": "\n".join(" ".join(pair) for pair in vocabulary["merges"]).encode()}
    for name, content in side_files.items():
        (source / name).write_bytes(content)
    code, stderr = run_convert_in_process(source, tmp_path / "out", "--max-new-tokens", "0", cwd=tmp_path)
    assert code == 0, stderr[-3000:]
    out = tmp_path / "out"
    assert {name: (out / name).read_bytes() for name in side_files} == side_files
    front_matter = (out / "README.md").read_text().split("---\n")[1].splitlines()
    assert "license: llama3.2" in front_matter and "license_link: https://example.com/LICENSE" in front_matter
    assert not any("apache" in line for line in front_matter)
    text = "The capital of France is Paris."
    assert AutoTokenizer.from_pretrained(out)(text).input_ids == AutoTokenizer.from_pretrained(source)(text).input_ids



def test_a_folders_tokenizer_travels_as_its_files_and_what_is_not_carried_is_named(tmp_path, caplog):
    """A Llama-2 / Mistral-v0.1-style tokenizer (SentencePiece-like BPE in tokenizer.json, LlamaTokenizer with
    `legacy: true`): transformers 5.25's `save_pretrained` drops `legacy` and rewrites tokenizer.json from its own
    reading, so the re-saved tokenizer split text after a special token otherwise and the conversion was refused ("The
    tokenizer written for the output ... differs"); with `legacy: false` it converted with a tokenizer.json that the
    `tokenizers` library reads otherwise than the source's. The tokenizer's files travel byte for byte (mistral-common's
    tekken.json too), and the folder's other entries, dropped without a word (params.json, original/), are named."""
    from tokenizers import Tokenizer, decoders, models, normalizers, processors, trainers
    from transformers import LlamaConfig, LlamaForCausalLM

    source = tmp_path / "source"
    source.mkdir()
    backend = Tokenizer(models.BPE(unk_token="<unk>", byte_fallback=True, fuse_unk=True))
    backend.normalizer = normalizers.Sequence([normalizers.Prepend("\u2581"), normalizers.Replace(" ", "\u2581")])
    backend.decoder = decoders.Sequence([decoders.Replace("\u2581", " "), decoders.ByteFallback(), decoders.Fuse(),
                                         decoders.Strip(" ", 1, 0)])
    words = ["the capital of France is Paris", "two  spaces and a tab", "hello world", "a model of words"]
    backend.train_from_iterator(words * 20, trainers.BpeTrainer(
        vocab_size=300, special_tokens=["<unk>", "<s>", "</s>", *(f"<0x{i:02X}>" for i in range(256))]))
    backend.post_processor = processors.TemplateProcessing(single="<s> $A", pair="<s> $A <s> $B",
                                                           special_tokens=[("<s>", 1)])
    backend.save(str(source / "tokenizer.json"))
    (source / "tokenizer_config.json").write_text(json.dumps({
        "tokenizer_class": "LlamaTokenizer", "legacy": True, "add_bos_token": True, "add_eos_token": False,
        "bos_token": "<s>", "eos_token": "</s>", "unk_token": "<unk>", "model_max_length": 2048,
        "chat_template": "{% for m in messages %}{{ bos_token + '[INST] ' + m['content'] + ' [/INST]' }}{% endfor %}"}))
    (source / "additional_chat_templates").mkdir()
    (source / "additional_chat_templates" / "tool_use.jinja").write_text("{{ messages[0]['content'] }}")
    (source / "tekken.json").write_text('{"vocab": []}')
    (source / "params.json").write_text("{}")
    (source / "original").mkdir()
    (source / "original" / "params.json").write_text("{}")
    torch.manual_seed(0)
    LlamaForCausalLM(LlamaConfig(vocab_size=backend.get_vocab_size(), hidden_size=32, intermediate_size=64,
                                 num_hidden_layers=2, num_attention_heads=4, bos_token_id=1,
                                 eos_token_id=2)).save_pretrained(source)
    code, stderr = run_convert_in_process(source, tmp_path / "out", "--max-new-tokens", "0", cwd=tmp_path)
    assert code == 0, stderr[-3000:]
    for name in ("tokenizer.json", "tokenizer_config.json", "tekken.json", "additional_chat_templates/tool_use.jinja"):
        assert (tmp_path / "out" / name).read_bytes() == (source / name).read_bytes(), name
    assert f"Not carried into the output: original/, params.json in {source} " in caplog.text
    assert not (tmp_path / "out" / "params.json").exists()
    text = "<s> two  spaces"
    assert AutoTokenizer.from_pretrained(tmp_path / "out")(text)["input_ids"] == \
        AutoTokenizer.from_pretrained(source)(text)["input_ids"]


def test_a_generic_tokenizer_class_and_a_linked_templates_folder_travel_as_they_are(tmp_path, caplog):
    """A helper's audit of the copied tokenizer: tokenizer_config.json naming `PreTrainedTokenizerFast` (Llama 3's
    layout), which transformers 5 loads as `TokenizersBackend`, the same class, was rewritten to name the latter; an
    `additional_chat_templates/` that is a link to a shared folder was not copied (links to folders are not followed
    for license folders), so the written tokenizer lacked its named templates and the conversion was refused."""
    source = save_source(tmp_path / "source")
    edit_json(source / "tokenizer_config.json", tokenizer_class="PreTrainedTokenizerFast")
    shared = tmp_path / "shared-templates"
    shared.mkdir()
    (shared / "tool_use.jinja").write_text("{{ 'TOOL' }}")
    (source / "additional_chat_templates").symlink_to(shared, target_is_directory=True)
    assert "tool_use" in AutoTokenizer.from_pretrained(source).chat_template
    code, stderr = run_convert_in_process(source, tmp_path / "out", "--max-new-tokens", "0", cwd=tmp_path)
    assert code == 0, stderr[-3000:]
    out = tmp_path / "out"
    assert (out / "tokenizer_config.json").read_bytes() == (source / "tokenizer_config.json").read_bytes()
    templates = out / "additional_chat_templates"
    assert not templates.is_symlink() and (templates / "tool_use.jinja").read_text() == "{{ 'TOOL' }}"
    assert "Not carried" not in caplog.text


def test_a_tokenizer_with_code_is_saved_by_transformers_and_only_its_code_is_named_as_left_behind(tmp_path, caplog):
    """A tokenizer_config.json with an `auto_map` to tokenizer code: saved by transformers' own class (the code is
    never copied). The "not carried" warning named its `additional_chat_templates/`, which the saved tokenizer
    writes, and not mistral-common's tekken.json, which was dropped. Other loaders' files travel byte for byte, and
    only the code is named."""
    source = save_source(tmp_path / "source")
    edit_json(source / "tokenizer_config.json", auto_map={"AutoTokenizer": ["tokenization_foo.FooTokenizer", None]})
    (source / "tokenization_foo.py").write_text("raise RuntimeError('never run')\n")
    (source / "additional_chat_templates").mkdir()
    (source / "additional_chat_templates" / "tool_use.jinja").write_text("{{ 'TOOL' }}")
    (source / "tekken.json").write_text('{"vocab": []}')
    code, stderr = run_convert_in_process(source, tmp_path / "out", "--max-new-tokens", "0", cwd=tmp_path)
    assert code == 0, stderr[-3000:]
    out = tmp_path / "out"
    assert (out / "tekken.json").read_bytes() == (source / "tekken.json").read_bytes()
    assert (out / "additional_chat_templates" / "tool_use.jinja").is_file()
    assert "auto_map" not in json.loads((out / "tokenizer_config.json").read_text())
    (warning,) = [record.getMessage() for record in caplog.records if "Not carried" in record.getMessage()]
    assert warning.startswith(f"Not carried into the output: tokenization_foo.py in {source} "), warning


def test_a_tokenizer_without_tokenizer_json_gets_one_beside_its_vocabulary_files(tmp_path):
    """From a review: a source whose tokenizer is vocab.json and merges.txt (no tokenizer.json) had its files copied
    as they were, so the output, which transformers' save gave a tokenizer.json before, lost it (the `tokenizers`
    library, TGI and transformers.js read that file alone). Saved by transformers again, its vocabulary files
    copied beside."""
    source = tmp_path / "source"
    make_source("qwen2").save_pretrained(source)
    make_tokenizer().save_pretrained(tmp_path / "full")
    spec = json.loads((tmp_path / "full" / "tokenizer.json").read_text())["model"]
    (source / "vocab.json").write_text(json.dumps(spec["vocab"]))
    merges = [merge if isinstance(merge, str) else " ".join(merge) for merge in spec["merges"]]
    (source / "merges.txt").write_text("#version: 0.2\n" + "\n".join(merges) + "\n")
    fields = json.loads((tmp_path / "full" / "tokenizer_config.json").read_text())
    (source / "tokenizer_config.json").write_text(json.dumps({**fields, "tokenizer_class": "Qwen2Tokenizer"}))
    assert upcycle(source, tmp_path / "out", dar_block_size=2, max_new_tokens=0, progress=False).report.passed
    out = tmp_path / "out"
    assert (out / "tokenizer.json").is_file()
    assert (out / "vocab.json").read_bytes() == (source / "vocab.json").read_bytes()
    text = "The capital of France"
    ids = [AutoTokenizer.from_pretrained(folder)(text)["input_ids"] for folder in (out, source)]
    assert ids[0] == ids[1]


def test_what_is_not_carried_is_said_only_where_a_folder_is_written_for_the_user(tmp_path, caplog):
    """From a review: `convert(path)` returns a model and writes no folder for the user, yet warned "Not carried into
    the output: ... copy what you need of them before removing the source"."""
    from dar_transformers.conversion import convert

    source = save_source(tmp_path / "source")
    (source / "params.json").write_text("{}")
    convert(source, dar_block_size=2, max_new_tokens=0, progress=False)
    assert "Not carried" not in caplog.text
    upcycle(source, tmp_path / "out", dar_block_size=2, max_new_tokens=0, progress=False)
    assert f"Not carried into the output: params.json in {source} " in caplog.text


def test_the_source_files_safetensors_metadata_is_named_as_not_carried(tmp_path, caplog):
    """Keys of a weights file's `__metadata__` beside "format" (a license, an author, a training step, as some tools
    write them) were dropped without a word: the output's files hold {"format": "pt"}, as save_pretrained writes."""
    source = save_source(tmp_path / "source")
    save_file(load_file(source / "model.safetensors"), source / "model.safetensors",
              metadata={"format": "pt", "license": "cc-by-nc-4.0", "training_step": "1200"})
    upcycle(source, tmp_path / "out", dar_block_size=2, max_new_tokens=0, progress=False)
    assert (f"Not carried into the output: the safetensors metadata of its weights files (license, training_step) "
            f"in {source} ") in caplog.text
    caplog.clear()
    upcycle(save_source(tmp_path / "plain"), tmp_path / "out2", dar_block_size=2, max_new_tokens=0, progress=False)
    assert "Not carried" not in caplog.text  # {"format": "pt"} alone, as transformers writes it: nothing to say


def test_license_files_of_any_case_and_a_licenses_folder_travel_with_the_weights(tmp_path):
    """license.txt, Notice.md and REUSE's LICENSES/ folder (a file in a subfolder too) were left behind without a word:
    the patterns matched upper-case file names only. Copied byte for byte at the same places; a link to a folder
    outside is not followed."""
    source = save_source(tmp_path / "source")
    outside = tmp_path / "elsewhere"
    outside.mkdir()
    (outside / "secret.txt").write_text("not a license\n")
    files = {"license.txt": b"lower-case terms\n", "Notice.md": b"Notice\n", "LICENSES/Apache-2.0.txt": b"apache\n",
             "LICENSES/third-party/MIT.txt": b"mit\n"}
    for name, content in files.items():
        (source / name).parent.mkdir(parents=True, exist_ok=True)
        (source / name).write_bytes(content)
    (source / "LICENSES" / "linked").symlink_to(outside, target_is_directory=True)
    code, stderr = run_convert_in_process(source, tmp_path / "out", "--max-new-tokens", "0", cwd=tmp_path)
    assert code == 0, stderr[-3000:]
    out = tmp_path / "out"
    assert {name: (out / name).read_bytes() for name in files} == files
    assert not (out / "LICENSES" / "linked").exists()


def test_a_source_card_without_a_license_gives_license_other_not_a_made_up_one(tmp_path):
    source = save_source(tmp_path / "source")
    code, stderr = run_convert_in_process(source, tmp_path / "out", "--max-new-tokens", "0", cwd=tmp_path)
    assert code == 0, stderr[-3000:]
    front_matter = (tmp_path / "out" / "README.md").read_text().split("---\n")[1].splitlines()
    assert [line for line in front_matter if line.startswith("license")] == ["license: other"]


def test_a_length_dependent_rope_is_checked_one_prompt_at_a_time(tmp_path):
    """`rope_type: dynamic` (dynamic NTK; longrope alike) takes the rotary frequencies from the batch's longest row once
    it exceeds `max_position_embeddings`, so right-padding changes a shorter prompt's logits. The check ran the source's
    prompts in one batch and the converted model's in other groups, and refused an exact conversion (a 0.4 logit
    difference on every prompt but the longest); each prompt alone, as `from_pretrained` runs it, differs by 3e-6."""
    source = save_source(tmp_path / "source")
    edit_json(source / "config.json", max_position_embeddings=32,
              rope_parameters={"rope_type": "dynamic", "rope_theta": 10000.0, "factor": 4.0})
    code, stderr = run_convert_in_process(source, tmp_path / "out", "--max-new-tokens", "2", cwd=tmp_path)
    assert code == 0, stderr[-3000:]


@pytest.mark.parametrize("rope", [
    {"rope_type": "longrope", "rope_theta": 10000.0, "attention_factor": 1.1,
     "short_factor": [1.0 + 0.1 * i for i in range(4)], "long_factor": [2.0 + 0.3 * i for i in range(4)]},
    {"rope_type": "yarn", "rope_theta": 10000.0, "factor": 4.0},
    {"rope_type": "llama3", "rope_theta": 10000.0, "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0},
], ids=["longrope", "yarn", "llama3"])
def test_an_original_length_beside_the_rope_parameters_is_the_converted_models_too(tmp_path, caplog, rope):
    """Phi-3's layout keeps `original_max_position_embeddings` beside the rope parameters, a field LlamaConfig does
    not define: transformers' rope takes it from there when the model is built, while the config's `rope_parameters`
    hold `max_position_embeddings`. The converter dropped it ("its model never reads them"), so the converted rope
    took `max_position_embeddings` instead: the check failed, or (a longrope model whose check prompts were all
    shorter than its original length, a helper's repro) passed, and the written model differed by 6 logits past that
    length. The converted folder now computes the source's function at every length."""
    source = save_source(tmp_path / "source")
    config = json.loads((source / "config.json").read_text())
    config.pop("rope_parameters", None)
    config.update(max_position_embeddings=48, original_max_position_embeddings=12, rope_scaling=rope)
    (source / "config.json").write_text(json.dumps(config))
    code, stderr = run_convert_in_process(source, tmp_path / "out", "--max-new-tokens", "2", cwd=tmp_path)
    assert code == 0, stderr[-3000:]
    assert "does not define" not in caplog.text  # not said to be unread, nor dropped
    assert json.loads((tmp_path / "out" / "config.json").read_text())["rope_parameters"][
        "original_max_position_embeddings"] == 12
    reference = AutoModelForCausalLM.from_pretrained(source, dtype=torch.float32).eval()
    converted = AutoModelForCausalLM.from_pretrained(tmp_path / "out", dtype=torch.float32).eval()
    for length in (10, 13, 40):  # both sides of the original length
        ids = torch.randint(3, 300, (1, length), generator=torch.Generator().manual_seed(length))
        with torch.no_grad():
            assert (reference(ids).logits - converted(ids).logits).abs().max() < 1e-4, length


def test_a_bidirectional_source_is_refused_naming_is_causal(tmp_path):
    """`"is_causal": false` (embedding models made from causal LMs ship it) makes transformers' masks bidirectional,
    a field the config class does not define: it was dropped as never read, and the check failed at a 6-logit
    difference with no word on why. Refused before anything is written, from a folder and from a model in memory."""
    source = save_source(tmp_path / "source")
    edit_json(source / "config.json", is_causal=False)
    code, stderr = run_convert_in_process(source, tmp_path / "out", "--max-new-tokens", "0", cwd=tmp_path)
    assert code != 0 and "sets is_causal=false: transformers' attention masks then let every token attend" in stderr
    assert "Traceback" not in stderr and not (tmp_path / "out").exists()
    model = AutoModelForCausalLM.from_pretrained(source)
    assert model.config.is_causal is False
    with pytest.raises(ValueError, match=r"config sets is_causal=False: transformers' attention masks"):
        upcycle(model, progress=False)


@pytest.mark.parametrize("template, warning", [
    ("{{ raise_exception('System message required') }}",
     r"fails on one user message \(TemplateError: System message required\)"),
    # a Python error inside the template: a one-line refusal naming no template, or a ZeroDivisionError traceback
    ("{{ messages[0]['content'] + 1 }}", r"fails on one user message \(TypeError: can only concatenate str"),
    ("{{ messages|length / 0 }}", r"fails on one user message \(ZeroDivisionError: "),
    ("", r"renders one user message to no tokens"),  # was `RuntimeError: max(): Expected reduction dim`
], ids=["raise_exception", "type-error", "zero-division", "empty"])
def test_a_chat_template_that_fails_leaves_the_chat_prompt_out_with_a_warning_naming_it(tmp_path, caplog, template,
                                                                                        warning):
    """A chat template that refuses one user message (real ones require a system message through
    `raise_exception`), fails in Python, or renders nothing: the conversion ended in a traceback (or a one-line error
    naming no template), and a good source could not be converted. The chat prompt is left out of the check, with a
    warning naming the template."""
    source = save_source(tmp_path / "source")
    (source / "chat_template.jinja").write_text(template)
    code, stderr = run_convert_in_process(source, tmp_path / "out", "--max-new-tokens", "2", cwd=tmp_path)
    assert code == 0, stderr[-3000:]
    assert re.search(r"The source's chat template " + warning, caplog.text), caplog.text[-2000:]
    assert "the chat prompt is left out" in caplog.text


def test_a_verification_prompt_that_tokenizes_to_nothing_is_refused_naming_it(tmp_path):
    """An empty prompt (or a tokenizer that encodes a prompt to nothing) ended in `RuntimeError: max(): Expected
    reduction dim ...` from deep inside the comparison."""
    source = save_source(tmp_path / "source")
    with pytest.raises(ValueError, match=r"^The verification prompt text-1 \(''\) tokenizes to no tokens"):
        upcycle(source, tmp_path / "out", prompts=["Hello world", ""], max_new_tokens=0, progress=False)
    assert not (tmp_path / "out").exists()


def test_a_tokenizer_with_ids_past_the_embedding_is_refused_naming_both_sizes(tmp_path):
    """A tokenizer with tokens added but the embeddings not resized (300 tokens over a vocab_size of 200): a prompt's
    id past the embedding ended in an IndexError traceback from the layer-streamed check."""
    source = save_source(tmp_path / "source")
    state = load_file(source / "model.safetensors")
    state["model.embed_tokens.weight"] = state["model.embed_tokens.weight"][:200].clone()
    save_file(state, source / "model.safetensors", metadata={"format": "pt"})
    edit_json(source / "config.json", vocab_size=200)
    code, stderr = run_convert_in_process(source, tmp_path / "out", "--max-new-tokens", "0", cwd=tmp_path)
    assert_refused_in_one_line(code, stderr, r"The tokenizer encodes the verification prompt text-0 to token id 2\d\d ",
                               r"the tokenizer has 300 tokens and the source config's vocab_size is 200",
                               r"model\.resize_token_embeddings\(len\(tokenizer\)\)")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["source"]


@pytest.mark.parametrize("flag, value, message", [
    ("--base-model", "x\nlicense: mit", "base_model must be the source's Hub id"),  # YAML injected into the card
    ("--base-model", "/home/me/models/llama", "base_model must be the source's Hub id"),  # a path of this machine
    ("--max-shard-size", "0", "max_shard_size must be a positive size such as '2GB' or '500MB', or an int of bytes"),
    ("--max-shard-size", "big", "max_shard_size must be a size such as '2GB' or '500MB', or an int of bytes"),
    # transformers reads a lowercase b as bits: 2gb was 250 MB shards
    ("--max-shard-size", "2gb", "max_shard_size '2gb' ends in a lowercase b, which transformers reads as bits (an "
                                "eighth of the bytes); write '2GB' for bytes."),
])
def test_a_card_field_or_shard_size_that_is_not_what_it_names_is_refused(tmp_path, capsys, flag, value, message):
    source = save_source(tmp_path / "source")
    code = cli_main(["convert", str(source), str(tmp_path / "out"), flag, value])
    assert code == 1 and message in capsys.readouterr().err
    assert not (tmp_path / "out").exists()


def test_a_corrupt_tokenizer_json_is_named_not_blamed_on_code(tmp_path, capsys):
    source = save_source(tmp_path / "source")
    (source / "tokenizer.json").write_text('{"version": "1.0", "truncation": ')
    code = cli_main(["convert", str(source), str(tmp_path / "out")])
    error = capsys.readouterr().err
    assert code == 1 and "from tokenizer.json, tokenizer_config.json" in error
    assert not (tmp_path / "out").exists()


def test_a_shard_size_in_plain_bytes_on_the_command_line_shards_as_the_api_does(tmp_path):
    """`--max-shard-size 300000` was refused for lacking a unit, although the API takes an int of bytes."""
    source = save_source(tmp_path / "source")
    assert cli_main(["convert", str(source), str(tmp_path / "bytes"), "--max-new-tokens", "0",
                     "--max-shard-size", "300000"]) == 0
    assert cli_main(["convert", str(source), str(tmp_path / "unit"), "--max-new-tokens", "0",
                     "--max-shard-size", "300KB"]) == 0
    shards = sorted(path.name for path in (tmp_path / "bytes").glob("*.safetensors"))
    assert len(shards) > 1 and shards == sorted(path.name for path in (tmp_path / "unit").glob("*.safetensors"))
    for shard in shards:
        assert filecmp.cmp(tmp_path / "bytes" / shard, tmp_path / "unit" / shard, shallow=False)


def test_a_shard_size_of_zero_bytes_is_refused_not_one_shard_per_tensor():
    from dar_transformers.conversion.options import ConversionOptions

    for size in (0, -1):
        with pytest.raises(ValueError, match=r"max_shard_size must be a positive size such as '2GB' or '500MB', or an "
                           r"int of bytes, got -?\d"):
            ConversionOptions(max_shard_size=size)
    with pytest.raises(ValueError, match=r"'100b' ends in a lowercase b, which transformers reads as bits \(an eighth "
                       r"of the bytes\); write a size such as '2GB' or '500MB', or a number of bytes\."):
        ConversionOptions(max_shard_size="100b")  # no "write '100B'": transformers takes no bare B either
    for size in (True, 1.5):  # True was one-byte shards, 1.5 an AttributeError
        with pytest.raises(ValueError, match=r"max_shard_size must be a size such as '2GB' or '500MB', or an int of "
                           rf"bytes, got {size!r}"):
            ConversionOptions(max_shard_size=size)


def test_an_in_memory_conversion_to_float16_refuses_an_overflowing_weight_naming_it():
    """The in-memory path (`upcycle(model)` without an output, `upcycle_model`) cast the same 1e5 to inf and returned
    the model: the verification reads only the prompts' rows."""
    model = make_source(tied=False)
    with torch.no_grad():
        model.model.embed_tokens.weight[317, 0] = 1e5
    with pytest.raises(ValueError, match=r"'model\.embed_tokens\.weight' holds NaN or infinite values in float16: a "
                       r"source value outside float16's range"):
        upcycle(model, tokenizer=make_tokenizer(), dtype=torch.float16, tolerance=1e-2, max_new_tokens=2,
                progress=False)


@pytest.mark.parametrize("flags, message", [
    (["--tolerance", "-1"], "--tolerance: tolerance must be a positive number, got -1.0."),
    (["--block-size", "99"], "--block-size: DARConfig.dar_block_size must be an integer in [1, 6]"),
    (["--experts", "2", "--top-k", "3"], "--top-k: DARMoeConfig.num_experts_per_tok must be an integer in [1, "),
    (["--max-shard-size", "0"], "--max-shard-size: max_shard_size must be a positive size such as '2GB'"),
])
def test_an_option_refused_by_the_api_names_its_flag(tmp_path, capsys, flags, message):
    """The API's errors name its own fields (`tolerance`, `num_experts_per_tok`); on the command line they also name the
    flag to change."""
    source = save_source(tmp_path / "source")
    code = cli_main(["convert", str(source), str(tmp_path / "out"), *flags])
    error = capsys.readouterr().err.strip().splitlines()[-1]
    assert code == 1 and error.startswith("dar convert: error: " + message), error
    assert not (tmp_path / "out").exists()


def test_a_mixed_precision_source_whose_config_loads_it_wider_is_named_in_a_warning(tmp_path, caplog):
    """bf16 matrices with float32 norms under a config.json that says float32: from_pretrained loads the source in
    float32; the output keeps every stored value but says bfloat16, so it loads in bf16 with its norms rounded (the
    two load as different functions). Converted without a word before; a single-dtype source was warned already."""
    from transformers import AutoModelForCausalLM

    source = save_source(tmp_path / "source")
    model = AutoModelForCausalLM.from_pretrained(source)
    for name, parameter in model.named_parameters():
        if parameter.dim() == 2:
            parameter.data = parameter.data.bfloat16()
    model.save_pretrained(source)
    edit_json(source / "config.json", dtype="float32")
    code, stderr = run_convert_in_process(source, tmp_path / "out", "--max-new-tokens", "0", cwd=tmp_path)
    assert code == 0, stderr[-3000:]
    assert ("config.json says dtype float32, so from_pretrained loads it in float32; its weights are stored in "
            "bfloat16 with some in float32") in caplog.text
    assert "Pass --dtype float32" in caplog.text
    assert "rounds" not in caplog.text  # --dtype auto rounds nothing: it keeps the float32 norms as stored
    loaded = [AutoModelForCausalLM.from_pretrained(folder) for folder in (source, tmp_path / "out")]
    assert [m.model.norm.weight.dtype for m in loaded] == [torch.float32, torch.bfloat16]  # what the warning says


def test_a_config_dtype_other_than_the_stored_one_is_named_in_a_warning(tmp_path, caplog):
    """config.json says bfloat16 over float32 files: from_pretrained loads the source in bfloat16, the output (which keeps
    the stored float32 exactly, and says float32) in float32; converted silently before."""
    source = save_source(tmp_path / "source")
    edit_json(source / "config.json", dtype="bfloat16")
    code, stderr = run_convert_in_process(source, tmp_path / "out", "--max-new-tokens", "0", cwd=tmp_path)
    assert code == 0, stderr[-3000:]
    assert "config.json says dtype bfloat16, but its weights are stored in float32" in caplog.text
    assert "Pass --dtype bfloat16" in caplog.text
    edit_json(source / "config.json", dtype="float32")
    caplog.clear()
    code, stderr = run_convert_in_process(source, tmp_path / "out2", "--max-new-tokens", "0", cwd=tmp_path)
    assert code == 0 and "config.json says dtype" not in caplog.text


def test_a_mixed_source_whose_declared_dtype_rounds_the_source_itself_is_named_that_way(tmp_path, caplog):
    """float32 embedding and head (most of the bytes) beside bf16 layers, under a config.json that says bfloat16: the
    warning said the output's float32 load rounded "those bfloat16 tensors" (float32 holds every bf16 value) and did
    not say that the source's own bf16 load rounds its float32 embedding and head, which it does."""
    from transformers import AutoModelForCausalLM

    source = save_source(tmp_path / "source", tied=False)
    weights = load_file(source / "model.safetensors")
    wide = ("model.embed_tokens.weight", "lm_head.weight")
    save_file({name: tensor if name in wide else tensor.bfloat16() for name, tensor in weights.items()},
              source / "model.safetensors", metadata={"format": "pt"})
    edit_json(source / "config.json", dtype="bfloat16")
    code, stderr = run_convert_in_process(source, tmp_path / "out", "--max-new-tokens", "0", cwd=tmp_path)
    assert code == 0, stderr[-3000:]
    assert ("so from_pretrained loads it in bfloat16, rounding its 2 tensor(s) stored in float32 (lm_head.weight, "
            "model.embed_tokens.weight)") in caplog.text
    assert "which holds every stored value" in caplog.text and "rounding those bfloat16 tensors" not in caplog.text
    output = AutoModelForCausalLM.from_pretrained(tmp_path / "out")
    assert torch.equal(output.model.embed_tokens.weight, weights["model.embed_tokens.weight"])  # as it says
    assert not torch.equal(AutoModelForCausalLM.from_pretrained(source).model.embed_tokens.weight.float(),
                           weights["model.embed_tokens.weight"])


def test_a_float8_source_card_says_its_tensors_were_widened_not_stored_so(tmp_path):
    """Plain float8 matrices (no scales) beside float32 norms and embedding: `auto` widens the float8 ones to bfloat16
    exactly, and the card's weights row said "as the source stores them, 14 tensor(s) in bfloat16", while its first
    sentence said float8_e4m3fn x 14."""
    source = save_source(tmp_path / "source")
    weights = load_file(source / "model.safetensors")
    save_file({name: tensor.to(torch.float8_e4m3fn) if name.endswith("proj.weight") else tensor
               for name, tensor in weights.items()}, source / "model.safetensors", metadata={"format": "pt"})
    code, stderr = run_convert_in_process(source, tmp_path / "out", "--max-new-tokens", "0", cwd=tmp_path)
    assert code == 0, stderr[-3000:]
    card = (tmp_path / "out" / "README.md").read_text()
    assert re.search(r"\| weights dtype \| float32; 21 tensor\(s\) in bfloat16, widened exactly from the source's "
                     r"float8_e4m3fn \(model\.layers\.0\.self_attn\.q_proj\.weight, ", card), card
    assert "as the source stores them" not in card


@pytest.mark.parametrize("template", ["chat", "none", "failing"])
def test_the_cards_generation_code_runs_on_the_written_folder(tmp_path, template, capsys):
    """The card's code, run as a user copies it: with the package, load, then generate, and its `dar generate` line.
    Its "Chat:" block called `apply_chat_template` whatever the tokenizer, which raises for one without a chat
    template or with one that fails on the card's one user message (a template requiring a system message)."""
    source = save_source(tmp_path / "source")
    if template == "none":
        (source / "chat_template.jinja").unlink()
    elif template == "failing":
        (source / "chat_template.jinja").write_text("{{ raise_exception('System message required') }}")
    code, stderr = run_convert_in_process(source, tmp_path / "out", "--max-new-tokens", "0", cwd=tmp_path)
    assert code == 0, stderr[-3000:]
    card = (tmp_path / "out" / "README.md").read_text()
    blocks = re.findall(r"```python\n(.*?)```", card, re.S)
    loading, usage = blocks[0], blocks[-1]
    assert ("apply_chat_template" in usage) == (template == "chat")
    reason = {"chat": "Chat:", "none": "The tokenizer has no chat template, so continue text:",
              "failing": "The tokenizer's chat template fails on one user message (TemplateError: System message "
                         "required), so continue text:"}[template]
    assert reason in card
    exec(loading.replace("<this repo or folder>", str(tmp_path / "out")) + usage.replace("48", "3"), {})
    (command,) = re.findall(r"from the command line: `dar (generate .*?)`", card)
    arguments = shlex.split(command.replace("<this folder>", str(tmp_path / "out"))) + ["--max-new-tokens", "2"]
    capsys.readouterr()
    assert cli_main(arguments) == 0, capsys.readouterr().err[-2000:]


def test_dar_generate_with_a_chat_template_that_fails_is_one_line_naming_the_way_out(tmp_path, capsys):
    """`dar generate` on a folder whose chat template fails on one user message ended in a traceback."""
    source = save_source(tmp_path / "source")
    (source / "chat_template.jinja").write_text("{{ raise_exception('System message required') }}")
    assert cli_main(["generate", str(source), "--prompt", "Hello", "--max-new-tokens", "2"]) == 1
    error = capsys.readouterr().err
    assert "Traceback" not in error and "fails on the prompt (TemplateError: System message required)" in error
    assert "--no-chat-template" in error
    assert cli_main(["generate", str(source), "--prompt", "Hello", "--max-new-tokens", "2", "--no-chat-template"]) == 0


def test_a_partial_rotary_factor_the_default_rope_ignores_converts(tmp_path):
    """The positive control of the refusal in test_cli_bad_sources: transformers' default rope ignores
    `partial_rotary_factor` (its scaled ropes honour it, and Llama's attention then fails on every forward), so this
    source runs, rotating whole heads, and converts to a model that computes the same."""
    source = save_source(tmp_path / "source")
    edit_json(source / "config.json", rope_parameters={"rope_type": "default", "rope_theta": 10000.0,
                                                       "partial_rotary_factor": 0.5})
    code, stderr = run_convert_in_process(source, tmp_path / "out", "--max-new-tokens", "0", cwd=tmp_path)
    assert code == 0, stderr[-3000:]
    ids = random_tokens(32)
    torch.testing.assert_close(logits(AutoModelForCausalLM.from_pretrained(tmp_path / "out").eval(), ids),
                               logits(AutoModelForCausalLM.from_pretrained(source).eval(), ids), atol=1e-5, rtol=0)
