# SPDX-License-Identifier: Apache-2.0
"""`torch.export` through transformers' ExecuTorch integration (`transformers.integrations.executorch`), on CPU.

The recipe ExecuTorch's LLM runner uses: `TorchExportableModuleForDecoderOnlyLM` wraps the model with a `StaticCache`
whose buffers become buffers of the exported program, `export` traces one decoding step (strict `torch.export`,
i.e. Dynamo), and decoding feeds one token at a time with its cache position. The exported program must give the
eager model's greedy tokens (HF `generate`) and its logits at every step; LlamaForCausalLM runs the same checks
side by side as the control. DAR's depth state is per token within one forward, so nothing of it lives in the
cache; the trace takes the reference depth equations (`depth_backends.depth_backend` under a compiler).
"""

import pytest
import torch
from transformers.integrations.executorch import TorchExportableModuleForDecoderOnlyLM

from conftest import perturb_dar_parameters, spread_weights, tiny_llama, upcycled_dar

MAX_CACHE_LEN = 24
NEW_TOKENS = 10
PROMPT = torch.tensor([[1, 17, 42, 5, 88, 23, 61]])


def tiny_model(kind: str) -> torch.nn.Module:
    """The tiny Llama at a weight scale where its greedy tokens are decided (default init leaves its logits nearly
    uniform, where a program that computed something else could still pick the same tokens), or its DAR upcycle with
    every DAR parameter moved off its init (the depth reads matter)."""
    llama = spread_weights(tiny_llama(seed=0, num_hidden_layers=3))
    if kind == "llama":
        return llama
    dar = upcycled_dar(llama, dar_block_size=2)
    perturb_dar_parameters(dar)
    return dar.eval()


def export_decoder(model) -> torch.export.ExportedProgram:
    model.generation_config.cache_implementation = "static"  # what the static-cache recipe requires
    exportable = TorchExportableModuleForDecoderOnlyLM(model, batch_size=1, max_cache_len=MAX_CACHE_LEN)
    with torch.no_grad():
        return exportable.export(input_ids=PROMPT[:, :1], cache_position=torch.tensor([0]))


@pytest.fixture(scope="module", params=["llama", "dar"])
def exported(request):
    """(eager model, its exported decoding program), one export per model kind for the module."""
    model = tiny_model(request.param)
    return model, export_decoder(model)


def exported_greedy(program: torch.export.ExportedProgram, prompt: torch.Tensor, new_tokens: int,
                    end_token: int) -> list[int]:
    """Greedy decoding through one module of the exported program, as ExecuTorch's runner drives it: the prompt one
    token at a time (each with its cache position), then each argmax fed back, up to `end_token`. (transformers'
    `TorchExportableModuleWithStaticCache.generate` calls `program.module()` again at every step; its tokens drift
    from HF's after a few steps at this weight scale, for Llama too.)"""
    module, tokens = program.module(), prompt[0].tolist()
    with torch.no_grad():
        for position, token in enumerate(tokens):
            logits = module(input_ids=torch.tensor([[token]]), cache_position=torch.tensor([position]))
        for _ in range(new_tokens):
            tokens.append(int(logits[0, -1].argmax()))
            if tokens[-1] == end_token:
                break
            logits = module(input_ids=torch.tensor([[tokens[-1]]]), cache_position=torch.tensor([len(tokens) - 1]))
    return tokens


def test_exported_static_cache_decoding_gives_hf_greedy_tokens(exported):
    model, program = exported
    with torch.no_grad():
        expected = model.generate(PROMPT, attention_mask=torch.ones_like(PROMPT), max_new_tokens=NEW_TOKENS,
                                  do_sample=False)
    assert exported_greedy(program, PROMPT, NEW_TOKENS, model.generation_config.eos_token_id) == expected[0].tolist()
    # Greedy tokens that never change would pass the comparison without the model: the continuation varies.
    assert len(set(expected[0, PROMPT.shape[1]:].tolist())) > 1


def test_exported_step_logits_equal_the_eager_forward(exported):
    """Each token fed through the exported program gives the eager full-sequence forward's logits at its position."""
    model, program = exported
    program = program.module()
    with torch.no_grad():
        expected = model(PROMPT).logits[0]  # [T, vocab]
        steps = [program(input_ids=PROMPT[:, t : t + 1], cache_position=torch.tensor([t]))[0, -1]
                 for t in range(PROMPT.shape[1])]
    torch.testing.assert_close(torch.stack(steps), expected, rtol=1e-5, atol=1e-5)


def test_exported_program_reads_the_dar_parameters():
    """Negative control: the exported DAR program differs from the one exported from its unperturbed twin (the DAR
    parameters are inside the program, not folded away as the exact-reduction init)."""
    perturbed = tiny_model("dar")
    plain = upcycled_dar(spread_weights(tiny_llama(seed=0, num_hidden_layers=3)), dar_block_size=2)
    with torch.no_grad():
        perturbed_logits = export_decoder(perturbed).module()(input_ids=PROMPT[:, :1], cache_position=torch.tensor([0]))
        plain_logits = export_decoder(plain).module()(input_ids=PROMPT[:, :1], cache_position=torch.tensor([0]))
    assert (perturbed_logits - plain_logits).abs().max() > 1e-3


@pytest.mark.parametrize("kind", ["llama", "dar"])
def test_the_recipe_exports_with_gradients_on_as_documented(kind):
    """transformers documents `TorchExportableModuleForDecoderOnlyLM(...).export(...)` without `torch.no_grad()`: with
    gradients on, DAR's traced training reads ran in activation checkpoints, which strict export cannot trace
    (`_checkpoint_context_fn`), where Llama exports. The exported step gives the eager logits."""
    model = tiny_model(kind)
    model.generation_config.cache_implementation = "static"
    exportable = TorchExportableModuleForDecoderOnlyLM(model, batch_size=1, max_cache_len=MAX_CACHE_LEN)
    program = exportable.export(input_ids=PROMPT[:, :1], cache_position=torch.tensor([0]))
    with torch.no_grad():
        step = program.module()(input_ids=PROMPT[:, :1], cache_position=torch.tensor([0]))
        expected = model(PROMPT[:, :1]).logits
    torch.testing.assert_close(step, expected, rtol=1e-5, atol=1e-5)


def test_an_export_with_a_dynamic_length_runs_at_every_length_up_to_its_bound():
    """A dynamic sequence length up to 2048: the inference backend's many-tokens test (`bytes_bound`) compared the
    traced size before asking whether it was tracing, a shape guard that capped the length at 2^15 / (B D) tokens
    (export failed: "Constraints violated (seq)"; compiled forwards recompiled past it)."""
    model = tiny_model("dar")
    seq = torch.export.Dim("seq", min=2, max=2048)
    with torch.no_grad():
        program = torch.export.export(model, (), {"input_ids": PROMPT, "use_cache": False}, strict=False,
                                      dynamic_shapes={"input_ids": {1: seq}, "use_cache": None})
        for length in (5, 1100):
            input_ids = torch.randint(3, 97, (1, length), generator=torch.Generator().manual_seed(length))
            torch.testing.assert_close(program.module()(input_ids=input_ids, use_cache=False).logits,
                                       model(input_ids, use_cache=False).logits, rtol=1e-5, atol=1e-5)
