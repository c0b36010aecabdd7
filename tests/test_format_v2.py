"""Format version 2: a sharded tensor is described once in the index, each rank's
chunks live in its own fragment, and version 1 checkpoints still load unchanged."""

from __future__ import annotations

import json
import re
import shutil
from pathlib import Path

import pytest
import torch
from distributed import run_ranks

import shardpoint
from shardpoint.errors import CorruptCheckpointError
from shardpoint.format.index import INDEX_NAME
from shardpoint.names import fragment_file

GOLDEN_V1 = Path(__file__).parent / "data" / "v1-two-ranks"
EXPERTS = 100


def _numel(shape: tuple[int, ...]) -> int:
    n = 1
    for d in shape:
        n *= d
    return n


def _golden_values():
    return torch.arange(21, dtype=torch.float32).reshape(7, 3), torch.arange(5)


def test_a_version_1_checkpoint_loads_verifies_and_inspects_unchanged(tmp_path):
    """Saved by the release before version 2 on 2 ranks (a Shard(0) DTensor, a
    replicated tensor, values); the files are as that release wrote them."""
    ckpt = tmp_path / "v1"
    shutil.copytree(GOLDEN_V1, ckpt)
    assert json.loads((ckpt / INDEX_NAME).read_text())["format_version"] == 1
    state = {"sharded": torch.zeros(7, 3), "replicated": torch.zeros(5, dtype=torch.int64)}
    state |= {"step": 0, "name": ""}
    shardpoint.load(state, ckpt)
    sharded, replicated = _golden_values()
    assert torch.equal(state["sharded"], sharded) and torch.equal(state["replicated"], replicated)
    assert state["step"] == 12 and state["name"] == "golden"
    assert shardpoint.verify(ckpt).ok
    with shardpoint.open(ckpt) as reader:
        assert reader.metadata["format_version"] == 1
        assert len(reader.entry("sharded").chunks) == 2


GOLDEN_V2 = Path(__file__).parent / "data" / "v2-two-ranks"


def test_the_version_2_golden_checkpoint_reads_as_written(tmp_path):
    """Written on 2 ranks by this release: a Shard(0) DTensor (a sharding and two
    fragments), a replicated tensor (listed), and a PerRank value holding a tensor.
    Future readers must keep reading it; the files are checked in."""
    ckpt = tmp_path / "v2"
    shutil.copytree(GOLDEN_V2, ckpt)
    doc = json.loads((ckpt / INDEX_NAME).read_text())
    assert doc["format_version"] == 2
    assert doc["tensors"]["sharded"]["sharding"] == {"mesh": 0, "dims": [0]}
    with shardpoint.open(ckpt) as reader:
        state = reader.state()
    sharded, replicated = _golden_values()
    assert torch.equal(state["sharded"], sharded) and torch.equal(state["replicated"], replicated)
    assert state["step"] == 12 and state["name"] == "golden"
    assert sorted(state["own"]) == [0, 1]
    for rank in (0, 1):
        assert state["own"][rank]["seen"] == 100 + rank
        assert torch.equal(state["own"][rank]["mask"], torch.full((2,), rank, dtype=torch.uint8))
    live = {"sharded": torch.zeros(7, 3), "replicated": torch.zeros(5, dtype=torch.int64)}
    shardpoint.load(live, ckpt, strict=False)
    assert torch.equal(live["sharded"], sharded)
    assert shardpoint.verify(ckpt).ok


def _global(name: str, shape: tuple[int, ...]) -> torch.Tensor:
    g = torch.Generator().manual_seed(sum(map(ord, name)))
    return torch.randn(shape, generator=g)


SHAPES = {
    "fsdp.w": (10, 6),  # 10 rows over 4 ranks: 3, 3, 3, 1
    "fsdp.b": (3,),  # 3 rows over 4 ranks: one rank's shard is empty
    "tp2d.w": (8, 6),  # a 2 x 2 mesh: rows x columns
    "hsdp.w": (9, 4),  # a 2 x 2 mesh: replicated x rows (HSDP)
}
SHAPES |= {f"moe.experts.{i}.w": (4 + i % 5, 3) for i in range(EXPERTS)}


def _sharded_state(world: int, value_offset: float = 0.0) -> dict:
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Replicate, Shard, distribute_tensor

    mesh = init_device_mesh("cpu", (world,))
    state = {}
    for name, shape in SHAPES.items():
        full = _global(name, shape) + value_offset
        if name.startswith(("tp2d", "hsdp")) and world == 4:
            grid = init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "tp"))
            placements = [Shard(0), Shard(1)] if name == "tp2d.w" else [Replicate(), Shard(0)]
            state[name] = distribute_tensor(full, grid, placements)
        else:
            state[name] = distribute_tensor(full, mesh, [Shard(0)])
    state["norm"] = torch.arange(6.0) + value_offset  # plain: replicated on every rank
    state["step"] = 41
    return state


