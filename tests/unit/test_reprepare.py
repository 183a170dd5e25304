"""A re-prepare loses nothing: the committed dataset stays readable, byte for byte, until the new index replaces it.

Each test starts from a good dataset, interrupts or finishes a re-prepare of a bigger source in the same folder,
and compares what the readers see with what they saw before.
"""

from __future__ import annotations

import errno
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest

import vidray.data.shards as shards
from vidray.data.format import content_hash
from vidray.data.ingest import prepare
from vidray.data.shards import (
    INDEX_NAME,
    LOCK_NAME,
    ShardWriter,
    listed_files,
    load_samples,
    read_index,
    read_report,
    remove_unlisted,
)
from vidray.errors import UserError

REPO_ROOT = Path(__file__).resolve().parents[2]
BUCKETS = [[9, 64, 64], [1, 64, 64]]
FPS = 8.0


def _bigger_source(samples_dir: Path, folder: Path, copies: int) -> Path:
    """The six samples listed `copies` times (absolute paths, a caption per copy): a longer prepare."""
    entries = json.loads((samples_dir / "metadata.json").read_text())
    bigger = [
        {**entry, "file_path": str(samples_dir / entry["file_path"]), "text": f"{entry['text']} (copy {copy})"}
        for copy in range(copies)
        for entry in entries
    ]
    path = folder / "bigger.json"
    path.write_text(json.dumps(bigger))
    return path


def _snapshot(shards_dir: Path) -> dict:
    """What readers see: the index, the report, and every decoded sample."""
    samples = load_samples(shards_dir)
    return {
        "index": read_index(shards_dir),
        "report": read_report(shards_dir),
        "sample_ids": [s.sample_id for s in samples],
        "captions": [s.caption for s in samples],
        "videos": [s.video for s in samples],
    }


def _assert_same_dataset(shards_dir: Path, before: dict) -> None:
    after = _snapshot(shards_dir)
    assert after["index"]["content_hash"] == before["index"]["content_hash"]
    assert after["index"] == before["index"]
    assert after["report"] == before["report"]
    assert after["sample_ids"] == before["sample_ids"] and after["captions"] == before["captions"]
    assert all(np.array_equal(a, b) for a, b in zip(after["videos"], before["videos"], strict=True))


def _files(shards_dir: Path) -> set[str]:
    return {str(p.relative_to(shards_dir)) for p in shards_dir.rglob("*") if p.is_file()}


@pytest.fixture
def good_dataset(tmp_path, samples_dir) -> tuple[Path, dict]:
    shards_dir = tmp_path / "shards"
    summary = prepare(samples_dir / "metadata.json", shards_dir, BUCKETS, FPS, samples_per_shard=2, progress=None)
    assert summary.num_kept == 6
    return shards_dir, _snapshot(shards_dir)


@pytest.mark.slow
def test_a_sigkilled_vidray_prepare_leaves_the_old_dataset_exactly(tmp_path, samples_dir, good_dataset):
    shards_dir, before = good_dataset
    source = _bigger_source(samples_dir, tmp_path, copies=10)
    vidray = Path(sys.executable).with_name("vidray")
    command = [str(vidray), "prepare", str(REPO_ROOT / "jobs" / "configs" / "tiny_t2v.yaml"),
               f"data.source={source}", f"data.shards_dir={shards_dir}", "data.samples_per_shard=1"]
    env = {**os.environ, "HF_HUB_OFFLINE": "1"}
    first_new_shard = shards_dir / "gen.00002" / "shard.00000.parquet"
    with subprocess.Popen(command, cwd=tmp_path, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT) as proc:
        deadline = time.monotonic() + 120
        while not first_new_shard.exists() and proc.poll() is None and time.monotonic() < deadline:
            time.sleep(0.02)
        if not first_new_shard.exists():
            proc.kill()
            pytest.fail(f"no new shard appeared; vidray prepare said:\n{proc.stdout.read().decode()[-3000:]}")
        # While it runs, a second prepare on the folder is refused (it would delete the running one's files).
        with pytest.raises(UserError, match="another `vidray prepare` is writing"):
            prepare(samples_dir / "metadata.json", shards_dir, BUCKETS, FPS, samples_per_shard=2, progress=None)
        proc.send_signal(signal.SIGKILL)
        proc.wait(timeout=30)
    assert proc.returncode == -signal.SIGKILL, "prepare finished before it was killed: use a bigger source"
    assert (shards_dir / "gen.00002").is_dir()  # the killed prepare's orphans are there ...
    _assert_same_dataset(shards_dir, before)  # ... and readers see the old dataset exactly

    # The next prepare (in this process: the killed one's lock died with it) removes the orphans.
    summary = prepare(_bigger_source(samples_dir, tmp_path, copies=2), shards_dir, BUCKETS, FPS,
                      samples_per_shard=16, progress=None)
    assert summary.num_kept == 12 and read_index(shards_dir)["generation"] == 3
    assert not (shards_dir / "gen.00001").exists() and not (shards_dir / "gen.00002").exists()


