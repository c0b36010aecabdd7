"""A small character-level transformer trained on Python's own standard library source.

Checkpoints every ``--save-every`` steps with a ``CheckpointManager`` and resumes from
the newest valid checkpoint when started again with the same ``--run-dir``. Every
step's loss is appended to ``RUN_DIR/losses.jsonl`` (exact, as ``float.hex``).

    python examples/train_char_lm.py --run-dir runs/demo/a --steps 300
    python examples/train_char_lm.py --run-dir runs/demo/b --steps 300 --crash-at 137

``--crash-at STEP`` kills the process with SIGKILL at that step (``--crash-phase``
``after-step``: right after the step and any save; ``during-save``: after the shard
files of that step's checkpoint are written, before it is committed). Start the same
command again without ``--crash-at`` to resume. ``--freeze-base`` trains only the output
layer (a fine-tune of a frozen base) and saves incrementally: each checkpoint writes
what changed and refers to the earlier files for the rest. SIGTERM makes it save and exit with
code 143 (128 + SIGTERM), the usual "preempted, requeue me" convention.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import math
import os
import signal
import sys
import sysconfig
from pathlib import Path

import torch
from torch import nn

from shardpoint import CheckpointManager, ResumableLoader, RetentionPolicy, SavePolicy, TrainState

# Fixed files of the standard library: present on every Python installation.
CORPUS_FILES = ["textwrap.py", "heapq.py", "bisect.py", "functools.py", "argparse.py"]


def corpus(limit: int = 400_000) -> torch.Tensor:
    root = Path(sysconfig.get_paths()["stdlib"])
    data = b"".join((root / name).read_bytes() for name in CORPUS_FILES)[:limit]
    return torch.frombuffer(bytearray(data), dtype=torch.uint8).long()


class Windows(torch.utils.data.Dataset):
    """Sample i: the text window starting at byte i * stride, as (input, target)."""

    def __init__(self, text: torch.Tensor, context: int, stride: int) -> None:
        self.text, self.context, self.stride = text, context, stride

    def __len__(self) -> int:
        return (len(self.text) - self.context - 1) // self.stride

    def __getitem__(self, i: int) -> tuple[torch.Tensor, torch.Tensor]:
        w = self.text[i * self.stride : i * self.stride + self.context + 1]
        return w[:-1], w[1:]


class CharTransformer(nn.Module):
    def __init__(self, context: int, dim: int = 64, layers: int = 2, dropout: float = 0.1) -> None:
        super().__init__()
        self.embed = nn.Embedding(256, dim)
        self.pos = nn.Embedding(context, dim)
        layer = nn.TransformerEncoderLayer(
            dim, nhead=4, dim_feedforward=4 * dim, dropout=dropout, batch_first=True
        )
        self.blocks = nn.TransformerEncoder(layer, layers, enable_nested_tensor=False)
        self.head = nn.Linear(dim, 256)
        self.register_buffer("mask", nn.Transformer.generate_square_subsequent_mask(context))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.embed(x) + self.pos(torch.arange(x.shape[1]))
        return self.head(self.blocks(h, mask=self.mask, is_causal=True))


def warmup_cosine(warmup: int, total: int):  # noqa: ANN201 - a LambdaLR factor
    def factor(step: int) -> float:
        if step < warmup:
            return (step + 1) / warmup
        progress = (step - warmup) / max(total - warmup, 1)
        return 0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * min(progress, 1.0)))

    return factor


def params_digest(model: nn.Module) -> str:
    h = hashlib.sha256()
    for name, p in sorted(model.state_dict().items()):
        h.update(name.encode())
        h.update(p.detach().contiguous().view(torch.uint8).numpy().tobytes())
    return h.hexdigest()


def crash_during_save_of(step: int) -> None:
    """Fault injection: SIGKILL this process while it commits the checkpoint of ``step``."""
    from shardpoint.format.index import MARKER_NAME
    from shardpoint.storage.local import LocalDirectory

    original = LocalDirectory.write_small_durably

    def write(self: LocalDirectory, name: str, data: bytes) -> None:
        if name == MARKER_NAME and self.root.name == f"step-{step:09d}":
            os.kill(os.getpid(), signal.SIGKILL)
        original(self, name, data)

    LocalDirectory.write_small_durably = write  # type: ignore[method-assign]


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    p.add_argument("--run-dir", type=Path, required=True)
    p.add_argument("--steps", type=int, default=300)
    p.add_argument("--save-every", type=int, default=25)
    p.add_argument("--keep-last", type=int, default=3)
    p.add_argument("--batch-size", type=int, default=16)
    p.add_argument("--context", type=int, default=64)
    p.add_argument("--num-workers", type=int, default=2)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--corpus-bytes", type=int, default=400_000, help="smaller: more epochs")
    p.add_argument("--crash-at", type=int, default=None)
    p.add_argument("--crash-phase", choices=["after-step", "during-save"], default="after-step")
    p.add_argument(
        "--freeze-base", action="store_true", help="train the head only, save incrementally"
    )
    args = p.parse_args(argv)

    torch.set_num_threads(1)  # the same kernels and reduction order in every run
    torch.manual_seed(args.seed)
    world = int(os.environ.get("WORLD_SIZE", "1"))  # set by torchrun
    if world > 1:
        torch.distributed.init_process_group("gloo")
    rank = torch.distributed.get_rank() if world > 1 else 0
    args.run_dir.mkdir(parents=True, exist_ok=True)
    if args.crash_at is not None and args.crash_phase == "during-save":
        crash_during_save_of(args.crash_at)

    data = Windows(corpus(args.corpus_bytes), args.context, stride=args.context // 2)
    loader = ResumableLoader(
        data,
        batch_size=args.batch_size,
        seed=args.seed,
        rank=rank,
        world_size=world,
        num_workers=args.num_workers,
    )
    model = CharTransformer(args.context)
    if args.freeze_base:
        for name, param in model.named_parameters():
            param.requires_grad_(name.startswith("head."))
    if world > 1:
        model = nn.parallel.DistributedDataParallel(model)
    trained = [param for param in model.parameters() if param.requires_grad]
    optimizer = torch.optim.AdamW(trained, lr=3e-3, weight_decay=0.1)
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, warmup_cosine(20, args.steps))
    state = TrainState(model=model, optimizer=optimizer, scheduler=scheduler, dataloader=loader)
    manager = CheckpointManager(
        args.run_dir / "checkpoints",
        policy=SavePolicy(every_n_steps=args.save_every),
        retention=RetentionPolicy(keep_last=args.keep_last),
        incremental=args.freeze_base,
    )
    step = manager.restore(state) or 0
    log = print if rank == 0 else (lambda *a, **k: None)
    log(
        f"{'resuming from step ' + str(step) if step else 'starting'} "
        f"(epoch {loader.epoch}, sample {loader.sampler.cursor})",
        flush=True,
    )

    suffix = "" if rank == 0 else f".rank{rank}"
    losses = open(args.run_dir / f"losses{suffix}.jsonl", "a", encoding="utf-8")
    loss_fn = nn.CrossEntropyLoss()
    model.train()
    last = None
    while step < args.steps:
        for x, y in loader:
            step += 1
            logits = model(x)
            loss = loss_fn(logits.reshape(-1, 256), y.reshape(-1))
            optimizer.zero_grad(set_to_none=True)
            loss.backward()
            optimizer.step()
            scheduler.step()
            losses.write(json.dumps({"step": step, "loss": loss.item().hex()}) + "\n")
            losses.flush()
            last = loss.item()
            state.step, state.epoch = step, loader.epoch
            manager.maybe_save(step, state, metrics={"loss": loss.item()})
            if step == args.crash_at:
                os.kill(os.getpid(), signal.SIGKILL)
            if manager.should_stop:
                log(f"preempted: saved step {step}, exiting with {manager.exit_code}", flush=True)
                manager.close()
                return manager.exit_code
            if step >= args.steps:
                break
    manager.save(step, state, force=True)
    manager.close()
    digest = params_digest(model.module if world > 1 else model)
    if rank == 0:
        final = {"step": step, "params_sha256": digest}
        (args.run_dir / "final.json").write_text(json.dumps(final))
    log(f"finished at step {step}; last loss {last}; params {digest[:16]}", flush=True)
    if world > 1:
        torch.distributed.destroy_process_group()
    return 0


if __name__ == "__main__":
    sys.exit(main())
