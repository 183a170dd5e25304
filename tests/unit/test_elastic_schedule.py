"""A global batch that survives a resize (`vidray.data.schedule`, "Dealing a step: G micro-batches to W ranks"):
each step deals G micro-batches whatever the worker count W <= G, rank r trains slots r, r+W, ... with gradient
accumulation, and the loss normalisation gives the full step's mean gradient at any W. Plus the config keys
(`scaling.num_workers: [min, max]`, `train.micro_batches_per_step`, `scaling.resize_check_s`) and what the driver
builds from them."""

from __future__ import annotations

import collections

import numpy as np
import pytest
import torch

from vidray.config import RESUME_CHANGEABLE, RESUME_RULES, ConfigError, diff_for_resume, load_job_config
from vidray.buckets import Bucket
from vidray.data.pipeline import plan_rank_steps
from vidray.data.schedule import SampleSchedule

A, B, C = Bucket(9, 64, 64), Bucket(1, 64, 64), Bucket(17, 64, 96)
UNEVEN = [A] * 23 + [B] * 9 + [C] * 3  # 35 samples over three buckets of uneven sizes


def deal_steps(schedule, world_sizes, num_steps, micro_batches):
    """`num_steps` deals from the start, at world size `world_sizes[i % len]` for step i, G = `micro_batches`."""
    deals, position = [], schedule.start()
    for i in range(num_steps):
        deal = schedule.next_step(position, world_sizes[i % len(world_sizes)], micro_batches)
        deals.append(deal)
        position = deal.next_position
    return deals


@pytest.mark.parametrize("world_size", [1, 2, 3, 4])
def test_g_micro_batches_are_dealt_each_to_exactly_one_rank_and_every_rank_gets_one(world_size):
    schedule = SampleSchedule.from_buckets(UNEVEN, batch_sizes=2, seed=0)
    for deal in deal_steps(schedule, [world_size], 12, micro_batches=4):
        assert deal.sample_rows.shape == (4, 2) and deal.micro_batches == 4
        slots = [deal.rank_slots(r).tolist() for r in range(world_size)]
        assert sorted(s for rank in slots for s in rank) == [0, 1, 2, 3]  # each slot once
        assert all(len(rank) >= 1 for rank in slots)
        assert [len(rank) for rank in slots] == [len(range(r, 4, world_size)) for r in range(world_size)]
        for r in range(world_size):
            rows, weights = deal.rank(r)
            np.testing.assert_array_equal(rows, deal.sample_rows[r::world_size])
            np.testing.assert_array_equal(weights, deal.weights[r::world_size])


def test_the_steps_samples_do_not_depend_on_the_worker_count_once_g_is_fixed():
    schedule = SampleSchedule.from_buckets(UNEVEN, batch_sizes=3, seed=1)
    reference = deal_steps(schedule, [4], 20, micro_batches=4)
    for world_sizes in ([1], [2], [3], [4, 2, 4], [2, 3, 1, 4]):
        for got, want in zip(deal_steps(schedule, world_sizes, 20, micro_batches=4), reference, strict=True):
            np.testing.assert_array_equal(got.sample_rows, want.sample_rows)
            np.testing.assert_array_equal(got.weights, want.weights)
            assert got.next_position == want.next_position


def test_resizing_4_2_4_with_a_fixed_global_batch_trains_every_sample_once_per_epoch():
    schedule = SampleSchedule.from_buckets(UNEVEN, batch_sizes=2, seed=2)
    seen = collections.defaultdict(collections.Counter)
    position, step = schedule.start(), 0
    while position.epoch < 3:
        world_size = 4 if step < 3 or step >= 7 else 2
        deal = schedule.next_step(position, world_size, 4)
        for r in range(world_size):
            rows, weights = deal.rank(r)
            seen[deal.epoch].update(rows[weights > 0].tolist())
        position, step = deal.next_position, step + 1
    for epoch in range(3):
        assert seen[epoch] == collections.Counter(range(len(UNEVEN))), epoch


def test_a_bucket_tail_pads_slots_to_g_with_weight_zero():
    schedule = SampleSchedule.from_buckets([A] * 10, batch_sizes=2, seed=0)  # 5 micro-batches: steps of 4 + 1
    first = schedule.next_step(schedule.start(), 2, 4)
    assert first.real.tolist() == [True] * 4 and first.total_weight == 8
    tail = schedule.next_step(first.next_position, 2, 4)
    assert tail.real.tolist() == [True, False, False, False]
    assert tail.weights[1:].sum() == 0 and tail.total_weight == 2
    assert tail.next_position == schedule.start(1)
    assert schedule.steps_per_epoch(2, 4) == schedule.steps_per_epoch(4) == 2


