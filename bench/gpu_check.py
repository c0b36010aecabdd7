"""One-command check of shardpoint's CUDA paths on a machine with one NVIDIA GPU.

    python bench/gpu_check.py --out $OUT/gpu_check.json [--gb 1.5] [--dir DIR]

Checks (each one is independent: one that raises is recorded and the rest still run):
  pinned_async    ``shardpoint.async_save`` of CUDA tensors: the staging pool's slots are
                  pinned; the training-thread stall vs a GPU ``clone()``, a pageable
                  ``.cpu()`` copy and a copy into preallocated pinned memory (the floor);
                  the persist time; the live tensors are overwritten as soon as the call
                  returns and the checkpoint must still hold the old values, bit-exact.
  sync_roundtrip  ``shardpoint.save`` then ``shardpoint.load`` into fresh CUDA tensors and
                  into fresh CPU tensors: bit-exact, GB/s both ways; then 10,000 small
                  tensors loaded into CUDA, bit-exact (a load planned in many batches).
  cuda_rng        the RNG streams captured by ``capture_rng`` / ``TrainState`` restore the
                  CUDA generator: the same draws again, also after a save, a reseed and a
                  load in the same process.
  pg_save_load    under a one-process NCCL group: save, load and a background save of
                  CUDA tensors, bit-exact (shardpoint's JSON collectives use a gloo group).
  fsdp2_resume    an FSDP2 model (``fully_shard``) with AdamW on CUDA, saved with
                  ``save`` and with ``async_save`` (the model trains on while the latter
                  persists); fresh models loaded from each take one more step with a loss
                  and parameters bit-identical to the original model's.

  shared_reads    2 ranks (gloo) save the same state (DDP-like), then load it into CUDA
                  tensors with ``share_reads=True``: bit-exact on both, and each stored
                  byte read from storage once (pieces reach the GPU through host buffers).

Prints a table and writes JSON to ``--out`` (after every check, so a timeout keeps what
finished). Exit status: 0 every check passed, 1 a check failed, 2 no CUDA device,
3 shardpoint could not be imported, 4 the ``--timeout`` watchdog fired.
"""

from __future__ import annotations

import argparse
import faulthandler
import json
import math
import os
import platform
import shutil
import socket
import sys
import tempfile
import threading
import time
import traceback
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from datetime import timedelta
from pathlib import Path
from typing import Any

# Deterministic cuBLAS workspaces, so a resumed training step can be bit-identical; must
# be set before CUDA initialises.
os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")

import torch  # noqa: E402
from torch import nn  # noqa: E402

_SRC = Path(__file__).resolve().parent.parent / "src"
if (_SRC / "shardpoint").is_dir():
    sys.path.insert(0, str(_SRC))  # check this checkout's code, installed or not

_IMPORT_ERROR: BaseException | None = None
try:
    import shardpoint
    from shardpoint import background_save
    from shardpoint import dist as sp_dist
    from shardpoint.staging import SLOT_BYTES
    from shardpoint.training.rng import capture_rng, restore_rng
except ImportError as exc:  # reported by main() with the exit status 3
    _IMPORT_ERROR = exc

Figures = dict[str, Any]
RESULTS: list[dict[str, Any]] = []  # every finished check, in order
REPORT: dict[str, Any] = {}  # what --out receives


# ---- tensors: states to save, bit-exact comparison --------------------------------------


def sync(device: str) -> None:
    if device == "cuda":
        torch.cuda.synchronize()


def raw_bytes(t: torch.Tensor) -> torch.Tensor:
    """The bytes of ``t`` (row-major) as a flat uint8 tensor."""
    return t.detach().contiguous().reshape(-1).view(torch.uint8)


def same_bits(a: torch.Tensor, b: torch.Tensor) -> bool:
    if a.dtype != b.dtype or a.shape != b.shape:
        return False
    if a.device != b.device:
        b = b.to(a.device)
    return torch.equal(raw_bytes(a), raw_bytes(b))


def tensors_of(state: dict[str, Any]) -> dict[str, torch.Tensor]:
    return {k: v for k, v in state.items() if isinstance(v, torch.Tensor)}


def nbytes(state: dict[str, Any]) -> int:
    return sum(t.numel() * t.element_size() for t in tensors_of(state).values())


