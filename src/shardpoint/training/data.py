"""A data position that resumes without replaying data: (seed, epoch, global cursor).

Every epoch visits a permutation of the dataset fixed by ``(seed, epoch)``. The
position is one global cursor: how many samples of that permutation the training
loop (all ranks together) has consumed. Rank ``r`` of ``W`` takes the samples
``cursor + r, cursor + r + W, ...`` of what is left, so after ``k`` steps of batch size
``b`` the ranks together consumed exactly the first ``k*b*W`` samples. Resuming
computes the permutation and slices it at the cursor: the cost does not depend on the
position, no batch is fetched and thrown away, and a different world size continues
with the next unseen samples.
"""

from __future__ import annotations

import warnings
from collections.abc import Iterator, Sized
from typing import Any

import torch
from torch.utils.data import DataLoader, Dataset, Sampler


def _epoch_seed(seed: int, epoch: int) -> int:
    return (seed * 1_000_003 + epoch) % (2**63)


class ResumableSampler(Sampler[int]):
    """Indices for this rank, starting at the global cursor; see the module docstring.

    The tail of an epoch that does not divide evenly across ranks is skipped (as
    ``DistributedSampler(drop_last=True)``), so every rank runs the same number of steps.
    """

    def __init__(
        self,
        dataset_size: int,
        *,
        seed: int = 0,
        shuffle: bool = True,
        rank: int = 0,
        world_size: int = 1,
    ) -> None:
        if not 0 <= rank < world_size:
            raise ValueError(f"rank {rank} is outside world size {world_size}")
        self.dataset_size = dataset_size
        self.seed = seed
        self.shuffle = shuffle
        self.rank = rank
        self.world_size = world_size
        self.epoch = 0
        self.cursor = 0  # samples of this epoch's order consumed by all ranks together

    def order(self) -> torch.Tensor:
        """This epoch's global sample order (computed, never stored)."""
        if not self.shuffle:
            return torch.arange(self.dataset_size)
        g = torch.Generator().manual_seed(_epoch_seed(self.seed, self.epoch))
        return torch.randperm(self.dataset_size, generator=g)

    def per_rank(self) -> int:
        """How many samples each rank still gets this epoch."""
        return max(self.dataset_size - self.cursor, 0) // self.world_size

    def __len__(self) -> int:
        return self.per_rank()

    def __iter__(self) -> Iterator[int]:
        n = self.per_rank()
        start = self.cursor + self.rank
        mine = self.order()[start : start + n * self.world_size : self.world_size]
        for i in range(0, n, 65536):  # lazily: a 10M-sample epoch is not one Python list
            yield from mine[i : i + 65536].tolist()

    def state_dict(self) -> dict[str, Any]:
        return {
            "seed": self.seed,
            "epoch": self.epoch,
            "cursor": self.cursor,
            "dataset_size": self.dataset_size,
            "world_size": self.world_size,
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        if state["dataset_size"] != self.dataset_size or state["seed"] != self.seed:
            raise ValueError(
                f"data position was saved for a dataset of {state['dataset_size']} samples with "
                f"seed {state['seed']}; this sampler has {self.dataset_size} and seed {self.seed}"
            )
        if state["world_size"] != self.world_size:
            warnings.warn(
                f"data position saved with world size {state['world_size']}, resuming with "
                f"{self.world_size}: continuing from global sample {state['cursor']} of epoch "
                f"{state['epoch']}, so no sample of the epoch is repeated or skipped",
                stacklevel=2,
            )
        self.epoch = state["epoch"]
        self.cursor = state["cursor"]


class ResumableLoader:
    """A ``DataLoader`` whose position is what the training loop has consumed.

    Workers and prefetching fetch ahead; only batches handed to the loop advance the
    cursor, so a checkpoint taken between steps resumes at the next unseen batch.
    Iterating to the end of an epoch moves to the next epoch. Extra keyword arguments
    (``num_workers``, ``collate_fn``, ``pin_memory``...) go to ``DataLoader``; its
    worker seeds come from a generator fixed by ``(seed, epoch)``, never from the
    global RNG, so creating an iterator mid-run does not shift any random stream.

    >>> loader = ResumableLoader(list(range(10)), batch_size=4, seed=1)
    >>> sorted(i for batch in loader for i in batch.tolist())
    [0, 1, 2, 3, 4, 5, 6, 7, 8, 9]
    """

    def __init__(
        self,
        dataset: Dataset[Any],
        *,
        batch_size: int,
        seed: int = 0,
        shuffle: bool = True,
        rank: int = 0,
        world_size: int = 1,
        **loader_kwargs: Any,
    ) -> None:
        if not isinstance(dataset, Sized):
            raise TypeError("ResumableLoader needs a dataset with __len__ (a map-style dataset)")
        for reserved in ("sampler", "batch_sampler", "shuffle", "generator", "drop_last"):
            if reserved in loader_kwargs:
                raise TypeError(f"ResumableLoader sets {reserved!r} itself")
        self.dataset = dataset
        self.batch_size = batch_size
        self.sampler = ResumableSampler(
            len(dataset), seed=seed, shuffle=shuffle, rank=rank, world_size=world_size
        )
        self.loader_kwargs = loader_kwargs

    @property
    def epoch(self) -> int:
        return self.sampler.epoch

    def __len__(self) -> int:
        """Batches left in the current epoch for this rank."""
        return -(-self.sampler.per_rank() // self.batch_size)

    def __iter__(self) -> Iterator[Any]:
        s = self.sampler
        total = s.per_rank()
        generator = torch.Generator().manual_seed(_epoch_seed(s.seed, s.epoch))
        loader = DataLoader(
            self.dataset,
            batch_size=self.batch_size,
            sampler=s,
            generator=generator,
            **self.loader_kwargs,
        )
        start = s.cursor
        taken = 0
        for batch in loader:
            taken = min(taken + self.batch_size, total)
            s.cursor = start + taken * s.world_size
            yield batch
        s.epoch += 1
        s.cursor = 0

    def skip_batches(self, n: int) -> None:
        """Move the position past the next ``n`` batches of every rank, as if the loop had
        taken them (into later epochs if need be): a rollback's skipped bad batches."""
        s = self.sampler
        for _ in range(n):
            if s.per_rank() == 0:  # the epoch was used up: its next batch is the next epoch's
                s.epoch += 1
                s.cursor = 0
            s.cursor += min(self.batch_size, s.per_rank()) * s.world_size

    def state_dict(self) -> dict[str, Any]:
        return self.sampler.state_dict()

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.sampler.load_state_dict(state)
