"""Video I/O with PyAV only: probe a source file, read one bucket-shaped clip from it, and encode/decode the
H.264 mp4 bytes that shards carry.

```python
info = probe_media("samples/cogvideo_horse_720x480_8fps.mp4")    # one open, header + first frame
video = read_clip(path, info, Bucket(9, 64, 64), fps=8.0)         # uint8 (F, H, W, 3)
part = read_clip(path, info, Bucket(9, 64, 64), fps=8.0, start_s=2.0, end_s=3.5)   # a window of the source
data = encode_mp4(video, fps=8.0)                                 # H.264 yuv420p bytes
assert decode_mp4(data).shape == video.shape
```

Display geometry: `MediaInfo.width`/`height` are what a viewer sees, and `read_clip` returns upright frames at
square pixels. Three things a file may say about its display are honoured, as FFmpeg's player does:
- the display matrix (rotation side data, e.g. a phone's portrait clip stored 320x240 with rotation -90, and
  mirrors), read from the first decoded frame, mapped like FFmpeg's `autorotate`;
- the sample aspect ratio (`stream.sample_aspect_ratio`, else the codec's): a 320x240 stream at SAR 2 displays
  640x240;
- for stills, the EXIF Orientation tag (JPEG, PNG, WebP, ...), read with PIL with `ImageOps.exif_transpose`
  semantics (FFmpeg's display matrix for stills drops mirrors).
All three are kept as one EXIF-style `orientation` code (1-8) plus `sample_aspect_ratio`.

Frame counting: the frames that are *presented*. An MP4/MOV edit list (a clip trimmed by stream copy) hides
samples that the header still counts (`stream.frames` 51, 36 shown); probe counts the index entries that are not
marked discard (no decoding, ~1 ms for a 30 s clip) and takes the duration of the edit, so clip sampling and
buckets see the frames that decode.

Frame sampling (`read_clip`): frame i of the clip is the source frame on screen at `start_s + i / fps` seconds
after the first frame (a nearest-earlier-timestamp pick, which also handles variable-rate sources). When the
source lasts less than `(num_frames - 1) / fps` seconds but still holds `num_frames` frames (and no window is
given), the clip takes every `stride`-th source frame instead,
`stride = min(round(source_fps / fps), (source_frames - 1) // (num_frames - 1))` (at least 1); its sampled rate
is then `source_fps / stride` (see `sampled_fps`). A source slower than `fps` repeats frames. The picked frames
are turned upright, resized (aspect kept at square pixels, the short side covers the bucket) and center-cropped,
with one resampling: swscale (bicubic) converts and shrinks video frames in one pass, PIL resamples stills and
frames that must be enlarged. `read_clips` reads several windows (e.g. one per scene) in one decode pass.
"""

from __future__ import annotations

import io
import math
import struct
from dataclasses import dataclass
from fractions import Fraction
from pathlib import Path
from typing import NamedTuple, Sequence

import av
import numpy as np
from PIL import Image, UnidentifiedImageError

from vidray.buckets import Bucket
from vidray.errors import UserError

# Containers whose header indexes every frame (index entries, average_rate are exact there).
_INDEXED_FORMATS = ("mov", "mp4")
# Time tolerance (s) when matching frame timestamps to sample times.
_EPS_S = 1e-4
# EXIF Orientation code -> the PIL transpose that shows the stored picture upright (PIL `ImageOps.exif_transpose`).
_ORIENTATION_TRANSPOSE = {
    2: Image.Transpose.FLIP_LEFT_RIGHT,
    3: Image.Transpose.ROTATE_180,
    4: Image.Transpose.FLIP_TOP_BOTTOM,
    5: Image.Transpose.TRANSPOSE,
    6: Image.Transpose.ROTATE_270,
    7: Image.Transpose.TRANSVERSE,
    8: Image.Transpose.ROTATE_90,
}
# EXIF Orientation code -> (clockwise degrees, mirrored), as the EXIF spec words them.
_ORIENTATION_ROTATION = {1: (0, False), 2: (0, True), 3: (180, False), 4: (180, True),
                         5: (270, True), 6: (90, False), 7: (90, True), 8: (270, False)}
_EXIF_ORIENTATION_TAG = 0x0112


