"""The HTTP layer of the serve plane: FastAPI routes compatible with the OpenAI Videos API, request validation and
bearer auth.

Every request is parsed and checked here, before any model work: a valid `POST /v1/videos` becomes a frozen
`VideoRequest` that is handed to a `VideoService` (the job runner, built by `vidray.serve.app`); the model
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
`parse_video_request` for every field's rule.
"""

from __future__ import annotations

import base64
import binascii
import errno
import hashlib
import hmac
import json
import logging
import math
import os
import re
import secrets
import sqlite3
import unicodedata
from contextlib import aclosing
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from urllib.parse import unquote_to_bytes
from typing import Any, BinaryIO, Protocol

from fastapi import Depends, FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, StreamingResponse
from python_multipart.multipart import parse_options_header
from starlette.concurrency import run_in_threadpool
from starlette.datastructures import UploadFile
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.formparsers import FormParser, MultiPartException, MultiPartParser
from starlette.types import Message, Receive

from vidray.serve import images
from vidray.serve.jobs import (
    ANONYMOUS_CLIENT,
    IdempotencyKeyReusedError,
    JobStoreUnavailableError,
    QueueFullError,
    StorageFullError,
    check_idempotency_key,
)

__all__ = [
    "ApiLimits",
    "ModelSpec",
    "RequestError",
    "VideoRequest",
    "VideoService",
    "build_api",
    "check_bearer",
    "client_id",
    "parse_video_request",
]

MAX_SEED = 2**63 - 1
"""Largest accepted `seed` (seeds are 0 .. 2**63-1, what `torch.Generator.manual_seed` takes without wrapping)."""

POLL_AFTER_MS = 500
"""`openai-poll-after-ms` header value on unfinished jobs: the SDK's `poll` waits this long between retrieves."""

QUEUE_FULL_RETRY_AFTER_S = 10
"""`Retry-After` seconds of a 429 for a full queue (a fixed small number: a slot frees when any job finishes)."""

DOWNLOAD_CHUNK_BYTES = 256 * 1024
"""Bytes per read when streaming a finished mp4."""

CREATE_FIELDS = (
    "prompt",
    "model",
    "size",
    "seconds",
    "num_frames",
    "seed",
    "num_inference_steps",
    "guidance_scale",
    "negative_prompt",
)
"""Text fields `POST /v1/videos` accepts (plus the `input_reference` image); any other field is a 400."""

_UNFINISHED = ("queued", "in_progress")

MAX_NUMBER_CHARS = 40
"""Longest accepted `seconds`, `num_frames`, `seed`, `num_inference_steps`, `guidance_scale` and `limit`, in characters
as sent (a seed has at most 19 digits): checked before any parsing, so no number costs more than this to read."""
MAX_SIZE_CHARS = 32
"""Longest accepted `size` ("WIDTHxHEIGHT"), in characters as sent."""
MAX_NAME_CHARS = 256
"""Longest accepted `model`, `input_reference[file_id]`, form field name or part header, in characters."""
MAX_ID_CHARS = 64
"""Longest accepted video id (path `video_id`, query `after`); ids are "video_" + 32 hex digits."""
MAX_CHOICE_CHARS = 16
"""Longest accepted `order` and `variant` query value."""
MAX_HEADER_CHARS = 4096
"""Longest accepted `Authorization`, `Content-Type` or `Content-Length` header, and URL path, in characters."""
MAX_JSON_FIELDS = 64
"""Most top-level members of a JSON create body (a form body takes at most 64 fields too)."""
MAX_QUERY_BYTES = 2048
"""Longest accepted query string, in bytes as sent (percent-encoded)."""


# --------------------------------------------------------------------------------------------------------------
# Errors, limits, what the model can make, a validated request
# --------------------------------------------------------------------------------------------------------------


class RequestError(Exception):
    """A request the server refuses, answered as JSON in the OpenAI error shape.

    Args:
        status: the HTTP status: 4xx for the client's mistakes (400 bad field, 401 auth, 404 unknown id, 409 not
            ready, 413 too large, 415 content type), 503 while the service is starting.
        param: the request field at fault (form field, query parameter or header name), or None.
        message: what was wrong, naming the value, the rule and the fix.
        code: a machine-readable code (`invalid_value`, `unknown_parameter`, `invalid_api_key`, ...).
        headers: extra response headers (`WWW-Authenticate` on 401, `Retry-After` on 503).
    """

    def __init__(
        self,
        status: int,
        param: str | None,
        message: str,
        code: str = "invalid_value",
        *,
        headers: Mapping[str, str] | None = None,
    ) -> None:
        super().__init__(message)
        self.status = status
        self.param = param
        self.message = message
        self.code = code
        self.headers = dict(headers or {})

    def to_json(self) -> dict:
        """The response body: ``{"error": {"message", "type", "param", "code"}}``; `type` is
        `"invalid_request_error"` for 4xx and `"server_error"` for 5xx, as the OpenAI API answers. A lone surrogate
        (a JSON key "\\ud800" echoed back) is written as its escape: UTF-8 cannot encode it (the answer was a
        500)."""
        error_type = "server_error" if self.status >= 500 else "invalid_request_error"
        param = None if self.param is None else _encodable(self.param[:MAX_NAME_CHARS])
        return {"error": {"message": _encodable(self.message), "type": error_type, "param": param,
                          "code": self.code}}

    def to_response(self) -> JSONResponse:
        """This error as a `JSONResponse` with its status and headers."""
        return JSONResponse(self.to_json(), status_code=self.status, headers=self.headers)


def _encodable(text: str) -> str:
    """`text` with every character UTF-8 cannot encode (lone surrogates) written as a backslash escape."""
    return text.encode("utf-8", "backslashreplace").decode("utf-8")


@dataclass(frozen=True)
class ApiLimits:
    """Size limits on requests, checked before anything is decoded or queued."""

    max_body_bytes: int = 8 * 2**20
    """Whole request body in bytes; larger -> 413 before the body is parsed (from `Content-Length`, or counted as
    a chunked body streams in)."""
    max_prompt_chars: int = 2000
    """`prompt` and `negative_prompt`, in characters as sent (surrounding whitespace counts): checked before the
    text is scanned or stripped."""
    max_image_bytes: int = 4 * 2**20
    """`input_reference` image file, in bytes (as uploaded); larger -> 413."""
    max_image_px: int = 4096
    """`input_reference` width and height, each, in pixels: an upper bound over the model's own
    (`ModelSpec.max_image_px`); the smaller one applies."""
    max_num_inference_steps: int = 100
    """Upper bound on `num_inference_steps` (compute per request)."""
    image_decode_workers: int = 2
    """Threads that decode `input_reference` images, at most this many at once (`vidray.serve.images.ImageDecoder`:
    a pool of their own, not the route threads)."""
    image_decode_timeout_s: float = 10.0
    """Seconds an image may wait for a decode thread and decode, together: past it the request is refused (400 when
    the decode itself ran that long, 503 with Retry-After when no thread came free)."""

    def __post_init__(self) -> None:
        for name in ("max_body_bytes", "max_prompt_chars", "max_image_bytes", "max_image_px",
                     "max_num_inference_steps", "image_decode_workers"):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise ValueError(f"ApiLimits.{name} must be a positive integer, got {value!r}")
        timeout = self.image_decode_timeout_s
        if isinstance(timeout, bool) or not isinstance(timeout, (int, float)) or not 0 < timeout < math.inf:
            raise ValueError(f"ApiLimits.image_decode_timeout_s must be a positive number of seconds, got {timeout!r}")


