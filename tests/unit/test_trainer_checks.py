"""Driver-side checks of `run_training`: they fail before Ray starts, naming the fix."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from vidray.config import load_job_config
from vidray.data.ingest import prepare_data
from vidray.train.checkpoint import TrainState, save_checkpoint
from vidray.train.trainer import check_job_inputs, latest_checkpoint

REPO = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module")
def job_and_index(tmp_path_factory):
    root = tmp_path_factory.mktemp("checks")
    job = load_job_config(REPO / "jobs/configs/tiny_t2v.yaml", [
        f"data.source={REPO / 'samples/metadata.json'}", f"data.shards_dir={root / 'shards'}",
        f"storage.path={root / 'runs'}", "train.max_steps=10",
    ])
    summary = prepare_data(job.data, progress=None)
    from vidray.data.shards import read_index

    return job, read_index(job.data.shards_dir), summary


def fake_checkpoint(directory: Path, *, step: int, index_hash: str, world_size: int = 2) -> Path:
    model = torch.nn.Linear(2, 2)
    optimizer = torch.optim.AdamW(model.parameters())
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda s: 1.0)
    return save_checkpoint(directory, transformer_state=model.state_dict(), optimizer=optimizer,
                           lr_scheduler=scheduler, train_state=TrainState(step, 0, 0, world_size, index_hash),
                           job_config={})


def test_fresh_run_passes(job_and_index):
    job, _, summary = job_and_index
    assert summary.num_kept == 6
    check_job_inputs(job)


def test_missing_shards_say_run_prepare(job_and_index, tmp_path):
    job, _, _ = job_and_index
    with pytest.raises(FileNotFoundError, match="vidray prepare"):
        check_job_inputs(load_job_config(None, [f"data.shards_dir={tmp_path}"]))


def test_fps_and_bucket_mismatch_with_shards(job_and_index):
    job, _, _ = job_and_index
    base = [f"data.shards_dir={job.data.shards_dir}"]
    with pytest.raises(ValueError, match="prepared at 8.0 fps but data.fps is 16.0"):
        check_job_inputs(load_job_config(None, base + ["data.fps=16"]))
    with pytest.raises(ValueError, match="not in data.buckets"):
        check_job_inputs(load_job_config(None, base + ["data.buckets=[[9, 64, 64]]"]))


def test_resume_past_max_steps_and_from_other_shards_are_refused(job_and_index):
    job, index, _ = job_and_index
    run_dir = job.run_dir
    fake_checkpoint(run_dir / "checkpoint_000004", step=4, index_hash=index["content_hash"])
    (run_dir / "checkpoint_000008").mkdir()  # an unfinished write: no manifest, never resumed from
    assert latest_checkpoint(run_dir).name == "checkpoint_000004"
    check_job_inputs(job)  # step 4 < max_steps 10: resumes

    fake_checkpoint(run_dir / "checkpoint_000010", step=10, index_hash=index["content_hash"])
    with pytest.raises(ValueError, match="already at step 10 >= train.max_steps 10: raise train.max_steps"):
        check_job_inputs(job)

    other = load_job_config(None, [f"data.shards_dir={job.data.shards_dir}", f"storage.path={job.storage.path}",
                                   "name=other", "train.max_steps=20"])
    fake_checkpoint(other.run_dir / "checkpoint_000002", step=2, index_hash="sha256:elsewhere")
    with pytest.raises(ValueError, match="trained on other shards"):
        check_job_inputs(other)
