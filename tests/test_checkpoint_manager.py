"""CheckpointManager: intervals, retention, fallback to the previous valid checkpoint."""

import json
import os
import signal

import pytest
import torch

import shardpoint
from shardpoint import CheckpointManager, IOOptions, RetentionPolicy, SavePolicy
from shardpoint.commit import Commit
from shardpoint.format.index import MARKER_NAME
from shardpoint.storage.local import LocalDirectory


def _state(value: float) -> dict:
    return {"w": torch.full((4,), value), "step": int(value)}


def _manager(tmp_path, **kw) -> CheckpointManager:
    kw.setdefault("preemption_signals", ())
    return CheckpointManager(tmp_path / "ckpts", **kw)


def test_saves_on_the_step_interval_only(tmp_path):
    m = _manager(
        tmp_path, policy=SavePolicy(every_n_steps=5), retention=RetentionPolicy(keep_last=None)
    )
    saved = [s for s in range(1, 21) if m.maybe_save(s, _state(s))]
    assert saved == [5, 10, 15, 20] and m.steps() == [5, 10, 15, 20]


def test_saves_on_the_time_interval(tmp_path, monkeypatch):
    import shardpoint.training.manager as mod

    now = [1000.0]
    monkeypatch.setattr(mod.time, "monotonic", lambda: now[0])
    m = _manager(tmp_path, policy=SavePolicy(every_n_seconds=60))
    assert not m.maybe_save(1, _state(1))
    now[0] += 61
    assert m.maybe_save(2, _state(2))
    now[0] += 30
    assert not m.maybe_save(3, _state(3))


def test_save_with_force_ignores_the_interval_and_a_committed_step_is_not_saved_twice(tmp_path):
    m = _manager(tmp_path, policy=SavePolicy(every_n_steps=100))
    assert m.save(7, _state(7)) is None
    assert m.save(7, _state(7), force=True) is not None
    assert m.save(7, _state(8), force=True) is None  # already committed, never rewritten


def test_restore_returns_the_newest_step_and_loads_it(tmp_path):
    m = _manager(
        tmp_path, policy=SavePolicy(every_n_steps=1), retention=RetentionPolicy(keep_last=None)
    )
    for s in (1, 2, 3):
        m.save(s, _state(s))
    dest = _state(0)
    assert m.restore(dest) == 3
    assert dest["w"].tolist() == [3.0] * 4 and dest["step"] == 3


def test_restore_of_an_empty_directory_returns_none(tmp_path):
    assert _manager(tmp_path).restore(_state(0)) is None


@pytest.mark.parametrize("damage", ["flip", "truncate", "index", "marker-only"])
def test_a_corrupt_newest_checkpoint_falls_back_to_the_previous_one(tmp_path, damage):
    m = _manager(
        tmp_path, policy=SavePolicy(every_n_steps=1), retention=RetentionPolicy(keep_last=None)
    )
    for s in (1, 2):
        m.save(s, _state(s))
    newest = m.path_for(2)
    shard = next(newest.glob("*.safetensors"))
    if damage == "flip":
        raw = bytearray(shard.read_bytes())
        raw[-2] ^= 0xFF
        shard.write_bytes(raw)
    elif damage == "truncate":
        shard.write_bytes(shard.read_bytes()[:-3])
    elif damage == "index":
        (newest / "index.json").write_text("{}")
    else:
        (newest / "index.json").unlink()
    dest = _state(0)
    with pytest.warns(UserWarning, match="checkpoint at step 2 is not usable"):
        assert m.restore(dest) == 1
    assert dest["w"].tolist() == [1.0] * 4
    events = [json.loads(x) for x in (tmp_path / "ckpts" / "events.jsonl").read_text().splitlines()]
    assert [e["event"] for e in events][-2:] == ["fallback", "restore"]


