"""The only module that calls ``torch.distributed``; everything is a no-op in one process.

Coordination data (plans, checksums, outcomes) travels as JSON bytes in uint8 tensors
over a CPU (gloo) group, never pickled: ``all_gather_object`` would unpickle whatever
another process sent.
"""

from __future__ import annotations

import json
import os
import threading
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any

import torch
import torch.distributed as dist
import xxhash

from .errors import CheckpointError

_SOLO = threading.local()  # per thread: act as a job of one process
# Groups made once per process group: followed by _follow_world, which drops them
# when the job re-initializes torch.distributed in this process.
_WORLD: Any = None  # the default group the ones below were made for (held: never reused)
_GENERATION = 0
_CPU_GROUP: Any = None


def is_distributed() -> bool:
    if getattr(_SOLO, "active", False):
        return False
    return dist.is_available() and dist.is_initialized()


@contextmanager
def solo() -> Iterator[None]:
    """Within this block (this thread only) the rank saves and loads its own state as a
    job of one process: no collectives, DTensors stand for their local shards. The
    memory tier keeps each rank's checkpoint this way."""
    _SOLO.active = True
    try:
        yield
    finally:
        _SOLO.active = False


def in_solo() -> bool:
    return bool(getattr(_SOLO, "active", False))


def rank() -> int:
    return dist.get_rank() if is_distributed() else 0


def world_size() -> int:
    return dist.get_world_size() if is_distributed() else 1


def is_node_leader() -> bool:
    """Whether this rank is the first of its node (torchrun's ``LOCAL_RANK`` 0); without
    a launcher that says so, every rank counts as one node's and rank 0 leads it."""
    local = os.environ.get("LOCAL_RANK")
    return (int(local) if local is not None and is_distributed() else rank()) == 0


def node_rank() -> int:
    """The node this rank runs on (torchrun's ``GROUP_RANK``; 0 without a launcher)."""
    return int(os.environ.get("GROUP_RANK", 0)) if is_distributed() else 0


def _follow_world() -> None:
    """Forget the groups made for an earlier default group: a job that re-initializes
    torch.distributed in this process (an in-process restart) has a new one."""
    global _WORLD, _GENERATION, _CPU_GROUP
    world = dist.group.WORLD
    if world is not _WORLD:
        _WORLD, _CPU_GROUP = world, None
        _GENERATION += 1


def generation() -> int:
    """Which process group of this process's life the job runs in (0 in one process):
    what was cached for an earlier one (save plans) must not be used in this one."""
    if not is_distributed():
        return 0
    _follow_world()
    return _GENERATION


def _cpu_group() -> Any:
    """The default group when it runs on the CPU (gloo), else a gloo group made once."""
    global _CPU_GROUP
    _follow_world()
    if _CPU_GROUP is None:
        _CPU_GROUP = (
            dist.group.WORLD if dist.get_backend() == "gloo" else dist.new_group(backend="gloo")
        )
    return _CPU_GROUP


def new_cpu_group() -> Any:
    """A gloo group of its own (a collective: every rank calls this at the same point),
    for collectives on a background thread; None in one process."""
    return dist.new_group(backend="gloo") if is_distributed() else None


def _encoded(value: Any) -> torch.Tensor:
    """``value`` as JSON bytes in a uint8 tensor (what every helper here sends)."""
    return torch.frombuffer(bytearray(json.dumps(value).encode()), dtype=torch.uint8)


def _decoded(data: torch.Tensor) -> Any:
    return json.loads(data.numpy().tobytes())


def all_gather_json(value: Any, group: Any = None) -> list[Any]:
    """Every rank's ``value`` (JSON-serialisable), in rank order. Every rank receives
    every rank's payload (padded to the longest), O(ranks) to every rank: the library
    uses none (the benchmarks do); ``max_of``, ``first_error``, ``gather_json``,
    ``gather_distinct_json`` and ``broadcast_json`` keep what a rank receives from
    growing with the ranks."""
    if not is_distributed():
        return [value]
    group = _cpu_group() if group is None else group
    payload = _encoded(value)
    sizes = [torch.zeros(1, dtype=torch.int64) for _ in range(world_size())]
    dist.all_gather(sizes, torch.tensor([len(payload)]), group=group)
    padded = torch.zeros(int(max(s.item() for s in sizes)), dtype=torch.uint8)
    padded[: len(payload)] = payload
    out = [torch.empty_like(padded) for _ in range(world_size())]
    dist.all_gather(out, padded, group=group)
    return [_decoded(o[: int(n.item())]) for o, n in zip(out, sizes)]


