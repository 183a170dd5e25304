"""Bucket assignment and validation (pure functions, no media)."""

from __future__ import annotations

import pytest

from vidray.buckets import Bucket, validate_bucket
from vidray.data.buckets import assign_bucket, rate_change_factor, rate_change_reason

BUCKETS = [Bucket(9, 64, 64), Bucket(9, 64, 112), Bucket(9, 112, 64), Bucket(17, 64, 112), Bucket(1, 64, 64)]


def test_bucket_is_named_and_prints_as_frames_x_height_x_width():
    bucket = Bucket(9, 64, 112)
    assert (bucket.num_frames, bucket.height, bucket.width) == (9, 64, 112)
    assert str(bucket) == "9x64x112"


@pytest.mark.parametrize(
    ("height", "width", "expected"),
    [
        (480, 854, Bucket(17, 64, 112)),  # landscape 16:9 -> the wide bucket, the longer one it can fill
        (1016, 576, Bucket(9, 112, 64)),  # portrait 9:16
        (256, 256, Bucket(9, 64, 64)),  # square
        (240, 320, Bucket(17, 64, 112)),  # 4:3 (H/W 0.75) is closer to 64/112 (0.57) than to 1:1
    ],
)
def test_assign_bucket_picks_the_closest_aspect(height, width, expected):
    assert assign_bucket(num_frames=49, height=height, width=width, buckets=BUCKETS) == expected


def test_a_portrait_source_and_its_landscape_mirror_get_mirror_image_buckets():
    # A new user's trial: 320x240 went to 64x112 (the crop keeps 76 %) but its 240x320 mirror to the square bucket
    # (75 %) instead of 112x64 (76 %): the distance was linear in H/W. Compared as log(H/W), the crop that keeps
    # the most wins both ways.
    assert assign_bucket(num_frames=49, height=240, width=320, buckets=BUCKETS) == Bucket(17, 64, 112)
    assert assign_bucket(num_frames=49, height=320, width=240, buckets=BUCKETS) == Bucket(9, 112, 64)
    for height, width in ((480, 854), (300, 400), (1000, 1100)):
        landscape = assign_bucket(num_frames=9, height=height, width=width, buckets=BUCKETS)
        portrait = assign_bucket(num_frames=9, height=width, width=height, buckets=BUCKETS)
        assert (portrait.height, portrait.width) == (landscape.width, landscape.height)


def test_assign_bucket_prefers_buckets_the_video_can_fill():
    assert assign_bucket(num_frames=12, height=480, width=854, buckets=BUCKETS) == Bucket(9, 64, 112)


def test_assign_bucket_prefers_a_bucket_filled_at_data_fps_over_a_longer_one_at_a_higher_rate():
    # 20 frames in 1.2 s at 8 fps hold 10 frames by time: 17 would need the stride fallback (every frame, 16.7 fps).
    assert assign_bucket(num_frames=20, height=480, width=854, buckets=BUCKETS, num_frames_at_fps=10) == Bucket(
        9, 64, 112)
    # Aspect ratio still comes first, and with no bucket of the rate the longer one is taken (stride fallback).
    assert assign_bucket(num_frames=20, height=480, width=854, buckets=[Bucket(17, 64, 112), Bucket(9, 64, 64)],
                         num_frames_at_fps=10) == Bucket(17, 64, 112)
    assert assign_bucket(num_frames=20, height=480, width=854, buckets=BUCKETS, num_frames_at_fps=20) == Bucket(
        17, 64, 112)


def test_a_source_too_short_for_data_fps_takes_the_bucket_changing_its_rate_least():
    # A square source of 36 frames at 43.9 fps (0.82 s) holds 7 frames at 8 fps: every bucket needs the stride fallback. Sampled rates:
    # 9 frames 10.98 fps (1.37x), 17 frames 21.95 (2.74x), 33 frames 43.9 (5.49x). Without a rate, the longest.
    rates = {9: 10.98, 17: 21.95, 33: 43.9}
    change = lambda b: rate_change_factor(rates[b.num_frames], 8.0)  # noqa: E731
    buckets = [Bucket(33, 64, 64), Bucket(17, 64, 64), Bucket(9, 64, 64), Bucket(9, 64, 112)]
    assert assign_bucket(num_frames=36, height=200, width=200, buckets=buckets, num_frames_at_fps=7,
                         rate_change=change) == Bucket(9, 64, 64)
    assert assign_bucket(num_frames=36, height=200, width=200, buckets=buckets, num_frames_at_fps=7) == Bucket(
        33, 64, 64)
    # Aspect ratio still comes first, and a bucket filled at data.fps before any rate change.
    assert assign_bucket(num_frames=36, height=200, width=200, buckets=buckets[:2] + [Bucket(9, 64, 112)],
                         num_frames_at_fps=7, rate_change=change) == Bucket(17, 64, 64)
    at_fps = lambda b: 1.0 if b.num_frames <= 20 else rate_change_factor(43.9, 8.0)  # noqa: E731 - 20 at 8 fps
    assert assign_bucket(num_frames=36, height=200, width=200, buckets=buckets, num_frames_at_fps=20,
                         rate_change=at_fps) == Bucket(17, 64, 64)
    # Equal changes: the longer bucket (more of the clip at the same rate).
    assert assign_bucket(num_frames=36, height=200, width=200, buckets=[Bucket(13, 64, 64), Bucket(17, 64, 64)],
                         num_frames_at_fps=7, rate_change=lambda b: 2.744) == Bucket(17, 64, 64)


