"""The HTTP layer of the serve plane: the FastAPI app (`build_api`) with routes compatible with the OpenAI Videos
API, bearer auth (`check_bearer`, `client_id`) and the job runner the routes call (`VideoService`).

Every request is checked before any model work: its sizes and body by `vidray.serve.wire`, its fields by
`vidray.serve.api.parse_video_request`; a valid `POST /v1/videos` becomes a frozen `VideoRequest` that is handed to
a `VideoService` (the job runner: `vidray.serve.app` implements it and serves `build_api`'s app); the model
deployments never see HTTP. No Ray and no torch in this module, so it is tested over real HTTP on CPU.

Routes (`build_api`), as the official `openai` SDK (3.57, `client.videos.*`) calls them with
``base_url="http://HOST:PORT/v1"``:

| route | SDK call | answer |
|---|---|---|
| `POST /v1/videos` | `create` (multipart/form-data) | the video object (status `queued`); JSON bodies too |
| `GET /v1/videos/{id}` | `retrieve`, `poll` | the video object; header `openai-poll-after-ms` while unfinished |
| `GET /v1/videos/{id}/content?variant=video` | `download_content` | `video/mp4` bytes; 409 until completed |
| `DELETE /v1/videos/{id}` | `delete` | `{"id", "object": "video.deleted", "deleted": true}` |
| `GET /v1/videos?after=&limit=&order=` | `list` | `{"object": "list", "data", "first_id", "last_id", "has_more"}` |
| `GET /v1/status` | (none) | `service.status()`: the model and the job counts (authenticated) |
| `GET /healthz` | (none) | `{"status": "ok"}` (200) or `{"status": "not ok"}` (503) only; no token, no store |

Clients are told apart by their bearer token (`client_id`, a short hash). Each client sees only its own videos:
retrieve, download, list and delete are scoped to the caller, and another client's id answers the same 404 as an
unknown one (existence is not confirmed); the service's admin tokens (`VideoService.admin_clients`) see every
client's. `POST /v1/videos` beyond the service's caps on unfinished jobs answers 429 `rate_limit_exceeded` with
`Retry-After` (seconds); a client whose stored bytes reached its quota 403 `storage_quota_exceeded`; a store that
reached its own quota, or whose disk is short or full, 507 `insufficient_storage`; another store failure 503; never
a 500.

An `Idempotency-Key` header on `POST /v1/videos` (1..255 printable ASCII characters; the SDK sends it with
``extra_headers={"Idempotency-Key": key}``) makes a create safe to retry: the same key and request from the same
client answer the job the first one made (also when the first answer was lost to a timeout), and the same key with
a different request is a 422 `idempotency_key_reused` (the IETF draft "The Idempotency-Key HTTP Header Field"
answers a reused key with another payload 422; 409 it keeps for a first request still in flight, which cannot
happen here: the key is written in the transaction that inserts the job).

Every error, ours or the framework's (unknown route, wrong method), answers in the OpenAI error shape
``{"error": {"message", "type", "param", "code"}}`` with a message naming the field, the value, the rule and the fix.

Create fields beyond the SDK's (`prompt`, `model`, `size`, `seconds`, `input_reference`) are sent with
``extra_body={"num_frames": 49, "seed": 7, ...}``; the SDK turns them into form fields. See
`vidray.serve.api.parse_video_request` for every field's rule.
"""

from __future__ import annotations

import errno
import hashlib
import hmac
import logging
import os
import secrets
import sqlite3
from collections.abc import Callable, Iterator, Sequence
from typing import BinaryIO, Protocol

from fastapi import Depends, FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, StreamingResponse
from starlette.concurrency import run_in_threadpool
from starlette.exceptions import HTTPException as StarletteHTTPException

from vidray.serve.api import ModelSpec, VideoRequest, decode_input_reference, parse_int, parse_video_request
from vidray.serve.errors import ApiLimits, RequestError, shown
from vidray.serve.jobs import (
    ANONYMOUS_CLIENT,
    IdempotencyKeyReusedError,
    JobStoreUnavailableError,
    QueueFullError,
    StorageFullError,
    check_idempotency_key,
)
from vidray.serve.wire import (
    BodyTooLarge,
    check_declared_length,
    check_request_lengths,
    counting_receive,
    form_fields,
    json_fields,
    too_large,
)

__all__ = [
    "VideoService",
    "build_api",
    "check_bearer",
    "client_id",
]

POLL_AFTER_MS = 500
"""`openai-poll-after-ms` header value on unfinished jobs: the SDK's `poll` waits this long between retrieves."""