def test_a_finished_reprepare_leaves_only_what_the_new_index_lists(tmp_path, samples_dir, good_dataset):
    shards_dir, before = good_dataset
    old_files = set(listed_files(before["index"]))
    (shards_dir / "my_notes.txt").write_text("files vidray did not write stay")
    summary = prepare(_bigger_source(samples_dir, tmp_path, copies=2), shards_dir, BUCKETS, FPS,
                      samples_per_shard=5, progress=None)
    index = read_index(shards_dir)
    assert summary.num_kept == 12 and index["num_samples"] == 12 and index["generation"] == 2
    assert _files(shards_dir) == {INDEX_NAME, LOCK_NAME, "my_notes.txt", *listed_files(index)}
    assert listed_files(index) == [f"gen.00002/shard.0000{i}.parquet" for i in range(3)] + [
        "gen.00002/report.json", "gen.00002/samples.parquet"]
    assert not old_files & _files(shards_dir)
    assert read_report(shards_dir)["num_kept"] == 12 and summary.report_path == shards_dir / "gen.00002/report.json"
    assert len({s.sample_id for s in load_samples(shards_dir)}) == 12


def test_a_reprepare_replaces_a_folder_prepared_before_generations(tmp_path, samples_dir, good_dataset):
    """Folders written by earlier vidray (shard.NNNNN.parquet and report.json beside index.json) still read,
    and a re-prepare removes their files once its own index is committed."""
    shards_dir, before = good_dataset
    legacy = dict(before["index"])
    legacy.pop("generation"), legacy.pop("report"), legacy.pop("samples")
    for entry in legacy["shards"]:
        (shards_dir / entry["file"]).rename(shards_dir / Path(entry["file"]).name)
    (shards_dir / "gen.00001" / "report.json").rename(shards_dir / "report.json")
    (shards_dir / "gen.00001" / "samples.parquet").unlink()  # folders of earlier vidray had no sample table
    (shards_dir / "gen.00001").rmdir()
    legacy["shards"] = [{**entry, "file": Path(entry["file"]).name} for entry in legacy["shards"]]
    legacy["content_hash"] = content_hash(legacy)
    (shards_dir / INDEX_NAME).write_text(json.dumps(legacy))
    assert [s.sample_id for s in load_samples(shards_dir)] == before["sample_ids"]
    assert shards.report_path(shards_dir) == shards_dir / "report.json"

    prepare(samples_dir / "metadata.json", shards_dir, BUCKETS, FPS, samples_per_shard=64, progress=None)
    assert _files(shards_dir) == {INDEX_NAME, LOCK_NAME, "gen.00001/shard.00000.parquet", "gen.00001/report.json",
                                  "gen.00001/shard.00001.parquet", "gen.00001/samples.parquet"}  # one per bucket
    assert sorted(s.sample_id for s in load_samples(shards_dir)) == sorted(before["sample_ids"])


