"""Object stores (S3 API; GCS and Azure through the same library) as checkpoint storage.

One checkpoint is the set of objects under ``URL/``; there are no directories and no
rename, so the commit marker is simply the last object written (after every shard and
the index PUT completed). S3 reads are strongly consistent: once the marker is
visible, so is everything it covers.

Built on obstore (Rust ``object_store``): parallel multipart uploads that abort on
failure, ranged parallel GETs with coalescing, and retries of connection errors and
5xx/throttling responses with exponential backoff and jitter under a bounded total
time. Configuration comes from the library's usual environment (``AWS_ENDPOINT_URL``,
``AWS_ACCESS_KEY_ID``, ``AWS_SECRET_ACCESS_KEY``, ``AWS_REGION``, ...) plus
``storage_options``. docs/storage.md says why obstore and not s3fs (measured).
"""

from __future__ import annotations

import os
import threading
from collections import deque
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from contextlib import contextmanager
from datetime import timedelta
from functools import partial
from typing import Any

from ..errors import CheckpointError, CorruptCheckpointError, file_too_large
from ..format import compressed
from ..format.index import check_file_name, split_reference
from ..parallel import run_parallel
from .io_types import BLOCK, Segment

_STORES: dict[tuple[str, str], Any] = {}
# Ranges closer than this are fetched in one GET (one request costs ~ this many bytes).
COALESCE = 1024 * 1024
PART_BYTES = BLOCK  # 16 MiB multipart parts; S3 needs >= 5 MiB except the last
DEFAULT_RETRY = {
    "max_retries": 10,
    "retry_timeout": timedelta(minutes=3),
    "backoff": {
        "init_backoff": timedelta(milliseconds=100),
        "max_backoff": timedelta(seconds=15),
        "base": 2,
    },
}


def _obstore() -> Any:
    try:
        import obstore
    except ImportError:
        raise CheckpointError(
            "object-store URLs need obstore: pip install 'shardpoint[s3]' (or obstore)"
        ) from None
    return obstore


def _store(bucket_url: str, options: dict[str, Any]) -> Any:
    """One client per bucket and options: connections are pooled inside it."""
    # The environment is part of the key: it says which endpoint and credentials apply.
    env = os.environ.get("AWS_ENDPOINT_URL", "")
    key = (bucket_url, repr(sorted(options.items())) + env)
    if key not in _STORES:
        from obstore.store import from_url

        options = dict(options)
        client = dict(options.pop("client_options", {}))
        endpoint = options.get("endpoint") or os.environ.get("AWS_ENDPOINT_URL", "")
        if endpoint.startswith("http://"):
            client.setdefault("allow_http", True)  # a local S3-compatible server
        retry = options.pop("retry_config", DEFAULT_RETRY)
        _STORES[key] = from_url(bucket_url, client_options=client, retry_config=retry, **options)
    return _STORES[key]


