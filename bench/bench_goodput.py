"""A failure campaign on torch's own elastic agent: how much of the wall-clock time a
job trains when failures keep arriving, what each kind of failure costs, and whether
the job still ends bit-identical to one that never failed.

The job is tests/multi_node_train.py (FSDP2, gloo, a deterministic batch per step) on
2 simulated nodes x 2 ranks: one ``torchrun --nnodes=2 --max-restarts=K
--rdzv-backend=c10d`` per node, each node with its own disk directory and its own
shared-memory directory, an S3 server (moto, behind a proxy that can stall) as the
remote tier. The memory tier saves every ``--memory-every`` steps, the node-local disks
every ``--save-every`` steps (uploaded in the background). ``--step-seconds`` of sleep
per step stands in for GPU time. A seeded controller injects failures, one at a time,
each a few steps after the job has recovered from the previous one:

- ``process``: SIGKILL of one rank; its agent restarts the group (from host memory);
- ``node``: node 1's agent and ranks SIGKILLed, its disk and shared memory wiped, a new
  agent started (its ranks' state comes from the buddy copies on node 0);
- ``preemption``: SIGTERM to both agents (forwarded to the ranks, which save and exit
  143), SIGKILL after ``--grace`` seconds, the job started again (a requeue);
- ``corruption``: every process SIGKILLed, host memory of both nodes lost (a reboot),
  one byte of the newest checkpoint on node 0's disk flipped, the job started again;
- ``store_stall``: the object store holds every request for ``--stall-seconds``;
  training goes on.

Node 0's agent hosts the rendezvous store (as a dedicated host or etcd would on a real
cluster), so a whole-node failure is injected on node 1. Goodput is measured from the
first step's start to the last step's end: productive time is the compute of every
step of the final timeline; badput is the save stall of those steps, the lost work
(steps computed again after a failure) and restart + restore (everything else).

    python bench/bench_goodput.py [--failures 20] [--seed 0] [--json OUT]

Prints a table per failure and the summary; ``--json`` writes what
bench/goodput_model.py reads; ``--keep`` keeps the jobs' directories, whose event log
``shardpoint report DIR/campaign/node0/nvme`` draws as a timeline (saves per tier,
restores by tier, preemptions).
"""

from __future__ import annotations

import argparse
import json
import os
import random
import shutil
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import time
import uuid
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "tests"))
from s3_server import FaultProxy, start_moto  # noqa: E402 - the tests' S3 server and proxy

from shardpoint.format.index import MARKER_NAME  # noqa: E402

WORKER = ROOT / "tests" / "multi_node_train.py"
CREDENTIALS = {
    "AWS_ACCESS_KEY_ID": "testing",
    "AWS_SECRET_ACCESS_KEY": "testing",
    "AWS_REGION": "us-east-1",
}
# The mix of a campaign, in proportion (shuffled with the seed): process crashes are the
# most common interruption at scale, then lost hosts, then preemptions and corruption.
MIX = {"process": 8, "node": 4, "preemption": 3, "corruption": 2, "store_stall": 3}


@dataclass(frozen=True)
class Config:
    failures: int = 20
    steps: int = 0  # 0: enough for the failures' gaps
    memory_every: int = 2
    save_every: int = 10
    step_seconds: float = 0.05
    grace: float = 10.0
    stall_seconds: float = 8.0
    max_restarts: int = 100
    seed: int = 0
    min_gap: int = 4  # steps after a recovery before the next failure
    max_gap: int = 16
    timeout: float = 1800.0  # the whole campaign; a hang is a failure
    nodes: int = 2
    per_node: int = 2
    erasure: str | None = None  # "K+M": the memory tier's ErasureCode; None: a replica
    kinds: tuple[str, ...] = ()  # the failure kinds to draw from (default: MIX)

    @property
    def world(self) -> int:
        return self.nodes * self.per_node

    @property
    def total_steps(self) -> int:
        return self.steps or self.failures * (self.max_gap + self.save_every) + self.save_every


