"""The manager's options, grouped: when to save, where the other tiers are, how to write.

Retention (which checkpoints to keep) is ``retention.RetentionPolicy``. ``MOVED_OPTIONS``:
the keyword arguments of earlier releases that now live in one of these.
"""

from __future__ import annotations

from dataclasses import InitVar, dataclass, field
from typing import Any

from ..defaults import DEFAULT_MAX_SHARD_BYTES, DEFAULT_THREADS
from .retention import RetentionPolicy


@dataclass(frozen=True)
class SavePolicy:
    """When ``maybe_save`` saves: every ``every_n_steps`` steps and/or every
    ``every_n_seconds``, at once after a preemption signal, and with ``continuous``
    (async saves only) whenever the previous save has committed, so that the newest
    checkpoint is as fresh as the disk allows (Orbax's continuous checkpointing halved
    its median save interval this way).

    ``refuse_nan`` (default): a state holding NaN in a floating tensor is saved to no
    tier: ``NaNStateError`` names the tensor and the rank, and the checkpoints before
    it stay (``shardpoint.nan_check``: one reduction per tensor at memory speed, and one
    small all-reduce under torch.distributed)."""

    every_n_steps: int | None = None
    every_n_seconds: float | None = None
    continuous: bool = False
    refuse_nan: bool = True

    def __post_init__(self) -> None:
        if self.every_n_steps is not None and self.every_n_steps < 1:
            raise ValueError("every_n_steps must be at least 1 (or None)")
        if self.every_n_seconds is not None and self.every_n_seconds <= 0:
            raise ValueError("every_n_seconds must be positive (or None)")


@dataclass(frozen=True)
class RemoteTier:
    """Each committed checkpoint is uploaded to ``url`` (an object store, or a shared
    file system) in the background; ``retention`` applies there. ``compress``: shard
    files are stored zstd-compressed block by block (object stores only; docs/format.md,
    "Compressed files"), which saves storage and upload bytes at the cost of CPU time:
    docs/benchmarks.md measures when it pays."""

    url: str
    retention: RetentionPolicy = RetentionPolicy(keep_last=10)
    compress: bool = False


@dataclass(frozen=True)
class Replicas:
    """Memory-tier redundancy by full copies: each rank's copy also on ``copies`` buddy
    ranks of other nodes; ``1 + copies`` times a copy's memory per rank."""

    copies: int = 1

    def __post_init__(self) -> None:
        if self.copies < 0:
            raise ValueError("Replicas(copies) must be 0 or more")


@dataclass(frozen=True)
class ErasureCode:
    """Memory-tier redundancy by parity: groups of ``data + parity`` nodes, any
    ``parity`` lost nodes of a group rebuilt from the others; ``(data + parity) / data``
    times a copy's memory per rank (docs/memory.md, "Erasure-coded redundancy").
    ``parity=1`` is XOR; ``parity >= 2`` needs pyeclib (``shardpoint[erasure]``)."""

    data: int
    parity: int = 1

    def __post_init__(self) -> None:
        if self.data < 1 or self.parity < 1:
            raise ValueError("ErasureCode needs data >= 1 and parity >= 1")


@dataclass(frozen=True)
class MemoryTierOptions:
    """Every ``every_n_steps`` steps each rank keeps its state in host shared memory,
    protected against node losses by ``redundancy``: ``Replicas(n)`` (full copies on n
    buddy ranks of other nodes) or ``ErasureCode(data, parity)`` (docs/memory.md).
    ``max_bytes`` bounds what one rank keeps; ``pool_bytes`` bounds its staging memory
    (default: the size of the rank's state); ``job`` names the namespace (default: from
    the directory)."""

    every_n_steps: int
    redundancy: Replicas | ErasureCode = Replicas(1)
    max_bytes: int | None = None
    pool_bytes: int | None = None
    job: str | None = None
    replicas: InitVar[int | None] = None  # moved: redundancy=Replicas(n)

    def __post_init__(self, replicas: int | None) -> None:
        if replicas is not None:
            raise TypeError(
                f"MemoryTierOptions(replicas={replicas}) is now "
                f"MemoryTierOptions(redundancy=Replicas({replicas}))"
            )
        if not isinstance(self.redundancy, (Replicas, ErasureCode)):
            raise TypeError(
                "MemoryTierOptions(redundancy=...) takes Replicas(n) or "
                f"ErasureCode(data, parity), not {self.redundancy!r}"
            )


@dataclass(frozen=True)
class AsyncOptions:
    """Asynchronous saves (``AsyncSaver``): ``pool_bytes`` bounds the staging memory;
    ``if_busy`` is ``"wait"`` or ``"skip"`` while the previous save still runs."""

    pool_bytes: int | None = None
    if_busy: str = "wait"


@dataclass(frozen=True)
class IOOptions:
    """How checkpoints are written and checked. ``verify="full"`` recomputes every
    checksum when restoring, ``"fast"`` checks marker, index, sizes and headers."""

    max_shard_size: int = DEFAULT_MAX_SHARD_BYTES
    threads: int = DEFAULT_THREADS
    verify: str = "full"
    storage_options: dict[str, Any] = field(default_factory=dict)

    def __post_init__(self) -> None:
        if self.verify not in ("full", "fast"):
            raise ValueError("verify must be 'full' or 'fast'")


# Keyword arguments of earlier releases, and where each option lives now.
MOVED_OPTIONS = {
    "every_n_steps": "policy=SavePolicy(every_n_steps=...)",
    "every_n_seconds": "policy=SavePolicy(every_n_seconds=...)",
    "keep_last": "retention=RetentionPolicy(keep_last=...)",
    "memory_every_n_steps": "memory=MemoryTierOptions(every_n_steps=...)",
    "max_shard_size": "io=IOOptions(max_shard_size=...)",
    "threads": "io=IOOptions(threads=...)",
    "verify": "io=IOOptions(verify=...)",
    "storage_options": "io=IOOptions(storage_options=...)",
}


def moved_options_message(given: dict[str, Any]) -> str:
    """The message for keyword arguments CheckpointManager does not take: the new
    spelling of each one that moved, or that it is unknown."""
    parts = [
        f"{name}= is now {MOVED_OPTIONS[name]}"
        if name in MOVED_OPTIONS
        else f"unexpected keyword argument {name!r}"
        for name in given
    ]
    return "CheckpointManager(): " + "; ".join(parts)
