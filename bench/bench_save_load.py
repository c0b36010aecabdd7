"""Save / cold load / warm load throughput: shardpoint vs raw disk vs peer libraries.

Everything is measured side by side in one run on the same disk:
  raw O_DIRECT write/read of the same byte count (page-aligned buffers, 4 threads),
  memcpy of the same state, torch.save/torch.load, safetensors save_file/load_file,
  torch.distributed.checkpoint (FileSystemWriter thread_count 1 and 4), shardpoint.

Every save is timed until its files are durable: peers that do not fsync get an fsync
of their output files inside the timed region, as shardpoint does. "Cold" loads drop
the page cache of the checkpoint files first. Prints a table, writes JSON.

    python bench/bench_save_load.py [--dir DIR] [--reps 3] [--quick] [--only large|small|many]
"""

from __future__ import annotations

import argparse
import json
import mmap
import os
import platform
import shutil
import statistics
import tempfile
import time
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from contextlib import contextmanager
from pathlib import Path

import safetensors.torch as st
import torch
import torch.distributed.checkpoint as dcp
import xxhash

import shardpoint
import shardpoint.storage.direct_io as sp_local
from shardpoint.staging import SLOT_BYTES, StagingPool

BLOCK = 16 * 1024 * 1024


def large_state(n: int = 48, numel: int = 8 * 1024 * 1024) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(0)
    return {f"layer{i:02d}.weight": torch.randn(numel, generator=g) for i in range(n)}


def small_state(n: int = 10_000) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(0)
    return {f"p{i:05d}": torch.randn(256 + (i * 37) % 3840, generator=g) for i in range(n)}


def many_state(n: int = 100_000) -> dict[str, torch.Tensor]:
    """A mixture-of-experts-like count of small tensors (64 to 1,023 floats)."""
    g = torch.Generator().manual_seed(0)
    return {f"e{i:06d}": torch.randn(64 + (i * 37) % 960, generator=g) for i in range(n)}


def nbytes(state: dict[str, torch.Tensor]) -> int:
    return sum(t.numel() * t.element_size() for t in state.values())


def files_under(path: Path) -> list[Path]:
    return [p for p in (path.rglob("*") if path.is_dir() else [path]) if p.is_file()]


def fsync_all(path: Path) -> None:
    for p in files_under(path):
        fd = os.open(p, os.O_RDONLY)
        os.fsync(fd)
        os.close(fd)


def drop_cache(path: Path) -> None:
    """Evict the files' pages so the next read comes from the disk."""
    os.sync()
    for p in files_under(path):
        fd = os.open(p, os.O_RDONLY)
        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        os.close(fd)
    try:
        Path("/proc/sys/vm/drop_caches").write_text("3")
    except OSError:
        pass  # not root: fadvise above already evicted these files


def remove(path: Path) -> None:
    if path.is_dir():
        shutil.rmtree(path)
    elif path.exists():
        path.unlink()


# ---- raw disk and memory baselines -------------------------------------------------


