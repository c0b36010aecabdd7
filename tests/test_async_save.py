"""Background saves: snapshot at return, errors never lost, bounded reusable staging."""

from __future__ import annotations

import errno
import os
import signal
import threading
from pathlib import Path

import pytest
import torch
from conftest import assert_states_equal, zeros_like_state

import shardpoint
from shardpoint import (
    AsyncSaver,
    CheckpointError,
    CheckpointManager,
    RetentionPolicy,
    SavePolicy,
    load,
    verify,
)
from shardpoint import background_save as background
from shardpoint.format.index import MARKER_NAME
from shardpoint.staging import SLOT_BYTES
from shardpoint.storage import direct_io


def _state(seed: int = 0) -> dict:
    g = torch.Generator().manual_seed(seed)
    return {
        # 40 MB in rows whose 256 KiB checksum blocks straddle 16 MiB slot boundaries
        "big": torch.randn(10_000, 1003, generator=g),
        "small": {str(i): torch.randn(17, generator=g) for i in range(50)},
        "half": torch.randn(33, 5, generator=g).half(),
        "scalar": torch.tensor(2.5),
        "empty": torch.empty(0, 3),
        "step": 11,
    }


def _mutate(state: dict) -> None:
    for v in state.values():
        if isinstance(v, dict):
            _mutate(v)
        elif isinstance(v, torch.Tensor) and v.numel():
            v.add_(1000)


def _clone(state: dict) -> dict:
    return {
        k: _clone(v) if isinstance(v, dict) else v.clone() if isinstance(v, torch.Tensor) else v
        for k, v in state.items()
    }


@pytest.mark.parametrize("pool_bytes", [None, SLOT_BYTES, 3 * SLOT_BYTES])
def test_written_values_are_the_state_when_async_save_returned(tmp_path, pool_bytes):
    saver = AsyncSaver(pool_bytes=pool_bytes)
    state = _state()
    expected = _clone(state)
    handle = saver.save(state, tmp_path / "ckpt")
    _mutate(state)  # the next optimizer step, right after the call returned
    state["step"] = 12
    info = handle.wait()
    assert info.tensors == 54 and info.blocked_seconds == handle.stall_seconds
    assert verify(tmp_path / "ckpt").ok  # every checksum, incl. blocks split across slots
    loaded = zeros_like_state(expected)
    load(loaded, tmp_path / "ckpt")
    assert_states_equal(loaded, expected)
    if pool_bytes is not None:
        assert saver.pool.nbytes <= pool_bytes  # the state (40 MB) streamed through


def test_shards_of_an_async_save_open_with_the_reference_safetensors_library(tmp_path):
    from safetensors import safe_open

    state = _state()
    shardpoint.async_save(state, tmp_path / "ckpt").wait()
    [shard] = list((tmp_path / "ckpt").glob("*.safetensors"))
    with safe_open(str(shard), "pt") as f:
        assert torch.equal(f.get_tensor("big"), state["big"])
        assert torch.equal(f.get_tensor("half"), state["half"])


def test_staging_pool_is_reused_across_saves(tmp_path):
    saver = AsyncSaver()
    saver.save(_state(), tmp_path / "a").wait()
    slots = [id(s) for s in _drain(saver.pool)]
    saver.save(_state(1), tmp_path / "b").wait()
    assert sorted(id(s) for s in _drain(saver.pool)) == sorted(slots)


