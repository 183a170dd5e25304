"""The job store's tenancy rules (issue 44 parts 1, 4, 5, 6) on real sqlite files in tmp_path: every read, list and
delete scoped to a client, the per-client list on its index, byte quotas and the free-space floor, idempotency keys
recorded with the job, and the owner file of a store folder."""

from __future__ import annotations

import dataclasses
import json
import sqlite3
import threading
from pathlib import Path

import pytest

from tests.unit.test_jobstore import _create, _png_bytes, _write_mp4
from vidray.inference.request import STORED_IMAGE, GenerationRequest
from vidray.serve.jobs import (
    _ADDED_AT_DEFAULT,
    _OUTSIDE_IDENTITY,
    IdempotencyKeyReusedError,
    JobStore,
    StorageFullError,
    StoreOwnedError,
    _request_sha256,
    claim_store,
)


def _finish(store: JobStore, client: str | None = None) -> str:
    """Claim the oldest queued job and complete it with a 112-byte mp4; returns its id."""
    job = store.claim("runner", lease_s=30)
    assert job is not None and (client is None or job.client == client)
    assert store.complete(job.id, job.owner, _write_mp4(store.temp_video()))
    return job.id


# ---------------------------------------------------------------- part 1: per-client isolation


def test_another_clients_id_is_unknown_to_get_video_path_open_video_delete_and_the_list_cursor(tmp_path):
    store = JobStore(tmp_path)
    alice = _create(store, "alice's", client="alice")
    _finish(store, "alice")
    for call in (lambda: store.get(alice.id, client="bob"), lambda: store.video_path(alice.id, client="bob"),
                 lambda: store.open_video(alice.id, client="bob")):
        assert call() is None
    assert store.delete(alice.id, client="bob") is False
    with pytest.raises(LookupError, match="not the id of a stored video"):  # the same words as a deleted id
        store.list(after=alice.id, client="bob")
    # Alice still has everything, and None (the runner, an admin) sees every client's.
    assert store.get(alice.id, client="alice").status == "completed"
    with store.open_video(alice.id, client="alice") as video:
        assert video.read().startswith(b"\x00\x00\x00\x18ftyp")
    assert store.get(alice.id).id == alice.id
    assert store.counts(client="bob")["completed"] == 0 and store.counts(client="alice")["completed"] == 1
    assert store.delete(alice.id, client="alice") is True
    assert not (store.videos_dir / f"{alice.id}.mp4").exists()


def test_a_clients_list_pages_hold_only_its_jobs_in_order(tmp_path):
    store = JobStore(tmp_path)
    mine = [_create(store, f"a{i}", client="alice").id for i in range(5)]
    for i in range(7):
        _create(store, f"b{i}", client="bob")
    seen, after = [], None
    while True:
        page, has_more = store.list(after=after, limit=2, order="asc", client="alice")
        seen += [job.id for job in page]
        assert all(job.client == "alice" for job in page)
        if not has_more:
            break
        after = page[-1].id
    assert seen == mine
    assert len(store.list(limit=100)[0]) == 12  # unscoped: all


@pytest.mark.parametrize("after", [False, True])
def test_the_per_client_list_is_read_through_the_client_index(tmp_path, after):
    store = JobStore(tmp_path)
    job = _create(store, client="alice")
    sql = ("SELECT id FROM jobs WHERE client = ? ORDER BY created_at DESC, seq DESC LIMIT 3" if not after else
           "SELECT id FROM jobs WHERE (created_at, seq) < (?, ?) AND client = ? "
           "ORDER BY created_at DESC, seq DESC LIMIT 3")
    args = ("alice",) if not after else (job.created_at, 10, "alice")
    with sqlite3.connect(store.db_path) as conn:
        plan = " ".join(row[-1] for row in conn.execute(f"EXPLAIN QUERY PLAN {sql}", args))
    assert "USING INDEX jobs_client_order" in plan and "TEMP B-TREE" not in plan, plan


# ---------------------------------------------------------------- part 4: bytes


def test_a_client_over_its_byte_quota_is_refused_and_keeps_every_job_and_file(tmp_path):
    store = JobStore(tmp_path)
    image = _png_bytes()
    first = _create(store, client="alice", input_reference=image, max_client_bytes=len(image) + 50)
    _finish(store, "alice")  # its mp4 (112 bytes) puts alice over the quota
    words = f"stores {len(image) + 112} bytes .* quota is {len(image) + 50} bytes .*max_stored_bytes_per_token.*delete"
    with pytest.raises(StorageFullError, match=words) as err:
        _create(store, "more", client="alice", input_reference=image, max_client_bytes=len(image) + 50)
    assert (err.value.scope, err.value.used_bytes) == ("client", len(image) + 112)
    assert sorted(p.name for p in store.inputs_dir.iterdir()) == [f"{first.id}.png"]  # the refused image is gone
    assert store.get(first.id).status == "completed" and store.video_path(first.id).is_file()
    # Another client is not held back by alice's quota; deleting frees alice's room.
    assert _create(store, client="bob", max_client_bytes=len(image) + 50).client == "bob"
    assert store.delete(first.id)
    assert _create(store, client="alice", max_client_bytes=len(image) + 50).client == "alice"


