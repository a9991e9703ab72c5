# SPDX-License-Identifier: Apache-2.0
# Copyright 2026 The dar-transformers authors.
"""The public entry points (`dar convert` calls `upcycle` / `upcycle_to_dar_moe`): each runs the pipeline once,
downwards: read the source's config and check its family (`sources`, `families`), build the target config
(`targets`), open the source's tensors, plan every target tensor (`plan`), write the folder in a staging folder
(`write`), verify what was written (`verify`), add the card (`card`) and move the folder into place (`output`).
"""

import contextlib
import contextvars
import dataclasses
import math
import os
from collections.abc import Mapping
from pathlib import Path

import torch
from huggingface_hub.utils import validate_repo_id
from transformers import AutoModelForCausalLM, PreTrainedConfig, PreTrainedModel
from transformers.utils import logging

from ..modeling_dar_moe import DARMoeForCausalLM
from .card import chat_answers, render_model_card
from .families import MOE_SOURCE_FAMILIES, source_family, warn_not_carried
from .options import ConversionOptions
from .output import check_output_folder, scratch_folder, write_repo_folder
from .checkpoints import Checkpoint, StateDictCheckpoint
from .keymaps import TensorPlan
from .plan import (
    cast_model, check_finite, check_tied_output_head, in_memory_source, kept_source_dtypes, logging_level_error,
    plan_conversion, upcycle_model,
)
from .report import VerificationReport, check_sees_rounding
from .sources import (
    Source, check_has_layers, check_heads_run, display_name, gguf_parsed_once, hub_snapshot, load_source_config,
    open_source,
    rounded_tensors, source_storage_dtype, tensors_phrase, warn_if_declared_dtype_differs,
)
from .targets import TargetKind, dar_moe_target_kind
from .verify import (
    build_prompts,
    check_written_tensors,
    check_written_tokenizer,
    raise_unless_passed,
    verify_conversion,
    verify_written,
)
from .write import write_converted_folder

logger = logging.get_logger(__name__)


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


def _same_value(first, second) -> bool:
    """Whether a field given twice has one value (an array or tensor compared whole; NaN is NaN)."""
    if first is second:
        return True
    try:
        return bool(first == second)
    except (TypeError, ValueError, RuntimeError):  # arrays and tensors of more than one element
        return type(first) is type(second) and repr(first) == repr(second)


# Set while `convert(path)` converts through a temporary folder into a model it returns: no folder is the user's.
_CONVERTED_IN_MEMORY = contextvars.ContextVar("dar_converted_in_memory", default=False)


def conversion_options(options: ConversionOptions | None, keywords: Mapping[str, object]) -> ConversionOptions:
    """`options` updated by `upcycle`'s keyword arguments: option names set options, the others are config fields."""
    if options is not None and not isinstance(options, ConversionOptions):
        raise TypeError(f"options must be a ConversionOptions (or None), got {type(options).__name__}: pass the "
                        "options as keywords (upcycle(source, output, dtype='bfloat16', dar_block_size=8)) or as "
                        "options=ConversionOptions(...).")
    option_keywords, fields = ConversionOptions.split(keywords)
    named = option_keywords.pop("fields", None)
    if named is not None and not isinstance(named, Mapping):
        raise ValueError(f"fields must be a mapping of config field names to values (such as "
                         f"{{'dar_block_size': 8}}), got {named!r}.")
    twice = sorted(name for name in set(named or {}) & set(fields) if not _same_value(named[name], fields[name]))
    if twice:  # the keyword won, silently
        raise ValueError(f"{', '.join(twice)} given twice, in fields= and as a keyword, with other values "
                         f"({', '.join(f'{name}={named[name]!r} and {fields[name]!r}' for name in twice)}): give each "
                         "once.")
    fields = {**(named or {}), **fields}
    if options is None:
        return ConversionOptions(**option_keywords, fields=fields)
    return dataclasses.replace(options, **option_keywords, fields={**options.fields, **fields})


