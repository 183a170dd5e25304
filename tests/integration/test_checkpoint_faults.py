"""A worker killed while it copies a checkpoint into the run folder: the previous checkpoint stays the latest
complete one, and the run re-run from it ends as an uninterrupted run does. Killed right after the copy's last
file (the manifest), before Ray Train registered the checkpoint: the restart inside the run continues from that
complete checkpoint, not from Ray's previous one, and the unregistered folder does not outlive
`checkpoint.num_to_keep`; with no restart allowed (as a Ctrl-C there), the same command re-run resumes from it and
`checkpoint.num_to_keep` still holds in the run folder when it ends.

The kills are real (SIGKILL of the Ray Train worker process) and land at chosen points of the copy of
`checkpoint_000004`: after `optimizer.pt` (before the manifest), or after `manifest.json` (the fault-injection
variable `vidray.train.checkpoint.FAULT_ENV`, each fault armed by deleting its marker file)."""

from __future__ import annotations

from pathlib import Path

import pytest

from vidray.config import load_job_config
from vidray.train.checkpoint import FAULT_ENV, CheckpointManager, read_train_state, verify_checkpoint
from vidray.train.trainer import run_training

from tests.integration.conftest import assert_same_training_state, uninterrupted_run

REPO = Path(__file__).resolve().parents[2]
pytestmark = pytest.mark.integration


@pytest.fixture(scope="module")
def fault_ray(tmp_path_factory):
    """A local Ray whose workers inherit the fault variable, both faults disarmed (their markers exist); yields
    {part: marker file}."""
    import ray

    from vidray.runtime import apply_ray_env_defaults, init_ray

    folder = tmp_path_factory.mktemp("fault")
    markers = {part: folder / f"killed-after-{part}" for part in ("optimizer.pt", "manifest.json")}
    for marker in markers.values():
        marker.write_text("disarmed")
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv(FAULT_ENV, ";".join(f"4:{part}:{marker}" for part, marker in markers.items()))
        apply_ray_env_defaults()
        if ray.is_initialized():
            ray.shutdown()
        init_ray(num_cpus=4)
        yield markers
        ray.shutdown()


@pytest.fixture(scope="module")
def straight_run(fault_ray, shards_dir) -> tuple[dict[int, float], Path]:
    """({step: loss}, its checkpoint folder at step 6) of the job run without a fault: the session's reference run
    (`conftest.uninterrupted_run`, the same job trained 40 steps in one go; a step's loss and state do not depend
    on `train.max_steps` or the checkpoint cadence), trained here with both faults disarmed when no module before
    trained it."""
    losses, run_dir = uninterrupted_run(shards_dir)
    assert all(m.read_text() == "disarmed" for m in fault_ray.values())  # the uninterrupted run was not touched
    assert read_train_state(run_dir / "checkpoint_000006").step == 6
    return losses, run_dir / "checkpoint_000006"


@pytest.fixture
def straight_losses(straight_run) -> dict[int, float]:
    return straight_run[0]


def job(shards_dir, storage: Path, **extra):
    overrides = [f"data.shards_dir={shards_dir}", f"storage.path={storage}", "name=faults",
                 "model.text_encoder=tiny_random", "train.max_steps=6", "train.log_every_steps=2",
                 "checkpoint.every_steps=2", "checkpoint.num_to_keep=null"]
    return load_job_config(REPO / "jobs/configs/tiny_t2v.yaml",
                           overrides + [f"{k.replace('__', '.')}={v}" for k, v in extra.items()])


def test_kill_during_checkpoint_copy_keeps_the_previous_checkpoint_and_the_run_ends_as_uninterrupted(
        fault_ray, straight_losses, straight_run, shards_dir, tmp_path):
    marker, expected = fault_ray["optimizer.pt"], straight_losses

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
        assert loss == expected[int(step)], step
    assert_same_training_state(rerun.checkpoint_path, straight_run[1])  # exact resume: bitwise equal
    assert run.complete() == ["checkpoint_000002", "checkpoint_000004", "checkpoint_000006"]
    verify_checkpoint(partial)  # rewritten whole


def test_kill_after_the_copy_before_ray_registers_it_restarts_from_that_checkpoint_and_keeps_num_to_keep(
        fault_ray, straight_losses, straight_run, shards_dir, tmp_path, capfd):
    # The copy of checkpoint 4 is whole (its manifest is in) but the worker dies before Ray Train registers it, so
    # Ray's latest is checkpoint 2. The restart (train.max_failures=1) must continue at step 5, not retrain 3-4.
    marker, expected = fault_ray["manifest.json"], straight_losses
    marker.unlink()
    run = run_training(job(shards_dir, tmp_path, train__max_failures=1, checkpoint__num_to_keep=2))
    assert "after copying manifest.json of checkpoint_000004" in marker.read_text()
    out = capfd.readouterr().out
    assert "restarted from this run's checkpoint checkpoint_000004 at step 4 (the run folder's latest complete)" in out
    assert run.first_step == 5
    assert [int(s) for s, _ in run.losses] == [5, 6]
    for step, loss in run.losses:
        assert loss == expected[int(step)], step
    assert_same_training_state(run.checkpoint_path, straight_run[1])  # exact resume: bitwise equal
    # Ray kept its two newest, 2 and 6; checkpoint 4, which it never registered, is removed after the run.
    assert CheckpointManager(tmp_path / "faults").complete() == ["checkpoint_000002", "checkpoint_000006"]
    assert "removed checkpoint_000004" in out


def test_run_stopped_before_ray_registers_its_last_checkpoint_then_rerun_keeps_num_to_keep(
        fault_ray, straight_losses, straight_run, shards_dir, tmp_path, capfd):
    # A new user's trial: a run stopped (Ctrl-C there; here its worker killed with no restart allowed) after the copy
    # of checkpoint 4 but before Ray registered it. Ray's checkpoint list names checkpoint 2 as the latest, the run
    # folder's latest complete one is 4: the same command re-run resumes from 4 and sets Ray's list aside, so Ray's
    # rotation knows only the checkpoints of the re-run. checkpoint.num_to_keep=2 must still hold when it ends (it
    # left checkpoints 2, 4 and 6 before).
    marker, expected = fault_ray["manifest.json"], straight_losses
    marker.unlink()
    with pytest.raises(Exception):  # noqa: B017 - Ray's TrainingFailedError wrapping the dead worker
        run_training(job(shards_dir, tmp_path, train__max_failures=0, checkpoint__num_to_keep=2))
    assert "after copying manifest.json of checkpoint_000004" in marker.read_text()
    run = CheckpointManager(tmp_path / "faults")
    assert run.complete() == ["checkpoint_000002", "checkpoint_000004"]
    capfd.readouterr()
    rerun = run_training(job(shards_dir, tmp_path, checkpoint__num_to_keep=2))
    out = capfd.readouterr().out
    assert rerun.first_step == 5
    for step, loss in rerun.losses:
        assert loss == expected[int(step)], step
    assert_same_training_state(rerun.checkpoint_path, straight_run[1])  # exact resume: bitwise equal
    assert run.complete() == ["checkpoint_000004", "checkpoint_000006"]
    assert ("Ray Train's checkpoint list (checkpoint_manager_snapshot.json) disagrees with the run folder: it names "
            "checkpoint_000002 as the latest checkpoint, not checkpoint_000004 (a run stopped after "
            "checkpoint_000004's copy, before Ray registered it)") in out
    assert "removed checkpoint_000002 (checkpoint.num_to_keep=2" in out
