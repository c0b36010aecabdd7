"""Damaged, incomplete and hostile checkpoints raise typed errors; nothing is loaded silently."""

import errno
import json
import os

import pytest
import torch
from conftest import rewrite_index, sample_state

import shardpoint
from shardpoint.errors import (
    CheckpointError,
    CheckpointExistsError,
    CorruptCheckpointError,
    IncompleteCheckpointError,
)
from shardpoint.format.index import INDEX_NAME, MARKER_NAME


def _dest():
    return {
        "a": torch.zeros(64, 32),
        "b": {"c": torch.zeros(10, dtype=torch.int64), "d": torch.zeros(3, dtype=torch.float64)},
        "step": 0,
    }


def _shard(path):
    (shard,) = path.glob("*.safetensors")
    return shard


def _all_readers_fail(path, error=CorruptCheckpointError, match=None):
    with pytest.raises(error, match=match):
        shardpoint.load(_dest(), path)
    with pytest.raises(error, match=match):
        with shardpoint.open(path) as r:
            r.get("a")
            r.get("b.c")
            r.get("b.d")
    assert not shardpoint.verify(path).ok


def test_a_flipped_byte_in_tensor_data_is_caught_and_names_the_file(ckpt_dir):
    shardpoint.save(sample_state(), ckpt_dir)
    shard = _shard(ckpt_dir)
    raw = bytearray(shard.read_bytes())
    raw[-5] ^= 0x01
    shard.write_bytes(raw)
    _all_readers_fail(ckpt_dir, match=shard.name)
    report = shardpoint.verify(ckpt_dir)
    assert [f.ok for f in report.files] == [False] and "checksum mismatch" in report.files[
        0
    ].errors[0]


@pytest.mark.parametrize("pos", [0, 3, 8, 20, 60])
def test_a_flipped_byte_in_the_header_is_caught(ckpt_dir, pos):
    shardpoint.save(sample_state(), ckpt_dir)
    shard = _shard(ckpt_dir)
    raw = bytearray(shard.read_bytes())
    raw[pos] ^= 0x41
    shard.write_bytes(raw)
    _all_readers_fail(ckpt_dir)


def _rewrite_header_value(shard, old: bytes, new: bytes) -> None:
    """Replace ``old`` by ``new`` (same length) in the shard's header: the file stays a
    valid safetensors file whose slots still agree with the index."""
    raw = shard.read_bytes()
    n = int.from_bytes(raw[:8], "little")
    assert len(old) == len(new) and raw[8 : 8 + n].count(old) == 1
    shard.write_bytes(raw[:8] + raw[8 : 8 + n].replace(old, new) + raw[8 + n :])


def test_a_load_checks_each_shard_header_by_its_checksum_in_the_index(ckpt_dir):
    """The index records each shard file's header checksum, so a load compares it
    instead of parsing the header: a header edited anywhere (here only its metadata,
    which slot-by-slot parsing would accept) is refused before a byte of data is read,
    and the state is untouched."""
    shardpoint.save(sample_state(), ckpt_dir)
    shard = _shard(ckpt_dir)
    files = json.loads((ckpt_dir / INDEX_NAME).read_text())["files"]
    assert len(files[shard.name]["header"]) == 16
    _rewrite_header_value(shard, b'"format":"pt"', b'"format":"xx"')
    dest = _dest()
    before = {k: v.clone() for k, v in [("a", dest["a"]), ("c", dest["b"]["c"])]}
    with pytest.raises(CorruptCheckpointError, match=f"{shard.name}: its header does not match"):
        shardpoint.load(dest, ckpt_dir)
    assert torch.equal(dest["a"], before["a"]) and torch.equal(dest["b"]["c"], before["c"])
    report = shardpoint.verify(ckpt_dir)  # says what a load would find
    assert not report.ok and "its header does not match" in report.files[0].errors[0]


