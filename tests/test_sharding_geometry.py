"""The chunk geometry format version 2 derives from a mesh and placements is torch's,
for even, uneven and empty shards and several mesh dimensions sharding one dimension."""

from __future__ import annotations

import random

import pytest
from torch.distributed.tensor import Replicate, Shard
from torch.distributed.tensor._utils import _compute_local_shape_and_global_offset

from shardpoint.sharding import REPLICATED, Mesh, Sharding


def _cases(count: int):
    rng = random.Random(7)
    for _ in range(count):
        ndim = rng.randint(1, 3)
        shape = tuple(rng.choice([0, 1, 2, 3, 5, 7, 8, 13, 64]) for _ in range(ndim))
        mesh_ndim = rng.randint(1, 3)
        mesh = tuple(rng.randint(1, 5) for _ in range(mesh_ndim))
        dims = tuple(
            REPLICATED if rng.random() < 0.25 else rng.randrange(ndim) for _ in range(mesh_ndim)
        )
        yield shape, mesh, dims


def _placements(dims):
    return [Replicate() if d == REPLICATED else Shard(d) for d in dims]


@pytest.mark.parametrize("shape,mesh,dims", list(_cases(300)))
def test_every_chunk_is_the_one_torch_gives_that_mesh_coordinate(shape, mesh, dims):
    sharding = Sharding(Mesh(mesh, tuple(range(_prod(mesh)))), dims)
    volume = 0
    for coord in sharding.coords():
        torch_shape, torch_offsets = _compute_local_shape_and_global_offset(
            shape, mesh, list(coord), _placements(dims)
        )
        offsets, sizes = sharding.box(shape, coord)
        assert sizes == tuple(torch_shape), (coord, sizes, torch_shape)
        if all(sizes):  # an empty chunk holds no bytes; torch places it at the end
            assert offsets == tuple(torch_offsets), (coord, offsets, torch_offsets)
        volume += _prod(sizes)
    copies = _prod(n for n, d in zip(mesh, dims) if d == REPLICATED)
    assert volume == _prod(shape) * copies


@pytest.mark.parametrize("shape,mesh,dims", list(_cases(200)))
def test_the_coordinates_overlapping_a_box_are_exactly_the_chunks_it_meets(shape, mesh, dims):
    rng = random.Random(hash((shape, mesh, dims)) & 0xFFFF)
    ranks = tuple(range(_prod(mesh)))
    sharding = Sharding(Mesh(mesh, ranks), dims)
    for _ in range(5):
        lo = tuple(rng.randint(0, max(n - 1, 0)) for n in shape)
        hi = tuple(rng.randint(a + 1, max(n, a + 1)) for a, n in zip(lo, shape))
        expected = set()
        for coord in sharding.coords():
            if any(c and d == REPLICATED for c, d in zip(coord, dims)):
                continue  # one coordinate per chunk: 0 in replicated mesh dimensions
            offsets, sizes = sharding.box(shape, coord)
            if all(sizes) and all(
                o < h and a < o + s for o, s, a, h in zip(offsets, sizes, lo, hi)
            ):
                expected.add(coord)
        if not all(n > 0 for n in shape):
            expected = set()
        assert set(sharding.overlapping(shape, lo, hi)) == expected


def test_a_rank_finds_its_shard_among_16384_without_visiting_the_others():
    sharding = Sharding(Mesh((8, 2048), tuple(range(16384))), (1, 0))
    shape = (4096 * 4, 8 * 512)
    coord = (5, 1000)
    offsets, sizes = sharding.box(shape, coord)
    hi = tuple(o + s for o, s in zip(offsets, sizes))
    assert list(sharding.overlapping(shape, offsets, hi)) == [coord]
    assert sharding.mesh.rank_at(coord) == 5 * 2048 + 1000
    assert sharding.mesh.coord_of(5 * 2048 + 1000) == coord


def _prod(xs):
    out = 1
    for x in xs:
        out *= x
    return out


@pytest.mark.parametrize(
    "mesh,dims",
    [
        ((2, 2), (REPLICATED, 0)),
        ((3, 4), (REPLICATED, 1)),
        ((2, 2, 2), (0, REPLICATED, REPLICATED)),
    ],
)
def test_replicas_share_the_writing_and_each_chunk_has_one_writer_among_its_holders(mesh, dims):
    """HSDP: each chunk is written once, by one of the ranks that hold it, and the
    replicas write about the same number of chunks."""
    shape = (24, 12)
    sharding = Sharding(Mesh(mesh, tuple(range(_prod(mesh)))), dims)
    written: dict[int, int] = {}
    for coord in sharding.overlapping(shape, (0, 0), shape):
        writer = sharding.writer(coord)
        holder = sharding.mesh.coord_of(writer)
        assert sharding.box(shape, holder) == sharding.box(shape, coord)
        written[writer] = written.get(writer, 0) + 1
    assert max(written.values()) - min(written.values()) <= 1
    assert sum(written.values()) == _prod(n for n, d in zip(mesh, dims) if d != REPLICATED)


class _CountedRanks(tuple):
    hashed = 0

    def __hash__(self) -> int:
        type(self).hashed += 1
        return super().__hash__()


def test_a_strided_mesh_is_looked_up_without_hashing_its_ranks_again():
    """A save looks each sharded entry's mesh up in a dict (10,000-100,000 entries): an
    FSDP sub-mesh with TP inside holds strided ranks (1, 9, 17, ... 2,048 of them), and
    hashing them per lookup doubled a steady save's planning at 16,384 ranks."""
    ranks = _CountedRanks(range(1, 16384, 8))
    mesh = Mesh((len(ranks),), ranks)
    assert mesh.ranks is ranks  # not consecutive: kept as given
    table = {mesh: 0}
    for _ in range(1000):
        table[mesh] += 1
    assert table[Mesh((len(ranks),), _CountedRanks(ranks))] == 1000  # equal meshes, one key
    assert _CountedRanks.hashed == 0
    assert Mesh((4,), (3, 4, 5, 6)).ranks == range(3, 7)  # consecutive: a range
