"""Background saves to an object store (moto on 127.0.0.1): ``async_save`` and
``AsyncSaver`` to ``s3://`` URLs, ``CheckpointManager(s3_url, async_save=True)``, a
failed upload and a process killed while a background save is uploading.

The training thread only stages bytes; writer threads hand 16 MiB slots to the
multipart writer (``_ObjectWriter``); the commit writes index.json, then COMMITTED.
"""

from __future__ import annotations

import multiprocessing
import os
import signal
import threading
import time

import pytest
import test_object_store
import torch
from conftest import assert_states_equal, zeros_like_state
from test_object_store import CREDENTIALS, _uploads_in_progress

import shardpoint
from shardpoint import (
    AsyncSaver,
    CheckpointError,
    CheckpointManager,
    RetentionPolicy,
    SavePolicy,
)
from shardpoint.format.index import INDEX_NAME, MARKER_NAME
from shardpoint.storage.object_store import PART_BYTES
from shardpoint.training.tiers import CheckpointTier

# The moto server and a fresh bucket per test (fixtures of test_object_store).
moto_endpoint = test_object_store.moto_endpoint
s3 = test_object_store.s3

STEP_1 = "step-000000001"  # the manager's name for step 1 (names.step_dir)


def _state(seed: int) -> dict:
    """~20 MB in one tensor (one shard object larger than a 16 MiB part: a multipart
    upload, two staging slots) plus small tensors of several dtypes and a plain value."""
    g = torch.Generator().manual_seed(seed)
    return {
        "big": torch.randn(5_000, 1_000, generator=g),
        "small": {str(i): torch.randn(33, generator=g) for i in range(8)},
        "ints": torch.randint(-1000, 1000, (17,), generator=g, dtype=torch.int64),
        "half": torch.randn(7, 3, generator=g).half(),
        "step": seed,
    }


def _clone(state: dict) -> dict:
    return {
        k: _clone(v) if isinstance(v, dict) else v.clone() if isinstance(v, torch.Tensor) else v
        for k, v in state.items()
    }


def _mutate(state: dict) -> None:
    """What a training step does right after the save call returns."""
    state["big"].add_(1.0)
    for t in state["small"].values():
        t.mul_(-2.0)
    state["ints"].fill_(7)
    state["half"].zero_()
    state["step"] = -1


def _keys(s3, prefix: str) -> list[str]:
    listed = s3["client"].list_objects_v2(Bucket=s3["bucket"], Prefix=prefix)
    return sorted(o["Key"] for o in listed.get("Contents", []))


def _load(url: str, like: dict) -> dict:
    loaded = zeros_like_state(like)
    shardpoint.load(loaded, url)
    return loaded


# ---- 1. round trip -----------------------------------------------------------------------


def test_async_save_to_s3_writes_the_values_at_the_call_in_a_multipart_upload(s3):
    url = f"{s3['url']}/run/step-1"
    state = _state(1)
    expected = _clone(state)
    handle = shardpoint.async_save(state, url)
    _mutate(state)  # the live tensors change at once: the checkpoint must not
    info = handle.wait()
    assert isinstance(handle.stall_seconds, float)
    assert 0 < handle.stall_seconds <= info.seconds
    assert info.blocked_seconds == handle.stall_seconds
    assert info.path == url and info.tensors == 11 and info.files == 1
    assert_states_equal(_load(url, expected), expected)
    assert not torch.equal(state["big"], expected["big"])  # the mutation really happened
    assert shardpoint.verify(url).ok
    assert _uploads_in_progress(s3) == []
    # The shard went up as a multipart upload (S3's ETag of one ends in -<parts>), and
    # the marker is there, after the index.
    shard = "run/step-1/rank00000-00000.safetensors"
    head = s3["client"].head_object(Bucket=s3["bucket"], Key=shard)
    assert head["ContentLength"] > PART_BYTES
    assert head["ETag"].strip('"').endswith("-2"), head["ETag"]
    assert _keys(s3, "run/step-1/") == sorted(
        [shard, f"run/step-1/{INDEX_NAME}", f"run/step-1/{MARKER_NAME}"]
    )


# ---- 2. a failed upload --------------------------------------------------------------------


