# SPDX-License-Identifier: Apache-2.0
# Copyright 2026 The dar-transformers authors.
"""The plan of a conversion: every target tensor from the source's names and shapes (nothing read), checked against
the target model built on the meta device, plus the new parameters with the values the model's own `_init_weights`
gives them. `upcycle_model` runs the same plan in memory.
"""

import contextlib
import copy
import dataclasses
import os
import zlib
from collections.abc import Iterator, Mapping, Sequence

import torch
from torch import nn
from transformers import PreTrainedConfig, PreTrainedModel
from transformers.utils import logging

from .checkpoints import Checkpoint, StateDictCheckpoint, require_finite, require_finite_cast
from ..training import is_dar_parameter
from .families import DAR_SOURCE_TYPE, source_family, warn_not_carried
from .keymaps import DAR_NEW_PARAMETERS, TensorInfo, TensorPlan, check_keys, is_ignored_source_key
from .options import resolve_dtype
from .sources import check_has_layers, check_heads_run, copy_in_dtype, model_dtype_of
from .targets import TargetKind, target_kind

FINITE_CHECK_BYTES = 64 * 2**20  # rows of a source tensor checked for NaN/inf per read
HEAD, EMBEDDING = "lm_head.weight", "model.embed_tokens.weight"


def meta_model(model_class: type[PreTrainedModel], config: PreTrainedConfig) -> PreTrainedModel:
    """The model of `config` on the meta device (no memory; an 8B model builds in well under a second), in eval mode
    as `from_pretrained` returns one: the layer-streamed verification runs its layers, and in training mode a source's
    dropout or router jitter (Mixtral's) made a valid conversion fail."""
    build = model_class._from_config if issubclass(model_class, PreTrainedModel) else model_class.from_config
    with torch.device("meta"):
        return build(config, attn_implementation="sdpa").eval()


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
    config_name: str = "its config.json",
    keep_source_dtypes: bool = False,
    source_model_type: str | None = None,
) -> tuple[dict[str, TensorPlan], list[str]]:
    """Every tensor of the target checkpoint: the shared ones planned from the source's (cast to `dtype`, or with
    `keep_source_dtypes` ("auto") each in the floating dtype the source stores it in: a mixed-precision source's
    float32 norms beside bf16 matrices stay float32; float8 is widened to bfloat16, exactly), the new ones with their
    `_init_weights` values (DAR's float32, float64 in a float64 model; a new router in `dtype`, as from_pretrained
    loads it). Returns (plans, new names).

    Raises, naming `description` and `config_name` (what its config was read from), when a source tensor is in no
    planned tensor (other than an ignored key, or a tied head: `check_tied_output_head` compared it with the
    embedding), when a target parameter is neither planned nor new (a dense DAR source, `source_model_type` "dar",
    supplies every DAR parameter: none of them is new), when a planned tensor has no place in the target, or when a
    shape differs from the target config's."""
    try:
        shared = target.plan_tensors(source_infos, config)
    except ValueError as error:
        raise ValueError(f"{description}: {error}") from error
    expected = meta_model(target.model_class, config).state_dict()
    if config.tie_word_embeddings and HEAD in source_infos and EMBEDDING not in source_infos:
        raise ValueError(
            f"{description} stores its tied embedding as {HEAD} only (tie_word_embeddings is true in {config_name}), "
            f"where the converter reads it as {EMBEDDING}, as save_pretrained writes a tied model. Load the source "
            "with transformers and save it again (save_pretrained), then convert that folder."
        )
    if config.tie_word_embeddings:
        expected.pop(HEAD, None)
        shared.pop(HEAD, None)  # tied: as `save_pretrained`, the checkpoint holds the embedding only
    used = {part for plan in shared.values() for part in plan.parts}
    unused = [name for name in source_infos if name not in used and not is_ignored_source_key(name)
              and not (name == HEAD and config.tie_word_embeddings)]
    if unused:
        raise ValueError(f"{description}: {len(unused)} tensor(s) that no converted tensor is made from: {unused[:8]}. "
                         "Every source tensor converts (only old checkpoints' rotary inv_freq and a tied "
                         f"{HEAD} equal to the embedding are left out); converting without them would drop them.")
    missing = [name for name in expected if name not in shared]
    unexpected = [name for name in shared if name not in expected]
    new_parameters = target.new_parameters
    if source_model_type == DAR_SOURCE_TYPE:  # its DAR parameters (trained, perhaps) are the model's, never new
        new_parameters = tuple(pattern for pattern in new_parameters if pattern not in DAR_NEW_PARAMETERS)
    try:
        check_keys(missing, unexpected, new_parameters)
    except ValueError as error:
        dar_keys = source_model_type == DAR_SOURCE_TYPE and any(
            is_dar_parameter(name) for name in (*missing, *unexpected))
        hint = (" A dense DAR checkpoint holds the DAR parameters its dar_block_size, dar_num_streams, dar_routing and "
                "dar_include_partial shape: a config.json edited after the weights were saved no longer matches them; "
                "convert the folder as it was saved." if dar_keys else "")
        raise ValueError(f"The weights in {description} do not match {config_name}: {error}{hint}") from error
    mismatched = {name: (plan.shape, tuple(expected[name].shape)) for name, plan in shared.items()
                  if plan.shape != tuple(expected[name].shape)}
    if mismatched:
        raise ValueError(f"The weights in {description} do not match {config_name}: shapes (found, expected) "
                         f"{dict(list(mismatched.items())[:8])}.")
    new_dtype = torch.float64 if dtype == torch.float64 else torch.float32  # DESIGN.md section 4: DAR stays fp32
    if keep_source_dtypes:  # "auto": each floating tensor as the source stores it (float8 widened, exactly)
        plans = {name: dataclasses.replace(plan, dtype=model_dtype_of(plan.dtype)) if plan.dtype.is_floating_point
                 else plan for name, plan in shared.items()}
    else:
        plans = {name: dataclasses.replace(plan, dtype=dtype) for name, plan in shared.items()}
    # DAR's parameters taken from a dense DAR source (its DAR-MoE upcycle) stay float32 whatever the storage dtype,
    # and under "auto" float64 where the source stores them so (the model loads them float32; "auto" rounds nothing).
    for name, plan in plans.items():
        if stays_float32(target, name) and plan.dtype.is_floating_point:
            kept_wider = keep_source_dtypes and plan.dtype == torch.float64
            plans[name] = dataclasses.replace(plan, dtype=plan.dtype if kept_wider else new_dtype)
    # Other new parameters (the routers of sparse upcycling) in the checkpoint's dtype, as from_pretrained loads them.
    for name, value in new_parameter_values(target.model_class, config, missing).items():
        plans[name] = TensorPlan(tuple(value.shape), new_dtype if stays_float32(target, name) else dtype, value=value)
    ordered = {name: plans[name] for name in expected if name in plans}  # the model's own parameter order
    return ordered, sorted(missing)


