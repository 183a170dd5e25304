"""The OpenAI-compatible HTTP layer (`vidray.serve.api`): the real `openai` SDK against a real uvicorn server on
127.0.0.1, Starlette's TestClient for auth and every 4xx, and `parse_video_request` rules directly.

The service behind the routes is an in-memory fake (`FakeVideoService`) that records the `VideoRequest`s it gets.
"""

from __future__ import annotations

import contextlib
import io
import random
import threading
import time
import warnings
from collections.abc import Iterator
from pathlib import Path
from urllib.parse import quote

import httpx2
import openai
import pytest
import uvicorn
from PIL import Image
from starlette.testclient import TestClient

from vidray.serve.api import ModelSpec, VideoRequest, parse_video_request
from vidray.serve.api import _check_image
from vidray.serve.errors import ApiLimits, RequestError
from vidray.serve.routes import build_api, check_bearer
from vidray.serve.wire import _image_from_reference

pytestmark = pytest.mark.filterwarnings("ignore::DeprecationWarning")  # the SDK's Sora retirement notice

TOKEN = "s3cret-token"
FAKE_MP4 = b"\x00\x00\x00\x18ftypmp42\x00\x00\x00\x00mp42isom" + bytes(range(256)) * 4


def easyanimate_frames(num_frames: int) -> bool:
    """EasyAnimate's rule: 1 frame or 4k+1 frames."""
    return num_frames == 1 or num_frames % 4 == 1


SPEC = ModelSpec(
    name="vidray-tiny",
    default_size=(64, 48),
    default_num_frames=9,
    fps=8.0,
    size_multiple=16,
    max_width=256,
    max_height=128,
    max_num_frames=49,
    valid_num_frames=easyanimate_frames,
    supports_image_to_video=False,  # as every spec the app builds (`vidray.serve.app.model_spec`): text-to-video
    default_num_inference_steps=4,
    default_guidance_scale=6.0,
)
# Only to reach the image checks of `_check_image` in direct calls (no served model takes an image today).
IMAGE_CHECK_SPEC = ModelSpec(**{**SPEC.__dict__, "supports_image_to_video": True})
LIMITS = ApiLimits(max_body_bytes=64 * 1024, max_prompt_chars=100, max_image_bytes=16 * 1024, max_image_px=512,
                   max_num_inference_steps=50)


def png_bytes(width: int = 32, height: int = 24, color: tuple[int, int, int] = (200, 30, 90)) -> bytes:
    """A real PNG, one solid colour."""
    out = io.BytesIO()
    Image.new("RGB", (width, height), color).save(out, format="PNG")
    return out.getvalue()


class FakeVideoService:
    """An in-memory `VideoService`: a dict of video objects; `submit` records each `VideoRequest`."""

    def __init__(self, tmp_path: Path, *, spec: ModelSpec = SPEC, limits: ApiLimits = LIMITS,
                 auth_token: str | None = TOKEN) -> None:
        self.spec, self.limits, self.auth_token = spec, limits, auth_token
        self.tmp_path = tmp_path
        self.videos: dict[str, dict] = {}
        self.files: dict[str, Path] = {}
        self.requests: list[VideoRequest] = []

    async def submit(self, request: VideoRequest, *, client: str = "anonymous") -> dict:
        self.requests.append(request)
        video_id = f"video_{len(self.requests):04d}"
        self.videos[video_id] = {
            "id": video_id, "object": "video", "created_at": 1_700_000_000 + len(self.requests),
            "status": "queued", "progress": 0, "model": request.model, "seconds": request.seconds,
            "size": request.size, "prompt": request.prompt,
        }
        return dict(self.videos[video_id])

    def complete(self, video_id: str, data: bytes = FAKE_MP4) -> None:
        path = self.tmp_path / f"{video_id}.mp4"
        path.write_bytes(data)
        self.files[video_id] = path
        self.videos[video_id].update(status="completed", progress=100, completed_at=1_700_000_100)

    def get(self, video_id: str, *, client: str | None = None) -> dict | None:
        video = self.videos.get(video_id)
        return dict(video) if video is not None else None

    def list(self, *, after: str | None, limit: int, order: str, client: str | None = None) -> tuple[list[dict], bool]:
        ordered = sorted(self.videos.values(), key=lambda v: (v["created_at"], v["id"]), reverse=order == "desc")
        ids = [v["id"] for v in ordered]
        if after is not None and after not in ids:  # as JobStore.list does
            raise LookupError(f"after={after!r} is not the id of a stored video (deleted, or never existed)")
        start = ids.index(after) + 1 if after in ids else 0
        page = ordered[start:start + limit]
        return [dict(v) for v in page], start + limit < len(ordered)

    def delete(self, video_id: str, *, client: str | None = None) -> bool:
        self.files.pop(video_id, None)
        return self.videos.pop(video_id, None) is not None

    def open_video(self, video_id: str, *, client: str | None = None):
        video = self.videos.get(video_id)
        path = self.files.get(video_id) if video and video["status"] == "completed" else None
        try:
            return None if path is None else open(path, "rb")  # noqa: SIM115 - the route closes it
        except FileNotFoundError:  # as JobStore.open_video: a file gone is no video
            return None

    def health(self) -> dict:
        return {"status": "ok", "model": self.spec.name, "num_videos": len(self.videos)}


class ServiceSlot:
    """What `get_service` reads: tests swap the service (or set None) per test."""

    service: FakeVideoService | None = None


# --------------------------------------------------------------------------------------------------------------
# Fixtures: one real uvicorn server per module, a fresh fake service per test
# --------------------------------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def slot() -> ServiceSlot:
    return ServiceSlot()


