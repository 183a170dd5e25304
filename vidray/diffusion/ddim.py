"""Discrete-time diffusion (DDPM noise, DDIM sampling): the maths of the epsilon and v-prediction objectives.

The families trained this way (AnimateDiff: epsilon; CogVideoX: v-prediction) define their training targets and
sampler steps here, as `vidray.diffusion.flow_matching` does for rectified flow. Conventions follow diffusers'
`DDIMScheduler` (diffusers/schedulers/scheduling_ddim.py) and `CogVideoXDDIMScheduler`
(scheduling_ddim_cogvideox.py), which `tests/unit/test_ddim.py` checks these functions against:

    alphas_cumprod[t] = prod_{s <= t} (1 - betas[s])            t in 0 .. num_train_timesteps - 1
    noisy_latents     = sqrt(a_t) * latents + sqrt(1 - a_t) * noise         (DDPM, Ho et al. 2020, eq. 4)
    epsilon target    = noise
    v target          = sqrt(a_t) * noise - sqrt(1 - a_t) * latents         (Salimans & Ho 2022, section 4)
    DDIM step (eta 0) = sqrt(a_prev) * x0 + sqrt(1 - a_prev) * eps          (Song et al. 2021, eq. 12)

with `a_t = alphas_cumprod[t]`, `x0` and `eps` the clean latents and noise implied by the model's prediction.
Every function takes per-sample timesteps (B,), so one batch may hold samples at different steps of their
schedules (serving's step-level batching). Pure torch; runs on CPU in unit tests.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

import numpy as np
import torch

__all__ = ["DDIMSchedule", "ddim_schedule", "inference_timesteps", "add_noise", "training_target",
           "predicted_original", "ddim_step"]

PredictionType = Literal["epsilon", "v_prediction"]
BetaSchedule = Literal["linear", "scaled_linear"]


@dataclass(frozen=True)
class DDIMSchedule:
    """The noise schedule of a discrete-time diffusion model."""

    alphas_cumprod: torch.Tensor
    """(num_train_timesteps,) float64: a_t, the signal's share of the variance at timestep t."""
    final_alpha_cumprod: float
    """a_prev of the last sampling step (`set_alpha_to_one`: 1.0, a clean sample; else a_0)."""

    @property
    def num_train_timesteps(self) -> int:
        return int(self.alphas_cumprod.shape[0])


def ddim_schedule(num_train_timesteps: int = 1000, *, beta_start: float = 0.00085, beta_end: float = 0.012,
                  beta_schedule: BetaSchedule = "scaled_linear", snr_shift_scale: float | None = None,
                  rescale_betas_zero_snr: bool = False, set_alpha_to_one: bool = True) -> DDIMSchedule:
    """The schedule of a scheduler config (the keys of diffusers' `DDIMScheduler` / `CogVideoXDDIMScheduler`).

    beta_schedule: "linear" (betas linear in [beta_start, beta_end]) or "scaled_linear" (their square roots linear:
    the latent-diffusion schedule). snr_shift_scale: CogVideoX's SNR shift `a / (s + (1 - s) * a)` (None: none,
    as `DDIMScheduler`). rescale_betas_zero_snr: zero terminal SNR (Lin et al. 2024, "Common Diffusion Noise
    Schedules and Sample Steps are Flawed", algorithm 1). Raises ValueError for another beta_schedule or a
    non-positive count.
    """
    if num_train_timesteps <= 0:
        raise ValueError(f"num_train_timesteps must be > 0, got {num_train_timesteps}")
    if beta_schedule == "linear":
        betas = torch.linspace(beta_start, beta_end, num_train_timesteps, dtype=torch.float64)
    elif beta_schedule == "scaled_linear":
        betas = torch.linspace(beta_start ** 0.5, beta_end ** 0.5, num_train_timesteps, dtype=torch.float64) ** 2
    else:
        raise ValueError(f"beta_schedule must be 'linear' or 'scaled_linear', got {beta_schedule!r}")
    alphas_cumprod = torch.cumprod(1.0 - betas, dim=0)
    if snr_shift_scale is not None:
        alphas_cumprod = alphas_cumprod / (snr_shift_scale + (1 - snr_shift_scale) * alphas_cumprod)
    if rescale_betas_zero_snr:
        root = alphas_cumprod.sqrt()
        first, last = root[0].clone(), root[-1].clone()
        alphas_cumprod = ((root - last) * first / (first - last)) ** 2
    final = 1.0 if set_alpha_to_one else float(alphas_cumprod[0])
    return DDIMSchedule(alphas_cumprod=alphas_cumprod, final_alpha_cumprod=final)


