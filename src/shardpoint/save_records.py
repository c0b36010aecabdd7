"""The typed records a save passes between its phases and its ranks.

``SaveOptions`` in, ``SaveInfo`` out; what rank 0 plans from (``RankFacts``) and sends
back (``PlannedWrite``); what each rank wrote (``WriteResult`` of ``ChunkRecord``s),
sent to rank 0 for the index. The gathered ones travel as JSON lists (never pickle).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, NamedTuple

from .defaults import DEFAULT_MAX_SHARD_BYTES, DEFAULT_THREADS
from .format.index import Chunk
from .incremental import IncrementalChain
from .sharding import Mesh, Sharding


@dataclass(frozen=True)
class SaveInfo:
    """What a save wrote."""

    path: Path | str  # a local path, or the URL
    files: int
    tensors: int
    bytes_written: int
    seconds: float  # from the call until the checkpoint was committed
    blocked_seconds: float | None = None  # how long the caller waited (async: the staging)


@dataclass(frozen=True)
class SaveOptions:
    max_shard_size: int = DEFAULT_MAX_SHARD_BYTES
    threads: int = DEFAULT_THREADS
    metadata: dict[str, Any] | None = None
    # Each node's directory is its own (node-local disks): every node's first rank
    # prepares and commits it. Otherwise one directory is shared and rank 0 does.
    per_node: bool = False
    # Incremental: chunks unchanged since the chain's newest checkpoint (a sibling
    # directory) are referred to, not written; the chain advances on commit.
    chain: IncrementalChain | None = None


# Built per tensor: a frozen dataclass costs five times as much to build.
@dataclass(slots=True, unsafe_hash=True)
class ChunkRecord:
    """One written piece as the index needs it: the tensor's facts and its chunk."""

    name: str
    dtype: str
    global_shape: tuple[int, ...]
    chunk: Chunk
    # Replicated state: the box (offsets, shape) this piece is part of, which other
    # ranks hold too; None for a rank's own shard.
    copy_of: tuple[tuple[int, ...], tuple[int, ...]] | None
    # xxh3-128 of the chunk's bytes (incremental saves; stays on the rank that wrote it).
    identity: str | None = None

    def to_json(self) -> list[Any]:
        c = self.chunk
        return [
            *(self.name, self.dtype, self.global_shape, c.file, c.key, c.offsets, c.shape),
            *(c.begin, c.end, c.checksums, c.block_rows, self.copy_of),
        ]

    @staticmethod
    def from_json(doc: list[Any]) -> ChunkRecord:
        name, dtype, global_shape, file, key, offsets, shape, begin, end, sums, rows, of = doc
        chunk = Chunk(file, key, tuple(offsets), tuple(shape), (begin, end), rows, tuple(sums))
        box = (tuple(of[0]), tuple(of[1])) if of is not None else None
        return ChunkRecord(name, dtype, tuple(global_shape), chunk, box)


@dataclass
class WriteResult:
    """What one rank wrote (sent to rank 0 for the index), or why it failed."""

    files: dict[str, int] = field(default_factory=dict)  # name -> size
    chunks: list[ChunkRecord] = field(default_factory=list)
    error: str | None = None
    # The rank's fragment (size, checksum) and the files of the chunks it lists.
    fragment: tuple[int, str] | None = None
    fragment_files: list[str] = field(default_factory=list)
    # Files of earlier checkpoints its chunks refer to (incremental) -> size.
    referenced: dict[str, int] = field(default_factory=dict)
    headers: dict[str, str] = field(default_factory=dict)  # its shard file -> header checksum
    in_fragment: list[ChunkRecord] = field(default_factory=list)  # (not sent: in the fragment)

    def to_json(self) -> dict[str, Any]:
        chunks = [c.to_json() for c in self.chunks]
        return {
            "files": self.files,
            "chunks": chunks,
            "error": self.error,
            "fragment": self.fragment,
            "fragment_files": self.fragment_files,
            "referenced": self.referenced,
            "headers": self.headers,
        }

    @staticmethod
    def from_json(doc: dict[str, Any]) -> WriteResult:
        chunks = [ChunkRecord.from_json(c) for c in doc["chunks"]]
        fragment = tuple(doc["fragment"]) if doc["fragment"] is not None else None
        return WriteResult(
            doc["files"],
            chunks,
            doc["error"],
            fragment,
            doc["fragment_files"],
            doc["referenced"],
            doc["headers"],
        )

    def file_size(self, name: str) -> int:
        """The size of a file its chunks are in: its own, or a referenced one."""
        return self.files[name] if name in self.files else self.referenced[name]


class RankFacts(NamedTuple):
    """What rank 0 plans a save from, per rank, beside its structure (a JSON list)."""

    structure: str | None  # the rank's structure digest (``save_plan._structure_digest``)
    sole_bytes: int  # the bytes only it writes (its shards)
    node: int
    leader: bool  # the first rank of its node
    # A background save planned again (``save_plan.plan_again``): whether this rank is
    # steady, and the writes of its cached plan, which rank 0 plans around.
    again: tuple[bool, list[PlannedWrite]] | None = None


class PlannedWrite(NamedTuple):
    """A piece of a replicated chunk a rank is to write (a JSON list): the piece's
    offsets and shape, cut from the holding at ``at`` of shape ``size``."""

    name: str
    offsets: tuple[int, ...]
    shape: tuple[int, ...]
    at: tuple[int, ...]
    size: tuple[int, ...]


ShardedTable = dict[str, tuple[str, tuple[int, ...], Sharding]]


def sharded_table(lists: list[Any]) -> tuple[ShardedTable, str | None]:
    """Every sharded entry from the ranks' distinct lists; an entry two ranks describe
    differently is a conflict (reported by the commit: the index could not be right)."""
    table: ShardedTable = {}
    for doc in lists:
        if not doc:
            continue
        meshes = [Mesh.from_json(tuple(shape), ranks) for shape, ranks in doc[0]]
        for name, dtype, global_shape, mesh, dims in doc[1]:
            described = (dtype, tuple(global_shape), Sharding(meshes[mesh], tuple(dims)))
            if table.setdefault(name, described) != described:
                return table, f"{name!r} is sharded differently on different ranks"
    return table, None
