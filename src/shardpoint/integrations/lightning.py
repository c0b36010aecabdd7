"""PyTorch Lightning: shardpoint checkpoints through ``Trainer(plugins=[...])``.

    trainer = L.Trainer(plugins=[ShardpointCheckpointIO()],
                        callbacks=[ResumableRNG(), SaveOnPreemption(), ModelCheckpoint(...)])
    trainer.fit(model, loader, ckpt_path="last")

``ShardpointCheckpointIO`` writes every checkpoint Lightning asks for (``ModelCheckpoint``,
``trainer.save_checkpoint``) as a shardpoint checkpoint directory: tensors in
safetensors files, everything else in the JSON index (a value that JSON cannot hold is
refused at save time, naming it), committed atomically, every byte checksummed; loading
checks every checksum and unpickles nothing. Lightning saves ``last.ckpt`` again at the
same path: each save is a new directory beside it (``last.ckpt.<n>``) and the name is a
symbolic link switched to it in one atomic rename, so a crash leaves the previous one
whole. ``ckpt_path="last"`` finds it as it finds a file.

Lightning does not checkpoint the random number generators: ``ResumableRNG`` (a
callback) saves every rank's Python, NumPy and torch streams and restores each rank's
own when training starts again, so dropout and anything else drawn from them continue
exactly; it saves the train loader's generators too (its own and its sampler's), and
on an epoch's last batch restores everything just before the resumed fit makes the next
epoch's iterator. A plain ``DataLoader`` resumed mid-epoch is restarted at the epoch's
first batch by Lightning: ``InexactResumeWarning``. Lightning stops on SIGTERM without
saving (and exits with status 0): ``SaveOnPreemption`` saves ``last.ckpt`` at the end of
the step and exits with 143. The data position is Lightning's own: give it a
``torchdata`` ``StatefulDataLoader`` and a resumed fit continues at the next batch.

``ShardpointCheckpointIO`` serves one process and strategies whose rank 0 writes the
whole checkpoint (DDP). Sharded training (FSDP2, tensor parallelism) saves without
``CheckpointIO`` in Lightning: use ``ShardpointModelParallelStrategy``, where every rank
writes its own shards. Local directories only (the switch of ``last.ckpt`` is a
symbolic link).
"""

from __future__ import annotations

import itertools
import os
import re
import signal
import warnings
from pathlib import Path
from typing import Any

import torch
from lightning.fabric.plugins.io.checkpoint_io import CheckpointIO
from lightning.pytorch.callbacks import Callback
from lightning.pytorch.strategies import ModelParallelStrategy
from lightning.pytorch.utilities.exceptions import SIGTERMException

from .. import dist
from ..background_save import AsyncSaver
from ..commit import Commit
from ..loading import load
from ..reader import CheckpointReader
from ..saving import save
from ..storage import open_storage
from ..training.rng import capture_rng, restore_rng
from ..training.train_state import TrainState, streams_for
from ..tree import PerRank


