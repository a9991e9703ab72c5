# SPDX-License-Identifier: Apache-2.0
# Copyright 2026 The dar-transformers authors.
"""Upcycling a Llama-family causal LM into DAR, verified, written as a Hub-ready folder (DESIGN.md sections 3 and 6).

DAR keeps the source family's own attention, MLP and norm modules under Llama's attribute names, and its new
parameters are initialised so that every depth read is the standard residual sum (zero queries, count scaling,
alpha = 1/2, anti-symmetric write gates). A converted model therefore computes the source's function to rounding,
and upcycling is a file operation: the source's tensors under their own names plus a few small new ones. The
converter is data plus a small function (STYLE.md item 10):

- `SOURCE_FAMILIES`: which source `model_type`s convert, and the DAR branch family each one uses;
- `DAR_KEY_MAP`: source checkpoint key -> DAR key (every shared parameter keeps its name);
- `TargetKind.new_parameters`: the target parameters the source has no counterpart for; their values are what the
  model's own `_init_weights` gives them (`new_parameter_values`, the one source of truth);
- `check_keys`: nothing else may be missing or unexpected;
- verification: source and DAR side by side (max |logit difference|, teacher-forced top-1 agreement, and greedy
  continuations when both models fit in memory).

A checkpoint source (an HF folder, a GGUF file, or an in-memory model with an output folder) converts without
building either model (`plan_conversion`, `checkpoint_io.write_checkpoint`): tensors are copied or cast one at a
time, and the written folder is verified layer by layer (`layerwise.verify_streamed`) before it is moved into
place. An in-memory model without an output folder converts in memory (`upcycle_model`, `verify_conversion`).
Other model kinds (the MoE variant) plug in through `register_target_kind` with their own config builder and plan.
"""

import contextlib
import copy
import dataclasses
import json
import os
import re
import tempfile
import zlib
from collections.abc import Callable, Iterator, Mapping, Sequence
from pathlib import Path

import torch
from huggingface_hub.errors import StrictDataclassError
from torch import nn
from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer, GenerationConfig, PreTrainedConfig, PreTrainedModel
from transformers.dynamic_module_utils import custom_object_save
from transformers.generation.streamers import BaseStreamer
from transformers.utils import logging

from .checkpoint_io import (
    Checkpoint,
    GGUFCheckpoint,
    SafetensorsCheckpoint,
    StateDictCheckpoint,
    TensorInfo,
    TensorPlan,
    materialise,
    parse_size,
    write_checkpoint,
)
from .configuration_dar import DARConfig
from .conversion.output import check_output_folder, write_repo_folder
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
# Source keys that are no weights (old Llama checkpoints saved the rotary frequencies); transformers ignores them too.
SOURCE_KEYS_IGNORED: tuple[str, ...] = (r"(model\.)?layers\.\d+\.self_attn\.rotary_emb\.inv_freq", r"model\.rotary_emb\.inv_freq")

# The DAR parameters a source has no counterpart for; `_init_weights` gives them the exact-reduction init.
DAR_NEW_PARAMETERS: tuple[str, ...] = (
    r"model\.layers\.\d+\.(attn|mlp)_residual\..+",  # depth queries, key norms, read and write gates per branch
    r"model\.final_readout\..+",  # the readout's depth query, key norm and read gate
)

