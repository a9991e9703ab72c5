# SPDX-License-Identifier: Apache-2.0
"""The converter (CPU, tiny models): exact upcycling of Llama/Mistral/Qwen2/Qwen3, the written repo folder,
remote-code reloading without the package, the CLI, and a clear error with nothing written for each bad input."""

import hashlib
import json
import os
import subprocess
import sys
import textwrap
from importlib.metadata import entry_points
from pathlib import Path

import gguf
import numpy as np
import pytest
import torch
from safetensors.torch import load_file, save_file
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
from transformers import (
    AutoModelForCausalLM,
    AutoTokenizer,
    GemmaConfig,
    GemmaForCausalLM,
    GPT2Config,
    GPT2LMHeadModel,
    LlamaConfig,
    LlamaForCausalLM,
    MistralConfig,
    MistralForCausalLM,
    MixtralConfig,
    MixtralForCausalLM,
    PreTrainedTokenizerFast,
    Qwen2Config,
    Qwen2ForCausalLM,
    Qwen3Config,
    Qwen3ForCausalLM,
)

from dar_transformers import DARForCausalLM
from dar_transformers.cli import main as cli_main
from dar_transformers.convert import (
    UnsupportedArchitectureError,
    VerificationError,
    chat_input_ids,
    convert,
    upcycle,
    upcycle_model,
)

REPO = Path(__file__).resolve().parents[1]
SHAPE = dict(hidden_size=32, intermediate_size=64, num_hidden_layers=3, num_attention_heads=4, num_key_value_heads=2)
VOCAB = 320
CHAT_TEMPLATE = (
    "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)
SHORT_PROMPTS = ["The capital of France is Paris, and the capital of Italy is Rome.", "Hello world, tiny models"]
FAST = dict(prompts=SHORT_PROMPTS, max_new_tokens=12, progress=False)  # keeps the default suite quick


def make_tokenizer() -> PreTrainedTokenizerFast:
    """A byte-level BPE tokenizer (300 tokens) with a chat template, trained in milliseconds."""
    tokenizer = Tokenizer(models.BPE(unk_token="<unk>"))
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=300,
        special_tokens=["<unk>", "<s>", "</s>", "<|im_start|>", "<|im_end|>"],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
    )
    tokenizer.train_from_iterator(["The capital of France is Paris. Hello world, tiny models are fun."] * 10, trainer)
    return PreTrainedTokenizerFast(
        tokenizer_object=tokenizer, bos_token="<s>", eos_token="</s>", unk_token="<unk>", chat_template=CHAT_TEMPLATE
    )


def spread_weights(model: torch.nn.Module, seed: int = 0) -> torch.nn.Module:
    """Random weights at a scale where logits reach a few units (default init: below 1), so a 1e-5 bar is a real test."""
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, parameter in model.named_parameters():
            noise = torch.randn(parameter.shape, generator=generator)
            parameter.copy_(1 + 0.1 * noise if "norm" in name else 0.15 * noise)
    return model.eval()


FAMILIES = {
    "llama": (LlamaConfig, LlamaForCausalLM, {}),
    "mistral": (MistralConfig, MistralForCausalLM, {"sliding_window": 5}),  # shorter than the prompts
    "qwen2": (Qwen2Config, Qwen2ForCausalLM, {}),
    "qwen3": (Qwen3Config, Qwen3ForCausalLM, {"head_dim": 16}),  # head_dim != hidden / heads, as in Qwen3
}


def make_source(family: str = "llama", tied: bool = True, seed: int = 0):
    config_class, model_class, extra = FAMILIES[family]
    torch.manual_seed(seed)
    config = config_class(**SHAPE, **extra, vocab_size=VOCAB, tie_word_embeddings=tied, bos_token_id=1, eos_token_id=2)
    return spread_weights(model_class(config), seed)


def save_source(folder: Path, family: str = "llama", tied: bool = True, shard: str | None = None) -> Path:
    model = make_source(family, tied)
    model.save_pretrained(folder, **({"max_shard_size": shard} if shard else {}))
    make_tokenizer().save_pretrained(folder)
    return folder


