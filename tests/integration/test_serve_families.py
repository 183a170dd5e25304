"""Every family but EasyAnimate (`test_serve.py`) served end to end over real HTTP (issue 29, "What must be shown"):
one `ray start --head` on 127.0.0.1 and one `serve run` whose config holds three Serve applications, one per family,
each under its own route prefix, driven by the official `openai` SDK (`base_url` = the prefix + /v1):

| application | config it is based on | model (exported as training exports it) | requests |
|---|---|---|---|
| /wan | serve/serve_config_experts.yaml | Wan 2.2 A14B image-to-video, two experts | first frame |
| /cogvideox | serve/serve_config.yaml | CogVideoX image-to-video | first frame; text only |
| /animatediff | serve/serve_config.yaml | AnimateDiff text-to-video | text; a first frame (400) |
| /broken | serve/serve_config.yaml | the CogVideoX model with its transformer's weights file damaged | text (fails) |

Each served video is the one `vidray generate` makes for the same prompt, seed, steps, size and image: both write
lossless mp4s (`crf` 0), so their frames must match (within 1 level: the replicas' and this process's torch may
sum in another order). At the shipped crf 18 libx264 does not always encode the same frames to the same bytes (4
to 42 byte strings in 60 encodes of the CogVideoX clip here, frames up to 28 levels apart; ServeSettings.crf), and
this comparison failed for CogVideoX. A job of /broken, whose Denoiser replicas cannot load the model (Serve marks
the deployment DEPLOY_FAILED), fails naming the stage instead of waiting for it for good (a fresh-user trial: a
two-expert LoRA checkpoint that no denoiser could load held its job in_progress). The image-to-video models also
serve a text-only request (the empty condition they were trained with, `model.i2v.condition_dropout`). Each model
is a tiny random one built from its family's shipped tiny job config (`jobs/configs/*_tiny.yaml`), exported by
`export_pipeline` + `write_job_file` as the end of a training run does.
"""

from __future__ import annotations

import copy
import shutil
import time
import warnings
from pathlib import Path
from typing import NamedTuple

import pytest
import yaml

from tests.integration.conftest import REPO
from tests.integration.serve_configs import serve_config_for
from tests.integration.test_serve import TOKEN, Served, serve_run

pytestmark = pytest.mark.integration

STEPS = 3
"""Denoising steps of every request; with Wan's shift 5 the high-noise expert takes the first and the low-noise one
the other two (boundary_ratio 0.9)."""
SEED = 11
CRF = 0
"""Lossless mp4s on both sides (module docstring)."""
PROMPT = "a red fox in the snow"


class Family(NamedTuple):
    config: str
    """The shipped tiny job config (jobs/configs/) the model is built and exported from."""
    serve_config: str
    """The shipped Serve config (serve/) whose application this family's is based on."""
    bucket: str
    """NUMxHxW of the training bucket and of every request: the smallest size the family takes; Wan's and
    CogVideoX's fewest frames of a video (1 is a still), AnimateDiff's example bucket (its UNet takes any count)."""


FAMILIES = {
    "wan": Family("wan_i2v_tiny.yaml", "serve_config_experts.yaml", "5x32x32"),  # frames 4k+1, sides 16k
    "cogvideox": Family("cogvideox_i2v_tiny.yaml", "serve_config.yaml", "9x32x32"),  # frames 8k+1, sides 16k
    "animatediff": Family("animatediff_t2v_tiny.yaml", "serve_config.yaml", "4x64x64"),  # sides 64k (SD's UNet)
}


def _model_name(family: str) -> str:
    return f"vidray-{family}-tiny"


