"""A training run killed at any point and resumed continues bit for bit.

The run is examples/train_char_lm.py: a transformer with dropout, AdamW with a
warmup/cosine schedule, a shuffling ResumableLoader with 2 workers, checkpoints every
10 steps. A small corpus makes an epoch 19 steps, so runs cross epoch boundaries.
"""

import json
import os
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import pytest
from conftest import read_losses

SCRIPT = Path(__file__).resolve().parents[1] / "examples" / "train_char_lm.py"
ARGS = ["--steps", "45", "--save-every", "10", "--corpus-bytes", "10000", "--batch-size", "16"]

pytestmark = pytest.mark.slow


def train(run_dir: Path, *extra: str) -> subprocess.CompletedProcess:
    """Run the example in its own session; output goes to files, not pipes.

    A run SIGKILLed on purpose leaves its DataLoader workers orphaned until their
    watchdog notices (minutes, seen in CI): with pipes they would hold the output open
    and stall the test, so the session's leftovers are killed when the run ends.
    """
    args = [sys.executable, str(SCRIPT), "--run-dir", str(run_dir), *ARGS, *extra]
    with tempfile.TemporaryFile() as out, tempfile.TemporaryFile() as err:
        proc = subprocess.Popen(args, stdout=out, stderr=err, start_new_session=True)
        try:
            code = proc.wait(timeout=300)
        finally:
            try:
                os.killpg(proc.pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        out.seek(0)
        err.seek(0)
        return subprocess.CompletedProcess(args, code, out.read().decode(), err.read().decode())


@pytest.fixture(scope="module")
def reference(tmp_path_factory) -> Path:
    run = tmp_path_factory.mktemp("reference")
    done = train(run)
    assert done.returncode == 0, done.stderr
    return run


@pytest.mark.parametrize(
    "crash_at, phase, resumes_from",
    [
        (7, "after-step", "starting"),  # before the first checkpoint: starts over
        (13, "after-step", "resuming from step 10"),  # mid-epoch
        (20, "after-step", "resuming from step 20"),  # right after a save
        (30, "during-save", "resuming from step 20"),  # shards written, never committed
        (19, "after-step", "resuming from step 10"),  # last step of the first epoch
        (41, "after-step", "resuming from step 40"),  # in the third epoch
    ],
)
def test_killed_run_resumes_bit_identical(tmp_path, reference, crash_at, phase, resumes_from):
    crashed = train(tmp_path, "--crash-at", str(crash_at), "--crash-phase", phase)
    assert crashed.returncode == -signal.SIGKILL, crashed.stderr
    resumed = train(tmp_path)
    assert resumed.returncode == 0, resumed.stderr
    assert resumes_from in resumed.stdout
    expected, got = read_losses(reference), read_losses(tmp_path)
    assert sorted(got) == list(range(1, 46))
    assert got == expected  # float.hex of every step's loss
    final = json.loads((tmp_path / "final.json").read_text())
    assert final == json.loads((reference / "final.json").read_text())


def test_a_frozen_base_saved_incrementally_resumes_bit_identical_after_sigkill(tmp_path):
    """Only the head trains; checkpoints refer to the frozen weights' earlier files."""
    reference = tmp_path / "reference"
    assert train(reference, "--freeze-base").returncode == 0
    crashed = tmp_path / "crashed"
    run = train(crashed, "--freeze-base", "--crash-at", "33")
    assert run.returncode == -signal.SIGKILL, run.stderr
    resumed = train(crashed, "--freeze-base")
    assert resumed.returncode == 0, resumed.stderr
    assert "resuming from step 30" in resumed.stdout
    assert read_losses(crashed) == read_losses(reference)
    final = json.loads((crashed / "final.json").read_text())
    assert final == json.loads((reference / "final.json").read_text())
    newest = json.loads((crashed / "checkpoints" / "step-000000045" / "index.json").read_text())
    assert newest["format_version"] == 3  # refers to the frozen weights written at step 40
    assert any(name.startswith("../step-000000040/") for name in newest["files"])


def test_sigterm_saves_exits_143_and_the_next_start_resumes(tmp_path, reference):
    proc = subprocess.Popen(
        [sys.executable, str(SCRIPT), "--run-dir", str(tmp_path), *ARGS],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    log = tmp_path / "losses.jsonl"
    deadline = time.monotonic() + 120
    while time.monotonic() < deadline:  # wait until training is past step 12
        if log.exists() and len(log.read_text().splitlines()) >= 12:
            break
        time.sleep(0.05)
    os.kill(proc.pid, signal.SIGTERM)
    out, err = proc.communicate(timeout=120)
    assert proc.returncode == 128 + signal.SIGTERM, err
    stopped_at = max(read_losses(tmp_path))
    assert f"preempted: saved step {stopped_at}" in out
    assert (tmp_path / "checkpoints" / f"step-{stopped_at:09d}" / "COMMITTED").exists()
    events = [
        json.loads(x) for x in (tmp_path / "checkpoints" / "events.jsonl").read_text().splitlines()
    ]
    assert any(e["event"] == "save" and e["reason"] == "preemption" for e in events)

    resumed = train(tmp_path)
    assert resumed.returncode == 0, resumed.stderr
    assert f"resuming from step {stopped_at}" in resumed.stdout
    assert read_losses(tmp_path) == read_losses(reference)


def test_the_demo_crashes_resumes_and_reports_identical_runs(tmp_path):
    demo = SCRIPT.parent / "demo.py"
    done = subprocess.run(
        [
            sys.executable,
            str(demo),
            "--dir",
            str(tmp_path),
            "--steps",
            "40",
            "--save-every",
            "10",
            "--crash-at",
            "23",
        ],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert done.returncode == 0, done.stdout + done.stderr
    assert "resuming from step 20" in done.stdout
    assert "losses bit-identical at 40 of 40 steps; final weights identical" in done.stdout
    assert (tmp_path / "loss_curves.png").stat().st_size > 10_000
