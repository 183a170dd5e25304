"""The planner's figure of `benchmarks/memory_modes.py`: planned vs measured tensor bytes for every memory mode a CPU
runs, on vidray's `medium` preset (EasyAnimate class, 6 blocks x 512, 38.6 M parameters).

- training, LoRA rank 8 on a frozen base stored in fp32, bf16 and fp8 (with and without activation checkpointing,
  bf16 autocast): `vidray.train.memory.measure_training_step` (peak tensor bytes of a steady-state step) vs
  `vidray.train.plan.estimate_memory(..., mode=MemoryMode(storage))`. fp8 storage is applied as
  `vidray.models.storage.apply_storage_dtype` does when that module is present; otherwise directly, as the storage
  helper's agreed recipe: the frozen weights cast to bf16, then diffusers' `apply_layerwise_casting(transformer,
  storage_dtype=float8_e4m3fn, compute_dtype=bfloat16, skip_modules_pattern=DEFAULT_SKIP_MODULES_PATTERN +
  ("lora_",))`.
- inference, offload none: one denoising step (no autograd, classifier-free guidance: batch 2) of the transformer
  in fp32 and in bf16, peak tensor bytes (weights included) vs `vidray.plan_inference.plan_inference`'s
  transformer + denoising-step terms (the text encoder, the VAE and its decode are not part of this measurement).

Block swap, FSDP CPU offload and the model / group / sequential offloads need CUDA: tests/gpu rows.
"""

from __future__ import annotations

from typing import Any

import torch

BUCKET = (9, 64, 64)
INFERENCE_BUCKET = (25, 256, 256)
"""1,792 video tokens: the denoising step's activations are about half the bf16 weights (at BUCKET they would be
lost in them)."""
TEXT_TOKENS = 32
LORA_RANK = 8


def _apply_storage(model: torch.nn.Module, storage: str) -> str:
    """Store `model`'s frozen weights in `storage` (`vidray.models.storage.apply_storage_dtype`, what training
    does); returns how it was applied (for the details)."""
    if storage == "fp32":
        return "fp32 (unchanged)"
    from vidray.models.storage import apply_storage_dtype

    apply_storage_dtype(model, storage, torch.device("cpu"))
    return "vidray.models.storage.apply_storage_dtype"


def _training_rows() -> list[dict[str, Any]]:
    from diffusers import EasyAnimateTransformer3DModel
    from peft import LoraConfig, inject_adapter_in_model

    from vidray.buckets import Bucket
    from vidray.models.presets import get_preset
    from vidray.train.memory import measure_training_step
    from vidray.train.plan import lora_targets, MemoryMode, Strategy, count_model, estimate_memory

    preset = get_preset("medium")
    counts = count_model(preset, lora_rank=LORA_RANK)
    bucket = Bucket(*BUCKET)
    f_lat, h_lat, w_lat = (bucket.num_frames - 1) // 4 + 1, bucket.height // 8, bucket.width // 8
    rows = []
    for storage in ("fp32", "bf16", "fp8"):
        for ac in (False, True):
            torch.manual_seed(0)
            model = EasyAnimateTransformer3DModel(**preset.config)
            model.requires_grad_(False)
            inject_adapter_in_model(LoraConfig(r=LORA_RANK, lora_alpha=LORA_RANK,
                                               target_modules=list(lora_targets("easyanimate"))), model)
            how = _apply_storage(model, storage)
            if ac:
                model.enable_gradient_checkpointing()
            model.train()

            def inputs():
                return dict(hidden_states=torch.randn(1, 16, f_lat, h_lat, w_lat), timestep=torch.rand(1) * 1000,
                            encoder_hidden_states=torch.randn(1, TEXT_TOKENS, 384))

            measured = measure_training_step(model, inputs, autocast_dtype=torch.bfloat16).peak_bytes
            planned = estimate_memory(preset, counts, Strategy("lora", ac, "bf16"), bucket=bucket, batch_size=1,
                                      text_tokens=TEXT_TOKENS, mode=MemoryMode(storage)).peak_bytes
            rows.append({"mode": f"train lora{'+AC' if ac else ''} bf16, {storage} frozen", "applied": how,
                         "measured_bytes": measured, "planned_bytes": planned, "ratio": round(planned / measured, 4)})
    return rows


def _inference_rows() -> list[dict[str, Any]]:
    from diffusers import EasyAnimateTransformer3DModel

    from vidray.buckets import Bucket
    from vidray.models.presets import get_preset
    from vidray.plan_inference import plan_inference
    from vidray.train.memory import TensorBytesTracker

    preset = get_preset("medium")
    bucket = Bucket(*INFERENCE_BUCKET)
    f_lat, h_lat, w_lat = (bucket.num_frames - 1) // 4 + 1, bucket.height // 8, bucket.width // 8
    rows = []
    for storage, dtype in (("fp32", torch.float32), ("bf16", torch.bfloat16)):
        torch.manual_seed(0)
        model = EasyAnimateTransformer3DModel(**preset.config).to(dtype).eval()
        tracker = TensorBytesTracker()
        with tracker, torch.no_grad():
            tracker.track(list(model.parameters()), list(model.buffers()))
            latents = torch.randn(1, 16, f_lat, h_lat, w_lat)
            prompt_embeds = torch.randn(2, TEXT_TOKENS, 384, dtype=dtype)
            tracker.track(latents, prompt_embeds)
            tracker.reset_peak()
            pred = model(hidden_states=torch.cat([latents, latents]).to(dtype), timestep=torch.full((2,), 500.0),
                         encoder_hidden_states=prompt_embeds, return_dict=False)[0]
            uncond, cond = pred.float().chunk(2)
            guided = uncond + 5.0 * (cond - uncond)
            latents = latents - 0.1 * guided
            measured = tracker.peak_bytes
        plan = plan_inference(preset, bucket=bucket, gpu_memory_bytes=2**40, text_tokens=TEXT_TOKENS,
                              storages=(storage,))
        none = next(e for e in plan.estimates if e.offload == "none")
        planned = none.components["transformer"] + none.denoise_bytes
        rows.append({"mode": f"inference none, {storage} storage (transformer + denoising step)",
                     "applied": f"model.to({storage})", "measured_bytes": measured, "planned_bytes": planned,
                     "ratio": round(planned / measured, 4)})
    return rows


def figures() -> dict[str, Any]:
    """{figure name: {value, unit, goal}} of the planner vs measured tensor bytes; prints each mode's row first."""
    rows = _training_rows() + _inference_rows()
    print(f"{'mode':<66}{'measured MiB':>13}{'planned MiB':>12}{'ratio':>7}")
    for r in rows:
        print(f"{r['mode']:<66}{r['measured_bytes'] / 2**20:>13.1f}{r['planned_bytes'] / 2**20:>12.1f}"
              f"{r['ratio']:>7.3f}")
    worst = max(abs(1 - r["ratio"]) for r in rows)
    return {"planner_vs_measured_max_rel_err": {"value": round(worst, 4),
                                                "unit": "max abs(1 - planned/measured) over the CPU modes",
                                                "goal": "<= 0.15"}}
