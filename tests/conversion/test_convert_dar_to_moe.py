# SPDX-License-Identifier: Apache-2.0
"""A dense DAR checkpoint (one trained after conversion, say) upcycles to DAR-MoE (CPU, tiny models): every DAR
parameter is kept bit for bit, each MLP becomes E identical experts behind a new router, and the result computes the
DAR source's function (1e-5 in float32), whatever its DAR settings; the DAR settings that shaped those parameters
cannot be changed on the way, and a source that is DAR already cannot be converted to dense DAR again."""

import json
import logging

import pytest
import torch
from safetensors.torch import load_file, save_file

from dar_transformers import DARConfig, DARForCausalLM, DARMoeForCausalLM
from dar_transformers.cli import main as cli_main
from dar_transformers.conversion import upcycle, upcycle_model, upcycle_to_dar_moe

from conftest import (
    FAST,
    IDS,
    is_dar_parameter,
    logits,
    make_source,
    make_tokenizer,
    run_convert_in_process,
    tree_digest,
)


def trained_dar(family: str = "llama", **fields) -> DARForCausalLM:
    """A DAR upcycle of a tiny Llama-family model whose DAR parameters then moved off their initialisation, as
    training moves them: a conversion that re-initialised them, instead of keeping them, computes the source's
    function, not this."""
    dar = upcycle_model(make_source(family), "dar", **fields)
    generator = torch.Generator().manual_seed(1)
    with torch.no_grad():
        for name, parameter in dar.named_parameters():
            if is_dar_parameter(name):
                parameter.add_(0.3 * torch.randn(parameter.shape, generator=generator))
    return dar.eval()


def saved(model, folder):
    model.save_pretrained(folder)
    make_tokenizer().save_pretrained(folder)
    return folder


def written_tensors(folder) -> dict[str, torch.Tensor]:
    tensors = {}
    for file in sorted(folder.glob("*.safetensors")):
        tensors.update(load_file(file))
    return tensors


@pytest.mark.parametrize("fields", [
    dict(dar_block_size=1),  # Full DAR
    dict(dar_block_size=2),  # Block DAR: a transport per block
    dict(dar_block_size=2, dar_routing="selfkv", dar_write_mode="split"),
    dict(dar_num_streams=1),  # Attention Residuals: no gates
], ids=["full", "block", "selfkv-split", "one-stream"])
def test_a_trained_dense_dar_folder_upcycles_to_dar_moe_keeping_its_dar_parameters(tmp_path, fields):
    dar = trained_dar(**fields)
    source = saved(dar, tmp_path / "dar")
    before = tree_digest(source)
    result = upcycle_to_dar_moe(source, tmp_path / "moe", num_experts=4, top_k=2, tolerance=1e-5, **FAST)
    assert result.report.passed and result.report.max_abs_logit_difference <= 1e-5
    assert tree_digest(source) == before  # the source is never touched

    moe = DARMoeForCausalLM.from_pretrained(tmp_path / "moe").eval()
    assert torch.allclose(logits(moe, IDS), logits(dar, IDS), atol=1e-5, rtol=0)
    assert not torch.allclose(logits(moe, IDS), logits(make_source(), IDS), atol=1e-2)  # not the Llama's function
    for name, value in dar.config.to_dict().items():  # every DAR setting of the source, as it was
        if name.startswith("dar_"):
            assert getattr(moe.config, name) == value, name
    assert moe.config.num_experts == 4 and moe.config.num_experts_per_tok == 2
    written, source_tensors = written_tensors(tmp_path / "moe"), written_tensors(source)
    dar_names = [name for name in source_tensors if is_dar_parameter(name)]
    assert dar_names and all(torch.equal(written[name], source_tensors[name]) for name in dar_names)
    card = " ".join((tmp_path / "moe" / "README.md").read_text().split())
    assert "The source is a DAR model already: its DAR parameters" in card and "are kept as they are" in card
    assert "initialised so that every depth read" not in card  # what a Llama-family source's card says
    assert "**at conversion the model computes the source model's function**, verified below" in card
    manifest = json.loads((tmp_path / "moe" / ".dar-convert-manifest.json").read_text())
    assert "README.md" in manifest["files"]



