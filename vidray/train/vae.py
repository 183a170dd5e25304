"""`vidray train-vae`: the family's VAE trained on the prepared clips, through the same Ray Train loop, data plane,
checkpoints and resume as the DiT (`vidray.train.loop`), with a reconstruction + KL loss.

EasyAnimate trains its VAE as the first of its three stages (VideoX-Fun's `scripts/vae`: L1 + KL + LPIPS + a
GAN loss); vidray keeps the LPIPS- and GAN-free part, the KL-regularised autoencoder of Rombach et al. 2022
("High-Resolution Image Synthesis with Latent Diffusion Models", sec. 3 and appendix G: reconstruction loss plus a
KL weight of about 1e-6). The run is the job's own config turned into a VAE job (`vae_training_job`): the run folder
`<storage.path>/<name>-vae`, `vae_training`'s length, learning rate and batch, the frames straight from the loader
(no encode stages), and at the end the trained VAE as a diffusers folder in `<run>/vae`, which a DiT job uses with
`model.vae_path`.
"""

from __future__ import annotations

import dataclasses
import math
import tempfile
from pathlib import Path
from typing import Any, Sequence

import torch

from vidray.config import ConfigError, JobConfig, ModelConfig, ParallelConfig, VAETrainingConfig
from vidray.locations import absolute_location, is_uri
from vidray.models.base import ModelFamily
from vidray.models.registry import get_family

VAE_RUN_SUFFIX = "-vae"
"""The VAE run of job `<name>` is `<storage.path>/<name>-vae`."""
VAE_EXPORT_DIR = "vae"
"""The trained VAE's diffusers folder inside the VAE run folder (what `model.vae_path` names)."""

__all__ = ["VAE_EXPORT_DIR", "VAE_RUN_SUFFIX", "VAEObjective", "reconstruction_psnr", "save_vae",
           "vae_export_path", "vae_training_job"]


def vae_training_job(job: JobConfig) -> JobConfig:
    """The VAE run of `job`: name `<name>-vae`, `train.objective: vae`, `vae_training`'s max_steps, lr, warmup and
    batch size in the train / optim / data keys, no latent cache (the loader hands over frames), no validation
    samples, EMA or LoRA, and `model.vae_path` cleared (the VAE that `init` gives is trained).

    Raises ConfigError (one line, naming the key) for what a VAE run does not support: `model.lora`,
    `scaling.strategy` other than ddp, `export.weights: ema`."""
    if job.train.objective == "vae":
        return job  # already a VAE job (a resubmitted or restarted driver)

    family = get_family(job.model.family)
    if not _vae_trains(family, job):
        raise ConfigError(f"train-vae: the {family.name} family's VAE cannot be trained here yet (model.family); "
                          "train-vae supports easyanimate: train an easyanimate job's VAE, or give a trained VAE "
                          "folder in model.vae_path")
    problems = []
    if job.model.lora is not None:
        problems.append("model.lora is set (LoRA adapts the DiT): remove it for train-vae")
    if job.scaling.strategy != "ddp":
        problems.append(f"scaling.strategy is {job.scaling.strategy}: the VAE trains with ddp (it is small)")
    if job.export.weights == "ema":
        problems.append("export.weights is ema: a VAE run keeps no EMA; set it to trained")
    if problems:
        raise ConfigError(f"train-vae: {'; '.join(problems)}")
    vt: VAETrainingConfig = job.vae_training
    train = dataclasses.replace(job.train, objective="vae", max_steps=vt.max_steps, ema=None,
                                validation=dataclasses.replace(job.train.validation, every_steps=None, prompts=[],
                                                                images=[]))
    data = dataclasses.replace(job.data, latent_cache="off",
                               batch_size_per_worker=vt.batch_size_per_worker or job.data.batch_size_per_worker)
    return dataclasses.replace(  # the VAE is small: its clips are never split over a context group
        job, name=f"{job.name}{VAE_RUN_SUFFIX}", model=dataclasses.replace(job.model, vae_path=None), data=data,
        parallel=ParallelConfig(),
        optim=dataclasses.replace(job.optim, lr=vt.lr, warmup_steps=vt.warmup_steps), train=train)


