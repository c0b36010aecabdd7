"""``CheckpointManager``: when to save, which checkpoints to keep, where to resume from.

The manager decides *when* and *what to keep*; ``shardpoint.save``/``load`` below it
know *how*. Layout: ``DIR/step-000001000/`` per checkpoint, ``DIR/events.jsonl`` for
the event log.
"""

from __future__ import annotations

import json
import math
import os
import signal
import threading
import time
import uuid
import warnings
from collections.abc import Callable, Collection, Iterable, Mapping
from functools import partial
from typing import Any

from .. import dist
from ..background_save import AsyncSave, AsyncSaver
from ..checkpoint_dir import open_committed
from ..errors import (
    CheckpointError,
    CorruptCheckpointError,
    NaNStateError,
    StateMismatchError,
    UnsupportedValueError,
)
from ..incremental import IncrementalChain
from ..loading import load
from ..names import RUN_ID_NAME
from ..nan_check import first_nan
from ..saving import SaveInfo, SaveOptions, run_save
from ..shared_reads import join_failed
from ..storage import CheckpointStorage, is_url, open_storage
from ..storage.layered import LayeredCheckpoint
from .memory_tier import MemoryTier
from .options import AsyncOptions, IOOptions, MemoryTierOptions, RemoteTier, SavePolicy
from .retention import KeptCheckpoint, RetentionPolicy
from .rollback import (
    Rollback,
    add_rollback,
    merged,
    read_rollbacks,
    request,
    skip_for,
    write_rollbacks,
)
from .rollback import skip_batches as skip_data_batches
from .tiers import CheckpointTier, Uploader

# Keyword arguments of earlier releases, and where each option lives now.
MOVED_OPTIONS = {
    "every_n_steps": "policy=SavePolicy(every_n_steps=...)",
    "every_n_seconds": "policy=SavePolicy(every_n_seconds=...)",
    "keep_last": "retention=RetentionPolicy(keep_last=...)",
    "memory_every_n_steps": "memory=MemoryTierOptions(every_n_steps=...)",
    "max_shard_size": "io=IOOptions(max_shard_size=...)",
    "threads": "io=IOOptions(threads=...)",
    "verify": "io=IOOptions(verify=...)",
    "storage_options": "io=IOOptions(storage_options=...)",
}


def _moved_options(given: dict[str, Any]) -> str:
    """The message for keyword arguments CheckpointManager does not take: the new
    spelling of each one that moved, or that it is unknown."""
    parts = [
        f"{name}= is now {MOVED_OPTIONS[name]}"
        if name in MOVED_OPTIONS
        else f"unexpected keyword argument {name!r}"
        for name in given
    ]
    return "CheckpointManager(): " + "; ".join(parts)


class EventLog:
    """JSON lines: one object per save, upload, restore, fallback, deletion, signal.

    Appended to a local file; on an object store (no append) the object is rewritten.
    With node-local directories each node keeps its own log: rank 0's holds saves,
    uploads and restores, every node's holds its own deletions.
    Writing is best effort: a full or read-only disk must not turn a committed save or
    a restore into a failure, so a failed write is a warning (once), never an error.

    ``listeners`` (``CheckpointManager(on_event=...)``: metrics exporters) receive every
    event as the dict written, on every rank that sees it (``notify``), also where the
    line is written by rank 0 only: one source of truth for the log and the metrics.
    """

    NAME = "events.jsonl"
    MAX_BYTES = 256 * 1024 * 1024

    def __init__(
        self, storage: CheckpointStorage, listeners: Iterable[Callable[[dict[str, Any]], None]] = ()
    ) -> None:
        self.storage = storage
        self.listeners = list(listeners)
        self._lock = threading.Lock()
        self._warned = False
        self._listener_warned = False

    def notify(self, event: str, **fields: Any) -> dict[str, Any]:
        """Give the event to the listeners (a listener's error is a warning, once: metrics
        must never fail a save); returns it."""
        record = {"event": event, "time": round(time.time(), 3), **fields}
        for listener in self.listeners:
            try:
                listener(record)
            except Exception as exc:
                if not self._listener_warned:
                    self._listener_warned = True
                    warnings.warn(f"event listener {listener!r} failed: {exc}", stacklevel=3)
        return record

    def write(self, event: str, **fields: Any) -> None:
        line = json.dumps(self.notify(event, **fields)) + "\n"
        with self._lock:
            try:
                self.storage.append_small(self.NAME, line.encode())
            except Exception as exc:  # OSError (ENOSPC, EROFS...), the object store's too
                if not self._warned:
                    self._warned = True
                    warnings.warn(
                        f"{self.storage.location(self.NAME)}: cannot write the event log "
                        f"({exc}); training and checkpoints go on without it",
                        stacklevel=3,
                    )

    def read(self) -> list[dict[str, Any]]:
        """The events; a line that is not a JSON object (torn by a full disk or a crash:
        the log is best effort) is skipped, with one warning naming the file."""
        raw = self.storage.read_small(self.NAME, self.MAX_BYTES) or b""
        events, torn = [], 0
        for line in raw.decode(errors="replace").splitlines():
            if not line.strip():
                continue
            try:
                event = json.loads(line)
            except ValueError:
                event = None
            if isinstance(event, dict):
                events.append(event)
            else:
                torn += 1
        if torn:
            warnings.warn(
                f"{self.storage.location(self.NAME)}: skipped {torn} line(s) that are not "
                "whole events (written while the disk was full, or cut by a crash)",
                stacklevel=2,
            )
        return events


