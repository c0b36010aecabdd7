"""Two simulated nodes on one machine, each with its OWN local checkpoint directory
(node-local NVMe, never shared between nodes), one S3-API object store (moto) behind
them: a job resumes exactly however much of the local tier is lost, a node killed
mid-upload never leaves a checkpoint committed on the remote, a node that cannot upload
does not stop the job, and a remote checkpoint of 4 ranks resumes on 3.

Every node is its own torchrun launch of tests/multi_node_train.py (2 nodes x 2 ranks,
gloo on CPU, FSDP2), started concurrently with the same master port.
"""

from __future__ import annotations

import json
import math
import os
import re
import shutil
import signal
import subprocess
import sys
import time
import uuid
from dataclasses import dataclass
from pathlib import Path

import boto3
import pytest
from distributed import _free_port
from s3_server import start_moto

import shardpoint
from shardpoint.format.index import MARKER_NAME
from shardpoint.training.tiers import CheckpointTier

pytestmark = pytest.mark.slow

WORKER = Path(__file__).resolve().parent / "multi_node_train.py"
STEPS, SAVE_EVERY = 8, 2  # checkpoints at steps 2, 4, 6, 8; keep_last=2 locally
LAUNCH_TIMEOUT = 300  # seconds for a whole launch (every node)
GRACE = 10  # seconds the surviving node gets after the other died, before it is stopped
CREDENTIALS = {
    "AWS_ACCESS_KEY_ID": "testing",
    "AWS_SECRET_ACCESS_KEY": "testing",
    "AWS_REGION": "us-east-1",
}


def local_dir(root: Path, node: int) -> Path:
    """Node ``node``'s own checkpoint directory: no other node ever sees it."""
    return root / f"node{node}" / "nvme"


def run_dir(root: Path, node: int) -> Path:
    """Where node ``node``'s ranks write their losses and digests (never checkpoints)."""
    return root / f"node{node}"


# ---- the object store --------------------------------------------------------------------


@pytest.fixture(scope="module")
def aws_env():
    """A moto server for this module; the AWS_* variables (here and in every launch)
    point every client at it."""
    server, endpoint = start_moto()
    env = {**CREDENTIALS, "AWS_ENDPOINT_URL": endpoint}
    with pytest.MonkeyPatch.context() as mp:
        for k, v in env.items():
            mp.setenv(k, v)
        yield env
    server.stop()


def new_remote(aws_env: dict[str, str]) -> str:
    """The remote tier of one job: ``s3://<fresh bucket>/run``."""
    bucket = f"mn{uuid.uuid4().hex[:16]}"
    boto3.client("s3").create_bucket(Bucket=bucket)
    return f"s3://{bucket}/run"


def remote_steps(remote: str) -> list[int]:
    """Steps committed on the remote, as the library lists them."""
    return CheckpointTier(remote, None).steps()


def remote_markers(remote: str) -> list[str]:
    """Every commit marker under the remote prefix, as the server lists it (independent
    of the library's own listing)."""
    bucket, _, prefix = remote.removeprefix("s3://").partition("/")
    pages = (
        boto3.client("s3")
        .get_paginator("list_objects_v2")
        .paginate(Bucket=bucket, Prefix=f"{prefix}/")
    )
    keys = [o["Key"] for page in pages for o in page.get("Contents", [])]
    return sorted(k for k in keys if k.endswith(f"/{MARKER_NAME}"))


# ---- launching nodes ---------------------------------------------------------------------


@dataclass
class NodeRun:
    node: int
    returncode: int | None  # None: still running when stopped by the harness
    stdout: str
    stderr: str

    def tail(self) -> str:
        return (
            f"--- node {self.node}: exit code {self.returncode}\n"
            f"--- stdout (tail)\n{self.stdout[-2000:]}\n--- stderr (tail)\n{self.stderr[-4000:]}"
        )


