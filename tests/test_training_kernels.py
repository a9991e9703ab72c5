# SPDX-License-Identifier: Apache-2.0
"""The C++ kernels of the fused eager training path (`cpu_kernels.py`, `config.dar_training_kernel = "cpp"`):
`train_read` / `train_read_backward` for every read, `train_read_entry_gradients` for a block's reads at once,
`write_first` / `write_partial` / `write_backward` for every two-stream write, run by `FastDepthBackend` on CPU.

- Float64: the loss and every parameter gradient equal the reference backend's to 1e-12 (relative to the largest
  gradient) for every block size, routing, stream count, write mode and `dar_include_partial` of the inference
  grid, and every kernel runs (counted); activation checkpointing (reentrant and not) with frozen parameters
  (LoRA-style) too, and DAR-MoE against the PyTorch path in float32; a second backward through the same graph in
  `test_fast_path.py`.
- Float32 and bf16 (weights in bf16, DAR's parameters in float32): the kernels' error against the float64
  reference is within a small multiple of the PyTorch fast path's own (DESIGN.md section 4's rule); under bf16
  autocast the two paths agree to the branches' bf16 rounding, and a backward called inside the autocast block
  gives the gradients of one called outside it (every optimised backend).
- The depth weights a training forward records (`output_depth_weights`) are the reference's, to 1e-12 in float64.
- Each kernel's outputs are the same bits on one thread and on three (the sums over tokens go by fixed chunks).
- Under `torch.compile` with the default inlined read the option changes nothing: the traced forward runs the
  two-phase read, no kernel runs, and the gradients are the eager kernels' (with `dar_compiled_read="operator"` the
  kernels run inside the graph: `test_compiled_kernels.py`).
- A second derivative is refused; without a compiler a warning names the option and the PyTorch path trains.
- Negative control: a backward that drops the key-norm term is caught by the float64 comparison.
"""

import contextlib
import logging

import pytest
import torch
from conftest import (
    counted_cpu_kernels,
    perturb_dar_parameters,
    random_input_ids,
    tiny_dar_config,
    tiny_dar_moe,
    torch_threads,
)
from test_inference_backend import GRID, perturbed_dar

from dar_transformers import DARConfig, cpu_kernels, depth_backends


@pytest.fixture
def counted_kernels(monkeypatch):
    return counted_cpu_kernels(monkeypatch)


def with_training_kernels(model):
    model.config.dar_training_kernel = "cpp"
    return model


def loss_and_gradients(model, input_ids, run=None) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """One training forward and backward of `model` (through `run`, e.g. its compiled form, when given)."""
    model.zero_grad(set_to_none=True)
    loss = (model if run is None else run)(input_ids, labels=input_ids).loss
    loss.backward()
    return loss.detach(), {name: p.grad.clone() for name, p in model.named_parameters() if p.grad is not None}


def gradient_error(gradients: dict, expected: dict) -> float:
    """Largest absolute difference of any gradient, over the largest expected gradient (a per-tensor relative error
    is meaningless for gradients that are zero up to rounding, such as a first read's query over one source)."""
    assert gradients.keys() == expected.keys()
    scale = max(grad.double().abs().max() for grad in expected.values())
    return max((gradients[name].double() - expected[name].double()).abs().max() / scale for name in expected).item()


