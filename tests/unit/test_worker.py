"""The training `Worker` in this process, without Ray (`vidray.train.local`, `vidray.train.context.LocalContext`):
the loop's behaviour at unit-test cost (a few CPU seconds a run, no cluster, no worker group), with the same checks,
checkpoints, exports and errors as a Ray Train run."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest

from vidray.config import load_job_config
from vidray.errors import UserError
from vidray.train.checkpoint import DamagedCheckpointError, read_train_state, verify_checkpoint
from vidray.train.local import train_in_process
from vidray.train.trainer import check_job_inputs, run_training

from tests.conftest import assert_same_training_state

REPO = Path(__file__).resolve().parents[2]


def tiny_job(shards_dir: Path, storage: Path, *overrides: str, name: str = "run"):
    return load_job_config(REPO / "jobs/configs/tiny_t2v.yaml", [
        f"data.shards_dir={shards_dir}", f"storage.path={storage}", f"name={name}", "model.text_encoder=tiny_random",
        "train.log_every_steps=2", "checkpoint.every_steps=2", *overrides])


def test_a_run_in_process_trains_checkpoints_rotates_exports_and_never_starts_ray(shards_dir, tmp_path):
    import ray

    result = train_in_process(tiny_job(shards_dir, tmp_path, "train.max_steps=4", "checkpoint.num_to_keep=1"))
    assert not ray.is_initialized()  # no cluster, no worker group: this process trained
    assert [int(s) for s, _ in result.losses] == [1, 2, 3, 4] and result.first_step == 1 and result.last_step == 4
    assert result.reported_steps == [2, 4]
    run_dir = tmp_path / "run"
    assert result.checkpoint_path == str(run_dir / "checkpoint_000004")
    assert read_train_state(result.checkpoint_path).step == 4
    assert sorted(p.name for p in run_dir.glob("checkpoint_0*")) == ["checkpoint_000004"]  # num_to_keep=1
    assert result.metrics["step"] == 4 and result.metrics["loss"] == pytest.approx(
        sum(loss for _, loss in result.losses[2:]) / 2, rel=1e-6)  # the last window's mean
    assert json.loads((run_dir / "diffusers" / "model_index.json").read_text())["_class_name"] == "EasyAnimatePipeline"
    assert [json.loads(line)["step"] for line in (run_dir / "metrics.jsonl").read_text().splitlines()] == [1, 2, 3, 4]
    assert [p["trainer"]["node_id"] for p in result.placement] == ["local"]


def test_a_resumed_run_continues_at_the_next_step_with_the_uninterrupted_losses_and_state(shards_dir, tmp_path):
    """4 steps straight through, and 2 steps then the same run name to step 4: the resumed run starts at step 3 and
    both have bitwise the same losses, weights, optimizer and lr scheduler (exact resume)."""
    straight = train_in_process(tiny_job(shards_dir, tmp_path / "a", "train.max_steps=4"))
    first = train_in_process(tiny_job(shards_dir, tmp_path / "b", "train.max_steps=2"))
    second = train_in_process(tiny_job(shards_dir, tmp_path / "b", "train.max_steps=4"))
    assert second.first_step == 3 and [int(s) for s, _ in second.losses] == [3, 4]
    assert first.losses + second.losses == straight.losses
    assert_same_training_state(second.checkpoint_path, straight.checkpoint_path)


def test_a_run_with_micro_batches_accumulates_the_global_batch_of_its_workers(shards_dir, tmp_path):
    """One rank trains what `scaling.num_workers` ranks train: G micro-batches a step, accumulated (the schedule
    deals by G, not by the ranks it has); one worker of G = 2 and two workers' worth of G = 2 are the same run."""
    one = train_in_process(tiny_job(shards_dir, tmp_path / "a", "train.max_steps=2", "scaling.num_workers=1",
                                    "train.micro_batches_per_step=2"))
    two = train_in_process(tiny_job(shards_dir, tmp_path / "b", "train.max_steps=2", "scaling.num_workers=2"))
    assert [loss for _, loss in one.losses] == pytest.approx([loss for _, loss in two.losses], rel=1e-6)


def resume_job(shards_dir: Path, storage: Path, *overrides: str):
    return load_job_config(REPO / "jobs/configs/tiny_t2v.yaml", [
        f"data.shards_dir={shards_dir}", f"storage.path={storage}", "name=resume", "model.text_encoder=tiny_random",
        "optim.warmup_steps=0", *overrides])


