"""The create request of the serve plane and its validation: what the model can make (`ModelSpec`), a validated
`POST /v1/videos` (`VideoRequest`), and `parse_video_request`, which checks the text fields and the first-frame
image (`input_reference`) against both before any model work.

`vidray.serve.wire` turns a body into (fields, image) first; `vidray.serve.routes` calls `parse_video_request` on
them, then `decode_input_reference` for an image, and hands the `VideoRequest` to the job runner
(`vidray.serve.app`); the model deployments never see HTTP. What to generate is a
`vidray.inference.request.GenerationRequest` (`VideoRequest.generation`), whose rules (prompt, steps, guidance,
seed, the bucket against the family's card) are the ones `vidray generate` applies, worded with the same text;
this module keeps the Videos API's own: text to numbers, `size` and `seconds`, the serving limits, the image.
Refusals are `vidray.serve.errors.RequestError`s, each naming the field, the value, the rule and the fix. No Ray
and no torch in this module.

Create fields beyond the SDK's (`prompt`, `model`, `size`, `seconds`, `input_reference`) are sent with
``extra_body={"num_frames": 49, "seed": 7, ...}``; the SDK turns them into form fields. See
`parse_video_request` for every field's rule.
"""

from __future__ import annotations

import math
import re
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field

from vidray.inference.request import (
    MAX_NUM_INFERENCE_STEPS,
    SEED_MAX,
    STORED_IMAGE,
    GenerationRequest,
    GenerationRequestError,
    Problem,
    field_problems,
    is_blank,
)
from vidray.serve import images
from vidray.serve.errors import (
    CREATE_FIELDS,
    MAX_NUMBER_CHARS,
    ApiLimits,
    RequestError,
    check_length,
    field_cap,
    image_too_large,
    shown,
)

__all__ = [
    "MAX_SEED",
    "ModelSpec",
    "VideoRequest",
    "decode_input_reference",
    "parse_int",
    "parse_video_request",
]

MAX_SEED = SEED_MAX
"""Largest accepted `seed` (`vidray.inference.request.SEED_MAX`)."""


# --------------------------------------------------------------------------------------------------------------
# What the model can make, a validated request
# --------------------------------------------------------------------------------------------------------------


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
    """Width and height must be multiples of this, in pixels (16 for EasyAnimate: VAE 8x and patch 2); serving's
    `vidray.serve.app.model_spec` reads it from the family card's bucket rules, the rule `GenerationRequest` checks,
    so this early check only adds the nearest valid sizes to the message."""
    max_width: int
    """Largest width in pixels (memory bound)."""
    max_height: int
    """Largest height in pixels (memory bound)."""
    max_num_frames: int
    """Largest frame count (memory bound)."""
    valid_num_frames: Callable[[int], bool]
    """Which frame counts the model can make, e.g. EasyAnimate: 1 or 4k+1 (temporal VAE compression 4); from the
    family card (`vidray.buckets.check_bucket`) in serving, as `size_multiple`."""
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
    family: str | None = None
    """The model's family (`vidray.cards`): each `GenerationRequest` is checked against its card; None: not."""

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
    """A validated `POST /v1/videos` request, ready for the job runner. Built only by `parse_video_request`: the
    `GenerationRequest` (what to generate, `vidray.inference.request`) and what the Videos API adds around it (the
    model's name, the `seconds` string, the uploaded first frame). The generation fields read through
    (`request.prompt`, `request.width`, ...)."""

    generation: GenerationRequest
    """What to generate: prompt, negative prompt, num_frames x height x width, steps, guidance, seed, fps; `image`
    is `STORED_IMAGE` when `input_reference` is given."""
    model: str
    """Always the serving model's `ModelSpec.name`."""
    seconds: str
    """The clip's actual duration num_frames / fps, as the video object's `seconds` string (e.g. "4.125")."""
    input_reference: bytes | None = field(default=None, repr=False)
    """The first-frame image file's own bytes, as uploaded (PNG, JPEG or WebP; not re-encoded), or None for
    text-to-video."""
    input_reference_size: tuple[int, int] | None = None
    """(width, height) of `input_reference` in pixels, from its header; None for text-to-video."""
    input_reference_format: str | None = None
    """Its format, a key of `vidray.serve.images.IMAGE_FORMATS` ("PNG", "JPEG", "WEBP"); None for text-to-video."""

    def __getattr__(self, name: str):
        """The generation fields (prompt, width, height, num_frames, seed, num_inference_steps, guidance_scale,
        negative_prompt, fps), read from `generation`."""
        if name in _GENERATION_FIELDS:
            return getattr(self.generation, name)
        raise AttributeError(f"{type(self).__name__!r} object has no attribute {name!r}")

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


_GENERATION_FIELDS = frozenset(("prompt", "negative_prompt", "width", "height", "num_frames", "seed",
                                "num_inference_steps", "guidance_scale", "fps"))
"""`VideoRequest`'s attributes read from its `GenerationRequest`."""

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


def _refusal(problem: Problem) -> RequestError:
    """A `GenerationRequest` rule's problem as the 400 naming its field (the bucket's: `size`); a missing prompt is
    `missing_required_parameter`."""
    param = "size" if problem.field in ("bucket", "height", "width") else problem.field
    param = "input_reference" if param == "image" else param
    code = "missing_required_parameter" if problem.field == "prompt" else "invalid_value"
    return RequestError(400, param, problem.message(), code=code)


