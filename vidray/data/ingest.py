"""`vidray prepare`: a source list (EasyAnimate metadata JSON or Open-Sora CSV) -> Parquet shards + index.

```python
summary = prepare("samples/metadata.json", "outputs/shards", buckets=[[9, 64, 64], [1, 64, 64]], fps=8.0,
                  samples_per_shard=64)
print(summary)      # kept/skipped counts, per-bucket counts; reasons in outputs/shards/report.json
```

Every listed file is probed once, given the bucket whose aspect ratio is closest (`assign_bucket`), sampled at
`fps`, resized + center-cropped to the bucket and stored as an H.264 mp4 (images as 1-frame mp4s). A file
that is missing, unreadable, undecodable or too short is skipped with its reason; it never stops the run.
"""

from __future__ import annotations

import csv
import hashlib
import json
import os
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any, Callable, Sequence

if TYPE_CHECKING:
    from vidray.config import DataConfig

from vidray.data.buckets import Bucket, assign_bucket, validate_bucket
from vidray.data.shards import REPORT_NAME, clear_shards_dir, write_index, write_report, write_shard
from vidray.data.video import MediaError, encode_mp4, num_frames_available, probe_media, read_clip, sampled_fps

IMAGE_EXTENSIONS = (".png", ".jpg", ".jpeg", ".webp", ".bmp")
_JSON_FORMAT = 'a JSON list of {"file_path": ..., "text": ..., "type": "video"|"image"} (EasyAnimate metadata)'
_CSV_FORMAT = "a CSV with a header row path,text[,num_frames,height,width,fps] (Open-Sora)"
_CSV_HINTS = {"num_frames": int, "height": int, "width": int, "fps": float}


@dataclass(frozen=True)
class SourceItem:
    """One entry of a source list."""

    file_path: Path
    """Absolute path (relative entries are resolved against the source file's folder)."""
    text: str
    """The caption."""
    is_image: bool
    """From the JSON `type`, else from the extension (.png/.jpg/.jpeg/.webp/.bmp)."""
    hints: dict[str, Any] = field(default_factory=dict)
    """Other columns/keys as the source gives them (e.g. CSV num_frames, height, width, fps); files are probed
    regardless, hints are never trusted for decoding."""
    listed_path: str = ""
    """The path exactly as the source lists it (sample ids hash it, so they survive moving the folder)."""


def _resolve(source: Path, listed: str) -> Path:
    path = Path(listed).expanduser()
    return path if path.is_absolute() else Path(os.path.abspath(source.parent / path))


def _is_image_path(path: str) -> bool:
    return Path(path).suffix.lower() in IMAGE_EXTENSIONS


def _read_json_source(path: Path) -> list[SourceItem]:
    try:
        entries = json.loads(path.read_text())
    except (json.JSONDecodeError, UnicodeDecodeError) as err:
        raise ValueError(f"source {path} is not valid JSON ({err}); expected {_JSON_FORMAT}") from None
    if not isinstance(entries, list):
        raise ValueError(f"source {path} holds a JSON {type(entries).__name__}; expected {_JSON_FORMAT}")
    items = []
    for i, entry in enumerate(entries):
        if not isinstance(entry, dict) or not isinstance(entry.get("file_path"), str) or not entry["file_path"]:
            raise ValueError(f"source {path}, entry {i}: needs a non-empty string 'file_path'; expected {_JSON_FORMAT}")
        if not isinstance(entry.get("text"), str):
            raise ValueError(f"source {path}, entry {i} ({entry['file_path']}): needs a string 'text' (the caption)")
        kind = entry.get("type")
        if kind is None:
            is_image = _is_image_path(entry["file_path"])
        elif kind in ("video", "image"):
            is_image = kind == "image"
        else:
            raise ValueError(f"source {path}, entry {i}: 'type' must be 'video' or 'image', got {kind!r}")
        hints = {k: v for k, v in entry.items() if k not in ("file_path", "text", "type")}
        items.append(SourceItem(_resolve(path, entry["file_path"]), entry["text"], is_image, hints, entry["file_path"]))
    return items


def _read_csv_source(path: Path) -> list[SourceItem]:
    try:
        with path.open(newline="") as f:
            reader = csv.DictReader(f)
            header = reader.fieldnames or []
            missing = [c for c in ("path", "text") if c not in header]
            if missing:
                raise ValueError(
                    f"source {path}: missing column(s) {missing} in header {header}; expected {_CSV_FORMAT}"
                )
            rows = list(reader)
    except UnicodeDecodeError as err:
        raise ValueError(f"source {path} is not a text CSV ({err}); expected {_CSV_FORMAT}") from None
    items = []
    for line, row in enumerate(rows, start=2):
        listed, text = row.get("path"), row.get("text")
        if not listed or text is None:
            raise ValueError(f"source {path}, line {line}: empty 'path' or missing 'text'; expected {_CSV_FORMAT}")
        hints: dict[str, Any] = {}
        for key, cast in _CSV_HINTS.items():
            value = (row.get(key) or "").strip()
            if value:
                try:
                    hints[key] = cast(float(value)) if cast is int else cast(value)
                except ValueError:
                    raise ValueError(
                        f"source {path}, line {line}: column {key} must be a number, got {value!r}"
                    ) from None
        items.append(SourceItem(_resolve(path, listed), text, _is_image_path(listed), hints, listed))
    return items


