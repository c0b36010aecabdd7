"""Checkpoints on an S3-API object store: a real server (moto) on 127.0.0.1, started here.

Round trips through save/load/open/verify, multi-rank saves, ranged resharding reads,
the manager on a URL, faults injected by a proxy (500/503, dropped connections), and
the tiered manager (local + remote) including a SIGKILL during an upload.
"""

from __future__ import annotations

import os
import random
import signal
import uuid
from datetime import timedelta

import boto3
import obstore  # noqa: F401 - the backend under test: missing, these tests fail (never skip)
import pytest
import torch
from conftest import assert_states_equal, zeros_like_state
from s3_server import FaultProxy, start_moto

import shardpoint
from shardpoint import (
    CheckpointError,
    CheckpointManager,
    CorruptCheckpointError,
    IOOptions,
    RemoteTier,
    RetentionPolicy,
    SavePolicy,
)
from shardpoint.format.index import MARKER_NAME
from shardpoint.storage import open_storage

CREDENTIALS = {
    "AWS_ACCESS_KEY_ID": "testing",
    "AWS_SECRET_ACCESS_KEY": "testing",
    "AWS_REGION": "us-east-1",
}


@pytest.fixture(scope="session")
def moto_endpoint():
    server, endpoint = start_moto()
    yield endpoint
    server.stop()


@pytest.fixture
def s3(moto_endpoint, monkeypatch):
    """A fresh bucket; the standard AWS_* variables point every client at the server."""
    for k, v in {**CREDENTIALS, "AWS_ENDPOINT_URL": moto_endpoint}.items():
        monkeypatch.setenv(k, v)
    bucket = f"t{uuid.uuid4().hex[:16]}"
    client = boto3.client("s3")
    client.create_bucket(Bucket=bucket)
    return {"url": f"s3://{bucket}", "bucket": bucket, "client": client}


def _uploads_in_progress(s3) -> list:
    return s3["client"].list_multipart_uploads(Bucket=s3["bucket"]).get("Uploads", [])


def _state(seed: int = 0) -> dict:
    g = torch.Generator().manual_seed(seed)
    return {
        "big": torch.randn(5_000, 1_000, generator=g),  # 20 MB: a multipart upload
        "small": {str(i): torch.randn(33, generator=g) for i in range(20)},
        "half": torch.randn(7, 3, generator=g).half(),
        "step": seed,
    }


def test_save_load_open_verify_round_trip_on_s3(s3):
    url = f"{s3['url']}/run/step-1"
    state = _state(1)
    info = shardpoint.save(state, url)
    assert info.path == url and info.tensors == 22
    loaded = zeros_like_state(state)
    shardpoint.load(loaded, url)
    assert_states_equal(loaded, state)
    with shardpoint.open(url) as r:
        assert torch.equal(r.get_slice("big")[100:110], state["big"][100:110])
        assert r.metadata["world_size"] == 1
    assert shardpoint.verify(url).ok
    assert _uploads_in_progress(s3) == []
    with pytest.raises(shardpoint.CheckpointExistsError):
        shardpoint.save(state, url)


def test_corrupt_and_uncommitted_checkpoints_on_s3_are_typed_errors(s3):
    url = f"{s3['url']}/c"
    shardpoint.save(_state(2), url)
    key = "c/rank00000-00000.safetensors"
    body = bytearray(s3["client"].get_object(Bucket=s3["bucket"], Key=key)["Body"].read())
    body[-5] ^= 0xFF
    s3["client"].put_object(Bucket=s3["bucket"], Key=key, Body=bytes(body))
    report = shardpoint.verify(url)
    assert not report.ok and "checksum mismatch" in report.files[0].errors[0]
    with pytest.raises(CorruptCheckpointError, match=key.split("/")[1]):
        shardpoint.load(zeros_like_state(_state(2)), url)
    s3["client"].delete_object(Bucket=s3["bucket"], Key=f"c/{MARKER_NAME}")
    with pytest.raises(shardpoint.IncompleteCheckpointError, match="no commit marker"):
        shardpoint.load(zeros_like_state(_state(2)), url)
    with pytest.raises(shardpoint.IncompleteCheckpointError, match="no such checkpoint"):
        shardpoint.load(zeros_like_state(_state(2)), f"{s3['url']}/nothing-here")