@dataclass(frozen=True)
class ModelSpec:
    """What the loaded model can make; requests are checked against it (filled from the model folder).

    Raises ValueError at construction if the defaults are not themselves valid (a misconfigured server, not a bad
    request).
    """

    name: str
    """The `model` string video objects carry; a request's `model` must equal it or be empty/absent."""
    default_size: tuple[int, int]
    """(width, height) in pixels when a request gives no `size`."""
    default_num_frames: int
    """Frame count when a request gives neither `seconds` nor `num_frames`."""
    fps: float
    """Frames per second of the mp4s written; a clip's duration in seconds is num_frames / fps."""
    size_multiple: int
    """Width and height must be multiples of this, in pixels (16 for EasyAnimate: VAE 8x and patch 2)."""
    max_width: int
    """Largest width in pixels (memory bound)."""
    max_height: int
    """Largest height in pixels (memory bound)."""
    max_num_frames: int
    """Largest frame count (memory bound)."""
    valid_num_frames: Callable[[int], bool]
    """Which frame counts the model can make, e.g. EasyAnimate: 1 or 4k+1 (temporal VAE compression 4)."""
    supports_image_to_video: bool
    """Whether a first-frame `input_reference` image is accepted."""
    default_num_inference_steps: int
    """Denoising steps when a request gives no `num_inference_steps`."""
    default_guidance_scale: float = 6.0
    """Classifier-free guidance scale when a request gives no `guidance_scale` (1.0 = no guidance)."""
    no_image_reason: str = "is a text-to-video model and takes no image"
    """Why an `input_reference` is refused (with `supports_image_to_video` False), after the model's name."""
    max_image_px: int | None = None
    """Largest `input_reference` width and height in pixels this model takes (the image is resized to the video's
    size: `vidray.serve.app.model_spec` sets twice the largest side of its buckets and of the sizes it serves);
    None: only `ApiLimits.max_image_px` applies."""

    def __post_init__(self) -> None:
        width, height = self.default_size
        if self.size_multiple < 1 or self.fps <= 0 or self.max_num_frames < 1:
            raise ValueError(
                f"ModelSpec {self.name!r}: size_multiple, fps and max_num_frames must be positive, got "
                f"{self.size_multiple}, {self.fps}, {self.max_num_frames}"
            )
        if _size_problem(width, height, self) is not None:
            raise ValueError(f"ModelSpec {self.name!r}: default_size {width}x{height} is invalid: "
                             f"{_size_problem(width, height, self)}")
        if not self._frames_ok(self.default_num_frames):
            raise ValueError(f"ModelSpec {self.name!r}: default_num_frames {self.default_num_frames} is not a "
                             f"valid count within 1..{self.max_num_frames}")
        if self.default_num_inference_steps < 1:
            raise ValueError(f"ModelSpec {self.name!r}: default_num_inference_steps must be >= 1, got "
                             f"{self.default_num_inference_steps}")

    def _frames_ok(self, num_frames: int) -> bool:
        return 1 <= num_frames <= self.max_num_frames and bool(self.valid_num_frames(num_frames))


@dataclass(frozen=True)
class VideoRequest:
    """A validated `POST /v1/videos` request, ready for the job runner. Built only by `parse_video_request`."""

    prompt: str
    """Stripped, 1..max_prompt_chars characters."""
    model: str
    """Always the serving model's `ModelSpec.name`."""
    width: int
    """Pixels; a multiple of `ModelSpec.size_multiple`, <= max_width."""
    height: int
    """Pixels; a multiple of `ModelSpec.size_multiple`, <= max_height."""
    num_frames: int
    """A count the model can make (`ModelSpec.valid_num_frames`), <= max_num_frames."""
    seconds: str
    """The clip's actual duration num_frames / fps, as the video object's `seconds` string (e.g. "4.125")."""
    seed: int
    """0 .. 2**63-1; 0 when the request gives none (same request -> same video)."""
    num_inference_steps: int
    """1 .. ApiLimits.max_num_inference_steps."""
    guidance_scale: float
    """Finite, >= 1.0 (1.0 = no classifier-free guidance)."""
    negative_prompt: str
    """Stripped; "" when not given."""
    input_reference: bytes | None = field(default=None, repr=False)
    """The first-frame image file's own bytes, as uploaded (PNG, JPEG or WebP; not re-encoded), or None for
    text-to-video."""
    input_reference_size: tuple[int, int] | None = None
    """(width, height) of `input_reference` in pixels, from its header; None for text-to-video."""
    input_reference_format: str | None = None
    """Its format, a key of `vidray.serve.images.IMAGE_FORMATS` ("PNG", "JPEG", "WEBP"); None for text-to-video."""

    @property
    def input_reference_suffix(self) -> str | None:
        """The suffix the job store files the image under (".png", ".jpg", ".webp"), or None."""
        fmt = self.input_reference_format
        return None if fmt is None else images.IMAGE_FORMATS[fmt]

    def input_reference_note(self) -> dict | None:
        """What becomes of the first-frame image, for the job record: {"size": "WxH" as uploaded, "resized_to":
        the video's "WxH", "note" when its aspect ratio differs (it is stretched: resized without cropping, as the
        families' stock pipelines do: `VaeImageProcessor.preprocess`, EasyAnimate's `preprocess_image`)}; None
        without an image."""
        if self.input_reference_size is None:
            return None
        width, height = self.input_reference_size
        record = {"size": f"{width}x{height}", "resized_to": self.size}
        if width * self.height != height * self.width:
            record["note"] = (f"input_reference is {width}x{height} but the video is {self.size}: the image is "
                              "resized to the video's size without cropping (stretched), as the model's stock "
                              "pipeline does; send an image of the video's aspect ratio to keep its proportions")
        return record

    @property
    def size(self) -> str:
        """The video object's `size` string, "WxH"."""
        return f"{self.width}x{self.height}"


# --------------------------------------------------------------------------------------------------------------
# Parsing and validation (pure functions)
# --------------------------------------------------------------------------------------------------------------

