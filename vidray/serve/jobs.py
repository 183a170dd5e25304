"""The durable video-job store: job records in sqlite, finished videos and input images as files.

Job records and videos live outside the Serve replicas, so a replica that crashes loses no job (issue 8 item 5).
Several processes on one host share one store at once (the ingress replicas, the job runner): every call opens
its own sqlite connection (WAL journal, 30 s busy timeout) and every write runs in a ``BEGIN IMMEDIATE``
transaction, so writers queue for the lock instead of failing with "database is locked".

Layout under the store's root folder::

    root/jobs.sqlite3          the job table (one row per job)
    root/videos/<id>.mp4       finished videos, moved in by `JobStore.complete`
    root/inputs/<id>.<ext>     first-frame images given with `POST /v1/videos` (``input_reference``)
    root/tmp/                  mp4s being written by a runner (`JobStore.temp_video`), swept by `sweep_temp`
    root/owner.json            the Serve app that owns the store (`claim_store`; written once, atomically)

A job's life::

    create -> queued -claim-> in_progress -complete-> completed
                 ^                 |  \\-fail-> failed
                 |                 |
                 +--release / recover_expired (attempts < max_attempts), else -> failed

Rules the store enforces:

- A ``completed`` or ``failed`` job never changes again, except that `JobStore.delete` removes it.
- Every change to an ``in_progress`` job names its owner (the runner that claimed it); a runner whose lease
  expired and whose job was re-claimed, released or deleted gets ``False`` and changes nothing.
- ``progress`` never goes down within one attempt; a job put back to ``queued`` starts its next attempt at 0.
- A job whose runner died (its lease ran out) is retried while ``attempts < max_attempts``, else marked
  ``failed`` with code ``runner_lost``: never left ``in_progress``.
- A lease that ran out is lost even before `recover_expired` hands the job back: `heartbeat` and `complete` then
  answer False. A runner passes a fresh owner id to each `claim` (`VideoJobService` does), so a runner that
  stalled past its lease cannot act on the next attempt of the same job, even when it claimed that attempt itself.
- Bounds: `create` refuses a job beyond ``max_unfinished`` (total) or ``max_unfinished_per_client`` unfinished
  (queued + in_progress) jobs with `QueueFullError`; `claim` takes clients' queues round-robin (FIFO within a
  client); a finished job expires ``retention_s`` after it finished and `sweep_expired` removes it and its files.
- Bytes: each job counts the bytes of its files (input image + mp4, column ``bytes``). `create` refuses a job with
  `StorageFullError` when its client's files already hold ``max_client_bytes``, the store's ``max_store_bytes``,
  or the disk has less than ``min_free_bytes`` free; `claim` hands out no job while the disk is that short (the
  jobs wait, queued). Nothing stored is removed to make room.
- Tenancy: `get`, `list`, `delete`, `video_path`, `open_video` and `counts` take ``client``: given, they see only
  that client's jobs (another client's id is answered exactly as an unknown one); None sees all (the runner,
  admins). ``jobs_client_order`` indexes the per-client list.
- Idempotency: `create` with an ``idempotency_key`` records (client, key, a hash of the request) in the same
  transaction that inserts the job; the same key and request from the same client later returns that job instead
  of a new one, and the same key with another request raises `IdempotencyKeyReusedError`. A key lives as long as
  its job. The hash covers the request's numbers (`_identity_json`), not the form params are stored in, so a retry
  across an upgrade that changed that form still gets its job.

The response object follows the OpenAI Videos API (`VideoJob.to_openai`; see NOTES.md "OpenAI Videos API").
"""

from __future__ import annotations

import contextlib
import errno
import hashlib
import json
import logging
import math
import os
import re
import shutil
import sqlite3
import tempfile
import time
import uuid
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import BinaryIO

from vidray.inference.request import STORED_IMAGE, GenerationRequest
from vidray.private_dirs import private_dir

__all__ = [
    "ANONYMOUS_CLIENT",
    "JOB_STATUSES",
    "TERMINAL_STATUSES",
    "IdempotencyKeyReusedError",
    "JobStore",
    "JobStoreUnavailableError",
    "QueueFullError",
    "StorageFullError",
    "StoreOwnedError",
    "claim_store",
    "VideoJob",
    "is_job_id",
    "new_job_id",
]

JOB_STATUSES = ("queued", "in_progress", "completed", "failed")
"""Every status a job can have, in the order a job goes through them (OpenAI Videos API terms)."""

TERMINAL_STATUSES = ("completed", "failed")
"""Statuses a job never leaves (except by deletion)."""

_SCHEMA_VERSION = 3
ANONYMOUS_CLIENT = "anonymous"
"""The client of every job when auth is disabled (all requests are one client)."""
_JOB_ID_RE = re.compile(r"video_[0-9a-f]{32}")
_SUFFIX_RE = re.compile(r"\.[A-Za-z0-9]{1,8}")
_BUSY_TIMEOUT_S = 30.0
_MAX_LIST_LIMIT = 100

_SCHEMA = """
CREATE TABLE IF NOT EXISTS jobs (
    seq             INTEGER PRIMARY KEY AUTOINCREMENT,
    id              TEXT    NOT NULL UNIQUE,
    created_at      INTEGER NOT NULL,
    status          TEXT    NOT NULL,
    progress        INTEGER NOT NULL,
    model           TEXT    NOT NULL,
    prompt          TEXT    NOT NULL,
    size            TEXT    NOT NULL,
    seconds         TEXT    NOT NULL,
    params          TEXT    NOT NULL,
    attempts        INTEGER NOT NULL,
    owner           TEXT,
    lease_until     REAL,
    completed_at    INTEGER,
    error           TEXT,
    input_reference TEXT
);
CREATE INDEX IF NOT EXISTS jobs_status_order ON jobs (status, created_at, seq);
CREATE INDEX IF NOT EXISTS jobs_order ON jobs (created_at, seq);
"""

_SCHEMA_V2 = """
ALTER TABLE jobs ADD COLUMN client TEXT NOT NULL DEFAULT 'anonymous';
ALTER TABLE jobs ADD COLUMN expires_at INTEGER;
CREATE INDEX IF NOT EXISTS jobs_client_status ON jobs (client, status);
CREATE INDEX IF NOT EXISTS jobs_expiry ON jobs (expires_at);
CREATE TABLE IF NOT EXISTS clients (
    client      TEXT PRIMARY KEY,
    last_claim  INTEGER NOT NULL
);
"""
"""Version 1 -> 2: the client (a hash of its bearer token) of each job, its expiry, and each client's turn in
round-robin claims (`clients.last_claim`: a counter, larger = claimed more recently)."""

_SCHEMA_V3 = """
ALTER TABLE jobs ADD COLUMN bytes INTEGER NOT NULL DEFAULT 0;
CREATE INDEX IF NOT EXISTS jobs_client_order ON jobs (client, created_at, seq);
CREATE TABLE IF NOT EXISTS idempotency_keys (
    client          TEXT    NOT NULL,
    key             TEXT    NOT NULL,
    request_sha256  TEXT    NOT NULL,
    job_id          TEXT    NOT NULL,
    created_at      INTEGER NOT NULL,
    PRIMARY KEY (client, key)
);
CREATE INDEX IF NOT EXISTS idempotency_keys_job ON idempotency_keys (job_id);
"""
"""Version 2 -> 3 (issue 44): the bytes each job's files hold (quotas), the per-client list index, and the
idempotency keys of creates."""

