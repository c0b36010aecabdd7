"""Multi-process save/load on CPU/gloo: per-rank writes, balanced replicas, resharding."""

from __future__ import annotations

import json
import math
import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from conftest import read_losses
from distributed import _free_port, run_ranks
from safetensors.torch import load_file, save_file
from torch import nn

import shardpoint
from shardpoint.checkpoint_dir import open_committed
from shardpoint.format.index import INDEX_NAME, MARKER_NAME
from shardpoint.loading import ReadPlan

pytestmark = pytest.mark.slow


def _ddp_model() -> nn.Module:
    torch.manual_seed(0)  # the same weights on every rank, as DDP keeps them
    return nn.Sequential(nn.Linear(1024, 2048), nn.Linear(2048, 1024), nn.LayerNorm(1024))


def _ddp_save(rank: int, world: int, path: str) -> None:
    model = _ddp_model()
    state = {"model": model, "ranks": {rank: torch.full((3,), float(rank))}, "step": 5}
    shardpoint.save(state, path)


def _ddp_load(rank: int, world: int, path: str) -> None:
    torch.manual_seed(rank + 100)
    model = nn.Sequential(nn.Linear(1024, 2048), nn.Linear(2048, 1024), nn.LayerNorm(1024))
    state = {"model": model, "ranks": {rank: torch.zeros(3)}, "step": 0}
    shardpoint.load(state, path, strict=False)  # other ranks' entries are not ours
    for a, b in zip(model.state_dict().values(), _ddp_model().state_dict().values()):
        assert torch.equal(a, b)
    assert state["ranks"][rank].tolist() == [float(rank)] * 3 and state["step"] == 5


def _written_per_rank(path: Path) -> dict[int, int]:
    index = json.loads((path / INDEX_NAME).read_text())
    out: dict[int, int] = {}
    for entry in index["tensors"].values():
        for c in entry.get("chunks", []):
            rank = int(re.match(r"rank(\d+)-", c["file"]).group(1))
            out[rank] = out.get(rank, 0) + c["byte_range"][1] - c["byte_range"][0]
    return out


def test_ddp_replicas_are_written_once_and_balanced(tmp_path):
    path = tmp_path / "ckpt"
    run_ranks(2, _ddp_save, str(path))
    index = json.loads((path / INDEX_NAME).read_text())
    assert index["world_size"] == 2
    total = sum(p.numel() * 4 for p in _ddp_model().parameters()) + 2 * 3 * 4
    per_rank = _written_per_rank(path)
    assert sum(per_rank.values()) == total  # every byte exactly once
    mean = total / 2
    assert max(per_rank.values()) <= 1.1 * mean, per_rank
    assert {int(f[4:9]) for f in index["files"]} == {0, 1}  # each rank wrote its own files
    # loads on 1 process (assembling the split pieces) and on 2
    model = nn.Sequential(nn.Linear(1024, 2048), nn.Linear(2048, 1024), nn.LayerNorm(1024))
    shardpoint.load({"model": model}, path, strict=False)
    for a, b in zip(model.state_dict().values(), _ddp_model().state_dict().values()):
        assert torch.equal(a, b)
    run_ranks(2, _ddp_load, str(path))
    assert shardpoint.verify(path).ok


class MLP(nn.Module):
    def __init__(self, dropout: float = 0.0) -> None:
        super().__init__()
        self.a = nn.Linear(16, 40)  # 40 rows: uneven shards on 3 ranks
        self.drop = nn.Dropout(dropout)
        self.b = nn.Linear(40, 22)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.b(self.drop(torch.relu(self.a(x))))


def _fsdp(world: int, dropout: float = 0.0) -> tuple[nn.Module, torch.optim.Optimizer]:
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    torch.manual_seed(0)
    model = MLP(dropout)
    if world > 1:
        mesh = init_device_mesh("cpu", (world,))
        fully_shard(model.a, mesh=mesh)
        fully_shard(model, mesh=mesh)
    return model, torch.optim.AdamW(model.parameters(), lr=0.01)


