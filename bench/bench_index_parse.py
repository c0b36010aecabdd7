"""Index parsing and in-place loading of many small tensors, microseconds per tensor.

Saves bench_save_load's small state (10,000 fp32 tensors), then times, in one process
with the garbage collector paused, ``parse_index`` of its ``index.json`` and a whole
in-place ``shardpoint.load`` (all or nothing, and ``atomic=False``). Prints the minimum
and median of each. To compare two versions of the code, run it with each on
``PYTHONPATH`` (e.g. a ``git worktree`` of the older commit), alternating.

    python bench/bench_index_parse.py [--reps 15] [--dir DIR]
"""

from __future__ import annotations

import argparse
import gc
import statistics
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

import torch
from bench_save_load import small_state

import shardpoint
from shardpoint.format.index import INDEX_NAME
from shardpoint.format.parse import parse_index


def per_tensor(fn: Callable[[], object], reps: int, tensors: int) -> tuple[float, float]:
    """(minimum, median) microseconds per tensor of ``reps`` calls of ``fn``."""
    times = []
    gc.collect()
    gc.disable()
    try:
        for _ in range(reps):
            start = time.perf_counter()
            fn()
            times.append(time.perf_counter() - start)
    finally:
        gc.enable()
    scale = 1e6 / tensors
    return min(times) * scale, statistics.median(times) * scale


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--reps", type=int, default=15)
    parser.add_argument("--dir", type=Path, default=None)
    args = parser.parse_args()
    state = small_state()
    with tempfile.TemporaryDirectory(dir=args.dir) as tmp:
        path = Path(tmp) / "ckpt"
        shardpoint.save(state, path)
        raw = (path / INDEX_NAME).read_bytes()
        dest = {k: torch.empty_like(v) for k, v in state.items()}
        rows = {
            "parse_index": lambda: parse_index(raw, INDEX_NAME),
            "load (all or nothing)": lambda: shardpoint.load(dest, path),
            "load, atomic=False": lambda: shardpoint.load(dest, path, atomic=False),
        }
        print(f"{len(state):,} tensors, µs per tensor: minimum / median of {args.reps}")
        for name, fn in rows.items():
            low, mid = per_tensor(fn, args.reps, len(state))
            print(f"  {name:24} {low:6.2f} / {mid:6.2f}")
        assert all(torch.equal(dest[k], v) for k, v in state.items())


if __name__ == "__main__":
    main()
