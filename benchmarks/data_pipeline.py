"""Benchmark of issue 6's data plane: figures (a)-(g), measured in one run on the same clips.

Run (it starts Ray, so under the machine-wide lock):
    flock /tmp/vidray-ray.lock .venv/bin/python benchmarks/data_pipeline.py [--clips 160] [--skip-train-overhead]

The clips: `vidray prepare` of the shipped `samples/` at one bucket, 17x256x256 at 16 frames/s (no scene split; the
five videos and GIFs are kept, the still image is not), replicated with new unique `sample_id`s to `--clips`
samples (default 160) by vidray's own writer (`ShardWriter`: shards of 8 clips, sample table, index), once into a
local folder and once, byte for byte the same, into moto's S3 server on 127.0.0.1. Every loader below is the
per-rank Ray Data loader (`vidray.data.pipeline.RankLoader`) planned by the schedule (`plan_rank_steps`, seed 0,
micro-batches of 4 clips, `shuffle_block_shards` 4), in a driver with Ray started by
`vidray.runtime.init_ray(num_cpus=4)`, Ray Data's CPU budget `data.loader_cpus` 0.5. Rates "after the first batch"
leave out Ray's fixed start-up (loader actor, first fetch and decode), reported separately.

(a) delivered clips/s of a 1-rank loader over the local folder, hot tier off (`hot_bytes=0`: every clip decoded),
    2 epochs, steady state after the first batch, divided by the plain single-process PyAV loop
    (`../shared/peers/pyav_decode_limit.py --rgb`, its default threads, best of 2 passes, run before and after the
    loader: the mean of the two) over the same clip bytes (the shards' `video_mp4` cells written out as .mp4
    files); goal >= 0.9.
(b) the trainer's data-wait fraction, sum of `TrainBatch.data_wait_s` / wall time of the consume loop after the
    first batch (which waits for Ray's start-up and the first fetch; reported too), with a trainer step of
    `STEP_S` (sleep) and the S3 store behind a user-space proxy
    (`benchmarks/_throttle.py`) limited to `THROTTLE_FACTOR` x the bytes/s the trainer consumes; prefetch on
    (`prefetch_batches=4, prefetch_window_batches=16`) vs off (0, 0); each run with a fresh warm cache (cold
    start); goal <= 0.05 with prefetch.
(c) one loader on S3 (fresh warm cache, hot tier large enough for the dataset), 2 epochs at full speed: epoch 2
    (warm/hot) clips/s divided by epoch 1 (cold) clips/s, each after its first batch; goal >= 3.
(d) 2 ranks' loaders (world size 2) sharing one warm cache folder with a budget of `CACHE_SHARDS` shards, on S3,
    one epoch consumed in lockstep: shard downloads (`warm_misses`, both ranks) divided by the number of shards;
    goal <= 1.05. Cross-check in the details: the bytes the store sent (through the proxy, unthrottled) divided by
    the dataset's bytes (`warm_misses` also counts a shard that another process was downloading as a miss).
(e) `benchmarks/schedule.py` (a subprocess, one thread): seconds and peak memory to plan one epoch of 26.6 M
    samples over 512 ranks; goals < 10 s, < 4 GB.
(f) `vidray.train.trainer.run_training` of the tiny model (`model.text_encoder=tiny_random`, 1 worker, 4 steps)
    on the shipped clips prepared at the tiny job's buckets (9x64x64, 1x64x64: 6 samples) and on the same
    replicated to 600 samples: rank 0's peak RSS (`TrainResult.peak_rss_bytes`), ratio 600 / 6; goal <= 1.10.
(g) `benchmarks/train_overhead.py`'s `measure` (its own `vidray train` and `torchrun` runs, after this driver's
    Ray is shut down; its default 300 timed steps after 100 warmup steps): Ray Train step time / torchrun step
    time; goal <= 1.05.

The last stdout line is one JSON object: {"benchmark": "data_pipeline", "figures": {name: {value, unit, goal}},
"details": {...}}; progress lines go before it. A figure that was not measured (it failed, or was left out on the
command line) is still there, with value null and `miss` its reason (`benchmarks/_figures.py`).
"""

from __future__ import annotations

