"""In-memory checkpoint tier: every rank's latest checkpoint in host shared memory,
with a copy on a buddy rank of another node.

Each rank saves its own state as a one-process checkpoint (DTensors as their local
shards) into a tmpfs directory, ``$SHARDPOINT_SHM_DIR`` (default
``/dev/shm/shardpoint``) / job / ``own`` / rank / step: it outlives a crashed process,
so a restart on the same node finds it. The files then go over ``torch.distributed``
to ``replicas`` buddy ranks on other nodes (rank + k * ranks_per_node), which keep them
under ``replica``. Every copy is an ordinary checkpoint: marker last, checksums on
every block, verified when loaded.

Survives: any process crash; the loss of one node per replica group (its ranks pull
their files back from buddies). Does not survive: losing a node together with all its
buddies, or every node (then the disk and remote tiers are used).
"""

from __future__ import annotations

import json
import mmap
import os
import shutil
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

from .. import dist
from ..background_save import Stager, lower_priority
from ..commit import Commit
from ..errors import (
    CheckpointError,
    CorruptCheckpointError,
    IncompleteCheckpointError,
    StateMismatchError,
)
from ..loading import load
from ..names import INDEX_NAME, MARKER_NAME, is_own_file, parse_step_dir, step_dir
from ..saving import DEFAULT_THREADS, SaveOptions, run_save
from ..staging import StagingPool
from ..storage import open_storage
from ..tree import flatten

DEFAULT_ROOT = "/dev/shm/shardpoint"
STALE_AFTER_SECONDS = 24 * 3600


