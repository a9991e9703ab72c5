# SPDX-License-Identifier: Apache-2.0
# Copyright 2026 The dar-transformers authors.
"""Upcycling a Llama-family causal LM into DAR, verified, written as a Hub-ready folder (DESIGN.md section 3).

DAR keeps the source family's own attention, MLP and norm modules under Llama's attribute names, and its new
parameters are initialised so that every depth read is the standard residual sum (zero queries, count scaling,
alpha = 1/2, anti-symmetric write gates). A converted model therefore computes the source's function to rounding.
The converter is data plus a small function (STYLE.md item 10):

- `SOURCE_FAMILIES`: which source `model_type`s convert, and the DAR branch family each one uses;
- `DAR_KEY_MAP`: source state-dict key -> DAR key (every shared parameter keeps its name);
- `TargetKind.new_parameters`: the target parameters the source has no counterpart for (left to `_init_weights`);
- `check_keys`: nothing else may be missing or unexpected;
- `verify_conversion`: source and DAR side by side (max |logit difference|, greedy continuations).

Sources: an in-memory model, a local HF folder (safetensors, sharded or not) or a GGUF file (dequantised by
transformers' GGUF loader, then moved into a plain model because a GGUF-loaded model refuses `save_pretrained`).
Other model kinds (the MoE variant) plug in through `register_target_kind` with their own config builder.
"""

import contextlib
import copy
import dataclasses
import json
import os
import re
import shutil
import tempfile
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path

import torch
from huggingface_hub.errors import StrictDataclassError
from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer, PreTrainedConfig, PreTrainedModel
from transformers.generation.streamers import BaseStreamer
from transformers.utils import logging

from .configuration_dar import DARConfig
from .modeling_dar import DARForCausalLM

logger = logging.get_logger(__name__)

# Source model_type -> dar_branch_family (the HF attention/MLP classes DAR composes, see DAR_BRANCH_MODULES).
SOURCE_FAMILIES: dict[str, str] = {"llama": "llama", "mistral": "mistral", "qwen2": "qwen2", "qwen3": "qwen3"}
# MoE sources convert to kind "dar_moe" only (`dar_transformers.moe_upcycling`).
MOE_SOURCE_FAMILIES: dict[str, str] = {"mixtral": "mistral", "qwen2_moe": "qwen2", "qwen3_moe": "qwen3"}

# Source key (regex, full match) -> DAR key (template). DAR keeps Llama's attribute names, so each row maps a
# shared parameter onto itself; a source key that matches no row is "unexpected" and stops the conversion.
DAR_KEY_MAP: tuple[tuple[str, str], ...] = (
    (r"model\.embed_tokens\.weight", r"\g<0>"),
    (r"model\.layers\.\d+\.self_attn\.[qkvo]_proj\.(weight|bias)", r"\g<0>"),  # Qwen2: q/k/v biases
    (r"model\.layers\.\d+\.self_attn\.[qk]_norm\.weight", r"\g<0>"),  # Qwen3: per-head q/k RMSNorm
    (r"model\.layers\.\d+\.mlp\.(gate|up|down)_proj\.(weight|bias)", r"\g<0>"),
    (r"model\.layers\.\d+\.(input|post_attention)_layernorm\.weight", r"\g<0>"),
    (r"model\.norm\.weight", r"\g<0>"),
    (r"lm_head\.weight", r"\g<0>"),
)

# The DAR parameters a source has no counterpart for; `_init_weights` gives them the exact-reduction init.
DAR_NEW_PARAMETERS: tuple[str, ...] = (
    r"model\.layers\.\d+\.(attn|mlp)_residual\..+",  # depth queries, key norms, read and write gates per branch
    r"model\.final_readout\..+",  # the readout's depth query, key norm and read gate
)

# Tolerances on max |logit difference| per verification dtype (DESIGN.md section 3: SmolLM2's logits reach about
# 46, and its own fp32-vs-fp64 difference is about 6e-5). Half precision has no exact bar of its own.
DEFAULT_TOLERANCES: dict[torch.dtype, float] = {
    torch.float64: 1e-8,
    torch.float32: 2e-4,
    torch.bfloat16: 2e-4,
    torch.float16: 2e-4,
}
DTYPES: dict[str, torch.dtype] = {
    "float64": torch.float64,
    "float32": torch.float32,
    "bfloat16": torch.bfloat16,
    "float16": torch.float16,
}

