"""``shardpoint.save``: flatten the state, pack tensors into shard files, write, commit.

Order of durability (the commit protocol, docs/format.md): every shard file is written
and fsynced, then ``index.json`` is written and fsynced, then the directory is fsynced,
and only then the commit marker is written and fsynced. A crash at any point leaves a
directory without a marker, which no reader accepts as a checkpoint.
"""

from __future__ import annotations

import os
import time
from collections.abc import Iterable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from datetime import datetime, timezone
from pathlib import Path
from typing import Any

import torch

from . import __version__, dist
from .checkpoint_dir import OWN_FILE, is_committed
from .errors import CheckpointError, CheckpointExistsError, UnsupportedValueError
from .format.index import (
    INDEX_NAME,
    MARKER_NAME,
    Chunk,
    Index,
    TensorEntry,
    block_checksums,
    block_rows_for,
    marker_json,
)
from .format.safetensors import (
    PAGE,
    TensorSlot,
    dtype_name,
    encode_header,
    itemsize,
    layout,
    tensor_nbytes,
)
from .gc_pause import gc_paused
from .parallel import map_batched
from .plan import Holding, Piece, plan_writes
from .storage import CheckpointStorage, WriterLock, open_storage
from .storage.local import ZERO_COPY_MIN_BYTES, Segment
from .tensor_kinds import local_part, may_be_replicated
from .tensor_memory import flat_bytes, host_contiguous, plain
from .tree import flatten, merge_trees

DEFAULT_MAX_SHARD_BYTES = 4 * 1024**3
DEFAULT_THREADS = 4
SHARD_METADATA = {"format": "pt"}  # what the Hugging Face loaders expect in each file


@dataclass(frozen=True)
class SaveInfo:
    """What a save wrote."""

    path: Path | str  # a local path, or the URL
    files: int
    tensors: int
    bytes_written: int
    seconds: float  # from the call until the checkpoint was committed
    blocked_seconds: float | None = None  # how long the caller waited (async: the staging)


def shard_file_name(rank: int, k: int) -> str:
    return f"rank{rank:05d}-{k:05d}.safetensors"


@gc_paused()
def save(
    state: Any,
    path: str | os.PathLike[str],
    *,
    max_shard_size: int = DEFAULT_MAX_SHARD_BYTES,
    threads: int = DEFAULT_THREADS,
    metadata: dict[str, Any] | None = None,
    storage_options: dict[str, Any] | None = None,
) -> SaveInfo:
    """Save ``state`` as a committed checkpoint directory at ``path``.

    ``state`` is a mapping (or a ``Stateful`` object) of tensors, ``Stateful`` objects
    (modules, optimizers, schedulers...) and plain values. Tensors are packed into
    safetensors files of at most ``max_shard_size`` bytes (a larger tensor gets a file
    of its own) and written by ``threads`` parallel workers.

    Under ``torch.distributed`` every rank calls ``save`` with its own state: each rank
    writes only its part (DTensor shards, its share of replicated tensors) to its own
    files, and rank 0 commits once every rank's files are durable.

    ``path`` may be an object-store URL (``s3://bucket/run/step-100``); see
    docs/storage.md for credentials, endpoints and ``storage_options``.

    >>> import torch, shardpoint
    >>> info = shardpoint.save({"w": torch.ones(2), "step": 7}, "/tmp/sp-doc/ckpt")
    >>> info.tensors
    1
    """
    start = time.perf_counter()
    plan = plan_save(state, open_storage(path, storage_options))
    result = WriteResult()
    try:
        shards = lay_out(plan, max_shard_size, zero_copy=True)
        result = _write_shards(plan.storage, shards, threads)
    except Exception as exc:  # any failure must still reach the commit's gather
        result.error = f"rank {plan.rank}: {exc}"
    return commit(plan, result, metadata, start=start)


@dataclass
class SavePlan:
    """What this rank writes for one save, agreed with every other rank."""

    storage: CheckpointStorage
    rank: int
    tree: Any  # the merged non-tensor tree of all ranks
    gathered: list[dict[str, Any]]  # every rank's structure, for the index
    pieces: list[Piece]  # what this rank writes
    local: dict[str, torch.Tensor]  # name -> this rank's contiguous bytes of the entry
    tensors: int
    group: Any = None  # the process group of the save's collectives (None: default)
    lock: WriterLock | None = None  # rank 0: held from preparing the directory to commit

    def unlock(self) -> None:
        if self.lock is not None:
            self.lock.release()
            self.lock = None


@dataclass
class WriteResult:
    """What one rank wrote, sent to rank 0 for the index (JSON-able fields only)."""

    files: dict[str, int] = field(default_factory=dict)  # name -> size
    chunks: list[dict[str, Any]] = field(default_factory=list)
    error: str | None = None


