"""What part of a global tensor a rank holds: plain tensors and DTensors (FSDP2, TP).

A plain tensor is the whole tensor (replicated when several ranks hold it, as under
DDP). A DTensor's local shard sits at an offset inside its global shape; ``Replicate``
placements make several ranks hold the same shard.
"""

from __future__ import annotations

import torch

from . import dist
from .errors import UnsupportedValueError

try:
    from torch.distributed.tensor import DTensor, Partial, Replicate
    from torch.distributed.tensor._utils import compute_local_shape_and_global_offset
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


def _dtensor_part(
    t: torch.Tensor, name: str
) -> tuple[torch.Tensor, tuple[int, ...], tuple[int, ...]]:
    if any(isinstance(p, Partial) for p in t.placements):
        raise UnsupportedValueError(
            f"cannot save DTensor {name!r} with a Partial placement (a pending reduction); "
            "redistribute it to Shard or Replicate first"
        )
    local = t.to_local()
    shape, offsets = compute_local_shape_and_global_offset(t.shape, t.device_mesh, t.placements)
    if tuple(shape) != tuple(local.shape):  # padded shards: keep the real part
        local = local[tuple(slice(0, s) for s in shape)]
    return local, tuple(t.shape), tuple(int(o) for o in offsets)
