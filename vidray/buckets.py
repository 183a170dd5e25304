"""Buckets: the (num_frames, height, width) shapes a batch holds, and which of them a model family's VAE and DiT take.

Plain data (no torch, no diffusers), below the config, which checks a job's buckets at load. Each family's rules
are its card's `bucket_rules` (`vidray.cards`); the table and `SOURCES` below are the built-in cards'. Assigning
a clip to a bucket (aspect ratio, upscale and frame-rate limits) is the data plane's: `vidray.data.buckets`.

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

import math
from typing import NamedTuple

from vidray.cards import BucketRules, all_cards, get_card

__all__ = ["Bucket", "BucketRules", "any_family_spatial_multiple", "bucket_rules", "check_bucket", "parse_bucket",
           "parse_bucket_form", "validate_bucket"]

SOURCES = """Where the built-in cards' bucket rules come from (diffusers: AutoencoderKLMagvit spatial_compression_ratio 8
and temporal_compression_ratio 4, EasyAnimateTransformer3DModel patch_size 2; AutoencoderKLWan scale_factor_spatial 8
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



class Bucket(NamedTuple):
    """A training shape: `num_frames` frames of `height` x `width` pixels (an ordered, named triple)."""

    num_frames: int
    height: int
    width: int

    def __str__(self) -> str:
        return f"{self.num_frames}x{self.height}x{self.width}"


def parse_bucket_form(text: str) -> Bucket:
    """'9x64x64' -> Bucket(9, 64, 64), its form alone checked (three positive-or-zero integers joined by x; what a
    family takes is `parse_bucket`'s or `check_bucket`'s). Raises ValueError naming the form."""
    parts = text.lower().split("x")
    if len(parts) != 3 or not all(p.strip().isdigit() for p in parts):
        raise ValueError(f"bucket must look like NUM_FRAMESxHEIGHTxWIDTH, e.g. 9x64x64, got {text!r}")
    return Bucket(*(int(p) for p in parts))


def parse_bucket(text: str, family: str | None = None) -> Bucket:
    """'9x64x64' (the form `str(Bucket)` writes) -> Bucket(9, 64, 64). Raises ValueError naming the expected form
    or the rule the bucket breaks: `family`'s (`check_bucket`: AnimateDiff takes 16 frames,
    CogVideoX 8k+1), or without one the defaults of `validate_bucket`."""
    bucket = parse_bucket_form(text)
    if family is None:
        validate_bucket(bucket)
    else:
        check_bucket(bucket, family)
    return bucket


def validate_bucket(bucket: Bucket, *, spatial_multiple: int = 16, temporal_compression: int = 4) -> None:
    """Raise ValueError unless `bucket` fits the VAE/DiT: H, W positive multiples of `spatial_multiple`,
    `num_frames` = 1 or `k * temporal_compression + 1` (the causal video VAE layout of EasyAnimate/Wan/CogVideoX).
    The defaults are EasyAnimate's; a model family's own are its card's (`check_bucket`).
    """
    num_frames, height, width = bucket
    if height <= 0 or width <= 0:
        raise ValueError(f"bucket {bucket}: height and width must be positive pixels, got {height}x{width}")
    if height % spatial_multiple or width % spatial_multiple:
        raise ValueError(
            f"bucket {bucket}: height and width must be multiples of {spatial_multiple}, "
            f"got {height}x{width}"
        )
    if num_frames < 1 or (num_frames - 1) % temporal_compression:
        rule = ("at least 1" if temporal_compression == 1
                else f"1 or k*{temporal_compression}+1 (e.g. {temporal_compression + 1}, {2 * temporal_compression + 1})")
        raise ValueError(f"bucket {bucket}: num_frames must be {rule}, got {num_frames}")


def any_family_spatial_multiple() -> int:
    """The multiple every registered family's bucket sides are multiples of (the gcd of their `spatial_multiple`s:
    16 for the built-ins): a side off it fits no family, what `vidray generate` refuses before it reads the model."""
    return math.gcd(*(card.bucket_rules.spatial_multiple for card in all_cards()))


def bucket_rules(family: str) -> BucketRules:
    """The rules of `family` (its card's). Raises ValueError naming the registered families."""
    return get_card(family).bucket_rules


def check_bucket(bucket: Bucket, family: str) -> None:
    """Raise ValueError naming the rule unless `family` can take `bucket` (`validate_bucket`)."""
    rules = bucket_rules(family)
    validate_bucket(Bucket(*bucket), spatial_multiple=rules.spatial_multiple,
                    temporal_compression=rules.num_frames_step)
    if rules.max_frames is not None and bucket[0] > rules.max_frames:
        raise ValueError(f"bucket {Bucket(*bucket)}: num_frames must be at most {rules.max_frames} for {family} (its "
                         f"motion modules cover {rules.max_frames} frames), got {bucket[0]}")
