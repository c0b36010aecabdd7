"""Opening a committed checkpoint: marker, index and shard headers, all checked.

Shared by ``load``, ``open`` and ``verify`` so every reader applies the same rules
before reading a single tensor byte.
"""

from __future__ import annotations

import itertools
import os
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

from . import tree as tree_codec
from .errors import CorruptCheckpointError, IncompleteCheckpointError
from .format.index import (
    INDEX_NAME,
    MARKER_NAME,
    Chunk,
    Fragment,
    Index,
    TensorEntry,
    checksum,
)
from .format.marker import check_marker
from .format.parse import parse_fragment, parse_index
from .format.safetensors import Header, header_length, parse_header
from .names import fragment_file
from .storage import CheckpointStorage, open_storage

# Small files are read whole; a hostile one (a sparse 64 GB index) must not exhaust
# memory. 1 GiB holds the index of ~5 million chunks (docs/format.md).
MAX_INDEX_BYTES = int(os.environ.get("SHARDPOINT_MAX_INDEX_BYTES", 1 << 30))
MAX_MARKER_BYTES = 64 * 1024


@dataclass
class CommittedCheckpoint:
    storage: CheckpointStorage
    index: Index
    _headers: dict[str, Header] = field(default_factory=dict)
    chunks_by_file: dict[str, list[tuple[TensorEntry, Chunk]]] = field(default_factory=dict)
    _fragments: dict[int, Fragment] = field(default_factory=dict)
    _checked: set[str] = field(default_factory=set)  # files whose header checksum matched

    def __post_init__(self) -> None:
        for entry in self.index.entries.values():
            for c in entry.chunks:
                self.chunks_by_file.setdefault(c.file, []).append((entry, c))

    @property
    def where(self) -> str:
        return self.storage.where

    def chunks(
        self, entry: TensorEntry, lo: tuple[int, ...], shape: Sequence[int]
    ) -> Sequence[Chunk]:
        """The stored chunks of ``entry`` that may overlap the box of ``shape`` at
        ``lo``. For an entry described by its sharding, only the writers of those
        chunks' fragments are read (a rank loading its own shard reads one)."""
        sharding = self.index.shardings.get(entry.name)
        if sharding is None:
            return entry.chunks
        hi = tuple(o + n for o, n in zip(lo, shape))
        out = []
        for coord in sharding.overlapping(entry.shape, lo, hi):
            rank = sharding.writer(coord)
            chunk = self.fragment(rank).get(entry.name)
            if chunk is None:
                raise CorruptCheckpointError(
                    f"{self.storage.location(fragment_file(rank))}: has no chunk of "
                    f"{entry.name!r}, which rank {rank} holds; {_DAMAGED}"
                )
            out.append(chunk)
        return out

    def fragment_value(self, rank: int, path: str) -> Any:
        """The encoded value rank ``rank`` kept in its fragment at ``path``; the tensor
        entries of its fragment join the index from then on."""
        values = self.read_fragment(rank).values
        if path not in values:
            raise CorruptCheckpointError(
                f"{self.storage.location(fragment_file(rank))}: has no value at {path!r}, "
                f"which {INDEX_NAME} says it holds; {_DAMAGED}"
            )
        return values[path]

    def fragment(self, rank: int) -> dict[str, Chunk]:
        """Rank ``rank``'s chunks of sharded entries (its fragment, read once)."""
        return self.read_fragment(rank).chunks

    def read_fragment(self, rank: int) -> Fragment:
        """Rank ``rank``'s fragment, read once and checked against the index's checksum."""
        if rank not in self._fragments:
            name = fragment_file(rank)
            where = self.storage.location(name)
            recorded = self.index.fragments.get(rank)
            raw = self.storage.read_small(name, MAX_INDEX_BYTES)
            if recorded is None or raw is None or (len(raw), checksum(raw)) != recorded:
                state = "missing" if raw is None else "not the one the index committed"
                raise CorruptCheckpointError(f"{where}: the chunk fragment is {state}; {_DAMAGED}")
            fragment = parse_fragment(raw, where, rank, self.index)
            self.index.entries.update(fragment.entries)
            own = [(e.name, e.chunks[0]) for e in fragment.entries.values()]
            for entry_name, c in [*fragment.chunks.items(), *own]:
                self.chunks_by_file.setdefault(c.file, []).append(
                    (self.index.entries[entry_name], c)
                )
                header = self._headers.get(c.file)
                if header is not None:  # parsed before this fragment was read
                    self._check_slot(header, self.index.entries[entry_name], c)
            self._fragments[rank] = fragment
        return self._fragments[rank]

    def read_every_fragment(self) -> None:
        """Fill every sharded entry's chunks from all fragments (``open``, ``verify``,
        export: whatever reads the whole checkpoint), checking they tile each entry."""
        found: dict[str, list[Chunk]] = {name: [] for name in self.index.shardings}
        for rank in sorted(self.index.fragments):
            for name, c in self.fragment(rank).items():
                if c.end > c.begin:  # an empty shard holds no bytes
                    found[name].append(c)
        for name, chunks in found.items():
            entry = self.index.entries[name]
            whole = (0,) * len(entry.shape), entry.shape
            # Counted up to one more than found: a hostile index's mesh may claim 2**62.
            derived = self.index.shardings[name].overlapping(entry.shape, *whole)
            expected = sum(1 for _ in itertools.islice(derived, len(chunks) + 1))
            if len(chunks) != expected:
                has = expected if expected <= len(chunks) else f"more than {len(chunks)}"
                raise CorruptCheckpointError(
                    f"{self.where}: {len(chunks)} chunks of {name!r} in the fragments, its "
                    f"sharding has {has}; {_DAMAGED}"
                )
            self.index.entries[name] = TensorEntry(
                name, entry.dtype, entry.shape, tuple(sorted(chunks, key=lambda c: c.offsets))
            )
        # Every value the tree keeps in a fragment is there (their shapes were checked
        # by parse_index and parse_fragment; fragment_value raises the typed error).
        tree_codec.decode(self.index.tree, lambda name: None, self.fragment_value)

    def header(self, file: str) -> Header:
        """Parse ``file``'s safetensors header once and check it and the file's size
        agree with the index: every slot, and the header's checksum where the index
        records one (one read of the header for both)."""
        if file not in self._headers:
            raw, size = self._header_bytes(file)
            header = parse_header(raw[8:], size, self.storage.location(file))
            for entry, c in self.chunks_by_file.get(file, []):
                self._check_slot(header, entry, c)
            self._compare_checksum(file, raw)
            self._headers[file] = header
        return self._headers[file]

    def check_header(self, file: str) -> None:
        """Check once that ``file``'s size and header agree with the index: by the
        checksum of its header bytes where the index records one (a file this release
        wrote: the header is then the one whose slots made the index), else by parsing
        the header and comparing every slot."""
        if file not in self.index.headers:
            self.header(file)
        elif file not in self._checked:
            self._compare_checksum(file, self._header_bytes(file)[0])

    def _header_bytes(self, file: str) -> tuple[bytes, int]:
        """``file``'s header as stored and its size, checked against the index."""
        size = self.index.files.get(file)
        if size is None:
            raise CorruptCheckpointError(
                f"{self.storage.location(file)}: not a file of this checkpoint; {_DAMAGED}"
            )
        check_size(self.storage, file, size)
        return _header_bytes(self.storage, file, size, self._data_start(file))

    def _compare_checksum(self, file: str, raw: bytes) -> None:
        expected = self.index.headers.get(file)
        if expected is not None and checksum(raw) != expected:
            raise CorruptCheckpointError(
                f"{self.storage.location(file)}: its header does not match {INDEX_NAME} "
                f"(shard replaced or index from another checkpoint); {_DAMAGED}"
            )
        self._checked.add(file)

    def _data_start(self, file: str) -> int:
        return min((c.begin for _, c in self.chunks_by_file.get(file, [])), default=8)

    def _check_slot(self, header: Header, entry: TensorEntry, c: Chunk) -> None:
        slot = header.slots.get(c.key)
        if (
            slot is None
            or slot.dtype != entry.dtype
            or slot.shape != c.shape
            or (header.data_start + slot.begin, header.data_start + slot.end) != (c.begin, c.end)
        ):
            raise CorruptCheckpointError(
                f"{self.storage.location(c.file)}: its header does not match {INDEX_NAME} for "
                f"{entry.name!r} (shard replaced or index from another checkpoint)"
            )


