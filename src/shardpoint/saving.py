"""The save pipeline: one set of phases for every caller.

    flatten -> plan (agreed across ranks) -> [stage] -> write -> commit

``save`` runs them on the caller's thread, writing straight from tensor memory.
``AsyncSaver`` (``background_save.py``) runs the same phases with one difference: the
write reads staged copies, so the caller returns after staging while the write and
the commit finish on background threads. The manager's local, remote and memory tiers
and the uploads use these phases too. ``run_save`` below is the whole pipeline.

Order of durability (the commit protocol, ``commit.py``, docs/format.md): every shard
file is durable, then ``index.json``, then the marker. A crash at any point leaves a
directory without a marker, which no reader accepts as a checkpoint.
"""

from __future__ import annotations

import json
import math
import os
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field, replace
from datetime import datetime, timezone
from pathlib import Path
from typing import Any, Protocol

import torch
import xxhash

from . import dist
from .commit import Commit
from .errors import CheckpointError, UnsupportedValueError
from .format.index import (
    PLAIN_VERSION,
    REFERENCES_VERSION,
    Chunk,
    Index,
    TensorEntry,
    block_checksums,
    block_rows_for,
    check_user_metadata,
    checksum,
    fragment_json,
)
from .format.safetensors import (
    MAX_HEADER_BYTES,
    METADATA_KEY,
    PAGE,
    TensorSlot,
    dtype_name,
    encode_header,
    itemsize,
    layout,
    tensor_nbytes,
)
from .gc_pause import gc_paused
from .incremental import IncrementalChain, Token, identity, token, unchanged
from .names import INDEX_NAME, MARKER_NAME, fragment_file, shard_file
from .parallel import map_batched
from .plan import Holding, Piece, plan_writes
from .sharding import Mesh, Sharding
from .storage import CheckpointStorage, open_storage
from .storage.io_types import ZERO_COPY_MIN_BYTES, Segment
from .tensor_kinds import local_part, may_be_replicated, regular_sharding
from .tensor_memory import flat_bytes, host_contiguous, plain
from .tree import flatten, merge_trees
from .version import __version__

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


@gc_paused()
def save(
    state: Any,
    path: str | os.PathLike[str],
    *,
    max_shard_size: int = DEFAULT_MAX_SHARD_BYTES,
    threads: int = DEFAULT_THREADS,
    metadata: dict[str, Any] | None = None,
    storage_options: dict[str, Any] | None = None,
    incremental: IncrementalChain | None = None,
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

    ``incremental``: an ``IncrementalChain`` shared by a sequence of saves into sibling
    directories. Chunks whose bytes equal those of the chain's previous save are not
    written again: the index refers to the earlier checkpoint's file (docs/format.md,
    version 3). Delete such checkpoints with ``CheckpointManager`` retention or
    ``shardpoint prune``, which keep referenced files.

    >>> import torch, shardpoint
    >>> info = shardpoint.save({"w": torch.ones(2), "step": 7}, "/tmp/sp-doc/ckpt")
    >>> info.tensors
    1
    """
    storage = open_storage(path, storage_options)
    options = SaveOptions(max_shard_size, threads, metadata, chain=incremental)
    info = run_save(state, storage, options)
    assert isinstance(info, SaveInfo)  # no staging: committed on return
    return info


@dataclass(frozen=True)
class SaveOptions:
    max_shard_size: int = DEFAULT_MAX_SHARD_BYTES
    threads: int = DEFAULT_THREADS
    metadata: dict[str, Any] | None = None
    # Each node's directory is its own (node-local disks): every node's first rank
    # prepares and commits it. Otherwise one directory is shared and rank 0 does.
    per_node: bool = False
    # Incremental: chunks unchanged since the chain's newest checkpoint (a sibling
    # directory) are referred to, not written; the chain advances on commit.
    chain: IncrementalChain | None = None


class Staging(Protocol):
    """The stage phase (``background_save.Stager``): copies the files' bytes on the
    caller's thread and writes them on background threads."""

    def stage(self, plan: SavePlan, files: list[ShardFile]) -> Callable[[], WriteResult]: ...
    def spare_bytes(self) -> int: ...


def run_save(
    state: Any,
    storage: CheckpointStorage,
    options: SaveOptions,
    staging: Staging | None = None,
    group: Any = None,
) -> SaveInfo | Callable[[], SaveInfo]:
    """The pipeline. Without ``staging`` the checkpoint is committed on return; with it,
    the state is staged on return and the returned function (for a background thread)
    writes, commits and returns the ``SaveInfo``."""
    start = time.perf_counter()
    if staging is None:
        try:
            return _run_phases(state, storage, options, None, group, start)()
        except _Unsettled:  # a speculative save met a change: again, agreed first
            return _run_phases(state, storage, options, None, group, start)()
    return _run_phases(state, storage, options, staging, group, start)


def _run_phases(
    state: Any,
    storage: CheckpointStorage,
    options: SaveOptions,
    staging: Staging | None,
    group: Any,
    start: float,
) -> Callable[[], SaveInfo]:
    """Plan, lay out and write (or stage); returns the commit, to call."""
    plan = plan_save(state, storage, options, group=group, staged=staging is not None)
    written, references = _write_phase(plan, options, staging)
    if staging is not None and plan.unsettled and plan.error is None:
        # A background save this rank cannot write with the cached plan (its structure
        # changed, or a leftover holds a name it needs), and the caller must not move
        # on before what it may have to write is copied. If all it holds fits in what
        # its staging pool already takes, it copies it and returns; the rest of the
        # save runs in the background. Otherwise (every rank of a DDP job changes when
        # its optimizer's state first appears: a replica per rank could exhaust the
        # host's memory) it waits here for the plan and stages its part of it.
        held = sum(t.numel() * t.element_size() for t in plan.local.values())
        if held <= staging.spare_bytes():
            plan.local = {name: t.to("cpu", copy=True) for name, t in plan.local.items()}
        else:
            try:
                plan = _plan_unsettled_again(plan, options)
            except Exception as exc:  # through the handle, as on the other ranks
                failure = exc

                def failed() -> SaveInfo:
                    raise failure

                return failed
            written, references = _write_phase(plan, options, staging)

    def finish() -> SaveInfo:
        result = _with_references(written(), *references)
        try:
            return commit(plan, result, options.metadata, start=start)
        except _Unsettled as again:
            if again.written is None:
                raise  # run_save saves again, from the live state
            job = _plan_again(plan, again.written, again.kept, options)
            if not plan.unsettled:  # what it wrote is its part of the new plan
                settled = replace(plan, structures=job.structures, job=job, speculative=False)
                return commit(settled, again.written, options.metadata, start=start)
            settled = _part_of(plan, job)  # from the copy it made
            done, refs = _write_phase(settled, options, None)
            return commit(settled, _with_references(done(), *refs), options.metadata, start=start)

    return finish