# Tolerances on max |logit difference| per verification (compute) dtype (DESIGN.md section 3: SmolLM2's logits reach
# about 46, and its own fp32-vs-fp64 difference is about 6e-5). Weights stored in half precision are verified in
# float32, at the float32 bar.
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
# Full greedy continuations need both models in memory: run them by default when both, in the verification dtype,
# take at most this many bytes (SmolLM2-135M in float32: 1.1 GB; TinyLlama-1.1B: 8.8 GB, checked teacher-forced only).
FULL_GREEDY_MAX_BYTES = 3 * 2**30
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
    kind's keyword arguments, e.g. `dar_block_size`); `plan_tensors(source_infos, target_config)` says how each
    shared target tensor is made from source tensors (`TensorPlan`: a concatenation of whole source tensors, or a
    transform of them), from names and shapes alone; `new_parameters` are regexes of the target parameters the
    source has no counterpart for, which get their `_init_weights` value.
    """

    model_class: type[PreTrainedModel]
    build_config: Callable[[PreTrainedConfig, str, torch.dtype, Mapping[str, object]], PreTrainedConfig]
    plan_tensors: Callable[[Mapping[str, TensorInfo], PreTrainedConfig], dict[str, TensorPlan]]
    new_parameters: tuple[str, ...]
    description: str


TARGET_KINDS: dict[str, TargetKind] = {}


def register_target_kind(name: str, kind: TargetKind) -> None:
    """Make `convert(..., kind=name)` (and `dar convert --kind name`) available; idempotent."""
    TARGET_KINDS[name] = kind


def is_ignored_source_key(key: str) -> bool:
    return any(re.fullmatch(pattern, key) for pattern in SOURCE_KEYS_IGNORED)


def map_keys(source_keys: Sequence[str], key_map: Sequence[tuple[str, str]] = DAR_KEY_MAP) -> dict[str, str]:
    """Target key -> source key through `key_map`; a source key that matches no row raises, naming it."""
    mapped, unexpected = {}, []
    for key in source_keys:
        if is_ignored_source_key(key):
            continue
        for pattern, template in key_map:
            if re.fullmatch(pattern, key):
                mapped[re.sub(pattern, template, key)] = key
                break
        else:
            unexpected.append(key)
    if unexpected:
        raise ValueError(
            f"The source has {len(unexpected)} parameter(s) that DAR has no place for: {unexpected[:8]}. "
            "Only the Llama-layout keys of the supported families convert (see dar_transformers.convert.DAR_KEY_MAP)."
        )
    return mapped


def plan_dar_tensors(source_infos: Mapping[str, TensorInfo], config: PreTrainedConfig) -> dict[str, TensorPlan]:
    """Kind "dar": every shared tensor is its source tensor under the same name."""
    return {
        target: TensorPlan(source_infos[source].shape, source_infos[source].dtype, (source,))
        for target, source in map_keys(list(source_infos)).items()
    }


def check_keys(missing: Sequence[str], unexpected: Sequence[str], new_parameters: Sequence[str]) -> None:
    """After mapping: every missing key must be a new parameter, and nothing may be unexpected."""
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
        plan_tensors=plan_dar_tensors,
        new_parameters=DAR_NEW_PARAMETERS,
        description="Dual Attention Residuals (dense)",
    ),
)


# --------------------------------------------------------------------------------------------------------------
# Sources.


@dataclasses.dataclass
class Source:
    """A source: where it came from (`name`, `location`: never an absolute path, they go into the model card), its
    config, tokenizer and generation config, and either its tensors (`checkpoint`, read one at a time) or a loaded
    model (`model`, eval mode, never modified)."""

    model: PreTrainedModel | None
    tokenizer: object | None
    name: str
    location: str  # "in-memory model", "HF folder <name>" or "GGUF file <file name>"
    config: PreTrainedConfig | None = None
    checkpoint: Checkpoint | None = None
    generation_config: GenerationConfig | None = None


def resolve_dtype(dtype: str | torch.dtype | None) -> torch.dtype | None:
    """A torch dtype from its name; "auto" (or None) -> None, meaning the source's own."""
    if dtype is None or dtype == "auto":
        return None
    if isinstance(dtype, torch.dtype) and dtype in DTYPES.values():
        return dtype
    if dtype in DTYPES:
        return DTYPES[dtype]
    raise ValueError(f"dtype must be 'auto' or one of {list(DTYPES)}, got {dtype!r}.")


def display_name(name_or_path: str) -> str:
    """A source's name for cards and configs: a Hub id as is, a local path by its last component only."""
    if os.path.isabs(name_or_path) or os.path.exists(name_or_path):
        return Path(name_or_path).name
    return name_or_path
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


def _plain_config(config: PreTrainedConfig) -> PreTrainedConfig:
    """A GGUF-read config without its quantization setting (a model built with it refuses `save_pretrained`)."""
    config = copy.deepcopy(config)
    if hasattr(config, "quantization_config"):
        del config.quantization_config
    return config


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
    plain = AutoModelForCausalLM.from_config(_plain_config(quantized.config), dtype=torch.float32)
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
    """Load (or wrap) the whole source model in `dtype`, e.g. to fine-tune or chat with it. An in-memory model is
    copied if it must change dtype, never modified. The converter itself streams (`open_source`).

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
        name = display_name(source.config.name_or_path or type(source).__name__)
        return Source(model.eval(), tokenizer, name, "in-memory model", config=source.config)
    path = Path(source)
    source_config = source_config or load_source_config(path)
    source_family(source_config)
    if path.is_file():
        folder, gguf_file = _gguf_location(path)
        loaded_tokenizer = tokenizer or _load_tokenizer(Path(folder), gguf_file)
        model = _load_gguf_model(path, dtype).eval()
        return Source(model, loaded_tokenizer, path.stem, f"GGUF file {path.name}", config=model.config)
    loaded_tokenizer = tokenizer or (_load_tokenizer(path) if need_tokenizer else None)
    model = _load_folder_model(path, dtype).eval()
    return Source(model, loaded_tokenizer, path.name, f"HF folder {path.name}", config=model.config)


MOE_GGUF_ARCHITECTURES = ("qwen2_moe", "qwen3_moe", "mixtral")


def open_source(source: PreTrainedModel | str | os.PathLike, source_config: PreTrainedConfig, tokenizer=None) -> Source:
    """The source's tensors, opened for reading one at a time (nothing is loaded), its tokenizer and generation config.

    An HF folder is read through its safetensors headers; a dense GGUF file tensor by tensor through transformers'
    GGUF tensor processors; an MoE GGUF file (whose processors merge experts across tensors) through transformers'
    whole-file loader, which holds every dequantised tensor in memory; an in-memory model through its state dict.
    """
    if isinstance(source, PreTrainedModel):
        if tokenizer is None:
            raise ValueError(
                "tokenizer is required to write an output folder from an in-memory model (the repo ships one)."
            )
        name = display_name(source.config.name_or_path or type(source).__name__)
        state = {key: tensor for key, tensor in source.state_dict().items()
                 if not (key == "lm_head.weight" and source.config.tie_word_embeddings)}
        return Source(None, tokenizer, name, "in-memory model", source.config, StateDictCheckpoint(state),
                      copy.deepcopy(source.generation_config))
    path = Path(source)
    if path.is_file():
        folder, gguf_file = _gguf_location(path)
        loaded_tokenizer = tokenizer or _load_tokenizer(Path(folder), gguf_file)
        config = _plain_config(source_config)
        with torch.device("meta"):
            meta = AutoModelForCausalLM.from_config(config)
        try:
            if config.model_type in MOE_GGUF_ARCHITECTURES:
                from transformers.modeling_gguf_pytorch_utils import load_gguf_checkpoint

                tensors = load_gguf_checkpoint(str(path), return_tensors=True, model_to_load=meta)["tensors"]
                checkpoint = StateDictCheckpoint(tensors, f"GGUF file {path}")
            else:
                checkpoint = GGUFCheckpoint(path, config, meta)
        except Exception as error:
            raise ValueError(f"Could not load the GGUF weights of {path}: {error}") from error
        return Source(None, loaded_tokenizer, path.stem, f"GGUF file {path.name}", config, checkpoint,
                      GenerationConfig.from_model_config(config))
    loaded_tokenizer = tokenizer or _load_tokenizer(path)
    checkpoint = SafetensorsCheckpoint(path)
    if (path / "generation_config.json").is_file():
        generation_config = GenerationConfig.from_pretrained(path)
    else:
        generation_config = GenerationConfig.from_model_config(source_config)
    return Source(None, loaded_tokenizer, path.name, f"HF folder {path.name}", source_config, checkpoint,
                  generation_config)


def source_storage_dtype(checkpoint: Checkpoint) -> torch.dtype:
    """The source's own dtype ("auto"): the floating dtype that holds most of its bytes."""
    totals: dict[torch.dtype, int] = {}
    for info in checkpoint.infos().values():
        if info.dtype.is_floating_point:
            totals[info.dtype] = totals.get(info.dtype, 0) + info.nbytes
    return max(totals, key=totals.get) if totals else torch.float32
