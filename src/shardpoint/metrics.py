"""Checkpoint metrics: an aggregator of the manager's events, and its exporters.

``CheckpointMetrics.observe`` takes the event dicts the ``CheckpointManager`` gives its
``on_event`` listeners, the same ones its event log holds (one source of truth), and
keeps counters, fixed-bucket histograms, last values and the newest checkpoint per
tier (``memory``, ``local``, ``remote``). It is pure Python with no dependency; the
exporters read it:

- ``serve_prometheus(metrics, port)``: an HTTP endpoint for Prometheus to scrape
  (``pip install 'shardpoint[metrics]'``); one per node, on its first rank.
- ``write_textfile(metrics, path)``: the same text, written atomically, for the node
  exporter's textfile collector (a cron-like call, e.g. after each save).
- ``metrics.scalars()``: a flat ``{name: float}`` for TensorBoard or W&B.

>>> from shardpoint import CheckpointManager                         # doctest: +SKIP
>>> from shardpoint.metrics import CheckpointMetrics, serve_prometheus
>>> metrics = CheckpointMetrics()                                     # doctest: +SKIP
>>> manager = CheckpointManager("runs/exp1", on_event=[metrics.observe])  # doctest: +SKIP
>>> endpoint = serve_prometheus(metrics, 9400)   # rank 0 of the node   # doctest: +SKIP
>>> for step in range(start, total):                                 # doctest: +SKIP
...     train_step()
...     if manager.maybe_save(step, state):
...         for name, value in metrics.scalars().items():
...             writer.add_scalar(name, value, step)                  # TensorBoard
>>> endpoint.close()                                                  # doctest: +SKIP

Ages (``shardpoint_newest_checkpoint_age_seconds``) are computed when read, from the
time of the newest checkpoint's event, so a stalled job's age keeps growing. Each
rank's aggregator holds what its rank sees: saves, memory saves and restores on every
rank; uploads and the remote tier's deletions on rank 0 only.
"""

from __future__ import annotations

import bisect
import math
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Any

TIERS = ("memory", "local", "remote")
# Events that say something went wrong, counted by kind (``failures_total{kind}``).
FAILURES = (
    "save_failed",
    "memory_save_failed",
    "upload_failed",
    "delete_failed",
    "save_refused",
    "fallback",
)
SECONDS_BUCKETS = (
    0.001, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0,
    120.0, 300.0, 600.0, 1800.0,
)  # fmt: skip
GB_PER_S_BUCKETS = (0.01, 0.05, 0.1, 0.25, 0.5, 1.0, 2.0, 4.0, 8.0, 16.0, 32.0, 64.0)
_KEEP_STEPS = 256  # per tier: enough to know the newest after deletions and rollbacks
_INSTALL = "pip install 'shardpoint[metrics]'"


@dataclass
class Histogram:
    """Counts of observations per fixed upper bound (``le``), their sum and count."""

    bounds: tuple[float, ...]
    counts: list[int] = field(init=False)  # per bound, then +Inf: not cumulative
    sum: float = 0.0
    count: int = 0

    def __post_init__(self) -> None:
        self.counts = [0] * (len(self.bounds) + 1)

    def observe(self, value: float) -> None:
        self.counts[bisect.bisect_left(self.bounds, value)] += 1
        self.sum += value
        self.count += 1

    def cumulative(self) -> list[tuple[str, int]]:
        """(le, observations <= le) per bound and ``+Inf``: Prometheus' buckets."""
        out, total = [], 0
        for bound, n in zip((*self.bounds, math.inf), self.counts):
            total += n
            out.append(("+Inf" if bound == math.inf else repr(float(bound)), total))
        return out


