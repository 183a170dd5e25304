"""`train_loop_per_worker`: what every Ray Train worker runs.

Steps: 1. build the model family's transformer (alone: the VAE and text encoder run in the encode stages; LoRA
adapters applied when `model.lora` is set); 2. load the sample table (not the clips) and build the
world-size-independent sample schedule (`vidray.data.schedule`); 3. activation checkpointing, then DDP with its
communication hook or FSDP2 (`vidray.train.parallel.parallelize`), then the optimizer, lr schedule and precision;
4. restore the checkpoint the driver chose (or this fit's own latest after a restart) with its data position and
the hook's state, then re-apply this job's `optim` section to it; 5. plan this rank's steps from the data position
at this run's world size (every
rank the same bucket; G = `train.micro_batches_per_step` micro-batches per step, rank r training r, r+W, ... with
gradient accumulation; noise and sigma keyed by (seed, step, sample)) and stream them through the rank's Ray Data
loader (`vidray.data.pipeline`: cold -> warm -> hot, prefetched in schedule order, then the vae and text encode
stages of `vidray.data.encode` with the latent cache), which delivers latents and prompt_embeds; it trains on them,
reporting loss, gradient norm and step time every
`train.log_every_steps` and a checkpoint every `checkpoint.every_steps`; a NaN/Inf loss, gradient norm or weight
stops the run (checked at each report and before each checkpoint, with no extra host sync per step);
6. rank 0 saves the diffusers pipeline.

Errors that a retry cannot fix are raised as `vidray.errors.UserError`s: the driver's callback
(`vidray.train.trainer`) ends the run at the first one instead of letting Ray Train retry it.
"""

from __future__ import annotations

import json
import os
import resource
import sys
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import numpy as np
import ray.train
import ray.train.torch
import torch
import torch.distributed as dist

from vidray.config import job_config_from_dict
from vidray.errors import UserError
from vidray.locations import is_uri
from vidray.logs import quiet_ray_train_worker
from vidray.models.export import export_pipeline, write_job_file
from vidray.metrics import TrainMetrics
from vidray.data.cache import check_cache_budget
from vidray.data.index import dataset_hash, dataset_rows, load_sample_index
from vidray.data.pipeline import RankLoader, TrainBatch, encode_spec, iter_rank_steps
from vidray.data.schedule import DataPosition, SampleSchedule, job_schedule
from vidray.data.shards import GenerationLease, read_index
from vidray.data.storage import open_storage
from vidray.models.registry import Components, get_family
from vidray.train.checkpoint import (
    CheckpointManager,
    TrainState,
    checkpoint_dir_name,
    checkpoint_step,
    dataset_mismatch,
    save_checkpoint,
    PendingShardedCheckpoint,
    start_sharded_checkpoint,
)
from vidray.train.ema import EMA, copy_averages_to
from vidray.train.optim import apply_optim_config, build_lr_scheduler, build_optimizer
from vidray.train.parallel import (
    build_transformer,
    clip_grad_norm_,
    full_model_for_export,
    gradient_sync,
    is_sharded,
    parallelize,
)
from vidray.train.precision import Precision
from vidray.train.runlog import RunLog
from vidray.train.validation import start_validator, wait_for_validations
from vidray.train.vae import (
    VAE_EXPORT_DIR,
    VAEObjective,
    save_vae,
    unused_parameter_names,
    vae_micro_loss,
    vae_probe_loss,
)
from vidray.train.step import (
    NonFiniteTrainingError,
    check_finite_window,
    flow_matching_step_loss,
    non_finite_parameters,
    sample_generator,
)


def _log(rank: int, message: str) -> None:
    # sys.__stdout__: Ray Train's print patch tees plain prints to its logger too, which doubles every line.
    if rank == 0:
        print(f"[vidray] {message}", file=sys.__stdout__, flush=True)


def _resume_state(loop_config: dict[str, Any], rank: int, **targets: Any) -> TrainState | None:
    """Load the checkpoint this attempt starts from (precedence: `vidray.train.trainer` module docstring).

    A checkpoint written during this `fit()` (any step after the driver's start point `loop_config["start_step"]`,
    so on a restart after a worker or node failure) wins: the newer of Ray Train's `get_checkpoint()` and the run
    folder's latest complete checkpoint. The folder's can be newer: Ray registers a checkpoint only once every rank's
    report of it has reached the controller, so a node lost after rank 0 finished the copy (manifest last: complete
    means whole) but before that would otherwise send the run back a whole checkpoint interval. Rank 0's choice is
    broadcast, so every rank loads the same one. Otherwise the driver's planned `loop_config["resume_from"]` is
    loaded, or None is returned (step 1). `targets`: what `CheckpointManager.load` restores (transformer, optimizer,
    lr_scheduler, and ema / grad_scaler / comm_hook when the run has them). Every load is `CheckpointManager.load`: each part's sha256 is checked
    against the manifest after this worker's download and before loading (DamagedCheckpointError naming the part).
    """
    start_step = int(loop_config.get("start_step") or 0)
    ray_name = _ray_checkpoint_name()  # every rank's: it names the source in the log line below
    name = None
    if rank == 0:
        candidates = [c for c in (ray_name, CheckpointManager(loop_config["run_dir"]).latest())
                      if c is not None and checkpoint_step(c) > start_step]
        name = max(candidates, key=checkpoint_step, default=None)
    if dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1:
        chosen = [name]
        dist.broadcast_object_list(chosen, src=0)
        name = chosen[0]
    if name is not None:
        state = CheckpointManager(loop_config["run_dir"]).load(name, **targets)
        source = "Ray Train's latest" if name == ray_name else "the run folder's latest complete"
        _log(rank, f"restarted from this run's checkpoint {name} at step {state.step} ({source})")
        return state
    start = loop_config.get("resume_from")
    if start:
        # Hashed again after this worker's download, whatever the driver checked (a remote part can change since).
        parent, name = start.rstrip("/").rsplit("/", 1) if is_uri(start) else (Path(start).parent, Path(start).name)
        state = CheckpointManager(parent).load(name, **targets)
        _log(rank, f"started from checkpoint {start} at step {state.step}")
        return state
    return None


