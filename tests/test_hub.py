# SPDX-License-Identifier: Apache-2.0
"""Hub readiness, tested up to the network call: what `push_to_hub` would upload is captured by replacing the
upload client, and that folder must load with `trust_remote_code=True` in a fresh Python process that cannot see
this package, then generate through `pipeline("text-generation")` and `TextStreamer`."""

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
import transformers.trainer
from huggingface_hub.errors import EntryNotFoundError
from test_training import REPOSITORY, load_example, write_docstring_corpus
from transformers import AutoTokenizer

import dar_transformers

PACKAGE_SOURCE = Path(dar_transformers.__file__).resolve().parents[1]  # src/, put on sys.path by the editable install
PROMPT = "The optimizer updates the parameters"


class CapturingHubApi:
    """Stands in for `huggingface_hub.HfApi`: records repo creation and copies every uploaded folder."""

    def __init__(self, capture_dir: Path):
        self.capture_dir = capture_dir
        self.created, self.uploads = [], []

    def create_repo(self, repo_id, **kwargs):
        self.created.append(repo_id)
        return SimpleNamespace(repo_id=repo_id)

    def upload_folder(self, repo_id, folder_path, ignore_patterns=(), **kwargs):
        target = self.capture_dir / f"upload{len(self.uploads)}"
        shutil.copytree(folder_path, target, ignore=shutil.ignore_patterns(*ignore_patterns))
        self.uploads.append((repo_id, target))
        return SimpleNamespace(commit_url=f"https://huggingface.co/{repo_id}/commit/0")


def fine_tune_and_push(tmp_path: Path, *arguments: str) -> tuple[CapturingHubApi, object]:
    """`examples/finetune.py --tiny --push-to-hub` with `arguments`, against the capturing client: (client, trainer)."""
    api = CapturingHubApi(tmp_path / "hub")
    patch = pytest.MonkeyPatch()
    patch.setattr(transformers.trainer, "hf_api", lambda: api)
    patch.setenv("HF_DATASETS_CACHE", str(tmp_path / "datasets"))
    try:
        trainer, _ = load_example("finetune").main([
            "--tiny", "--corpus-dir", str(write_docstring_corpus(tmp_path / "corpus")),
            "--output-dir", str(tmp_path / "run"), "--push-to-hub", *arguments,
        ])
    finally:
        patch.undo()
    return api, trainer


@pytest.fixture(scope="module")
def pushed(tmp_path_factory):
    """Run the fine-tuning example with --push-to-hub against the capturing client; return what was uploaded."""
    tmp_path = tmp_path_factory.mktemp("hub")
    api, trainer = fine_tune_and_push(
        tmp_path, "--max-steps", "8", "--sequence-length", "64", "--batch-size", "4", "--learning-rate", "3e-3",
        "--train-documents", "60", "--eval-documents", "10", "--eval-blocks", "4",
        "--hub-model-id", "someone/dar-tiny-finetune",
    )
    assert api.created == ["someone/dar-tiny-finetune"] and len(api.uploads) == 1
    repo_id, folder = api.uploads[0]
    assert repo_id == "someone/dar-tiny-finetune"
    return SimpleNamespace(folder=folder, model=trainer.model.eval(), tokenizer=trainer.processing_class, tmp=tmp_path)


def test_a_lora_fine_tune_pushes_the_merged_model(tmp_path):
    """`finetune.py --lora --push-to-hub` uploaded the adapter alone (adapter_config.json naming base None, no config,
    code or weights), whose base, this run's upcycled model, no repo holds. It pushes the merged DAR model now, as
    `--save` writes it: a folder that loads on its own and computes what the trained adapter computes."""
    from transformers import AutoModelForCausalLM

    api, trainer = fine_tune_and_push(
        tmp_path, "--max-steps", "4", "--eval-steps", "4", "--sequence-length", "32", "--batch-size", "2",
        "--train-documents", "40", "--eval-documents", "10", "--eval-blocks", "4", "--lora", "--lora-train-dar",
        "--hub-model-id", "someone/dar-tiny-lora",
    )
    assert len(api.uploads) == 1
    folder = api.uploads[0][1]
    names = {path.name for path in folder.iterdir()}
    assert "adapter_config.json" not in names and "adapter_model.safetensors" not in names
    assert {"config.json", "modeling_dar.py", "model.safetensors", "tokenizer.json", "README.md"} <= names
    assert json.loads((folder / "config.json").read_text())["model_type"] == "dar"
    loaded = AutoModelForCausalLM.from_pretrained(folder).eval()
    ids = torch.arange(3, 20).unsqueeze(0)
    with torch.no_grad():
        torch.testing.assert_close(loaded(ids).logits, trainer.model.eval()(ids).logits, rtol=1e-5, atol=1e-5)


