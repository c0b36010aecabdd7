"""Time to restore the data position mid-epoch on a 10-million-sample dataset.

shardpoint's position is (seed, epoch, global cursor): resuming computes the epoch's
permutation and slices it, so the time must not grow with the position. For contrast,
the cheapest form of replay: drawing the same shuffled indices from the start and
discarding them up to the position (no data is even loaded, which a real replay does).

    python bench/bench_data_position.py [--size 10000000] [--reps 3]
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path

from shardpoint import ResumableSampler


def resume_time(size: int, cursor: int) -> float:
    saved = ResumableSampler(size, seed=7)
    saved.cursor = cursor
    state = saved.state_dict()
    start = time.perf_counter()
    sampler = ResumableSampler(size, seed=7)
    sampler.load_state_dict(state)
    first = next(iter(sampler))  # the first sample of the resumed run is known
    elapsed = time.perf_counter() - start
    assert first == int(saved.order()[cursor])
    return elapsed


def replay_time(size: int, cursor: int) -> float:
    start = time.perf_counter()
    it = iter(ResumableSampler(size, seed=7))
    for _ in range(cursor):
        next(it)
    next(it)
    return time.perf_counter() - start


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--size", type=int, default=10_000_000)
    parser.add_argument("--reps", type=int, default=3)
    parser.add_argument("--out", type=Path, default=Path("bench/results/data_position.json"))
    args = parser.parse_args()
    positions = [0, args.size // 100, args.size // 10, args.size // 2, args.size - 1]
    rows = []
    print(f"dataset of {args.size:,} samples; median of {args.reps}")
    print(f"{'position':>12}  {'shardpoint resume':>18}  {'replay indices':>15}")
    for pos in positions:
        resume = statistics.median(resume_time(args.size, pos) for _ in range(args.reps))
        replay = statistics.median(replay_time(args.size, pos) for _ in range(args.reps))
        rows.append({"position": pos, "resume_s": resume, "replay_s": replay})
        print(f"{pos:>12,}  {resume * 1e3:>15.1f} ms  {replay * 1e3:>12.1f} ms")
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps({"size": args.size, "rows": rows}, indent=1))
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
