"""Ingest of the edge-case files in tests/data/edge (copied from ../shared/data/edge; its README gives what each
must give): display geometry (rotation, mirrors, sample aspect, EXIF), edit lists, cover art, HEVC 10-bit,
variable frame rate, colour range, undecodable and audio-only files.

The test card as a viewer sees it: a red square in the top-left corner, a green square in the top-right, a blue
bar along the bottom and a grey centre patch of level 40 + 8 * frame index.
"""

from __future__ import annotations

import json
from pathlib import Path

import av
import numpy as np
import pytest
from PIL import Image, ImageOps

from vidray.buckets import Bucket

from vidray.data.buckets import assign_bucket
from vidray.data.ingest import prepare
from vidray.data.shards import iter_samples, load_samples
from vidray.data.video import (
    MediaError,
    decode_mp4,
    num_frames_available,
    orientation_from_display_matrix,
    probe_media,
    read_clip,
)

EDGE = Path(__file__).resolve().parents[1] / "data" / "edge"
# The buckets and rate the edge README's table is checked with.
BUCKETS = [[17, 64, 96], [9, 64, 96], [9, 96, 64], [9, 64, 64], [9, 64, 160], [1, 64, 96], [1, 96, 64], [1, 64, 64]]
FPS = 8.0
RED, GREEN, BLUE = (255, 0, 0), (0, 255, 0), (0, 0, 255)


def _bucket_for(path: Path) -> Bucket:
    info = probe_media(path)
    return assign_bucket(
        num_frames=num_frames_available(info, FPS), height=info.height, width=info.width,
        buckets=[Bucket(*b) for b in BUCKETS], is_image=info.is_image,
    )


