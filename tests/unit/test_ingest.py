"""Ingest on the repo's samples/: video I/O, source lists, prepare -> shards + index, skip-and-report."""

from __future__ import annotations

import hashlib
import json
import os
import shutil
from pathlib import Path

import numpy as np
import pytest

from vidray.buckets import Bucket
from vidray.data.ingest import prepare, read_source
from vidray.data.shards import SHARD_SCHEMA, iter_samples, load_samples, read_index, read_report
from vidray.data.video import (
    MediaError,
    decode_mp4,
    encode_mp4,
    probe_media,
    read_clip,
    sampled_fps,
    write_mp4,
)

BUCKETS = [[9, 64, 64], [1, 64, 64]]
FPS = 8.0


def _gray_ramp(num_frames: int, step: int, height: int = 64, width: int = 64) -> np.ndarray:
    """uint8 (F, H, W, 3) whose frame i is uniformly gray at step*i: frame identity survives H.264."""
    values = (np.arange(num_frames) * step).astype(np.uint8)
    return np.broadcast_to(values[:, None, None, None], (num_frames, height, width, 3)).copy()


# --- video I/O -------------------------------------------------------------------------------------------


@pytest.mark.parametrize("shape", [(9, 64, 112, 3), (1, 64, 64, 3), (5, 48, 32, 3)])
def test_encode_decode_mp4_round_trips_shape_exactly_and_pixels_closely(shape):
    rng = np.random.default_rng(0)
    # Smooth content (H.264 is built for it): a gradient plus a little noise.
    base = np.linspace(0, 255, shape[1] * shape[2] * 3).reshape(shape[1:])
    frames = np.clip(base[None] + rng.normal(0, 4, shape), 0, 255).astype(np.uint8)
    data = encode_mp4(frames, fps=8.0)
    assert data[4:8] == b"ftyp"
    decoded = decode_mp4(data)
    assert decoded.shape == frames.shape and decoded.dtype == np.uint8
    assert np.abs(decoded.astype(np.int16) - frames).mean() < 6.0


def test_decode_mp4_into_a_batch_slot_equals_the_plain_decode_and_refuses_a_wrong_shape():
    rng = np.random.default_rng(1)
    frames = rng.integers(0, 255, (9, 64, 112, 3), dtype=np.uint8)
    data = encode_mp4(frames, fps=8.0)
    batch = np.full((2, 9, 64, 112, 3), 7, np.uint8)  # (B, F, H, W, 3)
    result = decode_mp4(data, out=batch[1])
    assert np.shares_memory(result, batch)  # written in place, no new array
    np.testing.assert_array_equal(batch[1], decode_mp4(data))
    assert (batch[0] == 7).all()  # the other slot is untouched
    with pytest.raises(MediaError, match="9 frames, 10 expected"):
        decode_mp4(data, out=np.empty((10, 64, 112, 3), np.uint8))
    with pytest.raises(MediaError, match="more than the 8 frames expected"):
        decode_mp4(data, out=np.empty((8, 64, 112, 3), np.uint8))
    with pytest.raises(MediaError, match=r"frame shape \(64, 112, 3\) differs from the expected \(64, 64, 3\)"):
        decode_mp4(data, out=np.empty((9, 64, 64, 3), np.uint8))


def test_encode_mp4_rejects_odd_size_and_wrong_dtype():
    with pytest.raises(ValueError, match="even height and width"):
        encode_mp4(np.zeros((2, 63, 64, 3), np.uint8), fps=8.0)
    with pytest.raises(ValueError, match=r"uint8 \(F, H, W, 3\)"):
        encode_mp4(np.zeros((2, 64, 64, 3), np.float32), fps=8.0)


