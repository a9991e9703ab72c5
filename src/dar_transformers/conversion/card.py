# SPDX-License-Identifier: Apache-2.0
# Copyright 2026 The dar-transformers authors.
"""The README.md (model card) of a converted repo: base model, DAR settings, verification numbers, how to load."""

import math

import torch
import yaml
from huggingface_hub.repocard import metadata_load

from .. import TRANSFORMERS_REQUIREMENT, __version__
from .families import DAR_SOURCE_TYPE, MOE_SOURCE_FAMILIES
from .report import check_sees_rounding
from .targets import untrained_router_note
from .verify import has_default_chat_template, one_message_chat

CARD_TEMPLATE = """---
{front_matter}
---

# {title}

{source_sentence} converted into **{kind}** (DAR; Yu, Li, Liu et al., arXiv 2607.18730) with
[dar-transformers](https://pypi.org/project/dar-transformers/) {package_version}.

{conversion_paragraph}

## DAR settings

| setting | value |
|---|---|
{settings}

## Verification

Source and DAR model run side by side on the same prompts: the largest absolute difference of the logits over
every position of every prompt, whether both models pick the same next token (teacher-forced top-1) wherever the
source's top-1/top-2 margin exceeds twice the tolerance, and, when both models fit in memory, whether their greedy
continuations are identical token for token. The line under the table says which of these ran, in which dtype.

{verification}
{chat_check}
## How to load

With the package installed (`pip install dar-transformers`), importing it registers the `{model_type}` model type:

```python
import dar_transformers  # noqa: F401  (registers model_type "{model_type}")
from transformers import AutoModelForCausalLM, AutoTokenizer

model = AutoModelForCausalLM.from_pretrained("{repo}")
tokenizer = AutoTokenizer.from_pretrained("{repo}")
```

Without the package, the modelling code shipped in this repo (`configuration_{model_type}.py`, `modeling_{model_type}.py` and the modules they import) is used:

```python
from transformers import AutoModelForCausalLM, AutoTokenizer

model = AutoModelForCausalLM.from_pretrained("{repo}", trust_remote_code=True)
tokenizer = AutoTokenizer.from_pretrained("{repo}", trust_remote_code=True)  # the config's code; the tokenizer has none
```

Requires `{transformers_requirement}` and torch. {usage}{mixed_dtypes}
"""

# How to generate: a chat for a tokenizer whose chat template renders one user message, plain text otherwise (a
# tokenizer without a template cannot `apply_chat_template`; `dar generate` then continues the prompt as text, and
# for a template that fails is told to with --no-chat-template).
CHAT_USAGE = """Chat:

```python
messages = [{"role": "user", "content": "What is the capital of France?"}]
input_ids = tokenizer.apply_chat_template(messages, add_generation_prompt=True, return_tensors="pt")["input_ids"]
print(tokenizer.decode(model.generate(input_ids, max_new_tokens=48)[0, input_ids.shape[1]:]))
```

or from the command line: `dar generate <this folder> --prompt "What is the capital of France?"`.
"""
TEXT_USAGE = """{reason}, so continue text:

```python
input_ids = tokenizer("The capital of France is", return_tensors="pt")["input_ids"]
print(tokenizer.decode(model.generate(input_ids, max_new_tokens=48)[0, input_ids.shape[1]:]))
```

or from the command line: `dar generate <this folder> --prompt "The capital of France is"{flag}`.
"""


def _mixed_dtypes_note(config, rounded_on_load: str, load_dtype, report, source_dtype=None) -> str:
    """For weights stored in several dtypes: what the load code above computes, and how to load what was verified.
    `from_pretrained` casts every tensor to the config's dtype (its default `dtype="auto"`), which rounds the tensors
    the source keeps in a dtype that one does not hold (`rounded_on_load`, from `api.describe_kept_dtypes`: float32
    norms beside bf16 matrices, 0.13 off the verified logits on a tiny model), as it does for the source itself; the
    check computed with every tensor as stored. `load_dtype`: the widest of them, in which a load keeps them all.
    `source_dtype`: the dtype the source's config.json declares, in which `from_pretrained` loads the source."""
    if not rounded_on_load:
        return ""
    dtype = str(config.dtype).removeprefix("torch.")
    declared = str(source_dtype).removeprefix("torch.") if isinstance(source_dtype, torch.dtype) else dtype
    source_load = ("as `from_pretrained` loads the source too" if declared == dtype else
                   f"while `from_pretrained` loads the source in {declared}, the dtype its config.json declares")
    wide = str(load_dtype).removeprefix("torch.")
    checked = (f" (the function checked above, in {report.dtype})"
               if report is not None and report.verified and report.dtype == wide else "")
    return (f"\nThe weights mix dtypes: {rounded_on_load}, beside {dtype}. The code above loads every tensor in "
            f"{dtype}, the config's dtype, which rounds those tensors ({source_load}); "
            f"`from_pretrained(..., dtype=torch.{wide})` computes with every tensor as stored{checked}.\n")


