"""The Hugging Face sharded layout: export to it, load from it, import it.

The layout (public, huggingface_hub): ``model-00001-of-0000N.safetensors`` files, each
with ``{"format": "pt"}`` metadata, and ``model.safetensors.index.json`` holding
``{"metadata": {"total_size": N}, "weight_map": {tensor: file}}``; a model that fits
one shard is a single ``model.safetensors`` without an index.

Export streams tensor by tensor: one tensor (plus its cast copy) is in memory at a
time. Loading reads each rank's slices straight into its (possibly FSDP-sharded)
parameters with the same read planner as ``shardpoint.load``.

A layout being read is the user's own files, not a shardpoint checkpoint, so it has
its own file rule (``SourceDirectory``): symlinks are followed wherever they point
(the hub cache links ``snapshots/<rev>/*`` to ``../../blobs/<sha>``) and names may
hold spaces, '+' and non-ASCII letters; a name is still a plain name inside the
directory and must be a regular file.
"""

from __future__ import annotations

import contextlib
import json
import math
import mmap
import os
import re
import warnings
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from .checkpoint_dir import CommittedCheckpoint, read_header
from .defaults import DEFAULT_THREADS
from .errors import (
    CheckpointError,
    CheckpointExistsError,
    CorruptCheckpointError,
    StateMismatchError,
)
from .format.index import Chunk, Index, TensorEntry
from .format.safetensors import DTYPES, METADATA_KEY, dtype_name, encode_header, itemsize, layout
from .layout import SHARD_METADATA, pack_in_order
from .loading import ReadPlan
from .reader import CheckpointReader
from .save_records import SaveInfo
from .saving import save
from .storage import CheckpointStorage, FileWriter, open_storage
from .storage.io_types import BLOCK
from .storage.local import LocalDirectory
from .tensor_kinds import local_part
from .tensor_memory import flat_bytes, memory_key, plain

HF_INDEX = "model.safetensors.index.json"
HF_SINGLE = "model.safetensors"
DEFAULT_MAX_SHARD_SIZE = "5GB"  # huggingface_hub's default
_MAX_INDEX_BYTES = 256 * 1024 * 1024
_UNITS = {
    "": 1,
    "B": 1,
    "KB": 10**3,
    "MB": 10**6,
    "GB": 10**9,
    "TB": 10**12,
    "KIB": 2**10,
    "MIB": 2**20,
    "GIB": 2**30,
    "TIB": 2**40,
}
_FLOATING = {"F64", "F32", "F16", "BF16"}
CAST_DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}


def parse_size(size: int | str) -> int:
    """Bytes in ``size``: an int, or "5GB" / "500MB" / "2GiB" (GB = 10**9, as in
    huggingface_hub; GiB = 2**30)."""
    if isinstance(size, int):
        return size
    m = re.fullmatch(r"\s*(\d+(?:\.\d+)?)\s*([A-Za-z]*)\s*", size)
    if not m or m.group(2).upper() not in _UNITS:
        raise ValueError(f"not a size: {size!r} (examples: 5GB, 500MB, 2GiB)")
    return int(float(m.group(1)) * _UNITS[m.group(2).upper()])


@dataclass(frozen=True)
class HFExport:
    """What ``export_hf`` wrote."""

    path: Path
    files: list[str]
    tensors: int
    total_size: int


