"""The Hugging Face Trainer integration (``shardpoint.integrations.transformers``): a run
killed with SIGKILL, or preempted with SIGTERM, and resumed continues bit for bit, in
one process and on 2 DDP ranks; a damaged newest checkpoint is skipped.

The run is examples/hf_trainer_resume.py: a two-layer GPT-2 from a config with dropout,
AdamW with warm-up and linear decay, 13 batches per epoch (so runs cross epochs), a
checkpoint every 5 steps.
"""

from __future__ import annotations

import json
import shutil
import signal
import subprocess
from pathlib import Path

import pytest
from example_runs import losses, run_example, steps_run

import shardpoint

pytestmark = pytest.mark.slow


def _run(run_dir: Path, *extra: str, ranks: int = 1) -> subprocess.CompletedProcess:
    return run_example("hf_trainer_resume.py", run_dir, *extra, ranks=ranks)


def _weights(run_dir: Path) -> str:
    return json.loads((run_dir / "final.json").read_text())["weights_sha256"]


def _checkpoints(run_dir: Path) -> Path:
    return run_dir / "out" / "checkpoints"


@pytest.fixture(scope="module")
def reference(tmp_path_factory) -> Path:
    run = tmp_path_factory.mktemp("reference")
    done = _run(run)
    assert done.returncode == 0, done.stderr
    return run


@pytest.mark.parametrize("crash_at", [12, 23])  # in the first epoch; in the second
def test_a_killed_run_resumes_bit_identical(tmp_path, reference, crash_at):
    crashed = _run(tmp_path, "--crash-at", str(crash_at))
    assert crashed.returncode == -signal.SIGKILL, crashed.stderr
    resumed = _run(tmp_path)
    assert resumed.returncode == 0, resumed.stderr
    newest = crash_at - crash_at % 5
    # Steps after the newest checkpoint ran again, and gave the same losses.
    assert steps_run(tmp_path)[crash_at : crash_at + 2] == [newest + 1, newest + 2]
    assert losses(tmp_path) == losses(reference)
    assert _weights(tmp_path) == _weights(reference)
    assert shardpoint.verify(_checkpoints(tmp_path) / "step-000000040").ok


def test_sigterm_saves_at_once_exits_143_and_resumes_without_repeating_a_step(tmp_path, reference):
    preempted = _run(tmp_path, "--sigterm-at", "17")
    assert preempted.returncode == 143, preempted.stderr
    assert "preempted: saved step 17" in preempted.stdout
    assert (_checkpoints(tmp_path) / "step-000000017").is_dir()
    assert _run(tmp_path).returncode == 0
    assert steps_run(tmp_path) == list(range(1, 41))  # nothing lost, nothing repeated
    assert losses(tmp_path) == losses(reference)
    assert _weights(tmp_path) == _weights(reference)


def test_a_damaged_newest_checkpoint_is_skipped_and_the_resume_stays_exact(tmp_path, reference):
    assert _run(tmp_path, "--crash-at", "23").returncode == -signal.SIGKILL
    newest = _checkpoints(tmp_path) / "step-000000020"
    shard = sorted(newest.glob("*.safetensors"))[0]
    data = bytearray(shard.read_bytes())
    data[-100] ^= 0xFF  # a flipped bit in a tensor's bytes
    shard.write_bytes(bytes(data))
    resumed = _run(tmp_path)
    assert resumed.returncode == 0, resumed.stderr
    assert "step-000000020" in resumed.stderr  # the warning names what was skipped
    assert steps_run(tmp_path)[23:25] == [16, 17]  # from step 15
    assert losses(tmp_path) == losses(reference)
    assert _weights(tmp_path) == _weights(reference)


def test_two_ddp_ranks_killed_and_resumed_continue_bit_identical(tmp_path_factory):
    ref, run = tmp_path_factory.mktemp("ddp-ref"), tmp_path_factory.mktemp("ddp")
    done = _run(ref, ranks=2)
    assert done.returncode == 0, done.stderr
    assert _run(run, "--crash-at", "23", ranks=2).returncode != 0
    resumed = _run(run, ranks=2)
    assert resumed.returncode == 0, resumed.stderr
    for rank in (0, 1):  # each rank's own batches and dropout masks
        assert losses(run, rank) == losses(ref, rank)
    assert losses(ref, 0) != losses(ref, 1)
    assert _weights(run) == _weights(ref)
    state = shardpoint.open(_checkpoints(run) / "step-000000040").state(tensors=False)
    assert sorted(state["rng"]) == [0, 1]  # every rank's streams


