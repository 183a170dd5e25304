"""`tests/gpu/ray_rows.py` (the Ray rows of `tests/gpu/run.sh`) on CPU, so that it cannot rot between GPU loans: the
tiny job through Ray Train, then the shipped Serve app serving its export and rendering one request over HTTP. Every
figure is measured or a miss whose reason is that it needs CUDA."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "gpu"))
import ray_rows  # noqa: E402

pytestmark = pytest.mark.integration


def test_the_ray_rows_train_the_tiny_job_and_serve_its_export_on_cpu(monkeypatch):
    for name, value in (("VIDRAY_API_TOKEN", ray_rows.TOKEN), ("NCCL_DEBUG", "WARN"),
                        ("RAY_TRAIN_HEALTH_CHECK_INTERVAL_S", "0.1")):
        monkeypatch.setenv(name, value)  # restored after the test (main only sets them when absent)
    out = ray_rows.main(["--device", "cpu", "--steps", "2", "--serve-steps", "2"])
    figures = out["figures"]
    assert set(figures) == {"ray_train_steps_per_s", "ray_train_loss_last_over_first", "ray_train_nccl_log_lines",
                            "ray_serve_deploy_s", "ray_serve_render_s", "ray_serve_mp4_bytes",
                            "ray_serve_denoiser_gpu_mib"}, out
    for name, figure in figures.items():
        assert figure["value"] is not None or figure["miss"].startswith("no CUDA"), (name, figure)
    assert figures["ray_train_steps_per_s"]["value"] > 0 and figures["ray_serve_mp4_bytes"]["value"] > 1000
    assert out["details"]["ray_train"]["steps"] == 2 and out["details"]["ray_serve"]["denoiser_pids"]
