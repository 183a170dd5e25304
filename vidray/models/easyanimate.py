"""EasyAnimate family: diffusers `EasyAnimateTransformer3DModel` (MMDiT) + `AutoencoderKLMagvit` + a BERT/Qwen
text encoder, exported as a stock `diffusers.EasyAnimatePipeline` folder.

Everything here mirrors diffusers/pipelines/easyanimate/pipeline_easyanimate.py (diffusers 0.42.1), so a
transformer trained with `EasyAnimateFamily.predict` behaves the same inside the stock pipeline:
- prompts: chat template -> right-padded tokens -> text encoder `hidden_states[-2]` (`encode_prompts`);
- transformer call: `transformer(noisy_latents, timesteps, encoder_hidden_states=prompt_embeds)`, timesteps =
  sigmas * num_train_timesteps in the latents' dtype; the text attention mask is NOT passed (the transformer has
  no mask input: padded text tokens take part in attention, in training as in the pipeline);
- latents: `vae.encode(video).mode() * scaling_factor`; decode `vae.decode(latents / scaling_factor)`.

Image-to-video (`model.i2v`): the InP transformer of diffusers/pipelines/easyanimate/pipeline_easyanimate_inpaint.py
takes `inpaint_latents` (B, 1 + 16, F_lat, H_lat, W_lat) concatenated to the noisy latents inside its `forward`
(so `in_channels` = 16 + 1 + 16 = 33, `resize_inpaint_mask_directly`): the mask resized to the latent grid
(`resize_mask`, first frame alone as the causal VAE encodes it) times scaling_factor, then the masked video's
latents (`encode_inpaint_latents`); the all-generate (text-to-video) input is zeros (`empty_condition`). Exported
as a stock `EasyAnimateInpaintPipeline` folder.
"""

from __future__ import annotations

import json
from pathlib import Path

import torch
from diffusers import AutoencoderKLMagvit, EasyAnimateInpaintPipeline, EasyAnimatePipeline, EasyAnimateTransformer3DModel
from diffusers import FlowMatchEulerDiscreteScheduler
from diffusers.pipelines.easyanimate.pipeline_easyanimate_inpaint import resize_mask

from vidray.cards import get_card
from vidray.models.offload import compute_dtype, execution_device
from vidray.models.storage import input_dtype
from vidray.config import FlowConfig, ModelConfig
from vidray.buckets import Bucket, validate_bucket
from vidray.models.base import (Components, ConditionModels, DiffusionModels, LatentModels, ModelFamily,
                                on_meta)
from vidray.models.conditioning import (ImageCondition, clip_condition, generate_mask, image_to_video, masked_video,
                                       over_batch, takes_image)
from vidray.models.experts import pick_expert
from vidray.models.folders import (folder_component, meta_component, meta_module, pretrained_folder,
                                   require_pipeline_folder, unused_parameter_names, unwrapped, write_pipeline_folder)
from vidray.models.text_encoder import build_text_encoder, encode_prompts, ensure_chat_template, text_hidden_size
from vidray.models.vae import decode_latents, encode_video

__all__ = [
    "EasyAnimateFamily",
    "TINY_TRANSFORMER",
    "TINY_VAE",
    "build_tiny",
    "empty_condition",
    "encode_inpaint_latents",
    "no_grad_parameter_names",
    "save_pipeline",
]

LATENT_CHANNELS = 16
"""EasyAnimate V5.x latent channels; the tiny preset uses the same so shapes do not depend on the preset."""
SPATIAL_COMPRESSION_RATIO = 8
TEMPORAL_COMPRESSION_RATIO = get_card("easyanimate").bucket_rules.temporal_compression
PATCH_SIZE = 2
assert SPATIAL_COMPRESSION_RATIO * PATCH_SIZE == get_card("easyanimate").bucket_rules.spatial_multiple

TINY_TRANSFORMER = dict(
    num_attention_heads=4,
    attention_head_dim=32,  # diffusers asserts attention_head_dim >= 16 (3D RoPE split over t/h/w)
    in_channels=LATENT_CHANNELS,
    out_channels=LATENT_CHANNELS,
    patch_size=PATCH_SIZE,
    sample_width=8,  # latent width of a 64 px bucket (only informative: RoPE uses a fixed 90x60 base grid)
    sample_height=8,
    num_layers=3,
    mmdit_layers=3,
    time_embed_dim=128,
)
"""Tiny DiT (inner dim 128, 3 MMDiT blocks; 1.9 M params with text_embed_dim 384). `text_embed_dim` is set from
the text encoder's hidden size."""

