"""The O_DIRECT engine: parallel block I/O between tensor memory and local files.

Writes use O_DIRECT, which measured several times faster than buffered writes + fsync
on the benchmark machine (docs/benchmarks.md). A large tensor whose address and file
offset agree modulo the page size is written straight from its memory; everything
else is copied into page-aligned bounce buffers first. File systems without O_DIRECT
(tmpfs, some FUSE mounts) fall back to buffered writes from tensor memory.

Reads of segments of ZERO_COPY_MIN_BYTES or more use O_DIRECT for files that are not in
the page cache and the cache for those that are; smaller segments always go through the
cache, straight into their memory (see ``read_ranges``). ``storage/local.py`` is the only
backend built on this module and the only user of its I/O engine (``write_files``,
``read_ranges``, ``StreamingFile``); ``convert.py`` and ``training/tiers.py`` import just
the file helpers ``fsync_directory`` and ``link_new``.

One module although long: writes and reads share the alignment rules, the bounce-buffer
pool and the buffered fallback, and they are tested together as one engine.
"""

from __future__ import annotations

import bisect
import errno
import mmap
import os
import stat
import threading
from collections.abc import Callable, Iterable, Iterator
from concurrent.futures import ThreadPoolExecutor
from contextlib import contextmanager
from itertools import accumulate
from pathlib import Path

import torch

from ..errors import CorruptCheckpointError
from .io_types import ALIGN, BLOCK, ZERO_COPY_MIN_BYTES, Segment

# Reading a gap this small costs less than another system call.
COALESCE_GAP = 64 * 1024
_DIRECT = getattr(os, "O_DIRECT", 0)
_MAX_IO = 1 << 30  # Linux moves at most ~2 GiB per call; stay well below it.
FILE_MODE = 0o644  # data, not programs


def open_regular(path: Path, flags: int) -> int:
    """Open ``path`` for reading, refusing anything but a regular file.

    O_NONBLOCK keeps a FIFO from blocking ``open`` forever (it is a no-op on regular
    files); the fstat check then refuses FIFOs, sockets, devices and directories.
    """
    fd = os.open(path, flags | os.O_NONBLOCK)
    try:
        mode = os.fstat(fd).st_mode
        if not stat.S_ISREG(mode):
            raise CorruptCheckpointError(
                f"{path}: is a {_kind(mode)}, not a regular file; the checkpoint is damaged "
                "(or was unpacked wrongly), load an earlier one"
            )
    except BaseException:
        os.close(fd)
        raise
    return fd


def _kind(mode: int) -> str:
    for test, name in (
        (stat.S_ISDIR, "directory"),
        (stat.S_ISFIFO, "FIFO"),
        (stat.S_ISSOCK, "socket"),
        (stat.S_ISCHR, "character device"),
        (stat.S_ISBLK, "block device"),
    ):
        if test(mode):
            return name
    return "special file"


@contextmanager
def typed_read_errors(where: str | os.PathLike[str]) -> Iterator[None]:
    """Turn an OS error while reading a checkpoint into ``CorruptCheckpointError``.

    Callers (``restore`` above all) fall back to an earlier checkpoint on a
    ``CheckpointError``; a raw ``PermissionError`` or ``ELOOP`` would end the job instead.
    """
    try:
        yield
    except OSError as exc:
        raise CorruptCheckpointError(
            f"{where}: cannot be read ({exc.strerror or exc}); check its permissions and the "
            "disk, or load an earlier checkpoint"
        ) from exc


class _BouncePool:
    """Page-aligned buffers shared by all I/O jobs of the process and kept between calls.

    Faulting in fresh pages costs more than the I/O of small checkpoints (55 ms for
    64 MB on the benchmark machine), so buffers live as long as the process: at most
    one per concurrently running job, BLOCK bytes each.
    """

    def __init__(self) -> None:
        self._free: list[Segment] = []
        self._lock = threading.Lock()

    @contextmanager
    def buffer(self, offset: int) -> Iterator[Segment]:
        with self._lock:
            buf = self._free.pop() if self._free else None
        if buf is None:
            flags = mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS | getattr(mmap, "MAP_POPULATE", 0)
            buf = Segment(0, torch.frombuffer(mmap.mmap(-1, BLOCK, flags=flags), dtype=torch.uint8))
        buf.offset = offset
        try:
            yield buf
        finally:
            with self._lock:
                self._free.append(buf)