@gguf_parsed_once()  # a GGUF source's metadata is read by several loaders: parsed once
def upcycle(
    source: PreTrainedModel | str | os.PathLike,
    output: str | os.PathLike | None = None,
    options: ConversionOptions | None = None,
    *,
    tokenizer=None,
    **keywords,
) -> ConversionResult:
    """Convert, verify and (if `output` is given) write; returns the verification report, the source and, for an
    in-memory conversion, the model.

    A path source (HF folder, GGUF file), or an in-memory model with an `output`, converts as a file operation: the
    folder is written to a temporary folder next to `output`, verified layer by layer against the source, and moved
    into place only if it passes. `options` (a `ConversionOptions`) or its fields as keywords (`dtype`, `tolerance`,
    `verify_dtype`, `full_greedy`, `prompts`, `max_new_tokens`, `max_shard_size`, `base_model`, `overwrite`,
    `progress`, `kind`); any other keyword is a config field of the target kind (for DAR: `dar_block_size`,
    `dar_routing`, `dar_num_streams`, ...). Raises before writing anything if an input is bad or the verification
    fails.
    """
    options = conversion_options(options, keywords)
    if tokenizer is not None and not callable(tokenizer):  # a path or Hub id: the folder's own is read already
        raise TypeError(f"tokenizer must be a tokenizer object (AutoTokenizer.from_pretrained(...)) or None (a folder "
                        f"or GGUF source's own), got {type(tokenizer).__name__} {tokenizer!r}.")
    target = options.target
    source = in_memory_source(source)
    if output is not None:
        output = check_output_folder(output, options.overwrite, source)
        if not options.verify:
            raise ValueError("verify=False cannot write an output folder: only verified conversions are written.")
    in_memory = isinstance(source, PreTrainedModel)
    source_config = source.config if in_memory else load_source_config(source)
    if in_memory:  # a folder's or GGUF file's config is checked as it is read (`load_source_config`)
        check_has_layers(source_config, "The in-memory model's config.num_hidden_layers")
        check_heads_run(source, source_config, "The in-memory model's config")
    branch_family = source_family(source_config)
    if in_memory and output is None:
        return _upcycle_in_memory(source, tokenizer, options)  # `upcycle_model` warns
    warn_not_carried(source_config)
    # Validate the target config before opening any weight.
    target.build_config(source_config, branch_family, options.storage_dtype or torch.float32, options.fields)

    loaded = open_source(source, source_config, tokenizer)
    if in_memory:
        loaded.model = source
    not_carried = list(loaded.not_carried)
    metadata_keys = sorted(loaded.checkpoint.metadata_keys)
    if metadata_keys:  # the writer's files hold {"format": "pt"}, as transformers' save_pretrained writes them
        not_carried.append(f"the safetensors metadata of its weights files ({', '.join(metadata_keys)})")
    if not_carried and not _CONVERTED_IN_MEMORY.get():  # `convert(path)` writes no folder for the user
        logger.warning(f"Not carried into the output: {', '.join(not_carried)} in {source} (the output holds "
                       "the converted weights, config, generation config, tokenizer, license files and a new model "
                       "card); copy what you need of them before removing the source.")
    written = False  # True once the output is in place: an interrupt after that says so (`dar convert` does)
    try:
        with contextlib.closing(loaded.checkpoint):
            check_tied_output_head(loaded.checkpoint, source_config, loaded.checkpoint.description)
            storage_dtype = options.storage_dtype or source_storage_dtype(loaded.checkpoint)
            if options.storage_dtype is None:
                warn_if_declared_dtype_differs(source_config, loaded.checkpoint, storage_dtype)
            config = target.build_config(source_config, branch_family, storage_dtype, options.fields)
            keep_source_dtypes = options.storage_dtype is None  # "auto": every tensor stored as the source stores it
            try:
                plans, new_names = plan_conversion(target, config, loaded.checkpoint.infos(), storage_dtype,
                                                   loaded.checkpoint.description, loaded.checkpoint.config_name,
                                                   keep_source_dtypes, source_config.model_type)
            except ValueError as error:  # a tensor the model needs may be one its index places in the wrong file
                absent = loaded.checkpoint.listed_but_absent()
                if not absent:
                    raise
                raise ValueError(f"{error}{absent}") from error
            kept = kept_source_dtypes(plans, target, storage_dtype)
            kept_description = describe_kept_dtypes(kept, plans, loaded.checkpoint)  # the log's and the card's
            wider = {dtype: names for dtype, names in kept.items() if not holds_exactly(storage_dtype, dtype)}
            rounded_on_load = describe_kept_dtypes(wider, plans, loaded.checkpoint)  # `from_pretrained` rounds them
            load_dtype = max(wider, key=lambda dtype: torch.finfo(dtype).bits, default=None)  # which holds them all
            # "auto" keeps every tensor as the source stores it; a narrower dtype rounds the values it does not hold
            # (the writer finds which, from its one read: `rounding` below)
            narrowed = [] if keep_source_dtypes else rounded_tensors(loaded.checkpoint, storage_dtype)
            if narrowed:
                may_round = describe_rounding(narrowed, loaded.checkpoint)
                logger.warning(f"--dtype {_short(storage_dtype)} may round {may_round}: where it does, the converted "
                               "model can at most compute the source's function with those weights rounded, not bit "
                               "for bit the source's, so the check may fail at its default tolerance (--tolerance "
                               "accepts the rounding, and the model card of a written output says so); --dtype auto "
                               "stores every tensor exactly.")
            if kept:
                rounds = (f"; --dtype {_short(storage_dtype)} would round those whose values it does not hold"
                          if rounded_tensors(loaded.checkpoint, storage_dtype) else "")
                logger.info(f"The source mixes dtypes: {kept_description} beside "
                            f"{_short(storage_dtype)} (--dtype auto){rounds}.")
            # NaN/inf in the source: refused by the writer as it reads each tensor (its one read), when staging.
            check_dtype = options.verification_dtype(storage_dtype)
            prompt_ids = (build_prompts(loaded.tokenizer, source_config.vocab_size, options.prompts) if options.verify
                          else [])
            outcome = {}

            def write(folder: Path) -> None:
                rounding = dict.fromkeys((name for name, _ in narrowed), False)  # marked by the write where it rounds
                write_converted_folder(folder, target, config, plans, new_names, loaded, options.max_shard_bytes,
                                       options.progress, rounding)
                changed = {name for name, rounded in rounding.items() if rounded}
                rounded = describe_rounding([(name, dtype) for name, dtype in narrowed if name in changed],
                                            loaded.checkpoint)
                if narrowed and not rounded:
                    logger.info(f"--dtype {_short(storage_dtype)} changed no value: every source tensor is stored "
                                "exactly.")
                check_written_tokenizer(folder, loaded.tokenizer, options.prompts)
                if not options.verify:
                    return
                check_written_tensors(folder, plans, loaded.checkpoint, options.progress)
                report = verify_written(loaded, target, folder, prompt_ids, check_dtype, options)
                if kept:
                    report.storage_dtype = " and ".join(str(dtype).removeprefix("torch.")
                                                        for dtype in (storage_dtype, *kept))
                if rounded:
                    report.rounding = rounding_sentence(rounded, storage_dtype, check_dtype)
                outcome["report"] = report
                raise_unless_passed(report, storage_dtype, None if keep_source_dtypes else loaded.checkpoint,
                                    moe_routing_hint(source_config, config, check_dtype) or
                                    (rounded_rotary_hint(source) if in_memory else ""),
                                    IN_MEMORY_SOURCE_NOTE if in_memory else "", changed)
                answers = chat_answers(report, loaded.tokenizer, loaded.generation_config.eos_token_id)
                card = render_model_card(config, report, loaded,
                                         base_model=options.base_model or snapshot_repo_id(source),
                                         kind=target.description, answers=answers, exact=target.exact,
                                         kept_dtypes=kept_description, rounded=rounded,
                                         rounded_on_load=rounded_on_load, load_dtype=load_dtype)
                (folder / "README.md").write_text(card, encoding="utf-8")

            if output is not None:
                write_repo_folder(output, write, options.overwrite, source)
                written = True
                logger.info(f"Wrote the converted model to {output}")
            else:  # a check only: written to a temporary folder, verified, removed
                with scratch_folder() as scratch:
                    write(scratch)
        loaded.model = None
        return ConversionResult(model=None, tokenizer=loaded.tokenizer, report=outcome.get("report"), source=loaded,
                                output=output, config=config)
    except KeyboardInterrupt as interrupt:  # one from `write_repo_folder` says itself whether it swapped
        interrupt.output_written = getattr(interrupt, "output_written", written)
        raise