def test_read_clip_samples_frames_by_timestamp(tmp_path):
    path = write_mp4(_gray_ramp(30, step=8), tmp_path / "ramp24.mp4", fps=24.0)  # 1.25 s
    info = probe_media(path)
    assert (info.num_frames, info.fps, info.width, info.height, info.is_image) == (30, 24.0, 64, 64, False)
    assert info.duration_s == pytest.approx(1.25)
    clip = read_clip(path, info, Bucket(9, 64, 64), fps=8.0)
    assert clip.shape == (9, 64, 64, 3)
    # 8 fps from 24 fps: every third source frame, gray 8 * 3i.
    np.testing.assert_allclose(clip.reshape(9, -1).mean(axis=1), 24 * np.arange(9), atol=4)
    assert sampled_fps(info, Bucket(9, 64, 64), 8.0) == 8.0


def test_read_clip_falls_back_to_a_frame_stride_when_the_source_is_short_in_time(tmp_path):
    path = write_mp4(_gray_ramp(20, step=10), tmp_path / "short.mp4", fps=24.0)  # 0.83 s < 8/8 s
    info = probe_media(path)
    clip = read_clip(path, info, Bucket(9, 64, 64), fps=8.0)
    # stride = min(round(24 / 8), (20 - 1) // 8) = 2
    np.testing.assert_allclose(clip.reshape(9, -1).mean(axis=1), 20 * np.arange(9), atol=4)
    assert sampled_fps(info, Bucket(9, 64, 64), 8.0) == 12.0


@pytest.mark.parametrize("end_s", [None, 1.05])  # the whole source (the reported case), or that window given
def test_a_source_that_holds_the_last_sample_time_by_a_little_is_sampled_by_timestamps(tmp_path, end_s):
    # A new user's trial: a 21-frame 20 fps clip (1.05 s) was skipped by prepare with "unexpected error:
    # ValueError: window [0.000, 1.050] s ... shorter than bucket 9x64x64 at 8 fps (1.125 s)": read_clip chose
    # timestamps because the last sample time, 8/8 = 1.0 s, is inside the source, and read_clips then asked for
    # 9/8 s. Every clip of 1.0-1.125 s failed so under the default config.
    path = write_mp4(_gray_ramp(21, step=10), tmp_path / "clip.mp4", fps=20.0)  # 1.05 s
    info = probe_media(path)
    assert info.duration_s == pytest.approx(1.05)
    clip = read_clip(path, info, Bucket(9, 64, 64), fps=8.0, end_s=end_s)
    # Frame i: the source frame on screen at i / 8 s, index floor(2.5 i).
    np.testing.assert_allclose(clip.reshape(9, -1).mean(axis=1), 10 * np.floor(2.5 * np.arange(9)), atol=4)
    assert sampled_fps(info, Bucket(9, 64, 64), 8.0) == 8.0


def one_sample_source(tmp_path: Path, samples_dir: Path, name: str) -> Path:
    """A source list in `tmp_path` holding the shipped sample `name` alone (copied beside it)."""
    meta = [e for e in json.loads((samples_dir / "metadata.json").read_text()) if e["file_path"].endswith(name)]
    shutil.copy(samples_dir / name, tmp_path)
    (tmp_path / "meta.json").write_text(json.dumps(meta))
    return tmp_path / "meta.json"


def test_prepare_keeps_a_shipped_gif_of_2_08_s_in_a_17_frame_bucket_at_8_fps(tmp_path, samples_dir):
    # The same fault with a shipped sample: 48 frames over 2.08 s hold the 17th sample time (2.0 s) but not 17/8 s.
    summary = prepare(one_sample_source(tmp_path, samples_dir, "animatediff_toonyou_256.gif"), tmp_path / "shards",
                      [[17, 64, 64]], FPS, 8, progress=None)
    assert (summary.num_kept, summary.skipped) == (1, [])