def _gather_bytes(payload: bytes, dst: int, group: Any) -> list[bytes] | None:
    """Every rank's ``payload`` on rank ``dst``: the sizes gathered to ``dst`` alone,
    then each non-empty payload point to point. A rank sends and receives its own bytes
    only (nothing padded to the longest payload, nothing that grows with the ranks),
    except ``dst``, which receives what it asked for."""
    me = rank()
    size = torch.tensor([len(payload)], dtype=torch.int64)
    sizes = [torch.zeros(1, dtype=torch.int64) for _ in range(world_size())] if me == dst else None
    dist.gather(size, sizes, dst=dst, group=group)
    if sizes is None:
        if payload:
            data = torch.frombuffer(bytearray(payload), dtype=torch.uint8)
            dist.send(data, dst=dst, group=group)  # groups span every rank
        return None
    out = []
    for r, n in enumerate(int(s.item()) for s in sizes):
        if r == me or not n:
            out.append(payload if r == me else b"")
            continue
        buffer = torch.empty(n, dtype=torch.uint8)
        dist.recv(buffer, src=r, group=group)
        out.append(buffer.numpy().tobytes())
    return out


def gather_json(value: Any, dst: int = 0, group: Any = None) -> list[Any] | None:
    """Every rank's ``value`` on rank ``dst`` (in rank order); None on the other ranks."""
    if not is_distributed():
        return [value]
    group = _cpu_group() if group is None else group
    payloads = _gather_bytes(json.dumps(value).encode(), dst, group)
    return None if payloads is None else [json.loads(p) for p in payloads]


def gather_distinct_json(
    facts: Any, value: Any, error: str | None, dst: int = 0, group: Any = None
) -> tuple[str | None, list[tuple[Any, Any]] | None]:
    """Every rank's small ``facts`` and large ``value`` on rank ``dst``, each distinct
    value sent once, with an error agreement. Each rank sends ``dst`` its facts, a
    digest of its value and its error (None: none); ``dst`` answers every rank with the
    first error and whether it is the first rank with its digest, and only those send
    their value (under DDP or FSDP every rank's is the same: one is sent).

    Returns the first error (every rank) and, on ``dst`` when no rank failed, every
    rank's ``(facts, value)``, equal values being one object; None elsewhere."""
    if not is_distributed():
        return error, None if error else [(facts, value)]
    group = _cpu_group() if group is None else group
    payload = json.dumps(value).encode()
    digest = xxhash.xxh3_128_hexdigest(payload)
    told = gather_json([facts, digest, error], dst, group)
    answers = None
    if told is not None:
        failed = next((e for _, _, e in told if e), None)
        first: dict[str, int] = {}
        for r, (_, d, _) in enumerate(told):
            first.setdefault(d, r)
        answers = [[failed, first[d] == r] for r, (_, d, _) in enumerate(told)]
    failed, speaks = scatter_json(answers, dst, group)
    if failed is not None:
        return failed, None
    sent = _gather_bytes(payload if speaks else b"", dst, group)
    if sent is None:
        return None, None
    assert told is not None
    values = {told[r][1]: json.loads(p) for r, p in enumerate(sent) if p}
    return None, [(f, values[d]) for f, d, _ in told]


def scatter_json(values: list[Any] | None, src: int = 0, group: Any = None) -> Any:
    """Rank ``src`` gives each rank its own value (``values[rank]``; None elsewhere):
    one scatter of the sizes, then each payload point to point, so a rank receives its
    own bytes only."""
    if not is_distributed():
        assert values is not None
        return values[0]
    if rank() == src:
        assert values is not None
        _scatter_payloads([_encoded(v) for v in values], src, group)
        return values[src]
    return _decoded(_scatter_payloads(None, src, group))


def _scatter_payloads(payloads: list[torch.Tensor] | None, src: int, group: Any) -> torch.Tensor:
    """The bytes of ``scatter_json``: ``payloads`` on ``src`` (one per rank of the
    group), None elsewhere; returns this rank's."""
    group = _cpu_group() if group is None else group
    size = torch.zeros(1, dtype=torch.int64)
    if payloads is None:
        dist.scatter(size, None, src=src, group=group)
        buffer = torch.empty(int(size.item()), dtype=torch.uint8)
        dist.recv(buffer, src=src, group=group)
        return buffer
    dist.scatter(size, [torch.tensor([len(p)]) for p in payloads], src=src, group=group)
    for r, payload in enumerate(payloads):
        if r != src:
            dist.send(payload, dst=r, group=group)
    return payloads[src]


