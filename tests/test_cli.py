"""The shardpoint command: inspect and verify, human and --json output, exit codes."""

import json
import subprocess
import sys

import torch

import shardpoint
from shardpoint.cli import main


def _save(path):
    shardpoint.save({"model": torch.nn.Linear(3, 2), "step": 9}, path)


def test_inspect_lists_entries_with_dtype_shape_size_file(ckpt_dir, capsys):
    _save(ckpt_dir)
    assert main(["inspect", str(ckpt_dir)]) == 0
    out = capsys.readouterr().out
    assert (
        "model.weight" in out
        and "F32" in out
        and "[2, 3]" in out
        and "rank00000-00000.safetensors" in out
    )


def test_inspect_json(ckpt_dir, capsys):
    _save(ckpt_dir)
    assert main(["inspect", str(ckpt_dir), "--json"]) == 0
    doc = json.loads(capsys.readouterr().out)
    assert [t["name"] for t in doc["tensors"]] == ["model.weight", "model.bias"]
    assert doc["tensors"][0]["bytes"] == 24 and doc["state"]["step"] == 9


def test_verify_exit_codes_follow_corruption(ckpt_dir, capsys):
    _save(ckpt_dir)
    assert main(["verify", str(ckpt_dir)]) == 0
    assert "checkpoint is valid" in capsys.readouterr().out
    (shard,) = ckpt_dir.glob("*.safetensors")
    raw = bytearray(shard.read_bytes())
    raw[-1] ^= 0xFF
    shard.write_bytes(raw)
    assert main(["verify", str(ckpt_dir), "--json"]) == 1
    doc = json.loads(capsys.readouterr().out)
    assert doc["ok"] is False and doc["files"][0]["ok"] is False


def test_verify_of_an_uncommitted_directory_fails(tmp_path, capsys):
    (tmp_path / "x").mkdir()
    assert main(["verify", str(tmp_path / "x")]) == 1
    assert "no commit marker" in capsys.readouterr().out


def test_inspect_of_a_bad_path_prints_a_clear_error(tmp_path, capsys):
    assert main(["inspect", str(tmp_path / "missing")]) == 1
    assert "no such checkpoint directory" in capsys.readouterr().err


def test_console_script_runs(ckpt_dir):
    _save(ckpt_dir)
    out = subprocess.run(
        [sys.executable, "-m", "shardpoint.cli", "verify", str(ckpt_dir)],
        capture_output=True,
        text=True,
    )
    assert out.returncode == 0, out.stderr
    assert (
        subprocess.run(
            [sys.executable, "-m", "shardpoint.cli", "--help"], capture_output=True
        ).returncode
        == 0
    )