def _worker_children(pid: int) -> list[int]:
    """Pids of the training workers a torchrun process started (they run in sessions of
    their own, so they are stopped one by one if torchrun cannot stop them)."""
    out = []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            stat = (entry / "stat").read_text()
            ppid = int(stat.rsplit(")", 1)[1].split()[1])
            if ppid == pid and WORKER.name in (entry / "cmdline").read_text():
                out.append(int(entry.name))
        except (OSError, ValueError, IndexError):
            continue
    return out


def _stop(proc: subprocess.Popen) -> None:
    """Stop a torchrun launch we started and every worker it started."""
    workers = _worker_children(proc.pid)
    proc.send_signal(signal.SIGTERM)  # torchrun stops its workers
    try:
        proc.wait(20)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait()
    for pid in workers:
        try:
            if WORKER.name in Path(f"/proc/{pid}/cmdline").read_text():
                os.kill(pid, signal.SIGKILL)
        except (OSError, ProcessLookupError):
            pass  # already gone


def launch(
    root: Path,
    remote: str,
    aws_env: dict[str, str],
    *,
    steps: int,
    nodes: int = 2,
    nproc: int = 2,
    node_args: dict[int, list[str]] | None = None,
    dying_node: int | None = None,
) -> list[NodeRun]:
    """Start one torchrun per node at once (node K: ``local_dir(root, K)`` and
    ``run_dir(root, K)``), and wait for all of them.

    A launch still running after LAUNCH_TIMEOUT is stopped and the test fails (a hang is
    a defect). With ``dying_node``, that node is expected to die: once it has exited,
    the others get GRACE seconds, then whatever still runs is stopped (a real scheduler
    tears the job down too) and reported with exit code None."""
    port = _free_port()
    env = {**os.environ, **aws_env, "OMP_NUM_THREADS": "1"}
    logs = root / "logs"
    logs.mkdir(parents=True, exist_ok=True)
    stamp = f"{time.monotonic_ns()}"
    procs, files = [], []
    for node in range(nodes):
        cmd = [
            sys.executable, "-m", "torch.distributed.run",
            "--nnodes", str(nodes), "--nproc_per_node", str(nproc), "--node_rank", str(node),
            "--master_addr", "127.0.0.1", "--master_port", str(port),
            str(WORKER),
            "--local-dir", str(local_dir(root, node)),
            "--remote", remote,
            "--run-dir", str(run_dir(root, node)),
            "--steps", str(steps),
            "--save-every", str(SAVE_EVERY),
            *(node_args or {}).get(node, []),
        ]  # fmt: skip
        out = open(logs / f"{stamp}.node{node}.out", "w+")  # noqa: SIM115 - closed below
        err = open(logs / f"{stamp}.node{node}.err", "w+")  # noqa: SIM115
        files.append((out, err))
        procs.append(subprocess.Popen(cmd, env=env, stdout=out, stderr=err, text=True))
    deadline = time.monotonic() + LAUNCH_TIMEOUT
    stopped: set[int] = set()
    try:
        if dying_node is not None:
            try:
                procs[dying_node].wait(max(deadline - time.monotonic(), 1))
            except subprocess.TimeoutExpired:
                pass  # reported below: the node that should have died did not
            else:
                deadline = min(deadline, time.monotonic() + GRACE)
        for node, proc in enumerate(procs):
            try:
                proc.wait(max(deadline - time.monotonic(), 0.1))
            except subprocess.TimeoutExpired:
                _stop(proc)
                stopped.add(node)
    finally:
        for node, proc in enumerate(procs):
            if proc.poll() is None:
                _stop(proc)
                stopped.add(node)
    runs = []
    for node, (proc, (out, err)) in enumerate(zip(procs, files)):
        out.seek(0), err.seek(0)
        runs.append(
            NodeRun(node, None if node in stopped else proc.returncode, out.read(), err.read())
        )
        out.close(), err.close()
    hung = [r for r in runs if r.returncode is None] if dying_node is None else []
    assert not hung, "launch did not finish in time:\n" + "\n".join(r.tail() for r in runs)
    return runs


def assert_launch_ok(runs: list[NodeRun]) -> None:
    """Every node exited 0; else the tails of every node's output."""
    assert all(r.returncode == 0 for r in runs), "launch failed:\n" + "\n".join(
        r.tail() for r in runs
    )