def checkpoint_lr(checkpoint: Path) -> float:
    import torch

    state = torch.load(checkpoint / "optimizer.pt", map_location="cpu", weights_only=True)
    return state["param_groups"][0]["lr"]


def test_changed_settings_take_effect_and_a_damaged_checkpoint_is_recovered_from(shards_dir, tmp_path):
    # 1. The reported case: 10 steps at lr 1e-3 ...
    first = train_in_process(resume_job(shards_dir, tmp_path, "optim.lr=1e-3", "train.max_steps=10",
                                        "train.log_every_steps=5", "checkpoint.every_steps=5",
                                        "checkpoint.num_to_keep=2"))
    assert first.metrics["lr"] == pytest.approx(1e-3)
    assert first.reported_steps == [5, 10]

    # 2. ... resumed to step 20 at lr 1e-5 with other cadences, num_to_keep and no gradient clipping: all apply.
    second = train_in_process(resume_job(shards_dir, tmp_path, "optim.lr=1e-5", "train.max_steps=20",
                                         "train.log_every_steps=3", "checkpoint.every_steps=4",
                                         "checkpoint.num_to_keep=3", "train.grad_clip_norm=null"))
    run_dir = tmp_path / "resume"
    assert second.first_step == 11 and [int(s) for s, _ in second.losses] == list(range(11, 21))
    assert second.metrics["lr"] == pytest.approx(1e-5)  # the lr the optimizer holds, reported
    assert checkpoint_lr(run_dir / "checkpoint_000020") == pytest.approx(1e-5)
    assert checkpoint_lr(run_dir / "checkpoint_000012") == pytest.approx(1e-5)  # from the first resumed step on
    assert second.reported_steps == [12, 15, 16, 18, 20]  # log every 3, checkpoint every 4, last step
    assert sorted(p.name for p in run_dir.glob("checkpoint_0*")) == [
        "checkpoint_000012", "checkpoint_000016", "checkpoint_000020"]  # num_to_keep=3
    assert second.metrics["grad_norm"] == 0.0  # clipping off: no norm measured (it is > 0 with clipping)
    assert first.metrics["grad_norm"] > 0.0

    # 3. The newest checkpoint's model file is cut in half: refused on the driver, naming the last good one.
    part = run_dir / "checkpoint_000020" / "transformer.safetensors"
    part.write_bytes(part.read_bytes()[: part.stat().st_size // 2])
    good = (run_dir / "checkpoint_000016").resolve()
    with pytest.raises(DamagedCheckpointError, match=rf"checkpoint_000020: transformer.safetensors .*"
                                                     rf"checkpoint.resume_from={good}"):
        train_in_process(resume_job(shards_dir, tmp_path, "optim.lr=1e-5", "train.max_steps=24"))

    # 4. The override it names recovers the run under the same name: it starts at step 17, and the damaged
    #    checkpoint is moved aside, not loaded, not overwritten in place.
    third = train_in_process(resume_job(shards_dir, tmp_path, "optim.lr=1e-5", "train.max_steps=24",
                                        "checkpoint.every_steps=4", "checkpoint.num_to_keep=3",
                                        f"checkpoint.resume_from={good}"))
    assert third.first_step == 17 and [int(s) for s, _ in third.losses] == list(range(17, 25))
    verify_checkpoint(run_dir / "checkpoint_000020")  # rewritten by this run, whole
    assert read_train_state(third.checkpoint_path).step == 24
    # The run's rotation knew only 20 and 24 (the earlier list was set aside with the damaged checkpoint);
    # num_to_keep=3 still holds in the run folder: the newest older checkpoint, 16, stays, 12 goes.
    assert sorted(p.name for p in run_dir.glob("checkpoint_0*")) == [
        "checkpoint_000016", "checkpoint_000020", "checkpoint_000024"]
    damaged = list((run_dir / "set_aside").glob("*/checkpoint_000020"))
    assert len(damaged) == 1
    with pytest.raises(DamagedCheckpointError):
        verify_checkpoint(damaged[0])
    plan = check_job_inputs(resume_job(shards_dir, tmp_path, "optim.lr=1e-5", "train.max_steps=30"))
    assert plan.checkpoint.name == "checkpoint_000024"  # the run goes on from its own latest checkpoint again


def test_a_diverged_run_stops_at_its_first_report_and_writes_no_checkpoint(shards_dir, tmp_path):
    """lr 1e30 blows the weights up after one step: the run stops at the first report (step 2), before a
    checkpoint of the diverged model is written (the Ray Train path adds: without retries, test_resume.py)."""
    from vidray.train.step import NonFiniteTrainingError

    with pytest.raises(NonFiniteTrainingError, match=r"^training diverged: .* at step \d+ \(lr 1e\+30\)") as err:
        train_in_process(tiny_job(shards_dir, tmp_path, "optim.lr=1e30", "optim.warmup_steps=0", "train.max_steps=4"))
    assert err.value.step <= 2
    assert not list((tmp_path / "run").glob("checkpoint_*"))


@pytest.mark.parametrize("overrides, expected", [
    (["data.shards_dir={tmp}/none"], "run `vidray prepare`"),
    (["data.fps=12"], "were prepared at 8.0 fps but data.fps is 12.0"),
    (["data.buckets=[[9, 64, 64]]"], "that are not in data.buckets"),
], ids=["no-shards", "other-fps", "unknown-bucket"])
def test_bad_input_is_refused_with_the_same_line_in_process_and_by_ray_train(shards_dir, tmp_path, overrides, expected,
                                                                            monkeypatch):
    """What Ray Train's path refuses before Ray starts, the in-process path refuses with the same one line (neither
    starts Ray for it)."""
    import ray

    monkeypatch.setenv("RAY_ADDRESS", "")  # never join another cluster: the refusal must come first
    job = tiny_job(shards_dir, tmp_path, "train.max_steps=2", *(o.format(tmp=tmp_path) for o in overrides))
    messages = []
    for run in (run_training, train_in_process):
        with pytest.raises(UserError) as err:
            run(job)
        messages.append(str(err.value))
    assert messages[0] == messages[1] and expected in messages[0] and "\n" not in messages[0]
    assert not ray.is_initialized()


def test_a_finished_run_is_refused_the_same_way_in_process_and_by_ray_train(shards_dir, tmp_path):
    train_in_process(tiny_job(shards_dir, tmp_path, "train.max_steps=2"))
    messages = []
    for run in (run_training, train_in_process):
        with pytest.raises(UserError) as err:
            run(tiny_job(shards_dir, tmp_path, "train.max_steps=2"))
        messages.append(str(err.value))
    assert messages[0] == messages[1] and "train.max_steps" in messages[0]


def test_validation_samples_are_written_between_steps_in_process(shards_dir, tmp_path):
    result = train_in_process(tiny_job(shards_dir, tmp_path, "train.max_steps=2", "train.validation.every_steps=2",
                                       'train.validation.prompts=["a red ball"]', "train.validation.bucket=1x64x64",
                                       "train.validation.num_inference_steps=2"))
    assert [v["step"] for v in result.validation] == [2] and result.validation_wait_s == 0.0
    written = {p.suffix for p in Path(result.validation[0]["dir"]).iterdir()}
    assert {".mp4", ".png"} <= written, written


def test_refuses_what_needs_ray_trains_worker_group(shards_dir, tmp_path):
    with pytest.raises(ValueError, match="elastic"):
        train_in_process(tiny_job(shards_dir, tmp_path, "scaling.num_workers=[1, 2]"))


@pytest.mark.slow
def test_two_gloo_ranks_in_processes_train_the_run_of_one_rank_with_two_micro_batches(shards_dir, tmp_path):
    """`world_size=2`: DDP over two gloo ranks in processes of this machine, each one micro-batch a step, trains the
    losses of one rank accumulating both (up to the all-reduce's rounding)."""
    if sys.platform != "linux":
        pytest.skip("spawned gloo ranks: Linux")
    two = train_in_process(tiny_job(shards_dir, tmp_path / "a", "train.max_steps=2"), world_size=2)
    one = train_in_process(tiny_job(shards_dir, tmp_path / "b", "train.max_steps=2"))
    assert [int(s) for s, _ in two.losses] == [1, 2]
    assert [loss for _, loss in two.losses] == pytest.approx([loss for _, loss in one.losses], rel=1e-5)
