# SPDX-License-Identifier: Apache-2.0
"""`dar convert` never destroys its source or misreports its output (issue 17 items 1, 3, 5, 6): the source/output
relations (same, parent, child, sibling, through symlinks and `..`, with and without --overwrite), OS errors on the
output, signals, stale staging folders and --max-new-tokens, each run through the CLI as a user would, with the
source's bytes hashed before and after. A property test (hypothesis) draws the relations; a handful of subprocess
cases replay the issue's reproductions."""

import contextlib
import errno
import fcntl
import hashlib
import json
import os
import re
import shutil
import signal
import socket
import stat
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest
import torch
from hypothesis import HealthCheck, event, given, settings
from hypothesis import strategies as st
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
from transformers import AutoModelForCausalLM, LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast

from conftest import run_convert_in_process
from dar_transformers.cli import Interrupted
from dar_transformers.conversion import api as api_module
from dar_transformers.conversion import write as conversion_write
from dar_transformers.conversion import output as output_module
from dar_transformers.conversion.output import MANIFEST_NAME, STAGING_MARKER, check_output_folder, write_manifest

# ---------------------------------------------------------------------------------------------------------------
# A tiny Llama source with a tokenizer (1 layer, hidden 16): a conversion in-process takes a fraction of a second.


def save_tiny_source(folder: Path) -> Path:
    tokenizer = Tokenizer(models.BPE(unk_token="<unk>"))
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=270, special_tokens=["<unk>", "<s>", "</s>"], initial_alphabet=pre_tokenizers.ByteLevel.alphabet()
    )
    tokenizer.train_from_iterator(["hello world"] * 3, trainer)
    torch.manual_seed(0)
    config = LlamaConfig(vocab_size=272, hidden_size=16, intermediate_size=32, num_hidden_layers=1,
                         num_attention_heads=2, num_key_value_heads=1, bos_token_id=1, eos_token_id=2)
    LlamaForCausalLM(config).save_pretrained(folder)
    PreTrainedTokenizerFast(tokenizer_object=tokenizer, bos_token="<s>", eos_token="</s>", unk_token="<unk>").save_pretrained(folder)
    return folder


@pytest.fixture(scope="module")
def tiny_source(tmp_path_factory) -> Path:
    return save_tiny_source(tmp_path_factory.mktemp("tiny") / "source")


def tree_state(root: Path, skip: Path | None = None) -> dict[str, str]:
    """Every entry under `root` (symlinks not followed) -> its content hash, link target or "dir"; `skip` left out."""
    state = {}
    for folder, folders, files in os.walk(root):
        for name in folders + files:
            path = Path(folder) / name
            if skip is not None and (path == skip or skip in path.parents):
                continue
            key = str(path.relative_to(root))
            if path.is_symlink():
                state[key] = "-> " + os.readlink(path)
            elif path.is_dir():
                state[key] = "dir"
            else:
                state[key] = hashlib.sha256(path.read_bytes()).hexdigest()
    return state


def source_bytes(source: Path) -> dict[str, str]:
    """Every file of the source (what the converter reads, and more), symlinks followed."""
    return {str(path.relative_to(source)): hashlib.sha256(path.read_bytes()).hexdigest()
            for path in sorted(source.rglob("*")) if path.is_file()}


PROGRESS = re.compile(r"\|\s*\d+/\d+ \[|\d+%\|")


def messages(stderr: str) -> list[str]:
    """The lines a terminal shows on stderr, progress bars left out."""
    visible = [line.split("\r")[-1] for line in stderr.split("\n")]
    return [line for line in visible if line.strip() and not PROGRESS.search(line)]


def dar_command() -> list[str]:
    script = Path(sys.executable).with_name("dar")
    return [str(script)] if script.is_file() else [sys.executable, "-m", "dar_transformers.cli"]


def run_dar(*args, cwd: Path, **popen) -> subprocess.CompletedProcess:
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    return subprocess.run([*dar_command(), *map(str, args)], cwd=cwd, env=env, capture_output=True, text=True,
                          timeout=600, stdin=subprocess.DEVNULL, **popen)


def assert_complete_output(folder: Path) -> None:
    config = json.loads((folder / "config.json").read_text())
    index = json.loads((folder / "model.safetensors.index.json").read_text())
    assert config["model_type"] == "dar"
    assert all((folder / name).is_file() for name in set(index["weight_map"].values()))
    assert {"README.md", "tokenizer.json", "modeling_dar.py"} <= {path.name for path in folder.iterdir()}
    assert not (folder / STAGING_MARKER).exists()
    assert output_module.not_a_conversion_output(folder) is None  # its manifest lists what it holds


def leftovers(parent: Path) -> list[str]:
    return sorted(path.name for path in parent.iterdir() if path.name.endswith((".partial", ".old")))


def written_meanwhile(out: Path, replacing: bool) -> str:
    """The CLI's last line for an output another process wrote while the run worked: found missing or empty at the
    check, or (`replacing`) holding another previous output than the one the run was to replace."""
    found = ("the previous conversion output this run was to replace is not the one there now" if replacing
             else "it was missing or empty when this run checked it")
    return (f"dar convert: error: Output folder {out} was written by another process while this conversion ran "
            f"({found}: another conversion into the same folder?); nothing was written, and the folder was left as it "
            "is.")


# ---------------------------------------------------------------------------------------------------------------
# The reproductions, as a user runs them.


def _reproduction(tmp_path: Path, tiny_source: Path, case: str) -> tuple[Path, list[str]]:
    if case == "output holds the source":  # 1: dar convert /x/proj/src /x/proj --overwrite
        source = tmp_path / "proj" / "src"
        shutil.copytree(tiny_source, source)
        (tmp_path / "proj" / "sibling.txt").write_text("user data")
        return source, [source, tmp_path / "proj", "--overwrite"]
    if case == "output is the source, spelled with ..":  # 2: dar convert /y/src /y/x/../src --overwrite
        source = tmp_path / "src"
        shutil.copytree(tiny_source, source)
        (tmp_path / "x").mkdir()
        return source, [source, f"{tmp_path}/x/../src", "--overwrite"]
    source = tmp_path / "src"  # 3: ln -s /z/src /z/link; dar convert /z/src /z/link/dar
    shutil.copytree(tiny_source, source)
    (tmp_path / "link").symlink_to(source)
    return source, [source, tmp_path / "link" / "dar"]


@pytest.mark.parametrize(
    "case", ["output holds the source", "output is the source, spelled with ..", "output inside the source via a symlink"]
)
def test_cli_refuses_an_output_that_overlaps_the_source(tmp_path, tiny_source, case):
    source, args = _reproduction(tmp_path, tiny_source, case)
    before, source_before = tree_state(tmp_path), source_bytes(source)
    completed = run_dar("convert", *args, cwd=tmp_path)
    assert completed.returncode == 1, completed.stderr[-2000:]
    (line,) = completed.stderr.strip().splitlines()
    assert line.startswith("dar convert: error: Output ") and "the source is never modified" in line
    assert tree_state(tmp_path) == before and source_bytes(source) == source_before


@pytest.mark.parametrize("how", [pytest.param("subprocess", marks=pytest.mark.slow), "in process"])
def test_cli_refuses_negative_max_new_tokens_in_one_line(tmp_path, tiny_source, how):
    args = (tiny_source, tmp_path / "out", "--max-new-tokens", "-5")
    if how == "subprocess":
        completed = run_dar("convert", *args, cwd=tmp_path)
        code, stderr = completed.returncode, completed.stderr
    else:
        code, stderr = run_convert_in_process(*args, cwd=tmp_path)
    assert code == 1
    assert stderr.strip().splitlines() == [
        "dar convert: error: --max-new-tokens must be 0 (no greedy continuations) or more, got -5."
    ]
    assert list(tmp_path.iterdir()) == []


def test_max_new_tokens_zero_reports_no_continuations_truthfully(tmp_path, tiny_source):
    code, stderr = run_convert_in_process(tiny_source, tmp_path / "out", "--max-new-tokens", "0", cwd=tmp_path)
    assert code == 0, stderr
    card = (tmp_path / "out" / "README.md").read_text()
    assert "no full greedy continuations (none asked for: max new tokens 0)" in card
    assert "do not fit in memory" not in card and "Greedy answers to the chat prompt" not in card


# ---------------------------------------------------------------------------------------------------------------
# OS errors on the output: one line, exit code 1, nothing left behind.


@contextlib.contextmanager
def mounted_tmpfs(where: Path, options: str):
    """A tmpfs at `where` (needs root and mount(8); the caller skips otherwise)."""
    where.mkdir()
    mounted = subprocess.run(["mount", "-t", "tmpfs", "-o", options, "tmpfs", str(where)], capture_output=True)
    if mounted.returncode != 0:
        pytest.skip(f"cannot mount a tmpfs here ({mounted.stderr.decode().strip()}); the in-process ENOSPC test covers it")
    try:
        yield where
    finally:
        subprocess.run(["umount", str(where)], check=True)


def _can_mount() -> bool:
    return os.geteuid() == 0 and shutil.which("mount") is not None


@pytest.mark.skipif(not _can_mount(), reason="needs root and mount(8) for a tiny tmpfs")
@pytest.mark.parametrize(  # out of space in the shards, the code files, the tokenizer (a Rust writer)
    "size", ["8k", pytest.param("100k", marks=pytest.mark.slow), pytest.param("140k", marks=pytest.mark.slow)]
)
def test_cli_on_a_full_disk_says_so_in_one_line_and_leaves_nothing(tmp_path, tiny_source, size):
    with mounted_tmpfs(tmp_path / "tiny", f"size={size}") as disk:
        completed = run_dar("convert", tiny_source, disk / "out", "--max-new-tokens", "0", cwd=tmp_path)
        assert completed.returncode == 1, completed.stderr[-2000:]
        (line,) = messages(completed.stderr)
        assert line.startswith(f"dar convert: error: Could not write {disk / 'out'}: No space left on device")
        assert line.endswith("nothing was written.")
        assert list(disk.iterdir()) == []


@pytest.mark.skipif(not _can_mount(), reason="needs root and mount(8) for a read-only tmpfs")
def test_read_only_output_is_one_line_and_leaves_nothing(tmp_path, tiny_source):
    with mounted_tmpfs(tmp_path / "ro", "size=1m,ro") as disk:
        code, stderr = run_convert_in_process(tiny_source, disk / "a" / "out", cwd=tmp_path)
        assert code == 1
        (line,) = messages(stderr)
        assert f"the folder {disk} is not writable (a read-only file system)" in line
        assert list(disk.iterdir()) == []


