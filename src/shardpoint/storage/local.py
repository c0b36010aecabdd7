"""Local file system backend: a checkpoint directory of a local (or shared POSIX) file
system. Bulk I/O runs on the O_DIRECT engine (``direct_io.py``); this module adds what
makes a directory a checkpoint directory: names that cannot escape it, special files
refused, small files replaced atomically, and the one-writer lock."""

from __future__ import annotations

import errno
import fcntl
import mmap
import os
import warnings
from collections.abc import Callable, Iterator
from pathlib import Path

from ..errors import ConcurrentWriterError, CorruptCheckpointError, file_too_large
from ..format.index import check_file_name, split_reference
from . import direct_io
from .direct_io import (
    FILE_MODE,
    fsync_directory,
    open_regular,
    pread_into,
    pwrite_all,
    typed_read_errors,
)
from .io_types import Segment

# flock refused by the file system itself, not by another holder of the lock.
_NO_FLOCK = {errno.ENOSYS, errno.EOPNOTSUPP, errno.ENOTSUP, errno.ENOLCK}
_WARNED_NO_LOCK: set[str] = set()


def _warn_no_lock(directory: Path, exc: OSError) -> None:
    where = str(directory.parent)
    if where not in _WARNED_NO_LOCK:
        _WARNED_NO_LOCK.add(where)
        warnings.warn(
            f"{directory}: this file system has no flock ({exc.strerror or exc}); saves are "
            "not guarded against a second job writing the same checkpoint",
            stacklevel=4,
        )


class WriterLock:
    """An exclusive advisory lock (``flock``) on a directory, held by one writer.

    Two processes saving into one checkpoint directory (e.g. a misconfigured requeue)
    would delete and overwrite each other's files; the second one is refused instead.
    The kernel drops the lock when its holder dies, so a crash never leaves it stale.
    """

    def __init__(self, directory: Path) -> None:
        self.directory = directory
        self._fd: int | None = None

    def acquire(self) -> None:
        fd = os.open(self.directory, os.O_RDONLY | os.O_DIRECTORY)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError as exc:
            if exc.errno not in _NO_FLOCK:
                os.close(fd)
                if isinstance(exc, BlockingIOError):
                    raise self._busy() from None
                raise
            # A file system without flock (Lustre mounted noflock, some FUSE): saves go
            # on unguarded against a second writer, said once.
            os.close(fd)
            _warn_no_lock(self.directory, exc)
            return
        except BaseException:
            os.close(fd)
            raise
        try:
            # Locked, but maybe a directory another process removed meanwhile (it was
            # empty) and that a third has created again: the lock would guard nothing.
            here, locked = os.stat(self.directory), os.fstat(fd)
            if (here.st_dev, here.st_ino) != (locked.st_dev, locked.st_ino):
                raise FileNotFoundError(f"{self.directory}: was removed while being locked")
        except BaseException:
            os.close(fd)
            raise
        self._fd = fd

    def _busy(self) -> ConcurrentWriterError:
        return ConcurrentWriterError(
            f"{self.directory}: another process is writing to or deleting this "
            "checkpoint right now; two jobs must not share a checkpoint directory. "
            "Stop the other job or give this one its own directory."
        )

    def release(self) -> None:
        if self._fd is not None:
            os.close(self._fd)  # closing drops the lock
            self._fd = None


def _is_dir(entry: os.DirEntry[str]) -> bool:
    try:
        return entry.is_dir()  # follows symlinks, as a reader opening the name would
    except OSError:  # a symlink loop: not a directory, and its readers say what it is
        return False


def _outside(path: Path, top: Path) -> bool:
    real, root = os.path.realpath(path), os.path.realpath(top)
    return os.path.commonpath([real, root]) != root


