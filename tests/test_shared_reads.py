"""``load(..., share_reads=True)``: bytes several ranks need (DDP parameters, HSDP
replicas of a shard) are read from storage once and sent to the others."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from distributed import count_received, run_ranks, run_ranks_outcomes

import shardpoint
from shardpoint.storage.local import LocalDirectory

SHAPES = {"hsdp.a": (64, 32), "hsdp.b": (10, 8)}  # sharded over 2, replicated over 2
DDP = {"ddp.w": (48, 16), "ddp.bias": (16,)}  # plain tensors: every rank holds them


def _full(name: str, shape) -> torch.Tensor:
    g = torch.Generator().manual_seed(sum(map(ord, name)))
    return torch.randn(shape, generator=g)


def _state(offset: float = 0.0) -> dict:
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Replicate, Shard, distribute_tensor

    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("replicate", "shard"))
    state = {
        n: distribute_tensor(_full(n, s) + offset, mesh, [Replicate(), Shard(0)])
        for n, s in SHAPES.items()
    }
    state |= {n: _full(n, s) + offset for n, s in DDP.items()}
    return state


def _save(rank: int, world: int, path: str) -> None:
    shardpoint.save(_state(), path)


def _count_reads(counter: list[int]) -> None:
    real = LocalDirectory.read_ranges

    def counting(self, requests, **kwargs):
        counter[0] += sum(s.end - s.offset for ss in requests.values() for s in ss)
        return real(self, requests, **kwargs)

    LocalDirectory.read_ranges = counting


def _load(rank: int, world: int, path: str, share: bool) -> None:
    counter = [0]
    _count_reads(counter)
    state = _state(offset=100.0)
    shardpoint.load(state, path, share_reads=share)
    for name, shape in SHAPES.items():
        assert torch.equal(state[name].full_tensor(), _full(name, shape)), name
    for name, shape in DDP.items():
        assert torch.equal(state[name], _full(name, shape)), name
    Path(f"{path}-read{rank}-{share}").write_text(json.dumps(counter[0]))


def _bytes(shapes: dict) -> int:
    return sum(4 * torch.Size(s).numel() for s in shapes.values())


@pytest.fixture(scope="module")
def saved(tmp_path_factory) -> Path:
    path = tmp_path_factory.mktemp("shared") / "ckpt"
    run_ranks(4, _save, str(path))
    return path


@pytest.mark.slow
@pytest.mark.parametrize("share", [False, True])
def test_a_two_replica_two_shard_load_reads_each_byte_from_storage_once(saved, share):
    run_ranks(4, _load, str(saved), share)
    read = [json.loads(Path(f"{saved}-read{r}-{share}").read_text()) for r in range(4)]
    if share:
        # every stored byte once, whatever rank read it (checksum blocks are whole chunks)
        assert sum(read) == _bytes(SHAPES) + _bytes(DDP), read
        assert max(read) < sum(read)  # and the ranks split the reading
    else:
        assert sum(read) == 2 * _bytes(SHAPES) + 4 * _bytes(DDP), read


# Resharding: saved on 4 ranks one way, loaded on 3 another. Uneven shapes included.
RESHARD = {"r.a": (64, 48), "r.b": (30, 50)}
LAYOUTS = {
    "columns": ((4,), ["s1"], (3,), ["s1"]),  # tensor-parallel column shards 4 -> 3
    "rows": ((4,), ["s0"], (3,), ["s0"]),  # FSDP 4 -> 3
    "fsdp x tp -> columns": ((2, 2), ["s0", "s1"], (3,), ["s1"]),
}


def _resharded_state(mesh_shape, placements, fill: bool) -> dict:
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Shard, distribute_tensor

    mesh = init_device_mesh("cpu", mesh_shape)
    kinds = [Shard(int(p[1])) for p in placements]
    return {
        n: distribute_tensor(_full(n, s) if fill else torch.zeros(s), mesh, kinds)
        for n, s in RESHARD.items()
    }


def _save_layout(rank: int, world: int, path: str, layout: str) -> None:
    mesh_shape, placements, _, _ = LAYOUTS[layout]
    shardpoint.save(_resharded_state(mesh_shape, placements, True), path)


def _load_layout(rank: int, world: int, path: str, layout: str, share: bool) -> None:
    _, _, mesh_shape, placements = LAYOUTS[layout]
    counter = [0]
    _count_reads(counter)
    state = _resharded_state(mesh_shape, placements, False)
    shardpoint.load(state, path, share_reads=share)
    for name, shape in RESHARD.items():
        assert torch.equal(state[name].full_tensor(), _full(name, shape)), name
    Path(f"{path}-read{rank}-{share}").write_text(json.dumps(counter[0]))


@pytest.mark.slow
@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_a_resharding_load_reads_each_stored_byte_once_when_sharing(tmp_path, layout):
    path = tmp_path / "ckpt"
    run_ranks(4, _save_layout, str(path), layout)
    for share in (False, True):
        run_ranks(3, _load_layout, str(path), layout, share)
    read = {
        share: sum(json.loads(Path(f"{path}-read{r}-{share}").read_text()) for r in range(3))
        for share in (False, True)
    }
    stored = _bytes(RESHARD)
    assert read[True] == stored, read  # amplification 1.00
    # Each rank alone reads every chunk it overlaps, whole rows widened to checksum
    # blocks (one block per chunk at these sizes): 1.5x, and 2x for the 2-D mesh.
    assert read[False] >= 1.5 * stored, read


def _load_corrupt(rank: int, world: int, path: str) -> None:
    state = _state(offset=100.0)
    before = {
        n: (t.full_tensor() if hasattr(t, "full_tensor") else t).clone() for n, t in state.items()
    }
    with pytest.raises(shardpoint.CheckpointError):
        shardpoint.load(state, path, share_reads=True)
    for n, t in state.items():  # nothing changed on any rank, the reader's or the others'
        assert torch.equal(t.full_tensor() if hasattr(t, "full_tensor") else t, before[n]), n


def test_a_checksum_error_on_the_rank_that_reads_fails_every_rank_and_changes_nothing(
    saved, tmp_path
):
    import shutil

    damaged = tmp_path / "damaged"
    shutil.copytree(saved, damaged)
    index = json.loads((damaged / "index.json").read_text())
    chunk = index["tensors"]["ddp.w"]["chunks"][0]  # read by one rank, needed by all
    data = bytearray((damaged / chunk["file"]).read_bytes())
    data[chunk["byte_range"][0] + 5] ^= 0xFF
    (damaged / chunk["file"]).write_bytes(bytes(data))
    # With a timeout: a rank that missed the failure would wait for the others forever.
    outcomes = run_ranks_outcomes(4, _load_corrupt, str(damaged), errors=tmp_path / "errors")
    assert all(o.exitcode == 0 for o in outcomes), "\n".join(map(str, outcomes))


def test_a_fragment_one_rank_cannot_read_while_planning_fails_every_rank(saved, tmp_path):
    """Finding a sharded entry's chunks reads its writer's fragment: a rank that fails
    there joins the planning's agreement with its error, so every rank raises instead
    of waiting for it."""
    import shutil

    from shardpoint.names import fragment_file

    damaged = tmp_path / "damaged"
    shutil.copytree(saved, damaged)
    index = json.loads((damaged / "index.json").read_text())
    writer = max(int(r) for r in index["fragments"])  # the rows of another rank than 0
    path = damaged / fragment_file(writer)
    path.write_bytes(path.read_bytes().replace(b'"block_rows":', b'"block_rows": '))
    outcomes = run_ranks_outcomes(4, _load_corrupt, str(damaged), errors=tmp_path / "errors")
    assert all(o.exitcode == 0 for o in outcomes), "\n".join(map(str, outcomes))


def _load_with_a_failing_coordinator(rank: int, world: int, path: str) -> None:
    from shardpoint import shared_reads

    if rank == 1:  # this coordinator fails while planning its chunks

        def failing(told, me):
            raise RuntimeError("planner broke (injected)")

        shared_reads.assign_readers = failing
    match = "injected" if rank == 1 else "rank 1: planner broke"
    state = _state(offset=100.0)
    before = {
        n: (t.full_tensor() if hasattr(t, "full_tensor") else t).clone() for n, t in state.items()
    }
    with pytest.raises((shardpoint.CheckpointError, RuntimeError), match=match):
        shardpoint.load(state, path, share_reads=True)
    for n, t in state.items():
        assert torch.equal(t.full_tensor() if hasattr(t, "full_tensor") else t, before[n]), n


def test_a_coordinator_that_fails_to_plan_fails_every_rank(saved, tmp_path):
    """Every rank waits for every coordinator's answer: one that cannot plan answers
    with its error, so every rank raises instead of waiting forever (60 s limit)."""
    outcomes = run_ranks_outcomes(
        4, _load_with_a_failing_coordinator, str(saved), errors=tmp_path / "errors", timeout=60
    )
    assert all(o.exitcode == 0 for o in outcomes), "\n".join(map(str, outcomes))


def _load_where_rank_2_cannot_take_its_part(rank: int, world: int, path: str) -> None:
    from shardpoint import shared_reads

    if rank == 2:  # after every coordinator answered: the other ranks go on to read

        def failing(*args):
            raise RuntimeError("part broke (injected)")

        shared_reads._take_part = failing
    match = "injected" if rank == 2 else "rank 2: part broke"
    state = _state(offset=100.0)
    before = {
        n: (t.full_tensor() if hasattr(t, "full_tensor") else t).clone() for n, t in state.items()
    }
    with pytest.raises((shardpoint.CheckpointError, RuntimeError), match=match):
        shardpoint.load(state, path, share_reads=True)
    for n, t in state.items():
        assert torch.equal(t.full_tensor() if hasattr(t, "full_tensor") else t, before[n]), n


def test_a_rank_that_cannot_take_its_part_of_the_plan_fails_every_rank(saved, tmp_path):
    """The plan is agreed; one rank then fails to take its part: its error joins the
    agreement every rank reaches after its reads (60 s limit), and nothing changes."""
    outcomes = run_ranks_outcomes(
        4,
        _load_where_rank_2_cannot_take_its_part,
        str(saved),
        errors=tmp_path / "errors",
        timeout=60,
    )
    assert all(o.exitcode == 0 for o in outcomes), "\n".join(map(str, outcomes))


class _Rejecting:
    """A ``Stateful`` that refuses what it is given: the load fails after the exchange."""

    def state_dict(self) -> dict:
        return {"x": 1}

    def load_state_dict(self, sd: dict) -> None:
        raise ValueError("rejected (injected)")


def _cut(placement: str, offset: float = 0.0):
    """A tensor saved as row shards and loaded as column shards: its pieces are column
    slices of the stored chunks, received through buffers."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Shard, distribute_tensor

    mesh = init_device_mesh("cpu", (4,))
    return distribute_tensor(_full("cut", (16, 12)) + offset, mesh, [Shard(int(placement))])


