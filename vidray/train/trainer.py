"""Driver side of training: check the job, then build and run the Ray Train `TorchTrainer`.

Everything a retry cannot fix is refused here, on the driver, before Ray reserves anything: shards that do not
match the config, a damaged checkpoint, a resume that changes a key fixed for the run (`vidray.config.RESUME_RULES`),
resources the cluster does not have, an output folder that cannot be written.

Which checkpoint a run starts from is decided by `vidray.train.resume.plan_resume` (its module docstring has the
precedence), and passed to the workers.
"""

from __future__ import annotations

import contextlib
import dataclasses
import errno
import fcntl
import os
import json
import signal
import sys
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from vidray.buckets import parse_bucket
from vidray.config import JobConfig
from vidray.data.cache import check_cache_budget
from vidray.data.outputs import check_output_location, latent_cache_root
from vidray.errors import RequestCannotBeMetError, UserError, UserFileNotFound  # noqa: F401 (re-exported)
from vidray.locations import absolute_location, is_uri
from vidray.models.export import BASE_REF, LORA_DIR, MODEL_INDEX
from vidray.storage import open_storage
from vidray.logs import ray_train_log_level, worker_env
from vidray.placement import alive_nodes, resolve_placement
from vidray.runtime import LOCAL_RAY, WORKER_GROUP_START_RETRIES, apply_ray_env_defaults, check_local_ray
from vidray.train.entry import train_loop_per_worker
from vidray.train.progress import TrainProgress
from vidray.train.resume import (
    ResumePlan,
    apply_num_to_keep,
    check_resume,
    interrupted_note,
    plan_files,
    plan_resume,
    set_aside,
)
from vidray.train.validation import check_validation_prompts


@dataclass
class TrainResult:
    """What a finished run left behind.

    run_dir: `<storage.path>/<name>`. checkpoint_path: the latest complete checkpoint folder.
    diffusers_dir: the trained pipeline in diffusers format. losses: [step, loss] for each step trained by this
    run (mean over ranks). first_step, last_step: the steps this run trained. steps_per_s: optimizer steps per
    second of wall time inside the loop (data loading and encoding included). metrics: the last reported metrics with a
    checkpoint (step, epoch, loss, step_time_s, lr, grad_norm). reported_steps: steps at which metrics were reported.
    trained_samples: [[step, epoch, [sample_id, ...]], ...] trained with weight > 0 on all ranks at each step
    (only with `run_training(..., record_sample_ids=True)`).
    """

    run_dir: Path | str
    """A local folder, or the URI string (`s3://bucket/runs/<name>`) when `storage.path` is one."""
    checkpoint_path: str | None
    diffusers_dir: str
    losses: list[list[float]]
    first_step: int
    last_step: int
    steps_per_s: float
    metrics: dict[str, Any] | None
    reported_steps: list[int] = field(default_factory=list)
    trained_samples: list[list[Any]] = field(default_factory=list)
    skipped_shards: list[dict[str, str]] = field(default_factory=list)
    """[{file, reason}] of shards skipped because their sha256 did not match index.json, or the store kept
    failing to deliver them (not trained on)."""
    skipped_clips: list[dict[str, str]] = field(default_factory=list)
    """[{sample_id, reason}] of clips that no longer decode (not trained on)."""
    step_seconds: list[list[float]] = field(default_factory=list)
    """[step, data_wait_s, encode_s, dit_s] of rank 0 for each step: seconds waiting for the loader, seconds the
    vae and text stages spent on the step's micro-batches (in their own actors, overlapped with training), and the
    DiT step (forward, backward, optimizer)."""
    data: dict[str, float] = field(default_factory=dict)
    """Rank 0's data-plane totals (`vidray.metrics.TrainMetrics.summary`): data_wait_s, data_wait_fraction, hot,
    warm, latent and prompt hits/misses, bytes_fetched, prefetch_lead, skipped counts, per-stage busy seconds,
    clips and busy fractions."""
    checkpoint_blocked_s: list[list[float]] = field(default_factory=list)
    """[step, seconds] rank 0's loop stood still for each checkpoint of this run: the local snapshot with
    `checkpoint.upload: async`, snapshot and copy to `storage.path` with `sync`."""
    first_step_done_unix: float | None = None
    placement: list[dict[str, Any]] = field(default_factory=list)
    """Per rank {"rank", "trainer": {"node_id", "labels"}, "loaders": [{"node_id", "labels"}, ...], "vae": [...],
    "text": [...], "expert", "timestep_range"}: the nodes (ids, labels) its DiT worker, its decode operators and its
    encode actors ran on, as each saw them from inside (`ray.get_runtime_context()`), its expert (`model.experts`
    layout groups, else None) and the [lowest, highest] timestep it trained a sample at, for the last attempt."""
    experts: dict[str, list[int]] = field(default_factory=dict)
    """{"high" | "low": the ranks of that expert's worker group} with `model.experts` layout groups, else {}."""
    expert_losses: dict[str, list[list[float]]] = field(default_factory=dict)
    """{"high" | "low": [step, loss] for each step, the mean over that expert's ranks} with `model.experts` layout
    groups, else {}."""
    """Wall clock (`time.time()`, s) when the first step of the run's last attempt finished on rank 0 (after a
    worker failure: the first step after the restart); None when it trained no step."""
    peak_rss_bytes: int = 0
    """Peak resident memory (bytes) of the rank-0 worker process (`ru_maxrss`)."""
    validation: list[dict[str, Any]] = field(default_factory=list)
    """[{"step", "seconds", "dir"}] of the validations of this run (`train.validation`), each sampled beside the
    training in its own actor (`vidray.train.validation`)."""
    validation_wait_s: float = 0.0
    """Seconds rank 0 waited at the end of the run for validations still running (their cost to the run)."""