def export_hf(
    checkpoint: str | os.PathLike[str],
    out: str | os.PathLike[str],
    *,
    max_shard_size: int | str = DEFAULT_MAX_SHARD_SIZE,
    prefix: str | None = None,
    dtype: str | torch.dtype | None = None,
    rename: Iterable[tuple[str, str]] = (),
    progress: Callable[[int], None] | None = None,
) -> HFExport:
    """Write the tensors of a shardpoint checkpoint in the Hugging Face sharded layout.

    ``prefix`` selects entries whose name starts with it and strips it (``"model."``
    for a ``{"model": model}`` or ``TrainState`` checkpoint). ``dtype`` ("bf16",
    "fp16", "fp32" or a torch dtype) casts floating tensors. ``rename`` is a list of
    ``(regex, replacement)`` applied in order to every (stripped) name. Works for a
    checkpoint saved on any number of ranks with any sharding; every tensor is read
    and checksum-verified on its own, so memory holds one tensor at a time.

    >>> export_hf("runs/step-1000", "export/", prefix="model.", dtype="bf16")  # doctest: +SKIP
    """
    limit = parse_size(max_shard_size)
    cast = _cast_dtype(dtype)
    try:
        rules = [(re.compile(pattern), replacement) for pattern, replacement in rename]
    except re.error as exc:
        raise ValueError(
            f"rename pattern {exc.pattern!r} is not a regular expression: {exc}"
        ) from None
    dest = open_storage(out)
    with CheckpointReader(checkpoint) as reader:
        plan: list[tuple[str, str, str, tuple[int, ...]]] = []  # source, name, dtype, shape
        seen: dict[str, str] = {}
        for source in reader.keys():
            if prefix is not None and not source.startswith(prefix):
                continue
            name = source[len(prefix or "") :]
            for pattern, replacement in rules:
                name = pattern.sub(replacement, name)
            if name == METADATA_KEY:
                raise CheckpointError(
                    f"{out}: {source!r} would be exported as {name!r}, the key safetensors "
                    "reserves; change the rename rules"
                )
            if name in seen:
                raise CheckpointError(
                    f"{out}: {seen[name]!r} and {source!r} would both be exported as {name!r}; "
                    "change the rename rules"
                )
            seen[name] = source
            entry = reader.entry(source)
            stored = entry.dtype
            target = dtype_name(cast) if cast is not None and stored in _FLOATING else stored
            plan.append((source, name, target, entry.shape))
        if not plan:
            raise CheckpointError(
                f"{reader.path}: no tensor entry starts with {prefix!r}; see `shardpoint "
                "inspect` for the names (a TrainState's model is under 'model.')"
            )
        shards = pack_in_order(
            plan, lambda t: t[1], lambda t: math.prod(t[3]) * itemsize(t[2]), limit
        )
        names = _file_names(len(shards))
        _prepare_output(dest)
        weight_map: dict[str, str] = {}
        total = sum(math.prod(shape) * itemsize(dt) for _, _, dt, shape in plan)
        written: list[str] = []
        try:
            for file, tensors in zip(names, shards):
                _write_hf_file(reader, dest, file, tensors, progress)
                written.append(file)
                weight_map.update({name: file for _, name, _, _ in tensors})
            if len(names) > 1:
                index = {
                    "metadata": {"total_size": total},
                    "weight_map": dict(sorted(weight_map.items())),
                }
                dest.write_small_durably(HF_INDEX, json.dumps(index, indent=2).encode())
                written.append(HF_INDEX)
            dest.sync()
        except BaseException:
            # No half export (it would refuse the next try): the files it finished go.
            for file in written:
                with contextlib.suppress(Exception):
                    dest.delete(file)
            raise
    return HFExport(dest.root, names, len(plan), total)


def _cast_dtype(dtype: str | torch.dtype | None) -> torch.dtype | None:
    if dtype is None or isinstance(dtype, torch.dtype):
        return dtype
    if dtype not in CAST_DTYPES:
        raise ValueError(f"dtype must be one of {sorted(CAST_DTYPES)}, not {dtype!r}")
    return CAST_DTYPES[dtype]


def _file_names(n: int) -> list[str]:
    if n == 1:
        return [HF_SINGLE]
    return [f"model-{k:05d}-of-{n:05d}.safetensors" for k in range(1, n + 1)]


def _prepare_output(out: CheckpointStorage) -> None:
    out.prepare()
    existing = [  # a killed export's unfinished .tmp files are overwritten, not in the way
        n
        for n in out.list()
        if n.startswith("model") and ".safetensors" in n and not n.endswith(".tmp")
    ]
    if existing:
        raise CheckpointExistsError(
            f"{out.where}: already holds an exported model ({sorted(existing)[:3]}); export to an "
            "empty directory or remove those files first"
        )


def _write_hf_file(
    reader: CheckpointReader,
    out: CheckpointStorage,
    file: str,
    tensors: list[tuple[str, str, str, tuple[int, ...]]],
    progress: Callable[[int], None] | None,
) -> None:
    """One file, tensor by tensor (each read, verified, written, then dropped); it
    appears whole or not at all (a local ``.tmp`` renamed, an object PUT)."""
    slots = layout([(name, dt, shape) for _, name, dt, shape in tensors])
    header = encode_header(slots, SHARD_METADATA)
    size = len(header) + sum(s.nbytes for s in slots.values())
    stream = _InOrder(out.open_writer(file, size, threads=4))
    try:
        stream.write(memoryview(header))
        for source, name, dt, _ in tensors:
            tensor = reader.get(source)  # verified; the only copy of it in memory
            if tensor.dtype != DTYPES[dt]:
                tensor = tensor.to(DTYPES[dt])
            stream.write(memoryview(flat_bytes(tensor).numpy()))
            if progress is not None:
                progress(slots[name].nbytes)
            del tensor
        stream.close()
    except BaseException:
        stream.writer.abort()
        raise


