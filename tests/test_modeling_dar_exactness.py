# SPDX-License-Identifier: Apache-2.0
"""Exactness and symmetry of DAR on tiny random models (CPU; DESIGN.md sections 2-4).

- Upcycling: a Llama state dict loaded into DARForCausalLM gives Llama's logits for every block size, routing,
  write mode, stream count and implementation (fp32 to 1e-5, float64 to 1e-10), and the same greedy tokens.
- Negative controls: without count-scaling or without the partial-block source the reduction drifts.
- Both optimised backends ("fast", "two_phase") vs the reference with random non-zero DAR parameters: float64
  logits and gradients agree to ~1e-10 relative; in fp32 each is no further from the float64 reference than a
  small multiple of the reference's own fp32 error.
- Symmetry: with gate delta 0 the two streams never separate under AdamW; with the default delta they differ
  in direction at init and their queries get different gradients.
"""

import re

import pytest
import torch
from conftest import (
    dar_parameter_names,
    load_llama_into_dar,
    perturb_dar_parameters,
    random_input_ids,
    tiny_dar_config,
    tiny_llama,
    upcycled_dar,
)
from transformers.models.llama.modeling_llama import LlamaRMSNorm

from dar_transformers import DARForCausalLM
from dar_transformers.convert import rms_norm_in_input_dtype
from dar_transformers.modeling_dar import DARDecoderLayer

NUM_LAYERS = 3  # M = 6 branches: K = 4 leaves a short last block, K = 6 is a single block


@pytest.fixture
def float64_llama_norms(monkeypatch):
    """HF's LlamaRMSNorm rounds through float32 even in a float64 model (on both sides of any comparison), which
    caps float64 agreement at ~1e-7 relative. The float64 checks run it in the input dtype instead."""
    monkeypatch.setattr(LlamaRMSNorm, "forward", rms_norm_in_input_dtype)


@pytest.fixture(scope="module")
def llama():
    return tiny_llama(num_hidden_layers=NUM_LAYERS)


def _max_abs_diff(a: torch.Tensor, b: torch.Tensor) -> float:
    return (a.double() - b.double()).abs().max().item()


def _max_relative_diff(a: torch.Tensor, b: torch.Tensor) -> float:
    """Max abs difference over the largest |b|; a zero b (the query of a branch with one source) must match exactly."""
    return _max_abs_diff(a, b) / max(b.double().abs().max().item(), 1e-300)


# (block size K, routing, streams): every routing with two streams, one stream only with selfkv (AttnRes).
UPCYCLING_GRID = [
    (block_size, routing, 2) for block_size in (1, 2, 3, 4, 6) for routing in ("dar", "selfkv", "crossv", "fixedkv")
] + [(block_size, "selfkv", 1) for block_size in (1, 2, 3, 4, 6)]


def test_llama_state_dict_leaves_exactly_the_dar_parameters_missing(llama):
    dar = DARForCausalLM(tiny_dar_config(num_hidden_layers=NUM_LAYERS, dar_block_size=2))
    missing, unexpected = load_llama_into_dar(llama, dar)
    assert unexpected == []
    assert set(missing) == dar_parameter_names(dar)
    # query, key norm, read gate per branch and readout; write gate per branch; transport where a partial is carried
    assert len(missing) == 3 * (2 * NUM_LAYERS + 1) + 2 * NUM_LAYERS + NUM_LAYERS


@pytest.mark.parametrize("block_size,routing,num_streams", UPCYCLING_GRID)
@pytest.mark.parametrize("write_mode", ["duplicate", "split"])
@pytest.mark.parametrize("implementation", ["fast", "two_phase", "reference"])
def test_upcycled_dar_gives_llama_logits_fp32(llama, block_size, routing, num_streams, write_mode, implementation):
    dar = upcycled_dar(
        llama,
        dar_block_size=block_size,
        dar_routing=routing,
        dar_num_streams=num_streams,
        dar_write_mode=write_mode,
        dar_implementation=implementation,
    )
    input_ids = random_input_ids()
    with torch.no_grad():
        assert _max_abs_diff(dar(input_ids).logits, llama(input_ids).logits) <= 1e-5