_BOUNCE = _BouncePool()


class _Completion:
    """Counts the bytes still to arrive per segment; calls back when one is complete."""

    def __init__(self, segments: list[Segment], callback: Callable[[Segment], None] | None) -> None:
        self.callback = callback
        self.left = {id(s): s.end - s.offset for s in segments}
        self.lock = threading.Lock()
        if callback:
            for s in segments:
                if s.end == s.offset:
                    callback(s)

    def add(self, s: Segment, n: int) -> None:
        if self.callback is None:
            return
        if n == s.end - s.offset:  # all of it at once (small segments): nothing to count
            self.callback(s)
            return
        with self.lock:
            self.left[id(s)] -= n
            complete = self.left[id(s)] == 0
        if complete:
            self.callback(s)


def _in_page_cache(path: Path, segments: list[Segment]) -> bool:
    """Whether the first, middle and last byte wanted are cached (non-blocking probes)."""
    flag = getattr(os, "RWF_NOWAIT", None)
    if flag is None or not segments:
        return False
    probe = bytearray(1)
    fd = open_regular(path, os.O_RDONLY)
    try:
        for offset in (
            segments[0].offset,
            segments[len(segments) // 2].offset,
            segments[-1].end - 1,
        ):
            try:
                if os.preadv(fd, [probe], offset, flag) != 1:
                    return False
            except OSError:  # EAGAIN: not cached; EOPNOTSUPP: cannot tell
                return False
        return True
    finally:
        os.close(fd)


def _open(path: Path, flags: int, direct: bool) -> tuple[int, bool]:
    def attempt(f: int) -> int:
        return os.open(path, f, FILE_MODE) if flags & os.O_WRONLY else open_regular(path, f)

    if direct and _DIRECT:
        try:
            return attempt(flags | _DIRECT), True
        except OSError as exc:
            if exc.errno != errno.EINVAL:
                raise
    return attempt(flags), False


def pwrite_all(fd: int, data: memoryview, offset: int) -> None:
    pos = 0
    while pos < len(data):
        pos += os.pwrite(fd, data[pos : pos + _MAX_IO], offset + pos)


def open_for_write(path: Path, direct: bool, *, exclusive: bool = False) -> tuple[int, bool]:
    """Create or truncate ``path`` for writing, with O_DIRECT where asked and the file
    system has it; returns the descriptor and whether it is direct (writes then need
    whole pages from page-aligned memory). ``exclusive``: create it, refusing one that
    exists (``FileExistsError``) instead of truncating it."""
    if exclusive:
        # Claimed without O_DIRECT: a file system that refuses O_DIRECT does so only
        # after creating the file, and the retry must not find its own file there.
        os.close(os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, FILE_MODE))
        try:
            return _open(path, os.O_WRONLY, direct)
        except BaseException:
            path.unlink(missing_ok=True)
            raise
    return _open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, direct)


def pread_into(fd: int, buf: memoryview, offset: int) -> int:
    """Fill ``buf`` from ``offset``; returns the bytes read (short only at end of file)."""
    pos = 0
    while pos < len(buf):
        n = os.preadv(fd, [buf[pos : pos + _MAX_IO]], offset + pos)
        if n == 0:
            break
        pos += n
    return pos


def _copy(dst: Segment, src: Segment, lo: int, hi: int) -> None:
    """Copy file bytes ``[lo, hi)`` from one segment to another.

    numpy for small pieces, where torch's dispatch costs ~20x the copy itself; torch
    for large ones, which it copies without holding the GIL.
    """
    d, s = lo - dst.offset, lo - src.offset
    if hi - lo < 65536:
        dst.array[d : d + hi - lo] = src.array[s : s + hi - lo]
    else:
        dst.data[d : d + hi - lo].copy_(src.data[s : s + hi - lo])


def link_new(tmp: Path, path: Path) -> None:
    """Give the file ``tmp`` the name ``path``, which must not exist (``FileExistsError``,
    also for a dangling link): a hard link, which refuses an existing name atomically;
    where the file system has none (exFAT, many FUSE mounts: gcsfuse, s3fs, blobfuse), a
    rename after checking the name is free. ``tmp`` may be gone afterwards."""
    try:
        os.link(tmp, path)
    except FileExistsError:
        raise
    except OSError:
        if os.path.lexists(path):
            raise FileExistsError(errno.EEXIST, "File exists", str(path)) from None
        os.rename(tmp, path)


