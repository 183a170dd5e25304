"""Per-family bucket rules: which (num_frames, height, width) a model family's VAE and DiT can take.

Plain data (no torch, no diffusers), so the config checks a job's buckets at load, before anything heavy is
imported. The family classes (`vidray.models.easyanimate`, ...) read their constants from here.

| family | height, width | num_frames | why |
|---|---|---|---|
| easyanimate | multiples of 16 | 1 or 4k+1 | VAE 8x spatial, causal 4x temporal compression; DiT patch 2 |
| wan | multiples of 16 | 1 or 4k+1 | VAE 8x spatial, causal 4x temporal compression; DiT patch (1, 2, 2) |
| cogvideox | multiples of 16 | 1 or 8k+1 | VAE 8x spatial, causal 4x temporal compression decoded 2 latent frames at a time (odd latent counts only); DiT patch 2, one latent frame per patch (1.0) or two (1.5: the odd latent count padded by one leading frame, as `CogVideoXPipeline` does, so the same rule) |
| animatediff | multiples of 64 | any | SD 1.5 image VAE 8x spatial applied per frame (no temporal compression); SD 1.5 UNet 3 downsamplers (8x) |

A family whose VAE has no temporal compression (AnimateDiff's 16 frames, per-frame SD VAE) takes
`temporal_compression=1`: any num_frames.
"""

from __future__ import annotations

from dataclasses import dataclass

from vidray.data.buckets import Bucket, validate_bucket

__all__ = ["BucketRules", "EXPERT_FAMILIES", "FAMILY_BUCKET_RULES", "IMAGE_TO_VIDEO_FAMILIES",
           "any_family_spatial_multiple", "bucket_rules", "check_bucket"]


@dataclass(frozen=True)
class BucketRules:
    """spatial_multiple: height and width must be multiples of it (pixels: VAE downsampling x DiT patch size);
    temporal_compression: the causal video VAE's frame compression; num_frames must be 1 or k * frame_step + 1,
    frame_step defaulting to temporal_compression (1: any)."""

    spatial_multiple: int
    temporal_compression: int
    frame_step: int | None = None
    """num_frames - 1 must be a multiple of it; None: `temporal_compression`. CogVideoX: 8 (see
    `FAMILY_BUCKET_RULES`)."""
    max_frames: int | None = None
    """The most frames a clip may have; None: no limit. AnimateDiff: 32, the frames its motion modules'
    positional embeddings cover (`motion_max_seq_length` of the v1.5-v3 adapters)."""

    @property
    def num_frames_step(self) -> int:
        """`frame_step`, or `temporal_compression` when it is None."""
        return self.frame_step or self.temporal_compression


FAMILY_BUCKET_RULES: dict[str, BucketRules] = {
    "easyanimate": BucketRules(spatial_multiple=16, temporal_compression=4),
    "wan": BucketRules(spatial_multiple=16, temporal_compression=4),
    "cogvideox": BucketRules(spatial_multiple=16, temporal_compression=4, frame_step=8),
    "animatediff": BucketRules(spatial_multiple=64, temporal_compression=1, max_frames=32),
}
"""Bucket rules by `model.family` (diffusers: AutoencoderKLMagvit spatial_compression_ratio 8 and
temporal_compression_ratio 4, EasyAnimateTransformer3DModel patch_size 2; AutoencoderKLWan scale_factor_spatial 8
and scale_factor_temporal 4, WanTransformer3DModel patch_size (1, 2, 2), as `WanPipeline.check_inputs` and its
`num_frames % vae_scale_factor_temporal != 1` rounding require; AutoencoderKLCogVideoX 4 blocks (8x spatial) and
temporal_compression_ratio 4, CogVideoXTransformer3DModel patch_size 2 with patch_size_t null (CogVideoX 1.0: any
latent frame count; `CogVideoXPipeline` makes (num_frames - 1) // 4 + 1 latent frames and checks only H, W % 8).
CogVideoX's num_frames are 8k+1, not 4k+1: `AutoencoderKLCogVideoX._decode` decodes `num_latent_frames_batch_size`
(2) latent frames at a time, the odd one in the first chunk, so only an odd latent count (F - 1) / 4 + 1 decodes
back to F frames (5 frames -> 2 latent -> 8 decoded, in the stock pipeline too); CogVideoX's own 49 = 8 * 6 + 1.
CogVideoX 1.5 (patch_size_t 2) keeps that rule: its pipeline pads the odd latent count by one frame for the
transformer and drops it before decoding (81 = 8 * 10 + 1 frames -> 21 latent -> 22 denoised -> 21 decoded).
AnimateDiff: SD 1.5's AutoencoderKL (4 blocks: 8x spatial) encodes each frame alone (temporal 1: any num_frames,
up to the motion modules' `motion_max_seq_length`, which `AnimateDiffFamily.predict` checks), and its
UNet2DConditionModel (block_out_channels 320/640/1280/1280, 3 downsamplers: 8x) needs latent sides that are
multiples of 8 for its skip connections to line up without interpolation: 8 * 8 = 64 px (AnimateDiff trains at 256
and 512; `AnimateDiffPipeline.check_inputs` alone asks only multiples of 8)."""


