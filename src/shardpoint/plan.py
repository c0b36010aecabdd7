"""Which rank writes which piece of which tensor, so every byte is written once and the
busiest rank writes about as much as the average.

A chunk that only one rank can hold (a DTensor shard with no ``Replicate``
placement: FSDP, TP) is written by that rank, and the planner only needs each rank's
total of such bytes. Chunks that may be replicated (plain tensors, replicated DTensor
dims) are planned by rank 0, which sends each rank its own writes (save_plan.py):

1. A large chunk held by several ranks (a DDP parameter, a replicated norm) is split
   into row pieces, one per holder, the largest pieces to the least-loaded holders.
2. The other replicated chunks go, largest first, to the least-loaded holder
   (longest-processing-time greedy); a chunk only one rank holds goes to it.

Ranks that hold the same list of replicated chunks (every rank under DDP) pass the
same list object, read once; chunks held by the same set of ranks share one list of
them, and the least-loaded holder comes from a heap per such set. Under DDP planning
costs O(ranks + chunks x log(ranks)), not O(ranks x chunks); in general it is linear
in the size of the holder relation (plus a sort per chunk several lists hold), plus
the pieces that large chunks split into.
"""

from __future__ import annotations

import heapq
import math
from dataclasses import dataclass
from typing import Any

from .errors import CheckpointError
from .format.safetensors import itemsize
from .sharding import Sharding

SPLIT_BYTES = 4 * 1024 * 1024  # below this, splitting a replicated chunk is not worth it


# Built per tensor: a frozen dataclass costs five times as much to build.
@dataclass(slots=True, unsafe_hash=True)
class Holding:
    """The part of one tensor entry a rank holds."""

    name: str
    dtype: str
    global_shape: tuple[int, ...]
    offsets: tuple[int, ...]
    shape: tuple[int, ...]
    replicated: bool  # other ranks may hold the same chunk
    # Set for a chunk format version 2 describes by its sharding (written to the
    # rank's fragment, not listed in the index).
    sharding: Sharding | None = None

    @property
    def nbytes(self) -> int:
        return math.prod(self.shape) * itemsize(self.dtype)

    def to_json(self) -> list[Any]:
        return [self.name, self.dtype, self.global_shape, self.offsets, self.shape]

    @staticmethod
    def from_json(doc: list[Any]) -> Holding:
        name, dtype, global_shape, offsets, shape = doc
        return Holding(name, dtype, tuple(global_shape), tuple(offsets), tuple(shape), True)


# Built per tensor: a frozen dataclass costs five times as much to build.
@dataclass(slots=True, unsafe_hash=True)
class Piece:
    """A box of a tensor entry to write, and the rank that writes it."""

    name: str
    offsets: tuple[int, ...]
    shape: tuple[int, ...]
    writer: int
    source: Holding  # the holding the writer takes the bytes from


