# SPDX-License-Identifier: Apache-2.0
"""--overwrite replaces only what a conversion wrote (CPU). A conversion writes, last, a manifest of every file (size,
st_mtime_ns) and folder in its output; a folder holding anything the manifest does not list, missing anything it
lists, or with a listed file changed, is refused and kept byte for byte, whatever the files' times say (mv, cp -a and
tar keep old times; a model card edited after training is newer than the weights). A genuine previous output, or a
copy of it that keeps the times (cp -a), is still replaced, and gets a new manifest."""

import json
import os
import shutil

import pytest
from transformers import AutoModelForCausalLM

from dar_transformers.conversion import convert, output as output_module, upcycle_to_dar_moe
from dar_transformers.conversion.output import (
    MANIFEST_NAME, STAGING_MARKER, not_a_conversion_output, remove_stale_runs, write_manifest,
)

from conftest import FAST, make_source, make_tokenizer, run_convert_in_process, save_source


@pytest.fixture(scope="module")
def source(tmp_path_factory):
    return save_source(tmp_path_factory.mktemp("manifest") / "source")


@pytest.fixture(scope="module")
def converted(source):
    out = source.parent / "converted"
    code, stderr = run_convert_in_process(source, out, "--max-new-tokens", "0", cwd=source.parent)
    assert code == 0, stderr
    return out


@pytest.fixture
def previous(converted, tmp_path):
    """A previous conversion output of this test's own (copytree's copy2 keeps sizes and times, as cp -a does)."""
    out = tmp_path / "out"
    shutil.copytree(converted, out)
    return out


def folder_bytes(folder):
    """Every entry under `folder`, symlinks not followed: file bytes, link targets, folders."""
    state = {}
    for root, folders, files in os.walk(folder):
        for name in folders + files:
            path = os.path.join(root, name)
            key = os.path.relpath(path, folder)
            if os.path.islink(path):
                state[key] = "-> " + os.readlink(path)
            else:
                state[key] = "dir" if os.path.isdir(path) else open(path, "rb").read()
    return state


def overwrite(source, out):
    return run_convert_in_process(source, out, "--overwrite", "--max-new-tokens", "0", cwd=out.parent)


def assert_refused_and_kept(source, out, reason):
    before = folder_bytes(out)
    code, stderr = overwrite(source, out)
    assert code == 1 and len(stderr.strip().splitlines()) == 1, stderr
    assert "is not a previous conversion output" in stderr and reason in stderr, stderr
    assert folder_bytes(out) == before
    assert sorted(path.name for path in out.parent.iterdir() if path.name.startswith(".")) == []  # nothing staged


def test_the_manifest_lists_every_file_and_folder_the_conversion_wrote(converted):
    manifest = json.loads((converted / MANIFEST_NAME).read_text())
    files = {path.relative_to(converted).as_posix(): path.stat() for path in converted.rglob("*") if path.is_file()}
    files.pop(MANIFEST_NAME)
    assert manifest["files"] == {name: {"size": status.st_size, "mtime_ns": status.st_mtime_ns}
                                 for name, status in files.items()}
    assert {"config.json", "README.md", "model.safetensors.index.json", "tokenizer.json"} <= manifest["files"].keys()
    folders = sorted(path.relative_to(converted).as_posix() for path in converted.rglob("*") if path.is_dir())
    assert manifest["folders"] == folders
    assert not_a_conversion_output(converted) is None


def test_overwrite_replaces_a_previous_output_and_writes_its_manifest_again(source, previous):
    """The negative control: a previous conversion output (here a cp -a copy of one) is replaced, every time."""
    for _ in range(2):
        manifest_before = json.loads((previous / MANIFEST_NAME).read_text())
        code, stderr = overwrite(source, previous)
        assert code == 0, stderr
        manifest = json.loads((previous / MANIFEST_NAME).read_text())
        assert manifest["files"].keys() == manifest_before["files"].keys() and manifest != manifest_before
        assert not_a_conversion_output(previous) is None
    assert sorted(path.name for path in previous.parent.iterdir()) == ["out"]  # nothing retired or staged is left