# Verification prompts: long enough (>= 64 tokens for common tokenizers) to cross several DAR blocks of positions.
DEFAULT_PROMPTS: tuple[str, ...] = (
    "The history of the printing press begins long before Gutenberg. Woodblock printing spread across East Asia "
    "for centuries, and movable type made of clay and later of metal appeared in China and Korea. When the press "
    "reached Europe in the fifteenth century, it changed how books were made, how ideas travelled and who could read. "
    "Within fifty years, printers in more than two hundred cities had produced",
    "def fibonacci(n: int) -> list[int]:\n    \"\"\"Return the first n Fibonacci numbers.\"\"\"\n    numbers = [0, 1]\n"
    "    while len(numbers) < n:\n        numbers.append(numbers[-1] + numbers[-2])\n    return numbers[:n]\n\n\n"
    "def is_prime(k: int) -> bool:\n    if k < 2:\n        return False\n    for d in range(2, int(k ** 0.5) + 1):\n",
    "Photosynthesis is the process by which green plants, algae and some bacteria turn light into chemical energy. "
    "Inside the chloroplasts, chlorophyll absorbs mostly blue and red light. Water molecules are split, oxygen is "
    "released, and the energy is stored in sugars that the plant uses to grow. Without it, there would be almost no "
    "oxygen in the air we breathe. In short, the overall reaction is",
    "Dear hiring committee, I am writing to apply for the position of research engineer in your machine learning "
    "team. Over the last five years I have trained language models, built data pipelines for text in eleven "
    "languages and maintained the evaluation tooling that our group uses every day. I enjoy careful measurement "
    "as much as building new things. What excites me most about",
    "Recipe for a simple tomato soup for four people: two tablespoons of olive oil, one onion, two cloves of garlic, "
    "one kilogram of ripe tomatoes, half a litre of vegetable stock, salt, pepper and a handful of fresh basil. "
    "First, chop the onion and the garlic finely, and cut the tomatoes into rough quarters. Then heat the oil in a "
    "large pot and",
)
CHAT_PROMPT = "What is the capital of France?"
TOKENIZER_FILES = ("tokenizer.json", "tokenizer.model", "vocab.json")


class UnsupportedArchitectureError(ValueError):
    """The source is not a causal LM of a family whose branches DAR reuses."""


class VerificationError(RuntimeError):
    """The converted model does not reproduce the source within the tolerance; nothing was written."""

    def __init__(self, message: str, report: "VerificationReport"):
        super().__init__(message)
        self.report = report


# --------------------------------------------------------------------------------------------------------------
# Target kinds: what a conversion produces.


@dataclasses.dataclass(frozen=True)
class TargetKind:
    """A model kind a source converts into.

    `build_config(source_config, branch_family, dtype, fields)` returns the target config (validating `fields`, the
    kind's keyword arguments, e.g. `dar_block_size`); `map_state_dict(source_state, target_config)` returns the
    target state dict of the shared parameters; `new_parameters` are regexes of the target parameters that stay at
    their `_init_weights` value.
    """

    model_class: type[PreTrainedModel]
    build_config: Callable[[PreTrainedConfig, str, torch.dtype, Mapping[str, object]], PreTrainedConfig]
    map_state_dict: Callable[[Mapping[str, torch.Tensor], PreTrainedConfig], dict[str, torch.Tensor]]
    new_parameters: tuple[str, ...]
    description: str


TARGET_KINDS: dict[str, TargetKind] = {}


def register_target_kind(name: str, kind: TargetKind) -> None:
    """Make `convert(..., kind=name)` (and `dar convert --kind name`) available; idempotent."""
    TARGET_KINDS[name] = kind


def map_keys(source_state: Mapping[str, torch.Tensor], key_map: Sequence[tuple[str, str]] = DAR_KEY_MAP) -> dict:
    """Rename the source state dict through `key_map`; a key that matches no row raises, naming it."""
    mapped, unexpected = {}, []
    for key, tensor in source_state.items():
        for pattern, template in key_map:
            if re.fullmatch(pattern, key):
                mapped[re.sub(pattern, template, key)] = tensor
                break
        else:
            unexpected.append(key)
    if unexpected:
        raise ValueError(
            f"The source state dict has {len(unexpected)} parameter(s) that DAR has no place for: {unexpected[:8]}. "
            "Only the Llama-layout keys of the supported families convert (see dar_transformers.convert.DAR_KEY_MAP)."
        )
    return mapped