@pytest.mark.parametrize("block_size,routing,num_streams", UPCYCLING_GRID)
def test_upcycled_dar_gives_llama_logits_float64(float64_llama_norms, block_size, routing, num_streams):
    llama64 = tiny_llama(num_hidden_layers=NUM_LAYERS, dtype=torch.float64)
    input_ids = random_input_ids()
    with torch.no_grad():
        expected = llama64(input_ids).logits
        for implementation in ("fast", "two_phase", "reference"):
            for write_mode in ("duplicate", "split"):
                dar = upcycled_dar(
                    llama64,
                    dar_block_size=block_size,
                    dar_routing=routing,
                    dar_num_streams=num_streams,
                    dar_write_mode=write_mode,
                    dar_implementation=implementation,
                )
                assert dar.dtype == torch.float64
                assert _max_abs_diff(dar(input_ids).logits, expected) <= 1e-10, (implementation, write_mode)


@pytest.mark.parametrize("block_size,routing", [(1, "dar"), (4, "crossv"), (3, "selfkv")])
def test_upcycled_dar_generates_llama_greedy_tokens(llama, block_size, routing):
    dar = upcycled_dar(llama, dar_block_size=block_size, dar_routing=routing)
    input_ids = random_input_ids(length=5)
    settings = dict(max_new_tokens=8, do_sample=False, eos_token_id=None)
    expected = llama.generate(input_ids, **settings)
    assert torch.equal(dar.generate(input_ids, **settings), expected)


@pytest.mark.parametrize("block_size", [1, 2, 4])
def test_dropping_count_scaling_drifts_from_llama(llama, block_size):
    """Without N * the reads are means: same direction, but RMSNorm's eps now acts on a smaller vector."""
    input_ids = random_input_ids()
    with torch.no_grad():
        expected = llama(input_ids).logits
        exact = upcycled_dar(llama, dar_block_size=block_size)(input_ids).logits
        drifted = upcycled_dar(llama, dar_block_size=block_size, dar_count_scaling=False)(input_ids).logits
    assert _max_abs_diff(exact, expected) <= 1e-5
    assert _max_abs_diff(drifted, expected) > 1e-4


@pytest.mark.parametrize("block_size", [2, 3, 6])
def test_dropping_partial_source_drifts_from_llama(llama, block_size):
    """Without the partial block as a source, branch i > 0 of a block misses its block's earlier outputs."""
    input_ids = random_input_ids()
    with torch.no_grad():
        expected = llama(input_ids).logits
        drifted = upcycled_dar(llama, dar_block_size=block_size, dar_include_partial=False)(input_ids).logits
    assert _max_abs_diff(drifted, expected) > 1e-4


def test_dropping_partial_source_is_inert_for_full_dar(llama):
    """K = 1 has no partial source to drop: a control that the drift above comes from the partial source."""
    input_ids = random_input_ids()
    with torch.no_grad():
        drifted = upcycled_dar(llama, dar_block_size=1, dar_include_partial=False)(input_ids).logits
        assert _max_abs_diff(drifted, llama(input_ids).logits) <= 1e-5


# Fast path vs reference with random non-zero DAR parameters: (K, routing, streams, include_partial).
FAST_VS_REFERENCE_GRID = [
    (1, "dar", 2, True),
    (2, "dar", 2, True),
    (3, "crossv", 2, True),
    (4, "fixedkv", 2, True),
    (6, "selfkv", 2, True),
    (3, "selfkv", 1, True),
    (2, "dar", 2, False),
    (3, "crossv", 2, False),  # odd K: attention branches commit, so the MLP read merges a fresh entry
    (2, "selfkv", 1, False),
]


