"""Saves reuse the plan of the last save while no rank's structure changes, and any
change on any rank is caught before a byte is written with a stale plan."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
import torch.distributed
from distributed import count_received, run_ranks

import shardpoint
from shardpoint import dist as sp_dist
from shardpoint import tensor_kinds


def _count_collectives(log: list[tuple[str, int]]) -> None:
    """Record every call of shardpoint's coordination layer and its payload size."""
    depth = [0]  # first_error is built on max_of (...): count the outer call only
    for name in (
        "all_gather_json",
        "gather_json",
        "all_to_all_json",
        "gather_distinct_json",
        "scatter_json",
        "scatter_plan",
        "broadcast_json",
        "max_of",
        "first_error",
    ):
        real = getattr(sp_dist, name)

        def counted(value, *args, _real=real, _name=name, **kwargs):
            if depth[0] == 0:
                # gather_distinct_json(facts, value, ...): the value is the structure
                sent = [value, args[0]] if _name == "gather_distinct_json" else value
                sent = None if callable(sent) else sent  # scatter_plan(plan): rank 0's planner
                log.append((_name, len(json.dumps(sent))))
            depth[0] += 1
            try:
                return _real(value, *args, **kwargs)
            finally:
                depth[0] -= 1

        setattr(sp_dist, name, counted)


def _state(rank: int, step: int, own_rows: int) -> dict:
    torch.manual_seed(step)
    shared = {f"layer{i}": torch.randn(64, 8) for i in range(50)}  # the same on both ranks
    # A tensor only this rank holds (under a per-rank key): its shape is the change.
    own = {str(rank): torch.full((own_rows, 3), float(10 * rank + step))}
    return {"shared": shared, "own": own, "step": step}


def _saves(rank: int, world: int, root: str, changed_at: int) -> None:
    log: list[tuple[str, int]] = []
    _count_collectives(log)
    per_save = []
    for step in range(4):
        rows = 5 if rank == 1 and step >= changed_at else 2  # rank 1 alone changes
        before = len(log)
        shardpoint.save(_state(rank, step, rows), f"{root}/step{step}")
        per_save.append(log[before:])
    if rank == 0:
        with open(f"{root}/collectives.json", "w") as f:
            json.dump(per_save, f)


def _check_values(root: str, step: int, rows_of_rank_1: int) -> None:
    with shardpoint.open(f"{root}/step{step}") as ckpt:
        expected = _state(0, step, 2)["shared"]
        for name, tensor in expected.items():
            assert torch.equal(ckpt.get(f"shared.{name}"), tensor)
        assert torch.equal(ckpt.get("own.0"), torch.full((2, 3), float(step)))
        assert torch.equal(ckpt.get("own.1"), torch.full((rows_of_rank_1, 3), 10.0 + step))


def test_an_unchanged_structure_is_not_gathered_again_and_a_change_on_one_rank_is_caught(
    tmp_path,
):
    run_ranks(2, _saves, str(tmp_path), 2)
    per_save = json.loads((tmp_path / "collectives.json").read_text())
    kinds = [[kind for kind, _ in save] for save in per_save]
    # First save (no plan yet on any rank): every rank's errors and structure to rank 0
    # (each distinct structure once), each rank's part of the plan from it, then the
    # commit's gather and outcome.
    first = ["gather_distinct_json", "scatter_plan", "gather_json", "broadcast_json"]
    assert kinds[0] == first
    # Unchanged structure: written with the cached plan at once; the commit's gather
    # (carrying the plan's digest) and its outcome are the save's only collective.
    assert kinds[1] == ["gather_json", "broadcast_json"]
    # The commit's report of a steady save is that of the first save plus the plan's
    # digest: the structure (the 50 replicated tensors, gathered once) is not sent again.
    steady_report, first_report = per_save[1][0][1], per_save[0][2][1]
    assert 0 < steady_report - first_report < 60
    # Rank 1 changed one tensor's shape: it writes nothing, the commit's verdict has
    # every rank remove what it wrote, and both save again, agreed first.
    assert kinds[2] == ["gather_json", "broadcast_json", *first]
    # ...and the new plan is reused from then on.
    assert kinds[3] == kinds[1]
    for step in range(4):
        _check_values(str(tmp_path), step, 5 if step >= 2 else 2)
        assert shardpoint.verify(tmp_path / f"step{step}").ok