def _train(model: nn.Module, opt: torch.optim.Optimizer, steps: int) -> list[float]:
    """``steps`` steps on batches drawn from the global torch RNG (as random crops or
    noise would be), which also draws the dropout masks."""
    losses = []
    for _ in range(steps):
        x = torch.randn(8, 16)
        loss = model(x).pow(2).mean()
        opt.zero_grad()
        loss.backward()
        opt.step()
        losses.append(loss.item())
    return losses


def _full_state(model: nn.Module, opt: torch.optim.Optimizer) -> dict[str, torch.Tensor]:
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_state_dict

    msd, osd = get_state_dict(model, opt, options=StateDictOptions(full_state_dict=True))
    out = {f"model.{k}": v for k, v in msd.items()}
    for fqn, s in osd["state"].items():
        for k in ("exp_avg", "exp_avg_sq"):
            out[f"optim.{fqn}.{k}"] = s[k]
    return {k: v.detach().clone().contiguous() for k, v in out.items()}


def _fsdp_save(rank: int, world: int, path: str, ref: str) -> None:
    model, opt = _fsdp(world)
    _train(model, opt, 2)
    shardpoint.save({"train": shardpoint.TrainState(model=model, optimizer=opt)}, path)
    full = _full_state(model, opt)
    if rank == 0:
        save_file(full, ref)


def _fsdp_load(rank: int, world: int, path: str, ref: str) -> None:
    model, opt = _fsdp(world)
    torch.manual_seed(1234)  # different weights before loading
    for p in model.parameters():
        with torch.no_grad():
            p.mul_(0.5)
    with (
        pytest.warns(UserWarning, match="RNG streams were saved on 4 ranks")
        if (rank == 0 and world != 4)
        else _no_warning()
    ):
        shardpoint.load({"train": shardpoint.TrainState(model=model, optimizer=opt)}, path)
    got = _full_state(model, opt)
    want = load_file(ref)
    assert got.keys() == want.keys()
    for k in want:
        assert torch.equal(got[k], want[k]), k


class _no_warning:
    def __enter__(self) -> None:
        return None

    def __exit__(self, *a: object) -> None:
        return None


@pytest.fixture(scope="module")
def fsdp_ckpt(tmp_path_factory) -> tuple[Path, Path]:
    root = tmp_path_factory.mktemp("fsdp")
    path, ref = root / "ckpt", root / "reference.safetensors"
    run_ranks(4, _fsdp_save, str(path), str(ref))
    return path, ref


@pytest.mark.parametrize("world", [2, 3])
def test_fsdp2_saved_on_4_ranks_loads_on_fewer(fsdp_ckpt, world):
    path, ref = fsdp_ckpt
    run_ranks(world, _fsdp_load, str(path), str(ref))


def test_fsdp2_saved_on_4_ranks_loads_in_one_process(fsdp_ckpt):
    path, ref = fsdp_ckpt
    model, opt = _fsdp(1)
    with pytest.warns(UserWarning, match="RNG streams were saved on 4 ranks"):
        shardpoint.load({"train": shardpoint.TrainState(model=model, optimizer=opt)}, path)
    got, want = _full_state(model, opt), load_file(str(ref))
    assert all(torch.equal(got[k], want[k]) for k in want)


def test_fsdp2_checkpoint_has_one_chunk_per_shard(fsdp_ckpt):
    path, _ = fsdp_ckpt
    with shardpoint.open(path) as r:
        weight = r.entry("train.model.a.weight")
        assert weight.shape == (40, 16)
        assert [c.offsets[0] for c in weight.chunks] == [0, 10, 20, 30]
        assert torch.equal(
            r.get("train.model.a.weight"),
            load_file(str(path.parent / "reference.safetensors"))["model.a.weight"],
        )


