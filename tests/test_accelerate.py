"""The Accelerate integration (``shardpoint.integrations.accelerate``): a loop saving
``accelerator_state(...)`` through a ``CheckpointManager``, killed with SIGKILL or
preempted with SIGTERM and started again, continues bit for bit, in one process and on
2 DDP ranks.

The run is examples/accelerate_resume.py: an MLP with dropout, AdamW with a step
schedule, Accelerate's stateful data loader (25 batches per epoch), a checkpoint every
5 steps.
"""

from __future__ import annotations

import json
import signal
import subprocess
from pathlib import Path

import pytest
import torch
from example_runs import losses, run_example, steps_run

import shardpoint

pytestmark = pytest.mark.slow


def _run(run_dir: Path, *extra: str, ranks: int = 1) -> subprocess.CompletedProcess:
    return run_example("accelerate_resume.py", run_dir, *extra, ranks=ranks)


def _final(run_dir: Path) -> dict:
    return json.loads((run_dir / "final.json").read_text())


@pytest.fixture(scope="module")
def reference(tmp_path_factory) -> Path:
    run = tmp_path_factory.mktemp("reference")
    done = _run(run)
    assert done.returncode == 0, done.stderr
    return run


@pytest.mark.parametrize("crash_at", [23, 31])  # in the first epoch; in the second
def test_a_killed_loop_resumes_bit_identical(tmp_path, reference, crash_at):
    assert _run(tmp_path, "--crash-at", str(crash_at)).returncode == -signal.SIGKILL
    resumed = _run(tmp_path)
    assert resumed.returncode == 0, resumed.stderr
    newest = crash_at - crash_at % 5
    assert steps_run(tmp_path)[crash_at] == newest + 1  # resumed after the newest save
    assert losses(tmp_path) == losses(reference)
    assert _final(tmp_path) == _final(reference)


def test_sigterm_saves_at_once_and_the_loop_resumes_without_repeating_a_step(tmp_path, reference):
    preempted = _run(tmp_path, "--sigterm-at", "17")
    assert preempted.returncode == 143, preempted.stderr
    assert (tmp_path / "checkpoints" / "step-000000017").is_dir()
    assert _run(tmp_path).returncode == 0
    assert steps_run(tmp_path) == list(range(1, 41))
    assert losses(tmp_path) == losses(reference)
    assert _final(tmp_path) == _final(reference)


def test_two_ddp_ranks_killed_and_resumed_continue_bit_identical(tmp_path_factory):
    ref, run = tmp_path_factory.mktemp("ddp-ref"), tmp_path_factory.mktemp("ddp")
    done = _run(ref, ranks=2)
    assert done.returncode == 0, done.stderr
    assert _run(run, "--crash-at", "23", ranks=2).returncode != 0
    resumed = _run(run, ranks=2)
    assert resumed.returncode == 0, resumed.stderr
    for rank in (0, 1):
        assert losses(run, rank) == losses(ref, rank)
    assert losses(ref, 0) != losses(ref, 1)
    assert _final(run) == _final(ref)


def test_the_state_holds_what_save_state_saves_and_refuses_two_models(tmp_path):
    from accelerate import Accelerator

    from shardpoint.integrations.accelerate import accelerator_state, load_state, save_state

    accelerator = Accelerator(cpu=True)
    model = torch.nn.Linear(4, 2)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    scheduler = torch.optim.lr_scheduler.StepLR(optimizer, 3)
    model, optimizer, scheduler = accelerator.prepare(model, optimizer, scheduler)
    accelerator.register_for_checkpointing(counter := _Counter(5))
    accelerator.step = 7
    save_state(accelerator, tmp_path / "ckpt")
    with torch.no_grad():
        model.weight.zero_()
    counter.n, accelerator.step = 0, 0
    scheduler.step()
    load_state(accelerator, tmp_path / "ckpt")
    stored = shardpoint.open(tmp_path / "ckpt").state()
    assert torch.equal(model.weight, stored["train"]["model"]["weight"])
    assert counter.n == 5 and accelerator.step == 7 and scheduler.scheduler.last_epoch == 0

    # A plain (not stateful) prepared loader: its position is the loop's business.
    accelerator.prepare(torch.utils.data.DataLoader(torch.zeros(4, 2), batch_size=2))
    assert accelerator_state(accelerator)["dataloaders"] == {}

    accelerator.prepare(torch.nn.Linear(2, 2))
    with pytest.raises(ValueError, match="one prepared model"):
        accelerator_state(accelerator)


def test_what_accelerate_would_save_beyond_the_objects_is_refused_not_dropped(tmp_path):
    """State pre-hooks (an EMA model saved beside, say) are not run by shardpoint: an
    error; Accelerate's own checkpoint naming and deletion do not apply: a warning."""
    from accelerate import Accelerator
    from accelerate.utils import ProjectConfiguration

    from shardpoint.integrations.accelerate import accelerator_state

    accelerator = Accelerator(cpu=True)
    accelerator.prepare(torch.nn.Linear(4, 2))
    handle = accelerator.register_save_state_pre_hook(lambda models, weights, folder: None)
    with pytest.raises(ValueError, match="pre-hooks"):
        accelerator_state(accelerator)
    handle.remove()
    accelerator_state(accelerator)
    naming = ProjectConfiguration(
        project_dir=str(tmp_path), automatic_checkpoint_naming=True, total_limit=2
    )
    with pytest.warns(UserWarning, match="automatic_checkpoint_naming"):
        accelerator_state(Accelerator(cpu=True, project_config=naming))


class _Counter:
    def __init__(self, n: int) -> None:
        self.n = n

    def state_dict(self) -> dict:
        return {"n": self.n}

    def load_state_dict(self, state: dict) -> None:
        self.n = state["n"]
