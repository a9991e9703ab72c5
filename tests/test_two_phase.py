# SPDX-License-Identifier: Apache-2.0
"""The two-phase backend ("two_phase"; eagerly here, its traced training reads are checked in test_compile.py): its
building blocks against plain autograd and a readable loop: phase 1 + phase 2 against the per-stream softmax over all
sources (values and every gradient, float64, every routing, with and without the partial), gradcheck of the
hand-written backward, its refusal of double backward, what it keeps for backward, the write's model-dtype branch
output, and the inference memo of parameter-derived tensors."""

import contextlib

import pytest
import torch

from conftest import (
    DEPTH_EPS,
    DEPTH_ROUTINGS,
    depth_read_inputs,
    loop_depth_read,
    memo_free_logits,
    perturbed_tiny_dar,
)
from dar_transformers import depth_backends
from dar_transformers.depth_backends import (
    DepthState,
    TwoPhaseDepthBackend,
    inverse_rms,
    phase_one,
    routed_queries,
    two_phase_read,
)

def _two_phase(entries, partial, query, gate, key_streams, value_streams, other_queries=()):
    """What the backend does: inverse RMS at each commit, phase 1 (planned together with `other_queries`, as a decoder
    layer plans its attention and MLP reads) without autograd, phase 2 with the read's gradient."""
    with torch.no_grad():
        history_inv_rms = torch.stack([inverse_rms(entry, DEPTH_EPS) for entry in entries])  # [S, B, T, J]
        routed_all = torch.cat([routed_queries(q, key_streams) for q in (query, *other_queries)], dim=1)
        phase = phase_one(routed_all, torch.stack(entries), history_inv_rms, key_streams, value_streams)[0]
    state = DepthState(None, partial, tuple(entries), history_inv_rms)
    return two_phase_read(routed_queries(query, key_streams), gate, state, partial, phase, key_streams, value_streams,
                          DEPTH_EPS)


@pytest.mark.parametrize("with_partial", [True, False])
@pytest.mark.parametrize("routing", sorted(DEPTH_ROUTINGS))
def test_two_phase_read_gradcheck(routing, with_partial):
    key_streams, value_streams = DEPTH_ROUTINGS[routing]
    entries, partial, query, gate = depth_read_inputs(len(key_streams), with_partial=with_partial)
    inputs = [query, gate, *entries] + ([partial] if with_partial else [])

    def function(query, gate, *sources):
        entries, partial = (sources[:-1], sources[-1]) if with_partial else (sources, None)
        return _two_phase(list(entries), partial, query, gate, key_streams, value_streams)[0]

    assert torch.autograd.gradcheck(function, inputs, eps=1e-6, atol=1e-8)


@pytest.mark.parametrize("entry_chunk", [8, 3])
@pytest.mark.parametrize("with_partial", [True, False])
@pytest.mark.parametrize("routing", sorted(DEPTH_ROUTINGS))
def test_two_phase_read_matches_the_loop(routing, with_partial, entry_chunk, monkeypatch):
    """Values, depth weights and every gradient against the per-stream softmax over all N sources, float64 to
    1e-12; phase 1 planned together with another read's query, as in a decoder layer. The backward takes the 4
    entries in one chunk, and in chunks of 3 and 1."""
    monkeypatch.setattr(depth_backends, "READ_BACKWARD_ENTRY_CHUNK", entry_chunk)
    key_streams, value_streams = DEPTH_ROUTINGS[routing]
    entries, partial, query, gate = depth_read_inputs(len(key_streams), with_partial=with_partial, seed=1)
    other_query = torch.randn_like(query)
    inputs = [query, gate, *entries] + ([partial] if with_partial else [])
    fast, weights = _two_phase(entries, partial, query, gate, key_streams, value_streams, (other_query,))
    assert type(fast.grad_fn).__name__ == "_TwoPhaseReadBackward"
    sources = torch.stack([*entries, partial] if with_partial else entries, dim=2)  # [B, T, N, J, D]
    loop = loop_depth_read(query, gate, sources, key_streams, value_streams)
    torch.testing.assert_close(fast, loop, rtol=1e-12, atol=1e-12)
    assert weights.shape == (sources.shape[2], *fast.shape[:2], len(key_streams))  # [N, B, T, J]
    torch.testing.assert_close(weights.sum(0), torch.ones_like(weights[0]), rtol=1e-12, atol=1e-12)
    upstream = torch.randn_like(fast)
    fast_grads = torch.autograd.grad((fast * upstream).sum(), inputs)
    for grad, reference in zip(fast_grads, torch.autograd.grad((loop * upstream).sum(), inputs)):
        torch.testing.assert_close(grad, reference, rtol=1e-10, atol=1e-12)


