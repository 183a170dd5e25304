"""The sample table: one row per sample, what the schedule needs without touching video bytes.

`vidray prepare` writes `gen.NNNNN/samples.parquet` beside the generation's shards and lists it in `index.json`
(`"samples": {file, bytes, sha256, num_samples}`), which is still written last. Columns (`SAMPLE_TABLE_SCHEMA`):

| column | type | meaning |
|---|---|---|
| `sample_id` | string | the shard row's id (16 hex chars, `-N` for a file listed again) |
| `sample_key` | int64 | first 8 bytes of sha256(sample_id), >= 0: keys per-sample noise (`vidray.train.step`) |
| `num_frames`, `height`, `width` | int32 | the bucket |
| `shard` | int32 | position of the sample's shard in `index.json`'s `shards` list |
| `row` | int32 | row of the sample in that shard |
| `stored_bytes` | int64 | len(video_mp4): bytes of the stored clip |
| `source_sha256` | binary(32) | sha256 digest of the source file's bytes, computed once per source; null if unknown |
| `clip_start_s`, `clip_end_s` | float32 | the clip's window in the source (clips split from one source share the hash) |

```python
table = load_sample_index("outputs/shards")   # numpy arrays; 1 M rows load in about a second
table.buckets[table.bucket_id[i]]             # Bucket of sample i
```
Folders prepared before the table existed: `load_sample_index` builds it from the shards' columns (reading each
shard once; `source_sha256` is unknown then: zeros) and says so in `SampleIndex.rebuilt`; re-run `vidray prepare` to store it.
"""

from __future__ import annotations

import collections
import hashlib
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Sequence

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.parquet as pq

from vidray.buckets import Bucket
from vidray.data.format import read_index
from vidray.errors import UserError
from vidray.storage import open_storage

SAMPLES_NAME = "samples.parquet"
SAMPLE_TABLE_SCHEMA = pa.schema(
    [
        ("sample_id", pa.string()),
        ("sample_key", pa.int64()),
        ("num_frames", pa.int32()),
        ("height", pa.int32()),
        ("width", pa.int32()),
        ("shard", pa.int32()),
        ("row", pa.int32()),
        ("stored_bytes", pa.int64()),
        ("source_sha256", pa.binary(32)),
        ("clip_start_s", pa.float32()),
        ("clip_end_s", pa.float32()),
    ]
)


def sample_key(sample_id: str) -> int:
    """Non-negative int64 key of a sample id: the first 8 bytes of its sha256, top bit cleared."""
    return int.from_bytes(hashlib.sha256(sample_id.encode()).digest()[:8], "big") & (2**63 - 1)


def write_sample_table(path: str | Path, columns: dict[str, Sequence[Any]]) -> pa.Table:
    """Write the sample table to `path` (Parquet, via the caller's temp-file + rename). `columns` holds every
    column of `SAMPLE_TABLE_SCHEMA` except `sample_key`, which is derived here; `source_sha256` as hex strings
    ("" when unknown). Returns the table.
    Raises ValueError for missing or extra columns."""
    expected = set(SAMPLE_TABLE_SCHEMA.names) - {"sample_key"}
    if set(columns) != expected:
        raise ValueError(f"sample table columns {sorted(columns)} differ from {sorted(expected)}")
    data = dict(columns)
    data["sample_key"] = [sample_key(s) for s in columns["sample_id"]]  # once per sample, at prepare time
    data["source_sha256"] = [bytes.fromhex(h) if h else None for h in columns["source_sha256"]]
    table = pa.table({name: pa.array(data[name], type=SAMPLE_TABLE_SCHEMA.field(name).type)
                      for name in SAMPLE_TABLE_SCHEMA.names})
    pq.write_table(table, path)
    return table


@dataclass(frozen=True, eq=False)
class SampleIndex:
    """The sample table as numpy arrays (no per-sample Python objects), N rows in index order (shard, row).

    sample_id: (N,) fixed-width bytes (`S<len>`; `.astype(str)` for text); sample_key: (N,) int64;
    bucket_id: (N,) int16 into `buckets` (sorted); shard, row: (N,) int32; stored_bytes: (N,) int64;
    source_sha256: (N, 32) uint8 sha256 digests of the sources (all zero when unknown; `.tobytes().hex()` for
    text); clip_start_s, clip_end_s: (N,) float32.
    rebuilt: True when built from the shards of a folder prepared before the table existed.
    """

    sample_id: np.ndarray
    sample_key: np.ndarray
    bucket_id: np.ndarray
    buckets: tuple[Bucket, ...]
    shard: np.ndarray
    row: np.ndarray
    stored_bytes: np.ndarray
    source_sha256: np.ndarray
    clip_start_s: np.ndarray
    clip_end_s: np.ndarray
    rebuilt: bool = False

    def __len__(self) -> int:
        return len(self.sample_id)


