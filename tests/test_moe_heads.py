# SPDX-License-Identifier: Apache-2.0
"""DAR-MoE task heads (CPU): registered with their Auto classes, exact reductions of Qwen3-MoE's heads on
left-padded batches, and loadable with remote code without the package."""

import json
import os
import subprocess
import sys
import textwrap

import pytest
import torch
from transformers import (
    AutoModelForQuestionAnswering,
    AutoModelForSequenceClassification,
    AutoModelForTokenClassification,
    Qwen3MoeConfig,
    Qwen3MoeForCausalLM,
    Qwen3MoeForQuestionAnswering,
    Qwen3MoeForSequenceClassification,
    Qwen3MoeForTokenClassification,
)

import dar_transformers
from dar_transformers import (
    DARMoeConfig,
    DARMoeForQuestionAnswering,
    DARMoeForSequenceClassification,
    DARMoeForTokenClassification,
    DARMoeModel,
)
from dar_transformers.conversion import convert_to_dar_moe

from conftest import INIT, TINY_LLAMA_FIELDS, TINY_MOE, perturb_dar_parameters, random_input_ids, tiny_dar_moe


HEADS = {  # kind: (Auto class, DAR-MoE head, Qwen3-MoE head, the head's own parameters)
    "sequence_classification": (
        AutoModelForSequenceClassification, DARMoeForSequenceClassification, Qwen3MoeForSequenceClassification, "score"
    ),
    "question_answering": (
        AutoModelForQuestionAnswering, DARMoeForQuestionAnswering, Qwen3MoeForQuestionAnswering, "qa_outputs"
    ),
    "token_classification": (
        AutoModelForTokenClassification, DARMoeForTokenClassification, Qwen3MoeForTokenClassification, "score"
    ),
}


def head_outputs(output) -> torch.Tensor:
    """The head's logits: [B, labels], [B, T, labels], or start and end logits stacked [2, B, T]."""
    return torch.stack([output.start_logits, output.end_logits]) if hasattr(output, "start_logits") else output.logits


def head_labels(kind: str, input_ids: torch.LongTensor) -> dict:
    generator = torch.Generator().manual_seed(5)
    batch, length = input_ids.shape
    if kind == "sequence_classification":
        return {"labels": torch.randint(0, 3, (batch,), generator=generator)}
    if kind == "token_classification":
        return {"labels": torch.randint(0, 3, (batch, length), generator=generator)}
    positions = torch.randint(0, length, (2, batch), generator=generator)
    return {"start_positions": positions[0], "end_positions": positions[1]}


def left_padded_batch(length: int = 10) -> tuple[torch.LongTensor, torch.LongTensor, torch.LongTensor]:
    """input_ids (pad 0), attention_mask and position_ids counting from each row's first real token."""
    attention_mask = torch.ones(3, length, dtype=torch.long)
    attention_mask[1, :3] = 0
    attention_mask[2, :6] = 0
    input_ids = random_input_ids(batch=3, length=length).masked_fill(attention_mask == 0, 0)
    position_ids = (attention_mask.cumsum(-1) - 1).clamp(min=0)
    return input_ids, attention_mask, position_ids


@pytest.mark.parametrize("kind", list(HEADS))
def test_task_heads_are_registered_with_their_auto_classes(kind):
    auto_class, head_class, _, _ = HEADS[kind]
    config = DARMoeConfig(**TINY_MOE, num_labels=3)
    head = auto_class.from_config(config)
    assert type(head) is head_class and type(head.model) is DARMoeModel
    assert head.config._experts_implementation == "grouped_mm"  # the fast experts path, as in the causal LM
    assert getattr(dar_transformers, head_class.__name__) is head_class


