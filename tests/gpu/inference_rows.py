"""GPU inference rows of issue 45, for `tests/gpu/run.sh` when a GPU machine is lent (CUDA only; CI never has one).

    PYTHONPATH=$PWD python3 tests/gpu/inference_rows.py      # ~1-2 min on one H100; last line: one JSON object

The model: an EasyAnimate pipeline folder of the `medium` preset's transformer (38.6 M parameters, random weights,
in `vidray.shape_presets`) with the tiny random text encoder and VAE, exported as training exports
it (fp32 safetensors + vidray_job.yaml; the folder names no device). Through the real CLI (`vidray.cli.main
["generate", ...]`, in this process, one run after another: the allocator's peak is reset and the cache emptied
between runs), 9x64x64, 8 steps, crf 0:

- `generate_bf16_s`, dtype: `--storage-dtype auto` (bf16 on the GPU), `--offload none`;
- per offload mode (none, model, group, sequential) and for fp8 storage: peak `torch.cuda.max_memory_allocated`
  bytes, seconds, and the PSNR of its frames against the bf16 `none` run's (the offload modes move weights, not
  math: expected identical frames, or within bf16 rounding for group offload's streams);
- `model_offload_peak_vs_expected`: model offload's peak over the bytes it is expected to hold: the largest
  component in its compute dtype (bf16; the VAE follows the storage dtype for EasyAnimate), plus the sampler's
  activations measured as the `none` run's peak minus all components' bytes. The planner's `plan_inference` (the
  planner helper's) did not exist on this branch: the expected bytes are computed here from the components'
  parameter bytes, as said; the owner may swap in the planner's figure (goal: within 15 %).

Without CUDA it prints one JSON object with every figure a miss.
"""

from __future__ import annotations

import gc
import json
import math
import os
import sys
import tempfile
import time
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")
sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

MODES = ("none", "model", "group", "sequential")
BUCKET = "9x64x64"
STEPS = 8


def _model_dir(root: Path) -> Path:
    """The medium-preset EasyAnimate folder (module docstring)."""
    import torch
    from diffusers import EasyAnimateTransformer3DModel

    from vidray.config import FlowConfig, ModelConfig, job_config_from_dict
    from vidray.models import get_family
    from vidray.models.export import write_job_file
    from vidray.models.presets import get_preset

    family = get_family("easyanimate")
    components = family.build(ModelConfig(text_encoder="tiny_random", max_sequence_length=16), seed=0)
    config = dict(get_preset("medium").config)
    config["text_embed_dim"] = components.transformer.config.text_embed_dim  # the tiny text encoder's width
    torch.manual_seed(0)
    components.transformer = EasyAnimateTransformer3DModel(**config)
    out = family.save_pipeline(components, root / "diffusers", FlowConfig(shift=3.0))
    write_job_file(out, job_config_from_dict({
        "name": "gpu-inference", "model": {"text_encoder": "tiny_random", "max_sequence_length": 16},
        "data": {"buckets": [[9, 64, 64]]}, "flow": {"shift": 3.0}}))
    return out


def _component_bytes(model_dir: Path) -> dict[str, int]:
    """Each component's bytes in bf16 (the compute dtype `auto` gives on a GPU), from its parameter count."""
    from vidray.models.export import load_model

    model = load_model(model_dir)
    counts = {name: sum(p.numel() for p in getattr(model.components, name).parameters())
              for name in ("text_encoder", "transformer", "vae")}
    return {name: 2 * n for name, n in counts.items()}


def _psnr(a, b) -> float | None:
    """`vidray.compare.video_psnr` of uint8 frames `a` against `b` for the JSON row: dB rounded to 0.01, 99.0 when
    equal (JSON has no inf), None when their shapes differ (a miss in the row, not an error ending the script)."""
    from vidray.compare import video_psnr

    if a.shape != b.shape:
        return None
    value = video_psnr(a, b)
    return 99.0 if math.isinf(value) else round(value, 2)


def _run(model_dir: Path, out: Path, *flags: str) -> dict:
    import torch

    from vidray.cli import main
    from vidray.data.video import decode_mp4

    gc.collect()
    torch.cuda.empty_cache()
    torch.cuda.reset_peak_memory_stats()
    before = torch.cuda.memory_allocated()
    started = time.perf_counter()
    code = main(["generate", "--model", str(model_dir), "--prompt", "a red ball on a table", "--output", str(out),
                 "--bucket", BUCKET, "--num-inference-steps", str(STEPS), "--crf", "0", *flags])
    torch.cuda.synchronize()
    seconds = time.perf_counter() - started
    peak = torch.cuda.max_memory_allocated() - before
    return {"exit": code, "seconds": round(seconds, 2), "peak_allocated_bytes": int(peak),
            "frames": decode_mp4(out.read_bytes()) if code == 0 else None}


def main() -> None:
    import torch

    figures: dict = {}
    if not torch.cuda.is_available():
        reason = {"value": None, "miss": "no CUDA device"}
        print(json.dumps({"benchmark": "gpu_inference_rows", "figures": {
            "generate_bf16_s": {**reason, "unit": "s"},
            "model_offload_peak_vs_expected": {**reason, "unit": "ratio", "goal": "0.85..1.15"}}}))
        return
    root = Path(tempfile.mkdtemp(prefix="vidray-gpu-inference-"))
    model_dir = _model_dir(root)
    sizes = _component_bytes(model_dir)
    rows = {}
    for mode in MODES:
        rows[mode] = _run(model_dir, root / f"{mode}.mp4", "--offload", mode)
    rows["fp8"] = _run(model_dir, root / "fp8.mp4", "--storage-dtype", "fp8")
    rows["fp32"] = _run(model_dir, root / "fp32.mp4", "--storage-dtype", "fp32")
    reference = rows["none"]["frames"]
    details = {}
    for name, row in rows.items():
        frames = row.pop("frames")
        row["psnr_vs_bf16_none_db"] = None if frames is None or reference is None else _psnr(frames, reference)
        details[name] = row
    activations = max(0, rows["none"]["peak_allocated_bytes"] - sum(sizes.values()))
    expected = max(sizes.values()) + activations
    figures["generate_bf16_s"] = {"value": rows["none"]["seconds"], "unit": "s"}
    figures["model_offload_peak_vs_expected"] = {
        "value": round(rows["model"]["peak_allocated_bytes"] / expected, 3), "unit": "ratio", "goal": "0.85..1.15",
        "expected": "largest component's bf16 bytes + the none run's activations (no plan_inference on this branch)"}
    figures["offload_frames_equal_none"] = {
        "value": all((details[m]["psnr_vs_bf16_none_db"] or 0) >= 40 for m in MODES[1:]), "unit": "bool",
        "goal": "true (PSNR >= 40 dB vs none)"}
    figures["fp8_vs_bf16_gpu_psnr_db"] = {"value": details["fp8"]["psnr_vs_bf16_none_db"], "unit": "dB",
                                          "goal": ">= 25"}
    print(json.dumps({"benchmark": "gpu_inference_rows", "device": torch.cuda.get_device_name(),
                      "figures": figures, "details": {"component_bf16_bytes": sizes, "rows": details}}))


if __name__ == "__main__":
    main()