class _InOrder:
    """Bytes written in file order, handed to a ``FileWriter`` in BLOCK pieces (which
    start at page boundaries, as writers need)."""

    def __init__(self, writer: FileWriter) -> None:
        self.writer = writer
        self.offset = 0
        self.buffer = bytearray()

    def write(self, data: memoryview) -> None:
        data = data.cast("B")
        while len(data):
            take = min(BLOCK - len(self.buffer), len(data))
            self.buffer += data[:take]
            data = data[take:]
            if len(self.buffer) == BLOCK:
                self._flush()

    def _flush(self) -> None:
        self.writer.write(self.offset, memoryview(self.buffer))
        self.offset += len(self.buffer)
        self.buffer = bytearray()

    def close(self) -> None:
        if self.buffer:
            self._flush()
        self.writer.close()


# ---- reading the layout ------------------------------------------------------------------


def check_source_file_name(name: object, where: str) -> str:
    """A file name from a source's weight map: a plain name inside the source directory
    (no '/', not '.' or '..', no NUL, hence never absolute). Unlike shardpoint's own
    shard names (``format.index.check_file_name``) it may hold spaces, '+' and
    non-ASCII letters: whoever wrote the source chose it."""
    if not isinstance(name, str) or not _is_plain_name(name):
        raise CorruptCheckpointError(
            f"{where}: refusing file name {name!r}: the weight map must name files inside "
            "the source directory (no '/', no '..', not absolute)"
        )
    return name


def _is_plain_name(name: str) -> bool:
    if name in ("", ".", "..") or "/" in name or "\0" in name:
        return False
    try:
        os.fsencode(name)
    except UnicodeEncodeError:  # a lone surrogate from JSON names no file
        return False
    return True


class SourceDirectory(LocalDirectory):
    """The directory of a Hugging Face layout being read: the user's files, so symlinks
    are followed wherever they point, unlike in a shardpoint checkpoint."""

    def path(self, name: str) -> Path:
        # Reads still open only regular files (``open_regular``): a FIFO never blocks.
        return self.root / check_source_file_name(name, str(self.root))


def open_hf(source: str | os.PathLike[str]) -> CommittedCheckpoint:
    """The tensors of a Hugging Face layout (directory with an index or a single
    ``model.safetensors``, or one ``.safetensors`` file), as a checkpoint the read
    planner understands. Headers are parsed strictly; nothing else is read."""
    source = Path(source)
    if source.is_file() and source.name == HF_INDEX:
        source = source.parent  # the index names the layout's files
    weight_map: dict[str, str] | None = None
    if source.is_file():
        if not source.name.endswith(".safetensors"):
            pickled = source.suffix in (".bin", ".pt", ".pth")
            raise CheckpointError(
                f"{source}: not a .safetensors file; pass it or the model's directory"
                + (" (pickle weights: allow_pickle_weights=True reads them)" if pickled else "")
            )
        root, files = source.parent, [source.name]
    elif (source / HF_INDEX).is_file():
        weight_map = _weight_map(source / HF_INDEX)
        root, files = source, sorted(set(weight_map.values()))
    elif (source / HF_SINGLE).is_file():
        root, files = source, [HF_SINGLE]
    else:
        pickled = sorted(p.name for p in source.glob("*.bin")) if source.is_dir() else []
        hint = (
            f" It holds pickle weights ({pickled[0]}...): pass allow_pickle_weights=True "
            "(CLI: --allow-pickle-weights) to read them with torch's restricted unpickler "
            "(weights_only=True)."
            if pickled
            else ""
        )
        raise CheckpointError(
            f"{source}: no {HF_INDEX}, {HF_SINGLE} or .safetensors file here.{hint}"
        )
    storage = SourceDirectory(root)
    entries: dict[str, TensorEntry] = {}
    sizes: dict[str, int] = {}
    for file in files:
        header = read_header(storage, file)  # refuses a missing or irregular file
        size = storage.size(file)
        assert size is not None
        sizes[file] = size
        for name, slot in header.slots.items():
            if name in entries:
                raise CorruptCheckpointError(
                    f"{storage.path(file)}: tensor {name!r} is in two files"
                )
            rows = slot.shape[0] if slot.shape else 1
            chunk = Chunk(
                file,
                name,
                (0,) * len(slot.shape),
                slot.shape,
                (header.data_start + slot.begin, header.data_start + slot.end),
                max(rows, 1),
                (),
            )
            entries[name] = TensorEntry(name, slot.dtype, slot.shape, (chunk,))
    if weight_map is not None:  # every tensor the index lists, in the file it names
        lost = [
            n for n, f in weight_map.items() if n not in entries or entries[n].chunks[0].file != f
        ]
        if lost:
            raise CorruptCheckpointError(
                f"{source / HF_INDEX}: lists {len(lost)} tensor(s) not in the file it names "
                f"(e.g. {lost[:3]}); the download is incomplete or the index is stale"
            )
    index = Index(
        files=sizes, entries=entries, aliases={}, tree=None, created="", library_version=""
    )
    return CommittedCheckpoint(storage, index)


