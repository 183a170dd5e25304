"""Validation samples during training (`train.validation`).

Every `train.validation.every_steps` (a multiple of `checkpoint.every_steps`) rank 0 hands the step to a
`Validator` actor that it started beside the training (`start_validator`: `train.validation.num_cpus` logical
CPUs on the nodes `placement.vae` allows, since it loads the VAE and the text encoder). The actor waits until
that step's checkpoint is complete in the run folder, loads it (`vidray.models.export.load_model`: its weights, a
LoRA run's adapters merged; the EMA when the run keeps one, `train.ema`), places it per the job's `memory`
section (`prepare_validation`: on its GPU in bf16 when it has one, on CPU in fp32 otherwise), samples each of
`prompts` with the same seed, bucket and sampler settings every time (an image-to-video model with `images`, each
prompt's fixed first frame), and writes into `<run>/validation/step_<N>/`:

- `<i>.mp4`: prompt i's video (H.264, the job's `data.fps`);
- `grid.png`: one row per prompt, one column per frame;
- `prompts.json`: the prompts, the seed, the bucket and the seconds the validation took;

and into TensorBoard (`<run>/tensorboard/validation/`): each prompt's video as an animated GIF image summary
`validation/<i>` (what `SummaryWriter.add_video` writes, encoded with Pillow instead of moviepy) and the grid.

Training does not wait for it: the only cost to the loop is the `validate.remote` call; at the end of the run rank
0 waits for the validations still running (the seconds are printed and returned as `validation_wait_s`). A
validation that fails is logged and does not stop the run. A sharded (FSDP) checkpoint is read in one process, every
rank's shards joined (`vidray.models.export.sharded_entries`), its EMA too.
"""

from __future__ import annotations

import dataclasses
import io
import json
import logging
import tempfile
import time
from pathlib import Path
from typing import Any

import numpy as np

from vidray.buckets import parse_bucket
from vidray.errors import UserError
from vidray.logs import quiet_diffusers
from vidray.train.runlog import copy_into

VALIDATION_DIR = "validation"
"""The run folder's folder of validation samples, one `step_<N>` folder per validation."""
TENSORBOARD_SUBDIR = "tensorboard/validation"
"""The TensorBoard event files of the validation samples (a run of its own, "validation", next to the scalars)."""
CHECKPOINT_WAIT_S = 600.0
"""How long a validation waits for its step's checkpoint to be complete in the run folder."""


def validation_bucket(job: Any) -> Any:
    """The samples' bucket: `train.validation.bucket`, else the job's first multi-frame bucket (else its first)."""
    if job.train.validation.bucket:
        return parse_bucket(job.train.validation.bucket, job.model.family)
    buckets = list(job.data.buckets)
    return next((b for b in buckets if b.num_frames > 1), buckets[0])


def check_validation_prompts(job: Any) -> None:
    """Refuse (UserError, one line) a validation prompt longer than `model.max_sequence_length` tokens, counted as
    the text encoder tokenizes it: it would be cut, and its video would not show the prompt it names. Loads the
    tokenizer only (no weights); does nothing when validation is off."""
    from vidray.models.text_encoder import (  # heavy: torch, transformers, accelerate
        build_tokenizer,
        count_prompt_tokens,
    )

    prompts = list(job.train.validation.prompts)
    if job.train.validation.every_steps is None or not prompts:
        return
    _check_validation_images(job)
    counts = count_prompt_tokens(build_tokenizer(job.model), prompts)
    for i, (prompt, count) in enumerate(zip(prompts, counts)):
        if count > job.model.max_sequence_length:
            raise UserError(f"train.validation.prompts[{i}] ({prompt[:40]!r}...) is {count} tokens, longer than "
                            f"model.max_sequence_length={job.model.max_sequence_length}: shorten it, or raise "
                            "model.max_sequence_length")