OWNER_FILE = "owner.json"
"""The file in a store's root naming the Serve app that owns it (`claim_store`)."""

MAX_IDEMPOTENCY_KEY_CHARS = 255
"""Longest accepted idempotency key (Stripe's limit), in characters; printable ASCII only."""

_COLUMNS = (
    "id, created_at, status, progress, model, prompt, size, seconds, params, attempts, owner, lease_until, "
    "completed_at, error, input_reference, client, expires_at"
)


class JobStoreUnavailableError(ConnectionError):
    """The head's job-store actor did not answer: its process died mid-call (Ray restarts it), or the head is
    unreachable. Nothing was answered, so the caller may retry (an HTTP route answers 503 with Retry-After)."""


class QueueFullError(Exception):
    """`JobStore.create` refused a job: too many unfinished (queued + in_progress) jobs in total or for its client.

    Attributes:
        scope: ``"total"`` or ``"client"``: which cap was reached.
        limit: the cap, jobs.
        unfinished: how many unfinished jobs that scope holds now.
    """

    def __init__(self, scope: str, limit: int, unfinished: int) -> None:
        who = "the server holds" if scope == "total" else "this client (bearer token) holds"
        super().__init__(f"{who} {unfinished} unfinished (queued or in_progress) videos, the most allowed is "
                         f"{limit}; wait for some to finish (or delete queued ones), then retry")
        self.scope, self.limit, self.unfinished = scope, limit, unfinished


class StorageFullError(Exception):
    """`JobStore.create` refused a job because bytes ran short; nothing was stored.

    Attributes:
        scope: ``"client"`` (this client's files reached its quota: a 4xx, the client frees room by deleting its
            videos), ``"store"`` (all clients' files reached the store's quota) or ``"disk"`` (the disk under the
            store has less free space than the floor): the last two are the server's (507).
        limit_bytes: the quota (client, store) or the free-space floor (disk), bytes.
        used_bytes: the bytes that scope's files hold now (client, store), or the bytes free on the disk (disk).
    """

    def __init__(self, scope: str, limit_bytes: int, used_bytes: int) -> None:
        used, limit = _bytes_text(used_bytes), _bytes_text(limit_bytes)
        if scope == "client":
            message = (f"this client (bearer token) stores {used} of videos and images, its quota is {limit} "
                       "(limits.max_stored_bytes_per_token); delete videos it no longer needs (DELETE "
                       "/v1/videos/{id}), then retry")
        elif scope == "store":
            message = (f"the server's video store holds {used}, its quota is {limit} (limits.max_stored_bytes); "
                       "retry later, and tell its operator")
        else:
            message = (f"the server's disk has {used} free, below the {limit} it keeps free "
                       "(limits.min_free_bytes); retry later, and tell its operator")
        super().__init__(message)
        self.scope, self.limit_bytes, self.used_bytes = scope, limit_bytes, used_bytes


class IdempotencyKeyReusedError(Exception):
    """`JobStore.create` was given an idempotency key its client already used for a different request (another
    prompt, size, parameter or image); nothing was stored. Attributes: ``job_id``, the job the key made."""

    def __init__(self, key: str, job_id: str) -> None:
        super().__init__(f"Idempotency-Key {key!r} was already used by this client for a different request (it made "
                         f"video {job_id!r}); send a new key for a new request, or resend the first request "
                         "unchanged to get that video")
        self.key, self.job_id = key, job_id


class StoreOwnedError(ValueError):
    """A store folder belongs to another Serve app (`claim_store`). One line naming the folder, both apps and the
    fix."""


def claim_store(root: str | Path, app: str) -> None:
    """Make Serve app `app` the owner of the store folder `root`, or check that it already is.

    The first app to open a folder writes ``root/owner.json`` (``{"app": ..., "claimed_at": unix s}``) atomically:
    a temp file hard-linked to the final name, so two apps starting at once cannot both win. Two apps on one store
    would take and render each other's jobs; a redeploy of the same app (same name) passes.

    Raises:
        StoreOwnedError: the folder belongs to another app; the message names the folder, its owner and the fix
            (give each app its own ``store_dir``, or remove the owner file once that app is gone).
        ValueError: `app` is empty, or the owner file is not what this function writes.
        OSError: the folder cannot be written.
    """
    _check_str("app", app)
    root = Path(root)
    root.mkdir(parents=True, exist_ok=True)
    owner_file = root / OWNER_FILE
    tmp = root / f".{OWNER_FILE}.{uuid.uuid4().hex}.tmp"
    tmp.write_text(json.dumps({"app": app, "claimed_at": int(time.time())}) + "\n")
    try:
        os.link(tmp, owner_file)  # atomic and exclusive: fails if an owner file exists
        return
    except FileExistsError:
        pass
    finally:
        tmp.unlink(missing_ok=True)
    try:
        owner = json.loads(owner_file.read_text())["app"]
    except (ValueError, KeyError, TypeError) as exc:
        raise ValueError(f"store_dir {root}: {owner_file} is not a vidray owner file ({exc}); remove it") from None
    if owner != app:
        raise StoreOwnedError(
            f"store_dir {root} belongs to Serve app {owner!r} ({owner_file}), not to app {app!r}: give each app its "
            f"own store_dir, or remove {owner_file} once app {owner!r} is gone to hand its jobs over"
        )


def new_job_id() -> str:
    """A fresh job id: ``"video_"`` + 32 lowercase hex digits (uuid4)."""
    return "video_" + uuid.uuid4().hex


def is_job_id(value: object) -> bool:
    """True if `value` has the form of a job id made by `new_job_id` (so it is safe inside a file name)."""
    return isinstance(value, str) and _JOB_ID_RE.fullmatch(value) is not None


