# SPDX-License-Identifier: Apache-2.0
# Copyright 2026 The dar-transformers authors.
"""Writing a planned conversion as a repo folder (without its card): safetensors shards and their index, the config
with `auto_map` and the remote-code files, the generation config and the tokenizer.

Each source tensor is read once, in row chunks (a transformed one whole), and each chunk is checked for NaN/inf as it is
read, so no more than one tensor or one chunk is in memory at a time; a non-floating tensor whose bytes are those of
its source is copied by the kernel (`os.copy_file_range`).
"""

import copy
import json
import os
import struct
from collections.abc import Callable, Iterable, Mapping, Sequence
from pathlib import Path

import torch
from transformers.dynamic_module_utils import custom_object_save
from transformers.utils import logging

from .checkpoints import (
    INDEX_NAME, SAFETENSORS_NAMES, Checkpoint, FiniteCheckpoint, pread_exact, require_finite_cast, source_read_error,
)
from .keymaps import TensorInfo, TensorPlan
from .plan import materialise, meta_model, note_rounding
from .sources import Source

logger = logging.get_logger(__name__)

CHUNK_BYTES = 64 * 2**20  # rows cast and written per step when a tensor is not copied byte for byte


def _copy_bytes(source_fd: int, offset: int, length: int, source_path: Path, target) -> None:
    target.flush()
    target_fd = target.fileno()
    done = 0
    try:
        while done < length:
            count = os.copy_file_range(source_fd, target_fd, length - done, offset + done)
            if count == 0:
                raise OSError("copy_file_range copied nothing")
            done += count
        target.seek(0, os.SEEK_END)
    except OSError:  # another file system, or a kernel without it: copy through user space in chunks
        target.seek(0, os.SEEK_END)
        while done < length:
            step = min(CHUNK_BYTES, length - done)
            target.write(pread_exact(source_fd, step, offset + done, source_path))  # its errors name the source
            done += step


def _check_cast(cast: torch.Tensor, source: torch.Tensor, name: str, first_row: int) -> torch.Tensor:
    """`cast` (`source` in the storage dtype) when it is finite. The source was checked finite as it was read, so a
    non-finite value here is one outside the storage dtype's range (float16 tops out at 65504), which the cast turns
    into inf and which no later check reads back when it sits in an embedding row that no prompt uses."""
    if not cast.dtype.is_floating_point or torch.isfinite(cast).all():
        return cast
    overflow = ~torch.isfinite(cast)
    row = first_row + int(overflow.reshape(overflow.shape[0], -1).any(dim=1).nonzero()[0]) if cast.dim() else None
    value = source[overflow].abs().max().item()
    dtype = str(cast.dtype).removeprefix("torch.")
    # The storage dtypes whose range holds it (a float64 source's 1e39 fits neither bfloat16 nor float32).
    wider = [candidate for candidate in ("bfloat16", "float32")
             if candidate != dtype and torch.finfo(getattr(torch, candidate)).max >= value]
    raise ValueError(f"Tensor {name!r}{f' (row {row})' if row is not None else ''} holds the value {value:.4g}, "
                     f"outside the range of {dtype} (it would be written as inf); convert to "
                     f"{' or '.join(wider or ['float64'])} (--dtype).")