def _move_in_user_files(out):
    """mv from elsewhere keeps the files' times, older than the conversion's card."""
    elsewhere = out.parent / "elsewhere"
    (elsewhere / "adapter").mkdir(parents=True)
    (elsewhere / "my_notes.txt").write_text("weeks of work")
    (elsewhere / "adapter" / "adapter_model.safetensors").write_bytes(b"x" * 100)
    old = (out / "config.json").stat().st_mtime_ns - 86400 * 10**9
    for path in ("my_notes.txt", "adapter/adapter_model.safetensors", "adapter"):
        os.utime(elsewhere / path, ns=(old, old))
    os.rename(elsewhere / "my_notes.txt", out / "my_notes.txt")
    os.rename(elsewhere / "adapter", out / "adapter")
    elsewhere.rmdir()


def _trainer_checkpoint(out):
    (out / "checkpoint-500").mkdir()
    (out / "checkpoint-500" / "trainer_state.json").write_text("{}")
    old = (out / "config.json").stat().st_mtime_ns - 10**9
    os.utime(out / "checkpoint-500" / "trainer_state.json", ns=(old, old))


def _symlink_to_user_data(out):
    (out.parent / "data").mkdir()
    (out.parent / "data" / "corpus.txt").write_text("user data")
    (out / "data").symlink_to(out.parent / "data", target_is_directory=True)


@pytest.mark.parametrize("added, reason", [
    (_move_in_user_files, "not written by the conversion: adapter, my_notes.txt)"),
    (_trainer_checkpoint, "not written by the conversion: checkpoint-500)"),
    (_symlink_to_user_data, "not written by the conversion: data)"),
])
def test_overwrite_refuses_anything_added_whatever_its_times(source, previous, added, reason):
    added(previous)
    assert_refused_and_kept(source, previous, reason)
    if (previous.parent / "data").exists():  # the symlink was not followed
        assert (previous.parent / "data" / "corpus.txt").read_text() == "user data"


def _saved_again_then_card_edited(out):
    """Fine-tuned and saved back in place, then a note added to the card (which is then the newest file)."""
    AutoModelForCausalLM.from_pretrained(out).save_pretrained(out)
    with open(out / "README.md", "a") as card:
        card.write("\n## Fine-tuning\n\nThree days on our data.\n")


def _card_edited(out):
    with open(out / "README.md", "a") as card:
        card.write("\nMy notes.\n")


def _same_bytes_written_again(out):
    (out / "config.json").write_bytes((out / "config.json").read_bytes())


def _shard_removed(out):
    (out / "model-00001-of-00002.safetensors").unlink()


def _file_replaced_by_a_symlink_to_its_copy(out):
    shutil.copy2(out / "tokenizer.json", out.parent / "tokenizer.json")  # same size and time
    (out / "tokenizer.json").unlink()
    (out / "tokenizer.json").symlink_to(out.parent / "tokenizer.json")


@pytest.mark.parametrize("change, reason", [
    (_saved_again_then_card_edited, "not written by the conversion: model.safetensors"),
    (_card_edited, "changed since the conversion wrote it: README.md)"),
    (_same_bytes_written_again, "changed since the conversion wrote it: config.json)"),
    (_shard_removed, "missing since the conversion wrote it: model-00001-of-00002.safetensors)"),
    (_file_replaced_by_a_symlink_to_its_copy, "changed since the conversion wrote it: tokenizer.json)"),
])
def test_overwrite_refuses_an_output_changed_since_the_conversion(source, previous, change, reason):
    change(previous)
    assert_refused_and_kept(source, previous, reason)


def _manifest_deleted(out):  # also what an output of a version before the manifest looks like
    (out / MANIFEST_NAME).unlink()


def _manifest_garbled(out):
    (out / MANIFEST_NAME).write_text("{not json")


def _manifest_of_another_format(out):
    manifest = json.loads((out / MANIFEST_NAME).read_text())
    (out / MANIFEST_NAME).write_text(json.dumps({**manifest, "format": 99}))


def _manifest_a_symlink(out):
    os.rename(out / MANIFEST_NAME, out.parent / "manifest.json")
    (out / MANIFEST_NAME).symlink_to(out.parent / "manifest.json")