def test_an_image_dropped_after_the_vae_stage_no_longer_counts_against_the_quota(tmp_path):
    store = JobStore(tmp_path)
    image = _png_bytes()
    first = _create(store, client="alice", input_reference=image)
    quota = {"max_client_bytes": len(image) - 1}  # alice is over it while her image is kept
    with pytest.raises(StorageFullError):
        _create(store, "more", client="alice", input_reference=image, **quota)
    assert store.drop_input(first.id) and not store.drop_input(first.id)  # the second: nothing left to drop
    assert _create(store, "more", client="alice", input_reference=image, **quota).client == "alice"


def test_the_stores_quota_and_the_free_space_floor_refuse_creates_and_claims_wait(tmp_path):
    store = JobStore(tmp_path)
    _create(store, client="alice")
    _finish(store)
    with pytest.raises(StorageFullError, match="store holds 112 bytes, its quota is 100 bytes .*max_stored_bytes") \
            as err:
        _create(store, client="bob", max_store_bytes=100)
    assert err.value.scope == "store"
    huge = 2**62  # more free space than any disk has
    with pytest.raises(StorageFullError, match="MiB free, below the .* MiB it keeps free .*min_free_bytes") as err:
        _create(store, client="bob", min_free_bytes=huge, input_reference=_png_bytes())
    assert err.value.scope == "disk" and list(store.inputs_dir.iterdir()) == []
    queued = _create(store, client="bob")
    assert store.claim("runner", lease_s=30, min_free_bytes=huge) is None  # stays queued while the disk is short
    assert store.get(queued.id).status == "queued"
    assert store.claim("runner", lease_s=30, min_free_bytes=1).id == queued.id


# ---------------------------------------------------------------- part 5: idempotency keys


def test_one_key_and_request_make_one_job_another_request_is_refused_and_keys_are_per_client(tmp_path):
    store = JobStore(tmp_path)
    image = _png_bytes()
    first = _create(store, client="alice", idempotency_key="k-1", input_reference=image)
    again = _create(store, client="alice", idempotency_key="k-1", input_reference=image)
    assert again.id == first.id and store.counts()["queued"] == 1
    assert len(list(store.inputs_dir.iterdir())) == 1  # the repeat's image copy is not kept
    with pytest.raises(IdempotencyKeyReusedError, match="'k-1' was already used .* different request") as err:
        _create(store, "another prompt", client="alice", idempotency_key="k-1", input_reference=image)
    assert err.value.job_id == first.id
    with pytest.raises(IdempotencyKeyReusedError):  # the image is part of the request
        _create(store, client="alice", idempotency_key="k-1", input_reference=image + b"\x00")
    assert _create(store, client="bob", idempotency_key="k-1", input_reference=image).id != first.id
    assert store.counts()["queued"] == 2 and len(list(store.inputs_dir.iterdir())) == 2
    # A repeat after the job finished answers the job as it is now, and a repeat never meets the caps.
    _finish(store, "alice")
    replay = _create(store, client="alice", idempotency_key="k-1", input_reference=image, max_unfinished=1)
    assert (replay.id, replay.status) == (first.id, "completed")
    # The key lives as long as its job.
    assert store.delete(first.id)
    assert _create(store, client="alice", idempotency_key="k-1", input_reference=image).id != first.id


