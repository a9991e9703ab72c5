# SPDX-License-Identifier: Apache-2.0
"""The fast path's building blocks against plain autograd: the committed-entry depth attention's hand-written
backward (gradcheck in float64, every routing), and the inference memo of parameter-derived tensors."""

import itertools

import pytest
import torch

from dar_transformers import DARConfig, DARForCausalLM
from dar_transformers.configuration_dar import ROUTING_KEY_VALUE_STREAMS
from dar_transformers.modeling_dar import (
    _committed_forward,
    _TransportWrite,
    depth_attention_committed,
    inverse_rms,
    routed_queries,
    transport_write,
)

ROUTINGS = {name: tuple(zip(*pairs)) for name, pairs in ROUTING_KEY_VALUE_STREAMS.items()}
ROUTINGS["one-stream"] = ((0,), (0,))


def _committed_inputs(num_streams, num_sources=4, num_queries=2, batch=2, tokens=3, hidden=6, seed=0):
    generator = torch.Generator().manual_seed(seed)
    entries = [
        torch.randn(batch, tokens, num_streams, hidden, generator=generator, dtype=torch.float64).requires_grad_()
        for _ in range(num_sources)
    ]
    queries = torch.randn(num_queries, num_streams, hidden, generator=generator, dtype=torch.float64).requires_grad_()
    return queries, entries


def _committed(queries, history_buffer, inv_rms_buffer, entries, key_streams, value_streams):
    """The fast path's phase 1 for queries [Q, J, D] (routed the way the model routes them)."""
    routed = routed_queries(queries, key_streams)
    return depth_attention_committed(routed, history_buffer, inv_rms_buffer, entries, key_streams, value_streams)


def _fill_buffers(entries, eps):
    with torch.no_grad():
        history = torch.stack(entries)  # [S, B, T, J, D]
        return history.clone(), inverse_rms(history, eps)


@pytest.mark.parametrize("routing", sorted(ROUTINGS))
def test_committed_depth_attention_gradcheck(routing):
    key_streams, value_streams = ROUTINGS[routing]
    queries, entries = _committed_inputs(len(key_streams))

    def function(queries, *entries):  # the model writes an entry's copy into the buffer when it commits it
        history_buffer, inv_rms_buffer = _fill_buffers(entries, eps=1e-6)
        mixed, lse = _committed(queries, history_buffer, inv_rms_buffer, entries, key_streams, value_streams)
        return (*mixed, *lse)

    assert torch.autograd.gradcheck(function, (queries, *entries), eps=1e-6, atol=1e-8)


@pytest.mark.parametrize("routing", sorted(ROUTINGS))
def test_committed_depth_attention_matches_plain_autograd(routing):
    """The custom function (buffer reads, manual backward) equals autograd through the same math on the entries."""
    key_streams, value_streams = ROUTINGS[routing]
    queries, entries = _committed_inputs(len(key_streams), seed=1)
    history_buffer, inv_rms_buffer = _fill_buffers(entries, eps=1e-6)
    mixed, lse = _committed(queries, history_buffer, inv_rms_buffer, entries, key_streams, value_streams)
    history = torch.stack(entries)
    reference_mixed, reference_lse, _, _ = _committed_forward(
        routed_queries(queries, key_streams), history, inverse_rms(history, 1e-6), key_streams, value_streams
    )  # [B, T, J, Q, D], [B, T, Q, J]
    (mixed, lse) = (torch.stack(mixed, dim=3), torch.stack(lse, dim=2))
    torch.testing.assert_close(mixed, reference_mixed, rtol=0, atol=1e-12)
    torch.testing.assert_close(lse, reference_lse, rtol=0, atol=1e-12)
    upstream = torch.randn_like(mixed), torch.randn_like(lse)
    grads = torch.autograd.grad((mixed * upstream[0]).sum() + (lse * upstream[1]).sum(), (queries, *entries))
    reference_grads = torch.autograd.grad(
        (reference_mixed * upstream[0]).sum() + (reference_lse * upstream[1]).sum(), (queries, *entries)
    )
    for grad, reference in zip(grads, reference_grads):
        torch.testing.assert_close(grad, reference, rtol=1e-10, atol=1e-12)


@pytest.mark.parametrize("routing", ["dar", "fixedkv"])
def test_committed_depth_attention_with_unused_outputs(routing):
    """A branch reads one query's mix and another query's log-sum-exp: the missing gradients count as zero."""
    key_streams, value_streams = ROUTINGS[routing]
    queries, entries = _committed_inputs(2, num_queries=3, seed=4)
    history_buffer, inv_rms_buffer = _fill_buffers(entries, eps=1e-6)
    mixed, lse = _committed(queries, history_buffer, inv_rms_buffer, entries, key_streams, value_streams)
    history = torch.stack(entries)
    reference_mixed, reference_lse, _, _ = _committed_forward(
        routed_queries(queries, key_streams), history, inverse_rms(history, 1e-6), key_streams, value_streams
    )
    grads = torch.autograd.grad(mixed[1].square().sum() + lse[2].sum(), (queries, *entries))
    reference_grads = torch.autograd.grad(
        reference_mixed[:, :, :, 1].square().sum() + reference_lse[:, :, 2].sum(), (queries, *entries)
    )
    for grad, reference in zip(grads, reference_grads):
        torch.testing.assert_close(grad, reference, rtol=1e-10, atol=1e-12)


