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


def check_job_inputs(job: JobConfig) -> None:
    """Driver-side checks before any Ray resource is reserved.

    Raises FileNotFoundError when the shards have no index (run `vidray prepare`), or `checkpoint.resume_from`
    is not a complete checkpoint; ValueError when the shards hold no samples or a bucket that is not in `data.buckets`.
    """
    from vidray.data.shards import read_index
    from vidray.train.checkpoint import read_train_state

    index = read_index(job.data.shards_dir)
    if index["num_samples"] == 0:
        raise ValueError(
            f"{job.data.shards_dir} holds no samples: every clip was skipped (see its report.json); "
            "fix the inputs or the buckets and re-run `vidray prepare`"
        )
    configured = {tuple(b) for b in job.data.buckets}
    prepared = {tuple(int(x) for x in str(b).split("x")) for b in index.get("bucket_counts", {})}
    unknown = prepared - configured
    if unknown:
        raise ValueError(
            f"shards in {job.data.shards_dir} hold buckets {sorted(unknown)} that are not in data.buckets "
            f"{sorted(configured)}: re-run `vidray prepare` with this config or add the buckets"
        )
    if job.checkpoint.resume_from:
        if not Path(job.checkpoint.resume_from).is_dir():
            raise FileNotFoundError(f"checkpoint.resume_from {job.checkpoint.resume_from} is not a folder")
        read_train_state(job.checkpoint.resume_from)


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
