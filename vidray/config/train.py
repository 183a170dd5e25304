"""`flow:`, `optim:`, `train:` (with `train.ema`, `train.validation`), `export:`, `vae_training:`,
`checkpoint:` and `scaling:`: how a run trains, saves and scales."""

from __future__ import annotations

import dataclasses
import re
from typing import Annotated, Any, Literal

from pydantic import Field, field_validator
from pydantic.dataclasses import dataclass

from vidray.config.bounds import AtLeastOne, NonNegativeFloat, NonNegativeInt, OpenFraction, PositiveFloat, Says
from vidray.config.common import _STRICT


@dataclass(config=_STRICT, kw_only=True)
class FlowConfig:
    sigma_sampling: Literal["uniform", "logit_normal"] = "logit_normal"
    """How training draws sigmas in [0, 1]: uniform, or sigmoid(N(logit_mean, logit_std)) (SD3, Esser et al. 2024)."""
    logit_mean: float = 0.0
    """Mean of the normal whose sigmoid gives sigma (`sigma_sampling: logit_normal`); 0.0 centres sigmas on 0.5."""
    logit_std: Annotated[PositiveFloat, Says(note=" (default 1.0)")] = 1.0
    """Standard deviation of that normal (> 0); larger spreads sigmas towards 0 and 1."""
    shift: PositiveFloat = 1.0
    """sigma <- shift*sigma / (1 + (shift-1)*sigma); 1.0 = no shift. Used in training and sampling alike."""
    num_train_timesteps: Annotated[AtLeastOne, Says(note=" (default 1000)")] = 1000
    """timesteps = sigmas * num_train_timesteps at the model call."""


@dataclass(config=_STRICT, kw_only=True)
class OptimConfig:
    lr: PositiveFloat = 1.0e-4
    """Peak AdamW learning rate, reached after `warmup_steps`."""
    betas: tuple[float, float] = (0.9, 0.999)
    """AdamW's (beta1, beta2): decay rates of the gradient's running mean and of its square, each in [0, 1)."""
    weight_decay: Annotated[NonNegativeFloat, Says(note=" (default 0.01)")] = 0.01
    """AdamW's decoupled weight decay (>= 0): each step multiplies the weights by (1 - lr x weight_decay)."""
    eps: Annotated[PositiveFloat, Says(note=" (default 1e-8)")] = 1.0e-8
    """AdamW's epsilon (> 0), added to the denominator for numerical stability."""
    warmup_steps: Annotated[NonNegativeInt, Says("optimizer steps")] = 0
    """Linear warmup from 0 to `lr` over this many optimizer steps, then constant."""


def parse_activation_checkpointing(value: str) -> int:
    """`train.activation_checkpointing` as a block stride: `none` -> 0, `full` -> 1, `every_<n>` -> n (>= 1).
    Raises ValueError naming the key and the valid forms."""
    if value in ("none", "full"):
        return 0 if value == "none" else 1
    match = re.fullmatch(r"every_([0-9]{1,4})", value)
    if match and int(match.group(1)) >= 1:
        return int(match.group(1))
    raise ValueError(f"train.activation_checkpointing must be none, full or every_<n> with n >= 1 (every n-th "
                     f"transformer block), got {value!r}")


@dataclass(config=_STRICT, kw_only=True)
class EMAConfig:
    decay: Annotated[OpenFraction, Says(note=" (e.g. 0.9999)")] = 0.9999
    """ema <- decay * ema + (1 - decay) * weights, at every update (0 < decay < 1)."""
    update_every_steps: AtLeastOne = 1
    """Optimizer steps between EMA updates (>= 1)."""


@dataclass(config=_STRICT, kw_only=True)
class ValidationConfig:
    every_steps: int | None = None
    """Sample `prompts` from the checkpoint of every this many steps (a multiple of `checkpoint.every_steps`),
    in an actor beside the training (`vidray.train.validation`): one mp4 per prompt and a PNG grid of their
    frames in `<run>/validation/step_<N>/`, and the videos in TensorBoard. null: no validation."""
    prompts: list[str] = dataclasses.field(default_factory=list)
    """The fixed prompts sampled at each validation (each with the same seed every time); they need `every_steps`
    (prompts without it fail at load)."""
    images: list[str] = dataclasses.field(default_factory=list)
    """An image-to-video model's (`model.i2v`) fixed first frames, one image file (PNG, JPEG) per prompt, each
    conditioning its prompt's sample as `vidray generate --image` does; empty: text-only samples (the empty
    condition)."""
    num_inference_steps: AtLeastOne = 8
    """Denoising steps of each validation sample."""
    guidance_scale: Annotated[float, Field(ge=1.0, allow_inf_nan=False), Says("(1.0: no guidance)")] = 1.0
    """Classifier-free guidance scale of the samples (1.0: none)."""
    seed: int = 0
    """Seed of the samples' initial noise (the same at every validation, so the videos compare)."""
    bucket: str | None = None
    """`FxHxW` of the samples; null: the job's first multi-frame bucket."""
    num_cpus: Annotated[PositiveFloat, Says("logical CPUs")] = 0.5
    """Logical CPUs of the validation actor (it runs where `placement.vae` allows: it loads the VAE and text
    encoder), so validation runs beside the training instead of stalling it."""


