"""Hugging Face ``Trainer``: shardpoint checkpoints, exact resume, preemption.

    trainer = ShardpointTrainer(model=model, args=args, train_dataset=data)
    trainer.train(resume_from_checkpoint=True)   # the newest valid checkpoint, if any
    if trainer.checkpoints.should_stop:          # SIGTERM: saved at the step's end
        raise SystemExit(trainer.checkpoints.exit_code)

Every checkpoint the ``Trainer`` decides to save (``save_steps``, ``save_strategy``) and
every one a preemption signal asks for is one ``CheckpointManager`` save of a
``TrainState``: model, optimizer, scaler and every rank's random streams in safetensors
files, the LR schedule, the ``TrainerState`` (step, epoch, log history, callbacks) in the
JSON index. ``resume_from_checkpoint=True`` restores the newest checkpoint every rank
can load (a damaged newest one is skipped with a warning), or starts from scratch when
there is none; a path restores that checkpoint. The data position is the Trainer's own
(its resumed epoch skips the batches already trained, by sampler index).

The Trainer has no loading hook, so this subclass replaces its checkpoint methods
(``_save_checkpoint`` and the ``_load_*`` it calls while resuming) and keeps its
training loop: the model and optimizer are restored before ``Trainer.train`` starts,
the schedule and the random streams where the Trainer restores its own. Written and
tested against transformers 5.24 with accelerate 1.15.

Not supported (refused at construction, naming the argument): DeepSpeed, FSDP through
the Trainer (use ``CheckpointManager`` with ``TrainState`` in your own loop),
``load_best_model_at_end``, ``save_only_model``, ``push_to_hub``, ``model_init``.
"""

from __future__ import annotations

import dataclasses
import json
import os
import tempfile
from pathlib import Path
from typing import Any

import torch
from transformers import Trainer, TrainerCallback
from transformers.trainer_callback import ExportableState, TrainerState
from transformers.trainer_utils import TrainOutput
from transformers.utils import logging

from ..dist import max_of
from ..errors import CheckpointError
from ..loading import load
from ..training.manager import CheckpointManager
from ..training.retention import RetentionPolicy
from ..training.rng import capture_rng, restore_rng
from ..training.train_state import TrainState

logger = logging.get_logger(__name__)
TRAINER_STATE = "trainer_state.json"  # the name Trainer.train reads a resumed state from