def test_unknown_url_schemes_are_refused(tmp_path):
    with pytest.raises(CheckpointError, match="unsupported URL scheme"):
        shardpoint.save({"w": torch.ones(1)}, "ftp://host/x")
    shardpoint.save({"w": torch.ones(1)}, f"file://{tmp_path}/ckpt")
    assert shardpoint.verify(tmp_path / "ckpt").ok


# ---- many ranks, partial reads ------------------------------------------------------------


def _save_two_ranks(rank: int, world: int, url: str) -> None:
    from torch.distributed.tensor import Shard, distribute_tensor, init_device_mesh

    mesh = init_device_mesh("cpu", (world,))
    full = torch.arange(4000 * 500, dtype=torch.float32).reshape(4000, 500)
    state = {"w": distribute_tensor(full, mesh, [Shard(0)]), "shared": torch.ones(1000), "step": 3}
    shardpoint.save(state, url)


@pytest.mark.slow
def test_two_ranks_save_to_s3_and_a_partial_load_reads_only_its_rows(s3, monkeypatch):
    from distributed import run_ranks

    url = f"{s3['url']}/dist"
    run_ranks(2, _save_two_ranks, url)
    with shardpoint.open(url) as r:
        assert r.metadata["world_size"] == 2 and len(r.entry("w").chunks) == 2
    # Resharding 2 -> 1: one process loads both ranks' chunks from the store.
    whole = {"w": torch.zeros(4000, 500), "shared": torch.zeros(1000), "step": 0}
    shardpoint.load(whole, url)
    assert torch.equal(whole["w"], torch.arange(4000 * 500, dtype=torch.float32).reshape(4000, 500))
    assert torch.equal(whole["shared"], torch.ones(1000)) and whole["step"] == 3
    proxy = FaultProxy(os.environ["AWS_ENDPOINT_URL"])
    monkeypatch.setenv("AWS_ENDPOINT_URL", proxy.url)
    try:
        with shardpoint.open(url) as r:
            rows = r.get_slice("w", verify=False)[1000:1100]
        assert torch.equal(rows[:, 0], torch.arange(1000, 1100, dtype=torch.float32) * 500)
        needed = 100 * 500 * 4
        # Served: the rows, plus index, marker and the two shard headers.
        assert needed <= proxy.bytes_served <= needed + 64 * 1024, proxy.bytes_served
    finally:
        proxy.close()


# ---- faults -----------------------------------------------------------------------------------


FAULT_RATE = 0.25  # with 10 retries a request fails for good once in ~4 million
FAULTS_AT_LEAST = 3  # in the save, and again in the load, of every seed


def _state_in_many_objects(seed: int) -> dict:
    """``_state`` plus 16 tensors of 256 KiB: saved with ``max_shard_size=300_000`` it is
    ~20 objects (one a multipart upload), ~25 requests to save and ~90 to load."""
    g = torch.Generator().manual_seed(1000 + seed)
    pieces = {str(i): torch.randn(64 * 1024, generator=g) for i in range(16)}
    return {**_state(seed), "pieces": pieces}


