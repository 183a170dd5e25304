"""A Denoiser replica spanning 2 processes (issue 47, part 2: `denoiser.processes: 2`, the CPU / gloo path of
`denoiser.gpus`): `serve run` of the shipped serve config on a `ray start --head` cluster, one Denoiser replica whose
placement group holds 2 bundles, rank 1 a `DenoiserRank` actor in the second. A guided request (CFG parallel: one
guidance branch a process) and an unguided one (both ranks run it whole) over real HTTP give the videos
`vidray generate` (1 process) makes with the same seed."""

from __future__ import annotations

import json
import warnings

import pytest

from vidray.compare import video_psnr

from tests.integration.serve_configs import serve_config_for
from tests.integration.test_serve import TOKEN, Served, serve_run

pytestmark = pytest.mark.integration


@pytest.fixture(scope="module")
def served_spanning(exported_model, tmp_path_factory):
    from tests.integration.conftest import start_ray_head

    store_dir = tmp_path_factory.mktemp("store")
    # One replica of each stage: 2 bundles of 1 CPU fit the 4-CPU head. crf 0: lossless mp4s, equal frames decode equal.
    config = serve_config_for(exported_model, store_dir, one_replica=True, default_num_inference_steps=3, crf=0,
                              denoiser={"processes": 2})
    config_path = tmp_path_factory.mktemp("config") / "serve_config.yaml"
    head = start_ray_head("/tmp/vrp", extra_env={"VIDRAY_API_TOKEN": TOKEN})
    try:
        with serve_run(head, config, config_path) as (base_url, process, log):
            yield Served(head, base_url, store_dir, process, log)
    finally:
        head.stop()


@pytest.mark.parametrize("guidance_scale", [4.0, 1.0], ids=["cfg_parallel", "unguided"])
def test_a_two_process_denoiser_replica_serves_the_video_vidray_generate_makes(served_spanning, exported_model,
                                                                                tmp_path, guidance_scale):
    from vidray.data.video import decode_mp4
    from vidray.generate import generate_to_file

    client = served_spanning.client()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", DeprecationWarning)
        video = client.videos.create(prompt="a cat on a wall", size="32x32",
                                     extra_body={"num_frames": 5, "seed": 11, "num_inference_steps": 3,
                                                 "guidance_scale": guidance_scale})
        done = served_spanning.wait_for(video.id, ("completed", "failed"))
        assert done["status"] == "completed", done
        served_frames = decode_mp4(client.videos.download_content(video.id).read())
    # The second rank is a live actor of this cluster, placed in the Denoiser replica's placement group.
    actors = json.loads(served_spanning.ray_cli("list", "actors", "--filter", "state=ALIVE", "--detail",
                                                "--format", "json", f"--address={served_spanning.head.dashboard_url}"))
    ranks = [a for a in actors if a["class_name"] == "DenoiserRank"]
    replicas = [a for a in actors if a["class_name"].endswith(":Denoiser")]
    assert len(ranks) == 1 and len(replicas) == 1, [a["class_name"] for a in actors]
    assert ranks[0]["placement_group_id"] and ranks[0]["placement_group_id"] == replicas[0]["placement_group_id"]
    local = generate_to_file(exported_model, "a cat on a wall", tmp_path / "local.mp4", bucket="5x32x32",
                             num_inference_steps=3, guidance_scale=guidance_scale, seed=11, fps=8.0, crf=0)
    local_frames = decode_mp4(local.read_bytes())
    assert served_frames.shape == local_frames.shape == (5, 32, 32, 3)
    assert video_psnr(served_frames, local_frames) >= 40.0
