"""The in-memory tier: 2 simulated nodes x 2 ranks (gloo), a separate shared-memory
directory per node. A replaced node's ranks pull their state from buddies without
reading the disk tier; a restart on the same nodes restores from its own memory."""

from __future__ import annotations

import os
import shutil
from pathlib import Path

import pytest
import torch
from distributed import count_disk_reads, count_received

import shardpoint
from shardpoint import CheckpointError, CheckpointManager, MemoryTierOptions, SavePolicy
from shardpoint.training.memory_tier import MemoryTier


def _state(rank: int, step: int, mesh=None) -> dict:  # noqa: ANN001
    from torch.distributed.tensor import Shard, distribute_tensor

    g = torch.Generator().manual_seed(step)
    full = torch.randn(400, 10, generator=g)
    return {
        "sharded": distribute_tensor(full, mesh, [Shard(0)]),
        "replicated": torch.randn(50, generator=g),
        "step": step,
    }


def _template(rank: int, mesh) -> dict:  # noqa: ANN001
    from torch.distributed.tensor import Shard, distribute_tensor

    return {
        "sharded": distribute_tensor(torch.zeros(400, 10), mesh, [Shard(0)]),
        "replicated": torch.zeros(50),
        "step": -1,
    }


def _node_env(rank: int, root: str) -> None:
    os.environ["LOCAL_WORLD_SIZE"] = "2"  # ranks 0,1 on node 0; ranks 2,3 on node 1
    os.environ["SHARDPOINT_SHM_DIR"] = str(Path(root) / f"node{rank // 2}")


def _manager(root: str) -> CheckpointManager:
    return CheckpointManager(
        Path(root) / "disk",
        policy=SavePolicy(every_n_steps=3),
        memory=MemoryTierOptions(every_n_steps=1, job="job"),
        preemption_signals=(),
    )


def _train(rank: int, world: int, root: str) -> None:
    from torch.distributed.device_mesh import init_device_mesh

    _node_env(rank, root)
    mesh = init_device_mesh("cpu", (world,))
    manager = _manager(root)
    for step in range(1, 6):  # disk: step 3; memory: step 5
        manager.maybe_save(step, _state(rank, step, mesh))
    manager.close()


def _restore(rank: int, world: int, root: str, expect_from_buddy: list[int]) -> None:
    from torch.distributed.device_mesh import init_device_mesh

    _node_env(rank, root)
    mesh = init_device_mesh("cpu", (world,))
    disk_bytes = count_disk_reads(Path(root) / "disk")
    log: list[tuple[str, int]] = []
    count_received(log)
    manager = _manager(root)
    state = _template(rank, mesh)
    assert manager.restore(state) == 5
    # Rank 0 gathers the holdings and sends each rank its part of the plan: nothing
    # every rank receives grows with the ranks (no all-gather), only rank 0's share.
    assert "all_gather" not in [name for name, _ in log], log
    if rank:
        assert sum(n for _, n in log) < 1000, log
    expected = _state(rank, 5, mesh)
    assert torch.equal(state["sharded"].to_local(), expected["sharded"].to_local())
    assert torch.equal(state["replicated"], expected["replicated"])
    assert state["step"] == 5
    assert disk_bytes[0] == 0, disk_bytes  # nothing read from the disk tier
    assert (manager.memory.bytes_received > 0) == (rank in expect_from_buddy)
    manager.close()


@pytest.mark.slow
def test_a_replaced_node_restores_from_buddies_and_a_restart_from_its_own_memory(tmp_path):
    """...and no rank but rank 0 receives every rank's holdings to agree on the step."""
    from distributed import run_ranks

    root = str(tmp_path)
    run_ranks(4, _train, root)
    assert shardpoint.CheckpointManager(tmp_path / "disk", preemption_signals=()).steps() == [3]
    shutil.rmtree(tmp_path / "node1")  # node 1 replaced: a machine with empty memory
    run_ranks(4, _restore, root, [2, 3])
    # Node 1's memory was refilled by that restore; every process restarts on its node.
    run_ranks(4, _restore, root, [])


@pytest.mark.slow
def test_without_any_memory_the_disk_tier_is_used(tmp_path):
    from distributed import run_ranks

    root = str(tmp_path)
    run_ranks(4, _train, root)
    shutil.rmtree(tmp_path / "node0")
    shutil.rmtree(tmp_path / "node1")  # every node lost: memory cannot help
    run_ranks(4, _restore_from_disk, root)


