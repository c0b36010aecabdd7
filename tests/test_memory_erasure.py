"""Erasure-coded memory tier: simulated nodes of one rank each (gloo), a separate
shared-memory directory per node. Wiped nodes are rebuilt from their parity group's
pieces without reading the disk tier; more losses than parity fall back to the disk
with an event; a corrupt piece is caught by its checksum before it is used."""

from __future__ import annotations

import json
import os
import shutil
import sys
from pathlib import Path

import numpy as np
import pytest
import torch
from distributed import count_disk_reads

from shardpoint import (
    CheckpointManager,
    ErasureCode,
    MemoryTierOptions,
    Replicas,
    SavePolicy,
)
from shardpoint.errors import CheckpointError
from shardpoint.training.erasure import Codec, Placement, placement, rs_width


def _state(step: int, mesh) -> dict:  # noqa: ANN001
    from torch.distributed.tensor import Shard, distribute_tensor

    g = torch.Generator().manual_seed(step)
    # 401 rows over the ranks: shards of different sizes, so the group pads the smaller
    # copies' chunks.
    full = torch.randn(401, 9, generator=g)
    return {
        "sharded": distribute_tensor(full, mesh, [Shard(0)]),
        "bias": torch.randn(11, generator=g, dtype=torch.float64),
        "step": step,
    }


def _template(mesh) -> dict:  # noqa: ANN001
    from torch.distributed.tensor import Shard, distribute_tensor

    return {
        "sharded": distribute_tensor(torch.zeros(401, 9), mesh, [Shard(0)]),
        "bias": torch.zeros(11, dtype=torch.float64),
        "step": -1,
    }


def _same(state: dict, step: int, mesh) -> None:  # noqa: ANN001
    want = _state(step, mesh)
    assert torch.equal(state["sharded"].to_local(), want["sharded"].to_local())
    assert torch.equal(state["bias"], want["bias"])
    assert state["step"] == step


def _mesh(world: int):  # noqa: ANN202
    from torch.distributed.device_mesh import init_device_mesh

    return init_device_mesh("cpu", (world,))


def _manager(root: str, data: int, parity: int, events: list | None = None) -> CheckpointManager:
    os.environ["LOCAL_WORLD_SIZE"] = "1"  # every rank a node of its own
    return CheckpointManager(
        Path(root) / "disk",
        policy=SavePolicy(every_n_steps=3),
        memory=MemoryTierOptions(
            every_n_steps=1,
            job="job",  # data=0: Replicas(parity), for the tests of ranks that move
            redundancy=ErasureCode(data=data, parity=parity) if data else Replicas(parity),
        ),
        preemption_signals=(),
        on_event=[events.append] if events is not None else (),
    )


def _node(rank: int, root: str, nodes: list[int] | None = None) -> None:
    """Rank ``rank`` runs on node ``nodes[rank]`` (default: node ``rank``)."""
    os.environ["SHARDPOINT_SHM_DIR"] = str(Path(root) / f"node{(nodes or {}).get(rank, rank)}")


def _train(rank: int, world: int, root: str, data: int, parity: int) -> None:
    _node(rank, root)
    mesh = _mesh(world)
    manager = _manager(root, data, parity)
    for step in range(1, 6):  # disk: step 3; memory: step 5
        manager.maybe_save(step, _state(step, mesh))
    manager.close()


def _restore(rank: int, world: int, root: str, data: int, parity: int, expect: dict) -> None:
    _node(rank, root, expect.get("nodes"))
    disk_bytes = count_disk_reads(Path(root) / "disk")
    events: list[dict] = []
    manager = _manager(root, data, parity, events)
    mesh = _mesh(world)
    state = _template(mesh)
    step = manager.restore(state)
    assert step == expect["step"], (rank, step, events)
    _same(state, step, mesh)
    if expect["tier"] == "memory":
        assert disk_bytes[0] == 0, disk_bytes  # nothing read from the disk tier
        assert manager.memory.rebuilt == (rank in expect.get("rebuilt", []))
    if rank == 0:  # the event log, written by rank 0, says where the state came from
        restored = [e for e in events if e["event"] == "restore"]
        assert restored[-1].get("tier", "storage") == expect["tier"], events
        assert restored[-1].get("ranks_rebuilt", []) == expect.get("rebuilt", []), restored
        moved = restored[-1].get("ranks_from_buddies", [])
        assert moved == expect.get("moved", []), restored
        fallback = [e for e in events if e["event"] == "fallback" and e.get("tier") == "memory"]
        assert bool(fallback) == bool(expect.get("memory_fallback")), events
        if fallback:  # e.g. refused before decoding, not by the rebuilt copy's checksums
            assert expect["memory_fallback"] in fallback[0]["error"], fallback
    manager.close()