class MediaError(UserError):
    """A media file that cannot be used: missing, empty, undecodable, no video stream, or too short."""


@dataclass(frozen=True)
class MediaInfo:
    """What `probe_media` found in a file. Sizes in pixels, `fps` in frames/s, `duration_s` in seconds."""

    width: int
    """Display width: what a viewer sees, after the sample aspect ratio and the orientation."""
    height: int
    """Display height (see `width`)."""
    fps: float
    """Mean frame rate: the container's average rate for mp4/mov, else num_frames / duration (GIFs are often
    variable-rate; their nominal rate is the tick rate, e.g. 100)."""
    num_frames: int
    """Frames presented (an MP4 edit list's hidden samples are not counted)."""
    duration_s: float
    """From the first frame's start to the last frame's end."""
    is_image: bool
    """A still image (PNG, JPEG, WebP, ...): one frame, no meaningful fps."""
    codec: str
    stored_width: int = 0
    """Width of the decoded pictures before orientation and sample aspect (0: same as `width`)."""
    stored_height: int = 0
    """Height of the decoded pictures (0: same as `height`)."""
    orientation: int = 1
    """EXIF-style code 1-8 of the turn/mirror that shows stored pictures upright (1: none, 6: rotate 90 degrees
    clockwise, e.g. a phone's portrait clip with display rotation -90; see `rotation`, `mirrored`)."""
    sample_aspect_ratio: float = 1.0
    """Width of one stored pixel over its height on screen (2.0: an anamorphic 320x240 that displays 640x240)."""
    start_time_s: float = 0.0
    """Presentation time of the first frame in the container's timeline (s); clip times count from it."""

    @property
    def rotation(self) -> int:
        """Clockwise degrees (0, 90, 180, 270) the stored picture turns to be displayed (PyAV's
        `frame.rotation` is the counter-clockwise angle: -90 there is 90 here)."""
        return _ORIENTATION_ROTATION[self.orientation][0]

    @property
    def mirrored(self) -> bool:
        """Whether the display also mirrors the picture (EXIF orientations 2, 4, 5, 7)."""
        return _ORIENTATION_ROTATION[self.orientation][1]

    @property
    def swaps_axes(self) -> bool:
        """Whether the display turns the picture by 90 or 270 degrees (stored width becomes display height)."""
        return self.orientation >= 5


def _open(path: Path) -> av.container.InputContainer:
    if not path.exists():
        raise MediaError(f"{path}: file not found")
    if not path.is_file():
        raise MediaError(f"{path}: not a regular file")
    if path.stat().st_size == 0:
        raise MediaError(f"{path}: zero-byte file")
    try:
        container = av.open(str(path))
    except (av.FFmpegError, OSError, UnicodeDecodeError) as err:
        raise MediaError(f"{path}: not a readable media file ({type(err).__name__}: {err})") from None
    if not container.streams.video:
        container.close()
        raise MediaError(f"{path}: no video stream (audio-only or not a video)")
    if _first_video_stream(container) is None:
        container.close()
        raise MediaError(
            f"{path}: no video stream: its only picture is cover art (an attached picture, e.g. an album cover "
            "embedded in an audio file)"
        )
    return container


def _is_attached_picture(stream: av.video.stream.VideoStream) -> bool:
    return bool(stream.disposition & av.stream.Disposition.attached_pic)


def _first_video_stream(container: av.container.InputContainer) -> av.video.stream.VideoStream | None:
    """The first video stream that is not an attached picture (cover art), or None."""
    return next((s for s in container.streams.video if not _is_attached_picture(s)), None)


def _video_stream(container: av.container.InputContainer) -> av.video.stream.VideoStream:
    stream = _first_video_stream(container)
    if stream is None:
        raise MediaError("no video stream: the only picture is cover art (an attached picture)")
    stream.thread_type = "AUTO"
    return stream


def _is_image_format(container: av.container.InputContainer) -> bool:
    names = container.format.name.split(",")
    return any(n == "image2" or (n.endswith("_pipe") and n != "gif_pipe") for n in names)