class CheckpointMetrics:
    """Counters, histograms, last values and newest checkpoint per tier, fed with the
    manager's events (``CheckpointManager(on_event=[metrics.observe])``). Thread-safe:
    events arrive from the training thread and from the background save and upload
    threads. An event it does not know, or a field it lacks, is ignored."""

    def __init__(self, clock: Callable[[], float] = time.time) -> None:
        self.clock = clock
        self._lock = threading.Lock()
        self.checkpoints = dict.fromkeys(TIERS, 0)  # committed per tier
        self.bytes = dict.fromkeys(TIERS, 0)  # written per tier
        self.stall = {t: Histogram(SECONDS_BUCKETS) for t in ("memory", "local")}
        self.persist = {t: Histogram(SECONDS_BUCKETS) for t in TIERS}
        self.throughput = {t: Histogram(GB_PER_S_BUCKETS) for t in ("local", "remote")}
        self.upload_lag = Histogram(SECONDS_BUCKETS)
        self.restore = {t: Histogram(SECONDS_BUCKETS) for t in TIERS}
        self.restore_bytes_from_remote = 0
        self.failures = dict.fromkeys(FAILURES, 0)
        self.rollbacks = 0
        self.set_aside = dict.fromkeys(TIERS, 0)
        self.deletions = dict.fromkeys(("local", "remote"), 0)
        self.preemptions = 0
        self.last: dict[str, float] = {}  # "local/stall_seconds" -> the latest value
        self._steps: dict[str, dict[int, float]] = {t: {} for t in TIERS}  # step -> time

    # ---- feeding -------------------------------------------------------------------------

    def observe(self, event: dict[str, Any]) -> None:
        """Take one event dict (``{"event": name, "time": unix seconds, **fields}``)."""
        name = event.get("event")
        when = _number(event.get("time"))
        when = self.clock() if when is None else when
        with self._lock:
            if name in self.failures:
                self.failures[name] += 1
            if name == "save":
                self._committed("local", event, when, stall=True)
            elif name == "memory_save":
                self._committed("memory", event, when, stall=True)
            elif name == "upload":
                self._committed("remote", event, when, stall=False)
                lag = _number(event.get("lag_seconds"))
                if lag is not None:
                    self.upload_lag.observe(lag)
            elif name == "restore":
                self._restored(event)
            elif name in ("delete", "cleanup", "set_aside"):
                tier = str(event.get("tier") or "local")
                step = _integer(event.get("step"))
                if tier in self._steps and step is not None:
                    self._steps[tier].pop(step, None)
                if name == "set_aside" and tier in self.set_aside:
                    self.set_aside[tier] += 1
                if name == "delete" and tier in self.deletions:
                    self.deletions[tier] += 1
            elif name == "rollback":
                self.rollbacks += 1
                to_step = _integer(event.get("to_step"))
                if to_step is not None:  # every newer copy is set aside or dropped
                    for steps in self._steps.values():
                        for step in [s for s in steps if s > to_step]:
                            del steps[step]
            elif name == "preempted":
                self.preemptions += 1

    def _committed(self, tier: str, event: dict[str, Any], when: float, *, stall: bool) -> None:
        self.checkpoints[tier] += 1
        nbytes = _number(event.get("bytes"))
        if nbytes is not None:
            self.bytes[tier] += int(nbytes)
            self.last[f"{tier}/bytes"] = nbytes
        seconds = _number(event.get("seconds"))
        if seconds is not None:
            self.persist[tier].observe(seconds)
            self.last[f"{tier}/persist_seconds"] = seconds
        blocked = _number(event.get("blocked_seconds"))
        if stall and blocked is not None:
            self.stall[tier].observe(blocked)
            self.last[f"{tier}/stall_seconds"] = blocked
        speed = _number(event.get("gb_per_s"))
        if tier in self.throughput and speed is not None:
            self.throughput[tier].observe(speed)
            self.last[f"{tier}/gb_per_s"] = speed
        step = _integer(event.get("step"))
        if step is not None:
            steps = self._steps[tier]
            steps[step] = when
            if len(steps) > _KEEP_STEPS:
                del steps[min(steps)]

    def _restored(self, event: dict[str, Any]) -> None:
        from_remote = _number(event.get("bytes_from_remote")) or 0
        tier = event.get("tier")
        if tier not in TIERS:  # read from disk: remote when any byte came from there
            tier = "remote" if from_remote > 0 else "local"
        self.restore_bytes_from_remote += int(from_remote)
        seconds = _number(event.get("seconds"))
        if seconds is not None:
            self.restore[tier].observe(seconds)
            self.last["restore/seconds"] = seconds
        self.last[f"restore/{tier}/step"] = _number(event.get("step")) or 0.0

    # ---- reading -------------------------------------------------------------------------

    def newest(self) -> dict[str, tuple[int, float]]:
        """Tier -> (newest step it holds, unix time of its event), for tiers with one."""
        with self._lock:
            newest = {tier: max(steps) for tier, steps in self._steps.items() if steps}
            return {tier: (step, self._steps[tier][step]) for tier, step in newest.items()}

    def scalars(self) -> dict[str, float]:
        """A flat ``{"shardpoint/<name>": value}`` for TensorBoard (``add_scalar`` each)
        or W&B (``wandb.log(metrics.scalars(), step=step)``): counts, last values, the
        histograms' means, newest step and age per tier (ages as of now)."""
        now = self.clock()
        newest = self.newest()
        with self._lock:
            out: dict[str, float] = {}
            for tier in TIERS:
                out[f"{tier}/checkpoints"] = self.checkpoints[tier]
                if tier in newest:
                    step, when = newest[tier]
                    out[f"{tier}/newest_step"] = step
                    out[f"{tier}/age_seconds"] = max(0.0, now - when)
            for tier, hist in self.stall.items():
                if hist.count:
                    out[f"{tier}/stall_seconds_mean"] = hist.sum / hist.count
            for tier, hist in self.persist.items():
                if hist.count:
                    out[f"{tier}/persist_seconds_mean"] = hist.sum / hist.count
            out.update(self.last)
            out.update({f"failures/{kind}": n for kind, n in self.failures.items()})
            out["rollbacks"] = self.rollbacks
            return {f"shardpoint/{name}": float(value) for name, value in out.items()}

    def families(self) -> list[tuple[str, str, str, list[tuple[dict[str, str], Any]]]]:
        """Every metric as (name, type, help, [(labels, value)]): a counter's or gauge's
        value is a number, a histogram's a (cumulative buckets, sum) pair. What the
        exporters turn into Prometheus' types; ages are computed now."""
        now = self.clock()
        newest = self.newest()
        with self._lock:

            def per_tier(values: dict[str, Any]) -> list[tuple[dict[str, str], Any]]:
                return [({"tier": t}, v) for t, v in values.items()]

            def hists(values: dict[str, Histogram]) -> list[tuple[dict[str, str], Any]]:
                return [({"tier": t}, (h.cumulative(), h.sum)) for t, h in values.items()]

            last = self.last
            return [
                (
                    "shardpoint_checkpoints",
                    "counter",
                    "Checkpoints committed, per tier (memory saves, saves, uploads).",
                    per_tier(self.checkpoints),
                ),
                (
                    "shardpoint_written_bytes",
                    "counter",
                    "Bytes written per tier (saves: this rank's; uploads: all ranks').",
                    per_tier({t: self.bytes[t] for t in ("local", "remote")}),
                ),
                (
                    "shardpoint_save_stall_seconds",
                    "histogram",
                    "Seconds the training thread waited for a save.",
                    hists(self.stall),
                ),
                (
                    "shardpoint_persist_seconds",
                    "histogram",
                    "Seconds from a save's call (an upload's start) to its commit.",
                    hists(self.persist),
                ),
                (
                    "shardpoint_throughput_gb_per_s",
                    "histogram",
                    "Write throughput of saves and uploads, GB/s.",
                    hists(self.throughput),
                ),
                (
                    "shardpoint_upload_lag_seconds",
                    "histogram",
                    "Seconds from a local commit to the remote copy's commit.",
                    [({}, (self.upload_lag.cumulative(), self.upload_lag.sum))],
                ),
                (
                    "shardpoint_restore_seconds",
                    "histogram",
                    "Seconds a restore took, per tier it came from.",
                    hists(self.restore),
                ),
                (
                    "shardpoint_restore_bytes_from_remote",
                    "counter",
                    "Bytes restores read from the remote tier.",
                    [({}, self.restore_bytes_from_remote)],
                ),
                (
                    "shardpoint_failures",
                    "counter",
                    "Failed saves, uploads, deletions; refused saves; restore fallbacks.",
                    [({"kind": k}, n) for k, n in self.failures.items()],
                ),
                (
                    "shardpoint_rollbacks",
                    "counter",
                    "Rollbacks asked of the run.",
                    [({}, self.rollbacks)],
                ),
                (
                    "shardpoint_set_aside",
                    "counter",
                    "Checkpoints set aside (unusable, rolled back, superseded).",
                    per_tier(self.set_aside),
                ),
                (
                    "shardpoint_deletions",
                    "counter",
                    "Checkpoints deleted by retention.",
                    per_tier(self.deletions),
                ),
                (
                    "shardpoint_preemptions",
                    "counter",
                    "Preemption signals handled.",
                    [({}, self.preemptions)],
                ),
                (
                    "shardpoint_last_save_stall_seconds",
                    "gauge",
                    "The latest save's stall of the training thread.",
                    [
                        ({"tier": t}, last[k])
                        for t in self.stall
                        if (k := f"{t}/stall_seconds") in last
                    ],
                ),
                (
                    "shardpoint_last_persist_seconds",
                    "gauge",
                    "The latest save's (upload's) seconds to commit.",
                    [
                        ({"tier": t}, last[k])
                        for t in TIERS
                        if (k := f"{t}/persist_seconds") in last
                    ],
                ),
                (
                    "shardpoint_newest_step",
                    "gauge",
                    "Newest step each tier holds.",
                    [({"tier": t}, s) for t, (s, _) in newest.items()],
                ),
                (
                    "shardpoint_newest_checkpoint_timestamp_seconds",
                    "gauge",
                    "Unix time of the newest checkpoint each tier holds.",
                    [({"tier": t}, w) for t, (_, w) in newest.items()],
                ),
                (
                    "shardpoint_newest_checkpoint_age_seconds",
                    "gauge",
                    "Seconds since the newest checkpoint each tier holds (as of the scrape).",
                    [({"tier": t}, max(0.0, now - w)) for t, (_, w) in newest.items()],
                ),
            ]


