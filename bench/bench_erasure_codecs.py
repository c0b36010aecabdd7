"""Which erasure codec for the memory tier (issue 39): zfec, pyeclib's backends and numpy
XOR parity next to memcpy of the same bytes, in one run.

A group is k ranks holding ``--mb`` MB each (the k data blocks); the codec makes m parity
blocks of the same size, and "rebuild" restores the first m data blocks from the m
parity blocks and the k - m surviving data blocks. Throughput is GB/s of group data
(k x mb) in, for encode and for rebuild alike; memcpy is ``np.copyto`` of those k x mb
bytes into a buffer allocated beforehand, the floor. Every rebuild is checked byte for
byte against the original blocks. All codecs run on the calling thread; the second
table says how much CPU each used per second of wall time (1.0: one core) and how fast
another Python thread ran while it encoded in the background (about 100 %: the codec
releases the GIL; about 0 %: it holds it for the whole call).

Each library is called once per group (whole blocks) and once per stripe of
``--stripe-kb`` KiB of group data (k pieces of 1/k each, the layout issue 39 plans):
zfec ``Encoder``/``Decoder`` on memoryviews of the blocks (returns only the parity or
the lost pieces); pyeclib ``ECDriver`` per backend, whose ``encode`` takes one ``bytes``
(not a memoryview or bytearray), so the k pieces are joined inside the timed call, and
returns k + m fragments, each a copy with an 80-byte header, of which the timed encode
keeps the m parity ones; its rebuild is ``reconstruct`` of the m lost fragments from
the fragments ``encode`` made. A whole group of 2 GiB or more is not given to pyeclib
(liberasurecode segfaults on it: its sizes are C ints). For m = 1,
numpy XOR on uint64 views into a parity buffer allocated beforehand: ``^=`` block by
block, ``^=`` stripe by stripe, and ``np.bitwise_xor.reduce`` over the k x n view.
Backends that cannot be created are reported with the error, not measured. Median of
``--reps`` runs after a warm-up, in wall time and in CPU time of the calling thread
(user + system, page faults included; in the JSON). The lowest CPU seconds per wall
second of any measurement is printed: under about 0.95 another process took the core.

    python bench/bench_erasure_codecs.py [--mb 64 256] [--reps 3] [--stripe-kb 128]
        [--backends NAME ...] [--json OUT]
"""

from __future__ import annotations

import argparse
import importlib.metadata
import itertools
import json
import os
import platform
import statistics
import threading
import time
import warnings
from collections.abc import Callable

import numpy as np

CONFIGS = [(2, 1), (4, 1), (4, 2), (8, 2)]
BACKENDS = [
    "liberasurecode_rs_vand",
    "isa_l_rs_vand",
    "isa_l_rs_cauchy",
    "jerasure_rs_vand",
    "jerasure_rs_cauchy",
]
STRIPE = 128 * 1024  # group data per codec call in the striped variants: k pieces of 1/k
TABLES = [("GB/s (wall time)", "gb_s")]  # + ("GB per CPU second", "gb_per_cpu_s"): JSON
MAX_PAYLOAD = 2**31 - 1  # liberasurecode sizes are C ints: a 2 GiB payload segfaults


def measure(fn: Callable[[], object], reps: int) -> tuple[float, float, float]:
    """Median wall seconds and median CPU seconds (of the calling thread, user + system)
    of ``reps`` calls after a warm-up, and CPU seconds per wall second over them."""
    fn()
    walls, cpus = [], []
    cpu0, wall0 = time.process_time(), time.perf_counter()
    for _ in range(reps):
        start, start_cpu = time.perf_counter(), time.thread_time()
        fn()
        cpus.append(time.thread_time() - start_cpu)
        walls.append(time.perf_counter() - start)
    cpu, wall = time.process_time() - cpu0, time.perf_counter() - wall0
    return statistics.median(walls), statistics.median(cpus), cpu / wall


def progress_beside(fn: Callable[[], object]) -> float:
    """Python loop iterations per second on this thread while ``fn`` runs (for at least
    half a second, repeated) on another thread."""
    done = [False]

    def work() -> None:
        end = time.perf_counter() + 0.5
        fn()
        while time.perf_counter() < end:
            fn()
        done[0] = True

    worker = threading.Thread(target=work)
    n, start = 0, time.perf_counter()
    worker.start()
    while not done[0]:
        n += 1
    rate = n / (time.perf_counter() - start)
    worker.join()
    return rate


