"""GPU row of issue 47: a video split over 2 GPUs (NCCL) against one GPU's, for when a machine with 2+ GPUs is lent.

`python tests/gpu/parallel_rows.py` (run by `tests/gpu/run.sh`): the tiny random Wan model, exported as a run
exports it, sampled by `vidray generate` on one GPU and with `--gpus 2`, with guidance (CFG parallel: one branch a
GPU) and without (context parallel: the sequence split over both, Ulysses over NCCL). Figures: the PSNR of each
2-GPU video against the 1-GPU one (goal >= 40 dB) and the seconds of each run. On a machine with fewer than 2 GPUs
(the single-GPU kinds lent so far) every figure is a miss saying so. The last stdout line is one JSON object.
"""

from __future__ import annotations

import json
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO))
from benchmarks._figures import miss  # noqa: E402
from benchmarks.context_parallel import _psnr, _wan_folder  # noqa: E402

FIGURES = {"cfg_parallel_2gpu_psnr_db": 4.0, "cp2_2gpu_psnr_db": 1.0}
"""{figure: the guidance scale of its run}"""


def _generate(model: Path, out: Path, guidance: float, *gpus: str) -> float:
    """Seconds of one `vidray generate` run writing `out` (crf 0); raises CalledProcessError with its output."""
    start = time.perf_counter()
    subprocess.run([sys.executable, "-m", "vidray.cli", "generate", "--model", str(model), "--prompt",
                    "a red ball bouncing", "--output", str(out), "--guidance-scale", str(guidance),
                    "--num-inference-steps", "4", "--seed", "7", "--crf", "0", *gpus],
                   check=True, cwd=REPO, capture_output=True, text=True)
    return time.perf_counter() - start


def main() -> None:
    gpus = torch.cuda.device_count()
    if gpus < 2:
        why = f"needs 2 GPUs; this machine has {gpus}"
        figures = {name: miss(why, unit="dB", goal=">= 40") for name in FIGURES}
        print(json.dumps({"benchmark": "gpu_parallel_rows", "figures": figures}))
        return
    from vidray.data.video import decode_mp4

    figures, details = {}, {}
    with tempfile.TemporaryDirectory(prefix="vidray-gpu-parallel-") as tmp:
        model = _wan_folder(Path(tmp))
        for name, guidance in FIGURES.items():
            one, two = Path(tmp) / f"{name}.1.mp4", Path(tmp) / f"{name}.2.mp4"
            try:
                details[name] = {"one_gpu_s": _generate(model, one, guidance),
                                 "two_gpus_s": _generate(model, two, guidance, "--gpus", "2")}
            except subprocess.CalledProcessError as err:
                figures[name] = miss(f"vidray generate failed: {(err.stderr or '').strip()[-300:]}", unit="dB",
                                     goal=">= 40")
                continue
            value = _psnr(decode_mp4(two.read_bytes()), decode_mp4(one.read_bytes()))
            figures[name] = {"value": value, "unit": "dB", "goal": ">= 40"}
    print(json.dumps({"benchmark": "gpu_parallel_rows", "device": torch.cuda.get_device_name(), "figures": figures,
                      "details": details}))


if __name__ == "__main__":
    main()
