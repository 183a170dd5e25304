"""The shard format: Parquet files of bucket-shaped H.264 clips, and the index that commits them.

A prepared folder holds `shard.00000.parquet`, `shard.00001.parquet`, ... (one row per sample, columns in
`SHARD_SCHEMA`), `report.json` (what was kept and skipped, and why) and, written last, `index.json`: the commit
marker. A folder without `index.json` is an unfinished `vidray prepare`; readers refuse it.

```python
index = read_index("outputs/shards")              # format, shards, num_samples, bucket_counts, buckets, fps
samples = load_samples("outputs/shards")          # [Sample(sample_id, caption, bucket, video uint8 (F, H, W, 3))]
```
"""

from __future__ import annotations

import hashlib
import json
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Iterator, Sequence

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq

from vidray.data.buckets import Bucket
from vidray.data.video import decode_mp4

FORMAT = "vidray-shards"
FORMAT_VERSION = 1
INDEX_NAME = "index.json"
REPORT_NAME = "report.json"
SHARD_GLOB = "shard.*.parquet"

SHARD_SCHEMA = pa.schema(
    [
        ("sample_id", pa.string()),  # stable: hash of the source path (as the source lists it) + bucket
        ("video_mp4", pa.binary()),  # H.264 yuv420p mp4 of (num_frames, height, width) frames
        ("caption", pa.string()),
        ("num_frames", pa.int32()),  # the bucket
        ("height", pa.int32()),
        ("width", pa.int32()),
        ("fps", pa.float32()),  # frames/s the clip was sampled at
        ("source_path", pa.string()),
        ("source_width", pa.int32()),
        ("source_height", pa.int32()),
        ("source_fps", pa.float32()),  # 0.0 for images
        ("source_num_frames", pa.int32()),
        ("source_duration_s", pa.float32()),
    ]
)
COLUMNS = tuple(SHARD_SCHEMA.names)


def shard_file_name(shard_index: int) -> str:
    """`shard.00042.parquet` for shard 42."""
    return f"shard.{shard_index:05d}.parquet"


