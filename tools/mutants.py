"""Generated mutants over the guarantee-carrying code, each run in place.

    python tools/mutants.py --list                      # the mutants, nothing run
    python tools/mutants.py                             # every target (see TARGETS)
    python tools/mutants.py --target rng,data           # some targets
    python tools/mutants.py --only rng:3,rng:7          # given mutants
    python tools/mutants.py --only data:12 --tests tests/test_mutant_kills.py
    python tools/mutants.py --sample 4                  # at most 4 mutants per function

Why not mutmut: its trampolines and per-test coverage do not follow the spawned ranks,
torchrun workers and forked children this suite runs the library in (docs/reliability.md).
Here each mutant is an edit of the source file on disk, so every process the tests
start runs it; the file is restored byte for byte (and its mtime) after each mutant,
also on Ctrl-C and SIGTERM, and a copy of the original is kept outside the tree until
then (a later run puts it back if this one was killed with SIGKILL).

Operators (from the AST, one change per mutant): comparison flips (``==``/``!=``,
``<``/``>=``, ``<``/``<=``..., ``is``/``is not``, ``in``/``not in``), ``and``/``or``,
``not x`` -> ``x``, ``+``/``-``, ``*``/``//``, ``|``/``&`` (also augmented), constants
(``True``/``False``, ``0``/``1``, ``n`` -> ``n + 1`` and ``0``), ``return x`` ->
``return None``, an expression statement that calls something -> ``pass``, and
``break``/``continue``, ``if x`` -> ``if not x`` (where ``x`` is no comparison or
``not``, which the flips above cover). Docstrings, other strings and annotations are not
mutated.

For each mutant the target's tests run with ``pytest -x`` (fastest files first) under a
timeout of twice the unmutated run plus 60 s (or ``--timeout``); the whole process
group is killed at the timeout. A failing test or a timeout is "killed" (timeouts are
listed apart); tests that pass are "SURVIVED". Each target's tests are first run on the
unmutated code and must pass. Results go to ``--out`` (JSON lines) and a table at the
end. Exit status 1 if any mutant survived. Not part of the test run: it edits src/ (run
it in a copy if someone else is editing the tree).
"""

from __future__ import annotations

import argparse
import ast
import hashlib
import json
import os
import random
import signal
import subprocess
import sys
import tempfile
import time
from dataclasses import asdict, dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PYTEST = ["-m", "pytest", "-x", "-q", "-p", "no:cacheprovider"]
# One cycle's enumerated kill points are always run; no sampled extras.
FAST_CRASH_ENV = {"SHARDPOINT_KILL_POINTS": "1", "SHARDPOINT_TWO_RANK_KILL_POINTS": "1"}


@dataclass(frozen=True)
class Target:
    """``scope``: qualified function names (``Class.method``) or module-level assignment
    names; ``name@text`` limits a function to its statements from the first one whose
    source contains ``text``. Empty: the whole module."""

    file: str
    tests: tuple[str, ...]
    scope: tuple[str, ...] = ()
    env: tuple[tuple[str, str], ...] = ()


DIST = "tests/test_distributed.py::"
TARGETS: dict[str, Target] = {
    "commit": Target(
        "src/shardpoint/commit.py",
        (
            "tests/test_integrity.py",
            "tests/test_mutant_kills.py",
            "tests/test_checkpoint_manager.py",
            "tests/test_hostile_files.py",
            "tests/test_crash_consistency.py",
            DIST + "test_a_rank_failing_mid_save_commits_nothing_and_the_previous_checkpoint_loads",
            DIST + "test_a_failure_on_one_rank_before_the_gather_fails_every_rank_without_hanging",
        ),
        env=tuple(FAST_CRASH_ENV.items()),
    ),
    "retention": Target(
        "src/shardpoint/training/retention.py",
        ("tests/test_retention_policy.py", "tests/test_checkpoint_manager.py"),
    ),
    "rng": Target(
        "src/shardpoint/training/rng.py",
        (
            "tests/test_rng.py",
            "tests/test_mutant_kills.py",
            "tests/test_resume_training.py",
            DIST + "test_fsdp2_training_continues_bit_identical_on_the_same_world_size",
        ),
    ),
    "data": Target(
        "src/shardpoint/training/data.py",
        (
            "tests/test_data_position.py",
            "tests/test_mutant_kills.py",
            "tests/test_resume_training.py",
        ),
    ),
    "verify": Target(
        "src/shardpoint/verify.py",
        (
            "tests/test_integrity.py",
            "tests/test_mutant_kills.py",
            "tests/test_corruption_matrix.py",
            "tests/test_cli.py",
            "tests/test_hostile_files.py",
        ),
    ),
    "memory_tier_identity": Target(
        "src/shardpoint/training/memory_tier.py",
        ("tests/test_memory_tier.py",),
        scope=("MemoryTier._identity", "load_identity", "MemoryTier.restore@error = None"),
    ),
    "object_store_retry": Target(
        "src/shardpoint/storage/object_store.py",
        ("tests/test_object_store.py",),
        scope=("DEFAULT_RETRY", "_store"),
    ),
}


