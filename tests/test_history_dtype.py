# SPDX-License-Identifier: Apache-2.0
"""`dar_history_dtype = "model"`: the committed entries are stored in the model dtype (as Llama stores its residual
stream), while the partial, the per-token statistics and the depth softmax and mixing stay float32.

In an fp32 model it is the float32 state bit for bit (so exact upcycling holds); in a bf16 model the entries are bf16
and everything else of the state float32; the reference and two-phase backends agree under it (values and every
gradient). A float16 model keeps the float32 history (float16's range)."""

import logging

import pytest
import torch
from conftest import (
    DEPTH_EPS,
    DEPTH_ROUTINGS,
    depth_read_inputs,
    loop_depth_read,
    perturb_dar_parameters,
    random_input_ids,
    tiny_dar_config,
    tiny_llama,
    upcycled_dar,
)

from dar_transformers import DARForCausalLM
from dar_transformers.depth_backends import DepthState, inverse_rms, phase_one, routed_queries, two_phase_read


def _tiny_dar(dtype, seed=0, **overrides):
    """A perturbed tiny DAR model in `dtype`, DAR parameters float32 (as `from_pretrained(dtype=...)` keeps them)."""
    torch.manual_seed(seed)
    overrides.setdefault("dar_implementation", "two_phase")  # the fused "fast" path refuses a model-dtype history
    model = DARForCausalLM(tiny_dar_config(**overrides))
    perturb_dar_parameters(model, scale=0.5, seed=seed)
    model = model.to(dtype)
    for name, module in model.named_modules():
        if name.endswith(("attn_residual", "mlp_residual", "final_readout")):
            module.float()
    return model.train()


def _loss_and_gradients(model, ids):
    model.zero_grad(set_to_none=True)
    output = model(ids, labels=ids)
    output.loss.backward()
    return output.logits.detach(), {name: parameter.grad.clone() for name, parameter in model.named_parameters()}


@pytest.mark.parametrize("implementation", ["two_phase", "reference"])
@pytest.mark.parametrize("block_size", [1, 3])
def test_model_history_in_an_fp32_model_is_the_float32_state_bit_for_bit(implementation, block_size):
    ids = random_input_ids(seed=1)
    results = []
    for history_dtype in ("float32", "model"):
        model = _tiny_dar(torch.float32, dar_block_size=block_size, dar_implementation=implementation,
                          dar_history_dtype=history_dtype)
        results.append(_loss_and_gradients(model, ids))
    (logits, gradients), (model_logits, model_gradients) = results
    torch.testing.assert_close(model_logits, logits, rtol=0, atol=0)
    for name, gradient in gradients.items():
        torch.testing.assert_close(model_gradients[name], gradient, rtol=0, atol=0, msg=name)


def test_exact_upcycling_holds_with_model_history_in_fp32():
    llama = tiny_llama(seed=3)
    dar = upcycled_dar(llama, dar_history_dtype="model", dar_implementation="two_phase")
    ids = random_input_ids(seed=2)
    with torch.no_grad():
        torch.testing.assert_close(dar(ids).logits, llama(ids).logits, rtol=1e-5, atol=1e-5)


def _decoder_states(model, ids):
    """The flattened DAR state each decoder layer returns: (backend, partial, inverse RMS [S, B, T, J], *entries)."""
    states = []
    hooks = [layer.register_forward_hook(lambda module, args, output: states.append(output))
             for layer in model.model.layers]
    try:
        loss = model(ids, labels=ids).loss
    finally:
        for hook in hooks:
            hook.remove()
    return loss, states


