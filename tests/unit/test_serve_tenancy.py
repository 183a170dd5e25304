"""Tenancy over HTTP (issue 44 parts 1, 4, 5): each bearer token sees only its own videos, admins see all, byte
quotas and the free-space floor refuse creates without losing anything, and an `Idempotency-Key` makes a create
safe to retry, also when the SDK retries one that timed out. The real `VideoJobService` (its sqlite store in
tmp_path, its runner) behind the real FastAPI app, with stage stand-ins that render in milliseconds."""

from __future__ import annotations

import asyncio
import threading
import time
import warnings

import openai
import pytest
import uvicorn
from starlette.testclient import TestClient

from tests.unit.test_serve_limits import TOKEN_A, TOKEN_B, Stages, _wait_for, serve_maker
from vidray.serve.app import ServeSettings, VideoJobService
from vidray.serve.routes import build_api

TOKEN_ADMIN = "admin-token-of-at-least-16-chars"
BODY = {"prompt": "a red fox", "num_inference_steps": 2}


def _auth(token: str) -> dict:
    return {"Authorization": f"Bearer {token}"}


@pytest.fixture
def serve(tiny_serve_model_dir, tmp_path):
    """make(**settings sections) -> (service, TestClient without a token); alice, bob and an admin."""
    with serve_maker(tiny_serve_model_dir, tmp_path, admin_tokens=(TOKEN_ADMIN,), app_name="vidray") as make:
        yield lambda *args, **sections: make(*args, **sections)[:2]


def _create(client: TestClient, token: str, prompt: str = "a red fox", **headers):
    return client.post("/v1/videos", json={**BODY, "prompt": prompt}, headers={**_auth(token), **headers})


def _completed(service: VideoJobService, video_id: str) -> None:
    _wait_for(lambda: service.store.get(video_id).status == "completed", what=f"{video_id} completed")


# ---------------------------------------------------------------- part 1


def test_token_b_gets_404_on_token_as_video_for_get_content_and_delete_and_never_lists_it(serve):
    service, client = serve()
    video_a = _create(client, TOKEN_A, "alice's secret prompt").json()["id"]
    _completed(service, video_a)
    mine_b = [_create(client, TOKEN_B, f"bob {i}").json()["id"] for i in range(3)]
    unknown = "video_" + "0" * 32
    for method, path in (("GET", "/v1/videos/{}"), ("GET", "/v1/videos/{}/content"), ("DELETE", "/v1/videos/{}")):
        started = time.monotonic()
        theirs = client.request(method, path.format(video_a), headers=_auth(TOKEN_B))
        assert time.monotonic() - started < 1.0
        nobody = client.request(method, path.format(unknown), headers=_auth(TOKEN_B))
        assert theirs.status_code == nobody.status_code == 404, (method, path, theirs.text)
        # The same answer as an id that never existed, but for the id itself: nothing confirms it exists.
        assert theirs.json()["error"]["message"].replace(video_a, "ID") == \
            nobody.json()["error"]["message"].replace(unknown, "ID")
    # B's list, page by page, holds B's jobs and never A's; A's id is not a cursor for B.
    seen, after = [], None
    while True:
        page = client.get("/v1/videos", params={"limit": 1, **({"after": after} if after else {})},
                          headers=_auth(TOKEN_B)).json()
        seen += [video["id"] for video in page["data"]]
        if not page["has_more"]:
            break
        after = page["last_id"]
    assert sorted(seen) == sorted(mine_b) and video_a not in seen and "alice" not in str(page)
    response = client.get("/v1/videos", params={"after": video_a}, headers=_auth(TOKEN_B))
    assert response.status_code == 400 and response.json()["error"]["param"] == "after"
    assert sum(client.get("/v1/status", headers=_auth(TOKEN_B)).json()["jobs"].values()) == 3
    # A still reads and downloads its video, which B's DELETE left in place.
    assert client.get(f"/v1/videos/{video_a}", headers=_auth(TOKEN_A)).json()["status"] == "completed"
    content = client.get(f"/v1/videos/{video_a}/content", headers=_auth(TOKEN_A))
    assert content.status_code == 200
    assert content.content == (service.store.videos_dir / f"{video_a}.mp4").read_bytes()
    assert [v["id"] for v in client.get("/v1/videos", headers=_auth(TOKEN_A)).json()["data"]] == [video_a]


def test_an_admin_token_lists_reads_and_deletes_every_clients_videos(serve):
    service, client = serve()
    video_a = _create(client, TOKEN_A).json()["id"]
    video_b = _create(client, TOKEN_B).json()["id"]
    listed = {v["id"] for v in client.get("/v1/videos", headers=_auth(TOKEN_ADMIN)).json()["data"]}
    assert listed == {video_a, video_b}
    assert client.get(f"/v1/videos/{video_a}", headers=_auth(TOKEN_ADMIN)).status_code == 200
    assert client.delete(f"/v1/videos/{video_b}", headers=_auth(TOKEN_ADMIN)).json()["deleted"] is True
    assert client.get(f"/v1/videos/{video_b}", headers=_auth(TOKEN_B)).status_code == 404


