"""Kill a checkpointing process with SIGKILL at every kind of point; nothing committed is lost.

A forked child restores from a CheckpointManager directory and saves three more steps
(keep_last=2, so retention deletes as it goes). Every file-system call it makes
(open, pwrite, fsync, ftruncate, replace, unlink, rmdir) is counted, and the child
SIGKILLs itself at call number ``k``: in the middle of writing shards, fsyncing,
renaming the index or the marker into place, or deleting an old checkpoint. The parent
then checks the invariants, and the next child continues in the same directory.

The same runs with ``CheckpointManager(async_save=True)``: the kill then lands on the
background writer, hasher or commit thread while the training thread has already moved
on and overwritten the live tensors.

SHARDPOINT_KILL_POINTS sets how many kill points to try (default 200 synchronous, half
as many asynchronous; more for a soak).
"""

from __future__ import annotations

import os
import signal
from pathlib import Path

import pytest
import torch

from shardpoint import CheckpointManager, load
from shardpoint.format.index import MARKER_NAME

KILL_POINTS = int(os.environ.get("SHARDPOINT_KILL_POINTS", "200"))
CALLS = ("open", "pwrite", "fsync", "ftruncate", "replace", "unlink", "rmdir")


def state_of(step: int) -> dict:
    """The state saved at ``step``: its values say which step they belong to."""
    g = torch.Generator().manual_seed(step)
    return {"w": torch.randn(300, 7, generator=g), "b": torch.full((5,), float(step)), "step": step}


def _template() -> dict:
    return {"w": torch.zeros(300, 7), "b": torch.zeros(5), "step": -1}


def _child(root: Path, kill_at: int, report: int, async_save: bool) -> None:
    count = [0]
    paths: dict[int, str] = {}  # fd -> path, to say which file a pwrite or fsync was for

    def counted(name: str):  # noqa: ANN202
        real = getattr(os, name)

        def call(*args, **kwargs):  # noqa: ANN002, ANN003, ANN202
            count[0] += 1
            target = paths.get(args[0], "") if isinstance(args[0], int) else os.fspath(args[0])
            if count[0] == kill_at:
                os.write(report, f"{name} {Path(target).name}\n".encode())
                os.kill(os.getpid(), signal.SIGKILL)
            result = real(*args, **kwargs)
            if name == "open":
                paths[result] = target
            return result

        return call

    for name in CALLS:
        setattr(os, name, counted(name))
    manager = CheckpointManager(
        root, every_n_steps=1, keep_last=2, preemption_signals=(), async_save=async_save
    )
    state = _template()
    start = manager.restore(state) or 0
    for step in range(start + 1, start + 4):
        live = state_of(step)
        manager.save(step, live)
        live["w"].fill_(float("nan"))  # the next training step, while the save is written
        live["b"].fill_(-1.0)
        manager.wait()
        with open(root.parent / "committed.log", "a") as log:  # after the commit
            log.write(f"{step}\n")
    os._exit(0)


def _run_child(root: Path, kill_at: int, async_save: bool) -> tuple[bool, str]:
    read, write = os.pipe()
    pid = os.fork()
    if pid == 0:  # pragma: no cover - the child never returns
        try:
            os.close(read)
            _child(root, kill_at, write, async_save)
        finally:
            os._exit(3)
    os.close(write)
    _, status = os.waitpid(pid, 0)
    where = os.read(read, 4096).decode().strip()
    os.close(read)
    killed = os.WIFSIGNALED(status) and os.WTERMSIG(status) == signal.SIGKILL
    assert killed or os.WEXITSTATUS(status) == 0, f"child failed with status {status}"
    return killed, where


def _check_after_crash(root: Path, log: Path, template) -> list[tuple[int, dict]]:  # noqa: ANN001
    """The invariants after a kill; returns each visible step with its loaded state."""
    committed = [int(x) for x in log.read_text().split()] if log.exists() else []
    manager = CheckpointManager(root, every_n_steps=1, keep_last=2, preemption_signals=())
    visible = manager.steps()
    # No committed checkpoint is lost: the newest one the process saw commit is there.
    if committed:
        assert max(committed) in visible or max(visible) > max(committed), (visible, committed)
    # The manager cleaned up what the crash left: only committed step directories remain.
    leftovers = [
        p for p in root.iterdir() if p.name.startswith("step-") and not (p / MARKER_NAME).exists()
    ]
    assert not leftovers, leftovers
    # Visible means complete: every visible checkpoint loads (the caller checks values).
    loaded = []
    for step in visible:
        state = template()
        load(state, manager.path_for(step))
        assert state["step"] == step
        loaded.append((step, state))
    return loaded


