"""``shardpoint.open``: a lazy reader that reads only the tensors (or rows) asked for."""

from __future__ import annotations

import os
from types import TracebackType
from typing import Any

import torch

from .checkpoint_dir import open_committed
from .format.index import TensorEntry
from .format.safetensors import DTYPES
from .loading import ReadPlan
from .tree import decode


class CheckpointReader:
    """Read entries of a committed checkpoint one at a time.

    >>> import shardpoint
    >>> with shardpoint.open("/tmp/sp-doc/ckpt") as ckpt:
    ...     ckpt.keys(), ckpt.get("w").tolist(), ckpt.get_slice("w")[1:].tolist()
    (['w'], [1.0, 1.0], [1.0])
    """

    def __init__(
        self, path: str | os.PathLike[str], storage_options: dict[str, Any] | None = None
    ) -> None:
        self._ckpt = open_committed(path, storage_options)
        self.path = self._ckpt.storage.root  # a Path, or the URL

    @property
    def metadata(self) -> dict[str, Any]:
        index = self._ckpt.index
        return {
            "format_version": index.format_version,
            "library_version": index.library_version,
            "created": index.created,
            "world_size": index.world_size,
            "files": dict(index.files),
            "user": dict(index.metadata),
        }

    def keys(self) -> list[str]:
        """Tensor entry names in state order (tied tensors appear under each name), then
        the tensors of the ranks' own values (``PerRank``, kept in their fragments)."""
        names = self._ckpt.index.names()
        listed = set(names)
        return names + [n for n in self._ckpt.index.entries if n not in listed]

    def __contains__(self, name: object) -> bool:
        return isinstance(name, str) and (
            name in self._ckpt.index.entries or name in self._ckpt.index.aliases
        )

    def entry(self, name: str) -> TensorEntry:
        """Where and how ``name`` is stored (dtype, global shape, chunks)."""
        self._require(name)
        return self._ckpt.index.resolve(name)

    def alias_of(self, name: str) -> str | None:
        return self._ckpt.index.aliases.get(name)

    def get(self, name: str, *, verify: bool = True) -> torch.Tensor:
        """The whole tensor ``name``, read and checksum-verified; other entries are not read."""
        self._require(name)
        plan = ReadPlan(self._ckpt)
        tensor = plan.fresh(name)
        plan.run(threads=1, verify=verify, direct=False)
        return tensor

    def get_slice(self, name: str, *, verify: bool = True) -> TensorSlice:
        """A handle whose ``[...]`` reads only the rows that the index touches.

        Checksums cover blocks of about 256 KiB of whole rows, so with ``verify`` a
        slice reads the blocks around its rows and checks them; ``verify=False`` reads
        exactly the rows, unchecked.
        """
        return TensorSlice(self, self.entry(name), verify)

    def state(self, *, tensors: bool = True) -> Any:
        """The whole saved state as Python values; with ``tensors=False`` each tensor is
        replaced by its ``TensorEntry`` and nothing but the index is read."""
        if not tensors:
            return decode(self._ckpt.index.tree, self.entry, self._ckpt.fragment_value)
        plan = ReadPlan(self._ckpt)
        loaded = {name: plan.fresh(name) for name in self._ckpt.index.entries}
        plan.run(threads=1, verify=True, direct=False)
        loaded |= {a: loaded[t] for a, t in self._ckpt.index.aliases.items()}  # tied: one tensor
        return decode(self._ckpt.index.tree, loaded.__getitem__, self._ckpt.fragment_value)

    def _read_box(
        self, entry: TensorEntry, box: list[tuple[int, int]], verify: bool
    ) -> torch.Tensor:
        """The box ``[lo, hi)`` per dimension of ``entry``, reading only overlapping rows."""
        out = torch.empty([hi - lo for lo, hi in box], dtype=DTYPES[entry.dtype])
        plan = ReadPlan(self._ckpt)
        plan.into_region(entry.name, out, tuple(lo for lo, _ in box))
        plan.run(threads=1, verify=verify, direct=False)
        return out

    def _require(self, name: str) -> None:
        if name not in self:
            raise KeyError(f"{self.path}: no tensor entry {name!r}; see .keys()")

    def close(self) -> None:
        """Nothing is held open between reads; kept for the context-manager protocol."""

    def __enter__(self) -> CheckpointReader:
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.close()


class TensorSlice:
    """Lazy view of one entry: ``shape``, ``dtype`` and ``[index]`` (ints, slices, ``...``)."""

    def __init__(self, reader: CheckpointReader, entry: TensorEntry, verify: bool) -> None:
        self._reader = reader
        self._entry = entry
        self._verify = verify
        self.shape = entry.shape
        self.dtype = DTYPES[entry.dtype]

    def __getitem__(self, index: Any) -> torch.Tensor:
        box, post = _bounding_box(index, self.shape)
        return self._reader._read_box(self._entry, box, self._verify)[post]


def _bounding_box(
    index: Any, shape: tuple[int, ...]
) -> tuple[list[tuple[int, int]], tuple[Any, ...]]:
    """Per-dimension [lo, hi) covering ``index``, and the index to apply inside that box."""
    if not isinstance(index, tuple):
        index = (index,)
    if any(i is Ellipsis for i in index):
        at = index.index(Ellipsis)
        fill = len(shape) - (len(index) - 1)
        index = index[:at] + (slice(None),) * fill + index[at + 1 :]
    if len(index) > len(shape):
        raise IndexError(f"too many indices ({len(index)}) for a tensor of {len(shape)} dims")
    index = index + (slice(None),) * (len(shape) - len(index))
    box: list[tuple[int, int]] = []
    post: list[Any] = []
    for i, size in zip(index, shape):
        if isinstance(i, bool) or not isinstance(i, (int, slice)):
            raise TypeError(f"get_slice supports ints, slices and ..., got {i!r}")
        if isinstance(i, int):
            j = i + size if i < 0 else i
            if not 0 <= j < size:
                raise IndexError(f"index {i} is out of range for a dimension of size {size}")
            box.append((j, j + 1))
            post.append(0)
            continue
        start, stop, step = i.indices(size)
        if step <= 0:
            raise ValueError("get_slice supports positive steps only")
        stop = max(start, stop)
        box.append((start, stop))
        post.append(slice(0, stop - start, step))
    return box, tuple(post)
