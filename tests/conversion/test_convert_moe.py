# SPDX-License-Identifier: Apache-2.0
"""Conversion to DAR-MoE (CPU, tiny models): sparse upcycling of dense models and Mixtral/Qwen-MoE checkpoints
convert exactly (1e-5 in float32, 1e-8 in float64), negative controls drift, Drop-Upcycling says it is not exact,
and the streamed, written conversion equals the in-memory one."""

import json
import re
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file
from transformers import (
    AutoModelForCausalLM,
    LlamaConfig,
    LlamaForCausalLM,
    MixtralConfig,
    MixtralForCausalLM,
    Qwen2MoeConfig,
    Qwen2MoeForCausalLM,
    Qwen3Config,
    Qwen3ForCausalLM,
    Qwen3MoeConfig,
    Qwen3MoeForCausalLM,
)

from dar_transformers import TRANSFORMERS_REQUIREMENT, DARMoeConfig, DARMoeForCausalLM
from dar_transformers.cli import main as cli_main
from dar_transformers.conversion import convert_to_dar_moe, upcycle_to_dar_moe, verify_conversion

from conftest import (
    FAST,
    IDS,
    INIT,
    SHAPE,
    TINY_LLAMA_FIELDS,
    VOCAB,
    assert_equals_in_memory,
    dense_llama,
    make_source,
    make_tokenizer,
    max_logit_difference,
    random_input_ids,
    spread_weights,
    word_tokenizer,
)


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


def test_sparse_upcycling_of_a_dense_llama_is_exact():
    llama = dense_llama()
    moe = convert_to_dar_moe(llama, num_experts=4, top_k=2)
    dense_mlp = llama.model.layers[1].mlp
    experts = moe.model.layers[1].mlp.experts
    for expert in range(4):  # every expert is the dense MLP, gate rows then up rows
        gate_up = torch.cat([dense_mlp.gate_proj.weight, dense_mlp.up_proj.weight])
        assert torch.equal(experts.gate_up_proj[expert], gate_up)
        assert torch.equal(experts.down_proj[expert], dense_mlp.down_proj.weight)
    input_ids = random_input_ids(length=10)
    report = verify_conversion(llama, moe, [("random", input_ids[:1])], max_new_tokens=8, progress=False)
    assert report.max_abs_logit_difference <= 1e-5 and report.greedy_identical
    with torch.no_grad():
        assert llama(input_ids).logits.abs().max() > 1.0
        router_logits = moe(input_ids, output_router_logits=True).router_logits
    assert all(logits.std() > 0.1 for logits in router_logits)  # a random router: the routing is not degenerate

    llama64 = dense_llama().double()
    moe64 = convert_to_dar_moe(llama64, num_experts=4, top_k=2)
    assert moe64.dtype == torch.float64 and moe64.config._experts_implementation == "batched_mm"
    assert max_logit_difference(llama64, moe64, input_ids) <= 1e-8


def test_sparse_upcycling_composes_with_full_dar_and_other_families():
    input_ids = random_input_ids(length=10)
    llama = dense_llama()
    assert max_logit_difference(llama, convert_to_dar_moe(llama, num_experts=3, top_k=3, dar_block_size=1), input_ids) <= 1e-5
    torch.manual_seed(0)
    qwen3 = Qwen3ForCausalLM(Qwen3Config(**TINY_LLAMA_FIELDS, **INIT, head_dim=8)).eval()
    assert max_logit_difference(qwen3, convert_to_dar_moe(qwen3, num_experts=4, top_k=1), input_ids) <= 1e-5


def test_upcycling_negative_controls_drift():
    """The checks can fail: unnormalised top-k weights and Drop-Upcycling noise both change the function."""
    llama = dense_llama()
    input_ids = random_input_ids(length=10)
    unnormalised = convert_to_dar_moe(llama, num_experts=4, top_k=2)
    unnormalised.config.norm_topk_prob = False
    for layer in unnormalised.model.layers:
        layer.mlp.gate.norm_topk_prob = False  # output becomes (p_1 + p_2) MLP(x)
    assert max_logit_difference(llama, unnormalised, input_ids) > 1e-2