import argparse
import json
import os
import re
import subprocess
import sys
import tempfile
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))
sys.path.insert(0, str(REPO / "benchmarks"))

import vidray  # noqa: E402,F401 - before ray: keeps Ray's listeners on 127.0.0.1 (vidray.runtime)
from _figures import fill_misses  # noqa: E402

PEERS = REPO.parent / "shared" / "peers"
VENV_PYTHON = Path(sys.executable)
BUCKET = (17, 256, 256)
"""[num_frames, height, width] of the loader benchmarks' clips."""
FPS = 16.0
FIGURES = {
    "a": {"a_loader_vs_pyav_clips_per_s_after_first_batch": ("x", ">= 0.9")},
    "b": {"b_wait_fraction_after_first_batch": ("fraction", "<= 0.05")},
    "c": {"c_epoch2_vs_epoch1_clips_per_s": ("x", ">= 3")},
    "d": {"d_shard_fetches_per_epoch_per_shard": ("x", "<= 1.05")},
    "e": {"e_plan_epoch_26.6M_samples_512_ranks_s": ("s", "< 10"),
          "e_plan_epoch_peak_memory_bytes": ("bytes", "< 4000000000")},
    "f": {"f_peak_rss_600_vs_6_samples": ("x", "<= 1.10")},
    "g": {"g_step_time_ratio": ("x", "<= 1.05")},
}
"""Each figure letter's goal figures {name: (unit, goal)}: what the JSON holds, measured or as a miss."""
BATCH = 4
"""Clips per micro-batch per rank."""
SAMPLES_PER_SHARD = 8
STEP_S = 0.25
"""(b): seconds of the simulated trainer step."""
THROTTLE_FACTOR = 1.2
"""(b): the store's bytes/s as a multiple of the bytes/s the trainer consumes."""
CACHE_SHARDS = 6
"""(d): the shared warm cache's budget in shards (of the largest shard's size)."""
TINY_BUCKETS = [[9, 64, 64], [1, 64, 64]]
RSS_SAMPLES = (6, 600)
BUCKET_NAME = "vidray-bench"

_T0 = time.perf_counter()


def say(message: str) -> None:
    """A progress line, time-stamped in seconds since the benchmark started."""
    print(f"[{time.perf_counter() - _T0:6.1f} s] {message}", flush=True)


# -- data -------------------------------------------------------------------------------------------------------


def prepare_base(out: Path, buckets: list[list[int]], fps: float) -> dict[str, Any]:
    """`vidray prepare` of samples/metadata.json into `out` (no scene split, no caption grouping)."""
    from vidray.data.ingest import prepare
    from vidray.data.shards import read_index

    prepare(REPO / "samples" / "metadata.json", out, buckets=buckets, fps=fps, samples_per_shard=64, progress=None,
            scene_split=None, group_by_caption=False)
    return read_index(out)


def replicate(base: Path, out: str | Path, num_samples: int, samples_per_shard: int) -> dict[str, Any]:
    """Write a prepared dataset of `num_samples` rows to `out` (folder or URI) by repeating the rows of the
    prepared folder `base` in turn, each with a new unique `sample_id` (`<id>-r<i>`), grouped by bucket (one bucket
    per shard) and cut into shards of `samples_per_shard`, with vidray's `ShardWriter` (sample table, report and
    `index.json` as `vidray prepare` writes them). Returns the committed index."""
    import pyarrow.parquet as pq

    from vidray.data.buckets import Bucket
    from vidray.data.index import load_sample_index
    from vidray.data.shards import ShardWriter, read_index, read_report

    index = read_index(base)
    table = load_sample_index(base)
    rows: list[dict[str, Any]] = []
    for entry in index["shards"]:
        rows.extend(pq.read_table(base / entry["file"]).to_pylist())
    digests = [d.tobytes().hex() if d.any() else "" for d in table.source_sha256]
    picks = sorted(range(num_samples), key=lambda i: (rows[i % len(rows)]["num_frames"], i))  # bucket-major
    writer = ShardWriter(out)
    columns: dict[str, list[Any]] = {k: [] for k in ("sample_id", "num_frames", "height", "width", "shard", "row",
                                                     "stored_bytes", "source_sha256", "clip_start_s", "clip_end_s")}
    counts: dict[str, int] = {}
    shard_rows: list[dict[str, Any]] = []

    def flush() -> None:
        if shard_rows:
            writer.write_shard(shard_rows)
            shard_rows.clear()

    for i in picks:
        src = rows[i % len(rows)]
        bucket = str(Bucket(src["num_frames"], src["height"], src["width"]))
        if shard_rows and (len(shard_rows) == samples_per_shard or shard_rows[0]["num_frames"] != src["num_frames"]):
            flush()
        row = dict(src, sample_id=f"{src['sample_id']}-r{i}")
        columns["sample_id"].append(row["sample_id"])
        for key in ("num_frames", "height", "width", "clip_start_s", "clip_end_s"):
            columns[key].append(row[key])
        columns["shard"].append(len(writer.shards))
        columns["row"].append(len(shard_rows))
        columns["stored_bytes"].append(len(row["video_mp4"]))
        columns["source_sha256"].append(digests[i % len(rows)])
        counts[bucket] = counts.get(bucket, 0) + 1
        shard_rows.append(row)
    flush()
    writer.write_sample_table(columns)
    report = dict(read_report(base), replicated_from=str(base), num_samples=num_samples, bucket_counts=counts)
    return writer.commit(report, buckets=[Bucket(*b) for b in index["buckets"]], fps=index["fps"],
                         bucket_counts=counts)


