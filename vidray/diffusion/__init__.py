"""Diffusion maths (`flow_matching`: sigmas, add_noise, velocity target; `ddim`): pure tensor functions below the
model families; the denoising loop that steps them is `vidray.inference.sampler`."""

from vidray.diffusion.flow_matching import (
    add_noise,
    euler_step,
    flow_matching_loss,
    inference_sigmas,
    sample_sigmas,
    shift_sigmas,
    timesteps_from_sigmas,
    velocity_target,
)

__all__ = [
    "add_noise",
    "euler_step",
    "flow_matching_loss",
    "inference_sigmas",
    "sample_sigmas",
    "shift_sigmas",
    "timesteps_from_sigmas",
    "velocity_target",
]