def test_no_space_simulated_in_process_leaves_nothing(tmp_path, tiny_source, monkeypatch):
    """Runs everywhere: ENOSPC raised (by a monkeypatch) once the staging folder is fully written."""

    def full(folder):
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC), str(folder / "model-00001-of-00002.safetensors"))

    monkeypatch.setattr(output_module, "_apply_umask", full)
    code, stderr = run_convert_in_process(tiny_source, tmp_path / "new" / "deeper" / "out", cwd=tmp_path)
    assert code == 1
    (line,) = messages(stderr)
    assert "Could not write" in line and "No space left on device" in line and "nothing was written" in line
    assert list(tmp_path.iterdir()) == []  # the parent folders it created are gone too


def test_immutable_previous_output_is_refused_before_any_work_and_kept(tmp_path, tiny_source):
    """chattr +i on a previous output: `--overwrite` cannot move it aside, which was found only at the swap, after the
    whole conversion; refused at once now, saying why a folder whose mode allows writing cannot be written."""
    out = tmp_path / "out"
    assert run_convert_in_process(tiny_source, out, "--max-new-tokens", "0", cwd=tmp_path)[0] == 0
    before = tree_state(tmp_path)
    if subprocess.run(["chattr", "+i", str(out)], capture_output=True).returncode != 0:
        pytest.skip("chattr +i needs root on a file system with attributes")
    try:
        code, stderr = run_convert_in_process(tiny_source, out, "--overwrite", "--max-new-tokens", "0", cwd=tmp_path)
    finally:
        subprocess.run(["chattr", "-i", str(out)], check=True)
    assert code == 1
    (line,) = messages(stderr)
    assert f"Output folder {out} is not writable (mode drwxr-xr-x, owner {os.geteuid()}, which allows it: an " \
           "immutable attribute (chattr +i)" in line and "Verifying" not in stderr
    assert tree_state(tmp_path) == before


def test_a_previous_output_that_cannot_be_removed_is_named_until_it_can(tmp_path, tiny_source, caplog):
    """An immutable file in the replaced output: the new output is in place (exit 0), the old one stays in its marked
    folder, named by this run and by the next ones, which remove it once they can."""
    out = tmp_path / "out"
    assert run_convert_in_process(tiny_source, out, "--max-new-tokens", "0", cwd=tmp_path)[0] == 0
    if subprocess.run(["chattr", "+i", str(out / "config.json")], capture_output=True).returncode != 0:
        pytest.skip("chattr +i needs root on a file system with attributes")
    try:
        code, stderr = run_convert_in_process(tiny_source, out, "--overwrite", "--max-new-tokens", "0", cwd=tmp_path)
        assert code == 0, stderr
        assert_complete_output(out)
        (retired,) = tmp_path.glob(".out.*.old")
        assert (retired / STAGING_MARKER).is_file() and (retired / "out" / "config.json").is_file()
        assert f"the previous output moved to {retired} could not be removed" in caplog.text
        marker = json.loads((retired / STAGING_MARKER).read_text())
        assert marker["pid"] == os.getpid()  # this process: alive, so the next run would leave it alone
        finished = subprocess.Popen(["true"])
        finished.wait()
        (retired / STAGING_MARKER).write_text(json.dumps({**marker, "pid": finished.pid}))  # as if run elsewhere
        assert run_convert_in_process(tiny_source, tmp_path / "other", "--max-new-tokens", "0", cwd=tmp_path)[0] == 0
        assert f"Could not remove {retired}" in caplog.text and retired.is_dir()
    finally:
        for config in [out / "config.json", *tmp_path.glob(".out.*.old/out/config.json")]:
            if config.exists():
                subprocess.run(["chattr", "-i", str(config)], check=True)
    assert run_convert_in_process(tiny_source, tmp_path / "third", "--max-new-tokens", "0", cwd=tmp_path)[0] == 0
    assert sorted(path.name for path in tmp_path.iterdir()) == ["other", "out", "third"]


def test_output_under_a_file_or_in_sys_is_one_line(tmp_path, tiny_source):
    (tmp_path / "file").write_text("x")
    for output, expected in [(tmp_path / "file" / "out", "which is not a folder"),
                             (tmp_path / "file", "exists and is not a folder")]:
        code, stderr = run_convert_in_process(tiny_source, output, cwd=tmp_path)
        assert code == 1 and expected in stderr and len(stderr.strip().splitlines()) == 1
    if Path("/sys/kernel").is_dir():
        code, stderr = run_convert_in_process(tiny_source, "/sys/dar-out", cwd=tmp_path)
        assert code == 1
        (line,) = messages(stderr)
        assert line.startswith("dar convert: error: Could not write /sys/dar-out")
    assert [path.name for path in tmp_path.iterdir()] == ["file"]


# ---------------------------------------------------------------------------------------------------------------
# Signals and stale staging folders.


def _start_and_signal(tmp_path: Path, source: Path, signum: int) -> tuple[subprocess.CompletedProcess, int]:
    """Start a long conversion (many greedy tokens), send `signum` once its staging folder exists; -> (the finished
    process, its pid)."""
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    process = subprocess.Popen(
        [*dar_command(), "convert", str(source), str(tmp_path / "out"), "--max-new-tokens", "1500"],
        cwd=tmp_path, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, stdin=subprocess.DEVNULL, text=True,
    )
    deadline = time.monotonic() + 300
    while not list(tmp_path.glob(".out.*.partial")) and process.poll() is None and time.monotonic() < deadline:
        time.sleep(0.02)
    assert process.poll() is None, "the conversion ended before it could be interrupted"
    time.sleep(0.2)
    process.send_signal(signum)
    stdout, stderr = process.communicate(timeout=300)
    return subprocess.CompletedProcess(process.args, process.returncode, stdout, stderr), process.pid


@pytest.mark.parametrize("signum", [signal.SIGTERM, pytest.param(signal.SIGHUP, marks=pytest.mark.slow)])
def test_cli_cleans_up_on_sigterm_and_sighup_like_sigint(tmp_path, tiny_source, signum):
    source = tmp_path / "source"
    shutil.copytree(tiny_source, source)
    source_before = source_bytes(source)
    completed, _ = _start_and_signal(tmp_path, source, signum)
    assert completed.returncode == 128 + signum, completed.stderr[-2000:]
    assert messages(completed.stderr)[-1] == f"dar convert: interrupted by {signal.Signals(signum).name}; nothing was written."
    assert sorted(path.name for path in tmp_path.iterdir()) == ["source"]
    assert source_bytes(source) == source_before


@pytest.mark.parametrize("signum", [signal.SIGTERM, signal.SIGHUP, signal.SIGINT])
def test_signal_after_the_staging_folder_is_written_removes_it(tmp_path, tiny_source, monkeypatch, signum):
    """In-process: the signal arrives when the staging folder is complete, just before the swap."""
    apply_umask = output_module._apply_umask

    def then_signal(folder):
        apply_umask(folder)
        os.kill(os.getpid(), signum)

    monkeypatch.setattr(output_module, "_apply_umask", then_signal)
    # Ctrl-C as an interactive run has it: a job started in the background by a non-interactive shell (as a CI runner
    # may start the tests) inherits SIGINT ignored, which Python and the CLI respect, so the test sets Python's own.
    inherited_sigint = signal.signal(signal.SIGINT, signal.default_int_handler)
    try:
        handlers = {number: signal.getsignal(number) for number in (signal.SIGTERM, signal.SIGHUP, signal.SIGINT)}
        code, stderr = run_convert_in_process(tiny_source, tmp_path / "out", "--max-new-tokens", "0", cwd=tmp_path)
        handlers_after = {number: signal.getsignal(number) for number in handlers}
    finally:
        signal.signal(signal.SIGINT, inherited_sigint)
    assert code == 128 + signum
    assert messages(stderr)[-1] == f"dar convert: interrupted by {signal.Signals(signum).name}; nothing was written."
    assert list(tmp_path.iterdir()) == []
    assert handlers_after == handlers  # the CLI's handlers are gone


@pytest.mark.parametrize("signum", [signal.SIGTERM, signal.SIGINT])
def test_an_interrupt_a_finalizer_swallows_still_stops_the_conversion(tmp_path, tiny_source, monkeypatch, signum):
    """In-process: the signal's handler runs while a `__del__` runs (regex's `Group.__del__` once, naturally), whose
    exceptions Python prints as "Exception ignored" and drops: the conversion went on, put its output in place and
    exited 0. The interrupt is raised again before the swap: nothing in place, 128 + N."""

    class SignalledWhileFinalized:
        def __del__(self):
            os.kill(os.getpid(), signum)
            sum(range(1000))  # the handler runs here, inside the finalizer

    verify_written = api_module.verify_written
    monkeypatch.setattr(api_module, "verify_written",
                        lambda *args: SignalledWhileFinalized() and None or verify_written(*args))
    swallowed = []  # what Python prints as "Exception ignored in ..."
    monkeypatch.setattr(sys, "unraisablehook", lambda unraisable: swallowed.append(unraisable.exc_value))
    inherited_sigint = signal.signal(signal.SIGINT, signal.default_int_handler)  # as above: Ctrl-C as it is run
    try:
        code, stderr = run_convert_in_process(tiny_source, tmp_path / "out", "--max-new-tokens", "0", cwd=tmp_path)
    finally:
        signal.signal(signal.SIGINT, inherited_sigint)
    assert [type(error) for error in swallowed] == [KeyboardInterrupt if signum == signal.SIGINT else Interrupted]
    assert code == 128 + signum, stderr[-2000:]
    assert messages(stderr)[-1] == f"dar convert: interrupted by {signal.Signals(signum).name}; nothing was written."
    assert list(tmp_path.iterdir()) == []


@pytest.mark.parametrize("moment, signum", [("in the clean-up after the swap", signal.SIGINT),
                                            ("once the output is in place", signal.SIGTERM),
                                            ("as the source is closed", signal.SIGHUP)])
