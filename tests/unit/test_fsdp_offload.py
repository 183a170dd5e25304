"""`memory.fsdp_cpu_offload` (FSDP2's `CPUOffloadPolicy`, `vidray.train.parallel.fsdp_offload_policy`) through the
real loop on 2 gloo ranks spawned in process (`train_in_process`, as tests/unit/test_train_fsdp.py): on CPU the
"device" is the host, so the offloaded run must train the same losses as the plain FSDP run; the policy is on the
sharded modules."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

from vidray.config import load_job_config
from vidray.train.local import train_in_process

REPO = Path(__file__).resolve().parents[2]
pytestmark = [pytest.mark.slow, pytest.mark.skipif(sys.platform != "linux", reason="spawned gloo ranks: Linux")]


def test_fsdp_cpu_offload_trains_the_losses_of_plain_fsdp(shards_dir, tmp_path):
    runs = {}
    for offload in (False, True):
        job = load_job_config(REPO / "jobs/configs/tiny_t2v.yaml", [
            f"data.shards_dir={shards_dir}", f"storage.path={tmp_path}", f"name=offload-{offload}",
            "model.text_encoder=tiny_random", "train.log_every_steps=3", "checkpoint.every_steps=3",
            "train.max_steps=3", "scaling.strategy=fsdp", "scaling.num_workers=2",
            f"memory.fsdp_cpu_offload={str(offload).lower()}"])
        runs[offload] = train_in_process(job, world_size=2)
    assert [loss for _, loss in runs[True].losses] == [loss for _, loss in runs[False].losses]


def test_offload_policy_is_cpu_offload_only_when_asked():
    from torch.distributed.fsdp import CPUOffloadPolicy

    from vidray.train.parallel import fsdp_offload_policy

    assert isinstance(fsdp_offload_policy(True, "cpu"), CPUOffloadPolicy)
    assert not fsdp_offload_policy(True, "cpu").pin_memory
    assert not isinstance(fsdp_offload_policy(False, "cpu"), CPUOffloadPolicy)


def test_parallelize_puts_the_cpu_offload_policy_on_every_sharded_module(tmp_path):
    """One gloo rank in this process: `parallelize` with `memory.fsdp_cpu_offload: true` gives the root and every
    block FSDP2's `CPUOffloadPolicy` (false: the default policy, no offload)."""
    import torch.distributed as dist
    from torch.distributed.fsdp import CPUOffloadPolicy

    from vidray.config import ModelConfig, job_config_from_dict
    from vidray.models import get_family
    from vidray.train.parallel import parallelize

    fam = get_family("easyanimate")
    dist.init_process_group("gloo", init_method=f"file://{tmp_path / 'store'}", rank=0, world_size=1)
    try:
        for offload in (True, False):
            transformer = fam.load_diffusion_models(ModelConfig(text_encoder="tiny_random"), seed=0).transformer
            job = job_config_from_dict({"scaling": {"strategy": "fsdp"}, "memory": {"fsdp_cpu_offload": offload}})
            parallelize(transformer, job, device="cpu", family=fam)
            modules = [transformer, *fam.block_lists(transformer)[0]]
            policies = [m._get_fsdp_state()._fsdp_param_group.offload_policy for m in modules]
            assert all(isinstance(p, CPUOffloadPolicy) == offload for p in policies), (offload, policies)
    finally:
        dist.destroy_process_group()