class ShardpointCheckpointIO(CheckpointIO):
    """Lightning's checkpoint files as shardpoint checkpoint directories.

    ``async_save=True``: ``save_checkpoint`` returns once the state is copied to host
    memory (a reused staging pool) and writes it in the background; ``last.ckpt`` is
    switched to it after it committed. The training loop may change every tensor
    meanwhile: the copy is what is written. At most one save is in flight (the next
    waits); a background save's error is raised by the next save or at teardown.
    """

    def __init__(self, async_save: bool = False) -> None:
        self._saver = AsyncSaver() if async_save else None
        self._saving: Path | None = None  # the name whose background save is in flight

    def save_checkpoint(
        self, checkpoint: dict[str, Any], path: Any, storage_options: Any = None
    ) -> None:
        if storage_options is not None:  # as Lightning's own TorchCheckpointIO says
            raise TypeError("ShardpointCheckpointIO does not take storage_options")
        path = Path(path)
        path.parent.mkdir(parents=True, exist_ok=True)
        self._wait()  # saves switch the link in the order they were made
        previous = _target(path)
        for leftover in _versions(path) - {previous}:  # of a save a crash interrupted
            Commit(open_storage(leftover)).delete()
        version = _next_version(path)

        def switch(info: Any, error: BaseException | None) -> None:
            if error is None:
                _switch(path, version, previous)

        with dist.solo():  # under DDP only rank 0 is here: a save of one process
            if self._saver is None:
                save(checkpoint, version)
                switch(None, None)
            else:
                self._saver.save(checkpoint, version, on_done=switch)
                self._saving = path

    def load_checkpoint(
        self, path: Any, map_location: Any = None, weights_only: Any = None, **kwargs: Any
    ) -> dict[str, Any]:
        self._wait()
        with CheckpointReader(path) as reader:
            return reader.state()

    def remove_checkpoint(self, path: Any) -> None:
        path = Path(path)
        if path == self._saving:
            self._wait()  # other names need not wait for the save in flight
        target = _target(path)
        if path.is_symlink():
            path.unlink()  # a link Lightning made (save_last="link") goes, its target stays
        if target is not None:
            Commit(open_storage(target)).delete()

    def teardown(self) -> None:
        self._wait()

    def _wait(self) -> None:
        if self._saver is not None:
            self._saving = None
            self._saver.wait()  # raises a background save's error


def _switch(path: Path, version: Path, previous: Path | None) -> None:
    """``path`` names ``version`` from now on (one atomic rename); the old one goes."""
    link = path.with_name(f".{path.name}.link")
    link.unlink(missing_ok=True)
    os.symlink(version.name, link)
    os.replace(link, path)
    if previous is not None and previous != version:
        Commit(open_storage(previous)).delete()


def _target(path: Path) -> Path | None:
    """The version directory (``NAME.<n>``) the link ``path`` names, if it is one of
    ours; a link Lightning made to another checkpoint is not ours to delete."""
    if path.is_symlink():
        target = path.parent / os.readlink(path)
        return target if target in _versions(path) else None
    if path.is_dir():
        raise FileExistsError(
            f"{path} is a directory that ShardpointCheckpointIO did not write (it writes "
            f"{path.name}.<n> and links {path.name} to it): move it away"
        )
    return None


def _versions(path: Path) -> set[Path]:
    """The directories ``path`` has named or was about to name (``NAME.<n>``)."""
    pattern = re.compile(re.escape(path.name) + r"\.\d+")
    return {p for p in path.parent.iterdir() if pattern.fullmatch(p.name) and p.is_dir()}


def _next_version(path: Path) -> Path:
    for n in itertools.count():
        candidate = path.with_name(f"{path.name}.{n}")
        if not candidate.exists():
            return candidate
    raise AssertionError("unreachable")


