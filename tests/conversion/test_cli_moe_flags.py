# SPDX-License-Identifier: Apache-2.0
"""`dar convert` with the DAR-MoE flags (`--experts`, `--top-k`, `--expert-noise`) and an unchecked tolerance, on a
tiny Llama source with a tokenizer (`save_source`), through the CLI's `main`.

What the run prints and what the model card says must match what was done: a conversion that deliberately changes the
function (Drop-Upcycling) or that checks nothing (tolerance inf) is never reported as PASSED or as exact.
"""

import pytest
import torch

from dar_transformers.cli import main as cli_main

from conftest import edit_json, save_source


@pytest.mark.parametrize("flags, kind", [
    (["--experts", "4", "--top-k", "2", "--expert-noise", "0.25"], "drop-upcycled"),
    (["--tolerance", "inf"], "dense, unchecked"),
])
def test_a_conversion_checked_at_tolerance_inf_is_not_reported_passed_nor_verified(tmp_path, capsys, flags, kind):
    """Drop-Upcycling verifies at tolerance inf (the experts are perturbed on purpose), and so does an explicit
    `--tolerance inf`: no logit difference can fail and no top-1 position is compared (margin > 2 x inf). The run
    said PASSED, and the card that the model computes the source's function, "verified below"."""
    source = save_source(tmp_path / "source")
    code = cli_main(["convert", str(source), str(tmp_path / "out"), *flags, "--max-new-tokens", "4"])
    printed = capsys.readouterr().out
    assert code == 0
    assert "PASSED" not in printed and "NOT VERIFIED (tolerance inf: differences reported only)" in printed
    card = (tmp_path / "out" / "README.md").read_text()
    assert "PASSED" not in card and "computes the source model's function**, verified below" not in card
    if kind == "drop-upcycled":
        assert "deliberately changed the function" in card
    else:
        assert "which this conversion did NOT verify" in card


ROUNDED = ("Storing the weights in float16 rounded 29 source tensor(s) stored in float32 (model.embed_tokens.weight, "
           "model.layers.0.input_layernorm.weight, ...); by construction the converted model computes what the "
           "source computes with them")
BOUNDED = ", and the check bounds its distance from the source as stored by its tolerance."  # only where it checked


@pytest.mark.parametrize("tolerance, verdict, headline, relaxed", [
    ("0.5", "PASSED: ", "**at conversion the model approximates the source model's function**: within a max abs "
                        "logit difference of 5.0e-01 (a tolerance relaxed from the default 2.0e-04), verified below at "
                        "that bar, not as an exact conversion.",
     "so it is verified as an approximate conversion, not as an exact one."),
    ("1e30", "NOT VERIFIED (tolerance 1.0e+30: differences reported only; ",
     "**at conversion the model computes the source model's function with its weights rounded to float16** by "
     "construction, which this conversion did NOT verify (see below).",
     "at which no next token was compared, so nothing was verified: the differences above are reported only."),
])
def test_a_relaxed_tolerance_is_reported_approximate_and_one_that_decides_nothing_not_verified(
        tmp_path, capsys, caplog, tolerance, verdict, headline, relaxed):
    """float16 weights from a float32 source move the logits by about 1e-2, so the bar must be relaxed. At 0.5 the
    run passes on the positions decided at that bar, but the card's headline claimed the source's function exactly,
    "verified below"; at 1e30 no position is decided (0/0 compared) and the run said PASSED, where inf says NOT
    VERIFIED (and the card called it "an approximate conversion" beside "did NOT verify"). Both name the rounding of
    the weights to float16, in the card and in a warning, which they did only when a check failed."""
    source = save_source(tmp_path / "source")
    code = cli_main(["convert", str(source), str(tmp_path / "out"), "--dtype", "float16", "--tolerance", tolerance,
                     "--max-new-tokens", "4"])
    printed = capsys.readouterr().out
    assert code == 0
    (line,) = [line for line in printed.splitlines() if line.startswith(("PASSED", "FAILED", "NOT VERIFIED"))]
    assert line.startswith(verdict), line
    card = " ".join((tmp_path / "out" / "README.md").read_text().split())
    assert headline in card and "computes the source model's function**, verified below" not in card
    assert ROUNDED + (BOUNDED if tolerance == "0.5" else ".") in card and relaxed in card
    assert "--dtype float16 may round 29 source tensor(s) stored in float32" in caplog.text


