"""The sample schedule (`vidray.data.schedule`): world-size independent, one bucket per step, equal batches per
rank, every sample of an epoch exactly once whatever the world sizes, deterministic across processes."""

import collections
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from vidray.buckets import Bucket
from vidray.data.schedule import DataPosition, SampleSchedule, batch_sizes_for_buckets

REPO = Path(__file__).resolve().parents[2]
A, B, C = Bucket(9, 64, 64), Bucket(1, 64, 64), Bucket(17, 64, 96)
UNEVEN = [A] * 11 + [B] * 5 + [C] * 1  # 17 samples: 11 clips, 5 images, 1 lonely clip of its own bucket
TWENTY = [A] * 14 + [B] * 6


def run_epochs(schedule, world_sizes, num_epochs):
    """Deal steps with world size `world_sizes[i % len]` at step i until `num_epochs` epochs are done.
    Returns {epoch: Counter of sample rows trained with weight > 0} and the deals."""
    seen = collections.defaultdict(collections.Counter)
    deals = []
    position = schedule.start()
    i = 0
    while position.epoch < num_epochs:
        deal = schedule.next_step(position, world_sizes[i % len(world_sizes)])
        seen[deal.epoch].update(deal.sample_rows[deal.weights > 0].tolist())
        deals.append(deal)
        position = deal.next_position
        i += 1
    return seen, deals


@pytest.mark.parametrize("world_size", [1, 2, 3, 4])
def test_every_sample_of_each_epoch_is_trained_exactly_once_for_any_world_size(world_size):
    schedule = SampleSchedule.from_buckets(UNEVEN, batch_sizes=2, seed=0)
    seen, _ = run_epochs(schedule, [world_size], num_epochs=3)
    for epoch in range(3):
        assert seen[epoch] == collections.Counter(range(len(UNEVEN))), epoch


def test_resizing_2_to_4_mid_epoch_keeps_every_sample_exactly_once_per_epoch():
    """20 samples, W=2 for k steps, then W=4 (and back): the multiset of sample ids per epoch is all of them once."""
    schedule = SampleSchedule.from_buckets(TWENTY, batch_sizes=2, seed=5)
    everyone = collections.Counter(range(20))
    for k in range(1, schedule.steps_per_epoch(2) + 2):
        position = schedule.start()
        seen = collections.defaultdict(collections.Counter)
        for step in range(1, 4 * schedule.steps_per_epoch(2)):
            deal = schedule.next_step(position, 2 if step <= k else 4)
            seen[deal.epoch].update(deal.sample_rows[deal.weights > 0].tolist())
            position = deal.next_position
        done = [e for e in seen if e < position.epoch]
        assert len(done) >= 2
        for epoch in done:
            assert seen[epoch] == everyone, (k, epoch)


def test_all_ranks_of_a_step_train_one_bucket_with_equal_batches_on_uneven_buckets():
    schedule = SampleSchedule.from_buckets(UNEVEN, batch_sizes=3, seed=1)
    _, deals = run_epochs(schedule, [4, 3, 2], num_epochs=4)
    for deal in deals:
        buckets = {UNEVEN[r] for r in deal.sample_rows.ravel().tolist()}
        assert buckets == {deal.bucket}
        assert deal.sample_rows.shape == (deal.world_size, 3)
        assert deal.weights.shape == (deal.world_size, 3)
        assert deal.total_weight >= 1


def test_lonely_bucket_and_short_batches_are_filled_with_weight_zero_repeats_never_dropped():
    schedule = SampleSchedule.from_buckets(UNEVEN, batch_sizes=4, seed=2)
    deal = schedule.next_step(schedule.start(), 1)
    position = schedule.start()
    lonely = UNEVEN.index(C)
    while True:
        deal = schedule.next_step(position, 1)
        position = deal.next_position
        if deal.bucket == C:
            break
    assert deal.sample_rows.tolist() == [[lonely] * 4]
    assert deal.weights.tolist() == [[1.0, 0.0, 0.0, 0.0]]


