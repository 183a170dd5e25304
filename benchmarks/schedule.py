"""Benchmark (e) of issue 6: seconds and peak memory to plan one epoch of 26.6 M samples over 512 ranks.

Run: `.venv/bin/python benchmarks/schedule.py` (one core: set OMP_NUM_THREADS=1; numpy's sorts are single-threaded).
The dataset is synthetic but shaped like EasyAnimate's: 26.6 M samples over 24 buckets (6 frame counts x 4
aspect ratios, skewed counts), micro-batch sizes from a token budget, and shards as `vidray prepare` writes them:
one bucket per shard, 1000 samples per shard (26.6 k shards). "Plan one epoch" = build the schedule (grouping the
samples by bucket and shard), build the epoch's micro-batches with the shard-local walk (`shuffle_block_shards`
4; every sample's slot), deal every step of the epoch to 512 ranks, and expand it to the (steps, 512) micro-batch
id of every rank plus the sample rows of one step (what a rank looks up per step).
Peak memory: the process's peak resident set (`resource.getrusage(RUSAGE_SELF).ru_maxrss`), which includes the
interpreter, numpy and the synthetic input (an upper bound of the planning's own memory); the tracemalloc peak of
the planning alone is printed too.

The last stdout line is one JSON object: {"benchmark": "schedule", "figures": {name: {value, unit, goal}}}.
"""

from __future__ import annotations

import json
import resource
import sys
import time
import tracemalloc
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from vidray.buckets import Bucket  # noqa: E402
from vidray.data.schedule import SampleSchedule, batch_sizes_for_buckets  # noqa: E402

NUM_SAMPLES = 26_600_000
SAMPLES_PER_SHARD = 1000
SHUFFLE_BLOCK_SHARDS = 4
WORLD_SIZE = 512
SEED = 0


def synthetic_buckets() -> tuple[list[Bucket], np.ndarray]:
    """24 buckets and a skewed bucket id per sample (int16)."""
    frames = [1, 17, 25, 49, 73, 97]
    sizes = [(512, 512), (384, 672), (672, 384), (448, 576)]
    buckets = sorted(Bucket(f, h, w) for f in frames for h, w in sizes)
    rng = np.random.default_rng(1)
    weights = rng.dirichlet(np.full(len(buckets), 0.7))
    ids = rng.choice(len(buckets), size=NUM_SAMPLES, p=weights).astype(np.int16)
    return buckets, ids


def synthetic_shards(ids: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """(bucket ids, shards): each bucket's samples cut into shards of SAMPLES_PER_SHARD (the last one of a bucket
    smaller), and the samples reordered into shard order, as `load_sample_index` returns the sample table (rows
    sorted by shard; shards of different buckets interleaved as prepare flushes them)."""
    order = np.argsort(ids, kind="stable")
    counts = np.bincount(ids)
    bucket_start = np.concatenate([[0], np.cumsum(counts)[:-1]])
    shards_per_bucket = -(-counts // SAMPLES_PER_SHARD)
    first_shard = np.concatenate([[0], np.cumsum(shards_per_bucket)[:-1]])
    sorted_ids = ids[order]
    rank_in_bucket = np.arange(len(ids)) - bucket_start[sorted_ids]
    shards = np.empty(len(ids), dtype=np.int32)
    shards[order] = first_shard[sorted_ids] + rank_in_bucket // SAMPLES_PER_SHARD
    # Number the shards in a random interleaving of the buckets (prepare flushes buckets as they fill).
    renumber = np.random.default_rng(2).permutation(int(shards.max()) + 1).astype(np.int32)
    shards = renumber[shards]
    by_shard = np.argsort(shards, kind="stable")
    return ids[by_shard], shards[by_shard]


def latent_tokens(bucket: Bucket) -> int:
    # EasyAnimate-like strides: 4x temporal, 8x spatial VAE; patch 2.
    return ((bucket.num_frames - 1) // 4 + 1) * (bucket.height // 16) * (bucket.width // 16)


def main() -> None:
    buckets, ids = synthetic_buckets()
    ids, shards = synthetic_shards(ids)
    sizes = batch_sizes_for_buckets(buckets, batch_size_per_worker=1, tokens_per_batch=32_768,
                                    latent_tokens=latent_tokens)
    tracemalloc.start()
    t0 = time.perf_counter()
    schedule = SampleSchedule(ids, buckets, batch_sizes=sizes, seed=SEED, shards=shards,
                              shuffle_block_shards=SHUFFLE_BLOCK_SHARDS)
    deal = schedule.plan(schedule.start(0), WORLD_SIZE)
    batch_ids, real = deal.batch_ids()  # (S, W)
    rows, weights = schedule.batch_samples(0, batch_ids[0])  # one step's samples: (W, B)
    elapsed_s = time.perf_counter() - t0
    _, traced_peak = tracemalloc.get_traced_memory()
    tracemalloc.stop()
    peak_rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024  # Linux: KiB
    # Sanity: every real micro-batch of the epoch is dealt exactly once.
    dealt = np.sort(batch_ids[real])
    assert np.array_equal(dealt, np.arange(schedule.batches_per_epoch)), "a micro-batch was lost or repeated"
    print(f"{NUM_SAMPLES} samples, {len(buckets)} buckets, {int(shards.max()) + 1} shards "
          f"(shuffle blocks of {SHUFFLE_BLOCK_SHARDS}), {schedule.batches_per_epoch} micro-batches, "
          f"{deal.num_steps} steps x {WORLD_SIZE} ranks ({int((~real).sum())} padded rank-batches): "
          f"{elapsed_s:.2f} s, peak RSS {peak_rss / 1e9:.2f} GB, tracemalloc peak {traced_peak / 1e9:.2f} GB")
    figures = {
        "plan_epoch_26.6M_samples_512_ranks_s": {"value": round(elapsed_s, 3), "unit": "s", "goal": "< 10"},
        "plan_epoch_peak_memory_bytes": {"value": int(peak_rss), "unit": "bytes", "goal": "< 4000000000"},
    }
    print(json.dumps({"benchmark": "schedule", "figures": figures}))


if __name__ == "__main__":
    main()