def test_prepare_puts_a_short_clip_in_the_bucket_it_fills_at_data_fps_rather_than_a_longer_one_above_it(
        tmp_path, samples_dir):
    # A new user's trial: Newton's cradle (36 frames at 43.9 fps, 0.82 s: 7 frames at 8 fps by time) went to a
    # 9-frame bucket by the stride fallback (every 4th frame: 11 fps), though a 5-frame bucket holds it at the
    # configured 8 fps. The 5-frame bucket wins; alone, the 9-frame bucket still takes it above 8 fps.
    meta = [e for e in json.loads((samples_dir / "metadata.json").read_text())
            if e["file_path"].endswith("newtonscradle_200x150.gif")]
    shutil.copy(samples_dir / "newtonscradle_200x150.gif", tmp_path)
    (tmp_path / "meta.json").write_text(json.dumps(meta))
    prepare(tmp_path / "meta.json", tmp_path / "both", [[9, 64, 64], [5, 64, 64]], FPS, 8, progress=None)
    (row,) = iter_samples(tmp_path / "both")
    assert (row["num_frames"], row["fps"]) == (5, FPS)
    prepare(tmp_path / "meta.json", tmp_path / "nine", [[9, 64, 64]], FPS, 8, progress=None)
    (row,) = iter_samples(tmp_path / "nine")
    assert row["num_frames"] == 9 and row["fps"] > FPS


def test_read_clip_too_short_raises_media_error(tmp_path):
    path = write_mp4(_gray_ramp(6, step=10), tmp_path / "tiny.mp4", fps=8.0)
    with pytest.raises(MediaError, match="too short: 6 frames at 8.00 fps"):
        read_clip(path, probe_media(path), Bucket(9, 64, 64), fps=8.0)


RED, GREEN, BLUE, WHITE, BLACK = (255, 0, 0), (0, 255, 0), (0, 0, 255), (255, 255, 255), (0, 0, 0)


def _crop_card(tall: bool) -> np.ndarray:
    """uint8 (512, 128, 3) if tall else (128, 512, 3): along the long side, red up to 192, a white then a black
    64 px band (the centre 128 px, what a 64x64 bucket keeps after halving), green from 320; the centre's first
    16 px across the short side are blue (they must survive: the short side is never cropped)."""
    card = np.zeros((128, 512, 3), np.uint8)  # built wide: (H, W, 3), long side = W
    card[:, :192] = RED
    card[:, 192:256] = WHITE
    card[:, 256:320] = BLACK
    card[:16, 192:320] = BLUE
    card[:, 320:] = GREEN
    return card.transpose(1, 0, 2).copy() if tall else card


@pytest.mark.parametrize("tall", [False, True], ids=["wide", "tall"])
@pytest.mark.parametrize("kind", ["video", "still"])
def test_read_clip_center_crop_keeps_the_centre_and_drops_the_long_side_borders(tmp_path, kind, tall):
    card = _crop_card(tall)
    if kind == "video":
        path = write_mp4(np.stack([card] * 12), tmp_path / "card.mp4", fps=8.0)
        bucket, tolerance = Bucket(9, 64, 64), 40  # H.264 4:2:0 blurs colour edges by a pixel or two
    else:
        from PIL import Image

        path = tmp_path / "card.png"
        Image.fromarray(card).save(path)
        bucket, tolerance = Bucket(1, 64, 64), 8
    clip = read_clip(path, probe_media(path), bucket, fps=8.0)
    assert clip.shape == (bucket.num_frames, 64, 64, 3)
    # Compare in the card's own orientation: the long side along axis 2 (width).
    frames = clip.transpose(0, 2, 1, 3) if tall else clip
    frames = frames.astype(np.int16)

    def region_is(colour, rows, cols):
        error = np.abs(frames[:, rows, cols] - np.array(colour)).max()
        assert error <= tolerance, f"{kind} {'tall' if tall else 'wide'}: region {rows}, {cols} off {colour} by {error}"

    region_is(BLUE, slice(0, 6), slice(3, 61))  # the short side is scaled, not cropped: its first 8 px are blue
    region_is(WHITE, slice(10, 64), slice(3, 29))  # the centre's first half
    region_is(BLACK, slice(10, 64), slice(35, 61))  # and its second half, in order (not mirrored)
    # Nothing of the red and green borders survives, even in the outermost columns.
    edges = frames[:, 10:, [0, 63]]  # (F, H, 2, 3): white on the left, black on the right
    assert edges[:, :, 0, 1].min() >= 255 - 3 * tolerance and edges[:, :, 1, 1].max() <= 3 * tolerance


