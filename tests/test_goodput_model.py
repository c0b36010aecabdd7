"""bench/goodput_model.py: the first-order ETTR model, Young/Daly intervals, the campaign
file's checks and the command line (pure arithmetic, no torch)."""

from __future__ import annotations

import importlib.util
import json
import math
import re
import sys
from pathlib import Path

import pytest

BENCH = Path(__file__).resolve().parents[1] / "bench"
EXAMPLE = BENCH / "goodput_example_campaign.json"

_spec = importlib.util.spec_from_file_location("goodput_model", BENCH / "goodput_model.py")
gm = importlib.util.module_from_spec(_spec)
sys.modules["goodput_model"] = gm  # dataclasses look their module up while the file runs
_spec.loader.exec_module(gm)


def one_tier(stall_s=0.5, restore_s=3.0, persist_s=1.0, step=2.0):
    return gm.Costs(step, {"memory": gm.TierCosts(stall_s, restore_s, persist_s)})


def test_without_failures_ettr_is_one_minus_the_stall_fraction():
    costs = gm.Costs(1.0, {"memory": gm.TierCosts(0.1, 0.0), "local": gm.TierCosts(2.0, 0.0)})
    prediction = gm.predict(costs, [], {"memory": 1, "local": 10})
    stall_per_step = 0.1 / 1 + 2.0 / 10  # seconds of stall per 1 s step
    stall_fraction = stall_per_step / (1.0 + stall_per_step)
    assert prediction.badput == pytest.approx(
        {"save_stall": stall_fraction, "lost_work": 0.0, "restart_restore": 0.0}
    )
    assert prediction.ettr == pytest.approx(1 - stall_fraction)


def test_one_failure_kind_costs_restart_restore_and_half_an_interval_plus_the_persist_lag():
    failure = gm.FailureKind("process", "memory", restart_s=20.0, mtbf_s=1000.0)
    prediction = gm.predict(one_tier(), [failure], {"memory": 5})
    # By hand: stall 0.5 s per 5 steps = 0.1 s per 2 s step; restart + restore
    # (20 + 3) / 1000 = 0.023 of wall time; lost 5/2 steps + 1 s persist / 2 s = 3 steps
    # = 6 s per 1000 s = 0.006; ETTR = (1 - 0.023) * 2 / 2.1 - 0.006.
    assert prediction.badput["restart_restore"] == pytest.approx(0.023)
    assert prediction.badput["lost_work"] == pytest.approx(0.006)
    assert prediction.badput["save_stall"] == pytest.approx(0.977 * 0.1 / 2.1)
    assert prediction.ettr == pytest.approx(0.92447619, abs=1e-8)


def test_ettr_and_the_badput_buckets_sum_to_the_wall_time():
    failures = [
        gm.FailureKind("node", "memory", restart_s=300.0, mtbf_s=7000.0),
        gm.FailureKind("corruption", "local", restart_s=60.0, mtbf_s=90000.0),
        gm.FailureKind("store_stall", None, restart_s=0.0, mtbf_s=50000.0),
    ]
    costs = gm.Costs(1.5, {"memory": gm.TierCosts(0.2, 1.0), "local": gm.TierCosts(1.0, 5.0)})
    prediction = gm.predict(costs, failures, {"memory": 40, "local": 400})
    assert prediction.ettr + sum(prediction.badput.values()) == pytest.approx(1.0)
    assert prediction.badput_s_per_hour["restart_restore"] == pytest.approx(
        3600 * (301 / 7000 + 65 / 90000)
    )


def test_a_preemption_saved_in_its_grace_loses_no_work():
    preemption = gm.FailureKind(
        "preemption", "memory", restart_s=10.0, mtbf_s=1000.0, lost_steps=0.0
    )
    assert gm.lost_steps_by_default("preemption") == 0.0
    assert gm.predict(one_tier(), [preemption], {"memory": 50}).badput["lost_work"] == 0.0


def test_young_daly_interval_is_the_closed_form_against_the_failures_its_tier_restores():
    costs = gm.Costs(
        2.0,
        {"memory": gm.TierCosts(4.0, 1.0), "local": gm.TierCosts(9.0, 5.0, persist_s=30.0)},
    )
    failures = [
        gm.FailureKind("process", "memory", restart_s=60.0, mtbf_s=3 * 7200.0),
        gm.FailureKind("node", "memory", restart_s=300.0, mtbf_s=1.5 * 7200.0),
        # Neither changes memory's interval: a preemption loses nothing whatever it is,
        # and corruption is the local tier's.
        gm.FailureKind("preemption", "memory", restart_s=300.0, mtbf_s=600.0, lost_steps=0.0),
        gm.FailureKind("corruption", "local", restart_s=60.0, mtbf_s=50.0),
    ]
    best = gm.best_intervals(costs, failures)
    # memory: 1/3 + 2/3 of one failure per 7200 s -> sqrt(2 * 4 * 7200) = 240 s = 120 steps.
    assert best["memory"].seconds == pytest.approx(math.sqrt(2 * 4.0 * 7200.0))
    assert best["memory"].steps == 120
    # local: sqrt(2 * 9 * 50) = 30 s, and its copies take 30 s to persist: 15 steps.
    assert best["local"] == gm.BestInterval(15, pytest.approx(30.0))


