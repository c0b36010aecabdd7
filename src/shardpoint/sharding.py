"""The chunks of a regularly sharded tensor, derived from its mesh and placements.

Format version 2 describes a DTensor whose placements are ``Shard(d)`` or
``Replicate`` with at least one ``Shard`` (FSDP, TP, FSDP x TP, HSDP, expert
parallelism) once — global shape, mesh, placements — instead of listing one chunk per
rank (docs/format.md). Every reader derives the chunk of any
mesh coordinate from that description with the rule below, which is the one torch
applies (``torch.chunk`` sizes, mesh dimensions in order, an empty shard placed at the
end of its dimension); the writer checks its own chunk against it before saving.
"""

from __future__ import annotations

import math
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from functools import cached_property
from typing import Any

import xxhash

REPLICATED = -1


@dataclass(frozen=True)
class Mesh:
    shape: tuple[int, ...]
    # The global rank at each coordinate, row-major. Consecutive ranks (the usual mesh)
    # are kept as a range: one costs nothing at any size, and a hostile index's
    # {"first", "count"} cannot make a reader fill its memory with 2**62 ranks.
    ranks: Sequence[int]

    def __post_init__(self) -> None:
        ranks = self.ranks
        if not isinstance(ranks, range) and ranks:
            consecutive = range(ranks[0], ranks[0] + len(ranks))
            if tuple(ranks) == tuple(consecutive):
                object.__setattr__(self, "ranks", consecutive)

    @staticmethod
    def from_json(shape: tuple[int, ...], ranks: Any) -> Mesh:
        """A mesh as ``ranks_json`` wrote it (no checks: ``format/index.py`` checks
        what it reads from storage)."""
        if type(ranks) is dict:
            return Mesh(shape, range(ranks["first"], ranks["first"] + ranks["count"]))
        return Mesh(shape, tuple(ranks))

    def ranks_json(self) -> Any:
        """The ranks in an index: consecutive ones as {"first", "count"}."""
        if isinstance(self.ranks, range):
            return {"first": self.ranks.start, "count": len(self.ranks)}
        return list(self.ranks)

    @cached_property
    def digest(self) -> str:
        """Identifies the mesh in a structure digest without hashing every rank each time."""
        return xxhash.xxh3_64_hexdigest(repr((self.shape, self.ranks_json())).encode())

    def __hash__(self) -> int:
        # A save looks its mesh up once per sharded entry: a strided mesh (FSDP's
        # sub-mesh with TP inside) would hash its 2,048 ranks each time.
        return hash(self.digest)

    @cached_property
    def _flat_of(self) -> dict[int, int]:
        return {r: i for i, r in enumerate(self.ranks)}

    def repeats_a_rank(self) -> bool:
        return not isinstance(self.ranks, range) and len(self._flat_of) != len(self.ranks)

    def coord_at(self, flat: int) -> tuple[int, ...]:
        coord = []
        for n in reversed(self.shape):
            flat, c = divmod(flat, n)
            coord.append(c)
        return tuple(reversed(coord))

    def coord_of(self, rank: int) -> tuple[int, ...] | None:
        """Where ``rank`` sits in the mesh; None if it is not part of it."""
        if isinstance(self.ranks, range):
            return self.coord_at(rank - self.ranks.start) if rank in self.ranks else None
        flat = self._flat_of.get(rank)
        return None if flat is None else self.coord_at(flat)

    def rank_at(self, coord: tuple[int, ...]) -> int:
        flat = 0
        for n, c in zip(self.shape, coord):
            flat = flat * n + c
        return self.ranks[flat]


