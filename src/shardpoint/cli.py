"""The ``shardpoint`` command: a thin layer over the library for looking at checkpoints."""

from __future__ import annotations

import argparse
import json
import math
import sys
import threading
import time
from collections.abc import Sequence
from typing import Any, TextIO

from . import __version__
from .errors import CheckpointError
from .reader import CheckpointReader
from .verify import verify

EXAMPLES = {
    "inspect": "examples:\n"
    "  shardpoint inspect runs/step-1000\n"
    "  shardpoint inspect runs/step-1000 --json | jq '.tensors[0]'",
    "verify": "examples:\n"
    "  shardpoint verify runs/step-1000\n"
    "  shardpoint verify runs/step-1000 --json\n\n"
    "exit status: 0 clean, 1 corrupt or incomplete",
}


def human_bytes(n: float) -> str:
    for unit in ("B", "KB", "MB", "GB", "TB"):
        if abs(n) < 1000 or unit == "TB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1000
    raise AssertionError("unreachable")


class ProgressBar:
    """A one-line progress bar on a terminal; silent when the stream is not a TTY."""

    def __init__(self, total: int, stream: TextIO = sys.stderr, label: str = "") -> None:
        self.total, self.done, self.stream, self.label = max(total, 1), 0, stream, label
        self.enabled = stream.isatty()
        self._lock = threading.Lock()
        self._last = 0.0

    def advance(self, n: int) -> None:
        with self._lock:
            self.done += n
            now = time.monotonic()
            if self.enabled and (now - self._last > 0.1 or self.done >= self.total):
                self._last = now
                frac = min(self.done / self.total, 1.0)
                bar = "#" * int(frac * 30)
                self.stream.write(
                    f"\r{self.label} [{bar:<30}] {frac:6.1%} "
                    f"{human_bytes(self.done)}/{human_bytes(self.total)}"
                )
                self.stream.flush()

    def close(self) -> None:
        if self.enabled:
            self.stream.write("\n")


def _inspect(args: argparse.Namespace) -> int:
    with CheckpointReader(args.path) as reader:
        rows = []
        for name in reader.keys():
            entry = reader.entry(name)
            rows.append(
                {
                    "name": name,
                    "dtype": entry.dtype,
                    "shape": list(entry.shape),
                    "bytes": entry.nbytes,
                    "files": sorted({c.file for c in entry.chunks}),
                    "chunks": len(entry.chunks),
                    "alias_of": reader.alias_of(name),
                }
            )
        values = reader.state(tensors=False)
        meta = reader.metadata
    if args.json:
        print(
            json.dumps(
                {"path": str(args.path), **meta, "tensors": rows, "state": _jsonable(values)},
                indent=1,
            )
        )
        return 0
    print(
        f"{args.path}  (format v{meta['format_version']}, shardpoint {meta['library_version']}, "
        f"created {meta['created']}, world size {meta['world_size']})"
    )
    widths = [max([len(r["name"]) for r in rows] + [4]), 8, 20, 10]
    header = ["name", "dtype", "shape", "size", "file"]
    print("  ".join(h.ljust(w) for h, w in zip(header, widths)) + "  file")
    for r in rows:
        where = f"= {r['alias_of']}" if r["alias_of"] else ", ".join(r["files"])
        cells = [r["name"], r["dtype"], str(r["shape"]), human_bytes(r["bytes"])]
        print("  ".join(c.ljust(w) for c, w in zip(cells, widths)) + "  " + where)
    total = sum(meta["files"].values())
    print(f"{len(rows)} tensors, {len(meta['files'])} files, {human_bytes(total)}")
    return 0


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
    if hasattr(value, "dtype") and hasattr(value, "chunks"):
        return f"<tensor {value.dtype}{list(value.shape)}>"
    return value


def _verify(args: argparse.Namespace) -> int:
    total = 0
    try:
        with CheckpointReader(args.path) as reader:
            total = sum(reader.metadata["files"].values())
    except CheckpointError:
        pass  # verify() reports the problem below
    bar = ProgressBar(total, label="verifying")
    report = verify(args.path, progress=bar.advance)
    bar.close()
    if args.json:
        print(
            json.dumps(
                {
                    "path": str(args.path),
                    "ok": report.ok,
                    "errors": report.errors,
                    "files": [
                        {
                            "name": f.name,
                            "size": f.size,
                            "chunks": f.chunks,
                            "ok": f.ok,
                            "errors": f.errors,
                        }
                        for f in report.files
                    ],
                },
                indent=1,
            )
        )
    else:
        for err in report.errors:
            print(f"ERROR {err}")
        for f in report.files:
            status = "ok" if f.ok else "CORRUPT"
            print(f"{status:8} {f.name}  {human_bytes(f.size)}  {f.chunks} chunks")
            for err in f.errors:
                print(f"         {err}")
        print("checkpoint is valid" if report.ok else "checkpoint is CORRUPT or incomplete")
    return 0 if report.ok else 1


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="shardpoint", description="Inspect and verify shardpoint checkpoints."
    )
    parser.add_argument("--version", action="version", version=f"shardpoint {__version__}")
    sub = parser.add_subparsers(dest="command", required=True)
    for name, func, text in (
        ("inspect", _inspect, "list the entries of a checkpoint: name, dtype, shape, size, file"),
        ("verify", _verify, "recompute every checksum; exit 1 if anything is corrupt"),
    ):
        p = sub.add_parser(
            name,
            help=text,
            description=text,
            epilog=EXAMPLES[name],
            formatter_class=argparse.RawDescriptionHelpFormatter,
        )
        p.add_argument("path", help="checkpoint directory")
        p.add_argument("--json", action="store_true", help="machine-readable output")
        p.set_defaults(func=func)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        return int(args.func(args))
    except CheckpointError as exc:
        print(f"shardpoint: error: {exc}", file=sys.stderr)
        return 1
    except BrokenPipeError:  # output piped into `head` and the like
        sys.stderr.close()
        return 0


if __name__ == "__main__":
    sys.exit(main())
