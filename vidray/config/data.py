"""`data:`: where the clips come from, their buckets, the shard and cache settings of the data plane."""

from __future__ import annotations

import dataclasses
import tempfile
from pathlib import Path
from typing import Annotated, Any

from pydantic import Field, field_validator
from pydantic.dataclasses import dataclass

from vidray.buckets import Bucket, validate_bucket
from vidray.config.bounds import AtLeastOne, NonNegativeInt, PositiveFloat, Says
from vidray.config.common import _STRICT


DEFAULT_CACHE_DIR = str(Path(tempfile.gettempdir()) / "vidray-cache")
"""`data.cache_dir`'s default: the node-local warm shard cache (`vidray.data.cache.ShardCache`)."""
DEFAULT_CACHE_BYTES = 20 * 2**30
"""`data.cache_bytes`' default: 20 GiB a node."""


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