def test_unsupported_trainer_arguments_are_refused_by_name(tmp_path):
    from transformers import GPT2Config, GPT2LMHeadModel, TrainingArguments

    from shardpoint.integrations.transformers import ShardpointTrainer

    model = GPT2LMHeadModel(GPT2Config(vocab_size=16, n_positions=8, n_embd=8, n_layer=1, n_head=1))
    args = TrainingArguments(
        output_dir=str(tmp_path), use_cpu=True, report_to="none", save_only_model=True
    )
    with pytest.raises(ValueError, match="save_only_model"):
        ShardpointTrainer(model=model, args=args)


@pytest.mark.parametrize("limit, kept", [(None, None), (0, None), (2, 2)])
def test_the_trainers_save_total_limit_is_the_retention(tmp_path, limit, kept):
    """As the Trainer reads ``save_total_limit``: unset (or <= 0) deletes no checkpoint."""
    from transformers import GPT2Config, GPT2LMHeadModel, TrainingArguments

    from shardpoint.integrations.transformers import ShardpointTrainer

    model = GPT2LMHeadModel(GPT2Config(vocab_size=16, n_positions=8, n_embd=8, n_layer=1, n_head=1))
    args = TrainingArguments(
        output_dir=str(tmp_path), use_cpu=True, report_to="none", save_total_limit=limit
    )
    trainer = ShardpointTrainer(model=model, args=args)
    assert trainer.checkpoints.retention.keep_last == kept
    assert trainer.checkpoints.directory == tmp_path / "checkpoints"


def test_a_preemption_on_an_evaluation_step_is_saved_under_save_strategy_best(tmp_path):
    """With save_strategy="best" the Trainer sets should_save to "a new best metric"
    after evaluating; a SIGTERM at a step whose metric is no better is saved all the same."""
    import os

    import torch
    from transformers import GPT2Config, GPT2LMHeadModel, TrainerCallback, TrainingArguments

    from shardpoint.integrations.transformers import ShardpointTrainer

    class PreemptAtStep3(TrainerCallback):
        def on_step_begin(self, args, state, control, **kwargs):  # noqa: ANN001, ANN201
            if state.global_step == 2:  # during step 3
                os.kill(os.getpid(), signal.SIGTERM)

    evaluations = iter(range(100))  # each evaluation worse than the one before
    data = [{"input_ids": torch.tensor([1, 2, 3, 4]), "labels": torch.tensor([1, 2, 3, 4])}] * 8
    model = GPT2LMHeadModel(GPT2Config(vocab_size=16, n_positions=8, n_embd=8, n_layer=1, n_head=1))
    args = TrainingArguments(
        output_dir=str(tmp_path), use_cpu=True, report_to="none", max_steps=6,
        per_device_train_batch_size=2, eval_strategy="steps", eval_steps=1,
        save_strategy="best", metric_for_best_model="worse", greater_is_better=False,
    )  # fmt: skip
    trainer = ShardpointTrainer(
        model=model, args=args, train_dataset=data, eval_dataset=data[:2],
        compute_metrics=lambda _: {"worse": next(evaluations)}, callbacks=[PreemptAtStep3()],
    )  # fmt: skip
    try:
        trainer.train()
        assert trainer.state.global_step == 3
        assert trainer.checkpoints.should_stop and trainer.checkpoints.exit_code == 143
        assert shardpoint.verify(trainer.checkpoints.path_for(3)).ok
    finally:
        trainer.checkpoints.close()


def test_a_fresh_run_among_an_earlier_runs_checkpoints_is_refused(tmp_path):
    """The manager would skip the steps the earlier run committed and keep its newest:
    a later resume would continue the earlier run. Asked to start afresh, it refuses."""
    import torch
    from transformers import GPT2Config, GPT2LMHeadModel, TrainingArguments

    from shardpoint.integrations.transformers import ShardpointTrainer

    data = [{"input_ids": torch.tensor([1, 2, 3, 4]), "labels": torch.tensor([1, 2, 3, 4])}] * 8

    def trainer() -> ShardpointTrainer:
        config = GPT2Config(vocab_size=16, n_positions=8, n_embd=8, n_layer=1, n_head=1)
        args = TrainingArguments(
            output_dir=str(tmp_path), use_cpu=True, report_to="none", max_steps=2,
            per_device_train_batch_size=2, save_steps=1,
        )  # fmt: skip
        return ShardpointTrainer(model=GPT2LMHeadModel(config), args=args, train_dataset=data)

    first = trainer()
    first.train()
    assert first.checkpoints.steps() == [1, 2]
    second = trainer()
    with pytest.raises(ValueError, match="earlier run"):
        second.train()
    second.train(resume_from_checkpoint=True)  # continuing it is fine: nothing to train
    assert second.state.global_step == 2
    third = trainer()

    def unlisted() -> list[int]:
        raise shardpoint.CheckpointError("the store is down")

    third.checkpoints.steps = unlisted  # one rank's listing fails: every rank is told
    with pytest.raises(shardpoint.CheckpointError, match="could not list"):
        third.train()


