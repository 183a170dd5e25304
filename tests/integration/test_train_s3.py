"""A short 2-worker training run on shards in object storage (moto's S3 server on 127.0.0.1): the workers fetch
the shards through the node's warm cache, skip a corrupted shard on every rank alike, and the result lists it."""

from __future__ import annotations

from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from vidray.config import load_job_config
from vidray.data.ingest import prepare
from vidray.data.shards import read_index
from vidray.data.storage import open_storage

REPO = Path(__file__).resolve().parents[2]
pytestmark = pytest.mark.integration


@pytest.fixture(scope="module")
def s3_ray(s3_env):
    """A local Ray started after the S3 variables are set, so its workers inherit them."""
    import ray

    from vidray.runtime import apply_ray_env_defaults, init_ray

    apply_ray_env_defaults()
    started = init_ray(num_cpus=4)
    yield ray
    if started:
        ray.shutdown()


def test_training_reads_s3_shards_through_the_cache_and_skips_a_corrupted_shard(s3_ray, tmp_path):
    from vidray.train.trainer import run_training

    uri = "s3://vidray-test/train-run/shards"
    buckets = load_job_config(REPO / "jobs/configs/tiny_t2v.yaml").data.buckets
    prepare(REPO / "samples" / "metadata.json", uri, buckets=buckets, fps=8.0, samples_per_shard=4, progress=None,
            scene_split=None)
    index = read_index(uri)
    assert len(index["shards"]) == 3  # one bucket per shard: 9x64x64 4 + 1 clips, 1x64x64 the image
    bad = index["shards"][1]
    storage = open_storage(uri)
    data = bytearray(storage.read_bytes(bad["file"]))
    data[-100] ^= 0xFF
    storage.write_bytes(bad["file"], bytes(data))

    job = load_job_config(REPO / "jobs/configs/tiny_t2v.yaml", [
        f"data.shards_dir={uri}", f"data.cache_dir={tmp_path / 'cache'}", f"storage.path={tmp_path / 'runs'}",
        "name=s3-run", "model.text_encoder=tiny_random", "train.max_steps=4", "train.log_every_steps=2",
        "checkpoint.every_steps=4",
    ])
    result = run_training(job, record_sample_ids=True)
    assert [int(s) for s, _ in result.losses] == [1, 2, 3, 4]
    assert [s["file"] for s in result.skipped_shards] == [bad["file"]]
    assert "sha256" in result.skipped_shards[0]["reason"]
    trained = {sid for _, _, ids in result.trained_samples for sid in ids}
    good = [pq.read_table(pa.BufferReader(storage.read_bytes(index["shards"][i]["file"])), columns=["sample_id"])
            for i in (0, 2)]
    good_ids = {s for table in good for s in table["sample_id"].to_pylist()}
    assert trained and trained <= good_ids  # nothing of the corrupted shard was trained on
    cached = {p.name for p in (tmp_path / "cache" / "shards").iterdir()}
    assert cached == {f"{index['shards'][i]['sha256']}.parquet" for i in (0, 2)}  # one file per shard per node
