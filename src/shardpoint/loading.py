"""``shardpoint.load``: read a checkpoint in place into the live state, all or nothing.

Every check that needs no tensor bytes (commit marker, index, file sizes, shard
headers, keys, shapes, dtypes, optimizer parameter groups) runs before the first byte
is read. A stored chunk that lands whole in contiguous CPU memory is read straight
into it; otherwise (resharding, other devices, strided tensors) the rows needed are
read into new tensors, at most ``max_host_bytes`` of them at a time, each batch copied
into place as soon as its reads are verified.

A load that fails after all (a checksum, an unreadable file, a ``Stateful`` rejecting
its state) leaves the state as it was (``atomic=True``, the default): the old bytes of
every CPU tensor overwritten are kept in an undo copy, taken batch by batch just ahead
of the writes, and put back on failure (docs/reliability.md). Destinations on a GPU
need no undo copy: they are written only after every read is verified, which holds
their new tensors in host memory until then (``atomic=False`` bounds those too).
"""

from __future__ import annotations

import os
import threading
import warnings
from collections import deque
from collections.abc import Callable, Iterable, Iterator
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any

import torch

from . import dist
from .checkpoint_dir import CommittedCheckpoint, open_committed
from .defaults import DEFAULT_LOAD_HOST_BYTES, DEFAULT_THREADS
from .errors import CorruptCheckpointError, StateMismatchError, UnsupportedValueError
from .format.index import Chunk, TensorEntry, checksum
from .format.safetensors import DTYPES
from .gc_pause import gc_paused
from .shared_reads import agree, exchange, join_failed, plan_shared_reads
from .staging import SLOT_BYTES, Slot, StagingPool
from .storage.io_types import Segment
from .tensor_kinds import local_part
from .tensor_memory import Box, box_view, flat_bytes, overlap, plain, same_memory
from .tree import LoadMatch, match


@gc_paused()
def load(
    state: Any,
    path: str | os.PathLike[str],
    *,
    strict: bool = True,
    verify: bool = True,
    threads: int = DEFAULT_THREADS,
    storage_options: dict[str, Any] | None = None,
    atomic: bool = True,
    share_reads: bool = False,
    max_host_bytes: int = DEFAULT_LOAD_HOST_BYTES,
    undo_pool: StagingPool | None = None,
) -> None:
    """Load the checkpoint at ``path`` (a directory or an object-store URL) into
    ``state`` in place, all or nothing.

    Tensors in ``state`` are filled in place; ``Stateful`` objects get
    ``load_state_dict`` with their stored state; other values in mappings and lists are
    replaced. With ``strict``, keys missing from the checkpoint or not in ``state``
    raise ``StateMismatchError``; shapes and dtypes must always agree. ``verify``
    checks every chunk's checksum.

    If the load fails, ``state`` is exactly as it was. That costs an undo copy of the
    CPU tensors loaded in place (their size in memory, and time to fill it:
    docs/benchmarks.md); ``atomic=False`` skips it, and a failed load then leaves
    those tensors partly overwritten.

    ``max_host_bytes`` bounds the new tensors a load holds at once for what it cannot
    read in place (a reshard, a transposed or other strided destination): about that
    many, on top of the undo copy. Atomic loads onto a GPU are the exception: they hold
    all of theirs until every read is verified (pass ``atomic=False`` to bound them).

    ``undo_pool``: a staging pool (``AsyncSaver.pool``) to take the undo copy into
    instead of fresh memory; its slots go back to it when the load returns, warm for
    the next background save. ``CheckpointManager.restore`` passes its saver's.

    ``share_reads`` (under ``torch.distributed``; every rank must call ``load`` with
    it): a stored chunk several ranks need — DDP parameters, HSDP replicas of a shard,
    a chunk a resharded cut splits between ranks — is read from storage once, by one of
    them, and each of the others is sent its piece (``shared_reads.py``).

    >>> import torch, shardpoint
    >>> state = {"w": torch.zeros(2), "step": 0}
    >>> shardpoint.load(state, "/tmp/sp-doc/ckpt")
    >>> state["step"], state["w"].tolist()
    (7, [1.0, 1.0])
    """
    if max_host_bytes < 1:
        raise ValueError(f"max_host_bytes must be a positive number of bytes, not {max_host_bytes}")
    share = share_reads and dist.is_distributed() and not dist.in_solo()
    where = str(path)
    try:
        ckpt, m, reads, loaded = _prepare(state, path, storage_options, strict)
        where = ckpt.where
    except Exception as exc:
        if not share:
            raise
        join_failed(exc, where)  # every rank learns, every rank raises
        raise
    shared = plan_shared_reads(reads, None, where) if share else None
    try:
        if shared is not None and shared.error is not None:
            raise shared.error
        undo = reads.run(
            threads=threads,
            verify=verify,
            atomic=atomic,
            max_host_bytes=max_host_bytes,
            undo_pool=undo_pool,
        )
    except Exception as exc:
        if shared is None:
            raise
        agree(exc, where)  # every rank learns, every rank raises
        raise
    try:
        if shared is not None:
            agree(None, where)  # every rank's reads are verified: exchange
            exchange(shared, undo)
        m.finish(lambda name: loaded[name])
    except BaseException:
        if not atomic:
            raise
        undo.restore()
        for give_back in reversed(m.undo):
            try:
                give_back()
            except Exception as exc:  # the original error is the one to raise
                warnings.warn(
                    f"{ckpt.where}: the load failed and a Stateful could not take its "
                    f"earlier state back ({exc}); rebuild it before going on",
                    stacklevel=2,
                )
        raise
    finally:
        undo.release()


