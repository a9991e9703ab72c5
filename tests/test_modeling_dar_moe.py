# SPDX-License-Identifier: Apache-2.0
"""DAR-MoE modeling on CPU with tiny random models (hidden 32, 2 layers, 4 experts, top-2): fast experts dispatch
and gradients against eager, HF's router, the aux loss, training, generation and caches, save/load and remote code,
compile, and the MoE init of missing weights."""

import json
import os
import subprocess
import sys
import textwrap

import pytest
import torch
from safetensors.torch import load_file
from transformers import AutoModel, AutoModelForCausalLM, Trainer, TrainingArguments
from transformers.integrations.moe import ExpertsInterface
from transformers.models.qwen3_moe.modeling_qwen3_moe import (
    Qwen3MoeExperts,
    Qwen3MoeTopKRouter,
    load_balancing_loss_func,
)

from dar_transformers import DARConfig, DARModel, DARMoeConfig, DARMoeForCausalLM, DARMoeModel
from dar_transformers.modeling_dar_moe import DARMoeTopKRouter

from conftest import (
    INIT,
    TINY_LLAMA_FIELDS,
    TINY_MOE,
    max_logit_difference,
    perturb_dar_parameters,
    random_input_ids,
    tiny_dar_moe,
)


def test_fast_experts_path_is_dispatched_and_matches_eager(monkeypatch):
    model = tiny_dar_moe(**INIT)
    perturb_dar_parameters(model, scale=0.3, seed=1)
    # The decorator string is in our module, so transformers picks the grouped_mm kernels (not the eager fallback).
    assert DARMoeForCausalLM._can_set_experts_implementation()
    assert model.config._experts_implementation == "grouped_mm"
    assert model.model.layers[0].mlp.experts.config._experts_implementation == "grouped_mm"

    calls = []
    grouped_mm = ExpertsInterface._global_mapping["grouped_mm"]

    def spy(module, *args, **kwargs):
        calls.append(module)
        return grouped_mm(module, *args, **kwargs)

    monkeypatch.setitem(ExpertsInterface._global_mapping, "grouped_mm", spy)
    input_ids = random_input_ids(length=10)
    with torch.no_grad():
        fast = model(input_ids).logits
        assert [id(module) for module in calls] == [id(layer.mlp.experts) for layer in model.model.layers]
        model.set_experts_implementation("eager")
        assert model.config._experts_implementation == "eager"
        eager = model(input_ids).logits
        assert len(calls) == 2  # the eager loop does not go through the kernel registry
        model.set_experts_implementation("batched_mm")
        batched = model(input_ids).logits
    assert fast.abs().max() > 1.0  # non-trivial logits
    assert torch.allclose(fast, eager, atol=1e-5, rtol=0) and torch.allclose(batched, eager, atol=1e-5, rtol=0)


def test_moe_modules_are_qwen3_moes_and_fast_experts_survive_a_dense_model_built_first():
    """The experts are transformers' own Qwen3MoeExperts (no re-decorated copy), and the fast-kernel decision does not
    depend on what was built before: a dense DARModel (whose answer is False) first, then DAR-MoE."""
    DARModel(DARConfig(**TINY_LLAMA_FIELDS))
    assert DARModel._can_set_experts_implementation() is False  # no experts in the dense family
    model = DARMoeModel(DARMoeConfig(**TINY_MOE))
    assert model.config._experts_implementation == "grouped_mm"
    block = model.layers[0].mlp
    assert type(block.experts) is Qwen3MoeExperts and isinstance(block.gate, Qwen3MoeTopKRouter)


