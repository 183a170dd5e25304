"""THE denoising loop, used by `vidray generate`, evaluation and serving alike.

Euler integration of the rectified-flow ODE d(latents)/d(sigma) = model_pred from sigma = 1 to 0 on
`inference_sigmas` (the same schedule as diffusers' FlowMatchEulerDiscreteScheduler), with classifier-free
guidance as in EasyAnimatePipeline: one batched call on [uncond, cond], then
`model_pred = uncond + guidance_scale * (cond - uncond)`.
"""

from __future__ import annotations

from typing import Callable

import numpy as np
import torch

from vidray.config import FlowConfig
from vidray.data.buckets import Bucket
from vidray.diffusion.flow_matching import euler_step, inference_sigmas, timesteps_from_sigmas
from vidray.models.registry import Components, ModelFamily
from vidray.models.text_encoder import encode_prompts
from vidray.models.vae import decode_latents, video_to_frames

__all__ = ["sample_latents", "generate_video"]


@torch.inference_mode()
def sample_latents(
    family: ModelFamily,
    transformer: torch.nn.Module,
    prompt_embeds: torch.Tensor,
    prompt_attention_mask: torch.Tensor,
    *,
    latent_shape: tuple[int, ...],
    num_inference_steps: int,
    shift: float,
    num_train_timesteps: int,
    guidance_scale: float = 1.0,
    negative_prompt_embeds: torch.Tensor | None = None,
    negative_prompt_attention_mask: torch.Tensor | None = None,
    generator: torch.Generator | None = None,
    callback: Callable[[int, float, torch.Tensor], None] | None = None,
    latents: torch.Tensor | None = None,
) -> torch.Tensor:
    """Denoise pure noise into latents (B, C, F, H, W) (normalized, ready for `decode_latents`).

    prompt_embeds (B, L, D), prompt_attention_mask (B, L); latent_shape (B, C, F_lat, H_lat, W_lat) from
    `family.latent_shape`. The initial noise is `torch.randn(latent_shape, generator=generator)` drawn on the
    generator's device (CPU by default, as diffusers' `randn_tensor` does), unless `latents` gives it.
    guidance_scale > 1 needs negative_prompt_embeds/mask of the same shapes (e.g. the empty prompt).
    `callback(i, sigma, latents)` runs after step i (0-based), sigma being the step's starting noise level.
    The transformer runs in eval mode (its previous mode is restored) under torch.inference_mode.
    """
    # 1. Check inputs
    batch_size = latent_shape[0]
    if prompt_embeds.ndim != 3 or prompt_embeds.shape[0] != batch_size:
        raise ValueError(f"prompt_embeds must be ({batch_size}, L, D) for latent_shape {latent_shape}, "
                         f"got {tuple(prompt_embeds.shape)}")
    do_cfg = guidance_scale > 1.0
    if do_cfg:
        if negative_prompt_embeds is None or negative_prompt_attention_mask is None:
            raise ValueError(
                f"guidance_scale {guidance_scale} > 1 needs negative_prompt_embeds and negative_prompt_attention_mask "
                f"(encode the empty prompt ''), or use guidance_scale=1.0"
            )
        if negative_prompt_embeds.shape != prompt_embeds.shape:
            raise ValueError(f"negative_prompt_embeds {tuple(negative_prompt_embeds.shape)} must match "
                             f"prompt_embeds {tuple(prompt_embeds.shape)}")
    param = next(transformer.parameters())
    device, dtype = param.device, param.dtype

    # 2. Prepare the schedule: (num_inference_steps + 1,) sigmas on the host, 1 -> 0
    sigmas = inference_sigmas(num_inference_steps, shift, num_train_timesteps=num_train_timesteps)
    timesteps = timesteps_from_sigmas(sigmas, num_train_timesteps)

    # 3. Prepare initial noise (sigma = 1)
    if latents is None:
        rng_device = generator.device if generator is not None else torch.device("cpu")
        latents = torch.randn(latent_shape, generator=generator, device=rng_device, dtype=torch.float32)
    elif tuple(latents.shape) != tuple(latent_shape):
        raise ValueError(f"latents {tuple(latents.shape)} must have latent_shape {tuple(latent_shape)}")
    latents = latents.to(device=device, dtype=dtype)

    # 4. Conditioning, batched [uncond, cond] for classifier-free guidance
    if do_cfg:
        prompt_embeds = torch.cat([negative_prompt_embeds, prompt_embeds])
        prompt_attention_mask = torch.cat([negative_prompt_attention_mask, prompt_attention_mask])
    prompt_embeds = prompt_embeds.to(device=device, dtype=dtype)
    prompt_attention_mask = prompt_attention_mask.to(device=device)

    # 5. Denoising loop
    was_training = transformer.training
    transformer.eval()
    try:
        for i in range(num_inference_steps):
            model_input = torch.cat([latents, latents]) if do_cfg else latents
            t = torch.full((model_input.shape[0],), float(timesteps[i]), device=device, dtype=dtype)
            model_pred = family.predict(transformer, model_input, t, prompt_embeds, prompt_attention_mask)
            if do_cfg:
                pred_uncond, pred_cond = model_pred.chunk(2)
                model_pred = pred_uncond + guidance_scale * (pred_cond - pred_uncond)
            latents = euler_step(latents, model_pred, float(sigmas[i]), float(sigmas[i + 1]))
            if callback is not None:
                callback(i, float(sigmas[i]), latents)
    finally:
        transformer.train(was_training)
    return latents


