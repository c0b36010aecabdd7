"""Capturing and restoring every random number stream a training step draws from.

Python ``random``, NumPy's global generator, torch's CPU generator and, when CUDA is
initialised, every CUDA device's generator. All of it is stored as tensors and plain
values (no pickle).
"""

from __future__ import annotations

import random
from typing import Any

import numpy as np
import torch
import xxhash


def _streams(py_state: tuple, np_state: tuple, torch_state: torch.Tensor) -> dict[str, Any]:
    """The CPU streams as tensors and plain values (what the checkpoint stores)."""
    version, internal, gauss_next = py_state
    kind, keys, pos, has_gauss, cached_gaussian = np_state
    return {
        "python": {
            "version": version,
            "state": torch.tensor(internal, dtype=torch.int64),
            "gauss_next": gauss_next,
        },
        "numpy": {
            "kind": kind,
            "keys": torch.from_numpy(keys.astype(np.int64)),
            "pos": int(pos),
            "has_gauss": int(has_gauss),
            "cached_gaussian": float(cached_gaussian),
        },
        "torch": torch_state,
    }


def capture_rng() -> dict[str, Any]:
    state = _streams(random.getstate(), np.random.get_state(), torch.get_rng_state())
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        state["cuda"] = [torch.cuda.get_rng_state(i) for i in range(torch.cuda.device_count())]
    return state


def restore_rng(state: dict[str, Any]) -> None:
    py = state["python"]
    random.setstate((py["version"], tuple(int(x) for x in py["state"].tolist()), py["gauss_next"]))
    npy = state["numpy"]
    np.random.set_state(
        (
            npy["kind"],
            npy["keys"].numpy().astype(np.uint32),
            npy["pos"],
            npy["has_gauss"],
            npy["cached_gaussian"],
        )
    )
    torch.set_rng_state(state["torch"])
    if "cuda_seed" in state and torch.cuda.is_available():
        torch.cuda.manual_seed_all(state["cuda_seed"])
    cuda = state.get("cuda")
    if cuda:
        if not torch.cuda.is_available() or torch.cuda.device_count() < len(cuda):
            raise RuntimeError(
                f"the checkpoint holds RNG state for {len(cuda)} CUDA device(s) but this process "
                f"sees {torch.cuda.device_count() if torch.cuda.is_available() else 0}"
            )
        for i, s in enumerate(cuda):
            torch.cuda.set_rng_state(s, i)


def reseed_streams(state: dict[str, Any], rank: int) -> dict[str, Any]:
    """Streams for a rank that has none saved: seeded from a saved rank's torch state and
    ``rank``, so they are reproducible and differ from every other rank's."""
    digest = xxhash.xxh3_64_intdigest(state["torch"].numpy().tobytes() + rank.to_bytes(8, "little"))
    seed = digest % (2**63)
    out = _streams(
        random.Random(seed).getstate(),
        np.random.RandomState(seed % (2**32)).get_state(),
        torch.Generator().manual_seed(seed).get_state(),
    )
    if "cuda" in state:
        out["cuda_seed"] = seed  # CUDA generators are seeded, not given a CPU state
    return out
