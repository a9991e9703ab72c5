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
    AutoModelForQuestionAnswering,
    AutoModelForSequenceClassification,
    AutoModelForTokenClassification,
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
    Qwen3MoeForQuestionAnswering,
    Qwen3MoeForSequenceClassification,
    Qwen3MoeForTokenClassification,
    PreTrainedTokenizerFast,
    Trainer,
    TrainingArguments,
)
from transformers.integrations.moe import ExpertsInterface
from transformers.modeling_outputs import MoeCausalLMOutputWithPast, MoeModelOutputWithPast
from transformers.models.qwen3_moe.modeling_qwen3_moe import (
    Qwen3MoeExperts,
    Qwen3MoeTopKRouter,
    load_balancing_loss_func,
)

from conftest import TINY_LLAMA_FIELDS
from test_convert import VOCAB as BPE_VOCAB
from test_convert import make_tokenizer
import dar_transformers
from dar_transformers import (
    DARConfig,
    DARModel,
    DARMoeConfig,
    DARMoeForCausalLM,
    DARMoeForQuestionAnswering,
    DARMoeForSequenceClassification,
    DARMoeForTokenClassification,
    DARMoeModel,
)
from dar_transformers.modeling_dar_moe import DARMoeSparseMoeBlock, DARMoeTopKRouter
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


def test_moe_modules_are_qwen3_moes_and_fast_experts_survive_a_dense_model_built_first():
    """The experts are transformers' own Qwen3MoeExperts (no re-decorated copy), and the fast-kernel decision does not
    depend on what was built before: a dense DARModel (whose answer is False) first, then DAR-MoE."""
    DARModel(DARConfig(**TINY))
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


def test_aux_loss_leaves_out_left_padding_as_transformers_load_balancing_loss_does():
    model = tiny_dar_moe(**INIT, router_aux_loss_coef=0.25)
    attention_mask = torch.ones(3, 10, dtype=torch.long)
    attention_mask[1, :4] = 0  # left padding
    attention_mask[2, :7] = 0
    input_ids = tokens(batch=3, length=10).masked_fill(attention_mask == 0, 0)
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


# ------------------------------------------------------------------------------------------------------ task heads

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
    input_ids = tokens(batch=3, length=length).masked_fill(attention_mask == 0, 0)
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
        **TINY, **INIT, num_experts=4, num_experts_per_tok=2, moe_intermediate_size=24, head_dim=8,
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
    perturb_dar_parameters(head)
    input_ids, attention_mask, position_ids = left_padded_batch()
    with torch.no_grad():
        pooled = head(input_ids, attention_mask=attention_mask, position_ids=position_ids).logits  # [B, 3]
        hidden = head.model(input_ids, attention_mask=attention_mask, position_ids=position_ids).last_hidden_state
        assert torch.equal(pooled, head.score(hidden[:, -1]))  # left padding: the last position is real
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


def test_task_heads_round_trip_and_load_with_remote_code_without_the_package(tmp_path):
    input_ids = tokens()
    torch.save(input_ids, tmp_path / "input_ids.pt")
    causal_lm = tiny_dar_moe(**INIT)
    perturb_dar_parameters(causal_lm)
    causal_lm.save_pretrained(tmp_path / "causal_lm")
    folders, expected = [], {}
    for kind, (auto_class, head_class, _, _) in HEADS.items():
        torch.manual_seed(0)
        head = head_class(DARMoeConfig(**TINY_MOE, **INIT, num_labels=3, shared_expert_intermediate_size=16)).eval()
        perturb_dar_parameters(head)
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

    remote_logits = load_heads_with_remote_code(tmp_path, folders)
    for kind in HEADS:
        assert torch.equal(remote_logits[str(tmp_path / kind)], expected[kind]), kind


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
    with pytest.raises(ValueError, match="Cannot convert model_type 'gpt2' to DAR-MoE"):
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
    # The converter's default prompts are about 350 tokens of this BPE tokenizer, each a decided next token (a word
    # tokenizer would map them all to <unk>, and a check that compares nothing does not pass).
    llama = tiny_llama(max_position_embeddings=512, vocab_size=BPE_VOCAB)
    llama.save_pretrained(tmp_path / "llama")
    make_tokenizer().save_pretrained(tmp_path / "llama")
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
    card = (tmp_path / "moe" / "README.md").read_text()
    assert "| experts E (sparse layers) | 4 (2 of 2 layers) |" in card and "| experts per token (top-k) | 2 |" in card

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
    fields = {**TINY, **INIT, "max_position_embeddings": 512, "vocab_size": BPE_VOCAB}
    mixtral = MixtralForCausalLM(MixtralConfig(num_local_experts=4, num_experts_per_tok=2, **fields)).eval()
    mixtral.save_pretrained(tmp_path / "mixtral")  # per-expert tensors on disk
    make_tokenizer().save_pretrained(tmp_path / "mixtral")
    code = cli_main(
        ["convert", str(tmp_path / "mixtral"), str(tmp_path / "moe"), "--kind", "dar_moe", "--max-new-tokens", "8"]
    )
    assert code == 0 and "PASSED" in capsys.readouterr().out
    reloaded = AutoModelForCausalLM.from_pretrained(tmp_path / "moe").eval()
    assert max_logit_diff(mixtral, reloaded, tokens()) <= 1e-5
