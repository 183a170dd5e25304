"""The serve plane's bounds and races (issue 27 items 2 and 4): queue caps per token and in total (429), fair turns
between tokens, retention, temp files, /healthz and /v1/status, a runner that stalled past its lease, a DELETE racing
a download, a full disk. The real `VideoJobService` (its sqlite store in tmp_path, its runner) behind the real
FastAPI app (Starlette's TestClient), with stage handles that render in milliseconds instead of Ray deployments."""

from __future__ import annotations

import asyncio
import contextlib
import errno
import os
import sqlite3
import threading
import time
from pathlib import Path

import numpy as np
import pytest
from starlette.testclient import TestClient

from vidray.serve.app import ServeSettings, VideoJobService
from vidray.serve.routes import build_api, client_id

TOKEN_A = "alice-token-of-at-least-16-chars"
TOKEN_B = "bob-token-of-at-least-16-chars!"


class _Remote:
    def __init__(self, fn):
        self.remote = fn


class Stages:
    """Stand-ins for the TextEncoder, Denoiser and VaeDecoder handles: a denoise streams one event per step,
    `step_s` seconds apart; `prompts` lists the renders in the order they started, `requests` the
    `GenerationRequest` each denoise received, `num_decoded` counts the renders that reached the VAE."""

    def __init__(self, step_s: float) -> None:
        self.step_s = step_s
        self.prompts: list[str] = []
        self.requests: list = []
        self.num_decoded = 0
        self.text = type("Text", (), {"encode": _Remote(self._encode)})()
        self.denoiser = type("Denoiser", (), {"options": lambda _self, **_: _self,
                                              "denoise": _Remote(self._denoise)})()
        self.vae = type("Vae", (), {"decode": _Remote(self._decode)})()

    async def _encode(self, prompt: str):
        self.prompts.append(prompt)
        return None, None

    def _denoise(self, request: dict):
        stages = self
        self.requests.append(request["request"])

        class Stream:
            def cancel(self) -> None:
                pass

            async def __aiter__(self):
                steps = request["request"].num_inference_steps
                for step in range(1, steps + 1):
                    await asyncio.sleep(stages.step_s)
                    yield {"step": step, "num_inference_steps": steps}
                yield {"latents": "latents"}

        return Stream()

    async def _decode(self, _latents):
        self.num_decoded += 1
        return np.zeros((9, 64, 48, 3), np.uint8)


@contextlib.contextmanager
def serve_maker(model_dir, tmp_path, *, headers: dict[str, str] | None = None, **service_kwargs):
    """Yields make(step_s, **settings sections) -> (service, TestClient sending `headers`, stages): a
    `VideoJobService` of tokens A and B (plus `service_kwargs`) on the tiny model with fake stages taking `step_s`
    per call, its store in `tmp_path`; every service made is stopped on exit."""
    made = []

    def make(step_s: float = 0.01, **sections):
        settings = ServeSettings(model_path=str(model_dir), store_dir=str(tmp_path / "store"), fps=8.0,
                                 store_on="replica", **sections)
        stages = Stages(step_s)
        service = VideoJobService(settings, (TOKEN_A, TOKEN_B), stages.text, stages.denoiser, stages.vae,
                                  **service_kwargs)
        client = TestClient(build_api(lambda: service), headers=headers or {})
        client.__enter__()
        made.append((client, service))
        return service, client, stages

    try:
        yield make
    finally:
        for client, service in made:
            client.portal.call(service.shutdown, 2.0)
            client.__exit__(None, None, None)


@pytest.fixture
def serve(tiny_serve_model_dir, tmp_path):
    """make(step_s, **settings sections) -> (service, client as alice, stages); each service is stopped after."""
    with serve_maker(tiny_serve_model_dir, tmp_path, headers={"Authorization": f"Bearer {TOKEN_A}"}) as make:
        yield make


def _create(client: TestClient, prompt: str, token: str = TOKEN_A):
    return client.post("/v1/videos", json={"prompt": prompt, "num_inference_steps": 2},
                       headers={"Authorization": f"Bearer {token}"})


def _wait_for(predicate, timeout_s: float = 10.0, what: str = "condition"):
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        value = predicate()
        if value:
            return value
        time.sleep(0.02)
    raise AssertionError(f"{what} not reached within {timeout_s} s")


def _read_if_present(path):
    # SQLite removes its -wal/-shm files when the last connection closes, which may fall between glob and read.
    try:
        return path.read_bytes()
    except FileNotFoundError:
        return b""


