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


# Reading *foreign* formats on the user's explicit request: a torch.save file
# (`convert`) and opted-in .bin weights (`load_hf(allow_pickle_weights=True)`), both
# through torch's restricted unpickler. Nothing else may touch pickle.
FOREIGN_FORMAT_READERS = {"convert.py", "hf.py"}


def test_the_library_source_never_uses_pickle():
    offenders = [
        f"{path.relative_to(SRC)}:{n}: {line.strip()}"
        for path in SRC.rglob("*.py")
        for n, line in enumerate(path.read_text().splitlines(), 1)
        if FORBIDDEN.search(line)
        and not (path.name in FOREIGN_FORMAT_READERS and "weights_only=True" in line)
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
    # The Hugging Face paths: export, load into a model, import.
    shardpoint.export_hf(ckpt_dir, ckpt_dir.parent / "hf", prefix="train.model.")
    shardpoint.load_hf(model, ckpt_dir.parent / "hf")
    shardpoint.import_hf(ckpt_dir.parent / "hf", ckpt_dir.parent / "imported")