def test_ctrl_c_during_a_reprepare_leaves_the_old_dataset_readable(tmp_path, samples_dir, good_dataset):
    shards_dir, before = good_dataset
    lines: list[str] = []

    def progress(line: str) -> None:  # the user presses Ctrl-C while the fourth file is being stored
        lines.append(line)
        if len(lines) == 4:
            raise KeyboardInterrupt

    with pytest.raises(KeyboardInterrupt):
        prepare(_bigger_source(samples_dir, tmp_path, copies=3), shards_dir, BUCKETS, FPS, samples_per_shard=1,
                progress=progress, group_by_caption=False)  # a shard per clip as it comes (no grouping buffer)
    assert 3 <= len(list((shards_dir / "gen.00002").glob("shard.*.parquet"))) <= 4  # stopped mid-way (of 18)
    _assert_same_dataset(shards_dir, before)


def test_a_full_disk_during_a_reprepare_leaves_the_old_dataset_and_the_next_prepare_cleans_up(
    tmp_path, samples_dir, good_dataset, monkeypatch
):
    shards_dir, before = good_dataset
    real_write_table = shards.pq.write_table
    calls = []

    def write_table(table, where, **kwargs):  # the third shard's write finds the disk full, half written
        calls.append(where)
        if len(calls) == 3:
            Path(where).write_bytes(b"PAR1 half a shard")
            raise OSError(errno.ENOSPC, "No space left on device")
        return real_write_table(table, where, **kwargs)

    monkeypatch.setattr(shards.pq, "write_table", write_table)
    bigger = _bigger_source(samples_dir, tmp_path, copies=2)
    with pytest.raises(OSError, match="No space left"):
        prepare(bigger, shards_dir, BUCKETS, FPS, samples_per_shard=1, progress=None)
    assert (shards_dir / "gen.00002" / ".shard.00002.parquet.tmp").is_file()
    _assert_same_dataset(shards_dir, before)

    monkeypatch.setattr(shards.pq, "write_table", real_write_table)
    summary = prepare(bigger, shards_dir, BUCKETS, FPS, samples_per_shard=8, progress=None)
    assert summary.num_kept == 12
    assert _files(shards_dir) == {INDEX_NAME, LOCK_NAME, *listed_files(read_index(shards_dir))}
    assert read_index(shards_dir)["generation"] == 3


def test_an_unreadable_index_is_never_cleaned_away(tmp_path, good_dataset):
    """A corrupt or edited index might still be recoverable: cleanup deletes nothing then."""
    shards_dir, before = good_dataset
    (shards_dir / INDEX_NAME).write_text((shards_dir / INDEX_NAME).read_text().replace('"fps": 8.0', '"fps": 9.0'))
    files = _files(shards_dir)
    assert remove_unlisted(shards_dir) == []
    with pytest.raises(UserError, match="content hash mismatch"):
        read_index(shards_dir)
    writer = ShardWriter(shards_dir)  # a new prepare may still start: it writes beside, as generation 2
    assert writer.generation == 2 and _files(shards_dir) == files
    writer.close()


def test_shard_writer_refuses_a_folder_it_cannot_create(tmp_path):
    (tmp_path / "file").write_text("not a folder")
    with pytest.raises(UserError, match="cannot create the shards folder .* set data.shards_dir"):
        ShardWriter(tmp_path / "file" / "shards")


def _all_skipped_source(folder: Path) -> Path:
    """A source whose every file is skipped (missing), the new-user trial's case."""
    path = folder / "broken.json"
    path.write_text(json.dumps([{"file_path": "gone1.mp4", "text": "a"}, {"file_path": "gone2.mp4", "text": "b"}]))
    return path


