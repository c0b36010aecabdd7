"""Saves reuse the plan of the last save while no rank's structure changes, and any
change on any rank is caught before a byte is written with a stale plan."""

from __future__ import annotations

import json

import pytest
import torch
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

    from shardpoint import saving

    for step in range(2):  # the plan is cached on every rank
        shardpoint.save(_state(rank, step, 2), f"{root}/step{step}")
    torch_dist.destroy_process_group()
    if replaced and rank == 1:  # a new process in its place: nothing of shardpoint's cached
        saving._PLANS.clear()
        sp_dist._WORLD = sp_dist._CPU_GROUP = sp_dist._BACKGROUND_GROUP = None
    torch_dist.init_process_group(
        "gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world
    )
    for step in (2, 3):  # rank 1's own tensor has a new shape: a stale plan would lose it
        shardpoint.save(_state(rank, step, 5 if rank == 1 else 2), f"{root}/step{step}")


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
