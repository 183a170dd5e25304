"""AnimateDiff text-to-video family: diffusers `UNetMotionModel` (a Stable Diffusion `UNet2DConditionModel` with
AnimateDiff's motion modules inserted) + an SD `AutoencoderKL` applied frame by frame + a CLIP text encoder, trained
with the epsilon objective on AnimateDiff's DDIM schedule and exported as a stock `diffusers.AnimateDiffPipeline`.

Only the motion modules train (`UNetMotionModel.freeze_unet2d_params`: every image-UNet parameter has requires_grad
False), as AnimateDiff's motion adapters are trained (guoyww/AnimateDiff `train.py`, `trainable_modules:
["motion_modules."]`). The optimizer, EMA and DDP see only the parameters with requires_grad; checkpoints and the
export hold the whole UNet.

Everything here mirrors diffusers/pipelines/animatediff/pipeline_animatediff.py (diffusers 0.42.1), so a UNet
trained with `AnimateDiffFamily.predict` behaves the same inside the stock pipeline:
- prompts (`encode_prompts`, as `AnimateDiffPipeline.encode_prompt`, copied from StableDiffusionPipeline's): padded
  to the tokenizer's `model_max_length` (`padding="max_length"`, truncation, special tokens), then
  `text_encoder(input_ids, attention_mask=None)[0]` (CLIP's config has no `use_attention_mask`): padding positions are
  encoded and attended to. vidray pads to `model.max_sequence_length`, and `build` sets the tokenizer's
  `model_max_length` to it, so the exported tokenizer makes the stock pipeline pad the same way;
- the UNet call: `unet(latents, t, encoder_hidden_states=prompt_embeds.repeat_interleave(num_frames, dim=0))`,
  latents laid out (B, C, F, H, W) (the pipeline repeats the prompt once per frame before the call; the UNet folds
  frames into the batch itself);
- latents: per frame, `posterior mode * vae.config.scaling_factor`, laid out (B, 4, F, H/8, W/8); decoded per frame as
  the pipeline's `decode_latents` (`vae.decode(1 / scaling_factor * latents)` on (B*F, 4, h, w));
- objective and sampler: epsilon on AnimateDiff's `DDIMScheduler` (linear betas 0.00085..0.012, steps_offset 1,
  clip_sample False: guoyww/AnimateDiff configs/inference `noise_scheduler_kwargs`; "leading" timesteps, diffusers'
  default), and the export carries that scheduler. A noise level sigma in [0, 1] is the timestep sigma * 1000
  (rounded); the sampler's schedule ends at -1 / 1000 (the final alpha, 1.0).

The export holds the `UNetMotionModel` as `unet` and no `motion_adapter` (what `AnimateDiffPipeline.save_pretrained`
itself writes: its `__init__` turns a UNet2DConditionModel + MotionAdapter into one UNetMotionModel). A pretrained
folder may hold either layout: a `UNetMotionModel`, or a `UNet2DConditionModel` plus a `motion_adapter/` folder
(combined with `UNetMotionModel.from_unet2d`, as the pipeline does).
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any, Literal

import torch
from diffusers import (AnimateDiffPipeline, AutoencoderKL, DDIMScheduler, MotionAdapter, UNet2DConditionModel,
                       UNetMotionModel)

from vidray.cards import get_card
from vidray.models.offload import compute_dtype, execution_device
from vidray.models.storage import input_dtype
from vidray.config import FlowConfig, ModelConfig
from vidray.buckets import Bucket, validate_bucket
from vidray.diffusion import ddim
from vidray.diffusion.objectives import DDIM
from vidray.models.base import (Components, ConditionModels, DiffusionModels, LatentModels, ModelFamily,
                                on_meta)
from vidray.models.experts import pick_expert
from vidray.models.folders import (meta_component, meta_module, pretrained_folder, require_pipeline_folder,
                                   unused_parameter_names, unwrapped,
                                   write_pipeline_folder)
from vidray.models.text_encoder import build_clip_text_encoder, text_hidden_size

__all__ = [
    "SCHEDULER_CONFIG",
    "TINY_UNET",
    "TINY_VAE",
    "AnimateDiffFamily",
    "build_tiny",
    "decode_latents",
    "encode_prompts",
    "encode_video",
    "load_vae_folder",
    "probe_loss",
    "save_pipeline",
]

LATENT_CHANNELS = 4
"""Stable Diffusion's AutoencoderKL `latent_channels`: the UNet's in_channels."""
SPATIAL_COMPRESSION_RATIO = 8
"""2 ** (len(block_out_channels) - 1) with 4 VAE blocks: the pipeline's `vae_scale_factor`."""
TEMPORAL_COMPRESSION_RATIO = get_card("animatediff").bucket_rules.temporal_compression
"""1: the SD VAE encodes every frame alone, so one latent frame per frame and any num_frames."""
PIPELINE_COMPONENTS = ("unet", "vae", "text_encoder", "tokenizer", "scheduler")
"""The subfolders of an AnimateDiff diffusers folder that vidray loads (plus `motion_adapter/` beside a
UNet2DConditionModel)."""
NUM_TRAIN_TIMESTEPS = 1000