def test_the_best_checkpoint_is_kept_and_named_as_by_the_trainers_rotation(tmp_path):
    """``save_total_limit=2`` with ``metric_for_best_model``: the Trainer keeps the two
    newest and the best, and names the best in ``state.best_model_checkpoint``."""
    import torch
    from transformers import GPT2Config, GPT2LMHeadModel, TrainingArguments

    from shardpoint.integrations.transformers import ShardpointTrainer

    losses = iter([5.0, 1.0, 4.0, 3.0, 2.0, 6.0])  # step 2 is the best
    data = [{"input_ids": torch.tensor([1, 2, 3, 4]), "labels": torch.tensor([1, 2, 3, 4])}] * 8
    config = GPT2Config(vocab_size=16, n_positions=8, n_embd=8, n_layer=1, n_head=1)
    args = TrainingArguments(
        output_dir=str(tmp_path), use_cpu=True, report_to="none", max_steps=6,
        per_device_train_batch_size=2, eval_strategy="steps", eval_steps=1, save_steps=1,
        save_total_limit=2, metric_for_best_model="score", greater_is_better=False,
    )  # fmt: skip
    trainer = ShardpointTrainer(
        model=GPT2LMHeadModel(config), args=args, train_dataset=data, eval_dataset=data[:2],
        compute_metrics=lambda _: {"score": next(losses)},
    )  # fmt: skip
    trainer.train()
    assert trainer.checkpoints.steps() == [2, 5, 6]
    assert trainer.state.best_model_checkpoint == str(trainer.checkpoints.path_for(2))


def test_a_finished_run_started_again_trains_no_further_step(tmp_path, reference):
    """The Trainer alone, resumed from its last checkpoint at ``max_steps`` (40 is not a
    whole number of epochs), trains a step 41 (measured with its own checkpoints)."""
    run = tmp_path / "run"
    shutil.copytree(reference, run)
    again = _run(run)
    assert again.returncode == 0, again.stderr
    assert steps_run(run) == list(range(1, 41))
    assert not (_checkpoints(run) / "step-000000041").exists()
    assert _weights(run) == _weights(reference)


# examples/hf_trainer_resume.py with TrainingArguments(gradient_accumulation_steps=2).
_ACCUMULATING = """
import runpy, sys, transformers
init = transformers.TrainingArguments.__init__
def accumulating(self, *args, **kwargs):
    kwargs.setdefault("gradient_accumulation_steps", 2)
    init(self, *args, **kwargs)
transformers.TrainingArguments.__init__ = accumulating
sys.argv = sys.argv[1:]
runpy.run_path(sys.argv[0], run_name="__main__")
"""


def _run_accumulating(run_dir: Path, *extra: str) -> subprocess.CompletedProcess:
    import os
    import sys

    from example_runs import EXAMPLES

    script = [str(EXAMPLES / "hf_trainer_resume.py"), "--run-dir", str(run_dir), "--steps", "20"]
    return subprocess.run(
        [sys.executable, "-c", _ACCUMULATING, *script, *extra],
        capture_output=True, text=True, timeout=300, env={**os.environ, "OMP_NUM_THREADS": "1"},
    )  # fmt: skip


def test_a_killed_run_with_gradient_accumulation_resumes_bit_identical(tmp_path_factory):
    """Two micro-batches per step, 13 batches per epoch (an epoch ends inside a step):
    killed after step 12 (newest checkpoint: step 10, in the second epoch), resumed."""
    reference, run = tmp_path_factory.mktemp("accum-ref"), tmp_path_factory.mktemp("accum")
    done = _run_accumulating(reference)
    assert done.returncode == 0, done.stderr
    assert _run_accumulating(run, "--crash-at", "12").returncode == -signal.SIGKILL
    before = len(steps_run(run))
    resumed = _run_accumulating(run)
    assert resumed.returncode == 0, resumed.stderr
    assert steps_run(run)[before] == 11  # from the checkpoint of step 10
    assert losses(run) == losses(reference)  # each step's last micro-batch
    assert _weights(run) == _weights(reference)
