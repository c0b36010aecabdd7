"""Where a run's directory lives across nodes: shared or node-local, and the run's id.

A directory may be the same path on every node but a different disk on each (node-local
NVMe): found out at the start (``directory_per_node``), never assumed. The run id kept in
it names the run's memory-tier namespace (``memory_job``).
"""

from __future__ import annotations

import hashlib
import os
import uuid
import warnings
from typing import Any

from .. import dist
from ..errors import CheckpointError
from ..names import RUN_ID_NAME
from ..storage import CheckpointStorage, is_url


def keeps_local(per_node: bool) -> bool:
    """Whether this rank prepares, retains and cleans the local directory: rank 0, and
    with node-local directories (``per_node``) each node's first rank."""
    return dist.rank() == 0 or (per_node and dist.is_node_leader())


def directory_per_node(storage: CheckpointStorage) -> bool:
    """Collective: whether the manager's directory is a different one on each node.

    Each node's first rank leaves a probe file in it; if one of them cannot see every
    other node's probe, the directories are node-local. One node, an object store or a
    directory that cannot be written (a read-only mount) counts as shared.
    """
    if not dist.is_distributed():
        return False
    # Rank 0 learns which ranks lead a node and sends every rank their list and a
    # token: what a rank receives grows with the nodes, not the ranks.
    leads = dist.gather_json(dist.is_node_leader())
    token, leaders = dist.broadcast_json(
        None if leads is None else [uuid.uuid4().hex, [r for r, y in enumerate(leads) if y]]
    )
    probes = {f"probe-{token}-{r}" for r in leaders}
    mine = f"probe-{token}-{dist.rank()}"
    if len(probes) < 2 or is_url(storage.where):
        return False
    wrote = False
    if mine in probes:
        try:
            storage.write_small_durably(mine, b"")
            wrote = True
        except (OSError, CheckpointError):
            pass
    dist.barrier()  # every probe written before anyone looks
    blind = wrote and not probes <= set(storage.list())
    separate = bool(dist.max_of([int(blind)])[0])  # also: all have looked before any probe goes
    if wrote:
        storage.delete(mine)
    return separate


def memory_job(directory: Any, storage: CheckpointStorage, per_node: bool) -> str:
    """The memory-tier namespace of the run in ``directory``, the same on every rank:
    from its absolute location and the run id kept in it (written at the first start).
    Another project's directory of the same relative name, or this one deleted to start
    over, has another id: memory copies of an earlier run are never restored into a new
    one. With node-local directories every node's first rank reads its own copy of the
    id and a node that lacks it (a replaced one) is given the others': which machine
    rank 0 lands on does not change the namespace."""
    where = str(directory) if is_url(directory) else os.path.abspath(directory)
    keeper = keeps_local(per_node)
    found = read_run_id(storage) if keeper else None
    every = dist.gather_json(found)  # once per manager: an id (32 characters) per rank
    chosen = None
    if every is not None:  # rank 0: its own id, else any node's, else a new one
        chosen = next((i for i in every if i), None) or uuid.uuid4().hex
    chosen = dist.broadcast_json(chosen)
    if keeper and found != chosen:
        write_run_id(storage, chosen)
    return "job-" + hashlib.sha256(f"{where}\n{chosen}".encode()).hexdigest()[:16]


def read_run_id(storage: CheckpointStorage) -> str | None:
    try:
        raw = storage.read_small(RUN_ID_NAME, 1024)
    except (OSError, CheckpointError):
        return None  # written (or warned about) by the caller
    return None if raw is None else raw.decode(errors="replace")


def write_run_id(storage: CheckpointStorage, run_id: str) -> None:
    """Best effort (a read-only mount): with a warning, the memory tier then cannot
    tell this run from a later one in the same directory."""
    try:
        storage.write_small_durably(RUN_ID_NAME, run_id.encode())
    except (OSError, CheckpointError) as exc:
        warnings.warn(
            f"{storage.location(RUN_ID_NAME)}: cannot write the run id ({exc}); the memory "
            "tier cannot tell this run from a later one in the same directory",
            stacklevel=4,
        )
