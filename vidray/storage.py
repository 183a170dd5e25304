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
- Whole folders (a run's diffusers export, a checkpoint): `upload_dir(local, location, marker=...)` copies a local
  folder there with its commit marker (`model_index.json`, `manifest.json`) written last, and `download_dir(location,
  local, marker=...)` copies a committed one back; each retries the whole transfer on OSError
  (`TRANSFER_ATTEMPTS`, exponential backoff) and then raises `StorageTransferError` naming the location.
"""

from __future__ import annotations

import os
import re
import time
import uuid
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Iterator
from urllib.parse import urlparse

import pyarrow.fs as pafs

from vidray.errors import UserError, UserFileNotFound
from vidray.locations import is_uri

S3_MAX_ATTEMPTS = 5
"""Attempts per S3 request (the first plus retries, exponential backoff by the AWS SDK)."""


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
        object store one whole-object upload (an object is never visible half written).

        Several processes may write the same `rel` at once (two ranks' encode stages caching the prompt_embeds of
        one caption): each writes its own temp file (`_temp_beside`) and the last rename wins.
        """
        if self.is_local:
            path = Path(self.path(rel))
            path.parent.mkdir(parents=True, exist_ok=True)
            tmp = _temp_beside(path)
            try:
                tmp.write_bytes(data)
                fsync_path(tmp)
                os.replace(tmp, path)
            finally:
                tmp.unlink(missing_ok=True)  # only left when the write or the rename failed
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

    def check_reachable(self, setting: str, *, write: bool = False) -> None:
        """Fail early, in one line, when this object-store folder cannot be used: the endpoint does not answer,
        the bucket does not exist, or (with `write`) an object cannot be written under the folder (a probe object
        `.vidray-write-probe-<uuid>` is written and deleted). Local folders are not touched (their callers check
        them with `vidray.config.check_output_path`, or read them and say what is missing).

        Raises UserError naming `setting` (the config key, e.g. `storage.path`), the location, the store's error
        and the fix. Without this, the same faults surface later as an OSError traceback from pyarrow (after
        `prepare` encoded every clip, or inside Ray Train's controller).
        """
        if self.is_local:
            return
        bucket = self.base.split("/", 1)[0]
        where = self.display()
        endpoint = _endpoint_text(self.fs)
        memo = f"{endpoint} {bucket}"
        failed = _UNREACHABLE.get(memo)
        if failed and time.monotonic() - failed[0] < UNREACHABLE_MEMO_S:
            error = failed[1]  # the same bucket just failed: not another round of the SDK's retries
        else:
            try:
                found, error = self.fs.get_file_info(bucket).type, None
                _UNREACHABLE.pop(memo, None)
            except OSError as err:
                error = str(err)
                _UNREACHABLE[memo] = (time.monotonic(), error)
        if error is not None:
            raise UserError(
                f"{setting} {where}: cannot reach the object store ({error}); check the endpoint "
                f"({endpoint}), the network and the credentials"
            )
        if found == pafs.FileType.NotFound:
            raise UserError(
                f"{setting} {where}: bucket {bucket!r} does not exist (or these credentials cannot see it) at "
                f"{endpoint}; create the bucket or fix the URI"
            )
        if not write:
            return
        probe = f".vidray-write-probe-{uuid.uuid4().hex}"
        try:
            self.write_bytes(probe, b"")
        except OSError as err:
            raise UserError(
                f"{setting} {where}: cannot write there ({err}); give a location these credentials may write to"
            ) from None
        try:
            self.delete_file(probe)
        except OSError:  # written but not deletable: the write check passed; the empty probe object stays
            pass

    def rel_names(self, rel: str = "") -> Iterator[tuple[str, bool]]:
        """(name, is_dir) of the entries directly under `rel`."""
        for entry in self.list(rel):
            yield entry.base_name, entry.type == pafs.FileType.Directory


UNREACHABLE_MEMO_S = 30.0
"""Seconds the error of a `check_reachable` probe that failed is reused for the next location in the same bucket at
the same endpoint, instead of another ~10 s of the SDK's retries (the doctor checks up to three in a row)."""
_UNREACHABLE: dict[str, tuple[float, str]] = {}
"""{"<endpoint text> <bucket>": (monotonic time of the failed probe, its error)}."""


def _endpoint_text(fs: pafs.FileSystem) -> str:
    """The endpoint `fs` talks to, for messages: for S3 the one the AWS variables select."""
    if not isinstance(fs, pafs.S3FileSystem):
        return f"the {fs.type_name} store's endpoint"
    for name in ("AWS_ENDPOINT_URL_S3", "AWS_ENDPOINT_URL"):
        if os.environ.get(name):
            return f"{os.environ[name]}, from {name}"
    return "AWS's default endpoint: set AWS_ENDPOINT_URL for another S3 server"


def fsync_path(path: Path) -> None:
    """Flush a file (or a folder's entries) to disk, so a rename that follows survives a power loss too."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def open_storage(location: str | Path, *, setting: str = "data.shards_dir") -> Storage:
    """A folder (a path, `file:///abs/path`, `s3://bucket/prefix`, `gs://bucket/prefix`, ...) as a `Storage`.
    Local paths are made absolute. Raises UserError naming `setting` (the config key or argument the location came
    from, e.g. `storage.path`) for a URI pyarrow cannot open (unknown scheme, missing bucket name)."""
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
            f"{setting} {text!r} cannot be opened ({err}); give a local folder or a URI such as "
            "s3://bucket/prefix, gs://bucket/prefix or file:///abs/path"
        ) from None
    return Storage(text, fs, path.rstrip("/") or path)


TRANSFER_ATTEMPTS = 3
"""Attempts of a whole `upload_dir` / `download_dir` (each S3 request inside one is retried by the SDK as well)."""
TRANSFER_BACKOFF_S = 1.0
"""Seconds to wait before the second attempt of a folder transfer, doubled before each later one."""
_COPY_CHUNK_BYTES = 8 * 1024 * 1024


class StorageTransferError(OSError):
    """A folder upload or download that failed on every attempt (`TRANSFER_ATTEMPTS`). The message names the
    location and the last error; `location` is the URI or folder."""

    def __init__(self, message: str, location: str):
        super().__init__(message)
        self.location = location

    def __reduce__(self):  # survives pickling from a Ray worker to the driver
        return (type(self), (str(self), self.location))


class UnsafePathError(UserError):
    """A key listed from a store, or a path field of an index or manifest, that would leave the folder it is joined
    onto (`..`, absolute, empty or NUL parts), or a sha256 field that is not 64 lowercase hex characters."""


_SHA256_HEX = re.compile(r"[0-9a-f]{64}")


def check_relative(rel: str, root: str | Path, *, what: str = "key") -> str:
    """Return `rel`, a `/`-separated path that is about to be joined onto the folder `root` (a local folder or a
    store's URI, for the message), after checking that it stays under it: a non-empty string whose parts are none
    of `''` (absolute, `a//b`, trailing `/`), `.`, `..`, and that holds no NUL. Every key listed from
    a bucket and every `file` field of an index or manifest goes through here before it becomes a local path.
    Raises UnsafePathError naming `what`, the key and the root (one line)."""
    reason = None
    if not isinstance(rel, str) or not rel:
        reason = "it is empty"
    elif "\x00" in rel:
        reason = "it holds a NUL character"
    elif any(part in ("", ".", "..") for part in rel.split("/")):
        reason = "it is absolute or has an empty, '.' or '..' part"
    if reason:
        raise UnsafePathError(f"{what} {rel!r} would leave {root} ({reason}): refused; remove or rename it at its "
                              "source (a writer of the store or an edited index)")
    return rel


def safe_join(root: Path, rel: str, *, what: str = "key", shown_root: str | None = None) -> Path:
    """`root / rel` after `check_relative(rel, shown_root or root)`: the local path of a listed key or index field
    (never outside `root`). Raises UnsafePathError."""
    return root / check_relative(rel, shown_root or root, what=what)


def check_sha256(value: Any, *, what: str = "sha256") -> str:
    """Return `value` when it is exactly 64 lowercase hex characters (a sha256 that may become a file name);
    raises UnsafePathError naming `what` and the value otherwise."""
    if not isinstance(value, str) or not _SHA256_HEX.fullmatch(value):
        raise UnsafePathError(f"{what} {value!r} is not a sha256 (64 lowercase hex characters): refused; re-run "
                              "`vidray prepare` to rewrite the index")
    return value


def _local_files(local: Path) -> list[str]:
    """Every file under `local`, as sorted `/`-separated relative paths."""
    return sorted(p.relative_to(local).as_posix() for p in local.rglob("*") if p.is_file())


def _temp_beside(path: Path) -> Path:
    """A temp file name next to `path` that no other writer uses: `.<name>.<pid>-<random>.tmp`. Writers of one
    target each rename their own temp file over it (the last rename wins); with one temp name for all, a second
    writer's rename found the file already renamed away and raised FileNotFoundError (two ranks caching one
    caption's prompt_embeds in a CI run)."""
    return path.with_name(f".{path.name}.{os.getpid()}-{uuid.uuid4().hex[:12]}.tmp")


def _put_file(storage: Storage, rel: str, source: Path) -> int:
    """Copy the local file `source` to `rel` in `storage` in 8 MiB chunks; returns its size in bytes. Locally a temp
    file + fsync + rename; on an object store one streamed upload (multipart for large files), visible only once
    complete."""
    if storage.is_local:
        target = Path(storage.path(rel))
        target.parent.mkdir(parents=True, exist_ok=True)
        tmp = _temp_beside(target)
        try:
            with open(source, "rb") as src, open(tmp, "wb") as out:
                while chunk := src.read(_COPY_CHUNK_BYTES):
                    out.write(chunk)
            fsync_path(tmp)
            os.replace(tmp, target)
        finally:
            tmp.unlink(missing_ok=True)  # only left when the copy or the rename failed
        return target.stat().st_size
    size = 0
    with open(source, "rb") as src, storage.fs.open_output_stream(storage.path(rel)) as out:
        while chunk := src.read(_COPY_CHUNK_BYTES):
            out.write(chunk)
            size += len(chunk)
    return size


def _get_file(storage: Storage, rel: str, target: Path) -> int:
    """Copy `rel` of `storage` to the local file `target` in 8 MiB sized reads; returns its size in bytes."""
    target.parent.mkdir(parents=True, exist_ok=True)
    size = 0
    with storage.open_input_file(rel) as src, open(target, "wb") as out:
        while chunk := src.read(_COPY_CHUNK_BYTES):
            out.write(chunk)
            size += len(chunk)
    return size


def _with_retries(what: str, location: str, attempts: int, backoff_s: float, once, hint: str):
    """Run `once()` up to `attempts` times while it raises OSError, sleeping backoff_s, 2*backoff_s, ... between
    tries; raises StorageTransferError naming `what`, `location`, the attempts and the last error."""
    if attempts < 1:
        raise ValueError(f"attempts must be >= 1, got {attempts}")
    for attempt in range(1, attempts + 1):
        try:
            return once()
        except (StorageTransferError, UserError):  # UserFileNotFound is an OSError too: not retried
            raise
        except OSError as err:  # pyarrow's network and S3 errors are OSErrors; FileNotFoundError is one too
            last = err
            if attempt < attempts:
                time.sleep(backoff_s * 2 ** (attempt - 1))
    raise StorageTransferError(
        f"{what} {location} failed {attempts} times (last error: {type(last).__name__}: {last}); {hint}", location
    ) from last


def upload_dir(local: str | Path, location: str | Path, *, marker: str | None = None,
               attempts: int = TRANSFER_ATTEMPTS, backoff_s: float = TRANSFER_BACKOFF_S) -> int:
    """Copy every file under the local folder `local` into `location` (a folder or a URI, see `open_storage`), so
    that `location` then holds exactly those files. Returns the bytes copied.

    With `marker` (a file of `local`, e.g. `model_index.json` or `manifest.json`) the copy is committed by that
    file: an existing marker at `location` is deleted first, then the other files are copied, files of an earlier
    copy that `local` lacks are deleted, and the marker is copied last. A reader that checks the marker never sees
    a half-written folder as complete. An attempt that raises OSError (after the SDK's own per-request retries)
    is repeated whole, up to `attempts` times with exponential backoff from `backoff_s` seconds.

    Raises FileNotFoundError when `local` is not a folder, ValueError when `marker` is not one of its files,
    UserError when `location` cannot be opened, StorageTransferError (an OSError naming `location`) when every
    attempt failed: the marker is then absent there.
    """
    local = Path(local)
    if not local.is_dir():
        raise FileNotFoundError(f"upload_dir: {local} is not a folder")
    files = _local_files(local)
    if marker is not None and marker not in files:
        raise ValueError(f"upload_dir: marker {marker!r} is not a file of {local} (files: {', '.join(files[:8])})")
    storage = open_storage(location, setting="upload destination")
    parts = [f for f in files if f != marker]

    def once() -> int:
        if marker is not None and storage.is_file(marker):
            storage.delete_file(marker)  # uncommit the earlier copy before touching its parts
        copied = sum(_put_file(storage, rel, local / rel) for rel in parts)
        for stale in sorted(storage.files() - set(files)):
            storage.delete_file(stale)
        if marker is not None:
            copied += _put_file(storage, marker, local / marker)
        return copied

    return _with_retries(
        "uploading", f"{local} to {storage.display()}", attempts, backoff_s, once,
        f"{storage.display()} is left without {marker} (incomplete); check the credentials, the bucket and "
        "AWS_ENDPOINT_URL, then run it again" if marker else "check the credentials, the bucket and AWS_ENDPOINT_URL",
    )


def download_dir(location: "str | Path | Storage", local: str | Path, *, marker: str | None = None,
                 attempts: int = TRANSFER_ATTEMPTS, backoff_s: float = TRANSFER_BACKOFF_S) -> int:
    """Copy every file under `location` (a folder, a URI, see `open_storage`, or a `Storage`) into the local folder `local`
    (created; files already there with other names are kept, so give a fresh folder). Returns the bytes copied.

    With `marker` only a committed folder is copied (see `upload_dir`): the marker must exist, is copied last, and
    must be unchanged (size, modification time) after the other files were copied, else the attempt is repeated
    (a writer replaced the folder meanwhile). An attempt that raises OSError is repeated whole, up to `attempts`
    times with exponential backoff from `backoff_s` seconds.

    Every listed key is checked to stay under `local` (`safe_join`) before anything is written: a key such as
    `a/../../x` raises UnsafePathError (not retried) naming the key and the folder.

    Raises UserFileNotFound when `location` holds no file, or no `marker` (not retried), UserError when it cannot
    be opened, StorageTransferError (an OSError naming `location`) when every attempt failed.
    """
    local = Path(local)
    storage = location if isinstance(location, Storage) else open_storage(location, setting="download source")

    def marker_info() -> pafs.FileInfo:
        info = storage.info(marker)
        if info.type != pafs.FileType.File:
            raise UserFileNotFound(f"{storage.display()} has no {marker}: it is not a complete folder")
        return info

    def once() -> int:
        before = marker_info() if marker is not None else None
        files = sorted(storage.files())
        if not files:
            raise UserFileNotFound(f"{storage.display()} holds no file")
        targets = {rel: safe_join(local, rel, shown_root=f"{local} (from {storage.display()})") for rel in files}
        if local.exists():
            for target in targets.values():  # a failed attempt's leftovers
                target.unlink(missing_ok=True)
        local.mkdir(parents=True, exist_ok=True)
        copied = sum(_get_file(storage, rel, targets[rel]) for rel in files if rel != marker)
        if marker is not None:
            copied += _get_file(storage, marker, local / marker)
            after = marker_info()
            if (after.size, after.mtime) != (before.size, before.mtime):
                raise OSError(f"{storage.display(marker)} changed during the download (a new copy is being written)")
        return copied

    return _with_retries("downloading", f"{storage.display()} to {local}", attempts, backoff_s, once,
                         "check the credentials, the bucket and AWS_ENDPOINT_URL, then run it again")