def _prepare(
    state: Any,
    path: str | os.PathLike[str],
    storage_options: dict[str, Any] | None,
    strict: bool,
) -> tuple[CommittedCheckpoint, LoadMatch, ReadPlan, dict[str, torch.Tensor]]:
    """Open, match and check everything that needs no tensor byte; plan the reads."""
    # Files are checked as they are read: under torch.distributed a rank reads only some.
    ckpt = open_committed(path, storage_options, every_file=False)
    m = match(state, ckpt.index.tree, ckpt.fragment_value)
    problems = []
    if strict and m.missing:
        problems.append(f"missing from the checkpoint: {_some(m.missing)}")
    if strict and m.unexpected:
        problems.append(f"in the checkpoint but not in the state: {_some(m.unexpected)}")
    differ = []
    parts = []
    for name, dest in m.destinations.items():
        entry = ckpt.index.resolve(name)
        part, shape, offsets = local_part(plain(dest), name)  # shape: global (a rank's own
        parts.append((name, part, offsets))  # in dist.solo())
        if shape != entry.shape or dest.dtype != DTYPES[entry.dtype]:
            differ.append(
                f"{name!r}: checkpoint has {entry.dtype}{list(entry.shape)}, state has "
                f"{dest.dtype}{list(shape)}"
            )
    # A wrong model can mismatch every one of 100,000 tensors: name the first few.
    for found in (differ, m.mismatched):
        more = f" (+{len(found) - _LISTED} more like it)" if len(found) > _LISTED else ""
        problems.extend(found[:_LISTED])
        if more:
            problems[-1] += more
    if problems:
        raise StateMismatchError(
            f"{ckpt.where}: checkpoint does not fit the state: "
            + "; ".join(problems)
            + ". Build the state with the same model/optimizer configuration, or pass "
            "strict=False to skip missing/unexpected keys."
        )
    reads = ReadPlan(ckpt)
    for name, part, offsets in parts:
        reads.into_region(name, part, offsets, live=True)
    loaded = {name: reads.fresh(name) for name in m.materialize}
    return ckpt, m, reads, loaded


_LISTED = 10  # problems of one kind an error message names


def _some(keys: list[str], limit: int = _LISTED) -> str:
    more = f" (+{len(keys) - limit} more)" if len(keys) > limit else ""
    return ", ".join(repr(k) for k in keys[:limit]) + more


@dataclass
class _Region:
    """A box of a stored entry and the tensors (same shape) it must end up in."""

    offsets: tuple[int, ...]
    tensor: torch.Tensor  # the first destination: a rank's local part, any device/layout
    live: bool  # part of the caller's state (restored if the load fails), not a new tensor
    copies: list[torch.Tensor] = field(default_factory=list)