@contextlib.contextmanager
def uvicorn_in_thread(app, *, log_level: str = "warning") -> Iterator[int]:
    """A real uvicorn server on 127.0.0.1 (a free port) serving the ASGI `app` in a thread; yields its port and
    stops it on exit. Raises RuntimeError when it does not start within 10 s."""
    server = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=0, log_level=log_level, lifespan="off"))
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    deadline = time.monotonic() + 10
    while not server.started:
        if time.monotonic() > deadline or not thread.is_alive():
            raise RuntimeError("uvicorn did not start within 10 s")
        time.sleep(0.01)
    try:
        yield server.servers[0].sockets[0].getsockname()[1]
    finally:
        server.should_exit = True
        thread.join(timeout=10)


@pytest.fixture(scope="module")
def server_url(slot: ServiceSlot):
    """A real uvicorn server on 127.0.0.1 (a free port) serving `build_api`, in a thread; yields its base URL."""
    with uvicorn_in_thread(build_api(lambda: slot.service)) as port:
        yield f"http://127.0.0.1:{port}"


@pytest.fixture
def service(slot: ServiceSlot, tmp_path: Path) -> FakeVideoService:
    slot.service = FakeVideoService(tmp_path)
    yield slot.service
    slot.service = None


@pytest.fixture
def sdk(server_url: str, service: FakeVideoService) -> openai.OpenAI:
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", DeprecationWarning)
        client = openai.OpenAI(base_url=f"{server_url}/v1", api_key=TOKEN, max_retries=0, timeout=10)
    yield client
    client.close()


@pytest.fixture
def client(slot: ServiceSlot, service: FakeVideoService) -> TestClient:
    with TestClient(build_api(lambda: slot.service), headers={"Authorization": f"Bearer {TOKEN}"}) as test_client:
        yield test_client


BOUNDARY = "vidray-b0undary"


def multipart(fields: dict, image: tuple[str, str, bytes] | None = None) -> bytes:
    """A multipart/form-data body (as the SDK sends it, even without a file): text fields, then the optional
    `input_reference` file part (filename, content_type, bytes)."""
    parts = [f'--{BOUNDARY}\r\nContent-Disposition: form-data; name="{name}"\r\n\r\n{value}\r\n'.encode()
             for name, value in fields.items()]
    if image is not None:
        filename, content_type, data = image
        parts.append(f'--{BOUNDARY}\r\nContent-Disposition: form-data; name="input_reference"; '
                     f'filename="{filename}"\r\nContent-Type: {content_type}\r\n\r\n'.encode() + data + b"\r\n")
    return b"".join(parts) + f"--{BOUNDARY}--\r\n".encode()


def create(client: TestClient, fields: dict, image: tuple[str, str, bytes] | None = None, **kwargs):
    """POST /v1/videos as multipart/form-data; `prompt` defaults to a valid one, a None value drops the field."""
    data = {k: v for k, v in {"prompt": "a red ball rolling", **fields}.items() if v is not None}
    headers = {"Content-Type": f"multipart/form-data; boundary={BOUNDARY}", **kwargs.pop("headers", {})}
    return client.post("/v1/videos", content=multipart(data, image), headers=headers, **kwargs)


def assert_error(response, status: int, param: str | None, *words: str) -> dict:
    """The response is `status` with the OpenAI error shape naming `param`, and its message holds `words`."""
    assert response.status_code == status, response.text
    error = response.json()["error"]
    assert set(error) == {"message", "type", "param", "code"}
    assert error["param"] == param, error
    assert error["type"] == ("server_error" if status >= 500 else "invalid_request_error")
    for word in words:
        assert word in error["message"], (word, error["message"])
    return error


# --------------------------------------------------------------------------------------------------------------
# The real openai SDK against a real uvicorn server
# --------------------------------------------------------------------------------------------------------------


def test_sdk_create_hands_the_parsed_request_with_extra_body_to_the_service(sdk, service):
    video = sdk.videos.create(
        prompt="  a red ball rolling  ",
        model="vidray-tiny",
        size="64x32",
        extra_body={"num_frames": 17, "seed": 7, "num_inference_steps": 3, "guidance_scale": 4.5,
                    "negative_prompt": "blurry"},
    )
    assert (video.id, video.object, video.status, video.size, video.seconds) == (
        "video_0001", "video", "queued", "64x32", "2.125")  # 17 frames / 8 fps
    [request] = service.requests
    assert (request.prompt, request.model, request.width, request.height, request.num_frames) == (
        "a red ball rolling", "vidray-tiny", 64, 32, 17)
    assert (request.seed, request.num_inference_steps, request.guidance_scale, request.negative_prompt) == (
        7, 3, 4.5, "blurry")
    assert request.input_reference is None


def test_sdk_create_with_an_image_on_the_real_apps_model_spec_is_400_naming_the_model(
        sdk, service, slot, tmp_path, tiny_serve_model_dir):
    # What the served app does (`vidray.serve.app.model_spec`, from an exported model): its models are text-to-
    # video, so an input_reference is a 400 that names the model, sent by the real SDK over real HTTP.
    from vidray.models.export import inspect_model
    from vidray.serve.app import ServeSettings, model_spec

    real = model_spec(ServeSettings(model_path=str(tiny_serve_model_dir), model_name="vidray-real"),
                      inspect_model(tiny_serve_model_dir))
    slot.service = FakeVideoService(tmp_path, spec=real)
    with pytest.raises(openai.BadRequestError) as err:
        sdk.videos.create(prompt="a red ball", input_reference=("first.png", png_bytes(), "image/png"))
    assert err.value.body["param"] == "input_reference"
    assert "'vidray-real' is a text-to-video model and takes no image" in err.value.body["message"]
    assert slot.service.requests == []


