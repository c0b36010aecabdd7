"""Bytes several ranks need are read from storage once (``load(..., share_reads=True)``).

Under DDP every rank needs every parameter; under HSDP each replica group needs the
same shards. Without sharing, N replicas read the same bytes N times from storage. With
it, the ranks exchange what each must fill (one all-gather), every region needed by
several ranks is read and verified by one of them — the least loaded so far, so
replicas split the reading — and sent to the others over ``torch.distributed``, after
every rank reported its reads verified (a second small all-gather). Every rank must
call ``load`` with it, so it is opt-in; ``CheckpointManager.restore`` uses it.

Only CPU destinations are shared (the exchange runs on the CPU group); others are read
by each rank as before.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch

from . import dist
from .errors import CheckpointError
from .tensor_memory import flat_bytes

# The read plan, its regions and the undo copy are loading.py's (ReadPlan, Region,
# Undo); typed Any here so that this module does not import the one that uses it.
ReadPlan = Any
Region = Any
Undo = Any


@dataclass
class SharedReads:
    """This rank's part of the exchange, in the agreed order (its index is the tag)."""

    sends: list[tuple[int, torch.Tensor, list[int]]] = field(default_factory=list)
    receives: list[tuple[int, Region, int]] = field(default_factory=list)
    read_bytes: int = 0  # of the shared regions, what this rank reads itself


def agree(error: BaseException | None, where: str, group: Any) -> None:
    """One all-gather of every rank's error. Raises on every rank if any rank failed:
    its own error on the failing rank, a ``CheckpointError`` naming it elsewhere."""
    errors = dist.all_gather_json(f"rank {dist.rank()}: {error}" if error else None, group)
    _raise_if_failed(error, errors, where)


def _raise_if_failed(error: BaseException | None, errors: list[str | None], where: str) -> None:
    if error is not None:
        raise error
    failed = [e for e in errors if e]
    if failed:
        raise CheckpointError(f"{where}: another rank could not load: {failed[0]}")


def join_failed(error: BaseException, where: str) -> None:
    """For a rank that cannot even start a shared load (no copy of the checkpoint on
    its node): take part in the load's first collective, so that every rank raises."""
    plan_shared_reads(None, error, where, None)


def plan_shared_reads(
    reads: ReadPlan | None, error: BaseException | None, where: str, group: Any
) -> SharedReads:
    """Agree with every rank on who reads each region several ranks need, and take the
    regions other ranks read out of ``reads``. Raises on every rank if any rank failed
    to prepare its load (``error``, and no ``reads``)."""
    mine: dict[str, Region] = {}
    if reads is not None:
        for name, regions in reads.regions.items():
            for r in regions:
                if r.tensor.device.type == "cpu":
                    mine[f"{name}|{list(r.offsets)}|{list(r.tensor.shape)}"] = r
    wanted = [[k, r.tensor.numel() * r.tensor.element_size()] for k, r in mine.items()]
    gathered = dist.all_gather_json(
        {"error": f"rank {dist.rank()}: {error}" if error else None, "wanted": wanted}, group
    )
    _raise_if_failed(error, [g["error"] for g in gathered], where)
    holders: dict[str, list[int]] = {}
    sizes: dict[str, int] = {}
    for rank, g in enumerate(gathered):
        for key, nbytes in g["wanted"]:
            holders.setdefault(key, []).append(rank)
            sizes[key] = nbytes
    me = dist.rank()
    load = [0] * len(gathered)
    plan = SharedReads()
    shared = sorted(key for key, ranks in holders.items() if len(ranks) > 1)
    for tag, key in enumerate(shared):
        ranks = holders[key]
        reader = min(ranks, key=lambda r: (load[r], r))
        load[reader] += sizes[key]
        if me not in ranks:
            continue
        region = mine[key]
        assert reads is not None
        if reader == me:
            plan.sends.append((tag, region.tensor, [r for r in ranks if r != me]))
            plan.read_bytes += sizes[key]
        else:
            plan.receives.append((tag, region, reader))
            name = key.split("|", 1)[0]
            reads.regions[name] = [r for r in reads.regions[name] if r is not region]
    return plan


def exchange(plan: SharedReads, undo: Undo, group: Any) -> None:
    """Send the regions this rank read to the ranks that need them and receive the
    others, then put them in place (with an undo copy of live ones first)."""
    pending = []
    received = []
    for tag, region, src in plan.receives:
        buffer = torch.empty(region.tensor.shape, dtype=region.tensor.dtype)
        pending.append(dist.irecv_bytes(flat_bytes(buffer), src, tag, group))
        received.append((region, buffer))
    sent = [flat_bytes(tensor.contiguous()) for _, tensor, _ in plan.sends]  # alive until sent
    for (tag, _, dsts), data in zip(plan.sends, sent):
        pending.extend(dist.isend_bytes(data, dst, tag, group) for dst in dsts)
    for work in pending:
        work.wait()
    with torch.no_grad():
        for region, buffer in received:
            for dest in (region.tensor, *region.copies):
                if region.live:
                    undo.save([dest])
                dest.copy_(buffer)