def test_without_header_checksums_a_load_parses_every_header(ckpt_dir):
    """An index from an earlier release has no header checksums: each header is parsed
    and its slots compared with the index, as before."""
    shardpoint.save(sample_state(), ckpt_dir)
    shard = _shard(ckpt_dir)

    def earlier_release(doc):
        for info in doc["files"].values():
            info.pop("header", None)

    rewrite_index(ckpt_dir, earlier_release)
    shardpoint.load(_dest(), ckpt_dir)  # parsed, and it agrees
    _rewrite_header_value(shard, b'"dtype":"I64"', b'"dtype":"U64"')
    slot = f"{shard.name}: its header does not match {INDEX_NAME} for 'b.c'"
    with pytest.raises(CorruptCheckpointError, match=slot):
        shardpoint.load(_dest(), ckpt_dir)


@pytest.mark.parametrize("keep", [0, 7, 100, -1])
def test_a_truncated_shard_is_caught(ckpt_dir, keep):
    shardpoint.save(sample_state(), ckpt_dir)
    shard = _shard(ckpt_dir)
    raw = shard.read_bytes()
    shard.write_bytes(raw[: keep if keep >= 0 else len(raw) - 1])
    _all_readers_fail(ckpt_dir, match="bytes, expected")


def test_a_missing_shard_is_caught(ckpt_dir):
    shardpoint.save(sample_state(), ckpt_dir)
    _shard(ckpt_dir).unlink()
    _all_readers_fail(ckpt_dir, match="missing")


def test_swapped_shards_are_caught(ckpt_dir):
    state = {"x": torch.randn(100), "y": torch.randn(100)}
    shardpoint.save(state, ckpt_dir, max_shard_size=400)
    a, b = sorted(ckpt_dir.glob("*.safetensors"))
    ra, rb = a.read_bytes(), b.read_bytes()
    a.write_bytes(rb)
    b.write_bytes(ra)
    with pytest.raises(CorruptCheckpointError, match="header does not match"):
        shardpoint.load({"x": torch.zeros(100), "y": torch.zeros(100)}, ckpt_dir)
    assert not shardpoint.verify(ckpt_dir).ok


def test_an_index_replaced_by_another_checkpoints_index_is_caught(tmp_path):
    shardpoint.save({"a": torch.ones(4)}, tmp_path / "old")
    shardpoint.save({"a": torch.zeros(4)}, tmp_path / "new")
    (tmp_path / "new" / INDEX_NAME).write_bytes((tmp_path / "old" / INDEX_NAME).read_bytes())
    with pytest.raises(CorruptCheckpointError, match="does not match the index that was committed"):
        shardpoint.load({"a": torch.empty(4)}, tmp_path / "new")


def test_a_damaged_index_is_caught(ckpt_dir):
    shardpoint.save(sample_state(), ckpt_dir)
    (ckpt_dir / INDEX_NAME).write_bytes(b'{"format": "shardp')
    _all_readers_fail(ckpt_dir)


def test_a_directory_without_commit_marker_is_not_a_checkpoint(ckpt_dir):
    shardpoint.save(sample_state(), ckpt_dir)
    (ckpt_dir / MARKER_NAME).unlink()
    _all_readers_fail(ckpt_dir, IncompleteCheckpointError, match="no commit marker")


def test_a_missing_directory_is_reported(tmp_path):
    with pytest.raises(IncompleteCheckpointError, match="no such checkpoint"):
        shardpoint.load({}, tmp_path / "nope")


@pytest.mark.parametrize(
    "bad", ["../outside.safetensors", "/etc/passwd", "sub/x.safetensors", "..", ""]
)
def test_an_index_pointing_outside_its_directory_is_refused_before_any_read(
    ckpt_dir, bad, monkeypatch
):
    shardpoint.save(sample_state(), ckpt_dir)
    good = _shard(ckpt_dir).name

    def point_outside(doc):
        doc["files"] = {bad: doc["files"][good]}
        for entry in doc["tensors"].values():
            for chunk in entry["chunks"]:
                chunk["file"] = bad

    rewrite_index(ckpt_dir, point_outside)
    opened = []
    real_open = os.open
    monkeypatch.setattr(
        os, "open", lambda p, *a, **k: opened.append(str(p)) or real_open(p, *a, **k)
    )
    _all_readers_fail(ckpt_dir, match="refusing file name")
    assert not [p for p in opened if p.endswith(".safetensors") or bad and bad in p]


