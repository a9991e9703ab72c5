# SPDX-License-Identifier: Apache-2.0
"""The output folder (CPU): an existing output is refused unless overwrite, and never inside the source; a mount point
is refused before any work; an existing empty folder's mode, owner and group carry over to the output."""

import json
import os
import re
import shutil
import stat
import subprocess
import sys
import tempfile
from pathlib import Path

import pytest

from dar_transformers.conversion import api as api_module
from dar_transformers.conversion import output as output_module
from dar_transformers.conversion import upcycle
from dar_transformers.conversion.output import MANIFEST_NAME, check_output_folder, not_a_conversion_output

from conftest import FAST, run_convert_in_process, save_source


def test_existing_output_is_refused_unless_overwrite(tmp_path):
    source = save_source(tmp_path / "source")
    out = tmp_path / "out"
    out.mkdir()
    (out / "keep.txt").write_text("user data")
    with pytest.raises(FileExistsError, match="exists and is not empty.*--overwrite"):
        upcycle(source, out, progress=False)
    assert [p.name for p in out.iterdir()] == ["keep.txt"]
    with pytest.raises(FileExistsError, match="not a previous conversion output"):  # --overwrite replaces only those
        upcycle(source, out, overwrite=True, progress=False)
    assert [p.name for p in out.iterdir()] == ["keep.txt"]
    (out / "keep.txt").unlink()
    upcycle(source, out, tolerance=1e-5, **FAST)  # an empty folder is replaced by the output
    first = json.loads((out / MANIFEST_NAME).read_text())
    upcycle(source, out, overwrite=True, tolerance=1e-5, **FAST)  # a previous conversion output, as written
    second = json.loads((out / MANIFEST_NAME).read_text())
    assert (out / "model.safetensors.index.json").is_file() and first["files"].keys() == second["files"].keys()
    assert first["files"]["config.json"]["mtime_ns"] != second["files"]["config.json"]["mtime_ns"]  # written anew
    assert sorted(p.name for p in tmp_path.iterdir()) == ["out", "source"]  # nothing retired or staged is left
    with pytest.raises(ValueError, match="lies inside the source"):
        upcycle(source, source / "dar", progress=False)


def test_the_working_folder_as_output_is_refused_before_any_work(tmp_path, monkeypatch):
    """`mkdir out && cd out && dar convert ../source .`: the swap renamed a new folder over the empty one, leaving the
    shell in a removed folder (`ls` showed nothing, the output lay in its parent under the same name). Refused, empty
    or a previous output with overwrite, naming what to do; a folder inside the working folder is fine."""
    source = save_source(tmp_path / "source")
    out = tmp_path / "out"
    out.mkdir()
    monkeypatch.chdir(out)
    for given, overwrite in ((".", False), (str(out), False), ("../out", True)):
        with pytest.raises(ValueError, match=r"is the current working folder: .* Name a new folder, e\.g\. "
                                             r"\./source-dar, or run the command from " + re.escape(str(tmp_path))):
            upcycle(source, given, overwrite=overwrite, progress=False)
        assert list(out.iterdir()) == [] and os.path.samefile(os.getcwd(), out)
    upcycle(source, "dar", tolerance=1e-5, **FAST)
    assert (out / "dar" / "config.json").is_file()
    # `cd out/dar/sub && dar convert ../../../source .. --overwrite`: a working folder inside the output went with it
    (out / "dar" / "sub").mkdir()
    monkeypatch.chdir(out / "dar" / "sub")
    before = sorted(path.name for path in (out / "dar").iterdir())
    with pytest.raises(ValueError, match=r"Output folder \.\. \(resolved: .*dar\) holds the current working folder: "):
        upcycle(source, "..", overwrite=True, progress=False)
    assert sorted(path.name for path in (out / "dar").iterdir()) == before


def _another_device(monkeypatch, folder):
    real_stat = os.stat

    def stat_on_another_device(path, *args, **kwargs):
        status = real_stat(path, *args, **kwargs)
        if os.fspath(path) != str(folder):
            return status
        fields = list(status[:10])
        fields[2] += 1  # st_dev
        return os.stat_result(fields)

    monkeypatch.setattr(os, "stat", stat_on_another_device)


