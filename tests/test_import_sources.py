"""Sources that shardpoint imports from other formats.

Pickled sources (a DCP directory's ``.metadata``, a ``torch.save`` file) are read only
on an explicit opt-in, checked before anything is unpickled. Hugging Face layouts are
the user's own files: symlinks are followed (the hub cache links snapshots into its
blobs directory) and weight-map file names may hold spaces, '+' and non-ASCII letters,
while staying plain names inside the source directory.
"""

from __future__ import annotations

import hashlib
import json
import os
import pickle
from pathlib import Path

import pytest
import torch
from safetensors.torch import save_file

import shardpoint
from shardpoint import CheckpointError, CorruptCheckpointError
from shardpoint.cli import build_parser, main
from shardpoint.hf import HF_INDEX, HF_SINGLE

# ---- pickled sources need allow_pickle ------------------------------------------------------


class _Payload:
    """Unpickling this creates ``marker``: stands in for code a hostile pickle runs."""

    def __init__(self, marker: Path) -> None:
        self.marker = marker

    def __reduce__(self):  # noqa: ANN204
        return (Path.touch, (self.marker,))


def hostile_dcp_dir(root: Path, marker: Path) -> Path:
    """A directory that convert detects as DCP, whose ``.metadata`` runs a payload."""
    root.mkdir()
    (root / ".metadata").write_bytes(pickle.dumps(_Payload(marker)))
    return root


def test_the_hostile_payload_is_live_when_unpickled(tmp_path):
    """Control: the payload the refusal tests rely on really runs when unpickled."""
    pickle.loads(pickle.dumps(_Payload(tmp_path / "ran")))
    assert (tmp_path / "ran").exists()


def test_convert_refuses_a_dcp_directory_before_unpickling_its_metadata(tmp_path):
    source = hostile_dcp_dir(tmp_path / "dcp", tmp_path / "payload-ran")
    with pytest.raises(CheckpointError) as caught:
        shardpoint.convert(source, tmp_path / "out")
    message = str(caught.value)
    assert str(source / ".metadata") in message
    assert "pickle" in message and "run" in message and "allow_pickle=True" in message
    assert not (tmp_path / "payload-ran").exists()
    assert not (tmp_path / "out").exists()


def test_cli_convert_refuses_a_dcp_directory_without_allow_pickle(tmp_path, capsys):
    source = hostile_dcp_dir(tmp_path / "dcp", tmp_path / "payload-ran")
    assert main(["convert", str(source), str(tmp_path / "out")]) == 2
    assert "--allow-pickle" in capsys.readouterr().err
    assert not (tmp_path / "payload-ran").exists()


def test_convert_with_allow_pickle_converts_a_genuine_dcp_checkpoint(tmp_path, capsys):
    import torch.distributed.checkpoint as dcp

    state = {"w": torch.randn(4, 3), "inner": {"ids": torch.arange(5)}}
    dcp.save(state, checkpoint_id=str(tmp_path / "dcp"), no_dist=True)
    result = shardpoint.convert(tmp_path / "dcp", tmp_path / "lib", allow_pickle=True)
    assert result.source_format == "dcp" and result.tensors == 2
    argv = ["convert", str(tmp_path / "dcp"), str(tmp_path / "cli"), "--allow-pickle"]
    assert main(argv) == 0
    for out in ("lib", "cli"):
        with shardpoint.open(tmp_path / out) as r:
            assert torch.equal(r.get("w"), state["w"])
            assert torch.equal(r.get("inner.ids"), state["inner"]["ids"])


def test_convert_refuses_a_torch_save_file_without_allow_pickle(tmp_path, monkeypatch):
    torch.save({"w": torch.arange(4.0)}, tmp_path / "in.pt")

    def refuse(*args, **kwargs):
        raise AssertionError("torch.load ran without allow_pickle")

    with monkeypatch.context() as m:
        m.setattr(torch, "load", refuse)
        with pytest.raises(CheckpointError, match="allow_pickle=True") as caught:
            shardpoint.convert(tmp_path / "in.pt", tmp_path / "ckpt")
    assert str(tmp_path / "in.pt") in str(caught.value)
    shardpoint.convert(tmp_path / "in.pt", tmp_path / "ckpt", allow_pickle=True)
    with shardpoint.open(tmp_path / "ckpt") as r:
        assert torch.equal(r.get("w"), torch.arange(4.0))


def test_convert_help_documents_allow_pickle():
    parser = build_parser()
    text = parser._subparsers._group_actions[0].choices["convert"].format_help()
    assert "--allow-pickle" in text and "pickle" in text


# ---- Hugging Face sources: the hub cache and any plain file name ------------------------------


def small_model() -> dict[str, torch.Tensor]:
    torch.manual_seed(0)
    return {
        "embed.weight": torch.randn(16, 8),
        "layer.0.weight": torch.randn(8, 8),
        "layer.0.bias": torch.randn(8),
        "head.weight": torch.randn(4, 8).to(torch.bfloat16),
        "position_ids": torch.arange(10),
    }


def write_sharded(directory: Path, state: dict[str, torch.Tensor], names: list[str]) -> None:
    """The sharded Hugging Face layout, written with the safetensors library: tensors
    dealt round-robin into files ``names`` plus ``model.safetensors.index.json``."""
    directory.mkdir(parents=True, exist_ok=True)
    weight_map = {key: names[i % len(names)] for i, key in enumerate(state)}
    for name in names:
        part = {k: v for k, v in state.items() if weight_map[k] == name}
        save_file(part, str(directory / name), metadata={"format": "pt"})
    index = {"metadata": {"total_size": 0}, "weight_map": weight_map}
    (directory / HF_INDEX).write_text(json.dumps(index))


