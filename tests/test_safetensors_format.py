"""Shard files are plain safetensors: golden bytes, reference-library interop, strict parsing."""

import math
import struct

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from safetensors import safe_open
from safetensors.torch import save_file

import shardpoint
from shardpoint.errors import CorruptCheckpointError
from shardpoint.format.safetensors import (
    DTYPES,
    MAX_HEADER_BYTES,
    Header,
    encode_header,
    header_length,
    parse_header,
)

GOLDEN_HEADER = (
    b'{"__metadata__":{"format":"pt"},"x":{"dtype":"F32","shape":[2],"data_offsets":[0,8]}}'
)
GOLDEN_FILE = (
    b"\x58\x00\x00\x00\x00\x00\x00\x00"  # header length 88, u64 little-endian
    + GOLDEN_HEADER
    + b"   "  # padded with spaces to a multiple of 8
    + bytes.fromhex("0000803f")  # 1.0f
    + bytes.fromhex("00000040")  # 2.0f
)


def test_single_tensor_file_matches_golden_bytes(ckpt_dir):
    shardpoint.save({"x": torch.tensor([1.0, 2.0])}, ckpt_dir)
    (shard,) = ckpt_dir.glob("*.safetensors")
    assert shard.read_bytes() == GOLDEN_FILE


def test_every_shard_opens_with_reference_library(ckpt_dir):
    state = {
        "w": torch.randn(8, 8),
        "h": torch.randn(5).half(),
        "nested": {"i": torch.arange(7, dtype=torch.int32)},
        "bf": torch.randn(3, 3).bfloat16(),
    }
    shardpoint.save(state, ckpt_dir, max_shard_size=200)
    shards = sorted(ckpt_dir.glob("*.safetensors"))
    assert len(shards) > 1
    seen = {}
    for shard in shards:
        with safe_open(str(shard), framework="pt") as f:
            assert f.metadata() == {"format": "pt"}
            for key in f.keys():
                seen[key] = f.get_tensor(key)
    assert set(seen) == {"w", "h", "nested.i", "bf"}
    assert torch.equal(seen["w"], state["w"])
    assert torch.equal(seen["nested.i"], state["nested"]["i"])
    assert torch.equal(seen["bf"], state["bf"])


def test_file_written_by_reference_library_parses(tmp_path):
    tensors = {
        "a": torch.randn(4, 5),
        "b": torch.zeros(0, 3),
        "c": torch.tensor(3, dtype=torch.int8),
    }
    path = tmp_path / "ref.safetensors"
    save_file(tensors, str(path), metadata={"k": "v"})
    raw = path.read_bytes()
    n = header_length(raw[:8], len(raw), str(path))
    header = parse_header(raw[8 : 8 + n], len(raw), str(path))
    assert header.metadata == {"k": "v"}
    for name, t in tensors.items():
        slot = header.slots[name]
        data = raw[header.data_start + slot.begin : header.data_start + slot.end]
        got = (
            torch.frombuffer(bytearray(data), dtype=t.dtype)
            if data
            else torch.empty(0, dtype=t.dtype)
        )
        assert torch.equal(got.reshape(t.shape), t)


def _file(header: bytes, data: bytes = b"") -> bytes:
    return struct.pack("<Q", len(header)) + header + data


def _parse(raw: bytes):
    n = header_length(raw[:8], len(raw), "f")
    return parse_header(raw[8 : 8 + n], len(raw), "f")


