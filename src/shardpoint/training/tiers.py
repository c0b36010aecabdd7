"""Checkpoint tiers: the ``step-NNNNNNNNN`` checkpoints under one directory or URL, and
the uploads from the fast local tier to the remote one.

Every rank uploads only its own files, in parallel with every other rank; rank 0
commits the remote copy (index, then marker) once every rank's files are durable
there. An interrupted upload is an uncommitted prefix that no reader takes for a
checkpoint (and the next upload of that step clears).
"""

from __future__ import annotations

import itertools
import os
import threading
import time
from collections.abc import Callable, Collection, Iterable
from pathlib import Path
from typing import Any

from .. import dist
from ..checkpoint_copy import copy_checkpoint
from ..checkpoint_dir import MAX_INDEX_BYTES
from ..commit import Commit
from ..errors import CheckpointError, CorruptCheckpointError
from ..format.index import Index, split_reference
from ..format.parse import parse_index
from ..names import (
    INDEX_NAME,
    PRUNED_NAME,
    is_own_file,
    parse_step_dir,
    set_aside_dir,
    step_dir,
    writer_rank,
)
from ..references import References
from ..storage import CheckpointStorage, is_url, join, open_storage
from ..storage.direct_io import fsync_directory
from ..storage.transfer import copy_files


class CheckpointTier:
    """The checkpoints of one manager under one directory (local path or URL)."""

    def __init__(
        self, root: str | os.PathLike[str], storage_options: dict[str, Any] | None
    ) -> None:
        self.root = root
        self.options = storage_options
        self.storage = open_storage(root, storage_options)
        self._references = References(root, storage_options)
        try:
            missing = not self.storage.exists()  # an existing one may be a read-only mount
        except CheckpointError:  # unreachable now (a store down): training goes on
            missing = False
        if missing:
            self.storage.prepare()

    def path_for(self, step: int) -> Any:
        return join(self.root, step_dir(step))

    def open(self, step: int) -> CheckpointStorage:
        return open_storage(self.path_for(step), self.options)

    def commit_of(self, step: int) -> Commit:
        return Commit(self.open(step))

    def step_dirs(self) -> list[int]:
        steps = (parse_step_dir(name) for name in self.storage.subdirectories())
        return sorted(s for s in steps if s is not None)

    def committed(self, step: int) -> bool:
        return self.commit_of(step).is_committed()

    def steps(self) -> list[int]:
        """Steps of committed checkpoints, oldest first."""
        return [s for s in self.step_dirs() if self.committed(s)]

    def linked(self, step: int) -> bool:
        """Whether the step's directory is a symbolic link (an earlier run's checkpoint
        linked in): read through, never deleted through."""
        return os.path.islink(self.path_for(step))

    def set_aside(self, step: int, why: str = "unusable") -> str | None:
        """Move the step's checkpoint out of the way (``names.set_aside_dir``), keeping
        every byte of it; returns where it went, or None where that is not possible: a
        link (an earlier run's, left alone), or an object store for an ``unusable`` one
        (no rename there; a copy of a damaged checkpoint would fail). On an object store
        a committed checkpoint set aside for another reason is copied under the new name
        (committed there) and then deleted."""
        if self.linked(step):
            return None
        if is_url(self.root):
            if why == "unusable":
                return None
            taken = set(self.storage.subdirectories())
            n = next(n for n in itertools.count(1) if set_aside_dir(step, n, why) not in taken)
            target = join(self.root, set_aside_dir(step, n, why))
            copy_checkpoint(self.path_for(step), target, storage_options=self.options)
            self.delete(step)  # marker first: never two committed copies named as the step
            return str(target)
        parent = Path(self.root)
        n = next(
            n for n in itertools.count(1) if not (parent / set_aside_dir(step, n, why)).exists()
        )
        target = parent / set_aside_dir(step, n, why)
        os.rename(self.path_for(step), target)  # atomic: seen whole under one name only
        fsync_directory(parent)
        return str(target)

    def committed_at(self, step: int) -> float | None:
        return self.commit_of(step).committed_at()

    def delete(self, step: int, keep: Collection[str] = ()) -> None:
        """Delete a checkpoint, except its files in ``keep`` (see ``references``)."""
        self.commit_of(step).delete(keep)

    def leftovers(self) -> list[int]:
        """Step directories without a marker that hold only checkpoint files (a crashed
        save, or a deleted checkpoint whose files others refer to); links excluded."""
        return [
            s for s in self.step_dirs() if not self.linked(s) and self.commit_of(s).is_leftover()
        ]

    def pruned(self, committed: Collection[int]) -> list[int]:
        """Deleted checkpoints whose files other checkpoints referred to, among the
        step directories that are not in ``committed`` (known, so not looked at again)."""
        known = set(committed)
        return [
            s
            for s in self.step_dirs()
            if s not in known and not self.linked(s) and self.commit_of(s).is_pruned()
        ]

    def references(self, steps: Iterable[int]) -> dict[int, set[str]] | None:
        """Step -> its files that the committed checkpoints of ``steps`` refer to; None
        if one of them cannot be read (then nothing may be deleted on a guess)."""
        by_dir = self._references.files([step_dir(s) for s in steps])
        if by_dir is None:
            return None
        return {s: files for d, files in by_dir.items() if (s := parse_step_dir(d)) is not None}

    def kept_files(self, step: int, references: dict[int, set[str]] | None) -> set[str]:
        """What deleting ``step`` must keep: what ``references`` says others read, or,
        when they could not be read, every shard file of it."""
        if references is not None:
            return references.get(step, set())
        return {n for n in self.open(step).list() if n.endswith(".safetensors")}

    def unreferenced(self, step: int, keep: Collection[str]) -> bool:
        """Whether an uncommitted step directory holds anything beyond the files in
        ``keep`` (which others refer to) and their note: then a clean-up has work."""
        return not keep or set(self.open(step).list()) != {*keep, PRUNED_NAME}


