"""Asynchronous saves: stage on the training thread, persist in the background.

``AsyncSaver.save`` runs the save pipeline (``saving.run_save``) with a ``Stager``:
on the caller's thread only what a consistent snapshot needs (flatten, the plan —
cached, with no collective, while no rank's structure changes — and a copy of the
bytes of every file this rank writes into staging-pool slots). When it returns, the
live tensors may change; what is written is what they held at the call. Writer
threads hand slots to the storage's streaming writers (local O_DIRECT files or
multipart uploads) as they are staged, a hasher thread checksums them in file order,
and a commit thread runs the pipeline's commit phase on a process group of its own.

At most one save is in flight: a new save first waits for the previous one (or,
with ``if_busy="skip"``, every rank skips while any rank is still busy). A failed
background save raises on ``wait()``, on the next save, or on ``close()``, once.
"""

from __future__ import annotations

import math
import os
import threading
import time
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor, wait
from dataclasses import dataclass, replace
from typing import Any

import torch
import xxhash

from . import dist
from .commit import Commit
from .defaults import DEFAULT_MAX_SHARD_BYTES, DEFAULT_THREADS
from .format.index import block_count, checksum
from .format.safetensors import itemsize
from .gc_pause import gc_paused
from .incremental import IncrementalChain
from .layout import ShardFile, chunk_records
from .save_plan import SavePlan
from .save_records import SaveInfo, SaveOptions, WriteResult
from .saving import run_save
from .staging import SLOT_BYTES, Slot, StagingPool
from .storage import FileWriter, open_storage
from .storage.io_types import ALIGN

_SMALL_COPY = 65536  # below this numpy copies faster than torch's dispatch


class AsyncSave:
    """Handle of one background save (like a ``concurrent.futures.Future``)."""

    def __init__(self, path: os.PathLike[str] | str, stall_seconds: float) -> None:
        self.path = path
        self.stall_seconds = stall_seconds  # how long the caller was blocked
        self._done = threading.Event()
        self._info: SaveInfo | None = None
        self._error: BaseException | None = None
        self._observed = False

    def _finish(self, info: SaveInfo | None, error: BaseException | None) -> None:
        self._info, self._error = info, error
        self._done.set()

    def done(self) -> bool:
        return self._done.is_set()

    def exception(self, timeout: float | None = None) -> BaseException | None:
        """The save's error (waits for it to finish), or None if it committed."""
        if not self._done.wait(timeout):
            raise TimeoutError(f"background save to {self.path} still running")
        self._observed = True
        return self._error

    def wait(self, timeout: float | None = None) -> SaveInfo:
        """Wait until the checkpoint is committed; raises the save's error if it failed."""
        error = self.exception(timeout)
        if error is not None:
            raise error
        assert self._info is not None
        return self._info