class MemoryTier:
    """The newest checkpoints of this rank (and replicas of its buddies') in shared memory.

    ``job`` names the run (one namespace per job on a node); ``max_bytes`` bounds what
    one rank keeps (its own copy plus the replicas it holds): a save over budget is
    skipped with an error. Saves are asynchronous: the caller only stages. A copy
    becomes visible (own or replica) only once complete, marker last.
    ``close(release=True)`` frees the memory on a clean exit.
    """

    def __init__(
        self,
        job: str,
        *,
        root: str | os.PathLike[str] | None = None,
        replicas: int = 1,
        ranks_per_node: int | None = None,
        keep: int = 1,
        max_bytes: int | None = None,
        pool_bytes: int | None = None,
        nice: int = 19,
    ) -> None:
        self.base = Path(root or os.environ.get("SHARDPOINT_SHM_DIR", DEFAULT_ROOT)) / job
        self.rank, self.world = dist.rank(), dist.world_size()
        self.per_node = ranks_per_node or int(os.environ.get("LOCAL_WORLD_SIZE", self.world))
        nodes = max(self.world // max(self.per_node, 1), 1)
        self.replicas = min(replicas, nodes - 1)
        self.keep = keep
        self.max_bytes = max_bytes
        self.bytes_received = 0  # over torch.distributed by the last restore (for tests)
        self.nice = nice  # of the background thread (see AsyncSaver)
        # Staging memory of its own (``pool_bytes`` bounds it, as for AsyncSaver): a
        # memory save may run while a disk save is still writing from its pool.
        self._stager = Stager(StagingPool(pool_bytes), DEFAULT_THREADS, nice)
        self.group = dist.new_cpu_group()  # collective: every rank builds its tier
        self._thread: threading.Thread | None = None
        self._role: dict[str, Any] | None = None  # this rank's part of the agreed restore
        self._error: BaseException | None = None
        self.base.mkdir(parents=True, exist_ok=True)
        _remove_stale_jobs(self.base.parent, keep=self.base)

    # ---- layout ------------------------------------------------------------------------

    def own_dir(self, step: int, rank: int | None = None) -> Path:
        return self.base / "own" / f"rank{self.rank if rank is None else rank:05d}" / step_dir(step)

    def replica_dir(self, rank: int, step: int) -> Path:
        return self.base / "replica" / f"rank{rank:05d}" / step_dir(step)

    def buddies(self, rank: int) -> list[int]:
        return [(rank + k * self.per_node) % self.world for k in range(1, self.replicas + 1)]

    def _committed_steps(self, parent: Path) -> dict[int, dict[str, int]]:
        """step -> {file: size} of committed copies under ``parent``."""
        out: dict[int, dict[str, int]] = {}
        for d in parent.iterdir() if parent.is_dir() else []:
            step = parse_step_dir(d.name)
            if step is not None and Commit(open_storage(d)).is_committed():
                out[step] = {p.name: p.stat().st_size for p in d.iterdir()}
        return out

    # ---- save -----------------------------------------------------------------------------

    def save(
        self,
        step: int,
        state: Any,
        on_done: Callable[[float, BaseException | None], None] | None = None,
    ) -> float:
        """Collective: keep ``state`` in this node's memory and on the buddies'.

        Returns once the state is staged (the stall, in seconds): writing to shared
        memory and sending to the buddies happen on a background thread, on a process
        group of their own. ``on_done(seconds, error)`` runs there at the end. A failure
        is raised by ``wait()`` (the next save, a restore or ``close`` calls it).
        """
        self.wait()
        start = time.perf_counter()
        finish: Callable[[], Any] | None = None
        error = None
        try:
            self._check_budget(state, step)
            target = self.own_dir(step)
            if target.exists():
                shutil.rmtree(target)  # a crashed earlier attempt at this step
            options = SaveOptions(metadata=self._identity(step))
            with dist.solo():  # this rank's state as a checkpoint of its own
                staged = run_save(state, open_storage(target), options, self._stager)
            assert callable(staged)
            finish = staged
        except CheckpointError as exc:  # still joins the collectives, on the thread
            error = f"rank {self.rank}: {exc}"
        stall = time.perf_counter() - start
        self._thread = threading.Thread(
            target=self._persist,
            args=(step, finish, error, start, on_done),
            name="shardpoint-memory",
        )
        self._thread.start()
        return stall

    def wait(self, *, raise_error: bool = True) -> None:
        """Wait for the memory save in flight; raise its error once (``raise_error``)."""
        if self._thread is not None:
            self._thread.join()
            self._thread = None
        error, self._error = self._error, None
        if error is not None and raise_error:
            raise error

    def _persist(
        self,
        step: int,
        finish: Callable[[], Any] | None,
        error: str | None,
        start: float,
        on_done: Callable[[float, BaseException | None], None] | None,
    ) -> None:
        lower_priority(self.nice)
        failure: BaseException | None = None
        try:
            if finish is not None:
                try:
                    with dist.solo():
                        finish()
                except CheckpointError as exc:
                    error = f"rank {self.rank}: {exc}"
            self._send_to_buddies(step, error)
        except BaseException as exc:  # delivered by wait(), never lost
            failure = exc
        self._error = failure
        if on_done is not None:
            on_done(time.perf_counter() - start, failure)

    def _send_to_buddies(self, step: int, error: str | None) -> None:
        own = self.own_dir(step)
        files: dict[str, int] = {}
        if error is None:
            try:  # listed before the agreement: a rank that cannot must not leave it
                files = _files(own)
            except OSError as exc:
                error = f"rank {self.rank}: {exc}"
        failed = dist.first_error(error, self.group)
        if failed is not None:
            shutil.rmtree(own, ignore_errors=True)
            raise CheckpointError(f"memory tier save of step {step} failed: {failed}")
        for k in range(1, self.replicas + 1):
            to = (self.rank + k * self.per_node) % self.world
            frm = (self.rank - k * self.per_node) % self.world
            # Each rank learns the file list of the buddy it receives from alone: what
            # a rank receives per save does not grow with the ranks.
            theirs = self._swap_manifests(to, frm, files)
            replica = self._exchange(
                send=(to, own), recv=(frm, theirs, self.replica_dir(frm, step))
            )
            if replica is not None and error is None:
                error = f"rank {self.rank}: {replica}"
        # Every copy durable before anyone prunes; a replica that could not be written
        # fails the save on every rank, which then holds what it held before it.
        failed = dist.first_error(error, self.group)
        if failed is not None:
            shutil.rmtree(own, ignore_errors=True)
            for parent in self._replica_parents():
                shutil.rmtree(parent / step_dir(step), ignore_errors=True)
            raise CheckpointError(f"memory tier save of step {step} failed: {failed}")
        self._prune(step)

    def _swap_manifests(self, to: int, frm: int, files: dict[str, int]) -> dict[str, int]:
        """Send this rank's file list (name -> size) to ``to``; receive ``frm``'s."""
        payload = json.dumps(files).encode()
        size = torch.tensor([len(payload)], dtype=torch.int64)
        data = torch.frombuffer(bytearray(payload), dtype=torch.uint8)
        sends = [
            dist.isend_bytes(size, to, tag=0, group=self.group),
            dist.isend_bytes(data, to, tag=1, group=self.group),
        ]
        their_size = torch.zeros(1, dtype=torch.int64)
        dist.irecv_bytes(their_size, frm, tag=0, group=self.group).wait()
        buffer = torch.empty(int(their_size.item()), dtype=torch.uint8)
        dist.irecv_bytes(buffer, frm, tag=1, group=self.group).wait()
        for request in sends:
            request.wait()
        return {str(k): int(v) for k, v in json.loads(buffer.numpy().tobytes()).items()}

    def _check_budget(self, state: Any, step: int) -> None:
        """The copies held now stay until every rank's copies of the new step are in
        place: the peak is those plus the new own copy and replicas (a buddy holds the
        same local rank's share of the state, so about this rank's size each)."""
        if self.max_bytes is None:
            return
        own = sum(t.numel() * t.element_size() for t in flatten(state).tensors.values())
        held = sum(
            p.lstat().st_size
            for parent in [self.own_dir(step).parent, *self._replica_parents()]
            if parent.is_dir()
            for d in parent.iterdir()
            if d.name != step_dir(step)  # replaced by the new copy
            for p in d.rglob("*")
        )
        need = held + own * (1 + self.replicas)
        if need > self.max_bytes:
            raise CheckpointError(
                f"memory tier: {need} bytes ({held} held until the new copies are in place, "
                f"plus {own} for the own copy and each of {self.replicas} replicas) exceed "
                f"max_bytes={self.max_bytes}; raise it (about twice one step's copies) or "
                "lower replicas"
            )

    def _identity(self, step: int) -> dict[str, Any]:
        return {"memory_tier": {"rank": self.rank, "world_size": self.world, "step": step}}

    def _exchange(
        self,
        send: tuple[int, Path] | None,
        recv: tuple[int, dict[str, int], Path] | None,
    ) -> str | None:
        """Send one checkpoint's files to a rank and/or receive another's (marker last).
        Returns why the received copy could not be written (a full shared-memory file
        system), and leaves none of it: the caller's ranks agree on that, so one rank's
        failure never leaves the others waiting."""
        requests = []
        maps = []
        if send is not None:
            to, src = send
            for i, name in enumerate(_ordered(list(_files(src)))):
                data = _file_bytes(src / name, maps)  # mapped from tmpfs: no copy
                requests.append(dist.isend_bytes(data, to, tag=i, group=self.group))
        received: list[tuple[str, torch.Tensor, int]] = []
        if recv is not None:
            frm, files, _ = recv
            for i, name in enumerate(_ordered(list(files))):
                buf = torch.empty(max(files[name], 1), dtype=torch.uint8)
                received.append((name, buf, files[name]))
                requests.append(dist.irecv_bytes(buf, frm, tag=i, group=self.group))
        for r in requests:
            r.wait()
        maps.clear()
        if recv is None:
            return None
        target = recv[2]
        try:
            if target.exists():
                shutil.rmtree(target)
            target.mkdir(parents=True)
            for name, buf, size in received:  # _ordered puts index and marker last
                with open(target / name, "wb") as f:
                    f.write(memoryview(buf.numpy())[:size])
                self.bytes_received += size
        except OSError as exc:
            shutil.rmtree(target, ignore_errors=True)
            return (
                f"writing rank {recv[0]}'s copy to {target}: {exc}; free "
                "space there (or raise its size), or lower replicas"
            )
        return None

    def _prune(self, newest: int) -> None:
        for parent in [self.base / "own" / f"rank{self.rank:05d}", *self._replica_parents()]:
            steps = sorted(self._committed_steps(parent))
            for d in parent.iterdir() if parent.is_dir() else []:
                step = parse_step_dir(d.name)
                if step is not None and step not in steps[-self.keep :] and step <= newest:
                    shutil.rmtree(d, ignore_errors=True)

    def discard(self, passed_over: Callable[[int, float | None], bool]) -> list[int]:
        """Delete this rank's copies (own and held replicas) of the steps for which
        ``passed_over(step, committed_at)`` holds (a rollback went back past them);
        returns their steps. Not collective: each rank looks at its own."""
        self.wait(raise_error=False)
        gone = set()
        for parent in [self.base / "own" / f"rank{self.rank:05d}", *self._replica_parents()]:
            for step in self._committed_steps(parent):
                d = parent / step_dir(step)
                if passed_over(step, Commit(open_storage(d)).committed_at()):
                    shutil.rmtree(d, ignore_errors=True)
                    gone.add(step)
        return sorted(gone)

    def _replica_parents(self) -> list[Path]:
        """The replica directories this rank holds (other ranks of the node hold others)."""
        held = [(self.rank - k * self.per_node) % self.world for k in range(1, self.replicas + 1)]
        return [self.base / "replica" / f"rank{r:05d}" for r in held]

    # ---- restore ------------------------------------------------------------------------------

    def newest_step(self) -> int | None:
        """Collective: the newest step every rank can recover from memory (own or a buddy's).
        A save in flight finishes first; one that failed is simply not a candidate.

        Rank 0 gathers every rank's holdings, picks the step and who sends whom a copy,
        and sends each rank its own part of that plan: only rank 0 receives anything
        that grows with the number of ranks."""
        self.wait(raise_error=False)
        holdings = dist.gather_json(self._holdings(), 0, self.group)
        plan = None if holdings is None else (lambda: _restore_roles(holdings, self.world))
        self._role = None  # until every rank has its part of this plan
        self._role = dist.scatter_plan(plan, 0, self.group)
        return self._role["step"]

    def restore(self, state: Any, step: int) -> None:
        """Collective: load ``step`` (the one ``newest_step`` agreed on) from memory; ranks
        without their own copy receive it from a buddy first. Raises (on every rank) if
        any rank cannot load it."""
        if self._role is None or self._role["step"] != step:
            raise ValueError(
                f"memory tier: restore({step}) needs newest_step() to have agreed on that "
                "step first (every rank calls newest_step, then restore)"
            )
        self.bytes_received = 0
        # This rank's transfers, in the order of the whole job's list: a rank waits for
        # each of its transfers in turn, and every partner reaches it in the same order.
        error = None
        for kind, other, files in self._role["transfers"]:
            if kind == "send":
                self._exchange(send=(other, self.replica_dir(other, step)), recv=None)
            else:
                error = self._exchange(send=None, recv=(other, files, self.own_dir(step))) or error
        mine: BaseException | None = None
        kind = 0  # the copy cannot be used; 1: another error, 2: the state does not fit
        try:
            if error is not None:
                raise CorruptCheckpointError(error)
            # Whose copy it is is checked first: another rank's state never lands in ours.
            meta = load_identity(self.own_dir(step))
            if meta != self._identity(step)["memory_tier"]:
                raise CorruptCheckpointError(f"{self.own_dir(step)}: belongs to {meta}")
            with dist.solo():
                load(state, self.own_dir(step))
        except (CorruptCheckpointError, IncompleteCheckpointError) as exc:
            mine = exc
        except StateMismatchError as exc:
            mine, kind = exc, 2
        except Exception as exc:  # raised on every rank, none left in the agreement
            mine, kind = exc, 1
        error = None if mine is None else f"rank {self.rank}: {type(mine).__name__}: {mine}"
        worst, failed = dist.worst_error(error, kind)
        if worst > 0:
            if kind == worst:
                raise mine  # type: ignore[misc]
            cls = StateMismatchError if worst == 2 else CheckpointError
            raise cls(f"another rank could not load memory tier step {step}: {failed}")
        if failed is not None:
            raise CorruptCheckpointError(f"memory tier step {step} is not usable: {failed}")

    def _holdings(self) -> dict[str, Any]:
        own = self._committed_steps(self.base / "own" / f"rank{self.rank:05d}")
        held = {
            str(int(p.name[4:])): {str(s): f for s, f in self._committed_steps(p).items()}
            for p in self._replica_parents()
        }
        return {"own": sorted(own), "held": held}

    def close(self, *, release: bool = False) -> None:
        """Finish the save in flight (raising its error); ``release=True`` (a clean end
        of training) frees this rank's memory."""
        self.wait()
        if release:
            shutil.rmtree(self.base / "own" / f"rank{self.rank:05d}", ignore_errors=True)
            for parent in self._replica_parents():
                shutil.rmtree(parent, ignore_errors=True)


def _file_bytes(path: Path, keep: list[Any]) -> torch.Tensor:
    """A file's bytes as a uint8 tensor (at least one byte: gloo sends no empty buffers)."""
    size = path.stat().st_size
    if size == 0:
        return torch.zeros(1, dtype=torch.uint8)
    with open(path, "rb") as f:
        mapped = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_COPY)
    keep.append(mapped)
    return torch.frombuffer(mapped, dtype=torch.uint8)