def _fsdp_resume(rank: int, world: int, path: str, out: str) -> None:
    """Train 2 steps with dropout, save, train 3 more; then a fresh job (weights and RNG
    back at their initial state) loads and trains the same 3 — and, to show the losses
    depend on the RNG streams, one more that loads without restoring them."""
    model, opt = _fsdp(world, dropout=0.5)
    torch.manual_seed(100 + rank)  # each rank its own stream of batches and dropout masks
    _train(model, opt, 2)
    shardpoint.save({"train": shardpoint.TrainState(model=model, optimizer=opt)}, path)
    losses = {"straight": _train(model, opt, 3)}
    for run, restore_rng in (("resumed", True), ("resumed_without_rng", False)):
        model2, opt2 = _fsdp(world, dropout=0.5)
        train = shardpoint.TrainState(model=model2, optimizer=opt2, capture_rng_state=restore_rng)
        shardpoint.load({"train": train}, path)
        losses[run] = _train(model2, opt2, 3)
    Path(f"{out}.rank{rank}").write_text(json.dumps(losses))


def test_fsdp2_training_continues_bit_identical_on_the_same_world_size(tmp_path):
    """Dropout masks and batches come from each rank's global RNG: the losses match only
    if the checkpoint gave every rank its own streams back."""
    out = tmp_path / "losses.json"
    run_ranks(2, _fsdp_resume, str(tmp_path / "ckpt"), str(out))
    for rank in range(2):
        losses = json.loads(Path(f"{out}.rank{rank}").read_text())
        assert losses["resumed_without_rng"] != losses["straight"], rank  # the RNG matters
        assert losses["resumed"] == losses["straight"], rank


def _mesh_2d_save(rank: int, world: int, path: str, ref: str) -> None:
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Shard, distribute_tensor

    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("fsdp", "tp"))
    torch.manual_seed(0)
    full = {"w": torch.randn(30, 20), "v": torch.randn(7, 5)}  # uneven on both dims
    state = {k: distribute_tensor(v, mesh, [Shard(0), Shard(1)]) for k, v in full.items()}
    shardpoint.save(state, path)
    if rank == 0:
        save_file(full, ref)


def _mesh_1d_load(rank: int, world: int, path: str, ref: str) -> None:
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Shard, distribute_tensor

    mesh = init_device_mesh("cpu", (world,))
    state = {
        k: distribute_tensor(torch.zeros(s), mesh, [Shard(0)])
        for k, s in (("w", (30, 20)), ("v", (7, 5)))
    }
    shardpoint.load(state, path)
    want = load_file(ref)
    for k, t in state.items():
        assert torch.equal(t.full_tensor(), want[k]), k


def test_a_2d_mesh_checkpoint_loads_on_a_1d_mesh_and_in_one_process(tmp_path):
    path, ref = tmp_path / "ckpt", tmp_path / "ref.safetensors"
    run_ranks(4, _mesh_2d_save, str(path), str(ref))
    run_ranks(2, _mesh_1d_load, str(path), str(ref))
    state = {"w": torch.zeros(30, 20), "v": torch.zeros(7, 5)}
    shardpoint.load(state, path)
    want = load_file(str(ref))
    assert all(torch.equal(state[k], want[k]) for k in state)


def _tied_load_sharded_and_whole(rank: int, world: int, path: str) -> None:
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Shard, distribute_tensor

    mesh = init_device_mesh("cpu", (world,))
    emb = distribute_tensor(torch.full((64, 64), -7.0), mesh, [Shard(0)], src_data_rank=None)
    head = torch.full((64, 64), -7.0)
    shardpoint.load({"emb": emb, "head": head}, path)
    want = torch.arange(64 * 64, dtype=torch.float32).reshape(64, 64) + 1
    assert torch.equal(head, want)
    assert torch.equal(emb.to_local(), want[rank * 32 : (rank + 1) * 32])


