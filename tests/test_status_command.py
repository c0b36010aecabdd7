"""``shardpoint status RUN``: a run's newest checkpoint per tier and its age, read from
the directory alone; exit 0 healthy, 1 stale or none (``--max-age``), 2 bad input."""

import json
import os
import time

import pytest
import torch

from shardpoint import CheckpointManager, RemoteTier, RetentionPolicy, SavePolicy
from shardpoint.cli import main, parse_duration
from shardpoint.format.index import MARKER_NAME


def _run(directory, steps=(1, 2, 3), **options):
    state = {"model": torch.nn.Linear(4, 4)}
    with CheckpointManager(
        directory, SavePolicy(every_n_steps=1), preemption_signals=(), **options
    ) as manager:
        for step in steps:
            manager.save(step, state)
        manager.wait_for_uploads()
    return directory


def _status(capsys, *argv):
    code = main(["status", *argv, "--json"])
    return code, json.loads(capsys.readouterr().out)


def _age_by(run, seconds):
    """Make every checkpoint and event ``seconds`` older, as if the job had stalled."""
    for marker in run.glob(f"step-*/{MARKER_NAME}"):
        old = marker.stat().st_mtime - seconds
        os.utime(marker, (old, old))
    log = run / "events.jsonl"
    events = [json.loads(line) for line in log.read_text().splitlines()]
    log.write_text("".join(json.dumps({**e, "time": e["time"] - seconds}) + "\n" for e in events))


def test_a_fresh_run_is_healthy_with_its_newest_step_and_last_save(tmp_path, capsys):
    run = _run(tmp_path / "run", retention=RetentionPolicy(keep_last=2))
    code, doc = _status(capsys, str(run), "--max-age", "30m")
    assert code == 0 and doc["healthy"] and doc["problems"] == []
    assert doc["tiers"]["local"]["step"] == 3 and doc["tiers"]["local"]["age_seconds"] < 60
    assert doc["newest"]["step"] == 3 and doc["tiers"]["remote"] is None
    assert doc["pending_uploads"] == [] and doc["set_aside"] == [] and doc["rollbacks"] == []
    assert doc["last_save"]["step"] == 3 and doc["last_save"]["blocked_seconds"] >= 0
    assert doc["retention"] == {"committed": [2, 3], "pruned": [], "uncommitted": [], "deleted": 1}
    assert main(["status", str(run)]) == 0
    out = capsys.readouterr().out
    assert "healthy" in out and "last save: step 3" in out


def test_max_age_exits_1_on_a_stale_run(tmp_path, capsys):
    run = _run(tmp_path / "run")
    _age_by(run, 3600)
    code, doc = _status(capsys, str(run), "--max-age", "30m")
    assert code == 1 and not doc["healthy"]
    assert "over --max-age" in doc["problems"][0]
    assert 3590 < doc["newest"]["age_seconds"] < 3700
    assert main(["status", str(run), "--max-age", "2h"]) == 0  # an hour is within two
    assert main(["status", str(run)]) == 0  # no --max-age: only reported
    assert main(["status", str(run), "--max-age", "1800"]) == 1
    assert main(["status", str(run), "--max-age", "59m"]) == 1
    assert "over --max-age 30m 0s" in capsys.readouterr().out


def test_the_age_is_the_directorys_marker_not_only_the_log(tmp_path, capsys):
    run = _run(tmp_path / "run")
    (run / "events.jsonl").unlink()  # a read-only disk kept no log: markers still tell
    for marker in run.glob(f"step-*/{MARKER_NAME}"):
        os.utime(marker, (time.time() - 7200,) * 2)
    code, doc = _status(capsys, str(run), "--max-age", "1h")
    assert code == 1 and doc["tiers"]["local"]["step"] == 3 and doc["last_save"] is None
    assert "over --max-age" in doc["problems"][0] and doc["newest"]["age_seconds"] > 7000


def test_a_run_without_any_checkpoint_is_unhealthy(tmp_path, capsys):
    (tmp_path / "run").mkdir()
    code, doc = _status(capsys, str(tmp_path / "run"))
    assert code == 1 and doc["problems"] == ["no checkpoint on disk (local or remote)"]


def test_bad_input_exits_2_with_the_path_named(tmp_path, capsys):
    assert main(["status", str(tmp_path / "missing")]) == 2
    assert "missing: no such directory" in capsys.readouterr().err
    run = _run(tmp_path / "run", steps=(1,))
    assert main(["status", str(run / "step-000000001")]) == 2  # a checkpoint, not a run
    assert "not a CheckpointManager directory" in capsys.readouterr().err
    assert main(["status", str(run), "--max-age", "soon"]) == 2
    assert "--max-age 'soon'" in capsys.readouterr().err


@pytest.mark.parametrize(
    "text, seconds",
    [("90", 90), ("90s", 90), ("30m", 1800), ("2h", 7200), ("1.5d", 129600), ("0", 0)],
)
def test_max_age_accepts_seconds_and_units(text, seconds):
    assert parse_duration(text) == seconds