def test_negative_control_phase_one_must_see_the_entries():
    """Phase 2 trusts phase 1: a phase 1 of other entries (a stale plan) must change the read."""
    key_streams, value_streams = DEPTH_ROUTINGS["dar"]
    entries, partial, query, gate = depth_read_inputs(2, seed=2)
    fresh = _two_phase(entries, partial, query, gate, key_streams, value_streams)[0]
    stale_entries = [entries[0], *(entry + 1.0 for entry in entries[1:])]
    with torch.no_grad():
        history_inv_rms = torch.stack([inverse_rms(entry, DEPTH_EPS) for entry in stale_entries])
        routed = routed_queries(query, key_streams)
        stale_phase = phase_one(routed, torch.stack(stale_entries), history_inv_rms, key_streams, value_streams)[0]
    state = DepthState(None, partial, tuple(entries), history_inv_rms)
    stale = two_phase_read(routed, gate, state, partial, stale_phase, key_streams, value_streams, DEPTH_EPS)[0]
    assert (stale - fresh).abs().max() > 1e-2


def test_two_phase_read_refuses_double_backward():
    """The backward is hand-written: a second derivative must fail loudly, not come out wrong."""
    key_streams, value_streams = DEPTH_ROUTINGS["dar"]
    entries, partial, query, gate = depth_read_inputs(2, seed=4)
    branch_input = _two_phase(entries, partial, query, gate, key_streams, value_streams)[0]
    with pytest.raises(RuntimeError, match=r"differentiable once only \(once_differentiable\)"):
        torch.autograd.grad(branch_input.pow(2).sum(), query, create_graph=True)


def test_two_phase_read_saves_only_per_token_scalars():
    """What backward keeps of a read (DESIGN.md section 7): the entries and the partial (alive anyway) and per-token
    statistics; no stacked history, no Obar, nothing else entry-sized."""
    key_streams, value_streams = DEPTH_ROUTINGS["dar"]
    entries, partial, query, gate = depth_read_inputs(2, num_sources=5, hidden=64, seed=3)
    saved = []
    with torch.autograd.graph.saved_tensors_hooks(lambda tensor: saved.append(tensor) or tensor, lambda tensor: tensor):
        _two_phase(entries, partial, query, gate, key_streams, value_streams)
    kept_anyway = {id(tensor) for tensor in (*entries, partial)}
    large = [tuple(tensor.shape) for tensor in saved if tensor.numel() >= partial.numel() and id(tensor) not in kept_anyway]
    assert large == [], large
    per_token = [tensor for tensor in saved if tensor.dim() == 4 and tensor.shape[0] == len(entries) + 1]
    assert len(per_token) == 1  # the softmax weights [N, B, T, J]; key dots are recomputed