def check_keys(missing: Sequence[str], unexpected: Sequence[str], new_parameters: Sequence[str]) -> None:
    """After loading: every missing key must be a new parameter, and nothing may be unexpected."""
    not_new = [key for key in missing if not any(re.fullmatch(pattern, key) for pattern in new_parameters)]
    if not_new or unexpected:
        raise ValueError(
            f"The converted state dict does not match the target model: missing {not_new[:8]} (of {len(not_new)}), "
            f"unexpected {list(unexpected)[:8]} (of {len(unexpected)})."
        )


def _architecture_fields(config_class: type[PreTrainedConfig]) -> tuple[str, ...]:
    """The fields a target config takes over from its source: its own fields, less the generic and the DAR ones."""
    generic = {field.name for field in dataclasses.fields(PreTrainedConfig)}
    return tuple(
        field.name
        for field in dataclasses.fields(config_class)
        if field.name not in generic and not field.name.startswith("dar_")
    )


def _check_no_sliding_layers(source_config: PreTrainedConfig, family: str) -> None:
    """Qwen2/Qwen3 sliding layers need per-layer masks that DAR does not build; refuse rather than drift."""
    layer_types = source_config.to_dict().get("layer_types") or []
    if "sliding_attention" in layer_types:
        raise UnsupportedArchitectureError(
            f"The {family} source uses sliding-window attention layers (use_sliding_window=True, layer_types has "
            "'sliding_attention'); DAR converts only full-attention Qwen2/Qwen3 models."
        )


def build_dar_config(
    source_config: PreTrainedConfig, branch_family: str, dtype: torch.dtype, fields: Mapping[str, object]
) -> DARConfig:
    """The DAR config of a source: every architecture field copied, the DAR fields from `fields` (validated)."""
    allowed = sorted(name for name in _dar_option_fields() if name != "dar_branch_family")
    unknown = sorted(set(fields) - set(allowed))
    if unknown:
        raise TypeError(f"Unknown DAR field(s) {unknown} for kind 'dar'; allowed: {allowed}.")
    if source_config.model_type not in SOURCE_FAMILIES:  # a family other kinds accept (MoE) but dense DAR does not
        raise UnsupportedArchitectureError(
            f"Kind 'dar' converts dense {sorted(SOURCE_FAMILIES)} models; model_type {source_config.model_type!r} "
            f"needs another kind (available: {sorted(TARGET_KINDS)})."
        )
    if branch_family in ("qwen2", "qwen3"):
        _check_no_sliding_layers(source_config, branch_family)
    source_fields = source_config.to_dict()
    architecture = {name: source_fields[name] for name in _architecture_fields(DARConfig) if name in source_fields}
    try:
        config = DARConfig(**architecture, **fields, dar_branch_family=branch_family)
    except StrictDataclassError as error:  # report the validator's own message (field name, allowed values)
        raise ValueError(str(error.__cause__ or error)) from error
    config.dtype = dtype
    config.architectures = ["DARForCausalLM"]
    return config


def _dar_option_fields() -> tuple[str, ...]:
    return tuple(field.name for field in dataclasses.fields(DARConfig) if field.name.startswith("dar_"))


register_target_kind(
    "dar",
    TargetKind(
        model_class=DARForCausalLM,
        build_config=build_dar_config,
        map_state_dict=lambda source_state, config: map_keys(source_state),
        new_parameters=DAR_NEW_PARAMETERS,
        description="Dual Attention Residuals (dense)",
    ),
)


# --------------------------------------------------------------------------------------------------------------
# Sources.


@dataclasses.dataclass
class Source:
    """A loaded source: the model (eval mode, never modified afterwards), its tokenizer and where it came from."""

    model: PreTrainedModel
    tokenizer: object | None
    name: str
    location: str  # "in-memory model", "HF folder <path>" or "GGUF file <path>"


def resolve_dtype(dtype: str | torch.dtype) -> torch.dtype:
    if isinstance(dtype, torch.dtype) and dtype in DTYPES.values():
        return dtype
    if dtype in DTYPES:
        return DTYPES[dtype]
    raise ValueError(f"dtype must be one of {list(DTYPES)}, got {dtype!r}.")


def source_family(config: PreTrainedConfig) -> str:
    """The DAR branch family of a source config, or a clear error listing the supported ones."""
    model_type = config.model_type
    if model_type in MOE_SOURCE_FAMILIES:
        return MOE_SOURCE_FAMILIES[model_type]
    if model_type not in SOURCE_FAMILIES:
        architectures = getattr(config, "architectures", None) or [type(config).__name__]
        raise UnsupportedArchitectureError(
            f"Cannot convert model_type {model_type!r} ({', '.join(architectures)}): DAR reuses the branches of "
            f"{sorted(SOURCE_FAMILIES)} decoders only (Llama, SmolLM, TinyLlama, Mistral, Qwen2, Qwen3)."
        )
    return SOURCE_FAMILIES[model_type]


