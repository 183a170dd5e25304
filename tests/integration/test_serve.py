"""The Serve application end to end over real HTTP: `serve run` of serve/serve_config.yaml (its model, store and
port pointed at this test's tiny model and temp folders) on a `ray start --head` cluster on 127.0.0.1, driven by
the official `openai` SDK and raw HTTP (issue 8). The model is EasyAnimate's image-to-video (inpaint) kind, which
serves text-only requests too (the empty condition): every test here is a text-to-video request except the one
with a first frame (`input_reference`); `test_serve_failover.py` serves a text-to-video model."""

from __future__ import annotations

import contextlib
import http.client
import json
import os
import signal
import subprocess
import sys
import time
import urllib.error
import urllib.request
import warnings
from pathlib import Path
from typing import Any

import pytest
import yaml

from tests.integration.conftest import REPO, SERVE_BUCKET, free_port
from tests.integration.serve_configs import serve_config_for

pytestmark = pytest.mark.integration

TOKEN = "test-token-0123456789abcdef"
SERVE_START_S = 600.0
"""Seconds `serve_run` waits for every application's /healthz. It bounds a hang only: a healthy start answers sooner.
Four applications (test_serve_families, about 20 replicas on 2 cores) took ~120 s on a quiet machine and passed
240 s on a loaded CI machine, whose log showed every endpoint registered just after that deadline."""


def _request(method: str, url: str, *, token: str | None = TOKEN, data: bytes | None = None,
             headers: dict | None = None) -> tuple[int, bytes, dict]:
    req = urllib.request.Request(url, data=data, method=method, headers=dict(headers or {}))
    if token:
        req.add_header("Authorization", f"Bearer {token}")
    try:
        with urllib.request.urlopen(req, timeout=30) as resp:
            return resp.status, resp.read(), dict(resp.headers)
    except urllib.error.HTTPError as err:
        return err.code, err.read(), dict(err.headers)


class Served:
    def __init__(self, head, base_url: str, store_dir: Path, process: subprocess.Popen, log: Path):
        self.head, self.base_url, self.store_dir, self.process, self.log = head, base_url, store_dir, process, log

    def client(self, token: str = TOKEN):
        import openai

        return openai.OpenAI(api_key=token, base_url=f"{self.base_url}/v1", max_retries=0, timeout=60)

    def wait_for(self, video_id: str, statuses: tuple[str, ...], timeout_s: float = 120, seen: list | None = None):
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            code, body, _ = _request("GET", f"{self.base_url}/v1/videos/{video_id}")
            assert code == 200, body
            video = json.loads(body)
            if seen is not None:
                seen.append((video["status"], video["progress"]))
            if video["status"] in statuses:
                return video
            time.sleep(0.1)
        raise TimeoutError(f"{video_id} not {statuses} after {timeout_s} s; log: {self.log.read_text()[-3000:]}")

    def ray_cli(self, *args: str) -> str:
        env = dict(self.head.env)
        return subprocess.run([str(Path(sys.executable).parent / "ray"), *args], env=env, capture_output=True,
                              text=True, timeout=60, check=True).stdout


@pytest.fixture(scope="module")
def exported_i2v_model(tmp_path_factory):
    """A tiny random EasyAnimate image-to-video (inpaint, `model.i2v`) model exported as training exports a run,
    trained at `SERVE_BUCKET`: what these tests serve."""
    from vidray.config import FlowConfig, I2VConfig, ModelConfig, job_config_from_dict
    from vidray.models import get_family
    from vidray.models.export import write_job_file

    family = get_family("easyanimate")
    components = family.build(ModelConfig(text_encoder="tiny_random", max_sequence_length=16, i2v=I2VConfig()),
                              seed=0)
    out_dir = family.save_pipeline(components, tmp_path_factory.mktemp("model") / "diffusers", FlowConfig(shift=3.0))
    write_job_file(out_dir, job_config_from_dict({
        "name": "tiny-serve-i2v", "model": {"text_encoder": "tiny_random", "max_sequence_length": 16, "i2v": {}},
        "data": {"buckets": [SERVE_BUCKET]}, "flow": {"shift": 3.0},
    }))
    return out_dir