def _fixed_width(column: pa.ChunkedArray | pa.Array) -> np.ndarray:
    """A string column as a numpy `S<max len>` array, from Arrow's offsets and data buffers (vectorised)."""
    array = column.combine_chunks() if isinstance(column, pa.ChunkedArray) else column
    array = array.cast(pa.large_string())
    n = len(array)
    if n == 0:
        return np.zeros(0, dtype="S1")
    if array.null_count:
        array = pc.fill_null(array, "")
    _, offsets_buf, data_buf = array.buffers()
    offsets = np.frombuffer(offsets_buf, dtype=np.int64, count=n + 1, offset=array.offset * 8)
    data = np.frombuffer(data_buf, dtype=np.uint8) if data_buf is not None else np.zeros(0, np.uint8)
    lengths = np.diff(offsets)
    width = max(1, int(lengths.max()))
    if (lengths == width).all():  # ids and hex hashes: one length, the data buffer is already the table
        return data[offsets[0]:offsets[-1]].copy().view(f"S{width}")
    out = np.zeros((n, width), dtype=np.uint8)
    for length in np.unique(lengths):  # a few distinct lengths: gather each group's bytes at once
        if length == 0:
            continue
        rows = np.flatnonzero(lengths == length)
        out[rows, :length] = data[offsets[rows][:, None] + np.arange(length)]
    return out.view(f"S{width}").reshape(n)


def _digests(column: pa.ChunkedArray) -> np.ndarray:
    """A binary(32) column as an (N, 32) uint8 array straight from Arrow's data buffer (nulls: zeros)."""
    array = column.combine_chunks()
    n = len(array)
    if n == 0 or array.null_count == n:
        return np.zeros((n, 32), dtype=np.uint8)
    _, data = array.buffers()
    out = np.frombuffer(data, dtype=np.uint8, count=(array.offset + n) * 32)[array.offset * 32:].reshape(n, 32)
    out = out.copy()
    if array.null_count:
        out[~array.is_valid().to_numpy(zero_copy_only=False)] = 0
    return out


def _bucket_ids(num_frames: np.ndarray, height: np.ndarray, width: np.ndarray) -> tuple[np.ndarray, tuple[Bucket, ...]]:
    keys = (num_frames.astype(np.int64) << 40) | (height.astype(np.int64) << 20) | width.astype(np.int64)
    unique, inverse = np.unique(keys, return_inverse=True)
    buckets = tuple(Bucket(int(k >> 40), int((k >> 20) & 0xFFFFF), int(k & 0xFFFFF)) for k in unique)
    return inverse.astype(np.int16 if len(unique) < 2**15 else np.int32), buckets


def _table_from_shards(storage: Any, index: dict[str, Any]) -> pa.Table:
    """The sample table of a folder prepared before it existed, read from the shards' own columns."""
    parts = []
    for shard_no, entry in enumerate(index["shards"]):
        t = pq.read_table(pa.BufferReader(storage.read_bytes(entry["file"])),
                          columns=["sample_id", "num_frames", "height", "width", "video_mp4", "clip_start_s",
                                   "clip_end_s"])
        n = t.num_rows
        parts.append(pa.table({
            "sample_id": t["sample_id"],
            "sample_key": pa.array([sample_key(s) for s in t["sample_id"].to_pylist()], pa.int64()),
            "num_frames": t["num_frames"], "height": t["height"], "width": t["width"],
            "shard": pa.array(np.full(n, shard_no, np.int32)),
            "row": pa.array(np.arange(n, dtype=np.int32)),
            "stored_bytes": pc.cast(pc.binary_length(t["video_mp4"]), pa.int64()),
            "source_sha256": pa.nulls(n, pa.binary(32)),
            "clip_start_s": t["clip_start_s"], "clip_end_s": t["clip_end_s"],
        }, schema=SAMPLE_TABLE_SCHEMA))
    return pa.concat_tables(parts) if parts else SAMPLE_TABLE_SCHEMA.empty_table()


