"""Which rank writes which piece of which tensor, so every byte is written once and the
busiest rank writes about as much as the average.

Input: what every rank holds (gathered once per save). Every rank runs the same
deterministic planner on the same input, so no plan needs to be sent around.

1. A chunk held by one rank (an FSDP/TP shard, a per-rank value) is written by it.
2. A large chunk held by several ranks (a DDP parameter, a replicated norm) is split
   into row pieces, one per holder, the largest pieces to the least-loaded holders.
3. The remaining small replicated chunks go, largest first, to the least-loaded
   holder (longest-processing-time greedy).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

from .format.safetensors import itemsize

SPLIT_BYTES = 4 * 1024 * 1024  # below this, splitting a replicated chunk is not worth it


@dataclass(frozen=True)
class Holding:
    """The part of one tensor entry a rank holds."""

    name: str
    dtype: str
    global_shape: tuple[int, ...]
    offsets: tuple[int, ...]
    shape: tuple[int, ...]

    @property
    def nbytes(self) -> int:
        return math.prod(self.shape) * itemsize(self.dtype)

    def to_json(self) -> list[Any]:
        return [self.name, self.dtype, self.global_shape, self.offsets, self.shape]

    @staticmethod
    def from_json(doc: list[Any]) -> Holding:
        name, dtype, global_shape, offsets, shape = doc
        return Holding(name, dtype, tuple(global_shape), tuple(offsets), tuple(shape))


@dataclass(frozen=True)
class Piece:
    """A box of a tensor entry to write, and the rank that writes it."""

    name: str
    offsets: tuple[int, ...]
    shape: tuple[int, ...]
    writer: int
    source: Holding  # the holding the writer takes the bytes from


def plan_writes(holdings: list[list[Holding]], *, split_bytes: int = SPLIT_BYTES) -> list[Piece]:
    """Assign every distinct chunk (or row piece of one) to exactly one writer."""
    groups: dict[tuple[str, tuple[int, ...], tuple[int, ...]], list[int]] = {}
    first: dict[tuple[str, tuple[int, ...], tuple[int, ...]], Holding] = {}
    for rank, held in enumerate(holdings):
        for h in held:
            key = (h.name, h.offsets, h.shape)
            ranks = groups.get(key)
            if ranks is None:
                groups[key] = [rank]
                first[key] = h
            else:
                ranks.append(rank)

    load = [0] * len(holdings)
    pieces: list[Piece] = []
    small: list[tuple[Holding, list[int]]] = []
    for key, ranks in groups.items():
        h = first[key]
        if len(ranks) == 1:
            pieces.append(Piece(h.name, h.offsets, h.shape, ranks[0], h))
            load[ranks[0]] += h.nbytes
        elif h.nbytes >= split_bytes and h.shape and h.shape[0] >= len(ranks):
            pieces.extend(_split_rows(h, ranks, load))
        else:
            small.append((h, ranks))
    for h, ranks in sorted(small, key=lambda x: -x[0].nbytes):
        writer = min(ranks, key=lambda r: (load[r], r))
        pieces.append(Piece(h.name, h.offsets, h.shape, writer, h))
        load[writer] += h.nbytes
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
