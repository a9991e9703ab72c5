# SPDX-License-Identifier: Apache-2.0
"""DAR under `torch.compile` (DESIGN.md section 6, "compiled = eager"), on CPU.

A compiled forward and backward must give the eager model's values and *every* parameter's gradient, for DAR and
DAR-MoE, every block size, routing, stream count and write mode, with `fullgraph=True`; a training run with fixed
shapes compiles once; `Trainer(torch_compile=True)` gives the eager loss curve; HF's compiled static-cache decoding
gives the eager greedy tokens. Most checks compile with `aot_eager` (dynamo + AOTAutograd, the stages where a side
channel between autograd nodes goes missing); DAR also compiles with inductor, as users run it.

A compiled training forward runs two-phase reads ("two_phase", each read as plain differentiable code inside an
activation checkpoint, autograd deriving its gradient), also when the eager default "fast" is configured: the eager
twin then runs the fused fast path or the hand-written two-phase backward, so these checks also compare the
backends. A compiled forward with gradients off (the
static-cache decoding below) runs the inference backend, as eager decoding does. The exactness tests pin all of them
to the reference equations; here float64 agreement is to 1e-10 relative.
"""

import copy
import os

import pytest
import torch
from torch._dynamo.testing import CompileCounterWithBackend

from conftest import TINY_LLAMA_FIELDS, perturb_dar_parameters
from dar_transformers import DARConfig, DARForCausalLM, DARMoeConfig, DARMoeForCausalLM
from dar_transformers import depth_backends

TINY_MOE = dict(num_experts=4, num_experts_per_tok=2)
# CPU by default; benchmarks/gpu_check.sh re-runs these checks with DAR_TEST_DEVICE=cuda.
DEVICE = torch.device(os.environ.get("DAR_TEST_DEVICE", "cpu"))


def tiny(kind: str = "dar", dtype=torch.float64, **overrides) -> torch.nn.Module:
    torch.manual_seed(0)
    fields = {**TINY_LLAMA_FIELDS, **overrides}  # 2 layers, M = 4 branches: tracing time grows with the layers
    if kind == "dar":
        model = DARForCausalLM(DARConfig(**fields))
    else:
        model = DARMoeForCausalLM(DARMoeConfig(**fields, **TINY_MOE))
        if dtype == torch.float64:
            model.set_experts_implementation("batched_mm")  # grouped_mm takes no float64
    model = model.to(dtype)
    perturb_dar_parameters(model, scale=0.3, seed=1)  # every DAR parameter off its exact-reduction init: no gradient is trivial
    return model.to(DEVICE).train()


def loss_and_gradients(model, call, input_ids):
    model.zero_grad(set_to_none=True)
    loss = call(input_ids=input_ids, labels=input_ids).loss
    loss.backward()
    return loss.detach(), {name: p.grad.clone() for name, p in model.named_parameters() if p.grad is not None}


def assert_same_gradients(got, expected, rtol, atol):
    assert got.keys() == expected.keys()
    for name in expected:
        torch.testing.assert_close(got[name], expected[name], rtol=rtol, atol=atol, msg=name)


def token_batch(seed: int = 0, batch: int = 2, length: int = 9) -> torch.LongTensor:
    ids = torch.randint(3, TINY_LLAMA_FIELDS["vocab_size"], (batch, length), generator=torch.Generator().manual_seed(seed))
    return ids.to(DEVICE)


def compiled_matches_eager(model, backend="aot_eager", rtol=1e-10, atol=1e-12, steps=2, **compile_kwargs):
    """Eager model vs a deep copy through torch.compile: loss and every gradient, `steps` batches of fixed shape
    (the second reuses the cached graph, with no recompilation allowed)."""
    torch._dynamo.reset()
    twin = copy.deepcopy(model)
    counter = CompileCounterWithBackend(backend)
    compiled = torch.compile(twin, backend=counter, fullgraph=True, **compile_kwargs)
    for step in range(steps):
        input_ids = token_batch(seed=step)
        expected_loss, expected = loss_and_gradients(model, model, input_ids)
        with torch._dynamo.config.patch(error_on_recompile=step > 0):
            loss, got = loss_and_gradients(twin, compiled, input_ids)
        torch.testing.assert_close(loss, expected_loss, rtol=rtol, atol=atol)
        assert_same_gradients(got, expected, rtol, atol)
        assert len(expected) == sum(p.requires_grad for p in model.parameters())  # every parameter got a gradient
    return counter


