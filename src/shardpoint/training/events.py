"""The event log: one JSON line per save, upload, restore, fallback, deletion, signal.

``CheckpointManager`` writes it (``DIR/events.jsonl``); ``shardpoint report`` and
``shardpoint status`` read it, and ``on_event`` listeners (``shardpoint.metrics``) are
given every event as it happens.
"""

from __future__ import annotations

import json
import threading
import time
import warnings
from collections.abc import Callable, Iterable
from typing import Any

from .. import dist
from ..storage import CheckpointStorage


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

    def log(self, event: str, **fields: Any) -> None:
        """A job-wide event: written to the log by rank 0, given to every rank's listeners."""
        if dist.rank() == 0:
            self.write(event, **fields)
        else:
            self.notify(event, **fields)