def _write_tensor(plan: TensorPlan, checkpoint: FiniteCheckpoint, infos: Mapping[str, TensorInfo], target,
                  rounding: dict[str, bool] | None = None) -> None:
    """Write one planned tensor; `checkpoint` checks every chunk for NaN/inf as it is read, so this read (the only
    one of the write: a GGUF tensor is dequantised once) is also the check. Floating tensors are copied through such
    a checked read (the chunk copied is the chunk checked); others are copied by the kernel. `rounding`: the source
    tensors the cast may round, marked when it changed a value (`note_rounding`), from the same read."""
    if plan.value is None and plan.transform is None:
        ranges = [checkpoint.checkpoint.byte_range(part) for part in plan.parts]
        same_bytes = all(r is not None for r in ranges) and all(infos[p].dtype == plan.dtype for p in plan.parts)
        if same_bytes and not plan.dtype.is_floating_point:  # nothing to check: NaN/inf are floating values
            for source_fd, offset, length, source_path in ranges:
                _copy_bytes(source_fd, offset, length, source_path, target)
            return
        for part in plan.parts:  # cast (or copied) in row chunks: one chunk in memory at a time
            info = infos[part]
            rows = info.shape[0] if info.shape else 1
            step = max(1, CHUNK_BYTES // max(1, info.nbytes // max(rows, 1) * (1 if same_bytes else 2)))
            for start in range(0, rows, step):
                chunk = checkpoint.read(part, slice(start, start + step) if info.shape else None)
                cast = _check_cast(note_rounding(chunk, plan.dtype, part, rounding), chunk, part, start)
                target.write(memoryview(cast.contiguous().reshape(-1).view(torch.uint8).numpy()))
        return
    tensor = materialise(plan, checkpoint, rounding).contiguous()
    # the parts were finite as read: a cast or a transform (Drop-Upcycling) overflowed
    require_finite_cast(tensor, ", ".join(plan.parts) or "a new parameter", "--dtype")
    target.write(memoryview(tensor.reshape(-1).view(torch.uint8).numpy()))


def _shard(sizes: Iterable[tuple[str, int]], max_shard_size: int) -> list[list[str]]:
    """Greedy, in order, as `save_pretrained` shards: a tensor larger than the limit gets a shard of its own."""
    shards, current, current_size = [], [], 0
    for name, size in sizes:
        if current and current_size + size > max_shard_size:
            shards.append(current)
            current, current_size = [], 0
        current.append(name)
        current_size += size
    if current:
        shards.append(current)
    return shards


def write_checkpoint(
    folder: Path,
    plans: Mapping[str, TensorPlan],
    checkpoint: Checkpoint,
    max_shard_size: int,
    own_shards: Sequence[str] = (),
    progress: Callable[[str], None] | None = None,
    rounding: dict[str, bool] | None = None,
) -> dict:
    """Write `plans` as safetensors shards `model-0000i-of-0000n.safetensors` and the index; the names in
    `own_shards` (DAR's new parameters) go into shard(s) of their own at the end. Returns the index.

    Every source tensor is read once, and each chunk is checked for NaN/inf as it is read: a non-finite source raises
    a ValueError naming the tensor part-way through the write (`convert` writes in a staging folder it removes on error).
    `rounding`: the source tensors the casts may round, marked when a cast changed a value (`note_rounding`)."""
    own = set(own_shards)
    shared = _shard(((name, plan.nbytes) for name, plan in plans.items() if name not in own), max_shard_size)
    new = _shard(((name, plans[name].nbytes) for name in own_shards), max_shard_size)
    shards = shared + new
    checkpoint = FiniteCheckpoint(checkpoint)
    infos = checkpoint.infos()  # once: a checkpoint builds this table of every tensor anew on each call
    weight_map, total = {}, 0
    for number, names in enumerate(shards, start=1):
        file_name = f"model-{number:05d}-of-{len(shards):05d}.safetensors"
        header, offset = {}, 0
        for name in names:
            plan = plans[name]
            header[name] = {"dtype": SAFETENSORS_NAMES[plan.dtype], "shape": list(plan.shape),
                            "data_offsets": [offset, offset + plan.nbytes]}
            offset += plan.nbytes
            weight_map[name] = file_name
        total += offset
        header["__metadata__"] = {"format": "pt"}
        encoded = json.dumps(header, separators=(",", ":")).encode("utf-8")
        encoded += b" " * (-len(encoded) % 8)
        with open(folder / file_name, "wb") as target:
            target.write(struct.pack("<Q", len(encoded)))
            target.write(encoded)
            for name in names:
                if progress is not None:
                    progress(name)
                _write_tensor(plans[name], checkpoint, infos, target, rounding)
            if target.tell() != 8 + len(encoded) + offset:
                raise RuntimeError(f"{file_name}: wrote {target.tell()} bytes, planned {8 + len(encoded) + offset}")
    index = {"metadata": {"total_size": total}, "weight_map": dict(sorted(weight_map.items()))}
    (folder / INDEX_NAME).write_text(json.dumps(index, indent=2) + "\n")
    return index


def write_converted_folder(folder, target, config, plans, new_names, source: Source, max_shard_bytes, progress,
                           rounding: dict[str, bool] | None = None):
    """The repo folder without its card: weights (shared shards, then DAR's own), config with `auto_map` and the
    remote-code files, generation config, tokenizer, and the source's `side_files` (license, vocabulary files).
    `rounding`: the source tensors the storage dtype may round, marked where it did (`note_rounding`)."""
    bar = logging.tqdm(total=len(plans), desc="Writing tensors", unit="tensor", disable=not progress)
    write_checkpoint(folder, plans, source.checkpoint, max_shard_bytes, own_shards=new_names,
                     progress=lambda name: bar.update(), rounding=rounding)
    bar.close()
    config = copy.deepcopy(config)
    config.name_or_path = ""
    custom_object_save(meta_model(target.model_class, config), folder, config=config)
    config.save_pretrained(folder)
    source.generation_config.save_pretrained(folder)
    if not source.tokenizer_copied:  # else its files are among the side files
        write_tokenizer(folder, source.tokenizer)
    for path in source.side_files:  # license terms, the tokenizer's files: as the source has them
        copied = folder / path.relative_to(source.folder)
        if not copied.exists():
            copied.parent.mkdir(parents=True, exist_ok=True)
            copy_source_file(path, copied)
    if source.tokenizer_copied:
        name_tokenizer_class(folder, source.tokenizer)


def name_tokenizer_class(folder: Path, tokenizer) -> None:
    """Name the class transformers loaded the source's tokenizer as in the copied tokenizer_config.json, where its
    files do not: `AutoTokenizer` picks a class by the folder's model_type when the files name none or a generic one
    (a Qwen2 folder's "TokenizersBackend" loads as Qwen2Tokenizer, which adds its pad token), and the output's
    model_type is DAR's. The only change to the copied files, made only where the class would otherwise differ."""
    loaded = type(tokenizer).__name__
    config_file = folder / "tokenizer_config.json"
    fields = json.loads(config_file.read_text(encoding="utf-8")) if config_file.is_file() else {}
    named = fields.get("tokenizer_class")
    generic = ("TokenizersBackend", "PreTrainedTokenizerFast", "PreTrainedTokenizer")  # one class in transformers 5
    if (named or "").removesuffix("Fast") == loaded.removesuffix("Fast") or (
            loaded in generic and (named is None or named in generic)):
        return
    fields["tokenizer_class"] = loaded
    config_file.write_text(json.dumps(fields, indent=2, ensure_ascii=False) + "\n", encoding="utf-8")


def copy_source_file(path: Path, copied: Path) -> None:
    """Copy a source file as it is; an error reading it (gone, unreadable) names the source file, as `pread_exact`'s
    do, so that the output's writer passes it on instead of reporting a write error."""
    try:
        source_file = open(path, "rb")
    except OSError as error:
        raise source_read_error(path, error) from error
    with source_file, open(copied, "wb") as target:
        while True:
            try:
                chunk = source_file.read(CHUNK_BYTES)
            except OSError as error:
                raise source_read_error(path, error) from error
            if not chunk:
                return
            target.write(chunk)


def write_tokenizer(folder: Path, tokenizer) -> None:
    """The tokenizer files, self-contained: an `auto_map` to tokenizer code is dropped (the converter loads and saves
    the tokenizer with transformers' own classes, and never copies or runs a source's code), and so are the loading
    flags `save_pretrained` leaves behind."""
    tokenizer.save_pretrained(folder)
    config_file = folder / "tokenizer_config.json"
    if not config_file.is_file():
        return
    fields = json.loads(config_file.read_text(encoding="utf-8"))
    auto_map = fields.pop("auto_map", None)
    for flag in ("is_local", "local_files_only"):
        fields.pop(flag, None)
    if auto_map:
        logger.warning(
            f"The source tokenizer's auto_map {auto_map} points to code that is not copied (the converter never ships "
            f"or runs a source's code): dropped from tokenizer_config.json; the tokenizer loads as "
            f"{fields.get('tokenizer_class') or type(tokenizer).__name__}."
        )
    config_file.write_text(json.dumps(fields, indent=2, ensure_ascii=False) + "\n", encoding="utf-8")


__all__ = ["write_checkpoint", "write_converted_folder", "write_tokenizer"]
