"""save -> load gives back exactly what was saved, in place, with the same Python types."""

import math

import pytest
import torch

import shardpoint
from shardpoint.format.safetensors import DTYPES

REQUIRED_DTYPES = [
    "F64",
    "F32",
    "F16",
    "BF16",
    "I64",
    "I32",
    "I16",
    "I8",
    "U8",
    "BOOL",
    "F8_E4M3",
    "F8_E5M2",
    "F8_E4M3FNUZ",
    "F8_E5M2FNUZ",
    "F8_E8M0",
    "C64",
]


def _random(dtype: torch.dtype, shape) -> torch.Tensor:
    if dtype == torch.bool:
        return torch.rand(shape) > 0.5
    if dtype.is_complex:
        return torch.randn(shape, dtype=dtype)
    if dtype.is_floating_point:
        return torch.randn(shape).to(dtype)
    info = torch.iinfo(dtype)
    return torch.randint(max(info.min, -1000), min(info.max, 1000), shape, dtype=torch.int64).to(
        dtype
    )


def _same_bits(a: torch.Tensor, b: torch.Tensor) -> bool:
    return (
        a.dtype == b.dtype
        and a.shape == b.shape
        and torch.equal(
            a.contiguous().view(torch.uint8) if a.numel() else a,
            b.contiguous().view(torch.uint8) if b.numel() else b,
        )
    )


@pytest.mark.parametrize("name", REQUIRED_DTYPES)
@pytest.mark.parametrize("shape", [(5, 7), (), (0,), (3, 0, 2)])
def test_every_dtype_and_shape_round_trips_bit_exact(ckpt_dir, name, shape):
    torch.manual_seed(0)
    t = _random(DTYPES[name], shape)
    shardpoint.save({"t": t}, ckpt_dir)
    dest = {"t": torch.empty(shape, dtype=DTYPES[name])}
    shardpoint.load(dest, ckpt_dir)
    assert _same_bits(dest["t"].reshape(-1), t.reshape(-1))
    with shardpoint.open(ckpt_dir) as r:
        assert _same_bits(r.get("t").reshape(-1), t.reshape(-1))


def test_load_fills_existing_tensors_in_place(ckpt_dir):
    src = {"w": torch.randn(100, 10), "b": torch.randn(10)}
    shardpoint.save(src, ckpt_dir)
    dest = {"w": torch.zeros(100, 10), "b": torch.zeros(10)}
    ptrs = {k: v.data_ptr() for k, v in dest.items()}
    objs = {k: id(v) for k, v in dest.items()}
    shardpoint.load(dest, ckpt_dir)
    assert {k: v.data_ptr() for k, v in dest.items()} == ptrs
    assert {k: id(v) for k, v in dest.items()} == objs
    assert torch.equal(dest["w"], src["w"]) and torch.equal(dest["b"], src["b"])


def test_non_contiguous_views_save_their_values(ckpt_dir):
    base = torch.arange(60.0).reshape(6, 10)
    state = {"t": base.t(), "sl": base[::2, 3:7], "exp": torch.ones(1, 4).expand(5, 4)}
    shardpoint.save(state, ckpt_dir)
    dest = {
        "t": torch.zeros(10, 6).t().contiguous().t(),
        "sl": torch.zeros(3, 4),
        "exp": torch.zeros(5, 4),
    }
    dest["t"] = torch.zeros(6, 10).t()  # a non-contiguous destination is filled correctly too
    shardpoint.load(dest, ckpt_dir)
    for k in state:
        assert torch.equal(dest[k], state[k]), k


def test_tied_weights_are_stored_once_and_retied(ckpt_dir):
    emb = torch.nn.Embedding(50, 8)
    head = torch.nn.Linear(8, 50, bias=False)
    head.weight = emb.weight
    model = torch.nn.ModuleDict({"emb": emb, "head": head})
    shardpoint.save({"model": model}, ckpt_dir)
    with shardpoint.open(ckpt_dir) as r:
        assert r.alias_of("model.head.weight") == "model.emb.weight"
        stored = sum(r.entry(n).nbytes for n in r.keys() if r.alias_of(n) is None)
        assert stored == 50 * 8 * 4
        state = r.state()
    assert state["model"]["head.weight"] is state["model"]["emb.weight"]

    fresh = torch.nn.ModuleDict(
        {"emb": torch.nn.Embedding(50, 8), "head": torch.nn.Linear(8, 50, bias=False)}
    )
    fresh["head"].weight = fresh["emb"].weight
    shardpoint.load({"model": fresh}, ckpt_dir)
    assert fresh["head"].weight is fresh["emb"].weight
    assert torch.equal(fresh["emb"].weight, emb.weight)


