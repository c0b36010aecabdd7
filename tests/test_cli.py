"""The shardpoint command: every subcommand on real checkpoints (valid, corrupt,
uncommitted), human and --json output, exit codes (0 ok, 1 check failed, 2 error)."""

import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch

import shardpoint
from shardpoint import RetentionPolicy
from shardpoint.cli import main


def _save(path):
    shardpoint.save({"model": torch.nn.Linear(3, 2), "step": 9}, path)


def test_inspect_lists_entries_with_dtype_shape_size_file(ckpt_dir, capsys):
    _save(ckpt_dir)
    assert main(["inspect", str(ckpt_dir)]) == 0
    out = capsys.readouterr().out
    assert "model.weight" in out and "F32" in out and "[2, 3]" in out and "whole, rank 0" in out
    assert "step = 9" in out  # the non-tensor state


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
    (tmp_path / "x" / "rank00000-00000.safetensors").write_bytes(b"partial")
    assert main(["verify", str(tmp_path / "x")]) == 1
    assert "no commit marker" in capsys.readouterr().out


def test_inspect_of_a_bad_path_prints_a_clear_error(tmp_path, capsys):
    assert main(["inspect", str(tmp_path / "missing")]) == 2
    assert "no such checkpoint directory" in capsys.readouterr().err


def test_verify_of_a_mistyped_path_is_an_error_not_a_corrupt_checkpoint(tmp_path, capsys):
    """Exit 2 (error), as inspect and ls: a job alerting on exit 1 ("corrupt") was told a
    typo was corruption."""
    for extra in ([], ["--json"]):
        assert main(["verify", str(tmp_path / "missing"), *extra]) == 2
        assert "no such checkpoint or directory" in capsys.readouterr().err


@pytest.mark.slow
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


# ---- a manager directory with valid, corrupt and uncommitted checkpoints ----------------


def _run_dir(root):
    """Steps 1-3 committed (step 2 then corrupted: its index no longer matches the
    marker), step 4 uncommitted (a crashed save)."""
    manager = shardpoint.CheckpointManager(
        root, retention=RetentionPolicy(keep_last=10), preemption_signals=()
    )
    model = torch.nn.Linear(4, 3)
    for step in (1, 2, 3):
        with torch.no_grad():
            model.weight.add_(0.5)
        manager.save(step, {"model": model, "step": step}, force=True)
    manager.close()
    index = root / "step-000000002" / "index.json"
    index.write_bytes(index.read_bytes() + b" ")  # no longer the index the marker names
    (root / "step-000000004").mkdir()
    (root / "step-000000004" / "rank00000-00000.safetensors").write_bytes(b"half")
    return root


def test_ls_shows_every_checkpoint_with_its_status(tmp_path, capsys):
    root = _run_dir(tmp_path / "run")
    assert main(["ls", str(root), "--json"]) == 0
    rows = json.loads(capsys.readouterr().out)
    assert [(r["step"], r["status"]) for r in rows] == [
        (1, "valid"),
        (2, "invalid"),
        (3, "valid"),
        (4, "uncommitted"),
    ]
    assert rows[0]["files"] == 1 and rows[0]["ranks"] == 1 and rows[0]["size"] > 0
    assert main(["ls", str(root)]) == 0
    out = capsys.readouterr().out
    assert "uncommitted" in out and "invalid" in out and "step-000000003" in out


def test_verify_of_a_directory_checks_every_committed_checkpoint(tmp_path, capsys):
    """Committed ones are verified (step 2 is corrupt); an uncommitted one (a save may
    be running) and a pruned one (files kept for a newer one) are listed as skipped."""
    root = _run_dir(tmp_path / "run")
    assert main(["verify", str(root), "--json"]) == 1
    docs = json.loads(capsys.readouterr().out)
    assert [(Path(d["path"]).name, d["ok"]) for d in docs] == [
        ("step-000000001", True),
        ("step-000000002", False),
        ("step-000000003", True),
    ]
    (root / "step-000000002").rename(tmp_path / "moved")
    assert main(["verify", str(root)]) == 0
    assert "skipped" in capsys.readouterr().out
    chain = tmp_path / "chain"
    incremental = shardpoint.IncrementalChain()
    state = {"frozen": torch.ones(256, 1024), "w": torch.zeros(3)}  # step 2 refers to step 1
    for step in (1, 2):
        state["w"].add_(1.0)
        shardpoint.save(state, chain / f"step-{step:09d}", incremental=incremental)
    assert main(["prune", str(chain), "--keep-last", "1"]) == 0
    capsys.readouterr()
    assert main(["verify", str(chain)]) == 0
    out = capsys.readouterr().out
    assert "step-000000001 (pruned)" in out and "step-000000002: checkpoint is" in out


