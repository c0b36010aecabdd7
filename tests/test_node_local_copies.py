"""Node-local checkpoint directories on two simulated nodes of two ranks each, with a
remote tier on an S3-API server (moto on 127.0.0.1).

Ranks are spawned processes joined by gloo; torchrun's ``LOCAL_RANK`` / ``GROUP_RANK``
are set by hand so that ranks 0-1 are node 0 and ranks 2-3 node 1, and each node gets
a directory of its own (``root/node0``, ``root/node1``) that the other never sees.
Replicated state (DDP-style: the same plain tensors on every rank) must then be on
each node's disk once, split among that node's ranks, so that a node restores from
its own disk alone; a node that lost its disk reads from the remote tier only.
"""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path

import boto3
import pytest
import test_object_store
import torch
import torch.distributed as dist
from distributed import count_received, run_ranks
from test_object_store import CREDENTIALS

from shardpoint import CheckpointManager, RemoteTier, SavePolicy
from shardpoint.format.index import INDEX_NAME, MARKER_NAME
from shardpoint.names import writer_rank
from shardpoint.training.tiers import CheckpointTier

# The moto server and a fresh bucket per test (fixtures of test_object_store).
moto_endpoint = test_object_store.moto_endpoint
s3 = test_object_store.s3

WORLD, RANKS_PER_NODE = 4, 2
STEP_DIR = "step-000000001"
SHARED_BYTES = 1024 * 1024 * 4 + 1024 * 4 + 100 * 16 * 8 + 512 * 8  # _shared()'s tensors


