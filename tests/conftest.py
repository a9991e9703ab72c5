# SPDX-License-Identifier: Apache-2.0
"""Shared builders and checks for the CPU test suite (import them: `from conftest import tiny_llama, save_source`).

Two tiny shapes, both built from random weights in a fraction of a second:
- `TINY_LLAMA_FIELDS` (hidden 32, 2 layers, M = 4 branches, GQA 4/2 heads, 97 tokens): the model-side tests, the
  DAR-MoE tests (`TINY_MOE`: 4 experts, top-2) and sparse upcycling (`dense_llama`);
- `SHAPE` with `VOCAB` 320 (3 layers, weights spread so logits reach a few units): the converter's sources of each
  family (`make_source`, `save_source` with the BPE `make_tokenizer`), whose every position is a decided next token.
Keyword overrides of any config field are accepted where a builder takes `**overrides`.
"""

import contextlib
import copy
import hashlib
import importlib.util
import io
import json
import os
import re
from pathlib import Path

import numpy as np
import torch
from safetensors.torch import load_file
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
from tokenizers.models import WordLevel
from tokenizers.pre_tokenizers import Whitespace
from transformers import (
    LlamaConfig,
    LlamaForCausalLM,
    MistralConfig,
    MistralForCausalLM,
    PreTrainedTokenizerFast,
    Qwen2Config,
    Qwen2ForCausalLM,
    Qwen3Config,
    Qwen3ForCausalLM,
)

from dar_transformers import DARConfig, DARForCausalLM, DARMoeConfig, DARMoeForCausalLM, cpu_kernels, depth_backends
from dar_transformers.cli import main as cli_main
from dar_transformers.configuration_dar import ROUTING_KEY_VALUE_STREAMS
from dar_transformers.modeling_dar import DAR_MODULE_NAMES

try:  # for the GGUF builders only: `benchmarks/gpu_check.sh` runs test_compile.py where gguf may be missing
    import gguf
except ImportError:
    gguf = None

# torchao lives only in .venv-quant (`make test-quant`, part of `make test`): installed beside the package it is
# imported by every transformers import, so the default venv does not have it and does not collect its test.
collect_ignore = [] if importlib.util.find_spec("torchao") else ["test_quantization.py"]

