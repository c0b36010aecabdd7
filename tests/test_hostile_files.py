"""Hostile files and failing disks: special files, OS errors on every read, loads that
fail half way, a full or read-only disk, two writers on one directory.

Each test is a guarantee of docs/reliability.md ("Round two"); each one fails on a
build without the mechanism it names.
"""

from __future__ import annotations

import builtins
import errno
import hashlib
import os
import socket
import stat
import subprocess
import sys
import warnings
from pathlib import Path

import pytest
import torch

import shardpoint
from shardpoint import CheckpointManager, RetentionPolicy
from shardpoint.cli import main as cli
from shardpoint.errors import (
    CheckpointError,
    ConcurrentWriterError,
    CorruptCheckpointError,
    StateMismatchError,
)
from shardpoint.format.index import INDEX_NAME, MARKER_NAME
from shardpoint.storage.local import LocalDirectory

pytestmark = pytest.mark.timeout(120)  # a reader that blocks on a FIFO fails, not hangs


def _state(seed: int = 0) -> dict:
    g = torch.Generator().manual_seed(seed)
    return {
        "a": torch.randn(300, 40, generator=g),
        "b": torch.randn(50, generator=g),
        "c": {"d": torch.randint(0, 100, (64, 8), generator=g)},
        "step": seed,
    }


def _digest(state: dict) -> str:
    """A checksum of every byte and value of the live state."""
    h = hashlib.sha256()

    def walk(value) -> None:
        if isinstance(value, dict):
            for k in sorted(value, key=str):
                h.update(repr(k).encode())
                walk(value[k])
        elif isinstance(value, torch.Tensor):
            h.update(value.detach().contiguous().view(torch.uint8).numpy().tobytes())
        else:
            h.update(repr(value).encode())

    walk(state)
    return h.hexdigest()


def _shard(path: Path) -> Path:
    return sorted(path.glob("*.safetensors"))[0]


def _replace_with(path: Path, kind: str) -> None:
    """Put a special file of ``kind`` where the regular file ``path`` was."""
    path.unlink()
    if kind == "fifo":
        os.mkfifo(path)
    elif kind == "directory":
        path.mkdir()
    elif kind == "socket":
        cwd = os.getcwd()
        os.chdir(path.parent)  # a socket's path has a length limit (108 bytes)
        try:
            with socket.socket(socket.AF_UNIX) as s:
                s.bind(path.name)
        finally:
            os.chdir(cwd)
    elif kind == "symlink loop":
        path.symlink_to(path.name)
    elif kind == "fifo via symlink":
        os.mkfifo(path.with_name("elsewhere"))
        path.symlink_to("elsewhere")
    else:
        raise AssertionError(kind)


SPECIAL = ["fifo", "directory", "socket", "symlink loop", "fifo via symlink"]
TARGETS = [MARKER_NAME, INDEX_NAME, "shard"]


@pytest.mark.parametrize("kind", SPECIAL)
@pytest.mark.parametrize("target", TARGETS)
def test_a_special_file_in_place_of_a_checkpoint_file_is_a_typed_error_for_every_reader(
    tmp_path, kind, target
):
    ckpt = tmp_path / "ckpt"
    shardpoint.save(_state(), ckpt)
    _replace_with(_shard(ckpt) if target == "shard" else ckpt / target, kind)
    live = _state(1)
    before = _digest(live)
    with pytest.raises(CheckpointError):
        shardpoint.load(live, ckpt)
    assert _digest(live) == before
    with pytest.raises(CheckpointError):
        with shardpoint.open(ckpt) as r:
            r.get("a")
    report = shardpoint.verify(ckpt)  # documented never to raise
    assert not report.ok
    # inspect and verify report the damage; listing and a dry-run prune still work.
    for argv, expected in (
        (["inspect", str(ckpt)], 2),
        (["verify", str(tmp_path)], 1),
        (["ls", str(tmp_path)], 0),
        (["prune", str(tmp_path), "--keep-last", "1", "--dry-run"], 0),
    ):
        assert cli(argv) == expected, argv