def start_moto() -> tuple[subprocess.Popen, int]:
    """moto's standalone S3 server on 127.0.0.1 at a free port, with the bucket `BUCKET_NAME`: (process, port)."""
    import pyarrow.fs as pafs

    moto = VENV_PYTHON.with_name("moto_server")
    if not moto.is_file():
        raise RuntimeError(f"{moto} not found: install the dev extras (pip install -e '.[dev]') for moto[server]")
    proc = subprocess.Popen([str(moto), "-H", "127.0.0.1", "-p", "0"], stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True)
    port, deadline = None, time.monotonic() + 30
    while port is None and time.monotonic() < deadline:
        line = proc.stdout.readline()
        if not line and proc.poll() is not None:
            break
        if m := re.search(r"Running on http://127\.0\.0\.1:(\d+)", line):
            port = int(m.group(1))
    if port is None:
        proc.kill()
        raise RuntimeError("moto_server did not report its port within 30 s")
    threading.Thread(target=lambda: [None for _ in proc.stdout], daemon=True).start()  # drain its log
    fs = pafs.S3FileSystem(access_key="testing", secret_key="testing", region="us-east-1", scheme="http",
                           endpoint_override=f"127.0.0.1:{port}", allow_bucket_creation=True)
    fs.create_dir(BUCKET_NAME)
    return proc, port


# -- loaders ----------------------------------------------------------------------------------------------------


@dataclass
class Consumed:
    """What a consume loop saw: per batch the time it was taken (s since the loop started), its clips, epoch,
    data wait and stats; `end_s`: when the loop ended."""

    times: list[float] = field(default_factory=list)
    clips: list[int] = field(default_factory=list)
    epochs: list[int] = field(default_factory=list)
    waits: list[float] = field(default_factory=list)
    stats: list[dict[str, float]] = field(default_factory=list)
    end_s: float = 0.0

    def add(self, t: float, batch: Any) -> None:
        self.times.append(t)
        self.clips.append(len(batch.sample_ids))
        self.epochs.append(batch.epoch)
        self.waits.append(batch.data_wait_s)
        self.stats.append(batch.stats)

    def rate(self, first: int, last: int) -> float:
        """Clips/s of batches first+1..last, timed from batch `first` being taken to batch `last` being taken."""
        return sum(self.clips[first + 1:last + 1]) / (self.times[last] - self.times[first])

    def total(self, key: str) -> float:
        return sum(s[key] for s in self.stats)


