"""Parallelism in one place: activation checkpointing, then FSDP2 (sharded) or DDP with its communication hook.

`parallelize(transformer, job, device)` is the one call the training loop makes (torchtitan's `parallelize_llama`:
`apply_ac`, then the data-parallel wrapper); the loop never branches on the strategy afterwards.

- Activation checkpointing (`train.activation_checkpointing`): `full` turns on the diffusers model's own
  `gradient_checkpointing` (every transformer block recomputed in the backward, `torch.utils.checkpoint` without
  reentrancy); `every_<n>` wraps every n-th block in torch's `checkpoint_wrapper` (as torchtitan's selective AC does).
  Either way the gradients equal those without it: the recompute is the same forward.
- DDP (`wrap_ddp`, what Ray Train's `prepare_model` does; gloo on CPU and NCCL on GPU) with `train.bucket_cap_mb`
  (the all-reduce of a full bucket overlaps the rest of the backward) and `train.grad_compression`'s hook: torch's
  `default_hooks.fp16_compress_hook` / `bf16_compress_hook` (the bucket is cast, all-reduced and cast back: half the
  bytes) or `powerSGD_hook.powerSGD_hook` (rank-r factors P, Q of each bucket's gradient matrix instead of the matrix,
  with error feedback; Vogels et al., "PowerSGD: Practical Low-Rank Gradient Compression", NeurIPS 2019).
  PowerSGD keeps per-rank state (the error feedback and warm-start factors): `CommHook.gather_state` collects every
  rank's for the checkpoint, so a resume at the same worker count continues it exactly.
- FSDP2 (`scaling.strategy: fsdp | hsdp`; torchtitan's `apply_fsdp`): `fully_shard` per transformer block, then the
  root, with a `MixedPrecisionPolicy` from `train.mixed_precision` (reduce in fp32). Gradient accumulation goes
  through `gradient_sync` for DDP and FSDP alike; checkpoints of a sharded model are DCP folders
  (`vidray.train.checkpoint.save_sharded_checkpoint`); `gather_full_state` gives rank 0 the full weights for
  the export. Sources: torchtitan `torchtitan/models/llama3/infra/parallelize.py`; torch docs "FSDP2 (fully_shard)"
  and "Distributed Checkpoint - torch.distributed.checkpoint".
"""

from __future__ import annotations

import contextlib
import dataclasses
import warnings
from pathlib import Path
from typing import Any, Callable

import numpy as np
import torch
import torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh

from vidray.config import JobConfig, parse_activation_checkpointing
from vidray.logs import is_verbose, stderr_without
from vidray.models.context_parallel import context_parallel_mesh, enable_context_parallel
from vidray.models.experts import EXPERT_ATTRIBUTES, ExpertSlot, TwoExperts
from vidray.models.lora import has_lora, init_adapters, is_adapter_parameter
from vidray.models.storage import frozen_parameter_names
from vidray.train.compressed_allreduce import int4_compress_hook

POWERSGD_START_ITER = 2
"""PowerSGD compresses from the 2nd synchronised backward on (the 1st all-reduces plainly: torch requires > 1 with
error feedback, and DDP rebuilds its buckets after the first iteration)."""


ORTHOGONALIZATION_EPSILON = 1e-8
"""Added to the norms in PowerSGD's Gram-Schmidt: a bucket holding an all-zero gradient matrix (parameters whose
gradient is still zero, e.g. zero-initialised output layers) otherwise divides 0 by 0 and the loss turns NaN
(seen on the tiny transformer at step 5 with torch's default 0)."""


def apply_activation_checkpointing(transformer: torch.nn.Module, setting: str,
                                   blocks: list[torch.nn.ModuleList] | None = None) -> int:
    """Turn on activation checkpointing of `transformer`'s blocks per `train.activation_checkpointing`; returns
    how many blocks are checkpointed. `blocks`: the block lists (`ModelFamily.block_lists`: one per expert of a
    two-expert model); default `[transformer.transformer_blocks]`.

    `full` uses the model's `enable_gradient_checkpointing()` when it has one (diffusers models), else wraps every
    block; `every_<n>` wraps blocks 0, n, 2n, ... of each list in
    `torch.distributed.algorithms._checkpoint.checkpoint_wrapper.checkpoint_wrapper` (non-reentrant; the wrapper's
    state-dict hooks keep parameter names unchanged in `state_dict()` and in `torch.distributed.checkpoint`'s
    helpers). Raises ValueError for a bad setting and for a model without blocks.
    """
    stride = parse_activation_checkpointing(setting)
    if stride == 0:
        return 0
    if blocks is None and isinstance(getattr(transformer, "transformer_blocks", None), torch.nn.ModuleList):
        blocks = [transformer.transformer_blocks]
    if stride == 1 and hasattr(transformer, "enable_gradient_checkpointing"):
        transformer.enable_gradient_checkpointing()  # diffusers: every block that supports it
        if blocks is None:
            return sum(1 for m in transformer.modules() if getattr(m, "gradient_checkpointing", False) is True)
        return sum(len(b) for b in blocks)
    if blocks is None:
        raise ValueError(f"train.activation_checkpointing: {setting}: {type(transformer).__name__} has no list of "
                         "blocks to checkpoint; set it to none (or full for a diffusers model)")
    from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import (  # heavy: torch
        CheckpointImpl,
        checkpoint_wrapper,
    )

    for one in blocks:
        for i in range(0, len(one), stride):
            one[i] = checkpoint_wrapper(one[i], checkpoint_impl=CheckpointImpl.NO_REENTRANT)
    return sum(len(range(0, len(one), stride)) for one in blocks)


