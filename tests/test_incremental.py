"""Incremental saves (incremental.py, format version 3): unchanged chunks are referred
to, never written twice; references are followed by every reader; deletion keeps what
is referred to; a damaged referenced file makes every checkpoint that reads it invalid."""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path

import pytest
import torch

import shardpoint
from shardpoint import (
    CheckpointError,
    CheckpointManager,
    CorruptCheckpointError,
    IncrementalChain,
    RetentionPolicy,
)
from shardpoint.checkpoint_copy import copy_checkpoint
from shardpoint.cli import main as cli
from shardpoint.commit import Commit
from shardpoint.names import PRUNED_NAME
from shardpoint.storage.local import LocalDirectory
from tests.conftest import rewrite_index
from tests.distributed import run_ranks

FROZEN_ROWS = 256  # 256 x 1024 fp32: 1 MiB that never changes


def _lora_state() -> dict:
    g = torch.Generator().manual_seed(0)
    return {
        "base": torch.randn(FROZEN_ROWS, 1024, generator=g),  # frozen
        "embed": torch.randn(64, 1024, generator=g),  # frozen
        "adapter": torch.zeros(8, 1024),  # trained
        "step": 0,
    }


def _train(state: dict, step: int) -> None:
    state["adapter"].add_(float(step))  # in place: the version counter moves
    state["step"] = step


def _load(path: Path | str) -> dict:
    out = {
        "base": torch.zeros(FROZEN_ROWS, 1024),
        "embed": torch.zeros(64, 1024),
        "adapter": torch.zeros(8, 1024),
        "step": -1,
    }
    shardpoint.load(out, path)
    return out


def _index(path: Path) -> dict:
    return json.loads((path / "index.json").read_bytes())


def _manager(root: Path, keep_last: int | None = None, **kw) -> CheckpointManager:
    return CheckpointManager(
        root,
        retention=RetentionPolicy(keep_last=keep_last),
        incremental=True,
        preemption_signals=(),
        **kw,
    )


def test_three_generations_write_only_the_changed_bytes_and_load_bit_identical(tmp_path):
    manager = _manager(tmp_path)
    state, saved = _lora_state(), {}
    written = []
    for step in (1, 2, 3):
        _train(state, step)
        written.append(manager.save(step, state, force=True).bytes_written)
        saved[step] = {k: v.clone() if torch.is_tensor(v) else v for k, v in state.items()}
    adapter = state["adapter"].numel() * 4
    frozen = (FROZEN_ROWS + 64) * 1024 * 4
    assert written[0] > frozen
    # Later saves: the adapter, a header, the index's share; not the frozen 1.25 MiB.
    assert all(adapter <= w < adapter + 4096 for w in written[1:]), written
    third = _index(manager.path_for(3))
    assert third["format_version"] == 3
    # References point at the file holding the bytes (step 1), never at step 2's index.
    assert sorted(third["files"]) == [
        "../step-000000001/rank00000-00000.safetensors",
        "rank00000-00000.safetensors",
    ]
    for step in (1, 2, 3):
        loaded = _load(manager.path_for(step))
        for k, v in saved[step].items():
            assert torch.equal(loaded[k], v) if torch.is_tensor(v) else loaded[k] == v, (step, k)
        assert shardpoint.verify(manager.path_for(step)).ok


def test_bytes_changed_behind_the_version_counter_are_written_not_referred_to(tmp_path):
    """The version counter alone is never trusted: a write through numpy does not move
    it, and the content hash catches the change."""
    manager = _manager(tmp_path)
    state = _lora_state()
    manager.save(1, state, force=True)
    version = state["base"]._version
    state["base"].numpy()[17, 3] += 1.0  # torch does not see this write
    assert state["base"]._version == version
    info = manager.save(2, state, force=True)
    assert info.bytes_written > FROZEN_ROWS * 1024 * 4
    assert torch.equal(_load(manager.path_for(2))["base"], state["base"])