@pytest.mark.parametrize("damage, reason", [
    (_manifest_deleted, f"no {MANIFEST_NAME}, the list of the files a conversion wrote (an output of a "
                        "dar-transformers version that wrote none, or one whose list was deleted)"),
    (_manifest_garbled, f"{MANIFEST_NAME} or the folder cannot be read"),
    (_manifest_of_another_format, "has format 99"),
    (_manifest_a_symlink, f"{MANIFEST_NAME} is not a plain file"),
])
def test_overwrite_refuses_an_output_without_a_readable_manifest(source, previous, damage, reason):
    damage(previous)
    assert_refused_and_kept(source, previous, reason)


def test_a_user_folder_without_manifest_or_dar_config_names_both(tmp_path):
    (tmp_path / "notes.txt").write_text("user data")
    assert not_a_conversion_output(tmp_path) == (
        f"no {MANIFEST_NAME}, and no config.json with model_type 'dar' or 'dar_moe'")


def test_a_subfolder_the_conversion_wrote_counts_and_one_added_later_does_not(tmp_path):
    """transformers saves named chat templates in additional_chat_templates/: listed with its files."""
    (tmp_path / "config.json").write_text(json.dumps({"model_type": "dar"}))
    (tmp_path / "additional_chat_templates").mkdir()
    (tmp_path / "additional_chat_templates" / "tool_use.jinja").write_text("{{ messages }}")
    write_manifest(tmp_path)
    assert not_a_conversion_output(tmp_path) is None
    (tmp_path / "additional_chat_templates" / "mine.jinja").write_text("{{ messages }}")
    assert not_a_conversion_output(tmp_path) == (
        "not written by the conversion: additional_chat_templates/mine.jinja")
    (tmp_path / "additional_chat_templates" / "mine.jinja").unlink()
    (tmp_path / "config.json").write_text(json.dumps({"model_type": "llama"}))
    os.utime(tmp_path / "config.json", ns=(0, 0))
    assert not_a_conversion_output(tmp_path) == "changed since the conversion wrote it: config.json"


@pytest.mark.parametrize("how", ["cli --kind dar", "cli --experts", "api upcycle_to_dar_moe", "api convert in-memory"])
def test_every_written_output_has_a_manifest_and_can_be_overwritten(source, tmp_path, how):
    out = tmp_path / "out"
    for again in (False, True):
        if how.startswith("cli"):
            flags = ["--kind", "dar"] if how == "cli --kind dar" else ["--experts", "2", "--top-k", "1"]
            code, stderr = run_convert_in_process(source, out, *flags, "--max-new-tokens", "0",
                                                  *(["--overwrite"] if again else []), cwd=tmp_path)
            assert code == 0, stderr
        elif how == "api upcycle_to_dar_moe":
            upcycle_to_dar_moe(source, out, num_experts=2, top_k=1, overwrite=again, **FAST)
        else:
            convert(make_source(), out, tokenizer=make_tokenizer(), overwrite=again, **FAST)
        assert (out / MANIFEST_NAME).is_file() and not_a_conversion_output(out) is None


def test_a_file_written_into_the_output_during_the_swap_is_kept_not_removed(source, previous, monkeypatch, caplog):
    """The output is checked just before the swap, but a process saving into it (a Trainer's checkpoint) may write
    between that check and the rename: the replaced folder is checked again after the swap, and, changed, kept
    (unmarked, so no later run removes it) with a warning naming it, instead of removed with the new file in it."""
    take_over = output_module._take_over_metadata

    def written_meanwhile(staging, existing):  # runs after the last check, just before the rename
        (previous / "late-checkpoint.bin").write_bytes(b"weights saved meanwhile")
        take_over(staging, existing)

    monkeypatch.setattr(output_module, "_take_over_metadata", written_meanwhile)
    code, stderr = overwrite(source, previous)
    assert code == 0, stderr
    assert not_a_conversion_output(previous) is None and not (previous / "late-checkpoint.bin").exists()
    (kept,) = [path for path in previous.parent.iterdir() if path.name.startswith(f".{previous.name}.")]
    assert (kept / previous.name / "late-checkpoint.bin").read_bytes() == b"weights saved meanwhile"
    assert not (kept / STAGING_MARKER).exists()
    assert remove_stale_runs(previous.parent) == [] and kept.exists()
    assert "changed while it was being replaced (not written by the conversion: late-checkpoint.bin)" in caplog.text
    assert str(kept / previous.name) in caplog.text
