"""The memory tier's redundancy side by side: full replicas vs erasure-coded parity.

For each configuration, N simulated nodes of one rank each (gloo on one machine, a
tmpfs directory per node under /dev/shm), every rank holding --mb MB of its own state.
Measured in one run, slowest rank reported:

  host memory: what the rank's node keeps for the tier (own copy + replicas or parity),
    as a multiple of the rank's own copy;
  save: the stall (staging on the caller) and the time until every copy or parity
    piece is in place (the background thread);
  training loop: how fast a Python loop on the caller runs while another such save
    runs in the background, as a share of its speed with nothing in the background;
  recovery: from own memory (every process restarted), and with node 1's memory
    wiped (from a buddy, or rebuilt from parity);
  floors: memcpy of the rank's state, and a cold load of it from the local disk.

    python bench/bench_memory_redundancy.py [--mb 64] [--json OUT]
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import sys
import tempfile
import threading
import time
from functools import partial
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).parent))
sys.path.insert(0, str(Path(__file__).parents[1] / "tests"))
from bench_memory_tier import timed_on_every_rank  # noqa: E402
from bench_save_load import drop_cache  # noqa: E402
from distributed import run_ranks  # noqa: E402

# (label, nodes, redundancy): pairs that survive the same number of lost nodes.
CONFIGS = [
    ("Replicas(1)", 3, ("replicas", 1)),
    ("ErasureCode(2, 1)", 3, ("erasure", 2, 1)),
    ("Replicas(2)", 4, ("replicas", 2)),
    ("ErasureCode(2, 2)", 4, ("erasure", 2, 2)),
    ("Replicas(1), 5 nodes", 5, ("replicas", 1)),
    ("ErasureCode(4, 1)", 5, ("erasure", 4, 1)),
]


def _redundancy(spec: tuple):  # noqa: ANN202
    from shardpoint import ErasureCode, Replicas

    return Replicas(spec[1]) if spec[0] == "replicas" else ErasureCode(spec[1], spec[2])


def _state(mb: int, seed: int) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    per = mb * 1024 * 1024 // 4 // 8
    return {f"layer{i}": torch.randn(per, generator=g) for i in range(8)}


def _loop_rate(seconds: float | None = None, until: threading.Thread | None = None) -> float:
    """Iterations per second of a pure-Python loop (the training thread's own work)."""
    n, start = 0, time.perf_counter()
    while True:
        for _ in range(1000):
            n += 1
        elapsed = time.perf_counter() - start
        if (until is not None and not until.is_alive()) or (seconds and elapsed >= seconds):
            return n / max(elapsed, 1e-9)


def _slot_bytes(base: Path) -> int:
    return sum(p.stat().st_size for p in base.rglob("*") if p.is_file())


def _rank(rank: int, world: int, root: str, shm: str, mb: int, spec: tuple, out: str) -> None:
    import shardpoint
    from shardpoint import dist
    from shardpoint.training.memory_tier import MemoryTier

    os.environ["SHARDPOINT_SHM_DIR"] = f"{shm}/node{rank}"
    os.environ["LOCAL_WORLD_SIZE"] = "1"
    own = _state(mb, rank)
    state = own  # every rank's own values (the tier saves each rank on its own)
    tier = MemoryTier("bench", redundancy=_redundancy(spec))
    times: dict[str, float] = {}
    timed = partial(timed_on_every_rank, times)

    copies = []
    for _ in range(3):  # the best of three: the first faults fresh pages in
        timed("memcpy of the state", lambda: [t.clone() for t in own.values()])
        copies.append(times["memcpy of the state"])
    times["memcpy of the state"] = min(copies)
    tier.save(0, state)  # faults the staging pool in
    tier.wait()
    dist.all_gather_json(None)
    start = time.perf_counter()
    times["save stall"] = tier.save(1, state)
    tier.wait()
    times["save complete"] = time.perf_counter() - start
    # The same save again, with the caller busy in Python meanwhile (the GIL contended,
    # as a training loop's Python does between kernels).
    idle = _loop_rate(seconds=0.5)
    dist.all_gather_json(None)
    tier.save(2, state)
    times["loop speed during the save"] = _loop_rate(until=tier._thread) / idle  # a share
    tier.wait()
    times["host memory"] = _slot_bytes(tier.base) / sum(
        t.numel() * t.element_size() for t in own.values()
    )
    # Faulted in before any timing: the first restore must not pay for fresh pages.
    target = {k: torch.empty_like(v).fill_(0) for k, v in own.items()}

    def from_memory() -> None:
        tier.restore(target, tier.newest_step())

    best: dict[str, float] = {}
    for _ in range(2):  # the better of two rounds of each (node 1 wiped again each time)
        timed("recovery: own memory", from_memory)
        if rank == 1:
            shutil.rmtree(tier.base)  # node 1 replaced: empty memory
            tier.base.mkdir(parents=True)
        dist.all_gather_json(None)
        timed("recovery: node 1 wiped", from_memory)
        assert all(torch.equal(target[k], v) for k, v in own.items())
        for name in ("recovery: own memory", "recovery: node 1 wiped"):
            best[name] = min(best.get(name, float("inf")), times[name])
    times.update(best)
    with dist.solo():
        shardpoint.save(state, f"{root}/disk/rank{rank}")
    drop_cache(Path(f"{root}/disk/rank{rank}"))
    with dist.solo():
        timed("recovery: local disk (cold)", shardpoint.load, target, f"{root}/disk/rank{rank}")
    tier.close(release=True)
    gathered = dist.all_gather_json(times)
    if rank == 0:
        worst = {k: max(g[k] for g in gathered) for k in times}
        worst["loop speed during the save"] = min(g["loop speed during the save"] for g in gathered)
        Path(out).write_text(json.dumps(worst))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--mb", type=int, default=64, help="MB of state per rank")
    parser.add_argument("--only", default=None, help="config labels, separated by |")
    parser.add_argument("--json", type=Path, default=None)
    args = parser.parse_args()
    results = {}
    for label, nodes, spec in CONFIGS:
        if args.only and label not in args.only.split("|"):
            continue
        shm = tempfile.mkdtemp(dir="/dev/shm", prefix="shardpoint-bench-")  # real tmpfs
        try:
            with tempfile.TemporaryDirectory() as root:
                out = f"{root}/result.json"
                run_ranks(nodes, _rank, root, shm, args.mb, spec, out)
                results[label] = {"nodes": nodes, **json.loads(Path(out).read_text())}
        finally:
            shutil.rmtree(shm, ignore_errors=True)
        r = results[label]
        print(
            f"{label:22} {nodes} nodes  memory {r['host memory']:.2f}x  "
            f"stall {r['save stall']:.3f} s  complete {r['save complete']:.3f} s  "
            f"loop {r['loop speed during the save']:.0%}  "
            f"own {r['recovery: own memory']:.3f} s  wiped {r['recovery: node 1 wiped']:.3f} s  "
            f"disk {r['recovery: local disk (cold)']:.3f} s  "
            f"memcpy {r['memcpy of the state']:.3f} s",
            flush=True,
        )
    if args.json:
        args.json.write_text(json.dumps({"mb_per_rank": args.mb, "results": results}, indent=2))


if __name__ == "__main__":
    main()
