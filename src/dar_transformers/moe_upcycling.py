# SPDX-License-Identifier: Apache-2.0
# Copyright 2026 The dar-transformers authors.
"""Moved to `dar_transformers.conversion` (the "dar_moe" target in `conversion.targets`, the entry points in
`conversion.api`); re-exported here so that old imports keep working."""

from .conversion.api import convert_to_dar_moe, upcycle_to_dar_moe
from .conversion.families import MOE_CONFIG_FIELDS
from .conversion.keymaps import fuse_expert_weights
from .conversion.targets import dar_moe_config_from_source, dar_moe_target_kind, drop_upcycled_experts

__all__ = [
    "MOE_CONFIG_FIELDS",
    "convert_to_dar_moe",
    "dar_moe_config_from_source",
    "dar_moe_target_kind",
    "drop_upcycled_experts",
    "fuse_expert_weights",
    "upcycle_to_dar_moe",
]
