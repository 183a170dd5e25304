"""Benchmark (g) of issue 6: Ray Train step time and start-up of `vidray train` against a plain `torchrun` DDP loop.

Run (it starts Ray, so under the machine-wide lock):
    flock /tmp/vidray-ray.lock .venv/bin/python benchmarks/train_overhead.py [--steps 300] [--warmup 100]

One run, on the same transformer, latent shape, batch, text length, thread count and worker count:
1. `vidray prepare --encode` of the clips in `samples/` into a temp dir, with the one bucket 9x64x64 (a single
   latent shape, so that every vidray step has the peer's shape; the still image is skipped as too short for it),
   which also fills the latent cache: like the peer, which trains on latents it holds, vidray trains on cached
   latents from its first step.
2. The peer `../shared/peers/torchrun_ddp_peer.py`, unchanged, under `torchrun --standalone --nproc_per_node W`
   with `OMP_NUM_THREADS = scaling.cpus_per_worker` (what Ray gives each worker; the peer itself calls
   `torch.set_num_threads(cpu_count // W)`: the same 1 thread on a 2-core machine, more on larger ones), the
   transformer config vidray builds (`vidray.models.registry`, tiny EasyAnimate preset; its `config.json` written
   to the temp dir), the per-rank latent shape of the bucket (`family.latent_shape(bucket,
   data.batch_size_per_worker)`) and text length `model.max_sequence_length`:
   - step time: the median it prints over `--steps` steps after `--warmup` (both runs get the same warmup: a
     steady-state figure; the median DiT step of vidray's steps 2..warmup is in the details, `warmup_dit_step_s`:
     for the first ~3 s after step 1 vidray's steps are ~2x slower, while each rank's encode stage actor, just
     started, works through the first blocks of its window beside the trainers on the 2 cores).
     The peer's steady-state run is repeated after vidray's, and the mean of its two medians is the reference
     (`step_time_ratio_vs_faster_peer_run` compares with the faster one): on this shared 2-core machine one peer
     run's median moves by up to 30 % (0.042-0.056 s seen);
   - start-up: a second run with `--steps 1 --warmup 0`, timed from process launch to its exit. That includes
     the first step (vidray's figure below includes it too) and the peer's teardown (a few tenths of a second:
     the figure slightly overstates the peer's start-up, never vidray's advantage).
3. `vidray train` (the CLI, a subprocess) with W workers, no checkpoint before the end and no gradient clipping
   (`train.grad_clip_norm: null`: the peer does not clip; clipping costs ~1.7 ms per step here), twice:
   - start-up: a run of 1 step, timed from launch to its `step 1/` log line (printed by rank 0 after step 1; it
     reaches the driver through Ray's log monitor, which adds up to ~0.1 s);
   - step time: `--warmup` + `--steps` steps with the default `train.log_every_steps` 10 (each report is a Ray
     Train barrier, a host sync and a metrics write: what a user's run pays). Each log line gives its window's
     mean step split into data wait, VAE/text encode and the DiT step (forward, backward, optimizer, lr
     schedule: what the peer's step does on the latents it holds); `step_time_ratio` is the median over the
     windows after the warmup of the DiT step, over the peer's median. The whole step (`step_time`: the window's
     wall time per step, encode, data wait and the window's logging included, `ray.train.report` excluded) is
     reported beside it (`whole_step_time_ratio`); with a loop that logs no split, `step_time_ratio` compares
     the whole step.
Each output line of both runs is time-stamped on arrival; known log lines give a phase breakdown of the start-up.
`start_to_first_step_ratio` is vidray's start-up over the peer's (goal <= 2.0: issue 43, part 3).

Ray starts on 127.0.0.1 (`RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER=0`) and the CLI stops it when it exits. The figures
move with the machine's load (2 cores shared with anything else running): `details.load_avg_1m` records it.
The last stdout line is one JSON object: {"benchmark": "train_overhead", "figures": {name: {value, unit, goal}}}.
`measure(tmp_dir)` returns the same dict (for `benchmarks/data_pipeline.py`); it does not take the Ray lock.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

from _figures import miss  # benchmarks/ is on sys.path: run as a script, or imported by data_pipeline.py

REPO = Path(__file__).resolve().parents[1]
VENV_BIN = Path(sys.executable).parent
"""The environment running this script (its torchrun and vidray): the repo's .venv under `make`, or any other."""
PEER = REPO.parent / "shared" / "peers" / "torchrun_ddp_peer.py"
BUCKET = [9, 64, 64]
"""[num_frames, height, width] of every sample in the benchmark run."""

