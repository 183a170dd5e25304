"""The training objective and sampler of a model family as one object: `family.objective`.

An `Objective` owns how a noise level becomes the transformer's input and target in training (`noisy_latents`,
`training_target`, `model_timesteps`) and how the sampler walks the levels down (`inference_sigmas`,
`sampler_step`). The training step (`vidray.train.step`), the sampler (`vidray.inference.sampler`), serving's
Denoiser and validation call only these five methods, so they never test which objective a family has.

- `FlowMatching`: rectified flow (EasyAnimate, Wan), the formulas of `vidray.diffusion.flow_matching`.
- `DDIM`: a discrete-time DDPM objective sampled with DDIM steps (`vidray.diffusion.ddim`), epsilon (AnimateDiff)
  or v-prediction (CogVideoX), on one model's schedule: a family whose models differ in schedule (CogVideoX's
  scheduler `snr_shift_scale`) gives each model its own `DDIM`.

A noise level `sigma` in [0, 1] is what the training step draws for every objective; a DDIM objective reads it as
the timestep round(sigma * num_train_timesteps), and its sampler's schedule ends at -1 / num_train_timesteps (the
final alpha). Pure torch; runs on CPU in unit tests.
"""

from __future__ import annotations

import abc
from dataclasses import dataclass
from typing import Literal

import torch

from vidray.diffusion import ddim, flow_matching

__all__ = ["DDIM", "FlowMatching", "Objective"]


class Objective(abc.ABC):
    """What the training step and the sampler ask of a family's objective; tensors only (no model)."""

    name: str
    """`flow_matching`, `epsilon` or `v_prediction`: what the objective trains the transformer to predict."""

    @abc.abstractmethod
    def noisy_latents(self, latents: torch.Tensor, noise: torch.Tensor, sigmas: torch.Tensor) -> torch.Tensor:
        """latents, noise (B, C, F, H, W) and sigmas (B,) in [0, 1] -> the transformer's input (B, C, F, H, W), in
        latents' dtype."""

    @abc.abstractmethod
    def training_target(self, latents: torch.Tensor, noise: torch.Tensor, sigmas: torch.Tensor) -> torch.Tensor:
        """What the family's `predict` is trained to output at noise levels `sigmas` (B,), (B, C, F, H, W)."""

    @abc.abstractmethod
    def model_timesteps(self, sigmas: torch.Tensor, num_train_timesteps: int) -> torch.Tensor:
        """The timesteps (B,) float32 that `predict` gets for noise levels `sigmas` (B,), in training and sampling
        alike."""

    @abc.abstractmethod
    def inference_sigmas(self, num_inference_steps: int, *, shift: float, num_train_timesteps: int) -> torch.Tensor:
        """The sampler's schedule: (num_inference_steps + 1,) float32 noise levels from pure noise to the clean end,
        one `sampler_step` between neighbours (the sampler, serving's Denoiser and validation all take it from
        here). Raises ValueError for num_inference_steps < 1."""

    @abc.abstractmethod
    def sampler_step(self, latents: torch.Tensor, model_pred: torch.Tensor, sigmas: torch.Tensor,
                     sigmas_next: torch.Tensor) -> torch.Tensor:
        """One sampler step of every sample (B, C, F, H, W) from its level `sigmas` (B,) to `sigmas_next` (B,),
        given the model's (guided) prediction: the one step function of `vidray.inference.sampler`."""


