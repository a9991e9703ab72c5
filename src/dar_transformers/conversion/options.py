# SPDX-License-Identifier: Apache-2.0
# Copyright 2026 The dar-transformers authors.
"""The options of one conversion, as one value validated once (`upcycle(source, output, options)`).

`upcycle` and `convert` still take them as keyword arguments: `ConversionOptions.split(keywords)` separates the
option names from the target kind's config fields (`dar_block_size`, `num_experts`, ...), which go into `fields`.
"""

import dataclasses
import difflib
import math
from collections.abc import Mapping, Sequence

import torch
from huggingface_hub.errors import HFValidationError
from huggingface_hub.utils import validate_repo_id
from transformers.utils.hub import convert_file_size_to_int

from .targets import TARGET_FIELDS, TargetKind, target_kind

DTYPES: dict[str, torch.dtype] = {
    "float64": torch.float64,
    "float32": torch.float32,
    "bfloat16": torch.bfloat16,
    "float16": torch.float16,
}


def resolve_dtype(dtype: str | torch.dtype | None) -> torch.dtype | None:
    """A torch dtype from its name; "auto" (or None) -> None, meaning the source's own."""
    if dtype is None or dtype == "auto":
        return None
    if isinstance(dtype, torch.dtype) and dtype in DTYPES.values():
        return dtype
    if dtype in DTYPES:
        return DTYPES[dtype]
    raise ValueError(f"dtype must be 'auto' or one of {list(DTYPES)}, got {dtype!r}.")


def parse_size(size: str | int) -> int:
    """'2GB' -> 2e9, '500MB', '40KB', '1GiB', or a positive int of bytes (as transformers' `max_shard_size`). A unit
    with a lowercase b ('2gb', '500Mb') is refused: transformers reads it as bits (2gb: 250 MB shards), which no one
    converting a checkpoint means."""
    if isinstance(size, bool) or not isinstance(size, (int, str)):
        raise ValueError(f"max_shard_size must be a size such as '2GB' or '500MB', or an int of bytes, got {size!r}.")
    if isinstance(size, str) and size.strip().endswith("b") and not size.strip().upper().endswith("IB"):
        in_bytes = size.strip()[:-1].upper() + "B"
        try:
            convert_file_size_to_int(in_bytes)
            hint = f"write {in_bytes!r} for bytes"
        except ValueError:  # "100b": no unit transformers reads as bytes either
            hint = "write a size such as '2GB' or '500MB', or a number of bytes"
        raise ValueError(f"max_shard_size {size!r} ends in a lowercase b, which transformers reads as bits (an eighth "
                         f"of the bytes); {hint}.")
    try:
        size_bytes = size if isinstance(size, int) else convert_file_size_to_int(size)
    except (ValueError, TypeError) as error:
        raise ValueError(
            f"max_shard_size must be a size such as '2GB' or '500MB', or an int of bytes, got {size!r}."
        ) from error
    if size_bytes <= 0:
        raise ValueError(
            f"max_shard_size must be a positive size such as '2GB' or '500MB', or an int of bytes, got {size!r}."
        )
    return size_bytes


