"""VAE encode/decode with the latent normalization, and uint8 frames <-> float video conversions.

One normalization, latents = (posterior_mean - shift) * scale, decoded as `vae.decode(latents / scale + shift)`:
- scalar (EasyAnimate): scale = `vae.config.scaling_factor`, shift = `shift_factor` (0 when absent), as
  `EasyAnimatePipeline` decodes `vae.decode(latents / vae.config.scaling_factor)`
  (diffusers/pipelines/easyanimate/pipeline_easyanimate.py);
- per channel (Wan, a VAE config with `latents_mean` and `latents_std`, one value per latent channel):
  shift = latents_mean, scale = 1 / latents_std, shaped (1, C, 1, 1, 1), exactly as `WanPipeline` decodes
  `latents / (1 / latents_std) + latents_mean` (diffusers/pipelines/wan/pipeline_wan.py, step "decode") and
  `WanImageToVideoPipeline.prepare_latents` encodes `(mode - latents_mean) * (1 / latents_std)`.

We encode to the posterior MEAN (the mode), not a sample: latents are deterministic, so cached latents are
reproducible and re-encoding a clip gives the same bits; the posterior std of video VAEs is small, so the
sampling noise it would add is negligible next to the flow-matching noise.
"""

from __future__ import annotations

import numpy as np
import torch

from vidray.models.offload import compute_dtype, execution_device

__all__ = ["encode_video", "decode_latents", "frames_to_video", "uint8_to_video", "video_to_frames"]


def _scale_and_shift(vae, device, dtype) -> tuple[float | torch.Tensor, float | torch.Tensor]:
    """(scale, shift) of the normalization (see the module docstring): Python floats, or (1, C, 1, 1, 1) tensors on
    `device` in `dtype` when the VAE config has `latents_mean` and `latents_std` (Wan)."""
    config = vae.config
    mean, std = getattr(config, "latents_mean", None), getattr(config, "latents_std", None)
    if mean is not None and std is not None:
        shape = (1, len(mean), 1, 1, 1)
        scale = 1.0 / torch.tensor(std).view(shape)  # WanPipeline's `latents_std`, computed the same way
        return scale.to(device, dtype), torch.tensor(mean).view(shape).to(device, dtype)
    scaling_factor = float(getattr(config, "scaling_factor", 1.0) or 1.0)
    shift_factor = float(getattr(config, "shift_factor", 0.0) or 0.0)
    return scaling_factor, shift_factor


@torch.no_grad()
def encode_video(vae, video: torch.Tensor) -> torch.Tensor:
    """video (B, 3, F, H, W) float in [-1, 1] -> latents (B, C_lat, F_lat, H_lat, W_lat) float32, normalized.

    For AutoencoderKLMagvit (EasyAnimate) and AutoencoderKLWan: F_lat = (F - 1) // 4 + 1, H_lat = H // 8,
    W_lat = W // 8; latents = (posterior.mode() - shift) * scale (module docstring). Runs on the VAE's device and
    dtype; not differentiable.
    """
    if video.ndim != 5 or video.shape[1] != 3:
        raise ValueError(f"video must be (B, 3, F, H, W), got {tuple(video.shape)}")
    posterior = vae.encode(video.to(device=execution_device(vae), dtype=compute_dtype(vae))).latent_dist
    mode = posterior.mode()
    scale, shift = _scale_and_shift(vae, mode.device, mode.dtype)
    return ((mode - shift) * scale).float()


@torch.no_grad()
def decode_latents(vae, latents: torch.Tensor) -> torch.Tensor:
    """latents (B, C_lat, F_lat, H_lat, W_lat) normalized -> video (B, 3, F, H, W) float32 clamped to [-1, 1].

    Inverse normalization of `encode_video`: `vae.decode(latents / scale + shift)`, as in EasyAnimatePipeline's and
    WanPipeline's step "decode". Not differentiable.
    """
    if latents.ndim != 5:
        raise ValueError(f"latents must be (B, C, F, H, W), got {tuple(latents.shape)}")
    device, dtype = execution_device(vae), compute_dtype(vae)
    scale, shift = _scale_and_shift(vae, device, dtype)
    latents = latents.to(device=device, dtype=dtype) / scale + shift
    video = vae.decode(latents, return_dict=False)[0]
    return video.float().clamp(-1.0, 1.0)


def uint8_to_video(video: torch.Tensor) -> torch.Tensor:
    """uint8 video (B, 3, F, H, W) (channels first, as `vidray.data.pipeline.TrainBatch.frames`) -> float32 in
    [-1, 1] (x / 127.5 - 1), the VAE's input range. Raises ValueError for another dtype or shape."""
    if video.dtype != torch.uint8 or video.ndim != 5 or video.shape[1] != 3:
        raise ValueError(f"video must be uint8 (B, 3, F, H, W), got {video.dtype} {tuple(video.shape)}")
    return video.float().div(127.5).sub(1.0)


def frames_to_video(frames: np.ndarray | torch.Tensor) -> torch.Tensor:
    """uint8 frames (B, F, H, W, 3) -> video (B, 3, F, H, W) float32 in [-1, 1] (`uint8_to_video`)."""
    frames = torch.as_tensor(frames)
    if frames.dtype != torch.uint8 or frames.ndim != 5 or frames.shape[-1] != 3:
        raise ValueError(f"frames must be uint8 (B, F, H, W, 3), got {frames.dtype} {tuple(frames.shape)}")
    return uint8_to_video(frames.permute(0, 4, 1, 2, 3))  # (B, F, H, W, 3) -> (B, 3, F, H, W)


def video_to_frames(video: torch.Tensor) -> np.ndarray:
    """video (B, 3, F, H, W) float in [-1, 1] -> uint8 frames (B, F, H, W, 3) as a numpy array.

    round(clamp(x / 2 + 0.5, 0, 1) * 255), like diffusers `VaeImageProcessor.postprocess` + `numpy_to_pil`.
    """
    if video.ndim != 5 or video.shape[1] != 3:
        raise ValueError(f"video must be (B, 3, F, H, W), got {tuple(video.shape)}")
    frames = (video.detach().float() / 2 + 0.5).clamp(0, 1).mul(255).round().to(torch.uint8)
    return frames.permute(0, 2, 3, 4, 1).cpu().numpy()  # (B, 3, F, H, W) -> (B, F, H, W, 3)
