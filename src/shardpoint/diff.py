"""Comparing two checkpoints entry by entry, one tensor pair in memory at a time."""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch

from .reader import CheckpointReader


@dataclass(frozen=True)
class TensorChange:
    name: str
    detail: str  # "F32[4, 3] -> F16[4, 3]" or "max abs diff 0.0125"
    max_abs_diff: float | None


@dataclass
class CheckpointDiff:
    added: list[str] = field(default_factory=list)
    removed: list[str] = field(default_factory=list)
    changed: list[TensorChange] = field(default_factory=list)
    values_changed: list[str] = field(default_factory=list)  # non-tensor paths
    unchanged: int = 0

    @property
    def differs(self) -> bool:
        return bool(self.added or self.removed or self.changed or self.values_changed)

    def to_json(self) -> dict[str, Any]:
        return {
            "differs": self.differs,
            "added": self.added,
            "removed": self.removed,
            "changed": [
                {"name": c.name, "detail": c.detail, "max_abs_diff": _json_number(c.max_abs_diff)}
                for c in self.changed
            ],
            "values_changed": self.values_changed,
            "unchanged": self.unchanged,
        }


def diff_checkpoints(
    a: CheckpointReader, b: CheckpointReader, progress: Callable[[int], None] | None = None
) -> CheckpointDiff:
    """What differs from ``a`` to ``b``: tensor entries (by value, checksum-verified
    reads) and the non-tensor state (by path)."""
    names_a, names_b = a.keys(), b.keys()
    in_a, in_b = set(names_a), set(names_b)
    result = CheckpointDiff(
        added=[n for n in names_b if n not in in_a],
        removed=[n for n in names_a if n not in in_b],
    )
    for name in (n for n in names_a if n in in_b):
        ea, eb = a.entry(name), b.entry(name)
        if (ea.dtype, ea.shape) != (eb.dtype, eb.shape):
            detail = f"{ea.dtype}{list(ea.shape)} -> {eb.dtype}{list(eb.shape)}"
            result.changed.append(TensorChange(name, detail, None))
            continue
        ta, tb = a.get(name), b.get(name)
        if progress is not None:
            progress(ea.nbytes)
        if torch.equal(ta, tb) or _same_bytes(ta, tb):  # NaN != NaN, yet stored alike
            result.unchanged += 1
            continue
        diff, nan_in_one = _max_abs_diff(ta, tb)
        detail = f"max abs diff {diff:.6g}"
        if nan_in_one:
            detail += f", NaN in one only at {nan_in_one} element(s)"
        result.changed.append(TensorChange(name, detail, diff))
    result.values_changed = _value_paths_differing(a.state(tensors=False), b.state(tensors=False))
    return result


def _same_bytes(a: torch.Tensor, b: torch.Tensor) -> bool:
    return torch.equal(a.reshape(-1).view(torch.uint8), b.reshape(-1).view(torch.uint8))


def _max_abs_diff(a: torch.Tensor, b: torch.Tensor) -> tuple[float, int]:
    """The largest |a - b| (a complex difference's magnitude) over the elements that
    differ and are numbers in both, and how many elements are NaN in one only: a NaN
    must not hide the real difference, and NaN in both at one place is no difference."""
    if a.dtype == torch.bool:
        return float((a != b).any()), 0
    if not a.numel():
        return 0.0, 0
    if not (a.is_floating_point() or a.is_complex()):
        return float((a.to(torch.int64) - b.to(torch.int64)).abs().max()), 0
    wide = torch.complex128 if a.is_complex() else torch.float64
    x, y = a.to(wide), b.to(wide)
    nan = torch.isnan(x) | torch.isnan(y)
    # Equal elements (infinities included: inf - inf is NaN) and NaNs count as 0 here.
    d = torch.where((x == y) | nan, 0.0, (x - y).abs())
    return float(d.max()), int((torch.isnan(x) ^ torch.isnan(y)).sum())


def _json_number(value: float | None) -> float | str | None:
    """JSON has no NaN or infinity (``inspect --json`` writes them as strings too)."""
    return value if value is None or math.isfinite(value) else str(value)


def _value_paths_differing(a: Any, b: Any, path: str = "") -> list[str]:
    """Paths of non-tensor values that differ (tensor entries are compared above)."""
    if _is_entry(a) or _is_entry(b):
        return []
    if isinstance(a, dict) and isinstance(b, dict):
        out = []
        for key in list(a) + [k for k in b if k not in a]:
            sub = f"{path}.{key}" if path else str(key)
            if key not in a or key not in b:
                if not (_is_entry(a.get(key)) or _is_entry(b.get(key))):
                    out.append(sub)
                continue
            out += _value_paths_differing(a[key], b[key], sub)
        return out
    if isinstance(a, (list, tuple)) and isinstance(b, (list, tuple)) and len(a) == len(b):
        return [
            p
            for i, (x, y) in enumerate(zip(a, b))
            for p in _value_paths_differing(x, y, f"{path}.{i}")
        ]
    same = type(a) is type(b) and (a == b or (a != a and b != b))  # nan equals nan here
    return [] if same else [path or "<root>"]


def _is_entry(v: Any) -> bool:
    return hasattr(v, "dtype") and hasattr(v, "chunks")
