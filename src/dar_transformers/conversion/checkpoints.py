# SPDX-License-Identifier: Apache-2.0
# Copyright 2026 The dar-transformers authors.
"""The sources' tensors, read one at a time without building a model (DESIGN.md section 6).

- `SafetensorsCheckpoint`: a folder of `*.safetensors` files read through their headers, each tensor (or rows of
  it) with `os.pread` at its byte offsets. Nothing is memory-mapped, so a read costs its own bytes in RSS and no
  shard stays resident (a mapped shard's touched pages count in RSS until it is closed: streaming-checkpoints.md 1).
- `GGUFCheckpoint`: a GGUF file, each tensor read at its offset, dequantised and un-permuted by transformers' own GGUF
  tensor processors (dense families; the MoE processors merge experts across tensors and go through transformers'
  whole-file loader instead).
- `StateDictCheckpoint`: an in-memory model's state dict behind the same interface.
"""

import json
import os
import re
import struct
from collections.abc import Collection, Mapping, Sequence
from pathlib import Path

import numpy as np
import torch
from transformers.utils import logging
from transformers.modeling_gguf_pytorch_utils import (
    TENSOR_PROCESSORS,
    Qwen2MoeTensorProcessor,
    TensorProcessor,
    get_gguf_hf_weights_map,
    load_gguf_checkpoint,
)

from .keymaps import TensorInfo

try:
    import gguf  # the [gguf] extra: only GGUF sources need it
except ImportError:
    gguf = None

SAFETENSORS_DTYPES: dict[str, torch.dtype] = {
    "F64": torch.float64, "F32": torch.float32, "BF16": torch.bfloat16, "F16": torch.float16,
    "I64": torch.int64, "I32": torch.int32, "I16": torch.int16, "I8": torch.int8, "U8": torch.uint8,
    "BOOL": torch.bool, "F8_E4M3": torch.float8_e4m3fn, "F8_E5M2": torch.float8_e5m2,
}
SAFETENSORS_NAMES = {dtype: name for name, dtype in SAFETENSORS_DTYPES.items()}
INDEX_NAME = "model.safetensors.index.json"
logger = logging.get_logger(__name__)


def pread_exact(fd: int, length: int, offset: int, path: Path | None = None) -> bytearray:
    """`length` bytes at `offset`. With `path` (a source file), an error names it as a read of the source, in one
    line without an errno, so that the output's writer passes it on instead of reporting a write error."""
    buffer = bytearray(length)
    view, done = memoryview(buffer), 0
    try:
        while done < length:
            count = os.preadv(fd, [view[done:]], offset + done)
            if count <= 0:
                raise OSError(f"unexpected end of file reading {length} bytes at offset {offset}")
            done += count
    except OSError as error:
        if path is None:
            raise
        short = " (the file is shorter than its header says: truncated, or changed while being read)"
        raise source_read_error(path, error, short if error.errno is None else "") from error
    return buffer


def source_read_error(path: Path, error: OSError, note: str = "") -> OSError:
    """A failed read of a source file, in one line without an errno: the output's writer passes it on as it is."""
    return OSError(f"Could not read the source file {path}: {error.strerror or error}{note}.")


def _tensor_from_bytes(buffer: bytearray, dtype: torch.dtype, shape: Sequence[int]) -> torch.Tensor:
    if len(buffer) == 0:
        return torch.empty(tuple(shape), dtype=dtype)
    return torch.frombuffer(buffer, dtype=torch.uint8).view(dtype).reshape(tuple(shape))


