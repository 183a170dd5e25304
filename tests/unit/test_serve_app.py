"""`build_app` checks the serve application's args before Serve starts anything: unknown keys, the bearer token,
the model folder, and what the model can make (issue 8 items 1 and 6). No Ray is started here."""

import asyncio
import os
import time

os.environ.setdefault("HF_HUB_OFFLINE", "1")

import pytest  # noqa: E402
import yaml  # noqa: E402

from vidray.models.export import inspect_model  # noqa: E402
from vidray.serve.app import ServeSettings, ServeSettingsError, build_app, model_spec  # noqa: E402

REPO_CONFIG = os.path.join(os.path.dirname(__file__), "..", "..", "serve", "serve_config.yaml")
TOKEN = "a-token-of-at-least-16-chars"
TOKEN2 = "another-token-of-16-chars-or-more"


@pytest.fixture(scope="module")
def model_dir(tiny_serve_model_dir):
    return tiny_serve_model_dir


def _args(model_dir, tmp_path, **extra):
    return {"model_path": str(model_dir), "store_dir": str(tmp_path / "store"), **extra}


def test_shipped_config_args_are_valid_settings():
    config = yaml.safe_load(open(REPO_CONFIG))
    app = config["applications"][0]
    assert app["import_path"] == "serve.app:build_app"
    assert config["http_options"]["host"] == "127.0.0.1"
    ServeSettings(**app["args"])  # raises on an unknown or out-of-range key
    names = {d["name"] for d in app["deployments"]}
    assert names == {"VideoIngress", "TextEncoder", "Denoiser", "VaeDecoder"}
    denoiser = next(d for d in app["deployments"] if d["name"] == "Denoiser")
    assert denoiser["max_ongoing_requests"] >= app["args"]["policy"]["max_batch_size"]


def test_unknown_or_out_of_range_keys_are_refused_naming_them(model_dir, tmp_path, monkeypatch):
    monkeypatch.setenv("VIDRAY_API_TOKEN", TOKEN)
    with pytest.raises(ServeSettingsError, match="policy.max_batch_sise: unknown key \\(did you mean max_batch_size"
                                                 "\\?\\); valid: latency_quantile, latency_target_s, max_batch_size, max_wait_s"):
        build_app(_args(model_dir, tmp_path, policy={"max_batch_sise": 4}))
    with pytest.raises(ServeSettingsError, match="store_dri: unknown key \\(did you mean store_dir\\?\\)"):
        build_app({**_args(model_dir, tmp_path), "store_dri": "x"})
    with pytest.raises(ServeSettingsError, match="runner.lease_s"):
        build_app(_args(model_dir, tmp_path, runner={"lease_s": 0}))
    with pytest.raises(ServeSettingsError, match="limits.max_queued_jobs_per_token: Input should be greater than or "
                                                 "equal to 1"):
        build_app(_args(model_dir, tmp_path, limits={"max_queued_jobs_per_token": 0}))
    with pytest.raises(ServeSettingsError, match="retention.hours: Input should be greater than 0"):
        build_app(_args(model_dir, tmp_path, retention={"hours": 0}))
    assert not (tmp_path / "store").exists()  # nothing was created before the args were found bad


def test_without_a_token_the_app_refuses_to_start_and_names_both_fixes(model_dir, tmp_path, monkeypatch):
    monkeypatch.delenv("VIDRAY_API_TOKEN", raising=False)
    with pytest.raises(ServeSettingsError, match="VIDRAY_API_TOKEN.*auth.disabled: true"):
        build_app(_args(model_dir, tmp_path))
    monkeypatch.setenv("VIDRAY_API_TOKEN", "short")
    with pytest.raises(ServeSettingsError, match="shorter than 16"):
        build_app(_args(model_dir, tmp_path))


