"""Every stored byte a load needs is read from storage once (``load(..., share_reads=True)``).

Several ranks need the same stored chunk when they hold replicas (DDP parameters on
every rank, HSDP replicas of a shard) and when they are cut differently than the ranks
that saved (resharding: FSDP 4 -> 3 ranks, tensor-parallel column shards 4 -> 3). Each
of them reading it alone makes storage serve the chunk once per rank that needs any of
it — a column slice of a chunk costs whole rows, since checksums cover whole rows.

With sharing the unit is the stored chunk. Every rank lists the pieces it needs (a
chunk and the box of it) and sends each to the chunk's coordinator (the rank its key
hashes to); each coordinator has each of its chunks that several ranks need read and
verified by one of them — the least loaded by the coordinator's count, so the reading
is split — once, covering
the rows all of them need, and each piece is sent to its rank over
``torch.distributed`` after every rank reported its reads verified (a small
all-reduce). Planning is spread like the reading: no rank learns every rank's needs.
Every rank must call ``load`` with it, so it is opt-in; ``CheckpointManager.restore``
uses it when bytes may come from the object store.

The exchange runs on the CPU (gloo) group: a piece for a GPU destination arrives in a
host buffer and is copied in, after every rank's reads verified, like any read for a
GPU destination.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any

import torch
import xxhash

from . import dist
from .errors import CheckpointError
from .format.safetensors import itemsize
from .tensor_memory import Box, box_view, flat_bytes, overlap, same_memory

# The read plan, its regions, the rows read for others and the undo copy are
# loading.py's (ReadPlan, Region, ChunkRows, Undo); typed Any here so that this module
# does not import the one that uses it.
ReadPlan = Any
Region = Any
ChunkRows = Any
Undo = Any


@dataclass
class _Source:
    """Rows of one stored chunk this rank reads, and the boxes of them to hand out."""

    rows: ChunkRows  # .tensor holds chunk rows [.first, ...) once the reads ran
    sends: list[tuple[int, int, Box]] = field(default_factory=list)  # tag, rank, box
    own: list[tuple[Box, list[Region]]] = field(default_factory=list)  # this rank's pieces


@dataclass
class SharedReads:
    """This rank's part of the exchange, in the agreed order (tags number the transfers)."""

    sources: list[_Source] = field(default_factory=list)
    receives: list[tuple[int, int, Box, list[Region]]] = field(default_factory=list)
    # Taking this rank's part failed after every rank agreed on the plan: ``load``
    # raises it in place of its reads, into the agreement every rank reaches after them.
    error: Exception | None = None


def agree(error: BaseException | None, where: str) -> None:
    """Whether any rank failed (one small all-reduce; the messages travel only then).
    Raises on every rank if any rank failed: its own error on the failing rank, a
    ``CheckpointError`` naming it elsewhere."""
    first = dist.first_error(f"rank {dist.rank()}: {error}" if error else None)
    _raise_if_failed(error, [first], where)


def _raise_if_failed(error: BaseException | None, errors: list[str | None], where: str) -> None:
    if error is not None:
        raise error
    failed = [e for e in errors if e]
    if failed:
        raise CheckpointError(f"{where}: another rank could not load: {failed[0]}")


def join_failed(error: BaseException, where: str) -> None:
    """For a rank that cannot even start a shared load (no copy of the checkpoint on
    its node): take part in the load's first collective, so that every rank raises."""
    plan_shared_reads(None, error, where)


def plan_shared_reads(
    reads: ReadPlan | None, error: BaseException | None, where: str
) -> SharedReads:
    """Agree with every rank on who reads each stored chunk several ranks need, and
    take the pieces other ranks read for this one out of ``reads``. Raises on every
    rank if any rank failed to prepare its load (``error``, and no ``reads``) or to
    plan its share.

    No rank plans for all: each stored chunk has a coordinator, the rank its key hashes
    to. Every rank sends each coordinator the pieces it needs of that coordinator's
    chunks, each coordinator picks the readers of its chunks, and tells each rank what
    it reads and hands out and what it receives from whom (two all-to-alls). What a rank
    sends and receives is its own pieces and, as a coordinator, every rank's pieces of
    its share of the chunks (under DDP: its chunks x the ranks), never every rank's
    pieces of every chunk; and one integer per rank (the sizes)."""
    pieces: dict[tuple[str, Box], list[Region]] = {}
    stored: dict[str, Any] = {}
    wanted: list[list[Any]] = []
    if reads is not None:
        try:  # finding the chunks reads fragments: an error joins the agreement below
            pieces, stored, wanted = _pieces(reads)
        except Exception as exc:
            error = exc
    agree(error, where)
    me, world = dist.rank(), dist.world_size()
    asks: list[list[Any]] = [[] for _ in range(world)]
    for item in wanted:
        asks[coordinator(item[0], world)].append(item)
    told = dist.all_to_all_json(asks)
    failure: Exception | None = None
    try:
        answers = [[None, part] for part in assign_readers(told, me)]
    except Exception as exc:
        failure = exc
        answers = [[f"rank {me}: {exc}", None]] * world
    replies = dist.all_to_all_json(answers)
    if failure is not None:
        raise failure
    failed = next((e for e, _ in replies if e is not None), None)
    if failed is not None:
        raise CheckpointError(f"{where}: another rank could not plan the shared reads: {failed}")
    part = [item for _, items in replies for item in items]
    assert reads is not None or not part
    try:
        return _take_part(part, reads, pieces, stored, me)
    except Exception as exc:  # every other rank goes on to its reads: join them there
        return SharedReads(error=exc)


