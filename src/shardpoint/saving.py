"""``shardpoint.save``: flatten the state, pack tensors into shard files, write, commit.

Order of durability (the commit protocol, docs/format.md): every shard file is written
and fsynced, then ``index.json`` is written and fsynced, then the directory is fsynced,
and only then the commit marker is written and fsynced. A crash at any point leaves a
directory without a marker, which no reader accepts as a checkpoint.
"""

from __future__ import annotations

import os
import time
from collections.abc import Iterable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from datetime import datetime, timezone
from pathlib import Path
from typing import Any, NoReturn

import torch

from . import __version__
from .checkpoint_dir import foreign_files
from .errors import CheckpointError, CheckpointExistsError, UnsupportedValueError
from .format.index import (
    INDEX_NAME,
    MARKER_NAME,
    Chunk,
    Index,
    TensorEntry,
    checksum,
    marker_json,
)
from .format.safetensors import PAGE, TensorSlot, dtype_name, encode_header, layout
from .gc_pause import gc_paused
from .parallel import map_batched
from .storage.local import ZERO_COPY_MIN_BYTES, LocalDirectory, Segment, fsync_directory
from .tensor_memory import flat_bytes, host_contiguous
from .tree import flatten

DEFAULT_MAX_SHARD_BYTES = 4 * 1024**3
DEFAULT_THREADS = 4
SHARD_METADATA = {"format": "pt"}  # what the Hugging Face loaders expect in each file


@dataclass(frozen=True)
class SaveInfo:
    """What a save wrote."""

    path: Path
    files: int
    tensors: int
    bytes_written: int
    seconds: float


def shard_file_name(rank: int, k: int) -> str:
    return f"rank{rank:05d}-{k:05d}.safetensors"


@gc_paused()
def save(
    state: Any,
    path: str | os.PathLike[str],
    *,
    max_shard_size: int = DEFAULT_MAX_SHARD_BYTES,
    threads: int = DEFAULT_THREADS,
    metadata: dict[str, Any] | None = None,
) -> SaveInfo:
    """Save ``state`` as a committed checkpoint directory at ``path``.

    ``state`` is a mapping (or a ``Stateful`` object) of tensors, ``Stateful`` objects
    (modules, optimizers, schedulers...) and plain values. Tensors are packed into
    safetensors files of at most ``max_shard_size`` bytes (a larger tensor gets a file
    of its own) and written by ``threads`` parallel workers.

    >>> import torch, shardpoint
    >>> info = shardpoint.save({"w": torch.ones(2), "step": 7}, "/tmp/sp-doc/ckpt")
    >>> info.tensors
    1
    """
    start = time.perf_counter()
    flat = flatten(state)
    entries, aliases, tensors = _dedupe(flat.tensors)
    files = _pack(entries, tensors, max_shard_size)

    storage = LocalDirectory(path)
    _prepare_directory(storage.root)
    index = Index(
        files={},
        entries={},
        aliases=aliases,
        tree=flat.tree,
        created=datetime.now(timezone.utc).isoformat(timespec="seconds"),
        library_version=__version__,
        metadata=dict(metadata or {}),
    )
    to_write: dict[str, tuple[int, list[Segment]]] = {}
    placed: list[tuple[str, str, TensorSlot, int, torch.Tensor]] = []  # ..., data start, bytes
    for file, names in files.items():
        slots = layout([(n, dtype_name(tensors[n].dtype), tuple(tensors[n].shape)) for n in names])
        header = encode_header(slots, SHARD_METADATA, _data_start_mod(slots, tensors))
        data_start = len(header)
        segments = [Segment(0, torch.frombuffer(bytearray(header), dtype=torch.uint8))]
        for name, slot in slots.items():
            data = flat_bytes(tensors[name])
            segments.append(Segment(data_start + slot.begin, data))
            placed.append((name, file, slot, data_start, data))
        size = data_start + sum(s.nbytes for s in slots.values())
        index.files[file] = size
        to_write[file] = (size, segments)

    # Checksums run beside the writes, on their own thread, so they cost no wall time.
    with ThreadPoolExecutor(max_workers=1, thread_name_prefix="shardpoint-hash") as hasher:
        digests = map_batched(
            hasher,
            lambda p: checksum(p[4].numpy()),
            placed,
            lambda p: p[2].nbytes,
        )
        try:
            storage.write_files(to_write, threads=threads)
        except OSError as exc:
            _fail(storage.root, to_write, exc)
        for (name, file, slot, data_start, _), digest in zip(placed, digests()):
            chunk = Chunk(
                file=file,
                key=name,
                offsets=(0,) * len(slot.shape),
                shape=slot.shape,
                begin=data_start + slot.begin,
                end=data_start + slot.end,
                checksum=digest,
            )
            index.entries[name] = TensorEntry(name, slot.dtype, slot.shape, (chunk,))

    index_bytes = index.to_json()
    try:
        storage.write_small_durably(INDEX_NAME, index_bytes)
        fsync_directory(storage.root)
        storage.write_small_durably(MARKER_NAME, marker_json(index_bytes))
        fsync_directory(storage.root)
    except OSError as exc:
        _fail(storage.root, [*to_write, INDEX_NAME, MARKER_NAME], exc)
    return SaveInfo(
        path=storage.root,
        files=len(files),
        tensors=len(flat.tensors),
        bytes_written=sum(index.files.values()) + len(index_bytes),
        seconds=time.perf_counter() - start,
    )


