# SPDX-License-Identifier: Apache-2.0
"""Streamed conversion and layer-streamed verification (CPU, tiny models): written folders equal the in-memory
conversion bit for bit, new parameters are `_init_weights`'s, what is verified is what is written (bf16 too), the
checks catch a wrong init, and no path of the converting machine reaches the written folder."""

import json
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file
from transformers import (
    AutoModelForCausalLM,
    LlamaForCausalLM,
    MixtralConfig,
    MixtralForCausalLM,
    Qwen3MoeConfig,
    Qwen3MoeForCausalLM,
)

from dar_transformers import DARConfig, DARForCausalLM, DARMoeForCausalLM
from dar_transformers.conversion import api as conversion_api
from dar_transformers.conversion import plan as conversion_plan
from dar_transformers.conversion.sources import plain_config
from dar_transformers.conversion.verify import norms_in_input_dtype
from dar_transformers.checkpoint_io import GGUFCheckpoint, SafetensorsCheckpoint
from dar_transformers.convert import (
    DAR_NEW_PARAMETERS,
    PromptCheck,
    VerificationError,
    VerificationReport,
    check_keys,
    meta_model,
    new_parameter_values,
    upcycle,
    upcycle_model,
)
from dar_transformers.layerwise import StreamedModel, streamed_logits
from dar_transformers.moe_upcycling import convert_to_dar_moe, upcycle_to_dar_moe
from test_convert import FAST, SHAPE, VOCAB, make_source, make_tokenizer, save_source, spread_weights, write_tiny_gguf


def written_state(folder: Path) -> dict[str, torch.Tensor]:
    index = json.loads((folder / "model.safetensors.index.json").read_text())
    state = {}
    for file in sorted(set(index["weight_map"].values())):
        state.update(load_file(folder / file))
    assert state.keys() == index["weight_map"].keys()
    return state


def assert_equals_in_memory(folder: Path, in_memory: torch.nn.Module) -> None:
    """The written tensors are the in-memory conversion's, bit for bit (tied heads are not written, as save_pretrained)."""
    expected = in_memory.state_dict()
    if in_memory.config.tie_word_embeddings:
        expected.pop("lm_head.weight")
    state = written_state(folder)
    assert state.keys() == expected.keys()
    for name, tensor in expected.items():
        assert state[name].dtype == tensor.dtype and torch.equal(state[name], tensor), name


def max_logit_difference(model_a, model_b, input_ids) -> float:
    with torch.no_grad():
        return (model_a(input_ids).logits.double() - model_b(input_ids).logits.double()).abs().max().item()


IDS = torch.randint(3, VOCAB, (2, 24), generator=torch.Generator().manual_seed(5))


@pytest.mark.parametrize("family, tied", [("llama", False), ("mistral", True), ("qwen2", False), ("qwen3", True)])
def test_streamed_conversion_equals_the_in_memory_one_and_the_source(tmp_path, family, tied):
    source = save_source(tmp_path / "source", family=family, tied=tied, shard="30KB")
    result = upcycle(source, tmp_path / "out", dar_block_size=2, tolerance=1e-5, max_shard_size="30KB", **FAST)
    report = result.report
    assert report.passed and report.method == "layer-streamed" and report.greedy_ran
    assert report.max_abs_logit_difference <= 1e-5 and max(c.max_abs_logit for c in report.checks) > 2
    assert all(check.top1_checked > 0 and check.top1_agreed == check.top1_checked for check in report.checks)
    source_model = AutoModelForCausalLM.from_pretrained(source).eval()
    assert_equals_in_memory(tmp_path / "out", upcycle_model(source_model, dar_block_size=2))
    reloaded = AutoModelForCausalLM.from_pretrained(tmp_path / "out").eval()
    assert max_logit_difference(reloaded, source_model, IDS) <= 1e-5


def test_float64_streamed_conversion_meets_1e_8(tmp_path):
    source = save_source(tmp_path / "source", family="qwen3", tied=False)
    result = upcycle(source, tmp_path / "out", dtype="float64", dar_block_size=1, **FAST)
    assert result.report.dtype == "float64" and result.report.tolerance == 1e-8
    assert result.report.max_abs_logit_difference <= 1e-8 and result.report.passed
    reloaded = AutoModelForCausalLM.from_pretrained(tmp_path / "out", dtype="auto").eval()
    assert reloaded.dtype == torch.float64
    source_model = AutoModelForCausalLM.from_pretrained(source, dtype=torch.float64).eval()
    with norms_in_input_dtype(reloaded, source_model):
        assert max_logit_difference(reloaded, source_model, IDS) <= 1e-8


