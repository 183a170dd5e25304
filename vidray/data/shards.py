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

A job still reading an older generation keeps it: each training worker holds a `GenerationLease` on the
generation of the index it read (`.vidray-readers/gen.00003.<id>.json`, an expiry time it refreshes while it runs;
plain files, so the same works on object storage), and the cleanup skips every generation with a live lease. A
lease its reader stopped refreshing (the process died) expires after `READER_LEASE_S` and is removed by the next
cleanup; the generation then goes with it.

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
import logging
import os
import re
import shutil
import socket
import threading
import time
import uuid
import weakref
from dataclasses import dataclass
from pathlib import Path
from contextlib import contextmanager
from typing import TYPE_CHECKING, Any, Iterator, Sequence

import numpy as np
import pyarrow as pa
import pyarrow.fs as pafs
import pyarrow.parquet as pq

from vidray.buckets import Bucket
from vidray.storage import Storage, fsync_path, open_storage
from vidray.data.format import (FORMAT, FORMAT_VERSION, GENERATION_PATTERN, INDEX_NAME, REPORT_NAME,
                                ShardChecksumError, content_hash, listed_files, read_index, read_index_file)
from vidray.data.video import decode_mp4
from vidray.errors import UserError, UserFileNotFound

if TYPE_CHECKING:
    from vidray.data.cache import ShardCache

LOCK_NAME = ".vidray-prepare.lock"
_log = logging.getLogger(__name__)
READERS_DIR = ".vidray-readers"
"""Where readers' `GenerationLease` files live, in the shards folder."""
READER_LEASE_S = 600.0
"""Seconds a reader's lease lasts unless refreshed (every third of it while the reader runs): a generation whose
reader died is freed this long after its last refresh."""

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


def _write_atomic(path: Path, data: bytes) -> None:
    """Replace `path` with `data` all at once: written to `.<name>.tmp`, flushed, renamed over `path`."""
    tmp = path.with_name(f".{path.name}.tmp")
    tmp.write_bytes(data)
    fsync_path(tmp)
    os.replace(tmp, path)
    fsync_path(path.parent)


def generation_dir_name(generation: int) -> str:
    """`gen.00003` for generation 3."""
    return f"gen.{generation:05d}"


def _shard_table(rows: Sequence[dict[str, Any]]) -> pa.Table:
    for row in rows:
        if set(row) != set(COLUMNS):
            raise ValueError(f"shard row columns {sorted(row)} differ from the shard schema {list(COLUMNS)}")
    return pa.Table.from_pylist(list(rows), schema=SHARD_SCHEMA)


def write_shard(shards_dir: str | Path, shard_index: int, rows: Sequence[dict[str, Any]]) -> dict[str, Any]:
    """Write `rows` (dicts with exactly the `SHARD_SCHEMA` columns) as `<shards_dir>/shard.NNNNN.parquet`, via a
    temp file and a rename. Returns {"file" (the name), "num_samples", "bytes", "sha256"}. Raises ValueError for
    rows whose keys differ from the schema."""
    table = _shard_table(rows)
    path = Path(shards_dir) / shard_file_name(shard_index)
    tmp = path.with_name(f".{path.name}.tmp")
    pq.write_table(table, tmp, row_group_size=max(1, len(rows)))
    fsync_path(tmp)
    os.replace(tmp, path)
    return {"file": path.name, "num_samples": len(rows), "bytes": path.stat().st_size, "sha256": _sha256_file(path)}


def _is_ours(name: str) -> bool:
    """Names vidray prepare writes in a shards folder (shards, reports, their temp files, generation folders)."""
    return bool(
        GENERATION_PATTERN.fullmatch(name)
        or re.fullmatch(r"shard\.\d+\.parquet|report\.json|index\.json|samples\.parquet", name)
        or re.fullmatch(r"\.(shard\.\d+\.parquet|report\.json|index\.json|samples\.parquet)\.tmp", name)
    )


def _kept_names(storage: Storage) -> set[str] | None:
    """What `remove_unlisted` keeps: `index.json` and every file it lists (relative names), or None when the
    index cannot be read (then nothing is deleted)."""
    try:
        index = read_index_file(storage)
    except UserError:
        return None
    keep = {INDEX_NAME}
    if index is not None:
        keep.update(listed_files(index))
    return keep


