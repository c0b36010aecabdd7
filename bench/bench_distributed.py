"""Aggregate save/load throughput at 1, 2 and 4 ranks (CPU/gloo), next to DCP.

The state is a row-sharded (FSDP-style, ``Shard(0)``) set of 48 fp32 tensors of
32 MB, 1.6 GB in all, split over the ranks; each rank creates only its own shard.
Raw O_DIRECT disk bandwidth for the same byte count is measured in the same run.
Cold loads drop the page cache of the checkpoint first. Also reports bytes written per
rank and the read amplification (bytes read / bytes needed) of a resharding load
(saved on 4 ranks, loaded on 2).

    python bench/bench_distributed.py [--reps 3] [--tensors 48]
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))
from bench_save_load import RawDisk, drop_cache  # noqa: E402
from distributed import run_ranks  # noqa: E402

import shardpoint  # noqa: E402
import shardpoint.storage.direct_io as sp_local  # noqa: E402
from shardpoint import dist as sp_dist  # noqa: E402

ROWS, COLS = 2048, 4096  # 32 MB of fp32 per tensor


def _state(rank: int, world: int, n: int, fill: bool) -> dict[str, torch.Tensor]:
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import DTensor, Shard

    mesh = init_device_mesh("cpu", (world,))
    rows = ROWS // world
    g = torch.Generator().manual_seed(rank)
    make = (
        (lambda: torch.randn(rows, COLS, generator=g))
        if fill
        else (lambda: torch.zeros(rows, COLS))
    )
    return {f"layer{i:02d}": DTensor.from_local(make(), mesh, [Shard(0)]) for i in range(n)}


def _timed(fn, *args) -> float:  # noqa: ANN001
    dist.barrier()
    start = time.perf_counter()
    fn(*args)
    dist.barrier()
    return time.perf_counter() - start


def _count_reads() -> dict[str, int]:
    counter = {"n": 0}
    real = os.preadv

    def counting(fd, buffers, offset, *flags):  # noqa: ANN001, ANN202
        n = real(fd, buffers, offset, *flags)
        if not flags:
            counter["n"] += n
        return n

    sp_local.os.preadv = counting  # type: ignore[attr-defined]
    return counter


def _run(rank: int, world: int, root: str, n: int, out: str) -> None:
    state = _state(rank, world, n, fill=True)
    dest = _state(rank, world, n, fill=False)
    times: dict[str, float] = {}
    for label, save, load in (
        ("shardpoint", lambda p: shardpoint.save(state, p), lambda p: shardpoint.load(dest, p)),
        (
            "DCP",
            lambda p: dcp.save(state, checkpoint_id=p),
            lambda p: dcp.load(dest, checkpoint_id=p),
        ),
    ):
        path = Path(root) / f"{label}-{world}"
        times[f"{label} save"] = _timed(save, path)
        if rank == 0:
            drop_cache(path)
        times[f"{label} cold load"] = _timed(load, path)
        assert all(torch.equal(dest[k].to_local(), state[k].to_local()) for k in state)
        if rank == 0 and label == "DCP":
            shutil.rmtree(path)
    if rank == 0:
        index = json.loads((Path(root) / f"shardpoint-{world}" / "index.json").read_text())
        per_rank: dict[str, int] = {}
        for name, info in index["files"].items():
            per_rank[name[4:9]] = per_rank.get(name[4:9], 0) + info["size"]
        Path(out).write_text(json.dumps({"times": times, "bytes_per_rank": per_rank}))


def _reshard_load(rank: int, world: int, saved: str, n: int, out: str) -> None:
    dest = _state(rank, world, n, fill=False)
    if rank == 0:
        drop_cache(Path(saved))
    dist.barrier()
    counter = _count_reads()
    shardpoint.load(dest, saved)
    needed = sum(t.to_local().numel() * 4 for t in dest.values())
    counts = sp_dist.all_gather_json([counter["n"], needed])
    if rank == 0:
        Path(out).write_text(
            json.dumps({"read": sum(c[0] for c in counts), "needed": sum(c[1] for c in counts)})
        )


def main() -> None:
    p = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    p.add_argument("--reps", type=int, default=3)
    p.add_argument("--tensors", type=int, default=48)
    p.add_argument("--dir", type=Path, default=None)
    p.add_argument("--out", type=Path, default=Path("bench/results/distributed.json"))
    args = p.parse_args()
    total = args.tensors * ROWS * COLS * 4
    results: dict[str, object] = {"bytes": total, "worlds": {}}
    root = Path(tempfile.mkdtemp(prefix="shardpoint-dist-", dir=args.dir))
    try:
        disk = RawDisk()
        raw_w, raw_r = [], []
        for _ in range(args.reps):
            f = root / "raw.bin"
            start = time.perf_counter()
            disk.write(f, total)
            raw_w.append(time.perf_counter() - start)
            drop_cache(f)
            start = time.perf_counter()
            disk.read(f, total)
            raw_r.append(time.perf_counter() - start)
            f.unlink()
        results["raw O_DIRECT"] = {
            "write": statistics.median(raw_w),
            "read": statistics.median(raw_r),
        }
        for world in (1, 2, 4):
            runs = []
            for _ in range(args.reps):
                out = root / "out.json"
                shutil.rmtree(root / f"shardpoint-{world}", ignore_errors=True)
                run_ranks(world, _run, str(root), args.tensors, str(out))
                runs.append(json.loads(out.read_text()))
            times = {k: statistics.median(r["times"][k] for r in runs) for k in runs[0]["times"]}
            results["worlds"][world] = {
                "seconds": times,
                "bytes_per_rank": runs[-1]["bytes_per_rank"],
            }
        for world in (1, 2):
            shutil.rmtree(root / f"shardpoint-{world}", ignore_errors=True)
        out = root / "reshard.json"
        run_ranks(2, _reshard_load, str(root / "shardpoint-4"), args.tensors, str(out))
        reshard = json.loads(out.read_text())
        results["reshard_4_to_2"] = {
            **reshard,
            "amplification": reshard["read"] / reshard["needed"],
        }
    finally:
        shutil.rmtree(root, ignore_errors=True)

    raw = results["raw O_DIRECT"]
    print(
        f"{total / 1e9:.2f} GB; raw O_DIRECT write {total / raw['write'] / 1e9:.2f} GB/s, "
        f"read {total / raw['read'] / 1e9:.2f} GB/s"
    )
    print(
        f"{'ranks':>5}  {'':12}{'save GB/s':>16}{'cold load GB/s':>18}   "
        "bytes written per rank (MB)"
    )
    for world, r in results["worlds"].items():
        for lib in ("shardpoint", "DCP"):
            s, ld = r["seconds"][f"{lib} save"], r["seconds"][f"{lib} cold load"]
            per = (
                ", ".join(f"{v / 1e6:.0f}" for v in r["bytes_per_rank"].values())
                if lib == "shardpoint"
                else ""
            )
            print(
                f"{world:>5}  {lib:12}{total / s / 1e9:8.2f} ({raw['write'] / s:4.2f}x)"
                f"{total / ld / 1e9:10.2f} ({raw['read'] / ld:4.2f}x)   {per}"
            )
    print(
        "resharding load 4 -> 2 ranks: read amplification "
        f"{results['reshard_4_to_2']['amplification']:.3f}"
    )
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(results, indent=1))


if __name__ == "__main__":
    main()
