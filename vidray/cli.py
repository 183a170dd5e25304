"""`vidray prepare [--encode] | encode | train | train-vae | generate | doctor | plan`: shard video clips (and encode them into the latent
cache), train a video diffusion model on Ray, sample from it, check a machine, job and cluster before a run.

Every command checks all of its arguments (a job config: `CONFIG` plus `section.key=value` overrides) before
doing anything expensive, so a typo fails in milliseconds, not after Ray has reserved workers or weights loaded.

Exit status: 0 success; 1 a command that ran but produced nothing usable (e.g. `prepare` kept no clip, `doctor`
found a FAIL), or a bug (an unexpected exception, shown with its traceback: please report it); 2 an error in what
the user gave
(`vidray.errors.UserError`: config, arguments, input files, checkpoints), printed as one line
`vidray <cmd>: error: <message>`.
"""

from __future__ import annotations

import argparse
import logging
import sys
from pathlib import Path

import yaml
from pydantic import ValidationError

from vidray import __version__
from vidray.buckets import Bucket
from vidray.config import JobConfig, load_job_config
from vidray.errors import UserError
from vidray.logs import set_verbose
from vidray.runtime import check_local_ray, init_ray


def _load(args: argparse.Namespace) -> JobConfig:
    return load_job_config(args.config, args.overrides)


def cmd_prepare(args: argparse.Namespace) -> int:
    from vidray.data.ingest import prepare_data  # heavy: pyarrow, av, PIL

    job = _load(args)
    if args.encode:
        _check_encode(job)  # before the prepare: its errors must not wait for a whole dataset
    summary = prepare_data(job.data, model=job.model)
    print(summary)
    if not summary.num_kept:
        return 1
    return _encode(job) if args.encode else 0


def cmd_encode(args: argparse.Namespace) -> int:
    from vidray.data.shards import INDEX_NAME  # heavy: pyarrow, av, PIL
    from vidray.storage import open_storage  # heavy: pyarrow, numpy

    job = _load(args)
    _check_encode(job)
    shards = open_storage(job.data.shards_dir)
    shards.check_reachable("data.shards_dir")
    if not shards.is_file(INDEX_NAME):
        raise UserError(f"no prepared shards in {job.data.shards_dir} (no {INDEX_NAME}): run `vidray prepare "
                        f"{args.config}` first, or `vidray prepare --encode {args.config}` to do both")
    return _encode(job)


def _check_encode(job: JobConfig) -> None:
    """What `_encode` needs that no Ray is needed to check: a latent cache, and (when vidray will start a local Ray)
    the resources of one decode + encode pipeline."""
    from vidray.data.fill_cache import check_encode_resources, encode_cache_root  # lazy: fast `vidray --help`

    encode_cache_root(job)
    check_local_ray(job, check_encode_resources)


def _encode(job: JobConfig) -> int:
    """Fill the latent cache from the prepared shards (`vidray.data.fill_cache.encode_to_cache`) and print the counts."""
    from vidray.data.fill_cache import encode_to_cache  # lazy: fast `vidray --help`

    started = init_ray()
    try:
        done = encode_to_cache(job)
    finally:
        if started:
            import ray  # heavy: ray

            ray.shutdown()
    slots = done["latent_hits"] + done["latent_misses"]  # per batch slot: a padded batch repeats clips
    padded = f" in {slots} batch slots (repeats that fill a bucket's last batch count as cached)" \
        if slots > done["clips"] else ""
    print(f"latent cache {done['cache']}: {done['clips']} clips{padded}; latents {done['latent_misses']} "
          f"encoded / {done['latent_hits']} cached, prompt_embeds {done['prompt_misses']} encoded / "
          f"{done['prompt_hits']} cached, {len(done['skipped'])} skipped, {done['seconds']:.1f} s")
    return 0


def cmd_train(args: argparse.Namespace) -> int:
    job = _load(args)
    return run_train_job(job, prepare_if_missing=args.prepare)


