"""Where an index's chunks lie: each inside its tensor and its file, together tiling the tensor.

Each chunk must lie inside its tensor and inside a listed file, its byte range must fit
its shape, and it must have one checksum per block of rows; the chunks of a tensor must
cover it exactly once. A tensor may be stored as 100,000 chunks: nothing here compares
chunks pairwise, and from ``_ARRAY_CHUNKS`` chunks on the checks run on arrays.
"""

from __future__ import annotations

import bisect
import math
import re
from itertools import chain
from typing import Any, NamedTuple

import numpy as np

from ..errors import CorruptCheckpointError
from .index import Chunk, block_count
from .safetensors import DTYPES

_HEX = re.compile(r"[0-9a-f]*")
_DAMAGED = "the checkpoint is damaged, load an earlier one"


def _corrupt(where: str, why: str) -> CorruptCheckpointError:
    return CorruptCheckpointError(f"{where}: {why}; {_DAMAGED}")


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
    each check is written out, with no helper call on the path of a valid chunk but
    ``block_count`` (cheaper than the ``max`` it would be written out with).
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
        if len(c.checksums) != block_count(rows, c.block_rows):
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
    need = block_count(size[:, 0], block_rows)
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
    if not (blocks == block_count(rows, block_rows)).all():
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


Extent = list[tuple[int, int]]  # [lo, hi) per dimension; tensor_memory.Box is (lo, hi)


def _disjoint(boxes: list[Extent]) -> bool:
    if len(boxes[0]) == 1:
        spans = sorted(b[0] for b in boxes)
        return all(a[1] <= b[0] for a, b in zip(spans, spans[1:]))
    if _grid_cells_distinct(boxes):
        return True
    return _sweep_disjoint(boxes)


def _grid_cells_distinct(boxes: list[Extent]) -> bool:
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


def _sweep_disjoint(boxes: list[Extent]) -> bool:
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
    open_: dict[int, Extent] = {}
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