def _ray_checkpoint_name() -> str | None:
    """The folder name of Ray Train's latest registered checkpoint of this `fit()`, or None."""
    checkpoint = ray.train.get_checkpoint()
    return None if checkpoint is None else Path(checkpoint.path).name


def train_loop_per_worker(loop_config: dict[str, Any]) -> dict[str, Any]:
    """Ray Train entry point. `loop_config`: {"job": JobConfig.to_dict(), "run_dir": absolute path,
    "shards_dir": absolute path, "resume_from": checkpoint folder or None, "start_step": its step (0 if none)}.

    Optional key "record_sample_ids": True to return what was trained, and to append it, step by step, to
    `<run_dir>/trained_samples/<start ns>-rank<r>.jsonl` (`_record_path`: every attempt of an elastic or
    restarted run leaves its own files, which `Result.return_value` of the last attempt alone cannot show).

    Returns (rank 0's is kept in `Result.return_value`): {"losses": [[step, loss], ...] for every step this run
    trained, "first_step", "last_step", "steps_per_s", "diffusers_dir", "reported_steps": steps at which metrics
    were reported (every `train.log_every_steps`, every checkpoint, and the last step), "trained_samples":
    [[step, epoch, [sample_id, ...]], ...] the samples trained with weight > 0 at each step, on all ranks
    (gathered once at the end; only with "record_sample_ids", else []), "skipped_shards": [{file, reason}] of
    shards skipped because their checksum failed or the store kept failing (on any rank), "skipped_clips":
    [{sample_id, reason}] of clips that did not decode (any rank), "step_seconds": [[step, data_wait_s, encode_s,
    dit_s], ...] of this rank, "data": `TrainMetrics.summary()` of this rank (data wait, tier hits and misses,
    bytes fetched), "checkpoint_blocked_s": [[step, seconds the loop stood still for that checkpoint]],
    "first_step_done_unix": wall clock when this attempt's first step finished, "placement": per rank, the nodes
    (id, labels) its trainer and its decode operators ran on (`_gather_placement`), "peak_rss_bytes": this worker
    process's peak resident memory}.
    Optional key "placement": {stage: label selector} (`vidray.placement.resolve_placement`); "decode" places
    the decode operator.
    """
    quiet_ray_train_worker()  # Ray Train's per-report TrainingReport dump (vidray.logs)
    job = job_config_from_dict(loop_config["job"])
    context = ray.train.get_context()
    rank, world_size = context.get_world_rank(), context.get_world_size()
    device = ray.train.torch.get_device()
    if device.type == "cpu":
        torch.set_num_threads(max(1, int(os.environ.get("OMP_NUM_THREADS", "1"))))

    # 1. The trainable transformer alone: the frozen VAE and text encoder run in the encode stages (a pretrained
    # one on the meta device when sharded: `parallelize` then loads each rank's shards).
    family = get_family(job.model.family)
    vae_run = job.train.objective == "vae"  # `vidray train-vae`: `transformer` below is the VAE's objective module
    if vae_run:
        transformer = VAEObjective(family.build_trainable_vae(job.model, seed=job.train.seed), job.vae_training)
        transformer, pretrained_weights = transformer.to(device), None
    else:
        transformer, pretrained_weights = build_transformer(family, job, device)
    if job.model.lora is not None:  # before the probe, AC, DDP and the optimizer: only the adapters train
        from vidray.models.lora import apply_lora, lora_summary

        apply_lora(transformer, job.model.lora, seed=job.train.seed)
        counts = lora_summary(transformer)
        _log(rank, f"LoRA rank {job.model.lora.rank}: {counts['trainable']:,} of {counts['total']:,} parameters train")

    # 2. Data: the sample table and the schedule; the clips stay in the shards until the loader streams them.
    # Object-store shards come through this node's warm disk cache (one download per shard per node), whose
    # budget must hold the largest shard (checked here, before any step).
    shards_dir = loop_config["shards_dir"]
    index = read_index(shards_dir)
    lease = GenerationLease(shards_dir, index)  # a re-prepare keeps the generation this rank reads (until the end)
    table = load_sample_index(shards_dir)
    if not open_storage(shards_dir).is_local:
        check_cache_budget(job.data.cache_bytes, index, local_ranks=context.get_local_world_size())
    sample_ids = table.sample_id.astype(str)
    schedule = job_schedule(job, table, family)

    # Parameters that never get a gradient break DDP's reducer ('Expected to have finished reduction'):
    # freeze them once, found by a probe step.
    no_grad = set(unused_parameter_names(transformer) if vae_run else family.no_grad_parameter_names(transformer))
    for name, param in transformer.named_parameters():
        if name in no_grad:
            param.requires_grad_(False)
    transformer.train()

    # 3. Activation checkpointing, then DDP (gloo on CPU, NCCL on GPU) with its communication hook, or FSDP2
    # (`scaling.strategy`); then the optimizer (of the sharded parameters under FSDP), lr schedule and precision
    # (autocast, fp16's grad scaler).
    model, comm = parallelize(transformer, job,
                              example_loss=vae_probe_loss if vae_run else lambda m: family.probe_loss(m, transformer),
                              pretrained_weights=pretrained_weights, device=device)
    sharded = is_sharded(model)
    # The EMA of the trained parameters: rank 0's under DDP (the replicas are equal), every rank's shards under FSDP.
    ema = EMA(transformer, job.train.ema) if job.train.ema is not None and (rank == 0 or sharded) else None
    optimizer = build_optimizer(transformer.parameters(), job.optim)
    lr_scheduler = build_lr_scheduler(optimizer, job.optim)
    precision = Precision(job.train.mixed_precision, device, sharded=sharded)

    # 4. Resume (the DDP hook exists: it restores its rank's PowerSGD state, or says why it starts afresh).
    def restore_comm_hook(saved: dict[str, Any] | None) -> None:
        why = comm.load_state(saved, rank, world_size)
        if why:
            _log(rank, why)

    state = _resume_state(loop_config, rank, transformer=transformer, optimizer=optimizer, lr_scheduler=lr_scheduler,
                          ema=None if ema is None else ema.averaged, grad_scaler=precision.grad_scaler,
                          comm_hook=restore_comm_hook)
    start_step = 1 if state is None else state.step + 1
    if state is not None:
        # This job's optim section wins over the restored one (lr, betas, weight decay, eps, warmup schedule).
        lr_scheduler = apply_optim_config(optimizer, job.optim, step=state.step)
    if ema is not None and ema.num_updates == 0:
        ema.reset()  # an EMA added on resume (or not yet updated) starts from these weights
    index_hash = index.get("content_hash", "")
    data_rows = dataset_rows(shards_dir)
    data_hash = dataset_hash(data_rows)
    problem = None if state is None else dataset_mismatch(state, shards_dir, index, data_rows)
    if problem:
        raise UserError(f"the checkpoint {problem}")  # deterministic: never retried (see vidray.train.trainer)
    position = _resume_position(schedule, state, rank)
    # This rank's steps, streamed by its Ray Data loader (started now: its actor warms up while DDP is set up).
    steps = iter_rank_steps(schedule, position, world_size=world_size, rank=rank, first_step=start_step,
                            last_step=job.train.max_steps, micro_batches=job.micro_batches_per_step)  # lazily
    placement = loop_config.get("placement") or {}  # {stage: label selector}, resolved on the driver
    # A VAE run trains on the frames themselves: no encode stages.
    encode = None if vae_run else encode_spec(job, placement, latent_cache=loop_config.get("latent_cache", ""))
    if encode is not None and loop_config.get("identities"):  # {stage: [ObjectRef]} of the driver's identity tasks (vidray.train.trainer)
        encode["identities"] = loop_config["identities"]
    loader = RankLoader(shards_dir, index, table, steps, job.data, sample_ids=sample_ids,
                        local_ranks=context.get_local_world_size(), label_selector=placement.get("decode"),
                        encode=encode)
    runtime = ray.get_runtime_context()
    trainer_node = {"node_id": runtime.get_node_id(), "labels": runtime.get_node_labels()}
    loader_nodes: dict[str, dict[str, Any]] = {}  # node_id -> {"node_id", "labels"} of this rank's decode operators
    stage_nodes: dict[str, dict[str, dict[str, Any]]] = {"vae": {}, "text": {}}  # the same, of its encode actors

    # 5. The loop.
    max_steps = job.train.max_steps
    sizes = ", ".join(f"{b} x{n}" for b, n in zip(schedule.buckets, schedule.batch_sizes.tolist()))
    _log(rank, f"training steps {start_step}..{max_steps} from epoch {position.epoch}, batch "
         f"{position.batches_consumed}/{schedule.batches_per_epoch} "
         f"({schedule.steps_per_epoch(world_size, job.micro_batches_per_step)} steps/epoch of "
         f"{job.micro_batches_per_step} micro-batches at {world_size} workers; batch sizes {sizes})")
    _log(rank, f"global batch {job.global_batch_size} samples per step (data.batch_size_per_worker "
         f"{job.data.batch_size_per_worker} x {job.micro_batches_per_step} micro-batches: "
         f"{job.scaling.max_workers} workers x {job.micro_batches_per_step // job.scaling.max_workers} accumulated); "
         f"precision {job.train.mixed_precision}, activation checkpointing {job.train.activation_checkpointing}, "
         f"gradient compression {job.train.grad_compression}" + (f", EMA decay {job.train.ema.decay}" if ema else ""))
    record = bool(loop_config.get("record_sample_ids"))
    trained: list[list[Any]] = []  # [step, epoch, [sample_id, ...]] of this rank, when recording
    step_losses: list[torch.Tensor] = []
    step_grad_norms: list[torch.Tensor] = []  # (,) global L2 norm before clipping; 0 when clipping is off
    step_lrs: list[float] = []
    history: list[list[float]] = []
    reported_steps: list[int] = []
    step_seconds: list[list[float]] = []  # [step, data_wait_s, encode_s, dit_s] of this rank
    checkpoint_blocked_s: list[list[float]] = []  # [step, seconds the loop stood still for its checkpoint]
    checkpoints = CheckpointManager(loop_config["run_dir"])
    mode = (ray.train.CheckpointUploadMode.ASYNC if job.checkpoint.upload == "async"
            else ray.train.CheckpointUploadMode.SYNC)
    # A sharded checkpoint with checkpoint.upload=async is written beside the training (dcp.async_save): its
    # collectives go over a gloo group of their own, and one thread per rank hashes the files once written.
    checkpoint_group = checkpoint_writer = None
    if sharded and job.checkpoint.upload == "async":
        checkpoint_group = dist.new_group(backend="gloo")
        checkpoint_writer = ThreadPoolExecutor(max_workers=1, thread_name_prefix="vidray-checkpoint")
    pending: tuple[PendingShardedCheckpoint, dict, float] | None = None
    """(the sharded checkpoint being written, its step's metrics, seconds its start held the step)"""

    def written_everywhere(started: PendingShardedCheckpoint) -> bool:
        """Whether every rank's write and hashing of `started` are done (a collective over the training's group:
        every rank gets the same answer, so all finish it at the same report)."""
        done = torch.tensor([1.0 if started.done() else 0.0], device=device)
        if world_size > 1:
            dist.all_reduce(done, op=dist.ReduceOp.MIN)
        return bool(done.item())

    def report_sharded(entry: tuple[PendingShardedCheckpoint, dict, float]) -> None:
        """Finish a sharded checkpoint (a collective: every rank, same point) and report it with its step's
        metrics; every rank reports its own folder (`CheckpointManager.ray_shard_upload_fn`)."""
        started, step_metrics, started_s = entry
        t_wait = time.perf_counter()
        snapshot = started.finish()
        ray.train.report(step_metrics, checkpoint=ray.train.Checkpoint.from_directory(str(snapshot)),
                         checkpoint_dir_name=checkpoint_dir_name(started.step), checkpoint_upload_mode=mode,
                         delete_local_checkpoint_after_upload=True,
                         checkpoint_upload_fn=checkpoints.ray_shard_upload_fn())
        checkpoint_blocked_s.append([started.step, started_s + time.perf_counter() - t_wait])
        if validator is not None and started.step % validate_every == 0:
            validations.append(validator.validate.remote(started.step))
    skipped: list[dict[str, str]] = []
    metrics_log = TrainMetrics(rank=rank, run=job.name, export_to_ray=job.train.ray_metrics)
    # The textfile needs a local folder: the run folder's, or for a run folder on object storage this node's temp
    # folder (the Prometheus endpoint of `train.metrics_port` serves the same figures either way).
    metrics_root = (Path(tempfile.gettempdir()) / "vidray-metrics" / job.name if is_uri(loop_config["run_dir"])
                    else Path(loop_config["run_dir"]) / "metrics")
    metrics_file = metrics_root / f"rank_{rank}.prom"
    if job.train.metrics_port is not None:
        metrics_log.serve(job.train.metrics_port + rank)
    run_log = RunLog(loop_config["run_dir"], start_step=start_step, title=job.name) if rank == 0 else None
    validate_every = job.train.validation.every_steps
    validator = start_validator(loop_config["run_dir"], job) if rank == 0 and validate_every else None
    validations: list[Any] = []  # refs of the validations handed to the validator (vidray.train.validation)
    window_start, window_steps = time.perf_counter(), 0
    run_start = time.perf_counter()
    first_step_done_unix: float | None = None  # wall clock (time.time()) when this attempt's first step finished
    batches = iter(loader)
    record_path = _record_path(loop_config, rank) if record else None
    try:
        for step in range(start_step, max_steps + 1):
            # This rank's micro-batches of the step (slots rank, rank + W, ... of its G: `vidray.data.schedule`), with
            # gradient accumulation: DDP all-reduces on the last backward only (no_sync on the others).
            optimizer.zero_grad(set_to_none=True)
            loss = None  # (,) sum of this rank's micro-batch losses
            data_wait_s = encode_s = dit_s = 0.0
            step_clips = 0
            step_ids: list[str] = []
            micro, num_micro = 0, 1
            while micro < num_micro:
                batch = next(batches, None)
                if batch is None or batch.step != step or batch.micro != micro:
                    got = "nothing" if batch is None else f"step {batch.step} micro-batch {batch.micro}"
                    raise RuntimeError(f"the loader delivered {got} where step {step} micro-batch {micro} was due")
                num_micro = batch.num_micro
                t_data = time.perf_counter()
                _add_loader_stats(metrics_log, batch)
                skipped.extend(batch.skipped)
                if batch.loader_node:
                    loader_nodes.setdefault(batch.loader_node["node_id"], batch.loader_node)
                for stage, node in batch.stage_nodes.items():
                    if node:
                        stage_nodes[stage].setdefault(node["node_id"], node)
                weights = batch.weights
                # sum_i w_i mse_i * W / total weight (of all G micro-batches): summed over this rank's micro-batches
                # and averaged over the W ranks by DDP, the gradient is the mean over the step's real samples.
                loss_weights = torch.from_numpy(weights) * (world_size / batch.total_weight)
                last = micro == num_micro - 1
                with gradient_sync(model, last):  # DDP's no_sync / FSDP's set_requires_gradient_sync
                    generators = [sample_generator(job.train.seed, step, int(k)) for k in batch.sample_keys.tolist()]
                    with precision.autocast():
                        if vae_run:  # the clips' frames, uint8 (B, 3, F, H, W), straight from the loader
                            micro_loss = vae_micro_loss(model, batch.frames.to(device), generators, loss_weights)
                        else:  # latents and prompt_embeds from the encode stages (encoded there or cached)
                            micro_loss = flow_matching_step_loss(
                                family, model, batch.latents.to(device), batch.prompt_embeds.to(device),
                                batch.prompt_attention_mask.to(device), job.flow, generators, loss_weights=loss_weights)
                    precision.backward(micro_loss)
                loss = micro_loss.detach() if loss is None else loss + micro_loss.detach()
                if record:
                    ids = [i for i, w in zip(batch.sample_ids, weights) if w > 0]
                    trained.append([step, batch.epoch, ids])
                    step_ids.extend(ids)
                data_wait_s += batch.data_wait_s
                step_clips += len(batch.sample_ids)  # batch slots the DiT trained (padding and repeats included)
                encode_s += batch.stats.get("vae_s", 0.0) + batch.stats.get("text_s", 0.0)  # in the stages, overlapped
                dit_s += time.perf_counter() - t_data
                micro += 1
            t_optim = time.perf_counter()
            step_epoch, position = batch.epoch, batch.next_position
            if record_path is not None:
                _append_record(record_path, [step, step_epoch, world_size, rank, step_ids])
            precision.unscale_(optimizer)  # fp16: clip and measure true gradients
            if job.train.grad_clip_norm is not None:
                grad_norm = clip_grad_norm_(model, job.train.grad_clip_norm)  # global, under FSDP too
            else:
                grad_norm = torch.zeros((), device=loss.device)
            step_lrs.append(lr_scheduler.get_last_lr()[0])  # the lr this step uses (a host float: no sync)
            precision.step(optimizer)
            lr_scheduler.step()
            if ema is not None:
                ema.maybe_update(step)
            step_losses.append(loss)
            step_grad_norms.append(grad_norm.detach().float())
            window_steps += 1
            if first_step_done_unix is None:
                first_step_done_unix = time.time()
            dit_s += time.perf_counter() - t_optim
            step_seconds.append([step, data_wait_s, encode_s, dit_s])
            metrics_log.observe_step(data_wait_s=data_wait_s, step_s=data_wait_s + dit_s, samples=step_clips)
            metrics_log.add_stage("dit", busy_s=dit_s, clips=step_clips)
            metrics_log.set_step(step)

            is_log = step % job.train.log_every_steps == 0 or step == max_steps
            is_checkpoint = step % job.checkpoint.every_steps == 0 or step == max_steps
            if not (is_log or is_checkpoint):
                continue
            # Host sync only here: mean loss and gradient norm over ranks for each step of the window. A NaN/Inf on
            # any rank reaches every rank through the mean, so all ranks stop at the same step, before any
            # checkpoint of a diverged model is written (and good ones rotated away).
            window = torch.stack([torch.stack(step_losses), torch.stack(step_grad_norms)])  # (2, steps)
            if world_size > 1:
                dist.all_reduce(window, op=dist.ReduceOp.AVG)
            window_losses, window_grad_norms = window.tolist()
            first_window_step = step - len(window_losses) + 1
            check_finite_window(first_window_step, window_losses, window_grad_norms, step_lrs,
                                check_grad_norms=not precision.skips_non_finite_steps)
            if is_checkpoint:
                bad = non_finite_parameters(transformer)
                if bad:
                    raise NonFiniteTrainingError(
                        f"training diverged: {len(bad)} weight tensor(s) hold NaN/Inf at step {step} (e.g. {bad[0]}; "
                        f"lr {step_lrs[-1]:.3g}); no checkpoint was written. Lower optim.lr or set "
                        "train.grad_clip_norm, then resume from the last checkpoint",
                        step, step_lrs[-1],
                    )
            history.extend([first_window_step + i, v] for i, v in enumerate(window_losses))
            window_lrs = list(step_lrs)
            step_losses.clear()
            step_grad_norms.clear()
            step_lrs.clear()
            step_time_s = (time.perf_counter() - window_start) / window_steps
            metrics = {
                "step": step,
                "epoch": step_epoch,
                "loss": float(np.mean(window_losses)),
                "step_time_s": step_time_s,
                "lr": lr_scheduler.get_last_lr()[0],
                "grad_norm": float(np.mean(window_grad_norms)),
            }
            data = metrics_log.window_summary()
            metrics["data_wait_fraction"] = data["data_wait_fraction"]
            metrics_log.observe_window(loss=metrics["loss"], lr=metrics["lr"],
                                       data_wait_fraction=min(1.0, data["data_wait_fraction"]))
            window_split = np.asarray(step_seconds[-len(window_losses):])[:, 1:].mean(axis=0)  # data, encode, dit
            metrics["encode_time_s"], metrics["dit_step_time_s"] = float(window_split[1]), float(window_split[2])
            for stage in ("decode", "vae", "text", "dit"):
                metrics[f"{stage}_busy_fraction"] = data[f"{stage}_busy_fraction"]
            busy = " ".join(f"{stage} {100 * data[f'{stage}_busy_fraction']:.0f}%" for stage in ("decode", "vae", "text", "dit"))
            # Per step (means over the window): step_time, encode, dit, data_wait. Counts (over the window): hot-tier
            # hits/lookups, warm-tier hits/shard opens, clips decoded, latents reused (latent cache or the encode
            # stage's memory) / needed, MiB fetched from the shard store.
            _log(rank, f"step {step}/{max_steps} loss {metrics['loss']:.4f} step_time {step_time_s:.3f} s "
                 f"(encode {window_split[1]:.3f} s, {'vae' if vae_run else 'dit'} {window_split[2]:.3f} s) lr {metrics['lr']:.2e} data_wait "
                 f"{window_split[0]:.3f} s ({100 * data['data_wait_fraction']:.0f}%) "
                 f"busy [{busy}] hot {data['hot_hits']:.0f}/{data['hot_hits'] + data['hot_misses']:.0f} warm "
                 f"{data['warm_hits']:.0f}/{data['warm_hits'] + data['warm_misses']:.0f} decoded "
                 f"{data['decode_clips']:.0f} latents reused {data['latent_hits']:.0f}/"
                 f"{data['latent_hits'] + data['latent_misses']:.0f} fetched "
                 f"{data['bytes_fetched'] / 2**20:.1f} MiB lead {batch.prefetch_lead}")
            metrics_log.write_textfile(metrics_file)
            if run_log is not None:
                run_log.log_window(first_window_step, window_losses, window_grad_norms, window_lrs, metrics,
                                   samples_per_step=job.global_batch_size)
                if is_checkpoint:
                    run_log.flush()  # TensorBoard events, metrics.jsonl and loss.png in the run folder
            reported_steps.append(step)
            if pending is not None and (is_checkpoint or written_everywhere(pending[0])):
                report_sharded(pending)  # the previous sharded checkpoint, written meanwhile: finished, reported first
                pending = None
            if is_checkpoint:
                # Rank 0 snapshots the parts into a local temp folder (the step waits only for this with
                # checkpoint.upload=async); Ray Train copies it to the run folder with the manager's upload (manifest
                # last, retried), in the background when asynchronous, and deletes the temp folder afterwards.
                t_snapshot = time.perf_counter()
                train_state = TrainState(step, position.epoch, position.batches_consumed, world_size, index_hash,
                                         position.to_dict(schedule.buckets), data_hash, len(table))
                if sharded:
                    # Every rank writes its shards (DCP) into its own temp folder and reports it; rank 0's upload
                    # writes the manifest only once every rank's files are in the run folder (manifest last). With
                    # checkpoint.upload=async the write runs beside the next steps, and the checkpoint is reported
                    # (with this step's metrics) at the next report, or at the end of the run.
                    if rank == 0:
                        checkpoints.clear_for_sharded_write(checkpoint_dir_name(step))  # an interrupted earlier write
                    if world_size > 1:
                        dist.barrier()
                    started = start_sharded_checkpoint(
                        tempfile.mkdtemp(prefix="vidray-ckpt-"), model=transformer, optimizer=optimizer,
                        lr_scheduler=lr_scheduler, train_state=train_state, job_config=job.to_dict(), rank=rank,
                        world_size=world_size, dataset=data_rows, ema=None if ema is None else ema.averaged,
                        grad_scaler=precision.grad_scaler, process_group=checkpoint_group, executor=checkpoint_writer)
                    pending = (started, metrics, time.perf_counter() - t_snapshot)
                    if checkpoint_group is None:
                        report_sharded(pending)
                        pending = None
                    window_start, window_steps = time.perf_counter(), 0
                    continue
                checkpoint, upload_fn = None, checkpoints.ray_upload_fn()
                hook_state = comm.gather_state(rank, world_size)  # every rank's PowerSGD state (a collective)
                if rank == 0:
                    snapshot = save_checkpoint(
                        tempfile.mkdtemp(prefix="vidray-ckpt-"),
                        model=transformer,
                        optimizer=optimizer,
                        lr_scheduler=lr_scheduler,
                        train_state=train_state,
                        job_config=job.to_dict(),
                        dataset=data_rows,
                        ema=None if ema is None else ema.averaged,
                        grad_scaler=precision.grad_scaler,
                        comm_hook_state=hook_state,
                    )
                    checkpoint = ray.train.Checkpoint.from_directory(str(snapshot))
                ray.train.report(metrics, checkpoint=checkpoint, checkpoint_dir_name=checkpoint_dir_name(step),
                                 checkpoint_upload_mode=mode, delete_local_checkpoint_after_upload=True,
                                 checkpoint_upload_fn=upload_fn)
                checkpoint_blocked_s.append([step, time.perf_counter() - t_snapshot])
                if validator is not None and step % validate_every == 0:
                    validations.append(validator.validate.remote(step))  # it waits for the copy; training goes on
            else:
                # Asynchronous mode for plain reports too: a synchronous report would wait for the copy in flight.
                ray.train.report(metrics, checkpoint_upload_mode=mode)
            window_start, window_steps = time.perf_counter(), 0
        if pending is not None:  # the last step's sharded checkpoint
            report_sharded(pending)
            pending = None
    finally:  # the sharded checkpoints' writer and group, however the loop ended
        _close_checkpoint_writer(checkpoint_writer, checkpoint_group)
    loader.close()
    lease.release()
    if run_log is not None:
        run_log.close()
    metrics_log.write_textfile(metrics_file)
    metrics_log.close()
    num_trained = max(0, max_steps - start_step + 1)
    steps_per_s = num_trained / (time.perf_counter() - run_start) if num_trained else 0.0
    trained_samples = _gather_trained(trained, world_size) if record else []
    skipped = _agree_on_skipped(skipped, world_size)
    nodes = _gather_placement({"rank": rank, "trainer": trainer_node, "loaders": list(loader_nodes.values()),
                               **{stage: list(found.values()) for stage, found in stage_nodes.items()}},
                              world_size)
    skipped_shards = [s for s in skipped if "file" in s]
    skipped_clips = [s for s in skipped if "sample_id" in s]
    if skipped:
        _log(rank, f"skipped {len(skipped_shards)} shard(s) and {len(skipped_clips)} clip(s) that could not be read")

    # 6. Rank 0 saves the trained pipeline in diffusers format (safetensors) with the job file (`_export_pipeline`),
    # or a VAE run's VAE (`vidray.train.vae.save_vae`).
    run_dir = str(loop_config["run_dir"])
    # A sharded model's full weights are gathered to rank 0 first (a collective: every rank takes part).
    trained_full = full_model_for_export(model, transformer, lambda: _build_unsharded(family, job), rank)
    # export.weights: ema: the averages, gathered from every rank's shards under FSDP (a collective).
    ema_weights = ema.full_averages() if ema is not None and job.export.weights == "ema" else None
    if vae_run:  # the trained VAE as a diffusers folder, what a DiT job's model.vae_path names
        diffusers_dir = f"{run_dir.rstrip('/')}/{VAE_EXPORT_DIR}"
        if rank == 0:
            save_vae(trained_full.vae.eval(), diffusers_dir)
            _log(rank, f"saved the trained VAE to {diffusers_dir} (use it with model.vae_path={diffusers_dir})")
    else:
        diffusers_dir = _export_pipeline(family, trained_full, job, ema_weights, run_dir) if rank == 0 else \
            f"{run_dir.rstrip('/')}/diffusers"
    validated, validation_wait_s, validation_problems = wait_for_validations(validations)  # after the export
    if validations:
        steps = ", ".join(str(v["step"]) for v in validated) or "none"
        took = ", ".join(f"{v['seconds']:.1f}" for v in validated)
        _log(rank, f"validation samples at steps {steps} in {loop_config['run_dir']}/validation (each took "
                   f"{took} s beside the training; the end of the run waited {validation_wait_s:.1f} s for them)")
        for problem in validation_problems:
            _log(rank, f"warning: a validation did not complete: {problem}")
    return {
        "validation": validated,
        "validation_wait_s": validation_wait_s,
        "losses": history,
        "first_step": start_step,
        "last_step": max_steps,
        "steps_per_s": steps_per_s,
        "diffusers_dir": diffusers_dir,
        "reported_steps": reported_steps,
        "trained_samples": trained_samples,
        "skipped_shards": skipped_shards,
        "skipped_clips": skipped_clips,
        "placement": nodes,
        "step_seconds": step_seconds,
        "checkpoint_blocked_s": checkpoint_blocked_s,
        "first_step_done_unix": first_step_done_unix,
        "data": metrics_log.summary(),
        "peak_rss_bytes": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024,  # Linux: KiB
    }


