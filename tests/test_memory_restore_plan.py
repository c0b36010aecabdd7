"""Unit tests of the memory tier's restore plan (``training/memory_restore_plan.py``): a
pure function from every rank's holdings to each rank's part of the restore. The
end-to-end restores are in tests/test_memory_tier.py and tests/test_memory_erasure.py."""

from __future__ import annotations

from typing import Any

from shardpoint.training.erasure import Placement
from shardpoint.training.memory_restore_plan import restore_roles

# What a send meets on the other rank (an XOR chain's last link reaches the rebuilder).
SENDS = {
    "send": {"receive"},
    "send_piece": {"receive_piece"},
    "chain_send": {"chain_receive", "receive_piece"},
}
ALONE = {"local_piece", "adopt"}


def _files(rank: int, step: int) -> dict[str, int]:
    return {f"rank00000-0000{rank}.safetensors": 100 + rank + step, "index.json": 7, "COMMITTED": 5}


def _slot(own: dict[int, list[int]] | None = None, held: dict[int, list[int]] | None = None):  # noqa: ANN202
    """One rank's holdings: ``own``/``held``: whose -> steps."""
    return {
        "own": {str(w): {str(s): _files(w, s) for s in steps} for w, steps in (own or {}).items()},
        "held": {
            str(w): {str(s): _files(w, s) for s in steps} for w, steps in (held or {}).items()
        },
        "parity": {},
    }


def _parity_job(world: int, m: int, step: int, wiped: set[int]) -> list[dict[str, Any]]:
    """One rank per node, every rank in one parity group; the nodes ``wiped`` hold
    nothing (their copy and their parity are gone)."""
    pl = Placement(tuple(range(world)), m)
    files = [_files(r, step) for r in range(world)]
    out = []
    for r in range(world):
        slot = _slot()
        if r not in wiped:
            p = pl.position(r)
            codewords = {
                str(j): {
                    "piece": pl.k + pl.holders(j).index(p),
                    "data_hashes": [f"data{j}.{d}" for d in range(pl.k)],
                    "parity_hash": f"parity{j}.{pl.holders(j).index(p)}",
                }
                for j in range(world)
                if p in pl.holders(j)
            }
            manifest = {
                "step": step,
                "members": list(pl.members),
                "parity": m,
                "chunk_bytes": 64,
                "files": files,
                "codewords": codewords,
            }
            slot = _slot(own={r: [step]})
            slot["parity"] = {str(r): {str(step): manifest}}
        out.append(slot)
    return out


def _run(roles: list[dict[str, Any]]) -> None:
    """Play the plan with blocking point-to-point transfers: a transfer completes when
    both ranks have reached it. Fails if two ranks would wait on each other forever."""
    at = [0] * len(roles)
    transfers = [r["transfers"] for r in roles]
    progress = True
    while progress:
        progress = False
        for rank, mine in enumerate(transfers):
            if at[rank] == len(mine):
                continue
            kind, other, _ = mine[at[rank]]
            if kind in ALONE:
                assert other == rank
                at[rank] += 1
                progress = True
            elif kind in SENDS and at[other] < len(transfers[other]):
                their_kind, their_other, _ = transfers[other][at[other]]
                if their_kind in SENDS[kind] and their_other == rank:
                    at[rank] += 1
                    at[other] += 1
                    progress = True
    stuck = {r: transfers[r][at[r]] for r in range(len(roles)) if at[r] < len(transfers[r])}
    assert not stuck, f"ranks wait forever: {stuck}"


def test_every_rank_with_its_own_copy_restores_the_newest_step_without_a_transfer():
    holdings = [_slot(own={r: [3, 5]}) for r in range(4)]
    roles = restore_roles(holdings, 4)
    assert [r["step"] for r in roles] == [5] * 4
    assert all(r["transfers"] == [] for r in roles)
    assert "ranks_from_buddies" not in roles[0] and "ranks_rebuilt" not in roles[0]


def test_the_newest_step_is_the_newest_that_every_rank_can_recover():
    holdings = [_slot(own={0: [3, 5]}), _slot(own={1: [3]})]  # rank 1 never got to step 5
    assert [r["step"] for r in restore_roles(holdings, 2)] == [3, 3]


def test_a_rank_without_its_own_copy_receives_its_buddys_replica():
    # Two nodes of one rank: node 1 was replaced; rank 0 holds rank 1's replica.
    holdings = [_slot(own={0: [4]}, held={1: [4]}), _slot(held={0: [4]})]
    roles = restore_roles(holdings, 2)
    assert roles[0]["transfers"] == [["send", 1, {"whose": 1, "own": False}]]
    assert roles[1]["transfers"] == [["receive", 0, _files(1, 4)]]
    assert roles[0]["ranks_from_buddies"] == [1]
    _run(roles)


def test_a_rank_takes_its_own_copy_over_a_replica_on_a_lower_rank():
    holdings = [_slot(own={0: [2]}, held={1: [2]}), _slot(own={1: [2]}, held={0: [2]})]
    roles = restore_roles(holdings, 2)
    assert all(r["transfers"] == [] for r in roles)


def test_a_replica_of_its_own_in_a_ranks_slot_is_adopted_in_place():
    # No own copies left (the ranks moved between nodes), but each slot now holds a
    # replica of its new rank's copy.
    holdings = [_slot(held={0: [6]}), _slot(held={1: [6]})]
    roles = restore_roles(holdings, 2)
    assert roles[0]["transfers"] == [["adopt", 0, None]]
    assert roles[1]["transfers"] == [["adopt", 1, None]]


