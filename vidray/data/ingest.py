"""`vidray prepare`: a source list (EasyAnimate metadata JSON or Open-Sora CSV) -> Parquet shards + index.

```python
summary = prepare("samples/metadata.json", "outputs/shards", buckets=[[9, 64, 64], [1, 64, 64]], fps=8.0,
                  samples_per_shard=64)
print(summary)      # kept/skipped counts, per-bucket counts; reasons in outputs/shards/gen.00001/report.json
```

Every listed file is probed once, given the bucket whose aspect ratio is closest to its display aspect
(`assign_bucket`; rotation, sample aspect ratio and EXIF orientation applied, see `vidray.data.video`), sampled
at `fps`, turned upright, resized + center-cropped to the bucket and stored as an H.264 mp4 (images as 1-frame
mp4s). A video lasting at least two clips of its bucket is scanned for scene cuts (`data.split_scenes`, on by
default): with several scenes it gives one sample per clip planned inside a scene (`vidray.data.scenes`), each
with its own sample id and source time range (`clip_start_s`, `clip_end_s`), so no clip straddles a cut. A file
that is missing, unreadable, undecodable or too short is skipped with its reason; it never stops the run.
"""

from __future__ import annotations

import codecs
import csv
import hashlib
import io
import json
import logging
import os
import re
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any, Callable, Sequence

if TYPE_CHECKING:
    from vidray.config import DataConfig, ModelConfig
    from vidray.models.text_encoder import TruncationStats

from vidray.buckets import Bucket, bucket_rules, validate_bucket
from vidray.data.buckets import assign_bucket, rate_change_factor, rate_change_reason, source_floor_reason
from vidray.data.grouping import SHARDS_PER_GROUPING, CaptionEmbedder, balanced_groups
from vidray.data.shards import INDEX_NAME, ShardWriter
from vidray.storage import is_uri
from vidray.errors import UserError, UserFileNotFound
from vidray.progress import progress_bar
from vidray.data.scenes import SceneSplit, detect_scenes, needs_scene_split, plan_scene_clips
from vidray.data.video import (
    ClipWindow,
    MediaError,
    MediaInfo,
    encode_mp4,
    num_frames_at_fps,
    num_frames_available,
    probe_media,
    read_clip,
    read_clips,
    sampled_fps,
)

FAILED_REPORT_NAME = "last_failed_report.json"
"""Where a prepare that kept no sample writes its report (never committed; the next committing prepare deletes it)."""
IMAGE_EXTENSIONS = (".png", ".jpg", ".jpeg", ".webp", ".bmp")
_JSON_FORMAT = 'a JSON list of {"file_path": ..., "text": ..., "type": "video"|"image"} (EasyAnimate metadata)'
_CSV_FORMAT = "a CSV with a header row path,text[,num_frames,height,width,fps] (Open-Sora)"
_CSV_HINTS = {"num_frames": int, "height": int, "width": int, "fps": float}
_log = logging.getLogger(__name__)


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


_BOMS = (
    (codecs.BOM_UTF8, "utf-8-sig"),
    (codecs.BOM_UTF16_LE, "utf-16"),
    (codecs.BOM_UTF16_BE, "utf-16"),
)
_SAVE_AS_UTF8 = (
    "save it as UTF-8 (Excel: 'CSV UTF-8'; LibreOffice: character set 'Unicode (UTF-8)'; Google Sheets exports "
    "UTF-8) or as UTF-16 with a byte-order mark (Excel's 'Unicode Text')"
)


def _read_text(path: Path) -> str:
    """The text of a source list as spreadsheets and editors save it: UTF-8 with or without a byte-order mark,
    or UTF-16 with one (Excel's "Unicode Text"). Line ends are left as they are (the CSV reader takes CRLF, LF
    and CR). Raises UserError for anything else (e.g. Windows-1252 or Latin-1 from a legacy export), naming the
    first bad byte and its line: no fallback encoding is guessed, because a wrong guess turns accented
    captions into mojibake that trains silently."""
    data = path.read_bytes()
    if data.startswith((codecs.BOM_UTF32_LE, codecs.BOM_UTF32_BE)):
        raise UserError(f"source {path} is UTF-32 text; {_SAVE_AS_UTF8}")
    for bom, encoding in _BOMS:
        if data.startswith(bom):
            try:
                return data.decode(encoding)
            except UnicodeDecodeError as err:
                raise UserError(
                    f"source {path} starts with a {encoding} byte-order mark but is not valid {encoding} "
                    f"({err.reason} at byte {err.start}); {_SAVE_AS_UTF8}"
                ) from None
    if b"\x00" in data:
        raise UserError(
            f"source {path} holds NUL bytes: UTF-16 or UTF-32 text without a byte-order mark, or not text at all; "
            f"{_SAVE_AS_UTF8}"
        )
    try:
        return data.decode("utf-8")
    except UnicodeDecodeError as err:
        before = data[: err.start]
        line = 1 + before.count(b"\n") + before.count(b"\r") - before.count(b"\r\n")  # CRLF, LF or CR ends
        raise UserError(
            f"source {path} is not UTF-8: byte 0x{data[err.start]:02x} on line {line} (a legacy encoding such as "
            f"Windows-1252); {_SAVE_AS_UTF8}"
        ) from None


