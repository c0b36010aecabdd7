"""shardpoint: sharded, verified, resumable checkpoints for PyTorch training.

>>> import torch, shardpoint
>>> shardpoint.save({"w": torch.ones(2), "step": 7}, "/tmp/ckpt")     # doctest: +SKIP
>>> shardpoint.load(state, "/tmp/ckpt")                               # doctest: +SKIP
"""

from .background_save import AsyncSave, AsyncSaver, async_save
from .checkpoint_copy import CopyInfo, copy_checkpoint
from .convert import convert
from .errors import (
    CheckpointError,
    CheckpointExistsError,
    ConcurrentWriterError,
    CorruptCheckpointError,
    IncompleteCheckpointError,
    NaNStateError,
    StateMismatchError,
    UnsupportedValueError,
)
from .hf import export_hf, import_hf, load_hf
from .incremental import IncrementalChain
from .loading import load
from .reader import CheckpointReader, TensorSlice
from .save_records import SaveInfo
from .saving import save
from .training.data import ResumableLoader, ResumableSampler
from .training.manager import CheckpointManager
from .training.options import (
    AsyncOptions,
    ErasureCode,
    IOOptions,
    MemoryTierOptions,
    RemoteTier,
    Replicas,
    SavePolicy,
)
from .training.retention import RetentionPolicy
from .training.train_state import TrainState
from .tree import PerRank, Stateful
from .verify import FileReport, VerifyReport, verify
from .version import __version__


def open(path: str, storage_options: dict | None = None) -> CheckpointReader:  # noqa: A001
    """Open a committed checkpoint (directory or URL) for lazy reads; use it as a
    context manager. (The contract name is ``shardpoint.open``.)"""
    return CheckpointReader(path, storage_options)


__all__ = [
    "CopyInfo",
    "copy_checkpoint",
    "IncrementalChain",
    "AsyncOptions",
    "AsyncSave",
    "AsyncSaver",
    "CheckpointError",
    "CheckpointManager",
    "CheckpointExistsError",
    "NaNStateError",
    "CheckpointReader",
    "ConcurrentWriterError",
    "CorruptCheckpointError",
    "ErasureCode",
    "FileReport",
    "IOOptions",
    "IncompleteCheckpointError",
    "MemoryTierOptions",
    "PerRank",
    "RemoteTier",
    "Replicas",
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