def test_write_keeps_the_branch_output_in_the_model_dtype():
    """bf16 training: the write keeps y as the branch produced it (bf16) for backward, not a float32 copy, and the
    partial once (the transport is one product with P)."""
    model = perturbed_tiny_dar(3, "two_phase").train()
    residual = model.model.layers[0].mlp_residual  # branch 1: inside a block, so it transports the partial
    backend = TwoPhaseDepthBackend(model.config)
    generator = torch.Generator().manual_seed(6)
    state = backend.start(torch.randn(2, 3, 2, 32, generator=generator))
    partial = torch.randn(2, 3, 2, 32, generator=generator, requires_grad=True)
    state = DepthState(backend, partial, state.history, state.history_inv_rms)
    branch_output = torch.randn(2, 3, 32, generator=generator).bfloat16().requires_grad_()
    saved = []
    with torch.autograd.graph.saved_tensors_hooks(lambda tensor: saved.append(tensor) or tensor, lambda tensor: tensor):
        written = backend.write(residual, state, branch_output, commits=False).partial
    assert written.dtype == torch.float32
    storages = {tensor.untyped_storage().data_ptr(): tensor for tensor in saved}  # a tensor saved twice counts once
    entry_sized = [(tensor.dtype, tuple(tensor.shape)) for tensor in storages.values()
                   if tensor.numel() >= branch_output.numel()]
    assert sorted(entry_sized, key=str) == sorted(
        [(torch.bfloat16, (2, 3, 1, 32)), (torch.float32, tuple(partial.shape))], key=str
    ), entry_sized
    reference = model.model.layers[0].mlp_residual.write_gate(branch_output.float(), partial)
    torch.testing.assert_close(written, reference, rtol=1e-6, atol=1e-6)
    upstream = torch.randn_like(written)
    fused = torch.autograd.grad((written * upstream).sum(), (partial, branch_output))
    plain = torch.autograd.grad((reference * upstream).sum(), (partial, branch_output))
    for grad, expected in zip(fused, plain):
        torch.testing.assert_close(grad.float(), expected.float(), rtol=1e-2, atol=1e-5)


# The memo's in-place and dtype tests run for both backends in test_fast_path.py.


def test_depth_mixing_stays_float32_under_bf16_autocast():
    """The precision policy holds under mixed precision: autocast must not push the depth products to bf16."""
    model = perturbed_tiny_dar(3, "two_phase")
    ids = torch.randint(0, 64, (2, 7), generator=torch.Generator().manual_seed(2))
    records = []

    def record(module, args, output):
        records.append(output[-1].dtype)

    handle = model.model.layers[1].register_forward_hook(record)  # output[-1] is the last committed (float32) entry
    with torch.autocast("cpu", dtype=torch.bfloat16):
        model(ids)
    handle.remove()
    entries, partial, _, _ = depth_read_inputs(2, hidden=32, seed=3)
    entries, partial = [entry.detach().float() for entry in entries], partial.detach().float()
    backend = TwoPhaseDepthBackend(model.config)
    history_inv_rms = torch.stack([inverse_rms(entry, model.config.rms_norm_eps) for entry in entries])
    state = DepthState(backend, partial, tuple(entries), history_inv_rms)
    residual = model.model.layers[1].mlp_residual
    plain, _ = backend.read(residual, state, True)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        autocast, _ = backend.read(residual, state, True)
    assert records == [torch.float32]
    assert autocast.dtype == torch.float32
    torch.testing.assert_close(autocast, plain, rtol=0, atol=0)


# A second backward and training with a frozen embedding run for both backends in test_fast_path.py.


def _saved_storages(model, ids):
    """Distinct storages autograd keeps in one training forward: {data_ptr: tensor}."""
    saved = {}

    def record(tensor):
        saved[tensor.untyped_storage().data_ptr()] = tensor
        return tensor

    with torch.autograd.graph.saved_tensors_hooks(record, lambda tensor: tensor):
        loss = model(ids, labels=ids).loss
    return loss, saved


def _kept_and_lean_gradients_agree(model, ids, state_shape, dtype) -> tuple[int, int]:
    """(state-sized tensors kept with the lean hooks, without them), after checking that both backwards give the same
    parameter gradients bit for bit."""
    def state_sized(saved):
        return [tensor for tensor in saved.values() if tensor.shape == state_shape and tensor.dtype == dtype]

    loss, saved = _saved_storages(model, ids)
    lean_kept = len(state_sized(saved))
    loss.backward()
    lean = {name: parameter.grad.clone() for name, parameter in model.named_parameters()}

    model.zero_grad(set_to_none=True)
    backend = depth_backends.ALL_DEPTH_BACKENDS[model.config.dar_implementation]
    original = backend.keeping_partials_lean
    backend.keeping_partials_lean = lambda self: contextlib.nullcontext()
    try:
        loss, saved = _saved_storages(model, ids)  # negative control: without the rebuild the partials are kept
        kept = len(state_sized(saved))
        loss.backward()
    finally:
        backend.keeping_partials_lean = original
    for name, parameter in model.named_parameters():
        torch.testing.assert_close(lean[name], parameter.grad, rtol=0, atol=0, msg=name)
    return lean_kept, kept


