"""The Lightning integration (``shardpoint.integrations.lightning``): a fit killed with
SIGKILL and resumed with ``ckpt_path="last"`` continues bit for bit.

The run is examples/lightning_resume.py: an MLP with dropout, AdamW with a step
schedule, a torchdata ``StatefulDataLoader`` (13 batches per epoch, so the runs cross
epoch boundaries), ``ModelCheckpoint(every_n_train_steps=5, save_last=True)`` written by
``ShardpointCheckpointIO``, the random streams saved by ``ResumableRNG``.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
from pathlib import Path

import pytest
import torch
from example_runs import losses, run_example, steps_run

import shardpoint

pytestmark = pytest.mark.slow


def _run(run_dir: Path, *extra: str) -> subprocess.CompletedProcess:
    return run_example("lightning_resume.py", run_dir, *extra)


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
    assert sorted(losses(tmp_path)) == list(range(1, 41))
    assert losses(tmp_path) == losses(reference)
    final = json.loads((tmp_path / "final.json").read_text())
    assert final == json.loads((reference / "final.json").read_text())
    last = tmp_path / "checkpoints" / "last.ckpt"
    assert last.is_symlink() and shardpoint.verify(last).ok  # a shardpoint checkpoint


def test_without_the_rng_callback_the_resumed_fit_differs(tmp_path, reference):
    """Lightning does not save the random streams: ResumableRNG is what makes the
    dropout masks after a resume the uninterrupted run's."""
    assert _run(tmp_path, "--without-rng", "--crash-at", "12").returncode == -signal.SIGKILL
    assert _run(tmp_path, "--without-rng").returncode == 0
    assert losses(tmp_path) != losses(reference)


def test_save_last_replaces_the_previous_checkpoint_and_leaves_no_other_version(reference):
    checkpoints = reference / "checkpoints"
    versions = sorted(p.name for p in checkpoints.iterdir() if p.name.startswith("last.ckpt."))
    assert len(versions) == 1  # the previous "last" was deleted after the switch
    state = shardpoint.open(checkpoints / "last.ckpt").state(tensors=False)
    assert state["global_step"] == 40 and "ResumableRNG" in state["callbacks"]


def test_sigterm_saves_last_at_once_exits_143_and_resumes_exactly(tmp_path, reference):
    """Lightning alone stops on SIGTERM without saving and exits with 0."""
    preempted = _run(tmp_path, "--sigterm-at", "17")
    assert preempted.returncode == 143, preempted.stderr
    last = tmp_path / "checkpoints" / "last.ckpt"
    assert shardpoint.open(last).state(tensors=False)["global_step"] == 17
    assert _run(tmp_path).returncode == 0
    assert steps_run(tmp_path) == list(range(1, 41))  # nothing lost, nothing run twice
    assert losses(tmp_path) == losses(reference)


def _torchrun(run_dir: Path, *extra: str) -> subprocess.CompletedProcess:
    return run_example("lightning_resume.py", run_dir, *extra, ranks=2)


def test_two_ddp_ranks_killed_and_resumed_continue_bit_identical(tmp_path_factory):
    """Rank 0 writes Lightning's checkpoint: ResumableRNG puts every rank's streams in
    it (the ranks are seeded differently), and each rank gets its own back."""
    ref, run = tmp_path_factory.mktemp("ddp-ref"), tmp_path_factory.mktemp("ddp")
    done = _torchrun(ref)
    assert done.returncode == 0, done.stderr
    assert _torchrun(run, "--crash-at", "23").returncode != 0
    resumed = _torchrun(run)
    assert resumed.returncode == 0, resumed.stderr
    for rank in (0, 1):
        assert losses(run, rank) == losses(ref, rank)
    assert json.loads((run / "final.json").read_text()) == json.loads(
        (ref / "final.json").read_text()
    )
    stored = shardpoint.open(run / "checkpoints" / "last.ckpt").state(tensors=False)
    assert sorted(stored["callbacks"]["ResumableRNG"]["streams"]) == [0, 1]


def test_async_saves_resume_bit_identical_and_clear_a_crashed_saves_leftover(tmp_path, reference):
    """``ShardpointCheckpointIO(async_save=True)``: the state is copied before training
    goes on, so what is written is the step's; a version directory a crash left
    unfinished is removed by the next save."""
    assert _run(tmp_path, "--async-save", "--crash-at", "23").returncode == -signal.SIGKILL
    leftover = tmp_path / "checkpoints" / "last.ckpt.9"  # as a save killed halfway leaves
    leftover.mkdir()
    (leftover / "rank00000-00000.safetensors").write_bytes(b"partial")
    resumed = _run(tmp_path, "--async-save")
    assert resumed.returncode == 0, resumed.stderr
    assert losses(tmp_path) == losses(reference)
    assert json.loads((tmp_path / "final.json").read_text()) == json.loads(
        (reference / "final.json").read_text()
    )
    versions = [p.name for p in (tmp_path / "checkpoints").iterdir() if ".ckpt." in p.name]
    assert not leftover.exists() and len([v for v in versions if v.startswith("last")]) == 1


