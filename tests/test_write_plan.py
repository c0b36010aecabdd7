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


@pytest.mark.slow
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


# ---- a background save that must run again: planned around what its steady ranks wrote --


def _changed_lists(rng: random.Random, old: list[Holding], names: list[str]) -> list[Holding]:
    """A changed rank's replicated chunks: some dropped, some reshaped, some added."""
    held = []
    for h in old:
        roll = rng.random()
        if roll < 0.2:
            continue  # dropped
        if roll < 0.35:
            rows = h.shape[0] + rng.randint(1, 5)
            h = Holding(h.name, h.dtype, (rows, 4), (0, 0), (rows, 4), True)
        held.append(h)
    for name in rng.sample(names, rng.randint(0, 2)):
        held.append(Holding(name, "F32", (7, 4), (0, 0), (7, 4), True))
    return held


@pytest.mark.parametrize("seed", range(300))
def test_a_background_again_covers_every_held_chunk_once_around_the_steady_ranks(seed):
    """Random jobs (shared and per-rank lists, large chunks split among holders,
    per-node copies) whose plan was cached, then some ranks change (drop, reshape, add
    chunks): either the planner refuses, exactly when a cached piece's writer changed
    and no longer holds its chunk while ranks of its node that staged only their own
    share do, or every chunk still held is covered exactly once (per node in per-node
    mode) by ranks that hold it, each steady rank writing exactly its cached pieces."""
    from shardpoint.errors import CheckpointError
    from shardpoint.plan import plan_writes_per_node, writes_around_staged

    rng = random.Random(seed)
    world = rng.randint(2, 6)
    per_node = rng.random() < 0.4
    nodes = sorted(rng.randint(0, 1) for _ in range(world)) if per_node else [0] * world
    big = 2_000_000 if rng.random() < 0.5 else 20  # rows of 16 B: 32 MB chunks split
    common = [_holding(i, big if i == 0 else rng.randint(1, 40)) for i in range(6)]
    old = [common if rng.random() < 0.6 else rng.sample(common, 4) for _ in range(world)]
    sole = [rng.randint(0, 1000) for _ in range(world)]
    cached = plan_writes_per_node(sole, old, nodes, per_node)
    kept = [
        [
            [p.name, p.offsets, p.shape, p.source.offsets, p.source.shape]
            for p in cached
            if p.writer == r
        ]
        for r in range(world)
    ]
    steady = [rng.random() < 0.5 for _ in range(world)]
    if all(steady):
        steady[rng.randrange(world)] = False
    changed_list = _changed_lists(rng, common, ["n0", "n1", "n2"])  # shared by some
    new = [
        old[r]
        if steady[r]
        else (
            changed_list if rng.random() < 0.5 else _changed_lists(rng, old[r], ["n0", "n1", "n2"])
        )
        for r in range(world)
    ]

    def key(h):
        return (h.name, h.offsets, h.shape)

    def holds(r, k):
        return any(key(h) == k for h in new[r])

    def groups():  # per node (or the job): its ranks
        return [[r for r in range(world) if nodes[r] == n] for n in sorted(set(nodes))]

    expect_refusal = any(
        not steady[p.writer]
        and not holds(p.writer, key(p.source))
        and not any(
            holds(r, key(p.source)) and not steady[r]
            for r in range(world)
            if nodes[r] == nodes[p.writer]
        )
        and any(holds(r, key(p.source)) for r in range(world) if nodes[r] == nodes[p.writer])
        for p in cached
    )
    try:
        pieces = writes_around_staged(steady, kept, sole, new, nodes, per_node)
    except CheckpointError as exc:
        assert expect_refusal, exc
        assert "cannot be completed from what was staged" in str(exc)
        return
    assert not expect_refusal
    for p in pieces:
        assert holds(p.writer, key(p.source)), p
    for r in range(world):
        if steady[r]:
            mine = sorted(
                [p.name, p.offsets, p.shape, p.source.offsets, p.source.shape]
                for p in pieces
                if p.writer == r
            )
            assert mine == sorted(kept[r]), r
    for ranks in groups():
        held = {key(h): h for r in ranks for h in new[r]}
        for k, h in held.items():
            rows = sorted(
                (p.offsets[0], p.shape[0], p.offsets[1:], p.shape[1:])
                for p in pieces
                if p.writer in ranks and key(p.source) == k
            )
            assert rows, (k, "not written")
            start = 0
            for offset, n, rest_offsets, rest_shape in rows:  # contiguous, disjoint, whole
                assert (offset, rest_offsets, rest_shape) == (start, h.offsets[1:], h.shape[1:])
                start += n
            assert start == h.shape[0], (k, rows)
        assert all(key(p.source) in held for p in pieces if p.writer in ranks)
