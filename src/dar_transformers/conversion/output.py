# SPDX-License-Identifier: Apache-2.0
# Copyright 2026 The dar-transformers authors.
"""The output folder of a conversion: checked against the source, written in a staging folder, moved into place.

The rules (users point `dar convert` at the only copy of a checkpoint):

- Every path is resolved (symlinks, `..`, relative) before anything is written, and compared by identity (device and
  inode, which also sees bind mounts) as well as by name.
- The source is sacred. For a source folder, the output may not be it, lie inside it or contain it; the same holds
  for the target of every symlink at the folder's top level (a Hub cache snapshot links into `blobs/`). For a source
  file (GGUF), the output may not be the file or a folder that contains it (or contains the symlink to it); a new
  folder next to the file is fine. This holds with and without `overwrite`.
- An existing output folder is replaced only when empty, or with `overwrite` when it is a previous conversion output
  exactly as the conversion left it: every file and folder in it is listed in the manifest (`MANIFEST_NAME`) the
  conversion wrote last, with the size and modification time it had then. Anything else is refused: a user's file
  moved in, a Trainer's checkpoint-N/, weights saved again by `save_pretrained`, an edited model card, an output of a
  version that wrote no manifest. Symlinks in the output are never followed.
- The output may not be a mount point (or lie on another device than its parent): the swap renames folders in the
  parent, which cannot replace a mount point. Nor the current working folder, which the swap would leave removed
  under the user's shell. Both refused before any work.
- The new folder is written and verified in a staging folder next to the output, flushed to the disk (fsync), and
  only then renamed into place: over no folder or an empty one by one rename, which the system refuses if another
  process wrote a folder there meanwhile; a replaced output is exchanged with it in one step where the system can
  (`_exchanged_into_place`; else moved aside first) and removed last, once the swap is on the disk (kept, with a
  warning, if it was written to after its last check). An output that another process wrote or replaced since the
  first check (another conversion into it) is refused, left as it is (`_check_again`); the last check and the swap
  hold the parent folder locked, so that two runs do not check and swap in between each other
  (`_swaps_one_at_a_time`). The new folder takes the replaced folder's permission bits (setgid included) and, as far
  as this process may, its owner and group. Signals are held back while folders are swapped or cleaned up, and any
  error (or interrupt) removes what this run created; an interrupt after the swap says that the output was written.
- Staging and retired folders carry a marker file (`STAGING_MARKER`) naming the run's process, which the run holds
  locked (`flock`) while the folder is its own (a staging folder until it is renamed into place); a later run removes
  those of runs that are no longer alive (a SIGKILL leaves them behind: where locks work, a free lock says so) and
  never touches a folder without it, a symlink, nor one whose marker is still locked (a run whose process id means
  nothing here: another container with the same host name and its own process ids). Its own run opens the marker for
  writing, writes and flushes it only through that locked descriptor, and closes it before removing it (NFS's
  emulated locks, `_marked_folder`).
"""

import contextlib
import ctypes
import errno
import gc
import json
import os
import re
import shutil
import signal
import socket
import stat
import tempfile
import threading
import uuid
from collections.abc import Callable, Iterable, Iterator
from pathlib import Path

from transformers.utils import logging

from ..configuration_dar import DAR_MODEL_TYPES  # a previous output's: the non-empty folders overwrite replaces

try:  # POSIX: a run holds its markers locked (`_marked_folder`); elsewhere the process id alone decides
    import fcntl
except ImportError:
    fcntl = None

logger = logging.get_logger(__name__)

# The file a conversion writes last in its output: every file (with its size and st_mtime_ns) and folder it wrote.
# `overwrite` replaces a folder only when it holds exactly what this lists, unchanged.
MANIFEST_NAME = ".dar-convert-manifest.json"
MANIFEST_FORMAT = 1
# A file inside each staging (`.partial`) and retired (`.old`) folder this package creates: who created it.
STAGING_MARKER = ".dar-convert-run.json"
STAGING_SUFFIX, RETIRED_SUFFIX = ".partial", ".old"
# Signals that must not cut a swap or a clean-up in half (the CLI turns SIGTERM and SIGHUP into exceptions too).
HELD_SIGNALS = {signal.SIGINT, signal.SIGTERM} | ({signal.SIGHUP} if hasattr(signal, "SIGHUP") else set())
# The open, locked marker of each staging and retired folder of this process (folder -> file descriptor).
_MARKER_LOCKS: dict[Path, int] = {}


def resolve_path(path: str | os.PathLike) -> Path:
    """The absolute path with every symlink and `..` resolved (as far as the path exists)."""
    return Path(os.path.realpath(os.fspath(path)))


def check_output_folder(output: str | os.PathLike, overwrite: bool, source: object = None) -> Path:
    """The resolved output folder, after refusing one that is, contains or lies inside the source (always), a path
    that is not a folder, and a non-empty folder unless `overwrite` and it is a previous conversion output.

    `source`: the source folder or file (a path), or an in-memory model, whose files are those of the folder it was
    loaded from (`loaded_from`)."""
    if not isinstance(output, (str, os.PathLike)):
        raise TypeError(f"The output must be a folder path (str or os.PathLike), got {type(output).__name__} "
                        f"{output!r}.")
    given = os.fspath(output)
    if not given.strip():  # `dar convert SRC "$OUT"` with OUT unset: not the current folder
        raise ValueError(f"Output {given!r} is an empty path (an unset shell variable?); name the folder to write, "
                         "for example ./model-dar.")
    output = resolve_path(given)
    shown = f"{given} (resolved: {output})" if str(output) != given else given
    try:
        os.fsencode(output).decode("utf-8")
    except UnicodeDecodeError:  # else refused only after the whole write, by the tokenizer's (Rust) writer
        raise ValueError(f"Output {ascii(str(output))} is not a valid UTF-8 path, which the tokenizer's writer (and "
                         "the Hub) need; choose an output folder whose path is UTF-8.") from None
    if isinstance(source, (str, os.PathLike)):
        _refuse_source_overlap(output, shown, source)
    elif (folder := loaded_from(source)) is not None:
        _refuse_source_overlap(output, shown, folder, in_memory=True)
    if os.path.lexists(output) and not output.is_dir():
        raise FileExistsError(f"Output {shown} exists and is not a folder; choose a new or empty folder.")
    blocking = _nearest_existing(output)
    if not blocking.is_dir():
        raise NotADirectoryError(f"Output {shown} lies under {blocking}, which is not a folder.")
    _refuse_names_too_long_to_stage(output, shown, blocking)
    if output.is_dir() and _is_mount_point(output):
        raise ValueError(
            f"Output folder {shown} is a mount point (or lies on another file system than {output.parent}): the "
            f"conversion writes a staging folder beside the output, in {output.parent}, and renames it into place, "
            f"which cannot replace a mount point. Choose a new folder inside it, e.g. "
            f"{output / _suggested_name(source)}."
        )
    working = _working_folder_relation(output) if output.is_dir() else None
    if working is not None:
        raise ValueError(
            f"Output folder {shown} {working} the current working folder: the conversion writes a staging folder "
            "beside it and renames it into place, which would leave your shell in the replaced folder, removed (empty "
            f"to ls, the output beside it under the same name). Name a new folder, e.g. ./{_suggested_name(source)}, "
            f"or run the command from {output.parent}."
        )
    marker = _read_marker(output) if output.is_dir() else None
    # (a marker naming the output itself was carried into place by a swap whose run was killed before removing it)
    if marker is not None and marker.get("output") != str(output) and not _run_ended(output, marker):
        raise ValueError(
            f"Output folder {shown} is the working folder of a conversion that is still running (process "
            f"{marker.get('pid')} on {marker.get('host')}, writing {marker.get('output')}); choose another output."
        )
    if output.is_dir() and any(output.iterdir()):
        if not overwrite:
            raise FileExistsError(
                f"Output folder {shown} exists and is not empty; choose a new or empty folder, or pass --overwrite "
                f"(overwrite=True) to replace a previous conversion output.{_left_staging_note(output)}"
            )
        reason = not_a_conversion_output(output)
        if reason:
            raise FileExistsError(
                f"Output folder {shown} is not empty and is not a previous conversion output ({reason}); --overwrite "
                "replaces only those. Choose a new or empty folder, or move this one away yourself."
            )
    _refuse_unwritable(output, shown)
    return output