def test_tied_weights_loaded_as_a_shard_and_as_a_whole_tensor_both_get_their_bytes(tmp_path):
    """``head`` is stored as an alias of ``emb``; each rank needs the same stored rows
    twice (its ``emb`` shard and all of ``head``): two reads from one file offset, each
    filled and verified (one was left unread before)."""
    w = torch.arange(64 * 64, dtype=torch.float32).reshape(64, 64) + 1
    shardpoint.save({"emb": w, "head": w}, tmp_path / "ckpt")
    run_ranks(2, _tied_load_sharded_and_whole, str(tmp_path / "ckpt"))


def _values_that_differ_per_rank(rank: int, world: int, path: str) -> None:
    for state in (
        {"buf": torch.arange(rank + 2, dtype=torch.float32)},  # shapes differ
        {"buf": torch.zeros(4, dtype=torch.float32 if rank == 0 else torch.float64)},
    ):
        with pytest.raises(shardpoint.CheckpointError, match="differs per rank.*PerRank"):
            shardpoint.save(state, path)
        assert not (Path(path) / MARKER_NAME).exists()


def test_a_plain_tensor_that_differs_per_rank_is_refused_at_save(tmp_path):
    """Without ``PerRank``, a plain tensor is one value every rank holds a copy of: one
    of another shape or dtype on some rank used to commit a checkpoint no load took
    ("the chunks do not cover its shape": damaged, and fallen back from)."""
    run_ranks(2, _values_that_differ_per_rank, str(tmp_path / "ckpt"))


def _failing_save(rank: int, world: int, path: str) -> None:
    import shardpoint.storage.local as local

    if rank == 1:

        def fail(*args: object, **kwargs: object) -> None:
            raise OSError(28, "No space left on device")

        local.LocalDirectory.write_files = fail  # type: ignore[method-assign]
    with pytest.raises(shardpoint.CheckpointError, match="rank 1: .*No space left"):
        shardpoint.save(
            {"w": torch.full((1000,), float(rank)), "ranks": {rank: torch.ones(1)}}, path
        )


def test_a_rank_failing_mid_save_commits_nothing_and_the_previous_checkpoint_loads(tmp_path):
    good = tmp_path / "step1"
    run_ranks(2, _ddp_save, str(good))
    bad = tmp_path / "step2"
    run_ranks(2, _failing_save, str(bad))
    assert not (bad / MARKER_NAME).exists()
    model = nn.Sequential(nn.Linear(1024, 2048), nn.Linear(2048, 1024), nn.LayerNorm(1024))
    shardpoint.load({"model": model}, good, strict=False)
    assert shardpoint.verify(good).ok


def test_read_amplification_of_a_resharding_load(tmp_path, monkeypatch):
    """Loading row shards of a 4-rank checkpoint into 3 regions reads ~ only what is needed."""
    import os

    import shardpoint.storage.local as local

    big = tmp_path / "big"
    run_ranks(4, _big_rows_save, str(big))
    counter = {"n": 0}
    real = os.preadv

    def counting(fd, buffers, offset, *flags):
        n = real(fd, buffers, offset, *flags)
        if not flags:
            counter["n"] += n
        return n

    monkeypatch.setattr(local.os, "preadv", counting)
    rows = 16384
    needed = 0
    expected = _big_rows_tensor()
    for lo, hi in ((0, 5461), (5461, 10922), (10922, rows)):  # what 3 ranks each need
        part = torch.zeros(hi - lo, 1024)
        plan = ReadPlan(open_committed(big))
        plan.into_region("w", part, (lo, 0))
        plan.run(threads=2, verify=True)
        needed += part.numel() * 4
        assert torch.equal(part, expected[lo:hi])
    amplification = counter["n"] / needed
    assert amplification <= 1.05, amplification
    assert math.isclose(needed, rows * 1024 * 4)


def _big_rows_tensor() -> torch.Tensor:
    torch.manual_seed(5)
    return torch.randn(16384, 1024)


def _big_rows_save(rank: int, world: int, path: str) -> None:
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Shard, distribute_tensor

    mesh = init_device_mesh("cpu", (world,))
    shardpoint.save({"w": distribute_tensor(_big_rows_tensor(), mesh, [Shard(0)])}, path)


