# SPDX-License-Identifier: Apache-2.0
# Copyright 2026 The dar-transformers authors.
"""Sources: an HF folder (safetensors), a GGUF file, or an in-memory model, opened for reading tensor by tensor
(`open_source`), with their config, tokenizer and generation config. The config is read, and its family checked,
before any weight (`load_source_config`); `load_source` loads a whole model instead (examples, fine-tuning).
"""

import collections
import contextlib
import copy
import dataclasses
import fnmatch
import json
import math
import os
import re
import threading
from pathlib import Path

import torch
import transformers
from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer, GenerationConfig, PreTrainedConfig, PreTrainedModel
from transformers.activations import ACT2FN
from transformers.integrations.ggml import GGUF_CONFIG_MAPPING
from transformers.modeling_gguf_pytorch_utils import load_gguf_checkpoint
from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS
from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES
from transformers.utils import logging

from ..training import is_dar_parameter
from .checkpoints import (
    INDEX_NAME, Checkpoint, GGUFCheckpoint, SafetensorsCheckpoint, StateDictCheckpoint, placed_gguf_tensors,
    source_read_error,
)
from .families import (
    ALL_SOURCE_FAMILIES,
    DAR_SOURCE_TYPE,
    architecture_fields,
    cache_only_windows,
    check_causal,
    check_model_type,
    one_line,
    rope_folded_fields,
    source_family,
)

logger = logging.get_logger(__name__)

TOKENIZER_FILES = ("tokenizer.json", "tokenizer.model", "vocab.json")
# Source files the output carries byte for byte: the license terms that travel with the weights, and the vocabulary
# files of a tokenizer read from the folder (its `save_pretrained` writes tokenizer.json only; llama.cpp's GGUF
# converter and sentencepiece users read tokenizer.model, BPE tools vocab.json and merges.txt).
# License patterns match names in any case (LICENSE, license.txt, Notice.md), files and folders (REUSE's LICENSES/,
# copied whole with its layout).
LICENSE_FILES = ("license*", "licence*", "notice*", "copying*", "use_policy*")
# The files of other tokenizer loaders (mistral-common's tekken.json and tokenizer.model.v3) describe the same
# vocabulary and travel too.
TOKENIZER_SIDE_FILES = ("tokenizer.model", "vocab.json", "merges.txt", "tekken.json", "tokenizer.model.v[0-9]*")
# A tokenizer read from the folder travels as its files (`tokenizer_copied`): transformers' `save_pretrained` rewrites
# tokenizer.json from its own reading (5.25 puts a class's built-in normaliser and pre-tokeniser in it) and drops
# settings such as LlamaTokenizer's `legacy`, so that a re-saved tokenizer tokenised otherwise than the source's
# files in `tokenizers` and other runtimes, or was refused by the converter's check. Where it is saved by transformers
# instead, these are what its `save_pretrained` writes anew (with `additional_chat_templates/`).
TOKENIZER_COPIED_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "added_tokens.json",
                          "chat_template.jinja", "chat_template.json")
CHAT_TEMPLATES_FOLDER = "additional_chat_templates"
# MoE GGUF files go through transformers' whole-file loader: its tensor processors merge experts across tensors.
# (llama.cpp writes a Mixtral as architecture "llama"; transformers reads it as a Llama, and its expert tensors, which
# a Llama has no parameter for, are refused by `GGUFCheckpoint`.)
MOE_GGUF_ARCHITECTURES = ("qwen2_moe", "qwen3_moe")
# The top-k routing llama.cpp computes for an MoE architecture, fixed by its graph whatever the file's metadata says
# (its qwen2moe graph weights the experts by their softmax probabilities as they are, its qwen3moe graph renormalises
# the top k): the config transformers' GGUF reader builds must say the same (Qwen3's comes from transformers'
# `GGUF_CONFIG_DEFAULTS_MAPPING`, not from the file), or both it and a conversion verified against it route otherwise.
GGUF_ARCHITECTURE_ROUTING: dict[str, dict[str, object]] = {
    "qwen2_moe": {"norm_topk_prob": False},
    "qwen3_moe": {"norm_topk_prob": True},
}
# `{architecture}.*` GGUF metadata that llama.cpp applies and transformers' GGUF config reader drops for the families
# that convert (`GGUF_CONFIG_MAPPING` has no config field for it), with the values under which dropping it changes
# nothing. Any other value means transformers' reading, and so a conversion verified against it, computes something
# other than what the file's model computes in llama.cpp (issue: rope scaling x4 read as no scaling, PASSED).
GGUF_DROPPED_METADATA: dict[str, tuple] = {
    # yarn, longrope: llama.cpp rescales the rotary frequencies; linear (also without a type) by the factor, checked
    # below; "none" scales by nothing whatever the factor (`check_gguf_metadata` then skips the factor)
    "rope.scaling.type": ("none", "linear"),
    "rope.scaling.factor": (0.0, 1.0),  # applied as linear scaling even without a type (0: unset)
    "rope.scale_linear": (0.0, 1.0),  # the factor's older name
    "rope.scaling.attn_factor": (1.0,),  # scales every rotary cos/sin
    "attention.sliding_window": (0,),  # a window transformers' config would not have
    "attention.causal": (True,),  # False: llama.cpp attends both ways (an embedding model); transformers, causally
    "attention.scale": (0.0,),  # 0: 1/sqrt(head_dim)
    "logit_scale": (1.0,),
    "embedding_scale": (1.0,),
    "residual_scale": (1.0,),
    "attn_logit_softcapping": (0.0,),
    "final_logit_softcapping": (0.0,),
}
# Dropped metadata that must equal what transformers' config holds instead (its class default, or the head dimension
# computed from the shape): a partial rotary or a different head size otherwise; for an MoE file, expert widths other
# than Qwen2MoeConfig's or Qwen3MoeConfig's defaults (the file's tensors then do not fit the model transformers builds).
GGUF_CONFIG_FIELD_METADATA: dict[str, str] = {
    "rope.dimension_count": "head_dim",
    "attention.key_length": "head_dim",
    "attention.value_length": "head_dim",
    "expert_feed_forward_length": "moe_intermediate_size",
    "expert_shared_feed_forward_length": "shared_expert_intermediate_size",
}


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
    folder: Path | None = None  # an HF folder source: its README.md front matter gives the card's license
    side_files: tuple[Path, ...] = ()  # source files the output carries byte for byte (`copied_side_files`)
    tokenizer_copied: bool = False  # its tokenizer's files are among them, written in place of transformers' save
    not_carried: tuple[str, ...] = ()  # a folder's entries the output does not carry (`not_carried`), for a warning
    custom_code: tuple[str, ...] = ()  # its config.json's `auto_map` entries, never run (`custom_code_entries`)
    license: dict[str, str] = dataclasses.field(default_factory=dict)  # a GGUF file's, as card fields (`gguf_license`)
    stored_as: str = ""  # how the source stores its tensors where the card's weights dtype would not say it
    # (`gguf_tensor_types`, `widened_tensor_types`)

    @property
    def reference_class(self) -> str:
        """The causal-LM class the conversion reproduces, in a phrase (`reference_class`)."""
        return reference_class(self.config.model_type)