def _drain(pool) -> list:  # noqa: ANN001
    slots = [pool.acquire() for _ in range(pool.nbytes // SLOT_BYTES)]
    for s in slots:
        pool.release(s)
    return slots


def _failing_writes(monkeypatch, after: int = 1) -> None:  # noqa: ANN001
    real, calls = direct_io.pwrite_all, [0]

    def pwrite_all(fd, data, offset):  # noqa: ANN001, ANN202
        calls[0] += 1
        if calls[0] > after:
            raise OSError(errno.ENOSPC, "No space left on device")
        return real(fd, data, offset)

    monkeypatch.setattr(direct_io, "pwrite_all", pwrite_all)


def test_a_background_write_error_surfaces_on_wait_and_commits_nothing(tmp_path, monkeypatch):
    saver = AsyncSaver(pool_bytes=SLOT_BYTES)
    saver.save(_state(), tmp_path / "old").wait()
    _failing_writes(monkeypatch)
    handle = saver.save(_state(1), tmp_path / "new")
    with pytest.raises(CheckpointError, match="No space left"):
        handle.wait()
    assert not (tmp_path / "new").exists()
    assert verify(tmp_path / "old").ok
    saver.close()  # the error was seen on wait(): not raised twice
    monkeypatch.undo()
    saver.save(_state(2), tmp_path / "again").wait()  # the pool lost no slot


def test_an_unobserved_background_error_raises_on_the_next_save(tmp_path, monkeypatch):
    saver = AsyncSaver()
    _failing_writes(monkeypatch)
    saver.save(_state(), tmp_path / "a")
    with pytest.raises(CheckpointError, match="No space left"):
        saver.save(_state(), tmp_path / "b")
    assert not (tmp_path / "a").exists() and not (tmp_path / "b").exists()


def test_an_unobserved_background_error_raises_on_close(tmp_path, monkeypatch):
    saver = AsyncSaver()
    _failing_writes(monkeypatch)
    saver.save(_state(), tmp_path / "a")
    with pytest.raises(CheckpointError, match="No space left"):
        saver.close()


def test_an_error_while_staging_commits_nothing_and_raises_on_wait(tmp_path, monkeypatch):
    def broken_copy(dst, src):  # noqa: ANN001, ANN202
        raise RuntimeError("device lost")

    monkeypatch.setattr(background, "_copy", broken_copy)
    saver = AsyncSaver()
    handle = saver.save(_state(), tmp_path / "a")
    with pytest.raises(CheckpointError, match="device lost"):
        handle.wait()
    assert not (tmp_path / "a").exists()


def _gated_writes(monkeypatch) -> threading.Event:  # noqa: ANN001
    gate, real = threading.Event(), direct_io.pwrite_all

    def pwrite_all(fd, data, offset):  # noqa: ANN001, ANN202
        gate.wait()
        return real(fd, data, offset)

    monkeypatch.setattr(direct_io, "pwrite_all", pwrite_all)
    return gate


def test_if_busy_skip_skips_while_the_previous_save_runs(tmp_path, monkeypatch):
    gate = _gated_writes(monkeypatch)
    saver = AsyncSaver(if_busy="skip")
    first = saver.save(_state(), tmp_path / "a")
    assert saver.save(_state(), tmp_path / "b") is None
    gate.set()
    first.wait()
    assert saver.save(_state(), tmp_path / "c").wait().tensors == 54
    assert not (tmp_path / "b").exists()


def test_by_default_a_new_save_waits_for_the_one_in_flight(tmp_path, monkeypatch):
    gate = _gated_writes(monkeypatch)
    saver = AsyncSaver()
    first = saver.save(_state(), tmp_path / "a")
    threading.Timer(0.3, gate.set).start()
    second = saver.save(_state(), tmp_path / "b")
    assert first.done() and (tmp_path / "a" / MARKER_NAME).exists()
    second.wait()


def test_a_checkpoint_is_not_visible_before_its_background_write_finished(tmp_path, monkeypatch):
    gate = _gated_writes(monkeypatch)
    handle = AsyncSaver().save(_state(), tmp_path / "a")
    assert not handle.done() and not (tmp_path / "a" / MARKER_NAME).exists()
    with pytest.raises(TimeoutError):
        handle.wait(timeout=0.05)
    gate.set()
    handle.wait()
    assert (tmp_path / "a" / MARKER_NAME).exists()


# ---- CheckpointManager(async_save=True) ------------------------------------------------


def test_manager_async_saves_commit_log_and_apply_retention(tmp_path):
    manager = CheckpointManager(
        tmp_path,
        policy=SavePolicy(every_n_steps=1),
        retention=RetentionPolicy(keep_last=2),
        async_save=True,
        preemption_signals=(),
    )
    state, saved = _state(), {}
    for step in range(1, 5):
        state["step"] = step
        saved[step] = _clone(state)
        assert isinstance(manager.save(step, state), shardpoint.AsyncSave)
        _mutate(state)
    manager.close()
    assert manager.steps() == [3, 4]
    saves = [e for e in manager.events.read() if e["event"] == "save"]
    assert [e["step"] for e in saves] == [1, 2, 3, 4]
    assert all(e["blocked_seconds"] <= e["seconds"] for e in saves)
    restored = zeros_like_state(state)
    assert CheckpointManager(tmp_path, preemption_signals=()).restore(restored) == 4
    assert_states_equal(restored, saved[4])  # bit for bit, not only the step
    kept = zeros_like_state(state)
    load(kept, tmp_path / "step-000000003")
    assert_states_equal(kept, saved[3])


def test_manager_close_raises_a_failed_background_save(tmp_path, monkeypatch):
    manager = CheckpointManager(tmp_path, async_save=True, preemption_signals=())
    _failing_writes(monkeypatch)
    manager.save(1, _state(), force=True)
    with pytest.raises(CheckpointError, match="No space left"):
        manager.close()
    assert manager.steps() == []
    assert [e["event"] for e in manager.events.read()] == ["save_failed"]


def test_preemption_with_an_async_save_in_flight_finishes_it_then_saves(tmp_path, monkeypatch):
    gate = _gated_writes(monkeypatch)
    manager = CheckpointManager(tmp_path, policy=SavePolicy(every_n_steps=10), async_save=True)
    try:
        state = _state()
        manager.maybe_save(10, state)
        os.kill(os.getpid(), signal.SIGTERM)
        threading.Timer(0.2, gate.set).start()
        assert manager.maybe_save(11, state)  # waits for step 10, then saves 11 at once
        assert manager.should_stop and manager.exit_code == 143
        assert manager.steps() == [10, 11]
    finally:
        gate.set()
        manager.close()


def _held_background(monkeypatch) -> threading.Event:  # noqa: ANN001
    """Hold back every background thread of a save (writers, hasher, commit) until the
    returned event is set: whatever they read, they read after the test went on."""
    gate, real = threading.Event(), background.lower_priority

    def held(nice):  # noqa: ANN001, ANN202
        gate.wait()
        real(nice)

    monkeypatch.setattr(background, "lower_priority", held)
    return gate


def _model_and_optimizer(seed: int) -> tuple[torch.nn.Module, torch.optim.Optimizer]:
    torch.manual_seed(seed)
    model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.ReLU(), torch.nn.Linear(16, 2))
    return model, torch.optim.AdamW(model.parameters(), lr=0.01)


def _tensors(model: torch.nn.Module, opt: torch.optim.Optimizer) -> dict:
    """Clones of the model's tensors and the optimizer's (exp_avg, exp_avg_sq, step)."""
    out = {f"model.{k}": v.clone() for k, v in model.state_dict().items()}
    for i, moments in opt.state_dict()["state"].items():
        out.update({f"optimizer.{i}.{k}": v.clone() for k, v in moments.items()})
    return out


def test_async_state_of_a_module_and_optimizer_is_the_state_at_the_call(tmp_path, monkeypatch):
    model, opt = _model_and_optimizer(0)
    model(torch.randn(4, 8)).sum().backward()
    opt.step()
    expected = _tensors(model, opt)
    gate = _held_background(monkeypatch)
    try:
        handle = shardpoint.async_save(
            shardpoint.TrainState(model=model, optimizer=opt, step=1), tmp_path / "ckpt"
        )
        assert not handle.done()  # nothing written, hashed or committed yet...
        opt.step()  # ...while training changes every parameter and moment in place
        changed = _tensors(model, opt)
        assert not any(torch.equal(v, expected[k]) for k, v in changed.items())
    finally:
        gate.set()
    handle.wait()
    model2, opt2 = _model_and_optimizer(1)
    load(shardpoint.TrainState(model=model2, optimizer=opt2, step=0), tmp_path / "ckpt")
    loaded = _tensors(model2, opt2)
    assert loaded.keys() == expected.keys()
    for k, v in loaded.items():
        assert torch.equal(v, expected[k]), k


# ---- two ranks -------------------------------------------------------------------------


def rank_state(rank: int) -> dict:
    g = torch.Generator().manual_seed(5)
    shared = torch.randn(4000, 1000, generator=g)  # same on both ranks: split between them
    return {"shared": shared, "ranks": {rank: torch.full((7,), float(rank))}, "step": 3}


def _two_rank_async(rank: int, world: int, root: str, fail_rank: int) -> None:
    import time

    root_path = Path(root)
    release = root_path / "release"
    if rank == 1:  # rank 1's background writes wait for the test's signal
        real = direct_io.pwrite_all

        def pwrite_all(fd, data, offset):  # noqa: ANN001, ANN202
            while not release.exists():
                time.sleep(0.01)
            if fail_rank == 1:
                raise OSError(errno.EIO, "Input/output error")
            return real(fd, data, offset)

        direct_io.pwrite_all = pwrite_all
    state = rank_state(rank)
    handle = shardpoint.async_save(state, root_path / "ckpt")
    _mutate(state)
    if rank == 0:
        time.sleep(0.5)  # rank 0's own part is long durable by now
        assert not (root_path / "ckpt" / MARKER_NAME).exists()
        release.touch()
    if fail_rank == 1:
        with pytest.raises(CheckpointError, match="Input/output error"):
            handle.wait()
        assert not (root_path / "ckpt" / MARKER_NAME).exists()
        return
    handle.wait()
    loaded = zeros_like_state(rank_state(rank))
    load(loaded, root_path / "ckpt", strict=False)
    assert_states_equal(loaded, rank_state(rank))


@pytest.mark.slow
@pytest.mark.parametrize("fail_rank", [-1, 1], ids=["both-finish", "rank-1-fails"])
def test_two_rank_async_save_commits_only_when_both_ranks_finished(tmp_path, fail_rank):
    from distributed import run_ranks

    run_ranks(2, _two_rank_async, str(tmp_path), fail_rank)
    assert (tmp_path / "ckpt" / MARKER_NAME).exists() == (fail_rank == -1)


def _two_savers_in_flight(rank: int, world: int, root: str) -> None:
    import time

    root_path = Path(root)
    release = root_path / "release"
    if rank == 1:  # rank 1's writes of checkpoint "a" wait: its "b" commits first there
        real = direct_io.pwrite_all

        def pwrite_all(fd, data, offset):  # noqa: ANN001, ANN202
            while "/a/" in os.readlink(f"/proc/self/fd/{fd}") and not release.exists():
                time.sleep(0.01)
            return real(fd, data, offset)

        direct_io.pwrite_all = pwrite_all
    first, second = AsyncSaver(), AsyncSaver()
    state_a, state_b = rank_state(rank), rank_state(rank + 7)
    saved_a = first.save(state_a, root_path / "a")
    saved_b = second.save(state_b, root_path / "b")
    if rank == 0:
        time.sleep(0.5)  # both of rank 0's commit threads are at their gathers by now
        release.touch()
    saved_b.wait()
    saved_a.wait()
    for path, expected in (("a", state_a), ("b", state_b)):
        loaded = zeros_like_state(expected)
        load(loaded, root_path / path, strict=False)
        assert_states_equal(loaded, expected)


@pytest.mark.slow
@pytest.mark.skipif(not Path("/proc/self/fd").is_dir(), reason="names open files via /proc")
def test_two_savers_with_saves_in_flight_at_once_commit_each_its_own(tmp_path):
    """Rank 0 reaches the commit of "a" first, rank 1 that of "b": on one shared group
    the two commits would pair each other's gathers (and hang, or mix the two)."""
    from distributed import run_ranks_outcomes

    outcomes = run_ranks_outcomes(
        2,
        _two_savers_in_flight,
        str(tmp_path),
        errors=tmp_path / "errors",
        timeout=90,
        start_method="spawn",  # a fork of this process would inherit other tests' threads
    )
    assert all(o.exitcode == 0 for o in outcomes), "\n".join(map(str, outcomes))
    assert verify(tmp_path / "a").ok and verify(tmp_path / "b").ok


def test_a_continuous_policy_saves_whenever_the_previous_save_has_committed(tmp_path, monkeypatch):
    gate = _gated_writes(monkeypatch)
    manager = CheckpointManager(
        tmp_path,
        SavePolicy(continuous=True),
        RetentionPolicy(keep_last=None),
        async_save=True,
        preemption_signals=(),
    )
    assert manager.maybe_save(1, _state())  # nothing in flight: save now
    assert not manager.maybe_save(2, _state())  # step 1 is still being written
    assert not manager.maybe_save(3, _state())
    gate.set()
    manager.wait()
    assert manager.maybe_save(4, _state())  # committed: the next step saves at once
    manager.close()
    assert manager.steps() == [1, 4]


def test_continuous_saves_need_async_saves_and_remote_needs_a_remote_tier(tmp_path):
    with pytest.raises(ValueError, match="needs async_save"):
        CheckpointManager(tmp_path, SavePolicy(continuous=True), preemption_signals=())
    with pytest.raises(TypeError, match="RemoteTier"):
        CheckpointManager(tmp_path, remote="s3://bucket/x", preemption_signals=())  # type: ignore[arg-type]


def test_background_saves_work_on_a_file_system_without_hard_links(tmp_path, monkeypatch):
    """exFAT and FUSE mounts (gcsfuse, s3fs, blobfuse) refuse hard links: a background
    save names its files by a rename after checking the name is free (it failed with
    'Operation not permitted' before), and still refuses a name that exists."""
    import errno

    from shardpoint.storage import direct_io

    def no_links(*args, **kwargs):  # noqa: ANN002, ANN003, ANN202
        raise PermissionError(errno.EPERM, "Operation not permitted")

    monkeypatch.setattr(direct_io.os, "link", no_links)
    state = {"w": torch.arange(10.0)}
    shardpoint.async_save(state, tmp_path / "ckpt").wait()
    out = {"w": torch.zeros(10)}
    shardpoint.load(out, tmp_path / "ckpt")
    assert torch.equal(out["w"], state["w"])
    taken = tmp_path / "taken"
    taken.write_bytes(b"another writer's")
    with pytest.raises(FileExistsError):
        direct_io.link_new(tmp_path / "ckpt" / "index.json", taken)
    assert taken.read_bytes() == b"another writer's"