def _write_phase(
    plan: SavePlan, options: SaveOptions, staging: Staging | None
) -> tuple[Callable[[], WriteResult], tuple[list[ChunkRecord], dict[str, int]]]:
    """Lay out and write (or stage) what ``plan`` gives this rank; returns the function
    that says what was written, and the records of chunks the chain's base holds."""
    written: Callable[[], WriteResult]
    references: tuple[list[ChunkRecord], dict[str, int]] = ([], {})
    try:
        if options.metadata is not None:  # refused before a byte is written, not at the commit
            check_user_metadata(options.metadata)
        if plan.unsettled:  # nothing to write: the commit's verdict has this save replanned
            result = WriteResult(error=plan.error)
            written = lambda: result  # noqa: E731
        else:
            if options.chain is not None:
                references = _refer_to_unchanged(plan, options.chain)
            files = lay_out(plan, options.max_shard_size, zero_copy=staging is None)
            if staging is None:
                result = write_from_memory(plan, files, options.threads)
                written = lambda: result  # noqa: E731
            elif plan.speculative and _taken(plan, files):
                # A crashed save's leftover holds a name this rank needs: only the
                # committing rank may clear it, under its lock, on the commit's *again*.
                plan.unsettled = True
                result = WriteResult()
                written = lambda: result  # noqa: E731
            else:
                written = staging.stage(plan, files)
    except Exception as exc:  # any failure must still reach the commit's gather
        failed = WriteResult(error=f"rank {plan.rank}: {exc}")
        written = lambda: failed  # noqa: E731
    return written, references


def _taken(plan: SavePlan, files: list[ShardFile]) -> bool:
    """Whether a file this rank is about to create exclusively is already there."""
    if not plan.storage.creates_exclusively:
        return False
    names = [f.name for f in files]
    if plan.sharded_names or plan.rank_values:
        names.append(fragment_file(plan.rank))
    return any(plan.storage.size(name) is not None for name in names)


def _refer_to_unchanged(
    plan: SavePlan, chain: IncrementalChain
) -> tuple[list[ChunkRecord], dict[str, int]]:
    """Drop from ``plan`` the pieces the chain's base holds byte for byte; returns the
    records that refer to them and the referenced files' sizes."""
    plan.chain = chain
    base = chain.base_for(plan.storage.root)
    if not base:  # the chain's first save: every chunk may stay unchanged
        plan.identify, plan.referred = {id(p) for p in plan.pieces}, []
        return [], {}
    split = unchanged(base, plan.pieces, lambda p: _piece_data(p, plan.local[p.name]), plan.tokens)
    # Referenced files must still be there (someone may have deleted the base by hand):
    # if one is not, this save writes everything.
    if any(plan.storage.size(f) != size for f, size in split.files.items()):
        plan.identify, plan.referred = {id(p) for p in plan.pieces}, []
        return [], {}
    plan.pieces, plan.referred, plan.identify = split.to_write, split.referred, split.identify
    return split.records, split.files


def _with_references(
    result: WriteResult, records: list[ChunkRecord], files: dict[str, int]
) -> WriteResult:
    if result.error is not None or not records:
        return result
    result.chunks.extend(records)
    result.referenced.update(files)
    return result


@dataclass
class SavePlan:
    """What this rank writes for one save, agreed with every other rank."""

    storage: CheckpointStorage
    rank: int
    tree: Any  # this rank's non-tensor tree (rank 0 merges every rank's at the commit)
    structures: list[dict[str, Any]] | None  # see _JobPlan
    pieces: list[Piece]  # what this rank writes
    local: dict[str, torch.Tensor]  # name -> this rank's contiguous bytes of the entry
    tensors: int
    per_node: bool
    group: Any = None  # the process group of the save's collectives (None: default)
    commit: Commit | None = None  # held by the rank that commits this directory
    job: _JobPlan | None = None  # the agreed plan (on rank 0: the sharded entries too)
    # This rank's own values (``tree.PerRank``) and the tensors in them: its fragment's.
    rank_values: dict[str, Any] = field(default_factory=dict)
    rank_tensors: set[str] = field(default_factory=set)
    tokens: dict[str, Token] = field(default_factory=dict)  # entry -> version and address
    chain: IncrementalChain | None = None  # advanced once this save is committed
    referred: list[Piece] = field(default_factory=list)  # pieces the chain's base holds
    identify: set[int] = field(default_factory=set)  # ids of pieces whose identity to compute
    # Written with the cached plan before any collective (see plan_save); unsettled:
    # this rank's structure changed or it failed, so it writes nothing and the commit
    # has every rank save again, agreed first.
    speculative: bool = False
    unsettled: bool = False
    error: str | None = None  # why this (unsettled) rank could not save
    # A background save: the caller has moved on, so a save that must run again keeps
    # the files the steady ranks wrote, and a rank that wrote nothing (``unsettled``)
    # copied what it holds or waited for its part of the new plan (``_run_phases``).
    staged: bool = False
    own_structure: _RankStructure | None = None  # this rank's, as planned
    cache_key: tuple[Any, ...] = ()  # where its plan is cached (``_PLANS``)

    @property
    def sharded_names(self) -> set[str]:
        """This rank's entries described by their sharding (chunks go to its fragment)."""
        return {p.name for p in [*self.pieces, *self.referred] if p.source.sharding is not None}

    def release(self) -> None:
        if self.commit is not None:
            self.commit.release()


# Built per tensor: a frozen dataclass costs five times as much to build.
@dataclass(slots=True, unsafe_hash=True)
class ChunkRecord:
    """One written piece as the index needs it: the tensor's facts and its chunk."""

    name: str
    dtype: str
    global_shape: tuple[int, ...]
    chunk: Chunk
    # Replicated state: the box (offsets, shape) this piece is part of, which other
    # ranks hold too; None for a rank's own shard.
    copy_of: tuple[tuple[int, ...], tuple[int, ...]] | None
    # xxh3-128 of the chunk's bytes (incremental saves; stays on the rank that wrote it).
    identity: str | None = None

    def to_json(self) -> list[Any]:
        c = self.chunk
        return [
            *(self.name, self.dtype, self.global_shape, c.file, c.key, c.offsets, c.shape),
            *(c.begin, c.end, c.checksums, c.block_rows, self.copy_of),
        ]

    @staticmethod
    def from_json(doc: list[Any]) -> ChunkRecord:
        name, dtype, global_shape, file, key, offsets, shape, begin, end, sums, rows, of = doc
        chunk = Chunk(file, key, tuple(offsets), tuple(shape), (begin, end), rows, tuple(sums))
        box = (tuple(of[0]), tuple(of[1])) if of is not None else None
        return ChunkRecord(name, dtype, tuple(global_shape), chunk, box)


