"""Scale simulation of a distributed save's and load's metadata, without processes:
format version 1 (every chunk listed in the index) against version 2 (a sharded tensor
described once, each rank's chunks in its own fragment).

Two layouts, each rank holding a row shard of every parameter plus replicated norms:

- ``fsdp``: 16,384 ranks x 10,000 parameters on a 1-D mesh;
- ``tp-fsdp``: 16,384 ranks x 2,000 parameters on an 8-way TP x 2,048-way FSDP mesh
  (``Shard(1)`` over TP, ``Shard(0)`` over FSDP).

Measured with the library's own code: each rank's save planning (structure digests,
the sharded-entry list, and on a structure change the replicated planning and rank
0's merge of the distinct lists), rank 0's index (built and serialised), and one
rank's load planning (parse the index, find the chunks of its own region, read its
fragment). Version 1's figures at this scale are extrapolated from a 64-rank sample
of the same layout (a 16,384-rank v1 index would take tens of GB), and say so.

Also the same steady save planning from real DTensors (``DTensor.from_local`` on a
``device_mesh`` over torch's fake process group of 16,384 ranks, in a child process):
what ``save`` runs per save before it writes (flatten the state, each tensor's
holding and sharding, the structure digest and the sharded-entry list); and a load's
planning into those DTensors from a directory holding the index and the rank's
fragment (open, parse, match, each region's chunks).

Also how long parsing takes where version 1 indexes stay: one of 4,096 ranks x 500
parameters (every row chunk listed), and one tensor stored as 100,000 chunks.

Also a save's planning on a structure change under DDP (every rank holding the same
1,000 replicated tensors): what each rank receives, before (an all-gather of every
rank's structure) and now (its own writes from rank 0's plan).

Also the planning of shared reads (``load(..., share_reads=True)``) at 4,096 ranks
(DDP, HSDP, FSDP resharded 4,096 -> 3,072): before, rank 0 received each distinct
piece list and planned every chunk; now each chunk's coordinator plans it, and the
figures are the busiest coordinator's and the largest part a rank receives.

    python bench/bench_plan_scale.py [--ranks 16384] [--quick]
"""

from __future__ import annotations

import argparse
import json
import math
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from shardpoint import save_commit, save_plan, save_records
from shardpoint.format.index import (
    Chunk,
    Index,
    TensorEntry,
    fragment_json,
)
from shardpoint.format.index import checksum as digest_of
from shardpoint.format.parse import parse_fragment, parse_index
from shardpoint.gc_pause import gc_paused
from shardpoint.names import fragment_file, shard_file
from shardpoint.plan import Holding
from shardpoint.sharding import Mesh, Sharding

ROWS_PER_RANK = 4
COLS = 4096
NORMS = 20