_SIZE_RE = re.compile(r"([0-9]{1,6})\s*[xX]\s*([0-9]{1,6})")
"""`size` after stripping, with `fullmatch`. Every regex on client text here is linear in its (capped) length: no
nested or overlapping quantifiers."""
_CONTROL_RE = re.compile(r"[\x00-\x08\x0b\x0c\x0e-\x1f\x7f-\x9f\ud800-\udfff]")
"""Unicode control characters (category Cc) other than tab, LF and CR, and unpaired surrogates (JSON's "\\ud800"
decodes to one; it cannot be encoded as UTF-8, for the tokenizer or the job store)."""
_INT_RE = re.compile(r"[+-]?[0-9]{1,30}")
_FLOAT_RE = re.compile(r"[+-]?(?:[0-9]+(?:\.[0-9]*)?|\.[0-9]+)(?:[eE][+-]?[0-9]+)?|[+-]?(?:inf|infinity|nan)",
                       re.IGNORECASE)
"""What a number field may hold after stripping (`fullmatch`): ASCII decimal or exponent notation (float() also
takes other scripts' digits and underscores: "1_0" read as 10, a fullwidth "１" as 1); inf and nan pass here and are
refused as not finite. The integer part and the fraction are separate groups: `[0-9]+\.?[0-9]*` let the regex engine
split a digit run every way before failing, ~5 s for 16,000 digits and a letter (issue 27)."""


def _field_cap(name: str, limits: ApiLimits) -> int:
    """The longest value accepted for create field `name`, in characters as sent."""
    if name in ("prompt", "negative_prompt"):
        return limits.max_prompt_chars
    if name == "size":
        return MAX_SIZE_CHARS
    if name == "model":
        return MAX_NAME_CHARS
    return MAX_NUMBER_CHARS


def _check_length(name: str, text: str, cap: int, fix: str = "shorten it") -> None:
    """Raise RequestError 400 naming `name` if `text` is longer than `cap` characters (before any parsing)."""
    if len(text) > cap:
        raise RequestError(400, name, f"{name} is {len(text)} characters, above the limit {cap}; {fix}")


def _shown(text: str, limit: int = 60) -> str:
    """`text` for an error message: repr'd, cut to `limit` characters with "..." (never echo a megabyte back)."""
    return repr(text) if len(text) <= limit else repr(text[:limit]) + "..."


def _is_blank(text: str) -> bool:
    """Only whitespace and invisible format characters (Unicode Cf: zero-width space, joiners, BOM), or empty."""
    return all(ch.isspace() or unicodedata.category(ch) == "Cf" for ch in text)


def _parse_int(name: str, text: str, what: str) -> int:
    """An ASCII decimal integer (surrounding whitespace allowed) of at most `MAX_NUMBER_CHARS` characters; else
    RequestError 400 naming `name` and describing the valid values as `what`. Linear in len(text)."""
    _check_length(name, text, MAX_NUMBER_CHARS, f"send an integer ({what})")
    if not _INT_RE.fullmatch(text.strip()):
        raise RequestError(400, name, f"{name} must be an integer ({what}), got {text!r}")
    return int(text)


def _parse_float(name: str, text: str, what: str) -> float:
    """An ASCII decimal or exponent number (surrounding whitespace allowed) of at most `MAX_NUMBER_CHARS`
    characters, finite; else RequestError 400 naming `name` and describing the valid values as `what`. Linear in
    len(text)."""
    _check_length(name, text, MAX_NUMBER_CHARS, f"send a number ({what})")
    try:
        if not _FLOAT_RE.fullmatch(text.strip()):
            raise ValueError(text)
        value = float(text)
    except ValueError:
        raise RequestError(400, name, f"{name} must be a number ({what}), got {text!r}") from None
    if not math.isfinite(value):
        raise RequestError(400, name, f"{name} must be a finite number ({what}), got {text!r}")
    return value


def _size_problem(width: int, height: int, spec: ModelSpec) -> str | None:
    """The first thing wrong with (width, height) for `spec`, as a sentence with the fix, or None if valid."""
    m = spec.size_multiple
    for side, value, largest in (("width", width, spec.max_width), ("height", height, spec.max_height)):
        if value < m:
            return f"{side} {value} is below the minimum {m}"
        if value > largest:
            return f"{side} {value} is above this model's maximum {largest}"
        if value % m:
            low, high = value // m * m, value // m * m + m
            options = " or ".join(str(v) for v in (low, high) if m <= v <= largest)
            return f"{side} {value} is not a multiple of {m}; use {options}"
    return None


def _valid_frames_near(spec: ModelSpec, num_frames: int) -> list[int]:
    """The nearest valid frame counts below and above `num_frames` within 1..max_num_frames (0, 1 or 2 items)."""
    near: list[int] = []
    for n in range(min(num_frames - 1, spec.max_num_frames), 0, -1):
        if spec.valid_num_frames(n):
            near.append(n)
            break
    for n in range(max(num_frames + 1, 1), spec.max_num_frames + 1):
        if spec.valid_num_frames(n):
            near.append(n)
            break
    return near


def _frames_from_seconds(seconds: float, spec: ModelSpec) -> int:
    """The frame count for a duration: the valid count nearest round_half_up(seconds * fps) within
    1..max_num_frames (a tie goes to the smaller count). Raises RequestError if round(seconds * fps) exceeds
    max_num_frames."""
    frames = seconds * spec.fps  # inf for a finite but huge seconds (1e308: floor() raised OverflowError, a 500)
    if frames >= spec.max_num_frames + 0.5:  # round half up above the maximum
        max_seconds = spec.max_num_frames / spec.fps
        raise RequestError(
            400,
            "seconds",
            f"seconds {seconds:g} at {spec.fps:g} fps is {frames:.0f} frames, above this model's maximum "
            f"{spec.max_num_frames} frames; ask for at most {max_seconds:g} seconds",
        )
    target = math.floor(frames + 0.5)
    if spec._frames_ok(target):
        return target
    near = _valid_frames_near(spec, target)
    # Nearest by distance; on a tie the smaller count (less compute). `near` is sorted ascending.
    return min(near, key=lambda n: (abs(n - target), n))


def _format_seconds(num_frames: int, fps: float) -> str:
    text = f"{num_frames / fps:.3f}".rstrip("0").rstrip(".")
    return text or "0"


