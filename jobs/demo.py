"""The main job on the embedded default (`make demo`): real clips -> a trained VAE -> a DiT trained on its latents
-> a generated video that resembles its caption's training clip.

1. prepare the clips shipped in samples/ into Parquet shards;
2. train the tiny EasyAnimate VAE on them (`vidray train-vae`: 1 Ray Train worker of 2 CPUs, a local Ray started
   in-process) and print its reconstruction PSNR on the training clips;
3. train the tiny DiT on that VAE's latents (`model.vae_path`);
4. generate a video for `--prompt` (by default a training clip's caption) from the trained pipeline, and from the
   same pipeline with the DiT at its random init (the baseline); write the training clip, its reconstruction and
   both videos side by side (`samples/side_by_side.png` and `.mp4`);
5. print a summary: the VAE's PSNR, each generated video's PSNR against the caption's training clip, the loss,
   steps/s, where the outputs are.

    python jobs/demo.py [--config jobs/configs/tiny_t2v.yaml] [section.key=value ...]
"""

from __future__ import annotations

import argparse
import dataclasses
import shutil
import sys
import time
from pathlib import Path

import numpy as np

from vidray.config import JobConfig, load_job_config
from vidray.data.ingest import prepare_data
from vidray.data.shards import INDEX_NAME, read_report, report_path
from vidray.errors import UserError
from vidray.locations import absolute_location
from vidray.logs import set_verbose
from vidray.train.trainer import run_training
from vidray.train.vae import training_clips_psnr, vae_training_job

RESUME_HINT = ("resume with `.venv/bin/python jobs/demo.py --resume` (and the same overrides); `make demo` starts the "
               "run afresh")