class CheckpointManager:
    """Periodic checkpoints of a training job, retention, preemption and restore.

    >>> manager = CheckpointManager(                                      # doctest: +SKIP
    ...     "runs/exp1", SavePolicy(every_n_steps=500), RetentionPolicy(keep_last=3)
    ... )
    >>> start = manager.restore(state) or 0                               # doctest: +SKIP
    >>> for step in range(start + 1, total + 1):                          # doctest: +SKIP
    ...     train_step()
    ...     manager.maybe_save(step, state)
    ...     if manager.should_stop:
    ...         raise SystemExit(manager.exit_code)

    ``policy`` says when to save (``SavePolicy``), ``retention`` what to keep
    (``RetentionPolicy``). ``preemption_signals`` (default SIGTERM; Slurm's
    ``--signal=USR1@N`` sends SIGUSR1) make the next ``maybe_save`` save at once and
    then set ``should_stop``. ``preemption_grace_seconds``: the time the scheduler leaves
    between the signal and SIGKILL (one number, or one per signal); when what is left of
    it is shorter than a disk save takes (the last one measured), the final save goes to
    the memory tier only (docs/training.md, "Schedulers").

    ``directory`` may be an object-store URL, and may be node-local (the same path on
    every node, different disks: found out at start, docs/storage.md). With
    ``remote=RemoteTier(url)`` the manager is tiered: checkpoints go to the fast
    ``directory`` and every rank uploads its own files of each committed one in the
    background; ``restore`` reads each file from the local copy when it has it, else
    from the remote; ``close()`` waits for the uploads.

    ``memory=MemoryTierOptions(every_n_steps)`` adds the in-memory tier (``MemoryTier``,
    docs/memory.md); ``restore`` uses it when it holds the newest step every rank can
    recover, without reading the disk.

    ``async_save=True`` (or ``AsyncOptions(...)``) returns from a save once the state is
    staged and writes it in the background (``AsyncSaver``). Retention and the event
    log entry follow the commit. A preemption save first finishes the one in flight,
    then saves synchronously. ``close()`` waits for the save in flight and raises its
    error. ``io`` (``IOOptions``) holds shard size, threads, restore verification and
    the object-store client's options. ``on_event``: callables given every event as a
    dict (``shardpoint.metrics``), on every rank.
    """

    def __init__(
        self,
        directory: str | os.PathLike[str],
        policy: SavePolicy | None = None,
        retention: RetentionPolicy | None = None,
        *,
        remote: RemoteTier | None = None,
        memory: MemoryTierOptions | None = None,
        async_save: bool | AsyncOptions = False,
        io: IOOptions | None = None,
        preemption_signals: Iterable[int] = (signal.SIGTERM,),
        preemption_grace_seconds: float | Mapping[int, float] | None = None,
        incremental: bool = False,
        on_event: Iterable[Callable[[dict[str, Any]], None]] = (),
        **moved: Any,
    ) -> None:
        if moved:
            raise TypeError(_moved_options(moved))
        policy = policy or SavePolicy()
        retention = retention or RetentionPolicy()
        io = io or IOOptions()
        if isinstance(remote, str):
            raise TypeError(f"remote must be RemoteTier({remote!r}), not a string")
        if remote is not None and remote.compress and not is_url(remote.url):
            raise ValueError(
                f"{remote.url}: RemoteTier(compress=True) needs an object-store URL (s3://...)"
            )
        asynchronous = AsyncOptions() if async_save is True else async_save or None
        graces = (
            preemption_grace_seconds.values()
            if isinstance(preemption_grace_seconds, Mapping)
            else [preemption_grace_seconds]
        )
        if any(g is not None and g <= 0 for g in graces):
            raise ValueError("preemption_grace_seconds must be positive (or None: no budget)")
        if policy.continuous and asynchronous is None:
            raise ValueError("SavePolicy(continuous=True) needs async_save")
        storage_options = io.storage_options or None
        self.tier = CheckpointTier(directory, storage_options)
        self.directory = self.tier.storage.root  # a Path, or the URL
        # Node-local disks (the same path on every node, different disks): every node
        # prepares, commits and retains its own copy. Found out, not assumed.
        self.per_node = _directory_per_node(self.tier.storage)
        self.policy = policy
        self.retention = retention
        self.io = io
        self.events = EventLog(self.tier.storage, on_event)
        self.remote = CheckpointTier(remote.url, storage_options) if remote else None
        self.remote_retention = remote.retention if remote else None
        self.memory_every_n_steps = memory.every_n_steps if memory else None
        self.rollbacks: list[Rollback] = self._agreed_rollbacks()
        self.memory = (
            MemoryTier(
                memory.job or _memory_job(self.directory, self.tier.storage, self.per_node),
                redundancy=memory.redundancy,
                max_bytes=memory.max_bytes,
                pool_bytes=memory.pool_bytes,
            )
            if memory
            else None
        )
        self._saver = (
            AsyncSaver(
                pool_bytes=asynchronous.pool_bytes,
                threads=io.threads,
                max_shard_size=io.max_shard_size,
                if_busy=asynchronous.if_busy,
                storage_options=storage_options,
                per_node=self.per_node,
            )
            if asynchronous is not None
            else None
        )
        # Incremental saves refer to the unchanged chunks of the newest checkpoint this
        # process saved (incremental.py); the first save after a start writes all.
        self._chain = IncrementalChain() if incremental else None
        self._saving_to: Any = None  # the async save in flight
        # Steps the last restore passed over -> (the tiers holding them, why): no copy
        # could be used ("unusable"), or an explicit older step was restored ("superseded").
        self._passed_over: dict[int, tuple[set[str], str]] = {}
        self._last_save = time.monotonic()
        self.preemption_grace_seconds = preemption_grace_seconds
        self._signal: int | None = None
        self._signal_time: float | None = None  # when this rank learned of the signal
        self._disk_save_seconds: float | None = None  # the last disk save's, start to commit
        self._memory_step: int | None = None  # the newest step handed to the memory tier
        self._preempting = False  # the latest save decision's, agreed by every rank
        self._stop = False
        self._previous_handlers: dict[int, Any] = {}
        self._install_handlers(preemption_signals)
        for rollback in self.rollbacks:  # a node or tier the request did not reach
            self._apply_rollback(rollback)
        self._remove_leftovers()
        self._uploader: Uploader | None = None
        if self.remote is not None:
            # Every rank uploads its own files; rank 0 commits the remote copy.
            self._uploader = Uploader(
                self.tier,
                self.remote,
                self._upload_event,
                self._apply_remote_retention,
                io.threads,
                remote.compress,
            )
            self._uploader.notify()  # an upload a crash interrupted restarts now

    @property
    def _keeps_local(self) -> bool:
        """Whether this rank prepares, retains and cleans the local directory."""
        return dist.rank() == 0 or (self.per_node and dist.is_node_leader())

    # ---- where checkpoints live ---------------------------------------------------------

    def path_for(self, step: int) -> Any:
        return self.tier.path_for(step)

    def steps(self) -> list[int]:
        """Steps of committed checkpoints on this node's disk, oldest first (committed,
        not necessarily valid)."""
        return self.tier.steps()

    def remote_steps(self) -> list[int]:
        """Steps committed on the remote tier (empty without one)."""
        return self.remote.steps() if self.remote is not None else []

    def _remove_leftovers(self) -> None:
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
                self._cannot_delete(tier.root, exc)
                continue
            pruned = [s for s in leftovers if tier.commit_of(s).is_pruned()]
            try:  # files the committed checkpoints refer to stay
                references = tier.references(tier.steps()) if pruned else {}
            except CheckpointError as exc:  # the listing failed: clean up next time
                self._cannot_delete(tier.root, exc)
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
            self._cannot_delete(source.path_for(step), exc)
            return
        self.events.write(event, step=step, path=str(source.path_for(step)), **fields)

    def _cannot_delete(self, path: Any, exc: BaseException) -> None:
        where = path if path is not None else self.directory
        warnings.warn(f"{where}: left in place, cannot delete it ({exc})", stacklevel=3)
        self.events.write("delete_failed", path=str(where), error=str(exc))

    # ---- restore --------------------------------------------------------------------------

    def restore(self, state: Any, *, step: int | None = None) -> int | None:
        """Load the newest checkpoint every rank can read into ``state``; returns its
        step, or None. With ``step``, that one only (None if no copy of it is usable):
        the newer ones are then set aside at the first save, on every tier, so that the
        run saves those steps anew and retention counts the run from ``step`` on.

        A restore landing on the step of a rollback (``rollback``) skips the batches the
        rollback asked to skip, so a requeued job skips them again and a later
        checkpoint (which holds the advanced position) does not.

        Each rank reads every file from its node's copy when it has it, else from the
        remote tier, so a replaced node reads only what it lacks. A damaged or
        incomplete newest checkpoint is skipped with a warning and the next copy, then
        the previous step, is tried. ``StateMismatchError`` (the state does not fit)
        is raised: an older checkpoint would not fit either.

        With a remote tier an upload that a crash interrupted is finished first: on
        node-local disks a rank may need files only another node holds, which the
        remote then has.
        """
        if self._uploader is not None:
            self._uploader.flush()
        wanted = step
        failed: dict[int, set[str]] = {}  # step -> the tiers whose copy could not be used
        candidates = self._candidates()
        for step, load_it in candidates:
            if wanted is not None and step != wanted:
                continue
            if load_it(state):
                passed = {s: (tiers, "unusable") for s, tiers in failed.items() if s > step}
                if wanted is not None:
                    newer = {s for s, _ in candidates if s > wanted}
                    passed = {s: ({"local", "remote"}, "superseded") for s in newer}
                    if self.memory is not None:
                        self.memory.discard(lambda s, _: s > wanted)
                self._passed_over = passed
                self._skip_after_restore(state, step)
                return step
            tier = getattr(load_it, "keywords", {}).get("tier")  # None: the memory tier
            if tier is not None:
                failed.setdefault(step, set()).add(tier)
        self._passed_over = {s: (tiers, "unusable") for s, tiers in failed.items()}
        return None

    def _skip_after_restore(self, state: Any, step: int) -> None:
        """Skip the batches a rollback to ``step`` asked to skip (every rank alike)."""
        n = skip_for(self.rollbacks, step)
        if n:
            skip_data_batches(state, n, str(self.path_for(step)))
            self._log("rollback_skip", step=step, skipped_batches=n)

    # ---- rollback ---------------------------------------------------------------------------

    def rollback(self, to_step: int, *, skip_batches: int = 0, reason: str = "") -> Rollback:
        """Collective: go back to the checkpoint of ``to_step`` (a loss spike after it).

        Every newer checkpoint is set aside on every tier (``step-N.rolled-back-K``,
        every byte kept; on object stores copied there, then deleted), newer copies in
        the memory tier are dropped, and the request is recorded in the run's
        ``rollbacks.json`` (and the remote's): the next ``restore`` loads ``to_step`` and
        then skips ``skip_batches`` batches (a ``ResumableLoader``'s, also in a
        ``TrainState``). The same request made again (a requeued job script asking for
        it at every start) is the one recorded: nothing newer that the resumed run
        saved is touched. Returns the rollback in effect.
        """
        self.wait()  # a save in flight commits first: it is one the rollback passes over
        if self._uploader is not None:
            self._uploader.flush()
        new = dist.broadcast_json(
            vars(request(to_step, skip_batches, reason)) if dist.rank() == 0 else None
        )
        fresh = Rollback(**new)
        rollbacks, chosen = add_rollback(self.rollbacks, fresh)
        if chosen is not fresh:
            return chosen  # asked for before: applied then (and at every start since)
        self.rollbacks = rollbacks
        self._record_rollbacks()
        self._apply_rollback(chosen)
        self._log("rollback", to_step=to_step, skip_batches=skip_batches, reason=reason)
        return chosen

    def _agreed_rollbacks(self) -> list[Rollback]:
        """Collective: the run's rollbacks (rank 0 reads its directory's record and the
        remote's, and sends the union: the same list on every rank)."""
        found: Any = None
        if dist.rank() == 0:
            lists = [self._read_rollbacks(self.tier)]
            if self.remote is not None:
                lists.append(self._read_rollbacks(self.remote))
            found = [vars(r) for r in merged(*lists)]
        return [Rollback(**r) for r in dist.broadcast_json(found)]

    def _read_rollbacks(self, tier: CheckpointTier) -> list[Rollback]:
        try:
            return read_rollbacks(tier.storage)
        except CheckpointError as exc:  # a store down, or a damaged record
            warnings.warn(f"{tier.root}: rollbacks not read: {exc}", stacklevel=4)
            return []

    def _record_rollbacks(self) -> None:
        """Write the agreed rollbacks where they are read: every node's directory (by
        its keeper) and the remote (by rank 0)."""
        where = [self.tier] if self._keeps_local else []
        if dist.rank() == 0 and self.remote is not None:
            where.append(self.remote)
        for tier in where:
            try:
                write_rollbacks(tier.storage, self.rollbacks)
            except (OSError, CheckpointError) as exc:
                warnings.warn(
                    f"{tier.root}: cannot record the rollback ({exc}); a restart will not "
                    "know of it",
                    stacklevel=3,
                )

    def _apply_rollback(self, rollback: Rollback) -> None:
        """Set aside what ``rollback`` goes back past, on this rank's tiers (see
        ``training/rollback.py``). Idempotent; collective only through its barrier."""
        tiers = [("local", self.tier)] if self._keeps_local else []
        if dist.rank() == 0 and self.remote is not None:
            tiers.append(("remote", self.remote))
        for name, tier in tiers:
            try:
                steps = [s for s in tier.steps() if rollback.passes_over(s, tier.committed_at(s))]
            except CheckpointError as exc:  # a store down: applied at the next start
                self._cannot_delete(tier.root, exc)
                continue
            for step in steps:
                self._set_aside(name, tier, step, "rolled-back")
        if self.memory is not None:
            self.memory.discard(rollback.passes_over)
        dist.barrier()  # set aside on every node before any rank restores or saves

    def _candidates(self) -> list[tuple[int, Callable[[Any], bool]]]:
        """Every copy ``restore`` may load, in the order it tries them: (step, a
        collective load that says whether every rank loaded it). Newest step first; for
        one step the memory tier, then each node's disk (missing files from the remote),
        then the remote alone. Every rank builds the same list from agreed facts."""
        local = set(self.steps())
        remote = set(
            dist.broadcast_json(self._reachable_remote_steps() if dist.rank() == 0 else None)
        )
        every_rank = dist.gather_json(sorted(local))  # on rank 0, which sends the union
        on_disk = set(
            dist.broadcast_json(
                None if every_rank is None else sorted({s for ss in every_rank for s in ss})
            )
        )
        out: list[tuple[int, Callable[[Any], bool]]] = []
        if self.memory is not None:
            in_memory = self.memory.newest_step()  # collective: ranks agree on it
            if self.memory.lost is not None:
                lost = self.memory.lost
                self._log(
                    "fallback",
                    step=lost["step"],
                    tier="memory",
                    error=f"memory tier: the copies of ranks {lost['ranks']} of step "
                    f"{lost['step']} are on no surviving node and cannot be rebuilt (more "
                    "nodes lost than its redundancy covers); restoring from storage",
                )
            if in_memory is not None and in_memory >= max(on_disk | remote, default=-1):
                out.append((in_memory, partial(self._from_memory, step=in_memory)))
        for step in sorted(on_disk | remote, reverse=True):
            if step in on_disk:
                here, there = step in local, step in remote
                out.append(
                    (
                        step,
                        partial(
                            self._try_restore,
                            step=step,
                            tier="local",
                            use_local=here,
                            use_remote=there,
                        ),
                    )
                )
            if step in remote:
                out.append(
                    (
                        step,
                        partial(
                            self._try_restore,
                            step=step,
                            tier="remote",
                            use_local=False,
                            use_remote=True,
                        ),
                    )
                )
        return out

    def _from_memory(self, state: Any, *, step: int) -> bool:
        assert self.memory is not None
        start = time.perf_counter()
        try:
            self.memory.restore(state, step)
        except CorruptCheckpointError as exc:  # every rank gets it: the tier agrees
            warnings.warn(f"{exc}; restoring from storage instead", stacklevel=3)
            self._log("fallback", step=step, tier="memory", error=str(exc))
            return False
        self._log(
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
            return self.remote_steps()
        except CheckpointError as exc:
            warnings.warn(f"remote tier not reachable, restoring without it: {exc}", stacklevel=3)
            self._log("fallback", tier="remote", error=str(exc))
            return []

    def _try_restore(
        self, state: Any, *, step: int, tier: str, use_local: bool, use_remote: bool
    ) -> bool:
        """Collective: load ``step`` from this rank's copies; True if every rank did."""
        copies = [self.tier.open(step)] if use_local else []
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
                stacklevel=3,
            )
            self._log("fallback", step=step, path=path, error=first)
            return False
        from_remote = dist.gather_json(  # for rank 0's event log
            view.bytes_read_from(remote_copy) if view is not None and remote_copy else 0
        )
        if from_remote is not None:
            self._log(
                "restore",
                step=step,
                path=path,
                bytes_from_remote=sum(from_remote),
                bytes_from_remote_by_rank=from_remote,
                seconds=round(time.perf_counter() - start, 4),
            )
        return True

    def _log(self, event: str, **fields: Any) -> None:
        """A job-wide event: written to the log by rank 0, given to every rank's listeners."""
        if dist.rank() == 0:
            self.events.write(event, **fields)
        else:
            self.events.notify(event, **fields)

    def _upload_event(self, event: str, **fields: Any) -> None:
        """Uploads run in the background: a failure is logged and warned about (the local
        copies stand; the next commit retries), never raised into training."""
        if event == "upload_failed" and dist.rank() == 0:
            warnings.warn(
                f"upload of step {fields.get('step')} to the remote tier failed: "
                f"{fields.get('error')}; the local copies are intact, the next save retries",
                stacklevel=2,
            )
        self._log(event, **fields)

    # ---- save -----------------------------------------------------------------------------

    def should_save(self, step: int) -> bool:
        """Whether ``step`` is due; under torch.distributed every rank gets the same answer."""
        p = self.policy
        due_by_time = bool(
            p.every_n_seconds and time.monotonic() - self._last_save >= p.every_n_seconds
        )
        busy = self._saver is not None and self._saver.busy()
        # Read once: a signal that arrives from here on counts for the next decision, so
        # that every rank acts on the same answer (saves together, stops together).
        signal_seen = self._signal or 0
        if dist.is_distributed():
            # A signal may reach only some ranks, clocks drift and saves finish at
            # different times: agree in one reduction.
            signal_seen, due_by_time, busy = dist.max_of([signal_seen, int(due_by_time), int(busy)])
            if signal_seen and self._signal is None:
                self._learn_signal(signal_seen)
        self._preempting = bool(signal_seen)
        if signal_seen:
            return True
        if p.continuous and not busy:
            return True
        if p.every_n_steps and step % p.every_n_steps == 0:
            return True
        return bool(due_by_time)

    def maybe_save(self, step: int, state: Any, *, metrics: dict[str, float] | None = None) -> bool:
        """Save if the interval rules (or a preemption signal) say so; True if it saved.
        With the memory tier, also keep the state in memory every
        ``memory_every_n_steps`` steps."""
        to_memory = self.memory is not None and step % (self.memory_every_n_steps or 1) == 0
        due = self.should_save(step)
        if to_memory or due:
            self._refuse_nan(step, state)
        if to_memory:
            self._to_memory(step, state)
        return due and self._save_now(step, state, False, metrics) is not None

    def save_to_memory(self, step: int, state: Any) -> None:
        """Collective: keep ``state`` in this node's memory and on the buddies'. Returns
        once it is staged; the rest runs in the background (``MemoryTier.save``)."""
        assert self.memory is not None, "no memory tier: pass MemoryTierOptions"
        self._refuse_nan(step, state)
        self._to_memory(step, state)

    def _refuse_nan(self, step: int, state: Any) -> None:
        """Collective: raise ``NaNStateError`` on every rank if any rank's state holds NaN
        (``SavePolicy.refuse_nan``), before a byte of it is staged anywhere."""
        if not self.policy.refuse_nan:
            return
        try:
            found = first_nan(state)
        except Exception:  # a state_dict() that raises: the save reports it, on every rank
            found = None
        mine = None if found is None else f"{found!r} on rank {dist.rank()}"
        _, first = dist.worst_error(mine, 0)
        if first is None:
            return
        self._log("save_refused", step=step, reason="nan", tensor=first)
        raise NaNStateError(
            f"{self.directory}: step {step} not saved: NaN in {first} (the run diverged). "
            "The checkpoints before it are kept; go back to one with "
            "manager.rollback(STEP, skip_batches=N) or `shardpoint rollback "
            f"{self.directory} --to STEP --skip-batches N`, then restore"
        )

    def _to_memory(self, step: int, state: Any) -> None:
        assert self.memory is not None
        stall: list[float] = []

        def on_done(seconds: float, error: BaseException | None) -> None:
            if error is None:
                self._log(
                    "memory_save",
                    step=step,
                    seconds=round(seconds, 4),
                    blocked_seconds=round(stall[0] if stall else seconds, 4),
                )
            else:
                self._log("memory_save_failed", step=step, error=str(error))

        stall.append(self.memory.save(step, state, on_done=on_done))
        self._memory_step = step

    def save(
        self, step: int, state: Any, *, force: bool = False, metrics: dict[str, float] | None = None
    ) -> SaveInfo | AsyncSave | None:
        """Save ``state`` as the checkpoint of ``step`` if the interval rules (or a
        preemption signal) say so, or always with ``force``; then apply retention.

        Returns what was saved (an ``AsyncSave`` handle with ``async_save=True``), or None
        when nothing was: not due, ``step`` already committed (e.g. a preemption right
        after a periodic save), or skipped because a background save was busy.
        """
        if not force and not self.should_save(step):
            return None
        self._refuse_nan(step, state)
        return self._save_now(step, state, force, metrics)

    def _save_now(
        self, step: int, state: Any, force: bool, metrics: dict[str, float] | None
    ) -> SaveInfo | AsyncSave | None:
        """``save`` once it is due and the state was checked."""
        if self._passed_over:
            self._set_aside_passed_over()
        if force:
            self._preempting = self._agreed_preemption()
        path = self.path_for(step)
        preempting = self._preempting
        if preempting and self._final_save_to_memory(step, state):
            self._after_save()
            return None
        if self._saver is not None and (preempting or self._saving_to == path):
            try:
                self.wait()  # the final save must not race the one in flight
            except CheckpointError as exc:
                if not preempting:
                    raise
                # Its failure is logged (save_failed); the final save matters more now.
                warnings.warn(
                    f"the background save in flight failed ({exc}); saving the final "
                    "checkpoint now",
                    stacklevel=2,
                )
        committed = self.tier.committed(step)
        if self.per_node:  # nodes may differ (a replaced node): one answer for all
            committed = bool(dist.max_of([int(committed)])[0])
        if committed:
            self._after_save()
            return None
        metrics, finite = _plain_metrics(metrics)
        # Known good: the NaN check passed (when on) and no metric diverged; retention
        # keeps the newest ones whatever came after (RetentionPolicy.keep_last_good).
        metadata = {"step": step, "metrics": metrics, "good": finite}
        reason = "preemption" if preempting else "interval"
        outcome = (metrics, reason, finite)
        if self._saver is None or preempting:
            io = self.io
            options = SaveOptions(
                io.max_shard_size, io.threads, metadata, self.per_node, self._chain
            )
            info = run_save(state, open_storage(path, self.tier.options), options)
            assert isinstance(info, SaveInfo)
            self._committed(step, info, *outcome)
            self._after_save()
            return info

        def on_done(info: SaveInfo | None, error: BaseException | None) -> None:
            if info is not None:
                self._committed(step, info, *outcome)
            else:
                self._log("save_failed", step=step, path=str(path), error=str(error))

        handle = self._saver.save(
            state, path, metadata=metadata, on_done=on_done, chain=self._chain
        )
        if handle is not None:
            self._saving_to = path
            self._after_save()
        return handle

    def _committed(
        self, step: int, info: SaveInfo, metrics: dict[str, Any], reason: str, good: bool
    ) -> None:
        """Log a committed save, apply retention and start its upload (on the thread
        that committed it, on every rank)."""
        self._disk_save_seconds = info.seconds
        self._log(
            "save",
            step=step,
            path=str(info.path),
            bytes=info.bytes_written,
            files=info.files,
            seconds=round(info.seconds, 4),
            blocked_seconds=round(info.blocked_seconds or info.seconds, 4),
            gb_per_s=round(info.bytes_written / max(info.seconds, 1e-9) / 1e9, 3),
            metrics=dict(metrics or {}),
            reason=reason,
        )
        if self._keeps_local:
            try:
                self._apply_retention(step, good)
            except (OSError, CheckpointError) as exc:  # the save itself stands
                self._cannot_delete(None, exc)
        if self._uploader is not None:
            self._uploader.notify(step)

    def wait(self) -> None:
        """Block until the background save in flight (if any) is committed; raises its error."""
        if self._saver is not None:
            self._saving_to = None
            self._saver.wait()

    def _after_save(self) -> None:
        self._last_save = time.monotonic()
        if self._preempting:
            self._stop = True

    def _agreed_preemption(self) -> bool:
        """Whether any rank has seen a preemption signal (read once, agreed by all)."""
        seen = self._signal or 0
        if dist.is_distributed():
            (seen,) = dist.max_of([seen])
            if seen and self._signal is None:
                self._learn_signal(seen)
        return bool(seen)

    def _set_aside_passed_over(self) -> None:
        """Collective, at the first save after a restore that passed over newer steps
        (no copy of theirs could be used, or an explicit older step was restored): move
        their directories out of the way, every byte kept (``step-N.unusable-K``,
        ``step-N.superseded-K``). This run goes on from an older step and saves those
        steps anew; left in place they were taken for this run's saves (skipped as saved
        already), kept by retention as the newest, and tried first by every later
        restore. A failure to read them may have been passing (a store or disk that was
        down), so nothing is deleted: the user decides."""
        passed, self._passed_over = self._passed_over, {}
        tiers = [("local", self.tier, self._keeps_local)]
        if self.remote is not None:
            tiers.append(("remote", self.remote, dist.rank() == 0))
        for name, tier, mine in tiers:
            steps = [s for s, (tried, _) in passed.items() if name in tried and mine]
            try:
                here = set(tier.step_dirs()) if steps else set()  # a node may not hold them
            except CheckpointError as exc:  # a store down: left as is, the barrier still met
                self._cannot_delete(tier.root, exc)
                continue
            for step in sorted(s for s in steps if s in here):
                self._set_aside(name, tier, step, passed[step][1])
        dist.barrier()  # moved on every node before any rank saves one of those steps

    def _set_aside(self, name: str, tier: CheckpointTier, step: int, why: str) -> None:
        """Move one checkpoint aside (``CheckpointTier.set_aside``), warning and logging."""
        try:
            where = tier.set_aside(step, why)
        except (OSError, CheckpointError) as exc:
            self._cannot_delete(tier.path_for(step), exc)
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

    def _apply_retention(self, saved: int, saved_good: bool) -> None:
        """Apply the policy after the save of step ``saved``, which is always kept: a
        higher step (a damaged checkpoint, an earlier run's) is not newer than it."""
        candidates, unreadable = [], set()
        steps = self.steps()
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
        uploading = self._uploader.busy_step if self._uploader is not None else None
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

    def _apply_remote_retention(self, uploaded: int) -> None:
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

    def wait_for_uploads(self, timeout: float | None = None) -> bool:
        """Block until this rank's uploads are done (the remote tier then holds the
        newest checkpoint unless an upload failed); False on timeout."""
        return self._uploader.flush(timeout) if self._uploader is not None else True

    # ---- preemption ---------------------------------------------------------------------------

    def _install_handlers(self, signals: Iterable[int]) -> None:
        if threading.current_thread() is not threading.main_thread():
            warnings.warn(
                "CheckpointManager created outside the main thread: preemption signals are "
                "not handled",
                stacklevel=3,
            )
            return
        for sig in signals:
            self._previous_handlers[sig] = signal.signal(sig, self._on_signal)

    def _on_signal(self, signum: int, frame: Any) -> None:
        # Only set a flag here: saving inside a signal handler could interrupt a save.
        self._learn_signal(signum)

    def _learn_signal(self, signum: int) -> None:
        if self._signal is None:  # the grace runs from the first signal
            self._signal_time = time.monotonic()
        self._signal = signum

    def _final_save_to_memory(self, step: int, state: Any) -> bool:
        """Collective, for a preemption save: whether it went to the memory tier (and
        the buddies) because what is left of ``preemption_grace_seconds`` is shorter
        than a disk save needs: the last disk save's duration (twice that while one is
        still in flight), with a quarter more as a margin. Before any disk save was
        measured, or without a memory tier, the disk is used (warned about when the
        grace looks short)."""
        grace = self.preemption_grace_seconds
        if isinstance(grace, Mapping):
            grace = grace.get(self._signal or 0)
        if grace is None:
            return False
        since = time.monotonic() - (self._signal_time or time.monotonic())
        left = grace - since
        busy = self._saver is not None and self._saver.busy()
        needed = 1.25 * (self._disk_save_seconds or 0.0) * (2 if busy else 1)
        short = needed > left
        if dist.is_distributed():  # every rank saves to the same tier
            short = bool(dist.max_of([int(short)])[0])
        budget = {
            "grace_left_seconds": round(left, 3),
            "disk_save_seconds": None if self._disk_save_seconds is None else round(needed, 3),
        }
        if not short:
            return False
        if self.memory is None:
            warnings.warn(
                f"preemption: {left:.1f} s of the grace left, a disk save needs about "
                f"{needed:.1f} s and there is no memory tier: saving to disk anyway",
                stacklevel=4,
            )
            self._log("preemption_save", step=step, tier="disk", **budget)
            return False
        try:
            if self._memory_step != step:
                self._to_memory(step, state)
            self.memory.wait()  # this node's copy and the buddies' replicas complete
        except CheckpointError as exc:  # the disk is the last chance left
            warnings.warn(
                f"preemption: the memory tier save failed ({exc}); saving to disk",
                stacklevel=4,
            )
            return False
        warnings.warn(
            f"preemption: {left:.1f} s of the grace left, a disk save needs about "
            f"{needed:.1f} s: step {step} saved to the memory tier (and its buddies) only",
            stacklevel=4,
        )
        self._log("preemption_save", step=step, tier="memory", **budget)
        return True

    @property
    def preempted(self) -> bool:
        """A preemption signal arrived (the next ``maybe_save`` will save)."""
        return self._signal is not None

    @property
    def preempting(self) -> bool:
        """The latest save decision (``should_save``, ``save``) was made for a
        preemption signal, as every rank agreed; training should stop after this save.
        (``preempted`` is this rank's own flag, which a signal may set at any moment.)"""
        return self._preempting

    @property
    def should_stop(self) -> bool:
        """A preemption signal arrived and the final checkpoint is committed: exit now."""
        return self._stop

    @property
    def exit_code(self) -> int:
        """0, or 143 (128 + SIGTERM) after a preemption, whichever signal announced it
        (SIGUSR1 too): the status schedulers, torchrun and Kubernetes read as
        "terminated, requeue". The signal itself is in the event log (``preempted``)."""
        return 128 + int(signal.SIGTERM) if self._signal is not None else 0

    def close(self, *, release_memory: bool = False) -> None:
        """Finish the background save in flight (raising its error) and restore the
        signal handlers that were installed before this manager. ``release_memory``
        frees the memory tier (at the clean end of training; a job that will be
        restarted keeps it)."""
        if self.memory is not None:
            self.memory.close(release=release_memory)
        try:
            try:
                self.wait()
            finally:  # even after a failed save: the newest committed one is uploaded
                if self._uploader is not None:
                    self._uploader.close()
        finally:
            for sig, handler in self._previous_handlers.items():
                signal.signal(sig, handler)
            self._previous_handlers.clear()
            if self._signal is not None:
                self._log("preempted", signal=self._signal, saved=self._stop)

    def __enter__(self) -> CheckpointManager:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