def test_probe_media_reads_gif_timing_and_images(samples_dir):
    gif = probe_media(samples_dir / "newtonscradle_200x150.gif")
    assert (gif.width, gif.height, gif.num_frames, gif.codec) == (200, 150, 36, "gif")
    assert gif.duration_s == pytest.approx(0.82)  # variable frame durations, 1/100 s ticks
    png = probe_media(samples_dir / "animatediff_sailboat_painting.png")
    assert (png.is_image, png.num_frames, png.width, png.height) == (True, 1, 384, 256)


@pytest.mark.parametrize(
    ("make", "reason"),
    [
        (lambda p: None, "file not found"),
        (lambda p: p.write_bytes(b""), "zero-byte"),
        (lambda p: p.write_text("not a video\n" * 10), "not a readable media file"),
    ],
)
def test_probe_media_names_the_problem(tmp_path, make, reason):
    path = tmp_path / "bad.mp4"
    make(path)
    with pytest.raises(MediaError, match=reason):
        probe_media(path)


# --- source lists ------------------------------------------------------------------------------------------


def test_read_source_resolves_easyanimate_json(samples_dir):
    items = read_source(samples_dir / "metadata.json")
    assert len(items) == 6
    assert all(item.file_path.is_absolute() and item.file_path.is_file() for item in items)
    assert [item.is_image for item in items].count(True) == 1
    assert items[0].text.startswith("A short handheld")


def test_read_source_reads_open_sora_csv_with_relative_and_absolute_paths(tmp_path, samples_dir):
    shutil.copy(samples_dir / "finetrainers_hiker_tiny_368x240.mp4", tmp_path / "hiker.mp4")
    png = samples_dir / "animatediff_sailboat_painting.png"
    (tmp_path / "data.csv").write_text(
        "path,text,num_frames,height,width,fps\n"
        'hiker.mp4,"A hiker, on a summit",49,240,368,8\n'
        f"{png},a sailboat,,,,\n"
    )
    items = read_source(tmp_path / "data.csv")
    assert items[0].file_path == tmp_path / "hiker.mp4" and items[0].text == "A hiker, on a summit"
    assert items[0].hints == {"num_frames": 49, "height": 240, "width": 368, "fps": 8.0}
    assert (items[0].is_image, items[1].is_image, items[1].file_path) == (False, True, png)


@pytest.mark.parametrize(
    ("name", "content", "message"),
    [
        ("meta.json", '{"file_path": "a.mp4", "text": "x"}', "holds a JSON dict; expected a JSON list"),
        ("meta.json", '[{"path": "a.mp4", "text": "x"}]', "needs a non-empty string 'file_path'"),
        ("meta.json", '[{"file_path": "a.mp4", "text": "x", "type": "gif"}]', "'type' must be 'video' or 'image'"),
        ("meta.json", "[]", "lists no files"),
        ("meta.json", "{not json", "not valid JSON"),
        ("data.csv", "file,caption\na.mp4,x\n", r"missing column\(s\) \['path', 'text'\]"),
        ("data.txt", "a.mp4\n", "unknown extension '.txt'"),
    ],
)
def test_read_source_rejects_bad_formats_with_a_clear_message(tmp_path, name, content, message):
    (tmp_path / name).write_text(content)
    with pytest.raises(ValueError, match=message):
        read_source(tmp_path / name)


