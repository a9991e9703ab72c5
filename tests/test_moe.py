# SPDX-License-Identifier: Apache-2.0
"""DAR-MoE on CPU with tiny random models: config, fast experts dispatch, aux loss, training, HF behaviour, conversion.

Tiny configs (hidden 32, 2 layers, 4 experts, top-2, 97-token vocabulary). Conversions are checked against the
source model's own logits: exact to 1e-5 in float32 and 1e-8 in float64 (DESIGN.md section 3), with negative
controls showing the checks can fail.
"""

import json
import os
import subprocess
import sys
import textwrap

import pytest
import torch
from safetensors.torch import load_file
from tokenizers import Tokenizer
from tokenizers.models import WordLevel
from tokenizers.pre_tokenizers import Whitespace
from transformers import (
    AutoConfig,
    AutoModel,
    AutoModelForCausalLM,
    LlamaConfig,
    LlamaForCausalLM,
    MixtralConfig,
    MixtralForCausalLM,
    Qwen2MoeConfig,
    Qwen2MoeForCausalLM,
    Qwen3MoeConfig,
    Qwen3Config,
    Qwen3ForCausalLM,
    Qwen3MoeForCausalLM,
    PreTrainedTokenizerFast,
    Trainer,
    TrainingArguments,
)
from transformers.integrations.moe import ExpertsInterface
from transformers.modeling_outputs import MoeCausalLMOutputWithPast, MoeModelOutputWithPast

from conftest import TINY_LLAMA_FIELDS
from dar_transformers import DARMoeConfig, DARMoeForCausalLM, DARMoeModel
from dar_transformers.modeling_dar_moe import DARMoeSparseMoeBlock
from dar_transformers.cli import main as cli_main
from dar_transformers.convert import verify_conversion
from dar_transformers.moe_upcycling import (
    convert_to_dar_moe,
    dar_moe_config_from_source,
    fuse_expert_weights,
    upcycle_to_dar_moe,
)

TINY = TINY_LLAMA_FIELDS
# Larger than HF's 0.02 so that logits are O(1) and routing is far from uniform: rounding and drift are visible.
INIT = dict(initializer_range=0.2)
TINY_MOE = dict(TINY, num_experts=4, num_experts_per_tok=2)


def tiny_dar_moe(seed: int = 0, **overrides) -> DARMoeForCausalLM:
    torch.manual_seed(seed)
    return DARMoeForCausalLM(DARMoeConfig(**{**TINY_MOE, **overrides})).eval()


def perturb_dar_parameters(model: torch.nn.Module, scale: float = 0.3, seed: int = 1) -> None:
    """Move every DAR residual parameter off its init, so the model is not its own exact reduction."""
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, parameter in sorted(model.named_parameters()):
            if any(part in name for part in ("attn_residual", "mlp_residual", "final_readout")):
                parameter.add_(scale * torch.randn(parameter.shape, generator=generator, dtype=parameter.dtype))


def tokens(batch: int = 2, length: int = 10, seed: int = 0) -> torch.LongTensor:
    return torch.randint(3, TINY["vocab_size"], (batch, length), generator=torch.Generator().manual_seed(seed))


def max_logit_diff(source, target, input_ids) -> float:
    with torch.no_grad():
        return (source(input_ids).logits.double() - target(input_ids).logits.double()).abs().max().item()


# ----------------------------------------------------------------------------------------------------------- config


def test_config_defaults_and_round_trip():
    config = DARMoeConfig(**TINY)
    assert config.model_type == "dar_moe"
    assert config.moe_intermediate_size == config.intermediate_size  # None -> the dense MLP width (upcycling)
    assert config.norm_topk_prob is True and config.shared_expert_intermediate_size == 0
    assert config.moe_layer_indices == [0, 1]
    reloaded = AutoConfig.for_model(**config.to_dict())
    assert isinstance(reloaded, DARMoeConfig) and reloaded.to_dict() == config.to_dict()
    sparse_every_second = DARMoeConfig(
        **{**TINY_MOE, "num_hidden_layers": 4, "decoder_sparse_step": 2, "mlp_only_layers": [3]}
    )
    assert sparse_every_second.moe_layer_indices == [1]


