"""shardpoint: sharded, verified, resumable checkpoints for PyTorch training.

>>> import torch, shardpoint
>>> shardpoint.save({"w": torch.ones(2), "step": 7}, "/tmp/ckpt")     # doctest: +SKIP
>>> shardpoint.load(state, "/tmp/ckpt")                               # doctest: +SKIP
"""

from .background_save import AsyncSave, AsyncSaver, async_save
from .convert import convert  # noqa: E402
from .errors import (  # noqa: E402
    CheckpointError,
    CheckpointExistsError,
    ConcurrentWriterError,
    CorruptCheckpointError,
    IncompleteCheckpointError,
    StateMismatchError,
    UnsupportedValueError,
)
from .hf import export_hf, import_hf, load_hf  # noqa: E402
from .loading import load  # noqa: E402
from .reader import CheckpointReader, TensorSlice  # noqa: E402
from .saving import SaveInfo, save  # noqa: E402
from .training.data import ResumableLoader, ResumableSampler  # noqa: E402
from .training.manager import CheckpointManager  # noqa: E402
from .training.options import (  # noqa: E402
    AsyncOptions,
    IOOptions,
    MemoryTierOptions,
    RemoteTier,
    SavePolicy,
)
from .training.retention import RetentionPolicy  # noqa: E402
from .training.train_state import TrainState  # noqa: E402
from .tree import Stateful  # noqa: E402
from .verify import FileReport, VerifyReport, verify  # noqa: E402
from .version import __version__


def open(path: str, storage_options: dict | None = None) -> CheckpointReader:  # noqa: A001
    """Open a committed checkpoint (directory or URL) for lazy reads; use it as a
    context manager. (The contract name is ``shardpoint.open``.)"""
    return CheckpointReader(path, storage_options)


__all__ = [
    "AsyncOptions",
    "AsyncSave",
    "AsyncSaver",
    "CheckpointError",
    "CheckpointManager",
    "CheckpointExistsError",
    "CheckpointReader",
    "ConcurrentWriterError",
    "CorruptCheckpointError",
    "FileReport",
    "IOOptions",
    "IncompleteCheckpointError",
    "MemoryTierOptions",
    "RemoteTier",
    "ResumableLoader",
    "ResumableSampler",
    "RetentionPolicy",
    "SaveInfo",
    "SavePolicy",
    "StateMismatchError",
    "Stateful",
    "TensorSlice",
    "TrainState",
    "UnsupportedValueError",
    "VerifyReport",
    "__version__",
    "async_save",
    "convert",
    "export_hf",
    "import_hf",
    "load_hf",
    "load",
    "open",
    "save",
    "verify",
]