def test_token_file_and_explicitly_disabled_auth_build_the_app_and_disabled_auth_warns(model_dir, tmp_path,
                                                                                      monkeypatch, caplog):
    monkeypatch.delenv("VIDRAY_API_TOKEN", raising=False)
    token_file = tmp_path / "token"
    token_file.write_text(f"# clients of the demo\n{TOKEN}\n\n  {TOKEN2}  \n{TOKEN}\n")
    app = build_app(_args(model_dir, tmp_path, auth={"token_file": str(token_file)}))
    ingress = app._bound_deployment
    assert ingress.name == "VideoIngress"
    assert ingress.init_args[1] == (TOKEN, TOKEN2)  # one per line, stripped, comments and repeats skipped
    token_file.write_text(f"{TOKEN}\nshort\n")
    with pytest.raises(ServeSettingsError, match="auth.token_file .* \\(token 2 of 2\\) is empty or shorter than 16"):
        build_app(_args(model_dir, tmp_path, auth={"token_file": str(token_file)}))
    with caplog.at_level("INFO", logger="vidray.serve.app"):
        app = build_app(_args(model_dir, tmp_path, auth={"disabled": True}))
    assert app._bound_deployment.init_args[1] is None
    # Issue 27: logged at INFO as "auth off"; turning auth off is a security choice, a WARNING naming the setting.
    warned = [r for r in caplog.records if r.levelname == "WARNING" and "auth.disabled: true" in r.getMessage()]
    assert len(warned) == 1 and "without a bearer token" in warned[0].getMessage()
    with pytest.raises(ServeSettingsError, match="auth.token_file .* does not exist"):
        build_app(_args(model_dir, tmp_path, auth={"token_file": str(tmp_path / "missing")}))
    with pytest.raises(ServeSettingsError, match="auth.token_file .* is a folder"):
        build_app(_args(model_dir, tmp_path, auth={"token_file": str(tmp_path)}))


def test_memory_reaches_every_stage_and_training_only_keys_are_refused(model_dir, tmp_path, monkeypatch):
    monkeypatch.setenv("VIDRAY_API_TOKEN", TOKEN)
    app = build_app(_args(model_dir, tmp_path, memory={"storage_dtype": "fp8", "offload": "model"}))
    ingress = app._bound_deployment
    stages = [arg._bound_deployment for arg in ingress.init_args[2:5]]
    assert [stage.name for stage in stages] == ["TextEncoder", "Denoiser", "VaeDecoder"]
    for stage in stages:
        assert stage.init_kwargs["memory"] == {"storage_dtype": "fp8", "block_swap": 0, "fsdp_cpu_offload": False,
                                               "offload": "model", "activation_offload": False}, stage.name
    for key, value in (("block_swap", 4), ("fsdp_cpu_offload", True), ("activation_offload", True)):
        with pytest.raises(ServeSettingsError, match=f"^memory.{key} is training-only .* remove memory.{key}$"):
            build_app(_args(model_dir, tmp_path, memory={key: value}))
    with pytest.raises(ServeSettingsError, match="memory.storage_dtype"):
        build_app(_args(model_dir, tmp_path, memory={"storage_dtype": "fp4"}))


def test_a_model_path_that_is_not_a_model_is_refused_before_any_weights(tmp_path, monkeypatch):
    monkeypatch.setenv("VIDRAY_API_TOKEN", TOKEN)
    (tmp_path / "empty").mkdir()
    with pytest.raises(ServeSettingsError, match="model_path: .*neither a diffusers folder"):
        build_app({"model_path": str(tmp_path / "empty"), "store_dir": str(tmp_path / "s")})


def test_a_store_dir_that_cannot_hold_a_store_is_one_line_before_serving(model_dir, tmp_path, monkeypatch):
    """Without a connected Ray (a dry build) the head's store folder is checked here; with Ray it is checked on
    the head (tests/integration/test_serve_failover.py). Either way one line naming store_dir."""
    monkeypatch.setenv("VIDRAY_API_TOKEN", TOKEN)
    (tmp_path / "a-file").write_text("not a folder")
    for store_on in ("head", "replica"):
        with pytest.raises(ServeSettingsError, match=rf"^store_dir .*a-file \(store_on: {store_on}\): .*File exists"):
            build_app(_args(model_dir, tmp_path, store_dir=str(tmp_path / "a-file"), store_on=store_on))
    with pytest.raises(ServeSettingsError, match="store_on: Input should be 'head' or 'replica'"):
        build_app(_args(model_dir, tmp_path, store_on="ingress"))


