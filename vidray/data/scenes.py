"""Scene cuts: split a long source video into training clips that never straddle a cut.

```python
info = probe_media(path)
scenes = detect_scenes(path, info, threshold=27.0, min_scene_s=0.5)    # [Scene(start_s, end_s), ...]
clips = plan_scene_clips(scenes, info, buckets, fps=8.0, max_clips_per_scene=1, max_clips_per_source=32)
for clip in clips:                                                     # SceneClip(bucket, start_s, end_s, scene)
    video = read_clip(path, info, clip.bucket, 8.0, start_s=clip.start_s, end_s=clip.end_s)
```

Detection: PySceneDetect's `ContentDetector` (HSV content change between consecutive frames, threshold 27 by
default, cuts closer than `min_scene_s` merged) on every frame, decoded by PyAV and scaled by swscale to
`analysis_width_px` (160 px wide): the 30 s 854x480 Sintel trailer takes about 1.5 s on one core.

Clip rule (`plan_scene_clips`): each scene gets the bucket `assign_bucket` picks for a source of the scene's
length at `fps` (aspect closest to the source's display aspect, then the most frames); a scene shorter than every
multi-frame bucket at `fps` gets no clip. `vidray.data.ingest` passes only the buckets of the aspect ratio the whole
source got, so every clip of a source has one aspect ratio and a short scene takes a shorter bucket of it (or none),
never another aspect ratio's crop. A scene gets `min(max_clips_per_scene, floor(scene_s / clip_s))`
consecutive, non-overlapping clips of `clip_s = num_frames / fps` seconds, centred in the scene (the spare time
split before and after, which also keeps clips away from the cut frames). With more clips than
`max_clips_per_source`, clips are taken round by round (every scene's first clip, then every scene's second...)
and within the last round evenly spread over the source. Times are seconds after the source's first frame.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from pathlib import Path
from typing import NamedTuple, Sequence

import av

from vidray.buckets import Bucket

from vidray.data.buckets import assign_bucket
from vidray.data.video import MediaError, MediaInfo, _open, _video_stream

# Time tolerance (s) for comparing clip and scene bounds.
_EPS_S = 1e-6


class Scene(NamedTuple):
    """One shot of a source: from its first frame's time `start_s` to the next cut (or the source's end),
    `end_s`; seconds after the source's first frame."""

    start_s: float
    end_s: float

    @property
    def duration_s(self) -> float:
        return self.end_s - self.start_s


class SceneClip(NamedTuple):
    """One training clip planned inside a scene: `bucket`, window [`start_s`, `end_s`] in seconds after the
    source's first frame (`end_s - start_s = bucket.num_frames / fps`), and the index of its scene."""

    bucket: Bucket
    start_s: float
    end_s: float
    scene: int


@dataclass(frozen=True, kw_only=True)
class SceneSplit:
    """How `vidray prepare` splits long videos at scene cuts (`DataConfig.split_scenes` and its knobs)."""

    threshold: float = 27.0
    """ContentDetector threshold: mean HSV change (0-255 scale) between consecutive frames that makes a cut."""
    min_scene_s: float = 0.5
    """Shortest scene (s): cuts closer together than this are merged (flashes, fast strobing)."""
    max_clips_per_scene: int = 1
    """Consecutive non-overlapping clips taken from one scene (1: one clip, centred in the scene)."""
    max_clips_per_source: int = 32
    """Most clips taken from one source file."""
    analysis_width_px: int = 160
    """Width the frames are scaled to for detection (height keeps the stored aspect)."""

    def __post_init__(self) -> None:
        if not self.threshold > 0:
            raise ValueError(f"scene threshold must be > 0, got {self.threshold}; the default is 27.0")
        if self.min_scene_s < 0:
            raise ValueError(f"min_scene_s must be >= 0 seconds, got {self.min_scene_s}")
        if self.max_clips_per_scene < 1 or self.max_clips_per_source < 1:
            raise ValueError(
                f"max_clips_per_scene and max_clips_per_source must be >= 1, got {self.max_clips_per_scene} "
                f"and {self.max_clips_per_source}"
            )
        if self.analysis_width_px < 16:
            raise ValueError(f"analysis_width_px must be >= 16 px, got {self.analysis_width_px}")


def needs_scene_split(info: MediaInfo, bucket: Bucket, fps: float) -> bool:
    """Whether a source is worth scanning for cuts: a video that lasts at least two clips of `bucket` at `fps`
    (`2 * num_frames / fps` seconds). Images, 1-frame buckets and shorter videos keep one clip, unscanned."""
    if info.is_image or bucket.num_frames == 1:
        return False
    return info.duration_s >= 2 * bucket.num_frames / fps - _EPS_S