def make_state(gb: float, device: str, seed: int) -> dict[str, Any]:
    """About ``gb`` GB of tensors on ``device``: eight large float32 matrices, bf16 and
    int64 ones, a non-contiguous (transposed) one, a 0-d and an empty one, plain values."""
    g = torch.Generator(device=device).manual_seed(seed)
    width = 4096
    total = max(int(gb * 1e9), 64 * width * 4 * 10)
    rows = total * 80 // 100 // 8 // (width * 4)
    state: dict[str, Any] = {
        f"layers.{i}.weight": torch.randn(rows, width, generator=g, device=device) for i in range(8)
    }
    bf16_rows = total * 10 // 100 // (width * 2)
    state["embed.bf16"] = torch.randn(
        bf16_rows, width, generator=g, device=device, dtype=torch.bfloat16
    )
    int_rows = total * 10 // 100 // (width * 8)
    state["tokens.int64"] = torch.randint(
        -(2**40), 2**40, (int_rows, width), generator=g, device=device, dtype=torch.int64
    )
    state["proj.transposed"] = torch.randn(512, 384, generator=g, device=device).t()
    state["scale.scalar"] = torch.randn((), generator=g, device=device)
    state["empty"] = torch.empty(0, 16, device=device)
    state["step"] = 7
    state["note"] = "gpu_check"
    return state


def fresh_like(state: dict[str, Any], device: str) -> dict[str, Any]:
    """Destinations of the same shapes and dtypes on ``device``, filled with a byte
    pattern the saved values do not have; plain values zeroed."""
    out: dict[str, Any] = {}
    for k, v in state.items():
        if isinstance(v, torch.Tensor):
            d = torch.empty_like(v, device=device)  # keeps the transposed strides
            if d.is_contiguous():
                raw_bytes(d).fill_(0xA5)
            else:
                d.zero_()
            out[k] = d
        else:
            out[k] = type(v)()
    return out


def mismatches(got: dict[str, Any], want: dict[str, Any]) -> list[str]:
    """Keys whose values differ (tensors bit by bit)."""
    bad = []
    for k, w in want.items():
        g = got.get(k)
        if isinstance(w, torch.Tensor):
            if not isinstance(g, torch.Tensor) or not same_bits(g, w):
                bad.append(k)
        elif g != w:
            bad.append(k)
    return bad


def overwrite(state: dict[str, Any]) -> None:
    """Change every byte of every tensor in place (what a training step would do)."""
    for v in tensors_of(state).values():
        if v.numel() == 0:
            continue
        if v.is_contiguous():
            raw_bytes(v).bitwise_not_()
        else:
            v.copy_(v + 1)


def gbps(nbytes_: int, seconds: float) -> float:
    return nbytes_ / seconds / 1e9 if seconds > 0 else float("inf")


# ---- check 1: async_save through the pinned staging pool ---------------------------------


def check_pinned_async(args: argparse.Namespace, root: Path) -> Figures:
    device = args.device
    state = make_state(args.gb, device, seed=1)
    size = nbytes(state)
    fig: Figures = {"state_gb": size / 1e9, "tensors": len(tensors_of(state))}
    problems: list[str] = []

    if device == "cuda":
        sync(device)
        start = time.perf_counter()
        host = {k: v.cpu() for k, v in tensors_of(state).items()}
        fig["cpu_copy_s"] = time.perf_counter() - start  # pageable, fresh memory
        del host
    host_before = _pinned_host_bytes()

    stalls: list[float] = []
    for rep in range(args.reps + 1):  # rep 0 is cold: it allocates the staging pool
        sync(device)
        start = time.perf_counter()
        ref = {k: v.clone() for k, v in tensors_of(state).items()}
        sync(device)
        clone_s = time.perf_counter() - start
        ref.update({k: v for k, v in state.items() if k not in ref})

        path = root / f"async-{rep}"
        sync(device)
        start = time.perf_counter()
        handle = shardpoint.async_save(state, path)
        stall = time.perf_counter() - start
        in_flight = not handle.done()
        overwrite(state)  # the checkpoint must keep the values of the call
        sync(device)
        info = handle.wait()
        persist = info.seconds

        dest = fresh_like(state, device)
        shardpoint.load(dest, path)
        bad = mismatches(dest, ref)
        if bad:
            problems.append(f"rep {rep}: loaded values differ from those at the call: {bad}")
        changed = mismatches(state, ref)
        if not set(tensors_of(state)) - {"empty"} <= set(changed):
            problems.append(f"rep {rep}: overwrite() left tensors unchanged (test bug)")
        shutil.rmtree(path)
        del dest, ref

        key = "cold" if rep == 0 else f"warm{rep}"
        fig[f"stall_{key}_s"] = stall
        fig[f"handle_stall_{key}_s"] = handle.stall_seconds
        fig[f"persist_{key}_s"] = persist
        fig[f"persist_{key}_gbps"] = gbps(info.bytes_written, persist)
        fig[f"clone_{key}_s"] = clone_s
        fig[f"in_flight_at_return_{key}"] = in_flight
        if rep:
            stalls.append(stall)
        if rep == 0:
            fig.update(_pool_figures(host_before, problems, pinned_expected=device == "cuda"))

    fig["stall_warm_best_s"] = min(stalls) if stalls else fig["stall_cold_s"]
    fig["stall_warm_gbps"] = gbps(size, fig["stall_warm_best_s"])
    if device == "cuda":
        fig["pinned_copy_floor_s"] = _pinned_copy_floor(state)
        fig["stall_vs_cpu_copy"] = fig["stall_warm_best_s"] / fig["cpu_copy_s"]
    return _result(fig, problems)