def test_rate_change_is_a_factor_of_at_least_one_either_way_and_its_bound_names_the_setting():
    assert rate_change_factor(8.0, 8.0) == 1.0
    assert rate_change_factor(12.0, 8.0) == rate_change_factor(8.0, 12.0) == 1.5
    with pytest.raises(ValueError, match="> 0 frames/s"):
        rate_change_factor(0.0, 8.0)
    assert rate_change_reason(Bucket(9, 64, 64), duration_s=0.82, clip_fps=10.98, fps=8.0, max_rate_change=1.5) is None
    assert rate_change_reason(Bucket(9, 64, 64), duration_s=1.0, clip_fps=12.0, fps=8.0, max_rate_change=1.5) is None
    reason = rate_change_reason(Bucket(9, 64, 64), duration_s=0.9, clip_fps=5.0, fps=8.0, max_rate_change=1.5)
    assert reason == ("too short for data.fps 8: 0.90 s, the nearest bucket 9x64x64 needs it sampled at 5 fps, a 1.60x "
                      "rate change (motion 1.60x faster) > data.max_rate_change 1.5 (raise it to keep such clips, or "
                      "add a bucket with fewer frames)")


def test_images_go_to_single_frame_buckets():
    assert assign_bucket(num_frames=1, height=382, width=600, buckets=BUCKETS, is_image=True) == Bucket(1, 64, 64)


def test_videos_never_go_to_single_frame_buckets():
    assert assign_bucket(num_frames=49, height=64, width=64, buckets=[Bucket(1, 64, 64)]) is None


def test_too_short_video_gets_no_bucket():
    assert assign_bucket(num_frames=8, height=480, width=854, buckets=BUCKETS) is None


def test_image_without_single_frame_bucket_gets_none():
    assert assign_bucket(num_frames=1, height=64, width=64, buckets=[Bucket(9, 64, 64)], is_image=True) is None


def test_assign_bucket_rejects_empty_source_size():
    with pytest.raises(ValueError, match="positive"):
        assign_bucket(num_frames=9, height=0, width=64, buckets=BUCKETS)


@pytest.mark.parametrize("bucket", [Bucket(1, 64, 64), Bucket(9, 64, 112), Bucket(49, 480, 720)])
def test_validate_bucket_accepts_vae_shapes(bucket):
    validate_bucket(bucket)


@pytest.mark.parametrize(
    ("bucket", "message"),
    [
        (Bucket(9, 60, 64), "multiples of 16"),
        (Bucket(9, 64, 0), "must be positive pixels, got 64x0"),
        (Bucket(8, 64, 64), r"1 or k\*4\+1"),
        (Bucket(0, 64, 64), r"1 or k\*4\+1"),
    ],
)
def test_validate_bucket_names_the_problem(bucket, message):
    with pytest.raises(ValueError, match=message):
        validate_bucket(bucket)


def test_bucket_rules_come_from_the_model_family():
    from vidray.config import ConfigError, load_job_config
    from vidray.buckets import BucketRules, bucket_rules, check_bucket

    assert bucket_rules("easyanimate") == BucketRules(spatial_multiple=16, temporal_compression=4)
    check_bucket(Bucket(17, 64, 48), "easyanimate")
    with pytest.raises(ValueError, match=r"num_frames must be 1 or k\*4\+1"):
        check_bucket(Bucket(16, 64, 64), "easyanimate")  # AnimateDiff's 16 frames: not an EasyAnimate shape
    with pytest.raises(ValueError, match="unknown model family 'hunyuanvideo'; valid: animatediff, cogvideox, "
                                         "easyanimate, wan"):
        check_bucket(Bucket(17, 64, 64), "hunyuanvideo")
    check_bucket(Bucket(16, 64, 64), "animatediff")  # per-frame VAE: any frame count, sides multiples of 64
    with pytest.raises(ConfigError, match=r"data.buckets: bucket 16x64x64: num_frames.*model.family=easyanimate"):
        load_job_config(None, ["data.buckets=[[16, 64, 64]]"])
    with pytest.raises(ConfigError, match="height and width must be positive pixels, got 0x64"):
        load_job_config(None, ["data.buckets=[[9, 0, 64]]"])


def test_a_bucket_is_parsed_against_its_familys_rule_not_easyanimates():
    """AnimateDiff's 16 frames (no temporal compression) broke `vidray train`, generate's --bucket and
    train.validation.bucket, which parsed every bucket with EasyAnimate's 4k+1 rule (found by a fresh-user trial)."""
    from vidray.config import ConfigError, job_config_from_dict
    from vidray.buckets import parse_bucket, parse_bucket_form

    assert parse_bucket("16x64x64", "animatediff") == Bucket(16, 64, 64)
    with pytest.raises(ValueError, match="k\\*4\\+1"):
        parse_bucket("16x64x64")  # no family: the default rule
    with pytest.raises(ValueError, match="num_frames must be at most 32 for animatediff"):
        parse_bucket("40x64x64", "animatediff")
    with pytest.raises(ValueError, match="num_frames must be at least 1, got 0"):
        parse_bucket("0x64x64", "animatediff")
    with pytest.raises(ValueError, match="k\\*8\\+1"):
        parse_bucket("5x64x64", "cogvideox")
    assert parse_bucket_form("16x48x48") == Bucket(16, 48, 48)  # the form alone
    job = job_config_from_dict({"model": {"family": "animatediff"}, "data": {"buckets": [[16, 64, 64]]},
                                "train": {"validation": {"bucket": "16x64x64", "every_steps": 50,
                                                         "prompts": ["a cat"]}}})
    assert job.train.validation.bucket == "16x64x64"
    with pytest.raises(ConfigError, match="num_frames must be at most 32 for animatediff") as err:
        job_config_from_dict({"model": {"family": "animatediff"}, "data": {"buckets": [[40, 64, 64]]}})
    assert "\n" not in str(err.value)