def generation_of(index: dict[str, Any]) -> str | None:
    """The generation folder an index's files live in (`gen.00003`), or None for the pre-generation layout."""
    first = index["shards"][0]["file"] if index.get("shards") else ""
    head = first.split("/", 1)[0] if "/" in first else ""
    return head if GENERATION_PATTERN.fullmatch(head) else None


class GenerationLease:
    """A reader's claim on the generation `index` names, so that a re-prepare's cleanup (`remove_unlisted`) keeps
    it while the reader runs: the file `<shards_dir>/.vidray-readers/<generation>.<id>.json` holds
    `{"generation", "expires_unix", "holder"}` and is rewritten every `lease_s / 3` seconds by a daemon thread.
    `release()` deletes it; a reader that dies without releasing frees the generation `lease_s` seconds after its
    last refresh. An index of the pre-generation layout takes no lease (nothing to hold). A failed write or
    refresh is logged, not raised: the lease protects a reader, it never stops one.
    """

    def __init__(self, shards_dir: str | Path | Storage, index: dict[str, Any], *, lease_s: float = READER_LEASE_S):
        self.storage = shards_dir if isinstance(shards_dir, Storage) else open_storage(shards_dir)
        self.generation = generation_of(index)
        self.lease_s = float(lease_s)
        self.rel = f"{READERS_DIR}/{self.generation}.{uuid.uuid4().hex[:12]}.json"
        self._stop = threading.Event()
        self._thread = None
        if self.generation is None:
            return
        self._write()
        self._thread = threading.Thread(target=self._refresh, name="vidray-generation-lease", daemon=True)
        self._thread.start()

    def _write(self) -> None:
        record = {"generation": self.generation, "expires_unix": time.time() + self.lease_s,
                  "holder": f"{socket.gethostname()}:{os.getpid()}"}
        try:
            self.storage.write_bytes(self.rel, json.dumps(record).encode())
        except OSError as err:
            _log.warning("could not write the reader lease %s (%s); a re-prepare may remove %s while this job reads "
                         "it", self.storage.display(self.rel), err, self.generation)

    def _refresh(self) -> None:
        while not self._stop.wait(self.lease_s / 3):
            self._write()

    def release(self) -> None:
        """Stop refreshing and delete the lease (idempotent)."""
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=10)
            self._thread = None
            try:
                self.storage.delete_file(self.rel)
            except OSError:
                pass  # gone already; an unreadable leftover expires by itself

    def __enter__(self) -> "GenerationLease":
        return self

    def __exit__(self, *exc: object) -> None:
        self.release()


def leased_generations(storage: Storage, *, now: float | None = None) -> set[str]:
    """Generations with a live reader lease (`GenerationLease`) in `storage`'s folder. Expired and unreadable
    lease files are deleted on the way."""
    now = time.time() if now is None else now
    live: set[str] = set()
    for name, is_dir in list(storage.rel_names(READERS_DIR)):  # none when the folder does not exist
        rel = f"{READERS_DIR}/{name}"
        if is_dir or not name.endswith(".json"):
            continue
        try:
            record = json.loads(storage.read_bytes(rel))
            generation, expires = str(record["generation"]), float(record["expires_unix"])
        except (OSError, ValueError, KeyError, TypeError):
            generation, expires = "", 0.0
        if expires > now and GENERATION_PATTERN.fullmatch(generation):
            live.add(generation)
        else:
            try:
                storage.delete_file(rel)
            except OSError:
                pass
    return live


def remove_unlisted(shards_dir: str | Path | Storage) -> list[Path] | list[str]:
    """Delete what a prepare wrote in `shards_dir` that the committed `index.json` does not list: generation
    folders and shards of earlier or unfinished prepares, pre-generation `shard.NNNNN.parquet` / `report.json`,
    temp files. Without an index everything of ours goes (an unfinished first prepare). Files vidray never
    writes are left alone; an index that cannot be read (UserError from `read_index`) deletes nothing; a
    generation a running job still reads (a live `GenerationLease`) is kept whole.
    Returns the removed paths (local: Paths; object stores: `/`-separated names relative to the folder). Call it
    only while no other prepare writes the folder (`ShardWriter` holds the lock locally): it would delete a
    running prepare's new generation."""
    storage = shards_dir if isinstance(shards_dir, Storage) else open_storage(shards_dir)
    if not storage.is_local:
        return _remove_unlisted_remote(storage)
    shards_dir = storage.local_path
    if not shards_dir.is_dir():
        return []
    keep = _kept_names(storage)
    if keep is None:
        return []
    keep_dirs = {Path(rel).parts[0] for rel in keep if len(Path(rel).parts) > 1}
    leased = leased_generations(storage)
    removed = []
    for path in sorted(shards_dir.iterdir()):
        if path.name in keep or path.name in leased or not _is_ours(path.name):
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


