"""Scene cuts: long videos become several training clips, none straddling a cut (vidray.data.scenes + prepare)."""

from __future__ import annotations

import json
import time

import numpy as np
import pytest

from vidray.config import DataConfig
from vidray.buckets import Bucket
from vidray.data.ingest import prepare, prepare_data
from vidray.data.scenes import (
    Scene,
    SceneClip,
    SceneSplit,
    detect_scenes,
    needs_scene_split,
    plan_scene_clips,
)
from vidray.data.shards import iter_samples
from vidray.data.video import MediaInfo, decode_mp4, probe_media, write_mp4

FPS = 8.0
RED, BLUE = (200, 30, 30), (30, 30, 200)


def _info(width: int = 320, height: int = 240, duration_s: float = 30.0) -> MediaInfo:
    return MediaInfo(width=width, height=height, fps=24.0, num_frames=round(24 * duration_s), duration_s=duration_s,
                     is_image=False, codec="h264")


@pytest.fixture(scope="module")
def two_shots(tmp_path_factory):
    """A 6 s, 24 fps, 64x64 clip: 3 s flat red, then a hard cut to 3 s flat blue (with a little noise)."""
    folder = tmp_path_factory.mktemp("two_shots")
    rng = np.random.default_rng(0)
    frames = np.empty((144, 64, 64, 3), np.uint8)
    frames[:72], frames[72:] = RED, BLUE
    frames = np.clip(frames + rng.normal(0, 3, frames.shape), 0, 255).astype(np.uint8)
    write_mp4(frames, folder / "two_shots.mp4", fps=24.0)
    (folder / "meta.json").write_text(json.dumps([{"file_path": "two_shots.mp4", "text": "red, then blue"}]))
    return folder


def _colour_of(frame: np.ndarray) -> str:
    mean = frame.reshape(-1, 3).mean(axis=0)
    if np.abs(mean - RED).max() < 20:
        return "red"
    if np.abs(mean - BLUE).max() < 20:
        return "blue"
    return f"mixed {mean.round()}"


def test_detect_scenes_finds_the_hard_cut_between_two_flat_shots(two_shots):
    path = two_shots / "two_shots.mp4"
    scenes = detect_scenes(path, probe_media(path))
    assert len(scenes) == 2
    assert scenes[0].start_s == 0.0 and scenes[0].end_s == pytest.approx(3.0, abs=1e-6) == scenes[1].start_s
    assert scenes[1].end_s == pytest.approx(6.0)


def test_prepare_splits_at_the_cut_and_every_clip_holds_one_colour(two_shots, tmp_path):
    summary = prepare(two_shots / "meta.json", tmp_path / "shards", [[9, 64, 64]], FPS, 64, progress=None)
    assert (summary.num_kept, summary.num_samples) == (1, 2)
    rows = sorted(iter_samples(tmp_path / "shards"), key=lambda row: row["clip_start_s"])
    assert len({row["sample_id"] for row in rows}) == 2
    colours = []
    for row, (scene_start, scene_end) in zip(rows, [(0.0, 3.0), (3.0, 6.0)], strict=True):
        assert scene_start <= row["clip_start_s"] < row["clip_end_s"] <= scene_end + 1e-4
        assert row["clip_end_s"] - row["clip_start_s"] == pytest.approx(9 / FPS, abs=1e-4)
        frame_colours = {_colour_of(frame) for frame in decode_mp4(row["video_mp4"])}
        assert len(frame_colours) == 1, frame_colours  # no clip straddles the cut
        colours.append(frame_colours.pop())
    assert colours == ["red", "blue"]


def test_split_scenes_false_keeps_one_clip_per_source_from_its_start(two_shots, tmp_path):
    common = {"source": str(two_shots / "meta.json"), "buckets": [[9, 64, 64]], "fps": FPS}
    off = prepare_data(DataConfig(shards_dir=str(tmp_path / "off"), split_scenes=False, **common), progress=None)
    on = prepare_data(DataConfig(shards_dir=str(tmp_path / "on"), **common), progress=None)
    assert (off.num_kept, off.num_samples, on.num_samples) == (1, 1, 2)
    (row,) = iter_samples(tmp_path / "off")
    assert (row["clip_start_s"], row["clip_end_s"]) == (0.0, pytest.approx(9 / FPS))


def test_more_clips_per_scene_are_consecutive_and_do_not_overlap(two_shots, tmp_path):
    summary = prepare(
        two_shots / "meta.json", tmp_path / "shards", [[9, 64, 64]], FPS, 64, progress=None,
        scene_split=SceneSplit(max_clips_per_scene=4),
    )
    rows = sorted(iter_samples(tmp_path / "shards"), key=lambda row: row["clip_start_s"])
    assert summary.num_samples == len(rows) == 4  # 3 s scenes hold two 1.125 s clips each
    for before, after in zip(rows, rows[1:]):
        assert before["clip_end_s"] <= after["clip_start_s"] + 1e-4
    assert [_colour_of(decode_mp4(row["video_mp4"])[-1]) for row in rows] == ["red", "red", "blue", "blue"]