def reference_class(model_type: str) -> str:
    """The class a source of `model_type` is loaded, converted and verified as, whatever its config.json's `auto_map`
    says: "transformers' built-in `LlamaForCausalLM`", or for a dense DAR source "this package's `DARForCausalLM`"."""
    if model_type == DAR_SOURCE_TYPE:
        return "this package's `DARForCausalLM`"
    return f"transformers' built-in `{MODEL_FOR_CAUSAL_LM_MAPPING_NAMES.get(model_type, 'causal-LM class')}`"



def display_name(name_or_path: str) -> str:
    """A source's name for cards and configs: a Hub id as is, a local path by its last component only (`folder_name`:
    a Hub cache snapshot by its repo id)."""
    if os.path.isabs(name_or_path) or os.path.exists(name_or_path):
        return folder_name(Path(name_or_path))
    return name_or_path


def folder_name(path: Path) -> str:
    """A source folder's own name, also when it is given as ".", ".." or "dir/." (whose `Path.name` is empty); a
    snapshot in the Hub cache (`.../models--{org}--{name}/snapshots/{commit}`, what `hf download` returns) by its
    repo id, not by its commit hash (`hub_snapshot`)."""
    snapshot = hub_snapshot(path)
    return snapshot[0] if snapshot else Path(os.path.abspath(path)).name


def hub_snapshot(folder: Path) -> tuple[str, str] | None:
    """(repo id, commit) of a folder that is a snapshot in the Hub cache, `.../models--{org}--{name}/snapshots/{commit}`
    (what `hf download` and `snapshot_download` return); None for any other folder."""
    path = Path(os.path.abspath(folder))
    cached = re.fullmatch(r"models--(.+?)--(.+)", path.parent.parent.name)
    if path.parent.name == "snapshots" and cached:
        return f"{cached.group(1)}/{cached.group(2)}", path.name
    return None


def folder_location(folder: Path) -> str:
    """The card's and log's "HF folder <name>", with the commit of a Hub cache snapshot: which revision converted."""
    snapshot = hub_snapshot(folder)
    return f"HF folder {snapshot[0]} at commit {snapshot[1]}" if snapshot else f"HF folder {folder_name(folder)}"


def gguf_location(path: Path) -> str:
    """The card's and log's "GGUF file <file name>", with the repo and commit of a Hub cache snapshot holding it."""
    snapshot = hub_snapshot(path.parent)
    return f"GGUF file {path.name}" + (f" of {snapshot[0]} at commit {snapshot[1]}" if snapshot else "")


def _gguf_folder_and_file(path: Path) -> tuple[str, str]:
    return str(path.parent), path.name


def source_model_type(path: str | os.PathLike) -> str | None:
    """The model_type of a folder or GGUF source as transformers reads it, without checks or warnings (those come
    with `load_source_config`); None where it cannot be read, which the conversion then reports."""
    path = Path(path)
    try:
        if path.is_dir():
            model_type = json.loads((path / "config.json").read_text(encoding="utf-8")).get("model_type")
        else:
            folder, gguf_file = _gguf_folder_and_file(path)
            model_type = AutoConfig.from_pretrained(folder, gguf_file=gguf_file, trust_remote_code=False).model_type
    except Exception:  # whatever a foreign or broken source trips over: the conversion names it
        return None
    return model_type if isinstance(model_type, str) else None  # `"model_type": ["llama"]`: refused by the conversion


