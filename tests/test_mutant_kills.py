"""Tests that kill mutants tools/mutants.py found surviving (docs/reliability.md,
"Generated mutants"). Each names the behaviour it pins down; the mutant ids it kills
are in the report of that run."""

from __future__ import annotations

import re

import pytest
import torch

import shardpoint
from shardpoint.errors import CheckpointError

# ---- verify ------------------------------------------------------------------------------


def _shards(path):
    return sorted(path.glob("*.safetensors"))


@pytest.mark.parametrize("row_first", [True, False], ids=["row-first", "row-last"])
def test_verify_streams_a_shard_larger_than_its_read_block_and_names_the_damaged_range(
    tmp_path, row_first
):
    """verify reads a file in 8 MiB blocks. A 24 MiB shard takes three reads; it holds a
    tensor of one 12 MiB row (one 12 MiB checksum range, spanning two reads) and a 1-D
    one (256 KiB checksum ranges, some straddling a read boundary), in either order.
    The intact file verifies, every byte read once; a byte flipped in each tensor, past
    the first read, is exactly one mismatch each, whose byte range holds that byte."""
    path = tmp_path / "big"
    n = 3 * 1024 * 1024
    row, flat = torch.ones(1, n), torch.arange(n, dtype=torch.float32)
    shardpoint.save({"a": row, "b": flat} if row_first else {"a": flat, "b": row}, path)
    (shard,) = _shards(path)
    assert shard.stat().st_size > 24 * 1024 * 1024
    seen = []
    report = shardpoint.verify(path, progress=seen.append)
    assert report.ok, report
    assert sum(seen) == shard.stat().st_size  # every byte read once
    raw = bytearray(shard.read_bytes())
    flipped = [9 * 1024 * 1024 + 12345, len(raw) - 1000]  # in "a", in "b"
    for at in flipped:
        raw[at] ^= 0x01
    shard.write_bytes(bytes(raw))
    report = shardpoint.verify(path)
    assert not report.ok
    (bad,) = [f for f in report.files if not f.ok]
    assert bad.name == shard.name
    assert len(bad.errors) == 2, bad.errors
    ranges = sorted(
        tuple(map(int, re.search(r"bytes (\d+)-(\d+)", e).groups())) for e in bad.errors
    )
    for (lo, hi), at in zip(ranges, flipped):
        assert lo <= at < hi, (ranges, flipped)
    lo, hi = ranges[0 if row_first else 1]
    assert hi - lo == 4 * n  # the row's one checksum range


def test_verify_with_no_worker_threads_asked_for_still_checks(tmp_path):
    """``threads=0`` (or less) means one worker, not an error."""
    path = tmp_path / "c"
    shardpoint.save({"w": torch.ones(10)}, path)
    assert shardpoint.verify(path, threads=0).ok


def test_raise_if_corrupt_raises_only_for_a_damaged_checkpoint_and_names_every_problem(tmp_path):
    path = tmp_path / "c"
    shardpoint.save({"a": torch.ones(1000), "b": torch.zeros(1000)}, path, max_shard_size=4096)
    shardpoint.verify(path).raise_if_corrupt()  # intact: no error
    shards = _shards(path)
    assert len(shards) == 2
    for shard in shards:
        raw = bytearray(shard.read_bytes())
        raw[-1] ^= 0x01
        shard.write_bytes(bytes(raw))
    report = shardpoint.verify(path)
    problems = [e for f in report.files for e in f.errors]
    assert len(problems) == 2
    with pytest.raises(CheckpointError) as raised:
        report.raise_if_corrupt()
    message = str(raised.value)
    assert message.startswith(f"{path}: verification failed: ")
    assert all(p in message for p in problems)


# ---- commit: begin, leftovers --------------------------------------------------------------


def _files(path):
    return sorted(p.name for p in path.iterdir())


def test_a_save_clears_what_a_crashed_save_left_in_its_directory(tmp_path):
    """Files a save writes, left by one that crashed before its marker, are removed by the
    next save into that directory: the committed checkpoint holds only its own files."""
    path = tmp_path / "c"
    path.mkdir()
    for leftover in ("rank00000-00007.safetensors", "rank00003-00000.safetensors.tmp",
                     "index.json.tmp", "COMMITTED.tmp"):  # fmt: skip
        (path / leftover).write_bytes(b"left by a crashed save")
    shardpoint.save({"w": torch.ones(4)}, path)
    assert _files(path) == ["COMMITTED", "index.json", "rank00000-00000.safetensors"]
    assert shardpoint.verify(path).ok


