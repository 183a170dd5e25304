"""Video I/O with PyAV only: probe a source file, read one bucket-shaped clip from it, and encode/decode the
H.264 mp4 bytes that shards carry.

```python
info = probe_media("samples/cogvideo_horse_720x480_8fps.mp4")    # one open, header + first frame
video = read_clip(path, info, Bucket(9, 64, 64), fps=8.0)         # uint8 (F, H, W, 3)
data = encode_mp4(video, fps=8.0)                                 # H.264 yuv420p bytes
assert decode_mp4(data).shape == video.shape
```

Frame sampling (`read_clip`): frame i of the clip is the source frame on screen at `i / fps` seconds after the
first frame (a nearest-earlier-timestamp pick, which also handles variable-rate GIFs). When the source lasts
less than `(num_frames - 1) / fps` seconds but still holds `num_frames` frames, the clip takes every `stride`-th
source frame instead, `stride = min(round(source_fps / fps), (source_frames - 1) // (num_frames - 1))` (at
least 1); its sampled rate is then `source_fps / stride` (see `sampled_fps`). A source slower than `fps` repeats
frames. The picked frames are resized (aspect kept, the short side covers the bucket) and center-cropped.
"""

from __future__ import annotations

import io
import math
from dataclasses import dataclass
from fractions import Fraction
from pathlib import Path

import av
import numpy as np
from PIL import Image

from vidray.data.buckets import Bucket

# Containers whose header indexes every frame (stream.frames, average_rate are exact there).
_INDEXED_FORMATS = ("mov", "mp4")
# Time tolerance (s) when matching frame timestamps to sample times.
_EPS_S = 1e-4


class MediaError(ValueError):
    """A media file that cannot be used: missing, empty, undecodable, no video stream, or too short."""


@dataclass(frozen=True)
class MediaInfo:
    """What `probe_media` found in a file. Sizes in pixels, `fps` in frames/s, `duration_s` in seconds."""

    width: int
    height: int
    fps: float
    """Mean frame rate: the container's average rate for mp4/mov, else num_frames / duration (GIFs are often
    variable-rate; their nominal rate is the tick rate, e.g. 100)."""
    num_frames: int
    duration_s: float
    """From the first frame's start to the last frame's end."""
    is_image: bool
    """A still image (PNG, JPEG, WebP, ...): one frame, no meaningful fps."""
    codec: str


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
    return container


def _video_stream(container: av.container.InputContainer) -> av.video.stream.VideoStream:
    stream = container.streams.video[0]
    stream.thread_type = "AUTO"
    return stream


def _is_image_format(container: av.container.InputContainer) -> bool:
    names = container.format.name.split(",")
    return any(n == "image2" or (n.endswith("_pipe") and n != "gif_pipe") for n in names)