def _read_json_source(path: Path) -> list[SourceItem]:
    text = _read_text(path)
    try:
        entries = json.loads(text)
    except json.JSONDecodeError as err:
        raise UserError(f"source {path} is not valid JSON ({err}); expected {_JSON_FORMAT}") from None
    if not isinstance(entries, list):
        raise UserError(f"source {path} holds a JSON {type(entries).__name__}; expected {_JSON_FORMAT}")
    items = []
    for i, entry in enumerate(entries):
        if not isinstance(entry, dict) or not isinstance(entry.get("file_path"), str) or not entry["file_path"]:
            raise UserError(f"source {path}, entry {i}: needs a non-empty string 'file_path'; expected {_JSON_FORMAT}")
        if not isinstance(entry.get("text"), str):
            raise UserError(f"source {path}, entry {i} ({entry['file_path']}): needs a string 'text' (the caption)")
        kind = entry.get("type")
        if kind is None:
            is_image = _is_image_path(entry["file_path"])
        elif kind in ("video", "image"):
            is_image = kind == "image"
        else:
            raise UserError(f"source {path}, entry {i}: 'type' must be 'video' or 'image', got {kind!r}")
        hints = {k: v for k, v in entry.items() if k not in ("file_path", "text", "type")}
        items.append(SourceItem(_resolve(path, entry["file_path"]), entry["text"], is_image, hints, entry["file_path"]))
    return items


def _csv_dialect(path: Path, text: str) -> tuple[str, str]:
    """(delimiter, text without a leading `sep=` line): Excel's `sep=;` line if present, else `csv.Sniffer` on
    the header line limited to comma, semicolon (Excel in locales with a decimal comma) and tab; a header it
    cannot split (one column) reads as comma-separated and fails on the missing columns."""
    first_line = re.split(r"\r\n|\r|\n", text, maxsplit=1)[0]
    sep = re.fullmatch(r'"?sep=(.)"?', first_line.strip())
    if sep:
        if sep.group(1) not in ",;\t|":
            raise UserError(f"source {path}: unsupported separator {sep.group(1)!r} on its 'sep=' line; use , ; or tab")
        return sep.group(1), text[len(first_line):].lstrip("\r\n")
    try:
        return csv.Sniffer().sniff(first_line, delimiters=",;\t").delimiter, text
    except csv.Error:
        return ",", text


def _read_csv_source(path: Path) -> list[SourceItem]:
    """Spreadsheet exports as they come: see `read_source`."""
    delimiter, text = _csv_dialect(path, _read_text(path))
    reader = csv.reader(io.StringIO(text, newline=""), delimiter=delimiter)
    try:
        header = next(reader, [])
        rows = [(reader.line_num, row) for row in reader]
    except csv.Error as err:
        raise UserError(f"source {path}, line {reader.line_num}: {err}; expected {_CSV_FORMAT}") from None
    names = [name.strip().lower() for name in header]
    duplicated = sorted({n for n in names if n and names.count(n) > 1})
    if duplicated:
        raise UserError(f"source {path}: column(s) {duplicated} appear more than once in header {header}")
    missing = [c for c in ("path", "text") if c not in names]
    if missing:
        sep = {",": "comma", ";": "semicolon", "\t": "tab"}.get(delimiter, repr(delimiter))
        raise UserError(
            f"source {path}: missing column(s) {missing} in header {header} (read as {sep}-separated); "
            f"expected {_CSV_FORMAT}"
        )
    sep_name = {",": "comma", ";": "semicolon", "\t": "tab"}.get(delimiter, repr(delimiter))
    needed = 1 + max(names.index("path"), names.index("text"))
    items = []
    bad_hints: dict[str, list[tuple[int, str]]] = {}
    for line, cells in rows:
        if not any(cell.strip() for cell in cells):  # blank rows, e.g. trailing ",,," rows of a spreadsheet
            continue
        if len(cells) > len(names) and any(cell.strip() for cell in cells[len(names):]):
            # An unquoted delimiter inside a cell (e.g. the caption) splits it; zip() would drop the rest.
            text_at = names.index("text")
            whole = delimiter.join(cells[text_at:]) if text_at == len(names) - 1 else None
            example = f'"{whole.strip()}"' if whole else '"a horse, galloping"'
            raise UserError(
                f"source {path}, line {line}: {len(cells)} cells but the header has {len(names)} columns "
                f"({sep_name}-separated): an unquoted {sep_name} inside a cell splits it; quote the caption: "
                f"{example}"
            )
        if len(cells) < needed:
            raise UserError(
                f"source {path}, line {line}: {len(cells)} cell(s) but the header has {len(names)} columns and "
                f"'path' and 'text' need the first {needed} ({sep_name}-separated); fill the row or quote the "
                f"caption; expected {_CSV_FORMAT}"
            )
        row = {name: cell for name, cell in zip(names, cells) if name}
        listed = row.get("path", "").strip()
        text = row.get("text")
        if not listed or text is None:
            raise UserError(f"source {path}, line {line}: empty 'path' or missing 'text'; expected {_CSV_FORMAT}")
        text = re.sub(r"\r\n?", "\n", text).strip()  # a cell's line breaks read alike from CRLF and LF files
        hints: dict[str, Any] = {}
        for key, cast in _CSV_HINTS.items():
            value = (row.get(key) or "").strip()
            if value:
                try:  # a decimal comma (semicolon CSVs of comma locales: "29,97") reads as a point
                    number = float(value.replace(",", ".")) if value.count(",") == 1 else float(value)
                    hints[key] = cast(number) if cast is int else number
                except (ValueError, OverflowError):
                    bad_hints.setdefault(key, []).append((line, value))
        items.append(SourceItem(_resolve(path, listed), text, _is_image_path(listed), hints, listed))
    for key, bad in bad_hints.items():  # hints are informational (files are probed): ignore, say so once
        lines = ", ".join(str(n) for n, _ in bad[:5]) + (" ..." if len(bad) > 5 else "")
        _log.warning(
            "source %s: column %s is not a number on %d row(s) (line %s, e.g. %r); ignored: hints are "
            "informational, every file is probed", path, key, len(bad), lines, bad[0][1],
        )
    return items