def test_an_own_copy_left_in_another_ranks_slot_is_sent_to_its_owner():
    # Ranks 1 and 2 came back on each other's nodes; the plan lists rank 1's transfer
    # first on both ranks, then rank 2's.
    holdings = [_slot(own={0: [6]}), _slot(own={2: [6]}), _slot(own={1: [6]})]
    roles = restore_roles(holdings, 3)
    assert roles[1]["transfers"] == [
        ["receive", 2, _files(1, 6)],
        ["send", 2, {"whose": 2, "own": True}],
    ]
    assert roles[2]["transfers"] == [
        ["send", 1, {"whose": 1, "own": True}],
        ["receive", 1, _files(2, 6)],
    ]
    assert roles[0]["ranks_from_buddies"] == [1, 2]
    _run(roles)


def test_when_no_step_is_recoverable_rank_0_is_told_whose_copies_of_the_newest_are_gone():
    holdings = [_slot(own={0: [7]}), _slot(), _slot(own={2: [7]})]
    roles = restore_roles(holdings, 3)
    assert [r["step"] for r in roles] == [None] * 3
    assert roles[0]["lost"] == {"step": 7, "ranks": [1]}
    assert all(r["transfers"] == [] for r in roles)


def test_an_empty_job_has_no_step_and_nothing_lost():
    roles = restore_roles([_slot(), _slot()], 2)
    assert roles == [{"step": None, "transfers": []}] * 2


def test_a_wiped_rank_is_rebuilt_from_xor_parity_summed_along_a_chain():
    pl = Placement((0, 1, 2), 1)
    roles = restore_roles(_parity_job(3, 1, 9, wiped={1}), 3)
    assert [r["step"] for r in roles] == [9] * 3
    assert roles[0]["ranks_rebuilt"] == [1]
    assert roles[1]["rebuild"] == {
        "chunk_bytes": 64,
        "data": 2,
        "parity": 1,
        "chunks": [[j, pl.data(j).index(1)] for j in pl.chunks(1)],
        "files": _files(1, 9),
    }
    # One chunk per codeword reaches the rebuilding rank: the sum of the other k pieces.
    received = roles[1]["transfers"]
    assert [t[0] for t in received] == ["receive_piece"] * len(pl.chunks(1))
    assert all(t[2]["index"] == "sum" for t in received)
    assert all(
        t[0] in ("chain_send", "chain_receive") for r in (0, 2) for t in roles[r]["transfers"]
    )
    for t in received:  # the chain's last link carries the checksum of its own piece
        last = [s for s in roles[t[1]]["transfers"] if s[0] == "chain_send" and s[1] == 1]
        assert last and all("hash" in s[2] for s in last)
    _run(roles)


def test_two_wiped_ranks_are_rebuilt_from_k_pieces_of_each_codeword():
    pl = Placement((0, 1, 2, 3), 2)
    roles = restore_roles(_parity_job(4, 2, 3, wiped={0, 2}), 4)
    assert [r["step"] for r in roles] == [3] * 4
    assert roles[0]["ranks_rebuilt"] == [0, 2]
    for owner in (0, 2):
        got = [t for t in roles[owner]["transfers"] if t[0] == "receive_piece"]
        assert len(got) == pl.k * len(pl.chunks(pl.position(owner)))
        for j in pl.chunks(pl.position(owner)):  # k distinct pieces of each codeword
            pieces = [t[2] for t in got if t[2]["codeword"] == j]
            assert len({piece["index"] for piece in pieces}) == pl.k
            assert all(isinstance(piece["index"], int) and piece["hash"] for piece in pieces)
    _run(roles)


def test_more_wiped_ranks_than_parity_leave_no_memory_step():
    roles = restore_roles(_parity_job(3, 1, 5, wiped={0, 1}), 3)
    assert [r["step"] for r in roles] == [None] * 3
    assert roles[0]["lost"] == {"step": 5, "ranks": [0, 1]}


def test_a_piece_the_rebuilding_ranks_own_slot_keeps_is_used_in_place():
    # Node 1 was wiped and the ranks of nodes 1 and 2 swapped: rank 1's slot now keeps
    # rank 2's copy and parity, which rank 1's rebuild uses there, without a transfer.
    holdings = _parity_job(3, 1, 8, wiped={1})
    holdings[1], holdings[2] = holdings[2], _slot()
    roles = restore_roles(holdings, 3)
    assert [r["step"] for r in roles] == [8] * 3
    assert [t[0] for t in roles[1]["transfers"]].count("local_piece") == 2
    assert roles[1]["transfers"][-1] == ["send", 2, {"whose": 2, "own": True}]
    assert roles[2]["transfers"] == [["receive", 1, _files(2, 8)]]
    assert roles[0]["ranks_rebuilt"] == [1] and roles[0]["ranks_from_buddies"] == [2]
    _run(roles)


def test_a_codeword_with_fewer_than_k_surviving_pieces_is_not_rebuilt():
    # Rank 1's node is wiped and rank 2 lost its own copy (its parity survives): of
    # each codeword rank 1 needs, only the parity piece is left, one of k = 2.
    holdings = _parity_job(3, 1, 5, wiped={1})
    holdings[2]["own"] = {}
    roles = restore_roles(holdings, 3)
    assert [r["step"] for r in roles] == [None] * 3
    assert roles[0]["lost"] == {"step": 5, "ranks": [1, 2]}