QUEUE_FULL_RETRY_AFTER_S = 10
"""`Retry-After` seconds of a 429 for a full queue (a fixed small number: a slot frees when any job finishes)."""

DOWNLOAD_CHUNK_BYTES = 256 * 1024
"""Bytes per read when streaming a finished mp4."""

_UNFINISHED = ("queued", "in_progress")


# --------------------------------------------------------------------------------------------------------------
# Auth
# --------------------------------------------------------------------------------------------------------------


def client_id(token: str) -> str:
    """The client a bearer token stands for, as the job store records it: the first 16 hex digits of its sha256
    (stable across restarts and replicas; the token itself is never stored)."""
    return hashlib.sha256(token.encode("utf-8", "surrogateescape")).hexdigest()[:16]


def check_bearer(authorization: str | None, token: str | Sequence[str] | None) -> str:
    """Check an `Authorization` header against the server's bearer token(s); returns the caller's client id.

    Args:
        authorization: the header value (``"Bearer <token>"``), or None when absent.
        token: the accepted token, or several (one per client); None disables auth (every request passes, as one
            client).

    Returns:
        `client_id` of the matching token, or `vidray.serve.jobs.ANONYMOUS_CLIENT` when auth is disabled.

    Raises:
        RequestError: 401 (`param="authorization"`, header `WWW-Authenticate: Bearer`) when the header is missing
            or differs from ``f"Bearer {token}"`` for every token (the scheme in any case, RFC 7235); each token is
            compared in constant time (`hmac.compare_digest`), all of them on every call.
    """
    if token is None:
        return ANONYMOUS_CLIENT
    tokens = (token,) if isinstance(token, str) else tuple(token)
    headers = {"WWW-Authenticate": "Bearer"}
    if not authorization:
        raise RequestError(401, "authorization", "missing bearer token: send the header 'Authorization: Bearer "
                           "<token>' (the openai SDK sends api_key this way)", code="invalid_api_key",
                           headers=headers)
    scheme, _, credentials = authorization.partition(" ")
    given = (scheme.lower() + " " + credentials).encode("utf-8", "surrogateescape")  # the scheme is case-insensitive
    matches = [known for known in tokens if hmac.compare_digest(given, f"bearer {known}".encode())]
    if not matches:
        raise RequestError(401, "authorization", "invalid bearer token in the Authorization header; use the "
                           "token the server was started with", code="invalid_api_key", headers=headers)
    return client_id(matches[0])


# --------------------------------------------------------------------------------------------------------------
# The service the routes hand requests to
# --------------------------------------------------------------------------------------------------------------


class VideoService(Protocol):
    """What the routes need from the job runner (`vidray.serve.app` implements it).

    Its sync methods are called in a worker thread (`run_in_threadpool`): they may wait for the job store (a
    round trip to the Ray head's store actor); a store that does not answer raises `JobStoreUnavailableError`
    (answered 503 with Retry-After).
    Video objects are dicts in the OpenAI shape: `id`, `object: "video"`, `created_at` (unix s), `status`
    (queued | in_progress | completed | failed), `progress` (0..100), `model`, `seconds`, `size`, optional
    `completed_at`, `expires_at`, `prompt`, `error: {code, message}`.
    """

    auth_token: str | Sequence[str] | None
    """Bearer token(s) every route but /healthz requires, one per client (admin tokens included); None disables
    auth."""
    admin_clients: frozenset[str]
    """`client_id`s of the admin tokens: their reads, lists and deletes see every client's videos (optional
    attribute; none when absent)."""
    limits: ApiLimits
    spec: ModelSpec

    async def submit(self, request: VideoRequest, *, client: str = ANONYMOUS_CLIENT,
                     idempotency_key: str | None = None) -> dict:
        """Record a job for `request` of `client` (`check_bearer`'s id) durably and queue it; returns its video
        object (status `queued`), or, for an `idempotency_key` the client sent before with the same request, the
        job that made. Raises `QueueFullError` past a cap on unfinished jobs, `StorageFullError` past a byte quota
        or with the disk short, `IdempotencyKeyReusedError` for a key sent before with another request, OSError
        or sqlite3.Error when the store cannot be written."""
        ...

    def get(self, video_id: str, *, client: str | None) -> dict | None:
        """The video object, or None for an unknown (or deleted) id, or one of another client than `client`
        (None: any client's)."""
        ...

    def list(self, *, after: str | None, limit: int, order: str, client: str | None) -> tuple[list[dict], bool]:
        """Up to `limit` of `client`'s video objects (None: every client's) by `created_at` (`order` "asc" |
        "desc"), starting after the id `after`; returns (objects, has_more). Raises LookupError when `after` is
        not a stored id of `client` (a 400 naming it)."""
        ...

    def delete(self, video_id: str, *, client: str | None) -> bool:
        """Delete `client`'s job (None: any client's) and its files; False for an unknown id or another
        client's."""
        ...

    def open_video(self, video_id: str, *, client: str | None) -> BinaryIO | None:
        """The finished mp4 of `client`'s job (None: any client's) opened for reading (the caller closes it), or
        None when the job is not completed, another client's, or its file is gone."""
        ...

    def health(self) -> dict:
        """``{"status": "ok"}`` or ``{"status": "not ok"}``, in constant time (no store access): for /healthz."""
        ...

    async def status(self, *, client: str | None = None) -> dict:
        """The model and the job counts of `client` (None: all) for the authenticated `GET /v1/status` (read off
        the event loop)."""
        ...