def test_a_create_past_the_tokens_or_the_total_cap_is_a_429_with_retry_after(serve, tmp_path):
    service, client, _ = serve(step_s=60.0, limits={"max_queued_jobs": 3, "max_queued_jobs_per_token": 2})
    assert [_create(client, f"a{i}").status_code for i in range(2)] == [200, 200]
    refused = _create(client, "a2")
    assert refused.status_code == 429 and refused.headers["retry-after"] == "10"
    error = refused.json()["error"]
    assert error["code"] == "rate_limit_exceeded" and "this client (bearer token) holds 2 unfinished" in \
        error["message"] and "most allowed is 2" in error["message"]
    assert _create(client, "b0", TOKEN_B).status_code == 200  # another token has its own cap
    full = _create(client, "b1", TOKEN_B)
    assert full.status_code == 429 and "the server holds 3 unfinished" in full.json()["error"]["message"]
    # Each job names its client by a hash of its token; the tokens themselves are stored nowhere.
    clients = sorted(job.client for job in service.store.list(limit=10)[0])
    assert clients == sorted([client_id(TOKEN_A)] * 2 + [client_id(TOKEN_B)])
    stored = b"".join(_read_if_present(path) for path in (tmp_path / "store").glob("jobs.sqlite3*"))
    assert TOKEN_A.encode() not in stored and TOKEN_B.encode() not in stored


def test_two_tokens_one_floods_and_the_others_job_starts_within_one_jobs_time(serve):
    # One job at a time, 2 steps of 0.15 s each: alice queues 6 jobs, then bob one. Strict first-in-first-out
    # started bob's job after all of alice's; a turn each starts it right after the job running when it came.
    _, client, stages = serve(step_s=0.15, runner={"max_concurrent_jobs": 1, "poll_s": 0.05})
    for i in range(6):
        assert _create(client, f"a{i}").status_code == 200
    assert _create(client, "b0", TOKEN_B).status_code == 200
    _wait_for(lambda: len(stages.prompts) >= 2, what="two renders started")
    assert stages.prompts[:2] == ["a0", "b0"]


def test_healthz_says_only_ok_at_once_while_v1_status_counts_off_the_event_loop(serve):
    service, client, _ = serve(step_s=60.0)
    assert _create(client, "a0").status_code == 200
    counts = service.store.counts

    def slow_counts(**scope):  # a store under load: a full count takes a second
        time.sleep(1.0)
        return counts(**scope)

    service.store.counts = slow_counts
    answers = {}
    status = threading.Thread(target=lambda: answers.setdefault("status", client.get("/v1/status")))
    status.start()
    time.sleep(0.2)  # /v1/status is counting now
    started = time.monotonic()
    health = client.get("/healthz", headers={"Authorization": ""})
    assert time.monotonic() - started < 0.5
    assert (health.status_code, health.json()) == (200, {"status": "ok"})  # no model name, no counts
    status.join(10)
    body = answers["status"].json()
    assert body["model"] == service.spec.name and sum(body["jobs"].values()) == 1
    assert client.get("/v1/status", headers={"Authorization": ""}).status_code == 401


def test_an_expired_video_is_swept_with_its_files_and_is_a_404_after(serve, tmp_path):
    service, client, _ = serve(retention={"hours": 1 / 3600, "sweep_every_s": 0.1, "tmp_max_age_s": 3600},
                               runner={"poll_s": 0.05})
    stale = tmp_path / "store" / "tmp" / "left-by-a-dead-render.mp4"
    stale.write_bytes(b"x")
    os.utime(stale, (time.time() - 7200, time.time() - 7200))
    video_id = _create(client, "a0").json()["id"]
    done = _wait_for(lambda: (v := client.get(f"/v1/videos/{video_id}").json())["status"] == "completed" and v,
                     what="the video completed")
    assert done["expires_at"] == done["completed_at"] + 1
    assert client.get(f"/v1/videos/{video_id}/content").status_code == 200
    _wait_for(lambda: client.get(f"/v1/videos/{video_id}").status_code == 404, what="the expired video's 404")
    assert client.get(f"/v1/videos/{video_id}/content").status_code == 404
    assert list((tmp_path / "store" / "videos").iterdir()) == []
    assert not stale.exists()  # swept when the runner started, being older than retention.tmp_max_age_s


