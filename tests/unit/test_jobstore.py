"""The durable video-job store (`vidray.serve.jobs`) on real sqlite files in tmp_path: records, OpenAI-style
pagination, exclusive claims across stores, threads and processes, leases, retries and the video files."""

from __future__ import annotations

import io
import multiprocessing
import sqlite3
import threading
import time
from pathlib import Path

import pytest
from PIL import Image

from vidray.serve.jobs import JOB_STATUSES, JobStore, QueueFullError, VideoJob, is_job_id

OPENAI_VIDEO_KEYS = {
    "id", "object", "created_at", "status", "progress", "model", "seconds", "size", "prompt", "completed_at",
    "expires_at", "error", "remixed_from_video_id",
}
PARAMS = {"num_frames": 9, "seed": 7, "num_inference_steps": 2, "guidance_scale": 1.0, "negative_prompt": "",
          "fps": 8}


def _create(store: JobStore, prompt: str = "a red ball", **kwargs) -> VideoJob:
    return store.create(model="tiny", prompt=prompt, size="64x64", seconds="1.125", params=PARAMS, **kwargs)


def _png_bytes() -> bytes:
    buf = io.BytesIO()
    Image.new("RGB", (16, 16), (200, 30, 30)).save(buf, format="PNG")
    return buf.getvalue()


def _write_mp4(path: Path) -> Path:
    # The store moves bytes, it does not decode them: any file stands in for an mp4 here.
    path.write_bytes(b"\x00\x00\x00\x18ftypmp42" + b"x" * 100)
    return path


# ---------------------------------------------------------------- records


def test_create_stores_a_queued_job_that_get_returns(tmp_path):
    store = JobStore(tmp_path)
    job = _create(store)
    assert is_job_id(job.id) and job.id.startswith("video_")
    assert (job.status, job.progress, job.attempts, job.owner, job.error) == ("queued", 0, 0, None, None)
    assert abs(job.created_at - time.time()) < 5
    assert job.params == PARAMS and job.input_reference is None
    assert store.get(job.id) == job
    assert (tmp_path / "jobs.sqlite3").is_file() and (tmp_path / "videos").is_dir()


def test_create_stores_the_input_reference_image_under_inputs(tmp_path):
    store = JobStore(tmp_path)
    png = _png_bytes()
    job = _create(store, input_reference=png, input_suffix=".PNG")
    assert job.input_reference == str(tmp_path / "inputs" / f"{job.id}.png")
    assert Path(job.input_reference).read_bytes() == png
    assert Image.open(job.input_reference).size == (16, 16)
    assert [p.name for p in (tmp_path / "inputs").iterdir()] == [f"{job.id}.png"]  # no temp files left


def test_create_rejects_unserializable_params_and_unsafe_suffix(tmp_path):
    store = JobStore(tmp_path)
    with pytest.raises(ValueError, match="params must be JSON-serializable"):
        store.create(model="tiny", prompt="p", size="64x64", seconds="1", params={"seed": object()})
    with pytest.raises(ValueError, match="params must be JSON-serializable"):
        store.create(model="tiny", prompt="p", size="64x64", seconds="1", params={"guidance_scale": float("nan")})
    with pytest.raises(ValueError, match="input_suffix"):
        _create(store, input_reference=_png_bytes(), input_suffix="/../../x")
    with pytest.raises(TypeError, match="params must be a dict"):
        store.create(model="tiny", prompt="p", size="64x64", seconds="1", params=[1])
    assert store.list()[0] == [] and list((tmp_path / "inputs").iterdir()) == []


def test_get_returns_none_for_unknown_or_malformed_ids(tmp_path):
    store = JobStore(tmp_path)
    _create(store)
    assert store.get("video_" + "0" * 32) is None
    assert store.get("../jobs.sqlite3") is None
    assert store.get("") is None


def test_jobs_survive_reopening_the_store_in_wal_mode(tmp_path):
    job = _create(JobStore(tmp_path))
    reopened = JobStore(tmp_path)
    assert reopened.get(job.id) == job
    with sqlite3.connect(tmp_path / "jobs.sqlite3") as conn:
        assert conn.execute("PRAGMA journal_mode").fetchone()[0] == "wal"