def cmd_train_vae(args: argparse.Namespace) -> int:
    """`vidray train-vae CONFIG`: the job's VAE run (`vidray.train.vae`), then its reconstruction PSNR on the
    training clips."""
    from vidray.train.vae import vae_training_job  # heavy: torch, numpy

    return run_train_job(vae_training_job(_load(args)), prepare_if_missing=args.prepare)


def run_train_job(job: JobConfig, *, prepare_if_missing: bool = False) -> int:
    """Prepare the shards when asked and missing, train, and print where the outputs are. Returns an exit code."""
    from vidray.data.shards import INDEX_NAME  # heavy: pyarrow, av, PIL
    from vidray.storage import open_storage  # heavy: pyarrow, numpy
    from vidray.train.trainer import check_job_outputs, run_training  # heavy: pyarrow, numpy

    if prepare_if_missing:  # without --prepare, run_training's check_job_inputs makes these checks first
        shards = open_storage(job.data.shards_dir)
        shards.check_reachable("data.shards_dir")  # ShardWriter checks it can write there if it prepares
        check_job_outputs(job)  # a bad storage.path is refused before --prepare encodes every clip
        if not shards.is_file(INDEX_NAME):
            from vidray.data.ingest import prepare_data  # heavy: pyarrow, av, PIL

            summary = prepare_data(job.data, model=job.model)
            print(summary)
            if not summary.committed:  # no sample kept: nothing to train on (the summary says why)
                return 1
    result = run_training(job)
    print(f"[vidray] trained steps {result.first_step}..{result.last_step} at {result.steps_per_s:.2f} steps/s")
    print(f"[vidray] latest checkpoint: {result.checkpoint_path}")
    if job.train.objective == "vae":
        from vidray.train.vae import training_clips_psnr  # heavy: torch, numpy

        print(f"[vidray] trained VAE: {result.diffusers_dir} (a DiT job uses it with model.vae_path="
              f"{result.diffusers_dir})")
        print(f"[vidray] {training_clips_psnr(result.diffusers_dir, job.data.shards_dir, family=job.model.family)}")
    else:
        adapters = ""
        if job.model.lora is not None:  # the base pipeline, the adapters beside it (vidray.models.export)
            from vidray.models.export import EXPERT_LORA_DIRS, LORA_DIR  # lazy: fast `vidray --help`

            folders = EXPERT_LORA_DIRS.values() if job.model.experts is not None else (LORA_DIR,)
            from vidray.models.export import lora_export_base  # lazy: fast `vidray --help`

            adapters = (f" (the LoRA adapters in {' and '.join(f'{d}/' for d in folders)} and base_model.json, the "
                        f"reference to the base {lora_export_base(job)}: vidray generate and serving merge them; "
                        "`vidray export --merge-lora` writes one merged folder)" if lora_export_base(job)
                        else f" (the base model; the LoRA adapters in {' and '.join(f'{d}/' for d in folders)} "
                        "beside it, which vidray generate and serving merge)")
        print(f"[vidray] diffusers pipeline: {result.diffusers_dir}{adapters}")
    print(f"[vidray] curves: {result.run_dir}/loss.png, metrics.jsonl; tensorboard --logdir {result.run_dir}")
    for shard in result.skipped_shards:
        print(f"[vidray] skipped shard {shard['file']}: {shard['reason']}")
    for clip in result.skipped_clips:
        print(f"[vidray] skipped clip {clip['sample_id']}: {clip['reason']}")
    if result.data:
        d = result.data
        latents = f"; {d['decode_clips']:.0f} clips decoded; latents {d['latent_hits']:.0f} reused / " \
                  f"{d['latent_misses']:.0f} encoded"
        first = result.step_seconds[0][1] if result.step_seconds else 0.0  # [step, data_wait_s, encode_s, dit_s]
        print(f"[vidray] data (rank 0): waited {d['data_wait_s']:.1f} s ({100 * d['data_wait_fraction']:.1f}% of "
              f"step time; {first:.1f} s of it for the first step, the loader's start-up); hot tier "
              f"{d['hot_hits']:.0f} hits / {d['hot_misses']:.0f} misses; warm tier "
              f"{d['warm_hits']:.0f} hits / {d['warm_misses']:.0f} downloads; {d['bytes_fetched'] / 2**20:.1f} MiB "
              f"fetched from the shard store{latents}")
    return 0


