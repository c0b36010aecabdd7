"""shardpoint.open reads only what it is asked for."""

import os

import pytest
import torch

import shardpoint
import shardpoint.storage.local as local


@pytest.fixture
def big(ckpt_dir):
    torch.manual_seed(1)
    state = {f"layer{i}": torch.randn(256, 128) for i in range(8)}
    state["scalar"] = torch.tensor(2.5)
    state["huge"] = torch.randn(4096, 256)  # 4 MB: 16 checksum blocks of 256 rows
    state["meta"] = {"step": 11, "name": "run"}
    shardpoint.save(state, ckpt_dir, metadata={"note": "hi"})
    return state


@pytest.fixture
def bytes_read(monkeypatch):
    """Tensor bytes read: reads inside the header (parsed once per file) are not counted."""
    counter = {"n": 0}
    real = os.preadv

    def counting(fd, buffers, offset, *flags):
        n = real(fd, buffers, offset, *flags)
        header_end = 8 + int.from_bytes(os.pread(fd, 8, 0), "little")
        if not flags and offset >= header_end:  # flagged calls are 1-byte cache probes
            counter["n"] += n
        return n

    monkeypatch.setattr(local.os, "preadv", counting)
    return counter


def test_get_reads_one_tensor_and_nothing_else(ckpt_dir, big, bytes_read):
    with shardpoint.open(ckpt_dir) as r:
        t = r.get("layer3")
    assert torch.equal(t, big["layer3"])
    assert bytes_read["n"] == 256 * 128 * 4


def test_unverified_get_slice_reads_exactly_the_rows_it_needs(ckpt_dir, big, bytes_read):
    with shardpoint.open(ckpt_dir) as r:
        s = r.get_slice("layer5", verify=False)
        assert s.shape == (256, 128) and s.dtype == torch.float32
        part = s[10:20, 5:9]
    assert torch.equal(part, big["layer5"][10:20, 5:9])
    assert bytes_read["n"] == 10 * 128 * 4


def test_verified_get_slice_reads_the_checksum_block_around_its_rows(ckpt_dir, big, bytes_read):
    with shardpoint.open(ckpt_dir) as r:
        part = r.get_slice("huge")[1000:1010]
    assert torch.equal(part, big["huge"][1000:1010])
    assert bytes_read["n"] == 256 * 256 * 4  # one block of 256 rows, not the 4 MB tensor


def test_verified_get_slice_catches_a_corrupt_block(ckpt_dir, big):
    with shardpoint.open(ckpt_dir) as r:
        (chunk,) = r.entry("huge").chunks
        (shard,) = ckpt_dir.glob("*.safetensors")
    raw = bytearray(shard.read_bytes())
    raw[chunk.begin + 1005 * 256 * 4] ^= 0x01  # inside row 1005
    shard.write_bytes(raw)
    with shardpoint.open(ckpt_dir) as r:
        with pytest.raises(shardpoint.CorruptCheckpointError, match="checksum mismatch in 'huge'"):
            r.get_slice("huge")[1000:1010]
        assert torch.equal(r.get_slice("huge")[0:10], big["huge"][0:10])  # other blocks are fine


@pytest.mark.parametrize(
    "index",
    [
        0,
        -1,
        slice(None),
        (slice(3, 50, 7), 2),
        (Ellipsis, 1),
        (Ellipsis,),
        (slice(5, 2),),
        (slice(-10, None), slice(None, None, 3)),
    ],
)
def test_get_slice_matches_torch_indexing(ckpt_dir, big, index):
    with shardpoint.open(ckpt_dir) as r:
        assert torch.equal(r.get_slice("layer0")[index], big["layer0"][index])


def test_get_slice_of_a_scalar(ckpt_dir, big):
    with shardpoint.open(ckpt_dir) as r:
        assert r.get_slice("scalar")[...].item() == 2.5


def test_keys_metadata_and_values_come_from_the_index_alone(ckpt_dir, big, bytes_read):
    with shardpoint.open(ckpt_dir) as r:
        assert r.keys() == [f"layer{i}" for i in range(8)] + ["scalar", "huge"]
        assert "layer1" in r and "nope" not in r
        assert r.metadata["user"] == {"note": "hi"} and r.metadata["format_version"] == 2
        values = r.state(tensors=False)
    assert values["meta"] == {"step": 11, "name": "run"}
    assert values["layer0"].shape == (256, 128)
    assert bytes_read["n"] == 0


def test_unknown_names_raise_key_error_naming_the_checkpoint(ckpt_dir, big):
    with shardpoint.open(ckpt_dir) as r, pytest.raises(KeyError, match="layer9"):
        r.get("layer9")


def test_user_metadata_is_written_as_json_writes_it_and_nan_is_refused(tmp_path):
    """The index is encoded with msgspec, which would write NaN as null: user metadata
    goes through json, so NaN is refused (nothing committed) and an int key is kept as
    json keeps it."""
    from shardpoint.errors import CheckpointError

    state = {"w": torch.ones(2)}
    with pytest.raises(CheckpointError, match="Out of range float"):
        shardpoint.save(state, tmp_path / "nan", metadata={"loss": float("nan")})
    assert not (tmp_path / "nan").exists()
    shardpoint.save(state, tmp_path / "ok", metadata={1: "int key", "big": 1e16, "é": [None]})
    with shardpoint.open(tmp_path / "ok") as r:
        assert r.metadata["user"] == {"1": "int key", "big": 1e16, "é": [None]}