# Under pytest-xdist (`make test-default` runs `-n 2`) each worker gets its share of the cores: torch's default of
# one thread per core in every worker would oversubscribe them (the subprocesses tests start inherit this count).
if "PYTEST_XDIST_WORKER_COUNT" in os.environ:
    torch.set_num_threads(max(1, (os.cpu_count() or 1) // int(os.environ["PYTEST_XDIST_WORKER_COUNT"])))

TINY_LLAMA_FIELDS = dict(
    vocab_size=97,
    hidden_size=32,
    intermediate_size=64,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    max_position_embeddings=64,
    bos_token_id=1,
    eos_token_id=2,
    pad_token_id=0,
)

def tiny_llama_config(**overrides) -> LlamaConfig:
    return LlamaConfig(**{**TINY_LLAMA_FIELDS, **overrides})


def tiny_dar_config(**overrides) -> DARConfig:
    return DARConfig(**{**TINY_LLAMA_FIELDS, **overrides})


def tiny_llama(seed: int = 0, dtype: torch.dtype = torch.float32, **overrides) -> LlamaForCausalLM:
    """A random tiny LlamaForCausalLM in eval mode; `seed` fixes its weights."""
    torch.manual_seed(seed)
    return LlamaForCausalLM(tiny_llama_config(**overrides)).to(dtype).eval()


def dense_llama(seed: int = 0, **overrides) -> LlamaForCausalLM:
    """`tiny_llama` at `INIT`: logits O(1) and routing far from uniform, so rounding and drift are visible."""
    return tiny_llama(seed, **{**INIT, **overrides})


def is_dar_parameter(name: str) -> bool:
    return any(part in DAR_MODULE_NAMES for part in name.split("."))


def dar_parameter_names(model: torch.nn.Module) -> set[str]:
    return {name for name, _ in model.named_parameters() if is_dar_parameter(name)}


def load_llama_into_dar(llama: LlamaForCausalLM, dar: DARForCausalLM):
    """Load the Llama state dict into a DAR model (non-strict: the DAR parameters keep their init).

    Returns the `load_state_dict` result (missing_keys, unexpected_keys) for the caller to check.
    """
    return dar.load_state_dict(llama.state_dict(), strict=False)


def upcycled_dar(llama: LlamaForCausalLM, **dar_overrides) -> DARForCausalLM:
    """A DARForCausalLM with the Llama weights and the upcycling init of the DAR parameters, in Llama's dtype."""
    config = tiny_dar_config(**{**_llama_fields(llama.config), **dar_overrides})
    dar = DARForCausalLM(config).to(llama.dtype).eval()
    load_llama_into_dar(llama, dar)
    return dar


def _llama_fields(config: LlamaConfig) -> dict:
    return {name: getattr(config, name) for name in TINY_LLAMA_FIELDS} | {
        "rms_norm_eps": config.rms_norm_eps,
        "initializer_range": config.initializer_range,
    }


def perturb_dar_parameters(model: torch.nn.Module, scale: float = 0.5, seed: int = 0) -> None:
    """Add scale * randn to every DAR parameter, so that no depth read is uniform and no gate is at its init."""
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, parameter in sorted(model.named_parameters()):
            if is_dar_parameter(name):
                noise = torch.randn(parameter.shape, generator=generator, dtype=torch.float64)
                parameter.add_(scale * noise.to(parameter.dtype))


def random_input_ids(batch: int = 2, length: int = 9, vocab_size: int = 97, seed: int = 0) -> torch.LongTensor:
    """Token ids drawn from 3 .. vocab_size - 1, so no pad, bos or eos token appears by chance."""
    generator = torch.Generator().manual_seed(seed)
    return torch.randint(3, vocab_size, (batch, length), generator=generator)


# ---------------------------------------------------------------------------------------------------------------
# The converter's sources and checks.

REPO = Path(__file__).resolve().parents[1]  # the repository root


SHAPE = dict(hidden_size=32, intermediate_size=64, num_hidden_layers=3, num_attention_heads=4, num_key_value_heads=2)


VOCAB = 320


CHAT_TEMPLATE = (
    "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)


SHORT_PROMPTS = ["The capital of France is Paris, and the capital of Italy is Rome.", "Hello world, tiny models"]


IDS = torch.randint(3, VOCAB, (2, 24), generator=torch.Generator().manual_seed(5))  # token ids of the VOCAB sources
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


def tree_digest(folder: Path) -> dict[str, str]:
    return {str(p.relative_to(folder)): hashlib.sha256(p.read_bytes()).hexdigest() for p in folder.rglob("*") if p.is_file()}


def memo_free_logits(model, input_ids) -> torch.Tensor:
    """Logits of a gradient-free forward of a copy of `model` with every memoised derived tensor dropped (the
    optimised backends memoise gates and folded queries per module, `depth_backends._derived`, and for all residuals
    at once, `_model_memo`): what a memo hit must reproduce exactly."""
    fresh = copy.deepcopy(model)
    for module in fresh.modules():
        module.__dict__.pop("_dar_fast_memo", None)
        module.__dict__.pop("_dar_model_memo", None)
    with torch.no_grad():
        return fresh(input_ids).logits


def assert_refused_in_one_line(code: int, stderr: str, *patterns: str) -> None:
    """Exit 1, no traceback, and the last stderr line is the error, matching every pattern."""
    assert code == 1, stderr[-3000:]
    assert "Traceback" not in stderr
    error = stderr.strip().splitlines()[-1]
    assert error.startswith("dar convert: error: "), stderr[-3000:]
    for pattern in patterns:
        assert re.search(pattern, error), (pattern, error)


def edit_json(path, **fields) -> None:
    path.write_text(json.dumps({**json.loads(path.read_text()), **fields}))


def run_convert_in_process(*args, cwd: Path) -> tuple[int, str]:
    """`dar convert ARGS` through the CLI's `main` in this process, from `cwd` -> (exit code, stderr): the CLI's own
    code path without an interpreter start-up, for the cases where a fresh process is not the point."""
    stderr = io.StringIO()
    previous = os.getcwd()
    os.chdir(cwd)
    try:
        with contextlib.redirect_stdout(io.StringIO()), contextlib.redirect_stderr(stderr):
            code = cli_main(["convert", *map(str, args)])
    finally:
        os.chdir(previous)
    return code, stderr.getvalue()


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


def write_tiny_gguf(path: Path, model: LlamaForCausalLM, tokenizer: PreTrainedTokenizerFast, extra_tensors=None,
                    extra_metadata=None, matrices_dtype=np.float32, matrices_type=None) -> Path:
    """A float32 Llama GGUF with a BPE ("gpt2") tokenizer and chat template, as llama.cpp's converter writes it;
    `extra_tensors` ({GGUF name: array}) are written after the model's, `extra_metadata` ({key: str, float, bool or int})
    after its metadata; `matrices_dtype` np.float16 writes the 2-D tensors F16 (the norms stay F32, as llama.cpp's
    `--outtype f16` writes them), and `matrices_type` (a `GGMLQuantizationType`) quantises them with gguf-py."""
    config = model.config
    writer = gguf_writer(path, "llama", config)
    writer.add_name("tiny-llama")
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
    for key, value in (extra_metadata or {}).items():
        value_type = {str: gguf.GGUFValueType.STRING, float: gguf.GGUFValueType.FLOAT32,
                      bool: gguf.GGUFValueType.BOOL}.get(type(value), gguf.GGUFValueType.UINT32)
        writer.add_key_value(key, value, value_type)
    for key, tensor in model.state_dict().items():
        if key == "lm_head.weight" and config.tie_word_embeddings:
            continue
        array = tensor.numpy().astype(matrices_dtype if tensor.dim() == 2 else np.float32)
        if key in GGUF_GLOBAL_NAMES:
            add_gguf_tensor(writer, GGUF_GLOBAL_NAMES[key], array, matrices_type)
            continue
        layer, module = key.split(".")[2], ".".join(key.split(".")[3:-1])
        if module == "self_attn.q_proj":
            array = llama_cpp_permute(array, config.num_attention_heads)
        elif module == "self_attn.k_proj":
            array = llama_cpp_permute(array, config.num_key_value_heads)
        add_gguf_tensor(writer, f"blk.{layer}.{GGUF_LAYER_NAMES[module]}.weight", array, matrices_type)
    finish_gguf(writer, extra_tensors)
    return path


def gguf_writer(path: Path, architecture: str, config) -> "gguf.GGUFWriter":
    """A GGUF writer holding the metadata llama.cpp writes for every decoder of `config` (its shape, rope base and
    dimension, norm epsilon, vocabulary size); the caller adds its family's own, then the tensors."""
    writer = gguf.GGUFWriter(str(path), architecture)
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
    return writer


def add_gguf_tensor(writer: "gguf.GGUFWriter", name: str, array: np.ndarray, matrices_type=None) -> None:
    if matrices_type is None or array.ndim != 2:
        writer.add_tensor(name, array)
    else:
        writer.add_tensor(name, gguf.quants.quantize(array, matrices_type), raw_dtype=matrices_type)


def finish_gguf(writer: "gguf.GGUFWriter", extra_tensors=None) -> None:
    """`extra_tensors` ({GGUF name: array}) after the model's, then the file written and closed."""
    for name, array in (extra_tensors or {}).items():
        writer.add_tensor(name, array)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()


def assert_nothing_written(parent: Path, before: set[str]) -> None:
    assert {p.name for p in parent.iterdir()} == before


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


def save_bf16_source(folder: Path, family: str = "llama") -> Path:
    model = make_source(family, tied=False).to(torch.bfloat16)
    model.save_pretrained(folder)
    make_tokenizer().save_pretrained(folder)
    return folder


# Larger than HF's 0.02 so that logits are O(1) and routing is far from uniform: rounding and drift are visible.
INIT = dict(initializer_range=0.2)


TINY_MOE = dict(TINY_LLAMA_FIELDS, num_experts=4, num_experts_per_tok=2)


def tiny_dar_moe(seed: int = 0, **overrides) -> DARMoeForCausalLM:
    torch.manual_seed(seed)
    return DARMoeForCausalLM(DARMoeConfig(**{**TINY_MOE, **overrides})).eval()


def word_tokenizer(vocab_size: int = TINY_LLAMA_FIELDS["vocab_size"]) -> PreTrainedTokenizerFast:
    """A word-level tokenizer over the tiny vocabulary (the converter writes one into the repo folder)."""
    vocab = {"<unk>": 0, "<s>": 1, "</s>": 2} | {f"w{index}": index for index in range(3, vocab_size)}
    backend = Tokenizer(WordLevel(vocab, unk_token="<unk>"))
    backend.pre_tokenizer = Whitespace()
    return PreTrainedTokenizerFast(tokenizer_object=backend, unk_token="<unk>", bos_token="<s>", eos_token="</s>")


# ---------------------------------------------------------------------------------------------------------------
# Depth-read building blocks shared by test_fast_path.py and test_two_phase.py.

DEPTH_ROUTINGS = {name: tuple(zip(*pairs)) for name, pairs in ROUTING_KEY_VALUE_STREAMS.items()}
DEPTH_ROUTINGS["one-stream"] = ((0,), (0,))
DEPTH_EPS = 1e-6


def depth_read_inputs(num_streams, num_sources=4, with_partial=True, batch=2, tokens=3, hidden=6, seed=0):
    """Entries, partial, folded query [J, D] and gate [J] in float64, all requiring gradients."""
    generator = torch.Generator().manual_seed(seed)

    def leaf(*shape):
        return torch.randn(*shape, generator=generator, dtype=torch.float64).requires_grad_()

    entries = [leaf(batch, tokens, num_streams, hidden) for _ in range(num_sources)]
    partial = leaf(batch, tokens, num_streams, hidden) if with_partial else None
    return entries, partial, leaf(num_streams, hidden), leaf(num_streams)


def loop_depth_read(query, gate, sources, key_streams, value_streams):
    """The read written out per target stream: x^j = sum_n softmax_n(q_j . k_n / rms(k_n)) V_n, u = sum_j gate_j x^j.

    query [J, D] is the pseudo-query already multiplied by the key-norm weight; sources [B, T, N, J, D].
    """
    branch_input = 0
    for target, (key_stream, value_stream) in enumerate(zip(key_streams, value_streams)):
        keys = sources[:, :, :, key_stream]  # [B, T, N, D]
        scores = (keys @ query[target]) * torch.rsqrt(keys.pow(2).mean(-1) + DEPTH_EPS)  # [B, T, N]
        extraction = torch.einsum("btn,btnd->btd", scores.softmax(-1), sources[:, :, :, value_stream])
        branch_input = branch_input + gate[target] * extraction
    return branch_input  # [B, T, D]


def perturbed_tiny_dar(block_size, implementation: str, **config_overrides) -> DARForCausalLM:
    """A tiny DAR model (vocabulary 64) in eval mode with every DAR parameter moved off its init."""
    torch.manual_seed(0)
    config = DARConfig(
        hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
        vocab_size=64, dar_block_size=block_size, dar_implementation=implementation, **config_overrides,
    )
    model = DARForCausalLM(config).eval()
    with torch.no_grad():
        for name, parameter in model.named_parameters():
            if "_residual" in name or "final_readout" in name:
                parameter.add_(0.3 * torch.randn_like(parameter))
    return model


class CountedKernels:
    """DAR's built C++ extension, counting the calls of each kernel (`calls`, from zero for `names`); a function in
    `replace[name]` is called as `replace[name](kernel, *args)` instead of the kernel (negative controls)."""

    def __init__(self, module, names=()):
        self.module = module
        self.calls: dict[str, int] = dict.fromkeys(names, 0)
        self.replace: dict[str, object] = {}

    def __getattr__(self, name):
        function = getattr(self.module, name)

        def counted(*args):
            self.calls[name] = self.calls.get(name, 0) + 1
            replacement = self.replace.get(name)
            return function(*args) if replacement is None else replacement(function, *args)

        return counted


def counted_cpu_kernels(monkeypatch, names=()) -> CountedKernels:
    """The depth backends' C++ kernels, counted (`CountedKernels`); they must build on the test machine."""
    module = cpu_kernels.cpu_kernels()
    assert module is not None, "the kernels must build on the test machine (a C++ compiler and ninja)"
    counted = CountedKernels(module, names)
    monkeypatch.setattr(depth_backends, "cpu_kernels", lambda: counted)
    return counted


@contextlib.contextmanager
def torch_threads(count: int):
    """torch's intra-op thread count set to `count` inside, restored after."""
    before = torch.get_num_threads()
    torch.set_num_threads(count)
    try:
        yield
    finally:
        torch.set_num_threads(before)