@pytest.mark.parametrize("how", ["os.path.ismount", "st_dev differs from the parent's", "a bind mount (mountinfo)"])
def test_a_mount_point_output_is_refused_before_any_work(tmp_path, monkeypatch, how):
    """The staging folder is written beside the output and renamed into place, which cannot replace a mount point
    (EBUSY, once the whole conversion had run): refused up front, suggesting a folder inside it. No root needed."""
    out = tmp_path / "volume"
    out.mkdir()
    if how == "os.path.ismount":
        ismount = os.path.ismount
        monkeypatch.setattr(os.path, "ismount", lambda path: os.fspath(path) == str(out) or ismount(path))
    elif how == "st_dev differs from the parent's":
        _another_device(monkeypatch, out)
    else:
        monkeypatch.setattr(output_module, "_mount_points", lambda: {str(out)})

    def no_conversion_work(source):
        raise AssertionError("the conversion started before the output was checked")

    monkeypatch.setattr(api_module, "load_source_config", no_conversion_work)
    with pytest.raises(ValueError, match=(
            rf"Output folder {re.escape(str(out))} is a mount point .* the conversion writes a staging folder beside "
            rf"the output, in {re.escape(str(tmp_path))}, .* Choose a new folder inside it, e.g. "
            rf"{re.escape(str(out / 'source-dar'))}\.")):
        upcycle(tmp_path / "source", out, progress=False)
    assert sorted(path.name for path in tmp_path.iterdir()) == ["volume"] and list(out.iterdir()) == []


@pytest.mark.skipif(os.geteuid() != 0 or shutil.which("mount") is None, reason="needs root and mount(8)")
@pytest.mark.parametrize("kind", ["tmpfs", "bind"])
def test_a_real_mount_point_output_is_refused(tmp_path, kind):
    out, elsewhere = tmp_path / "volume", tmp_path / "elsewhere"
    out.mkdir()
    elsewhere.mkdir()
    arguments = ["-t", "tmpfs", "-o", "size=1m", "tmpfs"] if kind == "tmpfs" else ["--bind", str(elsewhere)]
    mounted = subprocess.run(["mount", *arguments, str(out)], capture_output=True)
    if mounted.returncode != 0:
        pytest.skip(f"cannot mount here ({mounted.stderr.decode().strip()})")
    try:
        with pytest.raises(ValueError, match="is a mount point"):
            check_output_folder(out, False, tmp_path / "source")
        assert check_output_folder(out / "dar", False, tmp_path / "source") == out / "dar"  # inside it is fine
    finally:
        subprocess.run(["umount", str(out)], check=True)
    assert check_output_folder(out, False, tmp_path / "source") == out  # the folder itself, unmounted: fine


def test_an_existing_empty_output_folder_keeps_its_mode_owner_and_group(tmp_path):
    """A folder prepared for the output (group-shared, setgid) is replaced by the new one in one rename; the new one
    takes its permission bits, setgid included, and its owner and group (as root: another user's), and in a setgid
    folder its content takes the group too. The manifest still holds (chown and chmod leave the times alone)."""
    source = save_source(tmp_path / "source")
    out = tmp_path / "shared"
    out.mkdir()
    if os.geteuid() == 0:
        os.chown(out, 1234, 5678)
    os.chmod(out, 0o2750)  # after chown, which clears setgid
    before = os.stat(out)
    upcycle(source, out, tolerance=1e-5, **FAST)
    after = os.stat(out)
    assert (oct(stat.S_IMODE(after.st_mode)), after.st_uid, after.st_gid) == ("0o2750", before.st_uid, before.st_gid)
    assert {os.lstat(path).st_gid for path in out.rglob("*")} == {before.st_gid}
    assert all(os.lstat(path).st_mode & stat.S_ISGID for path in out.rglob("*") if path.is_dir())
    assert not_a_conversion_output(out) is None
    upcycle(source, out, overwrite=True, tolerance=1e-5, **FAST)  # a previous output replaced keeps them too
    assert (oct(stat.S_IMODE(os.stat(out).st_mode)), os.stat(out).st_gid) == ("0o2750", before.st_gid)


def test_an_output_path_that_is_not_utf8_is_refused_before_any_work(tmp_path):
    """An output named with bytes that are not UTF-8 (`$'out\\xff'` in a shell): the whole conversion ran, then the
    tokenizer's (Rust) writer refused the path with "'utf-8' codec can't encode character '\\udcff' ... surrogates not
    allowed", naming no file. Refused up front, naming the output."""
    source = save_source(tmp_path / "source")
    out = tmp_path / os.fsdecode(b"out\xff")
    with pytest.raises(ValueError, match=r"Output '.*out\\udcff' is not a valid UTF-8 path"):
        check_output_folder(out, overwrite=False, source=source)
    with pytest.raises(ValueError, match="is not a valid UTF-8 path"):
        upcycle(source, out, **FAST)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["source"]


