# SPDX-License-Identifier: Apache-2.0
# Copyright 2026 The dar-transformers authors.
"""The `dar` command: `dar convert SOURCE OUTPUT [...]`, `dar generate FOLDER [...]`, `dar analyze MODEL [...]`.

`convert` upcycles an HF folder or a GGUF file into DAR as a file operation (see `dar_transformers.convert`),
verifies the written folder layer by layer, prints the verification table and moves the Hub-ready folder into place; `generate` streams a (chat) answer from any causal-LM folder.

A user error is one line on stderr and exit code 1 (a failed verification: its table, exit code 2; a flag value of
the wrong type or outside its choices: argparse's usage line and error, exit code 2). SIGTERM and
SIGHUP interrupt like Ctrl-C (SIGINT): the staging folder is removed, one line says so, and the exit code is 128 +
the signal's number.
"""

import argparse
import contextlib
import os
import re
import signal
import sys
import threading
from collections.abc import Sequence
from pathlib import Path

from .analysis import add_arguments as add_analyze_arguments
from .analysis import at_least, check_token_ids
from .analysis import run_command as run_analyze
from .configuration_dar import DAR_ROUTINGS, DAR_WRITE_MODES
from .conversion.sources import gguf_parsed_once, source_model_type
from .convert import DTYPES, MOE_SOURCE_FAMILIES, TARGET_KINDS, VerificationError, upcycle
from .moe_upcycling import upcycle_to_dar_moe  # also registers --kind dar_moe

# CLI option -> target config field. Other kinds (the MoE variant) add their options and rows here.
CONVERT_FIELD_OPTIONS: dict[str, str] = {
    "block_size": "dar_block_size",
    "routing": "dar_routing",
    "streams": "dar_num_streams",
    "write_mode": "dar_write_mode",
}


def _shard_size(text: str) -> str | int:
    """`--max-shard-size`: a plain number is bytes (the API's int); anything else goes to the API as written, which
    takes transformers' sizes ('2GB', '500MB') and refuses the rest naming the flag."""
    return int(text) if text.isascii() and text.isdigit() else text


def _layer_list(text: str) -> list[int]:
    """`--mlp-only-layers 0,3`: layer indices, comma-separated (an empty string: none), each once."""
    try:
        layers = [int(part) for part in text.split(",") if part.strip()]
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a comma-separated list of layer indices (e.g. 0,3)") \
            from None
    repeated = sorted({layer for layer in layers if layers.count(layer) > 1})
    if repeated:
        raise argparse.ArgumentTypeError(f"{text!r} lists layer {', '.join(map(str, repeated))} more than once")
    return layers


