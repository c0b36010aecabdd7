"""Conversions between shardpoint and other checkpoint formats.

- ``torch.distributed.checkpoint`` directory -> shardpoint: DCP keeps its metadata in a
  pickle (``.metadata``), which torch's own reader loads with the full unpickler.
  Non-tensor entries of DCP (pickled objects) are not converted and are reported.
- ``torch.save`` file -> shardpoint: read with ``torch.load`` and ``weights_only=True,
  mmap=True`` (the restricted unpickler; tensor bytes stay memory-mapped).
- shardpoint -> ``torch.save`` file: the whole state is built in memory, because a
  ``torch.save`` file is one pickle of one object.

Both readers of a foreign format unpickle, so ``convert`` runs them only when the
caller passes ``allow_pickle=True`` (CLI: ``--allow-pickle``), the same rule as
``.bin`` weights in ``hf.py``: nothing is unpickled on a default path.
"""

from __future__ import annotations

import os
import tempfile
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from .errors import CheckpointError
from .format.index import MARKER_NAME
from .reader import CheckpointReader
from .saving import save
from .storage.direct_io import fsync_directory, link_new


@dataclass(frozen=True)
class Conversion:
    """What ``convert`` did."""

    source_format: str  # "dcp", "torch.save" or "shardpoint"
    path: Path
    tensors: int
    skipped: list[str] = field(default_factory=list)  # entries that could not be converted


def detect_format(path: str | os.PathLike[str]) -> str:
    path = Path(path)
    if path.is_dir() and (path / MARKER_NAME).exists():
        return "shardpoint"
    if path.is_dir() and (path / ".metadata").exists():
        return "dcp"
    if path.is_file():
        return "torch.save"
    raise CheckpointError(
        f"{path}: not a shardpoint checkpoint (no {MARKER_NAME}), a torch.distributed."
        "checkpoint directory (no .metadata) or a torch.save file"
    )


def convert(
    source: str | os.PathLike[str], out: str | os.PathLike[str], *, allow_pickle: bool = False
) -> Conversion:
    """Convert ``source`` (DCP directory, ``torch.save`` file, or shardpoint checkpoint)
    to ``out``: a shardpoint checkpoint, or a ``torch.save`` file from shardpoint.

    A DCP directory or a ``torch.save`` file is a pickle and is refused unless
    ``allow_pickle=True``: pass it only for files you trust.

    >>> convert("dcp_checkpoint/", "runs/converted", allow_pickle=True)  # doctest: +SKIP
    """
    kind = detect_format(source)
    if kind == "shardpoint":
        return _shardpoint_to_torch_save(source, out)
    if not allow_pickle:
        raise _pickle_refused(Path(source), kind)
    if kind == "dcp":
        return _dcp_to_shardpoint(source, out)
    return _torch_save_to_shardpoint(source, out)


def _pickle_refused(source: Path, kind: str) -> CheckpointError:
    # Raised before any byte of the pickle is read: unpickling is what runs code.
    if kind == "dcp":
        file, what = source / ".metadata", "DCP metadata, read by torch's full unpickler"
    else:
        file, what = source, "torch.save file, read by torch's restricted unpickler"
    return CheckpointError(
        f"{file}: not read without allow_pickle=True: it is a pickle ({what}), and "
        "unpickling a file can run code it carries. If you trust it, pass "
        "allow_pickle=True (CLI: --allow-pickle)."
    )


def _dcp_to_shardpoint(source: str | os.PathLike[str], out: str | os.PathLike[str]) -> Conversion:
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.metadata import TensorStorageMetadata

    reader = dcp.FileSystemReader(str(source))
    metadata = reader.read_metadata()
    state: dict[str, Any] = {}
    skipped = []
    for key, meta in metadata.state_dict_metadata.items():
        if isinstance(meta, TensorStorageMetadata):
            state[key] = torch.empty(meta.size, dtype=meta.properties.dtype)
        else:
            skipped.append(key)
    dcp.load(state, storage_reader=reader, no_dist=True)
    info = save(state, out)
    return Conversion("dcp", info.path, info.tensors, skipped)


def _torch_save_to_shardpoint(
    source: str | os.PathLike[str], out: str | os.PathLike[str]
) -> Conversion:
    try:
        obj = torch.load(source, map_location="cpu", weights_only=True, mmap=True)
    except Exception as exc:  # noqa: BLE001 - anything torch.load raises is the file's fault
        raise CheckpointError(
            f"{source}: cannot read it as a torch.save file with weights_only=True ({exc}); "
            "only tensors and plain containers are converted"
        ) from None
    if isinstance(obj, torch.Tensor):
        obj = {"tensor": obj}
    if not isinstance(obj, dict):
        raise CheckpointError(f"{source}: holds a {type(obj).__name__}, not a dict of tensors")
    info = save(obj, out)
    return Conversion("torch.save", info.path, info.tensors)


def _link_new(tmp: Path, out: Path) -> None:
    """Give ``tmp`` the name ``out``, which must not exist (not even as a link)."""
    try:
        link_new(tmp, out)
    except FileExistsError:
        raise CheckpointError(f"{out}: already exists; choose a new file name") from None


def _shardpoint_to_torch_save(
    source: str | os.PathLike[str], out: str | os.PathLike[str]
) -> Conversion:
    out = Path(out)
    if out.exists():
        raise CheckpointError(f"{out}: already exists; choose a new file name")
    with CheckpointReader(source) as reader:
        state = reader.state()  # verified
        tensors = len(reader.keys())
    # Durable before it has its name, and never over a file that is there: a new file
    # of its own, synced, then linked to the name (a link refuses an existing one).
    fd, name = tempfile.mkstemp(prefix=f".{out.name}.", suffix=".tmp", dir=out.parent)
    tmp = Path(name)
    try:
        with open(fd, "wb") as f:
            torch.save(state, f)
            f.flush()
            os.fsync(f.fileno())
        _link_new(tmp, out)
    finally:
        tmp.unlink(missing_ok=True)
    fsync_directory(out.parent)
    return Conversion("shardpoint", out, tensors)