@pytest.mark.parametrize("kind", SPECIAL)
@pytest.mark.parametrize("target", TARGETS)
def test_restore_falls_back_past_a_checkpoint_with_a_special_file(tmp_path, kind, target):
    run = tmp_path / "run"
    manager = CheckpointManager(
        run, retention=RetentionPolicy(keep_last=None), preemption_signals=()
    )
    manager.save(1, _state(1), force=True)
    manager.save(2, _state(2), force=True)
    newest = Path(manager.path_for(2))
    _replace_with(_shard(newest) if target == "shard" else newest / target, kind)
    live = _state(7)
    with pytest.warns(UserWarning, match="falling back"):
        step = CheckpointManager(run, preemption_signals=()).restore(live)
    assert step == 1
    assert _digest(live) == _digest(_state(1))


# ---- every OS error on every read -------------------------------------------------------


class FailingOS:
    """Makes the k-th call of the OS functions the readers use raise ``OSError``."""

    NAMES = ("open", "preadv", "fstat", "stat", "scandir", "lstat")

    def __init__(self, monkeypatch, fail_at: int | None, errno_: int = errno.EIO) -> None:
        self.calls = 0
        self.fail_at = fail_at
        self.failed = False
        for name in self.NAMES:
            real = getattr(os, name)
            monkeypatch.setattr(os, name, self._wrap(real, errno_))

    def _wrap(self, real, errno_):
        def call(*args, **kwargs):
            self.calls += 1
            if self.calls == self.fail_at:
                self.failed = True
                raise OSError(errno_, os.strerror(errno_))
            return real(*args, **kwargs)

        return call


@pytest.mark.parametrize("errno_", [errno.EIO, errno.EACCES, errno.ELOOP])
def test_an_os_error_at_any_read_of_a_load_is_typed_and_leaves_the_state_unchanged(
    tmp_path, monkeypatch, errno_
):
    ckpt = tmp_path / "ckpt"
    shardpoint.save(_state(), ckpt, max_shard_size=20_000)  # several files
    expected = _digest(_state())
    with monkeypatch.context() as m:
        counter = FailingOS(m, None)
        shardpoint.load(_state(1), ckpt)
        total = counter.calls
    assert total > 10
    failures = 0
    for k in range(1, total + 1):
        live = _state(1)
        before = _digest(live)
        with monkeypatch.context() as m:
            injected = FailingOS(m, k, errno_)
            try:
                shardpoint.load(live, ckpt)
            except CheckpointError:
                failures += 1
                assert _digest(live) == before, f"call {k} failed the load but changed the state"
                continue
        # Tolerated only where an OS error is an answer (a page-cache probe says "not
        # cached"): then the load is complete.
        assert injected.failed
        assert _digest(live) == expected, f"call {k}"
    assert failures >= total // 2


def test_restore_falls_back_when_the_newest_checkpoint_cannot_be_read(tmp_path, monkeypatch):
    run = tmp_path / "run"
    manager = CheckpointManager(
        run, retention=RetentionPolicy(keep_last=None), preemption_signals=()
    )
    manager.save(1, _state(1), force=True)
    manager.save(2, _state(2), force=True)
    newest = str(manager.path_for(2))
    real_open = os.open

    def no_permission(path, flags, *args, **kwargs):
        if str(path).startswith(newest) and str(path).endswith(".safetensors"):
            raise PermissionError(errno.EACCES, "Permission denied", str(path))
        return real_open(path, flags, *args, **kwargs)

    monkeypatch.setattr(os, "open", no_permission)
    live = _state(7)
    with pytest.warns(UserWarning, match="Permission denied"):
        assert CheckpointManager(run, preemption_signals=()).restore(live) == 1
    assert _digest(live) == _digest(_state(1))


# ---- a failed load changes nothing ----------------------------------------------------