def test_list_pages_in_creation_order_with_after_limit_order_and_has_more(tmp_path):
    store = JobStore(tmp_path)
    ids = [_create(store, prompt=f"clip {i}").id for i in range(5)]  # mostly the same second: ties by insertion

    page, has_more = store.list(limit=2)  # default order desc: newest first
    assert [j.id for j in page] == [ids[4], ids[3]] and has_more
    page, has_more = store.list(after=page[-1].id, limit=2)
    assert [j.id for j in page] == [ids[2], ids[1]] and has_more
    page, has_more = store.list(after=page[-1].id, limit=2)
    assert [j.id for j in page] == [ids[0]] and not has_more

    page, has_more = store.list(order="asc", limit=3)
    assert [j.id for j in page] == ids[:3] and has_more
    page, has_more = store.list(order="asc", after=ids[2], limit=3)
    assert [j.id for j in page] == ids[3:] and not has_more

    page, has_more = store.list(limit=5)
    assert [j.id for j in page] == ids[::-1] and not has_more
    assert store.list(after=ids[0]) == ([], False)


def test_list_orders_by_created_at_before_insertion_order(tmp_path):
    store = JobStore(tmp_path)
    first, second = _create(store).id, _create(store).id
    with sqlite3.connect(tmp_path / "jobs.sqlite3") as conn:  # `first` created a minute later than `second`
        conn.execute("UPDATE jobs SET created_at = created_at + 60 WHERE id = ?", (first,))
    assert [j.id for j in store.list(order="asc")[0]] == [second, first]
    assert [j.id for j in store.list(order="desc")[0]] == [first, second]


def test_list_rejects_unknown_cursor_bad_limit_and_bad_order(tmp_path):
    store = JobStore(tmp_path)
    _create(store)
    with pytest.raises(LookupError, match="after='video_0+' is not the id of a stored video"):
        store.list(after="video_" + "0" * 32)
    with pytest.raises(ValueError, match=r"limit must be an int in 1\.\.100, got 0"):
        store.list(limit=0)
    with pytest.raises(ValueError, match=r"limit must be an int in 1\.\.100, got 101"):
        store.list(limit=101)
    with pytest.raises(ValueError, match="order must be 'asc' or 'desc', got 'newest'"):
        store.list(order="newest")


def test_counts_reports_every_status(tmp_path):
    store = JobStore(tmp_path)
    for _ in range(3):
        _create(store)
    store.claim("runner-a", lease_s=30)
    assert store.counts() == {"queued": 2, "in_progress": 1, "completed": 0, "failed": 0}
    assert tuple(store.counts()) == JOB_STATUSES


# ---------------------------------------------------------------- claims


def test_claim_takes_the_oldest_queued_job_and_leases_it(tmp_path):
    store = JobStore(tmp_path)
    first, second = _create(store), _create(store)
    before = time.time()
    job = store.claim("runner-a", lease_s=30)
    assert job.id == first.id
    assert (job.status, job.attempts, job.owner, job.progress) == ("in_progress", 1, "runner-a", 0)
    assert before + 30 <= job.lease_until <= time.time() + 30
    assert store.claim("runner-b", lease_s=30).id == second.id
    assert store.claim("runner-c", lease_s=30) is None


def test_claim_rejects_bad_owner_and_lease(tmp_path):
    store = JobStore(tmp_path)
    _create(store)
    with pytest.raises(ValueError, match="lease_s must be a finite number of seconds > 0, got 0"):
        store.claim("runner-a", lease_s=0)
    with pytest.raises(ValueError, match="owner must be a non-empty string"):
        store.claim("", lease_s=10)
    assert store.counts()["queued"] == 1


def test_claim_is_exclusive_across_two_stores_on_one_file(tmp_path):
    store_a, store_b = JobStore(tmp_path), JobStore(tmp_path)
    created = {_create(store_a).id for _ in range(6)}
    claimed = []
    for _ in range(4):
        for store, owner in ((store_a, "a"), (store_b, "b")):
            job = store.claim(owner, lease_s=30)
            if job is not None:
                claimed.append(job.id)
    assert sorted(claimed) == sorted(created)  # each job exactly once
    assert {j.owner for j in store_a.list(limit=10)[0]} == {"a", "b"}