def test_a_failed_relaxed_check_does_not_announce_a_model_card(tmp_path, caplog):
    """A relaxed bar that the rounding still misses fails and writes nothing; the warning that "the model card says
    so" came before the verdict."""
    source = save_source(tmp_path / "source")
    code = cli_main(["convert", str(source), str(tmp_path / "out"), "--dtype", "float16", "--tolerance", "1e-3",
                     "--max-new-tokens", "4"])
    assert code == 2 and not (tmp_path / "out").exists()
    assert "The model card says so" not in caplog.text
    # nor the rounding warning, before any check: "computes the source's function ... (the model card says so)"
    assert "model card says so" not in caplog.text and "the model card of a written output says so" in caplog.text


def test_moe_flags_with_an_explicit_dense_kind_are_refused_naming_both(tmp_path, capsys):
    """`--kind dar --experts 4 --top-k 2` wrote a DAR-MoE model: any MoE flag switched the kind, whatever --kind said
    (its default "dar" could not be told apart from an explicit one)."""
    source = save_source(tmp_path / "source")
    code = cli_main(["convert", str(source), str(tmp_path / "out"), "--kind", "dar", "--experts", "4", "--top-k", "2"])
    error = capsys.readouterr().err.strip().splitlines()[-1]
    assert code == 1 and error == ("dar convert: error: --experts, --top-k make a DAR-MoE model, which contradicts "
                                   "--kind dar; pass --kind dar_moe or leave --kind out.")
    assert not (tmp_path / "out").exists()


def test_an_expert_noise_that_reinitialises_no_hidden_unit_is_refused(tmp_path, capsys):
    """round(noise x hidden units) = 0 left the experts identical copies, yet the run said "not exact" and relaxed
    the check to tolerance inf."""
    source = save_source(tmp_path / "source")
    code = cli_main(["convert", str(source), str(tmp_path / "out"), "--experts", "4", "--top-k", "2",
                     "--expert-noise", "0.001"])
    error = capsys.readouterr().err.strip().splitlines()[-1]
    assert code == 1 and "expert_noise=0.001 re-initialises" in error and "leaves the experts identical" in error
    assert not (tmp_path / "out").exists()


def test_the_expert_seed_is_a_flag_and_the_card_records_it(tmp_path, capsys):
    """Drop-Upcycling's re-drawn hidden units come from a seed that `dar convert` could not set (always 0) and that
    no file of the output recorded, so a checkpoint's experts could not be redrawn or told apart. --expert-seed sets
    it, the card's title names it, and it is refused without --expert-noise (nothing is random then)."""
    from safetensors.torch import load_file

    source = save_source(tmp_path / "source")
    noise = ["--experts", "2", "--top-k", "1", "--expert-noise", "0.5", "--max-new-tokens", "0"]
    for name, seed in (("default", []), ("seven", ["--expert-seed", "7"]), ("seven-again", ["--expert-seed", "7"])):
        assert cli_main(["convert", str(source), str(tmp_path / name), *noise, *seed]) == 0
    experts = {name: {key: value for file in (tmp_path / name).glob("*.safetensors")
                      for key, value in load_file(file).items()} for name in ("default", "seven", "seven-again")}
    key = next(key for key in experts["seven"] if key.endswith("experts.gate_up_proj"))
    assert torch.equal(experts["seven"][key], experts["seven-again"][key])
    assert not torch.equal(experts["seven"][key], experts["default"][key])
    assert "Drop-Upcycling expert_noise=0.5, seed 7 (not exact)" in (tmp_path / "seven" / "README.md").read_text()
    assert "Drop-Upcycling expert_noise=0.5, seed 0 (not exact)" in (tmp_path / "default" / "README.md").read_text()
    capsys.readouterr()
    code = cli_main(["convert", str(source), str(tmp_path / "out"), "--experts", "2", "--top-k", "1",
                     "--expert-seed", "7"])
    error = capsys.readouterr().err.strip().splitlines()[-1]
    assert code == 1 and "--expert-seed seeds the hidden units that --expert-noise re-draws" in error
    assert not (tmp_path / "out").exists()


def test_sparse_upcycling_a_model_with_mlp_biases_is_refused_naming_its_config_file(tmp_path, capsys):
    """The refusal said only "Sparse upcycling needs a bias-free MLP (mlp_bias=False)", naming no file."""
    source = save_source(tmp_path / "source")
    edit_json(source / "config.json", mlp_bias=True)
    code = cli_main(["convert", str(source), str(tmp_path / "out"), "--experts", "4", "--top-k", "2"])
    error = capsys.readouterr().err.strip().splitlines()[-1]
    assert code == 1 and error == (
        f"dar convert: error: Sparse upcycling needs a bias-free MLP (HF experts have no biases), but "
        f"{source / 'config.json'} says mlp_bias=true: this model converts to dense DAR only (leave out "
        "--experts/--top-k)."
    )
    assert not (tmp_path / "out").exists()