def test_committed_depth_attention_negative_control_stale_buffer():
    """The forward reads the buffer, not the entries: a buffer out of sync with the entries must show."""
    key_streams, value_streams = ROUTINGS["dar"]
    queries, entries = _committed_inputs(2, seed=2)
    history_buffer, inv_rms_buffer = _fill_buffers(entries, eps=1e-6)
    history_buffer[1] += 1.0
    mixed, _ = _committed(queries, history_buffer, inv_rms_buffer, entries, key_streams, value_streams)
    history = torch.stack(entries)
    reference, _, _, _ = _committed_forward(
        routed_queries(queries, key_streams), history, inverse_rms(history, 1e-6), key_streams, value_streams
    )
    assert (torch.stack(mixed, dim=3) - reference).abs().max() > 1e-2


def _perturbed_tiny_dar(block_size):
    torch.manual_seed(0)
    config = DARConfig(
        hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
        vocab_size=64, dar_block_size=block_size,
    )
    model = DARForCausalLM(config).eval()
    with torch.no_grad():
        for name, parameter in model.named_parameters():
            if "_residual" in name or "final_readout" in name:
                parameter.add_(0.3 * torch.randn_like(parameter))
    return model


@pytest.mark.parametrize("block_size", [1, 3])
def test_parameter_memo_follows_in_place_updates(block_size):
    """No-grad forwards memoise gates; an in-place update (an optimiser step, a load) must invalidate them."""
    model = _perturbed_tiny_dar(block_size)
    ids = torch.randint(0, 64, (2, 7), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        model(ids)  # fills the memo
        for name, parameter in model.named_parameters():
            if "_residual" in name or "final_readout" in name:
                parameter.mul_(-1.5)
        memoised = model(ids).logits
    recomputed = model(ids).logits.detach()  # gradients on: nothing is memoised
    torch.testing.assert_close(memoised, recomputed, rtol=0, atol=0)
    with torch.no_grad():
        state = {name: tensor.clone() for name, tensor in model.state_dict().items()}
        model.load_state_dict({name: tensor * 0.5 if "gate" in name else tensor for name, tensor in state.items()})
        after_load = model(ids).logits
    torch.testing.assert_close(after_load, model(ids).logits.detach(), rtol=0, atol=0)
    assert (after_load - memoised).abs().max() > 1e-4  # the load changed the function, and the memo saw it


def test_parameter_memo_follows_dtype_changes():
    model = _perturbed_tiny_dar(2)
    ids = torch.randint(0, 64, (1, 5), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        float32_logits = model(ids).logits
        model.double()
        float64_logits = model(ids).logits
    assert float64_logits.dtype == torch.float64
    torch.testing.assert_close(float64_logits.float(), float32_logits, rtol=1e-4, atol=1e-4)


def test_depth_mixing_stays_float32_under_bf16_autocast():
    """The precision policy holds under mixed precision: autocast must not push the depth products to bf16."""
    model = _perturbed_tiny_dar(3)
    ids = torch.randint(0, 64, (2, 7), generator=torch.Generator().manual_seed(2))
    records = []

    def record(module, args, output):
        records.append(output[0].dtype)

    handle = model.model.layers[1].register_forward_hook(record)  # output[0] is the float32 partial state
    with torch.autocast("cpu", dtype=torch.bfloat16):
        model(ids)
    handle.remove()
    queries, entries = _committed_inputs(2, seed=3)
    queries, entries = queries.detach().float(), [entry.detach().float() for entry in entries]
    history_buffer, inv_rms_buffer = _fill_buffers(entries, eps=1e-6)
    key_streams, value_streams = ROUTINGS["dar"]
    plain = _committed(queries, history_buffer, inv_rms_buffer, entries, key_streams, value_streams)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        autocast = _committed(queries, history_buffer, inv_rms_buffer, entries, key_streams, value_streams)
    assert records == [torch.float32]
    for plain_output, autocast_output in zip((*plain[0], *plain[1]), (*autocast[0], *autocast[1])):
        assert autocast_output.dtype == torch.float32
        torch.testing.assert_close(autocast_output, plain_output, rtol=0, atol=0)


def test_transport_write_gradcheck_and_plain_autograd():
    """The fused transport + write (its backward keeps P and y only) against gradcheck and autograd's own graph."""
    generator = torch.Generator().manual_seed(5)
    partial = torch.randn(2, 3, 2, 5, generator=generator, dtype=torch.float64, requires_grad=True)
    rho = torch.tensor([0.8], dtype=torch.float64, requires_grad=True)
    beta = torch.rand(2, 5, generator=generator, dtype=torch.float64, requires_grad=True)
    branch_output = torch.randn(2, 3, 1, 5, generator=generator, dtype=torch.float64, requires_grad=True)
    inputs = (partial, rho, beta, branch_output)
    assert torch.autograd.gradcheck(_TransportWrite.apply, inputs, eps=1e-6, atol=1e-8)
    upstream = torch.randn(2, 3, 2, 5, generator=generator, dtype=torch.float64)
    fused = torch.autograd.grad((_TransportWrite.apply(*inputs) * upstream).sum(), inputs)
    plain = torch.autograd.grad((transport_write(*inputs) * upstream).sum(), inputs)
    for grad, reference in zip(fused, plain):
        torch.testing.assert_close(grad, reference, rtol=1e-12, atol=1e-12)
    # A transport that forgot the swap (rho ignored) must not pass for this one.
    assert (transport_write(partial, torch.ones_like(rho), beta, branch_output)
            - transport_write(*inputs)).abs().max() > 1e-2