def test_an_interval_is_never_shorter_than_its_persist_time_and_at_least_one_step():
    costs = gm.Costs(10.0, {"remote": gm.TierCosts(0.0, 5.0, persist_s=45.0)})
    failure = gm.FailureKind("node", "remote", restart_s=60.0, mtbf_s=10.0)
    assert gm.best_intervals(costs, [failure])["remote"] == gm.BestInterval(4, 45.0)
    costs = gm.Costs(10.0, {"memory": gm.TierCosts(0.0, 1.0)})
    failure = gm.FailureKind("node", "memory", restart_s=60.0, mtbf_s=10.0)
    assert gm.best_intervals(costs, [failure])["memory"].steps == 1


def test_a_tier_no_failure_restores_from_has_no_best_interval():
    costs = gm.Costs(1.0, {"memory": gm.TierCosts(0.1, 1.0), "remote": gm.TierCosts(1.0, 9.0)})
    failure = gm.FailureKind("node", "memory", restart_s=60.0, mtbf_s=3600.0)
    assert gm.best_intervals(costs, [failure])["remote"] is None


def test_doubling_the_mtbf_raises_the_ettr():
    def ettr(mtbf_s):
        failure = gm.FailureKind("node", "memory", restart_s=120.0, mtbf_s=mtbf_s)
        return gm.predict(one_tier(), [failure], {"memory": 10}).ettr

    assert ettr(2 * 6480.0) > ettr(6480.0)


def test_the_restart_budget_reaches_the_goal_exactly():
    costs = one_tier()
    failure = gm.FailureKind("node", "memory", restart_s=100.0, mtbf_s=20000.0)
    budget = gm.restart_budget_s(costs, [failure], {"memory": 50}, goal=0.95)
    # Restart + restore at the budget: the restore (3 s) is part of it.
    at_budget = gm.FailureKind("node", "memory", restart_s=budget - 3.0, mtbf_s=20000.0)
    assert gm.predict(costs, [at_budget], {"memory": 50}).ettr == pytest.approx(0.95)
    assert gm.restart_budget_s(costs, [failure], {"memory": 1}, goal=0.95) is None


def test_a_failure_kind_needs_exactly_one_of_rate_and_mtbf():
    with pytest.raises(ValueError, match="exactly one"):
        gm.FailureKind("node", "memory", restart_s=1.0)
    assert gm.FailureKind("node", "memory", restart_s=1.0, rate_per_s=0.5).rate == 0.5


def test_the_example_campaign_has_one_kind_per_kind_and_tier_at_its_own_rates():
    campaign = gm.read_campaign(EXAMPLE)
    failures = gm.campaign_failures(campaign)
    assert sum(f.rate for f in failures) * campaign["wall_s"] == pytest.approx(
        len(campaign["failures"])
    )
    (store_stall,) = [f for f in failures if f.tier is None]
    assert store_stall.name == "store_stall"
    assert all(f.lost_steps == 0 for f in failures if f.name.startswith("preemption"))
    assert "not a measurement" in campaign["note"].lower()


def test_the_command_line_prints_the_campaign_and_the_scale_tables(tmp_path, capsys):
    out = tmp_path / "model.json"
    assert gm.main(["--campaign", str(EXAMPLE), "--json", str(out)]) == 0
    printed = capsys.readouterr().out
    assert "measured" in printed and "predicted" in printed
    for gpus in ("1,024", "16,384", "131,072"):
        assert gpus in printed
    result = json.loads(out.read_text())
    assert [plan["gpus"] for plan in result["scales"]] == [1024, 16384, 131072]
    ettrs = [plan["ettr"] for plan in result["scales"]]
    assert ettrs == sorted(ettrs, reverse=True)  # more GPUs, more failures
    assert result["campaign"]["measured"]["ettr"] == json.loads(EXAMPLE.read_text())["ettr"]


def test_a_campaign_missing_a_key_is_an_error_naming_it(tmp_path, capsys):
    campaign = json.loads(EXAMPLE.read_text())
    del campaign["tiers"]["local"]["restore_s"]
    path = tmp_path / "campaign.json"
    path.write_text(json.dumps(campaign))
    with pytest.raises(gm.CampaignError, match=r"missing key 'tiers\.local\.restore_s'"):
        gm.read_campaign(path)
    assert gm.main(["--campaign", str(path)]) == 2
    assert "tiers.local.restore_s" in capsys.readouterr().err


@pytest.mark.parametrize(
    "edit, named",
    [
        (lambda c: c["failures"][0].pop("steps_lost"), "failures[0].steps_lost"),
        (lambda c: c["failures"][1].update(kind="meteor"), "failures[1].kind"),
        (lambda c: c["intervals"].update(memory="2"), "intervals.memory"),
        (lambda c: c["failures"][2].update(kind="store_stall", tier="local"), "failures[2].tier"),
    ],
    ids=["missing", "unknown-kind", "wrong-type", "store-stall-with-a-tier"],
)
def test_a_bad_failure_record_or_value_is_an_error_naming_it(tmp_path, edit, named):
    campaign = json.loads(EXAMPLE.read_text())
    edit(campaign)
    path = tmp_path / "campaign.json"
    path.write_text(json.dumps(campaign))
    with pytest.raises(gm.CampaignError, match=re.escape(named)):
        gm.read_campaign(path)


def test_a_shorter_restart_flag_raises_the_ettr_at_scale(tmp_path):
    def ettr_at_16k(*flags):
        out = tmp_path / "model.json"
        assert gm.main(["--campaign", str(EXAMPLE), "--json", str(out), *flags]) == 0
        (plan,) = [p for p in json.loads(out.read_text())["scales"] if p["gpus"] == 16384]
        return plan["ettr"]

    assert ettr_at_16k("--restart-s", "node=60") > ettr_at_16k()
