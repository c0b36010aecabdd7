"""The safetensors byte layout: building a header and strictly parsing one.

Layout (public safetensors specification): an unsigned 64-bit little-endian header
length N, then N bytes of UTF-8 JSON (starting with ``{``, padded with spaces so the
data starts 8-byte aligned), then the tensor bytes back to back. Each JSON entry is
``{"dtype", "shape", "data_offsets": [begin, end]}`` relative to the data start; the
optional ``__metadata__`` entry maps strings to strings. The tensors must cover the
data section exactly, without gaps or overlaps.
"""

from __future__ import annotations

import json
import math
import re
import struct
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch

from ..errors import CorruptCheckpointError

# safetensors dtype name -> torch dtype, for every dtype both libraries share.
DTYPES: dict[str, torch.dtype] = {
    "F64": torch.float64,
    "F32": torch.float32,
    "F16": torch.float16,
    "BF16": torch.bfloat16,
    "I64": torch.int64,
    "I32": torch.int32,
    "I16": torch.int16,
    "I8": torch.int8,
    "U64": torch.uint64,
    "U32": torch.uint32,
    "U16": torch.uint16,
    "U8": torch.uint8,
    "BOOL": torch.bool,
    "F8_E4M3": torch.float8_e4m3fn,
    "F8_E5M2": torch.float8_e5m2,
    "C64": torch.complex64,
}
# Newer float8 formats (the names the reference library writes), where torch has them.
for _name, _attr in (
    ("F8_E4M3FNUZ", "float8_e4m3fnuz"),
    ("F8_E5M2FNUZ", "float8_e5m2fnuz"),
    ("F8_E8M0", "float8_e8m0fnu"),
):
    if hasattr(torch, _attr):
        DTYPES[_name] = getattr(torch, _attr)
DTYPE_NAMES: dict[torch.dtype, str] = {v: k for k, v in DTYPES.items()}

METADATA_KEY = "__metadata__"
# Same bound as the reference implementation: a larger header is refused before any
# allocation, so a hostile length field cannot make us read or allocate gigabytes.
MAX_HEADER_BYTES = 100_000_000
ALIGNMENT = 8
PAGE = 4096
_LEN = struct.Struct("<Q")
_ENTRY_KEYS = frozenset(("dtype", "shape", "data_offsets"))
# Every dimension, element count, byte count, offset and size must fit in int64, the
# type torch, safetensors and the OS use for them.
INT64_MAX = 2**63 - 1
# A JSON escape that can decode to a lone surrogate (\ud800-\udfff): a fast filter
# before the exact check in ``lone_surrogate``.
_SURROGATE_ESCAPE = re.compile(r"\\u[dD][89a-fA-F]")
TOO_LARGE = (
    "too large for 64-bit sizes (its nonzero dimensions times the item size must be < 2**63 bytes)"
)
_DAMAGED = "the file is damaged: restore it from a copy or load an earlier checkpoint"


# Built per tensor: a frozen dataclass costs five times as much to build.
@dataclass(slots=True, unsafe_hash=True)
class TensorSlot:
    """Where one tensor lives in a safetensors file; offsets are relative to the data start."""

    dtype: str
    shape: tuple[int, ...]
    begin: int
    end: int

    @property
    def nbytes(self) -> int:
        return self.end - self.begin


@dataclass(frozen=True)
class Header:
    slots: dict[str, TensorSlot]
    metadata: dict[str, str]
    data_start: int  # absolute file offset of the first tensor byte


def dtype_name(dtype: torch.dtype) -> str:
    try:
        return DTYPE_NAMES[dtype]
    except KeyError:
        raise TypeError(
            f"dtype {dtype} has no safetensors name; supported: {sorted(DTYPES)}"
        ) from None


def itemsize(dtype: str) -> int:
    return DTYPES[dtype].itemsize


