"""Pictures and figures that compare videos: PSNR between two clips, and a side-by-side mp4 + PNG frame grid of
named rows (a training clip, its VAE reconstruction, a generated video...). What `make demo` shows to prove that
its run learned (`jobs/demo.py`).
"""

from __future__ import annotations

import dataclasses
import math
from pathlib import Path

import numpy as np

from vidray.logs import quiet_diffusers
from vidray.train.validation import frame_grid

__all__ = ["Comparison", "compare_with_training_clip", "video_psnr", "write_side_by_side"]


def video_psnr(video: np.ndarray, reference: np.ndarray) -> float:
    """PSNR in dB of uint8 `video` against uint8 `reference`, both (F, H, W, 3) of one shape: 10 * log10(255^2 /
    MSE) over every pixel (the standard definition, e.g. skimage.metrics.peak_signal_noise_ratio). inf when
    equal. Raises ValueError for different shapes."""
    if video.shape != reference.shape:
        raise ValueError(f"video_psnr: shapes differ: {video.shape} vs {reference.shape}")
    mse = float(np.mean((video.astype(np.float64) - reference.astype(np.float64)) ** 2))
    return float("inf") if mse == 0 else 10 * math.log10(255.0 ** 2 / mse)


def write_side_by_side(rows: dict[str, np.ndarray], out_dir: str | Path, *, fps: float,
                       name: str = "side_by_side") -> tuple[Path, Path]:
    """Write `rows` ({label: uint8 (F, H, W, 3)}, one H and W; shorter videos padded with black frames) as
    `<out_dir>/<name>.png`, a grid with one row per video and its frames left to right, and `<out_dir>/<name>.mp4`,
    the videos next to each other, left to right in `rows`' order, at `fps`. Returns (png path, mp4 path); the
    labels' order is the rows' order (printed by the caller). Raises ValueError for no rows or mixed sizes."""
    from PIL import Image  # heavy: PIL

    from vidray.data.video import write_mp4  # heavy: av, PIL

    videos = list(rows.values())
    if not videos or len({v.shape[1:] for v in videos}) != 1:
        raise ValueError(f"write_side_by_side: needs videos of one frame size, got {[v.shape for v in videos]}")
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    png = out_dir / f"{name}.png"
    Image.fromarray(frame_grid(videos)).save(png, format="PNG")
    num_frames = max(v.shape[0] for v in videos)
    padded = [np.concatenate([v, np.zeros((num_frames - v.shape[0], *v.shape[1:]), np.uint8)]) for v in videos]
    mp4 = write_mp4(np.concatenate(padded, axis=2), out_dir / f"{name}.mp4", fps)  # (F, H, n * W, 3)
    return png, mp4


@dataclasses.dataclass
class Comparison:
    """What `compare_with_training_clip` wrote and measured."""

    lines: list[str]
    """The summary lines: each generated video's PSNR against the caption's training clip, and the margin."""
    rows: list[str]
    """The side-by-side rows' labels, in order."""
    png: Path
    mp4: Path
    generated_mp4: Path
    psnr: dict[str, float]
    """{"reconstruction", "generated", "baseline"}: dB against the training clip (absent without a clip)."""


def compare_with_training_clip(job, diffusers_dir: str | Path, prompt: str, out_dir: str | Path, *,
                               num_inference_steps: int = 16) -> Comparison:
    """Generate `prompt` from the trained pipeline in `diffusers_dir` and from the same pipeline with the DiT at
    its random init (`job.model` built under `train.seed`: the run's step-0 weights, with the job's VAE), at the
    bucket of the training clip whose caption is `prompt` (else the job's first multi-frame bucket), with the same
    seed; write `<out_dir>/generated.mp4` and the side-by-side grid and mp4 of the training clip, its VAE
    reconstruction and both videos (`write_side_by_side`); measure each one's PSNR against the clip. A prompt that
    is no training caption gets the videos without the figures. Raises what loading or sampling raises."""
    import torch  # heavy: torch

    from vidray.data.shards import load_samples  # heavy: pyarrow, av, PIL
    from vidray.data.video import write_mp4  # heavy: av, PIL
    from vidray.inference.sampler import generate_video  # heavy: torch, accelerate, safetensors
    from vidray.models.export import load_model  # heavy: pydantic
    from vidray.models.vae import frames_to_video, video_to_frames  # heavy: torch, accelerate, safetensors

    quiet_diffusers()
    trained = load_model(diffusers_dir)
    family, components = trained.family, trained.components
    clip = next((s for s in load_samples(job.data.shards_dir) if s.caption == prompt and s.bucket.num_frames > 1),
                None)
    bucket = clip.bucket if clip is not None else next(b for b in job.data.buckets if b.num_frames > 1)
    base = family.load_diffusion_models(job.model, seed=job.train.seed).transformer
    baseline = dataclasses.replace(components, transformer=base.eval())
    kwargs = dict(flow=trained.flow, num_inference_steps=num_inference_steps, guidance_scale=1.0,
                  max_sequence_length=trained.max_sequence_length, seed=job.train.seed)
    with torch.inference_mode():
        generated = generate_video(family, components, [prompt], bucket, **kwargs)[0]
        random_init = generate_video(family, baseline, [prompt], bucket, **kwargs)[0]
    out_dir = Path(out_dir)
    generated_mp4 = write_mp4(generated, out_dir / "generated.mp4", float(job.data.fps))
    rows: dict[str, np.ndarray] = {}
    psnr: dict[str, float] = {}
    lines = []
    if clip is not None:
        with torch.inference_mode():
            video = frames_to_video(clip.video[None])
            latents = family.encode_video(components.vae, video)
            rows["training clip"] = clip.video
            rows["VAE reconstruction"] = video_to_frames(family.decode_latents(components.vae, latents))[0]
        psnr["reconstruction"] = video_psnr(rows["VAE reconstruction"], clip.video)
        psnr["generated"] = video_psnr(generated, clip.video)
        psnr["baseline"] = video_psnr(random_init, clip.video)
        lines += [f"PSNR against the training clip of {prompt!r}: trained DiT {psnr['generated']:.1f} dB, random-init "
                  f"DiT {psnr['baseline']:.1f} dB ({psnr['generated'] - psnr['baseline']:+.1f} dB); the VAE's "
                  f"reconstruction {psnr['reconstruction']:.1f} dB"]
    else:
        lines.append(f"the prompt {prompt!r} is no training caption: no PSNR against a training clip")
    rows["generated (trained DiT)"] = generated
    rows["generated (random-init DiT)"] = random_init
    png, mp4 = write_side_by_side(rows, out_dir, fps=float(job.data.fps))
    return Comparison(lines=lines, rows=list(rows), png=png, mp4=mp4, generated_mp4=generated_mp4, psnr=psnr)