INPAINT_MASK_CHANNELS = 1
"""Channels of the resized mask in the inpaint latents (`resize_inpaint_mask_directly`: the mask itself, not its VAE
latents)."""
INPAINT_CHANNELS = INPAINT_MASK_CHANNELS + LATENT_CHANNELS
"""Channels of `inpaint_latents`: the mask, then the masked video's latents."""
I2V_IN_CHANNELS = LATENT_CHANNELS + INPAINT_CHANNELS
"""The InP transformer's `in_channels` (33): noisy latents + mask + masked video latents, as
`EasyAnimateInpaintPipeline.__call__` checks (`num_channels_latents + num_channels_mask + num_channels_masked_image`)."""
TINY_I2V_TRANSFORMER = dict(TINY_TRANSFORMER, in_channels=I2V_IN_CHANNELS, resize_inpaint_mask_directly=True,
                            add_noise_in_inpaint_model=False)
"""The tiny preset's inpaint transformer (`model.i2v`): TINY_TRANSFORMER taking the inpaint latents. No noise
augmentation of the reference (`add_noise_in_inpaint_model: false`, EasyAnimate V5's InP): the condition latents are
then a function of the clip alone, so the encode stage can cache them."""

TINY_VAE = dict(
    in_channels=3,
    out_channels=3,
    latent_channels=LATENT_CHANNELS,
    block_out_channels=(8, 8, 8, 8),  # 4 levels -> 8x spatial, 4x temporal compression, like the real VAE
    layers_per_block=0,  # no resnets in the down/up blocks (they need equal widths): per-frame convs set the cost
    norm_num_groups=4,
    spatial_group_norm=False,
)
"""Tiny Magvit VAE (44.5 k params), same compression ratios and latent channels as EasyAnimate V5.1. Chosen for
`make demo`'s `train-vae` on 2 CPU cores: 0.17 s per step of 2 clips of 9x64x64 at 2 threads, half the time of the
(8, 16, 16, 16) x 1-resnet VAE it replaced, with the same PSNR per step (experiments of issue 30, part 1)."""
TINY_VAE_INITIAL_LOGVAR = -6.0
"""The tiny VAE's posterior log-variance at init (the logvar half of `quant_conv.bias`): its samples start with
std 0.05 instead of ~1, so that `train-vae`'s decoder sees the latents rather than noise from the first step
(the latents themselves, the posterior's mode, do not depend on it)."""


def _check_layout(transformer: EasyAnimateTransformer3DModel, vae: AutoencoderKLMagvit, where: str) -> None:
    in_channels = I2V_IN_CHANNELS if takes_inpaint_latents(transformer) else LATENT_CHANNELS
    found = (
        vae.config.latent_channels,
        vae.spatial_compression_ratio,
        vae.temporal_compression_ratio,
        transformer.config.in_channels,
        transformer.config.patch_size,
    )
    expected = (LATENT_CHANNELS, SPATIAL_COMPRESSION_RATIO, TEMPORAL_COMPRESSION_RATIO, in_channels, PATCH_SIZE)
    if found != expected:
        raise ValueError(
            f"{where}: (vae latent_channels, spatial ratio, temporal ratio, transformer in_channels, patch_size) = "
            f"{found}, but the easyanimate family expects {expected}"
        )
    _check_inpaint_transformer(transformer, where)


def takes_inpaint_latents(transformer: EasyAnimateTransformer3DModel) -> bool:
    """Whether `transformer` is an inpaint (InP, image-to-video) model: `in_channels` differs from the latent
    channels, the test `EasyAnimateInpaintPipeline.__call__` makes (`num_channels_transformer !=
    num_channels_latents`). `transformer` may be DDP-wrapped (`unwrapped`)."""
    return int(unwrapped(transformer).config.in_channels) != LATENT_CHANNELS


