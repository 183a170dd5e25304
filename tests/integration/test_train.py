"""2-worker Ray Train runs on the shipped clips: completion with a checkpoint, and resume at the next step."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from vidray.config import load_job_config
from vidray.data.ingest import prepare
from vidray.train.checkpoint import read_train_state
from vidray.train.trainer import run_training

REPO = Path(__file__).resolve().parents[2]
pytestmark = pytest.mark.integration


@pytest.fixture(scope="module")
def shards_dir(tmp_path_factory):
    out = tmp_path_factory.mktemp("shards")
    summary = prepare(REPO / "samples" / "metadata.json", out, buckets=load_job_config(
        REPO / "jobs/configs/tiny_t2v.yaml").data.buckets, fps=8.0, samples_per_shard=4)
    assert summary.num_kept >= 4
    return out


def tiny_job(shards_dir, storage, **steps):
    overrides = [
        f"data.shards_dir={shards_dir}",
        f"storage.path={storage}",
        "name=test-run",
        "model.text_encoder=tiny_random",
        "train.log_every_steps=2",
        "checkpoint.every_steps=3",
        "checkpoint.num_to_keep=2",
    ] + [f"{k.replace('__', '.')}={v}" for k, v in steps.items()]
    return load_job_config(REPO / "jobs/configs/tiny_t2v.yaml", overrides)


def test_two_workers_train_checkpoint_and_resume_at_next_step(local_ray, shards_dir, tmp_path):
    # 1. A first run of 6 steps: checkpoints at 3 and 6, diffusers weights at the end.
    first = run_training(tiny_job(shards_dir, tmp_path, train__max_steps=6))
    assert [int(s) for s, _ in first.losses] == list(range(1, 7))
    assert first.checkpoint_path and read_train_state(first.checkpoint_path).step == 6
    assert read_train_state(first.checkpoint_path).world_size == 2
    assert (Path(first.diffusers_dir) / "model_index.json").is_file()
    assert list((Path(first.diffusers_dir) / "transformer").glob("*.safetensors"))
    saved = json.loads((Path(first.checkpoint_path) / "train_state.json").read_text())
    assert saved["step"] == 6

    # 2. The same run name with more steps resumes from step 6 and continues at step 7.
    second = run_training(tiny_job(shards_dir, tmp_path, train__max_steps=9))
    assert second.first_step == 7
    assert [int(s) for s, _ in second.losses] == [7, 8, 9]
    assert read_train_state(second.checkpoint_path).step == 9
    kept = sorted(p.name for p in (tmp_path / "test-run").glob("checkpoint_0*"))
    assert kept == ["checkpoint_000006", "checkpoint_000009"]  # num_to_keep=2


def test_resume_reproduces_the_uninterrupted_run(local_ray, shards_dir, tmp_path):
    """Exact resume: 3 steps + 3 resumed steps give the same losses as 6 steps in one go."""
    straight = run_training(tiny_job(shards_dir, tmp_path / "a", train__max_steps=6))
    run_training(tiny_job(shards_dir, tmp_path / "b", train__max_steps=3))
    resumed = run_training(tiny_job(shards_dir, tmp_path / "b", train__max_steps=6))
    assert [s for s, _ in resumed.losses] == [4, 5, 6]
    expected = dict((int(s), v) for s, v in straight.losses)
    for step, loss in resumed.losses:
        assert loss == pytest.approx(expected[int(step)], rel=1e-4, abs=1e-5)


def test_worker_killed_mid_run_restarts_from_checkpoint_and_matches_uninterrupted_run(local_ray, shards_dir, tmp_path):
    """SIGKILL one Ray Train worker once the step-5 checkpoint is committed (the step-10 one is being written, and
    `report` is a barrier): the group restarts from the latest committed checkpoint (FailureConfig) and the run ends
    exactly where an uninterrupted run ends."""
    import os
    import signal
    import threading
    import time

    import ray
    from ray.util.state import list_actors

    killed: list[int] = []

    def kill_a_worker_after_first_checkpoint():
        deadline = time.monotonic() + 120
        while time.monotonic() < deadline and not (tmp_path / "b" / "test-run" / "checkpoint_000010").exists():
            time.sleep(0.05)
        # This test's own cluster, by address: another Ray on the host must not make the lookup ambiguous.
        workers = list_actors(address=ray.get_runtime_context().gcs_address,
                              filters=[("class_name", "=", "RayTrainWorker"), ("state", "=", "ALIVE")])
        if workers:
            os.kill(workers[-1].pid, signal.SIGKILL)
            killed.append(workers[-1].pid)

    killer = threading.Thread(target=kill_a_worker_after_first_checkpoint, daemon=True)
    killer.start()
    interrupted = run_training(tiny_job(shards_dir, tmp_path / "b", train__max_steps=40,
                                        checkpoint__every_steps=5, train__max_failures=2))
    killer.join(timeout=5)
    assert killed, "no worker was alive to kill: the run finished before its first checkpoint was seen"
    assert interrupted.first_step > 1  # the final attempt started from a checkpoint, not from scratch

    straight = run_training(tiny_job(shards_dir, tmp_path / "a", train__max_steps=40, checkpoint__every_steps=5))
    expected = {int(s): v for s, v in straight.losses}
    assert [int(s) for s, _ in interrupted.losses] == list(range(interrupted.first_step, 41))
    for step, loss in interrupted.losses:
        assert loss == pytest.approx(expected[int(step)], rel=1e-4, abs=1e-5)