def _take_part(
    part: list[list[Any]],
    reads: ReadPlan,
    pieces: dict[tuple[str, Box], list[Region]],
    stored: dict[str, Any],
    me: int,
) -> SharedReads:
    """This rank's part of the plan, as transfers, its pieces that arrive from other
    ranks taken out of ``reads`` and the rows it reads for others added to them."""
    plan = SharedReads()
    for item in part:
        if item[0] == "receive":
            _, tag, key, lo, hi, reader = item
            box = (tuple(lo), tuple(hi))
            regions = pieces[key, box]
            reads.skip(regions, stored[key][1])
            plan.receives.append((tag, reader, box, regions))
            continue
        _, key, lo, hi, sends = item
        entry, chunk = stored[key]
        source = _Source(None)
        for tag, rank, blo, bhi in sends:
            box = (tuple(blo), tuple(bhi))
            if rank != me:
                source.sends.append((tag, rank, box))
                continue
            regions = pieces[key, box]
            whole = box == (chunk.offsets, tuple(o + n for o, n in zip(chunk.offsets, chunk.shape)))
            if source.rows is None and lo == blo and hi == bhi and whole:
                # Nobody needs more than the whole chunk, which lands whole in one of this
                # rank's regions: where that is contiguous it is read in place, as without
                # sharing, and sent from there.
                for r in regions:
                    into = box_view(r.tensor, r.offsets, box)
                    if into.device.type == "cpu" and into.is_contiguous():
                        source.rows = reads.rows_in(entry, chunk, into)
                        regions = [other for other in regions if other is not r]
                        break
            reads.skip(regions, chunk)
            source.own.append((box, regions))
        if source.rows is None:
            rows = (lo[0] - chunk.offsets[0], hi[0] - chunk.offsets[0]) if lo else (0, 1)
            source.rows = reads.read_rows(entry, chunk, *rows)
        plan.sources.append(source)
    return plan


def _pieces(
    reads: ReadPlan,
) -> tuple[dict[tuple[str, Box], list[Region]], dict[str, Any], list[list[Any]]]:
    """This rank's pieces: (chunk key, box) -> the regions it fills; chunk key ->
    (entry, chunk); and what it tells the chunks' coordinators (``[chunk key, lo, hi,
    bytes]``, in first-seen order)."""
    pieces: dict[tuple[str, Box], list[Region]] = {}
    stored: dict[str, Any] = {}
    wanted: list[list[Any]] = []
    for name, regions in reads.regions.items():
        entry = reads.ckpt.index.entries[name]
        size = itemsize(entry.dtype)
        for r in regions:
            shape = tuple(r.tensor.shape)
            for chunk in reads.ckpt.chunks(entry, r.offsets, shape):
                box = overlap(r.offsets, shape, chunk.offsets, chunk.shape)
                if box is None:
                    continue  # no overlap (or empty: nothing to read)
                key = f"{name}|{list(chunk.offsets)}"
                if (key, box) not in pieces:
                    pieces[key, box] = []
                    lo, hi = box
                    nbytes = math.prod(b - a for a, b in zip(lo, hi)) * size
                    wanted.append([key, list(lo), list(hi), nbytes])
                    stored[key] = (entry, chunk)
                pieces[key, box].append(r)
    return pieces, stored, wanted


def coordinator(key: str, world: int) -> int:
    """The rank that assigns the reader of the stored chunk ``key``: chunks spread
    evenly over the ranks, and every rank finds a chunk's coordinator alone."""
    return xxhash.xxh3_64_intdigest(key.encode()) % world