# --- prepare -> shards ----------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def prepared(samples_dir, tmp_path_factory):
    shards_dir = tmp_path_factory.mktemp("shards")
    lines: list[str] = []
    summary = prepare(
        samples_dir / "metadata.json", shards_dir, BUCKETS, FPS, samples_per_shard=4, progress=lines.append
    )
    return summary, shards_dir, lines


def test_prepare_keeps_every_sample_and_writes_index_last(prepared):
    summary, shards_dir, lines = prepared
    assert (summary.num_kept, summary.num_skipped) == (6, 0)
    assert summary.bucket_counts == {"9x64x64": 5, "1x64x64": 1}
    assert len(lines) == 6 and all("kept" in line for line in lines)
    index = read_index(shards_dir)
    assert index["num_samples"] == 6 and index["bucket_counts"] == {"9x64x64": 5, "1x64x64": 1}
    assert [s["file"] for s in index["shards"]] == [f"gen.00001/shard.0000{i}.parquet" for i in range(3)]
    assert [s["num_samples"] for s in index["shards"]] == [4, 1, 1]  # one bucket per shard: 4 + 1 clips, 1 image
    assert index["buckets"] == BUCKETS and index["fps"] == FPS
    # The index records every file it commits as it was on disk: sizes and content hashes match.
    for entry in [*index["shards"], index["report"]]:
        data = (shards_dir / entry["file"]).read_bytes()
        assert (len(data), hashlib.sha256(data).hexdigest()) == (entry["bytes"], entry["sha256"])
    assert summary.report_path == shards_dir / "gen.00001" / "report.json" == shards_dir / index["report"]["file"]
    assert read_report(shards_dir)["num_kept"] == 6
    assert "Prepared 6 of 6 files into 3 shard(s)" in str(summary)


def test_prepare_writes_shards_then_report_then_index_then_deletes_the_old_generation(tmp_path, samples_dir,
                                                                                     monkeypatch):
    """Write order of a real first prepare and re-prepare, seen by intercepting the renames and deletions."""
    events: list[tuple[str, str]] = []
    shards_dir = tmp_path / "shards"
    real_replace, real_unlink, real_rmtree = os.replace, os.unlink, shutil.rmtree

    def rel(path) -> str:
        return os.path.relpath(path, shards_dir)

    def replace(src, dst, *args, **kwargs):
        events.append(("write", rel(dst)))
        return real_replace(src, dst, *args, **kwargs)

    def unlink(path, *args, **kwargs):
        if kwargs.get("dir_fd") is None:  # rmtree's own unlinks (relative to a dir_fd) count as its one delete
            events.append(("delete", rel(path)))
        return real_unlink(path, *args, **kwargs)

    def rmtree(path, *args, **kwargs):
        events.append(("delete", rel(path)))
        return real_rmtree(path, *args, **kwargs)

    monkeypatch.setattr(os, "replace", replace)
    monkeypatch.setattr(os, "unlink", unlink)
    monkeypatch.setattr(shutil, "rmtree", rmtree)
    for generation in ("gen.00001", "gen.00002"):
        events.clear()
        prepare(samples_dir / "metadata.json", shards_dir, BUCKETS, FPS, samples_per_shard=4, progress=None)
        writes = [name for kind, name in events if kind == "write"]
        assert writes == [f"{generation}/shard.0000{i}.parquet" for i in range(3)] + [
            f"{generation}/samples.parquet", f"{generation}/report.json", "index.json"]
        commit = events.index(("write", "index.json"))
        deletes = [name for kind, name in events if kind == "delete"]
        assert all(events.index(("delete", name)) > commit for name in deletes)  # nothing goes before the switch
        assert deletes == ([] if generation == "gen.00001" else ["gen.00001"])
    assert sorted(p.name for p in shards_dir.iterdir()) == [".vidray-prepare.lock", "gen.00002", "index.json"]