@dataclass(config=_STRICT, kw_only=True)
class ExportConfig:
    weights: Literal["trained", "ema"] = "trained"
    """Which transformer weights the diffusers export at the end of training holds: the trained ones, or their EMA
    (`train.ema` must be set)."""


@dataclass(config=_STRICT, kw_only=True)
class VAETrainingConfig:
    """`vidray train-vae`: the family's VAE trained on the prepared clips with a reconstruction + KL loss
    (`vidray.train.vae`), with the job's data, checkpoint and scaling sections, in the run `<name>-vae`."""

    max_steps: AtLeastOne = 200
    """Optimizer steps of the VAE run (its `train.max_steps`)."""
    lr: float = 2.0e-3
    """Peak AdamW learning rate of the VAE run (its `optim.lr`; the other `optim` keys are the job's)."""
    warmup_steps: int = 0
    """Linear lr warmup steps of the VAE run (its `optim.warmup_steps`)."""
    batch_size_per_worker: AtLeastOne | None = None
    """Clips per micro-batch on each worker in the VAE run; null: `data.batch_size_per_worker`."""
    l1_weight: float = 1.0
    """Weight of the mean absolute reconstruction error (video in [-1, 1])."""
    mse_weight: float = 0.0
    """Weight of the mean squared reconstruction error."""
    kl_weight: float = 1.0e-6
    """Weight of the posterior's KL divergence to N(0, I), summed over the latent's elements (Rombach et al. 2022,
    LDM's KL-f8 autoencoders use 1e-6)."""


@dataclass(config=_STRICT, kw_only=True)
class TrainConfig:
    objective: Literal["flow_matching", "vae"] = "flow_matching"
    """What the run trains: `flow_matching` the DiT (`vidray train`), `vae` the VAE (set by `vidray train-vae`,
    which names the run `<name>-vae`)."""
    max_steps: AtLeastOne = 100
    """Optimizer steps in the whole run (a resumed run continues up to this number)."""
    grad_clip_norm: Annotated[PositiveFloat, Says(
        "(no clipping)", ": a negative norm flips the gradients' sign and 0 zeroes them")] | None = 1.0
    """Max global L2 norm of gradients; null disables clipping."""
    log_every_steps: AtLeastOne = 10
    """Steps between loss/step-time reports (each report is a Ray Train barrier and a host sync)."""
    seed: NonNegativeInt = 0
    """Seed of model init, noise, sigmas and the data schedule."""
    mixed_precision: Literal["no", "bf16", "fp16"] = "no"
    """Autocast dtype of the DiT forward and backward (`torch.autocast`): `bf16` on CPU and CUDA; `fp16` on CUDA
    only, with a `torch.amp.GradScaler` (`ShardedGradScaler` under FSDP/HSDP) whose state is checkpointed. Weights
    and optimizer state stay fp32 (`vidray.train.precision`)."""
    activation_checkpointing: str = "none"
    """Recompute transformer blocks' activations in the backward instead of keeping them: `none`, `full` (every
    block) or `every_<n>` (every n-th block, e.g. `every_2`; only for a family with a list of transformer blocks,
    its card's `blocks`: not AnimateDiff, refused at load). Same gradients, less memory, ~1/3 more
    compute (`vidray.train.parallel.apply_activation_checkpointing`)."""
    grad_accumulation_steps: Annotated[AtLeastOne, Says("micro-batches per worker")] | None = None
    """Micro-batches each worker accumulates per optimizer step: the global batch is `data.batch_size_per_worker` x
    the max worker count x this (printed at start). Sets `micro_batches_per_step` to max workers x this; null: 1
    (or whatever `micro_batches_per_step` says). Give one of the two, not both."""
    grad_compression: Literal["none", "fp16", "bf16", "int4", "powersgd"] = "none"
    """DDP communication hook compressing the gradient all-reduce (torch's `default_hooks.fp16_compress_hook` /
    `bf16_compress_hook`; `int4`: vidray's 4-bit two-phase all-reduce, 0.13 of the bytes,
    `vidray.train.compressed_allreduce`; or `powerSGD_hook` of rank `powersgd_rank`, whose error-feedback state is
    checkpointed, and which fits slower with AdamW: docs/training-at-scale.md)."""
    powersgd_rank: Annotated[AtLeastOne, Says(note=" (default 4)")] = 4
    """Rank of PowerSGD's low-rank gradient approximation (`grad_compression: powersgd`; Vogels et al. 2019)."""
    bucket_cap_mb: Annotated[PositiveFloat, Says("MiB", " (default 25)")] = 25.0
    """DDP gradient bucket size in MiB: all-reduce of a full bucket overlaps the rest of the backward (torch's
    default 25)."""
    ema: EMAConfig | None = None
    """Exponential moving average of the trained weights (`vidray.train.ema`), kept in the checkpoint, used for
    validation and exported with `export.weights: ema`; null: none. Rank 0 keeps it under DDP; under FSDP/HSDP every
    rank keeps the average of its own shards."""
    validation: ValidationConfig = dataclasses.field(default_factory=ValidationConfig)
    """Validation samples from fixed prompts during training (`vidray.train.validation`)."""
    max_failures: int = 2
    """Worker-group restarts (from the latest checkpoint) before the run fails; -1 retries forever."""
    micro_batches_per_step: int | None = None
    """The global batch, G micro-batches per optimizer step (each of its bucket's batch size); null: the (max)
    worker count, `scaling.num_workers` (or its max). Rank r of W trains micro-batches r, r+W, ... of the step
    with gradient accumulation, so the step's samples and loss (the mean over its real samples) do not depend on
    W: an elastic run keeps its global batch when it shrinks or grows. Must be >= the max worker count (every
    worker needs one micro-batch). With `model.experts.layout: groups` it is each expert's global batch, over
    its half of the workers (both experts train on the same samples)."""
    ray_metrics: bool = True
    """Record the training series (`vidray.metrics`) through Ray's metrics agent too (`ray.util.metrics`: each node's
    metrics export port carries them as `ray_vidray_*`); false: only the run folder's `.prom` files and the opt-in
    `metrics_port` endpoint. `benchmarks/metrics_export.py` measures its cost per step."""
    metrics_port: Annotated[int, Field(ge=1, le=65535 - 64), Says("(rank N serves on metrics_port + N)")] | None = None
    """Opt-in, for runs without Ray's metrics agent: each training worker also serves its Prometheus metrics
    (`vidray_*`, `vidray.metrics`) over HTTP on 127.0.0.1:(metrics_port + rank); null: no endpoint. Either way
    they go through Ray's metrics agent (`ray_vidray_*` on each node's metrics export port) and are written to
    `<run_dir>/metrics/rank_<N>.prom` (Prometheus text format) at every report."""