def _vae_trains(family: ModelFamily, job: JobConfig) -> bool:
    """Whether `family` trains its VAE here: its `load_latent_models(trainable=True)` on the meta device (shapes
    only) does not raise NotImplementedError. A folder that does not load is left for the run to name."""
    try:
        family.load_latent_models(job.model, seed=job.train.seed, trainable=True, meta=True)
    except NotImplementedError:
        return False
    except (OSError, ValueError):
        pass
    return True


def vae_export_path(job: JobConfig) -> str:
    """`<storage.path>/<name>-vae/vae` of a DiT or VAE job (absolute; a URI stays one): where `vidray train-vae`
    writes the trained VAE, for `model.vae_path`."""
    name = job.name if job.train.objective == "vae" else f"{job.name}{VAE_RUN_SUFFIX}"
    return f"{absolute_location(job.storage.path).rstrip('/')}/{name}/{VAE_EXPORT_DIR}"


class VAEObjective(torch.nn.Module):
    """The module a VAE run trains and wraps in DDP (so the all-reduce hooks see every parameter): `forward` encodes
    a video, decodes a sample of the posterior and returns the per-sample loss. `self.vae`: the VAE (diffusers
    `AutoencoderKLMagvit` for EasyAnimate: `encode(x).latent_dist` with `mean`, `std`, `logvar`; `decode(z).sample`).
    """

    def __init__(self, vae: torch.nn.Module, config: VAETrainingConfig):
        super().__init__()
        self.vae = vae
        self.l1_weight, self.mse_weight, self.kl_weight = config.l1_weight, config.mse_weight, config.kl_weight

    def forward(self, video: torch.Tensor, generators: Sequence[torch.Generator]) -> torch.Tensor:
        """video (B, 3, F, H, W) float in [-1, 1]; one CPU generator per sample (its posterior noise, drawn per
        sample so a resized run draws the same noise for the same sample) -> (B,) fp32 per-sample losses:
        l1_weight * mean|x_hat - x| + mse_weight * mean (x_hat - x)^2 + kl_weight * KL(q(z|x) || N(0, I)), the KL
        summed over the latent's elements (0.5 * sum(mu^2 + sigma^2 - 1 - log sigma^2))."""
        if len(generators) != video.shape[0]:
            raise ValueError(f"got {len(generators)} generators for a batch of {video.shape[0]} videos")
        posterior = self.vae.encode(video).latent_dist
        mean, std, logvar = posterior.mean, posterior.std, posterior.logvar  # (B, C_lat, F_lat, H_lat, W_lat)
        noise = torch.stack([torch.randn(mean.shape[1:], generator=g, dtype=torch.float32) for g in generators])
        latents = mean + std * noise.to(mean.device, mean.dtype)
        reconstruction = self.vae.decode(latents).sample
        error = reconstruction.float() - video.float()
        per_sample = torch.zeros(video.shape[0], device=video.device)
        if self.l1_weight:
            per_sample = per_sample + self.l1_weight * error.abs().flatten(1).mean(dim=1)
        if self.mse_weight:
            per_sample = per_sample + self.mse_weight * error.pow(2).flatten(1).mean(dim=1)
        if self.kl_weight:
            kl = 0.5 * (mean.float().pow(2) + logvar.float().exp() - 1.0 - logvar.float()).flatten(1).sum(dim=1)
            per_sample = per_sample + self.kl_weight * kl
        return per_sample


def vae_micro_loss(model: torch.nn.Module, frames: torch.Tensor, generators: Sequence[torch.Generator],
                   loss_weights: torch.Tensor) -> torch.Tensor:
    """sum_i w_i * loss_i of a micro-batch (the caller's normalisation, as `flow_matching_step_loss`): `model` the
    (DDP-wrapped) `VAEObjective`, frames uint8 (B, 3, F, H, W) from the loader (`TrainBatch.frames`),
    loss_weights (B,) (0 for the schedule's padding). Returns a scalar fp32 tensor."""
    from vidray.models.vae import uint8_to_video  # heavy: accelerate, safetensors, boto3

    per_sample = model(uint8_to_video(frames), generators)
    return (per_sample * loss_weights.to(per_sample.device, torch.float32)).sum()