def test_a_signal_after_the_swap_says_the_output_was_written(tmp_path, tiny_source, monkeypatch, moment, signum):
    """In-process: the signal arrives once the complete, verified output is in place, before `upcycle` returns. It
    was reported as "nothing was written" (the clean-up re-raised a held signal outside the handler that says the
    output is there, and `upcycle` had none); the CLI names the output it wrote, which is left as it is."""

    def signal_once(*args):
        os.kill(os.getpid(), signum)

    if moment == "in the clean-up after the swap":  # the removal of a parent folder it made (not empty: kept)
        make_parents = output_module._make_parents

        class SignalledFolder:
            def rmdir(self):
                signal_once()
                raise OSError(errno.ENOTEMPTY, os.strerror(errno.ENOTEMPTY))

        monkeypatch.setattr(output_module, "_make_parents", lambda folder: [*make_parents(folder), SignalledFolder()])
    elif moment == "once the output is in place":  # the first thing `upcycle` does after `write_repo_folder` returns
        monkeypatch.setattr(api_module.logger, "info", signal_once)
    else:
        open_source = api_module.open_source

        def opened(*args):
            source = open_source(*args)
            close = source.checkpoint.close
            source.checkpoint.close = lambda: (close(), signal_once())
            return source

        monkeypatch.setattr(api_module, "open_source", opened)
    inherited_sigint = signal.signal(signal.SIGINT, signal.default_int_handler)  # as in the test above
    try:
        code, stderr = run_convert_in_process(tiny_source, tmp_path / "out", "--max-new-tokens", "0", cwd=tmp_path)
    finally:
        signal.signal(signal.SIGINT, inherited_sigint)
    assert code == 128 + signum
    name = signal.Signals(signum).name
    assert messages(stderr)[-1] == f"dar convert: interrupted by {name} after {tmp_path / 'out'} was written."
    assert_complete_output(tmp_path / "out")
    assert leftovers(tmp_path) == []


def test_staging_left_by_sigkill_is_removed_by_the_next_run_and_nothing_else(tmp_path, tiny_source, caplog):
    source = tmp_path / "source"
    shutil.copytree(tiny_source, source)
    killed, pid = _start_and_signal(tmp_path, source, signal.SIGKILL)
    assert killed.returncode == -signal.SIGKILL
    (stale,) = tmp_path.glob(".out.*.partial")
    assert json.loads((stale / STAGING_MARKER).read_text())["pid"] == pid
    lookalike = tmp_path / ".out.notours.partial"  # no marker: not this package's, never removed
    lookalike.mkdir()
    (lookalike / "data").write_text("user data")
    running = tmp_path / ".out.running.partial"  # a marker a live run (this process) holds locked: left alone
    running.mkdir()
    (running / STAGING_MARKER).write_text(json.dumps({"pid": os.getpid(), "host": os.uname().nodename,
                                                      "output": str(tmp_path / "out")}))
    lock = os.open(running / STAGING_MARKER, os.O_RDONLY)
    fcntl.flock(lock, fcntl.LOCK_EX)
    try:
        code, stderr = run_convert_in_process(source, tmp_path / "out", "--max-new-tokens", "0", cwd=tmp_path)
    finally:
        os.close(lock)
    assert code == 0, stderr
    assert f"Removing {stale}, left behind by an earlier conversion (process {pid}, no longer running)." in caplog.text
    assert f"{running} belongs to a conversion that may still be running" in caplog.text
    assert not stale.exists() and (lookalike / "data").read_text() == "user data" and running.is_dir()
    assert_complete_output(tmp_path / "out")


def test_a_refused_rerun_names_the_staging_folder_a_killed_run_left(tmp_path):
    """An `--overwrite` run killed while writing (SIGKILL, the OOM killer) leaves a hidden staging folder as large as
    the model beside the previous output; a rerun without --overwrite is refused before the clean-up that removes it,
    and the refusal did not say it was there. Now it names it with its size; it removes nothing (a refused run changes
    nothing), and a live run's staging folder, another output's and an unmarked lookalike are not named."""
    output = tmp_path / "out"
    output.mkdir()
    (output / "config.json").write_text("{}")

    def staged(name, marker_output, pid):
        folder = tmp_path / name
        folder.mkdir()
        (folder / "model.safetensors").write_bytes(b"x" * 3 * 2**20)
        (folder / STAGING_MARKER).write_text(json.dumps({"pid": pid, "host": os.uname().nodename,
                                                         "output": str(marker_output)}))
        return folder

    left = staged(".out.abc123.partial", output, _dead_pid())
    live = staged(".out.live42.partial", output, os.getpid())
    other = staged(".out2.dead17.partial", tmp_path / "out2", _dead_pid())
    (tmp_path / ".out.notours.partial").mkdir()
    lock = os.open(live / STAGING_MARKER, os.O_RDONLY)
    fcntl.flock(lock, fcntl.LOCK_EX)
    try:
        with pytest.raises(FileExistsError) as refused:
            check_output_folder(output, overwrite=False)
    finally:
        os.close(lock)
    message = str(refused.value)
    assert (f"Beside it, {left} (0.00 GiB) is the staging folder of an earlier run into it that did not finish; the "
            f"next run that writes in {tmp_path} removes it, or remove it yourself.") in message
    assert str(live) not in message and str(other) not in message and "notours" not in message
    assert left.is_dir() and live.is_dir() and other.is_dir()
    for folder in (left, live):  # nothing left by a run (the live one's lock is free now): as it said before
        (folder / STAGING_MARKER).unlink()
    with pytest.raises(FileExistsError) as refused:
        check_output_folder(output, overwrite=False)
    assert str(refused.value).endswith("to replace a previous conversion output.")


@pytest.mark.parametrize("locked", [True, False, None])
def test_a_run_has_ended_by_its_lock_or_where_locks_fail_by_its_process_on_this_host(tmp_path, monkeypatch, locked):
    """The rule that decides which marked folders the clean-up removes and a refusal names: a held lock means alive,
    a free one ended (whatever the process id names now); with no locks (None: a file system without flock) a run of
    this host has ended when its process is gone, and one of another host, or of no readable process id, never."""
    monkeypatch.setattr(output_module, "_marker_locked", lambda folder: locked)
    here, dead = os.uname().nodename, _dead_pid()
    # (host, pid, ended where locks do not work)
    cases = [(here, dead, True), (here, os.getpid(), False), ("elsewhere", dead, False), (here, "?", False)]
    for host, pid, ended_without_locks in cases:
        expected = ended_without_locks if locked is None else not locked
        assert output_module._run_ended(tmp_path, {"host": host, "pid": pid}) == expected, (host, pid)


def test_a_stale_lookalike_that_is_a_symlink_is_never_followed(tmp_path):
    """A symlink named like a staging folder, to a folder holding a dead run's marker and the user's files: the
    clean-up followed it and emptied the folder it points to. Never followed now (nor a marker that is a symlink)."""
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    (elsewhere / STAGING_MARKER).write_text(json.dumps({"pid": _dead_pid(), "host": os.uname().nodename,
                                                        "output": str(tmp_path / "proj" / "out")}))
    (elsewhere / "notes.txt").write_text("user data")
    (tmp_path / "proj").mkdir()
    (tmp_path / "proj" / ".out.link1234.partial").symlink_to(elsewhere)
    linked_marker = tmp_path / "proj" / ".out.marker5678.partial"  # a real folder whose marker is a symlink
    linked_marker.mkdir()
    (linked_marker / "data").write_text("user data")
    (linked_marker / STAGING_MARKER).symlink_to(elsewhere / STAGING_MARKER)
    assert output_module.remove_stale_runs(tmp_path / "proj") == []
    assert (elsewhere / "notes.txt").read_text() == "user data" and (linked_marker / "data").read_text() == "user data"


def test_a_dead_runs_folder_is_removed_when_its_lock_is_free_though_its_process_id_is_in_use(tmp_path, caplog):
    """Every run holds its marker locked; where locks work, a free lock says the run ended, whatever its process id
    now names (process 1 in a container, reused) or its host was called (a new container's name): such folders were
    kept for good, "may still be running". Without a lock to read, the process id still decides."""
    stale = []
    for name, pid, host in (("pid1", 1, os.uname().nodename), ("rehosted", os.getpid(), "another-container")):
        folder = tmp_path / f".out.{name}.partial"
        folder.mkdir()
        (folder / STAGING_MARKER).write_text(json.dumps({"pid": pid, "host": host, "output": str(tmp_path / "out")}))
        (folder / "model.safetensors").write_bytes(b"0" * 64)
        stale.append(folder)
    assert output_module.remove_stale_runs(tmp_path) == sorted(stale) and leftovers(tmp_path) == []
    assert "no longer running" in caplog.text


def test_overwrite_replaces_a_previous_conversion_and_nothing_else(tmp_path, tiny_source):
    out = tmp_path / "out"
    assert run_convert_in_process(tiny_source, out, "--max-new-tokens", "0", cwd=tmp_path)[0] == 0
    (out / "old-only.txt").write_text("from the previous conversion")  # a file only the previous conversion wrote
    write_manifest(out)  # as that conversion did, last
    code, stderr = run_convert_in_process(tiny_source, out, "--overwrite", "--max-new-tokens", "0", cwd=tmp_path)
    assert code == 0, stderr
    assert_complete_output(out)
    assert not (out / "old-only.txt").exists() and leftovers(tmp_path) == []
    user = tmp_path / "user"
    user.mkdir()
    (user / "notes.txt").write_text("user data")
    (user / "config.json").write_text(json.dumps({"model_type": "llama"}))
    code, stderr = run_convert_in_process(tiny_source, user, "--overwrite", cwd=tmp_path)
    assert code == 1 and "is not a previous conversion output" in stderr and len(stderr.strip().splitlines()) == 1
    assert (user / "notes.txt").read_text() == "user data"


