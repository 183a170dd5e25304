"""Where shards live: a local folder or any URI `pyarrow.fs` reaches (`s3://bucket/prefix`, `gs://...`, `file://`).

`open_storage(data.shards_dir)` turns the setting into a `Storage`: a pyarrow filesystem plus the folder's path in
it, with what `vidray.data.shards` and `vidray.data.ingest` need (read, write whole, list, delete, exists).

- Local folders (a plain path or `file://`) keep the local guarantees: writes go to `.<name>.tmp`, are fsynced and
  renamed over the target; `ShardWriter` holds the folder's `.vidray-prepare.lock`.
- Object stores: each object is written whole in one upload (readers never see half an object); `index.json` is
  written last, so it stays the commit marker. There is no lock on object storage: run one `vidray prepare` per
  URI at a time (a second, concurrent one may delete the other's uncommitted generation; the index then lists
  missing shards and `read_index` says so).
- `s3://` honours the usual AWS variables (`AWS_ACCESS_KEY_ID`, `AWS_SECRET_ACCESS_KEY`, `AWS_SESSION_TOKEN`,
  `AWS_REGION` / `AWS_DEFAULT_REGION`) and `AWS_ENDPOINT_URL_S3` / `AWS_ENDPOINT_URL` (`http://127.0.0.1:9000` for
  MinIO or moto). Transient errors of S3 requests are retried with backoff by the AWS SDK's standard retry
  strategy (`pyarrow.fs.AwsStandardS3RetryStrategy`, `S3_MAX_ATTEMPTS` attempts). A URI with a query string
  (`s3://b/p?endpoint_override=...`) is passed to `pyarrow.fs.FileSystem.from_uri` as is.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path
from typing import Iterator
from urllib.parse import urlparse

import pyarrow.fs as pafs

from vidray.errors import UserError

S3_MAX_ATTEMPTS = 5
"""Attempts per S3 request (the first plus retries, exponential backoff by the AWS SDK)."""


def is_uri(location: str | Path) -> bool:
    """True for `scheme://...` locations (`file://` included)."""
    return "://" in str(location)


def _s3_filesystem() -> pafs.S3FileSystem:
    """An S3 filesystem from the AWS environment variables, with the SDK's standard retry strategy."""
    kwargs: dict = {"retry_strategy": pafs.AwsStandardS3RetryStrategy(max_attempts=S3_MAX_ATTEMPTS)}
    endpoint = os.environ.get("AWS_ENDPOINT_URL_S3") or os.environ.get("AWS_ENDPOINT_URL")
    if endpoint:
        parsed = urlparse(endpoint if "://" in endpoint else f"https://{endpoint}")
        kwargs["endpoint_override"] = parsed.netloc + parsed.path.rstrip("/")
        kwargs["scheme"] = parsed.scheme or "https"
    region = os.environ.get("AWS_REGION") or os.environ.get("AWS_DEFAULT_REGION")
    if region:
        kwargs["region"] = region
    return pafs.S3FileSystem(**kwargs)