@dataclass
class WriteResult:
    """What one rank wrote (sent to rank 0 for the index), or why it failed."""

    files: dict[str, int] = field(default_factory=dict)  # name -> size
    chunks: list[ChunkRecord] = field(default_factory=list)
    error: str | None = None
    # The rank's fragment (size, checksum) and the files of the chunks it lists.
    fragment: tuple[int, str] | None = None
    fragment_files: list[str] = field(default_factory=list)
    # Files of earlier checkpoints its chunks refer to (incremental) -> size.
    referenced: dict[str, int] = field(default_factory=dict)
    headers: dict[str, str] = field(default_factory=dict)  # its shard file -> header checksum
    in_fragment: list[ChunkRecord] = field(default_factory=list)  # (not sent: in the fragment)

    def to_json(self) -> dict[str, Any]:
        chunks = [c.to_json() for c in self.chunks]
        return {
            "files": self.files,
            "chunks": chunks,
            "error": self.error,
            "fragment": self.fragment,
            "fragment_files": self.fragment_files,
            "referenced": self.referenced,
            "headers": self.headers,
        }

    @staticmethod
    def from_json(doc: dict[str, Any]) -> WriteResult:
        chunks = [ChunkRecord.from_json(c) for c in doc["chunks"]]
        fragment = tuple(doc["fragment"]) if doc["fragment"] is not None else None
        return WriteResult(
            doc["files"],
            chunks,
            doc["error"],
            fragment,
            doc["fragment_files"],
            doc["referenced"],
            doc["headers"],
        )

    def file_size(self, name: str) -> int:
        """The size of a file its chunks are in: its own, or a referenced one."""
        return self.files[name] if name in self.files else self.referenced[name]


def plan_save(
    state: Any,
    storage: CheckpointStorage,
    options: SaveOptions,
    *,
    group: Any = None,
    staged: bool = False,
) -> SavePlan:
    """Flatten ``state``, prepare the directory (the committing rank) and decide what
    this rank writes.

    The first save of a job (and the first after any failure) is agreed before a byte
    is written: rank 0 gathers every rank's errors and structure (tensor names, shapes,
    dtypes, placements, node), plans who writes which replicated chunk and sends each
    rank its part; every rank caches that plan. A later save reuses it without a
    collective (*speculatively*) when this rank's structure is the one it cached: the
    commit's gather, which carries each rank's verdict and the plan's digest, then
    either commits or, when any rank changed or failed, has every rank remove what it
    wrote and save again agreed first (``run_save``). Ranks that write before rank 0
    has locked the directory create every file exclusively and refuse a committed
    checkpoint; leftovers of crashed saves are cleared at the commit.

    ``staged`` (a background save) stages device tensors itself (they are not copied
    to the host here) and speculates too, but cannot write again once the caller has
    moved on: when the commit says *again* the steady ranks keep what they wrote, and a
    rank whose structure changed writes its part of a plan made around them, from a
    copy or staged after waiting for it (``_run_phases``).
    """
    me = dist.rank()
    commits = me == 0 or (options.per_node and dist.is_node_leader())
    generation = dist.generation()
    cache_key = (generation, id(group), options.per_node, dist.world_size())
    # Every rank caches, keeps and drops its plan on the same verdicts: whether one is
    # cached is the same on every rank, so all take the same path without asking. A
    # re-initialized process group (an in-process restart, which may bring a new
    # process with nothing cached) starts without plans on every rank.
    for stale in [k for k in list(_PLANS) if k[0] != generation]:  # (the commit thread adds)
        _PLANS.pop(stale, None)
    cached = _PLANS.get(cache_key) if dist.is_distributed() else None
    speculative = cached is not None
    # A rank that fails before the collective still joins it, with its error, so that
    # no other rank waits forever; then every rank raises. Any exception counts: a
    # user's state_dict() may raise anything.
    own_error: Exception | None = None
    tree_here: Any = None
    holdings: list[Holding] = []
    tokens: dict[str, Token] = {}
    aliases: dict[str, str] = {}
    local: dict[str, torch.Tensor] = {}
    commit_: Commit | None = None
    own = None
    sharded: list[Any] = []
    flat = None
    try:
        per_rank = dist.is_distributed() and not dist.in_solo()
        flat = flatten(state, rank=me if per_rank else None)
        tree_here = flat.tree
        holdings, aliases, local, tokens = _holdings(
            flat.tensors, not staged, flat.rank_tensors, with_tokens=options.chain is not None
        )
        # One process has nothing to agree on: its plan costs less than a digest.
        own = _structure_digest(holdings, aliases) if dist.is_distributed() else None
        sharded = _sharded_entries(holdings)
        if commits:
            commit_ = Commit(storage)
            commit_.begin()
            if not speculative:  # no rank writes before the collective that follows
                commit_.clear()
        elif speculative:
            # Written before rank 0 has looked: never beside a committed checkpoint.
            if Commit(storage).is_committed():
                raise CheckpointError(f"{storage.where}: a committed checkpoint is here")
            storage.prepare(durable=False)  # the committing rank's makes it durable
    except Exception as exc:
        own_error = exc
    structure = _RankStructure(own, holdings, aliases, sharded)
    if speculative:
        assert cached is not None
        unsettled = own_error is not None or own != cached.own
        if own_error is not None and commit_ is not None:
            # Not this save's directory to clean (its lock may be another writer's, its
            # files a committed checkpoint's); a synchronous save's agreed round takes
            # the lock again.
            commit_.release()
            commit_ = None
    else:
        cached = _agree_and_plan(
            structure,
            own_error,
            commit_,
            storage.where,
            options,
            group,
        )
        if dist.is_distributed():  # one process (or a solo save) never reuses a plan
            _PLANS[cache_key] = cached
        unsettled = False
    assert cached is not None
    mine = [Piece(h.name, h.offsets, h.shape, me, h) for h in holdings if _writes(h, me)]
    mine += cached.pieces
    return SavePlan(
        storage,
        me,
        tree_here,
        cached.structures,
        [] if unsettled else mine,
        local,
        len(local) + len(aliases),
        options.per_node,
        group,
        commit_,
        cached,
        flat.rank_values if flat is not None else {},
        flat.rank_tensors if flat is not None else set(),
        tokens,
        speculative=speculative,
        unsettled=unsettled,
        error=f"rank {me}: {own_error}" if own_error is not None else None,
        staged=staged,
        own_structure=structure,
        cache_key=cache_key,
    )


@dataclass
class _RankStructure:
    """What a rank holds, as its plan needs it."""

    own: str | None  # its digest (``_structure_digest``)
    holdings: list[Holding]
    aliases: dict[str, str]
    sharded: list[Any]  # ``_sharded_entries``