def _logits_and_gradients(llama, implementation, probe, scale=0.5, **dar_fields):
    """Logits and every parameter's gradient of sum(logits * probe), a loss that keeps the model's dtype; every DAR
    parameter moved by `scale` times a normal draw (5: confident reads, depth scores of O(100))."""
    dar = upcycled_dar(llama, dar_implementation=implementation, **dar_fields)
    perturb_dar_parameters(dar, scale=scale, seed=1)
    logits = dar(random_input_ids()).logits
    (logits * probe.to(logits.dtype)).sum().backward()
    gradients = {name: parameter.grad for name, parameter in dar.named_parameters()}
    assert all(gradient is not None for gradient in gradients.values())
    return logits.detach(), gradients


def _fields(block_size, routing, num_streams, include_partial):
    return dict(
        dar_block_size=block_size,
        dar_routing=routing,
        dar_num_streams=num_streams,
        dar_include_partial=include_partial,
        dar_gate_delta=0.0 if routing == "fixedkv" else 0.7,
    )


@pytest.fixture(scope="module")
def probe():
    return torch.randn(2, 9, 97, generator=torch.Generator().manual_seed(5), dtype=torch.float64)


@pytest.mark.parametrize("implementation", ["fast", "two_phase"])
@pytest.mark.parametrize("block_size,routing,num_streams,include_partial", FAST_VS_REFERENCE_GRID)
def test_fast_path_matches_reference_in_float64(float64_llama_norms, probe, block_size, routing, num_streams,
                                                 include_partial, implementation):
    llama64 = tiny_llama(num_hidden_layers=NUM_LAYERS, dtype=torch.float64)
    fields = _fields(block_size, routing, num_streams, include_partial)
    reference_logits, reference_gradients = _logits_and_gradients(llama64, "reference", probe, **fields)
    fast_logits, fast_gradients = _logits_and_gradients(llama64, implementation, probe, **fields)
    # the perturbation matters: the perturbed model is far from Llama
    assert _max_abs_diff(reference_logits, llama64(random_input_ids()).logits) > 1e-2
    assert _max_relative_diff(fast_logits, reference_logits) <= 1e-12  # DESIGN.md section 7
    # Gradients: 1e-12 of the model's largest gradient, and 1e-10 of each tensor's own (a tiny gradient made of
    # cancelling terms, such as a transport logit's, carries rounding of its terms' size).
    largest = max(gradient.abs().max().item() for gradient in reference_gradients.values())
    for name, gradient in reference_gradients.items():
        assert _max_abs_diff(fast_gradients[name], gradient) <= 1e-12 * largest, name
        assert _max_relative_diff(fast_gradients[name], gradient) <= 1e-10, name


def _by_parameter_kind(gradients: dict) -> list[tuple[list[str], torch.Tensor]]:
    """Gradients grouped by parameter name without its layer index (every layer's `read_gate.logit` together),
    each group with its names and its gradients flattened into one vector. A relative error is then taken like a
    tensor's: against the group's largest |gradient|. A single scalar's relative error is ill-conditioned: a read
    gate's gradient sums g . (x^0 - x^1) over tokens and can cancel to 1e-2 of its neighbours', so fp32 rounding of
    1e-6 on it reads as 1e-4 relative whichever evaluation order produced it."""
    groups: dict[str, list[str]] = {}
    for name in gradients:
        groups.setdefault(re.sub(r"\.\d+\.", ".*.", name), []).append(name)
    return [(names, torch.cat([gradients[name].flatten() for name in names])) for names in groups.values()]


@pytest.mark.parametrize("implementation", ["fast", "two_phase"])
@pytest.mark.parametrize("block_size,routing,num_streams,include_partial", FAST_VS_REFERENCE_GRID)
def test_fast_path_fp32_error_is_within_reference_fp32_error(float64_llama_norms, probe, block_size, routing,
                                                              num_streams, include_partial, implementation):
    """DESIGN.md section 4: fp32 tolerances derive from the reference's own fp32-vs-float64 error."""
    _assert_fp32_error_within_the_references(probe, _fields(block_size, routing, num_streams, include_partial),
                                             implementation, scale=0.5)


