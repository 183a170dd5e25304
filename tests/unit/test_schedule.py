"""The sample schedule: deterministic, one bucket per batch, equal batches per rank, nothing dropped."""

import pytest

from vidray.data.buckets import Bucket
from vidray.train.schedule import DataPosition, SampleSchedule

A, B = Bucket(9, 64, 64), Bucket(1, 64, 64)
BUCKETS = [A, A, A, A, A, B, A, B, A]  # 7 clips + 2 images


def test_every_batch_holds_one_bucket_and_every_sample_is_scheduled_each_epoch():
    schedule = SampleSchedule(BUCKETS, batch_size=2, world_size=2, seed=0)
    for epoch in range(3):
        batches = schedule.epoch_batches(epoch)
        assert len(batches) == schedule.steps_per_epoch * 2
        for batch in batches:
            assert len(batch) == 2
            assert len({BUCKETS[i] for i in batch}) == 1
        assert {i for b in batches for i in b} == set(range(len(BUCKETS)))


def test_same_seed_same_schedule_on_every_rank_and_epochs_differ():
    one = SampleSchedule(BUCKETS, batch_size=2, world_size=2, seed=7)
    two = SampleSchedule(BUCKETS, batch_size=2, world_size=2, seed=7)
    assert [one.batch_for(s, r) for s in range(1, 20) for r in (0, 1)] == [
        two.batch_for(s, r) for s in range(1, 20) for r in (0, 1)
    ]
    assert one.epoch_batches(0) != one.epoch_batches(1)


def test_ranks_get_disjoint_batches_within_a_step():
    schedule = SampleSchedule([A] * 8, batch_size=2, world_size=2, seed=3)
    for step in range(1, schedule.steps_per_epoch + 1):
        assert not set(schedule.batch_for(step, 0)) & set(schedule.batch_for(step, 1))


def test_position_is_a_pure_function_of_step():
    schedule = SampleSchedule(BUCKETS, batch_size=2, world_size=2, seed=0)
    n = schedule.steps_per_epoch  # A: 7 clips -> 4 batches, B: 2 images -> 1 batch; 5 batches / 2 ranks -> 3
    assert n == 3
    assert schedule.position(1) == DataPosition(0, 0)
    assert schedule.position(n) == DataPosition(0, n - 1)
    assert schedule.position(n + 1) == DataPosition(1, 0)
    with pytest.raises(ValueError, match="1-based"):
        schedule.position(0)


def test_empty_dataset_is_an_error():
    with pytest.raises(ValueError, match="vidray prepare"):
        SampleSchedule([], batch_size=2, world_size=1, seed=0)
