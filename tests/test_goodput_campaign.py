"""The whole stack through mixed failures on torch's own elastic agent (bench/bench_goodput.py):
2 nodes x 2 ranks, ``torchrun --max-restarts --rdzv-backend=c10d``, the memory tier,
node-local disks and an S3 remote; a SIGKILLed rank, a lost node, a preemption, a
corrupt newest checkpoint with host memory gone, and a stalled object store. The job
ends bit-identical to one that never failed, each failure loses no more than the
interval of the tier it restored from, and the goodput model predicts what was measured.
bench/bench_goodput.py runs the 20-failure campaign docs/benchmarks.md reports.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "bench"))
import bench_goodput  # noqa: E402
import goodput_model  # noqa: E402

pytestmark = pytest.mark.slow

CONFIG = bench_goodput.Config(failures=5, seed=1)  # every kind once
# The tier each kind may restore from (a preemption's final save may be on disk or in
# memory; a corrupt local copy is replaced by the remote's or an older one).
TIERS = {
    "process": {"memory"},
    "node": {"memory"},
    "preemption": {"memory", "local"},
    "corruption": {"local", "remote"},
    "store_stall": {None},
}


@pytest.fixture(scope="module")
def jobs(tmp_path_factory) -> tuple[dict, dict]:
    root = tmp_path_factory.mktemp("goodput")
    reference = bench_goodput.run_job(root / "reference", CONFIG, failures=False)
    campaign = bench_goodput.run_job(root / "campaign", CONFIG, failures=True)
    return reference, campaign


def test_a_campaign_of_mixed_failures_ends_bit_identical_to_an_uninterrupted_run(jobs):
    reference, campaign = jobs
    assert sorted(f["kind"] for f in campaign["failures"]) == sorted(bench_goodput.MIX)
    assert bench_goodput.compare(campaign, reference) == []
    assert campaign["leaked_dev_shm"] == []


def test_each_failure_restores_from_its_tier_and_loses_at_most_that_tiers_interval(jobs):
    _, campaign = jobs
    interval = {"memory": CONFIG.memory_every, "local": CONFIG.save_every}
    interval["remote"] = CONFIG.save_every
    for f in campaign["failures"]:
        assert f["tier"] in TIERS[f["kind"]], f
        if f["kind"] == "corruption":
            # The newest step is unusable: the remote's copy of it when its upload had
            # finished, else the step before, one interval more.
            assert f["steps_lost"] <= 2 * interval[f["tier"]], f
        elif f["tier"] is not None:
            assert f["steps_lost"] <= interval[f["tier"]], f
        if f["kind"] == "preemption":
            assert f["steps_lost"] == 0, f  # saved within its grace


def test_the_goodput_model_predicts_the_measured_ettr(jobs, tmp_path):
    _, campaign = jobs
    path = tmp_path / "campaign.json"
    path.write_text(json.dumps(bench_goodput.result_json(campaign)))
    read = goodput_model.read_campaign(path)  # the schema the model checks
    predicted = goodput_model.predict(
        goodput_model.campaign_costs(read),
        goodput_model.campaign_failures(read),
        dict(read["intervals"]),
    )
    assert abs(predicted.ettr - campaign["ettr"]) <= 0.03, (predicted, campaign["ettr"])