def describe_rounding(rounded: list, checkpoint: Checkpoint) -> str:
    """The source tensors a conversion rounds (`rounded_tensors` of the source `checkpoint`), in a phrase: "23
    source tensor(s) stored in float32 (model.embed_tokens.weight, ...)"; empty when none."""
    return tensors_phrase(rounded, "source", checkpoint) if rounded else ""


def rounding_sentence(rounded: str, storage_dtype: torch.dtype, check_dtype: torch.dtype) -> str:
    """What the report says of the source values that storing in `storage_dtype` rounded (`rounded`, a
    `describe_rounding` phrase): where the check computes in a dtype no finer, both models compute from the same
    rounded weights, so its difference does not measure the rounding."""
    sentence = f"The output stores the weights in {_short(storage_dtype)}, which rounds {rounded}"
    if not check_sees_rounding(check_dtype, storage_dtype):
        return (f"{sentence}; the check computes both models in {_short(check_dtype)} from those rounded weights, so "
                "the difference above does not include that rounding (--verify-dtype float64 measures it).")
    return f"{sentence}; the difference above includes that rounding."


def moe_routing_hint(source_config: PreTrainedConfig, config: PreTrainedConfig, check_dtype: torch.dtype) -> str:
    """Why an MoE source (Mixtral, Qwen2/Qwen3-MoE) with renormalised top-k weights cannot pass a float64 check: its
    router takes the softmax and the renormalisation in float32 whatever the model's dtype, while DAR-MoE's
    renormalises the k weights again in float64 (`DARMoeTopKRouter`: sparse upcycling is then exact in float64).
    Empty for any other conversion."""
    if (check_dtype != torch.float64 or source_config.model_type not in MOE_SOURCE_FAMILIES
            or not getattr(config, "norm_topk_prob", False)):
        return ""
    return (f"The {source_config.model_type} source's router renormalises its top-k weights in float32 even in a "
            "float64 model, and DAR-MoE's renormalises them again in float64 (so that sparse upcycling of a dense "
            "model is exact in float64): the two differ by about 1e-7 of the logits, above the float64 bar. Verify "
            "in float32 (the default --verify-dtype), where they agree to float32 rounding.")