class LocalDirectory:
    """A checkpoint directory on a local (or shared POSIX) file system."""

    creates_exclusively = True

    def __init__(self, root: str | os.PathLike[str]) -> None:
        self.root = Path(root)

    @property
    def where(self) -> str:
        return str(self.root)

    def location(self, name: str) -> str:
        return str(self.path(name))

    def exists(self) -> bool:
        with typed_read_errors(self.root):
            return self.root.is_dir()

    def list(self) -> list[str]:
        """Names in the directory that are not directories (none if it does not exist):
        a FIFO or socket is listed, so that the readers refuse it by name."""
        return sorted(name for name, is_dir in self._entries() if not is_dir)

    def subdirectories(self) -> list[str]:
        return sorted(name for name, is_dir in self._entries() if is_dir)

    def _entries(self) -> list[tuple[str, bool]]:
        with typed_read_errors(self.root):
            if not self.root.is_dir():
                return []
            with os.scandir(self.root) as it:
                return [(e.name, _is_dir(e)) for e in it]

    def read_range(self, name: str, lo: int, hi: int) -> bytes:
        path = self.path(name)
        with typed_read_errors(path):
            fd = open_regular(path, os.O_RDONLY)
            try:
                buf = bytearray(hi - lo)
                n = pread_into(fd, memoryview(buf), lo)
                return bytes(buf[:n])
            finally:
                os.close(fd)

    def iter_bytes(self, name: str, block: int) -> Iterator[memoryview]:
        """The file in blocks; each view is valid until the next one is taken."""
        path = self.path(name)
        buf = bytearray(block)
        view = memoryview(buf)
        with typed_read_errors(path):
            fd = open_regular(path, os.O_RDONLY)
            with open(fd, "rb", buffering=0) as f:
                while n := f.readinto(buf):
                    yield view[:n]

    def delete(self, name: str) -> None:
        self.path(name).unlink(missing_ok=True)

    def open_writer(
        self, name: str, size: int, *, threads: int = 1, exclusive: bool = False
    ) -> direct_io.StreamingFile:
        """A file of ``size`` bytes written piece by piece (``write(offset, data)``), made
        durable by ``close()``; ``abort()`` removes it. ``exclusive``: refuse a name that
        exists (``FileExistsError``) instead of replacing it."""
        return direct_io.StreamingFile(self.path(name), size, exclusive=exclusive)

    def map_file(self, name: str) -> mmap.mmap:
        """A read-only memory map of a regular file (pages stream through the cache)."""
        path = self.path(name)
        with typed_read_errors(path):
            with open(open_regular(path, os.O_RDONLY), "rb") as f:
                return mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ)

    def append_small(self, name: str, data: bytes) -> None:
        """Append to a small log file (not durable: the event log is best effort)."""
        with open(self.path(name), "ab") as f:
            f.write(data)

    def prepare(self, *, durable: bool = True) -> None:
        """Create the directory and (``durable``) make its entry durable in the parent;
        a rank that does not commit leaves that to the one that does."""
        if self.root.exists() and not self.root.is_dir():
            raise NotADirectoryError(f"{self.root}: exists and is not a directory")
        self.root.mkdir(parents=True, exist_ok=True)
        if durable:
            fsync_directory(self.root.parent)

    def sync(self) -> None:
        fsync_directory(self.root)

    def lock(self) -> WriterLock:
        """The writer lock of this directory (which must exist to be locked)."""
        return WriterLock(self.root)

    def remove_if_empty(self) -> None:
        try:
            self.root.rmdir()  # only succeeds when nothing else is in the directory
        except OSError:
            pass

    def path(self, name: str) -> Path:
        """The path of file ``name``, refusing anything that escapes the directory."""
        check_file_name(name, str(self.root))
        ref = split_reference(name)
        # A reference names a sibling checkpoint's file: it may not leave the parent.
        top = self.root.parent if ref else self.root
        path = top / ref[0] / ref[1] if ref else self.root / name
        with typed_read_errors(path):
            escapes = (ref is not None or path.is_symlink()) and _outside(path, top)
        if escapes:
            raise CorruptCheckpointError(
                f"{path}: symlink points outside the checkpoint directory; refusing to read it"
            )
        return path

    def size(self, name: str) -> int | None:
        """The size of ``name``, None if it does not exist. Any kind of file has a size;
        the readers refuse what is not a regular file when they open it."""
        path = self.path(name)
        with typed_read_errors(path):
            try:
                return path.stat().st_size
            except FileNotFoundError:
                return None

    def modified(self, name: str) -> float | None:
        """When ``name`` was last written (seconds since the epoch), None if it does not exist."""
        path = self.path(name)
        with typed_read_errors(path):
            try:
                return path.stat().st_mtime
            except FileNotFoundError:
                return None

    def read_small(self, name: str, limit: int) -> bytes | None:
        """The whole of ``name`` (None if it does not exist), refusing one over ``limit``
        bytes before reading it: a hostile sparse file must not exhaust memory."""
        path = self.path(name)
        with typed_read_errors(path):
            try:
                fd = open_regular(path, os.O_RDONLY)
            except FileNotFoundError:
                return None
            with open(fd, "rb") as f:
                size = os.fstat(fd).st_size
                if size > limit:
                    raise file_too_large(str(path), size, limit)
                return f.read(limit + 1)[:limit]

    def write_small_durably(self, name: str, data: bytes, *, exclusive: bool = False) -> None:
        """Write, fsync, then rename into place: readers see all of ``data`` or nothing.

        ``exclusive``: create ``name`` itself, refusing one that exists
        (``FileExistsError``) — for a file a commit marker covers, which no reader looks
        at before the marker exists, so it need not appear whole."""
        final = self.path(name)
        if exclusive:
            fd = os.open(final, os.O_WRONLY | os.O_CREAT | os.O_EXCL, FILE_MODE)
            try:
                pwrite_all(fd, memoryview(data), 0)
                os.fsync(fd)
            except BaseException:
                final.unlink(missing_ok=True)
                raise
            finally:
                os.close(fd)
            return
        tmp = final.with_name(final.name + ".tmp")
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, FILE_MODE)
        try:
            try:
                pwrite_all(fd, memoryview(data), 0)
                os.fsync(fd)
            finally:
                os.close(fd)
            os.replace(tmp, final)
        except BaseException:
            tmp.unlink(missing_ok=True)
            raise

    def write_files(
        self, files: dict[str, tuple[int, list[Segment]]], *, threads: int, direct: bool = True
    ) -> None:
        """Create each file (name -> (size, segments)), refusing a name that exists, write
        it with parallel block jobs, then fsync (``direct_io.write_files``)."""
        paths = {self.path(name): spec for name, spec in files.items()}
        direct_io.write_files(paths, threads=threads, direct=direct)

    def read_ranges(
        self,
        requests: dict[str, list[Segment]],
        *,
        threads: int,
        direct: bool = True,
        on_segment: Callable[[Segment], None] | None = None,
    ) -> None:
        """Fill every destination segment from its file (name -> segments), in parallel
        (``direct_io.read_ranges``)."""
        paths = {self.path(name): segments for name, segments in requests.items()}
        direct_io.read_ranges(paths, threads=threads, direct=direct, on_segment=on_segment)