def test_router_is_hfs_in_float32_and_sums_to_one_in_float64():
    """Float32: Qwen3-MoE's router output bit for bit. Float64: HF's float32 softmax leaves the top-k weights summing to
    1 only to ~1e-7, which breaks a 1e-8 upcycling check; DAR's router renormalises them in float64."""
    config = DARMoeConfig(**TINY_MOE)
    torch.manual_seed(0)
    dar_router, hf_router = DARMoeTopKRouter(config), Qwen3MoeTopKRouter(config)
    with torch.no_grad():
        dar_router.weight.normal_(std=2.0)
        hf_router.weight.copy_(dar_router.weight)
    hidden = torch.randn(64, 32)
    with torch.no_grad():
        for got, expected in zip(dar_router(hidden), hf_router(hidden)):
            assert torch.equal(got, expected)
        dar_router.double(), hf_router.double()
        _, dar_weights, dar_index = dar_router(hidden.double())
        _, hf_weights, hf_index = hf_router(hidden.double())
    assert torch.equal(dar_index, hf_index) and dar_weights.dtype == torch.float64
    assert (dar_weights.sum(-1) - 1).abs().max() < 1e-15
    assert (hf_weights.sum(-1) - 1).abs().max() > 1e-9  # the negative control: float32 rounding
    assert (dar_weights - hf_weights).abs().max() < 1e-6  # the same routing otherwise


def test_fast_experts_gradients_match_eager():
    model = tiny_dar_moe(**INIT)
    input_ids = random_input_ids(length=10)
    gradients = {}
    for implementation in ("grouped_mm", "eager"):
        model.set_experts_implementation(implementation)
        model.zero_grad()
        model(input_ids, labels=input_ids).loss.backward()
        gradients[implementation] = {name: p.grad.clone() for name, p in model.named_parameters() if p.grad is not None}
    assert gradients["grouped_mm"].keys() == gradients["eager"].keys()
    assert any("experts.gate_up_proj" in name for name in gradients["eager"])
    for name, gradient in gradients["eager"].items():
        torch.testing.assert_close(gradients["grouped_mm"][name], gradient, atol=1e-5, rtol=1e-4, msg=name)


def test_loss_includes_the_load_balancing_term():
    model = tiny_dar_moe(**INIT, router_aux_loss_coef=0.25)
    input_ids = random_input_ids(length=10)
    with torch.no_grad():
        with_aux = model(input_ids, labels=input_ids, output_router_logits=True)
        lm_only = model(input_ids, labels=input_ids)
    assert lm_only.aux_loss is None and with_aux.aux_loss is not None
    assert torch.allclose(with_aux.loss - lm_only.loss, 0.25 * with_aux.aux_loss, atol=1e-6)

    # The aux loss is Switch Transformer's E * sum_e f_e P_e over layers, computed here by hand.
    fractions, probabilities = 0.0, 0.0
    for logits in with_aux.router_logits:  # [N, E]
        probs = logits.softmax(-1)
        chosen = probs.topk(2, dim=-1).indices  # [N, k]
        fractions = fractions + torch.nn.functional.one_hot(chosen, 4).sum(1).float().mean(0)  # [E]
        probabilities = probabilities + probs.mean(0)  # [E]
    layers = len(with_aux.router_logits)
    expected = 4 * ((fractions / layers) * (probabilities / layers)).sum()
    assert torch.allclose(with_aux.aux_loss, expected, atol=1e-6)
    assert with_aux.aux_loss > 1.0  # the aux loss of k = 2 routing is k at perfect balance


def test_aux_loss_leaves_out_left_padding_as_transformers_load_balancing_loss_does():
    model = tiny_dar_moe(**INIT, router_aux_loss_coef=0.25)
    attention_mask = torch.ones(3, 10, dtype=torch.long)
    attention_mask[1, :4] = 0  # left padding
    attention_mask[2, :7] = 0
    input_ids = random_input_ids(batch=3, length=10).masked_fill(attention_mask == 0, 0)
    with torch.no_grad():
        output = model(input_ids, attention_mask=attention_mask, labels=input_ids, output_router_logits=True)
        lm_only = model(input_ids, attention_mask=attention_mask, labels=input_ids)
    router_logits = output.router_logits  # per sparse layer [B * T, E], padded tokens included
    masked = load_balancing_loss_func(router_logits, 4, 2, attention_mask)
    unmasked = load_balancing_loss_func(router_logits, 4, 2)
    assert torch.equal(output.aux_loss, masked)
    assert (masked - unmasked).abs() > 1e-2  # the mask matters: 10 of the 30 tokens are padding
    # The same value from the real tokens alone: masking means leaving the padded tokens out.
    real = attention_mask.reshape(-1).bool()
    assert torch.allclose(masked, load_balancing_loss_func(tuple(logits[real] for logits in router_logits), 4, 2))
    assert torch.allclose(output.loss - lm_only.loss, 0.25 * masked, atol=1e-6)