def vae_probe_loss(model: torch.nn.Module) -> torch.Tensor:
    """The loss of one fixed 1x16x16 black image through `model` (a `VAEObjective`, maybe DDP-wrapped): what
    `vidray.train.parallel.prime_buckets` and the unused-parameter probe backpropagate."""
    device = next(model.parameters()).device
    video = torch.zeros(1, 3, 1, 16, 16, device=device)
    return model(video, [torch.Generator().manual_seed(0)]).sum()


def unused_parameter_names(objective: VAEObjective) -> list[str]:
    """Trainable parameters of `objective` that the probe's backward leaves without a gradient (DDP's reducer
    needs them frozen), found by one probe step on the plain module; gradients are cleared after it."""
    objective.zero_grad(set_to_none=True)
    vae_probe_loss(objective).backward()
    names = [name for name, p in objective.named_parameters() if p.requires_grad and p.grad is None]
    objective.zero_grad(set_to_none=True)
    return names


def save_vae(vae: torch.nn.Module, out_dir: str) -> str:
    """Write `vae` as a diffusers folder (`config.json` + `diffusion_pytorch_model.safetensors`) at `out_dir`, a
    local folder or a URI (through a temp folder and `vidray.storage.upload_dir`, `config.json` last).
    Returns `out_dir`."""
    from vidray.storage import upload_dir  # heavy: pyarrow

    if not is_uri(out_dir):
        vae.save_pretrained(out_dir, safe_serialization=True)
        return out_dir
    with tempfile.TemporaryDirectory(prefix="vidray-vae-") as tmp:
        vae.save_pretrained(tmp, safe_serialization=True)
        upload_dir(tmp, out_dir, marker="config.json")
    return out_dir


@torch.no_grad()
def reconstruction_psnr(vae: torch.nn.Module, videos: Sequence[Any]) -> float:
    """PSNR in dB, 10 * log10(1 / MSE), of `vae`'s reconstructions (posterior mode, decoded, clamped to [-1, 1])
    of `videos` (each uint8 (F, H, W, 3), encoded one at a time) on the [0, 1] scale, the MSE taken over every
    pixel of every video. Raises ValueError for no videos."""
    from vidray.models.vae import frames_to_video  # heavy: accelerate, safetensors, boto3

    if not len(videos):
        raise ValueError("reconstruction_psnr: no videos")
    squared, count = 0.0, 0
    for frames in videos:
        video = frames_to_video(torch.as_tensor(frames)[None]).to(vae.device, vae.dtype)  # (1, 3, F, H, W)
        reconstruction = vae.decode(vae.encode(video).latent_dist.mode()).sample.float().clamp(-1, 1)
        error = (reconstruction - video.float()) / 2  # on the [0, 1] scale
        squared, count = squared + float(error.pow(2).sum()), count + error.numel()
    mse = squared / count
    return float("inf") if mse == 0 else 10 * math.log10(1.0 / mse)


def training_clips_psnr(vae_dir: str, shards_dir: str, *, family: str, max_clips: int = 16) -> str:
    """One line with the reconstruction PSNR (`reconstruction_psnr`) of the VAE in `vae_dir` (loaded by the model
    `family`, e.g. "easyanimate") on the first `max_clips` training clips of the prepared `shards_dir`, e.g. "VAE
    reconstruction PSNR on 6 training clips: 21.4 dB"."""
    from vidray.data.shards import load_samples  # heavy: pyarrow, av, PIL

    if is_uri(vae_dir):
        return f"VAE reconstruction PSNR: not measured (the VAE is in object storage: {vae_dir})"
    samples = load_samples(shards_dir)[:max_clips]
    vae = get_family(family).load_latent_models(ModelConfig(family=family, vae_path=str(vae_dir)), seed=0).vae
    psnr = reconstruction_psnr(vae, [s.video for s in samples])
    return f"VAE reconstruction PSNR on {len(samples)} training clips: {psnr:.1f} dB"


def check_vae_path(job: JobConfig) -> None:
    """Raise ConfigError (one line) when `model.vae_path` is set but is not a local diffusers VAE folder."""
    if job.model.vae_path and not (Path(job.model.vae_path) / "config.json").is_file():
        raise ConfigError(f"model.vae_path {job.model.vae_path!r} is not a diffusers VAE folder (no config.json): "
                          f"train one with `vidray train-vae CONFIG` (it writes {vae_export_path(job)}) or give the "
                          "vae/ folder of a diffusers pipeline")