def _restore_from_disk(rank: int, world: int, root: str) -> None:
    from torch.distributed.device_mesh import init_device_mesh

    _node_env(rank, root)
    mesh = init_device_mesh("cpu", (world,))
    manager = _manager(root)
    state = _template(rank, mesh)
    assert manager.restore(state) == 3
    expected = _state(rank, 3, mesh)
    assert torch.equal(state["sharded"].to_local(), expected["sharded"].to_local())
    manager.close()


def test_a_corrupt_memory_copy_is_never_used(tmp_path, monkeypatch):
    monkeypatch.setenv("SHARDPOINT_SHM_DIR", str(tmp_path / "shm"))
    manager = CheckpointManager(
        tmp_path / "disk",
        policy=SavePolicy(every_n_steps=1),
        memory=MemoryTierOptions(every_n_steps=1),
        preemption_signals=(),
    )
    manager.maybe_save(1, {"w": torch.ones(1000)})
    manager.save_to_memory(2, {"w": torch.full((1000,), 2.0)})
    manager.memory.wait()  # the copy is written in the background
    (shard,) = manager.memory.own_dir(2).glob("*.safetensors")
    raw = bytearray(shard.read_bytes())
    raw[-4] ^= 0xFF
    shard.write_bytes(raw)
    state = {"w": torch.zeros(1000)}
    with pytest.warns(UserWarning, match="not usable"):
        assert manager.restore(state) == 1  # the disk tier's older, intact step
    assert torch.equal(state["w"], torch.ones(1000))


@pytest.mark.parametrize("wrong", ["rank", "world_size", "step"])
def test_a_memory_copy_tagged_with_another_rank_world_size_or_step_is_refused(
    tmp_path, monkeypatch, wrong
):
    monkeypatch.setenv("SHARDPOINT_SHM_DIR", str(tmp_path / "shm"))
    manager = CheckpointManager(
        tmp_path / "disk",
        policy=SavePolicy(every_n_steps=1),
        memory=MemoryTierOptions(every_n_steps=1),
        preemption_signals=(),
    )
    manager.maybe_save(1, {"w": torch.ones(1000)})  # on disk and in memory
    manager.memory.wait()
    # Step 2's copy where this rank looks for it: a complete, intact checkpoint of the
    # right shape, but tagged (like every memory copy) as another rank's, another world
    # size's or another step's state.
    identity = {"rank": 0, "world_size": 1, "step": 2}
    identity[wrong] += 1
    shardpoint.save(
        {"w": torch.full((1000,), 2.0)},
        manager.memory.own_dir(2),
        metadata={"memory_tier": identity},
    )
    state = {"w": torch.zeros(1000)}
    with pytest.warns(UserWarning, match="belongs to"):
        assert manager.restore(state) == 1  # the disk tier, not the foreign copy
    assert torch.equal(state["w"], torch.ones(1000))


def test_a_new_run_never_restores_an_earlier_runs_memory_copy(tmp_path, monkeypatch):
    """Memory copies belong to the run in the directory: another project's directory of
    the same relative name, or this one deleted to start over, finds none of them."""
    monkeypatch.setenv("SHARDPOINT_SHM_DIR", str(tmp_path / "shm"))
    for project in ("a", "b"):
        (tmp_path / project).mkdir()

    def restored(project: str) -> tuple[int | None, list[float]]:
        monkeypatch.chdir(tmp_path / project)
        manager = CheckpointManager(
            "checkpoints",
            policy=SavePolicy(every_n_steps=1000),
            memory=MemoryTierOptions(every_n_steps=1),
            preemption_signals=(),
        )
        state = {"w": torch.zeros(4)}
        step = manager.restore(state)
        if step is None and project == "a":
            manager.save_to_memory(5, {"w": torch.ones(4)})
        manager.close()
        return step, state["w"].tolist()

    assert restored("a") == (None, [0.0] * 4)  # the first start saves step 5 to memory
    assert restored("a") == (5, [1.0] * 4)  # a restart of the run finds it
    assert restored("b") == (None, [0.0] * 4)  # same relative name, another project
    shutil.rmtree(tmp_path / "a" / "checkpoints")  # start over
    assert restored("a") == (None, [0.0] * 4)


