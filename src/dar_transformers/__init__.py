# SPDX-License-Identifier: Apache-2.0
"""dar-transformers: Dual Attention Residuals (arXiv 2607.18730) as a Hugging Face transformers model family.

Importing the package registers the `dar` model type with the Auto classes (idempotently).
"""

from transformers import AutoConfig, AutoModel, AutoModelForCausalLM, AutoModelForSequenceClassification

from .configuration_dar import DARConfig
from .modeling_dar import DARForCausalLM, DARForSequenceClassification, DARModel, DARPreTrainedModel

__version__ = "0.1.0"


def _register_auto_classes() -> None:
    AutoConfig.register(DARConfig.model_type, DARConfig, exist_ok=True)
    AutoModel.register(DARConfig, DARModel, exist_ok=True)
    AutoModelForCausalLM.register(DARConfig, DARForCausalLM, exist_ok=True)
    AutoModelForSequenceClassification.register(DARConfig, DARForSequenceClassification, exist_ok=True)


_register_auto_classes()

__all__ = [
    "DARConfig",
    "DARModel",
    "DARForCausalLM",
    "DARForSequenceClassification",
    "DARPreTrainedModel",
]