# Lines (regex on the text) that mark the phases of `vidray train`'s start-up, in order.
VIDRAY_PHASES = [
    ("checks_done", re.compile(r"\[vidray\] captions:")),
    ("ray_started", re.compile(r"Started a local Ray instance")),
    ("controller_started", re.compile(r"Requesting resources")),
    ("process_group_set_up", re.compile(r"Setting up process group")),
    ("workers_started", re.compile(r"Started training worker group")),
    ("data_encoded", re.compile(r"\[vidray\] encoded \d+ samples")),  # loops that encode the dataset up front
    ("loop_started", re.compile(r"\[vidray\] training steps")),
    ("first_step", re.compile(r"\[vidray\] step 1/")),
]
STEP_LINE = re.compile(r"\[vidray\] step (\d+)/\d+ .*?step_time ([0-9.]+) s")
SPLIT = re.compile(r"\(encode ([0-9.]+) s, dit ([0-9.]+) s\)")
DATA_WAIT = re.compile(r"data_wait ([0-9.]+) s")
PEER_LINE = re.compile(r"median_step_s=([0-9.]+) p90_step_s=([0-9.]+)")


def _timed_run(cmd: list[str], env: dict[str, str], log_path: Path, timeout_s: float,
               cwd: Path = REPO) -> tuple[float, list[tuple[float, str]], int]:
    """Run `cmd`, time-stamping each line of its merged stdout/stderr on arrival (seconds since launch).

    Returns (wall seconds to exit, [(t, line)], exit code); the lines are also written to `log_path`.
    Raises RuntimeError naming the command and the log when it runs past `timeout_s` (it is killed then).
    """
    lines: list[tuple[float, str]] = []
    t0 = time.perf_counter()
    proc = subprocess.Popen(cmd, env=env, cwd=cwd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            bufsize=1)
    watchdog = threading.Timer(timeout_s, proc.kill)
    watchdog.start()
    try:
        with open(log_path, "w") as log:
            for line in proc.stdout or ():
                t = time.perf_counter() - t0
                lines.append((t, line.rstrip("\n")))
                log.write(f"{t:8.3f} {line}")
        code = proc.wait()
    finally:
        watchdog.cancel()
    wall = time.perf_counter() - t0
    if wall >= timeout_s:
        raise RuntimeError(f"{' '.join(cmd[:3])} ... ran past {timeout_s} s and was killed; see {log_path}")
    return wall, lines, code


def _env(**extra: str) -> dict[str, str]:
    env = dict(os.environ)
    env.update({"RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER": "0", "PYTHONUNBUFFERED": "1", **extra})
    return env


def _write_job(tmp: Path, steps: int, num_workers: int, *, log_every_steps: int = 10,
               name: str = "job.yaml") -> Path:
    job = {
        "name": "train-overhead",
        "model": {"family": "easyanimate", "preset": "tiny", "init": "random", "text_encoder": "minilm",
                  "max_sequence_length": 32},
        "data": {"source": str(REPO / "samples" / "metadata.json"), "shards_dir": str(tmp / "shards"),
                 "buckets": [BUCKET], "fps": 8.0, "batch_size_per_worker": 2, "cache_dir": str(tmp / "cache")},
        "optim": {"lr": 1.0e-3, "warmup_steps": 10},
        "train": {"max_steps": steps, "grad_clip_norm": None, "log_every_steps": log_every_steps,
                  "seed": 0},
        "checkpoint": {"every_steps": 100000, "num_to_keep": 1},
        "scaling": {"num_workers": num_workers, "use_gpu": False, "cpus_per_worker": 1},
        "storage": {"path": str(tmp / "runs" / Path(name).stem)},
    }
    path = tmp / name
    path.write_text(json.dumps(job, indent=1))  # JSON is YAML
    return path


def _peer_inputs(job_path: Path, tmp: Path) -> tuple[Path, str, int, int]:
    """(transformer config.json, per-rank latent shape "B,C,F,H,W", text length, threads per worker) of the job."""
    sys.path.insert(0, str(REPO))
    from vidray.config import load_job_config
    from vidray.buckets import Bucket
    from vidray.models.registry import get_family

    job = load_job_config(job_path)
    family = get_family(job.model.family)
    components = family.build(job.model, seed=job.train.seed)
    config_dir = tmp / "transformer"
    components.transformer.save_config(config_dir)  # config.json with _class_name
    shape = family.latent_shape(Bucket(*BUCKET), job.data.batch_size_per_worker)
    return config_dir / "config.json", ",".join(map(str, shape)), job.model.max_sequence_length, \
        max(1, int(job.scaling.cpus_per_worker))


