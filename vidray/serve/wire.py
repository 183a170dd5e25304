"""The wire side of a `POST /v1/videos`: a request body's bytes -> (text fields, optional image part), and the size
checks that come before any of it is parsed.

- Sizes: `check_request_lengths` (every route's first step: path, query, headers), `check_declared_length` (a
  `Content-Length` over `ApiLimits.max_body_bytes` is a 413 before the body is read), `counting_receive` (a
  chunked body raises `BodyTooLarge` once past it; `too_large` words the 413).
- JSON: `json_fields`, a strict walk of the body's text (RFC 8259: no NaN, no duplicate names; numbers kept as the
  text sent; only scalars decoded), every error naming its field.
- Forms: `form_fields`, Starlette's multipart and urlencoded parsers capped as the body streams in and UTF-8 only.
- An `input_reference` sent as a field is a base64 `data:` URL (`_image_from_reference`); this server fetches
  nothing.

Every step is linear in the (capped) body and raises `vidray.serve.errors.RequestError` naming the field at fault.
The fields are not validated here (`vidray.serve.api.parse_video_request` does that); the routes
(`vidray.serve.routes.build_api`) call these. Imports only `vidray.serve.errors` of vidray.
"""

from __future__ import annotations

import base64
import binascii
import json
import re
from contextlib import aclosing
from typing import Any
from urllib.parse import unquote_to_bytes

from fastapi import Request
from python_multipart.multipart import parse_options_header
from starlette.datastructures import UploadFile
from starlette.formparsers import FormParser, MultiPartException, MultiPartParser
from starlette.types import Message, Receive

from vidray.serve.errors import (
    CREATE_FIELDS,
    MAX_CHOICE_CHARS,
    MAX_HEADER_CHARS,
    MAX_ID_CHARS,
    MAX_JSON_FIELDS,
    MAX_NAME_CHARS,
    MAX_NUMBER_CHARS,
    MAX_QUERY_BYTES,
    ApiLimits,
    RequestError,
    check_length,
    field_cap,
    image_too_large,
    shown,
)

__all__ = [
    "TEXT_FIELDS",
    "BodyTooLarge",
    "check_declared_length",
    "check_request_lengths",
    "counting_receive",
    "form_fields",
    "json_fields",
    "too_large",
]

# --------------------------------------------------------------------------------------------------------------
# Size checks, before any parsing
# --------------------------------------------------------------------------------------------------------------


class BodyTooLarge(Exception):
    """Raised by a `counting_receive` wrapper once the body it has read passes its byte limit (the route answers
    `too_large`)."""


def counting_receive(receive: Receive, max_bytes: int) -> Receive:
    """Wrap an ASGI `receive` so the request body raises `BodyTooLarge` once it passes `max_bytes` (chunked
    bodies carry no Content-Length to check up front)."""
    seen = 0

    async def wrapped() -> Message:
        nonlocal seen
        message = await receive()
        if message["type"] == "http.request":
            seen += len(message.get("body", b""))
            if seen > max_bytes:
                raise BodyTooLarge()
        return message

    return wrapped


def check_declared_length(request: Request, limits: ApiLimits) -> None:
    """A `Content-Length` over `limits.max_body_bytes` -> 413 before the body is read; not ASCII digits -> 400."""
    declared = request.headers.get("content-length")
    if declared is None:
        return
    if not (declared.isascii() and declared.strip().isdigit()):  # "²".isdigit() is True and int() raises on it
        raise RequestError(400, "content-length", f"Content-Length {shown(declared)} is not a byte count")
    if int(declared) > limits.max_body_bytes:
        raise too_large(limits, int(declared))


_QUERY_CAPS = {"after": MAX_ID_CHARS, "limit": MAX_NUMBER_CHARS, "order": MAX_CHOICE_CHARS,
               "variant": MAX_CHOICE_CHARS}
_PATH_CAPS = {"video_id": MAX_ID_CHARS}
_HEADER_CAPS = ("authorization", "content-type", "content-length", "idempotency-key")


def check_request_lengths(request: Request) -> None:
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
        check_length(name, request.headers.get(name) or "", MAX_HEADER_CHARS, "send a shorter header")
    for name, value in request.query_params.multi_items():
        check_length(name, value, _QUERY_CAPS.get(name, MAX_QUERY_BYTES))
    for name, value in request.path_params.items():
        check_length(name, value, _PATH_CAPS.get(name, MAX_HEADER_CHARS))


def too_large(limits: ApiLimits, size: int | None) -> RequestError:
    """The 413 for a request body over `limits.max_body_bytes`: `size` is its declared length in bytes, or None
    for a chunked body cut off at the limit; returned, for the caller to raise."""
    # A chunked body (no Content-Length) is read only up to the limit, so its size is unknown.
    stated = f"is {size} bytes, above" if size is not None else "(sent without a Content-Length) is larger than"
    return RequestError(413, None, f"request body {stated} the limit {limits.max_body_bytes} bytes; "
                        f"a prompt may hold at most {limits.max_prompt_chars} characters and an input_reference "
                        f"image at most {limits.max_image_bytes} bytes", code="request_too_large")


# --------------------------------------------------------------------------------------------------------------
# Image references sent as fields (a base64 data URL)
# --------------------------------------------------------------------------------------------------------------


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
        raise RequestError(400, "input_reference", f"input_reference.image_url {shown(url)} is not a base64 data "
                           "URL; this server fetches no URLs: send 'data:image/png;base64,...' or upload the "
                           "image as the input_reference file part")
    try:
        data = base64.b64decode(payload, validate=True)
    except (binascii.Error, ValueError):
        raise RequestError(400, "input_reference", "input_reference.image_url holds invalid base64 after "
                           "';base64,'") from None
    return ("image_url", media_type or "application/octet-stream", data)


# --------------------------------------------------------------------------------------------------------------
# JSON bodies
# --------------------------------------------------------------------------------------------------------------

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
                raise RequestError(400, key or name, f"field {shown(name)} is given twice; send it once")
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


def json_fields(body: bytes, limits: ApiLimits) -> tuple[dict[str, str], tuple[str, str, bytes] | None]:
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
            raise RequestError(400, name, f"{name} must be a JSON string, got {shown(value)[1:-1]}")
        elif isinstance(value, str):
            fields[name] = str(value)
        else:  # true or false: arrays and objects were refused while walking
            kind = "JSON string" if name in TEXT_FIELDS else "string or a number"
            raise RequestError(400, name, f"{name} must be a {kind}, got {json.dumps(value)}")
    return fields, image

# --------------------------------------------------------------------------------------------------------------
# Form bodies (multipart/form-data, application/x-www-form-urlencoded)
# --------------------------------------------------------------------------------------------------------------


def _unexpected_file_part(name: str) -> RequestError:
    return RequestError(400, name, f"unexpected file part {shown(name)}; the only file part accepted is "
                        "input_reference (the first-frame image)", code="unknown_parameter")


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
        return 4 * field_cap(name, limits)
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
            raise image_too_large(part.file.filename or "input_reference", self._part_bytes, self.limits)
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


async def form_fields(request: Request, limits: ApiLimits) -> tuple[dict[str, str], tuple[str, str, bytes] | None]:
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
                raise RequestError(400, name, f"field {shown(name)} is given twice; send it once")
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