TRAIN = Path(__file__).resolve().parents[1] / "examples" / "train_char_lm.py"
DDP_ARGS = ["--steps", "30", "--save-every", "10", "--corpus-bytes", "10000", "--num-workers", "1"]


def _torchrun(run_dir: Path, *extra: str) -> subprocess.CompletedProcess[str]:
    cmd = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--nnodes",
        "1",
        "--nproc_per_node",
        "2",
        "--master_addr",
        "127.0.0.1",
        "--master_port",
        str(_free_port()),
        str(TRAIN),
        "--run-dir",
        str(run_dir),
        *DDP_ARGS,
        *extra,
    ]
    return subprocess.run(cmd, capture_output=True, text=True, timeout=600)


def _failed_workers(torchrun_stderr: str) -> dict[int, int]:
    """Rank -> exit code of every worker torchrun reports as failed (-9: SIGKILL)."""
    found = re.findall(
        r"rank\s*: (\d+) \(local_rank: \d+\)\n\s*exitcode\s*: (-?\d+)", torchrun_stderr
    )
    return {int(rank): int(code) for rank, code in found}


def _logged_steps(path: Path) -> list[int]:
    return [json.loads(line)["step"] for line in path.read_text().splitlines()]


def test_ddp_job_killed_with_sigkill_resumes_bit_identical(tmp_path):
    reference = tmp_path / "reference"
    done = _torchrun(reference)
    assert done.returncode == 0, done.stderr[-3000:]
    run = tmp_path / "run"
    killed = _torchrun(run, "--crash-at", "17")
    # The job died because its workers were SIGKILLed, and at step 17: not of any other
    # failure (an exception, a failed start), which would also exit nonzero.
    failed = _failed_workers(killed.stderr)
    assert killed.returncode != 0 and failed, killed.stderr[-3000:]
    assert set(failed) <= {0, 1} and set(failed.values()) == {-9}, killed.stderr[-3000:]
    for losses in ("losses.jsonl", "losses.rank1.jsonl"):
        assert _logged_steps(run / losses) == list(range(1, 18)), losses
    resumed = _torchrun(run)
    assert resumed.returncode == 0, resumed.stderr[-2000:]
    assert "resuming from step 10" in resumed.stdout
    assert read_losses(run) == read_losses(reference)
    assert (run / "final.json").read_text() == (reference / "final.json").read_text()
    index = json.loads((run / "checkpoints" / "step-000000030" / INDEX_NAME).read_text())
    assert index["world_size"] == 2


class _BrokenStateDict:
    def state_dict(self) -> dict:
        raise RuntimeError("user code failed")

    def load_state_dict(self, sd: dict) -> None:
        pass


# What rank 1 holds, and what its own save raises; rank 0 must hear of it, not hang.
RANK_1_FAILURES = {
    "a value without a JSON form": (lambda: {1, 2}, shardpoint.UnsupportedValueError, "ranks.1"),
    "user code raising": (_BrokenStateDict, RuntimeError, "user code failed"),
}


def _one_rank_fails(rank: int, world: int, path: str, case: str) -> None:
    value, error, match = RANK_1_FAILURES[case]
    state = {"w": torch.ones(3), "ranks": {rank: value() if rank == 1 else 0}}
    if rank == 1:
        with pytest.raises(error, match=match):
            shardpoint.save(state, path)
    else:
        with pytest.raises(shardpoint.CheckpointError, match="another rank could not save: rank 1"):
            shardpoint.save(state, path)


@pytest.mark.parametrize("case", list(RANK_1_FAILURES))
def test_a_failure_on_one_rank_before_the_gather_fails_every_rank_without_hanging(tmp_path, case):
    run_ranks(2, _one_rank_fails, str(tmp_path / "ckpt"), case)
    assert not (tmp_path / "ckpt" / MARKER_NAME).exists()