def test_model_spec_follows_the_models_bucket_and_frame_rule(model_dir, tmp_path):
    settings = ServeSettings(model_path=str(model_dir), fps=8.0)
    spec = model_spec(settings, inspect_model(model_dir))
    assert spec.default_size == (48, 64) and spec.default_num_frames == 9  # (width, height) of bucket 9x64x48
    assert spec.size_multiple == 16
    assert [n for n in range(1, 14) if spec.valid_num_frames(n)] == [1, 5, 9, 13]  # EasyAnimate: 1 or 4k + 1
    assert spec.supports_image_to_video is False


def test_a_stage_error_reaches_the_client_as_its_own_type_and_message_without_the_remote_traceback():
    # A new user's trial: a stage's RuntimeError reached GET /v1/videos/{id} as Ray's remote traceback with
    # terminal colour codes. Ray raises the stage's error as RayTaskError(<its type>); its cause is what is named.
    from ray.exceptions import RayTaskError

    from vidray.serve.app import failure_message

    cause = RuntimeError("Sizes of tensors must match except in dimension 2")
    remote = RayTaskError("VaeDecoder.decode", "Traceback (most recent call last):\n\x1b[36m  File ...\x1b[39m",
                          cause).as_instanceof_cause()
    assert isinstance(remote, RuntimeError)  # what a handle call raises
    message = failure_message(remote)
    assert message.startswith("internal error while making this video (error id ") and "\x1b" not in message
    assert failure_message(remote) == message  # the same error, the same id


def test_an_internal_error_shows_the_client_an_error_id_and_the_log_the_paths_and_hosts(caplog):
    # Issue 27: a stage's FileNotFoundError put the server's paths and host name in the job's error.message.
    from ray.exceptions import RayTaskError

    from vidray.inference.sampler import NonFiniteLatentsError
    from vidray.serve.app import failure_message

    secret = "[Errno 2] No such file: '/srv/vidray/models/tiny/vae.safetensors' on node gpu-7.internal"
    remote = RayTaskError("VaeDecoder.decode", "Traceback ...", FileNotFoundError(secret)).as_instanceof_cause()
    with caplog.at_level("ERROR", logger="vidray.serve.app"):
        message = failure_message(remote)
    error_id = message.split("error id ")[1][:8]
    assert "/srv" not in message and "gpu-7" not in message and "FileNotFoundError" not in message
    assert any(error_id in r.getMessage() and secret in r.getMessage() for r in caplog.records)
    other = failure_message(RuntimeError("another"))
    assert other.split("error id ")[1][:8] != error_id
    # What the request asked for and cannot get keeps its own words (a 4xx-like failure; 500 characters at most).
    cause = NonFiniteLatentsError("the denoised latents hold NaN (guidance_scale 1e+300)" + "x" * 600)
    assert failure_message(cause) == ("NonFiniteLatentsError: the denoised latents hold NaN (guidance_scale 1e+300)"
                                      + "x" * 600)[:500]


def test_a_job_failed_by_what_it_asked_for_is_invalid_request_not_internal_error():
    # A new user's trial: guidance_scale=1e300 failed as internal_error, though resending it fails the same way.
    from ray.exceptions import RayTaskError

    from vidray.inference.sampler import NonFiniteLatentsError
    from vidray.serve.app import failure_code

    cause = NonFiniteLatentsError("the denoised latents hold NaN (guidance_scale 1e+300)")
    remote = RayTaskError("Denoiser.denoise", "Traceback ...", cause).as_instanceof_cause()
    assert failure_code(remote) == failure_code(cause) == "invalid_request"
    bug = RayTaskError("Denoiser.denoise", "Traceback ...", RuntimeError("CUDA error")).as_instanceof_cause()
    assert failure_code(bug) == failure_code(ValueError("x")) == "internal_error"


class _Hang:
    """A stage handle whose every call waits until cancelled (a render in progress)."""

    def __init__(self):
        self.started = None

    def __getattr__(self, name):
        return self

    def options(self, **_):
        return self

    def remote(self, *args, **kwargs):
        import asyncio

        self.started.set()
        return asyncio.get_running_loop().create_future()  # never resolved


