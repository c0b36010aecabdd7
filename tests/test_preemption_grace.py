"""A scheduler's preemption warning with a short grace: Slurm's ``--signal=USR1@N`` on
2 simulated nodes x 2 ranks, each node with its own disk and its own shared-memory
directory, the ranks launched directly as ``srun`` launches them (RANK, WORLD_SIZE,
LOCAL_WORLD_SIZE in the environment; every task gets the signal).

The disk is slow (every save takes seconds longer) and the grace shorter than a disk
save: the final save goes to the memory tier (and the buddies on the other node), every
rank exits 143 within the grace, and the requeued job resumes from memory and ends
bit-identical to a run that was never preempted. One-process tests cover the decision:
a generous grace uses the disk; no memory tier uses the disk and says why.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
from distributed import _free_port

import shardpoint
from shardpoint import CheckpointManager, MemoryTierOptions, SavePolicy, write_phase

WORKER = Path(__file__).resolve().parent / "multi_node_train.py"
NODES, PER_NODE = 2, 2
STEPS = 30
GRACE, SLOW_DISK = 3.0, 4.0  # a disk save needs 1.25 x 4 s > 3 s of grace
LAUNCH_TIMEOUT = 240


# ---- one process: the decision ------------------------------------------------------------


def _slow_disk(monkeypatch, seconds: float) -> None:
    real = write_phase.write_from_memory

    def slow(*args, **kwargs):
        time.sleep(seconds)
        return real(*args, **kwargs)

    monkeypatch.setattr(write_phase, "write_from_memory", slow)


def _manager(tmp_path, monkeypatch, *, memory: bool, grace: float) -> CheckpointManager:
    monkeypatch.setenv("SHARDPOINT_SHM_DIR", str(tmp_path / "shm"))
    return CheckpointManager(
        tmp_path / "run",
        SavePolicy(every_n_steps=2),
        memory=MemoryTierOptions(every_n_steps=100) if memory else None,
        preemption_signals=(signal.SIGUSR1,),
        preemption_grace_seconds=grace,
    )


def _state(step: int) -> shardpoint.TrainState:
    torch.manual_seed(step)
    return shardpoint.TrainState(model=torch.nn.Linear(32, 32), step=step)


def _events(root: Path) -> list[dict]:
    return [json.loads(line) for line in (root / "events.jsonl").read_text().splitlines()]


def test_a_grace_shorter_than_a_disk_save_saves_to_memory_and_the_restart_restores_it(
    tmp_path, monkeypatch
):
    _slow_disk(monkeypatch, 0.5)
    manager = _manager(tmp_path, monkeypatch, memory=True, grace=0.3)
    assert manager.maybe_save(2, _state(2))  # measures a disk save: >= 0.5 s
    os.kill(os.getpid(), signal.SIGUSR1)
    with pytest.warns(UserWarning, match="saved to the memory tier"):
        assert not manager.maybe_save(3, _state(3))  # no disk save
    assert manager.should_stop and manager.exit_code == 143
    manager.close()
    assert manager.steps() == [2]  # step 3 is not on disk
    (event,) = [e for e in _events(tmp_path / "run") if e["event"] == "preemption_save"]
    assert event["tier"] == "memory" and event["step"] == 3
    assert event["disk_save_seconds"] > event["grace_left_seconds"]

    restored = _state(0)
    again = _manager(tmp_path, monkeypatch, memory=True, grace=0.3)
    assert again.restore(restored) == 3
    torch.testing.assert_close(restored.model.weight, _state(3).model.weight, rtol=0, atol=0)
    assert [e["tier"] for e in _events(tmp_path / "run") if e["event"] == "restore"] == ["memory"]
    again.close(release_memory=True)


def test_a_grace_that_fits_a_disk_save_saves_to_disk(tmp_path, monkeypatch):
    manager = _manager(tmp_path, monkeypatch, memory=True, grace=60)
    manager.maybe_save(2, _state(2))
    os.kill(os.getpid(), signal.SIGUSR1)
    assert manager.maybe_save(3, _state(3))
    assert manager.should_stop and manager.exit_code == 143
    manager.close(release_memory=True)
    assert manager.steps() == [2, 3]
    assert not [e for e in _events(tmp_path / "run") if e["event"] == "preemption_save"]


def test_a_short_grace_without_a_memory_tier_still_saves_to_disk_and_says_why(
    tmp_path, monkeypatch
):
    _slow_disk(monkeypatch, 0.3)
    manager = _manager(tmp_path, monkeypatch, memory=False, grace=0.1)
    manager.maybe_save(2, _state(2))
    os.kill(os.getpid(), signal.SIGUSR1)
    with pytest.warns(UserWarning, match="there is no memory tier: saving to disk anyway"):
        assert manager.maybe_save(3, _state(3))
    manager.close()
    assert manager.steps() == [2, 3]
    (event,) = [e for e in _events(tmp_path / "run") if e["event"] == "preemption_save"]
    assert event["tier"] == "disk"


def test_a_memory_save_that_fails_at_preemption_falls_back_to_the_disk(tmp_path, monkeypatch):
    from shardpoint.errors import CheckpointError
    from shardpoint.training.memory_tier import MemoryTier

    _slow_disk(monkeypatch, 0.3)
    manager = _manager(tmp_path, monkeypatch, memory=True, grace=0.1)
    manager.maybe_save(2, _state(2))

    def fails(self, step, error):
        raise CheckpointError("injected: the buddy is gone")

    monkeypatch.setattr(MemoryTier, "_send_to_buddies", fails)
    os.kill(os.getpid(), signal.SIGUSR1)
    with pytest.warns(UserWarning, match="the memory tier save failed .*injected"):
        assert manager.maybe_save(3, _state(3))  # the disk save, slow or not
    assert manager.should_stop
    manager.close()
    assert manager.steps() == [2, 3]


def test_a_grace_per_signal_applies_to_the_signal_received(tmp_path, monkeypatch):
    """Slurm: SIGUSR1 at ``--signal=USR1@120``, SIGTERM with KillWait's 30 s."""
    _slow_disk(monkeypatch, 0.3)
    monkeypatch.setenv("SHARDPOINT_SHM_DIR", str(tmp_path / "shm"))

    def manager() -> CheckpointManager:
        return CheckpointManager(
            tmp_path / "run",
            SavePolicy(every_n_steps=2),
            memory=MemoryTierOptions(every_n_steps=100),
            preemption_signals=(signal.SIGUSR1, signal.SIGTERM),
            preemption_grace_seconds={signal.SIGUSR1: 60, signal.SIGTERM: 0.1},
        )

    first = manager()
    first.maybe_save(2, _state(2))
    os.kill(os.getpid(), signal.SIGUSR1)
    assert first.maybe_save(3, _state(3))  # 60 s: the disk
    first.close()
    second = manager()
    second.maybe_save(4, _state(4))
    os.kill(os.getpid(), signal.SIGTERM)
    with pytest.warns(UserWarning, match="saved to the memory tier"):
        assert not second.maybe_save(5, _state(5))  # 0.1 s: the memory tier
    second.close(release_memory=True)
    assert second.steps() == [2, 3, 4]


