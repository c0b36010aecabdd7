"""Raw byte views of tensor memory, so I/O can go straight to and from tensors."""

from __future__ import annotations

import torch


def byte_view(tensor: torch.Tensor) -> memoryview:
    """A writable view of the bytes of a contiguous CPU tensor (no copy)."""
    if tensor.device.type != "cpu" or not tensor.is_contiguous():
        raise ValueError("byte_view needs a contiguous CPU tensor")
    if tensor.numel() == 0:
        return memoryview(bytearray())
    return memoryview(flat_bytes(tensor).numpy()).cast("B")


def host_contiguous(tensor: torch.Tensor) -> torch.Tensor:
    """The tensor itself when it is already contiguous CPU memory, else a compact copy."""
    tensor = tensor.detach()
    if tensor.device.type != "cpu":
        tensor = tensor.cpu()
    return tensor.contiguous()


def flat_bytes(tensor: torch.Tensor) -> torch.Tensor:
    """The bytes of a contiguous tensor as a flat uint8 tensor sharing its memory."""
    # reshape(-1) first: a 0-d tensor cannot be viewed as another dtype directly.
    if tensor.numel() == 0:
        return torch.empty(0, dtype=torch.uint8)
    return tensor.detach().reshape(-1).view(torch.uint8)
