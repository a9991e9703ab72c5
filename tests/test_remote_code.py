# SPDX-License-Identifier: Apache-2.0
"""Every folder the package writes loads through every Auto class with `trust_remote_code=True` where the package is
not installed, and gives the package's numbers.

The folders: `save_pretrained` of DAR and DAR-MoE, `dar convert` to DAR and to DAR-MoE, and a LoRA model merged
with `merge_and_unload()`. One fresh Python process, whose import system refuses `dar_transformers`, loads each
folder with `AutoModel` (what vLLM's Transformers backend builds), `AutoModelForCausalLM` and the three task heads,
and saves the outputs and weights; this process loads the same folder with the package and compares. A task head
started from a causal-LM folder has new, randomly initialised layers: those are taken from the remote model, every
other weight must already be equal.
"""

import json
import os
import subprocess
import sys
import textwrap

import pytest
import torch
from conftest import TINY_LLAMA_FIELDS, perturb_dar_parameters, random_input_ids, tiny_dar_config, tiny_llama
from tokenizers import Tokenizer
from tokenizers.models import WordLevel
from tokenizers.pre_tokenizers import Whitespace
import transformers
from transformers import AutoConfig, PreTrainedTokenizerFast

from dar_transformers import AUTO_CLASSES, DARForCausalLM, DARMoeConfig, DARMoeForCausalLM
from dar_transformers.convert import upcycle
from dar_transformers.moe_upcycling import upcycle_to_dar_moe

pytestmark = pytest.mark.compat

AUTO_CLASS_NAMES = ("AutoModel", "AutoModelForCausalLM", "AutoModelForSequenceClassification",
                    "AutoModelForQuestionAnswering", "AutoModelForTokenClassification")
PROMPTS = [" ".join(f"w{3 + (7 * index) % 90}" for index in range(16)), "w5 w9 w11 w60 w61 w62 w3 w4"]

# Runs in the fresh process: argv = input_ids file, output file, folders.
REMOTE_SCRIPT = textwrap.dedent(
    """
    import importlib.abc, sys

    class RefuseThePackage(importlib.abc.MetaPathFinder):
        def find_spec(self, name, path=None, target=None):
            if name.split(".")[0] == "dar_transformers":
                raise ModuleNotFoundError(f"{name} is refused in this process")

    sys.meta_path.insert(0, RefuseThePackage())
    try:
        import dar_transformers
    except ModuleNotFoundError:
        pass
    else:
        raise SystemExit("dar_transformers is importable: the check would prove nothing")

    import torch
    import transformers

    def outputs(output):
        if hasattr(output, "start_logits"):
            return torch.stack([output.start_logits, output.end_logits])
        return output.logits if hasattr(output, "logits") else output.last_hidden_state

    input_ids = torch.load(sys.argv[1])
    results = {}
    for folder in sys.argv[3:]:
        for name in %r:
            torch.manual_seed(0)
            extra = {} if name in ("AutoModel", "AutoModelForCausalLM") else {"num_labels": 3}
            model = getattr(transformers, name).from_pretrained(folder, trust_remote_code=True, **extra).eval()
            assert type(model).__module__.startswith("transformers_modules."), (folder, name, type(model).__module__)
            with torch.no_grad():
                results[folder, name] = (type(model).__name__, outputs(model(input_ids)), model.state_dict())
            # the task tables Trainer reads (its label smoother's shift, its model card's task)
            from transformers.models.auto import modeling_auto

            results[folder, name, "declared in"] = [
                table for table in ("MODEL_FOR_CAUSAL_LM_MAPPING_NAMES", "MODEL_FOR_SEQUENCE_CLASSIFICATION_MAPPING_NAMES",
                                    "MODEL_FOR_TOKEN_CLASSIFICATION_MAPPING_NAMES",
                                    "MODEL_FOR_QUESTION_ANSWERING_MAPPING_NAMES")
                if type(model).__name__ in getattr(modeling_auto, table).values()
            ]
    assert not any(module.startswith("dar_transformers") for module in sys.modules)
    torch.save(results, sys.argv[2])
    """
    % (AUTO_CLASS_NAMES,)
)


def word_tokenizer() -> PreTrainedTokenizerFast:
    """A word-level tokenizer over the tiny vocabulary (the converter writes one into the folder)."""
    words = {f"w{index}": index for index in range(3, TINY_LLAMA_FIELDS["vocab_size"])}
    vocab = {"<unk>": 0, "<s>": 1, "</s>": 2} | words
    backend = Tokenizer(WordLevel(vocab, unk_token="<unk>"))
    backend.pre_tokenizer = Whitespace()
    return PreTrainedTokenizerFast(tokenizer_object=backend, unk_token="<unk>", bos_token="<s>", eos_token="</s>")