def tiny_moe_source(kind: str):
    torch.manual_seed(0)
    shape = {**SHAPE, "vocab_size": VOCAB, "num_experts_per_tok": 2}
    if kind == "mixtral":
        model = MixtralForCausalLM(MixtralConfig(**shape, num_local_experts=4))
    else:
        model = Qwen3MoeForCausalLM(Qwen3MoeConfig(**shape, num_experts=4, moe_intermediate_size=24, head_dim=16,
                                                   norm_topk_prob=True))
    return spread_weights(model)


@pytest.mark.parametrize("kind", ["dense_to_moe", "mixtral", "qwen3_moe"])
def test_streamed_moe_conversion_equals_the_in_memory_one(tmp_path, kind):
    if kind == "dense_to_moe":
        model, options = make_source("llama", tied=False), dict(num_experts=4, top_k=2)
    else:
        model, options = tiny_moe_source(kind), {}
    model.save_pretrained(tmp_path / "source", max_shard_size="40KB")  # Mixtral: per-expert tensors on disk
    make_tokenizer().save_pretrained(tmp_path / "source")
    result = upcycle_to_dar_moe(tmp_path / "source", tmp_path / "out", dar_block_size=2, tolerance=1e-5, **options,
                                **FAST)
    assert result.report.passed and result.report.max_abs_logit_difference <= 1e-5
    in_memory = convert_to_dar_moe(model, **options, dar_block_size=2)
    assert_equals_in_memory(tmp_path / "out", in_memory)
    reloaded = AutoModelForCausalLM.from_pretrained(tmp_path / "out").eval()
    assert type(reloaded) is DARMoeForCausalLM
    assert max_logit_difference(reloaded, model, IDS) <= 1e-5


@pytest.mark.parametrize("fields", [dict(dar_block_size=2), dict(dar_block_size=1, dar_num_streams=1),
                                    dict(dar_block_size=4, dar_write_mode="split", dar_gate_delta=0.3)])
def test_new_parameter_values_are_what_init_weights_gives(fields):
    """One source of truth: the streamed values equal a freshly built DARForCausalLM's, bit for bit."""
    config = DARConfig(**SHAPE, vocab_size=VOCAB, **fields)
    torch.manual_seed(123)
    built = DARForCausalLM(config).state_dict()
    names = [name for name in built if any(__import__("re").fullmatch(p, name) for p in DAR_NEW_PARAMETERS)]
    assert names and len(names) == len(set(names))
    values = new_parameter_values(DARForCausalLM, config, names)
    for name in names:
        assert values[name].dtype == torch.float32 and torch.equal(values[name], built[name]), name


def test_streamed_verification_catches_a_wrong_dar_init_and_writes_nothing(tmp_path, monkeypatch):
    source = save_source(tmp_path / "source")
    right = conversion_plan.new_parameter_values

    def wrong(model_class, config, names):  # negative control: the read gates off their exact init alpha = 1/2
        values = right(model_class, config, names)
        return {name: value + 0.3 if name.endswith("read_gate.logit") else value for name, value in values.items()}

    monkeypatch.setattr(conversion_plan, "new_parameter_values", wrong)
    before = sorted(p.name for p in tmp_path.iterdir())
    with pytest.raises(VerificationError, match="nothing was written") as caught:
        upcycle(source, tmp_path / "out", dar_block_size=2, **FAST)
    assert caught.value.report.max_abs_logit_difference > 1e-3
    assert sorted(p.name for p in tmp_path.iterdir()) == before


def save_bf16_source(folder: Path, family: str = "llama") -> Path:
    model = make_source(family, tied=False).to(torch.bfloat16)
    model.save_pretrained(folder)
    make_tokenizer().save_pretrained(folder)
    return folder


def test_a_bf16_source_verifies_at_the_float32_bar_and_stays_bf16(tmp_path):
    source = save_bf16_source(tmp_path / "source")
    result = upcycle(source, tmp_path / "out", dar_block_size=2, **FAST)  # dtype "auto", no tolerance
    report = result.report
    assert report.passed and not report.relaxed and report.tolerance == 2e-4 and report.dtype == "float32"
    assert report.storage_dtype == "bfloat16" and "from bfloat16 weights" in report.table()
    assert report.max_abs_logit_difference <= 2e-4
    assert json.loads((tmp_path / "out" / "config.json").read_text())["dtype"] == "bfloat16"
    source_bytes = sum(p.stat().st_size for p in source.glob("*.safetensors"))
    written_bytes = sum(p.stat().st_size for p in (tmp_path / "out").glob("*.safetensors"))
    assert written_bytes < 1.2 * source_bytes  # bf16 stays bf16 (plus the small float32 DAR shard)
    reloaded = AutoModelForCausalLM.from_pretrained(tmp_path / "out", dtype="auto")
    assert reloaded.model.embed_tokens.weight.dtype == torch.bfloat16
    assert reloaded.model.layers[0].attn_residual.write_gate.logit.dtype == torch.float32


