"""`tests/gpu/serve_parallel_rows.py` (the 2-GPU spanning Denoiser replica's row of `tests/gpu/run.sh`) on a machine
with fewer than 2 GPUs: it imports, runs to its last JSON line as run.sh runs it, and reports every figure as a
miss naming the GPUs it needs and has, which `merge_rows` keeps (no row silently absent)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch

GPU_DIR = Path(__file__).resolve().parents[1] / "gpu"
sys.path.insert(0, str(GPU_DIR))
import merge_rows  # noqa: E402
import serve_parallel_rows  # noqa: E402


@pytest.mark.skipif(torch.cuda.device_count() >= 2, reason="this machine has 2 GPUs: the row measures instead")
def test_the_spanning_replica_row_skips_with_its_reason_below_two_gpus(tmp_path):
    run = subprocess.run([sys.executable, str(GPU_DIR / "serve_parallel_rows.py")], capture_output=True, text=True,
                         timeout=300, cwd=GPU_DIR.parents[1])
    assert run.returncode == 0, run.stderr[-2000:]
    row = merge_rows.last_json(run.stdout)
    assert row is not None and row["benchmark"] == "gpu_serve_parallel_rows", run.stdout
    assert set(row["figures"]) == set(serve_parallel_rows.SPLITS)
    gpus = torch.cuda.device_count()
    for figure in row["figures"].values():
        assert figure["value"] is None and figure["goal"] == ">= 40"
        assert figure["miss"] == f"needs 2 GPUs for a Denoiser replica spanning 2 (denoiser.gpus: 2); this machine " \
                                 f"has {gpus}"
    # run.sh's merge keeps the misses under their names
    (tmp_path / "serve_parallel_rows.log").write_text(run.stdout)
    (tmp_path / "serve_parallel_rows.rc").write_text("0")
    merged = merge_rows.merge(tmp_path)
    assert set(serve_parallel_rows.SPLITS) <= set(merged["figures"]), merged
    assert serve_parallel_rows.skipped(1)["figures"]["serve_2gpu_cfg_parallel_psnr_db"]["miss"].endswith("has 1")


def test_run_sh_runs_the_row_after_the_generate_row():
    rows = (GPU_DIR / "run.sh").read_text().split("ROWS=(", 1)[1].split(")", 1)[0].split()
    assert rows.index("tests/gpu/serve_parallel_rows.py") == rows.index("tests/gpu/parallel_rows.py") + 1