@pytest.mark.parametrize("text", ["", "m", "-5m", "2w", "nan", "inf"])
def test_max_age_refuses_what_is_not_a_duration(text):
    with pytest.raises(ValueError, match="--max-age"):
        parse_duration(text)


def test_set_aside_steps_failures_since_the_last_save_and_rollbacks(tmp_path, capsys):
    run = _run(tmp_path / "run", steps=(1, 2, 3, 4))
    os.rename(run / "step-000000004", run / "step-000000004.rolled-back-1")
    os.rename(run / "step-000000003", run / "step-000000003.unusable-2")
    now = time.time()
    log = run / "events.jsonl"
    earlier = {"event": "delete_failed", "time": now - 60, "path": "x", "error": "read-only"}
    log.write_text(json.dumps(earlier) + "\n" + log.read_text())  # before the last save
    with open(log, "a") as log:
        for event in (
            {"event": "rollback", "to_step": 2, "skip_batches": 40, "reason": "spike"},
            {"event": "save_refused", "step": 3, "reason": "nan", "tensor": "'w' on rank 0"},
            {"event": "save_refused", "step": 3, "reason": "nan"},
            {"event": "upload_failed", "step": 2, "error": "store down"},
        ):
            log.write(json.dumps({**event, "time": now}) + "\n")
    code, doc = _status(capsys, str(run))
    assert code == 0 and doc["tiers"]["local"]["step"] == 2
    assert [(a["step"], a["why"]) for a in doc["set_aside"]] == [
        (3, "unusable"),
        (4, "rolled-back"),
    ]
    assert doc["failures_since_last_save"] == {
        "save_refused": {"count": 2, "last_error": "nan"},
        "upload_failed": {"count": 1, "last_error": "store down"},
    }
    assert doc["failures"] == {"delete_failed": 1, "save_refused": 2, "upload_failed": 1}
    assert [r["to_step"] for r in doc["rollbacks"]] == [2]
    assert doc["retention"]["committed"] == [2]  # 1 deleted (keep_last=3), 3 and 4 set aside
    assert doc["pending_uploads"] == [2]  # an upload was tried, none succeeded
    assert main(["status", str(run)]) == 0
    out = capsys.readouterr().out
    assert "set aside step 4 (rolled-back)" in out and "save_refused x2" in out
    assert "rollback to step 2 (skip 40 batches): spike" in out


def test_remote_tier_and_pending_uploads_from_a_real_tiered_run(tmp_path, capsys):
    remote = tmp_path / "remote"
    run = _run(
        tmp_path / "run", steps=(1, 2), remote=RemoteTier(str(remote), RetentionPolicy(None))
    )
    code, doc = _status(capsys, str(run), "--tier", "remote", "--max-age", "10m")
    assert code == 0 and doc["tiers"]["remote"]["step"] == 2 and doc["pending_uploads"] == []
    _run(run, steps=(3,))  # saved without the remote tier: not uploaded
    code, doc = _status(capsys, str(run), "--tier", "remote")
    assert code == 0 and doc["pending_uploads"] == [3] and doc["tiers"]["remote"]["step"] == 2
    _age_by(run, 3600)
    assert main(["status", str(run), "--tier", "remote", "--max-age", "30m"]) == 1
    assert main(["status", str(run), "--tier", "memory"]) == 1  # no memory tier in this run


def test_odd_events_in_the_log_are_read_defensively(tmp_path, capsys):
    run = _run(tmp_path / "run", steps=(1,))
    with open(run / "events.jsonl", "a") as log:
        log.write(json.dumps({"event": "save", "step": 2, "time": "yesterday"}) + "\n")
        log.write(json.dumps({"event": "rollback", "time": 1.0}) + "\n")  # no fields
    code, doc = _status(capsys, str(run), "--max-age", "1h")
    assert code == 0 and doc["newest"]["step"] == 1
    assert doc["last_save"]["step"] == 2 and doc["last_save"]["age_seconds"] == 0
    assert main(["status", str(run)]) == 0
    assert "rollback to step ? (skip 0 batches)" in capsys.readouterr().out


def test_the_last_restore_says_its_tier_and_which_ranks_were_rebuilt(tmp_path, capsys):
    run = _run(tmp_path / "run")
    now = time.time()
    with open(run / "events.jsonl", "a") as log:
        for event in (
            {"event": "restore", "step": 2, "path": str(run / "step-000000002")},
            {"event": "restore", "step": 3, "tier": "memory", "ranks_rebuilt": [1, 4]},
        ):
            log.write(json.dumps({**event, "time": now}) + "\n")
    code, doc = _status(capsys, str(run))
    assert code == 0
    assert doc["last_restore"]["step"] == 3 and doc["last_restore"]["tier"] == "memory"
    assert doc["last_restore"]["ranks_rebuilt"] == [1, 4]
    assert doc["last_restore"]["ranks_from_buddies"] == []
    assert main(["status", str(run)]) == 0
    out = capsys.readouterr().out
    assert "last restore: step 3 from memory, ranks rebuilt from parity [1, 4]" in out


def test_a_run_never_restored_has_no_last_restore(tmp_path, capsys):
    _, doc = _status(capsys, str(_run(tmp_path / "run")))
    assert doc["last_restore"] is None