class ShardpointModelParallelStrategy(ModelParallelStrategy):
    """Lightning's ``ModelParallelStrategy`` (FSDP2 with ``fully_shard``, tensor
    parallelism) with checkpoints written by shardpoint: every rank writes its own shards
    of the model and optimizer state, in parallel, into one checkpoint directory
    committed atomically, and a resumed fit on another number of ranks reshards. Each
    rank's own part of Lightning's dictionary (loops with its data loader's position,
    callbacks, schedulers) is kept in that rank's fragment and given back to it, not
    rank 0's to every rank. ``last.ckpt`` is switched like ``ShardpointCheckpointIO``'s.
    The directories must be shared by the ranks (Lightning broadcasts rank 0's path).
    """

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.checkpoint_io = ShardpointCheckpointIO()  # removes what this strategy saved

    def save_checkpoint(
        self, checkpoint: dict[str, Any], filepath: Any, storage_options: Any = None
    ) -> None:
        if storage_options is not None:
            raise TypeError("ShardpointModelParallelStrategy does not take storage_options")
        path = Path(self.broadcast(str(filepath)))
        # Saved from the live modules below, each rank its own shards.
        checkpoint.pop("state_dict", None)
        checkpoint.pop("optimizer_states", None)
        previous = None
        if self.is_global_zero:
            path.parent.mkdir(parents=True, exist_ok=True)
            previous = _target(path)
            for leftover in _versions(path) - {previous}:
                Commit(open_storage(leftover)).delete()
            version = _next_version(path)
        version = Path(self.broadcast(str(version) if self.is_global_zero else None))
        save(self._shardpoint_state(checkpoint), version)
        if self.is_global_zero:
            _switch(path, version, previous)
        self.barrier("ShardpointModelParallelStrategy.save_checkpoint")

    def load_checkpoint(self, checkpoint_path: Any, weights_only: Any = None) -> dict[str, Any]:
        path = Path(self.broadcast(str(checkpoint_path)))
        state = self._shardpoint_state(None)
        load(state, path, strict=self.lightning_module.strict_loading)
        return state["lightning"].value

    def _shardpoint_state(self, lightning: dict[str, Any] | None) -> dict[str, Any]:
        if len(self.optimizers) > 1:
            raise ValueError("ShardpointModelParallelStrategy supports one optimizer")
        train = TrainState(
            model=self.model,
            optimizer=self.optimizers[0] if self.optimizers else None,
            capture_rng_state=False,  # ResumableRNG's, in Lightning's dictionary
        )
        return {"model": train, "lightning": _EachRank(lightning)}


class _EachRank:
    """A value every rank has its own of: saved in the rank's fragment; on load the
    rank takes its own back (a rank the saved run did not have takes rank 0's)."""

    def __init__(self, value: Any) -> None:
        self.value = value

    def state_dict(self) -> dict[str, Any]:
        return {"ranks": PerRank({dist.rank(): self.value})}

    def stored_keys_to_load(self, rel: tuple[object, ...], keys: list[object]) -> Any:
        if rel == ("ranks",) and keys:
            return [dist.rank() if dist.rank() in keys else min(keys)]  # type: ignore[type-var]
        return None

    def load_state_dict(self, state: dict[str, Any]) -> None:
        (self.value,) = state["ranks"].values()


class InexactResumeWarning(UserWarning):
    """A resumed fit will not continue bit for bit as the uninterrupted one would have
    (the message says why and what to change)."""