def _pinned_host_bytes() -> int | None:
    """Pinned host memory held by torch's caching host allocator (None: not reported)."""
    stats = getattr(torch.cuda, "host_memory_stats", None)
    if stats is None or not torch.cuda.is_available() or not torch.cuda.is_initialized():
        return None
    try:
        value = stats().get("allocated_bytes.current")
    except Exception:
        return None
    return None if value is None else int(value)


def _pool_figures(
    host_before: int | None, problems: list[str], *, pinned_expected: bool
) -> Figures:
    """Whether every staging slot is pinned, and what the pool holds (after a save)."""
    saver = getattr(background_save, "_DEFAULT_SAVER", None)
    if saver is None:
        problems.append("shardpoint.background_save._DEFAULT_SAVER not found; pool unchecked")
        return {}
    pool = saver.pool
    count = pool.nbytes // SLOT_BYTES
    free = pool._free.qsize()  # every slot is back once the save committed
    slots = [pool.acquire() for _ in range(min(count, free))]
    try:
        pinned = [bool(s.data.is_pinned()) for s in slots]
        aligned = [s.data.data_ptr() % 4096 == 0 for s in slots]
    finally:
        for s in slots:
            pool.release(s)
    fig: Figures = {
        "pool_flag_pinned": bool(pool.pinned),
        "pool_bytes": pool.nbytes,
        "pool_slots": count,
        "slots_checked": len(slots),
        "slots_pinned": sum(pinned),
        "slots_page_aligned": sum(aligned),
    }
    host_after = _pinned_host_bytes()
    if host_before is not None and host_after is not None:
        fig["pinned_allocator_growth_bytes"] = host_after - host_before
        if pool.nbytes:
            fig["pinned_bytes_per_pool_byte"] = (host_after - host_before) / pool.nbytes
    if len(slots) != count:
        problems.append(f"only {len(slots)} of {count} staging slots were free after wait()")
    if not all(aligned):
        problems.append("staging slots not page-aligned")
    if pinned_expected and not (pool.pinned and all(pinned) and slots):
        problems.append(f"staging slots not pinned: {sum(pinned)}/{len(slots)} pinned")
    return fig


def _pinned_copy_floor(state: dict[str, Any]) -> float:
    """Seconds to copy the state into preallocated pinned memory (the stall's floor)."""
    tensors = list(tensors_of(state).values())
    buf = torch.empty(nbytes(state), dtype=torch.uint8, pin_memory=True)
    best = float("inf")
    for _ in range(2):
        torch.cuda.synchronize()
        start = time.perf_counter()
        offset = 0
        for t in tensors:
            n = t.numel() * t.element_size()
            buf[offset : offset + n].copy_(raw_bytes(t), non_blocking=True)
            offset += n
        torch.cuda.synchronize()
        best = min(best, time.perf_counter() - start)
    del buf
    return best


# ---- check 2: synchronous save and load ---------------------------------------------------