def _save4(rank: int, world: int, path: str) -> None:
    shardpoint.save(_sharded_state(world), path)


def _load_on(rank: int, world: int, path: str) -> None:
    state = _sharded_state(world, value_offset=100.0)  # different values, same layout
    state["step"] = 0
    shardpoint.load(state, path)
    for name, shape in SHAPES.items():
        assert torch.equal(state[name].full_tensor(), _global(name, shape)), name
    assert torch.equal(state["norm"], torch.arange(6.0)) and state["step"] == 41


@pytest.fixture(scope="module")
def saved_on_4(tmp_path_factory) -> Path:
    path = tmp_path_factory.mktemp("v2") / "ckpt"
    run_ranks(4, _save4, str(path))
    return path


@pytest.mark.slow
def test_a_sharded_tensor_is_described_once_and_its_chunks_are_in_the_writers_fragments(
    saved_on_4,
):
    index = json.loads((saved_on_4 / INDEX_NAME).read_text())
    assert index["format_version"] == 2 and index["world_size"] == 4
    tensors = index["tensors"]
    for name in SHAPES:
        assert "chunks" not in tensors[name] and "sharding" in tensors[name], name
    assert tensors["tp2d.w"]["sharding"]["dims"] == [0, 1]
    meshes = index["meshes"]
    assert {tuple(m["shape"]) for m in meshes} == {(4,), (2, 2)}
    assert all(m["ranks"] == {"first": 0, "count": 4} for m in meshes)
    assert sorted(index["fragments"]) == ["0", "1", "2", "3"]
    # Per sharded tensor the index holds a few dozen bytes, not a chunk per rank.
    sharded_bytes = sum(len(json.dumps(tensors[n])) for n in SHAPES)
    assert sharded_bytes < 80 * len(SHAPES), sharded_bytes
    assert tensors["hsdp.w"]["sharding"]["dims"] == [-1, 0]
    for rank in range(4):
        fragment = json.loads((saved_on_4 / fragment_file(rank)).read_text())
        assert fragment["rank"] == rank
        # Every rank writes its piece of each tensor; of the HSDP tensor's two row
        # chunks, replica 0 writes the first (rank 0) and replica 1 the second (rank 3).
        hsdp = {"hsdp.w"} if rank in (0, 3) else set()
        assert set(fragment["chunks"]) == (set(SHAPES) - {"hsdp.w"}) | hsdp, rank
    hsdp_bytes = 0
    for rank in range(4):
        chunks = json.loads((saved_on_4 / fragment_file(rank)).read_text())["chunks"]
        if "hsdp.w" in chunks:
            begin, end = chunks["hsdp.w"]["byte_range"]
            hsdp_bytes += end - begin
    assert hsdp_bytes == 4 * _numel(SHAPES["hsdp.w"])  # each byte stored once, not twice
    assert shardpoint.verify(saved_on_4).ok


@pytest.mark.slow
@pytest.mark.parametrize("world", [3, 2])
def test_saved_on_4_ranks_loads_bit_identical_on_fewer(saved_on_4, world):
    run_ranks(world, _load_on, str(saved_on_4))


def test_saved_on_4_ranks_loads_bit_identical_in_one_process(saved_on_4):
    state = {name: torch.zeros(shape) for name, shape in SHAPES.items()}
    state |= {"norm": torch.zeros(6), "step": 0}
    shardpoint.load(state, saved_on_4)
    for name, shape in SHAPES.items():
        assert torch.equal(state[name], _global(name, shape)), name
    with shardpoint.open(saved_on_4) as reader:
        assert torch.equal(
            reader.get_slice("tp2d.w")[2:7, 1:5], _global("tp2d.w", (8, 6))[2:7, 1:5]
        )


def _corrupt_copy(src: Path, dst: Path, damage) -> Path:
    shutil.copytree(src, dst)
    damage(dst)
    return dst


