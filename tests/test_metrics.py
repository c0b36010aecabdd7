"""shardpoint.metrics: the aggregator of the manager's events (pure), and its Prometheus
endpoint and textfile as the real prometheus_client parser reads them."""

import builtins
import urllib.request

import pytest
import torch
from prometheus_client.parser import text_string_to_metric_families

from shardpoint import CheckpointManager, RetentionPolicy, SavePolicy
from shardpoint.metrics import (
    SECONDS_BUCKETS,
    CheckpointMetrics,
    Histogram,
    serve_prometheus,
    write_textfile,
)


def _save(step, when, **more):
    return {
        "event": "save",
        "time": when,
        "step": step,
        "bytes": 1000,
        "seconds": 0.3,
        "blocked_seconds": 0.02,
        "gb_per_s": 0.5,
        **more,
    }


def _samples(text):
    """{(sample name, sorted label items): value} of a Prometheus text exposition."""
    return {
        (s.name, tuple(sorted(s.labels.items()))): s.value
        for family in text_string_to_metric_families(text)
        for s in family.samples
    }


def test_histogram_buckets_are_cumulative_and_end_with_inf():
    h = Histogram((0.1, 1.0))
    for value in (0.05, 0.1, 0.5, 7.0):
        h.observe(value)
    assert h.cumulative() == [("0.1", 2), ("1.0", 3), ("+Inf", 4)]  # le: a bound is inside
    assert h.count == 4 and h.sum == pytest.approx(7.65)


def test_a_save_feeds_counters_histograms_last_values_and_the_newest_local_step():
    m = CheckpointMetrics(clock=lambda: 1000.0)
    m.observe(_save(10, 900.0))
    m.observe(_save(20, 950.0, blocked_seconds=4.0, seconds=6.0))
    assert m.checkpoints["local"] == 2 and m.bytes["local"] == 2000
    assert m.stall["local"].count == 2 and m.stall["local"].sum == pytest.approx(4.02)
    assert m.persist["local"].count == 2 and m.throughput["local"].count == 2
    assert m.last["local/stall_seconds"] == 4.0 and m.last["local/persist_seconds"] == 6.0
    assert m.newest() == {"local": (20, 950.0)}


def test_memory_saves_and_uploads_are_their_own_tiers():
    m = CheckpointMetrics(clock=lambda: 100.0)
    m.observe(
        {"event": "memory_save", "time": 90.0, "step": 5, "seconds": 0.1, "blocked_seconds": 0.01}
    )
    m.observe(
        {
            "event": "upload",
            "time": 95.0,
            "step": 4,
            "bytes": 77,
            "seconds": 2.0,
            "lag_seconds": 3.0,
            "gb_per_s": 0.1,
        }
    )
    assert m.newest() == {"memory": (5, 90.0), "remote": (4, 95.0)}
    assert m.stall["memory"].count == 1 and m.persist["remote"].count == 1
    assert m.bytes["remote"] == 77 and m.upload_lag.count == 1 and m.checkpoints["local"] == 0


def test_failures_are_counted_by_kind_including_refused_saves_and_fallbacks():
    m = CheckpointMetrics()
    for name in ("save_failed", "upload_failed", "upload_failed", "save_refused", "fallback"):
        m.observe({"event": name, "time": 1.0, "error": "boom"})
    assert m.failures == {
        "save_failed": 1,
        "memory_save_failed": 0,
        "upload_failed": 2,
        "delete_failed": 0,
        "save_refused": 1,
        "fallback": 1,
    }
    assert m.checkpoints == {"memory": 0, "local": 0, "remote": 0}


def test_deletions_set_asides_and_rollbacks_move_the_newest_step_back():
    m = CheckpointMetrics()
    for step in (1, 2, 3, 4):
        m.observe(_save(step, float(step)))
    m.observe({"event": "upload", "time": 5.0, "step": 4})
    m.observe({"event": "set_aside", "time": 6.0, "step": 4, "tier": "local", "why": "unusable"})
    assert m.newest()["local"] == (3, 3.0) and m.set_aside["local"] == 1
    m.observe(
        {"event": "rollback", "time": 7.0, "to_step": 2, "skip_batches": 5, "reason": "spike"}
    )
    assert m.newest() == {"local": (2, 2.0)} and m.rollbacks == 1  # the remote's 4 gone too
    m.observe({"event": "delete", "time": 8.0, "step": 2, "path": "x"})
    assert m.newest()["local"] == (1, 1.0) and m.deletions["local"] == 1


def test_the_age_of_the_newest_checkpoint_is_computed_when_read():
    now = [1000.0]
    m = CheckpointMetrics(clock=lambda: now[0])
    m.observe(_save(7, 990.0))
    assert m.scalars()["shardpoint/local/age_seconds"] == 10.0
    now[0] = 1060.0  # no event since: a stalled job's age keeps growing
    assert m.scalars()["shardpoint/local/age_seconds"] == 70.0
    ages = [s for n, _, _, s in m.families() if n == "shardpoint_newest_checkpoint_age_seconds"]
    assert ages == [[({"tier": "local"}, 70.0)]]


