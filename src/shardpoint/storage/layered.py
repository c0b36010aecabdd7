"""A read-only view of one checkpoint whose files are spread over several copies.

On node-local disks each node holds only its own ranks' files of a checkpoint; the
remote tier holds all of them once the uploads finished. A rank restoring reads
every file from the first copy that has it (its node's disk before the object
store), so a node that lost its disk reads only what it lacks from the remote.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from typing import Any

from ..errors import CheckpointError
from .io_types import Segment


class LayeredCheckpoint:
    """Files of one checkpoint from ``copies`` (a list of storages), first copy first."""

    def __init__(self, copies: list[Any]) -> None:
        if not copies:
            raise ValueError("a layered checkpoint needs at least one copy")
        self.copies = copies
        self.root = copies[0].root
        self._source: dict[str, Any] = {}
        self._bytes_read: dict[int, int] = {}  # id(copy) -> bytes read from it

    @property
    def where(self) -> str:
        return " + ".join(c.where for c in self.copies)

    def _copy_of(self, name: str) -> Any:
        if name not in self._source:
            self._source[name] = next(
                (c for c in self.copies if c.size(name) is not None), self.copies[0]
            )
        return self._source[name]

    def location(self, name: str) -> str:
        return self._copy_of(name).location(name)

    def exists(self) -> bool:
        return any(c.exists() for c in self.copies)

    def list(self) -> list[str]:
        return sorted({n for c in self.copies for n in c.list()})

    def size(self, name: str) -> int | None:
        return self._copy_of(name).size(name)

    def read_small(self, name: str, limit: int) -> bytes | None:
        return self._copy_of(name).read_small(name, limit)

    def read_range(self, name: str, lo: int, hi: int) -> bytes:
        return self._copy_of(name).read_range(name, lo, hi)

    def iter_bytes(self, name: str, block: int) -> Iterator[memoryview]:
        return self._copy_of(name).iter_bytes(name, block)

    def read_ranges(
        self,
        requests: dict[str, list[Segment]],
        *,
        threads: int,
        direct: bool = True,
        on_segment: Callable[[Segment], None] | None = None,
    ) -> None:
        by_copy: dict[int, dict[str, list[Segment]]] = {}
        for name, segments in requests.items():
            copy = self._copy_of(name)
            by_copy.setdefault(id(copy), {})[name] = segments
            read = sum(s.end - s.offset for s in segments)
            self._bytes_read[id(copy)] = self._bytes_read.get(id(copy), 0) + read
        for copy in self.copies:
            if id(copy) in by_copy:
                copy.read_ranges(
                    by_copy[id(copy)], threads=threads, direct=direct, on_segment=on_segment
                )

    def bytes_read_from(self, copy: Any) -> int:
        """Tensor bytes ``read_ranges`` fetched from ``copy`` (one of ``copies``)."""
        return self._bytes_read.get(id(copy), 0)

    def _read_only(self, *args: Any, **kwargs: Any) -> Any:
        raise CheckpointError(f"{self.where}: a layered view of a checkpoint is read-only")

    write_small_durably = write_files = open_writer = append_small = _read_only
    delete = prepare = sync = remove_if_empty = lock = _read_only

    def subdirectories(self) -> list[str]:
        return []