def _wipe(root: Path, *nodes: int) -> None:
    for node in nodes:
        shutil.rmtree(root / f"node{node}")


@pytest.mark.slow
def test_one_wiped_node_of_three_is_rebuilt_from_xor_parity_without_the_disk(tmp_path):
    """2+1 on 3 nodes: a replaced node's rank rebuilds its copy from the two others'
    data chunks and parity; a restart on every node then finds its own copy."""
    from distributed import run_ranks

    root = str(tmp_path)
    run_ranks(3, _train, root, 2, 1)
    parity = sorted(p.name for p in (tmp_path / "node1").rglob("codeword*.bin"))
    assert parity == ["codeword1.bin"], parity  # one codeword's parity per member (m=1)
    _wipe(tmp_path, 1)
    run_ranks(3, _restore, root, 2, 1, {"step": 5, "tier": "memory", "rebuilt": [1]})
    run_ranks(3, _restore, root, 2, 1, {"step": 5, "tier": "memory", "rebuilt": []})


@pytest.mark.slow
def test_a_replaced_node_that_comes_back_with_another_nodes_rank_is_rebuilt(tmp_path):
    """torchrun numbers nodes as they join: node 1 wiped and back last, so it runs rank
    2, and rank 1 lands on node 2, whose memory holds rank 2's copy. Rank 1 is rebuilt
    (one of its pieces is rank 2's chunk in its own slot, read without a transfer) and
    rank 2 gets its copy from node 2; a second restart finds every copy in place."""
    from distributed import run_ranks

    root = str(tmp_path)
    run_ranks(3, _train, root, 2, 1)
    _wipe(tmp_path, 1)
    nodes = {0: 0, 1: 2, 2: 1}
    expect = {"step": 5, "tier": "memory", "rebuilt": [1], "moved": [2], "nodes": nodes}
    run_ranks(3, _restore, root, 2, 1, expect)
    expect = {"step": 5, "tier": "memory", "nodes": nodes}
    run_ranks(3, _restore, root, 2, 1, expect)


@pytest.mark.slow
def test_with_replicas_ranks_that_swap_nodes_take_their_copies_from_where_they_are(tmp_path):
    """Replicas(1) on 2 nodes: node 0 replaced, and the new job numbers the nodes the
    other way round. Rank 0 now runs on old node 1, which holds rank 0's replica: it
    takes it as its copy in place; rank 1, on the new node, receives its own copy from
    old node 1. Nothing from the disk."""
    from distributed import run_ranks

    root = str(tmp_path)
    run_ranks(2, _train, root, 0, 1)
    _wipe(tmp_path, 0)
    nodes = {0: 1, 1: 0}
    expect = {"step": 5, "tier": "memory", "moved": [1], "nodes": nodes}
    run_ranks(2, _restore, root, 0, 1, expect)
    run_ranks(2, _restore, root, 0, 1, {"step": 5, "tier": "memory", "nodes": nodes})


@pytest.mark.slow
def test_two_wiped_nodes_of_four_are_rebuilt_with_two_parity_pieces(tmp_path):
    """2+2 on 4 nodes (Reed-Solomon, pyeclib): any two nodes may go."""
    from distributed import run_ranks

    root = str(tmp_path)
    run_ranks(4, _train, root, 2, 2)
    _wipe(tmp_path, 0, 2)
    run_ranks(4, _restore, root, 2, 2, {"step": 5, "tier": "memory", "rebuilt": [0, 2]})


@pytest.mark.slow
@pytest.mark.parametrize(
    ("data", "parity", "wiped"), [(2, 1, (0, 1)), (2, 2, (0, 1, 3)), (4, 2, (0, 2, 4))]
)
def test_more_lost_nodes_than_parity_fall_back_to_the_disk(tmp_path, data, parity, wiped):
    """2+1 with two of three nodes wiped, 2+2 with three of four, 4+2 with three of six
    (every codeword of every lost rank keeps a parity piece, but some have fewer than
    4 pieces in all): no step can be rebuilt, so the memory tier offers none, says whose
    copies are lost, and the disk's step 3 is restored."""
    from distributed import run_ranks

    root = str(tmp_path)
    run_ranks(data + parity, _train, root, data, parity)
    _wipe(tmp_path, *wiped)
    expect = {"step": 3, "tier": "storage", "memory_fallback": "on no surviving node"}
    run_ranks(data + parity, _restore, root, data, parity, expect)


