# SPDX-License-Identifier: Apache-2.0
# Copyright 2026 The dar-transformers authors.
"""The README's "Quick start", run as written: its shell block through the `dar` CLI and its Python block as a
script, on a tiny Llama folder named as the README's SmolLM2 download (nothing is fetched)."""

import contextlib
import io
import os
import re
import shlex
from pathlib import Path

import torch
from conftest import SHAPE, VOCAB, make_tokenizer, max_logit_difference, spread_weights
from transformers import LlamaConfig, LlamaForCausalLM

from dar_transformers.cli import main as cli_main

README = Path(__file__).resolve().parents[1] / "README.md"


def quick_start_blocks() -> dict[str, list[str]]:
    """The fenced blocks of the "## Quick start" section, by language."""
    text = README.read_text(encoding="utf-8")
    section = text.split("\n## Quick start\n", 1)[1].split("\n## ", 1)[0]
    blocks: dict[str, list[str]] = {}
    for language, body in re.findall(r"```(\w+)\n(.*?)```", section, flags=re.S):
        blocks.setdefault(language, []).append(body)
    return blocks


def save_tiny_smollm2(folder: Path) -> None:
    """What `hf download ... --local-dir smollm2` gives, at a tiny size: a Llama folder with a chat template, with
    enough layers for the README's `--block-size 8` (8 branches)."""
    config = LlamaConfig(**{**SHAPE, "num_hidden_layers": 4}, vocab_size=VOCAB, tie_word_embeddings=True,
                         bos_token_id=1, eos_token_id=2)
    torch.manual_seed(0)
    spread_weights(LlamaForCausalLM(config)).save_pretrained(folder)
    make_tokenizer().save_pretrained(folder)


def test_the_quick_start_runs_as_written(tmp_path, monkeypatch):
    blocks = quick_start_blocks()
    assert len(blocks.get("bash", [])) == 1 and len(blocks.get("python", [])) == 1, blocks.keys()
    save_tiny_smollm2(tmp_path / "smollm2")
    monkeypatch.chdir(tmp_path)

    commands = [shlex.split(line, comments=True) for line in blocks["bash"][0].splitlines() if line.strip()]
    assert [command[:2] for command in commands] == [["dar", "convert"], ["dar", "generate"]]
    for command in commands:
        stdout = io.StringIO()
        with contextlib.redirect_stdout(stdout), contextlib.redirect_stderr(io.StringIO()):
            assert cli_main(command[1:]) == 0, command
    assert stdout.getvalue().strip()  # the answer `dar generate` streamed

    printed = io.StringIO()
    namespace: dict = {}
    with contextlib.redirect_stdout(printed):
        exec(compile(blocks["python"][0], str(README), "exec"), namespace)  # noqa: S102 - the README's own code
    answer = printed.getvalue()
    assert "'role': 'assistant'" in answer and "What is the capital of France?" in answer

    model, full, fresh = namespace["model"], namespace["full"], namespace["fresh"]
    assert type(model).__name__ == "DARForCausalLM" and model.config.dar_block_size == 8
    assert full.config.dar_block_size == 1 and (tmp_path / "smollm2-dar-full" / "config.json").is_file()
    source, ids = LlamaForCausalLM.from_pretrained(tmp_path / "smollm2"), torch.tensor([[1, 40, 7, 99, 250, 3]])
    for dar in (model, full):  # upcycled exactly: the source's logits
        assert max_logit_difference(dar, source, ids) < 1e-4
    assert type(fresh).__name__ == "DARForCausalLM" and fresh.config.num_hidden_layers == 2
    with torch.no_grad():
        assert fresh(torch.tensor([[1, 2, 3]])).logits.shape == (1, 3, 128)
    assert sorted(os.listdir(tmp_path)) == ["smollm2", "smollm2-dar", "smollm2-dar-full"]
