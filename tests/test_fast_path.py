# SPDX-License-Identifier: Apache-2.0
"""The fused eager fast path ("fast", the eager default): its building blocks against plain autograd and a readable
loop: the fused depth read's hand-written backward (gradcheck in float64, every routing, with and without the
partial), the fused transport + write, their refusal of double backward, and the inference memo of parameter-derived
tensors."""

import contextlib
import copy

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
    DepthGradients,
    add_entry_gradients,
    _depth_read_forward,
    _TransportWrite,
    commit_entry,
    depth_read,
    cast_gated_write,
    inverse_rms,
    routed_queries,
    transport_write,
)

def _commit_all(entries, spare_slots=2):
    """What the model does: commit the entries into a larger depth-major buffer (copies and inverse RMS; unused
    slots NaN so that a read past the committed ones shows) -> (committed entries, buffers, shared gradients)."""
    history_buffer = entries[0].new_full((len(entries) + spare_slots, *entries[0].shape), float("nan"))
    inv_rms_buffer = history_buffer[..., 0].clone()
    gradients = DepthGradients()
    committed = [commit_entry(entry, history_buffer, inv_rms_buffer, slot, DEPTH_EPS, gradients)
                 for slot, entry in enumerate(entries)]
    return committed, history_buffer, inv_rms_buffer, gradients


def _fast_read(entries, partial, query, gate, key_streams, value_streams):
    committed, history_buffer, inv_rms_buffer, gradients = _commit_all(entries)
    routed = routed_queries(query, key_streams)
    return depth_read(routed, gate, history_buffer, inv_rms_buffer, committed, partial, key_streams, value_streams,
                      DEPTH_EPS, gradients)[0]


@pytest.mark.parametrize("with_partial", [True, False])
@pytest.mark.parametrize("routing", sorted(DEPTH_ROUTINGS))
def test_depth_read_gradcheck(routing, with_partial):
    key_streams, value_streams = DEPTH_ROUTINGS[routing]
    entries, partial, query, gate = depth_read_inputs(len(key_streams), with_partial=with_partial)
    inputs = [query, gate, *entries] + ([partial] if with_partial else [])

    def function(query, gate, *sources):  # the model copies an entry into the buffer when it commits it
        entries, partial = (sources[:-1], sources[-1]) if with_partial else (sources, None)
        return _fast_read(list(entries), partial, query, gate, key_streams, value_streams)

    assert torch.autograd.gradcheck(function, inputs, eps=1e-6, atol=1e-8)


