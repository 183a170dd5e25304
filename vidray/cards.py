"""Family cards: everything the rest of vidray asks about a model family, in one light record per family.

A card is plain data (no torch, no diffusers), so the config validates `model.family`, the bucket rules and the
planner's facts before anything heavy is imported; the family's class (`vidray.models.base.ModelFamily`, which
imports diffusers) is named by `family_class` and imported on first use by `vidray.models.registry`. The module
imports nothing of vidray but the plain-data `vidray.shape_presets`: it sits below the config, which validates
`model.family` against it.

```python
card = get_card("wan")              # ValueError naming the registered cards
card.bucket_rules.spatial_multiple  # 16
card.blocks                         # "blocks": the ModuleList FSDP2 shards and block swap streams
card.planner.lora_targets           # what the planner's activation formula models
```

The four built-in families are registered below (`BUILTIN_CARDS`). Another family needs no edit under `vidray/`:
write its `ModelFamily` subclass and its card in one module and register the card, in-process with `register_card`
or, for every process of a run (Ray workers, encode actors, serve replicas), by naming it in `VIDRAY_FAMILY_CARDS`
(`module:attribute`, comma-separated; read when the registry is first used). `docs/adding-a-family.md` shows the
steps. As torchtitan's `ModelSpec` and finetrainers' `ModelSpecification`: one record and one registry entry.
"""

from __future__ import annotations

import dataclasses
import importlib
import importlib.util
import os
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, Literal, get_args

from vidray.shape_presets import COGVIDEOX_PRESETS, EASYANIMATE_PRESETS, WAN_PRESETS, ShapePreset

__all__ = ["BUILTIN_CARDS", "BucketRules", "FAMILY_CARDS_ENV", "FamilyCard", "FamilyCardError", "PlannerFacts",
           "all_cards", "card_for_pipeline", "get_card", "register_card", "unregister_card"]

FAMILY_CARDS_ENV = "VIDRAY_FAMILY_CARDS"
"""Environment variable naming extra cards to register, `module:attribute` comma-separated (each attribute a
`FamilyCard`); every vidray process reads it when its registry is first used."""

Objective = Literal["flow_matching", "ddim"]
TokenFlow = Literal["dual_stream", "single_stream", "cross_attention"]


class _Required:
    def __repr__(self) -> str:
        return "<required>"


_MISSING: Any = _Required()
"""The default of a required card field: a card left without it is refused naming the field."""


class FamilyCardError(ValueError):
    """A card that cannot be registered (a missing or malformed field, a second card with one name, a family
    module that cannot be found or imported); the message names the card and the field."""


@dataclass(frozen=True)
class BucketRules:
    """spatial_multiple: height and width must be multiples of it (pixels: VAE downsampling x DiT patch size);
    temporal_compression: the causal video VAE's frame compression; num_frames must be 1 or k * frame_step + 1,
    frame_step defaulting to temporal_compression (1: any)."""

    spatial_multiple: int
    temporal_compression: int
    frame_step: int | None = None
    """num_frames - 1 must be a multiple of it; None: `temporal_compression`. CogVideoX: 8 (`vidray.buckets`)."""
    max_frames: int | None = None
    """The most frames a clip may have; None: no limit. AnimateDiff: 32, the frames its motion modules'
    positional embeddings cover (`motion_max_seq_length` of the v1.5-v3 adapters)."""

    @property
    def num_frames_step(self) -> int:
        """`frame_step`, or `temporal_compression` when it is None."""
        return self.frame_step or self.temporal_compression


@dataclass(frozen=True, kw_only=True)
class PlannerFacts:
    """What `vidray.train.plan` needs to plan a family's transformer from its shape alone (meta-device build and
    the per-token activation census); a card without them is planned by measuring (`plan_measured`)."""

    transformer_class: str
    """The diffusers class of the transformer (built on the meta device to count parameters)."""
    text_width_key: str
    """The transformer config key holding the text encoder's hidden size (`text_dim`, `text_embed_dim`)."""
    token_flow: TokenFlow
    """How text and video tokens go through a block, which picks the activation formula
    (`vidray.train.plan.block_activation_bytes`): `dual_stream` (MMDiT: each stream its own projections and MLP,
    text updated by every block: EasyAnimate), `single_stream` (one set of layers over the joint sequence:
    CogVideoX) or `cross_attention` (self-attention over video tokens, cross-attention to a text tensor shared by
    all blocks: Wan)."""
    lora_targets: tuple[str, ...]
    """LoRA target modules the activation formula models (peft `target_modules` suffixes): the attention
    projections of every stream."""
    ffn_dim_key: str | None = None
    """The config key of the MLP's hidden width; None: 4 x the model width (diffusers' `FeedForward` default)."""
    presets: tuple[ShapePreset, ...] = ()
    """The family's shape presets (`vidray plan --preset NAME`, `vidray.shape_presets.ShapePreset`): real models'
    transformer configs and encoder sizes. Names are unique across the registered cards."""
    tiny_preset: str | None = None
    """The name of the preset in `presets` that `model.preset: tiny` with `init: random` plans."""