@pytest.mark.parametrize("grace", [0, -1.0, {signal.SIGTERM: 0}])
def test_the_grace_must_be_positive(tmp_path, grace):
    with pytest.raises(ValueError, match="preemption_grace_seconds must be positive"):
        CheckpointManager(tmp_path, preemption_grace_seconds=grace)


# ---- two nodes, launched as srun launches them ------------------------------------------------


def node_dir(root: Path, node: int) -> Path:
    return root / f"node{node}"


def _start(root: Path, port: int, extra: list[str]) -> list[subprocess.Popen]:
    """One process per rank, with the environment srun (plus a few lines of job script)
    gives each task; node K's ranks see only node K's disk and shared memory."""
    procs = []
    for rank in range(NODES * PER_NODE):
        node = rank // PER_NODE
        env = {
            **_node_env(root, node),
            "MASTER_ADDR": "127.0.0.1",
            "MASTER_PORT": str(port),
            "RANK": str(rank),
            "WORLD_SIZE": str(NODES * PER_NODE),
            "LOCAL_RANK": str(rank % PER_NODE),
            "LOCAL_WORLD_SIZE": str(PER_NODE),
        }
        procs.append(_popen(root, f"rank{rank}", [str(WORKER), *_args(root, node, extra)], env))
    return procs


def _start_torchrun(root: Path, port: int, extra: list[str]) -> list[subprocess.Popen]:
    """One torchrun per node. torchrun forwards the signals it handles to its workers
    (and SIGKILLs them ``--shutdown-timeout`` seconds later, 30 by default); SIGUSR1 is
    one once named in ``--signals-to-handle``, as the Slurm recipe does."""
    procs = []
    for node in range(NODES):
        cmd = [
            "-m", "torch.distributed.run", "--nnodes", str(NODES),
            "--signals-to-handle", "SIGTERM,SIGINT,SIGHUP,SIGQUIT,SIGUSR1",
            "--nproc_per_node", str(PER_NODE), "--node_rank", str(node),
            "--master_addr", "127.0.0.1", "--master_port", str(port),
            str(WORKER), *_args(root, node, extra),
        ]  # fmt: skip
        procs.append(_popen(root, f"node{node}", cmd, _node_env(root, node)))
    return procs


def _node_env(root: Path, node: int) -> dict[str, str]:
    return {
        **os.environ,
        "SHARDPOINT_SHM_DIR": str(node_dir(root, node) / "shm"),
        "OMP_NUM_THREADS": "1",
    }


def _args(root: Path, node: int, extra: list[str]) -> list[str]:
    return [
        "--local-dir", str(node_dir(root, node) / "nvme"),
        "--run-dir", str(node_dir(root, node)),
        "--steps", str(STEPS),
        *extra,
    ]  # fmt: skip