def test_the_model_verified_is_the_model_written(tmp_path):
    """The streamed check reads the written folder: its DAR logits are those of `from_pretrained(out)` in float32,
    whose rotary `inv_freq` and other buffers are what `from_pretrained(out, dtype="auto")` builds (float32)."""
    source = save_bf16_source(tmp_path / "source")
    upcycle(source, tmp_path / "out", dar_block_size=2, **FAST)
    out = tmp_path / "out"
    source_model = AutoModelForCausalLM.from_pretrained(source, dtype=torch.float32).eval()
    reloaded32 = AutoModelForCausalLM.from_pretrained(out, dtype=torch.float32).eval()
    reloaded_auto = AutoModelForCausalLM.from_pretrained(out, dtype="auto").eval()
    for (name, buffer32), (_, buffer_auto) in zip(reloaded32.named_buffers(), reloaded_auto.named_buffers()):
        assert buffer_auto.dtype == buffer32.dtype == torch.float32 and torch.equal(buffer_auto, buffer32), name
    written = SafetensorsCheckpoint(out)
    sources = SafetensorsCheckpoint(source)
    streamed_source, streamed_target = streamed_logits(
        StreamedModel(meta_model(LlamaForCausalLM, source_model.config), sources),
        StreamedModel(meta_model(DARForCausalLM, reloaded32.config), written),
        [IDS[:1]], torch.float32,
    )
    with torch.no_grad():
        assert torch.allclose(streamed_target[0], reloaded32(IDS[:1]).logits, atol=1e-6, rtol=0)
        assert torch.allclose(streamed_source[0], source_model(IDS[:1]).logits, atol=1e-6, rtol=0)
    # The in-memory path builds the model as from_pretrained does: no bf16 rotary frequencies (the old bug).
    in_memory = upcycle_model(make_source("llama").to(torch.bfloat16), dar_block_size=2)
    assert in_memory.model.rotary_emb.inv_freq.dtype == torch.float32


OFFLOADED_HEAD = {"model.embed_tokens": "cpu", "model.layers": "cpu", "model.final_readout": "cpu", "model.norm": "disk",
                  "model.rotary_emb": "cpu", "lm_head": "disk"}
OFFLOADED_LAYERS = {**OFFLOADED_HEAD, "model.layers": "disk"}


@pytest.mark.parametrize("device_map,implementation", [
    ("auto", "fast"),  # max_memory fits everything here: a plain CPU placement through accelerate
    (OFFLOADED_HEAD, "fast"),
    # Whole decoder layers on disk: accelerate loads a module's weights only around its own forward; the fast
    # backend derives gates and queries outside those forwards and onloads them itself (`_onloaded`).
    (OFFLOADED_LAYERS, "fast"),
    (OFFLOADED_LAYERS, "reference"),
])
def test_offloaded_loading_generates_the_tokens_of_a_plain_load(tmp_path, device_map, implementation):
    source = save_source(tmp_path / "source", tied=False)
    upcycle(source, tmp_path / "out", dar_block_size=2, tolerance=1e-5, **FAST)
    plain = AutoModelForCausalLM.from_pretrained(tmp_path / "out").eval()
    offloaded = AutoModelForCausalLM.from_pretrained(
        tmp_path / "out", dar_implementation=implementation, device_map=device_map, max_memory={"cpu": "10MB"},
        offload_folder=tmp_path / "offload",
    ).eval()
    if device_map != "auto":
        assert "disk" in set(offloaded.hf_device_map.values())  # part of the model really lives on disk
    ids = IDS[:1, :10]
    kwargs = dict(max_new_tokens=8, do_sample=False, attention_mask=torch.ones_like(ids))
    assert torch.equal(plain.generate(ids, **kwargs), offloaded.generate(ids, **kwargs))