def test_fsdp2_ranks_write_their_own_shards_and_resume_bit_identical(tmp_path_factory):
    """``ShardpointModelParallelStrategy``: FSDP2 (``fully_shard``) on 2 ranks, each
    writing its own shards of parameters and Adam moments; killed and resumed."""
    ref, run = tmp_path_factory.mktemp("fsdp-ref"), tmp_path_factory.mktemp("fsdp")
    done = _torchrun(ref, "--fsdp")
    assert done.returncode == 0, done.stderr
    assert _torchrun(run, "--fsdp", "--crash-at", "23").returncode != 0
    resumed = _torchrun(run, "--fsdp")
    assert resumed.returncode == 0, resumed.stderr
    for rank in (0, 1):
        assert losses(run, rank) == losses(ref, rank)
    assert json.loads((run / "final.json").read_text()) == json.loads(
        (ref / "final.json").read_text()
    )
    with shardpoint.open(run / "checkpoints" / "last.ckpt") as reader:
        for name in ("model.model.net.3.weight", "model.optimizer.state.net.3.weight.exp_avg"):
            files = {c.file[:9] for c in reader.entry(name).chunks}
            assert files == {"rank00000", "rank00001"}  # each rank wrote its half
        assert reader.state(tensors=False)["lightning"]["ranks"].keys() == {0, 1}


def test_a_link_lightning_made_is_replaced_or_removed_and_its_target_kept(tmp_path):
    """``ModelCheckpoint(save_last="link")`` makes ``last.ckpt`` a link to a top-k
    checkpoint: saving or removing ``last.ckpt`` must not delete that checkpoint."""
    import torch

    from shardpoint.integrations.lightning import ShardpointCheckpointIO

    io = ShardpointCheckpointIO()
    top_k = tmp_path / "epoch=0-step=5.ckpt"
    io.save_checkpoint({"w": torch.ones(3), "global_step": 5}, top_k)
    last = tmp_path / "last.ckpt"
    os.symlink(top_k.name, last)  # as Lightning links it
    io.save_checkpoint({"w": torch.zeros(3), "global_step": 6}, last)
    assert os.readlink(last) == "last.ckpt.0"
    assert shardpoint.verify(top_k).ok
    os.replace(last, tmp_path / "mine")
    os.symlink(top_k.name, last)
    io.remove_checkpoint(last)
    assert not last.exists() and shardpoint.verify(top_k).ok
    (tmp_path / "other.ckpt").mkdir()
    with pytest.raises(FileExistsError, match="did not write"):
        io.save_checkpoint({"w": torch.ones(1)}, tmp_path / "other.ckpt")


class _Module(torch.nn.Module):
    def __init__(self, extra: bool, strict_loading: bool) -> None:
        super().__init__()
        self.a = torch.nn.Linear(2, 2)
        if extra:
            self.b = torch.nn.Linear(2, 2)
        self.strict_loading = strict_loading


@pytest.mark.parametrize("strict_loading", [True, False])
def test_the_model_parallel_strategy_loads_as_strictly_as_the_module_asks(tmp_path, strict_loading):
    """Lightning loads with ``LightningModule.strict_loading``: a model with a layer the
    checkpoint lacks loads the rest when it is False, and is refused when it is True."""
    from shardpoint.integrations.lightning import ShardpointModelParallelStrategy, _EachRank
    from shardpoint.training.train_state import TrainState

    saved = _Module(extra=False, strict_loading=True)
    state = {
        "model": TrainState(model=saved, capture_rng_state=False),
        "lightning": _EachRank({"epoch": 3}),
    }
    shardpoint.save(state, tmp_path / "ckpt")
    strategy = ShardpointModelParallelStrategy.__new__(ShardpointModelParallelStrategy)
    strategy._lightning_module = strategy._model = _Module(True, strict_loading)
    strategy._optimizers = []
    strategy.broadcast = lambda obj, src=0: obj  # one process, no group
    if strict_loading:
        with pytest.raises(shardpoint.StateMismatchError, match="not in the checkpoint|missing"):
            strategy.load_checkpoint(tmp_path / "ckpt")
        return
    assert strategy.load_checkpoint(tmp_path / "ckpt") == {"epoch": 3}
    assert torch.equal(strategy.model.a.weight, saved.a.weight)


def test_the_checkpoint_io_refuses_storage_options_as_lightnings_own_does(tmp_path):
    from shardpoint.integrations.lightning import ShardpointCheckpointIO

    with pytest.raises(TypeError, match="storage_options"):
        ShardpointCheckpointIO().save_checkpoint({"epoch": 1}, tmp_path / "x.ckpt", {"a": 1})
    assert not (tmp_path / "x.ckpt").exists()
