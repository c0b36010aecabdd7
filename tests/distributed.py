"""Running a test function on N CPU processes joined by a gloo process group."""

from __future__ import annotations

import os
import socket
import sys
from collections.abc import Callable
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


def run_ranks(world_size: int, fn: Callable[..., Any], *args: Any) -> None:
    """Run ``fn(rank, world_size, *args)`` on ``world_size`` processes; re-raise failures."""
    mp.start_processes(
        _entry, args=(world_size, _free_port(), fn, args), nprocs=world_size, start_method="spawn"
    )