@pytest.mark.slow
@pytest.mark.parametrize("seed", [1, 2, 3])
def test_saves_and_loads_survive_injected_500s_503s_and_dropped_connections(s3, monkeypatch, seed):
    proxy = FaultProxy(os.environ["AWS_ENDPOINT_URL"], fault_rate=FAULT_RATE, seed=seed)
    monkeypatch.setenv("AWS_ENDPOINT_URL", proxy.url)
    try:
        url = f"{s3['url']}/faulty-{seed}"
        state = _state_in_many_objects(seed)
        shardpoint.save(state, url, max_shard_size=300_000)  # must commit despite the faults
        in_save = proxy.faults
        loaded = zeros_like_state(state)
        shardpoint.load(loaded, url)  # retried reads; every checksum verified
        assert_states_equal(loaded, state)
        in_load = proxy.faults - in_save
        assert in_save >= FAULTS_AT_LEAST and in_load >= FAULTS_AT_LEAST, proxy.injected
        assert proxy.injected["dropped"] and proxy.injected["500"] + proxy.injected["503"]
    finally:
        proxy.close()
        monkeypatch.undo()
    assert _uploads_in_progress(s3) == []  # a failed multipart upload is aborted


# A store that stays down: give up after a few seconds instead of the default minutes.
FEW_RETRIES = {"retry_config": {"max_retries": 2, "retry_timeout": timedelta(seconds=5)}}


def test_a_save_that_cannot_reach_the_store_fails_without_committing(s3, monkeypatch):
    proxy = FaultProxy(os.environ["AWS_ENDPOINT_URL"], fault_rate=1.0)
    monkeypatch.setenv("AWS_ENDPOINT_URL", proxy.url)
    try:
        with pytest.raises(CheckpointError, match="cannot tell whether") as raised:
            shardpoint.save(_state(1), f"{s3['url']}/down", storage_options=FEW_RETRIES)
        # Not "a committed checkpoint already exists": an unreachable store is not one.
        assert not isinstance(raised.value, shardpoint.CheckpointExistsError)
    finally:
        proxy.close()
    monkeypatch.undo()
    listed = s3["client"].list_objects_v2(Bucket=s3["bucket"], Prefix="down/")
    assert "Contents" not in listed or all(
        not o["Key"].endswith(MARKER_NAME) for o in listed["Contents"]
    )


def test_a_load_from_an_unreachable_store_is_a_typed_error_and_changes_nothing(s3, monkeypatch):
    url = f"{s3['url']}/then-down"
    shardpoint.save(_state(1), url)
    proxy = FaultProxy(os.environ["AWS_ENDPOINT_URL"], fault_rate=1.0)
    monkeypatch.setenv("AWS_ENDPOINT_URL", proxy.url)
    live = zeros_like_state(_state(1))
    try:
        with pytest.raises(CorruptCheckpointError, match="cannot be read"):
            shardpoint.load(live, url, storage_options=FEW_RETRIES)
        assert not shardpoint.verify(url, storage_options=FEW_RETRIES).ok  # never raises
    finally:
        proxy.close()
        monkeypatch.undo()
    assert_states_equal(live, zeros_like_state(_state(1)))


# ---- the manager on a URL, and tiered --------------------------------------------------------


def test_a_tiered_manager_starts_and_restores_from_local_copies_while_the_remote_is_down(
    tmp_path, s3, monkeypatch
):
    manager = _tiered(tmp_path, s3)
    manager.save(1, _state(1))
    manager.close()
    proxy = FaultProxy(os.environ["AWS_ENDPOINT_URL"], fault_rate=1.0)
    monkeypatch.setenv("AWS_ENDPOINT_URL", proxy.url)
    try:
        down = CheckpointManager(
            tmp_path / "local",
            remote=RemoteTier(f"{s3['url']}/remote"),
            io=IOOptions(storage_options=FEW_RETRIES),
            preemption_signals=(),
        )
        restored = zeros_like_state(_state(0))
        with pytest.warns(UserWarning, match="remote tier not reachable"):
            assert down.restore(restored) == 1
        assert_states_equal(restored, _state(1))
        down.close()
    finally:
        proxy.close()