def test_an_async_incremental_save_refers_to_unchanged_chunks(tmp_path):
    manager = _manager(tmp_path, async_save=True)
    state = _lora_state()
    for step in (1, 2):
        _train(state, step)
        manager.save(step, state, force=True)
        manager.wait()
    expected = {k: v.clone() for k, v in state.items() if torch.is_tensor(v)}
    _train(state, 3)
    manager.save(3, state, force=True)
    state["adapter"].fill_(float("nan"))  # training moves on while the save is written
    manager.wait()
    assert any(n.startswith("../step-000000001/") for n in _index(manager.path_for(2))["files"])
    loaded = _load(manager.path_for(2))
    assert all(torch.equal(loaded[k], v) for k, v in expected.items())
    assert _load(manager.path_for(3))["adapter"][0, 0].item() == 6.0
    manager.close()


def test_retention_keeps_referenced_files_marked_pruned_then_deletes_them(tmp_path):
    manager = _manager(tmp_path, keep_last=1)
    state = _lora_state()
    for step in (1, 2, 3):
        _train(state, step)
        manager.save(step, state, force=True)
    first = manager.path_for(1)
    assert manager.steps() == [3]
    # Step 1 is deleted as a checkpoint; the file step 3 reads stays, with a note.
    assert sorted(os.listdir(first)) == [PRUNED_NAME, "rank00000-00000.safetensors"]
    assert not (manager.path_for(2)).exists()
    assert _load(manager.path_for(3))["step"] == 3
    # A save into the pruned directory would clear the file: refused.
    with pytest.raises(CheckpointError, match="later .incremental. checkpoints still read"):
        shardpoint.save(state, first)
    # Once nothing refers to it (the frozen tensors change), it goes.
    state["base"].add_(1.0)
    state["embed"].add_(1.0)
    _train(state, 4)
    manager.save(4, state, force=True)
    assert manager.steps() == [4] and not first.exists()
    assert not manager.path_for(3).exists()


def test_a_restarted_manager_keeps_pruned_files_still_referred_to(tmp_path):
    manager = _manager(tmp_path, keep_last=1)
    state = _lora_state()
    for step in (1, 2):
        _train(state, step)
        manager.save(step, state, force=True)
    manager.close()
    restarted = _manager(tmp_path, keep_last=1)  # start-up clean-up of leftovers
    assert (restarted.path_for(1) / PRUNED_NAME).exists()
    assert restarted.restore(_lora_state()) == 2
    assert _load(restarted.path_for(2))["step"] == 2


def test_prune_on_the_command_line_keeps_referenced_files(tmp_path, capsys):
    chain = IncrementalChain()
    state = _lora_state()
    for step in (1, 2, 3):
        _train(state, step)
        shardpoint.save(state, tmp_path / f"step-{step:09d}", incremental=chain)
    assert cli(["prune", str(tmp_path), "--keep-last", "1", "--json"]) == 0
    doc = json.loads(capsys.readouterr().out)
    assert doc["kept_for_references"] == [str(tmp_path / "step-000000001")]
    assert _load(tmp_path / "step-000000003")["step"] == 3
    assert cli(["ls", str(tmp_path), "--json"]) == 0
    rows = {Path(r["path"]).name: r for r in json.loads(capsys.readouterr().out)}
    assert rows["step-000000001"]["status"] == "pruned"
    newest = rows["step-000000003"]
    assert (
        newest["referenced"]
        == (tmp_path / "step-000000001/rank00000-00000.safetensors").stat().st_size
    )
    assert newest["size"] < 64 * 1024


def test_a_damaged_referenced_file_invalidates_its_readers_and_restore_falls_back(tmp_path):
    """ "late" changes up to step 2, is written once more (hashed) at step 3 and read
    from step 3's file by step 4; damaging that file invalidates steps 3 and 4 (typed
    errors naming the file); restore falls back to step 2, which has its own."""
    manager = _manager(tmp_path)
    state = {"late": torch.zeros(1000), "live": torch.zeros(10), "step": 0}
    for step in (1, 2, 3, 4):
        if step <= 2:
            state["late"].add_(1.0)
        state["live"].add_(1.0)
        state["step"] = step
        manager.save(step, state, force=True)
    file = manager.path_for(3) / "rank00000-00000.safetensors"
    assert "../step-000000003/rank00000-00000.safetensors" in _index(manager.path_for(4))["files"]
    data = bytearray(file.read_bytes())
    data[-100] ^= 0xFF
    file.write_bytes(bytes(data))
    report = shardpoint.verify(manager.path_for(4))
    damaged = [f.name for f in report.files if f.errors]
    assert damaged == ["../step-000000003/rank00000-00000.safetensors"], report
    with pytest.raises(CorruptCheckpointError, match="step-000000003"):
        shardpoint.load(
            {"late": torch.zeros(1000), "live": torch.zeros(10), "step": 0}, manager.path_for(4)
        )
    target = {"late": torch.zeros(1000), "live": torch.zeros(10), "step": 0}
    with pytest.warns(UserWarning):
        assert manager.restore(target) == 2
    assert target["late"][0].item() == 2.0 and target["live"][0].item() == 2.0


