"""Object-store throughput on a local S3-API server (moto, in its own process).

Side by side in one run, on the same bytes:
  the client libraries: obstore put/get vs s3fs pipe/cat (how shardpoint chose);
  shardpoint load vs one whole-object GET and vs parallel 16 MiB ranged GETs;
  shardpoint save/load to s3:// vs torch.distributed.checkpoint with its fsspec
  writer/reader (s3fs underneath), thread_count 1 and 4;
  read amplification of a partial load (rows of one tensor), counted by a proxy.

    pip install -e '.[bench-s3]'   # s3fs, for the comparison
    python bench/bench_object_store.py [--mb 256] [--reps 3]

The server is Python (moto): it, not the clients, bounds every figure here, so the
ratios say more than the absolute GB/s. Prints a table, writes bench/results/object_store.json.
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import statistics
import subprocess
import sys
import time
import uuid
from pathlib import Path

import torch

import shardpoint

sys.path.insert(0, str(Path(__file__).parent))
sys.path.insert(0, str(Path(__file__).parents[1] / "tests"))
from s3_server import FaultProxy  # noqa: E402

RESULTS = Path(__file__).parent / "results"


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def start_server() -> tuple[subprocess.Popen, str]:
    port = free_port()
    proc = subprocess.Popen(
        [sys.executable, "-m", "moto.server", "-H", "127.0.0.1", "-p", str(port)],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    for _ in range(100):
        try:
            socket.create_connection(("127.0.0.1", port), timeout=0.2).close()
            break
        except OSError:
            time.sleep(0.1)
    return proc, f"http://127.0.0.1:{port}"


def timed(fn, *args, **kwargs) -> float:  # noqa: ANN001, ANN002, ANN003
    start = time.perf_counter()
    fn(*args, **kwargs)
    return time.perf_counter() - start


def get_all(obstore, store, key: str) -> bytes:  # noqa: ANN001
    return obstore.get(store, key).bytes()


def get_ranges_in_parallel(obstore, store, key: str, size: int, threads: int = 8) -> None:  # noqa: ANN001
    """The plain parallel ranged GET a loader could do: 16 MiB ranges on 8 threads."""
    from concurrent.futures import ThreadPoolExecutor

    spans = [(lo, min(lo + (16 << 20), size)) for lo in range(0, size, 16 << 20)]
    with ThreadPoolExecutor(threads) as pool:
        list(pool.map(lambda s: obstore.get_range(store, key, start=s[0], end=s[1]), spans))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--mb", type=int, default=256, help="state size in MB")
    parser.add_argument("--reps", type=int, default=3)
    args = parser.parse_args()

    server, endpoint = start_server()
    os.environ.update(
        AWS_ENDPOINT_URL=endpoint,
        AWS_ACCESS_KEY_ID="bench",
        AWS_SECRET_ACCESS_KEY="bench",
        AWS_REGION="us-east-1",
    )
    try:
        import boto3
        import obstore
        import s3fs
        import torch.distributed.checkpoint as dcp
        from obstore.store import from_url
        from torch.distributed.checkpoint._fsspec_filesystem import FsspecReader, FsspecWriter

        bucket = f"bench{uuid.uuid4().hex[:8]}"
        boto3.client("s3").create_bucket(Bucket=bucket)
        n = args.mb * 1024 * 1024 // 4 // 16
        g = torch.Generator().manual_seed(0)
        state = {f"layer{i:02d}": torch.randn(n // 1024, 1024, generator=g) for i in range(16)}
        size = sum(t.numel() * 4 for t in state.values())
        blob = b"".join(t.numpy().tobytes() for t in state.values())
        store = from_url(f"s3://{bucket}", client_options={"allow_http": True})
        fs = s3fs.S3FileSystem(client_kwargs={"endpoint_url": endpoint})
        times: dict[str, list[float]] = {}

        def record(name: str, seconds: float) -> None:
            times.setdefault(name, []).append(seconds)

        for rep in range(args.reps):
            key = f"raw/{rep}"
            record(
                "obstore put (16 MiB parts, 4 parallel)",
                timed(obstore.put, store, key, blob, chunk_size=16 << 20, max_concurrency=4),
            )
            record("obstore get", timed(get_all, obstore, store, key))
            record(
                "obstore ranged GETs (16 MiB, 8 parallel)",
                timed(get_ranges_in_parallel, obstore, store, key, size),
            )
            record("s3fs pipe", timed(fs.pipe, f"{bucket}/s3fs/{rep}", blob))
            record("s3fs cat", timed(fs.cat, f"{bucket}/s3fs/{rep}"))

            url = f"s3://{bucket}/sp/{rep}"
            record("shardpoint save", timed(shardpoint.save, state, url))
            dest = {k: torch.empty_like(v) for k, v in state.items()}
            record("shardpoint load", timed(shardpoint.load, dest, url))
            for threads in (1, 4):
                path = f"s3://{bucket}/dcp{threads}/{rep}"
                writer = FsspecWriter(
                    path, thread_count=threads, client_kwargs={"endpoint_url": endpoint}
                )
                record(
                    f"DCP save, fsspec, {threads} thread(s)",
                    timed(dcp.save, dict(state), storage_writer=writer, no_dist=True),
                )
                reader = FsspecReader(path, client_kwargs={"endpoint_url": endpoint})
                dest = {k: torch.empty_like(v) for k, v in state.items()}
                record(
                    f"DCP load, fsspec, {threads} thread(s)",
                    timed(dcp.load, dest, storage_reader=reader, no_dist=True),
                )

        # Read amplification of a partial load through a byte-counting proxy.
        proxy = FaultProxy(endpoint)
        os.environ["AWS_ENDPOINT_URL"] = proxy.url
        rows = state["layer00"].shape[0] // 10
        with shardpoint.open(f"s3://{bucket}/sp/0") as r:
            before = proxy.bytes_served
            r.get_slice("layer00")[:rows]
            verified = proxy.bytes_served - before
            before = proxy.bytes_served
            r.get_slice("layer00", verify=False)[:rows]
            exact = proxy.bytes_served - before
        proxy.close()
        needed = rows * 1024 * 4
    finally:
        server.terminate()
        server.wait()

    medians = {k: statistics.median(v) for k, v in times.items()}
    print(f"\n{size / 1e6:.0f} MB, moto server on 127.0.0.1, median of {args.reps}")
    print(f"{'':44}{'seconds':>9}{'MB/s':>9}")
    for name, s in medians.items():
        print(f"{name:44}{s:>9.3f}{size / s / 1e6:>9.0f}")
    print(
        f"\npartial load of {rows} rows ({needed / 1e6:.2f} MB): read {verified / needed:.3f}x "
        f"with checksums, {exact / needed:.3f}x with verify=False"
    )
    RESULTS.mkdir(exist_ok=True)
    (RESULTS / "object_store.json").write_text(
        json.dumps(
            {
                "bytes": size,
                "seconds": medians,
                "partial_read_amplification": {
                    "verified": verified / needed,
                    "exact": exact / needed,
                },
            },
            indent=2,
        )
    )


if __name__ == "__main__":
    main()
