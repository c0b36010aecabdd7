"""Saves reuse the plan of the last save while no rank's structure changes, and any
change on any rank is caught before a byte is written with a stale plan."""

from __future__ import annotations

import json

import torch
from distributed import run_ranks

import shardpoint
from shardpoint import dist as sp_dist


def _count_collectives(log: list[tuple[str, int]]) -> None:
    """Record every collective of shardpoint's coordination layer and its payload size."""
    depth = [0]  # broadcast_json is built on all_gather_json: count the outer call only
    for name in ("all_gather_json", "gather_json", "broadcast_json"):
        real = getattr(sp_dist, name)

        def counted(value, *args, _real=real, _name=name, **kwargs):
            if depth[0] == 0:
                log.append((_name, len(json.dumps(value))))
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
    # First save: the agreement, the structure gather, the commit's gather and outcome.
    assert kinds[0] == ["all_gather_json", "all_gather_json", "gather_json", "broadcast_json"]
    # Unchanged structure: the agreement alone before writing, no structure payload.
    assert kinds[1] == ["all_gather_json", "gather_json", "broadcast_json"]
    agreement = per_save[1][0][1]
    structure = per_save[0][1][1]
    assert agreement < 200 < structure  # 50 replicated tensors are not sent again
    # Rank 1 changed one tensor's shape: both ranks plan again before writing...
    assert kinds[2] == kinds[0]
    # ...and the new plan is reused from then on.
    assert kinds[3] == kinds[1]
    for step in range(4):
        _check_values(str(tmp_path), step, 5 if step >= 2 else 2)
        assert shardpoint.verify(tmp_path / f"step{step}").ok