def plan_writes(
    sole_bytes: list[int], replicated: list[list[Holding]], *, split_bytes: int = SPLIT_BYTES
) -> list[Piece]:
    """Writers for the possibly-replicated chunks of every rank.

    ``sole_bytes[r]``: what rank ``r`` writes anyway (its unreplicated shards);
    ``replicated[r]``: the chunks rank ``r`` holds that others may hold too.
    """
    holders: dict[int, tuple[list[Holding], list[int]]] = {}  # id(list) -> (list, ranks)
    for rank, held in enumerate(replicated):
        holders.setdefault(id(held), (held, []))[1].append(rank)
    # chunk -> the rank lists of the lists that hold it (usually one: shared, unchanged)
    # A chunk is one value held by several ranks only if its dtype agrees too: ranks
    # that differ each write theirs, and the commit refuses the entry (it names both).
    found: dict[tuple[str, tuple[int, ...], tuple[int, ...], str], list[list[int]]] = {}
    first: dict[tuple[str, tuple[int, ...], tuple[int, ...], str], Holding] = {}
    for held, ranks in holders.values():
        for h in held:
            key = (h.name, h.offsets, h.shape, h.dtype)
            lists = found.get(key)
            if lists is None:
                found[key] = [ranks]
                first[key] = h
            else:
                lists.append(ranks)
    # Chunks held by the same lists share one merged list of their ranks (and a heap).
    merged: dict[tuple[int, ...], list[int]] = {}
    groups: dict[tuple[str, tuple[int, ...], tuple[int, ...], str], list[int]] = {}
    for key, lists in found.items():
        if len(lists) == 1:
            groups[key] = lists[0]
            continue
        same = tuple(map(id, lists))  # the lists' rank lists are disjoint: ids name the set
        if same not in merged:
            merged[same] = sorted(r for ranks in lists for r in ranks)
        groups[key] = merged[same]

    load = list(sole_bytes)
    pieces: list[Piece] = []
    rest: list[tuple[Holding, list[int]]] = []
    for key, ranks in groups.items():
        h = first[key]
        if len(ranks) > 1 and h.nbytes >= split_bytes and h.shape and h.shape[0] >= len(ranks):
            pieces.extend(_split_rows(h, ranks, load))
        else:
            rest.append((h, ranks))
    # (load, rank) of each holder set's ranks; an entry is stale once another set's
    # chunk raised that rank's load, and is refreshed when it comes to the top.
    heaps: dict[int, list[tuple[int, int]]] = {}
    for h, ranks in sorted(rest, key=lambda x: -x[0].nbytes):
        heap = heaps.get(id(ranks))
        if heap is None:
            heap = heaps[id(ranks)] = [(load[r], r) for r in ranks]
            heapq.heapify(heap)
        while heap[0][0] != load[heap[0][1]]:
            heapq.heapreplace(heap, (load[heap[0][1]], heap[0][1]))
        writer = heap[0][1]  # the least loaded, the lowest rank among equals
        pieces.append(Piece(h.name, h.offsets, h.shape, writer, h))
        load[writer] += h.nbytes
        heapq.heapreplace(heap, (load[writer], writer))
    return pieces