class RawDisk:
    """The disk's own speed: O_DIRECT sequential I/O of page-aligned buffers, 16 MB
    blocks, 4 threads, buffers prepared outside the timed region."""

    def __init__(self, threads: int = 4) -> None:
        self.threads = threads
        self.bufs = [mmap.mmap(-1, BLOCK) for _ in range(threads)]
        for b in self.bufs:
            b.write(os.urandom(4096) * (BLOCK // 4096))

    def _run(self, fd: int, size: int, io: Callable[[int, mmap.mmap, int], int]) -> None:
        blocks = range(0, size, BLOCK)
        with ThreadPoolExecutor(self.threads) as pool:
            list(
                pool.map(
                    lambda i: io(fd, self.bufs[i % self.threads], blocks[i]), range(len(blocks))
                )
            )

    def write(self, path: Path, size: int) -> None:
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_DIRECT)
        self._run(fd, size, os.pwrite)
        os.fsync(fd)
        os.close(fd)

    def read(self, path: Path, size: int) -> None:
        fd = os.open(path, os.O_RDONLY | os.O_DIRECT)
        self._run(fd, size, lambda f, b, o: os.preadv(f, [b], o))
        os.close(fd)


def memcpy(state: dict[str, torch.Tensor], dest: dict[str, torch.Tensor]) -> None:
    for k, v in state.items():
        dest[k].copy_(v)


# ---- the contenders ------------------------------------------------------------------


@contextmanager
def direct_io(enabled: bool) -> Iterator[None]:
    """shardpoint as is, or as on a file system without O_DIRECT (buffered I/O)."""
    saved = sp_local._DIRECT
    sp_local._DIRECT = saved if enabled else 0
    try:
        yield
    finally:
        sp_local._DIRECT = saved


def contenders(state: dict[str, torch.Tensor]) -> dict[str, dict[str, Callable[..., object]]]:
    """label -> {"save": f(path), "load": f(path, dest)}.

    Every load ends with the values inside ``dest``, a live state that already exists
    (as a model's parameters do): in place where the library can, else load then copy,
    as ``model.load_state_dict(torch.load(...))`` does. The copy also makes lazily
    mmap-backed results (safetensors) actually read their bytes.
    """

    def dcp_save(threads: int) -> Callable[[Path], None]:
        def run(p: Path) -> None:
            dcp.save(state, storage_writer=dcp.FileSystemWriter(str(p), thread_count=threads))
            fsync_all(p)

        return run

    def sp_save(direct: bool) -> Callable[[Path], None]:
        def run(p: Path) -> None:
            with direct_io(direct):
                shardpoint.save(state, p)

        return run

    def torch_save(p: Path) -> None:
        torch.save(state, p)
        fsync_all(p)

    def st_save(p: Path) -> None:
        st.save_file(state, str(p))
        fsync_all(p)

    def sp_load(
        direct: bool, atomic: bool = True, pool: Callable[[], StagingPool] | None = None
    ) -> Callable[[Path, dict], None]:
        def run(p: Path, dest: dict[str, torch.Tensor]) -> None:
            with direct_io(direct):
                shardpoint.load(dest, p, atomic=atomic, undo_pool=pool() if pool else None)

        return run

    # The undo copy into a staging pool's slots: one made for the load (fresh pages,
    # faulted in by MAP_POPULATE), or one kept warm, as an async saver's pool is after
    # its first save (what CheckpointManager.restore lends a load).
    warm = StagingPool()
    warm.reserve(-(-nbytes(state) // SLOT_BYTES) + 1)  # outside the timed loads

    return {
        "shardpoint": {"save": sp_save(True), "load": sp_load(True)},
        "shardpoint (buffered I/O)": {"save": sp_save(False), "load": sp_load(False)},
        "shardpoint, atomic=False": {"save": sp_save(True), "load": sp_load(True, False)},
        "shardpoint, undo in new pool": {
            "save": sp_save(True),
            "load": sp_load(True, True, StagingPool),
        },
        "shardpoint, undo in warm pool": {
            "save": sp_save(True),
            "load": sp_load(True, True, lambda: warm),
        },
        "torch.save/load": {
            "save": torch_save,
            "load": lambda p, dest: memcpy(torch.load(p, weights_only=True), dest),
        },
        "safetensors": {
            "save": st_save,
            "load": lambda p, dest: memcpy(st.load_file(str(p)), dest),
        },
        "DCP thread_count=1": {
            "save": dcp_save(1),
            "load": lambda p, dest: dcp.load(dest, storage_reader=dcp.FileSystemReader(str(p))),
        },
        "DCP thread_count=4": {
            "save": dcp_save(4),
            "load": lambda p, dest: dcp.load(dest, storage_reader=dcp.FileSystemReader(str(p))),
        },
    }


def timed(fn: Callable[..., object], *args: object) -> float:
    t = time.perf_counter()
    fn(*args)
    return time.perf_counter() - t


def measure(name: str, state: dict[str, torch.Tensor], root: Path, reps: int) -> dict[str, object]:
    """Median seconds per operation. Repetitions are interleaved (every contender once,
    then again) so slow drifts of the (virtual) disk hit every contender alike."""
    size = nbytes(state)
    print(f"\n== {name}: {len(state)} tensors, {size / 1e9:.2f} GB, {reps} rounds (median) ==")
    times: dict[str, dict[str, list[float]]] = {}

    def record(label: str, op: str, seconds: float) -> None:
        times.setdefault(label, {}).setdefault(op, []).append(seconds)

    copy = {k: torch.empty_like(v) for k, v in state.items()}
    memcpy(state, copy)
    dest = {k: torch.zeros_like(v) for k, v in state.items()}  # the live state, faulted in
    disk = RawDisk()
    raw, out = root / "raw.bin", root / "out"
    for round_ in range(reps):
        remove(raw)
        record("raw O_DIRECT", "save", timed(disk.write, raw, size))
        drop_cache(raw)
        record("raw O_DIRECT", "cold", timed(disk.read, raw, size))
        remove(raw)
        record("memcpy", "save", timed(memcpy, state, copy))
        record("xxh3 checksum", "save", timed(checksum_all, state))
        for label, ops in contenders(state).items():
            remove(out)
            record(label, "save", timed(ops["save"], out))
            drop_cache(out)
            record(label, "cold", timed(ops["load"], out, dest))
            record(label, "warm", timed(ops["load"], out, dest))
            remove(out)
            if not all(torch.equal(dest[k], v) for k, v in state.items()):
                raise AssertionError(f"{label} loaded wrong values")
            for t in dest.values():
                t.zero_()
        print(f"  round {round_ + 1}/{reps} done", flush=True)
    rows = {
        label: {op: statistics.median(v) for op, v in ops.items()} for label, ops in times.items()
    }
    table(name, size, rows, len(state))
    return {"tensors": len(state), "bytes": size, "seconds": rows, "all_seconds": times}


def checksum_all(state: dict[str, torch.Tensor]) -> None:
    for t in state.values():
        xxhash.xxh3_64_intdigest(t.numpy())


def table(name: str, size: int, rows: dict[str, dict[str, float]], tensors: int) -> None:
    raw = rows["raw O_DIRECT"]
    print(f"\n{name}  ({size / 1e9:.2f} GB)   GB/s (ratio to raw O_DIRECT)")
    print(f"{'':28}{'save':>18}{'cold load':>18}{'warm load':>18}")
    for label, row in rows.items():
        cells = []
        for key, base in (("save", raw["save"]), ("cold", raw["cold"]), ("warm", raw["cold"])):
            if key in row:
                cells.append(f"{size / row[key] / 1e9:7.2f} ({base / row[key]:4.2f}x)")
            else:
                cells.append("")
        print(f"{label:28}" + "".join(f"{c:>18}" for c in cells))
    if tensors >= 10_000:  # many small tensors: the cost per tensor is the figure
        print(f"\n{name}   microseconds per tensor")
        for label, row in rows.items():
            if label in ("raw O_DIRECT", "memcpy", "xxh3 checksum"):
                continue
            cells = [
                f"{row[k] / tensors * 1e6:.1f}" if k in row else ""
                for k in ("save", "cold", "warm")
            ]
            print(f"{label:28}" + "".join(f"{c:>18}" for c in cells))


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument(
        "--dir", type=Path, default=None, help="scratch directory on the disk to test"
    )
    parser.add_argument("--reps", type=int, default=3)
    parser.add_argument(
        "--quick", action="store_true", help="a small state, to check the script runs"
    )
    parser.add_argument(
        "--only", choices=["large", "small", "many"], default=None, help="run one case"
    )
    parser.add_argument("--out", type=Path, default=Path("bench/results/save_load.json"))
    args = parser.parse_args()
    root = Path(tempfile.mkdtemp(prefix="shardpoint-bench-", dir=args.dir))
    try:
        if args.quick:
            cases = {
                "large": large_state(4, 1024 * 1024),
                "small": small_state(500),
                "many": many_state(10_000),
            }
        else:
            makers = {
                "large (48 x 32 MB fp32)": large_state,
                "small (10,000 tensors)": small_state,
                "many (100,000 tensors)": many_state,
            }
            cases = {k: make() for k, make in makers.items() if k.startswith(args.only or "")}
        results = {
            "machine": {
                "cpus": os.cpu_count(),
                "platform": platform.platform(),
                "torch": torch.__version__,
            },
            "shardpoint": shardpoint.__version__,
            "cases": {name: measure(name, state, root, args.reps) for name, state in cases.items()},
        }
    finally:
        shutil.rmtree(root, ignore_errors=True)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(results, indent=1))
    print(f"\nwrote {args.out}")


if __name__ == "__main__":
    main()