@dataclass(slots=True)
class _Pending:
    """A read in flight: which checksum blocks it covers, and where its bytes go after."""

    entry: TensorEntry
    chunk: Chunk
    first_block: int
    blocks: int
    copy: tuple[torch.Tensor, torch.Tensor] | None  # (destination box, source box)
    live: bool  # the bytes land in (or are copied into) the caller's state


@dataclass(slots=True)
class _Batch:
    """Reads that go to the reader together (file -> segments), and how many bytes of
    new tensors they fill that are placed as soon as the batch is verified."""

    segments: dict[str, list[Segment]] = field(default_factory=dict)
    staged: int = 0


@dataclass(slots=True)
class ChunkRows:
    """Rows ``[a, b)`` of a stored chunk, read into a tensor of their own (a region
    needs only some rows, or several ranks need them: shared reads); ``tensor`` holds
    chunk rows ``first, first + 1, ...`` once planned."""

    entry: TensorEntry
    chunk: Chunk
    a: int
    b: int
    tensor: torch.Tensor | None = None
    first: int = 0

    def plan(self, verify: bool) -> tuple[Segment, _Pending]:
        """The read of these rows into a new tensor, and the checksum blocks it covers."""
        chunk, a, b = self.chunk, self.a, self.b
        first = last = 0
        if verify:  # whole checksum blocks
            first, last = a // chunk.block_rows, -(-b // chunk.block_rows)
            a, b = first * chunk.block_rows, min(last * chunk.block_rows, chunk.rows)
        shape = (b - a, *chunk.shape[1:]) if chunk.shape else ()
        self.tensor, self.first = torch.empty(shape, dtype=DTYPES[self.entry.dtype]), a
        segment = Segment(chunk.begin + a * chunk.row_bytes, flat_bytes(self.tensor))
        return segment, _Pending(self.entry, chunk, first, last - first, None, False)

    @property
    def origin(self) -> tuple[int, ...]:
        """Where ``tensor``'s first element sits in the global tensor."""
        offsets = self.chunk.offsets
        return (offsets[0] + self.first, *offsets[1:]) if offsets else ()


