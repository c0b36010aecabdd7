"""A tiny deterministic FSDP2 training job for the multi-node tests (tests/test_multi_node.py).

Run by torchrun, one launch per simulated node, each node with its own local checkpoint
directory (``--local-dir``) and all nodes with one object store (``--remote``):

    python -m torch.distributed.run --nnodes 2 --nproc_per_node 2 --node_rank K \\
        --master_addr 127.0.0.1 --master_port P tests/multi_node_train.py \\
        --local-dir T/nodeK/nvme --remote s3://bucket/run --run-dir T/nodeK --steps 8

Gloo on CPU; an MLP sharded with ``fully_shard`` so every rank owns its shards; AdamW.
The global batch of a step depends only on (seed, step); a rank trains on its slice, so
runs on the same world size are bit-identical. Rank 0 prints ``resumed from step N``
or ``fresh start``. Files written under ``--run-dir`` by rank R:

- ``losses.rank{R}.jsonl``: ``{"step", "loss"}`` per step (loss as ``float.hex``),
  appended to across restarts;
- ``restored.rank{R}.json`` after a restore: the step and digests of what was loaded;
- ``final.rank{R}.json`` at the end: the step and digests of the final state.

``local_sha256`` hashes this rank's own shards (parameters and AdamW state);
``full_sha256`` hashes the full (gathered) tensors, comparable across world sizes.

Fault injection on the node it is given to (every process of that launch):
``--fail-uploads`` makes every write to the object store raise OSError("injected upload
failure"); ``--kill-during-upload N`` SIGKILLs the process at its N-th such write.

Preemption (tests/test_preemption_grace.py, which launches the ranks directly, as
``srun`` does): ``--preemption-signal USR1`` and ``--grace S`` configure the manager,
``--memory-every N`` adds the memory tier, ``--slow-disk S`` makes every disk save take
S seconds longer, ``--step-sleep S`` adds S seconds of "compute" to each step (a signal
lands mid-run; bench/bench_goodput.py's stand-in for GPU time). A preempted rank writes
``preempted.rank{R}.json`` (the step, the exit code) and exits with the manager's exit
code. ``--timeline``: rank 0 appends to ``timeline.jsonl`` when it starts, what it
restored, and each step's start, compute end and save end (wall clock), for the goodput
campaign. ``--erasure K+M`` protects the memory tier with ``ErasureCode(K, M)`` instead
of a buddy replica.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import signal
import sys
import time
from datetime import timedelta
from pathlib import Path

import torch
import torch.distributed as dist
from torch import nn

import shardpoint
from shardpoint import (
    ErasureCode,
    MemoryTierOptions,
    RemoteTier,
    Replicas,
    RetentionPolicy,
    SavePolicy,
)

IN, HIDDEN, OUT = 64, 256, 64  # ~99k parameters; 256 rows shard unevenly on 3 ranks
GLOBAL_BATCH = 12  # divisible by 2, 3 and 4 ranks
# Every method by which the object store is written (whichever exist in this version).
OBJECT_STORE_WRITES = ("open_writer", "write_files", "put_file", "write_small_durably")


class MLP(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.a = nn.Linear(IN, HIDDEN)
        self.b = nn.Linear(HIDDEN, HIDDEN)
        self.c = nn.Linear(HIDDEN, OUT)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.c(torch.relu(self.b(torch.relu(self.a(x)))))


def build(world: int, seed: int) -> tuple[nn.Module, torch.optim.Optimizer]:
    """The model (sharded on ``world`` ranks when ``world > 1``) and its optimizer."""
    torch.manual_seed(seed)
    model = MLP()
    if world > 1:
        from torch.distributed.device_mesh import init_device_mesh
        from torch.distributed.fsdp import fully_shard

        mesh = init_device_mesh("cpu", (world,))
        for layer in (model.a, model.b, model.c):
            fully_shard(layer, mesh=mesh)
        fully_shard(model, mesh=mesh)
    return model, torch.optim.AdamW(model.parameters(), lr=3e-3, weight_decay=0.01)


def batch(seed: int, step: int, rank: int, world: int) -> tuple[torch.Tensor, torch.Tensor]:
    """This rank's slice of the global batch of ``step`` (a function of seed and step only)."""
    g = torch.Generator().manual_seed(seed * 1_000_003 + step)
    x = torch.randn(GLOBAL_BATCH, IN, generator=g)
    y = torch.sin(x[:, :OUT] * 2.0) + 0.1 * torch.randn(GLOBAL_BATCH, OUT, generator=g)
    per = GLOBAL_BATCH // world
    return x[rank * per : (rank + 1) * per], y[rank * per : (rank + 1) * per]