def scatter_plan(plan: Callable[[], list[Any]] | None, src: int = 0, group: Any = None) -> Any:
    """Rank ``src`` runs ``plan()`` (None on the others) and gives each rank its part, as
    ``scatter_json`` does. If planning or encoding the parts fails, every rank raises
    instead of waiting for a part forever: ``src`` its own exception, the others a
    ``CheckpointError`` with its message."""
    if not is_distributed():
        assert plan is not None
        return plan()[0]
    if rank() != src:
        error, part = _decoded(_scatter_payloads(None, src, group))
        if error is not None:
            raise CheckpointError(f"rank {src} could not plan: {error}")
        return part
    assert plan is not None
    ranks = dist.get_world_size(_cpu_group() if group is None else group)
    try:
        parts = plan()
        if len(parts) != ranks:
            raise ValueError(f"a plan of {len(parts)} parts for {ranks} ranks")
        payloads = [_encoded([None, part]) for part in parts]
    except Exception as exc:
        _scatter_payloads([_encoded([str(exc) or type(exc).__name__, None])] * ranks, src, group)
        raise
    _scatter_payloads(payloads, src, group)
    return parts[src]


def all_to_all_json(values: list[Any], group: Any = None) -> list[Any]:
    """Send ``values[r]`` to rank ``r``, for every rank at once; returns what each rank
    sent this one, in rank order. One all-to-all of the sizes (one integer per rank),
    then one of the payloads: a rank receives what was addressed to it, nothing padded
    to the longest payload."""
    if not is_distributed():
        return list(values)
    group = _cpu_group() if group is None else group
    payloads = [json.dumps(v).encode() for v in values]
    sizes = torch.tensor([len(p) for p in payloads], dtype=torch.int64)
    theirs = torch.empty_like(sizes)
    dist.all_to_all_single(theirs, sizes, group=group)
    received = torch.empty(int(theirs.sum()), dtype=torch.uint8)
    # frombuffer refuses an empty buffer: nothing to send is one byte, none of it sent
    sent = torch.frombuffer(bytearray(b"".join(payloads)) or bytearray(1), dtype=torch.uint8)
    counts = theirs.tolist()
    dist.all_to_all_single(received, sent[: int(sizes.sum())], counts, sizes.tolist(), group=group)
    raw = received.numpy().tobytes()
    out, at = [], 0
    for n in counts:
        out.append(json.loads(raw[at : at + n]))
        at += n
    return out


def broadcast_json(value: Any, src: int = 0, group: Any = None) -> Any:
    """``value`` from rank ``src`` on every rank (its size, then its bytes: every rank
    receives the one payload, however many ranks there are)."""
    if not is_distributed():
        return value
    group = _cpu_group() if group is None else group
    payload = _encoded(value) if rank() == src else None
    size = torch.tensor([0 if payload is None else len(payload)], dtype=torch.int64)
    dist.broadcast(size, src=src, group=group)
    data = torch.empty(int(size.item()), dtype=torch.uint8) if payload is None else payload
    dist.broadcast(data, src=src, group=group)
    return value if payload is not None else _decoded(data)


def relay_json(value: Any, ranks: list[int], group: Any = None) -> Any:
    """``value`` from ``ranks[0]`` on every rank of ``ranks`` (only they call this), along
    a binomial tree: each receives it once, point to point, and passes it on to at most
    ceil(log2(len(ranks))) others, the nearest (the head of the largest subtree) first,
    so every rank has it after ceil(log2(len(ranks))) rounds of sends. Ranks outside the
    list receive nothing: a node's first rank gets what its node's index needs, the
    node's other ranks do not."""
    if not is_distributed():
        return value
    group = _cpu_group() if group is None else group
    me = ranks.index(rank())
    parent, children = relay_tree(me, len(ranks))
    if parent is None:
        data = _encoded(value)
    else:
        size = torch.zeros(1, dtype=torch.int64)
        dist.recv(size, src=ranks[parent], group=group, tag=_RELAY_TAG)
        data = torch.empty(int(size.item()), dtype=torch.uint8)
        dist.recv(data, src=ranks[parent], group=group, tag=_RELAY_TAG)
    for child in children:
        size = torch.tensor([len(data)], dtype=torch.int64)
        dist.send(size, dst=ranks[child], group=group, tag=_RELAY_TAG)
        dist.send(data, dst=ranks[child], group=group, tag=_RELAY_TAG)
    return value if parent is None else _decoded(data)


