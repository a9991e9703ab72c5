# SPDX-License-Identifier: Apache-2.0
"""dar_transformers.analysis on CPU: linear CKA's invariances, recording that leaves the model unchanged, the
rescue-gain bookkeeping on a tiny model, and the summary plus PNGs of `analyze`."""

import fnmatch
import json
import math
import os
import re
from pathlib import Path

import numpy
import pytest
import torch
from conftest import perturb_dar_parameters, tiny_dar_config

from dar_transformers import DARForCausalLM
from dar_transformers.cli import main as cli_main
from dar_transformers.analysis import (
    ANALYSIS_FILES,
    analyze,
    cka_matrix,
    dar_branches,
    linear_cka,
    main,
    record_depth_reads,
    rescue_gain,
    save_plots,
)


def trained_like_dar(seed: int = 0, **overrides) -> DARForCausalLM:
    """A tiny DAR model whose DAR parameters are away from their init (non-uniform reads, gates not at 1/2)."""
    torch.manual_seed(seed)
    model = DARForCausalLM(tiny_dar_config(**overrides)).eval()
    perturb_dar_parameters(model, scale=0.5, seed=seed)
    return model


def token_batch(batch: int = 3, length: int = 12, seed: int = 0) -> torch.Tensor:
    return torch.randint(3, 97, (batch, length), generator=torch.Generator().manual_seed(seed))


# ----------------------------------------------------------------------------------------------------------- CKA


def test_cka_of_identical_inputs_is_one():
    x = torch.randn(500, 16, generator=torch.Generator().manual_seed(0))
    assert linear_cka(x, x) == pytest.approx(1.0, abs=1e-12)


def test_cka_of_independent_random_inputs_is_near_zero():
    generator = torch.Generator().manual_seed(1)
    x, y = torch.randn(4000, 8, generator=generator), torch.randn(4000, 8, generator=generator)
    # E[CKA] ~ D1 * D2 / (N * sqrt(D1 * D2)) for independent Gaussians: about 0.002 here.
    assert linear_cka(x, y) < 0.02


def test_cka_is_invariant_to_isotropic_scaling_and_orthogonal_transforms():
    generator = torch.Generator().manual_seed(2)
    x = torch.randn(300, 12, generator=generator, dtype=torch.float64)
    y = x @ torch.randn(12, 10, generator=generator, dtype=torch.float64) + 0.5 * torch.randn(
        300, 10, generator=generator, dtype=torch.float64
    )
    orthogonal, _ = torch.linalg.qr(torch.randn(10, 10, generator=generator, dtype=torch.float64))
    reference = linear_cka(x, y)
    assert 0.05 < reference < 0.999  # a non-trivial value, so the invariances are tested
    assert linear_cka(x, 7.5 * y) == pytest.approx(reference, abs=1e-10)
    assert linear_cka(x, y @ orthogonal) == pytest.approx(reference, abs=1e-10)
    assert linear_cka(0.01 * x, y) == pytest.approx(reference, abs=1e-10)


def test_cka_is_not_invariant_to_anisotropic_scaling():
    generator = torch.Generator().manual_seed(3)
    x = torch.randn(300, 6, generator=generator)
    y = x + 0.3 * torch.randn(300, 6, generator=generator)
    stretched = y * torch.tensor([10.0, 1, 1, 1, 1, 0.1])
    assert abs(linear_cka(x, stretched) - linear_cka(x, y)) > 1e-3


@pytest.mark.parametrize("tokens, width", [(40, 8), (12, 30)])
def test_cka_matrix_feature_and_gram_forms_agree_with_pairwise_cka(tokens, width):
    generator = torch.Generator().manual_seed(4)
    xs = [torch.randn(tokens, width, generator=generator) for _ in range(3)]
    ys = [x + torch.randn(tokens, width, generator=generator) * scale for x, scale in zip(xs, (0.1, 1.0, 10.0))]
    expected = torch.tensor([[linear_cka(x, y) for y in ys] for x in xs], dtype=torch.float64)
    torch.testing.assert_close(cka_matrix(xs, ys), expected, rtol=0, atol=1e-6)


# --------------------------------------------------------------------------------------------- instrumentation


@pytest.mark.parametrize("block_size", [1, 3])
def test_recording_keeps_the_logits_and_restores_the_fast_path(block_size):
    model = trained_like_dar(dar_block_size=block_size)
    input_ids = token_batch()
    with torch.no_grad():
        fast = model(input_ids=input_ids).logits
        with record_depth_reads(model) as reads:
            recorded = model(input_ids=input_ids).logits
            assert model.config.dar_implementation == "reference"
    assert model.config.dar_implementation == "fast"
    assert not any(branch.depth_attention._forward_hooks for branch in dar_branches(model))  # nothing left behind
    torch.testing.assert_close(recorded, fast, rtol=1e-4, atol=1e-5)
    names = [branch.name for branch in dar_branches(model)]
    assert list(reads) == names  # every read recorded, in execution order
    # The recorded weights are the model's own: what `output_depth_weights` returns on the fast path.
    with torch.no_grad():
        returned = model(input_ids=input_ids, output_depth_weights=True).depth_weights
    assert len(returned) == len(names)
    for name, weights in zip(names, returned):
        torch.testing.assert_close(reads[name].weights, weights, rtol=1e-4, atol=1e-5, msg=name)
    for name, read in reads.items():
        assert read.weights.shape[1:] == (3, 12, 2) and read.extracted.shape == (3, 12, 2, 32)  # depth-major
        torch.testing.assert_close(read.weights.sum(0), torch.ones(3, 12, 2))  # softmax over depth


def test_uniform_reads_at_initialisation():
    torch.manual_seed(0)
    model = DARForCausalLM(tiny_dar_config(dar_block_size=1)).eval()
    summary = analyze(model, token_batch())
    entropy = torch.tensor(summary["depth_weights"]["entropy_normalised"])
    torch.testing.assert_close(entropy[:, 1:], torch.ones_like(entropy[:, 1:]))  # zero queries: uniform weights
    first = summary["depth_weights"]["mean_weight"][0][2]  # branch 2 of Full DAR reads e0, e1, e2
    assert first[:3] == pytest.approx([1 / 3] * 3) and first[3] is None


# ------------------------------------------------------------------------------------------------- rescue gain