# --------------------------------------------------------------------------------------------------------------
# The conversion itself: a plan from names and shapes, the new parameters from `_init_weights`.


def meta_model(model_class: type[PreTrainedModel], config: PreTrainedConfig) -> PreTrainedModel:
    """The model of `config` on the meta device (no memory; an 8B model builds in well under a second)."""
    build = model_class._from_config if issubclass(model_class, PreTrainedModel) else model_class.from_config
    with torch.device("meta"):
        return build(config, attn_implementation="sdpa")


def _post_order(module: nn.Module, prefix: str = "") -> Iterator[tuple[str, nn.Module]]:
    """(name, module) children first, as transformers' `initialize_weights` visits them."""
    for child_name, child in module.named_children():
        yield from _post_order(child, f"{prefix}{child_name}.")
    yield prefix.rstrip("."), module


def new_parameter_values(
    model_class: type[PreTrainedModel], config: PreTrainedConfig, names: Sequence[str]
) -> dict[str, torch.Tensor]:
    """The values the model's own `_init_weights` gives the parameters `names` (CPU, float32), exactly as
    `from_pretrained` initialises missing keys: those tensors are materialised on a meta model, and `_init_weights`
    runs over their modules and ancestors, children first. An initialiser that draws from the global random
    generator (a fresh MoE router) draws from one seeded by the module's name, so every conversion path (streamed or
    in memory) gives the same tensors."""
    model = meta_model(model_class, config)
    names = set(names)
    owners = {name.rpartition(".")[0] for name in names}
    involved = {".".join(owner.split(".")[:depth]) for owner in owners for depth in range(1, owner.count(".") + 2)}
    with torch.random.fork_rng(devices=[]):
        for module_name, module in _post_order(model):
            if module_name not in involved or isinstance(module, PreTrainedModel):
                continue
            for parameter_name, parameter in list(module.named_parameters(recurse=False)):
                if f"{module_name}.{parameter_name}" in names:
                    empty = torch.empty(parameter.shape, dtype=torch.float32, device="cpu")
                    setattr(module, parameter_name, nn.Parameter(empty, requires_grad=False))
            torch.manual_seed(zlib.crc32(module_name.encode()))
            model._init_weights(module)
    return {name: model.get_parameter(name).detach() for name in sorted(names)}