def _tensors(model: nn.Module, opt: torch.optim.Optimizer):  # noqa: ANN202 - (name, tensor)
    """Parameters and AdamW state in a fixed order (DTensors as they are)."""
    for name, p in sorted(model.named_parameters()):
        yield name, p
        for key, value in sorted(opt.state.get(p, {}).items()):
            if isinstance(value, torch.Tensor):
                yield f"{name}.{key}", value


def digests(model: nn.Module, opt: torch.optim.Optimizer) -> dict[str, str]:
    """sha256 of this rank's own shards, and of the full tensors (collective)."""
    from torch.distributed.tensor import DTensor

    local, full = hashlib.sha256(), hashlib.sha256()
    for name, t in _tensors(model, opt):
        mine = t.to_local() if isinstance(t, DTensor) else t
        whole = t.full_tensor() if isinstance(t, DTensor) else t
        for h, value in ((local, mine), (full, whole)):
            value = value.detach().contiguous().reshape(-1)
            h.update(f"{name}:{value.dtype}:{tuple(value.shape)}".encode())
            h.update(value.view(torch.uint8).numpy().tobytes())
    return {"local_sha256": local.hexdigest(), "full_sha256": full.hexdigest()}


def inject_object_store_faults(fail: bool, kill_at: int | None) -> None:
    """Make this process's object-store writes fail, or SIGKILL it at the N-th one."""
    from shardpoint.storage.object_store import ObjectStoreDirectory

    calls = 0

    def patched(original):  # noqa: ANN001, ANN202
        def write(*args, **kwargs):  # noqa: ANN002, ANN003, ANN202
            nonlocal calls
            calls += 1
            if kill_at is not None and calls >= kill_at:
                os.kill(os.getpid(), signal.SIGKILL)
            if fail:
                raise OSError("injected upload failure")
            return original(*args, **kwargs)

        return write

    for method in OBJECT_STORE_WRITES:
        original = getattr(ObjectStoreDirectory, method, None)
        if original is not None:
            setattr(ObjectStoreDirectory, method, patched(original))


def slow_down_disk_saves(seconds: float) -> None:
    """Every synchronous save's writes take ``seconds`` longer (a slow disk); the memory
    tier's saves (staged, then written in the background) do not."""
    from shardpoint import write_phase

    real = write_phase.write_from_memory

    def slow(*args, **kwargs):  # noqa: ANN002, ANN003, ANN202
        time.sleep(seconds)
        return real(*args, **kwargs)

    write_phase.write_from_memory = slow


def write_json(path: Path, doc: dict) -> None:
    path.write_text(json.dumps(doc, sort_keys=True))