def orientation_from_display_matrix(matrix: tuple[int, ...] | list[int]) -> int:
    """FFmpeg's 9-int32 display matrix (16.16 fixed point, `AV_FRAME_DATA_DISPLAYMATRIX`) -> the EXIF
    orientation code 1-8 that shows the picture upright, following FFmpeg's `autorotate` (fftools): the angle of
    `av_display_rotation_get`, rounded to 90 degrees, plus the mirror the matrix carries. Angles that are not a
    multiple of 90 degrees give 1 (not supported; FFmpeg rotates with black corners there)."""
    m = matrix
    scale0, scale1 = math.hypot(m[0], m[3]), math.hypot(m[1], m[4])
    if scale0 == 0 or scale1 == 0:
        return 1
    theta = float(round(math.degrees(math.atan2(m[1] / scale1, m[0] / scale0))))  # = -av_display_rotation_get
    theta -= 360 * math.floor(theta / 360 + 0.9 / 360)
    if abs(theta - 90) < 1:
        return 5 if m[3] > 0 else 6  # transpose=cclock_flip (a plain transpose) / transpose=clock
    if abs(theta - 180) < 1:
        return {(True, True): 3, (True, False): 2, (False, True): 4, (False, False): 1}[(m[0] < 0, m[4] < 0)]
    if abs(theta - 270) < 1:
        return 7 if m[3] < 0 else 8  # transpose=clock_flip / transpose=cclock
    return 4 if abs(theta) < 1 and m[4] < 0 else 1


def _frame_orientation(frame: av.VideoFrame) -> int:
    """Orientation of a decoded video frame from its display matrix (else its rotation angle)."""
    matrix = None
    try:
        side = frame.side_data.get(av.sidedata.sidedata.Type.DISPLAYMATRIX)
        if side is not None and len(bytes(side)) >= 36:
            matrix = struct.unpack("<9i", bytes(side)[:36])
    except (ValueError, KeyError, AttributeError):  # PyAV raises ValueError on side data types it does not know
        matrix = None
    if matrix is not None:
        return orientation_from_display_matrix(matrix)
    rotation = int(round(getattr(frame, "rotation", 0) or 0))  # counter-clockwise degrees
    return {0: 1, 90: 8, 180: 3, 270: 6}.get((rotation % 360 + 360) % 360, 1)


def _exif_orientation(path: Path) -> int | None:
    """The EXIF Orientation (1-8) of a still as PIL reads it (header only); None when PIL cannot open the file."""
    try:
        with Image.open(path) as image:
            value = image.getexif().get(_EXIF_ORIENTATION_TAG)
    except (UnidentifiedImageError, OSError, ValueError, SyntaxError):
        return None
    return int(value) if isinstance(value, int) and 1 <= value <= 8 else 1


def _sample_aspect_ratio(stream: av.video.stream.VideoStream) -> float:
    """The container's sample aspect ratio, else the codec's (FFmpeg's `av_guess_sample_aspect_ratio` order);
    1.0 when neither is set or they are not positive."""
    for value in (stream.sample_aspect_ratio, stream.codec_context.sample_aspect_ratio):
        if value is not None and value > 0:
            return float(value)
    return 1.0


def _count_presented(stream: av.video.stream.VideoStream) -> int:
    """Frames an mp4/mov presents: its index entries that no edit list discards (no decoding); the header's
    sample count when the demuxer built no index."""
    entries = stream.index_entries
    if entries is not None and len(entries) > 0:
        return sum(1 for entry in entries if not entry.is_discard)
    return stream.frames