def detect_scenes(
    path: str | Path,
    info: MediaInfo,
    *,
    threshold: float = 27.0,
    min_scene_s: float = 0.5,
    analysis_width_px: int = 160,
) -> list[Scene]:
    """Find the hard cuts of `path` (`info` = `probe_media(path)`) with PySceneDetect's ContentDetector on
    frames scaled to `analysis_width_px` wide; returns the scenes in order, covering [0, info.duration_s]
    (one scene when there is no cut). See the module docstring for the parameters and cost.

    Raises MediaError when the file cannot be decoded (a decode error after some frames ends the scan there:
    the last scene then ends at the last decoded frame), ValueError for an image.
    """
    from scenedetect import FrameTimecode  # heavy: numpy, cv2, scenedetect
    from scenedetect.detectors import ContentDetector  # heavy: numpy, cv2, scenedetect

    path = Path(path)
    if info.is_image:
        raise ValueError(f"{path} is an image: it has no scenes")
    rate = info.fps if info.fps > 0 else 25.0
    min_scene_frames = max(1, round(min_scene_s * rate))
    detector = ContentDetector(threshold=threshold, min_scene_len=min_scene_frames)
    times: list[float] = []  # presentation time of every decoded frame, s after the first frame
    cut_indices: list[int] = []
    container = _open(path)  # MediaError naming the problem (missing, unreadable, no video, cover art only)
    try:
        stream = _video_stream(container)  # the first video stream that is not cover art
        width = min(analysis_width_px, info.stored_width or info.width)
        height = max(2, round(width * (info.stored_height or info.height) / (info.stored_width or info.width)))
        width, height = width - width % 2, height - height % 2
        try:
            for index, frame in enumerate(container.decode(stream)):
                t = float(frame.time) - info.start_time_s if frame.time is not None else index / rate
                times.append(t)
                small = frame.reformat(width=width, height=height, format="bgr24", interpolation="FAST_BILINEAR")
                cuts = detector.process_frame(FrameTimecode(index, fps=rate), small.to_ndarray())  # (h, w, 3) BGR
                cut_indices.extend(c.frame_num for c in cuts)
        except (av.FFmpegError, OSError) as err:
            if not times:
                raise MediaError(f"{path}: undecodable stream ({err})") from None
        if times:
            cut_indices.extend(c.frame_num for c in detector.post_process(FrameTimecode(len(times) - 1, fps=rate)))
    finally:
        container.close()
    if not times:
        raise MediaError(f"{path}: no frame decoded")
    end_s = info.duration_s if len(times) >= info.num_frames else times[-1] + 1.0 / rate
    bounds = [0.0] + sorted({times[i] for i in cut_indices if 0 < i < len(times)}) + [max(end_s, times[-1])]
    return [Scene(a, b) for a, b in zip(bounds[:-1], bounds[1:], strict=True) if b > a]


def plan_scene_clips(
    scenes: Sequence[Scene],
    info: MediaInfo,
    buckets: Sequence[Bucket],
    fps: float,
    *,
    max_clips_per_scene: int = 1,
    max_clips_per_source: int = 32,
) -> list[SceneClip]:
    """The clips to take from `scenes` (see the module docstring for the rule), ordered by start time.

    `buckets`: the configured buckets (only multi-frame ones are used); `fps` in frames/s. Every clip lies inside
    its scene: `scene.start_s <= start_s` and `end_s <= scene.end_s`. Returns [] when no scene is long enough
    for any multi-frame bucket. Raises ValueError for fps <= 0 or a max below 1.
    """
    if fps <= 0:
        raise ValueError(f"fps must be > 0 frames/s, got {fps}")
    if max_clips_per_scene < 1 or max_clips_per_source < 1:
        raise ValueError(
            f"max_clips_per_scene and max_clips_per_source must be >= 1, got {max_clips_per_scene} and "
            f"{max_clips_per_source}"
        )
    rounds: list[list[SceneClip]] = []  # rounds[k]: the k-th clip of every scene that has one
    for scene_index, scene in enumerate(scenes):
        frames_fit = math.floor(scene.duration_s * fps + 1e-6)  # n frames need n / fps seconds on screen
        bucket = assign_bucket(
            num_frames=frames_fit, height=info.height, width=info.width, buckets=buckets, is_image=False
        )
        if bucket is None:
            continue
        clip_s = bucket.num_frames / fps
        count = min(max_clips_per_scene, math.floor(scene.duration_s / clip_s + 1e-9))
        margin_s = (scene.duration_s - count * clip_s) / 2
        for k in range(count):
            start_s = scene.start_s + margin_s + k * clip_s
            clip = SceneClip(bucket, start_s, min(start_s + clip_s, scene.end_s), scene_index)
            if len(rounds) <= k:
                rounds.append([])
            rounds[k].append(clip)
    chosen: list[SceneClip] = []
    for clips in rounds:
        room = max_clips_per_source - len(chosen)
        if room <= 0:
            break
        if len(clips) > room:  # evenly spread over the source
            clips = [clips[math.floor(i * len(clips) / room)] for i in range(room)]
        chosen.extend(clips)
    return sorted(chosen, key=lambda c: c.start_s)