def _agree_and_plan(
    mine: _RankStructure,
    own_error: Exception | None,
    commit_: Commit | None,
    where: str,
    options: SaveOptions,
    group: Any,
    staged: list[Any] | None = None,
) -> _JobPlan:
    """A save without a plan every rank can reuse. Rank 0 gathers every rank's error
    (raised on every rank) and structure, plans who writes which replicated chunk and
    sends each rank its own writes. A rank's replicated holdings, tied tensors and
    sharded entries travel once per distinct list (under DDP or FSDP: once), so no rank
    but rank 0 receives anything that grows with the ranks; in per-node mode each
    node's first rank also gets every rank's node and tied tensors, for its node's
    index. Waiting for rank 0's answer also orders every write after the preparation
    of the directory.

    ``staged``: the plan of a background save that must run again
    (``_plan_again``): whether this rank is steady, and the writes of its
    cached plan, which rank 0 plans around (``_writes_around_staged``)."""
    me = dist.rank()
    replicated = [h for h in mine.holdings if h.replicated]
    sole_bytes = sum(h.nbytes for h in mine.holdings if _writes(h, me))
    facts = [mine.own, sole_bytes, dist.node_rank(), dist.is_node_leader(), staged]
    structure = {
        "replicated": [h.to_json() for h in replicated],
        "aliases": mine.aliases,
        "sharded": mine.sharded,
    }
    error = f"rank {me}: {own_error}" if own_error else None
    failed, gathered = dist.gather_distinct_json(facts, structure, error, 0, group)
    if failed and commit_ is not None:
        commit_.release()
    if own_error is not None:
        raise own_error
    if failed:
        raise CheckpointError(f"{where}: another rank could not save: {failed}")
    job: _RankZeroPlan | None = None

    def plan() -> list[dict[str, Any]]:
        nonlocal job
        assert gathered is not None
        job = _plan_job(gathered, options.per_node)
        return job.parts

    try:  # a failure to plan fails every rank, none waits for its part
        part = dist.scatter_plan(plan if gathered is not None else None, 0, group)
    except Exception:
        if commit_ is not None:
            commit_.release()
        raise
    held = {(h.name, h.offsets, h.shape): h for h in replicated}
    pieces = [
        Piece(name, tuple(offsets), tuple(shape), me, held[name, tuple(at), tuple(size)])
        for name, offsets, shape, at, size in part["writes"]
    ]
    if job is None:
        return _JobPlan(mine.own, part["job"], part.get("structures"), pieces)
    return _JobPlan(
        mine.own, part["job"], job.structures, pieces, job.table, job.conflict, job.lists
    )


@dataclass
class _RankZeroPlan:
    """Rank 0's plan of a job: each rank's part, and what its commits need."""

    parts: list[dict[str, Any]]  # per rank: the job's digest, its writes (and structures)
    structures: list[dict[str, Any]]  # every rank's aliases, node and whether it leads it
    table: dict[str, tuple[str, tuple[int, ...], Sharding]]
    conflict: str | None
    lists: list[Any]  # the distinct lists of sharded entries the table is made of


def _plan_job(gathered: list[tuple[Any, Any]], per_node: bool) -> _RankZeroPlan:
    """Rank 0: from every rank's facts and structure (equal structures are one object,
    read once), who writes which replicated chunk, and each rank's part of the plan."""
    decoded: dict[int, list[Holding]] = {}
    for _, structure in gathered:
        if id(structure) not in decoded:
            decoded[id(structure)] = [Holding.from_json(h) for h in structure["replicated"]]
    replicated = [decoded[id(structure)] for _, structure in gathered]
    sole_bytes = [facts[1] for facts, _ in gathered]
    nodes = [facts[2] for facts, _ in gathered]
    if gathered[0][0][4] is not None:  # a background save's again: around what is written
        steady = [facts[4][0] for facts, _ in gathered]
        kept = [facts[4][1] for facts, _ in gathered]
        pieces = _writes_around_staged(steady, kept, sole_bytes, replicated, nodes, per_node)
    else:
        pieces = _plan_writes(sole_bytes, replicated, nodes, per_node)
    structures = [
        {"aliases": structure["aliases"], "node": facts[2], "leader": facts[3]}
        for facts, structure in gathered
    ]
    job = _digest([facts[0] for facts, _ in gathered])
    parts: list[dict[str, Any]] = [{"job": job, "writes": []} for _ in gathered]
    for p in pieces:
        held = p.source  # the writer's holding the piece is cut from
        parts[p.writer]["writes"].append([p.name, p.offsets, p.shape, held.offsets, held.shape])
    if per_node:  # the ranks that commit a node's copy build its index
        for rank, (facts, _) in enumerate(gathered):
            if facts[3] or rank == 0:
                parts[rank]["structures"] = structures
    sharded: dict[str, Any] = {}  # each distinct list once, whatever else differs
    for structure in {id(s): s for _, s in gathered}.values():
        sharded.setdefault(_digest(structure["sharded"]), structure["sharded"])
    lists = list(sharded.values())
    table, conflict = _sharded_table(lists)
    return _RankZeroPlan(parts, structures, table, conflict, lists)


def _plan_writes(
    load: list[int], replicated: list[list[Holding]], nodes: list[int], per_node: bool
) -> list[Piece]:
    """``plan_writes`` for the job, or in per-node mode for each node apart: every node
    writes its own copy of replicated state, split among its ranks, so a node restores
    from its own disk alone; shards are written once."""
    if not per_node:
        return plan_writes(load, replicated)
    members: dict[int, list[int]] = {}
    for rank, node in enumerate(nodes):
        members.setdefault(node, []).append(rank)
    pieces = []
    for node in sorted(members):
        ranks = members[node]
        for piece in plan_writes([load[r] for r in ranks], [replicated[r] for r in ranks]):
            piece.writer = ranks[piece.writer]  # the node's index -> the job's rank
            pieces.append(piece)
    return pieces


