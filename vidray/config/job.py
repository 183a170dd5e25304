"""`JobConfig`: the sections of one run and the checks that involve more than one of them (a bucket against the
family's rules, workers against micro-batches, memory modes against the strategy, validation against checkpoints)."""

from __future__ import annotations

import dataclasses
from pathlib import Path
from typing import Any

from pydantic import TypeAdapter, model_validator
from pydantic.dataclasses import dataclass

from vidray.buckets import check_bucket, parse_bucket
from vidray.cards import get_card
from vidray.config.common import _NAME_RE, _STRICT, _families_with
from vidray.config.model import ModelConfig
from vidray.config.data import DataConfig
from vidray.config.train import (CheckpointConfig, ExportConfig, FlowConfig, OptimConfig, ParallelConfig, ScalingConfig,
                                 TrainConfig, VAETrainingConfig, parse_activation_checkpointing)
from vidray.config.runtime import MemoryConfig, PlacementConfig, StorageConfig
from vidray.placement import expert_selectors


@dataclass(config=_STRICT, kw_only=True)
class JobConfig:
    name: str = "vidray-run"
    """Run name; the run folder is `<storage.path>/<name>` and re-using it resumes the run."""
    model: ModelConfig = dataclasses.field(default_factory=ModelConfig)
    """The model family, its size and initial weights, the text encoder and LoRA."""
    data: DataConfig = dataclasses.field(default_factory=DataConfig)
    """Where the clips come from, how `vidray prepare` shards them, and how the loader feeds the trainers."""
    flow: FlowConfig = dataclasses.field(default_factory=FlowConfig)
    """The flow-matching objective: how sigmas are drawn and shifted (`vidray.diffusion.flow_matching`)."""
    optim: OptimConfig = dataclasses.field(default_factory=OptimConfig)
    """AdamW and its learning-rate warmup."""
    train: TrainConfig = dataclasses.field(default_factory=TrainConfig)
    """Run length, precision, memory and communication knobs, logging and fault tolerance."""
    checkpoint: CheckpointConfig = dataclasses.field(default_factory=CheckpointConfig)
    """When checkpoints are written, how many are kept, and what a run with checkpoints does."""
    scaling: ScalingConfig = dataclasses.field(default_factory=ScalingConfig)
    """How many Ray Train workers, on which devices, and the data-parallel strategy."""
    parallel: ParallelConfig = dataclasses.field(default_factory=ParallelConfig)
    """Model parallelism beside the data parallelism of `scaling`: context (sequence) parallel degrees."""
    storage: StorageConfig = dataclasses.field(default_factory=StorageConfig)
    """Where the run's outputs go."""
    placement: PlacementConfig = dataclasses.field(default_factory=PlacementConfig)
    """Which nodes each stage runs on (Ray label selectors) and the encode stages' resources."""
    export: ExportConfig = dataclasses.field(default_factory=ExportConfig)
    """What the diffusers export at the end of training holds."""
    vae_training: VAETrainingConfig = dataclasses.field(default_factory=VAETrainingConfig)
    """`vidray train-vae`: the VAE run's length, learning rate and loss weights."""
    memory: MemoryConfig = dataclasses.field(default_factory=MemoryConfig)
    """Frozen weights' storage dtype and offload, for training, validation and the export's generation."""

    @model_validator(mode="after")
    def _cross_checks(self):
        for bucket in self.data.buckets:
            try:
                check_bucket(bucket, self.model.family)
            except ValueError as err:
                raise ValueError(f"data.buckets: {err} (the rule of model.family={self.model.family}, "
                                 "vidray.buckets)") from None
        if get_card(self.model.family).objective == "ddim" and self.flow.num_train_timesteps != 1000:
            raise ValueError(f"flow.num_train_timesteps is {self.flow.num_train_timesteps}, but model.family: "
                             f"{self.model.family} trains on a 1000-step DDIM schedule: set flow.num_train_timesteps: "
                             "1000")
        if not _NAME_RE.fullmatch(self.name) or set(self.name) == {"."}:
            raise ValueError(
                f"name must be a plain folder name (letters, digits, '.', '_', '-'), got {self.name!r}: "
                "it becomes <storage.path>/<name>"
            )
        vt = self.vae_training
        if vt.lr <= 0 or min(vt.l1_weight, vt.mse_weight, vt.kl_weight) < 0 or vt.l1_weight + vt.mse_weight <= 0:
            raise ValueError(f"vae_training: lr must be > 0 and the loss weights >= 0 with l1_weight + mse_weight > 0, "
                             f"got lr {vt.lr}, l1_weight {vt.l1_weight}, mse_weight {vt.mse_weight}, kl_weight "
                             f"{vt.kl_weight}")
        if self.data.scene_threshold <= 0 or self.data.min_scene_s < 0:
            raise ValueError(
                f"data.scene_threshold must be > 0 and data.min_scene_s >= 0 seconds, got "
                f"{self.data.scene_threshold} and {self.data.min_scene_s} (defaults: 27.0 and 0.5)"
            )
        self._check_workers()
        self._check_context_parallel()
        self._check_expert_groups()
        self._check_memory()
        if not all(0 <= b < 1 for b in self.optim.betas):
            raise ValueError(f"optim.betas must each be in [0, 1), got {list(self.optim.betas)} (default [0.9, 0.999])")
        self._check_scale()
        if self.train.max_failures < -1:
            raise ValueError(f"train.max_failures must be >= 0, or -1 to retry forever, got {self.train.max_failures}")
        return self

    def _check_memory(self) -> None:
        """`memory`'s modes against the job: what they train and the device they need (one line each, naming the
        mode and what to use instead). The block count is checked when the model is built."""
        mem = self.memory
        if mem.block_swap and self.model.lora is None:
            raise ValueError(f"memory.block_swap: {mem.block_swap} swaps the frozen base under LoRA: set model.lora, "
                             "or use memory.fsdp_cpu_offload for full fine-tuning (scaling.strategy: fsdp)")
        if mem.block_swap and not self.scaling.use_gpu:
            raise ValueError(f"memory.block_swap: {mem.block_swap} needs a CUDA device (scaling.use_gpu: true): on CPU "
                             "every weight is in host memory already; use memory.block_swap: 0")
        if mem.block_swap and self.train.activation_checkpointing != "full":
            raise ValueError(f"memory.block_swap: {mem.block_swap} needs train.activation_checkpointing: full (each "
                             "swapped block is recomputed in the backward, which brings its weights back; without it "
                             f"autograd keeps every block's GPU copy), got {self.train.activation_checkpointing!r}")
        if mem.storage_dtype in ("bf16", "fp8") and self.model.lora is not None and self.train.mixed_precision == "no":
            raise ValueError(f"memory.storage_dtype: {mem.storage_dtype} computes the frozen base in bf16: set "
                             "train.mixed_precision: bf16 (autocast), or use memory.storage_dtype: fp32")
        if mem.storage_dtype == "fp8" and self.model.lora is not None and self.train.activation_checkpointing == "none":
            raise ValueError("memory.storage_dtype: fp8 under model.lora needs train.activation_checkpointing: full "
                             "(or every_<n>): without recomputation autograd keeps each layer's bf16 copy of its weight "
                             "for the backward, more than a bf16 base holds; or use memory.storage_dtype: bf16")
        if mem.storage_dtype in ("bf16", "fp8") and self.model.lora is not None and self.scaling.strategy != "ddp":
            raise ValueError(f"memory.storage_dtype: {mem.storage_dtype} stores a replicated LoRA base; with "
                             f"scaling.strategy: {self.scaling.strategy} FSDP2 shards the base in fp32: use "
                             "scaling.strategy: ddp (with memory.block_swap), or memory.storage_dtype: auto")
        if mem.fsdp_cpu_offload and self.scaling.strategy == "ddp":
            raise ValueError("memory.fsdp_cpu_offload: true needs scaling.strategy: fsdp or hsdp (FSDP2's "
                             "CPUOffloadPolicy); with ddp use memory.block_swap under model.lora")
        if mem.activation_offload and self.train.activation_checkpointing == "none":
            raise ValueError("memory.activation_offload: true offloads the checkpointed blocks' inputs: set "
                             "train.activation_checkpointing: full (or every_<n>), or memory.activation_offload: false")
        if mem.activation_offload and self.train.objective == "vae":
            raise ValueError("memory.activation_offload: true applies to the DiT's forward, not train.objective: vae; "
                             "set memory.activation_offload: false")
        if mem.offload != "none" and not self.scaling.use_gpu:
            raise ValueError(f"memory.offload: {mem.offload} needs a CUDA device (scaling.use_gpu: true): on CPU every "
                             "component is in host memory already; use memory.offload: none")

    def _check_workers(self) -> None:
        """scaling.num_workers (an int >= 1 or [min, max] with 1 <= min <= max), scaling.resize_check_s and
        train.micro_batches_per_step (>= the max worker count)."""
        workers = self.scaling.num_workers
        if not isinstance(workers, int):
            if any(isinstance(w, bool) for w in workers) or not 1 <= workers[0] <= workers[1]:
                raise ValueError(f"scaling.num_workers must be an int >= 1 or [min, max] with 1 <= min <= max, got "
                                 f"{list(workers)}: e.g. [2, 4]")
        elif workers < 1:
            raise ValueError(f"scaling.num_workers must be >= 1, got {workers}")
        given = self.train.micro_batches_per_step
        if given is not None and given < self.data_parallel_workers:
            per_expert = (" per expert (model.experts.layout: groups)"
                          if self.data_parallel_workers < self.scaling.max_workers else "")
            raise ValueError(
                f"train.micro_batches_per_step={given} is smaller than the max worker count{per_expert} "
                f"scaling.num_workers={workers if isinstance(workers, int) else list(workers)}: every worker trains "
                f"at least one micro-batch per step, so no allowed worker count above {given} could keep this "
                f"global batch. Set train.micro_batches_per_step >= {self.data_parallel_workers} (or null: the max "
                f"worker count), or lower the max of scaling.num_workers to {given}"
            )

    def _check_context_parallel(self) -> None:
        """`parallel.context`: a fixed worker count the degree divides, a family whose card supports it, ring only
        on GPU, every bucket's latent tokens (and, for a joint-attention family, `model.max_sequence_length`)
        divisible by the degree, no PowerSGD, no expert groups."""
        context, scaling = self.parallel.context, self.scaling
        degree = context.degree
        if degree == 1:
            return
        card = get_card(self.model.family)
        if not card.context_parallel:
            raise ValueError(f"parallel.context: model.family: {self.model.family} does not support context parallel "
                             "(its card's context_parallel is false: its attention has no split plan); set "
                             "parallel.context.ulysses and .ring to 1")
        if scaling.elastic:
            raise ValueError(f"parallel.context needs a fixed worker count, got scaling.num_workers="
                             f"{list(scaling.num_workers)} (elastic: a resize may leave a count the degree {degree} "
                             f"does not divide); set scaling.num_workers to one multiple of {degree}")
        if scaling.num_workers % degree:
            raise ValueError(f"parallel.context: degree {degree} (ulysses {context.ulysses} x ring {context.ring}) must "
                             f"divide scaling.num_workers ({scaling.describe_workers()}): a sample is split over "
                             f"{degree} workers; use a multiple of {degree} workers")
        if context.ring > 1 and not scaling.use_gpu:
            raise ValueError(f"parallel.context.ring: {context.ring} needs GPUs (scaling.use_gpu: true): ring attention "
                             "merges partial results by their log-sum-exp, which only the flash / cuDNN backends "
                             "return; on CPU use parallel.context.ulysses")
        if self.train.grad_compression == "powersgd":
            raise ValueError("parallel.context with train.grad_compression: powersgd is not supported (PowerSGD's "
                             "hook averages over every worker, a context group's ranks hold partial sums); use "
                             "train.grad_compression: none, fp16, bf16 or int4")
        if self.model.experts is not None and self.model.experts.layout == "groups":
            raise ValueError("parallel.context with model.experts.layout: groups is not supported yet; use "
                             "model.experts.layout: shared (both experts on every worker, each split over the group)")
        joint = card.planner is not None and card.planner.token_flow in ("dual_stream", "single_stream")
        if joint and self.model.max_sequence_length % degree:
            raise ValueError(f"parallel.context: model.max_sequence_length {self.model.max_sequence_length} is not "
                             f"divisible by the context degree {degree} ({self.model.family} attends over text and "
                             f"video jointly, so its text tokens are split too); set it to a multiple of {degree}")
        rules = card.bucket_rules
        for bucket in self.data.buckets:
            frames, height, width = bucket
            tokens = ((frames - 1) // rules.temporal_compression + 1) * (height // rules.spatial_multiple) * (
                width // rules.spatial_multiple)
            if tokens % degree:
                raise ValueError(f"parallel.context: bucket {list(bucket)} has {tokens} latent tokens, not divisible by "
                                 f"the context degree {degree} (each worker takes an equal share); pick a bucket whose "
                                 f"tokens divide by {degree}, or another degree")

    def _check_expert_groups(self) -> None:
        """`model.experts.layout: groups`: an even, fixed worker count (half per expert), no fp16, and expert
        selectors that agree with `placement.dit`'s (`scaling.strategy` is checked in `_check_strategy`)."""
        experts = self.model.experts
        if experts is None or experts.layout != "groups":
            return
        scaling = self.scaling
        if scaling.elastic:
            raise ValueError(f"model.experts.layout: groups needs a fixed worker count (half per expert), got "
                             f"scaling.num_workers={list(scaling.num_workers)} (elastic): set scaling.num_workers to "
                             "one even number, e.g. 2, or model.experts.layout: shared")
        if scaling.num_workers < 2 or scaling.num_workers % 2:
            raise ValueError(f"model.experts.layout: groups gives half of the workers to each expert, got "
                             f"scaling.num_workers={scaling.num_workers}: set scaling.num_workers to an even number, "
                             "or model.experts.layout: shared")
        if self.train.mixed_precision == "fp16":
            raise ValueError("train.mixed_precision: fp16 with model.experts.layout: groups is not supported (each "
                             "expert's group would keep its own loss scale): use train.mixed_precision: bf16, or "
                             "model.experts.layout: shared")

        expert_selectors(self)  # raises for a key both selectors give different values

    def _check_scale(self) -> None:
        """Precision, activation checkpointing, accumulation, compression and EMA keys (issue 28)."""
        train = self.train
        self._check_strategy()
        if train.mixed_precision == "fp16" and not self.scaling.use_gpu:
            raise ValueError("train.mixed_precision: fp16 needs CUDA (scaling.use_gpu: true): on CPU fp16 autocast "
                             "brings no speed and its loss scaling nothing; use train.mixed_precision: bf16")
        if train.grad_compression == "bf16" and not self.scaling.use_gpu:
            raise ValueError("train.grad_compression: bf16 needs NCCL (scaling.use_gpu: true): torch's bf16 hook does "
                             "not run over gloo; on CPU use train.grad_compression: fp16 (the same bytes)")
        if parse_activation_checkpointing(train.activation_checkpointing) > 1 and train.objective != "vae":
            if get_card(self.model.family).blocks is None:  # every_<n> wraps every n-th block of the card's list
                raise ValueError(
                    f"train.activation_checkpointing: {train.activation_checkpointing}: model.family "
                    f"{self.model.family} has no list of transformer blocks to take every n-th of (families with "
                    f"one: {_families_with('blocks')}); use full (diffusers' gradient checkpointing) or none")
        if train.grad_accumulation_steps is not None:
            if train.micro_batches_per_step is not None:
                raise ValueError("give train.grad_accumulation_steps or train.micro_batches_per_step, not both: "
                                 "micro_batches_per_step = max workers x grad_accumulation_steps")
        self._check_validation()
        if self.export.weights == "ema" and train.ema is None:
            raise ValueError("export.weights: ema needs train.ema (e.g. train.ema: {decay: 0.9999}); or set "
                             "export.weights: trained")

    def _check_validation(self) -> None:
        """train.validation: a cadence on checkpoints, prompts, sampler settings (the prompts' token counts are
        checked before the run starts, `vidray.train.trainer.check_job_inputs`)."""
        val = self.train.validation
        if val.every_steps is None:
            if val.prompts:
                raise ValueError(f"train.validation.prompts lists {len(val.prompts)} prompt(s) but "
                                 "train.validation.every_steps is not set, so they would never be sampled: set "
                                 "train.validation.every_steps (a multiple of checkpoint.every_steps), or remove "
                                 "train.validation.prompts")
            return
        every = self.checkpoint.every_steps
        if val.every_steps < 1 or val.every_steps % every:
            raise ValueError(f"train.validation.every_steps={val.every_steps} must be a multiple of "
                             f"checkpoint.every_steps={every} (validation samples the checkpoint of its step): e.g. "
                             f"{every * max(1, round(val.every_steps / every))}")
        if not val.prompts or any(not str(p).strip() for p in val.prompts):
            raise ValueError("train.validation.prompts must list the fixed prompts to sample, none empty: e.g. "
                             "train.validation.prompts: [\"a red kite over a beach\"]")
        if val.images and self.model.i2v is None:
            raise ValueError("train.validation.images are first frames for an image-to-video model: set model.i2v, "
                             "or remove train.validation.images")
        if val.images and len(val.images) != len(val.prompts):
            raise ValueError(f"train.validation.images must give one image per prompt: {len(val.images)} images "
                             f"for {len(val.prompts)} prompts")
        if val.bucket is not None:
            parse_bucket(val.bucket, self.model.family)  # the family's rule (AnimateDiff: 16 frames)

    def _check_strategy(self) -> None:
        """scaling.strategy, scaling.shard_group_size and what FSDP/HSDP do not support (issue 28 item 3)."""
        scaling, train = self.scaling, self.train
        if scaling.strategy == "hsdp":
            group = scaling.shard_group_size
            if group is None:
                raise ValueError("scaling.strategy: hsdp needs scaling.shard_group_size (workers per shard group, "
                                 "dividing scaling.num_workers), e.g. 2")
            counts = sorted({scaling.min_workers, scaling.max_workers})
            bad = [n for n in counts if n % group]
            if bad:
                raise ValueError(f"scaling.shard_group_size={group} must divide the worker count "
                                 f"(scaling.num_workers {bad[0]}): pick a divisor of {bad[0]}")
        elif scaling.shard_group_size is not None:
            raise ValueError(f"scaling.shard_group_size is for scaling.strategy: hsdp only, got strategy "
                             f"{scaling.strategy}: remove it or set scaling.strategy: hsdp")
        if scaling.strategy == "ddp":
            if self.model.experts is not None and train.grad_compression == "powersgd":
                raise ValueError("model.experts with train.grad_compression: powersgd is not supported (each step "
                                 "leaves one expert without gradients on some workers); use none, fp16, bf16 or int4")
            if self.model.experts is not None and self.flow.num_train_timesteps != 1000:
                raise ValueError(f"model.experts needs flow.num_train_timesteps 1000 (the experts' boundary is "
                                 f"boundary_ratio x 1000, as Wan 2.2's scheduler has it), got "
                                 f"{self.flow.num_train_timesteps}")
            return
        card = get_card(self.model.family)
        if card.blocks is None:
            raise ValueError(f"scaling.strategy: {scaling.strategy} shards a transformer's blocks, and model.family "
                             f"{self.model.family} has none to shard (families with FSDP: "
                             f"{_families_with('blocks')}): set scaling.strategy: ddp")
        if self.model.init == "pretrained" and not card.meta_build:
            raise ValueError(f"model.init: pretrained with scaling.strategy: {scaling.strategy} is not supported for "
                             f"model.family {self.model.family} yet (its transformer does not build on the meta "
                             f"device; families that do: {_families_with('meta_build')}): set scaling.strategy: "
                             "ddp")
        if self.model.experts is not None and self.model.experts.layout == "shared":
            raise ValueError(f"model.experts.layout: shared trains with scaling.strategy: ddp only (every worker holds "
                             f"both experts, replicated), got {scaling.strategy}: set scaling.strategy: ddp, or "
                             "model.experts.layout: groups to shard each expert within its half of the workers")
        if self.model.experts is not None and scaling.strategy == "hsdp":
            raise ValueError("model.experts.layout: groups shards each expert over its half of the workers with "
                             "scaling.strategy: fsdp; hsdp is not supported with two experts: set scaling.strategy: "
                             "fsdp")
        if train.grad_compression != "none":
            raise ValueError(f"train.grad_compression: {train.grad_compression} is a DDP communication hook; with "
                             f"scaling.strategy: {scaling.strategy} gradients are reduce-scattered in fp32 "
                             "(MixedPrecisionPolicy's reduce_dtype, the FSDP analogue): set train.grad_compression: "
                             "none")
        # train.ema, model.lora and fp16 are sharded like the weights (vidray.train.parallel, .checkpoint): fine.

    @property
    def micro_batches_per_step(self) -> int:
        """G: `train.micro_batches_per_step`, or the data-parallel workers x `train.grad_accumulation_steps` (1
        when null). With `model.experts.layout: groups` G is each expert's: both groups deal the one schedule."""
        given = self.train.micro_batches_per_step
        if given is not None:
            return int(given)
        return self.data_parallel_workers * (self.train.grad_accumulation_steps or 1)

    @property
    def data_parallel_workers(self) -> int:
        """The (max) data-parallel ranks a gradient is averaged over: every worker, or with `model.experts.layout:
        groups` each expert's half (`vidray.train.expert_groups`), divided by the context-parallel degree (a
        context group's workers train one micro-batch together)."""
        experts = self.model.experts
        groups = experts is not None and experts.layout == "groups"
        workers = self.scaling.max_workers // 2 if groups else self.scaling.max_workers
        return workers // self.parallel.context.degree

    @property
    def global_batch_size(self) -> int:
        """Samples per optimizer step at most: G micro-batches of `data.batch_size_per_worker` (a bucket's own batch
        size may be smaller: `data.tokens_per_batch`)."""
        return self.micro_batches_per_step * self.data.batch_size_per_worker

    @property
    def run_dir(self) -> Path:
        """`<storage.path>/<name>`: where this run's checkpoints, weights and samples live."""
        return Path(self.storage.path) / self.name

    def to_dict(self) -> dict[str, Any]:
        """Plain dict (buckets as lists) that `job_config_from_dict` reads back; saved with every checkpoint."""
        return _ADAPTER.dump_python(self, mode="json")


_ADAPTER = TypeAdapter(JobConfig)