def test_sdk_create_with_defaults_maps_seconds_to_the_nearest_valid_frame_count(sdk, service):
    video = sdk.videos.create(prompt="waves", seconds="4")  # 4 s * 8 fps = 32 -> 33 (4k+1)
    [request] = service.requests
    assert (request.num_frames, request.seconds, video.seconds) == (33, "4.125", "4.125")
    assert (request.width, request.height, request.seed, request.num_inference_steps) == (64, 48, 0, 4)
    assert (request.guidance_scale, request.negative_prompt, request.input_reference) == (6.0, "", None)


def test_sdk_retrieve_polls_with_header_until_completed_then_downloads_the_mp4(sdk, service):
    video = sdk.videos.create(prompt="waves")
    raw = sdk.videos.with_raw_response.retrieve(video.id)
    assert raw.headers["openai-poll-after-ms"] == "500"
    assert raw.parse().status == "queued"
    service.complete(video.id)
    raw = sdk.videos.with_raw_response.retrieve(video.id)
    assert "openai-poll-after-ms" not in raw.headers
    done = raw.parse()
    assert (done.status, done.progress, done.completed_at) == ("completed", 100, 1_700_000_100)
    content = sdk.videos.download_content(video.id, variant="video")
    assert content.content == FAKE_MP4
    assert content.response.headers["content-type"] == "video/mp4"


def test_sdk_list_pages_through_every_video_in_order(sdk, service):
    ids = [sdk.videos.create(prompt=f"clip {i}").id for i in range(3)]
    first = sdk.videos.list(limit=2, order="asc")
    assert [v.id for v in first.data] == ids[:2] and first.has_more is True and first.last_id == ids[1]
    assert [v.id for v in sdk.videos.list(limit=2, order="asc")] == ids  # auto-pagination follows `after`
    assert [v.id for v in sdk.videos.list(order="desc")] == ids[::-1]


def test_sdk_delete_removes_the_video_and_retrieve_then_raises_not_found(sdk, service):
    video = sdk.videos.create(prompt="waves")
    deleted = sdk.videos.delete(video.id)
    assert (deleted.id, deleted.object, deleted.deleted) == (video.id, "video.deleted", True)
    assert video.id not in service.videos
    with pytest.raises(openai.NotFoundError) as info:
        sdk.videos.retrieve(video.id)
    assert info.value.param == "video_id"


def test_sdk_raises_bad_request_naming_the_field_and_authentication_error_for_a_wrong_key(sdk, service,
                                                                                         server_url):
    with pytest.raises(openai.BadRequestError) as info:
        sdk.videos.create(prompt="waves", size="65x64")
    assert info.value.param == "size" and "multiple of 16" in info.value.message
    wrong = openai.OpenAI(base_url=f"{server_url}/v1", api_key="wrong", max_retries=0, timeout=10)
    with pytest.raises(openai.AuthenticationError):
        wrong.videos.retrieve("video_0001")
    wrong.close()
    assert service.requests == []


def test_body_over_the_limit_is_refused_with_413_over_real_http_declared_or_chunked(server_url, service):
    # The bulk is an image part: a text field over its own cap is a 400 as it streams in (issue 27).
    body = multipart({"prompt": "x"}, ("big.png", "image/png", b"x" * (LIMITS.max_body_bytes + 1024)))
    headers = {"Authorization": f"Bearer {TOKEN}", "Content-Type": f"multipart/form-data; boundary={BOUNDARY}"}

    def chunks():
        for start in range(0, len(body), 8192):
            yield body[start:start + 8192]

    with httpx2.Client(base_url=server_url, timeout=10) as http:
        declared = http.post("/v1/videos", content=body, headers=headers)
        chunked = http.post("/v1/videos", content=chunks(), headers=headers)
    assert "content-length" not in chunked.request.headers
    assert chunked.request.headers["transfer-encoding"] == "chunked"
    assert_error(declared, 413, None, f"{len(body)} bytes", f"limit {LIMITS.max_body_bytes} bytes")
    # Not "request body is more bytes" (a new user's trial); both name every part that can be large.
    assert_error(chunked, 413, None, f"(sent without a Content-Length) is larger than the limit "
                 f"{LIMITS.max_body_bytes} bytes", f"prompt may hold at most {LIMITS.max_prompt_chars} characters",
                 f"input_reference image at most {LIMITS.max_image_bytes} bytes")
    assert service.requests == []


# --------------------------------------------------------------------------------------------------------------
# Auth and availability
# --------------------------------------------------------------------------------------------------------------


def test_missing_or_wrong_bearer_token_is_401_but_healthz_needs_none(client, service):
    for headers in ({"Authorization": ""}, {"Authorization": "Bearer wrong"}, {"Authorization": TOKEN},
                    {"Authorization": f"Bearer {TOKEN}x"}):
        response = client.get("/v1/videos", headers=headers)
        assert_error(response, 401, "authorization", "bearer token")
        assert response.headers["www-authenticate"] == "Bearer"
    assert_error(create(client, {}, headers={"Authorization": "Bearer nope"}), 401, "authorization")
    assert service.requests == []
    health = client.get("/healthz", headers={"Authorization": ""})
    assert health.status_code == 200 and health.json() == {"status": "ok"}  # nothing else to the unauthenticated
    assert client.get("/v1/videos").status_code == 200


