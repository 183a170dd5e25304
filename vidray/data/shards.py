"""The shard format: Parquet files of bucket-shaped H.264 clips, and the index that commits them.

A prepared folder holds one *generation* per `vidray prepare`: `gen.00003/shard.00000.parquet`, `shard.00001...`
(one row per sample, columns in `SHARD_SCHEMA`), `gen.00003/samples.parquet` (the sample table the schedule reads:
`vidray.data.index`), `gen.00003/report.json` (what was kept and skipped, and why), and, written last,
`index.json`: the commit marker, which names the generation's shards, sample table and report by path
relative to the folder. Readers read only what `index.json` lists; a folder without it is an unfinished
`vidray prepare` and is refused.

A re-prepare never touches the committed generation before the switch: `ShardWriter` writes the next generation
beside it, then `commit` writes its report, replaces `index.json` atomically (temp file + `os.replace`) and only
then deletes what the new index does not list (older generations, shards of the pre-generation layout, temp
files). A prepare interrupted at any point (Ctrl-C, SIGKILL, a full disk) leaves the old index and everything it
lists intact, plus orphan files that the next prepare removes. One prepare at a time per folder: a second one is
refused while the first holds `.vidray-prepare.lock`.

```python
index = read_index("outputs/shards")              # format, shards, num_samples, bucket_counts, buckets, fps
samples = load_samples("outputs/shards")          # [Sample(sample_id, caption, bucket, video uint8 (F, H, W, 3))]
report = read_report("outputs/shards")            # kept and skipped files of the committed prepare
```
"""

from __future__ import annotations

import errno
import fcntl
import hashlib
import json
import os
import re
import shutil
import weakref
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Iterator, Sequence

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq

from vidray.data.buckets import Bucket
from vidray.data.video import decode_mp4
from vidray.errors import UserError, UserFileNotFound

FORMAT = "vidray-shards"
FORMAT_VERSION = 1
INDEX_NAME = "index.json"
REPORT_NAME = "report.json"
SHARD_GLOB = "shard.*.parquet"
GENERATION_PATTERN = re.compile(r"gen\.(\d{5,})")
"""A generation folder's name: `gen.00003` (one per prepare; the index names the committed one)."""
LOCK_NAME = ".vidray-prepare.lock"