@contextlib.contextmanager
def serve_run(head, config: dict, config_path: Path, route_prefixes: tuple[str, ...] = ("",),
              deploy_failed_expected: bool = False):
    """`serve run` of the Serve `config` (a parsed serve_config.yaml; its HTTP port is set here, once the head runs,
    so that none of the head's processes takes it in between) written to `config_path`, on `head`'s cluster. Yields
    (the proxy's root URL `http://127.0.0.1:<port>`, the `serve run` process, its log) once every application's
    /healthz answers 200 (`route_prefixes`: one per application, "" for the root); stopped with Ctrl-C (SIGINT,
    `serve run` then shuts its applications down) and then by PID at the end. A deployment reported DEPLOY_FAILED
    fails the start, unless `deploy_failed_expected` (an application whose stage is meant not to start)."""
    log = Path(head.temp_dir) / "serve_run.log"
    process = None
    try:
        port = free_port()
        config["http_options"]["port"] = port
        config_path.write_text(yaml.safe_dump(config))
        with open(log, "w") as out:
            process = subprocess.Popen(
                [str(Path(sys.executable).parent / "serve"), "run", f"--address=127.0.0.1:{head.gcs_port}",
                 str(config_path)], cwd=REPO, env=dict(head.env), stdout=out, stderr=subprocess.STDOUT,
            )
        root = f"http://127.0.0.1:{port}"
        waiting = list(route_prefixes)
        deadline = time.monotonic() + SERVE_START_S
        while waiting and time.monotonic() < deadline:
            text = log.read_text()
            failed = "DEPLOY_FAILED" in text and not deploy_failed_expected
            if process.poll() is not None or failed or "ServeSettingsError" in text:
                raise RuntimeError(f"serve run failed: {log.read_text()[-4000:]}")
            try:
                if _request("GET", f"{root}{waiting[0]}/healthz", token=None)[0] == 200:
                    waiting.pop(0)
                    continue
            except (OSError, http.client.HTTPException):  # not up yet, or not yet our proxy on the port
                pass
            time.sleep(1)
        if waiting:
            raise TimeoutError(f"{root}{waiting[0]}/healthz did not answer in {SERVE_START_S:.0f} s: "
                               f"{log.read_text()[-4000:]}")
        yield root, process, log
    finally:
        if process is not None and process.poll() is None:
            process.send_signal(signal.SIGINT)  # serve run shuts the application down on Ctrl-C
            try:
                process.wait(timeout=60)
            except subprocess.TimeoutExpired:
                process.kill()


@pytest.fixture(scope="module")
def served(exported_i2v_model, tmp_path_factory):
    """`serve run` of the shipped config with model, store and port replaced; stopped by PID at the end."""

    from tests.integration.conftest import start_ray_head

    store_dir = tmp_path_factory.mktemp("store")
    config = serve_config_for(exported_i2v_model, store_dir, default_num_inference_steps=4, runner={"lease_s": 6.0},
                              crf=0)  # lossless mp4s: equal frames decode equal (ServeSettings.crf)
    config_path = tmp_path_factory.mktemp("config") / "serve_config.yaml"

    # The token lives in the cluster's environment (where Serve builds the app and runs the replicas), as a
    # secret-backed env var would on a real cluster.
    # Custom metrics reach the node's Prometheus endpoint ~1 s after recording, not ~10 s (NOTES.md).
    head = start_ray_head("/tmp/vrs", extra_env={"VIDRAY_API_TOKEN": TOKEN, "RAY_metrics_report_interval_ms": "1000"})
    try:
        with serve_run(head, config, config_path) as (base_url, process, log):
            yield Served(head, base_url, store_dir, process, log)
    finally:
        head.stop()


def test_openai_sdk_creates_polls_downloads_lists_and_deletes_a_video(served):
    from vidray.data.video import decode_mp4

    client = served.client()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", DeprecationWarning)
        video = client.videos.create(prompt="a red ball rolling on grass", size="32x32", seconds="0.625",
                                     extra_body={"seed": 7, "num_inference_steps": 100})
        assert video.status == "queued" and video.object == "video" and video.size == "32x32"
        seen: list = []
        done = served.wait_for(video.id, ("completed", "failed"), seen=seen)
        assert done["status"] == "completed", done
        assert done["progress"] == 100
        # Progress moved during denoising: some poll saw it strictly between the start and the end.
        assert any(status == "in_progress" and 5 <= progress < 100 for status, progress in seen), seen
        retrieved = client.videos.retrieve(video.id)
        assert retrieved.status == "completed"
        content = client.videos.download_content(video.id)
        frames = decode_mp4(content.read())
        assert frames.shape == (5, 32, 32, 3)  # 0.625 s at 8 fps = 5 frames, 32x32
        listed = [v.id for v in client.videos.list()]
        assert video.id in listed
        deleted = client.videos.delete(video.id)
        assert deleted.deleted is True
    code, body, _ = _request("GET", f"{served.base_url}/v1/videos/{video.id}")
    assert code == 404 and json.loads(body)["error"]["message"]