@dataclass(config=_STRICT, kw_only=True)
class CheckpointConfig:
    every_steps: AtLeastOne = 50
    """Steps between checkpoints (the last step is always checkpointed)."""
    num_to_keep: Annotated[AtLeastOne, Says("(keep all)")] | None = 2
    """Newest checkpoints kept by Ray Train (>= 1); null keeps all."""
    resume_from: str | None = None
    """A checkpoint folder to start from; by default the run resumes from its own latest checkpoint, if any."""
    resume: Literal["auto", "never", "must"] = "auto"
    """What a run whose name already has checkpoints does: `auto` resumes from the latest complete one (or
    `resume_from`) and starts afresh when there is none; `never` refuses to start when the run folder holds any
    checkpoint (nothing is overwritten: pick a new name); `must` refuses to start without a checkpoint to resume
    (a re-submitted job that lost its run folder fails instead of silently training from step 1)."""
    upload: Literal["async", "sync"] = "async"
    """How a checkpoint reaches `storage.path`: `async` blocks the step only while rank 0 writes the parts to a
    local temp folder, then copies them to the run folder in the background (Ray Train's asynchronous upload; the
    next checkpoint waits for the previous copy); `sync` blocks until the copy is done. Either way the copy is
    retried, and the manifest goes last, so an interrupted copy is never taken for a complete checkpoint. A sharded
    checkpoint (`scaling.strategy: fsdp | hsdp`) with `async` is also written in the background (`dcp.async_save`:
    the step waits for the copy of each rank's state to CPU memory) and reported at the first log step after
    every rank's write is done."""