def test_padded_batched_generation_runs_with_router_logits_on_and_a_cached_steps_aux_loss_masks_its_tokens():
    """A model trained with `output_router_logits=True` in its config: a cached decoding step's router logits cover
    its new tokens, its attention mask the past ones too, and the load-balancing loss (transformers' Qwen3-MoE and
    Mixtral alike) died on the mismatch in every padded, batched `generate`. The step's aux loss now masks its own
    tokens: the same as the aux loss of the new tokens' router logits under the mask's last columns."""
    model = tiny_dar_moe(**INIT, output_router_logits=True)
    perturb_dar_parameters(model, scale=0.3)
    input_ids = random_input_ids(batch=2, length=9)
    attention_mask = torch.ones_like(input_ids)
    attention_mask[1, :3] = 0
    generated = model.generate(input_ids, attention_mask=attention_mask, max_new_tokens=3, do_sample=False)
    model.config.output_router_logits = False
    assert torch.equal(generated, model.generate(input_ids, attention_mask=attention_mask, max_new_tokens=3,
                                                 do_sample=False))
    model.config.output_router_logits = True
    with torch.no_grad():
        prefill = model(input_ids, attention_mask=attention_mask, use_cache=True)
        step_mask = torch.cat([attention_mask, torch.ones(2, 1, dtype=torch.long)], 1)
        step = model(generated[:, 9:10], attention_mask=step_mask, past_key_values=prefill.past_key_values)
    expected = load_balancing_loss_func(step.router_logits, 4, 2, step_mask[:, -1:])
    assert torch.equal(step.aux_loss, expected)


def test_trainer_steps_include_aux_loss_change_router_and_reduce_loss(tmp_path):
    model = tiny_dar_moe(**INIT, output_router_logits=True, router_aux_loss_coef=0.5)
    input_ids = random_input_ids(batch=4, length=12)
    with torch.no_grad():
        initial = model(input_ids, labels=input_ids)
        lm_only = model(input_ids, labels=input_ids, output_router_logits=False)
    assert initial.aux_loss > 1.0 and torch.allclose(initial.loss - lm_only.loss, 0.5 * initial.aux_loss, atol=1e-5)
    router_before = model.model.layers[0].mlp.gate.weight.detach().clone()

    class FourSequences(torch.utils.data.Dataset):  # one batch per epoch: every step sees the same 4 sequences
        def __len__(self):
            return 4

        def __getitem__(self, index):
            return {"input_ids": input_ids[index], "labels": input_ids[index]}

    arguments = TrainingArguments(
        output_dir=str(tmp_path), per_device_train_batch_size=4, max_steps=10, learning_rate=3e-3, logging_steps=1,
        save_strategy="no", report_to=[], use_cpu=True, disable_tqdm=True, lr_scheduler_type="constant", seed=0,
    )
    trainer = Trainer(model=model, args=arguments, train_dataset=FourSequences())
    trainer.train()
    logged = [entry["loss"] for entry in trainer.state.log_history if "loss" in entry]
    assert len(logged) == 10
    # The Trainer optimised lm + 0.5 * aux: its first logged loss is that, not the LM loss alone.
    assert abs(logged[0] - initial.loss.item()) < 1e-3 and abs(logged[0] - lm_only.loss.item()) > 0.3
    assert logged[-1] < logged[0] - 0.1
    router_after = model.model.layers[0].mlp.gate.weight.detach()
    assert (router_after - router_before).abs().max() > 1e-3  # the router is trained
    model.eval()
    with torch.no_grad():
        assert model(input_ids, labels=input_ids).loss < initial.loss - 0.1


def test_generation_with_and_without_cache_gives_the_same_tokens():
    model = tiny_dar_moe(**INIT)
    perturb_dar_parameters(model, scale=0.3, seed=1)
    input_ids = random_input_ids(batch=2, length=6)
    attention_mask = torch.ones_like(input_ids)
    attention_mask[1, :2] = 0  # left padding in the second row
    greedy = dict(max_new_tokens=8, do_sample=False, attention_mask=attention_mask, pad_token_id=0)
    cached = model.generate(input_ids, use_cache=True, **greedy)
    uncached = model.generate(input_ids, use_cache=False, **greedy)
    assert cached.shape == (2, 14)
    assert torch.equal(cached, uncached)


