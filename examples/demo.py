"""Crash a training run with SIGKILL, resume it, and show it continues bit for bit.

Trains the character-level transformer of ``train_char_lm.py`` twice in ``runs/demo``:
once without interruption, once killed hard at a random step and started again
(it resumes from its newest valid checkpoint). Then it compares the per-step losses
and final weights of both runs, prints a table, and plots both loss curves.

    python examples/demo.py                       # 300 steps, crash at a random step
    python examples/demo.py --steps 1000 --crash-at 537
    python examples/demo.py --no-crash            # just train (resuming if interrupted)
"""

from __future__ import annotations

import argparse
import json
import os
import random
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
TRAIN = HERE / "train_char_lm.py"


def train(run_dir: Path, steps: int, save_every: int, *extra: str) -> subprocess.CompletedProcess:
    cmd = [
        sys.executable,
        str(TRAIN),
        "--run-dir",
        str(run_dir),
        "--steps",
        str(steps),
        "--save-every",
        str(save_every),
        *extra,
    ]
    print(f"$ {' '.join(cmd[1:])}", flush=True)
    # Own session, output to files: a run killed on purpose leaves DataLoader workers
    # behind for a while, and they must neither hold our pipes open nor outlive the demo.
    with tempfile.TemporaryFile() as out, tempfile.TemporaryFile() as err:
        proc = subprocess.Popen(cmd, stdout=out, stderr=err, start_new_session=True)
        code = proc.wait()
        try:
            os.killpg(proc.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
        out.seek(0)
        err.seek(0)
        done = subprocess.CompletedProcess(cmd, code, out.read().decode(), err.read().decode())
    for line in done.stdout.splitlines():
        print(f"    {line}")
    if done.returncode not in (0, -9):
        sys.stderr.write(done.stderr)
        raise SystemExit(f"training failed with exit code {done.returncode}")
    return done


def losses(run_dir: Path) -> dict[int, float]:
    """Each step's loss; a step re-run after the resume replaces the killed run's value."""
    out: dict[int, float] = {}
    for line in (run_dir / "losses.jsonl").read_text().splitlines():
        record = json.loads(line)
        out[record["step"]] = float.fromhex(record["loss"])
    return out


def plot(
    path: Path, reference: dict[int, float], resumed: dict[int, float], crash: int | None
) -> bool:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print("(matplotlib is not installed: no plot)")
        return False
    fig, ax = plt.subplots(figsize=(8, 4.5), dpi=110)
    steps = sorted(reference)
    ax.plot(steps, [reference[s] for s in steps], lw=3, alpha=0.45, label="uninterrupted run")
    steps = sorted(resumed)
    ax.plot(
        steps,
        [resumed[s] for s in steps],
        lw=1.2,
        ls="--",
        color="black",
        label="killed and resumed run",
    )
    if crash is not None:
        ax.axvline(crash, color="red", lw=1, label=f"SIGKILL at step {crash}")
    ax.set_xlabel("step")
    ax.set_ylabel("training loss")
    ax.set_title("shardpoint: resumed training is bit-identical")
    ax.legend()
    fig.tight_layout()
    fig.savefig(path)
    return True


def main() -> None:
    p = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    p.add_argument("--dir", type=Path, default=Path("runs/demo"))
    p.add_argument("--steps", type=int, default=300)
    p.add_argument("--save-every", type=int, default=25)
    p.add_argument("--crash-at", type=int, default=None, help="default: a random step")
    p.add_argument("--no-crash", action="store_true", help="only train (and resume) the run")
    args = p.parse_args()
    start = time.monotonic()

    if args.no_crash:
        train(args.dir / "run", args.steps, args.save_every)
        return

    crash = args.crash_at or random.randint(args.save_every + 1, args.steps - 1)
    reference_dir, resumed_dir = args.dir / "uninterrupted", args.dir / "resumed"
    for d in (reference_dir, resumed_dir):
        shutil.rmtree(d, ignore_errors=True)

    print(f"1. uninterrupted run of {args.steps} steps")
    train(reference_dir, args.steps, args.save_every)
    print(f"2. the same run, killed with SIGKILL at step {crash}")
    killed = train(resumed_dir, args.steps, args.save_every, "--crash-at", str(crash))
    assert killed.returncode == -9, "the run was supposed to be killed"
    print("3. started again: it resumes from its newest valid checkpoint")
    train(resumed_dir, args.steps, args.save_every)

    reference, resumed = losses(reference_dir), losses(resumed_dir)
    shown = sorted(
        {1, crash - 1, crash, crash + 1, args.steps} | set(range(0, args.steps + 1, 50)) - {0}
    )
    print(f"\n{'step':>6}  {'uninterrupted loss':>20}  {'resumed loss':>20}  identical")
    for s in shown:
        same = "yes" if reference.get(s) == resumed.get(s) else "NO"
        print(f"{s:>6}  {reference[s]:>20.15f}  {resumed[s]:>20.15f}  {same}")
    identical = sum(reference[s] == resumed.get(s) for s in reference)
    final_a = json.loads((reference_dir / "final.json").read_text())["params_sha256"]
    final_b = json.loads((resumed_dir / "final.json").read_text())["params_sha256"]
    print(
        f"\nlosses bit-identical at {identical} of {len(reference)} steps; "
        f"final weights {'identical' if final_a == final_b else 'DIFFERENT'} "
        f"(sha256 {final_a[:16]}...)"
    )
    png = args.dir / "loss_curves.png"
    if plot(png, reference, resumed, crash):
        print(f"plot: {png}")
    print(
        f"checkpoints: {resumed_dir / 'checkpoints'} "
        f"(try: shardpoint inspect {sorted((resumed_dir / 'checkpoints').glob('step-*'))[-1]})"
    )
    print(f"demo took {time.monotonic() - start:.0f} s")
    if identical != len(reference) or final_a != final_b:
        raise SystemExit("the resumed run diverged from the uninterrupted one")


if __name__ == "__main__":
    main()
