"""Training in this process, without Ray: the same checks, the same `Worker`, the same run folder.

`train_in_process(job)` is `vidray.train.trainer.run_training` with the Ray parts taken out: it checks the job
(`check_job_inputs`: shards, outputs, resume rules, the run folder's lock), plans where the run starts
(`vidray.train.resume`), builds one rank's `Worker` with a `LocalContext` (`vidray.train.context`) and runs it:
the loader decodes and encodes in this process (`vidray.data.pipeline.LocalLoader`), checkpoints are copied into
`<storage.path>/<name>` as they are written, validation samples between steps. The run folder it leaves is the one a
Ray Train run leaves (checkpoints, `diffusers/`, TensorBoard, metrics), so either can resume the other.

One rank trains what `scaling.num_workers` ranks would: the schedule deals each step's G =
`train.micro_batches_per_step` micro-batches (default: one per worker) to the ranks it is given, so one rank trains
all G with gradient accumulation, the same samples, noise and global batch (`vidray.data.schedule`). `world_size`
> 1 trains on that many gloo ranks in processes of this machine (`torch.multiprocessing`), DDP or FSDP as the job
says: what the unit tests use for behaviours of several ranks.

What it is for: the unit tests of the loop's behaviour (accumulation, precision, resume arithmetic, expert routing,
validation triggers) in a second, a stack trace of a loop bug in one process, and a debugger on a laptop. What needs
Ray Train itself (worker restarts, elastic resizes, placement on labeled nodes, `ray job submit`) stays with
`run_training`.
"""

from __future__ import annotations

import os
import sys
import tempfile
from pathlib import Path
from typing import Any

from vidray.config import JobConfig
from vidray.train.resume import apply_num_to_keep, set_aside

IN_PROCESS_REFUSED = ("scaling.num_workers [min, max] (elastic)", "model.experts.layout: groups")
"""Settings that need Ray Train's worker group (named in `train_in_process`'s error)."""


def train_in_process(job: JobConfig, *, record_sample_ids: bool = False, world_size: int = 1) -> Any:
    """Train `job` in this process (module docstring); returns a `vidray.train.trainer.TrainResult`.

    Raises what `run_training` raises before Ray starts (UserError when another driver trains the run folder, the
    errors of `check_job_inputs`) and what a worker raises (a diverged loss, a damaged checkpoint: the same one-line
    `UserError`s), and ValueError for `world_size` < 1 or a job that needs Ray Train's worker group (an elastic
    `scaling.num_workers`, `model.experts.layout: groups`).
    """
    from vidray.train.trainer import (  # heavy: pyarrow, numpy
        build_loop_config,
        check_job_inputs,
        run_folder_lock,
        train_result,
        with_absolute_model_paths,
    )

    if world_size < 1:
        raise ValueError(f"world_size must be >= 1, got {world_size}")
    if job.scaling.elastic or (job.model.experts is not None and job.model.experts.layout == "groups"):
        raise ValueError(f"train_in_process runs a fixed group of ranks: {' and '.join(IN_PROCESS_REFUSED)} need "
                         "Ray Train's worker group (vidray train)")
    # 1. The driver's checks and resume plan, as `run_training` makes them.
    job = with_absolute_model_paths(job)
    with run_folder_lock(job):
        plan = check_job_inputs(job)
        if job.train.objective != "vae":  # a VAE run trains on frames only: its captions reach no model
            from vidray.data.captions import shards_caption_truncation  # heavy: torch, transformers, pyarrow

            print(f"[vidray] captions: {shards_caption_truncation(job.data.shards_dir, job.model)}", flush=True)
        # 2. Checkpoints newer than an explicit start point aside, then the ranks.
        set_aside(plan)
        loop_config = build_loop_config(job, plan, placement={}, record_sample_ids=record_sample_ids)
        if world_size == 1:
            out, reports, registered = run_rank(loop_config, rank=0, world_size=1)
        else:
            out, reports, registered = _spawn_ranks(loop_config, world_size)
        # 3. The run folder's rotation over checkpoints of earlier runs, and the result.
        apply_num_to_keep(plan, job, set(registered))
        with_checkpoint = [r for r in reports if "checkpoint" in r]
        metrics = {k: v for k, v in with_checkpoint[-1].items() if k != "checkpoint"} if with_checkpoint else None
        checkpoint_path = (f"{plan.manager.location().rstrip('/')}/{registered[-1]}" if registered else None)
        return train_result(job, out, metrics=metrics, checkpoint_path=checkpoint_path)


def run_rank(loop_config: dict[str, Any], *, rank: int, world_size: int) -> tuple[dict[str, Any], list, list[str]]:
    """One rank's `Worker` run in this process with a `LocalContext`: (its result, its reports' metrics, the
    checkpoints it registered, oldest first). A one-rank gloo group is made (and destroyed) when none is
    initialised; with `world_size` > 1 the caller has initialised the group (`_spawn_ranks`)."""
    import torch  # heavy: torch
    import torch.distributed as dist  # heavy: torch

    from vidray.train.context import LocalContext  # heavy: torch, numpy
    from vidray.train.loop import Worker  # heavy: torch, diffusers, pyarrow

    job = loop_config["job"]
    use_gpu = bool(job["scaling"].get("use_gpu")) and torch.cuda.is_available()
    device = torch.device("cuda", rank % max(1, torch.cuda.device_count())) if use_gpu else torch.device("cpu")
    if use_gpu:
        torch.cuda.set_device(device)
    own_group = not dist.is_initialized()
    if own_group:
        dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:
        context = LocalContext(rank=rank, world_size=world_size, device=device,
                               num_to_keep=job["checkpoint"].get("num_to_keep"))
        out = Worker(loop_config, context).run()
        return out, context.reports, context.registered
    finally:
        if own_group:
            dist.destroy_process_group()


def _spawn_ranks(loop_config: dict[str, Any], world_size: int) -> tuple[dict[str, Any], list, list[str]]:
    """`run_rank` on `world_size` gloo ranks, each in a process of its own (`torch.multiprocessing.spawn`,
    rendezvous through a file store); rank 0's result. A rank's exception is raised here with its message."""
    import torch  # heavy: torch
    import torch.multiprocessing as mp  # heavy: torch

    with tempfile.TemporaryDirectory(prefix="vidray-ranks-") as tmp:
        store, results = Path(tmp) / "store", Path(tmp) / "rank0.pt"
        mp.spawn(_rank_main, args=(world_size, loop_config, str(store), str(results)), nprocs=world_size, join=True)
        return torch.load(results, weights_only=False)


def _rank_main(rank: int, world_size: int, loop_config: dict[str, Any], store: str, results: str) -> None:
    import torch  # heavy: torch
    import torch.distributed as dist  # heavy: torch

    os.environ.setdefault("OMP_NUM_THREADS", "1")
    dist.init_process_group("gloo", store=dist.FileStore(store, world_size), rank=rank, world_size=world_size)
    try:
        out = run_rank(loop_config, rank=rank, world_size=world_size)
        if rank == 0:
            torch.save(out, results)
    finally:
        dist.destroy_process_group()
        sys.stdout.flush()
