# SPDX-License-Identifier: Apache-2.0
# Copyright 2026 The dar-transformers authors.
"""Moved to `dar_transformers.conversion` (readers in `conversion.checkpoints`, writing in `conversion.write`);
re-exported here so that old imports keep working."""

from .conversion.checkpoints import Checkpoint, GGUFCheckpoint, SafetensorsCheckpoint, StateDictCheckpoint
from .conversion.keymaps import TensorInfo, TensorPlan
from .conversion.options import parse_size
from .conversion.plan import materialise
from .conversion.write import write_checkpoint

__all__ = [
    "Checkpoint",
    "GGUFCheckpoint",
    "SafetensorsCheckpoint",
    "StateDictCheckpoint",
    "TensorInfo",
    "TensorPlan",
    "materialise",
    "parse_size",
    "write_checkpoint",
]