def test_claim_is_exclusive_across_two_threads_with_20_jobs_each(tmp_path):
    store = JobStore(tmp_path)
    created = {_create(store).id for _ in range(40)}
    claimed: dict[str, list[str]] = {"t0": [], "t1": []}
    errors: list[BaseException] = []
    start = threading.Barrier(2)

    def runner(owner: str) -> None:
        try:
            own_store = JobStore(tmp_path) if owner == "t1" else store
            start.wait()
            while (job := own_store.claim(owner, lease_s=30)) is not None:
                claimed[owner].append(job.id)
        except BaseException as exc:  # surfaced below: "database is locked" must not happen
            errors.append(exc)

    threads = [threading.Thread(target=runner, args=(owner,)) for owner in claimed]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=30)
    assert errors == []
    all_claimed = claimed["t0"] + claimed["t1"]
    assert len(all_claimed) == 40 and set(all_claimed) == created
    jobs = store.list(limit=40)[0]
    assert all(j.attempts == 1 and j.status == "in_progress" for j in jobs)
    assert {j.id for j in jobs if j.owner == "t0"} == set(claimed["t0"])


def _claim_in_child(root: str, owner: str, start, results) -> None:
    """Runs in a spawned process: claim until no job is left, report the ids (or the error) on `results`."""
    try:
        store = JobStore(root)
        start.wait(timeout=30)
        ids = []
        while (job := store.claim(owner, lease_s=30)) is not None:
            ids.append(job.id)
        results.put(("ok", ids))
    except BaseException as exc:
        results.put(("error", repr(exc)))


def test_claim_is_exclusive_against_a_second_process(tmp_path):
    store = JobStore(tmp_path)
    created = {_create(store).id for _ in range(40)}
    ctx = multiprocessing.get_context("spawn")
    start, results = ctx.Event(), ctx.Queue()
    child = ctx.Process(target=_claim_in_child, args=(str(tmp_path), "child", start, results))
    child.start()
    try:
        time.sleep(0.05)
        start.set()
        mine = []
        while (job := store.claim("parent", lease_s=30)) is not None:
            mine.append(job.id)
        kind, theirs = results.get(timeout=30)
    finally:
        child.join(timeout=30)
        if child.is_alive():
            child.kill()
    assert kind == "ok", theirs
    assert child.exitcode == 0
    assert len(mine) + len(theirs) == 40 and set(mine) | set(theirs) == created
    jobs = store.list(limit=40)[0]
    assert all(j.attempts == 1 for j in jobs)
    assert {j.id for j in jobs if j.owner == "child"} == set(theirs)


# ---------------------------------------------------------------- leases and progress


def test_heartbeat_updates_progress_and_lease_and_never_lowers_progress(tmp_path):
    store = JobStore(tmp_path)
    job_id = _create(store).id
    store.claim("runner-a", lease_s=1)
    assert store.heartbeat(job_id, "runner-a", progress=40, lease_s=60)
    job = store.get(job_id)
    assert job.progress == 40 and job.lease_until > time.time() + 50
    assert store.heartbeat(job_id, "runner-a", progress=10, lease_s=60)
    assert store.get(job_id).progress == 40
    assert store.heartbeat(job_id, "runner-a", progress=75, lease_s=60)
    assert store.get(job_id).progress == 75
    with pytest.raises(ValueError, match="progress must be an int percentage in 0..100, got 101"):
        store.heartbeat(job_id, "runner-a", progress=101, lease_s=60)


def test_heartbeat_returns_false_after_delete(tmp_path):
    store = JobStore(tmp_path)
    job_id = _create(store).id
    store.claim("runner-a", lease_s=30)
    assert store.delete(job_id)
    assert not store.heartbeat(job_id, "runner-a", progress=50, lease_s=30)
    assert store.get(job_id) is None


def test_a_runner_that_lost_its_lease_cannot_change_the_reclaimed_job(tmp_path):
    store = JobStore(tmp_path)
    job_id = _create(store).id
    store.claim("runner-a", lease_s=5)
    assert store.recover_expired(now=time.time() + 10) == [(job_id, "queued")]
    assert store.claim("runner-b", lease_s=30).attempts == 2

    assert not store.heartbeat(job_id, "runner-a", progress=90, lease_s=30)
    assert not store.complete(job_id, "runner-a", _write_mp4(tmp_path / "stale.mp4"))
    assert not store.fail(job_id, "runner-a", "oom", "out of memory")
    assert store.release(job_id, "runner-a", code="stage_died", message="denoiser died") is None
    job = store.get(job_id)
    assert (job.status, job.owner, job.progress) == ("in_progress", "runner-b", 0)
    assert (tmp_path / "stale.mp4").is_file() and store.video_path(job_id) is None
    assert store.heartbeat(job_id, "runner-b", progress=20, lease_s=30)