def _writes_around_staged(
    steady: list[bool],
    kept: list[list[Any]],
    sole_bytes: list[int],
    replicated: list[list[Holding]],
    nodes: list[int],
    per_node: bool,
) -> list[Piece]:
    """Rank 0, for a background save that must run again: the steady ranks wrote their
    cached share and can write nothing else (they staged only that); the ranks whose
    structure changed copied everything they hold and write the rest.

    A cached piece stays with its writer if the writer is steady or still holds the
    chunk it is cut from; otherwise it goes to the least-loaded changed rank (of the
    writer's node, in per-node mode) that holds that chunk, and is dropped if no rank
    holds it any more. Chunks no cached piece is cut from are planned among the changed
    ranks that hold them. A piece of a chunk that only steady ranks hold cannot be
    written: the save fails (the next one agrees first)."""
    chunks: dict[int, dict[tuple[Any, ...], Holding]] = {}  # per distinct list
    for held in replicated:
        if id(held) not in chunks:
            chunks[id(held)] = {(h.name, h.offsets, h.shape): h for h in held}
    load = list(sole_bytes)
    pieces: list[Piece] = []
    orphans: list[tuple[int, list[Any]]] = []  # (cached writer, its write)
    # The chunks cached pieces are cut from (with the node whose copy they are).
    cut: set[tuple[Any, ...]] = set()
    for rank, writes in enumerate(kept):
        for write in writes:
            name, offsets, shape, at, size = write
            key = (name, tuple(at), tuple(size))
            cut.add((*key, nodes[rank] if per_node else None))
            source = chunks[id(replicated[rank])].get(key)  # a steady rank's always is
            if source is None:
                orphans.append((rank, write))
                continue
            piece = Piece(name, tuple(offsets), tuple(shape), rank, source)
            pieces.append(piece)
            load[rank] += _piece_nbytes(piece)
    # The changed ranks' holders of each chunk, found once per distinct list.
    changed: dict[int, tuple[list[Holding], list[int]]] = {}
    for rank, held in enumerate(replicated):
        if not steady[rank]:
            changed.setdefault(id(held), (held, []))[1].append(rank)
    wanted = {(w[0], tuple(w[3]), tuple(w[4])) for _, w in orphans}
    holders: dict[tuple[Any, ...], list[int]] = {}
    # Per distinct changed list (and node): its chunks no cached piece is cut from.
    new: dict[tuple[int, int | None], list[Holding]] = {}
    for held, ranks in changed.values():
        for h in held:
            key = (h.name, h.offsets, h.shape)
            if key in wanted:
                holders.setdefault(key, []).extend(ranks)
        for node in {nodes[r] if per_node else None for r in ranks}:
            new[id(held), node] = [h for h in held if (h.name, h.offsets, h.shape, node) not in cut]
    for cached_writer, (name, offsets, shape, at, size) in orphans:
        key = (name, tuple(at), tuple(size))
        node = nodes[cached_writer]
        candidates = [r for r in holders.get(key, []) if not per_node or nodes[r] == node]
        if not candidates:
            if per_node:  # (the node's ranks' chunks: its copy)
                held_by = [chunks[id(replicated[r])] for r, n in enumerate(nodes) if n == node]
            else:
                held_by = list(chunks.values())
            if any(key in c for c in held_by):
                raise CheckpointError(
                    f"rank {cached_writer}'s structure changed during this background save and "
                    f"the piece of {name!r} at {list(offsets)} it was to write is held "
                    "only by ranks that staged their own share: the save cannot be "
                    "completed from what was staged, nothing is committed, and the next "
                    "save agrees on a plan before it stages"
                )
            continue  # no rank holds it any more: the entry left the state
        writer = min(candidates, key=lambda r: (load[r], r))
        source = chunks[id(replicated[writer])][key]
        piece = Piece(name, tuple(offsets), tuple(shape), writer, source)
        pieces.append(piece)
        load[writer] += _piece_nbytes(piece)
    nothing: list[Holding] = []
    lists = [
        nothing if steady[r] else new[id(held), nodes[r] if per_node else None]
        for r, held in enumerate(replicated)
    ]
    return pieces + _plan_writes(load, lists, nodes, per_node)


def _piece_nbytes(p: Piece) -> int:
    return math.prod(p.shape) * itemsize(p.source.dtype)


def _writes(h: Holding, rank: int) -> bool:
    """Whether ``rank`` writes its unreplicated holding ``h``: always, unless copies of
    it sit on other replicas (HSDP), of which the sharding picks one."""
    if h.replicated:
        return False  # planned among its holders
    if h.sharding is None:
        return True
    coord = h.sharding.mesh.coord_of(rank)
    return coord is not None and h.sharding.writer(coord) == rank


@dataclass(frozen=True)
class _JobPlan:
    """The agreed plan of a job's saves while no rank's structure changes."""

    own: str | None  # this rank's structure digest (None in one process: no reuse)
    job: str  # the digest of every rank's structure digest
    # Every rank's aliases, node and whether it leads it: on rank 0 and, in per-node
    # mode, on each node's first rank (None elsewhere).
    structures: list[dict[str, Any]] | None
    pieces: list[Piece]  # this rank's share of the replicated chunks
    # On rank 0: every entry described by its sharding -> (dtype, global shape,
    # sharding), or why the ranks' descriptions disagree.
    sharded: dict[str, tuple[str, tuple[int, ...], Sharding]] | None = None
    conflict: str | None = None
    lists: list[Any] | None = None  # on rank 0: the distinct lists the table is made of


# Plans of earlier saves, by (process group, per-node mode, world size). Every rank
# keeps its own; all of them are made and dropped on the same collectives' results.
_PLANS: dict[tuple[Any, ...], _JobPlan] = {}


def _forget(job: _JobPlan | None) -> None:
    for key in [k for k, v in list(_PLANS.items()) if v is job]:
        del _PLANS[key]


class _Unsettled(Exception):
    """A speculative save that could not commit (a rank changed or failed): every rank
    removed what it wrote and saves again, agreed first. A background save's steady
    ranks keep theirs: ``written`` is what this rank wrote and reported."""

    def __init__(
        self, why: str, written: WriteResult | None = None, kept: list[str] | None = None
    ) -> None:
        super().__init__(why)
        self.written = written
        self.kept = kept  # on rank 0: every file the ranks wrote and keep


def _digest(value: Any) -> str:
    return xxhash.xxh3_128_hexdigest(json.dumps(value).encode())


def _structure_digest(holdings: list[Holding], aliases: dict[str, str]) -> str:
    """What the plan depends on from this rank: its holdings (with their shardings),
    its tied tensors, its node."""
    facts = [
        (h.to_json(), h.replicated, h.sharding and (h.sharding.mesh.digest, h.sharding.dims))
        for h in holdings
    ]
    return _digest([facts, sorted(aliases.items()), dist.node_rank(), dist.rank()])


def _sharded_entries(holdings: list[Holding]) -> list[Any]:
    """This rank's entries described by a sharding, as the index needs them: the same
    list on every rank that holds the same entries (no offsets)."""
    meshes: dict[Mesh, int] = {}
    entries = []
    for h in holdings:
        if h.sharding is not None:
            mesh = meshes.setdefault(h.sharding.mesh, len(meshes))
            entries.append([h.name, h.dtype, h.global_shape, mesh, h.sharding.dims])
    return [[[m.shape, m.ranks_json()] for m in meshes], entries] if entries else []


def _sharded_table(
    lists: list[Any],
) -> tuple[dict[str, tuple[str, tuple[int, ...], Sharding]], str | None]:
    """Every sharded entry from the ranks' distinct lists; an entry two ranks describe
    differently is a conflict (reported by the commit: the index could not be right)."""
    table: dict[str, tuple[str, tuple[int, ...], Sharding]] = {}
    for doc in lists:
        if not doc:
            continue
        meshes = [Mesh.from_json(tuple(shape), ranks) for shape, ranks in doc[0]]
        for name, dtype, global_shape, mesh, dims in doc[1]:
            described = (dtype, tuple(global_shape), Sharding(meshes[mesh], tuple(dims)))
            if table.setdefault(name, described) != described:
                return table, f"{name!r} is sharded differently on different ranks"
    return table, None


def commit(
    plan: SavePlan, result: WriteResult, metadata: dict[str, Any] | None, *, start: float
) -> SaveInfo:
    """The commit phase: every rank reports, rank 0 builds the index, the committing
    rank(s) write index then marker, every rank learns the outcome. Raises on every
    rank if any rank failed.

    The gather doubles as the barrier before commit: rank 0 hears from every rank once
    its files are durable (or failed).
    """
    again = False
    try:
        return _commit(plan, result, metadata, start)
    except _Unsettled:
        again = plan.staged  # its next round commits into this directory, still locked
        raise
    finally:
        if not again:
            plan.release()


