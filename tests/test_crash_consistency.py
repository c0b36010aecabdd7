"""SIGKILL a checkpointing process at every file-system call of a cycle; nothing committed
is lost and nothing partial is ever visible.

A cycle is what a training job does with a ``CheckpointManager``: restore the newest
checkpoint, then save three more steps (two with two ranks), each followed by retention
(``keep_last=2``). Every file-system call of the cycle (``open``, ``pwrite``, ``fsync``,
``ftruncate``, ``replace``, ``unlink``, ``rmdir``) is counted and given the phase of the
library function it comes from:

- restore: reading the newest checkpoint (``CheckpointManager.restore``);
- prepare: creating, fsyncing and locking the step directory;
- write: the shard files (``open``, ``pwrite``, ``ftruncate``, ``fsync``);
- commit: ``index.json`` then ``COMMITTED``, each written, fsynced and renamed into
  place, with a directory fsync after each;
- retention: deleting the checkpoint that falls out of ``keep_last``.

One cycle runs without a kill to count its N calls. Then a forked child runs the cycle
again, in the directory the previous child left, and SIGKILLs itself just before call
k, for every k in 1..N. Before each of these runs the parent finishes what a killed
retention left undone, so the run starts like the counted cycle and its call k is the
counted call k (start-up clean-up is not counted). Further kill points, if asked for,
are sampled from 1..N and run from whatever the previous kill left. After every run:

- a restore loaded the newest committed checkpoint;
- the newest checkpoint any run saw committed is still there;
- a kill during retention (which follows a commit) left the step just committed;
- a run that reached no kill point committed every step it saved;
- after the next start no uncommitted directory is left, and every visible checkpoint
  loads with exactly its step's values.

The same runs with ``CheckpointManager(incremental=True)``: a frozen tensor is referred
to, not written, from the second save of a cycle on, so retention deletes checkpoints
whose files later ones still read (they stay, marked ``PRUNED``, until nothing refers
to them), and a kill lands in those deletions too.

The same runs with ``CheckpointManager(async_save=True)``: the kill then lands on the
background writer, hasher or commit thread while the training thread has already moved
on and overwritten the live tensors with NaN. With two ranks (torch.distributed, gloo),
each rank is killed at each call of its own cycle; the killed rank must die by SIGKILL,
the other only because its collective with the killed one broke.

SHARDPOINT_KILL_POINTS sets how many kill points the one-rank synchronous test tries
(default 200; half as many asynchronous or incremental), SHARDPOINT_TWO_RANK_KILL_POINTS those of
each two-rank test (default 160, over both ranks); never fewer than N (both ranks' N).
"""

from __future__ import annotations

import itertools
import os
import random
import re
import signal
import sys
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

import pytest
import torch

from shardpoint import CheckpointError, CheckpointManager, RetentionPolicy, SavePolicy, load
from shardpoint.commit import Commit
from shardpoint.format.index import MARKER_NAME
from shardpoint.names import PRUNED_NAME, step_dir
from shardpoint.references import referenced_files
from shardpoint.storage.local import LocalDirectory

KILL_POINTS = int(os.environ.get("SHARDPOINT_KILL_POINTS", "200"))
TWO_RANK_KILL_POINTS = int(os.environ.get("SHARDPOINT_TWO_RANK_KILL_POINTS", "160"))
CALLS = ("open", "pwrite", "fsync", "ftruncate", "replace", "unlink", "rmdir")
KEEP_LAST = 2

# The library function nearest to an OS call on its thread's stack gives the call's phase.
PHASE_OF_FUNCTION = {
    ("save_commit.py", "_commit"): "commit",
    ("commit.py", "delete"): "retention",
    ("commit.py", "begin"): "prepare",
    ("write_phase.py", "write_from_memory"): "write",
    ("background_save.py", "open"): "write",  # _Persist.open: creates the shard files
    ("background_save.py", "_write"): "write",
    ("background_save.py", "finish"): "write",  # ftruncate and fsync of the shards
    ("manager.py", "restore"): "restore",
}
PHASES = ("restore", "prepare", "write", "commit", "retention")

Record = tuple[str, str, str]  # phase, call, file name


def _phase_of_caller() -> str:
    frame = sys._getframe(2)  # the caller of the wrapped OS function
    while frame is not None:
        code = frame.f_code
        phase = PHASE_OF_FUNCTION.get((os.path.basename(code.co_filename), code.co_name))
        if phase is not None:
            return phase
        frame = frame.f_back
    return "other"