def plan_conversion(
    target: TargetKind,
    config: PreTrainedConfig,
    source_infos: Mapping[str, TensorInfo],
    dtype: torch.dtype,
    description: str = "the source",
) -> tuple[dict[str, TensorPlan], list[str]]:
    """Every tensor of the target checkpoint: the shared ones planned from the source's (cast to `dtype`), the new
    ones with their `_init_weights` values (float32; float64 in a float64 model). Returns (plans, new names).

    Raises, naming `description`, when a target parameter is neither planned nor new, when a planned tensor has no
    place in the target, or when a shape differs from the target config's."""
    try:
        shared = target.plan_tensors(source_infos, config)
    except ValueError as error:
        raise ValueError(f"{description}: {error}") from error
    expected = meta_model(target.model_class, config).state_dict()
    if config.tie_word_embeddings:
        expected.pop("lm_head.weight", None)
        shared.pop("lm_head.weight", None)  # tied: as `save_pretrained`, the checkpoint holds the embedding only
    missing = [name for name in expected if name not in shared]
    unexpected = [name for name in shared if name not in expected]
    try:
        check_keys(missing, unexpected, target.new_parameters)
    except ValueError as error:
        raise ValueError(f"The weights in {description} do not match its config.json: {error}") from error
    mismatched = {name: (plan.shape, tuple(expected[name].shape)) for name, plan in shared.items()
                  if plan.shape != tuple(expected[name].shape)}
    if mismatched:
        raise ValueError(f"The weights in {description} do not match its config.json: shapes (found, expected) "
                         f"{dict(list(mismatched.items())[:8])}.")
    plans = {name: dataclasses.replace(plan, dtype=dtype) for name, plan in shared.items()}
    new_dtype = torch.float64 if dtype == torch.float64 else torch.float32  # DESIGN.md section 4: DAR stays fp32
    for name, value in new_parameter_values(target.model_class, config, missing).items():
        plans[name] = TensorPlan(tuple(value.shape), new_dtype, value=value)
    ordered = {name: plans[name] for name in expected if name in plans}  # the model's own parameter order
    return ordered, sorted(missing)


def upcycle_model(
    source_model: PreTrainedModel, kind: str = "dar", dtype: torch.dtype | None = None, **fields
) -> PreTrainedModel:
    """Source model -> target model in memory, through the same plan as a streamed conversion (key map, new
    parameters from `_init_weights`, nothing else missing), loaded as `from_pretrained` loads a checkpoint: DAR
    parameters float32 in a half-precision model, buffers (rotary `inv_freq`) as the class builds them."""
    target = _target_kind(kind)
    dtype = dtype or source_model.dtype
    config = target.build_config(source_model.config, source_family(source_model.config), dtype, fields)
    checkpoint = StateDictCheckpoint(source_model.state_dict())
    plans, _ = plan_conversion(target, config, checkpoint.infos(), dtype, "the in-memory model")
    # Cloned: the target never shares storage with the source (training one must not change the other).
    state = {name: materialise(plan, checkpoint).clone() for name, plan in plans.items()}
    with logging_level_error():
        model = target.model_class.from_pretrained(None, config=config, state_dict=state, dtype=dtype)
    model.config.name_or_path = ""
    model.generation_config = copy.deepcopy(source_model.generation_config)
    return model.eval()


@contextlib.contextmanager
def logging_level_error():
    """Silence transformers' loading report and progress bars for a load whose keys were already checked."""
    previous = logging.get_verbosity()
    logging.set_verbosity_error()
    bars = logging.is_progress_bar_enabled()
    logging.disable_progress_bar()
    try:
        yield
    finally:
        logging.set_verbosity(previous)
        if bars:
            logging.enable_progress_bar()


def cast_model(model: PreTrainedModel, dtype: torch.dtype) -> PreTrainedModel:
    """A copy of `model` whose parameters compute in `dtype` (the verification dtype); buffers are kept as they are,
    as `from_pretrained` keeps rotary `inv_freq` in float32."""
    if all(parameter.dtype == dtype for parameter in model.parameters()) and not model.training:
        return model
    copied = copy.deepcopy(model)
    buffers = {name: buffer for name, buffer in copied.named_buffers()}
    copied.to(dtype)
    for name, buffer in buffers.items():
        module_name, _, buffer_name = name.rpartition(".")
        copied.get_submodule(module_name)._buffers[buffer_name] = buffer
    return copied.eval()


def _target_kind(kind: str) -> TargetKind:
    if kind not in TARGET_KINDS:
        raise ValueError(f"kind must be one of {sorted(TARGET_KINDS)}, got {kind!r}.")
    return TARGET_KINDS[kind]
# --------------------------------------------------------------------------------------------------------------
# Verification.


@dataclasses.dataclass
class PromptCheck:
    """One prompt run through source and converted model.

    `top1_checked`: positions where the source's top-1/top-2 logit margin exceeds twice the tolerance (there no
    difference within the tolerance can change the argmax); `top1_agreed`: those where both models' argmax agree
    (teacher-forced greedy agreement). `greedy_identical` is None when full continuations did not run.
    """

    name: str
    num_tokens: int
    max_abs_logit: float
    max_abs_logit_difference: float
    top1_checked: int
    top1_agreed: int
    greedy_identical: bool | None
    source_continuation: list[int]
    target_continuation: list[int]

    @classmethod
    def of(cls, name, input_ids, max_abs_logit, max_abs_logit_difference, top1, source_tokens, target_tokens):
        """One prompt's check from its figures; top1 = (checked, agreed); continuations None when not run."""
        return cls(
            name=name,
            num_tokens=input_ids.shape[1],
            max_abs_logit=max_abs_logit,
            max_abs_logit_difference=max_abs_logit_difference,
            top1_checked=top1[0],
            top1_agreed=top1[1],
            greedy_identical=None if source_tokens is None else source_tokens == target_tokens,
            source_continuation=source_tokens or [],
            target_continuation=target_tokens or [],
        )