def test_the_output_is_on_disk_before_it_is_renamed_into_place_and_before_the_old_one_goes(tmp_path, tiny_source,
                                                                                            monkeypatch):
    """Nothing was flushed: a crash (power loss) soon after a conversion could leave empty or truncated shards under
    the output's name, the replaced output already removed. Every file of the staging folder and the folder itself are
    flushed (`os.fsync`) before the rename that makes it the output, and the parent folder after that rename, before
    a replaced output is removed; recorded for a new output and for --overwrite."""
    events = []  # ("fsync", path) / ("rename", source, target) / ("remove", folder), in order

    def fsync(descriptor):
        events.append(("fsync", os.readlink(f"/proc/self/fd/{descriptor}")))
        real_fsync(descriptor)

    parked = {}  # where the one-step swap parks the staging folder (`_exchanged_into_place`) -> the staging folder

    def rename(source, target):
        if str(source).endswith(".partial") and Path(target).parent.name.endswith(".old"):
            parked[str(target)] = str(source)
        events.append(("rename", str(source), str(target)))
        real_replace(source, target)

    def exchange(first, second):  # the swap, recorded as the staging folder's rename into place
        swapped = real_exchange(first, second)
        if swapped:
            events.append(("rename", parked.get(str(first), str(first)), str(second)))
        return swapped

    def remove(folder):
        events.append(("remove", str(folder)))
        real_remove(folder)

    real_fsync, real_replace, real_remove = os.fsync, os.replace, output_module._remove_marked
    real_exchange = output_module._exchange
    monkeypatch.setattr(os, "fsync", fsync)
    monkeypatch.setattr(os, "replace", rename)
    monkeypatch.setattr(output_module, "_exchange", exchange)
    monkeypatch.setattr(output_module, "_remove_marked", remove)
    parent = tmp_path.resolve()
    out = parent / "out"
    for overwrite in ([], ["--overwrite"]):
        events.clear()
        assert run_convert_in_process(tiny_source, out, *overwrite, "--max-new-tokens", "0", cwd=tmp_path)[0] == 0
        (swap,) = [index for index, event in enumerate(events) if event[0] == "rename" and event[2] == str(out)]
        staging = Path(events[swap][1])
        flushed_before = {event[1] for event in events[:swap] if event[0] == "fsync"}
        written = [str(staging / path) for path, status in output_module.walk_without_symlinks(out)
                   if stat.S_ISREG(status.st_mode)]
        assert len(written) > 10 and {*written, str(staging)} <= flushed_before, sorted(flushed_before)
        parent_flushed = [index for index, event in enumerate(events[swap:], swap) if event == ("fsync", str(parent))]
        removed = [index for index, event in enumerate(events) if event[0] == "remove"]
        assert parent_flushed and len(removed) == len(overwrite) and all(parent_flushed[0] < i for i in removed)
    assert_complete_output(out)


def test_overwrite_never_replaces_a_dar_model_the_user_saved(tmp_path, tiny_source):
    """A DAR model saved by `save_pretrained` after training (a DAR config.json, but no conversion's manifest), a
    conversion output trained and saved back in place, and one that gained a Trainer's checkpoint-N/ are not previous
    conversion outputs: --overwrite refuses each in one line, naming why, and every file stays. A subfolder the
    conversion itself wrote (transformers saves named chat templates in additional_chat_templates/) does not count."""
    out = tmp_path / "out"
    assert run_convert_in_process(tiny_source, out, "--max-new-tokens", "0", cwd=tmp_path)[0] == 0
    templates = out / "additional_chat_templates"
    templates.mkdir()
    (templates / "tool_use.jinja").write_text("{{ messages }}")
    write_manifest(out)  # as a conversion that wrote the subfolder lists it
    code, stderr = run_convert_in_process(tiny_source, out, "--overwrite", "--max-new-tokens", "0", cwd=tmp_path)
    assert code == 0, stderr

    trained = tmp_path / "trained"
    AutoModelForCausalLM.from_pretrained(out).save_pretrained(trained)
    (trained / "notes.txt").write_text("user data")
    time.sleep(0.01)
    in_place = tmp_path / "in_place"
    shutil.copytree(out, in_place)  # a conversion output (copy2 keeps its times), then training saves into it
    AutoModelForCausalLM.from_pretrained(in_place).save_pretrained(in_place)
    cases = [(trained, f"no {MANIFEST_NAME}, the list of the files a conversion wrote"),
             (in_place, "not written by the conversion: model.safetensors"),
             (out, "not written by the conversion: checkpoint-500")]
    for folder, reason in cases:
        if folder == out:
            (out / "checkpoint-500").mkdir()
        before = {path: path.read_bytes() for path in folder.rglob("*") if path.is_file()}
        code, stderr = run_convert_in_process(tiny_source, folder, "--overwrite", cwd=tmp_path)
        assert code == 1 and reason in stderr and len(stderr.strip().splitlines()) == 1, stderr
        assert {path: path.read_bytes() for path in folder.rglob("*") if path.is_file()} == before


def test_a_gguf_source_is_its_file(tmp_path):
    """For a file source, the output may be next to it but may not be the file, or a folder holding it or the
    symlink through which it was named (checked before anything is read)."""
    models_folder = tmp_path / "models"
    models_folder.mkdir()
    gguf = models_folder / "tiny.gguf"
    gguf.write_bytes(b"GGUF")
    (tmp_path / "cache").mkdir()
    link = tmp_path / "cache" / "linked.gguf"
    link.symlink_to(gguf)
    (models_folder / "config.json").write_text(json.dumps({"model_type": "dar"}))  # looks like a conversion output
    assert check_output_folder(models_folder / "tiny-dar", False, gguf) == models_folder / "tiny-dar"
    for output, source in [(gguf, gguf), (models_folder, gguf), (tmp_path, gguf), (models_folder, link),
                           (tmp_path / "cache", link), (tmp_path / "cache" / "linked.gguf", link)]:
        with pytest.raises(ValueError, match=r"(is|contains) the (source file|symlink to the source)"):
            check_output_folder(output, True, source)


def test_a_symlink_in_the_source_protects_its_target(tmp_path, tiny_source):
    """A source whose tokenizer is a symlink into another folder (as a Hub cache snapshot links into blobs/): that
    folder is the source's too, even when it looks like a previous conversion output."""
    previous = tmp_path / "previous"
    assert run_convert_in_process(tiny_source, previous, "--max-new-tokens", "0", cwd=tmp_path)[0] == 0
    source = tmp_path / "source"
    shutil.copytree(tiny_source, source)
    (source / "tokenizer.json").unlink()
    (source / "tokenizer.json").symlink_to(previous / "tokenizer.json")
    before = tree_state(tmp_path)
    code, stderr = run_convert_in_process(source, previous, "--overwrite", cwd=tmp_path)
    assert code == 1 and "contains the target of the source's symlink tokenizer.json" in stderr
    assert tree_state(tmp_path) == before


def test_a_symlink_below_the_source_top_level_protects_its_target(tmp_path, tiny_source):
    """A DAR source whose index lists its shards in a subfolder of links into a previous conversion output: the
    output check looked at the source's top-level links only, so converting it onto that output with --overwrite
    (to DAR-MoE) replaced the files the source's weights are, and exited 0."""
    previous = tmp_path / "previous"
    assert run_convert_in_process(tiny_source, previous, "--max-new-tokens", "0", cwd=tmp_path)[0] == 0
    source = tmp_path / "source"
    (source / "w").mkdir(parents=True)
    for path in previous.iterdir():
        if path.suffix == ".safetensors":
            (source / "w" / path.name).symlink_to(path)
        elif path.is_file():
            shutil.copy(path, source / path.name)
    index = json.loads((previous / "model.safetensors.index.json").read_text())
    index["weight_map"] = {name: f"w/{file}" for name, file in index["weight_map"].items()}
    (source / "model.safetensors.index.json").write_text(json.dumps(index))
    before = tree_state(tmp_path)
    code, stderr = run_convert_in_process(source, previous, "--overwrite", "--experts", "2", "--top-k", "1",
                                          cwd=tmp_path)
    assert code == 1, stderr
    assert "contains the target of the source's symlink w/model-0000" in stderr
    assert tree_state(tmp_path) == before


def test_a_source_subfolder_that_cannot_be_listed_does_not_stop_the_output_check(tmp_path, monkeypatch):
    """The walk for symlinks below the source's top level must not turn an unlistable subfolder (another user's
    cache, say: nothing in it is read) into a failed conversion; the links it can list still protect their targets."""
    source, elsewhere = tmp_path / "source", tmp_path / "elsewhere"
    (source / "locked").mkdir(parents=True)
    (source / "open").mkdir()
    elsewhere.mkdir()
    (source / "open" / "link").symlink_to(elsewhere)
    listing = os.scandir
    monkeypatch.setattr(output_module.os, "scandir", lambda path: (
        (_ for _ in ()).throw(PermissionError(errno.EACCES, "Permission denied", str(path)))
        if Path(path).name == "locked" else listing(path)))
    assert check_output_folder(tmp_path / "out", False, source) == tmp_path / "out"
    with pytest.raises(ValueError, match=r"is the target of the source's symlink open/link"):
        check_output_folder(elsewhere, True, source)
    # A shard the index lists in the unlistable folder, linked into an earlier output: it still opens by name (a
    # folder one may enter but not list, mode 711), so its target is protected through the index.
    previous = tmp_path / "previous"
    previous.mkdir()
    (previous / "model-00001-of-00001.safetensors").write_bytes(b"weights")
    (source / "locked" / "model-00001-of-00001.safetensors").symlink_to(previous / "model-00001-of-00001.safetensors")
    (source / "model.safetensors.index.json").write_text(
        json.dumps({"weight_map": {"lm_head.weight": "locked/model-00001-of-00001.safetensors"}}))
    with pytest.raises(ValueError, match=r"contains the file the source's index lists as "
                                         r"locked/model-00001-of-00001\.safetensors"):
        check_output_folder(previous, True, source)


# ---------------------------------------------------------------------------------------------------------------
# The property: over source/output relations, either exit 1 with one line and nothing written, or a complete
# output; the source's bytes never change.

SOURCE_SPELLINGS = ["a/src", "link", "a/../a/src", "alink/src", "ABS/a/src"]
OUTPUT_SPELLINGS = [
    "a/src", "link", "a/src/.", "a/x/../src", "alink/src",  # the source itself
    "a", "alink", ".", "a/src/..",  # folders holding it
    "a/src/dar", "link/dar", "a/src/sub", "a/src/sub/dar",  # inside it
    "a/dar", "alink/dar", "a/src/../dar", "link/../dar", "new/deeper/dar",  # new siblings
    "a/empty", "a/prev", "alink/prev", "prevlink", "a/user", "a/file.txt",  # existing siblings
]


def build_layout(root: Path, tiny_source: Path, linked_tokenizer: bool) -> None:
    """root/a/{src (with sub/), x/, empty/, prev (a previous conversion output), user (a user's folder), file.txt},
    root/link -> a/src, root/alink -> a, root/prevlink -> a/prev; `linked_tokenizer`: src/tokenizer.json is a symlink into prev/."""
    src = root / "a" / "src"
    shutil.copytree(tiny_source, src)
    (src / "sub").mkdir()
    (src / "sub" / "notes.txt").write_text("kept with the source")
    for name in ("x", "empty", "prev", "user"):
        (root / "a" / name).mkdir()
    (root / "a" / "prev" / "config.json").write_text(json.dumps({"model_type": "dar"}))
    (root / "a" / "prev" / "README.md").write_text("---\ntags:\n- dar\n- upcycled\n---\n")  # a conversion's card
    shutil.copy(src / "tokenizer.json", root / "a" / "prev" / "tokenizer.json")
    write_manifest(root / "a" / "prev")  # the list of what it wrote, last
    (root / "a" / "user" / "thesis.txt").write_text("weeks of work")
    (root / "a" / "file.txt").write_text("a file")
    if linked_tokenizer:
        (src / "tokenizer.json").unlink()
        (src / "tokenizer.json").symlink_to("../prev/tokenizer.json")
    (root / "link").symlink_to("a/src")
    (root / "alink").symlink_to("a")
    (root / "prevlink").symlink_to("a/prev")