def test_save_load_round_trip_in_safetensors(tmp_path):
    model = tiny_dar_moe(**INIT, mlp_only_layers=[0], shared_expert_intermediate_size=16)
    perturb_dar_parameters(model, scale=0.3, seed=1)
    model.save_pretrained(tmp_path)
    files = sorted(os.listdir(tmp_path))
    assert "model.safetensors" in files and not any(name.endswith(".bin") for name in files)
    saved = load_file(str(tmp_path / "model.safetensors"))
    assert saved["model.layers.1.mlp.experts.gate_up_proj"].shape == (4, 128, 32)  # fused 3-D layout on disk
    config = json.loads((tmp_path / "config.json").read_text())
    assert config["model_type"] == "dar_moe" and config["auto_map"]["AutoModelForCausalLM"] == (
        "modeling_dar_moe.DARMoeForCausalLM"
    )
    reloaded = AutoModelForCausalLM.from_pretrained(tmp_path).eval()
    assert type(reloaded) is DARMoeForCausalLM and reloaded.config._experts_implementation == "grouped_mm"
    input_ids = random_input_ids(length=10)
    assert max_logit_difference(model, reloaded, input_ids) == 0.0
    base = AutoModel.from_pretrained(tmp_path)
    assert type(base) is DARMoeModel


REMOTE_CODE_SCRIPT = textwrap.dedent(
    """
    import importlib.util, sys
    import os
    sys.path[:] = [path for path in sys.path if not os.path.isdir(os.path.join(path or ".", "dar_transformers"))]
    assert importlib.util.find_spec("dar_transformers") is None, "dar_transformers must not be importable here"
    import torch
    from transformers import AutoModelForCausalLM
    model = AutoModelForCausalLM.from_pretrained(sys.argv[1], trust_remote_code=True).eval()
    assert type(model).__module__.startswith("transformers_modules"), type(model).__module__
    assert model.config._experts_implementation == "grouped_mm", model.config._experts_implementation
    input_ids = torch.load(sys.argv[2])
    with torch.no_grad():
        torch.save(model(input_ids).logits, sys.argv[3])
    print(type(model).__name__, type(model).__module__)
    """
)


@pytest.mark.slow  # test_remote_code.py (saved_dar_moe) loads such a folder through every Auto class
def test_remote_code_loading_in_a_fresh_process_without_the_package(tmp_path):
    model = tiny_dar_moe(**INIT)
    perturb_dar_parameters(model, scale=0.3, seed=1)
    saved = tmp_path / "checkpoint"
    model.save_pretrained(saved)
    assert {"configuration_dar.py", "configuration_dar_moe.py", "modeling_dar.py", "modeling_dar_moe.py"} <= set(
        os.listdir(saved)
    )
    input_ids = random_input_ids(length=10)
    torch.save(input_ids, tmp_path / "input_ids.pt")
    script = tmp_path / "load_remote.py"
    script.write_text(REMOTE_CODE_SCRIPT)
    environment = {
        "PATH": os.environ["PATH"], "HOME": str(tmp_path), "OMP_NUM_THREADS": str(torch.get_num_threads()), "HF_HUB_OFFLINE": "1",
        "HF_HOME": str(tmp_path / "hf_home"), "HF_MODULES_CACHE": str(tmp_path / "modules"),
    }
    result = subprocess.run(
        [sys.executable, str(script), str(saved), str(tmp_path / "input_ids.pt"), str(tmp_path / "out.pt")],
        cwd=tmp_path, env=environment, capture_output=True, text=True, timeout=300,
    )
    assert result.returncode == 0, result.stderr[-3000:]
    assert "DARMoeForCausalLM transformers_modules" in result.stdout
    with torch.no_grad():
        expected = model(input_ids).logits
    assert torch.equal(torch.load(tmp_path / "out.pt"), expected)