# --------------------------------------------------------------------------------------------------------------
# HTTP
# --------------------------------------------------------------------------------------------------------------


def _chunks(video_file) -> Iterator[bytes]:
    """The open file's bytes in `DOWNLOAD_CHUNK_BYTES` pieces (Starlette reads a sync iterator in a thread); closes
    it at the end, also when the client goes away."""
    with video_file:
        while chunk := video_file.read(DOWNLOAD_CHUNK_BYTES):
            yield chunk


_NO_SPACE = (errno.ENOSPC, errno.EDQUOT, errno.EFBIG)


async def _submit(service: VideoService, request: VideoRequest, client: str, idempotency_key: str | None) -> dict:
    """`service.submit`, its refusals as answers: a full queue is a 429 `rate_limit_exceeded` with `Retry-After`;
    the client's byte quota a 403 `storage_quota_exceeded` (the client frees room by deleting; a 403, unlike a 429,
    is not retried by the SDK); a key reused with another request a 422 `idempotency_key_reused`; the store's quota,
    a disk short of its free-space floor or a full disk a 507 and any other storage failure a 503, each with
    `Retry-After` and no server path."""
    retry = {"Retry-After": str(QUEUE_FULL_RETRY_AFTER_S)}
    try:
        if idempotency_key is None:  # services that predate the header take no such argument
            return await service.submit(request, client=client)
        return await service.submit(request, client=client, idempotency_key=idempotency_key)
    except QueueFullError as err:
        raise RequestError(429, None, str(err), code="rate_limit_exceeded", headers=retry) from None
    except StorageFullError as err:
        if err.scope == "client":
            raise RequestError(403, None, str(err), code="storage_quota_exceeded") from None
        logging.getLogger(__name__).error("creating a video job refused: %s", err)
        raise RequestError(507, None, str(err), code="insufficient_storage", headers=retry) from None
    except IdempotencyKeyReusedError as err:
        raise RequestError(422, "idempotency-key", str(err), code="idempotency_key_reused") from None
    except (OSError, sqlite3.Error) as err:
        full = (getattr(err, "errno", None) in _NO_SPACE
                or getattr(err, "sqlite_errorcode", None) == sqlite3.SQLITE_FULL)
        logging.getLogger(__name__).error("creating a video job failed: %r", err)
        if full:
            raise RequestError(507, None, "the server's video store is full (no space left on its disk); retry "
                               "later, and tell its operator", code="insufficient_storage", headers=retry) from None
        raise RequestError(503, None, f"the server's video store cannot be written ({type(err).__name__}); retry "
                           "later, and tell its operator if it persists", code="service_unavailable",
                           headers=retry) from None