def cmd_generate(args: argparse.Namespace) -> int:
    from vidray.generate import check_generate_args, generate_to_file  # lazy: fast `vidray --help`

    kwargs = dict(
        bucket=args.bucket,
        num_inference_steps=args.num_inference_steps,
        guidance_scale=args.guidance_scale,
        fps=args.fps,
        seed=args.seed,
        lora=args.lora,
        image=args.image,
        last_image=args.last_image,
        crf=args.crf,
        storage_dtype=args.storage_dtype,
        offload=args.offload,
        gpus=args.gpus,
        processes=args.processes,
    )
    # Every argument first, before torch/diffusers are even imported: a typo answers in well under a second.
    check_generate_args(args.model, args.prompt, args.output, **kwargs)
    out = generate_to_file(args.model, args.prompt, args.output, **kwargs)
    print(f"[vidray] wrote {out}")
    return 0


def cmd_export(args: argparse.Namespace) -> int:
    """`vidray export CHECKPOINT OUT_DIR`: a training checkpoint (full or sharded) as the safetensors pipeline
    folder that serving and `vidray generate` load (`vidray.models.export.export_checkpoint`; a LoRA run on a
    pretrained base: its adapters and a reference to the base). `--merge-lora`: a LoRA checkpoint or export as one
    merged pipeline folder, streamed tensor by tensor (`vidray.models.merge.export_merged`)."""
    if args.merge_lora:
        from vidray.models.merge import export_merged  # lazy: fast `vidray --help`

        print(f"[vidray] merged the LoRA of {args.checkpoint} into {export_merged(args.checkpoint, args.out_dir)}")
        return 0
    from vidray.models.export import export_checkpoint  # lazy: fast `vidray --help`

    print(f"[vidray] exported {args.checkpoint} to {export_checkpoint(args.checkpoint, args.out_dir)}")
    return 0


def cmd_doctor(args: argparse.Namespace) -> int:
    """Print the doctor's findings (`vidray.doctor`); 1 when any is FAIL. A config that does not load is a FAIL
    finding, not a usage error: the environment and cluster checks still run."""
    from vidray.doctor import Finding, check_cluster, check_environment, check_job  # lazy: fast `vidray --help`

    if args.config is None and args.overrides:
        raise UserError(f"overrides {args.overrides} need a CONFIG: vidray doctor CONFIG section.key=value ...")
    check_measure_args(args)
    findings = check_environment()
    for finding in findings:
        print(finding, flush=True)
    job = None
    if args.config is not None:
        try:
            job = _load(args)
            job_findings = check_job(job)
        except UserError as err:
            job_findings = [Finding("fail", "config", str(err))]
        for finding in job_findings:
            print(finding, flush=True)
        findings += job_findings
    cluster = check_cluster(job)
    for finding in cluster:
        print(finding, flush=True)
    findings += cluster
    if args.measure:
        measured = _doctor_measure(args, job, findings)
        for finding in measured:
            print(finding, flush=True)
        findings += measured
    failed = [f for f in findings if f.level == "fail"]
    warned = [f for f in findings if f.level == "warn"]
    passed = len(findings) - len(failed) - len(warned)
    print(f"vidray doctor: {len(failed)} failed, {len(warned)} warning(s), {passed} ok")
    return 1 if failed else 0