@pytest.mark.parametrize("given", ["", " "])
def test_an_empty_output_path_is_refused_not_taken_for_the_current_folder(tmp_path, monkeypatch, given):
    """`dar convert SRC "$OUT"` with OUT unset resolved "" to the current folder: written into it when empty, replaced
    with --overwrite when it was a previous output. Refused, naming what was given; the current folder is untouched."""
    source = save_source(tmp_path / "source")
    monkeypatch.chdir(tmp_path / "source")
    with pytest.raises(ValueError, match="is an empty path"):
        check_output_folder(given, overwrite=True, source=source)
    empty = tmp_path / "empty"
    empty.mkdir()
    monkeypatch.chdir(empty)
    with pytest.raises(ValueError, match="is an empty path"):
        upcycle(source, given, **FAST)
    assert list(empty.iterdir()) == []


def test_a_staging_folder_of_a_live_run_whose_process_id_means_nothing_here_is_left_alone(tmp_path, caplog):
    """A run in another container sharing the parent folder and the host name, with its own process ids: its marker
    names a process id that is no process here. The next run removed that live run's staging folder, since stale
    meant "process gone" alone; the run holds its marker locked (flock) while the folder is its own, so it is left
    alone until the lock is released, then removed."""
    output = tmp_path / "out"
    staging = output_module._marked_folder(output, output_module.STAGING_SUFFIX)  # held, as a running conversion does
    descriptor = output_module._MARKER_LOCKS.pop(staging)  # another process's (its own folders a run does not probe)
    (staging / "model-00001-of-00002.safetensors").write_bytes(b"being written")
    finished = subprocess.Popen(["true"])
    finished.wait()
    marker = staging / output_module.STAGING_MARKER
    marker.write_text(json.dumps({**json.loads(marker.read_text()), "pid": finished.pid}))  # another namespace's id
    try:
        assert output_module.remove_stale_runs(tmp_path) == []
        assert (staging / "model-00001-of-00002.safetensors").read_bytes() == b"being written"
        assert f"{staging} belongs to a conversion that may still be running (process {finished.pid}" in caplog.text
    finally:
        os.close(descriptor)  # the run ends without cleaning up (SIGKILL): now stale
    assert output_module.remove_stale_runs(tmp_path) == [staging] and not staging.exists()


AS_A_USER = pytest.mark.skipif(os.geteuid() == 0 and shutil.which("setpriv") is None,
                               reason="as root, permission bits need util-linux's setpriv to take effect")
# Root's permission rules without its override of them (a normal user's), for a subprocess.
DROP_OVERRIDES = ["setpriv", "--bounding-set=-dac_override,-dac_read_search,-fowner"] if os.geteuid() == 0 else []


@AS_A_USER
def test_an_output_the_swap_could_not_make_is_refused_before_any_work(tmp_path):
    """`dar convert SRC out --overwrite` over a previous output its owner made read-only (chmod 555): the swap cannot
    move that folder aside (moving a folder to another parent needs write permission on it), which was found only at
    the swap, after the whole conversion (hours at 8B). A read-only parent was refused at once but named the hidden
    staging folder the run had tried to create (`.out.XXXXXXXX.partial`), not the folder to fix. Both are refused
    before anything is read or created, naming the folder and its mode."""
    source = save_source(tmp_path / "source")
    out = tmp_path / "out"
    env = {**os.environ, "OMP_NUM_THREADS": "1", "HF_HUB_OFFLINE": "1"}

    def convert(output, *flags):
        return subprocess.run([*DROP_OVERRIDES, sys.executable, "-m", "dar_transformers.cli", "convert", str(source),
                               str(output), "--max-new-tokens", "1", *flags], env=env, stdin=subprocess.DEVNULL,
                              capture_output=True, text=True, timeout=300)

    assert convert(out).returncode == 0
    before = {path.name: path.read_bytes() for path in out.iterdir()}
    read_only = tmp_path / "read-only"
    read_only.mkdir()
    for folder in (out, read_only):
        os.chmod(folder, 0o555)
    try:
        failed = convert(out, "--overwrite")
        assert failed.returncode == 1, failed.stderr
        assert (f"Output folder {out} is not writable (mode dr-xr-xr-x" in failed.stderr
                and "Make it writable" in failed.stderr and "Verifying" not in failed.stderr), failed.stderr
        for output in (read_only / "out", read_only / "new" / "deeper" / "out"):
            failed = convert(output)
            assert failed.returncode == 1 and "partial" not in failed.stderr, failed.stderr
            assert f"the folder {read_only} is not writable (mode dr-xr-xr-x" in failed.stderr, failed.stderr
        assert sorted(path.name for path in tmp_path.iterdir()) == ["out", "read-only", "source"]
        assert list(read_only.iterdir()) == []
        assert {path.name: path.read_bytes() for path in out.iterdir()} == before
    finally:
        for folder in (out, read_only):
            os.chmod(folder, 0o755)