@dataclass(config=_STRICT, kw_only=True)
class ScalingConfig:
    num_workers: int | tuple[int, int] = 2
    """DDP workers (processes); gloo on CPU, NCCL on GPU. An int: that many, always. `[min, max]`: elastic (Ray
    Train's elastic mode): the run starts with as many workers as the cluster can place, up to max, and at least
    min; after a worker or node loss the group restarts from the latest checkpoint with the workers it can place
    (>= min), and while healthy it grows back (restarting from the latest checkpoint) when more can be placed,
    checked every `resize_check_s`. The global batch stays `train.micro_batches_per_step` micro-batches whatever
    the count (`vidray.data.schedule`)."""
    use_gpu: bool = False
    """One GPU per worker and NCCL between them; false: CPU workers over gloo."""
    cpus_per_worker: PositiveFloat = 1.0
    """Logical CPUs reserved per worker (fractions allowed)."""
    resize_check_s: Annotated[NonNegativeFloat, Says("seconds", " (default 60)")] = 60.0
    """Elastic runs only: seconds between checks, while training, whether more workers can be placed (Ray Train's
    `elastic_resize_monitor_interval_s`); growing restarts the group from the latest checkpoint."""
    strategy: Literal["ddp", "fsdp", "hsdp"] = "ddp"
    """Data parallelism (`vidray.train.parallel`): `ddp` replicates the transformer on every worker; `fsdp` shards
    its parameters, gradients and optimizer state over the workers (FSDP2 `fully_shard` per transformer block, then
    the root; checkpoints are sharded `torch.distributed.checkpoint` folders); `hsdp` shards within groups of
    `shard_group_size` workers and replicates across groups. With `model.lora` the frozen base is sharded too and
    only the adapters train and are checkpointed; an EMA (`train.ema`) is sharded like the weights."""
    reshard_after_forward: bool = True
    """FSDP/HSDP: free each block's gathered parameters after its forward (all-gathered again for the backward):
    less memory, one more all-gather per block and step."""
    shard_group_size: AtLeastOne | None = None
    """HSDP only (required there): workers per shard group; must divide the worker count."""

    @field_validator("num_workers", mode="before")
    @classmethod
    def _check_num_workers_shape(cls, value: Any) -> Any:
        if isinstance(value, (list, tuple)) and (
            len(value) != 2 or not all(isinstance(v, int) and not isinstance(v, bool) for v in value)
        ):
            raise ValueError(f"scaling.num_workers must be an int or [min, max] of two ints, got {list(value)}: "
                             "e.g. 2, or [2, 4] for an elastic run")
        return value

    @property
    def min_workers(self) -> int:
        """The fewest workers the run trains with (`num_workers`, or its min)."""
        return self.num_workers if isinstance(self.num_workers, int) else int(self.num_workers[0])

    @property
    def max_workers(self) -> int:
        """The most workers the run trains with (`num_workers`, or its max)."""
        return self.num_workers if isinstance(self.num_workers, int) else int(self.num_workers[1])

    @property
    def elastic(self) -> bool:
        """True for a `[min, max]` range (even min == max: Ray Train's elastic mode)."""
        return not isinstance(self.num_workers, int)

    def describe_workers(self) -> str:
        """'1 worker', '2 workers' or '2-4 workers (elastic)', for messages."""
        if not self.elastic:
            return f"{self.num_workers} worker{'' if self.num_workers == 1 else 's'}"
        return f"{self.min_workers}-{self.max_workers} workers (elastic)"


@dataclass(config=_STRICT, kw_only=True)
class ContextParallelConfig:
    """Context (sequence) parallel: one sample's tokens split over `ulysses * ring` consecutive workers, each
    attention gathering what it needs (`vidray.models.context_parallel`, diffusers' context-parallel hooks): Wan's
    video tokens (its text stays whole), EasyAnimate's and CogVideoX's text and video. The group's workers train the
    same micro-batches, so the data-parallel width is the workers divided by the degree. Supported by the families
    whose card says `context_parallel` (Wan, EasyAnimate, CogVideoX)."""

    ulysses: Annotated[AtLeastOne, Says(note=" (default 1)")] = 1
    """Ulysses degree: heads are exchanged by all-to-all so each worker attends over the whole sequence with
    heads / ulysses heads; must divide the transformer's attention heads."""
    ring: Annotated[AtLeastOne, Says(note=" (default 1)")] = 1
    """Ring degree: keys and values pass around the ring; needs a GPU attention backend that returns the
    log-sum-exp (flash or cuDNN), so CPU runs keep it 1."""
    cross_node: bool = False
    """Allow a context-parallel group to span nodes (its all-to-all then crosses the network every layer); false:
    a group larger than a node's GPUs is refused when the workers start."""

    @property
    def degree(self) -> int:
        """Workers one sample is split over: ulysses x ring."""
        return self.ulysses * self.ring


@dataclass(config=_STRICT, kw_only=True)
class ParallelConfig:
    """Splitting one sample's work over several workers (`vidray.train.loop` builds the mesh: data-parallel ranks
    outermost, each context group consecutive workers)."""

    context: ContextParallelConfig = dataclasses.field(default_factory=ContextParallelConfig)
    """Context (sequence) parallel degrees (`parallel.context.ulysses`, `.ring`); both 1: off."""
