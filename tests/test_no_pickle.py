"""No pickle anywhere: not in the library's source, not at run time on any path.

The source scan reads every module of src/shardpoint as a syntax tree, so an alias
(``import pickle as p``), a name bound at import (``from pickle import loads``) or a
relative of pickle (``_pickle``, ``dill``, ``marshal``, ...) is found wherever it is.
The run-time check replaces every pickle entry point before shardpoint is imported, in
a fresh interpreter, so even names shardpoint binds at import are the refusing ones.
"""

from __future__ import annotations

import ast
import pickle
import re
import subprocess
import sys
import textwrap
from dataclasses import dataclass
from pathlib import Path

import pytest
import torch

import shardpoint

SRC = Path(shardpoint.__file__).parent

# Modules that (un)pickle, or exist to: importing one at all is a use.
PICKLE_MODULES = frozenset(
    {"pickle", "_pickle", "cPickle", "cloudpickle", "dill", "marshal", "shelve", "joblib"}
    | {"jsonpickle", "copyreg", "pickletools", "_compat_pickle"}
)
# Entry points of torch that pickle or unpickle (a name or anything under it).
TORCH_PICKLING = (
    "torch.load",
    "torch.save",
    "torch.serialization",
    "torch.jit.load",
    "torch.jit.save",
    "torch.package",
    "torch.distributed.checkpoint",  # DCP's .metadata is a pickle
)
NOT_PICKLING = ("torch.distributed.checkpoint.state_dict",)  # FQN state dicts, no I/O
# all_gather_object, broadcast_object_list, ...: torch.distributed pickles these.
OBJECT_COLLECTIVE = re.compile(r"_object(_list)?$")
TORCH_LOAD = ("torch.load", "torch.serialization.load")


@dataclass(frozen=True)
class PickleUse:
    file: str  # relative to src/shardpoint
    function: str  # the enclosing def or class (dotted), "<module>" at top level
    family: str  # what it belongs to: "pickle", "torch.load(weights_only=True)", ...
    line: int
    code: str

    @property
    def where(self) -> tuple[str, str, str]:
        return (self.file, self.function, self.family)


# Foreign formats, only on the user's explicit request, and nothing else.
OPT_IN_FOREIGN_FORMATS = {
    # convert(..., allow_pickle=True): a torch.save file, by torch's restricted unpickler
    ("convert.py", "_torch_save_to_shardpoint", "torch.load(weights_only=True)"),
    # convert(..., allow_pickle=True): a DCP directory, whose metadata torch unpickles
    ("convert.py", "_dcp_to_shardpoint", "torch.distributed.checkpoint"),
    # convert(checkpoint, "model.pt"): writing a torch.save file, asked for by name
    ("convert.py", "_shardpoint_to_torch_save", "torch.save"),
    # load_hf / import_hf(allow_pickle_weights=True): .bin weights, restricted unpickler
    ("hf.py", "_read_pickle_weights", "torch.load(weights_only=True)"),
}


def _family(qualified: str) -> str | None:
    """The pickling family a dotted name belongs to, or None."""
    if qualified.split(".")[0] in PICKLE_MODULES:
        return qualified.split(".")[0]
    if any(qualified == p or qualified.startswith(p + ".") for p in NOT_PICKLING):
        return None
    for prefix in TORCH_PICKLING:
        if qualified == prefix or qualified.startswith(prefix + "."):
            return prefix
    return None