GRID = [
    # (block size, routing, streams, write mode): every block size with "dar", every routing at block size 2,
    # one stream (AttnRes), split writes.
    (1, "dar", 2, "duplicate"),
    (2, "dar", 2, "duplicate"),
    (None, "dar", 2, "duplicate"),  # about 8 blocks: with 4 branches, K = 1
    (4, "dar", 2, "duplicate"),  # one block (K = M)
    (2, "selfkv", 2, "duplicate"),
    (2, "crossv", 2, "split"),
    (2, "fixedkv", 2, "duplicate"),
    (4, "selfkv", 1, "duplicate"),
]


@pytest.mark.parametrize("block_size,routing,streams,write_mode", GRID)
def test_compiled_gradients_equal_eager_float64(block_size, routing, streams, write_mode):
    model = tiny(dar_block_size=block_size, dar_routing=routing, dar_num_streams=streams, dar_write_mode=write_mode)
    counter = compiled_matches_eager(model)
    assert counter.frame_count == 1  # one graph for the whole model, and fullgraph: no break in the residual path


@pytest.mark.parametrize("block_size", [1, 2])
def test_compiled_dar_moe_gradients_equal_eager_float64(block_size):
    model = tiny("moe", dar_block_size=block_size)
    assert compiled_matches_eager(model).frame_count == 1


# Inductor compiles C++ kernels with a C compiler: about 50 s on a cold cache for two layers here, so the default
# suite compiles one layer of DAR (a block of two branches: the partial's read, a commit, the readout) and DAR-MoE's
# experts only in the slow target; aot_eager checks DAR-MoE's compiled gradients in float64 above.
@pytest.mark.parametrize("kind", ["dar", pytest.param("moe", marks=pytest.mark.slow)])
def test_inductor_gradients_equal_eager_float32(kind):
    """As users compile: inductor, float32. The tolerance is a small multiple of the reference's own float32
    error against float64 (two evaluation orders of the same sums; DESIGN.md section 4)."""
    layers = 1 if kind == "dar" else 2
    model64 = tiny(kind, dar_block_size=2, num_hidden_layers=layers)
    model = tiny(kind, dtype=torch.float32, dar_block_size=2, num_hidden_layers=layers)
    input_ids = token_batch()
    _, exact = loss_and_gradients(model64, model64, input_ids)
    _, eager = loss_and_gradients(model, model, input_ids)
    own_error = max(((eager[name].double() - exact[name]).abs().max() / exact[name].abs().max().clamp_min(1e-30)).item()
                    for name in exact)
    compiled_matches_eager(model, backend="inductor", rtol=10 * own_error + 1e-6, atol=1e-6, steps=1)


@pytest.mark.parametrize("compiled_read", ["inlined", "operator"])
def test_compiled_bf16_training_matches_eager(compiled_read):
    """bf16 weights, DAR parameters in float32 (as `from_pretrained(dtype=bfloat16)` keeps them)."""
    model = tiny(dtype=torch.float32, dar_block_size=2, dar_compiled_read=compiled_read)
    for name, module in model.named_modules():
        if not any(part in name for part in ("attn_residual", "mlp_residual", "final_readout")):
            for parameter in module.parameters(recurse=False):
                parameter.data = parameter.data.bfloat16()
    compiled_matches_eager(model, rtol=2e-2, atol=2e-3, steps=1)


@pytest.mark.parametrize("neutral, implementation", [(True, "fast"), (False, "fast"), (True, "reference")],
                         ids=["neutral_products", "negative_control", "reference_backend"])
