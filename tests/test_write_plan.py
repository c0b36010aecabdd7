"""Who writes which replicated chunk (plan.plan_writes): every byte once, by a rank
that holds it, the least-loaded holder first; the same plan as scanning every holder
for the least-loaded one, however the ranks' lists are shared."""

from __future__ import annotations

import random

import pytest

from shardpoint.plan import Holding, Piece, plan_writes


def _holding(i: int, rows: int) -> Holding:
    return Holding(f"t{i}", "F32", (rows, 4), (0, 0), (rows, 4), True)


def _scan_every_holder(
    sole_bytes: list[int], replicated: list[list[Holding]], split_bytes: int
) -> list[tuple[str, tuple[int, ...], int]]:
    """The plan by definition: each chunk, largest first, to the holder with the least
    load (the lowest rank among equals), every holder looked at; large chunks held
    by several ranks split as plan_writes splits them."""
    ranks_of: dict[tuple, list[int]] = {}
    first: dict[tuple, Holding] = {}
    for rank, held in enumerate(replicated):
        for h in held:
            key = (h.name, h.offsets, h.shape)
            ranks_of.setdefault(key, []).append(rank)
            first.setdefault(key, h)
    load = list(sole_bytes)
    out = []
    rest = []
    for key, ranks in ranks_of.items():
        h = first[key]
        if len(ranks) > 1 and h.nbytes >= split_bytes and h.shape[0] >= len(ranks):
            k, rows = len(ranks), h.shape[0]
            start = 0
            for writer, n in zip(
                sorted(ranks, key=lambda r: (load[r], r)),
                [rows // k + (1 if i < rows % k else 0) for i in range(k)],
            ):
                out.append((h.name, (start, 0), writer))
                load[writer] += n * h.nbytes // rows
                start += n
        else:
            rest.append((h, ranks))
    for h, ranks in sorted(rest, key=lambda x: -x[0].nbytes):
        writer = min(ranks, key=lambda r: (load[r], r))
        out.append((h.name, h.offsets, writer))
        load[writer] += h.nbytes
    return out


def _summary(pieces: list[Piece]) -> list[tuple[str, tuple[int, ...], int]]:
    return [(p.name, p.offsets, p.writer) for p in pieces]


@pytest.mark.parametrize("seed", range(100))
def test_the_plan_is_the_least_loaded_holder_for_every_chunk_however_lists_are_shared(seed):
    rng = random.Random(seed)
    ranks = rng.randint(1, 12)
    chunks = [_holding(i, rng.choice([1, 3, 50, 400, 5000])) for i in range(rng.randint(1, 40))]
    # Some ranks share one list object (DDP), some hold their own list (equal or not),
    # so chunks are held by different sets of ranks, with loads raised across sets.
    shared = [h for h in chunks if rng.random() < 0.7]
    replicated = []
    for _ in range(ranks):
        kind = rng.random()
        if kind < 0.5:
            replicated.append(shared)
        elif kind < 0.75:
            replicated.append(list(shared))
        else:
            replicated.append([h for h in chunks if rng.random() < 0.5])
    sole = [rng.choice([0, 0, 100, 20_000]) for _ in range(ranks)]
    split = rng.choice([1000, 10**9])
    pieces = plan_writes(sole, replicated, split_bytes=split)
    assert _summary(pieces) == _scan_every_holder(sole, replicated, split)
    # Every byte once, by a rank that holds the chunk.
    for h in {h for held in replicated for h in held}:
        mine = [p for p in pieces if p.name == h.name]
        assert sum(p.shape[0] for p in mine) == h.shape[0], h.name
        assert all(h in replicated[p.writer] for p in mine), h.name


def test_ddp_chunks_spread_evenly_over_every_rank():
    """4,096 ranks share one list of 3,000 chunks (DDP): the busiest writes at most one
    chunk more than the average, and the plan is the scan's."""
    chunks = [_holding(i, 1 + i % 7) for i in range(3000)]
    replicated = [chunks] * 4096
    pieces = plan_writes([0] * 4096, replicated)
    load = [0] * 4096
    for p in pieces:
        load[p.writer] += p.source.nbytes
    total = sum(h.nbytes for h in chunks)
    assert sum(load) == total
    assert max(load) <= total / 4096 + max(h.nbytes for h in chunks)
    assert _summary(pieces) == _scan_every_holder([0] * 4096, replicated, 4 * 1024 * 1024)
