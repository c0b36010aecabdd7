"""Asynchronous saves: what training pays for a checkpoint, measured side by side.

On the 1.61 GB state of bench_save_load.py, in one run:
  stall      how long the call blocks the training thread: shardpoint.async_save vs a
             plain clone() of the state (fresh memory, the naive snapshot) vs a copy
             into preallocated memory (memcpy floor) vs the synchronous save vs
             torch.distributed.checkpoint.async_save (thread and process modes);
  slowdown   how much slower a compute-bound training loop (MLP forward/backward/SGD)
             runs while the background persist is going, for shardpoint's writer
             threads and for a prototype writer *process* that reads the staging
             slots from shared memory (the design alternative issue 5 asks about);
  persist    call-to-commit time of the async save vs the synchronous save;
  memory     peak RSS above the state itself with the default pool, a 256 MiB pool,
             and clone() (each in a fresh subprocess).

    python bench/bench_async.py [--dir DIR] [--reps 3]

Prints a table and writes JSON to bench/results/async.json.
"""

from __future__ import annotations

import argparse
import json
import mmap
import os
import platform
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

import torch
import xxhash

import shardpoint
from shardpoint.staging import SLOT_BYTES

sys.path.insert(0, str(Path(__file__).parent))
from bench_save_load import RawDisk, large_state, nbytes, remove  # noqa: E402

RESULTS = Path(__file__).parent / "results"


def median(xs: list[float]) -> float:
    return statistics.median(xs)


# ---- a compute-bound training loop ------------------------------------------------------


class Trainer:
    """An MLP step on random data: compute bound, no I/O, ~20-40 ms per step here."""

    def __init__(self) -> None:
        torch.manual_seed(0)
        layers = []
        for _ in range(4):
            layers += [torch.nn.Linear(1024, 1024), torch.nn.ReLU()]
        self.model = torch.nn.Sequential(*layers)
        self.opt = torch.optim.SGD(self.model.parameters(), lr=1e-4)
        self.x = torch.randn(512, 1024)

    def step(self) -> None:
        self.opt.zero_grad(set_to_none=True)
        self.model(self.x).square().mean().backward()
        self.opt.step()

    def rate_while(self, busy: threading.Event | None, seconds: float) -> float:
        """Steps per second, for ``seconds`` (busy=None) or for as long as ``busy`` is set."""
        start, steps = time.perf_counter(), 0
        while True:
            self.step()
            steps += 1
            elapsed = time.perf_counter() - start
            if (busy is None and elapsed >= seconds) or (busy is not None and not busy.is_set()):
                return steps / elapsed


# ---- the alternative design: a writer process on shared-memory staging -------------------


def writer_process_main(shm_path: str) -> None:
    """Runs in the writer process: JSON commands on stdin, one reply line per command."""
    size = os.path.getsize(shm_path)
    fd = os.open(shm_path, os.O_RDWR)
    shared = mmap.mmap(fd, size, flags=mmap.MAP_SHARED)
    view = memoryview(shared)
    files: dict[str, int] = {}
    for line in sys.stdin:
        cmd = json.loads(line)
        if cmd["op"] == "write":
            out = files.get(cmd["path"])
            if out is None:
                flags = os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_DIRECT
                out = files[cmd["path"]] = os.open(cmd["path"], flags)
            lo = cmd["slot"] * SLOT_BYTES
            data = view[lo : lo + cmd["len"]]
            os.pwrite(out, data, cmd["offset"])
            digest = xxhash.xxh3_64_hexdigest(data)
            print(json.dumps({"slot": cmd["slot"], "digest": digest}), flush=True)
        elif cmd["op"] == "sync":
            for out in files.values():
                os.fsync(out)
                os.close(out)
            files.clear()
            print(json.dumps({"synced": True}), flush=True)