def test_a_dar_folders_own_code_is_not_named_as_left_behind(tmp_path, caplog):
    """A DAR folder carries the package's code for `trust_remote_code`; its DAR-MoE upcycle writes this version's
    code, so those files are not among what the output does not carry (they were named in the warning), while a file
    of the user's is."""
    source = saved(trained_dar(), tmp_path / "dar")
    (source / "notes.txt").write_text("mine")
    assert (source / "modeling_dar.py").is_file()
    upcycle_to_dar_moe(source, tmp_path / "moe", num_experts=4, top_k=2, **FAST)
    (warning,) = [record.getMessage() for record in caplog.records if "Not carried" in record.getMessage()]
    assert warning.startswith(f"Not carried into the output: notes.txt in {source} ")

def test_a_bf16_dense_dar_upcycle_keeps_its_dar_parameters_float32(tmp_path, caplog):
    """`--dtype bfloat16` rounds the shared weights, never DAR's parameters, which a dense DAR source stores float32
    (DESIGN.md section 4) and its DAR-MoE upcycle keeps float32: the rounding warning counted them, and of a bf16
    save (whose DAR parameters are float32) said --dtype bfloat16 rounded them, which the card repeated."""
    source = saved(trained_dar(dar_block_size=2), tmp_path / "dar")
    caplog.set_level(logging.WARNING)
    upcycle_to_dar_moe(source, tmp_path / "rounded", num_experts=4, top_k=2, dtype="bfloat16", tolerance=1.0,
                       **FAST)
    written = written_tensors(tmp_path / "rounded")
    assert {tensor.dtype for name, tensor in written.items() if is_dar_parameter(name)} == {torch.float32}
    assert {tensor.dtype for name, tensor in written.items() if not is_dar_parameter(name)} == {torch.bfloat16}
    shared = [name for name in written_tensors(source) if not is_dar_parameter(name)]
    assert f"--dtype bfloat16 may round {len(shared)} source tensor(s) stored in float32" in caplog.text  # not DAR's

    # A bf16 save: nothing is rounded by --dtype bfloat16 (the DAR parameters stay float32), and nothing is said to be.
    bf16 = saved(DARForCausalLM.from_pretrained(source, dtype=torch.bfloat16), tmp_path / "dar-bf16")
    caplog.clear()
    result = upcycle_to_dar_moe(bf16, tmp_path / "exact", num_experts=4, top_k=2, dtype="bfloat16", **FAST)
    assert result.report.passed and not result.report.relaxed and result.report.storage_dtype == "bfloat16"
    assert "rounds" not in caplog.text and "config.json says dtype" not in caplog.text
    card = (tmp_path / "exact" / "README.md").read_text()
    # DAR's float32 parameters are not "kept as the source stores them"
    assert "| weights dtype | bfloat16; DAR's own parameters float32, as they load |" in card
    assert "rounded" not in card
    assert all(torch.equal(tensor, written_tensors(bf16)[name])
               for name, tensor in written_tensors(tmp_path / "exact").items() if is_dar_parameter(name))


def test_float64_dar_parameters_stay_float64_under_auto(tmp_path):
    """`--dtype auto` rounds nothing: a source whose DAR parameters are stored float64 beside float32 weights had
    them written float32, without a word (its own load computes them in float32, but the stored bits were lost)."""
    source = saved(trained_dar(), tmp_path / "dar")
    weights = written_tensors(source)
    widened = {name: tensor.double() if is_dar_parameter(name) else tensor for name, tensor in weights.items()}
    for file in source.glob("*.safetensors"):
        file.unlink()
    save_file(widened, source / "model.safetensors", metadata={"format": "pt"})
    upcycle_to_dar_moe(source, tmp_path / "moe", num_experts=4, top_k=2, **FAST)
    written = written_tensors(tmp_path / "moe")
    assert all(written[name].dtype == torch.float64 and torch.equal(written[name], tensor)
               for name, tensor in widened.items() if is_dar_parameter(name))


