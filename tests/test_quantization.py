# SPDX-License-Identifier: Apache-2.0
"""int8 weight-only quantization with torchao (extra `quant`), through transformers' `TorchAoConfig`, on CPU.

A converted DAR folder loaded in bf16 with `quantization_config=TorchAoConfig(Int8WeightOnlyConfig())`: every
linear layer of the branches becomes an int8 weight (per output channel, bf16 scales) while DAR's own parameters
stay plain float32 tensors (`_keep_in_fp32_modules_strict`; they are not linear layers, so torchao's default filter
leaves them alone anyway). The quantized model's logits stay within a stated bound of the bf16 model's, and DAR's
error is compared with its Llama source quantized the same way, side by side.

Bound: max |logit difference| <= 2% of the bf16 logits' max |value|. Per-channel int8 rounds each weight by at most
half a step, 1/254 of its row's max |weight| (0.4%); three layers in sequence and bf16 activations make it a few
times that. Measured here (the tiny model below, logits up to 0.54): DAR 0.91%, Llama 1.07% (0.95%, 1.14% with
transformers 5.25 and torchao 0.18.0). With DAR parameters moved further from their init (random scale 0.5 instead
of 0.1: depth softmaxes far sharper than an upcycle's) DAR reached 4.3%: sharp depth reads amplify the branches'
rounding. README "Serving" has SmolLM2's numbers.
"""

import pytest
import torch
from torchao.quantization import Int8WeightOnlyConfig
from transformers import AutoModelForCausalLM, LlamaConfig, LlamaForCausalLM, TorchAoConfig

from conftest import DAR_MODULE_NAMES, perturb_dar_parameters
from dar_transformers.convert import convert

pytestmark = pytest.mark.quant

RELATIVE_BOUND = 0.02
INPUT_IDS = torch.tensor([[1, 17, 42, 5, 88, 23, 61, 7, 19, 77, 3, 54]])


@pytest.fixture(scope="module")
def folders(tmp_path_factory):
    """(Llama source folder, DAR folder converted from it with every DAR parameter off its init)."""
    root = tmp_path_factory.mktemp("quant")
    torch.manual_seed(0)
    config = LlamaConfig(vocab_size=97, hidden_size=64, intermediate_size=128, num_hidden_layers=3,
                         num_attention_heads=4, num_key_value_heads=2, tie_word_embeddings=False, bos_token_id=1,
                         eos_token_id=2, pad_token_id=0)
    LlamaForCausalLM(config).save_pretrained(root / "llama")
    model = convert(AutoModelForCausalLM.from_pretrained(root / "llama"), dar_block_size=2)
    perturb_dar_parameters(model, scale=0.1)  # off the init (the depth reads matter), as a trained model is
    model.save_pretrained(root / "dar")
    return root / "llama", root / "dar"


def load(folder, quantized: bool):
    config = TorchAoConfig(Int8WeightOnlyConfig()) if quantized else None
    return AutoModelForCausalLM.from_pretrained(folder, dtype=torch.bfloat16, quantization_config=config).eval()


def relative_logit_error(folder) -> float:
    with torch.no_grad():
        reference = load(folder, quantized=False)(INPUT_IDS).logits.float()
        quantized = load(folder, quantized=True)(INPUT_IDS).logits.float()
    return ((quantized - reference).abs().max() / reference.abs().max()).item()


def test_int8_weight_only_quantizes_the_branches_and_keeps_dar_parameters_float32(folders):
    _, dar_folder = folders
    model = load(dar_folder, quantized=True)
    branch_weights, dar_parameters = {}, {}
    for name, parameter in model.named_parameters():
        if any(part in DAR_MODULE_NAMES for part in name.split(".")):
            dar_parameters[name] = parameter
        elif name.endswith("_proj.weight"):
            branch_weights[name] = parameter
    assert len(dar_parameters) > 0 and len(branch_weights) == 3 * 7
    for name, parameter in dar_parameters.items():
        assert type(parameter.data) is torch.Tensor and parameter.dtype == torch.float32, name
    for name, parameter in branch_weights.items():
        assert type(parameter.data).__name__ == "Int8Tensor", (name, type(parameter.data))
        assert parameter.data.qdata.dtype == torch.int8, name


def test_int8_logits_within_the_bound_of_the_bf16_model_dar_and_llama_side_by_side(folders):
    llama_folder, dar_folder = folders
    dar_error, llama_error = relative_logit_error(dar_folder), relative_logit_error(llama_folder)
    print(f"int8 weight-only vs bf16, max |logit difference| / max |logit|: DAR {dar_error:.4f}, "
          f"Llama {llama_error:.4f}")
    assert dar_error <= RELATIVE_BOUND
    assert llama_error <= RELATIVE_BOUND
    # Negative control: the quantized model is not the bf16 model (int8 rounding is visible in the logits).
    assert dar_error > 1e-4 and llama_error > 1e-4
