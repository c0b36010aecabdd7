"""torchdata's ``StatefulDataLoader`` as the data-loader of a ``TrainState``.

Its state (nested dicts, the sampler generator as a ``uint8`` tensor, per-worker
snapshots) is saved like any other state: tensors in shard files, the rest in the JSON
tree. A checkpoint taken mid-epoch with worker processes resumes at the next batch.
"""

from __future__ import annotations

import pytest
import torch
from torchdata.stateful_dataloader import StatefulDataLoader
from torchdata.stateful_dataloader.sampler import RandomSampler

import shardpoint
from shardpoint import CheckpointManager, TrainState


class Numbers(torch.utils.data.Dataset):
    """Sample i: (i, a value drawn from a generator seeded by i). Randomness keyed by
    the sample, not by the worker's RNG stream, so it survives a resume (torchdata does
    not save the workers' RNG state)."""

    def __len__(self) -> int:
        return 103

    def __getitem__(self, i: int) -> torch.Tensor:
        g = torch.Generator().manual_seed(1000 + i)
        return torch.tensor([float(i), torch.rand((), generator=g).item()])


def _loader(num_workers: int = 2) -> StatefulDataLoader:
    # The sampler owns its generator: torchdata saves a sampler's generator, not the
    # loader's (with ``shuffle=True, generator=g`` the epoch after a resume differs).
    data = Numbers()
    sampler = RandomSampler(data, generator=torch.Generator().manual_seed(7))
    return StatefulDataLoader(data, batch_size=4, sampler=sampler, num_workers=num_workers)


def _epochs(loader: StatefulDataLoader, n: int) -> list[torch.Tensor]:
    return [b for _ in range(n) for b in loader]


@pytest.mark.parametrize("workers", [0, 2])
def test_a_mid_epoch_checkpoint_resumes_at_the_next_batch_and_the_next_epoch(tmp_path, workers):
    expected = _epochs(_loader(workers), 3)  # 26 batches per epoch
    loader = _loader(workers)
    seen = list(loader)  # the first epoch
    it = iter(loader)
    for _ in range(10):  # mid second epoch
        seen.append(next(it))
    manager = CheckpointManager(tmp_path, preemption_signals=())
    manager.save(10, TrainState(model=None, dataloader=loader, step=10), force=True)
    del it, loader

    resumed = _loader(workers)
    state = TrainState(dataloader=resumed)
    assert CheckpointManager(tmp_path, preemption_signals=()).restore(state) == 10
    rest = list(resumed) + list(resumed)  # the rest of epoch 2, then epoch 3
    got = seen + rest
    assert len(got) == len(expected)
    assert all(torch.equal(a, b) for a, b in zip(got, expected))


def test_the_loader_state_is_in_the_tree_and_its_generator_in_a_shard(tmp_path):
    loader = _loader(num_workers=0)
    it = iter(loader)
    next(it)
    shardpoint.save(TrainState(dataloader=loader), tmp_path / "ck")
    with shardpoint.open(tmp_path / "ck") as reader:
        generators = [k for k in reader.keys() if k.startswith("dataloader.") and "generator" in k]
        assert generators and reader.get(generators[0]).dtype == torch.uint8
    fresh = _loader(num_workers=0)
    shardpoint.load(TrainState(dataloader=fresh), tmp_path / "ck")
    assert torch.equal(next(iter(fresh)), _epochs(_loader(num_workers=0), 1)[1])
