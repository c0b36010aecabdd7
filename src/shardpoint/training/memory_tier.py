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
in the holder's manifest, checked before a rebuild uses it.

Survives: any process crash; the loss of ``n`` nodes per replica group (its ranks pull
their files back from buddies), or of ``parity`` nodes per parity group (its ranks
rebuild their files from the survivors' pieces). Does not survive more losses than
that, or every node (then the disk and remote tiers are used).
"""

from __future__ import annotations

import json
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
import xxhash

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
from .erasure import Codec, Placement, placement
from .options import ErasureCode, Replicas

DEFAULT_ROOT = "/dev/shm/shardpoint"
STALE_AFTER_SECONDS = 24 * 3600
ONE_REPLICA = Replicas(1)
PARITY_MANIFEST = "parity.json"  # written last: a parity copy without it is not used


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
        return self.base / "own" / f"rank{self.rank if rank is None else rank:05d}" / step_dir(step)

    def replica_dir(self, rank: int, step: int) -> Path:
        return self.base / "replica" / f"rank{rank:05d}" / step_dir(step)

    def parity_dir(self, step: int) -> Path:
        return self.base / "parity" / f"rank{self.rank:05d}" / step_dir(step)

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
                files = _files(own)
            except OSError as exc:
                error = f"rank {self.rank}: {exc}"
        failed = dist.first_error(error, self.group)
        if failed is not None:
            shutil.rmtree(own, ignore_errors=True)
            raise CheckpointError(f"memory tier save of step {step} failed: {failed}")
        if self.placement is not None:
            unwritten = self._send_parity(step, files)
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
        payload = json.dumps(files).encode()
        size = torch.tensor([len(payload)], dtype=torch.int64)
        data = torch.frombuffer(bytearray(payload), dtype=torch.uint8)
        sends = []
        for rank in to:
            sends.append(dist.isend_bytes(size, rank, tag=0, group=self.group))
            sends.append(dist.isend_bytes(data, rank, tag=1, group=self.group))
        theirs = []
        for rank in frm:
            their_size = torch.zeros(1, dtype=torch.int64)
            dist.irecv_bytes(their_size, rank, tag=0, group=self.group).wait()
            buffer = torch.empty(int(their_size.item()), dtype=torch.uint8)
            dist.irecv_bytes(buffer, rank, tag=1, group=self.group).wait()
            got = json.loads(buffer.numpy().tobytes())
            theirs.append({str(k): int(v) for k, v in got.items()})
        for request in sends:
            request.wait()
        return theirs

    def _send_parity(self, step: int, files: dict[str, int]) -> str | None:
        """Collective in the parity group: one codeword at a time, its data members send
        their chunk of their copy to its parity holders, which compute and keep their
        parity piece with the checksums of every piece, manifest last. Returns why this
        rank could not keep its parity (it still takes part in every codeword, so that
        the others never wait for it)."""
        pl = self.placement
        assert pl is not None
        me = pl.position(self.rank)
        others = [r for r in pl.members if r != self.rank]
        theirs = iter(self._swap_manifests(others, files, others))
        manifests = [files if r == self.rank else next(theirs) for r in pl.members]
        size = pl.chunk_bytes([sum(f.values()) for f in manifests])
        codec = Codec(pl.k, pl.m)
        target = self.parity_dir(step)
        error = None
        try:
            if target.exists():
                shutil.rmtree(target)  # a crashed earlier attempt at this step
            target.mkdir(parents=True)
        except OSError as exc:
            error = f"making {target}: {exc}"
        codewords: dict[str, dict[str, Any]] = {}
        for j in range(len(pl.members)):
            requests = []
            if me in pl.data(j):
                chunk = torch.from_numpy(
                    _read_stream(self.own_dir(step), files, pl.chunks(me).index(j), size)
                )
                for holder in pl.holders(j):
                    requests.append(dist.isend_bytes(chunk, pl.members[holder], j, self.group))
            pieces: list[torch.Tensor] = []
            if me in pl.holders(j):
                for p in pl.data(j):
                    pieces.append(torch.empty(size, dtype=torch.uint8))
                    requests.append(dist.irecv_bytes(pieces[-1], pl.members[p], j, self.group))
            for request in requests:
                request.wait()
            if not pieces or error is not None:
                continue
            t = pl.holders(j).index(me)
            data = [piece.numpy() for piece in pieces]
            try:
                parity = codec.encode(data)[t]
            except Exception as exc:  # noqa: BLE001 - the others must not wait for this rank
                error = f"encoding codeword {j}: {type(exc).__name__}: {exc}"
                continue
            codewords[str(j)] = {
                "piece": pl.k + t,
                "data_hashes": [_digest(d) for d in data],
                "parity_hash": _digest(parity),
            }
            try:
                parity.tofile(target / f"codeword{j}.bin")
            except OSError as exc:
                error = f"writing parity to {target}: {exc}"
        if error is None:
            manifest = {
                "step": step,
                "members": list(pl.members),
                "parity": pl.m,
                "chunk_bytes": size,
                "files": manifests,
                "codewords": codewords,
            }
            try:
                write_manifest(target, manifest)
            except OSError as exc:
                error = f"writing {target / PARITY_MANIFEST}: {exc}"
        if error is not None:
            shutil.rmtree(target, ignore_errors=True)
            return f"{error}; free space there (or raise its size), or lower parity"
        return None

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
        mine = [self.base / "own" / f"rank{self.rank:05d}", *self._held_parents()]
        for _, parent in self._slot_dirs():
            if parent not in mine:  # another rank's, left in this slot before ranks moved
                shutil.rmtree(parent, ignore_errors=True)
        for leftover in mine[0].glob(".rebuild-*"):  # a rebuild killed before it finished
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
        return [self.base / "replica" / f"rank{r:05d}" for r in sorted(self._held_by(self.rank))]

    def _held_parents(self) -> list[Path]:
        """Every directory of what this rank holds for others: replicas, or its parity."""
        if self.placement is None:
            return self._replica_parents()
        return [self.base / "parity" / f"rank{self.rank:05d}"]

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
        self.lost = self._role.get("lost")
        return self._role["step"]

    def restore(self, state: Any, step: int) -> None:
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
        rebuild = None if spec is None else _Rebuild(self.own_dir(step), spec)
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
                if _digest(piece.numpy()) != detail["hash"] and error is None:
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

    def _piece(self, step: int, detail: dict[str, Any]) -> torch.Tensor:
        """A piece a rebuild asked for: a chunk of this rank's copy, or its parity of a
        codeword, as kept (the rebuilding rank checks it against the checksums)."""
        piece = np.zeros(detail["chunk_bytes"], dtype=np.uint8)
        try:
            if detail["kind"] == "data":
                own = self.own_dir(step, detail["whose"])
                piece = _read_stream(own, _files(own), detail["chunk"], detail["chunk_bytes"])
            else:
                parent = self.base / "parity" / f"rank{detail['whose']:05d}"
                path = parent / step_dir(step) / f"codeword{detail['codeword']}.bin"
                with open(path, "rb") as f:
                    f.readinto(memoryview(piece))
        except OSError:  # sent anyway (zeros fail the checksum): the receiver must not wait
            pass
        return torch.from_numpy(piece)

    def _holdings(self) -> dict[str, Any]:
        """What this rank's slot of the node holds, by whose it is: {"own": {rank: {step:
        files}}, "held": {rank: {step: files}}, "parity": {holder: {step: manifest}}}.
        By slot, not by this rank: a restarted job may give this node's slot another
        rank (torchrun orders nodes as they join), whose copies are then sent to it."""
        out: dict[str, dict[str, Any]] = {"own": {}, "held": {}, "parity": {}}
        for kind, parent in self._slot_dirs():
            whose = parent.name[4:]
            steps = self._committed_steps(parent)
            if kind != "parity":
                out[kind][whose] = {str(s): f for s, f in steps.items()}
                continue
            for step in steps:
                try:
                    manifest = json.loads((parent / step_dir(step) / PARITY_MANIFEST).read_bytes())
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
                if not d.name.startswith("rank") or not d.name[4:].isdigit():
                    continue
                kept_by = keeper(kind, int(d.name[4:]))
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


def _restore_roles(holdings: list[dict[str, Any]], world: int) -> list[dict[str, Any]]:
    """Rank 0's plan from every rank's holdings: per rank, the newest step every rank can
    recover (None: none) and its part of the transfers, in the job's order: ["send",
    owner, {"whose", "own"}] or ["receive", holder, {file: size}] for copies kept on
    another node (a buddy's replica, or an own copy a restart left in a slot now given
    to another rank), ["send_piece",
    rebuilder, what] or ["receive_piece", sender, which] for parity (with "rebuild": how
    the pieces make the rank's copy). A rank's own copy comes first, else the
    lowest-ranked buddy's, else a rebuild from its parity group."""
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


class _Rebuild:
    """A rank's copy rebuilt from its parity group's pieces: each piece is checked against
    the checksum its holder recorded before it is used, each codeword decoded once its
    ``k`` pieces are in, and the files written under a temporary name that becomes the
    copy only once every chunk is in place (never half a copy where a restore looks)."""

    def __init__(self, target: Path, spec: dict[str, Any]) -> None:
        self.target, self.files = target, spec["files"]
        self.chunk_bytes = spec["chunk_bytes"]
        self.codec = Codec(spec["data"], spec["parity"])
        self.wanted = {j: (c, want) for c, (j, want) in enumerate(spec["chunks"])}
        self.pieces: dict[int, dict[int, np.ndarray]] = {}
        self.error: str | None = None
        self.partial = target.parent / f".rebuild-{target.name}"
        try:
            shutil.rmtree(self.partial, ignore_errors=True)
            self.partial.mkdir(parents=True)
            for name, size in self.files.items():
                with open(self.partial / name, "wb") as f:
                    f.truncate(size)
        except OSError as exc:
            self.error = f"rebuilding {target}: {exc}"

    def add(self, which: dict[str, Any], piece: np.ndarray) -> None:
        j = which["codeword"]
        if self.error is not None:
            return
        if which["index"] != "sum" and _digest(piece) != which["hash"]:
            self.error = (
                f"rebuilding {self.target}: piece {which['index']} of codeword {j} from rank "
                f"{which['from']} does not match its checksum (a corrupt copy or parity)"
            )
            return
        got = self.pieces.setdefault(j, {})
        got[which["index"]] = piece
        if len(got) == self.codec.k or which["index"] == "sum":
            c, want = self.wanted[j]
            del self.pieces[j]
            try:
                chunk = piece if which["index"] == "sum" else self.codec.rebuild(got, want)
            except Exception as exc:  # noqa: BLE001 - reported in the agreement, not raised
                self.error = f"rebuilding {self.target}: decoding codeword {j}: {exc}"
                return
            try:
                for name, at, lo, hi in _spans(self.files, c, self.chunk_bytes):
                    with open(self.partial / name, "r+b") as f:
                        f.seek(at)
                        f.write(memoryview(chunk)[lo:hi])
            except OSError as exc:
                self.error = f"rebuilding {self.target}: {exc}"
            self.wanted.pop(j)

    def abandon(self) -> None:
        shutil.rmtree(self.partial, ignore_errors=True)

    def finish(self) -> str | None:
        """Why the copy could not be rebuilt (its partial files removed), or None."""
        if self.error is None and self.wanted:
            self.error = f"rebuilding {self.target}: codewords {sorted(self.wanted)} incomplete"
        if self.error is None:
            try:
                if self.target.exists():
                    shutil.rmtree(self.target)
                os.rename(self.partial, self.target)
            except OSError as exc:
                self.error = f"rebuilding {self.target}: {exc}"
        shutil.rmtree(self.partial, ignore_errors=True)
        return self.error


def _spans(files: dict[str, int], chunk: int, size: int):  # noqa: ANN202
    """Where chunk ``chunk`` (``size`` bytes) of a copy's files, taken in their commit
    order as one stream, lies: (file, offset in it, start, end in the chunk)."""
    lo, hi = chunk * size, (chunk + 1) * size
    at = 0
    for name in _ordered(list(files)):
        end = at + files[name]
        if end > lo and at < hi:
            start = max(lo, at)
            yield name, start - at, start - lo, min(hi, end) - lo
        at = end


def _read_stream(d: Path, files: dict[str, int], chunk: int, size: int) -> np.ndarray:
    """Chunk ``chunk`` of the copy in ``d`` (zeros past its end)."""
    out = np.zeros(size, dtype=np.uint8)
    for name, at, lo, hi in _spans(files, chunk, size):
        with open(d / name, "rb") as f:
            f.seek(at)
            f.readinto(memoryview(out)[lo:hi])
    return out


def _digest(data: np.ndarray) -> str:
    return xxhash.xxh3_64_hexdigest(memoryview(data))


def write_manifest(parity_dir: Path, manifest: dict[str, Any]) -> None:
    """The parity copy's manifest, written last and whole (the storage layer's
    temporary name and rename): a parity copy without it is not offered."""
    open_storage(parity_dir).write_small_durably(PARITY_MANIFEST, json.dumps(manifest).encode())