def test_a_failed_part_write_surfaces_on_wait_and_commits_nothing(s3):
    import shardpoint.storage.object_store as store

    earlier_url = f"{s3['url']}/earlier"
    shardpoint.save(_state(0), earlier_url)  # must survive the failure below untouched

    real_write = store._ObjectWriter.write
    calls = [0]
    lock = threading.Lock()
    seen_in_progress: list[list] = []

    def write(self, offset, data):  # noqa: ANN001, ANN202
        with lock:
            calls[0] += 1
            n = calls[0]
        if n == 2:
            # Hand this piece on first: the multipart upload is then under way (more
            # than one part's bytes were written), so the abort has something to abort.
            real_write(self, offset, data)
            deadline = time.monotonic() + 10
            while not seen_in_progress and time.monotonic() < deadline:
                uploads = _uploads_in_progress(s3)
                if uploads:
                    seen_in_progress.append(uploads)
                time.sleep(0.05)
            raise OSError("injected: the network went away")
        return real_write(self, offset, data)

    saver = AsyncSaver()
    url = f"{s3['url']}/failing"
    with pytest.MonkeyPatch.context() as patch:  # not the s3 fixture's: it holds the env
        patch.setattr(store._ObjectWriter, "write", write)
        handle = saver.save(_state(2), url)
        assert handle is not None
        with pytest.raises(CheckpointError, match="injected: the network went away") as caught:
            handle.wait()
    assert "rank00000-00000.safetensors" in str(caught.value)
    assert calls[0] >= 2
    assert seen_in_progress, "the multipart upload never started: the abort was not tested"
    assert not any(k.endswith(MARKER_NAME) for k in _keys(s3, "failing/"))
    assert _keys(s3, "failing/") == []  # nothing left: the shard was aborted, no index
    assert _uploads_in_progress(s3) == []  # the multipart upload was aborted
    assert shardpoint.verify(earlier_url).ok
    assert_states_equal(_load(earlier_url, _state(0)), _state(0))

    # The saver stays usable: the error was seen on wait(), the next save commits.
    assert store._ObjectWriter.write is real_write
    again = saver.save(_state(3), f"{s3['url']}/after")
    assert again is not None
    again.wait()
    saver.close()
    assert_states_equal(_load(f"{s3['url']}/after", _state(3)), _state(3))
    assert shardpoint.verify(f"{s3['url']}/after").ok
    # And the failed path itself can be saved to now.
    saver.save(_state(2), url).wait()
    assert_states_equal(_load(url, _state(2)), _state(2))
    assert _uploads_in_progress(s3) == []


# ---- 3. the manager on a URL, in the background --------------------------------------------


def test_manager_async_saves_to_s3_retain_and_restore_the_newest(s3):
    url = f"{s3['url']}/mgr"
    manager = CheckpointManager(
        url,
        policy=SavePolicy(every_n_steps=1),
        retention=RetentionPolicy(keep_last=2),
        async_save=True,
        preemption_signals=(),
    )
    for step in (1, 2, 3):
        state = _state(step)
        handle = manager.save(step, state)
        assert isinstance(handle, shardpoint.AsyncSave)
        _mutate(state)  # after staging: what is written is the state at the call
    manager.close()
    assert manager.steps() == [2, 3]
    assert _keys(s3, f"mgr/{STEP_1}/") == []  # step 1 deleted, every object of it
    events = manager.events.read()
    assert [e["step"] for e in events if e["event"] == "save"] == [1, 2, 3]
    assert [e["step"] for e in events if e["event"] == "delete"] == [1]
    restored = zeros_like_state(_state(0))
    fresh = CheckpointManager(url, preemption_signals=())
    assert fresh.restore(restored) == 3
    assert_states_equal(restored, _state(3))
    fresh.close()
    assert shardpoint.verify(f"{url}/step-000000002").ok
    assert _uploads_in_progress(s3) == []


# ---- 4. SIGKILL while a background save is uploading ----------------------------------------


def _async_save_then_die(url: str, env: dict) -> None:
    """In a fresh process: an async save to ``url`` killed by SIGKILL right after its
    first object (the shard) is complete on the store, before the index and marker."""
    os.environ.update(env)
    import shardpoint.storage.object_store as store

    real_close = store._ObjectWriter.close

    def close(self):  # noqa: ANN001, ANN202
        real_close(self)  # this object is complete on the store
        os.kill(os.getpid(), signal.SIGKILL)

    store._ObjectWriter.close = close
    handle = shardpoint.async_save(_state(4), url)
    handle.wait()
    os._exit(0)  # never reached: the kill comes first


@pytest.mark.slow
def test_sigkill_during_a_background_upload_never_commits_and_the_path_is_reusable(s3):
    parent = f"{s3['url']}/killed"
    url = f"{parent}/{STEP_1}"
    env = {k: os.environ[k] for k in (*CREDENTIALS, "AWS_ENDPOINT_URL")}
    # A fresh interpreter, not fork: the object-store client's threads do not survive one.
    child = multiprocessing.get_context("spawn").Process(
        target=_async_save_then_die, args=(url, env)
    )
    child.start()
    child.join(timeout=180)
    if child.exitcode is None:
        child.kill()
        child.join()
    assert child.exitcode == -signal.SIGKILL, child.exitcode
    keys = _keys(s3, f"killed/{STEP_1}/")
    assert keys == [f"killed/{STEP_1}/rank00000-00000.safetensors"]  # the shard made it up...
    tier = CheckpointTier(parent, None)
    assert tier.step_dirs() == [1]
    assert tier.steps() == []  # ...but no checkpoint is visible
    with pytest.raises(shardpoint.IncompleteCheckpointError):
        shardpoint.load(zeros_like_state(_state(4)), url)
    # A later save to the same path clears the leftover and commits.
    state = _state(5)
    shardpoint.async_save(state, url).wait()
    assert tier.steps() == [1]
    assert_states_equal(_load(url, _state(5)), _state(5))
    assert shardpoint.verify(url).ok
    assert _uploads_in_progress(s3) == []
