"""Bytes several ranks need are read from storage once (``load(..., share_reads=True)``).

Under DDP every rank needs every parameter; under HSDP each replica group needs the
same shards. Without sharing, N replicas read the same bytes N times from storage. With
it, rank 0 learns each distinct list of regions the ranks must fill and plans; every
region needed by several ranks is read and verified by one of them — the least loaded
so far, so replicas split the reading — and sent to the others over
``torch.distributed``, after every rank reported its reads verified (a small
all-reduce). Every rank must call ``load`` with it, so it is opt-in;
``CheckpointManager.restore`` uses it.

Only CPU destinations are shared (the exchange runs on the CPU group); others are read
by each rank as before.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from typing import Any

import torch
import xxhash

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
    """Whether any rank failed (one small all-reduce; the messages travel only then).
    Raises on every rank if any rank failed: its own error on the failing rank, a
    ``CheckpointError`` naming it elsewhere."""
    first = dist.first_error(f"rank {dist.rank()}: {error}" if error else None, group)
    _raise_if_failed(error, [first], where)


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
    to prepare its load (``error``, and no ``reads``).

    What crosses the wire does not grow with ranks × tensors: every rank sends a digest
    of its region list (one small all-gather), rank 0 receives each *distinct* list once
    (under DDP all ranks need the same regions: one list), plans, and each rank
    receives only its own part of the plan."""
    mine: dict[str, Region] = {}
    if reads is not None:
        for name, regions in reads.regions.items():
            for r in regions:
                if r.tensor.device.type == "cpu":
                    mine[f"{name}|{list(r.offsets)}|{list(r.tensor.shape)}"] = r
    wanted = [[k, r.tensor.numel() * r.tensor.element_size()] for k, r in mine.items()]
    digest = xxhash.xxh3_64_hexdigest(json.dumps(wanted).encode())
    facts = dist.all_gather_json(
        {"error": f"rank {dist.rank()}: {error}" if error else None, "digest": digest}, group
    )
    _raise_if_failed(error, [f["error"] for f in facts], where)
    digests = [f["digest"] for f in facts]
    first = digests.index(digest) == dist.rank()  # this rank speaks for its list
    lists = dist.gather_some_json(wanted if first else None, 0, group)
    parts = None
    if lists is not None:
        distinct = {digests[r]: lst for r, lst in enumerate(lists) if lst is not None}
        parts = assign_readers(distinct, digests)
    part = dist.scatter_json(parts, 0, group)
    plan = SharedReads()
    for tag, key, readers in part:
        region = mine[key]
        assert reads is not None
        if isinstance(readers, list):  # this rank reads it and sends it to these
            plan.sends.append((tag, region.tensor, readers))
            plan.read_bytes += region.tensor.numel() * region.tensor.element_size()
        else:  # rank ``readers`` reads it for this one
            plan.receives.append((tag, region, readers))
            name = key.split("|", 1)[0]
            reads.regions[name] = [r for r in reads.regions[name] if r is not region]
    return plan


def assign_readers(
    distinct: dict[str, list[list[Any]]], digests: list[str]
) -> list[list[list[Any]]]:
    """Rank 0's plan: for each region several ranks need (by key), the reader is the
    least loaded of them so far, so replicas split the reading. ``distinct``: each
    distinct region list (``[key, bytes]`` pairs) by digest; ``digests``: each rank's.
    Returns each rank's part: ``[tag, key, [ranks to send to]]`` where it reads,
    ``[tag, key, reader]`` where it receives; tags number the shared regions."""
    holders: dict[str, list[int]] = {}
    sizes: dict[str, int] = {}
    ranks_of: dict[str, list[int]] = {}
    for rank, d in enumerate(digests):
        ranks_of.setdefault(d, []).append(rank)
    for d, ranks in ranks_of.items():
        for key, nbytes in distinct[d]:
            holders.setdefault(key, []).extend(ranks)
            sizes[key] = nbytes
    load = [0] * len(digests)
    parts: list[list[list[Any]]] = [[] for _ in digests]
    shared = sorted(key for key, ranks in holders.items() if len(ranks) > 1)
    for tag, key in enumerate(shared):
        ranks = sorted(holders[key])
        reader = min(ranks, key=load.__getitem__)  # the first of equals: the lowest rank
        load[reader] += sizes[key]
        parts[reader].append([tag, key, [r for r in ranks if r != reader]])
        for r in ranks:
            if r != reader:
                parts[r].append([tag, key, reader])
    return parts


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