def test_a_dar_source_with_code_of_its_own_is_named_as_not_run(tmp_path):
    """A DAR folder whose auto_map names code other than the package's: the card claimed the source's function with
    no caveat (a Llama source's gets one), since every auto_map entry of a DAR source was taken for the package's."""
    source = saved(trained_dar(), tmp_path / "dar")
    config = json.loads((source / "config.json").read_text())
    config["auto_map"]["AutoModelForCausalLM"] = "my_dar.MyDARForCausalLM"
    (source / "config.json").write_text(json.dumps(config))
    upcycle_to_dar_moe(source, tmp_path / "moe", num_experts=4, top_k=2, **FAST)
    card = " ".join((tmp_path / "moe" / "README.md").read_text().split())
    assert "computes the function of this package's `DARForCausalLM` with the source's weights and config" in card
    assert "`AutoModelForCausalLM: my_dar.MyDARForCausalLM`" in card
    assert "configuration_dar.DARConfig" not in card  # the package's own entries are not "code it did not run"


def test_drop_upcycling_a_dar_source_says_the_experts_differ(tmp_path):
    source = saved(trained_dar(), tmp_path / "dar")
    upcycle_to_dar_moe(source, tmp_path / "moe", num_experts=4, top_k=2, expert_noise=0.5, **FAST)
    card = " ".join((tmp_path / "moe" / "README.md").read_text().split())
    assert "identical experts" not in card and "that much holds" not in card
    assert "re-initialised (Drop-Upcycling), which **deliberately changes the function**" in card


@pytest.mark.parametrize("family", ["mistral", "qwen3"])
def test_a_dense_dar_of_another_branch_family_upcycles_with_its_attention(tmp_path, family):
    """A Mistral-branch DAR keeps its sliding window (5 tokens, shorter than the prompts: a full-attention upcycle
    fails the check), a Qwen3-branch one its head_dim and q/k norms."""
    dar = trained_dar(family, dar_block_size=2)
    result = upcycle_to_dar_moe(saved(dar, tmp_path / "dar"), tmp_path / "moe", num_experts=4, top_k=2,
                                tolerance=1e-5, **FAST)
    assert result.report.passed
    moe = DARMoeForCausalLM.from_pretrained(tmp_path / "moe").eval()
    assert moe.config.dar_branch_family == family and moe.config.sliding_window == dar.config.sliding_window
    assert torch.allclose(logits(moe, IDS), logits(dar, IDS), atol=1e-5, rtol=0)


def test_a_llama_branch_dar_keeps_its_sliding_window(tmp_path):
    """DAR's mask applies `sliding_window` whatever the branch family, so a Llama-branch DAR's window is its own, not
    a stray Llama key: it was dropped as one ("its attention ignores the key"), and the full-attention upcycle then
    FAILED the check (5.3 logits off with a window of 5)."""
    source = saved(trained_dar(dar_block_size=2), tmp_path / "dar")
    config = json.loads((source / "config.json").read_text())
    (source / "config.json").write_text(json.dumps({**config, "sliding_window": 5}))
    dar = DARForCausalLM.from_pretrained(source).eval()
    assert dar.config.sliding_window == 5
    result = upcycle_to_dar_moe(source, tmp_path / "moe", num_experts=4, top_k=2, tolerance=1e-5, **FAST)
    assert result.report.passed
    moe = DARMoeForCausalLM.from_pretrained(tmp_path / "moe").eval()
    assert moe.config.sliding_window == 5
    assert torch.allclose(logits(moe, IDS), logits(dar, IDS), atol=1e-5, rtol=0)


def test_an_in_memory_dense_dar_model_upcycles_to_dar_moe(tmp_path):
    dar = trained_dar(dar_block_size=2)
    moe = upcycle_model(dar, "dar_moe", num_experts=3, num_experts_per_tok=2, dar_implementation="two_phase")
    assert type(moe) is DARMoeForCausalLM and moe.config.dar_implementation == "two_phase"  # a run's own choice
    assert torch.allclose(logits(moe, IDS), logits(dar, IDS), atol=1e-5, rtol=0)
    result = upcycle_to_dar_moe(dar, tmp_path / "moe", tokenizer=make_tokenizer(), num_experts=3, top_k=2, **FAST)
    assert result.report.passed


