"""Opening a committed checkpoint: marker, index and shard headers, all checked.

Shared by ``load``, ``open`` and ``verify`` so every reader applies the same rules
before reading a single tensor byte.
"""

from __future__ import annotations

import os
import re
from dataclasses import dataclass, field
from pathlib import Path

from .errors import CorruptCheckpointError, IncompleteCheckpointError
from .format.index import (
    INDEX_NAME,
    MARKER_NAME,
    Chunk,
    Index,
    TensorEntry,
    check_marker,
    parse_index,
)
from .format.safetensors import Header, header_length, parse_header
from .storage.local import LocalDirectory, fsync_directory


@dataclass
class CommittedCheckpoint:
    storage: LocalDirectory
    index: Index
    _headers: dict[str, Header] = field(default_factory=dict)
    chunks_by_file: dict[str, list[tuple[TensorEntry, Chunk]]] = field(default_factory=dict)

    def __post_init__(self) -> None:
        for entry in self.index.entries.values():
            for c in entry.chunks:
                self.chunks_by_file.setdefault(c.file, []).append((entry, c))

    @property
    def where(self) -> str:
        return str(self.storage.root)

    def header(self, file: str) -> Header:
        """Parse ``file``'s safetensors header once and check it agrees with the index."""
        if file not in self._headers:
            header = read_header(self.storage, file)
            for entry, c in self.chunks_by_file.get(file, []):
                slot = header.slots.get(c.key)
                if (
                    slot is None
                    or slot.dtype != entry.dtype
                    or slot.shape != c.shape
                    or (header.data_start + slot.begin, header.data_start + slot.end)
                    != (c.begin, c.end)
                ):
                    raise CorruptCheckpointError(
                        f"{self.storage.path(file)}: its header does not match {INDEX_NAME} for "
                        f"{entry.name!r} (shard replaced or index from another checkpoint)"
                    )
            self._headers[file] = header
        return self._headers[file]


def read_header(storage: LocalDirectory, file: str) -> Header:
    path = storage.path(file)
    with open(path, "rb") as f:
        size = os.fstat(f.fileno()).st_size
        n = header_length(f.read(8), size, str(path))
        return parse_header(f.read(n), size, str(path))


def open_committed(path: str | os.PathLike[str]) -> CommittedCheckpoint:
    """Open a committed checkpoint, or raise the typed error that says what is wrong."""
    storage = LocalDirectory(path)
    if not storage.root.is_dir():
        raise IncompleteCheckpointError(
            f"{storage.root}: no such checkpoint directory; check the path"
        )
    marker = storage.read_small(MARKER_NAME)
    if marker is None:
        raise IncompleteCheckpointError(
            f"{storage.root}: no commit marker ({MARKER_NAME}), so this is not a committed "
            "checkpoint (the save did not finish); load an earlier checkpoint"
        )
    raw = storage.read_small(INDEX_NAME)
    if raw is None:
        raise CorruptCheckpointError(
            f"{storage.root / INDEX_NAME}: missing although the checkpoint was committed; "
            "the checkpoint is damaged, load an earlier one"
        )
    check_marker(marker, raw, str(storage.root / MARKER_NAME))
    index = parse_index(raw, str(storage.root / INDEX_NAME))
    for name, size in index.files.items():
        actual = storage.size(name)
        if actual != size:
            state = "is missing" if actual is None else f"has {actual} bytes, expected {size}"
            raise CorruptCheckpointError(
                f"{storage.path(name)}: shard file {state}; the checkpoint is damaged, "
                "load an earlier one"
            )
    return CommittedCheckpoint(storage, index)


# Every name a save writes; anything else in a checkpoint directory is not ours.
OWN_FILE = re.compile(r"^(index\.json|COMMITTED|rank\d{5}-\d{5}\.safetensors)(\.tmp)?$")


def foreign_files(root: Path) -> list[str]:
    return sorted(p.name for p in root.iterdir() if not OWN_FILE.match(p.name))


def delete_checkpoint(root: Path) -> None:
    """Remove a checkpoint directory, commit marker first.

    Once the marker is gone no reader takes the directory for a checkpoint, so a crash
    halfway leaves an uncommitted leftover, never a damaged "valid" checkpoint. Files
    that are not shardpoint's are left alone (and keep the directory).
    """
    marker = root / MARKER_NAME
    if marker.exists():
        marker.unlink()
        fsync_directory(root)
    for p in root.iterdir():
        if OWN_FILE.match(p.name):
            p.unlink()
    if not any(root.iterdir()):
        root.rmdir()