def build_api(get_service: Callable[[], VideoService | None],
              on_error: Callable[[int, str], None] | None = None) -> FastAPI:
    """The FastAPI app with the OpenAI-compatible video routes (see the module docstring).

    Args:
        get_service: returns the job runner, or None while it is starting (routes then answer 503). Called on
            every request, so the app can be built at import time (for `serve.ingress(app)`) before the service
            exists.
        on_error: called with (HTTP status, error code) for every error answer (metrics:
            `vidray.serve.metrics.JobMetrics.count_http_error`); its own failure never changes the answer.

    Returns:
        A FastAPI app whose every error answers ``{"error": {...}}`` JSON (RequestError's shape).
    """
    app = FastAPI(title="vidray video API", version="1", docs_url=None, redoc_url=None, openapi_url=None,
                  dependencies=[Depends(check_request_lengths)])

    def respond(exc: RequestError) -> JSONResponse:
        if on_error is not None:
            try:
                on_error(exc.status, exc.code)
            except Exception:  # noqa: BLE001 - counting must not change the answer
                logging.getLogger(__name__).warning("on_error failed", exc_info=True)
        return exc.to_response()

    # 1. Every error in the OpenAI error shape.
    @app.exception_handler(RequestError)
    async def _request_error(_request: Request, exc: RequestError) -> JSONResponse:
        return respond(exc)

    @app.exception_handler(StarletteHTTPException)
    async def _http_error(request: Request, exc: StarletteHTTPException) -> JSONResponse:
        path = shown(request.url.path)[1:-1]
        if exc.status_code == 404:
            message = f"no route {request.method} {path}; see /v1/videos"
            code = "not_found"
        elif exc.status_code == 405:
            message = f"method {request.method} is not allowed on {path}"
            code = "method_not_allowed"
        else:
            message, code = str(exc.detail), "invalid_request"
        return respond(RequestError(exc.status_code, None, message, code=code, headers=exc.headers))

    @app.exception_handler(RequestValidationError)
    async def _validation_error(_request: Request, exc: RequestValidationError) -> JSONResponse:
        errors = exc.errors()
        first = errors[0] if errors else {}
        loc = [str(part) for part in first.get("loc", ())]
        param = loc[-1] if loc else None
        return respond(RequestError(400, param, f"{'.'.join(loc) or 'request'}: {first.get('msg', 'invalid')}"))

    @app.exception_handler(JobStoreUnavailableError)
    async def _store_unavailable(_request: Request, exc: JobStoreUnavailableError) -> JSONResponse:
        logging.getLogger(__name__).warning("%s", exc)
        return respond(RequestError(503, None, "the video store is not answering; retry in a few seconds",
                                    code="service_unavailable", headers={"Retry-After": "2"}))

    @app.exception_handler(Exception)
    async def _server_error(request: Request, exc: Exception) -> JSONResponse:
        # The client sees no internals (paths, host names): an error id, which the server log holds with the
        # traceback. Starlette re-raises after this answer, and uvicorn logs the traceback again.
        error_id = secrets.token_hex(4)
        logging.getLogger(__name__).error("internal server error %s on %s %s", error_id, request.method,
                                          request.url.path, exc_info=exc)
        return respond(RequestError(500, None, f"internal server error (error id {error_id}); the server log has "
                                    "the details under this id", code="server_error"))

    def service_or_503() -> VideoService:
        service = get_service()
        if service is None:
            raise RequestError(503, None, "the video service is starting; retry in a few seconds",
                               code="service_unavailable", headers={"Retry-After": "2"})
        return service

    def authorized(request: Request) -> VideoService:
        """The service, once the bearer token is checked: ``request.state.client`` is the caller's client id and
        ``request.state.scope`` the client whose videos it may see (None for an admin: everyone's)."""
        service = service_or_503()
        client = check_bearer(request.headers.get("authorization"), service.auth_token)
        request.state.client = client
        request.state.scope = None if client in getattr(service, "admin_clients", ()) else client
        return service

    async def video_or_404(service: VideoService, video_id: str, scope: str | None) -> dict:
        # Another client's id gets exactly this answer: a 403 would confirm that the id exists.
        video = await run_in_threadpool(lambda: service.get(video_id, client=scope))
        if video is None:
            raise RequestError(404, "video_id", f"no video with id {video_id!r}; list them with GET /v1/videos",
                               code="not_found")
        return video

    # 2. Routes.
    @app.get("/healthz")
    async def healthz() -> JSONResponse:
        service = get_service()
        ok = service is not None and service.health().get("status") == "ok"
        return JSONResponse({"status": "ok" if ok else "not ok"}, status_code=200 if ok else 503)

    @app.get("/v1/status")
    async def status(request: Request) -> JSONResponse:
        return JSONResponse(await authorized(request).status(client=request.state.scope))

    @app.post("/v1/videos")
    async def create_video(request: Request) -> JSONResponse:
        service = authorized(request)
        limits = service.limits
        idempotency_key = request.headers.get("idempotency-key")
        if idempotency_key is not None:
            try:
                check_idempotency_key(idempotency_key)
            except ValueError as err:
                raise RequestError(400, "idempotency-key", f"Idempotency-Key header: {err}") from None
        # Size first, before any parser reads the body: the declared length, then a count as it streams in.
        check_declared_length(request, limits)
        limited = Request(request.scope, counting_receive(request.receive, limits.max_body_bytes))
        content_type = (request.headers.get("content-type") or "").split(";")[0].strip().lower()
        try:
            if content_type in ("multipart/form-data", "application/x-www-form-urlencoded"):
                fields, image = await form_fields(limited, limits)
            elif content_type == "application/json":
                fields, image = json_fields(await limited.body(), limits)
            else:
                raise RequestError(415, "content-type", f"Content-Type {content_type or '(none)'!r} is not "
                                   "accepted; send multipart/form-data (as the openai SDK does), "
                                   "application/x-www-form-urlencoded (as `curl -d` does) or application/json",
                                   code="unsupported_media_type")
        except BodyTooLarge:
            raise too_large(limits, None) from None
        # Fields and the image's header on the loop (bounded, linear); the image's decode in its own pool.
        video_request = parse_video_request(fields, image, spec=service.spec, limits=limits)
        if video_request.input_reference is not None:
            await decode_input_reference(video_request, service.spec, limits, image[0])
        return JSONResponse(await _submit(service, video_request, request.state.client, idempotency_key))

    @app.get("/v1/videos")
    async def list_videos(
        request: Request, after: str | None = None, limit: str | None = None, order: str | None = None
    ) -> JSONResponse:
        service = authorized(request)
        count = 20
        if limit is not None:
            count = parse_int("limit", limit, "1..100")
            if not 1 <= count <= 100:
                raise RequestError(400, "limit", f"limit must be within 1..100, got {count}")
        order = order or "desc"
        if order not in ("asc", "desc"):
            raise RequestError(400, "order", f"order must be 'asc' or 'desc', got {order!r}")
        try:
            data, has_more = await run_in_threadpool(service.list, after=after or None, limit=count, order=order,
                                                     client=request.state.scope)
        except LookupError as err:  # an unknown cursor (was a 500: a new user's trial)
            raise RequestError(400, "after", str(err)) from None
        return JSONResponse({
            "object": "list",
            "data": data,
            "first_id": data[0]["id"] if data else None,
            "last_id": data[-1]["id"] if data else None,
            "has_more": bool(has_more),
        })

    @app.get("/v1/videos/{video_id}")
    async def retrieve_video(request: Request, video_id: str) -> JSONResponse:
        service = authorized(request)
        video = await video_or_404(service, video_id, request.state.scope)
        headers = {"openai-poll-after-ms": str(POLL_AFTER_MS)} if video.get("status") in _UNFINISHED else None
        return JSONResponse(video, headers=headers)

    @app.get("/v1/videos/{video_id}/content")
    async def download_video(request: Request, video_id: str, variant: str | None = None) -> StreamingResponse:
        service = authorized(request)
        if variant not in (None, "", "video"):
            raise RequestError(400, "variant", f"variant {variant!r} is not available; only 'video' (the mp4) is "
                               "served here")
        video = await video_or_404(service, video_id, request.state.scope)
        status = video.get("status")
        if status != "completed":
            if status == "failed":
                reason = (video.get("error") or {}).get("message") or "no reason recorded"
                detail = f"failed ({reason}); it has no content; create a new video"
            else:
                detail = (f"{status} ({video.get('progress', 0)}% done); poll GET /v1/videos/{video_id} until "
                          "its status is 'completed'")
            raise RequestError(409, "video_id", f"video {video_id!r} is {detail}", code="video_not_ready")
        # Opened here, once: a DELETE (or the retention sweep) after this point unlinks the name, and the download
        # still finishes from the open file (or the bytes fetched from the head's store); one before it is a 404.
        video_file = await run_in_threadpool(lambda: service.open_video(video_id, client=request.state.scope))
        if video_file is None:
            raise RequestError(404, "video_id", f"video {video_id!r} is completed but its mp4 is no longer "
                               "stored (expired or deleted); create it again", code="not_found")
        size = video_file.seek(0, os.SEEK_END)
        video_file.seek(0)
        return StreamingResponse(_chunks(video_file), media_type="video/mp4", headers={
            "content-length": str(size), "content-disposition": f'attachment; filename="{video_id}.mp4"'})

    @app.delete("/v1/videos/{video_id}")
    async def delete_video(request: Request, video_id: str) -> JSONResponse:
        service = authorized(request)
        if not await run_in_threadpool(lambda: service.delete(video_id, client=request.state.scope)):
            raise RequestError(404, "video_id", f"no video with id {video_id!r}; list them with GET /v1/videos",
                               code="not_found")
        return JSONResponse({"id": video_id, "object": "video.deleted", "deleted": True})

    return app