class ObjectStoreDirectory:
    """A checkpoint "directory" under ``scheme://bucket/prefix``."""

    creates_exclusively = False  # (see ``write_small_durably``)

    def __init__(self, url: str, storage_options: dict[str, Any] | None = None) -> None:
        self.url = url.rstrip("/")
        self.root = self.url
        scheme, rest = self.url.split("://", 1)
        bucket, _, self.prefix = rest.partition("/")
        if not bucket:
            raise CheckpointError(f"{url}: no bucket in the URL (expected {scheme}://bucket/path)")
        self.obs = _obstore()
        self.store = _store(f"{scheme}://{bucket}", storage_options or {})
        self._tables: dict[str, compressed.Table | None] = {}  # name -> its compressed copy

    @property
    def where(self) -> str:
        return self.url

    def location(self, name: str) -> str:
        check_file_name(name, self.url)
        ref = split_reference(name)
        return f"{self.url.rsplit('/', 1)[0]}/{ref[0]}/{ref[1]}" if ref else f"{self.url}/{name}"

    def _key(self, name: str) -> str:
        check_file_name(name, self.url)
        ref = split_reference(name)
        if ref is None:
            return f"{self.prefix}/{name}" if self.prefix else name
        if not self.prefix:  # a checkpoint at the bucket's top has no siblings
            raise CorruptCheckpointError(f"{self.url}: {name} points outside the bucket")
        parent = self.prefix.rpartition("/")[0]
        return f"{parent}/{ref[0]}/{ref[1]}" if parent else f"{ref[0]}/{ref[1]}"

    # ---- listing and small objects ------------------------------------------------------

    def exists(self) -> bool:
        return bool(self.list())

    def list(self) -> list[str]:
        """File names directly under the prefix (a compressed copy by its file's name)."""
        prefix = f"{self.prefix}/" if self.prefix else ""
        with _typed_read_errors(self.where):
            listing = self.obs.list_with_delimiter(self.store, prefix=prefix or None)
        names = (m["path"][len(prefix) :] for m in listing["objects"])
        return sorted({n.removesuffix(compressed.SUFFIX) for n in names})

    def subdirectories(self) -> list[str]:
        prefix = f"{self.prefix}/" if self.prefix else ""
        with _typed_read_errors(self.where):
            listing = self.obs.list_with_delimiter(self.store, prefix=prefix or None)
        return sorted(p[len(prefix) :].rstrip("/") for p in listing["common_prefixes"])

    def size(self, name: str) -> int | None:
        """The size of ``name`` (of the original file, if stored compressed)."""
        with _typed_read_errors(self.location(name)):
            try:
                return int(self.obs.head(self.store, self._key(name))["size"])
            except FileNotFoundError:
                pass
        table = self._table(name)  # asked only once the plain object is not there
        return table.size if table is not None else None

    def modified(self, name: str) -> float | None:
        """When the object ``name`` was written (the store's clock), None if it is not there."""
        with _typed_read_errors(self.location(name)):
            try:
                return self.obs.head(self.store, self._key(name))["last_modified"].timestamp()
            except FileNotFoundError:
                return None

    def read_small(self, name: str, limit: int) -> bytes | None:
        """The whole object (None if absent), refusing one over ``limit`` bytes before
        reading its body."""
        with _typed_read_errors(self.location(name)):
            try:
                result = self.obs.get(self.store, self._key(name))
            except FileNotFoundError:
                return None
            size = int(result.meta["size"])
            if size > limit:
                raise file_too_large(self.location(name), size, limit)
            return bytes(result.bytes())

    def _table(self, name: str) -> compressed.Table | None:
        """The frame table of ``name``'s compressed copy, None if it is stored as is."""
        if name not in self._tables:
            key, where = self._key(name) + compressed.SUFFIX, self.location(name)
            with _typed_read_errors(where):
                try:
                    total = int(self.obs.head(self.store, key)["size"])
                except FileNotFoundError:
                    return None  # not cached: the plain object may appear (an upload)
                tail = bytes(
                    self.obs.get_range(self.store, key, start=max(0, total - 65536), end=total)
                )

                def read(lo: int, hi: int) -> bytes:
                    return bytes(self.obs.get_range(self.store, key, start=lo, end=hi))

                self._tables[name] = compressed.parse_table(tail, total, where, read)
        return self._tables[name]

    def _read_compressed(self, name: str, table: compressed.Table, lo: int, hi: int) -> bytes:
        if hi <= lo:
            return b""
        if hi > table.size:
            raise CorruptCheckpointError(f"{self.location(name)}: ends before byte {hi}")
        frames = table.frames(lo, hi)
        start, end = table.starts[frames.start], table.starts[frames.stop]
        with _typed_read_errors(self.location(name)):
            data = bytes(
                self.obs.get_range(
                    self.store, self._key(name) + compressed.SUFFIX, start=start, end=end
                )
            )
        return compressed.decompress(table, frames.start, data, lo, hi, self.location(name))

    def write_compressed(
        self, name: str, blocks: Iterator[memoryview], size: int, *, threads: int = 1
    ) -> None:
        """Upload ``name``'s ``size`` bytes (``blocks``, in order) as its compressed copy,
        compressing up to ``threads`` blocks at once; visible only once complete."""
        self._tables.pop(name, None)
        key = self._key(name) + compressed.SUFFIX
        if size <= compressed.BLOCK:  # one frame: one PUT, no threads, no multipart
            self.obs.put(self.store, key, b"".join(compressed.compress(blocks, size)))
            return
        with ThreadPoolExecutor(max(threads, 1), "shardpoint-compress") as pool:
            frames = compressed.compress(blocks, size, partial(_window, pool, max(threads, 1)))
            self.obs.put(
                self.store,
                key,
                frames,
                chunk_size=PART_BYTES,
                max_concurrency=max(threads, 1),
                use_multipart=True,
            )

    def read_range(self, name: str, lo: int, hi: int) -> bytes:
        if hi <= lo:  # stores refuse empty ranges
            return b""
        table = self._tables.get(name)
        if table is None:
            try:
                with _typed_read_errors(self.location(name)):
                    return bytes(self.obs.get_range(self.store, self._key(name), start=lo, end=hi))
            except FileNotFoundError:
                table = self._table(name)
                if table is None:
                    raise
        return self._read_compressed(name, table, lo, hi)

    def lock(self) -> _NoLock:
        """Object stores have no advisory locks: two writers to one prefix are not
        detected there (docs/storage.md); the marker is still written last."""
        return _NoLock()

    def write_small_durably(self, name: str, data: bytes, *, exclusive: bool = False) -> None:
        """One PUT: S3 makes an object visible whole or not at all. Nothing is created
        exclusively here (``exclusive`` is for local files): obstore's conditional PUT
        cannot be a multipart upload, and an object store has no lock either — one
        writer per prefix (docs/storage.md)."""
        self.obs.put(self.store, self._key(name), data, use_multipart=False)

    def open_writer(
        self, name: str, size: int, *, threads: int = 1, exclusive: bool = False
    ) -> _ObjectWriter:
        """An object of ``size`` bytes written piece by piece (``write(offset, data)``, in
        any order), uploaded as parallel multipart parts and visible only after
        ``close()``; ``abort()`` leaves no object. Never exclusive (see
        ``write_small_durably``)."""
        self._tables.pop(name, None)
        return _ObjectWriter(self, name, size, threads)

    def append_small(self, name: str, data: bytes) -> None:
        """Append to a small log object (objects cannot grow: read, then rewrite)."""
        old = self.read_small(name, 1 << 30) or b""
        self.write_small_durably(name, old + data)

    def delete(self, name: str) -> None:
        """Delete ``name``, stored as is or compressed."""
        self._tables.pop(name, None)
        for key in (self._key(name), self._key(name) + compressed.SUFFIX):
            try:
                self.obs.delete(self.store, key)
            except FileNotFoundError:
                pass

    # Directory operations are no-ops: a prefix exists while objects are under it.
    def prepare(self, *, durable: bool = True) -> None:
        return None

    def sync(self) -> None:
        return None

    def remove_if_empty(self) -> None:
        return None

    # ---- bulk I/O -------------------------------------------------------------------------

    def write_files(
        self, files: dict[str, tuple[int, list[Segment]]], *, threads: int, direct: bool = True
    ) -> None:
        """Upload each file from its segments (which tile it) as a parallel multipart
        upload (not exclusively: see ``write_small_durably``). A failed upload is
        aborted, and on failure the objects this call created are deleted: no partial
        object remains."""
        created: list[str] = []

        def upload(item: tuple[str, tuple[int, list[Segment]]]) -> None:
            name, (size, segments) = item
            parts = _parts(sorted(segments, key=lambda s: s.offset), size)
            self.obs.put(
                self.store,
                self._key(name),
                parts,
                chunk_size=PART_BYTES,
                max_concurrency=max(threads, 1),
                use_multipart=size > PART_BYTES,
            )
            created.append(name)

        try:
            _each(upload, list(files.items()), threads)
        except BaseException:
            for name in created:
                self.delete(name)
            raise

    def read_ranges(
        self,
        requests: dict[str, list[Segment]],
        *,
        threads: int,
        direct: bool = True,
        on_segment: Callable[[Segment], None] | None = None,
    ) -> None:
        """Fill every segment from ranged GETs (parallel, ranges under 1 MiB apart merged)."""

        def fetch(item: tuple[str, list[Segment]]) -> None:
            name, segments = item
            wanted = [s for s in segments if s.end > s.offset]
            for s in segments:
                if s.end == s.offset and on_segment:
                    on_segment(s)
            if not wanted:
                return
            table = self._tables.get(name)
            if table is None:  # the plain object first: no extra request when it is there
                try:
                    with _typed_read_errors(self.location(name)):
                        got = self.obs.get_ranges(
                            self.store,
                            self._key(name),
                            starts=[s.offset for s in wanted],
                            ends=[s.end for s in wanted],
                            coalesce=COALESCE,
                        )
                except FileNotFoundError:
                    table = self._table(name)
                    if table is None:
                        raise
            if table is not None:
                for s in wanted:
                    s.array[:] = memoryview(self._read_compressed(name, table, s.offset, s.end))
                    if on_segment:
                        on_segment(s)
                return
            for s, data in zip(wanted, got):
                view = memoryview(data)
                if len(view) != s.end - s.offset:
                    raise CorruptCheckpointError(
                        f"{self.location(name)}: object is truncated (ends before byte {s.end})"
                    )
                s.array[:] = view
                if on_segment:
                    on_segment(s)

        _each(fetch, list(requests.items()), threads)

    def iter_bytes(self, name: str, block: int) -> Iterator[memoryview]:
        size = self.size(name) or 0
        for lo in range(0, size, block):
            yield memoryview(self.read_range(name, lo, min(lo + block, size)))