def test_shutdown_hands_running_and_just_claimed_jobs_back_and_stops_the_runner(model_dir, tmp_path):
    """The ingress's clean stop (`VideoIngress.__del__`): a job mid-render and one the runner claims during the
    stop both end `queued` with no attempt used, and the runner ends (it is not cancelled mid-claim, which left a
    claimed job to wait out its lease)."""
    import asyncio
    import threading
    import time

    from vidray.serve.app import VideoJobService

    settings = ServeSettings(model_path=str(model_dir), store_dir=str(tmp_path / "store"), fps=8.0,
                             store_on="replica", runner={"max_concurrent_jobs": 2, "lease_s": 30.0, "poll_s": 0.05})
    stage = _Hang()

    async def scenario():
        stage.started = asyncio.Event()
        service = VideoJobService(settings, None, stage, stage, stage)
        params = {"num_frames": 9, "width": 48, "height": 64, "seed": 0, "num_inference_steps": 2,
                  "guidance_scale": 1.0, "negative_prompt": "", "fps": 8.0}
        # Once `block` is set, the runner's next claim waits in its thread until the stop has begun, then a second
        # job arrives and that claim takes it: a claim in flight across the stop. (The second job is created only
        # then, so no claim that began earlier can take it.)
        claim, block, claiming, second = service.store.claim, threading.Event(), threading.Event(), []

        def claim_during_the_stop(owner, lease_s, **free):
            if block.is_set() and not claiming.is_set():
                claiming.set()
                deadline = time.monotonic() + 10
                while not service._stopping and time.monotonic() < deadline:
                    time.sleep(0.01)
                time.sleep(0.2)
                second.append(service.store.create(model="m", prompt="b", size="48x64", seconds="1",
                                                   params=params).id)
            return claim(owner, lease_s, **free)

        service.store.claim = claim_during_the_stop
        first = service.store.create(model="m", prompt="a", size="48x64", seconds="1", params=params)
        service.ensure_runner()
        await asyncio.wait_for(stage.started.wait(), 10)  # the first job is rendering
        block.set()
        service._wake.set()
        assert await asyncio.to_thread(claiming.wait, 10)
        handed_back = await service.shutdown(timeout_s=5)
        assert service._runner_task.done()
        service.ensure_runner()  # a health check after the stop starts nothing
        assert service._runner_task.done()
        return first.id, second, handed_back, service.store

    first, second, handed_back, store = asyncio.run(scenario())  # its end joins the claim's thread
    assert first in handed_back and len(second) == 1
    for job_id in (first, second[0]):
        job = store.get(job_id)
        assert (job.status, job.attempts, job.owner) == ("queued", 0, None), job


@pytest.mark.parametrize(("interval_ms", "refresh_s"), [(None, 5.0), ("10000", 5.0), ("1000", 0.5), ("100", 0.25),
                                                        ("60000", 5.0), ("soon", 5.0)])
def test_gauges_are_re_set_within_rays_metrics_report_interval(monkeypatch, interval_ms, refresh_s):
    from vidray.serve.metrics import gauge_refresh_s

    if interval_ms is None:
        monkeypatch.delenv("RAY_metrics_report_interval_ms", raising=False)
    else:
        monkeypatch.setenv("RAY_metrics_report_interval_ms", interval_ms)
    assert gauge_refresh_s() == refresh_s


class _Stages:
    """Stage handles that answer at once: the prompt's embeddings, one latents event, and `frames` as the decoded
    video."""

    def __init__(self, frames):
        self.frames = frames

    def options(self, **_):
        return self

    def __getattr__(self, name):
        import torch

        async def answer(value):
            return value

        class Stream:
            async def __aiter__(self):
                yield {"latents": torch.zeros(1), "step": 2}

            def cancel(self):
                pass

        class Method:
            @staticmethod
            def remote(*args, **kwargs):
                if name == "denoise":
                    return Stream()
                return answer((torch.zeros(1, 4, 8), torch.ones(1, 4, dtype=torch.bool)) if name == "encode"
                              else self.frames)

        return Method()