class ResumableRNG(Callback):
    """Saves every rank's Python, NumPy and torch random streams, and the state of the
    training loader's own generators (the ``DataLoader``'s ``generator`` and its
    sampler's), with every checkpoint, and puts each rank's own back when a resumed fit
    starts (a rank the saved run did not have gets streams derived from a saved rank's
    and its own number, and its loader's generators as they are).

    When they go back depends on where the checkpoint was saved, so that every draw
    comes from the state the uninterrupted fit drew it from:

    - on an epoch's last batch: the next thing the uninterrupted fit did was make the
      next epoch's iterator, drawing its shuffling (and the loader's base seed) from
      these generators or the global stream. Everything goes back just before the
      resumed fit makes its iterator, and a map-style loader's saved position (of an
      epoch that is over) is not loaded: its fresh iterator is the uninterrupted one's.
    - mid-epoch: the loader's own state (a torchdata ``StatefulDataLoader``) continues
      the epoch; when training starts, the global streams and the loader's generators
      go back to the saved states, for the draws the epochs after it make. A loader
      without a state (a plain ``DataLoader``) restarts at the epoch's first batch in
      Lightning: ``InexactResumeWarning``, naming the fix.
    """

    def __init__(self) -> None:
        self._trainer: Any = None
        self._pending: dict[str, Any] | None = None
        self._generators: list[list[torch.Tensor]] | None = None

    def setup(self, trainer: Any, pl_module: Any, stage: str) -> None:
        self._trainer = trainer

    def state_dict(self) -> dict[str, Any]:
        # Lightning builds the checkpoint on every rank and rank 0 writes its dict:
        # the streams of every rank go into rank 0's.
        # (A strategy that keeps every rank's dict, ShardpointModelParallelStrategy,
        # stores each rank's own streams with it as well.)
        own = capture_rng()
        generators = [
            [g.get_state() for g in _generators(loader)] for loader in self._train_loaders()
        ]
        gathered = dist.gather_json(_encode({"streams": own, "generators": generators}))
        if gathered is None:
            return {"streams": {dist.rank(): own}, "generators": {dist.rank(): generators}}
        ranks = [_decode(value) for value in gathered]
        return {
            "streams": {rank: value["streams"] for rank, value in enumerate(ranks)},
            "generators": {rank: value["generators"] for rank, value in enumerate(ranks)},
        }

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        self._pending = streams_for(dist.rank(), state_dict["streams"])
        self._generators = state_dict.get("generators", {}).get(dist.rank())
        fit_loop = getattr(self._trainer, "fit_loop", None)
        if fit_loop is not None and hasattr(fit_loop, "_load_combined_loader_states"):
            # Lightning has no hook between making the train loader and its iterator:
            # this is the call just before the iterator (FitLoop.setup_data).
            load_loader_states = fit_loop._load_combined_loader_states

            def before_the_iterator() -> None:
                del fit_loop._load_combined_loader_states  # once: the class's again
                self._before_the_iterator(fit_loop)
                load_loader_states()

            fit_loop._load_combined_loader_states = before_the_iterator

    def _before_the_iterator(self, fit_loop: Any) -> None:
        if not fit_loop.epoch_loop.batch_progress.is_last_batch or self._pending is None:
            return  # mid-epoch: the loader's own state continues; see on_train_start
        loaders = self._train_loaders()
        if not any(isinstance(dl.dataset, torch.utils.data.IterableDataset) for dl in loaders):
            # The saved position is of an epoch that is over: the uninterrupted fit
            # made a fresh iterator next, and so does this one.
            fit_loop._combined_loader_states_to_load = []
        restore_rng(self._pending)
        self._pending = None
        self._restore_generators(loaders)

    def on_train_start(self, trainer: Any, pl_module: Any) -> None:
        if self._pending is None:
            return  # nothing loaded, or restored before the iterator (an epoch's end)
        restore_rng(self._pending)
        self._pending = None
        loaders = self._train_loaders()
        plain = [dl for dl in loaders if not _has_state(dl)]
        if plain and not trainer.fit_loop.epoch_loop.batch_progress.is_last_batch:
            warnings.warn(
                f"resumed mid-epoch (global step {trainer.global_step}) with a "
                f"{type(plain[0]).__name__} that has no state: Lightning restarts it at "
                "the epoch's first batch, so the rest of this epoch does not get the "
                "uninterrupted fit's batches. Use torchdata's StatefulDataLoader, or "
                "save only on an epoch's last batch, for an exact resume",
                InexactResumeWarning,
                stacklevel=2,
            )
        self._restore_generators(loaders)

    def _train_loaders(self) -> list[Any]:
        combined = getattr(getattr(self._trainer, "fit_loop", None), "_combined_loader", None)
        if combined is None:
            return []
        return [dl for dl in combined.flattened if isinstance(dl, torch.utils.data.DataLoader)]

    def _restore_generators(self, loaders: list[Any]) -> None:
        saved, self._generators = self._generators, None
        if saved is None:
            return
        now = [_generators(loader) for loader in loaders]
        if [len(g) for g in now] != [len(s) for s in saved]:
            warnings.warn(
                f"the checkpoint holds the states of {[len(s) for s in saved]} generators "
                f"for the train loaders, which now have {[len(g) for g in now]}: they are "
                "left as they are, and the shuffling after the resume may differ from the "
                "uninterrupted fit's. Resume with the loaders the fit was saved with",
                InexactResumeWarning,
                stacklevel=2,
            )
            return
        for generators, states in zip(now, saved):
            for generator, state in zip(generators, states):
                generator.set_state(state)


