"""Edge values in index.json and shard headers (issue 14, items 8 and 11b).

Every size, offset and count is an int (not a bool, not a float) in [0, 2**63); a
tensor's element and byte counts fit in int64 even when another dimension is 0; every
string is valid Unicode. Anything else is a CorruptCheckpointError naming the file and
the field from every reader, and a clean error (no traceback) from the CLI. Each bad
file is a real checkpoint with one value edited and the marker re-signed, so that only
the value is wrong.
"""

import json
import re
import struct

import pytest
import torch
from conftest import rewrite_index

import shardpoint
from shardpoint.cli import main
from shardpoint.errors import CorruptCheckpointError
from shardpoint.format.index import FORMAT_VERSION, INDEX_NAME, check_file_name

DAMAGED = "the checkpoint is damaged, load an earlier one"


def _save(path, **extra):
    shardpoint.save(
        {"w": torch.arange(6.0).reshape(2, 3), "empty": torch.zeros(0, 4), **extra}, path
    )


def _dest():
    return {"w": torch.zeros(2, 3), "empty": torch.zeros(0, 4)}


def _every_reader_refuses(path, match, read_match=None):
    """``read_match``: what reading tensors says where it differs from ``verify``
    (loads and readers compare a shard header's checksum with the index's, ``verify``
    parses the header)."""
    with pytest.raises(CorruptCheckpointError, match=read_match or match):
        shardpoint.load(_dest(), path)
    with pytest.raises(CorruptCheckpointError, match=read_match or match):
        with shardpoint.open(path) as reader:
            for name in reader.keys():
                reader.get(name)
    report = shardpoint.verify(path)
    errors = report.errors + [e for f in report.files for e in f.errors]
    assert not report.ok and any(re.search(match, e) for e in errors), errors


def _cli(capsys, *args):
    rc = main([str(a) for a in args])
    out, err = capsys.readouterr()
    assert "Traceback" not in out + err
    return rc, out + err


def _set_shape(doc, name, shape):
    """Entry ``name`` and its only chunk get ``shape``, so that they still agree."""
    entry = doc["tensors"][name]
    (chunk,) = entry["chunks"]
    entry["shape"] = chunk["shape"] = list(shape)


def _rewrite_shard_header(path, mutate):
    """Edit the shard's JSON header, then move the index's byte ranges and file size
    with the data and re-sign the marker: only the edited value is wrong."""
    (shard,) = path.glob("*.safetensors")
    raw = shard.read_bytes()
    (n,) = struct.unpack("<Q", raw[:8])
    header = json.loads(raw[8 : 8 + n])
    mutate(header)
    new = json.dumps(header).encode()
    new += b" " * (-len(new) % 8)
    shard.write_bytes(struct.pack("<Q", len(new)) + new + raw[8 + n :])
    shift = len(new) - n

    def follow(doc):
        doc["files"][shard.name]["size"] += shift
        for entry in doc["tensors"].values():
            for chunk in entry["chunks"]:
                chunk["byte_range"] = [b + shift for b in chunk["byte_range"]]

    rewrite_index(path, follow)


def _rename(node, old, new):
    """``node`` (JSON) with every string ``old`` replaced by ``new``."""
    if isinstance(node, list):
        return [_rename(v, old, new) for v in node]
    if isinstance(node, dict):
        return {k: _rename(v, old, new) for k, v in node.items()}
    return new if node == old else node


def _rename_entry(doc, old, new):
    """Rename a tensor entry and the state key that holds it (not its key in the shard)."""
    doc["tensors"][new] = doc["tensors"].pop(old)
    doc["tree"] = _rename(doc["tree"], old, new)


# ---- shapes that overflow int64 --------------------------------------------------------

OVERFLOWING = [[0, 2**70], [2**63, 0], [0, 2**62], [0, 2**63 - 1]]


def _overflowing_checkpoint(path, shape):
    """Header and index agree on an overflowing shape for the empty tensor."""
    _save(path)
    _rewrite_shard_header(path, lambda h: h["empty"].update(shape=shape))
    rewrite_index(path, lambda doc: _set_shape(doc, "empty", shape))


@pytest.mark.parametrize("shape", OVERFLOWING, ids=str)
def test_an_overflowing_shape_of_an_empty_tensor_is_corrupt_for_every_reader(ckpt_dir, shape):
    _overflowing_checkpoint(ckpt_dir, shape)
    _every_reader_refuses(ckpt_dir, rf"{INDEX_NAME}: .*shape .*'empty'.*{DAMAGED}")


def test_an_overflowing_shape_only_in_a_shard_header_is_corrupt(ckpt_dir):
    _save(ckpt_dir)
    _rewrite_shard_header(ckpt_dir, lambda h: h["empty"].update(shape=[0, 2**70]))
    (shard,) = ckpt_dir.glob("*.safetensors")
    _every_reader_refuses(
        ckpt_dir,
        rf"{shard.name}: invalid safetensors header: .*'empty'",
        rf"{shard.name}: its header does not match {INDEX_NAME}",
    )


def test_the_cli_reports_an_overflowing_shape_without_a_traceback(ckpt_dir, tmp_path, capsys):
    _overflowing_checkpoint(ckpt_dir, [0, 2**70])
    message = rf"{INDEX_NAME}: shape of 'empty' .*{2**70}.*{DAMAGED}"
    rc, text = _cli(capsys, "inspect", ckpt_dir)
    assert rc == 2 and re.search(message, text), text
    rc, text = _cli(capsys, "verify", ckpt_dir)
    assert rc == 1 and "CORRUPT" in text and "shape of 'empty'" in text
    rc, text = _cli(capsys, "export-hf", ckpt_dir, tmp_path / "hf")
    assert rc == 2 and "shape of 'empty'" in text
    rc, text = _cli(capsys, "ls", ckpt_dir)
    assert rc == 0 and "invalid" in text and "shape of 'empty'" in text