@pytest.mark.parametrize(
    "field, value, message",
    [
        ("num_experts", 0, "num_experts must be an integer >= 1"),
        ("num_experts_per_tok", 5, "num_experts_per_tok must be an integer in [1, num_experts=4]"),
        ("moe_intermediate_size", 0, "moe_intermediate_size must be None"),
        ("shared_expert_intermediate_size", -1, "shared_expert_intermediate_size must be 0"),
        ("decoder_sparse_step", 0, "decoder_sparse_step must be an integer >= 1"),
        ("mlp_only_layers", [2], "mlp_only_layers must hold layer indices in [0, 1]"),
        ("mlp_only_layers", [0, 1], "leave no sparse layer"),
        ("router_aux_loss_coef", -0.1, "router_aux_loss_coef must be a finite number >= 0"),
        ("dar_routing", "nope", "dar_routing must be one of"),  # the inherited DAR validation still runs
    ],
)
def test_config_rejects_bad_values_naming_the_field(field, value, message):
    with pytest.raises(Exception, match=message.replace("[", r"\[").replace("]", r"\]")) as error:
        DARMoeConfig(**{**TINY_MOE, field: value})
    assert field in str(error.value)


# ----------------------------------------------------------------------------------------------------------- model


def test_sparse_and_dense_layers_follow_the_config():
    model = tiny_dar_moe(
        num_hidden_layers=4, decoder_sparse_step=2, mlp_only_layers=[3], shared_expert_intermediate_size=16
    )
    kinds = [type(layer.mlp).__name__ for layer in model.model.layers]
    assert kinds == ["LlamaMLP", "DARMoeSparseMoeBlock", "LlamaMLP", "LlamaMLP"]
    block = model.model.layers[1].mlp
    assert isinstance(block, DARMoeSparseMoeBlock) and block.has_shared_expert
    assert block.experts.gate_up_proj.shape == (4, 2 * 64, 32) and block.experts.down_proj.shape == (4, 32, 64)
    assert block.shared_expert.gate_proj.weight.shape == (16, 32)
    output = model(tokens(), output_router_logits=True)
    assert isinstance(output, MoeCausalLMOutputWithPast)
    assert len(output.router_logits) == 1 and output.router_logits[0].shape == (2 * 10, 4)
    base = model.model(tokens(), output_router_logits=True)
    assert isinstance(base, MoeModelOutputWithPast) and len(base.router_logits) == 1


def test_fast_experts_path_is_dispatched_and_matches_eager(monkeypatch):
    model = tiny_dar_moe(**INIT)
    perturb_dar_parameters(model)
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
    input_ids = tokens()
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


def test_fast_experts_gradients_match_eager():
    model = tiny_dar_moe(**INIT)
    input_ids = tokens()
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
    input_ids = tokens()
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


def test_trainer_steps_include_aux_loss_change_router_and_reduce_loss(tmp_path):
    model = tiny_dar_moe(**INIT, output_router_logits=True, router_aux_loss_coef=0.5)
    input_ids = tokens(batch=4, length=12)
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


# ------------------------------------------------------------------------------------------------- HF behaviour


def test_generation_with_and_without_cache_gives_the_same_tokens():
    model = tiny_dar_moe(**INIT)
    perturb_dar_parameters(model)
    input_ids = tokens(batch=2, length=6)
    attention_mask = torch.ones_like(input_ids)
    attention_mask[1, :2] = 0  # left padding in the second row
    greedy = dict(max_new_tokens=8, do_sample=False, attention_mask=attention_mask, pad_token_id=0)
    cached = model.generate(input_ids, use_cache=True, **greedy)
    uncached = model.generate(input_ids, use_cache=False, **greedy)
    assert cached.shape == (2, 14)
    assert torch.equal(cached, uncached)


def test_save_load_round_trip_in_safetensors(tmp_path):
    model = tiny_dar_moe(**INIT, mlp_only_layers=[0], shared_expert_intermediate_size=16)
    perturb_dar_parameters(model)
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
    input_ids = tokens()
    assert max_logit_diff(model, reloaded, input_ids) == 0.0
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