@dataclass(frozen=True)
class Mutant:
    id: str  # target:number
    file: str
    function: str
    line: int
    what: str
    start: int  # byte offsets of the replaced text in the file
    end: int
    new: str


# ---- generation -------------------------------------------------------------------------

CMP_FLIPS: dict[type, tuple[type, ...]] = {
    ast.Eq: (ast.NotEq,),
    ast.NotEq: (ast.Eq,),
    ast.Lt: (ast.GtE, ast.LtE),
    ast.LtE: (ast.Gt, ast.Lt),
    ast.Gt: (ast.LtE, ast.GtE),
    ast.GtE: (ast.Lt, ast.Gt),
    ast.Is: (ast.IsNot,),
    ast.IsNot: (ast.Is,),
    ast.In: (ast.NotIn,),
    ast.NotIn: (ast.In,),
}
BIN_FLIPS: dict[type, type] = {
    ast.Add: ast.Sub,
    ast.Sub: ast.Add,
    ast.Mult: ast.FloorDiv,
    ast.FloorDiv: ast.Mult,
    ast.Div: ast.Mult,
    ast.BitOr: ast.BitAnd,
    ast.BitAnd: ast.BitOr,
}
SYMBOL = {
    ast.Eq: "==", ast.NotEq: "!=", ast.Lt: "<", ast.LtE: "<=", ast.Gt: ">", ast.GtE: ">=",
    ast.Is: "is", ast.IsNot: "is not", ast.In: "in", ast.NotIn: "not in", ast.Add: "+",
    ast.Sub: "-", ast.Mult: "*", ast.FloorDiv: "//", ast.Div: "/", ast.BitOr: "|",
    ast.BitAnd: "&", ast.And: "and", ast.Or: "or",
}  # fmt: skip


class _Offsets:
    def __init__(self, source: str) -> None:
        self.source = source
        self.line_starts = [0]
        for line in source.splitlines(keepends=True):
            self.line_starts.append(self.line_starts[-1] + len(line.encode()))
        self.raw = source.encode()

    def span(self, node: ast.AST) -> tuple[int, int]:
        return (
            self.line_starts[node.lineno - 1] + node.col_offset,  # type: ignore[attr-defined]
            self.line_starts[node.end_lineno - 1] + node.end_col_offset,  # type: ignore[attr-defined]
        )


def _skip_children(node: ast.AST) -> set[int]:
    """Nodes never mutated: annotations, docstrings, f-strings, decorators."""
    skip: set[int] = set()

    def drop(n: ast.AST | None) -> None:
        if n is not None:
            skip.update(id(x) for x in ast.walk(n))

    for n in ast.walk(node):
        if isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef)):
            drop(n.returns)
            for a in [*n.args.args, *n.args.kwonlyargs, *n.args.posonlyargs]:
                drop(a.annotation)
            drop(n.args.vararg and n.args.vararg.annotation)
            drop(n.args.kwarg and n.args.kwarg.annotation)
            for d in n.decorator_list:
                drop(d)
        if isinstance(n, ast.AnnAssign):
            drop(n.annotation)
        if isinstance(n, ast.JoinedStr):
            drop(n)
        body = getattr(n, "body", None)
        if (
            isinstance(body, list)
            and body
            and isinstance(body[0], ast.Expr)
            and isinstance(body[0].value, ast.Constant)
            and isinstance(body[0].value.value, str)
        ):
            drop(body[0])
    return skip


