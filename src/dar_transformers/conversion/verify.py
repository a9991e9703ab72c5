# SPDX-License-Identifier: Apache-2.0
# Copyright 2026 The dar-transformers authors.
"""Verification: source and converted model side by side on the same prompts (DESIGN.md sections 3 and 6).

Per prompt: the max |logit difference| over every position, teacher-forced top-1 agreement wherever the source's
top-1/top-2 margin exceeds twice the tolerance, and, when both models fit in memory, full greedy continuations.
A written conversion is verified from the files written (`verify_written`, layer-streamed: `streamed.py`); an
in-memory one with both models in memory (`verify_conversion`). The written tokenizer is loaded back and compared
with the source's (`check_written_tokenizer`).
"""

import contextlib
import copy
import math
import re
from collections.abc import Mapping, Sequence
from pathlib import Path

import torch
from transformers import (
    AutoConfig, AutoModelForCausalLM, AutoTokenizer, DynamicCache, GenerationMixin, PreTrainedModel,
)
from transformers.generation.streamers import BaseStreamer
from transformers.utils import logging

from ..modeling_dar import cache_keyword
from .checkpoints import Checkpoint, SafetensorsCheckpoint
from .families import cache_only_windows, one_line
from .keymaps import TensorPlan, to_model_layout
from .options import ConversionOptions
from .plan import cast_model, logging_level_error, materialise, meta_model, set_experts_for
from .report import DEFAULT_TOLERANCES, PromptCheck, VerificationError, VerificationReport
from .sources import Source, exact_storage_dtype, plain_config, rounded_tensors
from .streamed import StreamedModel, all_finite, streamed_logit_statistics
from .targets import TargetKind

logger = logging.get_logger(__name__)

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
# generate() settings of the greedy check over the model's generation config (the source's generation_config.json,
# which the written folder carries), the same for both models: plain greedy search, one sequence per prompt, every
# one of `max_new_tokens` tokens, returned as a tensor. The config's logits processors (repetition_penalty,
# no_repeat_ngram_size, ...) still apply, as from_pretrained loads them; its search strategy and stopping rules do not
# (beam search refuses the progress streamer, stop_strings need a tokenizer, num_return_sequences > 1 needs sampling,
# max_time could stop the two models at different lengths, a quantized cache needs another package, the exponential
# decay length penalty raises the EOS token's logits and fails without one).
GREEDY_SEARCH: dict[str, object] = dict(
    do_sample=False, num_beams=1, num_beam_groups=1, num_return_sequences=1,
    penalty_alpha=None, dola_layers=None, constraints=None, force_words_ids=None,  # contrastive, DoLa, constrained
    prompt_lookup_num_tokens=None, assistant_early_exit=None, use_mtp=False,  # assisted generation
    eos_token_id=None, stop_strings=None, max_time=None, token_healing=False,  # stop after max_new_tokens only
    exponential_decay_length_penalty=None,  # a stopping rule too: it pushes towards the EOS token, which is unset
    cache_implementation=None,  # the model's default cache: the cache does not change the function
    return_dict_in_generate=False, output_scores=False, output_logits=False, output_attentions=False,
    output_hidden_states=False,
)


# Texts the written tokenizer must encode and decode as the source's, besides the verification prompts: spaces and
# tabs, new lines, accents, emoji and CJK (byte fallback), digits.
TOKENIZER_PROBES: tuple[str, ...] = (
    "Hello world", "  two leading spaces\n\tand a tab", "line one\n\nline three\r\n", "caf\u00e9 na\u00efve \u00dcber",
    "\U0001f917 \u4e2d\u6587 \u0645\u0631\u062d\u0628\u0627", "3.14159 + 2,718 = 5.85987", "",
)


