"""Where checkpoint files live: one backend per module, chosen by the path or URL.

``/dir`` and ``file:///dir`` are the local file system (``local.py``); ``s3://``,
``gs://``, ``az://`` are object stores (``object_store.py``). Every backend offers the
same small protocol, ``CheckpointStorage``.
"""

from __future__ import annotations

import os
from collections.abc import Callable, Iterator
from typing import Any, Protocol

from .io_types import Segment
from .local import LocalDirectory

OBJECT_STORE_SCHEMES = ("s3", "s3a", "gs", "gcs", "az", "abfs", "abfss", "azure")


class WriterLock(Protocol):
    """Held by the one process that may write or delete a checkpoint directory."""

    def acquire(self) -> None: ...
    def release(self) -> None: ...


class FileWriter(Protocol):
    """One file written piece by piece: ``write`` in any order and from any thread
    (pieces start at page boundaries; bytes past the size are cut), then ``close``
    makes it durable and visible, or ``abort`` leaves nothing."""

    def write(self, offset: int, data: memoryview) -> None: ...
    def close(self) -> None: ...
    def abort(self) -> None: ...


class CheckpointStorage(Protocol):
    """A checkpoint "directory": named files, written whole, read by byte ranges."""

    root: Any  # the location as given: a Path, or the URL
    # Whether ``exclusive`` writes refuse a name that is there (local files: yes).
    creates_exclusively: bool

    @property
    def where(self) -> str: ...
    def location(self, name: str) -> str: ...
    def exists(self) -> bool: ...
    def list(self) -> list[str]: ...
    def subdirectories(self) -> list[str]: ...
    def size(self, name: str) -> int | None: ...
    def modified(self, name: str) -> float | None: ...
    def read_small(self, name: str, limit: int) -> bytes | None: ...
    def read_range(self, name: str, lo: int, hi: int) -> bytes: ...
    def iter_bytes(self, name: str, block: int) -> Iterator[memoryview]: ...
    def write_small_durably(self, name: str, data: bytes, *, exclusive: bool = False) -> None: ...
    def write_files(
        self, files: dict[str, tuple[int, list[Segment]]], *, threads: int, direct: bool = True
    ) -> None: ...
    def read_ranges(
        self,
        requests: dict[str, list[Segment]],
        *,
        threads: int,
        direct: bool = True,
        on_segment: Callable[[Segment], None] | None = None,
    ) -> None: ...
    def open_writer(
        self, name: str, size: int, *, threads: int = 1, exclusive: bool = False
    ) -> FileWriter: ...
    def append_small(self, name: str, data: bytes) -> None: ...
    def delete(self, name: str) -> None: ...
    def prepare(self, *, durable: bool = True) -> None: ...
    def sync(self) -> None: ...
    def remove_if_empty(self) -> None: ...
    def lock(self) -> WriterLock: ...


def is_url(path: str | os.PathLike[str]) -> bool:
    if not isinstance(path, str) or "://" not in path:
        return False
    return path.split("://", 1)[0] in OBJECT_STORE_SCHEMES


def open_storage(
    path: str | os.PathLike[str], storage_options: dict[str, Any] | None = None
) -> CheckpointStorage:
    """The backend for ``path``: a local directory, ``file://`` URL, or object-store URL."""
    if isinstance(path, str) and path.startswith("file://"):
        return LocalDirectory(path[len("file://") :])
    if is_url(path):
        from .object_store import ObjectStoreDirectory

        return ObjectStoreDirectory(str(path), storage_options)
    if isinstance(path, str) and "://" in path:
        from ..errors import CheckpointError

        raise CheckpointError(
            f"{path}: unsupported URL scheme; use a local path, file://, s3://, gs:// or az://"
        )
    return LocalDirectory(path)


def join(base: str | os.PathLike[str], name: str) -> str | os.PathLike[str]:
    """``base/name`` for a local path or a URL."""
    if is_url(base) or (isinstance(base, str) and base.startswith("file://")):
        return f"{str(base).rstrip('/')}/{name}"
    from pathlib import Path

    return Path(base) / name