def probe_media(path: str | Path) -> MediaInfo:
    """Open `path` once with PyAV and describe its first video stream (cover pictures are not video); decodes
    only the first frame.

    The frame count comes from the mp4/mov index (entries an edit list hides are not counted) when present, else
    from demuxing the packets (GIFs and other containers; no decoding). Images are 1 frame. Width and height are
    the display size (see the module docstring). Raises MediaError when the file is missing, zero bytes, not a
    media file, has no video stream (or only cover art), or its first frame cannot be decoded.
    """
    path = Path(path)
    container = _open(path)
    try:
        stream = _video_stream(container)
        codec = stream.codec_context.name
        is_image = _is_image_format(container)
        time_base = stream.time_base or Fraction(1, 1)
        indexed = any(n in _INDEXED_FORMATS for n in container.format.name.split(","))
        num_frames = _count_presented(stream) if indexed else 0
        duration_s = float(stream.duration * time_base) if indexed and stream.duration else 0.0
        fps = float(stream.average_rate) if indexed and stream.average_rate else 0.0
        count_packets = num_frames <= 0 or is_image
        # One pass over packets: decode until the first frame proves the stream decodes; count packets (and
        # their timestamps) only where the container has no frame index (GIF, images, mkv...).
        first, counted, first_pts, end_pts = None, 0, None, None
        try:
            for packet in container.demux(stream):
                if first is None:
                    frames = packet.decode()
                    first = frames[0] if frames else None
                if packet.size == 0 or packet.pts is None or packet.is_discard:
                    continue
                if not count_packets:
                    if first is not None:
                        break
                    continue
                counted += 1
                first_pts = packet.pts if first_pts is None else min(first_pts, packet.pts)
                end = packet.pts + (packet.duration or 0)
                end_pts = end if end_pts is None else max(end_pts, end)
        except (av.FFmpegError, OSError) as err:
            raise MediaError(f"{path}: undecodable {codec} stream ({type(err).__name__}: {err})") from None
        if first is None:
            raise MediaError(f"{path}: undecodable {codec} stream (no frame decoded)")
        if count_packets:
            num_frames = counted
            if end_pts is not None and first_pts is not None and end_pts > first_pts:
                duration_s = float((end_pts - first_pts) * time_base)
        if is_image:
            num_frames, fps, duration_s = 1, 0.0, 0.0
        if num_frames <= 0:
            raise MediaError(f"{path}: video stream holds no frames")
        if fps <= 0 and duration_s > 0 and not is_image:
            fps = num_frames / duration_s
        if fps <= 0 and not is_image:
            rate = stream.average_rate or stream.guessed_rate
            fps = float(rate) if rate else 0.0
        if duration_s <= 0 and fps > 0 and not is_image:
            duration_s = num_frames / fps
        stored_width, stored_height = stream.width or first.width, stream.height or first.height
        if stored_width <= 0 or stored_height <= 0:
            raise MediaError(f"{path}: frame size {stored_width}x{stored_height} is not valid")
        orientation = (_exif_orientation(path) if is_image else None) or _frame_orientation(first)
        sar = _sample_aspect_ratio(stream)
        shown_width, shown_height = max(1, round(stored_width * sar)), stored_height
        if orientation >= 5:
            shown_width, shown_height = shown_height, shown_width
        start_time_s = float(first.time) if first.time is not None and not is_image else 0.0
        return MediaInfo(
            width=shown_width, height=shown_height, fps=fps, num_frames=num_frames, duration_s=duration_s,
            is_image=is_image, codec=codec, stored_width=stored_width, stored_height=stored_height,
            orientation=orientation, sample_aspect_ratio=sar, start_time_s=start_time_s,
        )
    finally:
        container.close()


def num_frames_available(info: MediaInfo, fps: float) -> int:
    """Most frames a clip sampled at `fps` (frames/s) can hold from this source: by timestamps, or by the
    stride fallback (every source frame at most once). Images give 1."""
    if info.is_image:
        return 1
    by_time = math.ceil(info.duration_s * fps - 1e-6) if info.duration_s > 0 else 0
    return max(info.num_frames, by_time)


def num_frames_at_fps(info: MediaInfo, fps: float) -> int:
    """Most frames a clip of the whole source holds at `fps` (frames/s) by timestamps, without the stride fallback:
    the largest n with `(n - 1) / fps` inside the source's duration (see `read_clip`). Images give 1; a source
    with no known duration gives 0."""
    if info.is_image:
        return 1
    if info.duration_s <= 0:
        return 0
    n = max(1, math.ceil((info.duration_s - _EPS_S) * fps))
    while n > 1 and not _uses_timestamps(info, n, fps):
        n -= 1
    while _uses_timestamps(info, n + 1, fps):
        n += 1
    return n


def _uses_timestamps(info: MediaInfo, num_frames: int, fps: float) -> bool:
    return (num_frames - 1) / fps < info.duration_s - _EPS_S