def _check(limits: ApiLimits, **values) -> None:
    """Apply the request's rules (`vidray.inference.request.field_problems`) to `values`, steps capped at
    `limits.max_num_inference_steps`; raise the first problem's 400 (`_refusal`)."""
    problems = field_problems(values, max_num_inference_steps=min(limits.max_num_inference_steps,
                                                                  MAX_NUM_INFERENCE_STEPS))
    if problems:
        raise _refusal(problems[0])


def parse_int(name: str, text: str, what: str) -> int:
    """An ASCII decimal integer (surrounding whitespace allowed) of at most `MAX_NUMBER_CHARS` characters; else
    RequestError 400 naming `name` and describing the valid values as `what`. Linear in len(text)."""
    check_length(name, text, MAX_NUMBER_CHARS, f"send an integer ({what})")
    if not _INT_RE.fullmatch(text.strip()):
        raise RequestError(400, name, f"{name} must be an integer ({what}), got {text!r}")
    return int(text)


def _parse_float(name: str, text: str, what: str) -> float:
    """An ASCII decimal or exponent number (surrounding whitespace allowed) of at most `MAX_NUMBER_CHARS`
    characters, finite; else RequestError 400 naming `name` and describing the valid values as `what`. Linear in
    len(text)."""
    check_length(name, text, MAX_NUMBER_CHARS, f"send a number ({what})")
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
            The prompt, seed, steps and guidance rules are the `GenerationRequest`'s (`vidray.inference.request.
            field_problems`, the same text `vidray generate` gives), applied here as each field is read so the
            first bad field is the one reported; the request is then built, with the bucket checked against
            `spec.family`'s card.
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
            check_length(name, fields[name], field_cap(name, limits))

    # 1c. Control characters (NUL, ESC, ...; tab and newlines are text) in any field: a client bug, never a prompt.
    for name in sorted(fields):
        bad = _CONTROL_RE.search(fields[name] or "")
        if bad:
            raise RequestError(400, name, f"{name} contains U+{ord(bad.group()):04X} at character {bad.start()}, "
                               "which is not text (a control character or an unpaired surrogate); remove it (tab "
                               "and newlines are allowed)")

    def given(name: str) -> str | None:
        value = fields.get(name)
        return None if value is None or is_blank(value) else value.strip()

    # 2. Prompt.
    prompt = (fields.get("prompt") or "").strip()
    _check(limits, prompt=prompt)

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
        num_frames = parse_int("num_frames", num_frames_text, "a frame count")
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
        seed = parse_int("seed", text, f"0..{MAX_SEED}")
        _check(limits, seed=seed)
    num_inference_steps = spec.default_num_inference_steps
    if (text := given("num_inference_steps")) is not None:
        num_inference_steps = parse_int("num_inference_steps", text, f"1..{limits.max_num_inference_steps}")
        _check(limits, num_inference_steps=num_inference_steps)
    guidance_scale = float(spec.default_guidance_scale)
    if (text := given("guidance_scale")) is not None:
        guidance_scale = _parse_float("guidance_scale", text, ">= 1.0")
        _check(limits, guidance_scale=guidance_scale)
    negative_prompt = "" if is_blank(fields.get("negative_prompt") or "") else fields["negative_prompt"].strip()

    # 7. Image.
    input_reference = input_reference_size = input_reference_format = None
    if image is not None:
        header = _check_image(image, spec=spec, limits=limits)
        input_reference, input_reference_format = image[2], header.format
        input_reference_size = (header.width, header.height)

    # 8. The request itself, all its rules at once and the bucket against the family's card.
    try:
        generation = GenerationRequest(
            prompt=prompt, negative_prompt=negative_prompt, num_frames=num_frames, height=height, width=width,
            num_inference_steps=num_inference_steps, guidance_scale=guidance_scale, seed=seed, fps=float(spec.fps),
            image=None if image is None else STORED_IMAGE, family=spec.family,
        )
    except GenerationRequestError as err:
        raise _refusal(err.problems[0]) from None
    return VideoRequest(
        generation=generation,
        model=spec.name,
        seconds=_format_seconds(num_frames, spec.fps),
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
    return RequestError(400, unknown[0], f"unknown field(s) {', '.join(shown(u) for u in unknown)}; accepted "
                        f"fields: {', '.join(CREATE_FIELDS)} and the file part input_reference",
                        code="unknown_parameter")


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
        raise image_too_large(filename, len(data), limits)
    try:
        return images.inspect_image(data, max_side_px=_image_side_limit(spec, limits),
                                    what=f"input_reference {shown(filename)}")
    except images.ImageRefused as err:
        raise _image_error(err, filename) from None


def _image_error(err: images.ImageRefused, filename: str) -> RequestError:
    """An `ImageRefused` as the request's answer (param input_reference; a 503 gets Retry-After)."""
    message = str(err)
    if not message.startswith("input_reference"):
        message = f"input_reference {shown(filename)}: {message}"
    headers = {"Retry-After": "2"} if err.status == 503 else None
    return RequestError(err.status, "input_reference", message, code=err.code, headers=headers)


async def decode_input_reference(request: VideoRequest, spec: ModelSpec, limits: ApiLimits, filename: str) -> None:
    """Decode the request's image in the image pool within `limits.image_decode_timeout_s` (`vidray.serve.images.
    ImageDecoder`), so a job is stored only for an image that decodes. Raises RequestError as `_image_error`."""
    header = images.ImageHeader(request.input_reference_format, *request.input_reference_size)
    try:
        await images.decoder(limits.image_decode_workers).decode(
            request.input_reference, header, max_side_px=_image_side_limit(spec, limits),
            timeout_s=limits.image_decode_timeout_s)
    except images.ImageRefused as err:
        raise _image_error(err, filename) from None
