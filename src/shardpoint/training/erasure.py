"""Erasure-coded redundancy for the memory tier: where the parity of a group of ranks
lives, and the codecs that compute and use it.

A parity group is the same local rank on ``data + parity`` consecutive nodes (the last
group of the job takes the nodes left over, so it may be larger). Each member's copy is
cut into ``k`` chunks (``k``: the group's size less ``m``), and the group forms one
codeword per member position, RAID-6 fashion: codeword ``j``'s parity is held by the
members at positions ``j, j+1, …, j+m-1`` (mod the group's size) and its data chunks
come from the other ``k`` members, one each. Every piece of a codeword is on another
node, so any ``m`` lost nodes of a group lose at most ``m`` pieces of each codeword,
and every member holds ``m`` parity chunks of ``1/k`` of a copy: ``(k+m)/k`` of the
memory one copy costs, where full replicas cost ``1 + replicas``.

Codecs (measured in docs/benchmarks.md, "Erasure codes for the memory tier"): XOR in
numpy for ``m = 1`` (close to memcpy, releases the GIL); Reed-Solomon from ISA-L
through ``pyeclib`` (``isa_l_rs_cauchy``) for ``m >= 2``, stripe by stripe.
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import cached_property

import numpy as np

from ..errors import CheckpointError

# pyeclib calls stay at most this much group data each: larger calls run several
# times slower (every call allocates its fragments) and 2 GiB ones crash.
RS_STRIPE_BYTES = 128 * 1024
RS_BACKEND = "isa_l_rs_cauchy"  # ISA-L's Vandermonde matrix is not always invertible
FRAGMENT_HEADER = 80  # bytes pyeclib puts before every fragment's payload


@dataclass(frozen=True)
class Placement:
    """One parity group: its ranks by position (``members``) and ``m`` parity pieces per
    codeword (``k = len(members) - m`` data pieces)."""

    members: tuple[int, ...]
    m: int

    @property
    def k(self) -> int:
        return len(self.members) - self.m

    def position(self, rank: int) -> int:
        return self.members.index(rank)

    def holders(self, j: int) -> list[int]:
        """Positions holding codeword ``j``'s parity: parity piece ``t`` at ``holders[t]``."""
        return [(j + t) % len(self.members) for t in range(self.m)]

    def data(self, j: int) -> list[int]:
        """Positions giving codeword ``j``'s data: data piece ``d`` from ``data[d]``."""
        held = set(self.holders(j))
        return [p for p in range(len(self.members)) if p not in held]

    def chunks(self, p: int) -> list[int]:
        """The codewords member ``p`` gives data to: its chunk ``c`` goes to ``chunks[c]``."""
        return [j for j in range(len(self.members)) if p in self.data(j)]

    def chunk_bytes(self, sizes: list[int]) -> int:
        """One chunk's size for the whole group: the largest copy cut in ``k``, rounded up
        to what the codec works on (smaller copies are padded with zeros)."""
        grain = 8 if self.m == 1 else rs_width(self.k)
        need = -(-max(sizes, default=0) // self.k)
        return max(-(-need // grain) * grain, grain)


def placement(rank: int, world: int, per_node: int, data: int, parity: int) -> Placement:
    """The parity group of ``rank``: the same local rank on ``data + parity`` nodes."""
    if world % per_node:
        raise CheckpointError(
            f"ErasureCode needs the same number of ranks on every node: {world} ranks are "
            f"not a multiple of {per_node} per node (LOCAL_WORLD_SIZE)"
        )
    nodes = max(world // max(per_node, 1), 1)
    size = data + parity
    if nodes < size:
        raise CheckpointError(
            f"ErasureCode(data={data}, parity={parity}) needs {size} nodes (every piece of "
            f"a codeword on another node); this job has {nodes} nodes of {per_node} ranks: lower "
            "data or parity, or use Replicas(1)"
        )
    groups = nodes // size
    node, local = divmod(rank, per_node)
    g = min(node // size, groups - 1)
    last = nodes if g == groups - 1 else (g + 1) * size
    return Placement(tuple(n * per_node + local for n in range(g * size, last)), parity)


def _xor(pieces: list[np.ndarray]) -> np.ndarray:
    """The XOR of equal-sized pieces (sizes a multiple of 8: XORed as uint64 words)."""
    out = pieces[0].copy()
    words = out.view(np.uint64)
    for piece in pieces[1:]:
        words ^= piece.view(np.uint64)
    return out


def rs_width(k: int) -> int:
    """Bytes of each data chunk per pyeclib call: a multiple of 64, so that a stripe's
    fragments carry exactly that much payload (no alignment padding)."""
    return max(RS_STRIPE_BYTES // k // 64 * 64, 64)


class Codec:
    """Computes a codeword's ``m`` parity chunks from its ``k`` data chunks, and any of
    its pieces from any ``k`` others. Pieces are 1-D uint8 arrays of one size, indexed
    0..k-1 (data) then k..k+m-1 (parity)."""

    def __init__(self, k: int, m: int) -> None:
        self.k, self.m = k, m

    def check(self) -> None:
        """Raise now (a ``CheckpointError`` naming the fix) if this codec cannot run here:
        pyeclib missing, or its backend not in the wheel."""
        if self.m > 1:
            try:
                self._headers  # noqa: B018 - builds the driver and encodes one stripe
            except CheckpointError:
                raise
            except Exception as exc:
                raise CheckpointError(
                    f"ErasureCode(parity={self.m}): pyeclib's {RS_BACKEND} does not work "
                    f"here ({type(exc).__name__}: {exc}); use parity=1 or Replicas"
                ) from exc

    def encode(self, chunks: list[np.ndarray]) -> list[np.ndarray]:
        if self.m == 1:
            return [_xor(chunks)]
        width = rs_width(self.k)
        out = [np.empty_like(chunks[0]) for _ in range(self.m)]
        for lo in range(0, chunks[0].size, width):
            stripe = b"".join(c[lo : lo + width].tobytes() for c in chunks)
            fragments = self._driver.encode(stripe)
            for t in range(self.m):
                out[t][lo : lo + width] = np.frombuffer(fragments[self.k + t], np.uint8)[
                    FRAGMENT_HEADER:
                ]
        return out

    def rebuild(self, pieces: dict[int, np.ndarray], want: int) -> np.ndarray:
        """Piece ``want`` from ``k`` others (``pieces``: index -> piece)."""
        if len(pieces) < self.k:
            raise CheckpointError(f"rebuilding needs {self.k} pieces, got {len(pieces)}")
        if self.m == 1:  # any piece is the XOR of all the others
            return _xor(list(pieces.values()))
        width = rs_width(self.k)
        some = next(iter(pieces.values()))
        out = np.empty_like(some)
        for lo in range(0, some.size, width):
            fragments = [self._headers[i] + p[lo : lo + width].tobytes() for i, p in pieces.items()]
            rebuilt = self._driver.reconstruct(fragments, [want])[0]
            out[lo : lo + width] = np.frombuffer(rebuilt, np.uint8)[FRAGMENT_HEADER:]
        return out

    @cached_property
    def _driver(self):  # noqa: ANN202 - pyeclib is optional: imported when m >= 2
        try:
            from pyeclib.ec_iface import ECDriver
        except ImportError as exc:
            raise CheckpointError(
                f"ErasureCode(parity={self.m}) needs pyeclib (Reed-Solomon from ISA-L): "
                "pip install 'shardpoint[erasure]'; parity=1 needs nothing"
            ) from exc
        return ECDriver(k=self.k, m=self.m, ec_type=RS_BACKEND)

    @cached_property
    def _headers(self) -> list[bytes]:
        """pyeclib's fragment headers for a stripe of this size: the same for every stripe
        of one size (they carry no checksum), so they are made again, never stored."""
        width = rs_width(self.k)
        return [f[:FRAGMENT_HEADER] for f in self._driver.encode(bytes(width * self.k))]
