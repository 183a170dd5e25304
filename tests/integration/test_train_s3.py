"""Short 2-worker training runs against object storage (moto's S3 server on 127.0.0.1): a run with its shards in
the bucket (the workers fetch them through the node's warm cache, skip a corrupted shard on every rank alike, and the
result lists it) and its `storage.path` in the bucket (checkpoints and the diffusers export land there, a re-submit
resumes from there, and `vidray generate` samples from the exported URI)."""

from __future__ import annotations

import json

from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from vidray.config import load_job_config
from vidray.data.ingest import prepare
from vidray.data.shards import read_index
from vidray.storage import open_storage

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


def test_run_on_s3_shards_and_storage_skips_a_corrupted_shard_checkpoints_resumes_and_exports_in_the_bucket_for_generate(
        s3_ray, tmp_path, monkeypatch):
    """One run with both its shards and its `storage.path` in the bucket, re-submitted to resume (each run starts a
    worker group: one run checks both sides of the storage)."""
    import uuid

    import av

    from vidray.cli import main
    from vidray.models.export import inspect_model
    from vidray.train.checkpoint import CheckpointManager
    from vidray.train.trainer import run_training

    # 1. Shards in the bucket, one of them corrupted after its index entry was written.
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
    good = [pq.read_table(pa.BufferReader(storage.read_bytes(index["shards"][i]["file"])), columns=["sample_id"])
            for i in (0, 2)]
    good_ids = {s for table in good for s in table["sample_id"].to_pylist()}

    name = f"s3-storage-{uuid.uuid4().hex[:6]}"

    def job(max_steps: int, *extra: str):
        return load_job_config(REPO / "jobs/configs/tiny_t2v.yaml", [
            f"data.shards_dir={uri}", f"data.cache_dir={tmp_path / 'cache'}", "storage.path=s3://vidray-test/runs",
            f"name={name}", "model.text_encoder=tiny_random", f"train.max_steps={max_steps}",
            "train.log_every_steps=2", "checkpoint.every_steps=2", *extra,
        ])

    # 2. The workers fetch the shards through the node's warm cache and skip the corrupted one on every rank alike;
    # the result lists it. Checkpoints and the diffusers export land in the bucket.
    result = run_training(job(4), record_sample_ids=True)
    assert [int(s) for s, _ in result.losses] == [1, 2, 3, 4]
    assert [s["file"] for s in result.skipped_shards] == [bad["file"]]
    assert "sha256" in result.skipped_shards[0]["reason"]
    trained = {sid for _, _, ids in result.trained_samples for sid in ids}
    assert trained and trained <= good_ids  # nothing of the corrupted shard was trained on
    cached = {p.name for p in (tmp_path / "cache" / "shards").iterdir()}
    assert cached == {f"{index['shards'][i]['sha256']}.parquet" for i in (0, 2)}  # one file per shard per node
    run_uri = f"s3://vidray-test/runs/{name}"
    assert result.run_dir == run_uri and result.diffusers_dir == f"{run_uri}/diffusers"
    assert result.checkpoint_path == f"{run_uri}/checkpoint_000004"
    stored = open_storage(run_uri).files()
    assert {"checkpoint_000004/manifest.json", "checkpoint_000004/transformer.safetensors"} <= stored
    assert {"diffusers/model_index.json", "diffusers/vidray_job.yaml", "diffusers/scheduler/scheduler_config.json"} \
        <= stored and any(f.startswith("diffusers/transformer/") for f in stored)

    # 3. Re-submitted with more steps (and resume=must): the driver finds the run's latest complete checkpoint in the
    # bucket, verifies it there, and the workers download it and continue at step 5; checkpoint.num_to_keep=2
    # rotates the bucket's checkpoints.
    resumed = run_training(job(6, "checkpoint.resume=must"), record_sample_ids=True)
    assert resumed.first_step == 5 and [int(s) for s, _ in resumed.losses] == [5, 6]
    assert {sid for _, _, ids in resumed.trained_samples for sid in ids} <= good_ids
    assert CheckpointManager(run_uri).complete() == ["checkpoint_000004", "checkpoint_000006"]
    # The curves went into the bucket's run folder too, continued by the resumed run (vidray.train.runlog).
    run_files = open_storage(run_uri)
    assert {"loss.png", "metrics.jsonl"} <= run_files.files()
    assert any(f.startswith("tensorboard/events.") for f in run_files.files())
    steps = [json.loads(line)["step"] for line in run_files.read_bytes("metrics.jsonl").decode().splitlines()]
    assert steps == [1, 2, 3, 4, 5, 6]

    # 4. `vidray generate` samples from the exported URI, through its model cache.
    monkeypatch.setenv("VIDRAY_MODEL_CACHE", str(tmp_path / "model-cache"))
    out = tmp_path / "horse.mp4"
    assert main(["generate", "--model", f"{run_uri}/diffusers", "--prompt", "a horse galloping", "--output", str(out),
                 "--bucket", "9x64x64", "--num-inference-steps", "2"]) == 0
    with av.open(str(out)) as container:
        frames = [f.to_ndarray(format="rgb24") for f in container.decode(video=0)]
    assert len(frames) == 9 and frames[0].shape == (64, 64, 3)
    (cached_model,) = (tmp_path / "model-cache").iterdir()
    info = inspect_model(f"{run_uri}/diffusers")  # unchanged in the bucket: the cached copy is used again
    assert info.path == cached_model and info.source == f"{run_uri}/diffusers" and info.kind == "diffusers"
    assert info.job.name == name and list((tmp_path / "model-cache").iterdir()) == [cached_model]