def plan_save(
    state: Any, storage: CheckpointStorage, *, group: Any = None, to_host: bool = True
) -> SavePlan:
    """Flatten ``state``, prepare the directory (rank 0) and agree on who writes what.

    The one gather of structure per save; it also orders every write after rank 0's
    preparation of the directory. ``to_host=False`` keeps device tensors where they
    are (the async path copies them into its staging pool itself).
    """
    me = dist.rank()
    # A rank that fails before the collective still joins it, with its error, so that
    # no other rank waits forever; then every rank raises. Any exception counts: a
    # user's state_dict() may raise anything.
    own_error: Exception | None = None
    tree_here: Any = None
    holdings: list[Holding] = []
    aliases: dict[str, str] = {}
    local: dict[str, torch.Tensor] = {}
    lock: WriterLock | None = None
    try:
        flat = flatten(state)
        tree_here = flat.tree
        holdings, aliases, local = _holdings(flat.tensors, to_host)
        if me == 0:
            lock = _prepare_directory(storage)
    except Exception as exc:
        own_error = exc
    sole = [h for h in holdings if not h.replicated]
    gathered = dist.all_gather_json(
        {
            "sole_bytes": sum(h.nbytes for h in sole),
            "replicated": [h.to_json() for h in holdings if h.replicated],
            "tree": tree_here,
            "aliases": aliases,
            "error": f"rank {me}: {own_error}" if own_error else None,
        },
        group,
    )
    if own_error is not None:
        raise own_error
    failed = [g["error"] for g in gathered if g["error"]]
    if failed:
        if lock is not None:
            lock.release()
        raise CheckpointError(f"{storage.where}: another rank could not save: {failed[0]}")
    replicated = [[Holding.from_json(h) for h in g["replicated"]] for g in gathered]
    plan = plan_writes([g["sole_bytes"] for g in gathered], replicated)
    mine = [Piece(h.name, h.offsets, h.shape, me, h) for h in sole]
    mine += [p for p in plan if p.writer == me]
    return SavePlan(
        storage,
        me,
        merge_trees([g["tree"] for g in gathered]),
        gathered,
        mine,
        local,
        len(local) + len(aliases),
        group,
        lock,
    )


def commit(
    plan: SavePlan, result: WriteResult, metadata: dict[str, Any] | None, *, start: float
) -> SaveInfo:
    """The commit protocol: every rank reports, rank 0 writes the index then the marker,
    every rank learns the outcome. Raises on every rank if any rank failed.

    The gather doubles as the barrier before commit: rank 0 hears from every rank once
    its files are durable (or failed).
    """
    try:
        return _commit(plan, result, metadata, start)
    finally:
        plan.unlock()


def _commit(
    plan: SavePlan, result: WriteResult, metadata: dict[str, Any] | None, start: float
) -> SaveInfo:
    storage, me = plan.storage, plan.rank
    results = dist.gather_json(
        {"files": result.files, "chunks": result.chunks, "error": result.error}, 0, plan.group
    )
    outcome = None
    if results is not None:  # rank 0
        errors = [r["error"] for r in results if r["error"]]
        outcome = errors[0] if errors else None
        if not errors:
            try:
                index_bytes = _index(plan.tree, plan.gathered, results, metadata).to_json()
                storage.write_small_durably(INDEX_NAME, index_bytes)
                storage.sync()
                storage.write_small_durably(MARKER_NAME, marker_json(index_bytes))
                storage.sync()
            except Exception as exc:  # OSError locally; the object store's errors too
                outcome = f"rank 0 (commit): {exc}"
        written = sum(sum(r["files"].values()) for r in results)
        files = sum(len(r["files"]) for r in results)
    else:
        written, files = sum(result.files.values()), len(result.files)
    outcome = dist.broadcast_json(outcome, 0, plan.group)
    if outcome:
        # Only rank 0 may remove the shared directory: another rank's files may still be
        # in flight when a fast-failing rank gets here.
        remove_own(
            storage,
            [*result.files, *((INDEX_NAME, MARKER_NAME) if me == 0 else ())],
            remove_directory=me == 0,
        )
        raise CheckpointError(
            f"{storage.where}: writing the checkpoint failed ({outcome}); nothing was committed "
            "and earlier checkpoints are untouched. Fix the cause above (free space, "
            "permissions, the object store's reachability), "
            "then save again."
        )
    seconds = time.perf_counter() - start
    return SaveInfo(
        path=storage.root,
        files=files,
        tensors=plan.tensors,
        bytes_written=written,
        seconds=seconds,
        blocked_seconds=seconds,  # a synchronous save blocks for all of it
    )


@dataclass
class ShardFile:
    """One shard file of this rank: its header and where each piece's bytes go."""

    name: str
    size: int
    header: torch.Tensor  # uint8, padded; the file's first bytes
    placed: list[_Placed]