def test_plain_values_keep_their_python_types(ckpt_dir):
    values = {
        "int": 2**70,
        "neg": -5,
        "float": 0.1,
        "negzero": -0.0,
        "nan": math.nan,
        "inf": math.inf,
        "ninf": -math.inf,
        "bool": True,
        "none": None,
        "str": "héllo ✓",
        "bytes": b"\x00\xffraw",
        "list": [1, [2, (3, 4)], {"k": ()}],
        "tuple": (1, "a", None, (2.5,)),
        "int_keys": {0: "a", 1: {2: "b"}},
        "odd_keys": {None: 1, True: 2, 1.5: 3, (1, "x"): 4, "s": 5},
        "empty": {},
    }
    shardpoint.save({"values": values}, ckpt_dir)
    dest = {"values": None}
    shardpoint.load(dest, ckpt_dir)
    got = dest["values"]
    assert math.isnan(got.pop("nan")) and math.isnan(values.pop("nan"))
    assert got == values
    assert math.copysign(1, got["negzero"]) == -1
    assert type(got["tuple"]) is tuple and type(got["tuple"][3]) is tuple
    assert type(got["list"][1][1]) is tuple
    assert list(got["int_keys"]) == [0, 1] and type(got["bool"]) is bool
    assert list(got["odd_keys"]) == [None, True, 1.5, (1, "x"), "s"]


class Counter:
    """A user Stateful object: saved through state_dict, restored through load_state_dict."""

    def __init__(self, n=0):
        self.n = n
        self.buf = torch.zeros(3)

    def state_dict(self):
        return {"n": self.n, "buf": self.buf}

    def load_state_dict(self, sd):
        self.n = sd["n"]
        self.buf = sd["buf"]


def test_stateful_objects_round_trip(ckpt_dir):
    model = torch.nn.Linear(4, 3)
    opt = torch.optim.AdamW(model.parameters(), lr=0.01)
    sched = torch.optim.lr_scheduler.StepLR(opt, step_size=2, gamma=0.5)
    for _ in range(3):
        model(torch.randn(2, 4)).sum().backward()
        opt.step()
        sched.step()
    c = Counter(7)
    c.buf += 2
    shardpoint.save({"model": model, "opt": opt, "sched": sched, "counter": c}, ckpt_dir)

    model2 = torch.nn.Linear(4, 3)
    opt2 = torch.optim.AdamW(model2.parameters(), lr=0.01)
    sched2 = torch.optim.lr_scheduler.StepLR(opt2, step_size=2, gamma=0.5)
    c2 = Counter()
    shardpoint.load({"model": model2, "opt": opt2, "sched": sched2, "counter": c2}, ckpt_dir)
    assert torch.equal(model2.weight, model.weight)
    assert sched2.state_dict() == sched.state_dict()
    assert opt2.param_groups[0]["lr"] == opt.param_groups[0]["lr"]
    for p, p2 in zip(model.parameters(), model2.parameters()):
        for k in ("exp_avg", "exp_avg_sq", "step"):
            assert torch.equal(opt.state[p][k], opt2.state[p2][k])
    assert c2.n == 7 and torch.equal(c2.buf, torch.full((3,), 2.0))
    # one more identical step keeps the two in lockstep
    x = torch.randn(2, 4)
    for m, o in ((model, opt), (model2, opt2)):
        o.zero_grad()
        m(x).sum().backward()
        o.step()
    assert torch.equal(model.weight, model2.weight)


def test_large_state_splits_into_shards_and_round_trips(ckpt_dir):
    state = {f"t{i}": torch.randn(256, 256) for i in range(10)}
    info = shardpoint.save(state, ckpt_dir, max_shard_size=600_000)
    assert info.files == 5
    dest = {k: torch.empty_like(v) for k, v in state.items()}
    shardpoint.load(dest, ckpt_dir)
    assert all(torch.equal(dest[k], state[k]) for k in state)