def _check_inpaint_transformer(transformer: EasyAnimateTransformer3DModel, where: str) -> None:
    """Raise ValueError for an inpaint transformer vidray cannot condition exactly as the stock pipeline does: a
    mask encoded by the VAE (`resize_inpaint_mask_directly: false`, 48 input channels) or noise added to the
    reference video (`add_noise_in_inpaint_model: true`: the stock pipeline draws it from the sampling generator)."""
    if not takes_inpaint_latents(transformer):
        return
    config = transformer.config
    if not config.resize_inpaint_mask_directly or config.in_channels != I2V_IN_CHANNELS:
        raise ValueError(f"{where}: inpaint transformer with in_channels {config.in_channels} and "
                         f"resize_inpaint_mask_directly {config.resize_inpaint_mask_directly}: vidray takes the "
                         f"resized-mask layout only (in_channels {I2V_IN_CHANNELS}, resize_inpaint_mask_directly true)")
    if config.add_noise_in_inpaint_model:
        raise ValueError(f"{where}: inpaint transformer with add_noise_in_inpaint_model true (noise on the reference "
                         "video) is not supported yet; set it to false in transformer/config.json to sample without it")


def _check_task(transformer: EasyAnimateTransformer3DModel, model_cfg: ModelConfig, where: str) -> None:
    """Raise ValueError when the transformer's task is not the config's: an inpaint (image-to-video) folder for a
    text-to-video config (`model.i2v` null) or a text-to-video folder for `model.i2v`."""
    if takes_inpaint_latents(transformer) and model_cfg.i2v is None:
        raise ValueError(f"{where} holds an image-to-video (inpaint, in_channels {transformer.config.in_channels}) "
                         "transformer but model.i2v is null: set model.i2v (e.g. {condition: first}) or give a "
                         "text-to-video EasyAnimatePipeline folder")
    if not takes_inpaint_latents(transformer) and model_cfg.i2v is not None:
        raise ValueError(f"{where} holds a text-to-video transformer (in_channels {transformer.config.in_channels}) "
                         f"but model.i2v is set: give an EasyAnimateInpaintPipeline folder (in_channels "
                         f"{I2V_IN_CHANNELS}) or set model.i2v to null")


def _pipeline_class(path: Path) -> type:
    """EasyAnimatePipeline or EasyAnimateInpaintPipeline, as the folder's model_index.json names it (the same
    components: either loads either's folder, but diffusers warns)."""
    class_name = json.loads((Path(path) / "model_index.json").read_text()).get("_class_name")
    return EasyAnimateInpaintPipeline if class_name == "EasyAnimateInpaintPipeline" else EasyAnimatePipeline


def _check_vae(vae: AutoencoderKLMagvit, where: str) -> None:
    found = (vae.config.latent_channels, vae.spatial_compression_ratio, vae.temporal_compression_ratio)
    expected = (LATENT_CHANNELS, SPATIAL_COMPRESSION_RATIO, TEMPORAL_COMPRESSION_RATIO)
    if found != expected:
        raise ValueError(f"{where}: vae (latent_channels, spatial ratio, temporal ratio) = {found}, but the "
                         f"easyanimate family expects {expected}")


def load_vae_folder(path: str | Path) -> AutoencoderKLMagvit:
    """The frozen `AutoencoderKLMagvit` of a local diffusers VAE folder (`config.json` + safetensors; what
    `vidray train-vae` writes to `<run>/vae`), for `model.vae_path`. Raises FileNotFoundError naming the folder and
    the fix when it holds no `config.json`, ValueError when its latent layout is not the family's."""
    path = Path(path)
    if not (path / "config.json").is_file():
        raise FileNotFoundError(f"model.vae_path {str(path)!r} is not a diffusers VAE folder (no config.json): train "
                                "one with `vidray train-vae CONFIG` (it writes <storage.path>/<name>-vae/vae) or give "
                                "the vae/ folder of a diffusers pipeline")
    vae = AutoencoderKLMagvit.from_pretrained(path, local_files_only=True)
    _check_vae(vae, str(path))
    return vae.eval().requires_grad_(False)


def _tiny_vae() -> AutoencoderKLMagvit:
    """TINY_VAE at the global RNG's state, its posterior log-variance at TINY_VAE_INITIAL_LOGVAR."""
    vae = AutoencoderKLMagvit(**TINY_VAE)
    with torch.no_grad():
        vae.quant_conv.bias[LATENT_CHANNELS:].fill_(TINY_VAE_INITIAL_LOGVAR)
    return vae


def _tiny_transformer(text_embed_dim: int, *, i2v: bool) -> EasyAnimateTransformer3DModel:
    """TINY_I2V_TRANSFORMER (`i2v`) or TINY_TRANSFORMER at the global RNG's state."""
    return EasyAnimateTransformer3DModel(**(TINY_I2V_TRANSFORMER if i2v else TINY_TRANSFORMER),
                                         text_embed_dim=text_embed_dim)