@dataclass
class Failure:
    kind: str
    node: int | None
    injected_at: float  # wall clock
    last_step_before: int  # the newest step rank 0 had finished
    restored_step: int | None = None
    tier: str | None = None  # the tier the job restored from (None: no restart)
    steps_lost: int = 0
    restart_s: float = 0.0  # fault -> ranks restored, less the restore itself
    restore_s: float = 0.0
    fault_to_first_step_s: float = 0.0
    notes: list[str] = field(default_factory=list)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class Job:
    """The torchrun agents of one job, their directories and what their ranks wrote."""

    def __init__(self, root: Path, remote: str, endpoint: str, config: Config) -> None:
        self.root, self.remote, self.config = root, remote, config
        self.env = {**os.environ, **CREDENTIALS, "AWS_ENDPOINT_URL": endpoint}
        self.env["OMP_NUM_THREADS"] = "1"
        # torch 2.13's c10d rendezvous shares one TCPStore across restart rounds and the
        # workers add no per-round prefix: a restarted gloo group reads the previous
        # round's (dead) peer addresses and fails to connect, round after round. Opting
        # out makes rank 0 host a fresh store every round.
        self.env["TORCH_DISABLE_SHARE_RDZV_TCP_STORE"] = "1"
        self.agents: dict[int, subprocess.Popen] = {}
        self.port = _free_port()
        self.rdzv_id = uuid.uuid4().hex[:8]
        (root / "logs").mkdir(parents=True, exist_ok=True)

    def node_dir(self, node: int) -> Path:
        return self.root / f"node{node}"

    def launch(self, node: int, extra: list[str] = ()) -> None:
        c = self.config
        cmd = [
            sys.executable, "-m", "torch.distributed.run",
            "--nnodes", str(c.nodes), "--nproc-per-node", str(c.per_node),
            "--max-restarts", str(c.max_restarts), "--monitor-interval", "0.1",
            "--rdzv-backend", "c10d", "--rdzv-endpoint", f"127.0.0.1:{self.port}",
            "--rdzv-id", self.rdzv_id,
            str(WORKER),
            "--local-dir", str(self.node_dir(node) / "nvme"),
            "--run-dir", str(self.node_dir(node)),
            "--remote", self.remote,
            "--steps", str(c.total_steps),
            "--save-every", str(c.save_every),
            "--memory-every", str(c.memory_every),
            "--step-sleep", str(c.step_seconds),
            "--preemption-signal", "TERM",
            "--timeline", *extra,
        ]  # fmt: skip
        if c.erasure:
            cmd += ["--erasure", c.erasure]
        env = {**self.env, "SHARDPOINT_SHM_DIR": str(self.node_dir(node) / "shm")}
        log = open(self.root / "logs" / f"{time.monotonic_ns()}.node{node}", "w")  # noqa: SIM115
        self.agents[node] = subprocess.Popen(cmd, env=env, stdout=log, stderr=subprocess.STDOUT)

    def launch_all(self) -> None:
        """A new job instance (a requeue): a new rendezvous, node 0 first (it hosts it)."""
        self.port, self.rdzv_id = _free_port(), uuid.uuid4().hex[:8]
        self.launch(0)
        time.sleep(0.5)
        for node in range(1, self.config.nodes):
            self.launch(node)

    def workers(self, node: int) -> list[int]:
        """Pids of the ranks node ``node``'s agent runs (each in a session of its own)."""
        agent = self.agents[node].pid
        out = []
        for entry in Path("/proc").iterdir():
            if not entry.name.isdigit():
                continue
            try:
                ppid = int((entry / "stat").read_text().rsplit(")", 1)[1].split()[1])
                if ppid == agent and WORKER.name in (entry / "cmdline").read_text():
                    out.append(int(entry.name))
            except (OSError, ValueError, IndexError):
                continue
        return sorted(out)

    def kill_node(self, node: int) -> None:
        """SIGKILL node ``node``'s agent and every rank it runs, and reap them."""
        ranks = self.workers(node)
        self.agents[node].kill()
        for pid in ranks:
            _kill(pid)
        self.agents[node].wait()
        _wait_gone(ranks)

    def running(self) -> bool:
        return all(a.poll() is None for a in self.agents.values())

    def finished(self) -> bool:
        return all(a.poll() is not None for a in self.agents.values())

    # ---- what the ranks wrote ----------------------------------------------------------

    def timeline(self) -> list[dict[str, Any]]:
        """Rank 0's timeline (whichever node it ran on), in time order."""
        rows = []
        for node in range(self.config.nodes):
            path = self.node_dir(node) / "timeline.jsonl"
            if path.is_file():
                rows += [json.loads(line) for line in path.read_text().splitlines() if line]
        return sorted(rows, key=lambda r: r.get("t0", r.get("ready", 0.0)))

    def events(self) -> list[dict[str, Any]]:
        rows = []
        for node in range(self.config.nodes):
            path = self.node_dir(node) / "nvme" / "events.jsonl"
            if path.is_file():
                for line in path.read_text().splitlines():
                    try:
                        rows.append(json.loads(line))
                    except json.JSONDecodeError:  # a line a SIGKILL cut short
                        continue
        return sorted(rows, key=lambda r: r.get("time", 0.0))

    def losses(self, rank: int) -> list[tuple[int, str]]:
        """Every (step, loss) rank ``rank`` logged, over every node and restart."""
        out = []
        for node in range(self.config.nodes):
            path = self.node_dir(node) / f"losses.rank{rank}.jsonl"
            if path.is_file():
                for line in path.read_text().splitlines():
                    try:
                        doc = json.loads(line)
                    except json.JSONDecodeError:  # cut short by a SIGKILL
                        continue
                    out.append((doc["step"], doc["loss"]))
        return out

    def final(self, rank: int) -> dict[str, Any]:
        for node in range(self.config.nodes):
            path = self.node_dir(node) / f"final.rank{rank}.json"
            if path.is_file():
                doc = json.loads(path.read_text())
                return {k: doc[k] for k in ("step", "local_sha256", "full_sha256")}
        raise FileNotFoundError(f"no final state of rank {rank} under {self.root}")

    def log_tail(self, lines: int = 40) -> str:
        out = []
        for path in sorted((self.root / "logs").iterdir())[-4:]:
            out.append(f"--- {path.name}\n" + "\n".join(path.read_text().splitlines()[-lines:]))
        return "\n".join(out)