@pytest.mark.parametrize(
    "damage,match",
    [
        (
            lambda d: (d / fragment_file(1)).unlink(),
            "rank00001.chunks.json: the chunk fragment is missing",
        ),
        (
            lambda d: (d / fragment_file(2)).write_bytes(
                (d / fragment_file(2)).read_bytes().replace(b'"block_rows":', b'"block_rows": ')
            ),
            "rank00002.chunks.json: the chunk fragment is not the one the index committed",
        ),
        (
            lambda d: [
                (d / "swap").write_bytes((d / fragment_file(0)).read_bytes()),
                (d / fragment_file(0)).write_bytes((d / fragment_file(3)).read_bytes()),
                (d / fragment_file(3)).write_bytes((d / "swap").read_bytes()),
                (d / "swap").unlink(),
            ],
            "rank00000.chunks.json: the chunk fragment is not the one the index committed",
        ),
    ],
    ids=["missing", "edited", "swapped"],
)
def test_a_missing_edited_or_swapped_fragment_is_a_typed_error_naming_it(
    saved_on_4, tmp_path, damage, match
):
    ckpt = _corrupt_copy(saved_on_4, tmp_path / "damaged", damage)
    state = {name: torch.zeros(shape) for name, shape in SHAPES.items()}
    state |= {"norm": torch.zeros(6), "step": 0}
    before = {k: v.clone() for k, v in state.items() if isinstance(v, torch.Tensor)}
    with pytest.raises(CorruptCheckpointError, match=match):
        shardpoint.load(state, ckpt)
    assert all(torch.equal(state[k], v) for k, v in before.items())  # nothing changed
    assert not shardpoint.verify(ckpt).ok