class CycleCalls:
    """In a child process: numbers the file-system calls made once ``armed`` and records
    each; at call ``kill_at`` it writes that call's record to ``report`` and SIGKILLs the
    process (every thread of it) before the call is made."""

    def __init__(self, kill_at: int, report: Path) -> None:
        self.kill_at = kill_at
        self.report = os.open(report, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)
        self.armed = False
        self.records: list[str] = []
        self._count = itertools.count(1)  # atomic under the GIL: background threads call
        self._paths: dict[int, str] = {}  # fd -> path, to name the file of a pwrite or fsync
        for name in CALLS:
            setattr(os, name, self._counted(name, getattr(os, name)))

    def _counted(self, name: str, real: Callable[..., object]) -> Callable[..., object]:
        def call(*args, **kwargs):  # noqa: ANN002, ANN003, ANN202
            first = args[0]
            target = self._paths.get(first, "?") if isinstance(first, int) else os.fspath(first)
            if self.armed:
                record = f"{_phase_of_caller()} {name} {Path(target).name}"
                if next(self._count) == self.kill_at:
                    os.write(self.report, f"{record}\n".encode())
                    os.kill(os.getpid(), signal.SIGKILL)
                self.records.append(record)
            result = real(*args, **kwargs)
            if name == "open":
                self._paths[result] = target
            return result

        return call

    def write_records(self) -> None:
        os.write(self.report, "".join(f"{r}\n" for r in self.records).encode())


def _read_records(report: Path) -> list[Record]:
    """The records a child wrote to ``report`` (none if it wrote none); removes the file."""
    if not report.exists():
        return []
    records = [tuple(line.split(" ", 2)) for line in report.read_text().splitlines()]
    report.unlink()
    return records  # type: ignore[return-value]


def _same_call(a: Record, b: Record) -> bool:
    """The same call of the cycle, whatever the step numbers in the names."""
    return a[:2] == b[:2] and re.sub(r"\d", "", a[2]) == re.sub(r"\d", "", b[2])


@dataclass
class Kill:
    rank: int
    at: int  # the call number
    enumerated: bool  # one of the 1..N runs (else sampled)
    record: Record | None  # where it landed; None: the run never reached call ``at``


