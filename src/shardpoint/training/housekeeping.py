"""Deleting and setting aside checkpoints: retention, passed-over and rolled-back steps, leftovers.

Every deletion is best effort: what cannot be deleted now (a read-only mount, another
writer, a store that is down) is a warning and a ``delete_failed`` event, never an error
that fails a committed save or a restore. Set aside means moved out of the way with
every byte kept (``step-N.WHY-K``): the user decides what to delete.
"""

from __future__ import annotations

import warnings
from collections.abc import Collection
from typing import Any

from .. import dist
from ..checkpoint_dir import open_committed
from ..errors import CheckpointError
from .events import EventLog
from .memory_tier import MemoryTier
from .node_layout import keeps_local
from .restore import PassedOver
from .retention import KeptCheckpoint, RetentionPolicy
from .rollback import Rollback
from .tiers import CheckpointTier, Uploader


class Housekeeping:
    """What a manager deletes or moves aside in its tiers (the local directory on the
    ranks that keep it, the remote on rank 0), logged to ``events``."""

    def __init__(
        self,
        tier: CheckpointTier,
        remote: CheckpointTier | None,
        memory: MemoryTier | None,
        events: EventLog,
        *,
        per_node: bool,
        retention: RetentionPolicy,
        remote_retention: RetentionPolicy | None,
    ) -> None:
        self.tier = tier
        self.remote = remote
        self.memory = memory
        self.events = events
        self.per_node = per_node
        self.retention = retention
        self.remote_retention = remote_retention

    @property
    def _keeps_local(self) -> bool:
        return keeps_local(self.per_node)

    # ---- leftovers --------------------------------------------------------------------------

    def remove_leftovers(self) -> None:
        """Delete step directories a crashed save, upload or deletion left without a marker.

        Best effort: on a read-only mount (an evaluation job) or when another process is
        saving one of them right now, they stay, and restore still works.
        """
        tiers = [self.tier] if self._keeps_local else []
        if dist.rank() == 0 and self.remote is not None:
            tiers.append(self.remote)
        for tier in tiers:
            try:
                leftovers = tier.leftovers()
            except CheckpointError as exc:  # unreadable, or a store that is down
                self.cannot_delete(tier.root, exc)
                continue
            pruned = [s for s in leftovers if tier.commit_of(s).is_pruned()]
            try:  # files the committed checkpoints refer to stay
                references = tier.references(tier.steps()) if pruned else {}
            except CheckpointError as exc:  # the listing failed: clean up next time
                self.cannot_delete(tier.root, exc)
                continue
            for step in leftovers:
                if step not in pruned:  # a crashed save or upload: nothing refers to it
                    self._delete(tier, step, "cleanup")
                elif references is not None and tier.unreferenced(step, references.get(step, ())):
                    self._delete(tier, step, "cleanup", keep=references.get(step, ()))

    def _delete(
        self,
        source: CheckpointTier,
        step: int,
        event: str,
        keep: Collection[str] = (),
        **fields: Any,
    ) -> None:
        """Delete one checkpoint (except the files in ``keep``), best effort: what cannot
        be deleted now is reported."""
        try:
            source.delete(step, keep)
        except (OSError, CheckpointError) as exc:  # read-only, permissions, another writer
            self.cannot_delete(source.path_for(step), exc)
            return
        self.events.write(event, step=step, path=str(source.path_for(step)), **fields)

    def cannot_delete(self, path: Any, exc: BaseException) -> None:
        """Warn and log that ``path`` (None: the directory) is left in place."""
        where = path if path is not None else self.tier.storage.root
        warnings.warn(f"{where}: left in place, cannot delete it ({exc})", stacklevel=3)
        self.events.write("delete_failed", path=str(where), error=str(exc))

    # ---- set aside --------------------------------------------------------------------------

    def apply_rollback(self, rollback: Rollback) -> None:
        """Set aside what ``rollback`` goes back past, on this rank's tiers (see
        ``training/rollback.py``). Idempotent; collective only through its barrier."""
        tiers = [("local", self.tier)] if self._keeps_local else []
        if dist.rank() == 0 and self.remote is not None:
            tiers.append(("remote", self.remote))
        for name, tier in tiers:
            try:
                steps = [s for s in tier.steps() if rollback.passes_over(s, tier.committed_at(s))]
            except CheckpointError as exc:  # a store down: applied at the next start
                self.cannot_delete(tier.root, exc)
                continue
            for step in steps:
                self._set_aside(name, tier, step, "rolled-back")
        if self.memory is not None:
            self.memory.discard(rollback.passes_over)
        dist.barrier()  # set aside on every node before any rank restores or saves

    def set_aside_passed_over(self, passed: PassedOver) -> None:
        """Collective, at the first save after a restore that passed over newer steps
        (no copy of theirs could be used, or an explicit older step was restored): move
        their directories out of the way, every byte kept (``step-N.unusable-K``,
        ``step-N.superseded-K``). This run goes on from an older step and saves those
        steps anew; left in place they were taken for this run's saves (skipped as saved
        already), kept by retention as the newest, and tried first by every later
        restore. A failure to read them may have been passing (a store or disk that was
        down), so nothing is deleted: the user decides."""
        tiers = [("local", self.tier, self._keeps_local)]
        if self.remote is not None:
            tiers.append(("remote", self.remote, dist.rank() == 0))
        for name, tier, mine in tiers:
            steps = [s for s, (tried, _) in passed.items() if name in tried and mine]
            try:
                here = set(tier.step_dirs()) if steps else set()  # a node may not hold them
            except CheckpointError as exc:  # a store down: left as is, the barrier still met
                self.cannot_delete(tier.root, exc)
                continue
            for step in sorted(s for s in steps if s in here):
                self._set_aside(name, tier, step, passed[step][1])
        dist.barrier()  # moved on every node before any rank saves one of those steps

    def _set_aside(self, name: str, tier: CheckpointTier, step: int, why: str) -> None:
        """Move one checkpoint aside (``CheckpointTier.set_aside``), warning and logging."""
        try:
            where = tier.set_aside(step, why)
        except (OSError, CheckpointError) as exc:
            self.cannot_delete(tier.path_for(step), exc)
            return
        cause = {
            "unusable": "the restore could not use this checkpoint",
            "superseded": "an older checkpoint was restored",
            "rolled-back": "a rollback went back past this checkpoint",
        }[why]
        if where is None:
            warnings.warn(
                f"{tier.path_for(step)}: {cause} and it cannot be moved aside here (an "
                "object store, or a link): this run will not save that step again until "
                "it is removed",
                stacklevel=4,
            )
            return
        warnings.warn(
            f"{tier.path_for(step)}: {cause}; moved to {where} (delete it when it is not "
            "needed) so that this run saves that step again",
            stacklevel=4,
        )
        self.events.write("set_aside", step=step, path=where, tier=name, why=why)

    # ---- retention --------------------------------------------------------------------------

    def apply_retention(self, saved: int, saved_good: bool, uploader: Uploader | None) -> None:
        """Apply the policy after the save of step ``saved``, which is always kept: a
        higher step (a damaged checkpoint, an earlier run's) is not newer than it."""
        candidates, unreadable = [], set()
        steps = self.tier.steps()
        # Known-good ones, newest first, only as far back as the policy needs: after a
        # good save that is the saved step itself, and no index is read.
        good, wanted = set(), self.retention.keep_last_good or 0
        for step in reversed(steps):
            if len(good) >= wanted:
                break
            if step == saved and saved_good or step != saved and self._good(step):
                good.add(step)
        for step in steps:
            metric = None
            if self.retention.best_metric:
                try:
                    metrics = self._index_metadata(step).get("metrics", {})
                    metric = metrics.get(self.retention.best_metric)
                except CheckpointError as exc:
                    if isinstance(exc.__cause__, OSError):  # could not be read: its metric
                        unreadable.add(step)  # is unknown, so it is not deleted on a guess
                    # An invalid index: no metric, kept or dropped by the other rules.
            candidates.append(KeptCheckpoint(step, metric, step in good))
        keep = self.retention.keep(candidates) | {saved} | unreadable
        uploading = uploader.busy_step if uploader is not None else None
        if uploading is not None:
            keep.add(uploading)
        self._delete_all_but(self.tier, [c.step for c in candidates], keep)

    def _index_metadata(self, step: int) -> dict[str, Any]:
        # Index only: a node-local copy names files on other nodes' disks.
        ckpt = open_committed(self.tier.open(step), every_file=False)
        return dict(ckpt.index.metadata)

    def _good(self, step: int) -> bool:
        """Whether ``step`` was saved known good (``metadata["good"]``); an unreadable
        index, or a checkpoint saved without the flag, is not known good."""
        try:
            return self._index_metadata(step).get("good") is True
        except CheckpointError:
            return False

    def apply_remote_retention(self, uploaded: int) -> None:
        """Remote retention after the upload of step ``uploaded``, which is always kept."""
        assert self.remote is not None
        steps = self.remote.steps()
        assert self.remote_retention is not None
        keep = self.remote_retention.keep([KeptCheckpoint(s, None) for s in steps]) | {uploaded}
        self._delete_all_but(self.remote, steps, keep, tier="remote")

    def _delete_all_but(
        self, source: CheckpointTier, steps: list[int], keep: set[int], **fields: Any
    ) -> None:
        """Delete the checkpoints of ``steps`` not in ``keep``, keeping every file a kept
        one refers to (incremental saves); then what is left of deleted ones that no
        kept checkpoint refers to any more."""
        keep = keep | {s for s in steps if source.linked(s)}  # never deleted through a link
        references = source.references(sorted(keep))  # None: a kept one is unreadable
        for step in steps:
            if step not in keep:
                kept = source.kept_files(step, references)
                self._delete(source, step, "delete", kept, **fields)
        for step in source.pruned(steps) if references is not None else []:
            if step not in keep and source.unreferenced(step, references.get(step, ())):
                self._delete(source, step, "cleanup", references.get(step, ()), **fields)