def test_padded_ranks_of_a_bucket_tail_have_weight_zero_and_loss_normalisation_counts_real_samples():
    schedule = SampleSchedule.from_buckets([A] * 6, batch_sizes=2, seed=0)  # 3 micro-batches
    first = schedule.next_step(schedule.start(), 2)
    assert first.real.tolist() == [True, True] and first.total_weight == 4
    tail = schedule.next_step(first.next_position, 2)
    assert tail.real.tolist() == [True, False]
    assert tail.weights[1].tolist() == [0.0, 0.0] and tail.total_weight == 2
    assert tail.next_position == schedule.start(1)


def test_resuming_from_any_position_with_the_same_world_size_continues_the_uninterrupted_run():
    schedule = SampleSchedule.from_buckets(UNEVEN, batch_sizes=2, seed=3)
    _, straight = run_epochs(schedule, [3], num_epochs=2)
    for cut in range(1, len(straight)):
        fresh = SampleSchedule.from_buckets(UNEVEN, batch_sizes=2, seed=3)  # a new process: nothing cached
        saved = straight[cut - 1].next_position
        position = fresh.position_from_dict(saved.epoch, saved.to_dict(fresh.buckets))
        for expected in straight[cut:]:
            deal = fresh.next_step(position, 3)
            assert np.array_equal(deal.sample_rows, expected.sample_rows)
            assert np.array_equal(deal.weights, expected.weights)
            position = deal.next_position


def test_vectorised_plan_equals_step_by_step_deals():
    schedule = SampleSchedule.from_buckets(UNEVEN * 3, batch_sizes={A: 2, B: 4, C: 1}, seed=4)
    for world_size in (1, 2, 5):
        start = schedule.next_step(schedule.start(2), 3).next_position  # mid-epoch, dealt at another size
        plan = schedule.plan(start, world_size)
        ids, real = plan.batch_ids()
        position = start
        for i in range(plan.num_steps):
            deal = schedule.next_step(position, world_size)
            assert np.array_equal(deal.batch_ids, ids[i]) and np.array_equal(deal.real, real[i])
            position = deal.next_position
        assert position == schedule.start(3)


def test_schedule_for_seed_and_epoch_is_the_same_in_another_process_and_epochs_differ():
    code = (
        "from vidray.buckets import Bucket; from vidray.data.schedule import SampleSchedule\n"
        "s = SampleSchedule.from_buckets([Bucket(9,64,64)]*11 + [Bucket(1,64,64)]*5 + [Bucket(17,64,96)],"
        " batch_sizes=2, seed=7)\n"
        "p = s.start(1)\n"
        "out = []\n"
        "for _ in range(6):\n"
        "    d = s.next_step(p, 2); out.append(d.sample_rows.tolist()); p = d.next_position\n"
        "print(out)\n"
    )
    other = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True, cwd=REPO,
                           env={"PYTHONHASHSEED": "123", "PATH": ""}).stdout.strip()
    here = SampleSchedule.from_buckets(UNEVEN, batch_sizes=2, seed=7)
    mine, position = [], here.start(1)
    for _ in range(6):
        deal = here.next_step(position, 2)
        mine.append(deal.sample_rows.tolist())
        position = deal.next_position
    assert other == str(mine)
    zero, position = [], here.start(0)
    for _ in range(6):
        deal = here.next_step(position, 2)
        zero.append(deal.sample_rows.tolist())
        position = deal.next_position
    assert zero != mine  # each epoch draws its own order


def test_position_is_world_size_independent_and_counts_micro_batches_per_bucket():
    schedule = SampleSchedule.from_buckets(TWENTY, batch_sizes=2, seed=0)  # A: 7 batches, B: 3
    assert schedule.num_batches.tolist() == [3, 7]  # buckets sorted: B (1 frame) first
    deal = schedule.next_step(schedule.start(), 4)
    assert deal.next_position.batches_consumed == int(deal.real.sum())
    assert int(deal.real.sum()) == (3 if deal.bucket == B else 4)  # B has 3 micro-batches: one rank padded
    assert deal.next_position.to_dict(schedule.buckets) == {
        str(B): int(deal.next_position.consumed[0]), str(A): int(deal.next_position.consumed[1])}
    assert schedule.steps_per_epoch(1) == 10 and schedule.steps_per_epoch(4) == 1 + 2