def test_a_missing_referenced_file_is_a_typed_error(tmp_path):
    manager = _manager(tmp_path)
    state = _lora_state()
    for step in (1, 2):
        _train(state, step)
        manager.save(step, state, force=True)
    (manager.path_for(1) / "rank00000-00000.safetensors").unlink()
    with pytest.raises(CheckpointError, match="step-000000001"):
        _load(manager.path_for(2))


@pytest.mark.parametrize(
    "name",
    [
        "../../etc/passwd",
        "../step-000000001/../x.safetensors",
        "../a/b/c.safetensors",
        "..//x.safetensors",
        "/abs/x.safetensors",
        "../step-000000001/passwd",  # a reference names a shard file, nothing else
    ],
)
def test_a_reference_that_leaves_the_parent_directory_is_refused(tmp_path, name):
    manager = _manager(tmp_path)
    state = _lora_state()
    for step in (1, 2):
        _train(state, step)
        manager.save(step, state, force=True)
    path = manager.path_for(2)
    old = "../step-000000001/rank00000-00000.safetensors"

    def swap(doc):
        doc["files"][name] = doc["files"].pop(old)
        for spec in doc["tensors"].values():
            for c in spec.get("chunks", []):
                if c["file"] == old:
                    c["file"] = name

    rewrite_index(path, swap)
    with pytest.raises(CorruptCheckpointError, match="refusing file name"):
        _load(path)


def test_a_sibling_that_is_a_symlink_out_of_the_parent_is_refused(tmp_path):
    root = tmp_path / "run"
    manager = _manager(root)
    state = _lora_state()
    for step in (1, 2):
        _train(state, step)
        manager.save(step, state, force=True)
    outside = tmp_path / "elsewhere"
    manager.path_for(1).rename(outside)
    manager.path_for(1).symlink_to(outside)
    with pytest.raises(CorruptCheckpointError, match="outside"):
        _load(manager.path_for(2))


def test_an_index_with_references_is_version_3_and_older_versions_may_not_hold_them(tmp_path):
    manager = _manager(tmp_path)
    state = _lora_state()
    for step in (1, 2):
        _train(state, step)
        manager.save(step, state, force=True)
    assert _index(manager.path_for(1))["format_version"] == 2  # wrote everything itself
    assert _index(manager.path_for(2))["format_version"] == 3


def test_a_save_to_another_parent_directory_writes_everything(tmp_path):
    chain = IncrementalChain()
    state = _lora_state()
    shardpoint.save(state, tmp_path / "a" / "one", incremental=chain)
    info = shardpoint.save(state, tmp_path / "b" / "two", incremental=chain)
    assert info.bytes_written > FROZEN_ROWS * 1024 * 4  # no sibling to refer to
    info = shardpoint.save(state, tmp_path / "b" / "three", incremental=chain)
    assert info.bytes_written < 4096  # a sibling of "two": all referred to


def test_a_failed_save_leaves_the_chain_on_the_last_committed_checkpoint(tmp_path, monkeypatch):
    chain = IncrementalChain()
    state = _lora_state()
    shardpoint.save(state, tmp_path / "one", incremental=chain)
    _train(state, 1)
    shardpoint.save(state, tmp_path / "two", incremental=chain)  # the adapter changed
    real = Commit.finish

    def fail(commit, index):  # noqa: ANN001
        raise OSError("disk full")

    monkeypatch.setattr(Commit, "finish", fail)
    with pytest.raises(CheckpointError, match="disk full"):
        # Writes the (now steady) adapter with its hash, then fails to commit.
        shardpoint.save(state, tmp_path / "three", incremental=chain)
    assert not (tmp_path / "three").exists()
    monkeypatch.setattr(Commit, "finish", real)
    shardpoint.save(state, tmp_path / "four", incremental=chain)
    files = _index(tmp_path / "four")["files"]
    # Its base is "two", the newest committed, whose adapter has no hash: written again,
    # never referred to in "three", whose files are gone.
    assert sorted(n for n in files if n.startswith("../")) == ["../one/rank00000-00000.safetensors"]
    assert _load(tmp_path / "four")["adapter"][0, 0].item() == 1.0


