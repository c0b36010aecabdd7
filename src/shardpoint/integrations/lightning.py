"""PyTorch Lightning: shardpoint checkpoints through ``Trainer(plugins=[...])``.

    trainer = L.Trainer(plugins=[ShardpointCheckpointIO()], callbacks=[ResumableRNG(), ...])
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
callback) saves the Python, NumPy and torch streams and restores them when training
starts again, so dropout and anything else drawn from them continue exactly. The data
position is Lightning's own: give it a ``torchdata`` ``StatefulDataLoader`` (with a
seeded ``generator``) and a resumed fit continues at the next batch.

Scope: one process, or strategies whose rank 0 writes the whole checkpoint (DDP). With
several ranks ``ResumableRNG`` keeps rank 0's streams for every rank; FSDP's sharded
state dicts bypass ``CheckpointIO`` in Lightning (use ``CheckpointManager`` directly).
"""

from __future__ import annotations

import itertools
import os
from pathlib import Path
from typing import Any

from lightning.fabric.plugins.io.checkpoint_io import CheckpointIO
from lightning.pytorch.callbacks import Callback

from ..commit import Commit
from ..reader import CheckpointReader
from ..saving import save
from ..storage import open_storage
from ..training.rng import capture_rng, restore_rng


class ShardpointCheckpointIO(CheckpointIO):
    """Lightning's checkpoint files as shardpoint checkpoint directories."""

    def save_checkpoint(
        self, checkpoint: dict[str, Any], path: Any, storage_options: Any = None
    ) -> None:
        path = Path(path)
        path.parent.mkdir(parents=True, exist_ok=True)
        previous = _target(path)
        version = _next_version(path)
        save(checkpoint, version)
        # The name switches to the new directory in one rename; the old one goes after.
        link = path.with_name(f".{path.name}.link")
        link.unlink(missing_ok=True)
        os.symlink(version.name, link)
        os.replace(link, path)
        if previous is not None and previous != version:
            Commit(open_storage(previous)).delete()

    def load_checkpoint(
        self, path: Any, map_location: Any = None, weights_only: Any = None, **kwargs: Any
    ) -> dict[str, Any]:
        with CheckpointReader(path) as reader:
            return reader.state()

    def remove_checkpoint(self, path: Any) -> None:
        path = Path(path)
        target = _target(path)
        if path.is_symlink():
            path.unlink()
        if target is not None:
            Commit(open_storage(target)).delete()


def _target(path: Path) -> Path | None:
    """The checkpoint directory ``path`` names (through its link), if any."""
    if path.is_symlink():
        return path.parent / os.readlink(path)
    return path if path.is_dir() else None


def _next_version(path: Path) -> Path:
    for n in itertools.count():
        candidate = path.with_name(f"{path.name}.{n}")
        if not candidate.exists():
            return candidate
    raise AssertionError("unreachable")


class ResumableRNG(Callback):
    """Saves the Python, NumPy and torch random streams with every checkpoint and puts
    them back when a resumed fit starts training."""

    def __init__(self) -> None:
        self._pending: dict[str, Any] | None = None

    def state_dict(self) -> dict[str, Any]:
        return {"streams": capture_rng()}

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        self._pending = state_dict["streams"]

    def on_train_start(self, trainer: Any, pl_module: Any) -> None:
        if self._pending is not None:
            restore_rng(self._pending)
            self._pending = None


__all__ = ["ResumableRNG", "ShardpointCheckpointIO"]
