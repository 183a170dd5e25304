"""What the decode operator (`vidray.data.pipeline.ClipLoader`) does to each clip, run in process through
`LocalLoader` (the same operators, plan and batches as the Ray Data `RankLoader`, whose order and streaming
tests/integration/test_pipeline.py checks on a real Ray): the hot tier, clips and shards that fail and are skipped
with weight 0, cached latents that spare the decode, and the warm prefetcher on (moto's) S3."""

from __future__ import annotations

import hashlib
import json
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from vidray.config import DataConfig, load_job_config
from vidray.data.index import load_sample_index
from vidray.data.ingest import prepare
from vidray.data.pipeline import LocalLoader, plan_rank_steps
from vidray.data.schedule import SampleSchedule
from vidray.data.format import content_hash
from vidray.data.shards import read_index

REPO = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module")
def shards_dir(tmp_path_factory):
    """The shipped clips in shards of 2 (tests/integration/test_pipeline.py uses it too)."""
    out = tmp_path_factory.mktemp("shards")
    buckets = load_job_config(REPO / "jobs/configs/tiny_t2v.yaml").data.buckets
    prepare(REPO / "samples" / "metadata.json", out, buckets=buckets, fps=8.0, samples_per_shard=2,
            progress=None, scene_split=None)
    return out


def plan_and_loader(shards_dir, *, loader_class=LocalLoader, world_size=1, rank=0, steps=6, window_steps=2048,
                    **data):
    """(the `RankStep`s of `rank` for steps 1..`steps` from the start, seed 0, batches of 2; a `loader_class`
    (`LocalLoader` or the Ray Data `RankLoader`) of them, `data`: `DataConfig` keys)."""
    index = read_index(shards_dir)
    table = load_sample_index(shards_dir)
    schedule = SampleSchedule(table.bucket_id, table.buckets, batch_sizes=2, seed=0, shards=table.shard,
                              shuffle_block_shards=2)
    plan = plan_rank_steps(schedule, schedule.start(0), world_size=world_size, rank=rank, first_step=1,
                           last_step=steps)
    return plan, loader_class(str(shards_dir), index, table, plan, DataConfig(**data), window_steps=window_steps)


def test_hot_tier_serves_later_epochs_without_reading_or_decoding(shards_dir):
    n = len(load_sample_index(shards_dir))
    plan, loader = plan_and_loader(shards_dir, steps=12)
    batches = list(loader)
    epochs = sorted({b.epoch for b in batches})
    assert len(epochs) >= 2
    later = [b for b in batches if b.epoch > epochs[0]]
    assert later and sum(b.stats["hot_misses"] for b in later) == 0
    assert sum(b.stats["shard_reads"] + b.stats["decode_s"] for b in later) == 0
    first = [b for b in batches if b.epoch == epochs[0]]
    assert sum(b.stats["hot_misses"] for b in first) == n  # each clip decoded once (repeats are hot hits)
    shards = len(read_index(shards_dir)["shards"])
    assert sum(b.stats["shard_reads"] for b in first) == shards  # each shard read once in the epoch

    _, cold = plan_and_loader(shards_dir, steps=12, hot_bytes=0)
    cold_batches = list(cold)
    # Hot tier off: every clip is decoded every time it comes up (a clip repeated within a batch: once).
    assert sum(b.stats["hot_misses"] for b in cold_batches) == sum(len(set(b.sample_ids)) for b in cold_batches)
    assert sum(b.stats["hot_misses"] for b in cold_batches) > n

def _rewrite_shard(shards_dir: Path, shard: int, edit) -> str:
    """Rewrite one shard through `edit(table) -> table` and re-commit its size and sha256 in index.json."""
    index_path = shards_dir / "index.json"
    index = json.loads(index_path.read_text())
    entry = index["shards"][shard]
    path = shards_dir / entry["file"]
    table = edit(pq.read_table(path))
    pq.write_table(table, path)
    data = path.read_bytes()
    entry.update(bytes=len(data), sha256=hashlib.sha256(data).hexdigest())
    index["content_hash"] = content_hash(index)
    index_path.write_text(json.dumps(index))
    return table.column("sample_id")[0].as_py()