@pytest.mark.parametrize(
    "raw, why",
    [
        (b"\x01\x00", "shorter than"),
        (struct.pack("<Q", MAX_HEADER_BYTES + 1), "exceeds"),
        (struct.pack("<Q", 100) + b"{}", "runs past the end"),
        (_file(b"\xff\xfe"), "not UTF-8"),
        (_file(b"[1,2]   "), "does not start"),
        (_file(b"{nope}  "), "not valid JSON"),
        (
            _file(
                b'{"a":{"dtype":"F32","shape":[1],"data_offsets":[0,4]},"a":{"dtype":"F32","shape":[1],"data_offsets":[0,4]}}',
                b"\0" * 4,
            ),
            "duplicate",
        ),
        (
            _file(b'{"a":{"dtype":"X9","shape":[1],"data_offsets":[0,4]}}', b"\0" * 4),
            "unknown dtype",
        ),
        (
            _file(b'{"a":{"dtype":"F32","shape":[-1],"data_offsets":[0,4]}}', b"\0" * 4),
            "invalid shape",
        ),
        (_file(b'{"a":{"dtype":"F32","shape":[2],"data_offsets":[0,4]}}', b"\0" * 4), "needs 8"),
        (_file(b'{"a":{"dtype":"F32","shape":[1],"data_offsets":[0,8]}}', b"\0" * 4), "outside"),
        (_file(b'{"a":{"dtype":"F32","shape":[1],"data_offsets":[4,8]}}', b"\0" * 8), "gap"),
        (
            _file(
                b'{"a":{"dtype":"F32","shape":[1],"data_offsets":[0,4]},"b":{"dtype":"F32","shape":[2],"data_offsets":[0,8]}}',
                b"\0" * 8,
            ),
            "overlaps",
        ),
        (
            _file(b'{"a":{"dtype":"F32","shape":[1],"data_offsets":[0,4]}}', b"\0" * 12),
            "cover 4 bytes",
        ),
        (
            _file(b'{"a":{"dtype":"F32","shape":[1],"data_offsets":[0,4],"x":1}}', b"\0" * 4),
            "exactly",
        ),
        (_file(b'{"__metadata__":{"k":1}}'), "__metadata__"),
        # found by the fuzz target: an unhashable dtype used to escape as TypeError
        (
            _file(b'{"a":{"dtype":[0,4],"shape":[1],"data_offsets":[0,4]}}', b"\0" * 4),
            "unknown dtype",
        ),
        (
            _file(b'{"a":{"dtype":"F32","shape":[true],"data_offsets":[0,4]}}', b"\0" * 4),
            "invalid shape",
        ),
        (
            _file(
                b'{"a":{"dtype":"F32","shape":[99999999999,99999999999],"data_offsets":[0,4]}}',
                b"\0" * 4,
            ),
            "too large for 64-bit sizes",
        ),
        # issue 14: sizes must fit in int64, even next to a zero dimension
        (
            _file(b'{"a":{"dtype":"F32","shape":[0,1180591620717411303424],"data_offsets":[0,0]}}'),
            r"invalid shape \[0, 1180591620717411303424\]",
        ),
        (
            _file(b'{"a":{"dtype":"F32","shape":[0,4611686018427387904],"data_offsets":[0,0]}}'),
            "too large for 64-bit sizes",
        ),
        (
            _file(b'{"a":{"dtype":"U8","shape":[9223372036854775808,0],"data_offsets":[0,0]}}'),
            "invalid shape",
        ),
        (_file(b'{"a":{"dtype":"F32","shape":[1.0],"data_offsets":[0,4]}}', b"\0" * 4), "shape"),
        (
            _file(b'{"a":{"dtype":"F32","shape":[1],"data_offsets":[0,4.0]}}', b"\0" * 4),
            "data_offsets",
        ),
        (
            _file(b'{"a":{"dtype":"F32","shape":[0],"data_offsets":[-1,-1]}}', b"\0" * 4),
            "data_offsets",
        ),
        (
            _file(b'{"__metadata__":{"format":"\\ud800"}}'),
            "not valid Unicode",
        ),
        (
            _file(b'{"\\udc80":{"dtype":"F32","shape":[1],"data_offsets":[0,4]}}', b"\0" * 4),
            "UTF-8",
        ),
    ],
)
def test_strict_parser_rejects_malformed_headers(raw, why):
    with pytest.raises(CorruptCheckpointError, match=why):
        _parse(raw)


def _assert_consistent(header: Header, raw: bytes) -> None:
    """What a parsed header promises its readers, checked here without the parser's code:
    the data starts right after the header, every slot's byte length is its shape times
    its item size, the slots tile the data section exactly (no gap, no overlap, nothing
    past the end), and writing the header again parses back to the same slots."""
    (n,) = struct.unpack("<Q", raw[:8])
    assert header.data_start == 8 + n
    data = raw[header.data_start :]
    assert all(type(k) is str and type(v) is str for k, v in header.metadata.items())
    for name, slot in header.slots.items():
        assert all(type(d) is int and 0 <= d < 2**63 for d in slot.shape), name
        assert slot.end - slot.begin == math.prod(slot.shape) * DTYPES[slot.dtype].itemsize, name
    spans = sorted((slot.begin, slot.end) for slot in header.slots.values())
    assert [begin for begin, _ in spans] == [0] + [end for _, end in spans[:-1]], spans
    assert (spans[-1][1] if spans else 0) == len(data), (spans, len(data))
    again = _parse(encode_header(header.slots, header.metadata) + data)
    assert (again.slots, again.metadata) == (header.slots, header.metadata)