@dataclass(frozen=True)
class Sharding:
    mesh: Mesh
    # The tensor dimension each mesh dimension shards; REPLICATED where the mesh
    # dimension holds copies (HSDP's replica dimension).
    dims: tuple[int, ...]

    @property
    def mesh_shape(self) -> tuple[int, ...]:
        return self.mesh.shape

    def box(
        self, shape: tuple[int, ...], coord: tuple[int, ...]
    ) -> tuple[tuple[int, ...], tuple[int, ...]]:
        """(offsets, shape) of the chunk at mesh coordinate ``coord``."""
        offsets = [0] * len(shape)
        sizes = list(shape)
        for parts, d, c in zip(self.mesh_shape, self.dims, coord):
            if d == REPLICATED:
                continue
            step = -(-sizes[d] // parts)
            lo = min(c * step, sizes[d])
            hi = min(lo + step, sizes[d])
            offsets[d] = shape[d] if hi == lo else offsets[d] + lo
            sizes[d] = hi - lo
        return tuple(offsets), tuple(sizes)

    def coords(self) -> Iterator[tuple[int, ...]]:
        """Every mesh coordinate, row-major (the order of the mesh's ranks)."""
        for flat in range(len(self.mesh.ranks)):
            yield self.mesh.coord_at(flat)

    def overlapping(
        self, shape: tuple[int, ...], lo: tuple[int, ...], hi: tuple[int, ...]
    ) -> Iterator[tuple[int, ...]]:
        """Mesh coordinates whose non-empty chunk overlaps the box ``[lo, hi)``, found by
        division per mesh dimension (a rank loading its shard of a tensor sharded over
        16,384 ranks looks at one or two of them, not all); one per chunk, with 0 in
        replicated mesh dimensions (``writer`` says which replica stored it)."""

        def walk(
            i: int, coord: tuple[int, ...], offsets: list[int], sizes: list[int]
        ) -> Iterator[tuple[int, ...]]:
            if i == len(self.mesh_shape):
                if all(s > 0 for s in sizes):
                    yield coord
                return
            d, parts = self.dims[i], self.mesh_shape[i]
            if d == REPLICATED:  # one chunk for all replicas: its coordinate says 0
                yield from walk(i + 1, (*coord, 0), offsets, sizes)
                return
            step = -(-sizes[d] // parts) or 1
            first = max(0, (lo[d] - offsets[d]) // step)
            last = min(parts - 1, (hi[d] - 1 - offsets[d]) // step)
            for c in range(first, last + 1):
                a = min(c * step, sizes[d])
                b = min(a + step, sizes[d])
                if b > a:
                    o, s = list(offsets), list(sizes)
                    o[d], s[d] = offsets[d] + a, b - a
                    yield from walk(i + 1, (*coord, c), o, s)

        if all(h > lo_ for lo_, h in zip(lo, hi)) or not shape:
            yield from walk(0, (), [0] * len(shape), list(shape))

    def writer(self, coord: tuple[int, ...]) -> int:
        """The rank that stored the chunk at ``coord`` (its replicated mesh dimensions
        ignored): replica number (chunk number mod replicas), so that replicas share
        the writing evenly."""
        replicated = [i for i, d in enumerate(self.dims) if d == REPLICATED]
        if not replicated:
            return self.mesh.rank_at(coord)
        chunk = 0
        for i, d in enumerate(self.dims):
            if d != REPLICATED:
                chunk = chunk * self.mesh.shape[i] + coord[i]
        replica = chunk % math.prod(self.mesh.shape[i] for i in replicated)
        at = list(coord)
        for i in reversed(replicated):
            replica, at[i] = divmod(replica, self.mesh.shape[i])
        return self.mesh.rank_at(tuple(at))

    def check(self, shape: tuple[int, ...], where: str) -> str | None:
        """Why this description cannot be right for a tensor of ``shape``, or None."""
        if len(self.mesh_shape) != len(self.dims) or not self.mesh_shape:
            return "mesh and placements differ in length"
        if any(n < 1 for n in self.mesh_shape) or math.prod(self.mesh_shape) != len(
            self.mesh.ranks
        ):
            return "the mesh's ranks do not fill its shape"
        if self.mesh.repeats_a_rank():
            return "a rank appears twice in the mesh"
        if any(not REPLICATED <= d < len(shape) for d in self.dims):
            return f"a placement shards a dimension the tensor {list(shape)} does not have"
        if all(d == REPLICATED for d in self.dims):
            return "no mesh dimension shards the tensor"
        return None