def test_expert_noise_breaks_symmetry_and_says_it_is_not_exact(caplog):
    llama = dense_llama()
    with caplog.at_level("WARNING"):
        noisy = convert_to_dar_moe(llama, num_experts=4, top_k=2, expert_noise=0.25, seed=3)
    assert "NOT function-preserving" in caplog.text
    experts = noisy.model.layers[0].mlp.experts.gate_up_proj.detach()
    dense = torch.cat([llama.model.layers[0].mlp.gate_proj.weight, llama.model.layers[0].mlp.up_proj.weight])
    changed_rows = (experts != dense).any(-1)  # [E, 2I]
    assert changed_rows.sum(-1).tolist() == [2 * 16] * 4  # 25% of the 64 hidden units, in gate and up rows
    assert not torch.equal(changed_rows[0], changed_rows[1])  # different units per expert: symmetry broken
    assert max_logit_difference(llama, noisy, random_input_ids(length=10)) > 1e-3
    again = convert_to_dar_moe(llama, num_experts=4, top_k=2, expert_noise=0.25, seed=3)
    assert torch.equal(again.model.layers[0].mlp.experts.gate_up_proj, noisy.model.layers[0].mlp.experts.gate_up_proj)


@pytest.mark.parametrize(
    "source_kind",
    ["mixtral", "mixtral_sliding", "qwen3_moe", "qwen3_moe_unnormalised_dense_first", "qwen2_moe_shared_expert"],
)
def test_moe_checkpoints_convert_exactly(source_kind):
    torch.manual_seed(0)
    moe = dict(num_experts_per_tok=2, **TINY_LLAMA_FIELDS, **INIT)
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
    input_ids = random_input_ids(length=12)
    report = verify_conversion(source, converted, [("random", input_ids[:1])], max_new_tokens=8, progress=False)
    assert report.max_abs_logit_difference <= 1e-5 and report.greedy_identical, report.table()
    assert max_logit_difference(source, converted, input_ids) <= 1e-5  # the whole batch too
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
    assert max_logit_difference(source, converted, input_ids) > 1e-3


PROMPTS = [" ".join(f"w{3 + (7 * index) % 90}" for index in range(24)), "w5 w9 w11 w60 w61 w62 w3 w4"]


@pytest.mark.parametrize("dtype, tolerance", [("float32", 1e-5), ("float64", 1e-8)])
def test_upcycle_to_dar_moe_verifies_and_writes_a_loadable_repo(tmp_path, dtype, tolerance):
    llama = dense_llama()
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
    assert max_logit_difference(llama, reloaded, random_input_ids(length=10)) <= 1e-5
    card = (tmp_path / "moe" / "README.md").read_text()
    assert "DAR-MoE" in card
    # How to load it: its own model type and code files, and the transformers releases the package supports (the
    # card said "dar" and configuration_dar.py, and required transformers>=<this machine's release>,<5.24).
    assert 'registers model_type "dar_moe"' in card and "`configuration_dar_moe.py`, `modeling_dar_moe.py`" in card
    assert f"Requires `{TRANSFORMERS_REQUIREMENT}` and torch" in card
    assert all((tmp_path / "moe" / name).is_file() for name in ("configuration_dar_moe.py", "modeling_dar_moe.py"))


def test_a_bf16_upcycle_writes_its_new_routers_as_it_loads_them(tmp_path):
    """Sparse upcycling of a bf16 model: its new routers were written float32 (DAR's new parameters' dtype) though
    they are no DAR parameters and load as bf16, so the loaded model saved again changed them. They are written in
    the checkpoint's dtype (DAR's own parameters stay float32): loading and saving the folder changes no tensor."""
    dense_llama().save_pretrained(tmp_path / "float32")
    # as from_pretrained(dtype=bfloat16) loads it: rotary frequencies float32 as computed (`.to(torch.bfloat16)`
    # would round them, and the written model, checked against this object, then computes other rotations)
    llama = LlamaForCausalLM.from_pretrained(tmp_path / "float32", dtype=torch.bfloat16).eval()
    result = upcycle_to_dar_moe(llama, tmp_path / "moe", tokenizer=word_tokenizer(), num_experts=4, top_k=2,
                                prompts=PROMPTS, max_new_tokens=0, progress=False, dar_block_size=2)
    assert result.report.passed
    written = {}
    for file in sorted((tmp_path / "moe").glob("*.safetensors")):
        written.update(load_file(file))
    assert all(written[name].dtype == torch.bfloat16 for name in written if name.endswith("mlp.gate.weight"))
    assert all(tensor.dtype == torch.float32 for name, tensor in written.items() if "_residual." in name)
    reloaded = AutoModelForCausalLM.from_pretrained(tmp_path / "moe", dtype="auto")
    reloaded.save_pretrained(tmp_path / "again")
    again = {}
    for file in sorted((tmp_path / "again").glob("*.safetensors")):
        again.update(load_file(file))
    assert again.keys() == written.keys()
    for name, tensor in written.items():
        assert again[name].dtype == tensor.dtype and torch.equal(again[name], tensor), name