def failed_workers(torchrun_stderr: str) -> dict[int, int]:
    """Rank -> exit code of every worker torchrun reports as failed (-9: SIGKILL)."""
    found = re.findall(
        r"rank\s*: (\d+) \(local_rank: \d+\)\n\s*exitcode\s*: (-?\d+)", torchrun_stderr
    )
    return {int(rank): int(code) for rank, code in found}


def resumed_from(runs: list[NodeRun]) -> int:
    """The step rank 0 (node 0) reported resuming from; 0 for a fresh start."""
    stdout = runs[0].stdout
    m = re.search(r"^resumed from step (\d+)$", stdout, re.M)
    if m:
        return int(m.group(1))
    assert re.search(r"^fresh start$", stdout, re.M), runs[0].tail()
    return 0


# ---- what the workers wrote ----------------------------------------------------------------


def rank_dir(root: Path, rank: int, nproc: int = 2) -> Path:
    return run_dir(root, rank // nproc)


def losses(root: Path, rank: int, nproc: int = 2) -> list[dict]:
    """Every loss line rank ``rank`` logged, in order, over every launch in ``root``."""
    path = rank_dir(root, rank, nproc) / f"losses.rank{rank}.jsonl"
    return [json.loads(line) for line in path.read_text().splitlines()]


def final(root: Path, rank: int, nproc: int = 2) -> dict:
    return json.loads((rank_dir(root, rank, nproc) / f"final.rank{rank}.json").read_text())


def restored(root: Path, rank: int, nproc: int = 2) -> dict:
    return json.loads((rank_dir(root, rank, nproc) / f"restored.rank{rank}.json").read_text())


def local_step_dirs(root: Path, node: int) -> dict[int, bool]:
    """Step -> committed, for every step directory in node ``node``'s own local dir."""
    out = {}
    for d in local_dir(root, node).glob("step-*"):
        out[int(d.name.removeprefix("step-"))] = (d / MARKER_NAME).is_file()
    return out


def digests(doc: dict) -> tuple[str, str]:
    return doc["local_sha256"], doc["full_sha256"]


# ---- the uninterrupted reference ---------------------------------------------------------


@pytest.fixture(scope="module")
def reference(tmp_path_factory, aws_env) -> tuple[Path, str]:
    """An uninterrupted 2-node job of STEPS steps: its root and its remote."""
    root = tmp_path_factory.mktemp("reference")
    remote = new_remote(aws_env)
    runs = launch(root, remote, aws_env, steps=STEPS)
    assert_launch_ok(runs)
    assert resumed_from(runs) == 0
    for rank in range(4):
        assert [r["step"] for r in losses(root, rank)] == list(range(1, STEPS + 1))
        assert final(root, rank)["step"] == STEPS
    return root, remote


def _assert_same_as_reference(root: Path, reference: tuple[Path, str]) -> None:
    """Every rank's loss log (over all launches) and final state equal the reference's,
    bit for bit."""
    ref_root, _ = reference
    for rank in range(4):
        assert losses(root, rank) == losses(ref_root, rank), f"rank {rank}"
        assert digests(final(root, rank)) == digests(final(ref_root, rank)), f"rank {rank}"


def _stop_at_and_wipe(tmp_path, aws_env, wipe: list[int], stop_at: int = 4) -> Path:
    """A job that ran ``stop_at`` steps (exiting normally, uploads awaited), then lost
    the local disks of the ``wipe`` nodes. Checks its checkpoint reached the remote."""
    root = tmp_path / "run"
    remote = new_remote(aws_env)
    first = launch(root, remote, aws_env, steps=stop_at)
    assert_launch_ok(first)
    assert stop_at in remote_steps(remote)
    assert all(final(root, rank)["uploads_flushed"] is True for rank in range(4))
    at_stop = {rank: digests(final(root, rank)) for rank in range(4)}
    for node in wipe:
        assert any(local_step_dirs(root, node).values()), node  # there was something to lose
        shutil.rmtree(local_dir(root, node))
    resumed = launch(root, remote, aws_env, steps=STEPS)
    assert_launch_ok(resumed)
    assert resumed_from(resumed) == stop_at
    for rank in range(4):
        # What each rank loaded is exactly what it held when it stopped.
        assert restored(root, rank)["step"] == stop_at
        assert digests(restored(root, rank)) == at_stop[rank], f"rank {rank}"
    return root


# ---- the tests ---------------------------------------------------------------------------


def test_node_1_local_disk_wiped_resumes_bit_identical(tmp_path, aws_env, reference):
    """Node 1's NVMe is lost (a replaced machine); node 0 still has its local copy. The
    job resumes from the newest checkpoint, node 1's part coming from the remote."""
    root = _stop_at_and_wipe(tmp_path, aws_env, wipe=[1])
    _assert_same_as_reference(root, reference)
    for node in (0, 1):  # each node's own disk holds its newest checkpoints again
        assert local_step_dirs(root, node) == {6: True, 8: True}, node


def test_both_nodes_local_disks_wiped_resume_bit_identical_from_the_remote(
    tmp_path, aws_env, reference
):
    root = _stop_at_and_wipe(tmp_path, aws_env, wipe=[0, 1])
    _assert_same_as_reference(root, reference)
    for node in (0, 1):
        assert local_step_dirs(root, node) == {6: True, 8: True}, node


def test_node_killed_mid_upload_commits_nothing_remote_and_the_job_resumes_bit_identical(
    tmp_path, aws_env, reference
):
    """Node 1 is SIGKILLed at its first write to the object store, i.e. during the
    upload of the first checkpoint. No checkpoint may be committed on the remote: every
    one lacks node 1's shards (after the kill, no rank can take another step)."""
    root = tmp_path / "run"
    remote = new_remote(aws_env)
    killed = launch(
        root,
        remote,
        aws_env,
        steps=STEPS,
        node_args={1: ["--kill-during-upload", "1"]},
        dying_node=1,
    )
    node0, node1 = killed
    failed = failed_workers(node1.stderr)
    # Node 1 died of the SIGKILL, not of some other failure (which also exits nonzero).
    assert node1.returncode not in (0, None) and -9 in failed.values(), node1.tail()
    assert set(failed) <= {2, 3}, node1.tail()
    # Node 0 cannot finish without node 1 (its collectives, the final barrier).
    assert node0.returncode != 0, node0.tail()
    # The kill came after node 1 committed a checkpoint locally: it died mid-upload.
    assert any(local_step_dirs(root, 1).values()), local_step_dirs(root, 1)
    assert remote_steps(remote) == []
    assert remote_markers(remote) == []
    logged = {rank: len(losses(root, rank)) for rank in range(4)}

    resumed = launch(root, remote, aws_env, steps=STEPS)
    assert_launch_ok(resumed)
    start = resumed_from(resumed)
    assert start >= SAVE_EVERY and start % SAVE_EVERY == 0, resumed[0].tail()
    ref_root, _ = reference
    for rank in range(4):
        before, after = losses(root, rank)[: logged[rank]], losses(root, rank)[logged[rank] :]
        reference_losses = losses(ref_root, rank)
        # The killed run logged a prefix of the reference; the relaunch re-ran from the
        # resumed step on, exactly as the reference did.
        assert before == reference_losses[: len(before)], f"rank {rank}"
        assert len(before) >= start, f"rank {rank}"
        assert after == reference_losses[start:], f"rank {rank}"
        assert digests(final(root, rank)) == digests(final(ref_root, rank)), f"rank {rank}"
    # The remote now holds the final checkpoint, complete: it loads in one process into
    # exactly the job's final state (parameters and optimizer state).
    steps = remote_steps(remote)
    assert STEPS in steps and set(steps) <= set(range(SAVE_EVERY, STEPS + 1, SAVE_EVERY))
    assert f"run/step-{STEPS:09d}/{MARKER_NAME}" in remote_markers(remote)
    assert _full_digest_of_remote(remote, STEPS) == final(ref_root, 0)["full_sha256"]


def _full_digest_of_remote(remote: str, step: int) -> str:
    """Load the remote checkpoint of ``step`` into one process; digest of the full state."""
    import warnings

    import multi_node_train

    model, opt = multi_node_train.build(1, seed=12345)  # other weights before loading
    state = shardpoint.TrainState(model=model, optimizer=opt)
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", "RNG streams were saved on")
        shardpoint.load(state, f"{remote}/step-{step:09d}")
    assert state.step == step
    return multi_node_train.digests(model, opt)["full_sha256"]


def test_a_node_that_cannot_upload_does_not_stop_the_job_and_the_failure_is_reported(
    tmp_path, aws_env
):
    """Every object-store write of node 1 fails. Saves are local and succeed, the job
    completes with exit code 0, nothing is ever committed on the remote (no checkpoint
    is complete there without node 1's shards), and the failure is reported: an
    ``upload_failed`` event in node 0's event log and a warning, both naming the cause."""
    root = tmp_path / "run"
    remote = new_remote(aws_env)
    steps = 6
    runs = launch(root, remote, aws_env, steps=steps, node_args={1: ["--fail-uploads"]})
    assert_launch_ok(runs)
    assert remote_steps(remote) == []
    assert remote_markers(remote) == []
    for node in (0, 1):  # keep_last=2 on every node's own disk, every one committed
        assert local_step_dirs(root, node) == {4: True, 6: True}, node
    events = [
        json.loads(line)
        for line in (local_dir(root, 0) / "events.jsonl").read_text().splitlines()
        if line.strip()
    ]
    failures = [e for e in events if e["event"] == "upload_failed"]
    assert failures, events
    assert any("injected upload failure" in e.get("error", "") for e in failures), failures
    stderr = runs[0].stderr + runs[1].stderr
    assert any(
        "Warning" in line and "injected upload failure" in line for line in stderr.splitlines()
    ), "no warning names the upload failure:\n" + "\n".join(r.tail() for r in runs)

    # The local checkpoints load: a relaunch (node 1 still unable to upload) resumes
    # from the newest one, each rank getting exactly the state it saved.
    at_end = {rank: digests(final(root, rank)) for rank in range(4)}
    again = launch(root, remote, aws_env, steps=steps, node_args={1: ["--fail-uploads"]})
    assert_launch_ok(again)
    assert resumed_from(again) == steps, again[0].tail()
    for rank in range(4):
        assert restored(root, rank)["step"] == steps
        assert digests(restored(root, rank)) == at_end[rank], f"rank {rank}"
    assert remote_markers(remote) == []


def test_a_2_node_checkpoint_resumes_on_3_ranks_of_one_node_from_the_remote(
    tmp_path, aws_env, reference
):
    """The reference job's remote (4 ranks on 2 nodes) restores on 3 ranks with an empty
    local dir: the newest remote step, into exactly the 4-rank job's full state
    (parameters and AdamW state, gathered), and training goes on from there."""
    ref_root, remote = reference
    ref_full = {final(ref_root, rank)["full_sha256"] for rank in range(4)}
    assert len(ref_full) == 1  # every rank gathered the same full state
    assert max(remote_steps(remote)) == STEPS
    root = tmp_path / "three"
    more = STEPS + 2
    runs = launch(root, remote, aws_env, steps=more, nodes=1, nproc=3)
    assert_launch_ok(runs)
    assert resumed_from(runs) == STEPS
    for rank in range(3):
        doc = restored(root, rank, nproc=3)
        assert doc["step"] == STEPS and doc["world_size"] == 3
        assert {doc["full_sha256"]} == ref_full, f"rank {rank}"
        logged = losses(root, rank, nproc=3)
        assert [r["step"] for r in logged] == [STEPS + 1, more], f"rank {rank}"
        assert all(math.isfinite(float.fromhex(r["loss"])) for r in logged), logged
        assert final(root, rank, nproc=3)["step"] == more
    assert len({final(root, rank, nproc=3)["full_sha256"] for rank in range(3)}) == 1
    assert final(root, 0, nproc=3)["full_sha256"] not in ref_full  # it trained on
    assert more in remote_steps(remote)