def test_every_error_answer_is_reported_to_on_error_and_a_failing_hook_changes_nothing(slot, service):
    # `on_error` feeds `ray_vidray_serve_http_errors_total` (vidray.serve.app.count_http_error).
    seen: list[tuple[int, str]] = []
    headers = {"Authorization": f"Bearer {TOKEN}"}
    with TestClient(build_api(lambda: slot.service, on_error=lambda status, code: seen.append((status, code))),
                    headers=headers) as counted:
        assert create(counted, {"size": "33x32"}).status_code == 400
        assert counted.get("/v1/videos", headers={"Authorization": "Bearer wrong"}).status_code == 401
        assert counted.get("/v1/videos/video_9999").status_code == 404
        assert counted.get("/nowhere").status_code == 404
        assert counted.post("/v1/videos", content=b"x", headers={"Content-Type": "text/plain"}).status_code == 415
        assert counted.get("/v1/videos").status_code == 200  # not an error: not reported
    assert seen == [(400, "invalid_value"), (401, "invalid_api_key"), (404, "not_found"), (404, "not_found"),
                    (415, "unsupported_media_type")]

    def broken(status: int, code: str) -> None:
        raise RuntimeError("metrics backend down")

    with TestClient(build_api(lambda: slot.service, on_error=broken), headers=headers) as hooked:
        assert_error(create(hooked, {"size": "33x32"}), 400, "size")


def test_auth_disabled_accepts_requests_without_a_token(client, service):
    service.auth_token = None
    response = create(client, {"prompt": "waves"}, headers={"Authorization": ""})
    assert response.status_code == 200 and response.json()["status"] == "queued"
    assert len(service.requests) == 1


def test_check_bearer_compares_the_whole_header():
    check_bearer(f"Bearer {TOKEN}", TOKEN)
    check_bearer(f"bearer {TOKEN}", TOKEN)  # the scheme is case-insensitive (RFC 7235); a new user's trial: was 401
    check_bearer(f"BEARER {TOKEN}", TOKEN)
    check_bearer(None, None)
    for header in (None, "", TOKEN, f"bearer {TOKEN.upper()}", f"Bearer {TOKEN} ", "Bearer é", f"Bearer  {TOKEN}"):
        with pytest.raises(RequestError) as info:
            check_bearer(header, TOKEN)
        assert info.value.status == 401


def test_routes_answer_503_json_while_the_service_is_starting(client, slot):
    slot.service = None
    for response in (client.get("/v1/videos/video_0001"), create(client, {})):
        error = assert_error(response, 503, None, "starting")
        assert error["code"] == "service_unavailable" and response.headers["retry-after"] == "2"
    health = client.get("/healthz")
    assert (health.status_code, health.json()) == (503, {"status": "not ok"})


def test_unknown_routes_and_methods_answer_in_the_openai_error_shape(client):
    assert_error(client.get("/v1/nothing"), 404, None, "/v1/nothing")
    assert_error(client.put("/v1/videos"), 405, None, "PUT")


# --------------------------------------------------------------------------------------------------------------
# Every bad field: 4xx JSON naming it, and nothing reaches the service
# --------------------------------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("fields", "param", "words"),
    [
        ({"prompt": "   "}, "prompt", ["must not be empty"]),
        ({"prompt": None}, "prompt", ["required"]),
        ({"prompt": "x" * 101}, "prompt", ["101 characters", "limit 100"]),
        ({"negative_prompt": "x" * 101}, "negative_prompt", ["101 characters"]),
        ({"model": "sora-2"}, "model", ["'sora-2'", "'vidray-tiny'"]),
        ({"size": "64x"}, "size", ["'64x'", "WIDTHxHEIGHT"]),
        ({"size": "65x64"}, "size", ["width 65", "multiple of 16", "64 or 80"]),
        ({"size": "64x50"}, "size", ["height 50", "48 or 64"]),
        ({"size": "512x64"}, "size", ["width 512", "maximum 256"]),
        ({"size": "64x0"}, "size", ["height 0", "minimum 16"]),
        ({"num_frames": "8"}, "num_frames", ["num_frames 8", "5 or 9"]),
        ({"num_frames": "53"}, "num_frames", ["1..49", "nearest valid: 49"]),
        ({"num_frames": "nine"}, "num_frames", ["integer", "'nine'"]),
        ({"seconds": "7"}, "seconds", ["56 frames", "maximum 49", "at most 6.125 seconds"]),
        ({"seconds": "1e308"}, "seconds", ["inf frames", "at most 6.125 seconds"]),  # was a 500 (OverflowError)
        ({"seconds": "0"}, "seconds", ["> 0"]),
        ({"seconds": "nan"}, "seconds", ["finite"]),
        ({"seconds": "4", "num_frames": "9"}, "seconds", ["33 frames", "num_frames is 9"]),
        ({"seed": "-1"}, "seed", ["0..9223372036854775807", "-1"]),
        ({"seed": str(2**63)}, "seed", ["0..9223372036854775807"]),
        ({"seed": "1.5"}, "seed", ["integer"]),
        ({"num_inference_steps": "0"}, "num_inference_steps", ["1..50", "got 0"]),
        ({"num_inference_steps": "51"}, "num_inference_steps", ["1..50", "got 51"]),
        ({"guidance_scale": "0.5"}, "guidance_scale", [">= 1.0", "0.5"]),
        ({"guidance_scale": "inf"}, "guidance_scale", ["finite"]),
        ({"steps": "4", "colour": "red"}, "colour", ["'colour'", "'steps'", "accepted fields"]),
        ({"prompt": "a red\x00 ball"}, "prompt", ["U+0000", "character 5"]),  # was accepted, NUL and all
        ({"negative_prompt": "blur\x1b[31m"}, "negative_prompt", ["U+001B"]),
        ({"size": "64x64\x00"}, "size", ["U+0000"]),
        ({"seed": "\x7f1"}, "seed", ["U+007F", "character 0"]),
        # Numbers are ASCII: float() and \d took other scripts' digits and underscores (a new user's trial)
        ({"size": "\uff1064x64"}, "size", ["WIDTHxHEIGHT"]),
        ({"seconds": "\u0661"}, "seconds", ["must be a number"]),
        ({"seconds": "1_0"}, "seconds", ["must be a number", "'1_0'"]),
        ({"num_frames": "\uff19"}, "num_frames", ["integer"]),
        ({"prompt": "\u200b\u200b"}, "prompt", ["must not be empty"]),  # zero-width spaces only: blank
    ],
)
def test_bad_field_is_400_json_naming_it(client, service, fields, param, words):
    assert_error(create(client, fields), 400, param, *words)
    assert service.requests == []