def fsync_directory(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def write_files(
    files: dict[Path, tuple[int, list[Segment]]], *, threads: int, direct: bool
) -> None:
    """Create each file (path -> (size, segments)), refusing one that exists (another
    writer's), write it with parallel block jobs, then fsync. On failure the files it
    created are removed, and only those."""
    fds: list[int] = []
    created: list[Path] = []
    try:
        jobs: list[Callable[[], None]] = []
        for path, (size, segments) in files.items():
            fd, is_direct = open_for_write(path, direct, exclusive=True)
            created.append(path)
            fds.append(fd)
            segments = sorted(segments, key=lambda s: s.offset)
            if not is_direct:
                jobs.extend(_buffered_write(fd, s) for s in segments)
                continue
            interiors = _zero_copy_interiors(segments)
            jobs.extend(_zero_copy_write(fd, s, lo, hi) for lo, hi, s in _blocks(interiors))
            spans = _gaps(interiors, _padded(size))
            by_offset = _ByOffset(segments)
            jobs.extend(_bounce_write(fd, by_offset, lo, hi, size) for lo, hi in spans)
        _run(jobs, threads)
        _run(
            [_truncate_and_sync(fd, size) for fd, (size, _) in zip(fds, files.values())],
            threads,
        )
    except BaseException:
        for path in created:
            path.unlink(missing_ok=True)
        raise
    finally:
        for fd in fds:
            os.close(fd)


def read_ranges(
    requests: dict[Path, list[Segment]],
    *,
    threads: int,
    direct: bool,
    on_segment: Callable[[Segment], None] | None,
) -> None:
    """Fill every destination segment from its file (path -> segments), in parallel.

    Segments of ZERO_COPY_MIN_BYTES or more of a file whose pages are in the page
    cache are read through it (8 GB/s warm on the benchmark machine); those of one that
    is not, with O_DIRECT (2.2x faster than buffered cold reads there), zero-copy into
    congruent tensors like writes. Smaller segments are always read through the cache,
    coalesced into spans and straight into their memory (``preadv``), so 10,000 small
    tensors cost a handful of calls and no bounce copy. ``direct=False`` reads
    everything through the cache (small lazy reads).
    ``on_segment(s)`` runs on an I/O thread as soon as all of ``s`` is in place, so
    checksums overlap the reads.
    """
    fds: list[int] = []
    try:
        jobs: list[Callable[[], None]] = []
        done = _Completion([s for ss in requests.values() for s in ss], on_segment)
        for path, segments in requests.items():
            where = str(path)
            segments = sorted((s for s in segments if s.end > s.offset), key=lambda s: s.offset)
            large = [s for s in segments if s.end - s.offset >= ZERO_COPY_MIN_BYTES]
            small = [s for s in segments if s.end - s.offset < ZERO_COPY_MIN_BYTES]
            with typed_read_errors(path):
                use_direct = bool(large) and direct and not _in_page_cache(path, large)
                fd, use_direct = _open(path, os.O_RDONLY, use_direct)
                fds.append(fd)
                # Small tensors always go through the page cache, straight into their
                # memory: O_DIRECT would read them into a bounce buffer and copy each
                # out (10,000 small tensors cold: 22.6 -> 19.8 us each, benchmarks.md).
                cached = open_regular(path, os.O_RDONLY) if use_direct and small else fd
                if cached != fd:
                    fds.append(cached)
            if use_direct:
                interiors = _zero_copy_interiors(large)
                jobs.extend(
                    _read_into(fd, s, lo, hi, where, done) for lo, hi, s in _blocks(interiors)
                )
                spans = _bounce_read_spans(large, interiors)
                by_offset = _ByOffset(large)
                # A bounce span may cross another segment's zero-copy interior (segments
                # that overlap): each byte of a segment comes from one read only, or its
                # completion would be counted twice, and reported before all of it is in.
                inner = {id(s): (lo, hi) for lo, hi, s in interiors}
                jobs.extend(
                    _bounce_read(fd, by_offset, lo, hi, where, done, inner) for lo, hi in spans
                )
            else:
                for s in large:
                    jobs.extend(
                        _read_into(fd, s, lo, hi, where, done) for lo, hi in _split(s.offset, s.end)
                    )
            jobs.extend(
                _scatter_read(cached, small, lo, hi, where, done) for lo, hi in _coalesce(small)
            )
        _run(jobs, threads)
    finally:
        for fd in fds:
            os.close(fd)


class StreamingFile:
    """One file written in pieces, in any order and from any thread (the staged slots
    of an async save, a copy from another backend), then made durable by ``close``.

    Every piece must start at a page boundary. A page-aligned piece of whole pages is
    written as it is; any other goes through a bounce buffer. Bytes past the file's
    size (the zeroed page padding of a staging slot) are cut off. The file is written
    as ``NAME.tmp`` and renamed on ``close``: like an object, it appears whole or not
    at all. ``exclusive``: neither ``NAME.tmp`` nor ``NAME`` may exist (another
    writer's): the first is created exclusively, the second made a link that refuses
    an existing name, instead of a rename over it.
    """

    def __init__(self, path: Path, size: int, *, exclusive: bool = False) -> None:
        self.path, self.size, self.exclusive = path, size, exclusive
        self.tmp = path.with_name(path.name + ".tmp")
        self.fd: int | None = None
        self.fd, self.direct = open_for_write(self.tmp, True, exclusive=exclusive)

    def write(self, offset: int, data: memoryview) -> None:
        if offset % ALIGN:
            raise ValueError(f"{self.path}: pieces must start at a page boundary ({offset})")
        if not self.direct:
            pwrite_all(self.fd, data[: max(self.size - offset, 0)], offset)
            return
        data = data[: max(_padded(self.size) - offset, 0)]
        if len(data) % ALIGN == 0 and _address(data) % ALIGN == 0:
            pwrite_all(self.fd, data, offset)
            return
        for lo in range(0, len(data), BLOCK):
            piece = data[lo : lo + BLOCK]
            with _BOUNCE.buffer(offset + lo) as buf:
                buf.array[: len(piece)] = piece
                n = _padded(len(piece))
                buf.array[len(piece) : n] = 0
                pwrite_all(self.fd, memoryview(buf.array)[:n], offset + lo)

    def close(self) -> None:
        """Cut the page padding, fsync, rename into place (made durable in the directory
        by the commit's directory sync, or the caller's). On failure nothing of it
        stays."""
        assert self.fd is not None
        fd, self.fd = self.fd, None
        try:
            try:
                _truncate_and_sync(fd, self.size)()
            finally:
                os.close(fd)
            if self.exclusive:
                link_new(self.tmp, self.path)  # FileExistsError: the name is another's
                self.tmp.unlink(missing_ok=True)
            else:
                os.replace(self.tmp, self.path)
        except BaseException:
            self.tmp.unlink(missing_ok=True)
            raise

    def abort(self) -> None:
        """Close and remove the file: a failed write leaves nothing behind."""
        fd, self.fd = self.fd, None
        try:
            if fd is not None:
                os.close(fd)
        finally:
            self.tmp.unlink(missing_ok=True)


def _padded(n: int) -> int:
    return -(-n // ALIGN) * ALIGN


def _address(view: memoryview) -> int:
    import numpy as np

    return int(np.frombuffer(view, dtype=np.uint8).ctypes.data) if len(view) else 0


def _run(jobs: list[Callable[[], None]], threads: int) -> None:
    if threads <= 1 or len(jobs) <= 1:
        for job in jobs:
            job()
        return
    with ThreadPoolExecutor(max_workers=threads, thread_name_prefix="shardpoint-io") as pool:
        futures = [pool.submit(job) for job in jobs]
        for future in futures:
            future.result()


# ---- planning: which bytes move zero-copy, which through bounce buffers -------------


def _zero_copy_interiors(segments: list[Segment]) -> list[tuple[int, int, Segment]]:
    """Page-aligned file ranges that can move straight between the file and tensor memory.

    O_DIRECT needs the memory address, the file offset and the length page aligned. When
    a tensor's address and its file offset are congruent modulo the page size, every
    whole page inside it qualifies. A save that writes from tensor memory (not from
    staging slots) pads each file's header so the data starts at the page offset most
    of the file's large tensors have in memory (``layout._data_start_mod``).
    """
    out = []
    for s in segments:
        if s.data.numel() < ZERO_COPY_MIN_BYTES or (s.data.data_ptr() - s.offset) % ALIGN:
            continue
        lo, hi = -(-s.offset // ALIGN) * ALIGN, s.end // ALIGN * ALIGN
        if hi > lo:
            out.append((lo, hi, s))
    return out


def _blocks(ranges: list[tuple[int, int, Segment]]) -> Iterable[tuple[int, int, Segment]]:
    for lo, hi, s in ranges:
        for a in range(lo, hi, BLOCK):
            yield a, min(a + BLOCK, hi), s


def _split(lo: int, hi: int) -> Iterable[tuple[int, int]]:
    for a in range(lo, hi, BLOCK):
        yield a, min(a + BLOCK, hi)


def _gaps(interiors: list[tuple[int, int, Segment]], end: int) -> list[tuple[int, int]]:
    """Page-aligned spans of ``[0, end)`` not covered by the interiors, at most BLOCK long."""
    spans, pos = [], 0
    for lo, hi, _ in sorted(interiors, key=lambda r: r[0]):
        spans.extend(_split(pos, lo))
        pos = hi
    spans.extend(_split(pos, end))
    return spans


def _bounce_read_spans(
    segments: list[Segment], interiors: list[tuple[int, int, Segment]]
) -> list[tuple[int, int]]:
    """Page-aligned spans covering what the interiors leave of the segments, merged."""
    inner = {id(s): (lo, hi) for lo, hi, s in interiors}
    pieces: list[tuple[int, int]] = []
    for s in segments:
        if s.data.numel() == 0:
            continue
        if id(s) in inner:
            lo, hi = inner[id(s)]
            pieces += [(a, b) for a, b in ((s.offset, lo), (hi, s.end)) if b > a]
        else:
            pieces.append((s.offset, s.end))
    merged: list[list[int]] = []
    for a, b in sorted(pieces):
        a, b = a // ALIGN * ALIGN, -(-b // ALIGN) * ALIGN
        if merged and a <= merged[-1][1]:
            merged[-1][1] = max(merged[-1][1], b)
        else:
            merged.append([a, b])
    return [span for a, b in merged for span in _split(a, b)]


def _coalesce(segments: list[Segment]) -> list[tuple[int, int]]:
    """Disjoint spans covering sorted segments, each segment inside one: gaps under
    COALESCE_GAP are bridged up to BLOCK long; a segment that overlaps the span so far
    (two regions of one stored range) always joins it."""
    spans: list[list[int]] = []
    for s in segments:
        if spans and (
            s.offset < spans[-1][1]
            or (s.offset - spans[-1][1] <= COALESCE_GAP and s.end - spans[-1][0] <= BLOCK)
        ):
            spans[-1][1] = max(spans[-1][1], s.end)
        else:
            spans.append([s.offset, s.end])
    return [(a, b) for a, b in spans]


class _ByOffset:
    """Segments sorted by offset, and the furthest end any of the first i + 1 reaches:
    finds every segment that shares a byte with a span, also when segments overlap
    each other (an earlier, longer one may reach past a later one's start)."""

    def __init__(self, segments: list[Segment]) -> None:
        self.segments = segments
        self.reach = list(accumulate((s.end for s in segments), max))

    def overlapping(self, lo: int, hi: int) -> Iterator[Segment]:
        segments = self.segments
        i = bisect.bisect_right(self.reach, lo)  # every one before ends at or before lo
        while i < len(segments) and segments[i].offset < hi:
            if segments[i].end > lo:
                yield segments[i]
            i += 1


# ---- jobs ------------------------------------------------------------------------------


def _zero_copy_write(fd: int, s: Segment, lo: int, hi: int) -> Callable[[], None]:
    return lambda: pwrite_all(fd, memoryview(s.array)[lo - s.offset : hi - s.offset], lo)


def _bounce_write(fd: int, segments: _ByOffset, lo: int, hi: int, size: int) -> Callable[[], None]:
    def job() -> None:
        with _BOUNCE.buffer(lo) as buf:
            end = min(hi, size)
            for s in segments.overlapping(lo, end):
                _copy(buf, s, max(s.offset, lo), min(s.end, end))
            if hi > end:  # the tail page past the end of the file; truncated away later
                buf.array[end - lo : hi - lo] = 0
            pwrite_all(fd, memoryview(buf.array)[: hi - lo], lo)

    return job


def _buffered_write(fd: int, s: Segment) -> Callable[[], None]:
    return lambda: pwrite_all(fd, memoryview(s.array), s.offset) if s.data.numel() else None


def _truncate_and_sync(fd: int, size: int) -> Callable[[], None]:
    def job() -> None:
        os.ftruncate(fd, size)  # drops the page padding of the last O_DIRECT block
        os.fsync(fd)

    return job


def _truncated(where: str, byte: int) -> CorruptCheckpointError:
    return CorruptCheckpointError(f"{where}: file is truncated (ends before byte {byte})")


def _read_into(
    fd: int, s: Segment, lo: int, hi: int, where: str, done: _Completion
) -> Callable[[], None]:
    def job() -> None:
        with typed_read_errors(where):
            n = pread_into(fd, memoryview(s.array)[lo - s.offset : hi - s.offset], lo)
        if n != hi - lo:
            raise _truncated(where, hi)
        done.add(s, hi - lo)

    return job


def _bounce_read(
    fd: int,
    segments: _ByOffset,
    lo: int,
    hi: int,
    where: str,
    done: _Completion,
    inner: dict[int, tuple[int, int]],
) -> Callable[[], None]:
    """Read ``[lo, hi)`` into a bounce buffer and copy it into every segment reaching
    it, except into the part of one that its own zero-copy read (``inner``) fills."""

    def job() -> None:
        with _BOUNCE.buffer(lo) as buf:
            with typed_read_errors(where):
                got = pread_into(fd, memoryview(buf.array)[: hi - lo], lo)
            for s in segments.overlapping(lo, hi):
                a, b = max(s.offset, lo), min(s.end, hi)
                skip = inner.get(id(s))
                pieces = [(a, b)] if skip is None else [(a, min(b, skip[0])), (max(a, skip[1]), b)]
                for x, y in pieces:
                    if y <= x:
                        continue
                    if y - lo > got:
                        raise _truncated(where, y)
                    _copy(s, buf, x, y)
                    done.add(s, y - x)

    return job


def _iov_max() -> int:
    """Buffers one preadv call takes (Linux: 1024); POSIX may answer -1 for no limit."""
    try:
        limit = os.sysconf("SC_IOV_MAX")
    except (AttributeError, ValueError, OSError):
        return 1024
    return min(limit, 1024) if limit >= 2 else 1024


_IOV_MAX = _iov_max()
_GAP = memoryview(bytearray(COALESCE_GAP))  # the bytes between segments: read, never used


def _scatter_read(
    fd: int, segments: list[Segment], lo: int, hi: int, where: str, done: _Completion
) -> Callable[[], None]:
    """Read the file span ``[lo, hi)`` through the page cache straight into the
    segments inside it, with one ``preadv`` per IOV_MAX / 2 of them (each may need a
    buffer for the gap before it, read into a scratch buffer no one reads; threads may
    share it): small tensors cost no bounce copy and no call of their own. The span
    holds whole segments (``_coalesce``); one that overlaps another (two regions of one
    stored range) is read by a call of its own."""

    def job() -> None:
        first = bisect.bisect_left(segments, lo, key=lambda s: s.offset)
        last = bisect.bisect_left(segments, hi, lo=first, key=lambda s: s.offset)
        inside, apart, end = [], [], lo
        for s in segments[first:last]:
            (inside if s.offset >= end else apart).append(s)
            end = max(end, s.end)
        for s in apart:
            with typed_read_errors(where):
                got = pread_into(fd, memoryview(s.array), s.offset)
            if got != s.end - s.offset:
                raise _truncated(where, s.end)
            done.add(s, got)
        at = lo
        for first in range(0, len(inside), _IOV_MAX // 2):  # a segment and a gap each
            group = inside[first : first + _IOV_MAX // 2]
            buffers: list[memoryview] = []
            start = at
            for s in group:
                if s.offset > at:
                    buffers.append(_GAP[: s.offset - at])
                buffers.append(memoryview(s.array))
                at = s.end
            with typed_read_errors(where):
                n = os.preadv(fd, buffers, start)
            if n != at - start:  # short: at the end of the file, or interrupted
                for s in group:
                    with typed_read_errors(where):
                        got = pread_into(fd, memoryview(s.array), s.offset)
                    if got != s.end - s.offset:
                        raise _truncated(where, s.end)
            for s in group:
                done.add(s, s.end - s.offset)

    return job