def add_convert_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("source", help="an HF model folder (safetensors) or a .gguf file; a dense DAR folder converts "
                        "to DAR-MoE (--experts/--top-k), keeping its DAR parameters")
    parser.add_argument(
        "output", help="the folder to write: new or empty (or a previous conversion output with --overwrite); never the "
        "source, inside it or around it",
    )
    parser.add_argument("--kind", default=None, choices=sorted(TARGET_KINDS),
                        help="target model kind (default: dar; dar_moe with --experts/--top-k/--expert-noise, and for "
                             "a mixture-of-experts source)")
    parser.add_argument(
        "--block-size", type=int, default=None,
        help="DAR block size K in branches (2 per layer); 1 = Full DAR; default: about 8 blocks",
    )
    parser.add_argument("--routing", choices=DAR_ROUTINGS, default=None, help="depth routing (default: dar)")
    parser.add_argument("--streams", type=int, choices=(1, 2), default=None,
                        help="residual streams (1 = AttnRes; default: 2, or a DAR source's own)")
    parser.add_argument("--write-mode", choices=DAR_WRITE_MODES, default=None,
                        help="stream write mode (default: duplicate, or a DAR source's own)")
    parser.add_argument(
        "--dtype", choices=["auto", *DTYPES], default="auto",
        help="storage dtype of the shared weights (default: the source's own); DAR's new parameters stay float32",
    )
    parser.add_argument(
        "--verify-dtype", choices=["float32", "float64"], default=None,
        help="dtype the verification computes in, whatever the storage dtype (default: float32, float64 for "
        "float64 weights)",
    )
    parser.add_argument(
        "--full-greedy", choices=["auto", "on", "off"], default="auto",
        help="full greedy continuations of both models (needs both in memory; auto: when both fit in 3 GiB in the "
        "verification dtype). Teacher-forced top-1 agreement is checked either way",
    )
    parser.add_argument(
        "--experts", type=int, default=None,
        help="DAR-MoE (implies --kind dar_moe): sparse-upcycle each dense MLP into E identical experts",
    )
    parser.add_argument("--top-k", type=int, default=None, help="DAR-MoE: experts per token (weights renormalised)")
    parser.add_argument(
        "--mlp-only-layers", type=_layer_list, default=None, metavar="L[,L...]",
        help="DAR-MoE upcycling: layers (0-based) that keep their dense MLP, e.g. 0,1 (as Qwen2/3-MoE's field)",
    )
    parser.add_argument(
        "--decoder-sparse-step", type=int, default=None, metavar="N",
        help="DAR-MoE upcycling: only every N-th layer (layer l with (l + 1) %% N == 0) becomes sparse; the others "
        "keep their dense MLP (default 1: every layer)",
    )
    parser.add_argument(
        "--expert-noise", type=float, default=0.0,
        help="DAR-MoE: Drop-Upcycling share in [0, 1] of each expert's hidden units re-initialised to break expert "
        "symmetry; the result is NOT exact, so the check only reports differences unless --tolerance is given",
    )
    parser.add_argument(
        "--expert-seed", type=int, default=None, metavar="N",
        help="DAR-MoE with --expert-noise: the seed of the re-drawn hidden units (default 0; the model card records "
        "it, so that the same command redraws the same experts)",
    )
    parser.add_argument(
        "--tolerance", type=float, default=None,
        help="max abs logit difference allowed (default 2e-4 in float32, 1e-8 in float64); a larger value relaxes "
        "the check, e.g. for a conversion that rounds float32 weights to bfloat16, and the model card says so",
    )
    parser.add_argument(
        "--max-new-tokens", type=int, default=64,
        help="greedy tokens compared per prompt (0: no full greedy continuations; default: 64)",
    )
    parser.add_argument(
        "--max-shard-size", default="2GB", type=_shard_size,
        help="safetensors shard size: with a unit ('2GB', '500MB', '5GiB') or a number of bytes",
    )
    parser.add_argument("--base-model", default=None, help="Hub id of the source, for the model card")
    parser.add_argument(
        "--overwrite", action="store_true",
        help="replace a previous conversion output exactly as the conversion left it (every file listed, unchanged, "
        "in its .dar-convert-manifest.json; nothing added), only once the new one is written and verified; never "
        "the source or a folder around or inside it",
    )


def given_flags(args: argparse.Namespace) -> list[str]:
    """The value flags of `dar convert` (`OPTION_FLAGS`) set on the command line: those not at their defaults (each
    flag's own: `--max-shard-size 0` is given, though 0 == 0.0, --expert-noise's default)."""
    defaults = {"--expert-noise": 0.0, "--max-shard-size": "2GB"}  # any other flag: None, unset
    return [flag for flag in OPTION_FLAGS.values()
            if getattr(args, flag.removeprefix("--").replace("-", "_"), None) not in (None, defaults.get(flag))]


def convert_fields(args: argparse.Namespace) -> dict:
    """The target config fields given on the command line (unset options keep the config defaults)."""
    return {field: getattr(args, option) for option, field in CONVERT_FIELD_OPTIONS.items() if getattr(args, option) is not None}