def check_measure_args(args: argparse.Namespace) -> None:
    """`vidray doctor`'s measuring flags: `--measure` needs a CONFIG; `--max-message-mib` (>= 1) and
    `--transfer-mib` (> 0) go with it. Raises UserError naming the flag."""
    flags = (("--max-message-mib", args.max_message_mib), ("--transfer-mib", args.transfer_mib))
    sized = [flag for flag, value in flags if value is not None]
    if sized and not args.measure:
        raise UserError(f"{' and '.join(sized)} only apply with --measure: vidray doctor CONFIG --measure {sized[0]} N")
    if args.measure and args.config is None:
        raise UserError("--measure needs a CONFIG (it measures that job's workers): vidray doctor CONFIG --measure")
    if args.max_message_mib is not None and not args.max_message_mib >= 1:
        raise UserError(f"--max-message-mib must be >= 1 (MiB; the sweep starts at 1 MiB), got {args.max_message_mib}")
    if args.transfer_mib is not None and not args.transfer_mib > 0:
        raise UserError(f"--transfer-mib must be > 0 (MiB), got {args.transfer_mib}")


def _doctor_measure(args: argparse.Namespace, job: JobConfig | None, findings: list) -> list:
    """`vidray doctor --measure`'s lines (`vidray.doctor_measure.measure`), or one line saying why it did not run:
    the config did not load, or the workers cannot be placed (a cluster, resources or placement FAIL above)."""
    from vidray.doctor import Finding  # lazy: fast `vidray --help`

    if job is None:
        return [Finding("warn", "measure", "skipped: the config did not load (the config FAIL above)")]
    if any(f.level == "fail" and f.topic in ("cluster", "resources", "placement") for f in findings):
        return [Finding("warn", "measure", "skipped: the job's workers cannot be placed (the cluster, resources or "
                        "placement FAIL above): fix that first")]
    from vidray.doctor_measure import measure  # lazy: fast `vidray --help`

    print(f"[vidray] measuring with the job's {job.scaling.min_workers} worker(s): all-reduce bandwidth, the object "
          "store's transfer rate and one simulated training step (a minute or so) ...", file=sys.stderr, flush=True)
    return measure(job, max_message_mib=args.max_message_mib, transfer_mib=args.transfer_mib)


def cmd_plan(args: argparse.Namespace) -> int:
    """Print the memory planner's table (`vidray.train.plan`) for the job's model and largest bucket, or for
    `--preset` and the `--frames/--height/--width` bucket; 1 when no strategy fits."""
    from vidray.models.presets import get_preset  # lazy: fast `vidray --help`
    from vidray.train.plan import format_report, host_memory_bytes, parse_bytes, plan_job  # lazy: fast `vidray --help`

    gpu_memory = parse_bytes(args.gpu_memory)
    host_memory = parse_bytes(args.host_memory) if args.host_memory else host_memory_bytes()
    sizes = (args.frames, args.height, args.width)
    if any(v is not None for v in sizes) and not all(v is not None for v in sizes):
        raise UserError("--frames, --height and --width go together: give all three (e.g. --frames 49 "
                        "--height 1024 --width 1024) or none (the job's largest bucket)")
    if args.gpus is not None and args.gpus < 1:
        raise UserError(f"--gpus must be >= 1, got {args.gpus}")
    preset = get_preset(args.preset) if args.preset else None  # before the config: a typo answers at once
    if args.inference:
        return _plan_inference(args, preset, gpu_memory, host_memory, sizes)
    if args.config is None:
        raise UserError("vidray plan needs a job config (e.g. jobs/configs/tiny_t2v.yaml), or --inference with a "
                        "config, a model folder or --preset")
    job = _load(args)
    num_gpus = args.gpus if args.gpus is not None else job.scaling.min_workers
    bucket = Bucket(*sizes) if all(v is not None for v in sizes) else None
    report = plan_job(job, gpu_memory_bytes=gpu_memory, num_gpus=num_gpus, preset=preset, bucket=bucket,
                      host_memory=host_memory)
    print(format_report(report))
    return 0 if report.chosen is not None else 1


