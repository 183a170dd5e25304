"""The Ray Train entry point as the driver references it: a light module, so that the driver pickles the
function without importing the worker's stack (diffusers, the model families, the data loader)."""

from __future__ import annotations

from typing import Any


def train_loop_per_worker(loop_config: dict[str, Any]) -> dict[str, Any]:
    """`vidray.train.loop.train_loop_per_worker`, imported in the worker."""
    from vidray.train.loop import train_loop_per_worker as run  # heavy: torch, diffusers, pyarrow

    return run(loop_config)