def _generators(loader: Any) -> list[torch.Generator]:
    """The generators a loader draws from: its own (each iterator's base seed) and its
    sampler's (the shuffling), each once."""
    found: list[torch.Generator] = []
    batch_sampler = getattr(loader, "batch_sampler", None)
    for owner in (loader, loader.sampler, getattr(batch_sampler, "sampler", None)):
        generator = getattr(owner, "generator", None)
        if isinstance(generator, torch.Generator) and all(generator is not g for g in found):
            found.append(generator)
    return found


def _has_state(loader: Any) -> bool:
    return callable(getattr(loader, "state_dict", None)) and callable(
        getattr(loader, "load_state_dict", None)
    )


class SaveOnPreemption(Callback):
    """After a SIGTERM (on any rank) saves ``last.ckpt`` at the end of the step (or of
    the epoch), then exits with 143, the status schedulers read as "terminated,
    requeue". A signal Lightning acts on first (during validation) still exits with
    143, with the newest checkpoint saved before it. ``dirpath``: where ``last.ckpt``
    goes; by default the ``ModelCheckpoint``'s directory, where ``ckpt_path="last"``
    looks."""

    def __init__(self, dirpath: str | os.PathLike[str] | None = None) -> None:
        self.dirpath = dirpath

    def on_train_batch_end(self, trainer: Any, *args: Any) -> None:
        self._save_if_signalled(trainer)

    def on_train_epoch_end(self, trainer: Any, pl_module: Any) -> None:
        self._save_if_signalled(trainer)

    def on_exception(self, trainer: Any, pl_module: Any, exception: BaseException) -> None:
        # A signal caught elsewhere (validation, Lightning's own checks): no consistent
        # point to save at, but the exit status must still say "terminated".
        if isinstance(exception, SIGTERMException) and exception.code in (None, 0):
            exception.code = 128 + signal.SIGTERM

    def _save_if_signalled(self, trainer: Any) -> None:
        received = int(trainer.received_sigterm)
        if dist.is_distributed():
            (received,) = dist.max_of([received])  # the signal may reach one rank only
        if not received:
            return
        trainer.save_checkpoint(self._last(trainer))
        raise SystemExit(128 + signal.SIGTERM)

    def _last(self, trainer: Any) -> Path:
        cb = trainer.checkpoint_callback
        directory = self.dirpath or (cb.dirpath if cb is not None else None)
        if directory is None:
            raise ValueError("SaveOnPreemption needs dirpath= or a ModelCheckpoint(dirpath=...)")
        name = "last.ckpt" if cb is None else cb.CHECKPOINT_NAME_LAST + cb.FILE_EXTENSION
        return Path(directory) / name


def _encode(value: Any) -> Any:
    """Random streams as JSON (tensors as dtype + values), to gather them."""
    if isinstance(value, torch.Tensor):
        return {"dtype": str(value.dtype).removeprefix("torch."), "values": value.tolist()}
    if isinstance(value, dict):
        return {k: _encode(v) for k, v in value.items()}
    if isinstance(value, list):
        return [_encode(v) for v in value]
    return value


def _decode(value: Any) -> Any:
    if isinstance(value, dict) and set(value) == {"dtype", "values"}:
        return torch.tensor(value["values"], dtype=getattr(torch, value["dtype"]))
    if isinstance(value, dict):
        return {k: _decode(v) for k, v in value.items()}
    if isinstance(value, list):
        return [_decode(v) for v in value]
    return value


__all__ = [
    "InexactResumeWarning",
    "ResumableRNG",
    "SaveOnPreemption",
    "ShardpointCheckpointIO",
    "ShardpointModelParallelStrategy",
]