class _MLP(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.a = torch.nn.Linear(12, 16)
        self.b = torch.nn.Linear(16, 10)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.b(torch.relu(self.a(x)))


def _fsdp_tp_save(rank: int, world: int, path: str) -> None:
    """FSDP2 over TP on a 2 x 2 mesh: colwise ``a`` (FSDP2 makes it a strided shard,
    kept in the index as chunks), rowwise ``b`` (Shard(0) x Shard(1): a sharding)."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard
    from torch.distributed.tensor.parallel import (
        ColwiseParallel,
        RowwiseParallel,
        parallelize_module,
    )

    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "tp"))
    model = _MLP()
    parallelize_module(model, mesh["tp"], {"a": ColwiseParallel(), "b": RowwiseParallel()})
    fully_shard(model, mesh=mesh["dp"])
    shardpoint.save(shardpoint.TrainState(model=model, capture_rng_state=False), path)


def _fsdp_load(rank: int, world: int, path: str) -> None:
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    model = _MLP()
    expected = {k: v.clone() for k, v in model.state_dict().items()}
    with torch.no_grad():
        for p in model.parameters():
            p.add_(1.0)  # the load must overwrite every value
    fully_shard(model, mesh=init_device_mesh("cpu", (world,)))
    shardpoint.load(shardpoint.TrainState(model=model, capture_rng_state=False), path)
    for name, value in model.state_dict().items():
        assert torch.equal(value.full_tensor(), expected[name]), name


@pytest.mark.slow
def test_a_real_fsdp2_over_tp_model_saved_on_4_ranks_loads_on_2_and_on_1(tmp_path):
    path = tmp_path / "fsdp-tp"
    run_ranks(4, _fsdp_tp_save, str(path))
    index = json.loads((path / INDEX_NAME).read_text())
    assert "sharding" in index["tensors"]["model.b.weight"]
    run_ranks(2, _fsdp_load, str(path))
    model = _MLP()
    expected = {k: v.clone() for k, v in model.state_dict().items()}
    with torch.no_grad():
        for p in model.parameters():
            p.zero_()
    shardpoint.load(shardpoint.TrainState(model=model, capture_rng_state=False), path)
    for name, value in model.state_dict().items():
        assert torch.equal(value, expected[name]), name
    assert shardpoint.verify(path).ok


def test_a_fragment_that_lies_about_a_chunk_is_refused(saved_on_4, tmp_path):
    """A fragment re-signed in the index (as a hostile or buggy writer could) that
    places rank 1's chunk of ``fsdp.w`` where rank 2's is: refused, naming it, before
    its bytes are used — the sharding, not the fragment, says where a chunk belongs."""
    from conftest import rewrite_index

    from shardpoint.format.index import checksum

    ckpt = tmp_path / "lying"
    shutil.copytree(saved_on_4, ckpt)
    path = ckpt / fragment_file(1)
    doc = json.loads(path.read_text())
    doc["chunks"]["fsdp.w"]["offsets"] = [6, 0]  # rank 2's rows
    raw = json.dumps(doc).encode()
    path.write_bytes(raw)
    rewrite_index(ckpt, lambda d: d["fragments"].update({"1": [len(raw), checksum(raw)]}))
    state = {name: torch.zeros(shape) for name, shape in SHAPES.items()}
    state |= {"norm": torch.zeros(6), "step": 0}
    with pytest.raises(CorruptCheckpointError, match="rank00001.chunks.json.*not the one rank 1"):
        shardpoint.load(state, ckpt)
    assert not shardpoint.verify(ckpt).ok


@pytest.mark.timeout(60)  # the bug this catches was a hang (or all memory) at open
def test_an_index_claiming_a_mesh_of_2_to_the_62_ranks_is_a_typed_error_in_bounded_time(
    tmp_path,
):
    """A 1 kB index may claim a mesh of 2**62 ranks (``{"first": 0, "count": 2**62}``)
    and a tensor of 2**40 rows, one per rank; each of the two fragments, re-signed,
    holds a valid 1-row chunk. Readers must not hold a rank per mesh coordinate nor
    count the sharding's chunks one by one: typed errors, at once."""
    from conftest import rewrite_index

    from shardpoint.format.index import checksum

    ckpt = tmp_path / "huge-mesh"
    shutil.copytree(GOLDEN_V2, ckpt)
    signed = {}
    for rank in (0, 1):
        path = ckpt / fragment_file(rank)
        doc = json.loads(path.read_text())
        chunk = doc["chunks"]["sharded"]
        begin = chunk["byte_range"][0]
        row = (ckpt / chunk["file"]).read_bytes()[begin : begin + 12]
        chunk |= {"offsets": [rank, 0], "shape": [1, 3], "byte_range": [begin, begin + 12]}
        chunk["checksums"] = [checksum(row)]
        raw = json.dumps(doc).encode()
        path.write_bytes(raw)
        signed[str(rank)] = [len(raw), checksum(raw)]

    def claim(doc):
        doc["world_size"] = 2**62
        doc["meshes"] = [{"shape": [2**62], "ranks": {"first": 0, "count": 2**62}}]
        doc["tensors"]["sharded"]["shape"] = [2**40, 3]
        doc["fragments"] = signed
        doc["files"].update({fragment_file(int(r)): {"size": n} for r, (n, _) in signed.items()})

    rewrite_index(ckpt, claim)
    with pytest.raises(CorruptCheckpointError, match="2 chunks of 'sharded'.*more than 2"):
        shardpoint.open(ckpt)
    assert not shardpoint.verify(ckpt).ok
    state = {"sharded": torch.zeros(7, 3), "replicated": torch.zeros(5, dtype=torch.int64)}
    with pytest.raises(shardpoint.StateMismatchError, match="sharded"):
        shardpoint.load(state | {"step": 0, "name": ""}, ckpt)


@pytest.mark.parametrize(
    ("ref", "match"),
    [
        ([2**31, "own.1"], "rank2147483648.chunks.json: the chunk fragment is missing"),
        ([1, "own.7"], "rank00001.chunks.json: has no value at 'own.7'"),
    ],
    ids=["rank-without-fragment", "path-not-in-fragment"],
)
def test_a_tree_that_keeps_a_value_in_a_fragment_that_lacks_it_fails_verify(tmp_path, ref, match):
    """Found by the fuzzer: the index's state tree said rank 2**31's fragment holds
    ``own.1``; ``verify`` passed (it read every fragment but resolved no value) while
    ``inspect`` failed. Whatever reads the whole checkpoint now resolves them all."""
    from conftest import rewrite_index

    ckpt = tmp_path / "dangling"
    shutil.copytree(GOLDEN_V2, ckpt)

    def dangle(doc):
        own = dict(doc["tree"]["dict"])["own"]["dict"]
        own[1][1] = {"in_fragment": ref}

    rewrite_index(ckpt, dangle)
    report = shardpoint.verify(ckpt)
    assert not report.ok and match in str(report.errors), report.errors
    with pytest.raises(CorruptCheckpointError, match=re.escape(match)):
        shardpoint.open(ckpt)


@pytest.mark.parametrize(
    ("value", "match"),
    [
        ({"tensor": "\x00"}, "names tensor '\\x00', which neither it nor index.json holds"),
        ({"in_fragment": [1, "own.1"]}, "refers to a fragment again"),
    ],
    ids=["tensor-held-nowhere", "fragment-in-a-fragment"],
)
def test_a_fragment_value_naming_what_no_file_holds_is_a_typed_error(tmp_path, value, match):
    """Found by the fuzzer (a fragment re-signed in the index, as a hostile writer
    could): ``shardpoint inspect`` raised a bare KeyError for a value naming a tensor
    held nowhere; a value naming a fragment again would recurse without end."""
    from conftest import rewrite_index

    from shardpoint.cli import main as cli_main
    from shardpoint.format.index import checksum

    ckpt = tmp_path / "named"
    shutil.copytree(GOLDEN_V2, ckpt)
    path = ckpt / fragment_file(1)
    doc = json.loads(path.read_text())
    doc["values"]["own.1"]["dict"][1][1] = value  # ["mask", {"tensor": "own.1.mask"}]
    raw = json.dumps(doc).encode()
    path.write_bytes(raw)

    def sign(index):
        index["fragments"]["1"] = [len(raw), checksum(raw)]
        index["files"][fragment_file(1)]["size"] = len(raw)

    rewrite_index(ckpt, sign)
    with pytest.raises(CorruptCheckpointError, match=re.escape(match)):
        shardpoint.open(ckpt)
    assert not shardpoint.verify(ckpt).ok
    assert cli_main(["inspect", str(ckpt)]) == 2


def _save_rng(rank: int, world: int, path: str) -> None:
    torch.manual_seed(1000 + rank)
    torch.rand(3)  # move the stream on from the seed
    shardpoint.save(shardpoint.TrainState(step=5), path)
    torch.save(torch.rand(4), f"{path}-draw{rank}.pt")  # what a resumed rank must draw next


def _restore_rng(rank: int, world: int, path: str) -> None:
    torch.manual_seed(0)  # a fresh process's stream
    state = shardpoint.TrainState()
    shardpoint.load(state, path)
    assert state.step == 5
    assert torch.equal(torch.rand(4), torch.load(f"{path}-draw{rank}.pt")), rank


@pytest.mark.slow
def test_each_ranks_rng_streams_live_in_its_fragment_not_in_the_index(tmp_path):
    """TrainState's RNG streams (a set per rank, tensors included) go to the rank's
    fragment: the index holds one small reference per rank, and every rank gets its
    own streams back."""
    path = tmp_path / "rng"
    run_ranks(4, _save_rng, str(path))
    doc = json.loads((path / INDEX_NAME).read_text())
    rng = dict(next(v for k, v in doc["tree"]["dict"] if k == "rng")["dict"])
    assert rng == {r: {"in_fragment": [r, f"rng.{r}"]} for r in range(4)}
    assert not any(name.startswith("rng.") for name in doc["tensors"])
    assert len(json.dumps(doc)) < 1_000 + 4 * 200  # ~150 bytes per rank, not ~1 KB
    for rank in range(4):
        fragment = json.loads((path / fragment_file(rank)).read_text())
        assert list(fragment["values"]) == [f"rng.{rank}"]
        assert fragment["tensors"] and all(
            n.startswith(f"rng.{rank}.") for n in fragment["tensors"]
        )
    run_ranks(4, _restore_rng, str(path))
    with shardpoint.open(path) as reader:  # the whole state, every rank's streams included
        assert sorted(reader.state()["rng"]) == [0, 1, 2, 3]
        assert {f"rng.{r}.torch" for r in range(4)} <= set(reader.keys())
    assert shardpoint.verify(path).ok


def _strided_alone(rank: int, world: int, path: str) -> None:
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import distribute_tensor
    from torch.distributed.tensor.placement_types import _StridedShard

    mesh = init_device_mesh("cpu", (world,))
    strided = distribute_tensor(torch.arange(8.0), mesh, [_StridedShard(0, split_factor=2)])
    assert strided.to_local().tolist() == [[0.0, 1.0, 4.0, 5.0], [2.0, 3.0, 6.0, 7.0]][rank]
    with pytest.raises(shardpoint.UnsupportedValueError, match="not one block"):
        shardpoint.load({"w": strided}, path)
    assert strided.to_local().tolist() == [[0.0, 1.0, 4.0, 5.0], [2.0, 3.0, 6.0, 7.0]][rank]
    with pytest.raises(shardpoint.UnsupportedValueError, match="not one block"):
        shardpoint.save({"w": strided}, path + "-strided")


@pytest.mark.slow
def test_a_strided_shard_that_is_not_one_block_is_refused_on_load_and_save(tmp_path):
    """``_StridedShard`` alone (no later Shard resolving it, unlike FSDP2 over TP above)
    holds rows 0, 1, 4, 5 of 8 on rank 0: loading it as the block at its offset put
    rows 0-3 there, and a save committed overlapping chunks no later open accepted."""
    path = tmp_path / "plain"
    shardpoint.save({"w": torch.arange(8.0)}, path)
    run_ranks(2, _strided_alone, str(path))
    assert not (tmp_path / "plain-strided" / "COMMITTED").exists()