def test_prepared_shards_have_the_training_columns_and_bucket_shapes(prepared):
    _, shards_dir, _ = prepared
    rows = list(iter_samples(shards_dir))
    assert len(rows) == 6 and set(rows[0]) == set(SHARD_SCHEMA.names)
    by_name = {row["source_path"].rsplit("/", 1)[-1]: row for row in rows}
    realshort = by_name["realshort_320x240_30.02fps.mp4"]
    assert realshort["source_fps"] == pytest.approx(30.02, abs=0.01) and realshort["fps"] == 8.0
    assert (realshort["source_width"], realshort["source_height"], realshort["source_num_frames"]) == (320, 240, 36)
    # Newton's cradle lasts 0.82 s < 9 frames at 8 fps: stride fallback over its 36 frames.
    assert by_name["newtonscradle_200x150.gif"]["fps"] > FPS
    samples = load_samples(shards_dir)
    assert len({s.sample_id for s in samples}) == 6
    for sample in samples:
        assert sample.video.shape == (*sample.bucket, 3) and sample.video.dtype == np.uint8
        assert sample.caption
    assert {s.bucket for s in samples} == {Bucket(9, 64, 64), Bucket(1, 64, 64)}


def test_prepare_skips_and_reports_bad_files_and_keeps_the_good_ones(tmp_path, samples_dir):
    media = tmp_path / "media"
    media.mkdir()
    (media / "zero.mp4").write_bytes(b"")
    (media / "truncated.mp4").write_bytes((samples_dir / "realshort_320x240_30.02fps.mp4").read_bytes()[:2048])
    (media / "text.mp4").write_text("this is not a video\n" * 50)
    entries = [
        {"file_path": str(samples_dir / "finetrainers_hiker_tiny_368x240.mp4"), "text": "hiker", "type": "video"},
        {"file_path": "zero.mp4", "text": "zero", "type": "video"},
        {"file_path": "truncated.mp4", "text": "truncated", "type": "video"},
        {"file_path": "text.mp4", "text": "text", "type": "video"},
        {"file_path": "missing.mp4", "text": "missing", "type": "video"},
        {"file_path": str(samples_dir / "animatediff_sailboat_painting.png"), "text": "sailboat", "type": "image"},
    ]
    (media / "meta.json").write_text(json.dumps(entries))
    shards_dir = tmp_path / "shards"
    lines: list[str] = []
    summary = prepare(media / "meta.json", shards_dir, BUCKETS, FPS, samples_per_shard=64, progress=lines.append)
    assert (summary.num_kept, summary.num_skipped) == (2, 4)
    report = read_report(shards_dir)
    reasons = {item["path"].rsplit("/", 1)[-1]: item["reason"] for item in report["skipped"]}
    assert set(reasons) == {"zero.mp4", "truncated.mp4", "text.mp4", "missing.mp4"}
    assert "zero-byte" in reasons["zero.mp4"]
    assert "not a readable media file" in reasons["truncated.mp4"]
    assert "not a readable media file" in reasons["text.mp4"]
    assert "not found" in reasons["missing.mp4"]
    assert report["num_kept"] == 2 and read_index(shards_dir)["num_samples"] == 2
    assert sum("skipped" in line for line in lines) == 4
    assert "Skipped 4" in str(summary)


def test_prepare_reports_too_short_videos_and_missing_bucket_kinds(tmp_path):
    write_mp4(_gray_ramp(6, step=10), tmp_path / "six.mp4", fps=8.0)
    (tmp_path / "meta.json").write_text(json.dumps([{"file_path": "six.mp4", "text": "six", "type": "video"}]))
    summary = prepare(tmp_path / "meta.json", tmp_path / "shards", [[9, 64, 64]], FPS, 8, progress=None)
    assert summary.num_kept == 0
    assert "too short: 6 frames at 8.00 fps" in summary.skipped[0][1]
    assert "No sample was kept: nothing committed; check" in str(summary)  # no previous dataset to mention
    # Not "Prepared 0 of 1 files into 0 shard(s) of one bucket and similar captions each" (a new user's trial).
    assert str(summary).startswith(f"Kept none of 1 files for {tmp_path / 'shards'} at 8 fps (")
    assert not (tmp_path / "shards" / "index.json").exists()  # a first prepare keeping nothing commits nothing
    assert not list((tmp_path / "shards").glob("gen.*"))
    report = json.loads((tmp_path / "shards" / "last_failed_report.json").read_text())
    assert report["committed"] is False and "too short" in report["skipped"][0]["reason"]
    assert summary.report_path == tmp_path / "shards" / "last_failed_report.json"


