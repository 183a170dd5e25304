"""Assigning clips to buckets: every batch holds clips of one `vidray.buckets.Bucket(num_frames, height, width)`;
this module picks a clip's bucket and says why a clip is left out (too small a source, too large a frame-rate change)."""

from __future__ import annotations

import math
from typing import Callable, Sequence

from vidray.buckets import Bucket


def assign_bucket(
    *, num_frames: int, height: int, width: int, buckets: Sequence[Bucket], is_image: bool = False,
    num_frames_at_fps: int | None = None, rate_change: Callable[[Bucket], float] | None = None,
) -> Bucket | None:
    """Pick the bucket for a source of `num_frames` frames at `height` x `width` px.

    Images (`is_image=True`) go to single-frame buckets, videos to multi-frame ones. Among the buckets whose
    `num_frames` the source can fill, the one whose aspect ratio (H/W) is closest to the source's wins, so the
    center crop drops the least: the distance is `|log(h/w) - log(H/W)|`, since the crop keeps the fraction
    `min(a/b, b/a)` of the frame for aspect ratios a and b (symmetric: a portrait source and its landscape mirror
    image get mirror-image buckets). Ties go to a bucket the source fills at `data.fps` (`num_frames_at_fps`: the most
    frames it holds at that rate by time; None: every bucket it can fill), then to the larger frame count, then
    the larger area. A longer bucket the source fills only by taking consecutive frames (the stride fallback of
    `vidray.data.video`, a rate above `data.fps`) is thus picked only when no bucket of that aspect ratio fits at
    `data.fps`: as EasyAnimate's loader keeps its sample stride and shortens the clip, the rate the model learns
    motion at stays the configured one. When none fits at `data.fps` (a short source), the bucket with the
    smallest `rate_change(bucket)` wins before the frame count: `rate_change_factor` of the rate the bucket is
    sampled at (`vidray.data.video.sampled_fps`), so a 0.8 s clip takes the bucket it stretches least rather than
    the longest one at up to 3x slow motion (None: no rate known, the longest, as before). Returns None when no
    bucket fits (a video too short for every multi-frame bucket, or no bucket of the right kind).
    """
    if height <= 0 or width <= 0:
        raise ValueError(f"source size must be positive, got {height}x{width}")
    log_aspect = math.log(height / width)
    candidates = [
        b for b in buckets if (b.num_frames == 1) == is_image and (is_image or b.num_frames <= num_frames)
    ]
    if not candidates:
        return None
    return min(
        candidates,
        key=lambda b: (round(abs(math.log(b.height / b.width) - log_aspect), 12),
                       num_frames_at_fps is not None and b.num_frames > num_frames_at_fps,
                       round(rate_change(b), 9) if rate_change is not None else 1.0,
                       -b.num_frames, -(b.height * b.width)),
    )


def upscale_factor(bucket: Bucket, *, height: int, width: int) -> float:
    """How much a `height` x `width` px source must be enlarged to cover `bucket` (resize keeping the aspect,
    short side covering, then center crop): max(bucket.height / height, bucket.width / width); below 1 the
    source is shrunk. Raises ValueError for a non-positive size."""
    if height <= 0 or width <= 0:
        raise ValueError(f"source size must be positive, got {height}x{width}")
    return max(bucket.height / height, bucket.width / width)


def source_floor_reason(
    bucket: Bucket, *, height: int, width: int, min_side_px: int, max_upscale: float
) -> str | None:
    """Why a `height` x `width` px source (displayed size) is too small to train on in `bucket`, or None when it
    is not: its shorter side under `min_side_px` (`data.min_source_side_px`), or `bucket` enlarging it more than
    `max_upscale` times (`data.max_upscale`). The reason names the setting that would keep it."""
    side = min(height, width)
    if side < min_side_px:
        return (f"too small: {width}x{height} px, shorter side {side} px < data.min_source_side_px "
                f"{min_side_px} (lower it to keep such sources)")
    factor = upscale_factor(bucket, height=height, width=width)
    if factor > max_upscale:
        return (f"too small: {width}x{height} px would be enlarged {factor:.1f}x to fill bucket {bucket} "
                f"> data.max_upscale {max_upscale:g} (raise it, or add a smaller bucket of this aspect ratio)")
    return None


def rate_change_factor(clip_fps: float, fps: float) -> float:
    """How far a clip sampled at `clip_fps` frames/s strays from `data.fps` (`fps`): max(clip_fps / fps,
    fps / clip_fps), a factor >= 1 (1.0: sampled at `fps`). Trained at `fps`, such a clip's motion plays
    `clip_fps / fps` times slower than its bucket-mates' (the stride fallback of a short source takes source frames
    closer together than 1 / fps s), or as many times faster below `fps`. Raises ValueError for a rate <= 0."""
    if clip_fps <= 0 or fps <= 0:
        raise ValueError(f"frame rates must be > 0 frames/s, got {clip_fps} and {fps}")
    return max(clip_fps / fps, fps / clip_fps)


def rate_change_reason(
    bucket: Bucket, *, duration_s: float, clip_fps: float, fps: float, max_rate_change: float
) -> str | None:
    """Why a source lasting `duration_s` s is too short to train on in `bucket` (the bucket `assign_bucket` found
    stretching it least), or None when it is not: sampled at `clip_fps` to fill the bucket, its rate differs
    from `fps` (`data.fps`) by more than `max_rate_change` (`data.max_rate_change`; see `rate_change_factor`).
    The reason names the duration, the bucket, the rate and change, and the setting that would keep it."""
    change = rate_change_factor(clip_fps, fps)
    if change <= max_rate_change * (1 + 1e-9):
        return None
    motion = "slower" if clip_fps > fps else "faster"
    return (f"too short for data.fps {fps:g}: {duration_s:.2f} s, the nearest bucket {bucket} needs it sampled at "
            f"{clip_fps:.4g} fps, a {change:.2f}x rate change (motion {change:.2f}x {motion}) > data.max_rate_change "
            f"{max_rate_change:g} (raise it to keep such clips, or add a bucket with fewer frames)")