def check_sync_roundtrip(args: argparse.Namespace, root: Path) -> Figures:
    device = args.device
    state = make_state(args.gb, device, seed=2)
    size = nbytes(state)
    fig: Figures = {"state_gb": size / 1e9}
    problems: list[str] = []
    path = root / "sync"

    sync(device)
    info = shardpoint.save(state, path)
    fig["save_s"] = info.seconds
    fig["save_gbps"] = gbps(info.bytes_written, info.seconds)
    fig["files"] = info.files

    for where in dict.fromkeys((device, "cpu")):
        dest = fresh_like(state, where)
        sync(device)
        start = time.perf_counter()
        shardpoint.load(dest, path)
        sync(device)
        seconds = time.perf_counter() - start
        fig[f"load_{where}_s"] = seconds  # the files are in the page cache: a warm load
        fig[f"load_{where}_gbps"] = gbps(size, seconds)
        wrong_device = [k for k, v in tensors_of(dest).items() if v.device.type != where]
        bad = mismatches(dest, state)
        if bad:
            problems.append(f"loaded into {where}: values differ: {bad}")
        if wrong_device:
            problems.append(f"loaded into {where}: tensors moved device: {wrong_device}")
        del dest
    shutil.rmtree(path)

    # Many small tensors (an optimizer state's shape): the load plans long after its
    # first batches are read, the case that once left GPU destinations unwritten.
    g = torch.Generator(device=device).manual_seed(3)
    many = {
        f"opt.{i}": torch.randn(256 + (i % 64) * 64, generator=g, device=device)
        for i in range(10_000)
    }
    shardpoint.save(many, root / "many")
    dest = fresh_like(many, device)
    sync(device)
    start = time.perf_counter()
    shardpoint.load(dest, root / "many")
    sync(device)
    fig["load_10k_small_s"] = time.perf_counter() - start
    bad = mismatches(dest, many)
    if bad:
        problems.append(f"10,000 small tensors loaded into {device}: values differ: {bad}")
    shutil.rmtree(root / "many")
    return _result(fig, problems)


# ---- check 3: CUDA random number streams --------------------------------------------------


def _draws(device: str) -> list[torch.Tensor]:
    """What a training step draws: normal, uniform, integers, dropout; and the CPU stream."""
    x = torch.ones(4096, device=device)
    return [
        torch.randn(4096, device=device),
        torch.rand(1000, device=device),
        torch.randint(0, 2**31 - 1, (1000,), device=device),
        nn.functional.dropout(x, p=0.5, training=True),
        torch.randn(64),  # the CPU generator, captured beside the CUDA ones
    ]


def _same_draws(a: list[torch.Tensor], b: list[torch.Tensor]) -> bool:
    return all(same_bits(x, y) for x, y in zip(a, b, strict=True))


def check_rng(args: argparse.Namespace, root: Path) -> Figures:
    device = args.device
    problems: list[str] = []
    fig: Figures = {}
    torch.manual_seed(11)
    _draws(device)  # initialises CUDA, so capture_rng includes its generators

    # capture, draw, restore, draw again: the same numbers
    captured = capture_rng()
    cuda_streams = captured.get("cuda") or []
    fig["cuda_streams_captured"] = len(cuda_streams)
    if device == "cuda" and len(cuda_streams) != torch.cuda.device_count():
        problems.append(
            f"capture_rng() holds {len(cuda_streams)} CUDA streams, the process sees "
            f"{torch.cuda.device_count()} devices"
        )
    first = _draws(device)
    restore_rng(captured)
    again = _draws(device)
    fig["restore_in_memory_identical"] = _same_draws(first, again)
    if not fig["restore_in_memory_identical"]:
        problems.append("draws after restore_rng(capture_rng()) differ")

    # TrainState through a checkpoint: save, draw on, reseed, load, draw: the same numbers
    path = root / "rng"
    shardpoint.save({"train": shardpoint.TrainState()}, path)
    uninterrupted = _draws(device)
    if device == "cuda":
        torch.cuda.manual_seed(12345)
    torch.manual_seed(12345)
    disturbed = _draws(device)
    fig["reseed_changed_draws"] = not _same_draws(disturbed, uninterrupted)
    shardpoint.load({"train": shardpoint.TrainState()}, path)
    resumed = _draws(device)
    fig["restore_from_checkpoint_identical"] = _same_draws(resumed, uninterrupted)
    if not fig["restore_from_checkpoint_identical"]:
        which = [i for i, (a, b) in enumerate(zip(resumed, uninterrupted)) if not same_bits(a, b)]
        problems.append(f"draws after loading the TrainState differ (draws {which})")
    if not fig["reseed_changed_draws"]:
        problems.append("reseeding did not change the draws (test bug)")
    with shardpoint.open(str(path)) as ckpt:
        fig["stored_rng_entries"] = sum(".rng." in k for k in ckpt.keys())
    shutil.rmtree(path)
    return _result(fig, problems)


# ---- check 4: a one-process NCCL group; FSDP2 -------------------------------------------


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@contextmanager
def process_group(device: str) -> Iterator[str]:
    """A one-process group: NCCL on CUDA (gloo on the CPU dry run)."""
    import torch.distributed as dist

    backend = "nccl" if device == "cuda" else "gloo"
    os.environ["MASTER_ADDR"] = "127.0.0.1"
    os.environ["MASTER_PORT"] = str(_free_port())
    os.environ.setdefault("GLOO_SOCKET_IFNAME", "lo")  # one machine, one process
    os.environ.setdefault("NCCL_SOCKET_IFNAME", "lo")
    if device == "cuda":
        torch.cuda.set_device(0)
    dist.init_process_group(backend, rank=0, world_size=1, timeout=timedelta(seconds=120))
    try:
        yield backend
    finally:
        dist.destroy_process_group()