def _as_node(rank: int) -> int:
    """What torchrun would set for 2 nodes x 2 ranks; returns the node."""
    os.environ["LOCAL_RANK"] = str(rank % RANKS_PER_NODE)
    os.environ["GROUP_RANK"] = str(rank // RANKS_PER_NODE)
    os.environ["LOCAL_WORLD_SIZE"] = str(RANKS_PER_NODE)
    return rank // RANKS_PER_NODE


def _node_dir(root: str, node: int) -> Path:
    return Path(root) / f"node{node}"


def _shared() -> dict:
    """Identical on every rank (a DDP model): ~4.2 MB, one tensor large enough to be
    split among a node's ranks."""
    g = torch.Generator().manual_seed(1234)
    return {
        "w": torch.randn(1024, 1024, generator=g),
        "b": torch.randn(1024, generator=g),
        "emb": torch.randn(100, 16, generator=g, dtype=torch.float64),
        "count": torch.arange(512, dtype=torch.int64) * 3,
    }


def _own(rank: int) -> torch.Tensor:
    """A tensor only ``rank`` holds (like its RNG streams): different on every rank."""
    return torch.arange(3000, dtype=torch.float32) + 1000.0 * (rank + 1)


class PerRank:
    """Saved under a key of its rank (``rank<R>``); on restore each rank reads back only
    its own key (``stored_keys_to_load``), as ``TrainState`` does with RNG streams."""

    def __init__(self, rank: int, tensor: torch.Tensor) -> None:
        self.key = f"rank{rank}"
        self.tensor = tensor

    def state_dict(self) -> dict:
        return {self.key: self.tensor}

    def load_state_dict(self, sd: dict) -> None:
        self.tensor = sd[self.key]

    def stored_keys_to_load(self, rel: tuple, keys: list) -> list | None:
        return [self.key] if rel == () else None


def _state(rank: int) -> dict:
    return {"model": _shared(), "per_rank": PerRank(rank, _own(rank)), "step": 7}


def _template(rank: int) -> dict:
    return {
        "model": {k: torch.zeros_like(v) for k, v in _shared().items()},
        "per_rank": PerRank(rank, torch.zeros(3000)),
        "step": 0,
    }


def _check_restored(rank: int, restored: dict) -> None:
    expected = _shared()
    assert restored["model"].keys() == expected.keys()
    for k, v in expected.items():
        assert torch.equal(restored["model"][k], v), f"rank {rank}: model.{k}"
    assert torch.equal(restored["per_rank"].tensor, _own(rank)), f"rank {rank}: per_rank"
    assert restored["step"] == 7, f"rank {rank}: step"


def _manager(rank: int, root: str, remote: str) -> CheckpointManager:
    manager = CheckpointManager(
        _node_dir(root, rank // RANKS_PER_NODE),
        policy=SavePolicy(every_n_steps=1),
        remote=RemoteTier(remote),
        preemption_signals=(),
    )
    assert manager.per_node, f"rank {rank}: node-local directories not detected"
    return manager


# ---- rank functions (module level: spawned processes import them) ---------------------------


def _save_and_upload(rank: int, world: int, root: str, remote: str, env: dict) -> None:
    import threading

    from shardpoint import dist as sp_dist

    os.environ.update(env)
    _as_node(rank)
    manager = _manager(rank, root, remote)
    # What the upload rounds (on their own thread) exchange must not grow with the ranks.
    real = sp_dist.all_gather_json

    def no_all_gather_on_the_upload_thread(*args, **kwargs):
        assert threading.current_thread().name != "shardpoint-upload", "an upload all-gather"
        return real(*args, **kwargs)

    sp_dist.all_gather_json = no_all_gather_on_the_upload_thread
    assert manager.save(1, _state(rank)) is not None
    assert manager.wait_for_uploads(timeout=300), f"rank {rank}: upload still running"
    manager.close()


def _restore_without_the_remote(rank: int, world: int, root: str, remote: str, env: dict) -> None:
    """Every node restores from its own disk: the remote copy is deleted first."""
    os.environ.update(env)
    node = _as_node(rank)
    manager = _manager(rank, root, remote)
    assert manager.wait_for_uploads(timeout=300)  # the start-up round found it uploaded
    dist.barrier()
    if rank == 0:
        client = boto3.client("s3")
        bucket, _, prefix = remote.removeprefix("s3://").partition("/")
        listed = client.list_objects_v2(Bucket=bucket, Prefix=f"{prefix}/")
        keys = [o["Key"] for o in listed.get("Contents", [])]
        assert keys, "nothing was uploaded: deleting the remote copy proves nothing"
        for key in keys:
            client.delete_object(Bucket=bucket, Key=key)
    dist.barrier()
    assert manager.remote_steps() == [], f"rank {rank}: the remote copy is still there"
    assert manager.steps() == [1], f"rank {rank} (node {node}): no local copy"
    restored = _template(rank)
    assert manager.restore(restored) == 1, f"rank {rank}: nothing restored"
    _check_restored(rank, restored)
    manager.close()


def _restore_node1_wiped(rank: int, world: int, root: str, remote: str, env: dict) -> None:
    os.environ.update(env)
    node = _as_node(rank)
    manager = _manager(rank, root, remote)
    assert manager.steps() == ([1] if node == 0 else []), f"rank {rank}: {manager.steps()}"
    assert manager.remote_steps() == [1]
    restored = _template(rank)
    assert manager.restore(restored) == 1, f"rank {rank}: nothing restored"
    _check_restored(rank, restored)
    manager.close()


# ---- helpers in the test process ------------------------------------------------------------


def _env() -> dict:
    return {k: os.environ[k] for k in (*CREDENTIALS, "AWS_ENDPOINT_URL")}


def _save(tmp_path: Path, s3) -> tuple[str, str]:
    root, remote = str(tmp_path / "nodes"), f"{s3['url']}/run"
    run_ranks(WORLD, _save_and_upload, root, remote, _env())
    assert CheckpointTier(remote, None).steps() == [1]
    return root, remote


def _index(root: str, node: int) -> dict:
    return json.loads((_node_dir(root, node) / STEP_DIR / INDEX_NAME).read_bytes())


def _restore_events(root: str) -> list[dict]:
    """Rank 0's event log (node 0's directory) holds the restore events."""
    lines = (_node_dir(root, 0) / "events.jsonl").read_text().splitlines()
    return [e for e in map(json.loads, lines) if e["event"] == "restore"]


# ---- tests ------------------------------------------------------------------------------------


@pytest.mark.slow
def test_each_node_holds_and_indexes_its_own_copy_and_restores_from_it_alone(tmp_path, s3):
    root, remote = _save(tmp_path, s3)
    shared_names = {f"model.{k}" for k in _shared()}
    for node in (0, 1):
        ranks = {node * RANKS_PER_NODE + i for i in range(RANKS_PER_NODE)}
        step = _node_dir(root, node) / STEP_DIR
        present = {p.name for p in step.iterdir()}
        assert {INDEX_NAME, MARKER_NAME} <= present
        shards = {n for n in present if n.endswith(".safetensors")}
        # Only this node's ranks' files, and every one of them wrote some.
        assert {writer_rank(n) for n in shards} == ranks, (node, sorted(shards))
        index = _index(root, node)
        # It names other nodes' files only for their ranks' own tensors (checked below).
        elsewhere = set(index["files"]) - present
        assert all(writer_rank(n) not in ranks for n in elsewhere), (node, elsewhere)
        tensors = index["tensors"]
        assert shared_names <= set(tensors), sorted(tensors)
        for name in shared_names:
            files = {c["file"] for c in tensors[name]["chunks"]}
            assert files <= shards, (node, name, files)  # on this node's disk
            assert {writer_rank(f) for f in files} <= ranks
        # The 4 MiB tensor is split among the node's ranks, once per node.
        w_writers = {writer_rank(c["file"]) for c in tensors["model.w"]["chunks"]}
        assert w_writers == ranks, (node, w_writers)
        # A rank's own tensor is in its own file, named by every node's index.
        for r in range(WORLD):
            (chunk,) = tensors[f"per_rank.rank{r}"]["chunks"]
            assert writer_rank(chunk["file"]) == r
        # This node's shard bytes hold a whole copy of the replicated state.
        assert sum((step / n).stat().st_size for n in shards) >= SHARED_BYTES
    # The two indexes name different copies of the replicated state.
    w0 = {c["file"] for c in _index(root, 0)["tensors"]["model.w"]["chunks"]}
    w1 = {c["file"] for c in _index(root, 1)["tensors"]["model.w"]["chunks"]}
    assert not w0 & w1
    # The remote holds rank 0's (node 0's) index and every file it names, committed.
    client, bucket = s3["client"], s3["bucket"]
    listed = client.list_objects_v2(Bucket=bucket, Prefix=f"run/{STEP_DIR}/")
    remote_names = {o["Key"].rsplit("/", 1)[1] for o in listed["Contents"]}
    assert remote_names == {*_index(root, 0)["files"], INDEX_NAME, MARKER_NAME}
    remote_index = client.get_object(Bucket=bucket, Key=f"run/{STEP_DIR}/{INDEX_NAME}")
    assert remote_index["Body"].read() == (_node_dir(root, 0) / STEP_DIR / INDEX_NAME).read_bytes()

    run_ranks(WORLD, _restore_without_the_remote, root, remote, _env())
    (event,) = _restore_events(root)
    assert event["step"] == 1
    assert event["bytes_from_remote_by_rank"] == [0] * WORLD
    assert event["bytes_from_remote"] == 0
    assert CheckpointTier(remote, None).step_dirs() == []  # it stayed deleted throughout


@pytest.mark.slow
def test_a_node_that_lost_its_disk_reads_from_the_remote_and_only_it_does(tmp_path, s3):
    root, remote = _save(tmp_path, s3)
    shutil.rmtree(_node_dir(root, 1))  # node 1 replaced: an empty local disk
    run_ranks(WORLD, _restore_node1_wiped, root, remote, _env())
    (event,) = _restore_events(root)
    assert event["step"] == 1
    by_rank = event["bytes_from_remote_by_rank"]
    assert len(by_rank) == WORLD
    assert by_rank[:2] == [0, 0], by_rank  # node 0 read its own disk only
    # Node 1's ranks read from the remote what no rank of node 0 reads for them: the
    # restore shares reads, so each replicated byte comes from storage once (node 0's
    # disk or the remote), not once per rank (which was >= 2 x SHARED_BYTES here).
    assert 0 < sum(by_rank[2:]) < 2 * SHARED_BYTES, by_rank
    assert event["bytes_from_remote"] == sum(by_rank)


def _save_with_node_1_failing_its_commit(rank: int, world: int, root: str) -> None:
    import pytest

    from shardpoint.commit import Commit
    from shardpoint.errors import CheckpointError
    from shardpoint.save_records import SaveOptions
    from shardpoint.saving import run_save
    from shardpoint.storage import open_storage
    from shardpoint.storage.local import LocalDirectory

    node = _as_node(rank)
    if node == 1:  # its first rank cannot write its node's index

        def failing(self, index, checkpoint=None):
            raise OSError(28, "No space left on device (injected)")

        Commit.finish = failing
    # Node 0's ranks log every file they delete, in one append-only log, in order.
    log = os.open(Path(root, "deleted.log"), os.O_WRONLY | os.O_CREAT | os.O_APPEND)
    real_delete = LocalDirectory.delete

    def logged(self, name):
        if node == 0:
            os.write(log, f"{name}\n".encode())
        return real_delete(self, name)

    LocalDirectory.delete = logged
    storage = open_storage(str(_node_dir(root, node) / STEP_DIR))
    with pytest.raises(CheckpointError, match="injected"):
        run_save(_state(rank), storage, SaveOptions(per_node=True))


def test_a_node_that_cannot_commit_makes_every_node_withdraw_its_copy(tmp_path):
    """Node 0 commits its copy; node 1's commit fails: node 0 takes its copy back,
    marker first, before any of its ranks removes a shard file (a crash in between must
    not leave a copy that looks whole), and every rank raises, none waits."""
    from distributed import run_ranks_outcomes

    outcomes = run_ranks_outcomes(
        WORLD, _save_with_node_1_failing_its_commit, str(tmp_path), errors=tmp_path / "errors"
    )
    assert all(o.exitcode == 0 for o in outcomes), "\n".join(map(str, outcomes))
    for node in (0, 1):
        step = _node_dir(str(tmp_path), node) / STEP_DIR
        assert not (step / MARKER_NAME).exists(), f"node {node} kept a committed copy"
    deleted = (tmp_path / "deleted.log").read_text().split()
    shards = [i for i, name in enumerate(deleted) if name.endswith(".safetensors")]
    assert MARKER_NAME in deleted and shards, deleted
    assert deleted.index(MARKER_NAME) < min(shards), deleted


def _steady_per_node_saves(rank: int, world: int, root: str) -> None:
    from shardpoint.save_records import SaveOptions
    from shardpoint.saving import run_save
    from shardpoint.storage import open_storage

    node = _as_node(rank)
    log: list[tuple[str, int]] = []
    count_received(log)
    for step in range(2):  # the second reuses the plan
        before = len(log)
        storage = open_storage(str(_node_dir(root, node) / f"step{step}"))
        run_save(_state(rank), storage, SaveOptions(per_node=True))
    Path(root, f"received{rank}.json").write_text(json.dumps(log[before:]))


@pytest.mark.slow
def test_only_each_nodes_first_rank_receives_what_its_nodes_index_needs(tmp_path):
    """Rank 0 relays the index inputs (every rank's report, the tree, ...: O(ranks) per
    save) to the nodes' first ranks only: the other ranks of a node receive a few
    bytes of agreement and outcome, whatever the job's size."""
    root = str(tmp_path)
    run_ranks(WORLD, _steady_per_node_saves, root)
    received = [json.loads(Path(root, f"received{r}.json").read_text()) for r in range(WORLD)]
    for rank in (1, 3):  # not first on their node
        assert sum(n for _, n in received[rank]) < 100, received[rank]
    leader = received[RANKS_PER_NODE]  # node 1's first rank: the inputs, then the index
    assert sum(n for name, n in leader if name == "recv") > 1000, leader
    for node in (0, 1):
        step = _node_dir(root, node) / "step1"
        assert (step / MARKER_NAME).exists()
        index = json.loads((step / INDEX_NAME).read_text())
        files = {c["file"] for c in index["tensors"]["model.w"]["chunks"]}
        assert all((step / f).exists() for f in files), (node, files)


RELAYED = [0, 5, 1, 4, 2]  # rank 3 is left out; 5 listed ranks make a tree 3 deep


def _relay(rank: int, world: int, root: str) -> None:
    from shardpoint import dist as sp_dist

    log: list[tuple[str, int]] = []
    count_received(log)
    value = {"rows": list(range(100)), "from": "rank 0"} if rank == 0 else None
    if rank in RELAYED:
        value = sp_dist.relay_json(value, RELAYED)
    Path(root, f"relay{rank}.json").write_text(json.dumps([value, log]))


@pytest.mark.slow
def test_the_relay_reaches_every_listed_rank_once_and_no_other(tmp_path):
    run_ranks(6, _relay, str(tmp_path))
    expected = {"rows": list(range(100)), "from": "rank 0"}
    for rank in range(6):
        value, log = json.loads((tmp_path / f"relay{rank}.json").read_text())
        receives = [n for name, n in log if name == "recv"]
        if rank in RELAYED:
            assert value == expected, rank
            assert len(receives) == (0 if rank == 0 else 2), (rank, log)  # size, then bytes
        else:
            assert value is None and log == [], (rank, log)


def test_the_relay_tree_reaches_every_rank_once_within_ceil_log2_rounds():
    """Each position receives once, from a position that already has the value, and
    with every rank sending one message per round, in order, the last one has it after
    ceil(log2(n)) rounds (a tree that sent to its smallest subtree first would take up
    to m(m+1)/2)."""
    import math

    from shardpoint.dist import relay_tree

    for n in range(2, 130):
        has = {0: 0}  # position -> the round it had the value by
        for me in range(n):  # parents come before their children
            parent, children = relay_tree(me, n)
            assert (parent is None) == (me == 0)
            for k, child in enumerate(children, start=1):
                assert child not in has and relay_tree(child, n)[0] == me
                has[child] = has[me] + k
        assert sorted(has) == list(range(n)), n
        assert max(has.values()) == math.ceil(math.log2(n)), (n, has)


def _detect_directories(rank: int, world: int, root: str) -> None:
    from shardpoint.storage.local import LocalDirectory
    from shardpoint.training.node_layout import directory_per_node

    _as_node(rank)
    log: list[tuple[str, int]] = []
    count_received(log)
    own = directory_per_node(LocalDirectory(_node_dir(root, rank // RANKS_PER_NODE)))
    shared = directory_per_node(LocalDirectory(Path(root) / "shared"))
    Path(root, f"detect{rank}.json").write_text(json.dumps([own, shared, log]))


@pytest.mark.slow
def test_node_local_directories_are_told_from_a_shared_one_by_probes_alone(tmp_path):
    """Each node's first rank leaves a probe; only rank 0 receives every rank's facts
    (no all-gather), and no probe is left behind."""
    for d in ("node0", "node1", "shared"):
        (tmp_path / d).mkdir()
    run_ranks(WORLD, _detect_directories, str(tmp_path))
    for rank in range(WORLD):
        own, shared, log = json.loads((tmp_path / f"detect{rank}.json").read_text())
        assert (own, shared) == (True, False), rank
        assert "all_gather" not in [name for name, _ in log], (rank, log)
    for d in ("node0", "node1", "shared"):
        assert list((tmp_path / d).iterdir()) == [], d


def _grown(step: int) -> dict:
    shared = _shared()
    if step >= 2:  # every rank, at once: a new replicated tensor (an optimizer's moments)
        shared["extra"] = torch.arange(2048, dtype=torch.float32) * (step + 1)
    return {"shared": shared, "step": step}


def _background_per_node_saves(rank: int, world: int, root: str) -> None:
    from shardpoint import AsyncSaver

    node = _as_node(rank)
    saver = AsyncSaver(per_node=True)
    for step in range(4):
        state = _grown(step)
        handle = saver.save(state, str(_node_dir(root, node) / f"step{step}"))
        for t in state["shared"].values():  # training goes on: the save keeps the call's
            t.add_(1)
        handle.wait()
    saver.close()


@pytest.mark.slow
def test_a_background_per_node_save_whose_structure_changed_keeps_each_nodes_copy(tmp_path):
    """Background saves in per-node mode: at step 2 every rank gains a tensor, so the
    commit says *again*, each rank writes the rest of its node's copy from what it
    copied at the call, and each node's directory holds a whole, verified copy."""
    from shardpoint import open as open_checkpoint
    from shardpoint import verify

    run_ranks(WORLD, _background_per_node_saves, str(tmp_path))
    for node in (0, 1):
        for step in range(4):
            directory = _node_dir(str(tmp_path), node) / f"step{step}"
            assert verify(directory).ok, (node, step)
            with open_checkpoint(directory) as ckpt:
                for name, tensor in _grown(step)["shared"].items():
                    assert torch.equal(ckpt.get(f"shared.{name}"), tensor), (node, step, name)