def _left_staging_note(output: Path) -> str:
    """A sentence naming the staging folders beside `output` that killed runs into it left (their marker's output is
    `output` and their run ended: what `remove_stale_runs` removes), for a refusal that comes before that clean-up, so
    that a hidden folder as large as the model does not stay unnoticed; empty if there is none."""
    left = []
    with contextlib.suppress(OSError):  # a parent that cannot be listed: nothing named
        for entry, marker in _marked_folders(output.parent, f".{output.name}.", (STAGING_SUFFIX,)):
            if marker.get("output") == str(output) and _run_ended(entry, marker):
                with contextlib.suppress(OSError):  # one that cannot be read (or went meanwhile): not named
                    size = sum(status.st_size for _, status in walk_without_symlinks(entry)
                               if stat.S_ISREG(status.st_mode))
                    left.append(f"{entry} ({size / 2**30:.2f} GiB)")
    if not left:
        return ""
    one = len(left) == 1
    return (f" Beside it, {_first_few(left)} {'is the staging folder' if one else 'are staging folders'} of an "
            f"earlier run into it that did not finish; the next run that writes in {output.parent} removes "
            f"{'it' if one else 'them'}, or remove {'it' if one else 'them'} yourself.")


def _run_ended(entry: Path, marker: dict) -> bool:
    """Whether the run that marked `entry` has ended: its marker's lock is free where its run held it (the marker
    says whether it could: `_marked_folder`; one written before it said so, by a version that locked where the file
    system let it, is taken as locked), else its process is gone from this host (a marker of another host, or of an
    unknown process, counts as alive)."""
    locked = _marker_locked(entry)
    if locked is False and marker.get("locked") is False:  # its run could not lock it: a free lock says nothing
        locked = None
    if locked is None:
        return marker.get("host") == socket.gethostname() and not _alive(marker.get("pid"))
    return not locked


def _may_write(path: Path, mode: int = os.W_OK) -> bool:
    """Whether this process may write `path` (`mode`), by its effective ids where the system can tell."""
    return os.access(path, mode, effective_ids=os.access in os.supports_effective_ids)


def _refuse_unwritable(output: Path, shown: str) -> None:
    """Refuse, before any work, an output the swap could not make: the staging folder is created in the output's
    parent (or the nearest existing ancestor, which gets the missing folders), which needs write permission there,
    and an existing output folder is moved aside into a folder beside it (`_retire`), which needs write permission on
    it (a folder's `..` entry changes). Else a read-only previous output was found only at the swap, after the whole
    conversion, and a read-only parent was named by the hidden staging path the run had tried to create."""
    parent = _nearest_existing(output.parent)
    if not _may_write(parent, os.W_OK | os.X_OK):
        raise PermissionError(
            f"Output {shown}: the folder {parent} is not writable ({_mode_and_file_system(parent)}), and the "
            f"conversion creates its staging folder (and any missing folder) there. Choose an output in a folder you "
            "can write to."
        )
    if os.path.lexists(output) and not _may_write(output):
        raise PermissionError(
            f"Output folder {shown} is not writable ({_mode_and_file_system(output)}): replacing it moves it aside "
            f"into a folder beside it, which needs write permission on it. Make it writable (chmod u+w {output}) or "
            "choose another output."
        )
    user = os.geteuid() if hasattr(os, "geteuid") else 0
    if os.path.lexists(output) and user != 0:  # root renames anything (CAP_FOWNER)
        folder, existing = os.stat(output.parent), os.lstat(output)
        if folder.st_mode & stat.S_ISVTX and user not in (folder.st_uid, existing.st_uid):
            raise PermissionError(
                f"Output folder {shown} belongs to user {existing.st_uid}, in {output.parent}, whose sticky bit (mode "
                f"{stat.filemode(folder.st_mode)}, as /tmp has) lets only an entry's owner or the folder's rename or "
                "replace it: the conversion could not put its output in place. Choose an output of your own (a new "
                "folder), or ask its owner to remove it."
            )


def _mode_and_file_system(path: Path) -> str:
    """Why `path` cannot be written, as far as its status tells: "mode dr-xr-xr-x, owner 1000", "a read-only file
    system", or a mode that would allow it followed by what else forbids it."""
    try:
        if os.statvfs(path).f_flag & os.ST_RDONLY:
            return "a read-only file system"
        status = os.stat(path)
    except OSError as error:
        return _describe(error)
    mode = f"mode {stat.filemode(status.st_mode)}, owner {status.st_uid}"
    user = os.geteuid() if hasattr(os, "geteuid") else None
    bit = stat.S_IWUSR if status.st_uid == user else stat.S_IWGRP if status.st_gid in os.getgroups() else stat.S_IWOTH
    if status.st_mode & bit:
        mode += (", which allows it: an immutable attribute (chattr +i), an access control list or a security module "
                 "forbids it")
    return mode


def _refuse_names_too_long_to_stage(output: Path, shown: str, existing: Path) -> None:
    """The run writes beside the output under its name plus 18 characters (`_marked_folder`: `.NAME.XXXXXXXX.partial`);
    a name the file system takes but not that one failed only after the staging folder's creation, naming the hidden
    folder instead of the output."""
    try:
        limit = os.pathconf(existing, "PC_NAME_MAX")
    except (OSError, ValueError):
        return
    name = len(os.fsencode(output.name))
    added = len(".." + "X" * 8) + max(len(STAGING_SUFFIX), len(RETIRED_SUFFIX))  # mkdtemp's 8 random characters
    if name + added > limit:
        raise ValueError(
            f"Output {shown}: its name is {name} bytes long, and the conversion stages its folder beside it under a "
            f"name {added} bytes longer, beyond this file system's {limit}; choose a name of at most {limit - added} "
            "bytes."
        )


def not_a_conversion_output(folder: Path) -> str | None:
    """Why `folder` is not a previous conversion output exactly as the conversion left it (None if it is): it holds
    the conversion's manifest (`MANIFEST_NAME`), every file and folder in it is listed there, each listed file is
    still there with its size and modification time, and its config.json has a DAR `model_type`. So a user's file
    moved or copied in (mv, cp -a and tar keep old times), a Trainer's checkpoint-N/, weights saved again by
    `save_pretrained`, an edited card, or a DAR model saved elsewhere, are each a reason. Symlinks are not followed.
    The manifest and the files are read by path, one after the other: a folder swapped at that path meanwhile (another
    conversion's swap) mixes two folders' files, so a read during which the path changed folder is read again."""
    for _ in range(3):
        before = _identity(folder)
        reason = _conversion_output_reason(folder)
        if _identity(folder) == before:
            break
    return reason