@dataclass
class Ledger:
    """What the parent knows across runs: the newest step committed, the checkpoints it
    saw visible after the last run, and every kill."""

    root: Path
    steps_per_cycle: int
    load_and_compare: Callable[[Path, int], None]  # raises unless it holds the step's values
    newest_committed: int = 0  # reported by a child, or seen visible by the parent
    visible: list[int] = field(default_factory=list)
    kills: list[Kill] = field(default_factory=list)

    def check_run(self, killed: Record | None) -> None:
        """The invariants after one run; ``killed``: the call it was killed at, if any."""
        run_log = self.root.parent / "run.log"
        lines = [line.split() for line in run_log.read_text().splitlines()]
        run_log.unlink()
        restored = [int(s) for what, s in lines if what == "restored"]
        committed = [int(s) for what, s in lines if what == "committed"]
        before = max(self.visible, default=0)
        # A restore loads the newest committed checkpoint.
        assert restored in ([], [before]), f"restored {restored}; visible before: {self.visible}"
        if killed is None:  # a run that reached no kill point committed all it saved
            assert restored == [before], (restored, self.visible)
            steps = list(range(before + 1, before + self.steps_per_cycle + 1))
            assert committed == steps, f"committed {committed}, expected {steps}"
        self.newest_committed = max([self.newest_committed, *committed])

        manager = CheckpointManager(
            self.root,
            policy=SavePolicy(every_n_steps=1),
            retention=RetentionPolicy(keep_last=KEEP_LAST),
            preemption_signals=(),
        )
        visible = manager.steps()
        newest = max(visible, default=0)
        # No committed checkpoint is lost: the newest is there, or a newer one.
        assert self.newest_committed in visible or newest > self.newest_committed, (
            f"checkpoints visible: {visible}; step {self.newest_committed} was committed"
        )
        # Retention runs only after a commit: a kill there leaves a new checkpoint.
        if killed is not None and killed[0] == "retention":
            assert newest > before, f"killed at {killed}; visible {visible}, before {before}"
        if killed is None:
            assert visible[-KEEP_LAST:] == committed[-KEEP_LAST:], (visible, committed)
        # The new manager cleaned up what the crash left: only committed step directories,
        # and deleted ones holding exactly the files a visible checkpoint refers to.
        referenced = self.referenced(visible)
        leftovers = [
            p.name
            for p in self.root.iterdir()
            if p.name.startswith("step-")
            and not (p / MARKER_NAME).exists()
            and {f.name for f in p.iterdir()} != {PRUNED_NAME, *referenced.get(p.name, ())}
        ]
        assert not leftovers, (leftovers, referenced)
        # Visible means complete: every visible checkpoint loads with its step's values.
        for step in visible:
            try:
                self.load_and_compare(manager.path_for(step), step)
            except CheckpointError as exc:
                raise AssertionError(
                    f"killed at {killed}: step {step} is visible but does not load: {exc}"
                ) from exc
        self.visible = visible
        self.newest_committed = max(self.newest_committed, newest)

    def finish_retention(self) -> None:
        """Delete what a killed retention left beyond ``keep_last``, as the next save's
        retention would: the next run then starts like the counted cycle."""
        keep = self.referenced(self.visible[-KEEP_LAST:])
        for step in self.visible[:-KEEP_LAST]:
            Commit(LocalDirectory(self.root / step_dir(step))).delete(keep.get(step_dir(step), ()))
        self.visible = self.visible[-KEEP_LAST:]

    def referenced(self, steps: list[int]) -> dict[str, set[str]]:
        return referenced_files(self.root, [step_dir(s) for s in steps], None)

    def table(self, title: str, cycle: list[Record], rank: int = 0) -> str:
        """The calls of one cycle and the kills that landed, by phase."""
        kills = [k for k in self.kills if k.rank == rank]
        landed = [k for k in kills if k.record is not None]
        exact = sum(1 for k in landed if k.enumerated and _same_call(k.record, cycle[k.at - 1]))
        rows = [
            f"{title}: {len(kills)} kill points ({len(cycle)} calls in one cycle, each "
            f"killed once, then {len(kills) - len(cycle)} sampled), {len(landed)} landed "
            f"({exact} of the {len(cycle)} enumerated exactly at the counted call)",
            f"  {'phase':<10} {'calls/cycle':>11} {'landed':>6} {'enum.':>5} {'sampled':>7}"
            "  landed by call",
        ]
        phases = {r[0] for r in cycle} | {k.record[0] for k in landed}
        for phase in sorted(phases, key=lambda p: PHASES.index(p) if p in PHASES else 99):
            here = [k for k in landed if k.record[0] == phase]
            by_call = Counter(k.record[1] for k in here)
            rows.append(
                f"  {phase:<10} {sum(1 for r in cycle if r[0] == phase):>11} {len(here):>6} "
                f"{sum(k.enumerated for k in here):>5} {sum(not k.enumerated for k in here):>7}  "
                + ", ".join(f"{call} {n}" for call, n in sorted(by_call.items()))
            )
        return "\n".join(rows)

    def assert_every_call_was_killed(self, cycle: list[Record], rank: int, exact: bool) -> None:
        """Every kind of call of every phase of the cycle took a kill; with ``exact``
        (deterministic order), every one of the N calls did."""
        landed = [k for k in self.kills if k.rank == rank and k.record is not None]
        missed = {r[:2] for r in cycle} - {k.record[:2] for k in landed}
        assert not missed, f"rank {rank}: no kill landed at {sorted(missed)}"
        if exact:
            wrong = [
                (k.at, cycle[k.at - 1], k.record)
                for k in landed
                if k.enumerated and not _same_call(k.record, cycle[k.at - 1])
            ]
            enumerated = sum(1 for k in landed if k.enumerated)
            assert not wrong and enumerated == len(cycle), (enumerated, len(cycle), wrong[:5])


def _schedule(cycles: dict[int, list[Record]], points: int, seed: int) -> list[Kill]:
    """Every call of every rank's cycle once, then sampled calls up to ``points``."""
    kills = [Kill(r, k, True, None) for r, c in cycles.items() for k in range(1, len(c) + 1)]
    rng = random.Random(seed)
    for _ in range(points - len(kills)):
        r = rng.choice(sorted(cycles))
        kills.append(Kill(r, rng.randint(1, len(cycles[r])), False, None))
    return kills


def _append(path: Path, line: str) -> None:
    with open(path, "a") as f:  # the builtin open: not one of the counted calls
        f.write(f"{line}\n")


# ---- one rank ------------------------------------------------------------------------


# Never changed: incremental saves refer to it instead of writing it again.
FROZEN = torch.randn(64, 9, generator=torch.Generator().manual_seed(99))


def state_of(step: int) -> dict:
    """The state saved at ``step``: its values say which step they belong to."""
    g = torch.Generator().manual_seed(step)
    w = torch.randn(300, 7, generator=g)
    return {"w": w, "b": torch.full((5,), float(step)), "frozen": FROZEN, "step": step}


def _template() -> dict:
    return {"w": torch.zeros(300, 7), "b": torch.zeros(5), "frozen": torch.zeros(64, 9), "step": -1}