def test_compiled_training_under_autocast_gives_the_eager_gradients(monkeypatch, neutral, implementation):
    """float32 weights under CPU bf16 autocast (mixed-precision training), dynamo + AOTAutograd: DAR's depth products
    run inside an autocast-off region, whose backward AOTAutograd traces with autocast on (PyTorch issue 179804), so
    the compiled gradients came out of bf16 products, 1e-2 to 3e-2 off eager's, where Llama's compiled gradients
    equal eager's. A traced forward under autocast now takes products autocast leaves alone (`wide_product`'s
    `neutral`). Negative control: without them, the gradients are that far off again. The reference backend (an
    opt-in `dar_implementation`, which a compiled forward honours) used einsums, bmm's in that backward: 7e-2 off."""
    if not neutral:
        start = depth_backends.TwoPhaseDepthBackend.start

        def start_without_neutral_products(self, *args, **kwargs):
            state = start(self, *args, **kwargs)
            self.under_autocast = False
            return state

        monkeypatch.setattr(depth_backends.TwoPhaseDepthBackend, "start", start_without_neutral_products)
    model = tiny(dtype=torch.float32, dar_block_size=2, dar_implementation=implementation)
    input_ids = token_batch()
    torch._dynamo.reset()
    twin = copy.deepcopy(model)
    compiled = torch.compile(twin, backend="aot_eager")

    def loss_and_gradients_under_autocast(module, call):  # backward outside autocast, as AMP training runs it
        with torch.autocast("cpu", dtype=torch.bfloat16):
            loss = call(input_ids=input_ids, labels=input_ids).loss
        loss.backward()
        return loss.detach(), {name: p.grad.clone() for name, p in module.named_parameters() if p.grad is not None}

    eager_loss, eager_gradients = loss_and_gradients_under_autocast(model, model)
    compiled_loss, compiled_gradients = loss_and_gradients_under_autocast(twin, compiled)
    torch.testing.assert_close(compiled_loss, eager_loss, rtol=0, atol=0)
    worst = max(((compiled_gradients[name] - gradient).abs().max() / gradient.abs().max()).item()
                for name, gradient in eager_gradients.items())
    # Eager and compiled form the branch inputs in different float32 orders, and autocast rounds them to bf16 for the
    # branches' products: a rounding flip here and there leaves 4e-4 (seed 0); the bf16 depth gradients were 1.6e-2.
    assert worst < 3e-3 if neutral else worst > 3e-3, worst


@pytest.mark.parametrize("compiled_read", ["inlined", "operator"])
@pytest.mark.parametrize("use_reentrant", [False, True])
def test_compiled_with_gradient_checkpointing_equals_eager(use_reentrant, compiled_read):
    model = tiny(dar_block_size=2, dar_compiled_read=compiled_read)
    model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": use_reentrant})
    torch._dynamo.reset()
    twin = copy.deepcopy(model)
    compiled = torch.compile(twin, backend="aot_eager")  # reentrant checkpointing runs backward in Python: no fullgraph
    input_ids = token_batch()
    expected_loss, expected = loss_and_gradients(model, model, input_ids)
    loss, got = loss_and_gradients(twin, compiled, input_ids)
    torch.testing.assert_close(loss, expected_loss, rtol=1e-10, atol=1e-12)
    assert_same_gradients(got, expected, 1e-10, 1e-12)


@pytest.mark.parametrize("block_size", [1, 2])
def test_a_graph_break_inside_a_checkpointed_layer_keeps_the_gradients(block_size):
    """dynamo cannot trace a checkpointed decoder layer with a graph break inside (a branch module's hook, a print;
    transformers 5.25's hub-kernel RMSNorm), so it runs that layer eagerly around the frames it compiles, while the
    model's start and final readout stay traced. Entries committed by the eager code had statistics without
    autograd, and the traced final readout lost their key-norm gradient: 0.08 off at the embedding."""
    model = tiny(dar_block_size=block_size)
    model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    twin = copy.deepcopy(model)
    for layer in twin.model.layers:
        layer.mlp.register_forward_hook(lambda *args: torch._dynamo.graph_break())
    torch._dynamo.reset()
    compiled = torch.compile(twin, backend="aot_eager")
    input_ids = token_batch()
    expected_loss, expected = loss_and_gradients(model, model, input_ids)
    loss, got = loss_and_gradients(twin, compiled, input_ids)
    torch.testing.assert_close(loss, expected_loss, rtol=1e-10, atol=1e-12)
    assert_same_gradients(got, expected, 1e-10, 1e-12)


def test_training_compiles_once_for_fixed_shapes():
    """Several optimiser steps with fixed shapes: one compiled frame, no recompilation (error_on_recompile)."""
    model = tiny(dtype=torch.float32, dar_block_size=2)
    torch._dynamo.reset()
    counter = CompileCounterWithBackend("aot_eager")
    compiled = torch.compile(model, backend=counter, fullgraph=True)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    with torch._dynamo.config.patch(error_on_recompile=True):
        for step in range(4):
            optimizer.zero_grad()
            input_ids = token_batch(seed=step)
            compiled(input_ids=input_ids, labels=input_ids).loss.backward()
            optimizer.step()
    assert counter.frame_count == 1


