"""A worker killed while it copies a checkpoint into the run folder: the previous checkpoint stays the latest
complete one, and the run re-run from it ends as an uninterrupted run does. (A restart inside the run takes the
same path: Ray Train registers a checkpoint only once the copy returned, so it restarts from the previous one, as
`tests/integration/test_train.py` shows for a worker killed between checkpoints.)

The kill is real (SIGKILL of the Ray Train worker process) and lands at a chosen point of the copy: after
`optimizer.pt` of `checkpoint_000004` is in the run folder and before its manifest (the fault-injection variable
`vidray.train.checkpoint.FAULT_ENV`, armed by deleting its marker file)."""

from __future__ import annotations

from pathlib import Path

import pytest

from vidray.config import load_job_config
from vidray.train.checkpoint import FAULT_ENV, CheckpointManager, verify_checkpoint
from vidray.train.trainer import run_training

REPO = Path(__file__).resolve().parents[2]
pytestmark = pytest.mark.integration


@pytest.fixture(scope="module")
def fault_ray(tmp_path_factory):
    """A local Ray whose workers inherit the fault variable (disarmed: its marker exists); yields the marker."""
    import ray

    from vidray.runtime import apply_ray_env_defaults, init_ray

    marker = tmp_path_factory.mktemp("fault") / "killed"
    marker.write_text("disarmed")
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv(FAULT_ENV, f"4:optimizer.pt:{marker}")
        apply_ray_env_defaults()
        if ray.is_initialized():
            ray.shutdown()
        init_ray(num_cpus=4)
        yield marker
        ray.shutdown()


def job(shards_dir, storage: Path, **extra):
    overrides = [f"data.shards_dir={shards_dir}", f"storage.path={storage}", "name=faults",
                 "model.text_encoder=tiny_random", "train.max_steps=6", "train.log_every_steps=2",
                 "checkpoint.every_steps=2", "checkpoint.num_to_keep=null"]
    return load_job_config(REPO / "jobs/configs/tiny_t2v.yaml",
                           overrides + [f"{k.replace('__', '.')}={v}" for k, v in extra.items()])


def test_kill_during_checkpoint_copy_keeps_the_previous_checkpoint_and_the_run_ends_as_uninterrupted(
        fault_ray, shards_dir, tmp_path):
    marker = fault_ray
    straight = run_training(job(shards_dir, tmp_path / "straight"))
    assert marker.read_text() == "disarmed"  # the uninterrupted run was not touched
    expected = {int(s): v for s, v in straight.losses}

    # Killed with no restart allowed (train.max_failures=0): the run fails, the folder holds the unfinished copy
    # without a manifest, and re-running the same command resumes from checkpoint 2 and overwrites that folder.
    marker.unlink()
    with pytest.raises(Exception):  # noqa: B017 - Ray's TrainingFailedError wrapping the dead worker
        run_training(job(shards_dir, tmp_path / "rerun", train__max_failures=0))
    assert "after copying optimizer.pt of checkpoint_000004" in marker.read_text()
    run = CheckpointManager(tmp_path / "rerun" / "faults")
    assert run.latest() == "checkpoint_000002"
    assert run.unfinished() == ["checkpoint_000004"]
    partial = tmp_path / "rerun" / "faults" / "checkpoint_000004"
    assert (partial / "optimizer.pt").is_file() and not (partial / "manifest.json").exists()
    rerun = run_training(job(shards_dir, tmp_path / "rerun"))
    assert rerun.first_step == 3
    for step, loss in rerun.losses:
        assert loss == pytest.approx(expected[int(step)], rel=1e-4, abs=1e-5)
    assert run.complete() == ["checkpoint_000002", "checkpoint_000004", "checkpoint_000006"]
    verify_checkpoint(partial)  # rewritten whole