def probe_media(path: str | Path) -> MediaInfo:
    """Open `path` once with PyAV and describe its first video stream; decodes only the first frame.

    The frame count comes from the mp4/mov index when present, else from demuxing the packets (GIFs and other
    containers; no decoding). Images are 1 frame. Raises MediaError when the file is missing, zero bytes,
    not a media file, has no video stream, or its first frame cannot be decoded.
    """
    path = Path(path)
    container = _open(path)
    try:
        stream = _video_stream(container)
        codec = stream.codec_context.name
        is_image = _is_image_format(container)
        time_base = stream.time_base or Fraction(1, 1)
        indexed = any(n in _INDEXED_FORMATS for n in container.format.name.split(","))
        num_frames = stream.frames if indexed else 0
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
                if packet.size == 0 or packet.pts is None:
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
        width, height = stream.width or first.width, stream.height or first.height
        if width <= 0 or height <= 0:
            raise MediaError(f"{path}: frame size {width}x{height} is not valid")
        return MediaInfo(
            width=width, height=height, fps=fps, num_frames=num_frames, duration_s=duration_s,
            is_image=is_image, codec=codec,
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


def resize_center_crop(frame: np.ndarray, height: int, width: int) -> np.ndarray:
    """uint8 (h, w, 3) -> uint8 (height, width, 3): scale keeping the aspect so the short side covers the
    target, then crop the center (done in one PIL bicubic resize of the source crop box)."""
    h, w = frame.shape[:2]
    scale = max(height / h, width / w)
    crop_h, crop_w = height / scale, width / scale  # source pixels that map onto the target
    top, left = (h - crop_h) / 2, (w - crop_w) / 2
    image = Image.fromarray(frame)
    out = image.resize(
        (width, height), Image.Resampling.BICUBIC, box=(left, top, left + crop_w, top + crop_h)
    )
    return np.asarray(out, dtype=np.uint8)


def read_clip(path: str | Path, info: MediaInfo, bucket: Bucket, fps: float) -> np.ndarray:
    """Read `bucket.num_frames` frames sampled at `fps` (frames/s) from `path` and fit them to the bucket.

    Returns uint8 (F, H, W, 3) RGB with (F, H, W) = `bucket`. One decode pass from the start, stopping at the
    last frame needed (a 30 s trailer decodes about 1 s for a 9-frame clip at 8 fps). Images and 1-frame
    buckets give the first frame. `info` is `probe_media(path)`. Raises MediaError when the source cannot fill
    the bucket ("too short: ..."), an image meets a multi-frame bucket, or decoding fails.
    """
    path = Path(path)
    num_frames = bucket.num_frames
    if fps <= 0:
        raise ValueError(f"fps must be > 0 frames/s, got {fps}")
    if info.is_image and num_frames != 1:
        raise MediaError(f"{path}: an image gives 1 frame, bucket {bucket} needs {num_frames}")
    if num_frames > num_frames_available(info, fps):
        raise _too_short(info, bucket, fps)

    by_time = num_frames > 1 and _uses_timestamps(info, num_frames, fps)
    stride = 1 if by_time else _stride(info, num_frames, fps)
    out = np.empty((num_frames, bucket.height, bucket.width, 3), dtype=np.uint8)  # (F, H, W, 3)
    filled = 0

    def fit(frame: av.VideoFrame) -> np.ndarray:  # resize as frames are picked: never hold full-size clips
        return resize_center_crop(frame.to_ndarray(format="rgb24"), bucket.height, bucket.width)

    container = _open(path)
    try:
        stream = _video_stream(container)
        t0, prev, prev_fitted = None, None, None
        try:
            for index, frame in enumerate(container.decode(stream)):
                if num_frames == 1 or (not by_time and index % stride == 0):
                    out[filled] = fit(frame)
                    filled += 1
                elif by_time:
                    t = float(frame.time) if frame.time is not None else index / info.fps
                    t0 = t if t0 is None else t0
                    # Sample times before this frame's start show the previous frame.
                    while prev is not None and filled < num_frames and filled / fps < t - t0 - _EPS_S:
                        prev_fitted = fit(prev) if prev_fitted is None else prev_fitted
                        out[filled] = prev_fitted
                        filled += 1
                    prev, prev_fitted = frame, None
                if filled >= num_frames:
                    break
        except (av.FFmpegError, OSError) as err:
            if filled < num_frames:
                raise MediaError(f"{path}: decoding failed after {filled} frames ({err})") from None
        # The last frame stays on screen until the source ends.
        while by_time and prev is not None and filled < num_frames and filled / fps < info.duration_s - _EPS_S:
            prev_fitted = fit(prev) if prev_fitted is None else prev_fitted
            out[filled] = prev_fitted
            filled += 1
    finally:
        container.close()
    if filled < num_frames:
        raise MediaError(
            f"{path}: decoded only {filled} of {num_frames} frames needed (truncated or corrupt stream?)"
        )
    return out


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


def decode_mp4(data: bytes) -> np.ndarray:
    """mp4 bytes -> uint8 (F, H, W, 3) RGB, every frame. Raises MediaError when the bytes do not decode."""
    try:
        with av.open(io.BytesIO(data), mode="r") as container:
            if not container.streams.video:
                raise MediaError("mp4 bytes hold no video stream")
            stream = _video_stream(container)
            frames = [frame.to_ndarray(format="rgb24") for frame in container.decode(stream)]
    except av.FFmpegError as err:
        raise MediaError(f"mp4 bytes do not decode ({err})") from None
    if not frames:
        raise MediaError("mp4 bytes hold no frames")
    return np.stack(frames)  # (F, H, W, 3)
