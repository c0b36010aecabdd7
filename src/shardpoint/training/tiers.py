"""Checkpoint tiers: the ``step-NNNNNNNNN`` checkpoints under one directory or URL,
and the background uploader that copies committed checkpoints from the fast local
tier to the remote one.

An upload follows the commit protocol on the remote side: shard files first, then
the index, then the marker, so an interrupted upload is an uncommitted prefix that
no reader takes for a checkpoint (and the next upload clears).
"""

from __future__ import annotations

import os
import re
import threading
import time
from collections.abc import Callable
from typing import Any

from ..checkpoint_dir import (
    MAX_INDEX_BYTES,
    MAX_MARKER_BYTES,
    OWN_FILE,
    delete_checkpoint,
    foreign_files,
    is_committed,
)
from ..format.index import INDEX_NAME, MARKER_NAME
from ..storage import CheckpointStorage, join, open_storage
from ..storage.local import LocalDirectory

_STEP_DIR = re.compile(r"^step-(\d{9,})$")


class CheckpointTier:
    """The checkpoints of one manager under one directory (local path or URL)."""

    def __init__(
        self, root: str | os.PathLike[str], storage_options: dict[str, Any] | None
    ) -> None:
        self.root = root
        self.options = storage_options
        self.storage = open_storage(root, storage_options)
        if isinstance(self.storage, LocalDirectory) and not self.storage.root.is_dir():
            self.storage.root.mkdir(parents=True, exist_ok=True)  # skipped on a read-only mount

    def path_for(self, step: int) -> Any:
        return join(self.root, f"step-{step:09d}")

    def open(self, step: int) -> CheckpointStorage:
        return open_storage(self.path_for(step), self.options)

    def step_dirs(self) -> list[int]:
        return sorted(
            int(m.group(1)) for m in map(_STEP_DIR.match, self.storage.subdirectories()) if m
        )

    def committed(self, step: int) -> bool:
        return is_committed(self.open(step))

    def steps(self) -> list[int]:
        """Steps of committed checkpoints, oldest first."""
        return [s for s in self.step_dirs() if self.committed(s)]

    def delete(self, step: int) -> None:
        delete_checkpoint(self.open(step))

    def leftovers(self) -> list[int]:
        """Step directories without a marker that hold only checkpoint files."""
        out = []
        for step in self.step_dirs():
            storage = self.open(step)
            if not is_committed(storage) and not foreign_files(storage):
                out.append(step)
        return out


class Uploader:
    """Copies committed local checkpoints to the remote tier on a background thread.

    Only the newest committed local checkpoint that the remote lacks is uploaded each
    time (an older one is superseded). ``on_event(name, **fields)`` reports uploads,
    failures and lag. ``flush()`` waits until the remote has caught up.
    """

    def __init__(
        self,
        local: CheckpointTier,
        remote: CheckpointTier,
        on_event: Callable[..., None],
        after_upload: Callable[[], None],
        threads: int,
    ) -> None:
        self.local, self.remote = local, remote
        self.on_event = on_event
        self.after_upload = after_upload
        self.threads = threads
        self._wanted = threading.Event()
        self._idle = threading.Event()
        self._idle.set()
        self._stop = False
        self._lock = threading.Lock()
        self._committed_at: dict[int, float] = {}
        self._thread = threading.Thread(target=self._run, name="shardpoint-upload", daemon=True)
        self._thread.start()

    def notify(self, step: int | None = None) -> None:
        """A local checkpoint was committed (or we just started): catch up."""
        with self._lock:
            if step is not None:
                self._committed_at[step] = time.time()
            self._idle.clear()
            self._wanted.set()

    def flush(self, timeout: float | None = None) -> bool:
        """Wait until every committed local checkpoint that should be remote is."""
        return self._idle.wait(timeout)

    def close(self) -> None:
        self.flush()
        self._stop = True
        self._wanted.set()
        self._thread.join()

    def _run(self) -> None:
        while True:
            self._wanted.wait()
            if self._stop:
                return
            with self._lock:
                self._wanted.clear()
            try:
                self._catch_up()
            except Exception as exc:  # reported; the next notify tries again
                self.on_event("upload_failed", error=f"{type(exc).__name__}: {exc}")
            with self._lock:
                if not self._wanted.is_set():
                    self._idle.set()

    def _catch_up(self) -> None:
        local = self.local.steps()
        if not local:
            return
        step = local[-1]
        if self.remote.committed(step):
            return
        start = time.perf_counter()
        nbytes = upload_checkpoint(self.local.open(step), self.remote.open(step), self.threads)
        seconds = time.perf_counter() - start
        lag = time.time() - self._committed_at.get(step, time.time() - seconds)
        self.on_event(
            "upload",
            step=step,
            path=str(self.remote.path_for(step)),
            bytes=nbytes,
            seconds=round(seconds, 4),
            lag_seconds=round(lag, 4),
            gb_per_s=round(nbytes / max(seconds, 1e-9) / 1e9, 3),
        )
        self.after_upload()


def upload_checkpoint(source: CheckpointStorage, target: CheckpointStorage, threads: int) -> int:
    """Copy one committed checkpoint: clear leftovers, shards in parallel, then the index,
    then the marker. Returns the bytes copied."""
    for name in target.list():  # an interrupted earlier upload: never committed
        if OWN_FILE.match(name):
            target.delete(name)
    names = [n for n in source.list() if OWN_FILE.match(n) and not n.endswith(".tmp")]
    shards = [n for n in names if n not in (INDEX_NAME, MARKER_NAME)]
    copy_files(source, target, shards, threads)
    index = source.read_small(INDEX_NAME, MAX_INDEX_BYTES)
    marker = source.read_small(MARKER_NAME, MAX_MARKER_BYTES)
    if index is None or marker is None:
        raise FileNotFoundError(f"{source.where}: not committed (deleted while uploading?)")
    target.write_small_durably(INDEX_NAME, index)
    target.sync()
    target.write_small_durably(MARKER_NAME, marker)
    target.sync()
    return sum(source.size(n) or 0 for n in shards) + len(index) + len(marker)


def copy_files(
    source: CheckpointStorage, target: CheckpointStorage, names: list[str], threads: int
) -> None:
    """Stream whole local files to another storage (an object store uploads each in
    parallel multipart parts)."""
    if not isinstance(source, LocalDirectory):
        raise NotImplementedError("uploads go from the local tier to the remote one")
    for name in names:
        target.put_file(name, source.path(name), threads)