def _build_unsharded(family: Any, job: Any) -> torch.nn.Module:
    """A fresh, unsharded transformer of the job's model (with its LoRA adapters when `model.lora` is set): what
    the full weights gathered from a sharded run load into for the export."""
    transformer = family.build_transformer(job.model, seed=job.train.seed)
    if job.model.lora is not None:
        from vidray.models.lora import apply_lora

        apply_lora(transformer, job.model.lora, seed=job.train.seed)
    return transformer


def _export_pipeline(family: Any, trained_full: torch.nn.Module, job: Any, ema_weights: dict[str, torch.Tensor] | None,
                     run_dir: str) -> str:
    """Rank 0's diffusers export of the trained DiT with the job's VAE and text encoder (and the job file) into
    `<run_dir>/diffusers`; returns that folder. `ema_weights` ({parameter name: full average}, with
    `export.weights: ema`) replace the trained weights of those names. A local run folder is written directly; for
    a URI a local temp folder is uploaded with model_index.json last (`upload_dir`: a half-uploaded export never
    looks like a model; the whole upload is retried, then the worker fails with a StorageTransferError naming the
    URI, and Ray Train's restart exports again from the last checkpoint)."""
    remote = is_uri(run_dir)
    diffusers_dir = f"{run_dir.rstrip('/')}/diffusers" if remote else str(Path(run_dir) / "diffusers")
    trained_full.eval()
    encoders = family.build_encoders(job.model, seed=job.train.seed)  # the export's VAE and text encoder
    if ema_weights is not None:
        copy_averages_to(trained_full, ema_weights)  # training is over: the export holds the averages
    components = Components(transformer=trained_full, vae=encoders.vae, text_encoder=encoders.text_encoder,
                            tokenizer=encoders.tokenizer)
    if remote:
        from vidray.data.storage import upload_dir
        from vidray.models.export import MODEL_INDEX

        with tempfile.TemporaryDirectory(prefix="vidray-export-") as tmp:
            export_pipeline(family, components, tmp, job.flow)
            write_job_file(tmp, job)
            num_bytes = upload_dir(tmp, diffusers_dir, marker=MODEL_INDEX)
        _log(0, f"saved diffusers pipeline to {diffusers_dir} ({num_bytes / 2**20:.1f} MiB uploaded)")
    else:
        export_pipeline(family, components, diffusers_dir, job.flow)
        write_job_file(diffusers_dir, job)
        _log(0, f"saved diffusers pipeline to {diffusers_dir}")
    return diffusers_dir


