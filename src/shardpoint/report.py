"""``shardpoint report``: what a CheckpointManager's event log says about its saves."""

from __future__ import annotations

import statistics
from pathlib import Path
from typing import Any

from .errors import CheckpointError
from .storage import open_storage
from .training.events import EventLog


def save_report(directory: Path, out: Path | None = None) -> dict[str, Any]:
    """Summarise ``directory/events.jsonl`` and plot save time, stall and size per step,
    and the run's timeline: the step of every save over wall time, each restore marked
    with the tier it came from, each preemption."""
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
        "restores_by_tier": _restores_by_tier(events),
        "fallbacks": sum(e.get("event") == "fallback" for e in events),
        "failed_saves": sum(e.get("event") == "save_failed" for e in events),
        "deletions": sum(e.get("event") == "delete" for e in events),
        "seconds": stats("seconds"),
        "blocked_seconds": stats("blocked_seconds"),
        "bytes": stats("bytes"),
        "plot": str(out),
    }
    _plot(saves, events, out)
    return summary


def restore_tier(event: dict[str, Any]) -> str:
    """The tier a ``restore`` event's state came from: memory, local (the directory's
    own copy) or remote (any byte from the remote tier)."""
    if event.get("tier") == "memory":
        return "memory"
    return "remote" if event.get("bytes_from_remote") else "local"


def _restores_by_tier(events: list[dict[str, Any]]) -> dict[str, int]:
    counts = {"memory": 0, "local": 0, "remote": 0}
    for e in events:
        if e.get("event") == "restore":
            counts[restore_tier(e)] += 1
    return counts


def _plot(saves: list[dict[str, Any]], events: list[dict[str, Any]], out: Path) -> None:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        raise CheckpointError(
            "the plot needs matplotlib: pip install matplotlib (or shardpoint[report])"
        ) from None
    steps = [e.get("step", i) for i, e in enumerate(saves)]
    fig, (top, middle, bottom) = plt.subplots(3, 1, figsize=(8, 9))
    top.plot(steps, [e.get("seconds", 0) for e in saves], "o-", label="save, call to commit")
    top.plot(steps, [e.get("blocked_seconds", 0) for e in saves], "s-", label="training stall")
    top.set_ylabel("seconds")
    top.set_xlabel("step")
    top.legend()
    middle.plot(steps, [e.get("bytes", 0) / 1e6 for e in saves], "o-")
    middle.set_ylabel("checkpoint size (MB)")
    middle.set_xlabel("step")
    _timeline(bottom, events)
    fig.tight_layout()
    fig.savefig(out, dpi=100)
    plt.close(fig)


def _timeline(ax: Any, events: list[dict[str, Any]]) -> None:
    """Steps over wall time: saves per tier as dots, restores as triangles coloured by
    the tier they came from, preemptions as vertical lines."""
    timed = [e for e in events if isinstance(e.get("time"), (int, float))]
    start = min((e["time"] for e in timed), default=0.0)
    colors = {"memory": "tab:green", "local": "tab:blue", "remote": "tab:purple"}
    for event, tier, label in (("memory_save", "memory", "memory save"), ("save", "local", "save")):
        rows = [e for e in timed if e.get("event") == event and "step" in e]
        ax.plot(
            [e["time"] - start for e in rows],
            [e["step"] for e in rows],
            ".",
            color=colors[tier],
            label=label,
        )
    for tier, color in colors.items():
        rows = [e for e in timed if e.get("event") == "restore" and restore_tier(e) == tier]
        if rows:
            ax.plot(
                [e["time"] - start for e in rows],
                [e.get("step", 0) for e in rows],
                "v",
                color=color,
                markersize=9,
                label=f"restored from {tier}",
            )
    for e in timed:
        if e.get("event") == "preempted":
            ax.axvline(e["time"] - start, color="tab:red", alpha=0.4)
    ax.set_xlabel("wall clock (s since the first event); red: preemptions")
    ax.set_ylabel("step")
    ax.legend(fontsize="small")