class Uploader:
    """Copies committed local checkpoints to the remote tier on a background thread.

    Collective: every rank runs one, and each ``notify`` (a commit, which every rank
    sees) is one upload round on every rank, on a process group of its own. A round
    uploads the newest committed step any rank has been told of, so a superseded one
    is skipped. ``on_event(name, **fields)`` reports uploads (rank 0) and failures;
    ``flush()`` waits until this rank's rounds are done.
    """

    def __init__(
        self,
        local: CheckpointTier,
        remote: CheckpointTier,
        on_event: Callable[..., None],
        after_upload: Callable[[int], None],
        threads: int,
        compress: bool = False,
    ) -> None:
        self.local, self.remote = local, remote
        self.compress = compress
        self.on_event = on_event
        self.after_upload = after_upload
        self.threads = threads
        self.group = dist.new_cpu_group()  # collective: every rank builds its uploader
        self.rank = dist.rank()
        self.busy_step: int | None = None  # retention keeps the step being uploaded
        self._rounds = 0
        self._newest: int | None = None
        self._stop = False
        self._cond = threading.Condition()
        self._committed_at: dict[int, float] = {}
        self._thread = threading.Thread(target=self._run, name="shardpoint-upload", daemon=True)
        self._thread.start()

    def notify(self, step: int | None = None) -> None:
        """A local checkpoint was committed on every rank (or the job just started)."""
        with self._cond:
            if step is not None:
                self._committed_at[step] = time.time()
                self._newest = max(step, self._newest if self._newest is not None else step)
            self._rounds += 1
            self._cond.notify_all()

    def flush(self, timeout: float | None = None) -> bool:
        """Wait until this rank's upload rounds are done; False on timeout."""
        with self._cond:
            return self._cond.wait_for(lambda: self._rounds == 0, timeout)

    def close(self) -> None:
        self.flush()
        with self._cond:
            self._stop = True
            self._cond.notify_all()
        self._thread.join()

    def _run(self) -> None:
        while True:
            with self._cond:
                self._cond.wait_for(lambda: self._rounds > 0 or self._stop)
                if self._rounds == 0:
                    return
                newest = self._newest
            try:
                self._round(newest)
            except Exception as exc:  # a round never kills the thread; the next one retries
                self.on_event("upload_failed", error=f"{type(exc).__name__}: {exc}")
            with self._cond:
                self._rounds -= 1
                self._cond.notify_all()

    def _round(self, newest: int | None) -> None:
        """One upload round; every rank runs the same collectives whatever fails."""
        if newest is None:  # started, not yet told of a step: offer the newest local one
            steps = _try(self.local.steps)
            newest = steps[-1] if isinstance(steps, list) and steps else None
        # The newest step any rank offers: one all-reduce of one integer, whatever the ranks.
        step = dist.max_of([-1 if newest is None else newest], self.group)[0]
        if step < 0:
            return
        self.busy_step = step
        try:
            self._upload(step)
        finally:
            self.busy_step = None

    def _upload(self, step: int) -> None:
        start = time.perf_counter()
        prepared: Any = None  # rank 0: (index bytes, index) of its local copy, or why not
        if self.rank == 0:
            prepared = _try(lambda: self._prepare_remote(step))
        # The files the remote copy needs, with the sizes the index gives them.
        go = dict(prepared[1].files) if isinstance(prepared, tuple) else prepared
        go = dist.broadcast_json(go, 0, self.group)
        if not isinstance(go, dict):  # committed already, or the remote cannot be reached
            if self.rank == 0 and go != "committed":
                self.on_event("upload_failed", step=step, error=go)
            return
        mine = _try(lambda: self._upload_own_files(step, go))
        reports = dist.gather_json(mine, 0, self.group)
        if reports is None:
            return
        errors = [f"rank {r}: {e}" for r, e in enumerate(reports) if not isinstance(e, int)]
        error = errors[0] if errors else _try(lambda: self._commit_remote(step, *prepared))
        path = str(self.remote.path_for(step))
        if error is not None:
            self.on_event("upload_failed", step=step, path=path, error=error)
            return
        seconds = time.perf_counter() - start
        nbytes = sum(reports)
        lag = time.time() - self._committed_at.get(step, time.time() - seconds)
        self.on_event(
            "upload",
            step=step,
            path=path,
            bytes=nbytes,
            ranks=len(reports),
            seconds=round(seconds, 4),
            lag_seconds=round(lag, 4),
            gb_per_s=round(nbytes / max(seconds, 1e-9) / 1e9, 3),
        )
        self.after_upload(step)

    def _prepare_remote(self, step: int) -> str | tuple[bytes, Index]:
        """Rank 0: its local copy's index (which names the files the remote copy needs),
        read once for the whole upload, after removing what an interrupted upload left;
        or "committed"."""
        target = self.remote.commit_of(step)
        if target.is_committed():
            return "committed"
        if target.is_pruned():  # its files are read by newer remote checkpoints
            raise CheckpointError(
                f"{target.storage.where}: a deleted remote checkpoint whose files newer "
                "remote checkpoints still read; this step is not uploaded again"
            )
        target.abort([n for n in target.storage.list() if is_own_file(n)], remove_directory=False)
        source = self.local.open(step)
        raw = source.read_small(INDEX_NAME, MAX_INDEX_BYTES)
        if raw is None or not Commit(source).is_committed():
            raise FileNotFoundError(f"{source.where}: not committed in the local tier")
        return raw, parse_index(raw, source.location(INDEX_NAME))

    def _upload_own_files(self, step: int, wanted: dict[str, int]) -> int:
        """This rank's files of ``step`` that the remote copy needs (name -> size), from
        its local copy (a node's own copies of replicated state stay local); returns the
        bytes. A local file of another size is damaged: the upload fails, and the
        remote keeps what it has."""
        source = self.local.open(step)
        if not Commit(source).is_committed():
            raise FileNotFoundError(f"{source.where}: not committed in the local tier")
        names = [n for n in source.list() if writer_rank(n) == self.rank and n in wanted]
        for name in names:
            if source.size(name) != wanted[name]:
                raise CorruptCheckpointError(
                    f"{source.location(name)}: {source.size(name)} bytes, the index says "
                    f"{wanted[name]}; the local copy is damaged and is not uploaded"
                )
        target = self.remote.open(step)
        target.prepare(durable=self.rank == 0)  # a shared file system's (no-op on stores)
        refs = [n for n in wanted if split_reference(n) and writer_rank(n) == self.rank]
        missing = self._referenced_missing(step, refs, source, target)
        return copy_files(source, target, names + missing, self.threads, compress=self.compress)

    def _referenced_missing(
        self, step: int, refs: list[str], source: CheckpointStorage, target: CheckpointStorage
    ) -> list[str]:
        """Of the files of earlier checkpoints ``step`` refers to, those the remote
        lacks. A remote sibling must hold the same checkpoint as the local one (its
        marker's or ``PRUNED`` note's ``checkpoint``), or none yet: then it is marked
        pruned for that checkpoint before its files arrive. Another checkpoint of the
        same step there (a run that went back and saved it again) is never written
        into: the upload fails, saying so."""
        missing = []
        for sibling in sorted({split_reference(n)[0] for n in refs}):  # type: ignore[index]
            files = [n for n in refs if split_reference(n)[0] == sibling]  # type: ignore[index]
            local = Commit(open_storage(join(self.local.root, sibling), self.local.options))
            remote = Commit(open_storage(join(self.remote.root, sibling), self.remote.options))
            ours, theirs = local.identity(), remote.identity()
            if not remote.is_committed() and not remote.is_pruned():
                # Nothing there, or what an interrupted upload left (nothing refers to
                # files of a directory without a marker or a note): ours from now on.
                remote.mark_pruned(ours, [])
                missing += files
            elif ours is not None and theirs == ours:
                missing += [n for n in files if target.size(n) != source.size(n)]
            else:
                raise CheckpointError(
                    f"{remote.storage.where}: holds another checkpoint than the local "
                    f"{sibling} that step {step} refers to; uploading it would mix two "
                    "runs. Delete that remote step (or use a new remote directory)."
                )
        return missing

    def _commit_remote(self, step: int, raw: bytes, index: Index) -> None:
        """Rank 0: every rank's files are durable remotely; the index, then the marker."""
        target = self.remote.open(step)
        listed = set(target.list())
        missing = {n for n in index.files if n not in listed and target.size(n) is None}
        if missing:  # a rank of another world size wrote them: nobody here uploads them
            raise FileNotFoundError(f"not uploaded by any rank: {sorted(missing)[:3]}")
        self.remote.commit_of(step).finish(raw)


def _try(fn: Callable[[], Any]) -> Any:
    """``fn()``, or its error as text: a rank that fails still joins the collectives."""
    try:
        return fn()
    except Exception as exc:
        return f"{type(exc).__name__}: {exc}"