def test_diff_reports_changed_added_removed_and_values(tmp_path, capsys):
    a, b = tmp_path / "a", tmp_path / "b"
    shardpoint.save(
        {"w": torch.zeros(3), "same": torch.ones(2), "gone": torch.ones(1), "lr": 0.1}, a
    )
    shardpoint.save(
        {
            "w": torch.tensor([0.0, 0.5, -2.0]),
            "same": torch.ones(2),
            "new": torch.ones(1),
            "lr": 0.2,
        },
        b,
    )
    assert main(["diff", str(a), str(b), "--json"]) == 1
    doc = json.loads(capsys.readouterr().out)
    assert doc["added"] == ["new"] and doc["removed"] == ["gone"]
    assert doc["changed"] == [{"name": "w", "detail": "max abs diff 2", "max_abs_diff": 2.0}]
    assert doc["values_changed"] == ["lr"] and doc["unchanged"] == 1
    assert main(["diff", str(a), str(a)]) == 0
    assert "0 added, 0 removed" in capsys.readouterr().out


def test_diff_of_tensors_holding_nan_compares_what_is_stored(tmp_path, capsys):
    nan = float("nan")
    shardpoint.save(
        {"w": torch.tensor([1.0, nan]), "h": torch.tensor([nan], dtype=torch.bfloat16)},
        tmp_path / "a",
    )
    shardpoint.save(
        {"w": torch.tensor([2.0, nan]), "h": torch.tensor([nan], dtype=torch.bfloat16)},
        tmp_path / "b",
    )
    assert main(["diff", str(tmp_path / "a"), str(tmp_path / "a"), "--json"]) == 0
    capsys.readouterr()
    assert main(["diff", str(tmp_path / "a"), str(tmp_path / "b"), "--json"]) == 1
    assert [c["name"] for c in json.loads(capsys.readouterr().out)["changed"]] == ["w"]


def test_diff_reports_the_real_difference_beside_nan_and_of_complex_values(tmp_path, capsys):
    """The JSON is strict (``NaN`` was written, which JSON parsers refuse), a NaN in one
    tensor does not hide the other elements' difference, and a complex difference is
    its magnitude (the imaginary part was dropped: 1+1j vs 1+5j differed by 0)."""
    nan, inf = float("nan"), float("inf")
    shardpoint.save(
        {"w": torch.tensor([nan, 1.0, nan]), "c": torch.tensor([1 + 1j]), "i": torch.tensor([0.0])},
        tmp_path / "a",
    )
    shardpoint.save(
        {"w": torch.tensor([nan, 2.5, 0.0]), "c": torch.tensor([1 + 5j]), "i": torch.tensor([inf])},
        tmp_path / "b",
    )
    assert main(["diff", str(tmp_path / "a"), str(tmp_path / "b"), "--json"]) == 1
    out = capsys.readouterr().out
    changed = {c["name"]: c for c in json.loads(out, parse_constant=lambda c: 1 / 0)["changed"]}
    assert changed["w"]["max_abs_diff"] == 1.5 and "NaN in one only at 1" in changed["w"]["detail"]
    assert changed["c"]["max_abs_diff"] == 4.0
    assert changed["i"]["max_abs_diff"] == "inf"


def test_diff_of_a_corrupt_checkpoint_is_an_error(tmp_path, capsys):
    root = _run_dir(tmp_path / "run")
    code = main(["diff", str(root / "step-000000001"), str(root / "step-000000002")])
    assert code == 2 and "step-000000002" in capsys.readouterr().err


def test_export_hf_and_import_hf_commands(tmp_path, capsys):
    from safetensors import safe_open

    _save(tmp_path / "ckpt")
    code = main(
        [
            "export-hf",
            str(tmp_path / "ckpt"),
            str(tmp_path / "hf"),
            "--prefix",
            "model.",
            "--dtype",
            "fp16",
            "--rename",
            "^weight$=kernel",
            "--json",
        ]
    )
    assert code == 0
    doc = json.loads(capsys.readouterr().out)
    assert doc["files"] == ["model.safetensors"] and doc["tensors"] == 2
    with safe_open(str(tmp_path / "hf" / "model.safetensors"), "pt") as f:
        assert sorted(f.keys()) == ["bias", "kernel"]
        assert f.get_tensor("kernel").dtype == torch.float16
    assert main(["import-hf", str(tmp_path / "hf"), str(tmp_path / "back")]) == 0
    assert "wrote 2 tensors" in capsys.readouterr().out
    assert (
        main(["export-hf", str(tmp_path / "ckpt"), str(tmp_path / "x"), "--prefix", "nope."]) == 2
    )
    assert "no tensor entry starts with 'nope.'" in capsys.readouterr().err
    assert main(["export-hf", str(tmp_path / "ckpt"), str(tmp_path / "y"), "--rename", "bad"]) == 2