@pytest.mark.parametrize("crf", [0, 18])
def test_the_runner_writes_the_mp4_at_the_settings_crf_and_crf_0_keeps_the_frames_exactly(model_dir, tmp_path, crf):
    """`crf` reaches the encoder: 0 is lossless (the decoded frames are those of the lossless encode of the decoded
    video, whatever libx264 decides), 18 the shipped default (smaller, lossy). Out of range is refused."""
    import asyncio

    import numpy as np

    from vidray.data.video import decode_mp4, encode_mp4
    from vidray.serve.app import VideoJobService

    frames = np.random.RandomState(0).randint(0, 256, (9, 64, 48, 3), dtype=np.uint8)
    settings = ServeSettings(model_path=str(model_dir), store_dir=str(tmp_path / "store"), store_on="replica",
                             crf=crf, runner={"poll_s": 0.05})

    async def scenario():
        stages = _Stages(frames)
        service = VideoJobService(settings, None, stages, stages, stages)
        params = {"num_frames": 9, "width": 48, "height": 64, "seed": 0, "num_inference_steps": 2,
                  "guidance_scale": 1.0, "negative_prompt": "", "fps": 8.0}
        job = service.store.create(model="m", prompt="a", size="48x64", seconds="1.125", params=params)
        return await run_until_finished(service, job.id, timeout_s=30)

    job, store = asyncio.run(scenario())
    assert job.status == "completed", job
    mp4 = store.video_path(job.id).read_bytes()
    lossless = encode_mp4(frames, 8.0, crf=0)
    if crf == 0:
        np.testing.assert_array_equal(decode_mp4(mp4), decode_mp4(lossless))
    else:
        assert len(mp4) < len(lossless) / 1.5 and not np.array_equal(decode_mp4(mp4), decode_mp4(lossless))
    with pytest.raises(ValueError, match="crf"):
        ServeSettings(model_path=str(model_dir), crf=52)


async def run_until_finished(service, job_id: str, *, timeout_s: float):
    """Start `service`'s runner, wait (at most `timeout_s`) until job `job_id` is completed or failed, stop the
    runner; returns (the job's record, the store)."""
    service.ensure_runner()
    deadline = time.monotonic() + timeout_s
    while service.store.get(job_id).status not in ("completed", "failed") and time.monotonic() < deadline:
        await asyncio.sleep(0.05)
    await service.shutdown(timeout_s=5)
    return service.store.get(job_id), service.store


class _StageHandle:
    """A stage handle as Serve gives one to the ingress: only its deployment and application names are read here."""

    def __init__(self, deployment_name: str):
        self.deployment_name, self.app_name = deployment_name, "app"


def test_every_running_jobs_stage_check_shares_one_serve_status_call_per_heartbeat(model_dir, tmp_path, monkeypatch):
    """The heartbeat of each running job asks whether a stage is DEPLOY_FAILED; with many jobs the replica still
    asks Serve's controller once per beat (`runner.lease_s` / 3), and the answer names the failed stage."""
    import threading

    from ray.serve.schema import ApplicationStatusOverview, DeploymentStatusOverview, ServeStatus

    import vidray.serve.app as app_module
    from vidray.serve.app import VideoJobService

    calls = []

    def status():
        calls.append(time.monotonic())
        time.sleep(0.05)  # a controller round trip: concurrent checks must wait for this one, not ask again
        deployments = {name: DeploymentStatusOverview(status="HEALTHY", status_trigger="CONFIG_UPDATE_COMPLETED",
                                                      replica_states={"RUNNING": 1}, message="")
                       for name in ("TextEncoder", "VaeDecoder")}
        deployments["Denoiser"] = DeploymentStatusOverview(
            status="DEPLOY_FAILED", status_trigger="REPLICA_STARTUP_FAILED", replica_states={},
            message="the replica's constructor raised")
        return ServeStatus(applications={"app": ApplicationStatusOverview(
            status="DEPLOY_FAILED", message="", last_deployed_time_s=0.0, deployments=deployments)})

    monkeypatch.setattr(app_module.serve, "status", status)
    settings = ServeSettings(model_path=str(model_dir), store_dir=str(tmp_path / "store"), fps=8.0,
                             store_on="replica", runner={"lease_s": 1.5})  # a beat every 0.5 s
    service = VideoJobService(settings, None, _StageHandle("TextEncoder"), _StageHandle("Denoiser"),
                              _StageHandle("VaeDecoder"))
    answers = []
    beats = [threading.Thread(target=lambda: answers.append(service.unavailable_stage())) for _ in range(16)]
    for beat in beats:
        beat.start()
    for beat in beats:
        beat.join()
    assert len(calls) == 1
    assert [str(a) for a in answers] == ["the Denoiser stage is DEPLOY_FAILED: the replica's constructor raised"] * 16
    time.sleep(0.55)  # the next beat asks again
    assert str(service.unavailable_stage()) == str(answers[0]) and len(calls) == 2


