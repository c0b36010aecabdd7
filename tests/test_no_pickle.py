"""No pickle anywhere: not in the library's source, not at run time on any load path."""

import pickle
import re
from pathlib import Path

import torch

import shardpoint

SRC = Path(shardpoint.__file__).parent
FORBIDDEN = re.compile(
    r"\bimport pickle\b|\bpickle\.|torch\.load\(|_object\(|\bmarshal\b|\bshelve\b"
)


def test_the_library_source_never_uses_pickle():
    offenders = [
        f"{path.relative_to(SRC)}:{n}: {line.strip()}"
        for path in SRC.rglob("*.py")
        for n, line in enumerate(path.read_text().splitlines(), 1)
        if FORBIDDEN.search(line)
    ]
    assert not offenders, offenders


def test_save_load_open_verify_run_with_pickle_disabled(ckpt_dir, monkeypatch):
    model = torch.nn.Linear(3, 2)
    opt = torch.optim.AdamW(model.parameters())

    def refuse(*args, **kwargs):
        raise AssertionError("pickle was used")

    for name in ("load", "loads", "dump", "dumps"):
        monkeypatch.setattr(pickle, name, refuse)
    monkeypatch.setattr(torch, "load", refuse)
    state = {"train": shardpoint.TrainState(model=model, optimizer=opt), "extra": {"k": (1, b"x")}}
    shardpoint.save(state, ckpt_dir)
    shardpoint.load(state, ckpt_dir)
    with shardpoint.open(ckpt_dir) as r:
        r.state()
    assert shardpoint.verify(ckpt_dir).ok