def relay_tree(me: int, n: int) -> tuple[int | None, list[int]]:
    """Position ``me`` of ``n`` in the relay's binomial tree: the position it receives
    from (``me`` without its highest bit; None for the root) and those it sends to, in
    order (``me`` plus each higher power of two: the nearest heads the largest subtree,
    so it goes first)."""
    parent = me - (1 << (me.bit_length() - 1)) if me else None
    children = []
    step = 1 << me.bit_length()
    while me + step < n:
        children.append(me + step)
        step <<= 1
    return parent, children


_RELAY_TAG = 7  # apart from the untagged point-to-point messages of the gathers


def first_error(error: str | None, group: Any = None) -> str | None:
    """The error of the lowest-ranked rank that failed (None: no rank failed): one
    all-reduce of one integer finds that rank, which then broadcasts its message, so
    no rank receives more than one message however many failed."""
    if not is_distributed():
        return error
    world = world_size()
    # The lowest failing rank r is the one with the largest world - r.
    top = max_of([world - rank() if error is not None else 0], group)[0]
    if not top:
        return None
    # Never empty: callers test the answer for truth.
    return broadcast_json(error, world - top, group) or "(no message)"


def barrier(group: Any = None) -> None:
    """Every rank reaches this point before any leaves it (a no-op in one process)."""
    if is_distributed():
        dist.barrier(group=_cpu_group() if group is None else group)


def isend_bytes(data: torch.Tensor, dst: int, tag: int, group: Any = None) -> Any:
    """Start sending a CPU tensor to rank ``dst`` (point to point, CPU group)."""
    return dist.isend(data, dst=dst, group=group or _cpu_group(), tag=tag)


def irecv_bytes(buffer: torch.Tensor, src: int, tag: int, group: Any = None) -> Any:
    """Start receiving into a CPU tensor from rank ``src``."""
    return dist.irecv(buffer, src=src, group=group or _cpu_group(), tag=tag)


def swap_json(value: Any, to: list[int], frm: list[int], group: Any = None) -> list[Any]:
    """Point to point: send ``value`` to the ranks ``to`` and receive the value each of
    the ranks ``frm`` sends this one, in that order (its size, then its bytes). Only
    these ranks take part: what a rank receives does not grow with the job."""
    data = _encoded(value)
    size = torch.tensor([len(data)], dtype=torch.int64)
    sends = []
    for dst in to:
        sends.append(isend_bytes(size, dst, tag=0, group=group))
        sends.append(isend_bytes(data, dst, tag=1, group=group))
    theirs = []
    for src in frm:
        their_size = torch.zeros(1, dtype=torch.int64)
        irecv_bytes(their_size, src, tag=0, group=group).wait()
        buffer = torch.empty(int(their_size.item()), dtype=torch.uint8)
        irecv_bytes(buffer, src, tag=1, group=group).wait()
        theirs.append(_decoded(buffer))
    for request in sends:
        request.wait()
    return theirs


def worst_error(error: str | None, kind: int, group: Any = None) -> tuple[int, str | None]:
    """Of the ranks that failed (``error`` set; ``kind``: larger is graver), the gravest
    kind and the message of the lowest-ranked rank of that kind; (-1, None) when no
    rank failed. Every rank gets the same answer, so every rank acts on it alike."""
    if not is_distributed():
        return (kind, error) if error is not None else (-1, None)
    worst = max_of([kind if error is not None else -1], group)[0]
    if worst < 0:
        return -1, None
    return worst, first_error(error if error is not None and kind == worst else None, group)


def max_of(values: list[int], group: Any = None) -> list[int]:
    """Elementwise maximum of ``values`` over all ranks (one small all-reduce)."""
    if not is_distributed():
        return values
    t = torch.tensor(values, dtype=torch.int64)
    dist.all_reduce(t, op=dist.ReduceOp.MAX, group=_cpu_group() if group is None else group)
    return [int(v) for v in t.tolist()]
