"""`tests/gpu/scale_check.py` (what `tests/gpu/run.sh` runs on a lent GPU) runs on CPU on the tiny preset, so that
it cannot rot between GPU loans: every part its docstring lists exists and reports a measured figure, or a miss
whose reason is that the figure needs CUDA or a library the machine lacks; a placeholder ("not wired yet") fails."""

from __future__ import annotations

import re
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "gpu"))
import scale_check  # noqa: E402

CPU_ONLY_MISSES = re.compile(r"no CUDA|torch\.cuda|is not installed here")
"""The only reasons a figure may be missing on CPU: it is measured on CUDA, or a library is not installed."""


def test_the_gpu_script_trains_the_tiny_preset_with_bf16_and_ac_on_cpu_and_reports_each_figure():
    torch.set_num_threads(1)
    listed = re.findall(r"^- `(\w+)`:", scale_check.__doc__, re.M)
    assert listed == list(scale_check.PARTS), "the docstring's parts are the script's parts"
    ran = [p for p in scale_check.PARTS if p != "tiny"]  # tiny: the tiny job through Ray Train (tests/integration)
    out = scale_check.main(["--device", "cpu", "--preset", "tiny", "--frames", "9", "--height", "64", "--width", "64",
                            "--steps", "2", "--only", ",".join(ran)])
    figures = out["figures"]
    for name, figure in figures.items():
        assert figure.get("value") is not None or CPU_ONLY_MISSES.search(figure["miss"]), (name, figure)
        assert any(name.startswith(part) for part in ran), name
    assert figures["big_step_time"]["value"] > 0 and 0 < figures["big_mfu"]["value"] < 1
    assert "max_memory_allocated" in figures["big_peak_over_planned"]["miss"]  # measured on CUDA only
    assert out["details"]["big"]["strategy"] == "ddp+AC bf16"  # a full fine-tune fits the planned 16 GiB
    assert figures["fsdp1_loss_last_over_first"]["value"] < 1  # FSDP2 on one rank (gloo) learns