def is_moe_source(source: str) -> bool:
    """Whether `source` is a mixture-of-experts model (Mixtral, Qwen2/Qwen3-MoE), which converts to DAR-MoE only: then
    `dar convert` without --kind makes DAR-MoE, and says so. A source whose model_type cannot be read is not one here;
    the conversion then refuses it with the reason."""
    model_type = source_model_type(source)
    if model_type in MOE_SOURCE_FAMILIES:
        print(f"dar convert: the source is a mixture of experts (model_type {model_type!r}), which converts to DAR-MoE "
              "only: --kind dar_moe.", file=sys.stderr, flush=True)
        return True
    return False


@gguf_parsed_once()  # the MoE check's reading of a GGUF source is the conversion's too
def run_convert(args: argparse.Namespace) -> int:
    # "~/model-dar" quoted, so that the shell left it: the home folder, as `dar generate` reads it (a folder named "~"
    # in the working directory, which `dar generate ~/model-dar` then did not find, was written instead)
    args.source, args.output = os.path.expanduser(args.source), os.path.expanduser(args.output)
    if args.max_new_tokens < 0:
        return convert_error(f"--max-new-tokens must be 0 (no greedy continuations) or more, got {args.max_new_tokens}.")
    moe_flags = [flag for flag, value in (("--experts", args.experts), ("--top-k", args.top_k),
                                          ("--expert-noise", args.expert_noise or None),
                                          ("--mlp-only-layers", args.mlp_only_layers),
                                          ("--decoder-sparse-step", args.decoder_sparse_step)) if value is not None]
    if args.expert_seed is not None and not args.expert_noise:
        return convert_error("--expert-seed seeds the hidden units that --expert-noise re-draws when it upcycles a "
                             "dense model; without --expert-noise nothing is random (sparse upcycling copies the MLP "
                             "exactly, and an MoE source keeps its experts): leave --expert-seed out.")
    if moe_flags and args.kind not in (None, "dar_moe"):
        return convert_error(f"{', '.join(moe_flags)} {'make' if len(moe_flags) > 1 else 'makes'} a DAR-MoE model, which "
                             f"contradicts --kind {args.kind}; pass --kind dar_moe or leave --kind out.")
    kind = args.kind or ("dar_moe" if moe_flags or is_moe_source(args.source) else "dar")
    convert_function, kind_options = upcycle, {"kind": kind}
    if kind == "dar_moe":
        convert_function = upcycle_to_dar_moe
        kind_options = {"num_experts": args.experts, "top_k": args.top_k, "expert_noise": args.expert_noise,
                        "seed": args.expert_seed or 0}
        kind_options.update({field: getattr(args, field) for field in ("mlp_only_layers", "decoder_sparse_step")
                             if getattr(args, field) is not None})
    try:
        result = convert_function(
            args.source,
            args.output,
            **kind_options,
            dtype=args.dtype,
            verify_dtype=args.verify_dtype,
            full_greedy={"auto": None, "on": True, "off": False}[args.full_greedy],
            tolerance=args.tolerance,
            max_new_tokens=args.max_new_tokens,
            max_shard_size=args.max_shard_size,
            base_model=args.base_model,
            overwrite=args.overwrite,
            **convert_fields(args),
        )
    except KeyboardInterrupt as interrupt:  # `upcycle` says whether its output was in place; none before it opened one
        interrupt.output_written = getattr(interrupt, "output_written", False)
        raise
    except VerificationError as error:
        print(error, file=sys.stderr)
        return 2
    except (ValueError, TypeError, OSError) as error:  # OSError: permission, read-only, no space, missing, ...
        return convert_error(named_by_flag(str(error), given_flags(args)))
    except (MemoryError, RuntimeError) as error:  # the conversion stopped before its output was put in place
        if not isinstance(error, MemoryError) and not OUT_OF_MEMORY.search(str(error)):
            raise  # a defect: its traceback is what a report needs
        return convert_error(f"out of memory ({' '.join(str(error).split())[:300] or type(error).__name__}); nothing "
                             "was written. Free memory, or pass --full-greedy off (its continuations hold both "
                             "models in memory; the rest of the conversion holds a tensor and a layer at a time).")
    try:
        print(result.report.table())
        config = result.config
        print(f"\nWrote {result.output} (block size {config.dar_block_size} of {config.dar_num_branches} branches).",
              flush=True)
    except KeyboardInterrupt as interrupt:
        interrupt.output_written = True
        raise
    except OSError as error:  # the conversion is done and in place; only its report was lost
        report_not_printed("dar convert", result.output, "its report", error)
    return 0


