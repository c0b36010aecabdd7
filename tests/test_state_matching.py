"""load checks the state it fills: keys (strict), shapes and dtypes, before reading any byte."""

import pytest
import torch
from conftest import sample_state

import shardpoint
from shardpoint.errors import StateMismatchError, UnsupportedValueError


def test_missing_and_unexpected_keys_are_listed_when_strict(ckpt_dir):
    shardpoint.save(sample_state(), ckpt_dir)
    dest = {"a": torch.zeros(64, 32), "extra": torch.zeros(2), "step": 0}
    with pytest.raises(StateMismatchError) as info:
        shardpoint.load(dest, ckpt_dir)
    msg = str(info.value)
    assert "'extra'" in msg and "'b'" in msg and str(ckpt_dir) in msg and "strict=False" in msg
    assert torch.equal(dest["a"], torch.zeros(64, 32))  # nothing was read


def test_non_strict_loads_the_keys_both_sides_have(ckpt_dir):
    state = sample_state()
    shardpoint.save(state, ckpt_dir)
    dest = {"a": torch.zeros(64, 32), "extra": torch.zeros(2)}
    shardpoint.load(dest, ckpt_dir, strict=False)
    assert torch.equal(dest["a"], state["a"]) and torch.equal(dest["extra"], torch.zeros(2))


@pytest.mark.parametrize("bad", [torch.zeros(64, 31), torch.zeros(64, 32, dtype=torch.float16)])
def test_shape_or_dtype_mismatch_is_an_error_even_when_not_strict(ckpt_dir, bad):
    shardpoint.save(sample_state(), ckpt_dir)
    with pytest.raises(StateMismatchError, match="'a': checkpoint has F32\\[64, 32\\]"):
        shardpoint.load({"a": bad}, ckpt_dir, strict=False)


def test_a_state_that_mismatches_every_tensor_gets_a_message_that_names_a_few(ckpt_dir):
    """10,000 wrong shapes: the message names the first ten and counts the rest (it
    listed all of them, 600 kB of text, before)."""
    shardpoint.save({f"p{i:05d}": torch.zeros(1) for i in range(10_000)}, ckpt_dir)
    with pytest.raises(StateMismatchError) as info:
        shardpoint.load({f"p{i:05d}": torch.zeros(2) for i in range(10_000)}, ckpt_dir)
    msg = str(info.value)
    assert "'p00000': checkpoint has F32[1], state has torch.float32[2]" in msg
    assert "'p00009'" in msg and "'p00010'" not in msg and "(+9990 more like it)" in msg
    assert len(msg) < 2000


def test_a_module_with_other_parameters_is_rejected_with_a_typed_error(ckpt_dir):
    shardpoint.save({"model": torch.nn.Linear(4, 4)}, ckpt_dir)
    with pytest.raises(StateMismatchError, match="model"):
        shardpoint.load({"model": torch.nn.Linear(4, 5)}, ckpt_dir)


def test_a_fresh_optimizer_gets_its_state_from_the_checkpoint(ckpt_dir):
    model = torch.nn.Linear(3, 3)
    opt = torch.optim.Adam(model.parameters())
    model(torch.randn(1, 3)).sum().backward()
    opt.step()
    shardpoint.save({"opt": opt}, ckpt_dir)
    opt2 = torch.optim.Adam(torch.nn.Linear(3, 3).parameters())
    shardpoint.load({"opt": opt2}, ckpt_dir)
    assert torch.equal(
        opt2.state_dict()["state"][0]["exp_avg"], opt.state_dict()["state"][0]["exp_avg"]
    )


class Opaque:
    pass


@pytest.mark.parametrize(
    "value, path",
    [
        ({"cfg": {"fn": Opaque()}}, "cfg.fn"),
        ({"xs": [1, 2, {3, 4}]}, "xs.2"),
        ({"np": __import__("numpy").float32(1.0)}, "np"),
        ({"dev": torch.device("cpu")}, "dev"),
        ({"sparse": torch.eye(3).to_sparse()}, "sparse"),
    ],
)
def test_values_that_need_pickle_are_refused_at_save_with_their_path(ckpt_dir, value, path):
    with pytest.raises(UnsupportedValueError, match=f"'{path}'"):
        shardpoint.save(value, ckpt_dir)
    assert not ckpt_dir.exists()


def test_colliding_entry_names_are_refused(ckpt_dir):
    with pytest.raises(UnsupportedValueError, match="a.b"):
        shardpoint.save({"a.b": torch.ones(1), "a": {"b": torch.ones(1)}}, ckpt_dir)
