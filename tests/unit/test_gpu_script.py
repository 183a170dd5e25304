"""`tests/gpu/scale_check.py` (what `tests/gpu/run.sh` runs on a lent GPU) runs on CPU on the tiny preset, so that
it cannot rot between GPU loans: every part reports figures or a miss with its reason."""

from __future__ import annotations

import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "gpu"))
import scale_check  # noqa: E402


def test_the_gpu_script_trains_the_tiny_preset_with_bf16_and_ac_on_cpu_and_reports_each_figure():
    torch.set_num_threads(1)
    out = scale_check.main(["--device", "cpu", "--preset", "tiny", "--frames", "9", "--height", "64", "--width", "64",
                            "--steps", "2", "--only", "big,fsdp1,serve"])
    figures = out["figures"]
    assert figures["big_step_time"]["value"] > 0 and 0 < figures["big_mfu"]["value"] < 1
    assert "max_memory_allocated" in figures["big_peak_over_planned"]["miss"]  # measured on CUDA only
    assert out["details"]["big"]["strategy"] == "ddp+AC bf16"  # a full fine-tune fits the planned 16 GiB
    assert figures["fsdp1_loss_last_over_first"]["value"] < 1  # FSDP2 on one rank (gloo) learns
    assert set(figures["serve_one_request_s"]) >= {"value", "miss"}
