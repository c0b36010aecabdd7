"""Rollbacks: going back to an earlier checkpoint of a run, on purpose (a loss spike).

A rollback is a record in the run's ``rollbacks.json`` (its directory; the remote tier
keeps a copy): the step to go back to, how many batches to skip after it, why, and when
it was asked for. Applying it sets aside, on every tier, each checkpoint newer than its
step committed *before* it was asked for (``step-N.rolled-back-K``, every byte kept) and
drops such copies from the memory tier. The rule reads the marker's time, so applying
a rollback again changes nothing and never touches a checkpoint the resumed run saved
after it: each node applies it at the manager's start to what it holds (a node the
request could not reach, a requeued job), and the same request made twice is one.

The skipped batches are skipped whenever a restore lands on the rollback's step (a
later checkpoint already holds the advanced position).
"""

from __future__ import annotations

import json
import time
import warnings
from dataclasses import asdict, dataclass
from typing import Any

from .. import dist
from ..errors import CheckpointError
from ..names import ROLLBACKS_NAME
from ..storage import CheckpointStorage
from .tiers import CheckpointTier

_MAX_BYTES = 16 * 1024 * 1024


@dataclass(frozen=True)
class Rollback:
    to_step: int
    skip_batches: int = 0
    reason: str = ""
    time: float = 0.0  # when it was asked for (seconds since the epoch)

    def same_request(self, other: Rollback) -> bool:
        return (self.to_step, self.skip_batches, self.reason) == (
            other.to_step,
            other.skip_batches,
            other.reason,
        )

    def passes_over(self, step: int, committed_at: float | None) -> bool:
        """Whether the checkpoint of ``step``, committed at ``committed_at``, is one this
        rollback goes back past."""
        return step > self.to_step and committed_at is not None and committed_at < self.time


def request(to_step: int, skip_batches: int = 0, reason: str = "") -> Rollback:
    if to_step < 0 or skip_batches < 0:
        raise ValueError("a rollback needs to_step >= 0 and skip_batches >= 0")
    return Rollback(int(to_step), int(skip_batches), str(reason), round(time.time(), 6))


def read_rollbacks(storage: CheckpointStorage) -> list[Rollback]:
    """The rollbacks recorded in ``storage`` (a run's directory), oldest first."""
    raw = storage.read_small(ROLLBACKS_NAME, _MAX_BYTES)
    if raw is None:
        return []
    try:
        return [Rollback(**r) for r in json.loads(raw)]
    except (ValueError, TypeError) as exc:
        raise CheckpointError(
            f"{storage.location(ROLLBACKS_NAME)}: not a list of rollbacks ({exc}); restore "
            "it from the remote tier's copy, or remove it to forget every rollback"
        ) from exc


def merged(*lists: list[Rollback]) -> list[Rollback]:
    """The rollbacks of several copies of the record, each once, oldest first."""
    out: dict[tuple[int, int, str, float], Rollback] = {}
    for r in (r for rs in lists for r in rs):
        out.setdefault((r.to_step, r.skip_batches, r.reason, r.time), r)
    return sorted(out.values(), key=lambda r: r.time)


def write_rollbacks(storage: CheckpointStorage, rollbacks: list[Rollback]) -> None:
    storage.write_small_durably(
        ROLLBACKS_NAME, json.dumps([asdict(r) for r in rollbacks], indent=1).encode()
    )


def agreed_rollbacks(local: CheckpointTier, remote: CheckpointTier | None) -> list[Rollback]:
    """Collective: the run's rollbacks (rank 0 reads its directory's record and the
    remote's, and sends the union: the same list on every rank)."""
    found: Any = None
    if dist.rank() == 0:
        lists = [_read_or_warn(local)]
        if remote is not None:
            lists.append(_read_or_warn(remote))
        found = [vars(r) for r in merged(*lists)]
    return [Rollback(**r) for r in dist.broadcast_json(found)]


def _read_or_warn(tier: CheckpointTier) -> list[Rollback]:
    try:
        return read_rollbacks(tier.storage)
    except CheckpointError as exc:  # a store down, or a damaged record
        warnings.warn(f"{tier.root}: rollbacks not read: {exc}", stacklevel=4)
        return []


def record_rollbacks(
    rollbacks: list[Rollback], local: CheckpointTier, remote: CheckpointTier | None, keeper: bool
) -> None:
    """Write the agreed rollbacks where they are read: every node's directory (by its
    keeper) and the remote (by rank 0). Best effort: a failure is a warning."""
    where = [local] if keeper else []
    if dist.rank() == 0 and remote is not None:
        where.append(remote)
    for tier in where:
        try:
            write_rollbacks(tier.storage, rollbacks)
        except (OSError, CheckpointError) as exc:
            warnings.warn(
                f"{tier.root}: cannot record the rollback ({exc}); a restart will not know of it",
                stacklevel=3,
            )


def add_rollback(rollbacks: list[Rollback], new: Rollback) -> tuple[list[Rollback], Rollback]:
    """``rollbacks`` with ``new`` added, and the rollback in effect: an identical request
    already recorded (a requeued job asking again) is that one, not a second."""
    for r in rollbacks:
        if r.same_request(new):
            return rollbacks, r
    return [*rollbacks, new], new


def skip_for(rollbacks: list[Rollback], step: int) -> int:
    """Batches to skip after a restore of ``step``: the newest rollback to it says."""
    to_it = [r for r in rollbacks if r.to_step == step]
    return to_it[-1].skip_batches if to_it else 0


def skip_batches(state: Any, n: int, where: str) -> None:
    """Advance the data position in ``state`` by ``n`` batches (an object with
    ``skip_batches``: ``ResumableLoader``, ``TrainState``, or one in a dict of state)."""
    if n == 0:
        return
    holders = [state] if hasattr(state, "skip_batches") else []
    if not holders and isinstance(state, dict):
        holders = [v for v in state.values() if hasattr(v, "skip_batches")]
    if not holders:
        raise CheckpointError(
            f"{where}: the rollback asks to skip {n} batches, but the state has no data "
            "loader that can skip (a ResumableLoader, in a TrainState or the state dict); "
            "skip them in the training loop, or roll back with skip_batches=0"
        )
    for holder in holders:
        holder.skip_batches(n)
