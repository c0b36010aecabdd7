"""A save whose structure is unchanged writes with the cached plan before any
collective (docs/distributed.md): before rank 0 has locked or cleared the directory.
Whatever is already there — a committed checkpoint, another job's save in flight, a
crashed save's leftovers — it is never damaged, and the save either commits or fails
the way an agreed save does."""

from __future__ import annotations

import hashlib
import json
from pathlib import Path

import pytest
import torch
import torch.distributed
from distributed import run_ranks

import shardpoint
from shardpoint.storage import local as local_storage


def _state(rank: int, step: int) -> dict:
    torch.manual_seed(step)
    return {
        "shared": {f"w{i}": torch.randn(32, 8) for i in range(6)},  # split among the ranks
        "own": {str(rank): torch.full((3,), float(10 * rank + step))},  # this rank's alone
        "step": step,
    }


def _fingerprint(directory: Path) -> dict[str, str]:
    return {
        p.name: hashlib.sha256(p.read_bytes()).hexdigest()
        for p in sorted(directory.iterdir())
        if p.is_file()
    }


def _then(rank: int, root: str, target: str, name: str, background: bool = False) -> None:
    """Two saves (the plan is cached after the first), then one into ``target``; records
    what each rank raised and whether it wrote a shard file into ``target``. With
    ``background``, the saves are an ``AsyncSaver``'s, each waited for."""
    saver = shardpoint.AsyncSaver() if background else None

    def save(state: dict, path: str) -> None:
        if saver is None:
            shardpoint.save(state, path)
        else:
            saver.save(state, path).wait()

    for step in range(2):
        save(_state(rank, step), f"{root}/step{step}")
    torch.distributed.barrier()
    if rank == 0 and Path(target).is_dir():  # before any rank writes there
        with open(f"{root}/{name}-before.json", "w") as f:
            json.dump(_fingerprint(Path(target)), f)
    torch.distributed.barrier()
    wrote = []
    real = local_storage.LocalDirectory.write_files
    real_stream = local_storage.LocalDirectory.open_writer  # a background save's files

    def recording(self, files, **kwargs):
        if str(self.root) == target:
            wrote.extend(files)
        return real(self, files, **kwargs)

    def recording_stream(self, name, size, **kwargs):
        if str(self.root) == target:
            wrote.append(name)
        return real_stream(self, name, size, **kwargs)

    local_storage.LocalDirectory.write_files = recording
    local_storage.LocalDirectory.open_writer = recording_stream
    raised = None
    try:
        save(_state(rank, 2), target)
    except Exception as exc:
        raised = type(exc).__name__
    finally:
        local_storage.LocalDirectory.write_files = real
        local_storage.LocalDirectory.open_writer = real_stream
    with open(f"{root}/{name}{rank}.json", "w") as f:
        json.dump({"raised": raised, "wrote": wrote}, f)


def _outcomes(root: Path, name: str, world: int) -> list[dict]:
    return [json.loads((root / f"{name}{r}.json").read_text()) for r in range(world)]


def _into_committed(rank: int, world: int, root: str, background: bool) -> None:
    _then(rank, root, f"{root}/step0", "committed", background)


@pytest.mark.slow
@pytest.mark.parametrize("background", [False, True], ids=["save", "background"])
def test_an_unchanged_save_into_a_committed_checkpoint_writes_nothing_there(tmp_path, background):
    """The committed checkpoint is refused by every rank before it writes a byte: rank 0
    when it locks, every other rank by looking for the marker first (it has no lock).
    A background save reports it through the commit, and removes nothing of it."""
    run_ranks(2, _into_committed, str(tmp_path), background)
    outcomes = _outcomes(tmp_path, "committed", 2)
    assert outcomes[0]["raised"] == ("CheckpointError" if background else "CheckpointExistsError")
    assert outcomes[1]["raised"] == "CheckpointError"
    assert [o["wrote"] for o in outcomes] == [[], []]
    before = json.loads((tmp_path / "committed-before.json").read_text())
    assert _fingerprint(tmp_path / "step0") == before
    assert shardpoint.verify(tmp_path / "step0").ok


def _beside_another_writer(rank: int, world: int, root: str, background: bool) -> None:
    _then(rank, root, f"{root}/busy", "busy", background)


@pytest.mark.slow
@pytest.mark.parametrize("background", [False, True], ids=["save", "background"])
def test_an_unchanged_save_beside_another_jobs_save_leaves_its_files_alone(tmp_path, background):
    """Another job is saving into the same directory (it holds the lock and has written
    a file whose name this save needs). The speculative write creates files exclusively,
    so it neither overwrites nor, failing, deletes that file; the agreed save that
    follows is refused by the lock on every rank."""
    busy = tmp_path / "busy"
    busy.mkdir()
    theirs = busy / "rank00001-00000.safetensors"
    theirs.write_bytes(b"the other job's bytes")
    lock = local_storage.WriterLock(busy)
    lock.acquire()
    try:
        run_ranks(2, _beside_another_writer, str(tmp_path), background)
    finally:
        lock.release()
    outcomes = _outcomes(tmp_path, "busy", 2)
    assert outcomes[0]["raised"] == ("CheckpointError" if background else "ConcurrentWriterError")
    assert outcomes[1]["raised"] == "CheckpointError"
    assert theirs.read_bytes() == b"the other job's bytes"
    assert sorted(p.name for p in busy.iterdir()) == [theirs.name]  # nothing else left