@dataclass(frozen=True)
class VideoJob:
    """One video generation job, as stored (a snapshot: later changes need another `JobStore.get`)."""

    id: str
    """``"video_"`` + uuid4 hex."""
    created_at: int
    """Unix time of `JobStore.create`, seconds."""
    status: str
    """One of `JOB_STATUSES`."""
    progress: int
    """Percent done, 0..100; never goes down within one attempt, back to 0 when the job is re-queued."""
    model: str
    prompt: str
    size: str
    """``"WxH"`` in pixels, e.g. ``"64x64"``."""
    seconds: str
    """Clip length as the OpenAI API gives it, a decimal string, e.g. ``"1.125"``."""
    params: dict
    """Generation parameters (JSON): a `GenerationRequest.to_dict()` (the serve plane's jobs; `request` reads it
    back, as it reads the bare numbers jobs stored before that type: num_frames, width, height, seed,
    num_inference_steps, guidance_scale, negative_prompt, fps), plus the `input_reference` note."""
    attempts: int
    """How many times a runner claimed the job."""
    owner: str | None
    """The runner id holding the job while ``in_progress`` (kept after it finishes, for the record)."""
    lease_until: float | None
    """Unix time, seconds, after which an ``in_progress`` job counts as lost; None when not ``in_progress``."""
    completed_at: int | None
    """Unix time, seconds, when the job became ``completed`` or ``failed``; None before."""
    error: dict | None
    """``{"code": str, "message": str}`` for a ``failed`` job (and the last retried failure of a re-queued
    one); None otherwise."""
    input_reference: str | None
    """Path of the stored first-frame image, or None for text-to-video."""
    client: str = ANONYMOUS_CLIENT
    """Who asked for the job: a short hash of its bearer token (never the token), `ANONYMOUS_CLIENT` without auth."""
    expires_at: int | None = None
    """Unix time, seconds, after which a finished job and its files are removed (`JobStore.sweep_expired`); None
    while unfinished or when the store keeps jobs forever."""

    @property
    def request(self) -> GenerationRequest:
        """The job's `GenerationRequest`, read from `params` (`GenerationRequest.from_dict`); a record of before
        that type (no `version`) gets its prompt from `prompt` and its image from `input_reference`. Raises
        ValueError (`GenerationRequestError`) for params that are no valid request."""
        if "version" in self.params:
            return GenerationRequest.from_dict(self.params)
        return GenerationRequest.from_dict(self.params, prompt=self.prompt,
                                           image=None if self.input_reference is None else STORED_IMAGE)

    def to_openai(self) -> dict:
        """The OpenAI Videos API ``video`` object: exactly the keys ``id, object, created_at, status, progress,
        model, seconds, size, prompt, completed_at, expires_at, error, remixed_from_video_id``.

        ``error`` is shown only on a ``failed`` job (a re-queued job keeps its last error internally)."""
        return {
            "id": self.id,
            "object": "video",
            "created_at": self.created_at,
            "status": self.status,
            "progress": self.progress,
            "model": self.model,
            "seconds": self.seconds,
            "size": self.size,
            "prompt": self.prompt,
            "completed_at": self.completed_at,
            "expires_at": self.expires_at,
            "error": dict(self.error) if (self.error is not None and self.status == "failed") else None,
            "remixed_from_video_id": None,
        }


def _row_to_job(row: tuple) -> VideoJob:
    (id_, created_at, status, progress, model, prompt, size, seconds, params, attempts, owner, lease_until,
     completed_at, error, input_reference, client, expires_at) = row
    return VideoJob(
        id=id_,
        created_at=int(created_at),
        status=status,
        progress=int(progress),
        model=model,
        prompt=prompt,
        size=size,
        seconds=seconds,
        params=json.loads(params),
        attempts=int(attempts),
        owner=owner,
        lease_until=lease_until,
        completed_at=completed_at,
        error=json.loads(error) if error is not None else None,
        input_reference=input_reference,
        client=client,
        expires_at=expires_at,
    )


def _check_str(name: str, value: object, *, allow_empty: bool = False) -> str:
    if not isinstance(value, str):
        raise TypeError(f"{name} must be a str, got {type(value).__name__}")
    if not allow_empty and not value:
        raise ValueError(f"{name} must be a non-empty string")
    return value


def _check_positive(name: str, value: object) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value) or value <= 0:
        raise ValueError(f"{name} must be a finite number of seconds > 0, got {value!r}")
    return float(value)


def _check_lease(lease_s: object) -> float:
    return _check_positive("lease_s", lease_s)


def _check_cap(name: str, value: object) -> int | None:
    if value is not None and (isinstance(value, bool) or not isinstance(value, int) or value < 1):
        raise ValueError(f"{name} must be None (no cap) or an int >= 1, got {value!r}")
    return value


def _check_progress(progress: object) -> int:
    if isinstance(progress, bool) or not isinstance(progress, int) or not 0 <= progress <= 100:
        raise ValueError(f"progress must be an int percentage in 0..100, got {progress!r}")
    return progress