# ---- exporters ------------------------------------------------------------------------------


def _prometheus() -> Any:
    try:
        import prometheus_client
    except ImportError:
        raise ImportError(f"the Prometheus exporter needs prometheus_client: {_INSTALL}") from None
    return prometheus_client


def registry_for(metrics: CheckpointMetrics) -> Any:
    """A ``prometheus_client.CollectorRegistry`` of its own holding only ``metrics``
    (read at each collection): to serve or write it, or to combine with others."""
    prometheus_client = _prometheus()
    from prometheus_client.core import (
        CounterMetricFamily,
        GaugeMetricFamily,
        HistogramMetricFamily,
    )

    kinds = {
        "counter": CounterMetricFamily,
        "gauge": GaugeMetricFamily,
        "histogram": HistogramMetricFamily,
    }

    class Collector:
        def collect(self) -> Iterator[Any]:
            for name, kind, text, samples in metrics.families():
                labels = sorted({k for lab, _ in samples for k in lab})
                family = kinds[kind](name, text, labels=labels)
                for lab, value in samples:
                    values = [lab.get(k, "") for k in labels]
                    if kind == "histogram":
                        buckets, total = value
                        family.add_metric(values, buckets, total)
                    else:
                        family.add_metric(values, float(value))
                yield family

    registry = prometheus_client.CollectorRegistry(auto_describe=False)
    registry.register(Collector())
    return registry