"""Told after Ctrl-C during training: running the demo's command again removes the earlier run."""


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--config", default="jobs/configs/tiny_t2v.yaml")
    parser.add_argument("--prompt", default="A hiker standing at the top of a mountain, triumphantly, high quality")
    parser.add_argument("--resume", action="store_true",
                        help="keep an earlier demo run and continue it (default: start the run afresh)")
    parser.add_argument("--verbose", action="store_true", help="also print Ray's and the libraries' own lines")
    parser.add_argument("overrides", nargs="*", default=[], help="section.key=value overrides")
    args = parser.parse_args()
    if args.verbose:
        set_verbose()
    try:
        job = load_job_config(args.config, args.overrides)
    except UserError as err:
        print(f"jobs/demo.py: error: {err}", file=sys.stderr)
        return 2
    try:
        return run_demo(job, prompt=args.prompt, resume=args.resume)
    except UserError as err:  # a refused resume, unusable shards...: one line; a bug shows its traceback
        print(f"jobs/demo.py: error: {err}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:  # Ctrl-C: training said where its checkpoints are and how to resume; no traceback
        print("jobs/demo.py: interrupted", file=sys.stderr)
        return 130


def run_demo(job: JobConfig, *, prompt: str, resume: bool) -> int:
    """Steps 1-5 of the module docstring for `job`; `resume` keeps earlier runs (and their shards)."""
    started = time.perf_counter()

    if resume and (Path(job.data.shards_dir) / INDEX_NAME).is_file():
        # The resumed run's shards as they are: no prepare step (a re-prepare of the same sources would resume too).
        print(f"== 1. prepare: keeping the shards in {job.data.shards_dir} as they are (a resumed run trains on the "
              "dataset it started on; a changed one is refused)", flush=True)
        report = read_report(job.data.shards_dir)
        num_kept, num_samples, num_skipped = report["num_kept"], report["num_samples"], report["num_skipped"]
    else:
        print(f"== 1. prepare {job.data.source} -> {job.data.shards_dir}", flush=True)
        summary = prepare_data(job.data, model=job.model)
        print(summary, flush=True)
        if not summary.committed:
            return 1  # nothing to train on; the summary says why
        num_kept, num_samples, num_skipped = summary.num_kept, summary.num_samples, summary.num_skipped

    # The tiny VAE trains faster as one worker of 2 threads than as 2 DDP workers of 1 thread on 2 cores (its step
    # is many small per-frame convolutions); `vidray train-vae` takes the same overrides on its command line.
    vae_job = vae_training_job(job)
    vae_job = dataclasses.replace(vae_job, scaling=dataclasses.replace(
        vae_job.scaling, num_workers=1, cpus_per_worker=2 * job.scaling.cpus_per_worker))
    vae_dir = Path(vae_job.run_dir) / "vae"
    if resume and (vae_dir / "config.json").is_file():
        print(f"== 2. train the VAE: keeping the trained VAE {vae_dir}", flush=True)
    else:
        _start_afresh(vae_job, resume)
        print(f"== 2. train the VAE {vae_job.name}: {vae_job.scaling.describe_workers()}, {vae_job.train.max_steps} "
              "steps", flush=True)
        vae_dir = Path(run_training(vae_job, resume_hint=RESUME_HINT).diffusers_dir)
    vae_psnr = training_clips_psnr(str(vae_dir), job.data.shards_dir, family=job.model.family)
    print(f"[vidray] {vae_psnr}", flush=True)

    job = dataclasses.replace(job, model=dataclasses.replace(job.model, vae_path=str(vae_dir)))
    _start_afresh(job, resume)
    print(f"== 3. train the DiT {job.name} on its latents: {job.scaling.describe_workers()}, {job.train.max_steps} "
          "steps", flush=True)
    result = run_training(job, resume_hint=RESUME_HINT)
    import ray

    if ray.is_initialized():  # done with Ray: its workers' last log lines print now, not after the summary
        ray.shutdown()

    print("== 4. generate", flush=True)
    from vidray.compare import compare_with_training_clip

    comparison = compare_with_training_clip(job, result.diffusers_dir, prompt, result.run_dir / "samples")

    losses = np.array([loss for _, loss in result.losses])
    print("\n== summary")
    print(vae_psnr)
    for line in comparison.lines:
        print(line)
    if len(losses) >= 20:
        first, last = losses[:10].mean(), losses[-10:].mean()
        print(f"DiT mean loss, first 10 steps: {first:.4f}   last 10 steps: {last:.4f}   ({last / first:.0%} of the "
              "first)")
    elif len(losses):
        resumed = f"resumed at step {result.first_step}, " if result.first_step > 1 else ""
        print(f"{resumed}trained {len(losses)} DiT steps this run (too few for a first/last 10 comparison): "
              f"mean loss {losses.mean():.4f}")
    print(f"DiT steps {result.first_step}..{result.last_step} at {result.steps_per_s:.2f} steps/s "
          f"({job.scaling.describe_workers()})")
    print(f"kept {num_kept} files as {num_samples} clips, skipped {num_skipped} "
          f"(report: {report_path(absolute_location(job.data.shards_dir))})")
    print(f"trained VAE:        {vae_dir}")
    print(f"checkpoint:         {result.checkpoint_path}")
    print(f"diffusers pipeline: {result.diffusers_dir}")
    print(f"loss curve:         {result.run_dir}/loss.png (tensorboard --logdir {result.run_dir.parent})")
    print(f"generated video:    {comparison.generated_mp4}")
    print(f"side by side:       {comparison.png} and {comparison.mp4} ({', '.join(comparison.rows)}, top to bottom "
          "/ left to right)")
    print(f"total wall time:    {time.perf_counter() - started:.0f} s")
    return 0


def _start_afresh(job: JobConfig, resume: bool) -> None:
    """Remove an earlier demo run of `job` unless resuming."""
    if job.run_dir.exists() and not resume:
        print(f"removing the previous demo run {job.run_dir} (pass --resume to continue it instead)", flush=True)
        shutil.rmtree(job.run_dir)


if __name__ == "__main__":
    sys.exit(main())
