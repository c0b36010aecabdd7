"""The index check that chunks tile a tensor (no overlap) agrees with the pairwise
definition on every shape of tiling, and does not compare chunks pairwise."""

from __future__ import annotations

import random

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from shardpoint.errors import CorruptCheckpointError
from shardpoint.format import coverage
from shardpoint.format.index import Chunk


def _pairwise_disjoint(boxes):
    for i, a in enumerate(boxes):
        for b in boxes[i + 1 :]:
            if all(lo1 < hi2 and lo2 < hi1 for (lo1, hi1), (lo2, hi2) in zip(a, b)):
                return False
    return True


def _random_tiling(rng: random.Random, shape: list[int], pieces: int):
    """Split the box of ``shape`` ``pieces - 1`` times along random dimensions."""
    boxes = [[(0, n) for n in shape]]
    for _ in range(pieces - 1):
        i = rng.randrange(len(boxes))
        box = boxes[i]
        dims = [d for d, (lo, hi) in enumerate(box) if hi - lo > 1]
        if not dims:
            continue
        d = rng.choice(dims)
        lo, hi = box[d]
        cut = rng.randrange(lo + 1, hi)
        boxes[i] = [*box[:d], (lo, cut), *box[d + 1 :]]
        boxes.append([*box[:d], (cut, hi), *box[d + 1 :]])
    return boxes


@settings(max_examples=400, deadline=None)
@given(
    seed=st.integers(0, 2**32 - 1),
    dims=st.integers(1, 4),
    pieces=st.integers(2, 80),
    perturb=st.booleans(),
)
def test_the_overlap_check_agrees_with_comparing_every_pair(seed, dims, pieces, perturb):
    rng = random.Random(seed)
    shape = [rng.randint(1, 9) for _ in range(dims)]
    boxes = _random_tiling(rng, shape, pieces)
    if perturb and len(boxes) > 1:  # move or grow one box: usually an overlap
        i = rng.randrange(len(boxes))
        d = rng.randrange(dims)
        lo, hi = boxes[i][d]
        if rng.random() < 0.5 and lo > 0:
            boxes[i][d] = (lo - 1, hi)
        elif hi < shape[d]:
            boxes[i][d] = (lo, hi + 1)
        else:
            boxes[i] = list(boxes[(i + 1) % len(boxes)])  # a duplicate
    if len(boxes) < 2:
        return
    expected = _pairwise_disjoint(boxes)
    assert coverage._disjoint(boxes) == expected
    arrays = coverage._boxes(_chunks(boxes), dims)  # as the parser checks many chunks
    assert coverage._disjoint_arrays(arrays, tuple(shape)) == expected


def _chunks(boxes):
    return tuple(
        Chunk(
            "f",
            "k",
            tuple(lo for lo, _ in b),
            tuple(hi - lo for lo, hi in b),
            (0, 0),
            1,
            ("0" * 16,),
        )
        for b in boxes
    )


@pytest.mark.parametrize(
    "make",
    [
        lambda n: [[(i, i + 1), (0, 64)] for i in range(n)],  # row shards
        lambda n: [[(0, 64), (i, i + 1)] for i in range(n)],  # column shards
        lambda n: [[(i // 100, i // 100 + 1), (i % 100, i % 100 + 1)] for i in range(n)],  # grid
    ],
    ids=["rows", "columns", "grid"],
)
@pytest.mark.parametrize("as_arrays", [False, True], ids=["one-by-one", "arrays"])
def test_a_tensor_of_many_chunks_is_checked_without_comparing_them_pairwise(
    make, as_arrays, monkeypatch
):
    """20,000 chunks: the pairwise loop would make 2*10**8 comparisons. Count the work
    instead of timing it: the box-by-box fallback must not run for these shapes (as the
    parser checks them: on arrays; and one by one)."""
    n = 20_000
    boxes = make(n)
    shape = tuple(max(b[d][1] for b in boxes) for d in range(2))
    if boxes[0][0] == (0, 64):
        shape = (64, n)
    elif boxes[0][1] == (0, 64):
        shape = (n, 64)
    chunks = _chunks(boxes)
    calls = []
    real = coverage._sweep_disjoint
    monkeypatch.setattr(coverage, "_sweep_disjoint", lambda b: calls.append(len(b)) or real(b))

    def check(chunks):
        boxes = coverage._boxes(chunks, 2) if as_arrays else None
        coverage._check_cover("t", shape, chunks, "index.json", boxes)

    check(chunks)
    assert calls == []  # a sort (one split dimension) or the grid check decided it
    clash = chunks[:-1] + (chunks[0],)  # one chunk twice, the last one missing
    with pytest.raises(CorruptCheckpointError, match="overlap"):
        check(clash)


def test_an_irregular_two_dimensional_tiling_is_swept_not_compared_pairwise(monkeypatch):
    """Tall column chunks beside many one-row chunks (no grid): the sweep keeps the open
    intervals sorted, so each new chunk is compared with two neighbours."""
    rows = 5_000
    boxes = [[(0, rows), (c, c + 1)] for c in range(100)]  # 100 tall columns
    boxes += [[(r, r + 1), (100, 200)] for r in range(rows)]  # and 5,000 short rows
    compared = []
    real_all = all

    def counting_all(it):
        compared.append(1)
        return real_all(it)

    monkeypatch.setattr(coverage, "all", counting_all, raising=False)
    assert coverage._disjoint(boxes)
    assert len(compared) == 0  # the 2-D sweep never compares box against box
    boxes.append([(rows - 1, rows), (150, 151)])  # inside a short row
    assert not coverage._disjoint(boxes)
