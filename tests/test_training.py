# SPDX-License-Identifier: Apache-2.0
"""Training with DAR on CPU: optimiser groups, gradient accumulation, gradient checkpointing, bf16 autocast, and
the fine-tuning example (examples/finetune.py) on real text.

Tiny models come from conftest (hidden 32, 2 layers, vocab 97). The real-text corpus for the example is built
here from the docstrings of the installed torch and transformers (real English prose present on every machine
that can run the tests); the full Debian corpus (scripts/prepare_corpus.py) is used by the documented SmolLM2 run.
"""

import importlib.util
import inspect
import json
import math
import sys
from pathlib import Path

import pytest
import torch
from conftest import perturb_dar_parameters, random_input_ids, tiny_llama, upcycled_dar
from datasets import Dataset
from transformers import Trainer, TrainingArguments, default_data_collator

from dar_transformers import DARForCausalLM
from dar_transformers.training import (
    DAR_MODULE_NAMES,
    create_dar_optimizer,
    dar_optimizer_cls_and_kwargs,
    dar_parameter_groups,
    dar_parameter_names,
    keep_dar_parameters_fp32,
)

REPOSITORY = Path(__file__).resolve().parents[1]
# Branch 0 reads only the embedding, identical in both streams: these get an identically zero gradient.
INERT_BRANCH_0_PARAMETERS = ("depth_attention.pseudo_query", "depth_attention.key_norm.weight", "read_gate.logit")