def _plan_unsettled_again(plan: SavePlan, options: SaveOptions) -> SavePlan:
    """A background save's rank that wrote nothing (``_run_phases``), on the caller's
    thread: its round of the commit (the others' on their background threads, once
    their speculative files are durable) says *again*; returns its part of the plan
    made around what the others wrote, to stage. A final failure raises here."""
    try:
        commit(plan, WriteResult(), options.metadata, start=time.perf_counter())
    except _Unsettled as again:
        return _part_of(plan, _plan_again(plan, WriteResult(), again.kept, options))
    raise AssertionError("a save committed without an unsettled rank's part")


def _part_of(plan: SavePlan, job: _JobPlan) -> SavePlan:
    """An unsettled rank's plan for its part of ``job``: its own shards and its share
    of the replicated chunks."""
    me = plan.rank
    assert plan.own_structure is not None
    own = [Piece(h.name, h.offsets, h.shape, me, h) for h in plan.own_structure.holdings]
    pieces = [p for p in own if _writes(p.source, me)] + job.pieces
    return replace(
        plan,
        structures=job.structures,
        pieces=pieces,
        job=job,
        speculative=False,
        unsettled=False,
    )


def _plan_again(
    plan: SavePlan, kept: WriteResult, every_kept: list[str] | None, options: SaveOptions
) -> _JobPlan:
    """Every rank, after a background save's *again* (a steady rank on its background
    thread, an unsettled one on the caller's): the committing ranks clear leftovers but
    the files written (``every_kept``, from rank 0), then rank 0 plans around what the
    steady ranks wrote (``_writes_around_staged``), and every rank caches that plan.
    On a failure every rank removes what it wrote and raises."""
    mine = plan.own_structure
    assert mine is not None and plan.job is not None
    cleared: Exception | None = None  # why a committing rank could not clear
    try:
        if plan.per_node and plan.commit is not None:  # each node's first rank: its own
            assert plan.structures is not None
            leaders = [0, *(r for r, s in enumerate(plan.structures) if s["leader"] and r)]
            every_kept = dist.relay_json(every_kept, leaders, plan.group)
        if plan.commit is not None:  # before the plan that orders the other ranks' writes
            plan.commit.clear(keep=set(every_kept or ()))
    except Exception as exc:  # every rank raises it at the planning that follows
        cleared = exc
    cached = [
        [p.name, p.offsets, p.shape, p.source.offsets, p.source.shape] for p in plan.job.pieces
    ]
    try:
        job = _agree_and_plan(
            mine,
            cleared,
            None,
            plan.storage.where,
            options,
            plan.group,
            staged=[not plan.unsettled, cached],
        )
    except Exception as exc:
        cleanup = plan.commit or Commit(plan.storage)
        cleanup.abort(kept.files, remove_directory=plan.commit is not None)
        plan.release()
        raise CheckpointError(
            f"{plan.storage.where}: the background save could not be completed ({exc}); "
            "nothing was committed and earlier checkpoints are untouched"
        ) from exc
    _PLANS[plan.cache_key] = job
    return job


def _commit(
    plan: SavePlan, result: WriteResult, metadata: dict[str, Any] | None, start: float
) -> SaveInfo:
    records, sizes = [*result.chunks, *result.in_fragment], {**result.files, **result.referenced}
    if result.error is None and not plan.unsettled and result.fragment is None:
        result = _write_fragment(plan, result)  # (written already by a first round)
    # The non-tensor trees travel here, not with the plan: they change every save.
    docs: list[Any] | None = None
    trees: list[Any] = [plan.tree]
    results: list[WriteResult] | None = [result]
    unsettled: list[int] = []  # on rank 0: the ranks that did not write the cached plan
    if dist.is_distributed():
        assert plan.job is not None
        # A speculative save's verdict and plan digest travel with its result: this
        # gather is the save's only collective before the outcome.
        job = plan.job.job if plan.speculative and not plan.unsettled else None
        report = {"result": result.to_json(), "tree": plan.tree, "job": job}
        gathered = dist.gather_json(report, 0, plan.group)
        docs = [g["result"] for g in gathered] if gathered is not None else None
        results = [WriteResult.from_json(d) for d in docs] if docs is not None else None
        trees = [g["tree"] for g in gathered or []]
        if plan.speculative:
            unsettled = [r for r, g in enumerate(gathered or []) if g["job"] != plan.job.job]
    outcome: str | dict[str, str] | None = None
    inputs: dict[str, Any] | None = None  # per node: what each node's first rank needs
    own_index: tuple[bytes, set[str]] | None = None
    if results is not None:  # rank 0
        errors = [r.error for r in results if r.error]
        outcome = errors[0] if errors else None
        changed = bool(unsettled) and not errors  # (an unsettled rank that failed says why)
        if changed:
            outcome = f"rank {unsettled[0]} did not write the cached plan"
        if outcome is None:
            try:
                assert plan.job is not None
                tree = merge_trees(trees)
                created = datetime.now(timezone.utc).isoformat(timespec="seconds")
                table = (plan.job.sharded or {}, plan.job.conflict)
                if plan.per_node:
                    # Each node's first rank builds its node's index from the same inputs
                    # (in parallel): rank 0 builds the first node's alone, whose checksum
                    # names the checkpoint, instead of one per node.
                    nodes = [s["node"] for s in plan.structures]
                    first = _index(plan, tree, results, metadata, table, created, nodes[0], nodes)
                    own_index = (first.to_json(), set(first.files))  # rank 0's node is first
                    inputs = {
                        "results": docs or [r.to_json() for r in results],
                        "tree": tree,
                        "sharded": [doc for doc in plan.job.lists or [] if doc],
                        "created": created,
                        "metadata": first.metadata,  # a plain dict, as the index holds it
                        "first": checksum(own_index[0]),
                    }
                else:
                    assert plan.commit is not None
                    index = _index(plan, tree, results, metadata, table, created)
                    plan.commit.clear(keep=index.files)
                    plan.commit.finish(index.to_json())
            except Exception as exc:  # OSError locally; the object store's errors too
                outcome = f"rank 0 (commit): {exc}"
        # A failed guess: every rank saves again, agreed (a background save only when a
        # structure changed: it cannot write again what failed to be written).
        if outcome is not None and plan.speculative and (changed or not plan.staged):
            outcome = {"again": outcome}
        written = sum(sum(r.files.values()) for r in results)
        files = sum(len(r.files) for r in results)
    else:
        written, files = sum(result.files.values()), len(result.files)
    outcome = dist.broadcast_json(outcome, 0, plan.group)
    if plan.per_node and outcome is None:
        if plan.commit is not None:  # it commits its node's copy: it needs the inputs
            leaders = [0, *(r for r, s in enumerate(plan.structures) if s["leader"] and r)]
            inputs = dist.relay_json(inputs, leaders, plan.group)
        outcome = _commit_every_node(plan, inputs, own_index)
    if outcome:
        _forget(plan.job)  # every rank got this outcome: the next save is agreed first
        again = isinstance(outcome, dict)
        if again and plan.staged:  # the steady ranks' files stay: planned around, below
            kept = sorted({f for r in results for f in r.files}) if results else None
            raise _Unsettled(outcome["again"], result, kept)
        # Only the committing rank removes the directory: another rank's files may still
        # be in flight when a fast-failing rank gets here. Each rank removes only the
        # files it created (made exclusively, so none is another save's).
        cleanup = plan.commit or Commit(plan.storage)
        own = [*result.files, *((INDEX_NAME, MARKER_NAME) if plan.commit else ())]
        cleanup.abort(own, remove_directory=plan.commit is not None and not again)
        if again:
            raise _Unsettled(outcome["again"])
        raise CheckpointError(
            f"{plan.storage.where}: writing the checkpoint failed ({outcome}); nothing was "
            "committed and earlier checkpoints are untouched. Fix the cause above (free "
            "space, permissions, the object store's reachability), then save again."
        )
    if plan.chain is not None:  # committed on every rank: the next save's base
        plan.chain.committed(plan.storage.root, records, plan.tokens, sizes)
    seconds = time.perf_counter() - start
    return SaveInfo(
        path=plan.storage.root,
        files=files,
        tensors=plan.tensors,
        bytes_written=written,
        seconds=seconds,
        blocked_seconds=seconds,  # a synchronous save blocks for all of it
    )


