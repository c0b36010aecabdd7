"""The commit marker (``COMMITTED``): its JSON, the checkpoint it names, its check of the index."""

from __future__ import annotations

import json

from ..errors import CorruptCheckpointError
from .index import FORMAT_NAME, INDEX_NAME, MARKER_NAME, checksum


def marker_json(index_bytes: bytes, checkpoint: str | None = None) -> bytes:
    """The marker of a commit of ``index_bytes``. ``checkpoint`` names the checkpoint
    across its copies (node-local copies have an index each; the remote copy has the
    first node's): the checksum of that index, which is the default."""
    digest = checksum(index_bytes)
    doc = {"format": FORMAT_NAME, "index_checksum": digest, "checkpoint": checkpoint or digest}
    return json.dumps(doc).encode()


def checkpoint_id(note: bytes) -> str | None:
    """The ``checkpoint`` a marker or a ``PRUNED`` note names (older markers: their
    index checksum); None if unreadable."""
    try:
        doc = json.loads(note.decode("utf-8"))
        found = doc.get("checkpoint", doc.get("index_checksum"))
    except (UnicodeDecodeError, ValueError, AttributeError):
        return None
    return found if isinstance(found, str) else None


def check_marker(marker: bytes, index_bytes: bytes, where: str) -> None:
    """The marker records the checksum of the index it committed; a swapped index fails here."""
    try:
        doc = json.loads(marker.decode("utf-8"))
        recorded = doc["index_checksum"]
    except (UnicodeDecodeError, ValueError, KeyError, TypeError):
        raise CorruptCheckpointError(f"{where}: unreadable commit marker {MARKER_NAME}") from None
    if recorded != checksum(index_bytes):
        raise CorruptCheckpointError(
            f"{where}: {INDEX_NAME} does not match the index that was committed (it was replaced "
            "or damaged after commit); restore it from a copy or use an earlier checkpoint"
        )