class _PickleScan(ast.NodeVisitor):
    """Every pickle use of one module, by the names its imports bind."""

    def __init__(self, file: str, source: str) -> None:
        self.file, self.lines = file, source.splitlines()
        self.tree = ast.parse(source)
        self.bound: dict[str, str] = {}  # local name -> dotted module or object
        for node in ast.walk(self.tree):  # imports anywhere bind for the whole module
            if isinstance(node, ast.Import):
                for a in node.names:
                    top = a.name.split(".")[0]
                    self.bound[a.asname or top] = a.name if a.asname else top
            elif isinstance(node, ast.ImportFrom) and not node.level:
                for a in node.names:
                    self.bound[a.asname or a.name] = f"{node.module}.{a.name}"
        self.scope: list[str] = []
        self.uses: list[PickleUse] = []
        self.visit(self.tree)

    def _use(self, node: ast.AST, family: str) -> None:
        line = node.lineno  # type: ignore[attr-defined]
        function = ".".join(self.scope) or "<module>"
        self.uses.append(PickleUse(self.file, function, family, line, self.lines[line - 1].strip()))

    def _qualified(self, node: ast.AST) -> str | None:
        """``a.b.c`` as the dotted name the module's imports make of it, or None."""
        attrs = []
        while isinstance(node, ast.Attribute):
            attrs.append(node.attr)
            node = node.value
        if not isinstance(node, ast.Name) or node.id not in self.bound:
            return None
        return ".".join([self.bound[node.id], *reversed(attrs)])

    def visit_FunctionDef(
        self, node: ast.FunctionDef | ast.AsyncFunctionDef | ast.ClassDef
    ) -> None:
        self.scope.append(node.name)
        self.generic_visit(node)
        self.scope.pop()

    visit_AsyncFunctionDef = visit_ClassDef = visit_FunctionDef

    def visit_Import(self, node: ast.Import) -> None:
        for a in node.names:
            if family := _family(a.name):
                self._use(node, family)

    def visit_ImportFrom(self, node: ast.ImportFrom) -> None:
        if node.level:  # shardpoint's own modules
            return
        for a in node.names:
            family = _family(f"{node.module}.{a.name}")
            if family or OBJECT_COLLECTIVE.search(a.name):
                self._use(node, family or "torch.distributed *_object")

    def visit_Call(self, node: ast.Call) -> None:
        func = self._qualified(node.func)
        keywords = {k.arg: k.value for k in node.keywords}
        if func in TORCH_LOAD:
            restricted = getattr(keywords.get("weights_only"), "value", None) is True
            self._use(node, "torch.load(weights_only=True)" if restricted else "torch.load")
            for child in [*node.args, *node.keywords]:
                self.visit(child)
            return
        dynamic = isinstance(node.func, ast.Name) and node.func.id == "__import__"
        if dynamic or func == "importlib.import_module":
            name = node.args[0] if node.args else None
            if isinstance(name, ast.Constant) and isinstance(name.value, str):
                if family := _family(name.value):
                    self._use(node, family)
        if func == "numpy.load" and getattr(keywords.get("allow_pickle"), "value", False):
            self._use(node, "numpy.load(allow_pickle=True)")
        self.generic_visit(node)

    def visit_Attribute(self, node: ast.Attribute) -> None:
        qualified = self._qualified(node)
        if OBJECT_COLLECTIVE.search(node.attr):
            self._use(node, "torch.distributed *_object")
        elif qualified and (family := _family(qualified)):
            self._use(node, family)
            return  # the rest of the chain is the same use
        self.generic_visit(node)

    def visit_Name(self, node: ast.Name) -> None:
        if node.id in self.bound and (family := _family(self.bound[node.id])):
            self._use(node, family)


def pickle_uses(source: str, file: str = "<snippet>") -> list[PickleUse]:
    return _PickleScan(file, source).uses


def library_pickle_uses() -> list[PickleUse]:
    return [
        use
        for path in sorted(SRC.rglob("*.py"))
        for use in pickle_uses(path.read_text(), str(path.relative_to(SRC)))
    ]


# ---- the source scan -------------------------------------------------------------------


def test_the_library_source_uses_pickle_only_in_the_opt_in_foreign_format_readers():
    offenders = [u for u in library_pickle_uses() if u.where not in OPT_IN_FOREIGN_FORMATS]
    assert not offenders, "\n".join(
        f"{u.file}:{u.line} ({u.function}): {u.code}" for u in offenders
    )


def test_the_source_scan_sees_every_opt_in_foreign_format_reader():
    # A scan that finds nothing would pass the test above: it must see the known readers
    # (when one moves or goes, update OPT_IN_FOREIGN_FORMATS).
    assert {u.where for u in library_pickle_uses()} >= OPT_IN_FOREIGN_FORMATS


@pytest.mark.parametrize(
    "source",
    [
        "import pickle",
        "import pickle as p",
        "from pickle import loads",
        "from pickle import Unpickler as U",
        "import _pickle",
        "from _pickle import loads",
        "import cPickle",
        "import dill",
        "import cloudpickle",
        "import shelve",
        "import marshal as m",
        "from marshal import loads",
        "import torch\ntorch.load(f)",
        "import torch\ntorch.load(f, weights_only=True)",  # outside the opt-in readers
        "from torch import load\nload(f)",
        "import torch as t\nt.serialization.load(f)",
        "import torch\ntorch.save(x, f)",
        "import torch.distributed as d\nd.all_gather_object(out, x)",
        "import torch.distributed as d\nd.broadcast_object_list(xs)",
        "from torch.distributed import gather_object",
        "import torch.distributed.checkpoint as dcp",
        "__import__('pickle')",
        "import importlib\nimportlib.import_module('_pickle')",
        "import numpy as np\nnp.load(f, allow_pickle=True)",
    ],
)
def test_the_source_scan_finds_every_way_of_reaching_pickle(source):
    assert pickle_uses(f"def f():\n{textwrap.indent(source, '    ')}\n")