def _steady_saves(rank: int, world: int, root: str) -> None:
    log: list[tuple[str, int]] = []
    count_received(log)
    saves = []
    for step in range(3):
        before = len(log)
        shardpoint.save(_state(rank, step, 2), f"{root}/step{step}")
        saves.append(log[before:])
    if rank == 1:
        with open(f"{root}/received.json", "w") as f:
            json.dump({"first": saves[0], "steady": saves[-1]}, f)


@pytest.fixture(scope="module")
def received_on_2_and_4_ranks(tmp_path_factory):
    """Three saves on 2 and on 4 ranks: per world, its directory and what rank 1
    received during the first save and during a steady one."""
    out = {}
    for world in (2, 4):
        root = tmp_path_factory.mktemp(f"world{world}")
        run_ranks(world, _steady_saves, str(root))
        out[world] = (root, json.loads((root / "received.json").read_text()))
    return out


@pytest.mark.slow
def test_what_a_rank_receives_per_unchanged_save_does_not_grow_with_the_ranks(
    received_on_2_and_4_ranks,
):
    """Coordination per steady-state save: each rank but rank 0 receives the same bytes
    in the same torch.distributed calls on 2 ranks as on 4 (at 16,384 ranks an
    all-gather of even 100 bytes per rank would send 1.6 MB to every rank, 27 GB in all,
    every save)."""
    seen = {}
    for world, (root, received) in received_on_2_and_4_ranks.items():
        seen[world] = received["steady"]
        for step in range(3):
            assert shardpoint.verify(root / f"step{step}").ok
    assert seen[2] == seen[4]
    assert [name for name, _ in seen[2]] == [
        "gather",  # the commit (no agreement before it): this rank's result size...
        "send",  # ...and its bytes
        "broadcast",  # the outcome's size...
        "broadcast",  # ...and its bytes
    ]
    assert sum(n for _, n in seen[2]) < 100


def test_what_a_rank_receives_to_plan_a_save_does_not_grow_with_the_ranks(
    received_on_2_and_4_ranks,
):
    """The first save (and any after a change) gathers every rank's structure to rank
    0 alone, each distinct one once (here every rank holds the same 50 replicated
    tensors), and each rank receives only its own writes: on 4 ranks rank 1 receives
    no more than on 2 (its share of the replicated tensors shrinks), and no all-gather
    sends it every rank's structure."""
    seen = {world: received["first"] for world, (_, received) in received_on_2_and_4_ranks.items()}
    for world, log in seen.items():
        assert "all_gather" not in [name for name, _ in log], (world, log)
    assert sum(n for _, n in seen[4]) <= sum(n for _, n in seen[2]), seen


def _count_mesh_reads(rank: int, world: int, root: str) -> None:
    from torch.distributed.device_mesh import DeviceMesh, init_device_mesh
    from torch.distributed.tensor import Shard, distribute_tensor

    mesh = init_device_mesh("cpu", (world,))
    state = {f"p{i}": distribute_tensor(torch.randn(8, 4), mesh, [Shard(0)]) for i in range(50)}
    real = DeviceMesh.mesh
    real_layout = tensor_kinds.compute_local_shape_and_global_offset
    reads = {"mesh": 0, "layout": 0}

    def counted(self):
        reads["mesh"] += 1
        return real.fget(self)

    def counted_layout(*args):
        reads["layout"] += 1
        return real_layout(*args)

    DeviceMesh.mesh = property(counted)
    tensor_kinds.compute_local_shape_and_global_offset = counted_layout
    try:
        for step in range(2):
            shardpoint.save(state, f"{root}/step{step}")
    finally:
        DeviceMesh.mesh = real
        tensor_kinds.compute_local_shape_and_global_offset = real_layout
    with open(f"{root}/reads{rank}.json", "w") as f:
        json.dump(reads, f)


