"""The `Worker`: one rank's training, what every Ray Train worker runs (`train_loop_per_worker`, a thin adapter
with a `RayTrainContext`) and what `vidray.train.local.train_in_process` runs in this process (a `LocalContext`):
everything it needs of where it runs comes through that context (`vidray.train.context`).

Steps (the `Worker`'s methods), in the order they run: 1. load the sample table (not the clips) and build the
world-size-independent sample schedule (`vidray.data.schedule`); 2. choose the checkpoint this attempt starts from
(the driver's, or this fit's own latest after a restart) and read its step and data position alone; 3. plan this
rank's steps from that position at this run's world size (every rank the same bucket; G =
`train.micro_batches_per_step` micro-batches per step, rank r training r, r+W, ... with gradient accumulation;
noise and sigma keyed by (seed, step, sample)) and start streaming them through the rank's Ray Data loader
(`vidray.data.pipeline`: cold -> warm -> hot, prefetched in schedule order, then the vae and text encode stages of
`vidray.data.encode` with the latent cache), which decodes its first batches while 4. the model family's
transformer is built (alone: the VAE and text encoder run in the encode stages; LoRA adapters applied when
`model.lora` is set), 5. activation checkpointing, then DDP with its communication hook or FSDP2
(`vidray.train.parallel.parallelize`), then the EMA, optimizer, lr schedule and precision, and 6. the checkpoint's
weights, optimizer and hook state are restored and this job's `optim` section re-applied to them. Then
`Worker.train_step` trains on the loader's latents and prompt_embeds, and every `train.log_every_steps`
the log window (`vidray.train.window`) reports loss, gradient norm and step time, with a checkpoint every
`checkpoint.every_steps`; a NaN/Inf loss, gradient norm or weight stops the run (checked at each report and before
each checkpoint, with no extra host sync per step); at the end rank 0 saves the diffusers pipeline.

Errors that a retry cannot fix are raised as `vidray.errors.UserError`s: the driver's callback
(`vidray.train.trainer`) ends the run at the first one instead of letting Ray Train retry it.
"""

from __future__ import annotations