@pytest.mark.parametrize("kind", list(HEADS))
def test_task_heads_reduce_exactly_to_qwen3_moes_heads_on_a_left_padded_batch(kind):
    """A Qwen3-MoE head's backbone converted to DAR-MoE (DAR at its upcycling init), the head's own weights copied:
    the DAR-MoE head gives the Qwen3-MoE head's outputs and loss, padding included."""
    _, head_class, qwen_class, head_name = HEADS[kind]
    torch.manual_seed(0)
    qwen_config = Qwen3MoeConfig(
        **TINY_LLAMA_FIELDS, **INIT, num_experts=4, num_experts_per_tok=2, moe_intermediate_size=24, head_dim=8,
        norm_topk_prob=True, num_labels=3,
    )
    source = qwen_class(qwen_config).eval()
    source_lm = Qwen3MoeForCausalLM(qwen_config)
    source_lm.model.load_state_dict(source.base_model.state_dict())  # Qwen3-MoE's QA head calls it `transformer`
    converted = convert_to_dar_moe(source_lm.eval())
    config = DARMoeConfig(**{**converted.config.to_dict(), "num_labels": 3})
    head = head_class(config).eval()
    head.model.load_state_dict(converted.model.state_dict())
    getattr(head, head_name).load_state_dict(getattr(source, head_name).state_dict())

    input_ids, attention_mask, position_ids = left_padded_batch()
    inputs = dict(input_ids=input_ids, attention_mask=attention_mask, position_ids=position_ids)
    labels = head_labels(kind, input_ids)
    with torch.no_grad():
        expected, got = source(**inputs, **labels), head(**inputs, **labels)
    assert head_outputs(expected).abs().max() > 0.1  # not a degenerate head
    assert torch.allclose(head_outputs(got), head_outputs(expected), atol=1e-5, rtol=0)
    assert torch.allclose(got.loss, expected.loss, atol=1e-5)


def test_sequence_classification_pools_each_rows_last_real_token_under_left_and_right_padding():
    """DAR parameters off their init: the pooled logits are the score of the backbone's last real token, and a padded
    row gets the logits of the same sequence alone."""
    torch.manual_seed(0)
    head = DARMoeForSequenceClassification(DARMoeConfig(**TINY_MOE, **INIT, num_labels=3)).eval()
    perturb_dar_parameters(head, scale=0.3, seed=1)
    input_ids, attention_mask, position_ids = left_padded_batch()
    with torch.no_grad():
        pooled = head(input_ids, attention_mask=attention_mask, position_ids=position_ids).logits  # [B, 3]
        hidden = head.model(input_ids, attention_mask=attention_mask, position_ids=position_ids).last_hidden_state
        # left padding: the last position is real (scored over all positions, as the head does: a product of
        # other rows may round differently on CPU BLAS, as oneDNN's does on AVX-512 machines)
        assert torch.equal(pooled, head.score(hidden)[:, -1])
        for row in range(3):
            alone = input_ids[row : row + 1, attention_mask[row].bool()]  # [1, T_row]
            alone_logits = head(alone).logits
            assert torch.allclose(pooled[row], alone_logits[0], atol=1e-5, rtol=0), row
            right_padded = torch.cat([alone, alone.new_zeros(1, 4)], dim=-1)
            right_mask = (right_padded != 0).long()
            right_logits = head(right_padded, attention_mask=right_mask).logits
            assert torch.allclose(right_logits, alone_logits, atol=1e-5, rtol=0), row
    assert pooled.abs().max() > 0.1


HEAD_REMOTE_CODE_SCRIPT = textwrap.dedent(
    """
    import importlib.util, os, sys
    sys.path[:] = [path for path in sys.path if not os.path.isdir(os.path.join(path or ".", "dar_transformers"))]
    assert importlib.util.find_spec("dar_transformers") is None, "dar_transformers must not be importable here"
    import torch
    import transformers
    input_ids = torch.load(sys.argv[1])
    for folder in sys.argv[2:]:
        auto_class = getattr(transformers, open(os.path.join(folder, "auto_class.txt")).read())
        model = auto_class.from_pretrained(folder, trust_remote_code=True).eval()
        assert type(model).__module__.startswith("transformers_modules"), type(model).__module__
        backbone = open(os.path.join(folder, "backbone.txt")).read()
        assert type(model.model).__name__ == backbone, type(model.model)
        with torch.no_grad():
            output = model(input_ids)
        logits = torch.stack([output.start_logits, output.end_logits]) if hasattr(output, "start_logits") else output.logits
        torch.save(logits, os.path.join(folder, "remote_logits.pt"))
        print(type(model).__name__, type(model).__module__)
    """
)