def test_steps_a_restore_passed_over_are_saved_anew_by_the_resumed_run(tmp_path):
    """Steps 2 and 3 are damaged; the run resumes from 1. Its own steps 2 and 3 used to
    be skipped as "already committed" (the damaged ones kept, retention counting them
    as the newest, every restore trying them first). Now the first save moves them
    aside, every byte kept (a failure to read may have been passing), and the resumed
    run's checkpoints are the ones a later restore finds."""
    m = _manager(tmp_path, retention=RetentionPolicy(keep_last=None))
    for s in (1, 2, 3):
        m.save(s, _state(s), force=True)
    for s in (2, 3):
        shard = next(m.path_for(s).glob("*.safetensors"))
        raw = bytearray(shard.read_bytes())
        raw[-2] ^= 0xFF
        shard.write_bytes(raw)
    m = _manager(tmp_path, retention=RetentionPolicy(keep_last=2))
    with pytest.warns(UserWarning, match="not usable"):
        assert m.restore(_state(0)) == 1
    with pytest.warns(UserWarning, match="could not use this checkpoint; moved to") as caught:
        assert m.save(2, _state(22), force=True) is not None
    assert len([w for w in caught if "moved to" in str(w.message)]) == 2
    assert m.steps() == [1, 2]  # the new 2 beside 1 (keep_last=2); the damaged ones aside
    root = tmp_path / "ckpts"
    aside = sorted(p.name for p in root.iterdir() if ".unusable-" in p.name)
    assert aside == ["step-000000002.unusable-1", "step-000000003.unusable-1"]
    assert all((root / a / "index.json").exists() for a in aside)  # nothing deleted
    events = [json.loads(x) for x in (root / "events.jsonl").read_text().splitlines()]
    assert sorted(e["step"] for e in events if e["event"] == "set_aside") == [2, 3]
    dest = _state(0)
    assert _manager(tmp_path).restore(dest) == 2 and dest["w"].tolist() == [22.0] * 4


def test_fast_verification_skips_checksums(tmp_path):
    m = _manager(tmp_path, policy=SavePolicy(every_n_steps=1), io=IOOptions(verify="fast"))
    m.save(1, _state(1))
    shard = next(m.path_for(1).glob("*.safetensors"))
    raw = bytearray(shard.read_bytes())
    raw[-1] ^= 0x01
    shard.write_bytes(raw)
    assert m.restore(_state(0)) == 1  # structure intact; only a full check sees the flip


def test_retention_keeps_the_last_n(tmp_path):
    m = _manager(
        tmp_path, policy=SavePolicy(every_n_steps=1), retention=RetentionPolicy(keep_last=2)
    )
    for s in range(1, 6):
        m.save(s, _state(s))
    assert m.steps() == [4, 5]
    assert sorted(p.name for p in (tmp_path / "ckpts").iterdir()) == [
        "events.jsonl",
        "step-000000004",
        "step-000000005",
    ]


def test_retention_keeps_every_nth_and_the_best(tmp_path):
    m = _manager(
        tmp_path,
        policy=SavePolicy(every_n_steps=1),
        retention=RetentionPolicy(
            keep_last=1, keep_every_n_steps=4, keep_best=2, best_metric="loss"
        ),
    )
    losses = {1: 5.0, 2: 1.0, 3: 4.0, 4: 3.0, 5: 0.5, 6: 6.0, 7: 7.0, 8: 9.0, 9: 8.0}
    for s, loss in losses.items():
        m.save(s, _state(s), metrics={"loss": loss})
    # last: 9; every 4th: 4, 8; best two losses: 5 (0.5), 2 (1.0)
    assert m.steps() == [2, 4, 5, 8, 9]


def test_the_save_just_made_is_kept_beside_a_higher_damaged_step(tmp_path):
    """A damaged step 300 (restore skips it) is "newer" by number than the saves that
    follow: each one is kept all the same, so a loadable checkpoint always remains."""
    m = _manager(tmp_path, retention=RetentionPolicy(keep_last=1))
    for s in (100, 200, 300):
        m.save(s, _state(s), force=True)
    shard = next((tmp_path / "ckpts" / "step-000000300").glob("*.safetensors"))
    shard.write_bytes(shard.read_bytes()[:10])  # keep_last=1 left only 300: now damaged
    m.save(50, _state(50), force=True)  # (a run going on without a restore)
    m.save(150, _state(150), force=True)
    assert m.steps() == [150, 300]
    with pytest.warns(UserWarning, match="step 300 is not usable"):
        assert _manager(tmp_path).restore(state := _state(0)) == 150 and state["step"] == 150


