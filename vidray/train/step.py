"""One flow-matching training step's maths: pure torch, no Ray, runs on CPU in unit tests."""

from __future__ import annotations

import torch

from vidray.config import FlowConfig
from vidray.diffusion.flow_matching import (
    add_noise,
    flow_matching_loss,
    sample_sigmas,
    timesteps_from_sigmas,
    velocity_target,
)


def step_generator(seed: int, step: int, rank: int) -> torch.Generator:
    """CPU generator for the noise and sigmas of (`step`, `rank`): a pure function of its arguments, so a resumed
    run draws exactly the noise the uninterrupted run would have drawn, with no RNG state to checkpoint."""
    return torch.Generator(device="cpu").manual_seed((seed * 1_000_003 + step) * 1_009 + rank)


def flow_matching_step_loss(
    family,
    transformer: torch.nn.Module,
    latents: torch.Tensor,
    prompt_embeds: torch.Tensor,
    prompt_attention_mask: torch.Tensor,
    flow: FlowConfig,
    generator: torch.Generator,
) -> torch.Tensor:
    """Rectified-flow loss of one batch (Esser et al. 2024, eq. 1-3; formulas in vidray.diffusion.flow_matching).

    Args:
        family: the model family (its `predict` adapts the call to the transformer).
        latents: (B, C_lat, F_lat, H_lat, W_lat) normalized VAE latents.
        prompt_embeds: (B, L, D); prompt_attention_mask: (B, L) bool.
        generator: CPU generator for noise and sigmas (see `step_generator`).
    Returns:
        scalar fp32 loss: mse(model_pred, noise - latents).
    """
    batch_size = latents.shape[0]
    noise = torch.randn(latents.shape, generator=generator, dtype=latents.dtype).to(latents.device)
    sigmas = sample_sigmas(batch_size, flow, generator=generator).to(latents.device)  # (B,)
    noisy_latents = add_noise(latents, noise, sigmas)
    timesteps = timesteps_from_sigmas(sigmas, flow.num_train_timesteps)
    model_pred = family.predict(transformer, noisy_latents, timesteps, prompt_embeds, prompt_attention_mask)
    return flow_matching_loss(model_pred, velocity_target(latents, noise))
