"""``CheckpointManager``: when to save, and the tiers, restore and clean-up it drives.

The manager decides *when* and *what to keep*; ``shardpoint.save``/``load`` below it
know *how*. Layout: ``DIR/step-000001000/`` per checkpoint, ``DIR/events.jsonl`` for
the event log. The save decision and the save path are here; the rest is in one module
each, which the manager composes: ``events`` (the event log), ``restore`` (which copy
to restore), ``housekeeping`` (retention, set-aside checkpoints, leftovers),
``node_layout`` (shared or node-local directory, run id), ``preemption`` (signals and
their grace), ``rollback`` (rollback records), ``tiers`` (uploads), ``memory_tier``.
"""

from __future__ import annotations

import math
import os
import signal
import time
import warnings
from collections.abc import Callable, Iterable, Mapping
from typing import Any

from .. import dist
from ..background_save import AsyncSave, AsyncSaver
from ..errors import CheckpointError, NaNStateError
from ..incremental import IncrementalChain
from ..nan_check import first_nan
from ..save_records import SaveInfo, SaveOptions
from ..saving import run_save
from ..storage import is_url, open_storage
from .events import EventLog
from .housekeeping import Housekeeping
from .memory_tier import MemoryTier
from .node_layout import directory_per_node, keeps_local, memory_job
from .options import (
    AsyncOptions,
    IOOptions,
    MemoryTierOptions,
    RemoteTier,
    SavePolicy,
    moved_options_message,
)
from .preemption import Preemption, check_grace
from .restore import PassedOver, Restorer
from .retention import RetentionPolicy
from .rollback import Rollback, add_rollback, agreed_rollbacks, record_rollbacks, request, skip_for
from .rollback import skip_batches as skip_data_batches
from .tiers import CheckpointTier, Uploader


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
            raise TypeError(moved_options_message(moved))
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
        check_grace(preemption_grace_seconds)
        if policy.continuous and asynchronous is None:
            raise ValueError("SavePolicy(continuous=True) needs async_save")
        storage_options = io.storage_options or None
        self.tier = CheckpointTier(directory, storage_options)
        self.directory = self.tier.storage.root  # a Path, or the URL
        # Node-local disks (the same path on every node, different disks): every node
        # prepares, commits and retains its own copy. Found out, not assumed.
        self.per_node = directory_per_node(self.tier.storage)
        self.policy = policy
        self.retention = retention
        self.io = io
        self.events = EventLog(self.tier.storage, on_event)
        self.remote = CheckpointTier(remote.url, storage_options) if remote else None
        self.remote_retention = remote.retention if remote else None
        self.memory_every_n_steps = memory.every_n_steps if memory else None
        self.rollbacks: list[Rollback] = agreed_rollbacks(self.tier, self.remote)
        self.memory = (
            MemoryTier(
                memory.job or memory_job(self.directory, self.tier.storage, self.per_node),
                redundancy=memory.redundancy,
                max_bytes=memory.max_bytes,
                pool_bytes=memory.pool_bytes,
            )
            if memory
            else None
        )
        self.housekeeping = Housekeeping(
            self.tier,
            self.remote,
            self.memory,
            self.events,
            per_node=self.per_node,
            retention=retention,
            remote_retention=self.remote_retention,
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
        # A restore's undo copy borrows the saver's staging pool: memory the first
        # background save would fault in anyway, handed back warm when the load is over.
        self.restorer = Restorer(
            self.tier,
            self.remote,
            self.memory,
            io,
            self.events,
            undo_pool=self._saver.pool if self._saver is not None else None,
        )
        # Incremental saves refer to the unchanged chunks of the newest checkpoint this
        # process saved (incremental.py); the first save after a start writes all.
        self._chain = IncrementalChain() if incremental else None
        self._saving_to: Any = None  # the async save in flight
        self._passed_over: PassedOver = {}  # by the last restore, set aside at the next save
        self._last_save = time.monotonic()
        self._disk_save_seconds: float | None = None  # the last disk save's, start to commit
        self._memory_step: int | None = None  # the newest step handed to the memory tier
        self._preempting = False  # the latest save decision's, agreed by every rank
        self._stop = False
        self.preemption = Preemption(preemption_signals, preemption_grace_seconds)
        for rollback in self.rollbacks:  # a node or tier the request did not reach
            self.housekeeping.apply_rollback(rollback)
        self.housekeeping.remove_leftovers()
        self._uploader: Uploader | None = None
        if self.remote is not None:
            # Every rank uploads its own files; rank 0 commits the remote copy.
            self._uploader = Uploader(
                self.tier,
                self.remote,
                self._upload_event,
                self.housekeeping.apply_remote_retention,
                io.threads,
                remote.compress,
            )
            self._uploader.notify()  # an upload a crash interrupted restarts now

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
        restored, self._passed_over = self.restorer.restore(state, step)
        if restored is not None:
            self._skip_after_restore(state, restored)
        return restored

    def _skip_after_restore(self, state: Any, step: int) -> None:
        """Skip the batches a rollback to ``step`` asked to skip (every rank alike)."""
        n = skip_for(self.rollbacks, step)
        if n:
            skip_data_batches(state, n, str(self.path_for(step)))
            self.events.log("rollback_skip", step=step, skipped_batches=n)

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
        record_rollbacks(self.rollbacks, self.tier, self.remote, keeps_local(self.per_node))
        self.housekeeping.apply_rollback(chosen)
        self.events.log("rollback", to_step=to_step, skip_batches=skip_batches, reason=reason)
        return chosen

    def _upload_event(self, event: str, **fields: Any) -> None:
        """Uploads run in the background: a failure is logged and warned about (the local
        copies stand; the next commit retries), never raised into training."""
        if event == "upload_failed" and dist.rank() == 0:
            warnings.warn(
                f"upload of step {fields.get('step')} to the remote tier failed: "
                f"{fields.get('error')}; the local copies are intact, the next save retries",
                stacklevel=2,
            )
        self.events.log(event, **fields)

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
        signal_seen = self.preemption.signal or 0
        if dist.is_distributed():
            # A signal may reach only some ranks, clocks drift and saves finish at
            # different times: agree in one reduction.
            signal_seen, due_by_time, busy = dist.max_of([signal_seen, int(due_by_time), int(busy)])
            if signal_seen and self.preemption.signal is None:
                self.preemption.learn(signal_seen)
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
        self.events.log("save_refused", step=step, reason="nan", tensor=first)
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
                self.events.log(
                    "memory_save",
                    step=step,
                    seconds=round(seconds, 4),
                    blocked_seconds=round(stall[0] if stall else seconds, 4),
                )
            else:
                self.events.log("memory_save_failed", step=step, error=str(error))

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
            passed, self._passed_over = self._passed_over, {}
            self.housekeeping.set_aside_passed_over(passed)
        if force:
            self._preempting = self.preemption.agreed()
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
                self.events.log("save_failed", step=step, path=str(path), error=str(error))

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
        self.events.log(
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
        if keeps_local(self.per_node):
            try:
                self.housekeeping.apply_retention(step, good, self._uploader)
            except (OSError, CheckpointError) as exc:  # the save itself stands
                self.housekeeping.cannot_delete(None, exc)
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

    def wait_for_uploads(self, timeout: float | None = None) -> bool:
        """Block until this rank's uploads are done (the remote tier then holds the
        newest checkpoint unless an upload failed); False on timeout."""
        return self._uploader.flush(timeout) if self._uploader is not None else True

    # ---- preemption ---------------------------------------------------------------------------

    def _final_save_to_memory(self, step: int, state: Any) -> bool:
        """Collective, for a preemption save: whether it went to the memory tier (and
        the buddies) because what is left of ``preemption_grace_seconds`` is shorter
        than a disk save needs: the last disk save's duration (twice that while one is
        still in flight), with a quarter more as a margin. Before any disk save was
        measured, or without a memory tier, the disk is used (warned about when the
        grace looks short)."""
        left = self.preemption.grace_left()
        if left is None:
            return False
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
            self.events.log("preemption_save", step=step, tier="disk", **budget)
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
        self.events.log("preemption_save", step=step, tier="memory", **budget)
        return True

    @property
    def preempted(self) -> bool:
        """A preemption signal arrived (the next ``maybe_save`` will save)."""
        return self.preemption.signal is not None

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
        return 128 + int(signal.SIGTERM) if self.preemption.signal is not None else 0

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
            self.preemption.close()
            if self.preemption.signal is not None:
                self.events.log("preempted", signal=self.preemption.signal, saved=self._stop)

    def __enter__(self) -> CheckpointManager:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


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
