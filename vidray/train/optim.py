"""Optimizer and learning-rate schedule, built from the `optim` section only."""

from __future__ import annotations

from typing import Iterable

import torch
from diffusers.optimization import get_constant_schedule_with_warmup

from vidray.config import OptimConfig


def build_optimizer(parameters: Iterable[torch.nn.Parameter], optim: OptimConfig) -> torch.optim.AdamW:
    """AdamW over the parameters that require grad (frozen ones are left out). Raises ValueError when none do.

    torch's fused implementation (`fused=True`: one kernel over all parameters, on CPU since torch 2.4 and on
    CUDA) where the parameters allow it (floating point, on a device torch has the kernel for), else torch's
    default. Same update rule (Loshchilov and Hutter, "Decoupled Weight Decay Regularization", ICLR 2019); the
    fused kernel skips the per-tensor Python loop of the default CPU path: on the tiny transformer (130 tensors,
    1 thread) the optimizer step took 4.5 ms instead of 15 ms, a quarter of the whole step
    (`benchmarks/train_overhead.py`). A checkpoint's optimizer state carries the choice: a resumed run keeps it.
    """
    trainable = [p for p in parameters if p.requires_grad]
    if not trainable:
        raise ValueError("no trainable parameters: every parameter has requires_grad=False")
    kwargs = dict(lr=optim.lr, betas=tuple(optim.betas), weight_decay=optim.weight_decay, eps=optim.eps)
    try:
        return torch.optim.AdamW(trainable, fused=True, **kwargs)
    except RuntimeError:  # "`fused=True` requires all the params to be floating point Tensors of supported devices"
        return torch.optim.AdamW(trainable, **kwargs)


def build_lr_scheduler(optimizer: torch.optim.Optimizer, optim: OptimConfig) -> torch.optim.lr_scheduler.LambdaLR:
    """Linear warmup from 0 to `optim.lr` over `optim.warmup_steps` steps, then constant
    (diffusers.optimization.get_constant_schedule_with_warmup)."""
    return get_constant_schedule_with_warmup(optimizer, num_warmup_steps=optim.warmup_steps)


def apply_optim_config(
    optimizer: torch.optim.Optimizer, optim: OptimConfig, *, step: int
) -> torch.optim.lr_scheduler.LambdaLR:
    """After restoring `optimizer` from a checkpoint at `step` (the last step applied), make `optim` (the resumed
    job's section) take effect: lr, betas, weight_decay and eps are set on every param group (Adam's moment
    estimates are kept), and the lr schedule is rebuilt from `optim` as if it had run `step` steps. Returns the
    new scheduler, replacing the restored one (whose base lr would silently win otherwise).
    """
    if step < 1:
        raise ValueError(f"step must be >= 1 (the last step applied), got {step}")
    for group in optimizer.param_groups:
        group.update(lr=optim.lr, initial_lr=optim.lr, betas=tuple(optim.betas), weight_decay=optim.weight_decay,
                     eps=optim.eps)
    # LambdaLR's constructor takes one step: last_epoch=step-1 leaves it at `step`, like an uninterrupted run.
    return get_constant_schedule_with_warmup(optimizer, num_warmup_steps=optim.warmup_steps, last_epoch=step - 1)