@dataclass(frozen=True, kw_only=True)
class FamilyCard:
    """One model family, as the rest of vidray sees it. Required: every field without a default below; a card
    left without one is refused by `register_card` naming the field."""

    name: str
    """`model.family` of a job (an identifier)."""
    family_class: str = _MISSING
    """"module:Class" of its `vidray.models.base.ModelFamily` subclass (imported on first use)."""
    bucket_rules: BucketRules = _MISSING
    """Which (num_frames, height, width) its VAE and DiT take (`vidray.buckets` documents the built-ins)."""
    objective: Objective = _MISSING
    """`flow_matching` (trains on `flow.shift` / `flow.num_train_timesteps`) or `ddim` (its folder's own
    1000-step DDIM schedule: epsilon or v-prediction; the config then requires num_train_timesteps 1000)."""
    text_seq_len: int = _MISSING
    """Prompt tokens of its stock pipeline (`max_sequence_length`), for a stock folder without vidray's job file."""
    pipelines: Mapping[str, bool] = _MISSING
    """{stock diffusers pipeline class: is it image-to-video}, e.g. {"WanPipeline": False,
    "WanImageToVideoPipeline": True}: which `model_index.json` folders load as this family."""
    blocks: str | None = None
    """The transformer's `nn.ModuleList` of blocks that activation checkpointing wraps, FSDP2 shards and block swap
    streams; None (AnimateDiff's UNet): DDP only, the config refuses fsdp / hsdp, `every_<n>` AC and block swap."""
    meta_build: bool = False
    """Its pretrained transformer builds on the meta device (`ModelFamily.load_diffusion_models(meta=True)`), so each
    FSDP rank loads only its shards; False: the config refuses `init: pretrained` with fsdp / hsdp."""
    experts: bool = False
    """It has a two-expert model (`model.experts`: Wan 2.2 A14B)."""
    context_parallel: bool = False
    """Its transformer can split one sample's tokens over workers (`parallel.context`): a context-parallel plan and
    attention processors for it exist in `vidray.models.context_parallel`."""
    clip_image_encoder: bool = False
    """Its image-to-video transformer takes CLIP image embeddings (`model.i2v.image_encoder`: Wan 2.1 I2V)."""
    fp32_vae: bool = False
    """Its VAE computes in float32 whatever the storage dtype (diffusers' Wan examples load `AutoencoderKLWan` in
    float32 beside a bf16 pipeline); False: the VAE follows the inference compute dtype."""
    planner: PlannerFacts | None = None
    """The planner's facts; None: planned by measuring a step of the tiny model."""

    @property
    def image_to_video(self) -> bool:
        """Whether `model.i2v` can build an image-to-video model (one of its stock pipelines is one)."""
        return any(self.pipelines.values())

    @property
    def module(self) -> str:
        """The module of `family_class`."""
        return self.family_class.partition(":")[0]

    def __post_init__(self) -> None:
        if not isinstance(self.name, str) or not self.name.isidentifier():
            raise FamilyCardError(f"family card {self.name!r}: name must be an identifier, e.g. 'wan'")
        for f in dataclasses.fields(self):
            if getattr(self, f.name) is _MISSING:
                raise FamilyCardError(f"family card {self.name!r}: field {f.name} is missing")
        module, _, cls = self.family_class.partition(":") if isinstance(self.family_class, str) else ("", "", "")
        if not module or not cls.isidentifier():
            raise FamilyCardError(f"family card {self.name!r}: family_class must be 'module:Class', got "
                                  f"{self.family_class!r}")
        if not isinstance(self.bucket_rules, BucketRules):
            raise FamilyCardError(f"family card {self.name!r}: bucket_rules must be a BucketRules")
        if self.objective not in get_args(Objective):
            raise FamilyCardError(f"family card {self.name!r}: objective must be flow_matching or ddim, got "
                                  f"{self.objective!r}")
        if not isinstance(self.text_seq_len, int) or self.text_seq_len < 1:
            raise FamilyCardError(f"family card {self.name!r}: text_seq_len must be a positive int")
        if not isinstance(self.pipelines, Mapping) or not self.pipelines:
            raise FamilyCardError(f"family card {self.name!r}: pipelines must map at least one stock pipeline "
                                  "class to whether it is image-to-video")
        if self.planner is not None and not isinstance(self.planner, PlannerFacts):
            raise FamilyCardError(f"family card {self.name!r}: planner must be a PlannerFacts or None")
        if self.planner is not None and self.planner.token_flow not in get_args(TokenFlow):
            raise FamilyCardError(f"family card {self.name!r}: planner.token_flow must be dual_stream, "
                                  f"single_stream or cross_attention, got {self.planner.token_flow!r}")
        if self.planner is not None and self.blocks is None:
            raise FamilyCardError(f"family card {self.name!r}: planner is set but blocks is None (the planner "
                                  "counts a list of transformer blocks)")
        if self.planner is not None:
            self._check_presets(self.planner)

    def _check_presets(self, planner: PlannerFacts) -> None:
        names = [getattr(preset, "name", None) for preset in planner.presets]
        for preset in planner.presets:
            if not isinstance(preset, ShapePreset) or preset.family != self.name:
                raise FamilyCardError(f"family card {self.name!r}: planner.presets must be ShapePresets of family "
                                      f"{self.name!r}, got {preset!r:.80}")
        if len(set(names)) != len(names):
            raise FamilyCardError(f"family card {self.name!r}: planner.presets name one preset twice: {names}")
        if planner.tiny_preset is not None and planner.tiny_preset not in names:
            raise FamilyCardError(f"family card {self.name!r}: planner.tiny_preset {planner.tiny_preset!r} is not "
                                  f"one of planner.presets ({', '.join(names) or 'none'})")