def _check_validation_images(job: Any) -> None:
    """Refuse (UserError, one line) a `train.validation.images` entry that is not an image file PIL reads (before
    the run: the validator would fail at its first validation)."""
    from vidray.models.conditioning import load_image  # heavy: torch

    for i, path in enumerate(job.train.validation.images):
        try:
            load_image(str(path))
        except (FileNotFoundError, ValueError) as err:
            raise UserError(f"train.validation.images[{i}]: {err}") from None


def prepare_validation(model: Any, memory: Any) -> Any:
    """Place a loaded model (`vidray.models.export.LoadedModel`) for sampling on this process's device per the job's
    `memory` section (`vidray.models.offload.prepare_for_inference`): on a CUDA GPU in `memory.storage_dtype`
    (auto: bf16) with `memory.offload`; on CPU (a validator actor without a GPU) in fp32 unless the storage dtype is
    set, and without offload (it needs a GPU: logged once, not an error, since the run's `memory.offload` was
    checked for its trainers' device). Returns the compute dtype."""
    from vidray.models.offload import inference_device, prepare_for_inference  # heavy: torch, accelerate, safetensors

    device = inference_device()
    if device.type != "cuda" and memory.offload != "none":
        logging.getLogger(__name__).warning(
            "validation samples on CPU (its actor has no GPU): memory.offload: %s applies on a GPU only, so it "
            "samples without offload", memory.offload)
        memory = dataclasses.replace(memory, offload="none")
    return prepare_for_inference(model.components, memory, device, family_name=model.family.name)