def test_a_stray_mlp_bias_in_a_config_whose_mlp_has_none_does_not_refuse_sparse_upcycling(tmp_path, capsys):
    """Mistral's MLP has no biases whatever its config.json says; `mlp_bias: true` there refused sparse upcycling of
    a bias-free MLP. The question is asked of the family's own MLP; the upcycle is exact."""
    source = save_source(tmp_path / "source", family="mistral")
    edit_json(source / "config.json", mlp_bias=True)
    code = cli_main(["convert", str(source), str(tmp_path / "out"), "--experts", "4", "--top-k", "2",
                     "--max-new-tokens", "4"])
    assert code == 0, capsys.readouterr().err[-2000:]
    assert "PASSED" in capsys.readouterr().out


@pytest.mark.parametrize("flags, got", [(["--top-k", "2"], "None, 2"), (["--experts", "4"], "4, None")])
def test_sparse_upcycling_without_experts_or_top_k_names_both_flags(tmp_path, capsys, flags, got):
    """`dar convert SRC OUT --top-k 2` said "needs num_experts and top_k", the API's names, not the flags to pass."""
    source = save_source(tmp_path / "source")
    code = cli_main(["convert", str(source), str(tmp_path / "out"), *flags])
    error = capsys.readouterr().err.strip().splitlines()[-1]
    assert code == 1 and error == (f"dar convert: error: Upcycling a dense llama model needs num_experts and top_k "
                                   f"(--experts and --top-k; got {got}).")
    assert not (tmp_path / "out").exists()


@pytest.mark.parametrize("flags, sparse", [(("--mlp-only-layers", "0"), [1, 2]), (("--decoder-sparse-step", "2"), [1]),
                                           (("--mlp-only-layers", "0", "--decoder-sparse-step", "3"), [2])])
def test_sparse_upcycling_of_chosen_layers_keeps_the_others_dense_and_exact(tmp_path, capsys, flags, sparse):
    """`--mlp-only-layers` / `--decoder-sparse-step` (Qwen2/3-MoE's fields): only the chosen layers become experts,
    the others keep their dense MLP bit for bit; the conversion stays exact. They were refused as unknown fields."""
    from safetensors.torch import load_file
    from transformers import AutoModelForCausalLM

    source = save_source(tmp_path / "source")
    code = cli_main(["convert", str(source), str(tmp_path / "moe"), "--experts", "4", "--top-k", "2", *flags,
                     "--max-new-tokens", "4"])
    assert code == 0 and "PASSED" in capsys.readouterr().out
    moe = AutoModelForCausalLM.from_pretrained(tmp_path / "moe")
    assert moe.config.moe_layer_indices == sparse
    dense = load_file(source / "model.safetensors")
    written = {}
    for file in (tmp_path / "moe").glob("*.safetensors"):
        written.update(load_file(file))
    for layer in range(3):
        kept = f"model.layers.{layer}.mlp.down_proj.weight"
        assert (kept in written) == (layer not in sparse)
        assert layer in sparse or torch.equal(written[kept], dense[kept])
    card = (tmp_path / "moe" / "README.md").read_text()
    assert f"| experts E (sparse layers) | 4 ({len(sparse)} of 3 layers) |" in card


def test_sparse_layer_choices_are_refused_for_an_moe_source_and_named_by_flag(tmp_path, capsys):
    source = save_source(tmp_path / "source")
    assert cli_main(["convert", str(source), str(tmp_path / "out"), "--experts", "4", "--top-k", "2",
                     "--mlp-only-layers", "0,1,2"]) == 1
    assert "--mlp-only-layers: DARMoeConfig.mlp_only_layers and decoder_sparse_step leave no sparse layer" in \
        capsys.readouterr().err
    with pytest.raises(SystemExit):
        cli_main(["convert", str(source), str(tmp_path / "out"), "--mlp-only-layers", "0,x"])
    assert "is not a comma-separated list of layer indices" in capsys.readouterr().err
    from transformers import MixtralConfig, MixtralForCausalLM

    from conftest import SHAPE, VOCAB, make_tokenizer

    MixtralForCausalLM(MixtralConfig(**SHAPE, vocab_size=VOCAB, num_local_experts=4)).save_pretrained(tmp_path / "mix")
    make_tokenizer().save_pretrained(tmp_path / "mix")
    assert cli_main(["convert", str(tmp_path / "mix"), str(tmp_path / "out"), "--kind", "dar_moe",
                     "--decoder-sparse-step", "2"]) == 1
    assert "the mixtral source's layers are sparse or dense as it stores them" in capsys.readouterr().err
    assert sorted(path.name for path in tmp_path.iterdir()) == ["mix", "source"]