def _data_start_mod(slots: dict[str, TensorSlot], tensors: dict[str, torch.Tensor]) -> int | None:
    """Where in a page the data should start so most large tensors move zero-copy.

    Direct I/O can skip the bounce buffer for a tensor whose address and file offset
    agree modulo the page size (storage/local.py). Tensors from the CPU allocator share
    one such class (64 with glibc), so aligning the data start to it usually wins
    every large tensor in the file. Small files keep the minimal padding.
    """
    votes: dict[int, int] = {}
    for name, slot in slots.items():
        if slot.nbytes >= ZERO_COPY_MIN_BYTES:
            cls = (tensors[name].data_ptr() - slot.begin) % PAGE
            votes[cls] = votes.get(cls, 0) + slot.nbytes
    best = max(votes, key=votes.__getitem__, default=None)
    return best if best is not None and best % 8 == 0 else None


def _dedupe(
    tensors: dict[str, torch.Tensor],
) -> tuple[list[str], dict[str, str], dict[str, torch.Tensor]]:
    """Store tensors that are views of the same memory (tied weights) once.

    Returns the names to store, alias name -> stored name, and name -> host tensor.
    """
    seen: dict[tuple[Any, ...], str] = {}
    stored: list[str] = []
    aliases: dict[str, str] = {}
    host: dict[str, torch.Tensor] = {}
    for name, t in tensors.items():
        try:
            dtype_name(t.dtype)
        except TypeError as exc:
            raise UnsupportedValueError(f"cannot save tensor {name!r}: {exc}") from None
        if t.is_sparse or t.layout != torch.strided:
            raise UnsupportedValueError(
                f"cannot save tensor {name!r}: layout {t.layout} is not supported; "
                "convert it with .to_dense() first"
            )
        identity = None
        if t.numel():  # every empty tensor has the same (null) data pointer
            identity = (
                t.device,
                t.untyped_storage().data_ptr(),
                t.storage_offset(),
                tuple(t.shape),
                tuple(t.stride()),
                t.dtype,
            )
        if identity is not None and identity in seen:
            aliases[name] = seen[identity]
            continue
        if identity is not None:
            seen[identity] = name
        stored.append(name)
        host[name] = host_contiguous(t)
    return stored, aliases, host


def _pack(
    names: list[str], tensors: dict[str, torch.Tensor], max_bytes: int
) -> dict[str, list[str]]:
    """Greedy packing in state order: related tensors stay together in one file."""
    files: dict[str, list[str]] = {}
    current: list[str] = []
    size = 0
    for name in names:
        nbytes = tensors[name].numel() * tensors[name].element_size()
        if current and size + nbytes > max_bytes:
            files[shard_file_name(0, len(files))] = current
            current, size = [], 0
        current.append(name)
        size += nbytes
    if current or not files:
        files[shard_file_name(0, len(files))] = current
    return files


def _prepare_directory(root: Path) -> None:
    """Create ``root``; clear what a crashed save left there; never touch a committed checkpoint."""
    if (root / MARKER_NAME).exists():
        raise CheckpointExistsError(
            f"{root}: a committed checkpoint already exists here; checkpoints are never "
            "modified in place. Save to a new path or delete this one first."
        )
    if root.exists():
        if not root.is_dir():
            raise CheckpointError(f"{root}: exists and is not a directory; choose another path")
        foreign = foreign_files(root)
        if foreign:
            raise CheckpointError(
                f"{root}: directory holds files that are not from an unfinished shardpoint save "
                f"({foreign[:3]}); save to an empty or new directory"
            )
        for p in root.iterdir():  # leftovers of a crashed save, never committed
            p.unlink()
    root.mkdir(parents=True, exist_ok=True)
    fsync_directory(root.parent)


def _fail(root: Path, names: Iterable[str], exc: OSError) -> NoReturn:
    """Remove what this save wrote, then raise: a failed save leaves no trace to mistake."""
    for name in names:
        for leftover in (root / name, root / f"{name}.tmp"):
            leftover.unlink(missing_ok=True)
    try:
        root.rmdir()  # only succeeds when nothing else is in the directory
    except OSError:
        pass
    raise CheckpointError(
        f"{root}: writing the checkpoint failed ({exc}); nothing was committed and earlier "
        "checkpoints are untouched. Free disk space or fix permissions, then save again."
    ) from exc