def _save_with_stateful(rank: int, world: int, path: str) -> None:
    shardpoint.save({**_state(), "cut": _cut("0"), "extra": _Rejecting()}, path)


def _load_rejected(rank: int, world: int, path: str) -> None:
    state = {**_state(offset=100.0), "cut": _cut("1", 100.0), "extra": _Rejecting()}
    tensors = {n: t for n, t in state.items() if isinstance(t, torch.Tensor)}
    before = {
        n: (t.full_tensor() if hasattr(t, "full_tensor") else t).clone() for n, t in tensors.items()
    }
    with pytest.raises(shardpoint.StateMismatchError, match="injected"):
        shardpoint.load(state, path, share_reads=True)
    for n, t in tensors.items():  # pieces received in place and through buffers alike
        assert torch.equal(t.full_tensor() if hasattr(t, "full_tensor") else t, before[n]), n


@pytest.mark.slow
def test_a_load_that_fails_after_the_exchange_puts_every_received_piece_back(tmp_path):
    path = tmp_path / "ckpt"
    run_ranks(4, _save_with_stateful, str(path))
    outcomes = run_ranks_outcomes(4, _load_rejected, str(path), errors=tmp_path / "errors")
    assert all(o.exitcode == 0 for o in outcomes), "\n".join(map(str, outcomes))