def _plan_inference(args: argparse.Namespace, preset, gpu_memory: int, host_memory: int, sizes) -> int:
    """`vidray plan --inference`: the generation plan of `--preset`, a diffusers folder or a job config's model, at
    the `--frames/--height/--width` bucket (or the job's largest), per GPU of `--gpus` (a serve config's Denoiser
    replica's GPUs or processes, and its `cfg_parallel`, by default) split as `generation_degrees` splits one video;
    1 when no offload mode fits."""
    from vidray.inference.parallel import generation_degrees  # lazy: fast `vidray --help`
    from vidray.plan_inference import (  # lazy: fast `vidray --help`
        format_inference_report,
        inference_preset,
        plan_inference,
    )
    from vidray.train.plan import job_preset, largest_bucket  # lazy: fast `vidray --help`

    bucket = Bucket(*sizes) if all(v is not None for v in sizes) else None
    text_tokens = None
    serve = _serve_config_args(args.config) if args.config is not None and Path(args.config).is_file() else None
    storage, offload = "bf16", None
    if args.config is not None and Path(args.config).is_dir():
        if preset is None:
            preset = inference_preset(args.config)
    elif serve is not None:  # a serve config: its model, its limits' largest video, its memory modes
        if preset is None:
            if not (Path(serve.model_path) / "transformer" / "config.json").is_file():
                raise UserError(f"{args.config}: model_path {serve.model_path} is not a diffusers folder here: give "
                                "--preset NAME (e.g. --preset easyanimate-v5-7b) to plan its shape")
            preset = inference_preset(serve.model_path)
        if bucket is None:
            bucket = Bucket(serve.limits.max_num_frames, serve.limits.max_height, serve.limits.max_width)
        storage = "bf16" if serve.memory.storage_dtype in ("auto", "fp32") else serve.memory.storage_dtype
        offload = serve.memory.offload
    elif args.config is not None:
        job = _load(args)
        if preset is None:
            preset = job_preset(job)
            text_tokens = job.model.max_sequence_length
        if job.model.experts is not None and preset.num_experts < 2:
            from vidray.models.presets import ShapePreset  # lazy: fast `vidray --help`

            preset = ShapePreset(**{**preset.__dict__, "num_experts": 2})
        if bucket is None:
            bucket = largest_bucket(job, preset)[0]
    if preset is None:
        raise UserError("vidray plan --inference needs a model: --preset NAME, a diffusers folder or a job config")
    if bucket is None:
        raise UserError("vidray plan --inference needs the video size: --frames, --height and --width (e.g. "
                        "--frames 49 --height 576 --width 1008)")
    guidance = args.guidance_scale > 1
    ranks = args.gpus or (serve.denoiser.ranks if serve is not None else 1)
    cfg, context = generation_degrees(ranks, guidance and (serve is None or serve.denoiser.cfg_parallel))
    report = plan_inference(preset, bucket=bucket, gpu_memory_bytes=gpu_memory, guidance=guidance,
                            text_tokens=text_tokens, host_memory_bytes=host_memory, cfg=cfg, context=context)
    print(format_inference_report(report))
    if offload is not None:  # a serve config: does its own memory section fit?
        own = next(e for e in report.estimates if (e.storage, e.offload) == (storage, offload))
        print(f"the serve config's memory (storage {storage}, offload {offload}): "
              f"{'fits' if own.fits else 'does not fit'}")
        return 0 if own.fits else 1
    return 0 if report.chosen is not None else 1