def _weight_map(path: Path) -> dict[str, str]:
    where = str(path)
    if path.stat().st_size > _MAX_INDEX_BYTES:
        raise CorruptCheckpointError(f"{where}: index larger than {_MAX_INDEX_BYTES} bytes")
    try:
        data = json.loads(path.read_bytes())
    except (ValueError, UnicodeDecodeError) as exc:
        raise CorruptCheckpointError(f"{where}: not valid JSON ({exc})") from None
    weight_map = data.get("weight_map") if isinstance(data, dict) else None
    if not isinstance(weight_map, dict) or not all(isinstance(k, str) for k in weight_map):
        raise CorruptCheckpointError(f"{where}: no 'weight_map' object of tensor -> file")
    return {name: check_source_file_name(f, where) for name, f in weight_map.items()}


def load_hf(
    target: torch.nn.Module | Mapping[str, torch.Tensor],
    source: str | os.PathLike[str],
    *,
    strict: bool = True,
    threads: int = DEFAULT_THREADS,
    allow_pickle_weights: bool = False,
) -> None:
    """Fill a model (or a mapping of name -> tensor) in place from a Hugging Face layout.

    Each rank reads only the slices its (DTensor/FSDP2-sharded) parameters hold. Tensors
    stored in another floating dtype are cast. Tied parameters count as present when
    one of them is. ``.bin`` (pickle) weights are refused unless
    ``allow_pickle_weights=True``, which reads them with torch's restricted unpickler
    (``weights_only=True``).

    >>> model = LlamaForCausalLM(config)            # doctest: +SKIP
    >>> fully_shard(model)                           # doctest: +SKIP
    >>> shardpoint.load_hf(model, "Llama-3-8B/")     # doctest: +SKIP
    """
    dests = dict(target.state_dict() if isinstance(target, torch.nn.Module) else target)
    source = Path(source)
    if allow_pickle_weights and not _has_safetensors(source):
        return _load_pickle_weights(dests, source, strict)
    ckpt = open_hf(source)
    stored = ckpt.index.entries
    _check_fit(dests, set(stored), strict, str(source))
    plan = ReadPlan(ckpt)
    casts: list[tuple[torch.Tensor, torch.Tensor]] = []
    for name, dest in dests.items():
        if name not in stored:
            continue
        entry = stored[name]
        part, global_shape, offsets = local_part(plain(dest), name)
        if tuple(global_shape) != entry.shape:
            raise StateMismatchError(
                f"{source}: {name!r} has shape {list(entry.shape)} in the file and "
                f"{list(global_shape)} in the model; build the model from the same config"
            )
        if part.dtype == DTYPES[entry.dtype]:
            plan.into_region(name, part, offsets)
        else:
            tmp = torch.empty(part.shape, dtype=DTYPES[entry.dtype])
            plan.into_region(name, tmp, offsets)
            casts.append((part, tmp))
    plan.run(threads=threads, verify=False)  # the layout has no checksums
    with torch.no_grad():
        for part, tmp in casts:
            part.copy_(tmp)


def _has_safetensors(source: Path) -> bool:
    return source.suffix == ".safetensors" or any(source.glob("*.safetensors"))


def _check_fit(dests: dict[str, torch.Tensor], stored: set[str], strict: bool, where: str) -> None:
    present = {_storage_key(t) for name, t in dests.items() if name in stored}
    missing = [
        n
        for n, t in dests.items()
        if n not in stored and (_storage_key(t) is None or _storage_key(t) not in present)
    ]
    unexpected = sorted(stored - set(dests))
    if strict and (missing or unexpected):
        raise StateMismatchError(
            f"{where}: the weights do not fit the model: missing {missing[:5]}, unexpected "
            f"{unexpected[:5]}; build the model from the checkpoint's config or pass strict=False"
        )


def _storage_key(t: torch.Tensor) -> tuple[Any, ...] | None:
    part = plain(t)
    return memory_key(getattr(part, "_local_tensor", part))


