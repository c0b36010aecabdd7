"""Every kind of damage to every file of a multi-file checkpoint is caught and named,
and CheckpointManager.restore falls back to the previous valid checkpoint."""

from __future__ import annotations

import shutil

import pytest
import torch

import shardpoint
from shardpoint import CheckpointManager
from shardpoint.errors import CheckpointError, CorruptCheckpointError, IncompleteCheckpointError
from shardpoint.format.index import MARKER_NAME


def _state(step: int) -> dict:
    g = torch.Generator().manual_seed(step)
    return {f"t{i}": torch.randn(2000, generator=g) for i in range(4)} | {"step": step}


def _template() -> dict:
    return {f"t{i}": torch.zeros(2000) for i in range(4)} | {"step": 0}


def _flip(path):
    raw = bytearray(path.read_bytes())
    raw[len(raw) // 2] ^= 0x10
    path.write_bytes(raw)


def _truncate(path):
    path.write_bytes(path.read_bytes()[:-9])


def _delete(path):
    path.unlink()


DAMAGE = {"flip a byte": _flip, "truncate": _truncate, "delete": _delete}


@pytest.fixture
def two_checkpoints(tmp_path):
    manager = CheckpointManager(
        tmp_path / "ckpts",
        every_n_steps=1,
        keep_last=None,
        preemption_signals=(),
        max_shard_size=9_000,
    )
    manager.save(1, _state(1))
    manager.save(2, _state(2))
    files = sorted(p.name for p in manager.path_for(2).iterdir())
    assert len([f for f in files if f.endswith(".safetensors")]) >= 3
    return manager, files


def _damaged_files(manager):
    return sorted(p.name for p in manager.path_for(2).iterdir())


@pytest.mark.parametrize("damage", DAMAGE)
def test_damage_to_any_file_is_caught_everywhere(two_checkpoints, damage):
    manager, files = two_checkpoints
    for name in files:
        path = manager.path_for(2)
        backup = path.parent / "backup"
        shutil.copytree(path, backup)
        DAMAGE[damage](path / name)

        report = shardpoint.verify(path)
        assert not report.ok, (damage, name)
        with pytest.raises((CorruptCheckpointError, IncompleteCheckpointError)) as err:
            shardpoint.load(_template(), path)
        assert name in str(err.value) or "commit marker" in str(err.value), (name, str(err.value))
        state = _template()
        if damage == "delete" and name == MARKER_NAME:
            assert manager.restore(state) == 1  # uncommitted: not a checkpoint, no warning
        else:
            with pytest.warns(UserWarning, match="step 2 is not usable"):
                assert manager.restore(state) == 1
        assert state["step"] == 1 and torch.equal(state["t0"], _state(1)["t0"])

        shutil.rmtree(path)
        backup.rename(path)


def test_swapped_shards_and_an_older_index_are_caught(two_checkpoints):
    manager, files = two_checkpoints
    path = manager.path_for(2)
    shards = [f for f in files if f.endswith(".safetensors")]
    a, b = path / shards[0], path / shards[1]
    ra, rb = a.read_bytes(), b.read_bytes()
    a.write_bytes(rb)
    b.write_bytes(ra)
    assert not shardpoint.verify(path).ok
    with pytest.raises(CheckpointError):
        shardpoint.load(_template(), path)
    a.write_bytes(ra)
    b.write_bytes(rb)

    (path / "index.json").write_bytes((manager.path_for(1) / "index.json").read_bytes())
    with pytest.raises(CorruptCheckpointError, match="does not match the index that was committed"):
        shardpoint.load(_template(), path)
    with pytest.warns(UserWarning):
        assert manager.restore(_template()) == 1


def test_a_pickle_file_in_a_checkpoint_is_never_opened_and_an_index_naming_one_is_refused(
    two_checkpoints,
):
    manager, _ = two_checkpoints
    path = manager.path_for(2)
    (path / "extra.pkl").write_bytes(b"\x80\x04K\x01.")  # stray pickle: ignored, never read
    state = _template()
    shardpoint.load(state, path)
    assert state["step"] == 2
    import json

    from shardpoint.format.index import INDEX_NAME, marker_json

    doc = json.loads((path / INDEX_NAME).read_text())
    doc["files"]["model.pkl"] = {"size": 5}
    raw = json.dumps(doc).encode()
    (path / INDEX_NAME).write_bytes(raw)
    (path / MARKER_NAME).write_bytes(marker_json(raw))
    (path / "model.pkl").write_bytes(b"\x80\x04K\x01.")
    # listed but not a safetensors shard: its header cannot parse, so nothing is unpickled
    report = shardpoint.verify(path)
    assert not report.ok