def test_names_with_brackets_are_printed_as_they_are(tmp_path, capsys):
    """Tensor names are text, not console markup: ``attn[q].weight`` lost its ``[q]``
    and ``w[/x]`` crashed inspect and diff (exit 1, read as "differences found")."""
    names = ["attn[q].weight", "w[/x]", "[bold]b"]
    shardpoint.save({n: torch.ones(2) for n in names}, tmp_path / "a")
    shardpoint.save({n: torch.zeros(2) for n in names}, tmp_path / "b")
    assert main(["inspect", str(tmp_path / "a")]) == 0
    out = capsys.readouterr().out
    assert all(n in out for n in names)
    assert main(["diff", str(tmp_path / "a"), str(tmp_path / "b")]) == 1
    out = capsys.readouterr().out
    assert all(f"~ {n}" in out for n in names)
    assert main(["verify", str(tmp_path / "a")]) == 0


def test_a_rename_rule_that_is_not_a_regular_expression_is_a_clear_error(tmp_path, capsys):
    _save(tmp_path / "ckpt")
    assert main(["export-hf", str(tmp_path / "ckpt"), str(tmp_path / "x"), "--rename", "(=x"]) == 2
    assert "is not a regular expression" in capsys.readouterr().err


def test_import_hf_refuses_pickle_weights(tmp_path, capsys):
    torch.save({"w": torch.ones(2)}, tmp_path / "pytorch_model.bin")
    assert main(["import-hf", str(tmp_path), str(tmp_path / "out")]) == 2
    assert "pickle" in capsys.readouterr().err
    assert main(["import-hf", str(tmp_path), str(tmp_path / "out"), "--allow-pickle-weights"]) == 0
    with shardpoint.open(tmp_path / "out") as r:
        assert torch.equal(r.get("w"), torch.ones(2))