def test_prepare_from_csv_source(tmp_path, samples_dir):
    (tmp_path / "data.csv").write_text(
        "path,text\n"
        f"{samples_dir / 'finetrainers_hiker_tiny_368x240.mp4'},a hiker\n"
        f"{samples_dir / 'animatediff_sailboat_painting.png'},a sailboat\n"
    )
    summary = prepare(tmp_path / "data.csv", tmp_path / "shards", BUCKETS, FPS, 64, progress=None)
    assert summary.bucket_counts == {"9x64x64": 1, "1x64x64": 1}
    assert sorted(s.caption for s in load_samples(tmp_path / "shards")) == ["a hiker", "a sailboat"]


def test_prepare_overwrites_a_previous_run_cleanly(tmp_path, samples_dir):
    shards_dir = tmp_path / "shards"
    first = prepare(samples_dir / "metadata.json", shards_dir, BUCKETS, FPS, 1, progress=None)
    assert len(list(shards_dir.glob("gen.00001/shard.*.parquet"))) == first.num_kept == 6
    ids = {s.sample_id for s in load_samples(shards_dir)}
    prepare(samples_dir / "metadata.json", shards_dir, BUCKETS, FPS, 64, progress=None)
    assert sorted(str(p.relative_to(shards_dir)) for p in shards_dir.glob("**/shard.*.parquet")) == [
        "gen.00002/shard.00000.parquet", "gen.00002/shard.00001.parquet"  # one per bucket
    ]
    assert {s.sample_id for s in load_samples(shards_dir)} == ids  # sample ids are stable


def test_prepare_rejects_a_bad_source_before_touching_the_shards_dir(tmp_path, prepared):
    (tmp_path / "meta.json").write_text('{"oops": 1}')
    with pytest.raises(ValueError, match="expected a JSON list"):
        prepare(tmp_path / "meta.json", tmp_path / "shards", BUCKETS, FPS, 8, progress=None)
    assert not (tmp_path / "shards").exists()
    with pytest.raises(ValueError, match="multiples of 16"):
        prepare(tmp_path / "meta.json", tmp_path / "shards", [[9, 60, 64]], FPS, 8, progress=None)


def test_read_index_refuses_an_unfinished_prepare(tmp_path, prepared):
    _, shards_dir, _ = prepared
    unfinished = tmp_path / "unfinished"
    unfinished.mkdir()
    shutil.copytree(shards_dir / "gen.00001", unfinished / "gen.00001")
    with pytest.raises(FileNotFoundError, match=r"unfinished prepare\): run `vidray prepare` first"):
        read_index(unfinished)
    with pytest.raises(FileNotFoundError, match="run `vidray prepare` first"):
        list(iter_samples(tmp_path / "nothing"))


def test_prepare_reports_a_clip_sampled_above_data_fps_to_fill_its_bucket(tmp_path, samples_dir):
    # Newton's cradle (36 frames at 43.9 fps, 0.82 s) fills a 9-frame bucket only by taking every 4th frame: 10.98
    # fps, so its motion plays 1.4x slower than its bucket-mates' at 8 fps. Kept, and said in report and summary.
    summary = prepare(one_sample_source(tmp_path, samples_dir, "newtonscradle_200x150.gif"), tmp_path / "shards",
                      [[9, 64, 64]], FPS, 8, progress=None)
    ((path, clip_fps),) = summary.off_rate
    assert path.endswith("newtonscradle_200x150.gif") and clip_fps == pytest.approx(10.98, abs=0.01)
    assert "newtonscradle_200x150.gif at 10.98 fps (1.4x slower)" in str(summary)
    report = read_report(tmp_path / "shards")
    assert report["num_off_rate"] == 1 and report["off_rate"][0]["slowdown"] == pytest.approx(1.372, abs=1e-3)