class AsyncSaver:
    """Background saves with one reusable staging pool; at most one save in flight.

    ``pool_bytes`` bounds the staging memory (default: grows to the largest save, so
    ``save`` never waits for the disk). ``if_busy`` is ``"wait"`` (a new save waits for
    the previous one) or ``"skip"`` (a new save is skipped, on every rank, while the
    previous one is still running). ``nice`` is the scheduling niceness of the
    background threads on Linux: at the default 19 they use what training leaves
    idle (a CPU-bound loop on 2 cores slowed 1% instead of 30%, the persist took 4.6 s
    instead of 0.8 s; docs/benchmarks.md); 0 lets them compete with training.
    """

    def __init__(
        self,
        *,
        pool_bytes: int | None = None,
        threads: int = DEFAULT_THREADS,
        max_shard_size: int = DEFAULT_MAX_SHARD_BYTES,
        if_busy: str = "wait",
        nice: int = 19,
        storage_options: dict[str, Any] | None = None,
        per_node: bool = False,
    ) -> None:
        if if_busy not in ("wait", "skip"):
            raise ValueError("if_busy must be 'wait' or 'skip'")
        self.nice = nice
        self.pool = StagingPool(pool_bytes)
        self.threads = threads
        self.max_shard_size = max_shard_size
        self.if_busy = if_busy
        self.storage_options = storage_options
        self.per_node = per_node  # node-local directories (the manager's local tier)
        self._in_flight: AsyncSave | None = None
        self._thread: threading.Thread | None = None
        self._stager: Stager | None = None
        self._group: Any = None
        self._group_generation = -1  # the process group's generation it was made in

    @gc_paused()
    def save(
        self,
        state: Any,
        path: str | os.PathLike[str],
        *,
        metadata: dict[str, Any] | None = None,
        on_done: Callable[[SaveInfo | None, BaseException | None], None] | None = None,
        chain: IncrementalChain | None = None,
    ) -> AsyncSave | None:
        """Snapshot ``state`` and write it to ``path`` in the background.

        Returns the handle, or None when ``if_busy="skip"`` skipped it. ``on_done(info,
        error)`` runs on the background thread once the save committed or failed.
        ``chain``: an incremental save (``shardpoint.save``'s ``incremental``). Raises the
        error of an earlier save nobody has seen yet.
        """
        if self.if_busy == "skip" and dist.max_of([int(self.busy())])[0]:
            return None
        self.wait()
        start = time.perf_counter()
        storage = open_storage(path, self.storage_options)
        if self._stager is None or self._stager.nice != self.nice:
            self._stager = Stager(self.pool, self.threads, self.nice)  # threads kept
        stager = self._stager
        options = SaveOptions(self.max_shard_size, self.threads, metadata, self.per_node, chain)
        finish = run_save(state, storage, options, stager, group=self._own_group())
        assert callable(finish)
        handle = AsyncSave(storage.root, 0.0)
        self._in_flight = handle
        self._thread = threading.Thread(
            target=_finish_in_background,
            args=(finish, handle, on_done, self.nice, dist.in_solo()),
            name="shardpoint-commit",
        )
        self._thread.start()
        handle.stall_seconds = time.perf_counter() - start  # all the caller waited for
        return handle

    def _own_group(self) -> Any:
        """This saver's gloo group for the collectives its background thread runs: not
        the training loop's default group, and not another saver's (two savers' saves in
        flight at once would pair each other's gathers). Made at its first distributed
        save (a collective, as the save is), again after torch.distributed is
        re-initialized; None in one process."""
        if not dist.is_distributed():
            return None
        if self._group_generation != dist.generation():
            self._group, self._group_generation = dist.new_cpu_group(), dist.generation()
        return self._group

    def busy(self) -> bool:
        """Whether a save is still in flight (staged, not yet committed or failed)."""
        return self._in_flight is not None and not self._in_flight.done()

    def wait(self) -> SaveInfo | None:
        """Wait for the save in flight; raises its error if nobody has seen it yet."""
        handle, self._in_flight = self._in_flight, None
        if handle is None:
            return None
        if self._thread is not None:
            self._thread.join()
        seen = handle._observed
        error = handle.exception()
        if error is not None:
            if seen:
                return None
            raise error
        return handle._info

    def close(self) -> None:
        """Finish the save in flight (raising its error) and keep nothing running."""
        self.wait()


_DEFAULT_SAVER: AsyncSaver | None = None


def async_save(
    state: Any,
    path: str | os.PathLike[str],
    *,
    metadata: dict[str, Any] | None = None,
) -> AsyncSave:
    """Save ``state`` to ``path`` in the background; returns once it is staged.

    Changing the live tensors after this returns does not change what is written.
    Calls share one staging pool (kept for the process) and run one at a time: a
    second call waits for the first. For a bounded pool, skipping while busy, or the
    manager's periodic saves, use ``AsyncSaver`` / ``CheckpointManager(async_save=True)``.

    >>> handle = shardpoint.async_save(state, "/ckpt/step-100")   # doctest: +SKIP
    >>> train_step()                                              # doctest: +SKIP
    >>> handle.wait()                                             # doctest: +SKIP
    """
    global _DEFAULT_SAVER
    if _DEFAULT_SAVER is None:
        _DEFAULT_SAVER = AsyncSaver()
    handle = _DEFAULT_SAVER.save(state, path, metadata=metadata)
    assert handle is not None  # the default saver waits rather than skips
    return handle