@pytest.mark.parametrize(
    ("mode", "points"), [("sync", KILL_POINTS), ("async", max(1, KILL_POINTS // 2))]
)
def test_sigkill_at_any_point_never_loses_a_committed_checkpoint(tmp_path, mode, points):
    root = tmp_path / "ckpts"
    log = tmp_path / "committed.log"
    phases: dict[str, int] = {}
    kills = 0
    for i in range(points):
        kill_at = 1 + (i * 37) % 97  # spread over restore, the three saves and retention
        killed, where = _run_child(root, kill_at, mode == "async")
        if killed:
            kills += 1
            call, _, target = where.partition(" ")
            if MARKER_NAME in target:
                phase = "marker"
            elif "index" in target:
                phase = "index"
            elif target.endswith(".safetensors"):
                phase = "shard"
            else:
                phase = "directory"  # fsync of a directory, rmdir
            phases[f"{call}:{phase}"] = phases.get(f"{call}:{phase}", 0) + 1

        for step, state in _check_after_crash(root, log, _template):
            expected = state_of(step)
            assert torch.equal(state["w"], expected["w"]) and torch.equal(state["b"], expected["b"])

    assert kills >= points // 2, kills
    covered = {key.split(":")[1] for key in phases}
    assert {"shard", "index", "marker", "directory"} <= covered, phases
    assert any(k.startswith("unlink:") for k in phases), phases  # retention and cleanup
    assert {"pwrite:shard", "fsync:shard", "replace:index", "replace:marker"} <= set(phases), phases
    print(
        f"\n{mode}: {kills} kills in {points} runs; by call and file: {dict(sorted(phases.items()))}"
    )


TWO_RANK_KILL_POINTS = int(os.environ.get("SHARDPOINT_TWO_RANK_KILL_POINTS", "30"))


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


def _rank_child(
    rank: int, world: int, root: str, kill_rank: int, kill_at: int, async_save: bool
) -> None:
    if rank == kill_rank:
        count = [0]
        for name in CALLS:
            real = getattr(os, name)

            def call(*args, _real=real, **kwargs):  # noqa: ANN002, ANN003, ANN202
                count[0] += 1
                if count[0] == kill_at:
                    os.kill(os.getpid(), signal.SIGKILL)
                return _real(*args, **kwargs)

            setattr(os, name, call)
    manager = CheckpointManager(
        root, every_n_steps=1, keep_last=2, preemption_signals=(), async_save=async_save
    )
    template = {"shared": torch.zeros(300, 7), "ranks": {rank: torch.zeros(4)}, "step": -1}
    start = manager.restore(template) or 0
    for step in range(start + 1, start + 3):
        live = _rank_state(step, rank)
        manager.save(step, live)
        live["shared"].fill_(float("nan"))  # training goes on while the save is written
        manager.wait()
        if rank == 0:
            with open(Path(root).parent / "committed.log", "a") as log:
                log.write(f"{step}\n")


@pytest.mark.parametrize("mode", ["sync", "async"])
def test_sigkill_of_one_rank_during_a_two_rank_save_never_exposes_a_partial_checkpoint(
    tmp_path, mode
):
    from distributed import run_ranks

    root = tmp_path / "ckpts"
    log = tmp_path / "committed.log"
    kills = 0
    for i in range(TWO_RANK_KILL_POINTS):
        kill_rank, kill_at = i % 2, 1 + (i * 7) % 41
        try:
            run_ranks(2, _rank_child, str(root), kill_rank, kill_at, mode == "async")
        except Exception:  # the killed rank, and the peer whose collective broke
            kills += 1
        for step, state in _check_after_crash(root, log, _two_rank_template):
            assert torch.equal(state["shared"], state_of(step)["w"])
            assert [state["ranks"][r][0].item() for r in (0, 1)] == [10 * step, 10 * step + 1]
    assert kills >= TWO_RANK_KILL_POINTS // 2, kills
