"""Every registered family beyond EasyAnimate (whose runs test_worker.py and tests/integration cover) through the
real loop, in this process (`vidray.train.local.train_in_process`: the `Worker` of a Ray Train run, its data
plane's decode and encode operators, its checkpoints and export): its shipped tiny config trains (Wan and
CogVideoX sharded with FSDP, on one rank), checkpoints, resumes exactly, and exports a folder that its stock
diffusers pipeline loads offline and samples from; and each image-to-video config the same way (DDP), each clip
conditioned on its own first frame through the data plane. Wan 2.2 A14B's two expert groups need Ray Train's
worker group: `tests/integration/test_families_train.py` runs that config with `run_training`, through
`check_image_to_video_run` here. Until issue 43 these ran as 14 Ray Train runs of 2 workers (~4.5 min of start-up);
several ranks' collectives are covered by tests/integration/test_train.py (DDP under Ray Train) and tests/unit/test_train_fsdp.py (FSDP on spawned ranks)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import yaml

from vidray.config import load_job_config
from vidray.buckets import Bucket
from vidray.inference.sampler import generate_video
from vidray.models.export import load_model
from vidray.models.registry import FAMILIES
from vidray.train.local import train_in_process

from tests.conftest import assert_same_training_state

REPO = Path(__file__).resolve().parents[2]
pytestmark = pytest.mark.slow  # 2 runs and a stock pipeline's sampling each: ~10-20 s
SHARDED = {"wan": "fsdp", "cogvideox": "fsdp"}
"""The text-to-video families trained here with FSDP (`scaling.strategy`): their DDP runs are the image-to-video
cases below; AnimateDiff has no blocks to shard (its card's `blocks` is None)."""
SAME_NOISE_AS_VIDRAY = ("animatediff",)
"""Families whose stock pipeline draws its initial noise from a seeded CPU generator in vidray's (B, C, F, H, W) layout
(`vidray.inference.sampler.initial_noise`), so the same seed gives the same latents without passing `latents=`."""


def family_config(family: str) -> Path:
    """The shipped tiny config whose model.family is `family`."""
    for path in sorted((REPO / "jobs" / "configs").glob("*.yaml")):
        model = yaml.safe_load(path.read_text()).get("model") or {}
        if model.get("family") == family and not model.get("i2v") and model.get("init") != "pretrained":
            return path
    raise LookupError(f"no config under jobs/configs/ has model.family: {family}")


def family_job(family: str, shards_dir, storage, name: str, max_steps: int, *extra: str):
    return load_job_config(family_config(family), [
        f"data.shards_dir={shards_dir}", f"storage.path={storage}", f"name={name}",
        "model.text_encoder=tiny_random", f"train.max_steps={max_steps}", "train.log_every_steps=1",
        "checkpoint.every_steps=2", "checkpoint.num_to_keep=null", "optim.warmup_steps=0", *extra,
    ])


@pytest.mark.parametrize("family", sorted(name for name in FAMILIES if name != "easyanimate"))
def test_the_family_trains_resumes_exactly_and_exports_its_stock_pipeline(family, shards_dir, tmp_path):
    import diffusers
    import torch

    strategy = f"scaling.strategy={SHARDED.get(family, 'ddp')}"
    straight = train_in_process(family_job(family, shards_dir, tmp_path, "straight", 4, strategy))
    # A second run resumes from the straight run's step-2 checkpoint: its steps 3 and 4 are the straight run's.
    resumed = train_in_process(family_job(family, shards_dir, tmp_path, "resumed", 4, strategy,
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
    if family in SAME_NOISE_AS_VIDRAY:  # the export samples what `vidray generate` samples for the prompt and seed
        loaded = load_model(export)
        final = []
        generate_video(loaded.family, loaded.components, ["a red fox"], Bucket(num_frames, height, width),
                       flow=loaded.flow, num_inference_steps=2, guidance_scale=1.0,
                       max_sequence_length=job.model.max_sequence_length, seed=0,
                       callback=lambda i, sigma, step_latents: final.append(step_latents))
        torch.testing.assert_close(final[-1], latents, atol=1e-5, rtol=1e-5)


def _stock_image_to_video_latents(pipe, image, num_frames: int, height: int, width: int, max_sequence_length: int):
    """Latents (1, C, F_lat, H_lat, W_lat) of the stock image-to-video pipeline `pipe` from a first frame `image`
    (PIL), 2 steps, no guidance, called as each pipeline takes an image."""
    import torch

    kwargs = dict(num_frames=num_frames, height=height, width=width, num_inference_steps=2, guidance_scale=1.0,
                  output_type="latent", generator=torch.Generator().manual_seed(0))
    if type(pipe).__name__ == "EasyAnimateInpaintPipeline":
        from diffusers.pipelines.easyanimate.pipeline_easyanimate_inpaint import get_image_to_video_latent

        pipe.vae.register_to_config(cache_mag_vae=True)  # dropped on load; the pipeline's resize_mask reads it
        video, mask = get_image_to_video_latent([image], None, num_frames, (height, width))
        return pipe("a red fox", video=video, mask_video=mask, **kwargs).frames
    return pipe(image=image, prompt="a red fox", max_sequence_length=max_sequence_length, **kwargs).frames


@pytest.mark.parametrize("config, pipeline_class", [
    ("tiny_i2v.yaml", "EasyAnimateInpaintPipeline"),
    ("wan21_i2v_tiny.yaml", "WanImageToVideoPipeline"),
    ("cogvideox_i2v_tiny.yaml", "CogVideoXImageToVideoPipeline")])
def test_the_image_to_video_model_trains_on_its_clips_first_frames_resumes_exactly_and_exports_its_stock_pipeline(
        config, pipeline_class, shards_dir, tmp_path):
    check_image_to_video_run(config, pipeline_class, train_in_process, shards_dir, tmp_path)


def check_image_to_video_run(config: str, pipeline_class: str, train, shards_dir: Path, tmp_path: Path,
                             layout: str | None = None) -> None:
    """An image-to-video config (EasyAnimate InP; Wan in Wan 2.2 A14B's layout, its two experts trained in the one
    run as two worker groups; Wan 2.1 with its CLIP image encoder; CogVideoX 1.0 I2V): the encode stage computes each clip's condition (its
    own first frame given; and its CLIP image embeddings) beside its latents, into the latent cache; the step trains on them with condition dropout; the resumed run repeats steps 3-4
    exactly (both experts' weights and optimizer state); the export is the family's stock image-to-video pipeline,
    which samples from a first frame. `train`: `train_in_process`, or `run_training` for what needs Ray Train."""
    import diffusers
    import numpy as np
    import torch
    from PIL import Image
    from safetensors.torch import load_file

    from vidray.models import get_family

    def job(name, max_steps, *extra):
        return load_job_config(REPO / "jobs/configs" / config, [
            f"data.shards_dir={shards_dir}", f"storage.path={tmp_path}", f"name={name}",
            "model.text_encoder=tiny_random", f"train.max_steps={max_steps}", "train.log_every_steps=1",
            "checkpoint.every_steps=2", "checkpoint.num_to_keep=null", "optim.warmup_steps=0",
            f"data.latent_cache={tmp_path / 'latents'}", *([layout] if layout else []), *extra])

    straight = train(job("straight", 4))
    resumed = train(job("resumed", 4, f"checkpoint.resume_from={Path(straight.run_dir) / 'checkpoint_000002'}"))
    assert resumed.first_step == 3 and resumed.losses == straight.losses[2:]
    assert_same_training_state(Path(resumed.run_dir) / "checkpoint_000004", Path(straight.run_dir) / "checkpoint_000004")
    family = get_family(job("straight", 4).model.family)
    i2v = family.condition(family.build(job("straight", 4).model, seed=0).transformer,
                           latent_shape=(1, family.latent_channels, 1, 1, 1))
    condition_channels = i2v.inpaint_latents.shape[1]
    entries = [load_file(p) for p in (tmp_path / "latents" / "vae").rglob("*.safetensors")]
    cached = {"latents", "inpaint_latents"} | ({"image_embeds"} if job("straight", 4).model.i2v.image_encoder else set())
    assert entries and all(set(e) == cached for e in entries)
    assert all(e["inpaint_latents"].shape[0] == condition_channels for e in entries)  # EasyAnimate 17, Wan 20, CogVideoX 16
    assert resumed.data["latent_hits"] > 0  # the resumed run read them back

    export = Path(straight.diffusers_dir)
    index = json.loads((export / "model_index.json").read_text())
    assert index["_class_name"] == pipeline_class
    experts = job("straight", 4).model.experts
    if experts is not None:  # Wan 2.2 A14B's layout: both experts trained in the one run, exported as stock
        assert index["boundary_ratio"] == experts.boundary_ratio and (export / "transformer_2").is_dir()
    pipe = getattr(diffusers, pipeline_class).from_pretrained(export, local_files_only=True)
    first_frame = np.random.default_rng(0).integers(0, 256, size=(64, 64, 3), dtype=np.uint8)
    latents = _stock_image_to_video_latents(pipe, Image.fromarray(first_frame), 9, 64, 64,
                                            job("straight", 4).model.max_sequence_length)
    assert latents.shape[0] == 1 and torch.isfinite(latents).all()