def test_the_transformers_requirement_quoted_by_cards_is_the_packages():
    setup = (Path(__file__).parents[2] / "setup.cfg").read_text()
    assert f"\n    {TRANSFORMERS_REQUIREMENT}\n" in setup


def test_dar_convert_cli_with_experts_and_top_k(tmp_path, capsys):
    # The converter's default prompts are about 350 tokens of this BPE tokenizer, each a decided next token (a word
    # tokenizer would map them all to <unk>, and a check that compares nothing does not pass).
    llama = dense_llama(max_position_embeddings=512, vocab_size=VOCAB)
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
    assert max_logit_difference(llama, reloaded, random_input_ids(length=10)) <= 1e-5
    card = (tmp_path / "moe" / "README.md").read_text()
    assert "| experts E (sparse layers) | 4 (2 of 2 layers) |" in card and "| experts per token (top-k) | 2 |" in card
    # What the conversion made of a dense source's MLPs, and the title's kind (the card named only the DAR
    # parameters as new, and its title said "+ DAR": a helper's audit of the card).
    assert "# llama + DAR-MoE" in card
    assert ("Each MLP of the sparse layers became 4 identical experts behind a new, randomly initialised router, so "
            "that whichever experts it picks compute the source's MLP.") in " ".join(card.split())

    # Drop-Upcycling: written, but the check says plainly that it is relaxed and the logits differ.
    code = cli_main(
        ["convert", str(tmp_path / "llama"), str(tmp_path / "noisy"), "--experts", "4", "--top-k", "2",
         "--expert-noise", "0.25", "--max-new-tokens", "8"]
    )
    output = capsys.readouterr().out
    assert code == 0 and "RELAXED" in output
    noisy = AutoModelForCausalLM.from_pretrained(tmp_path / "noisy").eval()
    assert max_logit_difference(llama, noisy, random_input_ids(length=10)) > 1e-3

    # Bad input: a clear error naming the field, nothing written.
    code = cli_main(["convert", str(tmp_path / "llama"), str(tmp_path / "bad"), "--experts", "2", "--top-k", "3"])
    assert code == 1 and "num_experts_per_tok must be an integer in [1, num_experts=2]" in capsys.readouterr().err
    assert not (tmp_path / "bad").exists()


@pytest.mark.parametrize("family", ["mixtral", "qwen2_moe"])
def test_an_moe_source_that_records_router_logits_converts_and_keeps_the_setting(tmp_path, capsys, family):
    """`output_router_logits: true` (its training adds router_aux_loss_coef x the load-balancing loss): the default
    run died with a traceback in transformers' load-balancing loss while the source generated its greedy check, and
    with --max-new-tokens 0 it passed and wrote output_router_logits false. Now it converts with its greedy check,
    and the DAR-MoE config keeps the setting (and the coefficient)."""
    torch.manual_seed(0)
    fields = {**TINY_LLAMA_FIELDS, **INIT, "max_position_embeddings": 512, "vocab_size": VOCAB,
              "num_experts_per_tok": 2, "output_router_logits": True, "router_aux_loss_coef": 0.1}
    source = (MixtralForCausalLM(MixtralConfig(num_local_experts=4, **fields)) if family == "mixtral" else
              Qwen2MoeForCausalLM(Qwen2MoeConfig(num_experts=4, moe_intermediate_size=24, **fields))).eval()
    source.save_pretrained(tmp_path / "source")
    make_tokenizer().save_pretrained(tmp_path / "source")
    code = cli_main(["convert", str(tmp_path / "source"), str(tmp_path / "moe"), "--kind", "dar_moe",
                     "--max-new-tokens", "4"])
    assert code == 0 and "PASSED" in capsys.readouterr().out
    config = json.loads((tmp_path / "moe" / "config.json").read_text())
    assert config["output_router_logits"] is True and config["router_aux_loss_coef"] == 0.1


