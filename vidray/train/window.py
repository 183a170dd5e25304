"""A training worker's counters between two reports, and the step line it prints.

Each step adds its loss and gradient norm as device tensors (no host sync) and its learning rate as a host float;
`LogWindow.close` is the one host sync of a window: one all-reduce of every step's loss and gradient norm (the mean
over ranks), the NaN/Inf check, and the window's metrics (what `ray.train.report` carries, what the run log and
TensorBoard record). `step_line` formats them as the `[vidray] step ...` line a person reads.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch
import torch.distributed as dist

from vidray.train.step import check_finite_window

STAGES = ("decode", "vae", "text", "dit")
"""The stages whose busy fraction a DiT run's window reports (`vidray.metrics.TrainMetrics.window_summary`)."""
VAE_RUN_STAGES = ("decode", "vae")
"""The stages of a VAE run (`train.objective: vae`): the loader decodes, the trainer's step trains the VAE (its
stage is `vae`); no encode stage and no DiT run."""


def compute_stage(objective: str) -> str:
    """The stage the trainer's step is, by `train.objective`: `vae` for a VAE run, `dit` otherwise. Its busy
    seconds (`TrainMetrics.add_stage`), the step line's compute time, the report's `<stage>_step_time_s` and the
    TensorBoard tags carry this name."""
    return "vae" if objective == "vae" else "dit"


def run_stages(compute: str) -> tuple[str, ...]:
    """The stages whose busy fractions a run with trainer stage `compute` (`compute_stage`) reports."""
    return VAE_RUN_STAGES if compute == "vae" else STAGES


@dataclass
class ClosedWindow:
    """One log window's steps, agreed over the ranks: `losses` and `grad_norms` (mean over ranks, host floats) and
    `lrs` of steps `first_step`.., and `metrics` (the report's: step, epoch, loss, step_time_s, lr, grad_norm,
    data_wait_fraction, encode_time_s, <compute>_step_time_s (dit, or vae for a VAE run), <stage>_busy_fraction
    of `run_stages(compute)`)."""

    first_step: int
    losses: list[float]
    grad_norms: list[float]
    lrs: list[float]
    metrics: dict[str, float]
    split_s: tuple[float, float, float]
    """Mean seconds per step of the window: (data wait, encode, DiT or VAE)."""
    compute: str = "dit"
    """The trainer's stage (`compute_stage`): `dit`, or `vae` for a VAE run."""
    experts: dict[str, dict[str, list[float]]] = field(default_factory=dict)
    """With two expert groups (`LogWindow.expert`): {"high" | "low": {"loss": [...], "grad_norm": [...]}}, each
    step's value, the mean over that expert's ranks; else empty."""