def _compare_one_rank(path: Path, step: int) -> None:
    state = _template()
    load(state, path)
    _assert_one_rank_state(state, step)


def _assert_one_rank_state(state: dict, step: int) -> None:
    expected = state_of(step)
    assert state["step"] == step
    assert torch.equal(state["w"], expected["w"]) and torch.equal(state["b"], expected["b"])
    assert torch.equal(state["frozen"], FROZEN)


def _child(root: Path, kill_at: int, report: Path, mode: str) -> None:
    calls = CycleCalls(kill_at, report)
    manager = CheckpointManager(
        root,
        policy=SavePolicy(every_n_steps=1),
        retention=RetentionPolicy(keep_last=KEEP_LAST),
        async_save=mode == "async",
        preemption_signals=(),
        incremental=mode == "incremental",
    )
    calls.armed = True  # after the start-up clean-up of the previous crash's leftovers
    run_log = root.parent / "run.log"
    _append(run_log, "started 0")  # the log exists even when the kill lands in the restore
    state = _template()
    start = manager.restore(state) or 0
    if start:
        _assert_one_rank_state(state, start)
    _append(run_log, f"restored {start}")
    for step in range(start + 1, start + 4):
        live = state_of(step)
        manager.save(step, live)
        live["w"].fill_(float("nan"))  # the next training step, while the save is written
        live["b"].fill_(-1.0)
        manager.wait()
        _append(run_log, f"committed {step}")  # after the commit and its retention
    if kill_at == 0:
        calls.write_records()


def _run_child(root: Path, kill_at: int, mode: str) -> list[Record]:
    """One cycle in a forked child killed at call ``kill_at``. Returns the record of the
    call it was killed at (none if it finished), or with ``kill_at`` 0 (no kill) the
    record of every call."""
    report = root.parent / "report"
    pid = os.fork()
    if pid == 0:  # pragma: no cover - the child never returns
        try:
            _child(root, kill_at, report, mode)
            os._exit(0)
        finally:
            os._exit(3)
    _, status = os.waitpid(pid, 0)
    records = _read_records(report)
    killed = os.WIFSIGNALED(status) and os.WTERMSIG(status) == signal.SIGKILL
    assert killed or os.WEXITSTATUS(status) == 0, f"child failed with status {status}"
    if kill_at:
        assert len(records) == killed, (kill_at, status, records)
    else:
        assert not killed and records, (status, records)
    return records