def read_source(path: str | Path) -> list[SourceItem]:
    """Read a source list: EasyAnimate metadata `.json` (a list of {file_path, text, type: video|image}) or an
    Open-Sora `.csv` (header path,text[,num_frames,height,width,fps]). Paths may be absolute or relative to the
    source file's folder; listed files are not opened here.

    Raises FileNotFoundError for a missing source, ValueError naming the problem and the expected format for
    anything else (another extension, not a JSON list, missing columns/keys, an empty list).
    """
    path = Path(path)
    if not path.is_file():
        hint = "" if path.is_absolute() else f" (relative paths resolve against the current directory, {Path.cwd()})"
        raise FileNotFoundError(f"source {path} does not exist{hint}; give an EasyAnimate .json or Open-Sora .csv")
    suffix = path.suffix.lower()
    if suffix == ".json":
        items = _read_json_source(path)
    elif suffix == ".csv":
        items = _read_csv_source(path)
    else:
        raise ValueError(
            f"source {path}: unknown extension {suffix!r}; expected .json ({_JSON_FORMAT}) or .csv ({_CSV_FORMAT})"
        )
    if not items:
        raise ValueError(f"source {path} lists no files")
    return items


@dataclass
class PrepareSummary:
    """What `prepare` did."""

    num_kept: int
    num_skipped: int
    skipped: list[tuple[str, str]]
    """(source path, reason) for every skipped file."""
    shards_dir: Path
    bucket_counts: dict[str, int]
    """`str(bucket)` ("9x64x64") -> samples kept in it, every configured bucket listed."""
    num_shards: int
    fps: float
    elapsed_s: float

    def __str__(self) -> str:
        total = self.num_kept + self.num_skipped
        buckets = ", ".join(f"{b}: {n}" for b, n in self.bucket_counts.items())
        text = (
            f"Prepared {self.num_kept} of {total} files into {self.num_shards} shard(s) in {self.shards_dir} "
            f"at {self.fps:g} fps in {self.elapsed_s:.1f} s; samples per bucket: {buckets}."
        )
        if self.skipped:
            reasons = "; ".join(f"{Path(p).name}: {r}" for p, r in self.skipped[:5])
            more = f" (and {len(self.skipped) - 5} more)" if len(self.skipped) > 5 else ""
            text += f" Skipped {self.num_skipped}: {reasons}{more}; all reasons in {self.shards_dir / REPORT_NAME}."
        if self.num_kept == 0:
            text += " No sample was kept: training cannot run on this folder; check the source paths and buckets."
        return text


def _sample_id(listed_path: str, bucket: Bucket) -> str:
    return hashlib.sha256(f"{listed_path}|{bucket}".encode()).hexdigest()[:16]


def _short_reason(err: Exception, path: Path) -> str:
    text = str(err)
    prefix = f"{path}: "
    return text[len(prefix):] if text.startswith(prefix) else text


def _no_bucket_reason(info, is_image: bool, buckets: Sequence[Bucket], fps: float) -> str:
    kind = [b for b in buckets if (b.num_frames == 1) == is_image]
    if not kind:
        what = "an image but no 1-frame bucket" if is_image else "a video but no multi-frame bucket"
        return f"{what} is configured (buckets: {', '.join(map(str, buckets))})"
    needed = min(b.num_frames for b in kind)
    return (
        f"too short: {info.num_frames} frames at {info.fps:.2f} fps ({info.duration_s:.2f} s), "
        f"the smallest bucket needs {needed} frames at {fps:g} fps"
    )