def read_header(
    storage: CheckpointStorage, file: str, *, size: int | None = None, data_start: int = 8
) -> Header:
    """Read and parse a shard's header. ``data_start`` (where the index says the data
    begins) lets one read fetch the length prefix and the header together: on an
    object store every read is a request."""
    if size is None:
        size = storage.size(file)
        if size is None:
            raise CorruptCheckpointError(f"{storage.location(file)}: shard file is missing")
    raw, size = _header_bytes(storage, file, size, data_start)
    return parse_header(raw[8:], size, storage.location(file))


def _header_bytes(
    storage: CheckpointStorage, file: str, size: int | None, data_start: int
) -> tuple[bytes, int]:
    """A shard's header as stored (length prefix, then the JSON) and the file's size."""
    assert size is not None  # checked by the caller
    first = storage.read_range(file, 0, min(max(data_start, 8), size, 8 + _HEADER_GUESS))
    n = header_length(first, size, storage.location(file))
    raw = first[: 8 + n]
    if len(raw) < 8 + n:
        raw += storage.read_range(file, len(first), 8 + n)
    return raw, size


_HEADER_GUESS = 16 * 1024 * 1024  # a hostile index must not make the first read huge
_DAMAGED = "the checkpoint is damaged, load an earlier one"


def check_size(storage: CheckpointStorage, name: str, size: int | None) -> None:
    actual = storage.size(name)
    if actual != size:
        state = "is missing" if actual is None else f"has {actual} bytes, expected {size}"
        raise CorruptCheckpointError(
            f"{storage.location(name)}: shard file {state}; the checkpoint is damaged, "
            "load an earlier one"
        )


