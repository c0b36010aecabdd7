"""Who gives each rank its memory-tier copy at a restore: rank 0's plan, a pure function
of every rank's holdings (``MemoryTier._holdings``).

For each rank, in this order: its own copy where its slot of the node keeps one; else
the copy kept on another node (the lowest-ranked buddy's replica, or an own copy a
restart left in a slot now given to another rank); else a rebuild from its parity
group's surviving pieces (``k`` per codeword: the other members' data chunks first,
then parity), with XOR parity (``m = 1``) summed on the way (``_xor_chain``). The step
chosen is the newest one every rank can recover; none if there is no such step, with
whose copies of the newest step held are gone.
"""

from __future__ import annotations

from typing import Any

from .erasure import Placement


def restore_roles(holdings: list[dict[str, Any]], world: int) -> list[dict[str, Any]]:
    """Rank 0's plan from every rank's holdings: per rank, the newest step every rank can
    recover (None: none) and its part of the transfers, in the job's order: ["send",
    owner, {"whose", "own"}] or ["receive", holder, {file: size}] for copies kept on
    another node (a buddy's replica, or an own copy a restart left in a slot now given
    to another rank); ["adopt", owner, None] for a replica of its own its slot keeps;
    ["send_piece", rebuilder, what], ["receive_piece", sender, which] and
    ["local_piece", owner, [what, which]] for parity (with "rebuild": how the pieces
    make the rank's copy), or the "chain_*" steps of ``_xor_chain``. A rank's own copy
    comes first, else the lowest-ranked buddy's, else a rebuild from its parity group.
    Rank 0's part also says which ranks did not use their own copy
    ("ranks_from_buddies", "ranks_rebuilt"), or, when no step is recoverable, whose
    copies of the newest step held are gone ("lost": {"step", "ranks"})."""
    # (whose, step) -> (the rank holding that copy, its files), own copies before replicas
    copies: dict[tuple[int, int], tuple[int, bool, dict[str, int]]] = {}
    parity: dict[tuple[int, int], tuple[int, dict[str, Any]]] = {}  # (holder, step) ->
    for kind in ("own", "held"):
        for holder, h in enumerate(holdings):
            for whose, steps in h[kind].items():
                for step, files in steps.items():
                    key = (int(whose), int(step))
                    if key not in copies or (kind == "own" and int(whose) == holder):
                        copies[key] = (holder, kind == "own", files)
    for holder, h in enumerate(holdings):
        for whose, steps in h["parity"].items():
            for step, manifest in steps.items():
                parity[(int(whose), int(step))] = (holder, manifest)

    def rebuild(rank: int, step: int) -> dict[str, Any] | None:
        """How ``rank`` rebuilds its copy of ``step`` from its parity group's pieces:
        for each codeword it gave a chunk to, ``k`` pieces of it that survive (data
        chunks of the other members first, then parity) with their checksums."""
        group = next(
            (m for (_, s), (_, m) in parity.items() if s == step and rank in m["members"]), None
        )
        if group is None:
            return None
        pl = Placement(tuple(group["members"]), group["parity"])
        p, size = pl.position(rank), group["chunk_bytes"]
        chunks, pieces = [], []
        for j in pl.chunks(p):
            kept = {}  # parity piece t -> (the rank holding it, its record)
            for t, h in enumerate(pl.holders(j)):
                holder, manifest = parity.get((pl.members[h], step), (None, {}))
                if str(j) in manifest.get("codewords", {}):
                    kept[t] = (holder, manifest["codewords"][str(j)])
            if not kept:
                return None
            hashes = next(iter(kept.values()))[1]["data_hashes"]
            found = [
                (
                    copies[(pl.members[q], step)][0],
                    d,
                    hashes[d],
                    {"kind": "data", "whose": pl.members[q], "chunk": pl.chunks(q).index(j)},
                )
                for d, q in enumerate(pl.data(j))
                if q != p and copies.get((pl.members[q], step), (0, False))[1]
            ] + [
                (
                    holder,
                    pl.k + t,
                    c["parity_hash"],
                    {"kind": "parity", "whose": pl.members[pl.holders(j)[t]]},
                )
                for t, (holder, c) in kept.items()
            ]
            if len(found) < pl.k:
                return None
            chunks.append([j, pl.data(j).index(p)])
            for sender, index, digest, what in found[: pl.k]:
                detail = {**what, "codeword": j, "chunk_bytes": size}
                pieces.append((sender, {"codeword": j, "index": index, "hash": digest}, detail))
        spec = {"chunk_bytes": size, "data": pl.k, "parity": pl.m, "chunks": chunks}
        return {"spec": {**spec, "files": group["files"][p]}, "pieces": pieces}

    rebuilds: dict[tuple[int, int], dict[str, Any] | None] = {}

    def source(rank: int, step: int) -> int | None:
        if (rank, step) in copies:
            return copies[(rank, step)][0]
        if (rank, step) not in rebuilds:
            rebuilds[(rank, step)] = rebuild(rank, step)
        return None if rebuilds[(rank, step)] is None else -1  # -1: rebuilt from parity

    newest = next(
        (
            step
            for step in sorted({s for _, s in copies} | {s for _, s in parity}, reverse=True)
            if all(source(rank, step) is not None for rank in range(world))
        ),
        None,
    )
    roles: list[dict[str, Any]] = [{"step": newest, "transfers": []} for _ in range(world)]
    held = {s for _, s in copies} | {s for _, s in parity}
    if newest is None and held:  # rank 0's part says whose copies of the newest are gone
        best = max(held)
        roles[0]["lost"] = {
            "step": best,
            "ranks": [r for r in range(world) if source(r, best) is None],
        }
    for owner in range(world) if newest is not None else ():
        holder = source(owner, newest)
        if holder != owner:  # rank 0's part says how (for the event log)
            how = "ranks_rebuilt" if holder == -1 else "ranks_from_buddies"
            roles[0].setdefault(how, []).append(owner)
        if holder == -1:
            plan = rebuilds[(owner, newest)]
            assert plan is not None
            roles[owner]["rebuild"] = plan["spec"]
            k = plan["spec"]["data"]
            for at in range(0, len(plan["pieces"]), k):  # one codeword's pieces
                pieces = plan["pieces"][at : at + k]
                senders = [sender for sender, _, _ in pieces]
                if plan["spec"]["parity"] == 1 and len({owner, *senders}) == k + 1:
                    _xor_chain(roles, owner, pieces)
                    continue
                for sender, receive, send in pieces:
                    which = {**receive, "from": sender}
                    if sender == owner:  # a piece its own slot keeps (ranks moved)
                        roles[owner]["transfers"].append(["local_piece", owner, [send, which]])
                        continue
                    roles[sender]["transfers"].append(["send_piece", owner, send])
                    roles[owner]["transfers"].append(["receive_piece", sender, which])
        elif holder == owner and not copies[(owner, newest)][1]:
            # Its own slot keeps a replica of it (left by the rank that held it before
            # the ranks moved): made its own copy in place, no transfer.
            roles[owner]["transfers"].append(["adopt", owner, None])
        elif holder != owner:
            _, is_own, files = copies[(owner, newest)]
            roles[holder]["transfers"].append(["send", owner, {"whose": owner, "own": is_own}])
            roles[owner]["transfers"].append(["receive", holder, files])
    return roles


def _xor_chain(roles: list[dict[str, Any]], owner: int, pieces: list[tuple]) -> None:
    """XOR parity (m = 1): a codeword's lost chunk is the XOR of its ``k`` other pieces,
    so they are summed on the way: each holder checks its piece against its checksum,
    XORs it into what the previous one sent and sends the sum on; the rebuilding rank
    receives one chunk per codeword, as from a replica, not ``k``."""
    for i, (sender, receive, send) in enumerate(pieces):
        if i:
            size = {"chunk_bytes": send["chunk_bytes"]}
            roles[sender]["transfers"].append(["chain_receive", pieces[i - 1][0], size])
        onward = pieces[i + 1][0] if i + 1 < len(pieces) else owner
        roles[sender]["transfers"].append(["chain_send", onward, {**send, "hash": receive["hash"]}])
    which = {"codeword": pieces[0][1]["codeword"], "index": "sum", "from": pieces[-1][0]}
    roles[owner]["transfers"].append(["receive_piece", pieces[-1][0], which])
