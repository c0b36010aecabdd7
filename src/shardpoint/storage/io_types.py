"""The I/O types every storage backend and the save pipeline share.

A ``Segment`` is bytes at an offset of a file, seen as a flat uint8 tensor: the source
of a write or the destination of a read. ``BLOCK`` is the unit of one I/O call (and of
one staging slot, one multipart part); ``ALIGN`` the page size direct I/O needs.
"""

from __future__ import annotations

import torch

ALIGN = 4096
BLOCK = 16 * 1024 * 1024
# Below this a tensor goes through the bounce buffer even when it is aligned: one copy
# is cheaper than an extra system call.
ZERO_COPY_MIN_BYTES = 1024 * 1024


class Segment:
    """Bytes at ``offset`` in a file, as a flat uint8 tensor (source or destination)."""

    __slots__ = ("offset", "data", "array", "end")

    def __init__(self, offset: int, data: torch.Tensor) -> None:
        self.offset = offset
        self.data = data
        self.array = data.numpy()  # the same memory, for cheap small copies
        self.end = offset + len(self.array)