def check_written_tokenizer(folder: Path, tokenizer, texts: Sequence[str] | None = None) -> None:
    """The tokenizer written to `folder`, loaded as a user loads it (`AutoTokenizer`, no remote code), against the
    source's: vocabulary, special tokens and their ids, chat template, and the ids and decoded text of
    `TOKENIZER_PROBES`, the verification texts (`DEFAULT_PROMPTS` unless `texts`) and the chat prompt. The logits
    check reads token ids the source tokenizer made, so it cannot see a tokenizer that `save_pretrained` wrote
    differently; this can. Raises ValueError naming the first three differences."""
    if tokenizer is None:
        return
    try:
        with logging_level_error():
            written = AutoTokenizer.from_pretrained(folder, trust_remote_code=False)
    except Exception as error:  # the written files do not load at all
        raise ValueError(f"The tokenizer written for the output does not load with AutoTokenizer: "
                         f"{one_line(error)}") from error
    differences = []

    def compare(what: str, expected, found) -> None:
        if expected != found and len(differences) < 3:
            differences.append(f"{what}: the source's {short(expected)}, the written one's {short(found)}")

    compare("vocabulary size (len)", len(tokenizer), len(written))
    compare("vocabulary", tokenizer.get_vocab(), written.get_vocab())
    for name in ("bos_token", "eos_token", "unk_token", "pad_token"):
        compare(name, (getattr(tokenizer, name), getattr(tokenizer, f"{name}_id")),
                (getattr(written, name), getattr(written, f"{name}_id")))
    compare("special tokens", sorted(map(str, tokenizer.all_special_tokens)),
            sorted(map(str, written.all_special_tokens)))
    compare("chat template", tokenizer.chat_template, written.chat_template)
    for text in (*TOKENIZER_PROBES, *(DEFAULT_PROMPTS if texts is None else texts)):
        ids = tokenizer(text)["input_ids"]
        compare(f"ids of {short(text)}", ids, written(text)["input_ids"])
        compare(f"decoded ids of {short(text)}", tokenizer.decode(ids), written.decode(ids))
    if has_default_chat_template(tokenizer) and written.chat_template == tokenizer.chat_template:
        try:
            compare("chat prompt ids", chat_input_ids(tokenizer, CHAT_PROMPT).tolist(),
                    chat_input_ids(written, CHAT_PROMPT).tolist())
        except Exception:  # a template that fails on one message, in any way: `build_prompts` already said so
            pass
    if differences:
        raise ValueError("The tokenizer written for the output, loaded back with AutoTokenizer, differs from the "
                         f"source's: {'; '.join(differences)}. Users of the output would tokenize differently from "
                         "the verification; nothing is written.")


def short(value, limit: int = 80) -> str:
    """`repr(value)` cut to `limit` characters, for messages."""
    text = repr(value)
    return text if len(text) <= limit else text[:limit - 3] + "..."


def top1_agreement(source_logits: torch.Tensor, target_logits: torch.Tensor,
                   tolerance: float) -> tuple[int, int, int]:
    """(positions checked, positions agreeing, positions agreeing of all): argmax agreement where the source's
    top-1/top-2 margin > 2 tol, and at every position (what a relaxed report shows beside it)."""
    top2 = source_logits.topk(2, dim=-1)  # values, indices [..., 2]
    decided = (top2.values[..., 0] - top2.values[..., 1]) > 2 * tolerance
    same = target_logits.argmax(-1) == top2.indices[..., 0]
    return int(decided.sum()), int((decided & same).sum()), int(same.sum())


