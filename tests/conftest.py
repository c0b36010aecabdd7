import json
import os
from pathlib import Path

import pytest
import torch

from shardpoint.format.index import INDEX_NAME, MARKER_NAME
from shardpoint.format.marker import marker_json

# ---- no silent skips ----------------------------------------------------------------------
# A skipped or expected-to-fail test proves nothing, and in CI a missing dependency must
# fail, not skip: every skip (pytest.skip, skipif, importorskip, at collection or in a
# test) and every xfail is reported as a failure. SHARDPOINT_ALLOW_SKIPS=1 lets a
# developer without some dev dependency run the rest; CI never sets it.


def _skip_as_failure(report: pytest.CollectReport | pytest.TestReport) -> None:
    if not report.skipped or os.environ.get("SHARDPOINT_ALLOW_SKIPS") == "1":
        return
    if hasattr(report, "wasxfail"):
        what = f"expected to fail ({report.wasxfail})"
        del report.wasxfail
    else:
        reason = report.longrepr[2] if isinstance(report.longrepr, tuple) else report.longrepr
        what = f"skipped ({reason})"
    report.outcome = "failed"
    report.longrepr = (
        f"{what}: that proves nothing and fails this suite; install the dev dependencies "
        "(README) or fix the test (SHARDPOINT_ALLOW_SKIPS=1 allows it locally)"
    )


@pytest.hookimpl(hookwrapper=True)
def pytest_make_collect_report(collector: pytest.Collector):  # noqa: ANN201
    outcome = yield
    _skip_as_failure(outcome.get_result())


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(item: pytest.Item, call: pytest.CallInfo):  # noqa: ANN201
    outcome = yield
    _skip_as_failure(outcome.get_result())


# ---- the fast lane stays fast -------------------------------------------------------------
# ``pytest -m "not slow"`` is the local lane (README). A test not marked slow that takes
# longer than FAST_LANE_SECONDS (setup, call and teardown) is named at the end of the
# run, so that the next change marks it or makes it faster.

FAST_LANE_SECONDS = 10.0
_slow_unmarked: dict[str, float] = {}


def pytest_runtest_logreport(report: pytest.TestReport) -> None:
    if "slow" not in report.keywords:
        _slow_unmarked[report.nodeid] = _slow_unmarked.get(report.nodeid, 0.0) + report.duration


def pytest_terminal_summary(terminalreporter) -> None:  # noqa: ANN001 - pytest's reporter
    over = {k: v for k, v in _slow_unmarked.items() if v > FAST_LANE_SECONDS}
    if over:
        terminalreporter.section("tests over the fast lane's budget, not marked slow")
        for nodeid, seconds in sorted(over.items(), key=lambda kv: -kv[1]):
            terminalreporter.write_line(f"{seconds:6.1f} s  {nodeid}  (mark it @pytest.mark.slow)")


@pytest.fixture
def ckpt_dir(tmp_path: Path) -> Path:
    return tmp_path / "ckpt"


def rewrite_index(path: Path, mutate) -> None:
    """Edit index.json and re-sign the marker, as a hostile or buggy writer could."""
    doc = json.loads((path / INDEX_NAME).read_bytes())
    mutate(doc)
    raw = json.dumps(doc).encode()
    (path / INDEX_NAME).write_bytes(raw)
    (path / MARKER_NAME).write_bytes(marker_json(raw))


def sample_state() -> dict:
    torch.manual_seed(0)
    return {
        "a": torch.randn(64, 32),
        "b": {"c": torch.arange(10, dtype=torch.int64), "d": torch.randn(3, dtype=torch.float64)},
        "step": 3,
    }


def read_losses(run_dir: Path) -> dict[int, str]:
    """examples/train_char_lm.py's loss per step (float.hex); a step re-run after a resume
    overrides the crashed run's value."""
    out = {}
    for line in (run_dir / "losses.jsonl").read_text().splitlines():
        record = json.loads(line)
        out[record["step"]] = record["loss"]
    return out


def zeros_like_state(state: dict) -> dict:
    """A template of ``state``: same nesting, zero tensors, 0 for other values."""
    return {
        k: zeros_like_state(v)
        if isinstance(v, dict)
        else torch.zeros_like(v)
        if isinstance(v, torch.Tensor)
        else 0
        for k, v in state.items()
    }


def assert_states_equal(a: dict, b: dict) -> None:
    """Same keys at every level, tensors bit-identical, other values equal."""
    assert a.keys() == b.keys()
    for k in a:
        if isinstance(a[k], dict):
            assert_states_equal(a[k], b[k])
        elif isinstance(a[k], torch.Tensor):
            assert torch.equal(a[k], b[k]), k
        else:
            assert a[k] == b[k], k