def test_served_video_is_the_video_vidray_generate_makes_with_the_same_seed(served, exported_i2v_model, tmp_path):
    from vidray.data.video import decode_mp4
    from vidray.generate import generate_to_file

    client = served.client()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", DeprecationWarning)
        video = client.videos.create(prompt="a cat on a wall", size="32x32",
                                     extra_body={"num_frames": 5, "seed": 11, "num_inference_steps": 3})
        served.wait_for(video.id, ("completed",))
        served_frames = decode_mp4(client.videos.download_content(video.id).read())
    local = generate_to_file(exported_i2v_model, "a cat on a wall", tmp_path / "local.mp4", bucket="5x32x32",
                             num_inference_steps=3, seed=11, fps=8.0, crf=0)
    local_frames = decode_mp4(local.read_bytes())
    assert served_frames.shape == local_frames.shape
    # Same latents -> same frames. Both mp4s are lossless (crf 0): libx264 does not always encode the same frames to
    # the same bytes, and at crf 18 two encodes of one clip decoded up to 28 levels apart (ServeSettings.crf).
    assert abs(served_frames.astype(int) - local_frames.astype(int)).max() <= 1


def test_a_first_frame_input_reference_gives_the_video_vidray_generate_image_makes(served, exported_i2v_model,
                                                                                  tmp_path):
    """Image-to-video over HTTP: the upload is stored with the job (its record says the 48x40 image is stretched to
    the 32x32 video, as the stock pipeline does), the VAE stage encodes it into the condition, and the denoiser
    samples with it: the frames `vidray generate --image` makes with the same seed, and not the text-only
    request's."""
    import numpy as np
    from PIL import Image

    from vidray.data.video import decode_mp4
    from vidray.generate import generate_to_file

    image_path = tmp_path / "first.png"
    Image.fromarray(np.random.RandomState(4).randint(0, 256, (40, 48, 3), dtype=np.uint8)).save(image_path)
    client = served.client()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", DeprecationWarning)
        with open(image_path, "rb") as image:
            video = client.videos.create(prompt="a cat on a wall", size="32x32", input_reference=image,
                                         extra_body={"num_frames": 5, "seed": 11, "num_inference_steps": 3})
        done = served.wait_for(video.id, ("completed", "failed"))
        assert done["status"] == "completed", done
        served_frames = decode_mp4(client.videos.download_content(video.id).read())
    from vidray.serve.jobs import JobStore

    record = JobStore(served.store_dir).get(video.id)
    note = record.params["input_reference"]  # 48x40 into 32x32: said in the record
    assert note["size"] == "48x40" and note["resized_to"] == "32x32" and "stretched" in note["note"]
    # The upload was kept as sent (a .png, its own bytes) and deleted once the job no longer needed it (issue 44).
    assert record.input_reference.endswith(f"{video.id}.png") and not Path(record.input_reference).exists()
    local = generate_to_file(exported_i2v_model, "a cat on a wall", tmp_path / "local.mp4", bucket="5x32x32",
                             num_inference_steps=3, seed=11, fps=8.0, image=image_path, crf=0)
    text_only = generate_to_file(exported_i2v_model, "a cat on a wall", tmp_path / "text.mp4", bucket="5x32x32",
                                 num_inference_steps=3, seed=11, fps=8.0, crf=0)
    local_frames, text_frames = decode_mp4(local.read_bytes()), decode_mp4(text_only.read_bytes())
    assert served_frames.shape == local_frames.shape
    assert abs(served_frames.astype(int) - local_frames.astype(int)).max() <= 1
    assert abs(served_frames.astype(int) - text_frames.astype(int)).max() > 1  # the image changed the video


