# SPDX-License-Identifier: Apache-2.0
# Copyright 2026 The dar-transformers authors.
"""Conversion of Llama-family checkpoints into DAR and DAR-MoE (DESIGN.md sections 3 and 6)."""