def _serve_config_args(path: str):
    """The first application's settings (`vidray.serve.app.ServeSettings`) of a Serve config file (a YAML with
    `applications`), or None for any other file (a job config). Raises UserError for a serve config whose args do
    not validate."""
    raw = yaml.safe_load(Path(path).read_text())
    if not isinstance(raw, dict) or not raw.get("applications"):
        return None

    from vidray.serve.app import ServeSettings  # heavy: ray, pyarrow, fastapi

    try:
        return ServeSettings(**(raw["applications"][0].get("args") or {}))
    except ValidationError as err:
        raise UserError(f"{path}: its first application's args do not validate: {err.errors()[0]['msg']}") from None


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="vidray", description=" ".join(__doc__.split("\n\n", 1)[0].split()))
    parser.add_argument("--version", action="version", version=f"vidray {__version__}")
    sub = parser.add_subparsers(dest="command", required=True)

    def with_config(p: argparse.ArgumentParser) -> None:
        p.add_argument("config", help="job YAML, e.g. jobs/configs/tiny_t2v.yaml")
        p.add_argument("overrides", nargs="*", default=[], help="section.key=value overrides, e.g. train.max_steps=20")

    p = sub.add_parser("prepare", help="probe, bucket and shard the clips listed in data.source")
    with_config(p)
    p.add_argument("--encode", action="store_true", help="then fill the latent cache (data.latent_cache): every "
                   "clip's latents and caption's prompt_embeds, encoded once by the vae / text stages on Ray")
    p.set_defaults(func=cmd_prepare)

    p = sub.add_parser("encode", help="fill the latent cache (data.latent_cache) from the prepared shards in "
                       "data.shards_dir, without preparing them again (what `prepare --encode` does after preparing)")
    with_config(p)
    p.set_defaults(func=cmd_encode)

    p = sub.add_parser("train", help="train with Ray Train (local Ray, or the cluster in RAY_ADDRESS)")
    with_config(p)
    p.add_argument("--prepare", action="store_true", help="run `prepare` first when the shards have no index")
    p.set_defaults(func=cmd_train)

    p = sub.add_parser("train-vae", help="train the family's VAE on the prepared clips (reconstruction + KL) in the "
                       "run <name>-vae; its vae/ folder is what model.vae_path takes")
    with_config(p)
    p.add_argument("--prepare", action="store_true", help="run `prepare` first when the shards have no index")
    p.set_defaults(func=cmd_train_vae)

    p = sub.add_parser("generate", help="write an mp4 from a trained model and a prompt")
    p.add_argument("--model", required=True, help="a diffusers folder (<run>/diffusers) or a checkpoint folder, "
                   "or its URI (s3://bucket/runs/<name>/diffusers: downloaded once into $VIDRAY_MODEL_CACHE, "
                   "default ~/.cache/vidray/models)")
    p.add_argument("--prompt", required=True, help="the text to generate a video for (longer than the model's "
                   "max_sequence_length tokens: cut to it, with a warning)")
    p.add_argument("--output", required=True, help="mp4 path to write")
    p.add_argument("--bucket", help="NUM_FRAMESxHEIGHTxWIDTH, e.g. 9x64x64 (default: the model's first bucket)")
    p.add_argument("--num-inference-steps", type=int, default=16, help="denoising steps, >= 1 (default: %(default)s)")
    p.add_argument("--guidance-scale", type=float, default=1.0,
                   help="classifier-free guidance scale, >= 1; 1 = off (default: %(default)s)")
    p.add_argument("--fps", type=float, default=8.0,
                   help="frame rate of the written mp4 in frames/s, 0.01..1000 (default: %(default)s)")
    p.add_argument("--seed", type=int, default=0, help="noise seed, 0..2**63-1 (default: %(default)s)")
    p.add_argument("--lora", help="LoRA adapters merged into the transformer before sampling: a local folder "
                   "(<run>/diffusers/lora, or peft's adapter_config.json + adapter_model.safetensors) or a "
                   ".safetensors file (a LoRA run's own export or checkpoint needs none)")
    p.add_argument("--image", help="first frame of the video (PNG or JPEG), resized to the bucket: for an "
                   "image-to-video model only (a model.i2v run's export, a stock EasyAnimateInpaintPipeline, "
                   "WanImageToVideoPipeline or CogVideoXImageToVideoPipeline folder)")
    p.add_argument("--last-image", help="last frame of the video (with --image): first-and-last conditioning")
    p.add_argument("--crf", type=int, default=18, help="the mp4's H.264 constant rate factor, 0..51: 0 is lossless "
                   "(the frames exactly as sampled), higher is smaller (default: %(default)s)")
    p.add_argument("--storage-dtype", default="auto", help="the weights' dtype: auto (bf16 on a CUDA GPU, fp32 on "
                   "CPU), fp32, bf16, or fp8 (float8_e4m3fn storage, bf16 compute, per layer) (default: %(default)s)")
    p.add_argument("--offload", default="none", help="where the weights wait on a CUDA GPU: none (all on the GPU), "
                   "model (one component at a time), group (the transformer's blocks stream from host memory), "
                   "sequential (each layer for its own computation: the least GPU memory) (default: %(default)s)")
    p.add_argument("--gpus", type=int, default=1, help="GPUs of this node to generate the one video on, one process "
                   "each (NCCL): with --guidance-scale above 1 and an even count, the two guidance branches run on "
                   "separate GPUs (CFG parallel: each holds a batch of 1, not 2); the rest of the count splits the "
                   "sequence (context parallel: where the model's family and this vidray have it, else refused: then "
                   "2 with guidance, or 1) (default: %(default)s)")
    p.add_argument("--processes", type=int, default=1, help="CPU only: as --gpus, over this many CPU processes "
                   "(gloo), for tests and benchmarks (default: %(default)s)")
    p.set_defaults(func=cmd_generate)

    p = sub.add_parser("export", help="write a training checkpoint (full or sharded) as the safetensors pipeline "
                       "folder that serving and generate load")
    p.add_argument("checkpoint", help="a checkpoint folder (<run>/checkpoint_000200) or its URI; with --merge-lora "
                   "also a LoRA run's export (<run>/diffusers)")
    p.add_argument("out_dir", help="the pipeline folder to write (replaced as a whole; with --merge-lora a new one)")
    p.add_argument("--merge-lora", action="store_true", help="write a LoRA run's model as one complete pipeline "
                   "folder with the adapters folded into the base's weights (streamed tensor by tensor; host memory "
                   "near one tensor) instead of the adapters and a reference to the base")
    p.set_defaults(func=cmd_export)

    p = sub.add_parser("doctor", help="check this machine (libraries, devices), a job config (inputs, outputs, "
                       "where train would start) and the Ray cluster (RAY_ADDRESS, or the local one) before a run")
    p.add_argument("config", nargs="?", help="job YAML to check as well (optional)")
    p.add_argument("overrides", nargs="*", default=[], help="section.key=value overrides, e.g. scaling.use_gpu=true")
    p.add_argument("--measure", action="store_true", help="also measure, on the cluster, with the job's workers: "
                   "all-reduce bus bandwidth per message size, the object store's node-to-node transfer rate of a "
                   "latent batch, and one simulated training step against the memory plan (reserves the workers "
                   "for a minute or so)")
    p.add_argument("--max-message-mib", type=float, help="largest all-reduce message of --measure, MiB (default: "
                   "64 with gloo, 1024 with NCCL; capped at a quarter of the workers' free memory)")
    p.add_argument("--transfer-mib", type=float, help="object size --measure transfers between nodes, MiB (default: "
                   "the job's latent batch of its largest bucket)")
    p.set_defaults(func=cmd_doctor)

    p = sub.add_parser("plan", help="print per-GPU memory of each training strategy (ddp, fsdp, AC, LoRA; bf16/fp32) "
                       "and memory mode (frozen storage bf16/fp8, block swap, FSDP CPU offload) for the job's model "
                       "and largest bucket, and the one that fits; with --inference, of generating one video in "
                       "each offload mode; reserves nothing")
    p.add_argument("config", nargs="?", help="job YAML, e.g. jobs/configs/tiny_t2v.yaml; with --inference also a "
                   "serve config (serve/serve_config.yaml), a diffusers model folder, or nothing with --preset")
    p.add_argument("overrides", nargs="*", default=[], help="section.key=value overrides, e.g. train.max_steps=20")
    p.add_argument("--inference", action="store_true", help="plan generation instead of training: which storage "
                   "dtype and offload mode (none, model, group, sequential) fits one GPU of --gpu-memory")
    p.add_argument("--guidance-scale", type=float, default=5.0, help="--inference: classifier-free guidance scale "
                   "(above 1 doubles the denoising batch; default: %(default)s)")
    p.add_argument("--gpu-memory", default="80GiB", help="memory of one GPU, e.g. 80GiB, 141GB (default: %(default)s)")
    p.add_argument("--gpus", type=int, help="GPUs (ranks) the job trains on (default: scaling.num_workers, its min); "
                   "with --inference, GPUs generating one video, as vidray generate --gpus splits it (default: a serve "
                   "config's denoiser.gpus, else 1)")
    p.add_argument("--host-memory", help="host memory of one node, e.g. 256GiB: the offload modes' pinned host "
                   "memory (block swap, FSDP CPU offload) is checked against it, shared by the node's ranks (up to "
                   "8) (default: $VIDRAY_HOST_MEMORY, else this machine's memory)")
    p.add_argument("--preset", help="plan this shape preset instead of the job's model: tiny, medium, "
                   "easyanimate-v5-7b, easyanimate-v5.1-12b, wan2.1-14b, wan2.2-a14b, wan-tiny, cogvideox-tiny")
    p.add_argument("--frames", type=int, help="bucket to plan instead of the job's largest (with --height, --width)")
    p.add_argument("--height", type=int, help="bucket height in pixels")
    p.add_argument("--width", type=int, help="bucket width in pixels")
    p.set_defaults(func=cmd_plan)
    for p in sub.choices.values():
        p.add_argument("--verbose", action="store_true", help="also print Ray's and the libraries' own lines "
                       "(Ray Train's reports, Ray Data's progress, model-loading bars); see vidray.logs")
    return parser


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    """`build_parser().parse_args(argv)`, except that `section.key=value` overrides may also follow a flag
    (`vidray train CONFIG a=1 --prepare b=2`): argparse ends a positional list at the first flag and would call
    `b=2` an unrecognized argument. (`parse_intermixed_args` would do this, but it refuses parsers with
    subcommands.) Exits 2 with argparse's usage message for anything else it does not know."""
    parser = build_parser()
    args, extras = parser.parse_known_args(argv)
    if extras:
        if not hasattr(args, "overrides") or any(e.startswith("-") or "=" not in e for e in extras):
            parser.error(f"unrecognized arguments: {' '.join(extras)}")
        if getattr(args, "config", "") is None:  # doctor's optional CONFIG
            parser.error(f"overrides {' '.join(extras)} need a CONFIG to apply to")
        args.overrides = [*args.overrides, *extras]
    return args


