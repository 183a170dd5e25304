"""`vidray doctor --measure`'s all-reduce bus bandwidth against torch's own `all_reduce` timed in a plain script
under `torchrun`: does the doctor, with its workers as Ray actors in the job's placement, report what the hardware
gives?

Run (it starts Ray, so under the machine-wide lock):
    flock /tmp/vidray-ray.lock .venv/bin/python benchmarks/doctor.py [--sizes-mib 1,4,16,64] [--pairs 2]

1. doctor: a local Ray started as `vidray train` starts it (`vidray.runtime.init_ray`), the tiny job's 2 workers of
   1 CPU (`vidray.doctor_measure.WorkerGroup`: a placement group, a gloo process group) and the doctor's sweep
   (`time_allreduce`: warm-up, a barrier, as many timed all-reduces as fit 0.5 s, 3-20), then Ray shut down.
2. torchrun: this file with `--peer` under `torchrun --standalone --nproc_per_node 2` (no Ray running): its own loop,
   nccl-tests' defaults (5 warm-up, a barrier, 20 timed all-reduces of float32 zeros, the per-all-reduce time
   averaged over the ranks), busbw = size / t x 2(n-1)/n.
Runs alternate (doctor, torchrun, doctor, torchrun, ...: `--pairs`), on the same sizes.

Figure (the last stdout line, one JSON object): `busbw_ratio_vs_torchrun`, the median over sizes of (the doctor's
mean busbw / torchrun's mean busbw), goal >= 0.9. `details` has every run's busbw per size, each pair's median
ratio, and the spread (min and max of the pairs' ratios).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

MIB = 2**20
PEER_PREFIX = "PEER "
GOAL = ">= 0.9"


def peer(sizes: list[int], warmup: int = 5, iters: int = 20) -> None:
    """Under torchrun: time a float32 all-reduce (sum) of each size; rank 0 prints `PEER {size: busbw}`."""
    import torch
    import torch.distributed as dist

    dist.init_process_group("gloo")
    n = dist.get_world_size()
    out = {}
    for size in sizes:
        buf = torch.zeros(size // 4, dtype=torch.float32)
        for _ in range(warmup):
            dist.all_reduce(buf)
        dist.barrier()
        start = time.perf_counter()
        for _ in range(iters):
            dist.all_reduce(buf)
        t = torch.tensor([(time.perf_counter() - start) / iters], dtype=torch.float64)
        dist.all_reduce(t)
        seconds = float(t) / n
        out[str(size)] = size / seconds * 2 * (n - 1) / n
    if dist.get_rank() == 0:
        print(PEER_PREFIX + json.dumps(out), flush=True)
    dist.destroy_process_group()


def run_torchrun(sizes: list[int]) -> dict[int, float]:
    """{size: busbw (bytes/s)} of one `torchrun --standalone --nproc_per_node 2` run of `peer`."""
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2", __file__, "--peer",
           "--sizes-mib", ",".join(str(s // MIB) for s in sizes)]
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    done = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=600)
    lines = [line for line in done.stdout.splitlines() if line.startswith(PEER_PREFIX)]
    if done.returncode != 0 or not lines:
        raise RuntimeError(f"torchrun failed (exit {done.returncode}): {done.stderr[-2000:]}")
    return {int(k): v for k, v in json.loads(lines[-1][len(PEER_PREFIX):]).items()}


def run_doctor(sizes: list[int]) -> dict[int, float]:
    """{size: busbw (bytes/s)} of the doctor's sweep with the tiny job's 2 workers on a fresh local Ray."""
    import ray

    from vidray.config import load_job_config
    from vidray.doctor_measure import WorkerGroup
    from vidray.runtime import init_ray

    job = load_job_config(REPO / "jobs/configs/tiny_t2v.yaml", ["scaling.num_workers=2", "scaling.use_gpu=false"])
    started = init_ray(log_to_driver=False)
    try:
        group = WorkerGroup(job, None)
        try:
            return {r["bytes"]: r["busbw"] for r in group.sweep(sizes)}
        finally:
            group.close()
    finally:
        if started:
            ray.shutdown()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--sizes-mib", default="1,4,16,64", help="message sizes, MiB (default: %(default)s)")
    ap.add_argument("--pairs", type=int, default=2, help="(doctor, torchrun) alternations (default: %(default)s)")
    ap.add_argument("--peer", action="store_true", help=argparse.SUPPRESS)
    a = ap.parse_args()
    sizes = [int(float(s) * MIB) for s in a.sizes_mib.split(",")]
    if a.peer:
        peer(sizes)
        return
    import vidray  # noqa: F401  (Ray env defaults before ray is imported)

    doctor_runs, torch_runs = [], []
    for i in range(a.pairs):
        doctor_runs.append(run_doctor(sizes))
        torch_runs.append(run_torchrun(sizes))
        pair = statistics.median(doctor_runs[-1][s] / torch_runs[-1][s] for s in sizes)
        print(f"pair {i}: " + ", ".join(f"{s // MIB} MiB doctor {doctor_runs[-1][s] / 1e9:.2f} / torchrun "
                                        f"{torch_runs[-1][s] / 1e9:.2f} GB/s" for s in sizes)
              + f"; median ratio {pair:.3f}", flush=True)
    per_size = {}
    for s in sizes:
        d, t = [r[s] for r in doctor_runs], [r[s] for r in torch_runs]
        per_size[f"{s // MIB} MiB"] = {
            "doctor_busbw_gbps": [round(x / 1e9, 3) for x in d], "torchrun_busbw_gbps": [round(x / 1e9, 3) for x in t],
            "ratio": round(statistics.mean(d) / statistics.mean(t), 3)}
    value = statistics.median(v["ratio"] for v in per_size.values())
    pairs = [round(statistics.median(d[s] / t[s] for s in sizes), 3) for d, t in zip(doctor_runs, torch_runs)]
    print(json.dumps({"benchmark": "doctor", "figures": {
        "busbw_ratio_vs_torchrun": {"value": round(value, 3), "unit": "x", "goal": GOAL}},
        "details": {"sizes": per_size, "pair_median_ratios": pairs, "spread": [min(pairs), max(pairs)],
                    "order": "doctor, torchrun, doctor, torchrun, ...", "workers": 2, "backend": "gloo",
                    "load_avg_1m": round(os.getloadavg()[0], 2)}}))


if __name__ == "__main__":
    main()