def background_progress(fn: Callable[[], object]) -> float:
    """How fast a Python loop runs while ``fn`` runs on another thread, as a share of its
    speed beside a thread that sleeps (which releases the GIL)."""
    return progress_beside(fn) / progress_beside(lambda: time.sleep(0.05))


def same(a: object, b: np.ndarray) -> bool:
    return np.array_equal(np.frombuffer(a, dtype=np.uint8), b.view(np.uint8))


class Xor:
    """m = 1 parity with numpy: ``mode`` is "whole" (``^=`` block by block), "chunked"
    (all blocks one ``stripe`` of bytes each at a time: the parity piece stays in cache)
    or "reduce" (``np.bitwise_xor.reduce`` over the rows)."""

    def __init__(self, mode: str, nbytes: int, stripe: int) -> None:
        self.mode, self.step = mode, stripe // 8
        self.out = np.empty(nbytes // 8, dtype=np.uint64)

    def xor(self, blocks: np.ndarray) -> np.ndarray:
        """XOR of the rows of ``blocks`` (j x n uint64) into the parity buffer."""
        out = self.out
        if self.mode == "whole":
            np.bitwise_xor(blocks[0], blocks[1], out=out)
            for b in blocks[2:]:
                np.bitwise_xor(out, b, out=out)
        elif self.mode == "chunked":
            step = self.step
            for lo in range(0, len(out), step):
                hi = lo + step
                o = out[lo:hi]
                np.bitwise_xor(blocks[0][lo:hi], blocks[1][lo:hi], out=o)
                for b in blocks[2:]:
                    np.bitwise_xor(o, b[lo:hi], out=o)
        else:
            np.bitwise_xor.reduce(blocks, axis=0, out=out)
        return out


Stripes = list[tuple[int, int]]


def stripes(nbytes: int, stripe: int | None) -> Stripes:
    """Byte ranges of one block the codec is called on: the whole block, or stripes."""
    step = stripe or nbytes
    return [(lo, min(lo + step, nbytes)) for lo in range(0, nbytes, step)]


def zfec_codec(blocks: list[np.ndarray], m: int, parts: Stripes):
    """Encode returns the parity of every stripe; rebuild the m lost blocks' stripes."""
    import zfec

    k = len(blocks)
    encoder, decoder = zfec.Encoder(k, k + m), zfec.Decoder(k, k + m)
    views = [memoryview(b) for b in blocks]
    parity_nums = tuple(range(k, k + m))
    nums = (*parity_nums, *range(m, k))

    def encode() -> list[list[bytes]]:
        return [encoder.encode(tuple(v[lo:hi] for v in views), parity_nums) for lo, hi in parts]

    def rebuilder(parity: list[list[bytes]]):
        survivors = [(*p, *(v[lo:hi] for v in views[m:])) for p, (lo, hi) in zip(parity, parts)]

        def rebuild() -> list[list[bytes]]:
            return [decoder.decode(s, nums)[:m] for s in survivors]

        def check(out: list[list[bytes]]) -> bool:
            return all(
                same(o[i], blocks[i][lo:hi]) for o, (lo, hi) in zip(out, parts) for i in range(m)
            )

        return rebuild, check

    return encode, rebuilder


def pyeclib_codec(blocks: list[np.ndarray], m: int, parts: Stripes, backend: str):
    """Encode joins each stripe's k pieces into the one ``bytes`` pyeclib takes and
    returns its k + m fragments; rebuild is ``reconstruct`` of the m lost fragments from
    the fragments ``encode`` made."""
    from pyeclib.ec_iface import ECDriver

    k = len(blocks)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", FutureWarning)  # jerasure is deprecated
        driver = ECDriver(k=k, m=m, ec_type=backend)
    views = [memoryview(b) for b in blocks]
    lost = list(range(m))

    def encode() -> list[list[bytes]]:
        return [driver.encode(b"".join([v[lo:hi] for v in views])) for lo, hi in parts]

    def parity() -> list[list[bytes]]:  # timed: what the memory tier keeps
        return [driver.encode(b"".join([v[lo:hi] for v in views]))[k:] for lo, hi in parts]

    def rebuilder(frags: list[list[bytes]]):
        def rebuild() -> list[list[bytes]]:
            return [driver.reconstruct(f[m:], lost) for f in frags]

        def check(out: list[list[bytes]]) -> bool:
            for o, f, (lo, hi) in zip(out, frags, parts):
                header = len(f[0]) - (hi - lo)
                if not all(same(memoryview(o[i])[header:], blocks[i][lo:hi]) for i in lost):
                    return False
            return True

        return rebuild, check

    return parity, encode, rebuilder


def xor_codec(words: np.ndarray, mode: str, stripe: int):
    """m = 1: numpy XOR of the k uint64 rows into a parity buffer allocated beforehand;
    rebuild XORs parity and the k - 1 survivors (received into one buffer) into block 0."""
    x = Xor(mode, words.shape[1] * 8, stripe)

    def encode() -> np.ndarray:
        return x.xor(words).copy()  # the copy is untimed: rebuilder's input only

    def rebuilder(parity: np.ndarray):
        survivors = np.vstack([parity, words[1:]])

        def rebuild() -> np.ndarray:
            return x.xor(survivors)

        return rebuild, lambda out: np.array_equal(out, words[0])

    return (lambda: x.xor(words)), encode, rebuilder


def bench_config(
    k: int, m: int, mb: int, reps: int, backends: list[str], stripe: int
) -> list[dict]:
    nbytes = mb * 2**20
    rng = np.random.default_rng(k * 100 + m)
    data = np.frombuffer(rng.bytes(k * nbytes), dtype=np.uint8).copy()
    blocks = [data[i * nbytes : (i + 1) * nbytes] for i in range(k)]
    words = data.view(np.uint64).reshape(k, -1)
    group = k * nbytes
    gil = (k, m) == (4, 1)  # the background-thread check, once per --mb
    rows = []

    def row(codec: str, enc: tuple[float, ...], reb: tuple[float, ...], **extra) -> None:
        r = {
            "codec": codec,
            "k": k,
            "m": m,
            "mb": mb,
            "encode_s": enc[0],
            "encode_gb_s": group / enc[0] / 1e9,
            "encode_cpu_s": enc[1],
            "encode_gb_per_cpu_s": group / enc[1] / 1e9,
            "encode_cpu_per_wall": enc[2],
            "rebuild_s": reb[0],
            "rebuild_gb_s": group / reb[0] / 1e9,
            "rebuild_cpu_s": reb[1],
            "rebuild_gb_per_cpu_s": group / reb[1] / 1e9,
            "rebuild_cpu_per_wall": reb[2],
            **extra,
        }
        rows.append(r)
        print(
            f"  {codec:42s} {k}+{m} {mb:4d} MB  encode {r['encode_gb_s']:6.2f} GB/s"
            f"  rebuild {r['rebuild_gb_s']:6.2f} GB/s  (per CPU s: {r['encode_gb_per_cpu_s']:.2f}"
            f" / {r['rebuild_gb_per_cpu_s']:.2f})",
            flush=True,
        )

    def run(codec: str, encode, rebuilder, timed_encode=None) -> None:
        timed_encode = timed_encode or encode
        enc = measure(timed_encode, reps)
        rebuild, check = rebuilder(encode())
        reb = measure(rebuild, reps)
        assert check(rebuild()), f"{codec} {k}+{m}: rebuilt bytes differ from the original"
        extra = {"gil": background_progress(timed_encode)} if gil else {}
        row(codec, enc, reb, **extra)

    dst = np.empty_like(data)
    t = measure(lambda dst=dst: np.copyto(dst, data), reps)
    row("memcpy", t, t)
    del dst

    piece = stripe // k // 64 * 64  # bytes of each block per call
    tag = f", {stripe // 1024} KiB stripes"
    if m == 1:
        for mode, name in [("whole", "^="), ("chunked", f"^={tag}"), ("reduce", "reduce")]:
            timed, encode, rebuilder = xor_codec(words, mode, piece)
            run(f"numpy XOR {name}", encode, rebuilder, timed)
    for parts, suffix in [(stripes(nbytes, None), ""), (stripes(nbytes, piece), tag)]:
        run(f"zfec{suffix}", *zfec_codec(blocks, m, parts))
    for backend in backends:
        for parts, suffix in [(stripes(nbytes, None), ""), (stripes(nbytes, piece), tag)]:
            codec = f"pyeclib {backend}{suffix}"
            try:
                timed, encode, rebuilder = pyeclib_codec(blocks, m, parts, backend)
            except Exception as exc:  # noqa: BLE001 - recorded as the reason it failed
                error = f"{type(exc).__name__}: {exc}"
                rows.append(
                    {"codec": f"pyeclib {backend}", "k": k, "m": m, "mb": mb, "error": error}
                )
                break
            if k * (parts[0][1] - parts[0][0]) > MAX_PAYLOAD:
                error = "not run: liberasurecode segfaults on a payload of 2 GiB or more"
                rows.append({"codec": codec, "k": k, "m": m, "mb": mb, "error": error})
                continue
            run(codec, encode, rebuilder, timed)
    return rows


def version(dist: str) -> str:
    try:
        return importlib.metadata.version(dist)
    except importlib.metadata.PackageNotFoundError:
        return "not installed"


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--mb", type=int, nargs="+", default=[64, 256])
    p.add_argument("--reps", type=int, default=3)
    p.add_argument("--backends", nargs="+", default=BACKENDS)
    p.add_argument("--stripe-kb", type=int, default=STRIPE // 1024)
    p.add_argument("--json", type=str, default=None)
    args = p.parse_args()
    rows = []
    for mb in args.mb:
        for k, m in CONFIGS:
            rows.extend(bench_config(k, m, mb, args.reps, args.backends, args.stripe_kb * 1024))

    ok = [r for r in rows if "error" not in r]
    failed: dict[tuple[str, str], list[str]] = {}
    for r in rows:
        if "error" in r:
            where = f"{r['k']}+{r['m']} {r['mb']} MB"
            failed.setdefault((r["codec"], r["error"]), []).append(where)
    runs = len(CONFIGS) * len(args.mb)
    versions = {d: version(d) for d in ("numpy", "zfec", "pyeclib")}
    print(
        f"\n{platform.machine()}, {os.cpu_count()} cores, Python {platform.python_version()}, "
        + ", ".join(f"{d} {v}" for d, v in versions.items())
    )
    low = min(min(r["encode_cpu_per_wall"], r["rebuild_cpu_per_wall"]) for r in ok)
    print(f"lowest CPU s per wall s of any measurement: {low:.2f} (under ~0.95: not quiet)")
    codecs = list(dict.fromkeys(r["codec"] for r in ok))
    for mb, (what, key) in itertools.product(args.mb, TABLES):
        print(f"\n{mb} MB per rank, encode / rebuild of the k x {mb} MB of group data: {what}\n")
        print("| codec | " + " | ".join(f"{k}+{m}" for k, m in CONFIGS) + " |")
        print("|---" * (len(CONFIGS) + 1) + "|")
        for codec in codecs:
            cells = []
            for k, m in CONFIGS:
                r = next(
                    (r for r in ok if (r["codec"], r["k"], r["m"], r["mb"]) == (codec, k, m, mb)),
                    None,
                )
                cells.append(f"{r['encode_' + key]:.2f} / {r['rebuild_' + key]:.2f}" if r else "–")
            print(f"| {codec} | " + " | ".join(cells) + " |")
    print(
        "\nthreads (4+1, largest --mb): CPU s per wall s; other Python thread's "
        "speed while it encodes in the background\n"
    )
    print("| codec | encode CPU/wall | rebuild CPU/wall | Python thread beside encode |")
    print("|---|---|---|---|")
    big = max(args.mb)
    for codec in codecs:
        r = next((r for r in ok if r["codec"] == codec and r["mb"] == big and r["k"] == 4), None)
        if r and "gil" in r:
            print(
                f"| {codec} | {r['encode_cpu_per_wall']:.2f} | {r['rebuild_cpu_per_wall']:.2f}"
                f" | {r['gil']:.0%} |"
            )
    if failed:
        print("\nnot measured:")
        for (codec, err), where in failed.items():
            print(f"- {codec}: {err} ({'all' if len(where) == runs else ', '.join(where)})")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(
                {
                    "machine": {
                        "arch": platform.machine(),
                        "cores": os.cpu_count(),
                        "python": platform.python_version(),
                    },
                    "versions": versions,
                    "failed": [
                        {"codec": c, "error": e, "configs": w} for (c, e), w in failed.items()
                    ],
                    "rows": ok,
                },
                f,
                indent=2,
            )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