def test_bad_positions_world_sizes_and_empty_datasets_are_errors_naming_the_problem():
    schedule = SampleSchedule.from_buckets(TWENTY, batch_sizes=2, seed=0)
    with pytest.raises(ValueError, match="world_size must be >= 1"):
        schedule.next_step(schedule.start(), 0)
    with pytest.raises(ValueError, match="does not fit this schedule"):
        schedule.next_step(DataPosition(0, (4, 0)), 1)
    with pytest.raises(ValueError, match="do not hold"):
        schedule.position_from_dict(0, {"5x32x32": 1})
    with pytest.raises(ValueError, match="vidray prepare"):
        SampleSchedule.from_buckets([], batch_sizes=2, seed=0)
    with pytest.raises(ValueError, match="no batch size for bucket"):
        SampleSchedule.from_buckets(TWENTY, batch_sizes={A: 2}, seed=0)


def test_token_budget_gives_each_bucket_its_batch_size():
    def latent_tokens(bucket):  # EasyAnimate: 4x temporal, 8x spatial
        return ((bucket.num_frames - 1) // 4 + 1) * (bucket.height // 8) * (bucket.width // 8)

    sizes = batch_sizes_for_buckets([A, B, C], batch_size_per_worker=2, tokens_per_batch=1536,
                                    latent_tokens=latent_tokens)
    assert sizes == {A: 8, B: 24, C: 3}  # 192, 64 and 5x8x12=480 tokens per clip
    assert batch_sizes_for_buckets([A, B], batch_size_per_worker=3, tokens_per_batch=None,
                                   latent_tokens=latent_tokens) == {A: 3, B: 3}
    assert batch_sizes_for_buckets([A], batch_size_per_worker=1, tokens_per_batch=10,
                                   latent_tokens=latent_tokens) == {A: 1}  # at least one clip


# --- the shard-local walk (shards given) -------------------------------------------------------------------------

# 2 buckets, one bucket per shard as `vidray prepare` writes them: A in shards 0-5 (5, 5, 5, 5, 5, 3 samples),
# B in shards 6-8 (4, 4, 2); rows in shard order, as `load_sample_index` gives them.
SHARD_SIZES = {0: 5, 1: 5, 2: 5, 3: 5, 4: 5, 5: 3, 6: 4, 7: 4, 8: 2}
SHARDED = [A if s < 6 else B for s, n in SHARD_SIZES.items() for _ in range(n)]
SHARD_OF = np.array([s for s, n in SHARD_SIZES.items() for _ in range(n)])


def bucket_sequence(schedule, epoch, bucket):
    """The real samples (weight 1) of `bucket`'s micro-batches in the epoch's order, as a flat array."""
    k = schedule.buckets.index(bucket)
    ids = np.arange(schedule.batch_start[k], schedule.batch_start[k + 1])
    rows, weights = schedule.batch_samples(epoch, ids)
    return rows[weights > 0]


def runs(values):
    """Values of consecutive runs: [3, 3, 1, 1, 3] -> [3, 1, 3]."""
    values = np.asarray(values)
    return values[np.concatenate([[True], values[1:] != values[:-1]])].tolist()


@pytest.mark.parametrize("block", [1, 2, 4])
def test_shard_walk_reads_each_block_of_shards_in_one_contiguous_run(block):
    schedule = SampleSchedule.from_buckets(SHARDED, batch_sizes=2, seed=0, shards=SHARD_OF, shuffle_block_shards=block)
    for epoch in range(3):
        for bucket, shards in ((A, range(6)), (B, range(6, 9))):
            sequence = SHARD_OF[bucket_sequence(schedule, epoch, bucket)]
            assert sorted(sequence.tolist()) == sorted(s for s in shards for _ in range(SHARD_SIZES[s]))
            order = list(dict.fromkeys(sequence.tolist()))  # shards by first appearance: the walk's order
            blocks = [set(order[i:i + block]) for i in range(0, len(order), block)]
            block_of = {s: i for i, members in enumerate(blocks) for s in members}
            # Each block's samples are one contiguous run: the block sequence switches len(blocks) - 1 times.
            assert runs([block_of[s] for s in sequence.tolist()]) == list(range(len(blocks))), (epoch, bucket)
            if block == 1:  # one shard per block: exactly one switch per shard
                assert len(runs(sequence)) == len(shards)


def test_shard_walk_mixes_samples_within_a_block_and_keeps_the_full_shuffle_without_shards():
    many = [A] * 400
    shards = np.repeat(np.arange(20), 20)  # 20 shards of 20: 5 blocks of 4 shards, 80 samples each
    walk = SampleSchedule.from_buckets(many, batch_sizes=4, seed=1, shards=shards, shuffle_block_shards=4)
    sequence = shards[bucket_sequence(walk, 0, A)]
    assert len(runs(sequence)) > 100  # shards interleave inside their block (~60 runs per block of 80)
    full = SampleSchedule.from_buckets(many, batch_sizes=4, seed=1)
    assert len(runs(shards[bucket_sequence(full, 0, A)])) > 300  # a full shuffle switches shard almost every sample


def test_shard_walk_is_deterministic_per_seed_and_epoch_and_differs_across_epochs():
    def sequences(seed, epoch):
        s = SampleSchedule.from_buckets(SHARDED, batch_sizes=2, seed=seed, shards=SHARD_OF, shuffle_block_shards=2)
        return [bucket_sequence(s, epoch, b).tolist() for b in (A, B)]

    assert sequences(3, 1) == sequences(3, 1)
    assert sequences(3, 0) != sequences(3, 1)
    assert sequences(3, 0) != sequences(4, 0)
    orders = {tuple(dict.fromkeys(SHARD_OF[np.array(sequences(3, e)[0])].tolist())) for e in range(6)}
    assert len(orders) > 1  # the shard walk itself changes from epoch to epoch


@pytest.mark.parametrize("world_sizes", [[1], [2], [2, 4], [4, 3, 1]])
def test_shard_walk_trains_every_sample_exactly_once_per_epoch_whatever_the_world_sizes(world_sizes):
    schedule = SampleSchedule.from_buckets(SHARDED, batch_sizes=3, seed=2, shards=SHARD_OF, shuffle_block_shards=2)
    seen, deals = run_epochs(schedule, world_sizes, num_epochs=3)
    for epoch in range(3):
        assert seen[epoch] == collections.Counter(range(len(SHARDED))), epoch
    for deal in deals:
        assert {SHARDED[r] for r in deal.sample_rows.ravel().tolist()} == {deal.bucket}


def test_a_short_batch_repeats_its_own_samples_so_it_touches_no_other_shard():
    schedule = SampleSchedule.from_buckets(SHARDED, batch_sizes=4, seed=0, shards=SHARD_OF, shuffle_block_shards=1)
    for epoch in range(4):
        k = schedule.buckets.index(B)  # 10 samples: the third batch has 2 real samples and 2 repeats
        rows, weights = schedule.batch_samples(epoch, np.array([schedule.batch_start[k + 1] - 1]))
        assert weights.tolist() == [[1.0, 1.0, 0.0, 0.0]]
        assert rows[0, 2:].tolist() == rows[0, :2].tolist()


def test_shards_and_block_size_are_checked():
    with pytest.raises(ValueError, match="data.shuffle_block_shards must be >= 1"):
        SampleSchedule.from_buckets(SHARDED, batch_sizes=2, seed=0, shards=SHARD_OF, shuffle_block_shards=0)
    with pytest.raises(ValueError, match="one int per sample"):
        SampleSchedule.from_buckets(SHARDED, batch_sizes=2, seed=0, shards=SHARD_OF[:-1])


def test_job_schedule_takes_batch_sizes_seed_and_shards_from_the_job():
    from types import SimpleNamespace

    from vidray.config import job_config_from_dict
    from vidray.buckets import Bucket
    from vidray.data.schedule import job_schedule
    from vidray.models.registry import get_family

    job = job_config_from_dict({"name": "sched", "data": {"buckets": [[9, 64, 64], [1, 64, 64]],
                                                          "tokens_per_batch": 1536},
                                "train": {"seed": 3}})
    table = SimpleNamespace(bucket_id=np.array([0] * 16 + [1] * 48), buckets=(Bucket(9, 64, 64), Bucket(1, 64, 64)),
                            shard=np.repeat(np.arange(8), 8))
    schedule = job_schedule(job, table, get_family("easyanimate"))
    # 1536 latent tokens: 9x64x64 -> 3x8x8 = 192 tokens -> 8 clips; 1x64x64 -> 64 tokens -> 24 images
    assert schedule.batch_sizes.tolist() == [8, 24] and schedule.seed == 3
    assert schedule.batches_per_epoch == 2 + 2