def test_missing_or_wrong_token_is_401_and_bad_fields_are_4xx_naming_the_field(served):
    url = f"{served.base_url}/v1/videos"
    form = json.dumps({"prompt": "a dog"}).encode()
    json_headers = {"Content-Type": "application/json"}
    for token in (None, "wrong-token-0123456789"):
        code, body, _ = _request("POST", url, token=token, data=form, headers=json_headers)
        assert code == 401, body
        assert json.loads(body)["error"]["message"]
    assert _request("GET", f"{served.base_url}/healthz", token=None)[0] == 200
    cases = [
        ({"prompt": ""}, "prompt"),
        ({"prompt": "x" * 5000}, "prompt"),
        ({"prompt": "a dog", "size": "33x32"}, "size"),
        ({"prompt": "a dog", "size": "4096x4096"}, "size"),
        ({"prompt": "a dog", "num_frames": 8}, "num_frames"),
        ({"prompt": "a dog", "seed": -1}, "seed"),
    ]
    for fields, param in cases:
        code, body, _ = _request("POST", url, data=json.dumps(fields).encode(), headers=json_headers)
        assert 400 <= code < 500, (fields, code, body)
        assert json.loads(body)["error"]["param"] == param, (fields, body)
    # A body over limits.max_body_bytes (8 MiB) is refused from its declared length, before it is read: send the
    # headers and a first chunk, then read the answer (sending all 9 MiB to a server that already answered races
    # with its closing the connection).
    conn = http.client.HTTPConnection("127.0.0.1", int(served.base_url.rsplit(":", 1)[1]), timeout=30)
    conn.putrequest("POST", "/v1/videos")
    for key, value in {**json_headers, "Authorization": f"Bearer {TOKEN}", "Content-Length": str(9 * 2**20)}.items():
        conn.putheader(key, value)
    conn.endheaders()
    conn.send(b"x" * 65536)
    response = conn.getresponse()
    assert response.status == 413, response.read()
    assert json.loads(response.read())["error"]["message"]
    conn.close()


def _denoiser_pid(served) -> int:
    actors = json.loads(served.ray_cli("list", "actors", "--format", "json", "--limit", "1000",
                                       "--address", served.head.dashboard_url, "--filter", "state=ALIVE"))
    pids = [a["pid"] for a in actors if "Denoiser" in (a.get("class_name") or "")]
    assert len(pids) == 1, actors
    return pids[0]


def _create_and_wait_for_denoising(served, client, **create) -> tuple[Any, dict]:
    """`client.videos.create(**create)`, then poll until the job is in its denoising steps (progress > 5);
    returns (the created video, its last polled record)."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", DeprecationWarning)
        video = client.videos.create(**create)
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline:
        current = json.loads(_request("GET", f"{served.base_url}/v1/videos/{video.id}")[1])
        if current["status"] == "in_progress" and current["progress"] > 5:
            break
        time.sleep(0.05)
    else:
        pytest.fail(f"job never got into denoising: {current}")
    return video, current


def _busy_cores(process, seconds: float = 1.0) -> float:
    """CPU seconds per second the process used over the next `seconds`."""
    before = sum(process.cpu_times()[:2])
    time.sleep(seconds)
    return (sum(process.cpu_times()[:2]) - before) / seconds


def _scrape(port: int) -> dict[tuple[str, frozenset], float]:
    """The node's Prometheus endpoint as {(series name, frozenset of (label, value)): value}."""
    from prometheus_client.parser import text_string_to_metric_families

    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10) as resp:
        text = resp.read().decode()
    return {(sample.name, frozenset(sample.labels.items())): sample.value
            for family in text_string_to_metric_families(text) for sample in family.samples}


def _total(scraped: dict, name: str, **labels: str) -> float:
    """The sum of `name`'s samples whose labels include `labels` (0 when none)."""
    return sum(v for (n, lab), v in scraped.items() if n == name and set(labels.items()) <= lab)