MANY = {f"ddp.{i}": (4,) for i in range(256)}  # enough chunks to spread evenly


def _ddp_save(rank: int, world: int, path: str) -> None:
    shardpoint.save({n: _full(n, s) for n, s in MANY.items()}, path)


def _ddp_load_logged(rank: int, world: int, path: str) -> None:
    state = {n: torch.zeros(s) for n, s in MANY.items()}
    log: list[tuple[str, int]] = []
    count_received(log)  # collectives and blocking receives; the exchange's irecv is not
    shardpoint.load(state, path, share_reads=True)
    assert all(torch.equal(state[n], _full(n, s)) for n, s in MANY.items())
    Path(f"{path}-calls{rank}").write_text(json.dumps(log))


@pytest.mark.slow
def test_planning_a_shared_load_sends_no_rank_every_ranks_needs(tmp_path):
    """No rank plans for all: under DDP every rank needs every chunk, and what the
    busiest rank receives to plan is about the same on 4 ranks as on 2 (rank 0 planning
    alone would receive twice as much on 4; an all-gather would send it to every rank).
    Only the all-to-alls' sizes grow, by one integer per rank."""
    calls, planned = {}, {}
    for world in (2, 4):
        path = tmp_path / f"w{world}"
        run_ranks(world, _ddp_save, str(path))
        run_ranks(world, _ddp_load_logged, str(path))
        logs = [json.loads(Path(f"{path}-calls{r}").read_text()) for r in range(world)]
        calls[world] = [name for name, _ in logs[1]]
        # the payload all-to-alls: the pieces each coordinator is told, the parts it sends
        planned[world] = max(
            sum(n for name, n in log if name == "all_to_all_single" and n != 8 * world)
            for log in logs
        )
    assert (
        calls[2]
        == calls[4]
        == [
            "all_reduce",  # did any rank fail to prepare?
            "all_to_all_single",  # the sizes of...
            "all_to_all_single",  # ...each rank's pieces, to each chunk's coordinator
            "all_to_all_single",  # the sizes of...
            "all_to_all_single",  # ...each rank's part of each coordinator's plan
            "all_reduce",  # every rank's reads verified
        ]
    ), calls
    assert planned[4] <= 1.25 * planned[2], planned