def test_memory_budget_and_release(tmp_path):
    tier = MemoryTier("job", root=tmp_path, max_bytes=1000)
    tier.save(1, {"w": torch.zeros(1000)})
    with pytest.raises(CheckpointError, match="exceed max_bytes"):
        tier.wait()  # saves run in the background: their errors surface here
    tier = MemoryTier("job", root=tmp_path, max_bytes=10_000)
    tier.save(1, {"w": torch.zeros(1000)})
    tier.save(2, {"w": torch.ones(1000)})
    tier.wait()
    assert sorted(p.name for p in tier.own_dir(2).parent.iterdir()) == ["step-000000002"]
    tier.close(release=True)
    assert not tier.own_dir(2).exists()


def test_the_memory_budget_counts_the_step_kept_until_the_next_is_in_place(tmp_path):
    """Step 1's copy stays until step 2's is complete: both count against max_bytes."""
    tier = MemoryTier("job", root=tmp_path, max_bytes=6000)  # one 4,000-byte step fits
    tier.save(1, {"w": torch.zeros(1000)})
    tier.wait()
    tier.save(2, {"w": torch.ones(1000)})
    with pytest.raises(CheckpointError, match="held until the new copies are in place"):
        tier.wait()
    assert [p.name for p in tier.own_dir(1).parent.iterdir()] == ["step-000000001"]
    tier.close(release=True)


def test_stale_jobs_are_freed(tmp_path):
    stale = tmp_path / "old-job" / "own"
    stale.mkdir(parents=True)
    (stale / "x").write_bytes(b"1")
    os.utime(stale / "x", (0, 0))
    os.utime(stale, (0, 0))
    os.utime(tmp_path / "old-job", (0, 0))
    MemoryTier("new-job", root=tmp_path)
    assert not (tmp_path / "old-job").exists() and (tmp_path / "new-job").exists()


def test_stale_jobs_being_freed_by_another_rank_do_not_fail_a_start(tmp_path, monkeypatch):
    """Every rank of a node frees the same stale jobs at its start: files another rank
    has just removed (or links to nothing) must not fail this rank's start."""
    stale = tmp_path / "old-job" / "own"
    stale.mkdir(parents=True)
    (stale / "link").symlink_to(tmp_path / "nothing")
    os.utime(stale / "link", (0, 0), follow_symlinks=False)
    os.utime(stale, (0, 0))
    os.utime(tmp_path / "old-job", (0, 0))
    listed = Path.rglob

    def removed_meanwhile(self, pattern):  # noqa: ANN001, ANN202
        yield from listed(self, pattern)
        if self.name == "old-job":
            yield self / "own" / "removed-by-another-rank"

    MemoryTier("new-job", root=tmp_path)  # the link is looked at, not followed
    assert not (tmp_path / "old-job").exists()
    (tmp_path / "another-old-job").mkdir()
    os.utime(tmp_path / "another-old-job", (0, 0))
    monkeypatch.setattr(Path, "rglob", removed_meanwhile)
    (tmp_path / "old-job").mkdir()
    MemoryTier("new-job", root=tmp_path)  # another rank is removing old-job: left to it
    assert not (tmp_path / "another-old-job").exists()


def test_a_memory_save_only_stages_on_the_caller_and_keeps_the_values_at_the_call(tmp_path):
    """The caller returns once the state is staged; tensors changed right after the
    call do not change the copy, and a restore waits for the copy in flight."""
    tier = MemoryTier("job", root=tmp_path)
    state = {"w": torch.arange(300_000, dtype=torch.float32)}
    stall = tier.save(1, state)
    state["w"].fill_(-1.0)  # training goes on at once
    assert stall >= 0
    assert tier.newest_step() == 1  # waits for the save in flight
    restored = {"w": torch.zeros(300_000)}
    tier.restore(restored, 1)
    assert torch.equal(restored["w"], torch.arange(300_000, dtype=torch.float32))
    tier.close(release=True)


def _killed_during_the_background_write(root: str, kill_at: int) -> None:
    """Commit step 1 to memory, then die by SIGKILL at the ``kill_at``-th write of step
    2's background persist (the training thread has long returned)."""
    import signal

    from shardpoint.storage import direct_io

    tier = MemoryTier("job", root=root)
    tier.save(1, {"w": torch.full((10_000_000,), 1.0)})
    tier.wait()
    real, calls = direct_io.pwrite_all, [0]

    def pwrite_all(fd, data, offset):  # noqa: ANN001, ANN202
        calls[0] += 1
        if calls[0] == kill_at:
            os.kill(os.getpid(), signal.SIGKILL)
        return real(fd, data, offset)

    direct_io.pwrite_all = pwrite_all
    tier.save(2, {"w": torch.full((10_000_000,), 2.0)})
    tier.wait()
    os._exit(0)  # only reached if the kill point was never hit