def test_convert_command_between_formats(tmp_path, capsys):
    torch.save({"w": torch.arange(4.0)}, tmp_path / "in.pt")
    argv = ["convert", str(tmp_path / "in.pt"), str(tmp_path / "ckpt"), "--allow-pickle"]
    assert main([*argv, "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["tensors"] == 1
    assert main(["convert", str(tmp_path / "ckpt"), str(tmp_path / "out.pt")]) == 0
    assert torch.equal(torch.load(tmp_path / "out.pt", weights_only=True)["w"], torch.arange(4.0))
    assert main(["convert", str(tmp_path / "nothing"), str(tmp_path / "z")]) == 2


def test_convert_to_torch_save_never_writes_through_an_existing_name(tmp_path):
    """A dangling link at the output name is refused (nothing written where it points)
    and no temporary file is left."""
    shardpoint.save({"w": torch.arange(4.0)}, tmp_path / "ckpt")
    (tmp_path / "out.pt").symlink_to(tmp_path / "elsewhere.pt")
    assert main(["convert", str(tmp_path / "ckpt"), str(tmp_path / "out.pt")]) == 2
    assert not (tmp_path / "elsewhere.pt").exists()
    assert sorted(p.name for p in tmp_path.iterdir()) == ["ckpt", "out.pt"]


def test_prune_keeps_the_newest_and_never_touches_uncommitted_or_invalid(tmp_path, capsys):
    root = _run_dir(tmp_path / "run")
    assert main(["prune", str(root), "--keep-last", "1", "--dry-run", "--json"]) == 0
    doc = json.loads(capsys.readouterr().out)
    assert [Path(p).name for p in doc["deleted"]] == ["step-000000001"]
    assert {Path(p).name: why.split(":")[0] for p, why in doc["left_alone"].items()} == {
        "step-000000002": "invalid",
        "step-000000004": "uncommitted",
    }
    assert (root / "step-000000001").exists()  # dry run
    assert main(["prune", str(root), "--keep-last", "1"]) == 0
    assert sorted(p.name for p in root.iterdir() if p.is_dir()) == [
        "step-000000002",
        "step-000000003",
        "step-000000004",
    ]
    assert main(["prune", str(root), "--keep-last", "0"]) == 2


def _three_steps(root: Path) -> Path:
    """Saved as the manager saves them: each index holds its step (a copy keeps it)."""
    for step in (1, 2, 3):
        state = {"w": torch.full((3,), float(step))}
        shardpoint.save(state, root / f"step-{step:09d}", metadata={"step": step})
    return root


def test_prune_keeps_the_newest_checkpoints_that_load(tmp_path, capsys):
    """An invalid newest step (a truncated shard) is not counted: the newest valid one
    stays, and the invalid one is left for the user to look at."""
    root = _three_steps(tmp_path / "run")
    shard = next((root / "step-000000003").glob("*.safetensors"))
    shard.write_bytes(shard.read_bytes()[:10])
    assert main(["prune", str(root), "--keep-last", "1"]) == 0
    assert sorted(p.name for p in root.iterdir()) == ["step-000000002", "step-000000003"]
    assert shardpoint.verify(root / "step-000000002").ok


def test_prune_never_follows_links_nor_counts_names_that_are_not_steps(tmp_path, capsys):
    """A ``latest`` link to the newest step, a link to a checkpoint outside the
    directory, and a copy named ``best``: none is counted, deleted or emptied."""
    root = _three_steps(tmp_path / "run")
    outside = tmp_path / "archive" / "step-000000001"
    assert main(["copy", str(root / "step-000000001"), str(outside)]) == 0
    (root / "latest").symlink_to("step-000000003")
    (root / "step-000000000").symlink_to(outside)  # a link named like the oldest step
    assert main(["copy", str(root / "step-000000001"), str(root / "best")]) == 0
    capsys.readouterr()
    assert main(["prune", str(root), "--keep-last", "1", "--json"]) == 0
    doc = json.loads(capsys.readouterr().out)
    assert [Path(p).name for p in doc["deleted"]] == ["step-000000001", "step-000000002"]
    assert sorted(Path(p).name for p in doc["left_alone"]) == [
        "best",
        "latest",
        "step-000000000",
    ]
    for kept in (root / "step-000000003", root / "latest", outside, root / "best"):
        assert shardpoint.verify(kept).ok, kept


def test_report_summarises_the_event_log_and_plots(tmp_path, capsys):
    root = _run_dir(tmp_path / "run")
    assert main(["report", str(root), "--json"]) == 0
    doc = json.loads(capsys.readouterr().out)
    assert doc["saves"] == 3 and doc["bytes"]["total"] > 0
    assert doc["restores_by_tier"] == {"memory": 0, "local": 0, "remote": 0}
    assert Path(doc["plot"]).stat().st_size > 1000  # a PNG
    assert main(["report", str(tmp_path)]) == 2


def test_report_counts_restores_by_the_tier_they_came_from(tmp_path, capsys):
    root = _run_dir(tmp_path / "run")
    restores = [
        {"event": "restore", "time": 1.0, "step": 2, "tier": "memory"},
        {"event": "restore", "time": 2.0, "step": 2, "path": "x", "bytes_from_remote": 0},
        {"event": "restore", "time": 3.0, "step": 3, "path": "x", "bytes_from_remote": 10},
        {"event": "restore", "time": 4.0, "step": 3, "path": "x", "bytes_from_remote": 5},
    ]
    with open(root / "events.jsonl", "a") as f:
        f.writelines(json.dumps(e) + "\n" for e in restores)
    assert main(["report", str(root), "--json"]) == 0
    doc = json.loads(capsys.readouterr().out)
    assert doc["restores_by_tier"] == {"memory": 1, "local": 1, "remote": 2}


def test_report_skips_a_torn_line_of_the_event_log(tmp_path, capsys):
    """The log is written best effort: a line cut by a full disk ended ``report`` with a
    bare JSON error that named no file."""
    root = _run_dir(tmp_path / "run")
    with open(root / "events.jsonl", "a") as f:
        f.write('{"event": "save", "step": 4, "pa')
    with pytest.warns(UserWarning, match="events.jsonl: skipped 1 line"):
        assert main(["report", str(root), "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["saves"] == 3


def test_every_command_has_help_with_examples():
    from shardpoint.cli import EXAMPLES, build_parser

    parser = build_parser()
    for name in EXAMPLES:
        help_text = parser._subparsers._group_actions[0].choices[name].format_help()
        assert "examples:" in help_text and "--json" in help_text, name
