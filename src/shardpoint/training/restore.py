"""Choosing what to restore: the copies a restore may load, newest first, and loading one.

``Restorer.candidates`` lists every copy (``RestoreCandidate``) in the order they are
tried: for each step, newest first, the memory tier, then each node's disk (files it
lacks from the remote), then the remote alone. ``Restorer.restore`` loads the first one
every rank can read and says which newer steps it passed over; a damaged or incomplete
copy is a warning and a fallback to the next, a state that does not fit is raised.
"""

from __future__ import annotations

import time
import warnings
from dataclasses import dataclass
from typing import Any, Literal

from .. import dist
from ..errors import (
    CheckpointError,
    CorruptCheckpointError,
    StateMismatchError,
    UnsupportedValueError,
)
from ..loading import load
from ..shared_reads import join_failed
from ..staging import StagingPool
from ..storage.layered import LayeredCheckpoint
from .events import EventLog
from .memory_tier import MemoryTier
from .options import IOOptions
from .tiers import CheckpointTier

# How a rank's restore attempt failed, gravest last (``dist.worst_error``).
_UNUSABLE, _FAILED, _MISMATCH = 0, 1, 2

# Steps a restore passed over -> (the tiers holding them, why): no copy could be used
# ("unusable"), or an explicit older step was restored ("superseded").
PassedOver = dict[int, tuple[set[str], str]]


@dataclass(frozen=True)
class RestoreCandidate:
    """One copy of ``step`` a restore may load: from the memory tier, from each node's
    disk (``tier="local"``; ``use_local`` where this node holds the step, ``use_remote``
    for the files it lacks), or from the remote alone (``tier="remote"``)."""

    step: int
    tier: Literal["memory", "local", "remote"]
    use_local: bool = False
    use_remote: bool = False