def test_a_clip_that_no_longer_decodes_is_skipped_with_weight_zero_and_reported(shards_dir, tmp_path):
    import shutil

    copy = tmp_path / "shards"
    shutil.copytree(shards_dir, copy)

    def garble_first_clip(table):
        videos = table.column("video_mp4").to_pylist()
        videos[0] = b"not an mp4 at all"
        return table.set_column(table.schema.get_field_index("video_mp4"), "video_mp4",
                                pa.array(videos, type=pa.binary()))

    bad_id = _rewrite_shard(copy, 0, garble_first_clip)
    plan, loader = plan_and_loader(copy, steps=8)
    batches = list(loader)
    assert len(batches) == 8  # training goes on
    skipped = [s for b in batches for s in b.skipped]
    assert [s["sample_id"] for s in skipped] == [bad_id]  # reported once
    for batch in batches:
        for sample_id, weight in zip(batch.sample_ids, batch.weights):
            if sample_id == bad_id:
                assert weight == 0  # never trained on
        assert batch.frames.shape[0] == 2  # the slot keeps the batch's shape

def test_a_shard_failing_its_checksum_is_skipped_and_its_clips_weigh_zero(shards_dir, tmp_path):
    import shutil

    copy = tmp_path / "shards"
    shutil.copytree(shards_dir, copy)
    index = read_index(copy)
    bad = index["shards"][0]
    path = copy / bad["file"]
    bad_ids = set(pq.read_table(path, columns=["sample_id"])["sample_id"].to_pylist())
    data = bytearray(path.read_bytes())
    data[-100] ^= 0xFF
    path.write_bytes(bytes(data))
    _, loader = plan_and_loader(copy, steps=8)
    batches = list(loader)
    skipped = [s for b in batches for s in b.skipped]
    assert [s.get("file") for s in skipped] == [bad["file"]] and "sha256" in skipped[0]["reason"]
    for batch in batches:
        assert all(w == 0 for sid, w in zip(batch.sample_ids, batch.weights) if sid in bad_ids)

def test_a_shard_the_store_no_longer_delivers_is_skipped_and_its_clips_weigh_zero(shards_dir, tmp_path):
    """The other way a shard fails: the store cannot deliver it (here: gone after the index was read)."""
    import shutil

    copy = tmp_path / "shards"
    shutil.copytree(shards_dir, copy)
    index = read_index(copy)
    gone = index["shards"][-1]
    gone_ids = set(pq.read_table(copy / gone["file"], columns=["sample_id"])["sample_id"].to_pylist())
    table = load_sample_index(copy)
    schedule = SampleSchedule(table.bucket_id, table.buckets, batch_sizes=2, seed=0, shards=table.shard,
                              shuffle_block_shards=2)
    plan = plan_rank_steps(schedule, schedule.start(0), world_size=1, rank=0, first_step=1, last_step=8)
    (copy / gone["file"]).unlink()
    batches = list(LocalLoader(str(copy), index, table, plan, DataConfig()))
    assert len(batches) == 8  # training goes on
    skipped = [s for b in batches for s in b.skipped]
    assert [s.get("file") for s in skipped] == [gone["file"]] and "unreadable" in skipped[0]["reason"]
    for batch in batches:
        assert all(w == 0 for sid, w in zip(batch.sample_ids, batch.weights) if sid in gone_ids)