@pytest.mark.parametrize(
    "use_reentrant, output_router_logits",
    # Reentrant checkpointing runs the first forward under no_grad, so the router logits that transformers' output
    # hooks record there carry no graph and the aux loss would get no gradient (as for HF's own Mixtral/Qwen3-MoE):
    # with reentrant checkpointing the LM loss alone is compared.
    [(False, True), (True, False)],
)
def test_gradient_checkpointing_gives_the_same_gradients(use_reentrant, output_router_logits):
    model = tiny_dar_moe(**INIT, output_router_logits=output_router_logits)
    perturb_dar_parameters(model, scale=0.3, seed=1)
    model.train()
    input_ids = random_input_ids(length=10)

    def gradients():
        model.zero_grad()
        model(input_ids, labels=input_ids).loss.backward()
        return {name: parameter.grad.clone() for name, parameter in model.named_parameters()}

    plain = gradients()
    model.activation_checkpointing_enable(activation_checkpointing_kwargs={"use_reentrant": use_reentrant})
    assert all(layer.gradient_checkpointing for layer in model.model.layers)
    checkpointed = gradients()
    model.activation_checkpointing_disable()
    assert plain["model.layers.0.mlp.gate.weight"].abs().max() > 0  # the router gets gradients
    assert plain["model.layers.0.mlp_residual.depth_attention.pseudo_query"].abs().max() > 0
    for name, gradient in plain.items():
        torch.testing.assert_close(checkpointed[name], gradient, atol=1e-5, rtol=1e-4, msg=name)


def test_the_aux_loss_under_reentrant_checkpointing_is_warned(caplog):
    """Router logits are recorded inside the decoder layers, so reentrant checkpointing drops the load-balancing
    loss's gradient (the routers' 0.27 off, as in Qwen3-MoE): said once, as for recorded hidden states."""
    from transformers.utils import logging as hf_logging

    model = tiny_dar_moe(**INIT, output_router_logits=True).train()
    model.activation_checkpointing_enable(activation_checkpointing_kwargs={"use_reentrant": True})
    hf_logging.get_logger("dar_transformers.modeling_dar").warning_once.cache_clear()
    with caplog.at_level("WARNING", logger="dar_transformers.modeling_dar"):
        model(random_input_ids(length=10), labels=random_input_ids(length=10)).loss.backward()
    assert "output_router_logits of a DAR model are recorded inside its decoder layers" in caplog.text


GENERATION = dict(max_new_tokens=8, eos_token_id=None, pad_token_id=0)


@pytest.fixture(scope="module")
def dar_moe():
    """Random experts and routers, block size 3, random non-zero DAR parameters: nothing reduces to a simpler model."""
    model = tiny_dar_moe(**INIT, dar_block_size=3)
    perturb_dar_parameters(model, scale=0.3, seed=1)
    return model


@pytest.mark.parametrize(
    "mode", [dict(do_sample=True, top_k=0), dict(do_sample=False, num_beams=3)], ids=["sampling", "beam_search"]
)
def test_sampling_and_beam_search_with_and_without_cache_agree(dar_moe, mode):
    input_ids = random_input_ids(length=5)
    generated = {}
    for use_cache in (True, False):
        torch.manual_seed(7)
        generated[use_cache] = dar_moe.generate(input_ids, use_cache=use_cache, **mode, **GENERATION)
    assert generated[True].shape == (2, 13) and torch.equal(generated[True], generated[False])


def test_static_cache_gives_the_tokens_of_dynamic_cache(dar_moe):
    input_ids = random_input_ids(length=5)
    static = dar_moe.generate(input_ids, do_sample=False, cache_implementation="static", **GENERATION)
    assert torch.equal(static, dar_moe.generate(input_ids, do_sample=False, **GENERATION))


def test_eager_and_sdpa_attention_and_reference_dar_path_agree(dar_moe):
    input_ids = random_input_ids(length=10)
    with torch.no_grad():
        expected = dar_moe(input_ids).logits
        for attention in ("eager", "sdpa"):
            config = DARMoeConfig(**dar_moe.config.to_dict())
            copy = DARMoeForCausalLM._from_config(config, attn_implementation=attention)
            copy.load_state_dict(dar_moe.state_dict())
            assert copy.config._attn_implementation == attention
            assert torch.allclose(copy.eval()(input_ids).logits, expected, atol=1e-5)
        # DAR's readable eager loop against its two-phase fast path, around the MoE branch (float64: exact order)
        reference = DARMoeForCausalLM(DARMoeConfig(**{**dar_moe.config.to_dict(), "dar_implementation": "reference"}))
        reference.load_state_dict(dar_moe.state_dict())
        fast64, reference64 = copy_of(dar_moe).double(), reference.double().eval()
        for model in (fast64, reference64):
            model.set_experts_implementation("batched_mm")  # grouped_mm takes no float64
        assert max_logit_difference(fast64, reference64, input_ids) <= 1e-10