def build_tiny(text_encoder_kind: str = "tiny_random", *, seed: int = 0, i2v: bool = False) -> Components:
    """Random tiny preset: TINY_TRANSFORMER (TINY_I2V_TRANSFORMER with `i2v`) + TINY_VAE (fp32, CPU) + the chosen
    frozen text encoder.

    Initialised under `seed` inside a forked RNG (the global torch RNG is left as it was).
    """
    text_encoder, tokenizer = build_text_encoder(text_encoder_kind, seed=seed)
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        transformer = _tiny_transformer(text_encoder.config.hidden_size, i2v=i2v)
        vae = _tiny_vae()
    vae.eval().requires_grad_(False)
    transformer.train()
    return Components(transformer=transformer, vae=vae, text_encoder=text_encoder, tokenizer=tokenizer)


def save_pipeline(components: Components, out_dir: str | Path, flow: FlowConfig) -> Path:
    """Write `components` as a complete diffusers folder (safetensors) that
    `diffusers.EasyAnimatePipeline.from_pretrained(out_dir, local_files_only=True)` loads and runs offline; an
    inpaint transformer (`model.i2v`, `takes_inpaint_latents`) is written as an `EasyAnimateInpaintPipeline`.

    Adds a `FlowMatchEulerDiscreteScheduler(shift=flow.shift, num_train_timesteps=flow.num_train_timesteps)`,
    and a trivial tokenizer chat template (the pipeline calls `apply_chat_template`). `cache_mag_vae` is not
    written: AutoencoderKLMagvit drops it from its config on load (only EasyAnimateInpaintPipeline reads it, in `resize_mask`; set
    `pipe.vae.register_to_config(cache_mag_vae=True)` after loading that pipeline: the value vidray conditions
    with). Note the stock pipeline pads
    prompts to 256 tokens (`encode_prompt` default) and the transformer has no text mask, so a transformer trained
    at another `max_sequence_length` matches exactly only when given `prompt_embeds`.
    Written by `vidray.models.folders.write_pipeline_folder` (a temp folder next to `out_dir`, then renamed): `out_dir`
    is complete or absent; an existing pipeline folder at `out_dir` is replaced. Raises
    FileExistsError if `out_dir` exists and is not a pipeline folder. Returns `out_dir`.
    """
    ensure_chat_template(components.tokenizer)
    scheduler = FlowMatchEulerDiscreteScheduler(shift=flow.shift, num_train_timesteps=flow.num_train_timesteps)
    pipeline_class = EasyAnimateInpaintPipeline if takes_inpaint_latents(components.transformer) else EasyAnimatePipeline
    pipe = pipeline_class(
        vae=components.vae,
        text_encoder=components.text_encoder,
        tokenizer=components.tokenizer,
        transformer=components.transformer,
        scheduler=scheduler,
    )
    return write_pipeline_folder(pipe, out_dir)


def _process_first_frame_only(vae: AutoencoderKLMagvit) -> bool:
    """`resize_mask`'s `process_first_frame_only`: the VAE config's `cache_mag_vae` as the stock pipeline reads it,
    True when absent (AutoencoderKLMagvit drops it from its config on load; EasyAnimate V5's VAE sets it: the
    causal VAE encodes the first frame alone, so the mask's first frame maps to the first latent frame)."""
    return bool(getattr(vae.config, "cache_mag_vae", True))