def load_source_config(path: str | os.PathLike) -> PreTrainedConfig:
    """The config of a folder or GGUF source, read before any weight so that bad inputs fail fast."""
    path = Path(path)
    if not path.exists():
        raise FileNotFoundError(f"Source {path} does not exist (expected an HF model folder or a .gguf file).")
    if path.is_file():
        if path.suffix.lower() != ".gguf":  # as transformers reads gguf_file: "MODEL.GGUF" too
            raise ValueError(f"Source file {path} is not a .gguf file; pass an HF model folder or a GGUF file.")
        folder, gguf_file = _gguf_folder_and_file(path)
        try:
            config = AutoConfig.from_pretrained(folder, gguf_file=gguf_file, trust_remote_code=False)
        except Exception as error:  # gguf-py raises whatever a truncated or foreign file trips over
            raise ValueError(f"Could not read the GGUF metadata of {path}: {one_line(error)}") from error
        check_gguf_metadata(path, config)
        check_has_layers(config, f"GGUF file {path}: its metadata block_count")
        check_model_builds(config, f"GGUF file {path} (the config transformers reads from its metadata)")
        return config
    config_file = path / "config.json"
    if (path / "adapter_config.json").is_file() and not any(
            (path / name).is_file() for name in ("model.safetensors", INDEX_NAME)):
        raise ValueError(
            f"Source folder {path} is a PEFT adapter (adapter_config.json), not a model: merge it into the model it "
            "was trained on and convert that (PeftModel.from_pretrained(base_model, adapter).merge_and_unload()"
            ".save_pretrained(folder), with the base model's tokenizer)."
        )
    if not config_file.is_file():
        raise FileNotFoundError(f"Source folder {path} has no config.json; it is not a Hugging Face model folder.")
    try:
        fields = json.loads(config_file.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as error:
        raise ValueError(f"Could not read {config_file}: {one_line(error)}") from error
    if not isinstance(fields, dict):
        raise ValueError(f"Could not read {config_file}: it holds a JSON {type(fields).__name__}, not an object.")
    # Before any Auto call: a custom model_type (with an auto_map to code in the folder) never reaches transformers.
    check_model_type(fields.get("model_type"), str(config_file))
    quantization = fields.get("quantization_config")
    if quantization is not None:  # its tensors are not the weights: FP8 values beside their scales, packed integers
        method = quantization.get("quant_method") if isinstance(quantization, dict) else None
        raise ValueError(
            f"{config_file} has a quantization_config (quant_method {method!r}): the folder holds quantized weights "
            "(with their scales or packing), which the converter reads only as GGUF files. Convert the unquantized "
            "checkpoint it was made from, or a dequantized copy of it (saved without quantization_config)."
        )
    try:
        config = AutoConfig.from_pretrained(path, trust_remote_code=False)
    except Exception as error:  # transformers' validators raise StrictDataclass*, ValueError, TypeError, KeyError
        raise ValueError(f"Invalid {config_file}: {one_line(error)}") from error
    if config.model_type != fields.get("model_type") and config.model_type not in (*ALL_SOURCE_FAMILIES, DAR_SOURCE_TYPE):
        ministral = fields.get("model_type") == "mistral" and "layer_types" in fields  # transformers' own heuristic
        raise ValueError(
            f"Cannot convert {config_file}: transformers {transformers.__version__} reads its model_type "
            f"{fields.get('model_type')!r} as {config.model_type!r}"
            + (" (a 'mistral' config with layer_types: Ministral's per-layer attention types)" if ministral else "")
            + ", which DAR does not convert."
            + (" If every layer is 'full_attention', remove layer_types: it then converts as Mistral." if ministral else "")
        )
    check_model_builds(config, config_file)
    check_has_layers(config, f"Invalid {config_file}: num_hidden_layers")
    check_causal(config, f"{config_file} sets is_causal={json.dumps(fields.get('is_causal'))}")
    windows = cache_only_windows(config)  # warned about on their own: the generation cache reads them
    undefined = [name for name in undefined_config_fields(config) if name not in windows]
    if undefined:
        logger.warning(
            f"{config_file} has field(s) that transformers' {type(config).__name__} does not define: "
            f"{', '.join(undefined)}. Its model never reads them, so the conversion computes the same without them; "
            "the output's config.json does not carry them (add them to it by hand if a tool of yours reads them)."
        )
    entries = custom_code_entries(config)
    if entries:
        logger.warning(
            f"{config_file} maps the model to code in the source (auto_map: {'; '.join(entries)}), which the converter "
            f"never runs: the conversion reproduces, and is verified against, {reference_class(config.model_type)} for "
            f"model_type {config.model_type!r} with the same weights and config, not that code. If the code computes "
            "something else (a logit scale, another rope), the converted model does not; the model card says so."
        )
    return config


def check_has_layers(config: PreTrainedConfig, where: str) -> None:
    """Refuse a config without decoder layers (`where` names the file and field): transformers builds such a model,
    but DAR's block size, which counts 2 branches per layer, then has no value to take, and the refusal would blame
    `--block-size` for the source's config."""
    layers = getattr(config, "num_hidden_layers", None)
    if not isinstance(layers, int) or layers < 1:
        raise ValueError(f"{where} is {layers!r}; a model to convert needs 1 or more decoder layers.")


def check_model_builds(config: PreTrainedConfig, config_file: Path | str) -> None:
    """Refuse a config that transformers' own class for its model_type cannot build a model from, before any weight is
    read: an activation (`hidden_act`) or a rope type (`rope_parameters`, `rope_scaling`) that transformers does not
    know passes its config validation, then fails as a bare KeyError deep in the model's constructor. Those two are
    named with the values allowed; anything else the constructor raises names the file and the error. A rope_theta
    that is not positive and finite, or a negative rms_norm_eps, builds a model whose every forward holds NaN: named
    too, as are the head layouts no forward runs with (`check_heads_run`). A GGUF source's config, which transformers
    reads from the file's metadata, is checked the same way."""
    allowed_rope_types = ("default", *ROPE_INIT_FUNCTIONS)
    rope = getattr(config, "rope_parameters", None) or {}
    for parameters in (rope, *(value for value in rope.values() if isinstance(value, dict))):
        rope_type = parameters.get("rope_type", "default")
        if rope_type not in allowed_rope_types:
            raise ValueError(f"Invalid {config_file}: rope type {rope_type!r} (rope_parameters / rope_scaling) is not "
                             f"one transformers knows (allowed: {', '.join(allowed_rope_types)}).")
        theta = parameters.get("rope_theta")
        if theta is not None and not (isinstance(theta, (int, float)) and 0 < theta < math.inf):
            raise ValueError(f"Invalid {config_file}: rope_theta={theta!r} (rope_parameters) must be a positive finite "
                             "number: the rotary frequencies are inf or NaN otherwise.")
    epsilon = getattr(config, "rms_norm_eps", None)
    if isinstance(epsilon, (int, float)) and not 0 <= epsilon < math.inf:
        raise ValueError(f"Invalid {config_file}: rms_norm_eps={epsilon!r} must be a finite number >= 0: the norms "
                         "compute NaN where a mean square is below a negative eps.")
    activation = getattr(config, "hidden_act", None)
    if isinstance(activation, str) and activation not in ACT2FN:
        raise ValueError(f"Invalid {config_file}: hidden_act {activation!r} is not an activation transformers knows "
                         f"(allowed: {', '.join(sorted(ACT2FN))}).")
    try:
        with torch.device("meta"):  # a copy: from_config sets the attention and experts implementations on its config
            model = AutoModelForCausalLM.from_config(copy.deepcopy(config), trust_remote_code=False)
    except Exception as error:  # whatever the constructor trips over: a config the source's own class cannot build
        raise ValueError(f"Invalid {config_file}: {reference_class(config.model_type)} cannot be built from it "
                         f"({type(error).__name__}: {one_line(error)}).") from error
    check_heads_run(model, config, f"Invalid {config_file}")


def check_heads_run(model: PreTrainedModel, config: PreTrainedConfig, where: str) -> None:
    """Refuse the head layouts that transformers' validators accept and its model builds, yet fails on at every
    forward (a shape error deep in the verification, or a traceback from the caller's own model): key/value heads
    that do not divide the query heads (each is repeated for a group of them), and a rope whose rotary dimensions are
    not the head dimension (every family that converts rotates whole heads; transformers' default rope ignores
    `partial_rotary_factor`, its scaled ropes honour it). `model` is the source's model, or one built from its config
    on the meta device; `where` starts the message ("Invalid .../config.json", "The in-memory model's config")."""
    version = f"transformers {transformers.__version__}"
    heads, key_value_heads = config.num_attention_heads, getattr(config, "num_key_value_heads", None)
    if key_value_heads and heads % key_value_heads:
        raise ValueError(
            f"{where}: num_key_value_heads={key_value_heads} does not divide num_attention_heads={heads}: "
            f"{reference_class(config.model_type)}'s attention repeats each key/value head for a group of query heads, "
            f"so the source model fails on every forward in {version}, and there is nothing to reproduce."
        )
    rotary = getattr(getattr(model, "model", None), "rotary_emb", None)
    frequencies = getattr(rotary, "inv_freq", None)
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // heads
    if frequencies is None or 2 * frequencies.shape[-1] == head_dim:
        return
    rope = getattr(config, "rope_parameters", None) or {}
    raise ValueError(
        f"{where}: its rope (rope_type {rope.get('rope_type', 'default')!r}, partial_rotary_factor "
        f"{rope.get('partial_rotary_factor', getattr(config, 'partial_rotary_factor', None))}) gives "
        f"{2 * frequencies.shape[-1]} rotary dimensions per head, but {reference_class(config.model_type)}'s "
        f"attention rotates all head_dim={head_dim} of them, so the source model fails on every forward in {version}, "
        "and there is nothing to reproduce. If the key is stray, remove it; a model trained with a partial rotary "
        "belongs to a family that does not convert."
    )


def undefined_config_fields(config: PreTrainedConfig) -> list[str]:
    """The fields of a source's config that its transformers config class does not define (added by a tool or by
    hand) and that the converted config leaves out. A field DAR's config carries (`architecture_fields`) is not one of
    them, defined or not: Qwen2Config and Qwen3MoeConfig define no `head_dim`, yet their attention reads it through
    `getattr`, and the converted config keeps it for the same modules to read."""
    defined = set(type(config)().to_dict()) | set(architecture_fields()) | {"auto_map"}  # `custom_code_entries`
    defined |= set(rope_folded_fields(config))  # carried inside the rope parameters
    return sorted(name for name in config.to_dict() if name not in defined)


def custom_code_entries(config: PreTrainedConfig) -> tuple[str, ...]:
    """A folder config's `auto_map` ("AutoModelForCausalLM: module.Class", ...): the source's own code for its config
    or model, which the converter never runs (the model's `model_type` picks transformers' built-in classes). A dense
    DAR source's entries that name the package's own classes (`DARConfig.remote_code_auto_map`: the copy of its code
    the folder carries for loading without the package) are not listed: the converter runs the package itself."""
    auto_map = getattr(config, "auto_map", None)
    if not isinstance(auto_map, dict):
        return ()
    own = set(type(config).remote_code_auto_map.values()) if config.model_type == DAR_SOURCE_TYPE else set()
    return tuple(f"{name}: {target}" for name, target in auto_map.items() if target not in own)


def check_gguf_metadata(path: Path, config: PreTrainedConfig) -> None:
    """Refuse a GGUF file of a family that converts whose `{architecture}.*` metadata changes the model's function
    but is dropped by transformers' GGUF config reader (`GGUF_DROPPED_METADATA`): as the
    file's tensors that transformers skips are refused (`GGUFCheckpoint`), so are its settings, naming key and value.
    A setting that transformers' config holds under another name (`GGUF_CONFIG_FIELD_METADATA`) must equal it, and an
    MoE file's config must route as llama.cpp's graph for its architecture does (`GGUF_ARCHITECTURE_ROUTING`)."""
    if config.model_type not in ALL_SOURCE_FAMILIES:
        return  # refused by family, naming the supported ones
    import gguf  # present: transformers just read the file's metadata with it

    reader = gguf.GGUFReader(str(path))
    architecture = reader.fields["general.architecture"].contents()
    for name, computed in GGUF_ARCHITECTURE_ROUTING.get(config.model_type, {}).items():
        if getattr(config, name, None) != computed:
            raise ValueError(
                f"GGUF file {path}: llama.cpp's {architecture} model computes {name} = {computed!r} whatever the file "
                f"says, but transformers' GGUF reader builds the model with {name} = {getattr(config, name, None)!r}, "
                "so the model transformers reads routes tokens to its experts otherwise; nothing is converted. "
                f"Convert the model's Hugging Face folder instead (its config.json carries {name})."
            )
    if architecture == "llama" and f"{architecture}.attention.head_count_kv" not in reader.fields:
        raise ValueError(
            f"GGUF file {path} has no {architecture}.attention.head_count_kv: llama.cpp then gives the model as many "
            "key/value heads as heads, but transformers' GGUF reader leaves the query and key weights in llama.cpp's "
            "rotary layout, so the model transformers reads (and a conversion verified against it) is not this file's "
            "model; nothing is converted. Convert the model's Hugging Face folder instead."
        )
    carried = {key for key, field in GGUF_CONFIG_MAPPING.get(config.model_type, {}).items() if field is not None}
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
    check_gguf_head_size(path, reader, architecture, carried, config)
    check_gguf_experts(path, reader.fields, architecture)
    scaling_type = reader.fields.get(f"{architecture}.rope.scaling.type")
    unscaled = scaling_type is not None and scaling_type.contents() == "none"
    for key, field in reader.fields.items():
        setting = key.removeprefix(f"{architecture}.")
        if setting == key or setting in carried:
            continue
        if unscaled and setting in ("rope.scaling.factor", "rope.scale_linear"):
            continue
        value = field.contents()
        if setting in GGUF_CONFIG_FIELD_METADATA:
            name = GGUF_CONFIG_FIELD_METADATA[setting]
            if not hasattr(config, name):
                continue  # a family without the field: its tensors or shapes are checked against the config
            read = head_dim if name == "head_dim" else getattr(config, name)
            if value != read:
                raise ValueError(
                    f"GGUF file {path}: its metadata {key} = {value!r}, but transformers' GGUF reader drops it and "
                    f"builds the model with {name} = {read!r}, so the model transformers reads is not this file's "
                    "model (a partial rotary, or tensors that do not fit); nothing is converted. Convert the model's "
                    f"Hugging Face folder instead (its config.json carries {name})."
                )
            continue
        neutral = GGUF_DROPPED_METADATA.get(setting)
        if neutral is not None and value not in neutral:
            raise ValueError(
                f"GGUF file {path}: its metadata {key} = {value!r} changes what the model computes in llama.cpp, and "
                f"transformers' GGUF reader drops it (allowed: {' or '.join(map(repr, neutral))}), so neither "
                "transformers nor a conversion would compute what this file's model computes; nothing is converted. "
                "Convert the model's Hugging Face folder instead (its config.json carries the setting)."
            )


def check_gguf_head_size(path: Path, reader, architecture: str, carried: set[str], config: PreTrainedConfig) -> None:
    """Where transformers' GGUF reader takes `rope.dimension_count` for the head dimension (Llama, Mistral) and the
    file has no `attention.key_length` (compared with that head dimension in `check_gguf_metadata`), a rotary that
    does not span llama.cpp's head size, `embedding_length / head_count`, and builds query heads the file's tensors
    do not fit (a partial rotary: llama.cpp refuses such a llama file) is refused naming the key; it was a list of
    mismatched shapes that named no metadata. `reader`: the file's `gguf.GGUFReader`."""
    fields = reader.fields
    rotary, heads = (fields.get(f"{architecture}.{key}") for key in ("rope.dimension_count", "attention.head_count"))
    if ("rope.dimension_count" not in carried or rotary is None or heads is None or not heads.contents()
            or f"{architecture}.attention.key_length" in fields):
        return
    size = config.hidden_size // heads.contents()
    queries = next((tensor for tensor in reader.tensors if tensor.name == "blk.0.attn_q.weight"), None)
    rows = None if queries is None else int(queries.n_elements) // config.hidden_size
    # Heads as wide as the rotary that fit the tensors (a head size other than hidden / heads, as Mistral-Nemo's,
    # written without key_length) are the model transformers reads, which the conversion reproduces.
    if rotary.contents() != size and rows != rotary.contents() * heads.contents():
        raise ValueError(
            f"GGUF file {path}: its metadata {architecture}.rope.dimension_count = {rotary.contents()!r} is not its "
            f"head size {size!r} ({architecture}.embedding_length {config.hidden_size} / "
            f"{architecture}.attention.head_count {heads.contents()}; it has no {architecture}.attention.key_length): "
            + ("llama.cpp refuses such a llama file (invalid n_rot)" if architecture == "llama" else
               "llama.cpp rotates part of each head (a partial rotary)")
            + ", and transformers' GGUF reader takes the rotary dimension for the head size, building heads "
            f"{rotary.contents()!r} wide that the file's tensors do not fit; nothing is converted."
        )


def check_gguf_experts(path: Path, fields, architecture: str) -> None:
    """An MoE file's experts per token must be 1 to its expert count, as llama.cpp asserts when it loads the file;
    the refusal names both metadata keys (it named DARMoeConfig's field, as if the converter had chosen the value)."""
    count, used = fields.get(f"{architecture}.expert_count"), fields.get(f"{architecture}.expert_used_count")
    if count is None or used is None or not count.contents():
        return
    if not 1 <= used.contents() <= count.contents():
        raise ValueError(
            f"GGUF file {path}: its metadata {architecture}.expert_used_count = {used.contents()!r} is not between 1 "
            f"and {architecture}.expert_count = {count.contents()!r} (the experts each token is routed to, of the "
            "layer's experts): no model runs it, in llama.cpp or transformers; nothing is converted."
        )


def gguf_special_tokens_note(fields) -> str:
    """A GGUF file's special token ids (`tokenizer.ggml.*_token_id`) that are no index of its token list, said as
    " (its metadata KEY = ID: past the N tokens of tokenizer.ggml.tokens)", or "" if none: transformers' GGUF tokenizer
    reader fails on them with an IndexError that names neither."""
    tokens = fields.get("tokenizer.ggml.tokens")
    if tokens is None:
        return ""
    count = len(tokens.data)
    outside = [f"{key} = {field.contents()!r}" for key, field in fields.items()
               if key.startswith("tokenizer.ggml.") and key.endswith("_token_id")
               and isinstance(field.contents(), int) and not 0 <= field.contents() < count]
    return f" (its metadata {', '.join(outside)}: past the {count} tokens of tokenizer.ggml.tokens)" if outside else ""


# A GGUF file's license metadata (llama.cpp's converter copies the model card's) and the card field of each.
GGUF_LICENSE_FIELDS = {"general.license": "license", "general.license.name": "license_name",
                       "general.license.link": "license_link"}


# llama.cpp ends generation at the end-of-turn and end-of-message tokens as at the end-of-sequence token
# (`llama_vocab_is_eog`); transformers' GGUF reader keeps only the last, so a chat model read from such a file would
# decode past the end of its turn.
GGUF_END_OF_GENERATION_FIELDS = ("tokenizer.ggml.eot_token_id", "tokenizer.ggml.eom_token_id")


def with_gguf_end_tokens(generation_config: GenerationConfig, vocab_size: int, fields) -> GenerationConfig:
    """`generation_config` of a model read from a GGUF file (`fields` of its `gguf_reader`), with the file's
    end-of-turn and end-of-message tokens (`GGUF_END_OF_GENERATION_FIELDS`) added to its `eos_token_id` where they are
    other tokens of the vocabulary, so that `generate` stops where llama.cpp stops. Changed in place and returned."""
    eos = generation_config.eos_token_id
    ends = [] if eos is None else [eos] if isinstance(eos, int) else list(eos)
    added = False
    for key in GGUF_END_OF_GENERATION_FIELDS:
        if key in fields:
            token = int(fields[key].contents())
            if token not in ends and 0 <= token < vocab_size:
                ends.append(token)
                added = True
    if added:  # a file with an end-of-turn token and no end-of-sequence one stops at the former
        generation_config.eos_token_id = ends if len(ends) > 1 else ends[0]
    return generation_config


def gguf_reader(path: Path):
    """A GGUF file's reader (`gguf.GGUFReader`: its metadata parsed, its tensors memory-mapped); inside
    `gguf_parsed_once`, the one every reader of the file shares."""
    import gguf  # present: transformers read the file's metadata with it

    return gguf.GGUFReader(str(path))


class _SharedGGUFReaders:
    """The state of `gguf_parsed_once`: how many are open (threads may nest them), gguf's own reader class while
    they are, and the readers made so far, keyed by the file's real path and identity (inode, size, mtime), so that
    a file replaced meanwhile is parsed again."""

    lock = threading.Lock()
    open = 0
    original = None
    readers: dict[tuple, object] = {}

    @classmethod
    def reader(cls, path, mode="r"):
        original = cls.original
        if original is None:  # the swapped class, kept by a caller past the block (`from gguf import GGUFReader`)
            import gguf  # restored: gguf's own class, as if never swapped

            return gguf.GGUFReader(path, mode)
        if mode != "r":  # a writable map is the caller's own
            return original(path, mode)
        try:
            stat = os.stat(path)
        except OSError:  # gguf's own error, as without sharing
            return original(path, mode)
        key = (os.path.realpath(path), stat.st_ino, stat.st_size, stat.st_mtime_ns)
        with cls.lock:
            reader = cls.readers.get(key)
        if reader is None:
            reader = original(path, mode)
            with cls.lock:
                reader = cls.readers.setdefault(key, reader)
        return reader


@contextlib.contextmanager
def gguf_parsed_once():
    """Inside it, each GGUF file is parsed once: every `gguf.GGUFReader(path)` of an unchanged file, read-only,
    returns the first one made. A conversion reads a GGUF source's metadata seven times otherwise (its config, this
    package's checks, the tokenizer, the tensors' key map and their reader, each through a reader of its own, most of
    them transformers' loaders), each parse about 4 s for SmolLM2's file, whose 49k-token vocabulary dominates it.
    The readers only read the file (a read-only memory map and the parsed fields), so sharing one changes nothing
    they see. gguf's class is swapped for the duration (transformers' loaders import it as they run) and restored
    when the outermost one closes, in any thread."""
    try:
        import gguf
    except ImportError:  # no GGUF support installed: nothing to share
        yield
        return
    state = _SharedGGUFReaders

    def shared(_cls, *args, **keywords):  # `__new__` of a subclass, so that gguf.GGUFReader stays a class
        return state.reader(*args, **keywords)  # an instance of gguf's own class: its __init__ is not run again

    with state.lock:
        if state.open == 0:
            state.original = gguf.GGUFReader
            gguf.GGUFReader = type("GGUFReader", (state.original,), {"__new__": shared})
        state.open += 1
    try:
        yield
    finally:
        with state.lock:
            state.open -= 1
            if state.open == 0:
                gguf.GGUFReader, state.original = state.original, None
                state.readers.clear()


def gguf_tensor_types(reader) -> str:
    """How a GGUF file (its `gguf_reader`) stores its tensors, for the card: "Q4_1 x 210, F32 x 61, Q8_0 x 1 tensors,
    dequantised to float32" (the SmolLM2 file's; the converted weights hold transformers' dequantised values, which
    the card's weights dtype alone would not say)."""
    return f"{counted(tensor.tensor_type.name for tensor in reader.tensors)} tensors, dequantised to float32"


def counted(names) -> str:
    """"Q4_1 x 210, F32 x 61": each name with how often it occurs, most frequent first (ties in first-seen order)."""
    return ", ".join(f"{name} x {count}" for name, count in collections.Counter(names).most_common())


def gguf_license(fields) -> dict[str, str]:
    """The card's license fields from a GGUF file's `general.license*` metadata (`GGUF_LICENSE_FIELDS`; `fields` of
    its `gguf_reader`); empty without them."""
    return {card: str(fields[key].contents()) for key, card in GGUF_LICENSE_FIELDS.items() if key in fields}


def _load_tokenizer(folder: Path, gguf_file: str | None = None, gguf_fields=None):
    """The source's tokenizer, with transformers' own classes; from a GGUF file (`gguf_file` in `folder`, its
    `gguf_reader`'s `gguf_fields`), with the named chat templates transformers' GGUF reader drops."""
    if gguf_file is None and not any((folder / name).is_file() for name in TOKENIZER_FILES):
        raise FileNotFoundError(
            f"Source folder {folder} has no tokenizer (looked for {', '.join(TOKENIZER_FILES)}); the output repo needs "
            "one. Copy the tokenizer files into the folder, or convert an in-memory model with tokenizer=..."
        )
    try:
        tokenizer = AutoTokenizer.from_pretrained(folder, gguf_file=gguf_file, trust_remote_code=False)
    except Exception as error:  # tokenizer backends raise many types; name the files either way
        files = [gguf_file] if gguf_file else [name for name in (*TOKENIZER_FILES, "tokenizer_config.json")
                                               if (folder / name).is_file()]
        raise ValueError(
            f"Could not load the tokenizer of {folder} from {', '.join(files)} (with transformers' own tokenizer "
            f"classes: the converter never runs code from the source): {one_line(error)}"
            + (gguf_special_tokens_note(gguf_fields) if gguf_fields is not None else "")
        ) from error
    if gguf_file is not None:
        named = gguf_named_chat_templates(folder / gguf_file, gguf_fields)
        if named.get("default", tokenizer.chat_template) != tokenizer.chat_template:
            raise ValueError(  # transformers saves the template named "default" as the tokenizer's default one
                f"GGUF file {folder / gguf_file}: its chat template 'tokenizer.chat_template.default' differs from "
                f"{'its default one (tokenizer.chat_template)' if tokenizer.chat_template else 'its (absent) default one'}, "
                "and transformers keeps a tokenizer's templates by name, its default one named 'default': one of the "
                "two would be lost. Keep the template you need and remove the key (gguf-py's gguf_new_metadata.py "
                "--remove-metadata tokenizer.chat_template.default writes a new file); nothing is converted."
            )
        named.pop("default", None)  # the same template as the default one
        if named:  # transformers' GGUF reader keeps the default template only
            default = {"default": tokenizer.chat_template} if tokenizer.chat_template else {}
            tokenizer.chat_template = {**default, **named}
    return tokenizer


def gguf_named_chat_templates(path: Path, fields) -> dict[str, str]:
    """A GGUF file's named chat templates (`tokenizer.chat_template.<name>`, llama.cpp's converter writes a model
    card's "tool_use", "rag", ...), which transformers' GGUF tokenizer reader drops: {name: template}, from the
    `fields` of its `gguf_reader`."""
    prefix = "tokenizer.chat_template."
    named = {key.removeprefix(prefix): str(field.contents()) for key, field in fields.items() if key.startswith(prefix)}
    for name in named:  # each becomes additional_chat_templates/<name>.jinja in the output
        if not name or name in (".", "..") or any(character in name for character in "/\\\0"):
            raise ValueError(f"GGUF file {path}: its chat template {prefix + name!r} has a name that is no file name "
                             "(a path, or empty), so it cannot be written beside the tokenizer; nothing is converted.")
    return named


def _load_folder_model(folder: Path, dtype: torch.dtype) -> PreTrainedModel:
    weight_files = sorted(folder.glob("*.safetensors"))
    if not weight_files:
        raise FileNotFoundError(
            f"Source folder {folder} has no safetensors weights (model.safetensors or sharded "
            "model-0000x-of-0000y.safetensors with model.safetensors.index.json)."
        )
    try:
        model, info = AutoModelForCausalLM.from_pretrained(
            folder, dtype=dtype, output_loading_info=True, trust_remote_code=False
        )
    except Exception as error:  # safetensors, JSON and shape errors alike: the file set is unusable
        raise ValueError(f"Could not load the weights in {folder}: {error}") from error
    problems = {name: info[name] for name in ("missing_keys", "unexpected_keys", "mismatched_keys") if info.get(name)}
    if problems:
        raise ValueError(f"The weights in {folder} do not match its config.json: {problems}.")
    return model


def plain_config(config: PreTrainedConfig) -> PreTrainedConfig:
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
    folder, gguf_file = _gguf_folder_and_file(path)
    try:
        quantized = AutoModelForCausalLM.from_pretrained(
            folder, gguf_file=gguf_file, dtype=torch.float32, trust_remote_code=False
        )
    except Exception as error:
        raise ValueError(f"Could not load the GGUF weights of {path}: {error}") from error
    plain = AutoModelForCausalLM.from_config(plain_config(quantized.config), dtype=torch.float32)
    plain.load_state_dict(quantized.state_dict(), strict=True)
    plain.generation_config = copy.deepcopy(quantized.generation_config)
    return plain.to(dtype)


def copied_side_files(folder: Path, tokenizer_from_folder: bool, whole: bool = False) -> tuple[Path, ...]:
    """The files of `folder` that the output copies as they are, at the same place relative to it: `LICENSE_FILES`
    (any case; the files of a folder so named too, its links to folders not followed), and, when the tokenizer was
    read from this folder (not a `tokenizer=` given instead, whose files they are not), its files: the vocabulary
    files and other loaders' (`TOKENIZER_SIDE_FILES`), and with `whole` (`tokenizer_copied`) the rest of them
    (`TOKENIZER_COPIED_FILES`, `additional_chat_templates/` even as a link), else saved by transformers."""
    copied = set()
    whole = tokenizer_from_folder and whole
    for entry in folder.iterdir():
        templates = whole and entry.name == CHAT_TEMPLATES_FOLDER  # a link to a shared folder of them too
        if any(fnmatch.fnmatch(entry.name.lower(), pattern) for pattern in LICENSE_FILES) or templates:
            if entry.is_file():
                copied.add(entry)
            elif entry.is_dir() and (templates or not entry.is_symlink()):
                for root, _, names in os.walk(entry):  # does not follow links to folders below it
                    copied.update(path for path in (Path(root) / name for name in names) if path.is_file())
        elif entry.is_file() and (
                (whole and any(fnmatch.fnmatch(entry.name, pattern) for pattern in TOKENIZER_COPIED_FILES))
                or (tokenizer_from_folder and any(fnmatch.fnmatch(entry.name, pattern)
                                                  for pattern in TOKENIZER_SIDE_FILES))):
            copied.add(entry)
    for path in copied:  # one this user may not read: said now, naming it, not after the conversion's work
        try:
            os.close(os.open(path, os.O_RDONLY))
        except OSError as error:
            raise source_read_error(path, error) from error
    return tuple(sorted(copied))


def tokenizer_copied(folder: Path) -> bool:
    """Whether the output carries the folder's tokenizer as its files, byte for byte (`TOKENIZER_COPIED_FILES`):
    unless its tokenizer_config.json maps the tokenizer to code (`auto_map`), which the converter never copies, or it
    has no tokenizer.json (only vocab.json and merges.txt, or tokenizer.model), which tools that read tokenizer.json
    alone (the `tokenizers` library, TGI, transformers.js) need and transformers' save writes beside them; then
    transformers' own class, as the converter loaded it, is saved (`write_tokenizer`), the vocabulary files copied."""
    if not (folder / "tokenizer.json").is_file():
        return False
    config_file = folder / "tokenizer_config.json"
    if not config_file.is_file():
        return True
    try:
        fields = json.loads(config_file.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, json.JSONDecodeError):
        return False  # the tokenizer loaded without it, somehow: saved as transformers has it
    return isinstance(fields, dict) and not fields.get("auto_map")


def not_carried(folder: Path, side_files: tuple[Path, ...], read: set[str]) -> list[str]:
    """The entries of a source folder that the output does not carry, as names (a folder with "/"): not the
    weights and config files the conversion reads (`read`), its side files, hidden entries (.git, .cache) or the model
    card (whose license fields the output's card takes). Said on the log, so that a user who deletes the source knows
    what the output lacks (params.json, original/, a preprocessor config, ...)."""
    kept = {path.relative_to(folder).parts[0] for path in side_files}
    return sorted(entry.name + ("/" if entry.is_dir() else "") for entry in folder.iterdir()
                  if not entry.name.startswith(".") and entry.name not in kept | read
                  and entry.name.lower() != "readme.md")


def copy_in_dtype(model: PreTrainedModel, dtype: torch.dtype) -> PreTrainedModel:
    """A copy of `model` whose parameters are in `dtype`, its buffers (rotary `inv_freq`) kept as they are, as
    `from_pretrained(..., dtype=...)` keeps them float32: `model.to(dtype)` rounds them too (a path source loaded in
    bfloat16 and the same model given in memory computed 0.07 logits apart)."""
    copied = copy.deepcopy(model)
    buffers = dict(copied.named_buffers())
    copied.to(dtype)
    for name, buffer in buffers.items():
        module_name, _, buffer_name = name.rpartition(".")
        copied.get_submodule(module_name)._buffers[buffer_name] = buffer
    return copied


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
        # Verification needs eval mode in `dtype`; a model in another state is copied, never switched
        model = source if source.dtype == dtype and not source.training else copy_in_dtype(source, dtype)
        name = display_name(source.config.name_or_path or type(source).__name__)
        return Source(model.eval(), tokenizer, name, "in-memory model", config=source.config)
    path = Path(source)
    source_config = source_config or load_source_config(path)
    source_family(source_config)
    if path.is_file():
        folder, gguf_file = _gguf_folder_and_file(path)
        fields = gguf_reader(path).fields
        loaded_tokenizer = tokenizer or _load_tokenizer(Path(folder), gguf_file, fields)
        model = _load_gguf_model(path, dtype).eval()
        with_gguf_end_tokens(model.generation_config, model.config.vocab_size, fields)
        return Source(model, loaded_tokenizer, path.stem, gguf_location(path), config=model.config)
    loaded_tokenizer = tokenizer or (_load_tokenizer(path) if need_tokenizer else None)
    model = _load_folder_model(path, dtype).eval()
    name = folder_name(path)
    return Source(model, loaded_tokenizer, name, folder_location(path), config=model.config)



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
        # The state dict as the model holds it, a tied head included (it is the embedding's tensor): the plan drops a
        # tied head as for a folder, after `check_tied_output_head` has seen it.
        return Source(None, tokenizer, name, "in-memory model", source.config,
                      StateDictCheckpoint(source.state_dict(), "the in-memory model"),
                      copy.deepcopy(source.generation_config))
    path = Path(source)
    if path.is_file():
        folder, gguf_file = _gguf_folder_and_file(path)
        reader = gguf_reader(path)  # once, for the tokenizer's named templates and the card
        loaded_tokenizer = tokenizer or _load_tokenizer(Path(folder), gguf_file, reader.fields)
        config = plain_config(source_config)
        with torch.device("meta"):
            meta = AutoModelForCausalLM.from_config(config)
        try:
            if config.model_type in MOE_GGUF_ARCHITECTURES:
                placed_gguf_tensors(path, meta)  # refuses a tensor that the loader would skip
                tensors = load_gguf_checkpoint(str(path), return_tensors=True, model_to_load=meta)["tensors"]
                checkpoint = StateDictCheckpoint(tensors, f"GGUF file {path}")
                checkpoint.config_name = "its GGUF metadata"
            else:
                checkpoint = GGUFCheckpoint(path, config, meta)
        except Exception as error:
            raise ValueError(f"Could not load the GGUF weights of {path}: {error}") from error
        generation_config = with_gguf_end_tokens(GenerationConfig.from_model_config(config), config.vocab_size,
                                                 reader.fields)
        return Source(None, loaded_tokenizer, path.stem, gguf_location(path), config, checkpoint,
                      generation_config, license=gguf_license(reader.fields), stored_as=gguf_tensor_types(reader))
    loaded_tokenizer = tokenizer or _load_tokenizer(path)
    checkpoint = SafetensorsCheckpoint(path)
    if any(not name.startswith(("model.", "lm_head.")) for name in checkpoint.infos()):  # a base model's keys?
        with torch.device("meta"):
            meta = AutoModelForCausalLM.from_config(plain_config(source_config))
        if checkpoint.with_base_model_prefix(meta.base_model_prefix, meta.state_dict().keys()):
            logger.info(f"{path} holds a base model's weights ({source_config.architectures or 'no architectures'}): "
                        f"read with the {meta.base_model_prefix}. prefix, as transformers loads them into the causal "
                        "LM.")
    generation_config = folder_generation_config(path)
    name = folder_name(path)
    copied = tokenizer is None and tokenizer_copied(path)  # decided once, as the side files are listed
    side_files = copied_side_files(path, tokenizer_from_folder=tokenizer is None, whole=copied)
    read = {"config.json", "generation_config.json", INDEX_NAME, *(file.name for file in path.glob("*.safetensors"))}
    if tokenizer is None and not copied:  # written anew by transformers' save_pretrained
        read |= {entry.name for entry in path.iterdir() if entry.name == CHAT_TEMPLATES_FOLDER
                 or any(fnmatch.fnmatch(entry.name, pattern) for pattern in TOKENIZER_COPIED_FILES)}
    if source_config.model_type == DAR_SOURCE_TYPE:  # its copy of the package's code: the output gets this version's
        package = Path(__file__).resolve().parent.parent
        read |= {code.name for code in path.glob("*.py") if (package / code.name).is_file()}
    return Source(None, loaded_tokenizer, name, folder_location(path), source_config, checkpoint,
                  generation_config, path, side_files, copied, tuple(not_carried(path, side_files, read)),
                  custom_code_entries(source_config), stored_as=widened_tensor_types(checkpoint))


def folder_generation_config(path: Path) -> GenerationConfig:
    """The generation config `from_pretrained` gives a model of the folder: its generation_config.json, or without
    one, as transformers builds it then, from config.json's own generation fields (`repetition_penalty`,
    `no_repeat_ngram_size`, `max_length`, ... in a folder saved before generation_config.json existed), which the
    model config drops as it is read: built from the config object, they were lost from the output, whose
    `generate` then gave other tokens, and the greedy check, which used the same config on both sides, saw nothing."""
    file = path / ("generation_config.json" if (path / "generation_config.json").is_file() else "config.json")
    try:
        if file.name == "generation_config.json":
            return GenerationConfig.from_pretrained(path)
        return GenerationConfig.from_pretrained(path, config_file_name="config.json", _from_model_config=True)
    except Exception as error:  # a malformed file, or values GenerationConfig refuses: name it on one line
        raise ValueError(f"Invalid {file} (its generation settings): {one_line(error)}") from error


# The dtypes a model computes in, and so the dtypes "auto" keeps a source's tensors in. A float8 tensor (no scales
# read: a checkpoint of plain float8 values) is widened to bfloat16, which holds every float8 value exactly.
MODEL_DTYPES = (torch.float16, torch.bfloat16, torch.float32, torch.float64)


def model_dtype_of(dtype: torch.dtype) -> torch.dtype:
    """`dtype` where a model computes in it (`MODEL_DTYPES`), else bfloat16 (float8: exactly)."""
    return dtype if dtype in MODEL_DTYPES else torch.bfloat16


def widened_tensor_types(checkpoint: Checkpoint) -> str:
    """How a checkpoint with tensors no model computes in (float8) stores its floating tensors, for the card:
    "float8_e4m3fn x 12, bfloat16 x 5 tensors, float8 widened exactly" (its weights dtype row alone says bfloat16, the
    dtype the output stores them in at twice the bytes); empty where every tensor is in a model dtype."""
    dtypes = [info.dtype for info in checkpoint.infos().values() if info.dtype.is_floating_point]
    if all(dtype in MODEL_DTYPES for dtype in dtypes):
        return ""
    return f"{counted(str(dtype).removeprefix('torch.') for dtype in dtypes)} tensors, float8 widened exactly"


def source_storage_dtype(checkpoint: Checkpoint) -> torch.dtype:
    """The source's own dtype ("auto"): the floating dtype that holds most of its bytes (a float8 tensor's counting as
    bfloat16, `model_dtype_of`)."""
    totals: dict[torch.dtype, int] = {}
    for info in checkpoint.infos().values():
        if info.dtype.is_floating_point:
            dtype = model_dtype_of(info.dtype)
            totals[dtype] = totals.get(dtype, 0) + info.nbytes
    return max(totals, key=totals.get) if totals else torch.float32


def warn_if_declared_dtype_differs(config: PreTrainedConfig, checkpoint: Checkpoint, storage_dtype: torch.dtype) -> None:
    """Warn when a folder's config.json declares a dtype other than the one all its floating weights are stored in
    (`storage_dtype`, the output's with `--dtype auto`): from_pretrained loads the source in the declared dtype and the
    output in the stored one (lossless, but twice the memory for float32 over bf16). A mixed-precision source (bf16
    matrices, float32 norms) loads in the declared dtype too, and the output in its config's, which then rounds the
    tensors kept wider (its norms: the logits move): warned too, with --dtype suggested only where the declared dtype
    stores every tensor exactly."""
    declared = getattr(config, "dtype", None)
    if not isinstance(checkpoint, SafetensorsCheckpoint) or not isinstance(declared, torch.dtype):
        return
    stored = {info.dtype for name, info in checkpoint.infos().items()
              if info.dtype.is_floating_point and not is_dar_parameter(name)}
    if declared == storage_dtype or storage_dtype not in stored:
        return
    short, storage = str(declared).removeprefix("torch."), str(storage_dtype).removeprefix("torch.")
    if stored == {storage_dtype}:
        logger.warning(
            f"The source's config.json says dtype {short}, but its weights are stored in {storage}: the output keeps "
            f"the stored values exactly and says so in its config, so from_pretrained loads it in that dtype by "
            f"default, where the source loads in {short}. Pass --dtype {short} to store it as the source loads."
        )
        return
    others = " and ".join(sorted(str(dtype).removeprefix("torch.") for dtype in stored - {storage_dtype}))
    # Which side's default load rounds what: the source's in the declared dtype, the output's in the stored one (a
    # wider dtype holds every value of a narrower one, so either may round nothing).
    source_rounds, output_rounds = rounded_tensors(checkpoint, declared), rounded_tensors(checkpoint, storage_dtype)
    source_load = f"so from_pretrained loads it in {short}" + (f", rounding its {tensors_phrase(source_rounds)}"
                                                               if source_rounds else "")
    output_load = (f"rounding those {others} tensors" if output_rounds else
                   f"which holds every stored value (the source's own load is the one that rounds)")
    suggestion = f" Pass --dtype {short} to store it as the source loads." if not source_rounds else ""
    logger.warning(
        f"The source's config.json says dtype {short}, {source_load}; its weights are stored in {storage} with some in "
        f"{others}, which the output keeps exactly, but its config says {storage}, so from_pretrained loads the output "
        f"in {storage} by default, {output_load}: by default the two load as different functions.{suggestion}"
    )


def tensors_phrase(tensors: list[tuple[str, torch.dtype]], kind: str = "",
                   checkpoint: Checkpoint | None = None) -> str:
    """"2 tensor(s) stored in float32 (model.embed_tokens.weight, lm_head.weight)" of `rounded_tensors` ("2 source
    tensor(s) ..." with `kind` "source"). With the `checkpoint`, a quantised tensor is said as stored: "211 source
    tensor(s) stored in float32 or as Q4_1 and Q6_K, dequantised to float32 (...)" (`Checkpoint.stored_as`)."""
    stored = {name: str(dtype).removeprefix("torch.") for name, dtype in tensors}
    quantised = {}
    if checkpoint is not None:
        for name, _ in tensors:
            stored_as = checkpoint.stored_as(name)
            if stored_as != stored[name]:
                quantised[stored_as] = stored.pop(name)
    said = [f"in {' and '.join(sorted(set(stored.values())))}"] if stored else []
    if quantised:
        said.append(f"as {' and '.join(sorted(quantised))}, dequantised to "
                    f"{' and '.join(sorted(set(quantised.values())))}")
    names = ", ".join(name for name, _ in tensors[:2]) + (", ..." if len(tensors) > 2 else "")
    return f"{len(tensors)} {kind + ' ' if kind else ''}tensor(s) stored {' or '.join(said)} ({names})"


def rounded_tensors(checkpoint: Checkpoint, storage_dtype: torch.dtype) -> list[tuple[str, torch.dtype]]:
    """(name, dtype) of the source's floating tensors that a conversion to `storage_dtype` rounds (a mixed-precision
    source under "auto": bf16 matrices, float32 norms); a DAR parameter is stored float32 (float64 in a float64
    model) whatever `storage_dtype`, and loads so (`_keep_in_fp32_modules_strict`; a dense DAR source's DAR-MoE
    upcycle keeps them: `is_dar_parameter`). A wider floating dtype holds a narrower one's
    every value (bf16 or fp16 in float32, float32 in float64); bf16 and fp16 round each other."""
    rounded = []
    for name, info in checkpoint.infos().items():
        dtype = storage_dtype
        if is_dar_parameter(name):
            dtype = torch.float64 if storage_dtype == torch.float64 else torch.float32
        stored = checkpoint.stored_dtype(name)  # a GGUF file's F16 tensor: float16, though read as float32
        if stored.is_floating_point and stored != dtype and not dtype.itemsize > stored.itemsize:
            rounded.append((name, stored))
    return rounded


def exact_storage_dtype(checkpoint: Checkpoint) -> torch.dtype:
    """The narrowest dtype that stores every floating tensor of the source exactly: its one floating dtype, else
    float32 (bf16 with fp16 or float32), float64 if it has any."""
    dtypes = {checkpoint.stored_dtype(name) for name, info in checkpoint.infos().items()
              if info.dtype.is_floating_point and not is_dar_parameter(name)}  # those stay float32 in any dtype
    if len(dtypes) == 1:
        return dtypes.pop()
    return torch.float64 if torch.float64 in dtypes else torch.float32


__all__ = ["Source", "check_gguf_metadata", "check_heads_run", "copy_in_dtype", "custom_code_entries",
           "display_name", "exact_storage_dtype", "gguf_parsed_once", "load_source", "load_source_config",
           "open_source", "rounded_tensors", "source_model_type", "source_storage_dtype", "tensors_phrase"]