def _flip_byte_inside(ckpt: Path, name: str) -> None:
    with shardpoint.open(ckpt) as r:
        chunk = r.entry(name).chunks[0]
    path = ckpt / chunk.file
    data = bytearray(path.read_bytes())
    data[(chunk.begin + chunk.end) // 2] ^= 0xFF
    path.write_bytes(bytes(data))


def test_a_corrupt_second_tensor_leaves_every_tensor_unchanged(ckpt_dir):
    shardpoint.save(_state(), ckpt_dir)
    _flip_byte_inside(ckpt_dir, "b")  # "a" is read (and would be overwritten) first
    live = _state(1)
    before = _digest(live)
    with pytest.raises(CorruptCheckpointError, match="checksum mismatch"):
        shardpoint.load(live, ckpt_dir)
    assert _digest(live) == before


@pytest.mark.parametrize("corrupt", ["t11", "t0"])
def test_a_corrupt_tensor_read_in_later_batches_leaves_every_tensor_unchanged(
    ckpt_dir, monkeypatch, corrupt
):
    """Reads go in batches whose undo copies are taken ahead, while later batches are
    still planned: a failure in the last batch must put back the tensors of every
    earlier one, and one in the first must stop the batches after it."""
    import time

    from shardpoint import loading

    monkeypatch.setattr(loading, "UNDO_BATCH_BYTES", 4096)
    save_flat = loading.Undo._save_flat

    def slow_save_flat(self, views):  # a read that does not wait for its undo copy wins
        time.sleep(0.05)
        save_flat(self, views)

    monkeypatch.setattr(loading.Undo, "_save_flat", slow_save_flat)
    state = {f"t{i}": torch.randn(64, 16) for i in range(12)}
    shardpoint.save(state, ckpt_dir)
    _flip_byte_inside(ckpt_dir, corrupt)
    live = {k: torch.zeros_like(v) for k, v in state.items()}
    with pytest.raises(CorruptCheckpointError):
        shardpoint.load(live, ckpt_dir)
    assert all(not v.any() for v in live.values())


def test_restore_with_only_a_corrupt_checkpoint_returns_none_and_keeps_the_fresh_state(tmp_path):
    run = tmp_path / "run"
    CheckpointManager(run, preemption_signals=()).save(5, _state(5), force=True)
    _flip_byte_inside(run / "step-000000005", "b")
    live = _state(1)
    before = _digest(live)
    with pytest.warns(UserWarning):
        assert CheckpointManager(run, preemption_signals=()).restore(live) is None
    assert _digest(live) == before  # "from scratch" really is from scratch


def _model_and_optimizer(params: int):
    torch.manual_seed(0)
    model = torch.nn.Sequential(*[torch.nn.Linear(8, 8) for _ in range(params)])
    opt = torch.optim.AdamW(model.parameters(), lr=0.1)
    model(torch.randn(2, 8)).sum().backward()
    opt.step()
    return model, opt


def test_an_optimizer_over_fewer_parameters_is_refused_before_the_model_changes(ckpt_dir):
    model, opt = _model_and_optimizer(3)
    shardpoint.save({"model": model, "optim": opt}, ckpt_dir)
    small_model, small_opt = _model_and_optimizer(3)
    small_opt = torch.optim.AdamW(list(small_model.parameters())[:4], lr=0.1)
    with torch.no_grad():
        for p in small_model.parameters():
            p.fill_(0.5)
    with pytest.raises(StateMismatchError, match="parameter groups differ"):
        shardpoint.load({"model": small_model, "optim": small_opt}, ckpt_dir)
    assert all(bool((p == 0.5).all()) for p in small_model.parameters())


def test_a_train_state_with_an_optimizer_over_fewer_parameters_is_refused(ckpt_dir):
    model, opt = _model_and_optimizer(3)
    shardpoint.save(shardpoint.TrainState(model=model, optimizer=opt), ckpt_dir)
    other, _ = _model_and_optimizer(3)
    fewer = torch.optim.AdamW(list(other.parameters())[:2], lr=0.1)
    with torch.no_grad():
        for p in other.parameters():
            p.fill_(0.5)
    with pytest.raises(StateMismatchError, match="parameter groups differ"):
        shardpoint.load(shardpoint.TrainState(model=other, optimizer=fewer), ckpt_dir)
    assert all(bool((p == 0.5).all()) for p in other.parameters())


class _Counter:
    def __init__(self, n: int) -> None:
        self.n = n

    def state_dict(self) -> dict:
        return {"n": self.n}

    def load_state_dict(self, sd: dict) -> None:
        self.n = sd["n"]


class _Refuses(_Counter):
    def load_state_dict(self, sd: dict) -> None:
        self.n = -1  # half applied, then refused; its own earlier state it takes back
        if sd["n"] == 9:
            raise ValueError("not my kind of state")
        self.n = sd["n"]


def test_a_stateful_that_rejects_its_state_rolls_back_every_tensor_and_stateful(ckpt_dir):
    shardpoint.save({"w": torch.ones(1000), "first": _Counter(5), "z": _Counter(9)}, ckpt_dir)
    w = torch.zeros(1000)
    first, last = _Counter(1), _Refuses(2)
    with pytest.raises(StateMismatchError, match="not my kind"):
        shardpoint.load({"w": w, "first": first, "z": last}, ckpt_dir)
    assert not w.any()
    assert (first.n, last.n) == (1, 2)


def test_a_rejected_load_puts_plain_values_back_too(ckpt_dir):
    """All or nothing covers the values a load replaces (numbers, strings, lists,
    nested dicts), not only tensors and Statefuls: they were left as the checkpoint's."""
    shardpoint.save(
        {"step": 7, "cfg": {"name": "new", "lr": 0.1}, "hist": [1, 2, 3], "pair": [4, 5],
         "w": torch.ones(4), "z": _Counter(9)},
        ckpt_dir,
    )  # fmt: skip
    hist, pair, cfg = [0], [0, 0], {"name": "old", "lr": 1.0}
    state = {
        "step": 0,
        "cfg": cfg,
        "hist": hist,
        "pair": pair,
        "w": torch.zeros(4),
        "z": _Refuses(2),
    }
    with pytest.raises(StateMismatchError, match="not my kind"):
        shardpoint.load(state, ckpt_dir)
    assert state["step"] == 0 and state["cfg"] is cfg and cfg == {"name": "old", "lr": 1.0}
    assert state["hist"] is hist and hist == [0] and state["pair"] is pair and pair == [0, 0]
    assert not state["w"].any() and state["z"].n == 2


# ---- writes after the commit are best effort ------------------------------------------


def test_a_full_disk_for_the_event_log_fails_neither_the_save_nor_retention(tmp_path, monkeypatch):
    real_open = builtins.open

    def full(path, mode="r", *args, **kwargs):
        if str(path).endswith("events.jsonl") and "a" in mode:
            raise OSError(errno.ENOSPC, "No space left on device", str(path))
        return real_open(path, mode, *args, **kwargs)

    monkeypatch.setattr(builtins, "open", full)
    manager = CheckpointManager(
        tmp_path / "run", retention=RetentionPolicy(keep_last=1), preemption_signals=()
    )
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        for step in (1, 2, 3):
            assert manager.save(step, _state(step), force=True) is not None
    assert manager.steps() == [3]  # retention ran after every save
    assert sum("event log" in str(w.message) for w in caught) == 1  # said once, not per save


def test_retention_that_cannot_delete_does_not_fail_the_save(tmp_path, monkeypatch):
    manager = CheckpointManager(
        tmp_path / "run", retention=RetentionPolicy(keep_last=1), preemption_signals=()
    )
    manager.save(1, _state(1), force=True)

    def refuse(commit, keep=()):
        raise OSError(errno.EROFS, "Read-only file system")

    monkeypatch.setattr("shardpoint.commit.Commit.delete", refuse)
    with pytest.warns(UserWarning, match="cannot delete"):
        assert manager.save(2, _state(2), force=True) is not None
    assert manager.steps() == [1, 2]


# ---- read-only directories -----------------------------------------------------------


def _read_only(monkeypatch) -> None:
    """Every write, creation or deletion fails with EROFS, as on a read-only mount."""
    writes = os.O_WRONLY | os.O_RDWR | os.O_CREAT | os.O_TRUNC | os.O_APPEND

    def erofs(*args, **kwargs):
        raise OSError(errno.EROFS, "Read-only file system")

    real_open = os.open
    real_builtin_open = builtins.open

    def ro_open(path, flags, *args, **kwargs):
        if flags & writes:
            erofs()
        return real_open(path, flags, *args, **kwargs)

    def ro_builtin_open(file, mode="r", *args, **kwargs):
        if any(c in mode for c in "wax+"):
            erofs()
        return real_builtin_open(file, mode, *args, **kwargs)

    monkeypatch.setattr(os, "open", ro_open)
    monkeypatch.setattr(builtins, "open", ro_builtin_open)
    for name in ("unlink", "rmdir", "mkdir", "replace", "rename", "remove"):
        monkeypatch.setattr(os, name, erofs)


def test_restore_and_listing_work_on_a_read_only_directory_with_a_leftover(
    tmp_path, monkeypatch, capsys
):
    run = tmp_path / "run"
    CheckpointManager(run, preemption_signals=()).save(4, _state(4), force=True)
    leftover = run / "step-000000008"
    leftover.mkdir()
    (leftover / "rank00000-00000.safetensors").write_bytes(b"partial")
    _read_only(monkeypatch)
    live = _state(0)
    with warnings.catch_warnings(record=True):
        warnings.simplefilter("always")
        manager = CheckpointManager(run, preemption_signals=())
        assert manager.steps() == [4]
        assert manager.restore(live) == 4
        manager.close()
    assert _digest(live) == _digest(_state(4))
    assert leftover.exists()
    assert cli(["ls", str(run)]) == 0
    assert "step-000000004" in capsys.readouterr().out


# ---- two writers on one directory ----------------------------------------------------


def test_a_save_into_a_directory_another_process_is_saving_to_is_refused(tmp_path):
    ckpt = tmp_path / "ckpt"
    ckpt.mkdir()
    (ckpt / "rank00000-00000.safetensors").write_bytes(b"the other writer's bytes")
    other = LocalDirectory(ckpt).lock()
    other.acquire()  # flock: a second open file description conflicts, as another process
    try:
        with pytest.raises(ConcurrentWriterError, match="another process"):
            shardpoint.save(_state(), ckpt)
        with pytest.raises(ConcurrentWriterError):
            shardpoint.async_save(_state(), ckpt).wait()
        assert (ckpt / "rank00000-00000.safetensors").read_bytes() == b"the other writer's bytes"
    finally:
        other.release()
    shardpoint.save(_state(), ckpt)  # the lock went with its holder
    assert shardpoint.verify(ckpt).ok


def test_a_file_system_without_flock_saves_unguarded_with_one_warning(tmp_path, monkeypatch):
    """Lustre mounted ``noflock`` (and some FUSE mounts) answer ENOSYS: every save used
    to fail ("cannot prepare the checkpoint directory") and remove a directory the user
    had made for it."""
    import errno
    import warnings

    import shardpoint.storage.local as local

    def no_flock(fd, op):  # noqa: ANN001, ANN202
        raise OSError(errno.ENOSYS, "Function not implemented")

    monkeypatch.setattr(local.fcntl, "flock", no_flock)
    monkeypatch.setattr(local, "_WARNED_NO_LOCK", set())
    with pytest.warns(UserWarning, match="no flock"):
        shardpoint.save(_state(), tmp_path / "a")
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # said once per directory of checkpoints
        shardpoint.save(_state(), tmp_path / "b")
    assert shardpoint.verify(tmp_path / "a").ok and shardpoint.verify(tmp_path / "b").ok


def test_retention_never_deletes_a_directory_another_process_is_saving_to(tmp_path):
    run = tmp_path / "run"
    manager = CheckpointManager(
        run, retention=RetentionPolicy(keep_last=None), preemption_signals=()
    )
    manager.save(1, _state(1), force=True)
    lock = LocalDirectory(manager.path_for(1)).lock()
    lock.acquire()
    try:
        with pytest.raises(ConcurrentWriterError):
            manager.tier.delete(1)
    finally:
        lock.release()
    assert shardpoint.verify(manager.path_for(1)).ok


def test_a_directory_replaced_while_it_is_being_locked_is_locked_again(tmp_path, monkeypatch):
    """Another process may remove an empty step directory (its clean-up) between our
    mkdir and our flock, and a third create it again: a lock on the removed one would
    guard nothing. The save notices, locks the directory at the path, and goes on."""
    import fcntl

    from shardpoint.storage import local

    path = tmp_path / "ckpt"
    real = fcntl.flock
    replaced = []

    def flock(fd, op):  # noqa: ANN001, ANN202
        if not replaced:  # the first lock: its directory is swapped under it
            replaced.append(True)
            path.rename(tmp_path / "gone")
            path.mkdir()
        return real(fd, op)

    refused = []
    write_files = LocalDirectory.write_files

    def write_while_checking_the_lock(self, *args, **kwargs):  # noqa: ANN001, ANN002, ANN003, ANN202
        try:  # a second writer of the directory at the path must be refused now
            LocalDirectory(path).lock().acquire()
        except ConcurrentWriterError:
            refused.append(True)
        return write_files(self, *args, **kwargs)

    monkeypatch.setattr(local.fcntl, "flock", flock)
    monkeypatch.setattr(LocalDirectory, "write_files", write_while_checking_the_lock)
    shardpoint.save({"w": torch.ones(3)}, path)
    assert replaced and refused == [True]
    assert shardpoint.verify(path).ok


_RACER = """
import sys, torch, shardpoint
from shardpoint.errors import CheckpointExistsError, ConcurrentWriterError
run, who = sys.argv[1], sys.argv[2]
manager = shardpoint.CheckpointManager(
    run, retention=shardpoint.RetentionPolicy(keep_last=None), preemption_signals=()
)
for step in range(1, 26):
    state = {"w": torch.full((2000,), float(step)), "who": who}
    try:
        saved = manager.save(step, state, force=True)  # None: already committed
        print("ok" if saved is not None else "present", step, flush=True)
    except (ConcurrentWriterError, CheckpointExistsError):
        print("refused", step, flush=True)
"""


@pytest.mark.slow
def test_two_processes_saving_the_same_steps_never_report_a_checkpoint_that_is_not_there(
    tmp_path,
):
    run = tmp_path / "run"
    procs = [
        subprocess.Popen(
            [sys.executable, "-c", _RACER, str(run), who], stdout=subprocess.PIPE, text=True
        )
        for who in ("A", "B")
    ]
    outputs = [p.communicate(timeout=100)[0] for p in procs]
    assert [p.returncode for p in procs] == [0, 0], outputs
    reported = {
        (who, int(line.split()[1]))
        for who, out in zip("AB", outputs)
        for line in out.splitlines()
        if line.startswith("ok")
    }
    assert reported
    for who, step in reported:
        path = run / f"step-{step:09d}"
        assert shardpoint.verify(path).ok, (who, step)
        with shardpoint.open(path) as r:
            assert r.state(tensors=False)["who"] == who  # the save that reported it
            assert bool((r.get("w") == step).all())
    assert {step for _, step in reported} == set(range(1, 26))  # one per step went through


# ---- sizes and modes -----------------------------------------------------------------


def test_a_huge_sparse_index_is_refused_before_it_is_read(ckpt_dir, capsys):
    shardpoint.save(_state(), ckpt_dir)
    with open(ckpt_dir / INDEX_NAME, "r+b") as f:
        f.truncate(4 * 1024**3)  # sparse: costs no disk, would cost 4 GB of memory
    with pytest.raises(CorruptCheckpointError, match="over the limit"):
        shardpoint.open(ckpt_dir)
    assert cli(["ls", str(ckpt_dir.parent)]) == 0
    assert "over the limit" in capsys.readouterr().out


def test_shard_files_are_not_executable(tmp_path):
    shardpoint.save(_state(), tmp_path / "sync")
    shardpoint.async_save(_state(), tmp_path / "async").wait()
    for path in [*tmp_path.glob("*/*.safetensors"), *tmp_path.glob("*/*.json")]:
        assert stat.S_IMODE(path.stat().st_mode) & 0o111 == 0, path


def test_a_lone_surrogate_or_an_unrepresentable_shape_is_refused_at_save_time(tmp_path):
    """Refused up front with the path, not after the shards are written, and never a
    checkpoint the readers would call damaged."""
    with pytest.raises(shardpoint.UnsupportedValueError, match="surrogate"):
        shardpoint.save({"w\ud800": torch.ones(2)}, tmp_path / "a")
    with pytest.raises(shardpoint.UnsupportedValueError, match="surrogate"):
        shardpoint.save({"w": torch.ones(2), "note": "x\udcff"}, tmp_path / "b")
    with pytest.raises(shardpoint.UnsupportedValueError, match="2\\*\\*63"):
        shardpoint.save({"w": torch.empty(0, 2**62)}, tmp_path / "c")
    assert not any(tmp_path.glob("*/*.safetensors"))


def test_atomic_false_loads_the_same_values_without_an_undo_copy(ckpt_dir, monkeypatch):
    from shardpoint import loading

    shardpoint.save(_state(), ckpt_dir)
    kept_at_the_end: list = []  # tensors each load's undo copy held when released
    release = loading.Undo.release

    def recording(self):
        kept_at_the_end.append(sum(len(live) for live, _ in self._saved))
        release(self)

    monkeypatch.setattr(loading.Undo, "release", recording)
    for atomic, kept in ((False, 0), (True, 3)):  # the three tensors of _state()
        kept_at_the_end.clear()
        live = _state(1)
        shardpoint.load(live, ckpt_dir, atomic=atomic)
        assert _digest(live) == _digest(_state())
        assert kept_at_the_end == [kept]