@torch.inference_mode()
def generate_video(
    family: ModelFamily,
    components: Components,
    prompts: list[str],
    bucket: Bucket,
    *,
    flow: FlowConfig,
    num_inference_steps: int = 8,
    guidance_scale: float = 1.0,
    max_sequence_length: int = 32,
    seed: int = 0,
    negative_prompt: str = "",
) -> np.ndarray:
    """prompts (B strings) -> uint8 frames (B, F, H, W, 3) at `bucket` (num_frames, height, width).

    Encode prompts -> `sample_latents` (noise from a CPU generator seeded with `seed`, so the same seed gives
    the same video on any device) -> `decode_latents` -> uint8 frames. With guidance_scale > 1 the
    unconditional branch uses `negative_prompt` (default '').
    """
    # 1. Check inputs and shapes
    if isinstance(prompts, str) or not prompts:
        raise ValueError(f"prompts must be a non-empty list of strings, got {prompts!r}")
    latent_shape = family.latent_shape(bucket, len(prompts))
    device = next(components.transformer.parameters()).device

    # 2. Encode prompts (and the negative prompt for guidance)
    prompt_embeds, prompt_attention_mask = encode_prompts(
        components.text_encoder, components.tokenizer, prompts, max_sequence_length=max_sequence_length, device=device
    )
    negative_prompt_embeds = negative_prompt_attention_mask = None
    if guidance_scale > 1.0:
        negative_prompt_embeds, negative_prompt_attention_mask = encode_prompts(
            components.text_encoder,
            components.tokenizer,
            [negative_prompt] * len(prompts),
            max_sequence_length=max_sequence_length,
            device=device,
        )

    # 3. Denoise
    generator = torch.Generator("cpu").manual_seed(seed)
    latents = sample_latents(
        family,
        components.transformer,
        prompt_embeds,
        prompt_attention_mask,
        latent_shape=latent_shape,
        num_inference_steps=num_inference_steps,
        shift=flow.shift,
        num_train_timesteps=flow.num_train_timesteps,
        guidance_scale=guidance_scale,
        negative_prompt_embeds=negative_prompt_embeds,
        negative_prompt_attention_mask=negative_prompt_attention_mask,
        generator=generator,
    )

    # 4. Decode to uint8 frames
    video = decode_latents(components.vae, latents)  # (B, 3, F, H, W) in [-1, 1]
    return video_to_frames(video)  # (B, F, H, W, 3) uint8