def _pickle_weight_files(source: Path) -> list[Path]:
    """The model's .bin files as the Hugging Face layout names them (a folder also holds
    other .bin files: training_args.bin, optimizer states)."""
    if source.is_file():
        return [source]
    index = source / "pytorch_model.bin.index.json"
    if index.is_file():
        try:
            names = set(json.loads(index.read_text())["weight_map"].values())
        except (ValueError, KeyError, TypeError, AttributeError) as exc:
            raise CheckpointError(f"{index}: not a weights index ({exc})") from None
        if not all(isinstance(n, str) and n and Path(n).name == n for n in names):
            raise CheckpointError(f"{index}: its weight_map must name files of this folder")
        return [source / n for n in sorted(names)]
    if (source / "pytorch_model.bin").is_file():
        return [source / "pytorch_model.bin"]
    raise CheckpointError(
        f"{source}: no pytorch_model.bin or pytorch_model.bin.index.json here; pass the .bin file"
    )


def _read_pickle_weights(source: Path) -> dict[str, torch.Tensor]:
    stored: dict[str, torch.Tensor] = {}
    for f in _pickle_weight_files(source):
        try:  # restricted unpickler (tensors and plain containers only), memory-mapped
            weights = torch.load(f, map_location="cpu", weights_only=True, mmap=True)
        except Exception as exc:  # noqa: BLE001 - any unpickling failure: a typed error
            raise CheckpointError(
                f"{f}: not loadable as weights ({type(exc).__name__}: {exc})"
            ) from None
        if not isinstance(weights, dict) or not all(
            isinstance(k, str) and isinstance(v, torch.Tensor) for k, v in weights.items()
        ):
            raise CheckpointError(f"{f}: holds no dict of named tensors")
        stored.update(weights)
    return stored


def _load_pickle_weights(dests: dict[str, torch.Tensor], source: Path, strict: bool) -> None:
    stored = _read_pickle_weights(source)
    _check_fit(dests, set(stored), strict, str(source))
    parts = {n: local_part(plain(d), n) for n, d in dests.items() if n in stored}
    differ = [  # another dtype is cast, as from safetensors files
        f"{n!r}: the file has shape {list(stored[n].shape)}, the model {list(shape)}"
        for n, (_, shape, _) in parts.items()
        if tuple(stored[n].shape) != tuple(shape)
    ]
    if differ:  # checked before any tensor is written, as for safetensors files
        more = f" (+{len(differ) - 10} more)" if len(differ) > 10 else ""
        raise StateMismatchError(
            f"{source}: weights do not fit the model: {'; '.join(differ[:10])}{more}; load "
            "them into the model they were saved from"
        )
    with torch.no_grad():
        for name, (part, _, offsets) in parts.items():
            box = stored[name]
            for dim, (o, s) in enumerate(zip(offsets, part.shape)):
                box = box.narrow(dim, o, s)
            part.copy_(box)


def import_hf(
    source: str | os.PathLike[str],
    out: str | os.PathLike[str],
    *,
    allow_pickle_weights: bool = False,
    **save_options: Any,
) -> SaveInfo:
    """Make a shardpoint checkpoint of a Hugging Face layout's tensors.

    The source files are memory-mapped, so their pages stream through the page cache
    into the new checkpoint instead of being loaded into process memory. ``.bin``
    weights need ``allow_pickle_weights=True`` (see ``load_hf``).
    """
    source = Path(source)
    if allow_pickle_weights and not _has_safetensors(source):
        return save(_read_pickle_weights(source), out, **save_options)
    ckpt = open_hf(source)
    maps: list[mmap.mmap] = []
    tensors: dict[str, torch.Tensor] = {}
    try:
        for file in ckpt.index.files:
            maps.append(ckpt.storage.map_file(file))
            raw = None
            if len(maps[-1]):
                with warnings.catch_warnings():  # read-only on purpose: save only reads it
                    warnings.simplefilter("ignore", UserWarning)
                    raw = torch.frombuffer(maps[-1], dtype=torch.uint8)
            for entry in ckpt.index.entries.values():
                c = entry.chunks[0]
                if c.file != file:
                    continue
                data = (
                    raw[c.begin : c.end] if raw is not None else torch.empty(0, dtype=torch.uint8)
                )
                # A byte view cast to the dtype needs aligned offsets; copy the rare odd one.
                if c.begin % itemsize(entry.dtype):
                    data = data.clone()
                tensors[entry.name] = data.view(DTYPES[entry.dtype]).reshape(entry.shape)
        return save(tensors, out, **save_options)
    finally:
        tensors.clear()
        for m in maps:
            try:
                m.close()
            except BufferError:
                pass  # a tensor still points into it; the map closes when that goes
