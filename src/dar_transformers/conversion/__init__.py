# SPDX-License-Identifier: Apache-2.0
# Copyright 2026 The dar-transformers authors.
"""Conversion of Llama-family checkpoints into DAR and DAR-MoE (DESIGN.md sections 3 and 6).

One module per step, each importing only the ones above it, in the order a checkpoint flows through them:

    families  which source model_types convert, and the config fields a target copies from its source
    keymaps   what each source tensor becomes (key map, new parameters, per-expert fusion): data
    targets   "dar" and "dar_moe": how each builds its config and plans its tensors, what it adds
    options   the options of one conversion, as one value
    checkpoints, sources   the source's tensors (safetensors, GGUF, in memory), config and tokenizer
    plan      every target tensor from names and shapes, the new ones from the model's `_init_weights`
    write     safetensors shards, index, config, code, tokenizer
    report, streamed, verify   source vs written model, layer by layer with the model's own forward
    card      the model card
    output    the output folder: checked, staged, moved into place
    api       `upcycle`, `convert`, `upcycle_to_dar_moe`, `convert_to_dar_moe` (what `dar convert` calls)
"""

from .api import ConversionResult, convert, convert_to_dar_moe, upcycle, upcycle_to_dar_moe
from .families import MOE_SOURCE_FAMILIES, SOURCE_FAMILIES, UnsupportedArchitectureError
from .keymaps import DAR_KEY_MAP, DAR_NEW_PARAMETERS
from .options import DTYPES, ConversionOptions
from .plan import new_parameter_values, plan_conversion, upcycle_model
from .report import VerificationError, VerificationReport
from .sources import load_source
from .targets import TARGET_KINDS, TargetKind, register_target_kind
from .verify import chat_input_ids, verify_conversion, verify_written

__all__ = [
    "DAR_KEY_MAP",
    "DAR_NEW_PARAMETERS",
    "DTYPES",
    "MOE_SOURCE_FAMILIES",
    "SOURCE_FAMILIES",
    "TARGET_KINDS",
    "ConversionOptions",
    "ConversionResult",
    "TargetKind",
    "UnsupportedArchitectureError",
    "VerificationError",
    "VerificationReport",
    "chat_input_ids",
    "convert",
    "convert_to_dar_moe",
    "load_source",
    "new_parameter_values",
    "plan_conversion",
    "register_target_kind",
    "upcycle",
    "upcycle_model",
    "upcycle_to_dar_moe",
    "verify_conversion",
    "verify_written",
]
