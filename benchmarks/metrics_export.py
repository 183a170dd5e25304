"""Benchmark of issue 31: the cost of recording the training series through Ray's metrics agent.

Run (it starts Ray, so under the machine-wide lock):
    flock /tmp/vidray-ray.lock .venv/bin/python benchmarks/metrics_export.py [--steps 150] [--warmup 50] [--pairs 2]

`vidray train` of `benchmarks/train_overhead.py`'s job (tiny EasyAnimate, 2 workers, cached latents of one 9x64x64
bucket, `train.log_every_steps` 10) with `train.ray_metrics: true` (every series also recorded with
`ray.util.metrics`: ~15 records per step and rank) and `false` (the run folder's `.prom` files only), interleaved
on, off, on, off, ... (`--pairs` pairs). Each run's figure is the median over its log windows after `--warmup`
steps of the whole step time (`step_time` of the step line: the window's wall time per step, data wait, encode,
the metrics and the log included). `ray_metrics_step_time_ratio` is the median of the "on" runs over the median of
the "off" runs; `details` has every run's median and the spread (max / min over the runs of one setting), which on
this shared 2-core machine is larger than the 2 % goal: the figure needs spare cores to resolve that goal.

The 1 ms resolution of the step line is 2 % of a step here, so `record_overhead_ratio` measures the cost itself:
in a Ray worker of a local cluster (connected to its metrics agent), the recording calls of one training step
(`_one_step`: what `vidray.train.loop` records for a step of 2 micro-batches and a log window) timed over 2000
steps with and without `export_to_ray`; the ratio is (the "off" runs' median step + the extra seconds per step) /
that step.

The last stdout line is one JSON object: {"benchmark": "metrics_export", "figures": {name: {value, unit, goal}}}.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from train_overhead import REPO, VENV_BIN, _env, _write_job, run_vidray  # noqa: E402


def _variant(job_path: Path, ray_metrics: bool) -> Path:
    """A copy of the job file with `train.ray_metrics` set and its own storage folder."""
    job = json.loads(job_path.read_text())
    tag = "on" if ray_metrics else "off"
    job["train"]["ray_metrics"] = ray_metrics
    job["storage"]["path"] = str(Path(job["storage"]["path"]).with_name(f"runs-{tag}"))
    out = job_path.with_name(f"job_{tag}.yaml")
    out.write_text(json.dumps(job, indent=1))
    return out


def _one_step(metrics, step: int) -> None:
    """The `TrainMetrics` calls of one step of `vidray.train.loop` (2 micro-batches, a log window every step)."""
    for _ in range(2):
        metrics.add_cache("hot", hits=2, misses=0)
        metrics.add_cache("warm", hits=0, misses=0)
        metrics.add_bytes_fetched(0)
        metrics.set_prefetch_lead(3)
        metrics.add_stage("decode", busy_s=0.001, clips=0)
        for tier, stage in (("latent", "vae"), ("prompt", "text")):
            metrics.add_cache(tier, hits=2, misses=0)
            metrics.add_stage(stage, busy_s=0.0005, clips=2)
    metrics.observe_step(data_wait_s=0.0001, step_s=0.05, samples=4)
    metrics.add_stage("dit", busy_s=0.05, clips=4)
    metrics.set_step(step)
    metrics.observe_window(loss=0.5, lr=1e-3, data_wait_fraction=0.01)


def record_seconds_per_step(steps: int = 2000) -> dict[str, float]:
    """{"on": s, "off": s} per step of `_one_step`'s calls in a Ray worker, with and without `export_to_ray`."""
    from vidray.runtime import init_ray  # before ray: its loopback-only setting

    import ray
    from ray import cloudpickle

    cloudpickle.register_pickle_by_value(sys.modules[__name__])  # the workers cannot import benchmarks/

    @ray.remote(num_cpus=1)
    def timed(export: bool) -> float:
        import time

        from vidray.metrics import TrainMetrics

        metrics = TrainMetrics(rank=0, run="bench", export_to_ray=export)
        _one_step(metrics, 0)  # first-use costs out of the timing
        t0 = time.perf_counter()
        for step in range(1, steps + 1):
            _one_step(metrics, step)
        return (time.perf_counter() - t0) / steps

    started = init_ray()
    try:
        runs = {k: [ray.get(timed.remote(k == "on")) for _ in range(3)] for k in ("on", "off")}
    finally:
        if started:
            ray.shutdown()
    return {k: statistics.median(v) for k, v in runs.items()}