_LORA_ATTENTION = ("to_q", "to_k", "to_v", "to_out.0")  # = vidray.config.DEFAULT_LORA_TARGET_MODULES (a test checks)

BUILTIN_CARDS: tuple[FamilyCard, ...] = (
    FamilyCard(
        name="easyanimate", family_class="vidray.models.easyanimate:EasyAnimateFamily",
        bucket_rules=BucketRules(spatial_multiple=16, temporal_compression=4), objective="flow_matching",
        text_seq_len=256, pipelines={"EasyAnimatePipeline": False, "EasyAnimateInpaintPipeline": True},
        blocks="transformer_blocks", meta_build=True, context_parallel=True,
        planner=PlannerFacts(transformer_class="EasyAnimateTransformer3DModel", text_width_key="text_embed_dim",
                             token_flow="dual_stream", presets=EASYANIMATE_PRESETS, tiny_preset="tiny",
                             lora_targets=(*_LORA_ATTENTION, "add_q_proj", "add_k_proj", "add_v_proj", "to_add_out"))),
    FamilyCard(
        name="wan", family_class="vidray.models.wan:WanFamily",
        bucket_rules=BucketRules(spatial_multiple=16, temporal_compression=4), objective="flow_matching",
        text_seq_len=512, pipelines={"WanPipeline": False, "WanImageToVideoPipeline": True},
        blocks="blocks", meta_build=True, experts=True, clip_image_encoder=True, fp32_vae=True, context_parallel=True,
        planner=PlannerFacts(transformer_class="WanTransformer3DModel", text_width_key="text_dim",
                             token_flow="cross_attention", ffn_dim_key="ffn_dim", presets=WAN_PRESETS,
                             tiny_preset="wan-tiny",
                             lora_targets=_LORA_ATTENTION)),
    FamilyCard(
        name="cogvideox", family_class="vidray.models.cogvideox:CogVideoXFamily",
        bucket_rules=BucketRules(spatial_multiple=16, temporal_compression=4, frame_step=8), objective="ddim",
        text_seq_len=226, pipelines={"CogVideoXPipeline": False, "CogVideoXImageToVideoPipeline": True},
        blocks="transformer_blocks", context_parallel=True,
        planner=PlannerFacts(transformer_class="CogVideoXTransformer3DModel", text_width_key="text_embed_dim",
                             token_flow="single_stream", presets=COGVIDEOX_PRESETS,
                             tiny_preset="cogvideox-tiny",
                             lora_targets=_LORA_ATTENTION)),  # one set of projections serves text and video
    FamilyCard(
        name="animatediff", family_class="vidray.models.animatediff:AnimateDiffFamily",
        bucket_rules=BucketRules(spatial_multiple=64, temporal_compression=1, max_frames=32), objective="ddim",
        text_seq_len=77, pipelines={"AnimateDiffPipeline": False}),
)
"""The built-in families. Sources of each value: `vidray.buckets` (bucket rules), the stock pipelines'
`max_sequence_length` defaults (EasyAnimate 256, Wan 512, CogVideoX 226, CLIP's 77 for AnimateDiff),
`vidray.train.plan` (the activation census per token flow), `vidray.models.offload` (Wan's fp32 VAE)."""