def encode_header(
    slots: dict[str, TensorSlot], metadata: dict[str, str] | None, data_start_mod: int | None = None
) -> bytes:
    """The length prefix plus padded JSON header for ``slots`` (in the given order).

    The spec allows any amount of space padding; ``data_start_mod`` (a multiple of 8)
    pads further so the data starts at that offset modulo the 4096-byte page, which
    lets page-aligned direct I/O reach the tensors without copies.
    """
    doc: dict[str, object] = {}
    if metadata:
        doc[METADATA_KEY] = metadata
    for name, slot in slots.items():
        doc[name] = {
            "dtype": slot.dtype,
            "shape": list(slot.shape),
            "data_offsets": [slot.begin, slot.end],
        }
    raw = json.dumps(doc, separators=(",", ":"), ensure_ascii=False).encode("utf-8")
    pad = -len(raw) % ALIGNMENT
    if data_start_mod is not None:
        pad = (data_start_mod - 8 - len(raw)) % PAGE
    return _LEN.pack(len(raw) + pad) + raw + b" " * pad


def layout(shapes: list[tuple[str, str, tuple[int, ...]]]) -> dict[str, TensorSlot]:
    """Back-to-back slots for ``(name, dtype, shape)`` in the given order."""
    slots: dict[str, TensorSlot] = {}
    pos = 0
    for name, dtype, shape in shapes:
        size = math.prod(shape) * itemsize(dtype)
        slots[name] = TensorSlot(dtype, tuple(shape), pos, pos + size)
        pos += size
    return slots


def _reject_duplicates(pairs: list[tuple[str, object]]) -> dict[str, object]:
    out = dict(pairs)  # built in C; it is smaller only if a key repeats
    if len(out) != len(pairs):
        seen: set[str] = set()
        for key, _ in pairs:
            if key in seen:
                raise ValueError(f"duplicate key {key!r}")
            seen.add(key)
    return out


def strict_json(text: str, **options: Any) -> Any:
    """``json.loads`` that refuses what JSON cannot hold: ``NaN``, ``Infinity`` and
    numbers too large for a float (``1e400``); Python's parser accepts them."""

    def no_constant(name: str) -> Any:
        raise ValueError(f"{name} is not a JSON number")

    def finite(literal: str) -> float:
        value = float(literal)
        if not math.isfinite(value):
            raise ValueError(f"{literal} is out of range for a JSON number")
        return value

    return json.loads(text, parse_constant=no_constant, parse_float=finite, **options)


def int_in(value: object, low: int = 0, high: int = INT64_MAX) -> bool:
    """``value`` is an int (not a bool, not a float) with ``low <= value <= high``.

    >>> int_in(3), int_in(True), int_in(3.0), int_in(-1), int_in(2**63)
    (True, False, False, False, False)
    """
    return type(value) is int and low <= value <= high


def int64s(value: object, length: int | None = None) -> tuple[int, ...] | None:
    """``value`` as a tuple if it is a list (of ``length`` items) of ``int_in`` values."""
    if type(value) is not list or (length is not None and len(value) != length):
        return None
    for v in value:  # int_in, inlined: this runs for every chunk of every tensor
        if type(v) is not int or v < 0 or v > INT64_MAX:
            return None
    return tuple(value)


def tensor_nbytes(dtype: str, shape: Sequence[int]) -> int | None:
    """Bytes of a ``dtype`` tensor of ``shape``; None if its sizes do not fit in int64.

    A zero dimension counts as 1 in the bound: torch derives strides from the other
    dimensions, so ``[0, 2**61, 4]`` overflows although it holds no element.

    >>> tensor_nbytes("F32", [2, 3]), tensor_nbytes("F32", [0, 2**70])
    (24, None)
    """
    size = itemsize(dtype)
    count = math.prod(shape)
    if count:  # no zero dimension: the bound is the size itself (the usual case)
        return count * size if count * size <= INT64_MAX else None
    bound = size
    for d in shape:
        bound *= d or 1
        if bound > INT64_MAX:
            return None
    return 0


def lone_surrogate(text: str, doc: object) -> str | None:
    """The first string in ``doc`` (parsed from the JSON ``text``) that is not valid
    Unicode, or None. JSON can spell a lone surrogate (``"\\ud800"``) but UTF-8 cannot
    encode one, so no writer produces it and printing or re-encoding it fails.

    >>> lone_surrogate('{"w\\\\ud800": 1}', {"w\\ud800": 1})
    'w\\ud800'
    """
    if not _SURROGATE_ESCAPE.search(text):  # the usual case: not even an escape like it
        return None
    stack = [doc]  # a loop, not recursion: the document may nest as deep as json allows
    while stack:
        node = stack.pop()
        if isinstance(node, dict):
            stack.extend(node)
            stack.extend(node.values())
        elif isinstance(node, list):
            stack.extend(node)
        elif isinstance(node, str) and not node.isascii():
            try:
                node.encode("utf-8")
            except UnicodeEncodeError:
                return node
    return None