def _finish_in_background(
    finish: Callable[[], SaveInfo],
    handle: AsyncSave,
    on_done: Callable[[SaveInfo | None, BaseException | None], None] | None,
    nice: int,
    solo: bool,
) -> None:
    if solo:  # a save started as a job of one process finishes as one
        with dist.solo():
            _finish_in_background(finish, handle, on_done, nice, False)
        return
    lower_priority(nice)
    info: SaveInfo | None = None
    error: BaseException | None = None
    try:
        info = replace(finish(), blocked_seconds=handle.stall_seconds)
    except BaseException as exc:  # delivered through the handle, never lost
        error = exc
    if on_done is not None:
        try:
            on_done(info, error)
        except BaseException as exc:
            error = error or exc
    handle._finish(info, error)


def lower_priority(nice: int) -> None:
    """Make the calling thread yield the CPU to training (Linux: per-thread niceness)."""
    if nice <= 0 or not hasattr(os, "setpriority"):
        return
    try:
        os.setpriority(os.PRIO_PROCESS, threading.get_native_id(), nice)
    except OSError:
        pass  # not permitted or not per-thread here: run at normal priority


# ---- staging: the only part that runs on the training thread --------------------------


def _stage(shards: list[ShardFile], pool: StagingPool, put: Callable[..., None]) -> None:
    """Copy every file's bytes, in file order, into pool slots and hand each slot on."""
    for f in shards:
        sources = [(0, f.header), *((p.begin, p.raw) for p in f.placed)]
        cursor = 0
        for lo in range(0, f.size, SLOT_BYTES):
            hi = min(lo + SLOT_BYTES, f.size)
            slot = pool.acquire()
            try:
                on_device = _fill(slot, sources, cursor, lo, hi)
            except BaseException:
                pool.release(slot)
                raise
            if on_device:
                torch.cuda.synchronize()  # the non-blocking copies must land first
            put(slot, f, lo, hi)
            while cursor < len(sources) and sources[cursor][0] + sources[cursor][1].numel() <= hi:
                cursor += 1


def _fill(
    slot: Slot, sources: list[tuple[int, torch.Tensor]], cursor: int, lo: int, hi: int
) -> bool:
    """Copy file bytes [lo, hi) from the sources (sorted by offset) into ``slot``; zero the
    page padding past ``hi``. Returns whether any copy came from a device."""
    on_device = False
    while cursor < len(sources) and sources[cursor][0] < hi:
        begin, src = sources[cursor]
        a, b = max(begin, lo), min(begin + src.numel(), hi)
        if b > a:
            on_device |= src.device.type != "cpu"
            _copy(slot.data[a - lo : b - lo], src[a - begin : b - begin])
        cursor += 1
    tail = -(hi - lo) % ALIGN  # O_DIRECT writes whole pages; truncated later
    if tail:
        slot.data[hi - lo : hi - lo + tail] = 0
    return on_device


def _copy(dst: torch.Tensor, src: torch.Tensor) -> None:
    if src.device.type == "cpu" and src.numel() < _SMALL_COPY:
        dst.numpy()[:] = src.numpy()
    else:
        dst.copy_(src, non_blocking=True)


# ---- persisting: writer threads, the hasher thread, then the commit ---------------------


@dataclass
class _Block:
    """One checksum block of a placed piece: file bytes [lo, hi)."""

    lo: int
    hi: int
    piece: int
    index: int