def _plan_everywhere(wanted: list[list[list]]) -> list[list]:
    """Every coordinator's plan for the pieces each rank wants, as the ranks get it."""
    from shardpoint.shared_reads import assign_readers, coordinator

    world = len(wanted)
    told = [[[] for _ in range(world)] for _ in range(world)]  # [coordinator][rank]
    for rank, items in enumerate(wanted):
        for item in items:
            told[coordinator(item[0], world)][rank].append(item)
    parts: list[list] = [[] for _ in range(world)]
    for c in range(world):
        for rank, part in enumerate(assign_readers(told[c], c)):
            parts[rank].extend(part)
    return parts


def _check_one_reader_each(parts: list[list], keys: list[str]) -> list[int]:
    """Each key is read by exactly one rank, which sends every other rank that needs
    it a piece under a tag that rank expects from it and from no other piece; returns
    the reads per rank."""
    for key in keys:
        reads = [
            (r, item) for r, part in enumerate(parts) for item in part if item[:2] == ["read", key]
        ]
        assert len(reads) == 1, key
        reader, (_, _, _, _, sends) = reads[0]
        assert reader in [r for _, r, _, _ in sends], key  # a rank that needs it
        for tag, r, lo, hi in sends:
            if r != reader:
                assert ["receive", tag, key, lo, hi, reader] in parts[r]
    for r, part in enumerate(parts):
        tags = [(item[5], item[1]) for item in part if item[0] == "receive"]
        assert len(tags) == len(set(tags)), f"rank {r} expects two pieces under one tag"
    return [sum(item[0] == "read" for item in part) for part in parts]


@pytest.mark.slow
def test_every_shared_chunk_has_one_reader_and_the_reading_is_split():
    """DDP: 64 ranks need the same 1,000 chunks; each is read by exactly one of them,
    which hands every other rank its piece; the reading is split evenly although each
    coordinator plans only its own ~16 chunks; a rank's part lists only its own
    pieces. HSDP: each replica group's chunk is read by one of its two ranks."""
    keys = [f"w{i}|[0]" for i in range(1000)]
    parts = _plan_everywhere([[[k, [0], [10], 40] for k in keys]] * 64)
    reads = _check_one_reader_each(parts, keys)
    assert all(len(part) == 1000 for part in parts)  # its own pieces, not ranks × pieces
    assert max(reads) <= 2 * 1000 / 64, reads

    shard_a = [["w|[0]", [0], [5], 20]]
    shard_b = [["w|[5]", [5], [10], 20]]
    parts = _plan_everywhere([shard_a, shard_b, shard_a, shard_b])
    reads = _check_one_reader_each(parts, ["w|[0]", "w|[5]"])
    assert reads[0] + reads[2] == reads[1] + reads[3] == 1, reads  # one in each group


def test_a_chunk_two_ranks_need_different_parts_of_is_read_once_covering_both():
    """Resharding: a [4, 6] chunk saved whole, loaded as column halves on two ranks.
    One rank reads the rows both need and sends the other its half; a chunk one rank
    alone needs is not shared."""
    from shardpoint.shared_reads import assign_readers

    left = [["t|[0, 0]", [0, 0], [4, 3], 48], ["u|[0]", [0], [8], 32]]
    right = [["t|[0, 0]", [0, 3], [4, 6], 48]]
    parts = assign_readers([left, right], 0)  # as coordinator 0 of two ranks
    assert parts[0] == [
        ["read", "t|[0, 0]", [0, 0], [4, 6], [[0, 0, [0, 0], [4, 3]], [2, 1, [0, 3], [4, 6]]]]
    ]
    assert parts[1] == [["receive", 2, "t|[0, 0]", [0, 3], [4, 6], 0]]