# ---------------------------------------------------------------- part 4


def test_an_over_quota_client_gets_a_403_naming_the_quota_and_loses_nothing(serve):
    service, client = serve(limits={"max_stored_bytes_per_token": 100})
    first = _create(client, TOKEN_A).json()["id"]
    _completed(service, first)  # its mp4 (a few KiB) takes alice past 100 bytes
    mp4 = client.get(f"/v1/videos/{first}/content", headers=_auth(TOKEN_A)).content
    started = time.monotonic()
    response = _create(client, TOKEN_A, "one more")
    assert time.monotonic() - started < 1.0
    assert response.status_code == 403, response.text
    error = response.json()["error"]
    assert error["code"] == "storage_quota_exceeded" and "retry-after" not in response.headers
    assert "quota is 100 bytes" in error["message"] and "max_stored_bytes_per_token" in error["message"]
    assert "DELETE /v1/videos/{id}" in error["message"]
    # Nothing was lost: alice's video is still there, and bob (under his quota) still creates.
    assert client.get(f"/v1/videos/{first}/content", headers=_auth(TOKEN_A)).content == mp4
    assert service.store.counts() == {"queued": 0, "in_progress": 0, "completed": 1, "failed": 0}
    assert _create(client, TOKEN_B).status_code == 200
    # Deleting frees the room.
    assert client.delete(f"/v1/videos/{first}", headers=_auth(TOKEN_A)).status_code == 200
    assert _create(client, TOKEN_A, "one more").status_code == 200


@pytest.mark.parametrize("limits, words", [
    ({"min_free_bytes": 2**62}, ("free, below", "limits.min_free_bytes")),
    ({"max_stored_bytes": 100}, ("quota is 100 bytes", "limits.max_stored_bytes")),
])
def test_the_stores_quota_or_a_short_disk_is_a_507_naming_the_limit_and_jobs_stay(serve, limits, words):
    service, client = serve()
    first = _create(client, TOKEN_A).json()["id"]
    _completed(service, first)
    service.settings = service.settings.model_copy(
        update={"limits": service.settings.limits.model_copy(update=limits)})
    response = _create(client, TOKEN_B)
    assert response.status_code == 507 and response.headers["retry-after"] == "10"
    error = response.json()["error"]
    assert error["code"] == "insufficient_storage" and all(word in error["message"] for word in words), error
    assert str(service.settings.store_dir) not in response.text
    assert client.get(f"/v1/videos/{first}/content", headers=_auth(TOKEN_A)).status_code == 200


# ---------------------------------------------------------------- part 5


def test_one_idempotency_key_makes_one_job_and_another_body_with_it_is_a_422(serve):
    service, client = serve(step_s=60.0)
    first = _create(client, TOKEN_A, **{"Idempotency-Key": "order-42"})
    again = _create(client, TOKEN_A, **{"Idempotency-Key": "order-42"})
    assert first.status_code == again.status_code == 200 and first.json()["id"] == again.json()["id"]
    assert sum(service.store.counts().values()) == 1
    other = _create(client, TOKEN_A, "another prompt", **{"Idempotency-Key": "order-42"})
    assert other.status_code == 422
    error = other.json()["error"]
    assert (error["param"], error["code"]) == ("idempotency-key", "idempotency_key_reused")
    assert first.json()["id"] in error["message"] and "new key" in error["message"]
    # Keys are per client: bob's "order-42" is his own job.
    assert _create(client, TOKEN_B, **{"Idempotency-Key": "order-42"}).json()["id"] != first.json()["id"]
    for bad in ("x" * 256, "caf\u00e9".encode(), "a\tb"):
        response = client.post("/v1/videos", json=BODY, headers={**_auth(TOKEN_A), "Idempotency-Key": bad})
        assert response.status_code == 400 and response.json()["error"]["param"] == "idempotency-key"
    assert sum(service.store.counts().values()) == 2


@pytest.fixture
def sdk_server(tiny_serve_model_dir, tmp_path):
    """(service, base URL, slow_creates): a real uvicorn server on 127.0.0.1 over a real VideoJobService whose store
    `create` commits and then takes `slow_creates["s"]` more seconds to answer (a head store under load)."""
    settings = ServeSettings(model_path=str(tiny_serve_model_dir), store_dir=str(tmp_path / "store"), fps=8.0,
                             store_on="replica")
    stages = Stages(0.01)
    service = VideoJobService(settings, (TOKEN_A,), stages.text, stages.denoiser, stages.vae)
    create, slow_creates = service.store.create, {"s": 0.0}

    def slow_create(**kwargs):
        job = create(**kwargs)
        time.sleep(slow_creates["s"])
        return job

    service.store.create = slow_create
    server = uvicorn.Server(uvicorn.Config(build_api(lambda: service), host="127.0.0.1", port=0,
                                           log_level="warning", lifespan="off"))
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    _wait_for(lambda: server.started, what="uvicorn started")
    yield service, f"http://127.0.0.1:{server.servers[0].sockets[0].getsockname()[1]}", slow_creates
    if service._loop is not None:
        asyncio.run_coroutine_threadsafe(service.shutdown(2.0), service._loop).result(10)
    server.should_exit = True
    thread.join(timeout=5)