# Why a conversion of an in-memory model can fail where its weights would convert: it is checked against the
# model object itself (`verify.in_memory_source_logits`), which may compute what its config and weights do not say.
IN_MEMORY_SOURCE_NOTE = (
    "The converted model was compared with the in-memory model itself: a config field edited after the model was "
    "built (rms_norm_eps, rope parameters: the modules keep the values of their construction), a forward hook or a "
    "replaced module make it compute what its config and weights do not say, and no conversion of them reproduces it. "
    "save_pretrained it and load it again to see what they compute."
)


def rounded_rotary_hint(source: PreTrainedModel) -> str:
    """Why an in-memory source may compute otherwise than its conversion: rotary frequencies (`inv_freq` buffers)
    in a half dtype, which `model.to(torch.bfloat16)` leaves behind (it casts buffers), where `from_pretrained(...,
    dtype=torch.bfloat16)` and the converted model keep them float32. Empty when they are float32."""
    rounded = [name for name, buffer in source.named_buffers()
               if name.endswith("inv_freq") and buffer.dtype not in (torch.float32, torch.float64)]
    if not rounded:
        return ""
    return (f"The source's rotary frequencies ({', '.join(rounded[:2])}) are "
            f"{str(source.get_buffer(rounded[0]).dtype).removeprefix('torch.')}: model.to(dtype) rounds them, while "
            "from_pretrained(..., dtype=...) and the converted model keep them float32, so the two compute different "
            "rotations. Load the source with from_pretrained(dtype=...) (or cast its parameters only) and convert "
            "that.")


def describe_kept_dtypes(kept: Mapping[torch.dtype, list[str]], plans: Mapping[str, TensorPlan],
                         checkpoint) -> str:
    """"7 tensor(s) in float32 as the source stores them (model.norm.weight, ...)" of `kept_source_dtypes`, or, for
    tensors the source stores in a narrower dtype that `auto` widens exactly (float8), "14 tensor(s) in bfloat16,
    widened exactly from the source's float8_e4m3fn (...)"; empty when nothing was kept apart."""
    infos = checkpoint.infos()

    def group(dtype: torch.dtype, names: list[str]) -> str:
        stored = {infos[part].dtype for name in names for part in plans[name].parts if part in infos} - {dtype}
        how = (f", widened exactly from the source's {' and '.join(sorted(_short(each) for each in stored))}"
               if stored else " as the source stores them")
        shown = ", ".join(names[:2]) + (", ..." if len(names) > 2 else "")
        return f"{len(names)} tensor(s) in {_short(dtype)}{how} ({shown})"

    return "; ".join(group(dtype, names) for dtype, names in kept.items())