def expected_to_write(root: Path, source: str, output: str, overwrite: bool) -> bool:
    """The rule, stated on resolved paths with plain string logic (the implementation compares identities)."""
    source_path, output_path = os.path.realpath(root / source), os.path.realpath(root / output)
    protected = [source_path] + [os.path.realpath(entry) for entry in Path(source_path).iterdir() if entry.is_symlink()]

    def within(inner, outer):
        return os.path.commonpath([inner, outer]) == outer

    if any(within(output_path, path) or within(path, output_path) for path in protected):
        return False
    if not os.path.lexists(output_path):
        return True
    if not os.path.isdir(output_path):
        return False
    if not os.listdir(output_path):
        return True
    config, manifest = Path(output_path) / "config.json", Path(output_path) / MANIFEST_NAME
    if not (overwrite and manifest.is_file() and not manifest.is_symlink()):
        return False
    listed = json.loads(manifest.read_text())
    present = {entry.relative_to(output_path).as_posix(): entry.lstat() for entry in Path(output_path).rglob("*")}
    present.pop(MANIFEST_NAME)
    return (present.keys() == listed["files"].keys() | set(listed["folders"])
            and all((present[name].st_size, present[name].st_mtime_ns) == (entry["size"], entry["mtime_ns"])
                    for name, entry in listed["files"].items())
            and json.loads(config.read_text()).get("model_type") in ("dar", "dar_moe"))


@settings(max_examples=50, deadline=None, derandomize=True, database=None,
          suppress_health_check=[HealthCheck.too_slow])
@given(
    source=st.sampled_from(SOURCE_SPELLINGS),
    output=st.sampled_from(OUTPUT_SPELLINGS),
    overwrite=st.booleans(),
    absolute_output=st.booleans(),
    linked_tokenizer=st.booleans(),
)
def test_property_the_source_is_never_touched(tmp_path_factory, tiny_source, source, output, overwrite,
                                               absolute_output, linked_tokenizer):
    root = tmp_path_factory.mktemp("relation")
    build_layout(root, tiny_source, linked_tokenizer)
    source = source.replace("ABS", str(root))
    output_argument = f"{root}/{output}" if absolute_output else output
    source_before = source_bytes(root / "a" / "src")
    resolved_output = Path(os.path.realpath(root / output))
    before = tree_state(root)
    expected = expected_to_write(root, source, output, overwrite)
    event("writes" if expected else "refused")

    code, stderr = run_convert_in_process(source, output_argument, *(["--overwrite"] if overwrite else []),
                                  "--max-new-tokens", "0", cwd=root)

    assert source_bytes(root / "a" / "src") == source_before
    if code == 1:
        assert len(stderr.strip().splitlines()) == 1 and stderr.startswith("dar convert: error: "), stderr
        assert tree_state(root) == before
    else:
        assert code == 0, stderr
        assert_complete_output(resolved_output)
        assert leftovers(resolved_output.parent) == []
        assert tree_state(root, skip=resolved_output) == {
            key: value for key, value in before.items()
            if not (root / key == resolved_output or resolved_output in (root / key).parents)
        } | {str(parent.relative_to(root)): "dir" for parent in resolved_output.parents if root in parent.parents}
    assert code == (0 if expected else 1), (source, output, overwrite, stderr)
    shutil.rmtree(root)


# ---------------------------------------------------------------------------------------------------------------
# Failures at the swap, after it and in the clean-up; read errors that are not the output's, and the output's own.


def _dead_pid() -> int:
    finished = subprocess.Popen(["true"])
    finished.wait()
    return finished.pid


def test_a_swap_that_cannot_move_the_old_output_back_names_where_it_is_and_no_run_removes_it(
    tmp_path, tiny_source, monkeypatch
):
    """Another process puts a folder at the output between the two renames of `--overwrite`: the new output cannot
    take the place, nor can the old one go back. The error says where the old output is; its folder is unmarked, so
    that no later run removes it (one did: it found a folder at the output and took the old one for replaced)."""
    out = tmp_path / "out"
    assert run_convert_in_process(tiny_source, out, "--max-new-tokens", "0", cwd=tmp_path)[0] == 0
    before = tree_state(out)
    replace = os.replace

    def racing_replace(source, destination):
        if Path(source).name.endswith(".partial") and Path(destination) == out:
            out.mkdir()
            (out / "theirs.txt").write_text("another process's")
        return replace(source, destination)

    monkeypatch.setattr(os, "replace", racing_replace)
    # the two-step swap (where the system has no one-step exchange), whose output is absent between the renames
    monkeypatch.setattr(output_module, "_exchanged_into_place", lambda *arguments: False)
    code, stderr = run_convert_in_process(tiny_source, out, "--overwrite", "--max-new-tokens", "0", cwd=tmp_path)
    monkeypatch.setattr(os, "replace", replace)
    assert code == 1
    (retired,) = tmp_path.glob(".out.*.old")
    (line,) = messages(stderr)
    assert line.startswith(f"dar convert: error: Could not write {out}: Directory not empty")
    assert line.endswith(f"nothing was written. The existing output could not be moved back (Directory not empty "
                         f"({retired / 'out'} -> {out})): it is now {retired / 'out'}; move it back yourself.")
    assert tree_state(retired / "out") == before and not (retired / STAGING_MARKER).exists()
    assert leftovers(tmp_path) == [retired.name]
    assert run_convert_in_process(tiny_source, tmp_path / "other", "--max-new-tokens", "0", cwd=tmp_path)[0] == 0
    assert tree_state(retired / "out") == before


def test_a_stale_retired_folder_is_removed_only_where_its_own_new_output_took_the_place(tmp_path, caplog):
    """A run killed after its swap leaves the replaced output in its marked retired folder: the next run removes it,
    but only if the output is the folder that run renamed into place (its manifest's random id, in the marker). Any
    other folder there leaves it alone, named: another run's output, one that took the inode the killed run's folder
    had (a helper's repro: killed between the renames, the next run removed that staging folder, the run after it
    got its inode for its own output, and the only copy of the old output was removed as replaced), or a marker of
    an earlier version (which recorded the inode)."""
    out = tmp_path / "out"
    out.mkdir()
    (out / output_module.MANIFEST_NAME).write_text(json.dumps({"format": 1, "run": "a" * 32, "files": {},
                                                               "folders": []}))
    identity = os.lstat(out)
    marker = {"pid": _dead_pid(), "host": output_module.socket.gethostname(), "output": str(out)}
    cases = {"replaced": {"replacement_run": "a" * 32}, "another run": {"replacement_run": "b" * 32},
             "the same inode": {"replacement": [identity.st_dev, identity.st_ino]}, "no identity": {}}
    for case, fields in cases.items():
        retired = tmp_path / f".out.{case.replace(' ', '-')}.old"
        (retired / "out").mkdir(parents=True)
        (retired / "out" / "weights").write_text(case)
        (retired / STAGING_MARKER).write_text(json.dumps({**marker, **fields}))
    removed = output_module.remove_stale_runs(tmp_path)
    assert [path.name for path in removed] == [".out.replaced.old"]
    assert leftovers(tmp_path) == [".out.another-run.old", ".out.no-identity.old", ".out.the-same-inode.old"]
    for kept in leftovers(tmp_path):
        assert f"{tmp_path / kept / 'out'} is the previous {out}, moved aside by a conversion that did not finish" \
            in caplog.text


def test_a_swap_records_the_new_outputs_run_id_in_the_retired_marker(tmp_path, tiny_source, monkeypatch):
    """The retired folder's marker names the output that replaces it by the id in that output's manifest."""
    out = tmp_path / "out"
    assert run_convert_in_process(tiny_source, out, "--max-new-tokens", "0", cwd=tmp_path)[0] == 0
    first = output_module.output_run_id(out)
    markers = []
    remove = output_module._remove_marked
    monkeypatch.setattr(output_module, "_remove_marked", lambda folder: markers.append(
        json.loads((folder / STAGING_MARKER).read_text())) or remove(folder))
    assert run_convert_in_process(tiny_source, out, "--overwrite", "--max-new-tokens", "0", cwd=tmp_path)[0] == 0
    second = output_module.output_run_id(out)
    assert len(first) == len(second) == 32 and first != second
    assert [marker.get("replacement_run") for marker in markers if "replacement_run" in marker] == [second]


def test_an_output_another_run_put_in_place_meanwhile_is_left_in_place_without_overwrite(tmp_path, tiny_source,
                                                                                         monkeypatch):
    """Run A, without --overwrite, found the output absent at its last check; run B finished and put its output there
    before A's swap. A moved B's complete output aside and removed it, and both said "Wrote" (a helper's repro, a
    window of about 0.1 ms); then A kept B's output in a hidden folder that no run removes, replaced it, and both still
    said "Wrote" (the concurrency audit). Now A's swap is one rename, which replaces only a missing or empty folder: A
    is refused, saying another process wrote the output meanwhile, and B's output stays in place as it was."""
    other = tmp_path / "other"
    assert run_convert_in_process(tiny_source, other, "--max-new-tokens", "0", cwd=tmp_path)[0] == 0
    before = tree_state(other)
    out = tmp_path / "out"
    move = output_module._move_into_place

    def run_b_finishes_first(staging, output, *checked):
        os.rename(other, output)  # run B's output arrives between A's last check and its swap
        return move(staging, output, *checked)

    monkeypatch.setattr(output_module, "_move_into_place", run_b_finishes_first)
    code, stderr = run_convert_in_process(tiny_source, out, "--max-new-tokens", "0", "--block-size", "1", cwd=tmp_path)
    assert code == 1
    assert messages(stderr)[-1] == written_meanwhile(out, replacing=False)
    assert tree_state(out) == before and leftovers(tmp_path) == []


