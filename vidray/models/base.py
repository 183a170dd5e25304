"""The model-family protocol: what the stages, the trainer, the sampler and the exporter may ask of one
DiT + VAE + text encoder stack. Nothing outside `vidray/models/` knows a family's quirks; each family is one file
(`easyanimate.py`, ...) implementing `ModelFamily`, registered in `registry.py`.

What a family owns: loading its modules through three role loaders (`load_condition_models`: text and image
encoders; `load_latent_models`: the VAE; `load_diffusion_models`: the transformer or one expert), each able to build
on the meta device, which the base class composes (`build`, `build_encoders`),
`encode_video` (latent normalisation included: EasyAnimate scales, Wan normalises per channel), `encode_prompt`,
the image-to-video condition where the family has one (`takes_image`, `encode_clip_condition`,
`encode_image_condition`, `empty_condition`; defaults raise for text-to-video families; and for a model that also
takes image embeddings, Wan 2.1 I2V's CLIP, `takes_image_embeds` and its encoders),
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
    """Frozen image encoder of a model that takes image embeddings (`ModelFamily.takes_image_embeds`: Wan 2.1 I2V's
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

    def supports_image_to_video(self, info: Any) -> bool:
        """Whether the model that `info` (`vidray.models.export.ModelInfo`, configs only, no weights) describes
        takes a first-frame image (`input_reference` in serving, `--image` in generate): a property of the model,
        not only of the family (an EasyAnimate T2V model does not; an InP one does). A text-to-video model answers
        an image request with a 400 naming the model. Default: False (the family has no image-to-video model)."""
        return False

    def needs_last_image(self, info: Any) -> bool:
        """Whether the image-to-video model `info` describes (configs only) cannot be conditioned on a first image
        alone and needs the last one too (Wan 2.1 FLF2V, whose CLIP embeds both); what the Videos API, which takes
        one image, refuses. Default: False."""
        return False

    def takes_image(self, transformer: torch.nn.Module) -> bool:
        """Whether `transformer` is an image-to-video model, read from its config (what the sampler and the
        training step ask before passing `inpaint_latents` to `predict`). Default: False."""
        return False

    def encode_clip_condition(self, vae: torch.nn.Module, video: torch.Tensor, condition: str) -> torch.Tensor:
        """A training clip (B, 3, F, H, W) float in [-1, 1] -> its image condition (for EasyAnimate the inpaint
        latents (B, C_in, F_lat, H_lat, W_lat) float32), the clip's own `condition` frames (`model.i2v.condition`:
        `first` or `first_last`) given, exactly as the family's stock image-to-video pipeline encodes them. The
        default says the family has no image-to-video model."""
        raise NotImplementedError(f"the {self.name} family has no image-to-video model: set model.i2v to null")

    samples_image_posterior: bool = False
    """Whether the family's stock image-to-video pipeline samples the image's VAE posterior from its generator
    (CogVideoX: `retrieve_latents(vae.encode(image), generator)`) rather than taking its mode (EasyAnimate, Wan). Then
    `encode_image_condition` also takes `generator=`, a CPU generator seeded with the request's seed (`vidray
    generate --seed`, a served request's seed), which generate and serving pass only to such a family."""

    def encode_image_condition(self, vae: torch.nn.Module, image: Any, bucket: Bucket, *,
                               last_image: Any = None) -> torch.Tensor:
        """A first-frame image (PIL, uint8 (H, W, 3) array, or (3, H, W) float tensor in [0, 1]) and an optional last
        one -> the condition (1, C_in, F_lat, H_lat, W_lat) float32 of a `bucket` video, the images resized to the
        bucket as the family's stock pipeline does (what `vidray generate --image` samples with). A family with
        `samples_image_posterior` takes `generator=` too. The default says the family has no image-to-video model."""
        raise NotImplementedError(f"the {self.name} family has no image-to-video model: it takes no --image")

    def empty_condition(self, latent_shape: tuple[int, ...], device: torch.device | str | None = None) -> torch.Tensor:
        """The condition of a sample with no image (text-to-video through an image-to-video model; a training
        sample that condition dropout drops) for latents of `latent_shape` (B, C, F_lat, H_lat, W_lat). The
        default says the family has no image-to-video model."""
        raise NotImplementedError(f"the {self.name} family has no image-to-video model")

    def takes_image_embeds(self, transformer: torch.nn.Module) -> bool:
        """Whether `transformer` also takes image embeddings (B, T, D_img) beside its latent condition (Wan 2.1 I2V's
        CLIP embeddings): callers then pass `image_embeds` to `predict` too, from `encode_clip_image_embeds`,
        `encode_image_embeds` or `empty_image_embeds`, travelling beside `inpaint_latents`. Default: False."""
        return False

    def encode_clip_image_embeds(self, image_encoder: torch.nn.Module, image_processor: Any, video: torch.Tensor,
                                 condition: str) -> torch.Tensor:
        """A training clip (B, 3, F, H, W) float in [-1, 1] -> the image embeddings (B, T, D_img) float32 of its own
        `condition` frames, as the family's stock pipeline embeds those frames given as images. The default says
        the family's models take none."""
        raise NotImplementedError(f"the {self.name} family's models take no image embeddings")

    def encode_image_embeds(self, image_encoder: torch.nn.Module, image_processor: Any, image: Any, *,
                            last_image: Any = None) -> torch.Tensor:
        """A first image (and an optional last; PIL, uint8 (H, W, 3) array or (3, H, W) float tensor in [0, 1]) ->
        image embeddings (1, T, D_img) float32, as the family's stock pipeline embeds them. The default says the
        family's models take none."""
        raise NotImplementedError(f"the {self.name} family's models take no image embeddings")

    def empty_image_embeds(self, transformer: torch.nn.Module, batch_size: int,
                           device: torch.device | str | None = None) -> torch.Tensor:
        """The image embeddings (B, T, D_img) float32 of samples with no image (condition dropout; text-to-video
        through an image-to-video model), for `transformer`. The default says the family's models take none."""
        raise NotImplementedError(f"the {self.name} family's models take no image embeddings")

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

        A family with image-to-video models also takes the keyword `inpaint_latents` (B, C_in, F, H, W) (from
        `encode_clip_condition`, `encode_image_condition` or `empty_condition`), required when `takes_image`;
        callers pass it only then, so a text-to-video family's signature stays as it is. A model that
        `takes_image_embeds` also takes the keyword `image_embeds` (B, T, D_img), passed only then."""

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
