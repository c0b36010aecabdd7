"""Each framework's own checkpointing vs shardpoint's integration, on the same run.

    python bench/bench_integrations.py [--only hf|lightning] [--steps 40]

Runs examples/hf_trainer_resume.py (GPT-2, 6 layers × 512 wide, AdamW) and
examples/lightning_resume.py (MLP 4096 wide, AdamW) as a user would, each several
times: uninterrupted; SIGKILLed after step 23 and started again; sent SIGTERM after
step 17 and started again; for the Trainer also SIGKILLed inside the save of step 20
(just before its last file / its commit) and started again. It reports whether each
resumed run's per-step losses (``float.hex``) and final weights equal the
uninterrupted run's, what SIGTERM left, how long training waited per save (median of
the uninterrupted run's saves after the first), and the size of one checkpoint.
"""

from __future__ import annotations

import argparse
import json
import shutil
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
HF = [str(ROOT / "examples" / "hf_trainer_resume.py"), "--width", "512", "--layers", "6"]
LIGHTNING = [str(ROOT / "examples" / "lightning_resume.py"), "--hidden", "4096"]


def _run(script: list[str], run_dir: Path, steps: int, *extra: str) -> int:
    args = [sys.executable, *script, "--run-dir", str(run_dir), "--steps", str(steps), *extra]
    done = subprocess.run(args, capture_output=True, text=True, timeout=1800)
    if done.returncode not in (0, -9, 143):
        tail = done.stderr.strip().splitlines()[-1:] or [""]
        print(f"    {Path(script[0]).name} {' '.join(extra)}: exit {done.returncode} {tail[0]}")
    return done.returncode


def _losses(run_dir: Path) -> dict[int, str]:
    out: dict[int, str] = {}
    for line in (run_dir / "losses-rank0.jsonl").read_text().splitlines():
        record = json.loads(line)
        out[record["step"]] = record["loss"]
    return out


def _final(run_dir: Path) -> Any:
    path = run_dir / "final.json"
    if not path.exists():
        return None
    final = json.loads(path.read_text())
    final.pop("seconds", None)
    return final


def _same(run_dir: Path, reference: Path) -> str:
    if _final(run_dir) is None:
        return "no (did not finish)"
    same = _losses(run_dir) == _losses(reference) and _final(run_dir) == _final(reference)
    return "yes" if same else "no (losses differ)"


def _save_seconds(run_dir: Path) -> float:
    lines = (run_dir / "saves-rank0.jsonl").read_text().splitlines()
    return statistics.median(json.loads(line)["seconds"] for line in lines[1:])


def _size(path: Path) -> int:
    path = path.resolve()
    if path.is_file():
        return path.stat().st_size
    return sum(p.stat().st_size for p in path.rglob("*") if p.is_file())


def _scenario(
    script: list[str], work: Path, steps: int, mode: list[str], crash_in_save: bool
) -> dict[str, Any]:
    ref = work / "reference"
    assert _run(script, ref, steps, *mode) == 0
    row: dict[str, Any] = {"save_seconds": _save_seconds(ref)}
    killed = work / "killed"
    _run(script, killed, steps, *mode, "--crash-at", "23")
    code = _run(script, killed, steps, *mode)
    row["sigkill_resume"] = _same(killed, ref) if code == 0 else f"no (exit {code})"
    term = work / "sigterm"
    row["sigterm_exit"] = _run(script, term, steps, *mode, "--sigterm-at", "17")
    code = _run(script, term, steps, *mode)
    steps_run = [json.loads(x)["step"] for x in (term / "losses-rank0.jsonl").open()]
    row["sigterm_steps_lost"] = len(steps_run) - steps
    row["sigterm_resume"] = _same(term, ref) if code == 0 else f"no (exit {code})"
    if crash_in_save:
        torn = work / "crash-in-save"
        _run(script, torn, steps, *mode, "--crash-in-save", "20")
        code = _run(script, torn, steps, *mode)
        row["crash_in_save_resume"] = _same(torn, ref) if code == 0 else f"no (exit {code})"
    row["checkpoint_bytes"] = _checkpoint_size(ref, steps)
    return row


def _checkpoint_size(run: Path, steps: int) -> int:
    for candidate in (
        run / "out" / f"checkpoint-{steps}",
        run / "out" / "checkpoints" / f"step-{steps:09d}",
        run / "checkpoints" / "last.ckpt",
    ):
        if candidate.exists():
            return _size(candidate)
    raise FileNotFoundError(f"no checkpoint of step {steps} under {run}")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--only", choices=["hf", "lightning"])
    parser.add_argument("--steps", type=int, default=40)
    parser.add_argument("--keep", action="store_true", help="keep the run directories")
    args = parser.parse_args(argv)
    frameworks = {
        "hf": (HF, True, {"Trainer's own": ["--own-checkpoints"]}),
        "lightning": (
            LIGHTNING,
            False,
            {"Lightning's own": ["--own-checkpoints", "--without-rng"]},
        ),
    }
    results: dict[str, dict[str, Any]] = {}
    for name, (script, crash_in_save, own) in frameworks.items():
        if args.only and args.only != name:
            continue
        modes = {**own, "shardpoint": [], "shardpoint async": ["--async-save"]}
        for label, mode in modes.items():
            work = Path(tempfile.mkdtemp(prefix=f"bench-{name}-"))
            row = _scenario(script, work, args.steps, mode, crash_in_save)
            if args.keep:
                print(f"    runs kept in {work}")
            else:
                shutil.rmtree(work, ignore_errors=True)
            results[f"{name}: {label}"] = row
            print(f"{name}: {label}: {json.dumps(row)}", flush=True)
    print()
    keys = sorted({k for row in results.values() for k in row})
    print("| run | " + " | ".join(keys) + " |")
    print("|---" * (len(keys) + 1) + "|")
    for label, row in results.items():
        cells = []
        for k in keys:
            v = row.get(k, "–")
            cells.append(f"{v:.3f}" if isinstance(v, float) else str(v))
        print(f"| {label} | " + " | ".join(cells) + " |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