def test_field_given_twice_is_400(client, service):
    body = (f'--{BOUNDARY}\r\nContent-Disposition: form-data; name="seed"\r\n\r\n1\r\n'
            f'--{BOUNDARY}\r\nContent-Disposition: form-data; name="seed"\r\n\r\n2\r\n').encode() + multipart(
        {"prompt": "a"})
    response = client.post("/v1/videos", content=body,
                           headers={"Content-Type": f"multipart/form-data; boundary={BOUNDARY}"})
    assert_error(response, 400, "seed", "given twice")


MULTIPART = f"multipart/form-data; boundary={BOUNDARY}"
URLENCODED = "application/x-www-form-urlencoded"


@pytest.mark.parametrize(
    ("content_type", "body", "status", "param", "words"),
    [
        # Starlette decoded a text part that is not UTF-8 as Latin-1: this prompt was queued as "café ÿþ ok"
        (MULTIPART, multipart({"prompt": "@"}).replace(b"@", b"caf\xe9 \xff\xfe ok"), 400, "prompt",
         ["'prompt' is not UTF-8", "byte 0xe9 at byte 3"]),
        (MULTIPART, multipart({"prompt": "a"}).replace(b'name="prompt"', b'name="pr\xffompt"'), 400, None,
         ["field's name is not UTF-8", "0xff"]),
        (URLENCODED, b"prompt=caf%E9+x", 400, "prompt", ["not UTF-8"]),  # was queued as "caf\ufffd x"
        (URLENCODED, b"prompt=caf\xe9+x", 400, "prompt", ["not UTF-8"]),  # was queued as "café x"
        (URLENCODED, b"pr%FFompt=x", 400, None, ["field's name"]),
        # the body's charset was used for part names: a UTF-16 body gave "unknown field(s) '牰浯瑰'"
        (f"{MULTIPART}; charset=utf-16", multipart({"prompt": "a"}), 415, "content-type", ["'utf-16'", "UTF-8"]),
        (f"{URLENCODED}; charset=latin-1", b"prompt=a", 415, "content-type", ["'latin-1'"]),
    ],
)
def test_form_text_that_is_not_utf8_is_refused_naming_the_field(client, service, content_type, body, status,
                                                                param, words):
    assert_error(client.post("/v1/videos", content=body, headers={"Content-Type": content_type}), status, param,
                 *words)
    assert service.requests == []


def test_utf8_form_text_reaches_the_service_unchanged(client, service):
    prompt = "café über 東京の夜 🎬"
    for content_type, body in (
        (MULTIPART, multipart({"prompt": prompt})),
        (f"{MULTIPART}; charset=UTF-8", multipart({"prompt": prompt})),
        (URLENCODED, "prompt=".encode() + prompt.encode().replace(b" ", b"+")),  # raw UTF-8: was read as Latin-1
        (f"{URLENCODED}; charset=utf-8", b"prompt=" + quote(prompt).encode()),
    ):
        response = client.post("/v1/videos", content=body, headers={"Content-Type": content_type})
        assert response.status_code == 200, (content_type, response.text)
    assert [request.prompt for request in service.requests] == [prompt] * 4


def test_an_image_on_a_text_to_video_model_is_400_naming_the_model(client, service):
    assert_error(create(client, {}, ("first.png", "image/png", png_bytes())), 400, "input_reference",
                 "'vidray-tiny' is a text-to-video model")
    assert service.requests == []


def _image_error(image: tuple[str, str, bytes]) -> RequestError:
    with pytest.raises(RequestError) as info:
        _check_image(image, spec=IMAGE_CHECK_SPEC, limits=LIMITS)
    assert info.value.param == "input_reference"
    return info.value


def test_check_image_refuses_undecodable_empty_and_oversized_images_naming_the_file():
    error = _image_error(("first.png", "image/png", b"\x89PNG not really"))
    assert (error.status, error.code) == (400, "unsupported_image_format") and "'first.png'" in error.message
    assert "only PNG, JPEG or WebP images are accepted" in error.message
    error = _image_error(("first.png", "image/png", png_bytes()[:20]))  # the PNG magic, its header cut
    assert (error.status, error.code) == (400, "invalid_image") and "cut short" in error.message
    assert "empty" in _image_error(("empty.png", "image/png", b"")).message
    assert "600x20" in _image_error(("huge.png", "image/png", png_bytes(600, 20))).message


def test_check_image_over_max_image_bytes_is_413():
    noisy = Image.frombytes("RGB", (90, 90), random.Random(0).randbytes(90 * 90 * 3))  # incompressible
    out = io.BytesIO()
    noisy.save(out, format="PNG")
    assert LIMITS.max_image_bytes < len(out.getvalue()) < LIMITS.max_body_bytes
    error = _image_error(("noise.png", "image/png", out.getvalue()))
    assert (error.status, error.code) == (413, "request_too_large")
    assert f"{len(out.getvalue())} bytes" in error.message and f"limit {LIMITS.max_image_bytes}" in error.message


def test_second_file_part_or_unexpected_file_field_is_400(client):
    image = ("first.png", "image/png", png_bytes())
    body = multipart({"prompt": "a"}, image)
    other = body.replace(b'name="input_reference"', b'name="mask"')
    headers = {"Content-Type": f"multipart/form-data; boundary={BOUNDARY}"}
    assert_error(client.post("/v1/videos", content=other, headers=headers), 400, "mask", "only file part")
    twice = body[: body.rindex(b"--" + BOUNDARY.encode() + b"--")] + multipart({}, image)
    assert_error(client.post("/v1/videos", content=twice, headers=headers), 400, "input_reference", "once")