@pytest.mark.parametrize("implementation,kernel", [("fast", "torch"), ("two_phase", "torch"), ("fast", "cpp")])
@pytest.mark.parametrize("block_size,routing,num_streams,include_partial", [
    (1, "dar", 2, True), (2, "dar", 2, False), (3, "crossv", 2, True), (4, "selfkv", 2, True),
])
def test_confident_reads_fp32_error_is_within_reference_fp32_error(float64_llama_norms, probe, block_size, routing,
                                                                   num_streams, include_partial, implementation,
                                                                   kernel):
    """The same with every DAR parameter moved 5 sigma (depth scores of O(100), weights near one-hot, as trained
    queries become). The two-phase read took phase 1's weights as exp(scores - L), which sum to 1 only to eps |L|,
    and the entries' share as 1 - sigmoid(z - L): its float32 gradients were up to 80x the reference's error. The C++
    training kernel's softmax backward met its mean with a product the compiler fused into a multiply-add (exact,
    where the mean summed rounded ones): up to 800x."""
    _assert_fp32_error_within_the_references(probe, _fields(block_size, routing, num_streams, include_partial),
                                             implementation, scale=5.0, dar_training_kernel=kernel)


def _assert_fp32_error_within_the_references(probe, fields, implementation, scale, **tested):
    exact_logits, exact_gradients = _logits_and_gradients(
        tiny_llama(num_hidden_layers=NUM_LAYERS, dtype=torch.float64), "reference", probe, scale, **fields
    )
    llama32 = tiny_llama(num_hidden_layers=NUM_LAYERS)
    reference_logits, reference_gradients = _logits_and_gradients(llama32, "reference", probe, scale, **fields)
    fast_logits, fast_gradients = _logits_and_gradients(llama32, implementation, probe, scale, **fields, **tested)

    def gradient_error(gradients):
        return max(
            _max_relative_diff(torch.cat([gradients[name].flatten() for name in names]), exact)
            for names, exact in _by_parameter_kind(exact_gradients)
        )

    reference_error = _max_relative_diff(reference_logits, exact_logits)
    # fp32 rounding, measurable and small (confident reads on an AMD EPYC's BLAS: 1.006e-5 for the reference itself)
    assert 0.0 < reference_error < 1e-4
    assert _max_relative_diff(fast_logits, exact_logits) <= 10 * reference_error + 1e-7
    assert gradient_error(fast_gradients) <= 10 * gradient_error(reference_gradients) + 1e-6


# An independent oracle: DESIGN.md section 2 written out as a plain loop over branches and streams, reading the
# model's parameters by name and calling its HF branch modules. Fast path and reference share the gates and the
# routing table; this catches errors in those (invisible at upcycling init, where the queries are zero).
ORACLE_KEY_VALUE_STREAMS = {  # target stream j -> (key stream, value stream)
    "dar": lambda j: (1 - j, j),
    "selfkv": lambda j: (j, j),
    "crossv": lambda j: (j, 1 - j),
    "fixedkv": lambda j: (0, 1),
}


def _oracle_extraction(depth_attention, sources, routing, config):
    """x^j = N * sum_r softmax_r(w^j . RMSNorm_{gamma^j}(S^kappa(j)_r)) S^nu(j)_r, for each target stream j."""
    extractions = []
    for j in range(config.dar_num_streams):
        key_stream, value_stream = ORACLE_KEY_VALUE_STREAMS[routing](j) if config.dar_num_streams == 2 else (0, 0)
        query, gamma = depth_attention.pseudo_query[j], depth_attention.key_norm.weight[j]
        scores = []
        for source in sources:
            key = source[key_stream]
            normed = key / torch.sqrt(key.pow(2).mean(-1, keepdim=True) + config.rms_norm_eps) * gamma
            scores.append(normed @ query)  # [B, T]
        weights = torch.softmax(torch.stack(scores), dim=0)  # [N, B, T]
        mixed = sum(weights[r].unsqueeze(-1) * source[value_stream] for r, source in enumerate(sources))
        extractions.append((len(sources) if config.dar_count_scaling else 1) * mixed)
    return extractions


