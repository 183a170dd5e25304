"""The tiny job on one GPU worker (NCCL backend). Skipped where CUDA is absent (CI, the CPU dev machines).

Run on a GPU machine: `.venv/bin/python -m pytest -q -s tests/gpu` (prints the mean step time).
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from vidray.config import load_job_config
from vidray.data.ingest import prepare_data
from vidray.train.trainer import run_training

REPO = Path(__file__).resolve().parents[2]
pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")]


def test_tiny_job_trains_on_one_gpu_with_nccl(tmp_path):
    job = load_job_config(REPO / "jobs/configs/tiny_t2v.yaml", [
        f"data.source={REPO / 'samples/metadata.json'}", f"data.shards_dir={tmp_path / 'shards'}",
        f"storage.path={tmp_path / 'runs'}", "scaling.use_gpu=true", "scaling.num_workers=1",
        "train.max_steps=60", "train.log_every_steps=20", "checkpoint.every_steps=60",
    ])
    prepare_data(job.data)
    result = run_training(job)
    losses = [loss for _, loss in result.losses]
    assert len(losses) == 60
    assert sum(losses[-10:]) < sum(losses[:10])
    print(f"\nGPU tiny job: {result.steps_per_s:.2f} steps/s ({1000 / result.steps_per_s:.1f} ms/step)")
