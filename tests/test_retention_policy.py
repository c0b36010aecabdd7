"""RetentionPolicy on its own: a pure function from committed steps to the steps kept."""

from __future__ import annotations

import pytest

from shardpoint import RetentionPolicy
from shardpoint.training.retention import KeptCheckpoint


def _keep(policy: RetentionPolicy, steps: list[int], metrics: dict[int, float] | None = None):
    metrics = metrics or {}
    return policy.keep([KeptCheckpoint(s, metrics.get(s)) for s in steps])


def test_keep_last_keeps_the_newest_steps_whatever_their_order():
    assert _keep(RetentionPolicy(keep_last=2), [30, 10, 40, 20]) == {30, 40}


def test_keep_last_none_keeps_everything():
    assert _keep(RetentionPolicy(keep_last=None), [1, 2, 3]) == {1, 2, 3}


def test_the_newest_checkpoint_is_kept_even_when_no_rule_selects_it():
    policy = RetentionPolicy(keep_last=1, keep_best=1, best_metric="loss", mode="min")
    assert _keep(policy, [1, 2, 3], {1: 0.1, 2: 0.5, 3: 0.9}) == {1, 3}


def test_keep_every_n_steps_keeps_the_multiples_beside_the_newest():
    assert _keep(RetentionPolicy(keep_last=1, keep_every_n_steps=20), [10, 20, 30, 40, 50]) == {
        20,
        40,
        50,
    }


@pytest.mark.parametrize(("mode", "best"), [("min", {2, 4}), ("max", {1, 3})])
def test_keep_best_ranks_by_the_metric_in_the_chosen_direction(mode, best):
    policy = RetentionPolicy(keep_last=1, keep_best=2, best_metric="loss", mode=mode)
    metrics = {1: 0.9, 2: 0.1, 3: 0.8, 4: 0.2, 5: 0.5}
    assert _keep(policy, [1, 2, 3, 4, 5], metrics) == best | {5}


def test_keep_best_ignores_checkpoints_without_a_metric_or_with_nan():
    policy = RetentionPolicy(keep_last=1, keep_best=1, best_metric="loss")
    assert _keep(policy, [1, 2, 3, 4], {1: float("nan"), 3: 0.7}) == {3, 4}


def test_keep_best_prefers_the_newer_of_equal_metrics():
    policy = RetentionPolicy(keep_last=1, keep_best=1, best_metric="loss")
    assert _keep(policy, [1, 2, 3, 9], {1: 0.5, 2: 0.5, 3: 0.5, 9: 0.9}) == {3, 9}


def test_no_checkpoints_keep_nothing():
    assert _keep(RetentionPolicy(keep_last=3, keep_best=1, best_metric="loss"), []) == set()


def test_invalid_policies_are_refused_with_what_to_do():
    with pytest.raises(ValueError) as exc:
        RetentionPolicy(keep_last=0)
    assert str(exc.value) == "keep_last must be at least 1 (or None to keep all)"
    with pytest.raises(ValueError) as exc:
        RetentionPolicy(mode="median")
    assert str(exc.value) == "mode must be 'min' or 'max'"


def test_keep_last_good_keeps_the_newest_good_ones_behind_a_bad_streak():
    policy = RetentionPolicy(keep_last=2, keep_last_good=1)
    good = {1: True, 2: True, 3: False, 4: False}
    kept = policy.keep([KeptCheckpoint(s, None, good[s]) for s in good])
    assert kept == {2, 3, 4}
    assert RetentionPolicy(keep_last=2, keep_last_good=None).keep(
        [KeptCheckpoint(s, None, good[s]) for s in good]
    ) == {3, 4}


def test_keep_last_good_must_not_be_negative():
    with pytest.raises(ValueError, match="keep_last_good"):
        RetentionPolicy(keep_last_good=-1)