def _close_checkpoint_writer(writer: ThreadPoolExecutor | None, group: Any) -> None:
    """End the asynchronous sharded checkpoints' thread and gloo group (`checkpoint.upload: async`). After a
    normal end nothing is in flight (the last checkpoint was finished): the thread ends and the group is destroyed.
    When the loop raised, a write may still be running: the thread is left to finish or fail on its own (waiting
    could hang on a lost peer) and the group to the process's end."""
    if writer is None:
        return
    failed = sys.exc_info()[0] is not None  # called from a `finally`: the exception it is unwinding, if any
    writer.shutdown(wait=not failed, cancel_futures=failed)
    if not failed and group is not None:
        dist.destroy_process_group(group)


def _resume_position(schedule: SampleSchedule, state: TrainState | None, rank: int) -> DataPosition:
    """The data position the first step of this attempt starts from: the checkpoint's, read back (any world
    size continues it), or the start of epoch 0. Checkpoints of vidray before the world-size-independent
    schedule (no per-bucket counts) start the epoch after theirs, with a log line. Raises UserError when the
    saved position does not fit the schedule (other buckets or batch sizes)."""
    if state is None:
        return schedule.start(0)
    if state.consumed_per_bucket is None:
        _log(rank, f"checkpoint of step {state.step} has no per-bucket data position (older vidray): "
             f"continuing at the start of epoch {state.epoch + 1}")
        return schedule.start(state.epoch + 1)
    try:
        return schedule.position_from_dict(state.epoch, state.consumed_per_bucket)
    except ValueError as err:
        raise UserError(f"the checkpoint's data position cannot continue on these shards: {err}; "
                        "use the original shards, data.buckets and batch sizes") from None


