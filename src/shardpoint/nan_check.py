"""Finding NaN in a training state before it is checkpointed.

A NaN in weights or optimizer state never goes away again: a checkpoint holding one
is a checkpoint no resume can use, and retention would rotate the good ones out for
it. ±inf is not looked for: attention masks and running minima hold it on purpose.
"""

from __future__ import annotations

from typing import Any

import torch

from .tensor_kinds import is_dtensor
from .tree import flatten


def first_nan(state: Any) -> str | None:
    """The path of the first floating tensor of ``state`` (as ``save`` names it) that
    holds a NaN, else None. ``amax`` propagates NaN: one reduction a tensor at memory
    speed, no scratch memory, and one device synchronisation per device, not per tensor.

    >>> first_nan({"w": torch.ones(3), "b": torch.tensor([0.0, float("nan")])})
    'b'
    """
    found: dict[torch.device, list[tuple[str, torch.Tensor]]] = {}
    for path, tensor in flatten(state).tensors.items():
        local = tensor.to_local() if is_dtensor(tensor) else tensor
        if local.is_floating_point() or local.is_complex():
            if local.numel() and local.device.type != "meta":
                found.setdefault(local.device, []).append((path, _nan_flag(local)))
    for flagged in found.values():
        hits = torch.stack([flag for _, flag in flagged]).nonzero()
        if hits.numel():
            return flagged[int(hits[0])][0]
    return None


def _nan_flag(t: torch.Tensor) -> torch.Tensor:
    """A 0-d bool tensor on ``t``'s device: whether ``t`` holds a NaN."""
    if t.element_size() == 1 or t.dtype == torch.complex32:  # float8: no amax kernel
        return torch.isnan(t).any()
    return (torch.view_as_real(t) if t.is_complex() else t).amax().isnan()