def test_retention_and_clean_up_never_delete_through_a_linked_step(tmp_path):
    """An earlier run's checkpoint and another job's unfinished save, linked in under
    step names: read through (restore), never deleted through."""
    earlier = _manager(tmp_path / "pretrain", retention=RetentionPolicy(keep_last=None))
    earlier.save(5, _state(5), force=True)
    unfinished = tmp_path / "pretrain" / "ckpts" / "step-000000007"
    unfinished.mkdir()
    (unfinished / "rank00000-00000.safetensors").write_bytes(b"half")
    root = tmp_path / "finetune" / "ckpts"
    root.mkdir(parents=True)
    (root / "step-000000005").symlink_to(earlier.path_for(5))
    (root / "step-000000007").symlink_to(unfinished)
    m = CheckpointManager(root, retention=RetentionPolicy(keep_last=1), preemption_signals=())
    assert (unfinished / "rank00000-00000.safetensors").exists()  # not a leftover of ours
    assert m.restore(state := _state(0)) == 5 and state["step"] == 5
    for s in (10, 20):
        m.save(s, _state(s), force=True)
    assert m.steps() == [5, 20]
    assert shardpoint.verify(earlier.path_for(5)).ok


def test_a_best_metric_that_cannot_be_read_deletes_nothing_that_round(tmp_path, monkeypatch):
    from shardpoint.storage import local

    m = _manager(tmp_path, retention=RetentionPolicy(keep_last=1, keep_best=1, best_metric="loss"))
    m.save(100, _state(100), force=True, metrics={"loss": 0.1})
    m.save(200, _state(200), force=True, metrics={"loss": 0.5})
    real = local.open_regular
    best_index = m.path_for(100) / "index.json"

    def open_regular(path, flags):  # noqa: ANN001, ANN202
        if path == best_index:  # an I/O error: read_small turns it into a typed error
            raise OSError(5, "Input/output error")
        return real(path, flags)

    monkeypatch.setattr(local, "open_regular", open_regular)
    m.save(300, _state(300), force=True, metrics={"loss": 0.9})
    assert m.steps() == [100, 200, 300]  # step 100 (the best) not deleted on a guess
    monkeypatch.setattr(local, "open_regular", real)
    m.save(400, _state(400), force=True, metrics={"loss": 0.9})
    assert m.steps() == [100, 400]


def test_a_remote_tier_on_a_shared_file_system_gets_every_upload(tmp_path):
    from shardpoint import RemoteTier

    remote = tmp_path / "shared"
    m = _manager(tmp_path, remote=RemoteTier(str(remote), RetentionPolicy(keep_last=1)))
    for s in (1, 2):
        m.save(s, _state(s), force=True)
        assert m.wait_for_uploads(timeout=60)
    m.close()
    assert m.remote_steps() == [2]
    assert shardpoint.verify(remote / "step-000000002").ok


def test_a_damaged_local_checkpoint_is_not_uploaded_over_the_remote_copy(tmp_path):
    """Step 3 is truncated locally before its upload: the upload fails, and the remote
    keeps step 2 (its retention never ran for a copy that did not commit)."""
    from shardpoint import RemoteTier

    remote = tmp_path / "shared"
    m = _manager(tmp_path, remote=RemoteTier(str(remote), RetentionPolicy(keep_last=1)))
    m.save(2, _state(2), force=True)
    assert m.wait_for_uploads(timeout=60)
    m.close()
    local = _manager(tmp_path, retention=RetentionPolicy(keep_last=None))
    local.save(3, _state(3), force=True)  # committed here, not uploaded
    local.close()
    shard = next(local.path_for(3).glob("*.safetensors"))
    shard.write_bytes(shard.read_bytes()[:10])
    with pytest.warns(UserWarning, match="local copy is damaged"):
        again = _manager(tmp_path, remote=RemoteTier(str(remote), RetentionPolicy(keep_last=1)))
        assert again.restore(_state(0)) == 2
        again.wait_for_uploads(timeout=60)
        again.close()
    assert again.remote_steps() == [2]
    assert shardpoint.verify(remote / "step-000000002").ok