def _gather_placement(mine: dict[str, Any], world_size: int) -> list[dict[str, Any]]:
    """Every rank's {"rank", "trainer": {"node_id", "labels"}, "loaders": [{"node_id", "labels"}, ...], "vae": [...],
    "text": [...]} (the nodes its DiT worker, its decode operators and its encode actors ran on), by rank (one
    collective, at the end)."""
    parts = [mine]
    if world_size > 1 and dist.is_available() and dist.is_initialized():
        parts = [None] * world_size
        dist.all_gather_object(parts, mine)
    return sorted(parts, key=lambda p: p["rank"])


def _agree_on_skipped(skipped: list[dict[str, str]], world_size: int) -> list[dict[str, str]]:
    """What any rank skipped (one collective, at the end): shards ({file, reason}) and clips ({sample_id,
    reason}), each once, sorted."""
    parts = [skipped]
    if world_size > 1 and dist.is_available() and dist.is_initialized():
        parts = [None] * world_size
        dist.all_gather_object(parts, skipped)
    merged = {s.get("file") or s["sample_id"]: s for part in parts for s in part}
    return [merged[k] for k in sorted(merged)]


def _add_loader_stats(metrics: TrainMetrics, batch: TrainBatch) -> None:
    """Feed one micro-batch's loader counters (`vidray.data.pipeline.STAT_KEYS`) into the metrics."""
    s = batch.stats
    metrics.add_cache("hot", hits=int(s["hot_hits"]), misses=int(s["hot_misses"]))
    metrics.add_cache("warm", hits=int(s["warm_hits"]), misses=int(s["warm_misses"]))
    metrics.add_bytes_fetched(int(s["bytes_fetched"]))
    for item in batch.skipped:
        metrics.add_skipped("shard" if "file" in item else "clip")
    metrics.set_prefetch_lead(batch.prefetch_lead)
    decoded = int(s["hot_misses"]) - int(s.get("decodes_skipped", 0))  # a miss whose latents were cached: no decode
    metrics.add_stage("decode", busy_s=float(s["decode_s"] + s["fetch_s"]), clips=decoded)
    for stage, tier in (("vae", "latent"), ("text", "prompt")):
        if f"{stage}_s" in s:
            hits, misses = int(s[f"{stage}_hits"]), int(s[f"{stage}_misses"])
            metrics.add_cache(tier, hits=hits, misses=misses)
            metrics.add_stage(stage, busy_s=float(s[f"{stage}_s"]), clips=hits + misses)