def test_a_restore_is_timed_per_tier_it_came_from():
    m = CheckpointMetrics()
    m.observe({"event": "restore", "time": 1.0, "step": 3, "tier": "memory", "seconds": 0.2})
    m.observe(
        {
            "event": "restore",
            "time": 1.0,
            "step": 3,
            "path": "p",
            "bytes_from_remote": 0,
            "seconds": 1.0,
        }
    )
    m.observe(
        {
            "event": "restore",
            "time": 1.0,
            "step": 3,
            "path": "p",
            "bytes_from_remote": 50,
            "seconds": 9.0,
        }
    )
    assert [m.restore[t].count for t in ("memory", "local", "remote")] == [1, 1, 1]
    assert m.restore["remote"].sum == 9.0 and m.restore_bytes_from_remote == 50


def test_unknown_events_and_odd_fields_are_ignored_not_raised():
    m = CheckpointMetrics(clock=lambda: 5.0)
    for event in (
        {},
        {"event": "something_new", "x": 1},
        {
            "event": "save",
            "step": "7",
            "seconds": None,
            "bytes": "many",
            "blocked_seconds": float("nan"),
        },
        {"event": "rollback", "to_step": None},
        {"event": "delete", "step": True},
    ):
        m.observe(event)
    assert m.checkpoints["local"] == 1 and m.stall["local"].count == 0
    assert m.newest() == {} and m.rollbacks == 1


def test_scalars_are_a_flat_dict_of_floats_for_tensorboard():
    m = CheckpointMetrics(clock=lambda: 10.0)
    m.observe(_save(3, 9.0))
    m.observe({"event": "save_refused", "time": 9.5, "step": 4, "reason": "nan"})
    scalars = m.scalars()
    assert all(isinstance(k, str) and type(v) is float for k, v in scalars.items())
    assert scalars["shardpoint/local/newest_step"] == 3.0
    assert scalars["shardpoint/local/stall_seconds"] == 0.02
    assert scalars["shardpoint/failures/save_refused"] == 1.0


def test_prometheus_endpoint_of_a_real_manager_changes_across_saves(tmp_path):
    metrics = CheckpointMetrics()
    state = {"model": torch.nn.Linear(8, 8)}
    manager = CheckpointManager(
        tmp_path / "run",
        SavePolicy(every_n_steps=1),
        RetentionPolicy(keep_last=2),
        preemption_signals=(),
        on_event=[metrics.observe],
    )
    with manager, serve_prometheus(metrics, 0) as endpoint:
        assert endpoint.url.startswith("http://127.0.0.1:")

        def scrape():
            with urllib.request.urlopen(endpoint.url, timeout=10) as response:
                return _samples(response.read().decode())

        manager.save(1, state)
        first = scrape()
        for step in (2, 3, 4):
            manager.save(step, state)
        second = scrape()

    local = (("tier", "local"),)
    assert first[("shardpoint_checkpoints_total", local)] == 1
    assert second[("shardpoint_checkpoints_total", local)] == 4
    count = ("shardpoint_save_stall_seconds_count", local)
    assert (first[count], second[count]) == (1, 4)
    inf = ("shardpoint_persist_seconds_bucket", (("le", "+Inf"), ("tier", "local")))
    assert (first[inf], second[inf]) == (1, 4)
    assert (
        second[("shardpoint_written_bytes_total", local)]
        > first[("shardpoint_written_bytes_total", local)]
    )
    assert (
        first[("shardpoint_newest_step", local)],
        second[("shardpoint_newest_step", local)],
    ) == (1, 4)
    assert second[("shardpoint_deletions_total", local)] == 2  # keep_last=2 of 4
    assert second[("shardpoint_newest_checkpoint_age_seconds", local)] < 60
    assert second[("shardpoint_failures_total", (("kind", "save_failed"),))] == 0  # present at 0


def test_textfile_is_atomic_prometheus_text(tmp_path):
    m = CheckpointMetrics()
    m.observe(_save(5, 1.0))
    path = tmp_path / "shardpoint.prom"
    path.write_text("old")
    write_textfile(m, str(path))
    samples = _samples(path.read_text())
    assert samples[("shardpoint_newest_step", (("tier", "local"),))] == 5
    buckets = [
        k
        for k in samples
        if k[0] == "shardpoint_save_stall_seconds_bucket" and ("tier", "local") in k[1]
    ]
    assert len(buckets) == len(SECONDS_BUCKETS) + 1
    assert [p.name for p in tmp_path.iterdir()] == ["shardpoint.prom"]  # no temporary left


def test_without_prometheus_client_the_error_names_the_extra(monkeypatch):
    real_import = builtins.__import__

    def no_prometheus(name, *args, **kwargs):
        if name.startswith("prometheus_client"):
            raise ImportError(f"No module named {name!r}")
        return real_import(name, *args, **kwargs)

    monkeypatch.setattr(builtins, "__import__", no_prometheus)
    m = CheckpointMetrics()
    m.observe(_save(1, 1.0))  # the aggregator needs nothing
    assert m.scalars()["shardpoint/local/newest_step"] == 1.0
    with pytest.raises(ImportError, match=r"pip install 'shardpoint\[metrics\]'"):
        serve_prometheus(m, 0)