def assign_readers(told: list[list[list[Any]]], me: int) -> list[list[Any]]:
    """Coordinator ``me``'s plan for its chunks. ``told[r]``: the pieces rank ``r`` needs
    of them (``[chunk key, lo, hi, bytes]``). Each chunk several ranks need is read by
    the least loaded of them (by what this coordinator gave them so far), ties broken
    in a rotation that starts at a different rank per coordinator and chunk, so the
    reading is split even when each coordinator has a chunk or two.

    Returns each rank's part: ``["read", chunk key, lo, hi, [[tag, rank, lo, hi], ...]]``
    where it reads (the rows of the box ``[lo, hi)`` bounding every piece, and the
    pieces to hand out, its own among them), ``["receive", tag, chunk key, lo, hi,
    reader]`` where it receives. A tag numbers the boxes one reader hands out: the
    coordinator's count for that reader, times the ranks, plus the coordinator, so tags
    from different coordinators never meet."""
    world = len(told)
    # chunk key -> [[lo, hi, ranks needing that box], ...] (usually one box: replicas)
    needs: dict[str, list[list[Any]]] = {}
    sizes: dict[str, int] = {}  # chunk key -> bytes of its first box
    for rank, items in enumerate(told):
        for key, lo, hi, nbytes in items:
            boxes = needs.get(key)
            if boxes is None:
                needs[key] = [[lo, hi, [rank]]]
                sizes[key] = nbytes
                continue
            for box in boxes:
                if box[0] == lo and box[1] == hi:
                    box[2].append(rank)  # ranks come in order: the list stays sorted
                    break
            else:
                boxes.append([lo, hi, [rank]])
    load: dict[int, int] = {}
    served: dict[int, int] = {}  # boxes each reader hands out so far: its next count
    parts: list[list[Any]] = [[] for _ in range(world)]
    for n, (key, boxes) in enumerate(needs.items()):  # in the order met: the same on a rerun
        nbytes = sizes[key]
        if len(boxes) == 1:
            lo, hi, ranks = boxes[0]
            if len(ranks) < 2:
                continue
        else:
            first = math.prod(b - a for a, b in zip(boxes[0][0], boxes[0][1]))
            boxes.sort()
            ranks = sorted({r for box in boxes for r in box[2]})
            lo = [min(d) for d in zip(*(box[0] for box in boxes))]
            hi = [max(d) for d in zip(*(box[1] for box in boxes))]
            nbytes = nbytes // first * math.prod(b - a for a, b in zip(lo, hi))
        turn = (me + n) % len(ranks)
        reader = min(ranks[turn:] + ranks[:turn], key=lambda r: load.get(r, 0))
        load[reader] = load.get(reader, 0) + nbytes
        sends = []
        for blo, bhi, rs in boxes:
            # A rank receives a box once: the reader's count of boxes tells its messages
            # apart.
            tag = served.get(reader, 0) * world + me
            served[reader] = served.get(reader, 0) + 1
            if _TAGS + tag > _MAX_TAG:
                raise ValueError(f"more pieces than tags: {key!r} needs tag {tag}")
            for r in rs:
                sends.append([tag, r, blo, bhi])
                if r != reader:
                    parts[r].append(["receive", tag, key, blo, bhi, reader])
        parts[reader].append(["read", key, lo, hi, sends])
    return parts


def exchange(plan: SharedReads, undo: Undo) -> None:
    """Send the pieces this rank read to the ranks that need them and receive the
    others, then put them in place (with an undo copy of live ones first). A piece
    whose place is contiguous CPU memory is received straight into it; others (column
    slices, GPU destinations) go through a host buffer, so a rank holds extra memory
    only for the pieces that need one."""
    pending = []
    arrived: list[tuple[tuple[int, ...], list[Region], torch.Tensor]] = []
    for tag, reader, box, regions in plan.receives:
        first = regions[0]
        into = box_view(first.tensor, first.offsets, box)
        if into.device.type == "cpu" and into.is_contiguous():
            if first.live:
                undo.save([into])  # before its bytes start to change
        else:
            into = torch.empty(into.shape, dtype=into.dtype)
        pending.append(dist.irecv_bytes(flat_bytes(into), reader, _TAGS + tag))
        arrived.append((box, regions, into))
    sent = []  # alive until sent
    for source in plan.sources:
        for tag, rank, box in source.sends:
            data = flat_bytes(_piece(source, box).contiguous())
            sent.append(data)
            pending.append(dist.isend_bytes(data, rank, _TAGS + tag))
        arrived.extend((box, regions, _piece(source, box)) for box, regions in source.own)
    for work in pending:
        work.wait()
    with torch.no_grad():
        for box, regions, data in arrived:
            for region in regions:
                for dest in (region.tensor, *region.copies):
                    dest = box_view(dest, region.offsets, box)
                    if same_memory(dest, data):
                        continue  # received in place
                    if region.live:
                        undo.save([dest])
                    dest.copy_(data)


# The exchange's tags start here: apart from the untagged (0) messages of the gathers
# and the save's relay, should an exchange that failed leave a receive posted.
_TAGS = 1 << 16
_MAX_TAG = (1 << 31) - 1  # gloo's tags are 32-bit


def _piece(source: _Source, box: Box) -> torch.Tensor:
    """The box ``[lo, hi)`` (global coordinates) of what ``source`` read."""
    return box_view(source.rows.tensor, source.rows.origin, box)