def read_source(path: str | Path) -> list[SourceItem]:
    """Read a source list: EasyAnimate metadata `.json` (a list of {file_path, text, type: video|image}) or an
    Open-Sora `.csv`/`.tsv` (header path,text[,num_frames,height,width,fps]). Paths may be absolute or relative
    to the source file's folder; listed files are not opened here.

    Files read as spreadsheets and editors save them: UTF-8 with or without a byte-order mark, or UTF-16 with
    one (a JSON source too); CSV line ends CRLF, LF or CR; quoted cells holding commas or line breaks (a cell's
    CRLF reads as LF); header names in any case and with stray spaces (` Path `); comma-, semicolon- or
    tab-separated (sniffed from the header line, or Excel's `sep=;` first line); blank rows skipped; path and
    caption cells stripped of surrounding whitespace.

    A data row with more non-empty cells than the header (an unquoted delimiter in a caption) or too few
    cells to reach 'path' and 'text' is an error naming the line and both counts. Hint columns (num_frames,
    height, width, fps) accept a decimal comma ("29,97"); an unparseable hint is dropped with one logged
    warning per column (hints are informational, never used for decoding).

    Raises UserFileNotFound for a missing source, UserError (a ValueError) naming the problem and the expected
    format for anything else (a folder, another extension, not UTF-8/UTF-16, not a JSON list, missing columns/keys, an
    empty list).
    """
    path = Path(path)
    if path.is_dir():
        lists = sorted(p.name for p in path.iterdir() if p.suffix.lower() in (".json", ".csv", ".tsv"))[:5]
        inside = f" ({', '.join(lists)})" if lists else ""
        raise UserError(f"source {path} is a folder: give the .json or .csv list inside it{inside}")
    if not path.is_file():
        hint = "" if path.is_absolute() else f" (relative paths resolve against the current directory, {Path.cwd()})"
        raise UserFileNotFound(f"source {path} does not exist{hint}; give an EasyAnimate .json or Open-Sora .csv")
    suffix = path.suffix.lower()
    if suffix == ".json":
        items = _read_json_source(path)
    elif suffix in (".csv", ".tsv"):
        items = _read_csv_source(path)
    else:
        raise UserError(
            f"source {path}: unknown extension {suffix!r}; expected .json ({_JSON_FORMAT}) or .csv/.tsv "
            f"({_CSV_FORMAT}; a spreadsheet's tab-separated 'Text' export can be renamed to .tsv)"
        )
    if not items:
        raise UserError(f"source {path} lists no files")
    return items