@pytest.mark.slow
@pytest.mark.parametrize("corrupt", ["parity", "data"])
def test_a_corrupt_piece_is_caught_by_its_checksum_and_the_disk_is_used(tmp_path, corrupt):
    """One flipped byte in the parity a rebuild needs, or in a surviving member's copy
    (a chunk given to the rebuild): the rebuilding rank refuses it before decoding; every
    rank falls back to the disk's step 3 with a `fallback` event naming the piece."""
    from distributed import run_ranks

    root = str(tmp_path)
    run_ranks(3, _train, root, 2, 1)
    _wipe(tmp_path, 1)
    if corrupt == "parity":  # node 0 holds codeword 0's parity, which rank 1 needs
        victim = next((tmp_path / "node0").rglob("codeword0.bin"))
    else:  # rank 2's copy: its shard file gives a chunk to codeword 0
        victim = next(p for p in (tmp_path / "node2").rglob("*.safetensors") if "own" in p.parts)
    data = bytearray(victim.read_bytes())
    data[len(data) // 3] ^= 0xFF
    victim.write_bytes(bytes(data))
    expect = {"step": 3, "tier": "storage", "memory_fallback": "does not match its checksum"}
    run_ranks(3, _restore, root, 2, 1, expect)


@pytest.mark.slow
def test_on_torchrun_a_sigkilled_rank_and_a_wiped_node_resume_exactly_from_memory(tmp_path):
    """3 simulated nodes x 1 rank, one ``torchrun --max-restarts --rdzv-backend=c10d``
    per node (bench/bench_goodput.py's campaign, 2+1 parity): a SIGKILLed rank restores
    from its own memory, a node wiped (agent and rank SIGKILLed, disk and shared memory
    gone, a new agent) rebuilds its rank's copy from the two other nodes' pieces, and
    the job ends bit-identical to one that never failed."""
    import json

    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "bench"))
    import bench_goodput

    config = bench_goodput.Config(
        failures=3, seed=2, nodes=3, per_node=1, erasure="2+1", kinds=("process", "node")
    )
    reference = bench_goodput.run_job(tmp_path / "reference", config, failures=False)
    campaign = bench_goodput.run_job(tmp_path / "campaign", config, failures=True)
    assert bench_goodput.compare(campaign, reference) == []
    assert campaign["leaked_dev_shm"] == []
    kinds = sorted(f["kind"] for f in campaign["failures"])
    assert "node" in kinds and "process" in kinds, kinds
    for f in campaign["failures"]:
        assert f["tier"] == "memory", f
        assert f["steps_lost"] <= config.memory_every, f
    log = tmp_path / "campaign" / "node0" / "nvme" / "events.jsonl"
    restores = [e for e in map(json.loads, log.read_text().splitlines()) if e["event"] == "restore"]
    rebuilt = [e.get("ranks_rebuilt", []) for e in restores if e.get("tier") == "memory"]
    assert rebuilt.count([1]) == kinds.count("node"), restores  # node 1's rank, from parity


