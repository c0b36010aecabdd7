"""The undo copy of an atomic load taken into a staging pool's slots (an async saver's):
still all or nothing, the slots handed back warm, and the pool reused, not grown, by
the loads and saves after it."""

from __future__ import annotations

import os

import pytest
import torch

import shardpoint
from shardpoint import CheckpointManager
from shardpoint.checkpoint_dir import open_committed
from shardpoint.errors import CorruptCheckpointError
from shardpoint.staging import SLOT_BYTES, StagingPool


def _state(seed: int) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    # 13 tensors of uneven sizes: undo pieces straddle the 16 MiB slots.
    sizes = [3 * 1024**2 + 17 * i for i in range(12)] + [40_000]
    return {f"t{i}": torch.randn(n // 4, generator=g) for i, n in enumerate(sizes)}


def _corrupt(path, name: str) -> None:
    chunk = open_committed(path).index.entries[name].chunks[0]
    data = path / chunk.file
    raw = bytearray(data.read_bytes())
    raw[chunk.end - 5] ^= 0xFF
    data.write_bytes(bytes(raw))


@pytest.mark.parametrize("capacity", [None, SLOT_BYTES])
def test_a_failed_load_into_pool_slots_puts_every_tensor_back(tmp_path, capacity):
    """``capacity`` of one slot: the rest of the undo copy falls back to fresh memory."""
    path = tmp_path / "ckpt"
    shardpoint.save(_state(0), path)
    _corrupt(path, "t12")  # the last tensor: read in the last batch
    pool = StagingPool(capacity)
    live = _state(1)
    before = {k: v.clone() for k, v in live.items()}
    with pytest.raises(CorruptCheckpointError, match="checksum mismatch"):
        shardpoint.load(live, path, undo_pool=pool)
    assert all(torch.equal(live[k], before[k]) for k in live)
    assert pool.nbytes > 0 and pool._free.qsize() == pool.nbytes // SLOT_BYTES  # all back


def test_loads_into_a_pool_reuse_its_slots_and_a_save_after_them_too(tmp_path):
    path = tmp_path / "ckpt"
    state = _state(0)
    shardpoint.save(state, path)
    saver = shardpoint.AsyncSaver()
    pool = saver.pool
    state_bytes = sum(t.numel() * 4 for t in state.values())
    for _ in range(2):
        live = _state(1)
        shardpoint.load(live, path, undo_pool=pool)
        assert all(torch.equal(live[k], state[k]) for k in state)
        grown = pool.nbytes
        assert pool._free.qsize() == grown // SLOT_BYTES  # every slot handed back
        # Each undo thread fills a slot of its own: at most one partly used per thread.
        assert state_bytes <= grown <= state_bytes + ((os.cpu_count() or 2) + 1) * SLOT_BYTES
    assert pool.nbytes == grown  # the second load borrowed the first one's slots
    saver.save(live, tmp_path / "again").wait()
    # The save staged in the warm slots (its files hold headers too: a slot more at most).
    assert pool.nbytes <= grown + SLOT_BYTES


def test_the_manager_takes_a_restores_undo_copy_into_its_savers_pool(tmp_path):
    state = _state(0)
    CheckpointManager(tmp_path / "run", preemption_signals=()).save(3, state, force=True)
    manager = CheckpointManager(tmp_path / "run", async_save=True, preemption_signals=())
    live = _state(1)
    assert manager.restore(live) == 3
    assert all(torch.equal(live[k], state[k]) for k in state)
    pool = manager.restorer.undo_pool
    assert pool is not None and pool.nbytes >= sum(t.numel() * 4 for t in state.values())
    assert pool._free.qsize() == pool.nbytes // SLOT_BYTES
    manager.close()