@pytest.mark.parametrize("block_size", [1, 2, 3, 4])
def test_backward_keeps_no_float32_partial_state(block_size):
    """DESIGN.md section 7: of the DAR state, backward keeps the committed entries only; the partial states of a block
    are rebuilt from the branch outputs it keeps anyway, and so is the entry of a block of one write (beta * y: Full
    DAR's every entry; with 4 branches, block size 3 ends with one). Gradients are those of keeping them (bit for
    bit), and the enclosing saved-tensor hooks (here the recording) still see everything that is kept."""
    model = perturbed_tiny_dar(block_size, "two_phase").train()
    ids = torch.randint(0, 64, (2, 7), generator=torch.Generator().manual_seed(8))
    num_branches = model.config.dar_num_branches
    blocks = [min(block_size, num_branches - start) for start in range(0, num_branches, block_size)]
    num_entries = 1 + sum(size > 1 for size in blocks)  # the embedding, then one per block of two writes or more
    lean_kept, kept = _kept_and_lean_gradients_agree(model, ids, (2, 7, 2, 32), torch.float32)
    assert lean_kept == num_entries
    assert kept == 1 + len(blocks) + sum(size - 1 for size in blocks)  # every entry and every partial


@pytest.mark.parametrize("block_size", [1, 2, 3, 4])
def test_the_fast_path_keeps_no_float32_partial_state_either(block_size):
    """The fast path (the eager default) keeps its committed entries in its history buffer, and its reads and writes
    kept every partial state P in float32 (issue 16 item 2: bf16 saved activations 1.461x Llama's); the same hooks
    now replace them by handles, rebuilt in backward by replaying the block's writes with the path's own write.
    Gradients bit for bit those of keeping them; none kept, against every partial without the hooks."""
    model = perturbed_tiny_dar(block_size, "fast").train()
    ids = torch.randint(0, 64, (2, 7), generator=torch.Generator().manual_seed(8))
    num_branches = model.config.dar_num_branches
    blocks = [min(block_size, num_branches - start) for start in range(0, num_branches, block_size)]
    lean_kept, kept = _kept_and_lean_gradients_agree(model, ids, (2, 7, 2, 32), torch.float32)
    assert lean_kept == 0
    assert kept == sum(size - 1 for size in blocks)  # every partial that is not committed


def test_full_dar_entries_kept_in_the_model_dtype_are_rebuilt_too():
    """With the history in the model dtype (`dar_history_dtype="model"`, bf16 here) a block of one write commits
    (beta * y) cast to bf16: rebuilt in that dtype, gradients bit for bit those of keeping it."""
    model = perturbed_tiny_dar(1, "two_phase", dar_history_dtype="model").to(torch.bfloat16).train()
    ids = torch.randint(0, 64, (2, 7), generator=torch.Generator().manual_seed(8))
    lean_kept, kept = _kept_and_lean_gradients_agree(model, ids, (2, 7, 2, 32), torch.bfloat16)
    assert (lean_kept, kept) == (1, 5)  # the embedding entry only, against it and the 4 commits


@pytest.mark.parametrize("implementation", ["two_phase", "fast"])
def test_parameter_memo_does_not_survive_a_fused_optimiser_step(implementation):
    """`AdamW(fused=True)` (the Trainer's default) updates parameters without bumping their version counters: an
    evaluation after a training step must see the new parameters (it read stale memoised gates once). Both
    memoising backends share `_derived`."""
    model = perturbed_tiny_dar(2, implementation)
    ids = torch.randint(0, 64, (2, 7), generator=torch.Generator().manual_seed(9))
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-1, fused=True)
    with torch.no_grad():
        before = model(ids).logits  # fills the memo
    model.train()
    model(ids, labels=ids).loss.backward()
    optimizer.step()
    model.eval()
    with torch.no_grad():
        memoised = model(ids).logits
    torch.testing.assert_close(memoised, memo_free_logits(model, ids), rtol=0, atol=0)
    assert (memoised - before).abs().max() > 1e-3