@pytest.mark.slow
def test_a_corrupt_parity_piece_is_caught_by_the_rebuilding_rank(tmp_path):
    """2+2 (Reed-Solomon: the rebuilding rank receives the pieces and decodes them
    itself): a flipped byte in every parity piece of the surviving nodes is refused by
    the rebuilding rank's check before decoding, and every rank restores the disk's step."""
    from distributed import run_ranks

    root = str(tmp_path)
    run_ranks(4, _train, root, 2, 2)
    _wipe(tmp_path, 1)
    for victim in tmp_path.rglob("codeword*.bin"):
        data = bytearray(victim.read_bytes())
        data[len(data) // 3] ^= 0xFF
        victim.write_bytes(bytes(data))
    expect = {"step": 3, "tier": "storage", "memory_fallback": "does not match its checksum"}
    run_ranks(4, _restore, root, 2, 2, expect)


# ---- the placement and the codecs, in one process -------------------------------------------


def test_every_codeword_has_its_pieces_on_distinct_nodes_and_parity_is_balanced():
    for nodes, per_node, k, m in [(3, 1, 2, 1), (4, 2, 2, 2), (7, 2, 2, 1), (11, 1, 4, 1)]:
        world = nodes * per_node
        groups = {placement(r, world, per_node, k, m) for r in range(world)}
        assert sorted(r for g in groups for r in g.members) == list(range(world))
        for g in groups:
            node_of = [r // per_node for r in g.members]
            assert len(set(node_of)) == len(g.members)  # one member per node
            n = len(g.members)
            for j in range(n):
                assert sorted(g.holders(j) + g.data(j)) == list(range(n))
            for p in range(n):  # each member: k chunks given, m parity pieces held
                assert len(g.chunks(p)) == g.k
                assert sum(p in g.holders(j) for j in range(n)) == m


def test_a_job_with_fewer_nodes_than_a_group_is_refused_with_the_fix():
    with pytest.raises(CheckpointError, match=r"needs 3 nodes.*has 2 nodes"):
        placement(0, 4, 2, 2, 1)
    with pytest.raises(CheckpointError, match="not a multiple of 2 per node"):
        placement(0, 5, 2, 2, 1)


def test_a_codec_that_cannot_run_here_is_refused_at_start(monkeypatch):
    """pyeclib failing (missing, or its backend not in the wheel) is a CheckpointError
    on every rank when the tier starts, never a hang in the middle of a save."""
    import pyeclib.ec_iface

    def broken(**kwargs):  # noqa: ANN003, ANN202
        raise RuntimeError("backend not available")

    monkeypatch.setattr(pyeclib.ec_iface, "ECDriver", broken)
    with pytest.raises(CheckpointError, match="does not work here.*backend not available"):
        Codec(2, 2).check()
    Codec(2, 1).check()  # XOR needs nothing


@pytest.mark.parametrize(("k", "m"), [(2, 1), (4, 1), (2, 2), (4, 2), (3, 3)])
def test_the_codec_rebuilds_any_piece_from_any_k_others(k, m):
    rng = np.random.default_rng(k * 10 + m)
    size = Placement(tuple(range(k + m)), m).chunk_bytes([3 * rs_width(k) * k - 5])
    data = [rng.integers(0, 256, size, dtype=np.uint8) for _ in range(k)]
    codec = Codec(k, m)
    pieces = dict(enumerate(data + codec.encode(data)))
    for lost in range(k + m):
        others = [i for i in pieces if i != lost]
        for start in range(len(others) - k + 1):
            given = {i: pieces[i] for i in others[start : start + k]}
            assert np.array_equal(codec.rebuild(given, lost), pieces[lost]), (lost, given.keys())


def test_the_old_replicas_spelling_names_the_new_one():
    with pytest.raises(TypeError, match=r"redundancy=Replicas\(2\)"):
        MemoryTierOptions(every_n_steps=5, replicas=2)
    assert MemoryTierOptions(every_n_steps=5).redundancy == Replicas(1)
    with pytest.raises(TypeError, match="Replicas"):
        MemoryTierOptions(every_n_steps=5, redundancy=2)  # type: ignore[arg-type]


def test_the_parity_manifest_is_written_last(tmp_path):
    """A parity copy is offered only once its manifest exists, and the manifest appears
    whole (written under another name, then renamed)."""
    from shardpoint.training.parity import PARITY_MANIFEST, write_manifest

    target = tmp_path / PARITY_MANIFEST
    write_manifest(tmp_path, {"a": 1})
    assert json.loads(target.read_bytes()) == {"a": 1}
    assert [p.name for p in tmp_path.iterdir()] == [PARITY_MANIFEST]


def test_the_partial_files_of_a_killed_rebuild_are_removed_by_the_next_save(tmp_path):
    from shardpoint.training.memory_tier import MemoryTier

    tier = MemoryTier("job", root=tmp_path)
    leftover = tier.own_dir(4).parent / ".rebuild-step-000000004"
    leftover.mkdir(parents=True)
    (leftover / "rank00000-00000.safetensors").write_bytes(b"\0" * 100)
    tier.save(5, {"w": torch.ones(10)})
    tier.wait()
    assert sorted(p.name for p in tier.own_dir(5).parent.iterdir()) == ["step-000000005"]
    tier.close(release=True)