def open_committed(
    path: str | os.PathLike[str] | CheckpointStorage,
    storage_options: dict[str, Any] | None = None,
    *,
    every_file: bool = True,
) -> CommittedCheckpoint:
    """Open a committed checkpoint (a path, URL or storage), or raise the typed error
    that says what is wrong. ``every_file=False`` leaves the size check of each shard
    file to its first read: a rank restoring from node-local disks reads only some."""
    storage = open_storage(path, storage_options) if isinstance(path, (str, os.PathLike)) else path
    if not storage.exists():
        raise IncompleteCheckpointError(
            f"{storage.where}: no such checkpoint directory; check the path"
        )
    marker = storage.read_small(MARKER_NAME, MAX_MARKER_BYTES)
    if marker is None:
        raise IncompleteCheckpointError(
            f"{storage.where}: no commit marker ({MARKER_NAME}), so this is not a committed "
            "checkpoint (the save did not finish); load an earlier checkpoint"
        )
    raw = storage.read_small(INDEX_NAME, MAX_INDEX_BYTES)
    if raw is None:
        raise CorruptCheckpointError(
            f"{storage.location(INDEX_NAME)}: missing although the checkpoint was committed; "
            "the checkpoint is damaged, load an earlier one"
        )
    check_marker(marker, raw, storage.location(MARKER_NAME))
    index = parse_index(raw, storage.location(INDEX_NAME))
    ckpt = CommittedCheckpoint(storage, index)
    if every_file:
        for name, size in index.files.items():
            check_size(storage, name, size)
        ckpt.read_every_fragment()
    return ckpt
