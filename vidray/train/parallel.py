"""Parallelism in one place: activation checkpointing, then DDP with its communication hook.

`parallelize(transformer, job, device)` is the one call the training loop makes (torchtitan's `parallelize_llama`:
`apply_ac`, then the data-parallel wrapper); the loop never branches on the strategy afterwards.

- Activation checkpointing (`train.activation_checkpointing`): `full` turns on the diffusers model's own
  `gradient_checkpointing` (every transformer block recomputed in the backward, `torch.utils.checkpoint` without
  reentrancy); `every_<n>` wraps every n-th block in torch's `checkpoint_wrapper` (as torchtitan's selective AC does).
  Either way the gradients equal those without it: the recompute is the same forward.
- DDP (`ray.train.torch.prepare_model`, gloo on CPU and NCCL on GPU) with `train.bucket_cap_mb` (the all-reduce of a
  full bucket overlaps the rest of the backward) and `train.grad_compression`'s hook: torch's
  `default_hooks.fp16_compress_hook` / `bf16_compress_hook` (the bucket is cast, all-reduced and cast back: half the
  bytes) or `powerSGD_hook.powerSGD_hook` (rank-r factors P, Q of each bucket's gradient matrix instead of the matrix,
  with error feedback; Vogels et al., "PowerSGD: Practical Low-Rank Gradient Compression", NeurIPS 2019).
  PowerSGD keeps per-rank state (the error feedback and warm-start factors): `CommHook.gather_state` collects every
  rank's for the checkpoint, so a resume at the same worker count continues it exactly.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Callable

import numpy as np
import torch
import torch.distributed as dist

from vidray.config import JobConfig, parse_activation_checkpointing

POWERSGD_START_ITER = 2
"""PowerSGD compresses from the 2nd synchronised backward on (the 1st all-reduces plainly: torch requires > 1 with
error feedback, and DDP rebuilds its buckets after the first iteration)."""


ORTHOGONALIZATION_EPSILON = 1e-8
"""Added to the norms in PowerSGD's Gram-Schmidt: a bucket holding an all-zero gradient matrix (parameters whose
gradient is still zero, e.g. zero-initialised output layers) otherwise divides 0 by 0 and the loss turns NaN
(seen on the tiny transformer at step 5 with torch's default 0)."""


def apply_activation_checkpointing(transformer: torch.nn.Module, setting: str) -> int:
    """Turn on activation checkpointing of `transformer`'s blocks per `train.activation_checkpointing`; returns
    how many blocks are checkpointed.

    `full` uses the model's `enable_gradient_checkpointing()` when it has one (diffusers models), else wraps every
    block; `every_<n>` wraps blocks 0, n, 2n, ... of `transformer_blocks` in
    `torch.distributed.algorithms._checkpoint.checkpoint_wrapper.checkpoint_wrapper` (non-reentrant; the wrapper's
    state-dict hooks keep parameter names unchanged in `state_dict()` and in `torch.distributed.checkpoint`'s
    helpers). Raises ValueError for a bad setting and for a model without `transformer_blocks`.
    """
    stride = parse_activation_checkpointing(setting)
    if stride == 0:
        return 0
    blocks = getattr(transformer, "transformer_blocks", None)
    if not isinstance(blocks, torch.nn.ModuleList):
        raise ValueError(f"train.activation_checkpointing: {type(transformer).__name__} has no transformer_blocks "
                         "to checkpoint; set it to none")
    if stride == 1 and hasattr(transformer, "enable_gradient_checkpointing"):
        transformer.enable_gradient_checkpointing()
        return len(blocks)
    from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import CheckpointImpl, checkpoint_wrapper

    for i in range(0, len(blocks), stride):
        blocks[i] = checkpoint_wrapper(blocks[i], checkpoint_impl=CheckpointImpl.NO_REENTRANT)
    return len(range(0, len(blocks), stride))


@dataclasses.dataclass
class CommHook:
    """The DDP communication hook of a run (`train.grad_compression`) and its state.

    kind: `none`, `fp16`, `bf16` or `powersgd`; state: PowerSGD's `PowerSGDState` (None otherwise).
    """

    kind: str
    state: Any = None

    def gather_state(self, rank: int, world_size: int) -> dict[str, Any] | None:
        """Every rank's hook state gathered to rank 0 (a collective: every rank calls it at a checkpoint):
        {"kind", "world_size", "powersgd_rank", "per_rank": [state of rank 0, 1, ...]} on rank 0 (CPU tensors), None
        on the other ranks and for hooks without state."""
        if self.state is None:
            return None
        mine = _powersgd_state_dict(self.state)
        parts = [mine]
        if world_size > 1:
            parts = [None] * world_size if rank == 0 else None
            dist.gather_object(mine, parts, dst=0)
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


def comm_hook_for(kind: str, *, powersgd_rank: int) -> tuple[CommHook, Callable | None]:
    """(CommHook, torch hook function) for `train.grad_compression` = `kind`; the function is None for `none`."""
    from torch.distributed.algorithms.ddp_comm_hooks import default_hooks, powerSGD_hook

    if kind == "none":
        return CommHook(kind), None
    if kind == "fp16":
        return CommHook(kind), default_hooks.fp16_compress_hook
    if kind == "bf16":
        return CommHook(kind), default_hooks.bf16_compress_hook
    if kind == "powersgd":
        state = powerSGD_hook.PowerSGDState(process_group=None, matrix_approximation_rank=powersgd_rank,
                                            start_powerSGD_iter=POWERSGD_START_ITER, random_seed=0,
                                            orthogonalization_epsilon=ORTHOGONALIZATION_EPSILON)
        return CommHook(kind, state), _one_bucket_at_a_time(powerSGD_hook.powerSGD_hook)
    raise ValueError(f"train.grad_compression must be none, fp16, bf16 or powersgd, got {kind!r}")


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


def parallelize(transformer: torch.nn.Module, job: JobConfig, *, hook_wrapper: Callable | None = None,
                example_loss: Callable[[torch.nn.Module], torch.Tensor] | None = None,
                ) -> tuple[torch.nn.Module, CommHook]:
    """Apply activation checkpointing, then DDP with `train.bucket_cap_mb` and the compression hook, to the model
    each worker trains. Returns (the model to call: DDP-wrapped when the worker group has more than one process,
    else `transformer` itself; its CommHook). `transformer` stays the unwrapped module whose state dict the
    checkpoint saves. `hook_wrapper(hook) -> hook`, if given, wraps the communication hook (benchmarks count the
    bytes each all-reduce sends with it). `example_loss(model)`: a scalar loss of a small batch, needed by PowerSGD
    (`prime_buckets`). Call after the checkpoint is restored and before the first forward."""
    import ray.train.torch

    apply_activation_checkpointing(transformer, job.train.activation_checkpointing)
    model = ray.train.torch.prepare_model(
        transformer, parallel_strategy_kwargs={"bucket_cap_mb": job.train.bucket_cap_mb})
    comm, hook = comm_hook_for(job.train.grad_compression, powersgd_rank=job.train.powersgd_rank)
    is_ddp = isinstance(model, torch.nn.parallel.DistributedDataParallel)
    if is_ddp and (hook is not None or hook_wrapper is not None):
        from torch.distributed.algorithms.ddp_comm_hooks import default_hooks

        fn = hook if hook is not None else default_hooks.allreduce_hook
        if comm.state is not None:
            if example_loss is None:
                raise ValueError("parallelize: train.grad_compression: powersgd needs example_loss to prime DDP's buckets")
            prime_buckets(model, example_loss)
        model.register_comm_hook(comm.state, hook_wrapper(fn) if hook_wrapper is not None else fn)
    if not is_ddp:
        comm = CommHook(comm.kind)  # one process: no all-reduce, no hook state
    return model, comm
