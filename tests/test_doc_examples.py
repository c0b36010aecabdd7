"""The README's and docs' code examples run: every fenced ```python block of README.md and
docs/*.md, the blocks of one file in order in one namespace (like a doctest session), in
a fresh working directory.

The blocks are fragments of a training script, so each session starts from ``prelude()``:
the names the docs assume (a tiny model, its optimizer and schedule, a dataset,
``train_step``...), inputs only, never a stand-in for shardpoint. A few blocks need
something to exist first (a checkpoint to export, a Hugging Face folder): ``GIVEN``
makes it just before that block, and says what it stands for.

A block that cannot run here (an object store, torchrun, a GPU, a framework's trainer)
carries ``<!-- example: not run (why) -->`` on the line right before its fence; every
other block runs, a new one by default. Each file's test prints what it ran and what it
did not.
"""

from __future__ import annotations

import ast
import io
import random
import re
import signal
import textwrap
import tokenize
import traceback
import warnings
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch

import shardpoint
from shardpoint.training.manager import CheckpointManager

ROOT = Path(__file__).resolve().parents[1]
DOCS = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]

FENCE = re.compile(r"^(?P<indent>[ \t]*)(?P<fence>`{3,}|~{3,})[ \t]*(?P<info>[^\s`]*)")
RUNNABLE = {"python", "py", "python3"}
NOT_RUN = re.compile(r"^[ \t]*<!--[ \t]*example:[ \t]*not run[ \t]*\((?P<why>.+)\)[ \t]*-->[ \t]*$")
MARKER = re.compile(r"<!--[ \t]*example:")


@dataclass(frozen=True)
class Block:
    path: Path
    line: int  # the opening fence's line (1-based)
    code: str  # dedented; its first line is the line after the fence
    not_run: str | None  # the marker's reason

    @property
    def name(self) -> str:
        return f"{self.path.relative_to(ROOT)}:{self.line}"


def python_blocks(path: Path) -> list[Block]:
    """Every fenced python block of ``path``, with the not-run marker right before it.
    A marker anywhere else, or without a reason, is an error: it would hide nothing."""
    lines = path.read_text().splitlines()
    blocks: list[Block] = []
    i = 0
    while i < len(lines):
        opening = FENCE.match(lines[i])
        if not opening:
            if MARKER.search(lines[i]):
                following = lines[i + 1] if i + 1 < len(lines) else ""
                fence = FENCE.match(following)
                if not (NOT_RUN.match(lines[i]) and fence and fence["info"] in RUNNABLE):
                    raise AssertionError(
                        f"{path.relative_to(ROOT)}:{i + 1}: {lines[i].strip()!r} is not "
                        "'<!-- example: not run (reason) -->' right before a ```python fence"
                    )
            i += 1
            continue
        indent, fence = opening["indent"], opening["fence"]
        end = i + 1
        while end < len(lines) and not re.match(
            rf"^[ \t]*{re.escape(fence[0])}{{{len(fence)},}}[ \t]*$", lines[end]
        ):
            end += 1
        if opening["info"] in RUNNABLE:
            body = [
                line[len(indent) :] if line.startswith(indent) else line
                for line in lines[i + 1 : end]
            ]
            marker = NOT_RUN.match(lines[i - 1]) if i > 0 else None
            blocks.append(
                Block(
                    path, i + 1, textwrap.dedent("\n".join(body)), marker and marker["why"].strip()
                )
            )
        i = end + 1
    return blocks


# ---- what the docs assume -------------------------------------------------------------------


class ScalarLog:
    """The docs' ``writer`` (TensorBoard's ``SummaryWriter``, not installed here): keeps
    what ``add_scalar`` is given."""

    def __init__(self) -> None:
        self.scalars: list[tuple[str, float, int]] = []

    def add_scalar(self, name: str, value: float, step: int) -> None:
        self.scalars.append((name, value, step))