def test_serve_metrics_reach_the_nodes_prometheus_endpoint(served):
    """The Denoiser's steps and batches, the job runner's outcomes, the store's jobs and the API's errors are
    Prometheus series on the node's metrics port (`vidray.serve.metrics`), tagged with their Serve deployment."""
    client = served.client()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", DeprecationWarning)
        video = client.videos.create(prompt="a lighthouse at night", size="32x32",
                                     extra_body={"num_frames": 5, "seed": 2, "num_inference_steps": 6})
    code, body, _ = _request("POST", f"{served.base_url}/v1/videos", data=b'{"prompt": "x", "size": "33x32"}',
                             headers={"Content-Type": "application/json"})
    assert code == 400, body
    assert served.wait_for(video.id, ("completed", "failed"), timeout_s=60)["status"] == "completed"
    checks = {
        "ray_vidray_serve_jobs_total": dict(outcome="completed", deployment="VideoIngress"),
        "ray_vidray_serve_job_seconds_count": dict(deployment="VideoIngress"),
        "ray_vidray_serve_http_errors_total": dict(status="400", code="invalid_value", deployment="VideoIngress"),
        "ray_vidray_serve_store_jobs": dict(status="completed"),
        "ray_vidray_serve_denoise_requests_total": dict(outcome="completed", deployment="Denoiser"),
        "ray_vidray_serve_denoise_step_seconds_count": dict(deployment="Denoiser"),
        "ray_vidray_serve_denoise_steps_total": dict(deployment="Denoiser"),
        "ray_vidray_serve_denoise_batch_size_count": dict(deployment="Denoiser"),
        "ray_vidray_serve_transfer_seconds_count": dict(deployment="Denoiser"),
        "ray_vidray_serve_policy_batch_size": dict(deployment="Denoiser"),
    }
    deadline = time.monotonic() + 60  # every series within a report interval (1 s here) and a store re-read (5 s)
    while True:
        scraped = _scrape(served.head.metrics_port)
        missing = {name: labels for name, labels in checks.items() if _total(scraped, name, **labels) < 1}
        if not missing or time.monotonic() > deadline:
            break
        time.sleep(1)
    assert not missing, (missing, sorted({n for n, _ in scraped if "vidray" in n}))
    # This job's 6 steps are among the Denoiser's steps, each counted with its batch size (1 here or more), in the
    # counters and in the histograms. (A Ray histogram's _sum is estimated from bucket midpoints: not checked.)
    steps = _total(scraped, "ray_vidray_serve_denoise_steps_total", deployment="Denoiser")
    assert steps >= 6
    assert _total(scraped, "ray_vidray_serve_denoise_step_seconds_count", deployment="Denoiser") >= 6
    assert _total(scraped, "ray_vidray_serve_denoise_items_stepped_total", deployment="Denoiser") >= steps
    assert _total(scraped, "ray_vidray_serve_denoise_busy_seconds_total", deployment="Denoiser") > 0
    assert _total(scraped, "ray_vidray_serve_policy_batch_size", deployment="Denoiser") >= 1
    # Idle replicas keep their gauges on the endpoint: Ray's agent drops a gauge two report intervals after it was
    # last set. (Re-set every 5 s with this 1 s interval, they showed in 2 s of every 5.)
    for _ in range(8):
        time.sleep(0.5)
        scraped = _scrape(served.head.metrics_port)
        assert _total(scraped, "ray_vidray_serve_policy_batch_size", deployment="Denoiser") >= 1
        assert _total(scraped, "ray_vidray_serve_store_jobs", status="completed") >= 1


