"""`parallel.context` in the job config: the data-parallel width it leaves, and each constraint refused at config
time in one line naming it (issue 47's bad input)."""

from __future__ import annotations

import pytest

from vidray.config import ConfigError, job_config_from_dict

WAN = {"model": {"family": "wan"}, "scaling": {"num_workers": 4}, "data": {"buckets": [[9, 64, 64]]}}


def _job(**sections):
    config = {key: dict(value) for key, value in WAN.items()}
    for section, values in sections.items():
        config[section] = {**config.get(section, {}), **values}
    return job_config_from_dict(config)


def test_a_context_group_trains_one_micro_batch_so_the_data_parallel_width_is_divided_by_its_degree():
    job = _job(parallel={"context": {"ulysses": 2}})
    assert (job.parallel.context.degree, job.data_parallel_workers, job.micro_batches_per_step) == (2, 2, 2)
    assert job.global_batch_size == 2 * job.data.batch_size_per_worker
    assert _job().data_parallel_workers == 4
    assert job_config_from_dict(job.to_dict()) == job  # saved with every checkpoint and read back


@pytest.mark.parametrize("sections, says", [
    ({"parallel": {"context": {"ulysses": 3}}}, "degree 3 (ulysses 3 x ring 1) must divide scaling.num_workers"),
    ({"parallel": {"context": {"ulysses": 2}}, "scaling": {"num_workers": [2, 4]}}, "parallel.context needs a fixed worker count"),
    ({"parallel": {"context": {"ring": 2}}}, "parallel.context.ring: 2 needs GPUs"),
    ({"parallel": {"context": {"ulysses": 2}}, "model": {"family": "animatediff"}, "data": {"buckets": [[8, 64, 64]]}},
     "animatediff does not support context parallel"),
    ({"parallel": {"context": {"ulysses": 4}}, "data": {"buckets": [[1, 32, 48]]}},
     "bucket [1, 32, 48] has 6 latent tokens, not divisible by the context degree 4"),
    ({"parallel": {"context": {"ulysses": 2}}, "model": {"family": "cogvideox", "max_sequence_length": 13},
      "data": {"buckets": [[9, 64, 64]]}},
     "model.max_sequence_length 13 is not divisible by the context degree 2 (cogvideox attends over text and video"),
    ({"parallel": {"context": {"ulysses": 2}}, "model": {"family": "easyanimate", "max_sequence_length": 7}},
     "model.max_sequence_length 7 is not divisible by the context degree 2"),
    ({"parallel": {"context": {"ulysses": 2}}, "train": {"grad_compression": "powersgd"}},
     "powersgd is not supported (PowerSGD's hook averages over every worker, a context group's ranks hold partial "
     "sums); use train.grad_compression: none, fp16, bf16 or int4"),
    ({"parallel": {"context": {"ulysses": 2}}, "model": {"family": "wan", "experts": {"layout": "groups"}}},
     "model.experts.layout: groups is not supported"),
    ({"parallel": {"context": {"ulysses": 0}}}, "parallel.context.ulysses must be >= 1"),
    ({"parallel": {"context": {"ulyses": 2}}}, "parallel.context.ulyses"),
    ({"train": {"micro_batches_per_step": 1}, "parallel": {"context": {"ulysses": 2}}}, None),
])
def test_each_constraint_of_context_parallel_is_one_line_at_config_time(sections, says):
    if says is None:  # G = 1 >= 4 workers / degree 2 is still too few: the workers check counts data-parallel ranks
        with pytest.raises(ConfigError, match="train.micro_batches_per_step=1 is smaller"):
            _job(**sections)
        return
    with pytest.raises(ConfigError) as err:
        _job(**sections)
    assert says in str(err.value) and "\n" not in str(err.value).strip()


def test_context_parallel_takes_the_stateless_int4_compression():
    assert _job(parallel={"context": {"ulysses": 2}}, train={"grad_compression": "int4"}).train.grad_compression == "int4"