class FlowMatching(Objective):
    """Rectified flow (SD3; diffusers' `FlowMatchEulerDiscreteScheduler`): the velocity target and Euler steps on
    shifted sigmas (`vidray.diffusion.flow_matching`). EasyAnimate's and Wan's objective, and every family's
    default."""

    name = "flow_matching"

    def __repr__(self) -> str:
        return "FlowMatching()"

    def noisy_latents(self, latents: torch.Tensor, noise: torch.Tensor, sigmas: torch.Tensor) -> torch.Tensor:
        """(1 - sigma) * latents + sigma * noise (B, C, F, H, W), computed in float32, in latents' dtype
        (`vidray.diffusion.flow_matching.add_noise`)."""
        return flow_matching.add_noise(latents, noise, sigmas)

    def training_target(self, latents: torch.Tensor, noise: torch.Tensor, sigmas: torch.Tensor) -> torch.Tensor:
        """The velocity noise - latents (B, C, F, H, W) (`vidray.diffusion.flow_matching.velocity_target`); sigmas
        are unused."""
        return flow_matching.velocity_target(latents, noise)

    def model_timesteps(self, sigmas: torch.Tensor, num_train_timesteps: int) -> torch.Tensor:
        """sigmas * num_train_timesteps (B,), sigmas' dtype (`vidray.diffusion.flow_matching.timesteps_from_sigmas`)."""
        return flow_matching.timesteps_from_sigmas(sigmas, num_train_timesteps)

    def inference_sigmas(self, num_inference_steps: int, *, shift: float, num_train_timesteps: int) -> torch.Tensor:
        """(num_inference_steps + 1,) float32: shifted sigmas from 1, then 0
        (`vidray.diffusion.flow_matching.inference_sigmas`, as diffusers' `FlowMatchEulerDiscreteScheduler
        .set_timesteps`). Raises ValueError for num_inference_steps < 1 or num_train_timesteps < 1."""
        return flow_matching.inference_sigmas(num_inference_steps, shift, num_train_timesteps=num_train_timesteps)

    def sampler_step(self, latents: torch.Tensor, model_pred: torch.Tensor, sigmas: torch.Tensor,
                     sigmas_next: torch.Tensor) -> torch.Tensor:
        """Euler: latents + (sigmas_next - sigmas) * model_pred (B, C, F, H, W), computed in float32, in latents'
        dtype (`vidray.diffusion.flow_matching.euler_step`)."""
        return flow_matching.euler_step(latents, model_pred, sigmas, sigmas_next)