def _parse_or_typed_error(raw: bytes) -> Header | None:
    try:
        return _parse(raw)
    except CorruptCheckpointError:
        return None


@settings(max_examples=300, deadline=None)
@given(st.binary(max_size=200))
def test_random_bytes_give_a_typed_error_or_a_consistent_header(raw):
    header = _parse_or_typed_error(raw)
    if header is not None:
        _assert_consistent(header, raw)


def test_every_one_byte_change_of_the_golden_file_gives_a_typed_error_or_a_consistent_header():
    parsed = 0
    for pos in range(len(GOLDEN_FILE)):
        for value in range(256):
            raw = bytearray(GOLDEN_FILE)
            raw[pos] = value
            header = _parse_or_typed_error(bytes(raw))
            if header is not None:
                _assert_consistent(header, bytes(raw))
                parsed += 1
    assert parsed >= 8 * 256  # every change to the 8 tensor bytes parses: the checks ran


def test_a_surrogate_pair_escape_is_valid_unicode_and_parses():
    header = _parse(
        _file(b'{"w\\ud83d\\ude00":{"dtype":"F32","shape":[1],"data_offsets":[0,4]}}', b"\0" * 4)
    )
    assert list(header.slots) == ["w\U0001f600"]


def test_an_empty_tensor_with_a_large_dimension_that_fits_parses():
    header = _parse(
        _file(b'{"a":{"dtype":"U8","shape":[0,9223372036854775807],"data_offsets":[0,0]}}')
    )
    assert header.slots["a"].shape == (0, 2**63 - 1)


def test_golden_file_parses():
    header = _parse(GOLDEN_FILE)
    assert header.data_start == 96
    assert header.slots["x"].shape == (2,)
    _assert_consistent(header, GOLDEN_FILE)


def test_a_tensor_named_like_the_header_metadata_key_is_refused(tmp_path):
    """``__metadata__`` is the header's own key: a tensor of that name made shard files
    the reference library cannot open (and an export the same)."""
    import shardpoint
    from shardpoint.hf import export_hf

    with pytest.raises(shardpoint.UnsupportedValueError, match="safetensors reserves"):
        shardpoint.save({"__metadata__": torch.ones(2)}, tmp_path / "a")
    assert not (tmp_path / "a" / "COMMITTED").exists()
    shardpoint.save({"meta": torch.ones(2)}, tmp_path / "b")
    with pytest.raises(shardpoint.CheckpointError, match="reserves"):
        export_hf(tmp_path / "b", tmp_path / "hf", rename=[("^meta$", "__metadata__")])


def test_files_end_before_their_header_could_pass_the_readers_limit(tmp_path, monkeypatch):
    """Shard files were packed by bytes alone: ~800,000 tiny tensors (98,000 of long
    names) made a header readers refuse (over 100 MB). The packing bounds the header
    too (here a 4 kB budget instead of 50 MB)."""
    import struct

    import shardpoint
    import shardpoint.layout as layout

    monkeypatch.setattr(layout, "HEADER_BUDGET", 4096)
    state = {f"layer.{i}.{'x' * 40}": torch.full((2,), float(i)) for i in range(100)}
    shardpoint.save(state, tmp_path / "c")
    files = sorted(p.name for p in (tmp_path / "c").glob("*.safetensors"))
    assert len(files) > 5
    for f in files:  # the 8-byte little-endian header length
        (length,) = struct.unpack("<Q", (tmp_path / "c" / f).read_bytes()[:8])
        assert length <= 4096, (f, length)
    out = {k: torch.zeros(2) for k in state}
    shardpoint.load(out, tmp_path / "c")
    assert all(torch.equal(out[k], v) for k, v in state.items())