@torch.no_grad()
def encode_inpaint_latents(vae: AutoencoderKLMagvit, video: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """video (B, 3, F, H, W) in [-1, 1] and mask (B, 1, F, H, W) (1 = generate, 0 = given) -> inpaint_latents
    (B, 1 + 16, F_lat, H_lat, W_lat) float32: [mask_latents, masked_video_latents] along channels.

    As EasyAnimateInpaintPipeline.__call__ step 6 with `resize_inpaint_mask_directly` (diffusers/pipelines/
    easyanimate/pipeline_easyanimate_inpaint.py): `masked_video_latents` = `prepare_mask_latents`: the masked
    video (`vidray.models.conditioning.masked_video`) encoded one sample at a time, `vae.encode(x)[0].mode() *
    scaling_factor` (no noise: `add_noise_in_inpaint_model` false); `mask_latents = resize_mask(1 - mask,
    masked_video_latents, cache_mag_vae) * scaling_factor` (trilinear, the first frame resized alone)."""
    if video.ndim != 5 or video.shape[1] != 3:
        raise ValueError(f"video must be (B, 3, F, H, W), got {tuple(video.shape)}")
    masked = masked_video(video.float(), mask.float()).to(device=execution_device(vae), dtype=compute_dtype(vae))
    scaling_factor = vae.config.scaling_factor
    latents = torch.cat([vae.encode(masked[i:i + 1])[0].mode() for i in range(masked.shape[0])]) * scaling_factor
    mask_latents = resize_mask(1 - mask.to(latents.device, torch.float32), latents, _process_first_frame_only(vae))
    mask_latents = mask_latents.to(latents.dtype) * scaling_factor
    return torch.cat([mask_latents, latents], dim=1).float()


def empty_condition(latent_shape: tuple[int, ...], device: torch.device | str | None = None) -> torch.Tensor:
    """The text-to-video inpaint latents (B, 1 + 16, F_lat, H_lat, W_lat) float32 for latents of `latent_shape`
    (B, 16, F_lat, H_lat, W_lat): zeros, as EasyAnimateInpaintPipeline gives an all-255 `mask_video` or none
    ("Use zero latents if we want to t2v": `mask_latents` (B, 1, ...) and `masked_video_latents` both zero)."""
    batch_size, _, *grid = latent_shape
    return torch.zeros(batch_size, INPAINT_CHANNELS, *grid, dtype=torch.float32, device=device)


def no_grad_parameter_names(transformer: EasyAnimateTransformer3DModel) -> list[str]:
    """Names of trainable transformer parameters that receive no gradient, found by a real probe step.

    Probe: one forward of a (1, C, 1, 2p, 2p) input with 2 text tokens, then `torch.autograd.grad` of the output
    sum w.r.t. every parameter with requires_grad (`allow_unused=True`; `.grad` fields are not touched). In
    EasyAnimateTransformer3DModel the last block's text-stream output (`attn1.to_add_out`, `txt_ff`) is never
    used, which makes DDP fail with "Expected to have finished reduction"; `requires_grad_(False)` on these.
    """
    return unused_parameter_names(transformer, probe_loss)


def probe_loss(model: torch.nn.Module, transformer: EasyAnimateTransformer3DModel) -> torch.Tensor:
    """The output sum of `model` (`transformer`, maybe DDP-wrapped) on a fixed (1, C, 1, 2p, 2p) input with 2 text
    tokens (a seeded CPU generator: the global RNG is untouched); fp32 scalar. The probe of
    `no_grad_parameter_names` and of `vidray.train.parallel.prime_buckets`. An inpaint (image-to-video)
    transformer gets its noisy latents' C = `out_channels` and the rest of its `in_channels` as `inpaint_latents`,
    as `predict` calls it."""
    cfg, param = transformer.config, next(transformer.parameters())
    dtype = input_dtype(param)  # fp32 when the base is stored in bf16 / fp8 (autocast)
    g = torch.Generator().manual_seed(0)
    p = cfg.patch_size
    channels = cfg.out_channels if takes_inpaint_latents(transformer) else cfg.in_channels
    noisy_latents = torch.randn(1, channels, 1, 2 * p, 2 * p, generator=g).to(param.device, dtype)
    prompt_embeds = torch.randn(1, 2, cfg.text_embed_dim, generator=g).to(param.device, dtype)
    timesteps = torch.full((1,), 500.0, device=param.device, dtype=dtype)
    extra = {}
    if takes_inpaint_latents(transformer):
        extra["inpaint_latents"] = torch.randn(1, cfg.in_channels - channels, 1, 2 * p, 2 * p, generator=g).to(
            param.device, dtype)
    return model(noisy_latents, timesteps, encoder_hidden_states=prompt_embeds, return_dict=False,
                 **extra)[0].float().sum()


class EasyAnimateFamily(ModelFamily):
    """EasyAnimate V5.x: latents (B, 16, (F-1)/4+1, H/8, W/8), DiT patch 2, so H and W multiples of 16."""

    name = "easyanimate"
    latent_channels = LATENT_CHANNELS
    example_bucket = (5, 32, 32)

    # Loading: the three role loaders (`ModelFamily`).

    def _folder(self, model_cfg: ModelConfig) -> Path | None:
        """`model.pretrained_path` as a pipeline folder (`model_index.json` checked: FileNotFoundError naming the
        fix), or None for the tiny preset. Raises ValueError for an unknown init or preset or an empty path."""
        folder = pretrained_folder(model_cfg, "easyanimate")
        return None if folder is None else require_pipeline_folder(folder, "EasyAnimatePipeline")

    def load_condition_models(self, model_cfg: ModelConfig, *, seed: int, text: bool = True, image: bool = True,
                              meta: bool = False) -> ConditionModels:
        """The frozen text encoder and tokenizer (EasyAnimate takes no image embeddings): a folder's `text_encoder/`
        and `tokenizer/` (the transformer and VAE not read), or `model.text_encoder` drawn under `seed` as in
        `build_tiny`; `model_cfg.text_encoder` is ignored for a folder."""
        if not text:
            return ConditionModels(text_encoder=None, tokenizer=None)
        folder = self._folder(model_cfg)
        if folder is None:
            text_encoder, tokenizer = build_text_encoder(model_cfg.text_encoder, seed=seed)
            return ConditionModels(text_encoder=on_meta(text_encoder) if meta else text_encoder, tokenizer=tokenizer)
        if meta:
            text_encoder, _ = meta_component(folder, "text_encoder")
            tokenizer = _pipeline_class(folder).from_pretrained(folder, transformer=None, vae=None, text_encoder=None,
                                                                local_files_only=True).tokenizer
            return ConditionModels(text_encoder=text_encoder.eval().requires_grad_(False),
                                   tokenizer=ensure_chat_template(tokenizer))
        pipe = _pipeline_class(folder).from_pretrained(folder, transformer=None, vae=None, local_files_only=True)
        return ConditionModels(text_encoder=pipe.text_encoder.eval().requires_grad_(False),
                               tokenizer=ensure_chat_template(pipe.tokenizer))

    def load_latent_models(self, model_cfg: ModelConfig, *, seed: int, trainable: bool = False,
                           meta: bool = False) -> LatentModels:
        """The frozen VAE: `model.vae_path` (`load_vae_folder`), else a folder's `vae/` alone, else TINY_VAE drawn
        under `seed` after the transformer, as `build_tiny` draws it. `trainable`: the one `init` gives (never
        `model.vae_path`) in train mode with gradients."""
        if model_cfg.vae_path and not trainable:
            if meta:
                vae, folder = meta_module(AutoencoderKLMagvit, model_cfg.vae_path)
                return LatentModels(vae=vae.eval().requires_grad_(False), weights_folder=folder)
            return LatentModels(vae=load_vae_folder(model_cfg.vae_path))
        folder = self._folder(model_cfg)
        weights_folder = None
        if folder is None:
            with torch.random.fork_rng(devices=[]):
                torch.manual_seed(seed)
                _tiny_transformer(text_hidden_size(model_cfg.text_encoder),
                                  i2v=model_cfg.i2v is not None)  # drawn first in build_tiny: the VAE's init follows it
                vae = _tiny_vae()
            vae = on_meta(vae) if meta else vae
        else:
            vae, weights_folder = folder_component(AutoencoderKLMagvit, folder, "vae", meta=meta)
        _check_vae(vae, str(folder or "the tiny preset"))
        vae = vae.train().requires_grad_(True) if trainable else vae.eval().requires_grad_(False)
        return LatentModels(vae=vae, weights_folder=weights_folder)

    def load_diffusion_models(self, model_cfg: ModelConfig, *, seed: int, expert: str | None = None,
                              meta: bool = False) -> DiffusionModels:
        """The transformer: the tiny preset drawn first under `seed` (as in `build_tiny`), with `text_embed_dim`
        from the text encoder's config; a pretrained folder's `transformer/` alone (its task checked against
        `model.i2v`). `meta`: from a pipeline folder's `transformer/config.json` or a transformer folder's
        `config.json` (FileNotFoundError naming the folder when it has none), with that folder. EasyAnimate has no
        experts: `expert` raises ValueError (`pick_expert`)."""
        if expert is not None:
            pick_expert(None, expert)
        if meta and model_cfg.init == "pretrained":
            path = Path(model_cfg.pretrained_path or "")
            folder = path / "transformer" if (path / "model_index.json").is_file() else path
            if not (folder / "config.json").is_file():
                raise FileNotFoundError(f"model.pretrained_path: {folder} has no config.json: give a diffusers "
                                        "pipeline folder (model_index.json, transformer/) or its transformer folder")
            config = EasyAnimateTransformer3DModel.load_config(str(folder))
            with torch.device("meta"):
                transformer = EasyAnimateTransformer3DModel.from_config(config)
            return DiffusionModels(transformer=transformer.train(), weights_folder=str(folder))
        folder = self._folder(model_cfg)
        if folder is not None:
            transformer = EasyAnimateTransformer3DModel.from_pretrained(folder, subfolder="transformer",
                                                                        local_files_only=True)
            _check_layout(transformer, meta_component(folder, "vae")[0], str(folder))  # its VAE's config alone
            _check_task(transformer, model_cfg, f"model.pretrained_path {folder}")
            return DiffusionModels(transformer=transformer.train())
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(seed)
            transformer = _tiny_transformer(text_hidden_size(model_cfg.text_encoder), i2v=model_cfg.i2v is not None)
        return DiffusionModels(transformer=(on_meta(transformer) if meta else transformer).train())

    def encode_video(self, vae: AutoencoderKLMagvit, video: torch.Tensor) -> torch.Tensor:
        """`vidray.models.vae.encode_video`: posterior mode * scaling_factor, (B, 16, (F-1)//4+1, H//8, W//8)."""
        return encode_video(vae, video)

    def decode_latents(self, vae: AutoencoderKLMagvit, latents: torch.Tensor) -> torch.Tensor:
        """`vidray.models.vae.decode_latents`: vae.decode(latents / scaling_factor + shift_factor), clamped."""
        return decode_latents(vae, latents)

    def encode_prompt(self, text_encoder, tokenizer, prompts: list[str], *, max_sequence_length: int,
                      device: torch.device | str | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        """`vidray.models.text_encoder.encode_prompts` (EasyAnimatePipeline.encode_prompt: chat template, right
        padding, hidden_states[-2])."""
        return encode_prompts(text_encoder, tokenizer, prompts, max_sequence_length=max_sequence_length,
                              device=device)


    def predict(
        self,
        transformer: EasyAnimateTransformer3DModel,
        noisy_latents: torch.Tensor,
        timesteps: torch.Tensor,
        prompt_embeds: torch.Tensor,
        prompt_attention_mask: torch.Tensor,
        *,
        inpaint_latents: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """noisy_latents (B, 16, F, H, W), timesteps (B,) = sigmas * num_train_timesteps, prompt_embeds (B, L, D),
        prompt_attention_mask (B, L) -> model_pred (B, 16, F, H, W), the velocity (noise - latents).

        Called exactly like EasyAnimatePipeline's denoising loop: timesteps cast to the latents' dtype,
        `encoder_hidden_states=prompt_embeds`; prompt_attention_mask is checked for shape but not passed (the
        stock transformer has no text mask input, and the pipeline does not use it either). An inpaint
        transformer (`takes_inpaint_latents`) needs `inpaint_latents` (B, 17, F, H, W) (`condition`: a clip's,
        an image's, or the empty one for text-to-video), passed in the latents' dtype as
        EasyAnimateInpaintPipeline does; a text-to-video one takes none. Raises ValueError otherwise.
        """
        if noisy_latents.ndim != 5:
            raise ValueError(f"noisy_latents must be (B, C, F, H, W), got {tuple(noisy_latents.shape)}")
        batch_size = noisy_latents.shape[0]
        if timesteps.shape != (batch_size,):
            raise ValueError(f"timesteps must have shape ({batch_size},), got {tuple(timesteps.shape)}")
        if prompt_embeds.ndim != 3 or prompt_embeds.shape[0] != batch_size:
            raise ValueError(f"prompt_embeds must be ({batch_size}, L, D), got {tuple(prompt_embeds.shape)}")
        if prompt_attention_mask.shape != prompt_embeds.shape[:2]:
            raise ValueError(
                f"prompt_attention_mask {tuple(prompt_attention_mask.shape)} must match prompt_embeds' (B, L) "
                f"{tuple(prompt_embeds.shape[:2])}"
            )
        inpaint = takes_inpaint_latents(transformer)
        if inpaint and inpaint_latents is None:
            raise ValueError(f"the transformer is an inpaint (image-to-video) model: pass inpaint_latents (B, "
                             f"{INPAINT_CHANNELS}, F, H, W) (family.condition without an image for text-to-video)")
        if not inpaint and inpaint_latents is not None:
            raise ValueError("inpaint_latents given to a text-to-video transformer: it takes no image condition")
        if inpaint and inpaint_latents.shape != (batch_size, INPAINT_CHANNELS, *noisy_latents.shape[2:]):
            raise ValueError(f"inpaint_latents must be ({batch_size}, {INPAINT_CHANNELS}, "
                             f"{', '.join(map(str, noisy_latents.shape[2:]))}), got {tuple(inpaint_latents.shape)}")
        dtype = noisy_latents.dtype
        model_pred = transformer(
            noisy_latents,
            timesteps.to(dtype=dtype),
            encoder_hidden_states=prompt_embeds.to(dtype=dtype),
            inpaint_latents=inpaint_latents.to(dtype=dtype) if inpaint else None,
            return_dict=False,
        )[0]
        if model_pred.shape[1] != noisy_latents.shape[1]:  # learned-sigma variants: (velocity, variance)
            model_pred, _ = model_pred.chunk(2, dim=1)
        return model_pred

    def image_inputs(self, info) -> int:
        """1 for an inpaint model (`model.i2v` set, or a stock `EasyAnimateInpaintPipeline` folder: a first image and
        an optional last one), 0 for an EasyAnimate T2V model."""
        return 1 if info.image_to_video else 0

    def condition(self, model, *, latent_shape=None, encoders=None, clip=None, image=None, last_image=None,
                  bucket=None, generator=None, device=None) -> ImageCondition | None:
        """`ModelFamily.condition` for an inpaint model (`takes_inpaint_latents`: `in_channels` 33, not 16):
        inpaint_latents (B, 17, F_lat, H_lat, W_lat) float32, None for a T2V model. A training clip's: the clip
        masked by `vidray.models.conditioning.generate_mask` (its own `model.i2v.condition` frames given), then
        `encode_inpaint_latents`, as the stock pipeline conditions on those frames. An image's (and a last one's):
        `vidray.models.conditioning.image_to_video` (get_image_to_video_latent: resized to the bucket, tiled over
        the frames) then `encode_inpaint_latents`. The empty one: zeros (module-level `empty_condition`)."""
        if not takes_image(model, takes_inpaint_latents):
            return None
        if clip is not None:
            batch_size, _, num_frames, height, width = clip.shape
            mask = generate_mask(batch_size, Bucket(num_frames, height, width), clip_condition(model)).to(clip.device)
            inpaint = encode_inpaint_latents(encoders.vae, clip, mask)
            return ImageCondition(inpaint.to(device) if device is not None else inpaint)
        if image is not None:
            video, mask = image_to_video(image, bucket, last_image)
            return ImageCondition(over_batch(encode_inpaint_latents(encoders.vae, video, mask), latent_shape, device))
        return ImageCondition(empty_condition(latent_shape, device))

    def latent_shape(self, bucket: Bucket, batch_size: int) -> tuple[int, int, int, int, int]:
        """(B, 16, (F-1)//4 + 1, H//8, W//8); e.g. Bucket(9, 64, 64), B=2 -> (2, 16, 3, 8, 8).

        Raises ValueError unless H, W are multiples of 16 (8x VAE, patch 2) and F is 1 or 4k+1."""
        validate_bucket(
            bucket,
            spatial_multiple=self.spatial_multiple,
            temporal_compression=TEMPORAL_COMPRESSION_RATIO,
        )
        if batch_size < 1:
            raise ValueError(f"batch_size must be >= 1, got {batch_size}")
        num_frames, height, width = bucket
        return (
            batch_size,
            LATENT_CHANNELS,
            (num_frames - 1) // TEMPORAL_COMPRESSION_RATIO + 1,
            height // SPATIAL_COMPRESSION_RATIO,
            width // SPATIAL_COMPRESSION_RATIO,
        )

    def no_grad_parameter_names(self, transformer: EasyAnimateTransformer3DModel) -> list[str]:
        """See module-level `no_grad_parameter_names`."""
        return no_grad_parameter_names(transformer)

    def prompt_embeds_dim(self, transformer: EasyAnimateTransformer3DModel) -> int:
        """`transformer.config.text_embed_dim` (the text encoder's hidden size: 384 for MiniLM)."""
        return int(transformer.config.text_embed_dim)

    def probe_loss(self, model: torch.nn.Module, transformer: EasyAnimateTransformer3DModel) -> torch.Tensor:
        """See module-level `probe_loss`."""
        return probe_loss(model, transformer)

    def save_pipeline(self, components: Components, out_dir: str | Path, flow: FlowConfig) -> Path:
        """See module-level `save_pipeline`."""
        return save_pipeline(components, out_dir, flow)
