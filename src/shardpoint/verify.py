"""``shardpoint.verify``: recompute every checksum and report per file.

Files are streamed in fixed-size blocks, so memory stays bounded by one block per
worker whatever the size of the checkpoint.
"""

from __future__ import annotations

import os
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import xxhash

from .checkpoint_dir import CommittedCheckpoint, open_committed
from .defaults import DEFAULT_THREADS
from .errors import CheckpointError
from .format.index import INDEX_NAME
from .names import is_fragment
from .parallel import run_parallel
from .storage import is_url

_BLOCK = 8 * 1024 * 1024


@dataclass
class FileReport:
    name: str
    size: int
    chunks: int
    errors: list[str] = field(default_factory=list)

    @property
    def ok(self) -> bool:
        return not self.errors


@dataclass
class VerifyReport:
    path: Path | str  # a local path, or the URL
    files: list[FileReport] = field(default_factory=list)
    errors: list[str] = field(default_factory=list)  # problems with the checkpoint as a whole

    @property
    def ok(self) -> bool:
        return not self.errors and all(f.ok for f in self.files)

    def raise_if_corrupt(self) -> None:
        if not self.ok:
            problems = self.errors + [e for f in self.files for e in f.errors]
            raise CheckpointError(f"{self.path}: verification failed: " + "; ".join(problems))


def verify(
    path: str | os.PathLike[str],
    *,
    threads: int = DEFAULT_THREADS,
    progress: Callable[[int], None] | None = None,
    storage_options: dict[str, Any] | None = None,
) -> VerifyReport:
    """Check the marker, index, every shard header and every chunk checksum.

    Never raises for a damaged checkpoint: the report says what is wrong, per file.
    ``progress(n)`` is called with the bytes checked as the work advances.

    >>> import shardpoint
    >>> shardpoint.verify("/tmp/sp-doc/ckpt").ok
    True
    """
    report = VerifyReport(path if is_url(path) else Path(path))
    try:
        ckpt = open_committed(path, storage_options)
    except CheckpointError as exc:
        report.errors.append(str(exc))
        return report
    files = sorted(ckpt.index.files)
    report.files = run_parallel(
        lambda f: _verify_file(ckpt, f, progress), files, threads, "shardpoint-verify"
    )
    return report


def _verify_file(
    ckpt: CommittedCheckpoint, name: str, progress: Callable[[int], None] | None
) -> FileReport:
    chunks = [c for _, c in ckpt.chunks_by_file.get(name, [])]
    report = FileReport(name, ckpt.index.files[name], len(chunks))
    if is_fragment(name):  # its checksum was checked when it was read (open_committed)
        return report
    blocks = [(*c.block_span(i), d, c.key) for c in chunks for i, d in enumerate(c.checksums)]
    try:
        # a valid safetensors header whose slots agree with the index, and the bytes the
        # index recorded (as loads check)
        ckpt.header(name)
        _check_blocks(ckpt, name, blocks, report, progress)
    except (CheckpointError, OSError) as exc:
        report.errors.append(str(exc))
    return report


def _check_blocks(
    ckpt: CommittedCheckpoint,
    name: str,
    blocks: list[tuple[int, int, str, str]],
    report: FileReport,
    progress: Callable[[int], None] | None,
) -> None:
    """Stream the file once, feeding each block of it to the checksum ranges it overlaps."""
    path = ckpt.storage.location(name)
    blocks = sorted(blocks)
    hashers = [xxhash.xxh3_64() for _ in blocks]
    first = 0  # ranges before this one are complete
    pos = 0
    for view in ckpt.storage.iter_bytes(name, _BLOCK):
        n = len(view)
        lo, hi = pos, pos + n
        i = first
        while i < len(blocks) and blocks[i][0] < hi:
            a, b = max(blocks[i][0], lo), min(blocks[i][1], hi)
            if a < b:
                hashers[i].update(view[a - lo : b - lo])
            i += 1
        while first < len(blocks) and blocks[first][1] <= hi:
            first += 1
        pos = hi
        if progress:
            progress(n)
    for (lo, hi, digest, key), h in zip(blocks, hashers):
        if h.hexdigest() != digest:
            report.errors.append(
                f"{path}: checksum mismatch for {key!r} (bytes {lo}-{hi}); "
                f"the data differs from what {INDEX_NAME} recorded"
            )