def test_a_reprepare_keeping_no_sample_commits_nothing_and_leaves_the_previous_dataset(tmp_path, good_dataset):
    shards_dir, before = good_dataset
    files_before = {p: (shards_dir / p).read_bytes() for p in _files(shards_dir)}
    summary = prepare(_all_skipped_source(tmp_path), shards_dir, BUCKETS, FPS, 2, progress=None)
    assert summary.num_kept == 0 and not summary.committed
    _assert_same_dataset(shards_dir, before)
    assert read_index(shards_dir)["num_samples"] == 6  # was 0 before the fix: the good dataset was deleted
    failed = shards_dir / "last_failed_report.json"
    assert {p: (shards_dir / p).read_bytes() for p in _files(shards_dir) - {failed.name}} == files_before
    assert not (shards_dir / "gen.00002").exists()  # the new generation's files are removed
    text = str(summary)
    assert f"nothing committed; the previous dataset in {shards_dir} is unchanged" in text
    assert "gone1.mp4: " in text and "gone2.mp4: " in text  # the skip reasons stay visible
    report = json.loads(failed.read_text())
    assert report["committed"] is False and [s["path"] for s in report["skipped"]] == [
        str(tmp_path / "gone1.mp4"), str(tmp_path / "gone2.mp4")]
    assert summary.report_path == failed


def test_a_committing_prepare_removes_the_stale_failed_report(tmp_path, samples_dir, good_dataset):
    shards_dir, _ = good_dataset
    prepare(_all_skipped_source(tmp_path), shards_dir, BUCKETS, FPS, 2, progress=None)
    assert (shards_dir / "last_failed_report.json").exists()
    summary = prepare(samples_dir / "metadata.json", shards_dir, BUCKETS, FPS, 64, progress=None)
    assert summary.committed and read_index(shards_dir)["generation"] == 2  # the aborted one was never visible
    assert not (shards_dir / "last_failed_report.json").exists()


def test_vidray_prepare_exits_1_when_nothing_is_committed(tmp_path, good_dataset, capsys):
    from vidray.cli import main

    shards_dir, before = good_dataset
    status = main(["prepare", str(REPO_ROOT / "jobs" / "configs" / "tiny_t2v.yaml"),
                   f"data.source={_all_skipped_source(tmp_path)}", f"data.shards_dir={shards_dir}"])
    assert status == 1
    assert "nothing committed; the previous dataset" in capsys.readouterr().out
    _assert_same_dataset(shards_dir, before)


def test_train_with_prepare_stops_with_1_when_the_prepare_commits_nothing(tmp_path, capsys):
    from vidray.cli import run_train_job
    from vidray.config import load_job_config

    shards_dir = tmp_path / "shards"
    job = load_job_config(REPO_ROOT / "jobs" / "configs" / "tiny_t2v.yaml",
                          [f"data.source={_all_skipped_source(tmp_path)}", f"data.shards_dir={shards_dir}"])
    assert run_train_job(job, prepare_if_missing=True) == 1  # before any Ray work
    assert "No sample was kept: nothing committed; check" in capsys.readouterr().out
    assert not (shards_dir / INDEX_NAME).exists()


def _index_listing(shards_dir: Path, entry: dict) -> None:
    """A well-formed index (content hash recomputed, as an editor of the folder could) listing one shard `entry`."""
    index = {"format": shards.FORMAT, "version": shards.FORMAT_VERSION, "generation": 1, "shards": [entry],
             "num_samples": 1}
    index["content_hash"] = content_hash(index)
    shards_dir.mkdir(parents=True, exist_ok=True)
    (shards_dir / INDEX_NAME).write_text(json.dumps(index))


GOOD_SHA = "0" * 64


@pytest.mark.parametrize("field, value", [
    ("file", "../outside.parquet"), ("file", "/etc/passwd"), ("file", ""), ("file", "gen.00001//shard.parquet"),
    ("file", "gen.00001/\x00.parquet"), ("sha256", "../../../tmp/evil"), ("sha256", "A" * 64), ("sha256", "0" * 63),
])
def test_an_index_field_that_would_leave_its_folder_is_refused_naming_the_field(tmp_path, field, value):
    from vidray.storage import UnsafePathError

    shards_dir = tmp_path / "shards"
    _index_listing(shards_dir, {"file": "gen.00001/shard.00000.parquet", "sha256": GOOD_SHA, "bytes": 1,
                                "num_samples": 1, field: value})
    with pytest.raises(UnsafePathError) as err:
        read_index(shards_dir)
    message = str(err.value)
    assert f"shards[0].{field}" in message and repr(value) in message and "\n" not in message
    assert remove_unlisted(shards_dir) == []  # an index that cannot be trusted deletes nothing either