@pytest.mark.parametrize("with_partial", [True, False])
@pytest.mark.parametrize("routing", sorted(DEPTH_ROUTINGS))
def test_depth_read_matches_the_loop_and_plain_autograd(routing, with_partial):
    """Values and gradients against the per-stream loop, and against autograd through the same fused math."""
    key_streams, value_streams = DEPTH_ROUTINGS[routing]
    entries, partial, query, gate = depth_read_inputs(len(key_streams), with_partial=with_partial, seed=1)
    inputs = [query, gate, *entries] + ([partial] if with_partial else [])
    fast = _fast_read(entries, partial, query, gate, key_streams, value_streams)
    assert fast.grad_fn is not None and type(fast.grad_fn).__name__ == "_DepthReadBackward"
    sources = torch.stack([*entries, partial] if with_partial else entries, dim=2)  # [B, T, N, J, D]
    loop = loop_depth_read(query, gate, sources, key_streams, value_streams)
    history = torch.stack([*entries, partial] if with_partial else entries)  # [N, B, T, J, D]
    plain, *_ = _depth_read_forward(
        routed_queries(query, key_streams), gate, history, inverse_rms(history, DEPTH_EPS), key_streams,
        value_streams,
    )
    torch.testing.assert_close(fast, loop, rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(plain, loop, rtol=1e-12, atol=1e-12)
    upstream = torch.randn_like(fast)
    fast_grads = torch.autograd.grad((fast * upstream).sum(), inputs)
    for other in (loop, plain):
        for grad, reference in zip(fast_grads, torch.autograd.grad((other * upstream).sum(), inputs)):
            torch.testing.assert_close(grad, reference, rtol=1e-10, atol=1e-12)


def test_depth_read_negative_control_stale_buffer():
    """The forward reads the buffer, not the entries: a buffer out of sync with the entries must show."""
    key_streams, value_streams = DEPTH_ROUTINGS["dar"]
    entries, partial, query, gate = depth_read_inputs(2, seed=2)
    committed, history_buffer, inv_rms_buffer, gradients = _commit_all(entries)
    history_buffer[1] += 1.0
    routed = routed_queries(query, key_streams)
    stale = depth_read(routed, gate, history_buffer, inv_rms_buffer, committed, partial, key_streams, value_streams,
                       DEPTH_EPS, gradients)[0]
    fresh = _fast_read(entries, partial, query, gate, key_streams, value_streams)
    assert (stale - fresh).abs().max() > 1e-2


def test_depth_read_saves_only_per_token_scalars():
    """Memory contract of #7: besides the inputs it already holds, the read saves nothing entry-sized."""
    key_streams, value_streams = DEPTH_ROUTINGS["dar"]
    entries, partial, query, gate = depth_read_inputs(2, num_sources=5, hidden=64, seed=3)
    entry_numel = partial.numel()
    saved = []
    committed, history_buffer, inv_rms_buffer, gradients = _commit_all(entries)
    routed = routed_queries(query, key_streams).detach().requires_grad_()
    with torch.autograd.graph.saved_tensors_hooks(lambda tensor: saved.append(tensor) or tensor, lambda tensor: tensor):
        depth_read(routed, gate, history_buffer, inv_rms_buffer, committed, partial, key_streams, value_streams,
                   DEPTH_EPS, gradients)
    large = [tuple(tensor.shape) for tensor in saved if tensor.numel() >= entry_numel and tensor is not partial]
    assert large == [], large
    per_token = [tensor for tensor in saved if tensor.dim() == 4 and tensor.shape[0] == len(entries) + 1]
    assert len(per_token) == 1  # the key dots, [N, B, T, J] (backward recomputes the softmax weights from them)


@pytest.mark.parametrize("implementation", ["fast", "two_phase"])  # both optimised backends memoise their gates
@pytest.mark.parametrize("block_size", [1, 3])
def test_parameter_memo_follows_in_place_updates(block_size, implementation):
    """No-grad forwards memoise gates; an in-place update (an optimiser step, a load) must invalidate them."""
    model = perturbed_tiny_dar(block_size, implementation)
    ids = torch.randint(0, 64, (2, 7), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        model(ids)  # fills the memo
        for name, parameter in model.named_parameters():
            if "_residual" in name or "final_readout" in name:
                parameter.mul_(-1.5)
        memoised = model(ids).logits
    torch.testing.assert_close(memoised, memo_free_logits(model, ids), rtol=0, atol=0)
    with torch.no_grad():
        state = {name: tensor.clone() for name, tensor in model.state_dict().items()}
        model.load_state_dict({name: tensor * 0.5 if "gate" in name else tensor for name, tensor in state.items()})
        after_load = model(ids).logits
    torch.testing.assert_close(after_load, memo_free_logits(model, ids), rtol=0, atol=0)
    assert (after_load - memoised).abs().max() > 1e-4  # the load changed the function, and the memo saw it


@pytest.mark.parametrize("write", ["through .data", "through another view of the storage"])
def test_parameter_memo_sees_writes_that_bump_no_version_counter(write, monkeypatch):
    """A hand-written SGD or EMA step through `.data`, or parameters that are views of a flat buffer written in place,
    bump no parameter's version counter: the memo's stamp stayed as it was, and no-grad forwards (evaluation,
    `generate`) kept the old gates and queries (logits 3e-2 and 4e-1 off). The memo now compares the values."""
    model = perturbed_tiny_dar(3, "fast")
    ids = torch.randint(0, 64, (2, 7), generator=torch.Generator().manual_seed(0))
    parameters = [p for name, p in model.named_parameters() if "_residual" in name or "final_readout" in name]
    if write != "through .data":
        flat = torch.cat([p.detach().reshape(-1) for p in parameters])
        offset = 0
        for parameter in parameters:
            parameter.data = flat[offset : offset + parameter.numel()].view_as(parameter)
            offset += parameter.numel()
    with torch.no_grad():
        before = model(ids).logits  # fills the memo
    if write == "through .data":
        for parameter in parameters:
            parameter.data.add_(torch.randn_like(parameter), alpha=0.3)
    else:
        flat.mul_(-1.5)
    with torch.no_grad():
        after = model(ids).logits
    torch.testing.assert_close(after, memo_free_logits(model, ids), rtol=0, atol=0)
    assert (after - before).abs().max() > 1e-3  # the write changed the function
    # Negative control: without the comparison the memo serves the old values.
    monkeypatch.setattr(depth_backends._Contents, "unchanged", lambda self: True)
    with torch.no_grad():
        model(ids)
        for written in [parameter.data for parameter in parameters] if write == "through .data" else [flat]:
            written.mul_(2.0)
        stale = model(ids).logits
    assert (stale - memo_free_logits(model, ids)).abs().max() > 1e-4


def test_parameter_memo_filled_in_inference_mode_serves_no_grad_forwards():
    """A memo filled by a `torch.inference_mode()` forward (its copies were inference tensors) then checked by a
    no-grad forward (`generate`): the check wrote into an inference tensor outside inference mode and raised."""
    model = perturbed_tiny_dar(3, "fast")
    ids = torch.randint(0, 64, (2, 7), generator=torch.Generator().manual_seed(0))
    with torch.inference_mode():
        first = model(ids).logits
    with torch.no_grad():
        again = model(ids).logits
    torch.testing.assert_close(again, first, rtol=0, atol=0)
    assert model.generate(ids, max_new_tokens=2, do_sample=False).shape == (2, 9)


@pytest.mark.parametrize("change", ["replaced submodule", "direct _modules write", "parametrization",
                                    "inference-mode model"])
def test_parameter_memo_follows_module_surgery_and_refuses_what_it_cannot_stamp(change):
    """The memo's stamp walked a list of each residual's submodules made at its first no-grad forward: a submodule
    assigned later (`residual.depth_attention = ...`), or the parameter a parametrization registers, was never
    stamped, and no-grad logits stayed those of the old module (0.1-2.0 off). A parametrized parameter is computed
    at each lookup (no stamp can vouch for it: derived at every forward), and a model built under
    `torch.inference_mode()` has parameters that count no versions (they crashed every no-grad forward)."""
    ids = torch.randint(0, 64, (2, 7), generator=torch.Generator().manual_seed(4))
    if change == "inference-mode model":
        with torch.inference_mode():
            model = perturbed_tiny_dar(2, "two_phase")
        with torch.inference_mode():
            first = model(ids).logits
            torch.testing.assert_close(model(ids).logits, first, rtol=0, atol=0)
        return
    model = perturbed_tiny_dar(2, "two_phase")
    donor = perturbed_tiny_dar(2, "two_phase").model.layers[0].mlp_residual  # built first: its registrations count
    with torch.no_grad():
        donor.depth_attention.pseudo_query.normal_()
        before = model(ids).logits  # fills the memo
    residual = model.model.layers[1].attn_residual
    if change in ("replaced submodule", "direct _modules write"):  # the second runs no registration hook
        if change == "replaced submodule":
            residual.depth_attention = donor.depth_attention
            model.model.final_readout.read_gate = donor.read_gate
        else:
            residual._modules["depth_attention"] = donor.depth_attention
            model.model.final_readout._modules["read_gate"] = donor.read_gate
    else:
        torch.nn.utils.parametrize.register_parametrization(residual.depth_attention, "pseudo_query", _Doubled())
        with torch.no_grad():
            model(ids)
            residual.depth_attention.parametrizations.pseudo_query.original.mul_(-3)
    with torch.no_grad():
        after = model(ids).logits
    with torch.enable_grad():
        torch.testing.assert_close(after, model(ids).logits.detach(), rtol=0, atol=1e-6)
    assert (after - before).abs().max() > 1e-3


@pytest.mark.parametrize("implementation", ["fast", "two_phase"])
def test_a_dar_parameter_frozen_as_a_buffer_is_read_at_every_forward(implementation):
    """A DAR parameter made a buffer (to freeze it) and then changed in place: buffers were neither stamped nor
    copied, so the memo served the old gates (logits 8e-2 off the reference). A derivation reading a non-parameter
    keeps no memo now."""
    model = perturbed_tiny_dar(2, implementation)
    ids = torch.randint(0, 64, (2, 7), generator=torch.Generator().manual_seed(4))
    gate = model.model.layers[1].mlp_residual.write_gate
    value = gate.logit.detach().clone()
    del gate.logit
    gate.register_buffer("logit", value)
    with torch.no_grad():
        before = model(ids).logits  # fills the memo, as before the fix
        gate.logit.add_(1.0)
        after = model(ids).logits
        model.config.dar_implementation = "reference"
        expected = model(ids).logits
    torch.testing.assert_close(after, expected, rtol=0, atol=1e-5)
    assert (after - before).abs().max() > 1e-3


@pytest.mark.parametrize("reparametrise", ["weight_norm", "spectral_norm"])
def test_a_legacy_hook_reparametrisation_of_a_dar_module_is_refused(reparametrise):
    """`torch.nn.utils.weight_norm` / `spectral_norm` compute the parameter in the module's forward pre-hook, which the
    optimised backends never call: they used the value of its last run (logits 0.18 off the reference, with gradients
    on and off). Refused, naming the module and the parametrization form they read; the reference backend runs it."""
    model = perturbed_tiny_dar(2, "fast")
    ids = torch.randint(0, 64, (1, 5), generator=torch.Generator().manual_seed(1))
    attention = model.model.layers[1].attn_residual.depth_attention
    with pytest.warns(FutureWarning) if reparametrise == "weight_norm" else contextlib.nullcontext():
        getattr(torch.nn.utils, reparametrise)(attention, "pseudo_query", dim=0)
    with pytest.raises(ValueError, match=r"layers\.1\.attn_residual\.depth_attention is reparametrised by "
                                         r"(Weight|Spectral)Norm .* torch\.nn\.utils\.parametrizations"):
        model(ids)
    model.config.dar_implementation = "reference"
    model(ids)
    model.config.dar_implementation = "two_phase"
    with torch.no_grad(), pytest.raises(ValueError, match="reparametrised by"):
        model(ids)


class _Doubled(torch.nn.Module):
    def forward(self, weight):
        return 2 * weight


@pytest.mark.parametrize("implementation", ["fast", "two_phase"])
def test_parameter_memo_follows_dtype_changes(implementation):
    model = perturbed_tiny_dar(2, implementation)
    ids = torch.randint(0, 64, (1, 5), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        float32_logits = model(ids).logits
        model.double()
        float64_logits = model(ids).logits
    assert float64_logits.dtype == torch.float64
    torch.testing.assert_close(float64_logits.float(), float32_logits, rtol=1e-4, atol=1e-4)


def test_depth_mixing_stays_float32_under_bf16_autocast():
    """The precision policy holds under mixed precision: autocast must not push the depth products to bf16."""
    model = perturbed_tiny_dar(3, "fast")
    ids = torch.randint(0, 64, (2, 7), generator=torch.Generator().manual_seed(2))
    records = []

    def record(module, args, output):
        records.append(output[-1].dtype)

    handle = model.model.layers[1].register_forward_hook(record)  # output[-1] is the last committed (float32) entry
    with torch.autocast("cpu", dtype=torch.bfloat16):
        model(ids)
    handle.remove()
    entries, partial, query, gate = depth_read_inputs(2, seed=3)
    entries, partial = [entry.detach().float() for entry in entries], partial.detach().float()
    query, gate = query.detach().float(), gate.detach().float()
    key_streams, value_streams = DEPTH_ROUTINGS["dar"]
    plain = _fast_read(entries, partial, query, gate, key_streams, value_streams)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        autocast = _fast_read(entries, partial, query, gate, key_streams, value_streams)
    assert records == [torch.float32]
    assert autocast.dtype == torch.float32
    torch.testing.assert_close(autocast, plain, rtol=0, atol=0)


def test_every_backend_keeps_the_depth_mixing_float32_under_bf16_autocast():
    """The reference backend, the oracle, ran its depth softmax and mixing under autocast in bf16 (depth weights bf16,
    3.8e-3 off the optimised backends'); every backend, with gradients on and off, now gives float32 depth weights
    within float32 rounding of each other."""
    ids = torch.randint(0, 64, (2, 7), generator=torch.Generator().manual_seed(5))
    weights = {}
    for implementation in ("reference", "fast", "two_phase"):
        model = perturbed_tiny_dar(1, implementation)
        for grad in (True, False):
            with torch.set_grad_enabled(grad), torch.autocast("cpu", dtype=torch.bfloat16):
                recorded = model(ids, output_depth_weights=True).depth_weights
            assert all(read.dtype == torch.float32 for read in recorded), (implementation, grad)
            weights[implementation, grad] = recorded
    for key, recorded in weights.items():
        for read, expected in zip(recorded, weights["reference", True]):
            torch.testing.assert_close(read.detach(), expected.detach(), rtol=0, atol=1e-5, msg=str(key))


@pytest.mark.parametrize("implementation, overrides", [
    ("fast", {}), ("two_phase", {}), ("fast", {"dar_training_kernel": "cpp"}),
])
def test_depth_weights_recorded_with_gradients_carry_the_references_gradient(implementation, overrides):
    """The optimised backends returned the depth weights of `output_depth_weights=True` without gradients (marked
    non-differentiable), the reference with them: a loss using them (here a depth-entropy regulariser) silently lost
    that term, 0.34 relative off the reference's query gradient. Such a forward now takes the reference backend
    whatever the config names; float64 gradients equal the reference's, and the term is not negligible (control)."""
    ids = torch.randint(0, 64, (2, 7), generator=torch.Generator().manual_seed(5))
    gradients = {}
    for name, config, weight in (("reference", {}, 0.1), (implementation, overrides, 0.1), ("reference", {}, 0.0)):
        model = perturbed_tiny_dar(2, name, **config).double().train()
        output = model(ids, labels=ids, output_depth_weights=True)
        assert all(read.requires_grad for read in output.depth_weights)
        entropy = -sum((read * read.clamp_min(1e-30).log()).sum() for read in output.depth_weights)
        (output.loss + weight * entropy).backward()
        gradients[name, weight] = {key: p.grad.clone() for key, p in model.named_parameters() if p.grad is not None}
    expected, got, without = gradients["reference", 0.1], gradients[implementation, 0.1], gradients["reference", 0.0]
    assert got.keys() == expected.keys()
    for key, gradient in expected.items():
        torch.testing.assert_close(got[key], gradient, rtol=1e-10, atol=1e-12, msg=key)
    query = "model.layers.1.attn_residual.depth_attention.pseudo_query"
    assert (without[query] - expected[query]).abs().max() > 1e-2 * expected[query].abs().max()


def test_transport_write_gradcheck_and_plain_autograd():
    """The fused transport + write (its backward keeps P and y only) against gradcheck and autograd's own graph."""
    generator = torch.Generator().manual_seed(5)
    partial = torch.randn(2, 3, 2, 5, generator=generator, dtype=torch.float64, requires_grad=True)
    rho = torch.tensor([0.8], dtype=torch.float64, requires_grad=True)
    beta = torch.rand(2, 5, generator=generator, dtype=torch.float64, requires_grad=True)
    branch_output = torch.randn(2, 3, 5, generator=generator, dtype=torch.float64, requires_grad=True)
    upstream = torch.randn(2, 3, 2, 5, generator=generator, dtype=torch.float64)
    for inputs in [(partial, rho, beta, branch_output), (None, None, beta, branch_output)]:  # inside / opening a block
        differentiable = [tensor for tensor in inputs if tensor is not None]
        assert torch.autograd.gradcheck(
            lambda *args: _TransportWrite.apply(*inputs[: 4 - len(args)], *args), differentiable, eps=1e-6, atol=1e-8
        )
        fused = torch.autograd.grad((_TransportWrite.apply(*inputs) * upstream).sum(), differentiable)
        plain = torch.autograd.grad((cast_gated_write(*inputs) * upstream).sum(), differentiable)
        for grad, reference in zip(fused, plain):
            torch.testing.assert_close(grad, reference, rtol=1e-12, atol=1e-12)
    # A transport that forgot the swap (rho ignored) must not pass for this one.
    written = branch_output.unsqueeze(-2)
    assert (transport_write(partial, torch.ones_like(rho), beta, written)
            - transport_write(partial, rho, beta, written)).abs().max() > 1e-2


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_transport_write_without_autograd_gives_the_differentiable_forms_bits(dtype):
    """Without autograd (the forward of `_TransportWrite`, the lean replays) the transport lerps each stream into its
    half of the result instead of lerping a flipped copy: the same values bit for bit, as the replays require."""
    generator = torch.Generator().manual_seed(3)
    partial = torch.randn(2, 7, 2, 33, generator=generator, dtype=dtype)
    rho = torch.rand(1, generator=generator, dtype=dtype)
    beta = torch.rand(2, 33, generator=generator, dtype=dtype)
    written = torch.randn(2, 7, 1, 33, generator=generator, dtype=dtype)
    plain = torch.addcmul(torch.lerp(partial.flip(-2), partial, rho), beta, written)
    assert torch.equal(transport_write(partial, rho, beta, written), plain)
    assert torch.equal(transport_write(partial, rho.requires_grad_(), beta, written).detach(), plain)  # autograd form


def test_transport_write_keeps_the_branch_output_in_the_model_dtype():
    """bf16 training: backward keeps y as the branch produced it (bf16), not a float32 copy, and the gradients equal
    those through a float32 y to float32 rounding (the cast is exact)."""
    generator = torch.Generator().manual_seed(6)
    partial = torch.randn(2, 3, 2, 8, generator=generator, requires_grad=True)
    rho = torch.tensor([0.8], requires_grad=True)
    beta = torch.rand(2, 8, generator=generator, requires_grad=True)
    branch_output = torch.randn(2, 3, 8, generator=generator).bfloat16().requires_grad_()
    saved = []
    with torch.autograd.graph.saved_tensors_hooks(lambda tensor: saved.append(tensor) or tensor, lambda tensor: tensor):
        written = _TransportWrite.apply(partial, rho, beta, branch_output)
    assert written.dtype == torch.float32
    assert [tensor.dtype for tensor in saved if tensor.shape == branch_output.shape] == [torch.bfloat16]
    upstream = torch.randn(2, 3, 2, 8, generator=generator)
    fused = torch.autograd.grad((written * upstream).sum(), (partial, rho, beta, branch_output))
    plain = torch.autograd.grad((cast_gated_write(partial, rho, beta, branch_output) * upstream).sum(),
                                (partial, rho, beta, branch_output))
    for grad, reference in zip(fused, plain):
        assert grad.dtype == reference.dtype
        torch.testing.assert_close(grad, reference, rtol=1e-6, atol=1e-6)


def _perturbed_with_option(block_size, implementation):
    """`perturbed_tiny_dar`, where "fast+cpp" is the fast backend with the C++ training kernels."""
    implementation, _, kernel = implementation.partition("+")
    return perturbed_tiny_dar(block_size, implementation, dar_training_kernel=kernel or "torch")


@pytest.mark.parametrize("checkpointing", [False, True])
@pytest.mark.parametrize("implementation", ["fast", "fast+cpp", "two_phase"])
@pytest.mark.parametrize("block_size", [1, 3])
def test_shared_entry_gradients_start_clean_for_a_second_backward(block_size, implementation, checkpointing):
    """The fast reads add the entries' gradients into one shared buffer that the commits empty: a second backward
    through the same graph (retain_graph) must give the same gradients, not twice them (two-phase too, whose
    backward rebuilds each block's partials; and the C++ training kernels, whose reads defer their entry gradients).
    With HF's gradient checkpointing (non-reentrant) a layer recomputed in backward stages its partial in its
    block's committed slot and stops before the commit: the fast path's second backward was wrong by 1.5 relative
    (the final readout, never recomputed, and the recomputed later layers read a partial for a committed entry)."""
    model = _perturbed_with_option(block_size, implementation).train()
    if checkpointing:
        model.gradient_checkpointing_enable()  # transformers 5: use_reentrant=False
    ids = torch.randint(0, 64, (2, 7), generator=torch.Generator().manual_seed(6))
    loss = model(ids, labels=ids).loss
    loss.backward(retain_graph=True)
    first = {name: parameter.grad.clone() for name, parameter in model.named_parameters()}
    model.zero_grad(set_to_none=True)
    loss.backward()
    for name, parameter in model.named_parameters():
        torch.testing.assert_close(parameter.grad, first[name], rtol=0, atol=0, msg=name)
    assert first["model.embed_tokens.weight"].abs().sum() > 0


@pytest.mark.parametrize("implementation", ["fast", "fast+cpp", "two_phase"])
@pytest.mark.parametrize("block_size", [1, 3])
def test_second_backward_with_a_frozen_embedding(block_size, implementation):
    """As under LoRA: with the embedding frozen, entry 0 needs no gradient (the fast path has no commit node to empty
    its slot); every trainable parameter gets its gradient, and a second backward through the same graph gives the
    first one's (the C++ kernels' deferred entry gradients of entry 0 are never added: no commit node takes them)."""
    model = _perturbed_with_option(block_size, implementation).train()
    model.model.embed_tokens.weight.requires_grad_(False)
    ids = torch.randint(0, 64, (2, 7), generator=torch.Generator().manual_seed(7))
    loss = model(ids, labels=ids).loss
    loss.backward(retain_graph=True)
    first = {name: parameter.grad.clone() for name, parameter in model.named_parameters() if parameter.requires_grad}
    model.zero_grad(set_to_none=True)
    loss.backward()
    for name, parameter in model.named_parameters():
        if parameter.requires_grad:
            torch.testing.assert_close(parameter.grad, first[name], rtol=0, atol=0, msg=name)
    assert model.model.embed_tokens.weight.grad is None
    assert first["model.layers.0.self_attn.q_proj.weight"].abs().sum() > 0


@pytest.mark.parametrize("frozen, block_size", [("embedding and the first layer", 4), ("all but the MLPs", 3)])
@pytest.mark.parametrize("implementation", ["fast", "fast+cpp", "two_phase"])
def test_gradients_where_a_block_starts_with_frozen_branches(implementation, frozen, block_size):
    """The lean backward rebuilds a block's partials by replaying its writes from the first: with the embedding and a
    block's first branch frozen (LoRA on the MLPs only, frozen bottom layers) that write kept no gradient and was not
    recorded, so the next write opened a block of its own, replayed from no partial: gradients 4e-2 (MLP-only) to
    0.8 (frozen first layer) relative off the reference. Float64."""
    model = _perturbed_with_option(block_size, implementation).double().train()
    reference = copy.deepcopy(model)
    reference.config.dar_implementation = "reference"
    for network in (model, reference):
        for name, parameter in network.named_parameters():
            trainable = (".mlp." in name if frozen == "all but the MLPs" else
                         not name.startswith(("model.embed_tokens", "model.layers.0.")))
            parameter.requires_grad_(trainable)
    ids = torch.randint(0, 64, (2, 7), generator=torch.Generator().manual_seed(7))
    model(ids, labels=ids).loss.backward()
    reference(ids, labels=ids).loss.backward()
    trained = [(name, parameter, reference.get_parameter(name)) for name, parameter in model.named_parameters()
               if parameter.requires_grad]
    assert any(name.startswith("model.layers.1.mlp") for name, _, _ in trained)
    for name, parameter, expected in trained:
        torch.testing.assert_close(parameter.grad, expected.grad, rtol=1e-10, atol=1e-12, msg=name)


def _refuses_a_differentiable_gradient(output, inputs):
    """A backward with create_graph=True through a hand-written backward raises at once, naming the way out."""
    with pytest.raises(RuntimeError, match="differentiable once only \\(once_differentiable\\).*dar_implementation "
                                           "= 'reference'"):
        torch.autograd.grad(output, inputs, create_graph=True)


def test_depth_read_refuses_double_backward():
    """Issue 16 item 5: the hand-written backwards (read, commit) fail loudly on a second derivative instead of
    computing it wrong."""
    key_streams, value_streams = DEPTH_ROUTINGS["dar"]
    entries, partial, query, gate = depth_read_inputs(2, seed=4)
    branch_input = _fast_read(entries, partial, query, gate, key_streams, value_streams)
    assert type(branch_input.grad_fn).__name__ == "_DepthReadBackward"
    _refuses_a_differentiable_gradient(branch_input.pow(2).sum(), query)
    entries, partial, query, gate = depth_read_inputs(2, seed=5)  # the commits' backward: an entry's gradient
    branch_input = _fast_read(entries, partial, query, gate, key_streams, value_streams)
    _refuses_a_differentiable_gradient(branch_input.pow(2).sum(), entries[0])


def test_transport_write_refuses_double_backward():
    generator = torch.Generator().manual_seed(7)
    partial = torch.randn(2, 3, 2, 5, generator=generator, dtype=torch.float64, requires_grad=True)
    rho = torch.tensor([0.8], dtype=torch.float64, requires_grad=True)
    beta = torch.rand(2, 5, generator=generator, dtype=torch.float64, requires_grad=True)
    branch_output = torch.randn(2, 3, 5, generator=generator, dtype=torch.float64, requires_grad=True)
    written = _TransportWrite.apply(partial, rho, beta, branch_output)
    _refuses_a_differentiable_gradient(written.pow(2).sum(), beta)


@pytest.mark.parametrize("implementation", ["fast", "two_phase"])
@pytest.mark.parametrize("second", ["backward", "autograd.grad", "backward(inputs=)"])
def test_model_training_refuses_double_backward(implementation, second):
    """End to end: a gradient penalty through the optimised paths fails with a clear error, where the reference (plain
    autograd) computes it (eager token attention: SDPA on CPU has no double backward of its own). The error came
    only from a second `.backward()`: taken as `torch.autograd.grad(penalty, weight)` or `backward(inputs=[weight])`
    (how Hessian-vector products and penalties are written) it never ran and the result was silently wrong, 0.9-1.0
    relative (a helper's repro). Now the first backward that asks for a differentiable gradient refuses."""
    ids = torch.randint(0, 64, (2, 7), generator=torch.Generator().manual_seed(10))
    results = {}
    for backend in ("reference", implementation):
        model = perturbed_tiny_dar(2, "fast").train()
        model.config.dar_implementation = backend
        model.set_attn_implementation("eager")
        weight = model.model.layers[0].self_attn.q_proj.weight
        loss = model(ids, labels=ids).loss
        if backend != "reference":
            _refuses_a_differentiable_gradient(loss, weight)
            continue
        (grad,) = torch.autograd.grad(loss, weight, create_graph=True)
        penalty = grad.pow(2).sum()
        if second == "autograd.grad":
            results[backend] = torch.autograd.grad(penalty, weight)[0]
        else:
            penalty.backward(inputs=[weight] if second == "backward(inputs=)" else None)
            results[backend] = weight.grad
        assert results[backend].abs().sum() > 0


@pytest.mark.parametrize("key_streams", [(1, 0), (0, 1), (0, 0), (0,)])
def test_a_blocks_deferred_entry_gradients_are_each_reads_terms_added(key_streams):
    """`add_entry_gradients` (the fast path's reads' entry gradients, deferred and added per block in PyTorch) against
    the equation written per read, entry, token and stream: c^v g_r + sum_{j: kappa(j) = v} gk^j q^j_r + k^v B^v_s,
    in float64, for reads of different entry counts (a block's reads and the final readout, which sees one entry
    more), every key routing and one stream. Entries no read saw, and the buffer's spare slot, keep what they held."""
    generator = torch.Generator().manual_seed(0)
    streams, (batch, tokens, hidden), slots = len(key_streams), (2, 3, 5), 4
    history = torch.randn(slots, batch, tokens, streams, hidden, generator=generator, dtype=torch.float64)
    held = torch.randn(history.shape, generator=generator, dtype=torch.float64)
    counts = (2, 2, 3, 2)
    grads_u = [torch.randn(batch, tokens, hidden, generator=generator, dtype=torch.float64) for _ in counts]
    queries = [torch.randn(streams, hidden, generator=generator, dtype=torch.float64) for _ in counts]
    coefficients = [torch.randn(count, batch, tokens, 3, streams, generator=generator, dtype=torch.float64)
                    for count in counts]
    expected = held.clone()
    for count, grad_u, query, coefficient in zip(counts, grads_u, queries, coefficients):
        for entry in range(count):
            for stream in range(streams):
                value, key, norm = (coefficient[entry, :, :, kind] for kind in range(3))
                term = value[..., stream, None] * grad_u + norm[..., stream, None] * history[entry, :, :, stream]
                for target, key_stream in enumerate(key_streams):
                    if key_stream == stream:
                        term = term + key[..., target, None] * query[target]
                expected[entry, :, :, stream] += term
    grad_entries = held.clone()
    add_entry_gradients(history, grad_entries, grads_u, queries, coefficients, list(key_streams))
    torch.testing.assert_close(grad_entries, expected, rtol=1e-13, atol=1e-13)
    assert torch.equal(grad_entries[3], held[3])