def test_input_reference_sent_as_a_text_field_is_told_to_come_as_a_file_part(client):
    # A new user's trial: `-F input_reference=hello` was answered "unknown field(s) 'input_reference'; accepted
    # fields: ... and the file part input_reference".
    body = multipart({"prompt": "a", "input_reference": "hello"})
    headers = {"Content-Type": f"multipart/form-data; boundary={BOUNDARY}"}
    assert_error(client.post("/v1/videos", content=body, headers=headers), 400, "input_reference",
                 "came as a text field; upload the image as a file part")


def test_declared_content_length_over_the_limit_is_413_before_reading(client, service):
    headers = {"Content-Type": f"multipart/form-data; boundary={BOUNDARY}"}
    response = client.post("/v1/videos", content=b"x" * (LIMITS.max_body_bytes + 1), headers=headers)
    assert_error(response, 413, None, f"{LIMITS.max_body_bytes + 1} bytes")
    assert service.requests == []


# --------------------------------------------------------------------------------------------------------------
# JSON bodies, content, list parameters
# --------------------------------------------------------------------------------------------------------------


def test_json_body_with_numbers_is_accepted(client, service):
    response = client.post("/v1/videos", json={"prompt": "waves", "num_frames": 5, "seed": 3, "guidance_scale": 1})
    assert response.status_code == 200, response.text
    [request] = service.requests
    assert (request.num_frames, request.seed, request.guidance_scale) == (5, 3, 1.0)


def test_a_data_url_image_reference_decodes_to_its_bytes():
    import base64

    image = png_bytes(16, 16)
    assert _image_from_reference("data:image/png;base64," + base64.b64encode(image).decode(), None, LIMITS) == (
        "image_url", "image/png", image)


@pytest.mark.parametrize(
    ("body", "status", "param", "word"),
    [
        (b"{not json", 400, None, "not valid JSON"),
        (b"[1, 2]", 400, None, "JSON object"),
        (b'{"prompt": "a", "seed": true}', 400, "seed", "string or a number"),
        (b'{"prompt": 5}', 400, "prompt", "must be a JSON string, got 5"),  # a new user's trial: was prompt "5"
        (b'{"prompt": "a", "negative_prompt": 1.5}', 400, "negative_prompt", "JSON string"),
        (b'{"prompt": "a", "size": 64}', 400, "size", "JSON string"),
        (b'{"prompt": "a", "model": 0}', 400, "model", "JSON string"),
        (b'{"prompt": "a", "input_reference": {"image_url": "https://example.com/a.png"}}', 400,
         "input_reference", "fetches no URLs"),
        (b'{"prompt": "a", "input_reference": {"file_id": "file_1"}}', 400, "input_reference", "file_id"),
        (b'{"prompt": "a", "input_reference": "abc"}', 400, "input_reference", "JSON body"),
        (b'{"prompt": "a", "frames": 9}', 400, "frames", "'frames'"),
        # JSON's \ud800 decodes to a lone surrogate, which no UTF-8 encoder takes (sqlite, the job store, raises)
        (b'{"prompt": "a red \\ud800ball"}', 400, "prompt", "U+D800 at character 6"),
        # 1000 levels of [ in 2 KB: json's recursive parser raised RecursionError, a 500 (a new user's trial)
        (b'{"prompt": "x", "seed": ' + b"[" * 1000 + b"]" * 1000 + b"}", 400, "seed", "got an array"),
        (b'{"prompt": "x", "prompt": "y"}', 400, "prompt", "given twice"),  # json.loads kept the last
        # Issue 27: each was a 500 or named no field. Python's int() refuses 4,300+ digits (ValueError in json.loads).
        (b'{"prompt": "x", "seed": ' + b"7" * 5000 + b"}", 400, "seed", "seed is 5000 characters, above the limit"),
        (b'{"prompt": "x", "seconds": NaN}', 400, "seconds", "NaN, which JSON has not"),
        (b'{"prompt": "x", "guidance_scale": -Infinity}', 400, "guidance_scale", "-Infinity"),
        (b'{"prompt": "x", "seconds": 1e400}', 400, "seconds", "finite number"),
        (b'{"prompt": "caf\xe9", "seed": 1}', 400, "prompt", "not UTF-8 text (byte 0xe9 at byte 15"),
        (b'{"\xff": 1}', 400, None, "not UTF-8"),
        (b'{"\\ud800": 1}', 400, "\\ud800", "unknown field"),  # a lone surrogate echoed back: was a 500
        (b"null", 400, None, "got null"),
        (b'{"prompt": "x"} {}', 400, None, "unexpected data after"),
        (b'{"prompt": "x", "input_reference": {"image_url": ["data:"]}}', 400, "input_reference.image_url",
         "got an array"),  # was a 500 ('list' object has no attribute 'strip'): found by the fuzz test
        (b"{" + b",".join(b'"f%d": 1' % i for i in range(65)) + b"}", 400, None, "more than 64 fields"),
    ],
)
def test_bad_json_body_is_400_naming_the_field(client, service, body, status, param, word):
    response = client.post("/v1/videos", content=body, headers={"Content-Type": "application/json"})
    assert_error(response, status, param, word)
    assert service.requests == []


def test_unsupported_content_type_is_415(client):
    response = client.post("/v1/videos", content=b"prompt", headers={"Content-Type": "text/plain"})
    assert_error(response, 415, "content-type", "'text/plain'", "multipart/form-data", "x-www-form-urlencoded")
    # the three it names are accepted (a new user's trial: urlencoded worked but no message or README said so)
    assert create(client, {}).status_code == 200
    for content_type, body in ((URLENCODED, b"prompt=a"), ("application/json", b'{"prompt": "a"}')):
        assert client.post("/v1/videos", content=body, headers={"Content-Type": content_type}).status_code == 200


