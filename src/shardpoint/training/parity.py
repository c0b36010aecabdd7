"""The memory tier's parity protocol: how a parity group's ranks make, keep and use the
erasure-code parity of their copies (``training/erasure.py`` says where each piece
lives and computes it).

A rank's copy is read as one stream of its files in commit order (``spans``), cut
into ``k`` chunks of ``chunk_bytes``; per codeword the data members send their chunk
to the parity holders (``send_parity``), which keep their parity piece as
``codewordJ.bin`` with the checksums of every piece of it in ``parity.json``, written
last: a parity copy without it is not used. A rank that lost its copy gets ``k``
pieces per codeword, checks each against its checksum and decodes its chunks into a
partial copy that becomes the copy only once complete (``Rebuild``).
"""

from __future__ import annotations

import json
import os
import shutil
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import torch
import xxhash

from .. import dist
from ..names import REBUILD_PREFIX, commit_order, is_own_file
from ..storage import open_storage
from .erasure import Codec, Placement

PARITY_MANIFEST = "parity.json"  # written last: a parity copy without it is not used


def codeword_file(j: int) -> str:
    """The file a parity holder keeps its piece of codeword ``j`` in."""
    return f"codeword{j}.bin"


def send_parity(
    pl: Placement,
    rank: int,
    group: Any,
    step: int,
    own: Path,
    manifests: list[dict[str, int]],
    target: Path,
) -> str | None:
    """Collective in the parity group: one codeword at a time, its data members send
    their chunk of their copy (``own``) to its parity holders, which compute and keep
    their parity piece in ``target`` with the checksums of every piece, manifest last.
    ``manifests``: every member's file list (name -> size), in member order. Returns
    why this rank could not keep its parity (it still takes part in every codeword,
    so that the others never wait for it)."""
    me = pl.position(rank)
    size = pl.chunk_bytes([sum(f.values()) for f in manifests])
    codec = Codec(pl.k, pl.m)
    error = None
    try:
        if target.exists():
            shutil.rmtree(target)  # a crashed earlier attempt at this step
        target.mkdir(parents=True)
    except OSError as exc:
        error = f"making {target}: {exc}"
    codewords: dict[str, dict[str, Any]] = {}
    for j in range(len(pl.members)):
        requests = []
        if me in pl.data(j):
            chunk = torch.from_numpy(read_stream(own, manifests[me], pl.chunks(me).index(j), size))
            for holder in pl.holders(j):
                requests.append(dist.isend_bytes(chunk, pl.members[holder], j, group))
        pieces: list[torch.Tensor] = []
        if me in pl.holders(j):
            for p in pl.data(j):
                pieces.append(torch.empty(size, dtype=torch.uint8))
                requests.append(dist.irecv_bytes(pieces[-1], pl.members[p], j, group))
        for request in requests:
            request.wait()
        if not pieces or error is not None:
            continue
        t = pl.holders(j).index(me)
        data = [piece.numpy() for piece in pieces]
        try:
            parity = codec.encode(data)[t]
        except Exception as exc:  # noqa: BLE001 - the others must not wait for this rank
            error = f"encoding codeword {j}: {type(exc).__name__}: {exc}"
            continue
        codewords[str(j)] = {
            "piece": pl.k + t,
            "data_hashes": [digest(d) for d in data],
            "parity_hash": digest(parity),
        }
        try:
            parity.tofile(target / codeword_file(j))
        except OSError as exc:
            error = f"writing parity to {target}: {exc}"
    if error is None:
        manifest = {
            "step": step,
            "members": list(pl.members),
            "parity": pl.m,
            "chunk_bytes": size,
            "files": manifests,
            "codewords": codewords,
        }
        try:
            write_manifest(target, manifest)
        except OSError as exc:
            error = f"writing {target / PARITY_MANIFEST}: {exc}"
    if error is not None:
        shutil.rmtree(target, ignore_errors=True)
        return f"{error}; free space there (or raise its size), or lower parity"
    return None