class Stager:
    """The stage phase of the pipeline for background saves (``write_phase.Staging``)."""

    def __init__(self, pool: StagingPool, threads: int, nice: int) -> None:
        self.pool, self.threads, self.nice = pool, threads, nice
        # Kept for every save: starting threads on the caller's thread cost more than
        # the staging copy itself (0.04-0.17 s per save on the 2-core dev VM).
        self._writers = ThreadPoolExecutor(
            threads, "shardpoint-write", initializer=lower_priority, initargs=(nice,)
        )
        self._hasher = ThreadPoolExecutor(
            1, "shardpoint-hash", initializer=lower_priority, initargs=(nice,)
        )

    def spare_bytes(self) -> int:
        """What the staging pool already holds: a rank that must copy all it holds
        after a change does so only within it (``saving.run_save``)."""
        return self.pool.nbytes

    def stage(self, plan: SavePlan, files: list[ShardFile]) -> Callable[[], WriteResult]:
        """Copy every file's bytes into pool slots (this thread) while writer threads
        write them out; returns the function that waits for the writes. Never raises:
        a failure is reported by that function, after the files are cleaned up."""
        persist = _Persist(plan, self.pool, self.threads, self._writers, self._hasher)
        try:
            slots = sum(-(-f.size // SLOT_BYTES) for f in files)
            self.pool.reserve(slots)
            # When everything fits, writing starts after staging: writers running beside
            # the copy slow it down (1.6 GB: 0.10 s alone, 0.13-0.25 s beside them).
            persist.hold = self.pool.nbytes >= slots * SLOT_BYTES
            persist.open(files)
            _stage(files, self.pool, persist.put)
        except Exception as exc:  # reported by the commit, so that no rank waits forever
            persist.fail(f"rank {plan.rank}: {exc}")
        persist.release_held()
        return persist.finish


class _OpenFile:
    def __init__(self, writer: FileWriter, shard: ShardFile, first_piece: int) -> None:
        self.shard = shard
        self.writer = writer
        self.blocks: list[_Block] = []
        self.empty: list[_Block] = []  # blocks of no bytes (empty tensors)
        self.block_counts: list[int] = []
        for i, p in enumerate(shard.placed):
            shape, size = p.slot.shape, itemsize(p.slot.dtype)
            step = p.block_rows * (math.prod(shape[1:]) * size if shape else size)
            rows = shape[0] if shape else 1
            self.block_counts.append(block_count(rows, p.block_rows))
            for k in range(self.block_counts[-1]):
                lo = p.begin + k * step
                block = _Block(lo, min(lo + step, p.end), first_piece + i, k)
                (self.blocks if block.hi > block.lo else self.empty).append(block)
        self.cursor = 0
        self.partial: xxhash.xxh3_64 | None = None


class _Persist:
    """Writes staged slots, checksums them in file order, and reports the result."""

    def __init__(
        self,
        plan: SavePlan,
        pool: StagingPool,
        threads: int,
        writers: ThreadPoolExecutor,
        hasher: ThreadPoolExecutor,
    ) -> None:
        self.plan = plan
        self.pool = pool
        self.threads = threads
        self.files: list[_OpenFile] = []
        self.placed: list[Any] = []
        self.sums: list[list[str]] = []
        # Incremental saves: each piece's xxh3-128 (None: not wanted), fed in file order.
        self.identities: list[Any] = []
        self.error: str | None = None
        self._by_name: dict[str, _OpenFile] = {}
        self.hold = False  # keep staged slots until staging is over (the pool fits it all)
        self._held: list[tuple[Slot, _OpenFile, int, int]] = []
        self._lock = threading.Lock()
        self._writers, self._hasher = writers, hasher
        self._jobs: list[Future[None]] = []

    def open(self, shards: list[ShardFile]) -> None:
        for f in shards:
            # Exclusive: a name that is there is another writer's (docs/distributed.md).
            writer = self.plan.storage.open_writer(
                f.name, f.size, threads=self.threads, exclusive=True
            )
            opened = _OpenFile(writer, f, len(self.placed))
            self.files.append(opened)
            self.placed.extend(f.placed)
            self.sums.extend([""] * n for n in opened.block_counts)
            self.identities.extend(
                xxhash.xxh3_128() if id(p.piece) in self.plan.identify else None for p in f.placed
            )
            for b in opened.empty:
                self.sums[b.piece][b.index] = checksum(b"")
            self._by_name[f.name] = opened

    def fail(self, error: str) -> None:
        with self._lock:
            self.error = self.error or error

    def put(self, slot: Slot, shard: ShardFile, lo: int, hi: int) -> None:
        """Hand a staged slot to the writers and the hasher (or hold it, see ``hold``)."""
        job = (slot, self._by_name[shard.name], lo, hi)
        if self.hold:
            self._held.append(job)
        else:
            self._submit(job)

    def release_held(self) -> None:
        self.hold = False
        for job in self._held:
            self._submit(job)
        self._held.clear()

    def _submit(self, job: tuple[Slot, _OpenFile, int, int]) -> None:
        job[0].pending = 2
        self._jobs.append(self._writers.submit(self._write, *job))
        self._jobs.append(self._hasher.submit(self._hash, *job))

    def _write(self, slot: Slot, f: _OpenFile, lo: int, hi: int) -> None:
        try:
            if self.error is None:  # the slot's page padding is zeroed; writers cut it
                n = -(-(hi - lo) // ALIGN) * ALIGN
                f.writer.write(lo, memoryview(slot.data.numpy())[:n])
        except Exception as exc:
            self.fail(f"rank {self.plan.rank}: writing {f.shard.name}: {exc}")
        finally:
            self.pool.done_with(slot)

    def _hash(self, slot: Slot, f: _OpenFile, lo: int, hi: int) -> None:
        """Checksum blocks in [lo, hi); a block split across slots is hashed in parts."""
        try:
            view = memoryview(slot.data.numpy())
            while f.cursor < len(f.blocks) and f.blocks[f.cursor].lo < hi:
                b = f.blocks[f.cursor]
                a, z = max(b.lo, lo), min(b.hi, hi)
                if self.identities[b.piece] is not None:
                    self.identities[b.piece].update(view[a - lo : z - lo])
                if f.partial is None and b.lo >= lo and b.hi <= hi:
                    self.sums[b.piece][b.index] = checksum(view[a - lo : z - lo])
                else:
                    f.partial = f.partial or xxhash.xxh3_64()
                    f.partial.update(view[a - lo : z - lo])
                    if b.hi > hi:
                        break  # the rest of this block is in the next slot
                    self.sums[b.piece][b.index] = f.partial.hexdigest()
                    f.partial = None
                f.cursor += 1
        except Exception as exc:
            self.fail(f"rank {self.plan.rank}: checksums of {f.shard.name}: {exc}")
        finally:
            self.pool.done_with(slot)

    def finish(self) -> WriteResult:
        """Wait for every slot, make the files durable, and say what was written."""
        wait(self._jobs)  # each job records its own error
        closing = list(self.files)
        while closing and self.error is None:
            f = closing.pop(0)
            try:
                f.writer.close()
            except Exception as exc:
                closing.insert(0, f)
                self.fail(f"rank {self.plan.rank}: writing {f.shard.name}: {exc}")
        if self.error is not None:
            for f in closing:
                try:
                    f.writer.abort()
                except Exception:  # best effort: the save already failed, say why it did
                    pass
            # Only the files it made: one whose name it could not take is another's.
            made = [f.shard.name for f in self.files if f not in closing]
            Commit(self.plan.storage).abort(made, remove_directory=False)
            return WriteResult(error=self.error)
        return WriteResult(
            {f.shard.name: f.shard.size for f in self.files},
            chunk_records(
                self.placed,
                self.sums,
                [h and h.hexdigest() for h in self.identities],
            ),
            headers={f.shard.name: f.shard.header_checksum for f in self.files},
        )