def check_pg_save_load(args: argparse.Namespace, root: Path) -> Figures:
    import torch.distributed as dist

    device = args.device
    problems: list[str] = []
    gb = min(args.gb, 0.5)
    state = make_state(gb, device, seed=4)
    fig: Figures = {
        "backend": dist.get_backend(),
        "world_size": dist.get_world_size(),
        "state_gb": nbytes(state) / 1e9,
    }
    path = root / "pg-sync"
    info = shardpoint.save(state, path)
    fig["save_gbps"] = gbps(info.bytes_written, info.seconds)
    json_group = getattr(sp_dist, "_CPU_GROUP", None)
    if json_group is not None:
        fig["json_group_backend"] = str(dist.get_backend(json_group))
    dest = fresh_like(state, device)
    shardpoint.load(dest, path)
    bad = mismatches(dest, state)
    if bad:
        problems.append(f"sync save/load under the group: values differ: {bad}")
    del dest
    shutil.rmtree(path)

    ref = {k: v.clone() for k, v in tensors_of(state).items()}
    ref.update({k: v for k, v in state.items() if k not in ref})
    path = root / "pg-async"
    handle = shardpoint.async_save(state, path)
    overwrite(state)
    info = handle.wait()
    fig["async_stall_s"] = handle.stall_seconds
    fig["async_persist_s"] = info.seconds
    saver = getattr(background_save, "_DEFAULT_SAVER", None)
    bg_group = getattr(saver, "_group", None)
    if bg_group is not None:
        fig["background_group_backend"] = str(dist.get_backend(bg_group))
    dest = fresh_like(state, device)
    shardpoint.load(dest, path)
    bad = mismatches(dest, ref)
    if bad:
        problems.append(f"async save under the group: values differ from the call's: {bad}")
    shutil.rmtree(path)
    return _result(fig, problems)


def _fsdp_api() -> tuple[Callable[..., Any], Callable[..., Any], type]:
    from torch.distributed.device_mesh import init_device_mesh

    try:
        from torch.distributed.fsdp import fully_shard
    except ImportError:  # torch < 2.6
        from torch.distributed._composable.fsdp import fully_shard  # type: ignore[no-redef]
    try:
        from torch.distributed.tensor import DTensor
    except ImportError:  # torch < 2.5
        from torch.distributed._tensor import DTensor  # type: ignore[no-redef]
    return fully_shard, init_device_mesh, DTensor


def _fsdp_model(
    device: str, mesh: Any, seed: int, layers: int, width: int
) -> tuple[nn.Module, torch.optim.Optimizer]:
    fully_shard = _fsdp_api()[0]
    torch.manual_seed(seed)
    blocks: list[nn.Module] = []
    for i in range(layers):
        blocks.append(nn.Linear(width, width))
        if i < layers - 1:
            blocks.append(nn.GELU())
    model = nn.Sequential(*blocks).to(device)
    for block in model:
        if isinstance(block, nn.Linear):
            fully_shard(block, mesh=mesh)
    fully_shard(model, mesh=mesh)
    return model, torch.optim.AdamW(model.parameters(), lr=1e-3, weight_decay=0.01)


def _train_step(
    model: nn.Module, opt: torch.optim.Optimizer, step: int, device: str, width: int
) -> torch.Tensor:
    g = torch.Generator(device=device).manual_seed(1000 + step)  # the same batch every run
    x = torch.randn(64, width, generator=g, device=device)
    loss = (model(x) - x).pow(2).mean()  # learn the identity: a loss of order 1
    opt.zero_grad(set_to_none=True)
    loss.backward()
    opt.step()
    return loss.detach().clone()


def _params(model: nn.Module) -> dict[str, torch.Tensor]:
    """Every parameter's values (world size 1: a DTensor's local shard is all of it)."""
    out = {}
    for name, p in model.named_parameters():
        local = p.to_local() if hasattr(p, "to_local") else p
        out[name] = local.detach().clone()
    return out