def test_a_save_reads_each_device_meshs_ranks_once_not_once_per_dtensor(tmp_path):
    """Reading a DeviceMesh's ranks costs O(ranks) (1.3 ms at 16,384 ranks): done per
    DTensor, a steady save of 10,000 of them spent 13 s on it (bench_plan_scale's real
    DTensor row); torch's layout of a shard costs ~20 µs, and a mixture-of-experts
    state repeats a few shapes 100,000 times. Two saves of 50 DTensors of one shape on
    one mesh read the mesh once and compute the layout once."""
    run_ranks(2, _count_mesh_reads, str(tmp_path))
    reads = [json.loads((tmp_path / f"reads{r}.json").read_text()) for r in (0, 1)]
    assert reads == [{"mesh": 1, "layout": 1}] * 2
    assert shardpoint.verify(tmp_path / "step1").ok


def _sharded_saves(rank: int, world: int, root: str) -> None:
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Shard, distribute_tensor

    mesh = init_device_mesh("cpu", (world,))
    for step in range(3):
        rows = 8 if step < 2 else 12  # every rank's DTensor grows at once
        full = torch.arange(rows * 4, dtype=torch.float32).reshape(rows, 4) + step
        shardpoint.save({"w": distribute_tensor(full, mesh, [Shard(0)])}, f"{root}/step{step}")


def test_a_sharded_tensor_that_changes_shape_on_every_rank_is_saved_with_a_new_plan(tmp_path):
    """Every rank changes at once, so no rank wrote the cached plan: rank 0's cached
    description of the sharded entry (its global shape) must not describe the chunks
    written with the new one."""
    run_ranks(2, _sharded_saves, str(tmp_path))
    for step in range(3):
        rows = 8 if step < 2 else 12
        expected = torch.arange(rows * 4, dtype=torch.float32).reshape(rows, 4) + step
        assert shardpoint.verify(tmp_path / f"step{step}").ok
        with shardpoint.open(tmp_path / f"step{step}") as ckpt:
            assert torch.equal(ckpt.get("w"), expected)


def _restarted_saves(rank: int, world: int, root: str, port: int, replaced: bool) -> None:
    import torch.distributed as torch_dist

    from shardpoint import save_plan

    for step in range(2):  # the plan is cached on every rank
        shardpoint.save(_state(rank, step, 2), f"{root}/step{step}")
    torch_dist.destroy_process_group()
    if replaced and rank == 1:  # a new process in its place: nothing of shardpoint's cached
        save_plan.PLANS.clear()
        sp_dist._WORLD = sp_dist._CPU_GROUP = None
    torch_dist.init_process_group(
        "gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world
    )
    for step in (2, 3):  # rank 1's own tensor has a new shape: a stale plan would lose it
        shardpoint.save(_state(rank, step, 5 if rank == 1 else 2), f"{root}/step{step}")


@pytest.mark.slow
@pytest.mark.parametrize("replaced", [False, True], ids=["same-processes", "rank-1-replaced"])
def test_a_process_group_initialized_again_in_the_same_processes_saves_with_a_new_plan(
    tmp_path, replaced
):
    """An in-process restart: every rank re-initializes torch.distributed, and with
    ``replaced`` rank 1 stands for a new process (nothing cached). Every rank drops
    what it cached for the old group, so all take the agreed path together."""
    from distributed import _free_port

    run_ranks(2, _restarted_saves, str(tmp_path), _free_port(), replaced)
    for step, rows in ((1, 2), (2, 5), (3, 5)):
        _check_values(str(tmp_path), step, rows)


# ---- background saves (AsyncSaver): the same plans, speculated on staged copies ----------


def _bump(state: dict) -> None:
    """What training does once a background save returned: change every tensor in place."""
    for t in [*state["shared"].values(), *state["own"].values()]:
        t.add_(1000)


def _background_saves(rank: int, world: int, root: str) -> None:
    log: list[tuple[str, int]] = []
    _count_collectives(log)
    saver = shardpoint.AsyncSaver()
    per_save = []
    for step in range(4):
        rows = 5 if rank == 1 and step >= 2 else 2  # rank 1 alone changes, at step 2
        before = len(log)
        state = _state(rank, step, rows)
        handle = saver.save(state, f"{root}/step{step}")
        _bump(state)  # the save must hold the values at the call, on every rank
        handle.wait()
        per_save.append([kind for kind, _ in log[before:]])
    saver.close()
    if rank == 0:
        with open(f"{root}/collectives.json", "w") as f:
            json.dump(per_save, f)