def _gguf_location(path: Path) -> tuple[str, str]:
    return str(path.parent), path.name


def load_source_config(path: str | os.PathLike) -> PreTrainedConfig:
    """The config of a folder or GGUF source, read before any weight so that bad inputs fail fast."""
    path = Path(path)
    if not path.exists():
        raise FileNotFoundError(f"Source {path} does not exist (expected an HF model folder or a .gguf file).")
    if path.is_file():
        if path.suffix != ".gguf":
            raise ValueError(f"Source file {path} is not a .gguf file; pass an HF model folder or a GGUF file.")
        folder, gguf_file = _gguf_location(path)
        try:
            return AutoConfig.from_pretrained(folder, gguf_file=gguf_file)
        except Exception as error:  # gguf-py raises whatever a truncated or foreign file trips over
            raise ValueError(f"Could not read the GGUF metadata of {path}: {error}") from error
    if not (path / "config.json").is_file():
        raise FileNotFoundError(f"Source folder {path} has no config.json; it is not a Hugging Face model folder.")
    try:
        return AutoConfig.from_pretrained(path)
    except (ValueError, KeyError, OSError, json.JSONDecodeError) as error:
        raise ValueError(f"Could not read {path / 'config.json'}: {error}") from error


def _load_tokenizer(folder: Path, gguf_file: str | None = None):
    if gguf_file is None and not any((folder / name).is_file() for name in TOKENIZER_FILES):
        raise FileNotFoundError(
            f"Source folder {folder} has no tokenizer (looked for {', '.join(TOKENIZER_FILES)}); the output repo needs "
            "one. Copy the tokenizer files into the folder, or convert an in-memory model with tokenizer=..."
        )
    try:
        return AutoTokenizer.from_pretrained(folder, gguf_file=gguf_file)
    except Exception as error:  # tokenizer backends raise many types; name the file either way
        raise ValueError(f"Could not load the tokenizer of {folder / (gguf_file or '')}: {error}") from error


def _load_folder_model(folder: Path, dtype: torch.dtype) -> PreTrainedModel:
    weight_files = sorted(folder.glob("*.safetensors"))
    if not weight_files:
        raise FileNotFoundError(
            f"Source folder {folder} has no safetensors weights (model.safetensors or sharded "
            "model-0000x-of-0000y.safetensors with model.safetensors.index.json)."
        )
    try:
        model, info = AutoModelForCausalLM.from_pretrained(folder, dtype=dtype, output_loading_info=True)
    except Exception as error:  # safetensors, JSON and shape errors alike: the file set is unusable
        raise ValueError(f"Could not load the weights in {folder}: {error}") from error
    problems = {name: info[name] for name in ("missing_keys", "unexpected_keys", "mismatched_keys") if info.get(name)}
    if problems:
        raise ValueError(f"The weights in {folder} do not match its config.json: {problems}.")
    return model


def _load_gguf_model(path: Path, dtype: torch.dtype) -> PreTrainedModel:
    """Dequantise through transformers' GGUF loader, then move the weights into a plain model.

    A model loaded with `gguf_file=` keeps its quantization setting and refuses `save_pretrained`; the plain model
    built from the same config without it computes identical logits.
    """
    folder, gguf_file = _gguf_location(path)
    try:
        quantized = AutoModelForCausalLM.from_pretrained(folder, gguf_file=gguf_file, dtype=torch.float32)
    except Exception as error:
        raise ValueError(f"Could not load the GGUF weights of {path}: {error}") from error
    config = copy.deepcopy(quantized.config)
    if hasattr(config, "quantization_config"):
        del config.quantization_config
    plain = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    plain.load_state_dict(quantized.state_dict(), strict=True)
    plain.generation_config = copy.deepcopy(quantized.generation_config)
    return plain.to(dtype)