def test_a_float64_check_of_an_moe_source_says_why_it_cannot_pass(tmp_path, capsys):
    """A Mixtral source verified in float64: its router renormalises the top-k weights in float32, DAR-MoE's again in
    float64 (for exact sparse upcycling), so the check fails by about 1e-7 with no word of why. The refusal says so
    and points to float32, where the same conversion passes."""
    torch.manual_seed(0)
    fields = {**TINY_LLAMA_FIELDS, **INIT, "max_position_embeddings": 512, "vocab_size": VOCAB}
    MixtralForCausalLM(MixtralConfig(num_local_experts=4, num_experts_per_tok=2, **fields)).save_pretrained(
        tmp_path / "mixtral")
    make_tokenizer().save_pretrained(tmp_path / "mixtral")
    code = cli_main(["convert", str(tmp_path / "mixtral"), str(tmp_path / "moe"), "--kind", "dar_moe",
                     "--max-new-tokens", "0", "--verify-dtype", "float64"])
    assert code == 2 and not (tmp_path / "moe").exists()  # 2: verification failed, nothing written
    assert ("The mixtral source's router renormalises its top-k weights in float32 even in a float64 model, and "
            "DAR-MoE's renormalises them again in float64" in capsys.readouterr().err)
    code = cli_main(["convert", str(tmp_path / "mixtral"), str(tmp_path / "moe"), "--kind", "dar_moe",
                     "--max-new-tokens", "0"])
    assert code == 0 and "PASSED" in capsys.readouterr().out


def test_dar_convert_cli_converts_a_mixtral_folder(tmp_path, capsys):
    torch.manual_seed(0)
    fields = {**TINY_LLAMA_FIELDS, **INIT, "max_position_embeddings": 512, "vocab_size": VOCAB}
    mixtral = MixtralForCausalLM(MixtralConfig(num_local_experts=4, num_experts_per_tok=2, **fields)).eval()
    mixtral.save_pretrained(tmp_path / "mixtral")  # per-expert tensors on disk
    make_tokenizer().save_pretrained(tmp_path / "mixtral")
    code = cli_main(
        ["convert", str(tmp_path / "mixtral"), str(tmp_path / "moe"), "--kind", "dar_moe", "--max-new-tokens", "8"]
    )
    assert code == 0 and "PASSED" in capsys.readouterr().out
    reloaded = AutoModelForCausalLM.from_pretrained(tmp_path / "moe").eval()
    assert max_logit_difference(mixtral, reloaded, random_input_ids(length=10)) <= 1e-5
    card = (tmp_path / "moe" / "README.md").read_text()
    assert "# mixtral + DAR-MoE" in card and "identical experts" not in card  # its experts and router are the source's


@pytest.mark.parametrize("source_kind, kind", [("mixtral router jitter", "dar_moe"), ("llama attention dropout", "dar"),
                                               ("llama attention dropout", "dar_moe")])
def test_training_only_noise_of_a_source_does_not_fail_its_verification(tmp_path, capsys, caplog, source_kind, kind):
    """The layer-streamed check ran both models in training mode (`meta_model` built them so): Mixtral's router jitter
    and any attention dropout made a valid conversion FAILED (max logit difference about 2-4), as if not exact. The
    jitter, which DAR-MoE does not carry, is said once (it was said per config built: twice), and in the card."""
    torch.manual_seed(0)
    fields = {**TINY_LLAMA_FIELDS, **INIT, "max_position_embeddings": 512, "vocab_size": VOCAB}
    source = (MixtralForCausalLM(MixtralConfig(num_local_experts=4, num_experts_per_tok=2, router_jitter_noise=0.5,
                                               **fields)) if source_kind.startswith("mixtral") else
              LlamaForCausalLM(LlamaConfig(attention_dropout=0.5, **fields))).eval()
    source.save_pretrained(tmp_path / "source")
    make_tokenizer().save_pretrained(tmp_path / "source")
    experts = ["--experts", "4", "--top-k", "2"] if kind == "dar_moe" and source_kind.startswith("llama") else []
    code = cli_main(["convert", str(tmp_path / "source"), str(tmp_path / "out"), "--kind", kind,
                     "--max-new-tokens", "4", *experts])
    assert code == 0 and "PASSED" in capsys.readouterr().out
    assert caplog.text.count("router_jitter_noise (training only) is dropped") == int(source_kind.startswith("mixtral"))
    # ... and the card, which outlives the log, says it too (the warning alone said it before)
    card = (tmp_path / "out" / "README.md").read_text()
    assert ("its router jitter (`router_jitter_noise=0.5`" in card) == source_kind.startswith("mixtral")
    reloaded = AutoModelForCausalLM.from_pretrained(tmp_path / "out").eval()
    assert max_logit_difference(source, reloaded, random_input_ids(length=10)) <= 1e-5