def test_commit_delete_keeps_named_files_under_a_pruned_note(tmp_path):
    state = _lora_state()
    shardpoint.save(state, tmp_path / "ck")
    Commit(LocalDirectory(tmp_path / "ck")).delete(keep={"rank00000-00000.safetensors"})
    assert sorted(os.listdir(tmp_path / "ck")) == [PRUNED_NAME, "rank00000-00000.safetensors"]
    assert Commit(LocalDirectory(tmp_path / "ck")).is_pruned()
    Commit(LocalDirectory(tmp_path / "ck")).delete()
    assert not (tmp_path / "ck").exists()


# ---- several ranks ----------------------------------------------------------------------


def _fsdp_rank(rank: int, world: int, root: str) -> None:
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Shard, distribute_tensor

    mesh = init_device_mesh("cpu", (world,))
    g = torch.Generator().manual_seed(0)
    frozen = distribute_tensor(torch.randn(64, 32, generator=g), mesh, [Shard(0)])
    trained = distribute_tensor(torch.zeros(16, 8), mesh, [Shard(0)])
    manager = CheckpointManager(
        root, retention=RetentionPolicy(keep_last=2), incremental=True, preemption_signals=()
    )
    for step in (1, 2, 3):
        trained.add_(1.0)
        manager.save(step, {"frozen": frozen, "trained": trained, "step": step}, force=True)
    manager.close()


def test_an_fsdp_incremental_checkpoint_loads_on_another_world_size(tmp_path):
    root = tmp_path / "run"
    run_ranks(2, _fsdp_rank, str(root))
    newest = root / "step-000000003"
    doc = _index(newest)
    assert doc["format_version"] == 3
    refs = sorted(n for n in doc["files"] if n.startswith("../"))
    assert refs == [
        "../step-000000001/rank00000-00000.safetensors",
        "../step-000000001/rank00001-00000.safetensors",
    ]
    assert (root / "step-000000001" / PRUNED_NAME).exists()  # retention kept its files
    out = {"frozen": torch.zeros(64, 32), "trained": torch.zeros(16, 8), "step": 0}
    shardpoint.load(out, newest)  # one process reads what two wrote
    g = torch.Generator().manual_seed(0)
    assert torch.equal(out["frozen"], torch.randn(64, 32, generator=g))
    assert torch.equal(out["trained"], torch.full((16, 8), 3.0)) and out["step"] == 3
    assert shardpoint.verify(newest).ok


def test_copy_makes_a_self_contained_checkpoint_of_version_2(tmp_path, capsys):
    manager = _manager(tmp_path / "run")
    state = _lora_state()
    for step in (1, 2, 3):
        _train(state, step)
        manager.save(step, state, force=True)
    out = tmp_path / "elsewhere" / "copy"
    assert cli(["copy", str(manager.path_for(3)), str(out), "--json"]) == 0
    doc = json.loads(capsys.readouterr().out)
    assert doc["made_own"] == 1
    index = _index(out)
    assert index["format_version"] == 2
    assert not any("/" in name for name in index["files"])
    shutil.rmtree(tmp_path / "run")  # nothing of the source is needed any more
    assert shardpoint.verify(out).ok
    loaded = _load(out)
    assert loaded["step"] == 3 and torch.equal(loaded["base"], state["base"])
    assert torch.equal(loaded["adapter"], state["adapter"])


def test_copy_of_a_sharded_incremental_checkpoint_rewrites_its_fragments(tmp_path):
    root = tmp_path / "run"
    run_ranks(2, _fsdp_rank, str(root))
    out = tmp_path / "copy"
    info = copy_checkpoint(root / "step-000000003", out)
    assert info.made_own == 2
    assert not any("/" in n for n in _index(out)["files"])
    shutil.rmtree(root)
    assert shardpoint.verify(out).ok
    loaded = {"frozen": torch.zeros(64, 32), "trained": torch.zeros(16, 8), "step": 0}
    shardpoint.load(loaded, out)
    assert torch.equal(loaded["trained"], torch.full((16, 8), 3.0))