def load_sample_index(shards_dir: str | Path) -> SampleIndex:
    """Read the committed sample table of a prepared folder (or URI, `vidray.storage`) into numpy arrays.

    Raises like `vidray.data.shards.read_index` (no index, missing files), and UserError when the table differs
    from what `index.json` recorded (size, sha256 or row count: edited or damaged) or lacks a column.
    """
    storage = open_storage(shards_dir)
    index = read_index(storage)
    entry = index.get("samples")
    rebuilt = entry is None
    if rebuilt:
        table = _table_from_shards(storage, index)
    else:
        path = storage.display(entry["file"])
        data = storage.read_bytes(entry["file"])
        if len(data) != entry["bytes"] or hashlib.sha256(data).hexdigest() != entry["sha256"]:
            raise UserError(f"{path} differs from the sample table index.json recorded (edited or damaged): "
                            "re-run `vidray prepare`")
        table = pq.read_table(pa.BufferReader(data))
        missing = [c for c in SAMPLE_TABLE_SCHEMA.names if c not in table.column_names]
        if missing or table.num_rows != index["num_samples"]:
            raise UserError(f"{path} has {table.num_rows} rows for {index['num_samples']} samples, missing columns "
                            f"{missing}: re-run `vidray prepare`")
    col = {name: table[name].to_numpy() for name in
           ("sample_key", "num_frames", "height", "width", "shard", "row", "stored_bytes", "clip_start_s",
            "clip_end_s")}
    bucket_id, buckets = _bucket_ids(col["num_frames"], col["height"], col["width"])
    return SampleIndex(
        sample_id=_fixed_width(table["sample_id"]),
        sample_key=col["sample_key"].astype(np.int64),
        bucket_id=bucket_id,
        buckets=buckets,
        shard=col["shard"].astype(np.int32),
        row=col["row"].astype(np.int32),
        stored_bytes=col["stored_bytes"].astype(np.int64),
        source_sha256=_digests(table["source_sha256"]),
        clip_start_s=col["clip_start_s"].astype(np.float32),
        clip_end_s=col["clip_end_s"].astype(np.float32),
        rebuilt=rebuilt,
    )



DATASET_ROWS_SCHEMA = pa.schema([("sample_id", pa.string()), ("source_sha256", pa.binary(32)),
                                 ("row_sha256", pa.binary(32))])


_UNREADABLE_CAPTION = "\x00unreadable shard"
"""What `dataset_rows` hashes for the captions of a shard that cannot be read (so driver and workers agree)."""


def dataset_rows(shards_dir: str | Path) -> pa.Table:
    """One row per sample of a prepared folder, sorted by sample_id: its source's sha256 (zeros when unknown) and
    `row_sha256`, the sha256 of what defines it as training data (sample_id, bucket `FxHxW`, source sha256,
    clip_start_s and clip_end_s in ms, caption), not of its encoding. Reads the sample table and the shards'
    caption column only (no video bytes). `dataset_hash` digests it; `describe_dataset_change` compares two.
    Raises like `load_sample_index`."""
    storage = open_storage(shards_dir)  # a folder or a URI
    table = load_sample_index(shards_dir)
    captions: list[list[str | None]] = []
    for entry in read_index(storage)["shards"]:
        try:  # only the caption column is read (a column chunk on object stores too)
            shard = pq.read_table(storage.path(entry["file"]), filesystem=storage.fs, columns=["caption"])
            captions.append(shard["caption"].to_pylist())
        except (OSError, pa.ArrowException):  # a damaged shard (training skips it): the same marker everywhere
            captions.append([_UNREADABLE_CAPTION] * int(entry["num_samples"]))
    ids, sources, digests = [], [], []
    for i in np.argsort(table.sample_id, kind="stable"):
        b = table.buckets[table.bucket_id[i]]
        source = table.source_sha256[i].tobytes()
        sample_id = table.sample_id[i].decode()
        row = "\t".join((sample_id, f"{b.num_frames}x{b.height}x{b.width}", source.hex(),
                         str(round(float(table.clip_start_s[i]) * 1000)),
                         str(round(float(table.clip_end_s[i]) * 1000)),
                         captions[table.shard[i]][table.row[i]] or ""))
        ids.append(sample_id)
        sources.append(source)
        digests.append(hashlib.sha256(row.encode()).digest())
    return pa.table({"sample_id": pa.array(ids, pa.string()), "source_sha256": pa.array(sources, pa.binary(32)),
                     "row_sha256": pa.array(digests, pa.binary(32))}, schema=DATASET_ROWS_SCHEMA)


