"""The commit protocol of one checkpoint directory, on any storage backend.

A checkpoint is visible only once its marker exists, and the marker is written only
after everything it covers is durable: shard files, then ``index.json``, then
``COMMITTED``. Every path that writes, checks, uploads, retains or deletes a checkpoint
goes through ``Commit``; nothing else writes or looks for a marker.

The backend supplies what differs: on a local file system ``write_small_durably`` is
write + fsync + rename and ``sync`` fsyncs the directory, and a ``flock`` keeps a
second writer out; on an object store each small file is one PUT (visible whole or not
at all), ``sync`` has nothing to do and there is no lock.
"""

from __future__ import annotations

import json
from collections.abc import Collection, Iterable

from .checkpoint_dir import MAX_MARKER_BYTES
from .errors import CheckpointError, CheckpointExistsError, CorruptCheckpointError
from .format.marker import checkpoint_id, marker_json
from .names import INDEX_NAME, MARKER_NAME, PRUNED_NAME, is_own_file
from .storage import CheckpointStorage, WriterLock


class Commit:
    """begin / finish / is_committed / abort / delete of one checkpoint directory."""

    def __init__(self, storage: CheckpointStorage) -> None:
        self.storage = storage
        self._lock: WriterLock | None = None

    def is_committed(self) -> bool:
        """Whether the marker exists. One that exists but cannot even be looked at (a
        symlink loop) counts: readers then report it, and restore falls back."""
        try:
            return self.storage.size(MARKER_NAME) is not None
        except CorruptCheckpointError:
            return True

    def committed_at(self) -> float | None:
        """When the marker was written (the storage's clock), None without one."""
        return self.storage.modified(MARKER_NAME)

    def _marker_present(self) -> bool:
        """Like ``is_committed``, but a marker that cannot be looked at (an unreachable
        store, a symlink loop) is an error: a save must not guess."""
        try:
            return self.storage.size(MARKER_NAME) is not None
        except CorruptCheckpointError as exc:
            raise CheckpointError(
                f"{self.storage.where}: cannot tell whether a checkpoint is already here "
                f"({exc}); nothing was written"
            ) from exc

    def is_leftover(self) -> bool:
        """Never committed, and holding only files a save writes (a crashed save)."""
        return not self.is_committed() and not self.foreign_files()

    def foreign_files(self) -> list[str]:
        return [name for name in self.storage.list() if not is_own_file(name)]

    def begin(self) -> None:
        """Create and lock the directory, refusing a committed checkpoint
        (``CheckpointExistsError``), a directory holding anything that is not a
        checkpoint file, or one another process is saving to (``ConcurrentWriterError``).
        The lock is held until ``release``. What a crashed save left there stays until
        ``clear``: other ranks may be writing this save's files already.
        """
        where = self.storage.where
        try:
            if self._marker_present():  # checked before creating anything
                raise _exists(where)
            self._prepare_and_lock()
            if self._marker_present():  # committed by another process since the first look
                raise _exists(where)
            names = self.storage.list()
            foreign = [n for n in names if not is_own_file(n)]
            if foreign:
                raise CheckpointError(
                    f"{where}: holds files that are not from an unfinished shardpoint save "
                    f"({foreign[:3]}); save to an empty or new directory"
                )
            if PRUNED_NAME in names:
                raise CheckpointError(
                    f"{where}: a deleted checkpoint whose files later (incremental) "
                    "checkpoints still read; save to another directory, or delete those "
                    "checkpoints first"
                )
        except BaseException as exc:
            self.release()
            if isinstance(exc, CheckpointError) or not isinstance(exc, Exception):
                raise
            # OSError locally; the object store's errors too. Nothing of ours is there yet.
            self.abort([], remove_directory=True)
            raise CheckpointError(
                f"{where}: cannot prepare the checkpoint directory ({exc}); nothing was "
                "written and earlier checkpoints are untouched. Check free space and "
                "permissions (or, for an object store, that it is reachable)."
            ) from exc

    def clear(self, keep: Collection[str] = ()) -> None:
        """Delete what a crashed or failed save left in the (locked) directory: every
        checkpoint file but those in ``keep``, this save's."""
        for name in self.storage.list():
            if is_own_file(name) and name not in keep:
                self.storage.delete(name)

    def _prepare_and_lock(self, attempts: int = 3) -> None:
        """Create the directory and take its lock. Another process clearing an empty
        leftover may remove the directory between the two: create it again."""
        for attempt in range(attempts):
            self.storage.prepare()
            lock = self.storage.lock()
            try:
                lock.acquire()
            except FileNotFoundError:
                if attempt == attempts - 1:
                    raise
                continue
            self._lock = lock
            return

    def finish(self, index: bytes, checkpoint: str | None = None) -> None:
        """Make the checkpoint visible: the index durable first, then the marker
        (``checkpoint``: see ``marker_json``)."""
        self.storage.write_small_durably(INDEX_NAME, index)
        self.storage.sync()
        self.storage.write_small_durably(MARKER_NAME, marker_json(index, checkpoint))
        self.storage.sync()

    def identity(self) -> str | None:
        """Which checkpoint this directory holds, or held before it was pruned (its
        marker's or its ``PRUNED`` note's ``checkpoint``); None if neither says."""
        for note in (MARKER_NAME, PRUNED_NAME):
            raw = self.storage.read_small(note, MAX_MARKER_BYTES)
            if raw is not None:
                return checkpoint_id(raw)
        return None

    def mark_pruned(self, checkpoint: str | None, kept: list[str]) -> None:
        """Write the ``PRUNED`` note (durably): this directory keeps files of checkpoint
        ``checkpoint`` that other checkpoints refer to; no save may clear them."""
        note = {"checkpoint": checkpoint, "kept": sorted(kept)}
        self.storage.write_small_durably(PRUNED_NAME, json.dumps(note).encode())
        self.storage.sync()

    def release(self) -> None:
        if self._lock is not None:
            self._lock.release()
            self._lock = None

    def abort(self, names: Iterable[str], *, remove_directory: bool) -> None:
        """Remove what this writer wrote for a failed save: it leaves no trace to mistake.

        An empty directory left behind (another rank still cleaning up) has no marker,
        is not a checkpoint, and is cleared by the next save or manager start.
        """
        for name in names:  # the files this writer made; a ".tmp" is its writer's to remove
            try:
                self.storage.delete(name)
            except Exception:  # best effort: the save already failed, say why it did
                pass
        if remove_directory:
            self.storage.remove_if_empty()

    def delete(self, keep: Collection[str] = ()) -> None:
        """Remove the checkpoint, marker first, under the writer lock, except the files
        in ``keep`` (other checkpoints refer to them: ``references.py``).

        Once the marker is gone no reader takes the directory for a checkpoint, so a
        crash halfway leaves an uncommitted leftover, never a damaged "valid" one. Kept
        files get a ``PRUNED`` note, durable before the marker goes, so that no save
        ever clears them as a crashed save's leftovers; the note goes last, once nothing
        is kept. Files that are not shardpoint's are left alone (and keep the
        directory). A directory another process is saving to raises
        ``ConcurrentWriterError``.
        """
        if not self.storage.exists():
            return
        lock = self.storage.lock()
        try:
            lock.acquire()
        except FileNotFoundError:  # removed by another process meanwhile: nothing to do
            return
        try:
            names = self.storage.list()
            kept = [n for n in names if n in keep]
            if kept and PRUNED_NAME not in names:
                self.mark_pruned(self.identity(), kept)
            if self.is_committed():
                self.storage.delete(MARKER_NAME)
                self.storage.sync()
            notes = (MARKER_NAME, PRUNED_NAME)
            for name in names:
                if is_own_file(name) and name not in keep and name not in notes:
                    self.storage.delete(name)
            if not kept and PRUNED_NAME in names:
                self.storage.sync()
                self.storage.delete(PRUNED_NAME)
            self.storage.remove_if_empty()
        finally:
            lock.release()

    def is_pruned(self) -> bool:
        """Deleted, with files that other checkpoints refer to kept (see ``delete``)."""
        return not self.is_committed() and self.storage.size(PRUNED_NAME) is not None


def _exists(where: str) -> CheckpointExistsError:
    return CheckpointExistsError(
        f"{where}: a committed checkpoint already exists here; checkpoints are never "
        "modified in place. Save to a new path or delete this one first."
    )
