# SPDX-License-Identifier: Apache-2.0
# Copyright 2026 The dar-transformers authors.
"""Moved to `dar_transformers.conversion.streamed` (the layer-streamed forward now runs the model's own `forward`);
re-exported here so that old imports keep working."""

from .conversion.streamed import LogitStatistics, StreamedModel, streamed_logit_statistics, streamed_logits

__all__ = ["LogitStatistics", "StreamedModel", "streamed_logit_statistics", "streamed_logits"]