def _scoped_nodes(tree: ast.Module, scope: tuple[str, ...]) -> list[tuple[str, ast.AST, int]]:
    """(function name, root node, first line) for each scope entry; the whole module's
    top-level functions, methods and assignments when ``scope`` is empty."""
    found: dict[str, tuple[ast.AST, int]] = {}

    def visit(body: list[ast.stmt], prefix: str) -> None:
        for n in body:
            if isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef)):
                found[prefix + n.name] = (n, n.lineno)
            elif isinstance(n, ast.ClassDef):
                visit(n.body, f"{prefix}{n.name}.")
            elif isinstance(n, (ast.Assign, ast.AnnAssign)) and not prefix:
                targets = n.targets if isinstance(n, ast.Assign) else [n.target]
                for t in targets:
                    if isinstance(t, ast.Name):
                        found[t.id] = (n, n.lineno)

    visit(tree.body, "")
    if not scope:
        return [(name, node, line) for name, (node, line) in found.items()]
    out = []
    for entry in scope:
        name, _, text = entry.partition("@")
        if name not in found:
            raise SystemExit(f"scope {entry!r}: no function or assignment {name!r}")
        node, first = found[name]
        if text:
            assert isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef))
            starts = [s.lineno for s in ast.walk(node) if isinstance(s, ast.stmt) and s is not node]
            first = min((ln for ln in starts if text in _SOURCE_LINES[ln - 1]), default=None)
            if first is None:
                raise SystemExit(f"scope {entry!r}: no statement containing {text!r}")
        out.append((name, node, first))
    return out


_SOURCE_LINES: list[str] = []


def generate(name: str, target: Target) -> list[Mutant]:
    path = ROOT / target.file
    source = path.read_text()
    _SOURCE_LINES[:] = source.splitlines()
    tree = ast.parse(source)
    offsets = _Offsets(source)
    original_dump = ast.dump(tree)
    out: list[Mutant] = []
    seen: set[tuple[int, int, str]] = set()

    def add(function: str, node: ast.AST, what: str, new: str, *, paren: bool = True) -> None:
        start, end = offsets.span(node)
        text = f"({new})" if paren else new
        key = (start, end, text)
        if key in seen:
            return
        mutated = offsets.raw[:start] + text.encode() + offsets.raw[end:]
        try:
            dumped = ast.dump(ast.parse(mutated))
        except SyntaxError:
            return
        if dumped == original_dump:
            return  # not a change
        seen.add(key)
        out.append(Mutant("", target.file, function, node.lineno, what, start, end, text))  # type: ignore[attr-defined]

    for function, root, first_line in _scoped_nodes(tree, target.scope):
        skip = _skip_children(root)
        for node in ast.walk(root):
            if id(node) in skip or getattr(node, "lineno", first_line) < first_line:
                continue
            u = ast.unparse
            if isinstance(node, ast.Compare):
                for i, op in enumerate(node.ops):
                    for new_op in CMP_FLIPS.get(type(op), ()):
                        m = ast.Compare(node.left, list(node.ops), node.comparators)
                        m.ops[i] = new_op()
                        add(function, node, f"{SYMBOL[type(op)]} -> {SYMBOL[new_op]}", u(m))
            elif isinstance(node, ast.BoolOp):
                other = ast.Or() if isinstance(node.op, ast.And) else ast.And()
                add(
                    function,
                    node,
                    f"{SYMBOL[type(node.op)]} -> {SYMBOL[type(other)]}",
                    u(ast.BoolOp(other, node.values)),
                )
            elif isinstance(node, ast.UnaryOp) and isinstance(node.op, ast.Not):
                add(function, node, "not x -> x", u(node.operand))
            elif isinstance(node, ast.BinOp) and type(node.op) in BIN_FLIPS:
                new_op = BIN_FLIPS[type(node.op)]
                add(
                    function,
                    node,
                    f"{SYMBOL[type(node.op)]} -> {SYMBOL[new_op]}",
                    u(ast.BinOp(node.left, new_op(), node.right)),
                )
            elif isinstance(node, ast.AugAssign) and type(node.op) in BIN_FLIPS:
                new_op = BIN_FLIPS[type(node.op)]
                m = ast.AugAssign(node.target, new_op(), node.value)
                add(
                    function,
                    node,
                    f"{SYMBOL[type(node.op)]}= -> {SYMBOL[new_op]}=",
                    u(m),
                    paren=False,
                )
            elif isinstance(node, ast.Constant) and not isinstance(node.value, (str, bytes)):
                v = node.value
                if isinstance(v, bool):
                    add(function, node, f"{v} -> {not v}", repr(not v), paren=False)
                elif isinstance(v, int):
                    for new in sorted({0 if v else 1, v + 1} - {v}):
                        add(function, node, f"{v} -> {new}", repr(new))
            elif isinstance(node, ast.Return) and node.value is not None:
                if not (isinstance(node.value, ast.Constant) and node.value.value is None):
                    add(function, node, "return x -> return None", "return None", paren=False)
            elif isinstance(node, ast.Expr) and isinstance(node.value, (ast.Call, ast.Await)):
                add(function, node, f"{u(node.value)[:40]} -> pass", "pass", paren=False)
            elif isinstance(node, (ast.If, ast.While)) and not isinstance(
                node.test, (ast.Compare, ast.UnaryOp)
            ):
                add(function, node.test, "if x -> if not x", f"not ({u(node.test)})")
            elif isinstance(node, ast.Break):
                add(function, node, "break -> continue", "continue", paren=False)
            elif isinstance(node, ast.Continue):
                add(function, node, "continue -> break", "break", paren=False)
    out.sort(key=lambda m: (m.start, m.end, m.what))
    return [
        Mutant(f"{name}:{i}", m.file, m.function, m.line, m.what, m.start, m.end, m.new)
        for i, m in enumerate(out, 1)
    ]