def test_manager_on_an_s3_url_saves_lists_retains_and_restores(s3):
    url = f"{s3['url']}/mgr"
    manager = CheckpointManager(
        url,
        policy=SavePolicy(every_n_steps=1),
        retention=RetentionPolicy(keep_last=2),
        preemption_signals=(),
    )
    for step in (1, 2, 3):
        manager.save(step, _state(step))
    assert manager.steps() == [2, 3]
    assert [e["event"] for e in manager.events.read()].count("save") == 3
    manager.close()
    restored = zeros_like_state(_state(0))
    assert CheckpointManager(url, preemption_signals=()).restore(restored) == 3
    assert_states_equal(restored, _state(3))


def _tiered(tmp_path, s3, **kwargs) -> CheckpointManager:
    return CheckpointManager(
        tmp_path / "local",
        policy=SavePolicy(every_n_steps=1),
        retention=RetentionPolicy(keep_last=1),
        remote=RemoteTier(f"{s3['url']}/remote", RetentionPolicy(keep_last=2)),
        preemption_signals=(),
        **kwargs,
    )


@pytest.mark.parametrize("async_save", [False, True])
def test_tiered_manager_uploads_in_the_background_with_its_own_retention(tmp_path, s3, async_save):
    manager = _tiered(tmp_path, s3, async_save=async_save)
    for step in (1, 2, 3):
        manager.save(step, _state(step))
        manager.wait()
        manager.wait_for_uploads()
    manager.close()
    assert manager.steps() == [3]  # keep 1 locally
    assert manager.remote_steps() == [2, 3]  # keep 2 remotely
    uploads = [e for e in manager.events.read() if e["event"] == "upload"]
    assert [e["step"] for e in uploads] == [1, 2, 3]
    assert all(e["bytes"] > 20e6 and e["lag_seconds"] >= e["seconds"] for e in uploads)


def test_incremental_uploads_send_only_what_the_remote_lacks_and_keep_what_it_refers_to(
    tmp_path, s3
):
    manager = _tiered(tmp_path, s3, incremental=True)
    state = _state(0)  # "big" (20 MB) never changes; "small" does
    for step in (1, 2, 3, 4):
        for t in state["small"].values():
            t.add_(1.0)
        state["step"] = step
        manager.save(step, state)
        manager.wait_for_uploads()
    uploads = {e["step"]: e["bytes"] for e in manager.events.read() if e["event"] == "upload"}
    assert uploads[1] > 20e6 and all(uploads[s] < 100_000 for s in (2, 3, 4)), uploads
    assert manager.remote_steps() == [3, 4]
    remote = f"{s3['url']}/remote"
    keys = [o["Key"] for o in s3["client"].list_objects_v2(Bucket=s3["bucket"])["Contents"]]
    # Remote step 1 is deleted as a checkpoint; the big tensor's file, which 3 and 4
    # read, stays under a PRUNED note.
    assert sorted(k for k in keys if "step-000000001" in k) == [
        "remote/step-000000001/PRUNED",
        "remote/step-000000001/rank00000-00000.safetensors",
    ]
    assert not any("step-000000002" in k for k in keys)
    restored = _state(7)
    shardpoint.load(restored, f"{remote}/step-000000004")
    assert torch.equal(restored["big"], state["big"]) and restored["step"] == 4
    assert all(torch.equal(restored["small"][k], v) for k, v in state["small"].items())
    assert shardpoint.verify(f"{remote}/step-000000004").ok
    manager.close()


