"""The Lightning integration (``shardpoint.integrations.lightning``): a fit killed with
SIGKILL and resumed with ``ckpt_path="last"`` continues bit for bit.

The run is examples/lightning_resume.py: an MLP with dropout, AdamW with a step
schedule, a torchdata ``StatefulDataLoader`` (13 batches per epoch, so the runs cross
epoch boundaries), ``ModelCheckpoint(every_n_train_steps=5, save_last=True)`` written by
``ShardpointCheckpointIO``, the random streams saved by ``ResumableRNG``.
"""

from __future__ import annotations

import json
import signal
import subprocess
import sys
from pathlib import Path

import pytest

import shardpoint

SCRIPT = Path(__file__).resolve().parents[1] / "examples" / "lightning_resume.py"

pytestmark = pytest.mark.slow


def _run(run_dir: Path, *extra: str) -> subprocess.CompletedProcess:
    args = [sys.executable, str(SCRIPT), "--run-dir", str(run_dir), "--steps", "40", *extra]
    return subprocess.run(args, capture_output=True, text=True, timeout=300)


def _losses(run_dir: Path) -> dict[int, str]:
    out = {}
    for line in (run_dir / "losses.jsonl").read_text().splitlines():
        record = json.loads(line)
        out[record["step"]] = record["loss"]  # a step run again after a resume overrides
    return out


@pytest.fixture(scope="module")
def reference(tmp_path_factory) -> Path:
    run = tmp_path_factory.mktemp("reference")
    done = _run(run)
    assert done.returncode == 0, done.stderr
    return run


@pytest.mark.parametrize("crash_at", [12, 23])  # in the first epoch; in the second
def test_a_killed_fit_resumes_bit_identical_from_last(tmp_path, reference, crash_at):
    crashed = _run(tmp_path, "--crash-at", str(crash_at))
    assert crashed.returncode == -signal.SIGKILL, crashed.stderr
    resumed = _run(tmp_path)
    assert resumed.returncode == 0, resumed.stderr
    assert "Restored all states from the checkpoint" in resumed.stdout + resumed.stderr
    assert sorted(_losses(tmp_path)) == list(range(1, 41))
    assert _losses(tmp_path) == _losses(reference)
    final = json.loads((tmp_path / "final.json").read_text())
    assert final == json.loads((reference / "final.json").read_text())
    last = tmp_path / "checkpoints" / "last.ckpt"
    assert last.is_symlink() and shardpoint.verify(last).ok  # a shardpoint checkpoint


def test_without_the_rng_callback_the_resumed_fit_differs(tmp_path, reference):
    """Lightning does not save the random streams: ResumableRNG is what makes the
    dropout masks after a resume the uninterrupted run's."""
    assert _run(tmp_path, "--without-rng", "--crash-at", "12").returncode == -signal.SIGKILL
    assert _run(tmp_path, "--without-rng").returncode == 0
    assert _losses(tmp_path) != _losses(reference)


def test_save_last_replaces_the_previous_checkpoint_and_leaves_no_other_version(reference):
    checkpoints = reference / "checkpoints"
    versions = sorted(p.name for p in checkpoints.iterdir() if p.name.startswith("last.ckpt."))
    assert len(versions) == 1  # the previous "last" was deleted after the switch
    state = shardpoint.open(checkpoints / "last.ckpt").state(tensors=False)
    assert state["global_step"] == 40 and "ResumableRNG" in state["callbacks"]
