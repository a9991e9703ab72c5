# SPDX-License-Identifier: Apache-2.0
"""The bytes on paper (issue 16 item 6): what DAR's depth path moves per token per branch, against the branch's own
matmul FLOPs and bytes, and the DAR/Llama ratios this projects on an H100-class GPU.

1. Counted: `dar_bytes` writes out, region by region, what the two-phase backend (`depth_backends.py`) reads and
   writes, each region one kernel that reads each input once and writes each output once (entry 0, the embedding
   broadcast to J streams, is read as [D]):
     phase 1        once per decoder layer: the S committed entries (history dtype) and their inverse RMS [S, J];
                    out, per read: Obar [J, D] fp32, log-sum-exp [J], softmax weights [S, J]
     read           per branch (phase 2): Obar and L, and when the partial is read P [J, D] fp32 with phase 1's
                    weights; out: u [D] fp32 and (with P) the merged depth weights [S + 1, J]
     write          per branch: y [D] (model dtype) and P; out P' [J, D] fp32, or at a commit the entry [J, D]
                    (history dtype) and the inverse-RMS table [S + 1, J]
     read backward  `_TwoPhaseRead.backward`: dY, weights, the S entries, P, statistics; out a gradient for each of
                    the S entries (history dtype) and for P
     rebuild        once per block (`_BlockPartials`): the kept y in, every partial of the block out (a block of
                    one write: its entry, history dtype)
     gradient sums  autograd's sum of an entry's gradients over the reads that see it (each read returns all S: one
                    add per entry and extra read) and of a partial's two gradients (next read, next write)
     write backward dP' (and P) with y in, dy (and dP) out: the fused minimum; eager runs it node by node.
2. Measured: the same path run for real (the backend and the paper modules of a `DARConfig`; each branch replaced by
   an identity view, so that only DAR's ops remain) under a `TorchDispatchMode` that sees every aten op, at two token
   counts (per-token bytes are the slope: parameter-sized tensors cancel). The backend's methods, the read's backward
   and the rebuild are regions; every other backward op is grouped by the autograd node that runs it. Each region is
   counted as one fused kernel: distinct external inputs, plus what it makes that leaves it; views move nothing. The
   check prints counted against measured: they agree to 0.1% at the real shapes (1.1% at tiny ones) in every region
   but the write's backward, which is reported both ways (fused minimum, and eager's autograd nodes).
3. Projected (`projection`): per token and decoder layer, Llama's training time is its matmuls (3x the forward
   FLOPs at the dense bf16 peak, or their bytes at full bandwidth if that is longer) plus its memory-bound kernels
   (norms, RoPE, SwiGLU, residual adds; forward 1x, backward 2x) at full bandwidth, nothing overlapped. DAR's is the
   same without the residual adds, plus its own forward and backward bytes at full bandwidth (DAR's depth path does
   under 1 FLOP per byte). Decode: one step of a batch reads the weights once and each sequence's KV cache.

    python benchmarks/bytes_on_paper.py                 # table (markdown) + check, all shapes
    python benchmarks/bytes_on_paper.py --json out.json
"""

import argparse
import dataclasses
import json
import math
from collections import defaultdict

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten

from dar_transformers import DARConfig, depth_backends
from dar_transformers.depth_backends import dar_history_dtype, depth_backend
from dar_transformers.modeling_dar import DARBranchResidual, DARReadout

SHAPES = {  # published configs (hidden, intermediate, layers, heads, kv heads)
    "SmolLM2-135M": dict(hidden_size=576, intermediate_size=1536, num_hidden_layers=30, num_attention_heads=9,
                         num_key_value_heads=3),
    "Llama-3.2-1B": dict(hidden_size=2048, intermediate_size=8192, num_hidden_layers=16, num_attention_heads=32,
                         num_key_value_heads=8),
    "Llama-3-8B": dict(hidden_size=4096, intermediate_size=14336, num_hidden_layers=32, num_attention_heads=32,
                       num_key_value_heads=8),
}
H100 = dict(bandwidth=3.35e12, flops=989e12)  # bytes/s, dense bf16 FLOP/s
F32 = 4


