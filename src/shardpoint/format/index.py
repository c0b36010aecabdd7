"""The checkpoint index (``index.json``), the commit marker, and chunk checksums.

``docs/format.md`` is the specification; this module is its only implementation.
Parsing is strict: anything the index claims is checked for type and range (every
number an int, not a bool or a float, that fits in int64; every string valid Unicode),
and file names must be plain names inside the checkpoint directory, before any shard
byte is read. An index may list millions of chunks: msgspec decodes them into typed
records and checks their numbers in C; what relates one field to another (a chunk
inside its tensor, inside its file) is checked here.
"""

from __future__ import annotations

import bisect
import json
import math
import re
from collections.abc import Sequence
from dataclasses import dataclass, field
from itertools import chain
from typing import Annotated, Any, NamedTuple

import msgspec
import numpy as np
import xxhash

from .. import tree as tree_codec
from ..errors import CorruptCheckpointError, UnsupportedValueError
from ..gc_pause import gc_paused
from ..sharding import Mesh, Sharding
from .safetensors import (
    DTYPES,
    INT64_MAX,
    TOO_LARGE,
    int64s,
    int_in,
    itemsize,
    lone_surrogate,
    strict_json,
    tensor_nbytes,
)

FORMAT_NAME = "shardpoint"
# An index is written as the lowest version it needs: 2, or 3 when it refers to files
# of other checkpoints (incremental saves). Every version up to FORMAT_VERSION is read.
PLAIN_VERSION = 2
REFERENCES_VERSION = 3
FORMAT_VERSION = REFERENCES_VERSION
FRAGMENT_FORMAT = "shardpoint-chunks"
INDEX_NAME = "index.json"
MARKER_NAME = "COMMITTED"
CHECKSUM_ALGORITHM = "xxh3-64"
# A shard file name is a plain name: no separators, no "..", nothing absolute.
_PLAIN = r"(?!\.)[A-Za-z0-9._-]{1,200}"
_FILE_NAME = re.compile(_PLAIN)  # fullmatch: "$" passes a "\n"
# Version 3: a file of a sibling checkpoint (same parent directory or prefix), which
# an incremental save refers to instead of writing the same bytes again.
_REFERENCE = re.compile(rf"\.\./({_PLAIN})/(rank\d{{5}}-\d{{5}}\.safetensors)")
_HEX = re.compile(r"[0-9a-f]*")
_DAMAGED = "the checkpoint is damaged, load an earlier one"


def checksum(data: Any) -> str:
    """xxh3-64 of a bytes-like object, as 16 lowercase hex digits."""
    return xxhash.xxh3_64_hexdigest(data)


# Checksums cover blocks of whole rows (dim 0) of about this size, so a load that
# needs only some rows of a chunk (resharding) verifies everything it reads while
# reading at most one extra block at each end.
CHECKSUM_BLOCK_BYTES = 256 * 1024