class JobStore:
    """The video-job table and its files under one root folder, shared safely by threads and processes.

    Each method opens its own sqlite connection, so one `JobStore` may be used from many threads, and many
    `JobStore` objects (in many processes on one host) may open the same root at once. Needs a local
    filesystem: sqlite's WAL mode does not work over network filesystems (NFS), so give each host its own
    root or use a server database.

    Args:
        root: the store's folder; created (with ``videos/`` and ``inputs/``) if missing.
        max_attempts: how many times a job is claimed before a lost or released job is marked ``failed``
            (2 = one retry). Must be >= 1.
        retention_s: seconds a finished (completed or failed) job is kept after it finished, then removed with
            its files by `sweep_expired`; None keeps jobs until deleted.
        app: the Serve app opening the store: it must own the folder (`claim_store`: the first app to open it
            does); None skips the check (tests, tools).

    Raises:
        StoreOwnedError: `root` belongs to another app than `app`.
        ValueError: `max_attempts` < 1, `retention_s` not a number > 0, or ``jobs.sqlite3`` was written by a newer
            schema version.
        sqlite3.DatabaseError: ``jobs.sqlite3`` exists but is not a sqlite database.
    """

    def __init__(self, root: str | Path, *, max_attempts: int = 2, retention_s: float | None = None,
                 app: str | None = None) -> None:
        if isinstance(max_attempts, bool) or not isinstance(max_attempts, int) or max_attempts < 1:
            raise ValueError(f"max_attempts must be an int >= 1 (2 = one retry), got {max_attempts!r}")
        if retention_s is not None:
            retention_s = _check_positive("retention_s", retention_s)
        self.root = Path(root)
        self.max_attempts = max_attempts
        self.retention_s = retention_s
        self.db_path = self.root / "jobs.sqlite3"
        self.videos_dir = self.root / "videos"
        self.inputs_dir = self.root / "inputs"
        self.tmp_dir = self.root / "tmp"
        self._short_warned_at = -math.inf  # monotonic s of the last "disk short" warning of `claim`
        for folder in (self.root, self.videos_dir, self.inputs_dir, self.tmp_dir):
            folder.mkdir(parents=True, exist_ok=True)
        if app is not None:
            claim_store(self.root, app)
        self._init_db()

    def __repr__(self) -> str:
        return f"JobStore(root={str(self.root)!r}, max_attempts={self.max_attempts})"

    # ------------------------------------------------------------------ connections

    @contextlib.contextmanager
    def _connect(self) -> Iterator[sqlite3.Connection]:
        """A fresh autocommit connection (transactions are explicit), closed on exit."""
        conn = sqlite3.connect(self.db_path, timeout=_BUSY_TIMEOUT_S, isolation_level=None)
        try:
            yield conn
        finally:
            conn.close()

    @contextlib.contextmanager
    def _write(self) -> Iterator[sqlite3.Connection]:
        """A ``BEGIN IMMEDIATE`` transaction: takes the write lock up front (waiting up to 30 s for it), so a
        read-then-write never fails half-way with "database is locked"; commits on success, rolls back on error."""
        with self._connect() as conn:
            conn.execute("BEGIN IMMEDIATE")
            try:
                yield conn
            except BaseException:
                conn.execute("ROLLBACK")
                raise
            conn.execute("COMMIT")

    def _init_db(self) -> None:
        with self._connect() as conn:
            # Switching to WAL needs a moment alone with the file; the busy timeout covers other processes opening
            # it at the same time. The mode is stored in the file, so later connections get it for free.
            mode = conn.execute("PRAGMA journal_mode=WAL").fetchone()[0]
            if str(mode).lower() != "wal":
                raise RuntimeError(
                    f"could not put {self.db_path} in WAL mode (got {mode!r}); the job store needs a local "
                    "filesystem (not NFS) that supports shared memory"
                )
        with self._write() as conn:
            version = conn.execute("PRAGMA user_version").fetchone()[0]
            if version == 0:
                for statement in filter(str.strip, _SCHEMA.split(";")):
                    conn.execute(statement)
            if version in (0, 1):  # a version-1 store gains its columns in place: its jobs stay
                for statement in filter(str.strip, _SCHEMA_V2.split(";")):
                    conn.execute(statement)
            if version in (0, 1, 2):  # version 3: each job's bytes, counted from the files it has now
                for statement in filter(str.strip, _SCHEMA_V3.split(";")):
                    conn.execute(statement)
                for job_id, input_reference in conn.execute("SELECT id, input_reference FROM jobs").fetchall():
                    size = _file_bytes(self.videos_dir / f"{job_id}.mp4")
                    size += 0 if input_reference is None else _file_bytes(Path(input_reference))
                    conn.execute("UPDATE jobs SET bytes = ? WHERE id = ?", (size, job_id))
                conn.execute(f"PRAGMA user_version = {_SCHEMA_VERSION}")
            elif version != _SCHEMA_VERSION:
                raise ValueError(
                    f"{self.db_path} has job-store schema version {version}, this vidray reads version "
                    f"{_SCHEMA_VERSION}; point the store at a new root folder or upgrade vidray"
                )

    # ------------------------------------------------------------------ records

    def create(
        self,
        *,
        model: str,
        prompt: str,
        size: str,
        seconds: str,
        params: dict,
        input_reference: bytes | None = None,
        input_suffix: str = ".png",
        client: str = ANONYMOUS_CLIENT,
        max_unfinished: int | None = None,
        max_unfinished_per_client: int | None = None,
        idempotency_key: str | None = None,
        max_client_bytes: int | None = None,
        max_store_bytes: int | None = None,
        min_free_bytes: int | None = None,
    ) -> VideoJob:
        """Store a new job, ``queued`` with progress 0, and its first-frame image if given; or, for an
        idempotency key this client used before with the same request, return the job that key made.

        The fields are stored as given: the ingress validates them (size, frame count, prompt length, image)
        before calling this.

        Args:
            model, prompt, size, seconds: as in the OpenAI request (``size`` ``"WxH"``, ``seconds`` a decimal
                string).
            params: JSON-serializable generation parameters (num_frames, seed, ...); stored as a copy.
            input_reference: the first-frame image file's bytes, written to ``inputs/<id><input_suffix>``.
            input_suffix: the image file's extension with its dot, e.g. ``".png"``, ``".jpg"``.
            client: who asks (a short hash of the bearer token; `ANONYMOUS_CLIENT` without auth).
            max_unfinished, max_unfinished_per_client: caps on unfinished (queued + in_progress) jobs in the store
                and of `client`, checked atomically with the insert; None = no cap.
            idempotency_key: the client's key for this request (`check_idempotency_key`'s rule), recorded in the
                transaction that inserts the job; None: every call makes a job.
            max_client_bytes, max_store_bytes: quotas on the bytes of `client`'s files and of all files (input
                images + mp4s), checked atomically with the insert; None = no quota.
            min_free_bytes: refuse when the disk under the store has less free space than this; None = no check.

        Returns:
            The new job (or the job the same key and request made before, in its current state).

        Raises:
            QueueFullError: a cap on unfinished jobs is reached (nothing is stored).
            StorageFullError: a byte quota is reached or the disk is short (nothing is stored).
            IdempotencyKeyReusedError: `idempotency_key` made another request's job (nothing is stored).
            TypeError: a field has the wrong type (model, prompt, size, seconds must be str; params a dict;
                input_reference bytes).
            ValueError: params is not JSON-serializable, input_suffix is not a dot and 1-8 letters/digits, or
                idempotency_key breaks its rule.
        """
        for name, value in (("model", model), ("size", size), ("seconds", seconds), ("client", client)):
            _check_str(name, value)
        _check_cap("max_unfinished", max_unfinished)
        _check_cap("max_unfinished_per_client", max_unfinished_per_client)
        for name, value in (("max_client_bytes", max_client_bytes), ("max_store_bytes", max_store_bytes),
                            ("min_free_bytes", min_free_bytes)):
            _check_cap(name, value)
        if idempotency_key is not None:
            check_idempotency_key(idempotency_key)
        _check_str("prompt", prompt, allow_empty=True)
        if not isinstance(params, dict):
            raise TypeError(f"params must be a dict of generation parameters, got {type(params).__name__}")
        try:
            params_json = json.dumps(params, sort_keys=True, allow_nan=False)
        except (TypeError, ValueError) as exc:
            raise ValueError(f"params must be JSON-serializable (str keys, finite numbers): {exc}") from exc
        if input_reference is not None and not isinstance(input_reference, (bytes, bytearray, memoryview)):
            raise TypeError(f"input_reference must be the image file's bytes, got {type(input_reference).__name__}")
        if not isinstance(input_suffix, str) or _SUFFIX_RE.fullmatch(input_suffix) is None:
            raise ValueError(f"input_suffix must be a dot and 1-8 letters or digits like '.png', got {input_suffix!r}")
        image = None if input_reference is None else bytes(input_reference)
        request_sha256 = _request_sha256(model, prompt, size, seconds, _identity_json(params), image)
        # What a store of before the identity hash recorded for this request (the stored params' JSON).
        stored_form_sha256 = _request_sha256(model, prompt, size, seconds, params_json, image)

        job_id = new_job_id()
        input_path: Path | None = None
        if image is not None:
            if min_free_bytes is not None and free_bytes(self.root) < min_free_bytes:  # before writing the image
                raise StorageFullError("disk", min_free_bytes, free_bytes(self.root))
            # 1. The image first (temp file + rename), so a row never names a half-written file.
            input_path = self.inputs_dir / f"{job_id}{input_suffix.lower()}"
            tmp = input_path.with_name(f".{input_path.name}.{uuid.uuid4().hex}.tmp")
            try:
                tmp.write_bytes(image)
                os.replace(tmp, input_path)
            finally:
                tmp.unlink(missing_ok=True)
        # 2. Then the row, with its key, in one transaction; if it is not written, the image goes too.
        created_at = int(time.time())
        existing: tuple | None = None
        try:
            with self._write() as conn:
                if idempotency_key is not None:
                    row = conn.execute(
                        "SELECT request_sha256, job_id FROM idempotency_keys WHERE client = ? AND key = ?",
                        (client, idempotency_key),
                    ).fetchone()
                    if row is not None and row[0] not in (request_sha256, stored_form_sha256):
                        raise IdempotencyKeyReusedError(idempotency_key, row[1])
                    if row is not None:  # read in this transaction: `delete` removes a job and its key together
                        existing = conn.execute(f"SELECT {_COLUMNS} FROM jobs WHERE id = ?", (row[1],)).fetchone()
                if existing is None:
                    _check_room(conn, client, max_unfinished, max_unfinished_per_client)
                    _check_bytes(conn, self.root, client, max_client_bytes=max_client_bytes,
                                 max_store_bytes=max_store_bytes, min_free_bytes=min_free_bytes)
                    conn.execute(
                        f"INSERT INTO jobs ({_COLUMNS}, bytes) VALUES (?, ?, 'queued', 0, ?, ?, ?, ?, ?, 0, NULL, "
                        "NULL, NULL, NULL, ?, ?, NULL, ?)",
                        (job_id, created_at, model, prompt, size, seconds, params_json,
                         str(input_path) if input_path is not None else None, client,
                         0 if image is None else len(image)),
                    )
                    if idempotency_key is not None:
                        conn.execute(
                            "INSERT INTO idempotency_keys (client, key, request_sha256, job_id, created_at) "
                            "VALUES (?, ?, ?, ?, ?)",
                            (client, idempotency_key, request_sha256, job_id, created_at),
                        )
        except BaseException:
            if input_path is not None:
                input_path.unlink(missing_ok=True)
            raise
        if existing is not None:  # a repeat of a create that was stored: its job, and no second image
            if input_path is not None:
                input_path.unlink(missing_ok=True)
            return _row_to_job(existing)
        job = self.get(job_id)
        if job is None:  # deleted between our insert and this read: hand back what was stored
            job = VideoJob(
                id=job_id, created_at=created_at, status="queued", progress=0, model=model, prompt=prompt,
                size=size, seconds=seconds, params=json.loads(params_json), attempts=0, owner=None,
                lease_until=None, completed_at=None, error=None,
                input_reference=str(input_path) if input_path is not None else None, client=client,
            )
        return job

    def get(self, job_id: str, *, client: str | None = None) -> VideoJob | None:
        """The job with this id, or None if there is none (also for a string that is not a job id, and for
        another client's job when `client` is given: None sees every client's)."""
        if not is_job_id(job_id):
            return None
        with self._connect() as conn:
            and_client, scope = _client_filter(client)
            row = conn.execute(f"SELECT {_COLUMNS} FROM jobs WHERE id = ?{and_client}", (job_id, *scope)).fetchone()
        return _row_to_job(row) if row is not None else None

    def list(
        self, *, after: str | None = None, limit: int = 20, order: str = "desc", client: str | None = None
    ) -> tuple[list[VideoJob], bool]:
        """One page of jobs in creation order (ties broken by insertion order), as ``GET /v1/videos`` pages.

        Args:
            after: the id of the last job of the previous page (the cursor); None for the first page.
            limit: page size, 1..100.
            order: ``"desc"`` (newest first) or ``"asc"`` (oldest first).
            client: only this client's jobs (read through the ``jobs_client_order`` index; another client's id
                as `after` is unknown); None: every client's.

        Returns:
            ``(page, has_more)``: up to `limit` jobs, and whether more follow the page.

        Raises:
            ValueError: limit outside 1..100, order not asc/desc.
            LookupError: `after` is not the id of a stored job (of `client`) (the message says to start again from
                the first page; the HTTP layer answers it with a 400 naming `after`).
        """
        if isinstance(limit, bool) or not isinstance(limit, int) or not 1 <= limit <= _MAX_LIST_LIMIT:
            raise ValueError(f"limit must be an int in 1..{_MAX_LIST_LIMIT}, got {limit!r}")
        if order == "desc":
            cmp, direction = "<", "DESC"
        elif order == "asc":
            cmp, direction = ">", "ASC"
        else:
            raise ValueError(f"order must be 'asc' or 'desc', got {order!r}")
        with self._connect() as conn:
            # One read transaction, so the cursor lookup and the page see the same snapshot.
            conn.execute("BEGIN")
            try:
                and_client, scope = _client_filter(client)
                where = "WHERE client = ?" if client is not None else ""
                if after is None:
                    rows = conn.execute(
                        f"SELECT {_COLUMNS} FROM jobs {where} ORDER BY created_at {direction}, seq {direction} "
                        "LIMIT ?",
                        (*scope, limit + 1),
                    ).fetchall()
                else:
                    cursor = conn.execute(
                        f"SELECT created_at, seq FROM jobs WHERE id = ?{and_client}",
                        (after, *scope),
                    ).fetchone() if is_job_id(after) else None
                    if cursor is None:
                        raise LookupError(
                            f"after={after!r} is not the id of a stored video (deleted, or never existed); "
                            "list again without 'after' to start from the first page"
                        )
                    rows = conn.execute(
                        f"SELECT {_COLUMNS} FROM jobs WHERE (created_at, seq) {cmp} (?, ?) "
                        f"{and_client} ORDER BY created_at {direction}, seq {direction} LIMIT ?",
                        (cursor[0], cursor[1], *scope, limit + 1),
                    ).fetchall()
            finally:
                conn.execute("COMMIT")
        page = [_row_to_job(row) for row in rows[:limit]]
        return page, len(rows) > limit

    def counts(self, *, client: str | None = None) -> dict[str, int]:
        """How many jobs are in each status: ``{status: count}`` with every status of `JOB_STATUSES`; only
        `client`'s jobs when given."""
        with self._connect() as conn:
            if client is not None:
                rows = conn.execute("SELECT status, COUNT(*) FROM jobs WHERE client = ? GROUP BY status",
                                    (client,)).fetchall()
            else:
                rows = conn.execute("SELECT status, COUNT(*) FROM jobs GROUP BY status").fetchall()
        counts = dict.fromkeys(JOB_STATUSES, 0)
        counts.update({status: int(n) for status, n in rows})
        return counts

    def delete(self, job_id: str, *, client: str | None = None) -> bool:
        """Remove a job's record, its idempotency key, its video and its input image, whatever its status.

        A runner working on the job then gets False from `heartbeat` (and `complete`, `fail`) and should stop.

        Args:
            client: only a job of this client is removed (another client's is answered as unknown); None: any.

        Returns:
            True if the job existed (and was `client`'s).
        """
        if not is_job_id(job_id):
            return False
        with self._write() as conn:
            and_client, scope = _client_filter(client)
            row = conn.execute(f"SELECT input_reference FROM jobs WHERE id = ?{and_client}",
                               (job_id, *scope)).fetchone()
            if row is None:
                return False
            conn.execute("DELETE FROM jobs WHERE id = ?", (job_id,))
            conn.execute("DELETE FROM idempotency_keys WHERE job_id = ?", (job_id,))
        # After the commit: `complete` moves a video in only while the row exists, under the write lock, so no
        # video can appear for this id from now on.
        self._remove_files(job_id, row[0])
        return True

    def _remove_files(self, job_id: str, input_reference: str | None) -> None:
        (self.videos_dir / f"{job_id}.mp4").unlink(missing_ok=True)
        if input_reference is not None:
            Path(input_reference).unlink(missing_ok=True)

    def sweep_expired(self, *, now: float | None = None) -> list[str]:
        """Remove every finished job whose ``expires_at`` is before `now`, with its video and input image
        (`retention_s`); afterwards it is a 404 like a deleted job.

        Args:
            now: unix time, seconds; default the current time (tests pass a later one).

        Returns:
            The ids removed.
        """
        now = time.time() if now is None else float(now)
        with self._write() as conn:
            rows = conn.execute(
                "SELECT id, input_reference FROM jobs WHERE expires_at IS NOT NULL AND expires_at < ?", (now,)
            ).fetchall()
            conn.executemany("DELETE FROM jobs WHERE id = ?", [(job_id,) for job_id, _ in rows])
            conn.executemany("DELETE FROM idempotency_keys WHERE job_id = ?", [(job_id,) for job_id, _ in rows])
        for job_id, input_reference in rows:
            self._remove_files(job_id, input_reference)
        return [job_id for job_id, _ in rows]

    # ------------------------------------------------------------------ the runner's side

    def claim(self, owner: str, lease_s: float, *, min_free_bytes: int | None = None) -> VideoJob | None:
        """Take the next ``queued`` job for `owner`: it becomes ``in_progress``, attempts + 1, leased until
        now + `lease_s` seconds. Exclusive across threads and processes: no two callers get the same job.

        Fair between clients: the next job is the oldest queued job of the client whose last claim is the longest
        ago (never claimed counts as longest), so clients' queues take turns (round-robin) and one client's burst
        does not starve the others; within one client, first in first out.

        Pass a fresh `owner` to each claim (the runner's id plus a claim counter): a runner that stalled past its
        lease and then claims the same job again must not be able to act on the new attempt with its old one.

        The runner renews the lease with `heartbeat` well within `lease_s`; a job whose lease ran out is
        handed back by `recover_expired`.

        Args:
            min_free_bytes: hand out no job while the disk under the store has less free space than this (its mp4
                could not be stored): the jobs stay queued; a warning is logged at most once a minute. None: no
                check.

        Returns:
            The claimed job, or None if no job is queued (or the disk is short).

        Raises:
            ValueError: owner empty, or lease_s not a finite number > 0.
        """
        _check_str("owner", owner)
        lease_s = _check_lease(lease_s)
        _check_cap("min_free_bytes", min_free_bytes)
        if min_free_bytes is not None and (free := free_bytes(self.root)) < min_free_bytes:
            now = time.monotonic()
            if now - self._short_warned_at >= 60.0:
                self._short_warned_at = now
                logging.getLogger(__name__).warning(
                    "job store %s: %s free on its disk, below limits.min_free_bytes (%s): no job is started until "
                    "space is freed (queued jobs wait)", self.root, _bytes_text(free), _bytes_text(min_free_bytes))
            return None
        with self._write() as conn:
            row = conn.execute(
                "SELECT j.id, j.client FROM jobs AS j LEFT JOIN clients AS c ON c.client = j.client "
                "WHERE j.status = 'queued' ORDER BY COALESCE(c.last_claim, -1), j.created_at, j.seq LIMIT 1"
            ).fetchone()
            if row is None:
                return None
            conn.execute(
                "INSERT INTO clients (client, last_claim) VALUES (?, (SELECT COALESCE(MAX(last_claim), 0) + 1 "
                "FROM clients)) ON CONFLICT (client) DO UPDATE SET last_claim = excluded.last_claim",
                (row[1],),
            )
            conn.execute(
                "UPDATE jobs SET status = 'in_progress', progress = 0, attempts = attempts + 1, owner = ?, "
                "lease_until = ? WHERE id = ? AND status = 'queued'",
                (owner, time.time() + lease_s, row[0]),
            )
            claimed = conn.execute(f"SELECT {_COLUMNS} FROM jobs WHERE id = ?", (row[0],)).fetchone()
        return _row_to_job(claimed)

    def heartbeat(self, job_id: str, owner: str, *, progress: int, lease_s: float) -> bool:
        """Renew `owner`'s lease on a running job (until now + `lease_s` s) and report its progress.

        Progress never goes down: a smaller value than the stored one keeps the stored one.

        Returns:
            True if `owner` still holds the job; False if it was deleted, its lease ran out (even if no one has
            handed it back yet), it was re-claimed, or is no longer ``in_progress``: the runner should then stop
            work on it.

        Raises:
            ValueError: progress not an int in 0..100, or lease_s not a finite number > 0.
        """
        _check_progress(progress)
        lease_s = _check_lease(lease_s)
        with self._write() as conn:
            now = time.time()
            cur = conn.execute(
                "UPDATE jobs SET progress = MAX(progress, ?), lease_until = ? "
                "WHERE id = ? AND owner = ? AND status = 'in_progress' AND lease_until >= ?",
                (progress, now + lease_s, job_id, owner, now),
            )
            return cur.rowcount == 1

    def complete(self, job_id: str, owner: str, video_file: str | Path) -> bool:
        """Finish `owner`'s job: move `video_file` to ``videos/<id>.mp4`` (atomically, `os.replace`; copied
        first when it lies on another filesystem), progress 100, ``completed_at`` now.

        Returns:
            True if done. False if `owner` no longer holds the job (deleted, its lease ran out, re-claimed,
            finished): then nothing changes and `video_file` stays where it is, for the caller to remove.

        Raises:
            FileNotFoundError: video_file does not exist (the job is left unchanged).
        """
        video_file = Path(video_file)
        if not video_file.is_file():
            raise FileNotFoundError(f"video_file {video_file} does not exist; write the mp4 before complete()")
        target = self.videos_dir / f"{job_id}.mp4"
        with self._write() as conn:
            row = conn.execute(
                "SELECT 1 FROM jobs WHERE id = ? AND owner = ? AND status = 'in_progress' AND lease_until >= ?",
                (job_id, owner, time.time()),
            ).fetchone()
            if row is None:
                return False
            # The move happens under the write lock, so `delete` cannot slip in between it and the update.
            _move_file(video_file, target)
            try:
                now = int(time.time())
                conn.execute(
                    "UPDATE jobs SET status = 'completed', progress = 100, completed_at = ?, expires_at = ?, "
                    "lease_until = NULL, error = NULL, bytes = bytes + ? WHERE id = ?",
                    (now, self._expiry(now), _file_bytes(target), job_id),
                )
            except BaseException:
                with contextlib.suppress(OSError):
                    _move_file(target, video_file)
                raise
        return True

    def fail(self, job_id: str, owner: str, code: str, message: str) -> bool:
        """Mark `owner`'s job ``failed`` for good with ``error = {code, message}`` (no retry), e.g. when the
        request itself cannot be rendered.

        Returns:
            True if done; False if `owner` no longer holds the job (nothing changes).

        Raises:
            ValueError: code or message empty.
        """
        error = _error_json(code, message)
        now = int(time.time())
        with self._write() as conn:
            cur = conn.execute(
                "UPDATE jobs SET status = 'failed', completed_at = ?, expires_at = ?, lease_until = NULL, error = ? "
                "WHERE id = ? AND owner = ? AND status = 'in_progress'",
                (now, self._expiry(now), error, job_id, owner),
            )
            return cur.rowcount == 1

    def release(self, job_id: str, owner: str, *, code: str, message: str) -> str | None:
        """Hand back `owner`'s job after a stage died under it: ``queued`` again (progress 0, no owner) while
        attempts < max_attempts, else ``failed`` with ``error = {code, message}``.

        Returns:
            The job's new status (``"queued"`` or ``"failed"``), or None if `owner` no longer holds the job
            (deleted, re-claimed, finished): then nothing changes.

        Raises:
            ValueError: code or message empty.
        """
        error = _error_json(code, message)
        with self._write() as conn:
            row = conn.execute(
                "SELECT attempts FROM jobs WHERE id = ? AND owner = ? AND status = 'in_progress'", (job_id, owner)
            ).fetchone()
            if row is None:
                return None
            return self._hand_back(conn, job_id, attempts=int(row[0]), error=error)

    def requeue(self, job_id: str, owner: str) -> bool:
        """Hand back `owner`'s running job without counting its attempt: ``queued`` again (progress 0, no owner,
        attempts - 1). For a runner that stops in good order (its replica scaled down, redeployed or shut down by
        `serve run`'s Ctrl-C) and did not fail the job: another runner claims it at once, with all its attempts.

        Returns:
            True if the job was handed back; False if `owner` no longer holds it (deleted, re-claimed, finished).
        """
        _check_str("owner", owner)
        with self._write() as conn:
            cur = conn.execute(
                "UPDATE jobs SET status = 'queued', progress = 0, owner = NULL, lease_until = NULL, "
                "attempts = MAX(attempts - 1, 0) WHERE id = ? AND owner = ? AND status = 'in_progress'",
                (job_id, owner),
            )
            return cur.rowcount == 1

    def recover_expired(self, *, now: float | None = None) -> list[tuple[str, str]]:
        """Hand back every ``in_progress`` job whose lease ran out before `now` (its runner died or hung), by
        the rule of `release` with code ``runner_lost``.

        Args:
            now: unix time, seconds; default the current time (tests pass a later one).

        Returns:
            ``[(job_id, new_status)]`` for each job handed back, oldest first; new_status is ``"queued"`` or
            ``"failed"``.
        """
        now = time.time() if now is None else float(now)
        recovered: list[tuple[str, str]] = []
        with self._write() as conn:
            rows = conn.execute(
                "SELECT id, attempts, owner, lease_until FROM jobs WHERE status = 'in_progress' AND lease_until < ? "
                "ORDER BY created_at, seq",
                (now,),
            ).fetchall()
            for job_id, attempts, owner, lease_until in rows:
                message = (
                    f"the runner {owner!r} stopped renewing its lease on this job (expired "
                    f"{now - lease_until:.1f} s ago) during attempt {attempts} of {self.max_attempts}"
                )
                error = _error_json("runner_lost", message)
                status = self._hand_back(conn, job_id, attempts=int(attempts), error=error)
                recovered.append((job_id, status))
        return recovered

    def _hand_back(self, conn: sqlite3.Connection, job_id: str, *, attempts: int, error: str) -> str:
        """Inside a write transaction: re-queue the in_progress job, or fail it when its attempts are used up."""
        if attempts < self.max_attempts:
            # The error is kept (not shown while queued) so a later failure's record can tell what happened.
            conn.execute(
                "UPDATE jobs SET status = 'queued', progress = 0, owner = NULL, lease_until = NULL, error = ? "
                "WHERE id = ?",
                (error, job_id),
            )
            return "queued"
        now = int(time.time())
        conn.execute(
            "UPDATE jobs SET status = 'failed', completed_at = ?, expires_at = ?, lease_until = NULL, error = ? "
            "WHERE id = ?",
            (now, self._expiry(now), error, job_id),
        )
        return "failed"

    def _expiry(self, finished_at: int) -> int | None:
        """``expires_at`` of a job finished at `finished_at` (unix s): rounded up, so it is never early."""
        return None if self.retention_s is None else finished_at + math.ceil(self.retention_s)

    # ------------------------------------------------------------------ files

    def video_path(self, job_id: str, *, client: str | None = None) -> Path | None:
        """The finished mp4 of a ``completed`` job (of `client`, when given), or None (not completed, deleted,
        another client's, or its file is gone)."""
        job = self.get(job_id, client=client)
        if job is None or job.status != "completed":
            return None
        path = self.videos_dir / f"{job.id}.mp4"
        return path if path.is_file() else None

    def open_video(self, job_id: str, *, client: str | None = None) -> BinaryIO | None:
        """The finished mp4 of a ``completed`` job (of `client`, when given) opened for reading (a delete after
        this call unlinks the name; the open file still reads to its end), or None (not completed, deleted,
        another client's, or its file is gone)."""
        path = self.video_path(job_id, client=client)
        try:
            return None if path is None else open(path, "rb")  # noqa: SIM115 - the caller closes it
        except FileNotFoundError:
            return None

    def read_input(self, job_id: str) -> bytes | None:
        """The first-frame image (``input_reference``) of job `job_id` as the bytes it was stored with, or None
        (a job without one, deleted, expired, or its file gone)."""
        job = self.get(job_id)
        if job is None or job.input_reference is None:
            return None
        try:
            return Path(job.input_reference).read_bytes()
        except FileNotFoundError:
            return None

    def drop_input(self, job_id: str) -> bool:
        """Delete job `job_id`'s first-frame image file (its record keeps the path, so `read_input` then answers
        None) and take its bytes off the job's count (the byte quotas, `limits.max_stored_bytes*`): the runner
        calls it once the VAE stage no longer needs the image. True if a file was removed."""
        job = self.get(job_id) if is_job_id(job_id) else None
        if job is None or job.input_reference is None:
            return False
        path = Path(job.input_reference)
        with self._write() as conn:  # the count and the file change together
            size = _file_bytes(path)
            try:
                path.unlink()
            except FileNotFoundError:
                return False
            conn.execute("UPDATE jobs SET bytes = MAX(0, bytes - ?) WHERE id = ?", (size, job_id))
        return True

    def temp_video(self) -> Path:
        """A new empty file ``tmp/<random>.mp4`` for a runner to write a video into before `complete` moves it in
        (same filesystem: the move is atomic). The runner removes it if the job ends otherwise; `sweep_temp`
        removes what a dead runner left."""
        return new_temp_mp4(self.tmp_dir)

    def sweep_temp(self, *, older_than_s: float, now: float | None = None) -> list[Path]:
        """Remove the files in ``tmp/`` last modified more than `older_than_s` seconds before `now` (left by
        runners that died or were cancelled mid-write); younger files may belong to a live render and stay.
        Returns the paths removed. Raises ValueError: older_than_s not a finite number > 0."""
        return sweep_old_files(self.tmp_dir, older_than_s=older_than_s, now=now)