class ProcessWriter:
    """Prototype: the training process stages into shared memory; a separate process
    writes and hashes the slots (commands are JSON, no tensor is pickled)."""

    def __init__(self, nbytes: int) -> None:
        self.slots = -(-nbytes // SLOT_BYTES)
        fd, self.shm_path = tempfile.mkstemp(dir="/dev/shm", prefix="shardpoint-bench-")
        os.ftruncate(fd, self.slots * SLOT_BYTES)
        self.shared = mmap.mmap(fd, self.slots * SLOT_BYTES, flags=mmap.MAP_SHARED)
        os.close(fd)
        self.arena = torch.frombuffer(self.shared, dtype=torch.uint8)
        self.arena.zero_()  # fault the pages in once, as the thread pool's slots are
        self.proc = subprocess.Popen(
            [sys.executable, __file__, "--writer-process", self.shm_path],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            text=True,
        )

    def stage(self, state: dict[str, torch.Tensor]) -> list[tuple[int, int]]:
        """Copy the tensors back to back into the arena; returns (slot, length) list."""
        pos = 0
        for t in state.values():
            raw = t.reshape(-1).view(torch.uint8)
            self.arena[pos : pos + raw.numel()].copy_(raw)
            pos += raw.numel()
        return [(i, min(SLOT_BYTES, pos - i * SLOT_BYTES)) for i in range(-(-pos // SLOT_BYTES))]

    def persist(self, slots: list[tuple[int, int]], path: Path, done: threading.Event) -> None:
        assert self.proc.stdin and self.proc.stdout
        for slot, length in slots:
            cmd = {"op": "write", "path": str(path), "slot": slot, "offset": slot * SLOT_BYTES}
            self.proc.stdin.write(json.dumps({**cmd, "len": length}) + "\n")
        self.proc.stdin.write(json.dumps({"op": "sync"}) + "\n")
        self.proc.stdin.flush()
        for _ in range(len(slots) + 1):
            self.proc.stdout.readline()
        done.clear()

    def close(self) -> None:
        assert self.proc.stdin
        self.proc.stdin.close()
        self.proc.wait()
        del self.arena
        self.shared.close()
        os.unlink(self.shm_path)


# ---- measurements --------------------------------------------------------------------------


def stalls(state: dict[str, torch.Tensor], root: Path, reps: int) -> dict[str, float]:
    out: dict[str, list[float]] = {}

    def record(name: str, seconds: float) -> None:
        out.setdefault(name, []).append(seconds)

    saver = shardpoint.AsyncSaver()
    start = time.perf_counter()
    saver.save(state, root / "first")
    first_stall = time.perf_counter() - start
    saver.wait()
    remove(root / "first")
    preallocated = {k: torch.empty_like(v).zero_() for k, v in state.items()}  # faulted in
    for _ in range(reps):
        start = time.perf_counter()
        snapshot = {k: v.clone() for k, v in state.items()}
        record("clone()", time.perf_counter() - start)
        del snapshot
        start = time.perf_counter()
        for k, v in state.items():
            preallocated[k].copy_(v)
        record("copy into preallocated memory", time.perf_counter() - start)

        start = time.perf_counter()
        handle = saver.save(state, root / "async")
        record("shardpoint async_save", time.perf_counter() - start)
        info = handle.wait()
        record("shardpoint async, call to commit", info.seconds)
        remove(root / "async")

        start = time.perf_counter()
        shardpoint.save(state, root / "sync")
        record("shardpoint save (sync)", time.perf_counter() - start)
        remove(root / "sync")
    medians = {k: median(v) for k, v in out.items()}
    medians["shardpoint async_save, first call (pool allocation)"] = first_stall
    medians.update(dcp_stalls(state, root, reps))
    return medians


def init_process_group() -> None:
    """A gloo group of one, as every multi-rank job has (and DCP needs)."""
    import torch.distributed as dist

    if not dist.is_initialized():
        os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
        os.environ.setdefault("MASTER_PORT", "29533")
        dist.init_process_group("gloo", rank=0, world_size=1)


def dcp_stalls(state: dict[str, torch.Tensor], root: Path, reps: int) -> dict[str, float]:
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict_saver import AsyncCheckpointerType

    init_process_group()
    out: dict[str, float] = {}
    for kind in AsyncCheckpointerType:
        times, ends = [], []
        try:
            for i in range(reps):
                path = root / f"dcp-{kind.value}-{i}"
                start = time.perf_counter()
                fut = dcp.async_save(dict(state), checkpoint_id=path, async_checkpointer_type=kind)
                times.append(time.perf_counter() - start)
                # In recent torch the future may be wrapped in a response object.
                getattr(fut, "upload_completion", fut).result()
                ends.append(time.perf_counter() - start)
                remove(path)
        except Exception as exc:  # report, do not hide: the table says why it is missing
            print(f"DCP async_save ({kind.value}) failed: {type(exc).__name__}: {exc}")
            continue
        out[f"DCP async_save ({kind.value})"] = median(times)
        out[f"DCP async ({kind.value}), call to durable"] = median(ends)
    return out


def slowdown(state: dict[str, torch.Tensor], root: Path, reps: int) -> dict[str, float]:
    """Training steps/s while a persist runs vs without; staging is excluded (it is
    the stall measured above)."""
    trainer = Trainer()
    trainer.rate_while(None, 1.0)  # warm up
    saver = shardpoint.AsyncSaver()  # nice=19, the default
    saver.save(state, root / "warm").wait()  # pool allocated outside the measurement
    remove(root / "warm")
    writer = ProcessWriter(nbytes(state))

    def thread_persist(path: Path, nice: int = 19) -> threading.Event:
        busy = threading.Event()
        busy.set()
        saver.nice = nice
        handle = saver.save(state, path)
        threading.Thread(target=lambda: (handle.wait(), busy.clear())).start()
        return busy

    def process_persist(path: Path) -> threading.Event:
        busy = threading.Event()
        busy.set()
        slots = writer.stage(state)
        threading.Thread(target=writer.persist, args=(slots, path, busy)).start()
        return busy

    raw = RawDisk()

    def raw_write(path: Path) -> threading.Event:
        """The floor: the same bytes written by plain O_DIRECT calls, no hashing, no
        commit; whatever this costs training is the disk's and the VM's share."""
        busy = threading.Event()
        busy.set()
        threading.Thread(target=lambda: (raw.write(path, nbytes(state)), busy.clear())).start()
        return busy

    modes = (
        ("thread, nice 19 (default)", thread_persist),
        ("thread, nice 0", lambda path: thread_persist(path, nice=0)),
        ("process", process_persist),
        ("raw write", raw_write),
    )
    # Baseline and persist windows alternate, so drifts of the machine's speed (this VM
    # varies +-8% second to second) hit both alike.
    totals: dict[str, list[float]] = {}
    for k in range(4 * reps):
        for mode, persist in modes:
            base = trainer.rate_while(None, 1.0)
            _add(totals, f"{mode}: baseline", base * 1.0, 1.0)
            path = root / f"{mode}-{k}"
            busy = persist(path)
            start = time.perf_counter()
            rate = trainer.rate_while(busy, 0)
            elapsed = time.perf_counter() - start
            _add(totals, f"{mode}: during", rate * elapsed, elapsed)
            while busy.is_set():
                time.sleep(0.001)
            remove(path)
    result = {}
    for mode, _ in modes:
        base = totals[f"{mode}: baseline"][0] / totals[f"{mode}: baseline"][1]
        during = totals[f"{mode}: during"][0] / totals[f"{mode}: during"][1]
        result[f"{mode}: baseline steps/s"] = base
        result[f"{mode}: steps/s during"] = during
        result[f"{mode}: seconds per persist, training"] = totals[f"{mode}: during"][1] / (4 * reps)
        result[f"{mode}: slowdown"] = 1 - during / base
    writer.close()
    return result


def _add(totals: dict[str, list[float]], key: str, steps: float, seconds: float) -> None:
    entry = totals.setdefault(key, [0.0, 0.0])
    entry[0] += steps
    entry[1] += seconds


def raw_write_seconds(root: Path, size: int, reps: int) -> float:
    raw, times = RawDisk(), []
    for _ in range(reps):
        start = time.perf_counter()
        raw.write(root / "raw.bin", size)
        times.append(time.perf_counter() - start)
        remove(root / "raw.bin")
    return median(times)


def peak_memory(pool: str) -> float:
    """Peak RSS (GB) above the state itself, in a fresh process."""
    out = subprocess.run(
        [sys.executable, __file__, "--memory-probe", pool], capture_output=True, text=True
    )
    if out.returncode:
        raise RuntimeError(f"memory probe {pool} failed:\n{out.stderr}")
    return float(out.stdout.strip().splitlines()[-1])


def high_water_mark() -> int:
    """Peak RSS of this process in bytes. (Not ru_maxrss: Linux carries that over from
    the parent through fork and exec, so a child of a big process starts "high".)"""
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith("VmHWM:"):
            return int(line.split()[1]) * 1024
    raise RuntimeError("no VmHWM in /proc/self/status")


def memory_probe(pool: str) -> None:
    state = large_state()
    with tempfile.TemporaryDirectory(dir=os.environ.get("BENCH_DIR")) as d:
        base = high_water_mark()
        if pool == "clone":
            snapshot = {k: v.clone() for k, v in state.items()}
            del snapshot
        else:
            saver = shardpoint.AsyncSaver(pool_bytes=None if pool == "default" else int(pool))
            saver.save(state, Path(d) / "c").wait()
        peak = high_water_mark()
    print((peak - base) / 1e9)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--dir", default=None, help="where to write (default: a temp dir)")
    parser.add_argument("--reps", type=int, default=3)
    parser.add_argument("--writer-process", help=argparse.SUPPRESS)
    parser.add_argument("--memory-probe", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.writer_process:
        return writer_process_main(args.writer_process)
    if args.memory_probe:
        return memory_probe(args.memory_probe)

    state = large_state()
    size = nbytes(state)
    with tempfile.TemporaryDirectory(dir=args.dir) as d:
        root = Path(d)
        os.environ["BENCH_DIR"] = d
        raw = raw_write_seconds(root, size, args.reps)
        # The training loop is measured with a process group (every multi-rank job has
        # one) but before DCP's async checkpointers ran in this process: after them the
        # same loop slowed 21% for every writer, as much as plain O_DIRECT writes.
        init_process_group()
        slow = slowdown(state, root, args.reps)
        stall = stalls(state, root, args.reps)
        memory = {
            "default pool (fits the state)": peak_memory("default"),
            "256 MiB pool": peak_memory(str(256 * 1024**2)),
            "clone()": peak_memory("clone"),
        }
    clone = stall["clone()"]
    print(f"\nstate {size / 1e9:.2f} GB, raw O_DIRECT write {size / raw / 1e9:.2f} GB/s")
    print(f"\n{'training-visible stall':<52}{'seconds':>9}{'x clone()':>11}")
    for name, s in stall.items():
        if "call to" not in name:
            print(f"{name:<52}{s:>9.3f}{s / clone:>11.2f}")
    print(f"\n{'persist (call to durable)':<52}{'seconds':>9}{'GB/s':>9}")
    for name, s in stall.items():
        if "call to" in name or "sync" in name:
            print(f"{name:<52}{s:>9.3f}{size / s / 1e9:>9.2f}")
    ratio = stall["shardpoint save (sync)"] / stall["shardpoint async, call to commit"]
    print(f"async persist throughput / sync: {ratio:.2f}")
    print(f"\n{'training loop while persisting':<52}{'value':>9}")
    for name, v in slow.items():
        print(f"{name:<52}{v:>9.3f}")
    print(f"\n{'peak RSS above the state':<52}{'GB':>9}")
    for name, v in memory.items():
        print(f"{name:<52}{v:>9.2f}")
    RESULTS.mkdir(exist_ok=True)
    (RESULTS / "async.json").write_text(
        json.dumps(
            {
                "machine": platform.platform(),
                "cpus": os.cpu_count(),
                "torch": torch.__version__,
                "state_bytes": size,
                "raw_write_gb_s": size / raw / 1e9,
                "stall_seconds": stall,
                "async_over_sync_throughput": ratio,
                "training_while_persisting": slow,
                "peak_rss_above_state_gb": memory,
            },
            indent=2,
        )
    )


if __name__ == "__main__":
    main()