class Checkpoint:
    """Tensors by name: `infos()` (shapes and dtypes, nothing read), `read(name, rows)` (dim-0 rows, or all)."""

    description: str = "checkpoint"
    config_name: str = "its config.json"  # what the source's config was read from, for messages
    metadata_keys: Collection[str] = ()  # its files' own metadata keys the output does not carry

    def infos(self) -> dict[str, TensorInfo]:
        raise NotImplementedError

    def read(self, name: str, rows: slice | None = None) -> torch.Tensor:
        raise NotImplementedError

    def stored_dtype(self, name: str) -> torch.dtype:
        """The narrowest dtype that holds the tensor's values as the source stores them (what a cast to another dtype
        may round): its `infos()` dtype, unless the checkpoint reads it wider (a GGUF file's F16 tensor)."""
        return self.infos()[name].dtype

    def stored_as(self, name: str) -> str:
        """How the source stores the tensor, in a word for messages: its `stored_dtype` ("float32"), or a GGUF
        file's quantisation type ("Q4_1"), whose values `stored_dtype` holds."""
        return str(self.stored_dtype(name)).removeprefix("torch.")

    def read_rows(self, name: str, indices: torch.Tensor) -> torch.Tensor:
        """Rows `indices` (any order, repeats allowed) of a 2-D tensor, e.g. embedding rows of a prompt."""
        self.check_rows(name, indices)
        return self.read(name)[indices]

    def check_rows(self, name: str, indices: torch.Tensor) -> None:
        """Raise, naming the tensor, if a row of `indices` is outside it (a row read at its byte offset past the end
        would come back empty or as the next tensor's bytes)."""
        rows = self.infos()[name].shape[0]
        outside = indices[(indices < 0) | (indices >= rows)]
        if len(outside):
            raise IndexError(f"{self.description}: row {int(outside[0])} of tensor {name!r} is out of range (it has "
                             f"{rows} rows).")

    def byte_range(self, name: str) -> tuple[int, int, int, Path] | None:
        """(file descriptor, offset, length, file path) of the tensor's bytes when they can be copied as they are."""
        return None

    def listed_but_absent(self) -> str:
        """A sentence naming tensors its index places in files that lack them (a sharded safetensors folder's), or
        "": what explains tensors the model needs and the checkpoint does not hold."""
        return ""

    def close(self) -> None:
        pass


def require_finite(chunk: torch.Tensor, name: str, description: str, first_row: int | None = None) -> None:
    """Raise, naming the tensor (and the rows of `chunk` when it holds rows `first_row`..), if `chunk` holds a NaN or
    an infinite value."""
    if not chunk.dtype.is_floating_point:
        return
    if torch.isfinite(chunk if chunk.dtype.itemsize > 1 else chunk.float()).all():
        return
    rows = "" if first_row is None else f" (in rows {first_row}..{first_row + max(len(chunk), 1) - 1})"
    raise ValueError(f"{description}: tensor {name!r} holds NaN or infinite values{rows}; a broken source is not "
                     "converted, nothing was written.")


def require_finite_cast(tensor: torch.Tensor, name: str, dtype_option: str) -> None:
    """Raise, naming the tensor, if `tensor`, made in the storage dtype from source values, holds NaN or an infinite
    value: a value outside that dtype's range (float16 tops out at 65504), which the cast made inf, or a broken source.
    `dtype_option`: how the caller chooses the storage dtype (`--dtype`, `dtype=...`)."""
    if not tensor.dtype.is_floating_point or torch.isfinite(tensor).all():
        return
    dtype = str(tensor.dtype).removeprefix("torch.")
    raise ValueError(f"Tensor {name!r} holds NaN or infinite values in {dtype}: a source value outside {dtype}'s range, "
                     f"which the cast made inf, or a broken source; convert to bfloat16 or float32 ({dtype_option}).")


class FiniteCheckpoint(Checkpoint):
    """`checkpoint` with every read checked for NaN/inf as it is materialised (`require_finite`), so the one read
    that writes a tensor also checks it; `byte_range` is not offered: a copy must go through a checked read."""

    def __init__(self, checkpoint: Checkpoint):
        self.checkpoint = checkpoint
        self.description = checkpoint.description

    def infos(self) -> dict[str, TensorInfo]:
        return self.checkpoint.infos()

    def read(self, name: str, rows: slice | None = None) -> torch.Tensor:
        chunk = self.checkpoint.read(name, rows)
        first_row = None if rows is None or chunk.dim() == 0 else rows.indices(2**63 - 1)[0]
        require_finite(chunk, name, self.description, first_row)
        return chunk

    def read_rows(self, name: str, indices: torch.Tensor) -> torch.Tensor:
        chunk = self.checkpoint.read_rows(name, indices)
        require_finite(chunk, name, self.description)
        return chunk