def test_pushed_folder_holds_config_with_auto_map_code_weights_tokenizer_and_card(pushed):
    names = {path.name for path in pushed.folder.iterdir()}
    assert {"config.json", "configuration_dar.py", "modeling_dar.py", "model.safetensors", "generation_config.json",
            "tokenizer.json", "tokenizer_config.json", "README.md"} <= names
    assert not any(name.startswith(("_", "checkpoint-")) for name in names)  # no scratch files or checkpoints
    config = json.loads((pushed.folder / "config.json").read_text())
    assert config["model_type"] == "dar" and config["architectures"] == ["DARForCausalLM"]
    assert config["auto_map"]["AutoConfig"] == "configuration_dar.DARConfig"
    assert config["auto_map"]["AutoModelForCausalLM"] == "modeling_dar.DARForCausalLM"
    assert config["auto_map"]["AutoModel"] == "modeling_dar.DARModel"  # what vLLM's Transformers backend builds
    # The remote code is this package's source as is: flat files importing only torch, transformers and each other.
    source = (PACKAGE_SOURCE / "dar_transformers" / "modeling_dar.py").read_text()
    assert (pushed.folder / "modeling_dar.py").read_text() == source
    assert "dar_transformers" not in source.replace("dar-transformers", "")
    card = (pushed.folder / "README.md").read_text()
    assert "library_name: transformers" in card
    for tag in ("dar", "dual-attention-residuals", "custom_code"):
        assert f"- {tag}" in card
    assert "Loss" in card and "learning_rate: 0.003" in card  # training summary: results and hyperparameters


def test_pushed_folder_loads_with_remote_code_in_a_clean_process_and_generates(pushed):
    input_ids = pushed.tokenizer(PROMPT, return_tensors="pt").input_ids
    with torch.no_grad():
        expected_logits = pushed.model(input_ids).logits
        expected_tokens = pushed.model.generate(input_ids, max_new_tokens=12, do_sample=False)
    torch.save({"logits": expected_logits, "tokens": expected_tokens}, pushed.tmp / "expected.pt")

    script = f"""
import importlib.util, io, json, sys
from contextlib import redirect_stdout
from pathlib import Path
sys.path = [entry for entry in sys.path if Path(entry or ".").resolve() != Path({str(PACKAGE_SOURCE)!r})]
assert importlib.util.find_spec("dar_transformers") is None, "the package must be invisible here"
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer, TextStreamer, pipeline

folder = {str(pushed.folder)!r}
model = AutoModelForCausalLM.from_pretrained(folder, trust_remote_code=True).eval()
tokenizer = AutoTokenizer.from_pretrained(folder, trust_remote_code=True)  # it reads config.json (model_type "dar")
expected = torch.load({str(pushed.tmp / "expected.pt")!r})
input_ids = tokenizer({PROMPT!r}, return_tensors="pt").input_ids
with torch.no_grad():
    logit_difference = (model(input_ids).logits - expected["logits"]).abs().max().item()
generator = pipeline("text-generation", model=model, tokenizer=tokenizer, trust_remote_code=True)
generated = generator({PROMPT!r}, max_new_tokens=12, do_sample=False, return_full_text=False)[0]["generated_text"]
streamed = io.StringIO()
with redirect_stdout(streamed):
    tokens = model.generate(input_ids, max_new_tokens=12, do_sample=False, streamer=TextStreamer(tokenizer, skip_prompt=True))
print("REPORT", json.dumps({{
    "class_module": type(model).__module__, "class_name": type(model).__name__, "logit_difference": logit_difference,
    "generated": generated, "streamed": streamed.getvalue(), "tokens": tokens.tolist(),
    "modules_loaded": sorted(name for name in sys.modules if name.startswith("dar_transformers")),
}}))
"""
    environment = {key: value for key, value in os.environ.items() if key != "PYTHONPATH"}
    environment.update(HF_MODULES_CACHE=str(pushed.tmp / "modules"), HF_HUB_OFFLINE="1", OMP_NUM_THREADS=str(torch.get_num_threads()))
    completed = subprocess.run([sys.executable, "-c", script], cwd=pushed.tmp, env=environment, capture_output=True,
                               text=True, timeout=300)
    assert completed.returncode == 0, completed.stderr[-5000:]
    assert "[y/N]" not in completed.stdout  # no trust_remote_code prompt anywhere
    report = json.loads(completed.stdout.split("REPORT ", 1)[1])

    assert report["class_module"].startswith("transformers_modules.") and report["class_name"] == "DARForCausalLM"
    assert report["modules_loaded"] == []
    assert report["logit_difference"] < 1e-5
    assert report["tokens"] == expected_tokens.tolist()
    expected_text = pushed.tokenizer.decode(expected_tokens[0, input_ids.shape[1]:], skip_special_tokens=True)
    assert report["generated"] == expected_text and len(expected_text.strip()) > 0
    assert report["streamed"].strip() == expected_text.strip()