@pytest.mark.parametrize("history_dtype,entry_dtype", [("model", torch.bfloat16), ("float32", torch.float32)])
def test_bf16_model_stores_entries_in_the_history_dtype_and_statistics_in_float32(history_dtype, entry_dtype):
    model = _tiny_dar(torch.bfloat16, num_hidden_layers=3, dar_block_size=4, dar_history_dtype=history_dtype)
    ids = random_input_ids(seed=4)
    saved = {}

    def record(tensor):
        saved[tensor.untyped_storage().data_ptr()] = tensor
        return tensor

    with torch.autograd.graph.saved_tensors_hooks(record, lambda tensor: tensor):
        loss, states = _decoder_states(model, ids)
    partials = [state[1] for state in states if state[1] is not None]
    assert partials and all(partial.dtype == torch.float32 for partial in partials)  # the partial stays float32
    assert all(state[2].dtype == torch.float32 for state in states)  # per-token inverse RMS
    entries = [entry for state in states for entry in state[3:]]
    assert len(entries) >= 3 and {entry.dtype for entry in entries} == {entry_dtype}
    # What backward keeps of the state: the committed entries, in their stored dtype, and no float32 copy of them.
    state_shape = (*ids.shape, 2, model.config.hidden_size)
    kept = sorted(str(tensor.dtype) for tensor in saved.values() if tuple(tensor.shape) == state_shape)
    assert kept == [str(entry_dtype)] * len(states[-1][3:]), kept
    loss.backward()
    assert all(torch.isfinite(parameter.grad).all() for parameter in model.parameters())


@pytest.mark.parametrize("implementation", ["two_phase", "reference"])
def test_a_float16_model_keeps_the_float32_history(implementation, tmp_path, caplog):
    """float16's range (65504) does not hold every committed entry Llama's residual stays within: a block's sum of
    branch outputs (one stream, no gate: +20000 and +50000 in a channel where the embedding is -40000, so Llama's
    running residual peaks at 30000) became inf in a float16 history, and the logits NaN. A float16 model keeps the
    float32 history under dar_history_dtype='model' (warned once); bfloat16 stores its own dtype (test above)."""
    llama = tiny_llama(initializer_range=0.2)
    channel = 5
    embeds = torch.randn(1, 6, llama.config.hidden_size, generator=torch.Generator().manual_seed(0))
    embeds[..., channel] = -40000.0
    layer = llama.model.layers[0]
    for module, projection, target in ((layer.self_attn, layer.self_attn.o_proj, 20000.0),
                                       (layer.mlp, layer.mlp.down_proj, 50000.0)):
        outputs = []
        hook = module.register_forward_hook(lambda m, args, output: outputs.append(
            output[0] if isinstance(output, tuple) else output))
        with torch.no_grad():
            llama(inputs_embeds=embeds)
            hook.remove()
            projection.weight[channel] *= target / outputs[0][..., channel].mean()
    llama.save_pretrained(tmp_path / "llama")
    upcycled_dar(llama, dar_block_size=2, dar_num_streams=1).save_pretrained(tmp_path / "dar")
    llama16 = type(llama).from_pretrained(tmp_path / "llama", dtype=torch.float16).eval()
    dar16 = DARForCausalLM.from_pretrained(tmp_path / "dar", dtype=torch.float16, dar_history_dtype="model",
                                           dar_implementation=implementation).eval()
    logging.Logger.warning_once.cache_clear()  # transformers' once-per-process warning: once per parameter here
    with torch.no_grad():
        expected = llama16(inputs_embeds=embeds.half()).logits.float()
        logits = dar16(inputs_embeds=embeds.half()).logits.float()
    assert torch.isfinite(expected).all() and torch.isfinite(logits).all()
    assert (logits - expected).abs().max() <= 1e-3 * expected.abs().max()
    assert "keeps the DAR history in float32 in a float16 model" in caplog.text