def parse_video_request(
    fields: Mapping[str, str],
    image: tuple[str, str, bytes] | None,
    *,
    spec: ModelSpec,
    limits: ApiLimits,
) -> VideoRequest:
    """Check a create request's fields and image against the model and limits; build the `VideoRequest`.

    Args:
        fields: the text form fields (name -> value, as the SDK's multipart body sends them, or JSON values as
            strings). Accepted names are `CREATE_FIELDS`:
            Every field's length is checked first, as sent: `limits.max_prompt_chars` characters for the prompts,
            `MAX_SIZE_CHARS` for size, `MAX_NAME_CHARS` for model, `MAX_NUMBER_CHARS` for the numbers.
            - `prompt` (required): stripped, non-empty, at most `limits.max_prompt_chars` characters.
            - `model`: empty or `spec.name`.
            - `size`: "WxH" in pixels, each a multiple of `spec.size_multiple` within `spec.max_width` x
              `spec.max_height`; default `spec.default_size`.
            - `seconds`: a positive number; the frame count is the valid count nearest round(seconds * fps)
              (half up; a tie goes to the smaller count); round(seconds * fps) above `spec.max_num_frames` is a 400.
            - `num_frames`: an exact frame count the model can make (else 400 naming the valid counts near it).
              With `seconds`, both must give the same count. Default `spec.default_num_frames`.
            - `seed`: integer 0 .. 2**63-1, default 0 (so a repeated request gives the same video).
            - `num_inference_steps`: 1 .. `limits.max_num_inference_steps`, default
              `spec.default_num_inference_steps`.
            - `guidance_scale`: finite, >= 1.0, default `spec.default_guidance_scale`.
            - `negative_prompt`: at most `limits.max_prompt_chars` characters, default "".
        image: the `input_reference` upload as (filename, content_type, bytes), or None. Its content type is not
            trusted: `_check_image` checks the bytes without decoding them (PNG, JPEG or WebP by their magic
            bytes, each side at most `_image_side_limit`, a JPEG's scans bounded); the route then decodes them in
            the image pool (`vidray.serve.images.ImageDecoder`). Kept as uploaded, not re-encoded.
        spec: what the serving model can make.
        limits: request size limits.

    Returns:
        The validated `VideoRequest`.

    Raises:
        RequestError: 400 with `param` = the first bad field, checked in a fixed order (unknown fields, then the
            order above, then the image; a field over its length cap, then a control character other than tab, LF
            and CR or an unpaired surrogate, in any field come right after the unknown fields); 413
            (`param="input_reference"`) for an image over `limits.max_image_bytes`.
    """
    # 1. Unknown fields (sorted, so the message is deterministic).
    unknown = sorted(set(fields) - set(CREATE_FIELDS))
    if unknown:
        raise _unknown_fields_error(unknown)

    # 1b. Lengths, before any field is scanned: every later check is then bounded (prompts by max_prompt_chars).
    for name in CREATE_FIELDS:
        if fields.get(name) is not None:
            _check_length(name, fields[name], _field_cap(name, limits))

    # 1c. Control characters (NUL, ESC, ...; tab and newlines are text) in any field: a client bug, never a prompt.
    for name in sorted(fields):
        bad = _CONTROL_RE.search(fields[name] or "")
        if bad:
            raise RequestError(400, name, f"{name} contains U+{ord(bad.group()):04X} at character {bad.start()}, "
                               "which is not text (a control character or an unpaired surrogate); remove it (tab "
                               "and newlines are allowed)")

    def given(name: str) -> str | None:
        value = fields.get(name)
        return None if value is None or _is_blank(value) else value.strip()

    # 2. Prompt.
    prompt = (fields.get("prompt") or "").strip()
    if _is_blank(prompt):
        raise RequestError(400, "prompt", "prompt is required and must not be empty or only whitespace",
                           code="missing_required_parameter")

    # 3. Model.
    model = given("model")
    if model is not None and model != spec.name:
        raise RequestError(400, "model", f"model {model!r} is not served here; this server serves {spec.name!r} "
                           f"(send model={spec.name!r} or leave it out)", code="model_not_found")

    # 4. Size.
    size = given("size")
    if size is None:
        width, height = spec.default_size
    else:
        match = _SIZE_RE.fullmatch(size)
        if match is None:
            raise RequestError(400, "size", f"size {size!r} must be 'WIDTHxHEIGHT' in pixels, e.g. "
                               f"'{spec.default_size[0]}x{spec.default_size[1]}'")
        width, height = int(match[1]), int(match[2])
        problem = _size_problem(width, height, spec)
        if problem is not None:
            raise RequestError(400, "size", f"size {size!r}: {problem} (sizes are multiples of "
                               f"{spec.size_multiple} up to {spec.max_width}x{spec.max_height})")

    # 5. Frames: `seconds` and/or `num_frames`.
    seconds_text, num_frames_text = given("seconds"), given("num_frames")
    frames_from_seconds = None
    if seconds_text is not None:
        seconds = _parse_float("seconds", seconds_text, "the clip duration")
        if seconds <= 0:
            raise RequestError(400, "seconds", f"seconds must be > 0, got {seconds_text!r}")
        frames_from_seconds = _frames_from_seconds(seconds, spec)
    if num_frames_text is not None:
        num_frames = _parse_int("num_frames", num_frames_text, "a frame count")
        if not spec._frames_ok(num_frames):
            near = _valid_frames_near(spec, num_frames)
            hint = f"nearest valid: {' or '.join(map(str, near))}" if near else "no valid count near it"
            raise RequestError(400, "num_frames", f"num_frames {num_frames} is not a frame count this model can "
                               f"make (valid counts are within 1..{spec.max_num_frames}); {hint}")
        if frames_from_seconds is not None and frames_from_seconds != num_frames:
            raise RequestError(400, "seconds", f"seconds {seconds_text} gives {frames_from_seconds} frames at "
                               f"{spec.fps:g} fps but num_frames is {num_frames}; send only one of them")
    else:
        num_frames = frames_from_seconds if frames_from_seconds is not None else spec.default_num_frames

    # 6. Seed, steps, guidance, negative prompt.
    seed = 0
    if (text := given("seed")) is not None:
        seed = _parse_int("seed", text, f"0..{MAX_SEED}")
        if not 0 <= seed <= MAX_SEED:
            raise RequestError(400, "seed", f"seed must be within 0..{MAX_SEED} (2**63-1), got {seed}")
    num_inference_steps = spec.default_num_inference_steps
    if (text := given("num_inference_steps")) is not None:
        num_inference_steps = _parse_int("num_inference_steps", text, f"1..{limits.max_num_inference_steps}")
        if not 1 <= num_inference_steps <= limits.max_num_inference_steps:
            raise RequestError(400, "num_inference_steps", f"num_inference_steps must be within "
                               f"1..{limits.max_num_inference_steps}, got {num_inference_steps}")
    guidance_scale = float(spec.default_guidance_scale)
    if (text := given("guidance_scale")) is not None:
        guidance_scale = _parse_float("guidance_scale", text, ">= 1.0")
        if guidance_scale < 1.0:
            raise RequestError(400, "guidance_scale", f"guidance_scale must be >= 1.0 (1.0 = no guidance), got "
                               f"{text}")
    negative_prompt = "" if _is_blank(fields.get("negative_prompt") or "") else fields["negative_prompt"].strip()

    # 7. Image.
    input_reference = input_reference_size = input_reference_format = None
    if image is not None:
        header = _check_image(image, spec=spec, limits=limits)
        input_reference, input_reference_format = image[2], header.format
        input_reference_size = (header.width, header.height)

    return VideoRequest(
        prompt=prompt,
        model=spec.name,
        width=width,
        height=height,
        num_frames=num_frames,
        seconds=_format_seconds(num_frames, spec.fps),
        seed=seed,
        num_inference_steps=num_inference_steps,
        guidance_scale=guidance_scale,
        negative_prompt=negative_prompt,
        input_reference=input_reference,
        input_reference_size=input_reference_size,
        input_reference_format=input_reference_format,
    )


