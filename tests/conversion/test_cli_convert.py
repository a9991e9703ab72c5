# SPDX-License-Identifier: Apache-2.0
"""`dar convert` and `dar generate` as a user runs them, and the demo's tiny mode."""

import json
import os
import shutil
import subprocess
import sys
from importlib.metadata import entry_points

import huggingface_hub.constants
import pytest

from transformers import AutoModelForCausalLM

from dar_transformers.cli import main as cli_main
from dar_transformers.conversion import chat_input_ids

from conftest import (REPO, edit_json, make_source, make_tokenizer, run_convert_in_process, save_source,
                      write_tiny_gguf)


def test_cli_convert_prints_the_table_and_generate_streams(tmp_path, capsys):
    (script,) = entry_points(group="console_scripts", name="dar")
    assert script.load() is cli_main
    source = save_source(tmp_path / "source", family="llama")
    out = tmp_path / "out"
    code = cli_main(["convert", str(source), str(out), "--block-size", "1", "--max-new-tokens", "8", "--tolerance", "1e-5"])
    printed = capsys.readouterr().out
    assert code == 0 and "PASSED" in printed and "chat: What is the capital of France?" in printed
    assert json.loads((out / "config.json").read_text())["dar_block_size"] == 1

    assert cli_main(["convert", str(source), str(out)]) == 1
    assert "exists and is not empty" in capsys.readouterr().err

    assert cli_main(["generate", str(out), "--max-new-tokens", "6"]) == 0
    streamed = capsys.readouterr().out
    tokenizer = make_tokenizer()
    dar = AutoModelForCausalLM.from_pretrained(out).eval()
    ids = chat_input_ids(tokenizer, "What is the capital of France?")
    expected = tokenizer.decode(dar.generate(ids, max_new_tokens=6, do_sample=False)[0, ids.shape[1]:], skip_special_tokens=True)
    assert streamed.strip() == expected.strip()

    # An empty prompt without a chat template gives no tokens: a reshape traceback from inside generate, now one line.
    assert cli_main(["generate", str(out), "--prompt", "", "--no-chat-template"]) == 1
    assert capsys.readouterr().err.strip().splitlines()[-1] == (
        "dar generate: error: --prompt gives no tokens (an empty prompt, and the tokenizer adds none): pass some text.")