def _oracle_read_gate(read_gate, extractions, config):
    if config.dar_num_streams == 1:
        return config.dar_read_scale * extractions[0]
    alpha = torch.sigmoid(read_gate.logit)
    return config.dar_read_scale * (alpha * extractions[0] + (1 - alpha) * extractions[1])


def _oracle_logits(model, input_ids):
    config, decoder = model.config, model.model
    num_streams, block_size, num_branches = config.dar_num_streams, config.dar_block_size, config.dar_num_branches
    embedding = decoder.embed_tokens(input_ids)
    positions = torch.arange(input_ids.shape[1]).unsqueeze(0)
    position_embeddings = decoder.rotary_emb(embedding, position_ids=positions)
    history = [[embedding * config.dar_embedding_scale for _ in range(num_streams)]]  # entries, each [stream][B, T, D]
    partial = None
    for branch in range(num_branches):
        layer = decoder.layers[branch // 2]
        residual = layer.attn_residual if branch % 2 == 0 else layer.mlp_residual
        position_in_block = branch % block_size
        sources = history + ([partial] if position_in_block > 0 and config.dar_include_partial else [])
        extractions = _oracle_extraction(residual.depth_attention, sources, config.dar_routing, config)
        u = _oracle_read_gate(residual.read_gate, extractions, config)
        if branch % 2 == 0:  # sdpa with no mask is causal
            normed = layer.input_layernorm(u)
            y = layer.self_attn(normed, position_embeddings=position_embeddings, attention_mask=None)[0]
        else:
            y = layer.mlp(layer.post_attention_layernorm(u))
        if num_streams == 1:
            written = [y]
        else:
            written = [config.dar_write_scale * torch.sigmoid(residual.write_gate.logit[j]) * y for j in range(2)]
        if position_in_block == 0:
            partial = written
        elif num_streams == 1:
            partial = [partial[0] + written[0]]
        else:
            rho = torch.sigmoid(residual.write_gate.transport_logit)
            partial = [rho * partial[j] + (1 - rho) * partial[1 - j] + written[j] for j in range(2)]
        if (branch + 1) % block_size == 0 or branch == num_branches - 1:
            history, partial = history + [partial], None
    readout = decoder.final_readout
    u_final = _oracle_read_gate(
        readout.read_gate, _oracle_extraction(readout.depth_attention, history, config.dar_routing, config), config
    )
    return model.lm_head(decoder.norm(u_final))


ORACLE_GRID = [
    (block_size, routing, 2, write_mode)
    for block_size in (1, 3, 4)
    for routing in ("dar", "selfkv", "crossv", "fixedkv")
    for write_mode in ("duplicate", "split")
] + [(block_size, "selfkv", 1, "duplicate") for block_size in (1, 3, 4)]


@pytest.mark.parametrize("block_size,routing,num_streams,write_mode", ORACLE_GRID)
def test_forward_matches_a_hand_written_oracle_of_the_design_equations(float64_llama_norms, block_size, routing,
                                                                       num_streams, write_mode):
    llama64 = tiny_llama(num_hidden_layers=NUM_LAYERS, dtype=torch.float64)
    input_ids = random_input_ids()
    with torch.no_grad():
        for implementation in ("fast", "two_phase", "reference"):
            dar = upcycled_dar(
                llama64,
                dar_block_size=block_size,
                dar_routing=routing,
                dar_num_streams=num_streams,
                dar_write_mode=write_mode,
                dar_gate_delta=0.0 if routing == "fixedkv" else 0.7,
                dar_implementation=implementation,
            )
            perturb_dar_parameters(dar, scale=0.5, seed=2)
            expected = _oracle_logits(dar, input_ids)
            assert _max_abs_diff(expected, llama64(input_ids).logits) > 1e-2  # the perturbation matters
            assert _max_relative_diff(dar(input_ids).logits, expected) <= 1e-10, implementation


def _stream_pairs(model, input_ids):
    """Run the model and return (stream 0, stream 1) of every state tensor each decoder layer outputs (the history
    entries and the partial block state).

    The stream axis is found by size (J = 2, with B = 3, T = 6, D = 32 and any entry count other than 2), so the
    check does not depend on the state layout.
    """
    outputs = []
    hooks = [
        layer.register_forward_hook(lambda module, args, output: outputs.append(output))
        for layer in model.modules()
        if isinstance(layer, DARDecoderLayer)
    ]
    try:
        model(input_ids)
    finally:
        for hook in hooks:
            hook.remove()
    pairs = []
    for output in outputs:
        for state in output if isinstance(output, tuple) else (output,):
            if not torch.is_tensor(state) or state.shape[-1] != model.config.hidden_size:
                continue
            stream_axes = [axis for axis, size in enumerate(state.shape) if size == 2]
            assert len(stream_axes) == 1, state.shape
            pairs.append(state.detach().unbind(stream_axes[0]))
    assert len(pairs) >= len(outputs) == model.config.num_hidden_layers
    return pairs


def _train_steps(model, steps, seed=0):
    """A few AdamW steps on random tokens (every parameter trained, weight decay on)."""
    model.train()
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.1)
    for step in range(steps):
        batch = random_input_ids(batch=3, length=6, seed=seed + step)
        optimizer.zero_grad()
        model(batch, labels=batch).loss.backward()
        optimizer.step()
    model.eval()


