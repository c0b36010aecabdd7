"""The index's records (chunks, tensor entries, the index, fragments) and their JSON.

``docs/format.md`` is the specification; ``format/`` is its only implementation. This
module holds what an index is made of and writes it: the records, the JSON they are
written as, the checksums of chunks (xxh3-64, block by block) and the names an index
gives shard files. Reading and checking an index is ``parse`` (chunk placement:
``coverage``); the commit marker is ``marker``.
"""

from __future__ import annotations

import json
import math
import re
from dataclasses import dataclass, field
from typing import Annotated, Any

import msgspec
import xxhash

from .. import tree as tree_codec
from ..errors import CorruptCheckpointError, UnsupportedValueError
from ..sharding import Mesh, Sharding
from .safetensors import INT64_MAX, itemsize

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


def block_count(rows: Any, block_rows: Any) -> Any:
    """How many checksum blocks cover ``rows`` rows (ints, or int64 arrays alike): one
    per ``block_rows`` rows, the last maybe short, and one (of no bytes) for no rows."""
    return -(-rows // block_rows) + (rows == 0)


def block_checksums(data: Any, shape: tuple[int, ...], itemsize: int, block_rows: int) -> list[str]:
    """Checksums of ``data`` (the chunk's bytes, a buffer) block by block."""
    step = block_rows * (math.prod(shape[1:]) * itemsize if shape else itemsize)
    rows = shape[0] if shape else 1
    blocks = block_count(rows, block_rows)
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


_ENCODE = msgspec.json.Encoder()


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