def copy_of(model: DARMoeForCausalLM) -> DARMoeForCausalLM:
    copy = DARMoeForCausalLM(DARMoeConfig(**model.config.to_dict()))
    copy.load_state_dict(model.state_dict())
    return copy.eval()


def test_tuple_return_and_logits_to_keep(dar_moe):
    input_ids = random_input_ids(length=10)
    with torch.no_grad():
        expected = dar_moe(input_ids, labels=input_ids, output_router_logits=True)
        output = dar_moe(input_ids, labels=input_ids, output_router_logits=True, return_dict=False)
        last = dar_moe(input_ids, logits_to_keep=1).logits
    assert isinstance(output, tuple)
    assert torch.equal(output[0], expected.loss) and torch.equal(output[1], expected.aux_loss)
    assert torch.equal(output[2], expected.logits)
    assert last.shape == (2, 1, 97) and torch.allclose(last, expected.logits[:, -1:], atol=1e-6)


def test_bf16_load_keeps_dar_parameters_float32_and_trains(dar_moe, tmp_path):
    dar_moe.save_pretrained(tmp_path)
    model = DARMoeForCausalLM.from_pretrained(tmp_path, dtype=torch.bfloat16)
    for name, parameter in model.named_parameters():
        is_dar = any(part in name for part in ("attn_residual", "mlp_residual", "final_readout"))
        assert parameter.dtype == (torch.float32 if is_dar else torch.bfloat16), name
    assert model.config._experts_implementation == "grouped_mm"
    model.train()
    input_ids = random_input_ids(length=10)
    output = model(input_ids, labels=input_ids, output_router_logits=True)
    output.loss.backward()
    assert output.logits.dtype == torch.bfloat16 and torch.isfinite(output.loss)
    assert torch.isfinite(model.model.layers[0].mlp.experts.gate_up_proj.grad).all()
    assert model.model.layers[0].mlp.gate.weight.grad.abs().max() > 0
    with torch.no_grad():
        assert (model.eval()(input_ids).logits.double() - dar_moe(input_ids).logits.double()).abs().max() < 0.2


def test_torch_compile_fullgraph_matches_eager(dar_moe):
    """A compiled forward runs the reference equations, eager the fast path: the two evaluation orders agree within
    a small multiple of float32's own error here (measured against float64, DESIGN.md section 4)."""
    torch._dynamo.reset()
    compiled = torch.compile(dar_moe, backend="aot_eager", fullgraph=True)
    input_ids = random_input_ids(length=10)
    exact = copy_of(dar_moe).double()
    exact.set_experts_implementation("batched_mm")
    with torch.no_grad():
        eager = dar_moe(input_ids).logits
        own_error = (eager.double() - exact(input_ids).logits).abs().max().item()
        assert own_error < 1e-4
        assert (compiled(input_ids).logits - eager).abs().max().item() <= 10 * own_error + 1e-6
    torch._dynamo.reset()


def test_missing_weights_get_the_moe_init():
    """`_init_weights` covers experts, routers and shared experts: HF initialises missing keys only through it."""
    config = DARMoeConfig(**TINY_MOE, shared_expert_intermediate_size=16, mlp_only_layers=[0])
    loaded = DARMoeForCausalLM.from_pretrained(None, config=config, state_dict={})
    block = loaded.model.layers[1].mlp
    for name in ("experts.gate_up_proj", "experts.down_proj", "gate.weight", "shared_expert_gate.weight"):
        parameter = block.get_parameter(name)  # torch.empty would leave arbitrary values
        assert torch.isfinite(parameter).all() and 0.01 < parameter.std() < 0.03, name  # normal(0, 0.02)
    assert loaded.model.layers[1].mlp_residual.depth_attention.pseudo_query.abs().max() == 0  # the DAR init
    assert not torch.equal(block.experts.gate_up_proj[0], block.experts.gate_up_proj[1])  # independent experts
