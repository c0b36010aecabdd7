"""``load(..., share_reads=True)``: bytes several ranks need (DDP parameters, HSDP
replicas of a shard) are read from storage once and sent to the others."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from distributed import run_ranks, run_ranks_outcomes

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


def test_rank_0_plans_from_each_distinct_list_once_and_every_shared_region_has_one_reader():
    """DDP: 64 ranks need the same 100 regions, sent once as one list; HSDP: two
    replica groups. Each shared region is read by exactly one of the ranks that need it,
    sent to the others, the reading split evenly; a rank's part lists only its regions."""
    from shardpoint.shared_reads import assign_readers

    regions = [[f"w{i}|[0]|[10]", 40] for i in range(100)]
    parts = assign_readers({"ddp": regions}, ["ddp"] * 64)
    for tag in range(100):
        readers = [
            r
            for r, part in enumerate(parts)
            for t, _, to in part
            if t == tag and isinstance(to, list)
        ]
        receivers = [
            r
            for r, part in enumerate(parts)
            for t, _, src in part
            if t == tag and isinstance(src, int)
        ]
        assert len(readers) == 1 and sorted(readers + receivers) == list(range(64))
    assert all(len(part) == 100 for part in parts)  # its own regions, not ranks × regions
    reads = [sum(isinstance(to, list) for _, _, to in part) for part in parts]
    assert max(reads) - min(reads) <= 1

    shard_a = [["w|[0]|[5]", 20]]
    shard_b = [["w|[5]|[5]", 20]]
    parts = assign_readers({"a": shard_a, "b": shard_b}, ["a", "b", "a", "b"])
    assert parts[0] == [[0, "w|[0]|[5]", [2]]] and parts[2] == [[0, "w|[0]|[5]", 0]]
    assert parts[1] == [[1, "w|[5]|[5]", [3]]] and parts[3] == [[1, "w|[5]|[5]", 1]]