@dataclasses.dataclass
class VerificationReport:
    dtype: str  # the dtype the check computed in
    tolerance: float
    default_tolerance: float
    max_new_tokens: int  # 0 when full greedy continuations did not run
    checks: list[PromptCheck]
    method: str = "in memory"  # or "layer-streamed"
    storage_dtype: str | None = None
    greedy_skipped: str = "none asked for"  # why full greedy continuations did not run

    @property
    def relaxed(self) -> bool:
        """True when a caller lowered the bar above the dtype's default tolerance."""
        return self.tolerance > self.default_tolerance

    @property
    def max_abs_logit_difference(self) -> float:
        return max(check.max_abs_logit_difference for check in self.checks)

    @property
    def greedy_ran(self) -> bool:
        return all(check.greedy_identical is not None for check in self.checks)

    @property
    def greedy_identical(self) -> bool:
        """Full continuations identical where they ran, and teacher-forced top-1 agreement everywhere."""
        return all(check.greedy_identical is not False and check.top1_agreed == check.top1_checked
                   for check in self.checks)

    @property
    def passed(self) -> bool:
        within = self.max_abs_logit_difference <= self.tolerance
        return within and (self.greedy_identical or self.relaxed)

    def checks_run(self) -> str:
        """One sentence saying which checks ran (for the table and the model card)."""
        computed = f"computed in {self.dtype}" + (
            f" from {self.storage_dtype} weights" if self.storage_dtype and self.storage_dtype != self.dtype else ""
        )
        checked = sum(check.top1_checked for check in self.checks)
        total = sum(check.num_tokens for check in self.checks)
        greedy = (f"full greedy continuations of {self.max_new_tokens} tokens per prompt" if self.greedy_ran
                  else f"no full greedy continuations ({self.greedy_skipped})")
        return (f"Checks run ({self.method}, {computed}): max abs logit difference at every position; teacher-forced "
                f"top-1 agreement at the {checked} of {total} positions whose source top-1/top-2 margin exceeds "
                f"2 x tolerance; {greedy}.")

    def table(self) -> str:
        """A Markdown table: one row per prompt, then the verdict and the checks that ran."""
        lines = [
            "| prompt | tokens | max abs logit | max abs logit difference | top-1 agreement (teacher-forced) "
            "| greedy continuation identical |",
            "|---|---:|---:|---:|---:|---|",
        ]
        for check in self.checks:
            greedy = ("not run" if check.greedy_identical is None
                      else f"{'yes' if check.greedy_identical else 'NO'} ({self.max_new_tokens} tokens)")
            lines.append(
                f"| {check.name} | {check.num_tokens} | {check.max_abs_logit:.2f} | "
                f"{check.max_abs_logit_difference:.3e} | {check.top1_agreed}/{check.top1_checked} | {greedy} |"
            )
        verdict = "PASSED" if self.passed else "FAILED"
        bar = f"tolerance {self.tolerance:.1e} in {self.dtype}"
        if self.relaxed:
            bar += f" (RELAXED from the default {self.default_tolerance:.1e}; greedy mismatches only reported)"
        lines.append("")
        lines.append(f"{verdict}: max abs logit difference {self.max_abs_logit_difference:.3e}, {bar}.")
        lines.append(self.checks_run())
        return "\n".join(lines)