# How a rank's restore attempt failed, gravest last (``dist.worst_error``).
_UNUSABLE, _FAILED, _MISMATCH = 0, 1, 2


def _plain_metrics(metrics: dict[str, Any] | None) -> tuple[dict[str, Any], bool]:
    """Metrics as JSON values, and whether every number among them was finite: a
    number, 0-d tensor or NumPy scalar as its float, NaN and infinity (a diverged loss)
    as None, which retention reads as unknown; anything else as given (a string stays
    one). Never raises: metrics may differ per rank, and a rank failing here alone would
    leave the others in the save's collectives (the save refuses, on every rank, what
    JSON cannot hold)."""
    out: dict[str, Any] = {}
    finite = True
    for name, value in (metrics or {}).items():
        if value is None or isinstance(value, (str, bool)):
            out[str(name)] = value
            continue
        try:
            number = float(value)
        except (TypeError, ValueError, RuntimeError):
            out[str(name)] = value
            continue
        out[str(name)] = number if math.isfinite(number) else None
        finite = finite and math.isfinite(number)
    return out, finite


def _directory_per_node(storage: CheckpointStorage) -> bool:
    """Collective: whether the manager's directory is a different one on each node.

    Each node's first rank leaves a probe file in it; if one of them cannot see every
    other node's probe, the directories are node-local. One node, an object store or a
    directory that cannot be written (a read-only mount) counts as shared.
    """
    if not dist.is_distributed():
        return False
    # Rank 0 learns which ranks lead a node and sends every rank their list and a
    # token: what a rank receives grows with the nodes, not the ranks.
    leads = dist.gather_json(dist.is_node_leader())
    token, leaders = dist.broadcast_json(
        None if leads is None else [uuid.uuid4().hex, [r for r, y in enumerate(leads) if y]]
    )
    probes = {f"probe-{token}-{r}" for r in leaders}
    mine = f"probe-{token}-{dist.rank()}"
    if len(probes) < 2 or is_url(storage.where):
        return False
    wrote = False
    if mine in probes:
        try:
            storage.write_small_durably(mine, b"")
            wrote = True
        except (OSError, CheckpointError):
            pass
    dist.barrier()  # every probe written before anyone looks
    blind = wrote and not probes <= set(storage.list())
    separate = bool(dist.max_of([int(blind)])[0])  # also: all have looked before any probe goes
    if wrote:
        storage.delete(mine)
    return separate


