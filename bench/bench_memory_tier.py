"""Recovery time of the memory tier vs local disk vs an S3 server, and its save stall.

2 ranks as 2 simulated nodes (gloo on one machine, a shared-memory directory each),
a row-sharded state of --mb MB in all. Measured on each rank, slowest rank reported:
  save stall: MemoryTier.save (stages; own copy in tmpfs + copy to the buddy in the
  background) vs an async disk save (AsyncSaver) vs shardpoint.save
  to the local disk;
  recovery: from own memory; from the buddy (node 1's memory wiped); from local disk
  (page cache dropped); from the S3 server (moto, its own process).

    python bench/bench_memory_tier.py [--mb 512]

Prints a table and writes bench/results/memory_tier.json.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import sys
import tempfile
import time
import uuid
from functools import partial
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).parent))
sys.path.insert(0, str(Path(__file__).parents[1] / "tests"))
from bench_object_store import start_server  # noqa: E402
from bench_save_load import drop_cache  # noqa: E402
from distributed import run_ranks  # noqa: E402

RESULTS = Path(__file__).parent / "results"


def _state(rank: int, world: int, mb: int, fill: bool) -> dict:
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Shard, distribute_tensor

    mesh = init_device_mesh("cpu", (world,))
    rows = mb * 1024 * 1024 // 4 // 1024 // 8
    out = {}
    for i in range(8):
        full = torch.randn(rows, 1024) if fill else torch.zeros(rows, 1024)
        out[f"layer{i}"] = distribute_tensor(full, mesh, [Shard(0)])
    return out


def timed_on_every_rank(times: dict[str, float], name: str, fn, *args) -> None:  # noqa: ANN001
    """``times[name]``: the seconds ``fn(*args)`` takes, every rank starting together."""
    from shardpoint import dist

    dist.all_gather_json(None)
    start = time.perf_counter()
    fn(*args)
    times[name] = time.perf_counter() - start


def _rank(rank: int, world: int, root: str, shm: str, mb: int, endpoint: str, bucket: str) -> None:
    import shardpoint
    from shardpoint import dist
    from shardpoint.training.memory_tier import MemoryTier

    os.environ["SHARDPOINT_SHM_DIR"] = f"{shm}/node{rank}"
    os.environ["LOCAL_WORLD_SIZE"] = "1"
    os.environ.update(
        AWS_ENDPOINT_URL=endpoint,
        AWS_ACCESS_KEY_ID="bench",
        AWS_SECRET_ACCESS_KEY="bench",
        AWS_REGION="us-east-1",
    )
    state = _state(rank, world, mb, fill=True)
    tier = MemoryTier("bench")
    times: dict[str, float] = {}
    timed = partial(timed_on_every_rank, times)

    # The transport floor: the same bytes once each way between the two "nodes".
    payload = torch.cat([t.to_local().reshape(-1) for t in state.values()]).view(torch.uint8)
    inbox = torch.empty_like(payload)

    def exchange() -> None:
        peer = 1 - rank
        reqs = [dist.isend_bytes(payload, peer, 0), dist.irecv_bytes(inbox, peer, 0)]
        for r in reqs:
            r.wait()

    timed("transport floor: gloo send+recv of the bytes", exchange)
    timed("save stall: memory tier, first save (pool faulted in)", tier.save, 0, state)
    timed("memory tier: own + buddy copy complete after that", tier.wait)
    timed("save stall: memory tier (staging only)", tier.save, 1, state)
    timed("memory tier: own + buddy copy complete after the stall", tier.wait)
    saver = shardpoint.AsyncSaver()
    saver.save(state, f"{root}/async/step-0").wait()  # faults its pool in
    timed(
        "save stall: async disk (AsyncSaver, warm pool)", saver.save, state, f"{root}/async/step-1"
    )
    saver.wait()
    timed("save stall: local disk", shardpoint.save, state, f"{root}/disk/step-1")
    timed("save: S3 server", shardpoint.save, state, f"s3://{bucket}/step-1")

    target = _state(rank, world, mb, fill=False)  # templates are built outside the timing

    def from_memory() -> None:
        tier.restore(target, tier.newest_step())

    timed("recovery: own memory", from_memory)
    if rank == 1:
        shutil.rmtree(f"{shm}/node1/bench/own")  # node 1 replaced
    timed("recovery: buddy's memory (node replaced)", from_memory)
    if rank == 0:
        drop_cache(Path(f"{root}/disk/step-1"))
    timed("recovery: local disk (cold)", shardpoint.load, target, f"{root}/disk/step-1")
    timed("recovery: S3 server", shardpoint.load, target, f"s3://{bucket}/step-1")
    gathered = dist.all_gather_json(times)
    if rank == 0:
        slowest = {k: max(g[k] for g in gathered) for k in times}
        Path(root, "times.json").write_text(json.dumps(slowest))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--mb", type=int, default=512)
    parser.add_argument("--dir", default=None)
    args = parser.parse_args()
    server, endpoint = start_server()
    try:
        import boto3

        os.environ.update(
            AWS_ENDPOINT_URL=endpoint,
            AWS_ACCESS_KEY_ID="bench",
            AWS_SECRET_ACCESS_KEY="bench",
            AWS_REGION="us-east-1",
        )
        bucket = f"mem{uuid.uuid4().hex[:8]}"
        boto3.client("s3").create_bucket(Bucket=bucket)
        shm = tempfile.mkdtemp(dir="/dev/shm", prefix="shardpoint-bench-")  # real tmpfs
        try:
            with tempfile.TemporaryDirectory(dir=args.dir) as root:
                run_ranks(2, _rank, root, shm, args.mb, endpoint, bucket)
                times = json.loads(Path(root, "times.json").read_text())
        finally:
            shutil.rmtree(shm, ignore_errors=True)
    finally:
        server.terminate()
        server.wait()
    size = args.mb * 1024 * 1024
    print(f"\n{size / 1e6:.0f} MB over 2 ranks (2 simulated nodes), slowest rank")
    print(f"{'':48}{'seconds':>9}{'GB/s':>8}")
    for name, s in times.items():
        print(f"{name:48}{s:>9.3f}{size / s / 1e9:>8.2f}")
    RESULTS.mkdir(exist_ok=True)
    (RESULTS / "memory_tier.json").write_text(
        json.dumps({"bytes": size, "seconds": times}, indent=2)
    )


if __name__ == "__main__":
    main()