@pytest.mark.slow
@pytest.mark.parametrize("kill_at", [1, 2])
def test_sigkill_during_a_background_memory_save_never_exposes_a_partial_copy(tmp_path, kill_at):
    import multiprocessing
    import signal

    child = multiprocessing.get_context("spawn").Process(
        target=_killed_during_the_background_write, args=(str(tmp_path), kill_at)
    )
    child.start()
    child.join(timeout=120)
    assert child.exitcode == -signal.SIGKILL, child.exitcode  # died mid-persist
    assert any((tmp_path / "job" / "own" / "rank00000").glob("step-000000002"))  # begun
    tier = MemoryTier("job", root=tmp_path)
    assert tier.newest_step() == 1  # the half-written step 2 is not a copy
    restored = {"w": torch.zeros(10_000_000)}
    tier.restore(restored, 1)
    assert torch.equal(restored["w"], torch.full((10_000_000,), 1.0))


def _two_nodes_tier(rank: int, root: str) -> MemoryTier:
    os.environ["LOCAL_WORLD_SIZE"] = "1"  # one rank per "node": the buddy is the other rank
    return MemoryTier("job", root=Path(root) / f"node{rank}")


def _receiver_killed_mid_exchange(rank: int, world: int, root: str) -> None:
    """Step 1 completes; during step 2's buddy exchange rank 1 dies by SIGKILL after
    writing the first file of its replica of rank 0's copy."""
    import signal

    import shardpoint.training.memory_tier as memory_tier

    tier = _two_nodes_tier(rank, root)
    tier.save(1, {"w": torch.full((1000,), 1.0 + rank)})
    tier.wait()
    if rank == 1:
        writes = [0]

        def dying_open(path, mode="r", *args, **kwargs):  # noqa: ANN001, ANN002, ANN003, ANN202
            if "replica" in str(path) and "w" in mode:
                writes[0] += 1
                if writes[0] == 2:  # the first replica file is on disk, the rest not
                    os.kill(os.getpid(), signal.SIGKILL)
            return open(path, mode, *args, **kwargs)

        memory_tier.open = dying_open  # the module's own name: nothing else is affected
    tier.save(2, {"w": torch.full((1000,), 2.0 + rank)})
    tier.wait()  # rank 0 waits here for its dead buddy until the harness stops it


def _restore_after_rank_0_was_replaced(rank: int, world: int, root: str) -> None:
    tier = _two_nodes_tier(rank, root)
    if rank == 0:
        shutil.rmtree(tier.base / "own")  # a new machine: only the buddy's replicas remain
    assert tier.newest_step() == 1  # rank 0's step 2 only exists as a half-written replica
    state = {"w": torch.zeros(1000)}
    tier.restore(state, 1)
    assert torch.equal(state["w"], torch.full((1000,), 1.0 + rank))


def test_a_buddy_killed_mid_exchange_leaves_no_replica_a_restore_would_use(tmp_path):
    from distributed import run_ranks, run_ranks_outcomes

    outcomes = run_ranks_outcomes(
        2, _receiver_killed_mid_exchange, str(tmp_path), errors=tmp_path / "errors", timeout=30
    )
    assert outcomes[1].killed_by_sigkill, outcomes[1]
    replica = tmp_path / "node1" / "job" / "replica" / "rank00000" / "step-000000002"
    assert replica.is_dir() and any(replica.iterdir())  # killed halfway through the copy
    run_ranks(2, _restore_after_rank_0_was_replaced, str(tmp_path))


def _save_with_rank_1_unable_to_list_its_copy(rank: int, world: int, root: str) -> None:
    import shardpoint.training.memory_tier as memory_tier

    _node_env(rank, root)
    if rank == 1:

        def unreadable(d):  # noqa: ANN001, ANN202
            raise PermissionError(13, "Permission denied (injected)", str(d))

        memory_tier.copy_files = unreadable
    tier = MemoryTier("job", root=Path(root) / f"shm{rank // 2}")
    tier.save(1, {"w": torch.full((100,), float(rank))})
    with pytest.raises(CheckpointError, match="injected"):
        tier.wait()  # on every rank: the failing one and its buddies alike
    tier.close(release=True)