def _kill(pid: int) -> None:
    try:
        os.kill(pid, signal.SIGKILL)
    except ProcessLookupError:
        pass


def _wait_gone(pids: list[int], timeout: float = 10.0) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline and any(Path(f"/proc/{p}").exists() for p in pids):
        time.sleep(0.02)


def _newest_step(job: Job) -> int:
    steps = [r["step"] for r in job.timeline() if "step" in r]
    return max(steps, default=0)


def _flip_newest_local(job: Job, node: int) -> str:
    """Flip one byte in the middle of the largest shard file of node ``node``'s newest
    committed checkpoint; returns the file."""
    nvme = job.node_dir(node) / "nvme"
    steps = sorted(d for d in nvme.glob("step-*") if (d / MARKER_NAME).is_file())
    for step_dir in reversed(steps):
        shards = sorted(step_dir.glob("*.safetensors"), key=lambda p: p.stat().st_size)
        if shards:
            path = shards[-1]
            with open(path, "r+b") as f:
                f.seek(path.stat().st_size // 2)
                byte = f.read(1)
                f.seek(-1, os.SEEK_CUR)
                f.write(bytes([byte[0] ^ 0xFF]))
            return str(path.relative_to(job.root))
    return ""


def inject(job: Job, kind: str, rng: random.Random, proxy: FaultProxy, c: Config) -> Failure:
    last = _newest_step(job)
    now = time.time()
    if kind == "process":
        node = rng.randrange(c.nodes)
        ranks = job.workers(node)
        failure = Failure(kind, node, now, last)
        _kill(rng.choice(ranks))
    elif kind == "node":
        failure = Failure(kind, 1, now, last)
        job.kill_node(1)
        shutil.rmtree(job.node_dir(1) / "shm", ignore_errors=True)
        shutil.rmtree(job.node_dir(1) / "nvme", ignore_errors=True)
        job.launch(1)
    elif kind == "preemption":
        failure = Failure(kind, None, now, last)
        ranks = {n: job.workers(n) for n in range(c.nodes)}
        for agent in job.agents.values():
            agent.send_signal(signal.SIGTERM)
        deadline = time.monotonic() + c.grace
        while time.monotonic() < deadline and not job.finished():
            time.sleep(0.05)
        for node in range(c.nodes):  # the scheduler's SIGKILL after the grace
            if job.agents[node].poll() is None:
                failure.notes.append(f"node {node} killed after the grace")
            job.agents[node].kill()
            job.agents[node].wait()
            for pid in ranks[node]:
                _kill(pid)
            _wait_gone(ranks[node])
        failure.last_step_before = _newest_step(job)  # the steps it finished meanwhile
        job.launch_all()
    elif kind == "corruption":
        failure = Failure(kind, None, now, last)
        for node in range(c.nodes):
            job.kill_node(node)
            shutil.rmtree(job.node_dir(node) / "shm", ignore_errors=True)
        flipped = _flip_newest_local(job, 0)
        failure.notes.append(f"flipped a byte of {flipped}")
        job.launch_all()
    elif kind == "store_stall":
        failure = Failure(kind, None, now, last)
        proxy.stall(c.stall_seconds)
    else:
        raise ValueError(kind)
    return failure


def _recovered(job: Job, failure: Failure, c: Config, deadline: float) -> None:
    """Wait until the job has run a step after ``failure``, and fill in what it cost."""
    if failure.kind == "store_stall":  # no restart: training must go on meanwhile
        target = failure.last_step_before + 2
        while time.monotonic() < deadline and _newest_step(job) < target and job.running():
            time.sleep(0.05)
        failure.fault_to_first_step_s = 0.0
        return
    while time.monotonic() < deadline:
        rows = job.timeline()
        ready = [r for r in rows if "ready" in r and r["ready"] > failure.injected_at]
        first = [r for r in rows if "t0" in r and ready and r["t0"] > ready[0]["ready"]]
        if first:
            start = ready[0]
            failure.restored_step = start["restored"]
            failure.steps_lost = max(failure.last_step_before - start["restored"], 0)
            failure.fault_to_first_step_s = first[0]["t0"] - failure.injected_at
            restores = [
                e
                for e in job.events()
                if e["event"] == "restore" and e["time"] > failure.injected_at
            ]
            if restores:
                e = restores[0]
                failure.restore_s = float(e.get("seconds", 0.0))
                failure.tier = (
                    "memory"
                    if e.get("tier") == "memory"
                    else "remote"
                    if e.get("bytes_from_remote")
                    else "local"
                )
            failure.restart_s = first[0]["t0"] - failure.injected_at - failure.restore_s
            return
        if job.finished():
            return
        time.sleep(0.05)
    raise TimeoutError(f"no step after the {failure.kind} failure: a hang\n{job.log_tail()}")


def _schedule(rng: random.Random, count: int, only: tuple[str, ...] = ()) -> list[str]:
    """``count`` failure kinds in a seeded order: every kind once (from 5 failures on),
    the rest drawn in MIX's proportions (of the kinds ``only`` names, if any)."""
    mix = {k: n for k, n in MIX.items() if not only or k in only}
    rest = [k for k, n in mix.items() for _ in range(n - 1)]
    rng.shuffle(rest)
    while len(rest) < count:
        rest += rest
    kinds = (list(mix) + rest)[:count]
    rng.shuffle(kinds)
    return kinds


def run_job(root: Path, config: Config, *, failures: bool) -> dict[str, Any]:
    """One job from start to end, with the campaign's failures or without; its result."""
    server, endpoint = start_moto()
    proxy = FaultProxy(endpoint)
    shm_before = set(os.listdir("/dev/shm")) if Path("/dev/shm").is_dir() else set()
    try:
        import boto3

        bucket = f"goodput{uuid.uuid4().hex[:12]}"
        boto3.client(
            "s3", endpoint_url=endpoint, region_name="us-east-1", **_boto_credentials()
        ).create_bucket(Bucket=bucket)
        job = Job(root, f"s3://{bucket}/run", proxy.url, config)
        rng = random.Random(config.seed)
        kinds = _schedule(rng, config.failures, config.kinds) if failures else []
        deadline = time.monotonic() + config.timeout
        job.launch_all()
        done: list[Failure] = []
        next_at = rng.randint(config.min_gap, config.max_gap) + config.memory_every
        for kind in kinds:
            while time.monotonic() < deadline and _newest_step(job) < next_at:
                if job.finished():
                    raise RuntimeError(
                        f"the job ended before failure {len(done)}\n{job.log_tail()}"
                    )
                time.sleep(0.05)
            failure = inject(job, kind, rng, proxy, config)
            _recovered(job, failure, config, deadline)
            done.append(failure)
            next_at = _newest_step(job) + rng.randint(config.min_gap, config.max_gap)
        for node, agent in job.agents.items():
            agent.wait(max(deadline - time.monotonic(), 1))
            if agent.returncode != 0:
                raise RuntimeError(f"node {node} exited {agent.returncode}\n{job.log_tail()}")
        shm_after = set(os.listdir("/dev/shm")) if Path("/dev/shm").is_dir() else set()
        return summarize(job, config, done, sorted(shm_after - shm_before))
    finally:
        proxy.close()
        server.stop()


def _boto_credentials() -> dict[str, str]:
    return {
        "aws_access_key_id": CREDENTIALS["AWS_ACCESS_KEY_ID"],
        "aws_secret_access_key": CREDENTIALS["AWS_SECRET_ACCESS_KEY"],
    }


def summarize(job: Job, c: Config, failures: list[Failure], leaked: list[str]) -> dict[str, Any]:
    rows = job.timeline()
    steps = [r for r in rows if "t0" in r]
    counted: dict[int, dict[str, Any]] = {}
    for r in steps:  # the last attempt of a step is the one the final weights went through
        counted[r["step"]] = r
    lost = [r for r in steps if counted[r["step"]] is not r]
    productive = sum(r["t1"] - r["t0"] for r in counted.values())
    stall = sum(r["t2"] - r["t1"] for r in counted.values())
    lost_work = sum(r["t2"] - r["t0"] for r in lost)
    wall = max(r["t2"] for r in steps) - min(r["t0"] for r in steps)
    events = job.events()

    def mean(values: list[float]) -> float | None:
        return statistics.fmean(values) if values else None

    memory_stall = mean([e["blocked_seconds"] for e in events if e["event"] == "memory_save"])
    local_stall = mean([e["blocked_seconds"] for e in events if e["event"] == "save"])
    saved_bytes = [e["bytes"] for e in events if e["event"] == "save"]

    def restore_s(tier: str) -> float:  # 0.0: no failure restored from it
        return mean([f.restore_s for f in failures if f.tier == tier]) or 0.0

    tiers = {  # uploads run in the background: the remote tier stalls nothing
        "memory": {"stall_s": memory_stall or 0.0, "restore_s": restore_s("memory")},
        "local": {"stall_s": local_stall or 0.0, "restore_s": restore_s("local")},
        "remote": {"stall_s": 0.0, "restore_s": restore_s("remote")},
    }
    per_rank = int(statistics.fmean(saved_bytes) / c.world) if saved_bytes else 0
    # Per-rank persist throughput (goodput_model.py: persist time = bytes / it): a save's
    # start to its copy being complete on that tier.
    persist = {
        "memory": mean([e["seconds"] for e in events if e["event"] == "memory_save"]),
        "local": mean([e["seconds"] for e in events if e["event"] == "save"]),
        "remote": mean([e["seconds"] for e in events if e["event"] == "upload"]),
    }
    for name, tier in tiers.items():
        seconds = persist[name]
        tier["gb_per_s"] = per_rank / seconds / 1e9 if seconds else None
    return {
        "config": asdict(c),
        "wall_s": wall,
        "productive_s": productive,
        "ettr": productive / wall,
        "step_seconds": statistics.median(r["t1"] - r["t0"] for r in counted.values()),
        "steps": len(counted),
        "intervals": {"memory": c.memory_every, "local": c.save_every, "remote": c.save_every},
        "tiers": tiers,
        "state_bytes_per_rank": per_rank,
        "failures": [asdict(f) for f in failures],
        "badput_s": {
            "save_stall": stall,
            "lost_work": lost_work,
            "restart_restore": wall - productive - stall - lost_work,
        },
        "leaked_dev_shm": leaked,
        "losses": {rank: job.losses(rank) for rank in range(c.world)},
        "final": {rank: job.final(rank) for rank in range(c.world)},
    }


def result_json(result: dict[str, Any]) -> dict[str, Any]:
    """What bench/goodput_model.py reads (the losses and final digests left out)."""
    return {k: v for k, v in result.items() if k not in ("losses", "final")}


def compare(campaign: dict[str, Any], reference: dict[str, Any]) -> list[str]:
    """What differs between the failed job and the uninterrupted one ([] if nothing):
    every loss any attempt logged equals the reference's at its step, every step ran,
    and the final states are the same bytes."""
    problems = []
    for rank in reference["losses"]:
        ref = dict(reference["losses"][rank])
        seen = {step for step, _ in campaign["losses"][rank]}
        if seen != set(ref):
            problems.append(f"rank {rank}: steps {sorted(set(ref) ^ seen)[:5]} differ")
        wrong = [(s, v) for s, v in campaign["losses"][rank] if ref.get(s) != v]
        if wrong:
            problems.append(f"rank {rank}: losses differ at steps {[s for s, _ in wrong[:5]]}")
        if campaign["final"][rank] != reference["final"][rank]:
            problems.append(f"rank {rank}: final state differs")
    return problems


def table(result: dict[str, Any]) -> str:
    lines = [
        "| # | failure | tier restored | steps lost | fault -> first step (s) | restore (s) |",
        "|---|---|---|---|---|---|",
    ]
    for i, f in enumerate(result["failures"], 1):
        lines.append(
            f"| {i} | {f['kind']} | {f['tier'] or '-'} | {f['steps_lost']} "
            f"| {f['fault_to_first_step_s']:.1f} | {f['restore_s']:.2f} |"
        )
    b = result["badput_s"]
    wall = result["wall_s"]
    lines += [
        "",
        f"wall {wall:.1f} s, productive {result['productive_s']:.1f} s: "
        f"ETTR {result['ettr']:.1%}; badput: save stall {b['save_stall'] / wall:.1%}, "
        f"lost work {b['lost_work'] / wall:.1%}, "
        f"restart + restore {b['restart_restore'] / wall:.1%}",
    ]
    return "\n".join(lines)


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--failures", type=int, default=Config.failures)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--memory-every", type=int, default=Config.memory_every)
    p.add_argument("--save-every", type=int, default=Config.save_every)
    p.add_argument("--step-seconds", type=float, default=Config.step_seconds)
    p.add_argument("--dir", type=Path, default=None)
    p.add_argument("--json", type=Path, default=None)
    p.add_argument("--keep", action="store_true", help="keep the jobs' directories")
    args = p.parse_args()
    config = Config(
        failures=args.failures,
        seed=args.seed,
        memory_every=args.memory_every,
        save_every=args.save_every,
        step_seconds=args.step_seconds,
    )
    root = Path(tempfile.mkdtemp(dir=args.dir, prefix="goodput-"))
    try:
        reference = run_job(root / "reference", config, failures=False)
        campaign = run_job(root / "campaign", config, failures=True)
    finally:
        if not args.keep:
            shutil.rmtree(root, ignore_errors=True)
    if args.keep:  # `shardpoint report DIR/campaign/node0/nvme` draws its timeline
        print(f"kept {root}")
    problems = compare(campaign, reference)
    print(table(campaign))
    print(f"uninterrupted: ETTR {reference['ettr']:.1%} (save stall only)")
    print("bit-identical to the uninterrupted run" if not problems else "\n".join(problems))
    print(f"leaked /dev/shm entries: {campaign['leaked_dev_shm'] or 'none'}")
    if args.json:
        out = result_json(campaign)
        out["reference_ettr"] = reference["ettr"]
        out["bit_identical"] = not problems
        args.json.write_text(json.dumps(out, indent=2))
    return 1 if problems else 0


if __name__ == "__main__":
    raise SystemExit(main())