# ---------------------------------------------------------------------------------------------------------------
# 1. Counted from the algorithm as implemented


def branch_layout(config: DARConfig) -> list[dict]:
    """Where each read stands (the M branches, then the final readout): committed entries S it sees, whether it reads
    the partial, opens or commits a block, and how many reads its phase 1 serves (0: planned by the branch before)."""
    block, branches = config.dar_block_size, config.dar_num_branches
    layout = []
    for m in range(branches):
        commits = (m + 1) % block == 0 or m == branches - 1
        attention_plans_both = m % 2 == 1 and not layout[-1]["commits"]
        layout.append(dict(entries=1 + m // block, reads_partial=config.dar_include_partial and m % block != 0,
                           opens=m % block == 0, commits=commits,
                           planned_reads=0 if attention_plans_both else (2 if m % 2 == 0 and not commits else 1)))
    layout.append(dict(entries=1 + -(-branches // block), reads_partial=False, opens=False, commits=False,
                       planned_reads=1, readout=True))
    return layout


def dar_bytes(config: DARConfig, model_bytes: int, history_bytes: int) -> dict[str, float]:
    """Bytes per token per branch by region (the final readout's read spread over the M branches), each region one
    kernel that reads its inputs once and writes its outputs once, as `measured_bytes` counts them."""
    streams, hidden = config.dar_num_streams, config.hidden_size
    entry, state, stat = streams * hidden * history_bytes, streams * hidden * F32, streams * F32
    layout = branch_layout(config)
    reads_of_entry = defaultdict(int)  # how many reads see committed entry s (for autograd's gradient sums)
    totals = defaultdict(float)
    partial_sums = 0
    for branch in layout:
        entries, partial = branch["entries"], int(branch["reads_partial"])
        history = hidden * history_bytes + (entries - 1) * entry  # entry 0 is the embedding broadcast to J streams
        for s in range(entries):
            reads_of_entry[s] += 1
        if branch["planned_reads"]:  # phase 1: entries and statistics in; per read Obar, L and weights out
            per_read = state + stat + entries * stat
            totals["phase 1"] += history + entries * stat + branch["planned_reads"] * per_read
        # phase 2: Obar and L in, and weights and P if the partial is read; u and the depth weights out
        totals["read"] += state + stat + partial * (entries * stat + state) + hidden * F32
        totals["read"] += partial * (entries + 1) * stat  # the merged depth weights (without P they are phase 1's)
        totals["read backward"] += (hidden * F32 + (entries + partial) * stat + history + entries * stat
                                    + partial * (state + stat)) + entries * entry + partial * state
        if branch.get("readout"):
            continue
        # write: y (and P unless the branch opens a block) in; P', or at a commit the entry and inverse-RMS table, out
        totals["write"] += hidden * model_bytes + (not branch["opens"]) * state
        totals["write"] += entry + entries * stat + (entries + 1) * stat if branch["commits"] else state
        if not branch["commits"]:  # backward: the block's partials rebuilt from the kept y
            totals["rebuild"] += hidden * model_bytes + state
            partial_sums += config.dar_include_partial  # dP from the next read and from the next write: one add
        elif branch["opens"]:  # a block of one write: its entry (beta * y) rebuilt from the kept y
            totals["rebuild"] += hidden * model_bytes + entry
        # the write's backward at its fused minimum: dP' (and P) in with y; dy (and dP) out
        totals["write backward"] += state + 2 * hidden * model_bytes + 2 * (not branch["opens"]) * state
    # autograd sums the gradients of an entry over the reads that see it: one add (two in, one out) per extra read
    entry_sums = sum(3 * entry * (reads - 1) for reads in reads_of_entry.values())
    totals["gradient sums"] = entry_sums + 3 * state * partial_sums
    return {region: value / config.dar_num_branches for region, value in totals.items()}


# ---------------------------------------------------------------------------------------------------------------
# 2. Measured: the DAR path with identity branches under a dispatch mode


def _view_bytes(tensor: torch.Tensor) -> int:
    """Distinct elements a kernel touches in this view (broadcast dimensions count once), in bytes."""
    elements = math.prod(size for size, stride in zip(tensor.shape, tensor.stride()) if stride != 0)
    return elements * tensor.element_size()


def _tensors(tree):
    """The tensors in a result: pytrees, and the DAR state and phase 1 (dataclasses pytree does not open)."""
    if isinstance(tree, depth_backends.DepthState):
        tree = (tree.partial, tree.history_inv_rms, tree.history)
    elif isinstance(tree, depth_backends.PhaseOne):
        tree = tuple(getattr(tree, field.name) for field in dataclasses.fields(tree))
    elif isinstance(tree, (tuple, list)):
        return [tensor for leaf in tree for tensor in _tensors(leaf)]
    return [leaf for leaf in tree_flatten(tree)[0] if isinstance(leaf, torch.Tensor)]


def _key(tensor: torch.Tensor) -> tuple:
    return (tensor.untyped_storage().data_ptr(), tuple(tensor.shape), tuple(tensor.stride()), tensor.storage_offset())


class ByteCounter(TorchDispatchMode):
    """Bytes per region, each region counted as one fused kernel: the distinct inputs it reads that were made outside
    it, plus the tensors it makes that leave it. Explicit regions (`region(name, function)`, the backend's methods and
    the read's backward): what leaves is what the function returns. Everything else is grouped by the autograd node
    that runs it (`torch._C._current_autograd_node`: the write's backward, casts, autograd's sums of an entry's
    gradients), or as "other forward"; there what leaves is what no later op of the same group reads."""

    def __init__(self):
        super().__init__()
        self.bytes = defaultdict(int)
        self.stack: list[dict] = []
        self.groups: dict = {}  # implicit regions: id -> dict(name, made {key: bytes}, read {key: bytes}, used set)

    def region(self, name, function):
        counter = self

        def wrapped(*args, **kwargs):
            frame = dict(name=name, made=set(), read={})
            counter.stack.append(frame)
            try:
                result = function(*args, **kwargs)
            finally:
                counter.stack.pop()
            leaving = [*_tensors(result), *frame.get("also_leaving", [])]
            outputs = {_key(t): _view_bytes(t) for t in leaving if t.untyped_storage().data_ptr() in frame["made"]}
            counter.bytes[name] += sum(frame["read"].values()) + sum(outputs.values()) + frame.get("in_place", 0)
            return result

        return wrapped

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        out = func(*args, **kwargs)
        inputs, outputs = _tensors((args, kwargs)), _tensors(out)
        aliases = [result.alias_info for result in func._schema.returns if result.alias_info is not None]
        if aliases and not any(alias.is_write for alias in aliases):
            return out  # a view: no bytes of its own
        in_place = outputs if aliases else []  # written over an input: a write unless the region made that input
        if self.stack:
            frame = self.stack[-1]
            frame["in_place"] = frame.get("in_place", 0) + sum(
                _view_bytes(tensor) for tensor in in_place if tensor.untyped_storage().data_ptr() not in frame["made"])
            for tensor in inputs:
                storage = tensor.untyped_storage().data_ptr()
                if storage not in frame["made"] and tensor.numel() > 0:  # one read per view start, its largest view
                    key = (storage, tensor.storage_offset())
                    frame["read"][key] = max(frame["read"].get(key, 0), _view_bytes(tensor))
            for tensor in outputs:
                frame["made"].add(tensor.untyped_storage().data_ptr())
            return out
        node = torch._C._current_autograd_node()
        group = self.groups.setdefault(id(node) if node is not None else "forward", dict(
            name=type(node).__name__ if node is not None else "other forward", made={}, read={}, used=set(),
            in_place=0))
        group["in_place"] += sum(
            _view_bytes(tensor) for tensor in in_place if tensor.untyped_storage().data_ptr() not in group["made"])
        for tensor in inputs:
            storage = tensor.untyped_storage().data_ptr()
            if storage in group["made"]:
                group["used"].add(storage)
            elif tensor.numel() > 0:
                key = (storage, tensor.storage_offset())
                group["read"][key] = max(group["read"].get(key, 0), _view_bytes(tensor))
        for tensor in outputs:
            group["made"].setdefault(tensor.untyped_storage().data_ptr(), _view_bytes(tensor))
        return out

    def close_groups(self, prefix: str) -> None:
        """Account the implicit regions so far (a group's made tensors that no later op of it read leave it)."""
        for group in self.groups.values():
            written = sum(size for storage, size in group["made"].items() if storage not in group["used"])
            self.bytes[f"{prefix}{group['name']}"] += sum(group["read"].values()) + written + group["in_place"]
        self.groups.clear()


class _IdentityBranch(torch.autograd.Function):
    """F_m replaced by y = u (a view: no bytes), so that only DAR's own ops remain."""

    @staticmethod
    def forward(ctx, branch_input):
        return branch_input.view_as(branch_input)

    @staticmethod
    def backward(ctx, grad):
        return grad


def measured_bytes(config: DARConfig, dtype: torch.dtype, tokens: int) -> dict[str, int]:
    """Bytes by region of one forward and backward of the DAR path over [1, tokens] (identity branches)."""
    torch.manual_seed(0)
    residuals = [DARBranchResidual(config, m) for m in range(config.dar_num_branches)]
    readout = DARReadout(config)
    for module in (*residuals, readout):
        for parameter in module.parameters():
            parameter.data.add_(0.3 * torch.randn_like(parameter))
    backend = depth_backend(config)
    counter = ByteCounter()
    for name, method in (("phase 1", "plan"), ("read", "read"), ("write", "write")):
        setattr(backend, method, counter.region(name, getattr(backend, method)))
    original_backward, original_rebuild = depth_backends._TwoPhaseRead.backward, depth_backends._BlockPartials.rebuild
    depth_backends._TwoPhaseRead.backward = staticmethod(counter.region("read backward", original_backward))
    rebuilding = {}

    def rebuild(block, index):
        rebuilding["entry"] = block.dtype is not None  # an entry (returned in the history dtype), not partials
        return original_rebuild(block, index)

    depth_backends._BlockPartials.rebuild = counter.region("rebuild", rebuild)
    original_write = depth_backends.gated_write

    def gated_write(*args):  # a rebuild materialises every partial of its block: all of them leave it
        partial = original_write(*args)
        if counter.stack and counter.stack[-1]["name"] == "rebuild" and not rebuilding["entry"]:
            counter.stack[-1].setdefault("also_leaving", []).append(partial)
        return partial

    depth_backends.gated_write = gated_write
    try:
        embedding = torch.randn(1, tokens, config.hidden_size, dtype=dtype, requires_grad=True)
        with counter:
            # DARModel.initial_state and DARDecoderLayer.forward, with identity branches
            history = embedding.to(dar_history_dtype(config, dtype)) * config.dar_embedding_scale
            state = backend.start(history.unsqueeze(-2).expand(-1, -1, config.dar_num_streams, -1))
            with backend.keeping_partials_lean():
                for layer in range(config.num_hidden_layers):
                    attn, mlp = residuals[2 * layer], residuals[2 * layer + 1]
                    attn_read, mlp_read = backend.plan(state, attn, mlp)
                    state = attn.write(state, _IdentityBranch.apply(attn.read(state, dtype, attn_read)))
                    state = mlp.write(state, _IdentityBranch.apply(mlp.read(state, dtype, mlp_read)))
                output, _ = readout(*state.as_args())
            counter.close_groups("")
            output.backward(torch.ones_like(output))
            counter.close_groups("backward: ")
    finally:
        depth_backends._TwoPhaseRead.backward = original_backward
        depth_backends._BlockPartials.rebuild = original_rebuild
        depth_backends.gated_write = original_write
    return dict(counter.bytes)


# autograd nodes of the measurement -> the counted region they implement
MEASURED_GROUPS = {"backward: _TwoPhaseReadBackward": "gradient sums"}
FORWARD_REGIONS = ("phase 1", "read", "write")
BACKWARD_REGIONS = ("read backward", "rebuild", "gradient sums", "write backward")


def measured_per_token(config: DARConfig, dtype: torch.dtype) -> dict[str, float]:
    """Per token per branch: the slope between two token counts (parameter-sized tensors cancel). The autograd nodes
    other than the read's are the write's backward and casts ("write backward", as eager runs it, node by node)."""
    small, large = measured_bytes(config, dtype, 8), measured_bytes(config, dtype, 24)
    per_token = defaultdict(float)
    for name in set(small) | set(large):
        region = MEASURED_GROUPS.get(name, name)
        if region not in FORWARD_REGIONS + BACKWARD_REGIONS:
            region = "write backward" if name.startswith("backward: ") else "other forward"
        per_token[region] += (large.get(name, 0) - small.get(name, 0)) / 16 / config.dar_num_branches
    return dict(per_token)


# ---------------------------------------------------------------------------------------------------------------
# 3. The branches' own FLOPs and bytes, and the projection


def llama_layer_costs(shape: dict, context: int, model_bytes: int = 2) -> dict[str, float]:
    """Per token and decoder layer (attention + MLP branches), forward: matmul FLOPs (projections, and QK^T and AV
    over a causal context of mean length context / 2), weight elements, and the bytes of the memory-bound kernels
    between the matmuls (two RMSNorms, RoPE on q and k, SwiGLU, two residual adds; flash attention reads K and V
    on chip)."""
    hidden, inter = shape["hidden_size"], shape["intermediate_size"]
    kv = shape["num_key_value_heads"] * hidden // shape["num_attention_heads"]
    weights = hidden * (2 * hidden + 2 * kv) + 3 * hidden * inter  # q, o, k, v; gate, up, down
    flops = 2 * weights + 2 * 2 * hidden * context / 2
    matmul_io = (hidden + hidden + 2 * kv + hidden + hidden) + (hidden + 2 * inter + inter + hidden)  # in + out
    elementwise = 2 * 2 * hidden + 2 * 2 * (hidden + kv) + 3 * inter  # norms, RoPE, SwiGLU: read + write
    residual_adds = 2 * 3 * hidden  # h + y, twice: read two, write one
    return dict(flops=flops, weights=weights, matmul_io_bytes=matmul_io * model_bytes,
                elementwise_bytes=elementwise * model_bytes, residual_bytes=residual_adds * model_bytes,
                kv_bytes_per_token_of_context=2 * kv * model_bytes)


def projection(shape: dict, forward: float, backward: float, tokens_per_step: int, context: int,
               decode_batch: int) -> dict[str, float]:
    """DAR / Llama time ratios on an H100-class GPU from bytes and FLOPs per token and decoder layer. forward,
    backward: DAR's bytes per token per branch. Assumptions: matmuls at the dense bf16 peak, every memory-bound kernel
    at full bandwidth, nothing overlaps; backward = 2x forward FLOPs and 2x forward elementwise bytes; DAR replaces
    the residual adds (and their backward) and adds its own bytes."""
    costs, bandwidth, peak = llama_layer_costs(shape, context), H100["bandwidth"], H100["flops"]
    weight_bytes = 2 * costs["weights"]
    train_matmul = max(3 * costs["flops"] / peak,
                       (3 * costs["matmul_io_bytes"] + 3 * weight_bytes / tokens_per_step) / bandwidth)
    train_llama = train_matmul + 3 * (costs["elementwise_bytes"] + costs["residual_bytes"]) / bandwidth
    train_dar = train_matmul + 3 * costs["elementwise_bytes"] / bandwidth + 2 * (forward + backward) / bandwidth
    # decode, one step of `decode_batch` sequences at `context` tokens: the weights once, each sequence's KV cache
    decode_matmul = max(decode_batch * costs["flops"] / peak, (weight_bytes + decode_batch * (
        context * costs["kv_bytes_per_token_of_context"] + costs["matmul_io_bytes"])) / bandwidth)
    decode_llama = decode_matmul + decode_batch * (costs["elementwise_bytes"] + costs["residual_bytes"]) / bandwidth
    decode_dar = decode_matmul + decode_batch * (costs["elementwise_bytes"] + 2 * forward) / bandwidth
    return dict(train=train_dar / train_llama, decode=decode_dar / decode_llama,
                llama_flops_per_branch=costs["flops"] / 2,
                llama_bytes_per_branch=(costs["matmul_io_bytes"] + costs["elementwise_bytes"] + costs["residual_bytes"]
                                        + weight_bytes / tokens_per_step) / 2,
                train_matmul_share=train_matmul / train_llama)


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--tokens-per-step", type=int, default=8 * 4096, help="training tokens per optimiser step")
    parser.add_argument("--context", type=int, default=4096)
    parser.add_argument("--decode-batch", type=int, nargs="+", default=[1, 64])
    parser.add_argument("--no-measure", dest="measure", action="store_false",
                        help="counted bytes and the projection only (skip the dispatch-mode check, ~3 min on 2 cores)")
    parser.add_argument("--json", default=None)
    arguments = parser.parse_args()
    report, check_rows, table_rows = {}, [], []
    for shape_name, shape in SHAPES.items():
        for history in ("float32", "model"):
            config = DARConfig(**shape, vocab_size=128, dar_history_dtype=history, dar_implementation="two_phase")
            counted = dar_bytes(config, 2, F32 if history == "float32" else 2)
            measured = measured_per_token(config, torch.bfloat16) if arguments.measure else {}
            forward = sum(counted[region] for region in FORWARD_REGIONS)
            backward = sum(counted[region] for region in BACKWARD_REGIONS)
            measured_forward = sum(measured.get(region, 0) for region in FORWARD_REGIONS)
            measured_backward = sum(measured.get(region, 0) for region in BACKWARD_REGIONS)
            fused_measured_backward = measured_backward - measured.get("write backward", 0) + counted["write backward"]
            largest_gap = max(abs(counted[r] - measured.get(r, 0)) / max(counted[r], 1) for r in counted
                              if r != "write backward") if measured else float("nan")
            projections = {batch: projection(shape, forward, backward, arguments.tokens_per_step, arguments.context,
                                             batch) for batch in arguments.decode_batch}
            first = projections[arguments.decode_batch[0]]
            report[f"{shape_name} / {history}"] = dict(block_size=config.dar_block_size, counted=counted,
                                                       measured=measured, projections=projections)
            check_rows.append(
                f"| {shape_name} | {history} | {forward / 1024:.1f} | {measured_forward / 1024:.1f} | "
                f"{backward / 1024:.1f} | {fused_measured_backward / 1024:.1f} | {measured_backward / 1024:.1f} | "
                f"{largest_gap:.1%} |")
            decode = " | ".join(f"{projections[batch]['decode']:.3f}x" for batch in arguments.decode_batch)
            table_rows.append(
                f"| {shape_name} (K = {config.dar_block_size}) | {history} | {forward / 1024:.1f} | "
                f"{backward / 1024:.1f} | "
                f"{first['llama_flops_per_branch'] / 1e6:.1f} | {first['llama_bytes_per_branch'] / 1024:.1f} | "
                f"{first['train']:.3f}x | {decode} |")
    if arguments.measure:  # with --no-measure there is nothing to check the count against: no such table
        print("Bytes per token per branch (KiB), bf16 model: counted (fused regions) against measured (dispatch "
              "mode)\n")
        print("| shape | history | forward counted | forward measured | backward counted | backward measured (write "
              "backward fused) | backward measured (eager autograd nodes) | largest region gap |")
        print("|---|---|---:|---:|---:|---:|---:|---:|")
        print("\n".join(check_rows))
    batches = " | ".join(f"decode ratio, batch {batch}" for batch in arguments.decode_batch)
    print(f"\nProjection on an H100-class GPU ({H100['bandwidth'] / 1e12:.2f} TB/s, {H100['flops'] / 1e12:.0f} dense "
          f"bf16 TFLOP/s), {arguments.tokens_per_step} tokens per training step, context {arguments.context}\n")
    print(f"| shape | history | DAR forward KiB | DAR backward KiB | branch matmul MFLOP | branch bytes KiB | "
          f"training ratio | {batches} |")
    print("|---|---|---:|---:|---:|---:|---:|" + "---:|" * len(arguments.decode_batch))
    print("\n".join(table_rows))
    if arguments.json:
        with open(arguments.json, "w") as handle:
            json.dump(report, handle, indent=1, default=float)


if __name__ == "__main__":
    main()