def header_length(prefix: bytes, file_size: int, where: str) -> int:
    """Validate the 8-byte length prefix against the file size; returns N."""
    if len(prefix) < 8 or file_size < 8:
        raise CorruptCheckpointError(
            f"{where}: file is shorter than the 8-byte safetensors header length"
        )
    (n,) = _LEN.unpack(prefix[:8])
    if n > MAX_HEADER_BYTES:
        raise CorruptCheckpointError(
            f"{where}: header length {n} exceeds the {MAX_HEADER_BYTES}-byte limit; "
            "the file is corrupt"
        )
    if 8 + n > file_size:
        raise CorruptCheckpointError(
            f"{where}: header length {n} runs past the end of the {file_size}-byte file "
            "(truncated?)"
        )
    return n


def parse_header(header: bytes, file_size: int, where: str) -> Header:
    """Strictly parse ``header`` (the N JSON bytes) of a file of ``file_size`` bytes.

    Raises CorruptCheckpointError naming ``where`` for anything the spec forbids.
    """

    def bad(why: str) -> CorruptCheckpointError:
        return CorruptCheckpointError(f"{where}: invalid safetensors header: {why}; {_DAMAGED}")

    try:
        text = header.decode("utf-8")
    except UnicodeDecodeError as exc:
        raise bad(f"not UTF-8 ({exc})") from None
    if not text.startswith("{"):
        raise bad("does not start with '{'")
    try:
        doc = strict_json(text, object_pairs_hook=_reject_duplicates)
    except (ValueError, RecursionError) as exc:
        raise bad(f"not valid JSON ({exc})") from None
    if not isinstance(doc, dict):
        raise bad("top level is not a JSON object")
    invalid = lone_surrogate(text, doc)
    if invalid is not None:
        raise bad(
            f"the string {invalid!r:.200} is not valid Unicode (a lone surrogate), so not UTF-8"
        )

    metadata = doc.pop(METADATA_KEY, {})
    if not isinstance(metadata, dict) or not all(
        isinstance(k, str) and isinstance(v, str) for k, v in metadata.items()
    ):
        raise bad("__metadata__ must map strings to strings")

    data_start = 8 + len(header)
    data_len = file_size - data_start
    slots: dict[str, TensorSlot] = {}
    for name, entry in doc.items():
        if type(entry) is not dict or len(entry) != 3 or not _ENTRY_KEYS.issuperset(entry):
            raise bad(f"entry {name!r} must have exactly dtype, shape and data_offsets")
        dtype, shape, offsets = entry["dtype"], entry["shape"], entry["data_offsets"]
        if type(dtype) is not str or dtype not in DTYPES:  # a list would not even hash
            raise bad(f"entry {name!r} has unknown dtype {dtype!r}")
        if int64s(shape) is None:
            raise bad(
                f"entry {name!r} has an invalid shape {shape!r:.200} (need ints in [0, 2**63))"
            )
        expected = tensor_nbytes(dtype, shape)
        if expected is None:
            raise bad(f"entry {name!r} has shape {shape!r:.200}, {TOO_LARGE}")
        if int64s(offsets, 2) is None or not offsets[0] <= offsets[1] <= data_len:
            raise bad(
                f"entry {name!r} has data_offsets {offsets!r:.200} outside the {data_len}-byte data"
            )
        if offsets[1] - offsets[0] != expected:
            raise bad(
                f"entry {name!r} spans {offsets[1] - offsets[0]} bytes "
                f"but {dtype}{shape} needs {expected}"
            )
        slots[name] = TensorSlot(dtype, tuple(shape), offsets[0], offsets[1])

    pos = 0
    for name, slot in sorted(slots.items(), key=lambda kv: (kv[1].begin, kv[1].end)):
        if slot.begin != pos:
            kind = "overlaps the previous tensor" if slot.begin < pos else "leaves a gap"
            raise bad(f"entry {name!r} at byte {slot.begin} {kind} (expected {pos})")
        pos = slot.end
    if pos != data_len:
        raise bad(f"tensors cover {pos} bytes but the data section has {data_len}")
    return Header(slots, metadata, data_start)