def _conversion_output_reason(folder: Path) -> str | None:
    manifest_path = folder / MANIFEST_NAME
    if not os.path.lexists(manifest_path):
        if not _has_dar_config(folder):
            return f"no {MANIFEST_NAME}, and no config.json with model_type {' or '.join(map(repr, DAR_MODEL_TYPES))}"
        return (f"no {MANIFEST_NAME}, the list of the files a conversion wrote (an output of a dar-transformers "
                "version that wrote none, or one whose list was deleted): without it the conversion's files cannot be "
                "told from yours")
    try:
        files, folders = _read_manifest(manifest_path)
        found = {path: status for path, status in walk_without_symlinks(folder)  # a run killed right after its swap
                 if path not in (MANIFEST_NAME, STAGING_MARKER)}  # leaves its marker (`_move_into_place`)
    except (OSError, ValueError) as error:
        return f"{MANIFEST_NAME} or the folder cannot be read ({error})"
    unlisted = {path for path in found if path not in files and path not in folders}
    if unlisted:  # name what was added, not each file inside a folder that was added
        return f"not written by the conversion: {_first_few(p for p in unlisted if _parent(p) not in unlisted)}"
    missing = [path for path in [*files, *folders] if path not in found]
    if missing:
        return f"missing since the conversion wrote it: {_first_few(missing)}"
    changed = [path for path, written in files.items()
               if not stat.S_ISREG(found[path].st_mode) or (found[path].st_size, found[path].st_mtime_ns) != written]
    changed += [path for path in folders if not stat.S_ISDIR(found[path].st_mode)]
    if changed:
        return f"changed since the conversion wrote it: {_first_few(changed)}"
    if not _has_dar_config(folder):
        return f"no config.json with model_type {' or '.join(map(repr, DAR_MODEL_TYPES))}"
    return None


def write_manifest(folder: Path) -> None:
    """Write `MANIFEST_NAME` into a complete output `folder`: every folder, and every file with its size and
    st_mtime_ns (the staging marker, removed before the swap, and an earlier manifest left out), and a random id of
    this output (`run`: what a retired folder's marker names as its replacement, `_replaced_by`). Call once nothing
    else will be written."""
    files, folders = {}, []
    for path, status in sorted(walk_without_symlinks(folder)):
        if path in (STAGING_MARKER, MANIFEST_NAME):
            continue
        if stat.S_ISDIR(status.st_mode):
            folders.append(path)
        elif stat.S_ISREG(status.st_mode):
            files[path] = {"size": status.st_size, "mtime_ns": status.st_mtime_ns}
        # nothing else is written by a conversion; were it, being unlisted keeps `overwrite` from replacing it
    manifest = {"format": MANIFEST_FORMAT, "written_by": "dar convert", "run": uuid.uuid4().hex, "folders": folders,
                "files": files}
    (folder / MANIFEST_NAME).write_text(json.dumps(manifest, indent=1) + "\n", encoding="utf-8")


def walk_without_symlinks(folder: Path) -> Iterator[tuple[str, os.stat_result]]:
    """(path relative to `folder`, in POSIX form; its lstat) of every entry under `folder`; a symlink is an entry of
    its own, never followed."""
    pending = [folder]
    while pending:
        current = pending.pop()
        with os.scandir(current) as entries:
            for entry in entries:
                status = entry.stat(follow_symlinks=False)
                yield Path(entry.path).relative_to(folder).as_posix(), status
                if stat.S_ISDIR(status.st_mode):
                    pending.append(Path(entry.path))


def _read_manifest(path: Path) -> tuple[dict[str, tuple[int, int]], set[str]]:
    """The files (path -> (size, mtime_ns)) and folders a manifest lists; ValueError if it is not one."""
    if not stat.S_ISREG(os.lstat(path).st_mode):
        raise ValueError(f"{MANIFEST_NAME} is not a plain file")
    manifest = json.loads(path.read_text(encoding="utf-8"))
    try:
        if manifest["format"] != MANIFEST_FORMAT:
            raise ValueError(f"{MANIFEST_NAME} has format {manifest['format']!r}, not {MANIFEST_FORMAT}")
        files = {str(name): (int(entry["size"]), int(entry["mtime_ns"])) for name, entry in manifest["files"].items()}
        folders = set(map(str, manifest["folders"]))
    except (KeyError, TypeError, AttributeError) as error:
        raise ValueError(f"{MANIFEST_NAME} is not a manifest ({type(error).__name__}: {error})") from error
    return files, folders