def as_hub_cache(layout: Path, cache: Path) -> Path:
    """Move ``layout``'s files into a huggingface_hub cache: each file's bytes in
    ``blobs/<sha256>``, and ``snapshots/<rev>/<name>`` a relative symlink to it."""
    repo = cache / "models--org--tiny"
    snapshot = repo / "snapshots" / "0123456789abcdef0123456789abcdef01234567"
    (repo / "blobs").mkdir(parents=True)
    snapshot.mkdir(parents=True)
    for f in sorted(layout.iterdir()):
        digest = hashlib.sha256(f.read_bytes()).hexdigest()
        f.rename(repo / "blobs" / digest)
        (snapshot / f.name).symlink_to(Path("..", "..", "blobs", digest))
    return snapshot


def read_with_load_hf(source: Path, tmp_path: Path) -> dict[str, torch.Tensor]:
    target = {k: torch.zeros_like(v) for k, v in small_model().items()}
    shardpoint.load_hf(target, source)
    return target


def read_with_import_hf(source: Path, tmp_path: Path) -> dict[str, torch.Tensor]:
    shardpoint.import_hf(source, tmp_path / "imported")
    with shardpoint.open(tmp_path / "imported") as r:
        return {k: r.get(k) for k in r.keys()}


def read_with_cli(source: Path, tmp_path: Path) -> dict[str, torch.Tensor]:
    assert main(["import-hf", str(source), str(tmp_path / "imported")]) == 0
    with shardpoint.open(tmp_path / "imported") as r:
        return {k: r.get(k) for k in r.keys()}


READERS = [read_with_load_hf, read_with_import_hf, read_with_cli]


def assert_same_tensors(got: dict[str, torch.Tensor], want: dict[str, torch.Tensor]) -> None:
    assert got.keys() == want.keys()
    for k in want:
        assert got[k].dtype == want[k].dtype and torch.equal(got[k], want[k]), k


@pytest.mark.parametrize("read", READERS, ids=["load_hf", "import_hf", "cli"])
def test_a_hub_cache_snapshot_of_relative_symlinks_is_read(tmp_path, read):
    state = small_model()
    layout = tmp_path / "layout"
    write_sharded(
        layout, state, ["model-00001-of-00002.safetensors", "model-00002-of-00002.safetensors"]
    )
    (layout / "config.json").write_text('{"model_type": "tiny"}')
    snapshot = as_hub_cache(layout, tmp_path / "hub")
    assert (snapshot / HF_INDEX).is_symlink()
    assert os.readlink(snapshot / "config.json").startswith("../../blobs/")
    assert_same_tensors(read(snapshot, tmp_path), state)


@pytest.mark.parametrize("read", READERS, ids=["load_hf", "import_hf", "cli"])
def test_a_hub_cache_single_file_is_read_as_directory_and_as_file(tmp_path, read):
    state = small_model()
    (tmp_path / "layout").mkdir()
    save_file(state, str(tmp_path / "layout" / HF_SINGLE), metadata={"format": "pt"})
    snapshot = as_hub_cache(tmp_path / "layout", tmp_path / "hub")
    assert_same_tensors(read(snapshot, tmp_path / "a"), state)
    assert_same_tensors(read(snapshot / HF_SINGLE, tmp_path / "b"), state)


@pytest.mark.parametrize("read", READERS, ids=["load_hf", "import_hf", "cli"])
def test_weight_map_file_names_may_hold_spaces_plus_and_non_ascii(tmp_path, read):
    state = small_model()
    names = ["model part 1.safetensors", "model+2.safetensors", "modèle-Ünïcode-3.safetensors"]
    write_sharded(tmp_path / "hf", state, names)
    assert_same_tensors(read(tmp_path / "hf", tmp_path), state)


@pytest.mark.parametrize(
    "name",
    [
        "../outside.safetensors",
        "/etc/hostname",
        "sub/x.safetensors",
        "..",
        "a\0b",
        "\ud800.safetensors",
        "",
        7,
    ],
)
def test_weight_map_names_that_leave_the_source_directory_are_refused(tmp_path, name):
    write_sharded(tmp_path / "hf", small_model(), ["model.safetensors"])
    index = json.loads((tmp_path / "hf" / HF_INDEX).read_text())
    index["weight_map"]["embed.weight"] = name
    (tmp_path / "hf" / HF_INDEX).write_text(json.dumps(index))
    with pytest.raises(CorruptCheckpointError, match="refusing file name"):
        shardpoint.import_hf(tmp_path / "hf", tmp_path / "out")


@pytest.mark.timeout(30)
@pytest.mark.parametrize("kind", ["directory", "fifo"])
def test_a_weight_map_name_that_is_not_a_regular_file_is_refused_without_hanging(tmp_path, kind):
    write_sharded(tmp_path / "hf", small_model(), ["model.safetensors"])
    odd = tmp_path / "hf" / "odd.safetensors"
    odd.mkdir() if kind == "directory" else os.mkfifo(odd)
    (tmp_path / "hf" / "link.safetensors").symlink_to(odd)  # resolving does not help
    index = json.loads((tmp_path / "hf" / HF_INDEX).read_text())
    for name in ("odd.safetensors", "link.safetensors"):
        index["weight_map"]["embed.weight"] = name
        (tmp_path / "hf" / HF_INDEX).write_text(json.dumps(index))
        with pytest.raises(CorruptCheckpointError, match="not a regular file"):
            shardpoint.load_hf({}, tmp_path / "hf", strict=False)