def _unknown_fields_error(unknown: list[str]) -> RequestError:
    """The 400 for create fields that do not exist (`unknown` sorted), naming them (each cut to 60 characters);
    `input_reference` sent as a text field is told to come as a file part."""
    if unknown == ["input_reference"]:
        return RequestError(400, "input_reference", "input_reference came as a text field; upload the image as a "
                            "file part (curl -F input_reference=@first.png), or in JSON as "
                            "{\"input_reference\": {\"image_url\": \"data:image/png;base64,...\"}}",
                            code="unknown_parameter")
    return RequestError(400, unknown[0], f"unknown field(s) {', '.join(_shown(u) for u in unknown)}; accepted "
                        f"fields: {', '.join(CREATE_FIELDS)} and the file part input_reference",
                        code="unknown_parameter")


def _unexpected_file_part(name: str) -> RequestError:
    return RequestError(400, name, f"unexpected file part {_shown(name)}; the only file part accepted is "
                        "input_reference (the first-frame image)", code="unknown_parameter")


def _image_too_large(filename: str, size: int, limits: ApiLimits) -> RequestError:
    return RequestError(413, "input_reference", f"input_reference {_shown(filename)} is {size} bytes, above the "
                        f"limit {limits.max_image_bytes} bytes; send a smaller (or compressed) image",
                        code="request_too_large")


def _image_side_limit(spec: ModelSpec, limits: ApiLimits) -> int:
    """The largest `input_reference` width and height in pixels: the model's (`ModelSpec.max_image_px`) within the
    operator's `ApiLimits.max_image_px`."""
    return min(limits.max_image_px, spec.max_image_px or limits.max_image_px)


def _check_image(image: tuple[str, str, bytes], *, spec: ModelSpec, limits: ApiLimits) -> images.ImageHeader:
    """(filename, content_type, bytes) -> its header, checked without decoding (`vidray.serve.images.inspect_image`:
    PNG, JPEG or WebP by the magic bytes, each side at most `_image_side_limit`, a JPEG's marker walk bounding its
    scans). Linear in the bytes, milliseconds at most. Raises RequestError 400 (413 over `limits.max_image_bytes`),
    param input_reference, naming what was wrong and what is accepted."""
    filename, _content_type, data = image
    if not spec.supports_image_to_video:
        raise RequestError(400, "input_reference", f"input_reference: {spec.name!r} {spec.no_image_reason}; send "
                           "the request without input_reference")
    if len(data) > limits.max_image_bytes:
        raise _image_too_large(filename, len(data), limits)
    try:
        return images.inspect_image(data, max_side_px=_image_side_limit(spec, limits),
                                    what=f"input_reference {_shown(filename)}")
    except images.ImageRefused as err:
        raise _image_error(err, filename) from None


def _image_error(err: images.ImageRefused, filename: str) -> RequestError:
    """An `ImageRefused` as the request's answer (param input_reference; a 503 gets Retry-After)."""
    message = str(err)
    if not message.startswith("input_reference"):
        message = f"input_reference {_shown(filename)}: {message}"
    headers = {"Retry-After": "2"} if err.status == 503 else None
    return RequestError(err.status, "input_reference", message, code=err.code, headers=headers)


async def _decode_image(request: VideoRequest, spec: ModelSpec, limits: ApiLimits, filename: str) -> None:
    """Decode the request's image in the image pool within `limits.image_decode_timeout_s` (`vidray.serve.images.
    ImageDecoder`), so a job is stored only for an image that decodes. Raises RequestError as `_image_error`."""
    header = images.ImageHeader(request.input_reference_format, *request.input_reference_size)
    try:
        await images.decoder(limits.image_decode_workers).decode(
            request.input_reference, header, max_side_px=_image_side_limit(spec, limits),
            timeout_s=limits.image_decode_timeout_s)
    except images.ImageRefused as err:
        raise _image_error(err, filename) from None