def _record_path(loop_config: dict[str, Any], rank: int) -> Path | None:
    """`<run_dir>/trained_samples/<start ns>-rank<rank>.jsonl`: where this attempt's rank appends what it trained
    (with "record_sample_ids"; local run folders only, else None). One file per rank per attempt, so that the
    steps re-trained after a restart can be told apart: the record of a step that counts is the latest
    attempt's."""
    run_dir = str(loop_config["run_dir"])
    if is_uri(run_dir):
        return None
    path = Path(run_dir) / "trained_samples" / f"{time.time_ns()}-rank{rank}.jsonl"
    path.parent.mkdir(parents=True, exist_ok=True)
    return path


def _append_record(path: Path, record: list[Any]) -> None:
    """Append one line `[step, epoch, world_size, rank, [sample_id, ...]]` (weight > 0 only)."""
    with open(path, "a") as f:
        f.write(json.dumps(record) + "\n")


def _gather_trained(trained: list[list[Any]], world_size: int) -> list[list[Any]]:
    """Merge every rank's [step, epoch, sample_ids] records into one per step (one collective, at the end)."""
    parts = [trained]
    if world_size > 1:
        parts = [None] * world_size
        dist.all_gather_object(parts, trained)
    merged: dict[int, list[Any]] = {}
    for part in parts:
        for step, epoch, ids in part:
            merged.setdefault(step, [step, epoch, []])[2].extend(ids)
    return [merged[s] for s in sorted(merged)]