def report_not_printed(command: str, output, what: str, error: OSError) -> None:
    """A command whose `output` is written could not print its report (`what`) to standard output: `| head` (a
    closed pipe), `> log` on a full disk, `> /dev/full`. Standard output goes to /dev/null and one line on standard
    error says what was written and why the report is missing; the command still succeeded."""
    reason = ("standard output was closed" if isinstance(error, BrokenPipeError) else
              f"writing standard output failed: {error.strerror or error}")
    stdout_closed()
    with contextlib.suppress(OSError):  # `2>&1 | reader`: standard error is the same closed pipe
        print(f"{command}: wrote {output}; {what} was not printed ({reason}).", file=sys.stderr, flush=True)


# torch's allocators' messages (CPU: "DefaultCPUAllocator: can't allocate memory"; CUDA: torch.OutOfMemoryError's)
OUT_OF_MEMORY = re.compile(r"can't allocate memory|out of memory", re.IGNORECASE)

# The API's name of each value `dar convert` passes -> its flag: an API error about one of them names the flag too.
OPTION_FLAGS = {
    "tolerance": "--tolerance", "max_shard_size": "--max-shard-size", "base_model": "--base-model",
    "expert_noise": "--expert-noise", "seed": "--expert-seed", "num_experts_per_tok": "--top-k",
    "num_experts": "--experts",
    "dar_block_size": "--block-size", "dar_routing": "--routing", "dar_num_streams": "--streams",
    "dar_write_mode": "--write-mode", "mlp_only_layers": "--mlp-only-layers",
    "decoder_sparse_step": "--decoder-sparse-step",
}


def named_by_flag(message: str, given: Sequence[str] = ()) -> str:
    """An error message that starts with an option's API name (`tolerance must be ...`, `DARConfig.dar_block_size
    must be ...`), prefixed with the flag it came from, so that the user sees what to change on the command line. A
    message about two fields together (`mlp_only_layers and decoder_sparse_step leave no sparse layer`) names the
    flags of those the user passed (`given`); a value no flag gave (an MoE source's own config field) names none."""
    head = re.match(r"(?:DAR(?:Moe)?Config\.)?([a-z_]+)((?: and [a-z_]+)*)\b", message)
    if head is None:
        return message
    flags = [OPTION_FLAGS[field] for field in (head.group(1), *head.group(2).split(" and ")[1:]) if field in OPTION_FLAGS]
    named = [flag for flag in flags if flag in given]
    return f"{' and '.join(named)}: {message}" if named else message


def close_progress_bars() -> None:
    """Close the progress bars an error or interrupt left open, so that the message that follows has its own line."""
    from tqdm import tqdm

    for bar in list(getattr(tqdm, "_instances", ())):
        bar.close()


def convert_error(error: object) -> int:
    """One line on stderr (a message's own line breaks are folded), exit code 1."""
    close_progress_bars()
    print(f"dar convert: error: {' '.join(str(error).split())}", file=sys.stderr)
    return 1


