"""The data position resumes exactly, in O(1), on the same or a different world size."""

import warnings

import pytest
import torch

from shardpoint import ResumableLoader, ResumableSampler


class Squares(torch.utils.data.Dataset):
    def __len__(self):
        return 103

    def __getitem__(self, i):
        return torch.tensor([i, i * i])


def _take(loader, n):
    out = []
    for batch in loader:
        out.append(batch[:, 0].tolist())
        if len(out) == n:
            break
    return out


@pytest.mark.parametrize("num_workers", [0, 2])
def test_mid_epoch_resume_gives_the_same_batches_as_an_uninterrupted_run(num_workers):
    full = ResumableLoader(Squares(), batch_size=8, seed=5, num_workers=num_workers)
    expected = _take(full, 12) + _take(
        full, 5
    )  # 12 = one epoch of 103 // 8 (+1 partial), then more

    first = ResumableLoader(Squares(), batch_size=8, seed=5, num_workers=num_workers)
    got = _take(first, 7)  # stop mid-epoch, as a crash after step 7 would
    state = first.state_dict()
    resumed = ResumableLoader(Squares(), batch_size=8, seed=5, num_workers=num_workers)
    resumed.load_state_dict(state)
    got += _take(resumed, 5) + _take(resumed, 5)
    assert got == expected


def test_epochs_reshuffle_and_cover_every_sample():
    loader = ResumableLoader(Squares(), batch_size=10, seed=1)
    epoch0 = [i for b in loader for i in b[:, 0].tolist()]
    epoch1 = [i for b in loader for i in b[:, 0].tolist()]
    assert sorted(epoch0) == sorted(epoch1) == list(range(103))
    assert epoch0 != epoch1 and loader.epoch == 2


def _run_ranks(samplers, steps, batch):
    """What `steps` steps consume on each rank, and the global cursor afterwards."""
    seen = []
    for s in samplers:
        seen += list(s)[: steps * batch]
    cursor = samplers[0].cursor + steps * batch * samplers[0].world_size
    return seen, cursor


@pytest.mark.parametrize("before, after", [(2, 1), (1, 2), (2, 4), (4, 3)])
def test_a_different_world_size_continues_with_unseen_samples(before, after):
    n, batch = 1000, 4
    old = [ResumableSampler(n, seed=3, rank=r, world_size=before) for r in range(before)]
    seen, cursor = _run_ranks(old, steps=30, batch=batch)
    state = old[0].state_dict()
    state["cursor"] = cursor
    new = [ResumableSampler(n, seed=3, rank=r, world_size=after) for r in range(after)]
    with pytest.warns(UserWarning, match=f"world size {before}, resuming with {after}"):
        for s in new:
            s.load_state_dict(state)
    rest = [i for s in new for i in s]
    assert not set(seen) & set(rest)  # nothing repeated
    assert len(seen) + len(rest) == n - (n - cursor) % after  # nothing skipped but the uneven tail
    assert len(set(seen) | set(rest)) == len(seen) + len(rest)


def test_same_world_size_resumes_silently():
    s = ResumableSampler(50, seed=0, world_size=1)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        ResumableSampler(50, seed=0).load_state_dict(s.state_dict())


def test_a_position_from_another_dataset_is_refused():
    with pytest.raises(ValueError, match="dataset of 50 samples"):
        ResumableSampler(60).load_state_dict(ResumableSampler(50).state_dict())


def test_resuming_does_not_touch_the_global_rng():
    torch.manual_seed(0)
    before = torch.get_rng_state()
    loader = ResumableLoader(Squares(), batch_size=8, seed=2, num_workers=2)
    _take(loader, 3)
    assert torch.equal(torch.get_rng_state(), before)