def test_a_rank_that_cannot_list_its_copy_fails_the_memory_save_on_every_rank(tmp_path):
    """The file list is taken before the ranks agree: a rank whose listing fails joins
    the agreement with its error instead of leaving the others waiting for it."""
    from distributed import run_ranks_outcomes

    outcomes = run_ranks_outcomes(
        4, _save_with_rank_1_unable_to_list_its_copy, str(tmp_path), errors=tmp_path / "errors"
    )
    assert all(o.exitcode == 0 for o in outcomes), "\n".join(map(str, outcomes))


def _save_with_rank_1_unable_to_write_a_replica(rank: int, world: int, root: str) -> None:
    import errno

    import shardpoint.training.memory_tier as memory_tier

    _node_env(rank, root)
    tier = MemoryTier("job", root=Path(root) / f"shm{rank // 2}")
    tier.save(1, {"w": torch.full((100,), float(rank))})
    tier.wait()
    if rank == 1:  # its shared memory is full: the replica it receives cannot be written

        def full(path, mode="r", *args, **kwargs):  # noqa: ANN001, ANN002, ANN003, ANN202
            if "replica" in str(path) and "w" in mode:
                raise OSError(errno.ENOSPC, "No space left on device (injected)", str(path))
            return open(path, mode, *args, **kwargs)

        memory_tier.open = full  # the module's name for the builtin
    tier.save(2, {"w": torch.full((100,), 10.0 + rank)})
    with pytest.raises(CheckpointError, match="injected"):
        tier.wait()  # on every rank, none left waiting for rank 1
    if rank == 1:
        del memory_tier.open
    assert tier.newest_step() == 1  # as before the failed save: nothing of step 2 is left
    assert not any(tier.base.glob("*/*/step-000000002"))
    state = {"w": torch.zeros(100)}
    tier.restore(state, 1)
    assert torch.equal(state["w"], torch.full((100,), float(rank)))
    tier.close(release=True)


def test_a_replica_that_cannot_be_written_fails_the_memory_save_on_every_rank(tmp_path):
    """A full shared-memory file system on one rank (the replica it receives) is a
    ``CheckpointError`` on every rank, not a wait for the collective timeout."""
    from distributed import run_ranks_outcomes

    outcomes = run_ranks_outcomes(
        4,
        _save_with_rank_1_unable_to_write_a_replica,
        str(tmp_path),
        errors=tmp_path / "errors",
        timeout=60,
    )
    assert all(o.exitcode == 0 for o in outcomes), "\n".join(map(str, outcomes))


def _job_of_node_local_manager(rank: int, world: int, root: str, out: str) -> None:
    os.environ["LOCAL_RANK"] = "0"  # each rank a node of its own, with its own disk
    os.environ["SHARDPOINT_SHM_DIR"] = str(Path(root) / f"shm{rank}")
    manager = CheckpointManager(
        Path(root) / f"node{rank}",
        memory=MemoryTierOptions(every_n_steps=1),
        preemption_signals=(),
    )
    assert manager.per_node
    Path(f"{out}{rank}").write_text(manager.memory.base.name)
    manager.close()


@pytest.mark.slow
def test_the_memory_namespace_survives_rank_0_landing_on_a_replaced_node(tmp_path):
    """With node-local directories the run id is on every node's disk: when rank 0's
    node is replaced (its disk empty), the job keeps the namespace the other nodes'
    memory copies are under, and the new disk gets the id too."""
    from distributed import run_ranks

    out = str(tmp_path / "job")
    run_ranks(2, _job_of_node_local_manager, str(tmp_path), out)
    first = [Path(f"{out}{r}").read_text() for r in range(2)]
    shutil.rmtree(tmp_path / "node0")  # rank 0 restarts on a new machine
    run_ranks(2, _job_of_node_local_manager, str(tmp_path), out)
    again = [Path(f"{out}{r}").read_text() for r in range(2)]
    assert first == again  # (each simulated node's directory has its own path here)
    assert (tmp_path / "node0" / "run-id").read_text() == (
        tmp_path / "node1" / "run-id"
    ).read_text()