SCHEDULER_CONFIG = dict(
    num_train_timesteps=NUM_TRAIN_TIMESTEPS,
    beta_start=0.00085,
    beta_end=0.012,
    beta_schedule="linear",
    steps_offset=1,
    clip_sample=False,
    set_alpha_to_one=True,
    timestep_spacing="leading",
    prediction_type="epsilon",
)
"""AnimateDiff's `DDIMScheduler` (guoyww/AnimateDiff configs/inference/inference-v*.yaml `noise_scheduler_kwargs`:
linear betas 0.00085..0.012, steps_offset 1, clip_sample False; the rest diffusers' defaults; its training uses the
same betas with DDPM): what the family trains and samples with, and what its export carries. "leading" timesteps
(t_i = i * 1000 // N + 1) make `DDIMScheduler.step`'s prev_timestep = t - 1000 // N the next timestep for every N,
so vidray's sampler (which steps between neighbours of `inference_sigmas`) takes the stock pipeline's steps exactly;
"linspace" spacing would not."""
SCHEDULE = ddim.ddim_schedule(
    NUM_TRAIN_TIMESTEPS, beta_start=SCHEDULER_CONFIG["beta_start"], beta_end=SCHEDULER_CONFIG["beta_end"],
    beta_schedule=SCHEDULER_CONFIG["beta_schedule"], set_alpha_to_one=SCHEDULER_CONFIG["set_alpha_to_one"])
"""`SCHEDULER_CONFIG` as `vidray.diffusion.ddim` computes it (checked against DDIMScheduler in tests)."""
OBJECTIVE = DDIM(SCHEDULE, "epsilon", spacing="leading", steps_offset=SCHEDULER_CONFIG["steps_offset"],
                 owner="the animatediff family")
"""The family's objective: epsilon on `SCHEDULE`, DDIM steps on its "leading" timesteps with steps_offset 1 (4 steps:
751, 501, 251, 1; `vidray.diffusion.objectives.DDIM`, as `DDIMScheduler` with clip_sample False)."""
_SCHEDULE_KEYS = ("num_train_timesteps", "beta_start", "beta_end", "beta_schedule", "prediction_type")
"""Scheduler config keys a pretrained folder must share with `SCHEDULER_CONFIG` (they define the objective)."""

TINY_UNET = dict(
    sample_size=8,
    in_channels=LATENT_CHANNELS,
    out_channels=LATENT_CHANNELS,
    down_block_types=("CrossAttnDownBlockMotion", "DownBlockMotion"),
    up_block_types=("UpBlockMotion", "CrossAttnUpBlockMotion"),
    block_out_channels=(16, 32),
    layers_per_block=1,
    norm_num_groups=8,
    num_attention_heads=2,
    motion_num_attention_heads=2,
    motion_max_seq_length=32,  # frames the motion modules' positional embeddings cover (AnimateDiff v1.5: 32)
    use_motion_mid_block=True,
)
"""Tiny UNetMotionModel (2 blocks, 1 downsampler; ~0.2 M params of which the motion modules are about half).
`cross_attention_dim` is set from the text encoder's hidden size."""