def test_changing_a_dar_setting_that_shaped_the_parameters_is_refused(tmp_path):
    """A block size, routing or stream count other than the source's would put its DAR parameters where they do not
    belong (or have none for them): refused before any work, naming both values."""
    source = saved(trained_dar(dar_block_size=2), tmp_path / "dar")
    before = tree_digest(source)
    code, stderr = run_convert_in_process(source, tmp_path / "moe", "--experts", "4", "--top-k", "2",
                                          "--block-size", "1", cwd=tmp_path)
    assert code == 1 and "dar_block_size=1 differs from the dense DAR source's 2" in stderr, stderr
    with pytest.raises(ValueError, match="dar_routing='selfkv' differs from the dense DAR source's 'dar'"):
        upcycle_to_dar_moe(source, tmp_path / "moe", num_experts=4, top_k=2, dar_routing="selfkv", **FAST)
    assert sorted(path.name for path in tmp_path.iterdir()) == ["dar"] and tree_digest(source) == before


def test_a_dar_source_is_not_converted_to_dense_dar_again_nor_a_dar_moe_one_at_all(tmp_path, capsys):
    source = saved(trained_dar(), tmp_path / "dar")
    assert cli_main(["convert", str(source), str(tmp_path / "again")]) == 1
    error = capsys.readouterr().err
    assert "already a dense DAR model (model_type 'dar')" in error and "--kind dar_moe" in error
    with pytest.raises(ValueError, match="already a dense DAR model"):
        upcycle(trained_dar(), tmp_path / "again", tokenizer=make_tokenizer(), **FAST)

    upcycle_to_dar_moe(source, tmp_path / "moe", num_experts=4, top_k=2, **FAST)
    assert cli_main(["convert", str(tmp_path / "moe"), str(tmp_path / "moe-again"), "--experts", "4",
                     "--top-k", "2"]) == 1
    assert "already a DAR-MoE checkpoint" in capsys.readouterr().err
    assert sorted(path.name for path in tmp_path.iterdir()) == ["dar", "moe"]


def test_a_dense_dar_with_mlp_biases_is_refused_without_pointing_back_to_dense_dar(tmp_path):
    """HF experts have no biases; the refusal for a Llama source says it converts to dense DAR only, which a DAR
    source already is."""
    config = DARConfig(**{**trained_dar().config.to_dict(), "mlp_bias": True})
    source = saved(DARForCausalLM(config), tmp_path / "dar")
    with pytest.raises(ValueError, match="mlp_bias=true: a dense DAR model with MLP biases has no DAR-MoE upcycle"):
        upcycle_to_dar_moe(source, tmp_path / "moe", num_experts=4, top_k=2, **FAST)
    assert sorted(path.name for path in tmp_path.iterdir()) == ["dar"]


@pytest.mark.parametrize("damage", ["a_parameter_removed", "block_size_edited", "llama_weights_labelled_dar"])
def test_a_dense_dar_folder_missing_dar_parameters_is_refused_naming_them(tmp_path, damage):
    """A DAR source's DAR parameters were taken for new ones when missing (a trained folder with one removed, or a
    config.json whose dar_block_size was edited after saving, or Llama weights under a `dar` config): the conversion
    planned them from `_init_weights`, wrote and compared its tensors, then the verification's strict load of the
    source died in a torch traceback. They are the model's own: refused in one line naming them, nothing written."""
    folder = saved(trained_dar(dar_block_size=2), tmp_path / "source")
    weights = load_file(folder / "model.safetensors")
    if damage == "a_parameter_removed":
        weights.pop("model.layers.1.attn_residual.depth_attention.pseudo_query")
        save_file(weights, folder / "model.safetensors", metadata={"format": "pt"})
        named = "model.layers.1.attn_residual.depth_attention.pseudo_query"
    elif damage == "block_size_edited":  # 3 layers, 6 branches: one block, no partial to transport
        config = json.loads((folder / "config.json").read_text())
        (folder / "config.json").write_text(json.dumps({**config, "dar_block_size": 6}))
        named = "write_gate.transport_logit"
    else:
        save_file({name: tensor for name, tensor in weights.items() if not is_dar_parameter(name)},
                  folder / "model.safetensors", metadata={"format": "pt"})
        named = "depth_attention.pseudo_query"
    code, stderr = run_convert_in_process(folder, tmp_path / "moe", "--experts", "2", "--top-k", "1", cwd=tmp_path)
    assert code == 1 and "Traceback" not in stderr, stderr[-3000:]
    error = stderr.strip().splitlines()[-1]
    assert error.startswith("dar convert: error: The weights in") and named in error, error
    assert "a config.json edited after the weights were saved" in error
    assert sorted(path.name for path in tmp_path.iterdir()) == ["source"]