def new_temp_mp4(folder: Path) -> Path:
    """A new empty ``<folder>/<random>.mp4`` (mkstemp: O_EXCL, 0600), in a folder made private if missing
    (`vidray.private_dirs.private_dir`: 0700, ours, no symlink; else PrivateDirError)."""
    private_dir(folder)
    fd, name = tempfile.mkstemp(suffix=".mp4", dir=folder)
    os.close(fd)
    return Path(name)


def sweep_old_files(folder: Path, *, older_than_s: float, now: float | None = None) -> list[Path]:
    """Remove the files in `folder` last modified more than `older_than_s` seconds before `now` (default: the
    clock); a missing folder has none. Returns the paths removed. Raises ValueError: older_than_s not a finite
    number > 0."""
    older_than_s = _check_positive("older_than_s", older_than_s)
    cutoff = (time.time() if now is None else float(now)) - older_than_s
    removed: list[Path] = []
    if not folder.is_dir():  # removed by hand: the next temp file makes it again
        return removed
    for entry in os.scandir(folder):
        with contextlib.suppress(FileNotFoundError):  # a runner moved or removed it meanwhile
            if entry.is_file(follow_symlinks=False) and entry.stat(follow_symlinks=False).st_mtime < cutoff:
                os.unlink(entry.path)
                removed.append(Path(entry.path))
    return removed


