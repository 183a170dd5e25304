"""`vidray generate`: a trained model + a prompt -> an mp4, through the one sampler (`vidray.inference.sampler`).

On one device in this process, or over several processes (`--gpus N`: one per GPU with NCCL; `--processes N`: gloo
on the CPU, for tests and benchmarks), each loading the model, with the guidance branches on separate ranks (CFG
parallel, `vidray.inference.parallel`); rank 0 writes the file.

The model is a diffusers folder or a training checkpoint folder, local or on object storage (`s3://...`, copied
into a local cache), read by `vidray.models.export` (see there).
"""

from __future__ import annotations

import contextlib
import logging
import os
import time
import typing
from pathlib import Path
from typing import Any

from vidray.config import MemoryConfig
from vidray.buckets import Bucket, parse_bucket_form, validate_bucket
from vidray.buckets import any_family_spatial_multiple
from vidray.errors import UserError
from vidray.inference.request import (
    FPS_RANGE,
    MAX_NUM_INFERENCE_STEPS,
    SEED_MAX,
    GenerationRequest,
    GenerationRequestError,
    field_problems,
)
from vidray.locations import NOT_A_FOLDER, creation_problem
from vidray.logs import quiet_diffusers
from vidray.plan_inference import check_generation_fits
from vidray.progress import progress_bar
from vidray.models.export import (  # re-exported: these lived here before the serve plane needed them
    JOB_FILE,
    LoadedModel,
    ModelInfo,
    _check_model_kind,
    inspect_model,
    load_model,
    lora_path_problem,
    model_experts,
    sharded_checkpoint_problem,
    two_experts_lora_problem,
    write_job_file,
)

# torch, diffusers and transformers are imported inside the functions that run a model, so that argument checks
# (`check_generate_args`) answer before those multi-second imports.

__all__ = [
    "GenerateArgumentError",
    "GenerateOutputError",
    "FPS_RANGE",
    "JOB_FILE",
    "MAX_NUM_INFERENCE_STEPS",
    "SEED_MAX",
    "LoadedModel",
    "ModelInfo",
    "check_generate_args",
    "generate_to_file",
    "inspect_model",
    "load_model",
    "memory_problems",
    "parallel_problems",
    "warn_if_prompt_truncated",
    "write_job_file",
]

logger = logging.getLogger(__name__)

class GenerateArgumentError(UserError):
    """`generate` arguments that cannot work (bad fps, steps, guidance, seed, bucket, prompt, output or model
    path). Raised before any weights load; the message lists every bad argument with the fix."""


class GenerateOutputError(UserError):
    """The mp4 could not be written at `--output` although the path passed the checks before sampling (a
    filesystem that refuses the file, e.g. `/proc`, or one that fills up)."""


def _flag(field: str) -> str:
    """The `vidray generate` flag of a `GenerationRequest` field (`num_inference_steps` -> `--num-inference-steps`;
    the bucket's sides -> `--bucket`)."""
    return "--bucket" if field in ("bucket", "num_frames", "height", "width") else "--" + field.replace("_", "-")


def _output_problem(output: Path) -> str | None:
    """Why `output` cannot be written as an mp4 (None when it can): suffix, an existing folder, or a parent that
    is not a writable folder (the nearest existing ancestor is tried, `vidray.locations.creation_problem`, as
    missing parents are created)."""
    if output.name.lower() == ".mp4":
        return f"--output {output} has no file name before .mp4; give e.g. outputs/video.mp4"
    if output.suffix.lower() != ".mp4":
        return f"--output {output} must end in .mp4 (vidray writes H.264 mp4)"
    if output.is_dir():
        return f"--output {output} is a folder; give a file path ending in .mp4"
    if output.exists() and not os.access(output, os.W_OK):
        return f"--output {output} exists and is not writable; choose another path or fix its permissions"
    ancestor, problem = creation_problem(output.absolute().parent)
    if problem == NOT_A_FOLDER:
        return f"--output {output}: {ancestor} is a file, not a folder; choose another path"
    if problem:
        return f"--output {output}: nothing can be created in folder {ancestor} ({problem}); choose a folder you can " \
               "write to"
    return None