def _remove_unlisted_remote(storage: Storage) -> list[str]:
    """`remove_unlisted` on an object store: the same rule, on keys ("folders" are key prefixes)."""
    keep = _kept_names(storage)
    if keep is None:
        return []
    keep_dirs = {rel.split("/")[0] for rel in keep if "/" in rel}
    leased = leased_generations(storage)
    removed = []
    for name, is_dir in sorted(storage.rel_names()):
        if name in keep or name in leased or not _is_ours(name):
            continue
        if is_dir:
            if name in keep_dirs:
                for inner, inner_is_dir in sorted(storage.rel_names(name)):
                    rel = f"{name}/{inner}"
                    if rel not in keep and _is_ours(inner) and not inner_is_dir:
                        storage.delete_file(rel)
                        removed.append(rel)
                continue
            storage.delete_dir(name)
        else:
            storage.delete_file(name)
        removed.append(name)
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

    `shards_dir` may be a URI (`vidray.storage`): each shard, the sample table and the report are then
    uploaded whole as they are finished and `index.json` last; there is no lock on object storage (run one
    prepare per URI at a time).

    Raises UserError when another prepare holds the folder's lock, or when `shards_dir` cannot be created (for a
    URI: its store does not answer, its bucket does not exist or an object cannot be written there).
    """

    def __init__(self, shards_dir: str | Path):
        self.storage = open_storage(shards_dir)
        if not self.storage.is_local:
            self._init_remote()
            return
        self.shards_dir = self.storage.local_path
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
            committed = read_index_file(self.storage)
        except UserError:  # a corrupt index is replaced by this prepare's; its files are kept until then
            committed = None
        self.generation = 1 + max([*existing, (committed or {}).get("generation", 0)])
        remove_unlisted(self.storage)
        self.generation_dir = self.shards_dir / generation_dir_name(self.generation)
        self.generation_dir.mkdir()
        self.shards: list[dict[str, Any]] = []
        """Index entries of the shards written so far ({"file": "gen.00003/shard.00000.parquet", ...})."""
        self.samples: dict[str, Any] | None = None
        """Index entry of the sample table once `write_sample_table` wrote it."""

    def _init_remote(self) -> None:
        """Object store: no lock (see the class docstring); the generation's objects are uploaded as written."""
        self.storage.check_reachable("data.shards_dir", write=True)  # before prepare probes and encodes any clip
        self.shards_dir = self.storage.location
        self._unlock = weakref.finalize(self, lambda: None)
        existing = [int(m.group(1)) for name, _ in self.storage.rel_names()
                    if (m := GENERATION_PATTERN.fullmatch(name))]
        try:
            committed = read_index_file(self.storage)
        except UserError:
            committed = None
        self.generation = 1 + max([*existing, (committed or {}).get("generation", 0)])
        remove_unlisted(self.storage)
        self.generation_dir = None
        self.generation_name = generation_dir_name(self.generation)
        self.shards = []
        self.samples = None

    def _upload(self, name: str, data: bytes) -> dict[str, Any]:
        rel = f"{self.generation_name}/{name}"
        self.storage.write_bytes(rel, data)
        return {"file": rel, "bytes": len(data), "sha256": hashlib.sha256(data).hexdigest()}

    def write_shard(self, rows: Sequence[dict[str, Any]]) -> dict[str, Any]:
        """Write the next shard of this generation; returns its index entry (`file` relative to the folder)."""
        self._check_open()
        if not self.storage.is_local:
            table = _shard_table(rows)
            sink = pa.BufferOutputStream()
            pq.write_table(table, sink, row_group_size=max(1, len(rows)))
            entry = self._upload(shard_file_name(len(self.shards)), sink.getvalue().to_pybytes())
            entry = {"file": entry["file"], "num_samples": len(rows), "bytes": entry["bytes"],
                     "sha256": entry["sha256"]}
            self.shards.append(entry)
            return entry
        entry = write_shard(self.generation_dir, len(self.shards), rows)
        entry["file"] = f"{self.generation_dir.name}/{entry['file']}"
        self.shards.append(entry)
        return entry

    def write_sample_table(self, columns: dict[str, Sequence[Any]]) -> dict[str, Any]:
        """Write this generation's sample table (`vidray.data.index`: one row per sample of the shards written,
        in their order) as `gen.NNNNN/samples.parquet`, via a temp file and a rename. Returns its index entry
        {file, bytes, sha256, num_samples}; `commit` lists it. Raises ValueError for wrong columns."""
        from vidray.data.index import SAMPLES_NAME, write_sample_table  # heavy: pyarrow

        self._check_open()
        if not self.storage.is_local:
            sink = pa.BufferOutputStream()
            table = write_sample_table(sink, columns)
            self.samples = {**self._upload(SAMPLES_NAME, sink.getvalue().to_pybytes()), "num_samples": table.num_rows}
            return self.samples
        path = self.generation_dir / SAMPLES_NAME
        tmp = path.with_name(f".{path.name}.tmp")
        table = write_sample_table(tmp, columns)
        fsync_path(tmp)
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
        if self.storage.is_local:
            report_path = self.generation_dir / REPORT_NAME
            _write_atomic(report_path, json.dumps(report, indent=2).encode())
            report_entry = {
                "file": f"{self.generation_dir.name}/{REPORT_NAME}",
                "bytes": report_path.stat().st_size,
                "sha256": _sha256_file(report_path),
            }
        else:
            report_entry = self._upload(REPORT_NAME, json.dumps(report, indent=2).encode())
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
            "report": report_entry,
        }
        if self.samples is not None:
            index["samples"] = dict(self.samples)
        index["content_hash"] = content_hash(index)
        if self.storage.is_local:
            fsync_path(self.shards_dir)  # the generation folder's entry is on disk before the index that names it
            _write_atomic(self.shards_dir / INDEX_NAME, json.dumps(index, indent=2).encode())
        else:  # one whole-object upload, after every object it lists
            self.storage.write_bytes(INDEX_NAME, json.dumps(index, indent=2).encode())
        remove_unlisted(self.storage)
        self.close()
        return index

    def abort(self) -> None:
        """Commit nothing: delete this generation's folder and release the lock. `index.json` and the files of
        the committed dataset (if any) stay exactly as they were."""
        self._check_open()
        if self.storage.is_local:
            shutil.rmtree(self.generation_dir, ignore_errors=True)
        else:
            for info in self.storage.list(self.generation_name, recursive=True):
                if info.type == pafs.FileType.File:
                    self.storage.fs.delete_file(info.path)
        self.close()

    def _check_open(self) -> None:
        if not self._unlock.alive:
            raise RuntimeError(f"this ShardWriter of {self.shards_dir} is committed or closed; start a new one")

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