@pytest.mark.parametrize(
    "source",
    [
        "import json\njson.loads(s)",
        "from torch.distributed.checkpoint.state_dict import get_state_dict",
        "import numpy as np\nnp.load(f)",
        "import torch\ntorch.empty(3)",
    ],
)
def test_the_source_scan_leaves_what_does_not_pickle(source):
    assert pickle_uses(source) == []


# ---- at run time -------------------------------------------------------------------------

# Run in a fresh interpreter: torch first (its own import subclasses pickle.Pickler),
# then every pickle entry point replaced, then shardpoint imported. marshal is left alone
# (the import system loads .pyc files with it): the source scan covers it.
WITH_PICKLE_REFUSED = """
import json, shutil, sys
from pathlib import Path

import torch
import _pickle
import pickle

USED = []


def refused(name):
    def refuse(*args, **kwargs):
        USED.append(name)
        raise AssertionError(f"{name} was called")
    return refuse


def refused_class(name, base):
    class Refused(base):
        def __init__(self, *args, **kwargs):
            USED.append(name)
            raise AssertionError(f"{name} was instantiated")

        def load(self, *args, **kwargs):
            USED.append(f"{name}.load")
            raise AssertionError(f"{name}.load was called")

        def dump(self, *args, **kwargs):
            USED.append(f"{name}.dump")
            raise AssertionError(f"{name}.dump was called")

    return Refused


for module in (pickle, _pickle):
    for fn in ("load", "loads", "dump", "dumps", "_load", "_loads", "_dump", "_dumps"):
        if hasattr(module, fn):
            setattr(module, fn, refused(f"{module.__name__}.{fn}"))
    for cls in ("Pickler", "Unpickler", "_Pickler", "_Unpickler"):
        if hasattr(module, cls):
            real = getattr(module, cls)
            setattr(module, cls, refused_class(f"{module.__name__}.{cls}", real))
for module in (torch, torch.serialization):
    module.load = refused("torch.load")
    module.save = refused("torch.save")

import shardpoint  # every name it binds at import is one of the refusing ones
from shardpoint.cli import main

root, foreign, stray = (Path(p) for p in sys.argv[1:4])
model = torch.nn.Linear(3, 2)
optimizer = torch.optim.AdamW(model.parameters())
model(torch.randn(4, 3)).sum().backward()
optimizer.step()


def train_state(step=7):
    extra = {"k": (1, b"x"), "f": float("nan"), "s": "text"}
    return shardpoint.TrainState(model=model, optimizer=optimizer, step=step, extra=extra)


ckpt = root / "ckpt"
shardpoint.save(train_state(), ckpt)
shutil.copy(stray, ckpt / "stray.pkl")  # a pickle in a checkpoint is never opened
shardpoint.load(train_state(), ckpt)
with shardpoint.open(ckpt) as reader:
    reader.state()
assert shardpoint.verify(ckpt).ok
shardpoint.async_save(train_state(), root / "async").wait()
shardpoint.load(train_state(), root / "async")
manager = shardpoint.CheckpointManager(
    root / "run", shardpoint.SavePolicy(every_n_steps=1), preemption_signals=()
)
for step in (1, 2):
    manager.save(step, train_state(step))
manager.close()
restored = train_state(0)
assert shardpoint.CheckpointManager(root / "run", preemption_signals=()).restore(restored) == 2
assert main(["inspect", str(ckpt)]) == 0
assert main(["verify", str(ckpt)]) == 0
assert main(["ls", str(root / "run")]) == 0
shardpoint.export_hf(ckpt, root / "hf", prefix="model.")
shardpoint.load_hf(model, root / "hf")
shardpoint.import_hf(root / "hf", root / "imported")
try:  # a foreign pickle without allow_pickle=True: refused unread
    shardpoint.convert(foreign, root / "converted")
    raise SystemExit("convert read a torch.save file without allow_pickle=True")
except shardpoint.CheckpointError:
    pass
print("pickle used:", json.dumps(USED))
"""


def test_save_load_open_verify_restore_and_the_cli_never_call_pickle(tmp_path):
    foreign, stray = tmp_path / "model.pt", tmp_path / "stray.pkl"
    torch.save({"w": torch.ones(2)}, foreign)
    stray.write_bytes(pickle.dumps({"never": "opened"}))
    (tmp_path / "work").mkdir()
    done = subprocess.run(
        [
            sys.executable,
            "-c",
            WITH_PICKLE_REFUSED,
            str(tmp_path / "work"),
            str(foreign),
            str(stray),
        ],
        capture_output=True,
        text=True,
        timeout=300,
    )
    output = done.stdout[-4000:] + done.stderr[-4000:]
    assert done.returncode == 0, output
    assert done.stdout.splitlines()[-1] == "pickle used: []", output
