"""The inference helper's figure of `benchmarks/memory_modes.py`: the quality cost of fp8 weight storage at
generation, measured on CPU.

`fp8_vs_bf16_generation_psnr_db` (goal >= 25): PSNR (`vidray.compare.video_psnr`: uint8 frames, peak 255) between
the video generated from a bf16-stored and from an fp8-stored copy of one model (float8_e4m3fn storage, bf16 compute,
per layer: `vidray.models.offload.prepare_for_inference`), same prompt, seed and sampler (16 steps, 9x64x64).

What it measures, honestly: a random-init model's video is the initial noise pushed through random layers, so a
PSNR between two of its videos says little about a trained model. The model here is the tiny Wan preset (random
tiny UMT5 text encoder and VAE) whose DiT is first trained briefly: `TRAIN_STEPS` flow-matching steps of AdamW on
one smooth target latent for one prompt (~105 s on 2 idle cores; the loss falls from ~1.5 to ~0.74, so the DiT has
learned part of the target, not all of it). `details.seed_to_seed_psnr_db` (bf16, seed 0 vs seed 1; ~19 dB) is the
scale to read the figure against: a change of seed still moves the frames by ~28 levels RMS (`frames_std` ~40), fp8
storage by ~3.5 (~37 dB). So the figure is the fp8 rounding (about 2^-4 relative per e4m3 weight) through 2 blocks
of a tiny, partly trained DiT, 16 sampler steps and an fp32 VAE: it shows the layerwise casting path costs little
next to what the model determines, not the cost on a 14B model's real videos (more layers, outlier weights), which
needs a real checkpoint and a GPU. `details.random_init_psnr_db` is the same comparison on the untrained DiT.
"""

from __future__ import annotations

import copy
import math
import os
import time
from typing import Any

os.environ.setdefault("HF_HUB_OFFLINE", "1")

GOAL = ">= 25"
EXPECTED = {"fp8_vs_bf16_generation_psnr_db": ("dB", GOAL)}
"""The figures `figures()` returns ({name: (unit, goal)}), for the runner's misses."""
TRAIN_STEPS = 300
BUCKET = (9, 64, 64)
PROMPT = "a red ball rolls across a wooden table"
NUM_INFERENCE_STEPS = 16


def _target_latents(shape: tuple[int, ...]):
    """A smooth, moving pattern in latent space (the 'video' the DiT learns), unit scale."""
    import torch

    _, channels, frames, height, width = shape
    f = torch.arange(frames).view(1, 1, frames, 1, 1).float()
    y = torch.linspace(0, math.pi, height).view(1, 1, 1, height, 1)
    x = torch.linspace(0, math.pi, width).view(1, 1, 1, 1, width)
    c = torch.arange(channels).view(1, channels, 1, 1, 1).float()
    return torch.sin(x * (1 + c % 3) + 0.4 * f) * torch.cos(y * (1 + c % 2) - 0.2 * f + c)


def _train(family, components, flow, steps: int) -> float:
    """Fit the transformer to `_target_latents` for `PROMPT` (flow matching, AdamW); returns the last loss."""
    import torch

    from vidray.buckets import Bucket

    latent_shape = family.latent_shape(Bucket(*BUCKET), 1)
    target = _target_latents(latent_shape)
    embeds, mask = family.encode_prompt(components.text_encoder, components.tokenizer, [PROMPT],
                                        max_sequence_length=16, device="cpu")
    transformer = components.transformer.train()
    optimizer = torch.optim.AdamW(transformer.parameters(), lr=2e-3, weight_decay=0.0)
    generator = torch.Generator().manual_seed(0)
    batch = 4
    loss = torch.tensor(float("nan"))
    for _ in range(steps):
        noise = torch.randn((batch, *latent_shape[1:]), generator=generator)
        sigmas = torch.rand(batch, generator=generator)
        latents = target.expand(batch, *latent_shape[1:])
        noisy = family.objective.noisy_latents(latents, noise, sigmas)
        t = family.objective.model_timesteps(sigmas, flow.num_train_timesteps)
        pred = family.predict(transformer, noisy, t, embeds.expand(batch, -1, -1), mask.expand(batch, -1))
        loss = torch.nn.functional.mse_loss(pred.float(), family.objective.training_target(latents, noise, sigmas))
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        optimizer.step()
    transformer.eval().requires_grad_(False)
    return float(loss.detach())


def _generate(family, components, flow, storage_dtype: str, seed: int):
    import torch

    from vidray.config import MemoryConfig
    from vidray.buckets import Bucket
    from vidray.inference.sampler import generate_video
    from vidray.models.offload import prepare_for_inference

    placed = copy.deepcopy(components)
    prepare_for_inference(placed, MemoryConfig(storage_dtype=storage_dtype), "cpu", family_name=family.name)
    with torch.inference_mode():
        return generate_video(family, placed, [PROMPT], Bucket(*BUCKET), flow=flow,
                              num_inference_steps=NUM_INFERENCE_STEPS, max_sequence_length=16, seed=seed)[0]


def figures() -> dict[str, Any]:
    """{"fp8_vs_bf16_generation_psnr_db": {"value", "unit", "goal", "details"}} (see the module docstring)."""
    import torch

    from vidray.compare import video_psnr
    from vidray.config import FlowConfig, ModelConfig
    from vidray.models import get_family

    torch.manual_seed(0)
    started = time.perf_counter()
    family, flow = get_family("wan"), FlowConfig(shift=3.0)
    components = family.build(ModelConfig(family="wan", text_encoder="tiny_random", max_sequence_length=16), seed=0)
    random_init = video_psnr(_generate(family, components, flow, "bf16", 0),
                             _generate(family, components, flow, "fp8", 0))
    train_started = time.perf_counter()
    final_loss = _train(family, components, flow, TRAIN_STEPS)
    train_s = time.perf_counter() - train_started
    bf16 = _generate(family, components, flow, "bf16", 0)
    fp8 = _generate(family, components, flow, "fp8", 0)
    seed_to_seed = video_psnr(bf16, _generate(family, components, flow, "bf16", 1))
    value = video_psnr(bf16, fp8)
    return {"fp8_vs_bf16_generation_psnr_db": {
        "value": round(value, 2), "unit": "dB", "goal": GOAL,
        "details": {"model": "wan-tiny, DiT trained briefly on one target (module docstring)",
                    "train_steps": TRAIN_STEPS, "final_train_loss": round(final_loss, 4),
                    "train_s": round(train_s, 1), "frames_std": round(float(bf16.std()), 1),
                    "seed_to_seed_psnr_db": round(seed_to_seed, 2), "random_init_psnr_db": round(random_init, 2),
                    "bucket": "x".join(map(str, BUCKET)), "num_inference_steps": NUM_INFERENCE_STEPS,
                    "seconds": round(time.perf_counter() - started, 1)}}}


if __name__ == "__main__":
    import json

    print(json.dumps(figures()))
