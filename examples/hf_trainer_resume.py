"""The Hugging Face Trainer with shardpoint checkpoints, killed and resumed exactly.

    python examples/hf_trainer_resume.py --run-dir runs/hf/a --steps 40
    python examples/hf_trainer_resume.py --run-dir runs/hf/b --steps 40 --crash-at 23
    python examples/hf_trainer_resume.py --run-dir runs/hf/b --steps 40     # resumes
    torchrun --nproc-per-node 2 examples/hf_trainer_resume.py --run-dir runs/hf/ddp

A two-layer GPT-2 built from a config (dropout on) learns the bytes of Python's own
``json`` package source, with AdamW and a warm-up-then-linear schedule, a checkpoint
every 5 steps. Every step's loss goes to ``RUN_DIR/losses-rank<R>.jsonl``
(``float.hex``), the final weights' digest to ``RUN_DIR/final.json``.
``--crash-at STEP`` SIGKILLs the process after that step, ``--crash-in-save STEP``
inside that step's save, ``--sigterm-at STEP`` sends it SIGTERM (a preemption: it saves
at once and exits with 143). Started again, it resumes from the newest valid
checkpoint. ``--own-checkpoints`` uses the Trainer's own checkpointing instead, for
comparison (bench/bench_integrations.py); ``--width``/``--layers`` size the model.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import signal
import sys
import time
from pathlib import Path
from typing import Any

import torch
from transformers import GPT2Config, GPT2LMHeadModel, Trainer, TrainerCallback, TrainingArguments
from transformers.trainer_callback import TrainerState
from transformers.trainer_utils import get_last_checkpoint

from shardpoint import CheckpointManager, RetentionPolicy
from shardpoint.commit import Commit
from shardpoint.integrations.transformers import ShardpointTrainer

CONTEXT = 32


class Bytes(torch.utils.data.Dataset):
    """Byte windows of the ``json`` package's source: made here, nothing downloaded."""

    def __init__(self) -> None:
        root = Path(json.__file__).parent
        text = b"".join(p.read_bytes() for p in sorted(root.glob("*.py")))
        self.data = torch.tensor(list(text[: 104 * CONTEXT]), dtype=torch.long)

    def __len__(self) -> int:
        return len(self.data) // CONTEXT

    def __getitem__(self, i: int) -> dict[str, torch.Tensor]:
        window = self.data[i * CONTEXT : (i + 1) * CONTEXT]
        return {"input_ids": window, "labels": window}


class LoggedLosses:
    """Writes every optimizer step's loss (``float.hex``) and every save's duration (the
    time training waits for it) to the run directory."""

    run_dir: Path
    rank: int

    def training_step(self, model: Any, inputs: Any, num_items_in_batch: Any = None) -> Any:
        loss = super().training_step(model, inputs, num_items_in_batch)  # type: ignore[misc]
        step = self.state.global_step + 1  # type: ignore[attr-defined]
        with open(self.run_dir / f"losses-rank{self.rank}.jsonl", "a") as f:
            f.write(json.dumps({"step": step, "loss": loss.item().hex()}) + "\n")
        return loss

    def _save_checkpoint(self, model: Any, trial: Any) -> None:
        started = time.perf_counter()
        super()._save_checkpoint(model, trial)  # type: ignore[misc]
        seconds = time.perf_counter() - started
        with open(self.run_dir / f"saves-rank{self.rank}.jsonl", "a") as f:
            f.write(json.dumps({"step": self.state.global_step, "seconds": seconds}) + "\n")  # type: ignore[attr-defined]


class LoggedShardpointTrainer(LoggedLosses, ShardpointTrainer):
    pass


class LoggedTrainer(LoggedLosses, Trainer):
    pass