# ---------------------------------------------------------------- outcomes


def test_complete_moves_the_video_in_and_video_path_returns_it(tmp_path):
    store = JobStore(tmp_path / "store")
    job_id = _create(store).id
    assert store.video_path(job_id) is None  # queued: no video yet
    store.claim("runner-a", lease_s=30)
    store.heartbeat(job_id, "runner-a", progress=60, lease_s=30)
    rendered = _write_mp4(tmp_path / "render.mp4")
    content = rendered.read_bytes()

    assert store.complete(job_id, "runner-a", rendered)
    assert not rendered.exists()
    path = store.video_path(job_id)
    assert path == tmp_path / "store" / "videos" / f"{job_id}.mp4" and path.read_bytes() == content
    job = store.get(job_id)
    assert (job.status, job.progress, job.lease_until) == ("completed", 100, None)
    assert abs(job.completed_at - time.time()) < 5


def test_complete_of_a_missing_file_raises_and_leaves_the_job_running(tmp_path):
    store = JobStore(tmp_path)
    job_id = _create(store).id
    store.claim("runner-a", lease_s=30)
    with pytest.raises(FileNotFoundError, match="does not exist; write the mp4 before complete"):
        store.complete(job_id, "runner-a", tmp_path / "nope.mp4")
    assert store.get(job_id).status == "in_progress"


def test_a_finished_job_is_never_changed_again(tmp_path):
    store = JobStore(tmp_path)
    done_id, failed_id = _create(store).id, _create(store).id
    store.claim("runner-a", lease_s=1)
    store.claim("runner-a", lease_s=1)
    assert store.complete(done_id, "runner-a", _write_mp4(tmp_path / "a.mp4"))
    assert store.fail(failed_id, "runner-a", "bad_request", "num_frames 10 cannot be made")
    before = {j.id: j for j in store.list()[0]}

    for job_id in (done_id, failed_id):
        assert not store.heartbeat(job_id, "runner-a", progress=5, lease_s=30)
        assert not store.complete(job_id, "runner-a", _write_mp4(tmp_path / "b.mp4"))
        assert not store.fail(job_id, "runner-a", "late", "late failure")
        assert store.release(job_id, "runner-a", code="late", message="late release") is None
    assert store.recover_expired(now=time.time() + 3600) == []
    assert store.claim("runner-b", lease_s=30) is None
    assert {j.id: j for j in store.list()[0]} == before


def test_fail_marks_the_job_failed_with_its_error(tmp_path):
    store = JobStore(tmp_path)
    job_id = _create(store).id
    store.claim("runner-a", lease_s=30)
    assert store.fail(job_id, "runner-a", "invalid_frames", "num_frames must be 4k+1")
    job = store.get(job_id)
    assert job.status == "failed" and job.error == {"code": "invalid_frames", "message": "num_frames must be 4k+1"}
    assert job.completed_at is not None and store.video_path(job_id) is None
    assert job.to_openai()["error"] == {"code": "invalid_frames", "message": "num_frames must be 4k+1"}


def test_release_requeues_on_the_first_attempt_and_fails_on_the_second(tmp_path):
    store = JobStore(tmp_path, max_attempts=2)
    job_id = _create(store).id
    store.claim("runner-a", lease_s=30)
    store.heartbeat(job_id, "runner-a", progress=50, lease_s=30)

    assert store.release(job_id, "runner-a", code="stage_died", message="the denoiser replica died") == "queued"
    job = store.get(job_id)
    assert (job.status, job.progress, job.owner, job.attempts) == ("queued", 0, None, 1)
    assert job.to_openai()["error"] is None  # a retried failure is not shown while queued

    assert store.claim("runner-b", lease_s=30).attempts == 2
    assert store.release(job_id, "runner-b", code="stage_died", message="the decoder replica died") == "failed"
    job = store.get(job_id)
    assert job.status == "failed" and job.error == {"code": "stage_died", "message": "the decoder replica died"}
    assert job.completed_at is not None