@AS_A_USER
def test_a_failed_swap_with_a_read_only_output_leaves_no_staging_copy(tmp_path):
    """An output made read-only after the last check, just before the swap (a race `check_output_folder` cannot
    close): the swap cannot move it aside and the run fails with it unchanged. The staging folder, holding the complete
    new model, had already taken over mode 555, so its removal failed silently and it stayed behind without a marker,
    which no later run removed (16 GB at 8B) while the error said "nothing was written"."""
    out = tmp_path / "out"
    out.mkdir()
    script = f"""
import os
from pathlib import Path
from dar_transformers.conversion import output as output_module

out = Path({str(out)!r})
refuse = output_module._refuse_unwritable
checks = []

def checked(*arguments):  # the last check passes: the folder becomes read-only after it
    checks.append(arguments)
    if len(checks) == 1:
        refuse(*arguments)

def write(staging):
    (staging / "model.safetensors").write_bytes(b"weights")
    os.chmod(out, 0o555)

output_module._refuse_unwritable = checked
try:
    output_module.write_repo_folder(out, write, overwrite=False)
except OSError as error:
    print(error)
"""
    try:
        run = subprocess.run([*DROP_OVERRIDES, sys.executable, "-c", script], capture_output=True, text=True,
                             timeout=120)
    finally:
        os.chmod(out, 0o755)
    assert "Permission denied" in run.stdout and "nothing was written" in run.stdout, run.stdout + run.stderr
    assert sorted(path.name for path in tmp_path.iterdir()) == ["out"] and list(out.iterdir()) == []


def test_parent_folders_made_before_one_that_fails_are_removed(tmp_path):
    """`dar convert SRC new/<300-character name>/out`: `new` was made, the next folder failed (name too long), and the
    run said "nothing was written" with `new` left behind (so would a disk filling up between two folders)."""
    source = save_source(tmp_path / "source")
    out = tmp_path / "new" / ("x" * 300) / "out"
    code, stderr = run_convert_in_process(source, out, "--max-new-tokens", "1", cwd=tmp_path)
    assert code == 1 and "File name too long" in stderr and "nothing was written" in stderr
    assert sorted(path.name for path in tmp_path.iterdir()) == ["source"]


def test_an_output_name_too_long_to_stage_beside_is_refused_naming_the_limit(tmp_path):
    """A 240-character output name is legal, but the staging folder beside it (the name plus 18 characters) is not:
    the run failed after starting, with "File name too long" naming the hidden staging folder."""
    source = save_source(tmp_path / "source")
    limit = os.pathconf(tmp_path, "PC_NAME_MAX")
    code, stderr = run_convert_in_process(source, tmp_path / ("x" * (limit - 15)), "--max-new-tokens", "1",
                                          cwd=tmp_path)
    assert code == 1 and f"choose a name of at most {limit - 18} bytes" in stderr and ".partial" not in stderr
    assert sorted(path.name for path in tmp_path.iterdir()) == ["source"]
    code, stderr = run_convert_in_process(source, tmp_path / ("y" * (limit - 18)), "--max-new-tokens", "1",
                                          cwd=tmp_path)
    assert code == 0, stderr[-2000:]


@pytest.mark.skipif(os.geteuid() != 0 or shutil.which("setpriv") is None,
                    reason="needs root to make another user's folder, and util-linux's setpriv to run as another user")