def read_report(shards_dir: str | Path) -> dict[str, Any]:
    """The report (kept and skipped files with reasons) of the prepare that `<shards_dir>/index.json` commits.

    Raises like `read_index`, UserFileNotFound when the index lists no report (written before reports were
    committed with the index) or the report is missing, UserError when it differs from what the index recorded.
    """
    storage = open_storage(shards_dir)
    index = read_index(storage)
    entry = index.get("report")
    if entry is None:
        raise UserFileNotFound(f"{storage.display(INDEX_NAME)} lists no report: re-run `vidray prepare` to get one")
    path = storage.display(entry["file"])
    try:
        data = storage.read_bytes(entry["file"])
    except FileNotFoundError:
        raise UserFileNotFound(f"{path}, the report {INDEX_NAME} lists, is missing: re-run `vidray prepare`") from None
    if hashlib.sha256(data).hexdigest() != entry["sha256"]:
        raise UserError(f"{path} differs from the report {INDEX_NAME} recorded (edited?): re-run `vidray prepare`")
    return json.loads(data)


def report_path(shards_dir: str | Path) -> Path | str:
    """Where the committed prepare's report lies (`<shards_dir>/gen.00003/report.json`; `report.json` for
    folders prepared before generations): a Path for a local folder, the URI for an object store. Raises like
    `read_index`."""
    storage = open_storage(shards_dir)
    index = read_index(storage)
    rel = index["report"]["file"] if index.get("report") else REPORT_NAME
    return Path(shards_dir) / rel if storage.is_local else storage.display(rel)


