"""Per-family bucket rules: which (num_frames, height, width) a model family's VAE and DiT can take.

Plain data (no torch, no diffusers), so the config checks a job's buckets at load, before anything heavy is
imported. Each family's rules are its card's `bucket_rules` (`vidray.cards`); the table and the sources below
are the built-in cards'.

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

from vidray.cards import BucketRules, all_cards, get_card
from vidray.data.buckets import Bucket, validate_bucket

__all__ = ["BucketRules", "any_family_spatial_multiple", "bucket_rules", "check_bucket"]

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


def any_family_spatial_multiple() -> int:
    """The multiple every registered family's bucket sides are multiples of (the gcd of their `spatial_multiple`s:
    16 for the built-ins): a side off it fits no family, what `vidray generate` refuses before it reads the model."""
    return math.gcd(*(card.bucket_rules.spatial_multiple for card in all_cards()))


def bucket_rules(family: str) -> BucketRules:
    """The rules of `family` (its card's). Raises ValueError naming the registered families."""
    return get_card(family).bucket_rules


def check_bucket(bucket: Bucket, family: str) -> None:
    """Raise ValueError naming the rule unless `family` can take `bucket` (`vidray.data.buckets.validate_bucket`)."""
    rules = bucket_rules(family)
    validate_bucket(Bucket(*bucket), spatial_multiple=rules.spatial_multiple,
                    temporal_compression=rules.num_frames_step)
    if rules.max_frames is not None and bucket[0] > rules.max_frames:
        raise ValueError(f"bucket {Bucket(*bucket)}: num_frames must be at most {rules.max_frames} for {family} (its "
                         f"motion modules cover {rules.max_frames} frames), got {bucket[0]}")