def test_an_output_another_conversion_replaced_meanwhile_is_not_replaced_again(tmp_path, tiny_source, monkeypatch,
                                                                                 caplog):
    """Two `--overwrite` conversions into one output: the later one to swap replaced the earlier one's fresh output as
    an ordinary previous output, and both said "Wrote" (the concurrency audit). Now a run refuses an output that
    another process wrote after its first check, leaving it in place; and one put there after its last check (a
    window of the swap itself) is kept, named, not removed."""
    out, other = tmp_path / "out", tmp_path / "other"
    for folder in (out, other):
        assert run_convert_in_process(tiny_source, folder, "--max-new-tokens", "0", cwd=tmp_path)[0] == 0
    before = tree_state(other)
    write = output_module.write_manifest

    def other_run_swaps_first(staging):  # while this run writes: the other run's output replaces the previous one
        shutil.rmtree(out)
        os.rename(other, out)
        return write(staging)

    monkeypatch.setattr(output_module, "write_manifest", other_run_swaps_first)
    code, stderr = run_convert_in_process(tiny_source, out, "--overwrite", "--max-new-tokens", "0", cwd=tmp_path)
    assert code == 1
    assert messages(stderr)[-1] == written_meanwhile(out, replacing=True)
    assert tree_state(out) == before and leftovers(tmp_path) == []

    monkeypatch.setattr(output_module, "write_manifest", write)
    assert run_convert_in_process(tiny_source, other, "--max-new-tokens", "0", cwd=tmp_path)[0] == 0
    before = tree_state(other)
    move = output_module._move_into_place

    def other_run_swaps_at_the_swap(staging, output, *checked):
        shutil.rmtree(output)
        os.rename(other, output)
        return move(staging, output, *checked)

    monkeypatch.setattr(output_module, "_move_into_place", other_run_swaps_at_the_swap)
    code, stderr = run_convert_in_process(tiny_source, out, "--overwrite", "--max-new-tokens", "0", cwd=tmp_path)
    assert code == 0, stderr
    assert_complete_output(out)
    (retired,) = tmp_path.glob(".out.*.old")
    assert tree_state(retired / "out") == before and not (retired / STAGING_MARKER).exists()
    assert ("The folder it replaced changed while it was being replaced (another folder took its place after this "
            "conversion's last check: another conversion's output?), so it was kept, not removed: "
            f"{retired / 'out'}") in caplog.text


@pytest.mark.parametrize("overwrite", [False, True])
def test_a_run_checks_its_output_last_only_after_another_runs_swap_there(tmp_path, tiny_source, overwrite, caplog):
    """The window the refusals above left: another conversion's output put in place between a run's last check and
    its swap (milliseconds) was replaced by this run, kept in a hidden folder and named, and the other run had said
    "Wrote" (with `--overwrite`; without it this run's rename was refused after the fact). Now the last check and the
    swap hold the output's parent folder locked, as the other run does through its own: here the test is that run,
    holding the lock while this one waits, putting its output in place, then letting go. This run then finds it, and
    is refused as for an output written meanwhile; the other run's output stays in place as it was."""
    out, other = tmp_path / "out", tmp_path / "other"
    for folder in ((out, other) if overwrite else (other,)):
        assert run_convert_in_process(tiny_source, folder, "--max-new-tokens", "0", cwd=tmp_path)[0] == 0
    before = tree_state(other)
    lock = os.open(tmp_path, os.O_RDONLY | os.O_DIRECTORY)
    fcntl.flock(lock, fcntl.LOCK_EX)  # the other run, about to swap
    failures = []

    def other_run_swaps_once_this_one_is_written():
        try:
            deadline = time.monotonic() + 300
            while not list(tmp_path.glob(f".out.*.partial/{MANIFEST_NAME}")):  # this run's last write before checking
                assert time.monotonic() < deadline, "the run never wrote its staging folder"
                time.sleep(0.01)
            time.sleep(1.0)  # without the lock, this run would check and swap now
            if overwrite:
                shutil.rmtree(out)
            os.rename(other, out)
        except BaseException as error:  # noqa: BLE001 - reported by the test below
            failures.append(error)
        finally:
            os.close(lock)

    thread = threading.Thread(target=other_run_swaps_once_this_one_is_written)
    thread.start()
    try:
        code, stderr = run_convert_in_process(tiny_source, out, *(["--overwrite"] if overwrite else []),
                                              "--max-new-tokens", "0", "--block-size", "1", cwd=tmp_path)
    finally:
        thread.join()
    assert failures == []
    assert code == 1, stderr
    assert messages(stderr)[-1] == written_meanwhile(out, replacing=overwrite)
    assert f"Waiting for another process that holds {tmp_path} locked" in caplog.text
    assert tree_state(out) == before and leftovers(tmp_path) == []


@pytest.mark.parametrize("signum", [signal.SIGTERM, signal.SIGINT])
def test_a_run_waiting_for_another_runs_swap_stops_on_an_interrupt_and_leaves_nothing(tmp_path, tiny_source, signum):
    """The wait for the parent folder's lock is not one of the held moments: Ctrl-C or SIGTERM while another process
    holds it (here the test) stops the run as before its swap, its staging folder removed."""
    lock = os.open(tmp_path, os.O_RDONLY | os.O_DIRECTORY)
    fcntl.flock(lock, fcntl.LOCK_EX)

    def interrupt_once_it_waits():
        deadline = time.monotonic() + 300
        while not list(tmp_path.glob(f".out.*.partial/{MANIFEST_NAME}")) and time.monotonic() < deadline:
            time.sleep(0.01)
        time.sleep(0.5)  # in the wait by now: nothing else is left to do before it
        os.kill(os.getpid(), signum)

    thread = threading.Thread(target=interrupt_once_it_waits)
    inherited_sigint = signal.signal(signal.SIGINT, signal.default_int_handler)  # as in the tests above
    try:
        thread.start()
        code, stderr = run_convert_in_process(tiny_source, tmp_path / "out", "--max-new-tokens", "0", cwd=tmp_path)
    finally:
        thread.join()
        signal.signal(signal.SIGINT, inherited_sigint)
        os.close(lock)
    assert code == 128 + signum
    assert messages(stderr)[-1] == f"dar convert: interrupted by {signal.Signals(signum).name}; nothing was written."
    assert list(tmp_path.iterdir()) == []


def test_a_parent_folder_that_cannot_be_locked_leaves_the_swap_unlocked(tmp_path, tiny_source, monkeypatch):
    """NFS emulates flock with POSIX locks, whose exclusive lock needs a file open for writing, which a folder cannot
    be (EBADF): the swap goes on unlocked, as before the lock, rather than fail the conversion."""
    flock = fcntl.flock

    def no_locks_on_folders(descriptor, operation):
        if stat.S_ISDIR(os.fstat(descriptor).st_mode):
            raise OSError(errno.EBADF, os.strerror(errno.EBADF))
        return flock(descriptor, operation)

    monkeypatch.setattr(fcntl, "flock", no_locks_on_folders)
    out = tmp_path / "out"
    assert run_convert_in_process(tiny_source, out, "--max-new-tokens", "0", cwd=tmp_path)[0] == 0
    assert_complete_output(out) and leftovers(tmp_path) == []


def test_an_output_that_appeared_while_the_run_worked_is_refused_saying_so(tmp_path, tiny_source, monkeypatch):
    """The loser of two conversions into one new folder was told the folder "exists and is not empty ... pass
    --overwrite", which invites replacing the winner's fresh output; now it is told another process wrote it."""
    out, other = tmp_path / "out", tmp_path / "other"
    assert run_convert_in_process(tiny_source, other, "--max-new-tokens", "0", cwd=tmp_path)[0] == 0
    write = output_module.write_manifest

    def other_run_finishes_first(staging):
        os.rename(other, out)
        return write(staging)

    monkeypatch.setattr(output_module, "write_manifest", other_run_finishes_first)
    code, stderr = run_convert_in_process(tiny_source, out, "--max-new-tokens", "0", cwd=tmp_path)
    assert code == 1 and "--overwrite" not in messages(stderr)[-1]
    assert f"Output folder {out} was written by another process while this conversion ran (it was missing or empty " \
           "when this run checked it" in messages(stderr)[-1]
    assert_complete_output(out) and leftovers(tmp_path) == []


def test_an_output_that_is_a_live_runs_working_folder_is_refused(tmp_path, tiny_source):
    """`--overwrite` into another live run's complete staging folder replaced it, and that run then put this one's
    model in place as its own (the concurrency audit). A folder holding a live run's marker is refused."""
    source = tmp_path / "source"
    shutil.copytree(tiny_source, source)
    staging = output_module._marked_folder(tmp_path / "a", output_module.STAGING_SUFFIX)
    try:
        code, stderr = run_convert_in_process(source, staging, "--overwrite", "--max-new-tokens", "0", cwd=tmp_path)
    finally:
        output_module._release_marker(staging)
    assert code == 1
    assert messages(stderr)[-1] == (
        f"dar convert: error: Output folder {staging} is the working folder of a conversion that is still running "
        f"(process {os.getpid()} on {socket.gethostname()}, writing {tmp_path / 'a'}); choose another output.")
    assert sorted(path.name for path in staging.iterdir()) == [STAGING_MARKER]


def _lockf_as_flock():
    """An `fcntl` whose `flock` behaves as NFS's: POSIX record locks (an exclusive one needs a descriptor open for
    writing, EBADF otherwise; closing any descriptor of the file releases the process's locks)."""
    def flock(descriptor, operation):
        return fcntl.lockf(descriptor, operation)

    return type("NFSLikeFcntl", (), {"flock": staticmethod(flock), "LOCK_EX": fcntl.LOCK_EX, "LOCK_SH": fcntl.LOCK_SH,
                                      "LOCK_NB": fcntl.LOCK_NB, "LOCK_UN": fcntl.LOCK_UN})


