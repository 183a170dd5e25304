"""The first-frame image of `POST /v1/videos` costs bounded work (issue 44, part 2; `vidray.serve.images`): PNG, JPEG
and WebP only, by their bytes; a JPEG with more scans than an encoder writes is refused by a linear marker walk
before any decode; decoding runs in a pool of its own with a deadline, so the route threads stay free for reads
and downloads; the side limit follows the model; the store keeps the upload's own bytes and the runner deletes
them once the VAE stage no longer needs them."""

from __future__ import annotations

import asyncio
import http.client
import io
import threading
import time

import numpy as np
import pytest
from PIL import Image
from starlette.testclient import TestClient

from tests.unit.test_serve_api import (BOUNDARY, SPEC, TOKEN, FakeVideoService, ServiceSlot, multipart,
                                      uvicorn_in_thread)
from vidray.serve import images
from vidray.serve.api import ModelSpec, _check_image
from vidray.serve.errors import ApiLimits, RequestError
from vidray.serve.routes import build_api

I2V_SPEC = ModelSpec(**{**SPEC.__dict__, "supports_image_to_video": True})
"""The fake service's model, taking a first frame."""
FORM = {"Content-Type": f"multipart/form-data; boundary={BOUNDARY}"}


def gradient(width: int, height: int) -> Image.Image:
    """A smooth RGB image (compresses well: a big image in a small file)."""
    y, x = np.mgrid[0:height, 0:width]
    return Image.fromarray(np.stack([x * 255 // width, y * 255 // height, (x + y) * 255 // (width + height)],
                                    -1).astype(np.uint8))


def encoded(fmt: str, width: int = 32, height: int = 24, mode: str = "RGB", **options) -> bytes:
    out = io.BytesIO()
    gradient(width, height).convert(mode).save(out, format=fmt, **options)
    return out.getvalue()


def _scans(data: bytes) -> list[tuple[int, int]]:
    """(start, end) of each scan (its SOS segment and entropy-coded data) of a JPEG written by Pillow."""
    spans, pos = [], 0
    while (start := data.find(b"\xff\xda", pos)) >= 0:
        length = int.from_bytes(data[start + 2:start + 4], "big")
        pos = images._NEXT_MARKER.search(data, start + 2 + length).start()
        spans.append((start, pos))
    return spans


def jpeg_with_scans(num_scans: int, width: int = 64, height: int = 64) -> bytes:
    """A progressive JPEG (libjpeg's 10 scans, via Pillow) with its smallest refinement scan repeated before EOI
    until it holds `num_scans` scans: what a crafted many-scan file looks like (libjpeg decodes it, warning)."""
    data = encoded("JPEG", width, height, progressive=True, quality=90)
    spans = _scans(data)
    start, end = min(spans[1:], key=lambda span: span[1] - span[0])
    return data[:-2] + data[start:end] * (num_scans - len(spans)) + data[-2:]


def refused(data: bytes, *, spec: ModelSpec = I2V_SPEC, limits: ApiLimits = ApiLimits()) -> RequestError:
    with pytest.raises(RequestError) as info:
        _check_image(("first.jpg", "image/jpeg", data), spec=spec, limits=limits)
    assert info.value.param == "input_reference" and 400 <= info.value.status < 500
    return info.value


@pytest.mark.parametrize(("fmt", "mode", "options"), [
    ("PNG", "RGB", {}), ("PNG", "P", {}), ("PNG", "RGBA", {}), ("PNG", "L", {}),
    ("JPEG", "RGB", {}), ("JPEG", "RGB", {"progressive": True}), ("JPEG", "L", {"progressive": True}),
    ("JPEG", "CMYK", {"progressive": True}), ("WEBP", "RGB", {}), ("WEBP", "RGBA", {"lossless": True}),
    ("WEBP", "RGB", {"exif": b"Exif\x00\x00"}),  # VP8X, the extended header
])
def test_png_jpeg_and_webp_pass_with_their_size_from_the_header_and_decode(fmt, mode, options):
    data = encoded(fmt, 40, 24, mode, **options)
    header = _check_image(("first", "", data), spec=I2V_SPEC, limits=ApiLimits())
    assert (header.format, header.width, header.height) == (fmt, 40, 24)
    assert images.decode_image(data, header, max_side_px=64) == (40, 24)


def test_libjpegs_own_progressive_files_are_within_the_scan_bound_and_one_more_scan_is_not():
    """What a real encoder writes (libjpeg's `jpeg_simple_progression` via Pillow: 10 scans for colour, 6 for
    grayscale, 18 for CMYK) passes; `MAX_JPEG_SCANS` passes; one more is refused, naming the bound and the fix."""
    written = {mode: images.jpeg_header(encoded("JPEG", 64, 64, mode, progressive=True)).num_scans
               for mode in ("RGB", "L", "CMYK")}
    assert written == {"RGB": 10, "L": 6, "CMYK": 18}
    assert max(written.values()) * 3 < images.MAX_JPEG_SCANS
    at_bound = jpeg_with_scans(images.MAX_JPEG_SCANS)
    assert _check_image(("a.jpg", "", at_bound), spec=I2V_SPEC, limits=ApiLimits()).num_scans == 64
    error = refused(jpeg_with_scans(images.MAX_JPEG_SCANS + 1))
    assert error.code == "image_too_complex"
    assert "more than 64 scans" in error.message and "re-encode it" in error.message


def test_a_crafted_many_scan_jpeg_is_refused_within_100_ms_of_cpu_before_any_decode(tmp_path):
    crafted = jpeg_with_scans(60_000)  # ~1 MiB of tiny scans: each one a pass over the image for the decoder
    # A real JPEG, walked to its end:
    assert images.jpeg_header(crafted, max_scans=10**6, max_segments=10**6).num_scans == 60_000
    limits = ApiLimits(max_image_bytes=len(crafted))
    start = time.process_time()
    error = refused(crafted, limits=limits)
    assert time.process_time() - start < 0.1
    assert "more than 64 scans" in error.message
    # Through the route: a 400 at once, nothing stored.
    slot = ServiceSlot()
    slot.service = FakeVideoService(tmp_path, spec=I2V_SPEC, limits=ApiLimits(max_image_bytes=len(crafted),
                                                                              max_body_bytes=2 * len(crafted)))
    with TestClient(build_api(lambda: slot.service), headers={"Authorization": f"Bearer {TOKEN}"}) as client:
        start = time.perf_counter()
        response = client.post("/v1/videos", content=multipart({"prompt": "a"}, ("a.jpg", "image/jpeg", crafted)),
                               headers=FORM)
    assert time.perf_counter() - start < 1.0
    assert response.status_code == 400 and response.json()["error"]["code"] == "image_too_complex"
    assert slot.service.requests == []


def test_a_jpeg_of_many_marker_segments_is_refused_in_bounded_steps():
    data = encoded("JPEG")
    comments = b"\xff\xfe\x00\x03x" * 100_000  # 100,000 COM segments after SOI
    start = time.process_time()
    error = refused(data[:2] + comments + data[2:])
    assert time.process_time() - start < 0.1
    assert f"more than {images.MAX_JPEG_SEGMENTS} marker segments" in error.message


@pytest.mark.parametrize(("fmt", "name"), [("GIF", "GIF"), ("BMP", "BMP"), ("TIFF", "TIFF"), ("ICO", "ICO"),
                                           ("PPM", "not an image format this server knows")])
def test_other_formats_are_a_400_naming_them_and_the_accepted_ones_whatever_the_content_type(tmp_path, fmt, name):
    slot = ServiceSlot()
    slot.service = FakeVideoService(tmp_path, spec=I2V_SPEC, limits=ApiLimits())
    with TestClient(build_api(lambda: slot.service), headers={"Authorization": f"Bearer {TOKEN}"}) as client:
        body = multipart({"prompt": "a"}, ("first.png", "image/png", encoded(fmt)))  # a PNG by its name and type
        start = time.perf_counter()
        response = client.post("/v1/videos", content=body, headers=FORM)
        assert time.perf_counter() - start < 1.0
    error = response.json()["error"]
    assert (response.status_code, error["param"], error["code"]) == (400, "input_reference",
                                                                      "unsupported_image_format")
    assert f"'first.png' is {name}" in error["message"]
    assert "only PNG, JPEG or WebP images are accepted" in error["message"]
    assert slot.service.requests == []


def test_the_side_limit_follows_the_models_largest_bucket_and_sizes(tiny_serve_model_dir, tmp_path):
    from vidray.models.export import inspect_model
    from vidray.serve.app import IMAGE_SIDE_FACTOR, ServeSettings, model_spec

    info = inspect_model(tiny_serve_model_dir)  # one bucket, 9x64x48
    settings = ServeSettings(model_path=str(tiny_serve_model_dir), store_dir=str(tmp_path),
                             limits={"max_width": 48, "max_height": 64})
    spec = ModelSpec(**{**model_spec(settings, info).__dict__, "supports_image_to_video": True})
    assert spec.max_image_px == IMAGE_SIDE_FACTOR * 64  # its bucket (9x64x48) and largest request: 64 high
    assert _check_image(("a", "", encoded("PNG", 128, 20)), spec=spec, limits=ApiLimits()).width == 128
    error = refused(encoded("PNG", 129, 20), spec=spec)
    assert "129x20 pixels, above the limit 128 per side for this model" in error.message
    wide = model_spec(settings.model_copy(update={"limits": settings.limits.model_copy(update={"max_width": 512})}),
                      info)
    assert wide.max_image_px == 1024  # a request may ask a 512-wide video
    assert refused(encoded("PNG", 300, 20), spec=spec, limits=ApiLimits(max_image_px=256)).message.endswith(
        "resize it to at most 128x128")  # the smaller of the two bounds


def test_decoding_waits_in_its_own_pool_under_a_deadline_naming_why():
    big = encoded("JPEG", 4096, 4096, progressive=True)  # ~0.1-0.3 s to decode
    header = images.jpeg_header(big)
    pool = images.ImageDecoder(1)

    async def two_at_once():
        return await asyncio.gather(pool.decode(big, header, max_side_px=4096, timeout_s=0.02),
                                    pool.decode(big, header, max_side_px=4096, timeout_s=0.02),
                                    return_exceptions=True)

    slow, waiting = asyncio.run(two_at_once())
    assert isinstance(slow, images.ImageRefused) and (slow.status, slow.code) == (400, "image_too_complex")
    assert "took more than 0.02 s to decode" in str(slow)
    assert isinstance(waiting, images.ImageRefused) and (waiting.status, waiting.code) == (503,
                                                                                           "service_unavailable")
    assert "decoding other images" in str(waiting)
    assert asyncio.run(pool.decode(big, header, max_side_px=4096, timeout_s=30)) == (4096, 4096)
    with pytest.raises(images.ImageRefused, match="does not decode"):
        asyncio.run(pool.decode(big[:len(big) // 2], header, max_side_px=4096, timeout_s=30))


@pytest.fixture
def image_server(tmp_path):
    """(base URL, FakeVideoService): uvicorn on a free 127.0.0.1 port, an image-to-video model, 8 MiB images."""
    slot = ServiceSlot()
    slot.service = FakeVideoService(tmp_path, spec=I2V_SPEC, limits=ApiLimits(
        max_body_bytes=16 * 2**20, max_image_bytes=8 * 2**20, image_decode_timeout_s=120))
    with uvicorn_in_thread(build_api(lambda: slot.service)) as port:
        yield f"127.0.0.1:{port}", slot.service


def _post(address: str, body: bytes) -> int:
    connection = http.client.HTTPConnection(address, timeout=120)
    try:
        connection.request("POST", "/v1/videos", body=body, headers={**FORM, "Authorization": f"Bearer {TOKEN}"})
        return connection.getresponse().status
    finally:
        connection.close()


def test_get_answers_while_forty_image_uploads_are_in_flight(image_server):
    """Forty uploads of a big progressive JPEG (each ~0.1 s of CPU to decode): before, each held one of
    Starlette's 40 route threads while it decoded (and re-encoded a PNG), and a GET waited for them all; now they
    wait for the image pool's 2 threads on the event loop, and the GET's store read gets a route thread at once
    (under a second even on a loaded machine)."""
    address, service = image_server
    service.videos["video_0001"] = {"id": "video_0001", "object": "video", "status": "queued", "progress": 0,
                                    "created_at": 1, "model": SPEC.name, "seconds": "1", "size": "64x48"}
    body = multipart({"prompt": "a red fox"}, ("first.jpg", "image/jpeg",
                                               encoded("JPEG", 3072, 3072, progressive=True)))
    statuses: list[int] = []
    uploads = [threading.Thread(target=lambda: statuses.append(_post(address, body))) for _ in range(40)]
    for upload in uploads:
        upload.start()
    time.sleep(0.5)  # the bodies are in, the decodes under way
    connection = http.client.HTTPConnection(address, timeout=60)
    start = time.perf_counter()
    connection.request("GET", "/v1/videos/video_0001", headers={"Authorization": f"Bearer {TOKEN}"})
    response = connection.getresponse()
    get_s, in_flight = time.perf_counter() - start, 40 - len(statuses)
    assert response.status == 200 and b"video_0001" in response.read()
    for upload in uploads:
        upload.join(timeout=120)
    assert get_s < 1.0 and in_flight >= 20, (get_s, in_flight)  # 2.3 s with the decodes in the route threads
    assert statuses == [200] * 40 and len(service.requests) == 40
    assert all(r.input_reference == body[body.index(b"\xff\xd8"):body.rindex(b"\r\n--")] for r in service.requests)


@pytest.mark.parametrize("max_attempts", [1, 2])
def test_the_store_keeps_the_uploads_own_bytes_until_the_vae_stage_no_longer_needs_them(tiny_serve_model_dir, tmp_path,
                                                                                      max_attempts):
    """The job store files the upload as sent (a .jpg here, not a PNG re-encode). The runner deletes it right after
    the VAE stage encoded it on the job's last attempt (the denoiser then runs without it on disk), else once the
    job finished (a retry after a replica died encodes it again)."""
    from tests.unit.test_serve_app import _Stages, run_until_finished
    from vidray.inference.request import GenerationRequest
    from vidray.serve.api import VideoRequest
    from vidray.serve.app import ServeSettings, VideoJobService

    upload = encoded("JPEG", 40, 30, progressive=True)
    settings = ServeSettings(model_path=str(tiny_serve_model_dir), store_dir=str(tmp_path / "store"),
                             store_on="replica", runner={"poll_s": 0.05, "max_attempts": max_attempts})
    on_disk_while_denoising = []

    class Stages(_Stages):
        def __getattr__(self, name):
            if name == "encode_image":  # the condition: none needed by the stand-in denoiser
                async def condition():
                    return {}
                return type("Method", (), {"remote": staticmethod(lambda *args: condition())})()
            if name == "denoise":
                on_disk_while_denoising.append(sorted(p.name for p in (tmp_path / "store" / "inputs").iterdir()))
            return super().__getattr__(name)

    async def scenario():
        stages = Stages(np.zeros((9, 64, 48, 3), dtype=np.uint8))
        service = VideoJobService(settings, None, stages, stages, stages)
        generation = GenerationRequest(prompt="a", width=48, height=64, num_frames=9, seed=0, num_inference_steps=2,
                                       guidance_scale=1.0, fps=8.0, image="input_reference")
        request = VideoRequest(generation=generation, model="vidray", seconds="1.125", input_reference=upload,
                               input_reference_size=(40, 30), input_reference_format="JPEG")
        job = await service.submit(request)
        assert service.store.read_input(job["id"]) == upload  # the upload's own bytes
        return job["id"], await run_until_finished(service, job["id"], timeout_s=30)

    job_id, (job, store) = asyncio.run(scenario())
    assert job.status == "completed", job
    assert job.input_reference.endswith(f"{job_id}.jpg")
    assert on_disk_while_denoising == [[] if max_attempts == 1 else [f"{job_id}.jpg"]]
    assert store.read_input(job_id) is None and list((tmp_path / "store" / "inputs").iterdir()) == []