def make_loader(shards_dir: str, *, epochs: int = 1, world_size: int = 1, rank: int = 0, local_ranks: int = 1,
                **data: Any):
    """A `RankLoader` of `rank` for `epochs` whole epochs from the start, micro-batches of `BATCH`; `local_ranks`:
    loaders sharing the node's warm cache (as the training loop passes its local world size)."""
    from vidray.config import DataConfig
    from vidray.data.index import load_sample_index
    from vidray.data.pipeline import RankLoader, plan_rank_steps
    from vidray.data.schedule import SampleSchedule
    from vidray.data.shards import read_index

    config = DataConfig(shards_dir=shards_dir, **data)
    index = read_index(shards_dir)
    table = load_sample_index(shards_dir)
    schedule = SampleSchedule(table.bucket_id, table.buckets, batch_sizes=BATCH, seed=0, shards=table.shard,
                              shuffle_block_shards=config.shuffle_block_shards)
    steps = plan_rank_steps(schedule, schedule.start(0), world_size=world_size, rank=rank, first_step=1,
                            last_step=epochs * schedule.steps_per_epoch(world_size))
    return RankLoader(shards_dir, index, table, steps, config, local_ranks=local_ranks)


def consume(loader: Any, step_s: float = 0.0) -> Consumed:
    """Take every batch of `loader`, sleeping `step_s` after each (a trainer step); returns what it saw."""
    seen = Consumed()
    t0 = time.perf_counter()
    for batch in loader:
        seen.add(time.perf_counter() - t0, batch)
        if step_s:
            time.sleep(step_s)
    seen.end_s = time.perf_counter() - t0
    return seen


# -- figures ----------------------------------------------------------------------------------------------------


def figure_a(local_dir: Path, tmp: Path) -> tuple[dict, dict]:
    """(a): loader clips/s (hot tier off) / plain PyAV clips/s over the same clip bytes."""
    import pyarrow.parquet as pq

    from vidray.data.shards import read_index

    clips_dir = tmp / "clips_mp4"
    clips_dir.mkdir()
    n = 0
    for entry in read_index(local_dir)["shards"]:
        for data in pq.read_table(local_dir / entry["file"], columns=["video_mp4"]).column("video_mp4").to_pylist():
            (clips_dir / f"clip{n:05d}.mp4").write_bytes(data)
            n += 1

    def run_peer() -> tuple[float, float]:
        out = subprocess.run([str(VENV_PYTHON), str(PEERS / "pyav_decode_limit.py"), str(clips_dir), "--rgb",
                              "--repeat", "2"], capture_output=True, text=True, check=True).stdout
        m = re.search(r"clips=(\d+) frames_per_run=(\d+) .*best_frames_per_s=([0-9.]+)", out)
        if m is None:
            raise RuntimeError(f"pyav_decode_limit.py printed no figure: {out!r}")
        clips, frames, fps = int(m.group(1)), int(m.group(2)), float(m.group(3))
        return fps, fps / (frames / clips)

    # The peer runs before and after the loader (the machine's load drifts); its figure is the mean of the two.
    say(f"(a) plain PyAV loop over {n} .mp4 files (pyav_decode_limit.py --rgb, best of 2 passes)")
    fps_before, before = run_peer()
    say(f"(a) peer: {fps_before:.0f} frames/s = {before:.1f} clips/s; now the 1-rank loader, hot tier off, 2 epochs")
    t0 = time.perf_counter()
    seen = consume(make_loader(str(local_dir), epochs=2, hot_bytes=0))
    rate = seen.rate(0, len(seen.times) - 1)
    first_s = seen.times[0]
    say(f"(a) loader: {sum(seen.clips)} clips in {time.perf_counter() - t0:.1f} s; first batch after {first_s:.2f} s "
        f"(start-up), then {rate:.1f} clips/s; decode {seen.total('decode_s'):.1f} s in the operator")
    fps_after, after = run_peer()
    peer_clips_per_s = (before + after) / 2
    fps = (fps_before + fps_after) / 2
    say(f"(a) peer again: {fps_after:.0f} frames/s = {after:.1f} clips/s")
    ratio = rate / peer_clips_per_s
    figures = {"a_loader_vs_pyav_clips_per_s_after_first_batch": {"value": round(ratio, 3), "unit": "x",
                                                                   "goal": ">= 0.9"}}
    details = {"a_loader_clips_per_s_after_first_batch": round(rate, 2),
               "a_pyav_clips_per_s": round(peer_clips_per_s, 2), "a_pyav_frames_per_s": round(fps),
               "a_pyav_clips_per_s_before_after": [round(before, 2), round(after, 2)],
               "a_loader_first_batch_s": round(first_s, 2), "a_clips_delivered": sum(seen.clips),
               "a_operator_decode_s": round(seen.total("decode_s"), 2)}
    return figures, details