@pytest.mark.slow
@pytest.mark.parametrize(
    ("mode", "points"),
    [
        ("sync", KILL_POINTS),
        ("async", max(1, KILL_POINTS // 2)),
        ("incremental", max(1, KILL_POINTS // 2)),
    ],
)
def test_sigkill_at_any_point_never_loses_a_committed_checkpoint(tmp_path, mode, points):
    ledger = Ledger(tmp_path / "ckpts", 3, _compare_one_rank)
    # A first cycle leaves checkpoints to restore and to delete; the second is counted.
    _run_child(ledger.root, 0, mode)
    ledger.check_run(None)
    cycle = _run_child(ledger.root, 0, mode)
    ledger.check_run(None)
    for kill in _schedule({0: cycle}, points, seed=1):
        if kill.enumerated:
            ledger.finish_retention()
        landed = _run_child(ledger.root, kill.at, mode)
        kill.record = landed[0] if landed else None
        ledger.kills.append(kill)
        ledger.check_run(kill.record)
    print(f"\n{ledger.table(f'1 rank, {mode}', cycle)}")
    assert set(PHASES) <= {r[0] for r in cycle}, cycle
    # Async: threads interleave. Incremental: where a kill stops decides what the next
    # cycle's retention deletes, so kill k lands near, not always at, counted call k.
    ledger.assert_every_call_was_killed(cycle, 0, exact=mode == "sync")


# ---- two ranks -----------------------------------------------------------------------


def _rank_state(step: int, rank: int) -> dict:
    shared = state_of(step)  # the same on both ranks: written once, split between them
    return {
        "shared": shared["w"],
        "ranks": {rank: torch.full((4,), float(10 * step + rank))},
        "step": step,
    }


def _two_rank_template() -> dict:
    return {
        "shared": torch.zeros(300, 7),
        "ranks": {0: torch.zeros(4), 1: torch.zeros(4)},
        "step": -1,
    }


def _assert_two_rank_state(state: dict, step: int) -> None:
    assert state["step"] == step
    assert torch.equal(state["shared"], state_of(step)["w"])
    assert [state["ranks"][r][0].item() for r in (0, 1)] == [10 * step, 10 * step + 1]


def _compare_two_ranks(path: Path, step: int) -> None:
    state = _two_rank_template()
    load(state, path)
    _assert_two_rank_state(state, step)


def _rank_child(
    rank: int, world: int, root: str, kill_rank: int, kill_at: int, async_save: bool
) -> None:
    """One rank's cycle; ``kill_rank`` dies at its call ``kill_at``. With ``kill_rank``
    -1 nobody is killed and every rank records its calls."""
    report = Path(root).parent / f"report-rank{rank}"
    calls = CycleCalls(kill_at if rank == kill_rank else 0, report)
    manager = CheckpointManager(
        root,
        policy=SavePolicy(every_n_steps=1),
        retention=RetentionPolicy(keep_last=KEEP_LAST),
        async_save=async_save,
        preemption_signals=(),
    )
    calls.armed = True
    run_log = Path(root).parent / "run.log"
    if rank == 0:
        _append(run_log, "started 0")
    state = _two_rank_template()  # every rank restores both ranks' values
    start = manager.restore(state) or 0
    if start:
        _assert_two_rank_state(state, start)
    if rank == 0:
        _append(run_log, f"restored {start}")
    for step in range(start + 1, start + 3):
        live = _rank_state(step, rank)
        manager.save(step, live)
        live["shared"].fill_(float("nan"))  # training goes on while the save is written
        manager.wait()
        if rank == 0:
            _append(run_log, f"committed {step}")
    if kill_rank == -1:
        calls.write_records()


# What the surviving rank may die of (the exception it raised): its connection to the
# killed rank broke, gloo's or the store's that rank 0 hosts. Anything else is its own.
LOST_PEER = re.compile(
    r"(builtins\.RuntimeError: \[\S*gloo\S*\]|torch\.distributed\.Dist\w*Error:) .*"
    r"(Connection closed by peer|Connection reset by peer|Broken pipe)"
)


def _run_ranks(
    tmp_path: Path, kill_rank: int, kill_at: int, async_save: bool
) -> dict[int, list[Record]]:
    """One two-rank cycle; returns {killed rank: [the record of the call it died at]}
    ({} if it finished), or with ``kill_rank`` -1 (no kill) every call of each rank.
    Any other way for either rank to end fails the test."""
    from distributed import run_ranks_outcomes

    outcomes = run_ranks_outcomes(
        2,
        _rank_child,
        str(tmp_path / "ckpts"),
        kill_rank,
        kill_at,
        async_save,
        errors=tmp_path / "errors",
    )
    if kill_rank == -1:
        assert all(o.exitcode == 0 for o in outcomes), "\n".join(map(str, outcomes))
        return {rank: _read_records(tmp_path / f"report-rank{rank}") for rank in (0, 1)}
    killer, peer = outcomes[kill_rank], outcomes[1 - kill_rank]
    records = _read_records(tmp_path / f"report-rank{kill_rank}")
    if not killer.killed_by_sigkill:  # its kill point was never reached
        assert killer.exitcode == 0 and peer.exitcode == 0, f"{killer}\n{peer}"
        assert not records, records
        return {}
    assert len(records) == 1, records
    assert peer.exitcode == 1 and LOST_PEER.match(peer.exception), (
        f"rank {kill_rank} was killed at {records[0]}; the other rank did not just lose "
        f"its peer:\n{peer}"
    )
    return {kill_rank: records}


@pytest.mark.slow
@pytest.mark.parametrize("mode", ["sync", "async"])
def test_sigkill_of_one_rank_during_a_two_rank_save_never_exposes_a_partial_checkpoint(
    tmp_path, mode
):
    ledger = Ledger(tmp_path / "ckpts", 2, _compare_two_ranks)
    # A first cycle leaves checkpoints to restore and to delete; the second is counted.
    _run_ranks(tmp_path, -1, 0, mode == "async")
    ledger.check_run(None)
    cycles = _run_ranks(tmp_path, -1, 0, mode == "async")
    ledger.check_run(None)
    for kill in _schedule(cycles, TWO_RANK_KILL_POINTS, seed=2):
        if kill.enumerated:
            ledger.finish_retention()
        landed = _run_ranks(tmp_path, kill.rank, kill.at, mode == "async")
        kill.record = landed[kill.rank][0] if landed else None
        ledger.kills.append(kill)
        ledger.check_run(kill.record)
    for r in (0, 1):
        print(f"\n{ledger.table(f'2 ranks, {mode}, rank {r} killed', cycles[r], r)}")
    assert set(PHASES) <= {r[0] for r in cycles[0]}, cycles[0]
    for r in (0, 1):
        ledger.assert_every_call_was_killed(cycles[r], r, exact=mode == "sync")
