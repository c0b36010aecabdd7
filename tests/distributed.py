"""Running a test function on N CPU processes joined by a gloo process group."""

from __future__ import annotations

import multiprocessing
import os
import signal
import socket
import sys
import time
import traceback
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch.distributed as dist
import torch.multiprocessing as mp


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _entry(rank: int, world_size: int, port: int, fn: Callable[..., Any], args: tuple) -> None:
    os.environ["OMP_NUM_THREADS"] = "1"
    dist.init_process_group(
        "gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world_size
    )
    fn(rank, world_size, *args)
    # Everyone finishes before anyone leaves: rank 0 hosts the store the others use.
    dist.barrier()
    # Leave without running gloo's C++ teardown, which intermittently aborts ("terminate
    # called without an active exception") after all work is done; failures above have
    # already raised.
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


RUN_RANKS_TIMEOUT = 300.0  # seconds: the slowest test using it takes well under a minute


def run_ranks(
    world_size: int, fn: Callable[..., Any], *args: Any, timeout: float = RUN_RANKS_TIMEOUT
) -> None:
    """Run ``fn(rank, world_size, *args)`` on ``world_size`` processes; re-raise failures.
    Ranks still running after ``timeout`` seconds are killed and the test fails: a hang
    (one rank left alone in a collective) is a defect, reported as one."""
    context = mp.start_processes(
        _entry,
        args=(world_size, _free_port(), fn, args),
        nprocs=world_size,
        start_method="spawn",
        join=False,
    )
    deadline = time.monotonic() + timeout
    while not context.join(max(deadline - time.monotonic(), 0.1)):
        if time.monotonic() >= deadline:
            alive = [rank for rank, p in enumerate(context.processes) if p.is_alive()]
            for p in context.processes:
                if p.is_alive():
                    p.kill()
            raise TimeoutError(
                f"ranks {alive} of {world_size} still running after {timeout:.0f} s: a hang"
            )


@dataclass(frozen=True)
class RankOutcome:
    """How one rank's process ended."""

    rank: int
    exitcode: int | None  # negative: killed by that signal; None: still running at the timeout
    exception: str  # "module.Type: message" of the exception the rank raised ("" if none)
    error: str  # its traceback

    @property
    def killed_by_sigkill(self) -> bool:
        return self.exitcode == -signal.SIGKILL

    def __str__(self) -> str:
        if self.exitcode is None:
            how = "hung (killed at the timeout)"
        elif self.exitcode < 0:
            how = f"killed by {signal.Signals(-self.exitcode).name}"
        else:
            how = f"exit code {self.exitcode}"
        return f"rank {self.rank}: {how}" + (f"\n{self.error}" if self.error else "")


def _reporting_entry(
    rank: int, world_size: int, port: int, fn: Callable[..., Any], args: tuple, errors: str
) -> None:
    try:
        _entry(rank, world_size, port, fn, args)  # leaves with os._exit(0)
    except BaseException as exc:
        kind = f"{type(exc).__module__}.{type(exc).__qualname__}"
        head = f"{kind}: {exc}".replace("\n", " ")  # one line
        Path(errors, f"rank{rank}.err").write_text(f"{head}\n{traceback.format_exc()}")
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(1)


def run_ranks_outcomes(
    world_size: int,
    fn: Callable[..., Any],
    *args: Any,
    errors: str | os.PathLike[str],
    timeout: float = 120.0,
    start_method: str = "fork",
) -> list[RankOutcome]:
    """Run ``fn(rank, world_size, *args)`` on ``world_size`` processes and say how each
    one ended, without stopping the others when one dies (unlike ``run_ranks``).

    A rank that raises writes its exception and traceback to ``errors/rank{N}.err`` and
    exits with code 1; one killed by a signal reports it; one still running after
    ``timeout`` seconds is killed and reported as hung. ``fork`` (the default) starts in
    milliseconds instead of seconds, for tests that start hundreds of jobs.
    """
    Path(errors).mkdir(parents=True, exist_ok=True)
    for stale in Path(errors).glob("rank*.err"):
        stale.unlink()
    ctx = multiprocessing.get_context(start_method)
    port = _free_port()
    procs = [
        ctx.Process(
            target=_reporting_entry, args=(rank, world_size, port, fn, args, os.fspath(errors))
        )
        for rank in range(world_size)
    ]
    for p in procs:
        p.start()
    deadline = time.monotonic() + timeout
    outcomes = []
    for rank, p in enumerate(procs):
        p.join(max(0.0, deadline - time.monotonic()))
        exitcode = p.exitcode
        if exitcode is None:
            p.kill()
            p.join()
        error_file = Path(errors, f"rank{rank}.err")
        exception, _, error = (error_file.read_text() if error_file.exists() else "").partition(
            "\n"
        )
        outcomes.append(RankOutcome(rank, exitcode, exception, error))
    return outcomes


def count_disk_reads(under: str | os.PathLike[str]) -> list[int]:
    """Count the bytes this process reads from local directories under ``under`` from
    now on: the returned one-item list's value (``LocalDirectory.read_ranges`` wrapped)."""
    from shardpoint.storage.local import LocalDirectory

    total = [0]
    real = LocalDirectory.read_ranges
    prefix = str(under)

    def counting(self, requests, **kwargs):  # noqa: ANN001, ANN003, ANN202
        if str(self.root).startswith(prefix):
            total[0] += sum(s.end - s.offset for ss in requests.values() for s in ss)
        return real(self, requests, **kwargs)

    LocalDirectory.read_ranges = counting
    return total


def count_received(log: list[tuple[str, int]]) -> None:
    """Record every torch.distributed call of this rank and the bytes it received."""

    def size(tensors) -> int:
        return sum(t.numel() * t.element_size() for t in tensors)

    received = {
        "all_gather": lambda out, *a, **k: size(out),
        "all_reduce": lambda t, *a, **k: size([t]),
        "all_to_all_single": lambda out, *a, **k: size([out]),
        "gather": lambda t, out=None, *a, **k: size(out or []),
        "scatter": lambda t, *a, **k: size([t]),
        "broadcast": lambda t, src, *a, **k: 0 if dist.get_rank() == src else size([t]),
        "recv": lambda t, *a, **k: size([t]),
        "send": lambda t, *a, **k: 0,
        "barrier": lambda *a, **k: 0,
    }
    for name, counter in received.items():
        real = getattr(dist, name)

        def counted(*args, _real=real, _name=name, _counter=counter, **kwargs):
            result = _real(*args, **kwargs)
            log.append((_name, _counter(*args, **kwargs)))
            return result

        setattr(dist, name, counted)
