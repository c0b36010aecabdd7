"""Running jobs on threads: one call per item (``run_parallel``), or many small jobs
grouped into batches so per-job overhead stays small (``map_batched``)."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from concurrent.futures import Executor, Future, ThreadPoolExecutor
from typing import TypeVar

T = TypeVar("T")
R = TypeVar("R")

BATCH_BYTES = 8 * 1024 * 1024


def run_parallel(fn: Callable[[T], R], items: Sequence[T], threads: int, name: str) -> list[R]:
    """``fn`` over ``items`` on up to ``threads`` threads (named ``name``), results in
    item order, the first error re-raised; on the caller's thread when one suffices."""
    if len(items) <= 1 or threads <= 1:
        return [fn(item) for item in items]
    with ThreadPoolExecutor(min(threads, len(items)), name) as pool:
        return list(pool.map(fn, items))


def map_batched(
    pool: Executor, fn: Callable[[T], R], items: Sequence[T], size_of: Callable[[T], int]
) -> Callable[[], list[R]]:
    """Submit ``fn`` over ``items`` in batches of about BATCH_BYTES; returns a collector.

    Calling the collector waits for every batch and returns the results in item order,
    re-raising the first error.
    """
    futures: list[Future[list[R]]] = []
    batch: list[T] = []
    size = 0
    for item in items:
        batch.append(item)
        size += size_of(item)
        if size >= BATCH_BYTES or len(batch) >= 4096:
            futures.append(pool.submit(lambda b=batch: [fn(x) for x in b]))
            batch, size = [], 0
    if batch:
        futures.append(pool.submit(lambda b=batch: [fn(x) for x in b]))
    return lambda: [r for f in futures for r in f.result()]