def test_remote_code_loading_in_a_fresh_process_without_the_package(tmp_path):
    model = tiny_dar_moe(**INIT)
    perturb_dar_parameters(model)
    saved = tmp_path / "checkpoint"
    model.save_pretrained(saved)
    assert {"configuration_dar.py", "configuration_dar_moe.py", "modeling_dar.py", "modeling_dar_moe.py"} <= set(
        os.listdir(saved)
    )
    input_ids = tokens()
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
    perturb_dar_parameters(model)
    model.train()
    input_ids = tokens()

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


GENERATION = dict(max_new_tokens=8, eos_token_id=None, pad_token_id=0)


@pytest.fixture(scope="module")
def dar_moe():
    """Random experts and routers, block size 3, random non-zero DAR parameters: nothing reduces to a simpler model."""
    model = tiny_dar_moe(**INIT, dar_block_size=3)
    perturb_dar_parameters(model)
    return model


@pytest.mark.parametrize(
    "mode", [dict(do_sample=True, top_k=0), dict(do_sample=False, num_beams=3)], ids=["sampling", "beam_search"]
)
def test_sampling_and_beam_search_with_and_without_cache_agree(dar_moe, mode):
    input_ids = tokens(length=5)
    generated = {}
    for use_cache in (True, False):
        torch.manual_seed(7)
        generated[use_cache] = dar_moe.generate(input_ids, use_cache=use_cache, **mode, **GENERATION)
    assert generated[True].shape == (2, 13) and torch.equal(generated[True], generated[False])


def test_static_cache_gives_the_tokens_of_dynamic_cache(dar_moe):
    input_ids = tokens(length=5)
    static = dar_moe.generate(input_ids, do_sample=False, cache_implementation="static", **GENERATION)
    assert torch.equal(static, dar_moe.generate(input_ids, do_sample=False, **GENERATION))


def test_eager_and_sdpa_attention_and_reference_dar_path_agree(dar_moe):
    input_ids = tokens()
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
        assert max_logit_diff(fast64, reference64, input_ids) <= 1e-10


def copy_of(model: DARMoeForCausalLM) -> DARMoeForCausalLM:
    copy = DARMoeForCausalLM(DARMoeConfig(**model.config.to_dict()))
    copy.load_state_dict(model.state_dict())
    return copy.eval()


def test_tuple_return_and_logits_to_keep(dar_moe):
    input_ids = tokens()
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
    input_ids = tokens()
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
    input_ids = tokens()
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


# --------------------------------------------------------------------------------------------------- conversion


def tiny_llama(seed: int = 0, **overrides) -> LlamaForCausalLM:
    torch.manual_seed(seed)
    return LlamaForCausalLM(LlamaConfig(**{**TINY, **INIT, **overrides})).eval()


def test_sparse_upcycling_of_a_dense_llama_is_exact():
    llama = tiny_llama()
    moe = convert_to_dar_moe(llama, num_experts=4, top_k=2)
    dense_mlp = llama.model.layers[1].mlp
    experts = moe.model.layers[1].mlp.experts
    for expert in range(4):  # every expert is the dense MLP, gate rows then up rows
        gate_up = torch.cat([dense_mlp.gate_proj.weight, dense_mlp.up_proj.weight])
        assert torch.equal(experts.gate_up_proj[expert], gate_up)
        assert torch.equal(experts.down_proj[expert], dense_mlp.down_proj.weight)
    input_ids = tokens()
    report = verify_conversion(llama, moe, [("random", input_ids[:1])], max_new_tokens=8, progress=False)
    assert report.max_abs_logit_difference <= 1e-5 and report.greedy_identical
    with torch.no_grad():
        assert llama(input_ids).logits.abs().max() > 1.0
        router_logits = moe(input_ids, output_router_logits=True).router_logits
    assert all(logits.std() > 0.1 for logits in router_logits)  # a random router: the routing is not degenerate

    llama64 = tiny_llama().double()
    moe64 = convert_to_dar_moe(llama64, num_experts=4, top_k=2)
    assert moe64.dtype == torch.float64 and moe64.config._experts_implementation == "batched_mm"
    assert max_logit_diff(llama64, moe64, input_ids) <= 1e-8