def test_an_upload_brings_the_referenced_files_the_remote_lacks(tmp_path, s3):
    """Steps 1 and 2 were saved before the job had a remote tier: uploading step 2
    uploads the file of step 1 it refers to, under a PRUNED note (step 1 itself is not
    a remote checkpoint)."""
    local = CheckpointManager(tmp_path / "local", incremental=True, preemption_signals=())
    state = _state(0)
    for step in (1, 2):
        state["small"]["0"].add_(1.0)
        local.save(step, state, force=True)
    local.close()
    manager = _tiered(tmp_path, s3)  # uploads the newest local checkpoint at start
    manager.wait_for_uploads()
    assert manager.remote_steps() == [2]
    remote = f"{s3['url']}/remote"
    keys = [o["Key"] for o in s3["client"].list_objects_v2(Bucket=s3["bucket"])["Contents"]]
    assert sorted(k for k in keys if "step-000000001" in k) == [
        "remote/step-000000001/PRUNED",
        "remote/step-000000001/rank00000-00000.safetensors",
    ]
    restored = _state(7)
    shardpoint.load(restored, f"{remote}/step-000000002")
    assert torch.equal(restored["big"], state["big"])
    assert torch.equal(restored["small"]["0"], state["small"]["0"])
    manager.close()


def _dtype_state() -> dict:
    g = torch.Generator().manual_seed(3)
    return {
        "fp32": torch.randn(1_500, 1_000, generator=g),  # 6 MB: two compressed blocks
        "bf16": torch.randn(700, 1_000, generator=g).bfloat16(),
        "fp16": torch.randn(33, 17, generator=g).half(),
        "int64": torch.arange(100_000, dtype=torch.int64),
        "uint8": torch.zeros(5_000_000, dtype=torch.uint8),  # compresses to almost nothing
        "bool": torch.rand(999, generator=g) > 0.5,
        "empty": torch.empty(0, 4),
        "step": 1,
    }


def test_a_compressed_remote_copy_round_trips_every_dtype_and_reads_partially(tmp_path, s3):
    manager = CheckpointManager(
        tmp_path / "local",
        remote=RemoteTier(f"{s3['url']}/remote", compress=True),
        preemption_signals=(),
    )
    state = _dtype_state()
    manager.save(1, state, force=True)
    manager.wait_for_uploads()
    manager.close()
    remote = f"{s3['url']}/remote/step-000000001"
    objects = {
        o["Key"].rsplit("/", 1)[1]: o["Size"]
        for o in s3["client"].list_objects_v2(Bucket=s3["bucket"])["Contents"]
    }
    local = tmp_path / "local" / "step-000000001" / "rank00000-00000.safetensors"
    assert "rank00000-00000.safetensors" not in objects  # only the compressed copy
    assert objects["rank00000-00000.safetensors.zst"] < 0.75 * local.stat().st_size
    loaded = _dtype_state()
    for t in loaded.values():
        if torch.is_tensor(t):
            t.zero_()
    shardpoint.load(loaded, remote)
    for k, v in state.items():
        assert torch.equal(loaded[k], v) if torch.is_tensor(v) else loaded[k] == v, k
    assert shardpoint.verify(remote).ok
    with shardpoint.open(remote) as reader:  # rows in the middle of the second block
        assert torch.equal(
            reader.get_slice("fp32")[1_100:1_103, 5:9], state["fp32"][1_100:1_103, 5:9]
        )
    # Any byte range of the file, as the storage layer serves it to every reader.
    storage = open_storage(remote)
    raw = local.read_bytes()
    rng = random.Random(0)
    for lo in [
        0,
        1,
        4 * 1024 * 1024 - 1,
        len(raw) - 1,
        *(rng.randrange(len(raw)) for _ in range(20)),
    ]:
        hi = min(len(raw), lo + rng.choice([1, 7, 4096, 5_000_000]))
        assert storage.read_range("rank00000-00000.safetensors", lo, hi) == raw[lo:hi]
    assert storage.size("rank00000-00000.safetensors") == len(raw)
    for small in (b"", b"x" * 1000):  # one frame: one PUT
        storage.write_compressed(
            "rank00009-00000.safetensors", iter([memoryview(small)]), len(small)
        )
        assert storage.read_range("rank00009-00000.safetensors", 0, len(small)) == small
        assert storage.size("rank00009-00000.safetensors") == len(small)