class PrometheusEndpoint:
    """A running ``/metrics`` HTTP endpoint (``serve_prometheus``); ``close()`` stops it."""

    def __init__(self, server: Any, thread: threading.Thread) -> None:
        self._server, self._thread = server, thread
        self.addr, self.port = server.server_address[:2]

    @property
    def url(self) -> str:
        return f"http://{self.addr}:{self.port}/metrics"

    def close(self) -> None:
        self._server.shutdown()
        self._server.server_close()
        self._thread.join()

    def __enter__(self) -> PrometheusEndpoint:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def serve_prometheus(
    metrics: CheckpointMetrics, port: int, addr: str = "127.0.0.1"
) -> PrometheusEndpoint:
    """Serve ``metrics`` for Prometheus at ``http://addr:port/metrics`` on a daemon
    thread (``port=0``: a free one, see ``.port``). Call it on one rank per node (its
    first: ``LOCAL_RANK`` 0); ``addr="0.0.0.0"`` to be scraped from another machine.

    >>> endpoint = serve_prometheus(metrics, 9400)                  # doctest: +SKIP
    >>> endpoint.url                                                  # doctest: +SKIP
    'http://127.0.0.1:9400/metrics'
    """
    registry = registry_for(metrics)
    started = _prometheus().start_http_server(port, addr=addr, registry=registry)
    if not isinstance(started, tuple):  # before 0.20 it returned nothing to stop
        raise ImportError(f"prometheus_client>=0.20 is needed: {_INSTALL}")
    return PrometheusEndpoint(*started)


def write_textfile(metrics: CheckpointMetrics, path: str) -> None:
    """Write ``metrics`` in Prometheus' text format to ``path`` (a ``.prom`` file in
    the node exporter's ``--collector.textfile.directory``), atomically: written
    beside it, then renamed over it, so the collector never reads half a file."""
    _prometheus().write_to_textfile(str(path), registry_for(metrics))


def _number(value: Any) -> float | None:
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        return None
    return float(value) if math.isfinite(value) else None


def _integer(value: Any) -> int | None:
    return value if isinstance(value, int) and not isinstance(value, bool) else None
