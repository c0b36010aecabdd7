"""The ``shardpoint`` command: a thin layer over the library.

Exit status of every command: 0 success, 1 the check failed (corrupt checkpoint,
differences found), 2 error (unreadable input, bad arguments).

One module although long: every command is a short adapter (its arguments, one library
call, its output) and they share the exit-status and error handling above; split by
command, each file would hold little but imports.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import sys
import time
import warnings
from collections.abc import Callable, Sequence
from contextlib import contextmanager
from pathlib import Path
from typing import Any

from rich.console import Console
from rich.markup import escape
from rich.progress import BarColumn, DownloadColumn, Progress, TextColumn, TimeRemainingColumn
from rich.table import Table
from rich.tree import Tree

from .checkpoint_dir import open_committed
from .commit import Commit
from .errors import CheckpointError
from .format.index import split_reference
from .names import is_own_file, parse_step_dir, writer_rank
from .reader import CheckpointReader
from .references import referenced_files
from .storage import join, open_storage
from .training.retention import KeptCheckpoint, RetentionPolicy
from .verify import verify
from .version import __version__

EXAMPLES = {
    "ls": "shardpoint ls runs/exp1\n  shardpoint ls runs/exp1 --json",
    "inspect": "shardpoint inspect runs/exp1/step-000001000\n"
    "  shardpoint inspect runs/exp1/step-000001000 --json | jq '.tensors[0]'",
    "verify": "shardpoint verify runs/exp1/step-000001000\n"
    "  shardpoint verify runs/exp1            # every checkpoint in a directory",
    "diff": "shardpoint diff runs/exp1/step-000001000 runs/exp1/step-000002000\n"
    "  shardpoint diff A B --json",
    "export-hf": "shardpoint export-hf runs/exp1/step-000001000 export/ --prefix model.\n"
    "  shardpoint export-hf CKPT export/ --prefix model. --dtype bf16 --max-shard-size 2GB\n"
    "  shardpoint export-hf CKPT export/ --rename '^model\\.=' --rename 'attn=self_attn'",
    "import-hf": "shardpoint import-hf Llama-3-8B/ runs/imported\n"
    "  shardpoint import-hf model.safetensors runs/imported",
    "convert": "shardpoint convert dcp_checkpoint/ runs/converted --allow-pickle  # DCP\n"
    "  shardpoint convert model.pt runs/converted --allow-pickle         # torch.save\n"
    "  shardpoint convert runs/exp1/step-000001000 model.pt              # to torch.save",
    "copy": "shardpoint copy runs/exp1/step-000001000 /archive/exp1-step-1000\n"
    "  shardpoint copy runs/exp1/step-000001000 s3://bucket/archive/step-1000",
    "prune": "shardpoint prune runs/exp1 --keep-last 3 --dry-run\n"
    "  shardpoint prune runs/exp1 --keep-last 3",
    "report": "shardpoint report runs/exp1                 # summary + runs/exp1/report.png\n"
    "  shardpoint report runs/exp1 --out saves.png --json",
    "status": "shardpoint status runs/exp1\n"
    "  shardpoint status runs/exp1 --max-age 30m || alert   # cron: exit 1 when stale\n"
    "  shardpoint status runs/exp1 --json --tier remote --max-age 2h",
    "rollback": "shardpoint rollback runs/exp1 --to 12000 --skip-batches 400 --reason 'spike'\n"
    "  shardpoint rollback runs/exp1 --to 12000 --remote s3://bucket/exp1",
}


def human_bytes(n: float) -> str:
    for unit in ("B", "KB", "MB", "GB", "TB"):
        if abs(n) < 1000 or unit == "TB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1000
    raise AssertionError("unreachable")


def _console(stderr: bool = False) -> Console:
    stream = sys.stderr if stderr else sys.stdout
    # Off a terminal (pipes, CI logs) rich would wrap at 80 columns and cut names.
    return Console(file=stream, width=None if stream.isatty() else 200)


@contextmanager
def _progress(total: int, label: str):  # noqa: ANN202 - yields the advance function
    """A progress bar on stderr when it is a terminal; a no-op otherwise."""
    console = _console(stderr=True)
    if not console.is_terminal:
        yield lambda n: None
        return
    columns = (TextColumn(label), BarColumn(), DownloadColumn(), TimeRemainingColumn())
    with Progress(*columns, console=console, transient=True) as progress:
        task = progress.add_task(label, total=max(total, 1))
        yield lambda n: progress.advance(task, n)


def _print_json(value: Any) -> None:
    print(json.dumps(value, indent=1))


# ---- ls -----------------------------------------------------------------------------------


def _checkpoint_dirs(root: str) -> list[str]:
    """``root`` itself if it is a checkpoint, else its subdirectories that look like one
    (local paths or object-store URLs)."""
    if _looks_like_checkpoint(root):
        return [root]
    storage = open_storage(root)
    if not storage.exists():
        raise CheckpointError(f"{root}: no such directory")
    subs = [str(join(root, name)) for name in storage.subdirectories()]
    dirs = [p for p in subs if _looks_like_checkpoint(p)]
    return sorted(dirs, key=lambda p: (_step_of(p) is None, _step_of(p) or 0, p))


def _looks_like_checkpoint(path: str) -> bool:
    return any(is_own_file(name) for name in open_storage(path).list())


def _name(path: str) -> str:
    return str(path).rstrip("/").rsplit("/", 1)[-1]


def _step_of(path: str) -> int | None:
    return parse_step_dir(_name(path))


def _describe(path: str) -> dict[str, Any]:
    row: dict[str, Any] = {"path": path, "step": _step_of(path), "status": "valid", "error": None}
    storage = open_storage(path)
    commit = Commit(storage)
    if not commit.is_committed():
        # A deleted checkpoint whose files later ones read (incremental saves).
        row["status"] = "pruned" if commit.is_pruned() else "uncommitted"
        row["size"] = sum(storage.size(name) or 0 for name in storage.list())
        return row
    try:
        ckpt = open_committed(path)  # marker, index, file sizes: no tensor bytes read
    except CheckpointError as exc:
        row.update(status="invalid", error=str(exc))
        return row
    index = ckpt.index
    step = index.metadata.get("step")
    referenced = sum(size for name, size in index.files.items() if split_reference(name))
    row.update(
        step=step if isinstance(step, int) else row["step"],
        created=index.created,
        size=sum(index.files.values()) - referenced,  # its own files
        referenced=referenced,  # bytes in earlier checkpoints' files it refers to
        files=len(index.files),
        ranks=index.world_size,
    )
    return row


def _ls(args: argparse.Namespace) -> int:
    rows = [_describe(p) for p in _checkpoint_dirs(args.path)]
    if args.json:
        _print_json(rows)
        return 0
    table = Table(title=escape(str(args.path)), title_justify="left")
    columns = ("checkpoint", "step", "created", "size", "referenced", "files", "ranks", "status")
    for column in columns:
        right = column in ("step", "size", "referenced")
        table.add_column(column, justify="right" if right else "left")
    colour = {"valid": "green", "invalid": "bold red", "uncommitted": "yellow", "pruned": "dim"}
    for r in rows:
        table.add_row(
            escape(_name(r["path"])),
            "" if r["step"] is None else str(r["step"]),
            r.get("created", ""),
            human_bytes(r.get("size", 0)),
            human_bytes(r["referenced"]) if r.get("referenced") else "",
            str(r.get("files", "")),
            str(r.get("ranks", "")),
            f"[{colour[r['status']]}]{r['status']}[/]",
        )
    console = _console()
    console.print(table)
    for r in rows:
        if r["error"]:
            console.print(
                f"[red]{escape(_name(r['path']))}[/]: {escape(r['error'])}", highlight=False
            )
    return 0


# ---- inspect ------------------------------------------------------------------------------


def _inspect(args: argparse.Namespace) -> int:
    with CheckpointReader(args.path) as reader:
        rows = []
        for name in reader.keys():
            entry = reader.entry(name)
            writers = (writer_rank(c.file) for c in entry.chunks)
            ranks = sorted({r for r in writers if r is not None})
            rows.append(
                {
                    "name": name,
                    "dtype": entry.dtype,
                    "shape": list(entry.shape),
                    "bytes": entry.nbytes,
                    "chunks": len(entry.chunks),
                    "ranks": ranks,
                    "files": sorted({c.file for c in entry.chunks}),
                    "alias_of": reader.alias_of(name),
                }
            )
        values = reader.state(tensors=False)
        meta = reader.metadata
    if args.json:
        state = _jsonable(values)
        _print_json({"path": str(args.path), **meta, "tensors": rows, "state": state})
        return 0
    console = _console()
    console.print(
        f"[bold]{escape(str(args.path))}[/]  format v{meta['format_version']}, shardpoint "
        f"{meta['library_version']}, created {meta['created']}, {meta['world_size']} rank(s)",
        highlight=False,
    )
    table = Table(show_edge=False)
    for column in ("name", "dtype", "shape", "size", "sharding"):
        table.add_column(column, justify="right" if column == "size" else "left")
    for r in rows:
        if r["alias_of"]:
            sharding = f"= {escape(r['alias_of'])} (tied)"
        elif r["chunks"] == 1:
            sharding = f"whole, rank {r['ranks'][0]}" if r["ranks"] else "whole"
        else:
            sharding = f"{r['chunks']} chunks on ranks {_ranges(r['ranks'])}"
        table.add_row(
            escape(r["name"]), r["dtype"], str(r["shape"]), human_bytes(r["bytes"]), sharding
        )
    console.print(table)
    tree = Tree("[bold]non-tensor state[/]")
    _add_values(tree, values)
    console.print(tree)
    total = sum(meta["files"].values())
    console.print(f"{len(rows)} tensors, {len(meta['files'])} files, {human_bytes(total)}")
    return 0


def _ranges(ranks: list[int]) -> str:
    """[0, 1, 2, 5] -> "0-2, 5"."""
    spans: list[list[int]] = []
    for r in ranks:
        if spans and r == spans[-1][1] + 1:
            spans[-1][1] = r
        else:
            spans.append([r, r])
    return ", ".join(f"{a}-{b}" if b > a else str(a) for a, b in spans)


def _add_values(tree: Tree, value: Any, limit: int = 200) -> None:
    """Non-tensor values as a tree; tensors (index entries) are left out."""
    items = value.items() if isinstance(value, dict) else enumerate(value)
    shown = 0
    for key, v in items:
        if _is_entry(v):
            continue
        if shown == limit:
            tree.add("…")
            return
        shown += 1
        if isinstance(v, (dict, list, tuple)) and v and not all(_is_entry(x) for x in _vals(v)):
            _add_values(tree.add(f"[cyan]{escape(str(key))}[/]"), v, limit)
        elif not isinstance(v, (dict, list, tuple)):
            tree.add(f"[cyan]{escape(str(key))}[/] = {escape(_short(v))}")


def _vals(v: Any) -> list[Any]:
    return list(v.values()) if isinstance(v, dict) else list(v)


def _is_entry(v: Any) -> bool:
    return hasattr(v, "dtype") and hasattr(v, "chunks")


def _short(v: Any) -> str:
    text = repr(v)
    return text if len(text) <= 80 else text[:77] + "..."


def _jsonable(value: Any) -> Any:
    """Non-tensor state for --json: tuples become lists, tensors their description."""
    if isinstance(value, dict):
        return {str(k): _jsonable(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_jsonable(v) for v in value]
    if isinstance(value, bytes):
        return f"<{len(value)} bytes>"
    if isinstance(value, float) and not math.isfinite(value):
        return str(value)  # JSON has no nan/inf
    if _is_entry(value):
        return f"<tensor {value.dtype}{list(value.shape)}>"
    return value


# ---- verify -------------------------------------------------------------------------------


def _verify(args: argparse.Namespace) -> int:
    root = args.path
    storage = open_storage(root)
    if not storage.exists():  # a mistyped path is an error (2), not a corrupt checkpoint (1)
        raise CheckpointError(f"{root}: no such checkpoint or directory; check the path")
    single = _looks_like_checkpoint(root)
    paths = [root] if single else _checkpoint_dirs(root)
    skipped = {} if single else {p: why for p in paths if (why := _not_committed(p))}
    paths = [p for p in paths if p not in skipped]
    if not paths:
        raise CheckpointError(f"{root}: no committed checkpoints here")
    reports = []
    for path in paths:
        total = 0
        try:
            total = sum(open_committed(path).index.files.values())
        except CheckpointError:
            pass  # verify() reports the problem below
        with _progress(total, f"verifying {escape(_name(path))}") as advance:
            reports.append(verify(path, progress=advance))
    ok = all(r.ok for r in reports)
    if args.json:
        docs = [
            {
                "path": str(r.path),
                "ok": r.ok,
                "errors": r.errors,
                "files": [
                    {
                        "name": f.name,
                        "size": f.size,
                        "chunks": f.chunks,
                        "ok": f.ok,
                        "errors": f.errors,
                    }
                    for f in r.files
                ],
            }
            for r in reports
        ]
        _print_json(docs[0] if single else docs)
        return 0 if ok else 1
    console = _console()
    for r in reports:
        for err in r.errors:
            console.print(f"[bold red]ERROR[/] {escape(err)}", highlight=False)
        for f in r.files:
            status = "[green]ok[/]     " if f.ok else "[bold red]CORRUPT[/]"
            console.print(
                f"{status} {escape(f.name)}  {human_bytes(f.size)}  {f.chunks} chunks",
                highlight=False,
            )
            for err in f.errors:
                console.print(f"         {escape(err)}", highlight=False)
        verdict = "[green]valid[/]" if r.ok else "[bold red]CORRUPT or incomplete[/]"
        console.print(f"{escape(str(r.path))}: checkpoint is {verdict}", highlight=False)
    for path, why in skipped.items():
        console.print(f"[yellow]skipped[/] {escape(str(path))} ({why})", highlight=False)
    return 0 if ok else 1


def _not_committed(path: str) -> str | None:
    """Why a directory's checkpoint is not one to verify: pruned (files kept for
    others only) or uncommitted (a save may be running); None if it is committed."""
    commit = Commit(open_storage(path))
    if commit.is_committed():
        return None
    return "pruned" if commit.is_pruned() else "uncommitted: a save may be running"


# ---- diff ---------------------------------------------------------------------------------


def _diff(args: argparse.Namespace) -> int:
    from .diff import diff_checkpoints

    with CheckpointReader(args.a) as a, CheckpointReader(args.b) as b:
        total = sum(a.entry(n).nbytes for n in set(a.keys()) & set(b.keys()))
        with _progress(total, "comparing") as advance:
            result = diff_checkpoints(a, b, progress=advance)
    if args.json:
        _print_json(result.to_json())
        return 1 if result.differs else 0
    console = _console()
    for name in result.added:
        console.print(f"[green]+ {escape(name)}[/]", highlight=False)
    for name in result.removed:
        console.print(f"[red]- {escape(name)}[/]", highlight=False)
    for change in result.changed:
        console.print(f"[yellow]~ {escape(change.name)}[/]  {change.detail}", highlight=False)
    for path in result.values_changed:
        console.print(f"[yellow]~ {escape(path)}[/] (value)", highlight=False)
    console.print(
        f"{len(result.added)} added, {len(result.removed)} removed, {len(result.changed)} tensors "
        f"and {len(result.values_changed)} values changed, {result.unchanged} tensors identical"
    )
    return 1 if result.differs else 0


# ---- export / import / convert ------------------------------------------------------------


def _export_hf(args: argparse.Namespace) -> int:
    from .hf import export_hf

    rules = []
    for rule in args.rename:
        pattern, sep, replacement = rule.partition("=")
        if not sep:
            raise CheckpointError(f"--rename {rule!r}: expected REGEX=REPLACEMENT")
        rules.append((pattern, replacement))
    with CheckpointReader(args.checkpoint) as reader:
        total = sum(
            reader.entry(n).nbytes for n in reader.keys() if n.startswith(args.prefix or "")
        )
    with _progress(total, "exporting") as advance:
        result = export_hf(
            args.checkpoint,
            args.out,
            max_shard_size=args.max_shard_size,
            prefix=args.prefix,
            dtype=args.dtype,
            rename=rules,
            progress=advance,
        )
    doc = {
        "path": str(result.path),
        "files": result.files,
        "tensors": result.tensors,
        "total_size": result.total_size,
    }
    if args.json:
        _print_json(doc)
    else:
        _console().print(
            f"exported {result.tensors} tensors ({human_bytes(result.total_size)}) to "
            f"{result.path} in {len(result.files)} file(s)",
            highlight=False,
        )
    return 0


def _import_hf(args: argparse.Namespace) -> int:
    from .hf import import_hf

    info = import_hf(args.source, args.out, allow_pickle_weights=args.allow_pickle_weights)
    return _report_saved(args, info.path, info.tensors, info.bytes_written, [])


def _convert(args: argparse.Namespace) -> int:
    from .convert import convert

    result = convert(args.source, args.out, allow_pickle=args.allow_pickle)
    return _report_saved(args, result.path, result.tensors, None, result.skipped)


def _copy(args: argparse.Namespace) -> int:
    from .checkpoint_copy import copy_checkpoint

    info = copy_checkpoint(args.source, args.out)
    doc = {
        "path": str(info.path),
        "files": info.files,
        "bytes": info.bytes_copied,
        "made_own": info.made_own,
    }
    if args.json:
        _print_json(doc)
        return 0
    own = f", {info.made_own} of them from earlier checkpoints" if info.made_own else ""
    _console().print(
        f"copied {info.files} files ({human_bytes(info.bytes_copied)}{own}) to {info.path}",
        highlight=False,
    )
    return 0


def _report_saved(
    args: argparse.Namespace, path: Path, tensors: int, nbytes: int | None, skipped: list[str]
) -> int:
    doc = {"path": str(path), "tensors": tensors, "bytes": nbytes, "skipped": skipped}
    if args.json:
        _print_json(doc)
        return 0
    console = _console()
    size = f" ({human_bytes(nbytes)})" if nbytes is not None else ""
    console.print(f"wrote {tensors} tensors{size} to {escape(str(path))}", highlight=False)
    if skipped:
        console.print(f"[yellow]not converted (not tensors):[/] {escape(', '.join(skipped[:10]))}")
    return 0


# ---- prune --------------------------------------------------------------------------------


def _prune(args: argparse.Namespace) -> int:
    if args.keep_last < 1:
        raise CheckpointError("--keep-last must be at least 1: prune never deletes them all")
    rows = [_describe(p) for p in _checkpoint_dirs(args.path)]
    # Only real step-N directories that load are counted and deleted: a link (it may
    # lead out of the directory, or to a kept checkpoint), a name that is not a step
    # (a copy the user named) and an invalid checkpoint are left alone, so the newest
    # loadable checkpoints are always the ones kept.
    why_not = {r["path"]: _left_alone_because(r) for r in rows}
    candidates = [r for r in rows if why_not[r["path"]] is None]  # oldest step first
    # The manager's retention rule, keep_last alone: the newest loadable ones are kept.
    policy = RetentionPolicy(keep_last=args.keep_last, keep_last_good=None)
    kept_steps = policy.keep([KeptCheckpoint(r["step"]) for r in candidates])
    keep = {r["path"] for r in candidates if r["step"] in kept_steps}
    delete = [r for r in candidates if r["path"] not in keep]
    gone = {r["path"] for r in delete}
    # Files the remaining committed checkpoints refer to (incremental saves) stay, in a
    # pruned directory; if one of them cannot be read, every shard file of the deleted
    # ones does.
    remaining = [
        _name(r["path"])
        for r in rows
        if r["path"] not in gone
        and r["status"] not in ("uncommitted", "pruned")
        and not os.path.islink(r["path"])
    ]
    referenced = referenced_files(args.path, remaining, None)
    pruned = [r for r in rows if why_not[r["path"]] == "pruned"] if referenced is not None else []

    def kept(path: str) -> set[str]:
        if referenced is not None:
            return referenced.get(_name(path), set())
        return {n for n in open_storage(path).list() if n.endswith(".safetensors")}

    keeps = {r["path"]: kept(r["path"]) for r in delete + pruned}
    for r in delete + pruned if not args.dry_run else []:
        Commit(open_storage(r["path"])).delete(keeps[r["path"]])
    left_alone = {path: why for path, why in why_not.items() if why not in (None, "pruned")}
    doc = {
        "dry_run": args.dry_run,
        "deleted": [r["path"] for r in delete],
        "kept": sorted(keep),
        "kept_for_references": sorted(path for path, files in keeps.items() if files),
        "left_alone": left_alone,
    }
    if args.json:
        _print_json(doc)
        return 0
    console = _console()
    verb = "would delete" if args.dry_run else "deleted"
    for r in delete:
        console.print(f"[red]{verb}[/] {escape(str(r['path']))}", highlight=False)
    for path in doc["kept_for_references"]:
        console.print(f"[dim]kept the files newer checkpoints refer to in[/] {escape(str(path))}")
    for path, why in left_alone.items():
        console.print(f"[yellow]left alone[/] {escape(str(path))} ({why})", highlight=False)
    console.print(f"{verb} {len(delete)}, kept {len(keep)}")
    return 0


def _rollback(args: argparse.Namespace) -> int:
    """Through a ``CheckpointManager`` of the directory (and its remote), as in the job:
    one implementation of what a rollback sets aside and records."""
    from .training.manager import CheckpointManager
    from .training.options import RemoteTier

    if not os.path.isdir(args.path) and "://" not in args.path:
        raise CheckpointError(f"{args.path}: no such directory (a CheckpointManager's)")
    remote = RemoteTier(args.remote, RetentionPolicy(None)) if args.remote else None
    manager = CheckpointManager(args.path, remote=remote, preemption_signals=())
    try:
        if args.to not in set(manager.steps()) | set(manager.remote_steps()):
            raise CheckpointError(
                f"{args.path}: no committed checkpoint of step {args.to} (committed: "
                f"{manager.steps() or 'none'}); `shardpoint ls {args.path}` lists them"
            )
        with warnings.catch_warnings(record=True) as moved:
            warnings.simplefilter("always")
            before = len(manager.rollbacks)
            done = manager.rollback(args.to, skip_batches=args.skip_batches, reason=args.reason)
    finally:
        manager.close()
    doc = {
        "to_step": done.to_step,
        "skip_batches": done.skip_batches,
        "reason": done.reason,
        "already_recorded": len(manager.rollbacks) == before,
        "set_aside": [str(w.message) for w in moved],
    }
    if args.json:
        _print_json(doc)
        return 0
    console = _console()
    for line in doc["set_aside"]:
        console.print(f"[yellow]set aside[/] {escape(line)}", highlight=False)
    said = "already recorded" if doc["already_recorded"] else "recorded"
    console.print(
        f"rollback to step {done.to_step} (skip {done.skip_batches} batches) {said}: the "
        "next start restores it; run this while the job is stopped",
        highlight=False,
    )
    return 0


def _left_alone_because(row: dict[str, Any]) -> str | None:
    """Why prune neither counts nor deletes this checkpoint; None if it may."""
    if os.path.islink(row["path"]):
        return "a symbolic link: prune deletes only real directories"
    if row["status"] == "uncommitted":
        return "uncommitted: a save may be running"
    if row["status"] == "pruned":
        return "pruned"  # its files kept for others are looked at again below
    if _step_of(row["path"]) is None:  # the name's, not the metadata's (a copy keeps it)
        return "not a step-N directory: prune counts and deletes only those"
    if row["status"] != "valid":
        return f"{row['status']}: look at it with `shardpoint verify`, delete it by hand"
    return None


# ---- report -------------------------------------------------------------------------------


def _report(args: argparse.Namespace) -> int:
    from .report import save_report

    summary = save_report(Path(args.path), Path(args.out) if args.out else None)
    if args.json:
        _print_json(summary)
        return 0
    console = _console()
    table = Table(title=f"{escape(str(args.path))}: {summary['saves']} saves", title_justify="left")
    for column in ("", "median", "max", "total"):
        table.add_column(column, justify="left" if not column else "right")
    for key, unit in (("seconds", "s"), ("blocked_seconds", "s"), ("bytes", "B")):
        s = summary[key]
        fmt: Callable[[float], str] = human_bytes if unit == "B" else (lambda v: f"{v:.3f} s")
        table.add_row(key.replace("_", " "), fmt(s["median"]), fmt(s["max"]), fmt(s["total"]))
    console.print(table)
    console.print(
        f"restores {summary['restores']}, fallbacks {summary['fallbacks']}, failed saves "
        f"{summary['failed_saves']}, deletions {summary['deletions']}; plot: {summary['plot']}",
        highlight=False,
    )
    return 0


# ---- status -------------------------------------------------------------------------------

_UNITS = {"": 1.0, "s": 1.0, "m": 60.0, "h": 3600.0, "d": 86400.0}


def parse_duration(text: str) -> float:
    """Seconds in ``90``, ``90s``, ``30m``, ``2h``, ``1.5d``."""
    number, unit = text.strip(), ""
    if number and number[-1].lower() in _UNITS:
        number, unit = number[:-1], number[-1].lower()
    try:
        seconds = float(number) * _UNITS[unit]
    except ValueError:
        seconds = math.nan
    if not math.isfinite(seconds) or seconds < 0:
        raise ValueError(f"--max-age {text!r}: give seconds, or a number with s, m, h or d (30m)")
    return seconds


def _human_seconds(seconds: float) -> str:
    """3.2 s, 12m 5s, 2h 3m, 4d 1h."""
    if seconds < 60:
        return f"{seconds:.1f} s"
    for unit, size, sub, sub_size in (("d", 86400, "h", 3600), ("h", 3600, "m", 60)):
        if seconds >= size:
            return f"{int(seconds // size)}{unit} {int(seconds % size // sub_size)}{sub}"
    return f"{int(seconds // 60)}m {int(seconds % 60)}s"


def run_status(path: str, max_age: float | None = None, tier: str = "disk") -> dict[str, Any]:
    """What a CheckpointManager's directory says about the run, read from the directory
    alone: its committed steps (and their markers' times), its event log, set-aside
    directories. ``healthy`` is False (``problems`` says why) when ``tier`` (``disk``:
    local or remote; or ``local``, ``remote``, ``memory``) holds no checkpoint, or its
    newest is older than ``max_age`` seconds."""
    from .metrics import FAILURES, CheckpointMetrics
    from .report import restore_tier
    from .training.events import EventLog

    storage = open_storage(path)
    if not storage.exists():
        raise CheckpointError(f"{path}: no such directory (a CheckpointManager's)")
    if _looks_like_checkpoint(path):
        raise CheckpointError(
            f"{path}: a checkpoint, not a CheckpointManager directory; give the one above it"
        )
    events = EventLog(storage).read()
    now = time.time()
    history = CheckpointMetrics(clock=lambda: now)  # one reading of the events: metrics'
    for event in events:
        history.observe(event)
    committed: dict[int, float | None] = {}
    pruned, uncommitted, set_aside = [], [], []
    for name in storage.subdirectories():
        step = parse_step_dir(name)
        if step is not None:
            commit = Commit(open_storage(join(path, name)))
            if commit.is_committed():
                committed[step] = commit.committed_at()
            else:
                (pruned if commit.is_pruned() else uncommitted).append(step)
            continue
        head, _, rest = name.partition(".")  # step-N.WHY-K: set aside (names.set_aside_dir)
        if (step := parse_step_dir(head)) is not None and rest:
            why, _, n = rest.rpartition("-")
            set_aside.append(
                {
                    "step": step,
                    "why": why if why and n.isdigit() else rest,
                    "path": str(join(path, name)),
                }
            )

    def entry(step: int, when: float | None, **more: Any) -> dict[str, Any]:
        age = None if when is None else max(0.0, now - when)
        return {"step": step, "time": when, "age_seconds": age, **more}

    def when_of(event: dict[str, Any]) -> float | None:
        t = event.get("time")
        return float(t) if isinstance(t, (int, float)) and math.isfinite(t) else None

    saved_at = {e.get("step"): when_of(e) for e in events if e.get("event") == "save"}
    tiers: dict[str, Any] = dict.fromkeys(("local", "remote", "memory"))
    if committed:
        newest = max(committed)
        when = committed[newest] if committed[newest] is not None else saved_at.get(newest)
        tiers["local"] = entry(newest, when, committed=len(committed), source="directory")
    for name, (step, when) in history.newest().items():
        if name != "local":  # the local tier is the directory's listing, not the log's
            tiers[name] = entry(step, when, source="event log")
    uploads = any(e.get("event") in ("upload", "upload_failed") for e in events)
    remote_step = tiers["remote"]["step"] if tiers["remote"] else -1
    pending = [s for s in sorted(committed) if s > remote_step] if uploads else []
    considered = ("local", "remote") if tier == "disk" else (tier,)
    found = [tiers[t] for t in considered if tiers[t] and tiers[t]["time"] is not None]
    freshest = max(found, key=lambda t: t["time"], default=None)
    last = max((i for i, e in enumerate(events) if e.get("event") == "save"), default=-1)
    since: dict[str, Any] = {}
    for e in events[last + 1 :]:
        if e.get("event") in FAILURES:
            kind = since.setdefault(e["event"], {"count": 0, "last_error": None})
            kind["count"] += 1
            kind["last_error"] = e.get("error") or e.get("reason") or kind["last_error"]
    problems = []
    where = "on disk (local or remote)" if tier == "disk" else f"in the {tier} tier"
    if freshest is None:
        problems.append(f"no checkpoint {where}")
    elif max_age is not None and freshest["age_seconds"] > max_age:
        problems.append(
            f"the newest checkpoint {where} (step {freshest['step']}) is "
            f"{_human_seconds(freshest['age_seconds'])} old, over --max-age "
            f"{_human_seconds(max_age)}"
        )
    last_save = events[last] if last >= 0 else None
    restores = [e for e in events if e.get("event") == "restore"]
    last_restore = None
    if restores:  # where the newest restore's state came from, rank by rank where it varied
        e = restores[-1]
        last_restore = {
            "step": e.get("step"),
            "tier": restore_tier(e),
            "age_seconds": max(0.0, now - (when_of(e) or now)),
            "ranks_rebuilt": e.get("ranks_rebuilt", []),
            "ranks_from_buddies": e.get("ranks_from_buddies", []),
        }
    return {
        "path": str(path),
        "time": now,
        "healthy": not problems,
        "problems": problems,
        "tier": tier,
        "max_age_seconds": max_age,
        "newest": freshest,
        "tiers": tiers,
        "last_save": None
        if last_save is None
        else {**last_save, "age_seconds": max(0.0, now - (when_of(last_save) or now))},
        "last_restore": last_restore,
        "failures_since_last_save": since,
        "failures": {k: n for k, n in history.failures.items() if n},
        "retention": {
            "committed": sorted(committed),
            "pruned": sorted(pruned),
            "uncommitted": sorted(uncommitted),
            "deleted": history.deletions["local"],
        },
        "pending_uploads": pending,
        "set_aside": sorted(set_aside, key=lambda a: (a["step"], a["path"])),
        "rollbacks": [e for e in events if e.get("event") == "rollback"],
    }


def _status(args: argparse.Namespace) -> int:
    max_age = parse_duration(args.max_age) if args.max_age is not None else None
    doc = run_status(args.path, max_age, args.tier)
    code = 0 if doc["healthy"] else 1
    if args.json:
        _print_json(doc)
        return code
    console = _console()
    verdict = "[green]healthy[/]" if doc["healthy"] else "[bold red]unhealthy[/]"
    table = Table(title=f"{escape(str(args.path))}: {verdict}", title_justify="left")
    for column in ("tier", "newest step", "age", "from"):
        table.add_column(column, justify="right" if column in ("newest step", "age") else "left")
    for name, t in doc["tiers"].items():
        if t is None:
            table.add_row(name, "", "", "[dim]none[/]")
            continue
        age = "" if t["age_seconds"] is None else _human_seconds(t["age_seconds"])
        what = f"{t['committed']} committed" if "committed" in t else t["source"]
        table.add_row(name, str(t["step"]), age, what)
    console.print(table)
    save = doc["last_save"]
    if save is not None:
        console.print(
            f"last save: step {save.get('step')}, {_human_seconds(save['age_seconds'])} ago, "
            f"{float(save.get('seconds') or 0):.3f} s to commit, "
            f"{float(save.get('blocked_seconds') or 0):.3f} s stall, "
            f"{human_bytes(float(save.get('bytes') or 0))}, {save.get('gb_per_s', 0)} GB/s",
            highlight=False,
        )
    restore = doc["last_restore"]
    if restore is not None:
        how = "".join(
            f", {label} {restore[key]}"
            for key, label in (
                ("ranks_rebuilt", "ranks rebuilt from parity"),
                ("ranks_from_buddies", "ranks from other nodes' copies"),
            )
            if restore[key]
        )
        console.print(
            f"last restore: step {restore['step']} from {restore['tier']}{how}, "
            f"{_human_seconds(restore['age_seconds'])} ago",
            highlight=False,
        )
    for kind, f in doc["failures_since_last_save"].items():
        error = f": {escape(str(f['last_error']))}" if f["last_error"] else ""
        console.print(
            f"[yellow]{kind}[/] x{f['count']} since the last save{error}", highlight=False
        )
    r = doc["retention"]
    console.print(
        f"retention: {len(r['committed'])} committed {r['committed']}, deleted {r['deleted']}"
        + (f", pruned {r['pruned']}" if r["pruned"] else "")
        + (f", uncommitted {r['uncommitted']}" if r["uncommitted"] else ""),
        highlight=False,
    )
    if doc["pending_uploads"]:
        console.print(f"not uploaded yet: {doc['pending_uploads']}", highlight=False)
    for a in doc["set_aside"]:
        console.print(f"[yellow]set aside[/] step {a['step']} ({a['why']}): {escape(a['path'])}")
    for e in doc["rollbacks"]:
        console.print(
            f"rollback to step {e.get('to_step', '?')} (skip {e.get('skip_batches', 0)} batches)"
            + (f": {escape(str(e['reason']))}" if e.get("reason") else ""),
            highlight=False,
        )
    for problem in doc["problems"]:
        console.print(f"[bold red]{escape(problem)}[/]", highlight=False)
    return code


# ---- the parser ---------------------------------------------------------------------------


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="shardpoint",
        description="Look at, check, compare, convert and prune shardpoint checkpoints.",
        epilog="exit status: 0 success, 1 check failed (corrupt, differences), 2 error",
    )
    parser.add_argument("--version", action="version", version=f"shardpoint {__version__}")
    sub = parser.add_subparsers(dest="command", required=True)

    def command(name: str, func: Callable[[argparse.Namespace], int], text: str) -> Any:
        p = sub.add_parser(
            name,
            help=text,
            description=text,
            epilog="examples:\n  " + EXAMPLES[name],
            formatter_class=argparse.RawDescriptionHelpFormatter,
        )
        p.add_argument("--json", action="store_true", help="machine-readable output")
        p.set_defaults(func=func)
        return p

    p = command("ls", _ls, "table of the checkpoints in a directory: step, size, status")
    p.add_argument("path", help="a directory of checkpoints (e.g. a CheckpointManager's)")
    p = command("inspect", _inspect, "entries with dtype, shape, sharding; non-tensor state")
    p.add_argument("path", help="checkpoint directory")
    p = command("verify", _verify, "recompute every checksum; exit 1 if anything is corrupt")
    p.add_argument("path", help="a checkpoint, or a directory of checkpoints")
    p = command("diff", _diff, "entries added, removed, changed (with max abs difference)")
    p.add_argument("a", help="first checkpoint")
    p.add_argument("b", help="second checkpoint")
    p = command("export-hf", _export_hf, "write the Hugging Face sharded safetensors layout")
    p.add_argument("checkpoint", help="shardpoint checkpoint")
    p.add_argument("out", help="output directory")
    p.add_argument("--prefix", help="select entries starting with this and strip it (model.)")
    p.add_argument("--max-shard-size", default="5GB", help="per file (default 5GB = 5*10^9)")
    p.add_argument("--dtype", choices=["bf16", "fp16", "fp32"], help="cast floating tensors")
    p.add_argument("--rename", action="append", default=[], help="REGEX=REPLACEMENT, repeatable")
    p = command("import-hf", _import_hf, "make a checkpoint from a Hugging Face layout")
    p.add_argument("source", help="directory with model.safetensors[.index.json], or a file")
    p.add_argument("out", help="new checkpoint directory")
    p.add_argument(
        "--allow-pickle-weights",
        action="store_true",
        help="read .bin (pickle) weights with torch's restricted unpickler",
    )
    p = command("copy", _copy, "copy a checkpoint, self-contained (referenced files made its own)")
    p.add_argument("source", help="committed checkpoint")
    p.add_argument("out", help="new checkpoint directory or URL")
    p = command("convert", _convert, "DCP or torch.save -> shardpoint, shardpoint -> torch.save")
    p.add_argument("source", help="DCP directory, torch.save file or shardpoint checkpoint")
    p.add_argument("out", help="new checkpoint directory, or .pt file from shardpoint")
    p.add_argument(
        "--allow-pickle",
        action="store_true",
        help="needed to read a DCP directory or torch.save file: both are pickles, and "
        "unpickling can run code; pass it only for files you trust",
    )
    p = command("prune", _prune, "delete all but the newest committed checkpoints")
    p.add_argument("path", help="a directory of checkpoints")
    p.add_argument("--keep-last", type=int, required=True, help="how many to keep")
    p.add_argument("--dry-run", action="store_true", help="only say what would be deleted")
    p = command("report", _report, "summary and plot of a CheckpointManager's event log")
    p.add_argument("path", help="a CheckpointManager directory (with events.jsonl)")
    p.add_argument("--out", help="PNG path (default: DIR/report.png)")
    p = command("rollback", _rollback, "go back to an earlier step; newer ones set aside, kept")
    p.add_argument("path", help="a CheckpointManager directory (or URL); the job stopped")
    p.add_argument("--to", type=int, required=True, help="the committed step to go back to")
    p.add_argument("--skip-batches", type=int, default=0, help="batches to skip after it")
    p.add_argument("--reason", default="", help="recorded with it (a loss spike at ...)")
    p.add_argument("--remote", help="the run's remote tier URL: set aside and recorded there too")
    p = command(
        "status", _status, "a run's newest checkpoint per tier and its age; exit 1 if stale"
    )
    p.add_argument("path", help="a CheckpointManager directory (or URL)")
    p.add_argument("--max-age", help="exit 1 if the newest checkpoint is older: 90s, 30m, 2h, 600")
    p.add_argument(
        "--tier",
        choices=("disk", "local", "remote", "memory"),
        default="disk",
        help="whose newest checkpoint --max-age checks (default disk: local or remote)",
    )
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        return int(args.func(args))
    except BrokenPipeError:  # output piped into `head` and the like
        sys.stderr.close()
        return 0
    except (CheckpointError, ValueError, OSError) as exc:
        print(f"shardpoint: error: {exc}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