class Rebuild:
    """A rank's copy rebuilt from its parity group's pieces: each piece is checked against
    the checksum its holder recorded before it is used, each codeword decoded once its
    ``k`` pieces are in, and the files written under a temporary name that becomes the
    copy only once every chunk is in place (never half a copy where a restore looks)."""

    def __init__(self, target: Path, spec: dict[str, Any]) -> None:
        self.target, self.files = target, spec["files"]
        self.chunk_bytes = spec["chunk_bytes"]
        self.codec = Codec(spec["data"], spec["parity"])
        self.wanted = {j: (c, want) for c, (j, want) in enumerate(spec["chunks"])}
        self.pieces: dict[int, dict[int, np.ndarray]] = {}
        self.error: str | None = None
        self.partial = target.parent / f"{REBUILD_PREFIX}{target.name}"
        try:
            shutil.rmtree(self.partial, ignore_errors=True)
            self.partial.mkdir(parents=True)
            for name, size in self.files.items():
                with open(self.partial / name, "wb") as f:
                    f.truncate(size)
        except OSError as exc:
            self.error = f"rebuilding {target}: {exc}"

    def add(self, which: dict[str, Any], piece: np.ndarray) -> None:
        j = which["codeword"]
        if self.error is not None:
            return
        if which["index"] != "sum" and digest(piece) != which["hash"]:
            self.error = (
                f"rebuilding {self.target}: piece {which['index']} of codeword {j} from rank "
                f"{which['from']} does not match its checksum (a corrupt copy or parity)"
            )
            return
        got = self.pieces.setdefault(j, {})
        got[which["index"]] = piece
        if len(got) == self.codec.k or which["index"] == "sum":
            c, want = self.wanted[j]
            del self.pieces[j]
            try:
                chunk = piece if which["index"] == "sum" else self.codec.rebuild(got, want)
            except Exception as exc:  # noqa: BLE001 - reported in the agreement, not raised
                self.error = f"rebuilding {self.target}: decoding codeword {j}: {exc}"
                return
            try:
                for name, at, lo, hi in spans(self.files, c, self.chunk_bytes):
                    with open(self.partial / name, "r+b") as f:
                        f.seek(at)
                        f.write(memoryview(chunk)[lo:hi])
            except OSError as exc:
                self.error = f"rebuilding {self.target}: {exc}"
            self.wanted.pop(j)

    def abandon(self) -> None:
        shutil.rmtree(self.partial, ignore_errors=True)

    def finish(self) -> str | None:
        """Why the copy could not be rebuilt (its partial files removed), or None."""
        if self.error is None and self.wanted:
            self.error = f"rebuilding {self.target}: codewords {sorted(self.wanted)} incomplete"
        if self.error is None:
            try:
                if self.target.exists():
                    shutil.rmtree(self.target)
                os.rename(self.partial, self.target)
            except OSError as exc:
                self.error = f"rebuilding {self.target}: {exc}"
        shutil.rmtree(self.partial, ignore_errors=True)
        return self.error


def spans(files: dict[str, int], chunk: int, size: int) -> Iterator[tuple[str, int, int, int]]:
    """Where chunk ``chunk`` (``size`` bytes) of a copy's files, taken in their commit
    order as one stream, lies: (file, offset in it, start, end in the chunk)."""
    lo, hi = chunk * size, (chunk + 1) * size
    at = 0
    for name in commit_order(list(files)):
        end = at + files[name]
        if end > lo and at < hi:
            start = max(lo, at)
            yield name, start - at, start - lo, min(hi, end) - lo
        at = end


def copy_files(d: Path) -> dict[str, int]:
    """The files of the copy in ``d`` (name -> size): what its stream is made of."""
    return {p.name: p.stat().st_size for p in d.iterdir() if is_own_file(p.name)}


def read_piece(detail: dict[str, Any], copy: Path, parity: Path) -> torch.Tensor:
    """A piece a rebuild asked for (``detail``, from ``restore_roles``): a chunk of the
    copy in ``copy``, or the parity of a codeword kept in ``parity``, as kept (the
    rebuilding rank checks it against the checksums)."""
    piece = np.zeros(detail["chunk_bytes"], dtype=np.uint8)
    try:
        if detail["kind"] == "data":
            piece = read_stream(copy, copy_files(copy), detail["chunk"], detail["chunk_bytes"])
        else:
            with open(parity / codeword_file(detail["codeword"]), "rb") as f:
                f.readinto(memoryview(piece))
    except OSError:  # sent anyway (zeros fail the checksum): the receiver must not wait
        pass
    return torch.from_numpy(piece)


def read_stream(d: Path, files: dict[str, int], chunk: int, size: int) -> np.ndarray:
    """Chunk ``chunk`` of the copy in ``d`` (zeros past its end)."""
    out = np.zeros(size, dtype=np.uint8)
    for name, at, lo, hi in spans(files, chunk, size):
        with open(d / name, "rb") as f:
            f.seek(at)
            f.readinto(memoryview(out)[lo:hi])
    return out


def digest(data: np.ndarray) -> str:
    """The checksum of a piece (a data chunk or parity) that a parity manifest records."""
    return xxhash.xxh3_64_hexdigest(memoryview(data))


def write_manifest(parity_dir: Path, manifest: dict[str, Any]) -> None:
    """The parity copy's manifest, written last and whole (the storage layer's
    temporary name and rename): a parity copy without it is not offered."""
    open_storage(parity_dir).write_small_durably(PARITY_MANIFEST, json.dumps(manifest).encode())


def read_manifest(parity_dir: Path) -> dict[str, Any]:
    """The parity copy's manifest (``OSError``, ``ValueError``: unreadable)."""
    return json.loads((parity_dir / PARITY_MANIFEST).read_bytes())