def check_tiled(spans: list[tuple[int, int, str]], buffer_size: int) -> None:
    """Raise unless the (begin, end, name) byte spans of a safetensors file's tensors tile its data buffer of
    `buffer_size` bytes: in order of their offsets, the first begins at 0, each where the previous ends, the last at the
    buffer's end. The safetensors library refuses any other header ("invalid offset"); a tensor pointing into another
    one's bytes would otherwise be read as a copy of it."""
    expected, previous = 0, None
    for begin, end, name in sorted(spans):
        if begin != expected:
            where = ("do not start the data buffer at 0" if previous is None
                     else f"{'overlap' if begin < expected else 'leave a gap after'} tensor {previous!r}, which ends at "
                          f"{expected}")
            raise ValueError(f"tensor {name!r}: data offsets {begin}..{end} {where}")
        expected, previous = end, name
    if expected != buffer_size:
        raise ValueError(f"its tensors' data ends at byte {expected} of a {buffer_size}-byte data buffer")


class _DuplicateTensor(Exception):
    """A tensor name found in a second file: (name, the first file)."""


# A PEFT adapter's weights file (`save_pretrained` of a PeftModel, beside adapter_config.json).
ADAPTER_WEIGHTS = "adapter_model.safetensors"


def _not_a_file(path: Path) -> str:
    """Why a path the converter must read as a file is not one, for a message: "does not exist", "is a folder", ..."""
    if path.is_symlink() and not path.exists():
        return "is a symlink to a missing file (an incomplete download?)"
    if not path.exists():
        return "does not exist"
    return "is a folder, not a file" if path.is_dir() else "is not a regular file (a pipe, socket or device)"