def load_heads_with_remote_code(tmp_path, folders: list[str]) -> dict[str, torch.Tensor]:
    """Run `HEAD_REMOTE_CODE_SCRIPT` in a fresh process without the package on the saved head folders (each with
    `auto_class.txt`, `backbone.txt`, and `tmp_path / "input_ids.pt"` beside them) -> folder -> its head outputs."""
    script = tmp_path / "load_remote_heads.py"
    script.write_text(HEAD_REMOTE_CODE_SCRIPT)
    environment = {
        "PATH": os.environ["PATH"], "HOME": str(tmp_path), "OMP_NUM_THREADS": str(torch.get_num_threads()),
        "HF_HUB_OFFLINE": "1", "HF_HOME": str(tmp_path / "hf_home"), "HF_MODULES_CACHE": str(tmp_path / "modules"),
    }
    result = subprocess.run(
        [sys.executable, str(script), str(tmp_path / "input_ids.pt"), *folders],
        cwd=tmp_path, env=environment, capture_output=True, text=True, timeout=300,
    )
    assert result.returncode == 0, result.stderr[-3000:]
    return {folder: torch.load(os.path.join(folder, "remote_logits.pt")) for folder in folders}


# The remote-code half is slow: test_remote_code.py loads every head class of DAR-MoE without the package in its one
# shared process; here it also loads head folders saved with their own head weights.
@pytest.mark.parametrize("with_remote_code", [False, pytest.param(True, marks=pytest.mark.slow)])
def test_task_heads_round_trip_and_load_with_remote_code_without_the_package(tmp_path, with_remote_code):
    input_ids = random_input_ids(length=10)
    torch.save(input_ids, tmp_path / "input_ids.pt")
    causal_lm = tiny_dar_moe(**INIT)
    perturb_dar_parameters(causal_lm, scale=0.3, seed=1)
    causal_lm.save_pretrained(tmp_path / "causal_lm")
    folders, expected = [], {}
    for kind, (auto_class, head_class, _, _) in HEADS.items():
        torch.manual_seed(0)
        head = head_class(DARMoeConfig(**TINY_MOE, **INIT, num_labels=3, shared_expert_intermediate_size=16)).eval()
        perturb_dar_parameters(head, scale=0.3, seed=1)
        folder = tmp_path / kind
        head.save_pretrained(folder)
        (folder / "auto_class.txt").write_text(auto_class.__name__)
        (folder / "backbone.txt").write_text("DARMoeModel")
        assert json.loads((folder / "config.json").read_text())["auto_map"][auto_class.__name__] == (
            f"modeling_dar_moe.{head_class.__name__}"
        )
        reloaded = auto_class.from_pretrained(folder).eval()
        assert type(reloaded) is head_class
        # All heads keep the backbone under `model` (base_model_prefix), so a causal-LM checkpoint starts a head.
        from_causal_lm = auto_class.from_pretrained(tmp_path / "causal_lm", num_labels=3)
        for name, tensor in causal_lm.model.state_dict().items():
            assert torch.equal(from_causal_lm.model.state_dict()[name], tensor), name
        with torch.no_grad():
            expected[kind] = head_outputs(head(input_ids))
            assert torch.equal(head_outputs(reloaded(input_ids)), expected[kind])
        folders.append(str(folder))

    if not with_remote_code:
        return
    remote_logits = load_heads_with_remote_code(tmp_path, folders)
    for kind in HEADS:
        assert torch.equal(remote_logits[str(tmp_path / kind)], expected[kind]), kind