def has_default_chat_template(tokenizer) -> bool:
    """Whether `apply_chat_template` has a template to use without being told one: a template, or named templates
    with a "default" (a tokenizer with named templates only, as some GGUF files hold, needs `chat_template=NAME`)."""
    template = getattr(tokenizer, "chat_template", None)
    return isinstance(template, str) or (isinstance(template, dict) and "default" in template)


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
        if ids.shape[1] == 0:
            raise ValueError(f"The verification prompt text-{index} ({text!r}) tokenizes to no tokens; every prompt must "
                             "encode to at least one token.")
        prompts.append((f"text-{index}", ids))
    if isinstance(tokenizer.chat_template, dict) and not has_default_chat_template(tokenizer):
        logger.warning(f"The tokenizer has named chat templates only ({', '.join(tokenizer.chat_template)}), no "
                       "default one: the chat prompt is left out of the verification.")
    if has_default_chat_template(tokenizer):
        # The source's template (chat_template.jinja or tokenizer_config.json of a folder, tokenizer.chat_template of a
        # GGUF file) renders one user message, or fails in any way a template can: jinja2's errors, its
        # raise_exception, or Python's inside it (`content + 1`: a TypeError; a division by zero). Either way, or
        # when it renders to no tokens, the chat prompt is left out, with a warning: it is the source's own template.
        ids, failure = one_message_chat(tokenizer)
        if ids is None:
            logger.warning(f"The source's chat template {failure}; the chat prompt is left out of the verification.")
        else:
            prompts.append(("chat: " + CHAT_PROMPT, ids))
    for name, ids in prompts:  # an id past the embedding has no row to read, in the source as in the conversion
        if ids.max() >= vocab_size:
            token = tokenizer.convert_ids_to_tokens(int(ids.max()))
            raise ValueError(
                f"The tokenizer encodes the verification prompt {name} to token id {int(ids.max())} ({token!r}), but "
                f"the model has no embedding row for it: the tokenizer has {len(tokenizer)} tokens and the source "
                f"config's vocab_size is {vocab_size} (tokens added to the tokenizer without resizing the embeddings?). "
                "Resize them (model.resize_token_embeddings(len(tokenizer))) and save the model, or use the tokenizer "
                "that matches its weights."
            )
    return prompts


def one_message_chat(tokenizer) -> tuple[torch.Tensor | None, str]:
    """The tokenizer's default chat template applied to one user message (`CHAT_PROMPT`): (input_ids [1, T], ""), or
    (None, what went wrong) when the template fails or renders no tokens."""
    try:
        text = chat_text(tokenizer, CHAT_PROMPT)
    except Exception as error:
        return None, f"fails on one user message ({type(error).__name__}: {one_line(error)})"
    ids = tokenizer(text, add_special_tokens=False, return_tensors="pt")["input_ids"]
    return (ids, "") if ids.shape[1] else (None, "renders one user message to no tokens")


def chat_text(tokenizer, message: str, template: str | None = None) -> str:
    """The chat template (the default one, or the named `template`) applied to one user message, ready for
    generation, as text."""
    return tokenizer.apply_chat_template([{"role": "user", "content": message}], add_generation_prompt=True,
                                         tokenize=False, chat_template=template)


def chat_input_ids(tokenizer, message: str, template: str | None = None) -> torch.Tensor:
    """The chat template applied to one user message, ready for generation: input_ids [1, T]."""
    return tokenizer(chat_text(tokenizer, message, template), add_special_tokens=False,
                     return_tensors="pt")["input_ids"]


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
def greedy_divergence(source_model, target_model, input_ids: torch.Tensor, source_tokens, target_tokens):
    """Where two greedy continuations of `input_ids` [1, T] first differ: (index of the new token, the source's
    top-1/top-2 logit margin there, the models' max abs logit difference there), from one unpadded forward of each
    model over the prompt and the tokens both chose before it; None where they do not differ (or did not run)."""
    if source_tokens is None or source_tokens == target_tokens:
        return None
    index = next((i for i, (a, b) in enumerate(zip(source_tokens, target_tokens)) if a != b),
                 min(len(source_tokens), len(target_tokens)))
    ids = torch.cat([input_ids, torch.tensor([source_tokens[:index]], dtype=input_ids.dtype)], dim=1)
    device = next(source_model.parameters()).device
    source_logits = source_model(ids.to(device), use_cache=False).logits[0, -1].double().cpu()  # [V]
    target_device = next(target_model.parameters()).device
    target_logits = target_model(ids.to(target_device), use_cache=False).logits[0, -1].double().cpu()
    top = source_logits.topk(2).values
    return index, float(top[0] - top[1]), float((target_logits - source_logits).abs().max())


