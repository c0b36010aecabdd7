"""Rollback after a loss spike, explicit older restores, and NaN never checkpointed."""

from __future__ import annotations

import json
import os
import time
import uuid
import warnings

import boto3
import pytest
import torch
from distributed import run_ranks
from s3_server import start_moto

from shardpoint import (
    CheckpointManager,
    MemoryTierOptions,
    NaNStateError,
    RemoteTier,
    ResumableLoader,
    RetentionPolicy,
    SavePolicy,
    TrainState,
)
from shardpoint.cli import main as cli
from shardpoint.nan_check import first_nan
from shardpoint.training.rollback import read_rollbacks


def _job(seed: int = 0, world: int = 1, rank: int = 0):
    """A small regression job whose samples 28..35 are poisoned (a loss spike)."""
    torch.manual_seed(seed)
    model = torch.nn.Linear(4, 1)
    opt = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
    g = torch.Generator().manual_seed(1)
    xs = torch.randn(64, 4, generator=g)
    ys = xs.sum(1, keepdim=True)
    ys[28:36] = 1e4
    data = [(x, y) for x, y in zip(xs, ys)]
    loader = ResumableLoader(data, batch_size=2, seed=3, shuffle=False, rank=rank, world_size=world)
    return model, opt, loader, TrainState(model=model, optimizer=opt, dataloader=loader)


def _train(model, opt, loader, state, steps: int, manager=None, start: int = 0) -> dict[int, str]:
    losses: dict[int, str] = {}
    step = start
    batches = iter(loader)
    while step < steps:  # takes no batch beyond the last step (the loader's cursor)
        try:
            x, y = next(batches)
        except StopIteration:  # the next epoch
            batches = iter(loader)
            continue
        step += 1
        loss = torch.nn.functional.mse_loss(model(x), y)
        opt.zero_grad()
        loss.backward()
        if torch.distributed.is_initialized():
            for p in model.parameters():
                torch.distributed.all_reduce(p.grad)
                p.grad /= torch.distributed.get_world_size()
        opt.step()
        state.step = step
        losses[step] = loss.item().hex()
        if manager is not None:
            manager.maybe_save(step, state)
    return losses


def _weights(model) -> list[str]:
    return [t.detach().numpy().tobytes().hex() for t in model.state_dict().values()]


def _reference(skip_after: int, skip: int, steps: int, world: int = 1, rank: int = 0):
    """The run that never saw the skipped batches."""
    model, opt, loader, state = _job(world=world, rank=rank)
    losses = _train(model, opt, loader, state, skip_after)
    loader.skip_batches(skip)
    losses.update(_train(model, opt, loader, state, steps, start=skip_after))
    return losses, _weights(model)


def test_a_rollback_with_skipped_batches_resumes_as_a_run_that_never_saw_them(tmp_path):
    model, opt, loader, state = _job()
    manager = CheckpointManager(
        tmp_path / "run", SavePolicy(every_n_steps=2), RetentionPolicy(None)
    )
    losses = _train(model, opt, loader, state, 18, manager)
    assert float.fromhex(losses[15]) > 1e6  # the spike: steps 15-18 read samples 28-35
    with pytest.warns(UserWarning, match="rollback went back past"):
        manager.rollback(14, skip_batches=4, reason="loss spike at 15")
    assert manager.restore(state) == 14
    resumed = _train(model, opt, loader, state, 24, manager, start=14)
    expected, weights = _reference(14, 4, 24)
    assert resumed == {s: expected[s] for s in range(15, 25)}
    assert _weights(model) == weights
    names = sorted(p.name for p in (tmp_path / "run").iterdir() if "rolled-back" in p.name)
    assert names == [f"step-{s:09d}.rolled-back-1" for s in (16, 18)]
    events = [e for e in manager.events.read() if e["event"] == "rollback"]
    assert events[0]["to_step"] == 14 and events[0]["reason"] == "loss spike at 15"
    manager.close()