@pytest.mark.parametrize("block_size,routing,streams,write_mode,include_partial", GRID)
def test_training_with_the_kernels_matches_the_reference_in_float64(counted_kernels, block_size, routing, streams,
                                                                   write_mode, include_partial):
    fields = (block_size, routing, streams, write_mode, include_partial)
    reference = perturbed_dar(torch.float64, "reference", *fields).train()
    model = with_training_kernels(perturbed_dar(torch.float64, "fast", *fields)).train()
    input_ids = random_input_ids()
    expected_loss, expected = loss_and_gradients(reference, input_ids)
    loss, gradients = loss_and_gradients(model, input_ids)
    assert abs(loss - expected_loss) <= 1e-12 * abs(expected_loss)
    assert gradient_error(gradients, expected) <= 1e-12
    config = model.config
    reads = config.dar_num_branches + 1  # every branch and the final readout
    assert counted_kernels.calls["train_read"] == counted_kernels.calls["train_read_backward"] == reads
    blocks = -(-config.dar_num_branches // config.dar_block_size)
    assert 0 < counted_kernels.calls["train_read_entry_gradients"] <= blocks + 1  # a block's reads at once
    if streams == 2:  # the forward's writes, and backward's replay of each block's partials (the lean hooks)
        sizes = [min(config.dar_block_size, config.dar_num_branches - start)
                 for start in range(0, config.dar_num_branches, config.dar_block_size)]
        replayed = [size - 1 for size in sizes if size > 1]  # the writes before a block's commit
        assert counted_kernels.calls["write_first"] == blocks + len(replayed)
        assert counted_kernels.calls.get("write_partial", 0) == (config.dar_num_branches - blocks
                                                                 + sum(writes - 1 for writes in replayed))
        assert counted_kernels.calls["write_backward"] == config.dar_num_branches
    else:  # one stream writes y unchanged: no write kernel
        assert "write_backward" not in counted_kernels.calls


def test_depth_weights_recorded_in_training_are_the_references(counted_kernels):
    """A training forward that records its depth weights takes the reference backend (they carry gradients there,
    `depth_backend`): the kernels do not run, and the weights are the reference's."""
    input_ids = random_input_ids()
    recorded = []
    for implementation in ("reference", "fast"):
        model = perturbed_dar(torch.float64, implementation, 3, "dar", 2, "duplicate", True).train()
        output = with_training_kernels(model)(input_ids, labels=input_ids, output_depth_weights=True)
        output.loss.backward()
        recorded.append(output.depth_weights)
    expected, weights = recorded
    assert counted_kernels.calls.get("train_read", 0) == 0 and len(weights) == len(expected)
    for got, want in zip(weights, expected):
        assert got.requires_grad
        torch.testing.assert_close(got, want, rtol=0, atol=1e-12)


def without_the_key_norm(read_backward, *args):
    """A read backward kernel (`train_read_backward`, `read_sources_backward`: the sources' inverse RMS is their
    fifth argument) given zeros for the inverse RMS: no key scale, no norm term (negative controls)."""
    args = list(args)
    args[4] = torch.zeros_like(args[4])
    return read_backward(*args)


def test_negative_control_a_read_backward_without_the_key_norm_term_is_caught(counted_kernels):
    fields = (2, "dar", 2, "duplicate", True)
    input_ids = random_input_ids()
    _, expected = loss_and_gradients(perturbed_dar(torch.float64, "reference", *fields).train(), input_ids)
    counted_kernels.replace["train_read_backward"] = without_the_key_norm
    _, gradients = loss_and_gradients(with_training_kernels(perturbed_dar(torch.float64, "fast", *fields)), input_ids)
    assert gradient_error(gradients, expected) > 1e-3


def _errors_against_float64(dtype: torch.dtype, make_model) -> tuple[float, float]:
    """(kernels, PyTorch fast path): each one's gradient error in `dtype` against the float64 reference."""
    input_ids = random_input_ids()
    _, expected = loss_and_gradients(make_model(torch.float64, "reference"), input_ids)
    errors = []
    for kernel in ("cpp", "torch"):
        model = make_model(torch.float32, "fast")
        model.config.dar_training_kernel = kernel
        _, gradients = loss_and_gradients(model.to(dtype) if dtype != torch.float32 else model, input_ids)
        errors.append(gradient_error(gradients, expected))
    return errors[0], errors[1]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_float32_and_bf16_training_is_as_close_to_float64_as_the_pytorch_path(counted_kernels, dtype):
    def make_model(model_dtype, implementation):
        model = perturbed_dar(torch.float32, implementation, 3, "dar", 2, "duplicate", True).train()
        model.to(model_dtype)
        if model_dtype == torch.bfloat16:  # as `from_pretrained(dtype=bfloat16)` loads it: DAR's parameters float32
            for name, parameter in model.named_parameters():
                if "residual" in name or "readout" in name:
                    parameter.data = parameter.data.float()
        return model

    kernels, pytorch = _errors_against_float64(dtype, make_model)
    assert counted_kernels.calls["train_read_backward"] > 0 and counted_kernels.calls["write_backward"] > 0
    assert kernels <= 4 * pytorch + (1e-6 if dtype == torch.float32 else 1e-3)


def test_training_under_bf16_autocast_with_the_kernels_matches_the_pytorch_path(counted_kernels):
    """Under autocast the branches run in bf16 and the depth path in float32 on both paths, so the two agree to the
    bf16 rounding of the branches (a depth path left in bf16 would miss by far more)."""
    input_ids = random_input_ids()
    results = []
    for kernel in ("torch", "cpp"):
        model = perturbed_dar(torch.float32, "fast", 3, "dar", 2, "duplicate", True).train()
        model.config.dar_training_kernel = kernel
        with torch.autocast("cpu", dtype=torch.bfloat16):
            results.append(loss_and_gradients(model, input_ids))
    (expected_loss, expected), (loss, gradients) = results
    assert counted_kernels.calls["train_read_backward"] > 0
    assert abs(loss - expected_loss) <= 1e-3 * abs(expected_loss)
    assert gradient_error(gradients, expected) <= 2e-2


@pytest.mark.parametrize("implementation,kernel", [("fast", "torch"), ("fast", "cpp"), ("two_phase", "torch")])
def test_a_backward_called_inside_autocast_gives_the_gradients_of_one_called_outside(implementation, kernel):
    """`loss.backward()` within the `torch.autocast` block: the hand-written backwards run with autocast off, as
    their forwards do, so the gradients are those of a backward called after the block, bit for bit (the PyTorch fast
    path's backward raised a dtype error on its float32 products before; the two-phase read's backward mixed in bf16,
    a read gate's gradient 0.24 relative off, inside the 2e-2 this test allowed then)."""
    input_ids = random_input_ids()
    results = []
    for inside in (False, True):
        model = perturbed_dar(torch.float32, implementation, 3, "dar", 2, "duplicate", True).train()
        model.config.dar_training_kernel = kernel
        with torch.autocast("cpu", dtype=torch.bfloat16):
            loss = model(input_ids, labels=input_ids).loss
            if inside:
                loss.backward()
        if not inside:
            loss.backward()
        results.append((loss.detach(), {name: p.grad for name, p in model.named_parameters() if p.grad is not None}))
    (expected_loss, expected), (loss, gradients) = results
    assert loss == expected_loss
    assert gradients.keys() == expected.keys()
    for name, gradient in expected.items():
        torch.testing.assert_close(gradients[name], gradient, rtol=0, atol=0, msg=name)


@pytest.mark.parametrize("use_reentrant", [False, True])
def test_dar_moe_gradient_checkpointing_and_frozen_parameters_with_the_kernels(counted_kernels, use_reentrant):
    input_ids = random_input_ids()
    moe = tiny_dar_moe(dar_block_size=3).train()  # float32: the experts' grouped product takes no float64
    perturb_dar_parameters(moe, scale=0.5, seed=1)
    _, expected = loss_and_gradients(moe, input_ids)
    _, gradients = loss_and_gradients(with_training_kernels(moe), input_ids)
    assert counted_kernels.calls["train_read_backward"] > 0
    assert gradient_error(gradients, expected) <= 1e-5

    model = perturbed_dar(torch.float64, "fast", 3, "dar", 2, "duplicate", True).train()
    for name, parameter in model.named_parameters():  # only the attention projections and the DAR queries train
        parameter.requires_grad_("q_proj" in name or "pseudo_query" in name)
    _, expected = loss_and_gradients(model, input_ids)
    with_training_kernels(model).activation_checkpointing_enable(
        activation_checkpointing_kwargs={"use_reentrant": use_reentrant}
    )
    calls = counted_kernels.calls.get("train_read", 0)
    _, gradients = loss_and_gradients(model, input_ids)
    assert gradient_error(gradients, expected) <= 1e-12
    assert counted_kernels.calls["train_read"] > calls + model.config.dar_num_branches  # replayed in backward


def test_each_training_kernel_gives_the_same_bits_on_one_thread_and_on_three():
    module = cpu_kernels.cpu_kernels()
    generator = torch.Generator().manual_seed(0)
    batch, tokens, streams, hidden, entries = 3, 200, 2, 32, 4  # 600 rows: split over threads, 19 chunks
    history = torch.randn(entries + 1, batch, tokens, streams, hidden, generator=generator)
    inv_rms = torch.rand(entries + 1, batch, tokens, streams, generator=generator) + 0.5
    partial = torch.randn(batch, tokens, streams, hidden, generator=generator)
    query, gate = torch.randn(streams, hidden, generator=generator), torch.rand(streams, generator=generator)
    grad_u = torch.randn(batch, tokens, hidden, generator=generator)
    grad_state = torch.randn(batch, tokens, streams, hidden, generator=generator)
    beta, rho = torch.randn(streams, hidden, generator=generator), torch.tensor([0.3])
    written = torch.randn(batch, tokens, hidden, generator=generator).bfloat16()
    routes = ([1, 0], [0, 1])  # key streams, value streams: DAR's reciprocal addressing

    def every_kernel():
        u, weights, keyed, partial_inv_rms = module.train_read(query, gate, history, inv_rms, entries, partial,
                                                               *routes, 1e-5)
        backward = module.train_read_backward(grad_u, query, gate, history, inv_rms, entries, partial,
                                              partial_inv_rms, weights, keyed, *routes)
        grad_entries = torch.ones_like(history)  # added into
        module.train_read_entry_gradients(history, grad_entries, [grad_u, grad_u * 2], [query, query * 3],
                                          [backward[3], backward[3][:2].clone()], routes[0])
        return [u, weights, keyed, partial_inv_rms, *backward, grad_entries,
                *module.write_backward(grad_state, partial, rho, beta, written),
                *module.write_backward(grad_state, None, None, beta, written)]

    with torch_threads(1):
        single = every_kernel()
    with torch_threads(3):
        split = every_kernel()
    assert all(torch.equal(a, b) for a, b in zip(split, single))


def test_compiled_training_with_the_option_runs_no_kernel_and_matches_eager(counted_kernels):
    torch._dynamo.reset()
    model = with_training_kernels(perturbed_dar(torch.float32, "fast", 3, "dar", 2, "duplicate", True)).train()
    input_ids = random_input_ids()
    _, expected = loss_and_gradients(model, input_ids)
    calls = dict(counted_kernels.calls)
    _, gradients = loss_and_gradients(model, input_ids, run=torch.compile(model, fullgraph=True))
    assert counted_kernels.calls == calls  # the traced forward ran the two-phase read
    assert gradient_error(gradients, expected) <= 1e-5


def test_the_kernels_refuse_double_backward(counted_kernels):
    model = with_training_kernels(perturbed_dar(torch.float64, "fast", 3, "dar", 2, "duplicate", True)).train()
    model.set_attn_implementation("eager")  # SDPA on CPU has no double backward of its own
    input_ids = random_input_ids()
    loss = model(input_ids, labels=input_ids).loss
    with pytest.raises(RuntimeError, match=r"_KernelDepthRead is differentiable once only \(once_differentiable\)"):
        torch.autograd.grad(loss, model.model.layers[0].self_attn.q_proj.weight, create_graph=True)


def test_without_a_compiler_a_warning_names_the_option_and_pytorch_trains(monkeypatch, caplog):
    import torch.utils.cpp_extension

    def no_compiler(*args, **kwargs):
        raise RuntimeError("Ninja is required to load C++ extensions")

    monkeypatch.setattr(cpu_kernels, "_loaded", {})
    monkeypatch.setattr(torch.utils.cpp_extension, "load_inline", no_compiler)
    model = perturbed_dar(torch.float32, "fast", 3, "dar", 2, "duplicate", True).train()
    input_ids = random_input_ids()
    _, expected = loss_and_gradients(model, input_ids)
    with caplog.at_level(logging.WARNING, logger="dar_transformers.cpu_kernels"):
        _, gradients = loss_and_gradients(with_training_kernels(model), input_ids)
    warnings = [record.getMessage() for record in caplog.records if record.levelno == logging.WARNING]
    assert len(warnings) == 1 and "dar_training_kernel='cpp'" in warnings[0] and "Ninja is required" in warnings[0]
    assert all(torch.equal(gradients[name], expected[name]) for name in expected)


def test_the_option_round_trips_and_a_bad_value_names_the_field(tmp_path):
    config = tiny_dar_config(dar_training_kernel="cpp")
    config.save_pretrained(tmp_path)
    assert DARConfig.from_pretrained(tmp_path).dar_training_kernel == "cpp"
    with pytest.raises(Exception, match=r"dar_training_kernel must be one of \['torch', 'cpp'\], got 'cuda'"):
        tiny_dar_config(dar_training_kernel="cuda")


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_the_kernels_partials_rebuilt_in_backward_give_the_gradients_of_keeping_them(counted_kernels, dtype):
    """With the kernels, the lean backward replays a block's writes with the kernels' own write (`write_first`,
    `write_partial`), whose rounding differs from PyTorch's: gradients bit for bit those of keeping every partial."""
    model = with_training_kernels(perturbed_dar(dtype, "fast", 3, "dar", 2, "duplicate", True)).train()
    input_ids = random_input_ids()
    _, lean = loss_and_gradients(model, input_ids)
    replays = counted_kernels.calls["write_partial"]
    backend = depth_backends.FastDepthBackend
    original = backend.keeping_partials_lean
    backend.keeping_partials_lean = lambda self: contextlib.nullcontext()
    try:
        _, kept = loss_and_gradients(model, input_ids)
    finally:
        backend.keeping_partials_lean = original
    assert counted_kernels.calls["write_partial"] < 2 * replays  # the first run replayed writes in its backward
    for name, gradient in kept.items():
        assert torch.equal(lean[name], gradient), name
