"""In-memory checkpoint tier: every rank's latest checkpoint in host shared memory,
protected against node losses by copies on buddy ranks of other nodes or by parity.

Each rank saves its own state as a one-process checkpoint (DTensors as their local
shards) into a tmpfs directory, ``$SHARDPOINT_SHM_DIR`` (default
``/dev/shm/shardpoint``) / job / ``own`` / rank / step: it outlives a crashed process,
so a restart on the same node finds it. The files then go over ``torch.distributed``
to the buddy ranks of ``Replicas(n)`` on other nodes (rank + k * ranks_per_node), which
keep them under ``replica``; or, with ``ErasureCode(data, parity)``, pieces of them go to
the ranks of the parity group (``erasure.Placement``) that keep parity under ``parity``.
Every copy is an ordinary checkpoint: marker last, checksums on every block, verified
when loaded; every parity piece and every data piece it was made from has a checksum
in the holder's manifest, checked before a rebuild uses it (``parity.py``). The own
copy is committed by the save pipeline (``Commit``); a replica is the sender's files
byte for byte, marker included, written from the buffers they arrived in, so the tier
writes them in commit order itself (marker last) instead of making a new marker.

Survives: any process crash; the loss of ``n`` nodes per replica group (its ranks pull
their files back from buddies), or of ``parity`` nodes per parity group (its ranks
rebuild their files from the survivors' pieces). Does not survive more losses than
that, or every node (then the disk and remote tiers are used).
"""

from __future__ import annotations

import mmap
import os
import shutil
import socket
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import torch

from .. import dist
from ..background_save import Stager, lower_priority
from ..commit import Commit
from ..defaults import DEFAULT_THREADS
from ..errors import (
    CheckpointError,
    CorruptCheckpointError,
    IncompleteCheckpointError,
    StateMismatchError,
)
from ..loading import load
from ..names import (
    REBUILD_PREFIX,
    commit_order,
    memory_slot,
    parse_rank_dir,
    parse_step_dir,
    step_dir,
)
from ..save_records import SaveOptions
from ..saving import run_save
from ..staging import StagingPool
from ..storage import open_storage
from ..tree import flatten
from .erasure import Codec, Placement, placement
from .memory_restore_plan import restore_roles
from .options import ErasureCode, Replicas
from .parity import (
    PARITY_MANIFEST,
    Rebuild,
    copy_files,
    digest,
    read_manifest,
    read_piece,
    send_parity,
)

DEFAULT_ROOT = "/dev/shm/shardpoint"
STALE_AFTER_SECONDS = 24 * 3600
ONE_REPLICA = Replicas(1)