def test_sparse_upcycling_composes_with_full_dar_and_other_families():
    input_ids = tokens()
    llama = tiny_llama()
    assert max_logit_diff(llama, convert_to_dar_moe(llama, num_experts=3, top_k=3, dar_block_size=1), input_ids) <= 1e-5
    torch.manual_seed(0)
    qwen3 = Qwen3ForCausalLM(Qwen3Config(**TINY, **INIT, head_dim=8)).eval()
    assert max_logit_diff(qwen3, convert_to_dar_moe(qwen3, num_experts=4, top_k=1), input_ids) <= 1e-5


def test_upcycling_negative_controls_drift():
    """The checks can fail: unnormalised top-k weights and Drop-Upcycling noise both change the function."""
    llama = tiny_llama()
    input_ids = tokens()
    unnormalised = convert_to_dar_moe(llama, num_experts=4, top_k=2)
    unnormalised.config.norm_topk_prob = False
    for layer in unnormalised.model.layers:
        layer.mlp.gate.norm_topk_prob = False  # output becomes (p_1 + p_2) MLP(x)
    assert max_logit_diff(llama, unnormalised, input_ids) > 1e-2


def test_expert_noise_breaks_symmetry_and_says_it_is_not_exact(caplog):
    llama = tiny_llama()
    with caplog.at_level("WARNING"):
        noisy = convert_to_dar_moe(llama, num_experts=4, top_k=2, expert_noise=0.25, seed=3)
    assert "NOT function-preserving" in caplog.text
    experts = noisy.model.layers[0].mlp.experts.gate_up_proj.detach()
    dense = torch.cat([llama.model.layers[0].mlp.gate_proj.weight, llama.model.layers[0].mlp.up_proj.weight])
    changed_rows = (experts != dense).any(-1)  # [E, 2I]
    assert changed_rows.sum(-1).tolist() == [2 * 16] * 4  # 25% of the 64 hidden units, in gate and up rows
    assert not torch.equal(changed_rows[0], changed_rows[1])  # different units per expert: symmetry broken
    assert max_logit_diff(llama, noisy, tokens()) > 1e-3
    again = convert_to_dar_moe(llama, num_experts=4, top_k=2, expert_noise=0.25, seed=3)
    assert torch.equal(again.model.layers[0].mlp.experts.gate_up_proj, noisy.model.layers[0].mlp.experts.gate_up_proj)


@pytest.mark.parametrize(
    "source_kind",
    ["mixtral", "mixtral_sliding", "qwen3_moe", "qwen3_moe_unnormalised_dense_first", "qwen2_moe_shared_expert"],
)
def test_moe_checkpoints_convert_exactly(source_kind):
    torch.manual_seed(0)
    moe = dict(num_experts_per_tok=2, **TINY, **INIT)
    source = {
        "mixtral": lambda: MixtralForCausalLM(MixtralConfig(num_local_experts=4, **moe)),
        "mixtral_sliding": lambda: MixtralForCausalLM(MixtralConfig(num_local_experts=4, sliding_window=4, **moe)),
        "qwen3_moe": lambda: Qwen3MoeForCausalLM(
            Qwen3MoeConfig(num_experts=4, moe_intermediate_size=24, head_dim=8, norm_topk_prob=True, **moe)
        ),
        "qwen3_moe_unnormalised_dense_first": lambda: Qwen3MoeForCausalLM(
            Qwen3MoeConfig(num_experts=4, moe_intermediate_size=24, head_dim=8, mlp_only_layers=[0], **moe)
        ),
        "qwen2_moe_shared_expert": lambda: Qwen2MoeForCausalLM(
            Qwen2MoeConfig(num_experts=4, moe_intermediate_size=24, shared_expert_intermediate_size=40, **moe)
        ),
    }[source_kind]().eval()
    converted = convert_to_dar_moe(source)
    config = converted.config
    assert config.num_experts == 4 and config.num_experts_per_tok == 2
    assert config.norm_topk_prob == getattr(source.config, "norm_topk_prob", True)  # Mixtral always renormalises
    input_ids = tokens(length=12)
    report = verify_conversion(source, converted, [("random", input_ids[:1])], max_new_tokens=8, progress=False)
    assert report.max_abs_logit_difference <= 1e-5 and report.greedy_identical, report.table()
    assert max_logit_diff(source, converted, input_ids) <= 1e-5  # the whole batch too
    # The routers, experts (and shared expert) are the source's: identical router logits in every sparse layer.
    with torch.no_grad():
        source_routers = source(input_ids, output_router_logits=True).router_logits
        target_routers = converted(input_ids, output_router_logits=True).router_logits
    assert len(source_routers) == len(target_routers) == len(config.moe_layer_indices)
    for source_logits, target_logits in zip(source_routers, target_routers):
        assert torch.allclose(source_logits, target_logits, atol=1e-5)
    # Negative control: a different router in one layer changes the function.
    with torch.no_grad():
        converted.model.layers[config.moe_layer_indices[0]].mlp.gate.weight.mul_(-1.0)
    assert max_logit_diff(source, converted, input_ids) > 1e-3


