"""Exponential moving average of the trained transformer's weights (`train.ema`).

ema <- decay * ema + (1 - decay) * weights every `update_every_steps` optimizer steps, with torch's
`torch.optim.swa_utils.AveragedModel` and `get_ema_multi_avg_fn` (one `torch._foreach_lerp_` over all parameters).
The first update copies the weights (AveragedModel's `n_averaged == 0` rule), so what the average held before it
never matters. Rank 0 alone keeps the average under DDP: the replicas' weights are equal, and rank 0 writes the
checkpoint and the export. The checkpoint holds it as `ema.safetensors` (keys `module.<name>` and `n_averaged`).
"""

from __future__ import annotations

import copy

import torch
from torch.optim.swa_utils import AveragedModel, get_ema_multi_avg_fn

from vidray.config import EMAConfig


class EMA:
    """The EMA of `transformer`'s parameters (buffers are not averaged: the transformer has none that train).

    Args:
        transformer: the trained module, unwrapped (not DDP), before activation-checkpoint wrappers (the average's
            parameters must come in the same order as the trained ones': wrappers keep that order).
        config: `train.ema`.
    """

    def __init__(self, transformer: torch.nn.Module, config: EMAConfig):
        self.config = config
        self.averaged = AveragedModel(transformer, multi_avg_fn=get_ema_multi_avg_fn(config.decay),
                                      use_buffers=False)
        self.averaged.requires_grad_(False)

    @property
    def module(self) -> torch.nn.Module:
        """The averaged transformer (what the export writes with `export.weights: ema`)."""
        return self.averaged.module

    @property
    def num_updates(self) -> int:
        """Updates applied so far (0: none; the next one copies the weights)."""
        return int(self.averaged.n_averaged.item())

    def maybe_update(self, transformer: torch.nn.Module, step: int) -> bool:
        """Average `transformer`'s parameters in when `step` (1-based optimizer step just applied) is a multiple of
        `update_every_steps`; returns whether it did."""
        if step % self.config.update_every_steps:
            return False
        self.averaged.update_parameters(transformer)
        return True

    def reset_to(self, transformer: torch.nn.Module) -> None:
        """Start the average afresh from `transformer`'s current weights (an EMA added on resume, or a checkpoint
        written without one)."""
        for ema_param, param in zip(self.module.parameters(), transformer.parameters(), strict=True):
            ema_param.detach().copy_(param.detach())
        self.averaged.n_averaged.zero_()

    def copy_module(self) -> torch.nn.Module:
        """A detached copy of the averaged transformer (for validation or export while training goes on)."""
        return copy.deepcopy(self.module)