@pytest.mark.parametrize(("redirect", "reason"), [
    ("| true; exit ${PIPESTATUS[0]}", "standard output was closed"),
    ("> /dev/full", "writing standard output failed: No space left on device"),
], ids=["closed_pipe", "full_disk"])
def test_a_conversion_whose_report_cannot_be_printed_exits_0_with_its_output_in_place(tmp_path, redirect, reason):
    """`dar convert SRC OUT | head -1`, or any reader that goes away: printing the report after the output was in
    place raised BrokenPipeError, a traceback and exit 1, for a complete conversion (a retry then met "exists"); and
    so did a report redirected to a log on a full disk (`> /dev/full`: OSError ENOSPC), with nothing saying the
    output (an `--overwrite` replacing the previous one) was in place."""
    source = save_source(tmp_path / "source")
    command = (f"{sys.executable} -m dar_transformers.cli convert {source} {tmp_path / 'out'} --max-new-tokens 1 "
               f"{redirect}")
    done = subprocess.run(["bash", "-c", command], env={**os.environ, "OMP_NUM_THREADS": "1", "HF_HUB_OFFLINE": "1"},
                          stdin=subprocess.DEVNULL, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    assert "Traceback" not in done.stderr
    assert f"dar convert: wrote {tmp_path / 'out'}; its report was not printed ({reason})." in done.stderr
    from dar_transformers.conversion.output import not_a_conversion_output
    assert not_a_conversion_output(tmp_path / "out") is None


@pytest.mark.parametrize(("arguments", "message"), [
    (["{missing}"], "dar generate: error: no folder {missing}"),  # was 40 s of Hub retries, then a connection error
    (["{file}"], "is a file; pass a model folder (a GGUF file: convert it with `dar convert` first)"),  # "not JSON"
    (["{folder}", "--max-new-tokens", "-1"], "argument --max-new-tokens: -1 is below 1"),  # was a traceback
    (["{folder}", "--temperature", "-1"], "argument --temperature: -1 is below 0.0"),  # was greedy, silently
    (["{folder}", "--temperature", "nan"], "argument --temperature: nan is not a finite number"),  # greedy, silently
    (["{folder}"], "dar generate: error: {folder} holds no config.json: not a model folder"),  # blamed sentencepiece
    (["{untokenized}"], "dar generate: error: {untokenized} holds no tokenizer (tokenizer.json, tokenizer_config.json, "
                        "tokenizer.model, vocab.json)"),
    (["./missing"], "dar generate: error: no folder ./missing\n"),  # said "(./ is a folder here, so it names a path")
    (["{folder}", "--seed", "4294967296"], "argument --seed: 4294967296 is above 4294967295, the most it takes"),
    ([""], "dar generate: error: the model is an empty path (an unset shell variable?); name the model folder\n"),
])  # --seed 2**32: numpy's traceback after the model loaded; "": an empty name in "error:  holds no config.json"
def test_dar_generate_refuses_bad_input_in_one_line(tmp_path, capsys, monkeypatch, arguments, message):
    paths = {"missing": str(tmp_path / "missing"), "file": str(tmp_path / "model.gguf"), "folder": str(tmp_path),
             "untokenized": str(tmp_path / "untokenized")}
    (tmp_path / "model.gguf").write_bytes(b"GGUF")
    (tmp_path / "untokenized").mkdir()
    (tmp_path / "untokenized" / "config.json").write_text("{}")
    monkeypatch.chdir(tmp_path)
    try:
        code = cli_main(["generate", *(argument.format(**paths) for argument in arguments)])
    except SystemExit as exit_:  # argparse's usage error
        code = exit_.code
    assert code in (1, 2) and message.format(**paths) in capsys.readouterr().err


@pytest.mark.parametrize(("redirect", "tokens", "code", "last_line"), [
    ("| true; exit ${PIPESTATUS[0]}", 64, 0, None),
    ("> /dev/full", 8, 1, "dar generate: error: writing standard output failed (No space left on device); the answer "
                          "was not written in full."),
], ids=["closed_pipe", "full_disk"])
def test_dar_generate_whose_answer_cannot_be_printed_says_so_without_a_traceback(tmp_path, redirect, tokens, code,
                                                                                   last_line):
    """`dar generate MODEL | head -1`: the streamer's write into the closed pipe was a BrokenPipeError traceback and
    exit 1; a filter whose reader has what it wanted stops quietly. `> /dev/full` (a log on a full disk): the
    streamer's failed write was an OSError traceback; one line saying so, exit 1 (the answer, the command's only
    product, is lost)."""
    source = save_source(tmp_path / "source")
    command = (f"{sys.executable} -m dar_transformers.cli generate {source} --no-chat-template --max-new-tokens "
               f"{tokens} {redirect}")
    done = subprocess.run(["bash", "-c", command], env={**os.environ, "OMP_NUM_THREADS": "1", "HF_HUB_OFFLINE": "1"},
                          stdin=subprocess.DEVNULL, capture_output=True, text=True, timeout=300)
    assert done.returncode == code and "Traceback" not in done.stderr, done.stderr[-3000:]
    if last_line is not None:
        assert done.stderr.strip().splitlines()[-1] == last_line


def test_dar_generate_prints_an_answer_its_output_encoding_lacks_and_repeats_a_seeded_sample(tmp_path):
    """An answer with a character standard output cannot encode (PYTHONIOENCODING=ascii, a cp1252 console) ended in
    a UnicodeEncodeError traceback; it is printed with "?" for it. `--seed` repeats a sampled answer (sampling took
    torch's random state as it came: no two runs alike)."""
    source = save_source(tmp_path / "source")

    def generate(*flags, encoding="utf-8"):
        command = [sys.executable, "-m", "dar_transformers.cli", "generate", str(source), "--no-chat-template",
                   "--max-new-tokens", "12", *flags]
        environment = {**os.environ, "OMP_NUM_THREADS": "1", "HF_HUB_OFFLINE": "1", "PYTHONIOENCODING": encoding}
        return subprocess.run(command, env=environment, stdin=subprocess.DEVNULL, capture_output=True, timeout=300)

    greedy = generate()
    answer = greedy.stdout.decode()
    assert greedy.returncode == 0 and any(ord(character) > 127 for character in answer), answer  # byte-level BPE
    ascii_run = generate(encoding="ascii")
    assert ascii_run.returncode == 0 and b"Traceback" not in ascii_run.stderr, ascii_run.stderr[-2000:]
    assert ascii_run.stdout.decode("ascii") == "".join(c if ord(c) < 128 else "?" for c in answer)
    seeded = [generate("--temperature", "2", "--seed", "5").stdout for _ in range(2)]
    assert seeded[0] == seeded[1] != generate("--temperature", "2", "--seed", "6").stdout


def test_dar_generate_takes_a_named_chat_template_and_refuses_to_guess_one(tmp_path, capsys):
    """A folder with named chat templates only (additional_chat_templates/NAME.jinja, no default one) was run as
    plain text without a word; it is refused naming them, `--chat-template NAME` picks one, and a name it lacks is
    refused naming those it has."""
    source = save_source(tmp_path / "source")
    (source / "chat_template.jinja").unlink()  # no default template
    (source / "additional_chat_templates").mkdir()
    (source / "additional_chat_templates" / "shout.jinja").write_text(
        "{% for m in messages %}{{ m['content'] | upper }}{% endfor %}{% if add_generation_prompt %}:{% endif %}")
    assert cli_main(["generate", str(source), "--max-new-tokens", "4"]) == 1
    assert capsys.readouterr().err.strip().splitlines()[-1] == (
        f"dar generate: error: {source} has named chat templates only (shout), none of them the default one: pass "
        "--chat-template NAME, or --no-chat-template to continue the prompt as text.")
    assert cli_main(["generate", str(source), "--max-new-tokens", "4", "--chat-template", "whisper"]) == 1
    assert capsys.readouterr().err.strip().splitlines()[-1] == (
        f"dar generate: error: {source} has no chat template named 'whisper' (its named ones: shout).")
    errors = sys.stdout.errors
    assert cli_main(["generate", str(source), "--max-new-tokens", "4", "--chat-template", "shout", "--prompt",
                     "hello"]) == 0
    assert sys.stdout.errors == errors  # the caller's stream as it was (main ran in its process)
    tokenizer = make_tokenizer()
    ids = tokenizer("HELLO:", add_special_tokens=False, return_tensors="pt")["input_ids"]
    model = AutoModelForCausalLM.from_pretrained(source).eval()
    expected = tokenizer.decode(model.generate(ids, attention_mask=ids.new_ones(ids.shape), max_new_tokens=4,
                                               do_sample=False)[0, ids.shape[1]:], skip_special_tokens=True)
    assert capsys.readouterr().out.strip() == expected.strip()


def test_dar_generate_reads_a_missing_folder_inside_a_local_one_as_a_path(tmp_path, capsys, monkeypatch):
    """`dar generate outputs/model-dar` mistyped: "org/name" looks like a Hub id, and it went to the Hub (40 s of
    retries offline, or another model of that name). Where "outputs" is a folder here it is a path: refused at once."""
    (tmp_path / "outputs").mkdir()
    monkeypatch.chdir(tmp_path)
    assert cli_main(["generate", "outputs/model-dr"]) == 1
    assert capsys.readouterr().err.strip() == ("dar generate: error: no folder outputs/model-dr (outputs/ is a folder "
                                               "here, so it names a path, not a Hub id)")
    # A Hub model of that name in the local cache is the Hub model, a same-named local folder notwithstanding.
    snapshot = tmp_path / "hub" / "models--outputs--cached-dar" / "snapshots" / ("0" * 40)
    snapshot.mkdir(parents=True)
    (snapshot.parent.parent / "refs").mkdir()
    (snapshot.parent.parent / "refs" / "main").write_text("0" * 40)
    (snapshot / "config.json").write_text("{}")
    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_CACHE", str(tmp_path / "hub"))
    from dar_transformers import cli as cli_module
    assert cli_module._cached_on_the_hub("outputs/cached-dar") and not cli_module._cached_on_the_hub("outputs/x")


def test_demo_runs_in_its_tiny_mode(tmp_path):
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    completed = subprocess.run(
        [sys.executable, str(REPO / "examples" / "demo.py"), "--tiny", "--output", str(tmp_path / "demo")],
        env=env, capture_output=True, text=True, cwd=tmp_path,
    )
    assert completed.returncode == 0, completed.stderr[-3000:]
    assert "PASSED" in completed.stdout and "identical answers: True" in completed.stdout


def test_a_hub_cache_snapshot_is_named_by_its_repo_id_and_commit_in_the_card(tmp_path):
    """The folder `hf download` returns is `.../models--{org}--{name}/snapshots/{commit}`: the card's title and source
    sentence named the commit hash as the model's name, and then (named by its repo id) no revision at all, so the
    card did not say which of the repo's versions was converted; its front matter had no `base_model`, so the Hub did
    not link the output to its base (a GGUF file's repo is a quantisation's, not the base model's: none there)."""
    commit = "ab12" * 10
    snapshot = save_source(tmp_path / "hub" / "models--SomeOrg--Tiny-Thing" / "snapshots" / commit)
    assert run_convert_in_process(snapshot, tmp_path / "out", "--max-new-tokens", "0", cwd=tmp_path)[0] == 0
    card = (tmp_path / "out" / "README.md").read_text()
    assert "# SomeOrg/Tiny-Thing + DAR" in card
    assert f"`SomeOrg/Tiny-Thing` (HF folder SomeOrg/Tiny-Thing at commit {commit})" in card
    assert card.startswith("---\nbase_model: SomeOrg/Tiny-Thing\n")
    # A GGUF file of a snapshot: the file, its repo and commit.
    gguf_snapshot = tmp_path / "hub" / "models--SomeOrg--Tiny-GGUF" / "snapshots" / ("cd34" * 10)
    gguf_snapshot.mkdir(parents=True)
    write_tiny_gguf(gguf_snapshot / "tiny-q.gguf", make_source("llama", tied=False), make_tokenizer())
    assert run_convert_in_process(gguf_snapshot / "tiny-q.gguf", tmp_path / "out-gguf", "--max-new-tokens", "0",
                                  cwd=tmp_path)[0] == 0
    card = (tmp_path / "out-gguf" / "README.md").read_text()
    assert f"`tiny-q` (GGUF file tiny-q.gguf of SomeOrg/Tiny-GGUF at commit {'cd34' * 10}: F32 x" in card, card[:1500]
    assert "base_model:" not in card
    # Any other folder: its name only.
    source = save_source(tmp_path / "plain-folder")
    assert run_convert_in_process(source, tmp_path / "out-plain", "--max-new-tokens", "0", cwd=tmp_path)[0] == 0
    card = (tmp_path / "out-plain" / "README.md").read_text()
    assert "`plain-folder` (HF folder plain-folder)" in card and "base_model:" not in card


@pytest.mark.parametrize("flags, says, not_said", [
    ((), "two residual streams and a softmax attention over depth with reciprocal cross-stream addressing", None),
    (("--routing", "selfkv"), "with each stream addressing its own history", "reciprocal"),
    (("--streams", "1"), "one-stream special case (Attention Residuals)", "two residual streams"),
])
def test_the_card_describes_the_streams_and_routing_of_the_model(tmp_path, flags, says, not_said):
    """The card said "two residual streams ... reciprocal cross-stream addressing ... read and write gates" for every
    conversion, one-stream and `selfkv` ones too."""
    source = save_source(tmp_path / "source")
    assert run_convert_in_process(source, tmp_path / "out", "--max-new-tokens", "0", *flags, cwd=tmp_path)[0] == 0
    card = " ".join((tmp_path / "out" / "README.md").read_text().split())
    assert says in card
    assert not_said is None or not_said not in card


def test_a_source_named_dot_is_named_by_its_folder_in_the_card(tmp_path):
    """`dar convert . ../out` from inside the source folder: `Path(".").name` is empty, so the card read "#  + DAR" and
    "`` (HF folder )", naming no source. The folder's own name, as for any other spelling of the path."""
    source = save_source(tmp_path / "SmolThing-135M")
    code = run_convert_in_process(".", "../out", "--max-new-tokens", "0", cwd=source)[0]
    assert code == 0
    card = (tmp_path / "out" / "README.md").read_text()
    assert "# SmolThing-135M + DAR" in card and "`SmolThing-135M` (HF folder SmolThing-135M)" in card


@pytest.mark.parametrize("flags, absent, rows", [
    (["--streams", "1"], ("transport_logit", "write_gate", "read_gate"),
     ["| routing | none (one stream) |", "| write mode | none (one stream) |",
      "| write-gate spread delta | none (one stream) |", "| initial transport rho | none (one stream) |"]),
    (["--block-size", "1"], ("transport_logit",),
     ["| initial transport rho | none (blocks of one branch carry no partial to transport) |"]),
])
def test_the_cards_settings_name_only_parameters_the_model_has(tmp_path, flags, absent, rows):
    """One stream has no routing, gates or transport, and blocks of one branch no transport; the card listed their
    settings (a routing, rho 0.95) and "transport" among the new parameters, though the files hold none."""
    from safetensors import safe_open

    source = save_source(tmp_path / "source")
    assert cli_main(["convert", str(source), str(tmp_path / "out"), *flags, "--max-new-tokens", "0"]) == 0
    names = [name for path in (tmp_path / "out").glob("*.safetensors") for name in safe_open(path, "pt").keys()]
    assert names and not any(part in name for name in names for part in absent)
    card = (tmp_path / "out" / "README.md").read_text()
    assert all(row in card for row in rows), card
    assert "gates, transport)" not in card


def test_dar_generate_on_a_broken_folder_or_prompt_is_one_line(tmp_path, capsys, monkeypatch):
    """A helper's audit of `dar generate`: a truncated safetensors file, a config its class refuses, and weights of
    another vocabulary size ended in tracebacks (only OSError and ValueError were caught); a prompt that is not UTF-8
    (a Latin-1 file, handed over as lone surrogates) in a TypeError traceback, or blamed on the chat template; a
    folder spelled "~/..." (quoted) passed the folder check and then went to the Hub with the literal name."""
    source = save_source(tmp_path / "source")
    broken = {}
    for damage in ("truncated", "heads", "vocab"):
        folder = tmp_path / damage
        shutil.copytree(source, folder)
        broken[damage] = folder
    weights = broken["truncated"] / "model.safetensors"
    weights.write_bytes(weights.read_bytes()[:100])
    edit_json(broken["heads"] / "config.json", num_attention_heads=5)
    edit_json(broken["vocab"] / "config.json", vocab_size=400)
    for damage, folder in broken.items():
        capsys.readouterr()
        assert cli_main(["generate", str(folder), "--max-new-tokens", "1"]) == 1, damage
        error = capsys.readouterr().err.strip().splitlines()[-1]
        assert error.startswith(f"dar generate: error: cannot load {folder}: ") and "Traceback" not in error, error
    for flags in ((), ("--no-chat-template",)):
        assert cli_main(["generate", str(source), "--prompt", "caf\udce9", "--max-new-tokens", "1", *flags]) == 1
        assert capsys.readouterr().err.strip() == ("dar generate: error: --prompt is not UTF-8 text (byte 0xe9 at "
                                                   "character 3); pass the prompt in UTF-8")
    monkeypatch.setenv("HOME", str(tmp_path))
    assert cli_main(["generate", "~/source", "--prompt", "Hello", "--max-new-tokens", "1"]) == 0


@pytest.mark.parametrize("flags, error", [
    (["--experts", "2", "--top-k", "1", "--decoder-sparse-step", "5"],
     "--decoder-sparse-step: DARMoeConfig.mlp_only_layers and decoder_sparse_step leave no sparse layer"),
    (["--routing", "dar", "--streams", "1"],
     "--routing and --streams: DARConfig.dar_routing and dar_num_streams: with dar_num_streams=1 dar_routing must be"),
    (["--expert-noise", "0.5"], "Upcycling a dense llama model needs num_experts and top_k"),
])
def test_dar_convert_refusals_name_the_flags_given_and_nothing_else(tmp_path, capsys, caplog, flags, error):
    """`--decoder-sparse-step 5` was refused as `--mlp-only-layers: ...` (a flag not given); `--routing dar --streams
    1` named neither the stream count nor its flag; with `--expert-noise`, every refusal (a missing --experts, a bad
    --block-size) came after a warning that the converted model "is NOT function-preserving"."""
    source = save_source(tmp_path / "source")
    capsys.readouterr()
    assert cli_main(["convert", str(source), str(tmp_path / "out"), *flags]) == 1
    printed = capsys.readouterr().err.strip()
    assert printed.startswith(f"dar convert: error: {error}") and len(printed.splitlines()) == 1, printed
    assert "NOT function-preserving" not in caplog.text and not (tmp_path / "out").exists()


def test_mlp_only_layers_listing_a_layer_twice_is_refused(tmp_path, capsys):
    with pytest.raises(SystemExit):
        cli_main(["convert", str(tmp_path / "source"), str(tmp_path / "out"), "--experts", "2", "--top-k", "1",
                  "--mlp-only-layers", "0,2,0"])
    assert "argument --mlp-only-layers: '0,2,0' lists layer 0 more than once" in capsys.readouterr().err


def test_a_quoted_home_folder_is_the_home_folder_as_dar_generate_reads_it(tmp_path, monkeypatch, capsys):
    """`dar convert SRC "~/model-dar"` (quoted, so the shell left the tilde) wrote `./~/model-dar`, a folder named "~"
    in the working directory, which `dar generate "~/model-dar"` then did not find."""
    home, work = tmp_path / "home", tmp_path / "work"
    home.mkdir(), work.mkdir()
    save_source(home / "source")
    monkeypatch.setenv("HOME", str(home))
    monkeypatch.chdir(work)
    assert cli_main(["convert", "~/source", "~/model-dar", "--max-new-tokens", "1"]) == 0
    assert (home / "model-dar" / "config.json").is_file() and list(work.iterdir()) == []
    assert cli_main(["generate", "~/model-dar", "--max-new-tokens", "2"]) == 0


@pytest.mark.parametrize("error, refused", [
    (RuntimeError("[enforce fail at alloc_cpu.cpp:121] data. DefaultCPUAllocator: can't allocate memory: you tried to "
                  "allocate 5000000000 bytes. Error code 12 (Cannot allocate memory)"), True),
    (MemoryError(), True),
    (RuntimeError("a defect of the package"), False),
], ids=["torch_allocator", "python", "other_runtime_error"])
def test_running_out_of_memory_is_one_line_saying_nothing_was_written(tmp_path, monkeypatch, capsys, error, refused):
    """Out of memory in the verification (a machine with less than the conversion needs): a torch traceback and exit
    1, the same code as a user error, with nothing saying whether the output was written. Now one line (the staging
    folder is removed either way); any other RuntimeError is a defect and keeps its traceback."""
    from dar_transformers.conversion import api

    source = save_source(tmp_path / "source")

    def exhausted(*args, **keywords):
        raise error

    monkeypatch.setattr(api, "verify_written", exhausted)
    if not refused:
        with pytest.raises(RuntimeError, match="a defect of the package"):
            cli_main(["convert", str(source), str(tmp_path / "out")])
    else:
        assert cli_main(["convert", str(source), str(tmp_path / "out")]) == 1
        message = capsys.readouterr().err.strip().splitlines()[-1]
        assert message.startswith("dar convert: error: out of memory (") and "nothing was written" in message
    assert sorted(path.name for path in tmp_path.iterdir()) == ["source"]


def test_an_empty_source_or_model_name_is_refused_not_read_as_the_working_folder(tmp_path, capsys, monkeypatch):
    """`dar convert "$SRC" out` with SRC unset converted the folder it ran in (Path("") is "."), and elsewhere said the
    output "lies inside the source folder"; `dar analyze ""` named an empty model. Both are refused as empty paths,
    nothing written, even from inside a model folder."""
    model = save_source(tmp_path / "model")
    monkeypatch.chdir(model)
    before = sorted(path.name for path in model.iterdir())
    assert cli_main(["convert", "", str(tmp_path / "out")]) == 1
    assert capsys.readouterr().err.strip().splitlines()[-1] == (
        "dar convert: error: The source is an empty path (an unset shell variable?); name the model folder or .gguf "
        "file to convert.")
    assert not (tmp_path / "out").exists() and sorted(path.name for path in model.iterdir()) == before
    (tmp_path / "text.txt").write_text("Hello world, tiny models")
    assert cli_main(["analyze", "", "--text", str(tmp_path / "text.txt"), "--out", str(tmp_path / "analysis")]) == 1
    assert "the model is an empty path (an unset shell variable?)" in capsys.readouterr().err
    assert not (tmp_path / "analysis").exists()