def load_source(
    source: PreTrainedModel | str | os.PathLike,
    dtype: torch.dtype,
    tokenizer=None,
    need_tokenizer: bool = True,
    source_config: PreTrainedConfig | None = None,
) -> Source:
    """Load (or wrap) the source in `dtype`. An in-memory model is copied if it must change dtype, never modified.

    `source_config` is the already-read config of a path source (reading GGUF metadata takes seconds).
    """
    if isinstance(source, PreTrainedModel):
        source_family(source.config)
        if tokenizer is None and need_tokenizer:
            raise ValueError(
                "tokenizer is required to write an output folder from an in-memory model (the repo ships one)."
            )
        # Verification needs eval mode in `dtype`; a model in another state is copied, never switched.
        model = source if source.dtype == dtype and not source.training else copy.deepcopy(source).to(dtype)
        name = source.config.name_or_path or type(source).__name__
        return Source(model.eval(), tokenizer, name, "in-memory model")
    path = Path(source)
    source_family(source_config or load_source_config(path))
    if path.is_file():
        folder, gguf_file = _gguf_location(path)
        loaded_tokenizer = tokenizer or _load_tokenizer(Path(folder), gguf_file)
        return Source(_load_gguf_model(path, dtype).eval(), loaded_tokenizer, path.stem, f"GGUF file {path}")
    loaded_tokenizer = tokenizer or (_load_tokenizer(path) if need_tokenizer else None)
    return Source(_load_folder_model(path, dtype).eval(), loaded_tokenizer, path.name, f"HF folder {path}")


# --------------------------------------------------------------------------------------------------------------
# The conversion itself.


def upcycle_model(
    source_model: PreTrainedModel, kind: str = "dar", dtype: torch.dtype | None = None, **fields
) -> PreTrainedModel:
    """Source model -> target model with the exact-reduction init: key map, new parameters, nothing else missing."""
    target = _target_kind(kind)
    dtype = dtype or source_model.dtype
    config = target.build_config(source_model.config, source_family(source_model.config), dtype, fields)
    state = target.map_state_dict(source_model.state_dict(), config)
    model = target.model_class(config)  # float32; `_init_weights` gives the new parameters their exact init
    result = model.load_state_dict(state, strict=False)
    check_keys(result.missing_keys, result.unexpected_keys, target.new_parameters)
    model.generation_config = copy.deepcopy(source_model.generation_config)
    return cast_model(model, dtype).eval()


def cast_model(model: PreTrainedModel, dtype: torch.dtype) -> PreTrainedModel:
    """Cast to `dtype`, keeping the modules the class keeps in float32 (DAR parameters) in float32."""
    model.to(dtype)
    keep_fp32 = model._keep_in_fp32_modules_strict or []
    if dtype in (torch.bfloat16, torch.float16):
        for name, module in model.named_modules():
            if any(part in keep_fp32 for part in name.split(".")):
                module.to(torch.float32)
    model.config.dtype = dtype
    return model


def _target_kind(kind: str) -> TargetKind:
    if kind not in TARGET_KINDS:
        raise ValueError(f"kind must be one of {sorted(TARGET_KINDS)}, got {kind!r}.")
    return TARGET_KINDS[kind]


# --------------------------------------------------------------------------------------------------------------
# Verification.


@dataclasses.dataclass
class PromptCheck:
    """One prompt run through source and converted model."""

    name: str
    num_tokens: int
    max_abs_logit: float
    max_abs_logit_difference: float
    greedy_identical: bool
    source_continuation: list[int]
    target_continuation: list[int]


@dataclasses.dataclass
class VerificationReport:
    dtype: str
    tolerance: float
    default_tolerance: float
    max_new_tokens: int
    checks: list[PromptCheck]

    @property
    def relaxed(self) -> bool:
        """True when a caller lowered the bar above the dtype's default tolerance."""
        return self.tolerance > self.default_tolerance

    @property
    def max_abs_logit_difference(self) -> float:
        return max(check.max_abs_logit_difference for check in self.checks)

    @property
    def greedy_identical(self) -> bool:
        return all(check.greedy_identical for check in self.checks)

    @property
    def passed(self) -> bool:
        within = self.max_abs_logit_difference <= self.tolerance
        return within and (self.greedy_identical or self.relaxed)

    def table(self) -> str:
        """A Markdown table: one row per prompt, then the verdict."""
        lines = [
            "| prompt | tokens | max abs logit | max abs logit difference | greedy continuation identical |",
            "|---|---:|---:|---:|---|",
        ]
        for check in self.checks:
            lines.append(
                f"| {check.name} | {check.num_tokens} | {check.max_abs_logit:.2f} | "
                f"{check.max_abs_logit_difference:.3e} | {'yes' if check.greedy_identical else 'NO'} "
                f"({self.max_new_tokens} tokens) |"
            )
        verdict = "PASSED" if self.passed else "FAILED"
        bar = f"tolerance {self.tolerance:.1e} in {self.dtype}"
        if self.relaxed:
            bar += f" (RELAXED from the default {self.default_tolerance:.1e}; greedy mismatches only reported)"
        lines.append("")
        lines.append(f"{verdict}: max abs logit difference {self.max_abs_logit_difference:.3e}, {bar}.")
        return "\n".join(lines)


