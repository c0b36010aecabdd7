"""``shardpoint.load``: read a checkpoint in place into the live state.

Every check that needs no tensor bytes (commit marker, index, file sizes, shard
headers, keys, shapes, dtypes) runs before the first byte is read, so a mismatch
never leaves the state half overwritten. Bytes go straight into the destination
tensors when they are contiguous CPU memory; otherwise through one temporary tensor
per entry.
"""

from __future__ import annotations

import math
import os
from dataclasses import dataclass, field
from typing import Any

import torch

from .checkpoint_dir import CommittedCheckpoint, open_committed
from .errors import CorruptCheckpointError, StateMismatchError
from .format.index import Chunk, TensorEntry, checksum
from .format.safetensors import DTYPES
from .gc_pause import gc_paused
from .saving import DEFAULT_THREADS
from .storage.local import Segment
from .tensor_memory import flat_bytes, plain
from .tree import match


@gc_paused()
def load(
    state: Any,
    path: str | os.PathLike[str],
    *,
    strict: bool = True,
    verify: bool = True,
    threads: int = DEFAULT_THREADS,
) -> None:
    """Load the checkpoint at ``path`` into ``state`` in place.

    Tensors in ``state`` are filled in place; ``Stateful`` objects get
    ``load_state_dict`` with their stored state; other values in mappings and lists are
    replaced. With ``strict``, keys missing from the checkpoint or not in ``state``
    raise ``StateMismatchError``; shapes and dtypes must always agree. ``verify``
    checks every chunk's checksum.

    >>> import torch, shardpoint
    >>> state = {"w": torch.zeros(2), "step": 0}
    >>> shardpoint.load(state, "/tmp/sp-doc/ckpt")
    >>> state["step"], state["w"].tolist()
    (7, [1.0, 1.0])
    """
    ckpt = open_committed(path)
    m = match(state, ckpt.index.tree)
    problems = []
    if strict and m.missing:
        problems.append(f"missing from the checkpoint: {_some(m.missing)}")
    if strict and m.unexpected:
        problems.append(f"in the checkpoint but not in the state: {_some(m.unexpected)}")
    for name, dest in m.destinations.items():
        entry = ckpt.index.resolve(name)
        if tuple(dest.shape) != entry.shape or dest.dtype != DTYPES[entry.dtype]:
            problems.append(
                f"{name!r}: checkpoint has {entry.dtype}{list(entry.shape)}, state has "
                f"{dest.dtype}{list(dest.shape)}"
            )
    if problems:
        raise StateMismatchError(
            f"{ckpt.where}: checkpoint does not fit the state: "
            + "; ".join(problems)
            + ". Build the state with the same model/optimizer configuration, or pass "
            "strict=False to skip missing/unexpected keys."
        )

    reads = ReadPlan(ckpt)
    for name, dest in m.destinations.items():
        reads.into(name, dest)
    loaded = {name: reads.fresh(name) for name in m.materialize}
    reads.run(threads=threads, verify=verify)
    m.finish(lambda name: loaded[name])


def _some(keys: list[str], limit: int = 10) -> str:
    more = f" (+{len(keys) - limit} more)" if len(keys) > limit else ""
    return ", ".join(repr(k) for k in keys[:limit]) + more


@dataclass
class _Target:
    """Where one stored entry's bytes go: a staging tensor and the tensors to copy into."""

    staging: torch.Tensor
    copies: list[torch.Tensor] = field(default_factory=list)


class ReadPlan:
    """Collects destinations for stored entries, then reads and verifies them in one pass."""

    def __init__(self, ckpt: CommittedCheckpoint) -> None:
        self.ckpt = ckpt
        self.targets: dict[str, _Target] = {}

    def into(self, name: str, dest: torch.Tensor) -> None:
        """Fill ``dest`` (any device, any strides) with entry ``name``."""
        entry = self.ckpt.index.resolve(name)
        target = self.targets.get(entry.name)
        if target is None:
            direct = dest.device.type == "cpu" and dest.is_contiguous() and len(entry.chunks) == 1
            staging = plain(dest) if direct else torch.empty(entry.shape, dtype=dest.dtype)
            target = self.targets[entry.name] = _Target(staging)
            if not direct:
                target.copies.append(dest)
        elif not _same_memory(target.staging, dest):
            target.copies.append(dest)

    def fresh(self, name: str) -> torch.Tensor:
        """A new CPU tensor holding entry ``name``; aliases share one tensor."""
        entry = self.ckpt.index.resolve(name)
        if entry.name not in self.targets:
            staging = torch.empty(entry.shape, dtype=DTYPES[entry.dtype])
            self.targets[entry.name] = _Target(staging)
        return self.targets[entry.name].staging

    def run(self, *, threads: int, verify: bool, direct: bool = True) -> None:
        requests: dict[str, list[Segment]] = {}
        checks: dict[int, tuple[TensorEntry, Chunk]] = {}  # id(segment) -> what it holds
        regions: list[tuple[torch.Tensor, torch.Tensor]] = []
        for name, target in self.targets.items():
            entry = self.ckpt.index.entries[name]
            for chunk in entry.chunks:
                self.ckpt.header(chunk.file)
                whole = chunk.shape == entry.shape
                buf = (
                    target.staging if whole else torch.empty(chunk.shape, dtype=DTYPES[entry.dtype])
                )
                segment = Segment(chunk.begin, flat_bytes(buf))
                requests.setdefault(chunk.file, []).append(segment)
                checks[id(segment)] = (entry, chunk)
                if not whole:
                    regions.append((_region(target.staging, chunk), buf))

        def verify_segment(segment: Segment) -> None:
            _verify_chunk(self.ckpt, *checks[id(segment)], segment.array)

        self.ckpt.storage.read_ranges(
            requests, threads=threads, direct=direct, on_segment=verify_segment if verify else None
        )
        for region, buf in regions:
            region.copy_(buf)
        for target in self.targets.values():
            for dest in target.copies:
                with torch.no_grad():
                    dest.copy_(target.staging)


def _verify_chunk(ckpt: CommittedCheckpoint, entry: TensorEntry, chunk: Chunk, data: Any) -> None:
    if checksum(data) != chunk.checksum:
        raise CorruptCheckpointError(
            f"{ckpt.storage.path(chunk.file)}: checksum mismatch in {entry.name!r} "
            f"(bytes {chunk.begin}-{chunk.end}); the file is corrupt, load an earlier checkpoint"
        )


def _region(t: torch.Tensor, chunk: Chunk) -> torch.Tensor:
    for dim, (offset, size) in enumerate(zip(chunk.offsets, chunk.shape)):
        t = t.narrow(dim, offset, size)
    return t


def _same_memory(a: torch.Tensor, b: torch.Tensor) -> bool:
    return (
        a.device == b.device
        and a.data_ptr() == b.data_ptr()
        and a.shape == b.shape
        and a.stride() == b.stride()
        and math.prod(a.shape) > 0
    )