def figure_b(uri: str, throttled_uri: str, proxy: Any, index: dict, tmp: Path) -> tuple[dict, dict]:
    """(b): data-wait fraction with the store throttled to ~ the consumption rate, prefetch on vs off."""
    shard_bytes = sum(s["bytes"] for s in index["shards"])
    consume_bytes_per_s = shard_bytes / index["num_samples"] * BATCH / STEP_S
    proxy.rate_bytes_per_s = THROTTLE_FACTOR * consume_bytes_per_s
    details: dict[str, Any] = {"b_step_s": STEP_S, "b_consumed_bytes_per_s": round(consume_bytes_per_s),
                               "b_store_bytes_per_s": round(proxy.rate_bytes_per_s)}
    fractions = {}
    for name, prefetch, window in (("on", 4, 16), ("off", 0, 0)):
        say(f"(b) prefetch {name}: trainer step {STEP_S} s, store throttled to {proxy.rate_bytes_per_s / 1e6:.2f} MB/s "
            f"({THROTTLE_FACTOR}x the {consume_bytes_per_s / 1e6:.2f} MB/s consumed)")
        before = proxy.bytes_down
        seen = consume(make_loader(throttled_uri, cache_dir=str(tmp / f"cache_b_{name}"), prefetch_batches=prefetch,
                                   prefetch_window_batches=window), step_s=STEP_S)
        steady = sum(seen.waits[1:]) / (seen.end_s - seen.times[0])
        whole = sum(seen.waits) / seen.end_s
        fractions[name] = steady
        details.update({f"b_wait_fraction_after_first_batch_prefetch_{name}": round(steady, 4),
                        f"b_wait_fraction_with_first_batch_prefetch_{name}": round(whole, 4),
                        f"b_first_batch_wait_s_prefetch_{name}": round(seen.waits[0], 2),
                        f"b_bytes_through_throttle_prefetch_{name}": proxy.bytes_down - before})
        say(f"(b) prefetch {name}: waited {sum(seen.waits[1:]):.2f} s of {seen.end_s - seen.times[0]:.1f} s after "
            f"the first batch ({steady:.3f}); first batch after {seen.waits[0]:.2f} s; "
            f"{(proxy.bytes_down - before) / 1e6:.1f} MB through the throttle")
        if proxy.bytes_down == before:
            raise RuntimeError(f"nothing went through the throttling proxy: {throttled_uri} did not reach it")
    proxy.rate_bytes_per_s = None
    figures = {"b_wait_fraction_after_first_batch": {
        "value": round(fractions["on"], 4), "unit": "fraction", "goal": "<= 0.05"}}  # off: in details
    return figures, details


def figure_c(uri: str, tmp: Path, index: dict) -> tuple[dict, dict]:
    """(c): epoch 2 (warm/hot) clips/s / epoch 1 (cold, S3) clips/s of one loader."""
    hot_bytes = 2 * index["num_samples"] * BUCKET[0] * BUCKET[1] * BUCKET[2] * 3  # room for every decoded clip
    say(f"(c) one loader on S3, 2 epochs, fresh warm cache, hot tier {hot_bytes / 2**20:.0f} MiB")
    seen = consume(make_loader(uri, epochs=2, cache_dir=str(tmp / "cache_c"), hot_bytes=hot_bytes))
    last0 = max(i for i, e in enumerate(seen.epochs) if e == seen.epochs[0])
    cold, warm = seen.rate(0, last0), seen.rate(last0, len(seen.times) - 1)
    later = range(last0 + 1, len(seen.stats))
    say(f"(c) epoch 1 {cold:.1f} clips/s, epoch 2 {warm:.1f} clips/s (hot misses in epoch 2: "
        f"{sum(seen.stats[i]['hot_misses'] for i in later):.0f})")
    figures = {"c_epoch2_vs_epoch1_clips_per_s": {"value": round(warm / cold, 2), "unit": "x", "goal": ">= 3"}}
    details = {"c_epoch1_cold_clips_per_s": round(cold, 2), "c_epoch2_warm_hot_clips_per_s": round(warm, 2),
               "c_epoch1_warm_misses": sum(seen.stats[i]["warm_misses"] for i in range(last0 + 1)),
               "c_epoch2_hot_misses": sum(seen.stats[i]["hot_misses"] for i in later)}
    return figures, details


