"""Diagnostic for figure (g) of issue 6: the `torchrun` DDP peer's own loop inside Ray Train workers against the
peer under `torchrun`, to tell Ray's training environment from vidray's loop.

Run (it starts Ray, so under the machine-wide lock):
    flock /tmp/vidray-ray.lock .venv/bin/python benchmarks/train_env.py [--steps 300] [--warmup 100] [--pairs 2]

One run, the inputs of `benchmarks/train_overhead.py` (its job: tiny EasyAnimate, latents (2, 16, 3, 8, 8) per
rank, 32 text tokens, 2 workers, 1 thread each):
1. The peer `../shared/peers/torchrun_ddp_peer.py`, unchanged, under `torchrun` (`train_overhead.run_peer`).
2. The same loop (probe pass, frozen unused parameters, `DistributedDataParallel`, AdamW, the median step after the
   warmup) as the training function of a `ray.train.torch.TorchTrainer` with 2 workers of 1 CPU on a local Ray
   started by `vidray.runtime.init_ray` (127.0.0.1): Ray's worker processes (nice 15), its gloo process group and
   its thread settings, and nothing of vidray's loop (no Ray Data, no stages, no metrics).
`--pairs` alternations of (peer, Ray), then one more peer run: each Ray run is compared with the mean of the peer
runs before and after it (one peer run's median moves by up to 30 % on this shared 2-core machine).

Each run is also sampled once at its steady state (`benchmarks/_schedstat.py`: 5 s of every thread's scheduling
counters once a rank has used 8 s of CPU): a line per run gives the machine's time slices per second and how often
the ranks' compute threads were preempted and how long they waited for a CPU; `details.sched` has them, with the
processes that woke most.

Figures (the last stdout line, one JSON object): `ray_env_step_ratio`, the median over the pairs of (Ray run's
median step / the mean of its neighbouring peer runs' medians). Measured on the 2-core machine: 1.169 (pairs
1.12 and 1.22); over 12 Ray runs of this loop and 10 peer runs (this script and a first version of it), medians
0.0442-0.0608 s (mean 0.0502) against 0.0417-0.0520 s (mean 0.0467): ~5-8 % on average, from 1.00 to 1.22. With
the sampler (`--pairs 2`: 1.084): 5886-5970 slices/s on the machine under Ray against 1821-2173 for the peer, the
ranks' compute threads preempted 627-691/s against 140-183/s and waiting for a CPU 0.114-0.137 s/s against
0.044-0.070 s/s (docs/performance.md, figure (g)).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))
sys.path.insert(0, str(REPO / "benchmarks"))

import vidray  # noqa: E402,F401  (Ray env defaults before ray is imported)
import train_overhead  # noqa: E402
from _schedstat import SteadyStateSampler  # noqa: E402


def peer_loop_in_worker(config: dict) -> None:
    """The peer's loop (`torchrun_ddp_peer.py`) as a Ray Train worker function; rank 0 reports its median step (s)."""
    import diffusers
    import torch
    import torch.distributed as dist

    rank, world = dist.get_rank(), dist.get_world_size()
    torch.set_num_threads(max(1, (os.cpu_count() or 2) // world))  # as the peer does
    torch.manual_seed(rank)
    cfg = json.load(open(config["transformer_config"]))
    model = getattr(diffusers, cfg["_class_name"]).from_config(cfg)
    b, c, f, h, w = (int(x) for x in config["latents"].split(","))
    text_dim = cfg.get("text_embed_dim") or cfg.get("text_dim") or cfg.get("caption_channels") or 32
    latents = torch.randn(b, c, f, h, w)
    prompt_embeds = torch.randn(b, config["text_len"], text_dim)
    probe = model(hidden_states=latents, timestep=torch.rand(b) * 1000, encoder_hidden_states=prompt_embeds,
                  return_dict=False)[0]
    probe.float().pow(2).mean().backward()
    for _, p in model.named_parameters():
        p.requires_grad_(p.grad is not None)
        p.grad = None
    ddp = torch.nn.parallel.DistributedDataParallel(model)
    opt = torch.optim.AdamW([p for p in ddp.parameters() if p.requires_grad], lr=1e-4)
    times = []
    for step in range(config["warmup"] + config["steps"]):
        t0 = time.perf_counter()
        sigmas = torch.rand(b)
        noise = torch.randn_like(latents)
        s = sigmas.view(b, 1, 1, 1, 1)
        noisy = (1 - s) * latents + s * noise
        pred = ddp(hidden_states=noisy, timestep=sigmas * 1000, encoder_hidden_states=prompt_embeds,
                   return_dict=False)[0]
        loss = torch.nn.functional.mse_loss(pred.float(), (noise - latents).float())
        opt.zero_grad(set_to_none=True)
        loss.backward()
        opt.step()
        if step >= config["warmup"]:
            times.append(time.perf_counter() - t0)
    if rank == 0:  # a file: Ray Train keeps no metrics reported without a checkpoint in `Result.metrics`
        Path(config["out"]).write_text(json.dumps({"median_step_s": statistics.median(times)}))


def run_in_ray(transformer_config: Path, latents: str, text_len: int, steps: int, warmup: int, tmp: Path,
               name: str) -> float:
    """Median step (s) of the peer's loop in a 2-worker TorchTrainer."""
    from ray.train import RunConfig, ScalingConfig
    from ray.train.torch import TorchTrainer

    trainer = TorchTrainer(
        peer_loop_in_worker,
        train_loop_config={"transformer_config": str(transformer_config), "latents": latents, "text_len": text_len,
                           "steps": steps, "warmup": warmup, "out": str(tmp / f"{name}.json")},
        scaling_config=ScalingConfig(num_workers=2, use_gpu=False, resources_per_worker={"CPU": 1}),
        run_config=RunConfig(storage_path=str(tmp / "runs"), name=name),
    )
    trainer.fit()
    return float(json.loads((tmp / f"{name}.json").read_text())["median_step_s"])


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--steps", type=int, default=300, help="timed steps after the warmup (default: %(default)s)")
    ap.add_argument("--warmup", type=int, default=100, help="untimed first steps (default: %(default)s)")
    ap.add_argument("--pairs", type=int, default=2, help="(peer, Ray) alternations (default: %(default)s)")
    a = ap.parse_args()
    import ray

    from vidray.runtime import init_ray

    with tempfile.TemporaryDirectory(prefix="vidray-train-env-") as tmp_dir:
        tmp = Path(tmp_dir)
        job = train_overhead._write_job(tmp, 10, 2)
        config, latents, text_len, threads = train_overhead._peer_inputs(job, tmp)

        sched: dict[str, list] = {"peer": [], "ray": []}

        def sampled(kind: str, pattern: str, run):
            """run() with the machine's scheduling counts sampled at its steady state (`schedstat`)."""
            sampler = SteadyStateSampler(pattern)
            sampler.start()
            try:
                return run()
            finally:
                sampler.stop()
                sched[kind].append(sampler.result)
                if sampler.result:
                    ranks = sampler.result["compute_threads"]
                    print(f"{kind} run: {sampler.result['slices_per_s']} time slices/s on the machine; the ranks' "
                          f"compute threads preempted {[t['nonvoluntary_switches_per_s'] for t in ranks]}/s, "
                          f"waiting for a CPU {[t['runqueue_wait_s_per_s'] for t in ranks]} s/s", flush=True)

        def peer(i: int) -> float:
            return sampled("peer", r"torchrun_ddp_peer\.py", lambda: train_overhead.run_peer(
                config, latents, text_len, threads, 2, a.steps, a.warmup, tmp, start_up=False,
                name=f"peer_{i}")["median_step_s"])

        peers, rays = [peer(0)], []
        for i in range(a.pairs):
            started = init_ray()  # a fresh local Ray per run, as `vidray train` starts one
            try:
                rays.append(sampled("ray", "RayTrainWorker", lambda: run_in_ray(
                    config, latents, text_len, a.steps, a.warmup, tmp, f"ray_{i}")))
            finally:
                if started:
                    ray.shutdown()
            peers.append(peer(i + 1))
            print(f"pair {i}: Ray {rays[-1]:.4f} s, peer before/after {peers[-2]:.4f} / {peers[-1]:.4f} s",
                  flush=True)
    ratios = [r / statistics.mean(peers[i:i + 2]) for i, r in enumerate(rays)]
    print(json.dumps({"benchmark": "train_env", "figures": {
        "ray_env_step_ratio": {"value": round(statistics.median(ratios), 3), "unit": "x", "goal": "<= 1.05"}},
        "details": {"ray_median_step_s": rays, "peer_median_step_s": peers, "ratios": [round(x, 3) for x in ratios],
                    "latents": latents, "text_len": text_len, "threads_per_worker": threads,
                    "steps": a.steps, "warmup": a.warmup, "load_avg_1m": os.getloadavg()[0], "sched": sched}}))


if __name__ == "__main__":
    main()