def build_prompts(tokenizer, vocab_size: int, texts: Sequence[str] | None = None) -> list[tuple[str, torch.Tensor]]:
    """(name, input_ids [1, T]) pairs: the texts, plus a chat prompt when the tokenizer has a chat template.

    Without a tokenizer, four seeded random prompts of 64 tokens stand in.
    """
    if tokenizer is None:
        generator = torch.Generator().manual_seed(0)
        return [(f"random-{index}", torch.randint(0, vocab_size, (1, 64), generator=generator)) for index in range(4)]
    prompts = []
    for index, text in enumerate(DEFAULT_PROMPTS if texts is None else texts):
        ids = tokenizer(text, return_tensors="pt")["input_ids"]
        prompts.append((f"text-{index}", ids))
    if tokenizer.chat_template is not None:
        prompts.append(("chat: " + CHAT_PROMPT, chat_input_ids(tokenizer, CHAT_PROMPT)))
    return prompts


def chat_input_ids(tokenizer, message: str) -> torch.Tensor:
    """The chat template applied to one user message, ready for generation: input_ids [1, T]."""
    text = tokenizer.apply_chat_template([{"role": "user", "content": message}], add_generation_prompt=True, tokenize=False)
    return tokenizer(text, add_special_tokens=False, return_tensors="pt")["input_ids"]


class TokenProgress(BaseStreamer):
    """A generation streamer that only advances a progress bar, one step per generated token."""

    def __init__(self, total: int, description: str, enabled: bool):
        self.bar = logging.tqdm(total=total, desc=description, unit="token", disable=not enabled, leave=False)
        self.prompt_seen = False

    def put(self, value: torch.Tensor) -> None:
        if self.prompt_seen:  # the first call carries the prompt
            self.bar.update()
        self.prompt_seen = True

    def end(self) -> None:
        self.bar.close()


@torch.no_grad()
def greedy_continuations(
    model: PreTrainedModel,
    prompts: Sequence[torch.Tensor],
    max_new_tokens: int,
    pad_token_id: int = 0,
    description: str = "Greedy decoding",
    progress: bool = False,
) -> list[list[int]]:
    """Exactly `max_new_tokens` greedy tokens per prompt, all prompts in one left-padded batch.

    End-of-sequence does not stop generation, so every one of the tokens is compared.
    """
    length = max(ids.shape[1] for ids in prompts)
    input_ids = torch.full((len(prompts), length), pad_token_id, dtype=torch.long)  # [N, T]
    attention_mask = torch.zeros_like(input_ids)  # [N, T]
    for row, ids in enumerate(prompts):
        input_ids[row, length - ids.shape[1] :] = ids[0]
        attention_mask[row, length - ids.shape[1] :] = 1
    output = model.generate(
        input_ids,
        attention_mask=attention_mask,
        max_new_tokens=max_new_tokens,
        do_sample=False,
        eos_token_id=None,
        pad_token_id=pad_token_id,
        streamer=TokenProgress(max_new_tokens, description, progress),
    )
    return output[:, length:].tolist()


def rms_norm_in_input_dtype(self, hidden_states: torch.Tensor) -> torch.Tensor:
    variance = hidden_states.pow(2).mean(-1, keepdim=True)
    return self.weight * (hidden_states * torch.rsqrt(variance + self.variance_epsilon))


@contextlib.contextmanager
def norms_in_input_dtype(*models: PreTrainedModel):
    """HF's RMSNorm modules (Llama, Mistral, Qwen, their MoE variants) round through float32 even in a float64 model,
    on both sides of a comparison, so a 1e-16 reassociation can flip one float32 rounding and show up as ~1e-5 in
    the logits. For the float64 verification every RMSNorm instance of `models` computes in its input dtype
    instead (an instance attribute, removed on exit); the formula is HF's own."""
    patched = [
        module for model in models for module in model.modules()
        if type(module).__name__.endswith("RMSNorm") and hasattr(module, "variance_epsilon")
        and "forward" not in vars(module)
    ]
    for module in patched:
        module.forward = rms_norm_in_input_dtype.__get__(module)
    try:
        yield
    finally:
        for module in patched:
            del module.forward