@contextmanager
def _typed_read_errors(where: str) -> Iterator[None]:
    """A store that stays unreachable after the retries (network, credentials, 5xx) is a
    ``CorruptCheckpointError`` on reads, so that restore falls back to another copy."""
    try:
        yield
    except FileNotFoundError:
        raise  # "absent" is an answer the callers handle
    except OSError as exc:
        raise _unreadable(where, exc) from exc
    except Exception as exc:
        from obstore.exceptions import BaseError

        if not isinstance(exc, BaseError):
            raise
        raise _unreadable(where, exc) from exc


def _unreadable(where: str, exc: BaseException) -> CorruptCheckpointError:
    return CorruptCheckpointError(
        f"{where}: cannot be read ({type(exc).__name__}: {str(exc).splitlines()[0]}); check "
        "the store's address, credentials and network, or load an earlier checkpoint"
    )


def _parts(segments: list[Segment], size: int) -> Iterator[memoryview]:
    """The file's bytes in order: segments, zeros for any gap between them."""
    pos = 0
    for s in segments:
        if s.offset > pos:
            yield memoryview(bytes(s.offset - pos))
        if s.end > s.offset:
            yield memoryview(s.array)
        pos = max(pos, s.end)
    if size > pos:
        yield memoryview(bytes(size - pos))