def test_content_of_an_unfinished_or_failed_video_is_409_naming_its_status(client, service):
    video_id = create(client, {}).json()["id"]
    assert_error(client.get(f"/v1/videos/{video_id}/content"), 409, "video_id", "queued", "0% done", "poll")
    service.videos[video_id].update(status="in_progress", progress=40)
    assert_error(client.get(f"/v1/videos/{video_id}/content"), 409, "video_id", "in_progress", "40% done")
    service.videos[video_id].update(status="failed", error={"code": "replica_died", "message": "replica lost"})
    assert_error(client.get(f"/v1/videos/{video_id}/content"), 409, "video_id", "failed", "replica lost")
    assert_error(client.get("/v1/videos/video_9999/content"), 404, "video_id", "'video_9999'")
    assert_error(client.get(f"/v1/videos/{video_id}/content?variant=thumbnail"), 400, "variant", "'thumbnail'")


def test_completed_video_whose_file_is_gone_is_404(client, service):
    video_id = create(client, {}).json()["id"]
    service.complete(video_id)
    assert client.get(f"/v1/videos/{video_id}/content").content == FAKE_MP4
    service.files[video_id].unlink()
    assert_error(client.get(f"/v1/videos/{video_id}/content"), 404, "video_id", "no longer stored")


def test_unknown_video_id_is_404_for_retrieve_and_delete(client):
    assert_error(client.get("/v1/videos/video_9999"), 404, "video_id", "'video_9999'")
    assert_error(client.delete("/v1/videos/video_9999"), 404, "video_id", "'video_9999'")


@pytest.mark.parametrize(
    ("query", "param", "word"),
    [("limit=0", "limit", "1..100"), ("limit=101", "limit", "got 101"), ("limit=ten", "limit", "integer"),
     ("order=sideways", "order", "'sideways'"),
     ("after=video_nope", "after", "after='video_nope' is not the id of a stored video")],  # was a 500 (a trial)
)
def test_bad_list_parameters_are_400(client, query, param, word):
    assert_error(client.get(f"/v1/videos?{query}"), 400, param, word)


def test_empty_list_has_null_first_and_last_ids(client):
    assert client.get("/v1/videos").json() == {"object": "list", "data": [], "first_id": None, "last_id": None,
                                               "has_more": False}


# --------------------------------------------------------------------------------------------------------------
# parse_video_request rules, directly
# --------------------------------------------------------------------------------------------------------------


def parse(**fields: str) -> VideoRequest:
    return parse_video_request({"prompt": "a cat", **fields}, None, spec=SPEC, limits=LIMITS)


@pytest.mark.parametrize(
    ("seconds", "num_frames", "text"),
    [("1", 9, "1.125"), ("4", 33, "4.125"), ("0.5", 5, "0.625"), ("0.875", 5, "0.625"),  # 7 frames: tie 5|9 -> 5
     ("0.01", 1, "0.125"), ("6.125", 49, "6.125"), ("0.1875", 1, "0.125")],  # 1.5 -> 2 (half up) -> 1
)
def test_seconds_give_the_nearest_valid_frame_count_ties_to_the_smaller(seconds, num_frames, text):
    request = parse(seconds=seconds)
    assert (request.num_frames, request.seconds) == (num_frames, text)


def test_seconds_and_num_frames_that_agree_are_accepted():
    assert parse(seconds="4", num_frames="33").num_frames == 33


def test_defaults_come_from_the_model_spec():
    request = parse()
    assert (request.width, request.height, request.num_frames, request.seconds, request.seed) == (
        64, 48, 9, "1.125", 0)
    assert (request.num_inference_steps, request.guidance_scale, request.model, request.size) == (
        4, 6.0, "vidray-tiny", "64x48")


def test_empty_optional_fields_count_as_absent_and_model_may_be_empty():
    request = parse(model="", size=" ", seed="", negative_prompt="  ")
    assert (request.size, request.seed, request.negative_prompt) == ("64x48", 0, "")


def test_tabs_and_newlines_are_prompt_text():
    request = parse_video_request({"prompt": "a red ball\n\tbouncing\r\n"}, None, spec=SPEC, limits=LIMITS)
    assert request.prompt == "a red ball\n\tbouncing"


def test_first_problem_is_reported_in_a_fixed_order():
    with pytest.raises(RequestError) as info:
        parse_video_request({"prompt": "", "size": "1x1", "zzz": "1", "aaa": "2"}, None, spec=SPEC, limits=LIMITS)
    assert (info.value.param, info.value.code) == ("aaa", "unknown_parameter")
    assert "'aaa', 'zzz'" in info.value.message
    with pytest.raises(RequestError) as info:
        parse_video_request({"prompt": "", "size": "1x1"}, None, spec=SPEC, limits=LIMITS)
    assert info.value.param == "prompt"


def test_check_image_keeps_the_upload_as_sent_and_reads_its_size_from_the_header():
    out = io.BytesIO()
    Image.new("RGBA", (20, 10), (1, 2, 3, 128)).save(out, format="WEBP", lossless=True)
    header = _check_image(("a.webp", "image/webp", out.getvalue()), spec=IMAGE_CHECK_SPEC, limits=LIMITS)
    assert (header.format, header.width, header.height, header.suffix) == ("WEBP", 20, 10, ".webp")
    request = parse_video_request({"prompt": "a"}, ("a.webp", "image/webp", out.getvalue()), spec=IMAGE_CHECK_SPEC,
                                  limits=LIMITS)
    assert request.input_reference == out.getvalue()  # the upload's own bytes, not a re-encode
    assert (request.input_reference_size, request.input_reference_suffix) == ((20, 10), ".webp")