def _write_fragment(plan: SavePlan, result: WriteResult) -> WriteResult:
    """Move this rank's chunks of sharded entries, and its own values (``PerRank``)
    with their tensors, out of what goes to rank 0 into its fragment file (format
    version 2): rank 0's index then grows neither by ranks x sharded tensors nor by a
    value per rank."""
    names = plan.sharded_names
    sharded = {c.name: c.chunk for c in result.chunks if c.name in names} if names else {}
    own = [
        TensorEntry(c.name, c.dtype, c.global_shape, (c.chunk,))
        for c in result.chunks
        if c.name in plan.rank_tensors
    ]
    if not sharded and not plan.rank_values:
        return result
    name = fragment_file(plan.rank)
    try:
        data = fragment_json(plan.rank, sharded, plan.rank_values, own)
        # Exclusive, as the shard files: a fragment that is there is another writer's.
        plan.storage.write_small_durably(name, data, exclusive=True)
    except Exception as exc:
        Commit(plan.storage).abort(result.files, remove_directory=False)
        return WriteResult(error=f"rank {plan.rank}: writing {name}: {exc}")
    return WriteResult(
        files={**result.files, name: len(data)},
        chunks=[
            c for c in result.chunks if c.name not in sharded and c.name not in plan.rank_tensors
        ],
        fragment=(len(data), checksum(data)),
        fragment_files=sorted({c.file for c in [*sharded.values(), *(e.chunks[0] for e in own)]}),
        referenced=result.referenced,
        headers=result.headers,
        in_fragment=[c for c in result.chunks if c.name in sharded or c.name in plan.rank_tensors],
    )


def _commit_every_node(
    plan: SavePlan, inputs: dict[str, Any] | None, own_index: tuple[bytes, set[str]] | None
) -> str | None:
    """Node-local directories: each node's first rank builds its node's index from
    rank 0's ``inputs`` and commits its node's copy. Every copy names the checkpoint by
    the first node's index (the one the remote copy gets), so copies of one
    checkpoint are known as such. If any node fails, the others withdraw theirs
    (marker first): a copy that looks committed on one node must mean every node's
    part is durable. ``own_index``: rank 0 built its node's already (and its files)."""
    error = None
    if plan.commit is not None:
        try:
            if own_index is None:
                assert inputs is not None  # relayed to every rank that commits
                index = _node_index(plan, inputs)
                own_index = (index.to_json(), set(index.files))
            plan.commit.clear(keep=own_index[1])
            plan.commit.finish(own_index[0], inputs["first"])
        except Exception as exc:
            error = f"rank {plan.rank} (commit): {exc}"
    first = dist.first_error(error, plan.group)
    if first is not None:
        if plan.commit is not None and error is None:
            plan.commit.release()
            try:
                plan.commit.delete()
            except Exception:  # best effort; the marker goes first, so at worst a leftover
                pass
        # Every copy's marker is gone before any rank removes its files (the caller's
        # clean-up): a crash in between must not leave a copy that looks whole.
        dist.barrier(plan.group)
    return first


def _node_index(plan: SavePlan, inputs: dict[str, Any]) -> Index:
    """This node's index, from the inputs rank 0 sent (the same as rank 0's own)."""
    results = [WriteResult.from_json(d) for d in inputs["results"]]
    table = _sharded_table(inputs["sharded"]) if inputs["sharded"] else ({}, None)
    nodes = [s["node"] for s in plan.structures]
    created, node = inputs["created"], dist.node_rank()
    return _index(plan, inputs["tree"], results, inputs["metadata"], table, created, node, nodes)


@dataclass
class ShardFile:
    """One shard file of this rank: its header and where each piece's bytes go."""

    name: str
    size: int
    header: torch.Tensor  # uint8, padded; the file's first bytes
    placed: list[_Placed]

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


