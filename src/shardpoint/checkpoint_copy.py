"""Copying a checkpoint to a new directory, self-contained.

A checkpoint of an incremental save refers to files of sibling checkpoints
(docs/format.md, "References"). Its copy holds every byte itself: each referenced
file becomes a shard file of its own under the next free number of the rank that
wrote it, the index and fragments name the new files, and the copy's index is
version 2 again. Shard bytes move unchanged (so do their offsets and checksums),
streamed file by file: nothing is held in memory whole.
"""

from __future__ import annotations

import os
from dataclasses import dataclass, replace
from typing import Any

import msgspec

from .checkpoint_dir import open_committed
from .commit import Commit
from .defaults import DEFAULT_THREADS
from .errors import CheckpointError
from .format.index import (
    PLAIN_VERSION,
    Chunk,
    TensorEntry,
    checksum,
    fragment_json,
    split_reference,
)
from .names import fragment_file, is_fragment, shard_file, shard_number, writer_rank
from .storage import open_storage
from .storage.transfer import copy_files


@dataclass(frozen=True)
class CopyInfo:
    path: Any  # the new checkpoint: a Path or URL
    files: int
    bytes_copied: int
    made_own: int  # referenced files of other checkpoints that are now its own


def copy_checkpoint(
    source: str | os.PathLike[str],
    target: str | os.PathLike[str],
    *,
    threads: int = DEFAULT_THREADS,
    storage_options: dict[str, Any] | None = None,
) -> CopyInfo:
    """Copy the committed checkpoint ``source`` to ``target`` (a new directory or URL),
    self-contained. File sizes and fragments are checked before a byte is copied;
    run ``verify`` on the copy to check every checksum."""
    ckpt = open_committed(source, storage_options)
    index = ckpt.index
    renamed = _own_names(list(index.files))
    storage = open_storage(target, storage_options)
    commit = Commit(storage)
    written: list[str] = []
    try:
        commit.begin()
        commit.clear()
        shards = [n for n in index.files if not is_fragment(n)]
        written += [renamed[n] for n in shards]
        nbytes = copy_files(ckpt.storage, storage, shards, threads, renamed)
        fragments = {}
        for rank in sorted(index.fragments):
            fragment = ckpt.read_fragment(rank)
            data = fragment_json(
                rank,
                {n: _moved(c, renamed) for n, c in fragment.chunks.items()},
                fragment.values,
                [_entry(e, renamed) for e in fragment.entries.values()],
            )
            storage.write_small_durably(fragment_file(rank), data)
            written.append(fragment_file(rank))
            fragments[rank] = (len(data), checksum(data))
        files = {renamed[n]: size for n, size in index.files.items()}
        files.update({fragment_file(r): size for r, (size, _) in fragments.items()})
        copied = replace(
            index,
            files=files,
            entries={n: _entry(e, renamed) for n, e in index.entries.items()},
            fragments=fragments,
            format_version=min(index.format_version, PLAIN_VERSION),
        )
        commit.finish(copied.to_json())
    except BaseException as exc:
        commit.abort(written, remove_directory=True)
        if isinstance(exc, OSError) and not isinstance(exc, CheckpointError):
            raise CheckpointError(
                f"{storage.where}: copying {ckpt.where} there failed ({exc}); nothing of "
                "the copy is left. Free space or fix permissions there, then copy again"
            ) from exc
        raise
    finally:
        commit.release()
    made_own = sum(1 for n in index.files if split_reference(n))
    return CopyInfo(storage.root, len(index.files), nbytes, made_own)


def _own_names(files: list[str]) -> dict[str, str]:
    """Every file's name in the copy: its own keep theirs; each referenced one gets the
    next free number of the rank that wrote it."""
    next_number: dict[int, int] = {}
    for name in files:
        rank, number = writer_rank(name), shard_number(name)
        if split_reference(name) is None and rank is not None and number is not None:
            next_number[rank] = max(next_number.get(rank, 0), number + 1)
    out = {}
    for name in files:
        if split_reference(name) is None:
            out[name] = name
            continue
        rank = writer_rank(name)
        if rank is None:
            raise CheckpointError(f"{name}: a referenced file not named by its rank")
        out[name] = shard_file(rank, next_number.get(rank, 0))
        next_number[rank] = next_number.get(rank, 0) + 1
    return out


def _moved(c: Chunk, renamed: dict[str, str]) -> Chunk:
    return msgspec.structs.replace(c, file=renamed[c.file])


def _entry(e: TensorEntry, renamed: dict[str, str]) -> TensorEntry:
    return replace(e, chunks=tuple(_moved(c, renamed) for c in e.chunks))