def _bytes_text(num_bytes: int) -> str:
    """``"512 bytes"`` below 1 MiB, else ``"12.3 MiB"``."""
    return f"{num_bytes} bytes" if num_bytes < 2**20 else f"{num_bytes / 2**20:.1f} MiB"


def _client_filter(client: str | None) -> tuple[str, tuple]:
    """The SQL that keeps one client's rows (`` AND client = ?`` and its parameter), or nothing for None."""
    if client is None:
        return "", ()
    _check_str("client", client)
    return " AND client = ?", (client,)


def _file_bytes(path: Path) -> int:
    """The size of the file at `path` in bytes, 0 when there is none."""
    try:
        return path.stat().st_size
    except FileNotFoundError:
        return 0


def free_bytes(folder: Path) -> int:
    """Bytes free for an unprivileged writer on the filesystem holding `folder` (`shutil.disk_usage`)."""
    return shutil.disk_usage(folder).free


def _check_bytes(conn: sqlite3.Connection, root: Path, client: str, *, max_client_bytes: int | None,
                 max_store_bytes: int | None, min_free_bytes: int | None) -> None:
    """Inside a write transaction: raise StorageFullError when the client's or the store's files reached their
    quota, or the disk under `root` has less than `min_free_bytes` free."""
    if max_client_bytes is not None:
        mine = conn.execute("SELECT COALESCE(SUM(bytes), 0) FROM jobs WHERE client = ?", (client,)).fetchone()[0]
        if mine >= max_client_bytes:
            raise StorageFullError("client", max_client_bytes, int(mine))
    if max_store_bytes is not None:
        total = conn.execute("SELECT COALESCE(SUM(bytes), 0) FROM jobs").fetchone()[0]
        if total >= max_store_bytes:
            raise StorageFullError("store", max_store_bytes, int(total))
    if min_free_bytes is not None:
        free = free_bytes(root)
        if free < min_free_bytes:
            raise StorageFullError("disk", min_free_bytes, free)


