"""Views of tensor memory: raw bytes, so I/O can go straight to and from tensors, and
boxes of a global tensor, so a stored chunk meets the regions that need it."""

from __future__ import annotations

import math
from typing import Any

import torch


def plain(tensor: torch.Tensor) -> torch.Tensor:
    """The tensor without autograd tracking (``detach`` costs microseconds; skip it when idle)."""
    return tensor.detach() if tensor.requires_grad else tensor


def host_contiguous(tensor: torch.Tensor) -> torch.Tensor:
    """The tensor itself when it is already contiguous CPU memory, else a compact copy."""
    if tensor.device.type != "cpu":
        tensor = tensor.cpu()
    return tensor.contiguous()


def flat_bytes(tensor: torch.Tensor) -> torch.Tensor:
    """The bytes of a contiguous, detached tensor as a flat uint8 tensor sharing its memory."""
    if tensor.numel() == 0:
        return torch.empty(0, dtype=torch.uint8)
    if tensor.dim() == 1:  # the usual case; one view op instead of two
        return tensor.view(torch.uint8)
    # reshape(-1) first: a 0-d tensor cannot be viewed as another dtype directly.
    return tensor.reshape(-1).view(torch.uint8)


def memory_key(t: torch.Tensor) -> tuple[Any, ...] | None:
    """What makes two tensors the same view of the same memory (tied weights); None for
    an empty tensor (every empty tensor has the same null data pointer)."""
    if math.prod(t.shape) == 0:
        return None
    return (t.device, t.data_ptr(), tuple(t.shape), t.stride(), t.dtype)


def same_memory(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Whether ``a`` and ``b`` are the same non-empty view of the same memory."""
    key = memory_key(a)
    return key is not None and key == memory_key(b)


# Boxes: [lo, hi) in a global tensor's coordinates. A chunk, a rank's region and a
# piece of either are boxes; a tensor holding one starts at its box's lo (its origin).
Box = tuple[tuple[int, ...], tuple[int, ...]]


def overlap(
    a: tuple[int, ...], a_shape: tuple[int, ...], b: tuple[int, ...], b_shape: tuple[int, ...]
) -> Box | None:
    """The box shared by the box at ``a`` of ``a_shape`` and the one at ``b`` of
    ``b_shape``; None if they share no element (a 0-d box shares its one element)."""
    lo = tuple(map(max, a, b))
    hi = tuple(min(x + n, y + m) for x, n, y, m in zip(a, a_shape, b, b_shape))
    return None if any(x >= y for x, y in zip(lo, hi)) else (lo, hi)


def box_view(tensor: torch.Tensor, origin: tuple[int, ...], box: Box) -> torch.Tensor:
    """The part of ``tensor`` (whose first element sits at ``origin``) inside ``box``."""
    for dim, (a, b, o) in enumerate(zip(*box, origin)):
        tensor = tensor.narrow(dim, a - o, b - a)
    return tensor
