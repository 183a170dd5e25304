"""What every layer of the serve plane's HTTP side refuses with, and the limits it checks: `RequestError` (a refusal
answered in the OpenAI error shape), `ApiLimits` (the operator's size limits), the fixed length caps (`MAX_*`),
the create fields (`CREATE_FIELDS`) and the few helpers that word a refusal (`shown`, `check_length`, `field_cap`,
`image_too_large`).

A leaf module: it imports nothing of vidray. `vidray.serve.wire` (body parsing), `vidray.serve.api` (request
validation) and `vidray.serve.routes` (the FastAPI app) raise and check with it, so none of them imports another
for an error or a limit; `vidray.serve.app` builds `ApiLimits` from its settings.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass

from fastapi.responses import JSONResponse

__all__ = [
    "CREATE_FIELDS",
    "MAX_CHOICE_CHARS",
    "MAX_HEADER_CHARS",
    "MAX_ID_CHARS",
    "MAX_JSON_FIELDS",
    "MAX_NAME_CHARS",
    "MAX_NUMBER_CHARS",
    "MAX_QUERY_BYTES",
    "MAX_SIZE_CHARS",
    "ApiLimits",
    "RequestError",
    "check_length",
    "field_cap",
    "image_too_large",
    "shown",
]

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


def field_cap(name: str, limits: ApiLimits) -> int:
    """The longest value accepted for create field `name` (one of `CREATE_FIELDS`), in characters as sent:
    `limits.max_prompt_chars` for the prompts, `MAX_SIZE_CHARS`, `MAX_NAME_CHARS` for model, else
    `MAX_NUMBER_CHARS`."""
    if name in ("prompt", "negative_prompt"):
        return limits.max_prompt_chars
    if name == "size":
        return MAX_SIZE_CHARS
    if name == "model":
        return MAX_NAME_CHARS
    return MAX_NUMBER_CHARS


def check_length(name: str, text: str, cap: int, fix: str = "shorten it") -> None:
    """Raise RequestError 400 naming `name` if `text` is longer than `cap` characters (before any parsing)."""
    if len(text) > cap:
        raise RequestError(400, name, f"{name} is {len(text)} characters, above the limit {cap}; {fix}")


def shown(text: str, limit: int = 60) -> str:
    """`text` for an error message: repr'd, cut to `limit` characters with "..." (never echo a megabyte back)."""
    return repr(text) if len(text) <= limit else repr(text[:limit]) + "..."


def image_too_large(filename: str, size: int, limits: ApiLimits) -> RequestError:
    """The 413 (param input_reference) for an image of `size` bytes over `limits.max_image_bytes`, naming the
    file (`filename`, cut by `shown`) and the limit; returned, for the caller to raise."""
    return RequestError(413, "input_reference", f"input_reference {shown(filename)} is {size} bytes, above the "
                        f"limit {limits.max_image_bytes} bytes; send a smaller (or compressed) image",
                        code="request_too_large")