def _window(pool: ThreadPoolExecutor, width: int, fn: Callable, items: Iterator[Any]) -> Iterator:
    """``map(fn, items)`` with up to ``width`` calls at once, reading ``items`` only as
    far ahead as that (a file's blocks are never all in memory)."""
    pending: deque[Any] = deque()
    for item in items:
        pending.append(pool.submit(fn, item))
        if len(pending) >= width:
            yield pending.popleft().result()
    while pending:
        yield pending.popleft().result()


def _each(fn: Callable[[Any], None], items: list[Any], threads: int) -> None:
    run_parallel(fn, items, threads, "shardpoint-object")


class _ObjectWriter:
    """Pieces arrive in any order from several threads; the upload needs them in order.

    Each piece is copied when it arrives (the caller reuses its buffer at once) and
    held until the bytes before it have been handed on. The writer uploads full parts
    in parallel while later pieces arrive.
    """

    def __init__(self, directory: ObjectStoreDirectory, name: str, size: int, threads: int) -> None:
        self.where, self.size = directory.location(name), size
        self._file = directory.obs.open_writer(
            directory.store,
            directory._key(name),
            buffer_size=PART_BYTES,
            max_concurrency=max(threads, 1),
        )
        self._next = 0
        self._waiting: dict[int, bytes] = {}
        self._lock = threading.Lock()

    def write(self, offset: int, data: memoryview) -> None:
        piece = bytes(data[: max(self.size - offset, 0)])  # cut any padding past the end
        with self._lock:
            self._waiting[offset] = piece
            while self._next in self._waiting and self._next < self.size:
                piece = self._waiting.pop(self._next)
                self._file.write(piece)
                self._next += len(piece)

    def close(self) -> None:
        if self._next != self.size:
            self.abort()
            raise OSError(f"{self.where}: {self.size - self._next} bytes were never written")
        self._file.close()

    def abort(self) -> None:
        """Abort the multipart upload: the object never appears and no parts stay
        behind. (obstore aborts when its writer is left through an exception.)"""
        self._waiting.clear()
        error = OSError(f"{self.where}: upload aborted")
        try:
            self._file.__exit__(OSError, error, None)
        except Exception:  # best effort: an unfinished upload is never visible either
            pass


class _NoLock:
    def acquire(self) -> None:
        pass

    def release(self) -> None:
        pass