def test_per_expert_checkpoint_tensors_are_fused(tmp_path):
    torch.manual_seed(0)
    mixtral = MixtralForCausalLM(MixtralConfig(num_local_experts=4, num_experts_per_tok=2, **TINY)).eval()
    mixtral.save_pretrained(tmp_path)
    on_disk = load_file(str(tmp_path / "model.safetensors"))
    assert "model.layers.0.block_sparse_moe.experts.3.w1.weight" in on_disk  # HF saves Mixtral per expert
    fused = fuse_expert_weights(on_disk)
    assert fused.keys() == mixtral.state_dict().keys()
    for name, tensor in mixtral.state_dict().items():
        assert torch.equal(fused[name], tensor), name
    assert fuse_expert_weights(fused).keys() == fused.keys()  # already fused: unchanged
    qwen_style = {
        f"model.layers.0.mlp.experts.{expert}.{name}.weight": torch.full(shape, float(expert))
        for expert in range(3)
        for name, shape in (("gate_proj", (5, 4)), ("up_proj", (5, 4)), ("down_proj", (4, 5)))
    }
    qwen_fused = fuse_expert_weights(qwen_style)
    assert qwen_fused["model.layers.0.mlp.experts.gate_up_proj"].shape == (3, 10, 4)
    assert qwen_fused["model.layers.0.mlp.experts.down_proj"][2].eq(2.0).all()
    del qwen_style["model.layers.0.mlp.experts.1.up_proj.weight"]
    with pytest.raises(ValueError, match="incomplete"):
        fuse_expert_weights(qwen_style)


def test_conversion_rejects_bad_inputs():
    llama = tiny_llama()
    with pytest.raises(ValueError, match="needs num_experts and top_k"):
        convert_to_dar_moe(llama)
    with pytest.raises(ValueError, match="expert_noise must be a fraction in"):
        convert_to_dar_moe(llama, num_experts=4, top_k=2, expert_noise=1.5)
    with pytest.raises(Exception, match="num_experts_per_tok must be an integer in"):
        convert_to_dar_moe(llama, num_experts=2, top_k=3)
    mixtral_config = MixtralConfig(num_local_experts=4, num_experts_per_tok=2, **TINY)
    with pytest.raises(ValueError, match="differs from the mixtral source"):
        dar_moe_config_from_source(mixtral_config, num_experts=8)
    with pytest.raises(ValueError, match="source model_type must be one of"):
        dar_moe_config_from_source(AutoConfig.for_model("gpt2"), num_experts=4, top_k=2)


def word_tokenizer(vocab_size: int = TINY["vocab_size"]) -> PreTrainedTokenizerFast:
    """A word-level tokenizer over the tiny vocabulary (the converter writes one into the repo folder)."""
    vocab = {"<unk>": 0, "<s>": 1, "</s>": 2} | {f"w{index}": index for index in range(3, vocab_size)}
    backend = Tokenizer(WordLevel(vocab, unk_token="<unk>"))
    backend.pre_tokenizer = Whitespace()
    return PreTrainedTokenizerFast(tokenizer_object=backend, unk_token="<unk>", bos_token="<s>", eos_token="</s>")


PROMPTS = [" ".join(f"w{3 + (7 * index) % 90}" for index in range(24)), "w5 w9 w11 w60 w61 w62 w3 w4"]