@dataclasses.dataclass(frozen=True)
class ConversionOptions:
    """How to convert, verify and write (the defaults are `dar convert`'s).

    kind: the target ("dar", "dar_moe", or a `TargetKind`); fields: its config fields (`dar_block_size`, ...).
    dtype: storage dtype of the shared weights ("auto": the source's own). tolerance: max |logit difference|
    (None: the verification dtype's default; larger relaxes the check, which the card records). verify_dtype:
    "float32"/"float64" (None: float32, float64 for float64 weights). full_greedy: full greedy continuations (None:
    when both models fit in `FULL_GREEDY_MAX_BYTES`). prompts: verification texts (None: the default five).
    max_new_tokens: greedy tokens compared per prompt. max_shard_size: safetensors shard size. base_model: the
    source's Hub id, for the card. overwrite: replace an existing output. progress: progress bars.
    """

    kind: str | TargetKind = "dar"
    fields: Mapping[str, object] = dataclasses.field(default_factory=dict)
    dtype: str | torch.dtype = "auto"
    tolerance: float | None = None
    verify: bool = True
    verify_dtype: str | torch.dtype | None = None
    full_greedy: bool | None = None
    prompts: Sequence[str] | None = None
    max_new_tokens: int = 64
    max_shard_size: str | int = "2GB"
    base_model: str | None = None
    overwrite: bool = False
    progress: bool = True

    def __post_init__(self):
        for name in ("verify", "overwrite", "progress", "full_greedy"):
            value = getattr(self, name)
            if not isinstance(value, bool) and not (name == "full_greedy" and value is None):
                # a truthy string ("no", "false") meant yes: overwrite="no" replaced a previous output
                allowed = "True, False or None (when both models fit in memory)" if name == "full_greedy" else \
                    "True or False"
                raise ValueError(f"{name} must be {allowed}, got {value!r}.")
        if not isinstance(self.fields, Mapping):
            raise ValueError(f"fields must be a mapping of config field names to values (such as "
                             f"{{'dar_block_size': 8}}), got {self.fields!r}.")
        if self.tolerance is not None and not (
            isinstance(self.tolerance, (int, float)) and not isinstance(self.tolerance, bool) and self.tolerance > 0
            and not math.isnan(self.tolerance)
        ):
            raise ValueError(f"tolerance must be a positive number, got {self.tolerance!r}.")
        if not (isinstance(self.max_new_tokens, int) and not isinstance(self.max_new_tokens, bool)
                and self.max_new_tokens >= 0):
            raise ValueError(
                f"max_new_tokens must be an integer >= 0 (0: no greedy continuations), got {self.max_new_tokens!r}."
            )
        if self.prompts is not None and (isinstance(self.prompts, str) or not isinstance(self.prompts, Sequence)
                                         or not all(isinstance(text, str) for text in self.prompts)):
            # a str is a Sequence too: each of its characters was verified as a one-token prompt
            raise ValueError(f"prompts must be a list of texts (str), got {self.prompts!r}.")
        if self.prompts is not None and not self.prompts:
            raise ValueError("prompts must hold at least one text (None: the default prompts), got [].")
        resolve_dtype(self.dtype)
        if self.verify_dtype is not None and resolve_dtype(self.verify_dtype) not in (torch.float32, torch.float64):
            raise ValueError(f"verify_dtype must be 'float32' or 'float64', got {self.verify_dtype!r}.")
        target_kind(self.kind)  # an unknown kind fails here
        parse_size(self.max_shard_size)
        if self.base_model is not None:  # written into the card's YAML front matter and title: a Hub id, nothing else
            try:
                validate_repo_id(self.base_model)
            except HFValidationError as error:
                raise ValueError(
                    f"base_model must be the source's Hub id (such as 'HuggingFaceTB/SmolLM2-135M-Instruct'), got "
                    f"{self.base_model!r}: {error}"
                ) from error

    @classmethod
    def split(cls, keywords: Mapping[str, object]) -> tuple[dict[str, object], dict[str, object]]:
        """(option keywords, target config fields) of `upcycle(**keywords)`'s keyword arguments; `fields=` (a mapping
        of config fields, as `ConversionOptions` takes them) stays an option, which `conversion_options` merges. A
        keyword that is no known field and spelt nearly as an option (overwite=True) is refused, naming the option;
        any other is a field, which the target kind checks when its config is built (a registered kind's own)."""
        names = {field.name for field in dataclasses.fields(cls)}
        for keyword in sorted(set(keywords) - names - TARGET_FIELDS):
            near = difflib.get_close_matches(keyword, names, n=1, cutoff=0.8)
            if near:
                raise TypeError(f"Unknown option {keyword!r} (did you mean {near[0]!r}?); the options are "
                                f"{sorted(names)}, and other keywords are config fields of the target kind.")
        options = {name: value for name, value in keywords.items() if name in names}
        return options, {name: value for name, value in keywords.items() if name not in names}

    @property
    def target(self) -> TargetKind:
        return target_kind(self.kind)

    @property
    def storage_dtype(self) -> torch.dtype | None:
        """The requested storage dtype, None for the source's own."""
        return resolve_dtype(self.dtype)

    @property
    def max_shard_bytes(self) -> int:
        return parse_size(self.max_shard_size)

    def verification_dtype(self, storage_dtype: torch.dtype) -> torch.dtype:
        """float32 for float32 and half-precision weights, float64 for float64 ones, or the requested one."""
        return resolve_dtype(self.verify_dtype) or torch.promote_types(storage_dtype, torch.float32)


__all__ = ["DTYPES", "ConversionOptions", "parse_size", "resolve_dtype"]