def test_copy_onto_a_committed_checkpoint_is_refused_and_changes_nothing(tmp_path):
    shardpoint.save(_lora_state(), tmp_path / "a")
    other = {"w": torch.ones(3)}
    shardpoint.save(other, tmp_path / "b")
    before = sorted((p.name, p.stat().st_size) for p in (tmp_path / "b").iterdir())
    with pytest.raises(shardpoint.CheckpointExistsError):
        shardpoint.copy_checkpoint(tmp_path / "a", tmp_path / "b")
    assert sorted((p.name, p.stat().st_size) for p in (tmp_path / "b").iterdir()) == before


def test_a_chunk_that_stops_changing_is_written_once_more_then_referred_to(tmp_path):
    """Chunks that changed since the last save are written without the content hash
    (full pre-training hashes nothing extra); one that then stays the same is written
    once more, hashed, and referred to from the save after."""
    manager = _manager(tmp_path)
    state = _lora_state()
    adapter = state["adapter"].numel() * 4
    manager.save(1, state, force=True)
    _train(state, 2)
    assert manager.save(2, state, force=True).bytes_written >= adapter  # changed
    assert manager.save(3, state, force=True).bytes_written >= adapter  # no hash yet
    assert manager.save(4, state, force=True).bytes_written < 1024  # referred to
    assert torch.equal(_load(manager.path_for(4))["adapter"], state["adapter"])


def test_export_hf_and_inspect_follow_references(tmp_path, capsys):
    manager = _manager(tmp_path / "run")
    state = _lora_state()
    for step in (1, 2):
        _train(state, step)
        manager.save(step, state, force=True)
    out = tmp_path / "hf"
    assert cli(["export-hf", str(manager.path_for(2)), str(out)]) == 0
    from safetensors.torch import load_file

    tensors = {}
    for f in sorted(out.glob("*.safetensors")):
        tensors.update(load_file(f))
    assert torch.equal(tensors["base"], state["base"])
    assert torch.equal(tensors["adapter"], state["adapter"])
    assert cli(["inspect", str(manager.path_for(2)), "--json"]) == 0
    assert "base" in capsys.readouterr().out


def _per_rank_values(rank: int, world: int, root: str) -> None:
    chain = IncrementalChain()
    mine = torch.arange(1000.0) + rank  # unchanged: referred to from the second save on
    state = {"mine": shardpoint.PerRank({rank: {"t": mine}}), "w": torch.zeros(3)}
    for step in (1, 2, 3):
        state["w"].add_(1.0)
        shardpoint.save(state, f"{root}/step-{step:09d}", incremental=chain)
    out = {"mine": shardpoint.PerRank({rank: {"t": torch.zeros(1000)}}), "w": torch.zeros(3)}
    shardpoint.load(out, f"{root}/step-000000003", strict=False)  # the other rank's: not here
    assert torch.equal(out["mine"][rank]["t"], mine) and out["w"][0].item() == 3.0


def test_a_ranks_own_values_in_its_fragment_are_referred_to_and_load(tmp_path):
    run_ranks(2, _per_rank_values, str(tmp_path))
    files = _index(tmp_path / "step-000000003")["files"]
    assert "../step-000000001/rank00001-00000.safetensors" in files
    assert shardpoint.verify(tmp_path / "step-000000003").ok


def test_a_base_deleted_by_hand_makes_the_next_save_write_everything(tmp_path):
    manager = _manager(tmp_path)
    state = _lora_state()
    manager.save(1, state, force=True)
    shutil.rmtree(manager.path_for(1))  # not through the manager
    info = manager.save(2, state, force=True)
    assert info.bytes_written > FROZEN_ROWS * 1024 * 4
    assert not any(n.startswith("../") for n in _index(manager.path_for(2))["files"])
    assert _load(manager.path_for(2))["step"] == 0


