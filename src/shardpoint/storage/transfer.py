"""Streaming files between storages: uploads to the remote tier, copies of checkpoints."""

from __future__ import annotations

from collections.abc import Iterator

from ..errors import CorruptCheckpointError
from ..parallel import run_parallel
from . import CheckpointStorage
from .io_types import BLOCK


def copy_file(
    source: CheckpointStorage,
    target: CheckpointStorage,
    name: str,
    threads: int,
    target_name: str | None = None,
    compress: bool = False,
) -> int:
    """Stream one file between any two storages (an object store uploads it in parallel
    multipart parts), as ``target_name`` (default: the same name); returns its size.
    ``compress``: a shard file goes to an object store as its compressed copy."""
    size = source.size(name)
    if size is None:
        raise FileNotFoundError(f"{source.location(name)}: missing")
    blocks = _exactly(source.iter_bytes(name, BLOCK), size, source.location(name))
    if compress and name.endswith(".safetensors"):
        target.write_compressed(target_name or name, blocks, size, threads=threads)  # type: ignore[attr-defined]
        return size
    writer = target.open_writer(target_name or name, size, threads=threads)
    try:
        offset = 0
        for block in blocks:
            writer.write(offset, block)
            offset += len(block)
        writer.close()
    except BaseException:
        writer.abort()
        raise
    return size


def _exactly(blocks: Iterator[memoryview], size: int, where: str) -> Iterator[memoryview]:
    """The blocks, failing (before the copy is finished) if they are not ``size`` bytes:
    a local target would pad or cut the file to its size, an upload take it as whole."""
    n = 0
    for block in blocks:
        n += len(block)
        if n > size:
            break
        yield block
    if n != size:
        raise CorruptCheckpointError(
            f"{where}: {n if n < size else 'more than ' + str(size)} bytes read, {size} "
            "expected (the file changed while it was copied)"
        )


def copy_files(
    source: CheckpointStorage,
    target: CheckpointStorage,
    names: list[str],
    threads: int,
    renamed: dict[str, str] | None = None,
    compress: bool = False,
) -> int:
    """Several files, a few at a time (each as ``renamed[name]`` if given); returns the
    bytes copied."""

    def one(name: str) -> int:
        return copy_file(source, target, name, threads, (renamed or {}).get(name), compress)

    return sum(run_parallel(one, names, threads, "shardpoint-copy"))
