"""One flow-matching training step's maths: pure torch, no Ray, runs on CPU in unit tests."""

from __future__ import annotations

import math
from typing import Sequence

import torch

from vidray.config import FlowConfig
from vidray.diffusion.flow_matching import (
    add_noise,
    flow_matching_loss,
    sample_sigmas,
    timesteps_from_sigmas,
    velocity_target,
)
from vidray.errors import UserError


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


class NonFiniteTrainingError(UserError):
    """The loss, gradient norm or weights became NaN or Inf at `step` (with learning rate `lr`).

    Deterministic: the same step fails again after a restart, so vidray never lets Ray Train retry it and never
    writes a checkpoint after it (good checkpoints are not rotated away by `checkpoint.num_to_keep`).
    """

    def __init__(self, message: str, step: int | None = None, lr: float | None = None):
        super().__init__(message)
        self.step, self.lr = step, lr

    def __reduce__(self):
        return (type(self), (str(self), self.step, self.lr))


def check_finite_window(
    first_step: int, losses: Sequence[float], grad_norms: Sequence[float], lrs: Sequence[float]
) -> None:
    """Raise NonFiniteTrainingError naming the first step of a window whose loss or gradient norm is NaN/Inf.

    Args:
        first_step: the step of `losses[0]` (1-based).
        losses: per-step losses (mean over ranks), host floats.
        grad_norms: per-step global gradient L2 norms before clipping (0.0 where not measured).
        lrs: per-step learning rates the optimizer used.
    """
    for i, (loss, grad_norm, lr) in enumerate(zip(losses, grad_norms, lrs, strict=True)):
        if not (math.isfinite(loss) and math.isfinite(grad_norm)):
            step = first_step + i
            what = f"loss {loss}" if not math.isfinite(loss) else f"gradient norm {grad_norm}"
            raise NonFiniteTrainingError(
                f"training diverged: {what} at step {step} (lr {lr:.3g}); no checkpoint was written after it. "
                "Lower optim.lr, raise optim.warmup_steps or set train.grad_clip_norm, then resume from the "
                "last checkpoint",
                step, lr,
            )


def non_finite_parameters(module: torch.nn.Module) -> list[str]:
    """Names of parameters holding a NaN or Inf (one host sync for the whole module; call at checkpoint time)."""
    named = list(module.named_parameters())
    if not named:
        return []
    finite = torch.stack([torch.isfinite(p.detach()).all() for _, p in named]).cpu().tolist()
    return [name for (name, _), ok in zip(named, finite, strict=True) if not ok]
