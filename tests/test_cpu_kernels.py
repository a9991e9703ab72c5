# SPDX-License-Identifier: Apache-2.0
"""The C++ kernels of the inference depth path (`cpu_kernels.py`, `config.dar_inference_kernel = "cpp"`).

- Float64 logits equal the reference backend's to 1e-12 relative for every block size, routing, stream count,
  write mode and `dar_include_partial` of the inference backend's grid, and every kernel runs (counted); float32
  decoding with a KV cache gives the PyTorch path's greedy tokens and logits within float32 rounding; bf16 weights
  with a bf16 history and DAR-MoE too.
- Over more tokens than a call's grain (prefill) the rows are split over torch's threads: float64 logits still equal
  the reference's, and each kernel's outputs with three threads are those of one thread, bit for bit.
- They run only where they are meant to: not without the option, not when depth weights are recorded, not with
  gradients on.
- Where they cannot be built, a warning names the option and the PyTorch operations give the same logits.
- Negative control: a kernel read that leaves out the partial's merge is caught by the float64 comparison.
- A model folder carries the kernels' source (remote code), and a bad option value is refused naming the field.
"""

import logging
import os

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
from test_inference_backend import GRID, NUM_LAYERS, max_relative_diff, perturbed_dar

from dar_transformers import DARConfig, DARForCausalLM, cpu_kernels

KERNELS = ("phase_one", "read_partial", "write_first", "write_partial", "commit")


@pytest.fixture
def counted_kernels(monkeypatch):
    return counted_cpu_kernels(monkeypatch, KERNELS)


def with_kernels(model):
    model.config.dar_inference_kernel = "cpp"
    return model


@pytest.mark.parametrize("block_size,routing,streams,write_mode,include_partial", GRID)
def test_the_kernels_match_the_reference_in_float64(counted_kernels, block_size, routing, streams, write_mode,
                                                    include_partial):
    fields = (block_size, routing, streams, write_mode, include_partial)
    reference = perturbed_dar(torch.float64, "reference", *fields)
    model = with_kernels(perturbed_dar(torch.float64, "fast", *fields))
    input_ids = random_input_ids()
    with torch.no_grad():
        expected = reference(input_ids).logits
        logits = model(input_ids).logits
    assert max_relative_diff(logits, expected) <= 1e-12
    config = model.config
    blocks = -(-config.dar_num_branches // config.dar_block_size)
    partial_reads = sum(1 for index in range(config.dar_num_branches) if index % config.dar_block_size != 0)
    assert counted_kernels.calls["phase_one"] >= blocks + 1  # at least once per block, and the readout
    assert counted_kernels.calls["read_partial"] == (partial_reads if include_partial else 0)
    # every block's commit; entry 0 too when it is contiguous (one stream: the embedding itself, not an expanded view)
    assert counted_kernels.calls["commit"] == blocks + (streams == 1)
    two_stream_writes = partial_reads if streams == 2 else 0  # a write into an open block of two streams
    assert counted_kernels.calls["write_partial"] == two_stream_writes
    assert counted_kernels.calls["write_first"] == (blocks if streams == 2 else 0)  # a block's first write


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float64])
def test_a_read_in_the_branch_dtype_is_the_float32_read_rounded_and_writes_are_the_pytorch_ops(dtype):
    """read_partial writes u in the branch's dtype as `.to(dtype)` rounds the float32 u (so no conversion follows);
    write_first is beta * y exactly; write_partial is lerp + addcmul up to one rounding (a fused multiply-add)."""
    kernels = cpu_kernels.cpu_kernels()
    generator = torch.Generator().manual_seed(0)
    batch, tokens, streams, hidden = 2, 5, 2, 40

    def rand(*shape, dtype=torch.float32):
        return torch.randn(*shape, generator=generator).to(dtype)

    partial, query, gate = rand(batch, tokens, streams, hidden), rand(streams, hidden), rand(streams)
    mean, log_sum_exp = rand(batch, tokens, streams, hidden), rand(batch, tokens, streams)
    arguments = (partial, query, gate, mean, log_sum_exp, [1, 0], [0, 1], 1e-5)
    in_float32 = kernels.read_partial(*arguments, torch.empty(0))
    in_dtype = kernels.read_partial(*arguments, torch.empty(0, dtype=dtype))
    assert in_float32.dtype == torch.float32 and in_dtype.dtype == dtype
    assert torch.equal(in_dtype, in_float32.to(dtype))
    # the equation: u = sum_j gate_j Obar^j + sum_j gate_j sigmoid(z_j - L_j) (P^{nu(j)} - Obar^j), with
    # z_j = P^{kappa(j)} . q_j / sqrt(sum P^{kappa(j)}^2 + D eps) (key stream kappa = [1, 0], value stream nu = [0, 1])
    keys = partial.flip(-2)
    scores = (keys * query).sum(-1) * (keys.pow(2).sum(-1) + hidden * 1e-5).rsqrt()
    share = gate * torch.sigmoid(scores - log_sum_exp)
    expected = (gate.unsqueeze(-1) * mean).sum(-2) + (share.unsqueeze(-1) * (partial - mean)).sum(-2)
    torch.testing.assert_close(in_float32, expected, rtol=1e-5, atol=1e-5)
    assert not torch.allclose(in_float32, (gate.unsqueeze(-1) * mean).sum(-2), atol=1e-2)  # the partial is merged

    beta, rho, written = rand(streams, hidden), torch.sigmoid(rand(1)), rand(batch, tokens, hidden, dtype=torch.bfloat16)
    assert torch.equal(kernels.write_first(beta, written), beta * written.unsqueeze(-2))
    for weight in (rho, 1 - rho):  # both of torch.lerp's forms
        expected = torch.lerp(partial.flip(-2), partial, weight).addcmul_(beta, written.unsqueeze(-2))
        torch.testing.assert_close(kernels.write_partial(partial, weight, beta, written), expected, rtol=1e-6, atol=1e-6)