def _usage(tokenizer) -> str:
    """The card's generation code: a chat where the tokenizer's template renders the one user message the code sends
    (the verification's own test), text otherwise, saying why."""
    if not has_default_chat_template(tokenizer):
        named = isinstance(getattr(tokenizer, "chat_template", None), dict)  # `chat_template=NAME` needed
        has = "named chat templates only, no default one" if named else "no chat template"
        return TEXT_USAGE.format(reason=f"The tokenizer has {has}", flag="")
    ids, failure = one_message_chat(tokenizer)
    if ids is None:
        return TEXT_USAGE.format(reason=f"The tokenizer's chat template {failure}", flag=" --no-chat-template")
    return CHAT_USAGE


def _settings_rows(config, kept_dtypes: str = "") -> list[tuple[str, str]]:
    num_branches = config.dar_num_branches
    num_blocks = math.ceil(num_branches / config.dar_block_size)
    variant = "Full DAR" if config.dar_block_size == 1 else f"Block DAR, {num_blocks} blocks"
    one_stream = config.dar_num_streams == 1  # no routing, read or write gates, nor transport (Attention Residuals)
    none = "none (one stream)"
    dtype = str(config.dtype).removeprefix("torch.")
    rows = [
        ("block size K (branches; 2 per layer)", f"{config.dar_block_size} of {num_branches} ({variant})"),
        ("streams", str(config.dar_num_streams)),
        ("routing", none if one_stream else config.dar_routing),
        ("write mode", none if one_stream else config.dar_write_mode),
        ("write-gate spread delta", none if one_stream else f"{config.dar_gate_delta:g}"),
        ("initial transport rho", none if one_stream else f"{config.dar_rho_init:g}" if config.dar_block_size > 1
         else "none (blocks of one branch carry no partial to transport)"),
        ("partial block as a source / count scaling", f"{config.dar_include_partial} / {config.dar_count_scaling}"),
        ("branch family (HF attention / MLP modules)", config.dar_branch_family),
        ("weights dtype", dtype + (f"; {kept_dtypes}" if kept_dtypes else "") + (
            "; DAR's own parameters float32, as they load" if dtype in ("bfloat16", "float16") else "")),
        ("tied input/output embeddings", str(config.tie_word_embeddings)),
    ]
    if hasattr(config, "num_experts"):  # DAR-MoE
        rows.append(("experts E (sparse layers)", f"{config.num_experts} ({len(config.moe_layer_indices)} of "
                                                  f"{config.num_hidden_layers} layers)"))
        rows.append(("experts per token (top-k)", str(config.num_experts_per_tok)))
        if getattr(config, "shared_expert_intermediate_size", 0):
            rows.append(("shared expert (intermediate size)", str(config.shared_expert_intermediate_size)))
    return rows


def chat_answers(report, tokenizer, eos_token_ids) -> tuple[str, str] | None:
    """The source's and the converted model's greedy answers to the verification chat prompt, cut at end-of-turn."""
    chat = [check for check in report.checks if check.name.startswith("chat:")] if report and tokenizer else []
    if not chat or chat[0].greedy_identical is None:  # no continuations ran (max new tokens 0, or not in memory)
        return None
    stops = set(eos_token_ids if isinstance(eos_token_ids, list) else [eos_token_ids]) - {None}

    def decode(tokens: list[int]) -> str:
        end = next((index for index, token in enumerate(tokens) if token in stops), len(tokens))
        text = tokenizer.decode(tokens[:end], skip_special_tokens=True).strip()
        return " ".join(text.split()).replace("|", "\\|")  # one Markdown table cell

    return decode(chat[0].source_continuation), decode(chat[0].target_continuation)


def _license_front_matter(source) -> list[str]:
    """The license fields (`license`, `license_name`, `license_link`) of the source folder's README.md front matter,
    or of a GGUF file's metadata (`Source.license`), as YAML lines; `license: other` without them: the weights keep
    the source's terms, never a made-up license."""
    readme = source.folder / "README.md" if source.folder is not None else None
    metadata = dict(getattr(source, "license", None) or {})
    if readme is not None and readme.is_file():
        try:
            metadata = metadata_load(readme) or {}
        except (OSError, UnicodeDecodeError, ValueError, yaml.YAMLError):  # an unreadable card: no license known
            metadata = {}
    fields = {key: metadata[key] for key in ("license", "license_name", "license_link") if metadata.get(key) is not None}
    fields = fields or {"license": "other"}
    return yaml.safe_dump(fields, sort_keys=False, allow_unicode=True, width=math.inf).splitlines()


