"""`vidray doctor CONFIG --measure`: what the cluster does, measured where the job would run.

On the cluster `vidray train` would use (`RAY_ADDRESS`, or a local Ray started as `vidray.runtime.init_ray` starts
it), the doctor reserves the job's workers as Ray Train places them (a placement group of the min of
`scaling.num_workers` bundles of `scaling.cpus_per_worker` CPUs, and a GPU each with `scaling.use_gpu`, PACK, on
`placement.dit`'s nodes), joins them in one torch.distributed process group (NCCL on GPUs, gloo on CPUs, as Ray
Train picks) and measures, one line each:

1. All-reduce bandwidth between the workers for messages of 1 MiB x 4^k up to `--max-message-mib` (default 64 MiB
   with gloo, 1 GiB with NCCL; capped at a quarter of the workers' free memory, which the line says). As nccl-tests
   measures it (NVIDIA/nccl-tests, doc/PERFORMANCE.md): warm-up all-reduces, a barrier, `iters` all-reduces back to
   back, the time per all-reduce averaged over the ranks; algbw = S / t and busbw = algbw * 2(n-1)/n in GB/s
   (10^9 bytes/s). busbw compares with a link's bandwidth whatever the number of ranks. One worker: skipped (the
   job has no all-reduce).
2. The object store's transfer rate between two nodes: an actor on one node returns a float32 array of the job's
   latent batch (`family.latent_shape(largest bucket, batch)`, or `--transfer-mib`), an actor on another node (the
   first worker's) gets it and copies it once into its memory, as a batch becomes a tensor. One node: the
   same-node path, said so.
3. One simulated training step: on the first worker, the job's transformer set up as `vidray.train.loop` sets it up
   (LoRA, unused parameters frozen, activation checkpointing, precision, fused AdamW, gradient clipping; no DDP or
   FSDP wrapper on one rank), random latents and prompt embeddings of the job's largest bucket and batch,
   `STEPS` steps: the median time of the steps after the first, and the peak memory of a steady step against the
   planner's estimate for one rank (`vidray.train.plan.estimate_memory`): on a GPU `torch.cuda.max_memory_allocated`,
   on CPU the live tensor bytes the planner predicts (`vidray.train.memory.TensorBytesTracker`), with the process's
   peak RSS beside it (the libraries and the allocator's free lists included, so not compared).

Each line is `ok`, `warn` or `FAIL` (`vidray.doctor.Finding`) with the fix; the thresholds are the constants below.
The arithmetic and the levels are pure functions (tests/unit/test_doctor_measures.py); `measure` runs it on Ray.
"""

from __future__ import annotations

import contextlib
import logging
import math
import os
import resource
import socket
import statistics
import time
from dataclasses import replace
from datetime import timedelta
from typing import Any, Iterator

from vidray.doctor import Finding, Level, _captured
from vidray.logs import worker_env
from vidray.placement import alive_nodes, resolve_placement
from vidray.runtime import apply_ray_env_defaults, autoscaler_max_resources, check_ray_address, init_ray

__all__ = ["DEFAULT_MAX_MESSAGE_MIB", "bus_bandwidth", "measure", "message_sizes", "simulated_step",
           "time_allreduce"]

MIB = 2**20
GB = 1e9
"""nccl-tests' GB: 10^9 bytes."""

# 1. Arithmetic and thresholds (pure).

DEFAULT_MAX_MESSAGE_MIB = {"gloo": 64, "nccl": 1024}
"""Largest all-reduce message by backend, MiB, when `--max-message-mib` is not given: 1 GiB as nccl-tests' usual
sweep on GPUs; 64 MiB over gloo, where a 1 GiB all-reduce takes seconds and needs GiBs of host memory per worker
(the sweep to 64 MiB takes ~2 s on a 2-core machine)."""
MEMORY_SHARE = 0.25
"""Largest message: this share of a worker's free memory (the message, the transport's buffers, headroom)."""
WARMUP_ITERS = 3
MIN_ITERS, MAX_ITERS = 3, 20
"""Timed all-reduces per size: enough for `TARGET_S` seconds, within these bounds (nccl-tests: 5 warm-up, 20 timed)."""
TARGET_S = 0.5
JUDGED_MIN_BYTES = 16 * MIB
"""busbw is judged against `BUSBW_FLOORS_GBPS` at the largest size measured when it is at least this: smaller
messages are latency-bound and stay below a link's bandwidth on any hardware."""
BUSBW_FLOORS_GBPS = {"nccl": (10.0, 1.0), "gloo": (0.5, 0.05)}
"""(warn below, FAIL below) busbw in GB/s. NCCL: under 10 GB/s is below one PCIe 4.0 x16 link (~25 GB/s), let
alone NVLink (hundreds) or InfiniBand (~45 per 400 Gb/s NIC): NCCL usually fell back to TCP sockets; under 1 GB/s
is below 10 GbE. gloo runs over TCP: under 0.5 GB/s is below a 10 GbE link, under 0.05 GB/s below 1 GbE."""
COMM_SHARE_WARN = 1.0
"""Warn when the job's gradient all-reduce (its bytes at the measured algbw) takes longer than this share of the
simulated step's compute: DDP overlaps the all-reduce with the backward, but cannot hide more than the step."""
PLAN_RATIO_OK = (0.85, 1.15)
"""Planned / measured peak memory within which the planner is right (its own goal, docs/training.md)."""
TRANSFER_FLOOR_BYTES_S = 100e6
"""Warn below this object-store rate between nodes (bytes/s): slower than 1 GbE (125 MB/s)."""
INLINE_OBJECT_BYTES = int(os.environ.get("RAY_max_direct_call_object_size", 100 * 1024))
"""Ray returns objects up to this size inside the task's reply, not through the object store (RayConfig
`max_direct_call_object_size`, 100 KiB by default): a smaller latent batch is measured at `MIN_TRANSFER_BYTES`."""
MIN_TRANSFER_BYTES = MIB
TRANSFER_REPEATS, TRANSFER_BUDGET_S = 5, 10.0
"""Timed transfers (after one warm-up): up to this many, stopping after the budget (seconds) with 2 or more."""
STEPS = 3
"""Simulated training steps: the first warms up (allocates the optimizer state), the others are timed."""
GROUP_START_S, PROCESS_GROUP_S, CALL_TIMEOUT_S = 60.0, 120.0, 600.0
"""Seconds to wait for the workers' placement, for their process group to form, and for one measuring call."""


