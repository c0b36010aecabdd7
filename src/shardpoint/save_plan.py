"""The plan phase: what each rank writes, agreed across ranks, and its cache.

The first save of a job (and the first after any failure) gathers every rank's
structure to rank 0, which plans who writes which replicated chunk (``plan.py``) and
sends each rank its part; later saves reuse the cached plan without a collective while
a rank's structure is unchanged (*speculatively*: the commit's gather checks). After a
background save's *again* (``saving.run_save``), ``plan_again`` plans around what the
steady ranks wrote.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field, replace
from typing import Any

import torch
import xxhash

from . import dist
from .commit import Commit
from .errors import CheckpointError, UnsupportedValueError
from .format.safetensors import METADATA_KEY, dtype_name, tensor_nbytes
from .incremental import IncrementalChain, Token, token
from .plan import Holding, Piece, plan_writes_per_node, writes_around_staged
from .save_records import (
    PlannedWrite,
    RankFacts,
    SaveOptions,
    ShardedTable,
    WriteResult,
    sharded_table,
)
from .sharding import Mesh
from .storage import CheckpointStorage
from .tensor_kinds import local_part, may_be_replicated, regular_sharding
from .tensor_memory import host_contiguous, memory_key, plain
from .tree import flatten


@dataclass
class SavePlan:
    """What this rank writes for one save, agreed with every other rank."""

    storage: CheckpointStorage
    rank: int
    tree: Any  # this rank's non-tensor tree (rank 0 merges every rank's at the commit)
    structures: list[dict[str, Any]] | None  # see JobPlan
    pieces: list[Piece]  # what this rank writes
    local: dict[str, torch.Tensor]  # name -> this rank's contiguous bytes of the entry
    tensors: int
    per_node: bool
    group: Any = None  # the process group of the save's collectives (None: default)
    commit: Commit | None = None  # held by the rank that commits this directory
    job: JobPlan | None = None  # the agreed plan (on rank 0: the sharded entries too)
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
    # copied what it holds or waited for its part of the new plan (``saving.run_save``).
    staged: bool = False
    own_structure: _RankStructure | None = None  # this rank's, as planned
    cache_key: tuple[Any, ...] = ()  # where its plan is cached (``PLANS``)

    @property
    def sharded_names(self) -> set[str]:
        """This rank's entries described by their sharding (chunks go to its fragment)."""
        return {p.name for p in [*self.pieces, *self.referred] if p.source.sharding is not None}

    def release(self) -> None:
        if self.commit is not None:
            self.commit.release()


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
    copy or staged after waiting for it (``saving.run_save``).
    """
    me = dist.rank()
    commits = me == 0 or (options.per_node and dist.is_node_leader())
    generation = dist.generation()
    cache_key = (generation, id(group), options.per_node, dist.world_size())
    # Every rank caches, keeps and drops its plan on the same verdicts: whether one is
    # cached is the same on every rank, so all take the same path without asking. A
    # re-initialized process group (an in-process restart, which may bring a new
    # process with nothing cached) starts without plans on every rank.
    for stale in [k for k in list(PLANS) if k[0] != generation]:  # (the commit thread adds)
        PLANS.pop(stale, None)
    cached = PLANS.get(cache_key) if dist.is_distributed() else None
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
            PLANS[cache_key] = cached
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
    again: tuple[bool, list[PlannedWrite]] | None = None,
) -> JobPlan:
    """A save without a plan every rank can reuse. Rank 0 gathers every rank's error
    (raised on every rank) and structure, plans who writes which replicated chunk and
    sends each rank its own writes. A rank's replicated holdings, tied tensors and
    sharded entries travel once per distinct list (under DDP or FSDP: once), so no rank
    but rank 0 receives anything that grows with the ranks; in per-node mode each
    node's first rank also gets every rank's node and tied tensors, for its node's
    index. Waiting for rank 0's answer also orders every write after the preparation
    of the directory.

    ``again``: the plan of a background save that must run again (``plan_again``):
    whether this rank is steady, and the writes of its cached plan, which rank 0 plans
    around (``plan.writes_around_staged``)."""
    me = dist.rank()
    replicated = [h for h in mine.holdings if h.replicated]
    sole_bytes = sum(h.nbytes for h in mine.holdings if _writes(h, me))
    facts = RankFacts(mine.own, sole_bytes, dist.node_rank(), dist.is_node_leader(), again)
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
    writes = [PlannedWrite(*w) for w in part["writes"]]
    pieces = [
        Piece(
            w.name, tuple(w.offsets), tuple(w.shape), me, held[w.name, tuple(w.at), tuple(w.size)]
        )
        for w in writes
    ]
    if job is None:
        return JobPlan(mine.own, part["job"], part.get("structures"), pieces)
    return JobPlan(
        mine.own, part["job"], job.structures, pieces, job.table, job.conflict, job.lists
    )


@dataclass
class _RankZeroPlan:
    """Rank 0's plan of a job: each rank's part, and what its commits need."""

    parts: list[dict[str, Any]]  # per rank: the job's digest, its writes (and structures)
    structures: list[dict[str, Any]]  # every rank's aliases, node and whether it leads it
    table: ShardedTable
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
    every = [RankFacts(*facts) for facts, _ in gathered]
    sole_bytes = [f.sole_bytes for f in every]
    nodes = [f.node for f in every]
    if every[0].again is not None:  # a background save's again: around what is written
        steady = [f.again[0] for f in every if f.again is not None]
        kept = [[PlannedWrite(*w) for w in f.again[1]] for f in every if f.again is not None]
        pieces = writes_around_staged(steady, kept, sole_bytes, replicated, nodes, per_node)
    else:
        pieces = plan_writes_per_node(sole_bytes, replicated, nodes, per_node)
    structures = [
        {"aliases": structure["aliases"], "node": f.node, "leader": f.leader}
        for f, (_, structure) in zip(every, gathered)
    ]
    job = _digest([f.structure for f in every])
    parts: list[dict[str, Any]] = [{"job": job, "writes": []} for _ in gathered]
    for p in pieces:
        held = p.source  # the writer's holding the piece is cut from
        write = PlannedWrite(p.name, p.offsets, p.shape, held.offsets, held.shape)
        parts[p.writer]["writes"].append(write)
    if per_node:  # the ranks that commit a node's copy build its index
        for rank, f in enumerate(every):
            if f.leader or rank == 0:
                parts[rank]["structures"] = structures
    sharded: dict[str, Any] = {}  # each distinct list once, whatever else differs
    for structure in {id(s): s for _, s in gathered}.values():
        sharded.setdefault(_digest(structure["sharded"]), structure["sharded"])
    lists = list(sharded.values())
    table, conflict = sharded_table(lists)
    return _RankZeroPlan(parts, structures, table, conflict, lists)


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
class JobPlan:
    """The agreed plan of a job's saves while no rank's structure changes."""

    own: str | None  # this rank's structure digest (None in one process: no reuse)
    job: str  # the digest of every rank's structure digest
    # Every rank's aliases, node and whether it leads it: on rank 0 and, in per-node
    # mode, on each node's first rank (None elsewhere).
    structures: list[dict[str, Any]] | None
    pieces: list[Piece]  # this rank's share of the replicated chunks
    # On rank 0: every entry described by its sharding -> (dtype, global shape,
    # sharding), or why the ranks' descriptions disagree.
    sharded: ShardedTable | None = None
    conflict: str | None = None
    lists: list[Any] | None = None  # on rank 0: the distinct lists the table is made of


# Plans of earlier saves, by (process group, per-node mode, world size). Every rank
# keeps its own; all of them are made and dropped on the same collectives' results.
PLANS: dict[tuple[Any, ...], JobPlan] = {}


def forget_plan(job: JobPlan | None) -> None:
    for key in [k for k, v in list(PLANS.items()) if v is job]:
        del PLANS[key]


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


def part_of(plan: SavePlan, job: JobPlan) -> SavePlan:
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


def plan_again(
    plan: SavePlan, kept: WriteResult, every_kept: list[str] | None, options: SaveOptions
) -> JobPlan:
    """Every rank, after a background save's *again* (a steady rank on its background
    thread, an unsettled one on the caller's): the committing ranks clear leftovers but
    the files written (``every_kept``, from rank 0), then rank 0 plans around what the
    steady ranks wrote (``plan.writes_around_staged``), and every rank caches that plan.
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
        PlannedWrite(p.name, p.offsets, p.shape, p.source.offsets, p.source.shape)
        for p in plan.job.pieces
    ]
    try:
        job = _agree_and_plan(
            mine,
            cleared,
            None,
            plan.storage.where,
            options,
            plan.group,
            again=(not plan.unsettled, cached),
        )
    except Exception as exc:
        cleanup = plan.commit or Commit(plan.storage)
        cleanup.abort(kept.files, remove_directory=plan.commit is not None)
        plan.release()
        raise CheckpointError(
            f"{plan.storage.where}: the background save could not be completed ({exc}); "
            "nothing was committed and earlier checkpoints are untouched"
        ) from exc
    PLANS[plan.cache_key] = job
    return job


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
        memory = memory_key(part)
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