UNSCHEDULED = ("Deployment 'Denoiser' in application 'app' has 1 replicas that have taken more than 30s to be "
               "scheduled. This may be due to waiting for the cluster to auto-scale or for a runtime environment to be "
               "installed. Resources required for each replica: {\"CPU\": 1}, total resources available: {}. Use "
               "`ray status` for more details.")
"""Serve's (ray 2.60) status message of a deployment whose replica waits for a node (PENDING_ALLOCATION)."""


def _serve_status(denoiser_replicas: dict[str, int], message: str = UNSCHEDULED):
    """A `serve.status()` answer: TextEncoder and VaeDecoder healthy, the Denoiser with these replica states and
    message (Serve reports UPDATING while a replica waits to start)."""
    from ray.serve.schema import ApplicationStatusOverview, DeploymentStatusOverview, ServeStatus

    deployments = {name: DeploymentStatusOverview(status="HEALTHY", status_trigger="CONFIG_UPDATE_COMPLETED",
                                                  replica_states={"RUNNING": 1}, message="")
                   for name in ("TextEncoder", "VaeDecoder")}
    deployments["Denoiser"] = DeploymentStatusOverview(status="UPDATING", status_trigger="CONFIG_UPDATE_STARTED",
                                                       replica_states=denoiser_replicas, message=message)
    return ServeStatus(applications={"app": ApplicationStatusOverview(
        status="DEPLOYING", message="", last_deployed_time_s=0.0, deployments=deployments)})


def test_a_stage_with_a_placed_replica_takes_the_jobs_and_an_unplaced_one_is_named_then_fails_them(
        model_dir, tmp_path, monkeypatch):
    """Issue 44 part 8. A Denoiser with one replica running and one waiting for a node is no problem (Serve routes
    to the running one). With none running and Serve reporting its replica unscheduled, `GET /v1/status` names the
    stage at once, and a job waiting on it fails after `runner.unplaced_stage_timeout_s` with `stage_unplaced`
    and a message naming the stage (before, it stayed in_progress for good: Ray leaves the replica PENDING)."""
    import vidray.serve.app as app_module
    from vidray.serve.app import StageUnplacedError, VideoJobService

    answer = {"status": _serve_status({"RUNNING": 1, "STARTING": 1})}
    monkeypatch.setattr(app_module.serve, "status", lambda: answer["status"])
    settings = ServeSettings(model_path=str(model_dir), store_dir=str(tmp_path / "store"), store_on="replica",
                             runner={"lease_s": 0.6, "poll_s": 0.05, "unplaced_stage_timeout_s": 1.0})
    service = VideoJobService(settings, None, _StageHandle("TextEncoder"), _StageHandle("Denoiser"),
                              _StageHandle("VaeDecoder"))
    assert service.stage_problems() == [] and service.unavailable_stage() is None  # one replica placed
    answer["status"] = _serve_status({"STARTING": 2}, message="")
    time.sleep(0.25)
    assert service.stage_problems() == []  # starting, not (yet) reported unscheduled: a model loading
    answer["status"] = _serve_status({"STARTING": 2})
    time.sleep(0.25)
    status = asyncio.run(service.status())
    assert [p["stage"] for p in status["stages"]["unplaced"]] == ["Denoiser"] and status["stages"]["failed"] == []
    assert "to be scheduled" in status["stages"]["unplaced"][0]["message"]
    assert service.unavailable_stage() is None  # within the bounded wait: an autoscaler may add a node

    class Stage(_Hang, _StageHandle):  # a handle of this app whose calls never answer (no replica to run them)
        def __init__(self, name):
            _Hang.__init__(self)
            _StageHandle.__init__(self, name)

    async def scenario():
        stages = [Stage(name) for name in ("TextEncoder", "Denoiser", "VaeDecoder")]
        for stage in stages:
            stage.started = asyncio.Event()
        runner = VideoJobService(settings, None, *stages)
        params = {"num_frames": 9, "width": 48, "height": 64, "seed": 0, "num_inference_steps": 2,
                  "guidance_scale": 1.0, "negative_prompt": "", "fps": 8.0}
        job = runner.store.create(model="m", prompt="a", size="48x64", seconds="1", params=params)
        start = time.monotonic()
        record, _store = await run_until_finished(runner, job.id, timeout_s=20)
        return record, time.monotonic() - start

    job, waited_s = asyncio.run(scenario())
    assert job.status == "failed" and job.error["code"] == "stage_unplaced", job
    assert "the Denoiser stage has no replica running: Serve could not place one on any node" in job.error["message"]
    assert "add a matching node or fix the stage's placement" in job.error["message"]
    assert 1.0 < waited_s < 10, waited_s
    assert isinstance(service.unavailable_stage(), StageUnplacedError)  # past the wait here too
    answer["status"] = _serve_status({"RUNNING": 1, "STARTING": 1})  # a node joined: placed again
    time.sleep(0.25)
    assert service.stage_problems() == [] and service.unavailable_stage() is None


