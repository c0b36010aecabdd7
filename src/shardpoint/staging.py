"""The staging pool of background saves: reusable, page-aligned host memory in slots.

A background save copies the bytes of every file it will write into pool slots (the
only work on the training thread), and the writer threads write the slots out and
hand them back. Slots are fixed-size, page-aligned (so O_DIRECT can write them as
they are) and kept for the life of the pool: faulting in fresh pages costs more than
the copy itself (a 1.5 GB ``clone()`` takes 0.67 s on the benchmark machine, a copy
into warm pool memory 0.10 s). On CUDA machines slots are pinned, so device-to-host
copies run at full speed without a bounce through pageable memory.
"""

from __future__ import annotations

import mmap
import queue
import threading
from dataclasses import dataclass

import torch

from .storage.io_types import ALIGN, BLOCK

SLOT_BYTES = BLOCK  # one write call per slot, the same size the sync writer uses


@dataclass(eq=False)
class Slot:
    """One page-aligned buffer of SLOT_BYTES."""

    data: torch.Tensor  # uint8, SLOT_BYTES
    pending: int = 0  # consumers (writer, hasher) still using it


def _allocate_slot(pinned: bool) -> Slot:
    if pinned:
        # cudaHostAlloc hands out whole pages. Asking for a page more than the slot
        # would cost double: the pinned allocator rounds every request up to a power
        # of two (measured on an H200, docs/benchmarks.md).
        raw = torch.empty(SLOT_BYTES, dtype=torch.uint8, pin_memory=True)
        if raw.data_ptr() % ALIGN == 0:
            return Slot(raw)
        raw = torch.empty(SLOT_BYTES + ALIGN, dtype=torch.uint8, pin_memory=True)
        skip = -raw.data_ptr() % ALIGN
        return Slot(raw[skip : skip + SLOT_BYTES])
    flags = mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS | getattr(mmap, "MAP_POPULATE", 0)
    return Slot(torch.frombuffer(mmap.mmap(-1, SLOT_BYTES, flags=flags), dtype=torch.uint8))


class StagingPool:
    """Slots for staging, allocated on first need and reused by every later save.

    ``capacity_bytes=None`` grows the pool to hold the largest save seen, so a save
    never waits for the disk before it returns. A smaller capacity bounds host memory:
    a save larger than the pool streams through it, and the caller waits only for the
    part that does not fit.
    """

    def __init__(self, capacity_bytes: int | None = None, *, pinned: bool | None = None) -> None:
        if capacity_bytes is not None and capacity_bytes < SLOT_BYTES:
            raise ValueError(f"staging pool capacity must be at least {SLOT_BYTES} bytes")
        self.capacity_slots = None if capacity_bytes is None else capacity_bytes // SLOT_BYTES
        self.pinned = torch.cuda.is_available() if pinned is None else pinned
        self._free: queue.SimpleQueue[Slot] = queue.SimpleQueue()
        self._count = 0
        self._lock = threading.Lock()

    @property
    def nbytes(self) -> int:
        """Host memory held by the pool."""
        return self._count * SLOT_BYTES

    def reserve(self, slots: int) -> None:
        """Grow the pool towards ``slots`` slots (never past its capacity)."""
        if self.capacity_slots is not None:
            slots = min(slots, self.capacity_slots)
        with self._lock:
            while self._count < slots:
                self._free.put(_allocate_slot(self.pinned))
                self._count += 1

    def acquire(self) -> Slot:
        """A free slot; blocks until a writer hands one back."""
        return self._free.get()

    def acquire_or_grow(self) -> Slot | None:
        """A free slot, else a new one while the pool is under its capacity (allocated
        on the caller's thread), else None at once."""
        try:
            return self._free.get_nowait()
        except queue.Empty:
            pass
        with self._lock:
            if self.capacity_slots is not None and self._count >= self.capacity_slots:
                return None
            self._count += 1
        return _allocate_slot(self.pinned)

    def release(self, slot: Slot) -> None:
        self._free.put(slot)

    def done_with(self, slot: Slot) -> None:
        """One consumer is done with ``slot``; the last one returns it to the pool."""
        with self._lock:
            slot.pending -= 1
            last = slot.pending == 0
        if last:
            self.release(slot)