def check_fsdp2_resume(args: argparse.Namespace, root: Path) -> Figures:
    fully_shard, init_device_mesh, DTensor = _fsdp_api()
    device, layers, width = args.device, args.fsdp_layers, args.fsdp_width
    problems: list[str] = []
    mesh = init_device_mesh(device, (1,))
    model, opt = _fsdp_model(device, mesh, 0, layers, width)
    dtensors = sum(isinstance(p, DTensor) for p in model.parameters())
    fig: Figures = {
        "layers": layers,
        "width": width,
        "params": sum(p.numel() for p in model.parameters()),
        "dtensor_params": f"{dtensors}/{len(list(model.parameters()))}",
    }
    if dtensors != len(list(model.parameters())):
        problems.append("fully_shard left parameters that are not DTensors")
    for step in range(2):
        _train_step(model, opt, step, device, width)
    at_save = _params(model)

    paths = {"sync": root / "fsdp-sync", "async": root / "fsdp-async"}
    info = shardpoint.save(
        {"train": shardpoint.TrainState(model=model, optimizer=opt)}, paths["sync"]
    )
    fig["save_s"] = info.seconds
    fig["save_tensors"] = info.tensors
    fig["save_bytes"] = info.bytes_written
    handle = shardpoint.async_save(
        {"train": shardpoint.TrainState(model=model, optimizer=opt)}, paths["async"]
    )
    fig["async_stall_s"] = handle.stall_seconds
    fig["async_in_flight_at_return"] = not handle.done()
    want_loss = _train_step(model, opt, 2, device, width)  # trains on while it persists
    want = _params(model)
    fig["async_persist_s"] = handle.wait().seconds
    fig["loss_continued"] = float(want_loss)

    for kind, path in paths.items():
        fresh, fresh_opt = _fsdp_model(device, mesh, 1, layers, width)  # other weights
        if not mismatches(_params(fresh), at_save):
            problems.append(f"{kind}: a fresh model already equals the saved one (test bug)")
        shardpoint.load({"train": shardpoint.TrainState(model=fresh, optimizer=fresh_opt)}, path)
        bad = mismatches(_params(fresh), at_save)
        if bad:
            problems.append(f"{kind}: parameters after load differ from the saved ones: {bad}")
        loss = _train_step(fresh, fresh_opt, 2, device, width)
        fig[f"loss_resumed_{kind}"] = float(loss)
        if not same_bits(loss, want_loss):
            problems.append(f"{kind}: resumed loss {float(loss)!r} != {float(want_loss)!r}")
        bad = mismatches(_params(fresh), want)
        if bad:
            problems.append(f"{kind}: parameters after the resumed step differ: {bad}")
        with shardpoint.open(str(path)) as ckpt:
            entry = ckpt.entry("train.model.0.weight")
            fig[f"{kind}_entry_shape"] = list(entry.shape)
        shutil.rmtree(path)
    return _result(fig, problems)


# ---- check 6: shared reads into GPU tensors, 2 ranks ------------------------------------

SHARED_TENSORS, SHARED_SHAPE = 8, (512, 1024)  # 2 MB of fp32 each


def _shared_reads_rank(rank: int, world: int, port: int, path: str, device: str, out: str) -> None:
    import torch.distributed as dist

    from shardpoint.storage.local import LocalDirectory

    dist.init_process_group(
        "gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world
    )
    g = torch.Generator().manual_seed(7)
    state = {f"w{i}": torch.randn(SHARED_SHAPE, generator=g) for i in range(SHARED_TENSORS)}
    shardpoint.save(state, path)  # the same on every rank: each writes a share
    read = [0]
    real = LocalDirectory.read_ranges

    def counting(self: Any, requests: Any, **kwargs: Any) -> Any:
        read[0] += sum(s.end - s.offset for ss in requests.values() for s in ss)
        return real(self, requests, **kwargs)

    LocalDirectory.read_ranges = counting  # type: ignore[method-assign]
    dest = {k: torch.zeros_like(v, device=device) for k, v in state.items()}
    dist.barrier()
    start = time.perf_counter()
    shardpoint.load(dest, path, share_reads=True)
    seconds = time.perf_counter() - start
    ok = all(same_bits(dest[k].cpu(), v) for k, v in state.items())
    Path(out, f"rank{rank}.json").write_text(json.dumps([read[0], ok, seconds]))
    dist.barrier()
    dist.destroy_process_group()