_CARDS: dict[str, FamilyCard] = {}
_plugins_loaded = False


def _check_module(card: FamilyCard) -> None:
    """Raise FamilyCardError unless the card's module can be found (without importing it: a family module imports
    diffusers, seconds of CPU, and the config checks run in the driver)."""
    try:
        found = importlib.util.find_spec(card.module) is not None
    except (ImportError, ValueError) as err:
        raise FamilyCardError(f"family card {card.name!r}: family_class module {card.module!r} cannot be found "
                              f"({err})") from None
    if not found:
        raise FamilyCardError(f"family card {card.name!r}: family_class module {card.module!r} cannot be found; "
                              "put it on PYTHONPATH or fix the name")


def register_card(card: FamilyCard) -> FamilyCard:
    """Register `card` (its module is found, not imported). Returns it. Raises FamilyCardError when a card of that
    name is registered already or the module cannot be found."""
    if not isinstance(card, FamilyCard):
        raise FamilyCardError(f"register_card takes a FamilyCard, got {type(card).__name__}")
    _load_plugins()
    if card.name in _CARDS:
        raise FamilyCardError(f"family card {card.name!r}: name is registered already (by "
                              f"{_CARDS[card.name].family_class}); give the family another name")
    taken = {preset.name: other.name for other in _CARDS.values() if other.planner for preset in other.planner.presets}
    for preset in card.planner.presets if card.planner else ():
        if preset.name in taken:
            raise FamilyCardError(f"family card {card.name!r}: preset {preset.name!r} is registered already (by "
                                  f"family {taken[preset.name]}); give the preset another name")
    _check_module(card)
    _CARDS[card.name] = card
    return card


def unregister_card(name: str) -> None:
    """Remove the card called `name` (tests that register a toy family clean up with it); a family already built
    from it stays cached in `vidray.models.registry` until `vidray.models.registry.forget_family(name)`."""
    _CARDS.pop(name, None)


def _load_plugins() -> None:
    """Register the built-in cards and those named in `VIDRAY_FAMILY_CARDS`, once per process."""
    global _plugins_loaded
    if _plugins_loaded:
        return
    _plugins_loaded = True
    for card in BUILTIN_CARDS:
        _CARDS.setdefault(card.name, card)
    for entry in filter(None, (e.strip() for e in os.environ.get(FAMILY_CARDS_ENV, "").split(","))):
        module, _, attr = entry.partition(":")
        try:
            card = getattr(importlib.import_module(module), attr)
        except (ImportError, AttributeError) as err:
            raise FamilyCardError(f"{FAMILY_CARDS_ENV} entry {entry!r} does not import: {err}") from None
        if _CARDS.get(getattr(card, "name", None)) is not card:
            register_card(card)


def all_cards() -> tuple[FamilyCard, ...]:
    """Every registered card, built-ins first."""
    _load_plugins()
    return tuple(_CARDS.values())


def get_card(name: str) -> FamilyCard:
    """The card of family `name`. Raises ValueError naming the registered families."""
    _load_plugins()
    try:
        return _CARDS[name]
    except KeyError:
        raise ValueError(f"unknown model family {name!r}; valid: {', '.join(sorted(_CARDS))}") from None


def card_for_pipeline(class_name: str) -> FamilyCard | None:
    """The card whose `pipelines` name the stock pipeline class `class_name` (a `model_index.json`'s
    `_class_name`); None when no registered card does."""
    return next((card for card in all_cards() if class_name in card.pipelines), None)