def _grafana_generator():
    """observability/grafana/dashboard.py (not a package) as a module."""
    import importlib.util

    spec = importlib.util.spec_from_file_location("vidray_grafana_dashboard",
                                                  REPO / "observability" / "grafana" / "dashboard.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _max_over_time(prom, expr: str, by: str) -> dict[str, float]:
    """{label value: the largest value of `expr` over the last 10 minutes} grouped `by` one label (a range query
    still sees series that went stale: a Ray gauge leaves the agent ~2 report intervals after its last set)."""
    return {r["metric"].get(by, ""): float(r["value"][1])
            for r in prom.query(f"max by ({by}) (max_over_time(({expr})[10m:1s]))")}


def test_a_real_prometheus_scrapes_every_rank_and_stage_through_rays_service_discovery(served, shards_dir, tmp_path):
    """Issue 31: Debian's Prometheus reads the session's service discovery file and scrapes the node's Ray metrics
    agent, which carries the training series of both ranks (`vidray.metrics`, recorded with `ray.util.metrics`: no
    port of vidray's own) and the serve plane's. Checked through Prometheus's query API: the step gauge of each rank
    equals the steps run, the loss is finite, the data-wait fraction lies in [0, 1], every stage counted busy
    seconds, and Ray Serve's request-latency histogram counted exactly the requests sent."""
    from vidray.observability import Prometheus, ray_service_discovery_file

    discovery = ray_service_discovery_file(Path(served.head.temp_dir) / "session_latest")
    deadline = time.monotonic() + 30
    while not discovery.is_file() and time.monotonic() < deadline:
        time.sleep(0.5)
    assert str(served.head.metrics_port) in discovery.read_text()
    with Prometheus(discovery, tmp_path / "prometheus", port=free_port(), scrape_interval_s=1.0) as prom:
        # Serving: the requests this test sends, counted by Ray Serve's latency histogram (its other tests' too:
        # the count must grow by exactly these).
        route = 'route="/v1/videos",method="POST"'
        counted = lambda: sum(float(r["value"][1]) for r in prom.query(  # noqa: E731
            f"sum(ray_serve_http_request_latency_ms_count{{{route}}})"))
        # Prometheus answers ~6 s after its start (NOTES.md): wait for its first scrape of the node's agent, then
        # one more, before reading what the module's earlier tests sent.
        agent = f'up{{instance="127.0.0.1:{served.head.metrics_port}"}}'
        deadline = time.monotonic() + 30
        while not prom.query(agent) and time.monotonic() < deadline:
            time.sleep(0.5)
        assert prom.query(agent), prom.targets()
        time.sleep(2)
        before = counted()
        client = served.client()
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", DeprecationWarning)
            videos = [client.videos.create(prompt=f"a kite {i}", size="32x32",
                                           extra_body={"num_frames": 5, "seed": i, "num_inference_steps": 2})
                      for i in range(3)]
        # Training: 2 ranks, 4 steps, as a driver of the same cluster (beside the Serve replicas' 0.8 CPUs).
        env = {**served.head.env, "RAY_ADDRESS": f"127.0.0.1:{served.head.gcs_port}"}
        run = subprocess.run(
            [str(Path(sys.executable).parent / "vidray"), "train", "jobs/configs/tiny_t2v.yaml",
             f"data.shards_dir={shards_dir}", f"storage.path={tmp_path / 'runs'}", "name=prom-run",
             "model.text_encoder=tiny_random", "train.max_steps=4", "train.log_every_steps=2",
             "checkpoint.every_steps=4", "scaling.cpus_per_worker=0.5", "data.loader_cpus=0.25"],
            cwd=REPO, env=env, capture_output=True, text=True, timeout=300)
        assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-3000:]
        for video in videos:
            assert served.wait_for(video.id, ("completed", "failed"), timeout_s=120)["status"] == "completed"

        train = '{run="prom-run"}'
        deadline = time.monotonic() + 30
        while True:
            steps = _max_over_time(prom, f"ray_vidray_train_step{train}", "rank")
            busy = _max_over_time(prom, f"ray_vidray_stage_busy_seconds_total{train}", "stage")
            sent = counted() - before
            if (steps == {"0": 4.0, "1": 4.0} and set(busy) == {"decode", "vae", "text", "dit"} and sent >= 3
                    or time.monotonic() > deadline):
                break
            time.sleep(1)
        assert steps == {"0": 4.0, "1": 4.0}, (steps, prom.targets())
        assert set(busy) == {"decode", "vae", "text", "dit"} and busy["dit"] > 0, busy
        assert sent == 3
        losses = _max_over_time(prom, f"ray_vidray_train_loss{train}", "rank")
        assert set(losses) == {"0", "1"} and all(0 < v < 10 for v in losses.values()), losses
        waits = _max_over_time(prom, f"ray_vidray_data_wait_fraction{train}", "rank")
        assert set(waits) == {"0", "1"} and all(0 <= v <= 1 for v in waits.values()), waits
        samples = _max_over_time(prom, f"ray_vidray_train_samples_total{train}", "rank")
        assert sum(samples.values()) == 4 * 4  # 4 steps of the global batch 4 (2 ranks x 2 micro-batches)
        nodes = _max_over_time(prom, f"ray_vidray_train_step{train}", "node")
        assert set(nodes) == {"127.0.0.1"}
        # Every series vidray exports reached Prometheus (counters at 0 are not exported by Ray: skipped shards
        # and fetched bytes stay 0 on local shards).
        from vidray.metrics import RAY_SERIES

        seen = prom.series_names()
        zero_here = {"ray_vidray_samples_skipped_total", "ray_vidray_data_fetched_bytes_total"}
        assert set(RAY_SERIES) - zero_here <= seen, sorted(set(RAY_SERIES) - zero_here - seen)
        # The Grafana dashboard's every panel query: Prometheus accepts it, it names only series Prometheus holds
        # (but those this run leaves at 0), and the training panels draw this run (over the last 10 minutes,
        # as Grafana asks).
        grafana = _grafana_generator()
        dashboard = json.loads(grafana.OUTPUT.read_text())
        not_here = zero_here | {"ray_vidray_serve_http_errors_total"}  # this module's other tests may send none
        returned = {}
        for title, expr in grafana.panel_queries(dashboard, rate_interval="10m"):
            names = grafana.metric_names(expr)
            assert names - not_here <= seen, (title, expr, sorted(names - not_here - seen))
            returned[title] = returned.get(title, False) or bool(prom.query_range(expr))  # UserError: refused
        drawn = ("Loss", "Learning rate", "Optimizer step", "Step time p50 / p95", "Samples/s", "Data wait fraction",
                    "Stage busy fraction (mean over ranks)", "Denoise batch size", "HTTP latency p50 / p95 / p99")
        assert [t for t in drawn if not returned.get(t)] == [], sorted(t for t, r in returned.items() if not r)


