"""Hostile index files: only typed errors, whatever the bytes or the JSON say."""

from __future__ import annotations

import json

import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import shardpoint
from shardpoint.errors import CorruptCheckpointError
from shardpoint.format.index import INDEX_NAME, parse_index


def _valid_index(tmp_path_factory) -> bytes:
    path = tmp_path_factory.mktemp("idx") / "ckpt"
    state = {
        "w": torch.ones(3, 2),
        "nested": {"b": torch.arange(4)},
        "meta": (1, "x", None),
        "tied": None,
    }
    state["tied"] = state["w"]
    shardpoint.save(state, path)
    return (path / INDEX_NAME).read_bytes()


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


@settings(
    max_examples=400, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture]
)
@given(data=st.data())
def test_any_value_anywhere_in_the_index_gives_a_typed_error_or_a_consistent_index(
    tmp_path_factory, data
):
    raw = (
        _valid_index(tmp_path_factory)
        if not hasattr(
            test_any_value_anywhere_in_the_index_gives_a_typed_error_or_a_consistent_index, "raw"
        )
        else test_any_value_anywhere_in_the_index_gives_a_typed_error_or_a_consistent_index.raw
    )  # noqa: E501
    test_any_value_anywhere_in_the_index_gives_a_typed_error_or_a_consistent_index.raw = raw
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
