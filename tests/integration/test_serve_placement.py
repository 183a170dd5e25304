"""A stage replica that no node can hold (issue 44, part 8): one `ray start --head` and one `serve run` of the shipped
config whose Denoiser asks for a node label no node has (`label_selector: {vidray.io/stage: nowhere}`). Ray leaves
that replica PENDING without error (NOTES.md); Serve reports it unscheduled (after RAY_SERVE_SLOW_STARTUP_WARNING_S,
lowered to 2 s here). `GET /v1/status` names the stage, and a job fails after `runner.unplaced_stage_timeout_s`
with `stage_unplaced` naming it, instead of staying in_progress for good."""

from __future__ import annotations

import json
import time
import warnings

import pytest

from tests.integration.conftest import start_ray_head
from tests.integration.serve_configs import serve_config_for
from tests.integration.test_serve import TOKEN, Served, _request, serve_run

pytestmark = pytest.mark.integration


def test_a_stage_no_node_can_hold_is_named_in_status_and_its_job_fails_after_a_bounded_wait(tiny_serve_model_dir,
                                                                                            tmp_path):
    store_dir = tmp_path / "store"
    config = serve_config_for(tiny_serve_model_dir, store_dir, default_num_inference_steps=2,
                              runner={"lease_s": 3.0, "unplaced_stage_timeout_s": 5.0})
    app = config["applications"][0]
    deployments = {d["name"]: d for d in app["deployments"]}
    deployments["Denoiser"]["ray_actor_options"]["label_selector"] = {"vidray.io/stage": "nowhere"}
    # Serve 2.60 runs the app's build task with the deployments' selector when all non-empty ones are equal
    # (`_get_shared_build_app_label_selector`): the Denoiser's alone would hold the build itself, and no ingress would
    # start. Another selector, which every node satisfies ("!v" holds where the key is absent), unpins the build.
    deployments["TextEncoder"]["ray_actor_options"]["label_selector"] = {"vidray.io/stage": "!nowhere"}
    head = start_ray_head("/tmp/vrp", extra_env={"VIDRAY_API_TOKEN": TOKEN, "RAY_SERVE_SLOW_STARTUP_WARNING_S": "2",
                                                 "RAY_SERVE_SLOW_STARTUP_WARNING_PERIOD_S": "2"})
    try:
        with serve_run(head, config, tmp_path / "serve_config.yaml") as (root, process, log):
            served = Served(head, root, store_dir, process, log)
            # 1. The app's status names the unplaced stage (Serve's note comes ~2 s after the replica was asked).
            deadline = time.monotonic() + 60
            while True:
                code, body, _ = _request("GET", f"{root}/v1/status")
                assert code == 200, body
                stages = json.loads(body)["stages"]
                if stages["unplaced"]:
                    break
                assert time.monotonic() < deadline, (stages, log.read_text()[-3000:])
                time.sleep(1)
            assert [s["stage"] for s in stages["unplaced"]] == ["Denoiser"] and stages["failed"] == [], stages
            assert "to be scheduled" in stages["unplaced"][0]["message"]
            # 2. A job fails after the bounded wait, naming the stage.
            with warnings.catch_warnings():
                warnings.simplefilter("ignore", DeprecationWarning)
                video = served.client().videos.create(prompt="a red fox", size="48x64",
                                                      extra_body={"num_frames": 9, "num_inference_steps": 2})
            start = time.monotonic()
            done = served.wait_for(video.id, ("completed", "failed"), timeout_s=90)
            assert done["status"] == "failed" and done["error"]["code"] == "stage_unplaced", done
            assert "the Denoiser stage has no replica running" in done["error"]["message"]
            assert time.monotonic() - start < 60
    finally:
        head.stop()