class SignalAt(TrainerCallback):
    """Sends this process a signal after a given step: ``{step: signal}``."""

    def __init__(self, signals: dict[int | None, int]) -> None:
        self.signals = signals

    def on_step_end(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        if state.global_step in self.signals:
            os.kill(os.getpid(), self.signals[state.global_step])


def _crash_in_save(trainer: Any, step: int, own: bool) -> None:
    """SIGKILL the save of ``step`` just before it ends: the Trainer's own before it
    writes ``trainer_state.json`` (its last file), shardpoint's before the commit (in
    the background with ``--async-save``, while training goes on)."""
    if own:
        save_to_json = TrainerState.save_to_json

        def crashing_save_to_json(self: Any, path: str) -> None:
            if trainer.state.global_step == step:
                os.kill(os.getpid(), signal.SIGKILL)
            save_to_json(self, path)

        TrainerState.save_to_json = crashing_save_to_json
    else:
        finish = Commit.finish

        def crashing_finish(self: Any, *args: Any, **kwargs: Any) -> None:
            if Path(self.storage.root).name == f"step-{step:09d}":
                os.kill(os.getpid(), signal.SIGKILL)
            finish(self, *args, **kwargs)

        Commit.finish = crashing_finish


def _leave(code: int) -> int:
    """Under torchrun: every rank done, then the process group down, then exit at once.
    Python's own teardown after a gloo group sometimes aborted ("terminate called
    without an active exception") or hung here, whatever saved the checkpoints; the
    work is done and flushed by then."""
    if torch.distributed.is_initialized():
        torch.distributed.barrier()
        torch.distributed.destroy_process_group()
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(code)
    return code


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--run-dir", type=Path, required=True)
    parser.add_argument("--steps", type=int, default=40)
    parser.add_argument("--crash-at", type=int, help="SIGKILL after this step")
    parser.add_argument("--sigterm-at", type=int, help="SIGTERM after this step")
    parser.add_argument("--own-checkpoints", action="store_true", help="the Trainer's own")
    parser.add_argument("--save-steps", type=int, default=5)
    parser.add_argument("--width", type=int, default=64, help="GPT-2 n_embd")
    parser.add_argument("--layers", type=int, default=2, help="GPT-2 n_layer")
    parser.add_argument("--async-save", action="store_true", help="shardpoint: in background")
    parser.add_argument(
        "--crash-in-save", type=int, help="SIGKILL inside the save of this step, before it ends"
    )
    args = parser.parse_args(argv)
    rank = int(os.environ.get("RANK", "0"))
    args.run_dir.mkdir(parents=True, exist_ok=True)

    torch.manual_seed(0)  # the model's initial weights
    config = GPT2Config(
        vocab_size=256, n_positions=CONTEXT, n_embd=args.width, n_layer=args.layers, n_head=4
    )
    model = GPT2LMHeadModel(config)
    training = TrainingArguments(
        output_dir=str(args.run_dir / "out"),
        max_steps=args.steps,
        per_device_train_batch_size=8,
        learning_rate=3e-3,
        warmup_steps=5,
        save_strategy="steps",
        save_steps=args.save_steps,
        save_total_limit=2,
        logging_steps=10,
        report_to="none",
        use_cpu=True,
        ddp_backend="gloo" if "WORLD_SIZE" in os.environ else None,
        disable_tqdm=True,
        seed=0,
    )
    callbacks = [SignalAt({args.crash_at: signal.SIGKILL, args.sigterm_at: signal.SIGTERM})]
    common = dict(model=model, args=training, train_dataset=Bytes(), callbacks=callbacks)
    if args.own_checkpoints:
        trainer: Any = LoggedTrainer(**common)
        resume: Any = (
            get_last_checkpoint(training.output_dir) if Path(training.output_dir).is_dir() else None
        )
    else:
        manager = CheckpointManager(
            args.run_dir / "out" / "checkpoints",
            retention=RetentionPolicy(keep_last=2),
            async_save=args.async_save,
        )
        trainer = LoggedShardpointTrainer(**common, checkpoints=manager)
        resume = True  # the newest valid checkpoint, or a fresh start
    trainer.run_dir, trainer.rank = args.run_dir, rank
    if args.crash_in_save is not None:
        _crash_in_save(trainer, args.crash_in_save, args.own_checkpoints)
    started = time.perf_counter()
    trainer.train(resume_from_checkpoint=resume)
    if not args.own_checkpoints and trainer.checkpoints.should_stop:
        print(f"preempted: saved step {trainer.state.global_step}, exiting", flush=True)
        trainer.checkpoints.close()
        return _leave(trainer.checkpoints.exit_code)
    if rank == 0:
        digest = hashlib.sha256()
        for name, tensor in sorted(trainer.model.state_dict().items()):
            digest.update(name.encode() + tensor.detach().cpu().contiguous().numpy().tobytes())
        result = {"weights_sha256": digest.hexdigest(), "seconds": time.perf_counter() - started}
        (args.run_dir / "final.json").write_text(json.dumps(result))
    return _leave(0)


if __name__ == "__main__":
    sys.exit(main())