def run_peer(config: Path, latents: str, text_len: int, threads: int, num_workers: int, steps: int, warmup: int,
             tmp: Path, *, start_up: bool = True, name: str = "peer") -> dict:
    """Peer median step time (s) and, with `start_up`, start-to-first-step (s): see the module docstring."""
    base = [str(VENV_BIN / "torchrun"), "--standalone", "--nproc_per_node", str(num_workers), str(PEER),
            "--config", str(config), "--latents", latents, "--text-len", str(text_len)]
    env = _env(OMP_NUM_THREADS=str(threads))
    start_wall = None
    if start_up:
        start_wall, _, code = _timed_run(base + ["--steps", "1", "--warmup", "0"], env, tmp / "peer_start.log", 300)
        if code != 0:
            raise RuntimeError(f"the peer's start-up run failed (exit {code}); see {tmp / 'peer_start.log'}")
    log = tmp / f"{name}.log"
    wall, lines, code = _timed_run(base + ["--steps", str(steps), "--warmup", str(warmup)], env, log, 600)
    found = [PEER_LINE.search(text) for _, text in lines]
    found = [m for m in found if m]
    if code != 0 or not found:
        raise RuntimeError(f"the peer run failed (exit {code}) or printed no median; see {log}")
    return {"median_step_s": float(found[-1].group(1)), "p90_step_s": float(found[-1].group(2)),
            "start_to_first_step_s": start_wall, "wall_s": wall}


def run_vidray(job_path: Path, warmup: int, tmp: Path, log_name: str = "vidray.log", *, verbose: bool = False) -> dict:
    """`vidray train` of `job_path`: start-up phases (s since launch; `start_to_first_step_s` when the run logs its
    step 1), the logged step times (s: one per `train.log_every_steps` window, each the window's mean) and their
    median over the windows after step `warmup` (None when there are none). Raises RuntimeError naming the log
    when the run fails or logs no step."""
    cmd = [str(VENV_BIN / "vidray"), "train", str(job_path)]
    log = tmp / log_name
    # verbose: Ray's own start-up lines (controller, worker group, process group) reach the log, so that every
    # phase of VIDRAY_PHASES is found; they are a few lines, not a cost.
    wall, lines, code = _timed_run(cmd, _env(**({"VIDRAY_VERBOSE": "1"} if verbose else {})), log, 900)
    if code != 0:
        raise RuntimeError(f"vidray train failed (exit {code}); see {log}")
    phases: dict[str, float] = {}
    step_times: dict[int, float] = {}
    dit_times: dict[int, float] = {}
    encode_times: dict[int, float] = {}
    wait_times: dict[int, float] = {}
    for t, text in lines:
        for name, pattern in VIDRAY_PHASES:
            if name not in phases and pattern.search(text):
                phases[name] = round(t, 2)
        m = STEP_LINE.search(text)
        if m:
            step_times[int(m.group(1))] = float(m.group(2))
            step = int(m.group(1))
            split = SPLIT.search(text)
            if split:
                encode_times[step], dit_times[step] = float(split.group(1)), float(split.group(2))
            wait = DATA_WAIT.search(text)
            if wait:
                wait_times[step] = float(wait.group(1))
    if not step_times:
        raise RuntimeError(f"no `step N/` line in vidray's output; see {log}")
    early = [s for i, s in sorted(dit_times.items()) if 1 < i <= warmup]

    def median_after_warmup(times: dict[int, float]) -> float | None:
        kept = [s for i, s in sorted(times.items()) if i > warmup]
        return statistics.median(kept) if kept else None

    timed = [s for i, s in sorted(step_times.items()) if i > warmup]
    return {"phases_s": phases, "start_to_first_step_s": phases.get("first_step"), "wall_s": wall,
            "median_step_s": statistics.median(timed) if timed else None,
            "p90_step_s": sorted(timed)[int(0.9 * len(timed))] if timed else None,
            "median_dit_step_s": median_after_warmup(dit_times),
            "median_encode_s": median_after_warmup(encode_times),
            "median_data_wait_s": median_after_warmup(wait_times), "windows_timed": len(timed),
            "warmup_dit_step_s": statistics.median(early) if early else None}