def test_import_hf_of_a_file_with_an_overflowing_shape_is_a_clean_error(tmp_path, capsys):
    header = json.dumps({"a": {"dtype": "F32", "shape": [0, 2**70], "data_offsets": [0, 0]}})
    header += " " * (-len(header) % 8)
    source = tmp_path / "model.safetensors"
    source.write_bytes(struct.pack("<Q", len(header)) + header.encode())
    rc, text = _cli(capsys, "import-hf", source, tmp_path / "out")
    assert rc == 2 and "model.safetensors: invalid safetensors header" in text
    assert "invalid shape [0, 1180591620717411303424]" in text


# ---- every other number of the index ---------------------------------------------------


def _chunk(doc, name="w"):
    return doc["tensors"][name]["chunks"][0]


def _file_info(doc):
    return next(iter(doc["files"].values()))


BAD_NUMBERS = [
    *[(lambda d, v=v: _file_info(d).update(size=v), "size of file") for v in (-1, 2**63, 1.0, True)],
    *[(lambda d, v=v: _set_shape(d, "w", [2, v]), "shape of 'w'") for v in (-3, 3.0, True, 2**63)],
    *[(lambda d, v=v: _chunk(d).update(offsets=[v, 0]), "chunk offsets of 'w'") for v in (-1, 0.0, False, 2**63)],
    *[(lambda d, v=v: _chunk(d).update(byte_range=v), "chunk byte_range of 'w'") for v in ([-24, 0], [0.0, 24], [True, 25], [0, 2**63])],
    *[(lambda d, v=v: _chunk(d).update(block_rows=v), "block_rows of a chunk of 'w'") for v in (0, -1, 1.0, True, 2**63)],
    *[(lambda d, v=v: d.update(world_size=v), "world_size") for v in (0, -1, 1.0, True, 2**63)],
    *[(lambda d, v=v: d.update(format_version=v), "format_version") for v in (0, -1, 1.0, True, 2**63)],
]  # fmt: skip


@pytest.mark.parametrize("mutate, field", BAD_NUMBERS)
def test_a_number_of_the_index_out_of_its_range_is_corrupt(ckpt_dir, mutate, field):
    _save(ckpt_dir)
    rewrite_index(ckpt_dir, mutate)
    _every_reader_refuses(ckpt_dir, rf"{INDEX_NAME}: {field} .*{DAMAGED}")


def test_a_newer_format_version_still_asks_for_an_upgrade(ckpt_dir):
    _save(ckpt_dir)
    rewrite_index(ckpt_dir, lambda d: d.update(format_version=FORMAT_VERSION + 1))
    _every_reader_refuses(ckpt_dir, "upgrade shardpoint")


@pytest.mark.parametrize(
    "digest", [123, None, "ABCDEF0123456789", "0123456789abcde", "0123456789abcdef\n"]
)
def test_a_checksum_that_is_not_16_lowercase_hex_digits_is_corrupt(ckpt_dir, digest):
    _save(ckpt_dir)
    rewrite_index(ckpt_dir, lambda d: _chunk(d).update(checksums=[digest]))
    _every_reader_refuses(ckpt_dir, rf"{INDEX_NAME}: chunk of 'w' has malformed checksums")


def test_a_file_name_with_a_trailing_newline_is_refused():
    with pytest.raises(CorruptCheckpointError, match="refusing file name"):
        check_file_name("rank00000-00000.safetensors\n", INDEX_NAME)


# ---- names and strings that are not valid Unicode --------------------------------------


def test_an_entry_name_that_is_not_valid_unicode_is_corrupt(ckpt_dir, capsys):
    _save(ckpt_dir)
    # json.dumps writes the lone surrogate as the escape "\ud800", which JSON allows
    rewrite_index(ckpt_dir, lambda d: _rename_entry(d, "w", "w\ud800"))
    assert b'"w\\ud800"' in (ckpt_dir / INDEX_NAME).read_bytes()
    _every_reader_refuses(ckpt_dir, rf"{INDEX_NAME}: the string 'w\\ud800' is not valid Unicode")
    rc, text = _cli(capsys, "inspect", ckpt_dir)
    assert rc == 2 and "is not valid Unicode" in text
    rc, text = _cli(capsys, "verify", ckpt_dir)
    assert rc == 1 and "is not valid Unicode" in text


@pytest.mark.parametrize(
    "mutate",
    [
        lambda d: d["metadata"].update(note="\udc80"),
        lambda d: d.update(tree=_rename(d["tree"], "hello", "\ud800hello")),
    ],
    ids=["metadata", "state value"],
)
def test_any_string_of_the_index_that_is_not_valid_unicode_is_corrupt(ckpt_dir, mutate):
    _save(ckpt_dir, note="hello")
    rewrite_index(ckpt_dir, mutate)
    _every_reader_refuses(ckpt_dir, "is not valid Unicode")


def test_a_name_escaped_as_a_surrogate_pair_is_valid(ckpt_dir, capsys):
    shardpoint.save({"w\U0001f600": torch.ones(2)}, ckpt_dir)
    rewrite_index(ckpt_dir, lambda d: None)  # json.dumps escapes it as "\ud83d\ude00"
    assert b"\\ud83d\\ude00" in (ckpt_dir / INDEX_NAME).read_bytes()
    assert shardpoint.verify(ckpt_dir).ok
    with shardpoint.open(ckpt_dir) as reader:
        assert torch.equal(reader.get("w\U0001f600"), torch.ones(2))
    assert _cli(capsys, "inspect", ckpt_dir)[0] == 0