def load_example(name: str):
    """Import examples/<name>.py as a module (examples are scripts, not a package)."""
    spec = importlib.util.spec_from_file_location(f"example_{name}", REPOSITORY / "examples" / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module
    spec.loader.exec_module(module)
    return module


def write_docstring_corpus(directory: Path) -> Path:
    """A small real-text corpus in the layout of scripts/prepare_corpus.py ({split}.jsonl), from library docstrings.

    Every documented public class of torch.nn and transformers' trainer/modeling modules is one document; every
    fifth document (in sorted order) is held out. Returns `directory`.
    """
    import torch.nn
    import transformers.generation.utils
    import transformers.modeling_utils
    import transformers.trainer
    import transformers.training_args

    documents = {}
    for module in (torch.nn, torch.optim, transformers.trainer, transformers.training_args, transformers.modeling_utils,
                   transformers.generation.utils):
        for name, value in sorted(vars(module).items()):
            text = inspect.getdoc(value) if inspect.isclass(value) or inspect.isfunction(value) else None
            if text and len(text) > 400 and not name.startswith("_"):
                documents[f"{module.__name__}.{name}"] = text
    directory.mkdir(parents=True, exist_ok=True)
    splits = {"train": [], "validation": []}
    for index, (path, text) in enumerate(sorted(documents.items())):
        splits["validation" if index % 5 == 4 else "train"].append({"package": "docstrings", "path": path, "text": text})
    for split, records in splits.items():
        (directory / f"{split}.jsonl").write_text("".join(json.dumps(record) + "\n" for record in records))
    return directory


def dar_modules_parameter_names(model: torch.nn.Module) -> set[str]:
    """DAR parameters found structurally: everything below a module registered under a DAR module name."""
    names = set()
    for module_name, module in model.named_modules():
        if module_name.split(".")[-1] in DAR_MODULE_NAMES:
            names |= {f"{module_name}.{name}" for name, _ in module.named_parameters()}
    return names


def training_arguments(tmp_path: Path, **overrides) -> TrainingArguments:
    defaults = dict(output_dir=str(tmp_path / "trainer"), report_to="none", use_cpu=True, save_strategy="no",
                    logging_strategy="no", disable_tqdm=True, seed=0, max_grad_norm=0.0, warmup_steps=0,
                    lr_scheduler_type="constant", dataloader_num_workers=0)
    return TrainingArguments(**{**defaults, **overrides})


def labelled_dataset(num_examples: int = 8, length: int = 12, seed: int = 0) -> Dataset:
    """Token ids with a different number of ignored (-100) label positions in every example."""
    ids = random_input_ids(batch=num_examples, length=length, seed=seed)
    labels = ids.clone()
    for row in range(num_examples):
        labels[row, : 1 + (row * row) % (length - 2)] = -100  # 1 .. length - 2 ignored positions, uneven
    return Dataset.from_dict({"input_ids": ids.tolist(), "labels": labels.tolist()})


# ---------------------------------------------------------------------------------------------------------------
# Optimiser groups


def test_parameter_groups_partition_parameters_and_isolate_dar():
    model = upcycled_dar(tiny_llama(), dar_block_size=2)
    groups = {group["name"]: group for group in dar_parameter_groups(model, 1e-3, 0.1, dar_learning_rate=1e-2)}
    names_of = {id(parameter): name for name, parameter in model.named_parameters()}
    grouped = {name: [names_of[id(parameter)] for parameter in group["params"]] for name, group in groups.items()}

    all_names = [name for name, _ in model.named_parameters()]
    assert sorted(sum(grouped.values(), [])) == sorted(all_names)  # every parameter exactly once
    assert set(grouped["dar"]) == dar_modules_parameter_names(model) == set(dar_parameter_names(model))
    # 4 branches x (query, key norm, read gate, write gate) + rho where a block continues (branches 1, 3) + readout 3
    assert len(grouped["dar"]) == 4 * 4 + 2 + 3
    assert (groups["dar"]["weight_decay"], groups["dar"]["lr"]) == (0.0, 1e-2)
    assert (groups["decay"]["weight_decay"], groups["decay"]["lr"]) == (0.1, 1e-3)
    assert "model.layers.0.self_attn.q_proj.weight" in grouped["decay"]
    assert "model.layers.1.input_layernorm.weight" in grouped["no_decay"] and "model.norm.weight" in grouped["no_decay"]


def test_no_weight_decay_on_dar_parameters_numerically():
    """With zero gradients an AdamW step is pure decoupled decay: p <- p (1 - lr wd) in the decay group only."""
    model = upcycled_dar(tiny_llama(), dar_block_size=2)
    perturb_dar_parameters(model)
    args = TrainingArguments(output_dir="unused", learning_rate=0.1, weight_decay=0.5, report_to="none")
    optimizer, scheduler = create_dar_optimizer(model, args, dar_learning_rate=0.3)
    assert scheduler is None
    before = {name: parameter.detach().clone() for name, parameter in model.named_parameters()}
    for parameter in model.parameters():
        parameter.grad = torch.zeros_like(parameter)
    optimizer.step()
    decayed = {name for group in optimizer.param_groups if group["name"] == "decay"
               for name, parameter in model.named_parameters() if any(parameter is p for p in group["params"])}
    for name, parameter in model.named_parameters():
        expected = before[name] * (1 - 0.1 * 0.5) if name in decayed else before[name]
        torch.testing.assert_close(parameter.detach(), expected, rtol=1e-6, atol=0, msg=name)
    assert dar_parameter_names(model) and not decayed & set(dar_parameter_names(model))
    # The DAR group is the only one with its own learning rate.
    assert {group["name"]: group["lr"] for group in optimizer.param_groups} == {"decay": 0.1, "no_decay": 0.1, "dar": 0.3}


def test_trainer_builds_dar_groups_through_optimizer_factory(tmp_path):
    model = upcycled_dar(tiny_llama(), dar_block_size=2)
    perturb_dar_parameters(model)  # at the upcycling init the key norms get no gradient (zero queries)
    args = training_arguments(tmp_path, learning_rate=2e-3, weight_decay=0.01, max_steps=2, warmup_steps=4,
                              lr_scheduler_type="constant_with_warmup", per_device_train_batch_size=4)
    trainer = Trainer(model=model, args=args, train_dataset=labelled_dataset(), data_collator=default_data_collator,
                      optimizer_cls_and_kwargs=dar_optimizer_cls_and_kwargs(args, dar_learning_rate=2e-2))
    dar_before = {name: p.detach().clone() for name, p in model.named_parameters() if name in dar_parameter_names(model)}
    trainer.train()
    groups = {group["name"]: group for group in trainer.optimizer.param_groups}
    assert groups["dar"]["weight_decay"] == 0.0 and groups["decay"]["weight_decay"] == 0.01
    # The warm-up schedule scales every group's own initial learning rate by the same factor (2/4 after 2 steps).
    assert groups["dar"]["initial_lr"] == 2e-2 and groups["decay"]["initial_lr"] == 2e-3
    assert (groups["dar"]["lr"], groups["decay"]["lr"]) == pytest.approx((1e-2, 1e-3))
    changed = [name for name, value in dar_before.items() if not torch.equal(value, model.get_parameter(name))]
    assert len(changed) == len(dar_before) - 3  # all but branch 0's inert read (see the next test)


@pytest.mark.parametrize("helper", ["optimizers", "optimizer_cls_and_kwargs"])
def test_trainer_resumed_from_a_checkpoint_ends_where_an_uninterrupted_run_ends(tmp_path, helper):
    """`trainer.train(resume_from_checkpoint=...)` over DAR's optimiser groups: Trainer reloads the optimiser state
    by group and position, so the resumed run's groups must be rebuilt in the saved order and membership; then 3 + 3
    steps end bit for bit where 6 straight steps end (weight decay, a warm-up schedule, clipping: every piece of
    saved state used). Negative control: the same resume with the optimiser state deleted (fresh AdamW moments, what
    a reordered group would amount to) ends elsewhere."""
    args = dict(learning_rate=1e-2, weight_decay=0.1, max_steps=6, warmup_steps=2, lr_scheduler_type="linear",
                max_grad_norm=0.5, per_device_train_batch_size=2, save_strategy="steps", save_steps=3)

    def run(name, resume_from=None):
        model = upcycled_dar(tiny_llama(), dar_block_size=2)
        perturb_dar_parameters(model)
        training = training_arguments(tmp_path / name, **args)
        optimizer = ({"optimizers": create_dar_optimizer(model, training, dar_learning_rate=3e-3)}
                     if helper == "optimizers" else
                     {"optimizer_cls_and_kwargs": dar_optimizer_cls_and_kwargs(training, dar_learning_rate=3e-3)})
        trainer = Trainer(model=model, args=training, train_dataset=labelled_dataset(),
                          data_collator=default_data_collator, **optimizer)
        trainer.train(resume_from_checkpoint=resume_from)
        assert [group["name"] for group in trainer.optimizer.param_groups] == ["decay", "no_decay", "dar"]
        return {name: parameter.detach().clone() for name, parameter in model.named_parameters()}

    straight = run("straight")
    checkpoint = tmp_path / "straight" / "trainer" / "checkpoint-3"
    resumed = run("resumed", resume_from=str(checkpoint))
    assert all(torch.equal(straight[name], resumed[name]) for name in straight)

    (checkpoint / "optimizer.pt").unlink()
    fresh_moments = run("fresh moments", resume_from=str(checkpoint))
    assert max((straight[name] - fresh_moments[name]).abs().max().item() for name in straight) > 1e-4


@pytest.mark.parametrize("optim,optim_args,expected", [
    ("sgd", "momentum=0.9", (torch.optim.SGD, {"momentum": 0.9})),
    ("adamw_torch", None, (torch.optim.AdamW, {"betas": (0.8, 0.9), "fused": None})),
    ("adamw_torch_fused", None, (torch.optim.AdamW, {"betas": (0.8, 0.9), "fused": True})),
])
def test_both_optimiser_helpers_build_the_optimiser_args_name(tmp_path, optim, optim_args, expected):
    """`args.optim` and `args.optim_args` choose the optimiser, as in a plain `Trainer` (the helpers built AdamW
    whatever they said, an SGD or Adafactor run silently another optimiser), over DAR's groups."""
    model = upcycled_dar(tiny_llama(), dar_block_size=2)
    args = training_arguments(tmp_path, learning_rate=1e-3, weight_decay=0.1, optim=optim, optim_args=optim_args,
                              adam_beta1=0.8, adam_beta2=0.9)
    trainer = Trainer(model=model, args=args, train_dataset=labelled_dataset(), data_collator=default_data_collator,
                      optimizer_cls_and_kwargs=dar_optimizer_cls_and_kwargs(args))
    optimizers = [create_dar_optimizer(model, args)[0], trainer.create_optimizer()]
    optimizer_class, settings = expected
    for optimizer in optimizers:
        assert type(optimizer) is optimizer_class
        group = {group["name"]: group for group in optimizer.param_groups}
        assert group["dar"]["weight_decay"] == 0.0 and group["decay"]["weight_decay"] == 0.1
        assert all(group["dar"][key] == value for key, value in settings.items()), group["dar"]


def test_an_optimiser_that_builds_its_own_groups_is_refused_naming_it(tmp_path, monkeypatch):
    """GaLore, APOLLO, LOMO and the layer-wise optimisers take the model or their own groups from `Trainer`
    (`params`, `model`, `optimizer_dict` among its keyword arguments; their packages are not installed here, so
    `Trainer`'s answer for GaLore is given): DAR's groups cannot go to them, which is said, naming `optim`."""
    monkeypatch.setattr(Trainer, "get_optimizer_cls_and_kwargs", staticmethod(
        lambda args, model=None: (torch.optim.AdamW, {"lr": args.learning_rate, "params": [{"params": []}]})))
    args = training_arguments(tmp_path, optim="galore_adamw", optim_target_modules=["mlp"])
    model = upcycled_dar(tiny_llama(), dar_block_size=2)
    for build in (lambda: create_dar_optimizer(model, args), lambda: dar_optimizer_cls_and_kwargs(args)):
        with pytest.raises(ValueError, match=r"optim='galore_adamw' builds its own parameter groups \(params\)"):
            build()


def test_dar_parameters_must_stay_fp32():
    model = upcycled_dar(tiny_llama(), dar_block_size=2).to(torch.bfloat16)
    with pytest.raises(ValueError, match="must stay float32"):
        dar_parameter_groups(model, 1e-3, 0.0)
    assert keep_dar_parameters_fp32(model) == len(dar_parameter_names(model))
    assert keep_dar_parameters_fp32(model) == 0
    dtypes = {name: parameter.dtype for name, parameter in model.named_parameters()}
    assert all((dtypes[name] == torch.float32) == (name in dar_parameter_names(model)) for name in dtypes)
    assert len(dar_parameter_groups(model, 1e-3, 0.0)) == 3
    with torch.no_grad():  # the mixed-precision model still runs: DAR mixing is float32 by design
        assert torch.isfinite(model(random_input_ids()).logits).all()


def test_a_float64_model_keeps_float64_dar_parameters_in_its_optimiser_groups():
    """A float64 model's DAR parameters are float64 (the package's policy: its compute dtype); the groups refused
    them, and keep_dar_parameters_fp32, which the refusal named, rounded them to float32 (a 1e-12 update lost)."""
    model = upcycled_dar(tiny_llama(), dar_block_size=2).to(torch.float64)
    assert keep_dar_parameters_fp32(model) == 0
    groups = dar_parameter_groups(model, 1e-3, 0.0)
    (dar_group,) = [group for group in groups if group["name"] == "dar"]
    assert {parameter.dtype for parameter in dar_group["params"]} == {torch.float64}


def test_bad_optimizer_settings_raise():
    model = upcycled_dar(tiny_llama())
    with pytest.raises(ValueError, match="learning rates must be positive"):
        dar_parameter_groups(model, 1e-3, 0.0, dar_learning_rate=-1.0)
    with pytest.raises(ValueError, match="weight_decay"):
        dar_parameter_groups(model, 1e-3, -0.1)
    model.requires_grad_(False)
    with pytest.raises(ValueError, match="no trainable parameters"):
        dar_parameter_groups(model, 1e-3, 0.0)


# ---------------------------------------------------------------------------------------------------------------
# Gradients: every parameter gets one (DDP without unused-parameter search), accumulation, checkpointing


def _gradients(model, input_ids, labels, **forward_kwargs) -> dict[str, torch.Tensor]:
    model.zero_grad()
    model(input_ids=input_ids, labels=labels, **forward_kwargs).loss.backward()
    return {name: parameter.grad.detach().clone() for name, parameter in model.named_parameters()}


@pytest.mark.parametrize("kernel", ["torch", "cpp"])
@pytest.mark.parametrize("block_size", [1, 2, 4])
def test_every_parameter_receives_a_gradient(block_size, kernel):
    """DDP with find_unused_parameters=False needs every parameter in the graph. Exactly three get a gradient that
    is identically zero: branch 0 reads a single source (the embedding), so its depth softmax is constant (query and
    key norm), and both streams' extractions are that same embedding, so its read gate alpha mixes equal values.
    The C++ training kernels too (their rounding left about 1e-12 on the query and key norm, which AdamW moves on)."""
    model = upcycled_dar(tiny_llama(), dar_block_size=block_size, dar_training_kernel=kernel).train()
    perturb_dar_parameters(model)
    input_ids = random_input_ids()
    model.zero_grad()
    model(input_ids=input_ids, labels=input_ids).loss.backward()
    missing = [name for name, parameter in model.named_parameters() if parameter.grad is None]
    assert missing == []
    zero = {name for name, parameter in model.named_parameters() if not parameter.grad.abs().max() > 0}
    assert zero == {f"model.layers.0.attn_residual.{name}" for name in INERT_BRANCH_0_PARAMETERS}


def test_num_items_in_batch_makes_accumulated_gradients_equal_the_full_batch():
    """The model path Trainer uses: micro-batch losses summed over the global token count add up exactly."""
    model = upcycled_dar(tiny_llama(), dar_block_size=2).double().train()
    perturb_dar_parameters(model)
    data = labelled_dataset()
    input_ids, labels = torch.tensor(data["input_ids"]), torch.tensor(data["labels"])
    full = _gradients(model, input_ids, labels)

    num_items = (labels[:, 1:] != -100).sum()
    model.zero_grad()
    for half in (slice(0, 4), slice(4, 8)):
        model(input_ids=input_ids[half], labels=labels[half], num_items_in_batch=num_items).loss.backward()
    for name, parameter in model.named_parameters():
        torch.testing.assert_close(parameter.grad, full[name], rtol=1e-10, atol=1e-12, msg=name)

    # Negative control: averaging per-micro-batch means (no num_items_in_batch) is measurably different,
    # because the micro-batches hold different numbers of labelled tokens.
    model.zero_grad()
    for half in (slice(0, 4), slice(4, 8)):
        (model(input_ids=input_ids[half], labels=labels[half]).loss / 2).backward()
    difference = max((parameter.grad - full[name]).abs().max().item() for name, parameter in model.named_parameters())
    assert difference > 1e-4


def test_trainer_label_smoothing_scores_the_next_token_as_for_llama(tmp_path):
    """`label_smoothing_factor` makes Trainer compute the loss itself, shifting the labels only for a class name in
    transformers' causal-LM table; DAR's was not there, so DAR (and DAR-MoE, and DAR under PEFT) was trained to
    predict the token it reads, with a loss 0.017 above its source Llama's at conversion. Exact upcycling means the
    same smoothed loss as the source, which the label smoother computes with the shift by hand here."""
    from peft import LoraConfig, get_peft_model
    from transformers.trainer_pt_utils import LabelSmoother

    from dar_transformers.conversion import convert, convert_to_dar_moe

    llama = tiny_llama().train()
    batch = {key: torch.tensor(values) for key, values in labelled_dataset()[:4].items()}
    args = training_arguments(tmp_path, label_smoothing_factor=0.1)

    def smoothed(model) -> float:
        return Trainer(model=model, args=args).compute_loss(model, dict(batch)).item()

    with torch.no_grad():  # the smoothed loss of the next token, from Llama's logits
        shifted = LabelSmoother(0.1)({"logits": llama(batch["input_ids"]).logits}, batch["labels"], shift_labels=True)
        unshifted = LabelSmoother(0.1)({"logits": llama(batch["input_ids"]).logits}, batch["labels"])
    assert abs(shifted.item() - unshifted.item()) > 1e-3  # the control: the shift shows in the loss
    assert smoothed(llama) == pytest.approx(shifted.item(), abs=1e-6)
    dar = convert(llama, dar_block_size=2, verify=False, progress=False).train()
    moe = convert_to_dar_moe(llama, num_experts=2, top_k=1, dar_block_size=2).train()
    lora = get_peft_model(convert(llama, dar_block_size=2, verify=False, progress=False).train(),
                          LoraConfig(r=2, target_modules=["q_proj"]))
    for model in (dar, moe, lora):
        assert smoothed(model) == pytest.approx(shifted.item(), abs=1e-5), type(model).__name__


def test_trainer_model_card_names_the_task_of_every_dar_head_as_of_llamas(tmp_path):
    """Trainer's model card (`create_model_card`, `push_to_hub`) names a task, and lists the evaluation results
    under it, only for a class in transformers' task tables: DAR's classification and question-answering heads had
    no task and empty results where Llama's heads have theirs."""
    from transformers import (
        AutoModelForQuestionAnswering,
        AutoModelForSequenceClassification,
        AutoModelForTokenClassification,
        LlamaConfig,
    )
    from transformers.modelcard import TrainingSummary

    from dar_transformers import DARMoeConfig
    from conftest import TINY_LLAMA_FIELDS, tiny_dar_config

    def card_of(model):
        summary = TrainingSummary.from_trainer(Trainer(model=model, args=training_arguments(tmp_path)),
                                               dataset="imdb", dataset_tags="imdb")
        summary.eval_results = {"Accuracy": 0.5}
        return summary.tasks, summary.create_metadata().get("model-index")

    configs = {"llama": LlamaConfig(**TINY_LLAMA_FIELDS), "dar": tiny_dar_config(),
               "dar_moe": DARMoeConfig(**TINY_LLAMA_FIELDS, num_experts=2, num_experts_per_tok=1)}
    for auto_class in (AutoModelForSequenceClassification, AutoModelForTokenClassification,
                       AutoModelForQuestionAnswering):
        cards = {kind: card_of(auto_class.from_config(config)) for kind, config in configs.items()}
        assert cards["llama"][0] is not None and cards["llama"][1][0]["results"][0]["metrics"], auto_class.__name__
        assert cards["dar"] == cards["llama"] and cards["dar_moe"] == cards["llama"], auto_class.__name__
    llama_lm, dar_lm = tiny_llama(), upcycled_dar(tiny_llama())
    assert card_of(dar_lm) == card_of(llama_lm) and card_of(llama_lm)[0] == "text-generation"


def _one_sgd_step_parameter_change(tmp_path, batch_size, accumulation, **argument_overrides):
    model = upcycled_dar(tiny_llama(), dar_block_size=2).train()
    perturb_dar_parameters(model)
    before = {name: parameter.detach().clone() for name, parameter in model.named_parameters()}
    args = training_arguments(tmp_path, per_device_train_batch_size=batch_size,
                              gradient_accumulation_steps=accumulation, max_steps=1, learning_rate=1.0,
                              train_sampling_strategy="sequential", **argument_overrides)
    trainer = Trainer(model=model, args=args, train_dataset=labelled_dataset(), data_collator=default_data_collator,
                      optimizers=(torch.optim.SGD(model.parameters(), lr=1.0), None))
    trainer.train()
    return {name: before[name] - parameter.detach() for name, parameter in model.named_parameters()}  # = gradient


def test_trainer_gradient_accumulation_equals_larger_batch(tmp_path):
    """One SGD step (lr 1) moves every parameter by its gradient: 4 micro-batches of 2 vs one batch of 8."""
    accumulated = _one_sgd_step_parameter_change(tmp_path, batch_size=2, accumulation=4)
    full = _one_sgd_step_parameter_change(tmp_path, batch_size=8, accumulation=1)
    assert max(step.abs().max().item() for step in full.values()) > 1e-3
    for name in full:
        torch.testing.assert_close(accumulated[name], full[name], rtol=1e-4, atol=1e-6, msg=name)


@pytest.mark.parametrize("use_reentrant", [False, True])
def test_gradient_checkpointing_gives_the_same_gradients(use_reentrant):
    model = upcycled_dar(tiny_llama(), dar_block_size=2).double().train()
    perturb_dar_parameters(model)
    input_ids = random_input_ids()
    plain = _gradients(model, input_ids, input_ids)
    model.activation_checkpointing_enable(activation_checkpointing_kwargs={"use_reentrant": use_reentrant})
    assert model.is_activation_checkpointing
    if use_reentrant:  # reentrant checkpointing needs an input that requires grad (what Trainer and PEFT do)
        model.enable_input_require_grads()
    checkpointed = _gradients(model, input_ids, input_ids, use_cache=False)
    for name in plain:
        torch.testing.assert_close(checkpointed[name], plain[name], rtol=1e-10, atol=1e-12, msg=name)


@pytest.mark.skipif(
    "every_n_layers" not in inspect.signature(getattr(DARForCausalLM, "activation_checkpointing_enable", len)).parameters,
    reason="every_n_layers is new in transformers 5.25")
@pytest.mark.parametrize("implementation", ["fast", "two_phase"])
@pytest.mark.parametrize("every_n_layers", [2, 3])
def test_checkpointing_every_nth_layer_gives_the_same_gradients(implementation, every_n_layers):
    """transformers 5.25's `activation_checkpointing_enable(every_n_layers=n)` checkpoints layers 0, n, 2n, ...: DAR's
    blocks (2 layers here, 4 branches) then mix checkpointed and plain layers, whose recomputed reads, partials and
    deferred entry gradients must meet the plain ones exactly."""
    model = upcycled_dar(tiny_llama(num_hidden_layers=5), dar_block_size=2, dar_implementation=implementation)
    model = model.double().train()
    perturb_dar_parameters(model)
    input_ids = random_input_ids()
    plain = _gradients(model, input_ids, input_ids)
    model.activation_checkpointing_enable(every_n_layers=every_n_layers)
    assert [layer.gradient_checkpointing for layer in model.model.layers] == [i % every_n_layers == 0 for i in range(5)]
    checkpointed = _gradients(model, input_ids, input_ids, use_cache=False)
    for name in plain:
        torch.testing.assert_close(checkpointed[name], plain[name], rtol=1e-10, atol=1e-12, msg=name)


@pytest.mark.parametrize("use_reentrant", [False, True])
def test_a_loss_on_recorded_outputs_under_checkpointing_is_exact_or_warned(use_reentrant, caplog):
    """Hidden states and depth weights are recorded inside the decoder layers: under reentrant checkpointing they
    carry no gradient, so a loss on them (a depth-entropy regulariser) was silently dropped from the gradients, up to
    2.9 relative off (a helper's repro). Non-reentrant checkpointing is exact; reentrant now says so once."""
    from transformers.utils import logging as hf_logging

    model = upcycled_dar(tiny_llama(), dar_block_size=2).double().train()
    perturb_dar_parameters(model)
    input_ids = random_input_ids()

    def gradients() -> dict[str, torch.Tensor]:
        model.zero_grad()
        output = model(input_ids=input_ids, labels=input_ids, use_cache=False, output_hidden_states=True,
                       output_depth_weights=True)
        entropy = sum(-(weights * weights.clamp_min(1e-12).log()).sum(0).mean() for weights in output.depth_weights)
        (output.loss + output.hidden_states[2].square().mean() + entropy).backward()
        return {name: parameter.grad.clone() for name, parameter in model.named_parameters()}

    plain = gradients()
    model.activation_checkpointing_enable(activation_checkpointing_kwargs={"use_reentrant": use_reentrant})
    model.enable_input_require_grads()
    hf_logging.get_logger("dar_transformers.modeling_dar").warning_once.cache_clear()
    with caplog.at_level("WARNING", logger="dar_transformers.modeling_dar"):
        checkpointed = gradients()
    warned = "reentrant activation checkpointing (use_reentrant=True) runs without gradients" in caplog.text
    assert warned == use_reentrant
    differs = max(((checkpointed[name] - plain[name]).abs().max() / plain[name].abs().max().clamp_min(1e-30)).item()
                  for name in plain)
    if use_reentrant:
        assert differs > 0.1  # what the warning is for
    else:
        assert differs < 1e-10
    model.eval()  # evaluation (no gradients needed) is not warned about
    caplog.clear()
    with torch.no_grad():
        model(input_ids=input_ids, output_hidden_states=True)
    assert "reentrant" not in caplog.text


@pytest.mark.parametrize("use_reentrant", [False, True])
def test_a_kv_cache_passed_under_gradient_checkpointing_is_dropped_as_llamas_is(use_reentrant):
    """A checkpointed layer's backward replays its forward, so transformers drops a KV cache handed to a checkpointing
    layer (`GradientCheckpointingLayer`, under the name Llama's layer takes it: `cache` from 5.24). DAR's layers took it
    as `past_key_values`, so every layer wrote it in forward and again in backward (10 tokens -> 20), and a training
    step on a second chunk failed in SDPA (a helper's repro). Now DAR does what its Llama does, loss for loss."""
    from transformers import DynamicCache

    llama = tiny_llama()
    dar = upcycled_dar(llama, dar_block_size=3)
    input_ids = random_input_ids(batch=2, length=10)
    seen = {}
    for name, model in (("llama", llama), ("dar", dar)):
        model.train()
        model.activation_checkpointing_enable(activation_checkpointing_kwargs={"use_reentrant": use_reentrant})
        model.enable_input_require_grads()
        cache = DynamicCache(config=model.config)
        output = model(input_ids, past_key_values=cache, use_cache=True, labels=input_ids)
        after_forward = cache.get_seq_length()
        output.loss.backward()
        cache = DynamicCache(config=model.config)  # a prefix, then a training step on the continuation
        model(input_ids[:, :4], past_key_values=cache, use_cache=True)
        second = model(input_ids[:, 4:], past_key_values=cache, use_cache=True, labels=input_ids[:, 4:]).loss
        second.backward()
        seen[name] = (after_forward, cache.get_seq_length(), output.loss.item(), second.item())
    assert seen["dar"][:2] == seen["llama"][:2] == (0, 0)
    assert seen["dar"][2:] == pytest.approx(seen["llama"][2:], rel=1e-5)


def test_trainer_with_gradient_checkpointing_matches_plain_step(tmp_path):
    plain = _one_sgd_step_parameter_change(tmp_path, batch_size=4, accumulation=1)
    checkpointed = _one_sgd_step_parameter_change(tmp_path, batch_size=4, accumulation=1, activation_checkpointing=True)
    for name in plain:
        torch.testing.assert_close(checkpointed[name], plain[name], rtol=1e-4, atol=1e-6, msg=name)


def test_bf16_autocast_forward_backward_keeps_dar_fp32():
    model = upcycled_dar(tiny_llama(), dar_block_size=2).train()
    perturb_dar_parameters(model, scale=0.2)
    input_ids = random_input_ids(batch=4, length=16)
    reference_loss = model(input_ids=input_ids, labels=input_ids).loss.item()
    model.zero_grad()
    with torch.autocast("cpu", dtype=torch.bfloat16):
        output = model(input_ids=input_ids, labels=input_ids)
    output.loss.backward()
    assert output.logits.dtype == torch.bfloat16 and output.loss.dtype == torch.float32
    assert abs(output.loss.item() - reference_loss) < 0.02 * reference_loss  # bf16 matmuls, fp32 loss
    for name in dar_parameter_names(model):
        parameter = model.get_parameter(name)
        assert parameter.dtype == torch.float32 and parameter.grad.dtype == torch.float32
        assert torch.isfinite(parameter.grad).all()


def test_trainer_bf16_training_lowers_loss(tmp_path):
    model = upcycled_dar(tiny_llama(), dar_block_size=2)
    dataset = labelled_dataset(num_examples=4)
    args = training_arguments(tmp_path, bf16=True, max_steps=12, learning_rate=1e-2, per_device_train_batch_size=4,
                              logging_strategy="steps", logging_steps=1)
    trainer = Trainer(model=model, args=args, train_dataset=dataset, data_collator=default_data_collator,
                      optimizers=create_dar_optimizer(model, args))
    trainer.train()
    losses = [entry["loss"] for entry in trainer.state.log_history if "loss" in entry]
    assert trainer.accelerator.mixed_precision == "bf16"
    assert len(losses) == 12 and all(math.isfinite(loss) for loss in losses)
    assert losses[-1] < 0.8 * losses[0]
    assert all(model.get_parameter(name).dtype == torch.float32 for name in dar_parameter_names(model))


# ---------------------------------------------------------------------------------------------------------------
# The example


@pytest.fixture(scope="session")
def docstring_corpus(tmp_path_factory) -> Path:
    return write_docstring_corpus(tmp_path_factory.mktemp("corpus"))


def test_finetune_example_tiny_lowers_heldout_perplexity(tmp_path, docstring_corpus, monkeypatch):
    monkeypatch.setenv("HF_DATASETS_CACHE", str(tmp_path / "datasets"))
    finetune = load_example("finetune")
    trainer, results = finetune.main([
        "--tiny", "--corpus-dir", str(docstring_corpus), "--output-dir", str(tmp_path / "run"), "--max-steps", "40",
        "--sequence-length", "64", "--batch-size", "4", "--learning-rate", "3e-3", "--dar-learning-rate", "1e-2",
        "--train-documents", "200", "--eval-documents", "40", "--eval-blocks", "16", "--logging-steps", "10", "--save",
    ])
    assert results["steps"] == 40 and results["eval_blocks"] == 16
    assert results["perplexity_after"] < 0.6 * results["perplexity_before"]
    assert json.loads((tmp_path / "run" / "results.json").read_text()) == results
    # Step 0 was the upcycled random Llama: the DAR parameters moved from their init and stayed float32.
    model = trainer.model
    fresh = DARForCausalLM(model.config)
    unmoved = {name for name in dar_parameter_names(model)
               if torch.equal(model.get_parameter(name), fresh.get_parameter(name))}
    assert unmoved == {f"model.layers.0.attn_residual.{name}" for name in INERT_BRANCH_0_PARAMETERS}
    saved = DARForCausalLM.from_pretrained(tmp_path / "run" / "final")
    for name, parameter in model.named_parameters():
        assert torch.equal(saved.get_parameter(name), parameter), name
    assert (tmp_path / "run" / "final" / "tokenizer.json").is_file()


def test_finetune_example_llama_baseline_starts_where_the_upcycle_starts(tmp_path, docstring_corpus, monkeypatch):
    """The upcycling comparison of docs/results.md: `--no-upcycle` trains the source Llama on the same batches.

    Step 0 must score the same held-out loss (the upcycle is exact), then both train and evaluate on the same
    schedule; the curves must differ after training (the DAR parameters are live, the comparison is not void).
    """
    monkeypatch.setenv("HF_DATASETS_CACHE", str(tmp_path / "datasets"))
    finetune = load_example("finetune")
    common = ["--tiny", "--corpus-dir", str(docstring_corpus), "--max-steps", "20", "--eval-steps", "10",
              "--sequence-length", "64", "--batch-size", "4", "--learning-rate", "3e-3", "--train-documents", "200",
              "--eval-documents", "40", "--eval-blocks", "16", "--logging-steps", "10"]
    _, dar = finetune.main([*common, "--output-dir", str(tmp_path / "dar"), "--dar-learning-rate", "1e-2"])
    _, llama = finetune.main([*common, "--output-dir", str(tmp_path / "llama"), "--no-upcycle"])
    assert (dar["architecture"], llama["architecture"]) == ("dar", "llama")
    assert [step for step, _ in dar["eval_curve"]] == [step for step, _ in llama["eval_curve"]] == [0, 10, 20]
    assert dar["train_tokens"] == llama["train_tokens"] == 20 * 4 * 64
    assert dar["eval_curve"][0][1] == pytest.approx(llama["eval_curve"][0][1], abs=1e-5)
    assert abs(dar["eval_curve"][-1][1] - llama["eval_curve"][-1][1]) > 1e-3
    assert llama["eval_curve"][-1][1] < llama["eval_curve"][0][1]
    with pytest.raises(SystemExit):
        finetune.main([*common, "--output-dir", str(tmp_path / "bad"), "--no-upcycle", "--dar-block-size", "2"])
    with pytest.raises(SystemExit):
        finetune.main([*common, "--output-dir", str(tmp_path / "bad"), "--eval-steps", "7"])


def test_finetune_example_with_lora_saves_a_model_that_loads_on_its_own(tmp_path, docstring_corpus, monkeypatch):
    """`--lora --save` saved the adapter alone, whose base (this run's upcycled DAR model) no folder held: it
    named its base "None". It saves the merged model now, a plain DAR folder, which computes what the trained
    adapter does; a copy is merged, so that the trainer's model keeps its adapter (a later `--push-to-hub` pushed
    an emptied one)."""
    from transformers import AutoModelForCausalLM

    monkeypatch.setenv("HF_DATASETS_CACHE", str(tmp_path / "datasets"))
    finetune = load_example("finetune")
    trainer, _ = finetune.main([
        "--tiny", "--corpus-dir", str(docstring_corpus), "--max-steps", "4", "--eval-steps", "4", "--sequence-length",
        "32", "--batch-size", "2", "--train-documents", "40", "--eval-documents", "10", "--eval-blocks", "4",
        "--logging-steps", "4", "--lora", "--lora-train-dar", "--save", "--output-dir", str(tmp_path / "run"),
    ])
    final = tmp_path / "run" / "final"
    assert not (final / "adapter_config.json").exists() and (final / "tokenizer_config.json").is_file()
    loaded = AutoModelForCausalLM.from_pretrained(final).eval()
    adapted = trainer.model.eval()  # the trained adapter, not merged
    assert any("lora_" in name for name in adapted.state_dict())
    ids = torch.arange(3, 20).unsqueeze(0)
    with torch.no_grad():
        torch.testing.assert_close(loaded(ids).logits, adapted(ids).logits, rtol=1e-5, atol=1e-5)
        with adapted.disable_adapter():  # the comparison is not void: the adapter changed the model
            assert (loaded(ids).logits - adapted(ids).logits).abs().max() > 1e-4


def test_finetune_example_rejects_a_missing_corpus(tmp_path):
    finetune = load_example("finetune")
    with pytest.raises(SystemExit):
        finetune.main(["--tiny", "--corpus-dir", str(tmp_path / "nothing")])



@pytest.mark.parametrize("options", [{}, {"dar_implementation": "two_phase"}, {"dar_training_kernel": "cpp"}])
def test_torch_func_grad_and_per_sample_gradients_give_backwards_gradients(options):
    """`torch.func.grad` (and `vmap(grad(...))`, per-sample gradients for differential privacy) failed on every
    optimised backend: their custom autograd functions define no `setup_context`, the two-phase read's saved-tensor
    hooks are refused under `grad`. Under a torch.func transform a forward takes the reference backend; the
    gradients are those `loss.backward()` gives with the configured backend (float64)."""
    from torch.func import functional_call, grad, vmap

    model = upcycled_dar(tiny_llama(dtype=torch.float64), dar_block_size=2, **options).train()
    perturb_dar_parameters(model, scale=0.5, seed=1)
    input_ids = random_input_ids()[:, :6]
    parameters = {name: parameter.detach() for name, parameter in model.named_parameters()}

    def loss(parameters, tokens):
        return functional_call(model, parameters, (tokens[None],), {"labels": tokens[None]}).loss

    per_sample = vmap(grad(loss), in_dims=(None, 0))(parameters, input_ids)
    for sample, tokens in enumerate(input_ids):
        model.zero_grad()
        model(tokens[None], labels=tokens[None]).loss.backward()
        transformed = grad(loss)(parameters, tokens)
        for name, parameter in model.named_parameters():
            torch.testing.assert_close(transformed[name], parameter.grad, rtol=1e-9, atol=1e-12, msg=name)
            torch.testing.assert_close(per_sample[name][sample], parameter.grad, rtol=1e-9, atol=1e-12, msg=name)


def test_a_vmapped_model_ensemble_with_the_cpp_inference_kernel_gives_each_models_logits():
    """`vmap(functional_call)` over stacked parameters (`torch.func.stack_module_state`, a model ensemble) with
    gradients off and `dar_inference_kernel="cpp"` died in the kernel ("Cannot access data pointer of Tensor that
    doesn't have storage"): batched tensors reached C++."""
    from torch.func import functional_call, stack_module_state, vmap

    models = []
    for seed in (1, 2):
        model = upcycled_dar(tiny_llama(), dar_block_size=2, dar_inference_kernel="cpp").eval()
        perturb_dar_parameters(model, scale=0.5, seed=seed)
        models.append(model)
    parameters, buffers = stack_module_state(models)
    input_ids = random_input_ids()[:1, :6]
    with torch.no_grad():
        ensemble = vmap(lambda p, b: functional_call(models[0], (p, b), (input_ids,)).logits)(parameters, buffers)
        for index, model in enumerate(models):
            torch.testing.assert_close(ensemble[index], model(input_ids).logits, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("flag", ["--sequence-length", "--batch-size", "--max-steps", "--eval-blocks"])
def test_finetune_refuses_sizes_below_one_in_one_line(tmp_path, capsys, flag):
    """`--sequence-length 0`, `--batch-size 0`, `--eval-blocks 0` were tracebacks from deep in the run, and
    `--max-steps 0` reported a run "after 1 steps" that trained nothing."""
    finetune = load_example("finetune")
    with pytest.raises(SystemExit) as exit_:
        finetune.parse_arguments(["--tiny", "--corpus-dir", str(tmp_path), flag, "0"])
    assert exit_.value.code == 2
    assert f"error: {flag} must be at least 1, got 0" in capsys.readouterr().err