@dataclass
class PrepareSummary:
    """What `prepare` did."""

    num_kept: int
    """Source files kept (a video split at scene cuts counts once; see `num_samples`)."""
    num_samples: int
    """Training clips written (more than `num_kept` when videos were split at scene cuts)."""
    num_skipped: int
    skipped: list[tuple[str, str]]
    """(source path, reason) for every skipped file."""
    shards_dir: Path | str
    """The local folder, or the URI as given (`vidray.storage`)."""
    report_path: Path | str
    """The committed report, `<shards_dir>/gen.NNNNN/report.json`: every kept and skipped file, with reasons."""
    bucket_counts: dict[str, int]
    """`str(bucket)` ("9x64x64") -> samples kept in it, every configured bucket listed."""
    num_shards: int
    fps: float
    elapsed_s: float
    captions_truncated: "TruncationStats | None" = None
    """Captions of kept files longer than `model.max_sequence_length` tokens (None: no model section given)."""
    committed: bool = True
    """False when no sample was kept: nothing was committed (`index.json` and any previous dataset untouched),
    `report_path` is then `<shards_dir>/last_failed_report.json`."""
    had_previous: bool = False
    """Whether `shards_dir` held a committed dataset when this prepare started."""
    empty_captions: list[str] = field(default_factory=list)
    """Kept source files whose caption is empty or whitespace only (they are kept; reported only)."""
    duplicate_listings: list[str] = field(default_factory=list)
    """Source paths listed more than once: one entry per listing after the first (reported only)."""
    off_rate: list[tuple[str, float]] = field(default_factory=list)
    """(source path, sampled fps) of each kept clip sampled at another rate than `fps` to fill its bucket (its
    motion plays sampled_fps / fps times slower than its bucket-mates'; at most `data.max_rate_change` times)."""
    grouped_by_caption: bool = False
    """Whether each shard holds similar captions of its bucket (`prepare(group_by_caption=True)`); every shard
    holds one bucket either way."""

    def __str__(self) -> str:
        total = self.num_kept + self.num_skipped
        buckets = ", ".join(f"{b}: {n}" for b, n in self.bucket_counts.items())
        if not self.num_kept:  # "into 0 shard(s) of one bucket ... samples per bucket: ." said nothing true
            text = f"Kept none of {total} files for {self.shards_dir} at {self.fps:g} fps ({self.elapsed_s:.1f} s)."
        else:
            text = (
                f"Prepared {self.num_kept} of {total} files"
                + (f" as {self.num_samples} clips" if self.num_samples != self.num_kept else "")
                + f" into {self.num_shards} shard(s)"
                + (" of one bucket and similar captions each" if self.grouped_by_caption else " of one bucket each")
                + f" in {self.shards_dir} "
                f"at {self.fps:g} fps in {self.elapsed_s:.1f} s; samples per bucket: {buckets}."
            )
        if self.skipped:
            reasons = "; ".join(f"{Path(p).name}: {r}" for p, r in self.skipped[:5])
            more = f" (and {len(self.skipped) - 5} more)" if len(self.skipped) > 5 else ""
            text += f" Skipped {self.num_skipped}: {reasons}{more}; all reasons in {self.report_path}."
        if self.captions_truncated is not None and self.captions_truncated.num_truncated:
            text += f" Captions: {self.captions_truncated}."
        if self.empty_captions:
            names = ", ".join(Path(p).name for p in self.empty_captions[:5])
            more = " ..." if len(self.empty_captions) > 5 else ""
            text += f" Empty captions (kept): {len(self.empty_captions)} ({names}{more})."
        if self.duplicate_listings:
            names = ", ".join(Path(p).name for p in self.duplicate_listings[:5])
            more = " ..." if len(self.duplicate_listings) > 5 else ""
            text += f" Listed more than once: {len(self.duplicate_listings)} extra listing(s) ({names}{more})."
        if self.off_rate:
            names = ", ".join(
                f"{Path(p).name} at {r:.4g} fps ({rate_change_factor(r, self.fps):.1f}x "
                f"{'slower' if r > self.fps else 'faster'})" for p, r in self.off_rate[:5])
            more = " ..." if len(self.off_rate) > 5 else ""
            text += (f" Sampled at another rate than {self.fps:g} fps to fill their bucket (motion slower or faster "
                     f"than their bucket-mates'): {len(self.off_rate)} clip(s) ({names}{more}).")
        if not self.committed:
            text += " No sample was kept: nothing committed"
            if self.had_previous:
                text += f"; the previous dataset in {self.shards_dir} is unchanged"
            text += "; check the source paths and buckets."
        return text


def _file_sha256(path: Path) -> str:
    """Hex sha256 of a source file's bytes (read in 1 MiB chunks)."""
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            digest.update(chunk)
    return digest.hexdigest()


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


@dataclass(frozen=True)
class _Clip:
    """One training clip read from a source: its bucket, rate (frames/s), window in the source (s after its
    first frame), encoded mp4, and whether it was planned inside a scene (`from_scene`)."""

    bucket: Bucket
    fps: float
    start_s: float
    end_s: float
    video_mp4: bytes
    from_scene: bool


