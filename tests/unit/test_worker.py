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
from vidray.train.checkpoint import read_train_state
from vidray.train.local import train_in_process
from vidray.train.trainer import run_training

from tests.conftest import assert_same_training_state

REPO = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module")
def shards_dir(tmp_path_factory) -> Path:
    """The shipped clips prepared with the tiny job's buckets (as the integration tests' `shards_dir`)."""
    from vidray.data.ingest import prepare

    out = tmp_path_factory.mktemp("shards")
    summary = prepare(REPO / "samples" / "metadata.json", out, buckets=load_job_config(
        REPO / "jobs/configs/tiny_t2v.yaml").data.buckets, fps=8.0, samples_per_shard=4)
    assert summary.num_kept >= 4
    return out


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
