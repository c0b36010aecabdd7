"""Tiers: async saves to an object store, per-rank uploads, a replaced node's reads.

Side by side in one run, against one moto S3 server on 127.0.0.1 (its own process):
  async      an ``AsyncSaver`` save to ``s3://``: how long the caller is blocked
             (``stall_seconds``, and the wall time of the call; the first call, which
             allocates the staging pool, reported apart) vs a plain ``clone()`` of the
             same state (fresh memory, the naive snapshot) vs a copy into preallocated
             memory (the memcpy floor) vs a synchronous ``shardpoint.save`` to the same
             server; and the async save's call-to-commit time;
  upload     a committed local checkpoint written by W = 1, 2, 4 gloo ranks, uploaded
             by a tiered ``CheckpointManager`` (every rank its own files; seconds and
             GB/s from the ``upload`` event), alternating with one process uploading
             the same files with ``copy_files`` (the one-uploader baseline);
  replaced   2 simulated nodes x 2 ranks (LOCAL_RANK, GROUP_RANK, a local directory
             per node), a ``Shard(0)`` DTensor state plus small replicated tensors;
             after the upload node 1's directory is wiped and the job restores: bytes
             each rank reads from the remote (``bytes_from_remote_by_rank`` of the
             ``restore`` event) vs the bytes of that rank's own files (target <= 1.05).

    python bench/bench_tiers.py [--mb 256] [--reps 3] [--replaced-mb 64]

The server is Python and bounds every absolute figure here: compare ratios. Prints a
table, writes bench/results/tiers.json.
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
import uuid
from pathlib import Path

import torch
import torch.distributed as dist

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))
from bench_object_store import start_server  # noqa: E402
from distributed import run_ranks  # noqa: E402

import shardpoint  # noqa: E402
from shardpoint.defaults import DEFAULT_THREADS  # noqa: E402
from shardpoint.names import step_dir, writer_rank  # noqa: E402
from shardpoint.storage import open_storage  # noqa: E402
from shardpoint.storage.transfer import copy_files  # noqa: E402

RESULTS = Path(__file__).parent / "results"
COLS = 1024  # 4 KiB rows of fp32
# Mixed tensor sizes, in rows of COLS fp32: 32 MiB, 4 MiB, 256 KiB, 16 KiB (every count
# divisible by 4, so the same list shards evenly over 1, 2 and 4 ranks).
ROW_CYCLE = (8192, 1024, 64, 4)


def median(xs: list[float]) -> float:
    return statistics.median(xs)


def row_sizes(mb: int) -> list[int]:
    """Rows of each tensor of a ~``mb`` MB state of mixed sizes."""
    rows: list[int] = []
    left = mb * 1024 * 1024 // (COLS * 4)  # rows still to place
    while left > 0:
        r = min(ROW_CYCLE[len(rows) % len(ROW_CYCLE)], -(-left // 4) * 4)
        rows.append(r)
        left -= r
    return rows


def mixed_state(mb: int, seed: int = 0) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return {f"t{i:03d}": torch.randn(r, COLS, generator=g) for i, r in enumerate(row_sizes(mb))}


def nbytes(state: dict[str, torch.Tensor]) -> int:
    return sum(t.numel() * t.element_size() for t in state.values())


def clear_prefix(bucket: str, prefix: str) -> None:
    """Delete every object under ``prefix`` (moto keeps them in its memory)."""
    import boto3

    s3 = boto3.client("s3")
    for page in s3.get_paginator("list_objects_v2").paginate(Bucket=bucket, Prefix=prefix):
        keys = [{"Key": o["Key"]} for o in page.get("Contents", [])]
        if keys:
            s3.delete_objects(Bucket=bucket, Delete={"Objects": keys})


# ---- 1. async save to an object store --------------------------------------------------------


def async_to_object_store(bucket: str, mb: int, reps: int) -> dict[str, object]:
    state = mixed_state(mb)
    size = nbytes(state)
    times: dict[str, list[float]] = {}

    def record(name: str, seconds: float) -> None:
        times.setdefault(name, []).append(seconds)

    saver = shardpoint.AsyncSaver()
    start = time.perf_counter()
    handle = saver.save(state, f"s3://{bucket}/async/first")
    first_wall = time.perf_counter() - start
    assert handle is not None
    first_stall = handle.stall_seconds
    first_commit = handle.wait().seconds
    clear_prefix(bucket, "async/first/")
    preallocated = {k: torch.empty_like(v).zero_() for k, v in state.items()}  # faulted in
    for rep in range(reps):
        start = time.perf_counter()
        snapshot = {k: v.clone() for k, v in state.items()}
        record("clone()", time.perf_counter() - start)
        del snapshot
        start = time.perf_counter()
        for k, v in state.items():
            preallocated[k].copy_(v)
        record("copy into preallocated memory", time.perf_counter() - start)

        url = f"s3://{bucket}/async/{rep}"
        start = time.perf_counter()
        handle = saver.save(state, url)
        record("async call returns (warm pool)", time.perf_counter() - start)
        assert handle is not None
        record("async stall (warm pool)", handle.stall_seconds)
        record("async call to commit", handle.wait().seconds)
        clear_prefix(bucket, f"async/{rep}/")

        url = f"s3://{bucket}/sync/{rep}"
        start = time.perf_counter()
        shardpoint.save(state, url)
        record("sync save", time.perf_counter() - start)
        clear_prefix(bucket, f"sync/{rep}/")
    saver.close()
    medians = {k: median(v) for k, v in times.items()}
    return {
        "bytes": size,
        "tensors": len(state),
        "seconds": {
            **medians,
            "async stall, first call (pool allocation)": first_stall,
            "async call returns, first call": first_wall,
            "async call to commit, first call": first_commit,
        },
        "all": times,
    }


# ---- 2. aggregate upload throughput ----------------------------------------------------------


def _sharded(rank: int, world: int, mb: int) -> dict[str, torch.Tensor]:
    """This rank's row shards of the mixed state (each rank creates only its own)."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import DTensor, Shard

    mesh = init_device_mesh("cpu", (world,))
    g = torch.Generator().manual_seed(rank)
    return {
        f"t{i:03d}": DTensor.from_local(
            torch.randn(r // world, COLS, generator=g), mesh, [Shard(0)]
        )
        for i, r in enumerate(row_sizes(mb))
    }


def _upload_ranks(
    rank: int, world: int, root: str, bucket: str, mb: int, reps: int, out: str
) -> None:
    """One node, one shared local directory; per rep: save, every rank uploads its own
    files (timed by the manager), then rank 0 alone uploads the same files (baseline)."""
    os.environ.update(LOCAL_RANK=str(rank), GROUP_RANK="0", LOCAL_WORLD_SIZE=str(world))
    state = _sharded(rank, world, mb)
    local = Path(root) / f"w{world}"
    manager = shardpoint.CheckpointManager(
        local,
        retention=shardpoint.RetentionPolicy(keep_last=1),
        remote=shardpoint.RemoteTier(
            f"s3://{bucket}/w{world}", retention=shardpoint.RetentionPolicy(keep_last=1)
        ),
    )
    baseline: list[float] = []
    for rep in range(reps):
        step = rep + 1
        manager.save(step, state, force=True)
        assert manager.wait_for_uploads()
        dist.barrier()
        if rank == 0:
            source = open_storage(local / step_dir(step))
            names = sorted(n for n in source.list() if writer_rank(n) is not None)
            target = open_storage(f"s3://{bucket}/baseline{world}/{rep}")
            start = time.perf_counter()
            copied = copy_files(source, target, names, DEFAULT_THREADS)
            baseline.append(time.perf_counter() - start)
            assert copied == sum(source.size(n) or 0 for n in names)
            clear_prefix(bucket, f"baseline{world}/{rep}/")
        dist.barrier()
    manager.close()
    if rank == 0:
        Path(out).write_text(json.dumps({"baseline_seconds": baseline}))


def upload_throughput(bucket: str, root: Path, mb: int, reps: int) -> dict[str, object]:
    results: dict[str, object] = {}
    for world in (1, 2, 4):
        out = root / f"upload{world}.json"
        run_ranks(world, _upload_ranks, str(root), bucket, mb, reps, str(out))
        baseline = json.loads(out.read_text())["baseline_seconds"]
        events = [
            json.loads(line)
            for line in (root / f"w{world}" / "events.jsonl").read_text().splitlines()
        ]
        uploads = [e for e in events if e["event"] == "upload"]
        failed = [e for e in events if e["event"] == "upload_failed"]
        assert len(uploads) == reps and not failed, (uploads, failed)
        per_rank = json.loads((root / f"w{world}" / step_dir(reps) / "index.json").read_text())[
            "files"
        ]
        upload_bytes = uploads[-1]["bytes"]
        results[str(world)] = {
            "bytes": upload_bytes,
            "files_per_rank": {n[4:9]: f["size"] for n, f in per_rank.items()},
            "ranks_reported": uploads[-1]["ranks"],
            "upload_seconds": [e["seconds"] for e in uploads],
            "baseline_seconds": baseline,
            "upload_gb_per_s": upload_bytes / median([e["seconds"] for e in uploads]) / 1e9,
            "baseline_gb_per_s": upload_bytes / median(baseline) / 1e9,
        }
        shutil.rmtree(root / f"w{world}", ignore_errors=True)
        clear_prefix(bucket, f"w{world}/")
    return results


# ---- 3. a replaced node -----------------------------------------------------------------------

REPLICATED = 8  # small replicated tensors (norms, scalars): 8 x 16 KiB


def _node_state(mb: int, fill: bool) -> dict[str, torch.Tensor]:
    """A Shard(0) DTensor state (``distribute_tensor`` of full tensors built the same on
    every rank) plus small replicated tensors."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Shard, distribute_tensor

    mesh = init_device_mesh("cpu", (dist.get_world_size(),))
    g = torch.Generator().manual_seed(1)
    state: dict[str, torch.Tensor] = {}
    for i, r in enumerate(row_sizes(mb)):
        full = torch.randn(r, COLS, generator=g) if fill else torch.zeros(r, COLS)
        state[f"layer{i:03d}"] = distribute_tensor(full, mesh, [Shard(0)])
    for i in range(REPLICATED):
        state[f"norm{i}"] = torch.randn(4096, generator=g) if fill else torch.zeros(4096)
    return state


def _node_ranks(rank: int, world: int, root: str, remote: str, mb: int, phase: str) -> None:
    os.environ.update(LOCAL_RANK=str(rank % 2), GROUP_RANK=str(rank // 2), LOCAL_WORLD_SIZE="2")
    local = Path(root) / f"node{rank // 2}"
    manager = shardpoint.CheckpointManager(local, remote=shardpoint.RemoteTier(remote))
    if phase == "save":
        assert manager.per_node, "the two node directories were not told apart"
        manager.save(1, _node_state(mb, fill=True), force=True)
        manager.close()  # waits for the upload
        return
    state = _node_state(mb, fill=False)
    step = manager.restore(state)
    manager.close()
    expected = _node_state(mb, fill=True)
    assert step == 1, step
    for k, v in expected.items():
        got = state[k].to_local() if hasattr(state[k], "to_local") else state[k]
        want = v.to_local() if hasattr(v, "to_local") else v
        assert torch.equal(got, want), f"rank {rank}: {k} differs after the restore"


def replaced_node(bucket: str, root: Path, mb: int) -> dict[str, object]:
    remote = f"s3://{bucket}/nodes"
    run_ranks(4, _node_ranks, str(root), remote, mb, "save")
    own: dict[int, int] = {}
    for rank in range(4):
        step = root / f"node{rank // 2}" / step_dir(1)
        own[rank] = sum(f.stat().st_size for f in step.iterdir() if writer_rank(f.name) == rank)
    shutil.rmtree(root / "node1")  # node 1 replaced: an empty local disk
    run_ranks(4, _node_ranks, str(root), remote, mb, "restore")
    events = [
        json.loads(line) for line in (root / "node0" / "events.jsonl").read_text().splitlines()
    ]
    restore = [e for e in events if e["event"] == "restore"][-1]
    upload = [e for e in events if e["event"] == "upload"][-1]
    from_remote = restore["bytes_from_remote_by_rank"]
    return {
        "upload": {k: upload[k] for k in ("bytes", "ranks", "seconds")},
        "restore_seconds": restore["seconds"],
        "restore_path": restore["path"],
        "own_file_bytes": [own[r] for r in range(4)],
        "bytes_from_remote": from_remote,
        "ratio": [f / own[r] if own[r] else None for r, f in enumerate(from_remote)],
        "fallbacks": [e for e in events if e["event"] == "fallback"],
    }


# ---- main ----------------------------------------------------------------------------------------


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--mb", type=int, default=256, help="state size in MB (sections 1, 2)")
    parser.add_argument("--reps", type=int, default=3)
    parser.add_argument("--replaced-mb", type=int, default=64, help="sharded state of section 3")
    parser.add_argument("--dir", default=None, help="local checkpoints (default: a temp dir)")
    args = parser.parse_args()

    server, endpoint = start_server()
    os.environ.update(
        AWS_ENDPOINT_URL=endpoint,
        AWS_ACCESS_KEY_ID="bench",
        AWS_SECRET_ACCESS_KEY="bench",
        AWS_REGION="us-east-1",
    )
    root = Path(tempfile.mkdtemp(prefix="shardpoint-tiers-", dir=args.dir))
    wall = time.perf_counter()
    try:
        import boto3

        bucket = f"bench{uuid.uuid4().hex[:8]}"
        boto3.client("s3").create_bucket(Bucket=bucket)
        t0 = time.perf_counter()
        async_r = async_to_object_store(bucket, args.mb, args.reps)
        t1 = time.perf_counter()
        upload_r = upload_throughput(bucket, root, args.mb, args.reps)
        t2 = time.perf_counter()
        replaced_r = replaced_node(bucket, root, args.replaced_mb)
        t3 = time.perf_counter()
    finally:
        server.terminate()
        server.wait()
        shutil.rmtree(root, ignore_errors=True)
    section_seconds = {"async": t1 - t0, "upload": t2 - t1, "replaced": t3 - t2}

    size = async_r["bytes"]
    s = async_r["seconds"]
    clone = s["clone()"]
    print(
        f"\n1. async save to s3:// — {size / 1e6:.0f} MB in {async_r['tensors']} fp32 tensors "
        f"of mixed sizes, moto on 127.0.0.1, median of {args.reps}"
    )
    print(f"{'':46}{'seconds':>9}{'x clone()':>11}{'MB/s':>8}")
    rows = [
        ("clone() of the state (fresh memory)", "clone()", False),
        ("copy into preallocated memory (memcpy floor)", "copy into preallocated memory", False),
        ("async stall_seconds, warm pool", "async stall (warm pool)", False),
        ("async call returns after, warm pool", "async call returns (warm pool)", False),
        (
            "async stall_seconds, first call (pool alloc.)",
            "async stall, first call (pool allocation)",
            False,
        ),
        ("async call returns after, first call", "async call returns, first call", False),
        ("async call to commit, warm", "async call to commit", True),
        ("async call to commit, first call", "async call to commit, first call", True),
        ("sync shardpoint.save", "sync save", True),
    ]
    for label, key, rate in rows:
        mbps = f"{size / s[key] / 1e6:>8.0f}" if rate else ""
        print(f"{label:46}{s[key]:>9.3f}{s[key] / clone:>11.2f}{mbps}")
    print(
        f"stall / clone(): {s['async stall (warm pool)'] / clone:.2f}x (stall_seconds), "
        f"{s['async call returns (warm pool)'] / clone:.2f}x (the call's wall time); "
        f"async call-to-commit / sync save: {s['async call to commit'] / s['sync save']:.2f}x"
    )

    print(f"\n2. upload of a committed local checkpoint (~{args.mb} MB), median of {args.reps}")
    print(
        f"{'ranks':>5}{'bytes/rank (MB)':>18}{'per-rank upload GB/s':>22}"
        f"{'one process GB/s':>18}{'ratio':>7}{'x 1 rank':>10}"
    )
    one = upload_r["1"]["upload_gb_per_s"]
    for world, r in upload_r.items():
        per = ", ".join(f"{v / 1e6:.0f}" for v in r["files_per_rank"].values())
        print(
            f"{world:>5}{per:>18}{r['upload_gb_per_s']:>22.3f}{r['baseline_gb_per_s']:>18.3f}"
            f"{r['upload_gb_per_s'] / r['baseline_gb_per_s']:>7.2f}"
            f"{r['upload_gb_per_s'] / one:>10.2f}"
        )

    rr = replaced_r
    print(
        f"\n3. node 1 replaced (2 nodes x 2 ranks, ~{args.replaced_mb} MB Shard(0) + "
        f"{REPLICATED} replicated tensors), restore {rr['restore_seconds']:.3f} s"
    )
    print(f"{'rank':>5}{'node':>6}{'own files (B)':>16}{'from remote (B)':>18}{'ratio':>8}")
    for r in range(4):
        ratio = rr["ratio"][r]
        print(
            f"{r:>5}{r // 2:>6}{rr['own_file_bytes'][r]:>16,}{rr['bytes_from_remote'][r]:>18,}"
            f"{(f'{ratio:.4f}' if ratio is not None else '-'):>8}"
        )
    print(
        f"\nsections took {', '.join(f'{k} {v:.0f} s' for k, v in section_seconds.items())}; "
        f"total {time.perf_counter() - wall:.0f} s"
    )

    RESULTS.mkdir(exist_ok=True)
    (RESULTS / "tiers.json").write_text(
        json.dumps(
            {
                "command": "python bench/bench_tiers.py " + " ".join(sys.argv[1:]),
                "async": async_r,
                "upload": upload_r,
                "replaced_node": replaced_r,
                "section_seconds": section_seconds,
            },
            indent=2,
        )
    )


if __name__ == "__main__":
    main()