def _corner(frame: np.ndarray, where: str, size: int = 3) -> np.ndarray:
    """Mean RGB of a size x size patch 1 px inside a corner ('tl', 'tr') or at the bottom centre ('bottom')."""
    h, w = frame.shape[:2]
    ys, xs = {
        "tl": (slice(1, 1 + size), slice(1, 1 + size)),
        "tr": (slice(1, 1 + size), slice(w - 1 - size, w - 1)),
        "bottom": (slice(h - 1 - size, h - 1), slice(w // 2 - size // 2, w // 2 - size // 2 + size)),
    }[where]
    return frame[ys, xs].reshape(-1, 3).mean(axis=0)


def _assert_upright_card(frame: np.ndarray) -> None:
    """Red top-left, green top-right, blue at the bottom: the card as a viewer sees it."""
    for where, colour in (("tl", RED), ("tr", GREEN), ("bottom", BLUE)):
        np.testing.assert_allclose(_corner(frame, where), colour, atol=40, err_msg=where)


def _extent(frame: np.ndarray, colour: tuple[int, int, int]) -> tuple[int, int]:
    """(height, width) in px of the bounding box of the pixels close to `colour`."""
    mask = np.abs(frame.astype(int) - colour).sum(axis=-1) < 150
    ys, xs = np.nonzero(mask)
    return int(ys.max() - ys.min() + 1), int(xs.max() - xs.min() + 1)


def _card(height: int = 48, width: int = 64) -> np.ndarray:
    """uint8 (height, width, 3): the test card, upright, as stored pixels."""
    card = np.full((height, width, 3), 128, np.uint8)
    card[:16, :16] = RED
    card[:16, -16:] = GREEN
    card[-8:, :] = BLUE
    return card


# --- 1. display geometry -----------------------------------------------------------------------------------


def test_phone_clip_with_rotation_is_portrait_bucketed_and_upright_like_the_reference():
    info = probe_media(EDGE / "rot90_stored320x240.mp4")
    assert (info.width, info.height) == (240, 320)  # what a viewer sees
    assert (info.stored_width, info.stored_height, info.rotation, info.orientation) == (320, 240, 90, 6)
    bucket = _bucket_for(EDGE / "rot90_stored320x240.mp4")
    assert bucket == Bucket(9, 96, 64)
    clip = read_clip(EDGE / "rot90_stored320x240.mp4", info, bucket, FPS)
    reference_path = EDGE / "portrait_240x320_ref.mp4"
    reference = read_clip(reference_path, probe_media(reference_path), bucket, FPS)
    for frame in clip:
        _assert_upright_card(frame)
    assert np.abs(clip.astype(int) - reference).mean() < 3.0


def test_anamorphic_clip_is_bucketed_by_display_aspect_and_its_squares_stay_square():
    path = EDGE / "sar2_stored320x240.mp4"
    info = probe_media(path)
    assert (info.width, info.height, info.stored_width, info.sample_aspect_ratio) == (640, 240, 320, 2.0)
    assert _bucket_for(path) == Bucket(9, 64, 160)
    clip = read_clip(path, info, Bucket(9, 64, 160), FPS)
    _assert_upright_card(clip[0])
    # A bucket of exactly the display aspect (240/640) crops nothing: the 48x48 (display px) corner squares
    # become 9.6 x 9.6 px. Read by stored size they would be twice as tall as wide.
    whole = read_clip(path, info, Bucket(1, 48, 128), FPS)[0]
    for colour in (RED, GREEN):
        height, width = _extent(whole, colour)
        assert abs(height - width) <= 1 and 9 <= height <= 11, (colour, height, width)


@pytest.mark.parametrize(
    ("degrees", "hflip", "vflip"), [(90, False, False), (270, False, False), (180, False, False), (0, True, False),
                                    (90, True, False), (0, False, True)],
)
def test_display_matrix_turns_and_mirrors_video_frames_as_ffmpeg_displays_them(tmp_path, degrees, hflip, vflip):
    card = _card()
    path = tmp_path / "turned.mp4"
    with av.open(str(path), "w") as container:
        stream = container.add_stream("libx264", rate=8)
        stream.width, stream.height, stream.pix_fmt = 64, 48, "yuv420p"
        stream.set_display_rotation(degrees, hflip=hflip, vflip=vflip)  # counter-clockwise, then mirrors
        for _ in range(2):
            for packet in stream.encode(av.VideoFrame.from_ndarray(card, format="rgb24")):
                container.mux(packet)
        for packet in stream.encode(None):
            container.mux(packet)
    expected = np.rot90(card, k=degrees // 90)
    expected = expected[:, ::-1] if hflip else expected
    expected = expected[::-1] if vflip else expected
    info = probe_media(path)
    assert (info.height, info.width) == expected.shape[:2]
    frame = read_clip(path, info, Bucket(1, *expected.shape[:2]), FPS)[0]
    assert np.abs(frame.astype(int) - expected).mean() < 8.0


def test_display_matrix_mapping_covers_rotations_and_mirrors():
    one = 1 << 16
    assert orientation_from_display_matrix([0, one, 0, -one, 0, 0, 0, 0, 1 << 30]) == 6  # a phone's rotation -90
    assert orientation_from_display_matrix([one, 0, 0, 0, one, 0, 0, 0, 1 << 30]) == 1
    assert orientation_from_display_matrix([-one, 0, 0, 0, one, 0, 0, 0, 1 << 30]) == 2  # mirrored
    assert orientation_from_display_matrix([-one, 0, 0, 0, -one, 0, 0, 0, 1 << 30]) == 3


_INVERSE_EXIF_TRANSPOSE = {
    2: Image.Transpose.FLIP_LEFT_RIGHT, 3: Image.Transpose.ROTATE_180, 4: Image.Transpose.FLIP_TOP_BOTTOM,
    5: Image.Transpose.TRANSPOSE, 6: Image.Transpose.ROTATE_90, 7: Image.Transpose.TRANSVERSE,
    8: Image.Transpose.ROTATE_270,
}


@pytest.mark.parametrize("orientation", range(1, 9))
@pytest.mark.parametrize("ext", ["png", "jpg", "webp"])
def test_still_with_exif_orientation_is_read_upright_like_pil_exif_transpose(tmp_path, orientation, ext):
    # The upright card (64 tall, 96 wide) stored turned/mirrored, with the EXIF tag that undoes it, as a camera
    # writes it. PIL's exif_transpose is the reference.
    upright_card = _card(64, 96)
    image = Image.fromarray(upright_card)
    if orientation != 1:
        image = image.transpose(_INVERSE_EXIF_TRANSPOSE[orientation])
    exif = image.getexif()
    exif[0x0112] = orientation
    path = tmp_path / f"card.{ext}"
    options = {"quality": 95} if ext == "jpg" else {"lossless": True} if ext == "webp" else {}
    image.save(path, exif=exif.tobytes(), **options)
    with Image.open(path) as opened:
        upright = np.asarray(ImageOps.exif_transpose(opened).convert("RGB"))
    assert np.abs(upright.astype(int) - upright_card).mean() < 4.0  # the file says what we meant
    info = probe_media(path)
    assert info.is_image and (info.width, info.height) == (96, 64) and info.orientation == orientation
    assert (info.stored_width, info.stored_height) == ((64, 96) if orientation >= 5 else (96, 64))
    bucket = _bucket_for(path)
    assert bucket == Bucket(1, 64, 96)
    frame = read_clip(path, info, bucket, FPS)[0]
    assert np.abs(frame.astype(int) - upright).mean() < 4.0
    _assert_upright_card(frame)


# --- 2. edit lists ----------------------------------------------------------------------------------------


def test_edit_list_clip_counts_the_frames_it_presents():
    trimmed, plain = probe_media(EDGE / "editlist_trim.mp4"), probe_media(EDGE / "editlist_control_plain.mp4")
    assert trimmed.num_frames == plain.num_frames == 36  # the header says 51
    assert trimmed.duration_s == pytest.approx(1.2) and trimmed.fps == pytest.approx(30.0)


# --- prepare over the edge list -------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def edge_prepared(tmp_path_factory):
    folder = tmp_path_factory.mktemp("edge")
    names = [
        "rot90_stored320x240.mp4", "portrait_240x320_ref.mp4", "sar2_stored320x240.mp4", "editlist_trim.mp4",
        "editlist_control_plain.mp4", "hevc10_320x240.mp4", "h264_8bit_320x240.mp4", "vfr_320x240.mp4",
        "flat_full_bt709.mp4", "flat_tv_bt709.mp4", "anim_320x240.webp", "audio_only.m4a", "audio_cover.mp3",
    ]
    entries = [{"file_path": str(EDGE / name), "text": name, "type": "video"} for name in names]
    (folder / "meta.json").write_text(json.dumps(entries))
    summary = prepare(folder / "meta.json", folder / "shards", BUCKETS, FPS, samples_per_shard=64, progress=None)
    rows = {Path(row["source_path"]).name: row for row in iter_samples(folder / "shards")}
    videos = {Path(row["source_path"]).name: decode_mp4(row["video_mp4"]) for row in rows.values()}
    reasons = {Path(path).name: reason for path, reason in summary.skipped}
    return summary, rows, videos, reasons


def test_prepare_keeps_the_edit_list_clip_with_the_frames_of_its_plain_twin(edge_prepared):
    _, rows, videos, reasons = edge_prepared
    assert "editlist_trim.mp4" not in reasons
    trim, plain = rows["editlist_trim.mp4"], rows["editlist_control_plain.mp4"]
    assert (trim["num_frames"], trim["height"], trim["width"]) == (plain["num_frames"], plain["height"], plain["width"])
    assert trim["source_num_frames"] == 36 and trim["fps"] == plain["fps"]
    assert np.abs(videos["editlist_trim.mp4"].astype(int) - videos["editlist_control_plain.mp4"]).mean() < 2.0


def test_prepare_stores_rotated_and_anamorphic_clips_as_a_viewer_sees_them(edge_prepared):
    _, rows, videos, _ = edge_prepared
    assert (rows["rot90_stored320x240.mp4"]["height"], rows["rot90_stored320x240.mp4"]["width"]) == (96, 64)
    rotated = rows["rot90_stored320x240.mp4"]
    assert (rotated["source_width"], rotated["source_height"]) == (240, 320)  # the display size
    assert (rows["sar2_stored320x240.mp4"]["height"], rows["sar2_stored320x240.mp4"]["width"]) == (64, 160)
    for name in ("rot90_stored320x240.mp4", "sar2_stored320x240.mp4"):
        _assert_upright_card(videos[name][0])
    assert np.abs(videos["rot90_stored320x240.mp4"].astype(int) - videos["portrait_240x320_ref.mp4"]).mean() < 3.0


def test_prepare_says_an_mp3_cover_is_cover_art_not_a_video(edge_prepared):
    _, rows, _, reasons = edge_prepared
    assert "audio_cover.mp3" not in rows
    assert "cover art" in reasons["audio_cover.mp3"] and "attached picture" in reasons["audio_cover.mp3"]
    assert "holds no frames" not in reasons["audio_cover.mp3"]
    assert "no video stream" in reasons["audio_only.m4a"]
    assert "undecodable webp" in reasons["anim_320x240.webp"]
    assert set(reasons) == {"audio_cover.mp3", "audio_only.m4a", "anim_320x240.webp"}


def test_video_with_a_cover_picture_uses_its_real_video_stream(tmp_path):
    path = tmp_path / "with_cover.mp4"
    with av.open(str(path), "w") as container:
        cover = container.add_stream("mjpeg", rate=1)
        cover.width, cover.height, cover.pix_fmt = 32, 32, "yuvj420p"
        cover.disposition = av.stream.Disposition.attached_pic
        video = container.add_stream("libx264", rate=8)
        video.width, video.height, video.pix_fmt = 64, 48, "yuv420p"
        for packet in cover.encode(av.VideoFrame.from_ndarray(np.full((32, 32, 3), 200, np.uint8), format="rgb24")):
            container.mux(packet)
        for packet in cover.encode(None):
            container.mux(packet)
        for i in range(12):
            frame = np.full((48, 64, 3), 10 * i, np.uint8)
            for packet in video.encode(av.VideoFrame.from_ndarray(frame, format="rgb24")):
                container.mux(packet)
        for packet in video.encode(None):
            container.mux(packet)
    with av.open(str(path)) as container:
        assert sum(bool(s.disposition & av.stream.Disposition.attached_pic) for s in container.streams.video) == 1
    info = probe_media(path)
    assert (info.width, info.height, info.num_frames, info.codec) == (64, 48, 12, "h264")
    clip = read_clip(path, info, Bucket(9, 48, 64), FPS)
    np.testing.assert_allclose(clip.reshape(9, -1).mean(axis=1), 10 * np.arange(9), atol=4)


def test_probe_names_cover_art_for_an_audio_file_with_a_picture():
    with pytest.raises(MediaError, match=r"only picture is cover art \(an attached picture"):
        probe_media(EDGE / "audio_cover.mp3")


# --- the README's "already works" rows ----------------------------------------------------------------------


def _centre_grey(frame: np.ndarray) -> float:
    h, w = frame.shape[:2]
    return float(frame[h // 2 - 2: h // 2 + 2, w // 2 - 2: w // 2 + 2].mean())


def test_hevc_10bit_and_its_8bit_twin_give_the_same_bucket_and_grey(edge_prepared):
    _, rows, videos, _ = edge_prepared
    hevc, h264 = rows["hevc10_320x240.mp4"], rows["h264_8bit_320x240.mp4"]
    assert (hevc["num_frames"], hevc["height"], hevc["width"]) == (h264["num_frames"], h264["height"], h264["width"])
    for a, b in zip(videos["hevc10_320x240.mp4"], videos["h264_8bit_320x240.mp4"], strict=True):
        assert abs(_centre_grey(a) - _centre_grey(b)) <= 3


def test_variable_frame_rate_samples_the_last_frame_shown_at_each_sample_time(edge_prepared):
    _, rows, videos, _ = edge_prepared
    with av.open(str(EDGE / "vfr_320x240.mp4")) as container:
        times = [float(frame.time) for frame in container.decode(video=0)]
    assert len(times) == 20 and times[10] - times[9] > 0.04  # 20 fps, then 5 fps
    video = videos["vfr_320x240.mp4"]
    for k, frame in enumerate(video):
        shown = max(i for i, t in enumerate(times) if t <= k / FPS + 1e-6)
        assert abs(_centre_grey(frame) - (40 + 8 * shown)) <= 4, (k, shown)
    assert rows["vfr_320x240.mp4"]["fps"] == FPS


@pytest.mark.parametrize("name", ["flat_full_bt709.mp4", "flat_tv_bt709.mp4"])
def test_full_and_limited_range_flat_cards_keep_their_colour(edge_prepared, name):
    _, _, videos, _ = edge_prepared
    np.testing.assert_allclose(videos[name].reshape(-1, 3).mean(axis=0), (200, 60, 30), atol=6)


def test_edge_prepare_keeps_every_usable_file_with_its_own_sample(edge_prepared):
    summary, rows, _, _ = edge_prepared
    assert (summary.num_kept, summary.num_skipped) == (10, 3)
    assert len(rows) == 10 and summary.num_samples == 10  # short clips: no scene split
    assert all(row["clip_start_s"] == 0.0 for row in rows.values())
    assert {s.video.shape for s in load_samples(summary.shards_dir)} >= {(9, 96, 64, 3), (9, 64, 160, 3)}


# --- sources too small to be content (issue 27, item 5) ---------------------------------------------------------


def test_prepare_skips_a_1x1_pixel_clip_instead_of_upscaling_it_to_a_64x64_bucket(tmp_path):
    # tiny_1x1_5frames.mp4: 5 frames of 1x1 px at 25 fps. It fills a 5-frame bucket (stride fallback), and was
    # kept and enlarged 64x without a word; it is skipped with the setting that would keep it.
    name = "tiny_1x1_5frames.mp4"
    (tmp_path / "meta.json").write_text(json.dumps([{"file_path": str(EDGE / name), "text": "dot", "type": "video"}]))
    buckets = [[5, 64, 64], [1, 64, 64]]
    summary = prepare(tmp_path / "meta.json", tmp_path / "shards", buckets, FPS, 8, progress=None)
    assert summary.num_kept == 0
    ((path, reason),) = summary.skipped
    assert Path(path).name == name
    assert reason == "too small: 1x1 px, shorter side 1 px < data.min_source_side_px 16 (lower it to keep such sources)"
    # With the side floor off, the upscale cap names the factor.
    summary = prepare(tmp_path / "meta.json", tmp_path / "shards", buckets, FPS, 8, progress=None,
                      min_source_side_px=0)
    assert "enlarged 64.0x to fill bucket 5x64x64 > data.max_upscale 8" in summary.skipped[0][1]
