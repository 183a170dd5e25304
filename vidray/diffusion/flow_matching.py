"""Rectified flow (flow matching) maths: the one place where sigmas, noisy_latents and targets are defined.

Training, evaluation and serving all use these functions. Conventions follow SD3 (Esser et al. 2024, "Scaling
Rectified Flow Transformers for High-Resolution Image Synthesis", arXiv:2403.03206, sections 2-3) and diffusers'
`FlowMatchEulerDiscreteScheduler` (diffusers/schedulers/scheduling_flow_match_euler_discrete.py):

    noisy_latents = (1 - sigma) * latents + sigma * noise     sigma in [0, 1], 1 = pure noise
    target        = d(noisy_latents)/d(sigma) = noise - latents     (the velocity the DiT predicts)
    timesteps     = sigmas * num_train_timesteps                    (only at the model call)

Sampling integrates d(latents)/d(sigma) = model_pred from sigma = 1 down to 0 with Euler steps.
Pure torch; runs on CPU in unit tests.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from vidray.config import FlowConfig

__all__ = [
    "shift_sigmas",
    "unshift_sigmas",
    "sample_sigmas",
    "add_noise",
    "velocity_target",
    "flow_matching_loss",
    "inference_sigmas",
    "euler_step",
    "timesteps_from_sigmas",
]


def shift_sigmas(sigmas: torch.Tensor, shift: float) -> torch.Tensor:
    """Time shift `shift*s / (1 + (shift-1)*s)` of sigmas in [0, 1] (any shape, dtype kept).

    shift > 1 spends more steps at high noise (SD3 eq. 23 with alpha = shift; diffusers
    `FlowMatchEulerDiscreteScheduler.set_timesteps` without dynamic shifting). shift = 1 is the identity;
    0 and 1 are fixed points and the map is monotone increasing. Raises ValueError for shift <= 0.
    """
    if shift <= 0:
        raise ValueError(f"shift must be > 0, got {shift}")
    if shift == 1.0:
        return sigmas
    return shift * sigmas / (1 + (shift - 1) * sigmas)


def sample_sigmas(
    batch_size: int,
    flow: FlowConfig,
    *,
    generator: torch.Generator | None = None,
    device: torch.device | str | None = None,
    sigma_range: tuple[float, float] | None = None,
) -> torch.Tensor:
    """Draw training sigmas: (batch_size,) float32 in [0, 1], then `shift_sigmas(., flow.shift)`.

    `uniform`: U(0, 1). `logit_normal`: sigmoid(N(logit_mean, logit_std)) (SD3 section 3.1, "lognorm(m, s)").
    Random numbers are drawn on the generator's device (CPU by default, so a seed gives the same sigmas on any
    accelerator) and then moved to `device`.

    `sigma_range` (lo, hi) with 0 <= lo < hi <= 1: the same distribution conditioned on lo <= sigma <= hi (the
    shifted sigma), drawn exactly by inverse transform sampling from one U(0, 1) number per sample: the quantiles
    of lo and hi under the unshifted draw bound a uniform, mapped back through the draw's inverse CDF (one expert's
    side of a timestep boundary, `vidray.models.experts.expert_sigma_range`; the peers' per-expert runs restrict
    the sampled timesteps the same way, e.g. DiffSynth-Studio's `--min/max_timestep_boundary`). Raises ValueError
    for a range outside [0, 1] or empty.
    """
    if batch_size < 1:
        raise ValueError(f"batch_size must be >= 1, got {batch_size}")
    rng_device = generator.device if generator is not None else torch.device("cpu")
    if sigma_range is not None:
        sigmas = _sample_sigmas_between(batch_size, flow, sigma_range, generator=generator, rng_device=rng_device)
        return sigmas.to(device=device if device is not None else rng_device)
    if flow.sigma_sampling == "uniform":
        sigmas = torch.rand(batch_size, generator=generator, device=rng_device, dtype=torch.float32)
    elif flow.sigma_sampling == "logit_normal":
        u = torch.randn(batch_size, generator=generator, device=rng_device, dtype=torch.float32)
        sigmas = torch.sigmoid(u * flow.logit_std + flow.logit_mean)
    else:
        raise ValueError(f"unknown flow.sigma_sampling {flow.sigma_sampling!r}; valid: uniform, logit_normal")
    return shift_sigmas(sigmas, flow.shift).to(device=device if device is not None else rng_device)


def unshift_sigmas(sigmas: torch.Tensor, shift: float) -> torch.Tensor:
    """The inverse of `shift_sigmas`: `s / (shift - (shift - 1) * s)` for shifted sigmas `s` in [0, 1]. Raises
    ValueError for shift <= 0."""
    if shift <= 0:
        raise ValueError(f"shift must be > 0, got {shift}")
    if shift == 1.0:
        return sigmas
    return sigmas / (shift - (shift - 1) * sigmas)


def _sample_sigmas_between(batch_size: int, flow: FlowConfig, sigma_range: tuple[float, float], *,
                           generator: torch.Generator | None, rng_device: torch.device) -> torch.Tensor:
    """`sample_sigmas` conditioned on lo <= sigma <= hi (its docstring): (batch_size,) float32 on `rng_device`."""
    lo, hi = (float(x) for x in sigma_range)
    if not 0.0 <= lo < hi <= 1.0:
        raise ValueError(f"sigma_range must satisfy 0 <= lo < hi <= 1, got {sigma_range}")
    if flow.sigma_sampling == "uniform":  # U(0, 1): its CDF and inverse CDF are the identity
        def cdf(s: torch.Tensor) -> torch.Tensor:
            return s

        inverse_cdf = cdf
    elif flow.sigma_sampling == "logit_normal":  # sigmoid(N(m, s)): through the normal's CDF and its inverse
        def cdf(s: torch.Tensor) -> torch.Tensor:
            return torch.special.ndtr((torch.logit(s) - flow.logit_mean) / flow.logit_std)

        def inverse_cdf(p: torch.Tensor) -> torch.Tensor:
            return torch.sigmoid(torch.special.ndtri(p) * flow.logit_std + flow.logit_mean)
    else:
        raise ValueError(f"unknown flow.sigma_sampling {flow.sigma_sampling!r}; valid: uniform, logit_normal")
    quantiles = cdf(unshift_sigmas(torch.tensor([lo, hi], dtype=torch.float64), flow.shift))  # before the shift
    v = torch.rand(batch_size, generator=generator, device=rng_device, dtype=torch.float64).cpu()
    raw = inverse_cdf(quantiles[0] + v * (quantiles[1] - quantiles[0]))
    # Rounding may step just outside the range: clamp to it (in float32, the sigmas' dtype).
    sigmas = shift_sigmas(raw, flow.shift).to(torch.float32)
    bounds32 = torch.tensor([lo, hi], dtype=torch.float32)
    return sigmas.clamp(bounds32[0], bounds32[1]).to(rng_device)


def _expand(sigmas: torch.Tensor, like: torch.Tensor) -> torch.Tensor:
    """(B,) or scalar sigmas -> (B, 1, 1, ...) broadcastable against `like` (B, C, F, H, W)."""
    sigmas = torch.as_tensor(sigmas, device=like.device)
    if sigmas.ndim == 0:
        return sigmas
    if sigmas.ndim != 1 or sigmas.shape[0] != like.shape[0]:
        raise ValueError(f"sigmas must be a scalar or have shape ({like.shape[0]},), got {tuple(sigmas.shape)}")
    return sigmas.reshape(-1, *([1] * (like.ndim - 1)))


def add_noise(latents: torch.Tensor, noise: torch.Tensor, sigmas: torch.Tensor) -> torch.Tensor:
    """noisy_latents = (1 - sigmas) * latents + sigmas * noise.

    latents, noise: (B, C, F, H, W); sigmas: (B,) in [0, 1] (or a scalar). Returns latents' dtype.
    Source: SD3 eq. 2-3 (rectified flow, a_t = 1 - t, b_t = t); diffusers `FlowMatchEulerDiscreteScheduler.scale_noise`.
    """
    if latents.shape != noise.shape:
        raise ValueError(f"latents {tuple(latents.shape)} and noise {tuple(noise.shape)} must have the same shape")
    s = _expand(sigmas, latents).to(torch.float32)
    noisy_latents = (1.0 - s) * latents.float() + s * noise.float()
    return noisy_latents.to(latents.dtype)


def velocity_target(latents: torch.Tensor, noise: torch.Tensor) -> torch.Tensor:
    """target = noise - latents (B, C, F, H, W): d(noisy_latents)/d(sigma), the velocity the DiT regresses.

    Source: SD3 section 2 (rectified flow, v = eps - x0); diffusers examples/dreambooth/train_dreambooth_sd3.py.
    """
    return noise - latents


def flow_matching_loss(model_pred: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    """Mean squared error over all elements, computed in float32: scalar tensor (no per-sigma weighting)."""
    if model_pred.shape != target.shape:
        raise ValueError(f"model_pred {tuple(model_pred.shape)} and target {tuple(target.shape)} differ in shape")
    return F.mse_loss(model_pred.float(), target.float(), reduction="mean")


def inference_sigmas(num_inference_steps: int, shift: float, *, num_train_timesteps: int = 1000) -> torch.Tensor:
    """Sampling schedule: (num_inference_steps + 1,) float32 from 1.0 down to 0.0 (the last entry is exactly 0).

    Equal to `FlowMatchEulerDiscreteScheduler(shift=shift, num_train_timesteps=num_train_timesteps)
    .set_timesteps(num_inference_steps).sigmas` (diffusers 0.42, no dynamic shifting): linspace from sigma_max = 1
    to sigma_min = shift_sigmas(1 / num_train_timesteps) in `num_inference_steps` points, shifted (once more),
    then a terminal 0 appended.
    """
    if num_inference_steps < 1:
        raise ValueError(f"num_inference_steps must be >= 1, got {num_inference_steps}")
    if num_train_timesteps < 1:
        raise ValueError(f"num_train_timesteps must be >= 1, got {num_train_timesteps}")
    # The scheduler's training table ends at timestep 1 -> sigma 1/N, shifted in float32 (its __init__).
    sigma_min = float(shift_sigmas(torch.tensor(1.0 / num_train_timesteps, dtype=torch.float32), shift))
    sigmas = torch.linspace(1.0, sigma_min, num_inference_steps, dtype=torch.float64)
    sigmas = shift_sigmas(sigmas, shift).to(torch.float32)
    return torch.cat([sigmas, torch.zeros(1, dtype=torch.float32)])


def euler_step(
    latents: torch.Tensor, model_pred: torch.Tensor, sigma: float | torch.Tensor, sigma_next: float | torch.Tensor
) -> torch.Tensor:
    """One Euler step of d(latents)/d(sigma) = model_pred: latents + (sigma_next - sigma) * model_pred.

    latents, model_pred: (B, C, F, H, W); sigma, sigma_next: floats or (B,) tensors. Computed in float32 and
    returned in latents' dtype, like diffusers `FlowMatchEulerDiscreteScheduler.step`.
    """
    dt = torch.as_tensor(sigma_next, dtype=torch.float32, device=latents.device) - torch.as_tensor(
        sigma, dtype=torch.float32, device=latents.device
    )
    dt = _expand(dt, latents)
    return (latents.float() + dt * model_pred.float()).to(latents.dtype)


def timesteps_from_sigmas(sigmas: torch.Tensor, num_train_timesteps: int) -> torch.Tensor:
    """timesteps = sigmas * num_train_timesteps (same shape, float): the model's timestep input."""
    return sigmas * num_train_timesteps