def _popen(root: Path, name: str, args: list[str], env: dict[str, str]) -> subprocess.Popen:
    (root / "logs").mkdir(parents=True, exist_ok=True)
    log = open(root / "logs" / f"{time.monotonic_ns()}.{name}", "w+")  # noqa: SIM115
    return subprocess.Popen([sys.executable, *args], env=env, stdout=log, stderr=subprocess.STDOUT)


def _wait(procs: list[subprocess.Popen], timeout: float) -> list[int]:
    deadline = time.monotonic() + timeout
    codes = []
    try:
        for proc in procs:
            codes.append(proc.wait(max(deadline - time.monotonic(), 0.1)))
    finally:
        for proc in procs:
            if proc.poll() is None:
                proc.kill()
                proc.wait()
    return codes


def _losses(root: Path, rank: int) -> list[dict]:
    path = node_dir(root, rank // PER_NODE) / f"losses.rank{rank}.jsonl"
    return [json.loads(line) for line in path.read_text().splitlines()]


def _final(root: Path, rank: int) -> dict:
    doc = json.loads((node_dir(root, rank // PER_NODE) / f"final.rank{rank}.json").read_text())
    return {k: doc[k] for k in ("step", "local_sha256", "full_sha256")}


def _logs(root: Path) -> str:
    logs = sorted((root / "logs").iterdir())
    return "\n".join(f"--- {p.name}\n{p.read_text()[-3000:]}" for p in logs)


SAVE_EVERY = 10  # disk saves at 10, 20, 30; the memory tier every step
COMMON = ["--save-every", str(SAVE_EVERY), "--memory-every", "1"]
SIGNAL_AFTER = 12  # steps: past the disk save of step 10 (measured, ~4 s), before step 20's


@pytest.fixture(scope="module")
def reference(tmp_path_factory) -> Path:
    """The same job, never preempted."""
    root = tmp_path_factory.mktemp("reference")
    codes = _wait(_start(root, _free_port(), COMMON), LAUNCH_TIMEOUT)
    assert codes == [0] * 4, _logs(root)
    return root


def _job_events(root: Path) -> list[dict]:
    path = node_dir(root, 0) / "nvme" / "events.jsonl"
    return [json.loads(line) for line in path.read_text().splitlines()]


@pytest.mark.slow
@pytest.mark.parametrize("launcher", ["srun", "torchrun"])
def test_sigusr1_with_a_short_grace_on_2_nodes_saves_to_memory_exits_143_and_resumes_exactly(
    tmp_path, reference, launcher
):
    start = {"srun": _start, "torchrun": _start_torchrun}[launcher]
    root = tmp_path / "run"
    preempted = [
        *COMMON, "--preemption-signal", "USR1", "--grace", str(GRACE),
        "--slow-disk", str(SLOW_DISK), "--step-sleep", "0.2",
    ]  # fmt: skip
    procs = start(root, _free_port(), preempted)
    deadline = time.monotonic() + LAUNCH_TIMEOUT
    while time.monotonic() < deadline and all(p.poll() is None for p in procs):
        ranks_past = [
            (node_dir(root, r // PER_NODE) / f"losses.rank{r}.jsonl").is_file()
            and len(_losses(root, r)) >= SIGNAL_AFTER
            for r in range(4)
        ]
        if all(ranks_past):
            break
        time.sleep(0.05)
    signalled = time.monotonic()
    for proc in procs:  # Slurm signals every task of the job step
        proc.send_signal(signal.SIGUSR1)
    codes = _wait(procs, LAUNCH_TIMEOUT)
    took = time.monotonic() - signalled
    assert took < GRACE, f"the job took {took:.2f} s to exit, the grace is {GRACE} s"
    if launcher == "srun":
        assert codes == [143] * 4, _logs(root)
    preempted_ranks = [
        json.loads((node_dir(root, r // PER_NODE) / f"preempted.rank{r}.json").read_text())
        for r in range(4)
    ]
    assert {doc["exit_code"] for doc in preempted_ranks} == {143}, _logs(root)
    stops = {doc["step"] for doc in preempted_ranks}
    assert len(stops) == 1, stops  # every rank stopped at the same step
    (stop,) = stops
    assert SIGNAL_AFTER <= stop < 2 * SAVE_EVERY  # between two disk saves
    (final_save,) = [e for e in _job_events(root) if e["event"] == "preemption_save"]
    assert final_save["tier"] == "memory" and final_save["step"] == stop
    for node in range(NODES):  # on no node's disk: the memory tier holds it
        assert not (node_dir(root, node) / "nvme" / f"step-{stop:09d}").exists()

    codes = _wait(start(root, _free_port(), COMMON), LAUNCH_TIMEOUT)  # the requeued job
    assert codes == [0] * len(codes), _logs(root)
    (restore,) = [e for e in _job_events(root) if e["event"] == "restore"]
    assert restore["tier"] == "memory" and restore["step"] == stop
    for rank in range(4):
        assert _losses(root, rank) == _losses(reference, rank), f"rank {rank}"
        assert _final(root, rank) == _final(reference, rank), f"rank {rank}"