@pytest.mark.parametrize("routing", ["dar", "selfkv"])
def test_streams_stay_identical_with_zero_gate_delta_under_adamw(llama, routing):
    """Negative control of DESIGN.md section 3: symmetric parameters never separate the streams."""
    dar = upcycled_dar(llama, dar_block_size=1, dar_routing=routing, dar_gate_delta=0.0)
    input_ids = random_input_ids(batch=3, length=6, seed=100)  # B = 3, T = 6, S >= 3 after layer 0: J is unique
    _train_steps(dar, steps=3)
    query = dar.model.layers[1].attn_residual.depth_attention.pseudo_query
    assert query.abs().max() > 1e-3  # training moved the queries away from zero ...
    assert torch.equal(query[0], query[1])  # ... by the same amount in both streams
    for stream0, stream1 in _stream_pairs(dar, input_ids):
        assert stream0.abs().max() > 0
        assert _max_abs_diff(stream0, stream1) <= 1e-6 * stream0.abs().max().item()


def test_streams_differ_at_init_and_queries_separate_after_one_step(llama):
    """With the default delta = 0.7 the histories differ in direction from the first branch on, so the two
    streams' queries get different gradients and different values after one optimiser step."""
    dar = upcycled_dar(llama, dar_block_size=1, dar_routing="dar")
    assert dar.config.dar_gate_delta == 0.7
    input_ids = random_input_ids(batch=3, length=6, seed=100)
    embedding = dar.model.embed_tokens(input_ids).detach()
    num_written = 0
    for stream0, stream1 in _stream_pairs(dar, input_ids):
        if torch.equal(stream0, embedding) and torch.equal(stream1, embedding):
            continue  # entry 0 is the embedding in both streams
        # branch outputs are written with different per-channel gates beta^0 != beta^1
        cosine = torch.nn.functional.cosine_similarity(stream0.flatten(), stream1.flatten(), dim=0).item()
        assert cosine < 0.99
        num_written += 1
    assert num_written >= dar.config.num_hidden_layers

    dar.train()
    dar(input_ids, labels=input_ids).loss.backward()
    for layer in dar.model.layers:
        for residual in (layer.attn_residual, layer.mlp_residual):
            if residual.branch_index == 0:
                continue  # one source: the softmax is constant, the query gets no gradient
            gradient = residual.depth_attention.pseudo_query.grad  # [J, D]
            assert _max_abs_diff(gradient[0], gradient[1]) > 1e-3 * gradient.abs().max().item()
    _train_steps(dar, steps=1)
    query = dar.model.layers[1].mlp_residual.depth_attention.pseudo_query
    assert _max_abs_diff(query[0], query[1]) > 1e-3