@pytest.fixture(scope="module")
def family_models(tmp_path_factory) -> dict[str, Path]:
    """{family: its exported tiny model folder}: the shipped tiny job config with its bucket set to the family's
    request size, the family's random build at the job's seed, written by `export_pipeline` and `write_job_file`
    (what `vidray.train.loop` writes at the end of a run)."""
    from vidray.config import load_job_config
    from vidray.models import get_family
    from vidray.models.export import export_pipeline, write_job_file

    models = {}
    for name, family in FAMILIES.items():
        bucket = [int(n) for n in family.bucket.split("x")]
        job = load_job_config(REPO / "jobs" / "configs" / family.config, [f"data.buckets=[{bucket}]"])
        model_family = get_family(job.model.family)
        components = model_family.build(job.model, seed=job.train.seed)
        out = export_pipeline(model_family, components, tmp_path_factory.mktemp(name) / "diffusers", job.flow)
        write_job_file(out, job)
        models[name] = Path(out)
    assert (models["wan"] / "transformer_2").is_dir()  # two experts
    return models


@pytest.fixture(scope="module")
def served_families(family_models, tmp_path_factory) -> dict[str, Served]:
    """{family: `Served` at its route prefix}: one Ray head, one `serve run` of three applications."""
    from tests.integration.conftest import start_ray_head

    config = yaml.safe_load((REPO / "serve" / "serve_config.yaml").read_text())
    config["applications"] = []
    stores = {}
    for name, family in FAMILIES.items():
        stores[name] = tmp_path_factory.mktemp(f"store-{name}")
        (app,) = serve_config_for(family_models[name], stores[name], shipped=family.serve_config,
                                  model_name=_model_name(name), default_num_inference_steps=STEPS,
                                  crf=CRF)["applications"]
        app.update(name=name, route_prefix=f"/{name}")
        config["applications"].append(app)
    # /broken: the CogVideoX model whose transformer weights do not load (its configs do: the ingress starts).
    broken = tmp_path_factory.mktemp("broken") / "diffusers"
    shutil.copytree(family_models["cogvideox"], broken)
    for weights in (broken / "transformer").glob("*.safetensors"):
        weights.write_bytes(b"not a safetensors file")
    app = copy.deepcopy(config["applications"][1])
    stores["broken"] = tmp_path_factory.mktemp("store-broken")
    app.update(name="broken", route_prefix="/broken")
    app["args"].update(model_path=str(broken), model_name="vidray-broken", store_dir=str(stores["broken"]))
    app["args"]["runner"]["lease_s"] = 6.0  # the heartbeat, which notices the failed stage, every 2 s
    config["applications"].append(app)
    names = (*FAMILIES, "broken")
    config_path = tmp_path_factory.mktemp("config") / "serve_config.yaml"
    head = start_ray_head("/tmp/vrf", extra_env={"VIDRAY_API_TOKEN": TOKEN})
    try:
        with serve_run(head, config, config_path, tuple(f"/{name}" for name in names),
                       deploy_failed_expected=True) as (root, process, log):
            yield {name: Served(head, f"{root}/{name}", stores[name], process, log) for name in names}
    finally:
        head.stop()


@pytest.fixture(scope="module")
def first_frame(tmp_path_factory) -> Path:
    """A 48x40 random PNG: stretched to each request's size, as the stock pipelines do."""
    import numpy as np
    from PIL import Image

    path = tmp_path_factory.mktemp("image") / "first.png"
    Image.fromarray(np.random.RandomState(4).randint(0, 256, (40, 48, 3), dtype=np.uint8)).save(path)
    return path


def _served_frames(served: Served, family: str, image: Path | None = None):
    """The frames of the video `family`'s application makes for `PROMPT` at its bucket, `SEED` and `STEPS` (with
    `image` as the `input_reference` when given), through the `openai` SDK."""
    from vidray.data.video import decode_mp4

    num_frames, height, width = FAMILIES[family].bucket.split("x")
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", DeprecationWarning)
        client = served.client()
        create = dict(model=_model_name(family), prompt=PROMPT, size=f"{width}x{height}",
                      extra_body={"num_frames": int(num_frames), "seed": SEED, "num_inference_steps": STEPS})
        if image is None:
            video = client.videos.create(**create)
        else:
            with open(image, "rb") as file:
                video = client.videos.create(**create, input_reference=file)
        done = served.wait_for(video.id, ("completed", "failed"))
        assert done["status"] == "completed", done
        return decode_mp4(client.videos.download_content(video.id).read())