def _sha256_file(path: Path) -> str:
    digest = hashlib.sha256()
    with path.open("rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            digest.update(chunk)
    return digest.hexdigest()


def _write_atomic(path: Path, data: bytes) -> None:
    tmp = path.with_name(f".{path.name}.tmp")
    tmp.write_bytes(data)
    os.replace(tmp, path)


def clear_shards_dir(shards_dir: str | Path) -> None:
    """Remove a previous prepare's outputs from `shards_dir` (index first, so a crash never leaves an index
    that points at deleted shards): index.json, report.json, shard.*.parquet and leftover temp files.
    Other files are left alone."""
    shards_dir = Path(shards_dir)
    if not shards_dir.is_dir():
        return
    (shards_dir / INDEX_NAME).unlink(missing_ok=True)
    (shards_dir / REPORT_NAME).unlink(missing_ok=True)
    for path in [*shards_dir.glob(SHARD_GLOB), *shards_dir.glob(".shard.*.tmp"), *shards_dir.glob(".*.json.tmp")]:
        path.unlink(missing_ok=True)


def write_shard(shards_dir: str | Path, shard_index: int, rows: Sequence[dict[str, Any]]) -> dict[str, Any]:
    """Write `rows` (dicts with exactly the `SHARD_SCHEMA` columns) as one Parquet shard, via a temp file and a
    rename. Returns the index entry: {"file", "num_samples", "bytes", "sha256"}. Raises ValueError for rows
    whose keys differ from the schema."""
    for row in rows:
        if set(row) != set(COLUMNS):
            raise ValueError(f"shard row columns {sorted(row)} differ from the shard schema {list(COLUMNS)}")
    path = Path(shards_dir) / shard_file_name(shard_index)
    tmp = path.with_name(f".{path.name}.tmp")
    table = pa.Table.from_pylist(list(rows), schema=SHARD_SCHEMA)
    pq.write_table(table, tmp, row_group_size=max(1, len(rows)))
    os.replace(tmp, path)
    return {"file": path.name, "num_samples": len(rows), "bytes": path.stat().st_size, "sha256": _sha256_file(path)}


def write_report(shards_dir: str | Path, report: dict[str, Any]) -> None:
    """Write `report.json` (kept and skipped files with reasons) via a temp file; before the index."""
    _write_atomic(Path(shards_dir) / REPORT_NAME, json.dumps(report, indent=2).encode())


def _content_hash(index: dict[str, Any]) -> str:
    body = {k: v for k, v in index.items() if k != "content_hash"}
    return "sha256:" + hashlib.sha256(json.dumps(body, sort_keys=True).encode()).hexdigest()


def write_index(
    shards_dir: str | Path,
    shards: Sequence[dict[str, Any]],
    *,
    buckets: Sequence[Bucket],
    fps: float,
    bucket_counts: dict[str, int],
) -> dict[str, Any]:
    """Write `index.json` (the commit marker; call it last, after every shard and the report) and return it.

    `shards` are `write_shard` entries; `bucket_counts` maps `str(bucket)` ("9x64x64") to its sample count.
    """
    index: dict[str, Any] = {
        "format": FORMAT,
        "version": FORMAT_VERSION,
        "fps": float(fps),
        "buckets": [list(b) for b in buckets],
        "columns": list(COLUMNS),
        "num_samples": sum(s["num_samples"] for s in shards),
        "bucket_counts": dict(bucket_counts),
        "shards": list(shards),
    }
    index["content_hash"] = _content_hash(index)
    _write_atomic(Path(shards_dir) / INDEX_NAME, json.dumps(index, indent=2).encode())
    return index


def read_index(shards_dir: str | Path) -> dict[str, Any]:
    """Read and check `<shards_dir>/index.json`; returns it as a dict (keys: format, version, fps, buckets,
    columns, num_samples, bucket_counts, shards [{file, num_samples, bytes, sha256}], content_hash).

    Raises FileNotFoundError when the index (or a shard it lists) is missing: run `vidray prepare` first; shards
    without an index are an unfinished prepare. Raises ValueError for another format version or an index whose
    content hash does not match (edited or corrupt).
    """
    shards_dir = Path(shards_dir)
    path = shards_dir / INDEX_NAME
    if not path.is_file():
        unfinished = shards_dir.is_dir() and any(shards_dir.glob(SHARD_GLOB))
        hint = " (shard files without an index are an unfinished prepare)" if unfinished else ""
        raise FileNotFoundError(f"{path} not found{hint}: run `vidray prepare` first")
    try:
        index = json.loads(path.read_text())
    except json.JSONDecodeError as err:
        raise ValueError(f"{path} is not valid JSON ({err}): re-run `vidray prepare`") from None
    if not isinstance(index, dict) or index.get("format") != FORMAT or index.get("version") != FORMAT_VERSION:
        found = (index.get("format"), index.get("version")) if isinstance(index, dict) else type(index).__name__
        raise ValueError(
            f"{path}: expected format {FORMAT!r} version {FORMAT_VERSION}, got {found}; re-run `vidray prepare`"
        )
    if index.get("content_hash") != _content_hash(index):
        raise ValueError(f"{path}: content hash mismatch (edited or corrupt index); re-run `vidray prepare`")
    missing = [s["file"] for s in index["shards"] if not (shards_dir / s["file"]).is_file()]
    if missing:
        raise FileNotFoundError(
            f"{shards_dir}: shards listed in {INDEX_NAME} are missing: {missing}; re-run `vidray prepare`"
        )
    return index


def iter_samples(shards_dir: str | Path, columns: Sequence[str] | None = None) -> Iterator[dict[str, Any]]:
    """Yield one dict per sample (all `SHARD_SCHEMA` columns, or only `columns`), shard by shard in index
    order. `video_mp4` comes as mp4 bytes. Raises like `read_index`, and ValueError for an unknown column."""
    index = read_index(shards_dir)
    if columns is not None:
        unknown = [c for c in columns if c not in COLUMNS]
        if unknown:
            raise ValueError(f"unknown shard column(s) {unknown}; valid: {', '.join(COLUMNS)}")
        columns = list(columns)
    for shard in index["shards"]:
        parquet = pq.ParquetFile(Path(shards_dir) / shard["file"])
        for batch in parquet.iter_batches(batch_size=64, columns=columns):
            yield from batch.to_pylist()


@dataclass(frozen=True, eq=False)
class Sample:
    """One training clip, decoded."""

    sample_id: str
    caption: str
    bucket: Bucket
    video: np.ndarray
    """uint8 (F, H, W, 3) RGB, (F, H, W) == bucket."""


def load_samples(shards_dir: str | Path) -> list[Sample]:
    """Decode every sample of a prepared folder into memory (meant for the small datasets of tests and demos).

    Raises like `read_index`, and ValueError when a decoded clip's shape differs from its bucket (corrupt shard).
    """
    samples = []
    columns = ["sample_id", "caption", "num_frames", "height", "width", "video_mp4"]
    for row in iter_samples(shards_dir, columns=columns):
        bucket = Bucket(row["num_frames"], row["height"], row["width"])
        video = decode_mp4(row["video_mp4"])  # (F, H, W, 3) uint8
        if video.shape != (*bucket, 3):
            raise ValueError(
                f"sample {row['sample_id']}: decoded shape {video.shape} differs from its bucket {bucket}; "
                "re-run `vidray prepare`"
            )
        samples.append(Sample(sample_id=row["sample_id"], caption=row["caption"], bucket=bucket, video=video))
    return samples