def lay_out(plan: SavePlan, max_shard_size: int, *, zero_copy: bool) -> list[ShardFile]:
    """Pack this rank's pieces into files and place every piece's bytes.

    ``zero_copy`` pads headers so large tensors land at their memory's page offset
    (direct I/O straight from tensor memory, see ``_data_start_mod``).
    """
    by_key = {_piece_key(p): p for p in plan.pieces}
    data = {key: _piece_data(p, plan.local[p.name]) for key, p in by_key.items()}
    shards = []
    for file, keys in _pack(list(by_key), data, max_shard_size, plan.rank).items():
        slots = layout([(k, dtype_name(data[k].dtype), tuple(data[k].shape)) for k in keys])
        mod = _data_start_mod(slots, data) if zero_copy else None
        header = encode_header(slots, SHARD_METADATA, mod)
        data_start = len(header)
        placed = [
            _Placed(
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


def chunk_records(placed: list[_Placed], checksums: list[list[str]]) -> list[dict[str, Any]]:
    """The index records of written pieces (JSON, sent to rank 0)."""
    return [
        {
            "name": p.piece.name,
            "dtype": p.piece.source.dtype,
            "global_shape": list(p.piece.source.global_shape),
            "file": p.file,
            "key": p.key,
            "offsets": list(p.piece.offsets),
            "shape": list(p.piece.shape),
            "byte_range": [p.begin, p.end],
            "block_rows": p.block_rows,
            "checksums": digest,
        }
        for p, digest in zip(placed, checksums)
    ]


def _write_shards(storage: CheckpointStorage, shards: list[ShardFile], threads: int) -> WriteResult:
    """Write this rank's files straight from tensor memory; checksums beside the writes."""
    to_write: dict[str, tuple[int, list[Segment]]] = {
        f.name: (f.size, [Segment(0, f.header), *(Segment(p.begin, p.raw) for p in f.placed)])
        for f in shards
    }
    placed = [p for f in shards for p in f.placed]
    # Checksums run on their own thread, so they cost no wall time.
    with ThreadPoolExecutor(max_workers=1, thread_name_prefix="shardpoint-hash") as hasher:
        digests = map_batched(
            hasher,
            lambda p: block_checksums(
                p.raw.numpy(), p.slot.shape, itemsize(p.slot.dtype), p.block_rows
            ),
            placed,
            lambda p: p.slot.nbytes,
        )
        try:
            storage.write_files(to_write, threads=threads)
            sums = digests()
        except Exception:  # whatever failed, none of this rank's files may stay behind
            remove_own(storage, to_write, remove_directory=False)
            raise
    return WriteResult({f.name: f.size for f in shards}, chunk_records(placed, sums))


@dataclass(frozen=True)
class _Placed:
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


def _piece_data(p: Piece, local: torch.Tensor) -> torch.Tensor:
    """The bytes of a piece: rows of the holding's local tensor (contiguous)."""
    if p.shape == p.source.shape:
        return local
    start = p.offsets[0] - p.source.offsets[0]
    return local.narrow(0, start, p.shape[0])


def _index(
    tree: Any,
    gathered: list[dict[str, Any]],
    results: list[dict[str, Any]],
    metadata: dict[str, Any] | None,
) -> Index:
    chunks_of: dict[str, list[Chunk]] = {}
    meta: dict[str, tuple[str, tuple[int, ...]]] = {}
    for r in results:
        for c in r["chunks"]:
            meta[c["name"]] = (c["dtype"], tuple(c["global_shape"]))
            chunks_of.setdefault(c["name"], []).append(
                Chunk(
                    c["file"],
                    c["key"],
                    tuple(c["offsets"]),
                    tuple(c["shape"]),
                    c["byte_range"][0],
                    c["byte_range"][1],
                    tuple(c["checksums"]),
                    c["block_rows"],
                )
            )
    entries = {
        name: TensorEntry(
            name, meta[name][0], meta[name][1], tuple(sorted(chunks, key=lambda c: c.offsets))
        )
        for name, chunks in chunks_of.items()
    }
    aliases = {a: t for g in gathered for a, t in g["aliases"].items() if a not in entries}
    return Index(
        files={name: size for r in results for name, size in r["files"].items()},
        entries=entries,
        aliases=aliases,
        tree=tree,
        created=datetime.now(timezone.utc).isoformat(timespec="seconds"),
        library_version=__version__,
        world_size=len(results),
        metadata=dict(metadata or {}),
    )


def _data_start_mod(slots: dict[str, TensorSlot], tensors: dict[str, torch.Tensor]) -> int | None:
    """Where in a page the data should start so most large tensors move zero-copy.

    Direct I/O can skip the bounce buffer for a tensor whose address and file offset
    agree modulo the page size (storage/local.py). Tensors from the CPU allocator share
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


def _holdings(
    tensors: dict[str, torch.Tensor], to_host: bool
) -> tuple[list[Holding], dict[str, str], dict[str, torch.Tensor]]:
    """What this rank holds of each tensor entry, tied tensors stored once.

    Returns the holdings, alias name -> stored name (views of the same memory), and
    name -> the local bytes as a contiguous (host, with ``to_host``) tensor.
    """
    world = dist.world_size()
    seen: dict[tuple[Any, ...], str] = {}
    holdings: list[Holding] = []
    aliases: dict[str, str] = {}
    local: dict[str, torch.Tensor] = {}
    for name, t in tensors.items():
        part, global_shape, offsets = local_part(t, name)
        try:
            dtype = dtype_name(part.dtype)
        except TypeError as exc:
            raise UnsupportedValueError(f"cannot save tensor {name!r}: {exc}") from None
        if tensor_nbytes(dtype, global_shape) is None:  # readers would refuse it
            raise UnsupportedValueError(
                f"cannot save tensor {name!r}: its shape {list(global_shape)} spans 2**63 "
                "bytes or more (counting empty dimensions as 1), beyond the format's sizes"
            )
        if part.layout != torch.strided:
            raise UnsupportedValueError(
                f"cannot save tensor {name!r}: layout {part.layout} is not supported; "
                "convert it with .to_dense() first"
            )
        identity = None
        if part.numel():  # every empty tensor has the same (null) data pointer
            identity = (part.device, part.data_ptr(), tuple(part.shape), part.stride(), part.dtype)
        if identity is not None and identity in seen:
            aliases[name] = seen[identity]
            continue
        if identity is not None:
            seen[identity] = name
        replicated = world > 1 and may_be_replicated(t)
        holdings.append(Holding(name, dtype, global_shape, offsets, tuple(part.shape), replicated))
        local[name] = host_contiguous(part) if to_host else plain(part).contiguous()
    return holdings, aliases, local


def _pack(
    names: list[str], tensors: dict[str, torch.Tensor], max_bytes: int, rank: int
) -> dict[str, list[str]]:
    """Greedy packing in state order: related tensors stay together in one file."""
    files: dict[str, list[str]] = {}
    current: list[str] = []
    size = 0
    for name in names:
        nbytes = tensors[name].numel() * tensors[name].element_size()
        if current and size + nbytes > max_bytes:
            files[shard_file_name(rank, len(files))] = current
            current, size = [], 0
        current.append(name)
        size += nbytes
    if current or not files:
        files[shard_file_name(rank, len(files))] = current
    return files


def _prepare_directory(storage: CheckpointStorage) -> WriterLock:
    """Create and lock the directory; clear what a crashed save left there; never touch
    a committed checkpoint, anything that is not a checkpoint file, or a directory
    another process is saving to (``ConcurrentWriterError``). Returns the held lock."""
    where = storage.where
    lock: WriterLock | None = None
    try:
        if is_committed(storage):  # checked before creating anything
            raise _exists(where)
        storage.prepare()
        lock = storage.lock()
        lock.acquire()
        if is_committed(storage):  # committed by another process since the first look
            raise _exists(where)
        names = storage.list()
        foreign = [n for n in names if not OWN_FILE.match(n)]
        if foreign:
            raise CheckpointError(
                f"{where}: holds files that are not from an unfinished shardpoint save "
                f"({foreign[:3]}); save to an empty or new directory"
            )
        for name in names:  # leftovers of a crashed save, never committed
            storage.delete(name)
        return lock
    except BaseException as exc:
        if lock is not None:
            lock.release()
        if isinstance(exc, CheckpointError) or not isinstance(exc, Exception):
            raise
        # OSError locally; the object store's errors too. Nothing of ours is there yet.
        remove_own(storage, [], remove_directory=True)
        raise CheckpointError(
            f"{where}: cannot prepare the checkpoint directory ({exc}); nothing was written "
            "and earlier checkpoints are untouched. Check free space and permissions (or, for "
            "an object store, that it is reachable)."
        ) from exc


def _exists(where: str) -> CheckpointExistsError:
    return CheckpointExistsError(
        f"{where}: a committed checkpoint already exists here; checkpoints are never "
        "modified in place. Save to a new path or delete this one first."
    )


def remove_own(storage: CheckpointStorage, names: Iterable[str], *, remove_directory: bool) -> None:
    """Remove what this rank wrote for a failed save: it leaves no trace to mistake.

    An empty directory left behind (another rank still cleaning up) has no marker, is
    not a checkpoint, and is cleared by the next save or CheckpointManager start.
    """
    for name in names:
        for leftover in (name, f"{name}.tmp"):
            try:
                storage.delete(leftover)
            except Exception:  # best effort: the save already failed, say why it did
                pass
    if remove_directory:
        storage.remove_if_empty()
