# SPDX-License-Identifier: Apache-2.0
# Copyright 2026 The dar-transformers authors.
"""Moved to the package `dar_transformers.conversion` (README: "Where things are"). The names this module used to
define are re-exported here, so `from dar_transformers.convert import convert, upcycle, ...` keeps working."""

from .conversion.api import ConversionResult, convert, upcycle
from .conversion.families import MOE_SOURCE_FAMILIES, SOURCE_FAMILIES, UnsupportedArchitectureError, source_family
from .conversion.keymaps import DAR_KEY_MAP, DAR_NEW_PARAMETERS, SOURCE_KEYS_IGNORED, check_keys, map_keys
from .conversion.options import DTYPES, ConversionOptions, resolve_dtype
from .conversion.plan import cast_model, meta_model, new_parameter_values, plan_conversion, upcycle_model
from .conversion.report import DEFAULT_TOLERANCES, PromptCheck, VerificationError, VerificationReport
from .conversion.sources import Source, load_source, load_source_config, open_source
from .conversion.targets import TARGET_KINDS, TargetKind, build_dar_config, register_target_kind
from .conversion.verify import (
    CHAT_PROMPT,
    DEFAULT_PROMPTS,
    FULL_GREEDY_MAX_BYTES,
    build_prompts,
    chat_input_ids,
    greedy_continuations,
    norms_in_input_dtype,
    rms_norm_in_input_dtype,
    verify_conversion,
    verify_written,
)

__all__ = [
    "CHAT_PROMPT",
    "DAR_KEY_MAP",
    "DAR_NEW_PARAMETERS",
    "DEFAULT_PROMPTS",
    "DEFAULT_TOLERANCES",
    "DTYPES",
    "FULL_GREEDY_MAX_BYTES",
    "MOE_SOURCE_FAMILIES",
    "SOURCE_FAMILIES",
    "SOURCE_KEYS_IGNORED",
    "TARGET_KINDS",
    "ConversionOptions",
    "ConversionResult",
    "PromptCheck",
    "Source",
    "TargetKind",
    "UnsupportedArchitectureError",
    "VerificationError",
    "VerificationReport",
    "build_dar_config",
    "build_prompts",
    "cast_model",
    "chat_input_ids",
    "check_keys",
    "convert",
    "greedy_continuations",
    "load_source",
    "load_source_config",
    "map_keys",
    "meta_model",
    "new_parameter_values",
    "norms_in_input_dtype",
    "open_source",
    "plan_conversion",
    "register_target_kind",
    "resolve_dtype",
    "rms_norm_in_input_dtype",
    "source_family",
    "upcycle",
    "upcycle_model",
    "verify_conversion",
    "verify_written",
]
