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
from .modeling_dar_moe import (
    DARMoeForCausalLM,
    DARMoeForQuestionAnswering,
    DARMoeForSequenceClassification,
    DARMoeForTokenClassification,
    DARMoeModel,
    DARMoePreTrainedModel,
)
from .peft_utils import register_peft_defaults

__version__ = "0.1.0"
# The transformers releases the package and the remote code of the folders it writes are tested with: setup.cfg's
# install_requires says the same (tests/conversion/test_convert_moe.py checks), model cards quote it.
TRANSFORMERS_REQUIREMENT = "transformers>=5.19,<5.26"


# The one registration table: for each model type, the class every Auto class builds. Importing the package
# registers each row with transformers (installed use), and marks each class for `save_pretrained`'s remote code:
# every folder the package writes (save_pretrained, push_to_hub, dar convert, a merged PEFT model) carries the flat
# code and an `auto_map` naming all of them (`DARConfig.save_pretrained`), so each loads with
# `trust_remote_code=True` where this package is not installed. vLLM's Transformers backend builds `AutoModel`.
AUTO_CLASSES = {
    DARConfig: {
        AutoModel: DARModel,
        AutoModelForCausalLM: DARForCausalLM,
        AutoModelForSequenceClassification: DARForSequenceClassification,
        AutoModelForQuestionAnswering: DARForQuestionAnswering,
        AutoModelForTokenClassification: DARForTokenClassification,
    },
    DARMoeConfig: {
        AutoModel: DARMoeModel,
        AutoModelForCausalLM: DARMoeForCausalLM,
        AutoModelForSequenceClassification: DARMoeForSequenceClassification,
        AutoModelForQuestionAnswering: DARMoeForQuestionAnswering,
        AutoModelForTokenClassification: DARMoeForTokenClassification,
    },
}


def _register_auto_classes() -> None:
    """Register `AUTO_CLASSES` with transformers and for remote code; idempotent (runs once at import). Each config
    class's `remote_code_auto_map` names the same classes as they are written into a folder."""
    for config_class, model_classes in AUTO_CLASSES.items():
        AutoConfig.register(config_class.model_type, config_class, exist_ok=True)
        config_class.register_for_auto_class()
        for auto_class, model_class in model_classes.items():
            auto_class.register(config_class, model_class, exist_ok=True)
            model_class.register_for_auto_class(auto_class.__name__)


_register_auto_classes()
# PEFT's default target modules for model_type "dar" are Llama's (same module names); see peft_utils.
for _config_class in AUTO_CLASSES:
    register_peft_defaults(_config_class.model_type)

__all__ = [
    "AUTO_CLASSES",
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
    "DARMoeForSequenceClassification",
    "DARMoeForQuestionAnswering",
    "DARMoeForTokenClassification",
    "DARMoePreTrainedModel",
    "TRANSFORMERS_REQUIREMENT",
]