def layout(name: str, ranks: int, params: int) -> tuple[Sharding, tuple[int, int]]:
    """The sharding and global shape of every parameter of ``name``."""
    if name == "fsdp":
        return Sharding(Mesh((ranks,), tuple(range(ranks))), (0,)), (ROWS_PER_RANK * ranks, COLS)
    tp = 8
    fsdp = ranks // tp
    mesh = Mesh((tp, fsdp), tuple(range(ranks)))
    return Sharding(mesh, (1, 0)), (ROWS_PER_RANK * fsdp, COLS * tp // 8)


def holdings_of(
    rank: int, params: int, sharding: Sharding, shape: tuple[int, int]
) -> list[Holding]:
    coord = sharding.mesh.coord_of(rank)
    assert coord is not None
    offsets, local = sharding.box(shape, coord)
    held = [
        Holding(
            f"layers.{i // 10}.p{i % 10}.weight", "BF16", shape, offsets, local, False, sharding
        )
        for i in range(params)
    ]
    held += [
        Holding(f"layers.{i}.norm.weight", "F32", (COLS,), (0,), (COLS,), True)
        for i in range(NORMS)
    ]
    return held


def real_dtensor_case(name: str, ranks: int, params: int) -> dict[str, float]:
    """Run ``_real_dtensor_child`` in a fresh process (it joins a fake process group)."""
    out = subprocess.run(
        [sys.executable, __file__, "--real-dtensor-child", name, str(ranks), str(params)],
        capture_output=True,
        text=True,
        check=True,
    ).stdout
    return json.loads(out.strip().splitlines()[-1])


def _real_dtensor_child(name: str, ranks: int, params: int) -> None:
    """Rank 1 of a fake ``ranks``-rank process group: build ``params`` DTensors on the
    layout's mesh (and the replicated norms), then time what a steady save plans."""
    import torch
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import DTensor, Shard
    from torch.testing._internal.distributed.fake_pg import FakeStore

    from shardpoint.tree import flatten

    dist.init_process_group("fake", rank=1, world_size=ranks, store=FakeStore())
    sharding, shape = layout(name, ranks, params)
    mesh = init_device_mesh("cpu", sharding.mesh_shape)
    placements = [Shard(d) for d in sharding.dims]
    coord = sharding.mesh.coord_of(1)
    assert coord is not None
    _, local = sharding.box(shape, coord)
    start = time.perf_counter()
    state: dict[str, torch.Tensor] = {}
    for i in range(params):
        state[f"layers.{i // 10}.p{i % 10}.weight"] = DTensor.from_local(
            torch.empty(local, dtype=torch.bfloat16), mesh, placements, run_check=False,
            shape=torch.Size(shape), stride=(shape[1], 1),
        )  # fmt: skip
    for i in range(NORMS):
        state[f"layers.{i}.norm.weight"] = torch.empty(COLS)
    built = time.perf_counter() - start
    times = []
    for _ in range(2):  # the first save also reads each mesh's ranks once
        with gc_paused():  # as inside save()
            start = time.perf_counter()
            flat = flatten(state, rank=1)
            held, aliases, _, _ = save_plan._holdings(
                flat.tensors, True, flat.rank_tensors, with_tokens=False
            )
            save_plan._structure_digest(held, aliases)
            save_plan._digest(save_plan._sharded_entries(held))
            times.append(time.perf_counter() - start)
    assert sum(1 for h in held if h.sharding is not None) == params
    load_s = _real_load_plan(state, sharding, shape)
    print(
        json.dumps(
            {"first_s": times[0], "steady_s": times[1], "build_dtensors_s": built, "load_s": load_s}
        )
    )


def _real_load_plan(state: dict[str, Any], sharding: Sharding, shape: tuple[int, int]) -> float:
    """Rank 1's load planning into ``state`` from a committed directory holding the
    job's index and rank 1's fragment (no shard file: nothing is read): open and parse,
    match the state, and find each region's chunks."""
    from shardpoint import loading
    from shardpoint.format.marker import marker_json

    ranks = len(sharding.mesh.ranks)
    names = [n for n, t in state.items() if n.endswith(".weight") and ".p" in n]
    coord = sharding.mesh.coord_of(1)
    assert coord is not None
    offsets, local = sharding.box(shape, coord)
    fragment = fragment_json(
        1, {n: chunk_for(n, i, 1, offsets, local) for i, n in enumerate(names)}, {}, []
    )
    index = job_index(ranks, {n: ("BF16", shape, sharding) for n in names})
    index.files[fragment_file(1)] = len(fragment)
    index.fragments[1] = (len(fragment), digest_of(fragment))
    raw = index.to_json()
    with tempfile.TemporaryDirectory() as d:
        (Path(d) / "index.json").write_bytes(raw)
        (Path(d) / "COMMITTED").write_bytes(marker_json(raw))
        (Path(d) / fragment_file(1)).write_bytes(fragment)
        start = time.perf_counter()
        ckpt, _, reads, _ = loading._prepare(state, d, None, True)
        found = 0
        for name, regions in reads.regions.items():
            for r in regions:
                found += len(ckpt.chunks(ckpt.index.entries[name], r.offsets, r.tensor.shape))
        seconds = time.perf_counter() - start
    assert found == len(state), found  # each region is one stored chunk
    return seconds


def job_index(ranks: int, table: dict[str, tuple[str, tuple[int, ...], Sharding]]) -> Index:
    """The version 2 index of a job whose sharded entries are ``table`` (name: dtype,
    global shape, sharding), plus the replicated norms; every rank's shard file and
    fragment listed (placeholder sizes and checksums)."""
    files = {shard_file(r, 0): 400_000_000 for r in range(ranks)}
    files |= {fragment_file(r): 1_000_000 for r in range(ranks)}
    entries = {n: TensorEntry(n, dt, gs, ()) for n, (dt, gs, _) in table.items()}
    for i in range(NORMS):
        n = f"layers.{i}.norm.weight"
        entries[n] = TensorEntry(n, "F32", (COLS,), (chunk_for(n, i, i, (0,), (COLS,), 4),))
    return Index(
        files, entries, {}, {"dict": [[n, {"tensor": n}] for n in entries]},
        "2026-01-01T00:00:00+00:00", "0", ranks,
        shardings={n: s for n, (_, _, s) in table.items()},
        fragments={r: (1_000_000, "0123456789abcdef") for r in range(ranks)},
    )  # fmt: skip


def chunk_for(name: str, i: int, rank: int, offsets, shape, item: int = 2) -> Chunk:
    nbytes = item * math.prod(shape)
    begin = 8192 + nbytes * i
    return Chunk(
        shard_file(rank, 0), f"{name}@{','.join(map(str, offsets))}", offsets, shape,
        (begin, begin + nbytes), max(shape[0], 1), ("0123456789abcdef",),
    )  # fmt: skip


def v2_case(name: str, ranks: int, params: int) -> dict[str, float]:
    sharding, shape = layout(name, ranks, params)
    out: dict[str, float] = {}

    # Each rank's save planning (rank 1 stands for any rank), with the collector paused
    # as inside save(): a collection of this process's large heap is not the planner's.
    with gc_paused():
        start = time.perf_counter()
        held = holdings_of(1, params, sharding, shape)
        own = save_plan._structure_digest(held, {})
        sharded = save_plan._sharded_entries(held)
        listed = save_plan._digest(sharded)
        out["save_plan_steady_s"] = time.perf_counter() - start  # a reused plan: no more
    # On a structure change rank 0 plans from every rank's facts and one distinct
    # structure (every rank's is the same here), and each rank decodes its part.
    norms = [h for h in held if h.replicated]
    sole = sum(h.nbytes for h in held if not h.replicated)
    structure = json.loads(
        json.dumps({"replicated": [h.to_json() for h in norms], "aliases": {}, "sharded": sharded})
    )
    gathered = [([own, sole, r // 8, r % 8 == 0], structure) for r in range(ranks)]
    with gc_paused():
        start = time.perf_counter()
        job = save_plan._plan_job(gathered, False)
        out["save_replan_rank0_s"] = time.perf_counter() - start
    assert job.conflict is None and len(job.table) == params
    out["save_replan_part_bytes"] = max(len(json.dumps(p)) for p in job.parts)
    with gc_paused():
        start = time.perf_counter()  # per-node mode (8 ranks per node): a plan per node
        save_plan._plan_job(gathered, True)
        out["save_replan_per_node_rank0_s"] = time.perf_counter() - start
    table = job.table
    out["structure_list_digest"] = len(listed)

    # Rank 0: the index from the plan and every rank's small report.
    start = time.perf_counter()
    index = job_index(ranks, table)
    tree = index.tree
    raw = index.to_json()
    out["rank0_commit_s"] = time.perf_counter() - start
    out["index_bytes"] = len(raw)

    # Node-local directories (8 ranks per node): each node's first rank builds its
    # node's index from the inputs rank 0 broadcasts (every rank's report, the tree, the
    # distinct sharded lists); before, rank 0 built one index per node and broadcast
    # them all.
    nodes = [r // 8 for r in range(ranks)]
    reports = [
        save_records.WriteResult(
            files={shard_file(r, 0): 400_000_000, fragment_file(r): 1_000_000},
            fragment=(1_000_000, "0123456789abcdef"),
            fragment_files=[shard_file(r, 0)],
        )
        for r in range(ranks)
    ]
    for i, h in enumerate(norms):  # the first node's ranks write the replicated norms
        reports[i % 8].chunks.append(
            save_records.ChunkRecord(h.name, h.dtype, h.global_shape,
                               chunk_for(h.name, i, i % 8, h.offsets, h.shape, 4),
                               (h.offsets, h.shape))
        )  # fmt: skip
    stand_in = _PlanStandIn([{"aliases": {}, "node": n} for n in nodes])
    inputs = {
        "results": [r.to_json() for r in reports],
        "tree": tree,
        "sharded": [json.loads(json.dumps(sharded))],
        "created": "2026-01-01T00:00:00+00:00",
        "metadata": None,
        "first": "0123456789abcdef",
    }
    start = time.perf_counter()
    payload = json.dumps(inputs).encode()
    out["per_node_rank0_s"] = time.perf_counter() - start
    start = time.perf_counter()
    decoded = json.loads(payload)
    results = [save_records.WriteResult.from_json(d) for d in decoded["results"]]
    node_table = save_records.sharded_table(decoded["sharded"])
    decode_s = time.perf_counter() - start
    start = time.perf_counter()
    node_index = save_commit.build_index(
        stand_in, decoded["tree"], results, None, node_table, decoded["created"], 5, nodes
    )
    node_raw = node_index.to_json()
    out["per_node_index_s"] = time.perf_counter() - start  # what rank 0 did per node
    out["per_node_leader_s"] = decode_s + out["per_node_index_s"]
    out["per_node_inputs_bytes"] = len(payload)
    out["per_node_nodes"] = len(set(nodes))
    out["per_node_index_bytes"] = len(node_raw)

    # One rank's fragment (written beside its shards) and its load planning.
    coord = sharding.mesh.coord_of(1)
    assert coord is not None
    offsets, local = sharding.box(shape, coord)
    mine = {n: chunk_for(n, i, 1, offsets, local) for i, n in enumerate(index.shardings)}
    fragment = fragment_json(1, mine, {}, [])
    start = time.perf_counter()
    parsed = parse_index(raw, "index.json")
    parsed.fragments[1] = (len(fragment), digest_of(fragment))
    hi = tuple(o + s for o, s in zip(offsets, local))
    writers = set()
    for n, s in parsed.shardings.items():
        for c in s.overlapping(parsed.entries[n].shape, offsets, hi):
            writers.add(s.mesh.rank_at(c))
    chunks = parse_fragment(fragment, fragment_file(1), 1, parsed).chunks
    out["load_plan_s"] = time.perf_counter() - start
    assert writers == {1} and len(chunks) == params
    out["fragment_bytes"] = len(fragment)
    return out


class _PlanStandIn:
    """What ``save_commit.build_index`` reads of a save's plan: every rank's aliases and node."""

    def __init__(self, structures: list[dict]) -> None:
        self.structures = structures


def v1_index(name: str, ranks: int, params: int) -> Index:
    """A version 1 index of layout ``name``: every chunk of every parameter listed."""
    sharding, shape = layout(name, ranks, params)
    entries = {}
    for i in range(params):
        n = f"layers.{i // 10}.p{i % 10}.weight"
        chunks = tuple(
            chunk_for(n, i, r, *sharding.box(shape, sharding.mesh.coord_at(r)))
            for r in range(ranks)
        )
        entries[n] = TensorEntry(n, "BF16", shape, tuple(sorted(chunks, key=lambda c: c.offsets)))
    tree = {"dict": [[n, {"tensor": n}] for n in entries]}
    files = {shard_file(r, 0): 400_000_000 for r in range(ranks)}
    index = Index(files, entries, {}, tree, "2026-01-01T00:00:00+00:00", "0", ranks)
    index.format_version = 1
    return index


def v1_case(name: str, ranks: int, params: int, sample: int) -> dict[str, float]:
    """Version 1 at ``ranks`` from a ``sample``-rank index of the same layout."""
    index = v1_index(name, sample, params)
    start = time.perf_counter()
    raw = index.to_json()
    build = time.perf_counter() - start
    start = time.perf_counter()
    parsed = parse_index(raw, "index.json")
    parse = time.perf_counter() - start
    del parsed  # freeing it is not part of the parse (a reader keeps it)
    scale = ranks / sample
    return {
        "index_bytes": len(raw) * scale,
        "rank0_commit_s": build * scale,
        "load_plan_s": parse * scale,
        "bytes_per_chunk": len(raw) / (sample * params),
    }


def parse_case(raw: bytes) -> dict[str, float]:
    """Seconds to parse ``raw``: json.loads alone (garbage collector paused, as the
    library's parse pauses it), and the whole strict parse."""
    with gc_paused():
        start = time.perf_counter()
        json.loads(raw)
        loads = time.perf_counter() - start
    start = time.perf_counter()
    index = parse_index(raw, "index.json")
    parse = time.perf_counter() - start
    del index  # freeing it is not part of the parse (a reader keeps it)
    return {"bytes": len(raw), "json_loads_s": loads, "parse_s": parse}


def shared_plan_case(wanted: list[list[list]]) -> dict[str, float]:
    """``load(..., share_reads=True)`` planning of ranks that need ``wanted[r]`` (pieces
    ``[chunk key, lo, hi, bytes]``), with the library's coordinators and planner; the
    all-to-alls are not run, their payloads measured. Before, rank 0 received each
    distinct list and planned every chunk."""
    from shardpoint.shared_reads import assign_readers, coordinator

    world = len(wanted)
    distinct = {id(lst): lst for lst in wanted}  # DDP: one list object for every rank
    told = [[[] for _ in range(world)] for _ in range(world)]  # [coordinator][rank]
    for rank, items in enumerate(wanted):
        for item in items:
            told[coordinator(item[0], world)][rank].append(item)
    received = [0] * world  # bytes of plan each rank receives
    told_bytes, plan_s = [], []
    with gc_paused():  # as inside load()
        for c in range(world):
            told_bytes.append(sum(len(json.dumps(lst)) for lst in told[c]))
            start = time.perf_counter()
            parts = assign_readers(told[c], c)
            plan_s.append(time.perf_counter() - start)
            for r, part in enumerate(parts):
                received[r] += len(json.dumps(part))
    return {
        "pieces": sum(len(lst) for lst in wanted),
        "before_rank0_bytes": sum(len(json.dumps(lst)) for lst in distinct.values()),
        "coordinator_max_bytes": max(told_bytes),
        "coordinator_max_plan_s": max(plan_s),
        "all_coordinators_plan_s": sum(plan_s),
        "max_part_bytes": max(received),
        "sizes_bytes": 2 * 8 * world,  # each all-to-all's sizes: one integer per rank
    }


def replicated_pieces(ranks: int, regions: int, replicas: int) -> list[list[list]]:
    """``replicas`` ranks need each shard (DDP: every rank; HSDP: a replica group)."""
    groups = ranks // replicas
    lists = [
        [[f"w{i}|[{g * 64}, 0]", [g * 64, 0], [g * 64 + 64, 128], 64 * 128 * 4]
         for i in range(regions)]
        for g in range(groups)
    ]  # fmt: skip
    return [lists[r % groups] for r in range(ranks)]


def resharded_pieces(saved: int, loaded: int, params: int) -> list[list[list]]:
    """FSDP ``saved`` -> ``loaded`` ranks, 4 rows per saved chunk: every rank's pieces
    differ."""
    rows, cols = 4 * saved, 128
    per = -(-rows // loaded)  # DTensor's Shard(0): ceil-sized pieces, the last shorter
    wanted = []
    for r in range(loaded):
        lo, hi = min(r * per, rows), min((r + 1) * per, rows)
        wanted.append([
            [f"w{i}|[{4 * c}, 0]", [max(lo, 4 * c), 0], [min(hi, 4 * c + 4), cols],
             (min(hi, 4 * c + 4) - max(lo, 4 * c)) * cols * 4]
            for i in range(params)
            for c in range(lo // 4, -(-hi // 4))
        ])  # fmt: skip
    return wanted


def ddp_replan_case(ranks: int, params: int) -> dict[str, float]:
    """A save's planning on a structure change (the first save of a job) under DDP:
    every rank holds the same ``params`` replicated tensors. Before, every rank
    all-gathered every rank's structure and planned the writes itself; now rank 0
    receives each rank's facts and the one distinct structure, plans, and each rank
    receives its own writes."""
    held = [
        Holding(f"layers.{i}.weight", "F32", (1024,), (0,), (1024,), True) for i in range(params)
    ]
    structure = {"replicated": [h.to_json() for h in held], "aliases": {}, "sharded": []}
    structure_bytes = len(json.dumps(structure))
    facts = ["0123456789abcdef0123456789abcdef", 0, 0, True]
    gathered = [(facts, structure) for _ in range(ranks)]
    with gc_paused():
        start = time.perf_counter()
        job = save_plan._plan_job(gathered, False)
        plan_s = time.perf_counter() - start
    told = len(json.dumps([facts, "0123456789abcdef0123456789abcdef", None]))
    return {
        "before_bytes_per_rank": ranks * structure_bytes,
        "after_rank0_bytes": ranks * told + structure_bytes,
        "after_bytes_per_rank": len(json.dumps([None, False]))
        + max(len(json.dumps(p)) for p in job.parts),
        "rank0_plan_s": plan_s,
    }


def main() -> None:
    p = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    p.add_argument("--ranks", type=int, default=16384)
    p.add_argument("--quick", action="store_true", help="1,024 ranks, to check the script runs")
    p.add_argument("--out", type=Path, default=Path("bench/results/plan_scale.json"))
    p.add_argument("--real-dtensor-child", nargs=3, help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.real_dtensor_child:
        layout_name, child_ranks, child_params = args.real_dtensor_child
        _real_dtensor_child(layout_name, int(child_ranks), int(child_params))
        return
    ranks = 1024 if args.quick else args.ranks
    cases = {"fsdp": 10_000, "tp-fsdp": 2_000}
    results = {}
    for name, params in cases.items():
        v2 = v2_case(name, ranks, params)
        v1 = v1_case(name, ranks, params, sample=64)
        v2["real_dtensor"] = real_dtensor_case(name, ranks, params)
        results[name] = {"params": params, "ranks": ranks, "v1": v1, "v2": v2}
        print(f"\n{name}: {ranks:,} ranks x {params:,} sharded parameters + {NORMS} norms")
        rows = [
            ("global index (MB)", v1["index_bytes"] / 1e6, v2["index_bytes"] / 1e6),
            ("rank 0 builds + serialises it (s)", v1["rank0_commit_s"], v2["rank0_commit_s"]),
            ("a rank plans its load (s)", v1["load_plan_s"], v2["load_plan_s"]),
            ("  the same into real DTensors (s)", None, v2["real_dtensor"]["load_s"]),
            ("a rank plans its save, steady (s)", None, v2["save_plan_steady_s"]),
            ("  the same from real DTensors (s)", None, v2["real_dtensor"]["steady_s"]),
            ("  ...the first save (reads each mesh) (s)", None, v2["real_dtensor"]["first_s"]),
            ("  on a structure change, rank 0 plans (s)", None, v2["save_replan_rank0_s"]),
            (
                "  the same, node-local: a plan per node (s)",
                None,
                v2["save_replan_per_node_rank0_s"],
            ),
            ("a rank's fragment (MB)", None, v2["fragment_bytes"] / 1e6),
        ]
        nodes, node_mb = v2["per_node_nodes"], v2["per_node_index_bytes"] / 1e6
        rows += [
            (f"node-local, {nodes:,} nodes: rank 0 works (s)",
             nodes * v2["per_node_index_s"], v2["per_node_index_s"] + v2["per_node_rank0_s"]),
            ("  each node's first rank builds its index (s)", None, v2["per_node_leader_s"]),
            ("  each node's first rank receives (MB)", nodes * node_mb,
             v2["per_node_inputs_bytes"] / 1e6),
        ]  # fmt: skip
        print(f"{'':46} {'v1 / before':>18} {'v2 (measured)':>14}")
        for label, old, new in rows:
            left = f"{old:18.2f}" if old is not None else " " * 18
            print(f"{label:46} {left} {new:14.2f}")
    for label, ranks_, params_ in (
        ("v1 index, 4,096 ranks x 500 parameters", 4096, 500),
        ("one tensor of 100,000 chunks, one per rank file", 100_000, 1),
    ):
        if args.quick:
            ranks_ //= 16
        r = parse_case(v1_index("fsdp", ranks_, params_).to_json())
        results[f"parse {label}"] = r
        print(
            f"\nparse {label}: {r['bytes'] / 1e6:.1f} MB in {r['parse_s']:.2f} s "
            f"(json.loads alone {r['json_loads_s']:.2f} s)"
        )
    r = ddp_replan_case(ranks, 1000)
    results["save replan DDP"] = r
    print(
        f"\nsave planning on a structure change, DDP: {ranks:,} ranks x 1,000 replicated "
        f"tensors: each rank received {r['before_bytes_per_rank'] / 1e6:.1f} MB before, now "
        f"{r['after_bytes_per_rank'] / 1e3:.2f} kB (rank 0: "
        f"{r['after_rank0_bytes'] / 1e6:.2f} MB in, plans in {r['rank0_plan_s']:.2f} s)"
    )
    shared_ranks = 1024 if args.quick else 4096
    saved, loaded = (1024, 768) if args.quick else (4096, 3072)
    for label, wanted in (
        (f"DDP, {shared_ranks:,} ranks", replicated_pieces(shared_ranks, 500, shared_ranks)),
        (f"HSDP, 2 replicas, {shared_ranks:,} ranks", replicated_pieces(shared_ranks, 500, 2)),
        (f"FSDP {saved:,} -> {loaded:,} ranks", resharded_pieces(saved, loaded, 500)),
    ):
        r = shared_plan_case(wanted)
        results[f"shared_reads {label}"] = r
        print(
            f"\nshared reads, {label} x 500 parameters: {r['pieces']:,} pieces; before, rank 0 "
            f"received {r['before_rank0_bytes'] / 1e6:.2f} MB and planned every chunk. Now the "
            f"busiest coordinator receives {r['coordinator_max_bytes'] / 1e6:.2f} MB and plans "
            f"in {r['coordinator_max_plan_s']:.3f} s (all of them: "
            f"{r['all_coordinators_plan_s']:.2f} s); a rank receives at most "
            f"{r['max_part_bytes'] / 1e6:.2f} MB of plan + {r['sizes_bytes'] / 1e3:.0f} kB of sizes"
        )
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(results, indent=1))


if __name__ == "__main__":
    main()
