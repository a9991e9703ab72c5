# SPDX-License-Identifier: Apache-2.0
"""transformers' own common model tests (`ModelTesterMixin`, from the installed release's source distribution) on
DAR and DAR-MoE: every base model and head, as an in-tree model would be tested.

Marked `upstream`: `make test` runs them on the newest supported transformers (`make test-upstream`) and on the
oldest (with the `compat` suite), each against that release's own `tests/test_modeling_common.py`, which the
Makefile fetches from PyPI's source distribution into `.cache/transformers-<version>/`. The source distribution
does not ship the generation and export mixins that file imports (`tests/generation/test_utils.py`,
`tests/exporters/test_export.py`), so they are empty classes here: DAR's generation is tested in
`test_modeling_dar_hf.py` (greedy, sampling, beam search, static cache, left padding) and `test_moe.py`, export by
the serving work. The skips are upstream's own (GPU, flash-attention, kernels, ...).
"""

import sys
import types
import unittest
from pathlib import Path
from unittest import mock

import pytest
import transformers

from dar_transformers import (
    AUTO_CLASSES,
    DARConfig,
    DARForCausalLM,
    DARForQuestionAnswering,
    DARForSequenceClassification,
    DARForTokenClassification,
    DARModel,
    DARMoeConfig,
    DARMoeForCausalLM,
    DARMoeForQuestionAnswering,
    DARMoeForSequenceClassification,
    DARMoeForTokenClassification,
    DARMoeModel,
)

pytestmark = pytest.mark.upstream
REPOSITORY = Path(__file__).resolve().parents[1]
COMMON_TESTS = REPOSITORY / ".cache" / f"transformers-{transformers.__version__}" / "test_modeling_common.py"


def test_the_installed_releases_common_tests_are_fetched():
    assert COMMON_TESTS.is_file(), (
        f"{COMMON_TESTS} is missing: `make test-upstream` fetches it from transformers "
        f"{transformers.__version__}'s source distribution on PyPI."
    )


def import_model_tester_mixin():
    """`test_modeling_common` as a module of a package `transformers_tests` with empty generation/export mixins."""
    package = types.ModuleType("transformers_tests")
    package.__path__ = [str(COMMON_TESTS.parent)]
    stubs = {
        "transformers_tests.exporters.test_export": "ExportTesterMixin",
        "transformers_tests.generation.test_utils": "GenerationTesterMixin",
    }
    sys.modules["transformers_tests"] = package
    for module_name, class_name in stubs.items():
        parent_name = module_name.rsplit(".", 1)[0]
        parent = sys.modules.setdefault(parent_name, types.ModuleType(parent_name))
        parent.__path__ = []
        module = types.ModuleType(module_name)
        setattr(module, class_name, type(class_name, (), {}))
        sys.modules[module_name] = module
    from transformers_tests import test_modeling_common

    return test_modeling_common


if COMMON_TESTS.is_file():  # else the test above says how to fetch them
    common = import_model_tester_mixin()
    EmptyGenerationTesterMixin = sys.modules["transformers_tests.generation.test_utils"].GenerationTesterMixin

    class DARModelTester:
        """Upstream `CausalLMModelTester`'s tiny shapes (batch 13, 7 tokens, hidden 32, 2 layers, vocab 99)."""

        def __init__(self, parent, config_class, **config_fields):
            self.parent = parent
            self.config_class = config_class
            self.config_fields = config_fields
            self.batch_size = 13
            self.seq_length = 7
            self.is_training = True
            self.vocab_size = 99
            self.hidden_size = 32
            self.num_hidden_layers = 2
            self.num_attention_heads = 4
            self.num_labels = 3

        def get_config(self):
            return self.config_class(
                vocab_size=self.vocab_size, hidden_size=self.hidden_size, intermediate_size=37,
                num_hidden_layers=self.num_hidden_layers, num_attention_heads=self.num_attention_heads,
                num_key_value_heads=2, max_position_embeddings=512, pad_token_id=0, bos_token_id=1, eos_token_id=2,
                num_labels=self.num_labels, **self.config_fields,
            )

        def prepare_config_and_inputs_for_common(self):
            input_ids = common.ids_tensor([self.batch_size, self.seq_length], self.vocab_size)
            attention_mask = common.random_attention_mask([self.batch_size, self.seq_length])
            return self.get_config(), {"input_ids": input_ids, "attention_mask": attention_mask}

    class InTreeNames:
        """The common tests pick labels and skip base models by transformers' static class-name tables
        (`MODEL_FOR_CAUSAL_LM_MAPPING_NAMES`, ...), as for an in-tree model: each row of the package's registration
        table is added to the table of its Auto class while the test class runs, and removed after."""

        config_class: type

        @classmethod
        def setUpClass(cls):
            super().setUpClass()
            for auto_class, model_class in AUTO_CLASSES[cls.config_class].items():
                names = mock.patch.dict(auto_class._model_mapping._model_mapping,
                                        {cls.config_class.model_type: model_class.__name__})
                names.start()
                cls.addClassCleanup(names.stop)

    class DARModelTest(InTreeNames, common.ModelTesterMixin, EmptyGenerationTesterMixin, unittest.TestCase):
        config_class = DARConfig
        all_model_classes = (
            DARModel, DARForCausalLM, DARForSequenceClassification, DARForQuestionAnswering, DARForTokenClassification
        )

        def setUp(self):
            self.model_tester = DARModelTester(self, DARConfig, dar_block_size=3)

    class DARMoeModelTest(InTreeNames, common.ModelTesterMixin, EmptyGenerationTesterMixin, unittest.TestCase):
        config_class = DARMoeConfig
        all_model_classes = (
            DARMoeModel, DARMoeForCausalLM, DARMoeForSequenceClassification, DARMoeForQuestionAnswering,
            DARMoeForTokenClassification,
        )

        def setUp(self):
            self.model_tester = DARModelTester(
                self, DARMoeConfig, dar_block_size=3, num_experts=4, num_experts_per_tok=2, moe_intermediate_size=16
            )
