"""shardpoint's coordination helpers (dist.py): what each rank receives must not grow
with the number of ranks."""

from __future__ import annotations

import json
from pathlib import Path

from distributed import count_received, run_ranks

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


def test_first_error_gives_every_rank_the_lowest_failing_ranks_message_and_no_other(tmp_path):
    run_ranks(WORLD, _first_error, str(tmp_path))
    for rank in range(WORLD):
        none, quiet, first, log = json.loads((tmp_path / f"rank{rank}.json").read_text())
        assert none is None and [name for name, _ in quiet] == ["all_reduce"], quiet
        assert first.startswith("rank 1 failed: "), (rank, first[:40])
        assert "all_gather" not in [name for name, _ in log], log
        # One integer, then one message's size and bytes (rank 1 receives nothing).
        assert sum(n for _, n in log) <= 8 + 8 + len(first) + 2, (rank, log)
