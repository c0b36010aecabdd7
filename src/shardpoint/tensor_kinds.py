"""What part of a global tensor a rank holds: plain tensors and DTensors (FSDP2, TP).

A plain tensor is the whole tensor (replicated when several ranks hold it, as under
DDP). A DTensor's local shard sits at an offset inside its global shape; ``Replicate``
placements make several ranks hold the same shard.
"""

from __future__ import annotations

import math
import weakref
from dataclasses import dataclass, field
from typing import Any

import torch

from . import dist
from .errors import UnsupportedValueError
from .sharding import REPLICATED, Mesh, Sharding

try:
    from torch.distributed.tensor import DTensor, Partial, Replicate, Shard
    from torch.distributed.tensor._utils import compute_local_shape_and_global_offset
    from torch.distributed.tensor.placement_types import _StridedShard
except ImportError:  # torch built without distributed support
    DTensor = None  # type: ignore[assignment,misc]


def is_dtensor(t: torch.Tensor) -> bool:
    return DTensor is not None and isinstance(t, DTensor)


def local_part(t: torch.Tensor, name: str) -> tuple[torch.Tensor, tuple[int, ...], tuple[int, ...]]:
    """(local tensor, global shape, offsets of the local tensor in the global one)."""
    if not is_dtensor(t):
        return t, tuple(t.shape), (0,) * t.dim()
    if dist.in_solo():  # a rank's own checkpoint: the local shard is the whole entry
        local = _dtensor_part(t, name)[0]
        return local, tuple(local.shape), (0,) * local.dim()
    return _dtensor_part(t, name)


def may_be_replicated(t: torch.Tensor) -> bool:
    """Whether other ranks may hold the same chunk: plain tensors (DDP) and DTensors with a
    ``Replicate`` placement. A DTensor sharded on every mesh dim is unique to its rank."""
    if dist.in_solo():
        return False
    return not is_dtensor(t) or any(isinstance(p, Replicate) for p in t.placements)


@dataclass
class _MeshFacts:
    """What a save needs of one DeviceMesh, read once: its ranks (O(ranks): 1.3 ms at
    16,384 ranks, and a save looks at the mesh of each of 10,000 DTensors), this rank's
    coordinate, and per placements and global shape what torch's layout gives
    (a mixture-of-experts state repeats a few shapes 100,000 times)."""

    mesh: Mesh
    coord: tuple[int, ...]
    shardings: dict[tuple[Any, ...], Sharding | None] = field(default_factory=dict)
    boxes: dict[tuple[Any, ...], tuple[tuple[int, ...], tuple[int, ...]]] = field(
        default_factory=dict
    )


_MESH_FACTS: weakref.WeakKeyDictionary[Any, _MeshFacts] = weakref.WeakKeyDictionary()


def _facts(device_mesh: Any) -> _MeshFacts:
    facts = _MESH_FACTS.get(device_mesh)
    if facts is None:
        ranks = device_mesh.mesh
        mesh = Mesh(tuple(ranks.shape), tuple(int(r) for r in ranks.flatten().tolist()))
        coord = tuple(int(c) for c in device_mesh.get_coordinate() or ())
        facts = _MESH_FACTS[device_mesh] = _MeshFacts(mesh, coord)
    return facts


def regular_sharding(
    t: torch.Tensor, name: str, offsets: tuple[int, ...], shape: tuple[int, ...]
) -> Sharding | None:
    """The sharding that describes ``t`` in format version 2: a DTensor whose
    placements are ``Shard`` (at least one) or ``Replicate``, not strided or partial,
    and whose local chunk (``offsets``, ``shape``) is the one the derivation rule
    gives this rank."""
    if dist.in_solo() or not is_dtensor(t):
        return None
    facts = _facts(t.device_mesh)
    placements = tuple(t.placements)
    if placements not in facts.shardings:
        facts.shardings[placements] = _described(placements, facts.mesh)
    sharding = facts.shardings[placements]
    if sharding is None:
        return None
    expected = sharding.box(tuple(t.shape), facts.coord)
    if (tuple(offsets), tuple(shape)) != expected:
        raise UnsupportedValueError(
            f"cannot describe the sharding of DTensor {name!r} ({t.placements} on mesh "
            f"{list(sharding.mesh.shape)}): its local chunk is at {list(offsets)} with shape "
            f"{list(shape)}, the format's rule gives {expected}; please report this"
        )
    return sharding


def _described(placements: tuple[Any, ...], mesh: Mesh) -> Sharding | None:
    kinds = [type(p) for p in placements]
    if Shard not in kinds or not all(k in (Shard, Replicate) for k in kinds):
        return None  # all replicated (planned), strided or partial placements
    return Sharding(mesh, tuple(p.dim if isinstance(p, Shard) else REPLICATED for p in placements))


def _dtensor_part(
    t: torch.Tensor, name: str
) -> tuple[torch.Tensor, tuple[int, ...], tuple[int, ...]]:
    if any(isinstance(p, Partial) for p in t.placements):
        raise UnsupportedValueError(
            f"cannot save DTensor {name!r} with a Partial placement (a pending reduction); "
            "redistribute it to Shard or Replicate first"
        )
    local = t.to_local()
    boxes = _facts(t.device_mesh).boxes
    key = (tuple(t.shape), tuple(t.placements))
    box = boxes.get(key)
    if box is None:
        if not _one_box(t.placements, tuple(t.device_mesh.shape)):
            raise UnsupportedValueError(
                f"DTensor {name!r} ({t.placements} on mesh {list(t.device_mesh.shape)}): a "
                "rank's local shard is not one block of the global tensor (a strided shard "
                "that no later Shard of the same dimension resolves), which a checkpoint "
                "cannot describe; redistribute it (e.g. to Shard or Replicate) first"
            )
        shape, offsets = compute_local_shape_and_global_offset(t.shape, t.device_mesh, t.placements)
        box = boxes[key] = (tuple(shape), tuple(int(o) for o in offsets))
    shape, offsets = box
    if shape != tuple(local.shape):  # padded shards: keep the real part
        local = local[tuple(slice(0, s) for s in shape)]
    return local, key[0], offsets


def _one_box(placements: Any, mesh_shape: tuple[int, ...]) -> bool:
    """Whether every rank's local shard is one block of the global tensor. A strided
    shard (FSDP2 over tensor parallelism) is one only when the later mesh dimensions
    that shard the same tensor dimension split each of its pieces ``split_factor`` ways:
    alone, ``_StridedShard(0, split_factor=2)`` on 2 ranks gives rank 0 rows 0, 1, 4, 5
    of 8, which a block at an offset would take for rows 0-3."""
    for i, p in enumerate(placements):
        if isinstance(p, _StridedShard):
            later = [
                mesh_shape[j]
                for j, q in enumerate(placements)
                if j > i and isinstance(q, Shard) and q.dim == p.dim
            ]
            if math.prod(later) != p.split_factor:
                return False
    return True