def depth_state_tensors_saved_by_compiled_training(model) -> int:
    """How many tensors of a depth state's shape ([B, T, J, D], any dtype) the compiled training forward keeps for
    backward (the outputs of AOTAutograd's forward graph, partitioned as inductor partitions it)."""
    from torch._dynamo.backends.common import aot_autograd
    from torch._functorch.partitioners import min_cut_rematerialization_partition

    input_ids = token_batch()
    state_shape = (*input_ids.shape, 2, model.config.hidden_size)
    counted = []

    def forward_compiler(graph_module, example_inputs):
        def run(*args):
            outputs = graph_module(*args)
            counted.append(sum(isinstance(o, torch.Tensor) and tuple(o.shape) == state_shape for o in outputs))
            return outputs

        return run

    backend = aot_autograd(fw_compiler=forward_compiler, bw_compiler=lambda graph_module, _: graph_module,
                           partition_fn=min_cut_rematerialization_partition)
    torch._dynamo.reset()
    torch.compile(model, backend=backend, fullgraph=True)(input_ids=input_ids, labels=input_ids).loss.backward()
    return counted[0]


@pytest.mark.parametrize("compiled_read", ["inlined", "operator"])
def test_compiled_training_keeps_the_reads_inputs_only(monkeypatch, compiled_read):
    """A traced training read runs inside an activation checkpoint (`_recomputed_read`), or is one custom operator
    whose gradient is another (`dar_compiled_read="operator"`): the compiled forward keeps no depth-state-sized
    tensor for backward beyond the committed entries and the partials, which the forward holds anyway (B_0 and one
    commit per block; one partial per branch that does not commit). Negative control: the same reads without the
    checkpoint keep their phase-1 sums and merges too."""
    model = tiny(dtype=torch.float32, dar_block_size=2, dar_compiled_read=compiled_read)  # M = 4: B_0 + 2 commits
    kept = depth_state_tensors_saved_by_compiled_training(model)
    assert 0 < kept <= 3 + 2
    if compiled_read == "inlined":
        monkeypatch.setattr(depth_backends, "checkpoint", lambda function, *args, **kwargs: function(*args))
        assert depth_state_tensors_saved_by_compiled_training(model) > kept