def figure_d(proxied_uri: str, proxy: Any, tmp: Path, index: dict) -> tuple[dict, dict]:
    """(d): shard downloads per epoch / shards, 2 ranks sharing one warm cache of a few shards. The store is read
    through the (unthrottled) proxy, whose byte count cross-checks the loaders' `warm_misses`."""
    largest = max(s["bytes"] for s in index["shards"])
    num_shards = len(index["shards"])
    dataset_bytes = sum(s["bytes"] for s in index["shards"])
    budget = CACHE_SHARDS * largest
    say(f"(d) 2 ranks, one shared warm cache of {budget / 1e6:.1f} MB ({CACHE_SHARDS} shards of {num_shards}), S3")
    proxy.rate_bytes_per_s = None
    before = proxy.bytes_down
    data = {"cache_dir": str(tmp / "cache_d"), "cache_bytes": budget}
    loaders = [make_loader(proxied_uri, world_size=2, rank=r, local_ranks=2, **data) for r in (0, 1)]
    misses = hits = 0.0
    steps = 0
    for b0, b1 in zip(*loaders):  # lockstep, as DDP ranks consume
        misses += b0.stats["warm_misses"] + b1.stats["warm_misses"]
        hits += b0.stats["warm_hits"] + b1.stats["warm_hits"]
        steps += 1
    store_ratio = (proxy.bytes_down - before) / dataset_bytes
    ratio = misses / num_shards
    say(f"(d) {steps} steps x 2 ranks: {misses:.0f} shard downloads (warm_misses) for {num_shards} shards, "
        f"{hits:.0f} warm hits; the store sent {store_ratio:.2f}x the dataset's bytes")
    figures = {"d_shard_fetches_per_epoch_per_shard": {"value": round(ratio, 3), "unit": "x", "goal": "<= 1.05"}}
    details = {"d_shard_downloads": misses, "d_num_shards": num_shards, "d_warm_hits": hits,
               "d_cache_bytes": budget, "d_store_bytes_per_dataset_bytes": round(store_ratio, 3)}
    return figures, details


def figure_e() -> tuple[dict, dict]:
    """(e): benchmarks/schedule.py in its own process (its peak RSS is the figure), one thread."""
    say("(e) benchmarks/schedule.py: plan one epoch of 26.6 M samples over 512 ranks (one thread)")
    env = dict(os.environ, OMP_NUM_THREADS="1", OPENBLAS_NUM_THREADS="1", MKL_NUM_THREADS="1")
    out = subprocess.run([str(VENV_PYTHON), str(REPO / "benchmarks" / "schedule.py")], capture_output=True, text=True,
                         env=env, check=True).stdout.strip().splitlines()
    result = json.loads(out[-1])
    say(f"(e) {out[-2] if len(out) > 1 else ''}")
    return {f"e_{k}": v for k, v in result["figures"].items()}, {}


def figure_f(tmp: Path) -> tuple[dict, dict]:
    """(f): rank 0's peak RSS training on 6 and on 600 samples (1 worker, 4 steps)."""
    from vidray.config import load_job_config
    from vidray.train.trainer import run_training

    base = tmp / "tiny_base"
    index = prepare_base(base, TINY_BUCKETS, 8.0)
    datasets = {index["num_samples"]: base}
    big = RSS_SAMPLES[1]
    replicate(base, tmp / f"tiny_{big}", big, 64)
    datasets[big] = tmp / f"tiny_{big}"
    rss: dict[int, Any] = {}
    for n, shards_dir in datasets.items():
        say(f"(f) run_training, 1 worker, 4 steps, {n} samples")
        job = load_job_config(REPO / "jobs/configs/tiny_t2v.yaml", [
            f"data.shards_dir={shards_dir}", f"storage.path={tmp / f'runs_{n}'}", f"name=rss-{n}",
            f"data.cache_dir={tmp / 'cache_f'}", "model.text_encoder=tiny_random", "train.max_steps=4",
            "train.log_every_steps=2", "checkpoint.every_steps=1000", "scaling.num_workers=1"])
        result = run_training(job)
        rss[n] = getattr(result, "peak_rss_bytes", None)
        say(f"(f) {n} samples: rank 0 peak RSS {rss[n] / 1e6 if rss[n] else float('nan'):.0f} MB")
    small, large = rss[min(rss)], rss[max(rss)]
    details = {f"f_peak_rss_bytes_{n}_samples": v for n, v in rss.items()}
    if not small or not large:
        raise RuntimeError(f"TrainResult.peak_rss_bytes is {small} / {large}: no peak RSS to compare")
    return {f"f_peak_rss_{RSS_SAMPLES[1]}_vs_{RSS_SAMPLES[0]}_samples": {
        "value": round(large / small, 3), "unit": "x", "goal": "<= 1.10"}}, details


