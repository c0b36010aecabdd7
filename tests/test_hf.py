"""Hugging Face layout: export loads in transformers / huggingface_hub, import reads
only each rank's slices, conversions keep every tensor."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch
import transformers  # a dev dependency: missing, these tests fail (never skip)

import shardpoint
from shardpoint import CheckpointError, StateMismatchError, export_hf, load_hf
from shardpoint.hf import HF_INDEX, HF_SINGLE, parse_size


def llama_config(width: int = 64):
    return transformers.LlamaConfig(
        vocab_size=4 * width,
        hidden_size=width,
        intermediate_size=2 * width,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=64,
        tie_word_embeddings=False,
    )


def llama(seed: int, width: int = 64):
    torch.manual_seed(seed)
    return transformers.LlamaForCausalLM(llama_config(width)).eval()


def logits(model, tokens):
    with torch.no_grad():
        return model(tokens).logits


TOKENS = torch.arange(24).reshape(2, 12) * 7 % 256


def test_parse_size_follows_huggingface_hub_units():
    assert parse_size("5GB") == 5 * 10**9 and parse_size("2GiB") == 2 * 2**30
    assert parse_size("500MB") == 500 * 10**6 and parse_size(1234) == 1234
    with pytest.raises(ValueError):
        parse_size("five gigs")


def test_export_writes_the_sharded_layout_with_index_and_pt_metadata(tmp_path):
    from safetensors import safe_open

    state = {"model": {f"w{i}": torch.randn(100, 10) for i in range(5)}, "step": 3}
    shardpoint.save(state, tmp_path / "ckpt")
    result = export_hf(tmp_path / "ckpt", tmp_path / "hf", prefix="model.", max_shard_size="9KB")
    assert result.files == [f"model-0000{k}-of-00003.safetensors" for k in (1, 2, 3)]
    index = json.loads((tmp_path / "hf" / HF_INDEX).read_text())
    assert index["metadata"]["total_size"] == 5 * 4000
    assert set(index["weight_map"]) == {f"w{i}" for i in range(5)}
    for name, file in index["weight_map"].items():
        with safe_open(str(tmp_path / "hf" / file), "pt") as f:
            assert f.metadata() == {"format": "pt"}
            assert torch.equal(f.get_tensor(name), state["model"][name])


def test_a_failed_export_leaves_no_half_export_and_can_be_run_again(tmp_path, monkeypatch):
    """A source file failing its checksum (here: the third file's write failing) used
    to leave the finished files, and the next try refused the directory as holding an
    export; a killed export's .tmp files are not in the way either."""
    import shardpoint.hf as hf

    state = {"model": {f"w{i}": torch.randn(100, 10) for i in range(5)}}
    shardpoint.save(state, tmp_path / "ckpt")
    real, calls = hf._write_hf_file, []

    def third_fails(reader, out, file, *args):  # noqa: ANN001, ANN002, ANN202
        calls.append(file)
        if len(calls) == 3:
            (tmp_path / "hf" / f"{file}.tmp").write_bytes(b"half")  # as a killed export
            raise shardpoint.CorruptCheckpointError("checksum mismatch (injected)")
        return real(reader, out, file, *args)

    monkeypatch.setattr(hf, "_write_hf_file", third_fails)
    with pytest.raises(shardpoint.CorruptCheckpointError, match="injected"):
        export_hf(tmp_path / "ckpt", tmp_path / "hf", prefix="model.", max_shard_size="9KB")
    assert [p.name for p in (tmp_path / "hf").iterdir()] == ["model-00003-of-00003.safetensors.tmp"]
    monkeypatch.setattr(hf, "_write_hf_file", real)
    result = export_hf(tmp_path / "ckpt", tmp_path / "hf", prefix="model.", max_shard_size="9KB")
    assert len(result.files) == 3 and (tmp_path / "hf" / HF_INDEX).exists()


def test_an_exported_file_ends_before_its_header_could_pass_the_readers_limit(
    tmp_path, monkeypatch
):
    """Many small tensors of long names: the export's files end by the header budget
    the saves use, not only by bytes, so every file's header stays readable."""
    from safetensors import safe_open

    import shardpoint.layout as layout

    state = {f"layer.{i}.{'x' * 40}": torch.full((2,), float(i)) for i in range(100)}
    shardpoint.save(state, tmp_path / "ckpt")
    monkeypatch.setattr(layout, "HEADER_BUDGET", 4096)
    result = export_hf(tmp_path / "ckpt", tmp_path / "hf")
    assert len(result.files) > 1  # by bytes alone (800 B) one file would hold them all
    index = json.loads((tmp_path / "hf" / HF_INDEX).read_text())
    assert set(index["weight_map"]) == set(state)
    for file in result.files:
        header = int.from_bytes((tmp_path / "hf" / file).read_bytes()[:8], "little")
        assert header <= 4096
    for name, file in index["weight_map"].items():
        with safe_open(str(tmp_path / "hf" / file), "pt") as f:
            assert torch.equal(f.get_tensor(name), state[name])


def test_a_model_that_fits_one_shard_is_a_single_file_without_index(tmp_path):
    shardpoint.save({"a": torch.ones(3)}, tmp_path / "ckpt")
    export_hf(tmp_path / "ckpt", tmp_path / "hf")
    assert sorted(p.name for p in (tmp_path / "hf").iterdir()) == [HF_SINGLE]


def test_export_casts_renames_and_refuses_collisions(tmp_path):
    from safetensors import safe_open

    state = {"model": {"attn": {"w": torch.randn(4, 4)}, "ids": torch.arange(3)}}
    shardpoint.save(state, tmp_path / "ckpt")
    export_hf(
        tmp_path / "ckpt",
        tmp_path / "hf",
        prefix="model.",
        dtype="bf16",
        rename=[("attn", "self_attn")],
    )
    with safe_open(str(tmp_path / "hf" / HF_SINGLE), "pt") as f:
        assert sorted(f.keys()) == ["ids", "self_attn.w"]
        assert f.get_tensor("self_attn.w").dtype == torch.bfloat16
        assert f.get_tensor("ids").dtype == torch.int64  # only floating tensors are cast
    with pytest.raises(CheckpointError, match="would both be exported"):
        export_hf(tmp_path / "ckpt", tmp_path / "hf2", rename=[(r"\..*", "")])
    with pytest.raises(shardpoint.CheckpointExistsError):
        export_hf(tmp_path / "ckpt", tmp_path / "hf", prefix="model.")


# ---- a Llama trained on 4 FSDP2 ranks, exported, loaded by transformers ------------------


def _train_and_save_fsdp(rank: int, world: int, path: str) -> None:
    from torch.distributed.fsdp import fully_shard

    model = llama(0).train()
    for layer in model.model.layers:
        fully_shard(layer)
    fully_shard(model)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    loss = model(TOKENS, labels=TOKENS).loss
    loss.backward()
    opt.step()
    shardpoint.save({"model": model, "step": 1}, path)


@pytest.mark.slow
def test_export_of_a_4_rank_fsdp2_checkpoint_loads_in_transformers_with_identical_logits(tmp_path):
    from distributed import run_ranks
    from huggingface_hub import load_torch_model

    run_ranks(4, _train_and_save_fsdp, str(tmp_path / "ckpt"))
    with shardpoint.open(tmp_path / "ckpt") as r:
        assert r.metadata["world_size"] == 4
        assert len(r.entry("model.lm_head.weight").chunks) == 4  # really sharded
    reference = llama(1)  # other init; everything comes from the checkpoint
    shardpoint.load({"model": reference, "step": 0}, tmp_path / "ckpt")

    out = tmp_path / "hf"
    result = export_hf(tmp_path / "ckpt", out, prefix="model.", max_shard_size="100KB")
    assert len(result.files) > 1
    llama_config().save_pretrained(out)  # the config comes from the user, not from us
    loaded = transformers.LlamaForCausalLM.from_pretrained(out).eval()
    assert torch.equal(logits(loaded, TOKENS), logits(reference, TOKENS))
    for name, value in reference.state_dict().items():
        assert torch.equal(loaded.state_dict()[name], value), name

    via_hub = llama(2)
    load_torch_model(via_hub, out)
    assert torch.equal(logits(via_hub, TOKENS), logits(reference, TOKENS))


@pytest.mark.slow
def test_export_streams_tensor_by_tensor(tmp_path):
    """Peak RSS growth of an export (over the process after imports) stays below twice
    the largest tensor + 256 MiB, on a 1.1 GB state; measured in a fresh process."""
    largest = 256 * 1024**2
    state = {f"layer{i}": torch.full((largest // 4,), float(i)) for i in range(4)}
    state.update({f"norm{i}": torch.ones(1000) for i in range(50)})
    shardpoint.save({"model": state}, tmp_path / "ckpt")
    del state
    script = textwrap.dedent(
        f"""
        import shardpoint
        def hwm():
            for line in open("/proc/self/status"):
                if line.startswith("VmHWM:"):
                    return int(line.split()[1]) * 1024
        base = hwm()
        shardpoint.export_hf({str(tmp_path / "ckpt")!r}, {str(tmp_path / "hf")!r},
                             prefix="model.", max_shard_size="600MB")
        print(hwm() - base)
        """
    )
    out = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True)
    assert out.returncode == 0, out.stderr
    growth = int(out.stdout.split()[-1])
    assert growth < 2 * largest + 256 * 1024**2, growth / 2**20
    print(f"\nexport of 1.07 GB: peak RSS growth {growth / 2**20:.0f} MiB")
    assert len(list((tmp_path / "hf").glob("*.safetensors"))) == 2


# ---- loading an HF layout -----------------------------------------------------------------


WIDE = 512  # 1-2 MB matrices: row halves far apart compared with the read merging gap


def _load_hf_on_two_ranks(rank: int, world: int, hf_dir: str, total: int) -> None:
    from torch.distributed.fsdp import fully_shard

    model = llama(5, WIDE)
    for layer in model.model.layers:
        fully_shard(layer)
    fully_shard(model)
    read = [0]
    real = os.preadv

    def counting(fd, buffers, offset, *flags):  # noqa: ANN001, ANN002, ANN202
        n = real(fd, buffers, offset, *flags)
        read[0] += n
        return n

    os.preadv = counting
    try:
        load_hf(model, hf_dir)
    finally:
        os.preadv = real
    # Each rank reads its half (row shards), not the whole model. Slack: reads of small
    # pieces less than 64 KiB apart are merged into one call (norm weights here).
    assert read[0] <= 0.55 * total, (read[0], total)
    print(f"\nrank {rank}: read {read[0]} of {total} bytes ({read[0] / total:.3f})")
    reference = llama(3, WIDE).state_dict()
    for name, value in model.state_dict().items():
        assert torch.equal(value.full_tensor(), reference[name]), name


@pytest.mark.slow
def test_load_hf_into_a_2_rank_fsdp2_model_reads_only_each_ranks_slices(tmp_path):
    from distributed import run_ranks

    source = llama(3, WIDE)
    source.save_pretrained(tmp_path / "hf", max_shard_size="2MB")  # transformers' own writer
    assert (tmp_path / "hf" / HF_INDEX).exists()
    total = sum(v.numel() * v.element_size() for v in source.state_dict().values())
    run_ranks(2, _load_hf_on_two_ranks, str(tmp_path / "hf"), total)


def test_load_hf_casts_to_the_models_dtype_and_checks_names_and_shapes(tmp_path):
    model = llama(3)
    export = {k: v.to(torch.bfloat16) for k, v in model.state_dict().items()}
    from safetensors.torch import save_file

    save_file(export, str(tmp_path / "model.safetensors"), metadata={"format": "pt"})
    target = llama(4)
    load_hf(target, tmp_path)
    for name, value in target.state_dict().items():
        assert torch.equal(value, export[name].to(torch.float32)), name
    with pytest.raises(StateMismatchError, match="missing"):
        load_hf({"not.in.file": torch.zeros(2)}, tmp_path / "model.safetensors")
    with pytest.raises(StateMismatchError, match="shape"):
        load_hf({"lm_head.weight": torch.zeros(3, 3)}, tmp_path, strict=False)


def test_files_of_every_float8_the_reference_library_writes_import(tmp_path):
    """``F8_E8M0`` (MX scales), ``F8_E4M3FNUZ``, ``F8_E5M2FNUZ``: valid safetensors
    files of them were refused as damaged ("unknown dtype")."""
    from safetensors.torch import save_file

    kinds = ["float8_e8m0fnu", "float8_e4m3fnuz", "float8_e5m2fnuz"]
    weights = {k: torch.arange(1.0, 5.0).to(getattr(torch, k)) for k in kinds}
    save_file(weights, str(tmp_path / "model.safetensors"))
    target = {k: torch.zeros(4, dtype=v.dtype) for k, v in weights.items()}
    load_hf(target, tmp_path)
    assert all(
        torch.equal(target[k].view(torch.uint8), v.view(torch.uint8)) for k, v in weights.items()
    )


def test_an_index_listing_a_tensor_no_file_holds_is_refused(tmp_path, capsys):
    """An incomplete download (a weight_map entry in no file) imported silently without
    it; the index's path itself, and a .bin file, are understood or named clearly."""
    from safetensors.torch import save_file

    from shardpoint.cli import main

    save_file({"a": torch.ones(2)}, str(tmp_path / "model-00001-of-00001.safetensors"))
    weight_map = {
        "a": "model-00001-of-00001.safetensors",
        "lm_head.weight": "model-00001-of-00001.safetensors",
    }
    (tmp_path / HF_INDEX).write_text(json.dumps({"weight_map": weight_map}))
    with pytest.raises(shardpoint.CorruptCheckpointError, match="lm_head.weight.*incomplete"):
        load_hf({"a": torch.zeros(2)}, tmp_path)
    assert main(["import-hf", str(tmp_path / HF_INDEX), str(tmp_path / "out")]) == 2
    assert "not in the file it names" in capsys.readouterr().err
    del weight_map["lm_head.weight"]
    (tmp_path / HF_INDEX).write_text(json.dumps({"weight_map": weight_map}))
    target = {"a": torch.zeros(2)}
    load_hf(target, tmp_path / HF_INDEX)  # the index's path: its directory
    assert torch.equal(target["a"], torch.ones(2))
    torch.save({"a": torch.ones(2)}, tmp_path / "pytorch_model.bin")
    with pytest.raises(CheckpointError, match="not a .safetensors file.*allow_pickle_weights"):
        load_hf(target, tmp_path / "pytorch_model.bin")


def test_pickle_weights_are_refused_unless_the_user_opts_in(tmp_path):
    model = torch.nn.Linear(3, 2)
    torch.save(model.state_dict(), tmp_path / "pytorch_model.bin")
    target = torch.nn.Linear(3, 2)
    with pytest.raises(CheckpointError, match="allow_pickle_weights=True"):
        load_hf(target, tmp_path)
    load_hf(target, tmp_path, allow_pickle_weights=True)
    assert torch.equal(target.weight, model.weight)


def test_pickle_weights_of_other_shapes_are_refused_before_any_is_loaded(tmp_path):
    """As for safetensors files: a .bin of a larger model used to be cut down to the
    model's shapes silently (a smaller one gave a raw torch error); another dtype is
    cast (an fp32 .bin into a bf16 model)."""
    source = torch.nn.Linear(4, 3)
    torch.save(source.state_dict(), tmp_path / "pytorch_model.bin")
    for target in (torch.nn.Linear(4, 2), torch.nn.Linear(4, 5)):
        before = {k: v.clone() for k, v in target.state_dict().items()}
        with pytest.raises(StateMismatchError, match="do not fit the model.*'weight'"):
            load_hf(target, tmp_path, allow_pickle_weights=True)
        assert all(torch.equal(v, before[k]) for k, v in target.state_dict().items())
    target = torch.nn.Linear(4, 3).bfloat16()
    load_hf(target, tmp_path, allow_pickle_weights=True)
    assert torch.equal(target.weight, source.weight.bfloat16())


def test_pickle_weights_are_read_from_the_files_the_layout_names(tmp_path):
    """A Trainer's folder also holds training_args.bin (an object, not weights) and
    may hold other .bin files: only pytorch_model.bin, or the files its index names, are
    read; a file that is not weights is a typed error naming it."""
    import argparse

    model = torch.nn.Linear(3, 2)
    weights = model.state_dict()
    torch.save({"weight": weights["weight"]}, tmp_path / "part-1.bin")
    torch.save({"bias": weights["bias"]}, tmp_path / "part-2.bin")
    torch.save(argparse.Namespace(lr=1), tmp_path / "training_args.bin")
    torch.save({"exp_avg": torch.ones(2)}, tmp_path / "optimizer.bin")
    weight_map = {"weight": "part-1.bin", "bias": "part-2.bin"}
    (tmp_path / "pytorch_model.bin.index.json").write_text(json.dumps({"weight_map": weight_map}))
    target = torch.nn.Linear(3, 2)
    load_hf(target, tmp_path, allow_pickle_weights=True)
    assert torch.equal(target.weight, model.weight) and torch.equal(target.bias, model.bias)
    with pytest.raises(CheckpointError, match="training_args.bin: not loadable as weights"):
        load_hf(target, tmp_path / "training_args.bin", allow_pickle_weights=True)
    (tmp_path / "pytorch_model.bin.index.json").unlink()
    with pytest.raises(CheckpointError, match="no pytorch_model.bin"):
        load_hf(target, tmp_path, allow_pickle_weights=True)


def test_import_hf_makes_a_checkpoint_with_the_same_tensors(tmp_path):
    model = llama(3)
    model.save_pretrained(tmp_path / "hf", max_shard_size="100KB")
    info = shardpoint.import_hf(tmp_path / "hf", tmp_path / "ckpt")
    assert info.tensors == len(model.state_dict())
    with shardpoint.open(tmp_path / "ckpt") as r:
        for name, value in model.state_dict().items():
            assert torch.equal(r.get(name), value), name


# ---- conversions ----------------------------------------------------------------------------


def test_dcp_to_shardpoint_keeps_every_tensor(tmp_path):
    import torch.distributed.checkpoint as dcp

    model = llama(3)
    opt = torch.optim.AdamW(model.parameters())
    model(TOKENS, labels=TOKENS).loss.backward()
    opt.step()
    state = {"model": model.state_dict(), "extra": {"t": torch.arange(5)}}
    dcp.save(state, checkpoint_id=str(tmp_path / "dcp"), no_dist=True)
    result = shardpoint.convert(tmp_path / "dcp", tmp_path / "ckpt", allow_pickle=True)
    assert result.source_format == "dcp" and result.skipped == []
    with shardpoint.open(tmp_path / "ckpt") as r:
        for name, value in model.state_dict().items():
            assert torch.equal(r.get(f"model.{name}"), value), name
        assert torch.equal(r.get("extra.t"), torch.arange(5))


def test_torch_save_round_trips_through_shardpoint(tmp_path):
    state = {"w": torch.randn(4, 4), "nested": {"b": torch.arange(3)}, "step": 5}
    torch.save(state, tmp_path / "in.pt")
    shardpoint.convert(tmp_path / "in.pt", tmp_path / "ckpt", allow_pickle=True)
    shardpoint.convert(tmp_path / "ckpt", tmp_path / "out.pt")
    back = torch.load(tmp_path / "out.pt", weights_only=True)
    assert torch.equal(back["w"], state["w"]) and torch.equal(
        back["nested"]["b"], state["nested"]["b"]
    )
    assert back["step"] == 5
    with pytest.raises(CheckpointError, match="already exists"):
        shardpoint.convert(tmp_path / "ckpt", tmp_path / "out.pt")


def test_a_torch_save_file_with_arbitrary_objects_is_refused(tmp_path):
    torch.save({"obj": Path("/etc")}, tmp_path / "bad.pt")
    with pytest.raises(CheckpointError, match="weights_only"):
        shardpoint.convert(tmp_path / "bad.pt", tmp_path / "ckpt", allow_pickle=True)