def test_an_uncommitted_step_directory_holding_a_foreign_file_is_left_alone_at_start(tmp_path):
    """Start-up clean-up removes only directories that hold nothing but a save's files;
    one that also holds a file of the user's is not a leftover, and nothing in it goes."""
    root = tmp_path / "ckpts"
    step = root / "step-000000005"
    step.mkdir(parents=True)
    (step / "rank00000-00000.safetensors").write_bytes(b"partial")
    (step / "notes.txt").write_text("mine")
    manager = shardpoint.CheckpointManager(root, preemption_signals=())
    assert manager.steps() == []
    assert _files(step) == ["notes.txt", "rank00000-00000.safetensors"]


def test_a_local_commit_makes_each_step_durable_before_the_next(tmp_path, monkeypatch):
    """Power-loss order (which a SIGKILL cannot show: the page cache survives it): every
    shard and the index are fsynced before the index is renamed into place; the
    directory is fsynced after that rename and before the marker's, and again after the
    marker's rename."""
    import os

    path = tmp_path / "c"
    events: list[tuple[str, str]] = []
    fds: dict[int, str] = {}
    real_open, real_fsync, real_replace = os.open, os.fsync, os.replace

    def opened(file, *args, **kwargs):
        fd = real_open(file, *args, **kwargs)
        fds[fd] = os.fspath(file)
        return fd

    def fsync(fd):
        events.append(("fsync", fds.get(fd, "?")))
        return real_fsync(fd)

    def replace(src, dst, *args, **kwargs):
        events.append(("replace", os.fspath(dst)))
        return real_replace(src, dst, *args, **kwargs)

    monkeypatch.setattr(os, "open", opened)
    monkeypatch.setattr(os, "fsync", fsync)
    monkeypatch.setattr(os, "replace", replace)
    shardpoint.save({"a": torch.ones(1000), "b": torch.zeros(1000)}, path, max_shard_size=4096)
    monkeypatch.undo()

    def at(event):
        assert event in events, (event, events)
        return events.index(event)

    d, index, marker = str(path), str(path / "index.json"), str(path / "COMMITTED")
    index_in_place, marker_in_place = at(("replace", index)), at(("replace", marker))
    for shard in _shards(path):
        assert at(("fsync", str(shard))) < index_in_place
    assert at(("fsync", index + ".tmp")) < index_in_place
    synced = [i for i, e in enumerate(events) if e == ("fsync", d)]
    assert any(index_in_place < i < marker_in_place for i in synced), events
    assert at(("fsync", marker + ".tmp")) < marker_in_place
    assert any(i > marker_in_place for i in synced), events


def test_retention_makes_the_marker_deletion_durable_before_deleting_anything_else(
    tmp_path, monkeypatch
):
    """Power-loss order of a deletion: the marker is unlinked and the directory fsynced
    before any other file of the checkpoint goes, so no crash leaves a marker over
    missing files. (A SIGKILL cannot show a missing fsync, and the sorted listing puts
    COMMITTED first anyway.)"""
    import os

    manager = shardpoint.CheckpointManager(
        tmp_path / "ckpts",
        retention=shardpoint.RetentionPolicy(keep_last=1),
        preemption_signals=(),
    )
    manager.save(1, {"w": torch.ones(4)}, force=True)
    old = manager.path_for(1)
    events: list[tuple[str, str]] = []
    fds: dict[int, str] = {}
    real_open, real_fsync, real_unlink = os.open, os.fsync, os.unlink

    def opened(file, *args, **kwargs):
        fd = real_open(file, *args, **kwargs)
        fds[fd] = os.fspath(file)
        return fd

    def fsync(fd):
        events.append(("fsync", fds.get(fd, "?")))
        return real_fsync(fd)

    def unlink(file, *args, **kwargs):
        events.append(("unlink", os.fspath(file)))
        return real_unlink(file, *args, **kwargs)

    monkeypatch.setattr(os, "open", opened)
    monkeypatch.setattr(os, "fsync", fsync)
    monkeypatch.setattr(os, "unlink", unlink)
    manager.save(2, {"w": torch.ones(4)}, force=True)
    monkeypatch.undo()
    assert manager.steps() == [2] and not old.exists()
    mine = [e for e in events if os.path.dirname(e[1]) == str(old) or e[1] == str(old)]
    unlinks = [e for e in mine if e[0] == "unlink"]
    assert unlinks[0] == ("unlink", str(old / "COMMITTED")), mine
    assert len(unlinks) >= 3, mine  # marker, index, shard
    first_other = mine.index(unlinks[1])
    assert ("fsync", str(old)) in mine[mine.index(unlinks[0]) : first_other], mine


# ---- rng: the CUDA branches, on a CPU-only machine ----------------------------------------