def test_plan_gives_each_long_enough_scene_one_centred_clip_of_its_best_bucket():
    scenes = [Scene(0.0, 3.0), Scene(3.0, 3.5), Scene(3.5, 5.0)]  # the middle one is shorter than 9 frames at 8 fps
    buckets = [Bucket(17, 64, 96), Bucket(9, 64, 96), Bucket(1, 64, 96)]
    clips = plan_scene_clips(scenes, _info(), buckets, FPS)
    assert clips == [
        SceneClip(Bucket(17, 64, 96), pytest.approx((3.0 - 17 / 8) / 2), pytest.approx((3.0 + 17 / 8) / 2), 0),
        SceneClip(Bucket(9, 64, 96), pytest.approx(3.5 + (1.5 - 9 / 8) / 2), pytest.approx(5.0 - (1.5 - 9 / 8) / 2), 2),
    ]


def test_plan_caps_clips_per_source_spread_over_the_source():
    scenes = [Scene(float(i), float(i + 2)) for i in range(0, 40, 2)]  # 20 scenes of 2 s
    clips = plan_scene_clips(scenes, _info(), [Bucket(9, 64, 96)], FPS, max_clips_per_source=5)
    assert [c.scene for c in clips] == [0, 4, 8, 12, 16]
    assert plan_scene_clips([Scene(0.0, 1.0)], _info(), [Bucket(9, 64, 96)], FPS) == []


def test_only_videos_lasting_two_clips_are_scanned_for_cuts():
    nine = Bucket(9, 64, 96)  # 1.125 s at 8 fps
    assert needs_scene_split(_info(duration_s=2.25), nine, FPS)
    assert not needs_scene_split(_info(duration_s=2.2), nine, FPS)
    assert not needs_scene_split(_info(duration_s=30.0), Bucket(1, 64, 96), FPS)
    still = MediaInfo(width=320, height=240, fps=0.0, num_frames=1, duration_s=0.0, is_image=True, codec="png")
    assert not needs_scene_split(still, nine, FPS)


def test_scene_split_rejects_bad_settings_naming_them():
    with pytest.raises(ValueError, match="max_clips_per_scene and max_clips_per_source must be >= 1"):
        SceneSplit(max_clips_per_scene=0)
    with pytest.raises(ValueError, match="threshold must be > 0"):
        SceneSplit(threshold=0)


def test_sintel_trailer_becomes_several_clips_inside_its_scenes(real_data_dir, tmp_path):
    path = real_data_dir / "cosmos_curate_sintel_trailer_30s_854x480.mp4"
    info = probe_media(path)
    start = time.perf_counter()
    scenes = detect_scenes(path, info)
    detect_s = time.perf_counter() - start
    print(f"scene detection of the 30 s 854x480 trailer: {detect_s:.2f} s, {len(scenes)} scenes")
    assert len(scenes) >= 5 and detect_s < 15.0
    (tmp_path / "meta.json").write_text(json.dumps([{"file_path": str(path), "text": "Sintel"}]))
    summary = prepare(tmp_path / "meta.json", tmp_path / "shards", [[9, 64, 112], [9, 64, 64]], FPS, 64, progress=None)
    rows = sorted(iter_samples(tmp_path / "shards"), key=lambda row: row["clip_start_s"])
    assert summary.num_kept == 1 and summary.num_samples == len(rows) >= 3
    assert len({row["sample_id"] for row in rows}) == len(rows)
    for before, after in zip(rows, rows[1:]):
        assert before["clip_end_s"] <= after["clip_start_s"] + 1e-4  # no overlap
    for row in rows:
        inside = [s for s in scenes if s.start_s - 1e-4 <= row["clip_start_s"] and row["clip_end_s"] <= s.end_s + 1e-4]
        assert len(inside) == 1, (row["clip_start_s"], row["clip_end_s"])  # no clip straddles a cut
        assert (row["num_frames"], row["height"], row["width"]) == (9, 64, 112)


def test_every_scene_clip_of_a_source_keeps_the_aspect_ratio_of_its_bucket(real_data_dir, tmp_path):
    # A new user's trial: with buckets of several lengths and aspect ratios, two short scenes of the 427x256 (H/W
    # 0.6) arm-wrestling clip were cut as 5x64x64 (a square crop dropping 40 % of the width) because no 9x64x112
    # clip fits them at 8 fps; the file's other clips were 9x64x112. A scene too short for every bucket of the
    # file's aspect ratio now gives no clip.
    path = real_data_dir / "mmaction2_armwrestling_340x256.mp4"
    (tmp_path / "meta.json").write_text(json.dumps([{"file_path": str(path), "text": "arm wrestling"}]))
    buckets = [[17, 64, 64], [9, 64, 64], [5, 64, 64], [9, 64, 112], [9, 112, 64], [1, 64, 64]]
    summary = prepare(tmp_path / "meta.json", tmp_path / "shards", buckets, FPS, 64, progress=None)
    rows = list(iter_samples(tmp_path / "shards"))
    assert summary.num_samples == len(rows) >= 3
    assert {(row["num_frames"], row["height"], row["width"], row["fps"]) for row in rows} == {(9, 64, 112, FPS)}