def prelude() -> dict[str, Any]:
    """The names the docs' fragments use without defining them: the imports of a
    training script, a tiny model (an embedding of 2,048 rows and one layer, the
    README's ``model.embed.weight`` and ``model.layers.0.weight``) with AdamW, a step
    schedule and a grad scaler, 64 samples, and one training step."""
    torch.manual_seed(0)
    model = torch.nn.Sequential(
        OrderedDict(
            embed=torch.nn.Embedding(2048, 4),
            layers=torch.nn.Sequential(torch.nn.Linear(4, 1)),
        )
    )
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    scheduler = torch.optim.lr_scheduler.StepLR(optimizer, step_size=10)
    dataset = torch.utils.data.TensorDataset(torch.randint(0, 2048, (64,)), torch.randn(64, 1))

    def train_step(x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        optimizer.zero_grad()
        loss = torch.nn.functional.mse_loss(model(x), y)
        loss.backward()
        optimizer.step()
        scheduler.step()
        return loss

    return {
        "torch": torch,
        "signal": signal,
        "shardpoint": shardpoint,
        **{
            name: getattr(shardpoint, name)
            for name in (
                "CheckpointManager",
                "MemoryTierOptions",
                "RemoteTier",
                "RetentionPolicy",
                "ResumableLoader",
                "SavePolicy",
                "TrainState",
            )
        },
        "model": model,
        "optimizer": optimizer,
        "opt": optimizer,
        "scheduler": scheduler,
        "sched": scheduler,
        "scaler": torch.amp.GradScaler("cpu"),
        "dataset": dataset,
        "data": dataset,
        "train_step": train_step,
        "total_steps": 3,
        "state": shardpoint.TrainState(model=model, optimizer=optimizer, scheduler=scheduler),
        "writer": ScalarLog(),
    }


def interop_inputs(ns: dict[str, Any]) -> None:
    """docs/interop.md's sources: a run's checkpoint of step 10000, a Llama model in the
    Hugging Face layout (a tiny one for the 8B download), a torch.distributed.checkpoint
    save; and ``config``, the model's."""
    import torch.distributed.checkpoint as dcp
    from transformers import LlamaConfig, LlamaForCausalLM

    shardpoint.save(ns["state"], "runs/exp1/step-000010000")
    with warnings.catch_warnings():  # "assuming the intent is to save in a single process"
        warnings.simplefilter("ignore", UserWarning)
        dcp.save(ns["model"].state_dict(), checkpoint_id="dcp_checkpoint")
    config = LlamaConfig(
        vocab_size=64,
        hidden_size=16,
        intermediate_size=32,
        num_hidden_layers=1,
        num_attention_heads=2,
        num_key_value_heads=2,
    )
    LlamaForCausalLM(config).save_pretrained("Llama-3-8B")
    ns.update(config=config, LlamaForCausalLM=LlamaForCausalLM)


def saved_12000_and_12400(ns: dict[str, Any]) -> None:
    """The run went on and saved steps 12000 and 12400 (the loss spiked after 12000)."""
    for step in (12000, 12400):
        ns["state"].step = step
        ns["manager"].save(step, ns["state"], force=True)


def next_save_due(ns: dict[str, Any]) -> None:
    """Training went on to the next step due for a save."""
    ns["step"] = 12500


# (file, how the block begins) -> what must exist before that block runs.
GIVEN: dict[tuple[str, str], Callable[[dict[str, Any]], None]] = {
    ("docs/interop.md", "shardpoint.export_hf("): interop_inputs,
    ("docs/training.md", "manager.rollback(12000,"): saved_12000_and_12400,
    ("docs/training.md", "if manager.maybe_save(step, state):"): next_save_due,
}


def given_for(rel: str, block: Block) -> Callable[[dict[str, Any]], None] | None:
    found = [
        g for (file, begins), g in GIVEN.items() if file == rel and block.code.startswith(begins)
    ]
    return found[0] if found else None


# ---- running a file's session ---------------------------------------------------------------


def absolute_paths(code: str) -> list[str]:
    """The string literals of ``code`` that name a place outside the working directory:
    absolute paths and URLs (an object store)."""
    found = []
    for token in tokenize.generate_tokens(io.StringIO(code).readline):
        if token.type != tokenize.STRING:
            continue
        try:
            value = ast.literal_eval(token.string)
        except ValueError:  # an f-string
            value = token.string
        if isinstance(value, str) and re.match(r"(/|~|[a-z][a-z0-9+.-]*://)", value):
            found.append(value)
    return list(dict.fromkeys(found))


def run_block(block: Block, ns: dict[str, Any]) -> None:
    """Execute ``block`` in ``ns``; its line numbers are the markdown file's."""
    outside = absolute_paths(block.code)
    if outside:
        pytest.fail(
            f"{block.name}: the example uses {outside}, outside the test's working directory: "
            "use a relative path (runs/...), or mark the block not run, with the reason",
            pytrace=False,
        )
    code = compile("\n" * block.line + block.code, str(block.path), "exec")
    try:
        exec(code, ns)
        return
    except (Exception, SystemExit) as exc:
        failure = exc
    frames = traceback.extract_tb(failure.__traceback__)[1:]  # from the block's own frame on
    at = [f.lineno for f in frames if f.filename == str(block.path)]
    first = "\n".join("    " + line for line in block.code.splitlines()[:6])
    pytest.fail(
        f"{block.name}: the example failed at line {at[-1] if at else '?'}:\n"
        f"{''.join(traceback.format_exception_only(type(failure), failure)).rstrip()}\n\n"
        f"the block begins:\n{first}\n\ntraceback:\n{''.join(traceback.format_list(frames))}",
        pytrace=False,
    )


def files_with_examples() -> list[Path]:
    """The files with a python fence (read in full by their own test, so that a bad
    marker fails that file's test only)."""
    return [
        p
        for p in DOCS
        if any(
            (m := FENCE.match(line)) and m["info"] in RUNNABLE
            for line in p.read_text().splitlines()
        )
    ]


@pytest.mark.filterwarnings("ignore:This DataLoader will create:UserWarning")  # num_workers=4
@pytest.mark.parametrize("path", files_with_examples(), ids=lambda p: str(p.relative_to(ROOT)))
def test_examples_run(
    path: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture
) -> None:
    rel = str(path.relative_to(ROOT))
    try:
        blocks = python_blocks(path)
    except AssertionError as exc:  # a marker in the wrong place
        pytest.fail(str(exc), pytrace=False)
    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv("SHARDPOINT_SHM_DIR", str(tmp_path / "shm"))  # the memory tier's
    # Every manager a block makes is closed at the end, newest first, so that each puts
    # back the signal handlers it found; then none may be left installed.
    managers: list[CheckpointManager] = []
    original_init = CheckpointManager.__init__

    def recording_init(self: CheckpointManager, *args: Any, **kwargs: Any) -> None:
        original_init(self, *args, **kwargs)
        managers.append(self)

    monkeypatch.setattr(CheckpointManager, "__init__", recording_init)
    handlers = {s: signal.getsignal(s) for s in (signal.SIGTERM, signal.SIGUSR1, signal.SIGINT)}
    rng = random.getstate(), np.random.get_state(), torch.get_rng_state()
    ns = prelude()
    try:
        for block in blocks:
            if block.not_run is not None:
                continue
            given = given_for(rel, block)
            if given is not None:
                given(ns)
            run_block(block, ns)
    finally:
        not_closed = []
        for manager in reversed(managers):
            try:
                manager.close()
            except Exception as exc:  # a background save or upload failed
                not_closed.append(f"{manager.directory}: {exc!r}")
        leaked = [s.name for s, h in handlers.items() if signal.getsignal(s) is not h]
        for s, h in handlers.items():
            signal.signal(s, h)
        random.setstate(rng[0])
        np.random.set_state(rng[1])
        torch.set_rng_state(rng[2])
    assert not not_closed, f"{rel}: closing the managers failed: {not_closed}"
    assert not leaked, f"{rel}: signal handlers left installed after closing the managers: {leaked}"
    not_run = [b for b in blocks if b.not_run is not None]
    with capsys.disabled():
        print(f"\n{rel}: {len(blocks) - len(not_run)} python blocks run, {len(not_run)} not run")
        for b in not_run:
            print(f"    not run: {b.name} ({b.not_run})")


def test_every_given_is_used() -> None:
    """A ``GIVEN`` whose block was edited away would silently stop preparing anything."""
    unused = [
        key
        for key in GIVEN
        if not any(
            b.not_run is None and b.code.startswith(key[1]) for b in python_blocks(ROOT / key[0])
        )
    ]
    assert not unused, f"no runnable block begins so: {unused}"