class ShardpointTrainer(Trainer):
    """A ``transformers.Trainer`` whose checkpoints are shardpoint checkpoints.

    ``checkpoints``: the ``CheckpointManager`` to save through (its directory, retention,
    remote tier, asynchronous saves, preemption signals), or None for
    ``CheckpointManager(OUTPUT_DIR/"checkpoints", retention=RetentionPolicy(keep_last=
    args.save_total_limit))``. Every other argument is the ``Trainer``'s.
    """

    def __init__(self, *args: Any, checkpoints: CheckpointManager | None = None, **kwargs: Any):
        super().__init__(*args, **kwargs)
        unsupported = {
            "deepspeed": self.is_deepspeed_enabled,
            "fsdp": self.is_fsdp_enabled,
            "load_best_model_at_end": self.args.load_best_model_at_end,
            "save_only_model": self.args.save_only_model,
            "push_to_hub": self.args.push_to_hub,
            "model_init": self.model_init is not None,  # re-creates model and optimizer
        }
        refused = [name for name, used in unsupported.items() if used]
        if refused:
            raise ValueError(
                f"ShardpointTrainer does not support {', '.join(refused)}: "
                "turn it off, or use CheckpointManager with TrainState in your own loop"
            )
        if checkpoints is None:
            keep = self.args.save_total_limit  # as the Trainer reads it: unset or <= 0 keeps all
            best = self._best_metric_key()  # the Trainer's rotation keeps the best one too
            checkpoints = CheckpointManager(
                Path(self.args.output_dir) / "checkpoints",
                retention=RetentionPolicy(
                    keep_last=keep if keep and keep > 0 else None,
                    keep_best=1 if best else None,
                    best_metric=best,
                    mode="max" if self.args.greater_is_better else "min",
                ),
            )
        self.checkpoints = checkpoints
        self._resumed: _Resumed | None = None
        self._saved_step: int | None = None
        self._manager_rules = _SaveOnPreemption(checkpoints)
        self.add_callback(self._manager_rules)

    # ---- saving -------------------------------------------------------------------------

    def _save_checkpoint(self, model: Any, trial: Any) -> None:
        if self.hp_search_backend is None and trial is None:
            self.store_flos()
        # What Trainer stores of its callbacks (EarlyStopping's patience, ...), as it does.
        for cb in self.callback_handler.callbacks + [self.control]:
            if isinstance(cb, ExportableState):
                name = cb.__class__.__name__
                if isinstance(self.state.stateful_callbacks[name], list):
                    self.state.stateful_callbacks[name].append(cb.state())
                else:
                    self.state.stateful_callbacks[name] = cb.state()
        step = self.state.global_step
        best = self.state.best_global_step
        if best and (best == step or best in self.checkpoints.steps()):  # as the Trainer does
            self.state.best_model_checkpoint = str(self.checkpoints.path_for(best))
        metrics = self._evaluated_at(step)  # retention ranks checkpoints by it
        self.checkpoints.save(step, self._train_state(), force=True, metrics=metrics)
        self._saved_step = step

    def _best_metric_key(self) -> str | None:
        """``metric_for_best_model`` as the evaluation logs name it (``eval_`` prefixed)."""
        name = self.args.metric_for_best_model
        if not name:
            return None
        return name if name.startswith("eval_") else f"eval_{name}"

    def _evaluated_at(self, step: int) -> dict[str, float]:
        """The best-model metric of the evaluation at ``step``, if one ran and logged it."""
        key = self._best_metric_key()
        for entry in reversed(self.state.log_history) if key else ():
            if entry.get("step") == step and key in entry:
                return {key: float(entry[key])}
        return {}

    def _maybe_log_save_evaluate(self, *args: Any, **kwargs: Any) -> None:
        super()._maybe_log_save_evaluate(*args, **kwargs)
        # save_strategy="best" replaces should_save with "a new best metric" after the
        # evaluation: a save the manager's rules asked for (a preemption, a time
        # interval) is made all the same.
        step = self.state.global_step
        if self._manager_rules.asked == step and self._saved_step != step:
            self._save_checkpoint(self.model, None)
            self.control = self.callback_handler.on_save(self.args, self.state, self.control)

    def _train_state(self) -> TrainState:
        """The whole state, built for the save or restore at hand (the optimizer and
        scheduler exist only once training starts)."""
        # Which process this is (set again when training starts) is the one field that
        # differs across ranks; values outside tensors must be the same on every rank.
        trainer_state = dataclasses.asdict(self.state)
        for per_process in ("is_local_process_zero", "is_world_process_zero"):
            trainer_state.pop(per_process)
        extra: dict[str, Any] = {"trainer_state": json.dumps(trainer_state)}
        if self.lr_scheduler is not None:
            extra["lr_scheduler"] = self.lr_scheduler.state_dict()
        return TrainState(
            model=self.model,
            optimizer=_unwrapped(self.optimizer),
            scaler=getattr(self.accelerator, "scaler", None),
            extra=extra,
            step=self.state.global_step,
        )

    # ---- resuming -----------------------------------------------------------------------

    def train(self, resume_from_checkpoint: str | bool | None = None, **kwargs: Any) -> Any:
        """``Trainer.train``; ``resume_from_checkpoint=True`` restores the newest valid
        checkpoint of ``self.checkpoints`` (or starts from scratch when there is none), a
        path restores that checkpoint directory."""
        try:
            if not resume_from_checkpoint:
                self._refuse_an_earlier_runs_checkpoints()
                return super().train(resume_from_checkpoint=None, **kwargs)
            resumed = self._restore(resume_from_checkpoint)
            if resumed is None:
                return super().train(resume_from_checkpoint=None, **kwargs)
            step = json.loads(resumed.trainer_state)["global_step"]
            if 0 < self.args.max_steps <= step:
                # Finished already (a job started again after its last save): the Trainer
                # would run one more step from here.
                logger.info(
                    "checkpoint of step %d: max_steps=%d reached", step, self.args.max_steps
                )
                self.state = TrainerState(**json.loads(resumed.trainer_state))
                return TrainOutput(step, 0.0, {})
            self._resumed = resumed
            # Trainer.train reads the resumed TrainerState from a file in the directory it
            # is given; every other read goes through the _load_* methods below.
            with tempfile.TemporaryDirectory(prefix="shardpoint-resume-") as view:
                Path(view, TRAINER_STATE).write_text(resumed.trainer_state)
                return super().train(resume_from_checkpoint=view, **kwargs)
        finally:
            self._resumed = None
            self.checkpoints.wait()  # a background save's error is raised here

    def _refuse_an_earlier_runs_checkpoints(self) -> None:
        """A fresh run among an earlier run's checkpoints would not replace them: the
        manager skips a step already committed, and keeps the newest steps, the earlier
        run's; a resume would then continue that run. Every rank learns (one reduction)."""
        try:
            held, unlisted = len(self.checkpoints.steps()) + len(self.checkpoints.remote_steps()), 0
        except (OSError, CheckpointError):  # told to every rank below, not raised alone
            held, unlisted = 0, 1
        held, unlisted = max_of([held, unlisted])
        if unlisted:
            raise CheckpointError(
                f"{self.checkpoints.directory}: a rank could not list its checkpoints, so "
                "whether an earlier run's are there is unknown; check the storage and retry"
            )
        if held:
            raise ValueError(
                f"{self.checkpoints.directory}: holds checkpoints of an earlier run; pass "
                "resume_from_checkpoint=True to continue it, or start this run in a new "
                "output_dir (or delete them)"
            )

    def _restore(self, which: str | bool) -> _Resumed | None:
        """Load model, optimizer and scaler in place (the optimizer is created now, as the
        Trainer would); keep what the Trainer restores later."""
        if self.optimizer is None:
            self.create_optimizer()
        state = self._train_state()
        state.extra = {}  # replaced by the stored extras
        if which is True:
            step = self.checkpoints.restore(state)
            if step is None:
                return None
        else:
            load(state, os.fspath(which))
        return _Resumed(
            trainer_state=state.extra["trainer_state"],
            lr_scheduler=state.extra.get("lr_scheduler"),
            lrs=[group["lr"] for group in self.optimizer.param_groups],
            rng=capture_rng(),  # the restored streams, put back where Trainer does
        )

    def _load_from_checkpoint(self, resume_from_checkpoint: str, model: Any = None) -> None:
        pass  # the model was restored with the optimizer, before training started

    def _load_optimizer_and_scheduler(self, checkpoint: str | None) -> None:
        resumed = self._resumed
        if checkpoint is None or resumed is None:
            return
        if resumed.lr_scheduler is not None and self.lr_scheduler is not None:
            self.lr_scheduler.load_state_dict(resumed.lr_scheduler)
        # Creating the scheduler set the learning rates to its first step's; the
        # restored optimizer's are the ones the next step uses.
        for group, lr in zip(self.optimizer.param_groups, resumed.lrs, strict=True):
            group["lr"] = lr

    def _load_scaler(self, checkpoint: str | None) -> None:
        pass  # restored with the model

    def _load_rng_state(self, checkpoint: str | None) -> None:
        if checkpoint is not None and self._resumed is not None:
            restore_rng(self._resumed.rng)


