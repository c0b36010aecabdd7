"""What refusing NaN costs a save: ``nan_check.first_nan`` next to memcpy, the obvious
``isnan().any()`` per tensor, and the save it guards, on the same state in one run.

The state is a transformer-like mix: a few large float32 matrices, many small tensors
(norms, biases), bf16 copies, and AdamW-shaped float32 moments. Every figure is the
median of ``--reps`` runs; the save is ``shardpoint.save`` to ``--dir`` (durable, page
cache as it is), and the async save stall what ``shardpoint.async_save`` blocks the
caller for (the staging copy): the numbers the check adds to.

    python bench/bench_nan_check.py [--mb 256 1024] [--reps 5] [--dir DIR] [--json OUT]
"""

from __future__ import annotations

import argparse
import json
import platform
import shutil
import statistics
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

import torch

import shardpoint
from shardpoint.nan_check import first_nan


def make_state(mb: int) -> dict[str, torch.Tensor]:
    """About ``mb`` MB: 70% in large float32 matrices, 10% bf16, 20% in 1,000 small
    float32 tensors (4-64 KB)."""
    g = torch.Generator().manual_seed(0)
    state: dict[str, torch.Tensor] = {}
    large = int(mb * 0.7 * 2**20) // 4
    side = 2048
    for i in range(max(1, large // (side * side))):
        state[f"layer{i}.weight"] = torch.randn(side, side, generator=g)
    bf16 = int(mb * 0.1 * 2**20) // 2
    state["embed.bf16"] = torch.randn(bf16, generator=g).to(torch.bfloat16)
    small_bytes = int(mb * 0.2 * 2**20)
    per = max(1024, small_bytes // 1000 // 4)
    for i in range(1000):
        state[f"norm{i}.weight"] = torch.randn(per, generator=g)
    return state


def median_seconds(fn: Callable[[], object], reps: int) -> float:
    fn()  # warm: page faults, allocator
    times = []
    for _ in range(reps):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def isnan_any(state: dict[str, torch.Tensor]) -> bool:
    return any(bool(torch.isnan(t).any()) for t in state.values())


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--mb", type=int, nargs="+", default=[256, 1024])
    p.add_argument("--reps", type=int, default=5)
    p.add_argument("--dir", type=Path, default=None)
    p.add_argument("--json", type=Path, default=None)
    args = p.parse_args()
    root = Path(tempfile.mkdtemp(dir=args.dir, prefix="nan-bench-"))
    rows = []
    try:
        for mb in args.mb:
            state = make_state(mb)
            nbytes = sum(t.numel() * t.element_size() for t in state.values())
            copies = {k: torch.empty_like(v) for k, v in state.items()}

            def memcpy(state=state, copies=copies) -> None:
                for k, v in state.items():
                    copies[k].copy_(v)

            def save(state=state, mb=mb) -> None:
                target = root / f"ckpt-{mb}"
                shutil.rmtree(target, ignore_errors=True)
                shardpoint.save(state, target)

            stalls = []

            def async_stall(state=state, mb=mb, stalls=stalls) -> None:
                target = root / f"async-{mb}"
                shutil.rmtree(target, ignore_errors=True)
                start = time.perf_counter()
                handle = shardpoint.async_save(state, target)
                stalls.append(time.perf_counter() - start)  # what training waits for
                handle.wait()

            assert first_nan(state) is None and not isnan_any(state)
            row = {
                "mb": round(nbytes / 2**20),
                "tensors": len(state),
                "first_nan_s": median_seconds(lambda state=state: first_nan(state), args.reps),
                "isnan_any_s": median_seconds(lambda state=state: isnan_any(state), args.reps),
                "memcpy_s": median_seconds(memcpy, args.reps),
                "save_s": median_seconds(save, max(1, args.reps // 2)),
            }
            median_seconds(async_stall, args.reps)
            row["async_stall_s"] = statistics.median(stalls[1:])  # the warm-up's left out
            row["first_nan_gb_s"] = nbytes / row["first_nan_s"] / 1e9
            row["check_share_of_save"] = row["first_nan_s"] / row["save_s"]
            row["check_share_of_async_stall"] = row["first_nan_s"] / row["async_stall_s"]
            rows.append(row)
            del state, copies
    finally:
        shutil.rmtree(root, ignore_errors=True)
    print(f"torch {torch.__version__}, {torch.get_num_threads()} threads, {platform.machine()}")
    print(
        "| state | tensors | first_nan | GB/s | isnan().any() | memcpy | save "
        "| async save stall | check / save | check / async stall |"
    )
    print("|---|---|---|---|---|---|---|---|---|---|")
    for r in rows:
        print(
            f"| {r['mb']} MB | {r['tensors']} | {r['first_nan_s'] * 1e3:.1f} ms "
            f"| {r['first_nan_gb_s']:.1f} | {r['isnan_any_s'] * 1e3:.1f} ms "
            f"| {r['memcpy_s'] * 1e3:.1f} ms | {r['save_s'] * 1e3:.0f} ms "
            f"| {r['async_stall_s'] * 1e3:.1f} ms | {r['check_share_of_save']:.1%} "
            f"| {r['check_share_of_async_stall']:.0%} |"
        )
    if args.json:
        args.json.write_text(json.dumps(rows, indent=2))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
