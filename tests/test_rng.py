"""RNG streams: captured and restored exactly; re-derived by rule for new ranks."""

import random

import numpy as np
import pytest
import torch

import shardpoint
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


def _save_streams(rank: int, world: int, path: str) -> None:
    import json

    torch.manual_seed(100 + rank)
    shardpoint.save(shardpoint.TrainState(model=torch.nn.Linear(3, 2), step=5), path)
    drawn = torch.rand(3).tolist()  # what each rank draws next, saved alongside
    with open(f"{path}-drawn-{rank}.json", "w") as f:
        json.dump(drawn, f)


def _load_streams_on_more_ranks(rank: int, world: int, path: str) -> None:
    import json

    torch.manual_seed(7)  # the fresh run's own streams: restoring must replace them
    state = shardpoint.TrainState(model=torch.nn.Linear(3, 2))
    shardpoint.load(state, path)  # strict: a rank the saved run lacked is not "missing"
    assert state.step == 5
    drawn = torch.rand(3).tolist()
    saved = [json.load(open(f"{path}-drawn-{r}.json")) for r in range(2)]
    torch.manual_seed(7)
    torch.nn.Linear(3, 2)  # the fresh run's streams as the load found them
    fresh = torch.rand(3).tolist()
    if rank < 2:
        assert drawn == saved[rank]  # its own streams back
    else:  # rank 0's streams reseeded with its own rank: neither a copy nor its own
        assert drawn not in saved and drawn != fresh


@pytest.mark.slow
def test_rng_streams_saved_on_2_ranks_load_on_3(tmp_path):
    """A rank the saved run did not have takes saved rank ``rank % old``'s streams,
    reseeded; it used to fail with 'missing from the checkpoint: rng.2' (and, with
    strict=False, kept the fresh run's streams)."""
    from distributed import run_ranks

    path = str(tmp_path / "ckpt")
    run_ranks(2, _save_streams, path)
    run_ranks(3, _load_streams_on_more_ranks, path)