@pytest.mark.parametrize("routing", ["dar", "selfkv", "crossv", "fixedkv"])
@pytest.mark.parametrize("with_partial", [True, False])
def test_two_phase_read_of_bf16_entries_matches_the_loop_over_upcast_sources(routing, with_partial):
    """One read of bf16 entries (float32 partial, query and gate): the two-phase read and the plain loop over the
    upcast sources agree to float32 rounding in values and in the query, gate and partial gradients; the entries'
    gradients are bf16 in both, equal up to the last bf16 bit."""
    key_streams, value_streams = DEPTH_ROUTINGS[routing]
    entries, partial, query, gate = depth_read_inputs(2, with_partial=with_partial, hidden=16, seed=5)
    entries = [entry.detach().bfloat16().requires_grad_() for entry in entries]
    partial, query, gate = (None if x is None else x.detach().float().requires_grad_() for x in (partial, query, gate))
    inputs = [query, gate, *entries] + ([partial] if with_partial else [])
    upstream = torch.randn(2, 3, 16, generator=torch.Generator().manual_seed(7))

    sources = [entry.float() for entry in entries] + ([partial] if with_partial else [])
    expected = loop_depth_read(query, gate, torch.stack(sources, dim=2), key_streams, value_streams)
    expected_grads = torch.autograd.grad((expected * upstream).sum(), inputs)
    with torch.no_grad():  # as the backend: statistics and phase 1 of the stored (bf16) entries, upcast
        history_inv_rms = torch.stack([inverse_rms(entry.float(), DEPTH_EPS) for entry in entries])  # [S, B, T, J]
        routed = routed_queries(query, key_streams)
        phase = phase_one(routed, torch.stack(entries).float(), history_inv_rms, key_streams, value_streams)[0]
    state = DepthState(None, partial, tuple(entries), history_inv_rms)
    branch_input = two_phase_read(routed_queries(query, key_streams), gate, state, partial, phase, key_streams,
                                  value_streams, DEPTH_EPS)[0]
    assert branch_input.dtype == torch.float32
    grads = torch.autograd.grad((branch_input * upstream).sum(), inputs)
    torch.testing.assert_close(branch_input, expected, rtol=1e-5, atol=1e-5)
    for index, (grad, expected_grad) in enumerate(zip(grads, expected_grads)):
        assert grad.dtype == inputs[index].dtype
        tolerance = dict(rtol=1e-4, atol=1e-5) if grad.dtype == torch.float32 else dict(rtol=1e-2, atol=1e-3)
        torch.testing.assert_close(grad, expected_grad, **tolerance, msg=f"input {index}")


def _gaps(first, second):
    """(max |logit gap| / max |logit|, {parameter: relative gradient gap}) of two (logits, gradients) results."""
    (logits, gradients), (other_logits, other_gradients) = first, second
    logit_gap = (logits.float() - other_logits.float()).abs().max() / other_logits.float().abs().max()
    grad_gaps = {
        name: ((gradient.float() - other_gradients[name].float()).norm()
               / other_gradients[name].float().norm().clamp_min(1e-12)).item()
        for name, gradient in gradients.items()
    }
    return logit_gap.item(), grad_gaps


def _bf16_run(implementation, history_dtype, block_size, ids):
    model = _tiny_dar(torch.bfloat16, num_hidden_layers=3, dar_block_size=block_size,
                      dar_implementation=implementation, dar_history_dtype=history_dtype)
    return _loss_and_gradients(model, ids)


# bf16 rounding scale: 2.5 units in the last place of the largest logit; 5% of a gradient's norm.
LOGIT_GAP, GRADIENT_GAP = 1e-2, 5e-2


@pytest.mark.parametrize("block_size", [1, 4])
def test_two_phase_and_reference_agree_on_a_bf16_model_with_model_history(block_size):
    """bf16 model, entries bf16: the two backends store the same bf16 entries up to a rounding flip, so they agree
    to bf16 rounding, logits and every gradient."""
    ids = random_input_ids(seed=6)
    fast = _bf16_run("two_phase", "model", block_size, ids)
    logit_gap, grad_gaps = _gaps(fast, _bf16_run("reference", "model", block_size, ids))
    assert logit_gap <= LOGIT_GAP, logit_gap
    assert max(grad_gaps.values()) <= GRADIENT_GAP, max(grad_gaps.items(), key=lambda item: item[1])
    if block_size == 1:  # negative control: against the float32 state the same tolerances fail
        logit_gap, grad_gaps = _gaps(fast, _bf16_run("reference", "float32", block_size, ids))
        assert logit_gap > LOGIT_GAP or max(grad_gaps.values()) > GRADIENT_GAP


def test_the_fast_backend_refuses_a_model_dtype_history_set_after_the_config():
    """The config refuses "fast" with "model"; a config changed afterwards is refused when the backend is built."""
    config = tiny_dar_config(dar_implementation="two_phase", dar_history_dtype="model")
    model = DARForCausalLM(config)
    model.config.dar_implementation = "fast"
    with pytest.raises(ValueError, match="dar_history_dtype='model' needs dar_implementation 'two_phase'"):
        model(random_input_ids(seed=7))