def test_a_run_holds_its_marker_locked_where_locks_are_nfs_like(tmp_path, monkeypatch):
    """On NFS, flock is emulated by POSIX locks: the exclusive lock on the marker, opened read-only, failed with EBADF
    and was ignored, so another run's probe found the lock free and removed the live run's staging folder (data loss
    and a false "Wrote" in the audit's repro); and writing the marker through a second descriptor would have released
    it. Now the marker is opened for writing and written through the locked descriptor: another process's probe sees
    it locked. Where no exclusive lock can be taken at all, the marker says so, and a free lock is not taken for an
    ended run: the process id decides."""
    monkeypatch.setattr(output_module, "fcntl", _lockf_as_flock())
    staging = output_module._marked_folder(tmp_path / "out", output_module.STAGING_SUFFIX)
    try:  # seen from another process (opening the marker here would release the lock, as NFS would)
        probe = ("import fcntl, json, os, sys\n"
                 "descriptor = os.open(sys.argv[1], os.O_RDONLY)\n"
                 "print(json.loads(os.read(descriptor, 4096))['locked'])\n"
                 "try:\n    fcntl.lockf(descriptor, fcntl.LOCK_SH | fcntl.LOCK_NB)\n"
                 "except OSError:\n    print('locked')\nelse:\n    print('free')\n")
        seen = subprocess.run([sys.executable, "-c", probe, str(staging / STAGING_MARKER)], capture_output=True,
                              text=True, check=True).stdout.split()
        assert seen == ["True", "locked"]
    finally:
        output_module._release_marker(staging)
        shutil.rmtree(staging)

    def no_exclusive_locks(descriptor, operation):
        if operation & fcntl.LOCK_EX:
            raise OSError(errno.ENOLCK, os.strerror(errno.ENOLCK))
        return fcntl.flock(descriptor, operation)

    monkeypatch.setattr(output_module, "fcntl", type("NoExclusive", (), {
        "flock": staticmethod(no_exclusive_locks), "LOCK_EX": fcntl.LOCK_EX, "LOCK_SH": fcntl.LOCK_SH,
        "LOCK_NB": fcntl.LOCK_NB}))
    live = output_module._marked_folder(tmp_path / "out", output_module.STAGING_SUFFIX)
    descriptor = output_module._MARKER_LOCKS.pop(live)  # as another process's run, still alive (this process)
    try:
        assert json.loads((live / STAGING_MARKER).read_text())["locked"] is False
        assert output_module.remove_stale_runs(tmp_path) == [] and live.is_dir()
    finally:
        os.close(descriptor)


def test_a_run_keeps_its_nfs_like_lock_up_to_the_swap_and_closes_it_before_removing_its_marker(tmp_path, monkeypatch):
    """The flush before the swap opened and closed the marker through a second descriptor, which releases an NFS
    lock: from then to the swap another run took the live staging folder for a dead one's (a review's repro: the
    previous output removed and an empty folder put in place, "Wrote"). And a run removed its own marker while still
    holding it open, which NFS turns into a `.nfsXXXX` file that keeps the folder from going."""
    monkeypatch.setattr(output_module, "fcntl", _lockf_as_flock())
    probe = ("import fcntl, os, sys\n"
             "descriptor = os.open(sys.argv[1], os.O_RDONLY)\n"
             "try:\n    fcntl.lockf(descriptor, fcntl.LOCK_SH | fcntl.LOCK_NB)\n"
             "except OSError:\n    print('locked')\nelse:\n    print('free')\n")
    seen = []
    check_again = output_module._check_again

    def probed(output, *arguments):  # the last check, after the flush: is the staging folder still locked?
        (staging,) = tmp_path.glob(".out.*.partial")
        seen.append(subprocess.run([sys.executable, "-c", probe, str(staging / STAGING_MARKER)], capture_output=True,
                                   text=True, check=True).stdout.strip())
        return check_again(output, *arguments)

    monkeypatch.setattr(output_module, "_check_again", probed)
    output_module.write_repo_folder(tmp_path / "out", lambda folder: (folder / "weights.bin").write_bytes(b"w"),
                                    overwrite=False)
    assert seen == ["locked"] and (tmp_path / "out" / "weights.bin").read_bytes() == b"w"

    staging = output_module._marked_folder(tmp_path / "other", output_module.STAGING_SUFFIX)
    (staging / "weights.bin").write_bytes(b"w")
    unlink = Path.unlink
    open_when_removed = []

    def watched(path, *args, **kwargs):
        if path.name == STAGING_MARKER:
            open_when_removed.append(path.parent in output_module._MARKER_LOCKS)
        return unlink(path, *args, **kwargs)

    monkeypatch.setattr(Path, "unlink", watched)
    output_module._remove_own_folder(staging)
    assert open_when_removed == [False] and not staging.exists() and leftovers(tmp_path) == []


def test_a_marker_carried_into_place_does_not_make_the_output_a_live_runs_folder(tmp_path, tiny_source):
    """A run killed between its swap and the removal of its marker leaves the marker in the output; where that run
    could not lock it (NFS without locks) and was on another host, the output was refused for ever as "the working
    folder of a conversion that is still running". A marker that names the folder it is in came with a finished
    swap: the output is a previous output like any other."""
    out = tmp_path / "out"
    assert run_convert_in_process(tiny_source, out, "--max-new-tokens", "0", cwd=tmp_path)[0] == 0
    (out / STAGING_MARKER).write_text(json.dumps({"pid": 1, "host": "c0ffee", "output": str(out), "locked": False}))
    assert check_output_folder(out, overwrite=True) == out
    elsewhere = {"pid": 1, "host": "c0ffee", "output": str(tmp_path / "a"), "locked": False}
    (out / STAGING_MARKER).write_text(json.dumps(elsewhere))  # another run's working folder: refused
    with pytest.raises(ValueError, match="is the working folder of a conversion that is still running"):
        check_output_folder(out, overwrite=True)


def test_an_output_written_during_the_first_check_is_not_taken_for_the_checked_one(tmp_path, monkeypatch):
    """The state a run compares at its swap was read after its first check: another conversion's output that landed
    in between became the baseline, and this run replaced it, both saying "Wrote" (a review's repro)."""
    out, other = tmp_path / "out", tmp_path / "other"
    output_module.write_repo_folder(other, lambda folder: (folder / "config.json").write_text(
        json.dumps({"model_type": "dar"})), overwrite=False)
    check = output_module.check_output_folder

    def another_run_lands_during_the_check(*arguments, **keywords):
        checked = check(*arguments, **keywords)
        if not out.exists():
            os.rename(other, out)
        return checked

    monkeypatch.setattr(output_module, "check_output_folder", another_run_lands_during_the_check)
    before = tree_state(out.parent / "other")
    with pytest.raises(FileExistsError, match="was written by another process while this conversion ran"):
        output_module.write_repo_folder(out, lambda folder: (folder / "config.json").write_text("{}"), overwrite=True)
    assert tree_state(out) == before and leftovers(tmp_path) == []


def test_a_check_that_reads_an_output_while_another_run_swaps_it_reads_it_again(tmp_path, tiny_source, monkeypatch):
    """The manifest and the files were read by path one after the other, so a check during another run's swap could
    mix two folders and refuse a valid output as "changed since the conversion wrote it" (2-5 in 100 checks in the
    audit). A read during which the path changed folder is read again."""
    out, other = tmp_path / "out", tmp_path / "other"
    for folder in (out, other):
        assert run_convert_in_process(tiny_source, folder, "--max-new-tokens", "0", cwd=tmp_path)[0] == 0
    read = output_module._conversion_output_reason
    calls = []

    def swapped_while_read(folder):
        calls.append(folder)
        if len(calls) == 1:  # another run swaps its output in mid-read: this read mixed the two folders
            os.rename(folder, tmp_path / "aside")
            os.rename(other, folder)
            return "changed since the conversion wrote it: config.json"
        return read(folder)

    monkeypatch.setattr(output_module, "_conversion_output_reason", swapped_while_read)
    assert output_module.not_a_conversion_output(out) is None and len(calls) == 2


def test_the_run_marker_it_removes_from_the_output_is_only_its_own(tmp_path, caplog):
    """`_unmark` removed the marker by name: another run's, where that run's folder took the output's place before
    it, or it warned "could not be removed ... remove it yourself" about a file that was not there."""
    output, empty = tmp_path / "out", tmp_path / "empty"
    staging = output_module._marked_folder(output, output_module.STAGING_SUFFIX)
    other = output_module._marked_folder(tmp_path / "b", output_module.STAGING_SUFFIX)
    try:
        os.rename(other, output)  # another run's marked folder is at the output
        output_module._unmark(staging, output)
        assert (output / STAGING_MARKER).is_file()
        empty.mkdir()
        output_module._unmark(other, empty)  # no marker there at all: nothing to remove, nothing to say
        assert "remove it yourself" not in caplog.text
    finally:
        for folder in list(output_module._MARKER_LOCKS):
            output_module._release_marker(folder)


def test_the_clean_up_skips_a_folder_gone_since_its_listing_and_a_parent_made_meanwhile(tmp_path, monkeypatch):
    """Two runs in one parent folder: an entry of the stale-run clean-up's listing that another run renamed or removed
    before its lstat failed this run ("No such file or directory" naming the other run's folder); a parent folder the
    other run made between this run's check and its mkdir failed it with "File exists". Both are skipped now, and a
    parent this run did not make is not this run's to remove."""
    gone = tmp_path / ".out.gone1234.partial"
    lstat = os.lstat

    def vanished(path, *args, **kwargs):
        if Path(path) == gone:
            raise FileNotFoundError(errno.ENOENT, os.strerror(errno.ENOENT), str(path))
        return lstat(path, *args, **kwargs)

    gone.mkdir()
    monkeypatch.setattr(os, "lstat", vanished)
    assert output_module.remove_stale_runs(tmp_path) == []
    monkeypatch.setattr(os, "lstat", lstat)
    made_meanwhile = tmp_path / "new" / "deeper"
    made_meanwhile.parent.mkdir()
    lexists = os.path.lexists
    monkeypatch.setattr(os.path, "lexists", lambda path: Path(path) != made_meanwhile.parent and lexists(path))
    assert output_module._make_parents(made_meanwhile) == [made_meanwhile]


def test_an_error_after_the_swap_is_a_warning_not_nothing_was_written(tmp_path, tiny_source, monkeypatch, caplog):
    """The new output is in place: an error checking the replaced one (EIO) keeps that one, unmarked, and says so;
    the run succeeds (it said 'nothing was written' with the new output in place)."""
    out = tmp_path / "out"
    assert run_convert_in_process(tiny_source, out, "--max-new-tokens", "0", cwd=tmp_path)[0] == 0
    previous = os.lstat(out).st_ino

    def unreadable(folder, overwrite):
        raise OSError(errno.EIO, os.strerror(errno.EIO), str(folder))

    monkeypatch.setattr(output_module, "_changed_since_checked", unreadable)
    code, stderr = run_convert_in_process(tiny_source, out, "--overwrite", "--max-new-tokens", "0", cwd=tmp_path)
    assert code == 0, stderr
    assert_complete_output(out)
    (retired,) = tmp_path.glob(".out.*.old")
    assert os.lstat(retired / "out").st_ino == previous and os.lstat(out).st_ino != previous
    assert_complete_output(retired / "out")
    assert not (retired / STAGING_MARKER).exists()
    assert f"Wrote {out}. The folder it replaced changed while it was being replaced (it could not be read: " \
           f"Input/output error" in caplog.text and f"so it was kept, not removed: {retired / 'out'}" in caplog.text


