"""The per-rank Ray Data loader (`vidray.data.pipeline.RankLoader`) on a real local Ray, real shards of the shipped
clips: each rank's planned clips in schedule order, window by window, through Ray Data's operators; the driver's
identity tasks. What the decode operator does to each clip (the hot tier, skipped clips and shards, cached latents,
the warm prefetcher) is the same in both loaders: tests/unit/test_clip_loader.py runs it in process
(`LocalLoader`)."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

from vidray.config import load_job_config
from vidray.data.pipeline import RankLoader
from vidray.data.shards import load_samples

from tests.unit.test_clip_loader import plan_and_loader, shards_dir  # noqa: F401 (a module-scoped fixture)

REPO = Path(__file__).resolve().parents[2]
pytestmark = pytest.mark.integration


def _loader(shards_dir, **kwargs):
    return plan_and_loader(shards_dir, loader_class=RankLoader, **kwargs)


@pytest.mark.parametrize("block_batches", [1, 8])  # a Ray Data block per micro-batch, or blocks of 1, 2, 4 ...
def test_each_rank_gets_its_planned_clips_in_schedule_order_as_equal_shaped_batches(local_ray, shards_dir,
                                                                                   block_batches):
    decoded = {s.sample_id: s for s in load_samples(shards_dir)}
    per_rank = []
    for rank in (0, 1):
        plan, loader = _loader(shards_dir, world_size=2, rank=rank, steps=5, block_batches=block_batches)
        batches = list(loader)
        assert [b.step for b in batches] == [p.step for p in plan] == [1, 2, 3, 4, 5]
        for batch, planned in zip(batches, plan):
            assert batch.frames.dtype.is_floating_point is False
            assert tuple(batch.frames.shape) == (2, 3, *planned.bucket)  # (B, 3, F, H, W) uint8
            np.testing.assert_array_equal(batch.weights, planned.weights)
            for i, sample_id in enumerate(batch.sample_ids):
                expected = decoded[sample_id]
                assert batch.captions[i] == expected.caption
                np.testing.assert_array_equal(batch.frames[i].permute(1, 2, 3, 0).numpy(), expected.video)
        per_rank.append(batches)
    # Every step: both ranks train the same bucket at the same batch size (equal cost, nobody waits).
    for a, b in zip(*per_rank):
        assert a.frames.shape == b.frames.shape and a.bucket == b.bucket


def test_a_long_plan_streams_window_by_window_in_order(local_ray, shards_dir):
    decoded = {s.sample_id: s.video for s in load_samples(shards_dir)}
    plan, loader = _loader(shards_dir, steps=7, window_steps=3)  # windows of 3, 3 and 1 steps
    batches = list(loader)
    assert [b.step for b in batches] == [p.step for p in plan] == list(range(1, 8))
    for batch in batches:
        for i, sample_id in enumerate(batch.sample_ids):
            np.testing.assert_array_equal(batch.frames[i].permute(1, 2, 3, 0).numpy(), decoded[sample_id])


def test_the_drivers_identity_tasks_name_the_encode_stages_entries_and_are_computed_once(local_ray, tmp_path):
    """The identities the tasks compute (on the stages' nodes, while the workers start) are the encode stage's
    (`EncodeStage.vae_id`, its entries' folder), and a second call in this driver reuses them (no new task); a
    later driver reads them from the cache's memo and starts no task (`vidray.data.identities`). What the decode
    operator does with them: tests/unit/test_clip_loader.py."""
    import dataclasses

    import ray

    from vidray.data import pipeline
    from vidray.data.encode import text_identity, vae_identity
    from vidray.data.pipeline import encode_spec, encoder_identity_refs

    job = load_job_config(REPO / "jobs/configs/tiny_t2v.yaml", ["model.text_encoder=tiny_random"])
    spec = encode_spec(job, {}, latent_cache=str(tmp_path / "cache"))
    refs = encoder_identity_refs(spec)
    assert all(isinstance(refs[stage], list) for stage in ("vae", "text"))  # tasks: nothing remembered yet
    answers = {"vae": ray.get(refs["vae"][0]), "text": ray.get(refs["text"][0])}
    assert answers["vae"] == vae_identity(dataclasses.asdict(job.model), job.train.seed)
    assert answers["text"] == text_identity(dataclasses.asdict(job.model), job.train.seed)
    assert encoder_identity_refs(spec) == refs
    pipeline._IDENTITY_REFS.clear()  # what a new driver process starts with
    assert encoder_identity_refs(spec) == answers  # read from the memo the tasks wrote: plain str, no task
    assert len(list((tmp_path / "cache" / "identities").glob("*.json"))) == 2
    pipeline._IDENTITY_REFS.clear()
    other = encode_spec(job, {}, latent_cache=str(tmp_path / "other"))  # another cache holds no memo: tasks again
    assert all(isinstance(v, list) for v in encoder_identity_refs(other).values())
