"""Loads where several ranks need the same stored bytes: storage bytes read and time,
with and without ``share_reads``.

- replicas: 4 ranks on a 2 x 2 mesh, HSDP-style (``Replicate`` over one mesh dimension,
  ``Shard(0)`` over the other): every shard is needed by 2 ranks. Plus DDP-style plain
  tensors that every rank needs.
- columns 4 -> 3: tensor-parallel column shards (``Shard(1)``) saved on 4 ranks, loaded
  on 3: the middle chunks are needed in part by two ranks each.

Cold loads (page cache dropped); the bytes each rank read from storage are counted at
the storage layer.

    python bench/bench_replica_load.py [--reps 3] [--tensors 12]
"""

from __future__ import annotations

import argparse
import json
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))
from bench_save_load import drop_cache  # noqa: E402
from distributed import run_ranks  # noqa: E402

import shardpoint  # noqa: E402
from shardpoint import dist as sp_dist  # noqa: E402
from shardpoint.storage.local import LocalDirectory  # noqa: E402

ROWS, COLS = 1024, 4096  # 16 MB of fp32 per sharded tensor
DDP_TENSORS = 4  # of 4 MB each


def _state(case: str, n: int, fill: bool, world: int) -> dict[str, torch.Tensor]:
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Replicate, Shard, distribute_tensor

    make = torch.randn if fill else torch.zeros
    torch.manual_seed(0)
    if case == "columns":
        mesh = init_device_mesh("cpu", (world,))
        return {f"tp.{i}": distribute_tensor(make(ROWS, COLS), mesh, [Shard(1)]) for i in range(n)}
    mesh = init_device_mesh("cpu", (2, 2))
    state = {
        f"hsdp.{i}": distribute_tensor(make(ROWS, COLS), mesh, [Replicate(), Shard(0)])
        for i in range(n)
    }
    state |= {f"ddp.{i}": make(ROWS // 4, COLS) for i in range(DDP_TENSORS)}
    return state


def _save(rank: int, world: int, path: str, case: str, n: int) -> None:
    shardpoint.save(_state(case, n, True, world), path)


def _load(rank: int, world: int, path: str, case: str, n: int, share: bool, out: str) -> None:
    read = [0]
    real = LocalDirectory.read_ranges

    def counting(self, requests, **kwargs):  # noqa: ANN001, ANN003, ANN202
        read[0] += sum(s.end - s.offset for ss in requests.values() for s in ss)
        return real(self, requests, **kwargs)

    LocalDirectory.read_ranges = counting  # type: ignore[method-assign]
    dest = _state(case, n, False, world)
    if rank == 0:
        drop_cache(Path(path))
    sp_dist.all_gather_json(None)  # start together
    start = time.perf_counter()
    shardpoint.load(dest, path, share_reads=share)
    seconds = time.perf_counter() - start
    results = sp_dist.all_gather_json([read[0], seconds])
    if rank == 0:
        Path(out).write_text(json.dumps(results))


CASES = {  # name -> (ranks that save, ranks that load)
    "replicas": (4, 4),
    "columns": (4, 3),
}


def main() -> None:
    p = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    p.add_argument("--reps", type=int, default=3)
    p.add_argument("--tensors", type=int, default=12)
    p.add_argument("--dir", type=Path, default=None)
    p.add_argument("--out", type=Path, default=Path("bench/results/replica_load.json"))
    args = p.parse_args()
    root = Path(tempfile.mkdtemp(prefix="shardpoint-replicas-", dir=args.dir))
    tensor = ROWS * COLS * 4
    results: dict[str, object] = {}
    try:
        for case, (savers, loaders) in CASES.items():
            stored = args.tensors * tensor + (
                DDP_TENSORS * tensor // 4 if case == "replicas" else 0
            )
            result: dict[str, object] = {"stored_bytes": stored}
            ckpt = root / case
            run_ranks(savers, _save, str(ckpt), case, args.tensors)
            runs: dict[bool, list[list[list[float]]]] = {False: [], True: []}
            for _ in range(args.reps):
                for share in (False, True):  # interleaved: disk drifts hit both alike
                    out = root / "out.json"
                    run_ranks(loaders, _load, str(ckpt), case, args.tensors, share, str(out))
                    runs[share].append(json.loads(out.read_text()))
            what = "2 replicas x 2 shards" if case == "replicas" else "Shard(1) saved on 4"
            print(f"\n{case}: {loaders} ranks load, {what}; stored {stored / 1e6:.0f} MB")
            print(f"{'':22}{'read from storage':>20}{'per rank (max)':>16}{'load (s)':>10}")
            for share, label in ((False, "each rank reads"), (True, "share_reads=True")):
                read = statistics.median(sum(r[0] for r in run) for run in runs[share])
                most = statistics.median(max(r[0] for r in run) for run in runs[share])
                seconds = statistics.median(max(r[1] for r in run) for run in runs[share])
                result[label] = {"read_bytes": read, "max_rank_bytes": most, "seconds": seconds}
                print(
                    f"{label:22}{read / 1e6:>14.0f} MB {read / stored:4.2f}x"
                    f"{most / 1e6:>13.0f} MB{seconds:>10.2f}"
                )
            results[case] = result
    finally:
        shutil.rmtree(root, ignore_errors=True)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(results, indent=1))


if __name__ == "__main__":
    main()