def test_static_cache_generation_with_router_logits_equals_the_dynamic_cache(tmp_path):
    """`output_router_logits` (which converted Mixtral/Qwen-MoE folders keep) with a left-padded batch and
    `cache_implementation="static"`: the prepared 4-D mask went into the load-balancing loss and generation died
    (transformers' own MoE models do too); it is left out of the loss, as it names no padded token per row."""
    torch.manual_seed(0)
    model = DARMoeForCausalLM(DARMoeConfig(**SHAPE, vocab_size=VOCAB, num_experts=4, num_experts_per_tok=2,
                                           output_router_logits=True)).eval()
    input_ids = torch.tensor([[0, 0, 5, 6, 7], [8, 9, 10, 11, 12]])
    attention_mask = torch.tensor([[0, 0, 1, 1, 1], [1, 1, 1, 1, 1]])
    settings = dict(max_new_tokens=4, do_sample=False, pad_token_id=0)
    dynamic = model.generate(input_ids, attention_mask=attention_mask, **settings)
    static = model.generate(input_ids, attention_mask=attention_mask, cache_implementation="static", **settings)
    assert torch.equal(static, dynamic)


def test_a_float64_dar_moe_folder_loads_with_experts_that_run_float64(tmp_path):
    """A float64 conversion (its check passed at 5e-15) loaded by `from_pretrained` took transformers' default
    `grouped_mm` experts, which take no float64: its first forward failed. A float64 model built without a request
    takes `batched_mm`; a request is kept."""
    source = make_source()
    upcycle_to_dar_moe(source, tmp_path / "moe", num_experts=4, top_k=2, dtype=torch.float64, max_new_tokens=0,
                       tokenizer=make_tokenizer(), progress=False)
    reloaded = AutoModelForCausalLM.from_pretrained(tmp_path / "moe").eval()
    assert reloaded.dtype == torch.float64 and reloaded.config._experts_implementation == "batched_mm"
    assert max_logit_difference(source.double(), reloaded, random_input_ids(length=10)) <= 1e-10
    requested = AutoModelForCausalLM.from_pretrained(tmp_path / "moe", experts_implementation="eager")
    assert requested.config._experts_implementation == "eager"


def test_a_float64_check_of_an_in_memory_moe_source_leaves_its_experts_kernel_alone(tmp_path):
    """The float64 check runs experts on batched_mm (grouped_mm takes no float64); an in-memory float64 MoE source
    in eval mode was switched in place (its config's experts implementation changed under the caller). The check
    runs a copy (`cast_model`)."""
    from dar_transformers.conversion import upcycle

    source = tiny_moe_source("qwen3_moe").double().eval()
    before = source.config._experts_implementation
    result = upcycle(source, tokenizer=make_tokenizer(), dar_block_size=2, kind="dar_moe", tolerance=1e-6,
                     **FAST)  # its router renormalises in float32 (see above): 1e-7 apart
    assert result.report is not None and result.report.dtype == "float64"
    assert source.config._experts_implementation == before


@pytest.mark.parametrize("window, layer_types, converts", [
    (8, ["full_attention"] * 3, False),  # Qwen3-MoE never reads layer types: every layer slides
    (None, None, True),  # use_sliding_window without a window: transformers attends fully
], ids=["window_beside_full_layer_types", "flag_without_a_window"])
def test_a_qwen3_moe_source_is_decided_sliding_by_what_its_model_reads(tmp_path, capsys, window, layer_types,
                                                                       converts):
    """Qwen3-MoE applies `sliding_window` in every layer whenever `use_sliding_window` is true (its config keeps the
    window only then) and has no layer types. The check read `layer_types` first: a stray all-full list beside a window
    of 8 passed the window by, and the conversion FAILED (4.7 logits; PASSED over full attention where the window
    exceeds the prompts), while the flag without a window, which transformers runs with full attention, was refused."""
    source = tiny_moe_source("qwen3_moe")
    source.save_pretrained(tmp_path / "source")
    make_tokenizer().save_pretrained(tmp_path / "source")
    fields = json.loads((tmp_path / "source" / "config.json").read_text())
    fields.update(use_sliding_window=True, sliding_window=window)
    if layer_types:
        fields["layer_types"] = layer_types
    (tmp_path / "source" / "config.json").write_text(json.dumps(fields))
    assert AutoModelForCausalLM.from_pretrained(tmp_path / "source").config.sliding_window == window
    code = cli_main(["convert", str(tmp_path / "source"), str(tmp_path / "moe"), "--max-new-tokens", "2",
                     "--tolerance", "1e-5"])
    err = capsys.readouterr().err
    if converts:
        assert code == 0, err[-2000:]
        assert json.loads((tmp_path / "moe" / "config.json").read_text()).get("sliding_window") is None
    else:
        assert code == 1 and "sliding-window attention in every layer" in err and "sliding_window=8" in err
        assert not (tmp_path / "moe").exists()