def test_a_clip_whose_latents_are_cached_is_not_decoded(shards_dir, tmp_path):
    """With the encode stage and a latent cache: a pass fills the cache (every clip decoded); a later pass reads
    each clip's latents from the cache without decoding it, bit for bit the first pass's, and a damaged entry
    makes its clip decode again (and be re-encoded) rather than train on the zeros that stand in for frames."""
    import dataclasses

    from vidray.data.encode import vae_identity
    from vidray.data.pipeline import encode_spec

    job = load_job_config(REPO / "jobs/configs/tiny_t2v.yaml", ["model.text_encoder=tiny_random"])
    cache = tmp_path / "latents"
    spec = encode_spec(job, {}, latent_cache=str(cache))
    vae_id = vae_identity(dataclasses.asdict(job.model), job.train.seed)  # what the driver's task computes

    def run(**extra):
        index = read_index(shards_dir)
        table = load_sample_index(shards_dir)
        schedule = SampleSchedule(table.bucket_id, table.buckets, batch_sizes=2, seed=0, shards=table.shard,
                                  shuffle_block_shards=2)
        plan = plan_rank_steps(schedule, schedule.start(0), world_size=1, rank=0, first_step=1, last_step=3)
        return list(LocalLoader(str(shards_dir), index, table, plan, DataConfig(hot_bytes=0),
                                encode={**spec, **extra}))

    def total(batches, key):
        return sum(b.stats[key] for b in batches)

    first = run(identities={"vae": vae_id})
    assert total(first, "decodes_skipped") == 0 and total(first, "vae_misses") > 0
    assert {p.parent.parent.name for p in cache.glob("vae/*/*/*.safetensors")} == {vae_id[:32]}

    second = run(identities={"vae": vae_id})
    slots = sum(len(set(b.sample_ids)) for b in second)  # clips per batch (a repeat within a batch: one read)
    assert total(second, "hot_misses") == slots and total(second, "decodes_skipped") == slots
    assert total(second, "vae_misses") == 0
    for a, b in zip(first, second):
        assert a.sample_ids == b.sample_ids and b.frames is None
        np.testing.assert_array_equal(a.latents.numpy(), b.latents.numpy())

    for entry in cache.glob("vae/*/*/*.safetensors"):
        entry.write_bytes(b"damaged")
    third = run(identities={"vae": vae_id})
    assert total(third, "decodes_skipped") == 0 and total(third, "vae_misses") > 0
    for a, b in zip(first, third):
        np.testing.assert_array_equal(a.latents.numpy(), b.latents.numpy())

def _one_clip_steps(table) -> dict[str, np.ndarray]:
    """A ClipLoader plan of one step per sample, in shard order: step i reads row 0 of shard i."""
    n = len(table)
    order = np.lexsort((table.row, table.shard))
    return {"offsets": np.arange(n + 1, dtype=np.int64), "shard": table.shard[order].astype(np.int32),
            "row": table.row[order].astype(np.int32), "key": table.sample_key[order].astype(np.int64),
            "bucket": np.array([table.buckets[b] for b in table.bucket_id[order]], dtype=np.int32)}

@pytest.mark.parametrize("prefetch_window", [2, 0])  # 0: no prefetch thread, the control
def test_the_warm_prefetcher_holds_the_next_windows_shards_before_the_loader_asks(s3_env, tmp_path,
                                                                                   prefetch_window):
    # Issue 27: ClipLoader._prefetch_warm ran in no test. Shards of one clip each on (moto's) S3; the loader is
    # asked for step 0 only; the shards of steps 1..window must reach the warm cache by themselves, and no more.
    import time

    from vidray.data.cache import ShardCache
    from vidray.data.pipeline import ClipLoader

    uri = f"s3://vidray-test/prefetch-{time.monotonic_ns()}"  # the s3_server fixture's bucket
    prepare(REPO / "samples" / "metadata.json", uri, buckets=[[9, 64, 64], [1, 64, 64]], fps=8.0,
            samples_per_shard=1, progress=None, scene_split=None, group_by_caption=False)
    index, table = read_index(uri), load_sample_index(uri)
    plan = _one_clip_steps(table)
    assert len(index["shards"]) >= 4
    loader = ClipLoader(uri, index["shards"], plan, cache_dir=str(tmp_path / "warm"), cache_bytes=2**30,
                        hot_bytes=0, prefetch_window=prefetch_window, open_shards=1, hash_clips=False)
    cache = ShardCache(tmp_path / "warm", 2**30)

    def cached(step: int) -> bool:
        return cache.path(index["shards"][int(plan["shard"][step])]["sha256"]).is_file()

    loader._step(0)  # the decoder reaches step 0 (it fetched shard 0 itself)
    deadline = time.monotonic() + 20
    while prefetch_window and not all(cached(i) for i in (1, 2)) and time.monotonic() < deadline:
        time.sleep(0.05)
    if prefetch_window:
        assert cached(1) and cached(2)  # fetched ahead of the loader's asking
        time.sleep(0.5)
        assert not any(cached(i) for i in range(3, len(plan["offsets"]) - 1))  # and no further than the window
    else:
        time.sleep(1.0)
        assert not cached(1) and not cached(2)  # without the prefetcher nothing arrives ahead