def holds_exactly(wide: torch.dtype, narrow: torch.dtype) -> bool:
    """Whether every value of `narrow` is a value of `wide` (bfloat16 in float32: yes; float32 in bfloat16, float16
    in bfloat16: no): a cast from `narrow` to `wide` changes nothing."""
    wide_info, narrow_info = torch.finfo(wide), torch.finfo(narrow)
    return (wide_info.eps <= narrow_info.eps and wide_info.max >= narrow_info.max
            and wide_info.smallest_normal <= narrow_info.smallest_normal)


def _short(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


def _upcycle_in_memory(source: PreTrainedModel, tokenizer, options: ConversionOptions) -> ConversionResult:
    """An in-memory model, nothing written: `upcycle_model`, then both models side by side in the check dtype."""
    storage_dtype = options.storage_dtype or source.dtype
    target = options.target
    target.build_config(source.config, source_family(source.config), storage_dtype, options.fields)
    state = StateDictCheckpoint(source.state_dict())
    check_finite(state, "the in-memory model")
    model = upcycle_model(source, target, options.storage_dtype, **options.fields)  # None: as the source holds it
    report = None
    if options.verify:
        check_dtype = options.verification_dtype(storage_dtype)
        source_model, target_model = cast_model(source, check_dtype), cast_model(model, check_dtype)
        prompt_ids = build_prompts(tokenizer, source.config.vocab_size, options.prompts)
        max_new_tokens = 0 if options.full_greedy is False else options.max_new_tokens
        report = verify_conversion(source_model, target_model, prompt_ids, options.tolerance, max_new_tokens,
                                   options.progress)
        stored = [storage_dtype]  # and, with dtype auto, the source's other dtypes, which the model keeps
        if options.storage_dtype is None:
            stored += sorted({parameter.dtype for parameter in source.parameters()} - {storage_dtype}, key=str)
        report.storage_dtype = " and ".join(str(dtype).removeprefix("torch.") for dtype in stored)
        raise_unless_passed(report, storage_dtype, state, rounded_rotary_hint(source), IN_MEMORY_SOURCE_NOTE)
    name = display_name(source.config.name_or_path or type(source).__name__)
    loaded = Source(source, tokenizer, name, "in-memory model", source.config)
    return ConversionResult(model=model, tokenizer=tokenizer, report=report, source=loaded, output=None,
                            config=model.config)


def convert(
    source: PreTrainedModel | str | os.PathLike, output: str | os.PathLike | None = None, **keywords
) -> PreTrainedModel:
    """Upcycle `source` (a model, an HF folder or a .gguf file) into DAR, verified; write it to `output` if given.
    Returns the converted model (a written one loaded from `output` with `dtype="auto"`).

    Keyword arguments: the DAR fields (`dar_block_size=8`, `dar_routing="dar"`, `dar_num_streams=2`, ...), the
    options of `upcycle` (`dtype`, `tolerance`, `overwrite`, `max_shard_size`, `base_model`, ...) or `options=`,
    and `tokenizer`.

    ```python
    >>> from dar_transformers.conversion import convert
    >>> dar = convert("SmolLM2-135M-Instruct.Q4_1.gguf", "smollm2-dar", dar_block_size=8)
    ```
    """
    if output is None and isinstance(source, (str, os.PathLike)):  # a model, compiled or not, is converted in memory
        options = keywords.get("options")
        if keywords.get("verify") is False or (isinstance(options, ConversionOptions) and not options.verify):
            raise ValueError(
                "convert(path, verify=False): a model converted from a folder or GGUF file is written to a temporary "
                "folder, verified and loaded back from it, and only verified conversions are written; verify=False "
                "converts an in-memory model (convert(model, verify=False))."
            )
        in_memory = _CONVERTED_IN_MEMORY.set(True)
        try:
            with scratch_folder() as scratch:  # read into memory, not mapped: the folder goes before the model
                model = _load_written(upcycle(source, scratch / "dar", **keywords).output, disable_mmap=True)
        finally:
            _CONVERTED_IN_MEMORY.reset(in_memory)
        # Not the removed temporary folder (a Trainer's card named it), nor any local path (a card would name it once
        # the folder is gone): the Hub id of a Hub cache snapshot, else none
        source = Path(source)
        snapshot = hub_snapshot(source if source.is_dir() else source.parent)
        model.name_or_path = model.config.name_or_path = snapshot[0] if snapshot else ""
        return model
    result = upcycle(source, output, **keywords)
    if result.model is not None:
        return result.model
    return _load_written(result.output)


def snapshot_repo_id(source) -> str | None:
    """The Hub id of a source folder that is a Hub cache snapshot (`hub_snapshot`): the card's `base_model` when
    `base_model` is not given, as its title already names it (the front matter had none, so the Hub did not link the
    converted model to its base). Not a GGUF file's repo: it holds a quantisation, not the base model."""
    if not isinstance(source, (str, os.PathLike)) or not Path(source).is_dir():
        return None
    snapshot = hub_snapshot(Path(source))
    if snapshot is None:
        return None
    try:
        validate_repo_id(snapshot[0])
    except ValueError:  # HFValidationError: a cache folder name that is no Hub id
        return None
    return snapshot[0]


def _load_written(folder: Path, **keywords) -> PreTrainedModel:
    with logging_level_error():
        return AutoModelForCausalLM.from_pretrained(folder, dtype="auto", trust_remote_code=False, **keywords).eval()


def _moe_target(expert_noise: float, seed: int) -> TargetKind | str:
    return dar_moe_target_kind(expert_noise, seed) if expert_noise else "dar_moe"


def upcycle_to_dar_moe(
    source: PreTrainedModel | str | os.PathLike,
    output: str | os.PathLike | None = None,
    *,
    num_experts: int | None = None,
    top_k: int | None = None,
    expert_noise: float = 0.0,
    seed: int = 0,
    **keywords,
) -> ConversionResult:
    """`dar convert --experts E --top-k k [--expert-noise X]`: convert, verify and write, as the dense converter.

    A dense source is sparse-upcycled (E and k required); an MoE source (Mixtral, Qwen2-MoE, Qwen3-MoE) keeps its
    experts and routing. `keywords` are those of `upcycle` (dtype, tolerance, tokenizer, DAR fields, ...). With
    `expert_noise > 0` the result is deliberately not exact: unless a tolerance is given, the verification only
    reports the differences (a relaxed check, recorded in the model card) instead of refusing.

    ```python
    >>> from dar_transformers.conversion import upcycle_to_dar_moe
    >>> result = upcycle_to_dar_moe("SmolLM2-135M-Instruct.Q4_1.gguf", "smollm2-dar-moe", num_experts=4, top_k=2)
    ```
    """
    if "kind" in keywords:
        raise ValueError(f"upcycle_to_dar_moe converts to DAR-MoE, so it takes no kind (got kind={keywords['kind']!r}); "
                         "upcycle(source, output, kind=...) converts to another target.")
    kind = _moe_target(expert_noise, seed)
    options = keywords.get("options")
    given = keywords.get("tolerance", getattr(options, "tolerance", None))  # a keyword, or the options' own
    if expert_noise and given is None:
        keywords["tolerance"] = math.inf
    return upcycle(source, output, kind=kind, num_experts=num_experts, num_experts_per_tok=top_k, **keywords)


def convert_to_dar_moe(
    source: PreTrainedModel,
    num_experts: int | None = None,
    top_k: int | None = None,
    expert_noise: float = 0.0,
    seed: int = 0,
    dtype: torch.dtype | None = None,
    **dar_fields,
) -> DARMoeForCausalLM:
    """An in-memory source -> DAR-MoE, unverified: sparse upcycling (dense source) or an MoE source as is.

    Raises if any source tensor would be dropped or any target parameter other than the new ones (DAR residual
    modules; routers when upcycling) would stay unloaded. For a verified, written conversion use `upcycle_to_dar_moe`.
    """
    fields = dict(num_experts=num_experts, num_experts_per_tok=top_k, **dar_fields)
    return upcycle_model(source, _moe_target(expert_noise, seed), dtype, **fields)


__all__ = ["ConversionResult", "convert", "convert_to_dar_moe", "upcycle", "upcycle_to_dar_moe"]
