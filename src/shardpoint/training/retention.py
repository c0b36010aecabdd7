"""Which checkpoints to keep: a policy value the manager applies after each commit."""

from __future__ import annotations

import math
from dataclasses import dataclass


@dataclass(frozen=True)
class KeptCheckpoint:
    step: int
    metric: float | None = None
    good: bool = False  # saved known good: no NaN in the state, no metric diverged


@dataclass(frozen=True)
class RetentionPolicy:
    """Keep the newest ``keep_last``, every step divisible by ``keep_every_n_steps``, and
    the ``keep_best`` with the best ``best_metric`` (the key of the ``metrics`` given
    to ``save``; lowest when ``mode == "min"``), and the newest ``keep_last_good`` saved
    known good (the manager's NaN check passed and every metric given was finite), so
    that a streak of diverged saves cannot rotate every good checkpoint out.

    The newest checkpoint is always kept, whatever the policy says.
    """

    keep_last: int | None = 3
    keep_every_n_steps: int | None = None
    keep_best: int | None = None
    best_metric: str | None = None
    mode: str = "min"
    keep_last_good: int | None = 1

    def __post_init__(self) -> None:
        if self.keep_best and not self.best_metric:
            raise ValueError("keep_best needs best_metric: the metrics key to rank checkpoints by")
        if self.keep_last is not None and self.keep_last < 1:
            raise ValueError("keep_last must be at least 1 (or None to keep all)")
        if self.mode not in ("min", "max"):
            raise ValueError("mode must be 'min' or 'max'")
        if self.keep_last_good is not None and self.keep_last_good < 0:
            raise ValueError("keep_last_good must be at least 0 (or None)")

    def keep(self, checkpoints: list[KeptCheckpoint]) -> set[int]:
        """The steps to keep among ``checkpoints`` (committed, any order)."""
        by_step = sorted(checkpoints, key=lambda c: c.step)
        if self.keep_last is None:
            return {c.step for c in by_step}
        kept = {c.step for c in by_step[-self.keep_last :]}
        if by_step:
            kept.add(by_step[-1].step)
        if self.keep_every_n_steps:
            kept |= {c.step for c in by_step if c.step % self.keep_every_n_steps == 0}
        if self.keep_last_good:
            good = [c.step for c in by_step if c.good]
            kept |= set(good[-self.keep_last_good :])
        if self.keep_best:
            scored = [c for c in by_step if c.metric is not None and not math.isnan(c.metric)]
            sign = 1 if self.mode == "min" else -1
            scored.sort(key=lambda c: (sign * c.metric, -c.step))  # type: ignore[operator]
            kept |= {c.step for c in scored[: self.keep_best]}
        return kept
