"""The model-family protocol: what the stages, the trainer, the sampler and the exporter may ask of one
DiT + VAE + text encoder stack. Nothing outside `vidray/models/` knows a family's quirks; each family is one file
(`easyanimate.py`, ...) implementing `ModelFamily`, registered in `registry.py`.

What a family owns: building its modules (`build`, `build_transformer`, `build_encoders`, `load_pretrained`),
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
from vidray.models.experts import ExpertSlot, TwoExperts, pick_expert

__all__ = ["Components", "Encoders", "ModelFamily"]


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
    spatial_compression_ratio: int
    temporal_compression_ratio: int
    spatial_multiple: int
    """Video height and width must be multiples of this (pixels): VAE downsampling x DiT patch size."""
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

    def for_model(self, model_cfg: ModelConfig) -> "ModelFamily":
        """This family for the one model `model_cfg` describes (`init: pretrained`: the folder's configs, read
        without weights; `init: random`: the preset), whose `objective` and `latent_shape` follow that model. Raises as
        `check_trainable` does for a folder the family cannot run. Default: `self` (nothing differs per model)."""
        return self

    def for_transformer(self, transformer: torch.nn.Module) -> "ModelFamily":
        """This family for the model of `transformer` (maybe DDP-wrapped), which this family built or loaded: its
        `objective` and `latent_shape` follow that model. Default: `self`."""
        return self

    @abc.abstractmethod
    def build(self, model_cfg: ModelConfig, *, seed: int) -> Components:
        """Random init of `model_cfg.preset` under `seed`, or load `model_cfg.pretrained_path` (local folder)."""

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

    def build_image_encoder(self, model_cfg: ModelConfig, *, seed: int) -> tuple[torch.nn.Module, Any] | None:
        """The frozen image encoder and its processor alone, equal to `build_encoders`'s, or None for a model that
        takes no image embeddings (what `vidray.data.encode.vae_identity` hashes with the VAE). Default: None."""
        return None

    def check_trainable(self, model_cfg: ModelConfig) -> None:
        """Raise ValueError (one line: what and the fix) when `model_cfg` names a model the family loads, samples and
        serves but cannot train here; what `vidray train` checks on the driver before anything is reserved.
        Default: every model the family builds trains."""

    def build_transformer(self, model_cfg: ModelConfig, *, seed: int) -> torch.nn.Module:
        """The trainable transformer alone (what a DiT trainer loads), equal to `build(...).transformer`.
        Default: `build` and drop the rest; families override it to skip loading the VAE and text encoder."""
        return self.build(model_cfg, seed=seed).transformer

    def build_expert(self, model_cfg: ModelConfig, *, seed: int, expert: str) -> torch.nn.Module:
        """One expert of a two-expert model (`model.experts`, `vidray.models.experts.TwoExperts`): "high"
        (diffusers' `transformer`) or "low" (`transformer_2`), what a serving stage of one expert loads. Default:
        `build_transformer` (both experts) and keep the one; a family that loads a folder's experts one by one
        overrides it, so a stage never holds the other expert. Raises ValueError (`pick_expert`) for another name
        or a model without experts."""
        return pick_expert(self.build_transformer(model_cfg, seed=seed), expert)

    def build_encoders(self, model_cfg: ModelConfig, *, seed: int) -> Encoders:
        """The frozen VAE, text encoder and tokenizer alone (what the encode stages load), equal to `build`'s.
        Default: `build` and drop the transformer."""
        c = self.build(model_cfg, seed=seed)
        return Encoders(vae=c.vae, text_encoder=c.text_encoder, tokenizer=c.tokenizer)

    def build_text_encoder(self, model_cfg: ModelConfig, *, seed: int) -> tuple[torch.nn.Module, Any]:
        """The frozen text encoder and its tokenizer alone, equal to `build_encoders`'s (what serving's text stage
        loads). Default: `build_encoders` and drop the VAE; families override it to skip loading the VAE."""
        encoders = self.build_encoders(model_cfg, seed=seed)
        return encoders.text_encoder, encoders.tokenizer

    def build_vae(self, model_cfg: ModelConfig, *, seed: int) -> torch.nn.Module:
        """The frozen VAE alone, equal to `build_encoders(...).vae` (what `vidray.data.encode.vae_identity` hashes
        to name the latent cache's entries). Default: `build_encoders` and drop the text encoder; families
        override it to skip loading the text encoder."""
        return self.build_encoders(model_cfg, seed=seed).vae

    def build_trainable_vae(self, model_cfg: ModelConfig, *, seed: int) -> torch.nn.Module:
        """The VAE that `vidray train-vae` trains (`vidray.train.vae`), in train mode with gradients: the one
        `init` gives (the preset's under `seed`, or a pretrained folder's `vae/`), never `model.vae_path`. The
        default says the family's VAE does not train here (raised as a one-line UserError by `train-vae`)."""
        raise NotImplementedError(f"the {self.name} family's VAE cannot be trained by vidray train-vae yet")

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

    def load_vae(self, path: str | Path) -> torch.nn.Module:
        """The frozen VAE of a local diffusers VAE folder (what `vidray train-vae` writes, what `model.vae_path`
        names). The default says the family has none to load; families override it."""
        raise NotImplementedError(f"the {self.name} family cannot load a VAE folder (model.vae_path) yet")

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

    def build_transformer_on_meta(self, model_cfg: ModelConfig) -> tuple[torch.nn.Module, str]:
        """(the pretrained transformer built on the meta device from its folder's config: shapes, no weights; the
        folder of its safetensors), for sharded training (`vidray.train.parallel.load_sharded_from_safetensors`).
        Families that train large pretrained models with FSDP override it; the default raises ValueError naming
        the family (the config refuses the combination at load unless the card says `meta_build`)."""
        raise ValueError(f"model.init: pretrained with scaling.strategy: fsdp is not supported for {self.name} yet: "
                         "use scaling.strategy: ddp")

    def build_expert_on_meta(self, model_cfg: ModelConfig, *, expert: str) -> tuple[torch.nn.Module, str]:
        """One expert of a pretrained two-expert folder on the meta device and the folder of its safetensors (what
        `build_transformer_on_meta` is for one transformer): for FSDP within an expert's worker group. Families
        with a two-expert model override it; the default raises ValueError naming the family."""
        raise ValueError(f"model.experts with model.init: pretrained and scaling.strategy: fsdp is not supported for "
                         f"{self.name}: use scaling.strategy: ddp")

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

    @abc.abstractmethod
    def load_pretrained(self, path: str | Path) -> Components:
        """Load components from a local diffusers folder (never a hub id)."""
