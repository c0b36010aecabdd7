"""Raw byte views of tensor memory, so I/O can go straight to and from tensors."""

from __future__ import annotations

import math

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


def same_memory(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Whether ``a`` and ``b`` are the same non-empty view of the same memory."""
    return (
        a.device == b.device
        and a.data_ptr() == b.data_ptr()
        and a.shape == b.shape
        and a.stride() == b.stride()
        and math.prod(a.shape) > 0
    )