def _function_sentence(exact: bool, report, source, rounded: str = "", storage: str = "") -> str:
    """What the card claims about the converted function: only what the conversion made true and the check showed.

    The function is the source model's, or, for a source whose config.json maps the model to its own code
    (`Source.custom_code`, never run), that of the class its model_type names (`Source.reference_class`). The claim
    is exact when verified at the default bar, approximate (within the tolerance) when the bar was relaxed, and
    unverified when nothing was compared at it (`VerificationReport.verified`). `rounded`: the source tensors the
    stored dtype `storage` rounds (`api.describe_rounding`), which the claim then names."""
    if not exact:
        return ("that much holds, but this conversion **deliberately changed the function** (its experts were perturbed: "
                "Drop-Upcycling), so the model does NOT compute the source model's function; the differences are "
                "reported below.")
    function = "the source model's function"
    caveat = ""
    if source.custom_code:
        function = (f"the function of {source.reference_class} with the source's weights and "
                    "config")
        caveat = (f" The source's config.json maps the model to its own code (auto_map: "
                  f"{'; '.join(f'`{entry}`' for entry in source.custom_code)}), which the conversion neither ran nor "
                  "reproduces: where that code computes something else, this model does not.")
    compared = function  # what the check compared with: the source as stored
    if rounded:  # the weights are the source's rounded to the stored dtype: the function is that of those weights
        function += f" with its weights rounded to {storage}"
        checked = report is not None and report.verified
        if checked and check_sees_rounding(report.dtype, storage):  # as the report's rounding sentence says
            bound = ", and the check bounds its distance from the source as stored by its tolerance"
        elif checked:  # both models computed in a dtype no finer than the stored one, from the same rounded weights
            bound = (f"; the check computed both models in {report.dtype} from those rounded weights, so it does not "
                     "measure that distance (a check with --verify-dtype float64 does)")
        else:
            bound = ""
        caveat = (f" Storing the weights in {storage} rounded {rounded}; by construction the converted model computes "
                  f"what the source computes with them{bound}.{caveat}")
    if report is None or not report.verified:
        return (f"**at conversion the model computes {function}** by construction, which this conversion did NOT "
                f"verify (see below).{caveat}")
    if report.relaxed:  # measured against the source as stored, whatever the rounding
        return (f"**at conversion the model approximates {compared}**: within a max abs logit difference of "
                f"{report.tolerance:.1e} (a tolerance relaxed from the default {report.default_tolerance:.1e}), "
                f"verified below at that bar, not as an exact conversion.{caveat}")
    return f"**at conversion the model computes {function}**, verified below.{caveat}"


ROUTING_DESCRIPTIONS = {  # DESIGN.md section 2: which stream's history keys and values a stream reads
    "dar": "reciprocal cross-stream addressing (keys from the other stream, values from its own)",
    "selfkv": "each stream addressing its own history (keys and values from itself)",
    "crossv": "keys from its own stream and values from the other",
    "fixedkv": "keys and values from fixed streams",
}


def _architecture_sentences(config) -> tuple[str, str]:
    """What the model's config makes of the residual path, and the DAR parameters that adds (no gates for one
    stream)."""
    if config.dar_num_streams == 1:
        return ("This model runs DAR's one-stream special case (Attention Residuals): the residual add around every "
                "attention and MLP branch becomes a softmax attention over depth of one residual stream.",
                "depth queries and key norms")
    return ("DAR replaces the residual add around every attention and MLP branch with two residual streams and a "
            f"softmax attention over depth with {ROUTING_DESCRIPTIONS[config.dar_routing]}.",
            f"depth queries, key norms, read and write gates{', transport' if config.dar_block_size > 1 else ''}")


def _from_dar(source) -> bool:
    """Whether the source is a dense DAR model (upcycled to DAR-MoE)."""
    return getattr(source.config, "model_type", None) == DAR_SOURCE_TYPE


def _title_kind(config, source) -> str:
    """What the title adds to the source's name: MoE for a dense DAR source's upcycle, DAR-MoE for any other source
    converted to DAR-MoE, DAR otherwise."""
    if _from_dar(source):
        return "MoE"
    return "DAR-MoE" if getattr(config, "num_experts", None) else "DAR"


