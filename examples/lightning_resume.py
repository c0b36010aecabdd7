"""PyTorch Lightning with shardpoint checkpoints, killed and resumed exactly.

    python examples/lightning_resume.py --run-dir runs/lt/a --steps 40
    python examples/lightning_resume.py --run-dir runs/lt/b --steps 40 --crash-at 23
    python examples/lightning_resume.py --run-dir runs/lt/b --steps 40      # resumes
    torchrun --nproc-per-node 2 examples/lightning_resume.py --run-dir runs/lt/ddp

A small MLP with dropout on random regression data, AdamW with a step schedule, a
torchdata ``StatefulDataLoader`` (seeded shuffling; under DDP a
``StatefulDistributedSampler``), a checkpoint every 5 steps by ``ModelCheckpoint``
(``last.ckpt``) written by ``ShardpointCheckpointIO``, every rank's random streams saved
by ``ResumableRNG``.
Every step's loss goes to ``RUN_DIR/losses-rank<R>.jsonl`` (``float.hex``);
``--crash-at STEP`` SIGKILLs the process after that step, ``--sigterm-at STEP`` sends it
SIGTERM (``SaveOnPreemption`` saves and exits with 143). Started again, it resumes from
``last.ckpt``. ``--own-checkpoints`` uses Lightning's own checkpoint files instead.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import sys
import time
from pathlib import Path
from typing import Any

import lightning as L
import torch
from lightning.pytorch.strategies import ModelParallelStrategy
from torch import nn
from torch.distributed.fsdp import fully_shard
from torchdata.stateful_dataloader import StatefulDataLoader
from torchdata.stateful_dataloader.sampler import RandomSampler, StatefulDistributedSampler

from shardpoint.integrations.lightning import (
    ResumableRNG,
    SaveOnPreemption,
    ShardpointCheckpointIO,
    ShardpointModelParallelStrategy,
)


class Regressor(L.LightningModule):
    def __init__(self, log: Path, hidden: int, fsdp: bool = False) -> None:
        super().__init__()
        self.fsdp = fsdp
        self.net = nn.Sequential(
            nn.Linear(8, hidden),
            nn.ReLU(),
            nn.Dropout(0.3),
            nn.Linear(hidden, hidden),
            nn.ReLU(),
            nn.Linear(hidden, 1),
        )
        self.log_path = log

    def configure_model(self) -> None:
        if self.fsdp:  # FSDP2: every linear layer's parameters sharded over the ranks
            mesh = self.device_mesh["data_parallel"]
            for layer in self.net:
                if isinstance(layer, nn.Linear):
                    fully_shard(layer, mesh=mesh)
            fully_shard(self.net, mesh=mesh)

    def training_step(self, batch: torch.Tensor, index: int) -> torch.Tensor:
        x, y = batch[:, :8], batch[:, 8:]
        loss = nn.functional.mse_loss(self.net(x), y)
        with open(self.log_path, "a") as f:
            f.write(json.dumps({"step": self.global_step + 1, "loss": loss.item().hex()}) + "\n")
        return loss

    def configure_optimizers(self) -> Any:
        opt = torch.optim.AdamW(self.parameters(), lr=0.01)
        return {"optimizer": opt, "lr_scheduler": torch.optim.lr_scheduler.StepLR(opt, 7, 0.5)}


class TimedCheckpoint(L.pytorch.callbacks.ModelCheckpoint):
    """``ModelCheckpoint`` that records how long training waited at each step it saved
    (its top-k file and ``last.ckpt``, removals included): ``RUN_DIR/saves-rank<R>.jsonl``."""

    def __init__(self, timings: Path, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self.timings = timings

    def on_train_batch_end(self, trainer: Any, *args: Any) -> None:
        started = time.perf_counter()
        super().on_train_batch_end(trainer, *args)
        every = self._every_n_train_steps
        if every and trainer.global_step % every == 0:
            seconds = time.perf_counter() - started
            with open(self.timings, "a") as f:
                f.write(json.dumps({"step": trainer.global_step, "seconds": seconds}) + "\n")


class SignalAt(L.Callback):
    """Sends this process a signal after a given step: ``{step: signal}``."""

    def __init__(self, signals: dict[int | None, int]) -> None:
        self.signals = signals

    def on_train_batch_end(self, trainer: Any, *args: Any) -> None:
        if trainer.global_step in self.signals:
            os.kill(os.getpid(), self.signals[trainer.global_step])


def _whole(tensor: torch.Tensor) -> torch.Tensor:
    """A sharded (DTensor) parameter gathered whole; a plain one as it is."""
    return tensor.full_tensor() if hasattr(tensor, "full_tensor") else tensor


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__)
    p.add_argument("--run-dir", type=Path, required=True)
    p.add_argument("--steps", type=int, default=40)
    p.add_argument("--crash-at", type=int, default=None, help="SIGKILL after this step")
    p.add_argument("--sigterm-at", type=int, default=None, help="SIGTERM after this step")
    p.add_argument("--without-rng", action="store_true", help="leave ResumableRNG out")
    p.add_argument("--own-checkpoints", action="store_true", help="Lightning's own files")
    p.add_argument("--async-save", action="store_true", help="shardpoint: in background")
    p.add_argument("--hidden", type=int, default=32, help="width of the MLP's hidden layer")
    p.add_argument("--fsdp", action="store_true", help="FSDP2 (ModelParallelStrategy)")
    p.add_argument(
        "--every-n-steps", type=int, default=5, help="ModelCheckpoint's interval (0: each epoch)"
    )
    args = p.parse_args(argv)
    rank, world = int(os.environ.get("RANK", 0)), int(os.environ.get("WORLD_SIZE", 1))
    args.run_dir.mkdir(parents=True, exist_ok=True)
    torch.set_num_threads(1)
    L.seed_everything(rank, verbose=False)  # each rank its own dropout masks
    data = torch.randn(100 * world, 9, generator=torch.Generator().manual_seed(1))
    # The sampler owns its generator: torchdata saves it (not a loader's ``generator``).
    sampler: Any = RandomSampler(data, generator=torch.Generator().manual_seed(2))
    if world > 1 and args.fsdp:
        # ShardpointModelParallelStrategy keeps each rank's loader state: each rank its
        # own part of the data and its own shuffling generator.
        data = data[rank::world]
        sampler = RandomSampler(data, generator=torch.Generator().manual_seed(2 + rank))
    elif world > 1:
        # Lightning stores rank 0's loader state for every rank: a sampler whose
        # position is the same number on every rank (its own part of each epoch's
        # permutation) resumes every rank exactly; rank-specific generators would not.
        sampler = StatefulDistributedSampler(data, num_replicas=world, rank=rank, seed=2)
    # The loader's own generator: starting an epoch draws a seed from it, not from the
    # global stream ResumableRNG restores (a resume from an epoch's end would be off).
    loader = StatefulDataLoader(
        data, batch_size=8, sampler=sampler, generator=torch.Generator().manual_seed(3)
    )
    checkpoints = args.run_dir / "checkpoints"
    last = checkpoints / "last.ckpt"
    callbacks: list[Any] = [
        TimedCheckpoint(
            args.run_dir / f"saves-rank{rank}.jsonl",
            dirpath=checkpoints,
            every_n_train_steps=args.every_n_steps,
            save_last=True,
        ),
        SignalAt({args.crash_at: signal.SIGKILL, args.sigterm_at: signal.SIGTERM}),
    ]
    if not args.without_rng:
        callbacks.append(ResumableRNG())
    if not args.own_checkpoints:
        callbacks.append(SaveOnPreemption())
    strategy: Any = "ddp" if world > 1 else "auto"
    if args.fsdp:
        own = args.own_checkpoints
        # Every rank data-parallel (the default would put the ranks of a node on the
        # tensor-parallel dimension, which this model does not use).
        mesh = {"data_parallel_size": world, "tensor_parallel_size": 1}
        strategy = (ModelParallelStrategy if own else ShardpointModelParallelStrategy)(**mesh)
    trainer = L.Trainer(
        max_steps=args.steps,
        accelerator="cpu",
        devices=world,
        strategy=strategy,
        use_distributed_sampler=False,  # the sampler above is already the one to use
        plugins=[]
        if args.own_checkpoints or args.fsdp
        else [ShardpointCheckpointIO(args.async_save)],
        callbacks=callbacks,
        default_root_dir=args.run_dir,
        enable_progress_bar=False,
        enable_model_summary=False,
        logger=False,
    )
    model = Regressor(args.run_dir / f"losses-rank{rank}.jsonl", args.hidden, args.fsdp)
    trainer.fit(model, loader, ckpt_path="last" if last.exists() else None)
    weights = {k: _whole(v).tolist() for k, v in model.state_dict().items()}  # collective
    if rank == 0:
        (args.run_dir / "final.json").write_text(json.dumps(weights))
    if torch.distributed.is_initialized():
        # Lightning leaves the process group up. Every rank done, the group down, then
        # exit at once: Python's own teardown after a gloo group sometimes aborted
        # ("terminate called without an active exception") here; the work is done.
        torch.distributed.barrier()
        torch.distributed.destroy_process_group()
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(0)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
