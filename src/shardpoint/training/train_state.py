"""``TrainState``: the whole state of a training job as one ``Stateful`` object."""

from __future__ import annotations

import warnings
from collections.abc import Mapping
from typing import Any

import torch
from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict

from .. import dist
from ..tree import PerRank, is_stateful
from .rng import capture_rng, reseed_streams, restore_rng


def _stream_source(rank: int, saved_ranks: list[Any]) -> Any:
    """Whose saved RNG streams this rank restores: its own, or on a world-size change
    (a rank that did not exist at save time) those of saved rank ``rank % old_world``.
    Decided from the stored keys alone, so a rank reads one rank's streams, not all."""
    if rank in saved_ranks:
        if len(saved_ranks) != dist.world_size() and rank == 0:
            warnings.warn(
                f"RNG streams were saved on {len(saved_ranks)} ranks and are restored on "
                f"{dist.world_size()}: ranks present at save time get their own streams back, "
                "new ranks get streams derived from a saved rank's and their own rank number, "
                "so random draws differ from a run on the original world size",
                stacklevel=5,
            )
        return rank
    return sorted(saved_ranks)[rank % len(saved_ranks)]


def streams_for(rank: int, saved: dict[Any, Any]) -> dict[str, Any]:
    """This rank's RNG streams from what was loaded (its source's, see ``_stream_source``):
    its own back, or the source's reseeded from its own rank, so no two ranks share a
    stream."""
    if rank in saved:
        return saved[rank]
    return reseed_streams(saved[_stream_source(rank, list(saved))], rank)


class TrainState:
    """Model, optimizer, LR schedule, grad scaler, data position, RNG streams, counters.

    Pass it to ``shardpoint.save``/``load`` or a ``CheckpointManager``. The model and
    optimizer go through ``torch.distributed.checkpoint.state_dict`` (FQN-keyed), so the
    same code serves plain, DDP and FSDP2 models and initialises a fresh optimizer's
    state for in-place loading. Everything is optional except what you pass.

    >>> state = TrainState(model=model, optimizer=opt, scheduler=sched,
    ...                    dataloader=loader, extra={"best_loss": 1.7})   # doctest: +SKIP
    >>> state.step += 1                                                   # doctest: +SKIP
    """

    def __init__(
        self,
        *,
        model: torch.nn.Module | None = None,
        optimizer: torch.optim.Optimizer | None = None,
        scheduler: Any = None,
        scaler: Any = None,
        dataloader: Any = None,
        extra: Mapping[str, Any] | None = None,
        step: int = 0,
        epoch: int = 0,
        capture_rng_state: bool = True,
    ) -> None:
        if optimizer is not None and model is None:
            raise ValueError("TrainState needs the model with the optimizer (FQN-keyed state)")
        for name, obj in (("scheduler", scheduler), ("scaler", scaler), ("dataloader", dataloader)):
            if obj is not None and not is_stateful(obj):
                raise TypeError(f"{name} must have state_dict() and load_state_dict()")
        self.model = model
        self.optimizer = optimizer
        self.scheduler = scheduler
        self.scaler = scaler
        self.dataloader = dataloader
        self.extra: dict[str, Any] = dict(extra or {})
        self.step = step
        self.epoch = epoch
        self.capture_rng_state = capture_rng_state

    def state_dict(self) -> dict[str, Any]:
        sd: dict[str, Any] = {"step": self.step, "epoch": self.epoch}
        if self.model is not None:
            optims = [self.optimizer] if self.optimizer is not None else []
            sd["model"], optim_sd = get_state_dict(self.model, optims)
            if self.optimizer is not None:
                sd["optimizer"] = optim_sd
        for name in ("scheduler", "scaler", "dataloader"):
            obj = getattr(self, name)
            if obj is not None:
                sd[name] = obj.state_dict()
        if self.extra:
            sd["extra"] = self.extra
        if self.capture_rng_state:
            # Keyed by rank: every rank has streams of its own, kept in its fragment
            # (PerRank), so the index does not grow by a set of streams per rank.
            sd["rng"] = PerRank({dist.rank(): capture_rng()})
        return sd

    def skip_batches(self, n: int) -> None:
        """Skip the next ``n`` batches of the data loader (a rollback past bad data)."""
        if not hasattr(self.dataloader, "skip_batches"):
            raise TypeError(
                f"cannot skip {n} batches: TrainState's dataloader "
                f"({type(self.dataloader).__name__}) has no skip_batches; use ResumableLoader"
            )
        self.dataloader.skip_batches(n)

    def stored_keys_to_load(
        self, rel: tuple[object, ...], keys: list[object]
    ) -> list[object] | None:
        """Of the saved RNG streams (every rank's), only the ones this rank restores."""
        if rel == ("rng",) and keys:
            return [_stream_source(dist.rank(), keys)]
        return None

    def load_state_dict(self, sd: dict[str, Any]) -> None:
        self.step = sd["step"]
        self.epoch = sd["epoch"]
        if self.model is not None:
            optims = [self.optimizer] if self.optimizer is not None else []
            set_state_dict(
                self.model,
                optims,
                model_state_dict=sd["model"],
                optim_state_dict=sd.get("optimizer", {}),
            )
        for name in ("scheduler", "scaler", "dataloader"):
            obj = getattr(self, name)
            if obj is not None:
                obj.load_state_dict(sd[name])
        if "extra" in sd:
            self.extra = sd["extra"]
        if self.capture_rng_state and "rng" in sd:
            restore_rng(streams_for(dist.rank(), sd["rng"]))