def top1_agreement(source_logits: torch.Tensor, target_logits: torch.Tensor, tolerance: float) -> tuple[int, int]:
    """(positions checked, positions agreeing): argmax agreement where the source's top-1/top-2 margin > 2 tol."""
    top2 = source_logits.topk(2, dim=-1)  # values, indices [..., 2]
    decided = (top2.values[..., 0] - top2.values[..., 1]) > 2 * tolerance
    agreed = decided & (target_logits.argmax(-1) == top2.indices[..., 0])
    return int(decided.sum()), int(agreed.sum())
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
    """Run two in-memory models side by side: max |logit difference| over all positions, teacher-forced top-1
    agreement, greedy continuations (`max_new_tokens=0` skips them). The caller picks the models' dtype.

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
    tolerance = default_tolerance if tolerance is None else tolerance
    steps = logging.tqdm(total=len(prompts) + 2, desc="Verifying (source vs DAR)", disable=not progress)
    logit_pairs = []
    for name, input_ids in prompts:
        logit_pairs.append((source_model(input_ids).logits.double(), target_model(input_ids).logits.double()))  # [1, T, V]
        steps.update()
    continuations = [[None] * len(prompts), [None] * len(prompts)]
    if max_new_tokens > 0:
        for side, (role, model) in enumerate((("source", source_model), ("converted", target_model))):
            description = f"Greedy decoding, {role} model ({len(prompts)} prompts)"
            continuations[side] = greedy_continuations(
                model, [ids for _, ids in prompts], max_new_tokens, 0, description, progress
            )
            steps.update()
    steps.close()
    checks = []
    for (name, input_ids), (source_logits, target_logits), source_tokens, target_tokens in zip(
        prompts, logit_pairs, *continuations
    ):
        checks.append(
            PromptCheck.of(
                name, input_ids, source_logits.abs().max().item(), (target_logits - source_logits).abs().max().item(),
                top1_agreement(source_logits, target_logits, tolerance), source_tokens, target_tokens,
            )
        )
    return VerificationReport(
        dtype=str(dtype).removeprefix("torch."),
        tolerance=tolerance,
        default_tolerance=default_tolerance,
        max_new_tokens=max_new_tokens,
        checks=checks,
    )


def _source_layout(state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """A source checkpoint's tensors in its model's parameter names: ignored keys dropped, per-expert MoE tensors
    fused (as transformers' loader fuses them)."""
    from .moe_upcycling import fuse_expert_weights

    return fuse_expert_weights({key: tensor for key, tensor in state.items() if not is_ignored_source_key(key)})


def _load_full_source(source: Source, dtype: torch.dtype) -> PreTrainedModel:
    if source.model is not None:
        return cast_model(source.model, dtype)
    with logging_level_error():
        model = AutoModelForCausalLM.from_config(source.config, dtype=dtype, attn_implementation="sdpa")
    state = _source_layout({name: source.checkpoint.read(name).to(dtype) for name in source.checkpoint.infos()})
    result = model.load_state_dict(state, strict=False)
    tied = ["lm_head.weight"] if source.config.tie_word_embeddings else []
    if result.unexpected_keys or set(result.missing_keys) - set(tied):
        raise ValueError(f"{source.location}: the weights do not load into {type(model).__name__}: {result}.")
    return model.eval()


def _set_experts_for(model: PreTrainedModel, dtype: torch.dtype) -> None:
    """transformers' grouped_mm experts kernel takes float32/bf16/fp16 only; batched_mm is its float64-capable peer."""
    if dtype == torch.float64 and any(type(module).__name__.endswith("Experts") for module in model.modules()):
        model.set_experts_implementation("batched_mm")


@torch.no_grad()
def verify_written(
    source: Source,
    target: TargetKind,
    folder: Path,
    prompts: Sequence[tuple[str, torch.Tensor]],
    dtype: torch.dtype,
    tolerance: float | None = None,
    full_greedy: bool | None = None,
    max_new_tokens: int = 64,
    progress: bool = True,
) -> VerificationReport:
    """Verify the conversion written in `folder` against the source: layer-streamed logits in `dtype` (max |logit
    difference|, teacher-forced top-1 agreement), and full greedy continuations of both models (the written one
    loaded by `from_pretrained`) when `full_greedy`, or by default when both fit in `FULL_GREEDY_MAX_BYTES`."""
    from .layerwise import StreamedModel, streamed_logit_statistics

    default_tolerance = DEFAULT_TOLERANCES[dtype]
    tolerance = default_tolerance if tolerance is None else tolerance
    written = SafetensorsCheckpoint(folder)
    try:
        target_config = AutoConfig.from_pretrained(folder)
        source_meta = meta_model(AutoModelForCausalLM, _plain_config(source.config))
        target_meta = meta_model(target.model_class, target_config)
        for model in (source_meta, target_meta):
            _set_experts_for(model, dtype)
        statistics = streamed_logit_statistics(
            StreamedModel(source_meta, source.checkpoint, _source_layout),
            StreamedModel(target_meta, written),
            [ids for _, ids in prompts],
            dtype,
            progress,
        )
        greedy_skipped = ("none asked for: max new tokens 0" if max_new_tokens == 0
                          else "turned off (--full-greedy off)" if full_greedy is False
                          else "both models do not fit in memory together")
        if full_greedy is None:
            sizes = [info.nbytes // info.dtype.itemsize * dtype.itemsize
                     for checkpoint in (source.checkpoint, written) for info in checkpoint.infos().values()]
            full_greedy = sum(sizes) <= FULL_GREEDY_MAX_BYTES
        continuations = [[None] * len(prompts)] * 2
        if full_greedy and max_new_tokens > 0:
            continuations = _full_greedy(source, folder, prompts, dtype, max_new_tokens, progress)
    finally:
        written.close()
    checks = []
    for (name, input_ids), stats, source_tokens, target_tokens in zip(prompts, statistics, *continuations):
        checks.append(
            PromptCheck.of(
                name, input_ids, stats.max_abs_logit, stats.max_abs_logit_difference, stats.top1_agreement(tolerance),
                source_tokens, target_tokens,
            )
        )
    return VerificationReport(
        dtype=str(dtype).removeprefix("torch."),
        tolerance=tolerance,
        default_tolerance=default_tolerance,
        max_new_tokens=max_new_tokens if full_greedy else 0,
        checks=checks,
        method="layer-streamed",
        storage_dtype=str(target_config.dtype).removeprefix("torch."),
        greedy_skipped=greedy_skipped,
    )


def _full_greedy(source, folder, prompts, dtype, max_new_tokens, progress) -> list[list[list[int]]]:
    """Greedy continuations of the source and of the written folder loaded by `from_pretrained`, in `dtype`."""
    source_model = _load_full_source(source, dtype)
    with logging_level_error():
        target_model = AutoModelForCausalLM.from_pretrained(folder, dtype=dtype).eval()
    _set_experts_for(source_model, dtype)
    _set_experts_for(target_model, dtype)
    continuations = []
    with norms_in_input_dtype(source_model, target_model) if dtype == torch.float64 else contextlib.nullcontext():
        for role, model in (("source", source_model), ("converted", target_model)):
            description = f"Greedy decoding, {role} model ({len(prompts)} prompts)"
            continuations.append(
                greedy_continuations(model, [ids for _, ids in prompts], max_new_tokens, 0, description, progress)
            )
    return continuations
# --------------------------------------------------------------------------------------------------------------
# The entry points.


@dataclasses.dataclass
class ConversionResult:
    """`model`: the converted model, in memory only for an in-memory conversion (no output folder); a written
    conversion is loaded from `output` (`convert()` does so). `config`: the target config either way."""

    model: PreTrainedModel | None
    tokenizer: object | None
    report: VerificationReport | None
    source: Source
    output: Path | None
    config: PreTrainedConfig | None = None


def verification_dtype(storage_dtype: torch.dtype, requested: str | torch.dtype | None = None) -> torch.dtype:
    """The dtype the check computes in: float32 for float32 and half-precision weights, float64 for float64 ones,
    or the requested float32/float64."""
    dtype = resolve_dtype(requested) or torch.promote_types(storage_dtype, torch.float32)
    if dtype not in (torch.float32, torch.float64):
        raise ValueError(f"verify_dtype must be 'float32' or 'float64', got {requested!r}.")
    return dtype


def upcycle(
    source: PreTrainedModel | str | os.PathLike,
    output: str | os.PathLike | None = None,
    *,
    tokenizer=None,
    kind: str = "dar",
    dtype: str | torch.dtype = "auto",
    tolerance: float | None = None,
    verify: bool = True,
    verify_dtype: str | torch.dtype | None = None,
    full_greedy: bool | None = None,
    prompts: Sequence[str] | None = None,
    max_new_tokens: int = 64,
    overwrite: bool = False,
    max_shard_size: str | int = "2GB",
    base_model: str | None = None,
    progress: bool = True,
    **fields,
) -> ConversionResult:
    """Convert, verify and (if `output` is given) write; returns the verification report, the source and, for an
    in-memory conversion, the model.

    A path source (HF folder, GGUF file), or an in-memory model with an `output`, converts as a file operation: the
    folder is written to a temporary folder next to `output`, verified layer by layer in `verify_dtype` (float32 by
    default, float64 for float64 weights) against the source, and moved into place only if it passes. `dtype` is
    the storage dtype of the shared weights ("auto": the source's own). `fields` are the target kind's config fields
    (for DAR: `dar_block_size`, `dar_routing`, `dar_num_streams`, ...). Raises before writing anything if an input
    is bad or the verification fails.
    """
    if tolerance is not None and not (isinstance(tolerance, (int, float)) and tolerance > 0):
        raise ValueError(f"tolerance must be a positive number, got {tolerance!r}.")
    if not (isinstance(max_new_tokens, int) and max_new_tokens >= 0):
        raise ValueError(f"max_new_tokens must be an integer >= 0 (0: no greedy continuations), got {max_new_tokens!r}.")
    storage_dtype = resolve_dtype(dtype)
    target = _target_kind(kind)
    max_shard_bytes = parse_size(max_shard_size)
    if output is not None:
        output = check_output_folder(output, overwrite, source)
        if not verify:
            raise ValueError("verify=False cannot write an output folder: only verified conversions are written.")
    if isinstance(source, PreTrainedModel):
        source_config = source.config
        source_family(source_config)
        if output is None:
            return _upcycle_in_memory(source, tokenizer, target, kind, storage_dtype, tolerance, verify, verify_dtype,
                                      full_greedy, prompts, max_new_tokens, progress, fields)
    else:
        source_config = load_source_config(source)
        source_family(source_config)
    # Validate the target config before opening any weight.
    target.build_config(source_config, source_family(source_config), storage_dtype or torch.float32, fields)

    loaded = open_source(source, source_config, tokenizer)
    if isinstance(source, PreTrainedModel):
        loaded.model = source
    try:
        storage_dtype = storage_dtype or source_storage_dtype(loaded.checkpoint)
        config = target.build_config(source_config, source_family(source_config), storage_dtype, fields)
        plans, new_names = plan_conversion(target, config, loaded.checkpoint.infos(), storage_dtype,
                                           loaded.checkpoint.description)
        check_dtype = verification_dtype(storage_dtype, verify_dtype)
        prompt_ids = build_prompts(loaded.tokenizer, source_config.vocab_size, prompts) if verify else []
        outcome = {}

        def write(folder: Path) -> None:
            write_converted_folder(folder, target, config, plans, new_names, loaded, max_shard_bytes, progress)
            if not verify:
                return
            report = verify_written(loaded, target, folder, prompt_ids, check_dtype, tolerance, full_greedy,
                                    max_new_tokens, progress)
            outcome["report"] = report
            _raise_unless_passed(report, storage_dtype)
            from .model_card import chat_answers, render_model_card

            answers = chat_answers(report, loaded.tokenizer, loaded.generation_config.eos_token_id)
            card = render_model_card(config, report, loaded, base_model=base_model, kind=target.description,
                                     answers=answers)
            (folder / "README.md").write_text(card, encoding="utf-8")

        if output is not None:
            write_repo_folder(output, write, overwrite, source)
            logger.info(f"Wrote the converted model to {output}")
        else:  # a check only: written to a temporary folder, verified, removed
            with tempfile.TemporaryDirectory(prefix="dar-convert-") as scratch:
                write(Path(scratch))
    finally:
        loaded.checkpoint.close()
    loaded.model = None
    return ConversionResult(model=None, tokenizer=loaded.tokenizer, report=outcome.get("report"), source=loaded,
                            output=output, config=config)


def write_converted_folder(folder, target, config, plans, new_names, source: Source, max_shard_bytes, progress):
    """The repo folder without its card: weights (shared shards, then DAR's own), config with `auto_map` and the
    remote-code files, generation config, tokenizer."""
    bar = logging.tqdm(total=len(plans), desc="Writing tensors", unit="tensor", disable=not progress)
    write_checkpoint(folder, plans, source.checkpoint, max_shard_bytes, own_shards=new_names,
                     progress=lambda name: bar.update())
    bar.close()
    config = copy.deepcopy(config)
    config.name_or_path = ""
    custom_object_save(meta_model(target.model_class, config), folder, config=config)
    config.save_pretrained(folder)
    source.generation_config.save_pretrained(folder)
    source.tokenizer.save_pretrained(folder)


def _raise_unless_passed(report: VerificationReport, storage_dtype: torch.dtype) -> None:
    if report.relaxed:
        logger.warning(
            f"Verification tolerance relaxed to {report.tolerance:.1e} (default {report.default_tolerance:.1e} "
            f"in {report.dtype}); greedy mismatches are reported, not refused. The model card says so."
        )
    if report.passed:
        return
    hint = ""
    if storage_dtype in (torch.bfloat16, torch.float16) and not report.relaxed:
        hint = (
            f"\nThe weights were rounded to {str(storage_dtype).removeprefix('torch.')}, which moves the logits beyond "
            "the bar; pass a larger tolerance (--tolerance) to accept a lower bar, which the model card records."
        )
    raise VerificationError(
        f"The converted model does not reproduce the source; nothing was written.\n{report.table()}{hint}", report
    )


def _upcycle_in_memory(source, tokenizer, target, kind, storage_dtype, tolerance, verify, verify_dtype, full_greedy,
                       prompts, max_new_tokens, progress, fields) -> ConversionResult:
    """An in-memory model, nothing written: `upcycle_model`, then both models side by side in the check dtype."""
    storage_dtype = storage_dtype or source.dtype
    target.build_config(source.config, source_family(source.config), storage_dtype, fields)
    model = upcycle_model(source, kind, storage_dtype, **fields)
    report = None
    if verify:
        check_dtype = verification_dtype(storage_dtype, verify_dtype)
        source_model, target_model = cast_model(source, check_dtype), cast_model(model, check_dtype)
        _set_experts_for(source_model, check_dtype)
        _set_experts_for(target_model, check_dtype)
        prompt_ids = build_prompts(tokenizer, source.config.vocab_size, prompts)
        report = verify_conversion(source_model, target_model, prompt_ids, tolerance,
                                   0 if full_greedy is False else max_new_tokens, progress)
        report.storage_dtype = str(storage_dtype).removeprefix("torch.")
        _raise_unless_passed(report, storage_dtype)
    name = display_name(source.config.name_or_path or type(source).__name__)
    loaded = Source(source, tokenizer, name, "in-memory model", source.config)
    return ConversionResult(model=model, tokenizer=tokenizer, report=report, source=loaded, output=None,
                            config=model.config)


def convert(
    source: PreTrainedModel | str | os.PathLike, output: str | os.PathLike | None = None, **options
) -> PreTrainedModel:
    """Upcycle `source` (a model, an HF folder or a .gguf file) into DAR, verified; write it to `output` if given.
    Returns the converted model (a written one loaded from `output` with `dtype="auto"`).

    Keyword arguments: the DAR fields (`dar_block_size=8`, `dar_routing="dar"`, `dar_num_streams=2`, ...) and the
    options of `upcycle` (`dtype`, `tolerance`, `tokenizer`, `overwrite`, `max_shard_size`, `base_model`, ...).

    ```python
    >>> from dar_transformers.convert import convert
    >>> dar = convert("SmolLM2-135M-Instruct.Q4_1.gguf", "smollm2-dar", dar_block_size=8)
    ```
    """
    if output is None and not isinstance(source, PreTrainedModel):
        with tempfile.TemporaryDirectory(prefix="dar-convert-") as scratch:
            return convert(source, Path(scratch) / "dar", **options)
    result = upcycle(source, output, **options)
    if result.model is not None:
        return result.model
    with logging_level_error():
        return AutoModelForCausalLM.from_pretrained(result.output, dtype="auto").eval()


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
    "new_parameter_values",
    "plan_conversion",
    "register_target_kind",
    "upcycle",
    "upcycle_model",
    "verify_conversion",
    "verify_written",
]