class SafetensorsCheckpoint(Checkpoint):
    """A folder's safetensors files, read through their headers: those of its index, else model.safetensors (as
    transformers reads a folder), else every `*.safetensors`."""

    def __init__(self, folder: str | os.PathLike, files: Sequence[str] | None = None, written: bool = False):
        """`written`: the folder is the converter's own output, read back to verify it: an OS error reading it is
        one of the disk written to, passed on with its errno (reported as a write error naming the output), not a
        read of the source."""
        self.folder = Path(folder)
        self.written = written
        self.description = f"safetensors in {self.folder}"
        self.weight_map: dict[str, str] = {}  # the index's, where one was read
        self.metadata_keys = set()  # the files' `__metadata__` keys beside "format"
        if files is None:
            index = self.folder / INDEX_NAME
            single = self.folder / "model.safetensors"
            if os.path.lexists(index) and not index.is_file():  # transformers reads model.safetensors, or fails
                if not single.is_file():
                    raise FileNotFoundError(f"{index} {_not_a_file(index)}; the folder's shards cannot be told apart "
                                            "from other safetensors files without it.")
                logger.warning(f"{index} {_not_a_file(index)}; reading {single.name}, as transformers does.")
            if index.is_file():
                try:
                    weight_map = json.loads(index.read_text())["weight_map"]
                except (json.JSONDecodeError, KeyError, TypeError) as error:
                    raise ValueError(f"{index} is not a safetensors index ({error!r}).") from error
                if not (isinstance(weight_map, dict) and weight_map
                        and all(isinstance(file, str) and file for file in weight_map.values())):
                    raise ValueError(
                        f"{index} is not a safetensors index: its weight_map must map each tensor name to the "
                        f"safetensors file that holds it (a non-empty object of file names), got {weight_map!r:.200}."
                    )
                self.weight_map = weight_map
                # One file however the index spells it ("./model-00001-of-00005.safetensors", as some tools write
                # it, is the shard beside it): else read twice, and named "not read" or "in both" itself.
                files = sorted({os.path.normpath(file) for file in weight_map.values()})
                outside = [file for file in files
                           if os.path.isabs(file) or os.path.normpath(file).split(os.sep)[0] == os.pardir]
                if outside:  # read as transformers would, but beyond the source folder the output check protects
                    raise ValueError(
                        f"{index} lists weights outside the source folder ({', '.join(map(repr, outside[:3]))}); "
                        "the converter reads only the folder's own files (which it keeps apart from the output). "
                        "Copy or link the shards into the folder and list them by their names."
                    )
                # Both are one checkpoint when the index lists model.safetensors alone (mlx-lm writes such an index).
                stale = single.is_file() and not any((self.folder / file).exists() for file in files)
                if stale:  # a later unsharded save_pretrained into the folder removed the shards, not their index
                    others = sorted(path.name for path in self.folder.glob("*.safetensors") if path != single)
                    logger.warning(f"Reading {single} only, as transformers does: {index.name} lists none of the files "
                                   f"in {self.folder} (a stale index, left by a later unsharded save_pretrained into "
                                   "the folder); remove it." + (f" Not read: {', '.join(others)}." if others else ""))
                    files = [single.name]
                elif single.is_file() and files != [single.name]:
                    raise ValueError(
                        f"Source folder {self.folder} holds two checkpoints: {single.name} and the shards of "
                        f"{index.name}. transformers' from_pretrained reads {single.name}; move the one you do not "
                        "mean out of the folder, so that the conversion reads the weights you use."
                    )
                unlisted = sorted(path.name for path in self.folder.glob("*.safetensors") if path.name not in files)
                if unlisted and not stale:  # a stale shard of an earlier save, an adapter: not this model's weights
                    logger.warning(f"Reading the {len(files)} file(s) of {index} only, as transformers does; not "
                                   f"read: {', '.join(unlisted)}.")
            elif single.is_file():  # as transformers reads the folder: other *.safetensors (a LoRA adapter, a backup)
                files = [single.name]  # are not this model's weights
                others = sorted(path.name for path in self.folder.glob("*.safetensors") if path.name != single.name)
                if others:
                    logger.warning(f"Reading {single} only, as transformers does; not read: {', '.join(others)}.")
            else:  # a PEFT adapter's weights are not a model's (its folder is refused as an adapter)
                files = sorted(path.name for path in self.folder.glob("*.safetensors") if path.name != ADAPTER_WEIGHTS)
        if not files:
            pickled = sorted(path.name for path in self.folder.glob("*.bin"))
            resave = "" if not pickled else (
                f" It holds {', '.join(pickled[:3])}{' ...' if len(pickled) > 3 else ''}: PyTorch pickles, which the "
                "converter does not read (it reads safetensors tensor by tensor); save the model as safetensors first "
                "(from_pretrained, then save_pretrained, which writes them).")
            raise FileNotFoundError(
                f"Source folder {self.folder} has no safetensors weights (model.safetensors or sharded "
                f"model-0000x-of-0000y.safetensors with model.safetensors.index.json).{resave}"
            )
        self._fds: list[int] = []
        self._files: dict[int, Path] = {}  # fd -> file, for messages
        self._entries: dict[str, tuple[int, int, TensorInfo]] = {}  # name -> (fd, absolute offset, info)
        try:
            for file in files:
                self._open(self.folder / file)
        except BaseException:
            self.close()
            raise

    def _open(self, path: Path) -> None:
        if not path.is_file():
            index = self.folder / INDEX_NAME
            listed = f" (listed in {index})" if index.is_file() else ""
            raise FileNotFoundError(f"{path}{listed} {_not_a_file(path)}.")
        fd = os.open(path, os.O_RDONLY)
        self._fds.append(fd)
        self._files[fd] = path
        size = os.fstat(fd).st_size
        try:
            (header_size,) = struct.unpack("<Q", pread_exact(fd, 8, 0))
            if not 2 <= header_size <= min(size - 8, 100 * 2**20):
                raise ValueError(f"header size {header_size} does not fit a file of {size} bytes")
            header = json.loads(pread_exact(fd, header_size, 8).decode("utf-8"))
            data_start = 8 + header_size
            spans = []  # (begin, end, name) of every tensor, checked to tile the data buffer below
            for name, entry in header.items():
                if name == "__metadata__":
                    self.metadata_keys |= set(entry) - {"format"} if isinstance(entry, dict) else set()
                    continue
                if not isinstance(entry, dict) or not {"dtype", "shape", "data_offsets"} <= entry.keys():
                    raise ValueError(f"tensor {name!r}'s header entry is {json.dumps(entry)[:120]}, not an object "
                                     "with dtype, shape and data_offsets")
                if entry["dtype"] not in SAFETENSORS_DTYPES:
                    raise ValueError(f"tensor {name!r} has dtype {entry['dtype']!r}")
                info = TensorInfo(tuple(int(n) for n in entry["shape"]), SAFETENSORS_DTYPES[entry["dtype"]])
                begin, end = (int(n) for n in entry["data_offsets"])
                if end - begin != info.nbytes or data_start + end > size:
                    raise ValueError(f"tensor {name!r}: offsets {begin}..{end} do not fit its shape or the file")
                if name in self._entries:
                    raise _DuplicateTensor(name, self._files[self._entries[name][0]].name)
                self._entries[name] = (fd, data_start + begin, info)
                spans.append((begin, end, name))
            check_tiled(spans, size - data_start)
        except _DuplicateTensor as duplicate:
            raise ValueError(
                f"Could not load the weights in {self.folder}: tensor {duplicate.args[0]!r} is in both "
                f"{duplicate.args[1]} and {path.name}; keep one model's weights in the folder (or an index that "
                "lists the shards to read)."
            ) from None
        except (ValueError, KeyError, TypeError, OSError, UnicodeDecodeError, struct.error) as error:
            if self.written and isinstance(error, OSError) and error.errno is not None:
                raise self._read_back_error(error, path) from error
            raise ValueError(f"Could not load the weights in {self.folder}: {path.name} is not a valid safetensors "
                             f"file ({error}).") from error

    def infos(self) -> dict[str, TensorInfo]:
        return {name: info for name, (_, _, info) in self._entries.items()}

    def listed_but_absent(self) -> str:
        """The tensors the index lists that no file read holds (transformers ignores them, and so does the converter
        unless the model needs them: then they explain the missing ones)."""
        absent = [f"{name} in {file}" for name, file in self.weight_map.items() if name not in self._entries]
        if not absent:
            return ""
        return (f" {INDEX_NAME} lists {len(absent)} tensor(s) that the file named for each does not hold "
                f"({', '.join(absent[:3])}{', ...' if len(absent) > 3 else ''}): a damaged or replaced shard?")

    def with_base_model_prefix(self, prefix: str, expected: Collection[str]) -> list[str]:
        """Read a base model's weights (`LlamaModel.save_pretrained`: `layers.0. ...`, `embed_tokens.weight`) as
        transformers' `from_pretrained` of the causal LM reads them: a tensor name the model lacks (`expected`: its
        state dict's names) but has with `prefix.` before it is read under that name (`core_model_loading.
        rename_source_key`), and the messages naming the folder say so. -> the names it renamed."""
        renamed = {name: f"{prefix}.{name}" for name in self._entries if name not in expected
                   and f"{prefix}.{name}" in expected and f"{prefix}.{name}" not in self._entries}
        if renamed:
            self._entries = {renamed.get(name, name): entry for name, entry in self._entries.items()}
            self.weight_map = {renamed.get(name, name): file for name, file in self.weight_map.items()}
            self.description += f" (a base model's weights, read with the {prefix}. prefix as transformers reads them)"
        return list(renamed)

    def read(self, name: str, rows: slice | None = None) -> torch.Tensor:
        fd, offset, info = self._entries[name]
        if rows is None or not info.shape:
            return _tensor_from_bytes(self._pread(fd, info.nbytes, offset), info.dtype, info.shape)
        start, stop, _ = rows.indices(info.shape[0])
        row_bytes = info.nbytes // max(info.shape[0], 1)
        buffer = self._pread(fd, (stop - start) * row_bytes, offset + start * row_bytes)
        return _tensor_from_bytes(buffer, info.dtype, (stop - start, *info.shape[1:]))

    def read_bytes(self, name: str, begin: int, length: int) -> bytearray:
        """`length` bytes of tensor `name`'s data from byte `begin` of it."""
        fd, offset, info = self._entries[name]
        if not 0 <= begin <= begin + length <= info.nbytes:
            raise ValueError(f"bytes {begin}..{begin + length} are outside tensor {name!r} ({info.nbytes} bytes)")
        return self._pread(fd, length, offset + begin)

    def _pread(self, fd: int, length: int, offset: int) -> bytearray:
        if not self.written:
            return pread_exact(fd, length, offset, self._files[fd])  # its errors name the source file
        try:
            return pread_exact(fd, length, offset)
        except OSError as error:
            if error.errno is None:  # shorter than its header says
                raise
            raise self._read_back_error(error, self._files[fd]) from error

    @staticmethod
    def _read_back_error(error: OSError, path: Path) -> OSError:
        return OSError(error.errno, f"{error.strerror or error} reading back the written {path.name} to verify it")

    def read_rows(self, name: str, indices: torch.Tensor) -> torch.Tensor:
        self.check_rows(name, indices)
        unique, inverse = torch.unique(indices, return_inverse=True)
        rows = torch.cat([self.read(name, slice(index, index + 1)) for index in unique.tolist()])
        return rows[inverse]

    def byte_range(self, name: str) -> tuple[int, int, int, Path]:
        fd, offset, info = self._entries[name]
        return fd, offset, info.nbytes, self._files[fd]

    def close(self) -> None:
        for fd in self._fds:
            os.close(fd)
        self._fds = []