def _conversion_paragraph(config, source, function_sentence: str, exact: bool = True) -> str:
    """What the conversion made of the source, ending with what training changes. A dense DAR source (its DAR-MoE
    upcycle) keeps its DAR parameters, trained or not; a Llama-family source gets them new, at the residual sum."""
    described, parameters = _architecture_sentences(config)
    if _from_dar(source):
        experts = (f"each MLP became {config.num_experts} identical experts behind a new router, so whichever experts "
                   f"the router picks compute the source's MLP: {function_sentence}" if exact else
                   f"each MLP became {config.num_experts} experts behind a new router, copies of it with part of their "
                   "hidden units re-initialised (Drop-Upcycling), which **deliberately changes the function**: the "
                   "model does NOT compute the source model's function; the differences are reported below.")
        router = untrained_router_note(config)
        return (f"{described} The source is a DAR model already: its DAR parameters ({parameters}) are kept as they "
                f"are, and {experts} Training is what lets the experts specialise." + (f" {router}" if router else ""))
    experts = ""
    moe_source = source.config.model_type in MOE_SOURCE_FAMILIES
    jitter = getattr(source.config, "router_jitter_noise", 0.0) if moe_source else 0.0
    if jitter:
        experts = (f" The source's experts and routers are kept; its router jitter (`router_jitter_noise={jitter}`, "
                   "a perturbation of the routing during training only) is not carried, as DAR-MoE's routers have "
                   "none: training this model routes without it.")
    if getattr(config, "num_experts", None) and not moe_source:
        experts = (f" Each MLP of the sparse layers became {config.num_experts} "
                   + ("identical experts behind a new, randomly initialised router, so that whichever experts it picks "
                      "compute the source's MLP." if exact else "experts behind a new, randomly initialised router, "
                      "copies of it with part of their hidden units re-initialised (Drop-Upcycling)."))
        router = untrained_router_note(config)
        experts += f" {router}" if router else ""
    return (f"{described} The new parameters ({parameters}) are initialised so that every depth read is the standard "
            f"residual sum: {function_sentence}{experts} Training (fine-tuning or continued pre-training) is what lets "
            "the depth attention depart from the plain residual stream.")


def render_model_card(
    config, report, source, base_model: str | None = None, kind: str = "Dual Attention Residuals", answers=None,
    exact: bool = True, kept_dtypes: str = "", rounded: str = "", rounded_on_load: str = "", load_dtype=None
) -> str:
    """Markdown with YAML front matter; `base_model` (a Hub id) goes into the front matter when given.

    `answers`: (source, converted) greedy answers to the chat prompt, shown side by side when given. `exact`: False
    when the target deliberately differs from the source (`TargetKind.exact`), which the card then says.
    `kept_dtypes`: the source tensors stored in another dtype than the config's (`api.describe_kept_dtypes`).
    `rounded`: the source tensors the stored dtype rounds (`api.describe_rounding`), named by the function claim.
    `rounded_on_load`: those of `kept_dtypes` that loading in the config's dtype rounds, `load_dtype` the widest of
    their dtypes (`_mixed_dtypes_note`).
    """
    front_matter = ["library_name: transformers", "pipeline_tag: text-generation", *_license_front_matter(source)]
    if base_model:
        front_matter.insert(0, f"base_model: {base_model}")
    front_matter += ["tags:", "- dar", "- dual-attention-residuals", "- upcycled", "- custom_code"]
    # Only names reach the card (a Hub id, or a file/folder name): never a path of the converting machine.
    location = f"{source.location}: {source.stored_as}" if getattr(source, "stored_as", "") else source.location
    source_sentence = f"`{base_model or source.name}` ({location})"
    if report is None:
        verification = "Not verified."
    else:
        verification = report.table()
        if report.relaxed:
            verification += (
                f"\n\n**The tolerance was relaxed** to {report.tolerance:.1e} from the default "
                f"{report.default_tolerance:.1e} for {report.dtype}, "
                + ("so it is verified as an approximate conversion, not as an exact one." if report.verified else
                   "at which no next token was compared, so nothing was verified: the differences above are reported "
                   "only.")
            )
    chat_check = ""
    if answers is not None:
        chat_check = (
            '\nGreedy answers to the chat prompt "What is the capital of France?":\n\n| model | answer |\n|---|---|\n'
            f"| source | {answers[0]} |\n| converted | {answers[1]} |\n"
        )
    return CARD_TEMPLATE.format(
        chat_check=chat_check,
        conversion_paragraph=_conversion_paragraph(config, source, _function_sentence(
            exact, report, source, rounded, str(getattr(config, "dtype", "")).removeprefix("torch.")), exact),
        front_matter="\n".join(front_matter),
        title=f"{base_model or source.name} + {_title_kind(config, source)}",
        source_sentence=source_sentence,
        kind=kind,
        package_version=__version__,
        settings="\n".join(f"| {name} | {value} |" for name, value in _settings_rows(config, kept_dtypes)),
        verification=verification,
        repo="<this repo or folder>",
        transformers_requirement=TRANSFORMERS_REQUIREMENT,
        mixed_dtypes=_mixed_dtypes_note(config, rounded_on_load, load_dtype, report,
                                        getattr(source.config, "dtype", None)),
        usage=_usage(source.tokenizer),
        model_type=config.model_type,
    )


__all__ = ["chat_answers", "render_model_card"]