def test_an_unchanged_background_save_has_one_collective_and_a_changed_rank_waits_for_its_part(
    tmp_path,
):
    """A background save speculates like a synchronous one: with its structure unchanged
    its only collective is the commit's gather and outcome. When rank 1's structure
    changes, it writes nothing and copies all it holds (it fits in its staging pool)
    before its caller moves on; the commit's *again* keeps what rank 0 wrote, and rank
    1 writes its part of a plan made around it from that copy, so the checkpoint holds
    the state at the call, not the bumped one."""
    run_ranks(2, _background_saves, str(tmp_path))
    kinds = json.loads((tmp_path / "collectives.json").read_text())
    first = ["gather_distinct_json", "scatter_plan", "gather_json", "broadcast_json"]
    assert kinds[0] == first
    assert kinds[1] == ["gather_json", "broadcast_json"]
    assert kinds[2] == ["gather_json", "broadcast_json", *first]
    assert kinds[3] == kinds[1]
    for step in range(4):
        _check_values(str(tmp_path), step, 5 if step >= 2 else 2)
        assert shardpoint.verify(tmp_path / f"step{step}").ok


def _grown_state(rank: int, step: int) -> dict:
    """From step 2 on every rank: one replicated tensor has a new shape and a new one
    appears (as an optimizer's moments do after its first step)."""
    state = _state(rank, step, 2)
    if step >= 2:
        torch.manual_seed(100 + step)
        state["shared"]["layer3"] = torch.randn(80, 8)
        state["shared"]["moment"] = torch.randn(40, 8)
    return state


def _save_and_bump(rank: int, root: str, steps: int, make_state) -> None:
    """Background saves of ``make_state(rank, step)``, each bumped once save returned."""
    saver = shardpoint.AsyncSaver()
    for step in range(steps):
        state = make_state(rank, step)
        handle = saver.save(state, f"{root}/step{step}")
        _bump(state)
        handle.wait()
    saver.close()


def _grown_background_saves(rank: int, world: int, root: str) -> None:
    _save_and_bump(rank, root, 4, _grown_state)


def _large_change_saves(rank: int, world: int, root: str) -> None:
    from shardpoint import saving

    waited = []
    real = saving._plan_unsettled_again

    def recording(plan, options):
        waited.append(True)
        return real(plan, options)

    saving._plan_unsettled_again = recording
    _save_and_bump(rank, root, 3, _large_state)
    with open(f"{root}/waited{rank}.json", "w") as f:
        json.dump(len(waited), f)


def _large_state(rank: int, step: int) -> dict:
    """24 MB the ranks share (each writes half: one 16 MB staging slot holds it) and a
    tensor of rank 1's own that grows at step 2."""
    torch.manual_seed(step)
    shared = {"a": torch.randn(3_000_000), "b": torch.randn(3_000_000)}
    rows = 5 if rank == 1 and step == 2 else 2
    return {"shared": shared, "own": {str(rank): torch.full((rows, 3), float(rank + step))}}


def test_a_changed_rank_whose_state_exceeds_its_staging_pool_waits_for_its_part(tmp_path):
    """Rank 1 changes, and all it holds (24 MB) is more than its staging pool (16 MB):
    instead of a host copy of all of it, it waits in save() for the plan made around
    what rank 0 wrote and stages its part; the checkpoint holds the state at the call."""
    run_ranks(2, _large_change_saves, str(tmp_path))
    assert [json.loads((tmp_path / f"waited{r}.json").read_text()) for r in (0, 1)] == [0, 1]
    for step in range(3):
        expected = _large_state(1, step)
        assert shardpoint.verify(tmp_path / f"step{step}").ok
        with shardpoint.open(tmp_path / f"step{step}") as ckpt:
            for name in ("a", "b"):
                assert torch.equal(ckpt.get(f"shared.{name}"), expected["shared"][name])
            assert torch.equal(ckpt.get("own.1"), expected["own"]["1"])