class MemoryTier:
    """The newest checkpoints of this rank (and replicas of its buddies') in shared memory.

    ``job`` names the run (one namespace per job on a node); ``redundancy`` protects the
    copies against node losses (``Replicas(n)`` or ``ErasureCode(data, parity)``);
    ``max_bytes`` bounds what one rank keeps (its own copy plus the replicas or parity
    it holds): a save over budget is skipped with an error. Saves are asynchronous: the
    caller only stages. A copy becomes visible (own, replica or parity) only once
    complete, marker (or parity manifest) last.
    ``close(release=True)`` frees the memory on a clean exit.
    """

    def __init__(
        self,
        job: str,
        *,
        root: str | os.PathLike[str] | None = None,
        redundancy: Replicas | ErasureCode = ONE_REPLICA,
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
        self.placement: Placement | None = None
        self.replicas = 0
        if isinstance(redundancy, ErasureCode):
            self.placement = placement(
                self.rank, self.world, self.per_node, redundancy.data, redundancy.parity
            )
            Codec(self.placement.k, self.placement.m).check()  # every rank alike, at start
        else:
            self.replicas = min(redundancy.copies, nodes - 1)
        self.keep = keep
        self.max_bytes = max_bytes
        self.bytes_received = 0  # over torch.distributed by the last restore (for tests)
        self.rebuilt = False  # whether the last restore rebuilt this rank's copy from parity
        # On rank 0, after a restore: which ranks rebuilt their copy, which got a buddy's.
        self.restored_how: dict[str, list[int]] = {}
        # On rank 0, after newest_step found none: the newest step held and whose copies
        # of it no rank can give or rebuild ({"step", "ranks"}).
        self.lost: dict[str, Any] | None = None
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
        self.mates = self._find_mates()

    def _find_mates(self) -> list[int]:
        """Collective: the ranks that use this rank's shared-memory directory (its node's),
        found from the directory itself, not from LOCAL_WORLD_SIZE: a copy there belongs
        to one of them, or to a rank that moved to another node (an orphan)."""
        where = self.base.stat()
        key = f"{socket.gethostname()}:{where.st_dev}:{where.st_ino}"
        keys = dist.gather_json(key, 0, self.group)
        parts = (
            None
            if keys is None
            else [[r for r, k in enumerate(keys) if k == mine] for mine in keys]
        )
        return dist.scatter_json(parts, 0, self.group)

    # ---- layout ------------------------------------------------------------------------

    def own_dir(self, step: int, rank: int | None = None) -> Path:
        return self.base / memory_slot("own", self.rank if rank is None else rank) / step_dir(step)

    def replica_dir(self, rank: int, step: int) -> Path:
        return self.base / memory_slot("replica", rank) / step_dir(step)

    def parity_dir(self, step: int, rank: int | None = None) -> Path:
        return (
            self.base / memory_slot("parity", self.rank if rank is None else rank) / step_dir(step)
        )

    def _committed_steps(self, parent: Path) -> dict[int, dict[str, int]]:
        """step -> {file: size} of committed copies (or parity copies) under ``parent``."""
        out: dict[int, dict[str, int]] = {}
        for d in parent.iterdir() if parent.is_dir() else []:
            step = parse_step_dir(d.name)
            if step is not None and (
                (d / PARITY_MANIFEST).is_file() or Commit(open_storage(d)).is_committed()
            ):
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
                files = copy_files(own)
            except OSError as exc:
                error = f"rank {self.rank}: {exc}"
        failed = dist.first_error(error, self.group)
        if failed is not None:
            shutil.rmtree(own, ignore_errors=True)
            raise CheckpointError(f"memory tier save of step {step} failed: {failed}")
        if self.placement is not None:
            pl = self.placement
            others = [r for r in pl.members if r != self.rank]
            theirs = iter(self._swap_manifests(others, files, others))
            manifests = [files if r == self.rank else next(theirs) for r in pl.members]
            target = self.parity_dir(step)
            unwritten = send_parity(pl, self.rank, self.group, step, own, manifests, target)
            if unwritten is not None:
                error = f"rank {self.rank}: {unwritten}"
        for k in range(1, self.replicas + 1):
            to = (self.rank + k * self.per_node) % self.world
            frm = (self.rank - k * self.per_node) % self.world
            # Each rank learns the file list of the buddy it receives from alone: what
            # a rank receives per save does not grow with the ranks.
            theirs = self._swap_manifests([to], files, [frm])[0]
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
            for parent in self._held_parents():
                shutil.rmtree(parent / step_dir(step), ignore_errors=True)
            raise CheckpointError(f"memory tier save of step {step} failed: {failed}")
        self._prune(step)

    def _swap_manifests(
        self, to: list[int], files: dict[str, int], frm: list[int]
    ) -> list[dict[str, int]]:
        """Send this rank's file list (name -> size) to the ranks ``to``; receive those
        of the ranks ``frm``, in that order."""
        theirs = dist.swap_json(files, to, frm, self.group)
        return [{str(k): int(v) for k, v in got.items()} for got in theirs]

    def _check_budget(self, state: Any, step: int) -> None:
        """The copies held now stay until every rank's copies of the new step are in
        place: the peak is those plus the new own copy and replicas (a buddy holds the
        same local rank's share of the state, so about this rank's size each)."""
        if self.max_bytes is None:
            return
        own = sum(t.numel() * t.element_size() for t in flatten(state).tensors.values())
        held = sum(
            p.lstat().st_size
            for parent in [self.own_dir(step).parent, *self._held_parents()]
            if parent.is_dir()
            for d in parent.iterdir()
            if d.name != step_dir(step)  # replaced by the new copy
            for p in d.rglob("*")
        )
        pl = self.placement
        share = self.replicas if pl is None else pl.m / pl.k  # of a copy, held for others
        need = held + int(own * (1 + share))
        if need > self.max_bytes:
            raise CheckpointError(
                f"memory tier: {need} bytes ({held} held until the new copies are in place, "
                f"plus {own} for the own copy and {share:g} of it for the other ranks' "
                f"redundancy) exceed max_bytes={self.max_bytes}; raise it (about twice one "
                "step's copies) or lower the redundancy"
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
            for i, name in enumerate(commit_order(list(copy_files(src)))):
                data = _file_bytes(src / name, maps)  # mapped from tmpfs: no copy
                requests.append(dist.isend_bytes(data, to, tag=i, group=self.group))
        received: list[tuple[str, torch.Tensor, int]] = []
        if recv is not None:
            frm, files, _ = recv
            for i, name in enumerate(commit_order(list(files))):
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
            for name, buf, size in received:  # commit_order puts index and marker last
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
        mine = [self.base / memory_slot("own", self.rank), *self._held_parents()]
        for _, parent in self._slot_dirs():
            if parent not in mine:  # another rank's, left in this slot before ranks moved
                shutil.rmtree(parent, ignore_errors=True)
        for leftover in mine[0].glob(f"{REBUILD_PREFIX}*"):  # a rebuild killed before it finished
            shutil.rmtree(leftover, ignore_errors=True)
        for parent in mine:
            steps = sorted(self._committed_steps(parent))
            for d in parent.iterdir() if parent.is_dir() else []:
                step = parse_step_dir(d.name)
                if step is not None and step not in steps[-self.keep :] and step <= newest:
                    shutil.rmtree(d, ignore_errors=True)

    def discard(self, passed_over: Callable[[int, float | None], bool]) -> list[int]:
        """Delete the copies this rank's slot of the node keeps (own, replicas, parity) of
        the steps for which ``passed_over(step, committed_at)`` holds (a rollback went
        back past them); returns their steps. Not collective: each rank looks at its own."""
        self.wait(raise_error=False)
        gone = set()
        for _, parent in self._slot_dirs():
            for step in self._committed_steps(parent):
                d = parent / step_dir(step)
                manifest = d / PARITY_MANIFEST
                at = manifest.stat().st_mtime if manifest.is_file() else None
                if passed_over(step, at or Commit(open_storage(d)).committed_at()):
                    shutil.rmtree(d, ignore_errors=True)
                    gone.add(step)
        return sorted(gone)

    def _replica_parents(self) -> list[Path]:
        """The replica directories this rank holds (other ranks of the node hold others)."""
        return [self.base / memory_slot("replica", r) for r in sorted(self._held_by(self.rank))]

    def _held_parents(self) -> list[Path]:
        """Every directory of what this rank holds for others: replicas, or its parity."""
        if self.placement is None:
            return self._replica_parents()
        return [self.base / memory_slot("parity", self.rank)]

    # ---- restore ------------------------------------------------------------------------------

    def newest_step(self) -> int | None:
        """Collective: the newest step every rank can recover from memory (own or a buddy's).
        A save in flight finishes first; one that failed is simply not a candidate.

        Rank 0 gathers every rank's holdings, picks the step and who sends whom a copy,
        and sends each rank its own part of that plan: only rank 0 receives anything
        that grows with the number of ranks."""
        self.wait(raise_error=False)
        holdings = dist.gather_json(self._holdings(), 0, self.group)
        plan = None if holdings is None else (lambda: restore_roles(holdings, self.world))
        self._role = None  # until every rank has its part of this plan
        self._role = dist.scatter_plan(plan, 0, self.group)
        self.lost = self._role.get("lost")
        return self._role["step"]

    def restore(self, state: Any, step: int, *, undo_pool: StagingPool | None = None) -> None:
        """Collective: load ``step`` (the one ``newest_step`` agreed on) from memory; ranks
        without their own copy receive it from a buddy, or rebuild it from their parity
        group's pieces (``rebuilt``), first. Raises (on every rank) if
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
        spec = self._role.get("rebuild")
        rebuild = None if spec is None else Rebuild(self.own_dir(step), spec)
        self.rebuilt = rebuild is not None
        self.restored_how = {
            how: self._role.get(how, []) for how in ("ranks_from_buddies", "ranks_rebuilt")
        }
        partial: torch.Tensor | None = None  # an XOR sum on its way to a rebuilding rank
        for kind, other, detail in self._role["transfers"]:
            if kind == "send":
                whose = detail["whose"]
                src = self.own_dir(step, whose) if detail["own"] else self.replica_dir(whose, step)
                self._exchange(send=(other, src), recv=None)
            elif kind == "receive":
                error = self._exchange(send=None, recv=(other, detail, self.own_dir(step))) or error
            elif kind == "send_piece":
                dist.isend_bytes(self._piece(step, detail), other, 0, self.group).wait()
            elif kind == "local_piece":
                assert rebuild is not None
                rebuild.add(detail[1], self._piece(step, detail[0]).numpy())
            elif kind == "adopt":
                try:
                    if self.own_dir(step).exists():
                        shutil.rmtree(self.own_dir(step))
                    self.own_dir(step).parent.mkdir(parents=True, exist_ok=True)
                    os.rename(self.replica_dir(self.rank, step), self.own_dir(step))
                except OSError as exc:
                    error = f"rank {self.rank}: taking its replica as its copy: {exc}"
            elif kind == "chain_receive":
                partial = torch.empty(detail["chunk_bytes"], dtype=torch.uint8)
                dist.irecv_bytes(partial, other, 0, self.group).wait()
            elif kind == "chain_send":
                piece = self._piece(step, detail)
                if digest(piece.numpy()) != detail["hash"] and error is None:
                    error = (
                        f"rank {self.rank}: its piece of codeword {detail['codeword']} for "
                        f"rank {other}'s rebuild does not match its checksum (a corrupt copy "
                        "or parity)"
                    )
                if partial is not None:  # sent on even when corrupt: nobody waits forever
                    piece.numpy().view(np.uint64)[:] ^= partial.numpy().view(np.uint64)
                dist.isend_bytes(piece, other, 0, self.group).wait()
                partial = None
            else:
                assert rebuild is not None
                piece = torch.empty(rebuild.chunk_bytes, dtype=torch.uint8)
                dist.irecv_bytes(piece, other, 0, self.group).wait()
                self.bytes_received += piece.numel()
                rebuild.add(detail, piece.numpy())
        # A corrupt piece found anywhere (an XOR sum's holder checks its own) stops every
        # rebuild before its copy is written: one agreement, on every rank.
        failed = dist.first_error(error, self.group)
        if failed is not None:
            if rebuild is not None:
                rebuild.abandon()
            raise CorruptCheckpointError(f"memory tier step {step} is not usable: {failed}")
        if rebuild is not None:
            error = rebuild.finish()
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
                load(state, self.own_dir(step), undo_pool=undo_pool)
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

    def _piece(self, step: int, detail: dict[str, Any]) -> torch.Tensor:
        whose = detail["whose"]
        return read_piece(detail, self.own_dir(step, whose), self.parity_dir(step, whose))

    def _holdings(self) -> dict[str, Any]:
        """What this rank's slot of the node holds, by whose it is: {"own": {rank: {step:
        files}}, "held": {rank: {step: files}}, "parity": {holder: {step: manifest}}}.
        By slot, not by this rank: a restarted job may give this node's slot another
        rank (torchrun orders nodes as they join), whose copies are then sent to it."""
        out: dict[str, dict[str, Any]] = {"own": {}, "held": {}, "parity": {}}
        for kind, parent in self._slot_dirs():
            whose = str(parse_rank_dir(parent.name))
            steps = self._committed_steps(parent)
            if kind != "parity":
                out[kind][whose] = {str(s): f for s, f in steps.items()}
                continue
            for step in steps:
                try:
                    manifest = read_manifest(parent / step_dir(step))
                except (OSError, ValueError):  # unreadable: not offered
                    continue
                out["parity"].setdefault(whose, {})[str(step)] = manifest
        return out

    def _slot_dirs(self) -> list[tuple[str, Path]]:
        """("own" | "held" | "parity", directory) of the copies this rank keeps in its
        node's memory: its own, the replicas and parity it holds, and, on the node's
        lowest rank, the orphans: copies of ranks no longer on this node (a restarted
        job may number the nodes anew: torchrun orders them as they join), offered to
        their owners by a restore and removed after the next memory save."""

        def keeper(kind: str, whose: int) -> int | None:
            if kind != "held":  # own/rankR and parity/rankR are kept by rank R
                return whose if whose in self.mates else None
            return next((m for m in self.mates if whose in self._held_by(m)), None)

        out = []
        for kind, sub in (("own", "own"), ("held", "replica"), ("parity", "parity")):
            for d in sorted((self.base / sub).iterdir()) if (self.base / sub).is_dir() else []:
                whose = parse_rank_dir(d.name)
                if whose is None:
                    continue
                kept_by = keeper(kind, whose)
                if kept_by == self.rank or (kept_by is None and self.rank == min(self.mates)):
                    out.append((kind, d))
        return out

    def _held_by(self, rank: int) -> set[int]:
        """Whose replicas ``rank`` holds."""
        return {(rank - k * self.per_node) % self.world for k in range(1, self.replicas + 1)}

    def close(self, *, release: bool = False) -> None:
        """Finish the save in flight (raising its error); ``release=True`` (a clean end
        of training) frees this rank's memory."""
        self.wait()
        if release:
            for _, parent in self._slot_dirs():
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
