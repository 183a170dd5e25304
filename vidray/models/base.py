"""The model-family protocol: what the stages, the trainer, the sampler and the exporter may ask of one
DiT + VAE + text encoder stack. Nothing outside `vidray/models/` knows a family's quirks; each family is one file
(`easyanimate.py`, ...) implementing `ModelFamily`, registered in `registry.py`.

What a family owns: loading its modules through three role loaders (`load_condition_models`: text and image
encoders; `load_latent_models`: the VAE; `load_diffusion_models`: the transformer or one expert), each able to build
on the meta device, which the base class composes (`build`, `build_encoders`),
`encode_video` (latent normalisation included: EasyAnimate scales, Wan normalises per channel), `encode_prompt`,
the image-to-video condition where the family has one (`image_inputs`, how many images a model takes, and
`condition`, one call for a training clip's, an image's or the empty condition: a typed
`vidray.models.conditioning.ImageCondition` of inpaint latents and, for Wan 2.1 I2V's CLIP, image embeddings, or
None for a text-to-video model),
the training objective and the sampler's schedule and step (`objective`, a `vidray.diffusion.objectives.Objective`:
flow matching by default), the transformer call (`predict`), its latent layout and bucket rules (`latent_shape`; the
rules' numbers also in `vidray.buckets`, which the config checks at load), and the diffusers pipeline it exports
(`save_pipeline`).
"""

from __future__ import annotations

import abc
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from vidray.cards import FamilyCard, get_card
from vidray.config import FlowConfig, ModelConfig
from vidray.buckets import Bucket
from vidray.diffusion.objectives import FlowMatching, Objective
from vidray.models.conditioning import ImageCondition
from vidray.models.experts import ExpertSlot, TwoExperts

__all__ = ["Components", "ConditionModels", "DiffusionModels", "Encoders", "LatentModels", "ModelFamily", "on_meta"]


@dataclass
class ConditionModels:
    """What `ModelFamily.load_condition_models` gives: the frozen modules that turn a request's prompt (and image)
    into the transformer's conditioning."""

    text_encoder: torch.nn.Module | None
    """Frozen text encoder (eval, requires_grad False); None when loaded with `text=False`."""
    tokenizer: Any
    """Its tokenizer (with a chat template; see `vidray.models.text_encoder`); None with `text=False`."""
    image_encoder: torch.nn.Module | None = None
    """Frozen image encoder of a model that takes image embeddings (Wan 2.1 I2V's `CLIPVisionModel`), else None
    (also with `image=False`)."""
    image_processor: Any = None
    """Its image processor (`CLIPImageProcessor`), else None."""


@dataclass
class LatentModels:
    """What `ModelFamily.load_latent_models` gives: the video VAE."""

    vae: torch.nn.Module
    """The VAE: frozen (eval, requires_grad False), or in train mode with gradients when loaded `trainable`."""
    weights_folder: str | None = None
    """On the meta device from a folder: the folder of its safetensors; else None."""


@dataclass
class DiffusionModels:
    """What `ModelFamily.load_diffusion_models` gives: the trained denoiser."""

    transformer: torch.nn.Module
    """The transformer (UNet for AnimateDiff) in train mode: one module, one expert ("high"/"low") when asked, or
    both experts as `vidray.models.experts.TwoExperts`."""
    weights_folder: str | None = None
    """On the meta device from a pretrained folder: the folder of its safetensors (what
    `vidray.train.parallel.load_sharded_from_safetensors` reads); else None."""


def on_meta(module: torch.nn.Module) -> torch.nn.Module:
    """`module` moved to the meta device (shapes, dtypes and modes kept, no storage): a role loader's `meta=True`
    for a random preset, whose tiny modules are drawn and then dropped (a folder's are built from its configs)."""
    return module.to("meta")