def message_sizes(max_bytes: int, *, min_bytes: int = MIB, factor: int = 4) -> list[int]:
    """`min_bytes` x `factor`^k up to `max_bytes` (1, 4, 16, 64 MiB for 64 MiB). Raises ValueError when
    `max_bytes` < `min_bytes`."""
    if max_bytes < min_bytes:
        raise ValueError(f"the largest message ({max_bytes} bytes) is below the smallest ({min_bytes} bytes)")
    sizes, size = [], min_bytes
    while size <= max_bytes:
        sizes.append(size)
        size *= factor
    return sizes


def bus_bandwidth(nbytes: float, seconds: float, world_size: int) -> tuple[float, float]:
    """(algbw, busbw) in bytes/s of an all-reduce of `nbytes` per rank that took `seconds` on `world_size` ranks:
    algbw = S / t, busbw = algbw x 2(n-1)/n (NVIDIA/nccl-tests, doc/PERFORMANCE.md: each rank sends and receives
    2(n-1)/n of the data, whatever the algorithm). Raises ValueError for t <= 0 or n < 1."""
    if not seconds > 0 or world_size < 1:
        raise ValueError(f"need seconds > 0 and world_size >= 1, got {seconds} and {world_size}")
    algbw = nbytes / seconds
    return algbw, algbw * 2 * (world_size - 1) / world_size


def cap_sizes(sizes: list[int], free_bytes: float) -> tuple[list[int], int | None]:
    """(the sizes that fit in `MEMORY_SHARE` of a worker's `free_bytes`, the cap when it removed any, else None)."""
    cap = int(free_bytes * MEMORY_SHARE)
    kept = [s for s in sizes if s <= cap]
    return kept, (cap if len(kept) < len(sizes) else None)


def bandwidth_level(backend: str, busbw: float, nbytes: int) -> Level:
    """`ok`, `warn` or `fail` for `busbw` (bytes/s) measured at `nbytes` (`BUSBW_FLOORS_GBPS`); `ok` below
    `JUDGED_MIN_BYTES` (latency-bound: not judged)."""
    if nbytes < JUDGED_MIN_BYTES:
        return "ok"
    warn_gbps, fail_gbps = BUSBW_FLOORS_GBPS[backend]
    if busbw < fail_gbps * GB:
        return "fail"
    return "warn" if busbw < warn_gbps * GB else "ok"


def comm_level(comm_s: float, step_s: float) -> Level:
    """`warn` when the gradient all-reduce (`comm_s`) exceeds `COMM_SHARE_WARN` of the step's compute (`step_s`)."""
    return "warn" if comm_s > COMM_SHARE_WARN * step_s else "ok"


def memory_level(planned: float, measured: float, *, device_bytes: float | None = None,
                 headroom: float | None = None) -> Level:
    """`warn` when planned / measured is outside `PLAN_RATIO_OK`, or when on a device of `device_bytes` the
    measured peak leaves less than `headroom` (the planner's `HEADROOM`) of it free; else `ok`."""
    if device_bytes and headroom is not None and measured > (1 - headroom) * device_bytes:
        return "warn"
    low, high = PLAN_RATIO_OK
    return "ok" if measured > 0 and low <= planned / measured <= high else "warn"


def transfer_level(rate: float, *, node_to_node: bool, batch_s: float | None = None,
                   step_s: float | None = None) -> Level:
    """`warn` when a node-to-node `rate` (bytes/s) is below `TRANSFER_FLOOR_BYTES_S`, or when one latent batch
    takes longer to arrive (`batch_s`) than a step (`step_s`); else `ok`."""
    if node_to_node and rate < TRANSFER_FLOOR_BYTES_S:
        return "warn"
    if batch_s is not None and step_s is not None and batch_s > step_s:
        return "warn"
    return "ok"


def gradient_bytes(trainable: int, job: Any) -> float | None:
    """Bytes a rank exchanges per step for `trainable` parameters' fp32 gradients, in all-reduce equivalents: DDP
    all-reduces them once (half with `train.grad_compression` fp16 or bf16, `INT4_WIRE_BYTES_RATIO` with int4);
    FSDP gathers the parameters twice and reduce-scatters the gradients, ~1.5x (`vidray.train.plan`). None for
    PowerSGD (a low-rank approximation)."""
    if job.train.grad_compression == "powersgd":
        return None
    from vidray.train.compressed_allreduce import INT4_WIRE_BYTES_RATIO  # heavy: torch

    share = {"fp16": 0.5, "bf16": 0.5, "int4": INT4_WIRE_BYTES_RATIO}.get(job.train.grad_compression, 1.0)
    nbytes = 4.0 * trainable * share
    return nbytes * (1.5 if job.scaling.strategy in ("fsdp", "hsdp") else 1.0)


def allreduce_seconds(nbytes: float, results: list[dict[str, float]], bucket_bytes: float) -> float:
    """Seconds to all-reduce `nbytes` in DDP's buckets of `bucket_bytes`, at the algbw measured for the size
    nearest (in log) to one bucket (`results`: {"bytes", "algbw"} per size)."""
    message = min(bucket_bytes, nbytes)
    nearest = min(results, key=lambda r: abs(math.log(r["bytes"] / max(message, 1.0))))
    return nbytes / nearest["algbw"]


def format_size(nbytes: float) -> str:
    """1 MiB, 64 MiB, 1 GiB, 24.0 KiB, 1.2 GiB."""
    for unit, scale in (("GiB", 2**30), ("MiB", MIB), ("KiB", 1024)):
        if nbytes >= scale:
            value = nbytes / scale
            return f"{value:.0f} {unit}" if value == int(value) else f"{value:.1f} {unit}"
    return f"{nbytes:.0f} B"


# 2. In a worker: torch.distributed and torch only (no Ray), so they also run in plain processes and tests.

