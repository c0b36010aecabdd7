"""The commit phase: every rank's report to rank 0, the index, the marker, the outcome.

Each rank writes its fragment (its chunks of sharded entries), then one gather brings
every rank's result, tree and plan verdict to rank 0, which builds the index
(``build_index``) and commits (``Commit.finish``: index, then marker) — or, with
node-local directories, each node's first rank builds and commits its node's copy.
Every rank learns the outcome: committed (``SaveInfo``), failed (raised on every
rank), or ``Again`` (a speculative save met a change: ``saving.run_save`` plans again).
The gather doubles as the barrier before the commit: rank 0 hears from every rank once
its files are durable (or failed).
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from datetime import datetime, timezone
from typing import Any

from . import dist
from .commit import Commit
from .errors import CheckpointError, UnsupportedValueError
from .format.index import (
    PLAIN_VERSION,
    REFERENCES_VERSION,
    Chunk,
    Index,
    TensorEntry,
    checksum,
    fragment_json,
)
from .names import INDEX_NAME, MARKER_NAME, fragment_file
from .save_plan import SavePlan, forget_plan
from .save_records import ChunkRecord, SaveInfo, ShardedTable, WriteResult, sharded_table
from .tree import merge_trees
from .version import __version__


@dataclass(frozen=True)
class Again:
    """A speculative save that could not commit (a rank changed or failed): every rank
    saves again, agreed first. A synchronous save's ranks removed what they wrote
    (``written`` is None); a background save's steady ranks keep theirs: ``written`` is
    what this rank wrote and reported, ``kept`` (on rank 0) every file the ranks keep."""

    why: str
    written: WriteResult | None = None
    kept: list[str] | None = None


def commit(
    plan: SavePlan, result: WriteResult, metadata: dict[str, Any] | None, *, start: float
) -> SaveInfo | Again:
    """Commit what every rank wrote; the same outcome on every rank. Raises on every
    rank if any rank failed and the save cannot run again."""
    outcome: SaveInfo | Again | None = None
    try:
        outcome = _commit(plan, result, metadata, start)
        return outcome
    finally:
        # A background save's next round commits into this directory, still locked.
        if not (isinstance(outcome, Again) and plan.staged):
            plan.release()


def _commit(
    plan: SavePlan, result: WriteResult, metadata: dict[str, Any] | None, start: float
) -> SaveInfo | Again:
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
                    first = build_index(
                        plan, tree, results, metadata, table, created, nodes[0], nodes
                    )
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
                    index = build_index(plan, tree, results, metadata, table, created)
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
        forget_plan(plan.job)  # every rank got this outcome: the next save is agreed first
        again = isinstance(outcome, dict)
        if again and plan.staged:  # the steady ranks' files stay; run_save plans around them
            kept = sorted({f for r in results for f in r.files}) if results else None
            return Again(outcome["again"], result, kept)
        # Only the committing rank removes the directory: another rank's files may still
        # be in flight when a fast-failing rank gets here. Each rank removes only the
        # files it created (made exclusively, so none is another save's).
        cleanup = plan.commit or Commit(plan.storage)
        own = [*result.files, *((INDEX_NAME, MARKER_NAME) if plan.commit else ())]
        cleanup.abort(own, remove_directory=plan.commit is not None and not again)
        if again:
            return Again(outcome["again"])
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
    table = sharded_table(inputs["sharded"]) if inputs["sharded"] else ({}, None)
    nodes = [s["node"] for s in plan.structures]
    created, node = inputs["created"], dist.node_rank()
    return build_index(
        plan, inputs["tree"], results, inputs["metadata"], table, created, node, nodes
    )


def build_index(
    plan: SavePlan,
    tree: Any,
    results: list[WriteResult],
    metadata: dict[str, Any] | None,
    table: tuple[ShardedTable, str | None],
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