def test_expert_noise_on_an_moe_source_is_refused_before_any_warning_and_named_by_flag(tmp_path, capsys, caplog):
    """`--expert-noise` on an MoE source warned that the converted model "is NOT function-preserving", then was
    refused as a fault of the source's files ("safetensors in ...: expert_noise applies to ..."). Refused first, by
    its flag and the source's config file, with no warning; nothing written."""
    from transformers import MixtralConfig, MixtralForCausalLM

    from conftest import SHAPE, VOCAB, make_tokenizer

    MixtralForCausalLM(MixtralConfig(**SHAPE, vocab_size=VOCAB, num_local_experts=4)).save_pretrained(tmp_path / "mix")
    make_tokenizer().save_pretrained(tmp_path / "mix")
    capsys.readouterr()
    assert cli_main(["convert", str(tmp_path / "mix"), str(tmp_path / "out"), "--expert-noise", "0.5"]) == 1
    printed = capsys.readouterr().err.strip()
    assert printed.startswith("dar convert: error: --expert-noise: expert_noise=0.5 re-draws part of the experts ") \
        and f"the mixtral source ({tmp_path / 'mix' / 'config.json'}) has experts of its own" in printed, printed
    assert "safetensors in" not in printed and "NOT function-preserving" not in caplog.text
    assert sorted(path.name for path in tmp_path.iterdir()) == ["mix"]

def test_an_moe_sources_own_fields_are_not_blamed_on_flags_and_stray_layer_indices_convert(tmp_path, capsys):
    """A Qwen3-MoE source's own config fields, no flag given: top-k 6 of 4 experts was refused as "--top-k: ...", a flag
    the user never passed; `mlp_only_layers` naming a layer the model does not have (7 of 3: transformers' MoE layers
    test membership, so it selects nothing) refused a source that runs ("--mlp-only-layers: ... indices in [0, 2]").
    The first is refused naming no flag; the second converts, its stray index dropped."""
    import json

    from transformers import Qwen3MoeConfig, Qwen3MoeForCausalLM

    from conftest import SHAPE, VOCAB, make_tokenizer

    def source(name, **fields):
        config = Qwen3MoeConfig(**SHAPE, vocab_size=VOCAB, num_experts=4, moe_intermediate_size=16, **fields)
        Qwen3MoeForCausalLM(config).save_pretrained(tmp_path / name)
        make_tokenizer().save_pretrained(tmp_path / name)
        return str(tmp_path / name)

    top_k = source("top_k", num_experts_per_tok=2)
    config = json.loads((tmp_path / "top_k" / "config.json").read_text())
    (tmp_path / "top_k" / "config.json").write_text(json.dumps({**config, "num_experts_per_tok": 6}))
    assert cli_main(["convert", top_k, str(tmp_path / "out"), "--kind", "dar_moe"]) == 1
    error = capsys.readouterr().err
    assert "DARMoeConfig.num_experts_per_tok must be an integer in [1, num_experts=4], got 6" in error
    assert "--top-k" not in error
    stray = source("stray", num_experts_per_tok=2, mlp_only_layers=[0, 7])
    assert cli_main(["convert", stray, str(tmp_path / "out"), "--kind", "dar_moe", "--max-new-tokens", "4"]) == 0
    assert json.loads((tmp_path / "out" / "config.json").read_text())["mlp_only_layers"] == [0]


def test_an_moe_source_without_kind_converts_to_dar_moe_and_says_so(tmp_path, capsys):
    """A Mixtral folder converts to DAR-MoE only: `dar convert mixtral out` was refused ("convert it to DAR-MoE with
    --kind dar_moe"); without --kind it makes DAR-MoE now, saying so. An explicit --kind dar is still refused."""
    import json

    from transformers import MixtralConfig, MixtralForCausalLM

    from conftest import SHAPE, VOCAB, make_tokenizer

    MixtralForCausalLM(MixtralConfig(**SHAPE, vocab_size=VOCAB, num_local_experts=4)).save_pretrained(tmp_path / "mix")
    make_tokenizer().save_pretrained(tmp_path / "mix")
    assert cli_main(["convert", str(tmp_path / "mix"), str(tmp_path / "out"), "--kind", "dar"]) == 1
    assert "convert it to DAR-MoE with --kind dar_moe" in capsys.readouterr().err
    assert cli_main(["convert", str(tmp_path / "mix"), str(tmp_path / "out"), "--max-new-tokens", "4"]) == 0
    assert "the source is a mixture of experts (model_type 'mixtral'), which converts to DAR-MoE only" in \
        capsys.readouterr().err
    assert json.loads((tmp_path / "out" / "config.json").read_text())["model_type"] == "dar_moe"