def test_a_staging_folder_that_cannot_be_removed_is_named_and_stays_marked(tmp_path, tiny_source, monkeypatch,
                                                                            caplog):
    """The write fails and so does the clean-up (a file system gone read-only): the log names the staging folder
    (it was removed silently, or not at all, with its marker gone first), whose marker is removed last, so that a
    later run, once the process is gone, removes it."""

    def full(folder):
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC), str(folder / "model-00001-of-00002.safetensors"))

    unlink = os.unlink

    def read_only(path, *args, **kwargs):
        if Path(path).name == "tokenizer.json":
            raise OSError(errno.EROFS, os.strerror(errno.EROFS), str(path))
        return unlink(path, *args, **kwargs)

    monkeypatch.setattr(output_module, "_apply_umask", full)
    monkeypatch.setattr(os, "unlink", read_only)
    code, stderr = run_convert_in_process(tiny_source, tmp_path / "out", cwd=tmp_path)
    monkeypatch.setattr(os, "unlink", unlink)
    assert code == 1 and "No space left on device" in stderr
    (staging,) = tmp_path.glob(".out.*.partial")
    assert f"The staging folder {staging} could not be removed (Read-only file system" in caplog.text
    assert "remove it yourself" in caplog.text
    marker = json.loads((staging / STAGING_MARKER).read_text())
    (staging / STAGING_MARKER).write_text(json.dumps({**marker, "pid": _dead_pid()}))  # as after the process ended
    assert output_module.remove_stale_runs(tmp_path) == [staging] and leftovers(tmp_path) == []


def test_a_read_error_on_the_written_shards_is_a_write_error_naming_the_output(tmp_path, tiny_source, monkeypatch):
    """EIO while verification reads the staging folder's shards back: the disk written to failed, so the message is
    the output's (it blamed 'the source file' at a hidden path that no longer existed, or called the shard invalid)."""
    preadv = os.preadv

    def failing_disk(fd, buffers, offset, *args):
        if ".partial" in os.readlink(f"/proc/self/fd/{fd}"):
            raise OSError(errno.EIO, os.strerror(errno.EIO))
        return preadv(fd, buffers, offset, *args)

    monkeypatch.setattr(os, "preadv", failing_disk)
    out = tmp_path / "out"
    code, stderr = run_convert_in_process(tiny_source, out, "--max-new-tokens", "0", cwd=tmp_path)
    assert code == 1
    (line,) = messages(stderr)
    assert re.fullmatch(rf"dar convert: error: Could not write {re.escape(str(out))}: Input/output error reading back "
                        r"the written model-\d+-of-\d+\.safetensors to verify it; nothing was written\.", line), line
    assert list(tmp_path.iterdir()) == []


@pytest.mark.parametrize("failure", ["unreadable", "deleted while converting"])
def test_a_side_file_that_cannot_be_read_is_named_as_the_source_s(tmp_path, tiny_source, monkeypatch, failure):
    """A license or vocabulary file the output copies as it is: one this user may not read is refused before the
    conversion's work, one that goes away meanwhile when it is copied; both name the source file (they read as a
    failure to write the output)."""
    source = tmp_path / "source"
    shutil.copytree(tiny_source, source)
    license_file = source / "LICENSE"
    license_file.write_text("terms")
    if failure == "unreadable":
        os_open = os.open

        def denied(path, flags, *args, **kwargs):
            if Path(path) == license_file:
                raise PermissionError(errno.EACCES, os.strerror(errno.EACCES), str(path))
            return os_open(path, flags, *args, **kwargs)

        monkeypatch.setattr(os, "open", denied)
        reason = "Permission denied"
    else:
        copy_source_file = conversion_write.copy_source_file

        def deleted_first(path, copied):
            license_file.unlink(missing_ok=True)
            copy_source_file(path, copied)

        monkeypatch.setattr(conversion_write, "copy_source_file", deleted_first)
        reason = "No such file or directory"
    code, stderr = run_convert_in_process(source, tmp_path / "out", "--max-new-tokens", "0", cwd=tmp_path)
    assert code == 1
    (line,) = messages(stderr)
    assert line == f"dar convert: error: Could not read the source file {license_file}: {reason}."
    assert sorted(path.name for path in tmp_path.iterdir()) == ["source"]


@pytest.mark.parametrize("previous", [False, True])
def test_a_run_killed_at_the_swap_leaves_a_folder_the_next_run_removes_or_a_usable_output(tmp_path, tiny_source,
                                                                                          monkeypatch, previous):
    """The staging folder's marker was removed before the rename into place, so a SIGKILL there left the complete
    staging folder unmarked, a model's size that no later run removes. It keeps its marker through the rename now:
    killed before it, the next run removes the folder; killed right after, the output carries the marker, which an
    --overwrite run ignores (the output is its own)."""
    out = tmp_path / "out"
    if previous:
        assert run_convert_in_process(tiny_source, out, "--max-new-tokens", "0", cwd=tmp_path)[0] == 0

    class Killed(BaseException):  # what a SIGKILL at the rename leaves: no clean-up runs
        pass

    replace = os.replace

    def killed_at_the_swap(source, target, *args, **kwargs):
        if Path(source).name.endswith(".partial") and Path(target) == out:
            raise Killed
        return replace(source, target, *args, **kwargs)

    monkeypatch.setattr(os, "replace", killed_at_the_swap)
    monkeypatch.setattr(output_module, "_remove_own_folder", lambda folder: None)  # the dead run cleans nothing
    monkeypatch.setattr(output_module, "_exchanged_into_place", lambda *arguments: False)  # the two-step swap
    with pytest.raises(Killed):
        run_convert_in_process(tiny_source, out, "--max-new-tokens", "0", "--overwrite", cwd=tmp_path)
    monkeypatch.undo()
    (staging,) = tmp_path.glob(".out.*.partial")
    assert (staging / STAGING_MARKER).is_file()
    for descriptor in list(output_module._MARKER_LOCKS.values()):  # the process died: its locks with it
        os.close(descriptor)
    output_module._MARKER_LOCKS.clear()
    for retired in tmp_path.glob(".out.*.old"):  # a killed --overwrite: the previous output moved back by hand
        if not out.exists():
            os.replace(retired / "out", out)
        shutil.rmtree(retired)
    assert output_module.remove_stale_runs(tmp_path) == [staging] and leftovers(tmp_path) == []

    # killed right after the rename: the output holds the marker, and an --overwrite run still takes it as its own
    code, stderr = run_convert_in_process(tiny_source, out, "--max-new-tokens", "0", "--overwrite", cwd=tmp_path)
    assert code == 0, stderr
    (out / STAGING_MARKER).write_text(json.dumps({"pid": _dead_pid(), "host": "h", "output": str(out)}))
    code, stderr = run_convert_in_process(tiny_source, out, "--max-new-tokens", "0", "--overwrite", cwd=tmp_path)
    assert code == 0, stderr
    assert_complete_output(out)
    assert not (out / STAGING_MARKER).exists() and leftovers(tmp_path) == []


def test_a_run_killed_at_any_step_of_an_overwrite_swap_leaves_an_output_in_place(tmp_path, tiny_source, monkeypatch,
                                                                                  caplog):
    """A SIGKILL between the two renames of `--overwrite` (the old output moved aside, the new one not yet in place)
    left no output at all (a helper's kill sweep); the old one was in a retired folder that only the next run named.
    Where the system swaps two folders in one step (`renameat2(RENAME_EXCHANGE)`), the new output is parked in the
    retired folder and exchanged with the old one: a run killed before any file operation of the swap leaves the old
    or the new output in place, complete, and the next run removes what the dead run left, naming no previous output
    to move back."""
    out = tmp_path / "out"
    assert run_convert_in_process(tiny_source, out, "--max-new-tokens", "0", cwd=tmp_path)[0] == 0
    old = tree_state(out)

    class Killed(BaseException):  # what a SIGKILL leaves: no clean-up runs
        pass

    real_replace, real_exchange = os.replace, getattr(output_module, "_exchange", None)
    steps = {"seen": 0, "kill_at": 0, "active": False}

    def step():
        if steps["active"]:
            steps["seen"] += 1
            if steps["seen"] == steps["kill_at"]:
                raise Killed

    def replace(source, target, *args, **kwargs):
        step()
        return real_replace(source, target, *args, **kwargs)

    def exchange(first, second):
        step()
        return real_exchange(first, second)

    real_unmark = output_module._unmark

    def unmark(*arguments):  # the first step after the new output is in place
        step()
        return real_unmark(*arguments)

    move = output_module._move_into_place

    def watched_move(*arguments):
        steps["active"] = True
        try:
            return move(*arguments)
        finally:
            steps["active"] = False

    outcomes = []
    for kill_at in range(1, 4):  # park the new output, exchange, unmark it
        steps.update(seen=0, kill_at=kill_at)
        with monkeypatch.context() as patched:
            patched.setattr(os, "replace", replace)
            patched.setattr(output_module, "_exchange", exchange, raising=False)
            patched.setattr(output_module, "_unmark", unmark)
            patched.setattr(output_module, "_move_into_place", watched_move)
            patched.setattr(output_module, "_remove_own_folder", lambda folder: None)  # the dead run cleans nothing
            with pytest.raises(Killed):
                run_convert_in_process(tiny_source, out, "--max-new-tokens", "0", "--overwrite", "--block-size", "1",
                                       cwd=tmp_path)
        for descriptor in list(output_module._MARKER_LOCKS.values()):  # the process died: its locks with it
            os.close(descriptor)
        output_module._MARKER_LOCKS.clear()
        assert out.is_dir(), f"no output in place after a kill at step {kill_at}"
        state = tree_state(out, skip=out / STAGING_MARKER)
        outcomes.append("old" if state == old else "new")
        if outcomes[-1] == "new":
            assert json.loads((out / "config.json").read_text())["dar_block_size"] == 1
        caplog.clear()
        output_module.remove_stale_runs(tmp_path)
        assert leftovers(tmp_path) == [] and "moved aside by a conversion that did not finish" not in caplog.text
        code, stderr = run_convert_in_process(tiny_source, out, "--max-new-tokens", "0", "--overwrite", cwd=tmp_path)
        assert code == 0, stderr
        assert_complete_output(out)
        old = tree_state(out)
    assert outcomes == ["old", "old", "new"]