def redundancy(erasure: str | None) -> Replicas | ErasureCode:
    """``--erasure K+M``: the memory tier's parity groups; without it, one buddy replica."""
    if erasure is None:
        return Replicas(1)
    k, m = (int(n) for n in erasure.split("+"))
    return ErasureCode(data=k, parity=m)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__)
    p.add_argument("--local-dir", required=True)
    p.add_argument("--remote", default=None)
    p.add_argument("--run-dir", type=Path, required=True)
    p.add_argument("--steps", type=int, default=8)
    p.add_argument("--save-every", type=int, default=2)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--no-wait-uploads", action="store_true")
    p.add_argument("--fail-uploads", action="store_true")
    p.add_argument("--kill-during-upload", type=int, default=None, metavar="N")
    p.add_argument("--preemption-signal", default=None, metavar="NAME")
    p.add_argument("--grace", type=float, default=None, metavar="S")
    p.add_argument("--memory-every", type=int, default=None, metavar="N")
    p.add_argument("--slow-disk", type=float, default=0.0, metavar="S")
    p.add_argument("--step-sleep", type=float, default=0.0, metavar="S")
    p.add_argument("--timeline", action="store_true")
    p.add_argument("--erasure", default=None, metavar="K+M")
    args = p.parse_args(argv)
    started = time.time()

    torch.set_num_threads(1)  # the same kernels and reduction order in every run
    dist.init_process_group("gloo", timeout=timedelta(seconds=120))
    rank, world = dist.get_rank(), dist.get_world_size()
    args.run_dir.mkdir(parents=True, exist_ok=True)
    if args.fail_uploads or args.kill_during_upload is not None:
        inject_object_store_faults(args.fail_uploads, args.kill_during_upload)
    if args.slow_disk:
        slow_down_disk_saves(args.slow_disk)
    signals = (getattr(signal, f"SIG{args.preemption_signal}"),) if args.preemption_signal else ()

    model, opt = build(world, args.seed)
    state = shardpoint.TrainState(model=model, optimizer=opt)
    manager = shardpoint.CheckpointManager(
        args.local_dir,
        policy=SavePolicy(every_n_steps=args.save_every),
        retention=RetentionPolicy(keep_last=2),
        remote=RemoteTier(args.remote, RetentionPolicy(keep_last=5)) if args.remote else None,
        memory=MemoryTierOptions(args.memory_every, redundancy=redundancy(args.erasure))
        if args.memory_every
        else None,
        preemption_signals=signals,
        preemption_grace_seconds=args.grace,
    )
    start = manager.restore(state) or 0
    timeline = None
    if args.timeline and dist.get_rank() == 0:
        timeline = open(args.run_dir / "timeline.jsonl", "a", encoding="utf-8")  # noqa: SIM115
        doc = {"started": started, "restored": start, "ready": time.time()}
        timeline.write(json.dumps(doc) + "\n")
        timeline.flush()
    if start:
        restored = {"step": start, "world_size": world, **digests(model, opt)}
        write_json(args.run_dir / f"restored.rank{rank}.json", restored)
    if rank == 0:
        print(f"resumed from step {start}" if start else "fresh start", flush=True)

    with open(args.run_dir / f"losses.rank{rank}.jsonl", "a", encoding="utf-8") as losses:
        for step in range(start + 1, args.steps + 1):
            t0 = time.time()
            x, y = batch(args.seed, step, rank, world)
            loss = nn.functional.mse_loss(model(x), y)
            opt.zero_grad(set_to_none=True)
            loss.backward()
            opt.step()
            time.sleep(args.step_sleep)
            losses.write(json.dumps({"step": step, "loss": loss.item().hex()}) + "\n")
            losses.flush()
            state.step = step
            t1 = time.time()
            manager.maybe_save(step, state)
            if timeline is not None:
                timeline.write(json.dumps({"step": step, "t0": t0, "t1": t1, "t2": time.time()}))
                timeline.write("\n")
                timeline.flush()
            if manager.should_stop:
                manager.close()
                doc = {"step": step, "exit_code": manager.exit_code}
                write_json(args.run_dir / f"preempted.rank{rank}.json", doc)
                losses.close()
                sys.stdout.flush()
                os._exit(manager.exit_code)  # gloo's teardown skipped, as below

    flushed = None if args.no_wait_uploads else manager.wait_for_uploads(timeout=120)
    manager.close()
    final = {"step": args.steps, "world_size": world, "uploads_flushed": flushed}
    write_json(args.run_dir / f"final.rank{rank}.json", {**final, **digests(model, opt)})
    if rank == 0:
        print(f"finished at step {args.steps}", flush=True)
    dist.barrier()  # everyone finishes before the store's host (rank 0's agent) leaves
    sys.stdout.flush()
    sys.stderr.flush()
    # Skip gloo's C++ teardown, which intermittently aborts after all work is done
    # (tests/distributed.py does the same); every failure above has already raised.
    os._exit(0)


if __name__ == "__main__":
    sys.exit(main())