class StateDictCheckpoint(Checkpoint):
    """An in-memory state dict, as given (a tied head included: the conversion plan drops it, as for a folder)."""

    def __init__(self, state_dict: Mapping[str, torch.Tensor], description: str = "in-memory model"):
        self.state_dict = dict(state_dict)
        self.description = description

    def infos(self) -> dict[str, TensorInfo]:
        return {name: TensorInfo(tuple(t.shape), t.dtype) for name, t in self.state_dict.items()}

    def read(self, name: str, rows: slice | None = None) -> torch.Tensor:
        tensor = self.state_dict[name].detach()
        return tensor if rows is None else tensor[rows]


def placed_gguf_tensors(path: Path, meta_model: torch.nn.Module) -> tuple[TensorProcessor, list[tuple[object, str]]]:
    """The tensors of a GGUF file, each with the parameter of `meta_model` (a model of the file's config) that
    transformers' `load_gguf_checkpoint` loads it into, and that loader's tensor processor: the one of the file's
    `general.architecture`, whose key map (`get_gguf_hf_weights_map`) names the tensors. The Qwen2-MoE/Qwen3-MoE
    processor looks an expert tensor `blk.N.ffn_{gate,up,down}_exps.weight` up without `.weight`.

    Raises, naming them, if the file holds tensors the model has no parameter for: the loader skips them, as a
    safetensors source's unplaceable tensors are refused (`keymaps.check_keys`)."""
    parsed = load_gguf_checkpoint(str(path))  # metadata only
    reader = gguf.GGUFReader(str(path))  # an np.memmap: only its header fields are touched here
    architecture = reader.fields["general.architecture"].contents()
    processor = TENSOR_PROCESSORS.get(architecture, TensorProcessor)(config=parsed["config"])
    key_map = get_gguf_hf_weights_map(meta_model, processor)
    experts = processor.GGUF_MOE_WEIGHTS_PATTERN if isinstance(processor, Qwen2MoeTensorProcessor) else None
    placed, unplaced = [], []
    for tensor in reader.tensors:
        expert = re.fullmatch(experts, tensor.name) if experts else None
        hf_name = key_map.get(expert["name"] if expert else tensor.name)
        if hf_name is None:
            unplaced.append(tensor.name)
        else:
            placed.append((tensor, hf_name))
    if unplaced:
        raise ValueError(
            f"the file holds {len(unplaced)} tensor(s) that {type(meta_model).__name__} of its config "
            f"has no parameter for: {unplaced[:8]}{' ...' if len(unplaced) > 8 else ''}. transformers' GGUF "
            "loader skips them (for example attention biases, or llama3 rope_freqs), so neither it nor a "
            "conversion would compute what this file's model computes; nothing is converted."
        )
    return processor, placed


