"""Issue 45: the planner's memory modes against the GPU's own count, one process, one JSON line last.

    PYTHONPATH=$PWD python3 tests/gpu/plan_modes_check.py [--device cuda] [--preset medium]

Rows (each `planned / measured` of peak bytes; goal 0.85-1.15, a row that raises is a miss with its reason):
- `train_lora_<storage>[_ac]`: a LoRA rank-8 step (bf16 autocast, fused AdamW) of `--preset`'s transformer whose
  frozen base is stored in bf16 or fp8 (`vidray.models.storage.apply_storage_dtype` when present, else the bf16
  cast + diffusers' `apply_layerwise_casting` it wraps), measured by `torch.cuda.max_memory_allocated` minus what
  was allocated before the model, against `vidray.train.plan.estimate_memory(..., mode=MemoryMode(storage))`;
- `infer_none_bf16`: one CFG denoising step (batch 2, no autograd) of the bf16 transformer against
  `vidray.plan_inference.plan_inference`'s transformer + denoising-step terms.
Block swap, FSDP CPU offload and the model / group / sequential offloads are the storage and inference helpers'
rows (`vidray/train/block_swap.py`, `vidray/models/offload.py`); they compare with the same planner functions.
On `--device cpu` the same code runs with `vidray.train.memory`'s tensor-byte counts (no CUDA allocator).
Not run on a GPU yet (no machine lent to the session that wrote it).
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "benchmarks"))

BUCKET = (9, 64, 64)
INFERENCE_BUCKET = (25, 256, 256)
TEXT_TOKENS = 32


def _peak(device: torch.device, setup, run) -> int:
    """Peak bytes of the model `setup()` returns on `device` plus what `run(model)` allocates: CUDA's allocator
    counts above what was allocated before `setup`; on CPU `vidray.train.memory`'s tensor bytes (the model's
    parameters and buffers tracked, its fp32 build before the storage cast not)."""
    if device.type == "cuda":
        torch.cuda.synchronize(device)
        base = torch.cuda.memory_allocated(device)
        model = setup()
        torch.cuda.reset_peak_memory_stats(device)
        run(model)
        torch.cuda.synchronize(device)
        return torch.cuda.max_memory_allocated(device) - base
    from vidray.train.memory import TensorBytesTracker

    model = setup()
    tracker = TensorBytesTracker()
    with tracker:
        tracker.track(list(model.parameters()), list(model.buffers()))
        run(model)
    return tracker.peak_bytes


def train_row(preset_name: str, storage: str, ac: bool, device: torch.device) -> dict:
    from diffusers import EasyAnimateTransformer3DModel
    from peft import LoraConfig, inject_adapter_in_model

    from _memory_planner import _apply_storage
    from vidray.buckets import Bucket
    from vidray.models.presets import get_preset
    from vidray.train.plan import lora_targets, MemoryMode, Strategy, count_model, estimate_memory

    preset = get_preset(preset_name)
    bucket = Bucket(*BUCKET)
    f_lat, h_lat, w_lat = (bucket.num_frames - 1) // 4 + 1, bucket.height // 8, bucket.width // 8

    def setup():
        torch.manual_seed(0)
        model = EasyAnimateTransformer3DModel(**preset.config)
        model.requires_grad_(False)
        inject_adapter_in_model(LoraConfig(r=8, lora_alpha=8, target_modules=list(lora_targets("easyanimate"))),
                                model)
        _apply_storage(model, storage)
        return model.to(device)

    def run(model):
        if ac:
            model.enable_gradient_checkpointing()
        model.train()
        optimizer = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-4, fused=True)
        for _ in range(2):  # the second step is the steady state (the optimizer state exists)
            optimizer.zero_grad(set_to_none=True)
            with torch.autocast(device.type, dtype=torch.bfloat16):
                pred = model(hidden_states=torch.randn(1, 16, f_lat, h_lat, w_lat, device=device),
                             timestep=torch.rand(1, device=device) * 1000,
                             encoder_hidden_states=torch.randn(1, TEXT_TOKENS, 384, device=device),
                             return_dict=False)[0]
            loss = torch.nn.functional.mse_loss(pred.float(), torch.randn_like(pred, dtype=torch.float32))
            loss.backward()
            del pred, loss
            optimizer.step()

    measured = _peak(device, setup, run)
    planned = estimate_memory(preset, count_model(preset, lora_rank=8), Strategy("lora", ac, "bf16"), bucket=bucket,
                              batch_size=1, text_tokens=TEXT_TOKENS, mode=MemoryMode(storage)).peak_bytes
    return {"planned_bytes": planned, "measured_bytes": measured, "ratio": round(planned / measured, 4)}


def infer_row(preset_name: str, device: torch.device) -> dict:
    from diffusers import EasyAnimateTransformer3DModel

    from vidray.buckets import Bucket
    from vidray.models.presets import get_preset
    from vidray.plan_inference import plan_inference

    preset = get_preset(preset_name)
    bucket = Bucket(*INFERENCE_BUCKET)
    f_lat, h_lat, w_lat = (bucket.num_frames - 1) // 4 + 1, bucket.height // 8, bucket.width // 8

    def setup():
        torch.manual_seed(0)
        return EasyAnimateTransformer3DModel(**preset.config).to(device, torch.bfloat16).eval()

    def run(model):
        with torch.no_grad():
            latents = torch.randn(1, 16, f_lat, h_lat, w_lat, device=device)
            pred = model(hidden_states=torch.cat([latents, latents]).bfloat16(),
                         timestep=torch.full((2,), 500.0, device=device),
                         encoder_hidden_states=torch.randn(2, TEXT_TOKENS, 384, device=device, dtype=torch.bfloat16),
                         return_dict=False)[0]
            uncond, cond = pred.float().chunk(2)
            latents - 0.1 * (uncond + 5.0 * (cond - uncond))

    measured = _peak(device, setup, run)
    none = next(e for e in plan_inference(preset, bucket=bucket, gpu_memory_bytes=2**40, text_tokens=TEXT_TOKENS,
                                          storages=("bf16",)).estimates if e.offload == "none")
    planned = none.components["transformer"] + none.denoise_bytes
    return {"planned_bytes": planned, "measured_bytes": measured, "ratio": round(planned / measured, 4)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--preset", default="medium")
    args = parser.parse_args()
    device = torch.device(args.device)
    if device.type == "cpu":
        torch.set_num_threads(1)
    rows: dict = {}
    jobs = {f"train_lora_{s}{'_ac' if ac else ''}": (lambda s=s, ac=ac: train_row(args.preset, s, ac, device))
            for s in ("bf16", "fp8") for ac in (False, True)}
    jobs["infer_none_bf16"] = lambda: infer_row(args.preset, device)
    for name, job in jobs.items():
        try:
            rows[name] = job()
        except Exception as err:  # one failing row never hides the others
            rows[name] = {"miss": f"{type(err).__name__}: {err}"[:300]}
        print(name, rows[name], flush=True)
    ratios = [r["ratio"] for r in rows.values() if "ratio" in r]
    worst = max((abs(1 - r) for r in ratios), default=None)
    figures = {"plan_modes_max_rel_err": {"value": worst, "unit": "max abs(1 - planned/measured)", "goal": "<= 0.15",
                                          **({} if worst is not None else {"miss": "no row measured"})}}
    print(json.dumps({"check": "plan_modes", "device": str(device), "figures": figures, "rows": rows}))


if __name__ == "__main__":
    main()
