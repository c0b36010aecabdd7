"""The one place that builds and parses the names of checkpoint files and directories.

A manager's directory holds one ``step-NNNNNNNNN`` directory per checkpoint; a
checkpoint directory holds ``rankRRRRR-KKKKK.safetensors`` shard files (rank R's K-th
file), ``rankRRRRR.chunks.json`` fragments (format version 2: where rank R's chunks of
sharded entries are), ``index.json`` and the ``COMMITTED`` marker. A deleted
checkpoint whose shard files later checkpoints still refer to (incremental saves)
keeps those files and a ``PRUNED`` note instead of its marker. The manager's directory
also holds ``run-id``: which run its checkpoints belong to (the memory tier's namespace),
and ``rollbacks.json``: the rollbacks asked of the run.
The memory tier keeps, per job, one slot directory per kind of copy and rank,
``own/rankRRRRR`` (rank R's own copies), ``replica/rankRRRRR`` (the replicas of rank R's
copies a buddy holds) and ``parity/rankRRRRR`` (the parity rank R holds), each holding
step directories; a rebuild writes ``.rebuild-step-NNNNNNNNN`` beside the copy it makes.
Anything else is not ours.
"""

from __future__ import annotations

import re

from .format.index import INDEX_NAME, MARKER_NAME

_STEP_DIR = re.compile(r"^step-(\d{9,})$")
_RANK_DIR = re.compile(r"^rank(\d+)$")
_SHARD_FILE = re.compile(r"^rank\d{5}-(\d{5})\.safetensors$")
_RANK_FILE = re.compile(r"^rank(\d{5})(-\d{5}\.safetensors|\.chunks\.json)$")
# Every name a save writes (``.tmp``: a small file or stream not yet renamed into place).
_OWN_FILE = re.compile(
    r"^(index\.json|COMMITTED|PRUNED|rank\d{5}-\d{5}\.safetensors|rank\d{5}\.chunks\.json)"
    r"(\.tmp)?$"
)
PRUNED_NAME = "PRUNED"
RUN_ID_NAME = "run-id"
ROLLBACKS_NAME = "rollbacks.json"  # the run's rollback requests (training/rollback.py)
MEMORY_KINDS = ("own", "replica", "parity")  # the memory tier's slot directories
REBUILD_PREFIX = ".rebuild-"  # a memory copy being rebuilt from parity, not yet a copy

__all__ = ["INDEX_NAME", "MARKER_NAME"]


def step_dir(step: int) -> str:
    return f"step-{step:09d}"


# Why a checkpoint was set aside: a restore could not use it, a rollback went back past
# it, or a restore of an explicit older step made it part of an abandoned future.
SET_ASIDE_REASONS = ("unusable", "rolled-back", "superseded")


def set_aside_dir(step: int, n: int, why: str = "unusable") -> str:
    """The name a set-aside checkpoint is moved to (``n``: the first free one; ``why``
    one of ``SET_ASIDE_REASONS``): not a step directory, so neither restored, counted
    nor deleted."""
    assert why in SET_ASIDE_REASONS, why
    return f"{step_dir(step)}.{why}-{n}"


def parse_step_dir(name: str) -> int | None:
    """The step of a ``step-NNNNNNNNN`` directory name, else None."""
    m = _STEP_DIR.match(name)
    return int(m.group(1)) if m else None


def shard_file(rank: int, k: int) -> str:
    return f"rank{rank:05d}-{k:05d}.safetensors"


def shard_number(name: str) -> int | None:
    """K of a ``rankRRRRR-KKKKK.safetensors`` name (also one referred to), else None."""
    m = _SHARD_FILE.match(name.rpartition("/")[2])
    return int(m.group(1)) if m else None


def fragment_file(rank: int) -> str:
    return f"rank{rank:05d}.chunks.json"


def is_fragment(name: str) -> bool:
    return name.endswith(".chunks.json") and writer_rank(name) is not None


def writer_rank(name: str) -> int | None:
    """The rank that wrote ``name`` (a shard file or a fragment, also one referred to
    in a sibling checkpoint), else None."""
    m = _RANK_FILE.match(name.rpartition("/")[2])
    return int(m.group(1)) if m else None


def is_own_file(name: str) -> bool:
    """Whether a save could have written ``name`` (finished or not)."""
    return _OWN_FILE.match(name) is not None


def commit_order(names: list[str]) -> list[str]:
    """A checkpoint's file names in the order a commit makes them: shards first, then
    the index, then the marker."""
    return sorted(names, key=lambda n: (n == MARKER_NAME, n == INDEX_NAME, n))


def rank_dir(rank: int) -> str:
    return f"rank{rank:05d}"


def parse_rank_dir(name: str) -> int | None:
    """The rank of a ``rankRRRRR`` directory name, else None."""
    m = _RANK_DIR.match(name)
    return int(m.group(1)) if m else None


def memory_slot(kind: str, rank: int) -> str:
    """Rank ``rank``'s memory-tier slot of kind ``kind`` (one of ``MEMORY_KINDS``),
    relative to the job's directory."""
    assert kind in MEMORY_KINDS, kind
    return f"{kind}/{rank_dir(rank)}"