def test_release_fails_at_once_when_max_attempts_is_one(tmp_path):
    store = JobStore(tmp_path, max_attempts=1)
    job_id = _create(store).id
    store.claim("runner-a", lease_s=30)
    assert store.release(job_id, "runner-a", code="stage_died", message="gone") == "failed"
    with pytest.raises(ValueError, match="max_attempts must be an int >= 1"):
        JobStore(tmp_path, max_attempts=0)


def test_requeue_hands_a_running_job_back_without_using_an_attempt(tmp_path):
    """A runner stopping in good order (its replica shut down) gives its job back whole: even on its last attempt
    the job is queued again, never failed, and the next claim is attempt 1 again."""
    store = JobStore(tmp_path, max_attempts=1)
    job_id = _create(store).id
    store.claim("runner-a", lease_s=30)
    store.heartbeat(job_id, "runner-a", progress=40, lease_s=30)
    assert store.requeue(job_id, "runner-b") is False  # not its job
    assert store.requeue(job_id, "runner-a") is True
    job = store.get(job_id)
    assert (job.status, job.progress, job.owner, job.lease_until, job.attempts) == ("queued", 0, None, None, 0)
    assert store.requeue(job_id, "runner-a") is False  # no longer running
    assert store.claim("runner-b", lease_s=30).attempts == 1
    store.complete(job_id, "runner-b", _write_mp4(tmp_path / "done.mp4"))
    assert store.requeue(job_id, "runner-b") is False and store.get(job_id).status == "completed"


def test_recover_expired_requeues_then_fails_jobs_past_their_lease(tmp_path):
    store = JobStore(tmp_path, max_attempts=2)
    lost_id, alive_id = _create(store).id, _create(store).id
    store.claim("runner-a", lease_s=10)
    store.claim("runner-b", lease_s=1000)
    assert store.recover_expired() == []  # nobody's lease ran out yet

    now = time.time() + 60
    assert store.recover_expired(now=now) == [(lost_id, "queued")]
    assert store.get(alive_id).status == "in_progress"
    assert store.claim("runner-c", lease_s=10).id == lost_id

    assert store.recover_expired(now=now + 120) == [(lost_id, "failed")]
    job = store.get(lost_id)
    assert job.status == "failed" and job.error["code"] == "runner_lost"
    assert "runner-c" in job.error["message"] and "attempt 2 of 2" in job.error["message"]
    assert store.get(alive_id).status == "in_progress"


def test_delete_removes_the_record_the_video_and_the_input_image(tmp_path):
    store = JobStore(tmp_path)
    job_id = _create(store, input_reference=_png_bytes()).id
    input_path = Path(store.get(job_id).input_reference)
    store.claim("runner-a", lease_s=30)
    store.complete(job_id, "runner-a", _write_mp4(tmp_path / "v.mp4"))
    video = store.video_path(job_id)
    assert video.is_file() and input_path.is_file()

    assert store.delete(job_id)
    assert store.get(job_id) is None and not video.exists() and not input_path.exists()
    assert store.video_path(job_id) is None
    assert not store.delete(job_id)
    assert not store.delete("not-a-job-id")


def test_to_openai_has_exactly_the_openai_video_keys(tmp_path):
    store = JobStore(tmp_path)
    job_id = _create(store).id
    body = store.get(job_id).to_openai()
    assert set(body) == OPENAI_VIDEO_KEYS
    assert body == {
        "id": job_id, "object": "video", "created_at": body["created_at"], "status": "queued", "progress": 0,
        "model": "tiny", "seconds": "1.125", "size": "64x64", "prompt": "a red ball", "completed_at": None,
        "expires_at": None, "error": None, "remixed_from_video_id": None,
    }
    openai_types = pytest.importorskip("openai.types")
    assert set(openai_types.Video.model_fields) == OPENAI_VIDEO_KEYS  # the SDK's own model, 3.57
    # Strict validation (the SDK itself parses responses leniently, so "64x64" and "tiny" pass there too) of a
    # job whose size and model are among the SDK's literals: every field has the type the SDK declares.
    strict = store.create(model="sora-2", prompt="p", size="1280x720", seconds="4", params={}).to_openai()
    video = openai_types.Video.model_validate(strict)
    assert (video.id, video.status, video.size, video.seconds) == (strict["id"], "queued", "1280x720", "4")