import contextlib
import json
import os
import resource
import sys
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from vidray.config import job_config_from_dict
from vidray.errors import UserError
from vidray.locations import is_uri
from vidray.logs import quiet_ray_train_worker
from vidray.models.export import (
    BASE_REF,
    MODEL_INDEX,
    export_adapters,
    export_pipeline,
    lora_export_base,
    write_job_file,
)
from vidray.models.lora import (
    adapter_key,
    adapter_state_dict,
    apply_lora,
    is_adapter_parameter,
    load_adapter_state_dict,
    lora_summary,
)
from vidray.models.storage import apply_storage_dtype, module_storage_bytes, storage_dtype_name
from vidray.private_dirs import private_dir
from vidray.metrics import TrainMetrics
from vidray.data.cache import check_cache_budget
from vidray.data.index import dataset_hash, dataset_rows, load_sample_index
from vidray.data.pipeline import TrainBatch, encode_spec, iter_rank_steps
from vidray.data.schedule import DataPosition, SampleSchedule, job_schedule
from vidray.data.shards import GenerationLease, read_index
from vidray.storage import open_storage, upload_dir
from vidray.models.context_parallel import check_context_group_in_node
from vidray.models.experts import ExpertSlot
from vidray.models.registry import Components, get_family
from vidray.train.block_swap import apply_block_swap
from vidray.train.context import RayTrainContext, WorkerContext
from vidray.train.checkpoint import (
    CheckpointError,
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
from vidray.train.expert_groups import ExpertGroups, form_expert_groups, full_expert_state, gather_experts_to_rank0
from vidray.train.optim import apply_optim_config, build_lr_scheduler, build_optimizer
from vidray.train.parallel import (
    FROZEN_BASE_PLACED,
    build_transformer,
    clip_grad_norm_,
    full_model_for_export,
    gradient_sync,
    is_sharded,
    parallelize,
)
from vidray.train.precision import Precision
from vidray.train.runlog import RunLog
from vidray.train.window import LogWindow, compute_stage, step_line
from vidray.train.vae import (
    VAE_EXPORT_DIR,
    VAEObjective,
    save_vae,
    unused_parameter_names,
    vae_micro_loss,
    vae_probe_loss,
)
from vidray.train.step import (
    ActivationOffload,
    NonFiniteTrainingError,
    flow_matching_step_loss,
    non_finite_parameters,
    sample_generator,
)


def _log(rank: int, message: str) -> None:
    # sys.__stdout__: Ray Train's print patch tees plain prints to its logger too, which doubles every line.
    if rank == 0:
        print(f"[vidray] {message}", file=sys.__stdout__, flush=True)


def _choose_start(loop_config: dict[str, Any], rank: int, restart_name: str | None
                  ) -> tuple[CheckpointManager, str, str] | None:
    """The checkpoint this attempt starts from, as (the manager of its folder, its name, the log line saying how it
    was chosen, with `{step}` for its step), or None (step 1). Every rank gets the same answer.

    A checkpoint written during this `fit()` (any step after the driver's start point `loop_config["start_step"]`,
    so on a restart after a worker or node failure) wins: the newer of `restart_name` (Ray Train's `get_checkpoint()`,
    `WorkerContext.restart_checkpoint`; None in process) and the run folder's latest complete checkpoint. The
    folder's can be newer: Ray registers a checkpoint only once every rank's report of it has reached the
    controller, so a node lost after rank 0 finished the copy (manifest last: complete means whole) but before that
    would otherwise send the run back a whole checkpoint interval. Rank 0's choice is broadcast, so every rank loads
    the same one. Otherwise the driver's planned `loop_config["resume_from"]`, or None.
    """
    start_step = int(loop_config.get("start_step") or 0)
    name = None  # restart_name is every rank's (`WorkerContext.restart_checkpoint`): it names the source below
    if rank == 0:
        candidates = [c for c in (restart_name, CheckpointManager(loop_config["run_dir"]).latest())
                      if c is not None and checkpoint_step(c) > start_step]
        name = max(candidates, key=checkpoint_step, default=None)
    if dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1:
        chosen = [name]
        dist.broadcast_object_list(chosen, src=0)
        name = chosen[0]
    if name is not None:
        source = "Ray Train's latest" if name == restart_name else "the run folder's latest complete"
        how = f"restarted from this run's checkpoint {name} at step {{step}} ({source})"
        return CheckpointManager(loop_config["run_dir"]), name, how
    start = loop_config.get("resume_from")
    if start:
        parent, name = start.rstrip("/").rsplit("/", 1) if is_uri(start) else (Path(start).parent, Path(start).name)
        return CheckpointManager(parent), name, f"started from checkpoint {start} at step {{step}}"
    return None


def _resume_state(loop_config: dict[str, Any], rank: int, restart_name: str | None, **targets: Any
                  ) -> TrainState | None:
    """Load the checkpoint this attempt starts from (`_choose_start`; precedence: `vidray.train.trainer` module
    docstring) into `targets` (what `CheckpointManager.load` restores: transformer, optimizer, lr_scheduler, and
    ema / grad_scaler / comm_hook when the run has them) and return its TrainState, or None (step 1). Every load is
    `CheckpointManager.load`: each part's sha256 is checked against the manifest after this worker's download and
    before loading (DamagedCheckpointError naming the part)."""
    return _load_start(_choose_start(loop_config, rank, restart_name), rank, **targets)


def _load_start(start: tuple[CheckpointManager, str, str] | None, rank: int, **targets: Any) -> TrainState | None:
    if start is None:
        return None
    manager, name, how = start
    state = manager.load(name, **targets)  # hashed again after this worker's download, whatever was checked before
    _log(rank, how.replace("{step}", str(state.step)))
    return state


def train_loop_per_worker(loop_config: dict[str, Any]) -> dict[str, Any]:
    """Ray Train entry point: `Worker(loop_config, RayTrainContext(...)).run()`. `loop_config`: {"job": JobConfig.to_dict(), "run_dir":
    absolute path, "shards_dir": absolute path, "resume_from": checkpoint folder or None, "start_step": its step
    (0 if none)}.

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
    (id, labels) its trainer and its decode operators ran on (`_gather_placement`), its expert ("high" | "low"
    with `model.experts` layout groups, else None) and the [lowest, highest] timestep it trained a sample at,
    "experts": {expert: its ranks} (layout groups, else {}), "expert_losses": {expert: [[step, loss], ...]} (each
    expert's mean loss over its ranks; layout groups, else {}), "peak_rss_bytes": this worker
    process's peak resident memory, "validation", "validation_wait_s": the validation samples written beside the
    training}.
    Optional key "placement": {stage: label selector} (`vidray.placement.resolve_placement`); "decode" places
    the decode operator.
    """
    quiet_ray_train_worker()  # Ray Train's per-report TrainingReport dump (vidray.logs)
    upload_async = loop_config["job"].get("checkpoint", {}).get("upload") == "async"
    return Worker(loop_config, RayTrainContext(upload_async=upload_async)).run()


@dataclass
class StepOutcome:
    """What one optimizer step leaves for the report: the loss (,) summed over this rank's micro-batches and the
    global gradient norm (,) (device tensors: no host sync), the lr it used, seconds waiting for data, in the
    encode stages (overlapped) and in the DiT (or VAE), batch slots trained, and the data position after it."""

    loss: torch.Tensor
    grad_norm: torch.Tensor
    lr: float
    data_wait_s: float
    encode_s: float
    dit_s: float
    clips: int
    epoch: int
    position: DataPosition
    prefetch_lead: Any


class Worker:
    """One rank's training run (the module docstring's steps 1-6), given its `WorkerContext`.

    `__init__` sets up: the sample schedule, where this attempt starts, this rank's loader (started before the
    model, so its first batches decode while the model is built), the transformer (with LoRA), the parallel
    wrapper (`vidray.train.parallel.parallelize`), the EMA, optimizer, lr schedule and precision, and the resumed
    state. `run()` trains every step with `train_step` (the one place precision, accumulation and
    the parallel wrapper meet: torchtitan's `Trainer.train_step`), reports each log window (`LogWindow`) and
    writes the checkpoints, then exports (`_finish`).
    """

    def __init__(self, loop_config: dict[str, Any], context: WorkerContext):
        self.loop_config = loop_config
        self.job = job = job_config_from_dict(loop_config["job"])
        self.context = context
        self.rank, self.world_size, self.device = context.rank, context.world_size, context.device
        if self.device.type == "cpu":
            torch.set_num_threads(max(1, int(os.environ.get("OMP_NUM_THREADS", "1"))))
        self.family = get_family(job.model.family).for_model(job.model)  # its objective follows this model
        self.vae_run = job.train.objective == "vae"  # `vidray train-vae`: the transformer is the VAE's objective
        self.compute_stage = compute_stage(job.train.objective)  # what the step line, metrics and TensorBoard call it
        self.experts = self._form_expert_groups()  # `model.experts` layout groups: this rank's expert, else None
        # parallel.context: each group of `context_degree` consecutive ranks trains one micro-batch together, its
        # tokens split over them (`vidray.models.context_parallel`); its rank 0 counts the group's clips and samples.
        self.context_degree = job.parallel.context.degree
        self.context_rank = self.rank % self.context_degree
        # The data-parallel world this rank's gradients are averaged over: its expert's group, or every rank (a
        # context group's ranks as one).
        self.dp_rank, self.dp_size = ((self.experts.group_rank, self.experts.group_size) if self.experts
                                      else (self.rank // self.context_degree, self.world_size // self.context_degree))
        if self.world_size % self.context_degree:
            raise UserError(f"parallel.context: degree {self.context_degree} does not divide the {self.world_size} "
                            "workers this attempt runs with; use a multiple of it")
        # The loader starts first: its actors start and its first batches decode while the model is built
        # (issue 43: the start-up's steps overlap instead of waiting on each other).
        self._load_data(local_ranks=context.local_world_size)
        self._plan_start()
        self._start_loader(local_ranks=context.local_world_size)
        try:
            transformer, pretrained_weights = self._build_transformer()
            self._parallelize(transformer, pretrained_weights)
            self._resume()
            self._start_outputs()
        except BaseException:
            self.loader.close()
            raise

    # Set-up ------------------------------------------------------------------------------------------------------

    def _form_expert_groups(self) -> ExpertGroups | None:
        """0. With `model.experts` layout groups, agree with the other ranks which expert each trains (by its
        node's labels and the resolved `expert_high` / `expert_low` selectors) and make each expert's process
        group (`vidray.train.expert_groups`, a collective); else None. Raises UserError when the ranks cannot be
        split (an odd count, or more nodes of one expert than it has workers)."""
        experts = self.job.model.experts
        if experts is None or experts.layout != "groups" or self.vae_run:
            return None
        try:
            groups = form_expert_groups(self.rank, self.world_size, self.context.node()["labels"],
                                        self.loop_config.get("placement") or {}, experts.boundary_ratio)
        except ValueError as err:
            raise UserError(str(err)) from None
        boundary = experts.boundary_ratio * self.job.flow.num_train_timesteps
        self._log(f"two expert groups: high-noise expert on ranks {groups.ranks['high']} (timesteps >= {boundary:g}), "
                  f"low-noise expert on ranks {groups.ranks['low']} (timesteps < {boundary:g})")
        return groups

    def _build_transformer(self) -> tuple[torch.nn.Module, str | None]:
        """4. The trainable transformer alone (the frozen VAE and text encoder run in the encode stages; a
        pretrained one on the meta device when sharded: `parallelize` then loads each rank's shards), with its
        LoRA adapters when `model.lora` is set (before the probe, AC, DDP and the optimizer)."""
        job = self.job
        # A LoRA run's frozen base is built in host memory: its storage dtype (and block swap) apply there, before
        # the GPU holds any of it (a 14 B expert in fp32 would not fit where its fp8 copy does).
        stored_base = job.model.lora is not None and job.scaling.strategy == "ddp"
        build_device = torch.device("cpu") if stored_base else self.device
        if self.vae_run:
            vae = self.family.load_latent_models(job.model, seed=job.train.seed, trainable=True).vae
            transformer = VAEObjective(vae, job.vae_training)
            transformer, pretrained_weights = transformer.to(self.device), None
        elif self.experts is not None:  # this rank's expert alone, named as in `TwoExperts`
            expert = self.experts.expert
            if job.scaling.strategy == "fsdp" and job.model.init == "pretrained":  # its shards loaded after sharding
                meta = self.family.load_diffusion_models(job.model, seed=job.train.seed, expert=expert, meta=True)
                transformer, pretrained_weights = ExpertSlot(meta.transformer, expert), meta.weights_folder
            else:
                built = self.family.load_diffusion_models(job.model, seed=job.train.seed, expert=expert).transformer
                transformer, pretrained_weights = ExpertSlot(built, expert).to(build_device), None
        else:
            transformer, pretrained_weights = build_transformer(self.family, job, build_device)
        if job.model.lora is not None:
            apply_lora(transformer, job.model.lora, seed=job.train.seed)
            counts = lora_summary(transformer)
            whose = ("" if job.model.experts is None else " in each expert (each expert group its own adapters)"
                     if self.experts is not None else " (both experts)")
            self._log(f"LoRA rank {job.model.lora.rank} on {', '.join(job.model.lora.target_modules)}: "
                      f"{counts['trainable']:,} of {counts['total']:,} parameters train{whose}")
        if stored_base and not self.vae_run:
            transformer = self._place_frozen_base(transformer)
        return transformer, pretrained_weights

    def _place_frozen_base(self, transformer: torch.nn.Module) -> torch.nn.Module:
        """4b. A LoRA run's frozen base (built in host memory): its `memory.storage_dtype`
        (`vidray.models.storage`; under `model.experts` layout shared both experts' bases, layout groups hold this
        rank's expert alone), then `memory.block_swap` (its last N blocks stay in pinned host memory,
        `vidray.train.block_swap`), then the rest to the device."""
        job = self.job
        try:
            dtype = apply_storage_dtype(transformer, job.memory.storage_dtype, self.device,
                                        mixed_precision=job.train.mixed_precision)
        except ValueError as err:
            raise UserError(str(err)) from None
        if dtype != torch.float32:
            self._log(f"frozen base stored in {storage_dtype_name(dtype)} (memory.storage_dtype: "
                      f"{job.memory.storage_dtype}): {module_storage_bytes(transformer) / 2**30:.2f} GiB")
        if job.memory.block_swap:
            try:
                swaps = apply_block_swap(transformer, self.family.block_lists(transformer), job.memory.block_swap,
                                         self.device)
            except ValueError as err:
                raise UserError(str(err)) from None
            self._log(f"block swap: the last {job.memory.block_swap} blocks of {swaps[0].num_blocks} in pinned host "
                      f"memory ({sum(s.host_bytes() for s in swaps) / 2**30:.2f} GiB), streamed one block ahead")
        else:
            transformer = transformer.to(self.device)
        if dtype != torch.float32 or job.memory.block_swap:
            setattr(transformer, FROZEN_BASE_PLACED, storage_dtype_name(dtype))
        return transformer

    def _load_data(self, *, local_ranks: int) -> None:
        """1. The sample table and the schedule; the clips stay in the shards until the loader streams them.
        Object-store shards come through this node's warm disk cache (one download per shard per node), whose
        budget must hold the largest shard (checked here, before any step)."""
        self.shards_dir = shards_dir = self.loop_config["shards_dir"]
        self.index = read_index(shards_dir)
        self.lease = GenerationLease(shards_dir, self.index)  # a re-prepare keeps this rank's generation
        self.table = load_sample_index(shards_dir)
        if not open_storage(shards_dir).is_local:
            check_cache_budget(self.job.data.cache_bytes, self.index, local_ranks=local_ranks)
        self.schedule = job_schedule(self.job, self.table, self.family)
        self.data_rows = dataset_rows(shards_dir)

    def _parallelize(self, transformer: torch.nn.Module, pretrained_weights: str | None) -> None:
        """5. Parameters that never get a gradient frozen (they break DDP's reducer: 'Expected to have finished
        reduction'; found by a probe step); activation checkpointing, then DDP (gloo on CPU, NCCL on GPU) with its
        communication hook, or FSDP2 (`scaling.strategy`); then the EMA (rank 0's under DDP, every rank's shards
        under FSDP), the optimizer (of the sharded parameters under FSDP), lr schedule and precision (autocast,
        fp16's grad scaler)."""
        job, family = self.job, self.family
        # A base stored in bf16 / fp8 computes in bf16: its probes run under bf16 autocast, as its steps do.
        stored = getattr(transformer, FROZEN_BASE_PLACED, None) not in (None, "fp32")
        probe_context = (lambda: torch.autocast(self.device.type, dtype=torch.bfloat16)) if stored else \
            contextlib.nullcontext
        with probe_context():
            no_grad = set(unused_parameter_names(transformer) if self.vae_run else
                          family.no_grad_parameter_names(transformer))
        for name, param in transformer.named_parameters():
            if name in no_grad:
                param.requires_grad_(False)
        transformer.train()

        if self.context_degree > 1:  # a group split over nodes crosses the network at every attention
            try:
                check_context_group_in_node(self.context_degree, self.context.local_world_size,
                                            job.parallel.context.cross_node)
            except ValueError as err:
                raise UserError(str(err)) from None

        def probe(m: torch.nn.Module) -> torch.Tensor:
            with probe_context():
                return vae_probe_loss(m) if self.vae_run else family.probe_loss(m, transformer)
        self.model, self.comm = parallelize(transformer, job, example_loss=probe,
                                            pretrained_weights=pretrained_weights, device=self.device,
                                            process_group=None if self.experts is None else self.experts.group,
                                            family=None if self.vae_run else family, mesh=self._expert_mesh())
        self.transformer = transformer
        self.sharded = is_sharded(self.model)
        # Every rank writes its part of the checkpoint (DCP): FSDP's shards, or each expert group's expert.
        self.writes_shards = self.sharded or self.experts is not None
        holds_ema = self.rank == 0 or self.sharded or (self.experts is not None and self.experts.is_leader)
        self.ema = EMA(transformer, job.train.ema) if job.train.ema is not None and holds_ema else None
        self.optimizer = build_optimizer(transformer.parameters(), job.optim)
        self.lr_scheduler = build_lr_scheduler(self.optimizer, job.optim)
        self.precision = Precision(job.train.mixed_precision, self.device, sharded=self.sharded)
        # memory.activation_offload: the forward's saved tensors (the checkpointed blocks' inputs) in pinned host RAM
        self.activation_offload = (ActivationOffload(pin_memory=self.device.type == "cuda")
                                   if job.memory.activation_offload else None)

    def _expert_mesh(self) -> Any:
        """The mesh FSDP shards this rank's expert over (its group: `ExpertGroups.shard_mesh`, a collective), with
        `model.experts` layout groups and `scaling.strategy: fsdp`; else None."""
        if self.experts is None or self.job.scaling.strategy != "fsdp":
            return None
        return self.experts.shard_mesh(self.device.type)

    def _plan_start(self) -> None:
        """2. Where this attempt starts, before any model is built: the checkpoint it resumes (`_choose_start`), its
        step and data position (read from its `train_state.json` alone). Raises UserError when the checkpoint was
        trained on other data or its position does not fit this schedule."""
        self.start_from = _choose_start(self.loop_config, self.rank, self.context.restart_checkpoint())
        state = None
        if self.start_from is not None:
            manager, name, _ = self.start_from
            state = manager.train_state(name)
        self.start_step = 1 if state is None else state.step + 1
        self.data_hash = dataset_hash(self.data_rows)
        problem = None if state is None else dataset_mismatch(state, self.shards_dir, self.index, self.data_rows)
        if problem:
            raise UserError(f"the checkpoint {problem}")  # deterministic: never retried (see vidray.train.trainer)
        self.position = _resume_position(self.schedule, state, self.rank)

    def _resume(self) -> None:
        """6. Restore the checkpoint `_plan_start` chose (`_load_start`; the DDP hook restores its rank's PowerSGD
        state, or says why it starts afresh) and re-apply this job's `optim` section. Raises CheckpointError when
        the checkpoint's step changed since `_plan_start` read it (rewritten during the start-up)."""

        def restore_comm_hook(saved: dict[str, Any] | None) -> None:
            why = self.comm.load_state(saved, self.rank, self.world_size)
            if why:
                self._log(why)

        state = _load_start(self.start_from, self.rank,
                            transformer=self.transformer, optimizer=self.optimizer,
                            lr_scheduler=self.lr_scheduler, ema=None if self.ema is None else self.ema.averaged,
                            grad_scaler=self.precision.grad_scaler, comm_hook=restore_comm_hook,
                            **({"optimizer_key": self.experts.optimizer_key} if self.experts else {}))
        if state is not None:
            if state.step + 1 != self.start_step:
                raise CheckpointError(f"checkpoint {self.start_from[1]} is at step {state.step} but was at step "
                                      f"{self.start_step - 1} when this attempt started: it was rewritten; restart "
                                      "the run")
            # This job's optim section wins over the restored one (lr, betas, weight decay, eps, warmup schedule).
            self.lr_scheduler = apply_optim_config(self.optimizer, self.job.optim, step=state.step)
        if self.ema is not None and self.ema.num_updates == 0:
            self.ema.reset()  # an EMA added on resume (or not yet updated) starts from these weights

    def _start_loader(self, *, local_ranks: int) -> None:
        """3. This rank's steps, streamed by its Ray Data loader (`vidray.data.pipeline`: cold -> warm -> hot,
        prefetched in schedule order, then the vae and text encode stages with the latent cache; a VAE run trains
        on the frames themselves: no encode stages)."""
        job, loop_config = self.job, self.loop_config
        steps = iter_rank_steps(self.schedule, self.position, world_size=self.dp_size, rank=self.dp_rank,
                                first_step=self.start_step, last_step=job.train.max_steps,
                                micro_batches=job.micro_batches_per_step)  # lazily
        placement = loop_config.get("placement") or {}  # {stage: label selector}, resolved on the driver
        encode = None if self.vae_run else encode_spec(job, placement, latent_cache=loop_config.get("latent_cache", ""))
        if encode is not None and loop_config.get("identities"):  # the driver's identity tasks (vidray.train.trainer)
            encode["identities"] = loop_config["identities"]
        self.loader = self.context.loader(self.shards_dir, self.index, self.table, steps, job.data,
                                          sample_ids=self.table.sample_id.astype(str), local_ranks=local_ranks,
                                          label_selector=placement.get("decode"), encode=encode)
        self.batches = iter(self.loader)
        self.trainer_node = self.context.node()
        self.loader_nodes: dict[str, dict[str, Any]] = {}  # node_id -> {"node_id", "labels"} of the decode operators
        self.stage_nodes: dict[str, dict[str, dict[str, Any]]] = {"vae": {}, "text": {}}  # the same, encode actors
        self.skipped: list[dict[str, str]] = []
        self.record = bool(loop_config.get("record_sample_ids"))
        self.trained: list[list[Any]] = []  # [step, epoch, [sample_id, ...]] of this rank, when recording
        self.record_path = _record_path(loop_config, self.rank) if self.record else None

    def _start_outputs(self) -> None:
        """7. What the run reports and writes: the log window, metrics (textfile, Ray's agent, the opt-in
        endpoint), the run log (TensorBoard, metrics.jsonl, loss.png) and validator on rank 0, and the checkpoint
        manager; a sharded checkpoint with `checkpoint.upload: async` is written beside the training
        (`dcp.async_save`): its collectives go over a gloo group of their own, and one thread per rank hashes the
        files once written."""
        job, loop_config, rank = self.job, self.loop_config, self.rank
        self.window = LogWindow(self.world_size, compute=self.compute_stage, **({} if self.experts is None else {
            "expert": self.experts.expert, "expert_sizes": {e: len(r) for e, r in self.experts.ranks.items()}}))
        # {expert: [[step, loss], ...]}, the mean over that expert's ranks (layout groups)
        self.expert_history: dict[str, list[list[float]]] = {e: [] for e in (self.experts.ranks if self.experts
                                                                               else ())}
        self.timestep_range: tuple[torch.Tensor, torch.Tensor] | None = None  # (min, max) trained, `_note_timesteps`
        self.history: list[list[float]] = []
        self.reported_steps: list[int] = []
        self.step_seconds: list[list[float]] = []  # [step, data_wait_s, encode_s, dit_s] of this rank
        self.checkpoint_blocked_s: list[list[float]] = []  # [step, seconds the loop stood still for its checkpoint]
        self.checkpoints = CheckpointManager(loop_config["run_dir"])
        self.context.bind(self.checkpoints)  # its upload functions copy each reported checkpoint into the run folder
        self.checkpoint_group = self.checkpoint_writer = None
        if self.writes_shards and job.checkpoint.upload == "async":
            self.checkpoint_group = dist.new_group(backend="gloo")
            self.checkpoint_writer = ThreadPoolExecutor(max_workers=1, thread_name_prefix="vidray-checkpoint")
        self.pending: tuple[PendingShardedCheckpoint, dict, float] | None = None
        """(the sharded checkpoint being written, its step's metrics, seconds its start held the step)"""
        self.metrics_log = TrainMetrics(rank=rank, run=job.name,
                                        export_to_ray=job.train.ray_metrics and self.context.exports_ray_metrics)
        # The textfile needs a local folder: the run folder's, or for a run folder on object storage this node's
        # temp folder (the Prometheus endpoint of `train.metrics_port` serves the same figures either way).
        metrics_root = (private_dir(Path(tempfile.gettempdir()) / "vidray-metrics" / job.name)  # 0700, ours
                        if is_uri(loop_config["run_dir"]) else Path(loop_config["run_dir"]) / "metrics")
        self.metrics_file = metrics_root / f"rank_{rank}.prom"
        if job.train.metrics_port is not None:
            self.metrics_log.serve(job.train.metrics_port + rank)
        self.run_log = (RunLog(loop_config["run_dir"], start_step=self.start_step, title=job.name)
                        if rank == 0 else None)
        self.validate_every = job.train.validation.every_steps
        self.validator = (self.context.start_validator(loop_config["run_dir"], job)
                          if rank == 0 and self.validate_every else None)

    # The loop ------------------------------------------------------------------------------------------------------

    def run(self) -> dict[str, Any]:
        """Train steps `start_step`..`train.max_steps`, reporting every `train.log_every_steps` and checkpointing
        every `checkpoint.every_steps` (and at the last step); then export. Returns `train_loop_per_worker`'s
        result."""
        job, schedule = self.job, self.schedule
        max_steps = job.train.max_steps
        sizes = ", ".join(f"{b} x{n}" for b, n in zip(schedule.buckets, schedule.batch_sizes.tolist()))
        self._log(f"training steps {self.start_step}..{max_steps} from epoch {self.position.epoch}, batch "
                  f"{self.position.batches_consumed}/{schedule.batches_per_epoch} "
                  f"({schedule.steps_per_epoch(self.dp_size, job.micro_batches_per_step)} steps/epoch of "
                  f"{job.micro_batches_per_step} micro-batches at {_workers(self.dp_size)}"
                  f"{' per expert' if self.experts else ''}; batch sizes {sizes})")
        dp_workers = job.data_parallel_workers
        self._log(f"global batch {job.global_batch_size} samples per step{' per expert' if self.experts else ''} "
                  f"(data.batch_size_per_worker {job.data.batch_size_per_worker} x {job.micro_batches_per_step} "
                  f"micro-batches: {_workers(dp_workers)} x {job.micro_batches_per_step // dp_workers} "
                  f"accumulated); {job.scaling.strategy}, mixed precision {job.train.mixed_precision}, "
                  "activation checkpointing "
                  f"{job.train.activation_checkpointing}, gradient compression {job.train.grad_compression}"
                  + (f", EMA decay {job.train.ema.decay}" if self.ema else "")
                  + (f", context parallel over {self.context_degree} workers (ulysses {job.parallel.context.ulysses} x "
                     f"ring {job.parallel.context.ring}): each micro-batch's tokens split over its group"
                     if self.context_degree > 1 else "")
                  + _experts_note(job))
        self.window_start, self.window_steps = time.perf_counter(), 0
        run_start = time.perf_counter()
        self.first_step_done_unix: float | None = None  # wall clock when this attempt's first step finished
        try:
            for step in range(self.start_step, max_steps + 1):
                outcome = self.train_step(step)
                self.position = outcome.position
                self._count_step(step, outcome)
                is_log = step % job.train.log_every_steps == 0 or step == max_steps
                is_checkpoint = step % job.checkpoint.every_steps == 0 or step == max_steps
                if is_log or is_checkpoint:
                    self._report(step, outcome, is_checkpoint=is_checkpoint)
            if self.pending is not None:  # the last step's sharded checkpoint
                self._report_sharded(self.pending)
                self.pending = None
        finally:  # the sharded checkpoints' writer and group, however the loop ended
            _close_checkpoint_writer(self.checkpoint_writer, self.checkpoint_group)
        num_trained = max(0, max_steps - self.start_step + 1)
        steps_per_s = num_trained / (time.perf_counter() - run_start) if num_trained else 0.0
        return self._finish(steps_per_s)

    def train_step(self, step: int) -> StepOutcome:
        """One optimizer step: this rank's micro-batches of the step (slots rank, rank + W, ... of its G:
        `vidray.data.schedule`) with gradient accumulation (DDP all-reduces, FSDP reduce-scatters, on the last
        backward only: `gradient_sync`), each forward under `precision.autocast()` and each backward scaled by
        fp16's grad scaler; then the gradients unscaled, clipped to `train.grad_clip_norm` (the global norm), the
        optimizer and lr steps, and the EMA's update. Raises RuntimeError when the loader delivers another step's
        micro-batch."""
        job, model, precision, device = self.job, self.model, self.precision, self.device
        self.optimizer.zero_grad(set_to_none=True)
        loss = None  # (,) sum of this rank's micro-batch losses
        data_wait_s = encode_s = dit_s = 0.0
        clips, step_ids = 0, []
        micro, num_micro = 0, 1
        while micro < num_micro:
            batch = next(self.batches, None)
            if batch is None or batch.step != step or batch.micro != micro:
                got = "nothing" if batch is None else f"step {batch.step} micro-batch {batch.micro}"
                raise RuntimeError(f"the loader delivered {got} where step {step} micro-batch {micro} was due")
            num_micro = batch.num_micro
            t_data = time.perf_counter()
            self._note_batch(batch)
            # sum_i w_i mse_i * W / total weight (of all G micro-batches): summed over this rank's micro-batches
            # and averaged over the W ranks by DDP, the gradient is the mean over the step's real samples.
            loss_weights = torch.from_numpy(batch.weights) * (self.dp_size / batch.total_weight)
            with gradient_sync(model, micro == num_micro - 1):  # DDP's no_sync / FSDP's set_requires_gradient_sync
                generators = [sample_generator(job.train.seed, step, int(k)) for k in batch.sample_keys.tolist()]
                with precision.autocast():
                    if self.vae_run:  # the clips' frames, uint8 (B, 3, F, H, W), straight from the loader
                        micro_loss = vae_micro_loss(model, batch.frames.to(device), generators, loss_weights)
                    else:  # latents and prompt_embeds (and I2V conditions) from the encode stages, or cached
                        micro_loss, timesteps = flow_matching_step_loss(
                            self.family, model, batch.latents.to(device), batch.prompt_embeds.to(device),
                            batch.prompt_attention_mask.to(device), job.flow, generators, loss_weights=loss_weights,
                            sigma_range=None if self.experts is None else self.experts.sigma_range,
                            return_timesteps=True, activation_offload=self.activation_offload,
                            **self._condition(batch))
                        self._note_timesteps(timesteps, batch.weights)
                # A context group's ranks each hold the gradient of their own tokens (partial sums of the
                # sample's), which DDP / FSDP average over every rank: scaled by the degree, the average over the
                # group is their sum, and over the data-parallel ranks their mean.
                precision.backward(micro_loss * self.context_degree if self.context_degree > 1 else micro_loss)
            loss = micro_loss.detach() if loss is None else loss + micro_loss.detach()
            if self.record and self.context_rank == 0:
                ids = [i for i, w in zip(batch.sample_ids, batch.weights) if w > 0]
                self.trained.append([step, batch.epoch, ids])
                step_ids.extend(ids)
            data_wait_s += batch.data_wait_s
            if self.context_rank == 0:  # batch slots the DiT trained (padding and repeats included), once a group
                clips += len(batch.sample_ids)
            encode_s += batch.stats.get("vae_s", 0.0) + batch.stats.get("text_s", 0.0)  # in the stages, overlapped
            dit_s += time.perf_counter() - t_data
            micro += 1
        t_optim = time.perf_counter()
        if self.record_path is not None and self.context_rank == 0:
            _append_record(self.record_path, [step, batch.epoch, self.world_size, self.rank, step_ids])
        precision.unscale_(self.optimizer)  # fp16: clip and measure true gradients
        if job.train.grad_clip_norm is not None:
            grad_norm = clip_grad_norm_(model, job.train.grad_clip_norm)  # global, under FSDP too
        else:
            grad_norm = torch.zeros((), device=loss.device)
        lr = self.lr_scheduler.get_last_lr()[0]  # the lr this step uses (a host float: no sync)
        precision.step(self.optimizer)
        self.lr_scheduler.step()
        if self.ema is not None:
            self.ema.maybe_update(step)
        dit_s += time.perf_counter() - t_optim
        return StepOutcome(loss, grad_norm, lr, data_wait_s, encode_s, dit_s, clips, batch.epoch,
                           batch.next_position, batch.prefetch_lead)

    def _condition(self, batch: TrainBatch) -> dict[str, Any]:
        """An image-to-video model's (`model.i2v`) keyword arguments of `flow_matching_step_loss`: the batch's
        inpaint_latents (and image_embeds with `model.i2v.image_encoder`) and `model.i2v.condition_dropout`;
        nothing for a text-to-video model. Raises RuntimeError
        when the encode stage delivered no condition for an image-to-video model."""
        i2v = self.job.model.i2v
        if i2v is None:
            return {}
        if batch.inpaint_latents is None:
            raise RuntimeError(f"model.i2v is set but step {batch.step}'s micro-batch came without inpaint_latents "
                               "from the encode stage")
        condition = {"inpaint_latents": batch.inpaint_latents.to(self.device),
                     "condition_dropout": i2v.condition_dropout}
        if i2v.image_encoder:  # Wan 2.1 I2V: the CLIP image embeddings beside the latent condition
            if batch.image_embeds is None:
                raise RuntimeError(f"model.i2v.image_encoder is set but step {batch.step}'s micro-batch came without "
                                   "image_embeds from the encode stage")
            condition["image_embeds"] = batch.image_embeds.to(self.device)
        return condition

    def _note_timesteps(self, timesteps: torch.Tensor, weights: Any) -> None:
        """Keep the lowest and highest timestep this rank trained a real sample at (weight > 0; device tensors: no
        host sync), reported at the end as "timestep_range"."""
        if not (weights > 0).any():
            return
        real = torch.from_numpy(weights > 0).to(timesteps.device)
        timesteps = timesteps.detach().float()
        low = torch.where(real, timesteps, float("inf")).min()
        high = torch.where(real, timesteps, float("-inf")).max()
        if self.timestep_range is not None:
            low, high = torch.minimum(low, self.timestep_range[0]), torch.maximum(high, self.timestep_range[1])
        self.timestep_range = (low, high)

    def _note_batch(self, batch: TrainBatch) -> None:
        """A micro-batch's loader counters, skipped shards and clips, and the nodes its stages ran on."""
        _add_loader_stats(self.metrics_log, batch)
        self.skipped.extend(batch.skipped)
        if batch.loader_node:
            self.loader_nodes.setdefault(batch.loader_node["node_id"], batch.loader_node)
        for stage, node in batch.stage_nodes.items():
            if node:
                self.stage_nodes[stage].setdefault(node["node_id"], node)

    def _count_step(self, step: int, outcome: StepOutcome) -> None:
        """A finished step into the log window and the metrics (no host sync)."""
        seconds = [step, outcome.data_wait_s, outcome.encode_s, outcome.dit_s]
        self.window.add(outcome.loss, outcome.grad_norm, outcome.lr, seconds)
        self.window_steps += 1
        if self.first_step_done_unix is None:
            self.first_step_done_unix = time.time()
        self.step_seconds.append(seconds)
        self.metrics_log.observe_step(data_wait_s=outcome.data_wait_s, step_s=outcome.data_wait_s + outcome.dit_s,
                                      samples=outcome.clips)
        self.metrics_log.add_stage(self.compute_stage, busy_s=outcome.dit_s, clips=outcome.clips)
        self.metrics_log.set_step(step)

    def _report(self, step: int, outcome: StepOutcome, *, is_checkpoint: bool) -> None:
        """Close the log window (the one host sync: mean loss and gradient norm over ranks, NaN/Inf checked on
        every rank at the same step, before any checkpoint of a diverged model is written and good ones rotated
        away), log it, and report it to Ray Train with this step's checkpoint when due."""
        data = self.metrics_log.window_summary()
        closed = self.window.close(step, epoch=outcome.epoch, lr_now=self.lr_scheduler.get_last_lr()[0],
                                   step_time_s=(time.perf_counter() - self.window_start) / self.window_steps,
                                   data=data, check_grad_norms=not self.precision.skips_non_finite_steps)
        if is_checkpoint:
            bad = non_finite_parameters(self.transformer)
            if bad:
                raise NonFiniteTrainingError(
                    f"training diverged: {len(bad)} weight tensor(s) hold NaN/Inf at step {step} (e.g. {bad[0]}; "
                    f"lr {closed.lrs[-1]:.3g}); no checkpoint was written. Lower optim.lr or set "
                    "train.grad_clip_norm, then resume from the last checkpoint",
                    step, closed.lrs[-1],
                )
        self.history.extend([closed.first_step + i, v] for i, v in enumerate(closed.losses))
        for expert, values in closed.experts.items():
            self.expert_history[expert].extend([closed.first_step + i, v] for i, v in enumerate(values["loss"]))
        metrics = closed.metrics
        self.metrics_log.observe_window(loss=metrics["loss"], lr=metrics["lr"],
                                        data_wait_fraction=min(1.0, data["data_wait_fraction"]))
        self._log(step_line(closed, max_steps=self.job.train.max_steps, data=data,
                            prefetch_lead=outcome.prefetch_lead))
        self.metrics_log.write_textfile(self.metrics_file)
        if self.run_log is not None:
            self.run_log.log_window(closed.first_step, closed.losses, closed.grad_norms, closed.lrs, metrics,
                                    samples_per_step=self.job.global_batch_size, experts=closed.experts)
            if is_checkpoint:
                self.run_log.flush()  # TensorBoard events, metrics.jsonl and loss.png in the run folder
        self.reported_steps.append(step)
        if self.pending is not None and (is_checkpoint or self._written_everywhere(self.pending[0])):
            self._report_sharded(self.pending)  # the previous sharded checkpoint, written meanwhile, reported first
            self.pending = None
        if is_checkpoint:
            self._checkpoint(step, metrics)
        else:
            self.context.report(metrics)
        self.window_start, self.window_steps = time.perf_counter(), 0

    # Checkpoints ---------------------------------------------------------------------------------------------------

    def _checkpoint(self, step: int, metrics: dict[str, Any]) -> None:
        """Write this step's checkpoint and report it with `metrics`. Full (DDP): rank 0 snapshots the parts into
        a local temp folder (the step waits only for this with `checkpoint.upload: async`); Ray Train copies it to
        the run folder with the manager's upload (manifest last, retried), in the background when asynchronous,
        and deletes the temp folder. Sharded (FSDP): every rank writes its shards (DCP) into its own temp folder
        and reports it; rank 0's upload writes the manifest only once every rank's files are in the run folder;
        with `checkpoint.upload: async` the write runs beside the next steps and the checkpoint is reported (with
        this step's metrics) at the next report, or at the end of the run."""
        job, rank, world_size, position = self.job, self.rank, self.world_size, self.position
        t_snapshot = time.perf_counter()
        train_state = TrainState(step, position.epoch, position.batches_consumed, world_size,
                                 self.index.get("content_hash", ""), position.to_dict(self.schedule.buckets),
                                 self.data_hash, len(self.table))
        if self.writes_shards:
            if rank == 0:
                # an interrupted earlier write
                self.context.clear_for_sharded_write(self.checkpoints, checkpoint_dir_name(step))
            if world_size > 1:
                dist.barrier()
            started = start_sharded_checkpoint(
                tempfile.mkdtemp(prefix="vidray-ckpt-"), model=self.transformer, optimizer=self.optimizer,
                lr_scheduler=self.lr_scheduler, train_state=train_state, job_config=job.to_dict(), rank=rank,
                world_size=world_size, dataset=self.data_rows, ema=None if self.ema is None else self.ema.averaged,
                grad_scaler=self.precision.grad_scaler, process_group=self.checkpoint_group,
                executor=self.checkpoint_writer,
                **({"optimizer_key": self.experts.optimizer_key} if self.experts else {}))
            self.pending = (started, metrics, time.perf_counter() - t_snapshot)
            if self.checkpoint_group is None:
                self._report_sharded(self.pending)
                self.pending = None
            return
        checkpoint = None
        hook_state = self.comm.gather_state(rank, world_size)  # every rank's PowerSGD state (a collective)
        if rank == 0:
            snapshot = save_checkpoint(
                tempfile.mkdtemp(prefix="vidray-ckpt-"), model=self.transformer, optimizer=self.optimizer,
                lr_scheduler=self.lr_scheduler, train_state=train_state, job_config=job.to_dict(),
                dataset=self.data_rows, ema=None if self.ema is None else self.ema.averaged,
                grad_scaler=self.precision.grad_scaler, comm_hook_state=hook_state)
            checkpoint = snapshot
        self.context.report(metrics, checkpoint=checkpoint, name=checkpoint_dir_name(step))
        self.checkpoint_blocked_s.append([step, time.perf_counter() - t_snapshot])
        self._maybe_validate(step)

    def _written_everywhere(self, started: PendingShardedCheckpoint) -> bool:
        """Whether every rank's write and hashing of `started` are done (a collective over the training's group:
        every rank gets the same answer, so all finish it at the same report)."""
        done = torch.tensor([1.0 if started.done() else 0.0], device=self.device)
        if self.world_size > 1:
            dist.all_reduce(done, op=dist.ReduceOp.MIN)
        return bool(done.item())

    def _report_sharded(self, entry: tuple[PendingShardedCheckpoint, dict, float]) -> None:
        """Finish a sharded checkpoint (a collective: every rank, same point) and report it with its step's
        metrics; every rank reports its own folder (`CheckpointManager.ray_shard_upload_fn`)."""
        started, step_metrics, started_s = entry
        t_wait = time.perf_counter()
        snapshot = started.finish()
        self.context.report(step_metrics, checkpoint=snapshot, name=checkpoint_dir_name(started.step), sharded=True)
        self.checkpoint_blocked_s.append([started.step, started_s + time.perf_counter() - t_wait])
        self._maybe_validate(started.step)

    def _maybe_validate(self, step: int) -> None:
        """Hand the checkpoint of `step` to the validator when validation is due (it waits for the copy; the
        training goes on)."""
        if self.validator is not None and step % self.validate_every == 0:
            self.validator.submit(step)

    # The end -------------------------------------------------------------------------------------------------------

    def _finish(self, steps_per_s: float) -> dict[str, Any]:
        """8. Close the loader and logs, agree on what was skipped and trained, and export: rank 0 saves the
        trained pipeline in diffusers format (safetensors) with the job file (`_export_pipeline`), or a VAE run's
        VAE (`vidray.train.vae.save_vae`); a sharded model's full weights (and EMA) are gathered to rank 0 first
        (collectives: every rank takes part). A LoRA run on a pretrained base (`lora_export_base`) gathers its
        adapters alone and writes them with a reference to the base (`_export_adapters`). Returns
        `train_loop_per_worker`'s result."""
        job, rank, world_size = self.job, self.rank, self.world_size
        self.loader.close()
        self.lease.release()
        if self.run_log is not None:
            self.run_log.close()
        self.metrics_log.write_textfile(self.metrics_file)
        self.metrics_log.close()
        trained_samples = _gather_trained(self.trained, world_size) if self.record else []
        skipped = _agree_on_skipped(self.skipped, world_size)
        timestep_range = None if self.timestep_range is None else [float(t) for t in self.timestep_range]
        nodes = _gather_placement({"rank": rank, "trainer": self.trainer_node, "timestep_range": timestep_range,
                                   "expert": None if self.experts is None else self.experts.expert,
                                   "loaders": list(self.loader_nodes.values()),
                                   **{stage: list(found.values()) for stage, found in self.stage_nodes.items()}},
                                  world_size)
        skipped_shards = [s for s in skipped if "file" in s]
        skipped_clips = [s for s in skipped if "sample_id" in s]
        if skipped:
            self._log(f"skipped {len(skipped_shards)} shard(s) and {len(skipped_clips)} clip(s) that could not be "
                      "read")
        run_dir = str(self.loop_config["run_dir"])
        base = None if self.vae_run else lora_export_base(job)
        if base is not None:  # a LoRA run on a pretrained base: only the adapters are gathered and written
            adapters = self._gather_adapters()
            diffusers_dir = (_export_adapters(adapters, job, base, run_dir, self.transformer) if rank == 0
                             else f"{run_dir.rstrip('/')}/diffusers")
        elif self.experts is not None:
            trained_full, ema_weights = self._gather_experts()
        elif getattr(self.transformer, FROZEN_BASE_PLACED, None) is not None:
            # A base stored in bf16 / fp8 or block-swapped is not what the run was given: the export holds the
            # trained adapters on a fresh fp32 base (the seeded or pretrained weights), never the stored copy.
            trained_full = _with_fresh_base(self.family, job, self.transformer) if rank == 0 else None
            ema_weights = self.ema.full_averages() if self.ema is not None and job.export.weights == "ema" else None
        else:
            trained_full = full_model_for_export(self.model, self.transformer,
                                                 lambda: _build_unsharded(self.family, job), rank)
            # export.weights: ema: the averages, gathered from every rank's shards under FSDP (a collective).
            ema_weights = self.ema.full_averages() if self.ema is not None and job.export.weights == "ema" else None
        if base is None and self.vae_run:  # the trained VAE as a diffusers folder, what model.vae_path names
            diffusers_dir = f"{run_dir.rstrip('/')}/{VAE_EXPORT_DIR}"
            if rank == 0:
                save_vae(trained_full.vae.eval(), diffusers_dir)
                self._log(f"saved the trained VAE to {diffusers_dir} (use it with model.vae_path={diffusers_dir})")
        elif base is None:
            diffusers_dir = (_export_pipeline(self.family, trained_full, job, ema_weights, run_dir) if rank == 0
                             else f"{run_dir.rstrip('/')}/diffusers")
        validated, validation_wait_s, validation_problems = (self.validator.wait() if self.validator is not None
                                                             else ([], 0.0, []))  # after export
        if self.validator is not None and len(self.validator):
            steps = ", ".join(str(v["step"]) for v in validated) or "none"
            took = ", ".join(f"{v['seconds']:.1f}" for v in validated)
            self._log(f"validation samples at steps {steps} in {run_dir}/validation (each took {took} s beside the "
                      f"training; the end of the run waited {validation_wait_s:.1f} s for them)")
            for problem in validation_problems:
                self._log(f"warning: a validation did not complete: {problem}")
        return {
            "validation": validated,
            "validation_wait_s": validation_wait_s,
            "losses": self.history,
            "expert_losses": self.expert_history,
            "experts": {} if self.experts is None else self.experts.ranks,
            "first_step": self.start_step,
            "last_step": job.train.max_steps,
            "steps_per_s": steps_per_s,
            "diffusers_dir": diffusers_dir,
            "reported_steps": self.reported_steps,
            "trained_samples": trained_samples,
            "skipped_shards": skipped_shards,
            "skipped_clips": skipped_clips,
            "placement": nodes,
            "step_seconds": self.step_seconds,
            "checkpoint_blocked_s": self.checkpoint_blocked_s,
            "first_step_done_unix": self.first_step_done_unix,
            "data": self.metrics_log.summary(),
            "peak_rss_bytes": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024,  # Linux: KiB
        }

    def _gather_adapters(self) -> dict[str, torch.Tensor] | None:
        """The trained adapters alone on rank 0, for an adapter-only export (collectives: every rank calls it):
        {name: tensor} in `adapter_state_dict`'s naming (a two-expert run's under each expert's prefix), with
        `export.weights: ema` the adapters' averages in place of the trained values; None on the other ranks. The
        base's weights are never gathered (a 14 B expert's 53 GiB stay sharded where they are)."""
        job = self.job
        ema = job.train.ema is not None and job.export.weights == "ema"
        if self.experts is not None:
            own = {k: v for k, v in self.transformer.state_dict().items() if is_adapter_parameter(k)}
            state = gather_experts_to_rank0(self.experts, full_expert_state(own))
            averages = (gather_experts_to_rank0(self.experts, None if self.ema is None else self.ema.full_averages())
                        if ema else None)
        else:
            state = adapter_state_dict(self.transformer)  # FSDP: each adapter gathered in full (a collective)
            averages = self.ema.full_averages() if ema and self.ema is not None else None
        if self.rank != 0:
            return None

        def named(name: str) -> str:  # activation checkpoint wrappers (`every_<n>`) add a level to the names
            return adapter_key(name.replace("_checkpoint_wrapped_module.", ""))

        adapters = {named(k): v.detach().to("cpu", copy=True) for k, v in state.items()}
        if averages:
            adapters.update({named(k): v for k, v in averages.items() if is_adapter_parameter(k)})
        return adapters

    def _gather_experts(self) -> tuple[torch.nn.Module | None, dict[str, torch.Tensor] | None]:
        """Both experts on rank 0 for the export (collectives: FSDP's full tensors within each group, then over the
        expert groups' gloo group): (a `TwoExperts` with each group leader's trained weights, and with
        `export.weights: ema` their averages); (None, None) on the other ranks."""
        job = self.job
        weights = gather_experts_to_rank0(self.experts, full_expert_state(self.transformer.state_dict()))
        ema_weights = None
        if job.train.ema is not None and job.export.weights == "ema":
            ema_weights = gather_experts_to_rank0(self.experts, None if self.ema is None else self.ema.full_averages())
        if self.rank != 0:
            return None, None
        full = _build_unsharded(self.family, job)
        full.load_state_dict(weights, strict=True)
        return full, ema_weights

    def _log(self, message: str) -> None:
        _log(self.rank, message)


def _workers(count: int) -> str:
    """'1 worker', '2 workers'."""
    return f"{count} worker{'' if count == 1 else 's'}"


def _experts_note(job: Any) -> str:
    """", two experts switched at timestep T" for a `model.experts` job (the start-of-run line), else ""."""
    if job.model.experts is None:
        return ""
    experts = job.model.experts
    held = "one worker group each" if experts.layout == "groups" else "both on every worker"
    return f", two experts switched at timestep {experts.boundary_ratio * job.flow.num_train_timesteps:g} ({held})"


def _with_fresh_base(family: Any, job: Any, transformer: torch.nn.Module) -> torch.nn.Module:
    """`_build_unsharded` (fp32, host memory) holding `transformer`'s trained LoRA adapters: the export of a run
    whose frozen base was stored in bf16 / fp8 or block-swapped (`memory`)."""
    full = _build_unsharded(family, job)
    load_adapter_state_dict(full, adapter_state_dict(transformer))
    return full


def _build_unsharded(family: Any, job: Any) -> torch.nn.Module:
    """A fresh, unsharded transformer of the job's model (with its LoRA adapters when `model.lora` is set): what
    the full weights gathered from a sharded run load into for the export."""
    transformer = family.load_diffusion_models(job.model, seed=job.train.seed).transformer
    if job.model.lora is not None:
        apply_lora(transformer, job.model.lora, seed=job.train.seed)
    return transformer


def _export_adapters(adapters: dict[str, torch.Tensor], job: Any, base: str, run_dir: str,
                     transformer: torch.nn.Module) -> str:
    """Rank 0's adapter-only export of a LoRA run on a pretrained base (`vidray.models.export.export_adapters`:
    `lora/` (two experts: and `lora_2/`), `base_model.json`, the job file) into `<run_dir>/diffusers`; returns that
    folder. For a URI, a local temp folder uploaded with base_model.json last (as `_export_pipeline`)."""
    remote = is_uri(run_dir)
    diffusers_dir = f"{run_dir.rstrip('/')}/diffusers" if remote else str(Path(run_dir) / "diffusers")
    inner = getattr(transformer, "first_expert", None)
    base_class = type(inner if isinstance(inner, torch.nn.Module) else getattr(transformer, "module", transformer))

    def write(folder: str) -> None:
        export_adapters(adapters, job.model.lora, base_class, folder, base, experts=job.model.experts is not None)
        write_job_file(folder, job)

    if remote:
        with tempfile.TemporaryDirectory(prefix="vidray-export-") as tmp:
            write(f"{tmp}/out")
            num_bytes = upload_dir(f"{tmp}/out", diffusers_dir, marker=BASE_REF)
        _log(0, f"saved the LoRA adapters to {diffusers_dir} (base {base}; {num_bytes / 2**20:.1f} MiB uploaded)")
    else:
        write(diffusers_dir)
        _log(0, f"saved the LoRA adapters to {diffusers_dir} (base {base}, referred to, not copied)")
    return diffusers_dir


def _export_pipeline(family: Any, trained_full: torch.nn.Module, job: Any, ema_weights: dict[str, torch.Tensor] | None,
                     run_dir: str) -> str:
    """Rank 0's diffusers export of the trained DiT with the job's VAE and text encoder (and a Wan 2.1 I2V model's
    image encoder; the job file) into
    `<run_dir>/diffusers`; returns that folder. `ema_weights` ({parameter name: full average}, with
    `export.weights: ema`) replace the trained weights of those names. A local run folder is written directly; for
    a URI a local temp folder is uploaded with model_index.json last (`upload_dir`: a half-uploaded export never
    looks like a model; the whole upload is retried, then the worker fails with a StorageTransferError naming the
    URI, and Ray Train's restart exports again from the last checkpoint)."""
    remote = is_uri(run_dir)
    diffusers_dir = f"{run_dir.rstrip('/')}/diffusers" if remote else str(Path(run_dir) / "diffusers")
    trained_full.eval()
    encoders = family.build_encoders(job.model, seed=job.train.seed)  # the export's VAE and text (image) encoder
    if ema_weights is not None:
        copy_averages_to(trained_full, ema_weights)  # training is over: the export holds the averages
    components = Components(transformer=trained_full, vae=encoders.vae, text_encoder=encoders.text_encoder,
                            tokenizer=encoders.tokenizer, image_encoder=encoders.image_encoder,
                            image_processor=encoders.image_processor)
    if remote:
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
    "text": [...], "expert", "timestep_range"} (the nodes its DiT worker, its decode operators and its encode actors
    ran on; its expert and trained timesteps), by rank (one collective, at the end)."""
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
    """Feed one micro-batch's loader counters (`vidray.data.pipeline.STAT_KEYS`) and the stages' work spans into
    the metrics."""
    s = batch.stats
    metrics.add_cache("hot", hits=int(s["hot_hits"]), misses=int(s["hot_misses"]))
    metrics.add_cache("warm", hits=int(s["warm_hits"]), misses=int(s["warm_misses"]))
    metrics.add_bytes_fetched(int(s["bytes_fetched"]))
    for item in batch.skipped:
        metrics.add_skipped("shard" if "file" in item else "clip")
    metrics.set_prefetch_lead(batch.prefetch_lead)
    decoded = int(s["hot_misses"]) - int(s.get("decodes_skipped", 0))  # a miss whose latents were cached: no decode
    metrics.add_stage("decode", busy_s=float(s["decode_s"] + s["fetch_s"]), clips=decoded, **_span(s, "decode"))
    for stage, tier in (("vae", "latent"), ("text", "prompt")):
        if f"{stage}_s" in s:
            hits, misses = int(s[f"{stage}_hits"]), int(s[f"{stage}_misses"])
            metrics.add_cache(tier, hits=hits, misses=misses)
            metrics.add_stage(stage, busy_s=float(s[f"{stage}_s"]), clips=hits + misses, **_span(s, stage))


def _span(stats: dict[str, float], stage: str) -> dict[str, float]:
    """{"start", "end"}: the wall-clock seconds between which `stage` worked on the micro-batch
    (`vidray.data.pipeline.DECODE_SPAN_KEYS`, `vidray.data.encode.ENCODE_SPAN_KEYS`), for `TrainMetrics.add_stage`
    to count only the part inside the log window; {} when the batch carries none."""
    start, end = stats.get(f"{stage}_start_unix"), stats.get(f"{stage}_end_unix")
    return {"start": start, "end": end} if start is not None and end is not None and end >= start else {}


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