def _read_clips(
    path: Path,
    info: MediaInfo,
    bucket: Bucket,
    buckets: Sequence[Bucket],
    fps: float,
    is_image: bool,
    scene_split: SceneSplit | None,
) -> tuple[list[_Clip], str]:
    """The clips of one source and a note for the progress line.

    A video lasting at least two clips of `bucket` (`needs_scene_split`), with `scene_split` given, is scanned
    for cuts; when it has several scenes (or `max_clips_per_scene` > 1), the clips are those
    `plan_scene_clips` lays inside the scenes with the buckets of `bucket`'s aspect ratio, each read from its
    window. Otherwise one clip from the start, as
    `read_clip` samples it (images: their one frame). Raises MediaError when the source cannot fill a clip, or
    when it has several scenes and none is long enough for a multi-frame bucket (every clip would straddle a cut).
    """
    note = ""
    if scene_split is not None and not is_image and needs_scene_split(info, bucket, fps):
        try:
            scenes = detect_scenes(
                path, info, threshold=scene_split.threshold, min_scene_s=scene_split.min_scene_s,
                analysis_width_px=scene_split.analysis_width_px,
            )
        except MediaError as err:
            scenes, note = [], f"scene detection failed ({_short_reason(err, path)}), one clip from the start"
        if len(scenes) > 1 or (scenes and scene_split.max_clips_per_scene > 1):
            # Every clip of the source keeps the aspect ratio of the bucket the whole file got: a short scene
            # takes a shorter bucket of that aspect ratio, never another one's crop.
            same_aspect = [b for b in buckets if b.height * bucket.width == b.width * bucket.height]
            planned = plan_scene_clips(
                scenes, info, same_aspect, fps, max_clips_per_scene=scene_split.max_clips_per_scene,
                max_clips_per_source=scene_split.max_clips_per_source,
            )
            if not planned:
                longest_s = max(scene.duration_s for scene in scenes)
                raise MediaError(
                    f"{len(scenes)} scenes, the longest {longest_s:.2f} s: none holds the smallest multi-frame "
                    f"bucket of its aspect ratio ({bucket.height}x{bucket.width}) at {fps:g} fps, so every clip would "
                    "straddle a scene cut (set data.split_scenes: false to keep such files, or raise "
                    "data.min_scene_s)"
                )
            windows = [ClipWindow(c.bucket, c.start_s, c.end_s) for c in planned]
            videos = read_clips(path, info, windows, fps)  # one decode pass; each (F, H, W, 3) uint8
            clips = [
                _Clip(c.bucket, float(fps), c.start_s, c.start_s + c.bucket.num_frames / fps, encode_mp4(v, fps), True)
                for c, v in zip(planned, videos, strict=True)
            ]
            return clips, f"{len(scenes)} scene(s)"
    video = read_clip(path, info, bucket, fps)  # (F, H, W, 3) uint8
    clip_fps = sampled_fps(info, bucket, fps)
    end_s = 0.0 if is_image else min(info.duration_s, bucket.num_frames / clip_fps)
    return [_Clip(bucket, clip_fps, 0.0, end_s, encode_mp4(video, clip_fps), False)], note


