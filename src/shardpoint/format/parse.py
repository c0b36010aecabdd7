"""Reading ``index.json`` and chunk fragments: strict decoding into ``index``'s records.

Parsing is strict: anything the index claims is checked for type and range (every
number an int, not a bool or a float, that fits in int64; every string valid Unicode),
and file names must be plain names inside the checkpoint directory, before any shard
byte is read. An index may list millions of chunks: msgspec decodes them into typed
records and checks their numbers in C; what relates one field to another (a chunk
inside its tensor, inside its file: ``coverage``) is checked here.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import msgspec

from .. import tree as tree_codec
from ..errors import CorruptCheckpointError
from ..gc_pause import gc_paused
from ..sharding import Mesh, Sharding
from .coverage import (
    _ARRAY_CHUNKS,
    _HEX,
    _bad_checksums,
    _boxes,
    _check_chunks,
    _check_cover,
    _corrupt,
    _whole_chunks_fit,
)
from .index import (
    CHECKSUM_ALGORITHM,
    FORMAT_NAME,
    FORMAT_VERSION,
    FRAGMENT_FORMAT,
    INDEX_NAME,
    Chunk,
    Fragment,
    Index,
    TensorEntry,
    _UInt64,
    check_file_name,
)
from .safetensors import (
    DTYPES,
    TOO_LARGE,
    int64s,
    int_in,
    lone_surrogate,
    strict_json,
    tensor_nbytes,
)


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