TINY_VAE = dict(
    in_channels=3,
    out_channels=3,
    down_block_types=("DownEncoderBlock2D",) * 4,  # 4 blocks: 8x spatial, as SD's
    up_block_types=("UpDecoderBlock2D",) * 4,
    block_out_channels=(8, 8, 8, 8),
    latent_channels=LATENT_CHANNELS,
    layers_per_block=1,
    norm_num_groups=2,
    sample_size=64,
    scaling_factor=0.18215,  # SD 1.5's VAE
)
"""Tiny AutoencoderKL, same compression and latent channels as SD 1.5's."""

TextEncoderKind = Literal["minilm", "tiny_random"]


def _text_width(kind: TextEncoderKind) -> int:
    """D of `build_clip_text_encoder(kind)`'s prompt_embeds: the UNet's cross_attention_dim."""
    return text_hidden_size(kind)


@torch.no_grad()
def encode_prompts(text_encoder: torch.nn.Module, tokenizer: Any, prompts: list[str], *, max_sequence_length: int,
                   device: torch.device | str | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """B prompts -> prompt_embeds (B, L, D) float32 and prompt_attention_mask (B, L) bool, L = max_sequence_length,
    on `device` (default: the text encoder's).

    As `AnimateDiffPipeline.encode_prompt` (StableDiffusionPipeline's, diffusers/pipelines/animatediff/
    pipeline_animatediff.py) with `clip_skip` None: tokenize with padding to `max_sequence_length` (the stock
    pipeline pads to `tokenizer.model_max_length`: `build` makes them equal), truncation and special tokens, then
    `text_encoder(input_ids, attention_mask=None)[0]`: padding positions stay in the embeddings and the UNet
    attends to them. The mask is the tokenizer's (for the text stage's bookkeeping); the UNet never sees it.
    """
    if isinstance(prompts, str) or not prompts:
        raise ValueError(f"prompts must be a non-empty list of strings, got {prompts!r}")
    if max_sequence_length < 1:
        raise ValueError(f"max_sequence_length must be >= 1, got {max_sequence_length}")
    text_inputs = tokenizer(list(prompts), padding="max_length", max_length=max_sequence_length, truncation=True,
                            return_attention_mask=True, return_tensors="pt")
    te_device = execution_device(text_encoder)
    prompt_embeds = text_encoder(text_inputs.input_ids.to(te_device), attention_mask=None)[0]  # (B, L, D)
    device = device if device is not None else te_device
    return (prompt_embeds.to(device=device, dtype=torch.float32),
            text_inputs.attention_mask.to(device=device).bool())


@torch.no_grad()
def encode_video(vae: AutoencoderKL, video: torch.Tensor) -> torch.Tensor:
    """video (B, 3, F, H, W) float in [-1, 1] -> latents (B, 4, F, H/8, W/8) float32: every frame encoded alone by
    the image VAE, posterior mode * `vae.config.scaling_factor` (what AnimateDiff's training encodes, with the mode
    instead of a sample: vidray's latents are deterministic, `vidray.models.vae`)."""
    if video.ndim != 5 or video.shape[1] != 3:
        raise ValueError(f"video must be (B, 3, F, H, W), got {tuple(video.shape)}")
    batch_size, _, num_frames, height, width = video.shape
    frames = video.permute(0, 2, 1, 3, 4).reshape(batch_size * num_frames, 3, height, width)  # (B*F, 3, H, W)
    frames = frames.to(device=execution_device(vae), dtype=compute_dtype(vae))
    mode = vae.encode(frames).latent_dist.mode()  # (B*F, 4, h, w)
    latents = mode * vae.config.scaling_factor
    latents = latents.reshape(batch_size, num_frames, *latents.shape[1:]).permute(0, 2, 1, 3, 4)  # (B, 4, F, h, w)
    return latents.float().contiguous()


@torch.no_grad()
def decode_latents(vae: AutoencoderKL, latents: torch.Tensor, decode_chunk_size: int = 16) -> torch.Tensor:
    """latents (B, 4, F, h, w) as `encode_video` gives them -> video (B, 3, F, 8h, 8w) float32 clamped to [-1, 1].

    Exactly `AnimateDiffPipeline.decode_latents`: `1 / scaling_factor * latents`, frames folded into the batch,
    decoded `decode_chunk_size` frames at a time, unfolded."""
    if latents.ndim != 5:
        raise ValueError(f"latents must be (B, C, F, H, W), got {tuple(latents.shape)}")
    latents = 1 / vae.config.scaling_factor * latents.to(device=execution_device(vae), dtype=compute_dtype(vae))
    batch_size, channels, num_frames, height, width = latents.shape
    latents = latents.permute(0, 2, 1, 3, 4).reshape(batch_size * num_frames, channels, height, width)
    video = torch.cat([vae.decode(latents[i:i + decode_chunk_size]).sample
                       for i in range(0, latents.shape[0], decode_chunk_size)])  # (B*F, 3, H, W)
    video = video.reshape(batch_size, num_frames, *video.shape[1:]).permute(0, 2, 1, 3, 4)  # (B, 3, F, H, W)
    return video.float().clamp(-1.0, 1.0)


def _check_vae(vae_config: Any, where: str) -> None:
    """Raise ValueError unless a VAE config (`AutoencoderKL.config` or its config.json as a dict) is SD's layout."""
    get = vae_config.get
    found = (get("latent_channels"), 2 ** (len(get("block_out_channels") or ()) - 1))
    expected = (LATENT_CHANNELS, SPATIAL_COMPRESSION_RATIO)
    if found != expected:
        raise ValueError(f"{where}: vae (latent_channels, spatial compression) = {found}, but the animatediff family "
                         f"(Stable Diffusion's AutoencoderKL) expects {expected}")


def _check_scheduler(folder: Path) -> None:
    """Raise ValueError unless the folder's scheduler config defines the family's objective (`SCHEDULER_CONFIG`)."""
    config = DDIMScheduler.load_config(folder, subfolder="scheduler", local_files_only=True)
    for key in _SCHEDULE_KEYS:
        if config.get(key, SCHEDULER_CONFIG[key]) != SCHEDULER_CONFIG[key]:
            raise ValueError(f"pretrained_path {str(folder)!r}: scheduler {key}={config[key]!r}, but the animatediff "
                             f"family trains and samples with AnimateDiff's schedule ({key}={SCHEDULER_CONFIG[key]!r}, "
                             "as its motion modules were trained) only; set it in the folder's "
                             "scheduler/scheduler_config.json")


def _read_json(path: Path) -> dict[str, Any]:
    try:
        return json.loads(path.read_text())
    except (OSError, ValueError) as err:
        raise ValueError(f"{path} is not a readable JSON config ({err})") from None


def _check_folder(path: str | Path) -> Path:
    """`require_pipeline_folder` for an AnimateDiffPipeline, then its scheduler's, UNet's and VAE's configs (before
    any weights load): a UNetMotionModel, or a UNet2DConditionModel with a motion_adapter/ folder; latent channels
    agreeing with the family's. Returns the folder."""
    folder = require_pipeline_folder(path, "AnimateDiffPipeline", PIPELINE_COMPONENTS)
    _check_scheduler(folder)
    unet = _read_json(folder / "unet" / "config.json")
    vae = _read_json(folder / "vae" / "config.json")
    where = f"pretrained_path {str(folder)!r}"
    if unet.get("_class_name") not in ("UNetMotionModel", "UNet2DConditionModel"):
        raise ValueError(f"{where}: unet is a {unet.get('_class_name')}, but AnimateDiff needs a UNetMotionModel or a "
                         "UNet2DConditionModel with a motion_adapter/")
    if unet["_class_name"] == "UNet2DConditionModel" and not (folder / "motion_adapter").is_dir():
        raise FileNotFoundError(f"{where} holds an image UNet2DConditionModel and lacks motion_adapter/: give a "
                                "folder with the MotionAdapter beside it, or one saved by AnimateDiffPipeline")
    _check_vae(vae, where)
    channels = (unet.get("in_channels"), unet.get("out_channels"), vae.get("latent_channels"))
    if len(set(channels)) != 1:
        raise ValueError(f"{where}: unet in_channels/out_channels {channels[:2]} do not match the vae's "
                         f"latent_channels {channels[2]}: the unet and vae come from different models")
    return folder


def _check_num_train_timesteps(num_train_timesteps: int) -> None:
    if num_train_timesteps != NUM_TRAIN_TIMESTEPS:
        raise ValueError(f"flow.num_train_timesteps is {num_train_timesteps}, but the animatediff family's DDIM "
                         f"schedule has {NUM_TRAIN_TIMESTEPS} timesteps: set flow.num_train_timesteps: "
                         f"{NUM_TRAIN_TIMESTEPS}")


def _trainable(unet: UNetMotionModel) -> UNetMotionModel:
    """`unet` in train mode with only its motion modules trainable (`freeze_unet2d_params`)."""
    unet.freeze_unet2d_params()
    return unet.train()


def _frozen(module: torch.nn.Module) -> torch.nn.Module:
    return module.eval().requires_grad_(False)


def _with_max_length(tokenizer: Any, max_sequence_length: int) -> Any:
    """`tokenizer` with `model_max_length` = `max_sequence_length` (in place): the stock pipeline pads prompts to it,
    so the exported tokenizer makes `AnimateDiffPipeline` encode as vidray trained."""
    tokenizer.model_max_length = int(max_sequence_length)
    return tokenizer


def load_vae_folder(path: str | Path) -> AutoencoderKL:
    """The frozen `AutoencoderKL` of a local diffusers VAE folder, for `model.vae_path`. Raises FileNotFoundError
    naming the folder when it holds no `config.json`, ValueError when its layout is not SD's."""
    path = Path(path)
    if not (path / "config.json").is_file():
        raise FileNotFoundError(f"model.vae_path {str(path)!r} is not a diffusers VAE folder (no config.json): give "
                                "the vae/ folder of a diffusers AnimateDiff or Stable Diffusion pipeline")
    vae = AutoencoderKL.from_pretrained(path, local_files_only=True)
    _check_vae(vae.config, str(path))
    return _frozen(vae)


def _tiny_unet(kind: TextEncoderKind) -> UNetMotionModel:
    """TINY_UNET at the global RNG's state, `cross_attention_dim` from the text encoder `kind`."""
    return UNetMotionModel(**TINY_UNET, cross_attention_dim=_text_width(kind))


def build_tiny(text_encoder_kind: TextEncoderKind = "tiny_random", *, seed: int = 0) -> Components:
    """Random tiny preset (fp32, CPU): the text encoder under `seed` (a 2-layer `CLIPTextModel` over MiniLM's
    tokenizer, or MiniLM; `vidray.models.text_encoder.build_clip_text_encoder`), then TINY_UNET and TINY_VAE under
    `seed` (in that order), each in a forked RNG (the global torch RNG is left as it was). The UNet's image layers are
    frozen; its motion modules train."""
    text_encoder, tokenizer = build_clip_text_encoder(text_encoder_kind, seed=seed)
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        unet = _tiny_unet(text_encoder_kind)
        vae = AutoencoderKL(**TINY_VAE)
    return Components(transformer=_trainable(unet), vae=_frozen(vae), text_encoder=text_encoder, tokenizer=tokenizer)


def _load_unet(folder: Path) -> UNetMotionModel:
    """The folder's UNetMotionModel: `unet/` itself, or `unet/` (UNet2DConditionModel) + `motion_adapter/` combined
    by `UNetMotionModel.from_unet2d` (as `AnimateDiffPipeline.__init__`). Only the motion modules trainable."""
    config = _read_json(folder / "unet" / "config.json")
    if config["_class_name"] == "UNetMotionModel":
        unet = UNetMotionModel.from_pretrained(folder, subfolder="unet", local_files_only=True)
    else:
        image_unet = UNet2DConditionModel.from_pretrained(folder, subfolder="unet", local_files_only=True)
        adapter = MotionAdapter.from_pretrained(folder, subfolder="motion_adapter", local_files_only=True)
        unet = UNetMotionModel.from_unet2d(image_unet, adapter)
    return _trainable(unet)


def save_pipeline(components: Components, out_dir: str | Path, flow: FlowConfig) -> Path:
    """Write `components` as a complete diffusers folder (safetensors) that
    `diffusers.AnimateDiffPipeline.from_pretrained(out_dir, local_files_only=True)` loads and runs offline.

    The UNetMotionModel goes in as `unet` with `motion_adapter=None` (the layout `AnimateDiffPipeline.save_pretrained`
    writes); the scheduler is `DDIMScheduler(**SCHEDULER_CONFIG)`, whose `set_timesteps` gives the family's
    `inference_sigmas` and whose `step` is `vidray.diffusion.ddim.ddim_step`, so the stock pipeline samples what
    vidray samples (`flow.shift` plays no part). The stock pipeline draws its initial noise laid out
    (B, C, F, H, W) as vidray does: pass vidray's noise as `latents=` (or the same seeded CPU generator) to get the
    same video; it pads prompts to the tokenizer's `model_max_length`, which `build` set to the trained
    `model.max_sequence_length`. Written by `vidray.models.folders.write_pipeline_folder` (complete or absent).
    Raises ValueError unless flow.num_train_timesteps is 1000. Returns `out_dir`.
    """
    _check_num_train_timesteps(flow.num_train_timesteps)
    pipe = AnimateDiffPipeline(vae=components.vae, text_encoder=components.text_encoder,
                               tokenizer=components.tokenizer, unet=unwrapped(components.transformer),
                               motion_adapter=None, scheduler=DDIMScheduler(**SCHEDULER_CONFIG))
    return write_pipeline_folder(pipe, out_dir)


def probe_loss(model: torch.nn.Module, unet: UNetMotionModel) -> torch.Tensor:
    """The output sum of `model` (`unet`, maybe DDP-wrapped) on a fixed (1, C, 2, s, s) input (2 frames, so the
    motion modules attend across time; s = 2 ** number of downsamplers, the smallest side every block takes) with 2
    text tokens per frame, from a seeded CPU generator (the global RNG is untouched); fp32 scalar. The probe of
    `no_grad_parameter_names` and of `vidray.train.parallel.prime_buckets`."""
    cfg, param = unet.config, next(unet.parameters())
    dtype = input_dtype(param)  # fp32 when the base is stored in bf16 / fp8 (autocast)
    g = torch.Generator().manual_seed(0)
    side = 2 ** (len(cfg.block_out_channels) - 1)
    num_frames = 2
    sample = torch.randn(1, cfg.in_channels, num_frames, side, side, generator=g).to(param.device, dtype)
    prompt_embeds = torch.randn(1, 2, cfg.cross_attention_dim, generator=g).to(param.device, dtype)
    return model(sample, torch.full((1,), 500, device=param.device),
                 encoder_hidden_states=prompt_embeds.repeat_interleave(num_frames, dim=0),
                 return_dict=False)[0].float().sum()


class AnimateDiffFamily(ModelFamily):
    """AnimateDiff (SD 1.5 UNet + motion modules): latents (B, 4, F, H/8, W/8), any F (per-frame VAE), H and W
    multiples of 64; epsilon on AnimateDiff's DDIM schedule; only the motion modules train."""

    name = "animatediff"
    latent_channels = LATENT_CHANNELS
    example_bucket = (4, 64, 64)
    objective = OBJECTIVE

    # 2. Modules.

    def load_condition_models(self, model_cfg: ModelConfig, *, seed: int, text: bool = True, image: bool = True,
                              meta: bool = False) -> ConditionModels:
        """The frozen CLIP text encoder and tokenizer (AnimateDiff takes no image embeddings): a folder's (loaded
        with `unet=None, motion_adapter=None, vae=None`), or the tiny preset's alone (drawn first, in its own forked
        RNG, so it equals `build_tiny`'s). The tokenizer pads to `model.max_sequence_length` (its
        `model_max_length`, which the export carries)."""
        if not text:
            return ConditionModels(text_encoder=None, tokenizer=None)
        folder = pretrained_folder(model_cfg, "animatediff")
        if folder is None:
            text_encoder, tokenizer = build_clip_text_encoder(model_cfg.text_encoder, seed=seed)
            text_encoder = on_meta(text_encoder) if meta else text_encoder
        else:
            _check_folder(folder)
            skip = dict(text_encoder=None) if meta else {}
            pipe = AnimateDiffPipeline.from_pretrained(folder, unet=None, motion_adapter=None, vae=None, **skip,
                                                       local_files_only=True)
            text_encoder = meta_component(folder, "text_encoder")[0] if meta else pipe.text_encoder
            text_encoder, tokenizer = _frozen(text_encoder), pipe.tokenizer
        return ConditionModels(text_encoder, _with_max_length(tokenizer, model_cfg.max_sequence_length))

    def load_latent_models(self, model_cfg: ModelConfig, *, seed: int, trainable: bool = False,
                           meta: bool = False) -> LatentModels:
        """The frozen VAE: `model.vae_path`, else a folder's `vae/` loaded by itself, else the tiny preset's (drawn
        under `seed` after the UNet, as in `build_tiny`). The VAE does not train here: `trainable` raises
        NotImplementedError."""
        if trainable:
            raise NotImplementedError(f"the {self.name} family's VAE cannot be trained by vidray train-vae yet")
        if model_cfg.vae_path:
            if meta:
                vae, weights = meta_module(AutoencoderKL, model_cfg.vae_path)
                return LatentModels(_frozen(vae), weights)
            return LatentModels(load_vae_folder(model_cfg.vae_path))
        folder = pretrained_folder(model_cfg, "animatediff")
        if folder is None:
            with torch.random.fork_rng(devices=[]):
                torch.manual_seed(seed)
                _tiny_unet(model_cfg.text_encoder)  # drawn first in build_tiny: replay it to reach the VAE's draws
                vae = AutoencoderKL(**TINY_VAE)
            return LatentModels(_frozen(on_meta(vae) if meta else vae))
        _check_folder(folder)
        if meta:
            vae, weights = meta_module(AutoencoderKL, folder / "vae")
            return LatentModels(_frozen(vae), weights)
        return LatentModels(load_vae_folder(folder / "vae"))

    def load_diffusion_models(self, model_cfg: ModelConfig, *, seed: int, expert: str | None = None,
                              meta: bool = False) -> DiffusionModels:
        """The UNetMotionModel (as `transformer`), without the VAE or the text encoder: the tiny preset drawn first
        under `seed` (as in `build_tiny`); a folder's `unet/` (and `motion_adapter/`). `meta`: from the config of a
        folder's `unet/` when it holds a UNetMotionModel (ValueError for an image UNet + motion adapter, whose
        weights are two folders). AnimateDiff has no experts: `expert` raises ValueError (`pick_expert`)."""
        if expert is not None:
            pick_expert(None, expert)
        folder = pretrained_folder(model_cfg, "animatediff")
        if folder is None:
            with torch.random.fork_rng(devices=[]):
                torch.manual_seed(seed)
                unet = _tiny_unet(model_cfg.text_encoder)
            return DiffusionModels(_trainable(on_meta(unet) if meta else unet))
        folder = _check_folder(folder)
        if not meta:
            return DiffusionModels(_load_unet(folder))
        if _read_json(folder / "unet" / "config.json")["_class_name"] != "UNetMotionModel":
            raise ValueError(f"pretrained_path {str(folder)!r} holds an image UNet and a motion adapter: its weights "
                             "are not one folder to shard from; save it as a UNetMotionModel or use scaling.strategy: "
                             "ddp")
        unet, weights = meta_module(UNetMotionModel, folder / "unet")
        return DiffusionModels(_trainable(unet), weights)

    # 3. Encoding, the UNet call, decoding.

    def encode_video(self, vae: AutoencoderKL, video: torch.Tensor) -> torch.Tensor:
        """See module-level `encode_video`: (B, 4, F, H//8, W//8) float32, frame by frame."""
        return encode_video(vae, video)

    def decode_latents(self, vae: AutoencoderKL, latents: torch.Tensor) -> torch.Tensor:
        """See module-level `decode_latents` (`AnimateDiffPipeline.decode_latents`, clamped to [-1, 1])."""
        return decode_latents(vae, latents)

    def encode_prompt(self, text_encoder, tokenizer, prompts: list[str], *, max_sequence_length: int,
                      device: torch.device | str | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        """See module-level `encode_prompts` (AnimateDiffPipeline.encode_prompt)."""
        return encode_prompts(text_encoder, tokenizer, prompts, max_sequence_length=max_sequence_length,
                              device=device)

    def predict(
        self,
        transformer: UNetMotionModel,
        noisy_latents: torch.Tensor,
        timesteps: torch.Tensor,
        prompt_embeds: torch.Tensor,
        prompt_attention_mask: torch.Tensor,
    ) -> torch.Tensor:
        """noisy_latents (B, 4, F, H, W), timesteps (B,) integer-valued in 0..999, prompt_embeds (B, L, D),
        prompt_attention_mask (B, L) -> model_pred (B, 4, F, H, W), the predicted noise (epsilon).

        Called exactly like AnimateDiffPipeline's denoising loop: `unet(latents, t, encoder_hidden_states=...)` with
        the latents as they are (B, C, F, H, W), `t` as int64 (the scheduler's timesteps; one per sample here, the
        UNet broadcasts them), and the prompt embeddings repeated once per frame
        (`prompt_embeds.repeat_interleave(num_frames, dim=0)`, (B*F, L, D)). prompt_attention_mask is checked for
        shape but not passed (the pipeline passes none). Raises ValueError for shapes that do not line up, or more
        frames than the motion modules' `motion_max_seq_length`.
        """
        if noisy_latents.ndim != 5:
            raise ValueError(f"noisy_latents must be (B, C, F, H, W), got {tuple(noisy_latents.shape)}")
        batch_size, _, num_frames, _, _ = noisy_latents.shape
        if timesteps.shape != (batch_size,):
            raise ValueError(f"timesteps must have shape ({batch_size},), got {tuple(timesteps.shape)}")
        if prompt_embeds.ndim != 3 or prompt_embeds.shape[0] != batch_size:
            raise ValueError(f"prompt_embeds must be ({batch_size}, L, D), got {tuple(prompt_embeds.shape)}")
        if prompt_attention_mask.shape != prompt_embeds.shape[:2]:
            raise ValueError(f"prompt_attention_mask {tuple(prompt_attention_mask.shape)} must match prompt_embeds' "
                             f"(B, L) {tuple(prompt_embeds.shape[:2])}")
        max_frames = unwrapped(transformer).config.motion_max_seq_length  # the loop passes the DDP-wrapped model
        if num_frames > max_frames:
            raise ValueError(f"{num_frames} frames, but this UNetMotionModel's motion modules cover at most "
                             f"motion_max_seq_length={max_frames}: use buckets of at most {max_frames} frames")
        return transformer(
            noisy_latents,
            timesteps.round().to(torch.int64),
            encoder_hidden_states=prompt_embeds.to(dtype=noisy_latents.dtype).repeat_interleave(num_frames, dim=0),
            return_dict=False,
        )[0]

    # 4. Shapes, probes, export.

    def latent_shape(self, bucket: Bucket, batch_size: int) -> tuple[int, int, int, int, int]:
        """(B, 4, F, H//8, W//8); e.g. Bucket(16, 256, 256), B=2 -> (2, 4, 16, 32, 32).

        Raises ValueError unless H, W are multiples of 64 (8x VAE, SD's UNet 8x; `vidray.buckets`) and F >= 1."""
        validate_bucket(bucket, spatial_multiple=self.spatial_multiple, temporal_compression=TEMPORAL_COMPRESSION_RATIO)
        if batch_size < 1:
            raise ValueError(f"batch_size must be >= 1, got {batch_size}")
        num_frames, height, width = bucket
        return (batch_size, LATENT_CHANNELS, num_frames, height // SPATIAL_COMPRESSION_RATIO,
                width // SPATIAL_COMPRESSION_RATIO)

    def no_grad_parameter_names(self, transformer: UNetMotionModel) -> list[str]:
        """Trainable parameters (motion modules) without a gradient from `probe_loss`
        (`vidray.models.folders.unused_parameter_names`)."""
        return unused_parameter_names(transformer, probe_loss)

    def prompt_embeds_dim(self, transformer: UNetMotionModel) -> int:
        """`transformer.config.cross_attention_dim` (768 for SD 1.5's CLIP ViT-L; the text encoder's hidden size
        here)."""
        return int(transformer.config.cross_attention_dim)

    def probe_loss(self, model: torch.nn.Module, transformer: UNetMotionModel) -> torch.Tensor:
        """See module-level `probe_loss`."""
        return probe_loss(model, transformer)

    def save_pipeline(self, components: Components, out_dir: str | Path, flow: FlowConfig) -> Path:
        """See module-level `save_pipeline`."""
        return save_pipeline(components, out_dir, flow)