def prepare(
    source: str | Path,
    shards_dir: str | Path,
    buckets: Sequence[Bucket | Sequence[int]],
    fps: float,
    samples_per_shard: int,
    *,
    progress: Callable[[str], Any] | None = print,
    caption_check: "Callable[[list[str]], TruncationStats] | None" = None,
    scene_split: SceneSplit | None = SceneSplit(),
    group_by_caption: bool = True,
    family: str = "easyanimate",
    min_source_side_px: int = 16,
    max_upscale: float = 8.0,
    max_rate_change: float = 1.5,
) -> PrepareSummary:
    """Turn the files listed in `source` into Parquet shards in `shards_dir` (see `vidray.data.shards`).

    `buckets`: [num_frames, height, width] triples, each within the bucket rules of the model `family`
    (`vidray.buckets`: EasyAnimate H, W multiples of 16 and num_frames 1 or 4k+1); `fps`: sampling rate in frames/s; `samples_per_shard`: rows
    per shard. Every shard holds samples of one bucket: rows are buffered per bucket. `group_by_caption`: each
    bucket buffers up to `samples_per_shard * SHARDS_PER_GROUPING` (8) rows, then writes them as 8 shards of
    similar captions (`vidray.data.grouping`: MiniLM caption embeddings, balanced principal-direction bisection);
    False: a bucket's shard is written every `samples_per_shard` rows, in source order. At the end each bucket's
    remaining rows make smaller shards (full shards first, then one holding the remainder). Memory: at most
    `len(buckets) * samples_per_shard * 8` encoded clips are held (`* 1` without grouping). Shards are numbered
    in the order they are written; the sample table lists rows in shard order, sample ids are unchanged.
    Writes a new generation `gen.NNNNN/shard.00000.parquet`..., its sample table
    `gen.NNNNN/samples.parquet` (`vidray.data.index`: bucket, shard, row, stored bytes and the sha256 of each source
    file, hashed once per file), then `gen.NNNNN/report.json`, then
    replaces `index.json` (the commit marker) and only then deletes the previous generation: a prepare that is
    interrupted or raises leaves the previous dataset in `shards_dir` readable as it was (`ShardWriter`).
    `scene_split`: how videos lasting at least two clips of their bucket are split at scene cuts into several
    samples (`vidray.data.scenes`; None: one clip per source, from its start).
    A source too small for content is skipped with its reason (`source_floor_reason`): its shorter displayed side
    under `min_source_side_px` pixels, or its bucket enlarging it more than `max_upscale` times. A source too
    short for every bucket of its aspect ratio at `fps` goes to the bucket that changes its rate least
    (`assign_bucket` with `rate_change_factor`: max(clip_fps / fps, fps / clip_fps) >= 1, clip_fps the rate of the
    stride fallback of `vidray.data.video`), and is sampled at that other rate: its motion plays `clip_fps / fps`
    times slower than its bucket-mates'. Such a clip is kept when the change is at most `max_rate_change`, and
    listed in the report (`num_off_rate`, `off_rate`: path, sampled fps, slowdown = clip_fps / fps) and counted in
    the summary; beyond it, skipped with its reason (`rate_change_reason`).
    A prepare that keeps no sample commits nothing: the new generation is deleted, `index.json` and the previous
    dataset (if any) stay exactly as they were, and the report (every skip reason, `committed: false`) goes to
    `<shards_dir>/last_failed_report.json`, outside any generation; the summary says "nothing committed".
    The report also counts kept files with empty captions (`num_empty_captions`, `empty_captions`) and extra
    listings of a file listed several times (`num_duplicate_listings`, `duplicate_listings`); both are kept.
    `progress` gets one line per file (None: silent). Files that cannot be used are skipped and reported, never
    raised. Raises ValueError for bad buckets/fps/samples_per_shard or a bad source list, FileNotFoundError for a
    missing source, before touching `shards_dir`; UserError while another prepare writes `shards_dir`.
    """
    start = time.perf_counter()
    say = progress or (lambda _line: None)
    # 1. Check arguments and read the source list (nothing on disk changes if this fails).
    rules = bucket_rules(family)
    buckets = [Bucket(*b) for b in buckets]
    if not buckets:
        raise ValueError("at least one bucket is needed, e.g. [[9, 64, 64], [1, 64, 64]]")
    for bucket in buckets:
        validate_bucket(bucket, spatial_multiple=rules.spatial_multiple, temporal_compression=rules.num_frames_step)
    if fps <= 0:
        raise ValueError(f"fps must be > 0 frames/s, got {fps}")
    if samples_per_shard < 1:
        raise ValueError(f"samples_per_shard must be >= 1, got {samples_per_shard}")
    if min_source_side_px < 0 or not max_upscale >= 1:
        raise ValueError(f"min_source_side_px must be >= 0 px and max_upscale >= 1.0, got {min_source_side_px} "
                         f"and {max_upscale}")
    if not max_rate_change >= 1:
        raise ValueError(f"max_rate_change must be >= 1.0 (a factor; 1.0 keeps only clips sampled at fps), got "
                         f"{max_rate_change}")
    items = read_source(source)

    # 2. Start a new generation beside the committed one (which stays readable until step 4 switches the index).
    shards_dir = shards_dir if is_uri(shards_dir) else Path(shards_dir)  # a URI: vidray.storage
    writer = ShardWriter(shards_dir)
    had_previous = writer.storage.is_file(INDEX_NAME)

    # 3. Probe, bucket, sample, encode; buffer rows per bucket and flush them as shards of one bucket each.
    shards: list[dict[str, Any]] = []
    kept: list[dict[str, Any]] = []
    skipped: list[tuple[str, str]] = []
    off_rate: list[dict[str, Any]] = []  # clips sampled at another rate than `fps` to fill their bucket
    bucket_counts = {str(b): 0 for b in buckets}
    seen_ids: dict[str, int] = {}
    num_files_kept = 0
    # The sample table (vidray.data.index): one entry per row, in shard order; source hashes once per file.
    table: dict[str, list[Any]] = {name: [] for name in (
        "sample_id", "num_frames", "height", "width", "shard", "row", "stored_bytes", "source_sha256",
        "clip_start_s", "clip_end_s")}
    source_hashes: dict[Path, str] = {}
    # Rows not yet written, per bucket, each with its source's sha256 (for the sample table).
    pending: dict[Bucket, list[tuple[dict[str, Any], str]]] = {}
    buffer_rows = samples_per_shard * (SHARDS_PER_GROUPING if group_by_caption else 1)
    embed = CaptionEmbedder() if group_by_caption else None  # loads MiniLM only when a buffer needs grouping

    def flush(bucket: Bucket) -> None:
        """Write `bucket`'s buffered rows as shards (groups of similar captions, or in source order) and list
        their rows in the sample table, in shard order."""
        buffered = pending.pop(bucket, [])
        if embed is not None and len(buffered) > samples_per_shard:
            groups = balanced_groups(embed([r["caption"] for r, _ in buffered]), samples_per_shard)
        else:
            groups = [range(s, min(s + samples_per_shard, len(buffered)))
                      for s in range(0, len(buffered), samples_per_shard)]
        for group in groups:
            shard_rows = [buffered[i][0] for i in group]
            for row_no, (r, sha256) in enumerate(buffered[i] for i in group):
                for name, value in (
                    ("sample_id", r["sample_id"]), ("num_frames", r["num_frames"]), ("height", r["height"]),
                    ("width", r["width"]), ("shard", len(shards)), ("row", row_no),
                    ("stored_bytes", len(r["video_mp4"])), ("source_sha256", sha256),
                    ("clip_start_s", r["clip_start_s"]), ("clip_end_s", r["clip_end_s"]),
                ):
                    table[name].append(value)
            shards.append(writer.write_shard(shard_rows))

    bar = progress_bar(len(items), "prepare", "file") if progress else None
    if bar is not None and not bar.disable and progress is print:
        say = lambda line: bar.write(line, file=sys.stdout)  # noqa: E731 - the lines stay above the bar

    def counted(rows):  # advances the bar once a file is done (kept, skipped or failed)
        for row in rows:
            yield row
            if bar is not None:
                bar.set_postfix(kept=num_files_kept, skipped=len(skipped), clips=len(kept), refresh=False)
                bar.update(1)

    for i, item in enumerate(counted(items), start=1):
        tag = f"[{i}/{len(items)}]"
        try:
            info = probe_media(item.file_path)
            is_image = item.is_image or info.is_image
            bucket = assign_bucket(
                num_frames=num_frames_available(info, fps), height=info.height, width=info.width,
                buckets=buckets, is_image=is_image, num_frames_at_fps=num_frames_at_fps(info, fps),
                rate_change=lambda b: rate_change_factor(sampled_fps(info, b, fps), fps),
            )
            if bucket is None:
                raise MediaError(_no_bucket_reason(info, is_image, buckets, fps))
            too_small = source_floor_reason(bucket, height=info.height, width=info.width,
                                            min_side_px=min_source_side_px, max_upscale=max_upscale)
            if too_small:  # checked first: a 1x1 px test pattern is no content at any rate
                raise MediaError(too_small)
            too_slow = rate_change_reason(bucket, duration_s=info.duration_s, clip_fps=sampled_fps(info, bucket, fps),
                                          fps=fps, max_rate_change=max_rate_change)
            if too_slow:
                raise MediaError(too_slow)
            clips, note = _read_clips(item.file_path, info, bucket, buckets, fps, is_image, scene_split)
        except MediaError as err:
            skipped.append((str(item.file_path), _short_reason(err, item.file_path)))
            say(f"{tag} skipped {item.file_path.name}: {skipped[-1][1]}")
            continue
        except Exception as err:  # noqa: BLE001 - one bad file must not stop the run; it is reported
            skipped.append((str(item.file_path), f"unexpected error: {type(err).__name__}: {err}"))
            say(f"{tag} skipped {item.file_path.name}: {skipped[-1][1]}")
            continue
        num_files_kept += 1
        if item.file_path not in source_hashes:
            source_hashes[item.file_path] = _file_sha256(item.file_path)
        for clip in clips:
            listed = item.listed_path or str(item.file_path)
            # One clip of a source keeps the id of the whole file; scene clips add their start time.
            sample_id = _sample_id(f"{listed}@{clip.start_s:.3f}" if clip.from_scene else listed, clip.bucket)
            seen_ids[sample_id] = seen_ids.get(sample_id, 0) + 1
            if seen_ids[sample_id] > 1:  # the same file listed again (e.g. another caption)
                sample_id = f"{sample_id}-{seen_ids[sample_id] - 1}"
            bucket_rows = pending.setdefault(clip.bucket, [])
            bucket_rows.append((
                {
                    "sample_id": sample_id,
                    "video_mp4": clip.video_mp4,
                    "caption": item.text,
                    "num_frames": clip.bucket.num_frames,
                    "height": clip.bucket.height,
                    "width": clip.bucket.width,
                    "fps": clip.fps,
                    "source_path": str(item.file_path),
                    "source_width": info.width,
                    "source_height": info.height,
                    "source_fps": info.fps,
                    "source_num_frames": info.num_frames,
                    "source_duration_s": info.duration_s,
                    "clip_start_s": clip.start_s,
                    "clip_end_s": clip.end_s,
                },
                source_hashes[item.file_path],
            ))
            bucket_counts[str(clip.bucket)] += 1
            kept.append(
                {
                    "path": str(item.file_path), "sample_id": sample_id, "bucket": list(clip.bucket), "fps": clip.fps,
                    "clip_start_s": round(clip.start_s, 4), "clip_end_s": round(clip.end_s, 4),
                }
            )
            if len(bucket_rows) >= buffer_rows:
                flush(clip.bucket)
            if abs(clip.fps - fps) > 1e-6 * fps:
                off_rate.append({"path": str(item.file_path), "sample_id": sample_id, "fps": round(clip.fps, 4),
                                 "slowdown": round(clip.fps / fps, 3)})
        source_desc = "image" if is_image else f"{info.num_frames} frames @ {info.fps:.2f} fps"
        size_kib = sum(len(c.video_mp4) for c in clips) / 1024
        if len(clips) == 1 and not clips[0].from_scene:
            what = f"bucket {clips[0].bucket} at {clips[0].fps:.2f} fps"
        else:
            clip_buckets = ", ".join(sorted({str(c.bucket) for c in clips}))
            what = f"{len(clips)} clips ({note}), bucket {clip_buckets} at {fps:g} fps"
        extra = f"; {note}" if note and len(clips) == 1 else ""
        say(
            f"{tag} kept    {item.file_path.name} -> {what} "
            f"({info.width}x{info.height}, {source_desc}, {size_kib:.1f} KiB{extra})"
        )
    if bar is not None:
        bar.close()
    for bucket in list(pending):  # what each bucket still buffers: smaller groups, full shards first
        flush(bucket)
    if kept:
        writer.write_sample_table(table)

    # 4. The report, then the index (the commit marker, replaced atomically), then delete the old generation.
    elapsed_s = time.perf_counter() - start
    kept_paths = {k["path"] for k in kept}
    empty_captions = sorted(
        {str(it.file_path) for it in items if str(it.file_path) in kept_paths and not it.text.strip()}
    )
    listings: dict[str, int] = {}
    duplicate_listings = []
    for it in items:
        listings[str(it.file_path)] = listings.get(str(it.file_path), 0) + 1
        if listings[str(it.file_path)] > 1:
            duplicate_listings.append(str(it.file_path))
    captions = caption_check([it.text for it in items if str(it.file_path) in kept_paths]) if caption_check else None
    report = {
        "source": os.path.abspath(source),  # as the kept paths: absolute, symlinks kept
        "source_list_sha256": _file_sha256(Path(source)),  # the list's bytes: the same list at another path
        "num_kept": num_files_kept,
        "num_samples": len(kept),
        "num_skipped": len(skipped),
        "bucket_counts": bucket_counts,
        "kept": kept,
        "skipped": [{"path": p, "reason": r} for p, r in skipped],
        "num_empty_captions": len(empty_captions),
        "empty_captions": empty_captions,
        "num_off_rate": len(off_rate),
        "off_rate": off_rate,
        "num_duplicate_listings": len(duplicate_listings),
        "duplicate_listings": duplicate_listings,
        "num_shards": len(shards),
        "shards_grouped_by": "bucket and caption" if group_by_caption else "bucket",
        "elapsed_s": round(elapsed_s, 3),
        **({"captions_truncated": captions.to_dict()} if captions is not None else {}),
    }
    if not kept:  # commit nothing: the previous index and its files stay as they were
        report["committed"] = False
        writer.abort()
        writer.storage.write_bytes(FAILED_REPORT_NAME, json.dumps(report, indent=2).encode())
        report_rel = FAILED_REPORT_NAME
    else:
        index = writer.commit(report, buckets=buckets, fps=fps, bucket_counts=bucket_counts)
        if writer.storage.is_file(FAILED_REPORT_NAME):  # stale: this prepare committed
            writer.storage.delete_file(FAILED_REPORT_NAME)
        report_rel = index["report"]["file"]
    report_file = writer.storage.display(report_rel)
    report_file = report_file if is_uri(shards_dir) else Path(report_file)
    return PrepareSummary(
        num_kept=num_files_kept, num_samples=len(kept), num_skipped=len(skipped), skipped=skipped,
        shards_dir=shards_dir, report_path=report_file, bucket_counts=bucket_counts,
        num_shards=len(shards), fps=float(fps), elapsed_s=time.perf_counter() - start,
        captions_truncated=captions, committed=bool(kept), had_previous=had_previous,
        empty_captions=empty_captions, duplicate_listings=duplicate_listings, grouped_by_caption=group_by_caption,
        off_rate=[(k["path"], k["fps"]) for k in off_rate],
    )


