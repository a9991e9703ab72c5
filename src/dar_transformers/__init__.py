# SPDX-License-Identifier: Apache-2.0
"""dar-transformers: Dual Attention Residuals (arXiv 2607.18730) as a Hugging Face transformers model family.

Importing the package registers the `dar` and `dar_moe` model types with the Auto classes and PEFT's default
LoRA targets (idempotently).
"""

from transformers import (
    AutoConfig,
    AutoModel,
    AutoModelForCausalLM,
    AutoModelForQuestionAnswering,
    AutoModelForSequenceClassification,
    AutoModelForTokenClassification,
)

from .configuration_dar import DARConfig
from .configuration_dar_moe import DARMoeConfig
from .modeling_dar import (
    DARForCausalLM,
    DARForQuestionAnswering,
    DARForSequenceClassification,
    DARForTokenClassification,
    DARModel,
    DARPreTrainedModel,
)
from .modeling_dar_moe import DARMoeForCausalLM, DARMoeModel, DARMoePreTrainedModel
from .peft_utils import register_peft_defaults

__version__ = "0.1.0"


def _register_auto_classes() -> None:
    AutoConfig.register(DARConfig.model_type, DARConfig, exist_ok=True)
    AutoModel.register(DARConfig, DARModel, exist_ok=True)
    AutoModelForCausalLM.register(DARConfig, DARForCausalLM, exist_ok=True)
    AutoModelForSequenceClassification.register(DARConfig, DARForSequenceClassification, exist_ok=True)
    AutoModelForQuestionAnswering.register(DARConfig, DARForQuestionAnswering, exist_ok=True)
    AutoModelForTokenClassification.register(DARConfig, DARForTokenClassification, exist_ok=True)
    # Saved and pushed checkpoints carry `auto_map` and the flat remote-code files, so they load with
    # `trust_remote_code=True` where this package is not installed.
    DARConfig.register_for_auto_class()
    DARModel.register_for_auto_class("AutoModel")
    DARForCausalLM.register_for_auto_class("AutoModelForCausalLM")
    DARForSequenceClassification.register_for_auto_class("AutoModelForSequenceClassification")
    DARForQuestionAnswering.register_for_auto_class("AutoModelForQuestionAnswering")
    DARForTokenClassification.register_for_auto_class("AutoModelForTokenClassification")
    AutoConfig.register(DARMoeConfig.model_type, DARMoeConfig, exist_ok=True)
    AutoModel.register(DARMoeConfig, DARMoeModel, exist_ok=True)
    AutoModelForCausalLM.register(DARMoeConfig, DARMoeForCausalLM, exist_ok=True)
    DARMoeConfig.register_for_auto_class()
    DARMoeModel.register_for_auto_class("AutoModel")
    DARMoeForCausalLM.register_for_auto_class("AutoModelForCausalLM")


_register_auto_classes()
# PEFT's default target modules for model_type "dar" are Llama's (same module names); see peft_utils.
register_peft_defaults(DARConfig.model_type)
register_peft_defaults(DARMoeConfig.model_type)

__all__ = [
    "DARConfig",
    "DARModel",
    "DARForCausalLM",
    "DARForSequenceClassification",
    "DARForQuestionAnswering",
    "DARForTokenClassification",
    "DARPreTrainedModel",
    "DARMoeConfig",
    "DARMoeModel",
    "DARMoeForCausalLM",
    "DARMoePreTrainedModel",
]