def test_rescue_gain_bookkeeping():
    model = trained_like_dar(dar_block_size=2)
    input_ids = token_batch(batch=4)
    result = rescue_gain(model, input_ids, ["L0.mlp", "L1.attn", "readout"])
    for name, entry in result["branches"].items():
        assert entry["logit_distance_corrupted"] > 0, name
        for stream in (0, 1):
            # restoring one stream sits between nothing restored (gain 0) and everything restored (gain 1)
            assert entry[f"rescue_gain{stream}"] == pytest.approx(
                1 - entry[f"logit_distance_restore{stream}"] / entry["logit_distance_corrupted"]
            )
            damage = entry["loss_corrupted"] - entry["loss_clean"]
            assert entry[f"rescue_gain_loss{stream}"] == pytest.approx(
                (entry["loss_corrupted"] - entry[f"loss_restore{stream}"]) / damage
            )
    assert len(result["mean_rescue_gain"]) == 2 and 0 <= result["mean_balance"] <= 1
    entries = result["branches"].values()
    for stream in (0, 1):
        pooled = 1 - sum(e[f"logit_distance_restore{stream}"] for e in entries) / sum(
            e["logit_distance_corrupted"] for e in entries
        )
        assert result["pooled_rescue_gain"][stream] == pytest.approx(pooled, rel=1e-5)


def test_rescue_gain_follows_the_read_gate():
    """With alpha = 1 the branch reads only stream 0: restoring it restores everything, restoring stream 1 nothing."""
    model = trained_like_dar(dar_block_size=2)
    with torch.no_grad():
        model.model.layers[1].attn_residual.read_gate.logit.fill_(40.0)
    entry = rescue_gain(model, token_batch(batch=4), ["L1.attn"])["branches"]["L1.attn"]
    assert entry["rescue_gain0"] == pytest.approx(1.0, abs=1e-6)
    assert entry["rescue_gain1"] == pytest.approx(0.0, abs=1e-6)
    assert entry["loss_restore0"] == pytest.approx(entry["loss_clean"], abs=1e-6)


def test_rescue_gain_summaries_are_the_true_median_and_keep_float64():
    """With an even number of reads the median is the mean of the two middle gains (torch's `nanmedian` gave the lower
    one: SmolLM2's 8 reads read 0.60 / 0.61 for 0.61 / 0.62); a float64 model's losses and gains stay float64 (its
    logits were cast to float32: loss gains 2e-3 relative off)."""
    model = trained_like_dar(dar_block_size=2).double()
    input_ids = token_batch(batch=4)
    names = ["L0.mlp", "L1.attn", "L1.mlp", "readout"]
    result = rescue_gain(model, input_ids, names)
    for stream in (0, 1):
        gains = sorted(result["branches"][name][f"rescue_gain{stream}"] for name in names)
        assert result["median_rescue_gain"][stream] == pytest.approx((gains[1] + gains[2]) / 2, rel=1e-12)
        assert gains[1] != pytest.approx(gains[2], rel=1e-6)  # the two middle values differ: the test can fail
    logits = model(input_ids=input_ids).logits
    assert logits.dtype == torch.float64
    loss = torch.nn.functional.cross_entropy(logits[:, :-1].reshape(-1, logits.shape[-1]), input_ids[:, 1:].reshape(-1))
    assert result["branches"]["readout"]["loss_clean"] == pytest.approx(loss.item(), rel=1e-13)


def test_a_corruption_that_changes_nothing_gives_no_gain_and_the_summary_stays_json(tmp_path):
    """Identical sequences: the donor is the sequence itself, the corrupted run differs from the clean one by
    rounding only; its gains were ratios of rounding noise (0.23, -0.57) and summary.json held bare NaN (not JSON).
    Now the gains are undefined, and the file has null for them."""
    model = trained_like_dar(dar_block_size=2)
    input_ids = token_batch(batch=1).repeat(3, 1)
    result = rescue_gain(model, input_ids, ["L1.attn", "readout"])
    for entry in result["branches"].values():
        assert all(math.isnan(entry[f"rescue_gain{key}"]) for key in ("0", "1", "_loss0", "_loss1"))
    assert all(math.isnan(value) for value in result["pooled_rescue_gain"])
    from dar_transformers.analysis import _nan_to_none
    json.dumps(_nan_to_none(analyze(model, input_ids)), allow_nan=False)  # raises on any NaN left


def test_rescue_gain_needs_two_sequences():
    with pytest.raises(ValueError, match="at least 2"):
        rescue_gain(trained_like_dar(), token_batch(batch=1))


# ---------------------------------------------------------------------------------------------- summary, files


def test_cka_of_a_representation_constant_over_the_examples_is_undefined_in_both_forms():
    """A read whose output does not vary over the tokens has no CKA: `linear_cka` and the feature form said NaN, the
    Gram form (which `analyze` takes for few tokens) 0.0, "entirely different streams"; now NaN in both, and the
    summary's means leave it out."""
    generator = torch.Generator().manual_seed(0)
    varying = torch.randn(6, 32, generator=generator, dtype=torch.float64)
    constant = torch.ones(6, 32, dtype=torch.float64)
    assert math.isnan(linear_cka(constant, varying))
    gram_form = cka_matrix([constant, varying], [varying, varying])  # 6 examples, width 32: the Gram form
    assert math.isnan(gram_form[0, 0]) and math.isnan(gram_form[0, 1])
    assert gram_form[1, 0] == pytest.approx(1.0) and gram_form[1, 1] == pytest.approx(1.0)


def test_analyze_writes_json_and_pngs(tmp_path):
    model = trained_like_dar(dar_block_size=2).train()
    summary = analyze(model, token_batch(batch=3))
    assert model.training  # analysed in eval mode, handed back as it came (it was left in eval mode)
    json.dumps(summary)  # serialisable
    cka = torch.tensor(summary["cross_stream_cka"]["matrix"])
    assert cka.shape == (5, 5) and ((cka >= -1e-9) & (cka <= 1 + 1e-9)).all()
    balance = summary["stream_balance"]
    assert len(balance["alpha"]) == 5 and len(balance["beta_spread"]) == 4
    assert all(math.isfinite(value) for value in balance["beta_spread"])
    paths = save_plots(summary, tmp_path)
    expected = {"depth_weights_stream0.png", "depth_weights_stream1.png", "depth_entropy.png", "cross_stream_cka.png",
                "rescue_gain.png", "stream_balance.png"}
    assert {path.name for path in paths} == expected
    # every file an analysis writes is one the --out check knows (`ANALYSIS_FILES`)
    known = [name for name in {*expected, "summary.json"}
             if any(fnmatch.fnmatch(name, pattern) for pattern in ANALYSIS_FILES)]
    assert len(known) == len(expected) + 1
    assert all(path.stat().st_size > 1000 for path in paths)