def measure(tmp_dir: str | Path, *, steps: int = 300, warmup: int = 100, num_workers: int = 2) -> dict:
    """Run the peer and `vidray train` (see the module docstring); returns the benchmark's JSON object.

    tmp_dir: an empty, writable folder for shards, runs and logs (`peer*.log`, `vidray.log` stay there).
    Raises RuntimeError naming the log of a run that failed.
    """
    tmp = Path(tmp_dir)
    tmp.mkdir(parents=True, exist_ok=True)
    job_path = _write_job(tmp, steps + warmup, num_workers)  # train.log_every_steps 10, the default
    start_job = _write_job(tmp, 1, num_workers, log_every_steps=1, name="job_start.yaml")
    prep = subprocess.run([str(VENV_BIN / "vidray"), "prepare", str(job_path), "--encode"], cwd=REPO, env=_env(),
                          capture_output=True, text=True)
    if prep.returncode != 0:
        raise RuntimeError(f"vidray prepare failed (exit {prep.returncode}): {prep.stderr[-2000:]}")
    config, latents, text_len, threads = _peer_inputs(job_path, tmp)
    peer = run_peer(config, latents, text_len, threads, num_workers, steps, warmup, tmp)
    vidray_start = run_vidray(start_job, 0, tmp, "vidray_start.log", verbose=True)
    if vidray_start["start_to_first_step_s"] is None:
        raise RuntimeError(f"no `step 1/` line in vidray's start-up run; see {tmp / 'vidray_start.log'}")
    vidray = run_vidray(job_path, warmup, tmp)
    if vidray["median_step_s"] is None:
        raise RuntimeError(f"vidray logged no step after the {warmup} warmup steps; see {tmp / 'vidray.log'}")
    # The peer's median moves by up to 30 % between runs on this shared 2-core machine: it runs again after
    # vidray, and the mean of its two medians is the reference (as figure (a) of benchmarks/data_pipeline.py
    # does with its peer); the ratio against the faster of the two is reported beside it.
    peer_after = run_peer(config, latents, text_len, threads, num_workers, steps, warmup, tmp, start_up=False,
                          name="peer_after")
    peer_medians = [peer["median_step_s"], peer_after["median_step_s"]]
    peer = {**peer, "median_step_s": statistics.mean(peer_medians)}
    # Like for like: the peer's step is forward + backward + optimizer on latents it already holds. vidray logs
    # its step split (data wait, VAE/text encode, DiT step); the DiT part is what the peer's step does. Without
    # the split (an older loop), the whole logged step_time is compared.
    dit = vidray["median_dit_step_s"]
    compared = dit if dit is not None else vidray["median_step_s"]
    figures = {
        "step_time_ratio": {"value": round(compared / peer["median_step_s"], 3), "unit": "x", "goal": "<= 1.05"},
        "step_time_ratio_vs_faster_peer_run": {"value": round(compared / min(peer_medians), 3), "unit": "x"},
        # Issue 43, part 3: `vidray train`'s launch to its first step within 2x of the peer's (the same run).
        "start_to_first_step_ratio": {"value": round(vidray_start["start_to_first_step_s"]
                                                     / peer["start_to_first_step_s"], 2), "unit": "x", "goal": "<= 2.0"},
        "start_to_first_step_s": {"value": round(vidray_start["start_to_first_step_s"], 2), "unit": "s"},
        "peer_start_to_first_step_s": {"value": round(peer["start_to_first_step_s"], 2), "unit": "s"},
        "vidray_dit_step_s": ({"value": round(dit, 4), "unit": "s"} if dit is not None else
                              miss("vidray's step lines carry no (encode, dit) split", unit="s")),
        "peer_step_s": {"value": round(peer["median_step_s"], 4), "unit": "s"},
        "vidray_whole_step_s": {"value": round(vidray["median_step_s"], 4), "unit": "s"},
        "whole_step_time_ratio": {"value": round(vidray["median_step_s"] / peer["median_step_s"], 3), "unit": "x"},
    }
    for name in ("encode", "data_wait"):
        value = vidray[f"median_{name}_s"]
        figures[f"vidray_{name}_s"] = ({"value": round(value, 4), "unit": "s"} if value is not None else
                                       miss(f"vidray's step lines carry no {name} time", unit="s"))
    return {"benchmark": "train_overhead", "figures": figures,
            "details": {"latents": latents, "text_len": text_len, "threads_per_worker": threads,
                        "num_workers": num_workers, "steps": steps, "warmup": warmup,
                        "compared": "dit step" if dit is not None else "whole step_time",
                        "vidray_phases_s": vidray_start["phases_s"], "vidray_p90_step_s": vidray["p90_step_s"],
                        "warmup_dit_step_s": vidray["warmup_dit_step_s"],
                        "peer_p90_step_s": peer["p90_step_s"], "peer_median_step_s_before_after": peer_medians,
                        "load_avg_1m": os.getloadavg()[0]}}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--steps", type=int, default=300, help="timed steps after the warmup (default: %(default)s)")
    ap.add_argument("--warmup", type=int, default=100, help="untimed first steps (default: %(default)s)")
    ap.add_argument("--workers", type=int, default=2, help="DDP workers of both runs (default: %(default)s)")
    ap.add_argument("--keep", help="folder for shards, runs and logs (default: a temp dir, deleted)")
    a = ap.parse_args()
    if a.keep:
        result = measure(a.keep, steps=a.steps, warmup=a.warmup, num_workers=a.workers)
    else:
        with tempfile.TemporaryDirectory(prefix="vidray-train-overhead-") as tmp:
            result = measure(tmp, steps=a.steps, warmup=a.warmup, num_workers=a.workers)
    d = result["details"]
    print(f"vidray start-up phases (s since launch): {d['vidray_phases_s']}", flush=True)
    print(json.dumps(result))


if __name__ == "__main__":
    main()