def _onto_leftovers(rank: int, world: int, root: str, background: bool) -> None:
    _then(rank, root, f"{root}/step2", "leftovers", background)


@pytest.mark.slow
@pytest.mark.parametrize("background", [False, True], ids=["save", "background"])
def test_an_unchanged_save_onto_a_crashed_saves_leftovers_commits_and_clears_them(
    tmp_path, background
):
    """A crashed save left files at the path (names this save needs, and others): the
    speculative write refuses the names that are there, every rank saves again agreed
    first — rank 0 clears the leftovers under the lock — and the checkpoint commits,
    holding nothing but its own files. In the background rank 1 sees its name taken
    before it stages: it copies what it holds, writes its part once rank 0 has cleared,
    rank 0 keeping what it wrote."""
    step2 = tmp_path / "step2"
    step2.mkdir()
    for name in ("rank00001-00000.safetensors", "rank00007-00000.safetensors", "index.json"):
        (step2 / name).write_bytes(b"left by a crashed save")
    run_ranks(2, _onto_leftovers, str(tmp_path), background)
    outcomes = _outcomes(tmp_path, "leftovers", 2)
    assert [o["raised"] for o in outcomes] == [None, None]
    if background:  # each file written once: rank 0's kept, rank 1's after the clear
        assert [len(o["wrote"]) for o in outcomes] == [1, 1]
    _check_only_its_own_files(step2)


def _onto_unneeded_leftovers(rank: int, world: int, root: str) -> None:
    _then(rank, root, f"{root}/step2", "unneeded")


def test_leftovers_a_speculative_save_does_not_collide_with_are_cleared_at_its_commit(
    tmp_path,
):
    """Leftovers whose names this save does not use: the speculative save commits at
    once, and rank 0 clears them before the index is written."""
    step2 = tmp_path / "step2"
    step2.mkdir()
    (step2 / "rank00007-00000.safetensors").write_bytes(b"left by a crashed save")
    run_ranks(2, _onto_unneeded_leftovers, str(tmp_path))
    outcomes = _outcomes(tmp_path, "unneeded", 2)
    assert [o["raised"] for o in outcomes] == [None, None]
    assert all(o["wrote"] for o in outcomes)  # written once each: no second, agreed save
    assert [len(o["wrote"]) for o in outcomes] == [1, 1]
    _check_only_its_own_files(step2)


def _check_only_its_own_files(directory: Path) -> None:
    assert shardpoint.verify(directory).ok
    index = json.loads((directory / "index.json").read_text())
    assert sorted(p.name for p in directory.iterdir()) == sorted(
        [*index["files"], "index.json", "COMMITTED"]
    )
    with shardpoint.open(directory) as ckpt:
        expected = _state(0, 2)["shared"]
        for name, tensor in expected.items():
            assert torch.equal(ckpt.get(f"shared.{name}"), tensor)
        assert torch.equal(ckpt.get("own.1"), torch.full((3,), 12.0))


def test_a_streamed_file_made_exclusively_neither_replaces_nor_removes_anothers(tmp_path):
    """A background save's files (``open_writer(exclusive=True)``): a name another writer
    took while this one streamed is refused at the close — not renamed over — and the
    refused writer leaves nothing of its own; a temporary name in use is refused at
    the open."""
    directory = local_storage.LocalDirectory(tmp_path)
    writer = directory.open_writer("rank00001-00000.safetensors", 4096, exclusive=True)
    writer.write(0, memoryview(bytes(4096)))
    (tmp_path / "rank00001-00000.safetensors").write_bytes(b"another writer's")
    with pytest.raises(FileExistsError):
        writer.close()
    writer.abort()  # what the saver does after a failed close
    assert (tmp_path / "rank00001-00000.safetensors").read_bytes() == b"another writer's"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["rank00001-00000.safetensors"]
    (tmp_path / "rank00002-00000.safetensors.tmp").write_bytes(b"being written")
    with pytest.raises(FileExistsError):
        directory.open_writer("rank00002-00000.safetensors", 4096, exclusive=True)
    assert (tmp_path / "rank00002-00000.safetensors.tmp").read_bytes() == b"being written"
    # Not exclusive (copies, exports): replaced, as before.
    writer = directory.open_writer("rank00001-00000.safetensors", 3)
    writer.write(0, memoryview(b"new"))
    writer.close()
    assert (tmp_path / "rank00001-00000.safetensors").read_bytes() == b"new"


def test_a_background_save_whose_file_name_another_writer_took_leaves_that_file(
    tmp_path, monkeypatch
):
    """Another writer takes a name while a background save streams that file: the
    save fails, and its clean-up removes the files it made, not that one."""
    target = tmp_path / "step"
    real_close = local_storage.direct_io.StreamingFile.close

    def racing_close(self):
        if self.path.name == "rank00000-00001.safetensors":
            self.path.write_bytes(b"another writer's")
        return real_close(self)

    monkeypatch.setattr(local_storage.direct_io.StreamingFile, "close", racing_close)
    state = {f"w{i}": torch.full((1024,), float(i)) for i in range(4)}  # 4 KB each
    saver = shardpoint.AsyncSaver(max_shard_size=8192)  # two files
    handle = saver.save(state, target)
    with pytest.raises(shardpoint.CheckpointError, match="rank00000-00001"):
        handle.wait()
    assert (target / "rank00000-00001.safetensors").read_bytes() == b"another writer's"
    assert sorted(p.name for p in target.iterdir()) == ["rank00000-00001.safetensors"]