def test_a_short_clip_takes_the_bucket_that_changes_its_rate_least_not_the_longest(tmp_path, samples_dir):
    # Issue 43's example: Newton's cradle (36 frames at 43.9 fps, 0.82 s) fills no bucket at 8 fps. It went to the
    # longest one it holds frames for, 17x64x64, by every 2nd frame: 21.95 fps, its motion 2.7x slower than its
    # bucket-mates'. The 9-frame bucket (every 4th frame, 10.98 fps: 1.37x) changes its rate least.
    source = one_sample_source(tmp_path, samples_dir, "newtonscradle_200x150.gif")
    summary = prepare(source, tmp_path / "shards", [[17, 64, 64], [9, 64, 64]], FPS, 8, progress=None)
    (row,) = iter_samples(tmp_path / "shards")
    assert (row["num_frames"], row["fps"]) == (9, pytest.approx(10.98, abs=0.01))
    assert summary.bucket_counts == {"17x64x64": 0, "9x64x64": 1}
    assert "newtonscradle_200x150.gif at 10.98 fps (1.4x slower)" in str(summary)  # the rate used, reported


def test_a_short_clip_beyond_max_rate_change_is_skipped_with_the_setting_to_raise(tmp_path, samples_dir):
    # With 17x64x64 alone, the cradle's nearest bucket needs 21.95 fps: a 2.74x change > data.max_rate_change 1.5.
    source = one_sample_source(tmp_path, samples_dir, "newtonscradle_200x150.gif")
    summary = prepare(source, tmp_path / "shards", [[17, 64, 64]], FPS, 8, progress=None)
    ((path, reason),) = summary.skipped
    assert path.endswith("newtonscradle_200x150.gif") and summary.num_kept == 0
    assert reason == ("too short for data.fps 8: 0.82 s, the nearest bucket 17x64x64 needs it sampled at 21.95 fps, "
                      "a 2.74x rate change (motion 2.74x slower) > data.max_rate_change 1.5 (raise it to keep such "
                      "clips, or add a bucket with fewer frames)")
    assert f"newtonscradle_200x150.gif: {reason}" in str(summary)
    report = json.loads(Path(summary.report_path).read_text())  # nothing kept: last_failed_report.json
    assert report["skipped"] == [{"path": path, "reason": reason}]
    # Raised, the bound keeps it, at the rate said in the off-rate report.
    summary = prepare(source, tmp_path / "kept", [[17, 64, 64]], FPS, 8, progress=None, max_rate_change=3.0)
    ((_, clip_fps),) = summary.off_rate
    assert summary.skipped == [] and clip_fps == pytest.approx(21.95, abs=0.01)
    assert read_report(tmp_path / "kept")["off_rate"][0]["slowdown"] == pytest.approx(2.744, abs=1e-3)
    with pytest.raises(ValueError, match="max_rate_change must be >= 1.0"):
        prepare(source, tmp_path / "bad", [[17, 64, 64]], FPS, 8, progress=None, max_rate_change=0.5)


@pytest.mark.parametrize("override, message", [
    ("data.min_source_side_px=-1", "data.min_source_side_px must be >= 0 pixels"),
    ("data.max_upscale=0.5", "data.max_upscale must be >= 1.0"),
    ("data.max_rate_change=0.9", r"data.max_rate_change must be >= 1.0 \(a factor"),
])
def test_source_floor_settings_are_checked_at_load(override, message):
    from vidray.config import ConfigError, load_job_config

    with pytest.raises(ConfigError, match=message):
        load_job_config(None, [override])
