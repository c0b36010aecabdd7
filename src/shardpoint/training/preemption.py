"""Preemption signals: which one arrived on this rank, when, and the grace left after it.

The handlers only set a flag (saving inside a signal handler could interrupt a save);
the manager reads it at its next save decision, agreed by every rank. The grace
(``preemption_grace_seconds``) runs from the first signal.
"""

from __future__ import annotations

import signal
import threading
import time
import warnings
from collections.abc import Iterable, Mapping
from typing import Any

from .. import dist

Grace = float | Mapping[int, float] | None  # seconds, or seconds per signal


def check_grace(grace_seconds: Grace) -> None:
    """Refuse a grace (one number, or one per signal) that is not positive."""
    graces = grace_seconds.values() if isinstance(grace_seconds, Mapping) else [grace_seconds]
    if any(g is not None and g <= 0 for g in graces):
        raise ValueError("preemption_grace_seconds must be positive (or None: no budget)")


class Preemption:
    """This rank's preemption signals: handlers installed for ``signals`` (from the main
    thread only) until ``close``, the signal received and when the first one came."""

    def __init__(self, signals: Iterable[int], grace_seconds: Grace) -> None:
        self.grace_seconds = grace_seconds
        self.signal: int | None = None
        self.signal_time: float | None = None  # when this rank learned of the signal
        self._previous_handlers: dict[int, Any] = {}
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
        self.learn(signum)

    def learn(self, signum: int) -> None:
        """A signal arrived here, or another rank saw one (``agreed``)."""
        if self.signal is None:  # the grace runs from the first signal
            self.signal_time = time.monotonic()
        self.signal = signum

    def agreed(self) -> bool:
        """Whether any rank has seen a preemption signal (read once, agreed by all)."""
        seen = self.signal or 0
        if dist.is_distributed():
            (seen,) = dist.max_of([seen])
            if seen and self.signal is None:
                self.learn(seen)
        return bool(seen)

    def grace_left(self) -> float | None:
        """Seconds left of the signal's grace (None: no grace given for it)."""
        grace = self.grace_seconds
        if isinstance(grace, Mapping):
            grace = grace.get(self.signal or 0)
        if grace is None:
            return None
        since = time.monotonic() - (self.signal_time or time.monotonic())
        return grace - since

    def close(self) -> None:
        """Put back the handlers that were installed before."""
        for sig, handler in self._previous_handlers.items():
            signal.signal(sig, handler)
        self._previous_handlers.clear()