def merged_lora_dar() -> DARForCausalLM:
    from peft import LoraConfig, get_peft_model

    torch.manual_seed(0)
    model = DARForCausalLM(tiny_dar_config(dar_block_size=3))
    perturb_dar_parameters(model, seed=2)
    adapted = get_peft_model(model, LoraConfig(r=4, target_modules=["q_proj", "v_proj"], init_lora_weights=False))
    return adapted.merge_and_unload()


def write_folders(root) -> dict[str, tuple[str, object]]:
    """kind -> (folder, model type) for every way the package writes a model folder."""
    llama = tiny_llama()
    convert_options = dict(tokenizer=word_tokenizer(), prompts=PROMPTS, max_new_tokens=4, progress=False,
                           dar_block_size=3)
    upcycle(llama, root / "converted_dar", **convert_options)
    upcycle_to_dar_moe(llama, root / "converted_dar_moe", num_experts=4, top_k=2, **convert_options)

    torch.manual_seed(0)
    dar = DARForCausalLM(tiny_dar_config(dar_block_size=3))
    perturb_dar_parameters(dar, seed=1)
    dar.save_pretrained(root / "saved_dar")
    torch.manual_seed(0)
    moe = DARMoeForCausalLM(DARMoeConfig(**TINY_LLAMA_FIELDS, num_experts=4, num_experts_per_tok=2,
                                         shared_expert_intermediate_size=16, initializer_range=0.2))
    perturb_dar_parameters(moe, seed=3)
    moe.save_pretrained(root / "saved_dar_moe")
    merged_lora_dar().save_pretrained(root / "merged_lora_dar")
    model_types = {"converted_dar": "dar", "converted_dar_moe": "dar_moe", "saved_dar": "dar",
                   "saved_dar_moe": "dar_moe", "merged_lora_dar": "dar"}
    return {kind: (str(root / kind), model_type) for kind, model_type in model_types.items()}


def run_without_the_package(tmp_path, input_ids, folders: list[str]) -> dict:
    torch.save(input_ids, tmp_path / "input_ids.pt")
    script = tmp_path / "load_without_the_package.py"
    script.write_text(REMOTE_SCRIPT)
    environment = {
        "PATH": os.environ["PATH"], "HOME": str(tmp_path), "OMP_NUM_THREADS": str(torch.get_num_threads()),
        "HF_HUB_OFFLINE": "1", "HF_HOME": str(tmp_path / "hf_home"), "HF_MODULES_CACHE": str(tmp_path / "modules"),
    }
    result = subprocess.run(
        [sys.executable, str(script), str(tmp_path / "input_ids.pt"), str(tmp_path / "remote.pt"), *folders],
        cwd=tmp_path, env=environment, capture_output=True, text=True, timeout=600,
    )
    assert result.returncode == 0, result.stderr[-4000:]
    return torch.load(tmp_path / "remote.pt")


@pytest.fixture(scope="module")
def written(tmp_path_factory):
    root = tmp_path_factory.mktemp("remote_code")
    folders = write_folders(root)
    input_ids = random_input_ids()
    remote = run_without_the_package(root, input_ids, [folder for folder, _ in folders.values()])
    return folders, input_ids, remote


def expected_auto_map(model_type: str) -> dict[str, str]:
    config_class = type(AutoConfig.for_model(model_type))
    module = "modeling_dar" if model_type == "dar" else "modeling_dar_moe"
    return {"AutoConfig": f"configuration_{model_type}.{config_class.__name__}"} | {
        auto_class.__name__: f"{module}.{model_class.__name__}"
        for auto_class, model_class in AUTO_CLASSES[config_class].items()
    }