@pytest.mark.filterwarnings("ignore::DeprecationWarning")
@pytest.mark.parametrize("key", ["sdk-retry-1", None])
def test_the_sdk_retrying_a_create_that_timed_out_makes_one_job_with_a_key(sdk_server, key):
    service, url, slow_creates = sdk_server
    slow_creates["s"] = 1.0  # each answer comes after the SDK's 0.4 s timeout
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", DeprecationWarning)
        sdk = openai.OpenAI(base_url=f"{url}/v1", api_key=TOKEN_A, max_retries=1, timeout=0.4)
    headers = {} if key is None else {"Idempotency-Key": key}
    with pytest.raises(openai.APITimeoutError):  # both tries time out: the SDK gives up
        sdk.videos.create(prompt="a red fox", extra_headers=headers, extra_body={"num_inference_steps": 2})
    slow_creates["s"] = 0.0
    video = sdk.videos.create(prompt="a red fox", extra_headers=headers, extra_body={"num_inference_steps": 2})
    time.sleep(1.1)  # every timed-out try has finished in its thread
    jobs, _ = service.store.list(limit=100)
    if key is None:  # the bug the key closes: one call to create became one job per try
        assert len(jobs) == 3
    else:
        assert [job.id for job in jobs] == [video.id]
    sdk.close()


def test_build_app_reads_admin_tokens_from_a_file_and_refuses_a_bad_one_naming_it(tiny_serve_model_dir, tmp_path,
                                                                                 monkeypatch):
    from vidray.serve.app import ServeSettingsError, build_app

    monkeypatch.setenv("VIDRAY_API_TOKEN", TOKEN_A)
    args = {"model_path": str(tiny_serve_model_dir), "store_dir": str(tmp_path / "store")}
    admin_file = tmp_path / "admins"
    admin_file.write_text(f"# operators\n{TOKEN_ADMIN}\n")
    app = build_app({**args, "auth": {"admin_token_file": str(admin_file)}})
    assert app._bound_deployment.init_kwargs["admin_tokens"] == (TOKEN_ADMIN,)
    assert build_app(args)._bound_deployment.init_kwargs["admin_tokens"] == ()
    for auth, words in (({"admin_token_file": str(tmp_path / "nope")}, "is missing"),
                        ({"admin_token_file": str(admin_file), "disabled": True}, "auth.disabled is true")):
        with pytest.raises(ServeSettingsError, match=f"auth.admin_token_file .*{words}"):
            build_app({**args, "auth": auth})
    admin_file.write_text("short\n")
    with pytest.raises(ServeSettingsError, match="shorter than 16 characters"):
        build_app({**args, "auth": {"admin_token_file": str(admin_file)}})


# ---------------------------------------------------------------- part 6


def test_a_second_app_on_a_store_folder_refuses_to_start_naming_the_folder_and_the_owner(tiny_serve_model_dir,
                                                                                        tmp_path):
    from vidray.serve.jobs import StoreOwnedError

    settings = ServeSettings(model_path=str(tiny_serve_model_dir), store_dir=str(tmp_path / "store"),
                             store_on="replica")
    stages = Stages(0.01)
    VideoJobService(settings, (TOKEN_A,), stages.text, stages.denoiser, stages.vae, app_name="vidray")
    VideoJobService(settings, (TOKEN_A,), stages.text, stages.denoiser, stages.vae, app_name="vidray")  # redeploy
    with pytest.raises(StoreOwnedError, match=r"^store_dir .*store belongs to Serve app 'vidray' .*not to app "
                                              r"'vidray-i2v': give each app its own store_dir"):
        VideoJobService(settings, (TOKEN_A,), stages.text, stages.denoiser, stages.vae, app_name="vidray-i2v")


def test_the_tenancy_keys_are_documented_in_serving_md_with_their_defaults():
    from pathlib import Path

    from vidray.serve.app import AuthSettings, LimitSettings

    doc = (Path(__file__).resolve().parents[2] / "docs/serving.md").read_text()
    for key in ("auth.admin_token_file", "limits.max_stored_bytes_per_token", "limits.max_stored_bytes",
                "limits.min_free_bytes", "Idempotency-Key", "owner.json", "serve-store-pvc.yaml"):
        assert key in doc, key
    limits = LimitSettings()
    assert (limits.max_stored_bytes_per_token, limits.min_free_bytes) == (10 * 2**30, 512 * 2**20)
    assert "(10 GiB)" in doc and "(512 MiB)" in doc and AuthSettings().admin_token_file is None