def prepare(
    source: str | Path,
    shards_dir: str | Path,
    buckets: Sequence[Bucket | Sequence[int]],
    fps: float,
    samples_per_shard: int,
    *,
    progress: Callable[[str], Any] | None = print,
) -> PrepareSummary:
    """Turn the files listed in `source` into Parquet shards in `shards_dir` (see `vidray.data.shards`).

    `buckets`: [num_frames, height, width] triples; `fps`: sampling rate in frames/s; `samples_per_shard`: rows
    per shard. Writes `shard.00000.parquet`..., then `report.json`, then `index.json` last; a previous prepare in
    `shards_dir` is removed first. `progress` gets one line per file (None: silent). Files that cannot be used
    are skipped and reported, never raised. Raises ValueError for bad buckets/fps/samples_per_shard or a bad
    source list, FileNotFoundError for a missing source, before touching `shards_dir`.
    """
    start = time.perf_counter()
    say = progress or (lambda _line: None)
    # 1. Check arguments and read the source list (nothing on disk changes if this fails).
    buckets = [Bucket(*b) for b in buckets]
    if not buckets:
        raise ValueError("at least one bucket is needed, e.g. [[9, 64, 64], [1, 64, 64]]")
    for bucket in buckets:
        validate_bucket(bucket)
    if fps <= 0:
        raise ValueError(f"fps must be > 0 frames/s, got {fps}")
    if samples_per_shard < 1:
        raise ValueError(f"samples_per_shard must be >= 1, got {samples_per_shard}")
    items = read_source(source)

    # 2. Clear a previous prepare (index first), so the folder never mixes two runs.
    shards_dir = Path(shards_dir)
    shards_dir.mkdir(parents=True, exist_ok=True)
    clear_shards_dir(shards_dir)

    # 3. Probe, bucket, sample, encode; flush a shard every `samples_per_shard` rows.
    rows: list[dict[str, Any]] = []
    shards: list[dict[str, Any]] = []
    kept: list[dict[str, Any]] = []
    skipped: list[tuple[str, str]] = []
    bucket_counts = {str(b): 0 for b in buckets}
    seen_ids: dict[str, int] = {}
    for i, item in enumerate(items, start=1):
        tag = f"[{i}/{len(items)}]"
        try:
            info = probe_media(item.file_path)
            is_image = item.is_image or info.is_image
            bucket = assign_bucket(
                num_frames=num_frames_available(info, fps), height=info.height, width=info.width,
                buckets=buckets, is_image=is_image,
            )
            if bucket is None:
                raise MediaError(_no_bucket_reason(info, is_image, buckets, fps))
            video = read_clip(item.file_path, info, bucket, fps)  # (F, H, W, 3) uint8
            clip_fps = sampled_fps(info, bucket, fps)
            video_mp4 = encode_mp4(video, clip_fps)
        except MediaError as err:
            skipped.append((str(item.file_path), _short_reason(err, item.file_path)))
            say(f"{tag} skipped {item.file_path.name}: {skipped[-1][1]}")
            continue
        except Exception as err:  # noqa: BLE001 - one bad file must not stop the run; it is reported
            skipped.append((str(item.file_path), f"unexpected error: {type(err).__name__}: {err}"))
            say(f"{tag} skipped {item.file_path.name}: {skipped[-1][1]}")
            continue
        sample_id = _sample_id(item.listed_path or str(item.file_path), bucket)
        seen_ids[sample_id] = seen_ids.get(sample_id, 0) + 1
        if seen_ids[sample_id] > 1:  # the same file listed again (e.g. another caption)
            sample_id = f"{sample_id}-{seen_ids[sample_id] - 1}"
        rows.append(
            {
                "sample_id": sample_id,
                "video_mp4": video_mp4,
                "caption": item.text,
                "num_frames": bucket.num_frames,
                "height": bucket.height,
                "width": bucket.width,
                "fps": clip_fps,
                "source_path": str(item.file_path),
                "source_width": info.width,
                "source_height": info.height,
                "source_fps": info.fps,
                "source_num_frames": info.num_frames,
                "source_duration_s": info.duration_s,
            }
        )
        bucket_counts[str(bucket)] += 1
        kept.append({"path": str(item.file_path), "sample_id": sample_id, "bucket": list(bucket), "fps": clip_fps})
        source_desc = "image" if is_image else f"{info.num_frames} frames @ {info.fps:.2f} fps"
        say(
            f"{tag} kept    {item.file_path.name} -> bucket {bucket} at {clip_fps:.2f} fps "
            f"({info.width}x{info.height}, {source_desc}, {len(video_mp4) / 1024:.1f} KiB)"
        )
        if len(rows) >= samples_per_shard:
            shards.append(write_shard(shards_dir, len(shards), rows))
            rows = []
    if rows:
        shards.append(write_shard(shards_dir, len(shards), rows))

    # 4. The report, then the index: the commit marker, written last.
    elapsed_s = time.perf_counter() - start
    report = {
        "source": str(Path(source).resolve()),
        "num_kept": len(kept),
        "num_skipped": len(skipped),
        "bucket_counts": bucket_counts,
        "kept": kept,
        "skipped": [{"path": p, "reason": r} for p, r in skipped],
        "elapsed_s": round(elapsed_s, 3),
    }
    write_report(shards_dir, report)
    write_index(shards_dir, shards, buckets=buckets, fps=fps, bucket_counts=bucket_counts)
    return PrepareSummary(
        num_kept=len(kept), num_skipped=len(skipped), skipped=skipped, shards_dir=shards_dir,
        bucket_counts=bucket_counts, num_shards=len(shards), fps=float(fps), elapsed_s=time.perf_counter() - start,
    )


def prepare_data(data: "DataConfig", *, progress: Callable[[str], Any] | None = print) -> PrepareSummary:
    """`prepare` driven by a job's `data` section (source, shards_dir, buckets, fps, samples_per_shard)."""
    return prepare(
        data.source,
        data.shards_dir,
        buckets=data.buckets,
        fps=data.fps,
        samples_per_shard=data.samples_per_shard,
        progress=progress,
    )
