"""``shardpoint report``: what a CheckpointManager's event log says about its saves."""

from __future__ import annotations

import statistics
from pathlib import Path
from typing import Any

from .errors import CheckpointError
from .storage import open_storage
from .training.manager import EventLog


def save_report(directory: Path, out: Path | None = None) -> dict[str, Any]:
    """Summarise ``directory/events.jsonl`` and plot save time, stall and size per step."""
    log = directory / "events.jsonl"
    if not log.exists():
        raise CheckpointError(f"{log}: no event log here; point to a CheckpointManager directory")
    events = EventLog(open_storage(directory)).read()
    saves = [e for e in events if e.get("event") == "save"]

    def stats(key: str) -> dict[str, float]:
        values = [float(e.get(key) or 0) for e in saves] or [0.0]
        return {"median": statistics.median(values), "max": max(values), "total": sum(values)}

    out = out or directory / "report.png"
    summary = {
        "saves": len(saves),
        "restores": sum(e.get("event") == "restore" for e in events),
        "fallbacks": sum(e.get("event") == "fallback" for e in events),
        "failed_saves": sum(e.get("event") == "save_failed" for e in events),
        "deletions": sum(e.get("event") == "delete" for e in events),
        "seconds": stats("seconds"),
        "blocked_seconds": stats("blocked_seconds"),
        "bytes": stats("bytes"),
        "plot": str(out),
    }
    _plot(saves, out)
    return summary


def _plot(saves: list[dict[str, Any]], out: Path) -> None:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        raise CheckpointError(
            "the plot needs matplotlib: pip install matplotlib (or shardpoint[report])"
        ) from None
    steps = [e.get("step", i) for i, e in enumerate(saves)]
    fig, (top, bottom) = plt.subplots(2, 1, figsize=(8, 6), sharex=True)
    top.plot(steps, [e.get("seconds", 0) for e in saves], "o-", label="save, call to commit")
    top.plot(steps, [e.get("blocked_seconds", 0) for e in saves], "s-", label="training stall")
    top.set_ylabel("seconds")
    top.legend()
    bottom.plot(steps, [e.get("bytes", 0) / 1e6 for e in saves], "o-")
    bottom.set_ylabel("checkpoint size (MB)")
    bottom.set_xlabel("step")
    fig.tight_layout()
    fig.savefig(out, dpi=100)
    plt.close(fig)