def add_generate_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("model", help="a DAR (or any causal-LM) model folder")
    parser.add_argument("--prompt", default="What is the capital of France?", help="the user message / text")
    parser.add_argument("--max-new-tokens", type=at_least(1), default=64,
                        help="most tokens of the answer (default: 64)")
    parser.add_argument("--no-chat-template", action="store_true", help="use the prompt as plain text")
    parser.add_argument("--chat-template", default=None, metavar="NAME",
                        help="one of the folder's named chat templates (additional_chat_templates/NAME.jinja) "
                        "instead of its default one")
    parser.add_argument("--temperature", type=at_least(0.0, float), default=0.0,
                        help="0 = greedy; above 0 samples, with the folder's generation settings (top_k, top_p)")
    parser.add_argument("--seed", type=at_least(0, maximum=2**32 - 1), default=None,  # numpy's seed range (set_seed)
                        help="seed of the sampling (--temperature above 0), so that a run can be repeated")
    parser.add_argument("--dtype", choices=list(DTYPES), default="float32",
                        help="the dtype the model computes in (default float32, whatever the folder stores)")


def _cached_on_the_hub(name: str) -> bool:
    """Whether `name` is a Hub id whose config.json is in the local Hub cache."""
    from huggingface_hub import try_to_load_from_cache

    try:
        return isinstance(try_to_load_from_cache(name, "config.json"), str)
    except ValueError:  # not a valid repo id
        return False


TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "tokenizer.model", "vocab.json")


def missing_model_folder(name: str, needs_tokenizer: bool = False) -> str | None:
    """Why `name` cannot be the model folder a command loads (None: an existing folder, or a Hub id): a file (a GGUF,
    a config.json: from_pretrained would say "not a valid JSON file"), a path that is not there, read as a path not a
    Hub id (absolute, relative to ".", ".." or "~", deeper than org/name, or "org/name" where "org" is a folder here,
    `outputs/model-dar` mistyped, and no Hub model of that name is cached: no Hub retries), a folder without
    config.json, or, with `needs_tokenizer`, one without tokenizer files."""
    if not name.strip():  # Path("") is the working folder
        return "the model is an empty path (an unset shell variable?); name the model folder"
    path = Path(name).expanduser()
    if path.is_file():
        return f"{name} is a file; pass a model folder (a GGUF file: convert it with `dar convert` first)"
    if path.is_dir():
        if not (path / "config.json").is_file():
            return f"{name} holds no config.json: not a model folder"
        if needs_tokenizer and not any((path / file).is_file() for file in TOKENIZER_FILES):
            return f"{name} holds no tokenizer ({', '.join(TOKENIZER_FILES)})"
        return None
    first = name.split("/", 1)[0]
    in_local_folder = ("/" in name and first not in ("", ".", "..", "~") and os.path.isdir(first)
                       and not _cached_on_the_hub(name))
    if os.path.isabs(name) or name.startswith((".", "~")) or name.count("/") > 1 or in_local_folder:
        return f"no folder {name}" + (f" ({first}/ is a folder here, so it names a path, not a Hub id)"
                                      if in_local_folder else "")
    return None


def load_error(error: BaseException) -> str:
    """A failed `from_pretrained` in one line: the message of a ValueError or OSError (transformers' own, naming the
    file), a config validator's own message, any other error with its type (a safetensors or a size-mismatch one)."""
    from .conversion.families import one_line

    message = one_line(error)
    plain = isinstance(error, (OSError, ValueError)) or type(error).__name__.startswith("StrictDataclass")
    return message if plain else f"{type(error).__name__}: {message}"


def model_location(name: str) -> str:
    """What `from_pretrained` loads for a model named on the command line: a folder spelled with "~" (quoted, so the
    shell left it) as `missing_model_folder` found it, expanded; any other name as given (a Hub id)."""
    expanded = os.path.expanduser(name)
    return expanded if expanded != name and os.path.isdir(expanded) else name


