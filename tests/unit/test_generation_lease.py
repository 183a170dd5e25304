"""A re-prepare keeps the generation a running job still reads (issue 27 item 4: it deleted it under the job):
real prepares of the shipped clips, a reader's `GenerationLease`, the cleanup of the next prepares."""

from __future__ import annotations

import json
import time
from pathlib import Path

import pyarrow.parquet as pq

from vidray.data.ingest import prepare
from vidray.data.shards import READERS_DIR, GenerationLease, generation_of, leased_generations, read_index
from vidray.storage import open_storage

REPO = Path(__file__).resolve().parents[2]
BUCKETS = [(1, 32, 32), (9, 32, 32)]


def prepare_samples(out: Path) -> dict:
    prepare(REPO / "samples" / "metadata.json", out, buckets=BUCKETS, fps=8.0, samples_per_shard=4,
            scene_split=None, group_by_caption=False)
    return read_index(out)


def test_a_re_prepare_keeps_the_generation_a_running_job_reads_and_the_next_one_frees_it(tmp_path):
    first = prepare_samples(tmp_path)
    generation = generation_of(first)
    assert generation == "gen.00001"
    lease = GenerationLease(tmp_path, first)  # a training worker that read this index
    try:
        second = prepare_samples(tmp_path)  # committed while the job runs
        assert generation_of(second) == "gen.00002"
        for entry in first["shards"]:  # the job reads on, every shard it was given
            assert pq.read_table(tmp_path / entry["file"]).num_rows == entry["num_samples"]
    finally:
        lease.release()
    assert not list((tmp_path / READERS_DIR).iterdir())  # released: the lease file is gone
    third = prepare_samples(tmp_path)
    assert generation_of(third) == "gen.00003"
    assert not (tmp_path / generation).exists() and not (tmp_path / "gen.00002").exists()


def test_a_lease_its_reader_stopped_refreshing_expires_and_is_removed(tmp_path):
    first = prepare_samples(tmp_path)
    readers = tmp_path / READERS_DIR
    readers.mkdir()
    (readers / "gen.00001.dead.json").write_text(json.dumps(
        {"generation": "gen.00001", "expires_unix": time.time() - 1, "holder": "gone:1"}))
    (readers / "gen.00001.junk.json").write_text("{not json")
    storage = open_storage(tmp_path)
    assert leased_generations(storage) == set()
    assert not list(readers.iterdir())  # both removed on the way
    prepare_samples(tmp_path)
    assert not (tmp_path / generation_of(first)).exists()


def test_a_lease_is_refreshed_while_its_reader_runs(tmp_path):
    index = prepare_samples(tmp_path)
    with GenerationLease(tmp_path, index, lease_s=0.6) as lease:
        path = tmp_path / lease.rel
        first = json.loads(path.read_text())["expires_unix"]
        time.sleep(1.0)  # past the first expiry: the thread rewrote it every 0.2 s
        later = json.loads(path.read_text())["expires_unix"]
        assert later > first and later > time.time()
        assert leased_generations(open_storage(tmp_path)) == {"gen.00001"}
    assert not path.exists()


def test_a_re_prepare_on_object_storage_keeps_a_leased_generation(tmp_path, s3_env):
    uri = f"s3://vidray-test/lease-{time.monotonic_ns()}"  # the s3_server fixture's bucket
    first = prepare_samples_uri(uri)
    storage = open_storage(uri)
    with GenerationLease(uri, first):
        prepare_samples_uri(uri)
        assert all(entry["file"] in storage.files() for entry in first["shards"])
    prepare_samples_uri(uri)
    assert not any(name.startswith("gen.00001/") for name in storage.files())


def prepare_samples_uri(uri: str) -> dict:
    prepare(REPO / "samples" / "metadata.json", uri, buckets=BUCKETS, fps=8.0, samples_per_shard=4,
            scene_split=None, group_by_caption=False)
    return read_index(uri)
