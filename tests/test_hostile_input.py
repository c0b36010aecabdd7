"""Hostile index files: only typed errors, whatever the bytes or the JSON say."""

from __future__ import annotations

import functools
import json
import math
import re
import tempfile
from pathlib import Path

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import shardpoint
from shardpoint.errors import CorruptCheckpointError
from shardpoint.format.index import (
    FORMAT_VERSION,
    INDEX_NAME,
    Chunk,
    Index,
    TensorEntry,
)
from shardpoint.format.parse import parse_index
from shardpoint.format.safetensors import DTYPES


@functools.cache
def _valid_index() -> bytes:
    with tempfile.TemporaryDirectory() as tmp:
        w = torch.ones(3, 2)
        state = {
            "w": w,
            "tied": w,
            "nested": {"b": torch.arange(4)},
            "empty": torch.zeros(0, 5),
            "meta": (1, "x", None),
        }
        shardpoint.save(state, f"{tmp}/ckpt")
        return Path(f"{tmp}/ckpt/{INDEX_NAME}").read_bytes()


json_values = st.recursive(
    st.none()
    | st.booleans()
    | st.integers(-(2**70), 2**70)
    | st.floats(allow_nan=False)
    | st.text(max_size=8),
    lambda children: (
        st.lists(children, max_size=4) | st.dictionaries(st.text(max_size=6), children, max_size=4)
    ),
    max_leaves=12,
)


def _paths(doc, prefix=()):
    yield prefix
    if isinstance(doc, dict):
        for k, v in doc.items():
            yield from _paths(v, (*prefix, k))
    elif isinstance(doc, list):
        for i, v in enumerate(doc):
            yield from _paths(v, (*prefix, i))


def _get(doc, path):
    for key in path:
        doc = doc[key]
    return doc


def _set(doc, path, value):
    if not path:
        return value
    target = doc
    for key in path[:-1]:
        target = target[key]
    target[path[-1]] = value
    return doc