def load_identity(path: Path) -> dict[str, Any]:
    from ..reader import CheckpointReader

    with CheckpointReader(path) as r:
        return dict(r.metadata["user"].get("memory_tier", {}))


def _restore_roles(holdings: list[dict[str, Any]], world: int) -> list[dict[str, Any]]:
    """Rank 0's plan from every rank's holdings: per rank, the newest step every rank can
    recover (None: none) and its part of the transfers, in the job's order: ["send",
    owner, None] or ["receive", holder, {file: size}]. A rank's own copy comes first,
    else the lowest-ranked buddy's."""
    own = [set(h["own"]) for h in holdings]
    replica: dict[tuple[int, int], int] = {}  # (owner, step) -> holder
    for holder, h in enumerate(holdings):
        for owner, steps in h["held"].items():
            for step in steps:
                replica.setdefault((int(owner), int(step)), holder)

    def source(rank: int, step: int) -> int | None:
        return rank if step in own[rank] else replica.get((rank, step))

    newest = next(
        (
            step
            for step in sorted(set().union(*own), reverse=True)
            if all(source(rank, step) is not None for rank in range(world))
        ),
        None,
    )
    roles: list[dict[str, Any]] = [{"step": newest, "transfers": []} for _ in range(world)]
    for owner in range(world) if newest is not None else ():
        holder = source(owner, newest)
        if holder != owner:
            files = holdings[holder]["held"][str(owner)][str(newest)]
            roles[holder]["transfers"].append(["send", owner, None])
            roles[owner]["transfers"].append(["receive", holder, files])
    return roles


def _files(d: Path) -> dict[str, int]:
    return {p.name: p.stat().st_size for p in d.iterdir() if is_own_file(p.name)}


def _ordered(names: list[str]) -> list[str]:
    """Shards first, then the index, then the marker: a copy is committed last."""
    return sorted(names, key=lambda n: (n == MARKER_NAME, n == INDEX_NAME, n))


def _remove_stale_jobs(root: Path, keep: Path) -> None:
    """Free the memory of jobs on this node untouched for a day (dead runs)."""
    now = time.time()
    for job in root.iterdir() if root.is_dir() else []:
        try:
            if job == keep or not job.is_dir():
                continue
            newest = max((p.lstat().st_mtime for p in job.rglob("*")), default=job.stat().st_mtime)
        except FileNotFoundError:  # another rank of this node is removing it right now
            continue
        if now - newest > STALE_AFTER_SECONDS:
            shutil.rmtree(job, ignore_errors=True)
