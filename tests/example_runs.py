"""Running the framework examples (examples/*_resume.py) as a user would, in one process
or under torchrun, and reading what they log: each rank's loss at every step
(``float.hex``), in the order the steps ran."""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
from pathlib import Path

EXAMPLES = Path(__file__).resolve().parents[1] / "examples"


def run_example(
    script: str, run_dir: Path, *extra: str, ranks: int = 1, steps: int = 40
) -> subprocess.CompletedProcess:
    """``examples/<script> --run-dir RUN_DIR --steps STEPS EXTRA...``; with ``ranks``
    > 1 under torchrun (gloo, a free port)."""
    args = [str(EXAMPLES / script), "--run-dir", str(run_dir), "--steps", str(steps), *extra]
    if ranks > 1:
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
        launch = ["-m", "torch.distributed.run", "--nproc-per-node", str(ranks)]
        args = [*launch, "--master-port", str(port), *args]
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    return subprocess.run(
        [sys.executable, *args], capture_output=True, text=True, timeout=300, env=env
    )


def losses(run_dir: Path, rank: int = 0) -> dict[int, str]:
    """Each step's loss; a step run again after a resume overrides the earlier one."""
    return {record["step"]: record["loss"] for record in _records(run_dir, rank)}


def steps_run(run_dir: Path, rank: int = 0) -> list[int]:
    """The steps in the order they ran (a resume repeats those after its checkpoint)."""
    return [record["step"] for record in _records(run_dir, rank)]


def _records(run_dir: Path, rank: int) -> list[dict]:
    lines = (run_dir / f"losses-rank{rank}.jsonl").read_text().splitlines()
    return [json.loads(line) for line in lines]