# ---------------------------------------------------------------- bounds (issue 27 item 2) and leases (item 4)


def test_create_beyond_the_total_or_the_clients_cap_raises_queue_full_and_stores_nothing(tmp_path):
    store = JobStore(tmp_path)
    for _ in range(2):
        _create(store, client="alice", max_unfinished=3, max_unfinished_per_client=2)
    with pytest.raises(QueueFullError, match="this client .* holds 2 unfinished .* most allowed is 2") as info:
        _create(store, client="alice", input_reference=_png_bytes(), max_unfinished=3, max_unfinished_per_client=2)
    assert (info.value.scope, info.value.limit) == ("client", 2)
    _create(store, client="bob", max_unfinished=3, max_unfinished_per_client=2)  # another client: room left
    with pytest.raises(QueueFullError, match="the server holds 3 unfinished") as info:
        _create(store, client="carol", max_unfinished=3, max_unfinished_per_client=2)
    assert info.value.scope == "total"
    assert sum(store.counts().values()) == 3 and list((tmp_path / "inputs").iterdir()) == []
    # A finished job no longer counts: in_progress still does.
    job = store.claim("runner-a", lease_s=30)
    assert store.fail(job.id, "runner-a", "oom", "out of memory")
    _create(store, client="carol", max_unfinished=3, max_unfinished_per_client=2)


def _create_one_in(folder: Path) -> None:
    """Create one job in the store at `folder` under a total cap of 5, a full queue being no error (a
    `run_at_once` action)."""
    try:
        _create(JobStore(folder), max_unfinished=5)
    except QueueFullError:
        pass


def test_the_total_cap_holds_when_several_processes_create_at_once(tmp_path):
    from tests.conftest import run_at_once

    JobStore(tmp_path)
    assert run_at_once(_create_one_in, tmp_path, repeats=4, processes=3) == []
    assert JobStore(tmp_path).counts()["queued"] == 5


def test_claim_takes_clients_round_robin_so_one_clients_burst_does_not_starve_another(tmp_path):
    store = JobStore(tmp_path)
    flood = [_create(store, prompt=f"a{i}", client="alice").id for i in range(20)]
    bob = [_create(store, prompt=f"b{i}", client="bob").id for i in range(2)]
    carol = _create(store, prompt="c0", client="carol").id
    order = [store.claim(f"runner#{i}", lease_s=30).id for i in range(8)]
    # Strict FIFO (the old claim) would start 20 of alice's jobs before bob's first: a turn each instead, FIFO
    # within a client; a client that was never served goes first among those waiting.
    assert order == [flood[0], bob[0], carol, flood[1], bob[1], flood[2], flood[3], flood[4]]


def test_a_finished_job_expires_after_the_retention_and_the_sweep_removes_it_with_its_files(tmp_path):
    store = JobStore(tmp_path, retention_s=3600)
    done = _create(store, input_reference=_png_bytes())
    broken = _create(store)
    kept = _create(store)
    assert store.complete(done.id, store.claim("runner-a", lease_s=30).owner, _write_mp4(tmp_path / "a.mp4"))
    assert store.fail(broken.id, store.claim("runner-b", lease_s=30).owner, "oom", "out of memory")
    done_now, broken_now = store.get(done.id), store.get(broken.id)
    assert done_now.to_openai()["expires_at"] == done_now.completed_at + 3600
    assert broken_now.to_openai()["expires_at"] == broken_now.completed_at + 3600
    assert store.get(kept.id).to_openai()["expires_at"] is None  # unfinished: no expiry yet

    # The two finished in whole seconds that may differ by one (a second boundary between them): bound by each.
    first, last = sorted((done_now.completed_at, broken_now.completed_at))
    assert store.sweep_expired(now=first + 3599) == []
    assert sorted(store.sweep_expired(now=last + 3601)) == sorted([done.id, broken.id])
    assert store.get(done.id) is None and store.get(broken.id) is None and store.get(kept.id) is not None
    assert list((tmp_path / "videos").iterdir()) == [] and list((tmp_path / "inputs").iterdir()) == []
    assert JobStore(tmp_path).get(kept.id).expires_at is None  # without retention_s, jobs are kept
    with pytest.raises(ValueError, match="retention_s must be a finite number of seconds > 0"):
        JobStore(tmp_path, retention_s=0)


