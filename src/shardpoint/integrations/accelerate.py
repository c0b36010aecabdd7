"""Accelerate: what ``Accelerator.save_state`` saves, as one shardpoint state.

    accelerator = Accelerator(dataloader_config=DataLoaderConfiguration(
        use_stateful_dataloader=True))                # the data position is saved too
    model, optimizer, scheduler, loader = accelerator.prepare(model, optimizer, scheduler, loader)
    state = accelerator_state(accelerator)
    checkpoints = CheckpointManager("runs/x", SavePolicy(every_n_steps=100))
    start = checkpoints.restore(state) or 0          # the newest valid checkpoint
    ...
    checkpoints.maybe_save(step, state)

or, in place of ``accelerator.save_state(dir)`` / ``load_state(dir)``:
``save_state(accelerator, dir)`` / ``load_state(accelerator, dir)``.

The state holds the prepared model and its optimizer (as a ``TrainState``: FQN-keyed
through ``torch.distributed.checkpoint.state_dict``, so DDP and FSDP2 models are
saved per rank and resharded on load), every rank's random streams, the grad scaler,
every prepared scheduler, every prepared data loader that has a state (Accelerate's
stateful loaders), every object given to ``register_for_checkpointing`` and
``accelerator.step``. Nothing is pickled; a value JSON cannot hold is refused naming it.
"""

from __future__ import annotations

import os
import warnings
from typing import Any

from ..loading import load
from ..save_records import SaveInfo
from ..saving import save
from ..training.train_state import TrainState
from ..tree import is_stateful


def accelerator_state(accelerator: Any) -> dict[str, Any]:
    """The state of everything ``accelerator`` prepared or registered, to save and to
    load in place (build it after ``accelerator.prepare``)."""
    models, optimizers = accelerator._models, accelerator._optimizers
    if len(models) > 1 or len(optimizers) > 1:
        raise ValueError(
            f"accelerator_state supports one prepared model and optimizer, not "
            f"{len(models)} and {len(optimizers)}: save the others as TrainStates of their own"
        )
    if optimizers and not models:
        raise ValueError("the optimizer needs its model: prepare both with the accelerator")
    # What Accelerate's own save_state would do beyond these objects: refused, not dropped.
    hooks = len(accelerator._save_model_state_pre_hook) + len(
        accelerator._load_model_state_pre_hook
    )
    if hooks:
        raise ValueError(
            "the accelerator has save/load state pre-hooks, which shardpoint does not run "
            "(what they save would be lost): register those objects with "
            "accelerator.register_for_checkpointing instead"
        )
    if accelerator.project_configuration.automatic_checkpoint_naming:
        warnings.warn(
            "ProjectConfiguration(automatic_checkpoint_naming=True) names and deletes "
            "Accelerate's own checkpoints, not shardpoint's: their names and total_limit are "
            "CheckpointManager's step-N directories and RetentionPolicy(keep_last=...)",
            stacklevel=2,
        )
    custom = accelerator._custom_objects
    not_stateful = [type(obj).__name__ for obj in custom if not is_stateful(obj)]
    if not_stateful:
        raise TypeError(f"registered objects need state_dict/load_state_dict: {not_stateful}")
    return {
        "train": TrainState(
            model=models[0] if models else None,
            optimizer=optimizers[0].optimizer if optimizers else None,
            scaler=accelerator.scaler,
        ),
        "schedulers": {str(i): s for i, s in enumerate(accelerator._schedulers)},
        # Accelerate's loaders all define state_dict; only stateful ones can answer it.
        "dataloaders": {
            str(i): d
            for i, d in enumerate(accelerator._dataloaders)
            if getattr(d, "use_stateful_dataloader", False) and is_stateful(d)
        },
        "registered": {str(i): obj for i, obj in enumerate(custom)},
        "accelerator": _StepCounter(accelerator),
    }


def save_state(accelerator: Any, path: str | os.PathLike[str], **kwargs: Any) -> SaveInfo:
    """``accelerator.save_state(path)`` as one shardpoint checkpoint (collective;
    ``kwargs`` go to ``shardpoint.save``)."""
    info = save(accelerator_state(accelerator), path, **kwargs)
    assert isinstance(info, SaveInfo)
    return info


def load_state(accelerator: Any, path: str | os.PathLike[str], **kwargs: Any) -> None:
    """``accelerator.load_state(path)`` from a shardpoint checkpoint, in place, all or
    nothing (collective; ``kwargs`` go to ``shardpoint.load``)."""
    load(accelerator_state(accelerator), path, **kwargs)


class _StepCounter:
    """``accelerator.step`` (gradient accumulation counts from it)."""

    def __init__(self, accelerator: Any) -> None:
        self.accelerator = accelerator

    def state_dict(self) -> dict[str, Any]:
        return {"step": self.accelerator.step}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.accelerator.step = state["step"]


__all__ = ["accelerator_state", "load_state", "save_state"]