def test_the_same_rollback_asked_again_after_a_requeue_changes_nothing(tmp_path):
    run = tmp_path / "run"
    model, opt, loader, state = _job()
    manager = CheckpointManager(run, SavePolicy(every_n_steps=2), RetentionPolicy(None))
    _train(model, opt, loader, state, 18, manager)
    with pytest.warns(UserWarning):
        manager.rollback(14, skip_batches=4, reason="spike")
    manager.restore(state)
    _train(model, opt, loader, state, 20, manager, start=14)  # saves 16, 18, 20 anew
    manager.close()
    # The requeued job script asks for the same rollback at its start.
    model, opt, loader, state = _job()
    again = CheckpointManager(run, SavePolicy(every_n_steps=2), RetentionPolicy(None))
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # nothing is moved aside this time
        again.rollback(14, skip_batches=4, reason="spike")
    assert again.steps()[-3:] == [16, 18, 20]
    assert again.restore(state) == 20
    assert len(read_rollbacks(again.tier.storage)) == 1
    # Batches are skipped only on a restore of the rollback's own step.
    assert loader.state_dict()["cursor"] == 2 * (20 + 4)
    again.close()


def test_the_command_line_rollback_is_applied_by_the_next_start_and_survives_requeues(tmp_path):
    run = tmp_path / "run"
    model, opt, loader, state = _job()
    manager = CheckpointManager(run, SavePolicy(every_n_steps=2), RetentionPolicy(None))
    _train(model, opt, loader, state, 18, manager)
    manager.close()
    assert cli(["rollback", str(run), "--to", "14", "--skip-batches", "4"]) == 0
    assert cli(["rollback", str(run), "--to", "14", "--skip-batches", "4"]) == 0  # once only
    assert len(read_rollbacks(CheckpointManager(run).tier.storage)) == 1
    for _attempt in range(2):  # a crash before the first save after the rollback
        model, opt, loader, state = _job()
        job = CheckpointManager(run, SavePolicy(every_n_steps=2), RetentionPolicy(None))
        assert job.restore(state) == 14
        assert loader.state_dict()["cursor"] == 2 * (14 + 4)
        job.close()
    resumed = _train(model, opt, loader, state, 20, job, start=14)
    job.close()
    expected, _ = _reference(14, 4, 20)
    assert resumed == {s: expected[s] for s in range(15, 21)}
    model, opt, loader, state = _job()
    later = CheckpointManager(run, SavePolicy(every_n_steps=2), RetentionPolicy(None))
    assert later.restore(state) == 20  # the resumed run's own saves are kept
    later.close()


def test_the_command_line_refuses_a_step_that_is_not_committed(tmp_path, capsys):
    run = tmp_path / "run"
    manager = CheckpointManager(run, SavePolicy(every_n_steps=2))
    manager.save(2, {"w": torch.ones(2)})
    manager.close()
    assert cli(["rollback", str(run), "--to", "3"]) == 2
    assert "no committed checkpoint of step 3" in capsys.readouterr().err
    assert cli(["rollback", str(tmp_path / "missing"), "--to", "2"]) == 2
    assert not (run / "rollbacks.json").exists()


def test_a_rollback_drops_newer_memory_copies_written_before_it(tmp_path, monkeypatch):
    monkeypatch.setenv("SHARDPOINT_SHM_DIR", str(tmp_path / "shm"))
    run = tmp_path / "run"
    options = dict(memory=MemoryTierOptions(every_n_steps=1))
    model, opt, loader, state = _job()
    manager = CheckpointManager(run, SavePolicy(every_n_steps=4), **options)
    _train(model, opt, loader, state, 10, manager)  # memory holds step 10, disk 4 and 8
    manager.close()
    assert cli(["rollback", str(run), "--to", "4"]) == 0
    model, opt, loader, state = _job()
    job = CheckpointManager(run, SavePolicy(every_n_steps=4), **options)
    assert job.restore(state) == 4  # not the memory copy of step 10
    _train(model, opt, loader, state, 6, job, start=4)
    job.close()
    model, opt, loader, state = _job()
    job = CheckpointManager(run, SavePolicy(every_n_steps=4), **options)
    assert job.restore(state) == 6  # a memory copy written after the rollback is used
    job.close(release_memory=True)