def _stride(info: MediaInfo, num_frames: int, fps: float) -> int:
    stride = max(1, round(info.fps / fps)) if info.fps > 0 else 1
    if num_frames > 1:
        stride = min(stride, max(1, (info.num_frames - 1) // (num_frames - 1)))
    return stride


def sampled_fps(info: MediaInfo, bucket: Bucket, fps: float) -> float:
    """The frame rate (frames/s) of the clip `read_clip` returns: `fps`, or `source_fps / stride` when the
    source is too short in time and the stride fallback applies (see the module docstring). 1-frame clips
    (images included) report `fps`, the rate they are encoded at."""
    if info.is_image or bucket.num_frames == 1:
        return float(fps)
    if _uses_timestamps(info, bucket.num_frames, fps) or info.fps <= 0:
        return float(fps)
    return info.fps / _stride(info, bucket.num_frames, fps)


def _too_short(info: MediaInfo, bucket: Bucket, fps: float) -> MediaError:
    return MediaError(
        f"too short: {info.num_frames} frames at {info.fps:.2f} fps ({info.duration_s:.2f} s), "
        f"bucket {bucket} needs {bucket.num_frames} frames at {fps:g} fps"
    )


def _resize_center_crop_image(image: Image.Image, height: int, width: int, pixel_aspect: float) -> np.ndarray:
    w, h = image.size
    scale = max(height / h, width / (w * pixel_aspect))  # target px per display unit; one row = 1 unit tall
    crop_h, crop_w = height / scale, width / (scale * pixel_aspect)  # source pixels that map onto the target
    top, left = (h - crop_h) / 2, (w - crop_w) / 2
    out = image.resize((width, height), Image.Resampling.BICUBIC, box=(left, top, left + crop_w, top + crop_h))
    return np.asarray(out, dtype=np.uint8)


def resize_center_crop(frame: np.ndarray, height: int, width: int, *, pixel_aspect: float = 1.0) -> np.ndarray:
    """uint8 (h, w, 3) -> uint8 (height, width, 3): scale keeping the display aspect so the short side covers
    the target, then crop the center (one PIL bicubic resize of the source crop box). `pixel_aspect`: display
    width of one source pixel over its height (the sample aspect ratio; 2.0 shows a 320x240 array as 640x240).
    Raises ValueError for a non-positive `pixel_aspect`."""
    if not pixel_aspect > 0:
        raise ValueError(f"pixel_aspect must be > 0, got {pixel_aspect}")
    return _resize_center_crop_image(Image.fromarray(frame), height, width, pixel_aspect)


def display_frame(frame: np.ndarray, info: MediaInfo, height: int, width: int) -> np.ndarray:
    """A stored uint8 (h, w, 3) picture of the source `info` describes -> the upright, square-pixel picture
    resized + center-cropped to uint8 (height, width, 3): orientation first (a lossless transpose), then the
    sample aspect ratio and the resize in one resampling pass."""
    image = Image.fromarray(frame)
    if info.orientation != 1:
        image = image.transpose(_ORIENTATION_TRANSPOSE[info.orientation])
    sar = info.sample_aspect_ratio
    pixel_aspect = 1.0 / sar if info.swaps_axes else sar  # a stored pixel's aspect, after the turn
    return _resize_center_crop_image(image, height, width, pixel_aspect)


class ClipWindow(NamedTuple):
    """One clip to read: `bucket`, and its window [`start_s`, `end_s`] in seconds after the source's first frame.
    The window must hold every sample time `start_s + i / fps`, i < `bucket.num_frames`: it lasts more than
    `(num_frames - 1) / fps` (the rule `read_clip` samples by timestamps with; scene planning gives clips
    `num_frames / fps`, each frame's whole time on screen)."""

    bucket: Bucket
    start_s: float
    end_s: float


def _fit_video_frame(frame: av.VideoFrame, info: MediaInfo, height: int, width: int) -> np.ndarray:
    """A decoded frame -> uint8 (height, width, 3), like `display_frame` but faster when shrinking: swscale
    (bicubic) converts to RGB and scales both axes in one pass (the sample aspect ratio folded into the x scale,
    the short side covering the bucket), then the center crop and the orientation's lossless transpose. Frames
    that would need enlarging in either axis go through `display_frame` (PIL, one resampling of the crop box).
    The two paths agree within ~1 grey level on average (a crop offset of up to half a pixel)."""
    sar = info.sample_aspect_ratio
    shown_w, shown_h = frame.width * sar, frame.height  # display units, still in stored orientation
    target_h, target_w = (width, height) if info.swaps_axes else (height, width)  # the bucket, stored orientation
    scale = max(target_h / shown_h, target_w / shown_w)
    scaled_w = max(target_w, math.ceil(shown_w * scale - 1e-6))
    scaled_h = max(target_h, math.ceil(shown_h * scale - 1e-6))
    if scaled_w > frame.width or scaled_h > frame.height:
        return display_frame(frame.to_ndarray(format="rgb24"), info, height, width)
    scaled = frame.reformat(width=scaled_w, height=scaled_h, format="rgb24", interpolation="BICUBIC").to_ndarray()
    top, left = (scaled_h - target_h) // 2, (scaled_w - target_w) // 2
    cropped = scaled[top:top + target_h, left:left + target_w]  # (target_h, target_w, 3)
    if info.orientation == 1:
        return np.ascontiguousarray(cropped)
    turned = Image.fromarray(np.ascontiguousarray(cropped)).transpose(_ORIENTATION_TRANSPOSE[info.orientation])
    return np.asarray(turned, dtype=np.uint8)


def _fit(frame: av.VideoFrame, info: MediaInfo, height: int, width: int) -> np.ndarray:
    """Stills through PIL (`display_frame`, exact EXIF semantics), video frames through `_fit_video_frame`."""
    if info.is_image:
        return display_frame(frame.to_ndarray(format="rgb24"), info, height, width)
    return _fit_video_frame(frame, info, height, width)


def read_clip(
    path: str | Path,
    info: MediaInfo,
    bucket: Bucket,
    fps: float,
    *,
    start_s: float = 0.0,
    end_s: float | None = None,
) -> np.ndarray:
    """Read `bucket.num_frames` frames sampled at `fps` (frames/s) from `path` and fit them to the bucket.

    Returns uint8 (F, H, W, 3) RGB with (F, H, W) = `bucket`, upright at square pixels (see the module
    docstring). Without a window, one decode pass from the start, stopping at the last frame needed (a 30 s
    trailer decodes about 1 s for a 9-frame clip at 8 fps). With a window (`start_s`, `end_s`: seconds after the
    first frame, e.g. one scene), frame i is the frame on screen at `start_s + i / fps` (see `read_clips`).
    Images and 1-frame buckets give the first frame (of the window). `info` is `probe_media(path)`.
    Raises MediaError when the source cannot fill the bucket ("too short: ..."), an image meets a multi-frame
    bucket, or decoding fails; ValueError for fps <= 0 or a window outside the source or shorter than the clip.
    """
    path = Path(path)
    num_frames = bucket.num_frames
    if fps <= 0:
        raise ValueError(f"fps must be > 0 frames/s, got {fps}")
    if info.is_image and num_frames != 1:
        raise MediaError(f"{path}: an image gives 1 frame, bucket {bucket} needs {num_frames}")
    if start_s > 0 or end_s is not None:
        window_end_s = info.duration_s if end_s is None else end_s
        return read_clips(path, info, [ClipWindow(bucket, start_s, window_end_s)], fps)[0]
    if num_frames > num_frames_available(info, fps):
        raise _too_short(info, bucket, fps)
    if num_frames > 1 and _uses_timestamps(info, num_frames, fps):
        return read_clips(path, info, [ClipWindow(bucket, 0.0, info.duration_s)], fps)[0]

    # The first frame, or every `stride`-th source frame (a source too short in time; module docstring).
    stride = _stride(info, num_frames, fps)
    out = np.empty((num_frames, bucket.height, bucket.width, 3), dtype=np.uint8)  # (F, H, W, 3)
    filled = 0
    container = _open(path)
    try:
        stream = _video_stream(container)
        try:
            for index, frame in enumerate(container.decode(stream)):
                if index % stride == 0:
                    out[filled] = _fit(frame, info, bucket.height, bucket.width)
                    filled += 1
                if filled >= num_frames:
                    break
        except (av.FFmpegError, OSError) as err:
            if filled < num_frames:
                raise MediaError(f"{path}: decoding failed after {filled} frames ({err})") from None
    finally:
        container.close()
    if filled < num_frames:
        raise MediaError(
            f"{path}: decoded only {filled} of {num_frames} frames needed (truncated or corrupt stream?)"
        )
    return out


def read_clips(path: str | Path, info: MediaInfo, windows: Sequence[ClipWindow], fps: float) -> list[np.ndarray]:
    """Read several clips of one source in one decode pass (e.g. one per scene): clip j holds the frames on
    screen at `windows[j].start_s + i / fps`, i < `windows[j].bucket.num_frames` (the last frame that starts at
    or before each sample time: variable frame rates and sources slower than `fps` are sampled as shown).

    Returns one uint8 (F, H, W, 3) array per window, in the order given, upright at square pixels. Seeks to the
    key frame at or before the earliest window start, then decodes up to the last sample time (a 30 s trailer
    with one key frame decodes from its start). Raises ValueError for fps <= 0 or a window that starts before 0
    or does not hold its last sample time (lasts no more than `(num_frames - 1) / fps`; 1-frame windows: any length
    > 0); MediaError for an image with a multi-frame window, or when decoding fails or ends before the last window
    does.
    """
    path = Path(path)
    if fps <= 0:
        raise ValueError(f"fps must be > 0 frames/s, got {fps}")
    for window in windows:
        last_sample_s = (window.bucket.num_frames - 1) / fps  # after start_s (`_uses_timestamps`' rule)
        if window.start_s < 0 or window.end_s - window.start_s <= last_sample_s - _EPS_S or \
                window.end_s <= window.start_s:
            raise ValueError(
                f"window [{window.start_s:.3f}, {window.end_s:.3f}] s of {path.name} ({info.duration_s:.2f} s) is "
                f"outside the source or does not hold bucket {window.bucket}'s last sample time at {fps:g} fps "
                f"({last_sample_s:.3f} s after its start)"
            )
        if info.is_image and window.bucket.num_frames != 1:
            raise MediaError(f"{path}: an image gives 1 frame, bucket {window.bucket} needs {window.bucket.num_frames}")
    outs = [np.empty((w.bucket.num_frames, w.bucket.height, w.bucket.width, 3), np.uint8) for w in windows]
    # Every sample, in time order: (time s, window index, frame index).
    targets = sorted((w.start_s + i / fps, j, i) for j, w in enumerate(windows) for i in range(w.bucket.num_frames))
    if not targets:
        return outs
    first_s = targets[0][0]
    filled = 0
    prev: av.VideoFrame | None = None
    fitted: dict[tuple[int, int], np.ndarray] = {}  # prev, fitted to each bucket size already needed

    def take(frame: av.VideoFrame, target: tuple[float, int, int]) -> None:
        bucket = windows[target[1]].bucket
        key = (bucket.height, bucket.width)
        if key not in fitted:
            fitted[key] = _fit(frame, info, bucket.height, bucket.width)
        outs[target[1]][target[2]] = fitted[key]

    container = _open(path)
    try:
        stream = _video_stream(container)
        seeked = first_s > 0 and not info.is_image
        try:
            if seeked:
                time_base = stream.time_base or Fraction(1, 1)
                container.seek(
                    int((info.start_time_s + first_s) / time_base), stream=stream, backward=True, any_frame=False
                )
            for index, frame in enumerate(container.decode(stream)):
                if frame.time is not None:
                    t = float(frame.time) - info.start_time_s
                elif not seeked and info.fps > 0:
                    t = index / info.fps
                else:
                    raise MediaError(f"{path}: frames carry no timestamps; cannot sample from {first_s:.3f} s")
                # Sample times before this frame's start show the previous frame.
                while prev is not None and filled < len(targets) and targets[filled][0] < t - _EPS_S:
                    take(prev, targets[filled])
                    filled += 1
                if filled >= len(targets):
                    break
                prev, fitted = frame, {}
        except (av.FFmpegError, OSError) as err:
            raise MediaError(f"{path}: decoding failed after {filled} of {len(targets)} frames ({err})") from None
        # The last frame stays on screen until its window (and the source) ends.
        while prev is not None and filled < len(targets):
            target = targets[filled]
            window = windows[target[1]]
            if window.bucket.num_frames > 1 and target[0] >= min(window.end_s, info.duration_s) - _EPS_S:
                break
            take(prev, target)
            filled += 1
    finally:
        container.close()
    if filled < len(targets):
        raise MediaError(
            f"{path}: decoded only {filled} of {len(targets)} frames needed (truncated or corrupt stream?)"
        )
    return outs


def _check_frames(frames: np.ndarray) -> None:
    if not isinstance(frames, np.ndarray) or frames.dtype != np.uint8 or frames.ndim != 4 or frames.shape[-1] != 3:
        shape = getattr(frames, "shape", None)
        dtype = getattr(frames, "dtype", type(frames).__name__)
        raise ValueError(f"frames must be uint8 (F, H, W, 3), got {dtype} {shape}")
    num_frames, height, width, _ = frames.shape
    if num_frames < 1:
        raise ValueError("frames must hold at least one frame, got F=0")
    if height % 2 or width % 2:
        raise ValueError(f"H.264 yuv420p needs even height and width, got {height}x{width}")


def _encode(frames: np.ndarray, fps: float, target: io.BytesIO | str, crf: int) -> None:
    _check_frames(frames)
    if fps <= 0:
        raise ValueError(f"fps must be > 0 frames/s, got {fps}")
    rate = Fraction(fps).limit_denominator(1001)
    with av.open(target, mode="w", format="mp4") as container:
        stream = container.add_stream("libx264", rate=rate)
        stream.width, stream.height = frames.shape[2], frames.shape[1]
        stream.pix_fmt = "yuv420p"
        stream.options = {"crf": str(crf)}
        for frame in frames:
            for packet in stream.encode(av.VideoFrame.from_ndarray(frame, format="rgb24")):
                container.mux(packet)
        for packet in stream.encode(None):
            container.mux(packet)


def encode_mp4(frames: np.ndarray, fps: float, *, crf: int = 18) -> bytes:
    """uint8 (F, H, W, 3) RGB -> H.264 (libx264, yuv420p, `crf`) mp4 bytes at `fps` frames/s, in memory.

    F = 1 works (a still). Raises ValueError for another dtype/shape or an odd H or W (yuv420p needs even).
    """
    buffer = io.BytesIO()
    _encode(frames, fps, buffer, crf)
    return buffer.getvalue()


def write_mp4(frames: np.ndarray, path: str | Path, fps: float, *, crf: int = 18) -> Path:
    """Write uint8 (F, H, W, 3) RGB to an H.264 mp4 file at `path` (parents created); returns the path.

    Raises ValueError like `encode_mp4`.
    """
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    _encode(frames, fps, str(path), crf)
    return path


def decode_mp4(data: bytes, out: np.ndarray | None = None) -> np.ndarray:
    """mp4 bytes -> uint8 (F, H, W, 3) RGB, every frame.

    out: None (a new array), or a writable uint8 (F, H, W, 3) array the frames are written into, each frame copied
    once from PyAV's picture (a data loader decodes into its batch this way, without a stack of the frames).
    Raises MediaError when the bytes do not decode, or when `out` is given and the stream's frame count or frame
    size differs from its shape.
    """
    try:
        with av.open(io.BytesIO(data), mode="r") as container:
            if not container.streams.video:
                raise MediaError("mp4 bytes hold no video stream")
            stream = _video_stream(container)
            if out is None:
                frames = [frame.to_ndarray(format="rgb24") for frame in container.decode(stream)]
            else:
                count = 0
                for frame in container.decode(stream):
                    if count >= len(out):
                        raise MediaError(f"mp4 bytes hold more than the {len(out)} frames expected")
                    picture = frame.to_ndarray(format="rgb24")
                    if picture.shape != out.shape[1:]:
                        raise MediaError(f"frame shape {picture.shape} differs from the expected {out.shape[1:]}")
                    out[count] = picture
                    count += 1
                if count != len(out):
                    raise MediaError(f"mp4 bytes hold {count} frames, {len(out)} expected")
                return out
    except av.FFmpegError as err:
        raise MediaError(f"mp4 bytes do not decode ({err})") from None
    if not frames:
        raise MediaError("mp4 bytes hold no frames")
    return np.stack(frames)  # (F, H, W, 3)