def test_another_users_folder_in_a_sticky_folder_is_refused_before_any_work(tmp_path):
    """In a sticky world-writable folder (/tmp, shared scratch) only an entry's owner (or the folder's) may rename or
    replace it: an empty mode-777 folder of another user as output (or another user's previous output with
    --overwrite) passed the writability checks and failed at the swap, after the whole conversion (a helper's
    repro). Refused before any work, naming the owner and the sticky bit; run as user 65534 (nobody)."""
    sticky = Path(tempfile.mkdtemp(prefix="dar-sticky-", dir="/tmp"))
    try:
        os.chmod(sticky, 0o1777)
        source = save_source(sticky / "source")
        for path in [source, *source.rglob("*")]:
            os.chmod(path, 0o755 if path.is_dir() else 0o644)
        (sticky / "out").mkdir(mode=0o777)
        os.chmod(sticky / "out", 0o777)
        env = {**os.environ, "OMP_NUM_THREADS": "1", "HF_HUB_OFFLINE": "1", "HF_HOME": str(sticky / "hf")}
        failed = subprocess.run(["setpriv", "--reuid=65534", "--regid=65534", "--clear-groups", sys.executable, "-m",
                                 "dar_transformers.cli", "convert", str(source), str(sticky / "out"),
                                 "--max-new-tokens", "1"], env=env, stdin=subprocess.DEVNULL, capture_output=True,
                                text=True, timeout=300)
        assert failed.returncode == 1, failed.stderr
        assert (f"Output folder {sticky / 'out'} belongs to user 0, in {sticky}, whose sticky bit" in failed.stderr
                and "Verifying" not in failed.stderr and "Writing" not in failed.stderr), failed.stderr
        assert sorted(path.name for path in sticky.iterdir()) == ["out", "source"] and not any((sticky / "out").iterdir())
    finally:
        shutil.rmtree(sticky)


def test_an_in_memory_model_is_never_written_over_the_folder_it_was_loaded_from(tmp_path):
    """A model loaded with `from_pretrained(folder)` and converted in memory into that folder replaced the checkpoint
    it came from (a dense DAR model upcycled to DAR-MoE with overwrite=True: the dense folder was gone), or wrote
    into it, where the path form refuses both; its `config.name_or_path` is the folder, protected the same way."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from dar_transformers.conversion import upcycle_to_dar_moe

    source = save_source(tmp_path / "source")
    out = tmp_path / "out"
    upcycle(source, out, dar_block_size=2, **FAST)
    before = {path.name: path.read_bytes() for path in out.iterdir() if path.is_file()}
    dar = AutoModelForCausalLM.from_pretrained(out)
    tokenizer = AutoTokenizer.from_pretrained(out)
    with pytest.raises(ValueError, match=r"is the source folder .*the folder the in-memory model was loaded from"):
        upcycle_to_dar_moe(dar, out, num_experts=2, top_k=1, tokenizer=tokenizer, overwrite=True, **FAST)
    assert {path.name: path.read_bytes() for path in out.iterdir() if path.is_file()} == before
    llama = AutoModelForCausalLM.from_pretrained(source)
    with pytest.raises(ValueError, match=r"lies inside the source folder .*the in-memory model was loaded from"):
        upcycle(llama, source / "dar", tokenizer=tokenizer, **FAST)
    assert not (source / "dar").exists()
    llama.config.name_or_path = ""  # built from a config: no folder to protect
    upcycle(llama, tmp_path / "elsewhere", tokenizer=tokenizer, **FAST)
    assert (tmp_path / "elsewhere" / "config.json").is_file()


def test_an_in_memory_model_loaded_from_a_gguf_file_leaves_the_rest_of_its_folder_free(tmp_path):
    """transformers names a model loaded with `gguf_file=` by the folder that holds the file: the whole folder was
    protected (an output beside the file refused), where the path form protects the file alone. The folder itself
    stays protected; an output inside it is written."""
    from transformers import AutoModelForCausalLM

    from conftest import make_source, make_tokenizer, write_tiny_gguf

    folder = tmp_path / "models"
    folder.mkdir()
    gguf = write_tiny_gguf(folder / "tiny.gguf", make_source("llama", True), make_tokenizer())
    model = AutoModelForCausalLM.from_pretrained(folder, gguf_file=gguf.name)
    with pytest.raises(ValueError, match="is the source folder"):
        upcycle(model, folder, tokenizer=make_tokenizer(), overwrite=True, **FAST)
    upcycle(model, folder / "tiny-dar", tokenizer=make_tokenizer(), tolerance=1e-4, **FAST)
    assert (folder / "tiny-dar" / "config.json").is_file() and gguf.is_file()