def test_negative_control_a_kernel_read_without_the_partial_merge_is_caught(counted_kernels):
    def without_the_merge(read_partial, partial, query, gate, mean, *rest):
        return (gate.unsqueeze(-1) * mean).sum(-2)  # phase 1's gated sum alone: the partial ignored

    counted_kernels.replace["read_partial"] = without_the_merge
    with pytest.raises(AssertionError):
        test_the_kernels_match_the_reference_in_float64(counted_kernels, 2, "dar", 2, "duplicate", True)


def test_cached_decoding_with_the_kernels_gives_the_pytorch_paths_tokens(counted_kernels):
    torch.manual_seed(0)
    model = DARForCausalLM(tiny_dar_config(num_hidden_layers=NUM_LAYERS, dar_block_size=3)).eval()
    perturb_dar_parameters(model, scale=0.5, seed=1)
    input_ids = random_input_ids(batch=2, length=6)
    options = dict(max_new_tokens=8, do_sample=False, output_logits=True, return_dict_in_generate=True)
    expected = model.generate(input_ids, **options)
    assert counted_kernels.calls["read_partial"] == 0  # the default: the PyTorch operations
    with_kernels(model)
    generated = model.generate(input_ids, **options)
    assert torch.equal(generated.sequences, expected.sequences)
    for logits, expected_logits in zip(generated.logits, expected.logits):
        torch.testing.assert_close(logits, expected_logits, rtol=1e-5, atol=1e-5)
    assert counted_kernels.calls["read_partial"] > 8  # prefill and every decoded token


