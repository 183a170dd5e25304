"""Every registered family beyond EasyAnimate (whose runs the rest of tests/integration covers) through the real
loop (issue 29): its shipped tiny config trains on 2 Ray Train workers, checkpoints, resumes exactly, and exports a
folder that its stock diffusers pipeline loads offline and samples from; and the image-to-video models (EasyAnimate
inpaint, CogVideoX I2V) the same way, each clip conditioned on its own first frame through the data plane."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import yaml

from vidray.config import load_job_config
from vidray.models.registry import FAMILIES
from vidray.train.trainer import run_training

from tests.integration.conftest import assert_same_training_state

REPO = Path(__file__).resolve().parents[2]
pytestmark = pytest.mark.integration


def family_config(family: str) -> Path:
    """The shipped tiny config whose model.family is `family`."""
    for path in sorted((REPO / "jobs" / "configs").glob("*.yaml")):
        model = yaml.safe_load(path.read_text()).get("model") or {}
        if model.get("family") == family and not model.get("i2v"):
            return path
    raise LookupError(f"no config under jobs/configs/ has model.family: {family}")


def family_job(family: str, shards_dir, storage, name: str, max_steps: int, *extra: str):
    return load_job_config(family_config(family), [
        f"data.shards_dir={shards_dir}", f"storage.path={storage}", f"name={name}",
        "model.text_encoder=tiny_random", f"train.max_steps={max_steps}", "train.log_every_steps=1",
        "checkpoint.every_steps=2", "checkpoint.num_to_keep=null", "optim.warmup_steps=0", *extra,
    ])


@pytest.mark.parametrize("family", sorted(name for name in FAMILIES if name != "easyanimate"))
def test_the_family_trains_on_2_workers_resumes_exactly_and_exports_its_stock_pipeline(family, local_ray, shards_dir,
                                                                                        tmp_path):
    import diffusers
    import torch

    straight = run_training(family_job(family, shards_dir, tmp_path, "straight", 4))
    # A second run resumes from the straight run's step-2 checkpoint: its steps 3 and 4 are the straight run's.
    resumed = run_training(family_job(family, shards_dir, tmp_path, "resumed", 4,
                                      f"checkpoint.resume_from={Path(straight.run_dir) / 'checkpoint_000002'}"))
    assert (straight.first_step, resumed.first_step, resumed.last_step) == (1, 3, 4)
    assert resumed.losses == straight.losses[2:]
    assert_same_training_state(Path(resumed.run_dir) / "checkpoint_000004", Path(straight.run_dir) / "checkpoint_000004")

    export = Path(straight.diffusers_dir)
    pipeline_class = json.loads((export / "model_index.json").read_text())["_class_name"]
    pipe = getattr(diffusers, pipeline_class).from_pretrained(export, local_files_only=True)
    job = family_job(family, shards_dir, tmp_path, "straight", 4)
    num_frames, height, width = job.data.buckets[0]
    latents = pipe("a red fox", num_frames=num_frames, height=height, width=width, num_inference_steps=2,
                   guidance_scale=1.0, max_sequence_length=job.model.max_sequence_length, output_type="latent",
                   generator=torch.Generator().manual_seed(0)).frames
    assert latents.shape[0] == 1 and torch.isfinite(latents).all()


I2V_CONFIGS = {
    "tiny_i2v.yaml": ("EasyAnimateInpaintPipeline", 17),  # the mask (1) and the masked video's latents (16)
    "cogvideox_i2v_tiny.yaml": ("CogVideoXImageToVideoPipeline", 16),  # the first frame's latents, then zeros
}
"""The shipped image-to-video configs: the stock pipeline class of their export and the channels of their condition
(`inpaint_latents`)."""


@pytest.mark.parametrize("config", sorted(I2V_CONFIGS))
def test_the_image_to_video_model_trains_on_its_clips_first_frames_resumes_exactly_and_exports_inpaint(
        config, local_ray, shards_dir, tmp_path):
    """`jobs/configs/tiny_i2v.yaml` (EasyAnimate InP) and `cogvideox_i2v_tiny.yaml` (CogVideoX I2V): the encode stage
    computes each clip's condition (EasyAnimate: inpaint latents; CogVideoX: image latents; its own first frame
    given) beside its latents, into the latent cache; the step trains on them with condition dropout; the resumed
    run repeats steps 3-4 exactly; the export is the family's stock image-to-video pipeline (an
    `EasyAnimateInpaintPipeline`, a `CogVideoXImageToVideoPipeline`) that samples from a first frame."""
    import diffusers
    import numpy as np
    import torch
    from PIL import Image
    from safetensors.torch import load_file

    pipeline_class, condition_channels = I2V_CONFIGS[config]

    def job(name, max_steps, *extra):
        return load_job_config(REPO / "jobs" / "configs" / config, [
            f"data.shards_dir={shards_dir}", f"storage.path={tmp_path}", f"name={name}",
            "model.text_encoder=tiny_random", f"train.max_steps={max_steps}", "train.log_every_steps=1",
            "checkpoint.every_steps=2", "checkpoint.num_to_keep=null", "optim.warmup_steps=0",
            f"data.latent_cache={tmp_path / 'latents'}", *extra])

    straight = run_training(job("straight", 4))
    resumed = run_training(job("resumed", 4, f"checkpoint.resume_from={Path(straight.run_dir) / 'checkpoint_000002'}"))
    assert resumed.first_step == 3 and resumed.losses == straight.losses[2:]
    assert_same_training_state(Path(resumed.run_dir) / "checkpoint_000004", Path(straight.run_dir) / "checkpoint_000004")
    entries = [load_file(p) for p in (tmp_path / "latents" / "vae").rglob("*.safetensors")]
    assert entries and all(set(e) == {"latents", "inpaint_latents"} for e in entries)
    assert all(e["inpaint_latents"].shape[0] == condition_channels for e in entries)
    assert resumed.data["latent_hits"] > 0  # the resumed run read them back

    export = Path(straight.diffusers_dir)
    assert json.loads((export / "model_index.json").read_text())["_class_name"] == pipeline_class
    pipe = getattr(diffusers, pipeline_class).from_pretrained(export, local_files_only=True)
    first_frame = Image.fromarray(np.random.default_rng(0).integers(0, 256, size=(64, 64, 3), dtype=np.uint8))
    if pipeline_class == "EasyAnimateInpaintPipeline":
        from diffusers.pipelines.easyanimate.pipeline_easyanimate_inpaint import get_image_to_video_latent

        pipe.vae.register_to_config(cache_mag_vae=True)  # dropped on load; the pipeline's resize_mask reads it
        video, mask = get_image_to_video_latent([first_frame], None, 9, (64, 64))
        inputs = {"video": video, "mask_video": mask}
    else:
        inputs = {"image": first_frame, "max_sequence_length": job("straight", 4).model.max_sequence_length}
    latents = pipe(prompt="a red fox", num_frames=9, height=64, width=64, num_inference_steps=2, guidance_scale=1.0,
                   output_type="latent", generator=torch.Generator().manual_seed(0), **inputs).frames
    assert latents.shape[0] == 1 and torch.isfinite(latents).all()
