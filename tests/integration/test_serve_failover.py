"""The serve job store survives the loss of the ingress replica's node (issue 31 item 4): a simulated cluster of a
head (0 CPUs, as the shipped KubeRay config) and two worker nodes; the app's job store runs as one actor on the
head (`store_on: head`, `vidray.serve.store_actor`). The ingress replica's node is killed mid-job; Serve restarts
the replicas on the other node, the job's lease runs out, and the new runner renders it: the id answers all along
(the store is on the head), and the job completes on its second attempt."""

from __future__ import annotations

import json
import time
import urllib.error
import urllib.request

import pytest

from tests.integration.conftest import free_port, loopback_cluster
from tests.integration.test_serve import TOKEN

pytestmark = pytest.mark.integration


def _get(url: str, *, timeout: float = 10) -> tuple[int, bytes]:
    req = urllib.request.Request(url, headers={"Authorization": f"Bearer {TOKEN}"})
    try:
        with urllib.request.urlopen(req, timeout=timeout) as resp:
            return resp.status, resp.read()
    except urllib.error.HTTPError as err:
        return err.code, err.read()


def _ingress_node(ray) -> str:
    from ray.util.state import list_actors

    actors = list_actors(filters=[("state", "=", "ALIVE")], detail=True, limit=1000)
    nodes = [a["node_id"] for a in actors if a["class_name"].endswith("VideoIngress")]
    assert len(nodes) == 1, actors
    return nodes[0]


def test_killing_the_ingress_replicas_node_mid_job_keeps_the_job_and_completes_it(exported_model, tmp_path,
                                                                                   monkeypatch):
    monkeypatch.setenv("VIDRAY_API_TOKEN", TOKEN)
    # Logical CPUs: either worker node alone can hold every replica after the other is gone.
    with loopback_cluster([{"num_cpus": 4}, {"num_cpus": 4}]) as (cluster, workers):
        import ray
        from ray import serve

        from vidray.serve.app import ServeSettingsError, build_app
        from vidray.serve.store_actor import head_job_store

        args = {"model_path": str(exported_model), "store_dir": str(tmp_path / "store"), "store_on": "head",
                "default_num_inference_steps": 4, "runner": {"lease_s": 4.0, "poll_s": 0.2, "max_attempts": 2}}
        # Bad input first: a store folder that cannot hold a store is one line before anything is reserved.
        (tmp_path / "a-file").write_text("not a folder")
        with pytest.raises(ServeSettingsError, match=r"^store_dir .*a-file \(store_on: head\): "):
            build_app({**args, "store_dir": str(tmp_path / "a-file")})

        port = free_port()
        serve.start(proxy_location="HeadOnly", http_options={"host": "127.0.0.1", "port": port})
        try:
            serve.run(build_app(args), name="vidray", route_prefix="/")
            base = f"http://127.0.0.1:{port}"
            store = head_job_store(args["store_dir"], max_attempts=2, retention_s=168 * 3600.0)
            head_id = cluster.head_node.node_id
            assert ray.get(store.actor.describe.remote())["node_id"] == head_id

            import openai

            client = openai.OpenAI(api_key=TOKEN, base_url=f"{base}/v1", max_retries=0, timeout=60)
            video = client.videos.create(prompt="a slow sunset", size="64x64",
                                         extra_body={"num_frames": 9, "seed": 1, "num_inference_steps": 60})
            deadline = time.monotonic() + 120
            while (job := store.get(video.id)).status != "in_progress" or job.progress < 10:
                assert job.status == "queued" or job.status == "in_progress", job
                assert time.monotonic() < deadline, job
                time.sleep(0.1)
            assert job.progress < 90, job  # killed mid-way through denoising

            node_id = _ingress_node(ray)
            assert node_id != head_id  # the head has no CPUs: the ingress is on a worker, as on KubeRay
            victim = next(w for w in workers if w.node_id == node_id)
            cluster.remove_node(victim, allow_graceful=False)

            # The id answers while the ingress is gone (from the store, through the driver) and once it is back
            # (over HTTP); the job ends completed, rendered again by the new runner.
            seen = []
            deadline = time.monotonic() + 240
            while True:
                assert store.get(video.id) is not None
                try:
                    code, body = _get(f"{base}/v1/videos/{video.id}")
                except OSError:  # the proxy has no ingress replica for a moment
                    code, body = None, b""
                if code == 200:
                    seen.append(json.loads(body)["status"])
                    if seen[-1] in ("completed", "failed"):
                        break
                assert time.monotonic() < deadline, (code, body, store.get(video.id))
                time.sleep(0.5)
            record = store.get(video.id)
            assert (record.status, record.attempts) == ("completed", 2), record
            assert _ingress_node(ray) != node_id
            code, mp4 = _get(f"{base}/v1/videos/{video.id}/content")
            assert code == 200 and mp4[4:8] == b"ftyp", (code, mp4[:64])
            listed = [v.id for v in client.videos.list()]
            assert video.id in listed
        finally:
            serve.shutdown()