# ---- running ----------------------------------------------------------------------------

BACKUP_DIR = Path(tempfile.gettempdir()) / "shardpoint-mutants"


def _backup_path(path: Path) -> Path:
    return BACKUP_DIR / (hashlib.sha256(str(path).encode()).hexdigest()[:16] + ".json")


def restore_leftovers() -> None:
    """Put back a file a SIGKILLed run left mutated."""
    for record in BACKUP_DIR.glob("*.json") if BACKUP_DIR.is_dir() else []:
        doc = json.loads(record.read_text())
        path = Path(doc["path"])
        if path.is_relative_to(ROOT):
            path.write_bytes(bytes.fromhex(doc["bytes"]))
            os.utime(path, ns=(doc["mtime_ns"], doc["mtime_ns"]))
            print(f"restored {path} left mutated by an earlier run", file=sys.stderr)
            record.unlink()


class _Stop(Exception):
    pass


def _stop(signum: int, frame: object) -> None:
    raise _Stop(signum)


def run_tests(
    tests: tuple[str, ...], env: dict[str, str], timeout: float
) -> tuple[str, float, str]:
    """('passed'|'failed'|'timeout', seconds, first failure line)."""
    start = time.perf_counter()
    proc = subprocess.Popen(
        [sys.executable, *PYTEST, *tests],
        cwd=ROOT,
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        start_new_session=True,  # the test run and everything it starts: one group
    )
    try:
        out, _ = proc.communicate(timeout=timeout)
        outcome = "passed" if proc.returncode == 0 else "failed"
    except subprocess.TimeoutExpired:
        out, outcome = "", "timeout"
    finally:
        try:
            os.killpg(proc.pid, signal.SIGKILL)  # leftovers: ranks, servers, children
        except ProcessLookupError:
            pass
        if proc.poll() is None:
            proc.communicate()
    lines = (out or "").splitlines()
    # The short summary names the failing test; else the first error line.
    why = [ln for ln in lines if ln.startswith(("FAILED", "ERROR"))]
    why = why or [ln for ln in lines if ln.startswith("E ")]
    if outcome == "failed" and not why:
        why = lines[-1:]
    return outcome, time.perf_counter() - start, " ".join(why[:1])[:200]


def run_mutant(m: Mutant, tests: tuple[str, ...], env: dict[str, str], timeout: float) -> dict:
    path = ROOT / m.file
    original = path.read_bytes()
    mtime = path.stat().st_mtime_ns
    BACKUP_DIR.mkdir(exist_ok=True)
    record = _backup_path(path)
    record.write_text(json.dumps({"path": str(path), "bytes": original.hex(), "mtime_ns": mtime}))
    try:
        path.write_bytes(original[: m.start] + m.new.encode() + original[m.end :])
        outcome, seconds, why = run_tests(tests, env, timeout)
    finally:
        path.write_bytes(original)
        os.utime(path, ns=(mtime, mtime))
        record.unlink()
    status = {"passed": "survived", "failed": "killed", "timeout": "timeout"}[outcome]
    return {**asdict(m), "status": status, "seconds": round(seconds, 1), "why": why}


