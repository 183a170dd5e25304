"""Benchmark of issue 8: step-level batching and the batch policy of the serve plane's DiT `Denoiser`.

Run (it starts Ray, so under the machine-wide lock):
    flock /tmp/vidray-ray.lock .venv/bin/python benchmarks/serve.py [--seconds 5] [--rounds 2] [--steps 16]

One run, one local Ray (127.0.0.1), the tiny random EasyAnimate model exported to a temp folder, bucket 9x64x64:
1. `TextEncoder` encodes one prompt (its prompt_embeds are reused by every request).
2. One `Denoiser` replica (`vidray.serve.stages`) is driven through its DeploymentHandle by C closed-loop clients
   (each sends its next request when the previous one's latents arrive), for `--seconds` per cell, `--steps`
   denoising steps per request. The HTTP ingress, the job store and the VAE are left out on purpose: they do not
   batch, and on 2 cores their CPU would blur the Denoiser's figures.
3. Calibration: one request alone gives L1 (s); the latency target (the SLO) is 5 x L1, and the adaptive policy is
   deployed with it (`policy.latency_target_s`).
4. Grid: policies fixed batch 1, 2, 4, 8 (`reconfigure({"batch_size": b, "wait_s": 0.02})`) and adaptive
   (`{"batch_size": null}`), concurrency 1, 4, 8, in three scenarios: no delay, and an injected delay at the stage
   boundary (`boundary_delay_s` = 0.5 x L1, or 2.5 x L1 where it leaves the denoiser half the target, each plus a
   2 MB/s simulated link; this kernel has no netem, NOTES.md).
Each cell records throughput (requests/s), p50/p95 latency (s) and goodput (requests/s that met the target),
pooled over `--rounds` rounds, and the mean running batch (requests per step) and the steps run per batch size
of each round; a round runs every policy once, so a change in the machine's load hits all alike.

Figures (the last stdout line, one JSON object):
- `batched_vs_batch1_throughput`: best fixed batch's throughput / batch 1's, no delay, concurrency 8 (goal >= 2),
  with `batched_vs_batch1_p95` beside it (goal <= 1: the batched p95 is no worse, "at equal p95").
- `adaptive_vs_best_fixed_goodput_<scenario>`: adaptive goodput / the best fixed policy's goodput, goodput summed
  over the concurrency sweep (1, 4, 8: one number per policy for the whole load range), the best fixed policy
  being the fixed batch with the highest such sum in that scenario (goal >= 0.95, in each scenario).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

import vidray  # noqa: E402,F401  (Ray env defaults before ray is imported)

BUCKET = (9, 64, 64)
FIXED_BATCHES = (1, 2, 4, 8)
CONCURRENCY = (1, 4, 8)
SCENARIOS = ("no_delay", "delay", "long_delay")


def export_tiny_model(out: Path) -> Path:
    from vidray.config import FlowConfig, ModelConfig, job_config_from_dict
    from vidray.models import get_family
    from vidray.models.export import write_job_file

    family = get_family("easyanimate")
    components = family.build(ModelConfig(text_encoder="tiny_random", max_sequence_length=16), seed=0)
    path = family.save_pipeline(components, out / "diffusers", FlowConfig(shift=3.0))
    write_job_file(path, job_config_from_dict({
        "name": "bench-serve", "model": {"text_encoder": "tiny_random", "max_sequence_length": 16},
        "data": {"buckets": [list(BUCKET)]}, "flow": {"shift": 3.0},
    }))
    return path


def mean_batch_size(steps_by_batch_size: dict) -> float:
    """Requests per step of a {batch size: steps} histogram (0 with no step)."""
    steps = sum(steps_by_batch_size.values())
    return sum(int(b) * n for b, n in steps_by_batch_size.items()) / steps if steps else 0.0


def percentile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    if not ordered:
        return float("nan")
    index = min(len(ordered) - 1, max(0, round(q * (len(ordered) - 1))))
    return ordered[index]


async def run_cell(handle, base_request: dict, *, concurrency: int, seconds: float) -> tuple[list[float], float]:
    """C closed-loop clients for `seconds`: (latencies of the requests that finished in time (s), duration (s)).
    Requests still running at the end are awaited but not counted."""
    latencies: list[float] = []
    stop_at = time.perf_counter() + seconds
    counter = {"seed": 0}

    async def client():
        while time.perf_counter() < stop_at:
            counter["seed"] += 1
            request = dict(base_request, seed=counter["seed"], sent_at=time.time())
            start = time.perf_counter()
            async for event in handle.options(stream=True).denoise.remote(request):
                if "latents" in event:
                    break
            end = time.perf_counter()
            if end <= stop_at:
                latencies.append(end - start)

    started = time.perf_counter()
    await asyncio.gather(*(client() for _ in range(concurrency)))
    return latencies, min(time.perf_counter(), stop_at) - started


def summarize(runs: list[tuple[list[float], float]], *, concurrency: int, target_s: float) -> dict:
    """Pool the rounds of one cell: throughput and goodput over the total time, percentiles over all latencies."""
    latencies = [x for run, _ in runs for x in run]
    duration = sum(d for _, d in runs)
    return {
        "concurrency": concurrency,
        "completed": len(latencies),
        "throughput_rps": len(latencies) / duration,
        "goodput_rps": sum(1 for x in latencies if x <= target_s) / duration,
        "p50_s": percentile(latencies, 0.50),
        "p95_s": percentile(latencies, 0.95),
    }


async def measure(args) -> dict:
    import ray
    from ray import serve

    from vidray.models import get_family
    from vidray.runtime import init_ray
    from vidray.serve.stages import Denoiser, TextEncoder

    tmp = Path(tempfile.mkdtemp(prefix="vidray-bench-serve-"))
    model_path = str(export_tiny_model(tmp))
    started_ray = init_ray(num_cpus=4)
    import socket

    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        http_port = sock.getsockname()[1]
    serve.start(http_options={"host": "127.0.0.1", "port": http_port})
    try:
        text = serve.run(TextEncoder.options(num_replicas=1).bind(model_path), name="text", route_prefix=None)
        prompt_embeds, prompt_attention_mask = await text.encode.remote("a red ball rolling on green grass")
        base_request = {
            "prompt_embeds": prompt_embeds, "prompt_attention_mask": prompt_attention_mask,
            "negative_prompt_embeds": None, "negative_prompt_attention_mask": None, "guidance_scale": 1.0,
            "latent_shape": get_family("easyanimate").latent_shape(BUCKET, 1),
            "num_inference_steps": args.steps,
        }

        def deploy(target_s: float):
            policy = {"latency_target_s": target_s, "max_batch_size": max(FIXED_BATCHES), "max_wait_s": 0.02}
            app = Denoiser.options(num_replicas=1, max_ongoing_requests=32,
                                   ray_actor_options={"num_cpus": 1}).bind(model_path, policy)
            return serve.run(app, name="denoiser", route_prefix=None)

        # 1. Calibrate: a request alone (after a warm-up) sets the target.
        handle = deploy(target_s=60.0)
        await handle.reconfigure.remote({"batch_size": 1, "wait_s": 0.0})
        await run_cell(handle, base_request, concurrency=1, seconds=2.0)  # warm-up
        alone, _ = await run_cell(handle, base_request, concurrency=1, seconds=3.0)
        l1 = percentile(alone, 0.5)
        target_s = 5.0 * l1
        handle = deploy(target_s=target_s)
        await run_cell(handle, base_request, concurrency=4, seconds=2.0)  # warm-up (fits a, c)

        # 2. The grid, in rounds: each round runs every policy once, so load drift hits all policies alike.
        scenarios = {
            "no_delay": {"boundary_delay_s": 0.0, "boundary_bytes_per_s": 0.0},
            "delay": {"boundary_delay_s": 0.5 * l1, "boundary_bytes_per_s": 2e6},
            "long_delay": {"boundary_delay_s": 2.5 * l1, "boundary_bytes_per_s": 2e6},
        }
        policies = {f"fixed_{b}": {"batch_size": b, "wait_s": 0.02} for b in FIXED_BATCHES}
        policies["adaptive"] = {"batch_size": None, "wait_s": None}
        scenarios = {name: scenarios[name] for name in args.scenarios}
        raw = {sc: {name: {c: [] for c in CONCURRENCY} for name in policies} for sc in scenarios}
        histograms = {sc: {name: {c: [] for c in CONCURRENCY} for name in policies} for sc in scenarios}
        for scenario, delay in scenarios.items():
            for round_index in range(args.rounds):
                for name, knobs in policies.items():
                    await handle.reconfigure.remote({**knobs, **delay})
                    for concurrency in CONCURRENCY:
                        before = await handle.stats.remote()
                        latencies, duration = await run_cell(handle, base_request, concurrency=concurrency,
                                                             seconds=args.seconds)
                        after = await handle.stats.remote()
                        raw[scenario][name][concurrency].append((latencies, duration))
                        hist_before = before["steps_by_batch_size"]
                        hist = {b: n - hist_before.get(b, 0) for b, n in after["steps_by_batch_size"].items()
                                if n > hist_before.get(b, 0)}
                        histograms[scenario][name][concurrency].append(hist)
                        mean_batch = mean_batch_size(hist)
                        print(f"{scenario:9s} round {round_index} {name:9s} C={concurrency}: "
                              f"{len(latencies) / duration:.2f} req/s, p50 {percentile(latencies, 0.5):.3f} s, "
                              f"mean batch {mean_batch:.2f}", flush=True)
        cells = {sc: {name: [summarize(raw[sc][name][c], concurrency=c, target_s=target_s) for c in CONCURRENCY]
                      for name in policies} for sc in scenarios}
        for sc in scenarios:  # the mean running batch (requests per step), per round
            for name in policies:
                for row in cells[sc][name]:
                    rounds = histograms[sc][name][row["concurrency"]]
                    row["mean_batch_by_round"] = [round(mean_batch_size(h), 2) for h in rounds]
                    row["steps_by_batch_size_by_round"] = rounds
        for scenario in scenarios:
            for name in policies:
                for row in cells[scenario][name]:
                    print(f"{scenario:9s} {name:9s} C={row['concurrency']}: {row['throughput_rps']:.2f} req/s, "
                          f"goodput {row['goodput_rps']:.2f}, p50 {row['p50_s']:.3f} s, p95 {row['p95_s']:.3f} s")
        stats = await handle.stats.remote()
    finally:
        serve.shutdown()
        if started_ray:
            ray.shutdown()

    def at(scenario: str, name: str, concurrency: int = max(CONCURRENCY)) -> dict:
        return next(r for r in cells[scenario][name] if r["concurrency"] == concurrency)

    figures = {}
    best_fixed = None
    if "no_delay" in scenarios:
        batch1 = at("no_delay", "fixed_1")
        best_fixed = max((f"fixed_{b}" for b in FIXED_BATCHES[1:]),
                         key=lambda n: at("no_delay", n)["throughput_rps"])
        figures["batched_vs_batch1_throughput"] = {
            "value": round(at("no_delay", best_fixed)["throughput_rps"] / batch1["throughput_rps"], 3),
            "unit": "ratio", "goal": ">= 2"}
        figures["batched_vs_batch1_p95"] = {
            "value": round(at("no_delay", best_fixed)["p95_s"] / batch1["p95_s"], 3), "unit": "ratio",
            "goal": "<= 1"}
    def total_goodput(scenario: str, name: str) -> float:
        return sum(row["goodput_rps"] for row in cells[scenario][name])

    best_by_scenario = {}
    for scenario in scenarios:
        best = max((f"fixed_{b}" for b in FIXED_BATCHES), key=lambda n: total_goodput(scenario, n))
        best_by_scenario[scenario] = best
        figures[f"adaptive_vs_best_fixed_goodput_{scenario}"] = {
            "value": round(total_goodput(scenario, "adaptive") / max(total_goodput(scenario, best), 1e-9), 3),
            "unit": "ratio", "goal": ">= 0.95"}
    return {
        "benchmark": "serve",
        "figures": figures,
        "details": {
            "bucket": "x".join(map(str, BUCKET)), "num_inference_steps": args.steps, "seconds_per_cell": args.seconds, "rounds": args.rounds,
            "alone_latency_s": round(l1, 4), "latency_target_s": round(target_s, 4),
            "best_fixed_throughput_no_delay": best_fixed, "best_fixed_goodput": best_by_scenario,
            "cells": cells, "denoiser_stats": stats, "load_avg_1m": os.getloadavg()[0],
        },
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--seconds", type=float, default=5.0, help="seconds of load per cell and round")
    parser.add_argument("--rounds", type=int, default=2, help="rounds over every policy (pooled per cell)")
    parser.add_argument("--steps", type=int, default=16, help="denoising steps per request")
    parser.add_argument("--scenarios", nargs="+", default=list(SCENARIOS), choices=SCENARIOS,
                        help="delay scenarios to run (default: all; the figures need all three)")
    args = parser.parse_args()
    result = asyncio.run(measure(args))
    print(json.dumps(result, default=float))


if __name__ == "__main__":
    main()