def stays_float32(target: TargetKind, name: str) -> bool:
    """Whether the target parameter `name` lies in a module its model keeps float32 (`_keep_in_fp32_modules_strict`:
    DAR's residual modules, DESIGN.md section 4), whatever the model's dtype."""
    kept_float32 = getattr(target.model_class, "_keep_in_fp32_modules_strict", None) or ()
    return not set(kept_float32).isdisjoint(name.split("."))


def kept_source_dtypes(plans: Mapping[str, TensorPlan], target: TargetKind,
                       dtype: torch.dtype) -> dict[torch.dtype, list[str]]:
    """The tensors planned from the source in a floating dtype other than the checkpoint's `dtype`, by dtype (what
    `keep_source_dtypes` kept of a mixed-precision source; DAR's parameters, new or a DAR source's, float32 by design,
    are not counted)."""
    kept: dict[torch.dtype, list[str]] = {}
    for name, plan in plans.items():
        if not stays_float32(target, name) and plan.dtype.is_floating_point and plan.dtype != dtype:
            kept.setdefault(plan.dtype, []).append(name)
    return kept


def row_chunks(info: TensorInfo) -> Iterator[tuple[int, slice | None]]:
    """(first row, rows) of a tensor in chunks of about `FINITE_CHECK_BYTES`; one (0, None) for a 0-d tensor."""
    if not info.shape:
        yield 0, None
        return
    rows = info.shape[0]
    step = max(1, FINITE_CHECK_BYTES // max(1, info.nbytes // max(rows, 1)))
    for start in range(0, rows, step):
        yield start, slice(start, min(start + step, rows))


def check_finite(checkpoint: Checkpoint, description: str = "the source") -> None:
    """Refuse a source with a NaN or infinite weight, naming the tensor. Each floating tensor is read in row chunks
    of about `FINITE_CHECK_BYTES`, so the check never holds more than one chunk (or one dequantised GGUF tensor)."""
    for name, info in checkpoint.infos().items():
        if not info.dtype.is_floating_point:
            continue
        for start, rows in row_chunks(info):
            require_finite(checkpoint.read(name, rows), name, description, start if rows is not None else None)


def check_tied_output_head(checkpoint: Checkpoint, config: PreTrainedConfig, description: str = "the source") -> None:
    """Refuse a source whose config ties the output head to the input embedding (`tie_word_embeddings`) while its
    checkpoint holds an `lm_head.weight` that differs from the embedding: the conversion plans a tied head (the
    embedding) and would drop that one, which transformers keeps (it loads such a folder untied, with a warning).
    An equal head is the tied one written out, and is dropped as before. Compared in row chunks of about
    `FINITE_CHECK_BYTES` each, as `check_finite` reads."""
    infos = checkpoint.infos()
    if not getattr(config, "tie_word_embeddings", False) or HEAD not in infos or EMBEDDING not in infos:
        return
    head, embedding = infos[HEAD], infos[EMBEDDING]
    in_memory = description == "the in-memory model"
    config_name, keeps = (("its config", "the model computes with that head") if in_memory
                          else ("config.json", "transformers loads this source untied, keeping it"))
    fix = ('set "tie_word_embeddings": false on its config (model.config.tie_word_embeddings = False) to convert both '
           "as they are, or tie them (model.tie_weights()) if the embedding is the head you mean" if in_memory
           else f'set "tie_word_embeddings": false in its config.json to convert both as they are, or remove {HEAD} '
           "from the checkpoint if the embedding is the head you mean")
    if head.shape != embedding.shape:
        raise ValueError(f"{description}: {config_name} ties {HEAD} to {EMBEDDING}, but their shapes differ "
                         f"({head.shape} and {embedding.shape}): {fix}.")
    for start, rows in row_chunks(head):
        head_rows = checkpoint.read(HEAD, rows).double()
        embedding_rows = checkpoint.read(EMBEDDING, rows).double()
        if not torch.allclose(head_rows, embedding_rows, rtol=0, atol=0, equal_nan=True):  # NaN: check_finite's
            difference = (head_rows - embedding_rows).abs().max().item()
            last = start + len(head_rows) - 1 if rows is not None else 0
            raise ValueError(
                f"{description}: {config_name} says tie_word_embeddings=true, but its {HEAD} differs from "
                f"{EMBEDDING} (max |difference| {difference:.3g} in rows {start}..{last}). Converting would drop "
                f"that trained head (a tied model's head is the embedding), and {keeps}: {fix}."
            )


def materialise(plan: TensorPlan, checkpoint: Checkpoint, rounding: dict[str, bool] | None = None) -> torch.Tensor:
    """The planned tensor in memory (its storage dtype). `rounding`: the source tensors that the cast to the storage
    dtype may round (its keys), each set True when the cast changed one of its values (`note_rounding`)."""
    if plan.value is not None:
        return plan.value.to(plan.dtype)
    if plan.transform is not None:  # the source parts' own values, not the transform's (Drop-Upcycling's noise)
        parts = [checkpoint.read(part) for part in plan.parts]
        for name, part in zip(plan.parts, parts):
            if _may_round(rounding, name):  # else no cast of the part is needed at all
                note_rounding(part, plan.dtype, name, rounding)
        return plan.transform(parts).to(plan.dtype).reshape(plan.shape)
    if len(plan.parts) == 1:
        return note_rounding(checkpoint.read(plan.parts[0]), plan.dtype, plan.parts[0], rounding).reshape(plan.shape)
    return torch.cat([note_rounding(checkpoint.read(part), plan.dtype, part, rounding).reshape(-1)
                      for part in plan.parts]).reshape(plan.shape)


def note_rounding(value: torch.Tensor, dtype: torch.dtype, name: str, rounding: dict[str, bool] | None):
    """`value` (of the source tensor `name`, or rows of it) cast to `dtype`; when `name` is a tensor the cast may round
    (a key of `rounding`, from the source's stored dtypes: a widening cast never rounds) and none of its values has
    changed yet, compare: a float32 tensor whose values are all bfloat16 values goes to bfloat16 unchanged."""
    cast = value.to(dtype)
    if _may_round(rounding, name) and not torch.equal(cast.to(value.dtype), value):
        rounding[name] = True
    return cast


def _may_round(rounding: dict[str, bool] | None, name: str) -> bool:
    """Whether `name` is a source tensor the cast may round (a key of `rounding`) not yet seen rounded."""
    return rounding is not None and rounding.get(name) is False


def in_memory_source(source):
    """`source` as the converter reads it: a path as it is; a model compiled by `torch.compile` as the model it
    compiles; an in-memory model whose weights are all here. Refused, saying what to do: a PEFT model or one with
    adapters loaded (its adapter would be lost or its keys refused: merge it first), weights on the meta device
    (offloaded by accelerate, or a model built without weights), any other object."""
    if isinstance(source, str) and not source.strip():  # Path("") is the working folder, which was converted
        raise ValueError("The source is an empty path (an unset shell variable?); name the model folder or .gguf "
                         "file to convert.")
    if isinstance(source, (str, os.PathLike)):
        return source
    compiled = getattr(source, "_orig_mod", None)  # torch.compile's OptimizedModule
    if isinstance(source, torch.nn.Module) and isinstance(compiled, PreTrainedModel):
        source = compiled
    if hasattr(source, "peft_config") and (not isinstance(source, PreTrainedModel)
                                           or getattr(source, "_hf_peft_config_loaded", False)):
        raise ValueError(
            f"The source is a model with PEFT adapters ({type(source).__name__}): converting it would drop them or "
            "fail on their tensors. Merge them first (merged = model.merge_and_unload(), or "
            "model.base_model.merge_and_unload() for transformers' own adapter integration) and convert the merged "
            "model."
        )
    if not isinstance(source, PreTrainedModel):
        raise TypeError(f"The source must be a transformers PreTrainedModel, an HF folder or a .gguf file; got "
                        f"{type(source).__name__}.")
    if not source.can_generate():  # a base model or a task head: its keys have no causal-LM place, and no
        # generation config for the output
        raise TypeError(
            f"The in-memory model is a {type(source).__name__}, which has no language-model head: the converter "
            "converts causal language models (LlamaForCausalLM, Qwen2ForCausalLM, ...). Load the checkpoint with "
            "AutoModelForCausalLM, or convert its folder."
        )
    on_meta = [name for name, tensor in source.state_dict().items() if tensor.is_meta]
    if on_meta:
        raise ValueError(
            f"The in-memory model has {len(on_meta)} weight(s) on the meta device ({', '.join(on_meta[:2])}"
            f"{', ...' if len(on_meta) > 2 else ''}): offloaded by accelerate (device_map with CPU or disk offload), "
            "or a model built without weights. Convert its folder (the converter streams it), or load it without "
            "offloading."
        )
    return source


def upcycle_model(
    source_model: PreTrainedModel, kind: str = "dar", dtype: torch.dtype | str | None = None, **fields
) -> PreTrainedModel:
    """Source model -> target model in memory, through the same plan as a streamed conversion (key map, new
    parameters from `_init_weights`, nothing else missing), loaded as `from_pretrained` loads a checkpoint: DAR
    parameters float32 in a half-precision model, buffers (rotary `inv_freq`) as the class builds them. `dtype`
    None ("auto"): the model's dtype, each source tensor kept in the dtype the source holds it in (a mixed-precision
    model's float32 norms beside bf16 matrices stay float32, as a written conversion keeps them)."""
    source_model = in_memory_source(source_model)
    if not isinstance(source_model, PreTrainedModel):  # a path: `in_memory_source` passes it on for `upcycle`
        raise TypeError(f"This converts an in-memory model; got the path {os.fspath(source_model)!r}. Convert a folder "
                        "or .gguf file with upcycle(path, output) / upcycle_to_dar_moe(path, output, ...), or "
                        "convert(path) for the model in memory.")
    target = target_kind(kind)
    dtype = resolve_dtype(dtype)  # a name ("bfloat16", "auto") or a torch dtype
    keep_source_dtypes = dtype is None
    dtype = dtype or source_model.dtype
    check_has_layers(source_model.config, "The in-memory model's config.num_hidden_layers")
    check_heads_run(source_model, source_model.config, "The in-memory model's config")
    warn_not_carried(source_model.config)
    config = target.build_config(source_model.config, source_family(source_model.config), dtype, fields)
    checkpoint = StateDictCheckpoint(source_model.state_dict())
    check_tied_output_head(checkpoint, source_model.config, "the in-memory model")
    plans, _ = plan_conversion(target, config, checkpoint.infos(), dtype, "the in-memory model", "its config",
                               keep_source_dtypes, source_model.config.model_type)
    # Cloned: the target never shares storage with the source (training one must not change the other).
    state = {name: materialise(plan, checkpoint).clone() for name, plan in plans.items()}
    for name, tensor in state.items():
        require_finite_cast(tensor, name, "dtype=...")
    with logging_level_error():
        model = target.model_class.from_pretrained(None, config=config, state_dict=state, dtype=dtype)
    for names in kept_source_dtypes(plans, target, dtype).values():  # from_pretrained cast them to `dtype`
        for name in names:
            model.get_parameter(name).data = state[name]
    # The source's name, as the source model has it (a Hub id, a folder, or "" for a model built from a config): a
    # Trainer's or PEFT's card names it as the base model (from_pretrained(None, ...) left the string "None")
    model.name_or_path = model.config.name_or_path = source_model.config.name_or_path
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


def needs_float64_experts(model: PreTrainedModel, dtype: torch.dtype) -> bool:
    """A model of MoE experts to run in float64, which transformers' grouped_mm experts kernel does not take."""
    return dtype == torch.float64 and any(type(module).__name__.endswith("Experts") for module in model.modules())


def set_experts_for(model: PreTrainedModel, dtype: torch.dtype) -> None:
    """Experts on a kernel that takes `dtype`: batched_mm, grouped_mm's float64-capable peer, for float64."""
    if needs_float64_experts(model, dtype):
        model.set_experts_implementation("batched_mm")


def cast_model(model: PreTrainedModel, dtype: torch.dtype) -> PreTrainedModel:
    """A copy of `model` whose parameters compute in `dtype` (the verification dtype), its experts on a kernel that
    takes it (`set_experts_for`); buffers are kept as they are, as `from_pretrained` keeps rotary `inv_freq` in
    float32. `model` itself where it already computes so in eval mode, unless a forward changes it: a dynamic rope
    keeps the longest length it has run (`max_seq_len_cached`), so the check's prompts would leave the caller's model
    computing otherwise than before (5.7 logits at 300 tokens past a 256-token `max_position_embeddings`)."""
    experts = needs_float64_experts(model, dtype)
    stateful = any("dynamic" in str(getattr(module, "rope_type", "")) for module in model.modules())
    if (all(parameter.dtype == dtype for parameter in model.parameters()) and not model.training and not experts
            and not stateful):
        return model
    copied = copy_in_dtype(model, dtype)
    set_experts_for(copied, dtype)
    return copied.eval()



__all__ = ["cast_model", "check_finite", "check_tied_output_head", "in_memory_source", "kept_source_dtypes",
           "logging_level_error", "materialise", "meta_model", "new_parameter_values", "plan_conversion",
           "set_experts_for", "upcycle_model"]