def assert_same_state(model_a: torch.nn.Module, model_b: torch.nn.Module) -> None:
    """Same parameter names, dtypes and values, bit for bit."""
    state_a, state_b = model_a.state_dict(), model_b.state_dict()
    assert state_a.keys() == state_b.keys()
    for name, tensor in state_a.items():
        assert tensor.dtype == state_b[name].dtype and torch.equal(tensor, state_b[name]), name


def dar_parameter_names_of(folder: Path) -> set[str]:
    index = json.loads((folder / "model.safetensors.index.json").read_text())
    return {name for name in index["weight_map"] if "_residual." in name or "final_readout" in name}


def tree_digest(folder: Path) -> dict[str, str]:
    return {str(p.relative_to(folder)): hashlib.sha256(p.read_bytes()).hexdigest() for p in folder.rglob("*") if p.is_file()}


def logits(model, input_ids) -> torch.Tensor:
    with torch.no_grad():
        return model(input_ids).logits


def llama_cpp_permute(weight: np.ndarray, num_heads: int) -> np.ndarray:
    """llama.cpp's rotary layout for attn_q / attn_k (transformers' GGUF loader undoes it)."""
    return weight.reshape(num_heads, 2, weight.shape[0] // num_heads // 2, *weight.shape[1:]).swapaxes(1, 2).reshape(weight.shape)


GGUF_LAYER_NAMES = {
    "self_attn.q_proj": "attn_q", "self_attn.k_proj": "attn_k", "self_attn.v_proj": "attn_v",
    "self_attn.o_proj": "attn_output", "mlp.gate_proj": "ffn_gate", "mlp.up_proj": "ffn_up",
    "mlp.down_proj": "ffn_down", "input_layernorm": "attn_norm", "post_attention_layernorm": "ffn_norm",
}
GGUF_GLOBAL_NAMES = {"model.embed_tokens.weight": "token_embd.weight", "model.norm.weight": "output_norm.weight",
                     "lm_head.weight": "output.weight"}


def write_tiny_gguf(path: Path, model: LlamaForCausalLM, tokenizer: PreTrainedTokenizerFast) -> Path:
    """A float32 Llama GGUF with a BPE ("gpt2") tokenizer and chat template, as llama.cpp's converter writes it."""
    config = model.config
    writer = gguf.GGUFWriter(str(path), "llama")
    writer.add_name("tiny-llama")
    writer.add_block_count(config.num_hidden_layers)
    writer.add_context_length(config.max_position_embeddings)
    writer.add_embedding_length(config.hidden_size)
    writer.add_feed_forward_length(config.intermediate_size)
    writer.add_head_count(config.num_attention_heads)
    writer.add_head_count_kv(config.num_key_value_heads)
    writer.add_rope_freq_base(config.rope_parameters["rope_theta"])
    writer.add_layer_norm_rms_eps(config.rms_norm_eps)
    writer.add_rope_dimension_count(config.head_dim)
    writer.add_vocab_size(config.vocab_size)
    spec = json.loads(tokenizer.backend_tokenizer.to_str())
    vocab = spec["model"]["vocab"]
    tokens = sorted(vocab, key=vocab.get) + [f"<unused{i}>" for i in range(config.vocab_size - len(vocab))]
    special = {added["content"] for added in spec["added_tokens"]}
    writer.add_tokenizer_model("gpt2")
    writer.add_token_list(tokens)
    writer.add_token_types([3 if token in special else 1 for token in tokens])  # 3: control, 1: normal
    writer.add_token_merges([merge if isinstance(merge, str) else " ".join(merge) for merge in spec["model"]["merges"]])
    writer.add_bos_token_id(1)
    writer.add_eos_token_id(2)
    writer.add_unk_token_id(0)
    writer.add_chat_template(tokenizer.chat_template)
    for key, tensor in model.state_dict().items():
        if key == "lm_head.weight" and config.tie_word_embeddings:
            continue
        array = tensor.numpy().astype(np.float32)
        if key in GGUF_GLOBAL_NAMES:
            writer.add_tensor(GGUF_GLOBAL_NAMES[key], array)
            continue
        layer, module = key.split(".")[2], ".".join(key.split(".")[3:-1])
        if module == "self_attn.q_proj":
            array = llama_cpp_permute(array, config.num_attention_heads)
        elif module == "self_attn.k_proj":
            array = llama_cpp_permute(array, config.num_key_value_heads)
        writer.add_tensor(f"blk.{layer}.{GGUF_LAYER_NAMES[module]}.weight", array)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path


@pytest.fixture(scope="module")
def converted_llama(tmp_path_factory):
    """A tied tiny Llama folder converted with all default verification prompts (text and chat)."""
    root = tmp_path_factory.mktemp("tied")
    source = save_source(root / "source")
    before = tree_digest(source)
    result = upcycle(source, root / "out", dar_block_size=2, tolerance=1e-5, progress=False)
    return root, source, before, result


def test_tied_llama_folder_converts_exactly_and_writes_a_complete_repo(converted_llama):
    root, source, before, result = converted_llama
    report = result.report
    assert report.passed and report.greedy_identical
    assert report.max_abs_logit_difference <= 1e-5
    assert max(check.max_abs_logit for check in report.checks) > 2  # the bar is tight relative to the logits
    assert [check.name for check in report.checks][-1].startswith("chat:")  # the chat template was exercised
    assert all(check.num_tokens >= 64 for check in report.checks[:-1])

    out = root / "out"
    names = {p.name for p in out.iterdir()}
    expected = {"config.json", "configuration_dar.py", "modeling_dar.py", "model.safetensors.index.json",
                "model-00001-of-00002.safetensors", "model-00002-of-00002.safetensors", "generation_config.json",
                "tokenizer.json", "tokenizer_config.json", "README.md"}
    assert expected <= names, names
    assert not [p for p in root.iterdir() if p.name.startswith(".out.")]  # no staging folder left behind
    umask = os.umask(0)
    os.umask(umask)
    assert (out.stat().st_mode & 0o777) == 0o777 & ~umask  # not mkdtemp's owner-only mode
    assert all((p.stat().st_mode & 0o777) == 0o666 & ~umask for p in out.iterdir())
    config = json.loads((out / "config.json").read_text())
    assert config["auto_map"]["AutoModelForCausalLM"] == "modeling_dar.DARForCausalLM"
    assert config["model_type"] == "dar" and config["dar_block_size"] == 2 and config["tie_word_embeddings"] is True
    template = (out / "chat_template.jinja").read_text() if "chat_template.jinja" in names else ""
    assert "<|im_start|>" in template + (out / "tokenizer_config.json").read_text()
    card = (out / "README.md").read_text()
    assert f"{report.max_abs_logit_difference:.3e}" in card and "PASSED" in card
    assert "trust_remote_code=True" in card and "Block DAR, 3 blocks" in card
    answers = [line for line in card.splitlines() if line.startswith(("| source |", "| converted |"))]
    assert len(answers) == 2 and answers[0].split("|")[2] == answers[1].split("|")[2]  # the same chat answer
    assert tree_digest(source) == before  # the source is never modified

    index = json.loads((out / "model.safetensors.index.json").read_text())
    dar_shard = {file for name, file in index["weight_map"].items() if "_residual." in name or "final_readout" in name}
    assert dar_shard == {"model-00002-of-00002.safetensors"}  # DAR's new parameters: a shard of their own
    assert set(load_file(out / "model-00002-of-00002.safetensors")) == dar_parameter_names_of(out)

    reloaded = AutoModelForCausalLM.from_pretrained(out).eval()
    assert isinstance(reloaded, DARForCausalLM)
    ids = torch.randint(0, VOCAB, (2, 20), generator=torch.Generator().manual_seed(1))
    source_model = LlamaForCausalLM.from_pretrained(source).eval()
    in_memory = upcycle_model(source_model, dar_block_size=2)  # the in-memory conversion: the same tensors, bit for bit
    assert_same_state(reloaded, in_memory)
    assert torch.equal(logits(reloaded, ids), logits(in_memory, ids))
    assert (logits(reloaded, ids) - logits(source_model, ids)).abs().max() <= 1e-5


def test_converted_folder_loads_with_remote_code_where_the_package_is_not_importable(converted_llama, tmp_path):
    root, _, _, result = converted_llama
    model = AutoModelForCausalLM.from_pretrained(root / "out").eval()
    ids = torch.randint(0, VOCAB, (2, 20), generator=torch.Generator().manual_seed(2))
    torch.save(ids, tmp_path / "ids.pt")
    script = textwrap.dedent(
        f"""
        import importlib.util, os, sys
        sys.path[:] = [p for p in sys.path if os.path.realpath(p) != {str(REPO / "src")!r} and p not in ("", ".")]
        assert importlib.util.find_spec("dar_transformers") is None, "the package must not be importable here"
        import torch
        from transformers import AutoModelForCausalLM
        model = AutoModelForCausalLM.from_pretrained({str(root / "out")!r}, trust_remote_code=True).eval()
        assert type(model).__module__.startswith("transformers_modules"), type(model).__module__
        assert "dar_transformers" not in sys.modules
        with torch.no_grad():
            torch.save(model(torch.load({str(tmp_path / "ids.pt")!r})).logits, {str(tmp_path / "logits.pt")!r})
        """
    )
    env = {"PATH": os.environ.get("PATH", ""), "HOME": str(tmp_path), "HF_HOME": str(tmp_path / "hf"),
           "HF_HUB_OFFLINE": "1", "OMP_NUM_THREADS": str(torch.get_num_threads())}
    completed = subprocess.run([sys.executable, "-I", "-c", script], cwd=tmp_path, env=env, capture_output=True, text=True)
    assert completed.returncode == 0, completed.stderr[-3000:]
    remote_logits = torch.load(tmp_path / "logits.pt")
    assert torch.equal(remote_logits, logits(model, ids))


def test_untied_sharded_llama_folder_converts_to_a_sharded_exact_repo(tmp_path):
    source = save_source(tmp_path / "source", tied=False, shard="40KB")
    assert (source / "model.safetensors.index.json").is_file()
    result = upcycle(source, tmp_path / "out", dar_block_size=3, tolerance=1e-5, max_shard_size="40KB", **FAST)
    assert result.report.max_abs_logit_difference <= 1e-5 and result.report.greedy_identical
    out = tmp_path / "out"
    assert (out / "model.safetensors.index.json").is_file() and len(list(out.glob("model-*.safetensors"))) > 1
    reloaded = AutoModelForCausalLM.from_pretrained(out).eval()
    assert not reloaded.config.tie_word_embeddings
    assert not torch.equal(reloaded.lm_head.weight, reloaded.model.embed_tokens.weight)
    ids = torch.randint(0, VOCAB, (1, 24), generator=torch.Generator().manual_seed(3))
    source_model = LlamaForCausalLM.from_pretrained(source).eval()
    assert (logits(reloaded, ids) - logits(source_model, ids)).abs().max() <= 1e-5


def test_gguf_file_converts_exactly_with_its_tokenizer_and_chat_template(tmp_path):
    source_model, tokenizer = make_source("llama", tied=True), make_tokenizer()
    (tmp_path / "gguf").mkdir()
    gguf_path = write_tiny_gguf(tmp_path / "gguf" / "tiny.gguf", source_model, tokenizer)
    before = tree_digest(tmp_path / "gguf")
    result = upcycle(gguf_path, tmp_path / "out", dar_block_size=2, tolerance=1e-5, **FAST)
    assert result.report.passed and result.report.checks[-1].name.startswith("chat:")
    out = tmp_path / "out"
    config = json.loads((out / "config.json").read_text())
    assert "quantization_config" not in config and config["tie_word_embeddings"] is True
    reloaded = AutoModelForCausalLM.from_pretrained(out).eval()
    ids = torch.randint(0, VOCAB, (2, 40), generator=torch.Generator().manual_seed(4))
    assert (logits(reloaded, ids) - logits(source_model, ids)).abs().max() <= 1e-5  # against the HF original
    written = AutoTokenizer.from_pretrained(out)
    text = "The capital of France is Paris. Hello"
    assert written(text)["input_ids"] == tokenizer(text)["input_ids"]
    assert written.chat_template == tokenizer.chat_template
    assert tree_digest(tmp_path / "gguf") == before


@pytest.mark.parametrize("family", ["mistral", "qwen2", "qwen3"])
@pytest.mark.parametrize("tied", [True, False])
def test_family_converts_exactly_with_its_own_branch_modules(family, tied):
    source = make_source(family, tied).train()  # a model in training mode is copied, not switched to eval
    before = {name: tensor.clone() for name, tensor in source.state_dict().items()}
    result = upcycle(source, dar_block_size=2, tolerance=1e-5, max_new_tokens=12, progress=False)
    report = result.report
    assert report.max_abs_logit_difference <= 1e-5, report.table()
    assert report.greedy_identical and max(check.max_abs_logit for check in report.checks) > 2
    dar = result.model
    source_attention = type(source.model.layers[0].self_attn)
    assert type(dar.model.layers[0].self_attn) is source_attention and dar.config.dar_branch_family == family
    family_keys = {"qwen2": "self_attn.q_proj.bias", "qwen3": "self_attn.q_norm.weight"}
    if family in family_keys:  # the family's own parameters arrived
        key = f"model.layers.1.{family_keys[family]}"
        assert torch.equal(dar.state_dict()[key], source.state_dict()[key])
    if family == "mistral":
        assert dar.config.sliding_window == 5  # prompts are 64 tokens: the window matters and is kept
    assert all(torch.equal(before[name], tensor) for name, tensor in source.state_dict().items())
    assert source.training


def test_float64_conversion_meets_the_1e_8_default_and_leaves_the_source_in_float32():
    source = make_source("llama", tied=False)
    result = upcycle(source, dtype="float64", dar_block_size=1, max_new_tokens=12, progress=False)
    assert result.model.dtype == torch.float64 and source.dtype == torch.float32
    assert result.report.tolerance == 1e-8 and result.report.max_abs_logit_difference <= 1e-8
    assert result.report.greedy_identical


def test_convert_returns_a_dar_model_with_the_keyword_fields():
    dar = convert(make_source(), dar_block_size=1, dar_routing="crossv", dar_gate_delta=0.5, tolerance=1e-5,
                  max_new_tokens=4, progress=False)
    assert isinstance(dar, DARForCausalLM)
    assert (dar.config.dar_block_size, dar.config.dar_routing, dar.config.dar_gate_delta) == (1, "crossv", 0.5)


# ---------------------------------------------------------------------------------------------------------------
# Bad inputs: a clear error, and nothing written.


def assert_nothing_written(parent: Path, before: set[str]) -> None:
    assert {p.name for p in parent.iterdir()} == before


def test_unsupported_architecture_is_refused_listing_the_supported_families(tmp_path):
    source = tmp_path / "gpt2"
    GPT2LMHeadModel(GPT2Config(n_embd=32, n_layer=2, n_head=4, vocab_size=VOCAB)).save_pretrained(source)
    make_tokenizer().save_pretrained(source)
    before = {p.name for p in tmp_path.iterdir()}
    with pytest.raises(UnsupportedArchitectureError, match=r"'gpt2'.*\['llama', 'mistral', 'qwen2', 'qwen3'\]"):
        upcycle(source, tmp_path / "out", progress=False)
    assert_nothing_written(tmp_path, before)
    with pytest.raises(UnsupportedArchitectureError, match="'gemma'"):
        upcycle(GemmaForCausalLM(GemmaConfig(**SHAPE, vocab_size=VOCAB, head_dim=8)), progress=False)
    mixtral = MixtralForCausalLM(MixtralConfig(**SHAPE, vocab_size=VOCAB, num_local_experts=2))
    with pytest.raises(UnsupportedArchitectureError, match="Kind 'dar' converts dense.*'mixtral' needs another kind"):
        upcycle(mixtral, progress=False)


def test_qwen_sliding_window_layers_are_refused_rather_than_converted_inexactly():
    config = Qwen2Config(**SHAPE, vocab_size=VOCAB, use_sliding_window=True, sliding_window=4, max_window_layers=1)
    assert "sliding_attention" in config.layer_types
    with pytest.raises(UnsupportedArchitectureError, match="sliding-window attention layers"):
        upcycle(Qwen2ForCausalLM(config), progress=False)


@pytest.mark.parametrize("damage", ["missing", "corrupt", "incomplete"])
def test_bad_weights_are_refused_naming_the_folder(tmp_path, damage):
    source = save_source(tmp_path / "source")
    weights = source / "model.safetensors"
    if damage == "missing":
        weights.unlink()
        expected = "no safetensors weights"
    elif damage == "corrupt":
        weights.write_bytes(b"\x00\x01not a safetensors file" * 8)
        expected = "Could not load the weights in"
    else:
        state = load_file(weights)
        del state["model.layers.1.mlp.up_proj.weight"]
        save_file(state, weights, metadata={"format": "pt"})
        expected = r"do not match its config.json.*model\.layers\.1\.mlp\.up_proj\.weight"
    before = {p.name for p in tmp_path.iterdir()}
    with pytest.raises((ValueError, FileNotFoundError), match=expected) as caught:
        upcycle(source, tmp_path / "out", progress=False)
    assert str(source) in str(caught.value)
    assert_nothing_written(tmp_path, before)


def test_corrupt_gguf_is_refused_naming_the_file(tmp_path):
    gguf_path = tmp_path / "broken.gguf"
    gguf_path.write_bytes(b"GGUF\x03\x00\x00\x00truncated")
    with pytest.raises(ValueError, match=f"Could not read the GGUF metadata of {gguf_path}"):
        upcycle(gguf_path, tmp_path / "out", progress=False)  # an output next to a GGUF file is allowed
    assert [p.name for p in tmp_path.iterdir()] == ["broken.gguf"]


def test_missing_tokenizer_is_refused(tmp_path):
    source = tmp_path / "source"
    make_source().save_pretrained(source)
    before = {p.name for p in tmp_path.iterdir()}
    with pytest.raises(FileNotFoundError, match=r"has no tokenizer \(looked for tokenizer.json"):
        upcycle(source, tmp_path / "out", progress=False)
    assert_nothing_written(tmp_path, before)
    with pytest.raises(ValueError, match="tokenizer is required"):
        upcycle(make_source(), tmp_path / "out", progress=False)
    assert_nothing_written(tmp_path, before)


def test_existing_output_is_refused_unless_overwrite(tmp_path):
    source = save_source(tmp_path / "source")
    out = tmp_path / "out"
    out.mkdir()
    (out / "keep.txt").write_text("user data")
    with pytest.raises(FileExistsError, match="exists and is not empty.*--overwrite"):
        upcycle(source, out, progress=False)
    assert [p.name for p in out.iterdir()] == ["keep.txt"]
    with pytest.raises(FileExistsError, match="not a previous conversion output"):  # --overwrite replaces only those
        upcycle(source, out, overwrite=True, progress=False)
    assert [p.name for p in out.iterdir()] == ["keep.txt"]
    (out / "keep.txt").unlink()
    upcycle(source, out, tolerance=1e-5, **FAST)  # an empty folder is used as is
    (out / "stale.txt").write_text("from a previous conversion")
    upcycle(source, out, overwrite=True, tolerance=1e-5, **FAST)
    assert not (out / "stale.txt").exists() and (out / "model.safetensors.index.json").is_file()
    assert sorted(p.name for p in tmp_path.iterdir()) == ["out", "source"]  # nothing retired or staged is left
    with pytest.raises(ValueError, match="lies inside the source"):
        upcycle(source, source / "dar", progress=False)


def test_block_size_that_does_not_fit_is_refused_before_loading(tmp_path):
    source = save_source(tmp_path / "source")
    before = {p.name for p in tmp_path.iterdir()}
    with pytest.raises(ValueError, match=r"dar_block_size must be an integer in \[1, 6\].*got 7"):
        upcycle(source, tmp_path / "out", dar_block_size=7, progress=False)
    with pytest.raises(TypeError, match=r"Unknown DAR field\(s\) \['dar_blocksize'\]"):
        upcycle(source, tmp_path / "out", dar_blocksize=2, progress=False)
    assert_nothing_written(tmp_path, before)


def test_a_conversion_that_is_not_exact_is_refused_and_nothing_written(tmp_path):
    source = save_source(tmp_path / "source")
    before = {p.name for p in tmp_path.iterdir()}
    # Without the partial block as a source the reduction fails (DESIGN.md section 3 negative control).
    with pytest.raises(VerificationError, match="nothing was written") as caught:
        upcycle(source, tmp_path / "out", dar_block_size=2, dar_include_partial=False, tolerance=1e-5, **FAST)
    assert caught.value.report.max_abs_logit_difference > 1e-2
    assert_nothing_written(tmp_path, before)


def test_bfloat16_needs_an_explicit_lower_bar_which_the_card_records(tmp_path):
    source = save_source(tmp_path / "source")
    with pytest.raises(VerificationError, match="--tolerance"):
        upcycle(source, tmp_path / "out", dtype="bfloat16", **FAST)
    assert not (tmp_path / "out").exists()
    result = upcycle(source, tmp_path / "out", dtype="bfloat16", tolerance=10.0, **FAST)
    assert result.report.relaxed
    assert "RELAXED" in (tmp_path / "out" / "README.md").read_text()
    reloaded = AutoModelForCausalLM.from_pretrained(tmp_path / "out")
    assert reloaded.model.embed_tokens.weight.dtype == torch.bfloat16
    assert reloaded.model.layers[0].attn_residual.write_gate.logit.dtype == torch.float32


# ---------------------------------------------------------------------------------------------------------------
# The command line.


def test_cli_convert_prints_the_table_and_generate_streams(tmp_path, capsys):
    (script,) = entry_points(group="console_scripts", name="dar")
    assert script.load() is cli_main
    source = save_source(tmp_path / "source", family="llama")
    out = tmp_path / "out"
    code = cli_main(["convert", str(source), str(out), "--block-size", "1", "--max-new-tokens", "8", "--tolerance", "1e-5"])
    printed = capsys.readouterr().out
    assert code == 0 and "PASSED" in printed and "chat: What is the capital of France?" in printed
    assert json.loads((out / "config.json").read_text())["dar_block_size"] == 1

    assert cli_main(["convert", str(source), str(out)]) == 1
    assert "exists and is not empty" in capsys.readouterr().err

    assert cli_main(["generate", str(out), "--max-new-tokens", "6"]) == 0
    streamed = capsys.readouterr().out
    tokenizer = make_tokenizer()
    dar = AutoModelForCausalLM.from_pretrained(out).eval()
    ids = chat_input_ids(tokenizer, "What is the capital of France?")
    expected = tokenizer.decode(dar.generate(ids, max_new_tokens=6, do_sample=False)[0, ids.shape[1]:], skip_special_tokens=True)
    assert streamed.strip() == expected.strip()


def test_demo_runs_in_its_tiny_mode(tmp_path):
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    completed = subprocess.run(
        [sys.executable, str(REPO / "examples" / "demo.py"), "--tiny", "--output", str(tmp_path / "demo")],
        env=env, capture_output=True, text=True, cwd=tmp_path,
    )
    assert completed.returncode == 0, completed.stderr[-3000:]
    assert "PASSED" in completed.stdout and "identical answers: True" in completed.stdout


def test_float64_verification_runs_hf_norms_in_float64_and_restores_them():
    """HF's RMSNorm rounds through float32 even in float64; the float64 verification lifts that on both models, for
    its duration only."""
    from conftest import tiny_llama

    from dar_transformers.convert import norms_in_input_dtype

    llama = tiny_llama(dtype=torch.float64)
    norm = llama.model.norm
    generator = torch.Generator().manual_seed(0)
    hidden = torch.randn(2, 3, llama.config.hidden_size, dtype=torch.float64, generator=generator)
    exact = norm.weight * hidden * torch.rsqrt(hidden.pow(2).mean(-1, keepdim=True) + norm.variance_epsilon)
    assert (norm(hidden) - exact).abs().max() > 1e-12  # HF's own: float32 inside
    with norms_in_input_dtype(llama):
        torch.testing.assert_close(norm(hidden), exact, rtol=1e-15, atol=1e-15)
        assert all("forward" in vars(layer.input_layernorm) for layer in llama.model.layers)
    assert not any("forward" in vars(module) for module in llama.modules())
    assert (norm(hidden) - exact).abs().max() > 1e-12