def test_a_runner_that_stalls_past_its_lease_and_re_claims_its_job_renders_it_once(serve, tmp_path):
    # The real sequence: the runner's store calls stall (a disk or GIL stall) past its lease; its own sweep
    # re-queues the job and its own claim takes it again. When the stall ends, the first attempt's heartbeat used
    # to succeed (same owner, in_progress) and both attempts rendered to the end: decoded twice.
    service, client, stages = serve(step_s=0.05, runner={"lease_s": 0.6, "poll_s": 0.05, "max_concurrent_jobs": 2})
    store, heartbeat = service.store, service.store.heartbeat

    def stalling_heartbeat(job_id, owner, **kwargs):
        if store.get(job_id).attempts == 1:  # the first attempt stalls until the job is re-claimed
            _wait_for(lambda: store.get(job_id).attempts >= 2, what="the re-claim")
        return heartbeat(job_id, owner, **kwargs)

    store.heartbeat = stalling_heartbeat
    video_id = _create(client, "a0").json()["id"]
    _wait_for(lambda: store.get(video_id).status == "completed", what="the video completed")
    _wait_for(lambda: not service._active, what="every render ended")
    job = store.get(video_id)
    assert (job.attempts, stages.prompts, stages.num_decoded) == (2, ["a0", "a0"], 1)
    assert list((tmp_path / "store" / "tmp").iterdir()) == []  # the dropped attempt left no temp file


def test_a_delete_racing_a_download_is_a_404_not_a_500(serve):
    service, client, _ = serve()
    video_id = _create(client, "a0").json()["id"]
    _wait_for(lambda: service.store.get(video_id).status == "completed", what="the video completed")
    video_path = service.store.video_path

    class RemovedAsItIsOpened(type(Path())):
        """The worst interleaving: the DELETE lands after the store found the file, as it opens it."""

        def __fspath__(self) -> str:
            service.delete(video_id, client=None)
            return super().__fspath__()

    service.store.video_path = lambda vid, **scope: RemovedAsItIsOpened(video_path(vid, **scope))
    response = client.get(f"/v1/videos/{video_id}/content")
    assert response.status_code == 404 and response.json()["error"]["code"] == "not_found"


@pytest.mark.parametrize("error", [
    OSError(errno.ENOSPC, "No space left on device"),
    sqlite3.OperationalError("database or disk is full"),
])
def test_a_full_disk_on_create_is_a_507_with_retry_after_not_a_500(serve, error):
    service, client, _ = serve()
    if isinstance(error, sqlite3.Error):
        error.sqlite_errorcode = sqlite3.SQLITE_FULL  # as sqlite3 sets it for SQLITE_FULL

    def create(**_):
        raise error

    service.store.create = create
    response = _create(client, "a0")
    assert response.status_code == 507 and response.headers["retry-after"] == "10"
    assert response.json()["error"]["code"] == "insufficient_storage"
    assert str(Path(service.settings.store_dir)) not in response.text


def test_check_bearer_names_each_tokens_client_by_a_short_stable_hash_and_no_auth_by_one_client():
    from vidray.serve.errors import RequestError
    from vidray.serve.jobs import ANONYMOUS_CLIENT
    from vidray.serve.routes import check_bearer

    tokens = (TOKEN_A, TOKEN_B)
    alice, bob = check_bearer(f"Bearer {TOKEN_A}", tokens), check_bearer(f"bearer {TOKEN_B}", tokens)
    assert alice == client_id(TOKEN_A) and bob == client_id(TOKEN_B) and alice != bob
    assert len(alice) == 16 and TOKEN_A not in alice
    assert check_bearer(None, None) == check_bearer("Bearer anything", None) == ANONYMOUS_CLIENT
    with pytest.raises(RequestError) as info:
        check_bearer(f"Bearer {TOKEN_A}x", tokens)
    assert info.value.status == 401


def test_deleting_a_running_job_cancels_its_render_on_the_runners_loop(serve):
    """DELETE reads the store in a worker thread; the render's cancel must still run on the runner's loop (asyncio
    tasks are not thread-safe: with the loop's debug checks on, a cancel from the worker thread raised, and the
    DELETE answered 500 although the job was gone)."""
    import asyncio

    service, client, stages = serve(step_s=0.5)
    client.portal.call(lambda: asyncio.get_running_loop().set_debug(True))
    video_id = _create(client, "a long one").json()["id"]
    _wait_for(lambda: video_id in service._renders, what="the render started")
    response = client.delete(f"/v1/videos/{video_id}")
    assert response.status_code == 200, response.text
    _wait_for(lambda: video_id not in service._renders, timeout_s=0.5, what="the render cancelled at once")
    assert stages.num_decoded == 0 and service.store.get(video_id) is None
