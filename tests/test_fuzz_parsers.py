"""Runs the coverage-guided fuzz target (the parsers, and the library and CLI on a fuzzed
index, see fuzz/fuzz_parsers.py) for a bounded time."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

import shardpoint

TARGET = Path(__file__).resolve().parents[1] / "fuzz" / "fuzz_parsers.py"
SECONDS = 30  # per CI run; a soak: python fuzz/fuzz_parsers.py -max_total_time=3600


@pytest.mark.slow
def test_parsers_survive_coverage_guided_fuzzing(tmp_path):
    ckpt = tmp_path / "ckpt"
    w = torch.arange(6.0).reshape(2, 3)
    shardpoint.save(
        {"w": w, "tied": w, "meta": (1, b"x", None), "b": torch.ones(2).bfloat16()}, ckpt
    )
    corpus = tmp_path / "corpus"
    corpus.mkdir()
    (corpus / "index").write_bytes(b"\x01" + (ckpt / "index.json").read_bytes())
    (corpus / "shard").write_bytes(b"\x00" + next(ckpt.glob("*.safetensors")).read_bytes())
    sharded = Path(__file__).parent / "data" / "v2-two-ranks"  # meshes, fragments
    (corpus / "sharded-index").write_bytes(b"\x02" + (sharded / "index.json").read_bytes())
    (corpus / "fragment").write_bytes(b"\x03" + (sharded / "rank00001.chunks.json").read_bytes())
    done = subprocess.run(
        [
            sys.executable,
            str(TARGET),
            f"-max_total_time={SECONDS}",
            f"-artifact_prefix={tmp_path}/",  # a crashing input lands here, not in the repo
            str(corpus),
        ],
        capture_output=True,
        text=True,
        timeout=600,
        env={**os.environ, "TMPDIR": str(tmp_path)},  # the target's seed checkpoint goes here
    )
    finding = done.stdout.find("Uncaught Python exception")  # atheris prints it to stdout
    assert done.returncode == 0, done.stdout[max(finding, 0) :][:3000] + done.stderr[-1000:]
    last = done.stderr.strip().splitlines()[-1]
    assert last.startswith("Done ") and int(last.split()[1]) > 1000, last  # inputs executed
    print(last)