class _Resumed:
    """What a restore keeps for the Trainer's later ``_load_*`` calls."""

    def __init__(
        self, trainer_state: str, lr_scheduler: Any, lrs: list[Any], rng: dict[str, Any]
    ) -> None:
        self.trainer_state = trainer_state
        self.lr_scheduler = lr_scheduler
        self.lrs = lrs
        self.rng = rng


class _SaveOnPreemption(TrainerCallback):
    """After each step: the manager's own rules (a preemption signal on any rank, a
    time interval) may ask for a save; after a preemption save training stops."""

    def __init__(self, checkpoints: CheckpointManager) -> None:
        self.checkpoints = checkpoints
        self.asked: int | None = None  # the last step these rules asked a save at

    def on_step_end(self, args: Any, state: Any, control: Any, **kwargs: Any) -> Any:
        if self.checkpoints.should_save(state.global_step):
            control.should_save = True
            self.asked = state.global_step
            if self.checkpoints.preempting:  # agreed by every rank, unlike .preempted
                control.should_training_stop = True
        return control


def _unwrapped(optimizer: Any) -> torch.optim.Optimizer | None:
    """Accelerate wraps the optimizer; the state lives in the one inside."""
    return getattr(optimizer, "optimizer", optimizer)


__all__ = ["ShardpointTrainer"]