@dataclass(frozen=True)
class Storage:
    """A folder on some filesystem. `rel` arguments are `/`-separated paths relative to it."""

    location: str
    """The setting as given (for messages)."""
    fs: pafs.FileSystem
    base: str
    """The folder's path inside `fs` (no trailing slash)."""

    @property
    def is_local(self) -> bool:
        return isinstance(self.fs, pafs.LocalFileSystem)

    @property
    def local_path(self) -> Path:
        """The folder as a `Path` (local storage only)."""
        if not self.is_local:
            raise ValueError(f"{self.location} is not a local folder")
        return Path(self.base)

    def path(self, rel: str = "") -> str:
        return f"{self.base}/{rel}" if rel else self.base

    def display(self, rel: str = "") -> str:
        """`rel` as a user reads it: a local path, or the URI."""
        if self.is_local:
            return str(Path(self.base) / rel) if rel else self.base
        loc = self.location.split("?", 1)[0].rstrip("/")
        return f"{loc}/{rel}" if rel else loc

    def info(self, rel: str) -> pafs.FileInfo:
        return self.fs.get_file_info(self.path(rel))

    def is_file(self, rel: str) -> bool:
        return self.info(rel).type == pafs.FileType.File

    def is_dir(self, rel: str = "") -> bool:
        return self.info(rel).type == pafs.FileType.Directory

    def size(self, rel: str) -> int:
        return int(self.info(rel).size)

    def read_bytes(self, rel: str) -> bytes:
        """The whole file (`open_input_file`: sized reads, fast on object stores). FileNotFoundError if absent."""
        with self.fs.open_input_file(self.path(rel)) as f:
            return f.read()

    def open_input_file(self, rel: str):
        return self.fs.open_input_file(self.path(rel))

    def write_bytes(self, rel: str, data: bytes) -> None:
        """Replace `rel` with `data` all at once: locally temp file + fsync + rename (+ fsync of the folder); on an
        object store one whole-object upload (an object is never visible half written)."""
        if self.is_local:
            path = Path(self.path(rel))
            path.parent.mkdir(parents=True, exist_ok=True)
            tmp = path.with_name(f".{path.name}.tmp")
            tmp.write_bytes(data)
            fsync_path(tmp)
            os.replace(tmp, path)
            fsync_path(path.parent)
            return
        with self.fs.open_output_stream(self.path(rel)) as f:
            f.write(data)

    def list(self, rel: str = "", *, recursive: bool = False) -> list[pafs.FileInfo]:
        """Entries under `rel` (none when it does not exist). Object stores list "folders" from key prefixes."""
        return self.fs.get_file_info(pafs.FileSelector(self.path(rel), allow_not_found=True, recursive=recursive))

    def files(self) -> set[str]:
        """Every file under the folder, as paths relative to it (one listing: one paged request on S3)."""
        prefix = self.base.rstrip("/") + "/"
        return {i.path[len(prefix):] for i in self.list(recursive=True) if i.type == pafs.FileType.File}

    def delete_file(self, rel: str) -> None:
        self.fs.delete_file(self.path(rel))

    def delete_dir(self, rel: str) -> None:
        self.fs.delete_dir(self.path(rel))

    def rel_names(self, rel: str = "") -> Iterator[tuple[str, bool]]:
        """(name, is_dir) of the entries directly under `rel`."""
        for entry in self.list(rel):
            yield entry.base_name, entry.type == pafs.FileType.Directory


def fsync_path(path: Path) -> None:
    """Flush a file (or a folder's entries) to disk, so a rename that follows survives a power loss too."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def open_storage(location: str | Path) -> Storage:
    """`data.shards_dir` (a folder, `file:///abs/path`, `s3://bucket/prefix`, `gs://bucket/prefix`, ...) as a
    `Storage`. Local paths are made absolute. Raises UserError naming the setting for a URI pyarrow cannot open
    (unknown scheme, missing bucket name)."""
    text = str(location)
    if not is_uri(text):
        return Storage(text, pafs.LocalFileSystem(), str(Path(text).expanduser().resolve()))
    parsed = urlparse(text)
    try:
        if parsed.scheme == "s3" and not parsed.query:
            if not parsed.netloc:
                raise ValueError("no bucket name")
            path = f"{parsed.netloc}{parsed.path}".rstrip("/")
            return Storage(text, _s3_filesystem(), path)
        fs, path = pafs.FileSystem.from_uri(text)
    except (ValueError, OSError) as err:
        raise UserError(
            f"data.shards_dir {text!r} cannot be opened ({err}); give a local folder or a URI such as "
            "s3://bucket/prefix, gs://bucket/prefix or file:///abs/path"
        ) from None
    return Storage(text, fs, path.rstrip("/") or path)
