"""Incremental saves vs full saves, side by side in one run.

  lora      a Llama-shaped model in plain torch (token embedding, N blocks of q/k/v/o
            attention and a gated MLP, RMS norms, LM head; base weights bf16 and
            frozen), LoRA adapters of rank r on q and v (fp32, trained by AdamW): the
            frozen base is >= 95 % of the bytes. A ``TrainState`` (model, optimizer,
            scheduler, step) is saved every step by a ``CheckpointManager`` with and
            without ``incremental=True``; between saves one real training step (forward,
            backward, optimizer step on random tokens). Per save: bytes written, the
            bytes that really changed since the previous save (tensor by tensor,
            compared with a copy), seconds.
  pretrain  the same model with every weight trained (fp32, AdamW): everything
            changes, so incremental can only cost (the xxh3-128 of every chunk, on
            the hasher thread beside the writes). Saves alternate between the two
            managers; medians over saves 2..S (the first save of each is full).
  s3        the lora run with a remote tier on a local moto S3 server: bytes and
            seconds per upload (the ``upload`` events).
  compress  per kind of state (bf16 frozen weights, fp32 trained weights, AdamW's
            exp_avg and exp_avg_sq, after the pretrain run's steps): the compressed
            size with zstd level 3 in 4 MiB blocks (``RemoteTier(compress=True)``),
            compression and decompression GB/s on one core; and the lora run's
            uploads to S3 with and without compression (seconds, bytes stored).
  hashes    one core's throughput of xxh3-64 (the checksums), xxh3-128 (the content
            identity) and blake3 (1 thread and all threads, if installed) over the
            same bytes, against a memcpy of them and a write + fsync of them to the
            same disk.

    python bench/bench_incremental.py [--hidden 1024] [--layers 8] [--saves 5] [--reps 2]
                                      [--parts hashes,lora,pretrain,compression,s3]

Prints a table, writes bench/results/incremental.json.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch
import xxhash
from torch import nn

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_object_store import start_server  # noqa: E402

import shardpoint  # noqa: E402

RESULTS = Path(__file__).parent / "results"


class LoRALinear(nn.Module):
    """A frozen linear layer plus a trained low-rank update (B @ A, B starts at 0)."""

    def __init__(self, base: nn.Linear, rank: int) -> None:
        super().__init__()
        self.base = base
        self.a = nn.Parameter(torch.randn(rank, base.in_features) * 0.01)
        self.b = nn.Parameter(torch.zeros(base.out_features, rank))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.base(x) + (x.float() @ self.a.t() @ self.b.t()).to(x.dtype)


class Block(nn.Module):
    def __init__(self, hidden: int, heads: int) -> None:
        super().__init__()
        self.heads = heads
        self.norm1 = nn.RMSNorm(hidden)
        self.norm2 = nn.RMSNorm(hidden)
        self.q, self.k, self.v, self.o = (nn.Linear(hidden, hidden, bias=False) for _ in range(4))
        mlp = hidden * 11 // 4
        self.gate = nn.Linear(hidden, mlp, bias=False)
        self.up = nn.Linear(hidden, mlp, bias=False)
        self.down = nn.Linear(mlp, hidden, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, h = x.shape
        y = self.norm1(x)
        q, k, v = (
            p(y).view(b, t, self.heads, -1).transpose(1, 2) for p in (self.q, self.k, self.v)
        )
        att = nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True)
        x = x + self.o(att.transpose(1, 2).reshape(b, t, h))
        y = self.norm2(x)
        return x + self.down(nn.functional.silu(self.gate(y)) * self.up(y))


class Llama(nn.Module):
    def __init__(self, vocab: int, hidden: int, layers: int, heads: int) -> None:
        super().__init__()
        self.embed = nn.Embedding(vocab, hidden)
        self.blocks = nn.ModuleList(Block(hidden, heads) for _ in range(layers))
        self.norm = nn.RMSNorm(hidden)
        self.head = nn.Linear(hidden, vocab, bias=False)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        x = self.embed(tokens)
        for block in self.blocks:
            x = block(x)
        return self.head(self.norm(x))


def make_job(args: argparse.Namespace, lora: bool) -> tuple[nn.Module, shardpoint.TrainState]:
    torch.manual_seed(0)
    model = Llama(args.vocab, args.hidden, args.layers, args.hidden // 64)
    if lora:
        model = model.to(torch.bfloat16).requires_grad_(False)
        for block in model.blocks:
            block.q = LoRALinear(block.q, args.rank)
            block.v = LoRALinear(block.v, args.rank)
    trained = [p for p in model.parameters() if p.requires_grad]
    opt = torch.optim.AdamW(trained, lr=1e-4)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: 1.0)
    return model, shardpoint.TrainState(model=model, optimizer=opt, scheduler=sched)


def train_step(model: nn.Module, state: shardpoint.TrainState, vocab: int) -> None:
    tokens = torch.randint(0, vocab, (1, 16))
    logits = model(tokens)
    loss = nn.functional.cross_entropy(logits.float().view(-1, vocab), tokens.view(-1))
    loss.backward()
    state.optimizer.step()
    state.optimizer.zero_grad(set_to_none=True)
    state.scheduler.step()
    state.step += 1


def tensors(state: shardpoint.TrainState) -> dict[str, torch.Tensor]:
    out = {f"model.{k}": v for k, v in state.model.state_dict().items()}
    for i, s in state.optimizer.state.items():
        for k, v in s.items():
            if torch.is_tensor(v):
                out[f"optim.{i}.{k}"] = v
    return out


def changed_bytes(now: dict[str, torch.Tensor], before: dict[str, torch.Tensor] | None) -> int:
    return sum(
        t.numel() * t.element_size()
        for k, t in now.items()
        if before is None or k not in before or not torch.equal(before[k], t)
    )


def run_saves(args: argparse.Namespace, root: Path, lora: bool, incremental: bool, **kw) -> dict:
    model, state = make_job(args, lora)
    manager = shardpoint.CheckpointManager(
        root,
        retention=shardpoint.RetentionPolicy(keep_last=2),
        incremental=incremental,
        preemption_signals=(),
        **kw,
    )
    rows, before = [], None
    for step in range(1, args.saves + 1):
        train_step(model, state, args.vocab)
        now = tensors(state)
        changed = changed_bytes(now, before)
        before = {k: v.clone() for k, v in now.items()}
        info = manager.save(step, state, force=True)
        index = (manager.path_for(step) / "index.json").stat().st_size
        manager.wait_for_uploads()
        rows.append(
            {
                "step": step,
                "bytes_written": info.bytes_written,
                "index_bytes": index,
                "changed_bytes": changed,
                "seconds": info.seconds,
            }
        )
    uploads = [e for e in manager.events.read() if e["event"] == "upload"]
    manager.close()
    total = sum(t.numel() * t.element_size() for t in before.values())  # type: ignore[union-attr]
    return {"rows": rows, "state_bytes": total, "uploads": uploads}


def summary(run: dict) -> dict:
    later = run["rows"][1:]
    return {
        "state_bytes": run["state_bytes"],
        "first_save_bytes": run["rows"][0]["bytes_written"],
        "median_bytes_written": statistics.median(r["bytes_written"] for r in later),
        "median_changed_bytes": statistics.median(r["changed_bytes"] for r in later),
        "max_written_over_changed": max(
            (r["bytes_written"] + r["index_bytes"]) / max(r["changed_bytes"], 1) for r in later
        ),
        "median_seconds": statistics.median(r["seconds"] for r in later),
    }


def alternate(args: argparse.Namespace, tmp: Path, lora: bool, reps: int) -> dict[str, list]:
    """Full and incremental runs interleaved, ``reps`` times each (noise hits both)."""
    out: dict[str, list] = {"full": [], "incremental": []}
    for rep in range(reps):
        for kind in ("full", "incremental"):
            root = tmp / f"{'lora' if lora else 'pretrain'}-{kind}-{rep}"
            out[kind].append(summary(run_saves(args, root, lora, kind == "incremental")))
            shutil.rmtree(root)
    return out


def hash_rates(tmp: Path, nbytes: int) -> dict[str, float]:
    data = torch.randint(0, 255, (nbytes,), dtype=torch.uint8).numpy()
    rates: dict[str, float] = {}

    def rate(name: str, fn) -> None:  # noqa: ANN001
        best = min(_timed(fn) for _ in range(3))
        rates[name] = nbytes / best / 1e9

    rate("xxh3-64", lambda: xxhash.xxh3_64_hexdigest(data))
    rate("xxh3-128", lambda: xxhash.xxh3_128_hexdigest(data))
    try:
        import blake3
    except ImportError:
        rates["blake3"] = float("nan")
    else:
        rate("blake3 (1 thread)", lambda: blake3.blake3(data).hexdigest())
        rate("blake3 (all threads)", lambda: blake3.blake3(data, max_threads=-1).hexdigest())
    dst = torch.empty(nbytes, dtype=torch.uint8)
    src = torch.from_numpy(data)
    rate("memcpy", lambda: dst.copy_(src))

    def write() -> None:
        path = tmp / "raw.bin"
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
        try:
            os.write(fd, memoryview(data))
            os.fsync(fd)
        finally:
            os.close(fd)
        path.unlink()

    rate("disk write + fsync", write)
    return rates


def _timed(fn) -> float:  # noqa: ANN001
    start = time.perf_counter()
    fn()
    return time.perf_counter() - start


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--hidden", type=int, default=1024)
    p.add_argument("--layers", type=int, default=8)
    p.add_argument("--vocab", type=int, default=8192)
    p.add_argument("--rank", type=int, default=8)
    p.add_argument("--saves", type=int, default=5)
    p.add_argument("--reps", type=int, default=2)
    p.add_argument("--parts", default="hashes,lora,pretrain,compression,s3")
    args = p.parse_args()
    parts = args.parts.split(",")
    tmp = Path(tempfile.mkdtemp(prefix="sp-incremental-", dir=os.environ.get("BENCH_DIR")))
    try:
        results: dict[str, object] = {"args": vars(args)}
        if "hashes" in parts:
            results["hashes_gb_per_s"] = hash_rates(tmp, 512 * 1024 * 1024)
        if "lora" in parts:
            results["lora"] = alternate(args, tmp, True, args.reps)
        if "pretrain" in parts:
            results["pretrain"] = alternate(args, tmp, False, args.reps)
        if "compression" in parts:
            results["compression"] = compression_by_kind(args)
        if "s3" in parts:
            results["s3"] = s3_uploads(args, tmp)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    RESULTS.mkdir(exist_ok=True)
    name = "incremental.json" if len(parts) == 5 else f"incremental-{'-'.join(parts)}.json"
    (RESULTS / name).write_text(json.dumps(results, indent=1))
    report(results)


def s3_uploads(args: argparse.Namespace, tmp: Path) -> dict[str, list]:
    import boto3

    server, endpoint = start_server()
    env = {
        "AWS_ACCESS_KEY_ID": "bench",
        "AWS_SECRET_ACCESS_KEY": "bench",
        "AWS_REGION": "us-east-1",
        "AWS_ENDPOINT_URL": endpoint,
    }
    os.environ.update(env)
    try:
        boto3.client("s3").create_bucket(Bucket="bench")
        client = boto3.client("s3")
        out = {}
        for kind in ("full", "incremental", "incremental+compress"):
            remote = shardpoint.RemoteTier(
                f"s3://bench/{kind}",
                shardpoint.RetentionPolicy(keep_last=2),
                compress=kind.endswith("compress"),
            )
            incremental = kind.startswith("incremental")
            run = run_saves(args, tmp / f"s3-{kind}", True, incremental, remote=remote)
            listing = client.list_objects_v2(Bucket="bench", Prefix=f"{kind}/")
            out[kind] = {
                "uploads": [
                    {"step": e["step"], "bytes": e["bytes"], "seconds": e["seconds"]}
                    for e in run["uploads"]
                ],
                "stored_bytes": sum(o["Size"] for o in listing.get("Contents", [])),
            }
        return out
    finally:
        server.terminate()
        server.wait()


def compression_by_kind(args: argparse.Namespace) -> dict[str, dict[str, float]]:
    from shardpoint.format import compressed

    lora_model, _ = make_job(args, True)
    model, state = make_job(args, False)
    for _ in range(3):
        train_step(model, state, args.vocab)
    kinds: dict[str, list[torch.Tensor]] = {
        "bf16 weights (frozen base)": [p for p in lora_model.parameters() if not p.requires_grad],
        "fp32 weights (trained)": list(model.parameters()),
        "AdamW exp_avg fp32": [s["exp_avg"] for s in state.optimizer.state.values()],
        "AdamW exp_avg_sq fp32": [s["exp_avg_sq"] for s in state.optimizer.state.values()],
    }
    out = {}
    for kind, tensors in kinds.items():
        raw = b"".join(t.detach().contiguous().view(torch.uint8).numpy().tobytes() for t in tensors)
        raw = raw[: 256 * 1024 * 1024]
        blocks = [
            memoryview(raw)[i : i + compressed.BLOCK] for i in range(0, len(raw), compressed.BLOCK)
        ]
        start = time.perf_counter()
        data = b"".join(compressed.compress(iter(blocks), len(raw)))
        seconds = time.perf_counter() - start
        total = len(data)
        table = compressed.parse_table(data[-65536:], total, kind, lambda lo, hi, d=data: d[lo:hi])
        start = time.perf_counter()
        back = compressed.decompress(table, 0, data, 0, len(raw), kind)
        dseconds = time.perf_counter() - start
        assert back == raw
        out[kind] = {
            "bytes": len(raw),
            "ratio": len(raw) / total,
            "compress_gb_per_s": len(raw) / seconds / 1e9,
            "decompress_gb_per_s": len(raw) / dseconds / 1e9,
        }
    return out


def report(results: dict) -> None:
    mb = 1e6
    print("\nhash / copy / write throughput, one 512 MiB buffer (GB/s):")
    for name, r in results.get("hashes_gb_per_s", {}).items():
        print(f"  {name:<22} {r:7.2f}")
    for job in [j for j in ("lora", "pretrain") if j in results]:
        print(f"\n{job}: medians of saves 2..S (each run: {results['args']['saves']} saves)")
        print(
            f"  {'kind':<12} {'state MB':>9} {'1st save MB':>11} {'written MB':>11} "
            f"{'changed MB':>11} {'max (written+index)/changed':>28} {'save s':>8}"
        )
        for kind, runs in results[job].items():
            for s in runs:
                state, first = s["state_bytes"] / mb, s["first_save_bytes"] / mb
                written, changed = s["median_bytes_written"] / mb, s["median_changed_bytes"] / mb
                print(
                    f"  {kind:<12} {state:9.1f} {first:11.1f} {written:11.2f} {changed:11.2f} "
                    f"{s['max_written_over_changed']:28.3f} {s['median_seconds']:8.3f}"
                )
    print("\nzstd level 3, 4 MiB blocks, one core (first 256 MiB of each kind):")
    for kind, c in results.get("compression", {}).items():
        print(
            f"  {kind:<28} ratio {c['ratio']:5.2f}  compress {c['compress_gb_per_s']:5.2f} GB/s"
            f"  decompress {c['decompress_gb_per_s']:5.2f} GB/s"
        )
    if "s3" in results:
        print("\ns3 uploads (lora), per step: MB (uncompressed), seconds; stored at the end")
        for kind, run in results["s3"].items():
            cells = ", ".join(
                f"{u['step']}: {u['bytes'] / mb:.1f} MB {u['seconds']:.2f}s" for u in run["uploads"]
            )
            print(f"  {kind:<22} {cells}; stored {run['stored_bytes'] / mb:.1f} MB")


if __name__ == "__main__":
    main()
