"""Mixed precision of a training step: `train.mixed_precision` as one object the step calls.

- `no`: fp32 throughout.
- `bf16`: `torch.autocast(device, torch.bfloat16)` around the forward (CPU and CUDA alike): matmuls, linear layers
  and convolutions run in bf16, reductions and the loss in fp32; no loss scaling (bf16 has fp32's exponent range).
- `fp16`: `torch.autocast("cuda", torch.float16)` with `torch.amp.GradScaler`: the loss is scaled before the
  backward, the gradients unscaled before clipping, and a step whose gradients hold Inf/NaN is skipped while the scale
  shrinks (Micikevicius et al., "Mixed Precision Training", ICLR 2018). The scaler's state is in the checkpoint.
  Under FSDP/HSDP it is torch's `ShardedGradScaler`: each rank checks its gradient shards for Inf/NaN and the
  ranks agree (an all-reduce) before any of them steps, so all skip the same step.

Master weights and optimizer state stay fp32 in every mode (autocast casts copies for the ops it covers), as in
torch's AMP recipe and torchtitan's `mixed_precision_param` (whose FSDP analogue keeps `reduce_dtype` fp32).
"""

from __future__ import annotations

import contextlib
from typing import ContextManager

import torch

from vidray.errors import UserError

DTYPES = {"no": None, "bf16": torch.bfloat16, "fp16": torch.float16}
"""`train.mixed_precision` -> the autocast dtype (None: fp32)."""


class Precision:
    """One run's precision: its autocast context, its backward and its optimizer step.

    Args:
        mode: `train.mixed_precision` (`no`, `bf16` or `fp16`).
        device: the worker's torch device. fp16 needs CUDA: on another device UserError names the key and bf16.
        sharded: the model is FSDP2-sharded (`vidray.train.parallel.is_sharded`): fp16 then scales with
            `torch.distributed.fsdp.sharded_grad_scaler.ShardedGradScaler`.
        allow_cpu_fp16: tests only: fp16 on a CPU device (torch runs it there; a run gains nothing from it).
    """

    def __init__(self, mode: str, device: torch.device, *, sharded: bool = False, allow_cpu_fp16: bool = False):
        if mode not in DTYPES:
            raise UserError(f"train.mixed_precision must be one of {', '.join(DTYPES)}, got {mode!r}")
        if mode == "fp16" and device.type != "cuda" and not allow_cpu_fp16:
            raise UserError(f"train.mixed_precision: fp16 needs a CUDA device, this worker has {device.type}: "
                            "use train.mixed_precision: bf16 (or scaling.use_gpu: true on a GPU cluster)")
        self.mode, self.device = mode, device
        self.dtype: torch.dtype | None = DTYPES[mode]
        self.grad_scaler = None
        if mode == "fp16":
            if sharded:
                from torch.distributed.fsdp.sharded_grad_scaler import ShardedGradScaler  # heavy: torch

                self.grad_scaler = ShardedGradScaler(device=device.type)
            else:
                self.grad_scaler = torch.amp.GradScaler(device.type)

    def autocast(self) -> ContextManager:
        """The forward's context: `torch.autocast` with this run's dtype, or nothing for fp32."""
        if self.dtype is None:
            return contextlib.nullcontext()
        return torch.autocast(self.device.type, dtype=self.dtype)

    def backward(self, loss: torch.Tensor) -> None:
        """`loss.backward()`, scaled by the grad scaler under fp16. loss: scalar fp32."""
        (loss if self.grad_scaler is None else self.grad_scaler.scale(loss)).backward()

    def unscale_(self, optimizer: torch.optim.Optimizer) -> None:
        """Divide the gradients by the loss scale (fp16), before clipping or measuring their norm; else nothing."""
        if self.grad_scaler is not None:
            self.grad_scaler.unscale_(optimizer)

    def step(self, optimizer: torch.optim.Optimizer) -> None:
        """`optimizer.step()`; under fp16 the scaler's step (skipped when a gradient holds Inf/NaN) and update."""
        if self.grad_scaler is None:
            optimizer.step()
            return
        self.grad_scaler.step(optimizer)
        self.grad_scaler.update()

    @property
    def skips_non_finite_steps(self) -> bool:
        """True under fp16: an Inf/NaN gradient norm is a skipped step that lowers the scale, not a divergence."""
        return self.grad_scaler is not None