def test_remote_retention_keeps_the_step_just_uploaded(tmp_path):
    """The remote holds a higher step of an earlier run: keep_last=1 there must not
    delete each new upload as soon as it commits."""
    from shardpoint import RemoteTier

    remote = RemoteTier(str(tmp_path / "shared"), RetentionPolicy(keep_last=1))
    earlier = CheckpointManager(tmp_path / "earlier", remote=remote, preemption_signals=())
    earlier.save(9, _state(9), force=True)
    assert earlier.wait_for_uploads(timeout=60)
    earlier.close()
    m = _manager(tmp_path, remote=remote)
    m.save(3, _state(3), force=True)
    assert m.wait_for_uploads(timeout=60)
    m.close()
    assert m.remote_steps() == [3, 9]


def test_retention_policy_never_drops_the_newest():
    from shardpoint.training.retention import KeptCheckpoint

    policy = RetentionPolicy(keep_last=1, keep_best=1, best_metric="loss", mode="max")
    kept = policy.keep([KeptCheckpoint(1, 10.0), KeptCheckpoint(2, 1.0)])
    assert kept == {1, 2}


class _Crash(BaseException):
    """The process dies here (nothing in the library catches a BaseException)."""


def _crash_deletion_at(monkeypatch, k: int) -> list[str]:
    """Run retention's real ``Commit.delete``, but raise ``_Crash`` in place of its
    ``k``-th file-system call (0: never). Returns its calls so far as "call file"."""
    calls: list[str] = []
    deleting = [False]
    paths: dict[int, str] = {}  # fd -> name, to say what an fsync was for

    def counted(name: str):  # noqa: ANN202
        real = getattr(os, name)

        def call(first, *args, **kwargs):  # noqa: ANN001, ANN002, ANN003, ANN202
            target = paths.get(first, "?") if isinstance(first, int) else os.path.basename(first)
            if deleting[0]:
                calls.append(f"{name} {target}")
                if len(calls) == k:
                    raise _Crash(calls[-1])
            result = real(first, *args, **kwargs)
            if name == "open":
                paths[result] = target
            return result

        return call

    for name in ("open", "fsync", "unlink", "rmdir", "replace"):
        monkeypatch.setattr(os, name, counted(name))

    real_delete = Commit.delete

    def delete_counted(commit, keep=()) -> None:  # noqa: ANN001
        deleting[0] = True
        try:
            real_delete(commit, keep)
        finally:
            deleting[0] = False

    monkeypatch.setattr(Commit, "delete", delete_counted)
    return calls


def _retention_deletes_step_1(root, monkeypatch, k: int) -> tuple[CheckpointManager, list[str]]:
    m = CheckpointManager(
        root,
        policy=SavePolicy(every_n_steps=1),
        retention=RetentionPolicy(keep_last=1),
        preemption_signals=(),
    )
    m.save(1, _state(1))
    with monkeypatch.context() as patch:
        calls = _crash_deletion_at(patch, k)
        if k == 0:
            m.save(2, _state(2))
        else:
            with pytest.raises(_Crash):
                m.save(2, _state(2))  # committed, then retention deletes step 1 and crashes
    return m, calls


def test_a_crash_during_retention_never_leaves_zero_valid_checkpoints(tmp_path, monkeypatch):
    """Retention's real deletion crashes at each of its file-system calls in turn. Right
    after the crash every directory a reader takes for a checkpoint (it has a marker)
    loads complete; a restarted manager removes the leftover and restores step 2."""
    m, calls = _retention_deletes_step_1(tmp_path / "no-crash", monkeypatch, 0)
    assert m.steps() == [2]
    assert {"unlink COMMITTED", "unlink index.json", "rmdir step-000000001"} <= set(calls), calls
    for k in range(1, len(calls) + 1):
        root = tmp_path / f"crash-at-{k}"
        m, _ = _retention_deletes_step_1(root, monkeypatch, k)
        assert 2 in m.steps(), (k, calls[k - 1], m.steps())
        for step in m.steps():  # what readers see right after the crash
            dest = _state(0)
            try:
                shardpoint.load(dest, m.path_for(step))
            except shardpoint.CheckpointError as exc:
                raise AssertionError(
                    f"crash before {calls[k - 1]!r} (call {k} of {len(calls)}): step {step} "
                    f"looks committed but is damaged: {exc}"
                ) from exc
            assert dest["w"].tolist() == [float(step)] * 4 and dest["step"] == step
        restarted = CheckpointManager(
            root,
            policy=SavePolicy(every_n_steps=1),
            retention=RetentionPolicy(keep_last=1),
            preemption_signals=(),
        )
        assert restarted.steps() in ([1, 2], [2]), (k, restarted.steps())
        assert restarted.path_for(1).exists() == (restarted.steps() == [1, 2]), k  # no leftover
        dest = _state(0)
        assert restarted.restore(dest) == 2 and dest["w"].tolist() == [2.0] * 4


