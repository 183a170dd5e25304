"""Grid of PowerSGD settings on `benchmarks/train_scale.py`'s part (e) (issue 47, part 4): the same 2-process gloo
run of the tiny EasyAnimate transformer (`run_hook`), one setting at a time, each against one uncompressed run.

    .venv/bin/python benchmarks/_powersgd_grid.py r4:s2 r8:s30:adam r4:s20:adam:nowarm ... [--steps 200] [--out F]
        [--model tiny|wide]

A cell is `r<rank>:s<start step>` plus any of `adam` / `adam_frozen` (compress in AdamW's preconditioned space,
`adam_preconditioned`), `nowarm` (warm_start off), `noef` (error feedback off). Each cell prints one JSON line:
loss_rel_diff (mean loss of the last 20 steps / the uncompressed run's - 1, absolute; goal <= 0.02), bytes_ratio
(mean bytes all-reduced per step after the 5th / uncompressed; goal <= 0.25) and wall_s (the run's wall time);
`--out` appends the lines to a file, `--none F` keeps the uncompressed run in F for the next call (one file per
`--model`). `--model wide`: train_scale's `WIDE_TRANSFORMER` (width 512, where a quarter of the bytes allows rank 64)
instead of the tiny model (width 128). ~30 s a cell on 2 CPU cores (tiny), 3-5 min (wide, shared cores).
Results of issue 47's grid (none meets both goals on either model; rank is what moves the loss): see
docs/training-at-scale.md.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path
from typing import Any

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from benchmarks.train_scale import late_loss, run_hook, steady_bytes  # noqa: E402


def adam_preconditioned(hook: Any, optimizer: torch.optim.Optimizer, *, frozen: bool = False) -> Any:
    """`hook` run on the bucket divided by AdamW's denominator d = sqrt(exp_avg_sq / (1 - beta2^step)) + eps (from
    `optimizer`'s state after its last step; 1 for a parameter without state yet), the result multiplied by d.

    The idea of 1-bit Adam (Tang et al., 2021): compress where Adam's update lives. PowerSGD's rank-r approximation
    keeps the largest directions of the raw gradient; AdamW then divides every coordinate by its own scale, so the
    coordinates with small gradients, which the approximation barely carries, get full-size updates made of
    approximation error. Divided by d first, every coordinate is on Adam's scale and the error is spread evenly.
    d is the same on every rank (DDP's optimizer states are replicas), so a plain all-reduce of g / d, times d, is the
    plain all-reduce of g: the warm-up steps are unchanged.

    `frozen`: as 1-bit Adam freezes the variance after its warm-up, d is taken once, at the first compressed step,
    and an optimizer step post-hook keeps each exp_avg_sq at that value (bias correction included) from then on, so
    AdamW's update is linear in the all-reduced gradient and the error feedback lives in a fixed metric."""
    frozen_d: dict[int, torch.Tensor] = {}
    registered: list[Any] = []

    def keep_frozen(optimizer, args, kwargs):
        for group in optimizer.param_groups:
            beta2 = group["betas"][1]
            for param in group["params"]:
                found = optimizer.state.get(param, {})
                if id(param) in frozen_d and "exp_avg_sq" in found:
                    nxt = float(found["step"]) + 1  # the next step's bias correction
                    found["exp_avg_sq"].copy_(frozen_d[id(param)].reshape(found["exp_avg_sq"].shape)
                                              * (1 - beta2 ** nxt))

    def scale_of(optimizer, param, compressing: bool) -> torch.Tensor | None:
        found = optimizer.state.get(param, {})
        if "exp_avg_sq" not in found:
            return None
        group = next(g for g in optimizer.param_groups if any(param is q for q in g["params"]))
        beta2 = group["betas"][1]
        vhat = found["exp_avg_sq"].reshape(-1) / (1 - beta2 ** float(found["step"]))
        if frozen and compressing:
            if id(param) not in frozen_d:
                frozen_d[id(param)] = vhat.clone()
            vhat = frozen_d[id(param)]
        return vhat.sqrt().add_(group["eps"])

    def preconditioned(state, bucket):
        if frozen and not registered:
            registered.append(optimizer.register_step_post_hook(keep_frozen))
        compressing = state.iter >= state.start_powerSGD_iter
        buffer = bucket.buffer()
        d = torch.ones_like(buffer)
        for param, grad in zip(bucket.parameters(), bucket.gradients()):
            scale = scale_of(optimizer, param, compressing)
            if scale is not None:
                offset = (grad.data_ptr() - buffer.data_ptr()) // buffer.element_size()  # its view in the bucket
                d[offset:offset + grad.numel()] = scale.to(buffer.dtype)
        buffer.div_(d)
        return hook(state, bucket).then(lambda fut: fut.value().mul_(d))

    preconditioned.__name__ = getattr(hook, "__name__", "hook")
    return preconditioned


def preconditioned_adam(hook: Any, optimizer: torch.optim.Optimizer) -> Any:
    """`adam_preconditioned` with the denominator of AdamW's last step (`_hook_run`'s `wrap_hook`)."""
    return adam_preconditioned(hook, optimizer, frozen=False)


def preconditioned_adam_frozen(hook: Any, optimizer: torch.optim.Optimizer) -> Any:
    """`adam_preconditioned` with the denominator frozen at the first compressed step (`wrap_hook`)."""
    return adam_preconditioned(hook, optimizer, frozen=True)


def knobs_of(cell: str) -> dict:
    """`comm_hook_for` keyword arguments for a cell such as `r4:s20:adam`; ValueError for an unknown part."""
    knobs: dict[str, Any] = {"powersgd_rank": 4, "start_step": 2}
    for part in cell.split(":"):
        if part[0] == "r" and part[1:].isdigit():
            knobs["powersgd_rank"] = int(part[1:])
        elif part[0] == "s" and part[1:].isdigit():
            knobs["start_step"] = int(part[1:])
        elif part in ("adam", "adam_frozen"):
            knobs["wrap_hook"] = {"adam": preconditioned_adam, "adam_frozen": preconditioned_adam_frozen}[part]
        elif part == "nowarm":
            knobs["warm_start"] = False
        elif part == "noef":
            knobs["error_feedback"] = False
        else:
            raise ValueError(f"cell {cell!r}: unknown part {part!r} (r<rank>, s<start>, adam, nowarm, noef)")
    return knobs


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("cells", nargs="+")
    ap.add_argument("--steps", type=int, default=200)
    ap.add_argument("--out", default=None, help="file the JSON lines are appended to")
    ap.add_argument("--none", default=None, help="file keeping the uncompressed run (read if there, else written)")
    ap.add_argument("--model", default="tiny", choices=("tiny", "wide"), help="train_scale.HOOK_MODELS key")
    a = ap.parse_args()
    start = time.perf_counter()
    if a.none and Path(a.none).exists():
        none = torch.load(a.none, weights_only=True)
    else:
        none = run_hook("none", a.steps, model=a.model)
        if a.none:
            torch.save(none, a.none)
    print(json.dumps({"cell": "none", "late_loss": late_loss(none), "bytes": steady_bytes(none),
                      "wall_s": round(time.perf_counter() - start, 1)}), flush=True)
    for cell in a.cells:
        start = time.perf_counter()
        knobs = knobs_of(cell)
        run = run_hook("powersgd", a.steps, knobs, wrap_hook=knobs.pop("wrap_hook", None), model=a.model)
        line = json.dumps({"cell": cell, "loss_rel_diff": round(abs(late_loss(run) / late_loss(none) - 1), 4),
                           "bytes_ratio": round(steady_bytes(run) / steady_bytes(none), 4),
                           "late_loss": late_loss(run), "wall_s": round(time.perf_counter() - start, 1)})
        print(line, flush=True)
        if a.out:
            with open(a.out, "a") as f:
                f.write(line + "\n")


if __name__ == "__main__":
    main()
