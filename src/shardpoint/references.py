"""Which files of a directory's checkpoints other checkpoints refer to.

An incremental save's index names files of sibling checkpoints (``../DIR/NAME``).
Retention, pruning and the clean-up of leftovers ask this module before deleting a
checkpoint, and keep every file a remaining committed checkpoint refers to
(``Commit.delete(keep=...)``).
"""

from __future__ import annotations

import os
from collections.abc import Iterable
from typing import Any

from .checkpoint_dir import MAX_INDEX_BYTES
from .errors import CheckpointError
from .format.index import parse_index, split_reference
from .names import INDEX_NAME
from .storage import join, open_storage


def referenced_files(
    parent: str | os.PathLike[str], directories: Iterable[str], options: dict[str, Any] | None
) -> dict[str, set[str]]:
    """Sibling directory name -> its files that the committed checkpoints in
    ``directories`` (names under ``parent``) refer to.

    An index that cannot be read refers to nothing: its checkpoint is already invalid,
    and keeping bytes for it would keep them forever.
    """
    out: dict[str, set[str]] = {}
    for name in directories:
        storage = open_storage(join(parent, name), options)
        try:
            raw = storage.read_small(INDEX_NAME, MAX_INDEX_BYTES)
            if raw is None:
                continue
            files = parse_index(raw, storage.location(INDEX_NAME)).files
        except CheckpointError:
            continue
        for file in files:
            ref = split_reference(file)
            if ref is not None:
                out.setdefault(ref[0], set()).add(ref[1])
    return out
