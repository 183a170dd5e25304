"""Wan family: diffusers `WanTransformer3DModel` + `AutoencoderKLWan` + a UMT5 text encoder. Wan 2.1 text-to-video
is exported as a stock `diffusers.WanPipeline` folder; image-to-video (`model.i2v`) as a `WanImageToVideoPipeline`;
Wan 2.2 A14B's two experts (`model.experts`) as either, with `transformer_2` and `boundary_ratio`.

Everything here mirrors diffusers/pipelines/wan/pipeline_wan.py (diffusers 0.42.1), so a transformer trained with
`WanFamily.predict` behaves the same inside the stock pipeline:
- prompts (`encode_prompts`, as `WanPipeline._get_t5_prompt_embeds`): `prompt_clean` (ftfy when installed, HTML
  unescape, whitespace), right-padded tokens with special tokens, the text encoder's `last_hidden_state`, every
  position past a prompt's own length set to zero; the mask is returned but never reaches the transformer;
- transformer call: `transformer(hidden_states=noisy_latents, timestep=timesteps, encoder_hidden_states=
  prompt_embeds, return_dict=False)[0]`, timesteps = sigmas * num_train_timesteps as given (the pipeline passes the
  scheduler's float32 timesteps, uncast, with latents in the transformer's dtype);
- latents: per-channel normalised, (mode - latents_mean) / latents_std from the VAE config; decoded as
  `vae.decode(latents / (1 / latents_std) + latents_mean)` (`vidray.models.vae`);
- sampling: flow matching with the job's shift. The stock Wan 2.1 folders carry `UniPCMultistepScheduler(
  flow_shift=...)`; vidray's sampler is Euler, so the export carries `FlowMatchEulerDiscreteScheduler(shift=...)`,
  and the stock pipeline loaded from it takes the same steps as `vidray.inference.sampler`.

Text encoders (`model.text_encoder`, offline): `tiny_random` is a random 2-layer `UMT5EncoderModel` (d_model 64)
over MiniLM's tokenizer (the one tokenizer shipped offline here: umT5's sentencepiece vocabulary is not); `minilm`
is the real MiniLM-L6 BERT (hidden 384), whose `last_hidden_state` the stock pipeline takes the same way. A real
Wan folder (`init: pretrained`) brings its own umT5-XXL and tokenizer.

Image-to-video (`model.i2v`): the condition of diffusers/pipelines/wan/pipeline_wan_i2v.py's
`WanImageToVideoPipeline.prepare_latents` (Wan 2.2 A14B's layout, no CLIP image embeddings): the given frames (the
first, or the first and the last) over zero frames, encoded by the VAE (mode) and normalised per channel, after a
4-channel mask of the given frames (the first pixel frame repeated over the VAE's 4x temporal compression): 20
condition channels, concatenated to the 16 noisy ones (transformer `in_channels` 36). It travels as the family's
`inpaint_latents`. Exported as a stock `WanImageToVideoPipeline` with no image encoder.

Wan 2.1 I2V (`model.i2v.image_encoder: true`): the same latent condition plus the CLIP image embeddings of the given
frames, as `WanImageToVideoPipeline.encode_image`: `image_processor(images=...)` (`CLIPImageProcessor`: resize,
centre crop, normalise), then `image_encoder(..., output_hidden_states=True).hidden_states[-2]` of the
`CLIPVisionModel`, (1, 257, image_dim) per image, passed to the transformer as `encoder_hidden_states_image` (its
`image_dim` / `added_kv_proj_dim` image cross-attention). For the first and the last frame (Wan 2.1 FLF2V, the
transformer's `pos_embed_seq_len` = 2 x 257) the two images' tokens are concatenated, (1, 514, image_dim), what the
transformer's `view(-1, 2 * seq_len, D)` makes of the pipeline's (2, 257, D). They travel beside the latent
condition as `image_embeds` (encode stage, latent cache, batch, `predict`); a sample without image (condition
dropout, text-only generation) gets zeros for both. Exported with `image_encoder/` and `image_processor/`.

Two experts (Wan 2.2 A14B: `transformer` for high noise, `transformer_2` below `boundary_ratio`): `model.experts`
builds two tiny transformers, or loads a folder with both, as one `vidray.models.experts.TwoExperts`, which routes
each sample by its timestep as the stock pipelines do; so training (each sample trains the expert of its timestep),
`vidray generate`, validation and serving use it unchanged, and it is exported back with both and the ratio.

Not here yet: one worker group per expert (every worker holds both).
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any, Literal

import torch
import numpy as np
from diffusers import (AutoencoderKLWan, FlowMatchEulerDiscreteScheduler, WanImageToVideoPipeline, WanPipeline,
                       WanTransformer3DModel)
from diffusers.models.transformers.transformer_wan import WanRotaryPosEmbed
from diffusers.pipelines.wan.pipeline_wan import prompt_clean
from diffusers.video_processor import VideoProcessor
from PIL import Image
from transformers import CLIPImageProcessor, CLIPVisionConfig, CLIPVisionModel

from vidray.cards import get_card
from vidray.models.offload import execution_device
from vidray.models.storage import input_dtype
from vidray.config import WAN_CLIP_TEXT_TOKENS, FlowConfig, ModelConfig
from vidray.buckets import Bucket, validate_bucket
from vidray.errors import UserError
from vidray.models.base import (Components, ConditionModels, DiffusionModels, LatentModels, ModelFamily,
                                on_meta)
from vidray.models.conditioning import ImageCondition, clip_condition, condition_frames, over_batch, takes_image
from vidray.models.experts import EXPERT_ATTRIBUTES, TwoExperts, check_boundary_ratio, check_expert, pick_expert
from vidray.models.folders import (folder_component, meta_component, meta_module, pretrained_folder,
                                   require_pipeline_folder, unused_parameter_names, unwrapped, write_pipeline_folder)
from vidray.models.text_encoder import TINY_T5_ENCODER, build_t5_text_encoder, t5_text_width
from vidray.models.vae import decode_latents, encode_video

__all__ = [
    "IMAGE_TOKENS",
    "TINY_I2V_TRANSFORMER",
    "TINY_IMAGE_ENCODER",
    "TINY_IMAGE_PROCESSOR",
    "TINY_TEXT_ENCODER",
    "TINY_TRANSFORMER",
    "TINY_VAE",
    "WanFamily",
    "build_text_encoder",
    "build_tiny",
    "build_tiny_image_encoder",
    "clip_frames",
    "condition_mask",
    "empty_condition",
    "empty_image_embeds",
    "encode_condition",
    "encode_image_embeds",
    "encode_prompts",
    "load_transformer",
    "load_vae_folder",
    "probe_loss",
    "save_pipeline",
    "takes_condition",
    "takes_image_embeds",
    "tiny_clip_transformer",
]

LATENT_CHANNELS = 16
"""Wan 2.1 VAE `z_dim`; the tiny preset uses the same so shapes do not depend on the preset."""
SPATIAL_COMPRESSION_RATIO = 8
TEMPORAL_COMPRESSION_RATIO = get_card("wan").bucket_rules.temporal_compression
PATCH_SIZE = (1, 2, 2)
"""WanTransformer3DModel patch (frames, height, width)."""
assert SPATIAL_COMPRESSION_RATIO * PATCH_SIZE[1] == get_card("wan").bucket_rules.spatial_multiple
PIPELINE_COMPONENTS = ("transformer", "vae", "text_encoder", "tokenizer", "scheduler")
"""The subfolders of a Wan T2V (`WanPipeline`) or I2V (`WanImageToVideoPipeline`) diffusers folder that vidray
loads; a Wan 2.1 I2V folder also `CLIP_COMPONENTS`."""
CLIP_COMPONENTS = ("image_encoder", "image_processor")
"""The subfolders of a Wan 2.1 I2V folder (transformer `image_dim` set): its `CLIPVisionModel` and
`CLIPImageProcessor`."""
IMAGE_TOKENS = 257
"""Tokens of one image's CLIP embeddings: Wan 2.1's CLIP ViT-H/14 at 224 px, 16 x 16 patches + the class token (the
tiny preset's 32 px / patch 2 gives the same count)."""
CONDITION_CHANNELS = TEMPORAL_COMPRESSION_RATIO + LATENT_CHANNELS
"""Channels of an I2V condition: the mask over one latent frame's 4 pixel frames, then the condition latents."""
I2V_IN_CHANNELS = LATENT_CHANNELS + CONDITION_CHANNELS
"""`in_channels` of an image-to-video transformer (36, Wan2.1-I2V and Wan2.2-I2V-A14B): noisy latents + condition."""

TINY_TRANSFORMER = dict(
    patch_size=PATCH_SIZE,
    num_attention_heads=2,
    attention_head_dim=16,  # RoPE splits it over (t, h, w) as 8 + 4 + 4
    in_channels=LATENT_CHANNELS,
    out_channels=LATENT_CHANNELS,
    freq_dim=32,
    ffn_dim=64,
    num_layers=2,
    cross_attn_norm=True,
    qk_norm="rms_norm_across_heads",
    eps=1e-6,
)
"""Tiny DiT (inner dim 32, 2 blocks; ~42 k params with text_dim 64), the Wan 2.1 block layout (cross-attention norm,
RMS q/k norm across heads). `text_dim` is set from the text encoder's hidden size."""

TINY_I2V_TRANSFORMER = {**TINY_TRANSFORMER, "in_channels": I2V_IN_CHANNELS}
"""The tiny preset's image-to-video transformer (`model.i2v`): TINY_TRANSFORMER taking the 20 condition channels
too, without CLIP image embeddings (`image_dim` None, Wan 2.2 A14B's layout)."""

TINY_IMAGE_ENCODER = dict(
    hidden_size=32,
    intermediate_size=64,
    projection_dim=32,
    num_hidden_layers=2,
    num_attention_heads=2,
    image_size=32,
    patch_size=2,
)
"""`transformers.CLIPVisionConfig` of the tiny preset's CLIP vision tower (Wan 2.1 I2V, `model.i2v.image_encoder`):
(32 / 2)^2 + 1 = IMAGE_TOKENS tokens of width 32 (the transformer's `image_dim`)."""

TINY_IMAGE_PROCESSOR = dict(size={"shortest_edge": 32}, crop_size={"height": 32, "width": 32})
"""`CLIPImageProcessor` of the tiny preset (its other settings the class defaults: bicubic resize, centre crop,
rescale, OpenAI CLIP mean/std), sized for TINY_IMAGE_ENCODER's 32 px."""

TINY_VAE = dict(
    base_dim=4,
    z_dim=LATENT_CHANNELS,
    dim_mult=[1, 1, 1, 1],
    num_res_blocks=1,
    temperal_downsample=[False, True, True],  # diffusers' spelling; 4x temporal, 8x spatial like the real VAE
)
"""Tiny Wan VAE (~22 k params), same compression ratios, latent channels and default `latents_mean` /
`latents_std` (the real Wan 2.1 VAE's) as Wan 2.1."""

TINY_TEXT_ENCODER = TINY_T5_ENCODER
"""`transformers.UMT5Config` of the `tiny_random` text encoder (`vidray.models.text_encoder.TINY_T5_ENCODER`;
vocab_size and pad_token_id from the tokenizer)."""

TextEncoderKind = Literal["minilm", "tiny_random"]


def text_dim(kind: TextEncoderKind) -> int:
    """D of the prompt_embeds (B, L, D) that `build_text_encoder(kind)` gives (the transformer's `text_dim`), from
    configs only (`vidray.models.text_encoder.t5_text_width`). Raises ValueError for an unknown `kind`."""
    return t5_text_width(kind)


def build_text_encoder(kind: TextEncoderKind, *, seed: int = 0) -> tuple[torch.nn.Module, Any]:
    """A frozen text encoder and MiniLM's tokenizer, offline: `tiny_random` a 2-layer `UMT5EncoderModel` under
    `seed`, `minilm` the real MiniLM-L6 (`vidray.models.text_encoder.build_t5_text_encoder`, variant umt5)."""
    return build_t5_text_encoder(kind, variant="umt5", seed=seed)


@torch.no_grad()
def encode_prompts(text_encoder: torch.nn.Module, tokenizer: Any, prompts: list[str], *, max_sequence_length: int,
                   device: torch.device | str | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """B prompts -> prompt_embeds (B, L, D) float32 and prompt_attention_mask (B, L) bool, L = max_sequence_length,
    on `device` (default: the text encoder's).

    As `WanPipeline._get_t5_prompt_embeds` (diffusers/pipelines/wan/pipeline_wan.py): `prompt_clean` each prompt,
    tokenize with padding to `max_sequence_length`, truncation and special tokens, take `last_hidden_state` of
    `text_encoder(input_ids, attention_mask)`, and zero every position at or past the prompt's length
    `attention_mask.sum()` (the pipeline slices and pads with zeros: the same values).
    """
    if isinstance(prompts, str) or not prompts:
        raise ValueError(f"prompts must be a non-empty list of strings, got {prompts!r}")
    if max_sequence_length < 1:
        raise ValueError(f"max_sequence_length must be >= 1, got {max_sequence_length}")
    text_inputs = tokenizer(
        [prompt_clean(prompt) for prompt in prompts],
        padding="max_length",
        max_length=max_sequence_length,
        truncation=True,
        add_special_tokens=True,
        return_attention_mask=True,
        return_tensors="pt",
    )
    mask = text_inputs.attention_mask  # (B, L)
    seq_lens = mask.gt(0).sum(dim=1).long()  # (B,)
    te_device = execution_device(text_encoder)
    prompt_embeds = text_encoder(text_inputs.input_ids.to(te_device), mask.to(te_device)).last_hidden_state
    keep = torch.arange(max_sequence_length, device=te_device)[None, :] < seq_lens.to(te_device)[:, None]  # (B, L)
    prompt_embeds = torch.where(keep[..., None], prompt_embeds, torch.zeros((), dtype=prompt_embeds.dtype,
                                                                            device=te_device))
    device = device if device is not None else te_device
    return prompt_embeds.to(device=device, dtype=torch.float32), mask.to(device=device).bool()


def _check_vae(vae: AutoencoderKLWan, where: str) -> None:
    config = vae.config
    found = (config.z_dim, config.scale_factor_spatial, config.scale_factor_temporal,
             len(config.latents_mean or ()), len(config.latents_std or ()))
    expected = (LATENT_CHANNELS, SPATIAL_COMPRESSION_RATIO, TEMPORAL_COMPRESSION_RATIO, LATENT_CHANNELS,
                LATENT_CHANNELS)
    if found != expected:
        raise ValueError(f"{where}: vae (z_dim, scale_factor_spatial, scale_factor_temporal, len(latents_mean), "
                         f"len(latents_std)) = {found}, but the wan family expects {expected}")


def takes_condition(transformer: WanTransformer3DModel) -> bool:
    """Whether `transformer` is an image-to-video model: `in_channels` (36) differs from the latent channels (16),
    as `WanImageToVideoPipeline` feeds it `cat([latents, condition])`. `transformer` may be DDP-wrapped."""
    return int(unwrapped(transformer).config.in_channels) != LATENT_CHANNELS


def takes_image_embeds(transformer: WanTransformer3DModel) -> bool:
    """Whether `transformer` takes CLIP image embeddings (Wan 2.1 I2V: `image_dim` set), passed as
    `encoder_hidden_states_image`. `transformer` may be DDP-wrapped."""
    return unwrapped(transformer).config.image_dim is not None


def image_tokens(transformer: WanTransformer3DModel) -> int:
    """T of the image embeddings (B, T, image_dim) `transformer` takes: `pos_embed_seq_len` (2 x IMAGE_TOKENS, Wan
    2.1 FLF2V: the first and the last frame) when set, else IMAGE_TOKENS (one image)."""
    return int(unwrapped(transformer).config.pos_embed_seq_len or IMAGE_TOKENS)


def _check_transformer(transformer: WanTransformer3DModel, where: str) -> None:
    """Raise ValueError for a transformer whose layout the family cannot drive: not 16 (T2V) or 36 (I2V) input
    channels with patch (1, 2, 2), CLIP image embeddings (`image_dim`) for a text-to-video one or without the
    image cross-attention (`added_kv_proj_dim`), or a `pos_embed_seq_len` that is not one or two images' tokens."""
    config = transformer.config
    found = (config.in_channels, tuple(config.patch_size))
    if found not in ((LATENT_CHANNELS, PATCH_SIZE), (I2V_IN_CHANNELS, PATCH_SIZE)):
        raise ValueError(f"{where}: transformer (in_channels, patch_size) = {found}, but the wan family expects "
                         f"{(LATENT_CHANNELS, PATCH_SIZE)} (text-to-video) or {(I2V_IN_CHANNELS, PATCH_SIZE)} "
                         "(image-to-video)")
    if config.image_dim is not None and (config.in_channels != I2V_IN_CHANNELS or config.added_kv_proj_dim is None
                                         or config.pos_embed_seq_len not in (None, 2 * IMAGE_TOKENS)):
        raise ValueError(f"{where}: transformer takes CLIP image embeddings (image_dim {config.image_dim}) but has "
                         f"in_channels {config.in_channels}, added_kv_proj_dim {config.added_kv_proj_dim}, "
                         f"pos_embed_seq_len {config.pos_embed_seq_len}; a Wan 2.1 I2V transformer has in_channels "
                         f"{I2V_IN_CHANNELS}, added_kv_proj_dim set and pos_embed_seq_len null or {2 * IMAGE_TOKENS}")


def _check_image_encoder(image_encoder: CLIPVisionModel, image_dim: int | None, where: str) -> None:
    """Raise ValueError unless the CLIP vision tower gives what a transformer of `image_dim` (its config's) takes:
    hidden_size == image_dim and IMAGE_TOKENS tokens per image ((image_size / patch_size)^2 + 1)."""
    config = image_encoder.config
    tokens = (config.image_size // config.patch_size) ** 2 + 1
    if (config.hidden_size, tokens) != (image_dim, IMAGE_TOKENS):
        raise ValueError(f"{where}: image_encoder gives {tokens} tokens of width {config.hidden_size} per image, but "
                         f"the transformer takes {IMAGE_TOKENS} of width {image_dim} (image_dim); give the image "
                         "encoder the transformer was trained with")


def _uses_clip(model_cfg: ModelConfig) -> bool:
    """`model.i2v.image_encoder`: a Wan 2.1 I2V model (CLIP image embeddings)."""
    return model_cfg.i2v is not None and model_cfg.i2v.image_encoder


def _check_task(transformer: WanTransformer3DModel, model_cfg: ModelConfig, where: str) -> None:
    """Raise ValueError when the transformer's task is not the config's: an image-to-video transformer for a
    text-to-video config (`model.i2v` null), or the reverse."""
    if takes_condition(transformer) and model_cfg.i2v is None:
        raise ValueError(f"{where} holds an image-to-video transformer (in_channels {I2V_IN_CHANNELS}) but model.i2v "
                         "is null: set model.i2v (e.g. {condition: first}) or give a WanPipeline folder")
    if not takes_condition(transformer) and model_cfg.i2v is not None:
        raise ValueError(f"{where} holds a text-to-video transformer (in_channels {LATENT_CHANNELS}) but model.i2v "
                         f"is set: give a WanImageToVideoPipeline folder (in_channels {I2V_IN_CHANNELS}) or set "
                         "model.i2v to null")
    if takes_condition(transformer) and takes_image_embeds(transformer) != _uses_clip(model_cfg):
        found = ("takes CLIP image embeddings (Wan 2.1 I2V)" if takes_image_embeds(transformer)
                 else "takes no CLIP image embeddings (Wan 2.2 A14B's layout)")
        raise ValueError(f"{where} holds an image-to-video transformer that {found}: set model.i2v.image_encoder: "
                         f"{str(takes_image_embeds(transformer)).lower()}")


def _pipeline_folder(path: str | Path) -> tuple[Path, type]:
    """(`path`, its pipeline class): a complete `WanPipeline` or `WanImageToVideoPipeline` folder, as its
    model_index.json names it. Raises FileNotFoundError / ValueError as `require_pipeline_folder` (another
    family's folder, a missing component, a two-expert folder without `transformer_2/`), and ValueError for a
    transformer with CLIP image embeddings (`image_dim`) without `image_encoder` / `image_processor`, or the
    reverse (`_check_clip_folder`)."""
    path = require_pipeline_folder(path, "WanPipeline")
    class_name = json.loads((path / "model_index.json").read_text()).get("_class_name")
    pipeline_class = WanImageToVideoPipeline if class_name == "WanImageToVideoPipeline" else WanPipeline
    require_pipeline_folder(path, pipeline_class.__name__, PIPELINE_COMPONENTS)
    if _boundary_ratio(path) is not None:
        require_pipeline_folder(path, pipeline_class.__name__, ("transformer_2",))
    _check_clip_folder(path)
    return path, pipeline_class


def _has_clip(path: Path) -> bool:
    """Whether the folder's model_index.json names an `image_encoder` (Wan 2.1 I2V's CLIP)."""
    return (json.loads((path / "model_index.json").read_text()).get("image_encoder") or [None])[0] is not None


def _check_clip_folder(path: Path) -> None:
    """Raise ValueError (one line, the folder and the fix) when the transformer's `image_dim` (transformer/
    config.json) and the folder's CLIP (`image_encoder` and `image_processor` in model_index.json, their
    subfolders) disagree: a Wan 2.1 I2V transformer needs both, a transformer without `image_dim` takes neither.
    Raises FileNotFoundError for a named CLIP subfolder that is missing."""
    index = json.loads((path / "model_index.json").read_text())
    named = [name for name in CLIP_COMPONENTS if (index.get(name) or [None])[0] is not None]
    config = path / "transformer" / "config.json"
    image_dim = json.loads(config.read_text()).get("image_dim") if config.is_file() else None
    if image_dim is not None and len(named) < len(CLIP_COMPONENTS):
        missing = " and ".join(name for name in CLIP_COMPONENTS if name not in named)
        raise ValueError(f"pretrained_path {str(path)!r}: the transformer takes CLIP image embeddings (image_dim "
                         f"{image_dim}, Wan 2.1 I2V) but the folder has no {missing}: add the CLIPVisionModel "
                         "image_encoder/ and CLIPImageProcessor image_processor/ it was trained with")
    if image_dim is None and named:
        raise ValueError(f"pretrained_path {str(path)!r} has {' and '.join(named)} but its transformer takes no "
                         "CLIP image embeddings (image_dim null): remove image_encoder and image_processor from "
                         "model_index.json, or give the Wan 2.1 I2V transformer they belong to")
    if named:
        require_pipeline_folder(path, "WanImageToVideoPipeline", CLIP_COMPONENTS)


def _boundary_ratio(path: Path) -> float | None:
    """The folder's `boundary_ratio` (model_index.json) when it holds two experts (`transformer_2/`), else None.
    Raises ValueError for a second expert without a boundary in (0, 1), or a boundary without a second expert."""
    index = json.loads((path / "model_index.json").read_text())
    two = (index.get("transformer_2") or [None])[0] is not None
    ratio = index.get("boundary_ratio")
    if two != (ratio is not None):
        raise ValueError(f"pretrained_path {str(path)!r}: transformer_2 and boundary_ratio go together (found "
                         f"transformer_2 {'set' if two else 'null'}, boundary_ratio {ratio}); fix model_index.json")
    return check_boundary_ratio(ratio, f"pretrained_path {str(path)!r}") if two else None


def _num_train_timesteps(path: Path) -> int:
    """The folder's scheduler's `num_train_timesteps` (1000 when its config does not say)."""
    config = path / "scheduler" / "scheduler_config.json"
    return int(json.loads(config.read_text()).get("num_train_timesteps", 1000)) if config.is_file() else 1000


def _experts_of(path: Path, transformer: WanTransformer3DModel,
                transformer_2: WanTransformer3DModel | None) -> torch.nn.Module:
    """`transformer`, or with a second expert the `TwoExperts` the folder's `boundary_ratio` and scheduler
    define; each expert checked (`_check_transformer`) and of one layout."""
    _check_transformer(transformer, str(path))
    ratio = _boundary_ratio(path)
    if ratio is None:
        return transformer
    _check_transformer(transformer_2, f"{path} (transformer_2)")
    if transformer_2.config.in_channels != transformer.config.in_channels:
        raise ValueError(f"pretrained_path {str(path)!r}: transformer and transformer_2 take "
                         f"{transformer.config.in_channels} and {transformer_2.config.in_channels} input channels; the "
                         "two experts must match")
    return TwoExperts(transformer, transformer_2, boundary_ratio=ratio, num_train_timesteps=_num_train_timesteps(path))


def load_vae_folder(path: str | Path) -> AutoencoderKLWan:
    """The frozen `AutoencoderKLWan` of a local diffusers VAE folder (`config.json` + safetensors), for
    `model.vae_path`. Raises FileNotFoundError naming the folder when it holds no `config.json`, ValueError when
    its latent layout is not the family's."""
    path = Path(path)
    if not (path / "config.json").is_file():
        raise FileNotFoundError(f"model.vae_path {str(path)!r} is not a diffusers VAE folder (no config.json): give "
                                "the vae/ folder of a diffusers Wan pipeline")
    vae = AutoencoderKLWan.from_pretrained(path, local_files_only=True)
    _check_vae(vae, str(path))
    return vae.eval().requires_grad_(False)


EXPERTS_NUM_TRAIN_TIMESTEPS = 1000
"""The scheduler's `num_train_timesteps` of a config-built two-expert model (the config requires it: Wan 2.2's)."""


def _tiny_transformer(kind: TextEncoderKind, *, i2v: bool = False, clip: int = 0) -> WanTransformer3DModel:
    """TINY_I2V_TRANSFORMER (`i2v`) or TINY_TRANSFORMER at the global RNG's state, `text_dim` from the text
    encoder `kind`. `clip` 1 or 2 (with `i2v`): Wan 2.1 I2V's layout, CLIP embeddings of that many images
    (`tiny_clip_transformer`)."""
    if clip:
        return WanTransformer3DModel(**tiny_clip_transformer(clip), text_dim=text_dim(kind))
    return WanTransformer3DModel(**(TINY_I2V_TRANSFORMER if i2v else TINY_TRANSFORMER), text_dim=text_dim(kind))


def tiny_clip_transformer(num_images: int) -> dict[str, Any]:
    """The tiny preset's Wan 2.1 I2V transformer config: TINY_I2V_TRANSFORMER taking TINY_IMAGE_ENCODER's embeddings
    (`image_dim` 32, `added_kv_proj_dim` the inner dim 32, as Wan2.1-I2V's 1280 and 5120); for 2 images (the first
    and the last: `model.i2v.condition: first_last`) `pos_embed_seq_len` 2 x IMAGE_TOKENS, as Wan2.1-FLF2V."""
    inner_dim = TINY_TRANSFORMER["num_attention_heads"] * TINY_TRANSFORMER["attention_head_dim"]
    return {**TINY_I2V_TRANSFORMER, "image_dim": TINY_IMAGE_ENCODER["hidden_size"], "added_kv_proj_dim": inner_dim,
            "pos_embed_seq_len": 2 * IMAGE_TOKENS if num_images == 2 else None}


def _clip_images(model_cfg: ModelConfig) -> int:
    """How many images' CLIP embeddings the config's model takes: 0 (no CLIP), 1 (`first`), 2 (`first_last`)."""
    if not _uses_clip(model_cfg):
        return 0
    return 2 if model_cfg.i2v.condition == "first_last" else 1


def build_tiny_image_encoder(*, seed: int = 0) -> tuple[CLIPVisionModel, CLIPImageProcessor]:
    """The tiny preset's frozen random `CLIPVisionModel` (TINY_IMAGE_ENCODER, drawn under `seed` in a forked RNG:
    the global torch RNG is left as it was) and its `CLIPImageProcessor` (TINY_IMAGE_PROCESSOR), offline."""
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        image_encoder = CLIPVisionModel(CLIPVisionConfig(**TINY_IMAGE_ENCODER))
    return image_encoder.eval().requires_grad_(False), CLIPImageProcessor(**TINY_IMAGE_PROCESSOR)


def build_tiny(text_encoder_kind: TextEncoderKind = "tiny_random", *, seed: int = 0, i2v: bool = False,
               boundary_ratio: float | None = None, clip: int = 0) -> Components:
    """Random tiny preset (fp32, CPU): the text encoder under `seed`, then TINY_TRANSFORMER (TINY_I2V_TRANSFORMER
    with `i2v`) and TINY_VAE under `seed` (in that order), each in a forked RNG (the global torch RNG is left as it
    was). With `boundary_ratio` (`model.experts`), a second transformer drawn right after the first: the two
    experts, as `TwoExperts` (high noise first). `clip` 1 or 2 (with `i2v`, `model.i2v.image_encoder`): Wan 2.1
    I2V, the transformer `tiny_clip_transformer(clip)` and the CLIP vision tower `build_tiny_image_encoder(seed=)`."""
    text_encoder, tokenizer = build_text_encoder(text_encoder_kind, seed=seed)
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        transformer = _tiny_transformers(text_encoder_kind, i2v=i2v, boundary_ratio=boundary_ratio, clip=clip)
        vae = AutoencoderKLWan(**TINY_VAE)
    image_encoder, image_processor = build_tiny_image_encoder(seed=seed) if clip else (None, None)
    return Components(transformer=transformer.train(), vae=vae.eval().requires_grad_(False),
                      text_encoder=text_encoder, tokenizer=tokenizer, image_encoder=image_encoder,
                      image_processor=image_processor)


def _tiny_transformers(kind: TextEncoderKind, *, i2v: bool, boundary_ratio: float | None,
                       clip: int = 0) -> torch.nn.Module:
    """The tiny transformer at the global RNG's state, or with `boundary_ratio` two of them (drawn in turn) as
    `TwoExperts` over `EXPERTS_NUM_TRAIN_TIMESTEPS`."""
    transformer = _tiny_transformer(kind, i2v=i2v, clip=clip)
    if boundary_ratio is None:
        return transformer
    return TwoExperts(transformer, _tiny_transformer(kind, i2v=i2v, clip=clip), boundary_ratio=boundary_ratio,
                      num_train_timesteps=EXPERTS_NUM_TRAIN_TIMESTEPS)


def _boundary_of(model_cfg: ModelConfig) -> float | None:
    """`model.experts.boundary_ratio`, or None for one transformer."""
    return None if model_cfg.experts is None else model_cfg.experts.boundary_ratio


def _ratio_of(transformer: torch.nn.Module) -> float | None:
    """A `TwoExperts`' boundary_ratio, None for one transformer."""
    return transformer.boundary_ratio if isinstance(transformer, TwoExperts) else None


def _check_experts(ratio: float | None, model_cfg: ModelConfig, where: str) -> None:
    """Raise ValueError when a folder's experts (`ratio`: its boundary_ratio, None for one transformer) are not the
    config's: two experts without `model.experts`, one with it, or another `boundary_ratio`."""
    wanted = _boundary_of(model_cfg)
    if ratio == wanted:
        return
    if wanted is None:
        raise ValueError(f"{where} holds two experts (transformer_2, boundary_ratio {ratio}, Wan 2.2 A14B) but "
                         f"model.experts is null: set model.experts: {{boundary_ratio: {ratio}}} to train both")
    if ratio is None:
        raise ValueError(f"{where} holds one transformer but model.experts is set: give a two-expert folder "
                         "(transformer_2/) or set model.experts to null")
    raise ValueError(f"{where} switches its experts at boundary_ratio {ratio} but model.experts.boundary_ratio is "
                     f"{wanted}: set it to {ratio}")


def load_transformer(path: str | Path) -> torch.nn.Module:
    """The transformer of a local Wan folder alone (no VAE or text encoder read), in train mode: its
    `transformer/`, or both experts as `TwoExperts` when it has a `transformer_2/` and `boundary_ratio` (Wan 2.2
    A14B). Raises as `WanFamily.load_diffusion_models` does for a folder."""
    path, _ = _pipeline_folder(path)
    transformer = WanTransformer3DModel.from_pretrained(path, subfolder="transformer", local_files_only=True)
    transformer_2 = (WanTransformer3DModel.from_pretrained(path, subfolder="transformer_2", local_files_only=True)
                     if _boundary_ratio(path) is not None else None)
    return _experts_of(path, transformer, transformer_2).train()


def _meta_transformer(model_cfg: ModelConfig, subfolder: str) -> tuple[WanTransformer3DModel, str]:
    """The transformer in `subfolder` (`transformer` or `transformer_2`) of the job's pretrained folder, built on
    the meta device from its config.json (shapes, no weights), and that subfolder's path. Raises ValueError without
    `model.pretrained_path`, for a folder the family refuses (`_pipeline_folder`), experts that are not the job's
    (`_check_experts`), or a transformer of another layout or task."""
    folder = pretrained_folder(model_cfg, "wan")
    if folder is None:
        raise ValueError("model.init: pretrained needs model.pretrained_path, a WanPipeline folder")
    path, _ = _pipeline_folder(folder)
    _check_experts(_boundary_ratio(path), model_cfg, str(path))
    source = path / subfolder
    with torch.device("meta"):
        transformer = WanTransformer3DModel.from_config(WanTransformer3DModel.load_config(str(source)))
    _check_transformer(transformer, str(source))
    _check_task(transformer, model_cfg, str(path))
    return transformer.train(), str(source)


def save_pipeline(components: Components, out_dir: str | Path, flow: FlowConfig) -> Path:
    """Write `components` as a complete diffusers folder (safetensors) that the stock pipeline loads and runs
    offline: `diffusers.WanPipeline.from_pretrained(out_dir, local_files_only=True)`, or for an image-to-video
    transformer (`takes_condition`) `WanImageToVideoPipeline` (no `image_encoder`, `image_processor`,
    `transformer_2` or `boundary_ratio`: the transformer takes no CLIP embeddings and samples every step), with the
    components' `image_encoder` and `image_processor` for a transformer that takes CLIP embeddings (Wan 2.1 I2V;
    ValueError when they are missing, or given for a transformer that takes none).

    The scheduler is `FlowMatchEulerDiscreteScheduler(shift=flow.shift, num_train_timesteps=
    flow.num_train_timesteps)` (not the stock Wan folders' `UniPCMultistepScheduler(flow_shift=...)`): its
    `set_timesteps` gives `vidray.diffusion.flow_matching.inference_sigmas` and its `step` is the Euler step of
    `vidray.inference.sampler`, so the stock pipeline samples what vidray samples. Note the stock pipeline pads
    prompts to 512 tokens (`__call__`'s `max_sequence_length` default): pass the trained `max_sequence_length` to
    match vidray exactly. Written by `vidray.models.folders.write_pipeline_folder`: `out_dir` is complete or
    absent; an existing pipeline folder there is replaced. Raises FileExistsError if `out_dir` exists and is not a
    pipeline folder. Returns `out_dir`.
    """
    scheduler = FlowMatchEulerDiscreteScheduler(shift=flow.shift, num_train_timesteps=flow.num_train_timesteps)
    modules = dict(tokenizer=components.tokenizer, text_encoder=components.text_encoder, vae=components.vae,
                   scheduler=scheduler, transformer=components.transformer)
    if takes_image_embeds(components.transformer) != (components.image_encoder is not None) or \
            (components.image_encoder is None) != (components.image_processor is None):
        raise ValueError("a transformer with CLIP image embeddings (image_dim) is exported with its image_encoder and "
                         "image_processor, and one without, with neither: the components disagree")
    if components.image_encoder is not None:
        modules.update(image_encoder=components.image_encoder, image_processor=components.image_processor)
    if isinstance(components.transformer, TwoExperts):
        experts = components.transformer
        if experts.boundary_timestep != experts.boundary_ratio * flow.num_train_timesteps:
            raise ValueError(f"the experts' boundary timestep {experts.boundary_timestep} is not boundary_ratio "
                             f"{experts.boundary_ratio} x flow.num_train_timesteps {flow.num_train_timesteps}")
        modules.update(transformer=experts.transformer, transformer_2=experts.transformer_2,
                       boundary_ratio=experts.boundary_ratio)
    pipe = WanImageToVideoPipeline(**modules) if takes_condition(components.transformer) else WanPipeline(**modules)
    return write_pipeline_folder(pipe, out_dir)


_WITHOUT_TRANSFORMERS = dict(transformer=None, transformer_2=None)
"""`from_pretrained` keywords that skip the transformers (what the encode stages and the text stage load)."""


def condition_mask(batch_size: int, num_frames: int, latent_grid: tuple[int, int, int],
                   given: list[int]) -> torch.Tensor:
    """The mask channels of an image-to-video condition, (B, 4, F_lat, H_lat, W_lat) float32: 1 on the `given`
    pixel frames' positions, 0 elsewhere, the first pixel frame repeated 4 times (the causal VAE's first latent
    frame holds one pixel frame), then each latent frame's 4 pixel frames as its 4 channels. As
    `WanImageToVideoPipeline.prepare_latents` (diffusers 0.42.1) builds `mask_lat_size` for `given` = [0] (an
    image) or [0, F - 1] (an image and a last image). Raises ValueError when F does not make `latent_grid`'s
    F_lat = (F - 1) // 4 + 1 frames."""
    latent_frames, latent_height, latent_width = latent_grid
    if (num_frames - 1) // TEMPORAL_COMPRESSION_RATIO + 1 != latent_frames or (num_frames - 1) % 4:
        raise ValueError(f"{num_frames} frames do not make {latent_frames} latent frames (num_frames must be 4k+1)")
    mask = torch.zeros(batch_size, 1, num_frames, latent_height, latent_width)
    mask[:, :, given] = 1.0
    first = torch.repeat_interleave(mask[:, :, 0:1], dim=2, repeats=TEMPORAL_COMPRESSION_RATIO)
    mask = torch.cat([first, mask[:, :, 1:]], dim=2)  # (B, 1, 4 * F_lat, H_lat, W_lat)
    mask = mask.view(batch_size, latent_frames, TEMPORAL_COMPRESSION_RATIO, latent_height, latent_width)
    return mask.transpose(1, 2).contiguous()


@torch.no_grad()
def encode_condition(vae: AutoencoderKLWan, video_condition: torch.Tensor, given: list[int]) -> torch.Tensor:
    """video_condition (B, 3, F, H, W) in [-1, 1], the `given` frames set and every other frame 0 -> the
    condition (B, 20, F_lat, H_lat, W_lat) float32: `condition_mask` then the VAE's latents of the video,
    (mode - latents_mean) / latents_std (`vidray.models.vae.encode_video`), as `WanImageToVideoPipeline.
    prepare_latents` returns `cat([mask_lat_size, latent_condition], dim=1)`."""
    latent_condition = encode_video(vae, video_condition)
    mask = condition_mask(video_condition.shape[0], video_condition.shape[2], tuple(latent_condition.shape[2:]),
                          given).to(latent_condition.device)
    return torch.cat([mask, latent_condition], dim=1)


def _image_frame(image: Any, height: int, width: int) -> torch.Tensor:
    """A PIL image, a uint8 (H, W, 3) array or a float (3, H, W) tensor in [0, 1] -> (3, height, width) float32 in
    [-1, 1]: `VideoProcessor.preprocess(image, height=, width=)` as `WanImageToVideoPipeline.__call__` step 5 (a
    plain resize to the bucket, no crop). Raises ValueError for another array layout."""
    if isinstance(image, np.ndarray):
        if image.dtype != np.uint8 or image.ndim != 3 or image.shape[-1] != 3:
            raise ValueError(f"an image array must be uint8 (H, W, 3), got {image.dtype} {image.shape}")
        image = Image.fromarray(image)
    elif isinstance(image, torch.Tensor):
        image = image[None]
    frame = VideoProcessor(vae_scale_factor=SPATIAL_COMPRESSION_RATIO).preprocess(image, height=height, width=width)
    return frame[0].float()


def empty_condition(latent_shape: tuple[int, ...], device: torch.device | str | None = None) -> torch.Tensor:
    """The condition of a sample without an image (condition dropout in training; a text-only request to an
    image-to-video model), (B, 20, F_lat, H_lat, W_lat) float32 for latents of `latent_shape`: zeros, no frame
    given and no latents. `WanImageToVideoPipeline` always takes an image; the zeros follow EasyAnimate's
    text-to-video input, the convention vidray's condition dropout trains."""
    batch_size, _, *grid = latent_shape
    return torch.zeros(batch_size, CONDITION_CHANNELS, *grid, dtype=torch.float32, device=device)


def _clip_picture(image: Any) -> Any:
    """An image as `WanImageToVideoPipeline.encode_image` is handed it by a user: a PIL image as is; a uint8 (H, W,
    3) array, or a float (3, H, W) tensor in [0, 1] (rounded to uint8), as a PIL image (what `CLIPImageProcessor`
    rescales by 1/255). Raises ValueError for another array layout."""
    if isinstance(image, torch.Tensor):
        image = image.detach().float().clamp(0, 1).mul(255).round().to(torch.uint8).permute(1, 2, 0).cpu().numpy()
    if isinstance(image, np.ndarray):
        if image.dtype != np.uint8 or image.ndim != 3 or image.shape[-1] != 3:
            raise ValueError(f"an image array must be uint8 (H, W, 3), got {image.dtype} {image.shape}")
        image = Image.fromarray(image)
    return image


@torch.no_grad()
def encode_image_embeds(image_encoder: CLIPVisionModel, image_processor: CLIPImageProcessor,
                        images: list[Any], *, images_per_sample: int = 1) -> torch.Tensor:
    """N = `images_per_sample` images per sample, B samples (`images`: B x N pictures, sample by sample) -> image
    embeddings (B, N x 257,
    D) float32 on the image encoder's device: `WanImageToVideoPipeline.encode_image` (diffusers 0.42.1),
    `image_encoder(**image_processor(images=...), output_hidden_states=True).hidden_states[-2]`, (B x N, 257, D),
    each sample's N images' tokens concatenated, as the transformer's `WanImageEmbedding` views the pipeline's
    `encode_image([image, last_image]).repeat(B, 1, 1)` (`view(-1, 2 * seq_len, D)`). Pictures: PIL, uint8 (H, W,
    3) arrays or (3, H, W) float tensors in [0, 1] (`_clip_picture`)."""
    device = next(image_encoder.parameters()).device
    inputs = image_processor(images=[_clip_picture(image) for image in images], return_tensors="pt").to(device)
    hidden = image_encoder(**inputs, output_hidden_states=True).hidden_states[-2]  # (B * N, 257, D)
    return hidden.reshape(len(images) // images_per_sample, -1, hidden.shape[-1]).float()  # (B, N * 257, D)


def _per_image(image_embeds: torch.Tensor) -> torch.Tensor:
    """image_embeds (B, N x 257, D), each sample's N images' tokens in a row -> (B x N, 257, D), what
    `WanTransformer3DModel` takes as `encoder_hidden_states_image`: the pipeline's `encode_image([image,
    last_image]).repeat(B, 1, 1)` layout, which the FLF2V transformer's `WanImageEmbedding` views back as
    (B, 2 x 257, D) (a no-op for one image)."""
    return image_embeds.reshape(-1, IMAGE_TOKENS, image_embeds.shape[-1])


def clip_frames(video: torch.Tensor, condition: str) -> list[np.ndarray]:
    """A clip batch (B, 3, F, H, W) in [-1, 1] -> the uint8 (H, W, 3) frames its `condition` gives to CLIP, sample
    by sample: frame 0 (`first`), or frames 0 and F - 1 (`first_last`, two even for F = 1: the FLF2V transformer
    takes two images' tokens), `round((x + 1) * 127.5)` (the inverse of `vidray.models.vae.frames_to_video`, exact
    for frames decoded from uint8)."""
    indices = [0, video.shape[2] - 1] if condition == "first_last" else [0]
    if condition not in ("first", "first_last"):
        condition_frames(video.shape[2], condition)  # raises naming the valid conditions
    frames = ((video.detach().float().cpu() + 1) * 127.5).round().clamp(0, 255).to(torch.uint8)
    return [frames[b, :, i].permute(1, 2, 0).numpy() for b in range(video.shape[0]) for i in indices]


def empty_image_embeds(transformer: WanTransformer3DModel, batch_size: int,
                       device: torch.device | str | None = None) -> torch.Tensor:
    """The CLIP embeddings of a sample without an image (condition dropout; text-only generation through a Wan 2.1
    I2V model), (B, T, image_dim) float32 zeros, T = `image_tokens(transformer)`: beside `empty_condition`'s zero
    latent condition. `WanImageToVideoPipeline` always takes an image; the zeros are the text-to-video input
    vidray's condition dropout trains."""
    config = unwrapped(transformer).config
    return torch.zeros(batch_size, image_tokens(transformer), config.image_dim, dtype=torch.float32, device=device)


def probe_loss(model: torch.nn.Module, transformer: WanTransformer3DModel) -> torch.Tensor:
    """The output sum of `model` (`transformer`, maybe DDP-wrapped) on a fixed (1, C, 1, 2, 2) input (one patch of
    (1, 2, 2)) with 2 text tokens (a seeded CPU generator: the global RNG is untouched); fp32 scalar. The probe of
    `no_grad_parameter_names` and of `vidray.train.parallel.prime_buckets`. A transformer with CLIP image
    embeddings (`takes_image_embeds`) gets (1, `image_tokens`, image_dim) of them and WAN_CLIP_TEXT_TOKENS text
    tokens (its attention splits the context there), so its image branch gets a gradient too."""
    cfg, param = transformer.config, next(transformer.parameters())
    dtype = input_dtype(param)  # fp32 when the base is stored in bf16 / fp8 (autocast)
    g = torch.Generator().manual_seed(0)
    _, ph, pw = cfg.patch_size
    noisy_latents = torch.randn(1, cfg.in_channels, 1, ph, pw, generator=g).to(param.device, dtype)
    clip = takes_image_embeds(transformer)
    prompt_embeds = torch.randn(1, WAN_CLIP_TEXT_TOKENS if clip else 2, cfg.text_dim, generator=g)
    extra = {}
    if clip:
        extra["encoder_hidden_states_image"] = _per_image(torch.randn(1, image_tokens(transformer), cfg.image_dim,
                                                                      generator=g).to(param.device, dtype))
    timesteps = torch.full((1,), 500.0, device=param.device)
    return model(hidden_states=noisy_latents, timestep=timesteps,
                 encoder_hidden_states=prompt_embeds.to(param.device, dtype), return_dict=False,
                 **extra)[0].float().sum()


class WanFamily(ModelFamily):
    """Wan 2.1 T2V: latents (B, 16, (F-1)/4+1, H/8, W/8), DiT patch (1, 2, 2), so H and W multiples of 16."""

    name = "wan"
    latent_channels = LATENT_CHANNELS
    example_bucket = (5, 32, 32)

    def check_trainable(self, model_cfg: ModelConfig) -> None:
        """Raise ValueError when a pretrained folder's experts are not `model.experts`' (`_check_experts`, from its
        model_index.json alone: no weights read): two experts train only as two."""
        folder = pretrained_folder(model_cfg, "wan")
        if folder is None or not (folder / "model_index.json").is_file():
            return  # the build says what is missing
        _check_experts(_boundary_ratio(folder), model_cfg, f"model.pretrained_path {str(folder)!r}")

    def load_condition_models(self, model_cfg: ModelConfig, *, seed: int, text: bool = True, image: bool = True,
                              meta: bool = False) -> ConditionModels:
        """The frozen text encoder (umT5) and tokenizer (`text`) and, for a Wan 2.1 I2V model
        (`model.i2v.image_encoder`), the CLIP vision tower and processor (`image`): a folder's `text_encoder/` +
        `tokenizer/` and `image_encoder/` + `image_processor/` (transformers and VAE not read); the tiny preset's
        as `build_tiny` draws them under `seed`. Raises ValueError when `model.i2v.image_encoder` is set and the
        folder has no image_encoder."""
        folder = pretrained_folder(model_cfg, "wan")
        text_encoder = tokenizer = image_encoder = image_processor = None
        if folder is None:
            if text:
                text_encoder, tokenizer = build_text_encoder(model_cfg.text_encoder, seed=seed)
            if image and _uses_clip(model_cfg):
                image_encoder, image_processor = build_tiny_image_encoder(seed=seed)
            if meta:
                text_encoder, image_encoder = (None if m is None else on_meta(m) for m in (text_encoder, image_encoder))
            return ConditionModels(text_encoder, tokenizer, image_encoder, image_processor)
        folder, pipeline_class = _pipeline_folder(folder)
        if text:
            clip = dict(image_encoder=None, image_processor=None) if pipeline_class is WanImageToVideoPipeline else {}
            skip = dict(text_encoder=None) if meta else {}
            pipe = pipeline_class.from_pretrained(folder, **_WITHOUT_TRANSFORMERS, vae=None, **clip, **skip,
                                                  local_files_only=True)
            text_encoder = meta_component(folder, "text_encoder")[0] if meta else pipe.text_encoder
            text_encoder, tokenizer = text_encoder.eval().requires_grad_(False), pipe.tokenizer
        if image and _uses_clip(model_cfg):
            if not _has_clip(folder):
                raise ValueError(f"pretrained_path {str(folder)!r} has no image_encoder but model.i2v.image_encoder is "
                                 "true: set it to false, or give a Wan 2.1 I2V folder")
            image_encoder = (meta_component(folder, "image_encoder")[0] if meta else CLIPVisionModel.from_pretrained(
                folder, subfolder="image_encoder", local_files_only=True)).eval().requires_grad_(False)
            image_processor = CLIPImageProcessor.from_pretrained(folder, subfolder="image_processor",
                                                                 local_files_only=True)
            transformer_config = WanTransformer3DModel.load_config(folder, subfolder="transformer",
                                                                   local_files_only=True)
            _check_image_encoder(image_encoder, transformer_config.get("image_dim"), str(folder))
        return ConditionModels(text_encoder, tokenizer, image_encoder, image_processor)

    def load_latent_models(self, model_cfg: ModelConfig, *, seed: int, trainable: bool = False,
                           meta: bool = False) -> LatentModels:
        """The frozen VAE: `model.vae_path`, else a folder's `vae/` loaded by itself (umT5-XXL is not read), else
        the tiny preset's (drawn under `seed` after the transformer(s), as in `build_tiny`). The Wan VAE does not
        train here: `trainable` raises NotImplementedError."""
        if trainable:
            raise NotImplementedError(f"the {self.name} family's VAE cannot be trained by vidray train-vae yet")
        if model_cfg.vae_path:
            if meta:
                vae, weights = meta_module(AutoencoderKLWan, model_cfg.vae_path)
                return LatentModels(vae.eval().requires_grad_(False), weights)
            return LatentModels(load_vae_folder(model_cfg.vae_path))
        folder = pretrained_folder(model_cfg, "wan")
        if folder is None:
            with torch.random.fork_rng(devices=[]):
                torch.manual_seed(seed)
                _tiny_transformers(model_cfg.text_encoder, i2v=model_cfg.i2v is not None,  # drawn first in build_tiny
                                   boundary_ratio=_boundary_of(model_cfg), clip=_clip_images(model_cfg))
                vae = AutoencoderKLWan(**TINY_VAE)
            return LatentModels((on_meta(vae) if meta else vae).eval().requires_grad_(False))
        folder, _ = _pipeline_folder(folder)
        vae, weights = folder_component(AutoencoderKLWan, folder, "vae", meta=meta)
        _check_vae(vae, str(folder))
        return LatentModels(vae.eval().requires_grad_(False), weights)

    def load_diffusion_models(self, model_cfg: ModelConfig, *, seed: int, expert: str | None = None,
                              meta: bool = False) -> DiffusionModels:
        """The transformer (both experts as `TwoExperts` for `model.experts`): the tiny preset drawn first under
        `seed` (as in `build_tiny`); a folder's `transformer/` (and `transformer_2/`) alone, its task and experts
        checked against the config. `expert`: from a folder its `transformer/` ("high") or `transformer_2/` ("low")
        alone, the other never read (a 14 B expert each, Wan 2.2 A14B); the tiny preset draws both and keeps the
        one. `meta`: a folder's transformer (or the expert's subfolder) from its config.json with that subfolder
        (with `restore_buffers` for the rotary embedding after `to_empty`). Raises ValueError when the folder or
        config has no experts for `expert`, and for a meta build of a two-expert model without `expert` (each
        expert is sharded within its own worker group)."""
        folder = pretrained_folder(model_cfg, "wan")
        if folder is None:
            with torch.random.fork_rng(devices=[]):
                torch.manual_seed(seed)
                transformer = _tiny_transformers(model_cfg.text_encoder, i2v=model_cfg.i2v is not None,
                                                 boundary_ratio=_boundary_of(model_cfg), clip=_clip_images(model_cfg))
            if expert is not None:
                transformer = pick_expert(transformer, expert)
            return DiffusionModels((on_meta(transformer) if meta else transformer).train())
        if meta:
            if expert is None:
                if _boundary_of(model_cfg) is not None:
                    raise ValueError("model.experts: each expert is sharded within its own worker group "
                                     "(model.experts.layout: groups), built from its own subfolder")
                return DiffusionModels(*_meta_transformer(model_cfg, "transformer"))
            check_expert(expert)
            if _boundary_of(model_cfg) is None:
                raise ValueError(f"the {expert}-noise expert was asked for, but model.experts is null: set "
                                 "model.experts to train a Wan 2.2 A14B folder's two experts")
            return DiffusionModels(*_meta_transformer(model_cfg, EXPERT_ATTRIBUTES[expert]))
        if expert is None:
            transformer = load_transformer(folder)
            _check_task(transformer, model_cfg, str(folder))
            _check_experts(_ratio_of(transformer), model_cfg, str(folder))
            return DiffusionModels(transformer)
        check_expert(expert)
        path, _ = _pipeline_folder(folder)
        ratio = _boundary_ratio(path)
        _check_experts(ratio, model_cfg, str(path))
        if ratio is None:
            raise ValueError(f"{str(path)!r} holds one transformer (no transformer_2 / boundary_ratio): it has no "
                             f"{expert}-noise expert to load alone; serve it with one Denoiser")
        transformer = WanTransformer3DModel.from_pretrained(
            path, subfolder="transformer" if expert == "high" else "transformer_2", local_files_only=True)
        _check_transformer(transformer, f"{path} ({'transformer' if expert == 'high' else 'transformer_2'})")
        _check_task(transformer, model_cfg, str(path))
        return DiffusionModels(transformer.train())

    def restore_buffers(self, transformer: torch.nn.Module) -> None:
        """The rotary embedding's `freqs_cos` / `freqs_sin` (non-persistent: no weights file holds them) of each
        `WanRotaryPosEmbed` in `transformer`, computed again as its constructor computes them, on the device of
        the transformer's parameters: after a meta-device build and `to_empty`, they are garbage."""
        device = next(transformer.parameters()).device
        for module in transformer.modules():
            if isinstance(module, WanRotaryPosEmbed):
                fresh = WanRotaryPosEmbed(module.attention_head_dim, module.patch_size, module.max_seq_len)
                for name in ("freqs_cos", "freqs_sin"):
                    setattr(module, name, getattr(fresh, name).to(device))

    def image_inputs(self, info) -> int:
        """0 for a text-to-video model; 2 for a model whose CLIP takes a first and a last image (Wan 2.1 FLF2V: the
        transformer's `pos_embed_seq_len` 2 x 257, or a job's `model.i2v` with `image_encoder` and `condition:
        first_last`), which one image cannot condition; else 1 (`model.i2v` set, or a stock
        `WanImageToVideoPipeline` folder: a first image and an optional last one). Reads configs only."""
        if not info.image_to_video:
            return 0
        config_file = Path(info.path) / "transformer" / "config.json"
        if config_file.is_file():
            return 2 if json.loads(config_file.read_text()).get("pos_embed_seq_len") == 2 * IMAGE_TOKENS else 1
        i2v = info.job.model.i2v if info.job is not None else None
        return 2 if i2v and i2v.image_encoder and i2v.condition == "first_last" else 1

    def condition(self, model, *, latent_shape=None, encoders=None, clip=None, image=None, last_image=None,
                  bucket=None, generator=None, device=None) -> ImageCondition | None:
        """`ModelFamily.condition` for an image-to-video model (`takes_condition`: `in_channels` 36, not 16): the
        condition (B, 20, F_lat, H_lat, W_lat) float32 and, for a model that takes CLIP image embeddings (Wan 2.1
        I2V: `takes_image_embeds`, `model.i2v.image_encoder`, or serving's VAE stage holding an image encoder),
        image_embeds (B, T, image_dim) float32; None for a text-to-video model.

        A training clip's: its own `model.i2v.condition` frames (`first`: frame 0; `first_last`: 0 and F - 1) over
        zero frames, `encode_condition`d, and the CLIP embeddings of those frames (`clip_frames`, as uint8
        pictures, `encode_image_embeds`d): what the stock pipeline makes of them given as `image` (and
        `last_image`). An image's (and a last one's): each resized to the bucket as the stock pipeline does
        (`VideoProcessor.preprocess`, no crop), placed at frame 0 (and F - 1) over zero frames, `encode_condition`d;
        CLIP embeddings of [image] or [image, last_image] as `WanImageToVideoPipeline.__call__` step 4 embeds them;
        raises UserError when the images make other embeddings than the transformer takes (one image to FLF2V, two
        to a one-image model). The empty one: zeros (module-level `empty_condition`, `empty_image_embeds`)."""
        if not takes_image(model, takes_condition):
            return None
        if model is None:
            embeds = encoders is not None and encoders.image_encoder is not None
        elif isinstance(model, ModelConfig):
            embeds = bool(model.i2v.image_encoder)
        else:
            embeds = takes_image_embeds(model)
        if clip is not None:
            condition = clip_condition(model)
            given = condition_frames(clip.shape[2], condition)
            video_condition = torch.zeros_like(clip, dtype=torch.float32)
            video_condition[:, :, given] = clip[:, :, given].float()
            latents = encode_condition(encoders.vae, video_condition, given)
            image_embeds = None
            if embeds:
                per_sample = 2 if condition == "first_last" else 1
                image_embeds = encode_image_embeds(encoders.image_encoder, encoders.image_processor,
                                                   clip_frames(clip, condition), images_per_sample=per_sample)
            return ImageCondition(latents, image_embeds).to(device) if device is not None else \
                ImageCondition(latents, image_embeds)
        if image is not None:
            num_frames, height, width = Bucket(*bucket)
            video_condition = torch.zeros(1, 3, num_frames, height, width)
            video_condition[0, :, 0] = _image_frame(image, height, width)
            given = [0]
            if last_image is not None:
                video_condition[0, :, -1] = _image_frame(last_image, height, width)
                given = condition_frames(num_frames, "first_last")
            latents = over_batch(encode_condition(encoders.vae, video_condition, given), latent_shape, device)
            image_embeds = None
            if embeds:
                images = [image] if last_image is None else [image, last_image]
                image_embeds = encode_image_embeds(encoders.image_encoder, encoders.image_processor, images,
                                                   images_per_sample=len(images))
                if isinstance(model, torch.nn.Module):
                    want = (image_tokens(model), unwrapped(model).config.image_dim)
                    if tuple(image_embeds.shape[1:]) != want:
                        fix = "drop --last-image" if last_image is not None else "give --last-image too"
                        raise UserError(f"this model takes image embeddings {want} (one image, or a first and a last "
                                        f"one), the image(s) given make {tuple(image_embeds.shape[1:])}: {fix}")
                image_embeds = over_batch(image_embeds, latent_shape, device)
            return ImageCondition(latents, image_embeds)
        if embeds and not isinstance(model, torch.nn.Module):
            raise ValueError("the empty condition of a model with image embeddings needs its transformer as model")
        return ImageCondition(empty_condition(latent_shape, device),
                              empty_image_embeds(model, int(latent_shape[0]), device) if embeds else None)

    def encode_video(self, vae: AutoencoderKLWan, video: torch.Tensor) -> torch.Tensor:
        """`vidray.models.vae.encode_video`: (posterior mode - latents_mean) / latents_std per channel,
        (B, 16, (F-1)//4+1, H//8, W//8) float32."""
        return encode_video(vae, video)

    def decode_latents(self, vae: AutoencoderKLWan, latents: torch.Tensor) -> torch.Tensor:
        """`vidray.models.vae.decode_latents`: vae.decode(latents / (1 / latents_std) + latents_mean), as WanPipeline
        decodes, clamped to [-1, 1], (B, 3, F, H, W) float32."""
        return decode_latents(vae, latents)

    def encode_prompt(self, text_encoder, tokenizer, prompts: list[str], *, max_sequence_length: int,
                      device: torch.device | str | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        """See module-level `encode_prompts` (WanPipeline._get_t5_prompt_embeds)."""
        return encode_prompts(text_encoder, tokenizer, prompts, max_sequence_length=max_sequence_length,
                              device=device)


    def predict(
        self,
        transformer: WanTransformer3DModel,
        noisy_latents: torch.Tensor,
        timesteps: torch.Tensor,
        prompt_embeds: torch.Tensor,
        prompt_attention_mask: torch.Tensor,
        inpaint_latents: torch.Tensor | None = None,
        image_embeds: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """noisy_latents (B, 16, F, H, W), timesteps (B,) = sigmas * num_train_timesteps, prompt_embeds (B, L, D),
        prompt_attention_mask (B, L) -> model_pred (B, 16, F, H, W), the velocity (noise - latents). An
        image-to-video transformer (`takes_condition`) also takes its condition `inpaint_latents` (B, 20, F, H, W)
        (`condition`: a clip's, an image's or the empty one), concatenated after the noisy latents
        along channels as `WanImageToVideoPipeline`'s loop does; a text-to-video one takes none (ValueError). A
        Wan 2.1 I2V transformer (`takes_image_embeds`) also takes `image_embeds` (B, T, image_dim), T =
        `image_tokens` (the same `condition` call's `image_embeds`), passed as
        `encoder_hidden_states_image` in the latents' dtype as the pipeline's loop does, one row per image
        (`_per_image`: (B x N, 257, image_dim)) (ValueError when missing, misshapen, or given to another
        transformer).

        Called exactly like WanPipeline's denoising loop: `hidden_states` and `encoder_hidden_states` in the
        latents' dtype, `timestep` as given (the pipeline passes the scheduler's float32 timesteps uncast),
        `return_dict=False`; prompt_attention_mask is checked for shape but not passed (the transformer has no text
        mask: positions past each prompt are zero in prompt_embeds, as `encode_prompts` gives them).
        """
        if noisy_latents.ndim != 5:
            raise ValueError(f"noisy_latents must be (B, C, F, H, W), got {tuple(noisy_latents.shape)}")
        batch_size = noisy_latents.shape[0]
        if timesteps.shape != (batch_size,):
            raise ValueError(f"timesteps must have shape ({batch_size},), got {tuple(timesteps.shape)}")
        if prompt_embeds.ndim != 3 or prompt_embeds.shape[0] != batch_size:
            raise ValueError(f"prompt_embeds must be ({batch_size}, L, D), got {tuple(prompt_embeds.shape)}")
        if prompt_attention_mask.shape != prompt_embeds.shape[:2]:
            raise ValueError(f"prompt_attention_mask {tuple(prompt_attention_mask.shape)} must match prompt_embeds' "
                             f"(B, L) {tuple(prompt_embeds.shape[:2])}")
        hidden_states = noisy_latents
        if takes_condition(transformer):
            expected = (batch_size, CONDITION_CHANNELS, *noisy_latents.shape[2:])
            if inpaint_latents is None or tuple(inpaint_latents.shape) != expected:
                found = None if inpaint_latents is None else tuple(inpaint_latents.shape)
                raise ValueError(f"an image-to-video transformer needs its condition inpaint_latents {expected}, got "
                                 f"{found}")
            hidden_states = torch.cat([noisy_latents, inpaint_latents.to(noisy_latents.dtype)], dim=1)
        elif inpaint_latents is not None:
            raise ValueError("a text-to-video transformer takes no inpaint_latents (the model has no image input)")
        extra = {}
        if takes_image_embeds(transformer):
            expected = (batch_size, image_tokens(transformer), unwrapped(transformer).config.image_dim)
            if image_embeds is None or tuple(image_embeds.shape) != expected:
                found = None if image_embeds is None else tuple(image_embeds.shape)
                raise ValueError(f"a Wan 2.1 I2V transformer needs its CLIP image_embeds {expected}, got {found}")
            extra["encoder_hidden_states_image"] = _per_image(image_embeds.to(noisy_latents.dtype))
        elif image_embeds is not None:
            raise ValueError("this transformer takes no CLIP image_embeds (image_dim null)")
        return transformer(
            hidden_states=hidden_states,
            timestep=timesteps,
            encoder_hidden_states=prompt_embeds.to(dtype=noisy_latents.dtype),
            return_dict=False,
            **extra,
        )[0]

    def latent_shape(self, bucket: Bucket, batch_size: int) -> tuple[int, int, int, int, int]:
        """(B, 16, (F-1)//4 + 1, H//8, W//8); e.g. Bucket(9, 64, 64), B=2 -> (2, 16, 3, 8, 8).

        Raises ValueError unless H, W are multiples of 16 (8x VAE, patch 2) and F is 1 or 4k+1."""
        validate_bucket(bucket, spatial_multiple=self.spatial_multiple, temporal_compression=TEMPORAL_COMPRESSION_RATIO)
        if batch_size < 1:
            raise ValueError(f"batch_size must be >= 1, got {batch_size}")
        num_frames, height, width = bucket
        return (batch_size, LATENT_CHANNELS, (num_frames - 1) // TEMPORAL_COMPRESSION_RATIO + 1,
                height // SPATIAL_COMPRESSION_RATIO, width // SPATIAL_COMPRESSION_RATIO)

    def no_grad_parameter_names(self, transformer: WanTransformer3DModel) -> list[str]:
        """Trainable parameters without a gradient from `probe_loss` (`vidray.models.folders.unused_parameter_names`);
        none in a WanTransformer3DModel (its CLIP image branch included: `probe_loss` feeds it image embeddings). `TwoExperts`: each expert probed alone (one probe
        timestep reaches one expert only), names prefixed `transformer.` / `transformer_2.`."""
        if isinstance(transformer, TwoExperts):
            return [f"{name}.{param}" for name in ("transformer", "transformer_2")
                    for param in unused_parameter_names(getattr(transformer, name), probe_loss)]
        return unused_parameter_names(transformer, probe_loss)

    def prompt_embeds_dim(self, transformer: WanTransformer3DModel) -> int:
        """`transformer.config.text_dim` (4096 for umT5-XXL; the text encoder's hidden size here)."""
        return int(transformer.config.text_dim)

    def probe_loss(self, model: torch.nn.Module, transformer: WanTransformer3DModel) -> torch.Tensor:
        """See module-level `probe_loss`."""
        return probe_loss(model, transformer)

    def save_pipeline(self, components: Components, out_dir: str | Path, flow: FlowConfig) -> Path:
        """See module-level `save_pipeline`."""
        return save_pipeline(components, out_dir, flow)

