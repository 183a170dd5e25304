"""Diffusion maths (`flow_matching`: sigmas, add_noise, velocity target; `ddim`): pure tensor functions below the
model families, and `objectives` (`FlowMatching`, `DDIM`: a family's `objective`, the one object the training step
and the sampler ask); the denoising loop that steps them is `vidray.inference.sampler`."""

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
from vidray.diffusion.objectives import DDIM, FlowMatching, Objective

__all__ = [
    "DDIM",
    "FlowMatching",
    "Objective",
    "add_noise",
    "euler_step",
    "flow_matching_loss",
    "inference_sigmas",
    "sample_sigmas",
    "shift_sigmas",
    "timesteps_from_sigmas",
    "velocity_target",
]
