"""The prepared folder's format, a leaf of the data plane: its names (`index.json`, generation folders, shard
files), reading and checking `index.json` (`read_index`) and the checksum error of a shard. `shards` (the writer and
the readers), `index` (the sample table) and `cache` (the warm shard cache) all read it without importing each
other."""

from __future__ import annotations

import hashlib
import json
import re
from pathlib import Path
from typing import Any

from vidray.errors import UserError, UserFileNotFound
from vidray.storage import Storage, check_relative, check_sha256, open_storage

__all__ = ["FORMAT", "FORMAT_VERSION", "GENERATION_PATTERN", "INDEX_NAME", "REPORT_NAME", "SHARD_GLOB",
           "ShardChecksumError", "check_listed_entries", "content_hash", "listed_files", "read_index",
           "read_index_file"]

FORMAT = "vidray-shards"
FORMAT_VERSION = 1
INDEX_NAME = "index.json"
REPORT_NAME = "report.json"
SHARD_GLOB = "shard.*.parquet"
GENERATION_PATTERN = re.compile(r"gen\.(\d{5,})")
"""A generation folder's name: `gen.00003` (one per prepare; the index names the committed one)."""


def content_hash(index: dict[str, Any]) -> str:
    """`"sha256:<hex>"` of `index` without its own `content_hash` key (keys sorted, JSON): what `index.json` records
    as `content_hash`, and what `read_index_file` checks it against (an edited or damaged index differs)."""
    body = {k: v for k, v in index.items() if k != "content_hash"}
    return "sha256:" + hashlib.sha256(json.dumps(body, sort_keys=True).encode()).hexdigest()


def read_index_file(storage: Storage) -> dict[str, Any] | None:
    """The index of `storage` as a dict if it is a well-formed, unedited vidray index; None when absent."""
    path = storage.display(INDEX_NAME)
    try:
        text = storage.read_bytes(INDEX_NAME)
    except FileNotFoundError:
        return None
    try:
        index = json.loads(text)
    except (json.JSONDecodeError, UnicodeDecodeError) as err:
        raise UserError(f"{path} is not valid JSON ({err}): re-run `vidray prepare`") from None
    if not isinstance(index, dict) or index.get("format") != FORMAT or index.get("version") != FORMAT_VERSION:
        found = (index.get("format"), index.get("version")) if isinstance(index, dict) else type(index).__name__
        raise UserError(
            f"{path}: expected format {FORMAT!r} version {FORMAT_VERSION}, got {found}; re-run `vidray prepare`"
        )
    if index.get("content_hash") != content_hash(index):
        raise UserError(f"{path}: content hash mismatch (edited or corrupt index); re-run `vidray prepare`")
    check_listed_entries(index, path, storage.display())
    return index


def check_listed_entries(index: dict[str, Any], path: str, root: str) -> None:
    """Every `file` of the index stays under its folder and every `sha256` (a cache file name) is 64 lowercase hex
    characters (`vidray.storage.check_relative` / `check_sha256`). Raises UnsafePathError (a UserError)
    naming the index, the field and the folder."""
    entries = [(f"shards[{i}]", s) for i, s in enumerate(index.get("shards", []))]
    entries += [(key, index[key]) for key in ("report", "samples") if index.get(key)]
    for field, entry in entries:
        if not isinstance(entry, dict):
            raise UserError(f"{path}: {field} is not an object; re-run `vidray prepare`")
        check_relative(entry.get("file"), root, what=f"{path} {field}.file")
        check_sha256(entry.get("sha256"), what=f"{path} {field}.sha256")


def listed_files(index: dict[str, Any]) -> list[str]:
    """Paths (relative to the shards folder) of every file an index commits: its shards, its report and its
    sample table (`vidray.data.index`)."""
    return [s["file"] for s in index["shards"]] + [index[key]["file"] for key in ("report", "samples") if index.get(key)]


def read_index(shards_dir: str | Path | Storage) -> dict[str, Any]:
    """Read and check `<shards_dir>/index.json`; returns it as a dict (keys: format, version, generation, fps,
    buckets, columns, num_samples, bucket_counts, shards [{file, num_samples, bytes, sha256}], report {file,
    bytes, sha256}, samples {file, bytes, sha256, num_samples} (the sample table, `vidray.data.index`; absent in
    folders prepared before it), content_hash). `file` paths are relative to `shards_dir` (`gen.00003/shard.00000.parquet`);
    indexes written before generations existed list bare `shard.00000.parquet` names and have no
    generation/report: they read the same. `shards_dir` may be a URI (`vidray.storage`): one listing checks
    that every listed object exists.

    Raises UserFileNotFound (a FileNotFoundError) when the index or a shard it lists is missing: run `vidray
    prepare` first; shards without an index are an unfinished prepare. Raises UserError (a ValueError) for
    another format version or an index whose content hash does not match (edited or corrupt).
    """
    storage = shards_dir if isinstance(shards_dir, Storage) else open_storage(shards_dir)
    index = read_index_file(storage)
    if index is None:
        unfinished = any(
            GENERATION_PATTERN.fullmatch(name) or Path(name).match(SHARD_GLOB) for name, _ in storage.rel_names()
        )
        hint = " (shard files without an index are an unfinished prepare)" if unfinished else ""
        raise UserFileNotFound(f"{storage.display(INDEX_NAME)} not found{hint}: run `vidray prepare` first")
    present = storage.files()
    missing = [s["file"] for s in index["shards"] if s["file"] not in present]
    if index.get("samples") and index["samples"]["file"] not in present:
        missing.append(index["samples"]["file"])
    if missing:
        raise UserFileNotFound(
            f"{storage.display()}: shards listed in {INDEX_NAME} are missing: {missing}; re-run `vidray prepare`"
        )
    return index


class ShardChecksumError(UserError):
    """A shard's bytes differ from the sha256 `index.json` records (corrupt or replaced object), after a retry.
    `file` is the shard's path relative to the folder."""

    def __init__(self, message: str, file: str):
        super().__init__(message)
        self.file = file