def _assert_consistent(index: Index) -> None:
    """What a parsed index promises its readers, checked here without the parser's code:
    plain file names, every chunk in a listed file and inside its size, byte lengths that
    match shapes, chunks that tile their tensor exactly, a tree naming every entry once,
    and a serialisation that parses back to the same index."""
    assert 1 <= index.format_version <= FORMAT_VERSION and index.world_size >= 1
    for file, size in index.files.items():
        assert re.fullmatch(r"[A-Za-z0-9_-][A-Za-z0-9._-]*", file), file
        assert type(size) is int and 0 <= size < 2**63
    for name, entry in index.entries.items():
        itemsize = DTYPES[entry.dtype].itemsize
        assert all(type(d) is int and 0 <= d < 2**63 for d in entry.shape), name
        for c in entry.chunks:
            assert c.file in index.files, (name, c.file)
            assert 0 <= c.begin <= c.end <= index.files[c.file], (name, c.begin, c.end)
            assert c.end - c.begin == math.prod(c.shape) * itemsize, (name, c.shape)
            assert len(c.offsets) == len(c.shape) == len(entry.shape), name
            assert all(o + s <= d for o, s, d in zip(c.offsets, c.shape, entry.shape)), name
            rows = c.shape[0] if c.shape else 1
            assert len(c.checksums) == max(1, -(-rows // c.block_rows)), name
            assert all(re.fullmatch(r"[0-9a-f]{16}", d) for d in c.checksums), name
        # every element of the tensor lies in exactly one chunk (volumes first: the count
        # below allocates the tensor's shape)
        assert sum(math.prod(c.shape) for c in entry.chunks) == math.prod(entry.shape), name
        coverage = torch.zeros(entry.shape, dtype=torch.int32)
        for c in entry.chunks:
            coverage[tuple(slice(o, o + s) for o, s in zip(c.offsets, c.shape))] += 1
        assert bool((coverage == 1).all()), name
    for name, target in index.aliases.items():
        assert target in index.entries and name not in index.entries, name
    names = index.names()
    assert sorted(names) == sorted(set(index.entries) | set(index.aliases))
    assert parse_index(index.to_json(), "index.json") == index


def _edits(doc) -> st.SearchStrategy:
    """(path, value): any JSON value anywhere, or one of the index's numbers moved by a
    little — small changes pass the type checks and reach the cross-checks between fields
    (a shape against its chunks, a byte range against its file)."""
    paths = list(_paths(doc))
    numbers = [p for p in paths if type(_get(doc, p)) is int]
    anywhere = st.tuples(st.sampled_from(paths), json_values)
    nudged = st.sampled_from(numbers).flatmap(
        lambda p: st.tuples(st.just(p), st.integers(-64, 64).map(lambda d: _get(doc, p) + d))
    )
    return anywhere | nudged


@settings(max_examples=400, deadline=None)
@given(data=st.data())
def test_any_value_anywhere_in_the_index_gives_a_typed_error_or_a_consistent_index(data):
    _edit_and_parse(_valid_index(), data)


def _edit_and_parse(raw: bytes, data) -> None:
    """One drawn edit of the index ``raw``: a typed error, or an index consistent by
    ``_assert_consistent``."""
    doc = json.loads(raw)
    path, value = data.draw(_edits(doc))
    doc = _set(doc, path, value)
    try:
        index = parse_index(json.dumps(doc).encode(), "index.json")
    except CorruptCheckpointError:
        return
    _assert_consistent(index)


@settings(max_examples=300, deadline=None)
@given(st.binary(max_size=300))
def test_random_bytes_as_an_index_give_a_typed_error_or_a_consistent_index(raw):
    try:
        index = parse_index(raw, "index.json")
    except CorruptCheckpointError:
        return
    _assert_consistent(index)


def test_the_unmodified_index_is_consistent():
    _assert_consistent(parse_index(_valid_index(), "index.json"))


@pytest.mark.parametrize("number", [b"Infinity", b"-Infinity", b"NaN", b"1e400"])
def test_a_number_json_cannot_hold_is_a_typed_error(number):
    """JSON has no NaN or infinity (docs/format.md stores them as {"float": "inf"}) but
    Python's json module reads them anyway (1e400 as inf): the index could not be written
    back (Index.to_json refuses it), so it is not one a writer produced."""
    raw = _valid_index().replace(b'{"tuple":[1,', b'{"tuple":[' + number + b",")
    assert raw != _valid_index()
    with pytest.raises(CorruptCheckpointError, match="^index.json: "):
        parse_index(raw, "index.json")


def test_deeply_nested_json_is_a_typed_error_not_a_crash():
    raw = (
        b'{"format":"shardpoint","format_version":1,"checksum_algorithm":"xxh3-64","tree":'
        + b"[" * 100_000
        + b"]" * 100_000
        + b"}"
    )
    with pytest.raises(CorruptCheckpointError, match="^index.json: not valid UTF-8 JSON"):
        parse_index(raw, "index.json")


@pytest.mark.parametrize(
    "later, why",
    [
        (b'"\xff"', "not valid UTF-8 JSON"),
        (b'"\\ud800"', "is not valid Unicode"),
        (b"NaN", "not valid UTF-8 JSON"),
        (b"1e400", "not valid JSON"),
    ],
)
def test_a_wrong_value_before_what_json_cannot_hold_is_still_a_typed_error(later, why):
    """The decoder stops at the first value of a wrong type (here a negative offset):
    what follows it must still be checked to be JSON before that value is named."""
    doc = json.loads(_valid_index())
    doc["tensors"]["w"]["chunks"][0]["offsets"] = [-1, 0]
    doc["metadata"] = {"later": "PLACEHOLDER"}  # the metadata follows the tensors
    raw = json.dumps(doc).encode().replace(b'"PLACEHOLDER"', later)
    with pytest.raises(CorruptCheckpointError, match=f"^index.json: .*{why}"):
        parse_index(raw, "index.json")


edge_ints = st.sampled_from([-1, 0, 1, 2**31, 2**53 + 1, 2**61, 2**62, 2**63 - 1, 2**63, 2**70])


@settings(max_examples=300, deadline=None)
@given(data=st.data())
def test_a_dimension_the_index_accepts_is_one_torch_can_allocate(data):
    """One dimension of a tensor, in its entry and all its chunks alike (so they still
    agree), set to an edge value: refused, or a shape torch can allocate (issue 14)."""
    doc = json.loads(_valid_index())
    name = data.draw(st.sampled_from([n for n, e in doc["tensors"].items() if "shape" in e]))
    entry = doc["tensors"][name]
    dim = data.draw(st.integers(0, len(entry["shape"]) - 1))
    value = data.draw(edge_ints | st.integers(-(2**70), 2**70))
    for shape in [entry["shape"]] + [c["shape"] for c in entry["chunks"]]:
        shape[dim] = value
    try:
        index = parse_index(json.dumps(doc).encode(), "index.json")
    except CorruptCheckpointError:
        return
    parsed = index.entries[name]
    torch.empty(parsed.shape, dtype=DTYPES[parsed.dtype], device="meta")
    assert parsed.nbytes < 2**63


# From this many chunks a tensor's chunks are checked on arrays (format/index.py), not
# one by one: the same refusals must come out of both.
MANY = 40


@functools.cache
def _many_chunk_index() -> bytes:
    """A version 1 index whose entries have MANY chunks each: row pieces of one rank
    file each, column pieces, and an 8 x 5 grid."""
    rows, cols = MANY * 2, 10
    files = {f"rank{r:05d}-00000.safetensors": 10_000 for r in range(MANY)}
    layouts = {
        "rows": (
            (rows, 6),
            [((2 * r, 0), (2, 6)) for r in range(MANY)],
        ),
        "columns": (
            (3, MANY * 2),
            [((0, 2 * r), (3, 2)) for r in range(MANY)],
        ),
        "grid": (
            (16, cols),
            [((2 * (r // 5), 2 * (r % 5)), (2, 2)) for r in range(MANY)],
        ),
    }
    entries = {}
    for i, (name, (shape, boxes)) in enumerate(layouts.items()):
        begin = 512 + 1000 * i  # each entry's chunks at their own place in the rank files
        chunks = []
        for r, (offsets, cshape) in enumerate(boxes):
            chunks.append(
                Chunk(
                    f"rank{r:05d}-00000.safetensors",
                    f"{name}@{r}",
                    offsets,
                    cshape,
                    (begin, begin + 4 * math.prod(cshape)),
                    1,
                    ("0123456789abcdef",) * cshape[0],
                )
            )
        entries[name] = TensorEntry(name, "F32", shape, tuple(chunks))
    tree = {"dict": [[n, {"tensor": n}] for n in entries]}
    index = Index(files, entries, {}, tree, "2026-01-01T00:00:00+00:00", "0", MANY)
    index.format_version = 1
    return index.to_json()


@settings(max_examples=300, deadline=None)
@given(data=st.data())
def test_any_value_in_an_index_of_many_chunks_gives_a_typed_error_or_a_consistent_index(data):
    _edit_and_parse(_many_chunk_index(), data)


def test_an_index_of_many_chunks_parses_as_written():
    index = parse_index(_many_chunk_index(), "index.json")
    assert [len(e.chunks) for e in index.entries.values()] == [MANY, MANY, MANY]
    _assert_consistent(index)


def _length(chunk):
    return chunk["byte_range"][1] - chunk["byte_range"][0]


def _chunk_edit(field, value):
    def edit(chunk):
        chunk[field] = value

    return edit


@pytest.mark.parametrize("entry", ["rows", "columns", "grid"])
@pytest.mark.parametrize(
    "edit, why",
    [
        (_chunk_edit("file", "rank99999-00000.safetensors"), "not listed in files"),
        (_chunk_edit("offsets", [0]), "offsets of .* one per dimension"),
        (_chunk_edit("shape", [2, 2, 1]), "shape of .* one per dimension"),
        (_chunk_edit("offsets", [2**63 - 1, 0]), "lies outside its shape"),
        (lambda c: c["offsets"].__setitem__(1, c["offsets"][1] + 7), "lies outside its shape"),
        (lambda c: c["byte_range"].__setitem__(1, c["byte_range"][1] + 4), "byte_range"),
        (lambda c: c.update(byte_range=[9_990, 9_990 + _length(c)]), "size of rank"),
        (lambda c: c["checksums"].pop(), "malformed checksums"),
        (lambda c: c["checksums"].__setitem__(0, "0123456789ABCDEF"), "malformed checksums"),
        (_chunk_edit("block_rows", 2), "malformed checksums"),
    ],
    ids=[
        "unlisted-file", "short-offsets", "long-shape", "offset-overflowing-int64",
        "outside", "byte-range-length", "past-the-file", "missing-checksum",
        "upper-case-hex", "block-rows",
    ],
)  # fmt: skip
def test_a_bad_chunk_among_many_is_named_as_among_few(entry, edit, why):
    """One chunk of MANY (checked on arrays) broken as tests of one chunk break it."""
    doc = json.loads(_many_chunk_index())
    edit(doc["tensors"][entry]["chunks"][MANY - 3])
    with pytest.raises(CorruptCheckpointError, match=f"^index.json: .*{why}"):
        parse_index(json.dumps(doc).encode(), "index.json")


@pytest.mark.parametrize("entry", ["rows", "columns", "grid"])
def test_two_of_many_chunks_that_overlap_are_refused(entry):
    doc = json.loads(_many_chunk_index())
    chunks = doc["tensors"][entry]["chunks"]
    chunks[MANY - 3] = dict(chunks[5], file=chunks[MANY - 3]["file"])  # one box twice
    with pytest.raises(CorruptCheckpointError, match="overlap"):
        parse_index(json.dumps(doc).encode(), "index.json")
    chunks.pop()  # and one box missing
    with pytest.raises(CorruptCheckpointError, match="do not cover"):
        parse_index(json.dumps(doc).encode(), "index.json")


def _many_tensor_index() -> bytes:
    """A version 2 index of MANY unsharded tensors, each stored whole as one chunk (their
    chunks are checked together, on arrays): 0-d, empty, 1-d, 2-d, one of many row blocks."""
    shapes = [(), (0, 3), (5,), (4, 3), (300, 2)]
    entries, at = {}, 512
    for i in range(MANY):
        shape = shapes[i % len(shapes)]
        rows = shape[0] if shape else 1
        nbytes = 4 * math.prod(shape)
        chunk = Chunk(
            "rank00000-00000.safetensors",
            f"t{i}",
            (0,) * len(shape),
            shape,
            (at, at + nbytes),
            128,
            ("0123456789abcdef",) * max(1, -(-rows // 128)),
        )
        entries[f"t{i}"] = TensorEntry(f"t{i}", "F32", shape, (chunk,))
        at += nbytes
    tree = {"dict": [[n, {"tensor": n}] for n in entries]}
    files = {"rank00000-00000.safetensors": at}
    return Index(files, entries, {}, tree, "2026-01-01T00:00:00+00:00", "0", 1).to_json()


def test_an_index_of_many_whole_tensors_parses_as_written():
    index = parse_index(_many_tensor_index(), "index.json")
    assert len(index.entries) == MANY
    _assert_consistent(index)


@settings(max_examples=300, deadline=None)
@given(data=st.data())
def test_any_value_in_an_index_of_many_whole_tensors_gives_a_typed_error_or_a_consistent_index(
    data,
):
    _edit_and_parse(_many_tensor_index(), data)


@pytest.mark.parametrize(
    "edit, why",
    [
        (_chunk_edit("file", "rank99999-00000.safetensors"), "not listed in files"),
        (_chunk_edit("offsets", [0]), "offsets of .* one per dimension"),
        (_chunk_edit("offsets", [0, 1]), "lies outside its shape"),
        (lambda c: c["byte_range"].__setitem__(1, c["byte_range"][1] + 4), "byte_range"),
        (lambda c: c["byte_range"].__setitem__(0, c["byte_range"][0] - 4), "byte_range"),
        (lambda c: c.update(byte_range=[10**9, 10**9 + _length(c)]), "size of rank"),
        (lambda c: c["checksums"].append("0123456789abcdef"), "malformed checksums"),
        (lambda c: c["checksums"].__setitem__(0, "0123456789ABCDEF"), "malformed checksums"),
        (_chunk_edit("block_rows", 1), "malformed checksums"),
    ],
    ids=[
        "unlisted-file", "short-offsets", "outside", "byte-range-end", "byte-range-begin",
        "past-the-file", "extra-checksum", "upper-case-hex", "block-rows",
    ],
)  # fmt: skip
def test_a_bad_whole_tensor_chunk_among_many_is_named(edit, why):
    """The chunk of entry t38 (a [4, 3] tensor, one of MANY checked together) broken:
    the error names it as a check of that entry alone would."""
    doc = json.loads(_many_tensor_index())
    edit(doc["tensors"]["t38"]["chunks"][0])
    with pytest.raises(CorruptCheckpointError, match=f"^index.json: .*{why}") as err:
        parse_index(json.dumps(doc).encode(), "index.json")
    assert "'t38'" in str(err.value)