# GGUF tensor types whose values a torch dtype holds exactly (the rest are read as float32).
GGUF_EXACT_DTYPES = {"F16": torch.float16, "BF16": torch.bfloat16, "F32": torch.float32}
GGUF_DEQUANTISE_CHUNK_BYTES = 64 << 20  # float32 rows dequantised at a time (GGUFCheckpoint)


class GGUFCheckpoint(Checkpoint):
    """A dense-family GGUF file, one tensor at a time: read at its offset, dequantised (float32), un-permuted by
    transformers' tensor processor and named through `get_gguf_hf_weights_map` of a meta model of `config`.

    The last tensor read stays dequantised, so reading a tensor in row chunks (casting, checking, the LM head in
    vocabulary chunks) dequantises it once, not once per chunk; the memory is that one tensor in float32, which the
    first chunk needs anyway (the q/k un-permutation mixes rows within a head). The dequantisation itself reads and
    dequantises `GGUF_DEQUANTISE_CHUNK_BYTES` of float32 rows at a time into that tensor: gguf-py's `dequantize`
    keeps every group's output and then concatenates them (twice the tensor in float32, plus the quantised bytes
    read), which a 128256 x 4096 embedding would make 4 GiB more than the tensor itself (README, "At scale")."""

    def __init__(self, path: str | os.PathLike, config, meta_model: torch.nn.Module):
        if gguf is None:
            raise ImportError("Reading a GGUF file needs the `gguf` package: pip install 'dar-transformers[gguf]'.")
        self.path = Path(path)
        self.description = f"GGUF file {self.path}"
        self.config_name = "its GGUF metadata"
        self.processor, placed = placed_gguf_tensors(self.path, meta_model)
        self._fd = os.open(self.path, os.O_RDONLY)
        self._tensors = {}
        self._last: tuple[str, torch.Tensor] | None = None  # (name, the whole dequantised tensor)
        self.dequantised = 0  # tensors dequantised so far (each once per run of reads)
        for tensor, hf_name in placed:
            info = TensorInfo(tuple(int(n) for n in reversed(tensor.shape.tolist())), torch.float32)
            self._tensors[hf_name] = (tensor.name, tensor.tensor_type, tensor.data.dtype, tensor.data.shape,
                                      int(tensor.data_offset), int(tensor.n_bytes), info)

    def infos(self) -> dict[str, TensorInfo]:
        return {name: entry[-1] for name, entry in self._tensors.items()}

    def stored_dtype(self, name: str) -> torch.dtype:
        """F16 and BF16 tensors are read as float32 but hold float16 / bfloat16 values (a conversion to that dtype
        rounds none of them); a quantised tensor's values (integers times a scale) are float32's."""
        return GGUF_EXACT_DTYPES.get(self._tensors[name][1].name, torch.float32)

    def stored_as(self, name: str) -> str:
        kind = self._tensors[name][1].name
        return kind if kind not in GGUF_EXACT_DTYPES else super().stored_as(name)

    def _dequantised(self, name: str) -> torch.Tensor:
        if self._last is not None and self._last[0] == name:
            return self._last[1]
        self._last = None  # free the previous tensor before making the next
        gguf_name, tensor_type, raw_dtype, raw_shape, offset, nbytes, info = self._tensors[name]
        rows = int(np.prod(raw_shape[:-1], dtype=np.int64))  # a row's blocks are contiguous, rows independent
        width = int(np.prod(info.shape, dtype=np.int64)) // max(rows, 1)  # dequantised values per row
        row_bytes = nbytes // max(rows, 1)
        weights = np.empty((rows, width), dtype=np.float32)
        step = max(1, GGUF_DEQUANTISE_CHUNK_BYTES // max(4 * width, 1))
        for start in range(0, rows, step):
            stop = min(start + step, rows)
            raw = pread_exact(self._fd, (stop - start) * row_bytes, offset + start * row_bytes, self.path)
            raw = np.frombuffer(raw, dtype=raw_dtype).reshape(stop - start, raw_shape[-1])
            try:
                weights[start:stop] = gguf.dequantize(raw, tensor_type)
            except NotImplementedError as error:  # F64, the integer types, some quantisation types (Q8_1, Q1_0)
                raise ValueError(
                    f"{self.description}: tensor {gguf_name} is stored as {tensor_type.name}, which the gguf package "
                    f"(which transformers reads GGUF files with) cannot dequantise ({error}); nothing is converted. "
                    "Convert a GGUF file whose tensors are F32, F16, BF16 or of a type such as Q8_0, Q4_K or IQ4_XS, "
                    "or the Hugging Face folder."
                ) from error
        weights = weights.reshape(*raw_shape[:-1], width)
        result = self.processor.process(weights=weights, name=gguf_name, tensor_key_mapping={}, parsed_parameters={})
        tensor = torch.from_numpy(np.ascontiguousarray(result.weights, dtype=np.float32)).reshape(info.shape)
        self.dequantised += 1
        self._last = (name, tensor)
        return tensor

    def read(self, name: str, rows: slice | None = None) -> torch.Tensor:
        tensor = self._dequantised(name)
        return tensor if rows is None else tensor[rows]

    def close(self) -> None:
        self._last = None
        if self._fd is not None:
            os.close(self._fd)
            self._fd = None


__all__ = ["Checkpoint", "FiniteCheckpoint", "GGUFCheckpoint", "SafetensorsCheckpoint", "StateDictCheckpoint",
           "placed_gguf_tensors", "require_finite"]