def test_bf16_with_a_bf16_history_matches_the_pytorch_path(counted_kernels):
    torch.manual_seed(0)
    model = DARForCausalLM(tiny_dar_config(num_hidden_layers=NUM_LAYERS, dar_block_size=2,
                                           dar_implementation="two_phase", dar_history_dtype="model"))
    perturb_dar_parameters(model, scale=0.5, seed=1)
    model = model.to(torch.bfloat16).eval()
    for name, parameter in model.named_parameters():
        if any(part in name for part in ("attn_residual", "mlp_residual", "final_readout")):
            parameter.data = parameter.data.float()
    input_ids = random_input_ids()
    with torch.no_grad():
        expected = model(input_ids).logits
        logits = with_kernels(model)(input_ids).logits
    assert counted_kernels.calls["phase_one"] > 0 and logits.dtype == torch.bfloat16
    # The same float32 mixing in another summation order; a branch input crosses a bf16 rounding boundary now and then.
    torch.testing.assert_close(logits.float(), expected.float(), rtol=2e-2, atol=2e-2)
    assert (logits == expected).float().mean() > 0.5


def test_dar_moe_with_the_kernels_matches_the_pytorch_path(counted_kernels):
    model = tiny_dar_moe(dar_block_size=3)
    perturb_dar_parameters(model, scale=0.5, seed=1)
    input_ids = random_input_ids()
    with torch.no_grad():
        expected = model(input_ids).logits
        logits = with_kernels(model)(input_ids).logits
    assert counted_kernels.calls["read_partial"] > 0
    torch.testing.assert_close(logits, expected, rtol=1e-5, atol=1e-5)


def test_the_kernels_run_only_where_they_are_meant_to(counted_kernels):
    model = with_kernels(perturbed_dar(torch.float32, "fast", 3, "dar", 2, "duplicate", True))
    with torch.no_grad():
        weights = model(random_input_ids(), output_depth_weights=True).depth_weights  # recorded depth weights
    model(random_input_ids())  # gradients on: training backends
    assert counted_kernels.calls == dict.fromkeys(KERNELS, 0)
    assert len(weights) == 2 * NUM_LAYERS + 1
    with torch.no_grad():
        model(random_input_ids())
    assert counted_kernels.calls["phase_one"] > 0


def test_forward_mode_ad_runs_the_pytorch_path_and_keeps_every_tangent(counted_kernels):
    """`torch.autograd.forward_ad` through a gradient-free forward: the kernels are called directly, not through the
    dispatcher, so they dropped every tangent silently (an input's tangent gave none at the logits; with a tangent on
    the head too, 2e-2 off; a helper's repro). Inside a dual level the PyTorch path runs: the reference's tangent."""
    import torch.autograd.forward_ad as forward_ad
    from torch.func import functional_call

    model = with_kernels(perturbed_dar(torch.float64, "fast", 3, "dar", 2, "duplicate", True))
    model.set_attn_implementation("eager")  # SDPA on CPU has no forward-mode derivative
    embeds = model.get_input_embeddings()(random_input_ids()).detach()
    tangent = torch.randn_like(embeds)
    head = model.lm_head.weight.detach()
    head_tangent = torch.randn_like(head)

    def logits_tangent():
        with torch.no_grad(), forward_ad.dual_level():
            parameters = {"lm_head.weight": forward_ad.make_dual(head, head_tangent)}
            logits = functional_call(model, parameters, args=(),
                                     kwargs={"inputs_embeds": forward_ad.make_dual(embeds, tangent)}).logits
            return forward_ad.unpack_dual(logits).tangent

    got = logits_tangent()
    assert counted_kernels.calls == dict.fromkeys(KERNELS, 0)
    model.config.dar_implementation = "reference"
    expected = logits_tangent()
    assert got is not None and (got - expected).abs().max() <= 1e-10 * expected.abs().max()
    with torch.no_grad():  # outside a dual level the kernels run again
        model.config.dar_implementation = "fast"
        model(random_input_ids())
    assert counted_kernels.calls["phase_one"] > 0


# 3 x 200 = 600 rows at D = 32: more than every call's grain (32768 values per thread: 512 rows of two streams), so
# each kernel splits its rows over the threads
LONG_BATCH, LONG_LENGTH = 3, 200