SHARD_SCHEMA = pa.schema(
    [
        ("sample_id", pa.string()),  # stable: hash of the source path (as the source lists it) + bucket (+ clip start)
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
        ("clip_start_s", pa.float32()),  # the clip's window in the source: s after its first frame (0, 0: image)
        ("clip_end_s", pa.float32()),  # (a long video split at scene cuts gives one row per clip)
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


def _fsync(path: Path) -> None:
    """Flush a file (or a folder's entries) to disk, so a rename that follows survives a power loss too."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _write_atomic(path: Path, data: bytes) -> None:
    """Replace `path` with `data` all at once: written to `.<name>.tmp`, flushed, renamed over `path`."""
    tmp = path.with_name(f".{path.name}.tmp")
    tmp.write_bytes(data)
    _fsync(tmp)
    os.replace(tmp, path)
    _fsync(path.parent)


def generation_dir_name(generation: int) -> str:
    """`gen.00003` for generation 3."""
    return f"gen.{generation:05d}"


def write_shard(shards_dir: str | Path, shard_index: int, rows: Sequence[dict[str, Any]]) -> dict[str, Any]:
    """Write `rows` (dicts with exactly the `SHARD_SCHEMA` columns) as `<shards_dir>/shard.NNNNN.parquet`, via a
    temp file and a rename. Returns {"file" (the name), "num_samples", "bytes", "sha256"}. Raises ValueError for
    rows whose keys differ from the schema."""
    for row in rows:
        if set(row) != set(COLUMNS):
            raise ValueError(f"shard row columns {sorted(row)} differ from the shard schema {list(COLUMNS)}")
    path = Path(shards_dir) / shard_file_name(shard_index)
    tmp = path.with_name(f".{path.name}.tmp")
    table = pa.Table.from_pylist(list(rows), schema=SHARD_SCHEMA)
    pq.write_table(table, tmp, row_group_size=max(1, len(rows)))
    _fsync(tmp)
    os.replace(tmp, path)
    return {"file": path.name, "num_samples": len(rows), "bytes": path.stat().st_size, "sha256": _sha256_file(path)}


def _content_hash(index: dict[str, Any]) -> str:
    body = {k: v for k, v in index.items() if k != "content_hash"}
    return "sha256:" + hashlib.sha256(json.dumps(body, sort_keys=True).encode()).hexdigest()


def _read_index_file(path: Path) -> dict[str, Any] | None:
    """The index at `path` as a dict if it is a well-formed, unedited vidray index; None when absent."""
    if not path.is_file():
        return None
    try:
        index = json.loads(path.read_text())
    except (json.JSONDecodeError, UnicodeDecodeError) as err:
        raise UserError(f"{path} is not valid JSON ({err}): re-run `vidray prepare`") from None
    if not isinstance(index, dict) or index.get("format") != FORMAT or index.get("version") != FORMAT_VERSION:
        found = (index.get("format"), index.get("version")) if isinstance(index, dict) else type(index).__name__
        raise UserError(
            f"{path}: expected format {FORMAT!r} version {FORMAT_VERSION}, got {found}; re-run `vidray prepare`"
        )
    if index.get("content_hash") != _content_hash(index):
        raise UserError(f"{path}: content hash mismatch (edited or corrupt index); re-run `vidray prepare`")
    listed = [s["file"] for s in index.get("shards", [])] + [
        index[key]["file"] for key in ("report", "samples") if index.get(key)
    ]
    for rel in listed:
        if Path(rel).is_absolute() or ".." in Path(rel).parts:
            raise UserError(f"{path} lists {rel!r}, outside its folder; re-run `vidray prepare`")
    return index


def listed_files(index: dict[str, Any]) -> list[str]:
    """Paths (relative to the shards folder) of every file an index commits: its shards, its report and its
    sample table (`vidray.data.index`)."""
    return [s["file"] for s in index["shards"]] + [index[key]["file"] for key in ("report", "samples") if index.get(key)]


def _is_ours(name: str) -> bool:
    """Names vidray prepare writes in a shards folder (shards, reports, their temp files, generation folders)."""
    return bool(
        GENERATION_PATTERN.fullmatch(name)
        or re.fullmatch(r"shard\.\d+\.parquet|report\.json|index\.json|samples\.parquet", name)
        or re.fullmatch(r"\.(shard\.\d+\.parquet|report\.json|index\.json|samples\.parquet)\.tmp", name)
    )


def remove_unlisted(shards_dir: str | Path) -> list[Path]:
    """Delete what a prepare wrote in `shards_dir` that the committed `index.json` does not list: generation
    folders and shards of earlier or unfinished prepares, pre-generation `shard.NNNNN.parquet` / `report.json`,
    temp files. Without an index everything of ours goes (an unfinished first prepare). Files vidray never
    writes are left alone; an index that cannot be read (UserError from `read_index`) deletes nothing.
    Returns the removed paths. Call it only while holding the folder's lock (`ShardWriter` does): it would
    delete a running prepare's new generation."""
    shards_dir = Path(shards_dir)
    if not shards_dir.is_dir():
        return []
    try:
        index = _read_index_file(shards_dir / INDEX_NAME)
    except UserError:
        return []
    keep = {INDEX_NAME}
    if index is not None:
        keep.update(listed_files(index))
    keep_dirs = {Path(rel).parts[0] for rel in keep if len(Path(rel).parts) > 1}
    removed = []
    for path in sorted(shards_dir.iterdir()):
        if path.name in keep or not _is_ours(path.name):
            continue
        if path.is_dir() and not path.is_symlink():
            if path.name in keep_dirs:  # the committed generation: drop only what its index does not list
                for inner in sorted(path.iterdir()):
                    if f"{path.name}/{inner.name}" not in keep and _is_ours(inner.name) and inner.is_file():
                        inner.unlink()
                        removed.append(inner)
                continue
            shutil.rmtree(path)
        else:
            path.unlink()
        removed.append(path)
    return removed


class ShardWriter:
    """Writes one prepare's generation beside the committed one and commits it by replacing `index.json`.

    ```python
    writer = ShardWriter("outputs/shards")        # locks the folder, removes orphans, makes gen.<N+1>/
    writer.write_shard(rows)                      # gen.<N+1>/shard.00000.parquet, ... (old index still valid)
    index = writer.commit(report, buckets=..., fps=8.0, bucket_counts={...})  # report, index, then cleanup
    ```
    Until `commit` replaces `index.json`, readers see the previous dataset unchanged; if the process dies or
    raises first, the new generation is an orphan that the next `ShardWriter` on the folder removes.

    Raises UserError when another prepare holds the folder's lock, or when `shards_dir` cannot be created.
    """

    def __init__(self, shards_dir: str | Path):
        self.shards_dir = Path(shards_dir)
        try:
            self.shards_dir.mkdir(parents=True, exist_ok=True)
        except OSError as err:
            raise UserError(
                f"cannot create the shards folder {self.shards_dir} ({err.strerror}); set data.shards_dir to a "
                "writable folder"
            ) from None
        lock_fd = _lock_folder(self.shards_dir)
        self._unlock = weakref.finalize(self, os.close, lock_fd)  # also when a failed prepare's writer is dropped
        # Numbers only grow (an interrupted prepare's number is not reused), then orphans of interrupted
        # prepares go before this one adds to the folder.
        existing = [int(m.group(1)) for p in self.shards_dir.iterdir() if (m := GENERATION_PATTERN.fullmatch(p.name))]
        try:
            committed = _read_index_file(self.shards_dir / INDEX_NAME)
        except UserError:  # a corrupt index is replaced by this prepare's; its files are kept until then
            committed = None
        self.generation = 1 + max([*existing, (committed or {}).get("generation", 0)])
        remove_unlisted(self.shards_dir)
        self.generation_dir = self.shards_dir / generation_dir_name(self.generation)
        self.generation_dir.mkdir()
        self.shards: list[dict[str, Any]] = []
        """Index entries of the shards written so far ({"file": "gen.00003/shard.00000.parquet", ...})."""
        self.samples: dict[str, Any] | None = None
        """Index entry of the sample table once `write_sample_table` wrote it."""

    def write_shard(self, rows: Sequence[dict[str, Any]]) -> dict[str, Any]:
        """Write the next shard of this generation; returns its index entry (`file` relative to the folder)."""
        self._check_open()
        entry = write_shard(self.generation_dir, len(self.shards), rows)
        entry["file"] = f"{self.generation_dir.name}/{entry['file']}"
        self.shards.append(entry)
        return entry

    def write_sample_table(self, columns: dict[str, Sequence[Any]]) -> dict[str, Any]:
        """Write this generation's sample table (`vidray.data.index`: one row per sample of the shards written,
        in their order) as `gen.NNNNN/samples.parquet`, via a temp file and a rename. Returns its index entry
        {file, bytes, sha256, num_samples}; `commit` lists it. Raises ValueError for wrong columns."""
        from vidray.data.index import SAMPLES_NAME, write_sample_table

        self._check_open()
        path = self.generation_dir / SAMPLES_NAME
        tmp = path.with_name(f".{path.name}.tmp")
        table = write_sample_table(tmp, columns)
        _fsync(tmp)
        os.replace(tmp, path)
        self.samples = {
            "file": f"{self.generation_dir.name}/{SAMPLES_NAME}", "bytes": path.stat().st_size,
            "sha256": _sha256_file(path), "num_samples": table.num_rows,
        }
        return self.samples

    def commit(
        self,
        report: dict[str, Any],
        *,
        buckets: Sequence[Bucket],
        fps: float,
        bucket_counts: dict[str, int],
    ) -> dict[str, Any]:
        """Write the report into the generation folder, then `index.json` (the commit marker: temp file +
        `os.replace`), then remove everything the new index does not list; releases the folder's lock.
        Returns the index. `bucket_counts` maps `str(bucket)` ("9x64x64") to its sample count."""
        self._check_open()
        report_path = self.generation_dir / REPORT_NAME
        _write_atomic(report_path, json.dumps(report, indent=2).encode())
        index: dict[str, Any] = {
            "format": FORMAT,
            "version": FORMAT_VERSION,
            "generation": self.generation,
            "fps": float(fps),
            "buckets": [list(b) for b in buckets],
            "columns": list(COLUMNS),
            "num_samples": sum(s["num_samples"] for s in self.shards),
            "bucket_counts": dict(bucket_counts),
            "shards": list(self.shards),
            "report": {
                "file": f"{self.generation_dir.name}/{REPORT_NAME}",
                "bytes": report_path.stat().st_size,
                "sha256": _sha256_file(report_path),
            },
        }
        if self.samples is not None:
            index["samples"] = dict(self.samples)
        index["content_hash"] = _content_hash(index)
        _fsync(self.shards_dir)  # the generation folder's entry is on disk before the index that names it
        _write_atomic(self.shards_dir / INDEX_NAME, json.dumps(index, indent=2).encode())
        remove_unlisted(self.shards_dir)
        self.close()
        return index

    def abort(self) -> None:
        """Commit nothing: delete this generation's folder and release the lock. `index.json` and the files of
        the committed dataset (if any) stay exactly as they were."""
        self._check_open()
        shutil.rmtree(self.generation_dir, ignore_errors=True)
        self.close()

    def _check_open(self) -> None:
        if not self._unlock.alive:
            raise RuntimeError(f"this ShardWriter of {self.generation_dir} is committed or closed; start a new one")

    def close(self) -> None:
        """Release the folder's lock. `commit` does; a writer abandoned by an exception releases it when it is
        garbage-collected (or its process ends); call this to release it at once."""
        self._unlock()


def _lock_folder(shards_dir: Path) -> int:
    """An exclusive POSIX lock on `<shards_dir>/.vidray-prepare.lock` (released when the fd closes or the
    process dies, even by SIGKILL). A process may re-lock a folder it holds (POSIX locks are per process)."""
    try:
        fd = os.open(shards_dir / LOCK_NAME, os.O_RDWR | os.O_CREAT, 0o644)
    except OSError as err:
        raise UserError(
            f"cannot write in the shards folder {shards_dir} ({err.strerror}); set data.shards_dir to a writable "
            "folder"
        ) from None
    try:
        fcntl.lockf(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except OSError as err:
        os.close(fd)
        if err.errno in (errno.EACCES, errno.EAGAIN):
            raise UserError(
                f"another `vidray prepare` is writing {shards_dir} (it holds {LOCK_NAME}); wait for it to finish "
                "or give this one another data.shards_dir"
            ) from None
        raise
    return fd


def read_index(shards_dir: str | Path) -> dict[str, Any]:
    """Read and check `<shards_dir>/index.json`; returns it as a dict (keys: format, version, generation, fps,
    buckets, columns, num_samples, bucket_counts, shards [{file, num_samples, bytes, sha256}], report {file,
    bytes, sha256}, samples {file, bytes, sha256, num_samples} (the sample table, `vidray.data.index`; absent in
    folders prepared before it), content_hash). `file` paths are relative to `shards_dir` (`gen.00003/shard.00000.parquet`);
    indexes written before generations existed list bare `shard.00000.parquet` names and have no
    generation/report: they read the same.

    Raises UserFileNotFound (a FileNotFoundError) when the index or a shard it lists is missing: run `vidray
    prepare` first; shards without an index are an unfinished prepare. Raises UserError (a ValueError) for
    another format version or an index whose content hash does not match (edited or corrupt).
    """
    shards_dir = Path(shards_dir)
    path = shards_dir / INDEX_NAME
    index = _read_index_file(path)
    if index is None:
        unfinished = shards_dir.is_dir() and any(
            GENERATION_PATTERN.fullmatch(p.name) or p.match(SHARD_GLOB) for p in shards_dir.iterdir()
        )
        hint = " (shard files without an index are an unfinished prepare)" if unfinished else ""
        raise UserFileNotFound(f"{path} not found{hint}: run `vidray prepare` first")
    missing = [s["file"] for s in index["shards"] if not (shards_dir / s["file"]).is_file()]
    if index.get("samples") and not (shards_dir / index["samples"]["file"]).is_file():
        missing.append(index["samples"]["file"])
    if missing:
        raise UserFileNotFound(
            f"{shards_dir}: shards listed in {INDEX_NAME} are missing: {missing}; re-run `vidray prepare`"
        )
    return index


def read_report(shards_dir: str | Path) -> dict[str, Any]:
    """The report (kept and skipped files with reasons) of the prepare that `<shards_dir>/index.json` commits.

    Raises like `read_index`, UserFileNotFound when the index lists no report (written before reports were
    committed with the index) or the report is missing, UserError when it differs from what the index recorded.
    """
    shards_dir = Path(shards_dir)
    index = read_index(shards_dir)
    entry = index.get("report")
    if entry is None:
        raise UserFileNotFound(f"{shards_dir / INDEX_NAME} lists no report: re-run `vidray prepare` to get one")
    path = shards_dir / entry["file"]
    if not path.is_file():
        raise UserFileNotFound(f"{path}, the report {INDEX_NAME} lists, is missing: re-run `vidray prepare`")
    if _sha256_file(path) != entry["sha256"]:
        raise UserError(f"{path} differs from the report {INDEX_NAME} recorded (edited?): re-run `vidray prepare`")
    return json.loads(path.read_text())


def report_path(shards_dir: str | Path) -> Path:
    """Where the committed prepare's report lies (`<shards_dir>/gen.00003/report.json`; `report.json` for
    folders prepared before generations). Raises like `read_index`."""
    index = read_index(shards_dir)
    return Path(shards_dir) / (index["report"]["file"] if index.get("report") else REPORT_NAME)


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
