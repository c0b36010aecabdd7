"""The coordination cost of a steady-state distributed save: the same small state
(replicated tensors of 1 KB, so writing is cheap and the collectives show) saved 25
times on N gloo ranks of this machine; the median wall time of saves 6-25 on rank 0,
and how many of shardpoint's collectives each steady save ran.

    python bench/bench_steady_save.py --ranks 2 4 --tensors 20
    python bench/bench_steady_save.py --ranks 2 4 --background   # AsyncSaver: the stall too

To compare with an earlier version, run the same command with that version first on
the path (``git worktree add /tmp/old <commit>``, then ``PYTHONPATH=/tmp/old/src``).
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import tempfile
import time

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

COUNTED = ("gather_json", "broadcast_json", "max_of", "gather_distinct_json", "scatter_plan")


def _rank(
    rank: int, world: int, port: int, root: str, tensors: int, out: str, background: bool
) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=world)
    import shardpoint
    from shardpoint import dist as sp_dist

    calls: list[str] = []
    for name in COUNTED:  # shardpoint's coordination calls, whichever exist
        real = getattr(sp_dist, name, None)
        if real is not None:

            def counted(*args, _real=real, _name=name, **kwargs):
                calls.append(_name)
                return _real(*args, **kwargs)

            setattr(sp_dist, name, counted)
    state = {f"w{i}": torch.randn(256) for i in range(tensors)}
    saver = shardpoint.AsyncSaver() if background else None
    times, stalls, per_save = [], [], []
    for step in range(25):
        dist.barrier()
        before = len(calls)
        start = time.perf_counter()
        if saver is None:
            shardpoint.save(state, f"{root}/step{step}")
        else:  # until committed, and how long the caller was blocked
            stalls.append(saver.save(state, f"{root}/step{step}").stall_seconds)
            saver.wait()
        times.append(time.perf_counter() - start)
        per_save.append(calls[before:])
    if rank == 0:

        def median_ms(values: list[float]) -> float:
            steady = sorted(values[5:])
            return round(1000 * steady[len(steady) // 2], 2)

        result = {"ranks": world, "median_ms": median_ms(times), "collectives": per_save[-1]}
        if stalls:
            result["median_stall_ms"] = median_ms(stalls)
        with open(out, "w") as f:
            json.dump(result, f)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--ranks", type=int, nargs="+", default=[2, 4])
    parser.add_argument("--tensors", type=int, default=20)
    parser.add_argument("--background", action="store_true", help="save with AsyncSaver")
    args = parser.parse_args()
    for world in args.ranks:
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
        with tempfile.TemporaryDirectory() as root:
            out = os.path.join(root, "result.json")
            mp.start_processes(
                _rank,
                args=(world, port, root, args.tensors, out, args.background),
                nprocs=world,
                start_method="spawn",
            )
            with open(out) as f:
                print(json.dumps(json.load(f)))


if __name__ == "__main__":
    main()