def test_leftovers_of_a_crashed_save_are_removed_at_start(tmp_path):
    m = _manager(tmp_path, policy=SavePolicy(every_n_steps=1))
    m.save(1, _state(1))
    shardpoint.save(_state(2), m.path_for(2))
    (m.path_for(2) / MARKER_NAME).unlink()
    restarted = _manager(tmp_path)
    assert not m.path_for(2).exists() and restarted.steps() == [1]


def test_delete_checkpoint_keeps_foreign_files(tmp_path):
    shardpoint.save(_state(1), tmp_path / "c")
    (tmp_path / "c" / "notes.txt").write_text("mine")
    Commit(LocalDirectory(tmp_path / "c")).delete()
    assert [p.name for p in (tmp_path / "c").iterdir()] == ["notes.txt"]


def test_a_streak_of_diverged_saves_never_rotates_the_last_good_checkpoint_out(tmp_path):
    """Losses that went to NaN/inf (the state still finite, so the NaN check passes):
    keep_last=2 alone would keep only bad ones; the newest good one stays, also for a
    later process that knows it only from its index."""
    nan, inf = float("nan"), float("inf")
    retention = RetentionPolicy(keep_last=2)  # keep_last_good=1 by default
    m = _manager(tmp_path, retention=retention)
    m.save(2, _state(2), force=True, metrics={"loss": 1.0})
    m.save(4, _state(4), force=True, metrics={"loss": nan})
    m.close()
    later = _manager(tmp_path, retention=retention)
    later.save(6, _state(6), force=True, metrics={"loss": inf})
    later.save(8, _state(8), force=True, metrics={"loss": nan})
    assert later.steps() == [2, 6, 8]
    later.save(10, _state(10), force=True, metrics={"loss": 0.5})
    assert later.steps() == [8, 10]
    later.close()
    without = _manager(tmp_path / "plain", retention=RetentionPolicy(keep_last=2, keep_last_good=0))
    for step, loss in ((2, 1.0), (4, nan), (6, nan)):
        without.save(step, _state(step), force=True, metrics={"loss": loss})
    assert without.steps() == [4, 6]
    without.close()


def test_a_preemption_signal_forces_a_save_and_sets_should_stop(tmp_path):
    m = CheckpointManager(
        tmp_path / "ckpts",
        policy=SavePolicy(every_n_steps=1000),
        preemption_signals=(signal.SIGUSR1,),
    )
    try:
        assert not m.maybe_save(3, _state(3))
        signal.raise_signal(signal.SIGUSR1)
        assert m.preempted and not m.should_stop
        assert m.maybe_save(4, _state(4))
        assert m.should_stop and m.exit_code == 143  # whichever signal announced it
        assert m.steps() == [4]
    finally:
        m.close()
    assert signal.getsignal(signal.SIGUSR1) is signal.SIG_DFL


def test_state_mismatch_is_raised_not_skipped(tmp_path):
    m = _manager(tmp_path, policy=SavePolicy(every_n_steps=1))
    m.save(1, _state(1))
    with pytest.raises(shardpoint.StateMismatchError):
        m.restore({"w": torch.zeros(5), "step": 0})


def _signal_after_the_ranks_agreed(rank: int, world: int, root: str) -> None:
    manager = CheckpointManager(
        root, SavePolicy(every_n_steps=2), async_save=True, preemption_signals=(signal.SIGUSR1,)
    )
    state = {"w": torch.ones(4)}
    agree = manager.should_save

    def signal_arrives_right_after(step: int) -> bool:
        due = agree(step)
        if rank == 1 and step == 2:
            signal.raise_signal(signal.SIGUSR1)  # after the agreement, before the save
        return due

    manager.should_save = signal_arrives_right_after
    first = manager.save(2, state)  # due by the interval on every rank: in the background
    assert isinstance(first, shardpoint.AsyncSave) and not manager.should_stop
    second = manager.save(3, state)  # now every rank preempts: at once, then stop
    assert isinstance(second, shardpoint.SaveInfo) and manager.should_stop
    manager.close()


