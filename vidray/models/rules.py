"""Per-family bucket rules: which (num_frames, height, width) a model family's VAE and DiT can take.

Plain data (no torch, no diffusers), so the config checks a job's buckets at load, before anything heavy is
imported. The family classes (`vidray.models.easyanimate`, ...) read their constants from here.

| family | height, width | num_frames | why |
|---|---|---|---|
| easyanimate | multiples of 16 | 1 or 4k+1 | VAE 8x spatial, causal 4x temporal compression; DiT patch 2 |
| wan | multiples of 16 | 1 or 4k+1 | VAE 8x spatial, causal 4x temporal compression; DiT patch (1, 2, 2) |

A family whose VAE has no temporal compression (AnimateDiff's 16 frames, per-frame SD VAE) takes
`temporal_compression=1`: any num_frames.
"""

from __future__ import annotations

from dataclasses import dataclass

from vidray.data.buckets import Bucket, validate_bucket

__all__ = ["BucketRules", "FAMILY_BUCKET_RULES", "IMAGE_TO_VIDEO_FAMILIES", "bucket_rules", "check_bucket"]


@dataclass(frozen=True)
class BucketRules:
    """spatial_multiple: height and width must be multiples of it (pixels: VAE downsampling x DiT patch size);
    temporal_compression: num_frames must be 1 or k * it + 1 (the causal video VAE's frame compression; 1: any)."""

    spatial_multiple: int
    temporal_compression: int


FAMILY_BUCKET_RULES: dict[str, BucketRules] = {
    "easyanimate": BucketRules(spatial_multiple=16, temporal_compression=4),
    "wan": BucketRules(spatial_multiple=16, temporal_compression=4),
}
"""Bucket rules by `model.family` (diffusers: AutoencoderKLMagvit spatial_compression_ratio 8 and
temporal_compression_ratio 4, EasyAnimateTransformer3DModel patch_size 2; AutoencoderKLWan scale_factor_spatial 8
and scale_factor_temporal 4, WanTransformer3DModel patch_size (1, 2, 2), as `WanPipeline.check_inputs` and its
`num_frames % vae_scale_factor_temporal != 1` rounding require)."""


IMAGE_TO_VIDEO_FAMILIES = frozenset({"easyanimate"})
"""Families with an image-to-video (inpaint) model that `model.i2v` can build (EasyAnimate: the InP transformer of
`EasyAnimateInpaintPipeline`); the config refuses `model.i2v` for the others at load."""


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
                    temporal_compression=rules.temporal_compression)