@dataclass(frozen=True, eq=False)
class DDIM(Objective):
    """DDPM noising with an epsilon or v-prediction target, sampled by deterministic DDIM steps (eta 0) on one
    model's `schedule` (`vidray.diffusion.ddim`, as diffusers' `DDIMScheduler` / `CogVideoXDDIMScheduler`).

    A noise level sigma is the timestep t = round(sigma * N), N = the schedule's num_train_timesteps, at most N - 1
    (training: clamped to 0..N - 1); the sampler's schedule is the scheduler's `set_timesteps` / N for `spacing` and
    `steps_offset`, then -1 / N, the clean end (the final alpha). `flow.shift` plays no part."""

    schedule: ddim.DDIMSchedule
    """The model's noise schedule (`vidray.diffusion.ddim.ddim_schedule` of its scheduler config)."""
    prediction_type: ddim.PredictionType
    """`epsilon` (AnimateDiff) or `v_prediction` (CogVideoX): what the transformer predicts."""
    spacing: Literal["linspace", "leading", "trailing"]
    """The scheduler's `timestep_spacing` (`vidray.diffusion.ddim.inference_timesteps`)."""
    steps_offset: int = 0
    """The scheduler's `steps_offset` (added to "leading" timesteps: AnimateDiff's 1)."""
    owner: str = "this model"
    """Who trains on the schedule, as errors name it (`the cogvideox family`)."""

    @property
    def name(self) -> str:  # type: ignore[override]
        """The prediction type: `epsilon` or `v_prediction`."""
        return self.prediction_type

    def __repr__(self) -> str:
        return (f"DDIM(prediction_type={self.prediction_type!r}, spacing={self.spacing!r}, "
                f"steps_offset={self.steps_offset}, num_train_timesteps={self.schedule.num_train_timesteps})")

    def _check_num_train_timesteps(self, num_train_timesteps: int) -> None:
        expected = self.schedule.num_train_timesteps
        if num_train_timesteps != expected:
            raise ValueError(f"flow.num_train_timesteps is {num_train_timesteps}, but {self.owner}'s DDIM schedule "
                             f"has {expected} timesteps: set flow.num_train_timesteps: {expected}")

    def _timesteps(self, sigmas: torch.Tensor) -> torch.Tensor:
        """Noise levels (B,) -> int64 timesteps round(sigma * N), at most N - 1 (B,); -1 / N -> -1 (the final
        alpha)."""
        n = self.schedule.num_train_timesteps
        return (sigmas.double() * n).round().long().clamp(max=n - 1)

    def _train_timesteps(self, sigmas: torch.Tensor) -> torch.Tensor:
        """Noise levels (B,) in [0, 1] -> the int64 timesteps (B,) in 0..N - 1 a training sample is noised at."""
        return self._timesteps(sigmas).clamp(0, self.schedule.num_train_timesteps - 1)

    def noisy_latents(self, latents: torch.Tensor, noise: torch.Tensor, sigmas: torch.Tensor) -> torch.Tensor:
        """sqrt(a_t) * latents + sqrt(1 - a_t) * noise (B, C, F, H, W), latents' dtype, t = round(sigma * N) in
        0..N - 1 (`vidray.diffusion.ddim.add_noise`, diffusers' `add_noise`)."""
        return ddim.add_noise(latents, noise, self._train_timesteps(sigmas), self.schedule)

    def training_target(self, latents: torch.Tensor, noise: torch.Tensor, sigmas: torch.Tensor) -> torch.Tensor:
        """The noise (epsilon) or the velocity sqrt(a_t) * noise - sqrt(1 - a_t) * latents (v-prediction, diffusers'
        `get_velocity`), (B, C, F, H, W) (`vidray.diffusion.ddim.training_target`)."""
        return ddim.training_target(latents, noise, self._train_timesteps(sigmas), self.schedule,
                                    self.prediction_type)

    def model_timesteps(self, sigmas: torch.Tensor, num_train_timesteps: int) -> torch.Tensor:
        """round(sigma * N) clamped to 0..N - 1, (B,) float32 (the family's `predict` passes them on as int64, as the
        pipeline passes its scheduler's timesteps). Raises ValueError unless num_train_timesteps is N."""
        self._check_num_train_timesteps(num_train_timesteps)
        return self._train_timesteps(sigmas).float()

    def inference_sigmas(self, num_inference_steps: int, *, shift: float, num_train_timesteps: int) -> torch.Tensor:
        """(num_inference_steps + 1,) float32: the scheduler's `set_timesteps` timesteps / N (e.g. 4 trailing steps:
        999, 749, 499, 249; 4 leading with steps_offset 1: 751, 501, 251, 1), then -1 / N (the final alpha).
        `shift` is unused. Raises ValueError unless num_train_timesteps is N, or for num_inference_steps outside
        1..N."""
        self._check_num_train_timesteps(num_train_timesteps)
        n = self.schedule.num_train_timesteps
        steps = ddim.inference_timesteps(num_inference_steps, n, spacing=self.spacing, steps_offset=self.steps_offset)
        return torch.cat([steps, torch.tensor([-1])]).float() / n

    def sampler_step(self, latents: torch.Tensor, model_pred: torch.Tensor, sigmas: torch.Tensor,
                     sigmas_next: torch.Tensor) -> torch.Tensor:
        """One DDIM step (eta 0, no clipping) of latents (B, C, F, H, W) from timestep round(sigma * N) to
        round(sigma_next * N) (-1: the clean end) given `model_pred` of the objective's prediction type
        (`vidray.diffusion.ddim.ddim_step`, as the scheduler's `step`)."""
        return ddim.ddim_step(model_pred, latents, self._timesteps(sigmas), self._timesteps(sigmas_next),
                              self.schedule, self.prediction_type)