def figure_g(tmp: Path, steps: int, warmup: int) -> tuple[dict, dict]:
    """(g): benchmarks/train_overhead.py's `measure` (its own `vidray train` and torchrun runs)."""
    from train_overhead import measure

    say(f"(g) train_overhead.measure: torchrun peer and `vidray train`, 2 workers, {steps} steps after {warmup}")
    result = measure(tmp / "g", steps=steps, warmup=warmup)
    figures, details = {}, {}
    for name, fig in result["figures"].items():
        if "goal" in fig:
            figures[f"g_{name}"] = fig
        else:
            details[f"g_{name}"] = fig["value"]
    details["g_vidray_phases_s"] = result["details"].get("vidray_phases_s")
    say(f"(g) {json.dumps(result['figures'])}")
    return figures, details


# -- the run ----------------------------------------------------------------------------------------------------


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--clips", type=int, default=160, help="samples of the loader benchmarks (default: %(default)s)")
    ap.add_argument("--skip-train-overhead", action="store_true", help="leave (g) out (it takes ~4 min)")
    ap.add_argument("--g-steps", type=int, default=300, help="(g): timed steps (default: %(default)s)")
    ap.add_argument("--g-warmup", type=int, default=100, help="(g): untimed first steps (default: %(default)s)")
    ap.add_argument("--figures", default="abcdefg", help="which figures to measure (default: all, %(default)s)")
    ap.add_argument("--keep", help="folder for data, caches and logs (default: a temp dir, deleted)")
    a = ap.parse_args()
    if a.clips < 100:
        raise SystemExit(f"--clips must be >= 100 so Ray's start-up is small against the run, got {a.clips}")
    if a.keep:
        if Path(a.keep).exists() and any(Path(a.keep).iterdir()):
            raise SystemExit(f"--keep {a.keep} is not empty: give a new folder (every run starts with cold caches)")
        Path(a.keep).mkdir(parents=True, exist_ok=True)
        result = run(Path(a.keep), a)
    else:
        with tempfile.TemporaryDirectory(prefix="vidray-data-bench-") as tmp:
            result = run(Path(tmp), a)
    print(json.dumps(result))


def measure_figure(letter: str, measure: Callable[[], tuple[dict, dict]], figures: dict, details: dict,
                   misses: dict[str, str]) -> None:
    """Run one figure's measurement into `figures` / `details`; a failure becomes `misses[letter]` (its reason),
    and the other figures still run."""
    try:
        part = measure()
    except Exception as err:  # noqa: BLE001 - the figure is a miss with its reason; the others still run
        say(f"({letter}) failed: {type(err).__name__}: {err}")
        misses[letter] = f"failed: {type(err).__name__}: {err}"
    else:
        figures.update(part[0])
        details.update(part[1])


def with_misses(figures: dict, misses: dict[str, str], requested: str) -> dict:
    """`figures` with every goal figure of `FIGURES` it lacks as a miss: its letter's failure, or left out."""
    for letter, expected in FIGURES.items():
        reason = misses.get(letter) or (f"left out (--figures {requested})" if letter not in requested
                                        else "not measured")
        fill_misses(figures, expected, reason)
    return figures


