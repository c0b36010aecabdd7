"""Coverage-guided fuzzing (atheris/libFuzzer) of the format parsers and the CLI on top.

The first byte of an input picks the target, so all four share one corpus:

    0  a shard file: ``header_length`` + ``parse_header``
    1  ``index.json`` bytes: ``parse_index``
    2  ``index.json`` bytes committed (with a matching marker) next to the files of a
       seed checkpoint (the sharded one if the index names a fragment):
       ``shardpoint.verify``, ``open(...).get``, and ``shardpoint inspect | verify | ls``
    3  a chunk fragment: rank 1's in the sharded seed, re-signed in its index (as a
       hostile writer could), then as target 2

Findings: an exception other than CheckpointError from the library; a shape the
parsers accept that torch cannot allocate; a CLI command that raises instead of
exiting 0, 1 or 2; a checkpoint that verifies but does not load, inspect or list
(exit 0); a crash or a hang. Besides libFuzzer's byte mutations, a structured
mutator puts edge values into the input's index (or a seed's): numbers (negative,
float, bool, 2**63, 2**70, ...) into its number fields, e.g. into one dimension of a
tensor and of all its chunks at once or into a mesh's rank count with the world
size, and lone surrogates into its strings. Bounded runs:

    python fuzz/fuzz_parsers.py -atheris_runs=50000
    python fuzz/fuzz_parsers.py -max_total_time=600      # a longer soak
"""

from __future__ import annotations

import atexit
import contextlib
import io
import json
import random
import shutil
import sys
import tempfile
from pathlib import Path
from typing import Any

import atheris
import numpy  # noqa: F401 - imported first so that only shardpoint is instrumented
import torch

with atheris.instrument_imports(include=["shardpoint"]):
    import shardpoint
    from shardpoint.cli import main as cli_main
    from shardpoint.errors import CheckpointError
    from shardpoint.format.index import (
        FRAGMENT_FORMAT,
        INDEX_NAME,
        MARKER_NAME,
        checksum,
    )
    from shardpoint.format.marker import marker_json
    from shardpoint.format.parse import parse_index
    from shardpoint.format.safetensors import DTYPES, header_length, parse_header
    from shardpoint.names import fragment_file

EDGE_VALUES: tuple[Any, ...] = (
    *(-1, -(2**63), 0, 1, 7, 2**31, 2**32 + 1, 2**53 + 1, 2**61, 2**62, 2**63 - 1),
    *(2**63, 2**64, 2**70, 10**30, -0.0, 0.5, 1.0, 1e300, float("inf"), float("nan")),
    *(True, False, None, "1", []),
)
EDGE_STRINGS = ("\ud800", "w\udfff", "", "\x00", "\u00e9\U0001f600")

# The seeds: a small checkpoint with an empty tensor, a tied one and non-tensor state;
# and the format version 2 golden checkpoint of the tests (a sharding over a mesh of 2
# ranks, their fragments). Target 2 commits each input's index next to copies of the
# files of the seed it names.
_TMP = Path(tempfile.mkdtemp(prefix="shardpoint-fuzz-"))
atexit.register(shutil.rmtree, _TMP, ignore_errors=True)
_w = torch.arange(6.0).reshape(2, 3)
_state = {"w": _w, "tied": _w, "empty": torch.zeros(0, 3), "meta": (1, b"x", None, "note")}
shardpoint.save(_state, _TMP / "seed", metadata={"step": 1, "run": "fuzz"})
_SHARDED = Path(__file__).resolve().parents[1] / "tests" / "data" / "v2-two-ranks"
SEED_INDEXES = ((_TMP / "seed" / INDEX_NAME).read_bytes(), (_SHARDED / INDEX_NAME).read_bytes())
SEED_FRAGMENT = (_SHARDED / fragment_file(1)).read_bytes()
WORK, WORK_SHARDED = _TMP / "work", _TMP / "work-sharded"
for _seed, _work in ((_TMP / "seed", WORK), (_SHARDED, WORK_SHARDED)):
    _work.mkdir()
    for _file in _seed.iterdir():
        if _file.name not in (INDEX_NAME, MARKER_NAME):
            (_work / _file.name).write_bytes(_file.read_bytes())


def _allocatable(shape: tuple[int, ...], dtype: str) -> None:
    """What a parser accepts, torch must be able to allocate (no data: the meta device)."""
    torch.empty(shape, dtype=DTYPES[dtype], device="meta")


def _cli(*args: str) -> tuple[int, str]:
    # Strict UTF-8 streams, like a terminal: text that cannot be encoded fails here too.
    out = io.TextIOWrapper(io.BytesIO(), encoding="utf-8")
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(out):
        rc = cli_main(list(args))
    out.seek(0)
    return rc, out.read()


def check_committed(index: bytes) -> None:
    work = WORK_SHARDED if b".chunks.json" in index else WORK  # names a fragment file
    (work / INDEX_NAME).write_bytes(index)
    (work / MARKER_NAME).write_bytes(marker_json(index))
    verified = shardpoint.verify(work).ok  # reports, never raises, for a damaged checkpoint
    try:
        with shardpoint.open(work) as reader:
            for name in reader.keys():
                reader.get(name)
    except CheckpointError:
        if verified:
            raise
    for command in ("inspect", "verify", "ls"):
        rc, output = _cli(command, str(work))
        assert rc in (0, 1, 2) and "Traceback" not in output, (command, rc, output)
        assert rc == 0 or not verified, f"{command} exits {rc} on a verified checkpoint: {output}"


