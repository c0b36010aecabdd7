"""torchdata's ``StatefulDataLoader`` as the data-loader of a ``TrainState``.

Its state (nested dicts, the sampler generator as a ``uint8`` tensor, per-worker
snapshots) is saved like any other state: tensors in shard files, the rest in the JSON
tree. A checkpoint taken mid-epoch with worker processes resumes at the next batch.
"""

from __future__ import annotations

import torch
from torchdata.stateful_dataloader import StatefulDataLoader

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
    return StatefulDataLoader(
        Numbers(),
        batch_size=4,
        shuffle=True,
        num_workers=num_workers,
        generator=torch.Generator().manual_seed(7),
    )


def _epochs(loader: StatefulDataLoader, n: int) -> list[torch.Tensor]:
    return [b for _ in range(n) for b in loader]


def test_a_mid_epoch_checkpoint_with_workers_resumes_at_the_next_batch(tmp_path):
    expected = _epochs(_loader(), 2)  # 26 batches per epoch
    loader = _loader()
    seen = []
    it = iter(loader)
    for _ in range(10):  # mid first epoch
        seen.append(next(it))
    manager = CheckpointManager(tmp_path, preemption_signals=())
    manager.save(10, TrainState(model=None, dataloader=loader, step=10), force=True)
    del it, loader

    resumed = _loader()
    state = TrainState(dataloader=resumed)
    assert CheckpointManager(tmp_path, preemption_signals=()).restore(state) == 10
    rest = list(resumed) + list(resumed)  # the rest of epoch 1, then epoch 2
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