def test_the_matched_depth_mean_leaves_out_the_read_of_the_embedding_alone():
    """The first branch reads one source, the embedding, into both streams: CKA 1 by construction, not a finding."""
    summary = analyze(trained_like_dar(dar_block_size=2), token_batch(batch=3))["cross_stream_cka"]
    matched = summary["matched_depth"]
    assert matched[0] == pytest.approx(1.0, abs=1e-9) and min(matched[1:]) < 0.999
    assert summary["matched_depth_mean"] == pytest.approx(sum(matched[1:]) / len(matched[1:]), abs=1e-12)


def test_pairs_of_reads_of_the_embedding_alone_are_left_out_of_the_off_diagonal_means():
    """Without the partial, every read of block 0 reads the embedding alone: any two of them have CKA 1 by
    construction, in stream 0 and across streams. Those pairs entered the off-diagonal ("diversity") mean and its
    within-stream yardstick; now a pair counts where at least one of its reads mixes two or more sources."""
    model, input_ids = trained_like_dar(dar_block_size=3, dar_include_partial=False), token_batch()
    summary = analyze(model, input_ids)["cross_stream_cka"]
    matrix = torch.tensor(summary["matrix"], dtype=torch.float64)  # [5, 5]: L0.attn, L0.mlp, L1.attn read e0 alone
    single = torch.tensor([True, True, True, False, False])
    both_single = single[:, None] & single[None, :]
    assert torch.allclose(matrix[both_single], torch.ones(9, dtype=torch.float64), atol=1e-9)
    off = ~torch.eye(5, dtype=torch.bool)
    assert summary["off_diagonal_mean"] == pytest.approx(matrix[off & ~both_single].mean().item(), abs=1e-12)
    assert abs(matrix[off].mean().item() - summary["off_diagonal_mean"]) > 1e-3  # the pairs left out matter here
    with torch.no_grad(), record_depth_reads(model) as reads:  # the within-stream yardstick, computed here
        model(input_ids=input_ids)
    stream0 = [reads[branch.name].extracted[..., 0, :].flatten(0, 1) for branch in dar_branches(model)]
    within = cka_matrix(stream0, stream0)
    assert summary["within_stream0_off_diagonal_mean"] == pytest.approx(within[off & ~both_single].mean().item(),
                                                                        abs=1e-9)


def test_a_model_run_on_fewer_layers_is_analysed_over_the_layers_it_runs():
    """`num_hidden_layers` lowered (an early exit): the forward runs the first layers only; the analysis listed
    every layer's reads and failed with a bare KeyError on the first one not run."""
    model = trained_like_dar(dar_block_size=1)
    model.config.num_hidden_layers = 1
    summary = analyze(model, token_batch())
    assert summary["branches"] == ["L0.attn", "L0.mlp", "readout"]
    assert len(summary["stream_balance"]["alpha"]) == 3 and len(summary["rescue_gain"]["branches"]) == 3


def test_analyze_refuses_sequences_without_a_next_token_and_a_mask_of_another_shape():
    model = trained_like_dar()
    with pytest.raises(ValueError, match=r"at least 2 tokens per sequence.*\[3, 1\]"):
        analyze(model, token_batch(length=1))
    with pytest.raises(ValueError, match=r"attention_mask has shape \[3, 11\]; input_ids has \[3, 12\]"):
        analyze(model, token_batch(), attention_mask=torch.ones(3, 11, dtype=torch.long))
    with pytest.raises(ValueError, match="no sequence two real tokens in a row"):
        analyze(model, token_batch(), attention_mask=torch.tensor([[1, 0] * 6] * 3))
    with pytest.raises(ValueError, match="no sequence two real tokens in a row"):  # all NaN, without a word, before
        rescue_gain(model, token_batch(), ["L0.mlp"], attention_mask=torch.zeros(3, 12, dtype=torch.long))
    mask = numpy.ones((3, 12), dtype=numpy.int64)  # a NumPy mask (a tokenizer's return_tensors="np") is a mask too
    mask[0, 9:] = 0
    assert rescue_gain(model, token_batch(), ["L0.mlp"], attention_mask=mask)["branches"]["L0.mlp"] == \
        rescue_gain(model, token_batch(), ["L0.mlp"], attention_mask=torch.from_numpy(mask))["branches"]["L0.mlp"]