def _data_url_cap(limits: ApiLimits) -> int:
    """Longest accepted `input_reference.image_url`, in characters: base64 of `max_image_bytes` plus a header."""
    return 4 * (limits.max_image_bytes // 3 + 1) + MAX_NAME_CHARS


def _image_from_reference(image_url: str | None, file_id: str | None,
                          limits: ApiLimits) -> tuple[str, str, bytes]:
    """The SDK's `ImageInputReferenceParam` ({"image_url": ...} or {"file_id": ...}) -> an image tuple.
    Only base64 `data:` URLs are accepted: this server fetches nothing. Raises RequestError 400 (413 for a URL
    longer than `_data_url_cap`). Plain string operations, linear in the URL's length."""
    if file_id is not None:
        raise RequestError(400, "input_reference", "input_reference.file_id is not supported here (no file "
                           "store); upload the image as the input_reference file part")
    url = image_url or ""
    if len(url) > _data_url_cap(limits):
        raise RequestError(413, "input_reference", f"input_reference.image_url is {len(url)} characters, above the "
                           f"limit {_data_url_cap(limits)} (an image of {limits.max_image_bytes} bytes in base64); "
                           "send a smaller image", code="request_too_large")
    head, comma, payload = url.strip().partition(",")
    media_type = head[len("data:"):].split(";")[0]
    if not (head.startswith("data:") and head.endswith(";base64") and comma):
        raise RequestError(400, "input_reference", f"input_reference.image_url {_shown(url)} is not a base64 data "
                           "URL; this server fetches no URLs: send 'data:image/png;base64,...' or upload the "
                           "image as the input_reference file part")
    try:
        data = base64.b64decode(payload, validate=True)
    except (binascii.Error, ValueError):
        raise RequestError(400, "input_reference", "input_reference.image_url holds invalid base64 after "
                           "';base64,'") from None
    return ("image_url", media_type or "application/octet-stream", data)


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


class _BodyTooLarge(Exception):
    pass


def _counting_receive(receive: Receive, max_bytes: int) -> Receive:
    """Wrap an ASGI `receive` so the request body raises `_BodyTooLarge` once it passes `max_bytes` (chunked
    bodies carry no Content-Length to check up front)."""
    seen = 0

    async def wrapped() -> Message:
        nonlocal seen
        message = await receive()
        if message["type"] == "http.request":
            seen += len(message.get("body", b""))
            if seen > max_bytes:
                raise _BodyTooLarge()
        return message

    return wrapped


def _check_declared_length(request: Request, limits: ApiLimits) -> None:
    """A `Content-Length` over `limits.max_body_bytes` -> 413 before the body is read; not ASCII digits -> 400."""
    declared = request.headers.get("content-length")
    if declared is None:
        return
    if not (declared.isascii() and declared.strip().isdigit()):  # "²".isdigit() is True and int() raises on it
        raise RequestError(400, "content-length", f"Content-Length {_shown(declared)} is not a byte count")
    if int(declared) > limits.max_body_bytes:
        raise _too_large(limits, int(declared))


_QUERY_CAPS = {"after": MAX_ID_CHARS, "limit": MAX_NUMBER_CHARS, "order": MAX_CHOICE_CHARS,
               "variant": MAX_CHOICE_CHARS}
_PATH_CAPS = {"video_id": MAX_ID_CHARS}
_HEADER_CAPS = ("authorization", "content-type", "content-length", "idempotency-key")


def _check_request_lengths(request: Request) -> None:
    """Every route's first step (a FastAPI dependency): the URL path, the query string, each query parameter, path
    parameter and parsed header is within its cap, before any of it is parsed further or looked up. Raises
    RequestError 414 (path or query string) or 400 naming the parameter."""
    path, query = request.scope.get("raw_path") or b"", request.scope.get("query_string") or b""
    if len(path) > MAX_HEADER_CHARS or len(query) > MAX_QUERY_BYTES:
        what, size, cap = ("URL path", len(path), MAX_HEADER_CHARS) if len(path) > MAX_HEADER_CHARS else (
            "query string", len(query), MAX_QUERY_BYTES)
        raise RequestError(414, None, f"the {what} is {size} bytes, above the limit {cap}; video ids are "
                           f"{MAX_ID_CHARS} characters at most", code="uri_too_long")
    for name in _HEADER_CAPS:
        _check_length(name, request.headers.get(name) or "", MAX_HEADER_CHARS, "send a shorter header")
    for name, value in request.query_params.multi_items():
        _check_length(name, value, _QUERY_CAPS.get(name, MAX_QUERY_BYTES))
    for name, value in request.path_params.items():
        _check_length(name, value, _PATH_CAPS.get(name, MAX_HEADER_CHARS))


def _too_large(limits: ApiLimits, size: int | None) -> RequestError:
    # A chunked body (no Content-Length) is read only up to the limit, so its size is unknown.
    shown = f"is {size} bytes, above" if size is not None else "(sent without a Content-Length) is larger than"
    return RequestError(413, None, f"request body {shown} the limit {limits.max_body_bytes} bytes; "
                        f"a prompt may hold at most {limits.max_prompt_chars} characters and an input_reference "
                        f"image at most {limits.max_image_bytes} bytes", code="request_too_large")


TEXT_FIELDS = ("prompt", "negative_prompt", "model", "size")
"""Create fields that are text: a JSON body must give them as strings (a number there is a client bug, not text)."""


class _JsonNumber(str):
    """A JSON number kept as the text sent (the decoder's parse_int/parse_float): never converted while decoding,
    so a 5,000-digit integer is a length error naming its field, not Python's int-digit ValueError (was a 500)."""


class _JsonConstant(str):
    """NaN, Infinity or -Infinity, which Python's json accepts and JSON (RFC 8259) has not: refused naming the field."""


_JSON = json.JSONDecoder(parse_int=_JsonNumber, parse_float=_JsonNumber, parse_constant=_JsonConstant)
"""Decodes one JSON scalar (`_JsonText.scalar`); numbers stay text."""
_JSON_SPACE = re.compile(r"[ \t\n\r]*")
_JSON_KINDS = {"[": "an array", "{": "an object", '"': "a string", "t": "a boolean", "f": "a boolean", "n": "null"}


def _json_kind(text: str, pos: int) -> str:
    """What the JSON value at `pos` is, from its first character ("an array", "a number", ...)."""
    first = text[pos:pos + 1]
    if not first:
        return "nothing"
    return _JSON_KINDS.get(first) or ("a number" if first in "-0123456789" else f"text that is not JSON ({first!r})")


class _JsonText:
    """A create body's JSON text, walked member by member so that every error names the field it is in.

    Only scalars are decoded, each on its own by the C scanner (`_JSON.raw_decode`), and only the objects the body
    may hold (the body, `input_reference`) are walked: an array or object anywhere else is refused from its first
    character, before it is read. Linear in the body's length; no recursion, however deep the nesting. `bad_at`
    is the index of the first character that was not UTF-8 in the body (decoded with surrogateescape), or None.
    """

    def __init__(self, text: str, bad_at: int | None, bad_byte: str) -> None:
        self.text, self.bad_at, self.bad_byte = text, bad_at, bad_byte

    def fail(self, pos: int, key: str | None, what: str) -> RequestError:
        """The error for a problem at `pos` inside `key`'s member: a non-UTF-8 byte before it is named first."""
        if self.bad_at is not None and self.bad_at <= pos:
            where = f"{key} is" if key is not None else "request body is"
            return RequestError(400, key, f"{where} not UTF-8 text ({self.bad_byte}); send JSON UTF-8 encoded")
        where = f"{key}: " if key is not None else "request body is not valid JSON: "
        return RequestError(400, key, f"{where}{what}")

    def skip(self, pos: int) -> int:
        return _JSON_SPACE.match(self.text, pos).end()

    def scalar(self, pos: int, key: str | None) -> tuple[Any, int]:
        """The string, number, true, false or null at `pos` and the index after it. Raises RequestError 400
        naming `key` for anything else (an array or object: `what` says which)."""
        kind = _json_kind(self.text, pos)
        if kind in ("an array", "an object"):
            raise RequestError(400, key, f"{key} must be a string or a number, got {kind}; the create fields are "
                               "strings and numbers")
        try:
            value, end = _JSON.raw_decode(self.text, pos)
        except json.JSONDecodeError as exc:
            raise self.fail(exc.pos, key, f"{exc.msg} at character {exc.pos}") from None
        if self.bad_at is not None and self.bad_at < end:
            raise self.fail(end, key, "")
        return value, end

    def members(self, pos: int, key: str | None = None) -> tuple[dict[str, Any], int]:
        """The object at `pos` (the body when `key` is None, else the field `key`) as {name: value} and the index
        after it; `input_reference` in the body is walked as an object too. Raises RequestError 400: not an
        object, bad syntax, more than `MAX_JSON_FIELDS` members, a name given twice or longer than
        `MAX_NAME_CHARS`, a value that is not JSON, a byte that is not UTF-8."""
        text, pos = self.text, self.skip(pos)
        if not text.startswith("{", pos):
            if self.bad_at is not None and self.bad_at <= pos:
                raise self.fail(pos, key, "")
            what = "request body must be a JSON object {...}" if key is None else f"{key} must be a JSON object"
            raise RequestError(400, key, f"{what}, got {_json_kind(text, pos)}")
        members: dict[str, Any] = {}
        pos = self.skip(pos + 1)
        more = not text.startswith("}", pos)
        while more:
            name, pos = self.member_name(pos, len(members), key)
            pos = self.skip(pos + 1)
            if key is None and name == "input_reference" and text.startswith(("{", "["), pos):
                value, pos = self.members(pos, name)
            else:
                value, pos = self.scalar(pos, name if key is None else f"{key}.{name}")
            if name in members:
                raise RequestError(400, key or name, f"field {_shown(name)} is given twice; send it once")
            members[name] = value
            pos = self.skip(pos)
            more = text.startswith(",", pos)
            pos = self.skip(pos + 1) if more else pos
        if not text.startswith("}", pos):
            raise self.fail(pos, key, f"expected ',' or the object's closing '}}' at character {pos}")
        return members, pos + 1

    def member_name(self, pos: int, count: int, key: str | None) -> tuple[str, int]:
        """The `count`-th member name at `pos` in the object `key` and the index of the ':' after it."""
        if count >= MAX_JSON_FIELDS:
            raise RequestError(400, key, f"{key or 'request body'} has more than {MAX_JSON_FIELDS} fields; the "
                               f"create fields are {', '.join(CREATE_FIELDS)}, input_reference")
        if not self.text.startswith('"', pos):
            raise self.fail(pos, key, f"expected a field name in double quotes at character {pos}")
        name, end = self.scalar(pos, key)
        if len(name) > MAX_NAME_CHARS:
            raise RequestError(400, key, f"a field name is {len(name)} characters, above the limit "
                               f"{MAX_NAME_CHARS}; the fields are {', '.join(CREATE_FIELDS)}, input_reference")
        end = self.skip(end)
        if not self.text.startswith(":", end):
            raise self.fail(end, key, f"expected ':' after the field name at character {end}")
        return name, end

    def body(self) -> dict[str, Any]:
        """The body's top-level object (`members`), which must be all the body holds."""
        members, end = self.members(0)
        if self.skip(end) != len(self.text):
            raise self.fail(end, None, f"unexpected data after the JSON object at character {end}")
        return members


def _json_text(body: bytes) -> _JsonText:
    """A JSON body's bytes as text (a UTF-8 BOM is dropped); bytes that are not UTF-8 are kept as surrogates and
    recorded, so the error can name the field they are in."""
    if body.startswith(b"\xef\xbb\xbf"):
        body = body[3:]
    try:
        return _JsonText(body.decode("utf-8"), None, "")
    except UnicodeDecodeError as exc:
        bad_at = len(body[:exc.start].decode("utf-8"))
        return _JsonText(body.decode("utf-8", "surrogateescape"), bad_at,
                         f"byte 0x{body[exc.start]:02x} at byte {exc.start} of the body")


def _json_fields(body: bytes, limits: ApiLimits) -> tuple[dict[str, str], tuple[str, str, bytes] | None]:
    """A JSON create body -> (text fields, image). Numbers become the text sent (never converted here), except in
    `TEXT_FIELDS`, which must be strings; NaN and Infinity are refused. Every problem is a 400 naming its field.
    Linear in the body's length (bounded by `limits.max_body_bytes`)."""
    fields: dict[str, str] = {}
    image = None
    for name, value in _json_text(body).body().items():
        if name == "input_reference":
            if value is None:
                continue
            if (not isinstance(value, dict) or set(value) - {"image_url", "file_id"}
                    or not all(v is None or type(v) is str for v in value.values())):
                raise RequestError(400, "input_reference", "input_reference in a JSON body must be "
                                   "{\"image_url\": \"data:image/png;base64,...\"}; or send multipart/form-data "
                                   "with the image as the input_reference file part")
            image = _image_from_reference(value.get("image_url"), value.get("file_id"), limits)
        elif value is None:
            continue
        elif isinstance(value, _JsonConstant):
            raise RequestError(400, name, f"{name} is {value}, which JSON has not (RFC 8259); send a finite number")
        elif isinstance(value, _JsonNumber) and name in TEXT_FIELDS:
            raise RequestError(400, name, f"{name} must be a JSON string, got {_shown(value)[1:-1]}")
        elif isinstance(value, str):
            fields[name] = str(value)
        else:  # true or false: arrays and objects were refused while walking
            kind = "JSON string" if name in TEXT_FIELDS else "string or a number"
            raise RequestError(400, name, f"{name} must be a {kind}, got {json.dumps(value)}")
    return fields, image


def _utf8_text(data: bytes, name: str | None) -> str:
    """A form field's bytes (`name`, or the field's name itself when None) as text; not UTF-8 -> RequestError 400.
    Starlette decodes such bytes as Latin-1 (`starlette.formparsers._user_safe_decode`, and every urlencoded
    name and value), and a prompt would silently change."""
    try:
        return bytes(data).decode("utf-8")
    except UnicodeDecodeError as exc:
        what = f"form field {name!r}" if name is not None else "a form field's name"
        raise RequestError(400, name, f"{what} is not UTF-8 text (byte 0x{data[exc.start]:02x} at byte "
                           f"{exc.start}); send text fields UTF-8 encoded, as the openai SDK and browsers do") from None


def _form_byte_cap(name: str, limits: ApiLimits) -> int | None:
    """The most bytes a text form field `name` may hold as sent in multipart (UTF-8: up to 4 bytes a character;
    the exact character count is checked by `parse_video_request`), or None for a name that is not a field."""
    if name in CREATE_FIELDS:
        return 4 * _field_cap(name, limits)
    if name == "input_reference[image_url]":
        return _data_url_cap(limits)
    if name == "input_reference[file_id]":
        return 4 * MAX_NAME_CHARS
    return None


def _form_keeps(name: str, limits: ApiLimits, size: int, encoded: int = 1) -> bool:
    """Whether to keep the next bytes of form field `name`, `size` bytes so far (sent `encoded` bytes a byte).
    False for a name that is no field: its value is dropped, `parse_video_request` refuses the name. Raises
    RequestError 400 naming the field once it is over its cap."""
    cap = _form_byte_cap(name, limits)
    if cap is None:
        return False
    if size > cap * encoded:
        raise RequestError(400, name, f"{name} is over {cap * encoded} bytes as sent, above its limit; shorten it")
    return True


class _UTF8MultiPartParser(MultiPartParser):
    """Starlette's multipart parser, but bounded and UTF-8: every part's headers, name and text are capped as they
    stream in (a part over its cap is a 400 before the rest is read), the image part's bytes are counted but not
    kept past `limits.max_image_bytes` (413 at its end), and a text part or part name that is not UTF-8 is a 400
    (`_utf8_text`), where Starlette would decode it as Latin-1 or as the body's `charset`."""

    def __init__(self, *args: Any, limits: ApiLimits, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.limits = limits
        self._part_bytes = 0
        self._header_bytes = 0

    def on_part_begin(self) -> None:
        super().on_part_begin()
        self._part_bytes = self._header_bytes = 0

    def on_header_field(self, data: bytes, start: int, end: int) -> None:
        self._count_header(end - start)
        super().on_header_field(data, start, end)

    def on_header_value(self, data: bytes, start: int, end: int) -> None:
        self._count_header(end - start)
        super().on_header_value(data, start, end)

    def _count_header(self, size: int) -> None:
        self._header_bytes += size
        if self._header_bytes > MAX_HEADER_CHARS:
            raise RequestError(400, None, f"a multipart part's headers are over {MAX_HEADER_CHARS} bytes; send "
                               "Content-Disposition with a field name (and a filename for the image) only")

    def on_headers_finished(self) -> None:
        super().on_headers_finished()
        part = self._current_part
        part.field_name = _utf8_text(_disposition_name(part.content_disposition), None)
        if part.file is not None and part.field_name != "input_reference":
            raise _unexpected_file_part(part.field_name)

    def on_part_data(self, data: bytes, start: int, end: int) -> None:
        part = self._current_part
        self._part_bytes += end - start
        if part.file is None:
            keep = _form_keeps(part.field_name, self.limits, self._part_bytes)
        else:  # counted to the end for the 413, not kept past the limit
            keep = self._part_bytes <= self.limits.max_image_bytes
        if keep:
            super().on_part_data(data, start, end)

    def on_part_end(self) -> None:
        part = self._current_part
        if part.file is not None and self._part_bytes > self.limits.max_image_bytes:
            raise _image_too_large(part.file.filename or "input_reference", self._part_bytes, self.limits)
        super().on_part_end()
        if part.file is None:
            self.items[-1] = (part.field_name, _utf8_text(part.data, part.field_name))


def _disposition_name(content_disposition: bytes) -> bytes:
    name = parse_options_header(content_disposition)[1][b"name"]
    if len(name) > MAX_NAME_CHARS:
        raise RequestError(400, None, f"a form field's name is {len(name)} bytes, above the limit {MAX_NAME_CHARS}; "
                           f"the fields are {', '.join(CREATE_FIELDS)} and the file part input_reference")
    return name


class _UTF8FormParser(FormParser):
    """Starlette's urlencoded parser, but bounded and UTF-8: a name or value over its cap (percent-encoded: up to
    3 bytes a byte) is a 400 as it streams in; names and values are UTF-8 after percent-decoding (not UTF-8 ->
    400): Starlette reads raw bytes as Latin-1 and replaces bad %-escapes with U+FFFD."""

    def __init__(self, *args: Any, limits: ApiLimits, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.limits = limits
        self._name: str | None = None

    def on_field_start(self) -> None:
        super().on_field_start()
        self._name = None

    def on_field_name(self, data: bytes, start: int, end: int) -> None:
        if len(self._field_name) + end - start > 3 * MAX_NAME_CHARS:
            raise RequestError(400, None, f"a form field's name is over {3 * MAX_NAME_CHARS} bytes as sent; the "
                               f"fields are {', '.join(CREATE_FIELDS)}")
        super().on_field_name(data, start, end)

    def on_field_data(self, data: bytes, start: int, end: int) -> None:
        if self._name is None:  # the name is complete once its value starts
            self._name = _utf8_text(unquote_to_bytes(bytes(self._field_name).replace(b"+", b" ")), None)
        if _form_keeps(self._name, self.limits, len(self._field_value) + end - start, encoded=3):
            super().on_field_data(data, start, end)

    def on_field_end(self) -> None:
        raw_name, raw_value = bytes(self._field_name), bytes(self._field_value)
        super().on_field_end()
        name = _utf8_text(unquote_to_bytes(raw_name.replace(b"+", b" ")), None)
        self._items[-1] = (name, _utf8_text(unquote_to_bytes(raw_value.replace(b"+", b" ")), name))


async def _form_fields(request: Request, limits: ApiLimits) -> tuple[dict[str, str], tuple[str, str, bytes] | None]:
    """A multipart/form-data or urlencoded create body -> (text fields, image). Text must be UTF-8 (400 otherwise,
    naming the field); a `charset` other than UTF-8 in the Content-Type is a 415. Every field is capped as it
    streams in (`_UTF8MultiPartParser`, `_UTF8FormParser`): time linear in the body, space bounded by the caps."""
    content_type, options = parse_options_header(request.headers.get("content-type") or "")
    charset = options.get(b"charset", b"utf-8").decode("latin-1")
    if charset.lower().replace("-", "").replace("_", "") != "utf8":
        raise RequestError(415, "content-type", f"charset {charset!r} is not accepted: send the form's "
                           "text UTF-8 encoded, with no charset or charset=utf-8", code="unsupported_media_type")
    try:
        async with aclosing(request.stream()) as stream:
            if content_type == b"multipart/form-data":
                form = await _UTF8MultiPartParser(request.headers, stream, max_files=4, max_fields=64,
                                                  limits=limits).parse()
            else:
                form = await _UTF8FormParser(request.headers, stream, max_fields=64, limits=limits).parse()
    except MultiPartException as exc:  # multipart syntax errors, too many fields or files, a part over 1 MB
        raise RequestError(400, None, f"malformed form body: {exc.message}") from None
    try:
        fields: dict[str, str] = {}
        uploads: list[tuple[str, UploadFile]] = []
        reference: dict[str, str] = {}
        for name, value in form.multi_items():
            if isinstance(value, UploadFile):
                uploads.append((name, value))
            elif name in ("input_reference[image_url]", "input_reference[file_id]"):
                reference[name[len("input_reference["):-1]] = value
            elif name in fields:
                raise RequestError(400, name, f"field {_shown(name)} is given twice; send it once")
            else:
                fields[name] = value
        if len(uploads) + bool(reference) > 1:
            raise RequestError(400, "input_reference", "input_reference is given more than once; send one image")
        if uploads:
            upload = uploads[0][1]
            data = await upload.read()
            image = (upload.filename or "input_reference", upload.content_type or "", data)
        elif reference:
            image = _image_from_reference(reference.get("image_url"), reference.get("file_id"), limits)
        else:
            image = None
        return fields, image
    finally:
        await form.close()


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
                  dependencies=[Depends(_check_request_lengths)])

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
        path = _shown(request.url.path)[1:-1]
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
        _check_declared_length(request, limits)
        limited = Request(request.scope, _counting_receive(request.receive, limits.max_body_bytes))
        content_type = (request.headers.get("content-type") or "").split(";")[0].strip().lower()
        try:
            if content_type in ("multipart/form-data", "application/x-www-form-urlencoded"):
                fields, image = await _form_fields(limited, limits)
            elif content_type == "application/json":
                fields, image = _json_fields(await limited.body(), limits)
            else:
                raise RequestError(415, "content-type", f"Content-Type {content_type or '(none)'!r} is not "
                                   "accepted; send multipart/form-data (as the openai SDK does), "
                                   "application/x-www-form-urlencoded (as `curl -d` does) or application/json",
                                   code="unsupported_media_type")
        except _BodyTooLarge:
            raise _too_large(limits, None) from None
        # Fields and the image's header on the loop (bounded, linear); the image's decode in its own pool.
        video_request = parse_video_request(fields, image, spec=service.spec, limits=limits)
        if video_request.input_reference is not None:
            await _decode_image(video_request, service.spec, limits, image[0])
        return JSONResponse(await _submit(service, video_request, request.state.client, idempotency_key))

    @app.get("/v1/videos")
    async def list_videos(
        request: Request, after: str | None = None, limit: str | None = None, order: str | None = None
    ) -> JSONResponse:
        service = authorized(request)
        count = 20
        if limit is not None:
            count = _parse_int("limit", limit, "1..100")
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