@pytest.mark.parametrize("fields, message", [
    ({"num_experts_per_tok": 6}, r"config\.json: the qwen3_moe source's num_experts_per_tok=6 is not a setting DAR-MoE "
                                 r"runs: .*\[1, num_experts=4\], got 6"),
    ({"router_aux_loss_coef": -1.0}, r"config\.json: the qwen3_moe source's router_aux_loss_coef=-1\.0 is not a "
                                     r"setting DAR-MoE runs"),
    ({"mlp_only_layers": [0, 1, 2]}, r"config\.json: the qwen3_moe source has no sparse layer \(mlp_only_layers=\[0, "
                                     r"1, 2\], decoder_sparse_step=1\): it has no experts"),
], ids=["top_k_above_experts", "negative_aux_loss", "every_layer_dense"])
def test_an_moe_sources_own_settings_that_dar_moe_refuses_are_named_in_its_file(tmp_path, capsys, fields, message):
    """Values of an MoE source's config.json that DARMoeConfig refuses were refused as DARMoeConfig's ("DARMoeConfig.
    num_experts_per_tok must be ..."), never naming the file; and a source whose every layer is dense was sent from
    "use DARConfig for a dense model" to --kind dar, which sent it back to --kind dar_moe."""
    source = tiny_moe_source("qwen3_moe")
    source.save_pretrained(tmp_path / "source")
    make_tokenizer().save_pretrained(tmp_path / "source")
    config = json.loads((tmp_path / "source" / "config.json").read_text())
    (tmp_path / "source" / "config.json").write_text(json.dumps({**config, **fields}))
    assert cli_main(["convert", str(tmp_path / "source"), str(tmp_path / "moe")]) == 1
    error = capsys.readouterr().err.strip().splitlines()[-1]
    assert re.search(message, error), error
    assert str(tmp_path / "source" / "config.json") in error and not (tmp_path / "moe").exists()


@pytest.mark.parametrize("top_k", [1, 2])
def test_a_top1_upcycle_says_its_routers_get_no_gradient_from_the_loss(tmp_path, caplog, top_k):
    """Sparse upcycling renormalises the top-k weights (exactness needs them to sum to 1), so at top-1 the chosen
    expert's weight is 1 whatever the router says: the language-modelling loss gives the new routers no gradient,
    and with `output_router_logits` off (the converted config's default) nothing trains them. The conversion said
    nothing of it; now a warning and the card do, and the claim is measured here."""
    make_source("llama", tied=False).save_pretrained(tmp_path / "source")
    make_tokenizer().save_pretrained(tmp_path / "source")
    upcycle_to_dar_moe(tmp_path / "source", tmp_path / "moe", num_experts=4, top_k=top_k, **FAST)
    said = "the language-modelling loss gives the new routers no gradient"
    assert caplog.text.count(said) == (top_k == 1)
    assert (said in (tmp_path / "moe" / "README.md").read_text()) == (top_k == 1)

    model = AutoModelForCausalLM.from_pretrained(tmp_path / "moe")
    spread_weights(model)  # DAR's parameters off their init: the claim is not an artefact of the exact start
    input_ids = random_input_ids(length=16)

    def router_gradient(**keywords) -> float:
        model.zero_grad()
        model(input_ids, labels=input_ids, **keywords).loss.backward()
        return max(layer.mlp.gate.weight.grad.abs().max().item() for layer in model.model.layers)

    language_modelling, with_aux_loss = router_gradient(), router_gradient(output_router_logits=True)
    if top_k == 1:  # rounding only (about 4e-9), against the aux loss's 6e-5 at router_aux_loss_coef 0.001
        assert language_modelling < 1e-3 * with_aux_loss
    else:  # the loss trains the routers (0.11 here)
        assert language_modelling > 1e-2