def _readable_image(path: str | Path) -> bool:
    """Whether PIL reads `path` as an image (its header checked, no pixels decoded)."""
    from PIL import Image, UnidentifiedImageError  # heavy: PIL

    try:
        with Image.open(path) as image:
            image.verify()
    except (UnidentifiedImageError, OSError, SyntaxError):  # SyntaxError: PIL's word for a broken PNG
        return False
    return True


def check_generate_args(
    model_path: str | Path,
    prompt: str,
    output: str | Path,
    *,
    bucket: Bucket | str | None = None,
    num_inference_steps: int = 16,
    guidance_scale: float = 1.0,
    fps: float = 8.0,
    seed: int = 0,
    lora: str | Path | None = None,
    image: str | Path | None = None,
    last_image: str | Path | None = None,
    crf: int = 18,
    storage_dtype: str = "auto",
    offload: str = "none",
    gpus: int = 1,
    processes: int = 1,
) -> tuple[ModelInfo, GenerationRequest]:
    """Check every `generate_to_file` argument without loading any weights; returns the model's configs and the
    `GenerationRequest` to sample (its bucket: `request.bucket`).

    Rules: the request's own (`vidray.inference.request.field_problems`, the ones the HTTP API applies too):
    prompt not blank; num_inference_steps an int in 1..MAX_NUM_INFERENCE_STEPS; guidance_scale finite and >= 1
    (1 = no guidance); fps finite within FPS_RANGE frames/s; seed an int in 0..SEED_MAX; a last image needs a
    first. The command line's: output ends in .mp4 and its folder is (or can be created) writable; model_path an
    existing diffusers or checkpoint folder, or a URI of one (`s3://bucket/runs/<name>/diffusers`: downloaded once
    into the local model cache in pass 2; `inspect_model`); bucket ('9x64x64' or a Bucket; default the model's
    first training bucket) a shape the model's family card takes (the request's `family` check: H, W multiples of
    16, num_frames 1 or 4k+1 for EasyAnimate). A bucket the model
    was not trained at is allowed (`generate_to_file` then logs a warning). lora: None, or a local LoRA folder
    (`<run>/diffusers/lora`) or .safetensors file (`vidray.models.export.lora_path_problem`). image, last_image:
    None or existing image files (the first and last frame), for an image-to-video model only (its family's
    `image_inputs`, read from the configs). crf: an int in 0..51 (the
    mp4's H.264 constant rate factor, `vidray.data.video.write_mp4`). storage_dtype: one of auto, fp32, bf16, fp8
    and offload: one of none, model, group, sequential (`vidray.config.MemoryConfig`); an offload mode other than
    none needs a CUDA GPU (only then is torch imported here, to ask `torch.cuda.is_available()`). gpus, processes:
    ints >= 1, not both above 1 (`parallel_problems`); gpus at most the CUDA GPUs visible; more ranks than the 2
    guidance branches (CFG parallel, guidance_scale > 1) need context parallel for the model's family
    (`vidray.inference.parallel.generation_parallel_problem`, in pass 2).

    Two passes: first the arguments themselves and the model folder's kind (file checks, no torch import), then
    the model's configs and the bucket against its family. Raises GenerateArgumentError listing every bad
    argument of the first failing pass.
    """
    # 1. Arguments that need nothing but themselves: the request's own rules (`vidray.inference.request`, the
    # ones the HTTP API applies), worded with the flags, then the command line's (files, crf, memory modes).
    problems = [p.message(_flag) for p in field_problems(
        {"prompt": prompt, "num_inference_steps": num_inference_steps, "guidance_scale": guidance_scale, "fps": fps,
         "seed": seed, "image": None if image is None else str(image),
         "last_image": None if last_image is None else str(last_image)})]
    output_problem = _output_problem(Path(output))
    if output_problem:
        problems.append(output_problem)
    if not isinstance(crf, int) or isinstance(crf, bool) or not 0 <= crf <= 51:
        problems.append(f"--crf must be an integer in 0..51 (libx264's constant rate factor, 0 = lossless), "
                        f"got {crf!r}")
    problems.extend(memory_problems(storage_dtype, offload))
    problems.extend(parallel_problems(gpus, processes))
    if isinstance(bucket, str):
        try:  # here what no family takes (its form, sides off every family's multiple); the family's rule in pass 2
            bucket = parse_bucket_form(bucket)
            validate_bucket(bucket, spatial_multiple=any_family_spatial_multiple(), temporal_compression=1)
        except ValueError as err:
            problems.append(f"--bucket: {err}")

    for flag, path in (("--image", image), ("--last-image", last_image)):
        if path is not None and not Path(path).is_file():
            problems.append(f"{flag} {path} is not a file: give a PNG or JPEG image")
        elif path is not None and not _readable_image(path):
            problems.append(f"{flag} {path} is not an image PIL can read: give a PNG or JPEG image")
    if lora is not None:
        lora_problem = lora_path_problem(lora)
        if lora_problem:
            problems.append(f"--lora {lora_problem}")
    try:
        _check_model_kind(model_path)  # a folder, or a URI (a metadata request, no download)
    except UserError as err:
        problems.append(f"--model: {err}")
    if problems:
        raise GenerateArgumentError("; ".join(problems))

    # 2. The model's configs (no weights), then the bucket against what its family can make.
    try:
        info = inspect_model(model_path)
    except UserError as err:
        raise GenerateArgumentError(f"--model: {err}") from None
    if problem := sharded_checkpoint_problem(info):
        raise GenerateArgumentError(f"--model: {problem}")
    if bucket is None:
        bucket = info.default_bucket()
        if bucket is None:
            raise GenerateArgumentError(f"--model {model_path} records no training bucket: pass --bucket, e.g. 9x64x64")
    bucket = Bucket(*bucket)
    if lora is not None and model_experts(info) is not None:
        raise GenerateArgumentError(two_experts_lora_problem(model_path, "--lora"))
    image_inputs = info.family.image_inputs(info)  # 0: text-to-video; 2: a first and a last image both
    if image is not None and image_inputs == 0:
        raise GenerateArgumentError(f"--image: the model {model_path} is text-to-video and takes no image; drop "
                                    "--image or give an image-to-video model (a stock EasyAnimateInpaintPipeline, "
                                    "WanImageToVideoPipeline or CogVideoXImageToVideoPipeline folder, or the export "
                                    "of a model.i2v run)")
    world_size = max(gpus, processes)  # pass 1 checked both
    if world_size > 1:
        from vidray.inference.parallel import generation_parallel_problem  # heavy: torch

        problem = generation_parallel_problem(world_size, guidance=float(guidance_scale) > 1.0,
                                              family_name=info.family.name,
                                              flag="--gpus" if gpus > 1 else "--processes")
        if problem:
            raise GenerateArgumentError(problem)
    if image is not None and last_image is None and image_inputs == 2:
        raise GenerateArgumentError(f"--image: the model {model_path} is conditioned on a first and a last frame "
                                    "(its image encoder takes both): give --last-image too")
    try:  # the request, with the bucket against the family's card
        request = GenerationRequest(
            prompt=prompt, num_frames=bucket.num_frames, height=bucket.height, width=bucket.width,
            num_inference_steps=num_inference_steps, guidance_scale=float(guidance_scale), seed=seed, fps=float(fps),
            image=None if image is None else str(image), last_image=None if last_image is None else str(last_image),
            family=info.family.name,
        )
    except GenerationRequestError as err:
        raise GenerateArgumentError("; ".join(p.message(_flag) for p in err.problems)) from None
    return info, request


