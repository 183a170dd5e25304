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
  and the stock pipeline loaded from it takes the same steps as `vidray.diffusion.sampler`.

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

Two experts (Wan 2.2 A14B: `transformer` for high noise, `transformer_2` below `boundary_ratio`): `model.experts`
builds two tiny transformers, or loads a folder with both, as one `vidray.models.experts.TwoExperts`, which routes
each sample by its timestep as the stock pipelines do; so training (each sample trains the expert of its timestep),
`vidray generate`, validation and serving use it unchanged, and it is exported back with both and the ratio.

Not here yet: Wan 2.1 I2V's CLIP image embeddings (`image_dim`, `encoder_hidden_states_image`; such a folder is
refused), and one worker group per expert (every worker holds both).
"""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path
from typing import Any, Literal

import torch
import numpy as np
from diffusers import (AutoencoderKLWan, FlowMatchEulerDiscreteScheduler, WanImageToVideoPipeline, WanPipeline,
                       WanTransformer3DModel)
from diffusers.pipelines.wan.pipeline_wan import prompt_clean
from diffusers.video_processor import VideoProcessor

from vidray.config import FlowConfig, ModelConfig
from vidray.data.buckets import Bucket, validate_bucket
from vidray.models.base import Components, Encoders, ModelFamily
from vidray.models.conditioning import condition_frames
from vidray.models.experts import TwoExperts, check_boundary_ratio, check_expert
from vidray.models.folders import (pretrained_folder, require_pipeline_folder, unused_parameter_names, unwrapped,
                                   write_pipeline_folder)
from vidray.models.rules import FAMILY_BUCKET_RULES
from vidray.models.text_encoder import TINY_T5_ENCODER, build_t5_text_encoder, t5_text_width
from vidray.models.vae import decode_latents, encode_video

__all__ = [
    "TINY_I2V_TRANSFORMER",
    "TINY_TEXT_ENCODER",
    "TINY_TRANSFORMER",
    "TINY_VAE",
    "WanFamily",
    "build_text_encoder",
    "build_tiny",
    "condition_mask",
    "empty_condition",
    "encode_condition",
    "encode_prompts",
    "load_pretrained",
    "load_transformer",
    "load_vae_folder",
    "probe_loss",
    "save_pipeline",
    "takes_condition",
]

LATENT_CHANNELS = 16
"""Wan 2.1 VAE `z_dim`; the tiny preset uses the same so shapes do not depend on the preset."""
SPATIAL_COMPRESSION_RATIO = 8
TEMPORAL_COMPRESSION_RATIO = FAMILY_BUCKET_RULES["wan"].temporal_compression
PATCH_SIZE = (1, 2, 2)
"""WanTransformer3DModel patch (frames, height, width)."""
assert SPATIAL_COMPRESSION_RATIO * PATCH_SIZE[1] == FAMILY_BUCKET_RULES["wan"].spatial_multiple
PIPELINE_COMPONENTS = ("transformer", "vae", "text_encoder", "tokenizer", "scheduler")
"""The subfolders of a Wan T2V (`WanPipeline`) or I2V (`WanImageToVideoPipeline`) diffusers folder that vidray
loads (an I2V folder's `image_encoder/`, Wan 2.1's CLIP, is refused: `_check_transformer`)."""
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
    te_device = next(text_encoder.parameters()).device
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


def _check_transformer(transformer: WanTransformer3DModel, where: str) -> None:
    """Raise ValueError for a transformer whose layout the family cannot drive: not 16 (T2V) or 36 (I2V) input
    channels with patch (1, 2, 2), or a Wan 2.1 I2V transformer that takes CLIP image embeddings (`image_dim`)."""
    config = transformer.config
    found = (config.in_channels, tuple(config.patch_size))
    if found not in ((LATENT_CHANNELS, PATCH_SIZE), (I2V_IN_CHANNELS, PATCH_SIZE)):
        raise ValueError(f"{where}: transformer (in_channels, patch_size) = {found}, but the wan family expects "
                         f"{(LATENT_CHANNELS, PATCH_SIZE)} (text-to-video) or {(I2V_IN_CHANNELS, PATCH_SIZE)} "
                         "(image-to-video)")
    if config.image_dim is not None:
        raise ValueError(f"{where}: transformer takes CLIP image embeddings (image_dim {config.image_dim}, Wan 2.1 "
                         "image-to-video), which vidray does not compute yet; give a Wan 2.1 text-to-video folder "
                         "or an image-to-video one without image_encoder (Wan 2.2 A14B's layout)")


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


def _pipeline_folder(path: str | Path) -> tuple[Path, type]:
    """(`path`, its pipeline class): a complete `WanPipeline` or `WanImageToVideoPipeline` folder, as its
    model_index.json names it. Raises FileNotFoundError / ValueError as `require_pipeline_folder` (another
    family's folder, a missing component, a two-expert folder without `transformer_2/`), and ValueError for a Wan
    2.1 CLIP-conditioned folder."""
    path = require_pipeline_folder(path, "WanPipeline")
    class_name = json.loads((path / "model_index.json").read_text()).get("_class_name")
    pipeline_class = WanImageToVideoPipeline if class_name == "WanImageToVideoPipeline" else WanPipeline
    require_pipeline_folder(path, pipeline_class.__name__, PIPELINE_COMPONENTS)
    if _boundary_ratio(path) is not None:
        require_pipeline_folder(path, pipeline_class.__name__, ("transformer_2",))
    if (json.loads((path / "model_index.json").read_text()).get("image_encoder") or [None])[0] is not None:
        raise ValueError(f"pretrained_path {str(path)!r} is a Wan 2.1 image-to-video folder (image_encoder/: CLIP "
                         "image embeddings), which vidray does not compute yet; give a Wan 2.1 text-to-video folder "
                         "or an image-to-video one without image_encoder (Wan 2.2 A14B's layout)")
    return path, pipeline_class


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


def _tiny_transformer(kind: TextEncoderKind, *, i2v: bool = False) -> WanTransformer3DModel:
    """TINY_I2V_TRANSFORMER (`i2v`) or TINY_TRANSFORMER at the global RNG's state, `text_dim` from the text
    encoder `kind`."""
    return WanTransformer3DModel(**(TINY_I2V_TRANSFORMER if i2v else TINY_TRANSFORMER), text_dim=text_dim(kind))


def build_tiny(text_encoder_kind: TextEncoderKind = "tiny_random", *, seed: int = 0, i2v: bool = False,
               boundary_ratio: float | None = None) -> Components:
    """Random tiny preset (fp32, CPU): the text encoder under `seed`, then TINY_TRANSFORMER (TINY_I2V_TRANSFORMER
    with `i2v`) and TINY_VAE under `seed` (in that order), each in a forked RNG (the global torch RNG is left as it
    was). With `boundary_ratio` (`model.experts`), a second transformer drawn right after the first: the two
    experts, as `TwoExperts` (high noise first)."""
    text_encoder, tokenizer = build_text_encoder(text_encoder_kind, seed=seed)
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        transformer = _tiny_transformers(text_encoder_kind, i2v=i2v, boundary_ratio=boundary_ratio)
        vae = AutoencoderKLWan(**TINY_VAE)
    return Components(transformer=transformer.train(), vae=vae.eval().requires_grad_(False),
                      text_encoder=text_encoder, tokenizer=tokenizer)


def _tiny_transformers(kind: TextEncoderKind, *, i2v: bool, boundary_ratio: float | None) -> torch.nn.Module:
    """The tiny transformer at the global RNG's state, or with `boundary_ratio` two of them (drawn in turn) as
    `TwoExperts` over `EXPERTS_NUM_TRAIN_TIMESTEPS`."""
    transformer = _tiny_transformer(kind, i2v=i2v)
    if boundary_ratio is None:
        return transformer
    return TwoExperts(transformer, _tiny_transformer(kind, i2v=i2v), boundary_ratio=boundary_ratio,
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


def load_pretrained(path: str | Path) -> Components:
    """transformer, vae, text_encoder and tokenizer of a local diffusers Wan folder, offline: a `WanPipeline`
    (text-to-video) or a one-transformer `WanImageToVideoPipeline` without image encoder (image-to-video). Its own
    scheduler is not used: vidray samples with the job's flow shift.

    Raises FileNotFoundError naming the folder when it has no model_index.json or lacks a component subfolder,
    ValueError when it is another pipeline's folder (another family) or its layout is not one the family drives
    (`_check_transformer`, `_check_vae`, `_boundary_ratio`). A two-expert folder (Wan 2.2 A14B) gives a
    `TwoExperts` transformer. The VAE and text encoder come back
    frozen; the transformer in train mode.
    """
    path, pipeline_class = _pipeline_folder(path)
    pipe = pipeline_class.from_pretrained(path, image_encoder=None, image_processor=None, local_files_only=True) \
        if pipeline_class is WanImageToVideoPipeline else pipeline_class.from_pretrained(path, local_files_only=True)
    transformer = _experts_of(path, pipe.transformer, pipe.transformer_2)
    _check_vae(pipe.vae, str(path))
    return Components(transformer=transformer.train(), vae=pipe.vae.eval().requires_grad_(False),
                      text_encoder=pipe.text_encoder.eval().requires_grad_(False), tokenizer=pipe.tokenizer)


def load_transformer(path: str | Path) -> torch.nn.Module:
    """The transformer of a local Wan folder alone (no VAE or text encoder read), in train mode: its
    `transformer/`, or both experts as `TwoExperts` when it has a `transformer_2/` and `boundary_ratio` (Wan 2.2
    A14B). Raises as `load_pretrained`."""
    path, _ = _pipeline_folder(path)
    transformer = WanTransformer3DModel.from_pretrained(path, subfolder="transformer", local_files_only=True)
    transformer_2 = (WanTransformer3DModel.from_pretrained(path, subfolder="transformer_2", local_files_only=True)
                     if _boundary_ratio(path) is not None else None)
    return _experts_of(path, transformer, transformer_2).train()


def save_pipeline(components: Components, out_dir: str | Path, flow: FlowConfig) -> Path:
    """Write `components` as a complete diffusers folder (safetensors) that the stock pipeline loads and runs
    offline: `diffusers.WanPipeline.from_pretrained(out_dir, local_files_only=True)`, or for an image-to-video
    transformer (`takes_condition`) `WanImageToVideoPipeline` (no `image_encoder`, `image_processor`,
    `transformer_2` or `boundary_ratio`: the transformer takes no CLIP embeddings and samples every step).

    The scheduler is `FlowMatchEulerDiscreteScheduler(shift=flow.shift, num_train_timesteps=
    flow.num_train_timesteps)` (not the stock Wan folders' `UniPCMultistepScheduler(flow_shift=...)`): its
    `set_timesteps` gives `vidray.diffusion.flow_matching.inference_sigmas` and its `step` is the Euler step of
    `vidray.diffusion.sampler`, so the stock pipeline samples what vidray samples. Note the stock pipeline pads
    prompts to 512 tokens (`__call__`'s `max_sequence_length` default): pass the trained `max_sequence_length` to
    match vidray exactly. Written by `vidray.models.folders.write_pipeline_folder`: `out_dir` is complete or
    absent; an existing pipeline folder there is replaced. Raises FileExistsError if `out_dir` exists and is not a
    pipeline folder. Returns `out_dir`.
    """
    scheduler = FlowMatchEulerDiscreteScheduler(shift=flow.shift, num_train_timesteps=flow.num_train_timesteps)
    modules = dict(tokenizer=components.tokenizer, text_encoder=components.text_encoder, vae=components.vae,
                   scheduler=scheduler, transformer=components.transformer)
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
    from PIL import Image

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


def probe_loss(model: torch.nn.Module, transformer: WanTransformer3DModel) -> torch.Tensor:
    """The output sum of `model` (`transformer`, maybe DDP-wrapped) on a fixed (1, C, 1, 2, 2) input (one patch of
    (1, 2, 2)) with 2 text tokens (a seeded CPU generator: the global RNG is untouched); fp32 scalar. The probe of
    `no_grad_parameter_names` and of `vidray.train.parallel.prime_buckets`."""
    cfg, param = transformer.config, next(transformer.parameters())
    g = torch.Generator().manual_seed(0)
    _, ph, pw = cfg.patch_size
    noisy_latents = torch.randn(1, cfg.in_channels, 1, ph, pw, generator=g).to(param.device, param.dtype)
    prompt_embeds = torch.randn(1, 2, cfg.text_dim, generator=g).to(param.device, param.dtype)
    timesteps = torch.full((1,), 500.0, device=param.device)
    return model(hidden_states=noisy_latents, timestep=timesteps, encoder_hidden_states=prompt_embeds,
                 return_dict=False)[0].float().sum()


class WanFamily(ModelFamily):
    """Wan 2.1 T2V: latents (B, 16, (F-1)/4+1, H/8, W/8), DiT patch (1, 2, 2), so H and W multiples of 16."""

    name = "wan"
    latent_channels = LATENT_CHANNELS
    spatial_compression_ratio = SPATIAL_COMPRESSION_RATIO
    temporal_compression_ratio = TEMPORAL_COMPRESSION_RATIO
    spatial_multiple = SPATIAL_COMPRESSION_RATIO * PATCH_SIZE[1]
    example_bucket = (5, 32, 32)

    def build(self, model_cfg: ModelConfig, *, seed: int) -> Components:
        """`init: random` -> the `tiny` preset with `model_cfg.text_encoder` (`build_tiny`; its image-to-video
        transformer for `model.i2v`); `init: pretrained` -> `load_pretrained(model_cfg.pretrained_path)` (the
        folder's own text encoder), whose task must be the config's (`model.i2v` set for an image-to-video
        folder). `model.vae_path` replaces the VAE."""
        folder = pretrained_folder(model_cfg, "wan")
        if folder is None:
            components = build_tiny(model_cfg.text_encoder, seed=seed, i2v=model_cfg.i2v is not None,
                                    boundary_ratio=_boundary_of(model_cfg))
        else:
            components = load_pretrained(folder)
            _check_task(components.transformer, model_cfg, str(folder))
            _check_experts(_ratio_of(components.transformer), model_cfg, str(folder))
        if model_cfg.vae_path:
            components = dataclasses.replace(components, vae=load_vae_folder(model_cfg.vae_path))
        return components

    def check_trainable(self, model_cfg: ModelConfig) -> None:
        """Raise ValueError when a pretrained folder's experts are not `model.experts`' (`_check_experts`, from its
        model_index.json alone: no weights read): two experts train only as two."""
        folder = pretrained_folder(model_cfg, "wan")
        if folder is None or not (folder / "model_index.json").is_file():
            return  # the build says what is missing
        _check_experts(_boundary_ratio(folder), model_cfg, f"model.pretrained_path {str(folder)!r}")

    def build_transformer(self, model_cfg: ModelConfig, *, seed: int) -> WanTransformer3DModel:
        """The transformer alone, equal to `build(model_cfg, seed=seed).transformer`, without the VAE or the text
        encoder: the tiny preset drawn first under `seed` (as in `build_tiny`); a folder's `transformer/` alone."""
        folder = pretrained_folder(model_cfg, "wan")
        if folder is not None:
            transformer = load_transformer(folder)
            _check_task(transformer, model_cfg, str(folder))
            _check_experts(_ratio_of(transformer), model_cfg, str(folder))
            return transformer
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(seed)
            transformer = _tiny_transformers(model_cfg.text_encoder, i2v=model_cfg.i2v is not None,
                                             boundary_ratio=_boundary_of(model_cfg))
        return transformer.train()

    def build_expert(self, model_cfg: ModelConfig, *, seed: int, expert: str) -> WanTransformer3DModel:
        """One expert of a two-expert model (`ModelFamily.build_expert`): from a folder, its `transformer/`
        ("high") or `transformer_2/` ("low") alone, the other never read (a 14 B expert each, Wan 2.2 A14B); the
        tiny preset draws both and keeps the one. Raises ValueError when the folder or config has no experts."""
        folder = pretrained_folder(model_cfg, "wan")
        if folder is None:
            return super().build_expert(model_cfg, seed=seed, expert=expert)
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
        return transformer.train()

    def build_encoders(self, model_cfg: ModelConfig, *, seed: int) -> Encoders:
        """The VAE, text encoder and tokenizer alone (frozen), equal to `build`'s: a folder is loaded with
        `transformer=None` (diffusers skips it); the tiny preset replays `build_tiny`."""
        folder = pretrained_folder(model_cfg, "wan")
        if folder is None:
            c = self.build(model_cfg, seed=seed)
            return Encoders(vae=c.vae, text_encoder=c.text_encoder, tokenizer=c.tokenizer)
        folder, pipeline_class = _pipeline_folder(folder)
        pipe = pipeline_class.from_pretrained(folder, **_WITHOUT_TRANSFORMERS, local_files_only=True)
        _check_vae(pipe.vae, str(folder))
        vae = load_vae_folder(model_cfg.vae_path) if model_cfg.vae_path else pipe.vae.eval().requires_grad_(False)
        return Encoders(vae=vae, text_encoder=pipe.text_encoder.eval().requires_grad_(False),
                        tokenizer=pipe.tokenizer)

    def build_text_encoder(self, model_cfg: ModelConfig, *, seed: int):
        """The frozen text encoder (umT5) and tokenizer alone, equal to `build_encoders`'s: a folder is loaded
        without transformers or VAE; the tiny preset replays `build_tiny`."""
        folder = pretrained_folder(model_cfg, "wan")
        if folder is None:
            return super().build_text_encoder(model_cfg, seed=seed)
        folder, pipeline_class = _pipeline_folder(folder)
        pipe = pipeline_class.from_pretrained(folder, **_WITHOUT_TRANSFORMERS, vae=None, local_files_only=True)
        return pipe.text_encoder.eval().requires_grad_(False), pipe.tokenizer

    def build_vae(self, model_cfg: ModelConfig, *, seed: int) -> AutoencoderKLWan:
        """The frozen VAE alone, equal to `build_encoders(...).vae`: `model.vae_path`, else a folder's `vae/` loaded
        by itself (umT5-XXL is not read), else the tiny preset's (replaying `build_tiny`)."""
        if model_cfg.vae_path:
            return load_vae_folder(model_cfg.vae_path)
        folder = pretrained_folder(model_cfg, "wan")
        if folder is None:
            return self.build_encoders(model_cfg, seed=seed).vae
        folder, _ = _pipeline_folder(folder)
        vae = AutoencoderKLWan.from_pretrained(folder, subfolder="vae", local_files_only=True)
        _check_vae(vae, str(folder))
        return vae.eval().requires_grad_(False)

    def supports_image_to_video(self, info) -> bool:
        """Whether the model `info` (`vidray.models.export.ModelInfo`) describes takes an image: `model.i2v` set,
        or a stock `WanImageToVideoPipeline` folder."""
        return bool(info.image_to_video)

    def takes_image(self, transformer: WanTransformer3DModel) -> bool:
        """`takes_condition`: the transformer's `in_channels` is 36, not 16."""
        return takes_condition(transformer)

    def encode_clip_condition(self, vae: AutoencoderKLWan, video: torch.Tensor, condition: str) -> torch.Tensor:
        """A training clip (B, 3, F, H, W) in [-1, 1] -> its condition (B, 20, F_lat, H_lat, W_lat) float32: the
        clip's own `condition` frames (`first`: frame 0; `first_last`: 0 and F-1) over zero frames,
        `encode_condition`d, what the stock pipeline makes of those frames given as `image` (and `last_image`)."""
        given = condition_frames(video.shape[2], condition)
        video_condition = torch.zeros_like(video, dtype=torch.float32)
        video_condition[:, :, given] = video[:, :, given].float()
        return encode_condition(vae, video_condition, given)

    def encode_image_condition(self, vae: AutoencoderKLWan, image, bucket: Bucket, *,
                               last_image=None) -> torch.Tensor:
        """A first image (and an optional last) -> the condition (1, 20, F_lat, H_lat, W_lat) float32 of a
        `bucket` video: each image resized to the bucket as the stock pipeline does (`VideoProcessor.preprocess`,
        no crop), placed at frame 0 (and F - 1) over zero frames, `encode_condition`d."""
        num_frames, height, width = Bucket(*bucket)
        video_condition = torch.zeros(1, 3, num_frames, height, width)
        video_condition[0, :, 0] = _image_frame(image, height, width)
        given = [0]
        if last_image is not None:
            video_condition[0, :, -1] = _image_frame(last_image, height, width)
            given = condition_frames(num_frames, "first_last")
        return encode_condition(vae, video_condition, given)

    def empty_condition(self, latent_shape: tuple[int, ...], device: torch.device | str | None = None) -> torch.Tensor:
        """See module-level `empty_condition`: zeros (B, 20, F_lat, H_lat, W_lat)."""
        return empty_condition(latent_shape, device)

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

    def load_vae(self, path: str | Path) -> AutoencoderKLWan:
        """`load_vae_folder`."""
        return load_vae_folder(path)

    def predict(
        self,
        transformer: WanTransformer3DModel,
        noisy_latents: torch.Tensor,
        timesteps: torch.Tensor,
        prompt_embeds: torch.Tensor,
        prompt_attention_mask: torch.Tensor,
        inpaint_latents: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """noisy_latents (B, 16, F, H, W), timesteps (B,) = sigmas * num_train_timesteps, prompt_embeds (B, L, D),
        prompt_attention_mask (B, L) -> model_pred (B, 16, F, H, W), the velocity (noise - latents). An
        image-to-video transformer (`takes_condition`) also takes its condition `inpaint_latents` (B, 20, F, H, W)
        (`encode_clip_condition`, `encode_image_condition`, `empty_condition`), concatenated after the noisy latents
        along channels as `WanImageToVideoPipeline`'s loop does; a text-to-video one takes none (ValueError).

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
        return transformer(
            hidden_states=hidden_states,
            timestep=timesteps,
            encoder_hidden_states=prompt_embeds.to(dtype=noisy_latents.dtype),
            return_dict=False,
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
        none in a WanTransformer3DModel without CLIP image branch. `TwoExperts`: each expert probed alone (one probe
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

    def load_pretrained(self, path: str | Path) -> Components:
        """See module-level `load_pretrained`."""
        return load_pretrained(path)