def test_a_damaged_compressed_copy_is_a_typed_error_naming_it(tmp_path, s3):
    manager = CheckpointManager(
        tmp_path / "local",
        remote=RemoteTier(f"{s3['url']}/remote", compress=True),
        preemption_signals=(),
    )
    manager.save(1, _dtype_state(), force=True)
    manager.wait_for_uploads()
    manager.close()
    key = "remote/step-000000001/rank00000-00000.safetensors.zst"
    data = bytearray(s3["client"].get_object(Bucket=s3["bucket"], Key=key)["Body"].read())
    data[1000] ^= 0xFF  # inside the first frame
    s3["client"].put_object(Bucket=s3["bucket"], Key=key, Body=bytes(data))
    remote = f"{s3['url']}/remote/step-000000001"
    with pytest.raises(CorruptCheckpointError, match="rank00000-00000.safetensors"):
        shardpoint.load(_dtype_state(), remote)
    assert not shardpoint.verify(remote).ok
    s3["client"].put_object(Bucket=s3["bucket"], Key=key, Body=bytes(data[:-3]))  # footer cut
    with pytest.raises(CorruptCheckpointError, match="compressed"):
        shardpoint.load(_dtype_state(), remote)


def test_an_upload_never_writes_into_a_remote_step_of_another_run(tmp_path, s3):
    """The remote holds step 1 of another run (same names and sizes); step 2 of this
    run refers to its own step 1: the upload fails saying so, and the remote's step 1
    stays as it was."""
    remote = f"{s3['url']}/remote"
    other = CheckpointManager(tmp_path / "other", remote=RemoteTier(remote), preemption_signals=())
    other.save(1, _state(5), force=True)
    other.close()
    mine = CheckpointManager(tmp_path / "mine", incremental=True, preemption_signals=())
    state = _state(6)
    mine.save(1, state, force=True)
    state["small"]["0"].add_(1.0)
    mine.save(2, state, force=True)
    mine.close()
    before = shardpoint.open(f"{remote}/step-000000001").get("big").clone()
    tiered = CheckpointManager(tmp_path / "mine", remote=RemoteTier(remote), preemption_signals=())
    with pytest.warns(UserWarning, match="another checkpoint than the local step-000000001"):
        tiered.wait_for_uploads()
    tiered.close()
    assert tiered.remote_steps() == [1]
    assert torch.equal(shardpoint.open(f"{remote}/step-000000001").get("big"), before)


def test_codec_refuses_a_frame_whose_header_claims_another_size():
    from shardpoint.format import compressed

    good = b"".join(compressed.compress(iter([memoryview(b"a" * 1000)]), 1000))
    table = compressed.parse_table(good, len(good), "f", lambda lo, hi: good[lo:hi])
    bomb = compressed._zstd().ZstdCompressor().compress(b"\0" * 10_000_000)
    with pytest.raises(CorruptCheckpointError, match="another size"):
        compressed.decompress(table, 0, bomb, 0, 1000, "f")
    with pytest.raises(CorruptCheckpointError, match="impossible length"):
        compressed.parse_table(
            good[:-16] + (10**12).to_bytes(8, "little") + good[-8:], len(good), "f", None
        )


def test_compression_is_refused_for_a_remote_that_is_not_an_object_store(tmp_path):
    with pytest.raises(ValueError, match="object-store URL"):
        CheckpointManager(tmp_path / "a", remote=RemoteTier(str(tmp_path / "b"), compress=True))


def test_a_replaced_node_restores_from_the_remote_tier(tmp_path, s3):
    manager = _tiered(tmp_path, s3)
    manager.save(1, _state(1))
    manager.close()
    import shutil

    shutil.rmtree(tmp_path / "local")  # a new machine: empty local disk
    restored = zeros_like_state(_state(0))
    fresh = _tiered(tmp_path, s3)
    assert fresh.restore(restored) == 1
    assert_states_equal(restored, _state(1))
    fresh.close()


