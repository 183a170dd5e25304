"""The first-frame image of `POST /v1/videos` (`input_reference`): which files are taken, and decoding them in a
bounded pool, so that no upload can buy minutes of CPU or hold the threads the other routes need (issue 44, part 2).

Three steps, cheapest first (`vidray.serve.api` calls them):

1. `inspect_image` (on the event loop, before anything is decoded): the magic bytes must say PNG, JPEG or WebP
   (`IMAGE_FORMATS`); the width and height are read from the file's own header (PNG's IHDR, JPEG's SOF, WebP's
   VP8/VP8L/VP8X chunk). A JPEG's markers are walked once, linearly (`jpeg_header`): more than `MAX_JPEG_SCANS`
   scans (SOS markers) or `MAX_JPEG_SEGMENTS` marker segments is refused there. A progressive JPEG's decoder
   passes over the whole image once per scan (~1.4 ms a scan measured on a small image, so a 4 MiB file of
   tiny scans held a thread for ~210 s of CPU); real encoders write few: libjpeg's `jpeg_simple_progression`
   (Pillow's `progressive=True`, cjpeg -progressive) writes 10 scans for YCbCr, 6 for grayscale and 18 for CMYK
   (2 + 4 per component; measured with Pillow 13 here), a baseline file 1 per component at most. 64 leaves 3.5x
   the most of those.
2. `ImageDecoder.decode` (off the event loop, in its own small pool, never Starlette's threads): Pillow opens the
   file as its sniffed format only and decodes it fully (`decode_image`), within a deadline; the side limit is
   checked again on Pillow's own reading of the size.
3. The upload's own bytes are what the job store keeps (`VideoRequest.input_reference`, with its format's suffix):
   no re-encode. The VAE stage decodes them again (`vidray.serve.stages.VaeDecoder.encode_image`, the same
   formats) and the runner deletes them once it no longer needs them (`vidray.serve.app`).

No Ray and no torch here; Pillow is imported only by the decode (step 2).
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import functools
import io
import re
import struct
from dataclasses import dataclass

__all__ = [
    "IMAGE_FORMATS",
    "MAX_JPEG_SCANS",
    "MAX_JPEG_SEGMENTS",
    "ImageDecoder",
    "ImageHeader",
    "ImageRefused",
    "decode_image",
    "decoder",
    "inspect_image",
    "jpeg_header",
]

IMAGE_FORMATS: dict[str, str] = {"PNG": ".png", "JPEG": ".jpg", "WEBP": ".webp"}
"""The formats taken (Pillow's format names) and the suffix the job store files each under."""

ALLOWED = "PNG, JPEG or WebP"
"""The accepted formats, as error messages name them."""

MAX_JPEG_SCANS = 64
"""Most scans (SOS markers) a JPEG may hold; more is refused before any decode (the module docstring's numbers:
libjpeg writes at most 18, for a progressive CMYK file)."""

MAX_JPEG_SEGMENTS = 1024
"""Most marker segments a JPEG may hold (APPn, DQT, DHT, SOF, SOS, ...): a real file has tens (a progressive one a
DHT before each scan at most), and the walk in `jpeg_header` then does at most this many steps in Python."""

_MAGIC = (
    (b"\x89PNG\r\n\x1a\n", "PNG"),
    (b"\xff\xd8\xff", "JPEG"),
)
_OTHER_MAGIC = (
    (b"GIF87a", "GIF"), (b"GIF89a", "GIF"), (b"BM", "BMP"), (b"II*\x00", "TIFF"), (b"MM\x00*", "TIFF"),
    (b"8BPS", "PSD"), (b"\x00\x00\x01\x00", "ICO"), (b"\x00\x00\x00\x0cjP  ", "JPEG 2000"), (b"qoif", "QOI"),
    (b"%PDF", "PDF"), (b"<svg", "SVG"), (b"<?xml", "XML (SVG?)"),
)
"""Formats refused with their name in the message (a guess from the magic bytes, for the sender's sake)."""

_FILL = re.compile(rb"\xff+")
"""JPEG fill bytes before a marker code."""
_NEXT_MARKER = re.compile(rb"\xff[^\x00\xd0-\xd7\xff]")
"""The marker ending a scan's entropy-coded data: 0xFF then a code that is not a stuffed zero, a restart marker
(RST0-7, inside the scan) or another fill byte. One byte class after one literal: linear, no backtracking."""
_SOF = frozenset({0xC0, 0xC1, 0xC2, 0xC3, 0xC5, 0xC6, 0xC7, 0xC9, 0xCA, 0xCB, 0xCD, 0xCE, 0xCF})
_STANDALONE = frozenset({0x01, *range(0xD0, 0xD8)})


class ImageRefused(ValueError):
    """An `input_reference` that is not taken. `status` is the HTTP status (400, or 503 when the server is busy),
    `code` the OpenAI error code; the message names what was wrong and what is accepted."""

    def __init__(self, message: str, *, status: int = 400, code: str = "invalid_image") -> None:
        super().__init__(message)
        self.status = status
        self.code = code


@dataclass(frozen=True)
class ImageHeader:
    """What `inspect_image` read from an image file's header, without decoding it."""

    format: str
    """Pillow's format name, a key of `IMAGE_FORMATS`."""
    width: int
    """Pixels, from the file's header."""
    height: int
    """Pixels, from the file's header."""
    num_scans: int = 1
    """A JPEG's scans (SOS markers); 1 for the other formats."""

    @property
    def suffix(self) -> str:
        """The file suffix the store keeps the upload under (".png", ".jpg", ".webp")."""
        return IMAGE_FORMATS[self.format]


def _format_name(data: bytes) -> str | None:
    """The format the magic bytes say, among `IMAGE_FORMATS`; None for any other."""
    for magic, name in _MAGIC:
        if data.startswith(magic):
            return name
    if data[:4] == b"RIFF" and data[8:12] == b"WEBP":
        return "WEBP"
    return None


def _other_format(data: bytes) -> str:
    """A refused file's format, for the message ("GIF", "an unknown format")."""
    for magic, name in _OTHER_MAGIC:
        if data.startswith(magic):
            return name
    if data[4:8] == b"ftyp":
        return "HEIF/AVIF (ISO media)"
    return "not an image format this server knows"


def inspect_image(data: bytes, *, max_side_px: int, what: str = "input_reference") -> ImageHeader:
    """Check an image file's bytes without decoding them: the format by its magic bytes, the size from its header,
    a JPEG's marker segments and scans (`jpeg_header`). Linear in len(data), bounded steps in Python.

    Args:
        data: the file's bytes, as uploaded.
        max_side_px: the largest width and height accepted, in pixels.
        what: how messages name the image (e.g. "input_reference 'first.png'").

    Returns:
        The header read.

    Raises:
        ImageRefused: empty, another format than PNG, JPEG or WebP, a header that does not parse, a side above
            `max_side_px`, a JPEG with more than `MAX_JPEG_SCANS` scans or `MAX_JPEG_SEGMENTS` segments.
    """
    if not data:
        raise ImageRefused(f"{what} is empty; upload a {ALLOWED} file")
    name = _format_name(data)
    if name is None:
        raise ImageRefused(f"{what} is {_other_format(data)} (by its first bytes); only {ALLOWED} images are "
                           "accepted: convert it to one of them", code="unsupported_image_format")
    try:
        if name == "PNG":
            header = _png_header(data)
        elif name == "JPEG":
            header = jpeg_header(data)
        else:
            header = _webp_header(data)
    except (struct.error, IndexError):
        raise ImageRefused(f"{what} is a {name} file whose header is cut short; upload the whole file") from None
    if header.width < 1 or header.height < 1:
        raise ImageRefused(f"{what} is a {name} file whose header gives the size {header.width}x{header.height}; "
                           "upload an image with a valid header")
    if header.width > max_side_px or header.height > max_side_px:
        raise ImageRefused(f"{what} is {header.width}x{header.height} pixels, above the limit {max_side_px} per "
                           f"side for this model; resize it to at most {max_side_px}x{max_side_px}")
    return header


def _png_header(data: bytes) -> ImageHeader:
    if data[12:16] != b"IHDR":
        raise ImageRefused("the PNG file does not start with its IHDR chunk; upload a valid PNG")
    width, height = struct.unpack(">II", data[16:24])
    return ImageHeader("PNG", width, height)


def _webp_header(data: bytes) -> ImageHeader:
    chunk = data[12:16]
    if chunk == b"VP8X":  # extended: the canvas size, 24-bit little-endian minus one
        width = 1 + int.from_bytes(data[24:27], "little")
        height = 1 + int.from_bytes(data[27:30], "little")
    elif chunk == b"VP8L":  # lossless: 14-bit fields minus one after the 0x2f signature
        if data[20] != 0x2F:
            raise ImageRefused("the WebP file's VP8L chunk has no signature; upload a valid WebP")
        bits = int.from_bytes(data[21:25], "little")
        width, height = 1 + (bits & 0x3FFF), 1 + ((bits >> 14) & 0x3FFF)
    elif chunk == b"VP8 ":  # lossy: the key frame's start code, then 14-bit sizes
        if data[23:26] != b"\x9d\x01\x2a":
            raise ImageRefused("the WebP file's VP8 chunk has no key frame start code; upload a valid WebP")
        width, height = (v & 0x3FFF for v in struct.unpack("<HH", data[26:30]))
    else:
        raise ImageRefused(f"the WebP file's first chunk is {chunk!r}, not VP8, VP8L or VP8X; upload a valid WebP")
    return ImageHeader("WEBP", width, height)


def jpeg_header(data: bytes, *, max_scans: int = MAX_JPEG_SCANS,
                max_segments: int = MAX_JPEG_SEGMENTS) -> ImageHeader:
    """Walk a JPEG's markers once, from SOI to EOI (or the end of the data), counting its scans: each marker
    segment is skipped by its length, each scan's entropy-coded data by one regex search for the next marker
    (`_NEXT_MARKER`, in C). Stops as soon as a bound is passed: a file of a million tiny scans is refused after
    `max_scans` + 1 of them. Linear in len(data); at most `max_segments` steps in Python.

    Returns:
        The header: the size from the (first) SOF segment, the number of scans.

    Raises:
        ImageRefused: more than `max_scans` scans or `max_segments` segments, no SOF segment, bytes that are not
            a marker where one must be.
        struct.error, IndexError: the data ends inside a segment header (the caller names it cut short).
    """
    pos, end = 2, len(data)
    scans = segments = 0
    size: tuple[int, int] | None = None
    while pos < end:
        if data[pos] != 0xFF:
            raise ImageRefused(f"the JPEG file has byte 0x{data[pos]:02x} at byte {pos} where a marker must be; "
                               "upload a valid JPEG")
        pos = _FILL.match(data, pos).end()
        marker = data[pos]
        pos += 1
        segments += 1
        if segments > max_segments:
            raise ImageRefused(f"the JPEG file has more than {max_segments} marker segments (a real encoder writes "
                               "tens); re-encode it, e.g. as a baseline JPEG or a PNG")
        if marker == 0xD9:  # EOI
            break
        if marker in _STANDALONE:
            continue
        (length,) = struct.unpack(">H", data[pos:pos + 2])
        if length < 2:
            raise ImageRefused(f"the JPEG file has a segment of length {length} at byte {pos}; upload a valid JPEG")
        if marker in _SOF and size is None:
            height, width = struct.unpack(">HH", data[pos + 3:pos + 7])
            size = (width, height)
        pos += length
        if marker == 0xDA:  # SOS: its entropy-coded data runs to the next marker
            scans += 1
            if scans > max_scans:
                raise ImageRefused(f"the JPEG file has more than {max_scans} scans (progressive passes); encoders "
                                   "write at most 18 (libjpeg's progressive mode: 10 for colour), and each one "
                                   "costs a pass over the whole image; re-encode it, e.g. as a baseline JPEG or "
                                   "a PNG", code="image_too_complex")
            found = _NEXT_MARKER.search(data, pos)
            if found is None:  # the data ends inside the scan: Pillow decides whether it decodes
                break
            pos = found.start()
    if size is None:
        raise ImageRefused("the JPEG file has no frame header (SOF) before its image data; upload a valid JPEG")
    return ImageHeader("JPEG", size[0], size[1], num_scans=scans)


def decode_image(data: bytes, header: ImageHeader, *, max_side_px: int) -> tuple[int, int]:
    """Decode the whole image with Pillow, as the format `inspect_image` found only (first frame of an animated
    file), to prove it decodes before a job is stored; runs in `ImageDecoder`'s pool.

    Returns:
        (width, height) in pixels as Pillow reads them.

    Raises:
        ImageRefused: Pillow cannot decode it (its error named), or its size is above `max_side_px`.
    """
    from PIL import Image  # heavy: PIL, only where an image is decoded (`import vidray.serve.api` stays light)

    try:
        with Image.open(io.BytesIO(data), formats=(header.format,)) as img:
            width, height = img.size
            if width > max_side_px or height > max_side_px:
                raise ImageRefused(f"the image is {width}x{height} pixels, above the limit {max_side_px} per side "
                                   f"for this model; resize it to at most {max_side_px}x{max_side_px}")
            img.load()
    except ImageRefused:
        raise
    except Exception as exc:  # Pillow raises many types (UnidentifiedImageError, OSError, SyntaxError, ValueError)
        raise ImageRefused(f"the {header.format} file does not decode ({type(exc).__name__}: {exc}); upload a "
                           f"valid {ALLOWED} file") from None
    return width, height


class ImageDecoder:
    """A pool of `workers` threads of its own for `decode_image`, and a deadline on every decode: image work never
    takes the threads of Starlette's pool (40, shared by every route's store reads and downloads), and at most
    `workers` images decode at once whatever the number of uploads; the others wait on the event loop, holding
    no thread. (Pillow releases the GIL while it decodes, so the event loop keeps serving.)"""

    def __init__(self, workers: int) -> None:
        if not isinstance(workers, int) or workers < 1:
            raise ValueError(f"ImageDecoder needs workers >= 1, got {workers!r}")
        self.workers = workers
        self._pool = concurrent.futures.ThreadPoolExecutor(workers, thread_name_prefix="vidray-image")

    async def decode(self, data: bytes, header: ImageHeader, *, max_side_px: int,
                     timeout_s: float) -> tuple[int, int]:
        """`decode_image` in this pool, waiting at most `timeout_s` seconds for a thread and the decode together.

        Raises:
            ImageRefused: what `decode_image` raises; 400 `image_too_complex` when the decode itself ran past the
                deadline (it still ends in its thread: the bounds of `inspect_image` keep it short); 503
                `service_unavailable` when no thread came free before the deadline (the caller sends Retry-After).
        """
        future = self._pool.submit(decode_image, data, header, max_side_px=max_side_px)
        try:
            return await asyncio.wait_for(asyncio.wrap_future(future), timeout_s)
        except asyncio.TimeoutError:
            if future.cancelled():  # still queued: cancelled with the wait (wrap_future cancels what did not start)
                raise ImageRefused(f"the server is decoding other images and none finished within {timeout_s:g} s; "
                                   "retry in a few seconds", status=503, code="service_unavailable") from None
            raise ImageRefused(f"the image took more than {timeout_s:g} s to decode; send a smaller or simpler "
                               f"{ALLOWED} file", code="image_too_complex") from None
        finally:
            future.cancel()  # the client went away while it waited: a queued decode does not run


@functools.lru_cache(maxsize=None)
def decoder(workers: int) -> ImageDecoder:
    """The process's `ImageDecoder` of `workers` threads (one per setting, made on first use)."""
    return ImageDecoder(workers)