class NonRetryableTrainingError(UserError):
    """A worker raised a vidray user error (deterministic: a retry would fail the same way)."""


def _storage_uri(storage_path: str, fs_path: str) -> str:
    """A path in the filesystem of `storage_path` as the user reads it: unchanged for a local `storage.path`, else
    with the URI's scheme put back (`bucket/runs/x` -> `s3://bucket/runs/x`)."""
    if not is_uri(storage_path) or is_uri(fs_path):
        return fs_path
    return f"{storage_path.split('://', 1)[0]}://{fs_path}"


def output_locations(job: JobConfig) -> list[tuple[str, str]]:
    """(config key, location) of what a run writes: `storage.path`, and `data.latent_cache` unless it is off."""
    locations = [("storage.path", job.storage.path)]
    if latent_cache := latent_cache_root(job):
        locations.append(("data.latent_cache", latent_cache))
    return locations


def check_job_outputs(job: JobConfig) -> None:
    """`check_output_location` for each of `output_locations(job)`; before any Ray resource is reserved and
    before `vidray train --prepare` prepares (else a bad `storage.path` on S3 ends in a traceback from Ray Train's
    controller, and a bad latent cache in one from the encode actors)."""
    for key, location in output_locations(job):
        check_output_location(key, location)


def check_job_inputs(job: JobConfig) -> ResumePlan:
    """Driver-side checks before any Ray resource is reserved; returns where the run starts.

    Raises UserFileNotFound when the shards have no index (run `vidray prepare`) or `checkpoint.resume_from`
    is not a folder; UserError when the shards hold no samples, a bucket that is not in `data.buckets` or
    another fps; CheckpointError when the checkpoint to start from is incomplete or damaged; ConfigError when
    `storage.path` or `data.latent_cache` cannot be written (`check_job_outputs`; for a URI, also when its store
    does not answer or its bucket does not exist, and likewise for `data.shards_dir` and an object-store
    `checkpoint.resume_from`), or when resuming changes a key fixed for the run (naming each key and both values),
    trains on another dataset (`vidray.train.checkpoint.dataset_mismatch`), or is already at `train.max_steps`,
    and when `model.max_sequence_length` exceeds the text encoder's limit. Prints one line listing the changeable
    keys that differ from the checkpoint, and the data position the run continues from (world-size independent: another
    `scaling.num_workers` deals the rest of the epoch, each sample still exactly once; `vidray.data.schedule`).
    """
    from vidray.data.shards import read_index, report_path  # heavy: av, PIL

    check_job_outputs(job)
    check_job_settings(job)
    warn_if_lora_export(job)
    warn_if_powersgd_with_adamw(job)
    shards = open_storage(job.data.shards_dir)  # a folder or a URI (vidray.storage)
    shards.check_reachable("data.shards_dir")  # an S3 fault in one line, not a traceback
    index = read_index(shards)
    if is_uri(job.data.shards_dir) and not job.data.shards_dir.startswith("file://"):
        check_cache_budget(job.data.cache_bytes, index)  # object-store shards go through the warm cache
    if index["num_samples"] == 0:
        raise UserError(
            f"{job.data.shards_dir} holds no samples: every clip was skipped (see {report_path(job.data.shards_dir)}); "
            "fix the inputs or the buckets and re-run `vidray prepare`"
        )
    configured = set(job.data.buckets)
    prepared = {parse_bucket(key, job.model.family) for key in index.get("bucket_counts", {})}
    unknown = prepared - configured
    if unknown:
        raise UserError(
            f"shards in {job.data.shards_dir} hold buckets {', '.join(map(str, sorted(unknown)))} that are not in "
            f"data.buckets ({', '.join(map(str, sorted(configured)))}): re-run `vidray prepare` with this config or add the buckets"
        )
    if abs(float(index.get("fps", job.data.fps)) - job.data.fps) > 1e-6:
        raise UserError(
            f"shards in {job.data.shards_dir} were prepared at {index['fps']} fps but data.fps is {job.data.fps}: "
            "re-run `vidray prepare` with this config or set data.fps to match"
        )
    plan = plan_resume(job)
    if plan.checkpoint is None:
        return plan
    with plan_files(plan.checkpoint) as folder:
        return check_resume(job, plan, folder, index)