def memory_problems(storage_dtype: str, offload: str) -> list[str]:
    """Why `--storage-dtype` / `--offload` (`vidray.config.MemoryConfig`'s values) cannot run here: an unknown
    value, or an offload mode other than none without a CUDA GPU (torch is imported only to ask that). Empty when
    both can."""
    problems = []
    storage_choices = typing.get_args(MemoryConfig.__pydantic_fields__["storage_dtype"].annotation)
    offload_choices = typing.get_args(MemoryConfig.__pydantic_fields__["offload"].annotation)
    if storage_dtype not in storage_choices:
        problems.append(f"--storage-dtype {storage_dtype!r}: give one of {', '.join(storage_choices)}")
    if offload not in offload_choices:
        problems.append(f"--offload {offload!r}: give one of {', '.join(offload_choices)}")
    elif offload != "none":
        import torch  # heavy: torch, numpy

        if not torch.cuda.is_available():
            problems.append(f"--offload {offload} needs a CUDA GPU (it moves weights between host memory and the GPU) "
                            "and none is visible here: use --offload none (memory.offload: none) on CPU")
    return problems


def parallel_problems(gpus: Any, processes: Any) -> list[str]:
    """Why `--gpus` / `--processes` cannot run here: not an int >= 1, both above 1, or more GPUs than CUDA shows
    (torch is imported only for gpus > 1, to count them). Empty when they can."""
    problems = []
    for flag, value in (("--gpus", gpus), ("--processes", processes)):
        if not isinstance(value, int) or isinstance(value, bool) or value < 1:
            problems.append(f"{flag} must be an integer >= 1, got {value!r}")
    if problems:
        return problems
    if gpus > 1 and processes > 1:
        return [f"--gpus {gpus} and --processes {processes}: give one (--processes is the CPU path, gloo)"]
    if gpus > 1:
        import torch  # heavy: torch, numpy

        visible = torch.cuda.device_count() if torch.cuda.is_available() else 0
        if gpus > visible:
            problems.append(f"--gpus {gpus}: only {visible} CUDA GPU{'s' if visible != 1 else ''} visible here "
                            f"(CUDA_VISIBLE_DEVICES, one node); give --gpus {max(visible, 1)} or fewer, or "
                            "--processes N to split over CPU processes")
    return problems