def check_shared_reads(args: argparse.Namespace, root: Path) -> Figures:
    import torch.multiprocessing as mp

    out = root / "shared-out"
    out.mkdir()
    path = root / "shared"
    ranks = 2
    mp.start_processes(
        _shared_reads_rank,
        args=(ranks, _free_port(), str(path), args.device, str(out)),
        nprocs=ranks,
        start_method="spawn",
    )
    results = [json.loads((out / f"rank{r}.json").read_text()) for r in range(ranks)]
    stored = SHARED_TENSORS * math.prod(SHARED_SHAPE) * 4
    read = sum(r[0] for r in results)
    fig: Figures = {
        "ranks": ranks,
        "stored_bytes": stored,
        "read_from_storage_bytes": read,
        "read_per_stored_byte": read / stored,
        "load_s": max(r[2] for r in results),
    }
    problems = []
    if not all(r[1] for r in results):
        problems.append(f"values differ on ranks {[i for i, r in enumerate(results) if not r[1]]}")
    if read != stored:
        problems.append(f"read {read} bytes from storage for {stored} stored (want each once)")
    shutil.rmtree(path)
    return _result(fig, problems)


# ---- running, reporting ---------------------------------------------------------------


def _result(fig: Figures, problems: list[str]) -> Figures:
    return {"ok": not problems, "figures": fig, "error": "; ".join(problems) or None}


def run_check(name: str, fn: Callable[..., Figures], *fn_args: Any) -> dict[str, Any]:
    start = time.perf_counter()
    try:
        out = fn(*fn_args)
    except Exception:
        out = {"ok": False, "figures": {}, "error": traceback.format_exc()}
        _settle_background_save()
    out = {"name": name, **out, "seconds": time.perf_counter() - start}
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        torch.cuda.empty_cache()
    RESULTS.append(out)
    _print_result(out)
    return out


def _settle_background_save() -> None:
    """After a check raised: let its background save finish, so that its outcome does
    not surface in the next check's ``async_save``."""
    saver = getattr(background_save, "_DEFAULT_SAVER", None)
    if saver is not None:
        try:
            saver.wait()
        except Exception:
            pass  # the check that started it already failed


def _print_result(r: dict[str, Any]) -> None:
    verdict = "PASS" if r["ok"] else "FAIL"
    print(f"{r['name']:<16} {verdict}  ({r['seconds']:.1f} s)", flush=True)
    for k, v in r["figures"].items():
        print(f"    {k:<34} {_fmt(v)}")
    if r["error"]:
        print("    error: " + r["error"].rstrip().replace("\n", "\n    "))
    sys.stdout.flush()


def _fmt(v: Any) -> str:
    if isinstance(v, float):
        return f"{v:.4g}"
    return str(v)


def write_report(out: Path) -> None:
    REPORT["checks"] = RESULTS
    REPORT["ok"] = bool(RESULTS) and all(r["ok"] for r in RESULTS)
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = out.with_name(out.name + ".tmp")
    tmp.write_text(json.dumps(REPORT, indent=2, default=str) + "\n")
    os.replace(tmp, out)


def filesystem_of(path: Path) -> str:
    """The file system type of ``path`` (from /proc/mounts; '?' elsewhere)."""
    best, kind = "", "?"
    try:
        for line in Path("/proc/mounts").read_text().splitlines():
            fields = line.split()
            mount = fields[1]
            inside = str(path).startswith(mount.rstrip("/") + "/") or str(path) == mount
            if inside and len(mount) >= len(best):
                best, kind = mount, fields[2]
    except OSError:
        pass
    return kind


def start_watchdog(seconds: float, out: Path, root: Path) -> threading.Timer:
    """After ``seconds``: print every thread's stack, write what finished, remove the
    checkpoints, exit 4."""

    def fire() -> None:
        print(f"\nwatchdog: still running after {seconds:.0f} s; stacks:", flush=True)
        faulthandler.dump_traceback(all_threads=True)
        REPORT["watchdog"] = f"timed out after {seconds:.0f} s"
        try:
            write_report(out)
            shutil.rmtree(root, ignore_errors=True)
        finally:
            sys.stdout.flush()
            os._exit(4)

    timer = threading.Timer(seconds, fire)
    timer.daemon = True
    timer.start()
    return timer