def test_a_corrupt_local_copy_falls_back_to_the_remote_copy_of_the_same_step(tmp_path, s3):
    manager = _tiered(tmp_path, s3)
    manager.save(1, _state(1))
    manager.close()
    (shard,) = (tmp_path / "local" / "step-000000001").glob("*.safetensors")
    raw = bytearray(shard.read_bytes())
    raw[-3] ^= 0xFF
    shard.write_bytes(raw)
    restored = zeros_like_state(_state(0))
    fresh = _tiered(tmp_path, s3)
    with pytest.warns(UserWarning, match="not usable"):
        assert fresh.restore(restored) == 1
    assert_states_equal(restored, _state(1))
    fallback = [e for e in fresh.events.read() if e["event"] == "fallback"]
    assert fallback and "local" in fallback[-1]["path"]
    fresh.close()


def _upload_then_die(local: str, remote: str, env: dict, kill_after_puts: int) -> None:
    os.environ.update(env)
    import shardpoint.storage.object_store as store

    manager = CheckpointManager(
        local,
        policy=SavePolicy(every_n_steps=1),
        remote=RemoteTier(remote),
        io=IOOptions(max_shard_size=4000),
        preemption_signals=(),
    )
    real_close = store._ObjectWriter.close
    count = [0]

    def close(self):  # noqa: ANN001, ANN202
        real_close(self)  # this object is complete on the store
        count[0] += 1
        if count[0] >= kill_after_puts:
            os.kill(os.getpid(), signal.SIGKILL)

    store._ObjectWriter.close = close
    manager.save(1, {"a": torch.ones(1000), "b": torch.zeros(10)}, force=True)
    manager.wait_for_uploads()
    os._exit(0)


def test_sigkill_during_an_upload_never_shows_a_partial_remote_checkpoint(tmp_path, s3):
    local, remote = str(tmp_path / "local"), f"{s3['url']}/remote"
    env = {k: os.environ[k] for k in (*CREDENTIALS, "AWS_ENDPOINT_URL")}
    # A fresh interpreter, not fork: the object-store client's runtime threads do not
    # survive a fork.
    import multiprocessing

    child = multiprocessing.get_context("spawn").Process(
        target=_upload_then_die, args=(local, remote, env, 1)
    )
    child.start()
    child.join(timeout=120)
    assert child.exitcode == -signal.SIGKILL, child.exitcode
    from shardpoint.training.tiers import CheckpointTier

    remote_tier = CheckpointTier(remote, None)
    assert remote_tier.step_dirs() == [1]  # one shard file made it up...
    assert remote_tier.steps() == []  # ...but nothing is visible as a checkpoint
    restarted = CheckpointManager(local, remote=RemoteTier(remote), preemption_signals=())
    assert restarted.steps() == [1]  # the local commit happened before the upload
    restarted.wait_for_uploads()  # the interrupted upload starts again at start-up
    assert restarted.remote_steps() == [1]
    restored = {"a": torch.zeros(1000), "b": torch.ones(10)}
    shardpoint.load(restored, f"{remote}/step-000000001")
    assert torch.equal(restored["a"], torch.ones(1000))
    restarted.close()


def test_the_command_line_accepts_object_store_urls(s3, capsys):
    import json

    from shardpoint.cli import main

    url = f"{s3['url']}/cli"
    manager = CheckpointManager(url, policy=SavePolicy(every_n_steps=1), preemption_signals=())
    for step in (1, 2):
        manager.save(step, {"w": torch.full((3,), float(step)), "step": step})
    manager.close()
    assert main(["ls", url, "--json"]) == 0
    rows = json.loads(capsys.readouterr().out)
    assert [(r["step"], r["status"]) for r in rows] == [(1, "valid"), (2, "valid")]
    assert main(["verify", url]) == 0
    assert main(["inspect", f"{url}/step-000000002"]) == 0
    assert "step = 2" in capsys.readouterr().out
    assert main(["diff", f"{url}/step-000000001", f"{url}/step-000000002"]) == 1
