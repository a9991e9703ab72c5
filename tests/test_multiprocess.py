# SPDX-License-Identifier: Apache-2.0
"""Multi-process training on CPU: `accelerate launch` with 2 processes (gloo) runs examples/finetune.py --tiny under
DDP. Every rank saves its parameters and the first batch it trained on; the test checks that the ranks saw different
data, ended with bit-identical parameters, and that the held-out loss fell.

The launcher is torchrun under `accelerate launch --multi_gpu`: with `--cpu`, accelerate 1.x runs a single process
(multi-CPU needs mpirun), while `--multi_gpu` on a machine without GPUs gives `DistributedType.MULTI_CPU` + gloo.
Each process gets one thread (OMP_NUM_THREADS=1).
"""

import json
import os
import socket
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from test_training import REPOSITORY, write_docstring_corpus

LAUNCHER = '''
import importlib.util, json, sys
from pathlib import Path
import pytest
import torch

spec = importlib.util.spec_from_file_location("finetune", {example!r})
finetune = importlib.util.module_from_spec(spec)
spec.loader.exec_module(finetune)
output = Path(sys.argv[1])
trainer, results = finetune.main(sys.argv[2:])
rank = trainer.args.process_index
first_batch = next(iter(trainer.get_train_dataloader()))["input_ids"]
torch.save({{"parameters": {{name: p.detach().clone() for name, p in trainer.model.named_parameters()}},
            "first_batch": first_batch}}, output / f"rank{{rank}}.pt")
(output / f"rank{{rank}}.json").write_text(json.dumps({{
    "results": results, "world_size": trainer.args.world_size,
    "distributed_type": str(trainer.accelerator.distributed_type), "backend": trainer.accelerator.state.backend,
    "losses": [entry["loss"] for entry in trainer.state.log_history if "loss" in entry]}}))
'''


def free_port() -> int:
    with socket.socket() as handle:
        handle.bind(("127.0.0.1", 0))
        return handle.getsockname()[1]


def test_two_process_ddp_keeps_ranks_in_sync_and_lowers_loss(tmp_path):
    corpus = write_docstring_corpus(tmp_path / "corpus")
    launcher = tmp_path / "launch.py"
    launcher.write_text(LAUNCHER.format(example=str(REPOSITORY / "examples" / "finetune.py")))
    command = [
        sys.executable, "-m", "accelerate.commands.launch", "--multi_gpu", "--num_processes", "2", "--num_machines", "1",
        "--mixed_precision", "no", "--dynamo_backend", "no", "--main_process_port", str(free_port()),
        str(launcher), str(tmp_path),
        "--tiny", "--corpus-dir", str(corpus), "--output-dir", str(tmp_path / "run"), "--max-steps", "12",
        "--sequence-length", "64", "--batch-size", "4", "--learning-rate", "3e-3", "--train-documents", "80",
        "--eval-documents", "20", "--eval-blocks", "8", "--logging-steps", "2",
    ]
    environment = {**os.environ, "OMP_NUM_THREADS": "1", "HF_DATASETS_CACHE": str(tmp_path / "datasets"),
                   "CUDA_VISIBLE_DEVICES": "", "TOKENIZERS_PARALLELISM": "false"}
    completed = subprocess.run(command, env=environment, capture_output=True, text=True, timeout=600)
    assert completed.returncode == 0, completed.stdout[-3000:] + completed.stderr[-5000:]

    reports = [json.loads((tmp_path / f"rank{rank}.json").read_text()) for rank in (0, 1)]
    states = [torch.load(tmp_path / f"rank{rank}.pt") for rank in (0, 1)]
    for report in reports:
        assert report["world_size"] == 2
        assert report["distributed_type"] == "DistributedType.MULTI_CPU" and report["backend"] == "gloo"
    # The ranks trained on different shards of the data ...
    assert not torch.equal(states[0]["first_batch"], states[1]["first_batch"])
    # ... and DDP's gradient all-reduce kept every parameter bit-identical.
    parameters = [state["parameters"] for state in states]
    assert parameters[0].keys() == parameters[1].keys() and len(parameters[0]) > 30
    for name in parameters[0]:
        assert torch.equal(parameters[0][name], parameters[1][name]), name
    results = reports[0]["results"]
    assert results["perplexity_after"] < 0.8 * results["perplexity_before"]
    losses = reports[0]["losses"]
    assert len(losses) == 6 and losses[-1] < losses[0]
    for key in ("eval_loss_before", "eval_loss_after", "steps"):  # evaluation is gathered over both ranks
        assert reports[1]["results"][key] == results[key]


FSDP2_SCRIPT = '''
import sys
import torch, torch.distributed as dist
sys.path.insert(0, {tests!r})
from conftest import perturb_dar_parameters, random_input_ids, tiny_llama, upcycled_dar
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard

dist.init_process_group("gloo")
rank, world = dist.get_rank(), dist.get_world_size()


def build():
    model = upcycled_dar(tiny_llama(), dar_block_size=2).double().train()
    perturb_dar_parameters(model)
    return model


reference, model = build(), build()
assert all(parameter.dim() > 0 for parameter in model.parameters())  # fully_shard refuses 0-dim parameters
mesh = init_device_mesh("cpu", (world,))
for layer in model.model.layers:
    fully_shard(layer, mesh=mesh)
fully_shard(model, mesh=mesh)
optimizer, reference_optimizer = (torch.optim.SGD(m.parameters(), lr=0.5) for m in (model, reference))
for step in range(3):
    input_ids = random_input_ids(batch=2 * world, length=12, seed=step)
    shards = input_ids.chunk(world)
    model(input_ids=shards[rank], labels=shards[rank]).loss.backward()
    optimizer.step()
    optimizer.zero_grad()
    (sum(reference(input_ids=shard, labels=shard).loss for shard in shards) / world).backward()
    reference_optimizer.step()
    reference_optimizer.zero_grad()
difference = max((p.full_tensor() - q).abs().max().item()
                 for p, q in zip(model.parameters(), reference.parameters()))
sharded = sum(type(p).__name__ == "DTensor" for p in model.parameters())
if rank == 0:
    print("RESULT", difference, sharded, len(list(model.parameters())), flush=True)
dist.destroy_process_group()
'''


@pytest.mark.slow
def test_fsdp2_on_cpu_matches_single_process_training(tmp_path):
    """FSDP2 (`fully_shard` per decoder layer and at the root) over gloo: 3 SGD steps on 2 ranks equal one process
    averaging the two shards' losses, in float64. accelerate 1.x does not offer FSDP on CPU (its FSDP plugin needs
    a GPU distributed type; `--use_fsdp` on CPU silently runs DDP), so this drives torch's FSDP2 directly.
    (`fully_shard` refuses 0-dim parameters; DAR's gate logits have shape (1,) for that reason.)"""
    script = tmp_path / "fsdp2.py"
    script.write_text(FSDP2_SCRIPT.format(tests=str(REPOSITORY / "tests")))
    command = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "2", "--master_port",
               str(free_port()), str(script)]
    environment = {**os.environ, "OMP_NUM_THREADS": "1", "CUDA_VISIBLE_DEVICES": ""}
    completed = subprocess.run(command, env=environment, capture_output=True, text=True, timeout=600)
    assert completed.returncode == 0, completed.stderr[-5000:]
    difference, sharded, total = completed.stdout.split("RESULT ", 1)[1].split()
    assert int(sharded) == int(total) > 30  # every parameter is a sharded DTensor
    assert float(difference) < 1e-12
