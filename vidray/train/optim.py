"""Optimizer and learning-rate schedule, built from the `optim` section only."""

from __future__ import annotations

from typing import Iterable

import torch
from diffusers.optimization import get_constant_schedule_with_warmup

from vidray.config import OptimConfig


def build_optimizer(parameters: Iterable[torch.nn.Parameter], optim: OptimConfig) -> torch.optim.AdamW:
    """AdamW over the parameters that require grad (frozen ones are left out)."""
    trainable = [p for p in parameters if p.requires_grad]
    if not trainable:
        raise ValueError("no trainable parameters: every parameter has requires_grad=False")
    return torch.optim.AdamW(
        trainable, lr=optim.lr, betas=tuple(optim.betas), weight_decay=optim.weight_decay, eps=optim.eps
    )


def build_lr_scheduler(optimizer: torch.optim.Optimizer, optim: OptimConfig) -> torch.optim.lr_scheduler.LambdaLR:
    """Linear warmup from 0 to `optim.lr` over `optim.warmup_steps` steps, then constant
    (diffusers.optimization.get_constant_schedule_with_warmup)."""
    return get_constant_schedule_with_warmup(optimizer, num_warmup_steps=optim.warmup_steps)
