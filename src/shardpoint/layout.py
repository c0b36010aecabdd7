"""Layout: this rank's pieces packed into shard files, and every piece's place in them.

Files are filled greedily in state order up to ``max_shard_size`` and end before their
header could pass ``HEADER_BUDGET``; headers are padded so large tensors can be written
zero-copy (``_data_start_mod``). ``chunk_records`` turns placed pieces into the
index's records once their checksums are known.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import TypeVar

import torch

from .format.index import Chunk, block_rows_for, checksum
from .format.safetensors import (
    MAX_HEADER_BYTES,
    PAGE,
    TensorSlot,
    dtype_name,
    encode_header,
    itemsize,
    layout,
)
from .names import shard_file
from .plan import Piece
from .save_plan import SavePlan
from .save_records import ChunkRecord
from .storage.io_types import ZERO_COPY_MIN_BYTES
from .tensor_memory import flat_bytes

T = TypeVar("T")
SHARD_METADATA = {"format": "pt"}  # what the Hugging Face loaders expect in each file


@dataclass
class ShardFile:
    """One shard file of this rank: its header and where each piece's bytes go."""

    name: str
    size: int
    header: torch.Tensor  # uint8, padded; the file's first bytes
    placed: list[PlacedPiece]

    @property
    def header_checksum(self) -> str:
        """What the index records of the header, so a load need not parse it."""
        return checksum(self.header.numpy())


def lay_out(plan: SavePlan, max_shard_size: int, *, zero_copy: bool) -> list[ShardFile]:
    """Pack this rank's pieces into files and place every piece's bytes.

    ``zero_copy`` pads headers so large tensors land at their memory's page offset
    (direct I/O straight from tensor memory, see ``_data_start_mod``).
    """
    by_key = {_piece_key(p): p for p in plan.pieces}
    data = {key: piece_data(p, plan.local[p.name]) for key, p in by_key.items()}
    shards = []
    for file, keys in _pack(list(by_key), data, max_shard_size, plan.rank).items():
        slots = layout([(k, dtype_name(data[k].dtype), tuple(data[k].shape)) for k in keys])
        mod = _data_start_mod(slots, data) if zero_copy else None
        header = encode_header(slots, SHARD_METADATA, mod)
        data_start = len(header)
        placed = [
            PlacedPiece(
                by_key[key],
                key,
                file,
                slot,
                data_start,
                flat_bytes(data[key]),
                block_rows_for(slot.shape, itemsize(slot.dtype)),
            )
            for key, slot in slots.items()
        ]
        size = data_start + sum(s.nbytes for s in slots.values())
        header_bytes = torch.frombuffer(bytearray(header), dtype=torch.uint8)
        shards.append(ShardFile(file, size, header_bytes, placed))
    return shards


def chunk_records(
    placed: list[PlacedPiece], checksums: list[list[str]], identities: list[str | None]
) -> list[ChunkRecord]:
    """The index records of written pieces (``identities``: incremental saves)."""
    return [
        ChunkRecord(
            p.piece.name,
            p.piece.source.dtype,
            tuple(p.piece.source.global_shape),
            Chunk(
                p.file,
                p.key,
                tuple(p.piece.offsets),
                tuple(p.piece.shape),
                (p.begin, p.end),
                p.block_rows,
                tuple(digest),
            ),
            (p.piece.source.offsets, p.piece.source.shape) if p.piece.source.replicated else None,
            ident,
        )
        for p, digest, ident in zip(placed, checksums, identities)
    ]


# Built per tensor: a frozen dataclass costs five times as much to build.
@dataclass(slots=True, unsafe_hash=True)
class PlacedPiece:
    """A piece placed in a shard file, and what its index record needs."""

    piece: Piece
    key: str
    file: str
    slot: TensorSlot
    data_start: int
    raw: torch.Tensor  # the bytes written
    block_rows: int

    @property
    def begin(self) -> int:
        return self.data_start + self.slot.begin

    @property
    def end(self) -> int:
        return self.data_start + self.slot.end


def _piece_key(p: Piece) -> str:
    """The name inside the shard file: the entry name when the piece is the whole tensor."""
    if p.shape == p.source.global_shape:
        return p.name
    return f"{p.name}@{','.join(map(str, p.offsets))}"


def piece_data(p: Piece, local: torch.Tensor) -> torch.Tensor:
    """The bytes of a piece: rows of the holding's local tensor (contiguous)."""
    if p.shape == p.source.shape:
        return local
    start = p.offsets[0] - p.source.offsets[0]
    return local.narrow(0, start, p.shape[0])


def _data_start_mod(slots: dict[str, TensorSlot], tensors: dict[str, torch.Tensor]) -> int | None:
    """Where in a page the data should start so most large tensors move zero-copy.

    Direct I/O can skip the bounce buffer for a tensor whose address and file offset
    agree modulo the page size (storage/direct_io.py). Tensors from the CPU allocator share
    one such class (64 with glibc), so aligning the data start to it usually wins
    every large tensor in the file. Small files keep the minimal padding.
    """
    votes: dict[int, int] = {}
    for name, slot in slots.items():
        if slot.nbytes >= ZERO_COPY_MIN_BYTES:
            cls = (tensors[name].data_ptr() - slot.begin) % PAGE
            votes[cls] = votes.get(cls, 0) + slot.nbytes
    best = max(votes, key=votes.__getitem__, default=None)
    return best if best is not None and best % 8 == 0 else None


# A header entry beyond its name: dtype, shape, offsets and JSON punctuation (a generous
# bound; a key with offsets, "name@o0,o1", is counted as twice the name).
_HEADER_ENTRY_BYTES = 256
HEADER_BUDGET = MAX_HEADER_BYTES // 2


def _pack(
    names: list[str], tensors: dict[str, torch.Tensor], max_bytes: int, rank: int
) -> dict[str, list[str]]:
    """This rank's pieces (by key, in state order) into its shard files' names."""
    groups = pack_in_order(
        names, lambda n: n, lambda n: tensors[n].numel() * tensors[n].element_size(), max_bytes
    )
    return {shard_file(rank, i): group for i, group in enumerate(groups)}


def pack_in_order(
    items: Sequence[T], key: Callable[[T], str], nbytes: Callable[[T], int], max_bytes: int
) -> list[list[T]]:
    """Greedy packing in state order (saves and ``hf`` exports): related tensors stay
    together in one file; one larger than ``max_bytes`` gets a file of its own. A file
    also ends before its header could pass HEADER_BUDGET (readers, the reference library
    too, refuse one over MAX_HEADER_BYTES: a million tiny tensors of long names). Always
    at least one (maybe empty) file."""
    files: list[list[T]] = [[]]
    size = header = 0
    for item in items:
        n = nbytes(item)
        entry = len(key(item).encode()) * 2 + _HEADER_ENTRY_BYTES  # its key, at most, and fields
        if files[-1] and (size + n > max_bytes or header + entry > HEADER_BUDGET):
            files.append([])
            size = header = 0
        files[-1].append(item)
        size += n
        header += entry
    return files