CHECKS = (
    "pinned_async",
    "sync_roundtrip",
    "cuda_rng",
    "pg_save_load",
    "fsdp2_resume",
    "shared_reads",
)


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--out", type=Path, default=Path("gpu_check.json"), help="JSON results")
    p.add_argument("--gb", type=float, default=1.5, help="state size of the timed checks")
    p.add_argument("--dir", default=None, help="where to write checkpoints (a temp dir inside)")
    p.add_argument("--reps", type=int, default=2, help="warm async saves after the cold one")
    p.add_argument("--checks", default=",".join(CHECKS), help="comma-separated subset")
    p.add_argument(
        "--timeout", type=float, default=280, help="watchdog: dump stacks, write the JSON, exit 4"
    )
    p.add_argument("--fsdp-layers", type=int, default=8)
    p.add_argument("--fsdp-width", type=int, default=1024)
    # The CPU dry run of the same logic (gloo, no pinned memory); not a GPU check.
    p.add_argument("--device", choices=("cuda", "cpu"), default="cuda", help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    unknown = set(args.checks.split(",")) - set(CHECKS)
    if unknown:
        p.error(f"unknown checks {sorted(unknown)}; choose from {','.join(CHECKS)}")
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    print(
        f"torch {torch.__version__}  cuda {torch.version.cuda}  python {platform.python_version()}"
    )
    if args.device == "cuda" and not torch.cuda.is_available():
        print(
            "gpu_check: no CUDA device is available (torch.cuda.is_available() is False; "
            f"torch {torch.__version__} built with CUDA {torch.version.cuda}). Run it on a "
            "machine with an NVIDIA GPU and a CUDA build of torch.",
            file=sys.stderr,
        )
        return 2
    if _IMPORT_ERROR is not None:
        print(f"gpu_check: cannot import shardpoint: {_IMPORT_ERROR!r}", file=sys.stderr)
        return 3

    wanted = args.checks.split(",")
    gpu = torch.cuda.get_device_name(0) if args.device == "cuda" else None
    root = Path(tempfile.mkdtemp(prefix="shardpoint-gpu-check-", dir=args.dir))
    REPORT.update(
        {
            "torch": torch.__version__,
            "cuda": torch.version.cuda,
            "gpu": gpu,
            "device": args.device,
            "gpus": torch.cuda.device_count() if args.device == "cuda" else 0,
            "gpu_memory_bytes": (
                torch.cuda.get_device_properties(0).total_memory if args.device == "cuda" else 0
            ),
            "cpus": os.cpu_count(),
            "shardpoint": getattr(shardpoint, "__version__", "?"),
            "shardpoint_path": str(Path(shardpoint.__file__).parent),
            "dir": str(root),
            "filesystem": filesystem_of(root),
            "gb": args.gb,
            "argv": sys.argv[1:],
        }
    )
    print(f"gpu {gpu}  shardpoint {REPORT['shardpoint']} from {REPORT['shardpoint_path']}")
    print(f"checkpoints under {root} ({REPORT['filesystem']}), state {args.gb} GB\n", flush=True)
    watchdog = start_watchdog(args.timeout, args.out, root)
    start = time.perf_counter()
    try:
        plain = [
            ("pinned_async", check_pinned_async),
            ("sync_roundtrip", check_sync_roundtrip),
            ("cuda_rng", check_rng),
            ("shared_reads", check_shared_reads),  # processes of its own
        ]
        for name, fn in plain:
            if name in wanted:
                run_check(name, fn, args, root)
                write_report(args.out)
        grouped = [("pg_save_load", check_pg_save_load), ("fsdp2_resume", check_fsdp2_resume)]
        grouped = [(n, f) for n, f in grouped if n in wanted]
        if grouped:
            try:
                with process_group(args.device):
                    for name, fn in grouped:
                        run_check(name, fn, args, root)
                        write_report(args.out)
            except Exception:  # the group itself failed to start or to end
                error = traceback.format_exc()
                done = {r["name"] for r in RESULTS}
                for name, _ in grouped:
                    if name not in done:
                        r = {"name": name, "ok": False, "figures": {}, "error": error}
                        RESULTS.append({**r, "seconds": 0.0})
                        _print_result(RESULTS[-1])
                REPORT["process_group_error"] = error
                print("process group error:\n" + error, flush=True)
    finally:
        watchdog.cancel()
        shutil.rmtree(root, ignore_errors=True)
    REPORT["seconds"] = time.perf_counter() - start
    write_report(args.out)

    print(f"\n{'check':<16} result  seconds")
    for r in RESULTS:
        print(f"{r['name']:<16} {'PASS' if r['ok'] else 'FAIL':<6}  {r['seconds']:7.1f}")
    failed = [r["name"] for r in RESULTS if not r["ok"]]
    print(
        f"\n{'FAILED: ' + ', '.join(failed) if failed else 'all checks passed'}"
        f" in {REPORT['seconds']:.0f} s; JSON: {args.out}"
    )
    return 1 if failed else 0


if __name__ == "__main__":
    code = main()
    sys.stdout.flush()
    sys.stderr.flush()
    # Skip interpreter teardown: gloo/NCCL destructors can abort after all work is done
    # (tests/distributed.py does the same); the results are already written.
    os._exit(code)