def padded(sequences: list[torch.Tensor], side: str, pad_ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """A batch of the sequences padded to the longest on `side` with `pad_ids` [B, T], and its attention mask."""
    length = max(len(sequence) for sequence in sequences)
    input_ids, mask = pad_ids.clone(), torch.zeros(len(sequences), length, dtype=torch.long)
    for row, sequence in enumerate(sequences):
        where = slice(0, len(sequence)) if side == "right" else slice(length - len(sequence), length)
        input_ids[row, where], mask[row, where] = sequence, 1
    return input_ids, mask


@pytest.mark.parametrize("side", ["right", "left"])
def test_a_padded_batch_is_analysed_over_its_real_tokens(side):
    """`analyze` took no attention mask: a tokenizer's padded batch entered every mean with its pad tokens (their
    reads, extractions, losses; left-padded sequences also at shifted positions). With the mask, the maps, the
    entropy, the loss, CKA and the stream statistics equal those of the sequences run one by one, pooled over their
    tokens, and nothing depends on what the padding holds. Negative control: the same batch without its mask."""
    model = trained_like_dar(dar_block_size=2).double()
    sequences = [token_batch(batch=1, length=length, seed=length)[0] for length in (12, 7, 9)]
    pad_zero, mask = padded(sequences, side, torch.zeros(3, 12, dtype=torch.long))
    pad_random, _ = padded(sequences, side, token_batch(seed=5))
    summary = analyze(model, pad_zero, attention_mask=mask)
    other_padding = analyze(model, pad_random, attention_mask=mask)

    def numbers(value) -> list[float]:  # every number of a summary, in order (None: nan)
        if isinstance(value, dict):
            return [x for key in sorted(value) for x in numbers(value[key])]
        if isinstance(value, list):
            return [x for item in value for x in numbers(item)]
        return [math.nan if value is None else float(value)] if isinstance(value, (int, float)) or value is None else []

    assert numbers(summary) == pytest.approx(numbers(other_padding), abs=1e-10, nan_ok=True)

    alone = []  # per sequence: its reads and logits, computed without padding
    for sequence in sequences:
        with record_depth_reads(model) as reads:
            alone.append((reads, model(input_ids=sequence[None]).logits))
    branches = [branch.name for branch in dar_branches(model)]
    losses = torch.cat([torch.nn.functional.cross_entropy(logits[0, :-1], sequence[1:], reduction="none")
                        for (_, logits), sequence in zip(alone, sequences)])
    assert summary["loss"] == pytest.approx(losses.mean().item(), abs=1e-10)
    assert (summary["tokens"], summary["predicted_tokens"]) == (28, 25)
    for row, name in enumerate(branches):
        weights = torch.cat([reads[name].weights[:, 0] for reads, _ in alone], dim=1)  # [S, N, J]
        for stream in (0, 1):
            mapped = [w for w in summary["depth_weights"]["mean_weight"][stream][row] if w is not None]
            assert mapped == pytest.approx(weights[:, :, stream].mean(1).tolist(), abs=1e-7)  # the maps are float32
    extractions = [torch.cat([reads[name].extracted[0] for reads, _ in alone]) for name in branches]  # [N, J, D]
    expected_cka = cka_matrix([x[:, 0] for x in extractions], [x[:, 1] for x in extractions])
    torch.testing.assert_close(torch.tensor(summary["cross_stream_cka"]["matrix"], dtype=torch.float64), expected_cka,
                               atol=1e-9, rtol=0)
    assert summary["cross_stream_cka"]["tokens"] == 28
    readout_rms = torch.stack([reads["readout"].entry_rms * len(sequence) for (reads, _), sequence
                               in zip(alone, sequences)]).sum(0) / 28  # [S, J]: the per-sequence means, pooled
    torch.testing.assert_close(torch.tensor(summary["stream_balance"]["entry_rms"], dtype=torch.float64), readout_rms,
                               atol=1e-10, rtol=0)

    unmasked = analyze(model, pad_zero)  # the pads' reads in the means
    unmasked_map = [w for w in unmasked["depth_weights"]["mean_weight"][0][-1] if w is not None]
    masked_map = [w for w in summary["depth_weights"]["mean_weight"][0][-1] if w is not None]
    assert max(abs(a - b) for a, b in zip(unmasked_map, masked_map)) > 1e-3


def test_one_stream_model_skips_the_two_stream_analyses(tmp_path):
    model = trained_like_dar(dar_num_streams=1, dar_block_size=2)
    summary = analyze(model, token_batch())
    assert "cross_stream_cka" not in summary and "rescue_gain" not in summary
    assert {path.name for path in save_plots(summary, tmp_path)} >= {"depth_weights_stream0.png", "stream_balance.png"}


def test_overwrite_replaces_the_earlier_analysis_whole(tmp_path, capsys):
    """`dar analyze --overwrite` of a one-stream model into the folder of a two-stream analysis left the earlier
    cross_stream_cka.png, rescue_gain.png and depth_weights_stream1.png beside the new summary (which says one
    stream): the folder mixed two analyses. The earlier analysis's files the new one does not write are removed; a file
    of another name is not."""
    arguments = saved_checkpoint_arguments(tmp_path)
    folder = tmp_path / "analysis"
    assert cli_main(["analyze", *arguments, "--out", str(folder)]) == 0
    assert (folder / "cross_stream_cka.png").exists() and (folder / "depth_weights_stream1.png").exists()
    (folder / "notes.txt").write_text("mine")
    (folder / "depth_weights_stream0_annotated.png").write_bytes(b"mine")  # a name the analysis never writes
    one_stream = trained_like_dar(dar_num_streams=1, dar_block_size=2)
    one_stream.save_pretrained(tmp_path / "model")  # the same folder, its tokenizer kept
    capsys.readouterr()
    assert cli_main(["analyze", *arguments, "--out", str(folder), "--overwrite"]) == 0
    written = int(re.search(r"and (\d+) PNGs", capsys.readouterr().out).group(1))
    assert sorted(path.name for path in folder.glob("*.png")) == [
        "depth_entropy.png", "depth_weights_stream0.png", "depth_weights_stream0_annotated.png", "stream_balance.png"]
    assert written == 3 and json.loads((folder / "summary.json").read_text())["num_streams"] == 1
    assert (folder / "notes.txt").read_text() == "mine"


def saved_checkpoint_arguments(tmp_path) -> list[str]:
    """A saved two-stream checkpoint with a word-level tokenizer, and a text: `dar analyze`'s arguments."""
    tokenizers = pytest.importorskip("tokenizers")
    from transformers import PreTrainedTokenizerFast

    model = trained_like_dar(dar_block_size=2)
    model.save_pretrained(tmp_path / "model")
    words = [f"w{index}" for index in range(90)]
    vocabulary = {"[UNK]": 0, **{word: index + 1 for index, word in enumerate(words)}}
    backend = tokenizers.Tokenizer(tokenizers.models.WordLevel(vocabulary, unk_token="[UNK]"))
    backend.pre_tokenizer = tokenizers.pre_tokenizers.Whitespace()
    PreTrainedTokenizerFast(tokenizer_object=backend, unk_token="[UNK]").save_pretrained(tmp_path / "model")
    text = tmp_path / "text.txt"
    text.write_text(" ".join(words[(7 * index) % 90] for index in range(200)))
    return [str(tmp_path / "model"), "--text", str(text), "--seq-len", "16", "--num-sequences", "3",
            "--max-rescue-branches", "2"]


def test_command_line_on_a_saved_checkpoint(tmp_path, capsys):
    """`dar analyze` and `python -m dar_transformers.analysis` on a saved checkpoint with its tokenizer."""
    arguments = saved_checkpoint_arguments(tmp_path)
    assert main([*arguments, "--out", str(tmp_path / "out")]) == 0  # python -m dar_transformers.analysis
    assert cli_main(["analyze", *arguments, "--out", str(tmp_path / "cli")]) == 0  # dar analyze
    assert (tmp_path / "cli" / "summary.json").exists()
    summary = json.loads((tmp_path / "out" / "summary.json").read_text())
    assert summary["batch"] == [3, 16] and list(summary["rescue_gain"]["branches"]) == ["L0.attn", "readout"]
    assert (tmp_path / "out" / "cross_stream_cka.png").exists()

    # An --out holding files of the names the analysis writes (an earlier run's, or the user's own summary.json) was
    # overwritten without a word, and the count of PNGs included the user's: refused before any work, naming them;
    # --overwrite replaces those names only, and the count is of the files written.
    user = tmp_path / "user"
    user.mkdir()
    (user / "summary.json").write_text("mine")
    (user / "photo.png").write_bytes(b"mine")
    capsys.readouterr()
    assert cli_main(["analyze", *arguments, "--out", str(user)]) == 1
    assert f"--out {user} already holds summary.json, which the analysis would replace" in capsys.readouterr().err
    assert (user / "summary.json").read_text() == "mine"
    assert cli_main(["analyze", *arguments, "--out", str(user), "--overwrite"]) == 0
    assert "wrote " + str(user) + "/summary.json and 6 PNGs" in capsys.readouterr().out
    assert json.loads((user / "summary.json").read_text())["batch"] == [3, 16]

    assert (user / "photo.png").read_bytes() == b"mine"
    # Links of those names, dangling or to a file elsewhere: refused like files (a dangling one was not seen, and the
    # summary written through it outside --out); with --overwrite the links are replaced, their targets untouched.
    linked = tmp_path / "linked"
    linked.mkdir()
    (tmp_path / "victim.txt").write_text("elsewhere")
    (linked / "summary.json").symlink_to(tmp_path / "victim.txt")
    (linked / "depth_entropy.png").symlink_to(tmp_path / "not_yet.png")
    assert cli_main(["analyze", *arguments, "--out", str(linked)]) == 1
    assert "already holds depth_entropy.png, summary.json" in capsys.readouterr().err
    assert cli_main(["analyze", *arguments, "--out", str(linked), "--overwrite"]) == 0
    assert (tmp_path / "victim.txt").read_text() == "elsewhere" and not (tmp_path / "not_yet.png").exists()
    assert not (linked / "summary.json").is_symlink() and json.loads((linked / "summary.json").read_text())
    for option, value, least in (("--seq-len", "0", 2), ("--num-sequences", "1", 2)):
        with pytest.raises(SystemExit):  # were a ZeroDivisionError and "The text gives 0 tokens"
            cli_main(["analyze", *arguments, "--out", str(tmp_path / "bad"), option, value])
        assert f"argument {option}: {value} is below {least}, the least it takes" in capsys.readouterr().err
    assert not (tmp_path / "bad").exists()


def test_command_line_failures_leave_out_as_it_was_and_say_so_in_one_line(tmp_path, capsys, monkeypatch):
    """A helper's audit of `dar analyze`: with --overwrite the user's links of the analysis's names were removed
    before any work, also when the run then failed; an --out that could not be made was found only after the
    analysis (`[Errno 2] No such file or directory: '/proc/an'`, naming no option); a failure while writing (a full
    disk) left a truncated plot and the new summary among the earlier analysis's plots; a broken model folder ended
    in a traceback; a Llama folder was loaded whole before being refused as not DAR."""
    arguments = saved_checkpoint_arguments(tmp_path)
    model, rest = arguments[0], arguments[1:]
    # --overwrite over links: a refused run (not a DAR model) leaves them.
    llama_folder = tmp_path / "llama"
    from transformers import LlamaConfig, LlamaForCausalLM

    LlamaForCausalLM(LlamaConfig(hidden_size=16, intermediate_size=32, num_hidden_layers=1, num_attention_heads=2,
                                 vocab_size=100)).save_pretrained(llama_folder)
    linked = tmp_path / "linked"
    linked.mkdir()
    (tmp_path / "mine.json").write_text("mine")
    (linked / "summary.json").symlink_to(tmp_path / "mine.json")
    loaded = []
    monkeypatch.setattr("transformers.AutoModelForCausalLM.from_pretrained",
                        lambda *args, **kwargs: loaded.append(args) or pytest.fail("the weights were loaded"))
    capsys.readouterr()
    assert cli_main(["analyze", str(llama_folder), *rest, "--out", str(linked), "--overwrite"]) == 1
    assert capsys.readouterr().err.strip() == (f"dar analyze: error: Expected a DAR model (model_type 'dar' or "
                                               f"'dar_moe'), got {llama_folder} of model_type 'llama'.")
    assert (linked / "summary.json").is_symlink() and not loaded  # refused from its config.json
    monkeypatch.undo()
    # An --out that cannot be made: refused before the model is read, naming --out; nothing made.
    (tmp_path / "afile").write_text("")
    for out, says in ((tmp_path / "afile" / "sub", "afile is not a folder, so no folder can be made under it"),
                      (Path("/proc/dar-analysis"), "cannot make the folder /proc/dar-analysis")):
        assert cli_main(["analyze", model, *rest, "--out", str(out)]) == 1
        error = capsys.readouterr().err
        assert error.startswith(f"dar analyze: error: --out {out}: ") and says in error, error
    # A broken model folder: one line naming it.
    broken = tmp_path / "broken"
    broken.mkdir()
    for name in ("config.json", "tokenizer.json", "tokenizer_config.json"):
        (broken / name).write_bytes((Path(model) / name).read_bytes())
    (broken / "model.safetensors").write_bytes((Path(model) / "model.safetensors").read_bytes()[:100])
    assert cli_main(["analyze", str(broken), *rest, "--out", str(tmp_path / "never")]) == 1
    error = capsys.readouterr().err
    assert error.startswith(f"dar analyze: error: cannot load {broken}: ") and "Traceback" not in error
    assert len(error.strip().splitlines()) == 1 and not (tmp_path / "never").exists()  # the folder made is removed
    # A failure while writing: --out as it was (the earlier analysis whole, no staging folder left).
    out = tmp_path / "analysis"
    assert cli_main(["analyze", model, *rest, "--out", str(out)]) == 0
    before = {path.name: path.read_bytes() for path in out.iterdir()}
    import matplotlib.figure

    def disk_full(figure, path, *args, **kwargs):
        Path(path).write_bytes(b"truncated")
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(matplotlib.figure.Figure, "savefig", disk_full)
    capsys.readouterr()
    assert cli_main(["analyze", model, *rest, "--out", str(out), "--overwrite"]) == 1
    assert capsys.readouterr().err.strip().splitlines()[-1] == (
        f"dar analyze: error: --out {out}: could not write the analysis (No space left on device); nothing in it was "
        "changed")
    assert {path.name: path.read_bytes() for path in out.iterdir()} == before



@pytest.fixture
def sigint_raises():
    """SIGINT raises KeyboardInterrupt during the test, as in an interactive run: a process a shell starts in the
    background without job control inherits it ignored (the conversion's interrupt tests set it the same way)."""
    import signal

    inherited = signal.signal(signal.SIGINT, signal.default_int_handler)
    yield
    signal.signal(signal.SIGINT, inherited)


@pytest.mark.parametrize("failure", ["error", "interrupt"])
def test_a_failure_or_an_interrupt_while_the_files_move_in_leaves_out_as_it_was(tmp_path, capsys, monkeypatch,
                                                                                 failure, sigint_raises):
    """The staged files were moved into --out one by one, outside any clean-up: a failure or a Ctrl-C between two
    moves left the new summary and some new plots among the earlier analysis's, the rest stranded in a hidden staging
    folder. The earlier files are moved aside first and everything is undone (an interrupt is held meanwhile)."""
    import signal

    from dar_transformers import analysis

    arguments = saved_checkpoint_arguments(tmp_path)
    out = tmp_path / "analysis"
    assert cli_main(["analyze", *arguments, "--out", str(out), "--seq-len", "12"]) == 0
    before = {path.name: path.read_bytes() for path in out.iterdir()}
    moves, replace = [], os.replace

    def fails_at_the_tenth(source, target):
        moves.append(Path(target).name)
        if len(moves) == 10:  # the earlier seven are aside, three new ones in
            if failure == "error":
                raise OSError(5, "Input/output error")
            signal.raise_signal(signal.SIGINT)
        replace(source, target)

    monkeypatch.setattr(analysis.os, "replace", fails_at_the_tenth)
    capsys.readouterr()
    assert cli_main(["analyze", *arguments, "--out", str(out), "--overwrite"]) == (1 if failure == "error" else 130)
    said = capsys.readouterr().err.strip().splitlines()[-1]
    assert said == (f"dar analyze: error: --out {out}: could not put the analysis in place (Input/output error); "
                    "nothing in it was changed" if failure == "error" else
                    "dar analyze: interrupted by SIGINT; nothing was written.")
    assert {path.name: path.read_bytes() for path in out.iterdir()} == before  # no staging folder either


def test_an_interrupt_once_the_analysis_is_in_place_says_so(tmp_path, capsys, monkeypatch, sigint_raises):
    """From a review: Ctrl-C while the staging folder (the earlier analysis's files) was removed was held and raised
    after it, and `dar analyze` said "interrupted" as if nothing had been written, with the new analysis in place."""
    import signal
    import shutil

    from dar_transformers import analysis

    arguments = saved_checkpoint_arguments(tmp_path)
    out = tmp_path / "analysis"
    assert cli_main(["analyze", *arguments, "--out", str(out), "--seq-len", "12"]) == 0
    rmtree = shutil.rmtree

    def interrupted(path, *args, **kwargs):
        signal.raise_signal(signal.SIGINT)
        rmtree(path, *args, **kwargs)

    monkeypatch.setattr(analysis.shutil, "rmtree", interrupted)
    capsys.readouterr()
    assert cli_main(["analyze", *arguments, "--out", str(out), "--overwrite"]) == 130
    assert capsys.readouterr().err.strip().splitlines()[-1] == f"dar analyze: interrupted by SIGINT after {out} was " \
                                                                "written."
    assert json.loads((out / "summary.json").read_text())["batch"] == [3, 16]
    assert not any(path.name.startswith(".") for path in out.iterdir())



def test_an_interrupt_whose_undoing_fails_says_where_the_earlier_files_are(tmp_path, capsys, caplog, monkeypatch,
                                                                           sigint_raises):
    """Ctrl-C during the moves, then a move back that fails (a filesystem gone read-only): the message that names
    where the earlier analysis's files are was replaced by the interrupt, which said "nothing was written". The
    message is logged, and the interrupt claims neither outcome."""
    import signal

    from dar_transformers import analysis

    arguments = saved_checkpoint_arguments(tmp_path)
    out = tmp_path / "analysis"
    assert cli_main(["analyze", *arguments, "--out", str(out), "--seq-len", "12"]) == 0
    moves, replace = [], os.replace

    def interrupted_then_stuck(source, target):
        moves.append(Path(target).name)
        if len(moves) == 3:
            signal.raise_signal(signal.SIGINT)
        if len(moves) > 10 and Path(target).parent == out:  # moving an earlier file back
            raise OSError(30, "Read-only file system")
        replace(source, target)

    monkeypatch.setattr(analysis.os, "replace", interrupted_then_stuck)
    capsys.readouterr()
    assert cli_main(["analyze", *arguments, "--out", str(out), "--overwrite"]) == 130
    assert capsys.readouterr().err.strip().splitlines()[-1] == "dar analyze: interrupted by SIGINT."
    assert "nor move back" in caplog.text and "the earlier analysis's files are in " in caplog.text

def test_a_folder_of_an_analysis_files_name_is_never_replaced(tmp_path, capsys):
    """A folder named rescue_gain.png in --out: with --overwrite the analysis ran, then the move into place failed
    on it with a raw "[Errno 21] Is a directory" naming the hidden staging folder, after the summary and the first
    plots had replaced the earlier ones. Refused before any work, naming it; nothing changed."""
    arguments = saved_checkpoint_arguments(tmp_path)
    out = tmp_path / "analysis"
    (out / "rescue_gain.png").mkdir(parents=True)
    (out / "rescue_gain.png" / "mine.txt").write_text("mine")
    (out / "summary.json").write_text("mine")
    capsys.readouterr()
    assert cli_main(["analyze", *arguments, "--out", str(out), "--overwrite"]) == 1
    assert capsys.readouterr().err == (f"dar analyze: error: --out {out} holds a folder named rescue_gain.png, where "
                                       "the analysis writes a file; move it away or pass another --out.\n")
    assert sorted(path.name for path in out.iterdir()) == ["rescue_gain.png", "summary.json"]
    assert (out / "summary.json").read_text() == "mine"


def test_an_empty_out_is_refused_and_a_quoted_tilde_is_the_home_folder(tmp_path, capsys, monkeypatch):
    """`--out "$OUT"` with OUT unset was the working directory (with --overwrite, the user's summary.json there
    replaced); `--out '~/x'` (or `--out=~/x`, which the shell leaves) wrote a folder named "~" in the working directory
    while the message named the home folder, and `--text '~/t.txt'` was "No such file"."""
    arguments = saved_checkpoint_arguments(tmp_path)
    work, home = tmp_path / "work", tmp_path / "home"
    work.mkdir(), home.mkdir()
    (work / "summary.json").write_text("mine")
    monkeypatch.chdir(work)
    monkeypatch.setenv("HOME", str(home))
    (home / "t.txt").write_text(Path(arguments[2]).read_text())
    capsys.readouterr()
    with pytest.raises(SystemExit):
        cli_main(["analyze", *arguments, "--out", "", "--overwrite"])
    assert "argument --out: an empty path (an unset shell variable?)" in capsys.readouterr().err
    assert (work / "summary.json").read_text() == "mine"
    assert cli_main(["analyze", arguments[0], "--text", "~/t.txt", *arguments[3:], "--out=~/x"]) == 0
    assert f"wrote {home / 'x'}/summary.json" in capsys.readouterr().out
    assert (home / "x" / "summary.json").is_file() and sorted(path.name for path in work.iterdir()) == ["summary.json"]


def test_a_killed_analysis_staging_folder_is_named_and_left(tmp_path, caplog):
    """A SIGKILLed analysis (the out-of-memory killer) leaves its hidden staging folder in --out, which no later run
    mentioned (and `push_to_hub` of a model folder would upload). Named on the log, never removed (another analysis
    may be writing into it). One killed between its moves holds the earlier analysis's files, their only copy: named
    as such (a review found the warning saying it held none of the user's files, to remove it)."""
    arguments = saved_checkpoint_arguments(tmp_path)
    out = tmp_path / "analysis"
    (out / ".dar-analyze.k1ll3d.partial").mkdir(parents=True)
    (out / ".dar-analyze.k1ll3d.partial" / "summary.json").write_text("{}")
    (out / ".dar-analyze.m0v1ng.partial" / "replaced").mkdir(parents=True)
    (out / ".dar-analyze.m0v1ng.partial" / "replaced" / "depth_entropy.png").write_bytes(b"earlier")
    assert cli_main(["analyze", *arguments, "--out", str(out)]) == 0
    assert f"{out / '.dar-analyze.k1ll3d.partial'} is the staging folder of an analysis that did not finish" \
        in caplog.text
    assert (f"{out / '.dar-analyze.m0v1ng.partial'} is the staging folder of an analysis killed while it replaced "
            f"another: {out / '.dar-analyze.m0v1ng.partial' / 'replaced'} holds the earlier analysis's "
            "depth_entropy.png, its only copy") in caplog.text
    assert (out / ".dar-analyze.k1ll3d.partial" / "summary.json").read_text() == "{}"


def test_sigterm_under_python_m_cleans_up_as_ctrl_c_does(tmp_path, capsys, monkeypatch):
    """`python -m dar_transformers.analysis` ended at SIGTERM at once (`dar analyze` raises it as an interrupt),
    leaving its staging folder, or the folders it made, behind."""
    import signal

    from dar_transformers import analysis

    arguments = saved_checkpoint_arguments(tmp_path)
    monkeypatch.setattr(analysis, "analyze", lambda *args, **kwargs: os.kill(os.getpid(), signal.SIGTERM))
    capsys.readouterr()
    assert main([*arguments, "--out", str(tmp_path / "made" / "out")]) == 128 + signal.SIGTERM
    assert capsys.readouterr().err.strip().splitlines()[-1] == ("python -m dar_transformers.analysis: interrupted by "
                                                                "SIGTERM.")
    assert not (tmp_path / "made").exists()


def test_save_plots_replaces_a_link_instead_of_writing_through_it(tmp_path):
    """`save_plots(summary, folder)`, the public API, wrote each PNG through a symbolic link of its name: a link to a
    file outside the folder got the plot's bytes. The link is replaced by the plot, its target untouched."""
    model = trained_like_dar(dar_block_size=2)
    summary = analyze(model, token_batch(), rescue_branches=[])
    folder = tmp_path / "plots"
    folder.mkdir()
    (tmp_path / "thesis.txt").write_text("mine")
    (folder / "depth_entropy.png").symlink_to(tmp_path / "thesis.txt")
    written = save_plots(summary, folder)
    assert folder / "depth_entropy.png" in written and not (folder / "depth_entropy.png").is_symlink()
    assert (folder / "depth_entropy.png").read_bytes().startswith(b"\x89PNG")
    assert (tmp_path / "thesis.txt").read_text() == "mine"

def test_a_model_folder_spelled_with_a_tilde_loads(tmp_path, capsys, monkeypatch):
    """`dar analyze '~/m'` (quoted: the shell left the tilde) passed the folder check, which expands it, and then
    went to the Hub with the literal name ("Repo id must use alphanumeric chars")."""
    arguments = saved_checkpoint_arguments(tmp_path)
    monkeypatch.setenv("HOME", str(tmp_path))
    assert cli_main(["analyze", "~/model", *arguments[1:], "--out", str(tmp_path / "out")]) == 0
    assert json.loads((tmp_path / "out" / "summary.json").read_text())["model"] == "~/model"


def test_command_line_without_matplotlib_says_so_before_any_work(tmp_path, capsys, monkeypatch):
    """matplotlib is an extra (`dar-transformers[analysis]`): without it the command died with a traceback after the
    whole analysis, having written a summary.json beside an earlier run's plots."""
    import builtins

    arguments = saved_checkpoint_arguments(tmp_path)
    capsys.readouterr()
    real_import = builtins.__import__

    def without_matplotlib(name, *args, **kwargs):
        if name.split(".")[0] == "matplotlib":
            raise ModuleNotFoundError("No module named 'matplotlib'")
        return real_import(name, *args, **kwargs)

    monkeypatch.setattr(builtins, "__import__", without_matplotlib)
    assert cli_main(["analyze", *arguments, "--out", str(tmp_path / "out")]) == 1
    assert capsys.readouterr().err == ("dar analyze: error: the plots need matplotlib, which is not installed: pip "
                                       "install matplotlib (or the package's extra, dar-transformers[analysis])\n")
    assert not (tmp_path / "out").exists()


def test_a_text_of_long_tokens_is_read_far_enough(tmp_path):
    """The analysis tokenised only num_sequences x seq_len x 16 characters of the text: a text of long words (a
    token each) was refused as too short although it held enough tokens."""
    tokenizers = pytest.importorskip("tokenizers")
    from transformers import PreTrainedTokenizerFast

    from dar_transformers.analysis import text_batch

    words = [f"{'x' * 60}{index}" for index in range(50)]
    backend = tokenizers.Tokenizer(tokenizers.models.WordLevel({word: i for i, word in enumerate(words)} | {"[UNK]": 50},
                                                               unk_token="[UNK]"))
    backend.pre_tokenizer = tokenizers.pre_tokenizers.Whitespace()
    tokenizer = PreTrainedTokenizerFast(tokenizer_object=backend, unk_token="[UNK]")
    batch = text_batch(tokenizer, " ".join(words[index % 50] for index in range(500)), 4, 16)
    assert batch.shape == (4, 16) and batch[0, 0].item() == 0 and batch[3, 15].item() == 63 % 50


def test_command_line_refuses_bad_paths_and_lengths_before_any_work(tmp_path, capsys):
    """An --out that is a file was refused after the whole analysis as "[Errno 17] File exists"; an unreadable --text
    after the model loaded, without naming the flag; a local model path that is not there as a malformed Hub id; and
    --seq-len 1 gave a NaN loss (a next-token loss needs two tokens)."""
    arguments = saved_checkpoint_arguments(tmp_path)
    (tmp_path / "file").write_text("x")
    capsys.readouterr()
    for changed, message in (
        (["--out", str(tmp_path / "file")], f"--out {tmp_path / 'file'} exists and is not a folder"),
        (["--text", str(tmp_path / "none.txt"), "--out", str(tmp_path / "o")],
         f"--text {tmp_path / 'none.txt'}: No such file or directory"),
    ):
        assert cli_main(["analyze", *arguments, *changed]) == 1
        assert capsys.readouterr().err == f"dar analyze: error: {message}\n"
    assert cli_main(["analyze", str(tmp_path / "no-model"), *arguments[1:], "--out", str(tmp_path / "o")]) == 1
    assert capsys.readouterr().err == f"dar analyze: error: no folder {tmp_path / 'no-model'}\n"
    with pytest.raises(SystemExit):
        cli_main(["analyze", *arguments, "--out", str(tmp_path / "o"), "--seq-len", "1"])
    assert "argument --seq-len: 1 is below 2" in capsys.readouterr().err
    assert not (tmp_path / "o").exists()


def test_a_tokenizer_of_another_model_is_one_line_not_an_index_error(tmp_path, capsys):
    """A tokenizer whose ids run past the model's vocabulary (another model's): `dar analyze` and `dar generate`
    printed the embedding's bare IndexError traceback."""
    import tokenizers
    from transformers import PreTrainedTokenizerFast

    arguments = saved_checkpoint_arguments(tmp_path)
    words = {f"w{index}": 200 + index for index in range(90)}  # ids beyond the tiny vocabulary of 97
    backend = tokenizers.Tokenizer(tokenizers.models.WordLevel({"[UNK]": 0, **words}, unk_token="[UNK]"))
    backend.pre_tokenizer = tokenizers.pre_tokenizers.Whitespace()
    PreTrainedTokenizerFast(tokenizer_object=backend, unk_token="[UNK]").save_pretrained(tmp_path / "model")
    assert cli_main(["analyze", *arguments, "--out", str(tmp_path / "out")]) == 1
    error = capsys.readouterr().err
    assert "Traceback" not in error and re.search(r"gives token id 2\d\d, but the model's vocabulary has 97 ids", error)
    assert cli_main(["generate", str(tmp_path / "model"), "--prompt", "w1 w2", "--no-chat-template"]) == 1
    assert "but the model's vocabulary has 97 ids" in capsys.readouterr().err
    assert not (tmp_path / "out").exists()


def test_a_peft_model_is_analysed_as_the_model_it_adapts():
    """`analyze(peft_model, ...)`: AttributeError "'DARForCausalLM' object has no attribute 'layers'" (PEFT's
    `base_model` is its LoRA wrapper). It reads the adapted model, adapters included."""
    from peft import LoraConfig, get_peft_model

    model = trained_like_dar(dar_block_size=2)
    peft_model = get_peft_model(model, LoraConfig(r=2, target_modules=["q_proj"], init_lora_weights=False))
    peft_model.eval()
    ids = token_batch()
    summary = analyze(peft_model, ids, rescue_branches=["L0.attn"])
    with torch.no_grad():
        expected = torch.nn.functional.cross_entropy(peft_model(input_ids=ids).logits[:, :-1].flatten(0, 1).double(),
                                                     ids[:, 1:].flatten())
    assert summary["loss"] == pytest.approx(expected.item(), rel=1e-5)
    assert [branch.name for branch in dar_branches(peft_model)] == [branch.name for branch in dar_branches(model)]


def test_the_two_stream_analyses_refuse_a_one_stream_model_naming_why():
    """`cross_stream_cka` and `rescue_gain` (exported) raised a bare IndexError on a one-stream model."""
    from dar_transformers.analysis import cross_stream_cka

    model = trained_like_dar(dar_num_streams=1)
    ids = token_batch()
    with record_depth_reads(model) as reads:
        model(input_ids=ids)
    with pytest.raises(ValueError, match="cross_stream_cka compares the two residual streams; this model has 1"):
        cross_stream_cka(reads, dar_branches(model))
    with pytest.raises(ValueError, match="rescue_gain compares the two residual streams; this model has 1"):
        rescue_gain(model, ids)


def test_a_model_of_a_folders_remote_code_is_analysed(tmp_path):
    """A DAR model loaded with `trust_remote_code=True` before the package registered its classes is a class of the
    folder's copy of the code: `analyze` refused it as "Expected a DAR model (model_type 'dar'), got
    DARForCausalLM". Loaded in a fresh process that imports the package only after the model, as from the Hub."""
    import subprocess
    import sys
    import textwrap

    model = trained_like_dar(dar_block_size=2)
    model.save_pretrained(tmp_path / "model")
    script = textwrap.dedent(f"""
        import torch
        from transformers import AutoModelForCausalLM
        model = AutoModelForCausalLM.from_pretrained({str(tmp_path / "model")!r}, trust_remote_code=True).eval()
        assert type(model).__module__.startswith("transformers_modules."), type(model).__module__
        from dar_transformers.analysis import analyze
        ids = torch.randint(3, 97, (3, 12), generator=torch.Generator().manual_seed(0))
        print(analyze(model, ids, rescue_branches=["L0.attn"])["loss"])
    """)
    environment = {"PATH": __import__("os").environ["PATH"], "HOME": str(tmp_path), "OMP_NUM_THREADS": "1",
                   "HF_HUB_OFFLINE": "1", "HF_MODULES_CACHE": str(tmp_path / "modules")}
    run = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=300, env=environment)
    assert run.returncode == 0, run.stderr[-3000:]
    with torch.no_grad():
        expected = analyze(model, token_batch(3, 12, 0), rescue_branches=["L0.attn"])["loss"]
    assert float(run.stdout.split()[-1]) == pytest.approx(expected, rel=1e-6)