def _memory_job(directory: Any, storage: CheckpointStorage, per_node: bool) -> str:
    """The memory-tier namespace of the run in ``directory``, the same on every rank:
    from its absolute location and the run id kept in it (written at the first start).
    Another project's directory of the same relative name, or this one deleted to start
    over, has another id: memory copies of an earlier run are never restored into a new
    one. With node-local directories every node's first rank reads its own copy of the
    id and a node that lacks it (a replaced one) is given the others': which machine
    rank 0 lands on does not change the namespace."""
    import hashlib

    where = str(directory) if is_url(directory) else os.path.abspath(directory)
    keeper = dist.rank() == 0 or (per_node and dist.is_node_leader())
    found = _read_run_id(storage) if keeper else None
    every = dist.gather_json(found)  # once per manager: an id (32 characters) per rank
    chosen = None
    if every is not None:  # rank 0: its own id, else any node's, else a new one
        chosen = next((i for i in every if i), None) or uuid.uuid4().hex
    chosen = dist.broadcast_json(chosen)
    if keeper and found != chosen:
        _write_run_id(storage, chosen)
    return "job-" + hashlib.sha256(f"{where}\n{chosen}".encode()).hexdigest()[:16]


def _read_run_id(storage: CheckpointStorage) -> str | None:
    try:
        raw = storage.read_small(RUN_ID_NAME, 1024)
    except (OSError, CheckpointError):
        return None  # written (or warned about) by the caller
    return None if raw is None else raw.decode(errors="replace")


def _write_run_id(storage: CheckpointStorage, run_id: str) -> None:
    """Best effort (a read-only mount): with a warning, the memory tier then cannot
    tell this run from a later one in the same directory."""
    try:
        storage.write_small_durably(RUN_ID_NAME, run_id.encode())
    except (OSError, CheckpointError) as exc:
        warnings.warn(
            f"{storage.location(RUN_ID_NAME)}: cannot write the run id ({exc}); the memory "
            "tier cannot tell this run from a later one in the same directory",
            stacklevel=4,
        )