def dataset_hash(shards_dir_or_rows: str | Path | pa.Table) -> str:
    """Identity of the training data in a prepared folder (or of its `dataset_rows`), independent of its encoding:
    "sha256:<hex>" over the sorted rows of `dataset_rows`. Re-preparing identical sources gives the same hash
    although the generation folder and x264's bytes differ (`index.json`'s content_hash does not survive that);
    adding, removing or changing a sample (source bytes, bucket, clip window, caption) changes it."""
    rows = shards_dir_or_rows if isinstance(shards_dir_or_rows, pa.Table) else dataset_rows(shards_dir_or_rows)
    digest = hashlib.sha256()
    for sample_id, row in zip(rows["sample_id"].to_pylist(), rows["row_sha256"].to_pylist(), strict=True):
        digest.update(sample_id.encode() + b"\t" + row + b"\n")
    return "sha256:" + digest.hexdigest()


def describe_dataset_change(old: pa.Table, new: pa.Table) -> str:
    """What differs between two `dataset_rows` tables, e.g. "3 samples added, 1 removed, 2 changed source, 1
    changed caption, bucket or clip window" ("no sample differs" when none).

    A sample_id hashes a file's path as `data.source` writes it (`vidray.data.ingest`), so the same file listed
    another way (relative instead of absolute, another folder) is a removed and an added sample. Removed and added
    samples of the same source file (equal `source_sha256`, known) are counted as such instead: "2 samples of the
    same source files listed under other paths (a sample_id hashes the path as data.source writes it: list the
    files as this run's prepare did)"."""
    before = dict(zip(old["sample_id"].to_pylist(), zip(old["source_sha256"].to_pylist(),
                                                         old["row_sha256"].to_pylist())))
    after = dict(zip(new["sample_id"].to_pylist(), zip(new["source_sha256"].to_pylist(),
                                                        new["row_sha256"].to_pylist())))
    common = before.keys() & after.keys()
    source = sum(1 for k in common if before[k][0] != after[k][0])
    other = sum(1 for k in common if before[k][0] == after[k][0] and before[k][1] != after[k][1])
    unknown = bytes(32)

    def sources(ids) -> collections.Counter:
        return collections.Counter(src for src in ids if src and src != unknown)

    relisted = sum((sources(before[k][0] for k in before.keys() - after.keys())
                    & sources(after[k][0] for k in after.keys() - before.keys())).values())
    added = len(after.keys() - before.keys()) - relisted
    parts = [f"{n} {what}" for n, what in ((added, "sample added" if added == 1 else "samples added"),
                                           (len(before.keys() - after.keys()) - relisted, "removed"),
                                           (source, "changed source"),
                                           (other, "changed caption, bucket or clip window")) if n]
    if relisted:
        parts.append(f"{relisted} {'sample' if relisted == 1 else 'samples'} of the same source files listed under "
                     "other paths (a sample_id hashes the path as data.source writes it: list the files as this "
                     "run's prepare did, e.g. relative or absolute as then)")
    return ", ".join(parts) or "no sample differs"


def drop_shards(table: SampleIndex, shards: Sequence[int]) -> SampleIndex:
    """`table` without the samples of the shards at positions `shards` (in `index.json`'s list): how a shard
    skipped for a failed checksum leaves the schedule. Buckets left empty disappear from `buckets`
    (`bucket_id` is renumbered); `shard` and `row` keep pointing into the original index."""
    keep = ~np.isin(table.shard, np.asarray(list(shards), dtype=np.int64))
    bucket_id, buckets = _bucket_ids(*(np.array([b[i] for b in table.buckets], dtype=np.int64)[table.bucket_id[keep]]
                                       for i in range(3)))
    return SampleIndex(
        sample_id=table.sample_id[keep], sample_key=table.sample_key[keep], bucket_id=bucket_id, buckets=buckets,
        shard=table.shard[keep], row=table.row[keep], stored_bytes=table.stored_bytes[keep],
        source_sha256=table.source_sha256[keep], clip_start_s=table.clip_start_s[keep],
        clip_end_s=table.clip_end_s[keep], rebuilt=table.rebuilt,
    )