class _StderrHandler(logging.StreamHandler):
    """A StreamHandler writing to whatever `sys.stderr` is at emit time (not the stream at setup)."""

    @property
    def stream(self):
        return sys.stderr

    @stream.setter
    def stream(self, _value) -> None:
        pass


def _setup_logging() -> None:
    """Show vidray's log records (warnings such as a cut prompt, and info lines) on stderr, once."""
    logger = logging.getLogger("vidray")
    if not any(isinstance(h, _StderrHandler) for h in logger.handlers):
        handler = _StderrHandler()
        handler.setFormatter(logging.Formatter("[vidray] %(levelname)s: %(message)s"))
        logger.addHandler(handler)
        logger.setLevel(logging.INFO)


def main(argv: list[str] | None = None) -> int:
    """Run `vidray ARGV`; returns the exit status (see the module docstring).

    Only `UserError`s (the user's input was wrong) become a one-line message and status 2; any other exception
    propagates with its traceback, since it is a bug to fix, not something the user can correct.
    """
    args = parse_args(argv)
    if getattr(args, "verbose", False):
        set_verbose()
    _setup_logging()
    try:
        return args.func(args)
    except UserError as err:
        print(f"vidray {args.command}: error: {err}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:  # Ctrl-C: what stopped was said already (e.g. by run_training); no traceback
        print(f"vidray {args.command}: interrupted", file=sys.stderr)
        return 130


if __name__ == "__main__":
    sys.exit(main())