def test_a_denoiser_spanning_processes_gets_a_placement_group_of_one_bundle_each_and_bad_spans_are_one_line(
        model_dir, tmp_path, monkeypatch):
    """`denoiser.processes` / `gpus` (issue 47): the Denoiser deployment gets a STRICT_PACK placement group of one
    bundle per rank and the span in its init kwargs; a span the family cannot split is refused in one line."""
    from types import SimpleNamespace

    from vidray.serve.app import DenoiserSettings, _spanning_options

    monkeypatch.setenv("VIDRAY_API_TOKEN", TOKEN)
    app = build_app(_args(model_dir, tmp_path, denoiser={"processes": 2}))
    denoiser = app._bound_deployment.init_args[3]._bound_deployment
    assert denoiser.name == "Denoiser"
    assert denoiser._deployment_config.max_ongoing_requests >= 16
    assert denoiser._replica_config.placement_group_bundles == [{"CPU": 1.0}, {"CPU": 1.0}]
    assert denoiser._replica_config.placement_group_strategy == "STRICT_PACK"
    assert (denoiser.init_kwargs["processes"], denoiser.init_kwargs["gpus"]) == (2, 1)
    plain = build_app(_args(model_dir, tmp_path))._bound_deployment.init_args[3]._bound_deployment
    assert plain._replica_config.placement_group_bundles is None
    assert _spanning_options(DenoiserSettings(gpus=2), SimpleNamespace(family_name="wan"), None)[
        "placement_group_bundles"] == [{"CPU": 1.0, "GPU": 1.0}] * 2
    with pytest.raises(ServeSettingsError, match="^denoiser: gpus .2. and processes .2. cannot both be above 1"):
        build_app(_args(model_dir, tmp_path, denoiser={"processes": 2, "gpus": 2}))
    with pytest.raises(ServeSettingsError, match="^denoiser.gpus 2 without guidance .* the animatediff family does "
                                                 "not support; use denoiser.gpus 2 with"):
        _spanning_options(DenoiserSettings(gpus=2, cfg_parallel=False), SimpleNamespace(family_name="animatediff"),
                          None)
    assert _spanning_options(DenoiserSettings(gpus=2), SimpleNamespace(family_name="animatediff"), None)
    with pytest.raises(ServeSettingsError, match="two-expert model"):
        _spanning_options(DenoiserSettings(gpus=2), SimpleNamespace(family_name="wan"), object())