def measure(tmp_dir: str | Path, *, steps: int = 150, warmup: int = 50, pairs: int = 2) -> dict:
    """Run the interleaved pairs (see the module docstring) in `tmp_dir`; returns the benchmark's JSON object.
    Raises RuntimeError naming the log of a run that failed."""
    tmp = Path(tmp_dir)
    tmp.mkdir(parents=True, exist_ok=True)
    job_path = _write_job(tmp, steps + warmup, 2)
    prep = subprocess.run([str(VENV_BIN / "vidray"), "prepare", str(job_path), "--encode"], cwd=REPO, env=_env(),
                          capture_output=True, text=True)
    if prep.returncode != 0:
        raise RuntimeError(f"vidray prepare failed (exit {prep.returncode}): {prep.stderr[-2000:]}")
    jobs = {True: _variant(job_path, True), False: _variant(job_path, False)}
    medians: dict[bool, list[float]] = {True: [], False: []}
    for i in range(pairs):
        for on in (True, False):
            # Each run its own storage: a second run of one name would resume the first.
            job = json.loads(jobs[on].read_text())
            job["name"] = f"metrics-{'on' if on else 'off'}-{i}"
            jobs[on].write_text(json.dumps(job, indent=1))
            log_name = f"vidray_{job['name']}.log"
            run = run_vidray(jobs[on], warmup, tmp, log_name)
            if run["median_step_s"] is None:
                raise RuntimeError(f"no step after the warmup in {tmp / log_name}")
            medians[on].append(run["median_step_s"])
            print(f"{job['name']}: median whole step {run['median_step_s']:.4f} s", flush=True)
    on, off = statistics.median(medians[True]), statistics.median(medians[False])
    record = record_seconds_per_step()
    extra = max(0.0, record["on"] - record["off"])
    spread = {("on" if k else "off"): round(max(v) / min(v), 3) for k, v in medians.items()}
    return {"benchmark": "metrics_export", "figures": {
        "ray_metrics_step_time_ratio": {"value": round(on / off, 3), "unit": "x", "goal": "<= 1.02"},
        "record_overhead_ratio": {"value": round((off + extra) / off, 4), "unit": "x", "goal": "<= 1.02"},
        "ray_record_us_per_step": {"value": round(extra * 1e6, 1), "unit": "us"},
        "step_s_with_ray_metrics": {"value": round(on, 4), "unit": "s"},
        "step_s_without_ray_metrics": {"value": round(off, 4), "unit": "s"},
    }, "details": {"medians_s": {"on": medians[True], "off": medians[False]}, "spread_max_over_min": spread,
                   "record_s_per_step": record,
                   "steps": steps, "warmup": warmup, "pairs": pairs, "load_avg_1m": os.getloadavg()[0]}}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--steps", type=int, default=150, help="timed steps after the warmup (default: %(default)s)")
    ap.add_argument("--warmup", type=int, default=50, help="untimed first steps (default: %(default)s)")
    ap.add_argument("--pairs", type=int, default=2, help="(on, off) pairs of runs (default: %(default)s)")
    a = ap.parse_args()
    with tempfile.TemporaryDirectory(prefix="vidray-metrics-export-") as tmp:
        result = measure(tmp, steps=a.steps, warmup=a.warmup, pairs=a.pairs)
    print(json.dumps(result))


if __name__ == "__main__":
    main()
