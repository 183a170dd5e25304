"""Driver side of training: check the job, then build and run the Ray Train `TorchTrainer`."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

from vidray.config import JobConfig


@dataclass
class TrainResult:
    """What a finished run left behind.

    run_dir: `<storage.path>/<name>`. checkpoint_path: the latest complete checkpoint folder.
    diffusers_dir: the trained pipeline in diffusers format. losses: [step, loss] for each step trained by this
    run (mean over ranks). first_step, last_step: the steps this run trained. steps_per_s: optimizer steps per
    second of wall time inside the loop (after data encoding).
    """

    run_dir: Path
    checkpoint_path: str | None
    diffusers_dir: str
    losses: list[list[float]]
    first_step: int
    last_step: int
    steps_per_s: float
    metrics: dict[str, Any] | None


def _absolute(path: str) -> str:
    return path if "://" in path else str(Path(path).expanduser().resolve())


def latest_checkpoint(run_dir: str | Path) -> Path | None:
    """The newest complete checkpoint folder (`checkpoint_<step>` with its manifest) of a local run, or None."""
    from vidray.train.checkpoint import MANIFEST

    run_dir = Path(run_dir)
    done = sorted(p for p in run_dir.glob("checkpoint_[0-9]*") if (p / MANIFEST).is_file())
    return done[-1] if done else None


def check_job_inputs(job: JobConfig) -> None:
    """Driver-side checks before any Ray resource is reserved.

    Raises FileNotFoundError when the shards have no index (run `vidray prepare`), or `checkpoint.resume_from`
    is not a complete checkpoint; ValueError when the shards hold no samples or a bucket that is not in
    `data.buckets`, when the checkpoint to resume from was trained on other shards, or when it already reached
    `train.max_steps`. Prints a warning when a resumed run changes `scaling.num_workers` (the schedule is then
    re-dealt from the checkpoint's step on).
    """
    from vidray.data.buckets import parse_bucket
    from vidray.data.shards import read_index
    from vidray.train.checkpoint import read_train_state

    index = read_index(job.data.shards_dir)
    if index["num_samples"] == 0:
        raise ValueError(
            f"{job.data.shards_dir} holds no samples: every clip was skipped (see its report.json); "
            "fix the inputs or the buckets and re-run `vidray prepare`"
        )
    configured = set(job.data.buckets)
    prepared = {parse_bucket(key) for key in index.get("bucket_counts", {})}
    unknown = prepared - configured
    if unknown:
        raise ValueError(
            f"shards in {job.data.shards_dir} hold buckets {sorted(unknown)} that are not in data.buckets "
            f"{sorted(configured)}: re-run `vidray prepare` with this config or add the buckets"
        )
    if abs(float(index.get("fps", job.data.fps)) - job.data.fps) > 1e-6:
        raise ValueError(
            f"shards in {job.data.shards_dir} were prepared at {index['fps']} fps but data.fps is {job.data.fps}: "
            "re-run `vidray prepare` with this config or set data.fps to match"
        )
    resume = None if "://" in job.storage.path else latest_checkpoint(job.run_dir)
    if resume is None and job.checkpoint.resume_from:
        resume = Path(job.checkpoint.resume_from)
        if not resume.is_dir():
            raise FileNotFoundError(f"checkpoint.resume_from {resume} is not a folder")
    if resume is None:
        return
    state = read_train_state(resume)
    if state.step >= job.train.max_steps:
        raise ValueError(
            f"{resume} is already at step {state.step} >= train.max_steps {job.train.max_steps}: raise "
            f"train.max_steps to continue the run, or choose a new name to start afresh"
        )
    if state.index_hash and state.index_hash != index.get("content_hash"):
        raise ValueError(
            f"{resume} was trained on other shards (index {state.index_hash}) than {job.data.shards_dir} "
            f"({index.get('content_hash')}): use the original shards, or a new name to start afresh"
        )
    if state.world_size != job.scaling.num_workers:
        print(f"[vidray] warning: {resume} was trained with {state.world_size} workers, this run has "
              f"{job.scaling.num_workers}: the sample schedule is re-dealt from step {state.step + 1} on")


def run_training(job: JobConfig) -> TrainResult:
    """Train `job` with Ray Train: starts a local Ray (or joins `RAY_ADDRESS`) if Ray is not initialized.

    A run whose `<storage.path>/<name>` already holds checkpoints resumes from the latest one.
    Raises the errors of `check_job_inputs` before Ray starts, and ray.train.TrainingFailedError when the
    worker group fails more than `train.max_failures` times.
    """
    check_job_inputs(job)

    import ray.train
    from ray.train.torch import TorchTrainer

    from vidray.runtime import init_ray
    from vidray.train.loop import train_loop_per_worker

    init_ray()
    storage_path = _absolute(job.storage.path)
    run_dir = Path(storage_path) / job.name
    loop_config = {
        "job": job.to_dict(),
        "run_dir": str(run_dir),
        "shards_dir": _absolute(job.data.shards_dir),
        "resume_from": _absolute(job.checkpoint.resume_from) if job.checkpoint.resume_from else None,
    }
    resources = {"CPU": job.scaling.cpus_per_worker}
    if job.scaling.use_gpu:
        resources["GPU"] = 1
    trainer = TorchTrainer(
        train_loop_per_worker,
        train_loop_config=loop_config,
        scaling_config=ray.train.ScalingConfig(
            num_workers=job.scaling.num_workers, use_gpu=job.scaling.use_gpu, resources_per_worker=resources
        ),
        run_config=ray.train.RunConfig(
            name=job.name,
            storage_path=storage_path,
            checkpoint_config=ray.train.CheckpointConfig(num_to_keep=job.checkpoint.num_to_keep),
            failure_config=ray.train.FailureConfig(max_failures=job.train.max_failures),
        ),
    )
    result = trainer.fit()
    out = result.return_value or {}
    return TrainResult(
        run_dir=run_dir,
        checkpoint_path=result.checkpoint.path if result.checkpoint else None,
        diffusers_dir=out.get("diffusers_dir", str(run_dir / "diffusers")),
        losses=out.get("losses", []),
        first_step=out.get("first_step", 0),
        last_step=out.get("last_step", 0),
        steps_per_s=out.get("steps_per_s", 0.0),
        metrics=result.metrics,
    )