def _split_rows(h: Holding, ranks: list[int], load: list[int]) -> list[Piece]:
    k = len(ranks)
    rows = h.shape[0]
    sizes = [rows // k + (1 if i < rows % k else 0) for i in range(k)]
    row_bytes = h.nbytes // rows
    out = []
    start = 0
    by_load = sorted(ranks, key=lambda r: (load[r], r))
    for writer, n in zip(by_load, sizes):  # sizes are non-increasing: biggest to least loaded
        offsets = (h.offsets[0] + start, *h.offsets[1:])
        out.append(Piece(h.name, offsets, (n, *h.shape[1:]), writer, h))
        load[writer] += n * row_bytes
        start += n
    return out


def plan_writes_per_node(
    load: list[int], replicated: list[list[Holding]], nodes: list[int], per_node: bool
) -> list[Piece]:
    """``plan_writes`` for the job, or in per-node mode for each node apart: every node
    writes its own copy of replicated state, split among its ranks, so a node restores
    from its own disk alone; shards are written once."""
    if not per_node:
        return plan_writes(load, replicated)
    members: dict[int, list[int]] = {}
    for rank, node in enumerate(nodes):
        members.setdefault(node, []).append(rank)
    pieces = []
    for node in sorted(members):
        ranks = members[node]
        for piece in plan_writes([load[r] for r in ranks], [replicated[r] for r in ranks]):
            piece.writer = ranks[piece.writer]  # the node's index -> the job's rank
            pieces.append(piece)
    return pieces


def writes_around_staged(
    steady: list[bool],
    kept: list[list[Any]],  # per rank: its cached writes (save_records.PlannedWrite)
    sole_bytes: list[int],
    replicated: list[list[Holding]],
    nodes: list[int],
    per_node: bool,
) -> list[Piece]:
    """Rank 0, for a background save that must run again: the steady ranks wrote their
    cached share and can write nothing else (they staged only that); the ranks whose
    structure changed copied everything they hold and write the rest.

    A cached piece stays with its writer if the writer is steady or still holds the
    chunk it is cut from; otherwise it goes to the least-loaded changed rank (of the
    writer's node, in per-node mode) that holds that chunk, and is dropped if no rank
    holds it any more. Chunks no cached piece is cut from are planned among the changed
    ranks that hold them. A piece of a chunk that only steady ranks hold cannot be
    written: the save fails (the next one agrees first)."""
    chunks: dict[int, dict[tuple[Any, ...], Holding]] = {}  # per distinct list
    for held in replicated:
        if id(held) not in chunks:
            chunks[id(held)] = {(h.name, h.offsets, h.shape): h for h in held}
    load = list(sole_bytes)
    pieces: list[Piece] = []
    orphans: list[tuple[int, list[Any]]] = []  # (cached writer, its write)
    # The chunks cached pieces are cut from (with the node whose copy they are).
    cut: set[tuple[Any, ...]] = set()
    for rank, writes in enumerate(kept):
        for write in writes:
            name, offsets, shape, at, size = write
            key = (name, tuple(at), tuple(size))
            cut.add((*key, nodes[rank] if per_node else None))
            source = chunks[id(replicated[rank])].get(key)  # a steady rank's always is
            if source is None:
                orphans.append((rank, write))
                continue
            piece = Piece(name, tuple(offsets), tuple(shape), rank, source)
            pieces.append(piece)
            load[rank] += _piece_nbytes(piece)
    # The changed ranks' holders of each chunk, found once per distinct list.
    changed: dict[int, tuple[list[Holding], list[int]]] = {}
    for rank, held in enumerate(replicated):
        if not steady[rank]:
            changed.setdefault(id(held), (held, []))[1].append(rank)
    wanted = {(w[0], tuple(w[3]), tuple(w[4])) for _, w in orphans}
    holders: dict[tuple[Any, ...], list[int]] = {}
    # Per distinct changed list (and node): its chunks no cached piece is cut from.
    new: dict[tuple[int, int | None], list[Holding]] = {}
    for held, ranks in changed.values():
        for h in held:
            key = (h.name, h.offsets, h.shape)
            if key in wanted:
                holders.setdefault(key, []).extend(ranks)
        for node in {nodes[r] if per_node else None for r in ranks}:
            new[id(held), node] = [h for h in held if (h.name, h.offsets, h.shape, node) not in cut]
    for cached_writer, (name, offsets, shape, at, size) in orphans:
        key = (name, tuple(at), tuple(size))
        node = nodes[cached_writer]
        candidates = [r for r in holders.get(key, []) if not per_node or nodes[r] == node]
        if not candidates:
            if per_node:  # (the node's ranks' chunks: its copy)
                held_by = [chunks[id(replicated[r])] for r, n in enumerate(nodes) if n == node]
            else:
                held_by = list(chunks.values())
            if any(key in c for c in held_by):
                raise CheckpointError(
                    f"rank {cached_writer}'s structure changed during this background save and "
                    f"the piece of {name!r} at {list(offsets)} it was to write is held "
                    "only by ranks that staged their own share: the save cannot be "
                    "completed from what was staged, nothing is committed, and the next "
                    "save agrees on a plan before it stages"
                )
            continue  # no rank holds it any more: the entry left the state
        writer = min(candidates, key=lambda r: (load[r], r))
        source = chunks[id(replicated[writer])][key]
        piece = Piece(name, tuple(offsets), tuple(shape), writer, source)
        pieces.append(piece)
        load[writer] += _piece_nbytes(piece)
    nothing: list[Holding] = []
    lists = [
        nothing if steady[r] else new[id(held), nodes[r] if per_node else None]
        for r, held in enumerate(replicated)
    ]
    return pieces + plan_writes_per_node(load, lists, nodes, per_node)


def _piece_nbytes(p: Piece) -> int:
    return math.prod(p.shape) * itemsize(p.source.dtype)
