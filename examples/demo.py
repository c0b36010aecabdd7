"""Save a small training state, load it into fresh objects, and check it came back exactly.

Run: python examples/demo.py [--dir DIR]
"""

from __future__ import annotations

import argparse
import tempfile
from pathlib import Path

import torch

import shardpoint


def make(seed: int) -> tuple[torch.nn.Module, torch.optim.Optimizer]:
    torch.manual_seed(seed)
    model = torch.nn.Sequential(torch.nn.Linear(32, 64), torch.nn.ReLU(), torch.nn.Linear(64, 4))
    return model, torch.optim.AdamW(model.parameters(), lr=1e-3)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument(
        "--dir", type=Path, default=None, help="where to write (default: a temp dir)"
    )
    args = parser.parse_args()
    root = args.dir or Path(tempfile.mkdtemp(prefix="shardpoint-demo-"))

    model, opt = make(0)
    for step in range(5):
        x = torch.randn(16, 32)
        loss = model(x).pow(2).mean()
        opt.zero_grad()
        loss.backward()
        opt.step()
    path = root / "step-5"
    info = shardpoint.save({"model": model, "optim": opt, "step": 5}, path)
    print(
        f"saved {info.tensors} tensors, {info.bytes_written} bytes, {info.files} file(s) to {path}"
    )

    model2, opt2 = make(1)  # different initial weights
    state = {"model": model2, "optim": opt2, "step": 0}
    shardpoint.load(state, path)
    same = all(torch.equal(a, b) for a, b in zip(model.parameters(), model2.parameters()))
    print(f"loaded step {state['step']}; weights identical: {same}")

    report = shardpoint.verify(path)
    print(f"verify: {'ok' if report.ok else 'CORRUPT'} ({len(report.files)} file(s))")
    with shardpoint.open(path) as ckpt:
        print("entries:", ", ".join(ckpt.keys()[:4]), "...")
    if not (same and report.ok and state["step"] == 5):
        raise SystemExit("demo failed: the checkpoint did not round-trip")


if __name__ == "__main__":
    main()