def warn_if_prompt_truncated(tokenizer, prompt: str, max_sequence_length: int) -> int:
    """Log a warning when `prompt` is longer than `max_sequence_length` tokens (counted as `encode_prompts`
    tokenizes: chat template + special tokens). Returns the number of tokens dropped (0 when it fits)."""
    from vidray.models.text_encoder import count_prompt_tokens  # heavy: torch, transformers, accelerate

    num_tokens = count_prompt_tokens(tokenizer, [prompt])[0]
    dropped = max(0, num_tokens - max_sequence_length)
    if dropped:
        logger.warning(
            "the prompt is %d tokens, longer than the model's max_sequence_length of %d: its last %d tokens are "
            "dropped and do not affect the video (the first %d tokens, special tokens included, are kept); "
            "shorten the prompt",
            num_tokens, max_sequence_length, dropped, max_sequence_length,
        )
    return dropped


def generate_to_file(
    model_path: str | Path,
    prompt: str,
    output: str | Path,
    *,
    bucket: Bucket | str | None = None,
    num_inference_steps: int = 16,
    guidance_scale: float = 1.0,
    fps: float = 8.0,
    seed: int = 0,
    lora: str | Path | None = None,
    image: str | Path | None = None,
    last_image: str | Path | None = None,
    crf: int = 18,
    storage_dtype: str = "auto",
    offload: str = "none",
    gpus: int = 1,
    processes: int = 1,
) -> Path:
    """Generate one video for `prompt` and write it as H.264 mp4 at `fps` frames/s. Returns the mp4 path.

    `bucket` ('9x64x64' or a Bucket) defaults to the model's first multi-frame training bucket. Every argument
    is checked first (`check_generate_args`, which lists the rules), before any weights load. A prompt longer
    than the model's `max_sequence_length` tokens is cut to it, with a logged warning naming the dropped count.
    `lora`: a LoRA (`<run>/diffusers/lora`, or a .safetensors file) merged into the transformer before sampling
    (`load_model(..., lora_path=lora)`; a LoRA run's own export or checkpoint needs none: its adapters are merged
    already). `image` (and `last_image`): image files of the first (and last) frame, for an image-to-video model;
    resized to the bucket (`vidray.models.conditioning.image_to_video`). `crf`: the mp4's H.264 constant rate factor
    (0 = lossless: the same frames always decode the same, which libx264 does not promise above 0; `vidray.serve.app`
    ServeSettings.crf). `storage_dtype`, `offload`: the weights' dtype and placement (`vidray.config.MemoryConfig`,
    `vidray.models.offload.prepare_for_inference`): on a CUDA GPU the model runs there, in bf16 by default (auto);
    on CPU in fp32 as always (bf16 / fp8 when asked). `gpus` N > 1: N processes, one per GPU of this node (NCCL),
    `processes` N > 1: N processes on the CPU (gloo; tests and benchmarks); each loads the model and encodes the
    prompt, and with guidance_scale > 1 and N even the two guidance branches run on separate ranks (CFG parallel,
    `vidray.inference.parallel`: per-GPU batch 1, not 2); the rest of N splits the sequence (context
    parallel, where the family and this build have it; refused in one line where not). Rank 0 writes the file; the video equals the one-process one (to
    float rounding: a batch of 1 may round differently from a batch of 2). Raises GenerateArgumentError (before any
    weights load), `vidray.models.lora.LoraLoadError` for a LoRA that does not fit the model, and
    GenerateOutputError when the mp4 cannot be written.
    """
    # 1. Check every argument (no weights yet).
    info, request = check_generate_args(
        model_path, prompt, output, bucket=bucket, num_inference_steps=num_inference_steps,
        guidance_scale=guidance_scale, fps=fps, seed=seed, lora=lora, image=image, last_image=last_image, crf=crf,
        storage_dtype=storage_dtype, offload=offload, gpus=gpus, processes=processes,
    )
    bucket = request.bucket
    if info.buckets and bucket not in info.buckets:
        logger.warning("bucket %s is not one the model was trained at (%s); sampling it anyway",
                       bucket, ", ".join(map(str, info.buckets)))
    i2v = info.job.model.i2v if info.job is not None else None
    if last_image is not None and i2v is not None and i2v.condition == "first":
        logger.warning("--last-image: the model was trained with model.i2v.condition: first (first frames only); "
                       "it never saw a last-frame condition, so expect the last frame to be followed loosely")

    # 2. Load, warn about a cut prompt, denoise, write: here, or in each of several ranks.
    world_size = max(gpus, processes)
    if world_size > 1:
        from vidray.inference.parallel import run_ranks  # heavy: torch

        run_ranks(_generate_rank, (model_path, request, str(output), lora, crf, storage_dtype, offload,
                                   logger.getEffectiveLevel()),
                  world_size, backend="nccl" if gpus > 1 else "gloo")
        return Path(output)
    from vidray.models.offload import inference_device  # heavy: torch, accelerate, safetensors

    return _generate_on(inference_device(), model_path, request, output, lora=lora, crf=crf,
                        storage_dtype=storage_dtype, offload=offload)