def check_job_settings(job: JobConfig) -> None:
    """The checks of `check_job_inputs` that need no prepared shard (`vidray doctor` runs them before `vidray
    prepare` has): `model.max_sequence_length` against the text encoder's limit, a model the family can train, the
    validation prompts' token counts and images (`check_validation_prompts`), and `model.vae_path`. Raises
    ConfigError or UserError naming the key and the fix."""
    from vidray.models.registry import get_family  # heavy: torch
    from vidray.models.text_encoder import check_max_sequence_length  # heavy: torch, transformers, accelerate
    from vidray.train.vae import check_vae_path  # heavy: torch

    check_max_sequence_length(job.model)
    try:
        get_family(job.model.family).check_trainable(job.model)  # a model the family samples but cannot train
    except ValueError as err:
        raise UserError(str(err)) from None
    check_validation_prompts(job)  # a prompt the text encoder would cut: before anything starts
    check_vae_path(job)  # a model.vae_path that is not a VAE folder: before anything starts


POWERSGD_ADAMW_GAP = ("after 200 steps the loss is 58 % above the uncompressed run's at rank 4 (14 % at rank 16)",
                      "raise train.powersgd_rank (to width / 8 at most for a quarter of the bytes: a 512-wide model "
                      "ends 5 % above at rank 64) or use train.grad_compression: int4, which sends 0.13 of the bytes at "
                      "1 % loss")
"""The loss gap docs/training-at-scale.md measured for PowerSGD with AdamW on the tiny model, and its advice with
the wide model's gap at a quarter of the bytes (issue 47's grid, `benchmarks/_powersgd_grid.py --model wide`; no
setting met 2 % on either model; `tests/unit/test_trainer_checks.py` keeps the words equal to the docs')."""


def warn_if_powersgd_with_adamw(job: JobConfig) -> bool:
    """Print one warning line, and return True, when the run compresses its gradients with PowerSGD: vidray's
    optimizer is AdamW, with which PowerSGD (made for SGD with momentum) fits slower (`POWERSGD_ADAMW_GAP`)."""
    if job.train.grad_compression != "powersgd":
        return False
    gap, advice = POWERSGD_ADAMW_GAP
    print(f"[vidray] warning: train.grad_compression: powersgd (rank {job.train.powersgd_rank}) with AdamW fits slower "
          f"than uncompressed training: on the tiny model {gap} (docs/training-at-scale.md); {advice}",
          file=sys.stderr, flush=True)
    return True


def warn_if_lora_export(job: JobConfig) -> bool:
    """Print one warning line, and return True, when `model.pretrained_path` is a LoRA run's export (a local
    pipeline folder with its adapters in `lora/`, `vidray.models.export.LORA_DIR`): a run starts from the folder's
    base pipeline, without those adapters (`vidray generate` and serving merge them; training does not). Resuming
    the LoRA run's checkpoint continues its adapters. Raises UserError for an adapter-only export (`base_model.json`,
    no pipeline of its own): a run cannot start from adapters alone; the line names its base and `vidray export
    --merge-lora`."""
    path = job.model.pretrained_path
    if job.model.init != "pretrained" or not path or is_uri(path):
        return False
    if (Path(path) / BASE_REF).is_file() and not (Path(path) / MODEL_INDEX).is_file():
        base = json.loads((Path(path) / BASE_REF).read_text()).get("base")
        raise UserError(f"model.pretrained_path {path} is an adapter-only LoRA export (its base is {base}): start from "
                        f"that base, resume the LoRA run's checkpoint to continue its adapters, or merge them first "
                        f"(`vidray export --merge-lora {path} OUT_DIR`) and give OUT_DIR")
    if not (Path(path) / LORA_DIR).is_dir():
        return False
    print(f"[vidray] warning: model.pretrained_path {path} is a LoRA run's export: this run starts from its base "
          f"pipeline without the adapters in {LORA_DIR}/ (to continue those adapters, resume that run's checkpoint "
          "with checkpoint.resume_from)", file=sys.stderr, flush=True)
    return True