def gather_to_rank0(obj: Any, rank: int, world_size: int) -> list[Any] | None:
    """Every rank's picklable `obj`, by rank, on rank 0 (`dist.gather_object`; a collective: every rank calls it);
    None on the other ranks. One process: `[obj]`, no process group needed."""
    if world_size == 1:
        return [obj]
    gathered = [None] * world_size if rank == 0 else None
    dist.gather_object(obj, gathered, dst=0)
    return gathered


@dataclasses.dataclass
class CommHook:
    """The DDP communication hook of a run (`train.grad_compression`) and its state.

    kind: `none`, `fp16`, `bf16`, `int4` or `powersgd`; state: PowerSGD's `PowerSGDState` (None otherwise: the
    other hooks keep no state).
    """

    kind: str
    state: Any = None

    def gather_state(self, rank: int, world_size: int) -> dict[str, Any] | None:
        """Every rank's hook state gathered to rank 0 (a collective: every rank calls it at a checkpoint):
        {"kind", "world_size", "powersgd_rank", "per_rank": [state of rank 0, 1, ...]} on rank 0 (CPU tensors), None
        on the other ranks and for hooks without state."""
        if self.state is None:
            return None
        parts = gather_to_rank0(_powersgd_state_dict(self.state), rank, world_size)
        if rank != 0:
            return None
        return {"kind": self.kind, "world_size": world_size,
                "powersgd_rank": self.state.matrix_approximation_rank, "per_rank": parts}

    def load_state(self, saved: dict[str, Any] | None, rank: int, world_size: int) -> str | None:
        """Restore this rank's state from a checkpoint's `gather_state` output. Returns None when restored (or
        nothing to restore), else why it starts afresh (another hook, worker count or rank): a line for the log."""
        if self.state is None:
            return None
        if saved is None:
            return "the checkpoint holds no PowerSGD state: its error feedback starts afresh"
        if saved.get("kind") != self.kind or saved.get("powersgd_rank") != self.state.matrix_approximation_rank:
            return (f"the checkpoint's gradient compression was {saved.get('kind')} (rank "
                    f"{saved.get('powersgd_rank')}): PowerSGD's error feedback starts afresh")
        if saved.get("world_size") != world_size:
            return (f"the checkpoint was written by {saved.get('world_size')} workers, this run has {world_size}: "
                    "PowerSGD's per-rank error feedback starts afresh")
        _load_powersgd_state_dict(self.state, saved["per_rank"][rank])
        return None


def _powersgd_state_dict(state) -> dict[str, Any]:
    """A PowerSGDState's evolving fields as plain tensors and numbers (`torch.load(weights_only=True)` reads it)."""
    name, keys, pos, has_gauss, cached = state.rng.get_state()
    to_cpu = lambda d: {int(k): v.detach().cpu().clone() for k, v in d.items()}  # noqa: E731
    return {"iter": int(state.iter), "error_dict": to_cpu(state.error_dict),
            "p_memory_dict": to_cpu(state.p_memory_dict), "q_memory_dict": to_cpu(state.q_memory_dict),
            "rng": {"name": name, "keys": torch.from_numpy(keys.astype(np.int64)), "pos": int(pos),
                    "has_gauss": int(has_gauss), "cached_gaussian": float(cached)},
            "total_numel_before_compression": int(state.total_numel_before_compression),
            "total_numel_after_compression": int(state.total_numel_after_compression),
            "next_stats_report": int(state.next_stats_report)}


def _load_powersgd_state_dict(state, saved: dict[str, Any]) -> None:
    device = lambda d: {k: v.to(_state_device()) for k, v in d.items()}  # noqa: E731
    state.iter = saved["iter"]
    state.error_dict = device(saved["error_dict"])
    state.p_memory_dict = device(saved["p_memory_dict"])
    state.q_memory_dict = device(saved["q_memory_dict"])
    rng = saved["rng"]
    state.rng.set_state((rng["name"], rng["keys"].numpy().astype(np.uint32), rng["pos"], rng["has_gauss"],
                         rng["cached_gaussian"]))
    state.total_numel_before_compression = saved["total_numel_before_compression"]
    state.total_numel_after_compression = saved["total_numel_after_compression"]
    state.next_stats_report = saved["next_stats_report"]