def _generate_rank(rank: int, device, model_path: str | Path, request: GenerationRequest, output: str,
                   lora: str | Path | None, crf: int, storage_dtype: str, offload: str, log_level: int) -> None:
    """One rank of `generate_to_file` over several processes (`vidray.inference.parallel.run_ranks`): the generation
    mesh (CFG parallel), then `_generate_on` its device; rank 0 logs (with the parent's level) and writes."""
    import torch.distributed as dist  # heavy: torch

    from vidray.inference.parallel import setup_generation_parallel  # heavy: torch

    if rank == 0:  # a forkserver child has none of the CLI's logging set up
        handler = logging.StreamHandler()
        handler.setFormatter(logging.Formatter("[vidray] %(levelname)s: %(message)s"))
        logging.getLogger("vidray").addHandler(handler)
        logging.getLogger("vidray").setLevel(log_level)
    parallel = setup_generation_parallel(dist.get_world_size(), rank, guidance=request.guidance_scale > 1.0,
                                         device_type=device.type, family_name=request.family)
    _generate_on(device, model_path, request, output, lora=lora, crf=crf, storage_dtype=storage_dtype,
                 offload=offload, parallel=parallel)


def _generate_on(device, model_path: str | Path, request: GenerationRequest, output: str | Path, *,
                 lora: str | Path | None, crf: int, storage_dtype: str, offload: str, parallel=None) -> Path:
    """`generate_to_file`'s work after the checks, on `device`: load, warn about a cut prompt, denoise, write the
    mp4 (`parallel`: this rank's `GenerationParallel` of several; the others return without writing)."""
    import torch  # heavy: torch, numpy

    from vidray.data.video import write_mp4  # heavy: av, PIL, numpy
    from vidray.inference.sampler import generate_video  # heavy: torch, accelerate, safetensors
    from vidray.models.conditioning import load_image  # heavy: torch, numpy
    from vidray.models.offload import prepare_for_inference  # heavy: torch, accelerate, safetensors

    bucket, num_inference_steps = request.bucket, request.num_inference_steps
    writer = parallel is None or parallel.is_writer
    quiet_diffusers()  # "Loading pipeline components..." bars (vidray.logs)
    # Refuse what does not fit the GPU before any weights load; on CPU nothing is checked.
    check_generation_fits(model_path, bucket, device, storage=storage_dtype, offload=offload,
                          guidance_scale=request.guidance_scale, cfg=1 if parallel is None else parallel.cfg,
                          context=1 if parallel is None else parallel.context)
    try:
        model = load_model(model_path, lora_path=lora)
    except UserError:
        raise
    except ValueError as err:  # the family's checks of a folder's layout (what `vidray train` checks on the driver)
        raise UserError(f"--model {model_path}: the model family cannot load it: {err}") from None
    compute = prepare_for_inference(model.components, MemoryConfig(storage_dtype=storage_dtype, offload=offload),
                                    device, family_name=model.family.name)
    if parallel is not None:
        parallel.parallelize(model.components.transformer, model.family.name)
    logger.info("sampling on %s in %s (memory.storage_dtype %s, memory.offload %s%s)", device,
                str(compute).removeprefix("torch."), storage_dtype, offload,
                "" if parallel is None else f"; {parallel.world_size} processes: CFG parallel "
                f"{'on' if parallel.cfg == 2 and request.guidance_scale > 1 else 'off'}, context parallel "
                f"{parallel.context}")
    if writer:
        warn_if_prompt_truncated(model.components.tokenizer, request.prompt, model.max_sequence_length)
    started = time.monotonic()
    last_shown = [started]

    # drawn on a terminal only, by one rank of several
    bar = progress_bar(num_inference_steps, "denoising", "step") if writer else contextlib.nullcontext()

    def progress(i: int, sigma: float, latents) -> None:  # a large bucket takes minutes per step: show that it moves
        bar.update(1)
        now = time.monotonic()
        if bar.disable and (i == 0 or i == num_inference_steps - 1 or now - last_shown[0] >= 5.0):
            last_shown[0] = now
            logger.info("denoising step %d/%d of %s done (%.1f s)", i + 1, num_inference_steps, bucket,
                        now - started)

    with torch.inference_mode(), bar:
        frames = generate_video(
            model.family, model.components, [request.prompt], bucket, flow=model.flow,
            num_inference_steps=request.num_inference_steps, guidance_scale=request.guidance_scale,
            max_sequence_length=model.max_sequence_length, seed=request.seed, callback=progress if writer else None,
            image=load_image(request.image) if request.image is not None else None,
            last_image=load_image(request.last_image) if request.last_image is not None else None,
            parallel=parallel,
        )  # (1, F, H, W, 3) uint8; None on a rank other than 0
    if not writer:
        return Path(output)
    try:
        return write_mp4(frames[0], Path(output), request.fps, crf=int(crf))
    except OSError as err:  # PyAV's FileNotFoundError, PermissionError, ... are OSErrors; so is a full disk
        raise GenerateOutputError(
            f"--output {output} could not be written ({type(err).__name__}: {err}); the video was generated but "
            "not saved: choose a path on a writable local filesystem"
        ) from None
