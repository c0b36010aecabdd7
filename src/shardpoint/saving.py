"""The save pipeline: one loop over the phases, for every caller.

    flatten + plan (save_plan) -> [stage] -> write (write_phase, layout) -> commit (save_commit)

``run_save`` below is the whole pipeline, and the one place where a save runs again.
``save`` runs it on the caller's thread, writing straight from tensor memory.
``AsyncSaver`` (``background_save.py``) runs it with a ``Staging``: the write reads
staged copies, so the caller returns after staging while the write and the commit
finish on background threads. The manager's local, remote and memory tiers use it too.

Order of durability (the commit protocol, ``commit.py``, docs/format.md): every shard
file is durable, then ``index.json``, then the marker. A crash at any point leaves a
directory without a marker, which no reader accepts as a checkpoint.
"""

from __future__ import annotations

import os
import time
from collections.abc import Callable
from dataclasses import replace
from typing import Any

from .defaults import DEFAULT_MAX_SHARD_BYTES, DEFAULT_THREADS
from .gc_pause import gc_paused
from .incremental import IncrementalChain
from .save_commit import Again, commit
from .save_plan import SavePlan, part_of, plan_again, plan_save
from .save_records import SaveInfo, SaveOptions, WriteResult
from .storage import CheckpointStorage, open_storage
from .write_phase import Staging, write_or_stage


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


def run_save(
    state: Any,
    storage: CheckpointStorage,
    options: SaveOptions,
    staging: Staging | None = None,
    group: Any = None,
) -> SaveInfo | Callable[[], SaveInfo]:
    """The pipeline. Without ``staging`` the checkpoint is committed on return; with it,
    the state is staged on return and the returned function (for a background thread)
    writes, commits and returns the ``SaveInfo``.

    A speculative save (one that reuses the cached plan, ``plan_save``) can meet a
    change that only the commit's gather reveals: the commit then answers ``Again`` on
    every rank and the loop below plans again — a synchronous save from the live state,
    agreed first; a background save around what its steady ranks wrote (the caller has
    moved on). A plan made again is agreed, never speculative, so its commit cannot
    answer ``Again``: the loop runs at most twice.
    """
    start = time.perf_counter()
    plan = plan_save(state, storage, options, group=group, staged=staging is not None)
    written = write_or_stage(plan, options, staging)
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
            written = write_or_stage(plan, options, staging)

    def write_and_commit() -> SaveInfo:
        nonlocal plan
        result = written()
        while True:
            outcome = commit(plan, result, options.metadata, start=start)
            if isinstance(outcome, SaveInfo):
                return outcome
            if outcome.written is None:  # every rank removed what it wrote: from the start
                plan = plan_save(state, storage, options, group=group)
                result = write_or_stage(plan, options, None)()
                continue
            job = plan_again(plan, outcome.written, outcome.kept, options)
            if plan.unsettled:  # its part of the new plan, from the copy it made
                plan = part_of(plan, job)
                result = write_or_stage(plan, options, None)()
            else:  # what it wrote is its part of the new plan
                plan = replace(plan, structures=job.structures, job=job, speculative=False)
                result = outcome.written

    return write_and_commit() if staging is None else write_and_commit


def _plan_unsettled_again(plan: SavePlan, options: SaveOptions) -> SavePlan:
    """A background save's rank that wrote nothing, on the caller's thread: its round
    of the commit (the others' on their background threads, once their speculative
    files are durable) answers ``Again``; returns its part of the plan made around
    what the others wrote, to stage. A final failure raises here."""
    outcome = commit(plan, WriteResult(), options.metadata, start=time.perf_counter())
    assert isinstance(outcome, Again), "a save committed without an unsettled rank's part"
    return part_of(plan, plan_again(plan, WriteResult(), outcome.kept, options))