def _generated_frames(model_dir: Path, family: str, out: Path, image: Path | None = None):
    """The frames `vidray generate` makes for the same request."""
    from vidray.data.video import decode_mp4
    from vidray.generate import generate_to_file

    mp4 = generate_to_file(model_dir, PROMPT, out, bucket=FAMILIES[family].bucket, num_inference_steps=STEPS,
                           seed=SEED, fps=8.0, image=image, crf=CRF)
    return decode_mp4(mp4.read_bytes())


def _assert_same_video(served, generated) -> None:
    """Same latents -> same frames (lossless mp4s), to within 1 level."""
    assert served.shape == generated.shape
    assert abs(served.astype(int) - generated.astype(int)).max() <= 1


def _assert_other_video(a, b) -> None:
    assert abs(a.astype(int) - b.astype(int)).max() > 1


def test_wan_2_2_with_two_expert_stages_serves_generate_s_first_frame_video(served_families, family_models,
                                                                            first_frame, tmp_path):
    served = served_families["wan"]
    frames = _served_frames(served, "wan", first_frame)
    _assert_same_video(frames, _generated_frames(family_models["wan"], "wan", tmp_path / "i2v.mp4", first_frame))
    _assert_other_video(frames, _generated_frames(family_models["wan"], "wan", tmp_path / "t2v.mp4"))
    # Both experts ran as their own deployments (generate's video needs both: see STEPS).
    log = served.log.read_text()
    assert "Deploying new version of Deployment(name='LowNoiseDenoiser', app='wan')" in log, log[-3000:]


def test_cogvideox_image_to_video_serves_generate_s_video_with_and_without_a_first_frame(
        served_families, family_models, first_frame, tmp_path):
    served, model = served_families["cogvideox"], family_models["cogvideox"]
    with_image = _served_frames(served, "cogvideox", first_frame)
    text_only = _served_frames(served, "cogvideox")
    _assert_same_video(with_image, _generated_frames(model, "cogvideox", tmp_path / "i2v.mp4", first_frame))
    _assert_same_video(text_only, _generated_frames(model, "cogvideox", tmp_path / "t2v.mp4"))
    _assert_other_video(with_image, text_only)


def test_animatediff_serves_generate_s_video_and_refuses_an_input_reference_naming_the_model(
        served_families, family_models, first_frame, tmp_path):
    import openai

    served = served_families["animatediff"]
    frames = _served_frames(served, "animatediff")
    _assert_same_video(frames, _generated_frames(family_models["animatediff"], "animatediff", tmp_path / "t2v.mp4"))
    with pytest.raises(openai.BadRequestError) as refused:
        _served_frames(served, "animatediff", first_frame)
    assert refused.value.status_code == 400
    message = refused.value.body["message"] if isinstance(refused.value.body, dict) else str(refused.value)
    assert _model_name("animatediff") in message and "text-to-video" in message, message


def test_a_job_whose_denoiser_cannot_load_its_model_fails_naming_the_stage_instead_of_waiting(served_families):
    served = served_families["broken"]
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", DeprecationWarning)
        video = served.client().videos.create(model="vidray-broken", prompt=PROMPT, size="32x32",
                                              extra_body={"num_frames": 9, "seed": SEED, "num_inference_steps": 2})
    done = served.wait_for(video.id, ("completed", "failed"), timeout_s=240)
    assert done["status"] == "failed" and done["error"]["code"] == "internal_error", done
    deadline = time.monotonic() + 30  # the replica's log line reaches serve run's output a moment later
    while "StageUnavailableError: the Denoiser stage is DEPLOY_FAILED" not in served.log.read_text():
        assert time.monotonic() < deadline, served.log.read_text()[-4000:]
        time.sleep(1)
