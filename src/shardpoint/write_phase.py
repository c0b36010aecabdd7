"""The write phase: this rank's files, from tensor memory or through a stage.

``write_or_stage`` lays out what the plan gives this rank and writes it (a synchronous
save: ``write_from_memory``, straight from the tensors) or hands it to a ``Staging``
(a background save: copied now, written on background threads). Either way it returns
a function that says what was written, for the commit; chunks an incremental chain's
base holds become references instead of writes.
"""

from __future__ import annotations

from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from typing import Protocol

from .commit import Commit
from .format.index import block_checksums, check_user_metadata
from .format.safetensors import itemsize
from .incremental import IncrementalChain, identity, unchanged
from .layout import PlacedPiece, ShardFile, chunk_records, lay_out, piece_data
from .names import fragment_file
from .parallel import map_batched
from .save_plan import SavePlan
from .save_records import ChunkRecord, SaveOptions, WriteResult
from .storage.io_types import Segment


class Staging(Protocol):
    """The stage phase (``background_save.Stager``): copies the files' bytes on the
    caller's thread and writes them on background threads."""

    def stage(self, plan: SavePlan, files: list[ShardFile]) -> Callable[[], WriteResult]: ...
    def spare_bytes(self) -> int: ...


def write_or_stage(
    plan: SavePlan, options: SaveOptions, staging: Staging | None
) -> Callable[[], WriteResult]:
    """Lay out and write (or stage) what ``plan`` gives this rank; returns the function
    that says what was written, the chunks the chain's base holds included."""
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
    return lambda: _with_references(written(), *references)


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
    split = unchanged(base, plan.pieces, lambda p: piece_data(p, plan.local[p.name]), plan.tokens)
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


def write_from_memory(plan: SavePlan, shards: list[ShardFile], threads: int) -> WriteResult:
    """The write phase of a synchronous save: this rank's files straight from tensor
    memory, checksums computed beside the writes."""
    to_write: dict[str, tuple[int, list[Segment]]] = {
        f.name: (f.size, [Segment(0, f.header), *(Segment(p.begin, p.raw) for p in f.placed)])
        for f in shards
    }
    placed = [p for f in shards for p in f.placed]

    def digests_of(p: PlacedPiece) -> tuple[list[str], str | None]:
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
