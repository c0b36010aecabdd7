"""RNG streams: captured and restored exactly; re-derived by rule for new ranks."""

import random

import numpy as np
import pytest
import torch

from shardpoint.training.rng import capture_rng, restore_rng
from shardpoint.training.train_state import _stream_source, streams_for


def _draw() -> tuple:
    return random.random(), float(np.random.rand()), torch.rand(1).item()


def test_restore_replays_every_stream():
    random.seed(1)
    np.random.seed(2)
    torch.manual_seed(3)
    saved = capture_rng()
    first = _draw()
    _draw()
    restore_rng(saved)
    assert _draw() == first


def test_a_new_rank_gets_reproducible_streams_of_its_own():
    torch.manual_seed(0)
    saved = {0: capture_rng(), 1: capture_rng()}
    with pytest.warns(UserWarning, match="saved on 2 ranks and are restored on 1"):
        assert _stream_source(0, [0, 1]) == 0  # its own, read alone
    assert [_stream_source(r, [0, 1]) for r in (2, 3)] == [0, 1]  # rank % old world
    restore_rng(streams_for(0, saved))
    rank0 = _draw()
    restore_rng(streams_for(2, saved))  # rank 2 did not exist when this was saved
    rank2 = _draw()
    restore_rng(streams_for(3, saved))
    rank3 = _draw()
    restore_rng(streams_for(2, saved))
    assert _draw() == rank2  # the same rule gives the same streams again
    assert len({rank0, rank2, rank3}) == 3  # and every rank has its own
