# SPDX-License-Identifier: Apache-2.0
# Copyright 2026 The dar-transformers authors.
"""Moved to `dar_transformers.conversion.card`; re-exported here so that old imports keep working."""

from .conversion.card import chat_answers, render_model_card

__all__ = ["chat_answers", "render_model_card"]