def test_retention_that_cannot_read_a_kept_index_keeps_every_shard_file(tmp_path, monkeypatch):
    """What a kept checkpoint refers to must be known before a file is deleted: when its
    index cannot be read (an I/O error), the checkpoints retention deletes keep every
    shard file (under a PRUNED note), and nothing pruned earlier is cleared."""
    manager = _manager(tmp_path, keep_last=1)
    state = _lora_state()
    for step in (1, 2):
        _train(state, step)
        manager.save(step, state, force=True)
    real = LocalDirectory.read_small

    def failing(self, name, limit):  # noqa: ANN001, ANN202
        if name == "index.json" and self.root.name == "step-000000003":
            raise CorruptCheckpointError(f"{self.root}: Input/output error")
        return real(self, name, limit)

    monkeypatch.setattr(LocalDirectory, "read_small", failing)
    _train(state, 3)
    manager.save(3, state, force=True)
    monkeypatch.setattr(LocalDirectory, "read_small", real)
    assert manager.steps() == [3]
    for step in (1, 2):
        assert sorted(os.listdir(manager.path_for(step))) == [
            PRUNED_NAME,
            "rank00000-00000.safetensors",
        ]
    assert _load(manager.path_for(3))["step"] == 3
    # Readable again: the next retention clears what nothing refers to.
    _train(state, 4)
    manager.save(4, state, force=True)
    assert not manager.path_for(2).exists() and (manager.path_for(1) / PRUNED_NAME).exists()


def _background_incremental_saves(rank: int, world: int, root: str) -> None:
    chain = IncrementalChain()
    saver = shardpoint.AsyncSaver()
    mine = torch.arange(1000.0) + rank  # unchanged: referred to from the second save on
    values = {"t": mine}
    state = {"mine": shardpoint.PerRank({rank: values}), "w": torch.zeros(3)}
    for step in (1, 2, 3, 4):
        state["w"].add_(1.0)
        if step == 3 and rank == 1:  # rank 1's structure changes: the save runs again
            values["extra"] = torch.ones(5)
        saver.save(state, f"{root}/step-{step:09d}", chain=chain).wait()
    saver.close()


def test_a_background_save_run_again_after_a_change_keeps_the_chain_of_its_steady_ranks(
    tmp_path,
):
    """Rank 0 is steady when rank 1 changes at step 3: it keeps the files it wrote,
    whose chunks of its own values went to its fragment, and the chain must still
    learn them, so that step 4 refers to step 1's file instead of writing it again."""
    run_ranks(2, _background_incremental_saves, str(tmp_path))
    for step in (3, 4):
        files = _index(tmp_path / f"step-{step:09d}")["files"]
        assert "../step-000000001/rank00000-00000.safetensors" in files, (step, files)
        assert shardpoint.verify(tmp_path / f"step-{step:09d}").ok
    out = {"mine": shardpoint.PerRank({0: {"t": torch.zeros(1000)}}), "w": torch.zeros(3)}
    shardpoint.load(out, tmp_path / "step-000000004", strict=False)
    assert torch.equal(out["mine"][0]["t"], torch.arange(1000.0)) and out["w"][0].item() == 4.0


def test_a_copy_that_fails_on_a_full_disk_is_a_typed_error_and_leaves_nothing(
    tmp_path, monkeypatch
):
    import errno

    import shardpoint.checkpoint_copy as checkpoint_copy

    shardpoint.save({"w": torch.ones(100)}, tmp_path / "a")

    def full(*args, **kwargs):  # noqa: ANN002, ANN003, ANN202
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(checkpoint_copy, "copy_files", full)
    with pytest.raises(shardpoint.CheckpointError, match="No space left.*Free space"):
        copy_checkpoint(tmp_path / "a", tmp_path / "b")
    assert not (tmp_path / "b").exists() and shardpoint.verify(tmp_path / "a").ok


def test_a_source_file_that_comes_back_short_fails_its_copy(tmp_path):
    """A file that shrank between its listing and its read: the copy fails (a local
    target would otherwise pad it to size with zeros)."""
    from shardpoint.storage.transfer import copy_file

    source = LocalDirectory(tmp_path / "src")
    source.prepare()
    (tmp_path / "src" / "f.bin").write_bytes(b"x" * 100)
    real = source.iter_bytes
    source.iter_bytes = lambda name, block: (b[:60] for b in real(name, block))  # type: ignore[method-assign]
    target = LocalDirectory(tmp_path / "dst")
    target.prepare()
    with pytest.raises(shardpoint.CorruptCheckpointError, match="60 bytes read, 100 expected"):
        copy_file(source, target, "f.bin", threads=1)
    assert not (tmp_path / "dst" / "f.bin").exists()