def test_model_and_tokenizer_push_to_hub_upload_the_same_repo_layout(tmp_path, pushed, monkeypatch):
    """The plain `model.push_to_hub` / `tokenizer.push_to_hub` route (no Trainer) uploads code, auto_map and a card."""
    import transformers.utils.hub as hub

    api = CapturingHubApi(tmp_path)
    uploaded = []

    def capture_upload(self, working_dir, repo_id, **kwargs):
        target = tmp_path / f"push{len(uploaded)}"
        shutil.copytree(working_dir, target)
        uploaded.append(target)

    def new_repo_card(repo_id, token=None):
        raise EntryNotFoundError(f"{repo_id} has no README.md yet")  # a fresh Hub repo

    monkeypatch.setattr(hub, "hf_api", lambda: api)
    monkeypatch.setattr(hub.ModelCard, "load", staticmethod(new_repo_card))
    monkeypatch.setattr(hub.PushToHubMixin, "_upload_modified_files", capture_upload)
    pushed.model.push_to_hub("someone/dar-tiny")
    AutoTokenizer.from_pretrained(pushed.folder).push_to_hub("someone/dar-tiny")
    assert api.created == ["someone/dar-tiny", "someone/dar-tiny"] and len(uploaded) == 2
    model_files = {path.name for path in uploaded[0].iterdir()}
    assert {"config.json", "configuration_dar.py", "modeling_dar.py", "model.safetensors", "README.md"} <= model_files
    assert "auto_map" in json.loads((uploaded[0] / "config.json").read_text())
    assert "library_name: transformers" in (uploaded[0] / "README.md").read_text()
    assert {"tokenizer.json", "tokenizer_config.json"} <= {path.name for path in uploaded[1].iterdir()}


def test_a_dar_moe_saved_from_a_dense_dar_folder_names_its_own_classes_in_auto_map(tmp_path):
    """`DARMoeForCausalLM.from_pretrained(dense_dar_folder, num_experts=...)` keeps the dense folder's `auto_map`;
    its save replaced only its own entry, so `AutoModel` and the heads still named the dense classes and a process
    without the package could not load them (vLLM builds `AutoModel`)."""
    import json

    from conftest import tiny_dar_config

    from dar_transformers import DARForCausalLM, DARMoeForCausalLM

    torch.manual_seed(0)
    DARForCausalLM(tiny_dar_config()).save_pretrained(tmp_path / "dense")
    moe = DARMoeForCausalLM.from_pretrained(tmp_path / "dense", num_experts=4, num_experts_per_tok=2)
    moe.save_pretrained(tmp_path / "moe")
    auto_map = json.loads((tmp_path / "moe" / "config.json").read_text())["auto_map"]
    assert auto_map["AutoConfig"] == "configuration_dar_moe.DARMoeConfig"
    for auto_class in ("AutoModel", "AutoModelForCausalLM", "AutoModelForSequenceClassification",
                       "AutoModelForTokenClassification", "AutoModelForQuestionAnswering"):
        assert auto_map[auto_class].startswith("modeling_dar_moe.DARMoe"), (auto_class, auto_map[auto_class])