@pytest.mark.parametrize("dtype, tolerance", [("float32", 1e-5), ("float64", 1e-8)])
def test_upcycle_to_dar_moe_verifies_and_writes_a_loadable_repo(tmp_path, dtype, tolerance):
    llama = tiny_llama()
    result = upcycle_to_dar_moe(
        llama, tmp_path / "moe", tokenizer=word_tokenizer(), num_experts=4, top_k=2, dtype=dtype, prompts=PROMPTS,
        max_new_tokens=8, progress=False, dar_block_size=2,
    )
    assert result.report.passed and result.report.greedy_identical
    assert result.report.max_abs_logit_difference <= tolerance
    assert result.report.method == "layer-streamed" and result.report.dtype == dtype
    reloaded = AutoModelForCausalLM.from_pretrained(tmp_path / "moe", dtype=torch.float32).eval()
    assert reloaded.config._experts_implementation == "grouped_mm"  # the fast experts path
    assert type(reloaded) is DARMoeForCausalLM and reloaded.config.num_experts == 4
    assert reloaded.config.dar_block_size == 2 and reloaded.config.architectures == ["DARMoeForCausalLM"]
    assert max_logit_diff(llama, reloaded, tokens()) <= 1e-5
    assert "DAR-MoE" in (tmp_path / "moe" / "README.md").read_text()


def test_dar_convert_cli_with_experts_and_top_k(tmp_path, capsys):
    llama = tiny_llama(max_position_embeddings=256)  # the converter's default prompts are about 80 tokens
    llama.save_pretrained(tmp_path / "llama")
    word_tokenizer().save_pretrained(tmp_path / "llama")
    code = cli_main(
        ["convert", str(tmp_path / "llama"), str(tmp_path / "moe"), "--experts", "4", "--top-k", "2",
         "--max-new-tokens", "8", "--block-size", "1"]
    )
    output = capsys.readouterr().out
    assert code == 0 and "PASSED" in output
    reloaded = AutoModelForCausalLM.from_pretrained(tmp_path / "moe").eval()
    assert type(reloaded) is DARMoeForCausalLM and reloaded.config.num_experts_per_tok == 2
    assert reloaded.config.dar_block_size == 1
    assert max_logit_diff(llama, reloaded, tokens()) <= 1e-5

    # Drop-Upcycling: written, but the check says plainly that it is relaxed and the logits differ.
    code = cli_main(
        ["convert", str(tmp_path / "llama"), str(tmp_path / "noisy"), "--experts", "4", "--top-k", "2",
         "--expert-noise", "0.25", "--max-new-tokens", "8"]
    )
    output = capsys.readouterr().out
    assert code == 0 and "RELAXED" in output
    noisy = AutoModelForCausalLM.from_pretrained(tmp_path / "noisy").eval()
    assert max_logit_diff(llama, noisy, tokens()) > 1e-3

    # Bad input: a clear error naming the field, nothing written.
    code = cli_main(["convert", str(tmp_path / "llama"), str(tmp_path / "bad"), "--experts", "2", "--top-k", "3"])
    assert code == 1 and "num_experts_per_tok must be an integer in [1, num_experts=2]" in capsys.readouterr().err
    assert not (tmp_path / "bad").exists()


def test_dar_convert_cli_converts_a_mixtral_folder(tmp_path, capsys):
    torch.manual_seed(0)
    fields = {**TINY, **INIT, "max_position_embeddings": 256}
    mixtral = MixtralForCausalLM(MixtralConfig(num_local_experts=4, num_experts_per_tok=2, **fields)).eval()
    mixtral.save_pretrained(tmp_path / "mixtral")  # per-expert tensors on disk
    word_tokenizer().save_pretrained(tmp_path / "mixtral")
    code = cli_main(
        ["convert", str(tmp_path / "mixtral"), str(tmp_path / "moe"), "--kind", "dar_moe", "--max-new-tokens", "8"]
    )
    assert code == 0 and "PASSED" in capsys.readouterr().out
    reloaded = AutoModelForCausalLM.from_pretrained(tmp_path / "moe").eval()
    assert max_logit_diff(mixtral, reloaded, tokens()) <= 1e-5