# The name `generate` takes a cache under: `cache` from transformers 5.24, where `past_key_values` warns. generate's
# own signature hides it in **kwargs; the method it hands the cache to names it.
GENERATE_CACHE_KEYWORD = cache_keyword(GenerationMixin.prepare_inputs_for_generation)


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

    End-of-sequence does not stop generation, so every one of the tokens is compared; whatever the model's generation
    config says, the search is plain greedy (`GREEDY_SEARCH`).
    """
    length = max(ids.shape[1] for ids in prompts)
    input_ids = torch.full((len(prompts), length), pad_token_id, dtype=torch.long)  # [N, T]
    attention_mask = torch.zeros_like(input_ids)  # [N, T]
    for row, ids in enumerate(prompts):
        input_ids[row, length - ids.shape[1] :] = ids[0]
        attention_mask[row, length - ids.shape[1] :] = 1
    # An MoE config that records router logits (its training adds the auxiliary loss) makes transformers' generate
    # compute that loss over the padded batch, which fails; decoding needs neither.
    no_router_logits = {"output_router_logits": False} if getattr(model.config, "output_router_logits", False) else {}
    # A window the model's attention ignores would still trim the cache generate builds from its config; a cache made
    # without the config keeps every token, so the continuation is the model's forward, which the conversion keeps.
    full_cache = {GENERATE_CACHE_KEYWORD: DynamicCache()} if cache_only_windows(model.config) else {}
    output = model.generate(
        input_ids,
        attention_mask=attention_mask,
        max_new_tokens=max_new_tokens,
        pad_token_id=pad_token_id,
        **GREEDY_SEARCH,
        **no_router_logits,
        **full_cache,
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
    logit_pairs, first_nonfinite = [], None
    for name, input_ids in prompts:
        # No KV cache: a cache built from a config that windows its layers fails or trims where the forward does not
        pair = (source_model(input_ids, use_cache=False).logits.double(),  # [1, T, V] each
                target_model(input_ids, use_cache=False).logits.double())
        for role, model, logits in zip(("source", "converted"), (source_model, target_model), pair):
            if first_nonfinite is None and not torch.isfinite(logits).all():
                first_nonfinite = f"{role} {first_nonfinite_module(model, input_ids)}"
        logit_pairs.append(pair)
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
                greedy_divergence(source_model, target_model, input_ids, source_tokens, target_tokens),
            )
        )
    return VerificationReport(
        dtype=str(dtype).removeprefix("torch."),
        tolerance=tolerance,
        default_tolerance=default_tolerance,
        max_new_tokens=max_new_tokens,
        checks=checks,
        first_nonfinite=first_nonfinite,
        unreached=unreached_settings(target_model.config, checks, max_new_tokens),
    )


def unreached_settings(config, checks: Sequence[PromptCheck], max_new_tokens: int) -> str:
    """The settings of `config` that act only on sequences longer than the longest one checked (its prompt, and
    the tokens greedy decoding added): a sliding window no sequence exceeds, a dynamic rope's scaling past
    `max_position_embeddings`, longrope's long factors past its original length. The check cannot have seen them;
    the report says so, in a sentence (empty when there are none)."""
    longest = max((check.num_tokens + (max_new_tokens if check.greedy_identical is not None else 0)
                   for check in checks), default=0)
    found = []
    window = getattr(config, "sliding_window", None)
    if window is not None and longest <= window:
        found.append(f"sliding_window={window}")
    rope = getattr(config, "rope_parameters", None) or {}
    kind = rope.get("rope_type", rope.get("type"))
    if kind == "dynamic" and longest <= config.max_position_embeddings:
        found.append(f"the dynamic rope's scaling past max_position_embeddings={config.max_position_embeddings}")
    if kind == "longrope":
        original = rope.get("original_max_position_embeddings") or config.max_position_embeddings
        if longest <= original:
            found.append(f"longrope's long factors past original_max_position_embeddings={original}")
    if not found:
        return ""
    return (f"Not exercised, since no checked sequence reaches them (the longest has {longest} tokens): "
            f"{'; '.join(found)}; the converted config sets them as the source's does.")


@torch.no_grad()
def first_nonfinite_module(model: PreTrainedModel, input_ids: torch.Tensor) -> str:
    """The first module of `model`'s backbone (embedding, decoder layer, final readout or norm) whose output holds
    a NaN or infinity on `input_ids`, in forward order; "LM head" when only the logits do."""
    found = []

    def watch(name: str):
        def hook(module, args, output) -> None:
            if not all_finite(output):
                found.append(name)
        return hook

    watched = [(name, module) for name, module in model.model.named_modules()
               if name in ("embed_tokens", "final_readout", "norm") or re.fullmatch(r"layers\.\d+", name)]
    hooks = [module.register_forward_hook(watch(name)) for name, module in watched]
    try:
        model(input_ids, use_cache=False)
    finally:
        for hook in hooks:
            hook.remove()
    return f"model.{found[0]}" if found else "LM head"


def _load_full_source(source: Source, dtype: torch.dtype) -> PreTrainedModel:
    if source.model is not None:
        return cast_model(source.model, dtype)
    # The random initialisation, overwritten below, must not advance the caller's generator: a script that seeds torch,
    # converts and then trains drew another stream after a folder or GGUF conversion than after an in-memory one.
    with logging_level_error(), torch.random.fork_rng(devices=[]):
        model = AutoModelForCausalLM.from_config(plain_config(source.config), dtype=dtype, attn_implementation="sdpa")
    # As `from_pretrained(source)` would: its generation_config.json (repetition_penalty, no_repeat_ngram_size, ...
    # apply to greedy decoding too), the same file the written folder carries and `from_pretrained(folder)` loads.
    model.generation_config = copy.deepcopy(source.generation_config)
    state = to_model_layout({name: source.checkpoint.read(name).to(dtype) for name in source.checkpoint.infos()})
    result = model.load_state_dict(state, strict=False)
    tied = ["lm_head.weight"] if source.config.tie_word_embeddings else []
    if result.unexpected_keys or set(result.missing_keys) - set(tied):
        raise ValueError(f"{source.location}: the weights do not load into {type(model).__name__}: {result}.")
    return model.eval()


@torch.no_grad()
def verify_written(
    source: Source,
    target: TargetKind,
    folder: Path,
    prompts: Sequence[tuple[str, torch.Tensor]],
    dtype: torch.dtype,
    options: ConversionOptions = ConversionOptions(),
) -> VerificationReport:
    """Verify the conversion written in `folder` against the source: layer-streamed logits in `dtype` (max |logit
    difference|, teacher-forced top-1 agreement), and full greedy continuations of both models (the written one
    loaded by `from_pretrained`) when `options.full_greedy`, or by default when both fit in `FULL_GREEDY_MAX_BYTES`.

    In float64 both models' RMSNorms compute in float64 (`norms_in_input_dtype`), as in `verify_conversion`."""
    default_tolerance = DEFAULT_TOLERANCES[dtype]
    tolerance = default_tolerance if options.tolerance is None else options.tolerance
    full_greedy, max_new_tokens = options.full_greedy, options.max_new_tokens
    written = SafetensorsCheckpoint(folder, written=True)
    try:
        target_config = AutoConfig.from_pretrained(folder, trust_remote_code=False)
        source_meta = meta_model(AutoModelForCausalLM, plain_config(source.config))
        target_meta = meta_model(target.model_class, target_config)
        for model in (source_meta, target_meta):
            set_experts_for(model, dtype)
        float64 = dtype == torch.float64
        caller_logits = None
        if source.model is not None:  # an in-memory source: the caller's own model, not one rebuilt from its state
            caller_logits = in_memory_source_logits(source.model, [ids for _, ids in prompts], dtype)
        with norms_in_input_dtype(source_meta, target_meta) if float64 else contextlib.nullcontext():
            comparison = streamed_logit_statistics(
                StreamedModel(source_meta, source.checkpoint, to_model_layout),
                StreamedModel(target_meta, written),
                [ids for _, ids in prompts],
                dtype,
                options.progress,
                caller_logits,
            )
        greedy_skipped = ("none asked for: max new tokens 0" if max_new_tokens == 0
                          else "turned off (--full-greedy off)" if full_greedy is False
                          else "both models do not fit in memory together")
        if full_greedy is None:
            sizes = [info.nbytes // info.dtype.itemsize * dtype.itemsize
                     for checkpoint in (source.checkpoint, written) for info in checkpoint.infos().values()]
            full_greedy = sum(sizes) <= FULL_GREEDY_MAX_BYTES
        continuations, divergences = [[None] * len(prompts)] * 2, [None] * len(prompts)
        if full_greedy and max_new_tokens > 0:
            continuations, divergences = _full_greedy(source, folder, prompts, dtype, max_new_tokens, options.progress)
    finally:
        written.close()
    checks = []
    for (name, input_ids), stats, source_tokens, target_tokens, divergence in zip(
        prompts, comparison.statistics, *continuations, divergences
    ):
        checks.append(
            PromptCheck.of(
                name, input_ids, stats.max_abs_logit, stats.max_abs_logit_difference, stats.top1_agreement(tolerance),
                source_tokens, target_tokens, divergence,
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
        first_nonfinite=comparison.first_nonfinite,
        greedy_skipped=greedy_skipped,
        unreached=unreached_settings(target_config, checks, max_new_tokens if full_greedy else 0),
    )


# Rows compared per step by `check_written_tensors`: not the writer's chunk (`write.CHUNK_BYTES`), so that a write
# that went wrong at its chunk boundaries is not read back through the same boundaries.
CHECK_CHUNK_BYTES = 24 * 2**20


def check_written_tensors(folder: Path, plans: Mapping[str, TensorPlan], checkpoint: Checkpoint,
                          progress: bool = False) -> None:
    """Every tensor written to `folder` holds its plan's values bit for bit: each source part read again in row
    chunks, cast to the storage dtype and compared byte by byte with the written file; a transformed or new tensor
    computed again whole (as its write computes it). The logit check sees only what its prompts reach: embedding rows
    of tokens no prompt holds, experts no prompt token is routed to. Raises `VerificationError` naming the tensor and
    its first differing row. The written headers are checked too: the planned tensors and no others, each with its
    planned dtype and shape (the bytes alone would pass a tensor whose header names another dtype or shape)."""
    written = SafetensorsCheckpoint(folder, written=True)
    bar = logging.tqdm(total=len(plans), desc="Comparing the written tensors", unit="tensor", disable=not progress)
    try:
        infos = checkpoint.infos()
        headers = written.infos()
        unplanned, absent = sorted(set(headers) - set(plans)), sorted(set(plans) - set(headers))
        if unplanned or absent:
            raise VerificationError(
                f"The output folder's weights files hold other tensors than the conversion planned ("
                + "; ".join(([f"not planned: {', '.join(map(repr, unplanned[:3]))}"] if unplanned else [])
                            + ([f"absent: {', '.join(map(repr, absent[:3]))}"] if absent else []))
                + "): nothing was written. The write is corrupt (a bug or a fault of the disk; please report it).", None
            )
        for name, plan in plans.items():
            bar.update()
            header = headers[name]
            if header.dtype != plan.dtype or tuple(header.shape) != tuple(plan.shape):
                _corrupt(name, plan, f"its header ({str(header.dtype).removeprefix('torch.')} {list(header.shape)} "
                                     f"where {list(plan.shape)} was planned)")
            if plan.value is not None or plan.transform is not None:
                expected = materialise(plan, checkpoint).contiguous()
                found = written.read(name)
                if not torch.equal(expected.view(-1).view(torch.uint8), found.reshape(-1).view(torch.uint8)):
                    _corrupt(name, plan, "its computed values")
                continue
            offset = 0  # into the written tensor's bytes: its parts one after another
            for part in plan.parts:
                info = infos[part]
                rows = info.shape[0] if info.shape else 1
                row_bytes = math.prod(info.shape[1:]) * plan.dtype.itemsize if info.shape else plan.dtype.itemsize
                step = max(1, CHECK_CHUNK_BYTES // max(1, row_bytes))
                for start in range(0, rows, step):
                    expected = checkpoint.read(part, slice(start, start + step) if info.shape else None)
                    expected = expected.to(plan.dtype).contiguous().reshape(-1).view(torch.uint8)
                    if not expected.numel():
                        continue
                    found = torch.frombuffer(written.read_bytes(name, offset, expected.numel()), dtype=torch.uint8)
                    if not torch.equal(expected, found):
                        differing = int((expected != found).nonzero()[0]) // max(1, row_bytes)
                        _corrupt(name, plan, f"source tensor {part!r}, row {start + differing}")
                    offset += expected.numel()
    finally:
        bar.close()
        written.close()


def _corrupt(name: str, plan: TensorPlan, where: str) -> None:
    raise VerificationError(
        f"The written tensor {name!r} differs from the conversion's plan at {where} (read back from the output "
        f"folder, {str(plan.dtype).removeprefix('torch.')}, and compared with the source read again): nothing was "
        "written. Either the source's files changed while the conversion read them (a download or a save into the "
        "source folder still running: convert again once it is done), or the write is corrupt (a bug or a fault of "
        "the disk; please report it).", None
    )


@torch.no_grad()
def in_memory_source_logits(model: PreTrainedModel, prompts: Sequence[torch.Tensor], dtype: torch.dtype) -> list:
    """The logits [T_i, V] of an in-memory source on each prompt, from the model object itself (in `dtype`,
    `cast_model`; its norms in float64 for a float64 check): what the written conversion must reproduce. A model
    rebuilt from its config and state dict computes something else where the object does not follow them (a config
    edited after construction, a forward hook, rotary frequencies rounded by `model.to(dtype)`), and a check against
    the rebuild passed conversions 3 logits away from the caller's model."""
    model = cast_model(model, dtype)  # a copy wherever it must change: never the caller's model changed
    device = next(model.parameters()).device
    with norms_in_input_dtype(model) if dtype == torch.float64 else contextlib.nullcontext():
        return [model(ids.to(device), use_cache=False).logits[0].to("cpu", dtype) for ids in prompts]


def _full_greedy(source, folder, prompts, dtype, max_new_tokens, progress) -> tuple[list[list[list[int]]], list]:
    """Greedy continuations of the source and of the written folder loaded by `from_pretrained`, in `dtype`, and
    where each prompt's continuations first differ (`greedy_divergence`)."""
    source_model = _load_full_source(source, dtype)
    with logging_level_error():
        target_model = AutoModelForCausalLM.from_pretrained(folder, dtype=dtype, trust_remote_code=False).eval()
    set_experts_for(source_model, dtype)
    set_experts_for(target_model, dtype)
    continuations = []
    with norms_in_input_dtype(source_model, target_model) if dtype == torch.float64 else contextlib.nullcontext():
        for role, model in (("source", source_model), ("converted", target_model)):
            description = f"Greedy decoding, {role} model ({len(prompts)} prompts)"
            continuations.append(
                greedy_continuations(model, [ids for _, ids in prompts], max_new_tokens, 0, description, progress)
            )
        divergences = [greedy_divergence(source_model, target_model, ids, source_tokens, target_tokens)
                       for (_, ids), source_tokens, target_tokens in zip(prompts, *continuations)]
    return continuations, divergences


def raise_unless_passed(
    report: VerificationReport, storage_dtype: torch.dtype, source: Checkpoint | None = None, hint: str = "",
    note: str = "", changed: set[str] | None = None,
) -> None:
    """Raise `VerificationError` unless the report passed. With the `source` checkpoint, the hint names the source
    tensors that `storage_dtype` rounded (`rounded_tensors`) and the dtype that stores every tensor of the source
    exactly (`exact_storage_dtype`), of them those whose values the write changed when it says (`changed`); a `hint`
    given replaces the guess about rounding; a `note` follows either."""
    if report.passed:
        if report.relaxed:  # (a failed check's table says RELAXED; no card is written for it)
            logger.warning(
                f"Verification tolerance relaxed to {report.tolerance:.1e} (default {report.default_tolerance:.1e} "
                f"in {report.dtype}); greedy mismatches are reported, not refused. The model card says so."
            )
        return
    storage = str(storage_dtype).removeprefix("torch.")
    rounded = rounded_tensors(source, storage_dtype) if source is not None else []
    if changed is not None:
        rounded = [(name, dtype) for name, dtype in rounded if name in changed]
    if hint:
        hint = f"\n{hint}"
    elif rounded and not report.relaxed:
        exact_dtype = exact_storage_dtype(source)
        names = ", ".join(name for name, _ in rounded[:3]) + (" ..." if len(rounded) > 3 else "")
        hint = (
            f"\n{len(rounded)} source tensor(s) hold values that {storage} rounds ({names}); --dtype "
            f"{str(exact_dtype).removeprefix('torch.')} (dtype={exact_dtype}) stores every tensor exactly, and --dtype "
            "auto (the default) keeps each as the source stores it. A larger "
            "tolerance (--tolerance) would accept the rounding instead, which the model card records."
        )
    elif storage_dtype in (torch.bfloat16, torch.float16) and not report.relaxed and changed is None:
        # (with `changed` from the write, the branch above named what was rounded, if anything was)
        hint = (
            f"\nThe weights were rounded to {str(storage_dtype).removeprefix('torch.')}, which moves the logits beyond "
            "the bar; pass a larger tolerance (--tolerance) to accept a lower bar, which the model card records."
        )
    hint = hint or _large_logits_hint(report)
    headline = "The converted model does not reproduce the source"
    if report.nothing_compared:
        headline = f"The converted model could not be verified ({report.nothing_compared})"
    note = f"\n{note}" if note else ""
    raise VerificationError(f"{headline}; nothing was written.\n{report.table()}{hint}{note}", report)


def _large_logits_hint(report: VerificationReport) -> str:
    """What to say of a float32 check that failed on its logit bar alone, by a difference within float32's relative
    rounding of the largest logit (1e-5 of it; the default bar, 2e-4, is 4e-6 of SmolLM2's largest, 45): the top-1
    check and the greedy continuations agree, so the bar, absolute, is what a model with large logits misses. ""
    for any other failure."""
    difference = report.max_abs_logit_difference
    largest = max((check.max_abs_logit for check in report.checks), default=0.0)
    if not (report.dtype == "float32" and not report.relaxed and report.first_nonfinite is None
            and report.nothing_compared is None and report.greedy_identical and math.isfinite(difference)
            and largest > 0 and difference <= 1e-5 * largest):
        return ""
    return (f"\nEvery compared next token agrees and the greedy continuations are identical: the difference "
            f"{difference:.1e} is {difference / largest:.0e} of the largest logit ({largest:.1f}), the size "
            f"{report.dtype} rounding of two summation orders reaches at logits that large. --verify-dtype float64 "
            "measures the conversion without that rounding; a larger tolerance (--tolerance) would accept it "
            "instead, which the model card records.")


__all__ = [
    "DEFAULT_PROMPTS",
    "build_prompts",
    "check_written_tokenizer",
    "chat_input_ids",
    "check_written_tensors",
    "greedy_continuations",
    "greedy_divergence",
    "norms_in_input_dtype",
    "raise_unless_passed",
    "verify_conversion",
    "verify_written",
]