class Validator:
    """Samples `train.validation.prompts` from a run's checkpoints (see the module docstring). A Ray actor
    (`start_validator`), or a plain object in-process.

    Args:
        run_dir: the run folder (a local path or a URI).
        job: the job (`JobConfig.to_dict()`).
    """

    def __init__(self, run_dir: str, job: dict[str, Any]):
        from vidray.config import job_config_from_dict  # heavy: pydantic
        from vidray.storage import open_storage  # heavy: pyarrow

        self.run_dir = str(run_dir)
        self.job = job_config_from_dict(job)
        self.storage = open_storage(self.run_dir, setting="storage.path")
        self.staging = Path(tempfile.mkdtemp(prefix="vidray-validation-")) if not self.storage.is_local \
            else self.storage.local_path
        self._writer = None

    def validate(self, step: int) -> dict[str, Any]:
        """Wait for `checkpoint_<step>` to be complete, sample the prompts from it, write the files; returns
        {"step", "seconds", "dir": the step's folder}. Raises TimeoutError when the checkpoint is not complete
        within `CHECKPOINT_WAIT_S`, and what loading or sampling raises."""
        import torch  # heavy: torch

        from vidray.data.video import write_mp4  # heavy: av, PIL
        from vidray.inference.sampler import generate_video  # heavy: torch, accelerate, safetensors
        from vidray.models.conditioning import load_image  # heavy: torch

        started = time.perf_counter()
        checkpoint = self._wait_for_checkpoint(step)
        quiet_diffusers()
        model = self._load(checkpoint)
        val, bucket = self.job.train.validation, validation_bucket(self.job)
        rel = f"{VALIDATION_DIR}/step_{step:06d}"
        out = self.staging / rel
        out.mkdir(parents=True, exist_ok=True)
        videos = []
        with torch.inference_mode():
            for i, prompt in enumerate(val.prompts):
                image = load_image(val.images[i]) if val.images else None  # an I2V model's fixed first frame
                frames = generate_video(model.family, model.components, [prompt], bucket, flow=model.flow,
                                        num_inference_steps=val.num_inference_steps,
                                        guidance_scale=float(val.guidance_scale),
                                        max_sequence_length=model.max_sequence_length, seed=val.seed,
                                        image=image)[0]
                write_mp4(frames, out / f"{i}.mp4", float(self.job.data.fps))
                videos.append(np.asarray(frames))  # (F, H, W, 3) uint8
        grid = frame_grid(videos)
        _write_png(grid, out / "grid.png")
        seconds = time.perf_counter() - started
        (out / "prompts.json").write_text(json.dumps({
            "step": step, "checkpoint": str(checkpoint), "prompts": list(val.prompts),
            "images": list(val.images), "seed": val.seed,
            "bucket": str(bucket), "num_inference_steps": val.num_inference_steps,
            "guidance_scale": val.guidance_scale, "seconds": round(seconds, 3)}, indent=2))
        self._tensorboard(step, videos, grid)
        if not self.storage.is_local:
            copy_into(self.storage, self.staging, only=[rel, TENSORBOARD_SUBDIR])
        return {"step": step, "seconds": seconds, "dir": f"{self.run_dir.rstrip('/')}/{rel}"}

    def _wait_for_checkpoint(self, step: int) -> Any:
        from vidray.train.checkpoint import CheckpointManager, checkpoint_dir_name  # heavy: torch, pyarrow, safetensors

        manager, name = CheckpointManager(self.run_dir), checkpoint_dir_name(step)
        deadline = time.monotonic() + CHECKPOINT_WAIT_S
        while name not in manager.complete():
            if time.monotonic() > deadline:
                raise TimeoutError(f"validation of step {step}: {name} was not complete in {self.run_dir} after "
                                   f"{CHECKPOINT_WAIT_S:.0f} s")
            time.sleep(0.5)
        return manager.location(name)

    def _load(self, checkpoint: Any) -> Any:
        """The checkpoint's model for sampling, with the EMA weights when the run keeps an EMA (not for LoRA
        runs, whose EMA holds unmerged adapters: their merged trained weights are sampled)."""
        from vidray.models.export import inspect_model, load_model  # heavy: pydantic

        model = load_model(checkpoint, allow_sharded=True)  # the run's own checkpoint, read without unpickling
        if self.job.train.ema is not None and self.job.model.lora is None:
            from vidray.train.ema import load_ema_into  # heavy: torch

            load_ema_into(model.components.transformer, inspect_model(checkpoint).path)
        prepare_validation(model, self.job.memory)
        return model

    def _tensorboard(self, step: int, videos: list[np.ndarray], grid: np.ndarray) -> None:
        from tensorboard.compat.proto.summary_pb2 import Summary  # heavy: tensorboard
        from torch.utils.tensorboard import SummaryWriter  # heavy: torch

        if self._writer is None:
            self._writer = SummaryWriter(str(self.staging / TENSORBOARD_SUBDIR))
        values = [Summary.Value(tag=f"validation/{i}", image=_gif_summary(v, float(self.job.data.fps)))
                  for i, v in enumerate(videos)]
        self._writer._get_file_writer().add_summary(Summary(value=values), step)
        self._writer.add_image("validation/grid", grid, step, dataformats="HWC")
        self._writer.flush()


def frame_grid(videos: list[np.ndarray]) -> np.ndarray:
    """One (rows * H, cols * W, 3) uint8 image of videos (each (F, H, W, 3) uint8, same H and W): row i holds
    video i's frames left to right; shorter videos are padded with black frames."""
    cols = max(v.shape[0] for v in videos)
    h, w = videos[0].shape[1:3]
    grid = np.zeros((len(videos) * h, cols * w, 3), dtype=np.uint8)
    for r, video in enumerate(videos):
        for c, frame in enumerate(video):
            grid[r * h:(r + 1) * h, c * w:(c + 1) * w] = frame
    return grid


def _write_png(image: np.ndarray, path: Path) -> None:
    from PIL import Image  # heavy: PIL

    Image.fromarray(image).save(path, format="PNG")