def test_a_signal_between_the_agreement_and_the_save_counts_for_the_next_save(tmp_path):
    """Acting on this rank's flag instead of the agreed answer, rank 1 would save
    synchronously while rank 0 saves in the background: the collectives would not
    match and the job would hang; or rank 1 alone would stop."""
    from distributed import run_ranks_outcomes

    outcomes = run_ranks_outcomes(
        2,
        _signal_after_the_ranks_agreed,
        str(tmp_path / "ckpt"),
        errors=tmp_path / "err",
        timeout=60,
    )
    assert all(o.exitcode == 0 for o in outcomes), "\n".join(map(str, outcomes))
    assert shardpoint.verify(tmp_path / "ckpt" / "step-000000003").ok


class _PickyOnRank1:
    """A Stateful whose ``load_state_dict`` fails on rank 1 alone, with an error that is
    neither the checkpoint's nor a mismatch (a user's bug)."""

    def __init__(self) -> None:
        self.v = 0

    def state_dict(self) -> dict:
        return {"v": self.v}

    def load_state_dict(self, sd: dict) -> None:
        from shardpoint import dist

        if dist.rank() == 1 and sd["v"] == 7:  # the checkpoint's value, not its own back
            raise TypeError("picky (injected)")
        self.v = sd["v"]


def _restore_with_one_rank_failing(rank: int, world: int, root: str, where: str) -> None:
    import warnings

    from shardpoint import CheckpointError, MemoryTierOptions, StateMismatchError

    os.environ["SHARDPOINT_SHM_DIR"] = os.path.join(root, "shm", str(rank))
    memory = MemoryTierOptions(every_n_steps=1) if where == "memory" else None
    manager = CheckpointManager(os.path.join(root, "disk"), memory=memory, preemption_signals=())
    state = {"w": torch.ones(4), "picky": _PickyOnRank1()}
    state["picky"].v = 7
    manager.save(1, state, force=True)
    state["picky"].v = 0
    if memory is not None:
        manager.save_to_memory(2, state)
        manager.memory.wait()
    if where == "memory":  # rank 1's state does not fit its memory copy
        state, expected = {"w": torch.ones(4 + rank), "picky": _PickyOnRank1()}, StateMismatchError
    else:
        expected = TypeError if rank == 1 else CheckpointError
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # no fallback to an older checkpoint either
        with pytest.raises(expected, match="picky|another rank|does not fit"):
            manager.restore(state)


@pytest.mark.parametrize("where", ["disk", "memory"])
def test_an_error_on_one_rank_during_restore_is_raised_on_every_rank(tmp_path, where):
    """A restore whose load fails on one rank with an error that is not the checkpoint's
    (a Stateful's own ``TypeError``; a state that does not fit its memory copy) raises on
    every rank, without falling back: the others used to wait in the agreement until
    the collective timeout."""
    from distributed import run_ranks_outcomes

    outcomes = run_ranks_outcomes(
        2,
        _restore_with_one_rank_failing,
        str(tmp_path),
        where,
        errors=tmp_path / "errors",
        timeout=60,
    )
    assert all(o.exitcode == 0 for o in outcomes), "\n".join(map(str, outcomes))


def test_a_failed_background_save_does_not_stop_the_preemption_save(tmp_path, monkeypatch):
    """SIGTERM after a background save failed: the final save waits for the one in
    flight, whose error used to be raised there, so nothing was saved and the job died
    with that error instead of exiting for a requeue."""
    import shardpoint.background_save as background_save
    from shardpoint import CheckpointError

    real, failed = background_save._finish_in_background, []

    def first_fails(finish, *args):  # noqa: ANN001, ANN002, ANN202
        if not failed:
            failed.append(True)

            def finish():  # noqa: ANN202
                raise CheckpointError("the disk went away (injected)")

        return real(finish, *args)

    monkeypatch.setattr(background_save, "_finish_in_background", first_fails)
    m = _manager(
        tmp_path,
        policy=SavePolicy(every_n_steps=10),
        async_save=True,
        preemption_signals=(signal.SIGUSR1,),
    )
    assert m.maybe_save(10, _state(10)) is True  # staged; fails in the background
    os.kill(os.getpid(), signal.SIGUSR1)
    with pytest.warns(UserWarning, match="background save in flight failed"):
        assert m.maybe_save(11, _state(11)) is True
    assert m.should_stop and m.steps() == [11]
    m.close()