def chunk_records(
    placed: list[_Placed], checksums: list[list[str]], identities: list[str | None]
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


def write_from_memory(plan: SavePlan, shards: list[ShardFile], threads: int) -> WriteResult:
    """The write phase of a synchronous save: this rank's files straight from tensor
    memory, checksums computed beside the writes."""
    to_write: dict[str, tuple[int, list[Segment]]] = {
        f.name: (f.size, [Segment(0, f.header), *(Segment(p.begin, p.raw) for p in f.placed)])
        for f in shards
    }
    placed = [p for f in shards for p in f.placed]

    def digests_of(p: _Placed) -> tuple[list[str], str | None]:
        raw = p.raw.numpy()
        sums = block_checksums(raw, p.slot.shape, itemsize(p.slot.dtype), p.block_rows)
        return sums, identity(raw) if id(p.piece) in plan.identify else None

    # Checksums run on their own thread, so they cost no wall time.
    with ThreadPoolExecutor(max_workers=1, thread_name_prefix="shardpoint-hash") as hasher:
        digests = map_batched(hasher, digests_of, placed, lambda p: p.slot.nbytes)
        # Created exclusively (a file that is there is another writer's); on failure
        # write_files removes the files it created, and only those.
        plan.storage.write_files(to_write, threads=threads)
        try:
            done = digests()
        except Exception:  # none of this rank's files may stay behind
            Commit(plan.storage).abort(to_write, remove_directory=False)
            raise
    records = chunk_records(placed, [d[0] for d in done], [d[1] for d in done])
    headers = {f.name: f.header_checksum for f in shards}
    return WriteResult({f.name: f.size for f in shards}, records, headers=headers)


# Built per tensor: a frozen dataclass costs five times as much to build.
@dataclass(slots=True, unsafe_hash=True)
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
    plan: SavePlan,
    tree: Any,
    results: list[WriteResult],
    metadata: dict[str, Any] | None,
    table: tuple[dict[str, tuple[str, tuple[int, ...], Sharding]], str | None],
    created: str,
    node: int | None = None,
    nodes: list[int] | None = None,
) -> Index:
    """The index of the checkpoint, or of one ``node``'s copy of it: every shard, and
    of replicated state the copy that node's ranks wrote (or, for state that node does
    not hold, the first node's copy)."""
    holders: dict[tuple[Any, ...], set[int]] = {}  # replicated box -> nodes with a copy
    for rank, r in enumerate(results):
        for c in r.chunks:
            if c.copy_of is not None and nodes is not None:
                holders.setdefault((c.name, *c.copy_of), set()).add(nodes[rank])
    copier = {box: node if node in held else min(held) for box, held in holders.items()}

    def included(rank: int, c: ChunkRecord) -> bool:
        if node is None or c.copy_of is None or nodes is None:
            return True
        return copier[(c.name, *c.copy_of)] == nodes[rank]

    chunks_of: dict[str, list[Chunk]] = {}
    meta: dict[str, tuple[str, tuple[int, ...]]] = {}
    files: dict[str, int] = {}
    headers: dict[str, str] = {}
    for rank, r in enumerate(results):
        headers.update(r.headers)
        for c in r.chunks:
            if included(rank, c):
                if meta.setdefault(c.name, (c.dtype, c.global_shape)) != (c.dtype, c.global_shape):
                    dtype, shape = meta[c.name]
                    raise UnsupportedValueError(
                        f"tensor {c.name!r} is {dtype}{list(shape)} on one rank and "
                        f"{c.dtype}{list(c.global_shape)} on rank {rank}: a value that differs "
                        "per rank must be wrapped in shardpoint.PerRank (or be a DTensor)"
                    )
                chunks_of.setdefault(c.name, []).append(c.chunk)
                files[c.chunk.file] = r.file_size(c.chunk.file)
        if node is None or (nodes is not None and nodes[rank] == node):
            files.update(r.files)  # a node's own files, even one of no chunks
        # Every node's index names every rank's sharded chunks: their files and fragment.
        for name in [*r.fragment_files, *([fragment_file(rank)] if r.fragment else [])]:
            files[name] = r.file_size(name)
    entries = {
        name: TensorEntry(
            name, meta[name][0], meta[name][1], tuple(sorted(chunks, key=lambda c: c.offsets))
        )
        for name, chunks in chunks_of.items()
    }
    sharded, conflict = table
    if conflict is not None:
        raise UnsupportedValueError(conflict)
    shardings = {}
    for name, (dtype, shape, sharding) in sharded.items():
        if name in entries:
            raise UnsupportedValueError(f"{name!r} is sharded on some ranks and not on others")
        entries[name] = TensorEntry(name, dtype, shape, ())
        shardings[name] = sharding
    aliases = {a: t for s in plan.structures for a, t in s["aliases"].items() if a not in entries}
    return Index(
        files=files,
        entries=entries,
        aliases=aliases,
        tree=tree,
        created=created,
        library_version=__version__,
        world_size=len(results),
        metadata=dict(metadata or {}),
        shardings=shardings,
        fragments={rank: r.fragment for rank, r in enumerate(results) if r.fragment},
        format_version=REFERENCES_VERSION if any(r.referenced for r in results) else PLAIN_VERSION,
        headers={name: h for name, h in headers.items() if name in files},
    )


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


def _holdings(
    tensors: dict[str, torch.Tensor], to_host: bool, own: set[str], *, with_tokens: bool
) -> tuple[list[Holding], dict[str, str], dict[str, torch.Tensor], dict[str, Token]]:
    """What this rank holds of each tensor entry, tied tensors stored once.

    Returns the holdings, alias name -> stored name (views of the same memory), name ->
    the local bytes as a contiguous (host, with ``to_host``) tensor, and name -> the
    local part's token (``with_tokens``: incremental saves). Tensors named in ``own``
    are this rank's alone (never planned among holders).
    """
    world = dist.world_size()
    seen: dict[tuple[Any, ...], str] = {}
    holdings: list[Holding] = []
    aliases: dict[str, str] = {}
    local: dict[str, torch.Tensor] = {}
    tokens: dict[str, Token] = {}
    for name, t in tensors.items():
        if name == METADATA_KEY:  # the one key a safetensors header keeps for itself
            raise UnsupportedValueError(
                f"cannot save a tensor named {name!r}: safetensors reserves that key; rename it"
            )
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
        if part.is_conj() or part.is_neg():  # a lazy view: its values are not its bytes
            part = part.resolve_conj().resolve_neg()
        memory = None
        if part.numel():  # every empty tensor has the same (null) data pointer
            memory = (part.device, part.data_ptr(), tuple(part.shape), part.stride(), part.dtype)
        if memory is not None and memory in seen:
            aliases[name] = seen[memory]
            continue
        if memory is not None:
            seen[memory] = name
        sharding = regular_sharding(t, name, offsets, tuple(part.shape)) if world > 1 else None
        # A tensor of this rank's own value (PerRank) is its alone, whatever its kind.
        replicated = sharding is None and world > 1 and name not in own and may_be_replicated(t)
        holdings.append(
            Holding(name, dtype, global_shape, offsets, tuple(part.shape), replicated, sharding)
        )
        local[name] = host_contiguous(part) if to_host else plain(part).contiguous()
        if with_tokens:
            tokens[name] = token(part)
    return holdings, aliases, local, tokens


# A header entry beyond its name: dtype, shape, offsets and JSON punctuation (a generous
# bound; a key with offsets, "name@o0,o1", is counted as twice the name).
_HEADER_ENTRY_BYTES = 256
HEADER_BUDGET = MAX_HEADER_BYTES // 2


def _pack(
    names: list[str], tensors: dict[str, torch.Tensor], max_bytes: int, rank: int
) -> dict[str, list[str]]:
    """Greedy packing in state order: related tensors stay together in one file. A file
    also ends before its header could pass HEADER_BUDGET (readers, the reference library
    too, refuse one over MAX_HEADER_BYTES: a million tiny tensors of long names)."""
    files: dict[str, list[str]] = {}
    current: list[str] = []
    size = header = 0
    for name in names:
        nbytes = tensors[name].numel() * tensors[name].element_size()
        entry = len(name.encode()) * 2 + _HEADER_ENTRY_BYTES  # its key, at most, and fields
        if current and (size + nbytes > max_bytes or header + entry > HEADER_BUDGET):
            files[shard_file(rank, len(files))] = current
            current, size, header = [], 0, 0
        current.append(name)
        size += nbytes
        header += entry
    if current or not files:
        files[shard_file(rank, len(files))] = current
    return files