def block_rows_for(shape: tuple[int, ...], itemsize: int) -> int:
    row_bytes = math.prod(shape[1:]) * itemsize if shape else itemsize
    return max(1, CHECKSUM_BLOCK_BYTES // max(row_bytes, 1))


def block_checksums(data: Any, shape: tuple[int, ...], itemsize: int, block_rows: int) -> list[str]:
    """Checksums of ``data`` (the chunk's bytes, a buffer) block by block."""
    step = block_rows * (math.prod(shape[1:]) * itemsize if shape else itemsize)
    rows = shape[0] if shape else 1
    blocks = max(1, -(-rows // block_rows))
    view = memoryview(data).cast("B")
    return [checksum(view[i * step : (i + 1) * step]) for i in range(blocks)]


# Numbers an index holds: ints in int64's range (msgspec checks them while decoding).
_UInt64 = Annotated[int, msgspec.Meta(ge=0, le=INT64_MAX)]
_Digest = Annotated[str, msgspec.Meta(min_length=16, max_length=16)]


class Chunk(msgspec.Struct, frozen=True, gc=False):
    """One stored piece of a tensor: where it sits in the tensor and in its file.

    An index may list millions: msgspec decodes them straight into this record (its
    fields are the JSON object's, in order; no cycles, so the collector skips them).
    The constraints on the fields are checked when decoding, not when built here.
    """

    file: str
    key: str  # the tensor name inside the safetensors file
    offsets: tuple[_UInt64, ...]  # position of the chunk inside the global tensor
    shape: tuple[_UInt64, ...]
    byte_range: tuple[_UInt64, _UInt64]  # absolute [begin, end) inside ``file``
    block_rows: Annotated[int, msgspec.Meta(ge=1, le=INT64_MAX)]
    checksums: tuple[_Digest, ...]  # one per block of ``block_rows`` rows

    @property
    def begin(self) -> int:
        return self.byte_range[0]

    @property
    def end(self) -> int:
        return self.byte_range[1]

    @property
    def rows(self) -> int:
        return self.shape[0] if self.shape else 1

    @property
    def row_bytes(self) -> int:
        begin, end = self.byte_range
        return (end - begin) // self.rows if self.rows else 0

    def block_span(self, i: int) -> tuple[int, int]:
        """Absolute byte range of checksum block ``i``."""
        begin, end = self.byte_range
        step = self.block_rows * self.row_bytes
        return begin + i * step, min(begin + (i + 1) * step, end)


# Built per tensor: a frozen dataclass costs five times as much to build.
@dataclass(slots=True, unsafe_hash=True)
class TensorEntry:
    name: str
    dtype: str
    shape: tuple[int, ...]
    chunks: tuple[Chunk, ...]

    @property
    def nbytes(self) -> int:
        return math.prod(self.shape) * itemsize(self.dtype)


@dataclass
class Index:
    files: dict[str, int]  # shard file name -> size in bytes
    entries: dict[str, TensorEntry]
    aliases: dict[str, str]  # entry name -> the entry it shares storage with
    tree: Any
    created: str
    library_version: str
    world_size: int = 1
    metadata: dict[str, Any] = field(default_factory=dict)
    format_version: int = PLAIN_VERSION
    # Version 2: entries described by a sharding (their chunks are in the writers'
    # fragments, read when needed), and each rank's fragment as (size, checksum).
    shardings: dict[str, Sharding] = field(default_factory=dict)
    fragments: dict[int, tuple[int, str]] = field(default_factory=dict)
    # Shard file -> checksum of its header (the length prefix and the JSON, as
    # written): a load compares it instead of parsing the header. Optional: files
    # without one (earlier releases, files an incremental save refers to) are parsed.
    headers: dict[str, str] = field(default_factory=dict)

    def resolve(self, name: str) -> TensorEntry:
        return self.entries[self.aliases.get(name, name)]

    def names(self) -> list[str]:
        """Every tensor entry name, aliases included, in state order."""
        return tree_codec.tensor_names(self.tree)

    def to_json(self) -> bytes:
        """The index as JSON of its ``format_version`` (docs/format.md): an index read
        from a version 1 file writes back as version 1."""
        if self.format_version < 2 and (self.shardings or self.fragments):
            raise ValueError("shardings and fragments need format version 2")
        if self.format_version < 3 and any(map(split_reference, self.files)):
            raise ValueError("references to other checkpoints' files need format version 3")
        meshes: dict[Mesh, int] = {}
        tensors: dict[str, Any] = {}
        for name in self.names():
            if name in self.aliases:
                tensors[name] = {"alias_of": self.aliases[name]}
                continue
            e = self.entries[name]
            spec: dict[str, Any] = {"dtype": e.dtype, "shape": list(e.shape)}
            sharding = self.shardings.get(name)
            if sharding is not None:
                mesh = meshes.setdefault(sharding.mesh, len(meshes))
                spec["sharding"] = {"mesh": mesh, "dims": list(sharding.dims)}
            else:
                spec["chunks"] = e.chunks  # encoded as JSON objects, fields in order
            tensors[name] = spec
        doc = {
            "format": FORMAT_NAME,
            "format_version": self.format_version,
            "library_version": self.library_version,
            "created": self.created,
            "checksum_algorithm": CHECKSUM_ALGORITHM,
            "world_size": self.world_size,
            "files": {name: self._file_json(name, size) for name, size in self.files.items()},
            "meshes": [{"shape": list(m.shape), "ranks": m.ranks_json()} for m in meshes],
            "fragments": {str(r): list(f) for r, f in sorted(self.fragments.items())},
            "tensors": tensors,
            "tree": self.tree,
            "metadata": _user_json(self.metadata),
        }
        return _dumps(doc)

    def _file_json(self, name: str, size: int) -> dict[str, Any]:
        header = self.headers.get(name)
        return {"size": size} if header is None else {"size": size, "header": header}


def _dumps(doc: Any) -> bytes:
    """Compact UTF-8 JSON of what the library built (9x json.dumps on an index of 10,000
    entries). Trees hold no NaN or infinity (``tree`` tags them), which msgspec would
    write as null; user metadata goes through ``_user_json``."""
    return _ENCODE.encode(doc)


def _user_json(value: Any) -> msgspec.Raw:
    """A user's JSON value as json.dumps writes it: NaN and infinity refused, any key
    json.dumps takes taken."""
    return msgspec.Raw(
        json.dumps(value, separators=(",", ":"), ensure_ascii=False, allow_nan=False).encode()
    )


def check_user_metadata(value: Any) -> None:
    """Refuse metadata the index could not hold, naming why (before a byte is written)."""
    try:
        _user_json(value)
    except (TypeError, ValueError, RecursionError) as exc:
        raise UnsupportedValueError(
            f"the save's metadata cannot be stored as JSON ({exc}); pass numbers, strings, "
            "lists and dicts (NaN and infinity are refused)"
        ) from None


def fragment_json(
    rank: int, chunks: dict[str, Chunk], values: dict[str, Any], entries: list[TensorEntry]
) -> bytes:
    """A rank's fragment: the chunks it wrote of entries described by a sharding, its
    own values (``tree.PerRank``) by path, and the tensor entries inside them."""
    doc = {
        "format": FRAGMENT_FORMAT,
        "rank": rank,
        "chunks": chunks,
        "values": values,
        "tensors": {
            e.name: {"dtype": e.dtype, "shape": list(e.shape), "chunk": e.chunks[0]}
            for e in entries
        },
    }
    return _dumps(doc)


@dataclass
class Fragment:
    chunks: dict[str, Chunk]  # of entries described by a sharding
    values: dict[str, Any]  # the rank's own values, by path
    entries: dict[str, TensorEntry]  # the tensors inside those values


def reference(directory: str, file: str) -> str:
    """The name by which a checkpoint refers to ``file`` of its sibling ``directory``."""
    return f"../{directory}/{file}"


def split_reference(name: str) -> tuple[str, str] | None:
    """(sibling directory, file) of a reference name, else None (a plain name)."""
    m = _REFERENCE.fullmatch(name)
    return (m.group(1), m.group(2)) if m else None


def check_file_name(name: object, where: str) -> str:
    """A plain name inside the checkpoint directory, or a reference to a shard file of
    a sibling checkpoint (``../DIR/rankRRRRR-KKKKK.safetensors``, ``DIR`` plain)."""
    if not isinstance(name, str) or not (_FILE_NAME.fullmatch(name) or _REFERENCE.fullmatch(name)):
        raise CorruptCheckpointError(
            f"{where}: refusing file name {name!r}: shard files must be plain names inside "
            "the checkpoint directory (no '/', no '..', not absolute), or "
            "../DIR/rankRRRRR-KKKKK.safetensors for a shard file of a sibling checkpoint"
        )
    return name


def _corrupt(where: str, why: str) -> CorruptCheckpointError:
    return CorruptCheckpointError(f"{where}: {why}; {_DAMAGED}")


def _ints(
    value: object, what: str, of: str, where: str, *, length: int | None = None
) -> tuple[int, ...]:
    ints = int64s(value, length)
    if ints is None:
        count = "ints" if length is None else f"{length} ints"
        raise _corrupt(
            where, f"{what} of {of!r} must be a list of {count} in [0, 2**63), got {value!r:.200}"
        )
    return ints


def _int(value: object, what: str, where: str, low: int = 0) -> int:
    if not int_in(value, low):
        raise _corrupt(where, f"{what} must be an int in [{low}, 2**63), got {value!r:.200}")
    return value  # type: ignore[return-value]


# What msgspec decodes. Chunks (millions of them in a large index) decode into
# ``Chunk``, their numbers and strings checked in C; everything else stays a plain
# JSON value and is checked below, with messages that name the entry.
class _EntryDoc(msgspec.Struct):
    dtype: Any = msgspec.UNSET
    shape: tuple[_UInt64, ...] | msgspec.UnsetType = msgspec.UNSET
    chunks: tuple[Chunk, ...] | msgspec.UnsetType = msgspec.UNSET
    sharding: Any = msgspec.UNSET
    alias_of: Any = msgspec.UNSET


class _Head(msgspec.Struct):
    """The fields that say what a document is, decoded first when the rest fails."""

    format: Any = None
    format_version: Any = None
    checksum_algorithm: Any = None
    rank: Any = None
    tensors: msgspec.Raw = msgspec.field(default_factory=lambda: msgspec.Raw(b"{}"))


class _IndexDoc(msgspec.Struct):
    files: Any
    tensors: dict[str, _EntryDoc]
    tree: Any
    created: Any
    library_version: Any
    format: Any = None
    format_version: Any = None
    checksum_algorithm: Any = None
    world_size: Any = 1
    meshes: Any = msgspec.UNSET
    fragments: Any = msgspec.UNSET
    metadata: Any = msgspec.field(default_factory=dict)


class _FragmentTensorDoc(msgspec.Struct):
    dtype: Any
    shape: tuple[_UInt64, ...]
    chunk: Chunk


class _FragmentDoc(msgspec.Struct):
    chunks: dict[str, Chunk]
    tensors: dict[str, _FragmentTensorDoc]
    values: Any
    format: Any = None
    rank: Any = None


_DECODE_INDEX = msgspec.json.Decoder(_IndexDoc)
_DECODE_ENTRY = msgspec.json.Decoder(_EntryDoc)
_DECODE_FRAGMENT = msgspec.json.Decoder(_FragmentDoc)
_DECODE_HEAD = msgspec.json.Decoder(_Head)
_DECODE_JSON = msgspec.json.Decoder()
_ENCODE = msgspec.json.Encoder()
# A chunk's lists of ints, as messages name them, and their lengths (-1: the rank).
_CHUNK_FIELDS = [
    ("offsets", "chunk offsets", -1),
    ("shape", "chunk shape", -1),
    ("byte_range", "chunk byte_range", 2),
]


class _WrongValue(Exception):
    """msgspec refused a value of the wrong type or range (its message says where)."""


def _decode(decoder: msgspec.json.Decoder[Any], raw: bytes, where: str) -> Any:
    """``raw`` decoded. A value of the wrong type or range raises ``_WrongValue`` (the
    caller says which); JSON that is not even that is refused here: bad UTF-8, a lone
    surrogate, ``NaN``, a number out of range, nesting too deep."""
    try:
        return decoder.decode(raw)
    except msgspec.ValidationError as exc:
        if "Number out of range" in str(exc):
            raise _corrupt(where, f"not valid JSON ({exc})") from None
        raise _WrongValue(str(exc)) from None
    except (msgspec.DecodeError, RecursionError) as exc:
        raise _why_not_json(raw, where, exc) from None


def _why_not_json(raw: bytes, where: str, exc: Exception) -> CorruptCheckpointError:
    """Name what msgspec refused: it reports a lone surrogate as truncated input."""
    try:
        text = raw.decode("utf-8")
        invalid = lone_surrogate(text, strict_json(text))
    except (UnicodeDecodeError, ValueError, RecursionError) as plain:
        return _corrupt(where, f"not valid UTF-8 JSON ({plain})")
    if invalid is not None:
        return _corrupt(
            where, f"the string {invalid!r:.200} is not valid Unicode (a lone surrogate)"
        )
    return _corrupt(where, f"not valid UTF-8 JSON ({exc})")


def _check_head(version: Any, algorithm: Any, where: str) -> int:
    version = _int(version, "format_version", where, low=1)
    if version > FORMAT_VERSION:
        raise CorruptCheckpointError(
            f"{where}: format_version {version!r} is not supported by this shardpoint "
            f"(reads up to {FORMAT_VERSION}); upgrade shardpoint to read it"
        )
    if algorithm != CHECKSUM_ALGORITHM:
        raise _corrupt(where, f"unknown checksum_algorithm {algorithm!r:.200}")
    return version


def _head(raw: bytes, where: str) -> _Head | None:
    """What a document msgspec refused says it is; None if it is not a JSON object.
    msgspec stops at the first wrong value: the rest must be checked to be JSON too."""
    _decode(_DECODE_JSON, raw, where)
    try:
        return _decode(_DECODE_HEAD, raw, where)  # type: ignore[no-any-return]
    except _WrongValue:
        return None


def _refused_index(raw: bytes, where: str, problem: str) -> CorruptCheckpointError:
    """Why msgspec refused (``problem``) a syntactically valid index: what it is
    (format, version) first, then the entry, and the field of it, with a wrong value."""
    head = _head(raw, where)
    if head is None or head.format != FORMAT_NAME:
        return _corrupt(where, 'not a shardpoint index (missing "format": "shardpoint")')
    _check_head(head.format_version, head.checksum_algorithm, where)
    try:
        entries = msgspec.json.decode(head.tensors, type=dict[str, msgspec.Raw])
    except msgspec.ValidationError:
        entries = {}
    for name, entry in entries.items():
        try:
            _DECODE_ENTRY.decode(entry)
        except msgspec.ValidationError as exc:
            return _corrupt(where, _entry_problem(name, entry, str(exc), where))
    return _corrupt(where, f"malformed index ({problem})")


def _entry_problem(name: str, entry: msgspec.Raw, problem: str, where: str) -> str:
    """Entry ``name`` has a value of the wrong type or range (msgspec's ``problem``):
    name the field and the value, as the checks of a decoded entry would."""
    doc = msgspec.json.decode(entry)
    if isinstance(doc, dict):
        shape = doc.get("shape")
        if shape is not None:  # raises if it is wrong
            _dtype_shape_nbytes(doc.get("dtype"), _ints(shape, "shape", name, where), name, where)
        chunks = doc.get("chunks")
        at = problem.rpartition(" - at `$.chunks[")[2].partition("]")[0]
        if at.isdigit() and isinstance(chunks, list) and isinstance(chunks[int(at)], dict):
            chunk, n = chunks[int(at)], len(shape) if isinstance(shape, list) else None
            for field, what, length in _CHUNK_FIELDS:
                if field in chunk:
                    _ints(chunk[field], what, name, where, length=n if length == -1 else length)
            if "block_rows" in chunk:
                _int(chunk["block_rows"], f"block_rows of a chunk of {name!r}", where, low=1)
            if "].checksums" in problem:
                raise _bad_checksums(name, chunk["checksums"], chunk.get("block_rows"), where)
    return f"entry {name!r} is malformed ({problem})"


@gc_paused()  # millions of objects for a large index, none of them in a cycle
def parse_index(raw: bytes, where: str) -> Index:
    """Strictly parse and cross-check an index; raises CorruptCheckpointError naming ``where``."""
    try:
        doc = _decode(_DECODE_INDEX, raw, where)
    except _WrongValue as exc:
        raise _refused_index(raw, where, str(exc)) from None
    if doc.format != FORMAT_NAME:
        raise _corrupt(where, 'not a shardpoint index (missing "format": "shardpoint")')
    _check_head(doc.format_version, doc.checksum_algorithm, where)
    try:
        return _parse_fields(doc, where)
    except CorruptCheckpointError:
        raise
    except (KeyError, TypeError, ValueError, AttributeError) as exc:
        raise _corrupt(where, f"malformed index ({type(exc).__name__}: {exc})") from None


def _parse_fields(doc: _IndexDoc, where: str) -> Index:
    files: dict[str, int] = {}
    headers: dict[str, str] = {}
    for name, info in doc.files.items():
        check_file_name(name, where)
        files[name] = _int(info["size"], f"size of file {name!r}", where)
        header = info.get("header")
        if header is not None:
            if type(header) is not str or len(header) != 16 or not _HEX.fullmatch(header):
                raise _corrupt(where, f"file {name!r} has a malformed header checksum")
            headers[name] = header

    world_size = _int(doc.world_size, "world_size", where, low=1)
    version = doc.format_version
    meshes = _parse_meshes(_given(doc.meshes), world_size, where) if version >= 2 else []
    fragments = _parse_fragments(_given(doc.fragments), world_size, where) if version >= 2 else {}
    entries: dict[str, TensorEntry] = {}
    aliases: dict[str, str] = {}
    shardings: dict[str, Sharding] = {}
    whole: list[tuple[str, str, tuple[int, ...], int, Chunk]] = []  # checked together
    unset = msgspec.UNSET
    for name, spec in doc.tensors.items():
        if spec.alias_of is not unset and spec.dtype is unset and spec.shape is unset:
            if spec.chunks is not unset or spec.sharding is not unset:
                raise _corrupt(where, f"alias {name!r} also holds chunks or a sharding")
            aliases[name] = spec.alias_of
            continue
        if spec.shape is unset:
            raise _corrupt(where, f"entry {name!r} has no shape")
        dtype, shape, nbytes = _dtype_shape_nbytes(spec.dtype, spec.shape, name, where)
        if version >= 2 and spec.sharding is not unset:
            shardings[name] = _parse_sharding(spec.sharding, name, shape, meshes, where)
            entries[name] = TensorEntry(name, dtype, shape, ())  # chunks: in the fragments
            continue
        if spec.chunks is unset:
            raise _corrupt(where, f"entry {name!r} has neither chunks nor a sharding")
        chunks = spec.chunks
        if len(chunks) == 1 and chunks[0].shape == shape:  # the usual unsharded tensor
            whole.append((name, dtype, shape, nbytes, chunks[0]))
        else:
            boxes = _boxes(chunks, len(shape)) if len(chunks) >= _ARRAY_CHUNKS and shape else None
            _check_chunks(chunks, name, dtype, shape, files, where, boxes)
            _check_cover(name, shape, chunks, where, boxes)
        entries[name] = TensorEntry(name, dtype, shape, chunks)
    if whole and not _whole_chunks_fit(whole, files):
        for name, dtype, shape, _, chunk in whole:  # raises at the first that does not
            _check_chunks((chunk,), name, dtype, shape, files, where)
    for name, target in aliases.items():
        if target not in entries:
            raise _corrupt(where, f"alias {name!r} points at missing entry {target!r:.200}")

    tree = doc.tree
    try:
        referenced = tree_codec.tensor_names(tree)
    except (ValueError, TypeError, AttributeError, KeyError) as exc:
        raise _corrupt(where, f"malformed state tree ({exc})") from None
    known = set(entries) | set(aliases)
    unknown = [n for n in referenced if n not in known]
    if unknown or len(referenced) != len(known):
        raise _corrupt(
            where,
            "state tree and tensor table disagree "
            f"(e.g. {(unknown or sorted(known - set(referenced)))[:3]})",
        )
    metadata = doc.metadata
    if not isinstance(metadata, dict):
        raise _corrupt(where, f"metadata must be a JSON object, got {metadata!r:.200}")
    return Index(
        files=files,
        entries=entries,
        aliases=aliases,
        tree=tree,
        created=str(doc.created),
        library_version=str(doc.library_version),
        world_size=world_size,
        metadata=metadata,
        format_version=version,
        shardings=shardings,
        fragments=fragments,
        headers=headers,
    )


def _given(value: Any) -> Any:
    """A field a version 2 index must have (a ``KeyError`` is reported as malformed)."""
    if value is msgspec.UNSET:
        raise KeyError("a field of format version 2 is missing")
    return value


def _dtype_shape_nbytes(
    dtype: Any, shape: tuple[int, ...], name: str, where: str
) -> tuple[str, tuple[int, ...], int]:
    """An entry's dtype and global shape (its ints decoded), checked (index entries
    and fragment tensors), and its size in bytes."""
    if type(dtype) is not str or dtype not in DTYPES:
        raise _corrupt(where, f"entry {name!r} has unknown dtype {dtype!r:.200}")
    nbytes = tensor_nbytes(dtype, shape)
    if nbytes is None:
        raise _corrupt(where, f"shape {list(shape)} of {name!r} is {TOO_LARGE}")
    return dtype, shape, nbytes


def _parse_meshes(specs: list[Any], world_size: int, where: str) -> list[Mesh]:
    meshes = []
    for spec in specs:
        shape = _ints(spec["shape"], "shape", "a mesh", where)
        ranks_spec = spec["ranks"]
        if type(ranks_spec) is dict:
            first = _int(ranks_spec["first"], "a mesh's first rank", where)
            count = _int(ranks_spec["count"], "a mesh's rank count", where, low=1)
            if first + count > world_size:
                raise _corrupt(where, f"a mesh names ranks beyond world_size {world_size}")
            ranks: Sequence[int] = range(first, first + count)
        else:
            ranks = _ints(ranks_spec, "ranks", "a mesh", where)
            if any(r >= world_size for r in ranks):
                raise _corrupt(where, f"a mesh names ranks beyond world_size {world_size}")
        meshes.append(Mesh(shape, ranks))
    return meshes


def _parse_fragments(
    spec: dict[str, Any], world_size: int, where: str
) -> dict[int, tuple[int, str]]:
    fragments = {}
    for key, value in spec.items():
        if not key.isdigit() or int(key) >= world_size or type(value) is not list:
            raise _corrupt(where, f"fragment entry {key!r:.50}: {value!r:.100} is malformed")
        size, digest = value
        _int(size, f"size of rank {key}'s fragment", where)
        if type(digest) is not str or len(digest) != 16 or not _HEX.fullmatch(digest):
            raise _corrupt(where, f"rank {key}'s fragment has a malformed checksum")
        fragments[int(key)] = (size, digest)
    return fragments


def _parse_sharding(
    spec: dict[str, Any],
    name: str,
    shape: tuple[int, ...],
    meshes: list[Mesh],
    where: str,
) -> Sharding:
    mesh = _int(spec["mesh"], f"mesh of {name!r}", where)
    if mesh >= len(meshes):
        raise _corrupt(where, f"entry {name!r} names mesh {mesh}, which is not listed")
    dims = spec["dims"]
    if type(dims) is not list or not all(type(d) is int for d in dims):
        raise _corrupt(where, f"the sharded dims of {name!r} must be a list of ints")
    sharding = Sharding(meshes[mesh], tuple(dims))
    why = sharding.check(shape, where)
    if why is not None:
        raise _corrupt(where, f"the sharding of {name!r} is impossible: {why}")
    return sharding


@gc_paused()
def parse_fragment(raw: bytes, where: str, rank: int, index: Index) -> Fragment:
    """Strictly parse rank ``rank``'s fragment: every chunk must be the one the sharding
    of its entry gives that rank, every tensor entry a whole tensor of a new name, and
    everything inside a listed file."""
    try:
        doc = _decode(_DECODE_FRAGMENT, raw, where)
    except _WrongValue as exc:
        head = _head(raw, where)
        if head is None or head.format != FRAGMENT_FORMAT or head.rank != rank:
            raise _corrupt(where, f"not the chunk fragment of rank {rank}") from None
        raise _corrupt(where, f"malformed fragment ({exc})") from None
    if doc.format != FRAGMENT_FORMAT or doc.rank != rank or type(doc.rank) is not int:
        raise _corrupt(where, f"not the chunk fragment of rank {rank}")
    values = doc.values
    if type(values) is not dict:
        raise _corrupt(where, "its values are not a JSON object")
    chunks: dict[str, Chunk] = {}
    entries: dict[str, TensorEntry] = {}
    try:
        for name, spec in doc.tensors.items():
            dtype, shape, _ = _dtype_shape_nbytes(spec.dtype, spec.shape, name, where)
            if name in index.entries or name in index.aliases:
                raise _corrupt(where, f"entry {name!r} is also in {INDEX_NAME}")
            chunk = spec.chunk
            _check_chunks((chunk,), name, dtype, shape, index.files, where)
            if chunk.shape != shape:
                raise _corrupt(where, f"the chunk of {name!r} is not the whole tensor")
            entries[name] = TensorEntry(name, dtype, shape, (chunk,))
        for name, spec in doc.chunks.items():
            sharding = index.shardings.get(name)
            if sharding is None:
                raise _corrupt(where, f"names {name!r:.200}, which has no sharding in the index")
            entry = index.entries[name]
            chunk = spec
            _check_chunks((chunk,), name, entry.dtype, entry.shape, index.files, where)
            coord = sharding.mesh.coord_of(rank)
            if (
                coord is None
                or sharding.writer(coord) != rank
                or (chunk.offsets, chunk.shape) != sharding.box(entry.shape, coord)
            ):
                raise _corrupt(where, f"its chunk of {name!r} is not the one rank {rank} holds")
            chunks[name] = chunk
        for path, value in values.items():  # each tensor a value names is held somewhere
            named: list[str] = []
            tree_codec.decode(value, named.append, _nested_fragment)  # type: ignore[arg-type]
            for tensor in named:
                elsewhere = tensor in index.entries or tensor in index.aliases
                if tensor not in entries and not elsewhere:
                    raise _corrupt(
                        where,
                        f"its value at {path!r:.100} names tensor {tensor!r:.100}, which neither "
                        f"it nor {INDEX_NAME} holds",
                    )
    except CorruptCheckpointError:
        raise
    except (KeyError, TypeError, ValueError, AttributeError, RecursionError) as exc:
        raise _corrupt(where, f"malformed fragment ({type(exc).__name__}: {exc})") from None
    return Fragment(chunks, values, entries)


def _nested_fragment(rank: int, path: str) -> Any:
    raise ValueError("a value kept in a fragment refers to a fragment again")


def _check_chunks(
    chunks: tuple[Chunk, ...],
    name: str,
    dtype: str,
    shape: tuple[int, ...],
    files: dict[str, int],
    where: str,
    boxes: _Boxes | None = None,
) -> None:
    """Each chunk of entry ``name`` lies inside its tensor and inside a listed file,
    its byte range fits its shape, and it has one checksum per block of rows.
    ``boxes``, the chunks' offsets and shapes as arrays, if the tensor has many.

    This runs for every chunk of every tensor (100,000 chunks may make one tensor):
    each check is written out, with no helper call on the path of a valid chunk.
    msgspec checked the numbers' types and ranges and the strings' types.
    """
    n = len(shape)
    item = DTYPES[dtype].itemsize
    one_by_one = chunks  # unless arrays show all fit (the loop names the first that does not)
    if boxes is not None and _chunks_fit(chunks, boxes, shape, item, files):
        one_by_one = ()
    for c in one_by_one:
        size = files.get(c.file)  # names in `files` were checked already
        if size is None:
            raise _corrupt(where, f"entry {name!r} names file {c.file!r:.200} not listed in files")
        offsets, cshape = c.offsets, c.shape
        if len(offsets) != n or len(cshape) != n:
            what = "offsets" if len(offsets) != n else "shape"
            raise _corrupt(
                where, f"chunk {what} of {name!r} must be a list of {n} ints, one per dimension"
            )
        if cshape != shape:  # a whole tensor (offsets in range only if all 0) needs no more
            for o, k, d in zip(offsets, cshape, shape):
                if o + k > d:
                    raise _corrupt(
                        where, f"a chunk of {name!r} lies outside its shape {list(shape)}"
                    )
        elif any(offsets):
            raise _corrupt(where, f"a chunk of {name!r} lies outside its shape {list(shape)}")
        begin, end = c.byte_range
        if end - begin != math.prod(cshape) * item or end > size:
            raise _corrupt(
                where,
                f"chunk of {name!r} has byte_range [{begin}, {end}] inconsistent with its "
                f"shape or with the size of {c.file}",
            )
        rows = cshape[0] if cshape else 1
        if len(c.checksums) != max(1, -(-rows // c.block_rows)):
            raise _bad_checksums(name, c.checksums, c.block_rows, where)
    # Strings of 16 characters (decoded so): one match checks every digest.
    if not _HEX.fullmatch("".join([d for c in chunks for d in c.checksums])):
        bad = next(c for c in chunks if not _HEX.fullmatch("".join(c.checksums)))
        raise _bad_checksums(name, bad.checksums, bad.block_rows, where)


class _Boxes(NamedTuple):
    """The offsets and shapes of a tensor's many chunks, one row per chunk."""

    lo: np.ndarray
    size: np.ndarray


# From this many chunks a tensor's chunks are checked on arrays: building them costs
# more than it saves for a few chunks.
_ARRAY_CHUNKS = 32


def _boxes(chunks: tuple[Chunk, ...], n: int) -> _Boxes | None:
    """The chunks' boxes as arrays; None if one has not ``n`` offsets and ``n`` sizes."""
    offsets, shapes = [c.offsets for c in chunks], [c.shape for c in chunks]
    if set(map(len, offsets)) != {n} or set(map(len, shapes)) != {n}:
        return None
    count = len(chunks)
    lo = np.fromiter(chain.from_iterable(offsets), np.int64, count * n)
    size = np.fromiter(chain.from_iterable(shapes), np.int64, count * n)
    return _Boxes(lo.reshape(count, n), size.reshape(count, n))


def _chunks_fit(
    chunks: tuple[Chunk, ...],
    boxes: _Boxes,
    shape: tuple[int, ...],
    item: int,
    files: dict[str, int],
) -> bool:
    """Whether every chunk passes ``_check_chunks``' loop, checked on arrays (one per
    field) instead of chunk by chunk; False sends the caller to the loop for the error."""
    sizes = list(map(files.get, [c.file for c in chunks]))
    if None in sizes:
        return False
    lo, size = boxes
    if not (size <= np.array(shape, np.int64) - lo).all():  # lo + size may overflow int64
        return False
    count = len(chunks)
    span = np.fromiter(chain.from_iterable([c.byte_range for c in chunks]), np.int64, count * 2)
    begin, end = span[0::2], span[1::2]
    # Inside the tensor, a chunk's volume is at most the tensor's: no product overflows.
    if not ((end - begin == size.prod(axis=1) * item) & (end <= np.array(sizes))).all():
        return False
    blocks = np.fromiter(map(len, [c.checksums for c in chunks]), np.int64, count)
    block_rows = np.fromiter([c.block_rows for c in chunks], np.int64, count)
    need = np.maximum(1, -(-size[:, 0] // block_rows))
    return bool((blocks == need).all())


def _whole_chunks_fit(
    whole: list[tuple[str, str, tuple[int, ...], int, Chunk]], files: dict[str, int]
) -> bool:
    """Whether every chunk that is a whole tensor (name, dtype, shape, bytes, chunk;
    its shape checked equal to the tensor's) passes ``_check_chunks``, checked on
    arrays (one pass per field) instead of entry by entry: an index of 100,000 small
    tensors holds 100,000 of them. False sends the caller to the loop for the error."""
    chunks = [w[4] for w in whole]
    sizes = [files.get(c.file) for c in chunks]
    if None in sizes:
        return False
    offsets = [c.offsets for c in chunks]
    if any(map(any, offsets)) or list(map(len, offsets)) != [len(w[2]) for w in whole]:
        return False
    count = len(chunks)
    span = np.fromiter(chain.from_iterable([c.byte_range for c in chunks]), np.int64, count * 2)
    begin, end = span[0::2], span[1::2]
    nbytes = np.fromiter([w[3] for w in whole], np.int64, count)
    if not ((end - begin == nbytes) & (end <= np.array(sizes, np.int64))).all():
        return False
    rows = np.fromiter([w[2][0] if w[2] else 1 for w in whole], np.int64, count)
    block_rows = np.fromiter([c.block_rows for c in chunks], np.int64, count)
    blocks = np.fromiter(map(len, [c.checksums for c in chunks]), np.int64, count)
    if not (blocks == np.maximum(1, -(-rows // block_rows))).all():
        return False
    # Strings of 16 characters (decoded so): one match checks every digest.
    return _HEX.fullmatch("".join([d for c in chunks for d in c.checksums])) is not None


def _bad_checksums(name: str, digests: Any, block_rows: Any, where: str) -> CorruptCheckpointError:
    return _corrupt(
        where,
        f"chunk of {name!r} has malformed checksums {digests!r:.80} (need one per "
        f"{block_rows} rows, each 16 lowercase hex digits)",
    )


def _check_cover(
    name: str,
    shape: tuple[int, ...],
    chunks: tuple[Chunk, ...],
    where: str,
    boxes: _Boxes | None = None,
) -> None:
    """The chunks must tile the tensor exactly: volumes add up and no two overlap.

    With the volumes equal to the tensor's, "no overlap" is all that is left, checked
    without comparing chunks pairwise (a tensor may be stored as 100,000 chunks):
    dimensions every chunk spans whole are dropped; one split dimension is a sort; a
    grid (DTensor shardings, row pieces of them) is matched cell by cell; two split
    dimensions of any shape are a sweep over the first with the second's intervals
    kept sorted. Only three or more irregularly split dimensions fall back to
    comparing the chunks that are open at the same time in the sweep. Many chunks
    (``boxes``: checked to lie inside the tensor) are sorted and matched as arrays.
    """
    if len(chunks) == 1 and chunks[0].shape == shape:
        return  # the whole tensor (its offsets are 0: chunks are checked to lie inside)
    if boxes is not None:
        volume = sum(boxes.size.prod(axis=1).tolist())  # each fits int64; their sum may not
    else:
        volume = sum(map(math.prod, [c.shape for c in chunks]))
    if volume != math.prod(shape):
        raise _corrupt(where, f"the chunks of {name!r} do not cover its shape {list(shape)}")
    if boxes is not None:
        disjoint = _disjoint_arrays(boxes, shape)
    else:
        pieces = [(c.offsets, c.shape) for c in chunks if math.prod(c.shape)]
        if len(pieces) < 2:
            return
        split = [
            d for d, size in enumerate(shape) if any(o[d] != 0 or s[d] != size for o, s in pieces)
        ]
        disjoint = bool(split) and _disjoint(
            [[(o[d], o[d] + s[d]) for d in split] for o, s in pieces]
        )
    if not disjoint:
        raise _corrupt(where, f"two chunks of {name!r} overlap")


def _disjoint_arrays(boxes: _Boxes, shape: tuple[int, ...]) -> bool:
    """``_disjoint`` of the boxes that are not empty, on arrays."""
    lo, size = boxes
    filled = size.all(axis=1)
    if not filled.all():
        lo, size = lo[filled], size[filled]
    if len(lo) < 2:
        return True
    hi = lo + size
    split = np.flatnonzero(((lo != 0) | (hi != np.array(shape, np.int64))).any(axis=0))
    if not len(split):
        return False  # two chunks, each the whole tensor
    lo, hi = lo[:, split], hi[:, split]
    if len(split) == 1:
        order = np.argsort(lo[:, 0])
        return bool((hi[order[:-1], 0] <= lo[order[1:], 0]).all())
    cells = []  # the grid drawn by every chunk's edges, as _grid_cells_distinct
    for d in range(len(split)):
        edges = np.unique(np.concatenate([lo[:, d], hi[:, d]]))
        first = np.searchsorted(edges, lo[:, d])
        if not (np.searchsorted(edges, hi[:, d]) == first + 1).all():
            break  # spans several cells: not a grid
        cells.append(first)
    else:
        return len(np.unique(np.stack(cells, axis=1), axis=0)) == len(lo)
    return _sweep_disjoint([list(zip(a, b)) for a, b in zip(lo.tolist(), hi.tolist())])


Box = list[tuple[int, int]]  # [lo, hi) per dimension


def _disjoint(boxes: list[Box]) -> bool:
    if len(boxes[0]) == 1:
        spans = sorted(b[0] for b in boxes)
        return all(a[1] <= b[0] for a, b in zip(spans, spans[1:]))
    if _grid_cells_distinct(boxes):
        return True
    return _sweep_disjoint(boxes)


def _grid_cells_distinct(boxes: list[Box]) -> bool:
    """Every box is one cell of the grid drawn by all boxes' edges, and no cell is
    taken twice (then no two overlap). False if the boxes do not form a grid."""
    rank: list[dict[int, int]] = []
    for d in range(len(boxes[0])):
        edges = sorted({e for b in boxes for e in b[d]})
        rank.append({e: i for i, e in enumerate(edges)})
    cells = set()
    for b in boxes:
        cell = []
        for (lo, hi), r in zip(b, rank):
            if r[hi] != r[lo] + 1:
                return False  # spans several cells: not a grid in this dimension
            cell.append(r[lo])
        cells.add(tuple(cell))
    return len(cells) == len(boxes)


def _sweep_disjoint(boxes: list[Box]) -> bool:
    """Sweep along the first dimension; the boxes open at a coordinate must be disjoint
    in the others. With two dimensions the open intervals are kept sorted, so a new
    one is compared with its two neighbours only."""
    events = sorted(
        [(b[0][1], 0, i) for i, b in enumerate(boxes)]  # ends first: intervals are [lo, hi)
        + [(b[0][0], 1, i) for i, b in enumerate(boxes)]
    )
    if len(boxes[0]) == 2:
        starts: list[int] = []  # open intervals of dimension 1, sorted (they are disjoint)
        ends: list[int] = []
        for _, is_start, i in events:
            lo, hi = boxes[i][1]
            at = bisect.bisect_left(starts, lo)
            if not is_start:
                del starts[at], ends[at]
                continue
            if (at > 0 and ends[at - 1] > lo) or (at < len(starts) and starts[at] < hi):
                return False
            starts.insert(at, lo)
            ends.insert(at, hi)
        return True
    open_: dict[int, Box] = {}
    for _, is_start, i in events:
        if not is_start:
            del open_[i]
            continue
        rest = boxes[i][1:]
        for other in open_.values():
            if all(a < d and c < b for (a, b), (c, d) in zip(rest, other[1:])):
                return False
        open_[i] = boxes[i]
    return True


def marker_json(index_bytes: bytes, checkpoint: str | None = None) -> bytes:
    """The marker of a commit of ``index_bytes``. ``checkpoint`` names the checkpoint
    across its copies (node-local copies have an index each; the remote copy has the
    first node's): the checksum of that index, which is the default."""
    digest = checksum(index_bytes)
    doc = {"format": FORMAT_NAME, "index_checksum": digest, "checkpoint": checkpoint or digest}
    return json.dumps(doc).encode()


def checkpoint_id(note: bytes) -> str | None:
    """The ``checkpoint`` a marker or a ``PRUNED`` note names (older markers: their
    index checksum); None if unreadable."""
    try:
        doc = json.loads(note.decode("utf-8"))
        found = doc.get("checkpoint", doc.get("index_checksum"))
    except (UnicodeDecodeError, ValueError, AttributeError):
        return None
    return found if isinstance(found, str) else None


def check_marker(marker: bytes, index_bytes: bytes, where: str) -> None:
    """The marker records the checksum of the index it committed; a swapped index fails here."""
    try:
        doc = json.loads(marker.decode("utf-8"))
        recorded = doc["index_checksum"]
    except (UnicodeDecodeError, ValueError, KeyError, TypeError):
        raise CorruptCheckpointError(f"{where}: unreadable commit marker {MARKER_NAME}") from None
    if recorded != checksum(index_bytes):
        raise CorruptCheckpointError(
            f"{where}: {INDEX_NAME} does not match the index that was committed (it was replaced "
            "or damaged after commit); restore it from a copy or use an earlier checkpoint"
        )
