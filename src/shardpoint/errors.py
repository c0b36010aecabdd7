"""The error types shardpoint raises: one base class, one subclass per kind of failure.

Every message names the checkpoint path (and file, where there is one) and says what
the user can do next.
"""

from __future__ import annotations


class CheckpointError(Exception):
    """Base class of every error shardpoint raises about a checkpoint."""


class CorruptCheckpointError(CheckpointError):
    """A file of the checkpoint is malformed, truncated, missing or fails its checksum."""


class IncompleteCheckpointError(CheckpointError):
    """The directory is not a committed checkpoint (no commit marker, e.g. a crashed save)."""


class StateMismatchError(CheckpointError):
    """The checkpoint does not fit the state it is loaded into (keys, shapes or dtypes)."""


class UnsupportedValueError(CheckpointError, TypeError):
    """A value in the state cannot be stored without pickle; refused at save time."""


class NaNStateError(CheckpointError):
    """The state to save holds NaN (a diverged run): it is not checkpointed."""


class CheckpointExistsError(CheckpointError, FileExistsError):
    """A committed checkpoint already exists where a new one was to be written."""


class ConcurrentWriterError(CheckpointError):
    """Another process is saving to (or deleting) the same checkpoint directory."""


def file_too_large(where: str, size: int, limit: int) -> CorruptCheckpointError:
    """The error for a small file (index, marker) over its size limit, read or not."""
    return CorruptCheckpointError(
        f"{where}: {size} bytes, over the limit of {limit} bytes for this file; the "
        "checkpoint is damaged (if it is genuinely this large, raise the limit with "
        "SHARDPOINT_MAX_INDEX_BYTES)"
    )