def test_a_prefill_split_over_threads_matches_the_reference_in_float64(counted_kernels):
    fields = (2, "dar", 2, "duplicate", True)
    reference = perturbed_dar(torch.float64, "reference", *fields)
    model = with_kernels(perturbed_dar(torch.float64, "fast", *fields))
    input_ids = random_input_ids(batch=LONG_BATCH, length=LONG_LENGTH)
    with torch.no_grad():
        expected = reference(input_ids).logits
        with torch_threads(3):
            logits = model(input_ids).logits
    assert max_relative_diff(logits, expected) <= 1e-12
    assert all(counted_kernels.calls[name] > 0 for name in KERNELS)


def test_each_kernel_gives_the_same_bits_on_one_thread_and_on_three():
    module = cpu_kernels.cpu_kernels()
    generator = torch.Generator().manual_seed(0)
    sources, streams, hidden, reads = 4, 2, 32, 3
    shape = (LONG_BATCH, LONG_LENGTH, streams, hidden)
    history = torch.randn(sources + 1, *shape, generator=generator)
    key_scale = torch.rand(sources + 1, *shape[:-1], generator=generator)
    queries = [torch.randn(streams, hidden, generator=generator) for _ in range(reads)]
    gates = [torch.rand(streams, generator=generator) for _ in range(reads)]
    partial = torch.randn(*shape, generator=generator)
    beta, rho = torch.randn(streams, hidden, generator=generator), torch.tensor([0.3])
    written = torch.randn(LONG_BATCH, LONG_LENGTH, hidden, generator=generator).bfloat16()
    routes = ([1, 0], [0, 1])  # key streams, value streams: DAR's reciprocal addressing

    def every_kernel():
        gated, mean, log_sum_exp = module.phase_one(history, sources, key_scale, queries, gates, *routes,
                                                    [False, True, True])
        u = module.read_partial(partial, queries[1], gates[1], mean[0], log_sum_exp[0], *routes, 1e-5, written)
        stored, scales = history.clone(), key_scale.clone()
        module.commit(partial, stored, sources, scales, routes[0], 1e-5)
        return [gated, mean, log_sum_exp, u, module.write_first(beta, written),
                module.write_partial(partial, rho, beta, written), stored, scales]

    with torch_threads(1):
        single = every_kernel()
    with torch_threads(3):
        split = every_kernel()
    assert all(torch.equal(a, b) for a, b in zip(split, single))


def test_without_a_compiler_a_warning_names_the_option_and_pytorch_runs(monkeypatch, caplog):
    import torch.utils.cpp_extension

    def no_compiler(*args, **kwargs):
        raise RuntimeError("Ninja is required to load C++ extensions")

    monkeypatch.setattr(cpu_kernels, "_loaded", {})
    monkeypatch.setattr(torch.utils.cpp_extension, "load_inline", no_compiler)
    model = perturbed_dar(torch.float32, "fast", 3, "dar", 2, "duplicate", True)
    input_ids = random_input_ids()
    with torch.no_grad(), caplog.at_level(logging.WARNING, logger="dar_transformers.cpu_kernels"):
        expected = model(input_ids).logits
        logits = with_kernels(model)(input_ids).logits
        model(input_ids)  # warned once, not at every forward
    warnings = [record.getMessage() for record in caplog.records if record.levelno == logging.WARNING]
    assert len(warnings) == 1
    assert "dar_inference_kernel='cpp'" in warnings[0] and "Ninja is required" in warnings[0]
    assert torch.equal(logits, expected)


def test_a_model_folder_carries_the_kernels_and_the_option_round_trips(tmp_path):
    model = DARForCausalLM(tiny_dar_config(dar_inference_kernel="cpp"))
    model.save_pretrained(tmp_path)
    assert os.path.isfile(tmp_path / "cpu_kernels.py")  # imported by depth_backends.py: remote code carries it
    assert DARConfig.from_pretrained(tmp_path).dar_inference_kernel == "cpp"
    with pytest.raises(Exception, match=r"dar_inference_kernel must be one of \['torch', 'cpp'\], got 'cuda'"):
        tiny_dar_config(dar_inference_kernel="cuda")
