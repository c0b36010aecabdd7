"""Every kind of damage to every file of a multi-file checkpoint is caught and named,
and CheckpointManager.restore falls back to the previous valid checkpoint."""

from __future__ import annotations

import re
import shutil
import warnings
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import pytest
import torch

import shardpoint
from shardpoint import CheckpointManager, IOOptions, RetentionPolicy, SavePolicy
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
        policy=SavePolicy(every_n_steps=1),
        retention=RetentionPolicy(keep_last=None),
        io=IOOptions(max_shard_size=9_000),
        preemption_signals=(),
    )
    manager.save(1, _state(1))
    manager.save(2, _state(2))
    files = sorted(p.name for p in manager.path_for(2).iterdir())
    assert len([f for f in files if f.endswith(".safetensors")]) >= 3
    return manager, files


@contextmanager
def _damaged(manager: CheckpointManager, name: str, damage: str) -> Iterator[Path]:
    """Step 2's checkpoint with ``name`` damaged, put back as it was afterwards."""
    path = manager.path_for(2)
    backup = path.parent / "backup"
    shutil.copytree(path, backup)
    DAMAGE[damage](path / name)
    try:
        yield path
    finally:
        shutil.rmtree(path)
        backup.rename(path)


def _assert_same_state(got: dict, want: dict) -> None:
    assert got.keys() == want.keys()
    for key, value in want.items():
        if isinstance(value, torch.Tensor):
            assert got[key].dtype == value.dtype and torch.equal(got[key], value), key
        else:
            assert got[key] == value, key


@pytest.mark.parametrize("damage", DAMAGE)
def test_verify_reports_damage_to_any_file_and_names_it(two_checkpoints, damage):
    manager, files = two_checkpoints
    for name in files:
        with _damaged(manager, name, damage) as path:
            report = shardpoint.verify(path)
            problems = report.errors + [e for f in report.files for e in f.errors]
            assert not report.ok, (damage, name)
            assert any(name in p for p in problems), (damage, name, problems)


@pytest.mark.parametrize("damage", DAMAGE)
def test_loading_a_damaged_file_raises_a_typed_error_naming_the_checkpoint_and_file(
    two_checkpoints, damage
):
    manager, files = two_checkpoints
    for name in files:
        with _damaged(manager, name, damage) as path:
            with pytest.raises((CorruptCheckpointError, IncompleteCheckpointError)) as err:
                shardpoint.load(_template(), path)
            message = str(err.value)
            assert str(path) in message and name in message, (damage, name, message)


@pytest.mark.parametrize("damage", DAMAGE)
def test_restore_falls_back_to_every_value_of_the_previous_checkpoint(two_checkpoints, damage):
    manager, files = two_checkpoints
    for name in files:
        with _damaged(manager, name, damage):
            state = _template()
            if damage == "delete" and name == MARKER_NAME:
                with warnings.catch_warnings():  # uncommitted: not a checkpoint, no warning
                    warnings.simplefilter("error")
                    assert manager.restore(state) == 1
            else:
                with pytest.warns(UserWarning, match=f"step 2 is not usable .*{re.escape(name)}"):
                    assert manager.restore(state) == 1
            _assert_same_state(state, _state(1))


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

    from shardpoint.format.index import INDEX_NAME
    from shardpoint.format.marker import marker_json

    doc = json.loads((path / INDEX_NAME).read_text())
    doc["files"]["model.pkl"] = {"size": 5}
    raw = json.dumps(doc).encode()
    (path / INDEX_NAME).write_bytes(raw)
    (path / MARKER_NAME).write_bytes(marker_json(raw))
    (path / "model.pkl").write_bytes(b"\x80\x04K\x01.")
    # listed but not a safetensors shard: its header cannot parse, so nothing is unpickled
    report = shardpoint.verify(path)
    assert not report.ok