def main() -> int:
    signal.signal(signal.SIGTERM, _stop)
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--target", help=f"comma-separated, of: {', '.join(TARGETS)}")
    parser.add_argument("--only", help="comma-separated mutant ids (target:number)")
    parser.add_argument("--list", action="store_true", help="print the mutants, run nothing")
    parser.add_argument("--sample", type=int, help="at most N mutants per function (even)")
    parser.add_argument("--tests", help="comma-separated test paths instead of the target's")
    parser.add_argument("--no-baseline", action="store_true", help="skip the unmutated run")
    parser.add_argument("--timeout", type=float, help="seconds per mutant (default: see above)")
    parser.add_argument(
        "--out", default=str(BACKUP_DIR / "results.jsonl"), help="JSON lines of results (appended)"
    )
    parser.add_argument("--pause-file", help="wait while this file exists, before each run")
    args = parser.parse_args()
    restore_leftovers()
    only = set(args.only.split(",")) if args.only else set()
    names = args.target.split(",") if args.target else list(TARGETS)
    if only:
        names = sorted({i.split(":")[0] for i in only}, key=list(TARGETS).index)
    unknown = [n for n in names if n not in TARGETS]
    if unknown:
        raise SystemExit(f"unknown target(s) {unknown}; known: {', '.join(TARGETS)}")

    plan: list[tuple[str, list[Mutant]]] = []
    for name in names:
        mutants = generate(name, TARGETS[name])
        if only:
            mutants = [m for m in mutants if m.id in only]
        elif args.sample:
            rng = random.Random(0)
            by_function: dict[str, list[Mutant]] = {}
            for m in mutants:
                by_function.setdefault(m.function, []).append(m)
            mutants = [
                m
                for group in by_function.values()
                for m in (group if len(group) <= args.sample else rng.sample(group, args.sample))
            ]
            mutants.sort(key=lambda m: int(m.id.split(":")[1]))
        plan.append((name, mutants))
    if args.list:
        for _name, mutants in plan:
            for m in mutants:
                print(
                    f"{m.id:26} {m.file}:{m.line:<4} {m.function:28} {m.what}  =>  {m.new[:60]!r}"
                )
        print(f"{sum(len(ms) for _, ms in plan)} mutants", file=sys.stderr)
        return 0

    paused = 0.0

    def pause() -> None:
        nonlocal paused
        while args.pause_file and os.path.exists(args.pause_file):
            time.sleep(30)
            paused += 30

    results: list[dict] = []
    started = time.perf_counter()
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    out = open(args.out, "a")  # noqa: SIM115
    try:
        for name, mutants in plan:
            target = TARGETS[name]
            tests = tuple(args.tests.split(",")) if args.tests else target.tests
            env = {**os.environ, **dict(target.env), "PYTHONDONTWRITEBYTECODE": "1"}
            timeout = 900.0
            if not args.no_baseline:
                pause()
                outcome, seconds, why = run_tests(tests, env, timeout)
                print(f"{name}: unmutated run {outcome} in {seconds:.0f} s", flush=True)
                if outcome != "passed":
                    raise SystemExit(f"{name}: the tests fail on the unmutated code: {why}")
                timeout = 2 * seconds + 60
            timeout = args.timeout or timeout
            for m in mutants:
                pause()
                r = run_mutant(m, tests, env, timeout)
                results.append(r)
                out.write(json.dumps({"target": name, **r}) + "\n")
                out.flush()
                print(
                    f"{m.id:24} {r['status']:8} {r['seconds']:6.1f}s  {m.function}:{m.line} "
                    f"{m.what}  {r['why'][:90] if r['status'] != 'killed' else ''}",
                    flush=True,
                )
    except (KeyboardInterrupt, _Stop):
        print("stopped; the file was restored", file=sys.stderr)
    finally:
        out.close()
    print(f"\n{'target':22} {'mutants':>7} {'killed':>7} {'timeout':>7} {'survived':>8}")
    for name, _ in plan:
        rs = [r for r in results if r["id"].split(":")[0] == name]
        count = {s: sum(r["status"] == s for r in rs) for s in ("killed", "timeout", "survived")}
        print(
            f"{name:22} {len(rs):7} {count['killed']:7} {count['timeout']:7} {count['survived']:8}"
        )
    survivors = [r for r in results if r["status"] == "survived"]
    for r in survivors:
        print(f"SURVIVED {r['id']} {r['file']}:{r['line']} {r['function']}: {r['what']}")
    print(f"total {time.perf_counter() - started:.0f} s ({paused:.0f} s of it paused)")
    return 1 if survivors else 0


if __name__ == "__main__":
    raise SystemExit(main())
