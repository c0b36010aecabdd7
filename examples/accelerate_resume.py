"""An Accelerate training loop with shardpoint checkpoints, killed and resumed exactly.

    python examples/accelerate_resume.py --run-dir runs/acc/a --steps 40
    python examples/accelerate_resume.py --run-dir runs/acc/b --steps 40 --crash-at 23
    python examples/accelerate_resume.py --run-dir runs/acc/b --steps 40     # resumes
    torchrun --nproc-per-node 2 examples/accelerate_resume.py --run-dir runs/acc/ddp

A small MLP with dropout on random regression data, AdamW with a step schedule, the
data loader prepared as Accelerate's stateful loader (so its position is saved), a
checkpoint every 5 steps by a ``CheckpointManager`` of ``accelerator_state(...)``.
Every step's loss goes to ``RUN_DIR/losses-rank<R>.jsonl`` (``float.hex``);
``--crash-at STEP`` SIGKILLs the process after that step, ``--sigterm-at STEP`` sends
it SIGTERM (the manager saves at once; the script exits with 143).
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import sys
from pathlib import Path

import torch
from accelerate import Accelerator
from accelerate.utils import DataLoaderConfiguration, set_seed
from torch import nn

from shardpoint import CheckpointManager, RetentionPolicy, SavePolicy
from shardpoint.integrations.accelerate import accelerator_state


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--run-dir", type=Path, required=True)
    p.add_argument("--steps", type=int, default=40)
    p.add_argument("--crash-at", type=int, help="SIGKILL after this step")
    p.add_argument("--sigterm-at", type=int, help="SIGTERM after this step")
    args = p.parse_args(argv)
    args.run_dir.mkdir(parents=True, exist_ok=True)
    torch.set_num_threads(1)
    accelerator = Accelerator(
        cpu=True,
        # Stateful: the position is saved; seedable: each epoch's order follows from the seed
        # and the epoch (a plain RandomSampler draws it from the global stream).
        dataloader_config=DataLoaderConfiguration(
            use_stateful_dataloader=True, use_seedable_sampler=True
        ),
    )
    rank = accelerator.process_index
    set_seed(0)
    model = nn.Sequential(nn.Linear(8, 64), nn.ReLU(), nn.Dropout(0.3), nn.Linear(64, 1))
    optimizer = torch.optim.AdamW(model.parameters(), lr=0.01)
    scheduler = torch.optim.lr_scheduler.StepLR(optimizer, 7, 0.5)
    data = torch.randn(200, 9, generator=torch.Generator().manual_seed(1))
    # A generator of its own: starting an epoch draws its seed from it, not from the
    # global stream that dropout uses (which a resume restores before that draw).
    loader = torch.utils.data.DataLoader(
        data, batch_size=8, shuffle=True, generator=torch.Generator().manual_seed(2)
    )
    model, optimizer, scheduler, loader = accelerator.prepare(model, optimizer, scheduler, loader)
    set_seed(100 + rank)  # each rank its own dropout masks

    state = accelerator_state(accelerator)
    train = state["train"]  # a TrainState: its step and epoch counters are saved too
    checkpoints = CheckpointManager(
        args.run_dir / "checkpoints", SavePolicy(every_n_steps=5), RetentionPolicy(keep_last=2)
    )
    checkpoints.restore(state)  # the newest valid checkpoint, if there is one
    signals = {args.crash_at: signal.SIGKILL, args.sigterm_at: signal.SIGTERM}
    log = args.run_dir / f"losses-rank{rank}.jsonl"
    while train.step < args.steps and not checkpoints.should_stop:
        loader.set_epoch(train.epoch)
        for batch in loader:  # a restored loader goes on from its saved position
            loss = nn.functional.mse_loss(model(batch[:, :8]), batch[:, 8:])
            accelerator.backward(loss)
            optimizer.step()
            scheduler.step()
            optimizer.zero_grad()
            train.step += 1
            with open(log, "a") as f:
                f.write(json.dumps({"step": train.step, "loss": loss.item().hex()}) + "\n")
            if train.step in signals:
                os.kill(os.getpid(), signals[train.step])
            checkpoints.maybe_save(train.step, state)
            if checkpoints.should_stop or train.step == args.steps:
                break
        else:
            train.epoch += 1
    checkpoints.close()
    if rank == 0 and not checkpoints.should_stop:
        weights = {k: v.tolist() for k, v in accelerator.unwrap_model(model).state_dict().items()}
        (args.run_dir / "final.json").write_text(json.dumps(weights))
    # Every rank done, the group down, then exit at once: Python's own teardown after a
    # gloo group sometimes aborted ("terminate called without an active exception")
    # here; the work is done.
    distributed = accelerator.num_processes > 1
    accelerator.wait_for_everyone()
    accelerator.end_training()
    if distributed:
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(checkpoints.exit_code)
    return checkpoints.exit_code


if __name__ == "__main__":
    raise SystemExit(main())
