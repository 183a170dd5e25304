"""CogVideoX 1.0 and 1.5 family: diffusers `CogVideoXTransformer3DModel` + `AutoencoderKLCogVideoX` + a T5 text
encoder, trained with v-prediction and exported as a stock `diffusers.CogVideoXPipeline` folder.

Everything here mirrors diffusers/pipelines/cogvideo/pipeline_cogvideox.py (diffusers 0.42.1), so a transformer
trained with `CogVideoXFamily.predict` behaves the same inside the stock pipeline:
- prompts (`encode_prompts`, as `CogVideoXPipeline._get_t5_prompt_embeds`): the prompts as given (no cleaning),
  right-padded to `max_sequence_length` with special tokens, truncated, `text_encoder(input_ids)[0]` WITHOUT an
  attention mask (padding positions are encoded like the others and kept); the tokenizer's mask is returned but
  never reaches the transformer (it has no text mask);
- transformer call: hidden_states laid out (B, F, C, H, W) (vidray's (B, C, F, H, W) permuted in `predict` and the
  output permuted back), `timestep` the scheduler's int64 timesteps, `image_rotary_emb` from
  `_prepare_rotary_positional_embeddings` when the config has `use_rotary_positional_embeddings` (CogVideoX-5b),
  else None (CogVideoX-2b: sincos positions over `max_text_seq_length` text tokens, so the prompt length must equal
  it);
- latents: `posterior mode * vae.config.scaling_factor`, decoded as `vae.decode(latents / scaling_factor)`
  (the pipeline's `decode_latents`; `vidray.models.vae` with a scalar scale and no shift);
- objective and sampler: v-prediction on the model's own `CogVideoXDDIMScheduler` schedule (`vidray.diffusion.ddim`
  computes its alphas as `CogVideoXDDIMScheduler.__init__` does: betas, SNR shift, zero terminal SNR), DDIM steps on
  its trailing timesteps, and the export carries that scheduler config, so the stock pipeline takes the same DDIM
  steps as `vidray.inference.sampler`. The tiny preset and CogVideoX-2b folders carry `SCHEDULER_CONFIG`
  (`snr_shift_scale` 3.0); CogVideoX-5b, 5b-I2V and 1.5 folders `SCHEDULER_CONFIG_5B` (1.0); a folder's config is
  checked by `check_scheduler_config` (v-prediction, trailing, no clipping, 1000 train timesteps; any betas, SNR
  shift, rescale and final alpha). The family's `objective` (a `vidray.diffusion.objectives.DDIM` of that schedule)
  gets tensors only, so a `CogVideoXFamily` instance carries one model's config: `for_model(model_cfg)` reads it
  from a folder (configs only, no weights), `for_transformer(transformer)` from the transformer the family built or
  loaded (which carries it), and `predict` refuses a transformer of another. A noise level sigma in [0, 1] is the
  timestep sigma * 1000 (rounded); the sampler's schedule ends at -1 / 1000 (the final alpha).

Image-to-video (`model.i2v`, condition `first`), as diffusers/pipelines/cogvideo/pipeline_cogvideox_image2video.py
(`CogVideoXImageToVideoPipeline`, CogVideoX-5b-I2V) builds it: the transformer's `in_channels` is 32, the noisy latents
(16) then the image latents (16) concatenated along channels; the image latents are the first frame resized to the
bucket (`VideoProcessor.preprocess`: PIL LANCZOS to (H, W), [-1, 1]), encoded alone as a 1-frame video, a posterior
SAMPLE drawn from the pipeline's generator (`latent_dist.sample(generator)`: vidray draws it from a CPU generator
seeded with the request's seed, before and apart from the initial noise), times `scaling_factor` (divided by it when
the VAE config sets `invert_scale_latents`, CogVideoX 1.5), then zeros over the other latent frames. The pipeline adds
no other noise to the image; `ofs` is None (CogVideoX 1.0 has no `ofs_embed_dim`). Training conditions each clip on
its own first frame encoded the same way but with the posterior MODE (deterministic, so the encode stage caches it;
the finetuning scripts also add noise to the image and sample, which a cache cannot hold); a dropped condition
(`model.i2v.condition_dropout`) and text-to-video through an I2V model get zero image latents, as the finetuning
scripts' `noised_image_dropout` does. Exported as a stock `CogVideoXImageToVideoPipeline` folder.

CogVideoX 1.5 text-to-video (CogVideoX1.5-5B folders: transformer `patch_size_t` 2, VAE `invert_scale_latents`,
scheduler `snr_shift_scale` 1.0; the tiny preset's `build_tiny(version="1.5")`), as `CogVideoXPipeline.__call__`
runs it: the latent frames of a bucket, (F - 1) // 4 + 1, odd for 1 or 8k+1 frames, are padded to a multiple of
`patch_size_t` by one frame (`latent_padding`, the pipeline's `additional_frames`). The padding is part of the
latents everywhere, not added inside `predict`: `latent_shape` gives the padded shape (the pipeline draws its noise
for the padded count and denoises every frame, so vidray's sampler must too to give the same latents),
`encode_video` pads a clip's latents by copying the first latent frame in front (as the CogVideoX 1.5 finetuning
scripts' `compute_loss` does before drawing the noise, so the loss covers every frame) and `decode_latents` drops
the leading frame before decoding (the pipeline's `latents[:, additional_frames:]`). `encode_video` and
`decode_latents` know a 1.5 model by its VAE's `invert_scale_latents` (diffusers' conversion sets it for 1.5 only; a
folder whose VAE and transformer disagree is refused), `latent_shape` by the family instance's `patch_size_t`
(`for_model`). The 3D RoPE is the pipeline's 1.5 one (`grid_type="slice"` of the `sample_height // 2` x
`sample_width // 2` table, temporal positions over latent frame pairs); a bucket past that table is a one-line
error. The latent cache holds padded latents under the 1.5 VAE's own identity (its config differs from 1.0's).
CogVideoX 1.5 image-to-video (CogVideoX1.5-5B-I2V) as `CogVideoXImageToVideoPipeline` runs it: the image latents
span the padded count, the image in frame 0 and zeros after (the pipeline's first-frame copy, `image_latents[:, :F %
patch_size_t]`, is empty for the even padded count; the 1.5 I2V finetuning scripts lay them out the same), scaled by
`1 / scaling_factor` (`invert_scale_latents`, as the pipeline; the finetuning scripts multiply, which the pipeline's
comment calls the original training's slip), and the transformer gets `ofs` = `OFS` (2.0) when it has
`ofs_embed_dim`.

Not here yet: `model.preset` has no 1.5 tiny preset (it is reached as a folder).
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any, Literal

import numpy as np
import torch
from diffusers import (AutoencoderKLCogVideoX, CogVideoXDDIMScheduler, CogVideoXImageToVideoPipeline,
                       CogVideoXPipeline, CogVideoXTransformer3DModel)
from diffusers.models.embeddings import get_3d_rotary_pos_embed
from diffusers.pipelines.cogvideo.pipeline_cogvideox import get_resize_crop_region_for_grid
from diffusers.video_processor import VideoProcessor
from PIL import Image

from vidray.cards import get_card
from vidray.models.offload import compute_dtype, execution_device
from vidray.models.storage import input_dtype
from vidray.config import FlowConfig, ModelConfig
from vidray.buckets import Bucket, validate_bucket
from vidray.diffusion import ddim
from vidray.diffusion.objectives import DDIM
from vidray.errors import UserError
from vidray.models.base import (Components, ConditionModels, DiffusionModels, LatentModels, ModelFamily,
                                on_meta)
from vidray.models.conditioning import ImageCondition, clip_condition, over_batch, takes_image
from vidray.models.experts import pick_expert
from vidray.models.folders import (folder_component, meta_component, meta_module, pretrained_folder,
                                   require_pipeline_folder, unused_parameter_names, unwrapped, write_pipeline_folder)
from vidray.models.text_encoder import build_t5_text_encoder, t5_text_width
from vidray.models.vae import decode_latents, encode_video

__all__ = [
    "SCHEDULER_CONFIG",
    "SCHEDULER_CONFIG_5B",
    "TINY_I2V_TRANSFORMER",
    "TINY_TRANSFORMER",
    "TINY_VAE",
    "CogVideoXFamily",
    "build_tiny",
    "check_scheduler_config",
    "empty_condition",
    "encode_image_latents",
    "encode_prompts",
    "folder_scheduler_config",
    "image_condition",
    "preprocess_image",
    "load_vae_folder",
    "probe_loss",
    "rotary_positional_embeddings",
    "save_pipeline",
    "schedule_of",
    "scheduler_config_of",
    "takes_image_latents",
]

LATENT_CHANNELS = 16
"""AutoencoderKLCogVideoX `latent_channels` (CogVideoX 1.0 T2V: the transformer's in_channels)."""
SPATIAL_COMPRESSION_RATIO = 8
"""2 ** (len(block_out_channels) - 1) with 4 blocks: the pipeline's `vae_scale_factor_spatial`."""
TEMPORAL_COMPRESSION_RATIO = get_card("cogvideox").bucket_rules.temporal_compression
FRAME_STEP = get_card("cogvideox").bucket_rules.num_frames_step
"""num_frames is 1 or 8k+1: the VAE decodes 2 latent frames at a time, so only odd latent counts round-trip
(`vidray.buckets`)."""
PATCH_SIZE = 2
"""CogVideoXTransformer3DModel `patch_size` (height and width); `patch_size_t` None: one latent frame per patch."""
PATCH_SIZE_T_15 = 2
"""CogVideoX 1.5's `patch_size_t`: two latent frames per patch, so its latent frames are padded to an even count (one
leading frame for the odd counts of 8k+1 buckets; `latent_padding`). The only `patch_size_t` the family takes."""
assert SPATIAL_COMPRESSION_RATIO * PATCH_SIZE == get_card("cogvideox").bucket_rules.spatial_multiple
PIPELINE_COMPONENTS = ("transformer", "vae", "text_encoder", "tokenizer", "scheduler")
"""The subfolders of a CogVideoX diffusers folder (T2V or I2V) that vidray loads."""
T2V_PIPELINE = "CogVideoXPipeline"
I2V_PIPELINE = "CogVideoXImageToVideoPipeline"
I2V_IN_CHANNELS = 2 * LATENT_CHANNELS
"""CogVideoX 1.0 I2V transformer `in_channels` (32): the noisy latents, then the image latents, along channels
(`CogVideoXImageToVideoPipeline.__call__`: `latent_channels = in_channels // 2`, `torch.cat([latent_model_input,
latent_image_input], dim=2)` in its (B, F, C, H, W) layout)."""
NUM_TRAIN_TIMESTEPS = 1000

SCHEDULER_CONFIG = dict(
    num_train_timesteps=NUM_TRAIN_TIMESTEPS,
    beta_start=0.00085,
    beta_end=0.012,
    beta_schedule="scaled_linear",
    snr_shift_scale=3.0,
    rescale_betas_zero_snr=True,
    timestep_spacing="trailing",
    prediction_type="v_prediction",
    set_alpha_to_one=True,
    clip_sample=False,
    steps_offset=0,
)
"""CogVideoX-2b's scheduler/scheduler_config.json (`CogVideoXDDIMScheduler`): what the tiny preset trains and samples
with and its export carries (a folder's own config is followed: `folder_scheduler_config`)."""
SCHEDULER_CONFIG_5B = dict(SCHEDULER_CONFIG, snr_shift_scale=1.0)
"""CogVideoX-5b's, 5b-I2V's and CogVideoX1.5-5B's scheduler/scheduler_config.json: CogVideoX-2b's but for
`snr_shift_scale` 1.0 (no SNR shift). A folder's own config is what the family trains and samples with
(`folder_scheduler_config`); this one is for tests and docs."""
_FREE_KEYS = ("beta_start", "beta_end", "beta_schedule", "snr_shift_scale", "rescale_betas_zero_snr",
              "set_alpha_to_one", "steps_offset")
"""The scheduler keys a folder may set as it likes: `vidray.diffusion.ddim` follows each (steps_offset plays no part
with trailing timesteps). The other keys of `SCHEDULER_CONFIG` must be as there (`check_scheduler_config`)."""


def schedule_of(scheduler_config: dict[str, Any]) -> ddim.DDIMSchedule:
    """The `vidray.diffusion.ddim` schedule of a checked `CogVideoXDDIMScheduler` config (`check_scheduler_config`):
    alphas_cumprod (1000,) float64 as diffusers' `CogVideoXDDIMScheduler.__init__` computes them (betas, then the
    SNR shift, then zero terminal SNR), and the final alpha."""
    return ddim.ddim_schedule(
        scheduler_config["num_train_timesteps"], beta_start=scheduler_config["beta_start"],
        beta_end=scheduler_config["beta_end"], beta_schedule=scheduler_config["beta_schedule"],
        snr_shift_scale=scheduler_config["snr_shift_scale"],
        rescale_betas_zero_snr=scheduler_config["rescale_betas_zero_snr"],
        set_alpha_to_one=scheduler_config["set_alpha_to_one"])


SCHEDULE = schedule_of(SCHEDULER_CONFIG)
"""`SCHEDULER_CONFIG` as `vidray.diffusion.ddim` computes it (checked against CogVideoXDDIMScheduler in
tests/unit/test_ddim.py)."""


def check_scheduler_config(config: dict[str, Any], where: str) -> dict[str, Any]:
    """A scheduler config (a folder's scheduler_config.json as a dict) -> the `SCHEDULER_CONFIG` keys with the
    folder's values (diffusers' defaults where it has none), if the family can follow it: a `CogVideoXDDIMScheduler`
    with v-prediction, 1000 train timesteps, trailing timesteps, no clipping and no `trained_betas`, any betas
    (linear or scaled_linear), SNR shift, zero-terminal-SNR rescale and final alpha (`_FREE_KEYS`). Raises
    ValueError in one line naming `where`, the key and the fix otherwise."""
    name = config.get("_class_name", "CogVideoXDDIMScheduler")
    if name != "CogVideoXDDIMScheduler":
        raise ValueError(f"{where}: scheduler is {name}, but the cogvideox family samples with CogVideoXDDIMScheduler "
                         "(DDIM on the same v-prediction schedule): set _class_name to CogVideoXDDIMScheduler in "
                         "scheduler/scheduler_config.json")
    full = dict(CogVideoXDDIMScheduler.from_config({k: v for k, v in config.items() if not k.startswith("_")}).config)
    checked = {key: full[key] for key in SCHEDULER_CONFIG}
    for key, expected in SCHEDULER_CONFIG.items():
        if key not in _FREE_KEYS and checked[key] != expected:
            raise ValueError(f"{where}: scheduler {key}={checked[key]!r}, but the cogvideox family trains and samples "
                             f"with {key}={expected!r} (v-prediction, DDIM on trailing timesteps, as CogVideoX's own "
                             f"folders): set {key}: {json.dumps(expected)} in scheduler/scheduler_config.json")
    if full.get("trained_betas") is not None:
        raise ValueError(f"{where}: scheduler trained_betas is set, but the cogvideox family computes its betas from "
                         "beta_start, beta_end and beta_schedule: set trained_betas: null in "
                         "scheduler/scheduler_config.json")
    if checked["beta_schedule"] not in ("linear", "scaled_linear"):
        raise ValueError(f"{where}: scheduler beta_schedule={checked['beta_schedule']!r}, but the cogvideox family "
                         "follows 'linear' or 'scaled_linear' only: set one in scheduler/scheduler_config.json")
    shift = checked["snr_shift_scale"]
    if isinstance(shift, bool) or not isinstance(shift, (int, float)) or not shift > 0:
        raise ValueError(f"{where}: scheduler snr_shift_scale={shift!r} must be a number > 0 (3.0: CogVideoX-2b, 1.0: "
                         "CogVideoX-5b and 1.5): fix scheduler/scheduler_config.json")
    return checked


_TRANSFORMER_ATTRIBUTE = "_vidray_cogvideox_scheduler_config"
"""The attribute a transformer the family built or loaded carries its scheduler config in (`scheduler_config_of`)."""


def _attach_scheduler_config(transformer: torch.nn.Module, scheduler_config: dict[str, Any]) -> None:
    """Record on `transformer` the (checked) scheduler config it was built or loaded with: what
    `CogVideoXFamily.for_transformer`, `predict`'s check and `save_pipeline` read."""
    object.__setattr__(unwrapped(transformer), _TRANSFORMER_ATTRIBUTE, dict(scheduler_config))


def scheduler_config_of(transformer: torch.nn.Module, default: dict[str, Any] | None = None) -> dict[str, Any]:
    """The scheduler config `transformer` (maybe DDP-wrapped) was built or loaded with by the family, else `default`
    (a transformer made outside the family; None: CogVideoX-2b's `SCHEDULER_CONFIG`)."""
    config = getattr(unwrapped(transformer), _TRANSFORMER_ATTRIBUTE, None)
    return dict(config if config is not None else default if default is not None else SCHEDULER_CONFIG)


def folder_scheduler_config(folder: str | Path) -> dict[str, Any]:
    """A CogVideoX folder's scheduler/scheduler_config.json, checked (`check_scheduler_config`, errors naming the
    folder)."""
    config = CogVideoXDDIMScheduler.load_config(folder, subfolder="scheduler", local_files_only=True)
    return check_scheduler_config(config, f"pretrained_path {str(folder)!r}")


TINY_TRANSFORMER = dict(
    num_attention_heads=2,
    attention_head_dim=16,  # 3D RoPE splits it over (t, h, w) as 4 + 6 + 6
    in_channels=LATENT_CHANNELS,
    out_channels=LATENT_CHANNELS,
    time_embed_dim=32,
    num_layers=2,
    sample_width=4,  # latent pixels: the RoPE crop base grid (sample // patch) is 2 x 2
    sample_height=4,
    sample_frames=9,
    patch_size=PATCH_SIZE,
    use_rotary_positional_embeddings=True,
)
"""Tiny DiT (inner dim 32, 2 blocks; ~62 k params with text_embed_dim 64), the CogVideoX-5b layout (3D rotary
positions, so any prompt length). `text_embed_dim` is set from the text encoder's hidden size."""
TINY_I2V_TRANSFORMER = dict(TINY_TRANSFORMER, in_channels=I2V_IN_CHANNELS)
"""The tiny image-to-video transformer (`model.i2v`): TINY_TRANSFORMER taking the image latents too (in_channels 32,
out_channels 16). No learned positional embeddings (CogVideoX-5b-I2V has them, which ties it to its 480x720
`sample_height/width`; `predict` takes such a transformer at that size only), so any bucket works."""

TINY_15_TRANSFORMER = dict(TINY_TRANSFORMER, patch_size_t=PATCH_SIZE_T_15, patch_bias=False, sample_height=8,
                           sample_width=8, sample_frames=81)
"""Tiny CogVideoX 1.5 DiT (CogVideoX1.5-5B's layout: `patch_size_t` 2, no patch bias, 3D rotary positions on the
"slice" grid of `sample_height // 2` x `sample_width // 2` = 4 x 4 patches, so buckets up to 64 x 64 px). Built by
`build_tiny(version="1.5")` (tests write it as a folder; `model.preset` has no 1.5 yet)."""

TINY_15_I2V_TRANSFORMER = dict(TINY_15_TRANSFORMER, in_channels=I2V_IN_CHANNELS, ofs_embed_dim=32)
"""The tiny CogVideoX 1.5 image-to-video DiT (CogVideoX1.5-5B-I2V's layout): TINY_15_TRANSFORMER taking the image
latents too, with the `ofs` embedding (`ofs_embed_dim` = `time_embed_dim`, as 1.5-I2V's 512 = 512: it is added to
the time embedding)."""
OFS = 2.0
"""The `ofs` a CogVideoX 1.5 image-to-video transformer gets (`ofs_embed_dim` set): `CogVideoXImageToVideoPipeline`
passes `latents.new_full((1,), fill_value=2.0)`, as the 1.5 I2V finetuning scripts do."""

TINY_VAE = dict(
    block_out_channels=(8, 8, 8, 8),  # 4 blocks: 8x spatial
    latent_channels=LATENT_CHANNELS,
    layers_per_block=1,
    norm_num_groups=2,
    temporal_compression_ratio=TEMPORAL_COMPRESSION_RATIO,
    scaling_factor=0.7,  # CogVideoX-2b's VAE
)
"""Tiny AutoencoderKLCogVideoX (~77 k params), same compression ratios and latent channels as CogVideoX's."""
TINY_15_VAE = dict(TINY_VAE, invert_scale_latents=True)
"""The tiny 1.5 VAE: CogVideoX 1.5's VAE config sets `invert_scale_latents` (diffusers' conversion script does for
1.5 only), which the family reads as "latents padded for patch_size_t 2" (`pads_latent_frames`)."""

TextEncoderKind = Literal["minilm", "tiny_random"]


@torch.no_grad()
def encode_prompts(text_encoder: torch.nn.Module, tokenizer: Any, prompts: list[str], *, max_sequence_length: int,
                   device: torch.device | str | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """B prompts -> prompt_embeds (B, L, D) float32 and prompt_attention_mask (B, L) bool, L = max_sequence_length,
    on `device` (default: the text encoder's).

    As `CogVideoXPipeline._get_t5_prompt_embeds` (diffusers/pipelines/cogvideo/pipeline_cogvideox.py): tokenize with
    padding to `max_sequence_length`, truncation and special tokens, then `text_encoder(input_ids)[0]` without an
    attention mask: padding positions stay in the embeddings. The mask is the tokenizer's (for the text stage's
    bookkeeping); the transformer never sees it.
    """
    if isinstance(prompts, str) or not prompts:
        raise ValueError(f"prompts must be a non-empty list of strings, got {prompts!r}")
    if max_sequence_length < 1:
        raise ValueError(f"max_sequence_length must be >= 1, got {max_sequence_length}")
    text_inputs = tokenizer(list(prompts), padding="max_length", max_length=max_sequence_length, truncation=True,
                            add_special_tokens=True, return_attention_mask=True, return_tensors="pt")
    te_device = execution_device(text_encoder)
    prompt_embeds = text_encoder(text_inputs.input_ids.to(te_device))[0]  # (B, L, D)
    device = device if device is not None else te_device
    return (prompt_embeds.to(device=device, dtype=torch.float32),
            text_inputs.attention_mask.to(device=device).bool())


def rotary_positional_embeddings(transformer: CogVideoXTransformer3DModel, latent_frames: int, latent_height: int,
                                 latent_width: int, device: torch.device | str) -> tuple[torch.Tensor, torch.Tensor]:
    """(freqs_cos, freqs_sin), each (F_lat/p_t * H_lat/p * W_lat/p, attention_head_dim) float32 on `device`: the 3D
    RoPE exactly as `CogVideoXPipeline._prepare_rotary_positional_embeddings` computes it for a video of height
    H_lat * 8 and width W_lat * 8 (its grid is height // (vae_scale_factor_spatial * p) = H_lat // p). CogVideoX 1.0
    (`patch_size_t` None, p_t = 1): cropped from the `sample_height` x `sample_width` base grid by
    `get_resize_crop_region_for_grid`. CogVideoX 1.5: `grid_type="slice"` of a (sample_height // p, sample_width // p)
    table over (F_lat + p_t - 1) // p_t temporal positions (F_lat the padded count). Raises ValueError when a 1.5 grid
    exceeds that table (diffusers fails there with a shape error)."""
    cfg = transformer.config
    p, p_t = cfg.patch_size, cfg.patch_size_t
    grid_height, grid_width = latent_height // p, latent_width // p
    if p_t is None:
        crops = get_resize_crop_region_for_grid((grid_height, grid_width), cfg.sample_width // p,
                                                cfg.sample_height // p)
        return get_3d_rotary_pos_embed(embed_dim=cfg.attention_head_dim, crops_coords=crops,
                                       grid_size=(grid_height, grid_width), temporal_size=latent_frames, device=device)
    max_size = (cfg.sample_height // p, cfg.sample_width // p)
    if grid_height > max_size[0] or grid_width > max_size[1]:
        scale = SPATIAL_COMPRESSION_RATIO * p
        raise ValueError(f"this CogVideoX 1.5 transformer's rotary table (transformer sample_height x sample_width = "
                         f"{cfg.sample_height} x {cfg.sample_width} latent px) covers videos up to "
                         f"{max_size[0] * scale}x{max_size[1] * scale} px, got {grid_height * scale}x"
                         f"{grid_width * scale}: set data.buckets to at most that height and width")
    return get_3d_rotary_pos_embed(embed_dim=cfg.attention_head_dim, crops_coords=None,
                                   grid_size=(grid_height, grid_width), temporal_size=(latent_frames + p_t - 1) // p_t,
                                   grid_type="slice", max_size=max_size, device=device)


def _check_vae(vae: AutoencoderKLCogVideoX, where: str) -> None:
    config = vae.config
    found = (config.latent_channels, 2 ** (len(config.block_out_channels) - 1), config.temporal_compression_ratio)
    expected = (LATENT_CHANNELS, SPATIAL_COMPRESSION_RATIO, TEMPORAL_COMPRESSION_RATIO)
    if found != expected:
        raise ValueError(f"{where}: vae (latent_channels, spatial compression, temporal_compression_ratio) = {found}, "
                         f"but the cogvideox family expects {expected}")


def pads_latent_frames(vae: AutoencoderKLCogVideoX) -> bool:
    """Whether `vae` is CogVideoX 1.5's (config `invert_scale_latents`, which diffusers' conversion sets for 1.5 only,
    and which `_check_folder` and `build` check agrees with the transformer's `patch_size_t` 2): its latents are padded
    to an even frame count (`latent_padding`) by `encode_video` and unpadded by `decode_latents`."""
    return bool(getattr(vae.config, "invert_scale_latents", False))


def latent_padding(num_latent_frames: int, patch_size_t: int | None) -> int:
    """The latent frames CogVideoX 1.5 puts before the F_lat of a video so a multiple of `patch_size_t` reaches the
    transformer: `patch_size_t - F_lat % patch_size_t` when that is not 0, else 0; 0 for 1.0 (None). As
    `CogVideoXPipeline.__call__` (its `additional_frames`, noise drawn for them too, dropped before decoding:
    `latents[:, additional_frames:]`) and the CogVideoX 1.5 finetuning scripts (`compute_loss`: the first latent frame
    copied `F_lat % patch_size_t` times in front, the same count for patch_size_t 2). An 8k+1 bucket has an odd F_lat,
    so 1.5 always pads one frame."""
    if patch_size_t is None:
        return 0
    return (patch_size_t - num_latent_frames % patch_size_t) % patch_size_t


def _check_layout(transformer_config: Any, vae_config: Any, where: str) -> None:
    """Raise ValueError unless the VAE's `invert_scale_latents` (CogVideoX 1.5's VAE) agrees with the transformer's
    `patch_size_t` (2: 1.5; null: 1.0): the family pads latent frames on the VAE's word (`pads_latent_frames`)."""
    is_15 = transformer_config.get("patch_size_t") is not None
    inverted = bool(vae_config.get("invert_scale_latents", False))
    if is_15 != inverted:
        raise ValueError(f"{where}: transformer patch_size_t={transformer_config.get('patch_size_t')} but vae "
                         f"invert_scale_latents={str(inverted).lower()}: a CogVideoX 1.5 model (patch_size_t 2) has "
                         "the 1.5 VAE (invert_scale_latents true, as diffusers' conversion writes it) and a 1.0 model "
                         "neither; fix vae/config.json or give the model's own VAE")


def _check_transformer(config: Any, where: str) -> None:
    """Raise ValueError unless a transformer config (a `CogVideoXTransformer3DModel.config` or its config.json as a
    dict) is one the family runs: patch_size 2, in_channels 16 (T2V) or 32 (I2V), out_channels 16; patch_size_t null
    (CogVideoX 1.0) or 2 (1.5; rotary positions); ofs_embed_dim null but for image-to-video (CogVideoX1.5-5B-I2V)."""
    get = config.get
    if get("patch_size_t") not in (None, PATCH_SIZE_T_15):
        raise ValueError(f"{where}: transformer patch_size_t={get('patch_size_t')}, but the cogvideox family runs "
                         f"null (CogVideoX 1.0) or {PATCH_SIZE_T_15} (CogVideoX 1.5) only; give a CogVideoX folder")
    if get("ofs_embed_dim") is not None and get("in_channels") != I2V_IN_CHANNELS:
        raise ValueError(f"{where}: transformer ofs_embed_dim={get('ofs_embed_dim')} on a text-to-video transformer "
                         f"(in_channels {get('in_channels')}), but CogVideoXPipeline passes no ofs: set ofs_embed_dim: "
                         "null in transformer/config.json (only CogVideoX1.5-5B-I2V has it)")
    if get("patch_size_t") is not None and not get("use_rotary_positional_embeddings"):
        raise ValueError(f"{where}: transformer patch_size_t={get('patch_size_t')} without "
                         "use_rotary_positional_embeddings: CogVideoX 1.5 uses 3D rotary positions; set "
                         "use_rotary_positional_embeddings: true in transformer/config.json")
    found = (get("in_channels"), get("out_channels"), get("patch_size"))
    valid = ((LATENT_CHANNELS, LATENT_CHANNELS, PATCH_SIZE), (I2V_IN_CHANNELS, LATENT_CHANNELS, PATCH_SIZE))
    if found not in valid:
        raise ValueError(f"{where}: transformer (in_channels, out_channels, patch_size) = {found}, but the cogvideox "
                         f"family expects {valid[0]} (text-to-video) or {valid[1]} (image-to-video)")


def _folder_pipeline(path: str | Path) -> str:
    """The pipeline class a CogVideoX folder declares: `I2V_PIPELINE` when its model_index.json says so, else
    `T2V_PIPELINE` (what `require_pipeline_folder` then checks, naming any other class)."""
    try:
        index = json.loads((Path(path) / "model_index.json").read_text())
    except (OSError, json.JSONDecodeError):
        return T2V_PIPELINE  # require_pipeline_folder names what is wrong
    return I2V_PIPELINE if isinstance(index, dict) and index.get("_class_name") == I2V_PIPELINE else T2V_PIPELINE


def _pipeline_class(path: str | Path) -> type:
    """`CogVideoXImageToVideoPipeline` or `CogVideoXPipeline`, as the folder declares (`_folder_pipeline`)."""
    return CogVideoXImageToVideoPipeline if _folder_pipeline(path) == I2V_PIPELINE else CogVideoXPipeline


def _check_folder(path: str | Path, model_cfg: ModelConfig | None = None) -> Path:
    """`require_pipeline_folder` for a CogVideoXPipeline or CogVideoXImageToVideoPipeline, then its scheduler's and
    transformer's configs (before any weights load): the pipeline class and the transformer's in_channels must
    agree, and with `model_cfg` the folder's task must be the job's (`model.i2v` set for an image-to-video folder,
    null for a text-to-video one). Returns the folder. Raises ValueError in one line naming the folder otherwise."""
    pipeline = _folder_pipeline(path)
    folder = require_pipeline_folder(path, pipeline, PIPELINE_COMPONENTS)
    folder_scheduler_config(folder)
    config = CogVideoXTransformer3DModel.load_config(folder, subfolder="transformer", local_files_only=True)
    _check_transformer(config, str(folder))
    _check_layout(config, AutoencoderKLCogVideoX.load_config(folder, subfolder="vae", local_files_only=True),
                  f"pretrained_path {str(folder)!r}")
    image_to_video = config["in_channels"] == I2V_IN_CHANNELS
    if image_to_video != (pipeline == I2V_PIPELINE):
        raise ValueError(f"pretrained_path {str(folder)!r} holds a {pipeline} whose transformer has in_channels "
                         f"{config['in_channels']}: a {I2V_PIPELINE} takes {I2V_IN_CHANNELS}, a {T2V_PIPELINE} "
                         f"{LATENT_CHANNELS}; re-export the folder")
    if model_cfg is not None and image_to_video != (model_cfg.i2v is not None):
        if model_cfg.i2v is not None:
            fix = "give a CogVideoX image-to-video folder (CogVideoXImageToVideoPipeline), or set model.i2v to null"
        else:
            fix = "set model.i2v: {condition: first} to use it, or give a CogVideoX text-to-video folder"
        raise ValueError(f"model.pretrained_path {str(folder)!r} holds a CogVideoX "
                         f"{'image' if image_to_video else 'text'}-to-video model ({pipeline}) but model.i2v is "
                         f"{'null' if model_cfg.i2v is None else 'set'}: {fix}")
    return folder


def _check_condition(model_cfg: ModelConfig) -> None:
    """Raise ValueError unless `model.i2v.condition` is `first`: CogVideoXImageToVideoPipeline takes one image, the
    first frame."""
    if model_cfg.i2v is not None and model_cfg.i2v.condition != "first":
        raise ValueError(f"model.i2v.condition is {model_cfg.i2v.condition}, but CogVideoX image-to-video "
                         "(CogVideoXImageToVideoPipeline) is conditioned on the first frame only: set "
                         "model.i2v.condition: first")


def _check_num_train_timesteps(num_train_timesteps: int) -> None:
    if num_train_timesteps != NUM_TRAIN_TIMESTEPS:
        raise ValueError(f"flow.num_train_timesteps is {num_train_timesteps}, but the cogvideox family's DDIM schedule "
                         f"has {NUM_TRAIN_TIMESTEPS} timesteps: set flow.num_train_timesteps: {NUM_TRAIN_TIMESTEPS}")


def load_vae_folder(path: str | Path) -> AutoencoderKLCogVideoX:
    """The frozen `AutoencoderKLCogVideoX` of a local diffusers VAE folder, for `model.vae_path`. Raises
    FileNotFoundError naming the folder when it holds no `config.json`, ValueError when its layout is not the
    family's."""
    path = Path(path)
    if not (path / "config.json").is_file():
        raise FileNotFoundError(f"model.vae_path {str(path)!r} is not a diffusers VAE folder (no config.json): give "
                                "the vae/ folder of a diffusers CogVideoX pipeline")
    vae = AutoencoderKLCogVideoX.from_pretrained(path, local_files_only=True)
    _check_vae(vae, str(path))
    return vae.eval().requires_grad_(False)


def _tiny_transformer(kind: TextEncoderKind, *, i2v: bool = False,
                      version: Literal["1.0", "1.5"] = "1.0") -> CogVideoXTransformer3DModel:
    """TINY_TRANSFORMER (TINY_I2V_TRANSFORMER with `i2v`; TINY_15_TRANSFORMER or TINY_15_I2V_TRANSFORMER for
    `version` 1.5) at the global RNG's state, `text_embed_dim` from the text encoder `kind`."""
    if version == "1.5":
        layout = TINY_15_I2V_TRANSFORMER if i2v else TINY_15_TRANSFORMER
    elif version == "1.0":
        layout = TINY_I2V_TRANSFORMER if i2v else TINY_TRANSFORMER
    else:
        raise ValueError(f"version must be '1.0' or '1.5', got {version!r}")
    return CogVideoXTransformer3DModel(**layout, text_embed_dim=t5_text_width(kind))


def build_tiny(text_encoder_kind: TextEncoderKind = "tiny_random", *, seed: int = 0, i2v: bool = False,
               version: Literal["1.0", "1.5"] = "1.0") -> Components:
    """Random tiny preset (fp32, CPU): the text encoder under `seed` (a 2-layer `T5EncoderModel` over MiniLM's
    tokenizer, or MiniLM; `vidray.models.text_encoder.build_t5_text_encoder`), then TINY_TRANSFORMER (with `i2v`:
    TINY_I2V_TRANSFORMER) and TINY_VAE under `seed` (in that order), each in a forked RNG (the global torch RNG is
    left as it was), the transformer carrying CogVideoX-2b's `SCHEDULER_CONFIG` (`scheduler_config_of`). `version`
    1.5: TINY_15_TRANSFORMER (TINY_15_I2V_TRANSFORMER with `i2v`) and TINY_15_VAE on CogVideoX1.5-5B's scheduler
    (`SCHEDULER_CONFIG_5B`). `CogVideoXFamily().for_transformer(components.transformer)` is the family of this
    model."""
    text_encoder, tokenizer = build_t5_text_encoder(text_encoder_kind, variant="t5", seed=seed)
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        transformer = _tiny_transformer(text_encoder_kind, i2v=i2v, version=version)
        vae = AutoencoderKLCogVideoX(**(TINY_15_VAE if version == "1.5" else TINY_VAE))
    _attach_scheduler_config(transformer, SCHEDULER_CONFIG_5B if version == "1.5" else SCHEDULER_CONFIG)
    return Components(transformer=transformer.train(), vae=vae.eval().requires_grad_(False),
                      text_encoder=text_encoder, tokenizer=tokenizer)


def save_pipeline(components: Components, out_dir: str | Path, flow: FlowConfig, *,
                  scheduler_config: dict[str, Any] | None = None) -> Path:
    """Write `components` as a complete diffusers folder (safetensors) that
    `diffusers.CogVideoXPipeline.from_pretrained(out_dir, local_files_only=True)` loads and runs offline; an
    image-to-video transformer (`takes_image_latents`) is written as a `CogVideoXImageToVideoPipeline` (the same
    components), which samples what `vidray generate --image` samples given the same image, seed and noise.

    The scheduler is `CogVideoXDDIMScheduler(**scheduler_config_of(transformer))`, the config the transformer was
    built or loaded with (CogVideoX-2b's for the tiny preset, a 5b folder's `snr_shift_scale` 1.0 for a model
    fine-tuned from it; `scheduler_config`, else `SCHEDULER_CONFIG`, for a transformer made outside the family):
    its `set_timesteps` gives the family's
    `inference_sigmas` and its `step` is `vidray.diffusion.ddim.ddim_step`, so the stock pipeline samples what
    vidray samples (`flow.shift` plays no part: this is not flow matching). Two differences to know: the stock
    pipeline draws its initial noise laid out (B, F, C, H, W), so pass it vidray's noise permuted as `latents=` to
    get the same video; and its `step` goes to t - 1000 // num_inference_steps where vidray goes to the next
    trailing timestep, the same whenever 1000 is a multiple of num_inference_steps (50, its default, is). Note
    the stock pipeline pads prompts to 226 tokens: pass the trained `max_sequence_length`. Written by
    `vidray.models.folders.write_pipeline_folder` (complete or absent). Raises ValueError unless
    flow.num_train_timesteps is 1000. Returns `out_dir`.
    """
    _check_num_train_timesteps(flow.num_train_timesteps)
    pipeline = CogVideoXImageToVideoPipeline if takes_image_latents(components.transformer) else CogVideoXPipeline
    pipe = pipeline(tokenizer=components.tokenizer, text_encoder=components.text_encoder,
                    vae=components.vae, transformer=components.transformer,
                    scheduler=CogVideoXDDIMScheduler(**scheduler_config_of(components.transformer,
                                                                            scheduler_config)))
    return write_pipeline_folder(pipe, out_dir)


def _check_bound(transformer: torch.nn.Module, scheduler_config: dict[str, Any], patch_size_t: int | None) -> None:
    """Raise ValueError in one line unless `transformer`'s scheduler config (`scheduler_config_of`, the family's
    `scheduler_config` when it carries none) and `patch_size_t` are `scheduler_config` and `patch_size_t`, the model
    the family instance is bound to (`CogVideoXFamily.for_model` / `for_transformer`): its objective, sampler step and
    latent shape follow that model."""
    own = {**scheduler_config_of(transformer, scheduler_config), "patch_size_t": transformer.config.patch_size_t}
    theirs = {**scheduler_config, "patch_size_t": patch_size_t}
    keys = sorted(k for k in own if own[k] != theirs.get(k))
    if keys:
        found = ", ".join(f"{k}={own[k]!r}" for k in keys)
        other = ", ".join(f"{k}={theirs.get(k)!r}" for k in keys)
        raise ValueError(f"this CogVideoX transformer has {found}, but the family it is called through is bound to "
                         f"{other}: use the family of its own model (family.for_model(model_cfg) or "
                         "family.for_transformer(transformer))")


def _joint_positions(config: Any) -> bool:
    """Whether the transformer's patch embedding adds positional embeddings over text and video tokens jointly
    (`CogVideoXPatchEmbed`: sincos without rotary positions, CogVideoX-2b; learned, CogVideoX-5b-I2V), so the prompt
    must be exactly `max_text_seq_length` tokens."""
    return bool(not config.use_rotary_positional_embeddings or config.use_learned_positional_embeddings)


def takes_image_latents(transformer: torch.nn.Module) -> bool:
    """Whether `transformer` (maybe DDP-wrapped) is an image-to-video model: its `in_channels` is 32 (noisy latents
    + image latents), not 16."""
    return int(unwrapped(transformer).config.in_channels) == I2V_IN_CHANNELS


def preprocess_image(image: Any, bucket: Bucket) -> torch.Tensor:
    """A first frame -> (1, 3, H, W) float32 in [-1, 1] at the bucket's size, as `CogVideoXImageToVideoPipeline`
    preprocesses its `image` (`VideoProcessor(vae_scale_factor=8).preprocess(image, height, width)`: a PIL image
    resized to (W, H) with LANCZOS, the whole image (no crop); a (3, H, W) float tensor in [0, 1] resized by
    `F.interpolate`; both then 2x - 1). A uint8 (H, W, 3) array is taken as the PIL image it holds. Raises
    ValueError for another kind of input."""
    if isinstance(image, np.ndarray):
        if image.dtype != np.uint8 or image.ndim != 3 or image.shape[-1] != 3:
            raise ValueError(f"an image array must be uint8 (H, W, 3), got {image.dtype} {image.shape}")
        image = Image.fromarray(image)
    elif isinstance(image, torch.Tensor):
        if image.ndim != 3 or image.shape[0] != 3 or not image.is_floating_point():
            raise ValueError(f"an image tensor must be float (3, H, W) in [0, 1], got {image.dtype} "
                             f"{tuple(image.shape)}")
    elif not isinstance(image, Image.Image):
        raise ValueError(f"image must be a PIL image, a uint8 (H, W, 3) array or a (3, H, W) tensor in [0, 1], "
                         f"got {type(image).__name__}")
    processor = VideoProcessor(vae_scale_factor=SPATIAL_COMPRESSION_RATIO)
    return processor.preprocess(image, height=bucket.height, width=bucket.width).float()


@torch.no_grad()
def encode_image_latents(vae: AutoencoderKLCogVideoX, images: torch.Tensor, *,
                         generator: torch.Generator | None = None) -> torch.Tensor:
    """images (B, 3, H, W) float in [-1, 1] -> image latents (B, 16, 1, H/8, W/8) float32: each image encoded alone
    as a 1-frame video, scaled as `CogVideoXImageToVideoPipeline.prepare_latents` does (`* scaling_factor`, or
    `/ scaling_factor` when the VAE config sets `invert_scale_latents`).

    With `generator`: the posterior sample `latent_dist.sample(generator)`, one draw per image in batch order, as the
    pipeline's `retrieve_latents(vae.encode(img), generator)` (what generation uses, so a seed gives the stock
    pipeline's latents). Without: the posterior mode (what training uses: deterministic, so the latent cache holds
    it)."""
    if images.ndim != 4 or images.shape[1] != 3:
        raise ValueError(f"images must be (B, 3, H, W), got {tuple(images.shape)}")
    frames = images.to(device=execution_device(vae), dtype=compute_dtype(vae)).unsqueeze(2)  # (B, 3, 1, H, W)
    latents = []
    for i in range(frames.shape[0]):
        posterior = vae.encode(frames[i:i + 1]).latent_dist
        latents.append(posterior.sample(generator) if generator is not None else posterior.mode())
    latents = torch.cat(latents).float()
    scaling_factor = vae.config.scaling_factor
    if getattr(vae.config, "invert_scale_latents", False):
        return latents / scaling_factor
    return latents * scaling_factor


def image_condition(image_latents: torch.Tensor, num_latent_frames: int) -> torch.Tensor:
    """image latents (B, 16, 1, H_lat, W_lat) -> the condition (B, 16, F_lat, H_lat, W_lat) float32: the image's
    latent frame first, zeros over the other F_lat - 1 (the pipeline's `latent_padding`)."""
    if image_latents.ndim != 5 or image_latents.shape[2] != 1:
        raise ValueError(f"image_latents must be (B, C, 1, H, W), got {tuple(image_latents.shape)}")
    padding = image_latents.new_zeros(*image_latents.shape[:2], num_latent_frames - 1, *image_latents.shape[3:])
    return torch.cat([image_latents, padding], dim=2).float()


def empty_condition(latent_shape: tuple[int, ...], device: torch.device | str | None = None) -> torch.Tensor:
    """The no-image condition (B, 16, F_lat, H_lat, W_lat) float32 for latents of `latent_shape`: zeros, as the
    CogVideoX I2V finetuning scripts drop the image (`noised_image_dropout`: `torch.zeros_like(image_latents)`)."""
    batch_size, _, *grid = latent_shape
    return torch.zeros(batch_size, LATENT_CHANNELS, *grid, dtype=torch.float32, device=device)


def probe_loss(model: torch.nn.Module, transformer: CogVideoXTransformer3DModel) -> torch.Tensor:
    """The output sum of `model` (`transformer`, maybe DDP-wrapped) on a fixed (1, p_t, C_in, p, p) input (one patch,
    laid out (B, F, C, H, W), p_t = `patch_size_t` or 1; an image-to-video transformer's C_in = 32 takes the image
    latents too; learned positional embeddings (CogVideoX-5b-I2V): `sample_height` x `sample_width`, the one size
    they take) with 2 text tokens (`max_text_seq_length` when positions span text and video: no rotary, or learned;
    `_joint_positions`), from a seeded CPU generator (the global RNG is untouched); fp32 scalar. The probe of
    `no_grad_parameter_names` and of `vidray.train.parallel.prime_buckets`."""
    cfg, param = transformer.config, next(transformer.parameters())
    dtype = input_dtype(param)  # fp32 when the base is stored in bf16 / fp8 (autocast)
    g = torch.Generator().manual_seed(0)
    p = cfg.patch_size
    height, width = (cfg.sample_height, cfg.sample_width) if cfg.use_learned_positional_embeddings else (p, p)
    frames = cfg.patch_size_t or 1  # CogVideoX 1.5: one temporal patch
    hidden_states = torch.randn(1, frames, cfg.in_channels, height, width, generator=g).to(param.device, dtype)
    num_text = cfg.max_text_seq_length if _joint_positions(cfg) else 2
    prompt_embeds = torch.randn(1, num_text, cfg.text_embed_dim, generator=g).to(param.device, dtype)
    rotary = (rotary_positional_embeddings(transformer, frames, height, width, param.device)
              if cfg.use_rotary_positional_embeddings else None)
    ofs = hidden_states.new_full((1,), OFS) if cfg.ofs_embed_dim is not None else None
    return model(hidden_states=hidden_states, encoder_hidden_states=prompt_embeds,
                 timestep=torch.full((1,), 500, device=param.device), ofs=ofs, image_rotary_emb=rotary,
                 return_dict=False)[0].float().sum()


class CogVideoXFamily(ModelFamily):
    """CogVideoX 1.0 T2V and I2V, and 1.5 T2V: latents (B, 16, (F-1)/4+1, H/8, W/8), F = 1 or 8k+1, DiT patch 2 per
    latent frame (1.5: per pair of latent frames, the latents padded by one leading frame: `latent_padding`), so H and
    W multiples of 16; v-prediction on the model's DDIM schedule. An I2V transformer (`model.i2v`, condition `first`)
    takes the image latents (B, 16, F_lat, H_lat, W_lat) as `predict`'s `inpaint_latents`.

    An instance describes one model: its scheduler config (the objective's and sampler's DDIM schedule) and its
    transformer's `patch_size_t` (the latent frames `latent_shape` pads for). The registered family
    (`get_family("cogvideox")`) is CogVideoX-2b's (`SCHEDULER_CONFIG`, no `patch_size_t`: the tiny preset);
    `for_model(model_cfg)` (a folder's configs, no weights) and `for_transformer(transformer)` give the family of
    another model, and `predict` refuses a transformer of another schedule or layout in one line."""

    def __init__(self, scheduler_config: dict[str, Any] | None = None, patch_size_t: int | None = None):
        self.scheduler_config = dict(SCHEDULER_CONFIG if scheduler_config is None else scheduler_config)
        """The checked `CogVideoXDDIMScheduler` config (`check_scheduler_config`) of `objective`."""
        self.patch_size_t = patch_size_t
        """The transformer's `patch_size_t` (None: CogVideoX 1.0; 2: 1.5, whose latent frames `latent_shape` pads)."""
        schedule = SCHEDULE if self.scheduler_config == SCHEDULER_CONFIG else schedule_of(self.scheduler_config)
        self.objective = DDIM(schedule, "v_prediction", spacing="trailing", owner="the cogvideox family")
        """v-prediction on this model's schedule, DDIM steps on its trailing timesteps (`vidray.diffusion.objectives
        .DDIM`, as `CogVideoXDDIMScheduler`): a noise level sigma is the timestep round(sigma * 1000), the sampler's
        schedule ends at -1 / 1000 (the final alpha, a_prev = 1)."""

    def __repr__(self) -> str:
        return (f"CogVideoXFamily(snr_shift_scale={self.scheduler_config['snr_shift_scale']}, "
                f"patch_size_t={self.patch_size_t})")

    def for_model(self, model_cfg: ModelConfig) -> "CogVideoXFamily":
        """The family of the model `model_cfg` describes, from configs only (no weights): a pretrained folder's
        scheduler config (`folder_scheduler_config`) and transformer `patch_size_t`, the folder checked first
        (`_check_folder`: scheduler, transformer and VAE layout; one-line errors naming the folder); the tiny preset's
        CogVideoX-2b `SCHEDULER_CONFIG` and no `patch_size_t`. `self` when that is this family's model."""
        folder = pretrained_folder(model_cfg, "cogvideox")
        if folder is None:
            return self._for(SCHEDULER_CONFIG, None)
        folder = _check_folder(folder)
        config = CogVideoXTransformer3DModel.load_config(folder, subfolder="transformer", local_files_only=True)
        return self._for(folder_scheduler_config(folder), config.get("patch_size_t"))

    def for_transformer(self, transformer: torch.nn.Module) -> "CogVideoXFamily":
        """The family of the model `transformer` (maybe DDP-wrapped) is: the scheduler config the family built or
        loaded it with (`scheduler_config_of`; this family's for a transformer made elsewhere) and its
        `patch_size_t`. `self` when that is this family's model."""
        return self._for(scheduler_config_of(transformer, self.scheduler_config),
                         unwrapped(transformer).config.patch_size_t)

    def _for(self, scheduler_config: dict[str, Any], patch_size_t: int | None) -> "CogVideoXFamily":
        same = (dict(scheduler_config), patch_size_t) == (self.scheduler_config, self.patch_size_t)
        return self if same else CogVideoXFamily(scheduler_config, patch_size_t)

    name = "cogvideox"
    latent_channels = LATENT_CHANNELS
    example_bucket = (9, 32, 32)

    # 2. Modules.

    def check_trainable(self, model_cfg: ModelConfig) -> None:
        """What `vidray train` checks on the driver before anything is reserved: `model.i2v.condition` is `first`,
        and a pretrained folder's configs (no weights read) are ones the family runs (`_check_folder`: its scheduler,
        `check_scheduler_config`; its transformer and VAE layout, 1.0 or 1.5; its task against `model.i2v`). Raises
        ValueError in one line naming the folder, the key and the fix."""
        _check_condition(model_cfg)
        folder = pretrained_folder(model_cfg, "cogvideox")
        if folder is not None:
            _check_folder(folder, model_cfg)

    def load_condition_models(self, model_cfg: ModelConfig, *, seed: int, text: bool = True, image: bool = True,
                              meta: bool = False) -> ConditionModels:
        """The frozen T5 text encoder and tokenizer (CogVideoX takes no image embeddings): a folder's (checked by
        `_check_folder`; transformer and VAE not read), or the tiny preset's drawn under `seed` as in `build_tiny`."""
        _check_condition(model_cfg)
        if not text:
            return ConditionModels(text_encoder=None, tokenizer=None)
        folder = pretrained_folder(model_cfg, "cogvideox")
        if folder is None:
            text_encoder, tokenizer = build_t5_text_encoder(model_cfg.text_encoder, variant="t5", seed=seed)
            return ConditionModels(on_meta(text_encoder) if meta else text_encoder, tokenizer)
        _check_folder(folder, model_cfg)
        skip = dict(text_encoder=None) if meta else {}
        pipe = _pipeline_class(folder).from_pretrained(folder, transformer=None, vae=None, **skip,
                                                       local_files_only=True)
        text_encoder = meta_component(folder, "text_encoder")[0] if meta else pipe.text_encoder
        return ConditionModels(text_encoder.eval().requires_grad_(False), pipe.tokenizer)

    def load_latent_models(self, model_cfg: ModelConfig, *, seed: int, trainable: bool = False,
                           meta: bool = False) -> LatentModels:
        """The frozen VAE: `model.vae_path` (its layout checked against the model's transformer config:
        `_check_layout`), else a folder's `vae/` loaded by itself (T5 is not read), else the tiny preset's (drawn
        under `seed` after the transformer, as in `build_tiny`). The CogVideoX VAE does not train here:
        `trainable` raises NotImplementedError."""
        if trainable:
            raise NotImplementedError(f"the {self.name} family's VAE cannot be trained by vidray train-vae yet")
        _check_condition(model_cfg)
        folder = pretrained_folder(model_cfg, "cogvideox")
        if folder is not None:
            _check_folder(folder, model_cfg)
        if model_cfg.vae_path:
            if meta:
                vae, weights = meta_module(AutoencoderKLCogVideoX, model_cfg.vae_path)
                vae = vae.eval().requires_grad_(False)
            else:
                vae, weights = load_vae_folder(model_cfg.vae_path), None
            transformer_config = (dict(TINY_I2V_TRANSFORMER if model_cfg.i2v is not None else TINY_TRANSFORMER)
                                  if folder is None else CogVideoXTransformer3DModel.load_config(
                                      folder, subfolder="transformer", local_files_only=True))
            _check_layout(transformer_config, vae.config, f"model.vae_path {model_cfg.vae_path!r}")
            return LatentModels(vae, weights)
        if folder is None:
            with torch.random.fork_rng(devices=[]):
                torch.manual_seed(seed)
                _tiny_transformer(model_cfg.text_encoder, i2v=model_cfg.i2v is not None)  # drawn first in build_tiny
                vae = AutoencoderKLCogVideoX(**TINY_VAE)
            return LatentModels((on_meta(vae) if meta else vae).eval().requires_grad_(False))
        vae, weights = folder_component(AutoencoderKLCogVideoX, folder, "vae", meta=meta)
        _check_vae(vae, str(folder))
        return LatentModels(vae.eval().requires_grad_(False), weights)

    def load_diffusion_models(self, model_cfg: ModelConfig, *, seed: int, expert: str | None = None,
                              meta: bool = False) -> DiffusionModels:
        """The transformer, without the VAE or the text encoder: the tiny preset drawn first under `seed` (as in
        `build_tiny`); a folder's `transformer/` alone (its task checked against `model.i2v`), carrying the model's
        scheduler config (`scheduler_config_of`). `meta`: from its config (a folder's `transformer/config.json`,
        with that folder). CogVideoX has no experts: `expert` raises ValueError (`pick_expert`)."""
        if expert is not None:
            pick_expert(None, expert)
        _check_condition(model_cfg)
        folder = pretrained_folder(model_cfg, "cogvideox")
        if folder is not None:
            _check_folder(folder, model_cfg)
            if meta:
                transformer, weights = meta_component(folder, "transformer")
            else:
                transformer, weights = CogVideoXTransformer3DModel.from_pretrained(
                    folder, subfolder="transformer", local_files_only=True), None
            _attach_scheduler_config(transformer, folder_scheduler_config(folder))
            return DiffusionModels(transformer.train(), weights)
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(seed)
            transformer = _tiny_transformer(model_cfg.text_encoder, i2v=model_cfg.i2v is not None)
        transformer = on_meta(transformer) if meta else transformer
        _attach_scheduler_config(transformer, SCHEDULER_CONFIG)
        return DiffusionModels(transformer.train())

    # 3. Encoding, the transformer call, decoding.

    def encode_video(self, vae: AutoencoderKLCogVideoX, video: torch.Tensor) -> torch.Tensor:
        """`vidray.models.vae.encode_video`: posterior mode * vae.config.scaling_factor, (B, 16, (F-1)//4+1, H//8,
        W//8) float32 (CogVideoX-2b's VAE: scaling_factor 0.7; the pipeline's decode divides by it). CogVideoX 1.5's
        VAE (`pads_latent_frames`): then padded to an even frame count by copies of the first latent frame in front
        (`latent_padding`, one for an 8k+1 clip), as the 1.5 finetuning scripts' `compute_loss` pads before drawing
        the noise: (B, 16, (F-1)//4+2, H//8, W//8)."""
        latents = encode_video(vae, video)
        if not pads_latent_frames(vae):
            return latents
        padding = latent_padding(latents.shape[2], PATCH_SIZE_T_15)
        return torch.cat([latents[:, :, :1].repeat(1, 1, padding, 1, 1), latents], dim=2)

    def decode_latents(self, vae: AutoencoderKLCogVideoX, latents: torch.Tensor) -> torch.Tensor:
        """`vidray.models.vae.decode_latents`: vae.decode(latents / scaling_factor), as
        `CogVideoXPipeline.decode_latents` (after its (B, F, C, H, W) -> (B, C, F, H, W) permute), clamped to
        [-1, 1], (B, 3, F, H, W) float32. CogVideoX 1.5's VAE (`pads_latent_frames`) takes the padded latents
        (an even count, `latent_shape`) and drops the leading padding frame first, as the pipeline's
        `latents[:, additional_frames:]` before `decode_latents`; an odd count is decoded as it is."""
        if pads_latent_frames(vae) and latents.shape[2] % PATCH_SIZE_T_15 == 0:
            latents = latents[:, :, 1:]
        return decode_latents(vae, latents)

    def encode_prompt(self, text_encoder, tokenizer, prompts: list[str], *, max_sequence_length: int,
                      device: torch.device | str | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        """See module-level `encode_prompts` (CogVideoXPipeline._get_t5_prompt_embeds)."""
        return encode_prompts(text_encoder, tokenizer, prompts, max_sequence_length=max_sequence_length,
                              device=device)

    def predict(
        self,
        transformer: CogVideoXTransformer3DModel,
        noisy_latents: torch.Tensor,
        timesteps: torch.Tensor,
        prompt_embeds: torch.Tensor,
        prompt_attention_mask: torch.Tensor,
        *,
        inpaint_latents: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """noisy_latents (B, 16, F, H, W), timesteps (B,) integer-valued in 0..999, prompt_embeds (B, L, D),
        prompt_attention_mask (B, L) -> model_pred (B, 16, F, H, W), the v-prediction.

        An image-to-video transformer (`takes_image_latents`) needs `inpaint_latents`: here the image latents
        (B, 16, F, H, W) (`condition`: a clip's, an image's, or the empty one), concatenated after
        the noisy latents along channels as CogVideoXImageToVideoPipeline does (`ofs` None for CogVideoX 1.0, `OFS`
        for 1.5, whose transformer has `ofs_embed_dim`); a text-to-video one takes none. With learned positional
        embeddings (CogVideoX-5b-I2V) the latents must be
        `sample_height` x `sample_width`, as the transformer's patch embedding requires.

        Called exactly like CogVideoXPipeline's denoising loop: `hidden_states` = noisy_latents permuted to
        (B, F, C, H, W), `encoder_hidden_states` in its dtype, `timestep` as int64 (the scheduler's timesteps),
        `image_rotary_emb` from `rotary_positional_embeddings` when the transformer uses rotary positions (else
        None), `return_dict=False`; the output is permuted back. prompt_attention_mask is checked for shape but not
        passed (the transformer has no text mask). Raises ValueError for shapes that do not line up, without
        rotary positions (CogVideoX-2b) a prompt length other than `max_text_seq_length`, or a transformer whose
        scheduler config or `patch_size_t` is not the family's (`for_model`, `for_transformer`: another model's).
        """
        if noisy_latents.ndim != 5:
            raise ValueError(f"noisy_latents must be (B, C, F, H, W), got {tuple(noisy_latents.shape)}")
        batch_size, _, num_frames, height, width = noisy_latents.shape
        if timesteps.shape != (batch_size,):
            raise ValueError(f"timesteps must have shape ({batch_size},), got {tuple(timesteps.shape)}")
        if prompt_embeds.ndim != 3 or prompt_embeds.shape[0] != batch_size:
            raise ValueError(f"prompt_embeds must be ({batch_size}, L, D), got {tuple(prompt_embeds.shape)}")
        if prompt_attention_mask.shape != prompt_embeds.shape[:2]:
            raise ValueError(f"prompt_attention_mask {tuple(prompt_attention_mask.shape)} must match prompt_embeds' "
                             f"(B, L) {tuple(prompt_embeds.shape[:2])}")
        inner = unwrapped(transformer)  # the training loop passes the DDP-wrapped model
        cfg = inner.config
        _check_bound(inner, self.scheduler_config, self.patch_size_t)
        if cfg.patch_size_t is not None and num_frames % cfg.patch_size_t:
            raise ValueError(f"this CogVideoX 1.5 transformer (patch_size_t {cfg.patch_size_t}) takes latents padded "
                             f"to a multiple of {cfg.patch_size_t} frames, got {num_frames}: pad them as "
                             "family.encode_video and family.latent_shape do (one leading frame)")
        hidden_states = noisy_latents
        if takes_image_latents(inner):
            if inpaint_latents is None:
                raise ValueError(f"the transformer is a CogVideoX image-to-video model: pass inpaint_latents, the "
                                 f"image latents ({batch_size}, {LATENT_CHANNELS}, F, H, W) (family.condition without "
                                 "an image for text-to-video)")
            if inpaint_latents.shape != (batch_size, LATENT_CHANNELS, *noisy_latents.shape[2:]):
                raise ValueError(f"inpaint_latents must be ({batch_size}, {LATENT_CHANNELS}, "
                                 f"{', '.join(map(str, noisy_latents.shape[2:]))}), got {tuple(inpaint_latents.shape)}")
            hidden_states = torch.cat([noisy_latents, inpaint_latents.to(noisy_latents.dtype)], dim=1)
        elif inpaint_latents is not None:
            raise ValueError("inpaint_latents given to a CogVideoX text-to-video transformer: it takes no image")
        if cfg.use_learned_positional_embeddings and (height, width) != (cfg.sample_height, cfg.sample_width):
            raise ValueError(f"this CogVideoX transformer has learned positional embeddings (CogVideoX-5b-I2V) for "
                             f"{cfg.sample_height * SPATIAL_COMPRESSION_RATIO}x"
                             f"{cfg.sample_width * SPATIAL_COMPRESSION_RATIO} videos only, got "
                             f"{height * SPATIAL_COMPRESSION_RATIO}x{width * SPATIAL_COMPRESSION_RATIO}: set "
                             "data.buckets to that height and width")
        rotary = (rotary_positional_embeddings(inner, num_frames, height, width, noisy_latents.device)
                  if cfg.use_rotary_positional_embeddings else None)
        if _joint_positions(cfg) and prompt_embeds.shape[1] != cfg.max_text_seq_length:
            kind = "learned positions" if cfg.use_learned_positional_embeddings else "sincos positions, no rotary"
            raise ValueError(f"this CogVideoX transformer ({kind}) takes exactly "
                             f"max_text_seq_length={cfg.max_text_seq_length} text tokens, got "
                             f"{prompt_embeds.shape[1]}: set model.max_sequence_length: {cfg.max_text_seq_length}")
        ofs = noisy_latents.new_full((1,), OFS) if cfg.ofs_embed_dim is not None else None  # 1.5 I2V
        model_pred = transformer(
            hidden_states=hidden_states.permute(0, 2, 1, 3, 4),  # (B, C, F, H, W) -> (B, F, C, H, W)
            encoder_hidden_states=prompt_embeds.to(dtype=noisy_latents.dtype),
            timestep=timesteps.round().to(torch.int64),
            ofs=ofs,
            image_rotary_emb=rotary,
            return_dict=False,
        )[0]
        return model_pred.permute(0, 2, 1, 3, 4)  # (B, F, C, H, W) -> (B, C, F, H, W)

    # 4. Image-to-video (CogVideoXImageToVideoPipeline).

    def image_inputs(self, info) -> int:
        """1 for an image-to-video model (`model.i2v` set, or a stock `CogVideoXImageToVideoPipeline` folder: a first
        frame only), else 0."""
        return 1 if info.image_to_video else 0

    def condition(self, model, *, latent_shape=None, encoders=None, clip=None, image=None, last_image=None,
                  bucket=None, generator=None, device=None) -> ImageCondition | None:
        """`ModelFamily.condition` for an image-to-video model (`takes_image_latents`: `in_channels` 32, not 16):
        image latents (B, 16, F_lat, H_lat, W_lat) float32, None for a text-to-video model.

        A training clip's: its own first frame encoded alone (`encode_image_latents`, the posterior mode:
        deterministic, so it is cached), zeros over the other latent frames (`image_condition`). CogVideoX 1.5
        (`pads_latent_frames`): F_lat counts the padding frame too, the image in frame 0 (as the 1.5 I2V finetuning
        scripts and the pipeline, whose `image_latents[:, :F % p_t]` copy is empty for the even padded count, lay
        them out). Raises ValueError for a `model.i2v.condition` other than `first` (the stock pipeline takes one
        image).

        An image's: CogVideoXImageToVideoPipeline's steps 5 (`preprocess_image`) and `prepare_latents`
        (`encode_image_latents`: the posterior sampled from `generator`, the sampler's generator seeded with the
        request's seed, drawn before anything else from it as the pipeline draws it before its noise; the mode
        without one; then `image_condition`). Raises UserError (a ValueError) for a last image: the stock pipeline
        takes none.

        The empty one: zeros (module-level `empty_condition`)."""
        if not takes_image(model, takes_image_latents):
            return None
        vae = encoders.vae if encoders is not None else None
        if clip is not None:
            condition = clip_condition(model)
            if condition != "first":
                raise ValueError(f"model.i2v.condition is {condition}, but CogVideoX image-to-video is conditioned on "
                                 "the first frame only: set model.i2v.condition: first")
            if clip.ndim != 5 or clip.shape[1] != 3:
                raise ValueError(f"video must be (B, 3, F, H, W), got {tuple(clip.shape)}")
            num_latent_frames = (clip.shape[2] - 1) // TEMPORAL_COMPRESSION_RATIO + 1
            if pads_latent_frames(vae):  # CogVideoX 1.5: as many frames as the padded latents (`encode_video`)
                num_latent_frames += latent_padding(num_latent_frames, PATCH_SIZE_T_15)
            latents = image_condition(encode_image_latents(vae, clip[:, :, 0]), num_latent_frames)
            return ImageCondition(latents.to(device) if device is not None else latents)
        if image is not None:
            if last_image is not None:
                raise UserError("CogVideoX image-to-video takes a first frame only (CogVideoXImageToVideoPipeline has "
                                "no last image): drop --last-image")
            bucket = Bucket(*bucket)
            _, _, num_latent_frames, _, _ = self.latent_shape(bucket, 1)
            image_latents = encode_image_latents(vae, preprocess_image(image, bucket), generator=generator)
            return ImageCondition(over_batch(image_condition(image_latents, num_latent_frames), latent_shape, device))
        return ImageCondition(empty_condition(latent_shape, device))

    # 5. Shapes, probes, export.

    def latent_shape(self, bucket: Bucket, batch_size: int) -> tuple[int, int, int, int, int]:
        """(B, 16, (F-1)//4 + 1, H//8, W//8); e.g. Bucket(9, 64, 64), B=2 -> (2, 16, 3, 8, 8). For a CogVideoX 1.5
        model's family (`for_model`, `for_transformer`: `patch_size_t` 2) the latent frames are padded to its multiple
        (`latent_padding`): Bucket(9, 64, 64) -> (2, 16, 4, 8, 8), the shape `CogVideoXPipeline` draws its noise in.

        Raises ValueError unless H, W are multiples of 16 (8x VAE, patch 2) and F is 1 or 8k+1 (the 1.0 transformer,
        `patch_size_t` null, takes any latent frame count and 1.5 an even one after padding; the VAE decodes only
        odd counts back to F frames)."""
        validate_bucket(bucket, spatial_multiple=self.spatial_multiple, temporal_compression=FRAME_STEP)
        if batch_size < 1:
            raise ValueError(f"batch_size must be >= 1, got {batch_size}")
        num_frames, height, width = bucket
        num_latent_frames = (num_frames - 1) // TEMPORAL_COMPRESSION_RATIO + 1
        num_latent_frames += latent_padding(num_latent_frames, self.patch_size_t)
        return (batch_size, LATENT_CHANNELS, num_latent_frames, height // SPATIAL_COMPRESSION_RATIO,
                width // SPATIAL_COMPRESSION_RATIO)

    def no_grad_parameter_names(self, transformer: CogVideoXTransformer3DModel) -> list[str]:
        """Trainable parameters without a gradient from `probe_loss`
        (`vidray.models.folders.unused_parameter_names`)."""
        return unused_parameter_names(transformer, probe_loss)

    def prompt_embeds_dim(self, transformer: CogVideoXTransformer3DModel) -> int:
        """`transformer.config.text_embed_dim` (4096 for T5-XXL; the text encoder's hidden size here)."""
        return int(transformer.config.text_embed_dim)

    def probe_loss(self, model: torch.nn.Module, transformer: CogVideoXTransformer3DModel) -> torch.Tensor:
        """See module-level `probe_loss`."""
        return probe_loss(model, transformer)

    def save_pipeline(self, components: Components, out_dir: str | Path, flow: FlowConfig) -> Path:
        """See module-level `save_pipeline` (this family's scheduler config for a transformer that carries none)."""
        return save_pipeline(components, out_dir, flow, scheduler_config=self.scheduler_config)