class _FakeCuda:
    """torch.cuda's RNG functions for ``devices`` devices, recording every call; the CI
    machines have no GPU, and a skipped test fails this suite."""

    def __init__(self, monkeypatch, devices: int, initialized: bool) -> None:
        self.calls: list[tuple] = []
        self.states = {i: torch.tensor([i + 1, 7], dtype=torch.uint8) for i in range(devices)}
        cuda = torch.cuda
        monkeypatch.setattr(cuda, "is_available", lambda: devices > 0)
        monkeypatch.setattr(cuda, "is_initialized", lambda: initialized)
        monkeypatch.setattr(cuda, "device_count", lambda: devices)
        monkeypatch.setattr(cuda, "get_rng_state", self._get)
        monkeypatch.setattr(cuda, "set_rng_state", self._set)
        monkeypatch.setattr(cuda, "manual_seed_all", lambda s: self.calls.append(("seed", s)))

    def _get(self, i=0):
        self.calls.append(("get", i))
        return self.states[i].clone()

    def _set(self, state, i=0):
        self.calls.append(("set", i, state.tolist()))


def test_rng_capture_reads_cuda_state_only_once_cuda_is_initialised(monkeypatch):
    from shardpoint.training.rng import capture_rng

    fake = _FakeCuda(monkeypatch, devices=2, initialized=False)
    assert "cuda" not in capture_rng() and fake.calls == []  # never initialises CUDA
    fake = _FakeCuda(monkeypatch, devices=2, initialized=True)
    state = capture_rng()
    assert [s.tolist() for s in state["cuda"]] == [[1, 7], [2, 7]]


def test_rng_restore_sets_every_cuda_device_and_reseeds_a_new_rank(monkeypatch):
    from shardpoint.training.rng import capture_rng, reseed_streams, restore_rng

    fake = _FakeCuda(monkeypatch, devices=2, initialized=True)
    state = capture_rng()
    fake.calls.clear()
    restore_rng(state)
    assert fake.calls == [("set", 0, [1, 7]), ("set", 1, [2, 7])]
    new = reseed_streams(state, rank=5)
    assert "cuda" not in new and isinstance(new["cuda_seed"], int)
    fake.calls.clear()
    restore_rng(new)
    assert fake.calls == [("seed", new["cuda_seed"])]
    fake = _FakeCuda(monkeypatch, devices=1, initialized=True)
    with pytest.raises(RuntimeError, match="2 CUDA device"):
        restore_rng(state)  # saved on 2 devices, this process sees 1


# ---- data position ---------------------------------------------------------------------------


def test_a_rank_outside_the_world_size_is_refused():
    with pytest.raises(ValueError, match="outside world size"):
        shardpoint.ResumableSampler(10, rank=2, world_size=2)
    with pytest.raises(ValueError, match="outside world size"):
        shardpoint.ResumableSampler(10, rank=-1, world_size=2)


def test_an_unshuffled_loader_yields_the_dataset_in_order_and_resumes_mid_epoch():
    loader = shardpoint.ResumableLoader(list(range(10)), batch_size=3, shuffle=False)
    batches = iter(loader)
    assert next(batches).tolist() == [0, 1, 2]
    resumed = shardpoint.ResumableLoader(list(range(10)), batch_size=3, shuffle=False)
    resumed.load_state_dict(loader.state_dict())
    assert [b.tolist() for b in resumed] == [[3, 4, 5], [6, 7, 8], [9]]


def test_an_epoch_of_more_than_65536_samples_per_rank_yields_each_sample_once():
    """The sampler hands out indices in slices of 65536 (never one list of a whole epoch)."""
    n = 3 * 65536 + 5
    for world in (1, 2):
        samplers = [
            shardpoint.ResumableSampler(n, seed=1, rank=r, world_size=world) for r in range(world)
        ]
        seen = [i for s in samplers for i in s]
        assert len(seen) == len(set(seen)) == n - n % world
        assert set(seen) == set(samplers[0].order()[: n - n % world].tolist())


def test_a_sampler_length_is_what_it_yields_and_zero_once_the_epoch_is_consumed():
    for cursor in (0, 7, 99, 100):
        for r in range(3):
            s = shardpoint.ResumableSampler(100, seed=2, rank=r, world_size=3)
            s.cursor = cursor
            assert len(s) == len(list(s)), (cursor, r)
    fresh = shardpoint.ResumableLoader(list(range(10)), batch_size=3, seed=3)
    assert len(fresh) == 4 == len(list(fresh))  # batches left, the last one partial
    # A loop that stops right after the epoch's last batch, saves, and resumes:
    loader = shardpoint.ResumableLoader(list(range(10)), batch_size=5, seed=3)
    batches = iter(loader)
    next(batches), next(batches)
    resumed = shardpoint.ResumableLoader(list(range(10)), batch_size=5, seed=3)
    resumed.load_state_dict(loader.state_dict())
    assert len(resumed) == 0 and len(resumed.sampler) == 0
    assert list(resumed) == [] and resumed.epoch == 1