@pytest.mark.parametrize(
    "kind", ["saved_dar", "converted_dar", "merged_lora_dar", "saved_dar_moe", "converted_dar_moe"]
)
def test_every_written_folder_names_every_auto_class_and_loads_each_without_the_package(written, kind):
    folders, input_ids, remote = written
    folder, model_type = folders[kind]
    auto_map = json.loads((open(os.path.join(folder, "config.json")).read()))["auto_map"]
    assert auto_map == expected_auto_map(model_type)
    assert set(AUTO_CLASS_NAMES) | {"AutoConfig"} == set(auto_map)

    for name in AUTO_CLASS_NAMES:
        remote_class, remote_outputs, remote_state = remote[folder, name]
        assert remote_class == auto_map[name].split(".")[1]
        extra = {} if name in ("AutoModel", "AutoModelForCausalLM") else {"num_labels": 3}
        model, info = getattr(transformers, name).from_pretrained(folder, output_loading_info=True, **extra)
        assert type(model).__module__.startswith("dar_transformers.") and type(model).__name__ == remote_class
        new_layers = set(info["missing_keys"])  # the task head's own layers, absent from a causal-LM folder
        assert all(key.startswith(("score.", "qa_outputs.")) for key in new_layers), new_layers
        state = model.state_dict()
        for key, tensor in state.items():
            if key not in new_layers:
                assert torch.equal(remote_state[key], tensor), (kind, name, key)
        model.load_state_dict({key: remote_state[key] for key in new_layers}, strict=False)
        with torch.no_grad():
            output = model.eval()(input_ids)
        if hasattr(output, "start_logits"):
            expected = torch.stack([output.start_logits, output.end_logits])
        else:
            expected = output.logits if hasattr(output, "logits") else output.last_hidden_state
        assert expected.abs().max() > 0
        torch.testing.assert_close(remote_outputs, expected, rtol=0, atol=1e-6)
    # Trainer shifts the labels for label smoothing only for the causal-LM classes transformers' table names, and its
    # model card names a task only for a listed head; the remote code declares each head in its task's table, as the
    # package does (test_training.py measures what that changes).
    tables = {"AutoModel": [], "AutoModelForCausalLM": ["MODEL_FOR_CAUSAL_LM_MAPPING_NAMES"],
              "AutoModelForSequenceClassification": ["MODEL_FOR_SEQUENCE_CLASSIFICATION_MAPPING_NAMES"],
              "AutoModelForTokenClassification": ["MODEL_FOR_TOKEN_CLASSIFICATION_MAPPING_NAMES"],
              "AutoModelForQuestionAnswering": ["MODEL_FOR_QUESTION_ANSWERING_MAPPING_NAMES"]}
    for name in AUTO_CLASS_NAMES:
        assert remote[folder, name, "declared in"] == tables[name], (kind, name)


@pytest.mark.parametrize("config_class", list(AUTO_CLASSES))
def test_each_config_names_the_classes_a_folder_of_its_type_names(config_class):
    """`remote_code_auto_map` is a literal in the config's own file (remote code saves folders too, and it used to be
    filled in only by the package's import): it must say what the registration table and the folders say."""
    assert config_class.remote_code_auto_map == expected_auto_map(config_class.model_type)


def test_a_dar_moe_saved_by_remote_code_from_a_dense_dar_folder_names_only_moe_classes(tmp_path):
    """Without the package: the DAR-MoE class of a DAR-MoE folder's code, loaded from a dense DAR folder and saved,
    wrote an `auto_map` whose AutoConfig, AutoModel and heads still named the dense classes (model_type dar_moe), so
    `AutoModel` (what vLLM builds) made a dense DARModel of the folder, 0.66 off the saved model's hidden states."""
    config = dict(TINY_LLAMA_FIELDS, dar_block_size=2)
    DARForCausalLM(tiny_dar_config(dar_block_size=2)).save_pretrained(tmp_path / "dense")
    DARMoeForCausalLM(DARMoeConfig(**config, num_experts=4)).save_pretrained(tmp_path / "moe")
    script = REMOTE_SCRIPT.split("import torch\n")[0] + textwrap.dedent(f"""
        import json
        from transformers import AutoModel, AutoModelForCausalLM
        moe_class = type(AutoModelForCausalLM.from_pretrained({str(tmp_path / "moe")!r}, trust_remote_code=True))
        moe_class.from_pretrained({str(tmp_path / "dense")!r}, num_experts=4).save_pretrained({str(tmp_path / "out")!r})
        print(type(AutoModel.from_pretrained({str(tmp_path / "out")!r}, trust_remote_code=True)).__name__)
    """)
    environment = {"PATH": os.environ["PATH"], "HOME": str(tmp_path), "OMP_NUM_THREADS": "1", "HF_HUB_OFFLINE": "1",
                   "HF_HOME": str(tmp_path / "hf_home"), "HF_MODULES_CACHE": str(tmp_path / "modules")}
    run = subprocess.run([sys.executable, "-c", script], cwd=tmp_path, env=environment, capture_output=True,
                         text=True, timeout=300)
    assert run.returncode == 0, run.stderr[-3000:]
    assert run.stdout.split()[-1] == "DARMoeModel"
    auto_map = json.loads((tmp_path / "out" / "config.json").read_text())["auto_map"]
    assert auto_map == expected_auto_map("dar_moe")


def test_a_dense_dar_saved_where_a_dar_moe_was_names_the_moe_code_left_there(tmp_path, caplog):
    """transformers removes no file when it saves; the DAR-MoE code files stayed beside the dense DAR's, unnamed, and
    push_to_hub would upload them. The save names them (it removes nothing it did not write)."""
    DARMoeForCausalLM(DARMoeConfig(**TINY_LLAMA_FIELDS, num_experts=4)).save_pretrained(tmp_path)
    DARForCausalLM(tiny_dar_config()).save_pretrained(tmp_path)
    assert "also holds configuration_dar_moe.py, modeling_dar_moe.py" in caplog.text
    assert (tmp_path / "modeling_dar_moe.py").is_file()
    caplog.clear()
    DARForCausalLM(tiny_dar_config()).save_pretrained(tmp_path / "clean")
    assert "also holds" not in caplog.text