def test_deleting_a_running_job_stops_its_denoising_at_once(served):
    """The reported case (a new user's trial): DELETE of a job in denoising answered 200, but the Denoiser went on
    stepping it to its end (8.7 min for 100 steps of 49x512x512 on 2 cores), and every other request waited behind
    it. Now the ingress cancels the job's Denoiser stream, and the request leaves the batch after its step."""
    import psutil

    denoiser = psutil.Process(_denoiser_pid(served))
    client = served.client()
    video, _ = _create_and_wait_for_denoising(served, client, prompt="a long slow pan", size="512x512",
                                              extra_body={"num_frames": 49, "seed": 3, "num_inference_steps": 100})
    assert _busy_cores(denoiser) > 0.5  # stepping it
    code, body, _ = _request("DELETE", f"{served.base_url}/v1/videos/{video.id}")
    assert code == 200 and json.loads(body)["deleted"] is True, body
    deleted_at = time.monotonic()
    # The step in flight finishes (about 5 s at this size on 2 cores); then the replica idles.
    while _busy_cores(denoiser) > 0.2:
        assert time.monotonic() - deleted_at < 20, "the Denoiser still steps the deleted job 20 s after its DELETE"
    assert _request("GET", f"{served.base_url}/v1/videos/{video.id}")[0] == 404
    # The next request is served at its own pace, not behind the deleted one.
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", DeprecationWarning)
        small = client.videos.create(prompt="a quick one", size="32x32", extra_body={"num_frames": 5, "seed": 4})
    assert served.wait_for(small.id, ("completed", "failed"), timeout_s=30)["status"] == "completed"


def test_a_denoiser_replica_killed_mid_job_leaves_the_job_retried_and_completed(served):
    """Documented outcome: a job whose stage replica died is queued again once (attempts 2) and completes."""
    from vidray.serve.jobs import JobStore

    pid = _denoiser_pid(served)
    client = served.client()
    video, current = _create_and_wait_for_denoising(
        served, client, prompt="a slow sunset", size="64x64",
        extra_body={"num_frames": 9, "seed": 1, "num_inference_steps": 100})
    assert current["progress"] < 90, current  # killed mid-way through denoising
    os.kill(pid, signal.SIGKILL)
    done = served.wait_for(video.id, ("completed", "failed"), timeout_s=180)
    assert done["status"] == "completed", done
    record = JobStore(served.store_dir).get(video.id)
    assert record.attempts == 2


def test_ctrl_c_on_serve_run_hands_a_running_job_back_without_using_an_attempt(served):
    """Last in the module: it stops the app. `serve run` interrupted (Ctrl-C) stops the replicas in good order;
    the ingress hands its running job back to the store, queued with its attempt uncounted, for the next start of
    the app (it was left in_progress until its lease ran out, and then had used an attempt)."""
    from vidray.serve.jobs import JobStore

    client = served.client()
    video, current = _create_and_wait_for_denoising(
        served, client, prompt="a boat at dawn", size="128x128",
        extra_body={"num_frames": 49, "seed": 5, "num_inference_steps": 100})
    assert current["progress"] < 90, current
    served.process.send_signal(signal.SIGINT)
    served.process.wait(timeout=120)
    record = JobStore(served.store_dir).get(video.id)
    assert (record.status, record.owner, record.attempts, record.progress) == ("queued", None, 0, 0), record