def test_creates_racing_with_one_key_from_eight_threads_make_one_job(tmp_path):
    store = JobStore(tmp_path)
    ids, start = [], threading.Barrier(8)

    def create():
        start.wait()
        ids.append(_create(JobStore(tmp_path), client="alice", idempotency_key="retry-me").id)

    threads = [threading.Thread(target=create) for _ in range(8)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert len(ids) == 8 and len(set(ids)) == 1 and store.counts()["queued"] == 1


@pytest.mark.parametrize("key", ["", "x" * 256, "caf\u00e9", "tab\there"])
def test_an_idempotency_key_outside_printable_ascii_or_255_chars_is_refused(tmp_path, key):
    with pytest.raises(ValueError, match="1..255 printable ASCII"):
        _create(JobStore(tmp_path), idempotency_key=key)


def _legacy_and_current_params(seed: int = 7) -> tuple[dict, dict]:
    """One image-to-video request's params as a store kept them before `GenerationRequest` (the bare numbers and
    the input_reference note) and as it keeps them now (`to_dict()` and the note)."""
    note = {"size": "16x16", "resized_to": "64x64"}
    legacy = {"num_frames": 9, "width": 64, "height": 64, "seed": seed, "num_inference_steps": 4,
              "guidance_scale": 6.0, "negative_prompt": "", "fps": 8.0, "input_reference": note}
    request = GenerationRequest(prompt="a red ball", num_frames=9, width=64, height=64, seed=seed,
                                num_inference_steps=4, guidance_scale=6.0, fps=8.0, image=STORED_IMAGE,
                                family="easyanimate")
    return legacy, {**request.to_dict(), "input_reference": note}


def _create_request(store: JobStore, params: dict, **kwargs):
    return store.create(model="tiny", prompt="a red ball", size="64x64", seconds="1.125", params=params,
                        input_reference=_png_bytes(), client="alice", idempotency_key="order-7", **kwargs)


def test_a_retry_across_the_upgrade_that_stored_the_whole_request_gets_the_job_its_key_made(tmp_path):
    """The hash covers the request's numbers, not the form the store keeps them in: a key recorded by a store that
    kept the bare numbers, or by one that hashed the stored `to_dict()` JSON, still answers the same request with
    its job, and a different request with that key is still refused."""
    legacy, current = _legacy_and_current_params()
    store = JobStore(tmp_path)
    before = _create_request(store, legacy)  # a store of before GenerationRequest
    again = _create_request(store, current)  # the same request, retried after the upgrade
    assert again.id == before.id and sum(store.counts().values()) == 1
    with pytest.raises(IdempotencyKeyReusedError):
        _create_request(store, _legacy_and_current_params(seed=8)[1])
    # A key a store recorded as the hash of the stored to_dict() JSON (main before this fix) still matches.
    conn = sqlite3.connect(store.db_path)
    with conn:
        conn.execute("UPDATE idempotency_keys SET request_sha256 = ?",
                     (_request_sha256("tiny", "a red ball", "64x64", "1.125", json.dumps(current, sort_keys=True),
                                      _png_bytes()),))
    conn.close()
    assert _create_request(store, current).id == before.id and sum(store.counts().values()) == 1


def test_every_request_field_is_placed_in_or_out_of_the_idempotency_identity():
    """A field added to GenerationRequest must say how the hash treats it (`_ADDED_AT_DEFAULT`, with its default)
    or a retry across the upgrade that adds it would be refused."""
    first_form = {"num_frames", "width", "height", "seed", "num_inference_steps", "guidance_scale",
                  "negative_prompt", "fps"}
    fields = {f.name: f.default for f in dataclasses.fields(GenerationRequest)}
    unplaced = set(fields) - first_form - _OUTSIDE_IDENTITY - set(_ADDED_AT_DEFAULT)
    assert not unplaced, f"place {sorted(unplaced)} in vidray.serve.jobs._ADDED_AT_DEFAULT or _OUTSIDE_IDENTITY"
    assert all(fields[name] == default for name, default in _ADDED_AT_DEFAULT.items())


# ---------------------------------------------------------------- part 6: one store, one app


def test_the_first_app_owns_a_store_and_a_second_app_is_refused_naming_the_folder_and_the_owner(tmp_path):
    JobStore(tmp_path, app="vidray")
    assert json.loads((tmp_path / "owner.json").read_text())["app"] == "vidray"
    JobStore(tmp_path, app="vidray")  # a redeploy of the same app
    JobStore(tmp_path)  # tools and tests that name no app
    with pytest.raises(StoreOwnedError) as err:
        JobStore(tmp_path, app="other-app")
    message = str(err.value)
    assert "\n" not in message and str(tmp_path) in message and "'vidray'" in message and "'other-app'" in message
    (tmp_path / "owner.json").unlink()  # the fix the message names
    JobStore(tmp_path, app="other-app")


def test_two_apps_claiming_one_empty_folder_at_once_leave_exactly_one_owner(tmp_path):
    results, start = {}, threading.Barrier(8)

    def claim(app: str):
        start.wait()
        try:
            claim_store(tmp_path / "store", app)
            results[app] = "owner"
        except StoreOwnedError:
            results[app] = "refused"

    threads = [threading.Thread(target=claim, args=(f"app{i}",)) for i in range(8)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert sorted(results.values()).count("owner") == 1
    owner = json.loads((tmp_path / "store" / "owner.json").read_text())["app"]
    assert results[owner] == "owner"
    assert [p.name for p in Path(tmp_path / "store").iterdir()] == ["owner.json"]  # no temp file left