@dataclass
class Components:
    """The four modules of a text-to-video model, named as in diffusers pipelines."""

    transformer: torch.nn.Module
    """The DiT: the only trained module."""
    vae: torch.nn.Module
    """Frozen video VAE (eval, requires_grad False)."""
    text_encoder: torch.nn.Module
    """Frozen text encoder (eval, requires_grad False)."""
    tokenizer: Any
    """Its tokenizer (with a chat template; see `vidray.models.text_encoder`)."""
    image_encoder: torch.nn.Module | None = None
    """Frozen image encoder of a model that takes image embeddings (`ImageCondition.image_embeds`: Wan 2.1 I2V's
    `CLIPVisionModel`), else None."""
    image_processor: Any = None
    """Its image processor (`CLIPImageProcessor`), else None."""


@dataclass
class Encoders:
    """The frozen modules the encode stages run (`vidray.data.encode`): no transformer."""

    vae: torch.nn.Module
    """Frozen video VAE (eval, requires_grad False)."""
    text_encoder: torch.nn.Module
    """Frozen text encoder (eval, requires_grad False)."""
    tokenizer: Any
    """Its tokenizer (with a chat template; see `vidray.models.text_encoder`)."""
    image_encoder: torch.nn.Module | None = None
    """Frozen image encoder (Wan 2.1 I2V's CLIP), for a model that takes image embeddings; else None."""
    image_processor: Any = None
    """Its image processor, else None."""