@pytest.mark.parametrize("block_size,blocks", [(1, 4), (2, 2), (4, 1)])
def test_compiled_training_scores_each_block_once(monkeypatch, block_size, blocks):
    """A traced training forward computes phase 1's scores once per block for all of the block's reads, and once for
    the final readout, with the eager gradients (M = 4 branches). Negative control: scoring per read (the reads'
    planning cut to one residual each) makes one call per read, which the count catches."""
    calls = []
    scores = depth_backends.depth_scores_by_entry

    def counted(routed, entries, *args):
        calls.append((len(entries), routed.shape[1] // 2))  # (entries, reads)
        return scores(routed, entries, *args)

    monkeypatch.setattr(depth_backends, "depth_scores_by_entry", counted)
    compiled_matches_eager(tiny(dar_block_size=block_size), steps=1)
    per_block = [(1 + block, block_size) for block in range(blocks)]
    assert calls == [*per_block, (1 + blocks, 1)]

    calls.clear()
    monkeypatch.setattr(depth_backends, "reads_ahead", lambda residuals, first, *args: [first])
    monkeypatch.setattr(depth_backends, "reads_planned_together", lambda residuals: [residuals[0]])
    compiled_matches_eager(tiny(dar_block_size=block_size), steps=1)
    assert len(calls) == 4 + 1 and (block_size == 1 or calls != [*per_block, (1 + blocks, 1)])


@pytest.mark.parametrize("compiled_read", ["inlined", "operator"])
def test_compiled_training_derives_every_residuals_gates_at_once(monkeypatch, compiled_read):
    """A traced training forward derives the gates and folded queries of all the branch residuals in one stacked
    pass (`stacked_derivations`) and hands each its rows as tensors of their own (`traced_rows`: fewer distinct
    kernels for inductor to compile in the first step), with the eager gradients; only the final readout derives its
    own. Where the parameters are not here for the whole model (FSDP2 shards outside their layers' forwards, meta
    tensors of an offloaded model) every read and write derives its own in its layer, which the counts see."""
    stacked, derived = [], []
    stack, own = depth_backends.stacked_derivations, depth_backends._derived

    def counted_stack(residuals, *args):  # traced calls only (the eager twin derives per residual, memoised)
        if torch.compiler.is_compiling():
            stacked.append(len(residuals))
        return stack(residuals, *args)

    def counted_own(module, name, *args):
        if torch.compiler.is_compiling():
            derived.append(name)
        return own(module, name, *args)

    monkeypatch.setattr(depth_backends, "stacked_derivations", counted_stack)
    monkeypatch.setattr(depth_backends, "_derived", counted_own)
    model = tiny(dar_block_size=2, dar_compiled_read=compiled_read)  # 4 branches
    compiled_matches_eager(model, steps=1)
    assert stacked == [4] and set(derived) == {"gate_3", "routed_query"}  # the readout's, over B_0 and 2 commits

    stacked.clear()
    derived.clear()
    monkeypatch.setattr(depth_backends, "DTensor", torch.nn.Parameter)  # every parameter "a shard" of FSDP2
    compiled_matches_eager(model, steps=1)
    assert stacked == [] and {"beta", "rho", "gate_2", "routed_query"} <= set(derived) and len(derived) > 8


def test_a_block_is_scored_ahead_only_over_self_contained_layers(monkeypatch):
    """A block's reads are scored together (in the first of its layers) only when the model hands the backend its
    residuals: not in a training forward where a decoder layer is checkpointed (its recompute would not see work
    done for it elsewhere: the compiled checkpointing test above then loses gradients), nor when the later reads'
    parameters are not here (meta, or FSDP2 shards)."""
    from dar_transformers.modeling_dar import self_contained

    model = tiny(dar_block_size=4)  # one block: every read is ahead of the first
    residuals = [r for layer in model.model.layers for r in (layer.attn_residual, layer.mlp_residual)]
    first = residuals[0]
    assert depth_backends.reads_ahead(residuals, first, 4, 99) == residuals
    assert depth_backends.reads_ahead(residuals, residuals[1], 4, 2) == residuals[1:3]
    assert all(self_contained(layer) for layer in model.model.layers)
    given = []
    start = depth_backends.TwoPhaseDepthBackend.start
    monkeypatch.setattr(depth_backends.TwoPhaseDepthBackend, "start",
                        lambda self, entry, keep_weights=True, residuals=(): given.append(len(residuals)) or start(
                            self, entry, keep_weights, residuals))
    model.config.dar_implementation = "two_phase"
    model(input_ids=token_batch())
    model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    assert not any(self_contained(layer) for layer in model.model.layers)
    model(input_ids=token_batch())
    assert given == [4, 0]

    monkeypatch.setattr(depth_backends, "DTensor", torch.nn.Parameter)  # every parameter "a shard"
    assert depth_backends.reads_ahead(residuals, first, 4, 99) == []
    monkeypatch.undo()
    with torch.device("meta"):
        residuals[2].depth_attention.pseudo_query = torch.nn.Parameter(torch.empty(2, 8))
    assert depth_backends.reads_ahead(residuals, first, 4, 99) == []


@pytest.mark.parametrize("block_size", [1, 2, 3])
@pytest.mark.parametrize("kind", ["dar", "moe"])
def test_the_operator_read_compiles_to_the_eager_gradients_float64(kind, block_size):
    """`dar_compiled_read="operator"`: the traced read and its gradient are custom operators; compiled values and
    every parameter's gradient equal eager's (the eager twin runs the fast path or the hand-written two-phase
    backward), for DAR and DAR-MoE, Full DAR and blocks with and without a left-over branch."""
    model = tiny(kind, dar_block_size=block_size, dar_compiled_read="operator")
    compiled_matches_eager(model)


def test_the_operator_read_compiles_with_the_depth_parameters_frozen():
    """Only the branches train (LoRA-style, every DAR parameter frozen): the gradient operator is asked for neither
    the query's nor the gate's gradient, and the branch parameters' gradients are eager's."""
    model = tiny(dar_block_size=2, dar_compiled_read="operator")
    for name, parameter in model.named_parameters():
        if any(part in name for part in ("attn_residual", "mlp_residual", "final_readout")):
            parameter.requires_grad_(False)
    compiled_matches_eager(model)


def test_the_operator_read_compiles_with_inductor_float32():
    """As users compile, inductor in float32: the operators run as they are inside the generated code."""
    model = tiny(dtype=torch.float32, dar_block_size=2, dar_compiled_read="operator")
    compiled_matches_eager(model, backend="inductor", rtol=2e-4, atol=1e-5)


@pytest.mark.parametrize("kernel", ["torch", "cpp"])
def test_every_traced_training_read_is_the_one_opaque_operator(kernel, compiled_read="operator"):
    """`dar_compiled_read="operator"`: the compiler generates no code for a training read (item 3 of issue 16: every
    block's reads run the same precompiled code, where inlined each read compiles kernels of its own): the graphs
    AOTAutograd hands to inductor call the read operator once per read (M branches and the final readout) and its
    gradient operator once per read, and hold no depth softmax of their own (`aten.exp` appears only in the loss,
    `aten.bmm` not at all). With `dar_training_kernel="cpp"` the operators are the source read and write (C++ on
    CPU), and the graphs hold no transport of their own either (`aten.flip`). With the inlined read it fails."""
    from torch._dynamo.backends.common import aot_autograd

    model = tiny(dtype=torch.float32, dar_block_size=2, dar_compiled_read=compiled_read, dar_training_kernel=kernel)
    graphs = {}

    def compiler(kind):
        def compile_graph(graph_module, example_inputs):
            graphs[kind] = [str(node.target) for node in graph_module.graph.nodes if node.op == "call_function"]
            return graph_module
        return compile_graph

    torch._dynamo.reset()
    backend = aot_autograd(fw_compiler=compiler("forward"), bw_compiler=compiler("backward"))
    input_ids = token_batch()
    torch.compile(model, backend=backend, fullgraph=True)(input_ids=input_ids, labels=input_ids).loss.backward()
    reads = model.config.dar_num_branches + 1
    forward, backward = graphs["forward"], graphs["backward"]
    read = "two_phase_read" if kernel == "torch" else "source_read"
    assert sum(target.endswith(f".{read}.default") for target in forward) == reads
    assert sum(target.endswith(f".{read}_backward.default") for target in backward) == reads
    assert not any("bmm" in target for target in forward + backward)
    if kernel == "cpp":
        writes = model.config.dar_num_branches
        assert sum(target.endswith(".source_write.default") for target in forward) == writes
        assert sum(target.endswith(".source_write_backward.default") for target in backward) == writes
        assert not any("flip" in target for target in forward + backward)
    assert sum("aten.exp." in target for target in forward) <= 1  # the loss's log-softmax, if decomposed


class _ReferenceWithoutCountScaling(depth_backends.ReferenceDepthBackend):
    """The reference equations with the count scaling N dropped (a wrong backend, for the negative control)."""

    def read(self, residual, state, read_partial, planned=None, dtype=None):
        branch_input, weights = super().read(residual, state, read_partial, planned, dtype)
        return branch_input / weights.shape[0], weights


def test_negative_control_a_compiled_path_that_differs_is_caught(monkeypatch):
    """The comparison can fail: a compiled forward that takes other equations than eager (picked only while
    tracing) must fail it."""
    eager_backend = depth_backends.depth_backend

    def differs_when_compiled(config, **options):
        if torch.compiler.is_compiling():
            return _ReferenceWithoutCountScaling(config)
        return eager_backend(config, **options)

    monkeypatch.setattr("dar_transformers.modeling_dar.depth_backend", differs_when_compiled)
    with pytest.raises(AssertionError):
        compiled_matches_eager(tiny(dar_block_size=2), steps=1)


@pytest.mark.parametrize("kind", ["dar", "moe"])
def test_compiled_static_cache_generation_gives_the_eager_tokens(kind):
    """HF's compiled decoding: static cache, decode steps through `torch.compile` (compile_config; CPU allowed)."""
    from transformers import CompileConfig

    model = tiny(kind, dtype=torch.float32, dar_block_size=2).eval()
    prompt = token_batch(length=5)
    settings = dict(max_new_tokens=6, do_sample=False, pad_token_id=0)
    eager = model.generate(prompt, cache_implementation="static", disable_compile=True, **settings)
    torch._dynamo.reset()
    compile_config = CompileConfig(backend="aot_eager", fullgraph=True)
    compile_config._compile_all_devices = True
    compiled = model.generate(prompt, cache_implementation="static", compile_config=compile_config, **settings)
    assert hasattr(model, "_compiled_call") and model._compiled_call is not None  # the decode steps were compiled
    torch.testing.assert_close(compiled, eager, rtol=0, atol=0)


def test_trainer_torch_compile_gives_the_eager_loss_curve(tmp_path):
    """`TrainingArguments(torch_compile=True)`: accelerate compiles the whole model; the logged losses of a few AdamW
    steps equal eager training's."""
    from transformers import Trainer, TrainingArguments, default_data_collator
    from datasets import Dataset

    ids = torch.randint(3, TINY_LLAMA_FIELDS["vocab_size"], (8, 12), generator=torch.Generator().manual_seed(0))
    dataset = Dataset.from_dict({"input_ids": ids.tolist(), "labels": ids.tolist()})
    curves = {}
    for compiled in (False, True):
        torch._dynamo.reset()
        torch._dynamo.utils.counters.clear()
        model = tiny(dtype=torch.float32, dar_block_size=2)
        args = TrainingArguments(
            output_dir=str(tmp_path / str(compiled)), report_to="none", use_cpu=True, save_strategy="no",
            disable_tqdm=True, seed=0, max_steps=6, learning_rate=1e-2, per_device_train_batch_size=4,
            logging_strategy="steps", logging_steps=1, lr_scheduler_type="constant", dataloader_num_workers=0,
            torch_compile=compiled, torch_compile_backend="aot_eager" if compiled else None,
        )
        trainer = Trainer(model=model, args=args, train_dataset=dataset, data_collator=default_data_collator)
        trainer.train()
        curves[compiled] = [entry["loss"] for entry in trainer.state.log_history if "loss" in entry]
        graphs = torch._dynamo.utils.counters["stats"]["unique_graphs"]
        assert graphs >= 1 if compiled else graphs == 0  # the compiled run did go through dynamo
    assert len(curves[True]) == 6 and curves[True][-1] < curves[True][0]
    torch.testing.assert_close(torch.tensor(curves[True]), torch.tensor(curves[False]), rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("configured,traced", [("fast", "two_phase"), ("two_phase", "two_phase"),
                                               ("reference", "reference")])
def test_a_traced_forward_takes_a_backend_that_compiles(monkeypatch, configured, traced):
    """The fused fast path's shared gradient buffer is invisible to a compiler: while tracing, "fast" becomes
    "two_phase"; eagerly every configured backend runs as configured."""
    config = DARConfig(**TINY_LLAMA_FIELDS, dar_implementation=configured)
    assert type(depth_backends.depth_backend(config)) is depth_backends.ALL_DEPTH_BACKENDS[configured]
    # an eager forward whose decoder layers are compiled on their own (regional compilation) traces them too
    assert type(depth_backends.depth_backend(config, traced=True)) is depth_backends.ALL_DEPTH_BACKENDS[traced]
    monkeypatch.setattr(torch.compiler, "is_compiling", lambda: True)
    assert type(depth_backends.depth_backend(config)) is depth_backends.ALL_DEPTH_BACKENDS[traced]


def test_compiled_two_phase_equals_eager_two_phase():
    """The eager twin on two-phase reads too (GRID compares against the eager default, the fused fast path)."""
    compiled_matches_eager(tiny(dar_block_size=2, dar_implementation="two_phase"), steps=1)


def test_regional_compilation_names_the_graph_per_layer_that_dynamos_limit_cuts_short(caplog):
    """Each DAR decoder layer has its own place in the depth history, so regional compilation traces a graph per layer;
    past dynamo's recompile_limit the remaining layers ran eagerly with only dynamo's generic warning. The model says
    why and what limit to set; with it set, every layer is compiled, once with gradients on and once with them off."""
    from torch._dynamo.testing import CompileCounter

    model = tiny(num_hidden_layers=3, dar_block_size=2)
    torch._dynamo.reset()
    counter = CompileCounter()
    for layer in model.model.layers:
        layer.compile(backend=counter)
    input_ids = token_batch(seed=0)
    with torch._dynamo.config.patch(recompile_limit=2):
        model(input_ids, labels=input_ids).loss.backward()
    assert counter.frame_count == 2  # the third layer ran eagerly
    assert ("3 DAR decoder layers are compiled on their own (regional compilation). Each has its own place in the "
            "depth history, so dynamo traces one graph per layer" in caplog.text)
    assert "runs the remaining layers eagerly. Set torch._dynamo.config.recompile_limit = 6 " in caplog.text
    torch._dynamo.reset()
    counter.frame_count = 0
    with torch._dynamo.config.patch(recompile_limit=6):
        model(input_ids, labels=input_ids).loss.backward()
        with torch.no_grad():
            model(input_ids)
    assert counter.frame_count == 6
    torch._dynamo.reset()


@pytest.mark.parametrize("implementation", ["fast", "two_phase"])
@pytest.mark.parametrize("compiled_read", ["inlined", "operator"])
@pytest.mark.parametrize("how", ["compile()", "replaced", "compile_regions"])
def test_regional_compilation_gives_the_eager_gradients(implementation, compiled_read, how):
    """Regional compilation (each decoder layer compiled on its own while the model runs eagerly: `layer.compile()`,
    the layer replaced by `torch.compile(layer)`, or accelerate's `compile_regions`) traced the eager backend's
    reads and writes: the fast path's shared gradient buffer lost every layer's gradient (relative error 1.0), and
    two-phase scoring a block ahead across layer graphs, with B_0's key statistics taken without autograd, left the
    embedding's gradient 0.8 % off, while the loss was the same. Now the layers trace "two_phase", score only their
    own reads and B_0's statistics carry the gradient: float64 equal to eager, twice (no recompile)."""
    model = tiny(dar_block_size=2, dar_implementation=implementation, dar_compiled_read=compiled_read)
    torch._dynamo.reset()
    twin = copy.deepcopy(model)
    layers = twin.model.layers
    if how == "compile_regions":  # accelerate's: the layers, and the model's other leaf modules, replaced
        from accelerate.utils import compile_regions

        twin = compile_regions(twin, backend="aot_eager")
    elif how == "compile()":
        for layer in layers:
            layer.compile(backend="aot_eager")
    else:
        for index, layer in enumerate(layers):
            layers[index] = torch.compile(layer, backend="aot_eager")
    for step in range(2):
        input_ids = token_batch(seed=step)
        expected_loss, expected = loss_and_gradients(model, model, input_ids)
        with torch._dynamo.config.patch(error_on_recompile=step > 0):
            loss, got = loss_and_gradients(twin, twin, input_ids)
        got = {name.replace("._orig_mod", ""): grad for name, grad in got.items()}  # a replaced layer's names
        torch.testing.assert_close(loss, expected_loss, rtol=1e-10, atol=1e-12)
        assert_same_gradients(got, expected, 1e-10, 1e-12)
    with torch.no_grad():  # the same compiled layers with gradients off (dynamo failed in its shape guards here)
        input_ids = token_batch(seed=2)
        torch.testing.assert_close(twin(input_ids).logits, model(input_ids).logits, rtol=1e-10, atol=1e-12)
    prompt = input_ids[:, :5]
    assert torch.equal(twin.generate(prompt, max_new_tokens=3, do_sample=False),
                       model.generate(prompt, max_new_tokens=3, do_sample=False))


@pytest.mark.parametrize("implementation, compiled_read", [("fast", "inlined"), ("two_phase", "inlined"),
                                                            ("fast", "operator")])
def test_a_compiled_training_forward_recording_depth_weights_is_one_graph_with_their_gradients(implementation,
                                                                                                compiled_read):
    """`output_depth_weights=True` in a whole-model compiled training forward: the eager fallback to the reference
    backend (whose weights carry gradients) logged a warning while dynamo traced, which it cannot: fullgraph failed
    and a partial graph broke at every call. A traced forward takes plain operations, whose weights carry gradients
    already; no fallback there: one graph, and float64 gradients of a loss on the weights equal the eager reference's.
    With `dar_compiled_read="operator"` too: its operators return the weights without a gradient, and the loss's term
    on them was dropped (gradients 1.1 relative off); a forward recording them reads inline."""
    from torch._dynamo.utils import counters

    def loss_and_gradients(model, forward):
        output = forward(input_ids=input_ids, labels=input_ids, output_depth_weights=True)
        loss = output.loss + sum((read * read).sum() for read in output.depth_weights)
        loss.backward()
        return {name: parameter.grad.clone() for name, parameter in model.named_parameters()}

    torch._dynamo.reset()
    counters.clear()
    model = tiny(dar_block_size=2, dar_implementation=implementation, dar_compiled_read=compiled_read).train()
    reference = copy.deepcopy(model)
    reference.config.dar_implementation = "reference"
    input_ids = torch.randint(3, 97, (2, 9), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():  # transformers installs its output-capturing hooks at the first such call, eagerly
        model(input_ids=input_ids, output_depth_weights=True)
    counter = CompileCounterWithBackend("aot_eager")
    compiled = torch.compile(model, backend=counter, fullgraph=True)
    expected = loss_and_gradients(reference, reference)
    for _ in range(2):
        model.zero_grad()
        gradients = loss_and_gradients(model, compiled)
    assert counter.frame_count == 1 and not counters["graph_break"] and not counters["recompiles"]
    for name, gradient in expected.items():
        torch.testing.assert_close(gradients[name], gradient, rtol=1e-9, atol=1e-12, msg=name)