def time_allreduce(nbytes: int, device: Any, *, warmup: int = WARMUP_ITERS, target_s: float = TARGET_S,
                   min_iters: int = MIN_ITERS, max_iters: int = MAX_ITERS) -> dict[str, float]:
    """Time an all-reduce (sum) of `nbytes` of float32 on the default process group, as nccl-tests does: `warmup`
    all-reduces, one more to size the run (as many as fit `target_s` at the slowest rank's pace, within
    [`min_iters`, `max_iters`]), a barrier, then that many back to back, the device synchronised at the end; every
    rank calls it. Returns {"bytes", "seconds": per all-reduce, averaged over ranks, "iters", "algbw", "busbw"}."""
    import torch  # heavy: torch, numpy
    import torch.distributed as dist  # heavy: torch, numpy

    device = torch.device(device)
    sync = torch.cuda.synchronize if device.type == "cuda" else (lambda: None)
    buf = torch.zeros(nbytes // 4, dtype=torch.float32, device=device)  # zeros: sums stay finite at any count
    for _ in range(warmup):
        dist.all_reduce(buf)
    sync()
    start = time.perf_counter()
    dist.all_reduce(buf)
    sync()
    slowest = torch.tensor([time.perf_counter() - start], dtype=torch.float64, device=device)
    dist.all_reduce(slowest, op=dist.ReduceOp.MAX)
    iters = max(min_iters, min(max_iters, int(target_s / max(float(slowest), 1e-9))))
    dist.barrier()
    start = time.perf_counter()
    for _ in range(iters):
        dist.all_reduce(buf)
    sync()
    mean = torch.tensor([(time.perf_counter() - start) / iters], dtype=torch.float64, device=device)
    dist.all_reduce(mean)
    seconds = float(mean) / dist.get_world_size()
    algbw, busbw = bus_bandwidth(nbytes, seconds, dist.get_world_size())
    return {"bytes": nbytes, "seconds": seconds, "iters": iters, "algbw": algbw, "busbw": busbw}


def single_rank_strategy(job: Any):
    """The planner's `Strategy` for the job's step on one rank: `job_strategy`, with fsdp as ddp and fsdp+lora as
    lora (one rank holds everything; `check_fits` plans fsdp on one GPU the same way)."""
    from vidray.train.plan import job_strategy  # heavy: pydantic

    strategy = job_strategy(job)
    return replace(strategy, kind={"fsdp": "ddp", "fsdp+lora": "lora"}.get(strategy.kind, strategy.kind))


def without_context(job: Any) -> Any:
    """`job` with `parallel.context` at degree 1: what one rank runs when it holds the whole sample."""
    from vidray.train.plan import job_context  # heavy: pydantic

    if job_context(job) == (1, 1):
        return job
    context = replace(job.parallel.context, ulysses=1, ring=1)
    return replace(job, parallel=replace(job.parallel, context=context))


def context_bytes(job: Any) -> float:
    """Bytes a rank sends per step for `job`'s context parallel (`vidray.train.plan.context_step_traffic_bytes`
    over its largest bucket and batch, its precision and activation checkpointing); 0 at degree 1."""
    from vidray.train.plan import (context_step_traffic_bytes, job_context, job_preset, job_strategy,  # heavy: pydantic
                                   largest_bucket)

    ulysses, ring = job_context(job)
    if ulysses * ring == 1:
        return 0.0
    preset = job_preset(job)
    bucket, batch = largest_bucket(job, preset)
    strategy = job_strategy(job)
    return float(context_step_traffic_bytes(preset, bucket, ulysses=ulysses, ring=ring, precision=strategy.precision,
                                            activation_checkpointing=strategy.activation_checkpointing,
                                            text_tokens=job.model.max_sequence_length, batch_size=batch))


def simulated_step(job: Any, device: Any, *, num_steps: int = STEPS) -> dict[str, Any]:
    """Run `num_steps` (>= 2) training steps of `job`'s transformer on `device`, as `vidray.train.loop` runs them
    on one rank, on random latents and prompt embeddings of the largest bucket and batch the planner plans.

    Returns {"preset", "bucket", "batch", "text_tokens", "strategy", "device", "trainable", "step_s": median of
    the steps after the first, "first_step_s", "peak_bytes" (one steady step: `max_memory_allocated` on CUDA,
    tracked tensor bytes on CPU), "planned_bytes", "rss_peak_bytes" (CPU), "device_bytes" (CUDA)}, or
    {"error": "<type>: <message>", "oom": bool} when a step raised."""
    import torch  # heavy: torch, numpy

    from vidray.train.plan import MemoryMode, estimate_memory, job_mode, plan_job  # heavy: pydantic

    if num_steps < 2:
        raise ValueError(f"num_steps must be >= 2 (the first warms up), got {num_steps}")
    device = torch.device(device)
    # 1. What the planner plans: the largest bucket and its batch, the strategy on one rank (no context group: one
    #    rank holds the whole sample).
    report = plan_job(without_context(job), gpu_memory_bytes=2**60, num_gpus=1)
    strategy = single_rank_strategy(job)
    planned = estimate_memory(report.preset, report.counts, strategy, bucket=report.bucket,
                              batch_size=report.batch_size, text_tokens=report.text_tokens, num_gpus=1,
                              mode=MemoryMode(job_mode(job).storage if strategy.precision == "bf16" else "fp32"))
    out: dict[str, Any] = {"preset": report.preset.name, "bucket": list(report.bucket), "batch": report.batch_size,
                           "text_tokens": report.text_tokens, "strategy": strategy.name, "device": device.type,
                           "planned_bytes": planned.peak_bytes}
    try:
        out.update(_run_steps(job, device, report, num_steps))
    except Exception as err:  # noqa: BLE001 - an OOM or a setting the step refuses: reported as a FAIL line
        oom = isinstance(err, torch.OutOfMemoryError) or "out of memory" in str(err).lower()
        out.update(error=f"{type(err).__name__}: {' '.join(str(err).split())[:300]}", oom=oom)
    return out


def _build_step(job: Any, device: Any, report: Any):
    """(transformer, one-step callable, inputs) set up as `vidray.train.loop` sets them up on one rank (with
    `model.experts` layout groups: the high-noise expert alone, on its side of the boundary)."""
    import torch  # heavy: torch, numpy

    from vidray.models.registry import get_family  # heavy: torch, numpy, pydantic
    from vidray.train.optim import build_optimizer  # heavy: torch, diffusers, safetensors
    from vidray.train.parallel import apply_activation_checkpointing  # heavy: torch, numpy, pydantic
    from vidray.train.precision import Precision  # heavy: torch, numpy
    from vidray.train.step import flow_matching_step_loss, step_generator  # heavy: torch, numpy, pydantic

    family = get_family(job.model.family).for_model(job.model)
    experts, sigma_range = job.model.experts, None
    if experts is not None and experts.layout == "groups":  # a rank holds one expert (vidray.train.expert_groups)
        from vidray.models.experts import ExpertSlot, expert_sigma_range  # heavy: torch, numpy

        expert = family.load_diffusion_models(job.model, seed=job.train.seed, expert="high").transformer
        transformer = ExpertSlot(expert, "high")
        transformer, sigma_range = transformer.to(device), expert_sigma_range("high", experts.boundary_ratio)
    else:
        transformer = family.load_diffusion_models(job.model, seed=job.train.seed).transformer.to(device)
    if job.model.lora is not None:
        from vidray.models.lora import apply_lora  # heavy: torch, numpy

        apply_lora(transformer, job.model.lora, seed=job.train.seed)
    no_grad = set(family.no_grad_parameter_names(transformer))
    for name, param in transformer.named_parameters():
        if name in no_grad:
            param.requires_grad_(False)
    transformer.train()
    apply_activation_checkpointing(transformer, job.train.activation_checkpointing, family.block_lists(transformer))
    optimizer = build_optimizer(transformer.parameters(), job.optim)
    precision = Precision(job.train.mixed_precision, device)
    g = torch.Generator().manual_seed(job.train.seed)
    batch, tokens = report.batch_size, report.text_tokens
    inputs = {  # (B, C, F, H, W), (B, L, D), (B, L)
        "latents": torch.randn(family.latent_shape(report.bucket, batch), generator=g).to(device),
        "prompt_embeds": torch.randn(batch, tokens, family.prompt_embeds_dim(transformer), generator=g).to(device),
        "prompt_attention_mask": torch.ones(batch, tokens, dtype=torch.bool, device=device),
    }
    # An image-to-video model's condition, as a text-only sample gets it (its shapes and cost are a clip's).
    condition = family.condition(transformer, latent_shape=tuple(inputs["latents"].shape), device=device)
    condition = condition.predict_kwargs() if condition is not None else {}

    def one_step(step: int) -> None:
        optimizer.zero_grad(set_to_none=True)
        with precision.autocast():
            loss = flow_matching_step_loss(family, transformer, inputs["latents"], inputs["prompt_embeds"],
                                           inputs["prompt_attention_mask"], job.flow,
                                           step_generator(job.train.seed, step, 0), sigma_range=sigma_range,
                                           **condition)
        precision.backward(loss)
        precision.unscale_(optimizer)
        if job.train.grad_clip_norm is not None:
            torch.nn.utils.clip_grad_norm_(transformer.parameters(), job.train.grad_clip_norm)
        precision.step(optimizer)

    return transformer, optimizer, one_step, inputs


def _run_steps(job: Any, device: Any, report: Any, num_steps: int) -> dict[str, Any]:
    """Build, time `num_steps` steps, then measure one steady step's peak memory (see `simulated_step`)."""
    import torch  # heavy: torch, numpy

    from vidray.train.memory import TensorBytesTracker  # heavy: torch, numpy

    cuda = device.type == "cuda"
    sync = torch.cuda.synchronize if cuda else (lambda: None)
    _reset_peak_rss()
    transformer, optimizer, one_step, inputs = _build_step(job, device, report)
    times = []
    for step in range(1, num_steps + 1):
        if cuda and step == num_steps:
            torch.cuda.reset_peak_memory_stats(device)
        sync()
        start = time.perf_counter()
        one_step(step)
        sync()
        times.append(time.perf_counter() - start)
    out = {"trainable": sum(p.numel() for p in transformer.parameters() if p.requires_grad),
           "step_s": statistics.median(times[1:]), "first_step_s": times[0], "num_steps": num_steps}
    if cuda:
        out["peak_bytes"] = torch.cuda.max_memory_allocated(device)
        out["device_bytes"] = torch.cuda.get_device_properties(device).total_memory
        return out
    tracker = TensorBytesTracker()  # one more steady step, outside the timing (the mode slows every op)
    with tracker:
        tracker.track(list(transformer.parameters()), list(transformer.buffers()), inputs,
                      [dict(state) for state in optimizer.state.values()])
        one_step(num_steps + 1)
    out["peak_bytes"] = tracker.peak_bytes
    out["rss_peak_bytes"] = _peak_rss()
    return out


def _reset_peak_rss() -> None:
    """Reset this process's peak RSS (VmHWM; Linux >= 4.0: `5` written to /proc/self/clear_refs); else nothing."""
    with contextlib.suppress(OSError):
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")


def _peak_rss() -> int:
    """This process's peak RSS in bytes since `_reset_peak_rss` (VmHWM), or since it started (ru_maxrss)."""
    with contextlib.suppress(OSError, ValueError):
        with open("/proc/self/status") as f:
            for line in f:
                if line.startswith("VmHWM:"):
                    return int(line.split()[1]) * 1024

    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024


# 3. On Ray: the workers (actors in the job's placement), and the transfer's two ends.

class MeasureWorker:
    """One of the job's workers for the measurement (`ray.remote(MeasureWorker)`, one per placement bundle)."""

    def describe(self) -> dict[str, Any]:
        """{"node_id", "ip", "port": a free port on this node (rank 0's serves the process group's store),
        "gpu_ids", "available_bytes": the node's available memory}."""
        import psutil  # heavy: psutil
        import ray  # heavy: ray

        ip = ray.util.get_node_ip_address()
        with socket.socket() as s:
            s.bind((ip, 0))
            port = s.getsockname()[1]
        return {"node_id": ray.get_runtime_context().get_node_id(), "ip": ip, "port": port,
                "gpu_ids": [str(g) for g in ray.get_gpu_ids()],
                "available_bytes": psutil.virtual_memory().available}

    def join(self, url: str, rank: int, world_size: int, backend: str, visible: str | None,
             local_index: int) -> float:
        """Join the process group at `url` (`visible`: the CUDA devices every worker of this node sees, as Ray Train
        shares them, so that NCCL can use NVLink; `local_index`: this worker's among them). Returns the free bytes
        of this worker's device (GPU), or NaN on CPU (the driver divides the node's memory)."""
        import torch  # heavy: torch, numpy
        import torch.distributed as dist  # heavy: torch, numpy

        torch.set_num_threads(max(1, int(os.environ.get("OMP_NUM_THREADS", "1"))))  # as vidray.train.loop
        if visible is not None:
            os.environ["CUDA_VISIBLE_DEVICES"] = visible
            torch.cuda.set_device(local_index)
            self.device = torch.device("cuda", local_index)
        else:
            self.device = torch.device("cpu")
        dist.init_process_group(backend, init_method=url, rank=rank, world_size=world_size,
                                timeout=timedelta(seconds=PROCESS_GROUP_S))
        return float(torch.cuda.mem_get_info()[0]) if visible is not None else float("nan")

    def allreduce(self, sizes: list[int]) -> list[dict[str, float]]:
        return [time_allreduce(size, self.device) for size in sizes]

    def step(self, job_dict: dict[str, Any], num_steps: int) -> dict[str, Any]:
        from vidray.config import job_config_from_dict  # heavy: pydantic

        return simulated_step(job_config_from_dict(job_dict), self.device, num_steps=num_steps)

    def leave(self) -> None:
        import torch.distributed as dist  # heavy: torch, numpy

        if dist.is_initialized():
            dist.destroy_process_group()


class TransferEnd:
    """One end of the transfer measurement (`ray.remote(TransferEnd)`, no CPU reserved, pinned to a node)."""

    def node_id(self) -> str:
        import ray  # heavy: ray

        return ray.get_runtime_context().get_node_id()

    def make(self, nbytes: int, fill: float):
        """A float32 array of `nbytes`, returned: Ray stores it in this node's object store."""
        import numpy as np  # heavy: numpy

        return np.full(nbytes // 4, fill, dtype=np.float32)

    def fetch(self, refs: list) -> float:
        """Seconds to get `refs[0]` (pulled from the node that holds it) and copy it once into this process."""
        import numpy as np  # heavy: numpy
        import ray  # heavy: ray

        start = time.perf_counter()
        array = np.array(ray.get(refs[0]), copy=True)
        seconds = time.perf_counter() - start
        del array
        return seconds


class MeasureError(Exception):
    """The measurement could not run (workers not placed, no process group): one FAIL line, the message says why
    and what to do."""


@contextlib.contextmanager
def _ray_session() -> Iterator[None]:
    """The Ray this process uses: already initialized, joined quietly (`RAY_ADDRESS`), or a local one started as
    `vidray train` starts it (and shut down at the end)."""
    import ray  # heavy: ray

    if ray.is_initialized():
        yield
        return
    if os.environ.get("RAY_ADDRESS"):
        check_ray_address(os.environ["RAY_ADDRESS"])
        apply_ray_env_defaults()
        ray.init(logging_level=logging.WARNING, log_to_driver=False)
    else:
        init_ray(log_to_driver=False)
    try:
        yield
    finally:
        ray.shutdown()


class WorkerGroup:
    """The job's workers as Ray Train places them (`build_trainer_configs`: `scaling.cpus_per_worker` CPUs and a GPU
    each with `scaling.use_gpu`, PACK, `placement.dit`'s selector), joined in one process group."""

    def __init__(self, job: Any, selector: dict[str, str] | None):
        from ray.util.placement_group import placement_group  # heavy: ray

        self.num_workers = job.scaling.min_workers
        self.backend = "nccl" if job.scaling.use_gpu else "gloo"
        bundle = {"CPU": float(job.scaling.cpus_per_worker), **({"GPU": 1.0} if job.scaling.use_gpu else {})}
        self.bundle = bundle
        self.pg = placement_group([dict(bundle)] * self.num_workers, strategy="PACK",
                                  **({"bundle_label_selector": [dict(selector)] * self.num_workers}
                                     if selector else {}))
        self.actors: list[Any] = []
        if not self.pg.wait(timeout_seconds=GROUP_START_S):
            self.close()
            raise MeasureError(
                f"the job's {self.num_workers} worker(s) of {bundle} could not be placed within {GROUP_START_S:.0f} s: "
                "another run holds the resources, or no node has them (`ray status` shows both): wait for it or "
                "free them, then run the doctor again")
        try:
            self._start_actors()
        except Exception as err:
            self.close()
            if isinstance(err, MeasureError):
                raise
            raise MeasureError(f"the job's workers did not start: {type(err).__name__}: "
                               f"{' '.join(str(err).split())[:200]}; `ray status` and the workers' logs say why") from None

    def _start_actors(self) -> None:
        import ray  # heavy: ray
        from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy  # heavy: ray

        env = worker_env()
        remote = ray.remote(MeasureWorker)
        self.actors = [remote.options(
            num_cpus=self.bundle["CPU"], num_gpus=self.bundle.get("GPU", 0),
            scheduling_strategy=PlacementGroupSchedulingStrategy(self.pg, placement_group_bundle_index=i),
            **({"runtime_env": {"env_vars": env}} if env else {})).remote() for i in range(self.num_workers)]
        self.infos = ray.get([a.describe.remote() for a in self.actors], timeout=CALL_TIMEOUT_S)
        self.nodes = [info["node_id"] for info in self.infos]
        master = self.infos[0]
        url = f"tcp://{master['ip']}:{master['port']}"
        visible = self._visible_gpus() if self.backend == "nccl" else [(None, 0)] * self.num_workers
        joins = [a.join.remote(url, rank, self.num_workers, self.backend, *visible[rank])
                 for rank, a in enumerate(self.actors)]
        try:
            free = ray.get(joins, timeout=PROCESS_GROUP_S + 30)
        except Exception as err:  # noqa: BLE001 - a timeout or the process group's own error
            raise MeasureError(
                f"the {self.num_workers} workers did not form a {self.backend} process group at {url}: "
                f"{type(err).__name__}: {' '.join(str(err).split())[:200]}. Every worker connects to the first "
                f"({master['ip']}) and to the others over TCP: open the ports between the nodes, or set "
                f"{'NCCL' if self.backend == 'nccl' else 'GLOO'}_SOCKET_IFNAME to the interface they share") from None
        per_node = {n: self.nodes.count(n) for n in self.nodes}
        self.free_bytes = min(f if not math.isnan(f) else info["available_bytes"] / per_node[info["node_id"]]
                              for f, info in zip(free, self.infos))

    def _visible_gpus(self) -> list[tuple[str, int]]:
        """(CUDA_VISIBLE_DEVICES, own index) per worker: the GPUs of all workers on its node, as Ray Train's
        `_share_cuda_visible_devices` sets them."""
        by_node: dict[str, list[str]] = {}
        for info in self.infos:
            by_node.setdefault(info["node_id"], []).extend(info["gpu_ids"])
        out = []
        for info in self.infos:
            ids = sorted(set(by_node[info["node_id"]]), key=lambda g: (len(g), g))
            out.append((",".join(ids), ids.index(info["gpu_ids"][0])))
        return out

    def sweep(self, sizes: list[int]) -> list[dict[str, float]]:
        import ray  # heavy: ray

        results = ray.get([a.allreduce.remote(sizes) for a in self.actors], timeout=CALL_TIMEOUT_S)
        return results[0]  # every rank returns the same averaged figures

    def step(self, job: Any, num_steps: int) -> dict[str, Any]:
        import ray  # heavy: ray

        return ray.get(self.actors[0].step.remote(job.to_dict(), num_steps), timeout=CALL_TIMEOUT_S)

    def close(self) -> None:
        import ray  # heavy: ray
        from ray.util.placement_group import remove_placement_group  # heavy: ray

        for actor in self.actors:
            with contextlib.suppress(Exception):
                ray.get(actor.leave.remote(), timeout=10)
            ray.kill(actor)
        remove_placement_group(self.pg)


def latent_batch_bytes(job: Any) -> tuple[int, str]:
    """(bytes of one float32 latent batch of the job's largest bucket, "9x64x64 x2")."""
    from vidray.models.registry import get_family  # heavy: torch, numpy, pydantic
    from vidray.train.plan import job_preset, largest_bucket  # heavy: pydantic

    bucket, batch = largest_bucket(job, job_preset(job))
    shape = get_family(job.model.family).for_model(job.model).latent_shape(bucket, batch)
    return 4 * math.prod(shape), f"{bucket.num_frames}x{bucket.height}x{bucket.width} x{batch}"


def measure_transfer(nbytes: int, receiver: str, others: list[str]) -> dict[str, Any]:
    """Time moving `nbytes` from an actor on another alive node (the first of `others` with an object store, else
    `receiver` itself) to one on node `receiver`. Returns {"bytes", "seconds": median, "repeats", "rate",
    "node_to_node", "sender", "receiver"} or {"error"}."""
    import ray  # heavy: ray
    from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy  # heavy: ray

    sender = next((n for n in others if n != receiver), receiver)
    remote = ray.remote(TransferEnd)
    ends = [remote.options(num_cpus=0, scheduling_strategy=NodeAffinitySchedulingStrategy(node, soft=False)).remote()
            for node in (sender, receiver)]
    out = {"bytes": nbytes, "node_to_node": sender != receiver, "sender": sender, "receiver": receiver}
    try:
        times: list[float] = []
        budget_end = time.monotonic() + TRANSFER_BUDGET_S
        for i in range(TRANSFER_REPEATS + 1):  # the first warms up the connection
            ref = ends[0].make.remote(nbytes, float(i))
            ray.wait([ref], timeout=CALL_TIMEOUT_S, fetch_local=False)  # made, and not pulled here
            seconds = ray.get(ends[1].fetch.remote([ref]), timeout=CALL_TIMEOUT_S)
            del ref
            if i:
                times.append(seconds)
            if len(times) >= 2 and time.monotonic() > budget_end:
                break
        median = statistics.median(times)
        out.update(seconds=median, repeats=len(times), rate=nbytes / median)
    except Exception as err:  # noqa: BLE001 - a timeout, a lost object: a FAIL line
        out["error"] = f"{type(err).__name__}: {' '.join(str(err).split())[:200]}"
    finally:
        for end in ends:
            ray.kill(end)
    return out


def _object_store_bytes(node_ids: list[str]) -> float:
    import ray  # heavy: ray

    stores = [n["Resources"].get("object_store_memory", 0) for n in ray.nodes()
              if n.get("Alive") and n["NodeID"] in node_ids]
    return min(stores) if stores else float("inf")


# 4. The orchestration and its lines.

def measure(job: Any, *, max_message_mib: float | None = None, transfer_mib: float | None = None,
            num_steps: int = STEPS) -> list[Finding]:
    """Measure the job's cluster (module docstring) and return the lines: `allreduce <size>` per size and
    `allreduce`, `transfer`, `step`; or one `measure` FAIL when the workers cannot be placed or joined. Joins
    `RAY_ADDRESS` or starts a local Ray when Ray is not initialized, and leaves it again; reserves the job's
    workers for the measurement only."""
    import ray  # heavy: ray

    with _ray_session():
        # 1. The job's workers, placed as Ray Train places them, in one process group.
        try:
            group = WorkerGroup(job, _dit_selector(job))
        except MeasureError as err:
            return [Finding("fail", "measure", str(err))]
        try:
            # 2. All-reduce sweep (every worker), then the simulated step (the first worker).
            sweep = _sweep(group, job, max_message_mib) if group.num_workers > 1 else None
            step = group.step(job, num_steps)
        except ray.exceptions.GetTimeoutError:
            return [Finding("fail", "measure", f"a measurement took over {CALL_TIMEOUT_S:.0f} s: the workers hang "
                            "(a collective waiting for a rank that cannot reach it); check the nodes' network")]
        except ray.exceptions.RayError as err:  # a worker died (killed for memory, its node lost)
            return [Finding("fail", "measure", f"a worker failed while measuring: {type(err).__name__}: "
                            f"{' '.join(str(err).split())[:300]}; `ray status` and the worker's log say why")]
        finally:
            group.close()
        # 3. The object store between two nodes (the first worker's and another).
        transfer = _transfer(job, group.nodes, transfer_mib)
    return [*(sweep_findings(sweep, job, step) if sweep else [_skipped_sweep(job)]),
            transfer_finding(transfer, step), step_finding(step)]


def _transfer(job: Any, worker_nodes: list[str], transfer_mib: float | None) -> dict[str, Any]:
    """`measure_transfer` of the job's latent batch (or `transfer_mib`; `MIN_TRANSFER_BYTES` when Ray would pass
    it inline; at most `MEMORY_SHARE` of the object store) to the first worker's node from another node, another
    worker's first."""
    import ray  # heavy: ray

    latent_bytes, what = latent_batch_bytes(job)
    wanted = int(transfer_mib * MIB) if transfer_mib else latent_bytes
    nbytes = max(wanted, MIN_TRANSFER_BYTES) if wanted <= INLINE_OBJECT_BYTES else wanted
    receiver = worker_nodes[0]
    others = [n["NodeID"] for n in ray.nodes() if n.get("Alive") and n["NodeID"] != receiver]
    others.sort(key=lambda n: n not in worker_nodes)  # another worker's node first
    store_cap = int(_object_store_bytes([receiver, *others[:1]]) * MEMORY_SHARE)
    transfer = measure_transfer(min(nbytes, store_cap), receiver, others)
    transfer.update(latent_bytes=latent_bytes, latent=what, wanted=wanted, store_cap=store_cap)
    return transfer


def _dit_selector(job: Any) -> dict[str, str] | None:
    """`placement.dit`'s selector as `vidray train` resolves it on this cluster (None: anywhere)."""
    try:
        resolved, _ = _captured(lambda: resolve_placement(job, alive_nodes(),
                                                          autoscaler=autoscaler_max_resources() is not None))
    except Exception:  # noqa: BLE001 - the static placement line has the FAIL; measure unplaced
        return None
    return resolved.get("dit")


def _sweep(group: WorkerGroup, job: Any, max_message_mib: float | None) -> dict[str, Any]:
    requested = int((max_message_mib or DEFAULT_MAX_MESSAGE_MIB[group.backend]) * MIB)
    sizes, cap = cap_sizes(message_sizes(requested), group.free_bytes)
    results = group.sweep(sizes) if sizes else []
    return {"backend": group.backend, "world_size": group.num_workers, "num_nodes": len(set(group.nodes)),
            "results": results, "requested": requested, "cap": cap, "free_bytes": group.free_bytes,
            "flag": max_message_mib is not None, "elastic": job.scaling.elastic}


def _skipped_sweep(job: Any) -> Finding:
    """The `allreduce` line of a job with one worker (at its min): nothing to measure, and why."""
    workers = job.scaling.describe_workers() + (", measured at its min" if job.scaling.elastic else "")
    return Finding("ok", "allreduce", f"skipped: one worker ({workers}) exchanges no gradients, so there is no "
                   "all-reduce to measure; with scaling.num_workers >= 2 the doctor measures it")


def sweep_findings(sweep: dict[str, Any], job: Any, step: dict[str, Any] | None) -> list[Finding]:
    """One `allreduce <size>` line per size, then the `allreduce` verdict (see `summary_finding`)."""
    found = []
    for r in sweep["results"]:
        found.append(Finding("ok", f"allreduce {format_size(r['bytes'])}",
                             f"busbw {r['busbw'] / GB:7.2f} GB/s, algbw {r['algbw'] / GB:7.2f} GB/s, "
                             f"{1e3 * r['seconds']:8.2f} ms per all-reduce ({r['iters']} timed)"))
    return [*found, summary_finding(sweep, job, step)]


def summary_finding(sweep: dict[str, Any], job: Any, step: dict[str, Any] | None) -> Finding:
    """The `allreduce` line: the workers and backend, busbw at the largest size against `BUSBW_FLOORS_GBPS`, the
    cap, and the job's gradient exchange per step against the simulated step (`COMM_SHARE_WARN`)."""
    backend, n = sweep["backend"], sweep["world_size"]
    where = f"{n} workers on {sweep['num_nodes']} node(s), {backend}" + (" (elastic: its min)" if sweep["elastic"]
                                                                       else "")
    mib = f"{sweep['requested'] / MIB:g}"
    flag = (f"--max-message-mib {mib}" if sweep["flag"]
            else f"the {backend} default, {mib} MiB; --max-message-mib sets it")
    cap = (f"; capped at {format_size(sweep['cap'])} ({MEMORY_SHARE:.0%} of a worker's "
           f"{format_size(sweep['free_bytes'])} free)" if sweep["cap"] else "")
    if not sweep["results"]:
        return Finding("fail", "allreduce", f"{where}: no message fits in {MEMORY_SHARE:.0%} of a worker's "
                       f"{format_size(sweep['free_bytes'])} free memory: free memory on the workers' nodes")
    largest = sweep["results"][-1]
    level = bandwidth_level(backend, largest["busbw"], largest["bytes"])
    text = (f"{where}: busbw {largest['busbw'] / GB:.2f} GB/s at {format_size(largest['bytes'])}, the largest size "
            f"({flag}{cap})")
    if largest["bytes"] < JUDGED_MIN_BYTES:
        text += f"; not judged below {format_size(JUDGED_MIN_BYTES)} (latency-bound)"
    elif level != "ok":
        warn_gbps, fail_gbps = BUSBW_FLOORS_GBPS[backend]
        floor = fail_gbps if level == "fail" else warn_gbps
        text += f", below {floor:g} GB/s: {_bandwidth_fix(backend)}"
    comm = _comm_text(sweep, job, step)
    if comm:
        comm_text, comm_lvl = comm
        text += f"; {comm_text}"
        level = _worst(level, comm_lvl)
    return Finding(level, "allreduce", text)


def _bandwidth_fix(backend: str) -> str:
    if backend == "nccl":
        return ("NCCL_DEBUG=INFO shows its transport (NET/Socket is TCP: enable InfiniBand/EFA or GPUDirect RDMA, or "
                "set NCCL_SOCKET_IFNAME to the fast interface); within a node `nvidia-smi topo -m` shows NVLink or "
                "PCIe")
    return ("gloo runs over TCP: set GLOO_SOCKET_IFNAME to the nodes' fast interface, keep the workers on fewer nodes "
            "(placement.dit.label_selector), or train on GPUs")


def _comm_text(sweep: dict[str, Any], job: Any, step: dict[str, Any] | None) -> tuple[str, Level] | None:
    """The job's gradient exchange per step (one expert's, within its group, with `model.experts` layout groups),
    predicted at the measured algbw, against the step's compute."""
    if not step or "error" in step:
        return None
    if job.data_parallel_workers * job.parallel.context.degree < 2 <= job.scaling.max_workers:  # model.experts
        # layout groups of one worker each (a context group's ranks all-reduce their partial gradients)
        return "each expert's worker group has one worker: its gradients are not all-reduced", "ok"
    nbytes = gradient_bytes(step["trainable"], job)
    if nbytes is None:
        return "train.grad_compression=powersgd sends a low-rank approximation: its exchange is not estimated", "ok"
    seconds = allreduce_seconds(nbytes, sweep["results"], job.train.bucket_cap_mb * MIB)
    share = seconds / step["step_s"]
    text = (f"the job's gradients ({format_size(nbytes)} a step) take ~{1e3 * seconds:.1f} ms, {share:.0%} of the "
            f"simulated step's {1e3 * step['step_s']:.1f} ms")
    context = context_bytes(job)
    if context:  # the all-to-alls of parallel.context, at the all-reduce's algbw (the collective differs: a guide)
        context_s = allreduce_seconds(context, sweep["results"], job.train.bucket_cap_mb * MIB)
        text += (f"; context parallel's all-to-alls ({format_size(context)} a rank per step, "
                 f"`vidray.train.plan.context_step_traffic_bytes`) ~{1e3 * context_s:.1f} ms at the same algbw")
    level = comm_level(seconds, step["step_s"])
    if level == "warn":
        text += (": more than the step's compute, which DDP cannot hide behind the backward: set "
                 "train.grad_compression (int4, fp16, or bf16 on GPUs), or use fewer nodes or a faster network")
    return text, level


def transfer_finding(t: dict[str, Any], step: dict[str, Any] | None) -> Finding:
    """The `transfer` line: node-to-node (or same-node) rate of the latent batch, against `TRANSFER_FLOOR_BYTES_S`
    and the simulated step."""
    path = (f"node-to-node ({t['sender'][:8]} -> {t['receiver'][:8]})" if t["node_to_node"]
            else f"same-node ({t['receiver'][:8]}; one node, the node-to-node path is not measured)")
    asked = (f"the job's latent batch ({t['latent']}, {format_size(t['wanted'])})" if t["wanted"] == t["latent_bytes"]
             else f"--transfer-mib's {format_size(t['wanted'])}")
    size = format_size(t["bytes"])
    if t["bytes"] == t["wanted"]:
        size += f" ({asked})"
    elif t["wanted"] <= INLINE_OBJECT_BYTES:
        size += (f" (not {asked}: Ray passes objects under {format_size(INLINE_OBJECT_BYTES)} inside task messages, "
                 "not through the object store)")
    else:
        size += f" (not {asked}: capped at {MEMORY_SHARE:.0%} of the object store)"
    if "error" in t:
        return Finding("fail", "transfer", f"{path}: getting {size} failed: {t['error']}. The nodes' object managers "
                       "talk over TCP (object_manager_port, 8076 by default): open it between the nodes")
    batch_s = t["latent_bytes"] / t["rate"]
    step_s = step.get("step_s") if step and "error" not in step else None
    level = transfer_level(t["rate"], node_to_node=t["node_to_node"], batch_s=batch_s, step_s=step_s)
    text = (f"{path}: {size} at {t['rate'] / 1e6:.0f} MB/s ({1e3 * t['seconds']:.1f} ms, median of {t['repeats']}; "
            "get + one copy)")
    if step_s is not None:
        text += f"; a latent batch arrives in {1e3 * batch_s:.2g} ms, {batch_s / step_s:.1%} of a step"
    if level == "warn" and step_s is not None and batch_s > step_s:
        text += (": the trainer would wait for its latents: place the encode stages on the trainers' nodes "
                 "(placement.vae.label_selector and placement.text.label_selector as placement.dit's), or fill the "
                 "latent cache before training (`vidray encode CONFIG`)")
    elif level == "warn":
        text += (f": below {TRANSFER_FLOOR_BYTES_S / 1e6:.0f} MB/s (1 GbE): Ray moves objects over the network of "
                 "the node addresses `ray status` lists: start the nodes on their fast interface (--node-ip-address)")
    return Finding(level, "transfer", text)


def step_finding(step: dict[str, Any]) -> Finding:
    """The `step` line: time per step and peak memory against the plan (`PLAN_RATIO_OK`; a GPU's `HEADROOM`)."""
    from vidray.train.plan import HEADROOM, format_bytes  # heavy: pydantic

    b = step["bucket"]
    what = (f"{step['preset']} at {b[0]}x{b[1]}x{b[2]} x{step['batch']} ({step['text_tokens']} text tokens), "
            f"{step['strategy']} on one {step['device'].upper()} worker")
    if "error" in step:
        fix = ("out of memory: use the strategy `vidray plan CONFIG` picks, or lower the largest bucket or "
               "data.batch_size_per_worker" if step["oom"] else "`vidray train` would stop with the same error")
        return Finding("fail", "step", f"{what}: the step failed: {step['error']}; {fix}")
    planned, measured = step["planned_bytes"], step["peak_bytes"]
    memory = "peak memory" if step["device"] == "cuda" else "peak tensor memory"
    text = (f"{what}: {1e3 * step['step_s']:.1f} ms a step (median of {step['num_steps'] - 1} after the first, "
            f"{1e3 * step['first_step_s']:.0f} ms); {memory} {format_bytes(measured)}, the plan "
            f"{format_bytes(planned)} ({planned / measured:.2f}x)")
    if "rss_peak_bytes" in step:
        text += f"; peak RSS {format_bytes(step['rss_peak_bytes'])}"
    level = memory_level(planned, measured, device_bytes=step.get("device_bytes"), headroom=HEADROOM)
    if level == "warn" and step.get("device_bytes") and measured > (1 - HEADROOM) * step["device_bytes"]:
        text += (f": less than {HEADROOM:.0%} of the GPU's {format_bytes(step['device_bytes'])} stays free: set "
                 "train.activation_checkpointing=full or use the strategy `vidray plan CONFIG` picks")
    elif level == "warn":
        low, high = PLAN_RATIO_OK
        text += (f": outside {low}-{high}x, the planner mispredicts this model: its choice of strategy may be "
                 "wrong here; go by the measured peak (and report the case)")
    return Finding(level, "step", text)


def _worst(a: Level, b: Level) -> Level:
    order = ("ok", "warn", "fail")
    return max(a, b, key=order.index)