@torch.no_grad()
def verify_conversion(
    source_model: PreTrainedModel,
    target_model: PreTrainedModel,
    prompts: Sequence[tuple[str, torch.Tensor]],
    tolerance: float | None = None,
    max_new_tokens: int = 64,
    progress: bool = True,
) -> VerificationReport:
    """Run source and target side by side: max |logit difference| over all positions, greedy continuations.

    In float64 both models' RMSNorms compute in float64 (`norms_in_input_dtype`), so that the comparison measures
    the conversion, not HF's float32 rounding inside the norm."""
    dtype = target_model.dtype
    with norms_in_input_dtype(source_model, target_model) if dtype == torch.float64 else contextlib.nullcontext():
        return _verify_conversion(source_model, target_model, prompts, tolerance, max_new_tokens, progress)


def _verify_conversion(
    source_model, target_model, prompts, tolerance, max_new_tokens, progress
) -> VerificationReport:
    dtype = target_model.dtype
    default_tolerance = DEFAULT_TOLERANCES[dtype]
    steps = logging.tqdm(total=len(prompts) + 2, desc="Verifying (source vs DAR)", disable=not progress)
    logit_pairs = []
    for name, input_ids in prompts:
        logit_pairs.append((source_model(input_ids).logits.double(), target_model(input_ids).logits.double()))  # [1, T, V]
        steps.update()
    continuations = []
    for role, model in (("source", source_model), ("converted", target_model)):
        description = f"Greedy decoding, {role} model ({len(prompts)} prompts)"
        continuations.append(greedy_continuations(model, [ids for _, ids in prompts], max_new_tokens, 0, description, progress))
        steps.update()
    steps.close()
    checks = []
    for (name, input_ids), (source_logits, target_logits), source_tokens, target_tokens in zip(
        prompts, logit_pairs, *continuations
    ):
        checks.append(
            PromptCheck(
                name=name,
                num_tokens=input_ids.shape[1],
                max_abs_logit=source_logits.abs().max().item(),
                max_abs_logit_difference=(target_logits - source_logits).abs().max().item(),
                greedy_identical=source_tokens == target_tokens,
                source_continuation=source_tokens,
                target_continuation=target_tokens,
            )
        )
    return VerificationReport(
        dtype=str(dtype).removeprefix("torch."),
        tolerance=default_tolerance if tolerance is None else tolerance,
        default_tolerance=default_tolerance,
        max_new_tokens=max_new_tokens,
        checks=checks,
    )


# --------------------------------------------------------------------------------------------------------------
# Output folder.


def check_output_folder(output: str | os.PathLike, overwrite: bool, source: object = None) -> Path:
    """Refuse an existing non-empty output (unless overwrite), a file, or a folder that is or holds the source."""
    output = Path(output).absolute()
    if output.exists() and not output.is_dir():
        raise FileExistsError(f"Output {output} exists and is not a folder.")
    if output.is_dir() and any(output.iterdir()) and not overwrite:
        raise FileExistsError(f"Output folder {output} exists and is not empty; pass overwrite=True (--overwrite).")
    if isinstance(source, (str, os.PathLike)) and Path(source).is_dir():  # a GGUF file's neighbours are no source
        source_folder = Path(source).absolute()
        if output == source_folder or source_folder in output.parents:
            raise ValueError(
                f"Output folder {output} is or lies inside the source folder {source_folder}; the source is never modified."
            )
    return output


def _apply_umask(folder: Path) -> None:
    """mkdtemp (and some writers) create owner-only entries; give the repo the modes a plain mkdir/open would."""
    umask = os.umask(0)
    os.umask(umask)
    os.chmod(folder, 0o777 & ~umask)
    for path in folder.rglob("*"):
        os.chmod(path, (0o777 if path.is_dir() else 0o666) & ~umask)


def write_repo_folder(output: Path, write: Callable[[Path], None], overwrite: bool) -> None:
    """Run `write(folder)` on a temporary folder next to `output`, then rename it into place (all or nothing)."""
    output.parent.mkdir(parents=True, exist_ok=True)
    staging = Path(tempfile.mkdtemp(prefix=f".{output.name}.", suffix=".partial", dir=output.parent))
    try:
        write(staging)
        _apply_umask(staging)
        check_output_folder(output, overwrite)  # the output may have appeared while we worked
        if output.exists():
            retired = Path(tempfile.mkdtemp(prefix=f".{output.name}.", suffix=".old", dir=output.parent))
            os.replace(output, retired / output.name)
            os.replace(staging, output)
            shutil.rmtree(retired)
        else:
            os.replace(staging, output)
    finally:
        if staging.exists():
            shutil.rmtree(staging)


# --------------------------------------------------------------------------------------------------------------
# The entry points.


@dataclasses.dataclass
class ConversionResult:
    model: PreTrainedModel
    tokenizer: object | None
    report: VerificationReport | None
    source: Source
    output: Path | None