def run_generate(args: argparse.Namespace) -> int:
    from transformers import AutoModelForCausalLM, AutoTokenizer, TextStreamer, set_seed

    from .conversion.verify import has_default_chat_template
    from .convert import chat_input_ids, resolve_dtype

    problem = missing_model_folder(args.model, needs_tokenizer=True)
    if args.chat_template is not None and args.no_chat_template:
        problem = "--chat-template and --no-chat-template contradict each other; pass one of them"
    if problem is None:
        try:  # the shell hands over bytes that are not UTF-8 as lone surrogates, which no tokenizer encodes
            args.prompt.encode("utf-8")
        except UnicodeEncodeError as error:
            problem = (f"--prompt is not UTF-8 text (byte {ord(args.prompt[error.start]) - 0xDC00:#04x} at character "
                       f"{error.start}); pass the prompt in UTF-8")
    if problem is not None:
        print(f"dar generate: error: {problem}", file=sys.stderr)
        return 1
    location = model_location(args.model)

    def cannot_load(error: Exception) -> int:
        """Any failure of a broken folder (a truncated safetensors file, a config its class refuses): one line."""
        print(f"dar generate: error: cannot load {args.model}: {load_error(error)}", file=sys.stderr)
        return 1

    try:
        tokenizer = AutoTokenizer.from_pretrained(location)
    except Exception as error:
        return cannot_load(error)
    templates = tokenizer.chat_template if isinstance(tokenizer.chat_template, dict) else {}
    if args.chat_template is not None and args.chat_template not in templates:
        named = f"its named ones: {', '.join(sorted(templates))}" if templates else "it has no named chat template"
        print(f"dar generate: error: {args.model} has no chat template named {args.chat_template!r} ({named}).",
              file=sys.stderr)
        return 1
    if templates and not has_default_chat_template(tokenizer) and not args.no_chat_template and not args.chat_template:
        print(f"dar generate: error: {args.model} has named chat templates only ({', '.join(sorted(templates))}), "
              "none of them the default one: pass --chat-template NAME, or --no-chat-template to continue the prompt "
              "as text.", file=sys.stderr)
        return 1
    try:  # the weights only once the prompt's template is settled: a large model takes a while to load
        model = AutoModelForCausalLM.from_pretrained(location, dtype=resolve_dtype(args.dtype)).eval()
    except Exception as error:
        return cannot_load(error)
    if (args.chat_template or has_default_chat_template(tokenizer)) and not args.no_chat_template:
        try:
            input_ids = chat_input_ids(tokenizer, args.prompt, args.chat_template)
        except Exception as error:  # the folder's own template fails (jinja2's errors, raise_exception, Python's)
            print(f"dar generate: error: the chat template of {args.model} fails on the prompt "
                  f"({type(error).__name__}: {' '.join(str(error).split())}); pass --no-chat-template to continue the "
                  "prompt as text.", file=sys.stderr)
            return 1
    else:
        input_ids = tokenizer(args.prompt, return_tensors="pt")["input_ids"]
    if input_ids.shape[-1] == 0:  # generate cannot start from nothing (a reshape error deep in it)
        print("dar generate: error: --prompt gives no tokens (an empty prompt, and the tokenizer adds none): pass some "
              "text.", file=sys.stderr)
        return 1
    try:  # a tokenizer of another model: the embedding raised a bare IndexError
        check_token_ids(input_ids, model.config.vocab_size, args.model)
    except ValueError as error:
        print(f"dar generate: error: {error}", file=sys.stderr)
        return 1
    sampling = {"do_sample": True, "temperature": args.temperature} if args.temperature > 0 else {"do_sample": False}
    if args.seed is not None:
        set_seed(args.seed)
    streamer = TextStreamer(tokenizer, skip_prompt=True, skip_special_tokens=True)
    try:
        with characters_replaced(sys.stdout):
            model.generate(
                input_ids, attention_mask=input_ids.new_ones(input_ids.shape), max_new_tokens=args.max_new_tokens,
                streamer=streamer, **sampling,
            )
    except BrokenPipeError:  # `dar generate ... | head`: the reader has what it wanted; stop as a filter does
        stdout_closed()
    except OSError as error:  # the streamer's print: `> /dev/full`, a log on a full disk (it was a traceback)
        stdout_closed()
        with contextlib.suppress(OSError):
            print(f"dar generate: error: writing standard output failed ({error.strerror or error}); the answer was "
                  "not written in full.", file=sys.stderr)
        return 1
    return 0


