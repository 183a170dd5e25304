"""Benchmark of issue 7's stages: training throughput with online VAE / text encoding vs cached latents on the same
clips, per-stage busy fractions, and the tiny job on a simulated cluster of 16 labeled nodes. Measured in one run.

Run (it starts Ray, so under the machine-wide lock):
    flock /tmp/vidray-ray.lock .venv/bin/python benchmarks/stages.py [--steps 12] [--bucket 17x128x128] [--nodes 16]

Set-up: the shipped `samples/` prepared at `--bucket` (default 17x128x128: the VAE's cost grows with the pixels,
while the tiny DiT's stays small) into a temp folder; the tiny job (`jobs/configs/tiny_t2v.yaml`,
`model.text_encoder=minilm`, 2 workers, `data.hot_bytes=0` so that every step reads through the stages).

Figures:
- `online_clips_s`, `cached_clips_s`: clips trained per second (steps/s x global batch) with `data.latent_cache=off`
  (every clip VAE- and text-encoded by the encode actors as it arrives) and from a latent cache filled beforehand
  by `vidray.data.fill_cache.encode_to_cache` (what `vidray prepare --encode` runs), same clips, same steps.
- `cached_over_online`: cached_clips_s / online_clips_s; goal >= 1.0 (cached latents must not be slower).
- `online_data_wait_fraction`, `cached_data_wait_fraction`: the share of the trainers' step time spent waiting for
  the next micro-batch (`vidray.metrics`), rank 0.
- `online_vae_busy_fraction`, `cached_vae_busy_fraction`, `*_decode_busy_fraction`, `*_dit_busy_fraction`: the
  share of rank 0's wall time each stage worked for it (`vidray.metrics.TrainMetrics.summary`: each stage's
  timestamped work, clipped to the log window that received it; at most 1 per stage actor). Figures recorded
  before 2026-12-06 divided the stage seconds by rank 0's step seconds instead, and could exceed 1.
- `sixteen_nodes_placed`: on a `ray.cluster_utils.Cluster` of 16 nodes on this machine (an unlabeled head with no
  CPUs, 3 `vae`, 4 `dit` and 8 `decode` nodes of 1 logical CPU each: 15 on 2 cores), the tiny job with 4 workers
  (1 CPU each), decode operators of 0.5 CPU and vae+text actors of 0.25 + 0.25 CPU placed by label: the share of
  actors (trainers, decode, vae, text) that ran on a node with their stage's label, read from inside each actor;
  goal >= 1.0.

The last stdout line is one JSON object: {"benchmark": "stages", "figures": {...}, "details": {...}}.
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from _figures import miss  # noqa: E402 - benchmarks/ is sys.path[0] when run as a script

STAGE = "vidray.io/stage"


def say(message: str) -> None:
    print(f"[stages-bench] {message}", flush=True)


def job(shards_dir: Path, storage: Path, name: str, steps: int, bucket: list[int], *extra: str):
    from vidray.config import load_job_config

    return load_job_config(REPO / "jobs/configs/tiny_t2v.yaml", [
        f"data.shards_dir={shards_dir}", f"storage.path={storage}", f"name={name}", "model.text_encoder=minilm",
        f"train.max_steps={steps}", f"train.log_every_steps={steps}", f"checkpoint.every_steps={steps}",
        f"data.buckets=[{bucket}]", "data.hot_bytes=0", *extra])


def figures_of(result, job_cfg) -> dict[str, float]:
    global_batch = job_cfg.data.batch_size_per_worker * job_cfg.scaling.num_workers
    # steps/s without the first step (start-up of the actors and DDP)
    seconds = [s[1] + s[3] for s in result.step_seconds[1:]]  # data wait + dit of each step, rank 0
    steps_s = len(seconds) / sum(seconds) if seconds and sum(seconds) > 0 else 0.0
    d = result.data
    return {"clips_s": steps_s * global_batch, "data_wait_fraction": d["data_wait_fraction"],
            **{f"{stage}_busy_fraction": d[f"{stage}_busy_fraction"] for stage in ("decode", "vae", "text", "dit")},
            "latent_hits": d["latent_hits"], "latent_misses": d["latent_misses"]}


def online_vs_cached(args, tmp: Path) -> dict[str, dict[str, float]]:
    import ray

    from vidray.data.fill_cache import encode_to_cache
    from vidray.data.ingest import prepare
    from vidray.runtime import init_ray
    from vidray.train.trainer import run_training

    bucket = [int(x) for x in args.bucket.split("x")]
    shards = tmp / "shards"
    summary = prepare(REPO / "samples" / "metadata.json", shards, buckets=[bucket], fps=8.0, samples_per_shard=8)
    say(f"prepared {summary.num_kept} clips at {bucket}")
    started = init_ray(num_cpus=4)
    try:
        online_job = job(shards, tmp / "runs", "online", args.steps, bucket, "data.latent_cache=off")
        online = figures_of(run_training(online_job), online_job)
        say(f"online: {online}")
        cache = tmp / "latents"
        filled = encode_to_cache(job(shards, tmp / "runs", "fill", args.steps, bucket, f"data.latent_cache={cache}"))
        say(f"filled the cache: {filled['latent_misses']} clips encoded in {filled['seconds']:.1f} s")
        cached_job = job(shards, tmp / "runs", "cached", args.steps, bucket, f"data.latent_cache={cache}")
        cached = figures_of(run_training(cached_job), cached_job)
        say(f"cached: {cached}")
    finally:
        if started:
            ray.shutdown()
    return {"online": online, "cached": cached, "fill_s": filled["seconds"], "fill_clips": filled["clips"]}


def sixteen_nodes(args, tmp: Path) -> dict[str, object]:
    import ray
    from ray.cluster_utils import Cluster

    from vidray.data.ingest import prepare
    from vidray.train.trainer import run_training

    shards = tmp / "shards16"
    prepare(REPO / "samples" / "metadata.json", shards, buckets=[[9, 64, 64], [1, 64, 64]], fps=8.0,
            samples_per_shard=4)
    kinds = ["vae"] * 3 + ["dit"] * 4 + ["decode"] * (args.nodes - 8)
    cluster = Cluster(initialize_head=True, head_node_args={"num_cpus": 0, "node_ip_address": "127.0.0.1"})
    t0 = time.perf_counter()
    try:
        for kind in kinds:
            cluster.add_node(num_cpus=1, node_ip_address="127.0.0.1", labels={STAGE: kind})  # Ray: whole CPUs
        cluster.wait_for_nodes()
        ray.init(address=cluster.address)
        say(f"{len(ray.nodes())} nodes up in {time.perf_counter() - t0:.0f} s")
        from vidray.config import load_job_config

        job16 = load_job_config(REPO / "jobs/configs/tiny_t2v.yaml", [
            f"data.shards_dir={shards}", f"storage.path={tmp / 'runs16'}", "name=sixteen",
            "model.text_encoder=tiny_random", "train.max_steps=4", "train.log_every_steps=2",
            "checkpoint.every_steps=4", "scaling.num_workers=4", "scaling.cpus_per_worker=1",
            "data.loader_cpus=0.5", "placement.vae.num_cpus=0.25", "placement.text.num_cpus=0.25",
            f"placement.dit.label_selector={{{STAGE}: dit}}", f"placement.decode.label_selector={{{STAGE}: decode}}",
            f"placement.vae.label_selector={{{STAGE}: vae}}", f"placement.text.label_selector={{{STAGE}: vae}}"])
        t1 = time.perf_counter()
        result = run_training(job16)
        wall = time.perf_counter() - t1
    finally:
        ray.shutdown()
        cluster.shutdown()
    placed = total = 0
    nodes_used: dict[str, set[str]] = {"trainer": set(), "loaders": set(), "vae": set(), "text": set()}
    want = {"trainer": "dit", "loaders": "decode", "vae": "vae", "text": "vae"}
    for rank in result.placement:
        for role, expected in want.items():
            actors = [rank[role]] if role == "trainer" else rank.get(role, [])
            for actor in actors:
                total += 1
                placed += actor["labels"].get(STAGE) == expected
                nodes_used[role].add(actor["node_id"])
    return {"placed_fraction": placed / total if total else 0.0, "actors": total, "last_step": result.last_step,
            "wall_s": wall, "distinct_nodes": {k: len(v) for k, v in nodes_used.items()}}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--steps", type=int, default=12)
    parser.add_argument("--bucket", default="17x128x128", help="FxHxW of the clips (F = 4k+1, H and W multiples of 16)")
    parser.add_argument("--nodes", type=int, default=16, help="nodes of the simulated cluster (>= 9)")
    args = parser.parse_args()
    from vidray.runtime import apply_ray_env_defaults

    apply_ray_env_defaults()
    with tempfile.TemporaryDirectory(prefix="vidray-stages-") as tmp:
        a = online_vs_cached(args, Path(tmp))
        b = sixteen_nodes(args, Path(tmp))
    on, ca = a["online"], a["cached"]
    figures = {
        "online_clips_s": {"value": round(on["clips_s"], 3), "unit": "clips/s", "goal": "> 0"},
        "cached_clips_s": {"value": round(ca["clips_s"], 3), "unit": "clips/s", "goal": "> 0"},
        "cached_over_online": ({"value": round(ca["clips_s"] / on["clips_s"], 3), "unit": "ratio", "goal": ">= 1.0"}
                               if on["clips_s"] else miss("the online run trained no clip", unit="ratio",
                                                          goal=">= 1.0")),
        "online_data_wait_fraction": {"value": round(on["data_wait_fraction"], 3), "unit": "fraction", "goal": "<= 1"},
        "cached_data_wait_fraction": {"value": round(ca["data_wait_fraction"], 3), "unit": "fraction", "goal": "<= 1"},
        "sixteen_nodes_placed": {"value": round(b["placed_fraction"], 3), "unit": "fraction", "goal": ">= 1.0"},
    }
    for name, run in (("online", on), ("cached", ca)):
        for stage in ("decode", "vae", "text", "dit"):
            figures[f"{name}_{stage}_busy_fraction"] = {"value": round(run[f"{stage}_busy_fraction"], 3),
                                                        "unit": "fraction", "goal": ">= 0"}
    details = {"bucket": args.bucket, "steps": args.steps, "fill_s": round(a["fill_s"], 2),
               "fill_clips": a["fill_clips"], "online": on, "cached": ca, "sixteen_nodes": b}
    print(json.dumps({"benchmark": "stages", "figures": figures, "details": details}))


if __name__ == "__main__":
    main()
