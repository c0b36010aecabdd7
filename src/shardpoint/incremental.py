"""Incremental saves: a chunk whose bytes equal the same chunk of the previous
checkpoint of a chain is not written again; the new index refers to the file that
holds those bytes (``../step-NNNNNNNNN/rankRRRRR-KKKKK.safetensors``, format version 3).

Equality is certain, not likely. A chunk is a candidate only if its tensor's version
counter and memory address are the ones recorded when the referenced bytes were
written (every in-place write through torch bumps the counter): a changed counter
means "write it", with no hashing. A candidate is referenced only if the xxh3-128 of
its bytes now equals the xxh3-128 of the bytes written then, computed by the write
itself; the counter alone is never trusted (a write through ``.data`` or numpy does
not bump it).

The identity costs a hash of every byte written, so it is computed only for chunks
that may be unchanged next time: new ones, and ones whose token did not move since the
base (a chunk that changed since the last save is expected to change again; if it
does not, it is written once more, with its identity, and referred to after that).
Full pre-training, where every chunk changes every step, hashes nothing extra.

References always point at the file that physically holds the bytes, never at a
reference: a chain of a hundred saves is one hop from every chunk. The chain lives in
the process (each rank keeps what it wrote); the first save after a restart writes
everything.
"""

from __future__ import annotations

import os
from collections.abc import Callable
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

import msgspec
import torch
import xxhash

from .format.index import reference, split_reference
from .tensor_memory import flat_bytes, host_contiguous

Token = tuple[int, int]  # (tensor version counter, data pointer) when it was saved


def identity(data: Any) -> str:
    """The content identity of a chunk's bytes (a buffer)."""
    return xxhash.xxh3_128_hexdigest(data)


def token(tensor: torch.Tensor) -> Token:
    return (tensor._version, tensor.data_ptr())


@dataclass(frozen=True)
class Stored:
    """A chunk this rank stored in the chain's newest checkpoint."""

    record: Any  # save_records.ChunkRecord, its file named relative to the checkpoint
    identity: str | None  # None: written without one (it had just changed)
    token: Token
    file_size: int


def _parent_and_name(root: str | os.PathLike[str]) -> tuple[str, str]:
    if isinstance(root, str) and "://" in root:
        parent, _, name = root.rstrip("/").rpartition("/")
        return parent, name
    path = Path(root).absolute()
    return str(path.parent), path.name


class IncrementalChain:
    """What this rank stored in the newest committed checkpoint of one chain (a
    manager's directory): the base the next save refers to."""

    def __init__(self) -> None:
        self._parent: str | None = None
        self._stored: dict[tuple[Any, ...], Stored] = {}

    def base_for(self, root: str | os.PathLike[str]) -> dict[tuple[Any, ...], Stored]:
        """The chunks a save to ``root`` may refer to: none unless ``root`` is a sibling
        of the base (references are relative to the parent directory)."""
        parent, _ = _parent_and_name(root)
        return self._stored if parent == self._parent else {}

    def committed(
        self,
        root: str | os.PathLike[str],
        records: list[Any],
        tokens: dict[str, Token],
        file_sizes: dict[str, int],
    ) -> None:
        """The save to ``root`` committed on every rank: its chunks are the next base.
        ``records`` are this rank's chunks (written ones carry their identity)."""
        parent, name = _parent_and_name(root)
        stored: dict[tuple[Any, ...], Stored] = {}
        for r in records:
            if r.name not in tokens:
                continue
            file = r.chunk.file
            if split_reference(file) is None:
                file = reference(name, file)
            record = replace(r, chunk=msgspec.structs.replace(r.chunk, file=file))
            size = file_sizes[r.chunk.file]
            stored[_key(r.name, r.chunk.offsets, r.chunk.shape, r.dtype)] = Stored(
                record, r.identity, tokens[r.name], size
            )
        self._parent, self._stored = parent, stored


def _key(name: str, offsets: Any, shape: Any, dtype: str) -> tuple[Any, ...]:
    return (name, tuple(offsets), tuple(shape), dtype)


@dataclass
class Split:
    """An incremental save's pieces: to write (``identify``: the ones whose identity the
    write computes, by ``id``), or referred to (their records, the files' sizes)."""

    to_write: list[Any]
    identify: set[int]
    referred: list[Any]
    records: list[Any]
    files: dict[str, int]


def unchanged(
    base: dict[tuple[Any, ...], Stored],
    pieces: list[Any],
    data_of: Callable[[Any], torch.Tensor],
    tokens: dict[str, Token],
) -> Split:
    """Split ``pieces`` into those to write and those ``base`` holds byte for byte.

    ``data_of(piece)``: its bytes now (a tensor, any device), read for candidates only;
    ``tokens``: each entry's token now.
    """
    split = Split([], set(), [], [], {})
    for p in pieces:
        stored = base.get(_key(p.name, p.offsets, p.shape, p.source.dtype))
        steady = stored is None or stored.token == tokens.get(p.name)
        if stored is not None and steady and stored.identity is not None:
            if identity(flat_bytes(host_contiguous(data_of(p))).numpy()) == stored.identity:
                split.referred.append(p)
                split.records.append(stored.record)
                split.files[stored.record.chunk.file] = stored.file_size
                continue
        split.to_write.append(p)
        if steady:
            split.identify.add(id(p))
    return split