def fetch_verified(storage: Storage, entry: dict[str, Any]) -> bytes:
    """The bytes of the shard `entry` (an `index.json` shard entry), checked against its sha256. A mismatch is
    read once more (a transient bad read), then raises ShardChecksumError naming the shard and both hashes."""
    for attempt in range(2):
        data = storage.read_bytes(entry["file"])
        digest = hashlib.sha256(data).hexdigest()
        if digest == entry["sha256"]:
            return data
    raise ShardChecksumError(
        f"shard {storage.display(entry['file'])} has sha256 {digest[:16]}... ({len(data)} bytes) but index.json "
        f"records {entry['sha256'][:16]}... ({entry.get('bytes')} bytes): corrupt or replaced; re-run `vidray prepare`",
        entry["file"],
    )


@contextmanager
def open_shard(storage: Storage, entry: dict[str, Any], cache: "ShardCache | None" = None) -> Iterator[pq.ParquetFile]:
    """The shard `entry` as a ParquetFile, its sha256 verified when fetched. Local folders are read in place
    (hashed on each open, never copied); object stores go through `cache` (the node's warm disk cache,
    `vidray.data.cache`: verified once at download, pinned while open) or, without one, are read into memory.
    Raises ShardChecksumError (see `fetch_verified`)."""
    if cache is not None and not storage.is_local:
        with cache.lease(storage, entry) as path:
            yield pq.ParquetFile(path)
        return
    yield pq.ParquetFile(pa.BufferReader(fetch_verified(storage, entry)))


def iter_samples(
    shards_dir: str | Path,
    columns: Sequence[str] | None = None,
    *,
    cache: "ShardCache | None" = None,
    skipped: list[dict[str, str]] | None = None,
) -> Iterator[dict[str, Any]]:
    """Yield one dict per sample (all `SHARD_SCHEMA` columns, or only `columns`), shard by shard in index
    order. `video_mp4` comes as mp4 bytes. Every shard is checked against its sha256 when fetched (`open_shard`;
    `cache`: the node's warm disk cache for object stores). With a `skipped` list, a shard failing its check, or
    still unreadable after the store's retries (OSError), is skipped and recorded there as {"file", "reason"};
    without one it raises (ShardChecksumError, OSError).
    Raises like `read_index`, and ValueError for an unknown column."""
    storage = open_storage(shards_dir)
    index = read_index(storage)
    if columns is not None:
        unknown = [c for c in columns if c not in COLUMNS]
        if unknown:
            raise ValueError(f"unknown shard column(s) {unknown}; valid: {', '.join(COLUMNS)}")
        columns = list(columns)
    for shard in index["shards"]:
        try:
            with open_shard(storage, shard, cache) as parquet:
                rows = [row for batch in parquet.iter_batches(batch_size=64, columns=columns)
                        for row in batch.to_pylist()]
        except ShardChecksumError as err:
            if skipped is None:
                raise
            skipped.append({"file": shard["file"], "reason": str(err)})
            continue
        except OSError as err:  # the store kept failing after the SDK's retries with backoff, or the shard vanished
            if skipped is None:
                raise
            skipped.append({"file": shard["file"], "reason": f"unreadable after retries: {type(err).__name__}: {err}"})
            continue
        yield from rows


@dataclass(frozen=True, eq=False)
class Sample:
    """One training clip, decoded."""

    sample_id: str
    caption: str
    bucket: Bucket
    video: np.ndarray
    """uint8 (F, H, W, 3) RGB, (F, H, W) == bucket."""


def load_samples(
    shards_dir: str | Path,
    *,
    cache: "ShardCache | None" = None,
    skipped: list[dict[str, str]] | None = None,
) -> list[Sample]:
    """Decode every sample of a prepared folder into memory (meant for the small datasets of tests and demos).
    `cache` and `skipped`: as in `iter_samples` (shards whose checksum fails are skipped and listed in `skipped`
    when it is given, else raise ShardChecksumError).

    Raises like `read_index`, and ValueError when a decoded clip's shape differs from its bucket (corrupt shard).
    """
    samples = []
    columns = ["sample_id", "caption", "num_frames", "height", "width", "video_mp4"]
    for row in iter_samples(shards_dir, columns=columns, cache=cache, skipped=skipped):
        bucket = Bucket(row["num_frames"], row["height"], row["width"])
        video = decode_mp4(row["video_mp4"])  # (F, H, W, 3) uint8
        if video.shape != (*bucket, 3):
            raise ValueError(
                f"sample {row['sample_id']}: decoded shape {video.shape} differs from its bucket {bucket}; "
                "re-run `vidray prepare`"
            )
        samples.append(Sample(sample_id=row["sample_id"], caption=row["caption"], bucket=bucket, video=video))
    return samples
