"""`vidray generate`: a trained model + a prompt -> an mp4, through the one sampler (`vidray.diffusion.sampler`).

A model is either
- a diffusers folder written at the end of training (`<run>/diffusers`, with `vidray_job.yaml` beside the
  weights recording the family, buckets, flow shift and prompt length it was trained with), or any local
  diffusers EasyAnimate folder (then prompts use the stock pipeline's 256 tokens and `--bucket` is needed), or
- a training checkpoint folder (`<run>/checkpoint_000200`): components are rebuilt from the saved config and
  the transformer weights are loaded from the checkpoint.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

import torch
import yaml

from vidray.config import FlowConfig, JobConfig, job_config_from_dict
from vidray.data.buckets import Bucket
from vidray.data.video import write_mp4
from vidray.diffusion.sampler import generate_video
from vidray.models.registry import Components, ModelFamily, get_family

JOB_FILE = "vidray_job.yaml"
"""Name of the resolved job config written beside an exported diffusers pipeline."""

_PIPELINE_FAMILIES = {"EasyAnimatePipeline": "easyanimate"}
STOCK_MAX_SEQUENCE_LENGTH = 256
"""diffusers EasyAnimatePipeline.encode_prompt's default prompt length (tokens)."""


@dataclass
class LoadedModel:
    """A model ready for sampling: family, components (eval mode), flow settings, prompt length, buckets."""

    family: ModelFamily
    components: Components
    flow: FlowConfig
    max_sequence_length: int
    buckets: list[Bucket]


def load_model(path: str | Path) -> LoadedModel:
    """Load a diffusers folder or a vidray checkpoint folder for sampling (see the module docstring).

    Raises FileNotFoundError when `path` is neither (no model_index.json, no manifest.json).
    """
    from vidray.train.checkpoint import MANIFEST, load_transformer_state, read_job_config

    path = Path(path)
    if (path / MANIFEST).is_file():
        job = job_config_from_dict(read_job_config(path))
        family = get_family(job.model.family)
        components = family.build(job.model, seed=job.train.seed)
        components.transformer.load_state_dict(load_transformer_state(path))
        return _ready(family, components, job.flow, job.model.max_sequence_length, job.data.buckets)
    if (path / "model_index.json").is_file():
        if (path / JOB_FILE).is_file():
            job = job_config_from_dict(yaml.safe_load((path / JOB_FILE).read_text()))
            family = get_family(job.model.family)
            return _ready(family, family.load_pretrained(path), job.flow, job.model.max_sequence_length,
                          job.data.buckets)
        class_name = json.loads((path / "model_index.json").read_text()).get("_class_name", "")
        if class_name not in _PIPELINE_FAMILIES:
            raise ValueError(f"{path} holds a {class_name or 'unknown'} pipeline; supported: {sorted(_PIPELINE_FAMILIES)}")
        family = get_family(_PIPELINE_FAMILIES[class_name])
        scheduler = json.loads((path / "scheduler" / "scheduler_config.json").read_text())
        flow = FlowConfig(shift=float(scheduler.get("shift", 1.0)),
                          num_train_timesteps=int(scheduler.get("num_train_timesteps", 1000)))
        return _ready(family, family.load_pretrained(path), flow, STOCK_MAX_SEQUENCE_LENGTH, [])
    raise FileNotFoundError(
        f"{path} is neither a diffusers folder (model_index.json) nor a vidray checkpoint (manifest.json)"
    )


def _ready(family, components, flow, max_sequence_length, buckets) -> LoadedModel:
    for module in (components.transformer, components.vae, components.text_encoder):
        module.eval()
    return LoadedModel(family, components, flow, max_sequence_length, list(buckets))


def write_job_file(diffusers_dir: str | Path, job: JobConfig) -> Path:
    """Record the resolved job config beside an exported pipeline so `load_model` samples as trained."""
    out = Path(diffusers_dir) / JOB_FILE
    out.write_text(yaml.safe_dump(job.to_dict(), sort_keys=False))
    return out


def generate_to_file(
    model_path: str | Path,
    prompt: str,
    output: str | Path,
    *,
    bucket: Bucket | None = None,
    num_inference_steps: int = 16,
    guidance_scale: float = 1.0,
    fps: float = 8.0,
    seed: int = 0,
) -> Path:
    """Generate one video for `prompt` and write it as H.264 mp4 at `fps` frames/s. Returns the mp4 path.

    `bucket` defaults to the model's first multi-frame training bucket. Raises ValueError for an empty
    prompt, a bad bucket, or a model without a known bucket when none is given.
    """
    if not prompt.strip():
        raise ValueError("prompt is empty: give the text to generate a video for")
    if Path(output).suffix.lower() != ".mp4":
        raise ValueError(f"output {output} must end in .mp4 (vidray writes H.264 mp4)")
    if num_inference_steps < 1:
        raise ValueError(f"num_inference_steps must be >= 1, got {num_inference_steps}")
    model = load_model(model_path)
    if bucket is None:
        videos = [b for b in model.buckets if b.num_frames > 1] or model.buckets
        if not videos:
            raise ValueError(f"{model_path} records no training bucket: pass --bucket, e.g. 9x64x64")
        bucket = videos[0]
    with torch.inference_mode():
        frames = generate_video(
            model.family, model.components, [prompt], bucket, flow=model.flow,
            num_inference_steps=num_inference_steps, guidance_scale=guidance_scale,
            max_sequence_length=model.max_sequence_length, seed=seed,
        )  # (1, F, H, W, 3) uint8
    output = Path(output)
    output.parent.mkdir(parents=True, exist_ok=True)
    return write_mp4(frames[0], output, fps)