_OUTSIDE_IDENTITY = frozenset(("version", "prompt", "image", "family"))
"""Keys of a stored `GenerationRequest.to_dict()` that `_identity_json` leaves out: the record's version, and what
the hash already covers beside params (the prompt, the image's bytes) or follows from the model (its family)."""
_ADDED_AT_DEFAULT = {"last_image": None}
"""Request fields that jobs' params gained after the first stored form (the bare numbers: num_frames, width, height,
seed, num_inference_steps, guidance_scale, negative_prompt, fps), each with its default: left out of the hash at
that default, so a client retrying with the same Idempotency-Key across an upgrade that added it gets its job. A
field added to `GenerationRequest` later goes here too (test_jobstore checks that every field is placed)."""


def _identity_json(params: dict) -> str:
    """The JSON that identifies `params` for the idempotency hash: the generation numbers (and any note beside
    them, such as the `input_reference` record), whatever form the store keeps them in, so the hash of one request
    stays the same across a change of that form (`GenerationRequest.to_dict`'s version, a field added at its
    default). Params that are no versioned request are identified as they are."""
    if "version" in params:
        params = {key: value for key, value in params.items()
                  if key not in _OUTSIDE_IDENTITY
                  and not (key in _ADDED_AT_DEFAULT and value == _ADDED_AT_DEFAULT[key])}
    return json.dumps(params, sort_keys=True, allow_nan=False)