def test_close_after_a_failed_background_save_still_finishes_the_uploads(tmp_path, monkeypatch):
    """``close()`` raises the failed save's error, and first lets the newest committed
    checkpoint reach the remote tier (the upload thread was left to die with the
    process, and that checkpoint with a node-local disk)."""
    import time

    import shardpoint.background_save as background_save
    from shardpoint import CheckpointError, RemoteTier
    from shardpoint.training.tiers import Uploader

    real, calls = background_save._finish_in_background, []

    def second_fails(finish, *args):  # noqa: ANN001, ANN002, ANN202
        calls.append(True)
        if len(calls) == 2:

            def finish():  # noqa: ANN202
                raise CheckpointError("the disk went away (injected)")

        return real(finish, *args)

    real_round = Uploader._round

    def slow_round(self, newest):  # noqa: ANN001, ANN202
        time.sleep(1.0)  # an object store slower than the training loop
        return real_round(self, newest)

    monkeypatch.setattr(background_save, "_finish_in_background", second_fails)
    monkeypatch.setattr(Uploader, "_round", slow_round)
    m = _manager(tmp_path, async_save=True, remote=RemoteTier(str(tmp_path / "remote")))
    m.save(1, _state(1), force=True)
    m.wait()  # committed locally; its upload is under way
    m.save(2, _state(2), force=True)  # fails in the background
    with pytest.raises(CheckpointError, match="injected"):
        m.close()
    assert 1 in CheckpointManager(tmp_path / "remote", preemption_signals=()).steps()


def test_metrics_are_stored_as_numbers_and_a_diverged_loss_does_not_fail_the_save(tmp_path):
    """A 0-d tensor or NumPy loss is its float; NaN or infinity (a diverged loss) is
    stored as unknown. Each of them used to fail the whole save at its commit."""
    import numpy as np

    from shardpoint import CheckpointReader

    m = _manager(tmp_path, retention=RetentionPolicy(keep_best=1, best_metric="loss"))
    losses = {1: torch.tensor(0.5), 2: float("nan"), 3: np.float32(0.25), 4: float("inf"), 5: None}
    for step, loss in losses.items():
        metrics = {"loss": loss, "phase": "warmup"}  # a string and None stay as they are
        assert m.save(step, _state(step), force=True, metrics=metrics) is not None
    stored = {}
    for step in m.steps():
        with CheckpointReader(m.path_for(step)) as r:
            stored[step] = r.metadata["user"]["metrics"]["loss"]
    assert stored[3] == 0.25 and stored.get(2, None) is None and stored.get(4, None) is None
    assert 3 in m.steps() and 1 not in m.steps()  # best by loss: 0.25


def test_the_old_keyword_arguments_name_their_new_spelling(tmp_path):
    with pytest.raises(TypeError, match=r"every_n_steps= is now policy=SavePolicy\(every_n_steps"):
        CheckpointManager(tmp_path, every_n_steps=10)
    with pytest.raises(TypeError, match=r"keep_last= is now retention=RetentionPolicy\(keep_last"):
        CheckpointManager(tmp_path, keep_last=3)
    with pytest.raises(TypeError, match=r"memory_every_n_steps= is now memory=MemoryTierOptions"):
        CheckpointManager(tmp_path, memory_every_n_steps=5)
    with pytest.raises(TypeError, match=r"unexpected keyword argument 'colour'"):
        CheckpointManager(tmp_path, colour="blue")
    with pytest.raises(TypeError, match=r"RemoteTier\('s3://b/run'\)"):
        CheckpointManager(tmp_path, remote="s3://b/run")
    assert not any(tmp_path.iterdir())  # refused before anything is written