def _has_dar_config(folder: Path) -> bool:
    config_path = folder / "config.json"
    try:
        if not stat.S_ISREG(os.lstat(config_path).st_mode):
            return False
        config = json.loads(config_path.read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return False
    return isinstance(config, dict) and config.get("model_type") in DAR_MODEL_TYPES


def _parent(path: str) -> str:
    return path.rpartition("/")[0]


def _first_few(paths: Iterable[str], count: int = 5) -> str:
    paths = sorted(paths)
    return ", ".join(paths[:count]) + (f" and {len(paths) - count} more" if len(paths) > count else "")


def _is_mount_point(folder: Path) -> bool:
    """True if renaming `folder` within its parent is impossible: a mount point, a folder on another device than its
    parent, or a bind mount of a folder of the same file system (listed in /proc/self/mountinfo)."""
    if os.path.ismount(folder) or os.stat(folder).st_dev != os.stat(folder.parent).st_dev:
        return True
    return str(folder) in _mount_points()


def _mount_points() -> set[str]:
    """The mount points the kernel lists for this process (field 5 of /proc/self/mountinfo, octal escapes decoded);
    empty where there is no such file."""
    try:
        lines = Path("/proc/self/mountinfo").read_text(encoding="utf-8", errors="surrogateescape").splitlines()
    except OSError:
        return set()
    fields = [line.split(" ") for line in lines]
    octal = re.compile(r"\\([0-7]{3})")  # mountinfo writes a space as \040
    return {octal.sub(lambda match: chr(int(match.group(1), 8)), field[4]) for field in fields if len(field) > 4}


def _suggested_name(source: object) -> str:
    """The output name a refusal suggests: the source folder's name (a file's stem) + "-dar"."""
    if not isinstance(source, (str, os.PathLike)):
        return "dar-model"
    source = Path(source)
    return (source.name if source.is_dir() else source.stem) + "-dar"


def loaded_from(model: object) -> str | None:
    """The local folder an in-memory model was loaded from (`config.name_or_path`, as `from_pretrained` sets it), or
    None: a Hub id, a model built from a config, a folder that is gone."""
    name = getattr(getattr(model, "config", None), "name_or_path", None)
    return name if isinstance(name, str) and name and os.path.isdir(name) else None


def _refuse_source_overlap(output: Path, shown: str, source: str | os.PathLike, in_memory: bool = False) -> None:
    """Refuse an output that is, lies inside or contains the source (`_protected_paths`); `in_memory`: `source` is
    the folder an in-memory model was loaded from, whose checkpoint a conversion of the model must keep too (an
    output inside it only where it is an HF folder: one loaded with `gguf_file=` names the folder of the file, which
    the path form's protection of the file alone leaves free)."""
    source_path = resolve_path(source)
    if not os.path.exists(source_path):
        return  # nothing to protect; the source's own check names the missing path
    inside_refused = not in_memory or (source_path / "config.json").is_file()
    for protected, is_folder, what in _protected_paths(Path(source), source_path):
        relation = None
        if _same(output, protected):
            relation = "is"
        elif is_folder and inside_refused and _inside(output, protected):
            relation = "lies inside"
        elif _inside(protected, output):
            relation = "contains"
        if relation:
            suggestion = source_path.with_name(_suggested_name(source_path))
            loaded = (" (the folder the in-memory model was loaded from, its config.name_or_path)"
                      if in_memory and protected == source_path else "")
            raise ValueError(
                f"Output {shown} {relation} {what} {protected}{loaded}; the source is never modified, with or without "
                f"--overwrite. Choose an output folder outside it, e.g. {suggestion}."
            )


def _protected_paths(given: Path, source: Path) -> Iterator[tuple[Path, bool, str]]:
    """(path, is a folder, description) of what the output must keep clear of: the source, the targets of the
    symlinks anywhere in a source folder (an index may list shards in a subfolder, and a Hub cache's snapshot links
    every file), and the symlink itself for a symlinked source file."""
    if source.is_dir():
        yield source, True, "the source folder"
        folders = [source]
        while folders:  # the whole tree, not following links into other folders (their targets are protected whole)
            try:
                entries = list(os.scandir(folders.pop()))
            except OSError:  # a subfolder this user cannot list (its files may still open by name: the index's below)
                continue
            for entry in entries:
                if entry.is_symlink():
                    if os.path.exists(entry.path):
                        target = resolve_path(entry.path)
                        name = Path(entry.path).relative_to(source)
                        yield target, target.is_dir(), f"the target of the source's symlink {name},"
                elif entry.is_dir():
                    folders.append(Path(entry.path))
        with contextlib.suppress(OSError, ValueError, KeyError, TypeError, AttributeError):  # the reader names those
            listed = set(json.loads((source / "model.safetensors.index.json").read_text())["weight_map"].values())
            for file in sorted(listed):  # the shards the index lists, reached by a link the walk could not list
                target = resolve_path(source / file) if os.path.exists(source / file) else None
                if target is not None and not _inside(target, source):
                    yield target, target.is_dir(), f"the file the source's index lists as {file},"
    else:
        yield source, False, "the source file"
    if given.is_symlink():  # the source was named through a symlink: keep that too
        yield resolve_path(given.absolute().parent) / given.name, False, "the symlink to the source"


def _identity(path: Path) -> tuple[int, int] | None:
    try:
        status = os.stat(path)
    except OSError:
        return None
    return status.st_dev, status.st_ino


def _same(first: Path, second: Path) -> bool:
    identity = _identity(first)
    return first == second or (identity is not None and identity == _identity(second))


def _working_folder_relation(folder: Path) -> str | None:
    """"is" where `folder` is the current working folder, "holds" where it holds it (replacing it would leave the shell
    in a removed folder), else None."""
    try:
        working = Path.cwd()
    except OSError:  # the working folder was removed
        return None
    return "is" if _same(folder, working) else "holds" if _inside(working, folder) else None


def _inside(inner: Path, outer: Path) -> bool:
    """True if `inner` is strictly inside the folder `outer` (by name, or by identity of an existing ancestor)."""
    if outer in inner.parents:
        return True
    outer_identity = _identity(outer)
    if outer_identity is None:
        return False
    existing = inner if _identity(inner) is not None else _nearest_existing(inner)
    ancestors = [existing] if existing != inner else []
    ancestors += list(existing.parents)
    return any(_identity(ancestor) == outer_identity for ancestor in ancestors)


def _nearest_existing(path: Path) -> Path:
    """`path` or its nearest ancestor that exists."""
    while not os.path.lexists(path) and path != path.parent:
        path = path.parent
    return path


# --------------------------------------------------------------------------------------------------------------
# Writing.


class OutputWriteError(OSError):
    """An OS error while writing the output folder (permission, read-only mount, no space, ...), as one line that
    names the output; `errno` is the original error's."""


@contextlib.contextmanager
def signals_held() -> Iterator[None]:
    """Hold SIGINT, SIGTERM and SIGHUP back until the block ends, so that a folder swap or a clean-up runs to its
    end; a signal that arrived meanwhile is raised again afterwards. (A Python handler runs in the main thread whatever
    thread the signal reached, so the handlers are swapped rather than the thread's signal mask.) Only the main thread
    can do this; elsewhere it holds nothing. SIGKILL cannot be held: the marker lets the next run clean up after it.
    Yields the list of the signals held so far, for a block that undoes its work when one arrived."""
    if threading.current_thread() is not threading.main_thread():
        yield []
        return
    received: list[int] = []
    previous = {}
    for signum in HELD_SIGNALS:
        handler = signal.getsignal(signum)
        if handler is not None and handler != signal.SIG_IGN:
            previous[signum] = signal.signal(signum, lambda number, frame: received.append(number))
    try:
        yield received
    finally:
        for signum, handler in previous.items():
            signal.signal(signum, handler)
        if received:
            signal.raise_signal(received[0])


class _LostInterrupts:
    """The signals whose handlers raised an interrupt (Ctrl-C's KeyboardInterrupt, the CLI's SIGTERM and SIGHUP)
    while `interrupts_kept` was open. An exception raised while a finalizer runs (a `__del__`, a weakref callback) is
    printed as "Exception ignored in ..." and dropped, and a signal's handler runs wherever the main thread is: such an
    interrupt was lost, and the conversion went on to put its output in place and exit 0."""

    def __init__(self):
        self.received: list[tuple[int, Callable]] = []

    def raise_lost(self) -> None:
        """Raise the first interrupt again by its own handler, if the code that received it has gone on since: every
        interrupt that propagates leaves the block before this is reached."""
        if self.received:
            signum, handler = self.received[0]
            self.received.clear()
            handler(signum, None)


@contextlib.contextmanager
def interrupts_kept() -> Iterator[_LostInterrupts]:
    """Wrap the handlers of `HELD_SIGNALS` that raise an interrupt (`signal.default_int_handler`, or one marked
    `raises_interrupt`, as the CLI's are) so that each signal is noted before its handler raises; `raise_lost()` then
    raises one that a finalizer swallowed. Handlers that do not raise are left alone, so is any thread but the main
    one (where no handler can be set)."""
    kept = _LostInterrupts()
    if threading.current_thread() is not threading.main_thread():
        yield kept
        return
    previous = {}
    for signum in HELD_SIGNALS:
        handler = signal.getsignal(signum)
        if handler is signal.default_int_handler or getattr(handler, "raises_interrupt", False):
            def noted(number, frame, handler=handler):
                kept.received.append((number, handler))
                handler(number, frame)
            previous[signum] = signal.signal(signum, noted)
    try:
        yield kept
    finally:
        for signum, handler in previous.items():
            signal.signal(signum, handler)


def write_repo_folder(output: Path, write: Callable[[Path], None], overwrite: bool, source: object = None) -> None:
    """Run `write(folder)` on a staging folder next to `output`, add the manifest of what it wrote, then move it into
    place (all or nothing).

    The output is checked (`check_output_folder`) before anything is created and again just before the swap; the
    new folder's files are flushed to the disk before it (`_fsync`); an existing output (empty, or a previous
    conversion with `overwrite`) is moved aside only once the new folder is complete, then removed; the new folder
    takes its permission bits, owner and group (`_take_over_metadata`). On any error or interrupt, the staging folder
    and the parent folders this call created are removed and the error propagates; an OS error is re-raised as one
    `OSError` line that names the output, an interrupt with `output_written`: whether the new output is in place."""
    read_before = isinstance(output, (str, os.PathLike))  # what is there before the check (else it says why)
    try:
        before = _output_state(resolve_path(output)) if read_before else None
    except OSError:
        read_before, before = False, None
    output = check_output_folder(output, overwrite, source)
    checked = _output_state(output)
    if read_before and checked is not None and checked != before:  # the check passed another run's output
        raise FileExistsError(_written_meanwhile(output, before))
    created: list[Path] = []
    staging = None
    swapped = False
    swap_turn = contextlib.ExitStack()
    try:
        try:
            remove_stale_runs(output.parent)
            with signals_held():
                created = _make_parents(output.parent)
                staging = _marked_folder(output, STAGING_SUFFIX)
            with interrupts_kept() as interrupts:
                write(staging)
                _apply_umask(staging)
                write_manifest(staging)  # last: what `overwrite` may replace later
                for path, status in walk_without_symlinks(staging):  # on the disk before the rename makes it the output
                    if path == STAGING_MARKER:  # through its locked descriptor: closing another releases an NFS lock
                        os.fsync(_MARKER_LOCKS[staging])
                    elif stat.S_ISREG(status.st_mode) or stat.S_ISDIR(status.st_mode):
                        _fsync(staging / path)
                _fsync(staging)
                swap_turn.enter_context(_swaps_one_at_a_time(output.parent))  # to the end of the swap
                _check_again(output, overwrite, source, checked)  # another process may have written it meanwhile
                interrupts.raise_lost()  # one a finalizer swallowed stops the conversion here, nothing in place
            with signals_held():
                _move_into_place(staging, output, checked)
                staging, swapped = None, True
        except OSError as error:
            if error.errno is None:  # one of this module's own refusals, already one line
                raise
            raise _write_error(output, error.errno, _describe(error), getattr(error, "kept", None)) from error
        except Exception as error:
            number = rust_os_errno(error)
            if number is None:
                raise
            raise _write_error(output, number, str(error)) from error
        finally:
            with signals_held():
                swap_turn.close()
                if staging is not None and os.path.lexists(staging):
                    _remove_own_folder(staging)
                if staging is not None:
                    _release_marker(staging)
                for folder in reversed(created):
                    with contextlib.suppress(OSError):
                        folder.rmdir()  # only if still empty
    except KeyboardInterrupt as interrupt:  # one held during the swap or the clean-up is raised after them
        interrupt.output_written = swapped
        raise


def _output_state(output: Path) -> str | None:
    """What a check found at `output`, to tell later whether another process changed it since: None for no folder or
    an empty one, else its manifest's run id (`write_manifest`; "" for a folder without one)."""
    if not output.is_dir() or not any(output.iterdir()):
        return None
    return output_run_id(output) or ""


@contextlib.contextmanager
def _swaps_one_at_a_time(parent: Path) -> Iterator[None]:
    """Hold the output's parent folder locked (`flock`) from the last check to the end of the swap, so that of two
    conversions into one output the later to get there checks only once the earlier one's output is in place, and is
    refused (`_check_again`); without it, an output put in place between another run's last check and its swap was
    replaced (kept in a hidden folder and named) and its run had said "Wrote". Every conversion into that folder waits
    for the lock, whatever its output, for the milliseconds of a swap (and the removal of a replaced output). Where the
    folder cannot be opened or locked (no read permission, NFS, whose emulated locks need a file open for writing, no
    `fcntl`), the swap goes on unlocked, as before."""
    descriptor = None
    if fcntl is not None:
        with contextlib.suppress(OSError):
            descriptor = os.open(parent, os.O_RDONLY | os.O_DIRECTORY)
    try:
        if descriptor is not None:
            try:
                fcntl.flock(descriptor, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except BlockingIOError:
                logger.warning(f"Waiting for another process that holds {parent} locked (another conversion putting "
                               "its output in place there?) before this one checks its output again and puts it in "
                               "place.")
                with contextlib.suppress(OSError):  # an interrupt still stops the wait
                    fcntl.flock(descriptor, fcntl.LOCK_EX)
            except OSError:  # no locks on this file system
                pass
        yield
    finally:
        if descriptor is not None:
            os.close(descriptor)


def _check_again(output: Path, overwrite: bool, source: object, checked: str | None) -> None:
    """The check just before the swap: `check_output_folder` again, after refusing an output that another process
    wrote or replaced since the first check (`checked`, `_output_state`): another conversion into the same folder, which
    this one would replace (with `overwrite`) or be told to replace. One that went meanwhile is no reason to stop."""
    now = _output_state(output)
    if now is not None and now != checked:
        raise FileExistsError(_written_meanwhile(output, checked))
    check_output_folder(output, overwrite, source)


def _written_meanwhile(output: Path, checked: str | None) -> str:
    found = ("it was missing or empty when this run checked it" if checked is None
             else "the previous conversion output this run was to replace is not the one there now")
    return (f"Output folder {output} was written by another process while this conversion ran ({found}: another "
            "conversion into the same folder?); nothing was written, and the folder was left as it is.")


@contextlib.contextmanager
def scratch_folder() -> Iterator[Path]:
    """A marked folder in the temporary folder (`tempfile.gettempdir()`, `$TMPDIR`) for a conversion that has no
    output (`upcycle(path)`, a check only; `convert(path)`, loaded back and returned), removed on exit. A run killed
    where nothing runs its clean-up (SIGKILL, the out-of-memory killer) left an unmarked `dar-convert-*` folder, a
    model's size, that nothing removed; a marked one is removed by the next run that has no output, as
    `write_repo_folder` removes stale staging folders beside an output (`remove_stale_runs`)."""
    parent = resolve_path(tempfile.gettempdir())
    remove_stale_runs(parent)
    try:
        with signals_held():
            folder = _marked_folder(parent / "dar-convert", STAGING_SUFFIX)
    except OSError as error:
        raise _scratch_error(parent, parent, error.errno, _describe(error)) from error
    try:
        yield folder
    except OSError as error:  # the folder's writes (the source's reads name the source and pass)
        if error.errno not in SCRATCH_ERRNOS and not str(error.filename or "").startswith(str(folder)):
            raise
        cause = error.__cause__ if isinstance(error, OutputWriteError) else None  # `convert(path)`'s output in it
        described = _describe(cause) if isinstance(cause, OSError) else _describe(error)
        raise _scratch_error(folder, parent, error.errno, described) from error
    except Exception as error:
        number = rust_os_errno(error)
        if number is None:
            raise
        raise _scratch_error(folder, parent, number, str(error)) from error
    finally:
        with signals_held():
            _remove_own_folder(folder)
            _release_marker(folder)
        # The verification's models of the folder (loaded memory-mapped) may be left in reference cycles until the
        # next collection, each mapping the removed files, whose space stays taken until then.
        gc.collect()


def rust_os_errno(error: Exception) -> int | None:
    """The errno of an OS error that a Rust writer (tokenizers) reported as a bare Exception "... (os error N)";
    None for any other exception."""
    found = re.search(r"\(os error (\d+)\)", str(error))
    return int(found.group(1)) if found is not None and type(error) is Exception else None


# Errors of writing that name no file (a full disk, a quota, a file system gone read-only): the scratch folder's.
SCRATCH_ERRNOS = {errno.ENOSPC, errno.EDQUOT, errno.EROFS}


def _scratch_error(folder: Path, parent: Path, number: int, description: str) -> OutputWriteError:
    """One line for a conversion without an output whose temporary folder could not be written, naming where it
    lies and how to choose another place (a raw OSError named a hidden `.partial` path, or no file at all)."""
    error = OutputWriteError(
        f"Could not write the conversion's temporary folder {folder}: {description}. A conversion without an output "
        f"folder writes the converted model (about the source's size) into {parent} (the temporary folder, "
        "$TMPDIR), verifies it there and removes it; set TMPDIR to a folder with room for it, or give an output "
        "folder. Nothing was kept."
    )
    error.errno = number
    return error


def _remove_own_folder(folder: Path) -> None:
    """Remove a folder this run created (its staging folder), writable first: it may have taken over the mode of a
    read-only output it was to replace (`_take_over_metadata`) before that swap failed, and then neither `rmtree`
    (without root's override) nor any later run (its marker is gone by then) would remove it. Its marker goes last
    (`_remove_marked`), so that what cannot be removed (a file system gone read-only) stays recognisable to a later
    run, and the log names it."""
    with contextlib.suppress(OSError):
        os.chmod(folder, stat.S_IRWXU)  # a real folder: made by `tempfile.mkdtemp`
    try:
        _remove_marked(folder)
    except OSError as error:
        logger.warning(f"The staging folder {folder} could not be removed ({_describe(error)}); remove it yourself.")


def _fsync(path: Path) -> None:
    """Flush a file's data, or a folder's entries (a rename in it), to the disk: else a crash (power loss) soon after
    the swap could leave the output's files empty or truncated, the replaced output already removed. A folder on a
    file system that cannot flush folders (EINVAL) is left as it is."""
    descriptor = os.open(path, os.O_RDONLY)
    try:
        os.fsync(descriptor)
    except OSError as error:
        if error.errno != errno.EINVAL or not path.is_dir():
            raise OSError(error.errno, error.strerror, str(path)) from error
    finally:
        os.close(descriptor)


def _write_error(
    output: Path, errno: int, description: str, kept: tuple[Path, str] | None = None
) -> OutputWriteError:
    """One line naming the output; `kept`: where the output that was to be replaced is now, and why it is not back
    in place (`_retire`)."""
    message = f"Could not write {output}: {description}; nothing was written."
    if kept is not None:
        message += (f" The existing output could not be moved back ({kept[1]}): it is now {kept[0]}; move it back "
                    "yourself.")
    error = OutputWriteError(message)
    error.errno = errno
    return error


def _describe(error: OSError) -> str:
    text = error.strerror or str(error)
    if error.filename is not None:
        text += f" ({error.filename}" + (f" -> {error.filename2}" if error.filename2 is not None else "") + ")"
    return text


def _make_parents(folder: Path) -> list[Path]:
    """mkdir -p `folder`; returns the folders it created, outermost first. One that fails (a name too long, no
    space) leaves none of those it made before it."""
    missing = []
    while not os.path.lexists(folder):
        missing.append(folder)
        folder = folder.parent
    made: list[Path] = []
    try:
        for path in reversed(missing):
            try:
                path.mkdir()
            except FileExistsError:  # another run made it meanwhile: not this run's to remove
                if not path.is_dir():
                    raise
                continue
            made.append(path)
    except BaseException:
        for path in reversed(made):
            with contextlib.suppress(OSError):
                path.rmdir()
        raise
    return made


def _marked_folder(output: Path, suffix: str, **fields) -> Path:
    """A new hidden folder next to `output` holding the marker of this run, with `fields` (call with signals
    held)."""
    folder = Path(tempfile.mkdtemp(prefix=f".{output.name}.", suffix=suffix, dir=output.parent))
    # Locked before it names anyone (an empty marker is no marker), until `_release_marker`: the lock, not the process
    # id, tells another run that this one is alive, even one whose process ids are another namespace's. Opened for
    # writing and written through this descriptor: NFS emulates flock with POSIX locks, whose exclusive lock needs a
    # file open for writing (else EBADF: the run held no lock and another run took its folder for a dead one's) and
    # which closing any other descriptor of the file in this process releases. The marker says whether the lock was
    # taken, so that a free lock is taken for an ended run only where it was (`_run_ended`).
    try:
        descriptor = _MARKER_LOCKS[folder] = os.open(folder / STAGING_MARKER, os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o644)
        locked = False
        if fcntl is not None:
            with contextlib.suppress(OSError):  # a file system without locks: the process id decides
                fcntl.flock(descriptor, fcntl.LOCK_EX | fcntl.LOCK_NB)
                locked = True
        marker = {"pid": os.getpid(), "host": socket.gethostname(), "output": str(output), "locked": locked, **fields}
        text = (json.dumps(marker) + "\n").encode("utf-8")
        while text:
            text = text[os.write(descriptor, text):]
    except BaseException:  # no space for the marker, say: nothing of this run is left behind
        _release_marker(folder)
        shutil.rmtree(folder, ignore_errors=True)
        raise
    return folder


def _release_marker(folder: Path) -> None:
    """Close (and so unlock) the marker of a folder of this run that is no longer its own (moved into place, removed,
    or left behind for a later run to remove)."""
    descriptor = _MARKER_LOCKS.pop(folder, None)
    if descriptor is not None:
        os.close(descriptor)


def _marker_locked(folder: Path) -> bool | None:
    """Whether a live run holds the marker of `folder` locked: True, or False when the lock is free (a run that ended,
    however, holds no lock); None where this cannot be told (no locks on this file system, an unreadable marker): the
    process id decides then."""
    if fcntl is None:
        return None
    if folder in _MARKER_LOCKS:  # this process's own (closing a probe's descriptor would release its lock on NFS)
        return True
    try:
        descriptor = os.open(folder / STAGING_MARKER, os.O_RDONLY | os.O_NOFOLLOW)
    except OSError:
        return None
    try:
        fcntl.flock(descriptor, fcntl.LOCK_SH | fcntl.LOCK_NB)
    except BlockingIOError:
        return True
    except OSError:  # no locks on this file system
        return None
    finally:
        os.close(descriptor)
    return False


def _move_into_place(staging: Path, output: Path, checked: str | None) -> None:
    """Rename the complete staging folder to `output`. Where the last check found no output or an empty folder
    (`checked` None), one rename, which the system refuses if a non-empty folder is there by then (another process
    wrote it: refused, left as it is); a previous conversion output (`checked`: its run id) is moved into a marked
    retired folder first (moved back if the rename fails) and removed after, its metadata taken over first, unless it
    changed after it was last checked (`_changed_since_checked`): then it is kept. Call with signals held. The staging
    folder keeps its marker (and lock) through the rename, so that a run killed before it (SIGKILL, which no hold
    stops) leaves a marked folder that a later run removes, not a complete unmarked one that none would; the output's
    copy of the marker goes right after (`_unmark`; a run killed in between leaves it there, which
    `check_output_folder` ignores)."""
    try:
        existing = os.lstat(output)
    except FileNotFoundError:
        existing = None
    if existing is None or checked is None:
        if existing is not None:
            if not _may_write(output):  # made read-only after the last check, which refuses that (`_refuse_unwritable`)
                raise OSError(errno.EACCES, os.strerror(errno.EACCES), str(output))
            _take_over_metadata(staging, existing)
        try:
            os.replace(staging, output)  # replaces an empty folder only (a non-empty one: ENOTEMPTY)
        except OSError as error:
            if error.errno in (errno.ENOTEMPTY, errno.EEXIST, errno.ENOTDIR, errno.EISDIR):
                raise FileExistsError(_written_meanwhile(output, checked)) from error
            raise
        _unmark(staging, output)
        try:
            _fsync(output.parent)
        except OSError as error:  # the output is in place: say what may not last rather than fail
            logger.warning(f"Wrote {output}, but its folder {output.parent} could not be flushed to the disk "
                           f"({_describe(error)}): a crash soon may undo the rename.")
        return
    _take_over_metadata(staging, existing)
    # What the output becomes, by the id its manifest holds (`_replaced_by`): not its inode, which the file system
    # gives again to a later folder once this one is gone (a run killed between the renames, its staging folder
    # removed by the next run, whose new output then took that inode, and the only copy of the old output went).
    retired = _marked_folder(output, RETIRED_SUFFIX, replacement_run=output_run_id(staging))
    try:
        _retire(staging, output, retired, checked)
    finally:
        _release_marker(retired)


def _unmark(staging: Path, output: Path) -> None:
    """Remove the marker the staging folder carried into place (`_move_into_place`) and release its lock: only that
    file (the one this run holds open), not one another run's folder put at `output` meanwhile."""
    marker, descriptor = output / STAGING_MARKER, _MARKER_LOCKS.get(staging)
    held = os.fstat(descriptor) if descriptor is not None else None
    _release_marker(staging)  # closed before it is removed: NFS keeps a removed file that is still open (.nfsXXXX)
    try:
        found = os.lstat(marker)
        if held is None or (held.st_dev, held.st_ino) == (found.st_dev, found.st_ino):
            marker.unlink()
    except FileNotFoundError:
        pass
    except OSError as error:
        logger.warning(f"Wrote {output}, but its run marker {STAGING_MARKER} could not be removed from it "
                       f"({_describe(error)}); remove it yourself.")


def _exchange(first: Path, second: Path) -> bool:
    """Swap two folders of one file system in one step (Linux's `renameat2` with `RENAME_EXCHANGE`), so that no moment
    has neither at either path; False where the C library, the kernel or the file system has no such swap."""
    try:
        function = getattr(ctypes.CDLL(None, use_errno=True), "renameat2", None)
    except (OSError, TypeError):  # no C library to open by this name (Windows)
        return False
    if function is None:
        return False
    function.argtypes = [ctypes.c_int, ctypes.c_char_p, ctypes.c_int, ctypes.c_char_p, ctypes.c_uint]
    at_current_folder, rename_exchange = -100, 2  # AT_FDCWD, RENAME_EXCHANGE (linux/fcntl.h)
    if function(at_current_folder, os.fsencode(first), at_current_folder, os.fsencode(second), rename_exchange) == 0:
        return True
    number = ctypes.get_errno()
    if number in (errno.EINVAL, errno.ENOSYS, errno.ENOTSUP):  # no exchange here: the caller renames in two steps
        return False
    raise OSError(number, os.strerror(number), f"{first} <-> {second}")


def _exchanged_into_place(staging: Path, output: Path, retired: Path) -> bool:
    """Put the new output in place in one step where the system can (`_exchange`): parked in the marked `retired`
    folder, then swapped with the output, so that the old one lands in the retired folder. A run killed at any moment
    leaves the old or the new output at `output`, and its retired folder holds the other, which the next run removes
    as its own (`remove_stale_runs`); with two renames, a SIGKILL between them left no output at `output`. False
    (everything as it was) where there is no exchange, or the output may not be written by this process (a folder
    made read-only after the last check: the two-step path fails on it, leaving it as it is), or where the exchange
    fails (the two-step path then tries, and reports its own error)."""
    parked = retired / output.name
    if not os.access(output, os.W_OK):
        return False
    os.replace(staging, parked)
    try:
        if _exchange(parked, output):
            return True
    except OSError as error:
        logger.debug(f"The one-step swap of {output} failed ({_describe(error)}); renaming in two steps.")
    os.replace(parked, staging)
    return False


def _retire(staging: Path, output: Path, retired: Path, checked: str) -> None:
    """`_move_into_place` with an existing output: swapped with the staging folder in one step where the system can
    (`_exchanged_into_place`, the old output then in the marked `retired` folder), else moved into the retired folder
    and the staging folder renamed into place; the retired one is then removed (or kept, `_changed_since_checked`).
    Once the new output is in place, nothing raises: what could not be done is a warning. If the rename into place
    fails and the old output cannot be moved back (another process put a folder at `output` meanwhile), the retired
    folder is unmarked, so that no run removes it, and the error says where the old output is (`kept`)."""
    try:
        exchanged = _exchanged_into_place(staging, output, retired)
    except OSError:
        shutil.rmtree(retired, ignore_errors=True)
        raise
    if not exchanged:
        try:
            os.replace(output, retired / output.name)
        except OSError:
            shutil.rmtree(retired, ignore_errors=True)
            raise
        try:
            os.replace(staging, output)
        except OSError as error:
            try:
                os.replace(retired / output.name, output)
            except OSError as back:
                with contextlib.suppress(OSError):
                    (retired / STAGING_MARKER).unlink()
                error.kept = (retired / output.name, _describe(back))
                raise error from back
            shutil.rmtree(retired, ignore_errors=True)
            raise
    _unmark(staging, output)
    try:
        changed = _changed_since_checked(retired / output.name, checked)
    except OSError as error:
        changed = f"it could not be read: {_describe(error)}"
    if changed:  # written to between the last check and the swap (a Trainer saving into it): never removed
        with contextlib.suppress(OSError):
            (retired / STAGING_MARKER).unlink()  # unmarked, so no later run removes it either
        logger.warning(f"Wrote {output}. The folder it replaced changed while it was being replaced ({changed}), so "
                       f"it was kept, not removed: {retired / output.name}")
        return
    try:
        _fsync(output.parent)  # the rename on the disk before the replaced output, its only other copy, goes
        _remove_marked(retired)
    except OSError as error:  # the new output is in place; say what is left rather than fail
        logger.warning(f"Wrote {output}, but the previous output moved to {retired} could not be removed "
                       f"({_describe(error)}); remove it yourself.")


def _changed_since_checked(replaced: Path, checked: str) -> str | None:
    """Why the folder just replaced may not be removed (None if it may): the last check found there the previous
    conversion output whose run id is `checked`, as written, but up to the swap a process may have written into it
    (a Trainer saving into it) or put another folder in its place (another conversion's output)."""
    if not any(replaced.iterdir()):
        return None
    if (output_run_id(replaced) or "") != checked:
        return "another folder took its place after this conversion's last check: another conversion's output?"
    return not_a_conversion_output(replaced)


def _take_over_metadata(staging: Path, existing: os.stat_result) -> None:
    """Give the new folder what the folder it replaces had (a user may have prepared an empty, group-shared folder):
    its owner and group as far as this process may set them, then its permission bits, setgid included. In a setgid
    folder, entries take the folder's group and subfolders the setgid bit, so its content gets them too, as if it had
    been written there. The swap itself stays one rename, so the inode, ACLs and extended attributes are new."""
    for owner, group in ((existing.st_uid, existing.st_gid), (-1, existing.st_gid)):  # a user may still set the group
        with contextlib.suppress(OSError):
            os.chown(staging, owner, group)
            break
    os.chmod(staging, stat.S_IMODE(existing.st_mode))  # after chown, which may clear setgid
    now = os.stat(staging)
    differs = [f"{what} {old} (now {new})" for what, old, new in (
        ("owner", existing.st_uid, now.st_uid), ("group", existing.st_gid, now.st_gid),
        ("mode", oct(stat.S_IMODE(existing.st_mode)), oct(stat.S_IMODE(now.st_mode)))) if old != new]
    if differs:
        logger.warning(f"The new output folder could not keep the replaced folder's {', '.join(differs)}: this user "
                       "may not set them.")
    if not existing.st_mode & stat.S_ISGID:
        return
    for path, status in walk_without_symlinks(staging):
        with contextlib.suppress(OSError):
            os.chown(staging / path, -1, existing.st_gid, follow_symlinks=False)
            if stat.S_ISDIR(status.st_mode):
                os.chmod(staging / path, stat.S_IMODE(status.st_mode) | stat.S_ISGID)


def remove_stale_runs(parent: Path) -> list[Path]:
    """Remove the staging and retired folders in `parent` that runs no longer alive left behind (recognised by their
    marker; nothing else is touched), naming each on the log. A retired folder whose output is missing (a run killed
    between its two renames) holds the only copy of that output: it is named, not removed. One that holds the run's
    own new output, parked before a swap that did not happen (`_exchanged_into_place`; its manifest's id is the
    marker's), is removed: the output in place is the previous one, unchanged. Returns what was removed."""
    removed = []
    if not parent.is_dir():
        return removed
    for entry, marker in _marked_folders(parent, ".", (STAGING_SUFFIX, RETIRED_SUFFIX)):
        pid, host, output = marker.get("pid"), marker.get("host"), Path(str(marker.get("output", "")))
        # Every run holds its marker locked while the folder is its own, so where locks work a free lock says the run
        # ended, whatever its process id now names (reused: process 1 in a container) or its host was called.
        if not _run_ended(entry, marker):
            logger.warning(f"{entry} belongs to a conversion that may still be running (process {pid} on {host}); "
                           "left alone.")
            continue
        kept = entry / output.name
        if (entry.name.endswith(RETIRED_SUFFIX) and os.path.lexists(kept) and not _replaced_by(output, marker)
                and not _replaced_by(kept, marker)):  # (the run's own new output, parked before its swap: removed)
            logger.warning(f"{kept} is the previous {output}, moved aside by a conversion that did not finish "
                           f"(process {pid}), and {output} is not the folder that conversion wrote: left alone, move "
                           "it back or remove it yourself.")
            continue
        logger.warning(f"Removing {entry}, left behind by an earlier conversion (process {pid}, no longer running).")
        try:
            with signals_held():
                _remove_marked(entry)
        except OSError as error:
            logger.warning(f"Could not remove {entry} ({_describe(error)}); remove it yourself.")
            continue
        removed.append(entry)
    return removed


def _marked_folders(parent: Path, prefix: str, suffixes: tuple[str, ...]) -> Iterator[tuple[Path, dict]]:
    """(folder, marker) of each folder in `parent` named `prefix`...`suffix` that holds a run's marker, in name
    order: real folders only (a symlink named like one is never followed: its target is not a run's), none gone since
    the listing (another run's, renamed into place or removed), and none of this process's own (alive; reading its
    marker would release an NFS lock, `_marked_folder`)."""
    for entry in sorted(parent.iterdir()):
        if not (entry.name.startswith(prefix) and entry.name.endswith(suffixes)) or entry in _MARKER_LOCKS:
            continue
        try:
            if not stat.S_ISDIR(os.lstat(entry).st_mode):
                continue
        except FileNotFoundError:
            continue
        marker = _read_marker(entry)
        if marker is not None:
            yield entry, marker


def _replaced_by(output: Path, marker: dict) -> bool:
    """Whether `output` is the folder that the run of a retired folder's `marker` renamed into place (its manifest's
    random id, `write_manifest`): only then is the retired folder a replaced output, not the only copy of one. A
    marker without the id (written by an earlier version, which recorded the folder's inode) is never taken as
    replaced: the retired folder is named and kept."""
    expected = marker.get("replacement_run")
    return isinstance(expected, str) and bool(expected) and output_run_id(output) == expected


def output_run_id(folder: Path) -> str | None:
    """The random id in the manifest of a conversion output (`write_manifest`), None where it has none or none can
    be read."""
    try:
        if not stat.S_ISREG(os.lstat(folder / MANIFEST_NAME).st_mode):
            return None
        run = json.loads((folder / MANIFEST_NAME).read_text(encoding="utf-8")).get("run")
    except (OSError, ValueError, AttributeError):
        return None
    return run if isinstance(run, str) else None


def _remove_marked(folder: Path) -> None:
    """Remove a marked folder, its marker last: a folder that cannot be removed whole stays recognisable. This run's
    own marker is closed (its lock released) just before it goes: NFS renames a removed file that is still open
    (`.nfsXXXX`), and the folder would stay behind; once the lock is free another run may remove the rest first."""
    for entry in folder.iterdir():
        if entry.name != STAGING_MARKER:
            shutil.rmtree(entry) if entry.is_dir() and not entry.is_symlink() else entry.unlink()
    _release_marker(folder)
    with contextlib.suppress(FileNotFoundError):
        (folder / STAGING_MARKER).unlink()
    with contextlib.suppress(FileNotFoundError):
        folder.rmdir()


def _read_marker(folder: Path) -> dict | None:
    try:
        if not stat.S_ISREG(os.lstat(folder / STAGING_MARKER).st_mode):  # a symlink is no marker
            return None
        marker = json.loads((folder / STAGING_MARKER).read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return None
    return marker if isinstance(marker, dict) else None


def _alive(pid: object) -> bool:
    if not isinstance(pid, int) or pid <= 0:
        return True  # unknown: treat as alive, touch nothing
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def _apply_umask(folder: Path) -> None:
    """mkdtemp (and some writers) create owner-only entries; give the repo the modes a plain mkdir/open would."""
    umask = os.umask(0)
    os.umask(umask)
    os.chmod(folder, 0o777 & ~umask)
    for path in folder.rglob("*"):
        os.chmod(path, (0o777 if path.is_dir() else 0o666) & ~umask)