def prepare_data(
    data: "DataConfig", model: "ModelConfig | None" = None, *, progress: Callable[[str], Any] | None = print
) -> PrepareSummary:
    """`prepare` driven by a job's `data` section (source, shards_dir, buckets, fps, samples_per_shard,
    group_by_caption, and the scene split: split_scenes, scene_threshold, min_scene_s, max_clips_per_scene,
    max_clips_per_source).

    With the job's `model` section, also counts the kept captions longer than `model.max_sequence_length` tokens
    (tokenized as training encodes them; `vidray.models.text_encoder.caption_truncation`): in the summary and in
    report.json as `captions_truncated: {num, num_captions, max_tokens_over, mean_tokens_over, total_tokens_over,
    max_sequence_length}`. Only the model's tokenizer loads (no weights).
    """
    caption_check = None
    if model is not None:
        if model.init == "pretrained" and not (Path(str(model.pretrained_path)) / "tokenizer").is_dir():
            raise UserFileNotFound(  # before any clip is processed
                f"model.pretrained_path {model.pretrained_path!r} has no tokenizer/ folder; give a diffusers folder"
            )
        from vidray.models.text_encoder import check_max_sequence_length  # heavy: torch, transformers, accelerate

        check_max_sequence_length(model)  # config files only, before any clip is processed

        def check_captions(captions: list[str]) -> "TruncationStats":
            from vidray.models.text_encoder import build_tokenizer, caption_truncation  # heavy: torch, transformers

            return caption_truncation(build_tokenizer(model), captions, model.max_sequence_length,
                                      counted="kept files' captions")

        caption_check = check_captions

    return prepare(
        data.source,
        data.shards_dir,
        buckets=data.buckets,
        fps=data.fps,
        samples_per_shard=data.samples_per_shard,
        progress=progress,
        caption_check=caption_check,
        scene_split=SceneSplit(
            threshold=data.scene_threshold, min_scene_s=data.min_scene_s,
            max_clips_per_scene=data.max_clips_per_scene, max_clips_per_source=data.max_clips_per_source,
        ) if data.split_scenes else None,
        group_by_caption=data.group_by_caption,
        min_source_side_px=data.min_source_side_px,
        max_upscale=data.max_upscale,
        max_rate_change=data.max_rate_change,
        **({"family": model.family} if model is not None else {}),
    )