class ReadPlan:
    """Collects destination regions of stored entries, then reads and verifies them.

    A region that is exactly a stored chunk and lands in contiguous CPU memory is read
    straight into it. Otherwise (resharding, other devices) only the rows of each
    overlapping chunk that the region needs are read, widened to whole checksum
    blocks when verifying, and copied into place.
    """

    def __init__(self, ckpt: CommittedCheckpoint) -> None:
        self.ckpt = ckpt
        self.regions: dict[str, list[_Region]] = {}
        self.fresh_tensors: dict[str, torch.Tensor] = {}
        # Shared reads (shared_reads.py): pieces another rank reads for this one, as
        # (id(region), chunk offsets), and chunk rows this rank reads for several.
        self._skipped: set[tuple[int, tuple[int, ...]]] = set()
        self._rows: list[ChunkRows] = []

    def into(self, name: str, dest: torch.Tensor, *, live: bool = False) -> None:
        """Fill ``dest`` (a plain tensor or a DTensor's local shard) with entry ``name``;
        ``live``: it belongs to the caller's state, restored if ``run`` fails."""
        part, _, offsets = local_part(plain(dest), name)
        self.into_region(name, part, offsets, live=live)

    def into_region(
        self, name: str, part: torch.Tensor, offsets: tuple[int, ...], *, live: bool = False
    ) -> None:
        """Fill ``part`` with the box of entry ``name`` that starts at ``offsets``."""
        entry = self.ckpt.index.resolve(name)
        if part.is_conj() or part.is_neg():  # its bytes are not the values it shows
            raise UnsupportedValueError(
                f"{self.ckpt.where}: cannot load {name!r} into a lazy conjugate or negative "
                "view (.conj(), .imag of one); load into the tensor it views instead"
            )
        regions = self.regions.setdefault(entry.name, [])
        for r in regions:
            if r.offsets == offsets and tuple(r.tensor.shape) == tuple(part.shape):
                if not same_memory(r.tensor, part):
                    r.copies.append(part)
                    r.live = r.live or live
                return
        regions.append(_Region(offsets, part, live))

    def fresh(self, name: str) -> torch.Tensor:
        """A new CPU tensor holding all of entry ``name``; aliases share one tensor."""
        entry = self.ckpt.index.resolve(name)
        if entry.name not in self.fresh_tensors:
            t = torch.empty(entry.shape, dtype=DTYPES[entry.dtype])
            self.fresh_tensors[entry.name] = t
            self.into(entry.name, t)
        return self.fresh_tensors[entry.name]

    def skip(self, regions: list[_Region], chunk: Chunk) -> None:
        """Leave what ``chunk`` holds of ``regions`` unread: it arrives some other way."""
        self._skipped.update((id(r), chunk.offsets) for r in regions)

    def read_rows(self, entry: TensorEntry, chunk: Chunk, a: int, b: int) -> ChunkRows:
        """Read rows ``[a, b)`` of ``chunk`` too (widened to whole checksum blocks when
        verifying), into a new tensor: ``run`` fills the returned handle."""
        rows = ChunkRows(entry, chunk, a, b)
        self._rows.append(rows)
        return rows

    def rows_in(self, entry: TensorEntry, chunk: Chunk, tensor: torch.Tensor) -> ChunkRows:
        """All of ``chunk``, as a region exactly its size reads it into ``tensor``."""
        return ChunkRows(entry, chunk, 0, chunk.rows, tensor, 0)

    def run(
        self,
        *,
        threads: int,
        verify: bool,
        direct: bool = True,
        atomic: bool = False,
        max_host_bytes: int = DEFAULT_LOAD_HOST_BYTES,
        undo_pool: StagingPool | None = None,
    ) -> Undo:
        """Read, verify and place every region. With ``atomic``, on any error the live
        regions are as before, and on success the returned ``Undo`` can still put them
        back; without, live regions are written as their reads land.

        Reads start as soon as their batch is planned: one reader thread takes the
        batches in order while this thread plans the next ones. What cannot be read in
        place is read into new tensors, at most ``max_host_bytes`` of them at a time
        (plus one piece): each batch is copied into place once its reads are verified
        and its tensors dropped before more are planned. Live destinations off the CPU
        are the exception under ``atomic``: they are written only once every read is
        verified, so their new tensors wait until then."""
        pending: dict[int, _Pending] = {}  # id(segment) -> what it holds

        def verify_segment(segment: Segment) -> None:
            _verify_blocks(self.ckpt, pending[id(segment)], segment)

        def in_place(batch: _Batch) -> list[torch.Tensor]:
            return [
                s.data
                for ss in batch.segments.values()
                for s in ss
                if pending[id(s)].live and pending[id(s)].copy is None
            ]

        def deferred(p: _Pending) -> bool:  # written only after every read is verified
            assert p.copy is not None
            return atomic and p.live and not p.copy[0].is_cpu

        later: list[_Pending] = []  # deferred copies, made once every read is verified

        def place(batch: _Batch) -> None:
            """Copy a verified batch's new tensors into place and let them go. Its
            segments leave ``pending`` here: once the batch is dropped, their ids may
            be those of segments planned later."""
            with torch.no_grad():
                for s in (s for ss in batch.segments.values() for s in ss):
                    p = pending.pop(id(s))
                    if p.copy is None:
                        continue
                    if deferred(p):
                        later.append(p)
                        continue
                    if p.live:
                        undo.save([p.copy[0]])
                    p.copy[0].copy_(p.copy[1])

        undo = Undo(atomic, undo_pool)
        # The undo copy of a batch runs while the batch before it is read, in pieces on
        # up to half the cores: filling fresh memory is what it costs, not the copy,
        # and the other half keep the reads and checksums going.
        workers = max(1, min(threads, (os.cpu_count() or 2) // 2))
        # Two batches of new tensors at a time, one being read while the next is
        # planned: each ends by half the budget, made of pieces of an eighth of it.
        piece_bytes = max(1, max_host_bytes // 8)
        reads: deque[tuple[Future, _Batch]] = deque()
        staged = 0  # bytes of new tensors planned and not yet placed (deferred ones aside)
        try:
            with (
                ThreadPoolExecutor(workers, thread_name_prefix="shardpoint-undo") as saver,
                ThreadPoolExecutor(1, thread_name_prefix="shardpoint-reader") as reader,
            ):

                def read(batch: _Batch) -> None:
                    ahead = undo.save_ahead(saver, in_place(batch))

                    def job() -> None:
                        for piece in ahead:  # a batch is overwritten only once it is saved
                            piece.result()
                        self.ckpt.storage.read_ranges(
                            batch.segments,
                            threads=threads,
                            direct=direct,
                            on_segment=verify_segment if verify else None,
                        )

                    reads.append((reader.submit(job), batch))

                def settle_oldest() -> None:
                    nonlocal staged
                    done, batch = reads.popleft()
                    done.result()
                    place(batch)
                    staged -= batch.staged

                try:
                    for batch in self._batches(pending, verify, piece_bytes, deferred):
                        read(batch)
                        staged += batch.staged
                        # A read that failed early stops the planning; new tensors
                        # beyond the budget wait for the batches before them.
                        while reads and (reads[0][0].done() or staged > batch.staged):
                            settle_oldest()
                    while reads:
                        settle_oldest()
                except BaseException:
                    for later, _ in reads:
                        later.cancel()
                    raise
            # Leaving the pools waited for every read and undo copy still running:
            # nothing lands after the undo below.
        except BaseException:
            undo.restore()
            undo.release()
            raise
        try:
            with torch.no_grad():  # every read is verified: the rest into place
                for p in later:
                    p.copy[0].copy_(p.copy[1])  # off the CPU: no undo copy
                for regions in self.regions.values():
                    for r in regions:
                        for dest in r.copies:
                            if r.live:
                                undo.save([dest])
                            dest.copy_(r.tensor)
        except BaseException:
            undo.restore()
            undo.release()
            raise
        return undo

    def _batches(
        self,
        pending: dict[int, _Pending],
        verify: bool,
        piece_bytes: int,
        deferred: Callable[[_Pending], bool],
    ) -> Iterator[_Batch]:
        """The reads, planned into batches as they fill; ``pending`` gets what each
        segment holds. The first batch is FIRST_UNDO_BATCH_BYTES (its undo copy is taken
        before any read), each next one twice the last; a batch also ends once its new
        tensors reach three pieces (so it holds at most four)."""
        batch = _Batch()
        batch_bytes, batches = 0, 0

        def reads() -> Iterator[tuple[Segment, _Pending]]:
            skipped = self._skipped
            entries, shardings = self.ckpt.index.entries, self.ckpt.index.shardings
            for name, regions in self.regions.items():
                entry = entries[name]
                listed = None if name in shardings else entry.chunks  # the index holds them
                for region in regions:
                    chunks = listed
                    if chunks is None:  # the writers' fragments hold them
                        chunks = self.ckpt.chunks(entry, region.offsets, region.tensor.shape)
                    for chunk in chunks:
                        if skipped and (id(region), chunk.offsets) in skipped:
                            continue
                        yield from self._plan_chunk(entry, chunk, region, verify, piece_bytes)
            for rows in self._rows:
                yield rows.plan(verify)

        for segment, p in reads():
            if p.chunk.file not in batch.segments:  # checked once per file
                self.ckpt.check_header(p.chunk.file)
            batch.segments.setdefault(p.chunk.file, []).append(segment)
            size = segment.end - segment.offset
            batch_bytes += size
            if p.copy is not None and not deferred(p):
                batch.staged += size
            pending[id(segment)] = p
            doublings = min(batches, 5)  # 8 MiB << 5: UNDO_BATCH_BYTES
            full = batch_bytes >= min(UNDO_BATCH_BYTES, FIRST_UNDO_BATCH_BYTES << doublings)
            if full or batch.staged >= 3 * piece_bytes:
                yield batch
                batch, batch_bytes, batches = _Batch(), 0, batches + 1
        if batch.segments:
            yield batch

    def _plan_chunk(
        self, entry: TensorEntry, chunk: Chunk, region: _Region, verify: bool, piece_bytes: int
    ) -> Iterable[tuple[Segment, _Pending]]:
        """The reads of what ``region`` needs of ``chunk``: straight into its memory if
        it can, else into new tensors of at most about ``piece_bytes`` each (whole
        checksum blocks), copied into place once verified. (A list where there is one
        read: this runs once per stored chunk, and 100,000 generators cost.)"""
        t = region.tensor
        live = region.live
        blocks = len(chunk.checksums)
        if chunk.offsets == region.offsets and chunk.shape == t.shape:  # the common case
            if t.is_cpu and t.is_contiguous():
                return [
                    (
                        Segment(chunk.begin, flat_bytes(t)),
                        _Pending(entry, chunk, 0, blocks, None, live),
                    )
                ]
        box = overlap(region.offsets, tuple(t.shape), chunk.offsets, chunk.shape)
        if box is None:
            return []  # no overlap (or an empty tensor: nothing to read)
        dst = box_view(t, region.offsets, box)
        if dst.shape == chunk.shape and dst.is_cpu and dst.is_contiguous():  # a row shard
            return [
                (
                    Segment(chunk.begin, flat_bytes(dst)),
                    _Pending(entry, chunk, 0, blocks, None, live),
                )
            ]
        if not chunk.shape:  # a 0-d chunk into a strided or GPU destination
            tmp = torch.empty((), dtype=DTYPES[entry.dtype])
            return [
                (
                    Segment(chunk.begin, flat_bytes(tmp)),
                    _Pending(entry, chunk, 0, blocks, (dst, tmp), live),
                )
            ]
        return self._pieces(entry, chunk, region, box, verify, piece_bytes)

    @staticmethod
    def _pieces(
        entry: TensorEntry,
        chunk: Chunk,
        region: _Region,
        box: Box,
        verify: bool,
        piece_bytes: int,
    ) -> Iterator[tuple[Segment, _Pending]]:
        """Rows [a, b) of the chunk are needed: read in pieces of whole checksum blocks,
        each allocated only when the batches reach it, so that no load holds more than
        its host-memory budget in new tensors."""
        t, live = region.tensor, region.live
        lo, hi = box
        a, b = lo[0] - chunk.offsets[0], hi[0] - chunk.offsets[0]
        step = chunk.block_rows * max(1, piece_bytes // max(chunk.block_rows * chunk.row_bytes, 1))
        start = a
        while start < b:
            # Piece boundaries on block boundaries: no block is read (and hashed) twice.
            end = min(b, (start // chunk.block_rows) * chunk.block_rows + step)
            rows = ChunkRows(entry, chunk, start, end)
            segment, p = rows.plan(verify)
            piece_lo = (lo[0] + start - a, *lo[1:])
            piece_hi = (lo[0] + end - a, *hi[1:])
            piece = (piece_lo, piece_hi)
            p.copy = (box_view(t, region.offsets, piece), box_view(rows.tensor, rows.origin, piece))
            p.live = live
            yield segment, p
            start = end


# Reads go in batches of up to this many bytes, each one's undo copy taken while the
# batch before it is read (docs/benchmarks.md measures what the undo copy costs); the
# first is FIRST_UNDO_BATCH_BYTES (its undo copy is taken before any read), each next
# one twice the last.
UNDO_BATCH_BYTES = 256 * 1024 * 1024
FIRST_UNDO_BATCH_BYTES = 8 * 1024 * 1024
UNDO_PIECE_BYTES = 32 * 1024 * 1024


class Undo:
    """The old contents of live tensors a load overwrote, to put back if it fails.

    Only CPU tensors are kept here (an undo copy of GPU memory would double it); a GPU
    destination is written only after every read is verified (docs/reliability.md).

    The copies go into slots of a staging pool when one is given (``undo_pool``): a
    background saver's pool is memory its first save would fault in anyway, so the
    copy costs the load no fresh memory and that save none either. Without one, fresh
    memory, as ``clone()`` would take.
    """

    def __init__(self, enabled: bool, pool: StagingPool | None = None) -> None:
        self.enabled = enabled
        # (live tensors, their old bytes): one saved tensor of the same shape, or for
        # flat byte views the parts of one or more buffers that hold them back to back.
        self._saved: list[tuple[list[torch.Tensor], list[torch.Tensor]]] = []
        self._pool = pool
        self._borrowed: list[Slot] = []
        self._filling: dict[int, tuple[torch.Tensor | None, int]] = {}  # thread -> slot, bytes used
        self._lock = threading.Lock()

    def save(self, tensors: list[torch.Tensor]) -> None:
        if not self.enabled:
            return
        for t in tensors:
            if not (t.is_cpu and t.numel()):
                continue
            if self._pool is not None and t.is_contiguous():
                self._save_flat([flat_bytes(t)])
            else:
                self._saved.append(([t], [t.clone(memory_format=torch.preserve_format)]))

    def _save_flat(self, views: list[torch.Tensor]) -> None:
        """Keep the bytes of flat uint8 ``views``."""
        if self._pool is None:
            copy = torch.cat(views) if len(views) > 1 else views[0].clone()
            self._saved.append((views, [copy]))
            return
        parts = self._take(sum(v.numel() for v in views))
        with torch.no_grad():
            _scatter(views, parts)
        self._saved.append((views, parts))

    def _take(self, nbytes: int) -> list[torch.Tensor]:
        """Buffers holding ``nbytes`` in all, from the pool's slots: free ones, else new
        ones faulted in on this (undo) thread, else, at the pool's capacity, fresh
        memory. Each thread fills a slot of its own, so none waits for another's."""
        assert self._pool is not None
        parts = []
        slot, used = self._filling.get(threading.get_ident(), (None, SLOT_BYTES))
        while nbytes:
            if used == SLOT_BYTES:
                new = self._pool.acquire_or_grow()
                if new is None:
                    parts.append(torch.empty(nbytes, dtype=torch.uint8))
                    break
                with self._lock:
                    self._borrowed.append(new)
                slot, used = new.data, 0
            n = min(nbytes, SLOT_BYTES - used)
            parts.append(slot[used : used + n])
            used, nbytes = used + n, nbytes - n
        self._filling[threading.get_ident()] = (slot, used)
        return parts

    def save_ahead(self, pool: ThreadPoolExecutor, tensors: list[torch.Tensor]) -> list[Future]:
        """Save ``tensors`` (flat byte views) on ``pool``, in tasks of about
        UNDO_PIECE_BYTES: large tensors in pieces, small ones together."""
        if not self.enabled:
            return []
        tasks: list[Future] = []
        batch: list[torch.Tensor] = []
        size = 0
        for t in tensors:
            pieces = [t] if t.numel() <= UNDO_PIECE_BYTES else t.split(UNDO_PIECE_BYTES)
            for piece in pieces:
                batch.append(piece)
                size += piece.numel()
                if size >= UNDO_PIECE_BYTES:
                    tasks.append(pool.submit(self._save_flat, batch))
                    batch, size = [], 0
        if batch:
            tasks.append(pool.submit(self._save_flat, batch))
        return tasks

    def restore(self) -> None:
        with torch.no_grad():
            for live, old in reversed(self._saved):
                if len(live) == 1 and len(old) == 1 and live[0].shape == old[0].shape:
                    live[0].copy_(old[0])
                    continue
                _scatter(old, live)

    def release(self) -> None:
        """Hand the borrowed slots back to their pool: the load is over."""
        self._saved.clear()
        if self._pool is not None:
            for slot in self._borrowed:
                self._pool.release(slot)
        self._borrowed.clear()
        self._filling.clear()


def _scatter(sources: list[torch.Tensor], targets: list[torch.Tensor]) -> None:
    """Copy the bytes of flat ``sources`` back to back into flat ``targets``."""
    si = ti = s_at = t_at = 0
    while si < len(sources) and ti < len(targets):
        src, dst = sources[si], targets[ti]
        n = min(src.numel() - s_at, dst.numel() - t_at)
        dst[t_at : t_at + n].copy_(src[s_at : s_at + n])
        s_at, t_at = s_at + n, t_at + n
        if s_at == src.numel():
            si, s_at = si + 1, 0
        if t_at == dst.numel():
            ti, t_at = ti + 1, 0


def _verify_blocks(ckpt: CommittedCheckpoint, p: _Pending, segment: Segment) -> None:
    data = memoryview(segment.array)
    step = p.chunk.block_rows * p.chunk.row_bytes
    for i in range(p.blocks):
        block = p.first_block + i
        if checksum(data[i * step : (i + 1) * step]) != p.chunk.checksums[block]:
            lo, hi = p.chunk.block_span(block)
            raise CorruptCheckpointError(
                f"{ckpt.storage.location(p.chunk.file)}: checksum mismatch in {p.entry.name!r} "
                f"(bytes {lo}-{hi}); the file is corrupt, load an earlier checkpoint"
            )