def test_the_job_record_says_when_the_first_frame_is_stretched_to_the_videos_aspect_ratio():
    """The stock pipelines resize the image to the video's size without cropping; vidray does the same and notes
    it in the job's params when the aspect ratios differ."""
    from vidray.inference.request import GenerationRequest
    from vidray.serve.api import VideoRequest

    def request(size):
        generation = GenerationRequest(prompt="a", width=64, height=32, num_frames=5, seed=0, num_inference_steps=2,
                                       guidance_scale=1.0, fps=8.0, image="input_reference")
        return VideoRequest(generation=generation, model="m", seconds="1", input_reference=b"png",
                            input_reference_size=size)

    stretched = request((40, 40)).input_reference_note()
    assert stretched["size"] == "40x40" and stretched["resized_to"] == "64x32"
    assert "resized to the video's size without cropping (stretched)" in stretched["note"]
    assert request((128, 64)).input_reference_note() == {"size": "128x64", "resized_to": "64x32"}  # same aspect
    assert request(None).input_reference_note() is None


def test_model_spec_with_an_invalid_default_is_refused():
    with pytest.raises(ValueError, match="default_num_frames 8"):
        ModelSpec(**{**SPEC.__dict__, "default_num_frames": 8})
    with pytest.raises(ValueError, match="default_size 60x48"):
        ModelSpec(**{**SPEC.__dict__, "default_size": (60, 48)})
    with pytest.raises(ValueError, match="max_body_bytes"):
        ApiLimits(max_body_bytes=0)


def test_request_error_json_has_the_openai_shape():
    assert RequestError(400, "size", "bad size").to_json() == {
        "error": {"message": "bad size", "type": "invalid_request_error", "param": "size", "code": "invalid_value"}}


# --------------------------------------------------------------------------------------------------------------
# Issue 27: lengths before parsing, and no internals in a 500
# --------------------------------------------------------------------------------------------------------------


def test_the_issues_16000_digit_seconds_is_refused_by_its_length_before_any_parsing():
    # The issue's example: ~5 s in the old number regex (quadratic backtracking), on the event loop.
    start = time.perf_counter()
    with pytest.raises(RequestError) as info:
        parse(seconds="1" * 16_000 + "x")
    assert time.perf_counter() - start < 0.1
    assert (info.value.param, info.value.status) == ("seconds", 400)
    assert "seconds is 16001 characters, above the limit 40" in info.value.message
    with pytest.raises(RequestError, match="prompt is 101 characters"):
        parse(prompt=" " * 98 + "abc")  # the raw length counts: stripping would scan first


@pytest.mark.parametrize(
    ("method", "path", "headers", "status", "param"),
    [
        ("GET", "/v1/videos?after=" + "v" * 65, {}, 400, "after"),
        ("GET", "/v1/videos?limit=" + "1" * 41, {}, 400, "limit"),
        ("GET", "/v1/videos?order=" + "a" * 17, {}, 400, "order"),
        ("GET", "/v1/videos?x=" + "1" * 3000, {}, 414, None),
        ("GET", "/v1/videos/" + "v" * 65, {}, 400, "video_id"),
        ("DELETE", "/v1/videos/" + "v" * 65, {}, 400, "video_id"),
        ("GET", "/v1/videos/video_1/content?variant=" + "v" * 17, {}, 400, "variant"),
        ("GET", "/v1/videos", {"Authorization": "Bearer " + "t" * 5000}, 400, "authorization"),
        ("POST", "/v1/videos", {"Content-Type": "multipart/form-data; boundary=" + "b" * 5000}, 400, "content-type"),
    ],
)
def test_query_path_and_header_values_over_their_caps_are_refused_naming_them(client, method, path, headers, status,
                                                                              param):
    assert_error(client.request(method, path, headers=headers), status, param, "above the limit")


def test_a_500_shows_an_error_id_and_the_log_holds_the_details(slot, service, caplog):
    secret = "/srv/vidray/store/jobs.sqlite3 on host gpu-7.internal"

    async def broken_submit(request, *, client=None):  # a bug (an OSError of the store is a 503/507 of its own)
        raise RuntimeError(f"cannot open {secret}")

    service.submit = broken_submit
    with TestClient(build_api(lambda: slot.service), raise_server_exceptions=False,
                    headers={"Authorization": f"Bearer {TOKEN}"}) as plain:
        with caplog.at_level("ERROR", logger="vidray.serve.routes"):
            response = create(plain, {})
    error = assert_error(response, 500, None, "internal server error (error id ")
    assert secret not in response.text and "RuntimeError" not in response.text
    error_id = error["message"].split("error id ")[1][:8]
    assert any(error_id in r.getMessage() and secret in str(r.exc_info[1]) for r in caplog.records if r.exc_info)


def test_a_job_store_that_does_not_answer_is_a_503_with_retry_after_on_every_route(client, service):
    """The head's store actor restarting (`JobStoreUnavailableError`) is a 503 to retry, not a 500, on the routes
    that read the store (create's own mapping of store errors is tested with the real service)."""
    from vidray.serve.jobs import JobStoreUnavailableError

    video_id = create(client, {}).json()["id"]

    def unavailable(*_args, **_kwargs):
        raise JobStoreUnavailableError("the job store on the Ray head did not answer (ActorUnavailableError)")

    for name in ("get", "list", "delete", "open_video"):
        setattr(service, name, unavailable)
    for method, path in (("GET", f"/v1/videos/{video_id}"), ("GET", "/v1/videos"),
                         ("DELETE", f"/v1/videos/{video_id}"), ("GET", f"/v1/videos/{video_id}/content")):
        response = client.request(method, path)
        assert response.status_code == 503, (method, path, response.text)
        assert response.headers["Retry-After"] == "2"
        assert response.json()["error"]["code"] == "service_unavailable"