def test_a_symlink_escaping_the_directory_is_refused(tmp_path):
    outside = tmp_path / "elsewhere"
    shardpoint.save(sample_state(), outside)
    ckpt = tmp_path / "ckpt"
    shardpoint.save(sample_state(), ckpt)
    shard = _shard(ckpt)
    shard.unlink()
    shard.symlink_to(_shard(outside))
    _all_readers_fail(ckpt, match="symlink points outside")


@pytest.mark.parametrize(
    "mutate, match",
    [
        (lambda d: d.update(format_version=99), "upgrade shardpoint"),
        (lambda d: d.update(format="other"), "not a shardpoint index"),
        (lambda d: d["tensors"]["a"]["chunks"][0].update(byte_range=[0, 10]), "byte_range"),
        (lambda d: d["tensors"]["a"]["chunks"][0].update(shape=[64, 33]), "outside its shape"),
        (lambda d: d["tensors"]["a"]["chunks"][0].update(offsets=[1, 0]), "outside its shape"),
        (lambda d: d["tensors"]["a"]["chunks"][0].update(checksums=["zz"]), "malformed checksums"),
        (lambda d: d["tensors"]["a"].update(dtype="F99"), "unknown dtype"),
        (lambda d: d["tensors"].pop("a"), "disagree"),
        (lambda d: d["tensors"].update(z={"alias_of": "nope"}), "missing entry"),
        (
            lambda d: d["tensors"]["a"]["chunks"].append(d["tensors"]["a"]["chunks"][0]),
            "do not cover",
        ),
        (lambda d: d["tree"].update(bogus=1), "malformed"),
        (lambda d: d["files"].clear(), "not listed"),
        (lambda d: d.update(tensors=[]), "malformed index"),
    ],
)
def test_inconsistent_index_fields_are_refused(ckpt_dir, mutate, match):
    shardpoint.save(sample_state(), ckpt_dir)
    rewrite_index(ckpt_dir, mutate)
    with pytest.raises(CorruptCheckpointError, match=match):
        shardpoint.load(_dest(), ckpt_dir)


def test_a_committed_checkpoint_is_never_overwritten(ckpt_dir):
    shardpoint.save({"a": torch.ones(3)}, ckpt_dir)
    before = {p.name: p.read_bytes() for p in ckpt_dir.iterdir()}
    with pytest.raises(CheckpointExistsError):
        shardpoint.save({"a": torch.zeros(3)}, ckpt_dir)
    assert {p.name: p.read_bytes() for p in ckpt_dir.iterdir()} == before


def test_leftovers_of_a_crashed_save_are_cleared_by_the_next_save(ckpt_dir):
    shardpoint.save({"a": torch.ones(3)}, ckpt_dir)
    (ckpt_dir / MARKER_NAME).unlink()  # as if the process died before committing
    (ckpt_dir / "index.json.tmp").write_bytes(b"partial")
    shardpoint.save({"a": torch.full((3,), 2.0)}, ckpt_dir)
    dest = {"a": torch.empty(3)}
    shardpoint.load(dest, ckpt_dir)
    assert dest["a"].tolist() == [2.0, 2.0, 2.0]
    assert not (ckpt_dir / "index.json.tmp").exists()


def test_a_directory_with_foreign_files_is_not_cleared(ckpt_dir):
    ckpt_dir.mkdir()
    (ckpt_dir / "notes.txt").write_text("mine")
    with pytest.raises(CheckpointError, match="not from an unfinished"):
        shardpoint.save({"a": torch.ones(3)}, ckpt_dir)
    assert (ckpt_dir / "notes.txt").read_text() == "mine"