def check_fragment(fragment: bytes) -> None:
    index = json.loads(SEED_INDEXES[1])
    index["fragments"]["1"] = [len(fragment), checksum(fragment)]
    index["files"][fragment_file(1)] = {"size": len(fragment)}
    (WORK_SHARDED / fragment_file(1)).write_bytes(fragment)
    try:
        check_committed(json.dumps(index).encode())
    finally:  # target 2 expects the seed's own fragment
        (WORK_SHARDED / fragment_file(1)).write_bytes(SEED_FRAGMENT)


def one_input(data: bytes) -> None:
    if not data:
        return
    target, body = data[0] % 4, data[1:]
    try:
        if target == 0:
            n = header_length(body[:8], len(body), "shard")
            for slot in parse_header(body[8 : 8 + n], len(body), "shard").slots.values():
                _allocatable(slot.shape, slot.dtype)
        elif target == 1:
            for entry in parse_index(body, INDEX_NAME).entries.values():
                _allocatable(entry.shape, entry.dtype)
        elif target == 2:
            check_committed(body)
        else:
            check_fragment(body)
    except CheckpointError:
        pass


# ---- the structured mutator ---------------------------------------------------------------


def _leaves(doc: Any, kinds: tuple[type, ...]) -> list[tuple[Any, Any]]:
    """(container, key) of every value of ``kinds`` in ``doc`` (bools are ints to Python);
    a loop, not recursion, as ``doc`` may nest deeply."""
    slots, stack = [], [doc]
    while stack:
        node = stack.pop()
        items = node.items() if isinstance(node, dict) else enumerate(node)
        for key, value in items:
            if isinstance(value, kinds):
                slots.append((node, key))
            elif isinstance(value, (dict, list)):
                stack.append(value)
    return slots


def _dimensions(doc: Any) -> list[tuple[list[Any], int]]:
    """(shape lists, dimension) of each tensor dimension: the entry's shape and its chunks'."""
    tensors = doc.get("tensors") if isinstance(doc, dict) else None
    dims = []
    for entry in tensors.values() if isinstance(tensors, dict) else ():
        shape = entry.get("shape") if isinstance(entry, dict) else None
        chunks = entry.get("chunks") if isinstance(entry, dict) else None
        if isinstance(shape, list) and isinstance(chunks, list):
            shapes = [shape] + [c.get("shape") for c in chunks if isinstance(c, dict)]
            shapes = [s for s in shapes if isinstance(s, list) and len(s) == len(shape)]
            dims += [(shapes, i) for i in range(len(shape))]
    return dims


def _counted_meshes(doc: Any) -> list[dict[str, Any]]:
    """The meshes of a version 2 index whose ranks are {"first", "count"}."""
    meshes = doc.get("meshes") if isinstance(doc, dict) else None
    return [
        m
        for m in (meshes if isinstance(meshes, list) else [])
        if isinstance(m, dict) and isinstance(m.get("ranks"), dict)
    ]


def put_edge_values(doc: Any, rng: random.Random) -> None:
    """Replace one to three values of an index: mostly numbers, half of those one
    dimension of a tensor in its entry and all its chunks (so that they still agree),
    some a mesh's rank count with the mesh's shape and the world size (likewise),
    sometimes a string."""
    for _ in range(rng.randint(1, 3)):
        dims, meshes, roll = _dimensions(doc), _counted_meshes(doc), rng.random()
        if meshes and roll < 0.1:
            mesh, value = rng.choice(meshes), rng.choice(EDGE_VALUES)
            mesh["ranks"]["count"] = doc["world_size"] = value
            mesh["shape"] = [value]
        elif dims and roll < 0.45:
            shapes, i = rng.choice(dims)
            value = rng.choice(EDGE_VALUES)
            for shape in shapes:
                shape[i] = value
        elif slots := _leaves(doc, (str,) if roll > 0.9 else (int, float)):
            container, key = rng.choice(slots)
            edges = EDGE_STRINGS if isinstance(container[key], str) else EDGE_VALUES
            container[key] = rng.choice(edges)


def mutate(data: bytes, max_size: int, seed: int) -> bytes:
    rng = random.Random(seed)
    if rng.random() < 0.5:
        return atheris.Mutate(data, max_size)
    try:
        doc = json.loads(data[1:])
    except (ValueError, RecursionError):
        doc = None
    if not isinstance(doc, (dict, list)):
        doc = json.loads(rng.choice((*SEED_INDEXES, SEED_FRAGMENT)))
    put_edge_values(doc, rng)
    fragment = isinstance(doc, dict) and doc.get("format") == FRAGMENT_FORMAT
    target = 3 if fragment else rng.choice((1, 2))
    try:
        out = bytes([target]) + json.dumps(doc, separators=(",", ":")).encode()
    except RecursionError:  # as deep as json.loads allows, one frame too deep to dump
        return atheris.Mutate(data, max_size)
    return out if len(out) <= max_size else atheris.Mutate(data, max_size)


if __name__ == "__main__":
    atheris.Setup(sys.argv, one_input, custom_mutator=mutate)
    atheris.Fuzz()