class Restorer:
    """Loads a run's newest usable copy from its tiers (collective: every rank builds
    the same candidates from agreed facts and tries them together)."""

    def __init__(
        self,
        tier: CheckpointTier,
        remote: CheckpointTier | None,
        memory: MemoryTier | None,
        io: IOOptions,
        events: EventLog,
        *,
        undo_pool: StagingPool | None = None,
    ) -> None:
        self.undo_pool = undo_pool  # where a load's undo copy goes (loading.Undo)
        self.tier = tier
        self.remote = remote
        self.memory = memory
        self.io = io
        self.events = events

    def restore(self, state: Any, wanted: int | None) -> tuple[int | None, PassedOver]:
        """Load into ``state`` the newest candidate every rank can read (with ``wanted``,
        that step only); returns its step (None if none) and the newer steps passed over.
        Restoring an explicit older step drops the memory tier's newer copies."""
        failed: dict[int, set[str]] = {}  # step -> the tiers whose copy could not be used
        candidates = self.candidates()
        for candidate in candidates:
            step = candidate.step
            if wanted is not None and step != wanted:
                continue
            if candidate.tier == "memory":
                loaded = self._from_memory(state, step)
            else:
                loaded = self._from_storage(state, candidate)
            if loaded:
                passed = {s: (tiers, "unusable") for s, tiers in failed.items() if s > step}
                if wanted is not None:
                    newer = {c.step for c in candidates if c.step > wanted}
                    passed = {s: ({"local", "remote"}, "superseded") for s in newer}
                    if self.memory is not None:
                        self.memory.discard(lambda s, _: s > wanted)
                return step, passed
            if candidate.tier != "memory":
                failed.setdefault(step, set()).add(candidate.tier)
        return None, {s: (tiers, "unusable") for s, tiers in failed.items()}

    def candidates(self) -> list[RestoreCandidate]:
        """Every copy ``restore`` may load, in the order it tries them. Newest step first;
        for one step the memory tier, then each node's disk (missing files from the
        remote), then the remote alone. Every rank builds the same list from agreed facts."""
        local = set(self.tier.steps())
        remote = set(
            dist.broadcast_json(self._reachable_remote_steps() if dist.rank() == 0 else None)
        )
        every_rank = dist.gather_json(sorted(local))  # on rank 0, which sends the union
        on_disk = set(
            dist.broadcast_json(
                None if every_rank is None else sorted({s for ss in every_rank for s in ss})
            )
        )
        out: list[RestoreCandidate] = []
        if self.memory is not None:
            in_memory = self.memory.newest_step()  # collective: ranks agree on it
            if self.memory.lost is not None:
                lost = self.memory.lost
                self.events.log(
                    "fallback",
                    step=lost["step"],
                    tier="memory",
                    error=f"memory tier: the copies of ranks {lost['ranks']} of step "
                    f"{lost['step']} are on no surviving node and cannot be rebuilt (more "
                    "nodes lost than its redundancy covers); restoring from storage",
                )
            if in_memory is not None and in_memory >= max(on_disk | remote, default=-1):
                out.append(RestoreCandidate(in_memory, "memory"))
        for step in sorted(on_disk | remote, reverse=True):
            if step in on_disk:
                out.append(RestoreCandidate(step, "local", step in local, step in remote))
            if step in remote:
                out.append(RestoreCandidate(step, "remote", use_local=False, use_remote=True))
        return out

    def _from_memory(self, state: Any, step: int) -> bool:
        assert self.memory is not None
        start = time.perf_counter()
        try:
            self.memory.restore(state, step, undo_pool=self.undo_pool)
        except CorruptCheckpointError as exc:  # every rank gets it: the tier agrees
            warnings.warn(f"{exc}; restoring from storage instead", stacklevel=4)
            self.events.log("fallback", step=step, tier="memory", error=str(exc))
            return False
        self.events.log(
            "restore",
            step=step,
            tier="memory",
            bytes_from_buddies=self.memory.bytes_received,
            **self.memory.restored_how,
            seconds=round(time.perf_counter() - start, 4),
        )
        return True

    def _reachable_remote_steps(self) -> list[int]:
        """The remote's committed steps; none, with a warning, while it cannot be reached
        (the local copies may still be complete)."""
        try:
            return self.remote.steps() if self.remote is not None else []
        except CheckpointError as exc:
            warnings.warn(f"remote tier not reachable, restoring without it: {exc}", stacklevel=4)
            self.events.log("fallback", tier="remote", error=str(exc))
            return []

    def _from_storage(self, state: Any, candidate: RestoreCandidate) -> bool:
        """Collective: load ``candidate`` from this rank's copies; True if every rank did."""
        step, tier, use_remote = candidate.step, candidate.tier, candidate.use_remote
        copies = [self.tier.open(step)] if candidate.use_local else []
        remote_copy = self.remote.open(step) if use_remote and self.remote is not None else None
        if remote_copy is not None:
            copies.append(remote_copy)
        named = self.remote if tier == "remote" and self.remote is not None else self.tier
        path = str(named.path_for(step))
        start = time.perf_counter()
        mine: BaseException | None = None
        kind = -1
        view = LayeredCheckpoint(copies) if copies else None
        # When bytes may come from the object store, those several ranks need are read
        # once and sent between ranks; from local disks alone each rank reads its own
        # (cheaper here: docs/benchmarks.md). Decided from agreed facts only.
        share = use_remote and self.remote is not None
        try:
            if view is None:
                missing = CorruptCheckpointError(f"{path}: no copy of step {step} on this node")
                if share:  # the others are in the load's collective
                    join_failed(missing, path)
                raise missing
            load(
                state,
                view,
                verify=self.io.verify == "full",
                threads=self.io.threads,
                share_reads=share,
                undo_pool=self.undo_pool,
            )
        except StateMismatchError as exc:
            mine, kind = exc, _MISMATCH
        except UnsupportedValueError as exc:  # the state's fault: older ones fail alike
            mine, kind = exc, _FAILED
        except CheckpointError as exc:  # corrupt, incomplete, unreadable
            mine, kind = exc, _UNUSABLE
        except Exception as exc:  # anything else (a Stateful's own error): raised on every rank
            mine, kind = exc, _FAILED
        # Ranks agree: a checkpoint is used only if it loaded on every rank; a mismatch
        # wins (an older checkpoint would not fit either), then an error that is not
        # the checkpoint's. The messages travel only if some rank failed.
        error = None if mine is None else f"rank {dist.rank()}: {type(mine).__name__}: {mine}"
        worst, first = dist.worst_error(error, kind)
        if worst == _MISMATCH:
            if kind == _MISMATCH:
                raise mine  # type: ignore[misc]
            raise StateMismatchError(f"another rank could not load {path}: {first}")
        if worst == _FAILED:
            if kind == _FAILED:
                raise mine  # type: ignore[misc]
            raise CheckpointError(f"another rank failed while loading {path}: {first}")
        if worst == _UNUSABLE:
            warnings.warn(
                f"checkpoint at step {step} is not usable ({first}); falling back to "
                "the next copy or the previous checkpoint",
                stacklevel=4,
            )
            self.events.log("fallback", step=step, path=path, error=first)
            return False
        from_remote = dist.gather_json(  # for rank 0's event log
            view.bytes_read_from(remote_copy) if view is not None and remote_copy else 0
        )
        if from_remote is not None:
            self.events.log(
                "restore",
                step=step,
                path=path,
                bytes_from_remote=sum(from_remote),
                bytes_from_remote_by_rank=from_remote,
                seconds=round(time.perf_counter() - start, 4),
            )
        return True