def test_loss_normalisation_gives_the_full_steps_mean_gradient_at_any_worker_count():
    """Each rank sums, over its micro-batches, sum_i w_i loss_i * W / total weight, and DDP averages the W ranks'
    gradients: the result is the gradient of the mean loss over the step's real samples, for W = 1..4."""
    schedule = SampleSchedule.from_buckets([A] * 13, batch_sizes=2, seed=3)  # 7 micro-batches, the last short
    generator = torch.Generator().manual_seed(0)
    features = torch.randn(13, 5, generator=generator)
    targets = torch.randn(13, generator=generator)
    weight0 = torch.randn(5, generator=generator)

    def per_sample_loss(w, rows):
        rows = torch.as_tensor(rows)
        return (features[rows] @ w - targets[rows]) ** 2

    position = schedule.start()
    for _ in range(2):  # a full step of 4 micro-batches, then the tail (3 real micro-batches, 1 padded slot)
        deal = schedule.next_step(position, 1, 4)
        real_rows = deal.sample_rows[deal.weights > 0]
        w = weight0.clone().requires_grad_(True)
        per_sample_loss(w, real_rows).mean().backward()
        expected = w.grad.clone()
        for world_size in (1, 2, 3, 4):
            deal = schedule.next_step(position, world_size, 4)
            rank_grads = []
            for r in range(world_size):
                w = weight0.clone().requires_grad_(True)
                rows, weights = deal.rank(r)
                for micro_rows, micro_weights in zip(rows, weights):  # gradient accumulation
                    loss_weights = torch.from_numpy(micro_weights) * (world_size / deal.total_weight)
                    (per_sample_loss(w, micro_rows) * loss_weights).sum().backward()
                rank_grads.append(w.grad)
            ddp_average = torch.stack(rank_grads).mean(0)
            torch.testing.assert_close(ddp_average, expected, rtol=1e-5, atol=1e-6)
        position = deal.next_position


def test_vectorised_plan_with_g_equals_step_by_step_deals():
    schedule = SampleSchedule.from_buckets(UNEVEN * 2, batch_sizes={A: 2, B: 3, C: 1}, seed=4)
    start = schedule.next_step(schedule.start(1), 2, 3).next_position  # mid-epoch
    for world_size, g in ((1, 3), (2, 5), (3, 3)):
        plan = schedule.plan(start, world_size, g)
        ids, real = plan.batch_ids()
        assert ids.shape == (plan.num_steps, g)
        position = start
        for i in range(plan.num_steps):
            deal = schedule.next_step(position, world_size, g)
            assert np.array_equal(deal.batch_ids, ids[i]) and np.array_equal(deal.real, real[i])
            position = deal.next_position
        assert position == schedule.start(2)


def test_rank_plans_yield_each_ranks_micro_batches_in_slot_order_with_their_count():
    schedule = SampleSchedule.from_buckets(UNEVEN, batch_sizes=2, seed=5)
    deals = deal_steps(schedule, [3], 4, micro_batches=4)
    union = collections.defaultdict(list)
    for rank in range(3):
        plan = plan_rank_steps(schedule, schedule.start(), world_size=3, rank=rank, first_step=1, last_step=4,
                               micro_batches=4)
        expected_count = len(range(rank, 4, 3))  # rank 0: slots 0 and 3; ranks 1, 2: one slot
        assert [(p.step, p.micro, p.num_micro) for p in plan] == [
            (step, m, expected_count) for step in range(1, 5) for m in range(expected_count)]
        for p in plan:
            deal = deals[p.step - 1]
            slot = rank + 3 * p.micro
            np.testing.assert_array_equal(p.rows, deal.sample_rows[slot])
            assert p.total_weight == deal.total_weight and p.next_position == deal.next_position
            union[p.step].append(slot)
    assert all(sorted(slots) == [0, 1, 2, 3] for slots in union.values())


def test_fewer_micro_batches_than_workers_is_refused_by_the_schedule():
    schedule = SampleSchedule.from_buckets(UNEVEN, batch_sizes=2, seed=0)
    with pytest.raises(ValueError, match=r"micro_batches per step \(2\) must be >= world_size \(3\)"):
        schedule.next_step(schedule.start(), 3, 2)
    with pytest.raises(ValueError, match="must be >= world_size"):
        schedule.plan(schedule.start(), 4, 3)


# --- the config ---------------------------------------------------------------------------------------------------