def test_sweep_temp_removes_only_temp_files_older_than_the_bound(tmp_path):
    import os

    store = JobStore(tmp_path)
    stale, live = store.temp_video(), store.temp_video()
    os.utime(stale, (time.time() - 7200, time.time() - 7200))
    assert store.sweep_temp(older_than_s=3600) == [stale]
    assert not stale.exists() and live.exists()  # a live render's file stays


def test_a_stalled_runners_heartbeat_and_complete_fail_once_its_lease_ran_out(tmp_path):
    # The runner stalled (no heartbeat within its lease); nobody has recovered the job yet. Its late heartbeat used
    # to renew the lease as if nothing happened, and its complete stored a render that a re-claim was redoing.
    store = JobStore(tmp_path)
    job_id = _create(store).id
    store.claim("runner-a#1", lease_s=0.2)
    time.sleep(0.3)
    assert not store.heartbeat(job_id, "runner-a#1", progress=50, lease_s=30)
    assert not store.complete(job_id, "runner-a#1", _write_mp4(tmp_path / "late.mp4"))
    assert (tmp_path / "late.mp4").is_file() and store.video_path(job_id) is None
    assert store.recover_expired() == [(job_id, "queued")]
    # The same runner re-claims it under a fresh owner id: the stalled attempt's id acts on nothing.
    assert store.claim("runner-a#2", lease_s=30).attempts == 2
    assert not store.heartbeat(job_id, "runner-a#1", progress=90, lease_s=30)
    assert store.heartbeat(job_id, "runner-a#2", progress=10, lease_s=30)


def test_a_version_1_store_is_migrated_in_place_keeping_its_jobs(tmp_path):
    from vidray.serve import jobs

    store = JobStore(tmp_path)
    job_id = _create(store).id
    with sqlite3.connect(tmp_path / "jobs.sqlite3") as conn:  # back to what version 1 wrote
        _back_to_version_2(conn)
        conn.execute("DROP TABLE clients")
        conn.execute("DROP INDEX jobs_client_status")
        conn.execute("DROP INDEX jobs_expiry")
        conn.execute("ALTER TABLE jobs DROP COLUMN client")
        conn.execute("ALTER TABLE jobs DROP COLUMN expires_at")
        conn.execute("PRAGMA user_version = 1")
    job = JobStore(tmp_path).get(job_id)
    assert (job.client, job.expires_at, job.status) == (jobs.ANONYMOUS_CLIENT, None, "queued")
    assert JobStore(tmp_path).claim("runner-a", lease_s=30).id == job_id


def _back_to_version_2(conn: sqlite3.Connection) -> None:
    """Undo what schema version 3 added (bytes, the per-client list index, idempotency keys)."""
    conn.execute("DROP TABLE idempotency_keys")
    conn.execute("DROP INDEX jobs_client_order")
    conn.execute("ALTER TABLE jobs DROP COLUMN bytes")
    conn.execute("PRAGMA user_version = 2")


def test_a_version_2_store_is_migrated_counting_each_jobs_bytes_from_its_files(tmp_path):
    store = JobStore(tmp_path)
    image = _png_bytes()
    job = _create(store, input_reference=image)
    claimed = store.claim("runner-a", lease_s=30)
    mp4 = _write_mp4(store.temp_video())
    mp4_bytes = mp4.stat().st_size
    assert store.complete(claimed.id, claimed.owner, mp4)
    other = _create(store, client="bob")
    with sqlite3.connect(tmp_path / "jobs.sqlite3") as conn:
        _back_to_version_2(conn)
    store = JobStore(tmp_path)
    with sqlite3.connect(tmp_path / "jobs.sqlite3") as conn:
        sizes = dict(conn.execute("SELECT id, bytes FROM jobs").fetchall())
        assert conn.execute("PRAGMA user_version").fetchone()[0] == 3
    assert sizes == {job.id: len(image) + mp4_bytes, other.id: 0}
    assert store.get(job.id).status == "completed"