def test_restoring_an_explicit_older_step_lets_later_saves_and_retention_proceed(tmp_path):
    run = tmp_path / "run"
    model, opt, loader, state = _job()
    manager = CheckpointManager(run, SavePolicy(every_n_steps=2), RetentionPolicy(keep_last=2))
    _train(model, opt, loader, state, 10, manager)
    assert manager.steps() == [8, 10]
    manager.close()
    model, opt, loader, state = _job()
    job = CheckpointManager(run, SavePolicy(every_n_steps=2), RetentionPolicy(keep_last=2))
    assert job.restore(state, step=8) == 8
    with pytest.warns(UserWarning, match="an older checkpoint was restored"):
        resumed = _train(model, opt, loader, state, 12, job, start=8)
    assert job.steps() == [10, 12]  # step 10 saved anew, not skipped as committed
    assert (run / "step-000000010.superseded-1").is_dir()
    expected, weights = _reference(12, 0, 12)
    assert resumed == {s: expected[s] for s in range(9, 13)}
    assert _weights(model) == weights
    job.close()


@pytest.fixture(scope="module")
def moto_endpoint():
    server, endpoint = start_moto()
    yield endpoint
    server.stop()


def test_a_rollback_sets_aside_the_remote_copies_too_keeping_their_bytes(
    tmp_path, moto_endpoint, monkeypatch
):
    for k, v in {
        "AWS_ACCESS_KEY_ID": "testing",
        "AWS_SECRET_ACCESS_KEY": "testing",
        "AWS_REGION": "us-east-1",
        "AWS_ENDPOINT_URL": moto_endpoint,
    }.items():
        monkeypatch.setenv(k, v)
    bucket = f"t{uuid.uuid4().hex[:16]}"
    boto3.client("s3").create_bucket(Bucket=bucket)
    url = f"s3://{bucket}/run"
    remote = RemoteTier(url, retention=RetentionPolicy(None))
    model, opt, loader, state = _job()
    manager = CheckpointManager(tmp_path / "run", SavePolicy(every_n_steps=2), remote=remote)
    _train(model, opt, loader, state, 2, manager)
    manager.wait_for_uploads()
    _train(model, opt, loader, state, 8, manager, start=2)
    manager.wait_for_uploads()
    newer = [s for s in manager.remote_steps() if s > 2]
    assert 8 in newer  # the uploader sends the newest step; ones it passed over are not there
    with pytest.warns(UserWarning):
        manager.rollback(2)
    assert manager.remote_steps() == [2]
    manager.close()
    listing = boto3.client("s3").list_objects_v2(Bucket=bucket, Prefix="run/")["Contents"]
    aside = {o["Key"].split("/")[1] for o in listing if "rolled-back" in o["Key"]}
    assert aside == {f"step-{s:09d}.rolled-back-1" for s in newer}
    assert cli(["verify", f"{url}/step-000000008.rolled-back-1"]) == 0
    # A new machine, with only the remote: the record is there too.
    model, opt, loader, state = _job()
    fresh = CheckpointManager(tmp_path / "elsewhere", remote=remote)
    assert [r.to_step for r in fresh.rollbacks] == [2]
    assert fresh.restore(state) == 2
    fresh.close()


# ---- NaN ------------------------------------------------------------------------------


def test_first_nan_names_the_tensor_and_ignores_infinities():
    assert first_nan({"mask": torch.tensor([0.0, float("-inf")]), "n": torch.arange(3)}) is None
    bad = torch.zeros(3, dtype=torch.bfloat16)
    bad[1] = float("nan")
    assert first_nan({"a": {"b": torch.ones(2), "c": bad}}) == "a.c"
    assert first_nan({"z": torch.tensor([complex(0, float("nan"))])}) == "z"
    assert first_nan({"f8": torch.tensor([float("nan")]).to(torch.float8_e4m3fn)}) == "f8"