def inference_timesteps(num_inference_steps: int, num_train_timesteps: int = 1000, *,
                        spacing: Literal["linspace", "leading", "trailing"] = "leading",
                        steps_offset: int = 0) -> torch.Tensor:
    """The timesteps (num_inference_steps,) int64, high to low, of diffusers' `set_timesteps` for `spacing`
    ("linspace", "leading", "trailing"; `steps_offset` is added to "leading"). Raises ValueError for more steps
    than train timesteps, or another spacing."""
    if not 0 < num_inference_steps <= num_train_timesteps:
        raise ValueError(f"num_inference_steps must be in 1..{num_train_timesteps}, got {num_inference_steps}")
    if spacing == "linspace":
        steps = np.linspace(0, num_train_timesteps - 1, num_inference_steps).round()[::-1]
    elif spacing == "leading":
        steps = np.arange(num_inference_steps)[::-1] * (num_train_timesteps // num_inference_steps) + steps_offset
    elif spacing == "trailing":
        steps = np.round(np.arange(num_train_timesteps, 0, -num_train_timesteps / num_inference_steps)) - 1
    else:
        raise ValueError(f"spacing must be 'linspace', 'leading' or 'trailing', got {spacing!r}")
    return torch.from_numpy(steps.copy().astype(np.int64))


def _alpha(schedule: DDIMSchedule, timesteps: torch.Tensor, like: torch.Tensor) -> torch.Tensor:
    """a_t per sample (B,) broadcast to `like` (B, ...), in its dtype; a negative t is the final alpha."""
    t = timesteps.to(torch.int64).cpu()
    alphas = torch.where(t >= 0, schedule.alphas_cumprod[t.clamp(min=0)],
                         torch.tensor(schedule.final_alpha_cumprod, dtype=torch.float64))
    return alphas.to(device=like.device, dtype=like.dtype).reshape(-1, *([1] * (like.ndim - 1)))


def add_noise(latents: torch.Tensor, noise: torch.Tensor, timesteps: torch.Tensor,
              schedule: DDIMSchedule) -> torch.Tensor:
    """latents, noise (B, ...) and timesteps (B,) ints -> sqrt(a_t) * latents + sqrt(1 - a_t) * noise."""
    alpha = _alpha(schedule, timesteps, latents)
    return alpha.sqrt() * latents + (1 - alpha).sqrt() * noise


def training_target(latents: torch.Tensor, noise: torch.Tensor, timesteps: torch.Tensor, schedule: DDIMSchedule,
                    prediction_type: PredictionType) -> torch.Tensor:
    """What the model learns to predict at `timesteps` (B,): the noise ("epsilon"), or the velocity
    sqrt(a_t) * noise - sqrt(1 - a_t) * latents ("v_prediction", diffusers' `get_velocity`). Raises ValueError for
    another prediction_type."""
    if prediction_type == "epsilon":
        return noise
    if prediction_type == "v_prediction":
        alpha = _alpha(schedule, timesteps, latents)
        return alpha.sqrt() * noise - (1 - alpha).sqrt() * latents
    raise ValueError(f"prediction_type must be 'epsilon' or 'v_prediction', got {prediction_type!r}")


def predicted_original(model_pred: torch.Tensor, sample: torch.Tensor, timesteps: torch.Tensor,
                       schedule: DDIMSchedule, prediction_type: PredictionType) -> tuple[torch.Tensor, torch.Tensor]:
    """(x0, eps): the clean latents and the noise that `model_pred` implies for `sample` (B, ...) at `timesteps`."""
    alpha = _alpha(schedule, timesteps, sample)
    if prediction_type == "epsilon":
        eps = model_pred
        x0 = (sample - (1 - alpha).sqrt() * eps) / alpha.sqrt()
    elif prediction_type == "v_prediction":
        x0 = alpha.sqrt() * sample - (1 - alpha).sqrt() * model_pred
        eps = alpha.sqrt() * model_pred + (1 - alpha).sqrt() * sample
    else:
        raise ValueError(f"prediction_type must be 'epsilon' or 'v_prediction', got {prediction_type!r}")
    return x0, eps


def ddim_step(model_pred: torch.Tensor, sample: torch.Tensor, timesteps: torch.Tensor,
              prev_timesteps: torch.Tensor, schedule: DDIMSchedule,
              prediction_type: PredictionType) -> torch.Tensor:
    """One deterministic DDIM step (eta 0, no clipping) of `sample` (B, ...) from `timesteps` to `prev_timesteps`
    (B,) ints, a negative one meaning the end (the final alpha): sqrt(a_prev) * x0 + sqrt(1 - a_prev) * eps, as
    diffusers' `DDIMScheduler.step(eta=0)` with `clip_sample=False` and `CogVideoXDDIMScheduler.step` compute it."""
    x0, eps = predicted_original(model_pred, sample, timesteps, schedule, prediction_type)
    alpha_prev = _alpha(schedule, prev_timesteps, sample)
    return alpha_prev.sqrt() * x0 + (1 - alpha_prev).sqrt() * eps

