"""Scale simulation of a distributed save's metadata, without processes.

4,096 simulated ranks, each holding 500 FSDP-sharded parameters (a row shard of each)
and 20 replicated norm weights (the same on every rank). Measures what a save does
with metadata on every rank (decoding the gathered payloads, planning) and on rank 0
(building and serialising the index), and the index size per chunk.

    python bench/bench_plan_scale.py [--ranks 4096] [--params 500] [--norms 20]
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

from shardpoint.format.index import Chunk, Index, TensorEntry
from shardpoint.plan import Holding, plan_writes


def main() -> None:
    p = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    p.add_argument("--ranks", type=int, default=4096)
    p.add_argument("--params", type=int, default=500)
    p.add_argument("--norms", type=int, default=20)
    p.add_argument("--index-ranks", type=int, default=256, help="ranks in the index-size sample")
    p.add_argument("--out", type=Path, default=Path("bench/results/plan_scale.json"))
    args = p.parse_args()
    rows = 4 * args.ranks  # every parameter has 4 rows per rank

    def payload(rank: int) -> dict:
        """What one rank contributes to the structure gather, as JSON text."""
        sole = 500 * (4 * 4096 * 2)  # its 500 bf16 row shards of 4 x 4096
        norms = [[f"layers.{i}.norm.weight", "F32", [4096], [0], [4096]] for i in range(args.norms)]
        return {"sole_bytes": sole, "replicated": norms, "tree": None, "aliases": {}}

    texts = [json.dumps(payload(r)) for r in range(args.ranks)]
    start = time.perf_counter()
    gathered = [json.loads(t) for t in texts]
    replicated = [[Holding.from_json(h) for h in g["replicated"]] for g in gathered]
    pieces = plan_writes([g["sole_bytes"] for g in gathered], replicated)
    mine = [
        Holding(f"layers.{i}.w", "BF16", (rows, 4096), (4 * 7, 0), (4, 4096), False)
        for i in range(args.params)
    ]
    plan_seconds = time.perf_counter() - start
    print(
        f"planning on each rank ({args.ranks} ranks, {args.params} sharded + {args.norms} "
        f"replicated params): {plan_seconds:.3f} s, {len(pieces)} replicated pieces, "
        f"{len(mine)} own shards"
    )

    # Rank 0's index: measure bytes per chunk on a sample, time the full build.
    def index_for(n_ranks: int) -> Index:
        entries = {}
        for i in range(args.params):
            name = f"model.layers.{i // 10}.mlp.param{i % 10}.weight"
            chunks = tuple(
                Chunk(
                    f"rank{r:05d}-00000.safetensors",
                    f"{name}@{4 * r},0",
                    (4 * r, 0),
                    (4, 4096),
                    4096 + 32768 * i,
                    4096 + 32768 * (i + 1),
                    ("0123456789abcdef",),
                    8,
                )
                for r in range(n_ranks)
            )
            entries[name] = TensorEntry(name, "BF16", (4 * n_ranks, 4096), chunks)
        tree = {"dict": [[n, {"tensor": n}] for n in entries]}
        files = {f"rank{r:05d}-00000.safetensors": 40_000_000 for r in range(n_ranks)}
        return Index(files, entries, {}, tree, "2026-01-01T00:00:00+00:00", "0", n_ranks)

    sample = index_for(args.index_ranks).to_json()
    per_chunk = len(sample) / (args.index_ranks * args.params)
    start = time.perf_counter()
    full = index_for(args.ranks).to_json()
    index_seconds = time.perf_counter() - start
    print(
        f"index: {per_chunk:.0f} bytes per chunk; {args.ranks * args.params:,} chunks -> "
        f"{len(full) / 1e6:.0f} MB, built and serialised on rank 0 in {index_seconds:.1f} s"
    )
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(
        json.dumps(
            {
                "ranks": args.ranks,
                "params": args.params,
                "norms": args.norms,
                "plan_seconds": plan_seconds,
                "index_bytes_per_chunk": per_chunk,
                "index_bytes": len(full),
                "index_seconds": index_seconds,
            },
            indent=1,
        )
    )


if __name__ == "__main__":
    main()