IMAGE_TO_VIDEO_FAMILIES = frozenset({"easyanimate", "wan", "cogvideox"})
"""Families with an image-to-video model that `model.i2v` can build (EasyAnimate: the InP transformer of
`EasyAnimateInpaintPipeline`; Wan: the 36-channel transformer of `WanImageToVideoPipeline`; CogVideoX: the 1.0 or
1.5 I2V transformer of `CogVideoXImageToVideoPipeline`, first frame only); the config refuses `model.i2v` for the
others at load."""


EXPERT_FAMILIES = frozenset({"wan"})
"""Families with a two-expert model that `model.experts` can build (Wan 2.2 A14B: `transformer` and
`transformer_2` switched at `boundary_ratio`); the config refuses `model.experts` for the others at load."""


FSDP_BLOCKS = {"easyanimate": "transformer_blocks", "wan": "blocks", "cogvideox": "transformer_blocks"}
"""Each family's `nn.ModuleList` of transformer blocks that FSDP2 shards one by one (`vidray.train.parallel.apply_fsdp`,
`ModelFamily.fsdp_blocks`); a family absent here (AnimateDiff: motion modules spread through a UNet's down, mid
and up blocks) trains with `scaling.strategy: ddp`, and the config refuses fsdp / hsdp for it at load."""


META_FAMILIES = frozenset({"easyanimate", "wan"})
"""Families whose pretrained transformer builds on the meta device for FSDP (`ModelFamily.build_transformer_on_meta`:
each rank then loads only its shards); the config refuses `model.init: pretrained` with fsdp / hsdp for the others."""


def any_family_spatial_multiple() -> int:
    """The multiple every family's bucket sides are multiples of (the gcd of their `spatial_multiple`s: 16): a side
    off it fits no family, what `vidray generate` refuses before it reads the model."""
    import math

    return math.gcd(*(rules.spatial_multiple for rules in FAMILY_BUCKET_RULES.values()))


def bucket_rules(family: str) -> BucketRules:
    """The rules of `family`. Raises ValueError naming the known families."""
    try:
        return FAMILY_BUCKET_RULES[family]
    except KeyError:
        raise ValueError(f"unknown model family {family!r}; valid: {', '.join(sorted(FAMILY_BUCKET_RULES))}") from None


def check_bucket(bucket: Bucket, family: str) -> None:
    """Raise ValueError naming the rule unless `family` can take `bucket` (`vidray.data.buckets.validate_bucket`)."""
    rules = bucket_rules(family)
    validate_bucket(Bucket(*bucket), spatial_multiple=rules.spatial_multiple,
                    temporal_compression=rules.num_frames_step)
    if rules.max_frames is not None and bucket[0] > rules.max_frames:
        raise ValueError(f"bucket {Bucket(*bucket)}: num_frames must be at most {rules.max_frames} for {family} (its "
                         f"motion modules cover {rules.max_frames} frames), got {bucket[0]}")
