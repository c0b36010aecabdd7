"""shardpoint's coordination helpers (dist.py): what each rank receives must not grow
with the number of ranks."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from distributed import count_received, run_ranks, run_ranks_outcomes

WORLD = 4
FAILING = (1, 3)


def _first_error(rank: int, world: int, root: str) -> None:
    from shardpoint import dist as sp_dist

    log: list[tuple[str, int]] = []
    count_received(log)
    none = sp_dist.first_error(None)
    quiet = list(log)
    # Long messages: a rank that received every failing rank's would show it in bytes.
    error = f"rank {rank} failed: " + "x" * 5000 if rank in FAILING else None
    first = sp_dist.first_error(error)
    Path(root, f"rank{rank}.json").write_text(json.dumps([none, quiet, first, log[len(quiet) :]]))


@pytest.mark.slow
def test_first_error_gives_every_rank_the_lowest_failing_ranks_message_and_no_other(tmp_path):
    run_ranks(WORLD, _first_error, str(tmp_path))
    for rank in range(WORLD):
        none, quiet, first, log = json.loads((tmp_path / f"rank{rank}.json").read_text())
        assert none is None and [name for name, _ in quiet] == ["all_reduce"], quiet
        assert first.startswith("rank 1 failed: "), (rank, first[:40])
        assert "all_gather" not in [name for name, _ in log], log
        # One integer, then one message's size and bytes (rank 1 receives nothing).
        assert sum(n for _, n in log) <= 8 + 8 + len(first) + 2, (rank, log)


def _failed_plan(rank: int, world: int, root: str) -> None:
    from shardpoint import dist as sp_dist
    from shardpoint.errors import CheckpointError

    def plan() -> list:
        raise ValueError("no plan today")

    part = sp_dist.scatter_plan(lambda: [f"part {r}" for r in range(world)])
    raised = []
    for failing in (plan, lambda: ["one part"]):  # raises; a part short
        try:
            sp_dist.scatter_plan(failing if rank == 0 else None)
            raised.append(None)
        except (ValueError, CheckpointError) as exc:
            raised.append(f"{type(exc).__name__}: {exc}")
    Path(root, f"rank{rank}.json").write_text(json.dumps([part, raised]))


def test_a_plan_that_fails_on_rank_0_fails_every_rank_instead_of_hanging(tmp_path):
    # A rank left waiting for its part would hang: killed after 60 s, reported as such.
    outcomes = run_ranks_outcomes(3, _failed_plan, str(tmp_path), errors=tmp_path, timeout=60)
    assert [o.exitcode for o in outcomes] == [0, 0, 0], outcomes
    for rank in range(3):
        part, raised = json.loads((tmp_path / f"rank{rank}.json").read_text())
        assert part == f"part {rank}"
        short = "a plan of 1 parts for 3 ranks"
        if rank == 0:
            assert raised == ["ValueError: no plan today", f"ValueError: {short}"]
        else:
            assert raised == [
                "CheckpointError: rank 0 could not plan: no plan today",
                f"CheckpointError: rank 0 could not plan: {short}",
            ]


def _save_whose_plan_fails(rank: int, world: int, root: str) -> None:
    import torch

    import shardpoint
    from shardpoint import save_plan
    from shardpoint.errors import CheckpointError

    state = {"w": torch.ones(4), "step": 1}
    real = save_plan._plan_job
    save_plan._plan_job = lambda *a: (_ for _ in ()).throw(RuntimeError("planner bug"))
    try:
        shardpoint.save(state, f"{root}/ckpt")
        raised = None
    except (RuntimeError, CheckpointError) as exc:
        raised = type(exc).__name__
    save_plan._plan_job = real
    shardpoint.save(state, f"{root}/ckpt")  # the directory was released: saving works
    Path(root, f"save{rank}.json").write_text(json.dumps(raised))


def test_a_save_whose_planning_fails_on_rank_0_raises_everywhere_and_can_be_retried(tmp_path):
    import shardpoint

    run_ranks(2, _save_whose_plan_fails, str(tmp_path))
    raised = [json.loads((tmp_path / f"save{r}.json").read_text()) for r in range(2)]
    assert raised == ["RuntimeError", "CheckpointError"]
    assert shardpoint.verify(tmp_path / "ckpt").ok