@dataclass
class LogWindow:
    """The steps since the last report on one rank.

    world_size: ranks averaging each step's loss and gradient norm at `close` (1: no collective). expert and
    expert_sizes: this rank's expert and each expert's worker count when the two experts train in groups
    (`vidray.train.expert_groups`): `close` then also gives each expert's loss and gradient norm. compute: the
    trainer's stage (`compute_stage`), which names its step time and the busy fractions reported."""

    world_size: int
    expert: str | None = None
    compute: str = "dit"
    expert_sizes: dict[str, int] = field(default_factory=dict)
    losses: list[torch.Tensor] = field(default_factory=list)
    """(,) per step: the sum of this rank's micro-batch losses."""
    grad_norms: list[torch.Tensor] = field(default_factory=list)
    """(,) per step: the global L2 norm before clipping; 0 when clipping is off."""
    lrs: list[float] = field(default_factory=list)
    seconds: list[list[float]] = field(default_factory=list)
    """[step, data_wait_s, encode_s, dit_s] per step of the window."""

    def add(self, loss: torch.Tensor, grad_norm: torch.Tensor, lr: float, seconds: list[float]) -> None:
        """Record one step: its loss and gradient norm (device tensors, kept as they are: no host sync), the lr it
        used, and [step, data_wait_s, encode_s, dit_s]."""
        self.losses.append(loss)
        self.grad_norms.append(grad_norm.detach().float())
        self.lrs.append(lr)
        self.seconds.append(seconds)

    def close(self, step: int, *, epoch: int, lr_now: float, step_time_s: float, data: dict[str, float],
              check_grad_norms: bool = True) -> ClosedWindow:
        """End the window at `step` (a collective when world_size > 1: every rank at the same step): the mean over
        ranks of each step's loss and gradient norm, checked for NaN/Inf (`check_finite_window`: a NaN on any rank
        reaches every rank through the mean, so all stop at the same step; `check_grad_norms` False under fp16,
        whose overflowing steps the scaler skips), and the window's metrics. `data`: `TrainMetrics.window_summary()`.
        Raises NonFiniteTrainingError. The window is empty afterwards."""
        window = torch.stack([torch.stack(self.losses), torch.stack(self.grad_norms)])  # (2, steps)
        per_expert: dict[str, list[list[float]]] = {}
        if self.expert is not None:
            losses, grad_norms, per_expert = self._expert_means(window)
        else:
            if self.world_size > 1:
                dist.all_reduce(window, op=dist.ReduceOp.AVG)
            losses, grad_norms = window.tolist()
        first_step = step - len(losses) + 1
        lrs = list(self.lrs)
        check_finite_window(first_step, losses, grad_norms, lrs, check_grad_norms=check_grad_norms)
        split = np.asarray(self.seconds)[:, 1:].mean(axis=0)  # data wait, encode, dit
        metrics = {
            "step": step,
            "epoch": epoch,
            "loss": float(np.mean(losses)),
            "step_time_s": step_time_s,
            "lr": lr_now,
            "grad_norm": float(np.mean(grad_norms)),
            "data_wait_fraction": data["data_wait_fraction"],
            "encode_time_s": float(split[1]),
            f"{self.compute}_step_time_s": float(split[2]),
            **{f"{stage}_busy_fraction": data[f"{stage}_busy_fraction"] for stage in run_stages(self.compute)},
            **{f"loss_{e}": float(np.mean(rows[0])) for e, rows in per_expert.items()},
            **{f"grad_norm_{e}": float(np.mean(rows[1])) for e, rows in per_expert.items()},
        }
        self.losses.clear()
        self.grad_norms.clear()
        self.lrs.clear()
        self.seconds.clear()
        return ClosedWindow(first_step, losses, grad_norms, lrs, metrics, (float(split[0]), float(split[1]),
                                                                            float(split[2])),
                            experts={e: {"loss": rows[0], "grad_norm": rows[1]} for e, rows in per_expert.items()},
                            compute=self.compute)


    def _expert_means(self, window: torch.Tensor) -> tuple[list[float], list[float], dict[str, list[list[float]]]]:
        """`window` (2, steps) of this rank -> (losses, grad_norms: means over every rank, {expert: [losses,
        grad_norms], means over its ranks}); one all-reduce of (2 + 2E, steps): this rank's values also in its own
        expert's two rows, zeros in the other's."""
        experts = list(self.expert_sizes)
        mine = torch.tensor([float(e == self.expert) for e in experts], device=window.device)
        window = torch.cat([window, (mine[:, None, None] * window[None]).flatten(0, 1)])
        if self.world_size > 1:
            dist.all_reduce(window, op=dist.ReduceOp.SUM)
        counts = [self.world_size] * 2 + [self.expert_sizes[e] for e in experts for _ in range(2)]
        rows = (window / torch.tensor(counts, dtype=window.dtype, device=window.device)[:, None]).tolist()
        return rows[0], rows[1], {e: rows[2 + 2 * i: 4 + 2 * i] for i, e in enumerate(experts)}


def step_line(closed: ClosedWindow, *, max_steps: int, data: dict[str, float], prefetch_lead: Any) -> str:
    """The `step ...` line of a window: per step (means over the window) step time, encode, dit (or vae: the
    window's `compute` stage), data wait; the busy fractions of the run's stages (`run_stages`); counts over the
    window: hot-tier hits/lookups, warm-tier hits/shard opens, clips decoded, latents reused (latent cache or the
    encode stage's memory) / needed, MiB fetched from the shard store; and how far the loader's prefetch runs
    ahead. `lr` is the one the window's last step trained with (as metrics.jsonl and TensorBoard record it; the
    report's `lr` is the next step's, what the optimizer holds). With two expert groups each expert's loss follows
    the mean (`loss 1.5379 high 1.5227 low 1.5532`)."""
    m = closed.metrics
    data_wait, encode, compute = closed.split_s
    busy = " ".join(f"{stage} {100 * data[f'{stage}_busy_fraction']:.0f}%" for stage in run_stages(closed.compute))
    experts = "".join(f" {e} {m[f'loss_{e}']:.4f}" for e in ("high", "low") if f"loss_{e}" in m)
    return (f"step {m['step']}/{max_steps} loss {m['loss']:.4f}{experts} step_time {m['step_time_s']:.3f} s "
            f"(encode {encode:.3f} s, {closed.compute} {compute:.3f} s) lr {closed.lrs[-1]:.2e} data_wait "
            f"{data_wait:.3f} s ({100 * data['data_wait_fraction']:.0f}%) "
            f"busy [{busy}] hot {data['hot_hits']:.0f}/{data['hot_hits'] + data['hot_misses']:.0f} warm "
            f"{data['warm_hits']:.0f}/{data['warm_hits'] + data['warm_misses']:.0f} decoded "
            f"{data['decode_clips']:.0f} latents reused {data['latent_hits']:.0f}/"
            f"{data['latent_hits'] + data['latent_misses']:.0f} fetched "
            f"{data['bytes_fetched'] / 2**20:.1f} MiB lead {prefetch_lead}")
