"""Shards on object storage: `vidray prepare` to `s3://` and reading back, against a real S3-compatible server
(moto's standalone server on 127.0.0.1, started and stopped by the `s3_server` fixture)."""

from __future__ import annotations

import uuid
from pathlib import Path

import numpy as np
import pyarrow.fs as pafs
import pytest

from vidray.data.cache import ShardCache
from vidray.data.index import load_sample_index
from vidray.data.ingest import prepare
from vidray.data.shards import (
    INDEX_NAME,
    ShardChecksumError,
    iter_samples,
    listed_files,
    load_samples,
    read_index,
    read_report,
)
from vidray.storage import open_storage
from vidray.errors import UserFileNotFound

from tests.conftest import run_at_once

BUCKETS = [[9, 64, 64], [1, 64, 64]]
FPS = 8.0


def _prepare(samples_dir: Path, where: str | Path, samples_per_shard: int = 2):
    return prepare(samples_dir / "metadata.json", where, BUCKETS, FPS, samples_per_shard, progress=None,
                   scene_split=None)


def _fresh_uri() -> str:
    return f"s3://vidray-test/{uuid.uuid4().hex[:8]}/shards"


@pytest.fixture(scope="module")
def local_and_s3(samples_dir, tmp_path_factory, s3_env):
    """The samples prepared once to a local folder and once to a fresh S3 prefix."""
    local = tmp_path_factory.mktemp("local") / "shards"
    _prepare(samples_dir, local)
    uri = _fresh_uri()
    summary = _prepare(samples_dir, uri)
    return local, uri, summary


def test_prepare_to_s3_reads_back_identical_to_a_local_prepare(local_and_s3, tmp_path):
    local, uri, summary = local_and_s3
    assert summary.report_path == f"{uri}/gen.00001/report.json"
    local_samples, s3_samples = load_samples(local), load_samples(uri)
    assert [s.sample_id for s in s3_samples] == [s.sample_id for s in local_samples]
    assert len(s3_samples) == 6
    for a, b in zip(local_samples, s3_samples):
        assert a.caption == b.caption and a.bucket == b.bucket and a.video.shape == b.video.shape
    local_index, s3_index = read_index(local), read_index(uri)
    assert s3_index["bucket_counts"] == local_index["bucket_counts"]
    assert [s["num_samples"] for s in s3_index["shards"]] == [s["num_samples"] for s in local_index["shards"]]
    assert [k["sample_id"] for k in read_report(uri)["kept"]] == [k["sample_id"] for k in read_report(local)["kept"]]
    np.testing.assert_array_equal(load_sample_index(uri).sample_id, load_sample_index(local).sample_id)
    # The objects themselves, copied to a local folder, read back to the same decoded videos (H.264 encodes of two
    # prepares may differ in the last bits, so the pixels are compared on the very bytes uploaded).
    copy = tmp_path / "copy"
    storage = open_storage(uri)
    for rel in storage.files():
        (copy / rel).parent.mkdir(parents=True, exist_ok=True)
        (copy / rel).write_bytes(storage.read_bytes(rel))
    for a, b in zip(load_samples(copy), s3_samples):
        assert a.sample_id == b.sample_id
        np.testing.assert_array_equal(a.video, b.video)
    # The file:// form of the local folder reads the same dataset.
    assert [r["sample_id"] for r in iter_samples(f"file://{local}", columns=["sample_id"])] == \
        [s.sample_id for s in local_samples]


def test_s3_reads_go_through_the_warm_cache_once_per_shard(local_and_s3, tmp_path):
    _, uri, _ = local_and_s3
    cache = ShardCache(tmp_path / "cache", budget_bytes=10**8)
    first = load_samples(uri, cache=cache)
    num_shards = len(read_index(uri)["shards"])
    assert cache.stats.downloads == num_shards and cache.stats.hits == 0
    second = load_samples(uri, cache=cache)
    assert cache.stats.downloads == num_shards and cache.stats.hits == num_shards
    assert [s.sample_id for s in first] == [s.sample_id for s in second]
    cached = sorted(p.name for p in (tmp_path / "cache" / "shards").iterdir())
    assert cached == sorted(f"{s['sha256']}.parquet" for s in read_index(uri)["shards"])


