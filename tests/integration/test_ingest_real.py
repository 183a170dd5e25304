"""Prepare every file of the shared real media folder (11 clips and stills, see its SOURCES.md)."""

from __future__ import annotations

import re
from collections import Counter
import time
from fractions import Fraction

import pytest

from vidray.buckets import Bucket
from vidray.data.ingest import prepare
from vidray.data.shards import iter_samples, load_samples, read_index
from vidray.data.video import probe_media, read_clip

BUCKETS = [[9, 64, 64], [9, 64, 112], [9, 112, 64], [1, 64, 64]]
FPS = 8.0


def _sources_table(real_data_dir) -> dict[str, dict]:
    """Rows of SOURCES.md's table: file -> {width, height, fps (Fraction), num_frames}."""
    rows = {}
    for line in (real_data_dir / "SOURCES.md").read_text().splitlines():
        match = re.match(r"\| `([^`]+)` \| (\d+)x(\d+) \| (\d+)/(\d+) \| (\d+) \|", line)
        if match:
            name, w, h, num, den, frames = match.groups()
            rows[name] = {
                "width": int(w), "height": int(h), "fps": Fraction(int(num), int(den)), "num_frames": int(frames)
            }
    return rows


def test_probe_matches_sources_md(real_data_dir):
    table = _sources_table(real_data_dir)
    assert len(table) == 11
    for name, expected in table.items():
        info = probe_media(real_data_dir / name)
        expected_size = (expected["width"], expected["height"], expected["num_frames"])
        # SOURCES lists the stored size; width/height are the display size (sample aspect applied).
        assert (info.stored_width, info.stored_height, info.num_frames) == expected_size, name
        if name == "mmaction2_armwrestling_340x256.mp4":  # sample aspect ratio 64:51 -> shown 427x256
            assert (info.width, info.height, info.sample_aspect_ratio) == (427, 256, pytest.approx(64 / 51))
        else:
            assert (info.width, info.height) == (expected["width"], expected["height"]), name
        if name.endswith(".png"):
            assert info.is_image and info.fps == 0.0
        elif name == "newtonscradle_200x150.gif":
            # SOURCES lists the GIF tick rate (100/1); its 36 frames span 0.82 s, a mean of ~43.9 fps.
            assert info.fps == pytest.approx(36 / 0.82) and info.duration_s == pytest.approx(0.82)
        elif name.endswith(".gif"):
            # 48 frames over 2.08 s = 23.077 mean fps; SOURCES lists FFmpeg's guessed 277/12 = 23.083.
            assert info.fps == pytest.approx(float(expected["fps"]), rel=1e-3), name
        else:
            assert info.fps == pytest.approx(float(expected["fps"]), rel=1e-6), name
    assert probe_media(real_data_dir / "realshort_320x240_30.02fps.mp4").fps == pytest.approx(30.02, abs=0.005)


def test_long_trailer_probes_and_reads_only_what_it_needs(real_data_dir):
    path = real_data_dir / "cosmos_curate_sintel_trailer_30s_854x480.mp4"
    start = time.perf_counter()
    info = probe_media(path)
    clip = read_clip(path, info, Bucket(49, 64, 112), FPS)  # 6 s of the 30 s trailer
    elapsed_s = time.perf_counter() - start
    assert (info.num_frames, info.duration_s, clip.shape) == (720, 30.0, (49, 64, 112, 3))
    assert elapsed_s < 3.0, f"probe + 49-frame read took {elapsed_s:.2f} s"


def test_prepare_keeps_all_eleven_real_files(real_data_dir, tmp_path):
    lines: list[str] = []
    summary = prepare(
        real_data_dir / "metadata.json", tmp_path, BUCKETS, FPS, samples_per_shard=4, progress=lines.append
    )
    assert (summary.num_kept, summary.num_skipped) == (11, 0), summary.skipped
    # Scene splitting (data.split_scenes, on by default): the Sintel trailer (30 s, cuts) and the arm-wrestling
    # clip (10 s, cuts) give one clip per long-enough scene; the nine other files one sample each.
    per_source = Counter(row["source_path"].rsplit("/", 1)[-1] for row in iter_samples(tmp_path, ["source_path"]))
    assert per_source.pop("cosmos_curate_sintel_trailer_30s_854x480.mp4") >= 5
    assert per_source.pop("mmaction2_armwrestling_340x256.mp4") >= 2
    assert set(per_source.values()) == {1} and len(per_source) == 9
    num_samples = summary.num_samples
    assert sum(summary.bucket_counts.values()) == num_samples and summary.bucket_counts["1x64x64"] == 2
    assert summary.bucket_counts["9x112x64"] == 1  # the 576x1016 portrait clip
    index = read_index(tmp_path)
    assert index["num_samples"] == num_samples
    assert len(index["shards"]) == sum(-(-n // 4) for n in summary.bucket_counts.values())  # one bucket per shard
    samples = load_samples(tmp_path)
    assert all(s.video.shape == (*s.bucket, 3) for s in samples)
    assert len(lines) == 11