def test_a_worker_range_is_elastic_and_the_global_batch_defaults_to_the_max_worker_count():
    job = load_job_config(None, ["scaling.num_workers=[2, 4]", "scaling.resize_check_s=5"])
    assert (job.scaling.min_workers, job.scaling.max_workers, job.scaling.elastic) == (2, 4, True)
    assert job.micro_batches_per_step == 4
    assert job.to_dict()["scaling"]["num_workers"] == [2, 4]
    fixed = load_job_config(None, ["scaling.num_workers=3"])
    assert (fixed.scaling.elastic, fixed.micro_batches_per_step) == (False, 3)  # G = W: as before
    assert load_job_config(None, ["scaling.num_workers=2", "train.micro_batches_per_step=6"]).micro_batches_per_step == 6


def test_a_global_batch_no_allowed_worker_count_can_keep_is_refused_naming_both_keys_and_the_fix():
    with pytest.raises(ConfigError, match=r"train.micro_batches_per_step=3 is smaller than the max worker count "
                                          r"scaling.num_workers=\[2, 4\].*Set train.micro_batches_per_step >= 4"):
        load_job_config(None, ["scaling.num_workers=[2, 4]", "train.micro_batches_per_step=3"])
    with pytest.raises(ConfigError, match="train.micro_batches_per_step=0 is smaller"):
        load_job_config(None, ["train.micro_batches_per_step=0"])


@pytest.mark.parametrize("value, message", [
    ("[3, 2]", "1 <= min <= max"), ("[0, 2]", "1 <= min <= max"), ("[2]", "two ints"), ("[true, 2]", "two ints"),
    ("[2, 4, 8]", "two ints"), ("0", "must be >= 1"),
])
def test_bad_worker_ranges_are_refused_with_an_example(value, message):
    with pytest.raises(ConfigError, match=rf"scaling.num_workers.*{message}"):
        load_job_config(None, [f"scaling.num_workers={value}"])


def test_worker_range_resize_check_and_global_batch_may_change_on_resume():
    for key in ("scaling.num_workers", "scaling.resize_check_s", "train.micro_batches_per_step"):
        assert RESUME_RULES[key] == RESUME_CHANGEABLE, key
    saved = load_job_config(None, ["scaling.num_workers=2"]).to_dict()
    diff = diff_for_resume(saved, load_job_config(None, ["scaling.num_workers=[2, 4]"]))
    assert diff.fixed == {} and diff.changeable == {"scaling.num_workers": (2, [2, 4])}


def test_driver_builds_an_elastic_scaling_config_and_checks_resources_at_the_min(tmp_path, capsys):
    from vidray.train.trainer import RequestCannotBeMetError, build_trainer_configs, check_resources, \
        required_resources

    job = load_job_config(None, ["scaling.num_workers=[2, 4]", "scaling.resize_check_s=3",
                                 "scaling.cpus_per_worker=1", "data.loader_cpus=0.3"])  # + 0.2 encode
    scaling, run = build_trainer_configs(job, str(tmp_path))
    assert scaling.num_workers == (2, 4) and scaling.elasticity_enabled
    assert scaling.elastic_resize_monitor_interval_s == 3.0
    # a node loss may cost a worker-group start-up failure: elastic runs allow one per worker failure on top
    assert run.failure_config.controller_failure_limit == 2 + job.train.max_failures == 4
    _, forever = build_trainer_configs(load_job_config(None, ["scaling.num_workers=[2, 4]",
                                                              "train.max_failures=-1"]), str(tmp_path))
    assert forever.failure_config.controller_failure_limit == -1
    fixed, fixed_run = build_trainer_configs(load_job_config(None, ["scaling.num_workers=3"]), str(tmp_path))
    assert fixed.num_workers == 3 and not fixed.elasticity_enabled
    assert fixed_run.failure_config.controller_failure_limit == 2

    assert required_resources(job) == {"CPU": 3.0} and required_resources(job, 4) == {"CPU": 6.0}
    check_resources(job, {"CPU": 4.0})  # 2 fit: it can run, and says it starts smaller
    assert "holds the resources of 2 of scaling.num_workers=[2, 4] workers" in capsys.readouterr().out
    check_resources(job, {"CPU": 6.0})
    assert capsys.readouterr().out == ""
    with pytest.raises(RequestCannotBeMetError, match=r"scaling.num_workers=\[2, 4\] \(at least 2\).*needs 3 CPUs; "
                                                      r"the cluster has 2"):
        check_resources(job, {"CPU": 2.0})