def _state_device() -> torch.device:
    return torch.device("cuda", torch.cuda.current_device()) if torch.cuda.is_available() else torch.device("cpu")


def comm_hook_for(kind: str, *, powersgd_rank: int, start_step: int = POWERSGD_START_ITER, warm_start: bool = True,
                  error_feedback: bool = True) -> tuple[CommHook, Callable | None]:
    """(CommHook, torch hook function) for `train.grad_compression` = `kind`; the function is None for `none`.

    PowerSGD's knobs (`torch.distributed.algorithms.ddp_comm_hooks.powerSGD_hook.PowerSGDState`): `powersgd_rank`
    (rank of the approximation), `start_step` (plain all-reduce for the synchronised backwards before it; >= 2),
    `warm_start` (reuse the previous step's Q), `error_feedback` (the defaults are vidray's settings; the other values
    are measured in `benchmarks/_powersgd_grid.py`). Raises ValueError for another kind, or a start_step below 2."""
    from torch.distributed.algorithms.ddp_comm_hooks import default_hooks, powerSGD_hook  # heavy: torch

    if kind == "none":
        return CommHook(kind), None
    if kind == "fp16":
        return CommHook(kind), default_hooks.fp16_compress_hook
    if kind == "bf16":
        return CommHook(kind), default_hooks.bf16_compress_hook
    if kind == "int4":
        return CommHook(kind), int4_compress_hook
    if kind == "powersgd":
        if start_step < 2:
            raise ValueError(f"PowerSGD's start step must be >= 2 (torch needs one plain all-reduce first), got "
                             f"{start_step}")
        state = powerSGD_hook.PowerSGDState(process_group=None, matrix_approximation_rank=powersgd_rank,
                                            start_powerSGD_iter=start_step, random_seed=0,
                                            use_error_feedback=error_feedback, warm_start=warm_start,
                                            orthogonalization_epsilon=ORTHOGONALIZATION_EPSILON)
        return CommHook(kind, state), _one_bucket_at_a_time(powerSGD_hook.powerSGD_hook)
    raise ValueError(f"train.grad_compression must be none, fp16, bf16, int4 or powersgd, got {kind!r}")


def _one_bucket_at_a_time(hook: Callable) -> Callable:
    """`hook`, with each bucket's all-reduces finished before the next bucket's start.

    PowerSGD launches a bucket's second all-reduce (of Q) from the first one's completion callback. Over gloo those
    callbacks run on gloo's threads, so two buckets' chains interleave in a different order on different ranks and
    the collectives mismatch (gloo aborts: "Received data size doesn't match expected size"; seen with 2 ranks on
    CPU). Waiting for the previous bucket keeps every rank's collectives in bucket order. It costs the overlap of
    one bucket's communication with the next bucket's: negligible next to the bytes PowerSGD saves."""
    pending: list[Any] = []

    def ordered(state, bucket):
        while pending:
            pending.pop().wait()
        future = hook(state, bucket)
        pending.append(future)
        return future

    ordered.__name__ = getattr(hook, "__name__", "hook")
    return ordered


def prime_buckets(model: torch.nn.Module, example_loss: Callable[[torch.nn.Module], torch.Tensor]) -> None:
    """One forward and backward of `example_loss(model) * 0` through DDP `model` before its hook is registered:
    DDP all-reduces the zero gradients with its initial buckets and rebuilds them in gradient-ready order at the
    next forward, so every step the hook sees uses the rebuilt buckets. A stateful hook (PowerSGD keys its error
    feedback by bucket index) then sees the same buckets in a fresh run and in a resumed one; without this, a
    resumed run's first step met its restored state with the initial buckets ("size of tensor a (1726528) must
    match the size of tensor b (272832)"). The weights and optimizer are untouched; the gradients are cleared."""
    (example_loss(model) * 0.0).backward()
    model.zero_grad(set_to_none=True)


def mixed_precision_policy(mixed_precision: str):
    """FSDP2's `MixedPrecisionPolicy` for `train.mixed_precision`: parameters all-gathered (and the forward and
    backward computed) in bf16 for `bf16` (fp16 for `fp16`), fp32 for `no`; gradients always reduce-scattered in
    fp32 (`reduce_dtype`: FSDP's analogue of a DDP compression hook). The sharded master weights and the optimizer
    state stay fp32. Raises ValueError for another setting."""
    from torch.distributed.fsdp import MixedPrecisionPolicy  # heavy: torch

    dtypes = {"no": None, "bf16": torch.bfloat16, "fp16": torch.float16}
    if mixed_precision not in dtypes:
        raise ValueError(f"train.mixed_precision must be no, bf16 or fp16, got {mixed_precision!r}")
    return MixedPrecisionPolicy(param_dtype=dtypes[mixed_precision], reduce_dtype=torch.float32)


