"""Diffusion maths (`flow_matching`: sigmas, add_noise, velocity target) and the one denoising loop (`sampler`)."""

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