def _gif_summary(video: np.ndarray, fps: float) -> Any:
    """A TensorBoard image summary holding `video` ((F, H, W, 3) uint8) as an animated GIF (TensorBoard's image
    dashboard plays it), as `torch.utils.tensorboard.summary.video` builds it."""
    from PIL import Image  # heavy: PIL
    from tensorboard.compat.proto.summary_pb2 import Summary  # heavy: tensorboard

    frames = [Image.fromarray(frame) for frame in video]
    buffer = io.BytesIO()
    frames[0].save(buffer, format="GIF", save_all=True, append_images=frames[1:], loop=0,
                   duration=max(1, int(round(1000 / max(fps, 1e-3)))))
    return Summary.Image(height=video.shape[1], width=video.shape[2], colorspace=3,
                         encoded_image_string=buffer.getvalue())


def wait_for_validations(refs: list[Any], *, timeout_s: float = 900.0) -> tuple[list[dict[str, Any]], float,
                                                                                  list[str]]:
    """Wait for the validations still running at the end of the run: (their results, seconds waited, one line
    per validation that failed or did not finish within `timeout_s`). Never raises: validation does not fail a
    run whose training succeeded."""
    import ray  # heavy: ray

    started = time.perf_counter()
    results, problems = [], []
    ready, not_ready = ray.wait(refs, num_returns=len(refs), timeout=timeout_s) if refs else ([], [])
    for ref in ready:
        try:
            results.append(ray.get(ref))
        except Exception as err:  # noqa: BLE001 - reported, the run's training stands
            problems.append(f"{type(err).__name__}: {str(err).strip().splitlines()[-1][:300]}")
    problems += [f"still running after {timeout_s:.0f} s" for _ in not_ready]
    return sorted(results, key=lambda r: r["step"]), time.perf_counter() - started, problems


def start_validator(run_dir: str, job: Any) -> Any:
    """A `Validator` actor (`train.validation.num_cpus` CPUs, where `placement.vae` allows), owned by the caller
    (rank 0): it ends with it. Its calls run one at a time, in order."""
    import ray  # heavy: ray

    selector = dict(job.placement.vae.label_selector or {})
    options: dict[str, Any] = {"num_cpus": float(job.train.validation.num_cpus), "max_restarts": 0,
                               "max_concurrency": 1}
    if selector:
        options["label_selector"] = selector
    return ray.remote(Validator).options(**options).remote(run_dir, job.to_dict())


class RayValidations:
    """Validations run by one `Validator` actor (`start_validator`) beside the training: `submit(step)` hands it a
    checkpoint's step (the training goes on), `wait()` waits for those still running at the end
    (`wait_for_validations`). What a Ray Train worker's rank 0 uses (`vidray.train.context.RayTrainContext`)."""

    def __init__(self, run_dir: str, job: Any):
        self._actor = start_validator(run_dir, job)
        self._refs: list[Any] = []

    def __len__(self) -> int:
        return len(self._refs)

    def submit(self, step: int) -> None:
        self._refs.append(self._actor.validate.remote(step))

    def wait(self) -> tuple[list[dict[str, Any]], float, list[str]]:
        return wait_for_validations(self._refs)


class LocalValidations:
    """Validations run in this process (`vidray.train.context.LocalContext`): `submit(step)` samples the prompts
    from that step's checkpoint at once (the training waits for it); `wait()` returns what was sampled, the same
    tuple as `wait_for_validations` (a validation that raised is one line in its problems, as there)."""

    def __init__(self, run_dir: str, job: Any):
        self._validator = Validator(run_dir, job.to_dict())
        self._results: list[dict[str, Any]] = []
        self._problems: list[str] = []

    def __len__(self) -> int:
        return len(self._results) + len(self._problems)

    def submit(self, step: int) -> None:
        try:
            self._results.append(self._validator.validate(step))
        except Exception as err:  # noqa: BLE001 - reported, the run's training stands
            self._problems.append(f"{type(err).__name__}: {str(err).strip().splitlines()[-1][:300]}")

    def wait(self) -> tuple[list[dict[str, Any]], float, list[str]]:
        return sorted(self._results, key=lambda r: r["step"]), 0.0, list(self._problems)