@pytest.mark.parametrize("fail_at", ["shard", "index", "marker"])
def test_a_full_disk_fails_cleanly_and_keeps_earlier_checkpoints(tmp_path, monkeypatch, fail_at):
    import shardpoint.storage.local as local

    shardpoint.save({"a": torch.ones(1000)}, tmp_path / "step1")
    real_pwrite = os.pwrite
    target = {"shard": ".safetensors", "index": "index.json", "marker": MARKER_NAME}[fail_at]
    fds = {}
    real_open = os.open

    def tracking_open(p, *a, **k):
        fd = real_open(p, *a, **k)
        fds[fd] = str(p)
        return fd

    def failing_pwrite(fd, data, offset):
        if target in fds.get(fd, ""):
            raise OSError(errno.ENOSPC, "No space left on device")
        return real_pwrite(fd, data, offset)

    monkeypatch.setattr(local.os, "open", tracking_open)
    monkeypatch.setattr(local.os, "pwrite", failing_pwrite)
    with pytest.raises(CheckpointError, match="No space left"):
        shardpoint.save({"a": torch.zeros(1000)}, tmp_path / "step2")
    monkeypatch.undo()
    assert not (tmp_path / "step2").exists()
    dest = {"a": torch.empty(1000)}
    shardpoint.load(dest, tmp_path / "step1")
    assert torch.equal(dest["a"], torch.ones(1000))


def _writes_of_one_save(tmp_path) -> int:
    """How many pwrite/fsync/replace calls one save of the test state makes."""
    calls = [0]
    real = {name: getattr(os, name) for name in ("pwrite", "fsync", "replace")}

    def counting(name):
        def call(*args, **kwargs):
            calls[0] += 1
            return real[name](*args, **kwargs)

        return call

    for name in real:
        setattr(os, name, counting(name))
    try:
        shardpoint.save(_io_state(), tmp_path / "probe", max_shard_size=4000)
    finally:
        for name, fn in real.items():
            setattr(os, name, fn)
    return calls[0]


def _io_state():
    return {f"t{i}": torch.full((700,), float(i)) for i in range(4)} | {"step": 1}


@pytest.mark.parametrize("code", [errno.ENOSPC, errno.EIO])
def test_an_io_error_at_every_write_call_fails_cleanly(tmp_path, monkeypatch, code):
    shardpoint.save({"a": torch.ones(10)}, tmp_path / "earlier")
    total = _writes_of_one_save(tmp_path)
    assert total >= 10
    for k in range(1, total + 1):
        calls = [0]
        real = {name: getattr(os, name) for name in ("pwrite", "fsync", "replace")}

        def failing(name, real=real, calls=calls, k=k):
            def call(*args, **kwargs):
                calls[0] += 1
                if calls[0] == k:
                    raise OSError(code, os.strerror(code))
                return real[name](*args, **kwargs)

            return call

        for name in real:
            monkeypatch.setattr(os, name, failing(name))
        target = tmp_path / f"attempt{k}"
        with pytest.raises(CheckpointError, match=os.strerror(code)):
            shardpoint.save(_io_state(), target, max_shard_size=4000)
        monkeypatch.undo()
        assert not target.exists(), (k, sorted(p.name for p in target.iterdir()))
    dest = {"a": torch.zeros(10)}
    shardpoint.load(dest, tmp_path / "earlier")
    assert torch.equal(dest["a"], torch.ones(10))


def test_a_failure_that_is_not_an_io_error_also_leaves_nothing(tmp_path, monkeypatch):
    import shardpoint.write_phase as write_phase

    def broken_checksums(*args, **kwargs):
        raise RuntimeError("checksum worker crashed")

    monkeypatch.setattr(write_phase, "block_checksums", broken_checksums)
    with pytest.raises(CheckpointError, match="checksum worker crashed"):
        shardpoint.save({"a": torch.ones(10)}, tmp_path / "ckpt")
    assert not (tmp_path / "ckpt").exists()


def test_verify_reads_each_shard_header_once(tmp_path, monkeypatch):
    """Parsing a header and comparing its checksum with the index need one read of it
    (on an object store every read is a request)."""
    from shardpoint.names import is_fragment
    from shardpoint.storage.local import LocalDirectory

    path = tmp_path / "ckpt"
    shardpoint.save({f"t{i}": torch.randn(8) for i in range(5)}, path, max_shard_size=64)
    starts = []
    real = LocalDirectory.read_range

    def counting(self, name, lo, hi):
        starts.append((name, lo))
        return real(self, name, lo, hi)

    monkeypatch.setattr(LocalDirectory, "read_range", counting)
    assert shardpoint.verify(path).ok
    shards = [p.name for p in path.glob("*.safetensors") if not is_fragment(p.name)]
    assert len(shards) > 1
    assert sorted(n for n, lo in starts if lo == 0 and n in shards) == sorted(shards)