def _request_sha256(model: str, prompt: str, size: str, seconds: str, params_json: str,
                    input_reference: bytes | None) -> str:
    """A hash of everything a create is asked for (`params_json`: `_identity_json`'s, for a request, or the stored
    JSON of a store before it): two requests with the same hash make the same video."""
    digest = hashlib.sha256()
    for part in (model, prompt, size, seconds, params_json):
        encoded = part.encode("utf-8", "surrogatepass")
        digest.update(len(encoded).to_bytes(8, "big") + encoded)
    digest.update(b"-" if input_reference is None else b"+" + hashlib.sha256(input_reference).digest())
    return digest.hexdigest()


def check_idempotency_key(key: object) -> str:
    """`key` if it is a usable idempotency key: a str of 1..255 printable ASCII characters (0x20-0x7E, as an
    HTTP header's structured string holds). Raises ValueError naming the rule."""
    if (not isinstance(key, str) or not 1 <= len(key) <= MAX_IDEMPOTENCY_KEY_CHARS
            or any(not " " <= ch <= "~" for ch in key)):
        shown = repr(key)[:80]
        raise ValueError(f"an idempotency key must be 1..{MAX_IDEMPOTENCY_KEY_CHARS} printable ASCII characters "
                         f"(e.g. a uuid4), got {shown}")
    return key


def _check_room(conn: sqlite3.Connection, client: str, max_total: int | None, max_client: int | None) -> None:
    """Inside a write transaction: raise QueueFullError when a cap on unfinished jobs is reached."""
    if max_total is not None:
        total = conn.execute("SELECT COUNT(*) FROM jobs WHERE status IN ('queued', 'in_progress')").fetchone()[0]
        if total >= max_total:
            raise QueueFullError("total", max_total, int(total))
    if max_client is not None:
        mine = conn.execute(
            "SELECT COUNT(*) FROM jobs WHERE client = ? AND status IN ('queued', 'in_progress')", (client,)
        ).fetchone()[0]
        if mine >= max_client:
            raise QueueFullError("client", max_client, int(mine))


def _error_json(code: str, message: str) -> str:
    _check_str("code", code)
    _check_str("message", message)
    return json.dumps({"code": code, "message": message})


def _move_file(src: Path, dst: Path) -> None:
    """Move `src` to `dst` atomically; across filesystems, copy to a temp file beside `dst` then rename."""
    try:
        os.replace(src, dst)
    except OSError as exc:
        if exc.errno != errno.EXDEV:
            raise
        tmp = dst.with_name(f".{dst.name}.{uuid.uuid4().hex}.tmp")
        try:
            shutil.copyfile(src, tmp)
            os.replace(tmp, dst)
        finally:
            tmp.unlink(missing_ok=True)
        src.unlink(missing_ok=True)