def test_reprepare_on_s3_leaves_only_what_the_new_index_lists(samples_dir, s3_env):
    uri = _fresh_uri()
    _prepare(samples_dir, uri, samples_per_shard=2)
    first = read_index(uri)
    _prepare(samples_dir, uri, samples_per_shard=4)
    index = read_index(uri)
    assert index["generation"] == first["generation"] + 1
    assert open_storage(uri).files() == {INDEX_NAME, *listed_files(index)}
    assert all(f.startswith("gen.00002/") for f in listed_files(index))
    assert len(load_samples(uri)) == 6


def test_corrupted_shard_object_is_detected_and_skipped_with_a_reason(samples_dir, s3_env, s3_server, tmp_path):
    uri = _fresh_uri()
    _prepare(samples_dir, uri, samples_per_shard=2)
    index = read_index(uri)
    bad = index["shards"][1]["file"]
    storage = open_storage(uri)
    data = bytearray(storage.read_bytes(bad))
    data[len(data) // 2] ^= 0xFF  # one flipped byte, same size
    storage.write_bytes(bad, bytes(data))

    with pytest.raises(ShardChecksumError, match=bad) as err:
        load_samples(uri)
    assert err.value.file == bad

    skipped: list[dict] = []
    kept = load_samples(uri, skipped=skipped)
    assert [s["file"] for s in skipped] == [bad]
    assert "sha256" in skipped[0]["reason"] and "re-run `vidray prepare`" in skipped[0]["reason"]
    assert len(kept) == 6 - index["shards"][1]["num_samples"]

    cache = ShardCache(tmp_path / "cache", budget_bytes=10**8)
    skipped_cached: list[dict] = []
    kept_cached = load_samples(uri, cache=cache, skipped=skipped_cached)
    assert [s["file"] for s in skipped_cached] == [bad]
    assert cache.stats.checksum_failures == 2  # downloaded, mismatched, downloaded once more, refused
    assert [s.sample_id for s in kept_cached] == [s.sample_id for s in kept]
    assert not any(p.name.startswith(index["shards"][1]["sha256"]) for p in (tmp_path / "cache" / "shards").iterdir())


def test_s3_prefix_without_an_index_says_run_prepare(s3_env):
    with pytest.raises(UserFileNotFound, match="index.json not found.*run `vidray prepare`"):
        read_index(_fresh_uri())


def test_s3_uri_maps_to_bucket_and_prefix_on_an_s3_filesystem(s3_env):
    storage = open_storage("s3://vidray-test/x")
    assert isinstance(storage.fs, pafs.S3FileSystem) and storage.base == "vidray-test/x"
    assert not storage.is_local


def test_driver_checks_read_the_index_from_s3_and_refuse_a_too_small_cache_budget(local_and_s3, tmp_path):
    from vidray.config import load_job_config
    from vidray.errors import UserError
    from vidray.train.trainer import check_job_inputs

    _, uri, _ = local_and_s3
    repo = Path(__file__).resolve().parents[2]
    base = [f"data.shards_dir={uri}", f"storage.path={tmp_path / 'runs'}"]
    plan = check_job_inputs(load_job_config(repo / "jobs/configs/tiny_t2v.yaml", base))
    assert plan.checkpoint is None
    largest = max(s["bytes"] for s in read_index(uri)["shards"])
    with pytest.raises(UserError, match=rf"data.cache_bytes=1000 is smaller than the largest shard \({largest} "
                                        rf"bytes\): raise it to at least {largest}"):
        check_job_inputs(load_job_config(repo / "jobs/configs/tiny_t2v.yaml", base + ["data.cache_bytes=1000"]))


def test_dropping_a_skipped_shard_removes_exactly_its_samples_from_the_sample_table(local_and_s3):
    from vidray.data.index import drop_shards

    _, uri, _ = local_and_s3
    table = load_sample_index(uri)
    kept = drop_shards(table, [1])
    assert len(kept) == len(table) - int((table.shard == 1).sum()) and 1 not in set(kept.shard.tolist())
    np.testing.assert_array_equal(kept.sample_id, table.sample_id[table.shard != 1])
    before = [table.buckets[b] for b in table.bucket_id[table.shard != 1]]
    assert [kept.buckets[b] for b in kept.bucket_id] == before


def test_a_shard_the_store_keeps_failing_to_serve_is_skipped_with_a_reason(local_and_s3, monkeypatch):
    from vidray.storage import Storage

    _, uri, _ = local_and_s3
    index = read_index(uri)
    dropped = index["shards"][0]["file"]
    real_read = Storage.read_bytes

    def flaky(self, rel):
        if rel == dropped:
            raise OSError("AWS Error NETWORK_CONNECTION during GetObject operation: connection reset (after retries)")
        return real_read(self, rel)

    monkeypatch.setattr(Storage, "read_bytes", flaky)
    skipped: list[dict] = []
    kept = load_samples(uri, skipped=skipped)
    assert [s["file"] for s in skipped] == [dropped] and "unreadable after retries" in skipped[0]["reason"]
    assert len(kept) == 6 - index["shards"][0]["num_samples"]
    with pytest.raises(OSError, match="connection reset"):
        load_samples(uri)


def _folder(root: Path, files: dict[str, bytes]) -> Path:
    for rel, data in files.items():
        (root / rel).parent.mkdir(parents=True, exist_ok=True)
        (root / rel).write_bytes(data)
    return root


def test_upload_dir_copies_a_folder_to_s3_and_download_dir_copies_it_back(s3_env, tmp_path):
    from vidray.storage import download_dir, upload_dir

    files = {"model_index.json": b"{}", "transformer/weights.bin": bytes(range(256)) * 4096, "vae/config.json": b"1"}
    local = _folder(tmp_path / "export", files)
    uri = f"s3://vidray-test/{uuid.uuid4().hex[:8]}/diffusers"
    assert upload_dir(local, uri, marker="model_index.json") == sum(map(len, files.values()))
    assert open_storage(uri).files() == set(files)
    back = tmp_path / "back"
    assert download_dir(uri, back, marker="model_index.json") == sum(map(len, files.values()))
    assert {rel: (back / rel).read_bytes() for rel in files} == files


def test_upload_dir_writes_the_marker_last_and_removes_files_of_an_earlier_copy(s3_env, tmp_path, monkeypatch):
    from vidray import storage as storage_mod
    from vidray.storage import upload_dir

    uri = f"s3://vidray-test/{uuid.uuid4().hex[:8]}/diffusers"
    upload_dir(_folder(tmp_path / "v1", {"model_index.json": b"1", "old.bin": b"x", "a.bin": b"a1"}), uri,
               marker="model_index.json")
    order: list[tuple[str, bool]] = []
    real_put = storage_mod._put_file

    def recording_put(storage, rel, source):
        order.append((rel, storage.is_file("model_index.json")))  # is the old copy still marked complete?
        return real_put(storage, rel, source)

    monkeypatch.setattr(storage_mod, "_put_file", recording_put)
    upload_dir(_folder(tmp_path / "v2", {"model_index.json": b"22", "a.bin": b"a2", "b/c.bin": b"c"}), uri,
               marker="model_index.json")
    assert [rel for rel, _ in order] == ["a.bin", "b/c.bin", "model_index.json"]
    assert not any(marked for _, marked in order)  # the earlier marker went first: no mix of copies looks complete
    storage = open_storage(uri)
    assert storage.files() == {"model_index.json", "a.bin", "b/c.bin"}
    assert storage.read_bytes("a.bin") == b"a2" and storage.read_bytes("model_index.json") == b"22"


def test_upload_dir_retries_a_failed_attempt_then_raises_naming_the_uri_without_the_marker(s3_env, tmp_path,
                                                                                        monkeypatch):
    from vidray import storage as storage_mod
    from vidray.storage import StorageTransferError, upload_dir

    local = _folder(tmp_path / "export", {"model_index.json": b"{}", "w.bin": b"w"})
    uri = f"s3://vidray-test/{uuid.uuid4().hex[:8]}/diffusers"
    real_put = storage_mod._put_file
    failures = {"left": 1}

    def flaky_put(storage, rel, source):
        if rel == "w.bin" and failures["left"] > 0:
            failures["left"] -= 1
            raise OSError("AWS Error NETWORK_CONNECTION during PutObject operation: connection reset")
        return real_put(storage, rel, source)

    monkeypatch.setattr(storage_mod, "_put_file", flaky_put)
    assert upload_dir(local, uri, marker="model_index.json", backoff_s=0.01) == 3  # the second attempt went through
    assert open_storage(uri).files() == {"model_index.json", "w.bin"}

    failures["left"] = 10
    other = f"s3://vidray-test/{uuid.uuid4().hex[:8]}/diffusers"
    with pytest.raises(StorageTransferError, match=rf"{other}.*failed 3 times.*connection reset") as err:
        upload_dir(local, other, marker="model_index.json", backoff_s=0.01)
    assert err.value.location.endswith(other) and failures["left"] == 7
    assert not open_storage(other).is_file("model_index.json")


def test_download_dir_refuses_a_folder_without_its_marker_or_without_files(s3_env, tmp_path):
    from vidray.storage import download_dir, upload_dir

    uri = f"s3://vidray-test/{uuid.uuid4().hex[:8]}/diffusers"
    upload_dir(_folder(tmp_path / "export", {"w.bin": b"w"}), uri)  # no marker: an interrupted export
    with pytest.raises(UserFileNotFound, match=rf"{uri} has no model_index.json"):
        download_dir(uri, tmp_path / "back", marker="model_index.json")
    with pytest.raises(UserFileNotFound, match="holds no file"):
        download_dir(f"s3://vidray-test/{uuid.uuid4().hex[:8]}/nothing", tmp_path / "back2")


def test_download_dir_repeats_a_download_when_the_folder_was_replaced_meanwhile(s3_env, tmp_path, monkeypatch):
    from vidray import storage as storage_mod
    from vidray.storage import download_dir, upload_dir

    uri = f"s3://vidray-test/{uuid.uuid4().hex[:8]}/diffusers"
    upload_dir(_folder(tmp_path / "v1", {"model_index.json": b"1", "w.bin": b"old"}), uri, marker="model_index.json")
    real_get = storage_mod._get_file
    replaced = {"done": False}

    def get_then_replace(storage, rel, target):
        size = real_get(storage, rel, target)
        if rel == "w.bin" and not replaced["done"]:  # a new export lands while the old one is being read
            replaced["done"] = True
            upload_dir(_folder(tmp_path / "v2", {"model_index.json": b"22", "w.bin": b"new"}), uri,
                       marker="model_index.json")
        return size

    monkeypatch.setattr(storage_mod, "_get_file", get_then_replace)
    download_dir(uri, tmp_path / "back", marker="model_index.json", backoff_s=0.01)
    assert (tmp_path / "back" / "w.bin").read_bytes() == b"new"
    assert (tmp_path / "back" / "model_index.json").read_bytes() == b"22"


def test_upload_dir_to_a_local_folder_gives_the_same_files(tmp_path):
    from vidray.storage import download_dir, upload_dir

    files = {"manifest.json": b"{}", "part.bin": b"p" * 1000}
    upload_dir(_folder(tmp_path / "src", files), tmp_path / "dst", marker="manifest.json")
    download_dir(tmp_path / "dst", tmp_path / "back", marker="manifest.json")
    assert {rel: (tmp_path / "back" / rel).read_bytes() for rel in files} == files


def _copy_into(folder: Path, source: Path) -> None:
    """One copy of `source` to `folder`/part.bin through `vidray.storage` (a `run_at_once` action)."""
    from vidray.storage import _put_file

    _put_file(open_storage(folder), "part.bin", source)


def test_local_copies_of_one_file_by_several_processes_at_once_all_succeed(tmp_path):
    """The other local writer of `vidray.storage` (`upload_dir`'s copies) with the fault of the latent
    cache's writes (one temp name for every writer: a second rename raised FileNotFoundError): 3 processes copy
    one file to the same target 200 times each, started together."""
    source = tmp_path / "source.bin"
    source.write_bytes(b"p" * 4096)
    (tmp_path / "dst").mkdir()
    assert run_at_once(_copy_into, tmp_path / "dst", source, repeats=200) == []
    assert [p.name for p in (tmp_path / "dst").iterdir()] == ["part.bin"]  # no temp file left
    assert (tmp_path / "dst" / "part.bin").read_bytes() == b"p" * 4096


def test_a_model_uri_is_downloaded_once_and_fetched_again_after_a_new_export(s3_env, tmp_path, monkeypatch):
    from vidray import storage as storage_mod
    from vidray.storage import upload_dir
    from vidray.models.export import fetch_model

    monkeypatch.setenv("VIDRAY_MODEL_CACHE", str(tmp_path / "cache"))
    uri = f"s3://vidray-test/{uuid.uuid4().hex[:8]}/diffusers"
    upload_dir(_folder(tmp_path / "v1", {"model_index.json": b"{}", "transformer/w.bin": b"one"}), uri,
               marker="model_index.json")
    downloads = []
    real_download = storage_mod.download_dir
    monkeypatch.setattr(storage_mod, "download_dir", lambda *a, **k: downloads.append(a[0]) or real_download(*a, **k))
    first = fetch_model(uri)
    assert first.parent == tmp_path / "cache" and (first / "transformer" / "w.bin").read_bytes() == b"one"
    assert fetch_model(uri) == first and downloads == [uri]  # unchanged: the cached copy, no second download
    upload_dir(_folder(tmp_path / "v2", {"model_index.json": b'{"v": 2}', "transformer/w.bin": b"two"}), uri,
               marker="model_index.json")
    second = fetch_model(uri)
    assert second != first and (second / "transformer" / "w.bin").read_bytes() == b"two" and len(downloads) == 2
    assert sorted(p.name for p in (tmp_path / "cache").iterdir()) == sorted([first.name, second.name])  # no temp


def test_a_model_uri_without_a_model_is_refused_with_the_uri_before_any_download(s3_env, tmp_path, monkeypatch):
    from vidray.storage import upload_dir
    from vidray.generate import GenerateArgumentError, check_generate_args
    from vidray.models.export import ModelFolderError, inspect_model

    monkeypatch.setenv("VIDRAY_MODEL_CACHE", str(tmp_path / "cache"))
    missing = f"s3://vidray-test/{uuid.uuid4().hex[:8]}/diffusers"
    with pytest.raises(GenerateArgumentError, match=rf"--model: model {missing} does not exist"):
        check_generate_args(missing, "a horse", tmp_path / "out.mp4")
    unfinished = f"s3://vidray-test/{uuid.uuid4().hex[:8]}/diffusers"
    upload_dir(_folder(tmp_path / "parts", {"transformer/w.bin": b"w"}), unfinished)  # the marker never arrived
    with pytest.raises(ModelFolderError, match=rf"model {unfinished} is neither a diffusers folder"):
        inspect_model(unfinished)
    assert not (tmp_path / "cache").exists()


def test_an_unreachable_model_store_is_a_user_error_naming_the_uri(monkeypatch):
    from vidray.models.export import ModelDownloadError, inspect_model

    port = 1  # nothing listens there
    monkeypatch.setenv("AWS_ENDPOINT_URL", f"http://127.0.0.1:{port}")
    monkeypatch.setenv("AWS_ACCESS_KEY_ID", "testing")
    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", "testing")
    monkeypatch.setenv("AWS_DEFAULT_REGION", "us-east-1")
    monkeypatch.setattr("vidray.storage.S3_MAX_ATTEMPTS", 1)
    with pytest.raises(ModelDownloadError,
                       match=r"model s3://vidray-test/x/diffusers cannot be read.*AWS_ENDPOINT_URL"):
        inspect_model("s3://vidray-test/x/diffusers")


def test_an_s3_storage_path_gives_ray_train_vidrays_filesystem_and_the_path_without_its_scheme(s3_env, tmp_path):
    from vidray.config import load_job_config
    from vidray.train.trainer import build_trainer_configs

    repo = Path(__file__).resolve().parents[2]
    job = load_job_config(repo / "jobs/configs/tiny_t2v.yaml", ["storage.path=s3://vidray-test/runs"])
    _, run = build_trainer_configs(job, "s3://vidray-test/runs")
    assert run.storage_path == "vidray-test/runs" and isinstance(run.storage_filesystem, pafs.S3FileSystem)
    assert run.storage_filesystem.__reduce__()[1][0]["endpoint_override"] == s3_env.split("://", 1)[1]
    _, local_run = build_trainer_configs(job, str(tmp_path / "runs"))
    assert local_run.storage_path == str(tmp_path / "runs") and local_run.storage_filesystem is None


def test_check_reachable_names_the_setting_and_the_fault_and_leaves_no_probe_object(s3_env):
    from vidray.errors import UserError

    uri = _fresh_uri()
    open_storage(uri).check_reachable("storage.path", write=True)
    assert open_storage(uri).files() == set()  # the probe object was deleted again
    with pytest.raises(UserError, match=rf"^storage.path s3://nobucket-x/runs: bucket 'nobucket-x' does not exist "
                                        rf"\(or these credentials cannot see it\) at {s3_env}, from AWS_ENDPOINT_URL; "
                                        "create the bucket or fix the URI$"):
        open_storage("s3://nobucket-x/runs").check_reachable("storage.path")


def test_an_unreachable_endpoint_is_one_line_naming_the_setting_and_the_endpoint(monkeypatch):
    from vidray.errors import UserError

    monkeypatch.setenv("AWS_ENDPOINT_URL", "http://127.0.0.1:1")  # nothing listens there
    monkeypatch.setattr("vidray.storage.S3_MAX_ATTEMPTS", 1)
    with pytest.raises(UserError, match=r"^data.shards_dir s3://vidray-test/shards: cannot reach the object store "
                                        r"\(.*NETWORK_CONNECTION.*\); check the endpoint \(http://127.0.0.1:1, from "
                                        r"AWS_ENDPOINT_URL\), the network and the credentials$") as first:
        open_storage("s3://vidray-test/shards").check_reachable("data.shards_dir")
    # The next location in that bucket reuses the failure (a new user's trial: the doctor spent ~10 s of the SDK's
    # retries on each of its three lines); after UNREACHABLE_MEMO_S it is probed again.
    from vidray import storage

    memo = "http://127.0.0.1:1, from AWS_ENDPOINT_URL vidray-test"
    failed_at = storage._UNREACHABLE[memo][0]
    with pytest.raises(UserError) as second:
        open_storage("s3://vidray-test/runs").check_reachable("storage.path", write=True)
    assert str(second.value) == str(first.value).replace("data.shards_dir s3://vidray-test/shards",
                                                         "storage.path s3://vidray-test/runs")
    assert storage._UNREACHABLE[memo][0] == failed_at  # not probed again
    monkeypatch.setattr(storage, "UNREACHABLE_MEMO_S", 0.0)
    with pytest.raises(UserError):
        open_storage("s3://vidray-test/runs").check_reachable("storage.path")
    assert storage._UNREACHABLE[memo][0] > failed_at  # probed again


def test_prepare_to_a_missing_bucket_is_refused_before_any_clip_is_probed(samples_dir, s3_env, capsys):
    from vidray.cli import main

    repo = Path(__file__).resolve().parents[2]
    code = main(["prepare", str(repo / "jobs/configs/tiny_t2v.yaml"), f"data.source={samples_dir / 'metadata.json'}",
                 "data.shards_dir=s3://nobucket-x/shards"])
    out, err = capsys.readouterr()
    assert code == 2 and "kept" not in out  # no `[1/6] kept ...` line: nothing was probed or encoded
    assert err.strip() == (f"vidray prepare: error: data.shards_dir s3://nobucket-x/shards: bucket 'nobucket-x' does "
                           f"not exist (or these credentials cannot see it) at {s3_env}, from AWS_ENDPOINT_URL; "
                           "create the bucket or fix the URI")


def test_train_refuses_an_s3_storage_path_in_a_missing_bucket_before_preparing_or_starting_ray(
        local_and_s3, s3_env, capsys, tmp_path):
    import ray

    from vidray.cli import main

    _, uri, _ = local_and_s3
    repo = Path(__file__).resolve().parents[2]
    fresh = _fresh_uri()
    code = main(["train", str(repo / "jobs/configs/tiny_t2v.yaml"), "--prepare", f"data.shards_dir={fresh}",
                 "storage.path=s3://nobucket-x/runs", "train.max_steps=1"])
    out, err = capsys.readouterr()
    assert code == 2 and not ray.is_initialized()
    assert "kept" not in out and not open_storage(fresh).is_file(INDEX_NAME)  # refused before --prepare prepared
    assert err.startswith("vidray train: error: storage.path s3://nobucket-x/runs: bucket 'nobucket-x' does not exist")
    code = main(["train", str(repo / "jobs/configs/tiny_t2v.yaml"), f"data.shards_dir={uri}",
                 f"data.latent_cache={tmp_path / 'latents'}", "storage.path=s3://nobucket-x/runs"])
    assert code == 2 and not ray.is_initialized()
    assert "storage.path s3://nobucket-x/runs: bucket 'nobucket-x' does not exist" in capsys.readouterr().err


@pytest.mark.parametrize("command", [["prepare", "--encode"], ["encode"]])
def test_a_latent_cache_in_a_missing_bucket_is_refused_before_preparing_or_starting_ray(local_and_s3, capsys,
                                                                                       command):
    import ray

    from vidray.cli import main

    _, uri, _ = local_and_s3
    repo = Path(__file__).resolve().parents[2]
    code = main([*command, str(repo / "jobs/configs/tiny_t2v.yaml"), f"data.shards_dir={uri}",
                 "data.latent_cache=s3://nobucket-x/latents"])
    out, err = capsys.readouterr()
    assert code == 2 and not ray.is_initialized() and "kept" not in out
    assert err.startswith(f"vidray {command[0]}: error: data.latent_cache s3://nobucket-x/latents: bucket "
                          "'nobucket-x' does not exist")


def test_a_resume_from_in_a_missing_bucket_is_one_line_naming_the_setting(local_and_s3, tmp_path):
    from vidray.config import load_job_config
    from vidray.errors import UserError
    from vidray.train.trainer import check_job_inputs

    _, uri, _ = local_and_s3
    repo = Path(__file__).resolve().parents[2]
    job = load_job_config(repo / "jobs/configs/tiny_t2v.yaml", [
        f"data.shards_dir={uri}", f"storage.path={tmp_path / 'runs'}", f"data.latent_cache={tmp_path / 'latents'}",
        "checkpoint.resume_from=s3://nobucket-x/runs/tiny-t2v/checkpoint_000002"])
    with pytest.raises(UserError, match=r"^checkpoint.resume_from s3://nobucket-x/runs/tiny-t2v: bucket 'nobucket-x' "
                                        r"does not exist"):
        check_job_inputs(job)


def _put_raw_key(endpoint: str, key: str, data: bytes) -> None:
    """Write `key` into the test bucket as is (boto3 does not normalize `..`), as a hostile writer of the bucket
    could."""
    import boto3

    boto3.client("s3", endpoint_url=endpoint, aws_access_key_id="testing", aws_secret_access_key="testing",
                 region_name="us-east-1").put_object(Bucket="vidray-test", Key=key, Body=data)


@pytest.mark.parametrize("bad_key", ["a/../../x", "a//x", "./x"])
def test_a_bucket_key_that_would_leave_the_local_folder_is_refused_and_nothing_is_written(
        s3_env, tmp_path, monkeypatch, bad_key):
    from vidray.storage import UnsafePathError, download_dir
    from vidray.models.export import fetch_model

    monkeypatch.setenv("VIDRAY_MODEL_CACHE", str(tmp_path / "cache" / "models"))
    prefix = f"{uuid.uuid4().hex[:8]}/diffusers"
    _put_raw_key(s3_env, f"{prefix}/model_index.json", b"{}")
    _put_raw_key(s3_env, f"{prefix}/{bad_key}", b"planted")
    uri = f"s3://vidray-test/{prefix}"
    assert any(bad_key in rel for rel in open_storage(uri).files())  # the store lists the key as written
    with pytest.raises(UnsafePathError) as err:
        fetch_model(uri)  # the path serving and `vidray generate` take for an s3:// model
    assert repr(bad_key) in str(err.value) and "would leave" in str(err.value) and "\n" not in str(err.value)
    with pytest.raises(UnsafePathError):
        download_dir(uri, tmp_path / "cache" / "plain", marker="model_index.json")
    assert not [p for p in tmp_path.rglob("*") if p.is_file() and p.read_bytes() == b"planted"]