def test_a_state_with_nan_is_never_committed_and_the_good_checkpoints_stay(tmp_path):
    run = tmp_path / "run"
    model, opt, loader, state = _job()
    manager = CheckpointManager(run, SavePolicy(every_n_steps=2), RetentionPolicy(keep_last=1))
    _train(model, opt, loader, state, 4, manager)
    with torch.no_grad():
        model.weight[0, 1] = float("nan")
    with pytest.raises(NaNStateError, match=r"step 6 not saved: NaN in 'model.weight' on rank 0"):
        _train(model, opt, loader, state, 6, manager, start=4)
    assert manager.steps() == [4]
    assert not (run / "step-000000006").exists()
    refused = [e for e in manager.events.read() if e["event"] == "save_refused"]
    assert refused[0]["step"] == 6 and "model.weight" in refused[0]["tensor"]
    with pytest.raises(NaNStateError):  # a forced (preemption) save is refused alike
        manager.save(7, state, force=True)
    allowed = CheckpointManager(tmp_path / "other", SavePolicy(refuse_nan=False))
    assert allowed.save(6, state, force=True) is not None  # the user's explicit choice
    manager.close()


def _nan_on_one_rank(rank: int, world: int, root: str) -> None:
    os.environ["LOCAL_WORLD_SIZE"] = "1"  # one rank per "node": buddies on the other
    model, opt, loader, state = _job(world=world, rank=rank)
    manager = CheckpointManager(
        root,
        SavePolicy(every_n_steps=2),
        memory=MemoryTierOptions(every_n_steps=1),
    )
    _train(model, opt, loader, state, 4, manager)
    if rank == 1:
        with torch.no_grad():
            model.bias[0] = float("nan")
    with pytest.raises(NaNStateError, match="'model.bias' on rank 1"):
        manager.maybe_save(5, state)  # the memory tier's step: refused on both ranks
    with pytest.raises(NaNStateError, match="'model.bias' on rank 1"):
        manager.maybe_save(6, state)
    assert manager.steps() == [2, 4]
    manager.close(release_memory=True)
    if rank == 0:
        events = [json.loads(line) for line in open(os.path.join(root, "events.jsonl"))]
        assert [e["step"] for e in events if e["event"] == "save_refused"] == [5, 6]
        assert max(e["step"] for e in events if e["event"] == "memory_save") == 4


@pytest.mark.slow
def test_nan_on_one_rank_is_refused_on_every_rank_and_no_tier_takes_it(tmp_path, monkeypatch):
    monkeypatch.setenv("SHARDPOINT_SHM_DIR", str(tmp_path / "shm"))
    run_ranks(2, _nan_on_one_rank, str(tmp_path / "run"))


def _spike_and_roll_back(rank: int, world: int, root: str, out: str) -> None:
    model, opt, loader, state = _job(world=world, rank=rank)
    manager = CheckpointManager(root, SavePolicy(every_n_steps=2), RetentionPolicy(None))
    losses = _train(model, opt, loader, state, 9, manager)
    assert float.fromhex(losses[8]) > 1e6  # 2 ranks x 2 samples: samples 28-31 at step 8
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        manager.rollback(6, skip_batches=3, reason="spike")
        manager.rollback(6, skip_batches=3, reason="spike")  # the same request: one
    manager.close()
    # The job is requeued: a new process start runs the same script again.
    model, opt, loader, state = _job(world=world, rank=rank)
    job = CheckpointManager(root, SavePolicy(every_n_steps=2), RetentionPolicy(None))
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        job.rollback(6, skip_batches=3, reason="spike")
    assert job.restore(state) == 6
    resumed = _train(model, opt, loader, state, 14, job, start=6)
    job.close()
    expected, weights = _reference(6, 3, 14, world, rank)
    assert resumed == {s: expected[s] for s in range(7, 15)}
    assert _weights(model) == weights
    with open(os.path.join(out, f"rank{rank}.json"), "w") as f:
        json.dump(resumed, f)


@pytest.mark.slow
def test_two_ranks_roll_back_past_a_spike_and_end_as_a_run_that_skipped_its_batches(tmp_path):
    out = tmp_path / "out"
    out.mkdir()
    start = time.monotonic()
    run_ranks(2, _spike_and_roll_back, str(tmp_path / "run"), str(out))
    assert time.monotonic() - start < 120
    aside = sorted(p.name for p in (tmp_path / "run").iterdir() if "rolled-back" in p.name)
    assert aside == ["step-000000008.rolled-back-1"]
    assert len(list(out.iterdir())) == 2