def run(tmp: Path, a: argparse.Namespace) -> dict[str, Any]:
    figures: dict[str, Any] = {}
    misses: dict[str, str] = {}  # figure letter -> why it was not measured
    details: dict[str, Any] = {"clips": a.clips, "bucket": "x".join(map(str, BUCKET)), "batch_per_rank": BATCH,
                               "samples_per_shard": SAMPLES_PER_SHARD, "load_avg_1m_start": os.getloadavg()[0]}
    requested = a.figures.replace("g", "") if a.skip_train_overhead else a.figures

    # 1. (e) first, alone: its peak RSS and seconds want a quiet process.
    if "e" in requested:
        measure_figure("e", figure_e, figures, details, misses)

    # 2. The clips: prepare once, replicate into a local folder and into S3 (moto on 127.0.0.1).
    say(f"prepare samples/ at {BUCKET} {FPS} frames/s, replicate to {a.clips} clips (local folder and S3)")
    base_index = prepare_base(tmp / "base", [list(BUCKET)], FPS)
    local = tmp / "local"
    index = replicate(tmp / "base", local, a.clips, SAMPLES_PER_SHARD)
    moto, moto_port = start_moto()
    from _throttle import ThrottledProxy

    proxy = ThrottledProxy("127.0.0.1", moto_port, rate_bytes_per_s=None)
    try:
        os.environ.update({"AWS_ENDPOINT_URL": f"http://127.0.0.1:{moto_port}", "AWS_ACCESS_KEY_ID": "testing",
                           "AWS_SECRET_ACCESS_KEY": "testing", "AWS_DEFAULT_REGION": "us-east-1",
                           "AWS_EC2_METADATA_DISABLED": "true"})
        os.environ.pop("AWS_ENDPOINT_URL_S3", None)
        uri = f"s3://{BUCKET_NAME}/clips"
        replicate(tmp / "base", uri, a.clips, SAMPLES_PER_SHARD)
        proxy_port = proxy.start()
        proxied_uri = throttled_uri = (f"s3://{BUCKET_NAME}/clips?endpoint_override=127.0.0.1:{proxy_port}"
                                       "&scheme=http&region=us-east-1")
        details.update({"base_clips": base_index["num_samples"], "num_shards": len(index["shards"]),
                        "dataset_bytes": sum(s["bytes"] for s in index["shards"])})
        say(f"{a.clips} clips of {details['base_clips']} sources in {len(index['shards'])} shards "
            f"({details['dataset_bytes'] / 1e6:.1f} MB); S3 at 127.0.0.1:{moto_port}, throttle at :{proxy_port}")

        # 3. Ray (the environment above reaches the loader actors through the raylet).
        from vidray.runtime import apply_ray_env_defaults, init_ray

        apply_ray_env_defaults()
        t0 = time.perf_counter()
        started = init_ray(num_cpus=4)
        details["ray_init_s"] = round(time.perf_counter() - t0, 2)
        say(f"Ray started in {details['ray_init_s']} s")
        try:
            for name, measure in (("a", lambda: figure_a(local, tmp)),
                                  ("b", lambda: figure_b(uri, throttled_uri, proxy, index, tmp)),
                                  ("c", lambda: figure_c(uri, tmp, index)),
                                  ("d", lambda: figure_d(proxied_uri, proxy, tmp, index)),
                                  ("f", lambda: figure_f(tmp))):
                if name in requested:
                    measure_figure(name, measure, figures, details, misses)
        finally:
            if started:
                import ray

                ray.shutdown()
    finally:
        proxy.stop()
        moto.terminate()
        try:
            moto.wait(timeout=10)
        except subprocess.TimeoutExpired:
            moto.kill()

    # 4. (g) last: it starts its own Ray through `vidray train`.
    if a.skip_train_overhead and "g" in a.figures:
        misses["g"] = "left out (--skip-train-overhead)"
    elif "g" in requested:
        measure_figure("g", lambda: figure_g(tmp, a.g_steps, a.g_warmup), figures, details, misses)
    details["load_avg_1m_end"] = os.getloadavg()[0]
    details["wall_s"] = round(time.perf_counter() - _T0, 1)
    return {"benchmark": "data_pipeline", "figures": with_misses(figures, misses, requested), "details": details}


if __name__ == "__main__":
    main()