def test_a_background_save_in_which_every_rank_changed_is_planned_again_at_the_call(tmp_path):
    """No rank is steady: the cached pieces of the reshaped tensor are dropped (no rank
    holds that chunk any more), the rest stay with their writers, and the new tensor
    is planned among the ranks, each writing from the copy it made at the call."""
    run_ranks(2, _grown_background_saves, str(tmp_path))
    for step in range(4):
        expected = _grown_state(0, step)
        assert shardpoint.verify(tmp_path / f"step{step}").ok
        with shardpoint.open(tmp_path / f"step{step}") as ckpt:
            names = {n for n in ckpt.keys() if n.startswith("shared.")}
            assert names == {f"shared.{n}" for n in expected["shared"]}
            for name, tensor in expected["shared"].items():
                assert torch.equal(ckpt.get(f"shared.{name}"), tensor), (step, name)
            assert torch.equal(ckpt.get("own.1"), torch.full((2, 3), 10.0 + step))


def _written_by(directory: str, rank: int) -> list[str]:
    """The tensors whose chunks ``rank`` wrote into ``directory``'s checkpoint."""
    with open(f"{directory}/index.json") as f:
        index = json.load(f)
    prefix = f"rank{rank:05d}-"
    return sorted(
        name
        for name, entry in index["tensors"].items()
        if all(c["file"].startswith(prefix) for c in entry["chunks"])
    )


def _dropping_background_saves(rank: int, world: int, root: str) -> None:
    saver = shardpoint.AsyncSaver()
    saver.save(_state(rank, 0, 2), f"{root}/step0").wait()
    # A replicated tensor the plan gave rank 1 to write, which rank 1 then drops while
    # rank 0 keeps it: rank 0 staged only its own share and has moved on.
    dropped = next(n for n in _written_by(f"{root}/step0", 1) if n.startswith("shared."))
    state = _state(rank, 1, 2)
    if rank == 1:
        del state["shared"][dropped.removeprefix("shared.")]
    with pytest.raises(
        shardpoint.CheckpointError, match="cannot be completed from what was staged"
    ):
        saver.save(state, f"{root}/step1").wait()
    torch.distributed.barrier()  # rank 0 has cleaned up
    assert not (Path(root) / "step1").exists() or not any((Path(root) / "step1").iterdir())
    # The next save agrees first, and commits.
    saver.save(_state(rank, 2, 2), f"{root}/step2").wait()
    saver.close()


def test_a_background_save_that_cannot_be_completed_around_what_was_staged_fails_cleanly(tmp_path):
    """The one case a structure change costs a background checkpoint: a replicated
    chunk whose cached writer no longer holds it, held only by ranks that staged their
    own share. Every rank's handle says so, nothing of it is left, the checkpoint
    before it is untouched and the next save commits."""
    run_ranks(2, _dropping_background_saves, str(tmp_path))
    assert shardpoint.verify(tmp_path / "step0").ok
    _check_values(str(tmp_path), 0, 2)
    _check_values(str(tmp_path), 2, 2)


def _failing_background_saves(rank: int, world: int, root: str) -> None:
    saver = shardpoint.AsyncSaver()
    saver.save(_state(rank, 0, 2), f"{root}/step0").wait()
    state = _state(rank, 1, 2)
    if rank == 1:  # a value rank 1 cannot save: it fails before staging, the plan cached
        state["own"]["1"] = state["own"]["1"].to_sparse()
    handle = saver.save(state, f"{root}/step1")
    error = handle.exception()
    assert isinstance(error, shardpoint.CheckpointError), error
    assert "rank 1" in str(error) and "layout" in str(error), error
    assert not (Path(root) / "step1" / "index.json").exists()
    saver.save(_state(rank, 2, 2), f"{root}/step2").wait()
    saver.close()


def test_a_rank_that_fails_before_staging_a_speculative_background_save_fails_it_everywhere(
    tmp_path,
):
    """No collective precedes a steady background save's staging: a rank that cannot
    save still joins the commit with its error, so both handles raise it, rank 0 commits
    nothing, and the next save agrees first and commits."""
    run_ranks(2, _failing_background_saves, str(tmp_path))
    assert shardpoint.verify(tmp_path / "step0").ok
    assert not (tmp_path / "step1" / "index.json").exists()
    _check_values(str(tmp_path), 2, 2)
