"""Hostile index files: only typed errors, whatever the bytes or the JSON say."""

from __future__ import annotations

import functools
import json
import tempfile
from pathlib import Path

import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import shardpoint
from shardpoint.errors import CorruptCheckpointError
from shardpoint.format.index import INDEX_NAME, parse_index


@functools.cache
def _valid_index() -> bytes:
    with tempfile.TemporaryDirectory() as tmp:
        w = torch.ones(3, 2)
        state = {"w": w, "tied": w, "nested": {"b": torch.arange(4)}, "meta": (1, "x", None)}
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


def _set(doc, path, value):
    if not path:
        return value
    target = doc
    for key in path[:-1]:
        target = target[key]
    target[path[-1]] = value
    return doc


@settings(max_examples=400, deadline=None)
@given(data=st.data())
def test_any_value_anywhere_in_the_index_gives_a_typed_error_or_a_consistent_index(data):
    raw = _valid_index()
    doc = json.loads(raw)
    paths = list(_paths(doc))
    path = data.draw(st.sampled_from(paths))
    doc = _set(doc, path, data.draw(json_values))
    try:
        parse_index(json.dumps(doc).encode(), "index.json")
    except CorruptCheckpointError:
        pass


@settings(max_examples=300, deadline=None)
@given(st.binary(max_size=300))
def test_random_bytes_as_an_index_give_a_typed_error(raw):
    try:
        parse_index(raw, "index.json")
    except CorruptCheckpointError:
        pass


def test_deeply_nested_json_is_a_typed_error_not_a_crash():
    raw = (
        b'{"format":"shardpoint","format_version":1,"checksum_algorithm":"xxh3-64","tree":'
        + b"[" * 100_000
        + b"]" * 100_000
        + b"}"
    )
    try:
        parse_index(raw, "index.json")
    except CorruptCheckpointError:
        pass