def device_mesh(strategy: str, *, shard_group_size: int | None = None, device_type: str | None = None):
    """The `DeviceMesh` of the default process group for `strategy`: 1-D over all ranks for `fsdp`; for `hsdp`,
    2-D `(replicate, shard)` of shape (world // shard_group_size, shard_group_size), which `fully_shard` reads as
    HSDP (sharded within a group, replicated across groups). Raises ValueError when the group size does not divide
    the world size, or for another strategy."""
    if device_type is None:
        device_type = "cuda" if torch.cuda.is_available() else "cpu"
    world = dist.get_world_size()
    if strategy == "fsdp":
        return init_device_mesh(device_type, (world,), mesh_dim_names=("shard",))
    if strategy == "hsdp":
        if not shard_group_size or world % shard_group_size:
            raise ValueError(f"scaling.shard_group_size={shard_group_size} must divide the worker count {world}")
        return init_device_mesh(device_type, (world // shard_group_size, shard_group_size),
                                mesh_dim_names=("replicate", "shard"))
    raise ValueError(f"device_mesh: scaling.strategy must be fsdp or hsdp, got {strategy!r}")


def fsdp_offload_policy(enabled: bool, device: torch.device | str):
    """FSDP2's offload policy for `memory.fsdp_cpu_offload`: `CPUOffloadPolicy(pin_memory=True on CUDA)` when
    enabled (sharded parameters, gradients and optimizer state in host memory; each block's parameters copied to
    the device for its all-gather, the optimizer step on the CPU), else the default `OffloadPolicy()` (none)."""
    from torch.distributed.fsdp import CPUOffloadPolicy, OffloadPolicy  # heavy: torch

    if not enabled:
        return OffloadPolicy()
    return CPUOffloadPolicy(pin_memory=torch.device(device).type == "cuda")


def apply_fsdp(transformer: torch.nn.Module, mesh, mp_policy, reshard_after_forward: bool = True, *,
               blocks: torch.nn.ModuleList | None = None, offload_policy: Any = None) -> torch.nn.Module:
    """FSDP2 (`torch.distributed.fsdp.fully_shard`) on each block of `blocks` (the family's,
    `ModelFamily.block_lists`; default `transformer.transformer_blocks`), then on the root (torchtitan's
    `apply_fsdp`: a block's parameters are all-gathered just before its forward and, with
    `reshard_after_forward`, freed after it; the root holds the rest: embeddings, norms, output projection).
    Parameters become `DTensor`s sharded on dim 0 over `mesh` (each rank holds 1/world of every tensor); the
    module is changed in place and returned (its class becomes an `FSDPModule`). The optimizer must be built
    after this call (it must see the sharded parameters). Raises ValueError for a model without
    `transformer_blocks`."""
    from torch.distributed.fsdp import fully_shard  # heavy: torch

    # FSDP2 warns at every forward that the root returned a view (diffusers' `return_dict=False` tuple): an in-place
    # op on it would skip the backward all-gather. vidray's loss reads `model_pred` out of place only
    # (`vidray.train.step.flow_matching_step_loss`), so the warning says nothing a user can act on.
    warnings.filterwarnings("ignore", message=r"FSDP2-wrapped module .* returned a view tensor")
    if blocks is None:
        blocks = getattr(transformer, "transformer_blocks", None)
    if not isinstance(blocks, torch.nn.ModuleList):
        raise ValueError(f"scaling.strategy: fsdp: {type(transformer).__name__} has no transformer_blocks to shard; "
                         "use scaling.strategy: ddp")
    offload = {} if offload_policy is None else {"offload_policy": offload_policy}
    for i, block in enumerate(blocks):
        # The last block's parameters are needed again first in the backward: keeping them saves one all-gather.
        fully_shard(block, mesh=mesh, mp_policy=mp_policy,
                    reshard_after_forward=reshard_after_forward and i < len(blocks) - 1, **offload)
    fully_shard(transformer, mesh=mesh, mp_policy=mp_policy, reshard_after_forward=reshard_after_forward, **offload)
    return transformer


def is_sharded(model: torch.nn.Module) -> bool:
    """True when `model` (what `parallelize` returned) is FSDP2-sharded: its checkpoint is a sharded DCP folder and
    its full weights exist only when gathered (`full_state_dict`)."""
    from torch.distributed.fsdp import FSDPModule  # heavy: torch

    return isinstance(model, FSDPModule)


def gradient_sync(model: torch.nn.Module, enabled: bool):
    """Context for one micro-batch's backward under gradient accumulation: with `enabled` False (all but the last
    micro-batch of a step) gradients only accumulate locally; with True they are all-reduced (DDP) or
    reduce-scattered (FSDP) with the accumulated ones. DDP: `model.no_sync()`; FSDP2: its analogue
    `set_requires_gradient_sync(enabled)` (set again on every call, so the last micro-batch always syncs); a plain
    module (one process): nothing to do."""
    if hasattr(model, "set_requires_gradient_sync"):
        model.set_requires_gradient_sync(enabled)
        return contextlib.nullcontext()
    if not enabled and hasattr(model, "no_sync"):
        return model.no_sync()
    return contextlib.nullcontext()


def build_transformer(family: Any, job: JobConfig, device: torch.device) -> tuple[torch.nn.Module, str | None]:
    """(the transformer to train, the folder of its pretrained safetensors or None). A pretrained transformer
    trained with `scaling.strategy: fsdp | hsdp` is built on the meta device (`family.load_diffusion_models(...,
    meta=True)`: no weights in memory) and its folder returned, for `parallelize` to load each rank's shards after
    sharding; otherwise `family.load_diffusion_models` builds it in full (random init under `train.seed`, or the
    pretrained weights), on `device`."""
    if job.scaling.strategy != "ddp" and job.model.init == "pretrained":
        meta = family.load_diffusion_models(job.model, seed=job.train.seed, meta=True)
        return meta.transformer, meta.weights_folder
    return family.load_diffusion_models(job.model, seed=job.train.seed).transformer.to(device), None


def clip_grad_norm_(model: torch.nn.Module, max_norm: float) -> torch.Tensor:
    """`torch.nn.utils.clip_grad_norm_` of `model`'s gradients, returning the global L2 norm before clipping as a
    plain (,) tensor. With FSDP the gradients are DTensor shards: torch 2.13 reduces the per-shard norms into the
    norm of the whole gradient (a DTensor, made plain here with `full_tensor()`, a collective) and clips with it,
    equal to the unsharded model's (`tests/unit/test_fsdp.py`)."""
    norm = torch.nn.utils.clip_grad_norm_(model.parameters(), max_norm)
    return norm.full_tensor() if hasattr(norm, "full_tensor") else norm


UNUSED_PARAMETERS_WARNING = "find_unused_parameters=True was specified in DDP constructor, but did not find any " \
    "unused parameters"
"""The start of the line torch's C++ DDP reducer prints to stderr (`TORCH_WARN_ONCE` in `search_unused_parameters`,
once per process) the first time a forward uses every parameter of a DDP model built with
`find_unused_parameters=True`."""


def quiet_unused_parameters_warning(process_group: Any = None, *, device: torch.device | str = "cpu") -> None:
    """Spend the reducer's once-per-process `UNUSED_PARAMETERS_WARNING`, in silence, unless verbose (`vidray.logs`).

    Two experts on every worker (`model.experts` layout shared) need DDP's `find_unused_parameters`: a micro-batch
    whose samples fall on one side of the boundary leaves the other expert without gradients. A micro-batch that
    reaches both experts uses every parameter, and the reducer then prints its advice to turn the flag off, from C++
    to the process's stderr (no Python warning that `warnings.filterwarnings` could stop), once per worker. Here a
    one-weight DDP model with the flag, over `process_group` (None: the default group; a collective: every rank of
    the group calls this), runs one forward and backward that uses its weight, with file descriptor 2 captured:
    the line torch prints then is dropped, anything else printed meanwhile is written back. torch warns once per
    process, so the real model's steps print nothing."""
    if is_verbose():
        return
    device = torch.device(device)
    probe = torch.nn.Linear(1, 1, bias=False, device=device)
    kwargs: dict[str, Any] = {"find_unused_parameters": True}
    if process_group is not None:
        kwargs["process_group"] = process_group
    if device.type == "cuda":
        kwargs["device_ids"] = [device.index if device.index is not None else torch.cuda.current_device()]
    with stderr_without(UNUSED_PARAMETERS_WARNING):
        ddp = torch.nn.parallel.DistributedDataParallel(probe, **kwargs)
        ddp(torch.ones(1, 1, device=device)).sum().backward()


def parallelize(transformer: torch.nn.Module, job: JobConfig, *, hook_wrapper: Callable | None = None,
                example_loss: Callable[[torch.nn.Module], torch.Tensor] | None = None,
                pretrained_weights: str | None = None, device: torch.device | str | None = None,
                process_group: Any = None, family: Any = None, mesh: Any = None) -> tuple[torch.nn.Module, CommHook]:
    """Apply context parallel (`parallel.context`), activation checkpointing, then the data parallelism of
    `scaling.strategy`, to the model each worker trains. Returns (the model to call, its CommHook).

    Context parallel (degree > 1, a DiT `family`): the family's plan splits each sample's tokens over groups of
    consecutive ranks (`vidray.models.context_parallel`, mesh ("dp", "ring", "ulysses")); it goes first, on the
    unwrapped blocks (after LoRA, which the caller applies), so its hooks find each block's arguments by name.
    DDP and FSDP then run over every rank; the caller scales each backward by the degree (`Worker.train_step`).

    `ddp`: DDP with `train.bucket_cap_mb` and the compression hook (`find_unused_parameters` for a `TwoExperts`
    transformer, `model.experts` layout shared, its reducer's advice to turn it off silenced:
    `quiet_unused_parameters_warning`), over `process_group` when given (one expert's worker group,
    `vidray.train.expert_groups`), else every worker; the model is DDP-wrapped when the worker group
    has more than one process, else `transformer` itself, which stays the unwrapped module whose state dict the
    checkpoint saves. `hook_wrapper(hook) -> hook`, if given, wraps the communication hook (benchmarks count the
    bytes each all-reduce sends with it). `example_loss(model)`: a scalar loss of a small batch, needed by PowerSGD
    (`prime_buckets`).
    `fsdp` / `hsdp`: `apply_fsdp` over `device_mesh` with `mixed_precision_policy(train.mixed_precision)`; the
    returned model is `transformer` itself, sharded in place (`is_sharded`), and the CommHook is `none`. With
    `pretrained_weights` (a meta-device transformer from `build_transformer`), each rank's shards are then
    materialised on `device` and loaded file by file (`load_sharded_from_safetensors`), the family restoring the
    buffers no file holds. `family`: whose `block_lists` activation checkpointing and FSDP take (None:
    `transformer_blocks`). `mesh`: the `DeviceMesh` FSDP shards over (one expert's group,
    `vidray.train.expert_groups.ExpertGroups.shard_mesh`); None: `device_mesh` of every rank.

    Call before the optimizer is built (FSDP replaces the parameters with sharded ones) and before the checkpoint
    is restored (a sharded model loads its own shards)."""
    context = job.parallel.context
    if context.degree > 1 and family is not None:
        device_type = torch.device(device).type if device is not None else next(transformer.parameters()).device.type
        mesh_of_context = context_parallel_mesh(context.ulysses, context.ring, device_type=device_type)
        enable_context_parallel(transformer, mesh_of_context, family=family.name)
    blocks = None if family is None else family.block_lists(transformer)
    apply_activation_checkpointing(transformer, job.train.activation_checkpointing, blocks)
    if job.scaling.strategy in ("fsdp", "hsdp"):
        device = torch.device(device) if device is not None else next(transformer.parameters()).device
        if mesh is None:
            mesh = device_mesh(job.scaling.strategy, shard_group_size=job.scaling.shard_group_size,
                               device_type=device.type)
        if blocks is not None and len(blocks) != 1:
            raise ValueError("scaling.strategy: fsdp shards one transformer's blocks: two experts on every worker "
                             "(model.experts.layout: shared) train with ddp")
        apply_fsdp(transformer, mesh, mixed_precision_policy(job.train.mixed_precision),
                   job.scaling.reshard_after_forward, blocks=None if blocks is None else blocks[0],
                   offload_policy=fsdp_offload_policy(job.memory.fsdp_cpu_offload, device))
        if pretrained_weights is not None:
            _load_pretrained_shards(transformer, pretrained_weights, device=device, seed=job.train.seed,
                                    restore_buffers=None if family is None else family.restore_buffers)
        return transformer, CommHook("none")
    if job.scaling.strategy != "ddp":
        raise ValueError(f"scaling.strategy must be ddp, fsdp or hsdp, got {job.scaling.strategy!r}")

    # Two experts (`model.experts`): a micro-batch whose samples all fall on one side of the boundary leaves the
    # other expert without gradients on this rank, so DDP must look for unused parameters at every backward.
    two_experts = isinstance(transformer, TwoExperts)
    ddp_kwargs = {"bucket_cap_mb": job.train.bucket_cap_mb,
                  **({"find_unused_parameters": True} if two_experts else {}),
                  **({"process_group": process_group} if process_group is not None else {})}
    model = wrap_ddp(transformer, device if device is not None else next(transformer.parameters()).device, ddp_kwargs)
    comm, hook = comm_hook_for(job.train.grad_compression, powersgd_rank=job.train.powersgd_rank)
    is_ddp = isinstance(model, torch.nn.parallel.DistributedDataParallel)
    if two_experts and is_ddp:  # DDP's reducer warns at a step whose samples reached both experts: expected here
        quiet_unused_parameters_warning(process_group, device=next(transformer.parameters()).device)
    if is_ddp and (hook is not None or hook_wrapper is not None):
        from torch.distributed.algorithms.ddp_comm_hooks import default_hooks  # heavy: torch

        fn = hook if hook is not None else default_hooks.allreduce_hook
        if comm.state is not None:
            if example_loss is None:
                raise ValueError("parallelize: train.grad_compression: powersgd needs example_loss to prime DDP's buckets")
            prime_buckets(model, example_loss)
        # A stateless hook's state is the process group it reduces over: DDP's own (one expert's group), not
        # every rank's.
        state = comm.state if comm.state is not None else process_group
        model.register_comm_hook(state, hook_wrapper(fn) if hook_wrapper is not None else fn)
    if not is_ddp:
        comm = CommHook(comm.kind)  # one process: no all-reduce, no hook state
    return model, comm


FROZEN_BASE_PLACED = "_vidray_frozen_base"
"""Attribute a LoRA run's transformer carries once its frozen base is stored (`memory.storage_dtype` other than
fp32) or block-swapped (`memory.block_swap`) and placed on the device: `wrap_ddp` then neither moves it nor lets
DDP broadcast its frozen weights. Its value: the storage dtype's name."""


def wrap_ddp(model: torch.nn.Module, device: torch.device | str, ddp_kwargs: dict[str, Any]) -> torch.nn.Module:
    """`model` on `device`, wrapped in DistributedDataParallel (with `ddp_kwargs`) when the default process group
    has more than one rank; unwrapped on one rank, or with no group. What Ray Train's `prepare_model` does (its
    device ids on a GPU), without needing a Ray Train worker: the in-process `Worker` takes the same path."""
    device = torch.device(device)
    if device.type == "cuda":
        torch.cuda.set_device(device)
    if getattr(model, FROZEN_BASE_PLACED, None) is None:  # else placed already: block swap's blocks stay on the host
        model = model.to(device)
    if not (dist.is_available() and dist.is_initialized()) or dist.get_world_size() <= 1:
        return model
    if getattr(model, FROZEN_BASE_PLACED, None) is not None:
        # A LoRA base stored in bf16 / fp8 or block-swapped: DDP neither broadcasts it (gloo has no float8, and
        # swapped blocks are in host memory) nor reduces it (frozen): every rank built the same base (one seed, or
        # the same pretrained files).
        torch.nn.parallel.DistributedDataParallel._set_params_and_buffers_to_ignore_for_model(
            model, frozen_parameter_names(model) + [name for name, _ in model.named_buffers()])
    if device.type == "cuda":
        ddp_kwargs = {"device_ids": [device], "output_device": device, **ddp_kwargs}
    return torch.nn.parallel.DistributedDataParallel(model, **ddp_kwargs)


def _load_pretrained_shards(transformer: torch.nn.Module, folder: str, *, device: torch.device, seed: int,
                            restore_buffers: Callable[[torch.nn.Module], None] | None = None) -> None:
    """Fill a meta-device, sharded transformer from its pretrained folder (`restore_buffers`: the family's, for
    buffers no file holds; an `ExpertSlot` from its expert's folder, under its expert's names); LoRA adapters
    (`model.lora`, which no pretrained file holds) then get their starting values (`vidray.models.lora.init_adapters`
    under `seed`)."""
    # One expert of two: its names carry its prefix, and its group's ranks read its folder themselves.
    expert = isinstance(transformer, ExpertSlot)
    prefix = EXPERT_ATTRIBUTES[transformer.expert] + "." if expert else ""
    if not has_lora(transformer):
        load_sharded_from_safetensors(transformer, folder, device=device, restore_buffers=restore_buffers,
                                      prefix=prefix, broadcast=not expert)
        return
    from torch.distributed.checkpoint.state_dict import get_model_state_dict  # heavy: torch

    # peft renames an adapted layer's own weights: `to_q.weight` -> `to_q.base_layer.weight` (file keys: no prefix)
    renamed = {k.replace(".base_layer.", ".")[len(prefix):]: k[len(prefix):]
               for k in get_model_state_dict(transformer) if ".base_layer." in k}
    load_sharded_from_safetensors(transformer, folder, device=device, not_in_files=is_adapter_parameter,
                                  names=lambda k: renamed.get(k, k), restore_buffers=restore_buffers, prefix=prefix,
                                  broadcast=not expert)
    init_adapters(transformer, seed=seed)


def full_model_for_export(model: torch.nn.Module, transformer: torch.nn.Module, build: Callable[[], torch.nn.Module],
                          rank: int) -> torch.nn.Module | None:
    """The trained transformer with its full weights, for rank 0's export: `transformer` (the module `model`, what
    `parallelize` returned, wraps) when it is not sharded;
    for a sharded one, a collective (every rank calls it): `get_model_state_dict(model,
    StateDictOptions(full_state_dict=True, cpu_offload=True))` gathers the full state to rank 0's CPU (empty on
    the others), loaded into `build()` (a fresh unsharded transformer of the same config) on rank 0. Returns None
    on the other ranks of a sharded model."""
    if not is_sharded(model):
        return transformer
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict  # heavy: torch

    state = get_model_state_dict(model, options=StateDictOptions(full_state_dict=True, cpu_offload=True))
    if rank != 0:
        return None
    full = build()
    full.load_state_dict(state, strict=True)
    return full


def build_transformer_on_meta(build: Callable[[], torch.nn.Module]) -> torch.nn.Module:
    """`build()` under `torch.device("meta")`: the module's structure with no parameter storage (shapes and dtypes
    only), so a 14 B model costs no memory until `fully_shard` and `load_sharded_from_safetensors` materialise each
    rank's shards."""
    with torch.device("meta"):
        return build()


def load_sharded_from_safetensors(model: torch.nn.Module, folder: str, *, device: torch.device | str = "cpu",
                                  not_in_files: Callable[[str], bool] | None = None,
                                  names: Callable[[str], str] | None = None,
                                  restore_buffers: Callable[[torch.nn.Module], None] | None = None,
                                  prefix: str = "", broadcast: bool = True) -> int:
    """Materialise a meta-device, `fully_shard`-ed `model` on `device` (`to_empty`) and fill it from the diffusers
    weights in `folder` (`*.safetensors`, e.g. `diffusion_pytorch_model-00001-of-00003.safetensors`), one file at
    a time: rank 0 reads the file's tensors (`safetensors.safe_open`) and `set_model_state_dict(...,
    StateDictOptions(full_state_dict=True, broadcast_from_rank0=True, strict=False))` broadcasts them, each rank
    keeping only its shards; so no rank ever holds more than one file's tensors beside its shards. Every entry of
    the model's state dict must come from the files; non-persistent buffers (not in a state dict) are left
    uninitialised by `to_empty`: `restore_buffers(model)` (the family's `ModelFamily.restore_buffers`) re-creates
    them, and without it a model that has them is refused (the EasyAnimate transformer has none; Wan's rotary
    embedding has two).
    `not_in_files(name)`: True for the state-dict entries the caller fills itself (LoRA adapters): they are not
    expected in the files, and are left uninitialised here. `names(file_key)`: the model's name of a file's tensor
    where they differ (LoRA: an adapted layer's `to_q.weight` is the model's `to_q.base_layer.weight`); `prefix`
    goes before every file key (an `ExpertSlot`'s `transformer.` / `transformer_2.`). `broadcast` False: every rank
    reads the files itself and keeps its shards (`full_state_dict` without `broadcast_from_rank0`: the ranks of
    two expert groups load different files, so rank 0 cannot read for all). Returns the
    number of tensors loaded. Raises
    FileNotFoundError when `folder` holds no safetensors file and ValueError when the files miss a parameter or
    name one the model does not have."""
    from safetensors import safe_open  # heavy: safetensors
    from torch.distributed.checkpoint.state_dict import (  # heavy: torch
        StateDictOptions,
        get_model_state_dict,
        set_model_state_dict,
    )

    files = sorted(Path(folder).glob("*.safetensors"))
    if not files:
        raise FileNotFoundError(f"{folder} holds no *.safetensors file: give a diffusers transformer folder")
    non_persistent = [n for m_name, m in model.named_modules() for n in getattr(m, "_non_persistent_buffers_set", ())]
    if non_persistent and restore_buffers is None:
        raise ValueError(f"{type(model).__name__} has non-persistent buffers ({non_persistent[0]}) that no weights "
                         "file holds: it cannot be built on the meta device; set model.init so it is built in full")
    model.to_empty(device=device)
    if restore_buffers is not None:
        restore_buffers(model)
    expected = {k for k in get_model_state_dict(model) if not_in_files is None or not not_in_files(k)}
    seen: set[str] = set()
    rank = dist.get_rank() if dist.is_initialized() else 0
    broadcast = broadcast and dist.is_initialized()
    options = StateDictOptions(full_state_dict=True, broadcast_from_rank0=broadcast, strict=False)
    for path in files:
        with safe_open(str(path), framework="pt", device="cpu") as f:
            file_keys = list(f.keys())
            keys = [prefix + (names(k) if names is not None else k) for k in file_keys]
            unknown = [k for k in keys if k not in expected]
            if unknown:
                raise ValueError(f"{path.name} holds {unknown[0]}, which {type(model).__name__} does not have "
                                 f"({len(unknown)} unknown tensors): is {folder} this model family's transformer?")
            # broadcast_from_rank0: rank 0 reads the file, the others receive their shards (they pass nothing)
            state = {k: f.get_tensor(fk) for k, fk in zip(keys, file_keys)} if rank == 0 or not broadcast else {}
        set_model_state_dict(model, state, options=options)
        seen.update(keys)
    missing = sorted(expected - seen)
    if missing:
        raise ValueError(f"{folder} does not hold {missing[0]} ({len(missing)} tensors missing) of "
                         f"{type(model).__name__}")
    return len(seen)