def upcycle(
    source: PreTrainedModel | str | os.PathLike,
    output: str | os.PathLike | None = None,
    *,
    tokenizer=None,
    kind: str = "dar",
    dtype: str | torch.dtype = "float32",
    tolerance: float | None = None,
    verify: bool = True,
    prompts: Sequence[str] | None = None,
    max_new_tokens: int = 64,
    overwrite: bool = False,
    max_shard_size: str | int = "2GB",
    base_model: str | None = None,
    progress: bool = True,
    **fields,
) -> ConversionResult:
    """Convert, verify and (if `output` is given) write; returns the model, the verification report and the source.

    `fields` are the target kind's config fields (for DAR: `dar_block_size`, `dar_routing`, `dar_num_streams`, ...).
    Raises before writing anything if an input is bad or the verification fails.
    """
    dtype = resolve_dtype(dtype)
    target = _target_kind(kind)
    if tolerance is not None and not tolerance > 0:
        raise ValueError(f"tolerance must be a positive number, got {tolerance!r}.")
    if output is not None:
        output = check_output_folder(output, overwrite, source)
        if not verify:
            raise ValueError("verify=False cannot write an output folder: only verified conversions are written.")
    source_config = None
    if not isinstance(source, PreTrainedModel):  # validate the target config before loading any weight
        source_config = load_source_config(source)
        target.build_config(source_config, source_family(source_config), dtype, fields)

    loaded = load_source(source, dtype, tokenizer, need_tokenizer=output is not None, source_config=source_config)
    model = upcycle_model(loaded.model, kind, dtype, **fields)

    report = None
    if verify:
        prompt_ids = build_prompts(loaded.tokenizer, loaded.model.config.vocab_size, prompts)
        report = verify_conversion(loaded.model, model, prompt_ids, tolerance, max_new_tokens, progress)
        if report.relaxed:
            logger.warning(
                f"Verification tolerance relaxed to {report.tolerance:.1e} (default {report.default_tolerance:.1e} "
                f"in {report.dtype}); greedy mismatches are reported, not refused. The model card says so."
            )
        if not report.passed:
            hint = ""
            if dtype in (torch.bfloat16, torch.float16) and not report.relaxed:
                hint = (
                    f"\nIn {report.dtype} the rounding of the source itself exceeds the float32 bar; pass a larger "
                    "tolerance (--tolerance) to accept a lower bar, which the model card records."
                )
            raise VerificationError(
                f"The converted model does not reproduce the source; nothing was written.\n{report.table()}{hint}",
                report,
            )

    if output is not None:
        from .model_card import chat_answers, render_model_card

        answers = chat_answers(report, loaded.tokenizer, model.generation_config.eos_token_id)
        card = render_model_card(
            model.config, report, loaded, base_model=base_model, kind=target.description, answers=answers
        )

        def write(folder: Path) -> None:
            model.save_pretrained(folder, max_shard_size=max_shard_size)
            loaded.tokenizer.save_pretrained(folder)
            (folder / "README.md").write_text(card, encoding="utf-8")

        write_repo_folder(output, write, overwrite)
        logger.info(f"Wrote the converted model to {output}")
    return ConversionResult(model=model, tokenizer=loaded.tokenizer, report=report, source=loaded, output=output)


def convert(
    source: PreTrainedModel | str | os.PathLike, output: str | os.PathLike | None = None, **options
) -> PreTrainedModel:
    """Upcycle `source` (a model, an HF folder or a .gguf file) into DAR, verified; write it to `output` if given.

    Keyword arguments: the DAR fields (`dar_block_size=8`, `dar_routing="dar"`, `dar_num_streams=2`, ...) and the
    options of `upcycle` (`dtype`, `tolerance`, `tokenizer`, `overwrite`, `max_shard_size`, `base_model`, ...).

    ```python
    >>> from dar_transformers.convert import convert
    >>> dar = convert("SmolLM2-135M-Instruct.Q4_1.gguf", "smollm2-dar", dar_block_size=8)
    ```
    """
    return upcycle(source, output, **options).model


__all__ = [
    "DAR_KEY_MAP",
    "DAR_NEW_PARAMETERS",
    "SOURCE_FAMILIES",
    "TARGET_KINDS",
    "ConversionResult",
    "TargetKind",
    "UnsupportedArchitectureError",
    "VerificationError",
    "VerificationReport",
    "convert",
    "register_target_kind",
    "upcycle",
    "upcycle_model",
    "verify_conversion",
]