def test_no_absolute_path_of_the_converting_machine_reaches_the_written_folder(tmp_path):
    source = save_source(tmp_path / "source")
    (tmp_path / "gguf").mkdir()
    gguf = write_tiny_gguf(tmp_path / "gguf" / "tiny.gguf", make_source("llama"), make_tokenizer())
    for name, origin in (("from-folder", source), ("from-gguf", gguf)):
        upcycle(origin, tmp_path / name, dar_block_size=2, tolerance=1e-5, **FAST)
        for path in (tmp_path / name).iterdir():
            if path.suffix in (".json", ".md", ".jinja", ".py"):
                text = path.read_text()
                assert str(tmp_path) not in text and str(Path.home()) + "/" not in text, path.name
        card = (tmp_path / name / "README.md").read_text()
        assert (origin.name if origin.is_dir() else origin.name) in card


def test_the_gguf_source_is_read_tensor_by_tensor_as_transformers_loads_it(tmp_path):
    from transformers.modeling_gguf_pytorch_utils import load_gguf_checkpoint

    model = make_source("llama", tied=False)
    gguf = write_tiny_gguf(tmp_path / "tiny.gguf", model, make_tokenizer())
    config = AutoModelForCausalLM.from_pretrained(tmp_path, gguf_file="tiny.gguf").config
    meta = meta_model(LlamaForCausalLM, plain_config(config))
    streamed = GGUFCheckpoint(gguf, config, meta)
    whole = load_gguf_checkpoint(str(gguf), return_tensors=True, model_to_load=meta)["tensors"]
    assert streamed.infos().keys() == whole.keys()
    for name, tensor in whole.items():
        assert torch.equal(streamed.read(name), tensor), name
    assert torch.equal(streamed.read_rows("model.embed_tokens.weight", torch.tensor([7, 3, 7])),
                       whole["model.embed_tokens.weight"][[7, 3, 7]])


# ---------------------------------------------------------------------------------------------------------------
# Verdicts that must fail when broken.


def report_with(max_difference: float, greedy: bool | None, agreed: int = 5) -> VerificationReport:
    check = PromptCheck("p", 5, 3.0, max_difference, 5, agreed, greedy, [1, 2], [1, 2] if greedy else [1, 3])
    return VerificationReport("float32", 2e-4, 2e-4, 2, [check])


def test_logits_within_tolerance_but_different_greedy_tokens_do_not_pass_and_write_nothing(tmp_path, monkeypatch):
    assert report_with(1e-6, True).passed
    assert not report_with(1e-6, False).passed  # greedy continuations differ
    assert not report_with(1e-6, None, agreed=4).passed  # a teacher-forced top-1 disagreement
    assert not report_with(1e-3, True).passed
    source = save_source(tmp_path / "source")
    monkeypatch.setattr(conversion_api, "verify_written", lambda *args, **kwargs: report_with(1e-6, False))
    before = sorted(p.name for p in tmp_path.iterdir())
    with pytest.raises(VerificationError, match="nothing was written"):
        upcycle(source, tmp_path / "out", **FAST)
    assert sorted(p.name for p in tmp_path.iterdir()) == before


@pytest.mark.parametrize("tolerance", [0, -1e-5, 0.0])
def test_a_tolerance_that_is_not_positive_is_refused_before_any_work(tmp_path, tolerance):
    with pytest.raises(ValueError, match="tolerance must be a positive number"):
        upcycle(tmp_path / "does-not-exist", tmp_path / "out", tolerance=tolerance)
    assert not (tmp_path / "out").exists()


def test_an_unexpected_key_reaching_check_keys_raises(tmp_path):
    check_keys(["model.layers.0.attn_residual.read_gate.logit"], [], DAR_NEW_PARAMETERS)  # new: fine
    with pytest.raises(ValueError, match=r"unexpected \['model\.layers\.0\.extra\.weight'\]"):
        check_keys([], ["model.layers.0.extra.weight"], DAR_NEW_PARAMETERS)
    with pytest.raises(ValueError, match=r"missing \['model\.norm\.weight'\]"):
        check_keys(["model.norm.weight"], [], DAR_NEW_PARAMETERS)
    source = save_source(tmp_path / "source")
    state = load_file(source / "model.safetensors")
    state["model.layers.0.mlp.extra_proj.weight"] = torch.zeros(2, 2)
    save_file(state, source / "model.safetensors", metadata={"format": "pt"})
    before = sorted(p.name for p in tmp_path.iterdir())
    with pytest.raises(ValueError, match=r"model\.layers\.0\.mlp\.extra_proj\.weight"):
        upcycle(source, tmp_path / "out", **FAST)
    assert sorted(p.name for p in tmp_path.iterdir()) == before
