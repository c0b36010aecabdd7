"""Compressed copies of shard files (docs/format.md, "Compressed files").

A tier that compresses (``RemoteTier(compress=True)``) stores ``NAME`` as
``NAME.zst``: the file cut into blocks of ``block`` bytes, each compressed into its own
zstd frame (with zstd's frame checksum), then a JSON table of the frames' compressed
sizes, then a 16-byte footer (the table's length, little-endian, and a magic). Any
byte range is read by fetching and decompressing only the frames it overlaps. This is
not a safetensors file; the index, checksums and readers see the original bytes.
"""

from __future__ import annotations

import json
import struct
import threading
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass
from typing import Any

from ..errors import CheckpointError, CorruptCheckpointError
from .safetensors import int_in

SUFFIX = ".zst"
MAGIC = b"SPZSTD01"
FOOTER = 16
BLOCK = 4 * 1024 * 1024  # partial reads fetch at most one extra block at each end
MAX_BLOCK = 64 * 1024 * 1024  # what a reader accepts: one block is held in memory
MAX_TABLE = 64 * 1024 * 1024  # ~8 million frames: 32 TB of file at the default block
LEVEL = 3
_TABLE_FORMAT = "shardpoint-compressed"
_DAMAGED = "the copy is damaged, load another one"


def _zstd() -> Any:
    try:
        import zstandard
    except ImportError:
        raise CheckpointError(
            "compressed files need the zstandard package: pip install 'shardpoint[compression]'"
        ) from None
    return zstandard


@dataclass(frozen=True)
class Table:
    """Where each block's frame is in a compressed file."""

    size: int  # of the original file
    block: int
    starts: tuple[int, ...]  # byte offset of each frame in the compressed file, and the end

    def frames(self, lo: int, hi: int) -> range:
        """The frames holding original bytes [lo, hi)."""
        return range(lo // self.block, -(-hi // self.block))


def compress(blocks: Iterable[memoryview], size: int, map_: Callable = map) -> Iterator[bytes]:
    """The compressed file of the ``size`` bytes in ``blocks`` (any sizes, in order):
    frames as they are ready, then the table and the footer. ``map_`` may run the
    compression of several blocks at once (zstd releases the GIL)."""
    zstd = _zstd()
    local = threading.local()  # a compressor may not be shared by threads

    def compress_block(block: bytes) -> bytes:
        if not hasattr(local, "compressor"):
            local.compressor = zstd.ZstdCompressor(level=LEVEL, write_checksum=True)
        return local.compressor.compress(block)

    sizes: list[int] = []

    def frames() -> Iterator[bytes]:
        pending = bytearray()
        for view in blocks:
            pending += view
            while len(pending) >= BLOCK:
                yield bytes(pending[:BLOCK])
                del pending[:BLOCK]
        if pending or not size:
            yield bytes(pending)

    for frame in map_(compress_block, frames()):
        sizes.append(len(frame))
        yield frame
    table = json.dumps(
        {"format": _TABLE_FORMAT, "codec": "zstd", "size": size, "block": BLOCK, "frames": sizes},
        separators=(",", ":"),
    ).encode()
    yield table + struct.pack("<Q", len(table)) + MAGIC


def parse_table(footer_and_more: bytes, total: int, where: str, read: Callable) -> Table:
    """The table of a compressed file of ``total`` bytes, from its last bytes
    (``footer_and_more``, at least the footer); ``read(lo, hi)`` fetches more."""
    if total < FOOTER or len(footer_and_more) < FOOTER or footer_and_more[-8:] != MAGIC:
        raise CorruptCheckpointError(f"{where}: not a shardpoint compressed file")
    (n,) = struct.unpack("<Q", footer_and_more[-FOOTER:-8])
    if not 0 < n <= min(total - FOOTER, MAX_TABLE):
        raise CorruptCheckpointError(f"{where}: its frame table has an impossible length {n}")
    tail = footer_and_more[:-FOOTER]
    raw = tail[-n:] if len(tail) >= n else read(total - FOOTER - n, total - FOOTER)
    try:
        doc = json.loads(raw)
        size, block, sizes = doc["size"], doc["block"], doc["frames"]
        ok = doc.get("format") == _TABLE_FORMAT and doc.get("codec") == "zstd"
    except (ValueError, KeyError, TypeError, RecursionError):
        ok = False
    if not ok or not int_in(size) or not int_in(block, 1) or block > MAX_BLOCK:
        raise CorruptCheckpointError(f"{where}: its frame table is malformed")
    if type(sizes) is not list:
        raise CorruptCheckpointError(f"{where}: its frame table is malformed")
    if len(sizes) != max(1, -(-size // block)) or not all(int_in(s, 1) for s in sizes):
        raise CorruptCheckpointError(f"{where}: its frame table does not fit its size")
    starts = [0]
    for s in sizes:
        starts.append(starts[-1] + s)
    if starts[-1] != total - FOOTER - n:
        raise CorruptCheckpointError(f"{where}: its frames do not add up to the file")
    return Table(size, block, tuple(starts))


def decompress(table: Table, first: int, data: bytes, lo: int, hi: int, where: str) -> bytes:
    """Original bytes [lo, hi) from ``data``: the compressed frames from frame ``first``
    on, starting at that frame's offset."""
    zstd = _zstd()
    out = bytearray()
    base = table.starts[first]
    for i in table.frames(lo, hi):
        expected = min(table.block, table.size - i * table.block)
        frame = data[table.starts[i] - base : table.starts[i + 1] - base]
        try:
            # The frame's own header says its size: check it before inflating anything
            # (a damaged or hostile header must not make a reader allocate gigabytes).
            if zstd.frame_content_size(frame) != expected:
                raise zstd.ZstdError(f"its header says another size than {expected} bytes")
            block = zstd.ZstdDecompressor().decompress(frame)
        except zstd.ZstdError as exc:
            raise CorruptCheckpointError(
                f"{where}: block {i} cannot be decompressed ({exc}); {_DAMAGED}"
            ) from None
        if len(block) != expected:
            raise CorruptCheckpointError(f"{where}: block {i} has {len(block)} bytes")
        out += block
    skip = lo - table.frames(lo, hi).start * table.block
    return bytes(out[skip : skip + hi - lo])