class ModelFamily(abc.ABC):
    """Interface of a model family. An instance may describe one model: its `objective` (whose methods get tensors
    only) and `latent_shape` get no model, so a family whose schedule or latent layout differs between its models
    (CogVideoX: the scheduler's `snr_shift_scale`, its objective's parameter; 1.5's padded latent frames) gives that
    model's instance from `for_model` / `for_transformer`, and every caller holding a concrete model asks those. For
    the other families they return the family itself."""

    name: str
    latent_channels: int
    example_bucket: tuple[int, int, int]
    """(num_frames, height, width) of a small bucket the family takes: what the conformance test of every family
    (`tests/unit/test_families.py`) trains, samples and decodes at."""
    objective: Objective = FlowMatching()
    """The training objective and sampler (`vidray.diffusion.objectives`): `noisy_latents`, `training_target`,
    `model_timesteps`, `inference_sigmas`, `sampler_step`, what the training step, the sampler, serving's Denoiser and
    validation call (`family.objective.X(...)`); `objective.name` says which. The default is rectified flow
    (EasyAnimate, Wan: `FlowMatching`, target = noise - latents); a family trained otherwise gives its own (CogVideoX:
    v-prediction, AnimateDiff: epsilon, each a `DDIM` on its model's schedule)."""

    @property
    def card(self) -> FamilyCard:
        """This family's card (`vidray.cards`): its bucket rules, capabilities and planner facts."""
        return get_card(self.name)

    @property
    def spatial_multiple(self) -> int:
        """Video height and width must be multiples of this (pixels: VAE downsampling x DiT patch size): the card's
        bucket rule, written once there."""
        return self.card.bucket_rules.spatial_multiple

    @property
    def temporal_compression_ratio(self) -> int:
        """The VAE's frame compression (1: none, any num_frames), the card's bucket rule."""
        return self.card.bucket_rules.temporal_compression

    def for_model(self, model_cfg: ModelConfig) -> "ModelFamily":
        """This family for the one model `model_cfg` describes (`init: pretrained`: the folder's configs, read
        without weights; `init: random`: the preset), whose `objective` and `latent_shape` follow that model. Raises as
        `check_trainable` does for a folder the family cannot run. Default: `self` (nothing differs per model)."""
        return self

    def for_transformer(self, transformer: torch.nn.Module) -> "ModelFamily":
        """This family for the model of `transformer` (maybe DDP-wrapped), which this family built or loaded: its
        `objective` and `latent_shape` follow that model. Default: `self`."""
        return self

    # Loading: three role loaders a family implements; `build` and `build_encoders` compose them (and
    # `vidray.models.export.load_pipeline_folder`, a whole local pipeline folder whatever its task).

    @abc.abstractmethod
    def load_condition_models(self, model_cfg: ModelConfig, *, seed: int, text: bool = True, image: bool = True,
                              meta: bool = False) -> ConditionModels:
        """The frozen text encoder and tokenizer (`text`) and, for a model that takes image embeddings
        (`model.i2v.image_encoder`: Wan 2.1 I2V's CLIP), its image encoder and processor (`image`; else None):
        the random preset's drawn under `seed` (as `build` draws them), or `model.pretrained_path`'s, nothing else
        of the folder read. `meta`: on the meta device (shapes, no weights; a folder's from its configs).
        Raises ValueError for an unknown init or preset or an empty path, FileNotFoundError naming a folder that is
        not one the family loads."""

    @abc.abstractmethod
    def load_latent_models(self, model_cfg: ModelConfig, *, seed: int, trainable: bool = False,
                           meta: bool = False) -> LatentModels:
        """The frozen VAE: `model.vae_path` when set, else the random preset's (drawn under `seed` as `build` draws
        it) or `model.pretrained_path`'s `vae/` alone (what `vidray.data.encode.vae_identity` hashes). `trainable`:
        the VAE `vidray train-vae` trains (`vidray.train.vae`), in train mode with gradients, the one `init` gives,
        never `model.vae_path`; a family whose VAE does not train here raises NotImplementedError naming it (a
        one-line UserError in `train-vae`). `meta`: on the meta device (shapes, no weights), with the folder of its
        weights when from a folder."""

    @abc.abstractmethod
    def load_diffusion_models(self, model_cfg: ModelConfig, *, seed: int, expert: str | None = None,
                              meta: bool = False) -> DiffusionModels:
        """The trainable transformer in train mode, without the VAE or the text encoder: the random preset's drawn
        under `seed` (as `build` draws it), or `model.pretrained_path`'s; both experts as `TwoExperts` for
        `model.experts`, or the one `expert` ("high": diffusers' `transformer`, "low": `transformer_2`) alone, the
        other never held (what a serving stage of one expert loads). `meta`: on the meta device (shapes, no
        weights; a folder's from its config) with the folder of its safetensors (`weights_folder`), what FSDP's
        sharded load reads. Raises ValueError (`pick_expert`) for another expert name or a model without experts,
        ValueError naming the family and the fix for a meta build it cannot give."""

    def build(self, model_cfg: ModelConfig, *, seed: int) -> Components:
        """Every module of the model `model_cfg` names (random init of `model_cfg.preset` under `seed`, or
        `model_cfg.pretrained_path`, a local folder; `model.vae_path` replaces the VAE): the three role loaders'.
        Raises as they do."""
        condition = self.load_condition_models(model_cfg, seed=seed)
        latent = self.load_latent_models(model_cfg, seed=seed)
        diffusion = self.load_diffusion_models(model_cfg, seed=seed)
        return Components(transformer=diffusion.transformer, vae=latent.vae, text_encoder=condition.text_encoder,
                          tokenizer=condition.tokenizer, image_encoder=condition.image_encoder,
                          image_processor=condition.image_processor)

    def image_inputs(self, info: Any) -> int:
        """How many images the model that `info` (`vidray.models.export.ModelInfo`, configs only, no weights)
        describes takes: 0, a text-to-video model (an image request is answered with a 400 naming the model, `vidray
        generate --image` refused); 1, a first image (`input_reference` in serving, `--image` in generate) and, where
        the family's pipeline has one, an optional last one (`--last-image`); 2, a first and a last image both (Wan
        2.1 FLF2V, whose CLIP embeds both: what the Videos API, which takes one image, refuses). A property of the
        model, not only of the family (an EasyAnimate T2V model takes none; an InP one takes one). Default: 0."""
        return 0

    def condition(self, model: "torch.nn.Module | ModelConfig | None", *,
                  latent_shape: tuple[int, ...] | None = None, encoders: Any = None, clip: torch.Tensor | None = None,
                  image: Any = None, last_image: Any = None, bucket: Bucket | None = None,
                  generator: torch.Generator | None = None,
                  device: torch.device | str | None = None) -> ImageCondition | None:
        """The image-to-video condition (`vidray.models.conditioning.ImageCondition`) of a batch, the one entry point
        of the conditioning rule; None for a text-to-video model. `model` says what the model takes: its transformer
        (read from the transformer's config, maybe DDP-wrapped), its `ModelConfig` (`model.i2v`, with
        `model.i2v.image_encoder` for image embeddings), or None where the caller holds neither and knows the model
        takes an image (serving's VAE stage; then `encoders.image_encoder` says whether image embeddings come too).
        One of three, as the family's stock image-to-video pipeline makes it:

        - `clip` (B, 3, F, H, W) float in [-1, 1], a training clip, with `model` a ModelConfig: the clip's own
          `model.i2v.condition` frames (`first` or `first_last`) given (what the encode stage caches);
        - `image` (PIL, uint8 (H, W, 3) array or (3, H, W) float tensor in [0, 1]) and an optional `last_image`
          for a `bucket` video, the images resized to it as the stock pipeline does, repeated over
          `latent_shape[0]` samples (1 without `latent_shape`); `generator` is the CPU generator (seeded with the
          request's seed) a family that samples the image's VAE posterior (CogVideoX) draws from, ignored by the
          others;
        - neither: the empty condition (zeros) of samples without an image, for latents of `latent_shape` (B, C,
          F_lat, H_lat, W_lat): text-to-video through an image-to-video model, a sample condition dropout drops.

        `encoders` (for `clip` and `image`): anything with the frozen `vae`, `image_encoder` and `image_processor`
        (`Components`, `Encoders`). Tensors are float32, on `device` when given (else where the encoders put
        them). Raises ValueError (UserError for a user's images) for a condition the model cannot take. Default:
        None, the family has no image-to-video model (`vidray.models.registry` refuses a card that claims one)."""
        return None

    def check_trainable(self, model_cfg: ModelConfig) -> None:
        """Raise ValueError (one line: what and the fix) when `model_cfg` names a model the family loads, samples and
        serves but cannot train here; what `vidray train` checks on the driver before anything is reserved.
        Default: every model the family builds trains."""

    @abc.abstractmethod
    def encode_video(self, vae: torch.nn.Module, video: torch.Tensor) -> torch.Tensor:
        """video (B, 3, F, H, W) float in [-1, 1] -> latents (B, C_lat, F_lat, H_lat, W_lat) float32, normalised
        as the family's pipeline expects them (deterministic: the posterior's mode)."""

    @abc.abstractmethod
    def decode_latents(self, vae: torch.nn.Module, latents: torch.Tensor) -> torch.Tensor:
        """latents (B, C_lat, F_lat, H_lat, W_lat) as `encode_video` gives them -> video (B, 3, F, H, W) float32
        clamped to [-1, 1], as the family's pipeline decodes them (what the sampler, serving's decode stage and
        the demo's comparison call)."""

    @abc.abstractmethod
    def encode_prompt(self, text_encoder: torch.nn.Module, tokenizer: Any, prompts: list[str], *,
                      max_sequence_length: int, device: torch.device | str | None = None,
                      ) -> tuple[torch.Tensor, torch.Tensor]:
        """B prompts -> prompt_embeds (B, L, D) float32 and prompt_attention_mask (B, L) bool, L =
        max_sequence_length, as the family's pipeline encodes them, on `device` (default: the text encoder's)."""

    @abc.abstractmethod
    def predict(
        self,
        transformer: torch.nn.Module,
        noisy_latents: torch.Tensor,
        timesteps: torch.Tensor,
        prompt_embeds: torch.Tensor,
        prompt_attention_mask: torch.Tensor,
    ) -> torch.Tensor:
        """noisy_latents (B, C, F, H, W), timesteps (B,), prompt_embeds (B, L, D), prompt_attention_mask (B, L)
        -> model_pred (B, C, F, H, W): the velocity, called exactly as the family's stock diffusers pipeline does.

        A family with image-to-video models also takes the keywords of `condition(...).predict_kwargs()`:
        `inpaint_latents` (B, C_in, F, H, W), required for an image-to-video model, and `image_embeds` (B, T, D_img)
        for a model that takes them; callers pass them only then (`condition` is None for a text-to-video model), so
        a text-to-video family's signature stays as it is."""

    @abc.abstractmethod
    def latent_shape(self, bucket: Bucket, batch_size: int) -> tuple[int, int, int, int, int]:
        """(B, C_lat, F_lat, H_lat, W_lat) of a batch of `bucket` clips. Raises ValueError for a bucket the VAE/DiT
        cannot take."""

    @abc.abstractmethod
    def no_grad_parameter_names(self, transformer: torch.nn.Module) -> list[str]:
        """Trainable transformer parameters that get no gradient in a forward+backward (freeze them for DDP)."""

    def prompt_embeds_dim(self, transformer: torch.nn.Module) -> int:
        """D of the `prompt_embeds` (B, L, D) `transformer` takes (its text projection's input width): what
        `vidray doctor --measure` feeds a simulated step. Families override it; the default says it is missing."""
        raise NotImplementedError(f"{type(self).__name__} has no prompt_embeds_dim")

    def block_lists(self, transformer: torch.nn.Module) -> list[torch.nn.ModuleList] | None:
        """The `nn.ModuleList`s of the transformer's blocks that activation checkpointing wraps and FSDP2 shards
        one by one (`vidray.train.parallel`): the family card's `blocks` attribute of the
        transformer, of each expert of a `TwoExperts`, or of the expert of an `ExpertSlot`; None for a family
        without one (AnimateDiff) or a transformer that lacks it."""
        if isinstance(transformer, TwoExperts):
            modules = [transformer.transformer, transformer.transformer_2]
        else:
            modules = [transformer.first_expert if isinstance(transformer, ExpertSlot) else transformer]
        attribute = self.card.blocks
        lists = [getattr(module, attribute, None) if attribute else None for module in modules]
        return lists if all(isinstance(blocks, torch.nn.ModuleList) for blocks in lists) else None

    def restore_buffers(self, transformer: torch.nn.Module) -> None:
        """Re-create the non-persistent buffers (no weights file holds them) of a transformer built on the meta
        device and materialised with `to_empty` (their values are garbage then). Default: none to restore."""

    def probe_loss(self, model: torch.nn.Module, transformer: torch.nn.Module) -> torch.Tensor:
        """A scalar loss of one tiny fixed input through `model` (`transformer`, maybe DDP-wrapped): what
        `vidray.train.parallel.prime_buckets` backpropagates. Families override it; the default says it is missing."""
        raise NotImplementedError(f"{type(self).__name__} has no probe_loss: train.grad_compression: powersgd needs it")

    @abc.abstractmethod
    def save_pipeline(self, components: Components, out_dir: str | Path, flow: FlowConfig) -> Path:
        """Write a complete diffusers pipeline folder that the stock pipeline class loads offline."""

    def build_encoders(self, model_cfg: ModelConfig, *, seed: int) -> Encoders:
        """The frozen VAE, text encoder and tokenizer (and image encoder and processor, for a model that takes image
        embeddings) alone, equal to `build`'s: what the encode stages load (`vidray.data.encode`)."""
        condition = self.load_condition_models(model_cfg, seed=seed)
        return Encoders(vae=self.load_latent_models(model_cfg, seed=seed).vae, text_encoder=condition.text_encoder,
                        tokenizer=condition.tokenizer, image_encoder=condition.image_encoder,
                        image_processor=condition.image_processor)