@contextlib.contextmanager
def characters_replaced(stream):
    """While the block runs, a character `stream`'s encoding lacks (an accent under PYTHONIOENCODING=ascii, an emoji
    in a cp1252 console) is written as "?" instead of ending in a UnicodeEncodeError traceback; the stream's own
    setting comes back after (`main` may run inside a caller's process)."""
    errors = getattr(stream, "errors", None)
    try:
        stream.reconfigure(errors="replace")
    except (AttributeError, ValueError):  # not a text file of its own (a StringIO), or detached
        errors = None
    try:
        yield
    finally:
        if errors is not None:
            with contextlib.suppress(AttributeError, ValueError, OSError):
                stream.reconfigure(errors=errors)


def stdout_closed() -> None:
    """Standard output was closed by its reader (`| head`) or cannot be written (a full disk): point it at
    /dev/null, so that Python's flush at exit raises no second error."""
    os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="dar", description="Dual Attention Residuals (arXiv 2607.18730) tools")
    commands = parser.add_subparsers(dest="command", required=True)
    convert_parser = commands.add_parser("convert", help="upcycle a Llama/Mistral/Qwen2/Qwen3 model into DAR")
    add_convert_arguments(convert_parser)
    convert_parser.set_defaults(run=run_convert)
    generate_parser = commands.add_parser("generate", help="stream a (chat) answer from a model folder")
    add_generate_arguments(generate_parser)
    generate_parser.set_defaults(run=run_generate)
    analyze_parser = commands.add_parser(
        "analyze", help="depth-weight maps, cross-stream CKA, rescue gain, stream balance of a DAR model (PNGs + JSON)"
    )
    add_analyze_arguments(analyze_parser)
    analyze_parser.set_defaults(run=run_analyze)
    return parser


class Interrupted(KeyboardInterrupt):
    """SIGTERM or SIGHUP, raised like Ctrl-C's KeyboardInterrupt so that the same clean-up runs."""

    def __init__(self, signum: int):
        super().__init__(signal.Signals(signum).name)
        self.signum = signum


@contextlib.contextmanager
def interrupts_raised():
    """While the command runs, SIGTERM and SIGHUP raise `Interrupted` (by default they end the process at once,
    leaving a half-written staging folder behind); the previous handlers come back afterwards."""
    signums = [signal.SIGTERM] + ([signal.SIGHUP] if hasattr(signal, "SIGHUP") else [])
    if threading.current_thread() is not threading.main_thread():
        yield
        return

    def interrupt(signum, frame):
        raise Interrupted(signum)

    interrupt.raises_interrupt = True  # one that a finalizer swallows is raised again (`output.interrupts_kept`)
    previous = {signum: signal.signal(signum, interrupt) for signum in signums}
    try:
        yield
    finally:
        for signum, handler in previous.items():
            signal.signal(signum, handler)


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        with interrupts_raised():
            return args.run(args)
    except KeyboardInterrupt as interrupt:
        output = getattr(args, "output", None) or getattr(args, "out", None)  # convert's, analyze's
        return interrupted(f"dar {args.command}", interrupt, output)


def interrupted(command: str, interrupt: KeyboardInterrupt, output) -> int:
    """Say that `command` was interrupted, and whether its `output` was written (`output_written`, set by
    `run_convert` and `dar analyze`'s writer where they know); the exit status of a process ended by the signal."""
    signum = getattr(interrupt, "signum", signal.SIGINT)
    written = getattr(interrupt, "output_written", None)
    done = "" if written is None else f" after {output} was written" if written else "; nothing was written"
    close_progress_bars()
    print(f"{command}: interrupted by {signal.Signals(signum).name}{done}.", file=sys.stderr)
    return 128 + signum


if __name__ == "__main__":
    sys.exit(main())
