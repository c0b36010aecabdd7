"""Which files of a directory's checkpoints other checkpoints refer to.

An incremental save's index names files of sibling checkpoints (``../DIR/NAME``).
Retention, pruning and the clean-up of leftovers ask this module before deleting a
checkpoint, and keep every file a remaining committed checkpoint refers to
(``Commit.delete(keep=...)``).

Retention asks after every save, for every kept checkpoint: a committed index never
changes, so what it refers to is cached under its marker (which holds the index's
checksum) and costs one small read once known.
"""

from __future__ import annotations

import json
import os
from collections.abc import Iterable
from typing import Any

from .checkpoint_dir import MAX_INDEX_BYTES, MAX_MARKER_BYTES
from .errors import CheckpointError
from .format.index import split_reference
from .names import INDEX_NAME, MARKER_NAME
from .storage import join, open_storage

_Cache = dict[tuple[str, bytes], set[tuple[str, str]]]


class References:
    """What the committed checkpoints under one parent directory refer to."""

    def __init__(self, parent: str | os.PathLike[str], options: dict[str, Any] | None) -> None:
        self.parent, self.options = parent, options
        self._cache: _Cache = {}

    def files(self, directories: Iterable[str]) -> dict[str, set[str]] | None:
        """Sibling directory name -> its files that the committed checkpoints in
        ``directories`` (names under the parent) refer to; None if that cannot be told.

        None when a marker or an index cannot be *read* (an I/O error, a special file,
        a store that is down): the caller must then keep every file it would delete,
        never guess. An index that is there but does not parse refers to nothing: its
        checkpoint is invalid for good, and keeping bytes for it would keep them forever.
        """
        out: dict[str, set[str]] = {}
        for name in directories:
            try:
                refs = self._of(name)
            except CheckpointError:
                return None
            for sibling, file in refs:
                out.setdefault(sibling, set()).add(file)
        return out

    def _of(self, name: str) -> set[tuple[str, str]]:
        storage = open_storage(join(self.parent, name), self.options)
        marker = storage.read_small(MARKER_NAME, MAX_MARKER_BYTES)
        if marker is None:
            return set()  # not (or no longer) a checkpoint: refers to nothing
        key = (name, marker)
        if key not in self._cache:
            raw = storage.read_small(INDEX_NAME, MAX_INDEX_BYTES)
            try:
                files = json.loads(raw)["files"] if raw is not None else {}
                refs = {r for f in files if isinstance(f, str) and (r := split_reference(f))}
            except (ValueError, KeyError, TypeError, RecursionError):
                refs = set()
            self._cache[key] = refs
        return self._cache[key]


def referenced_files(
    parent: str | os.PathLike[str], directories: Iterable[str], options: dict[str, Any] | None
) -> dict[str, set[str]] | None:
    """``References(parent, options).files(directories)``, without a cache."""
    return References(parent, options).files(directories)