def required_resources(job: JobConfig, num_workers: int | None = None) -> dict[str, float]:
    """Logical resources the run reserves with `num_workers` workers (default: `scaling.num_workers`, or the min
    of an elastic `[min, max]`: what it needs to run at all): CPU = workers * (cpus_per_worker + data.loader_cpus
    + placement.vae.num_cpus + placement.text.num_cpus: each worker's Ray Data loader and encode actors), GPU =
    workers * (1 when use_gpu + the encode actors' num_gpus), plus `train.validation.num_cpus` of the validation
    actor when validation is on. Ray Train's controller actor reserves 0 CPUs, so it adds nothing."""
    workers = job.scaling.min_workers if num_workers is None else int(num_workers)
    encoders = (job.placement.vae, job.placement.text)
    need = {"CPU": workers * (job.scaling.cpus_per_worker + job.data.loader_cpus + sum(e.num_cpus for e in encoders))}
    if job.train.validation.every_steps is not None:
        need["CPU"] += job.train.validation.num_cpus
    gpus = workers * ((1.0 if job.scaling.use_gpu else 0.0) + sum(e.num_gpus for e in encoders))
    if gpus:
        need["GPU"] = float(gpus)
    return need


def check_resources(job: JobConfig, cluster: dict[str, float], *, autoscaler_max: dict[str, float] | None = None,
                    where: str = "the cluster") -> None:
    """Refuse a job whose worker group cannot be placed: raises RequestCannotBeMetError with the numbers.

    `cluster`: total logical resources now (`ray.cluster_resources()`); `autoscaler_max`: what the autoscaler's
    node types could add up to, or None for a fixed cluster. Each worker needs its CPUs (and GPU) on one node;
    this checks totals, which is necessary, not sufficient. An elastic `scaling.num_workers: [min, max]` is
    checked at its min (it can run at all); when the totals hold fewer than max workers a line says how many it
    starts with.
    """
    problems = []
    min_workers, max_workers = job.scaling.min_workers, job.scaling.max_workers
    per_worker = required_resources(job, 1)
    # the most of each resource the cluster can reach (its autoscaler's limit when it reports one), and how many
    # workers (each with its loader and encode actor) fit in it
    could_have = {r: float(max(cluster.get(r, 0), (autoscaler_max or {}).get(r, 0))) for r in per_worker}
    workers_fit = {r: int((could_have[r] + 1e-9) // need) for r, need in per_worker.items()}
    if job.scaling.elastic:
        fitting = min(workers_fit.values())
        if min_workers <= fitting < max_workers:
            print(f"[vidray] {where} holds the resources of {fitting} of scaling.num_workers={[min_workers, max_workers]} "
                  f"workers now: the run starts with {fitting} and grows when more can be placed (checked every "
                  f"scaling.resize_check_s={job.scaling.resize_check_s:g} s)", flush=True)
    for resource, need in required_resources(job).items():
        have = float(cluster.get(resource, 0))
        could = could_have[resource]
        if need > could + 1e-9:
            if resource == "GPU":  # name only the keys that ask for GPUs (a trial: use_gpu was blamed when false)
                askers = [("scaling.use_gpu=true", "scaling.use_gpu=false")] if job.scaling.use_gpu else []
                askers += [(f"placement.{stage}.num_gpus={getattr(job.placement, stage).num_gpus:g}",
                            f"placement.{stage}.num_gpus=0")
                           for stage in ("vae", "text") if getattr(job.placement, stage).num_gpus > 0]
                fix = (f"set {' and '.join(off for _, off in askers)}, or run on a cluster with GPUs "
                       + ("(RAY_ADDRESS)" if where == LOCAL_RAY else "(add GPU nodes, or point RAY_ADDRESS at one)"))
            else:
                # each worker's loader and encode actor, and what its trainer could have beside them
                others = per_worker["CPU"] - job.scaling.cpus_per_worker
                per_worker_cpus = could / min_workers - others
                most_workers = workers_fit["CPU"]
                lower = f"lower scaling.num_workers{' (its min)' if job.scaling.elastic else ''}"
                if per_worker_cpus >= 0.1:
                    fix = (f"{lower} or scaling.cpus_per_worker (e.g. scaling.cpus_per_worker="
                           f"{per_worker_cpus:.2g}), or data.loader_cpus")
                else:  # no trainer share fits beside the loaders and encode actors: only fewer workers help
                    fix = (f"{lower} to at most {most_workers}" if most_workers >= 1 else lower) + (
                        f" (each worker also holds data.loader_cpus + placement.vae|text.num_cpus = {others:g} CPUs)")
            extra = f" (its autoscaler can reach {could:g})" if autoscaler_max else ""
            workers = (f"{[min_workers, max_workers]} (at least {min_workers})" if job.scaling.elastic
                       else f"{min_workers}")
            if resource == "GPU":
                asking = " + ".join(on for on, _ in askers)
                what = (f"{asking} with scaling.num_workers={workers}" if job.scaling.elastic
                        else f"{asking} with {min_workers} worker{'' if min_workers == 1 else 's'}")
            else:
                what = (f"scaling.num_workers={workers} x (scaling.cpus_per_worker="
                        f"{job.scaling.cpus_per_worker:g} + data.loader_cpus={job.data.loader_cpus:g} + "
                        f"placement.vae.num_cpus={job.placement.vae.num_cpus:g} + "
                        f"placement.text.num_cpus={job.placement.text.num_cpus:g})")
            unit = resource if need == 1 else f"{resource}s"
            problems.append(f"{what} needs {need:g} {unit}; {where} has {have:g}{extra}: {fix}")
    if problems:
        raise RequestCannotBeMetError("; ".join(problems))


def _stop_on_user_errors_callback():
    """A Ray Train callback (runs on the controller) that ends the run at the first worker `UserError`.

    Ray Train 2.60 retries every worker error up to `FailureConfig(max_failures)`; an exception raised by a
    callback is a controller error, which its failure policy does not retry. The driver unwraps it again.
    """
    from ray.train import UserCallback  # heavy: ray

    class StopOnUserError(UserCallback):
        def after_exception(self, run_context, worker_exceptions):
            for exc in worker_exceptions.values():
                base = getattr(exc, "_base_exc", exc)
                if isinstance(base, UserError):
                    raise base

    return StopOnUserError()


def _torch_trainer_class():
    """`TorchTrainer` whose Ctrl-C stops the run at once.

    Ray Train 2.60's SIGINT handler blocks on `controller.abort`, which waits for a worker group that is still
    starting (up to `RAY_TRAIN_WORKER_GROUP_START_TIMEOUT_S`, then the next start-up try). This one asks the
    controller to abort without waiting and raises KeyboardInterrupt in the driver: a local cluster then ends
    with the driver, and on a remote cluster the driver's actors (controller, workers) end with it.
    """
    import ray  # heavy: ray
    from ray.train.torch import TorchTrainer  # heavy: ray

    class VidrayTorchTrainer(TorchTrainer):
        def _register_sigint_handler(self, controller):
            def on_sigint(signum, frame):
                try:
                    controller.abort.remote()
                except Exception:  # noqa: BLE001 - the controller may already be gone
                    pass
                signal.signal(signal.SIGINT, signal.default_int_handler)
                raise KeyboardInterrupt

            if ray.__version__.startswith("2.60"):  # a private hook: other Ray versions keep their own handler
                signal.signal(signal.SIGINT, on_sigint)
            else:
                super()._register_sigint_handler(controller)

    return VidrayTorchTrainer


def build_trainer_configs(job: JobConfig, storage_path: str, *, placement: dict[str, dict[str, str]] | None = None,
                          callbacks: list[Any] | None = None) -> tuple[Any, Any]:
    """(ray.train.ScalingConfig, ray.train.RunConfig) for `job`: workers and their resources, run name and
    storage (a `storage.path` URI with vidray's pyarrow filesystem), checkpoints kept, worker restarts
    (`train.max_failures`) and bounded worker-group start-up retries (`vidray.runtime.WORKER_GROUP_START_RETRIES`;
    elastic jobs add one per allowed worker failure, -1 when `train.max_failures` is -1). `placement`: {stage:
    label selector} as `vidray.placement.resolve_placement` resolved it; the workers go where its `dit` entry
    allows (`worker_label_selectors`), or, with `model.experts.layout: groups`, each its expert's half of them."""
    import ray.train  # heavy: ray

    resources = {"CPU": job.scaling.cpus_per_worker}
    if job.scaling.use_gpu:
        resources["GPU"] = 1
    elastic = job.scaling.elastic  # [min, max]: Ray Train's elastic mode, resize checks every resize_check_s
    scaling = ray.train.ScalingConfig(
        num_workers=(job.scaling.min_workers, job.scaling.max_workers) if elastic else job.scaling.num_workers,
        use_gpu=job.scaling.use_gpu, resources_per_worker=resources,
        **({"elastic_resize_monitor_interval_s": float(job.scaling.resize_check_s)} if elastic else {}),
        **({"label_selector": selectors} if (selectors := worker_label_selectors(job, placement)) else {}),
    )
    storage_filesystem = None
    if is_uri(storage_path):
        # A URI: Ray Train gets vidray's own filesystem (AWS_ENDPOINT_URL, region, retries) and the path without its
        # scheme (`s3://bucket/runs` -> `bucket/runs`), as RunConfig(storage_filesystem=) requires. The filesystem
        # is pickled to the controller and workers without credentials (each resolves them from its environment)
        # and without the retry strategy (they use pyarrow's default: AWS standard, 3 attempts).
        storage = open_storage(storage_path, setting="storage.path")
        storage_filesystem, storage_path = storage.fs, storage.base
    controller_failure_limit = WORKER_GROUP_START_RETRIES
    if elastic:
        # After a node is lost, Ray's AutoscalingCoordinator (2.60) refreshes its node view every 20 s, so the first
        # restart may still ask for the lost node's workers and wait out RAY_TRAIN_WORKER_GROUP_START_TIMEOUT_S: each
        # worker failure may cost one start-up failure on top of the bounded start-up retries.
        retries = job.train.max_failures
        controller_failure_limit = -1 if retries < 0 else WORKER_GROUP_START_RETRIES + retries
    run = ray.train.RunConfig(
        name=job.name,
        storage_path=storage_path,
        storage_filesystem=storage_filesystem,
        checkpoint_config=ray.train.CheckpointConfig(num_to_keep=job.checkpoint.num_to_keep),
        failure_config=ray.train.FailureConfig(
            max_failures=job.train.max_failures, controller_failure_limit=controller_failure_limit
        ),
        callbacks=[_stop_on_user_errors_callback(), *(callbacks or [])],
        # Ray Train's own INFO lines (every report's TrainingReport dump, worker-group start-up) only with --verbose;
        # the workers get the library settings of this driver (vidray.logs) on a cluster too.
        logging_config=ray.train.LoggingConfig(log_level=ray_train_log_level()),
        worker_runtime_env={"env_vars": worker_env()},
    )
    return scaling, run


def worker_label_selectors(job: JobConfig, placement: dict[str, dict[str, str]] | None
                           ) -> dict[str, str] | list[dict[str, str]] | None:
    """What `ScalingConfig(label_selector=)` gets from the resolved `placement` ({stage: selector}): None (the
    workers go anywhere), the `dit` selector for every worker, or, with `model.experts.layout: groups`, one selector
    per worker: `expert_high`'s for the first `scaling.num_workers // 2` workers (placement-group bundles), then
    `expert_low`'s (each falling back to `dit`'s, else {}: Ray takes an empty dict as no constraint); None when
    all of them are empty.

    Ray Train 2.60 gives bundle i the i-th selector, but numbers world ranks by node and GPU id
    (`WorkerGroup._assign_worker_ranks`), not by bundle: a worker learns its expert from its node's labels
    (`vidray.placement.expert_of_ranks`), not from its rank."""
    placement = placement or {}
    dit = dict(placement.get("dit") or {})
    experts = job.model.experts
    if experts is None or experts.layout != "groups":
        return dit or None
    half = job.scaling.max_workers // 2  # layout groups: a fixed, even worker count (vidray.config)
    high = dict(placement.get("expert_high") or dit)
    low = dict(placement.get("expert_low") or dit)
    if not (high or low):
        return None
    return [dict(high) for _ in range(half)] + [dict(low) for _ in range(half)]


RESUME_HINT = "run the same command again to resume"
"""What `run_training` tells a user after Ctrl-C, unless the caller knows its own resume command."""


def run_training(job: JobConfig, *, record_sample_ids: bool = False, resume_hint: str = RESUME_HINT) -> TrainResult:
    """Train `job` with Ray Train: starts a local Ray (or joins `RAY_ADDRESS`) if Ray is not initialized.

    A run whose `<storage.path>/<name>` already holds checkpoints resumes from the latest one, unless
    `checkpoint.resume_from` names another (see the module docstring). Raises UserError when another driver is
    training the same run folder (`run_folder_lock`), the errors of `check_job_inputs` and RequestCannotBeMetError,
    all before Ray reserves anything; a vidray UserError raised in a worker (a diverged
    loss, a damaged checkpoint) is raised as is, without Ray Train retries; ray.train.TrainingFailedError when
    the worker group fails more than `train.max_failures` times. `record_sample_ids`: also return the sample_ids
    trained at each step (`TrainResult.trained_samples`; for tests and audits, it grows with the run).
    `resume_hint`: how to resume, printed after Ctrl-C (KeyboardInterrupt is re-raised), e.g. the demo's
    `--resume` (running its command again starts over).
    """
    # 1. Checks that need no Ray: local resources (first: a run that cannot start says so before the resume
    #    lines), the run folder not in use, config against shards and checkpoint, output folder.
    apply_ray_env_defaults()
    job = with_absolute_model_paths(job)  # the workers' working directory is not the driver's
    check_local_ray(job, check_resources)
    with run_folder_lock(job):
        return _run_training(job, record_sample_ids=record_sample_ids, resume_hint=resume_hint)


def with_absolute_model_paths(job: JobConfig) -> JobConfig:
    """`job` with a relative `model.pretrained_path` and `model.vae_path` made absolute against the driver's
    working directory (`absolute_location`; URIs stay): the Ray Train workers and encode actors run elsewhere."""
    paths = {key: absolute_location(value) for key in ("pretrained_path", "vae_path")
             if (value := getattr(job.model, key))}
    return dataclasses.replace(job, model=dataclasses.replace(job.model, **paths)) if paths else job


RUN_LOCK_NAME = ".vidray-train.lock"
"""The file in a local run folder that a training driver holds an exclusive `flock` on while it trains."""


@contextlib.contextmanager
def run_folder_lock(job: JobConfig):
    """Hold an exclusive lock on the run folder `<storage.path>/<name>` for as long as one driver trains it: a
    second `vidray train` (or `ray job submit`) of the same run, which would write its checkpoints over the
    first's and remove them in its own rotation (a new user's trial: the second died with Ray's "Path not found"
    traceback), is refused at once, before it checks or reserves anything.

    An `flock` on `<run>/.vidray-train.lock`: per open file, so a second run in the same process is refused too,
    and released by the kernel when the driver dies, even by SIGKILL. A run that ends having written nothing (refused
    by a later check) leaves no folder. Raises UserError naming the run and the fix.
    A run folder on object storage (`storage.path` a URI) has no lock: two drivers of one run there are not
    detected. A folder that cannot be created is left to `check_job_inputs`, which names the setting.
    """
    storage_path = absolute_location(job.storage.path)
    if is_uri(storage_path):
        yield
        return
    run_dir = Path(storage_path) / job.name
    try:
        run_dir.mkdir(parents=True, exist_ok=True)
        fd = os.open(run_dir / RUN_LOCK_NAME, os.O_RDWR | os.O_CREAT, 0o644)
    except OSError:  # unwritable storage.path: check_job_inputs says so, naming the key
        yield
        return
    try:
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError as err:
            if err.errno in (errno.EWOULDBLOCK, errno.EAGAIN, errno.EACCES):
                raise UserError(
                    f"another `vidray train` is training the run {run_dir} (it holds {RUN_LOCK_NAME}): its "
                    f"checkpoints would be overwritten. Wait for it to finish, or give this run another name "
                    f"(name={job.name}-2)"
                ) from None
            raise
        try:
            yield
        finally:
            with contextlib.suppress(OSError):  # a run that wrote nothing leaves nothing
                if [p.name for p in run_dir.iterdir()] == [RUN_LOCK_NAME]:
                    (run_dir / RUN_LOCK_NAME).unlink()
                    run_dir.rmdir()
    finally:
        os.close(fd)


def _run_training(job: JobConfig, *, record_sample_ids: bool, resume_hint: str) -> TrainResult:
    """`run_training` once the run folder is locked (`run_folder_lock`)."""
    import ray  # heavy: ray
    import ray.train  # heavy: ray

    from vidray.runtime import autoscaler_max_resources, init_ray  # lazy: test_captions replaces init_ray

    plan = check_job_inputs(job)
    from vidray.data.captions import shards_caption_truncation  # heavy: torch, transformers (~1 s)

    if job.train.objective != "vae":  # a VAE run trains on frames only: its captions reach no model
        print(f"[vidray] captions: {shards_caption_truncation(job.data.shards_dir, job.model)}", flush=True)

    # 2. Join or start Ray, then check the cluster it found.
    init_ray()
    autoscaler_max = autoscaler_max_resources()
    check_resources(job, ray.cluster_resources(), autoscaler_max=autoscaler_max)
    from vidray.train.plan import check_cluster_fits  # lazy: GPU clusters only; vidray.train.plan imports in ~0.2 s

    if memory := check_cluster_fits(job, ray.cluster_resources()):
        print(f"[vidray] memory: {memory}", flush=True)
    placement = resolve_placement(job, alive_nodes(), autoscaler=autoscaler_max is not None)

    # 3. Move checkpoints newer than an explicit start point aside, then run.
    storage_path = absolute_location(job.storage.path)
    set_aside(plan)
    loop_config = build_loop_config(job, plan, placement=placement, record_sample_ids=record_sample_ids)
    if loop_config["latent_cache"]:
        # The encoders' identities name their cache entries; computed once (and once per driver process), on the
        # stages' nodes, while the workers start, so that the loaders skip decoding clips whose latents are cached
        # from the first step and the encode stages load no encoder until a miss (refs: never waited for here;
        # see vidray.data.pipeline).
        from vidray.data.pipeline import encode_spec, encoder_identity_refs  # heavy: pyarrow

        loop_config["identities"] = encoder_identity_refs(encode_spec(job, placement,
                                                                      latent_cache=loop_config["latent_cache"]))
    bar = TrainProgress(first_step=plan.step + 1, max_steps=job.train.max_steps,
                        samples_per_step=job.global_batch_size)  # a terminal's bar, fed by the reports
    scaling_config, run_config = build_trainer_configs(job, storage_path, placement=placement,
                                                       callbacks=bar.callbacks)
    trainer = _torch_trainer_class()(
        train_loop_per_worker, train_loop_config=loop_config, scaling_config=scaling_config, run_config=run_config
    )
    try:
        with bar:
            result = trainer.fit()
    except ray.train.ControllerError as err:
        if isinstance(err.controller_failure, UserError):
            raise err.controller_failure from None
        raise
    except KeyboardInterrupt:
        print(interrupted_note(plan, job, resume_hint), file=sys.stderr, flush=True)
        raise
    apply_num_to_keep(plan, job, {Path(checkpoint.path).name for checkpoint, _ in result.best_checkpoints or []})
    return train_result(job, result.return_value or {}, metrics=result.metrics, checkpoint_path=(
        _storage_uri(storage_path, result.checkpoint.path) if result.checkpoint else None))


def run_dir_of(job: JobConfig) -> Path | str:
    """`<storage.path>/<name>`: a local Path, or the URI string when `storage.path` is one."""
    storage_path = absolute_location(job.storage.path)
    return f"{storage_path.rstrip('/')}/{job.name}" if is_uri(storage_path) else Path(storage_path) / job.name


def build_loop_config(job: JobConfig, plan: ResumePlan, *, placement: dict[str, Any],
                      record_sample_ids: bool) -> dict[str, Any]:
    """The `loop_config` every rank's `Worker` is built from (`vidray.train.loop.train_loop_per_worker` documents
    its keys), for a checked job, its resume plan and its resolved placement ({} on one node)."""
    return {
        "job": job.to_dict(),
        "run_dir": plan.manager.location(),  # a local path or the URI
        "shards_dir": absolute_location(job.data.shards_dir),
        "resume_from": str(plan.checkpoint) if plan.checkpoint else None,
        "start_step": plan.step,  # checkpoints of later steps were written during this fit (a restart's own)
        "record_sample_ids": record_sample_ids,
        "placement": placement,
        "latent_cache": latent_cache_root(job),
    }


def train_result(job: JobConfig, out: dict[str, Any], *, metrics: dict[str, Any] | None,
                 checkpoint_path: str | None) -> TrainResult:
    """The `TrainResult` of a run from rank 0's return value `out` (`Worker.run`), the metrics reported with the
    last checkpoint and that checkpoint's folder."""
    run_dir = run_dir_of(job)
    return TrainResult(
        run_dir=run_dir,
        checkpoint_path=checkpoint_path,
        diffusers_dir=out.get("diffusers_dir", f"{run_dir}/diffusers"),
        losses=out.get("losses", []),
        first_step=out.get("first_step", 0),
        last_step=out.get("last_step", 0),
        steps_per_s=out.get("steps_per_s", 0.0),
        metrics=metrics,
        reported_steps=out.get("reported_steps", []),
        trained_samples=out.get("trained_samples", []),
        skipped_shards=out.get("skipped_shards", []),
        skipped_clips=out.get("skipped_clips", []),
        placement=out.get("placement", []),
        experts=out.get("experts", {}),
        expert_losses=out.get("expert_losses", {}),
        step_seconds=out.get("step_seconds", []),
        checkpoint_blocked_s=out.get("checkpoint_blocked_s", []),
        first_step_done_unix=out.get("first_step_done_unix"),
        data=out.get("data", {}),
        peak_rss_bytes=out.get("peak_rss_bytes", 0),
        validation=out.get("validation", []),
        validation_wait_s=out.get("validation_wait_s", 0.0),
    )