def test_buffered_fallback_and_direct_io_write_identical_files(tmp_path, monkeypatch):
    import shardpoint.storage.direct_io as local

    # "big" is large enough for the zero-copy path, "a" and "b" go through bounce buffers
    state = {"a": torch.randn(1000, 17), "big": torch.randn(3, 1024 * 1024), "b": torch.randn(3)}
    shardpoint.save(state, tmp_path / "direct")
    monkeypatch.setattr(local, "_DIRECT", 0)
    shardpoint.save(state, tmp_path / "buffered")
    a = sorted((tmp_path / "direct").glob("*.safetensors"))
    b = sorted((tmp_path / "buffered").glob("*.safetensors"))
    assert [p.read_bytes() for p in a] == [p.read_bytes() for p in b]
    for source in ("buffered", "direct"):
        dest = {k: torch.empty_like(v) for k, v in state.items()}
        shardpoint.load(dest, tmp_path / source)
        assert all(torch.equal(dest[k], state[k]) for k in state)


def test_large_tensors_are_placed_for_zero_copy_direct_io(ckpt_dir):
    from shardpoint.storage.io_types import ALIGN

    state = {"big": torch.randn(1024 * 1024), "small": torch.randn(5)}
    shardpoint.save(state, ckpt_dir)
    with shardpoint.open(ckpt_dir) as r:
        (chunk,) = r.entry("big").chunks
    # the file offset agrees with the tensor's address modulo the page size
    assert (chunk.begin - state["big"].data_ptr()) % ALIGN == 0


def test_blocks_larger_than_the_bounce_buffer_round_trip(ckpt_dir, monkeypatch):
    import shardpoint.storage.direct_io as local

    monkeypatch.setattr(local, "BLOCK", 8192)  # many blocks, tensors straddling block edges
    state = {f"t{i}": torch.randn(1000 + i) for i in range(20)}
    shardpoint.save(state, ckpt_dir)
    dest = {k: torch.empty_like(v) for k, v in state.items()}
    shardpoint.load(dest, ckpt_dir)
    assert all(torch.equal(dest[k], state[k]) for k in state)


@pytest.mark.parametrize("cached", [True, False])
def test_loads_through_the_page_cache_and_with_direct_io_agree(ckpt_dir, monkeypatch, cached):
    import shardpoint.storage.direct_io as local

    monkeypatch.setattr(local, "_in_page_cache", lambda path, segments: cached)
    torch.manual_seed(3)
    state = {
        "big": torch.randn(2, 1024 * 1024),
        "odd": torch.randn(300_001),
        "small": torch.randn(7),
    }
    shardpoint.save(state, ckpt_dir)
    # a destination that is not page-congruent with the file: a view 3 floats into a buffer
    backing = torch.zeros(2 * 1024 * 1024 + 3)
    dest = {
        "big": backing[3:].view(2, 1024 * 1024),
        "odd": torch.zeros(300_001),
        "small": torch.zeros(7),
    }
    shardpoint.load(dest, ckpt_dir)
    assert all(torch.equal(dest[k], state[k]) for k in state)


def test_conjugate_and_negative_views_save_their_values_and_are_refused_as_destinations(
    ckpt_dir,
):
    """A lazy ``.conj()`` shares its base's bytes but shows other values: it is saved as
    the values it shows (not as an alias of its base), and loading into one is refused
    with a typed error (the bytes written would not be the values read back)."""
    t = torch.tensor([1 + 2j, 3 - 4j], dtype=torch.complex64)
    shardpoint.save({"t": t, "c": t.conj(), "n": t.conj().imag}, ckpt_dir)
    out = {
        k: torch.zeros(2, dtype=d)
        for k, d in (("t", t.dtype), ("c", t.dtype), ("n", torch.float32))
    }
    shardpoint.load(out, ckpt_dir)
    assert torch.equal(out["t"], t) and torch.equal(out["c"], t.conj().resolve_conj())
    assert out["n"].tolist() == [-2.0, 4.0]
    base = torch.zeros(2, dtype=torch.complex64)
    with pytest.raises(shardpoint.UnsupportedValueError, match="conjugate"):
        shardpoint.load({"t": base.conj(), "c": out["c"], "n": out["n"]}, ckpt_dir)
    assert not base.any()


def test_metadata_that_json_cannot_hold_is_refused_before_a_byte_is_written(ckpt_dir):
    for bad in ({"loss": float("nan")}, {"loss": torch.tensor(0.5)}, {"x": object()}):
        with pytest.raises(shardpoint.CheckpointError, match="metadata cannot be stored"):
            shardpoint.save({"w": torch.ones(1000)}, ckpt_dir, metadata=bad)
        assert not ckpt_dir.exists() or not any(ckpt_dir.iterdir())
