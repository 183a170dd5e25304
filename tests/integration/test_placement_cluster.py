"""Stages placed by node label on a local multi-node Ray cluster (`ray.cluster_utils.Cluster`, all on 127.0.0.1):
an unlabeled head, a node labeled `vidray.io/stage=vae` and one labeled `dit`. The DiT trainers, the decode
operators and the vae / text encode actors report, from inside, the labels of the node they ran on (`ray.get_runtime_context().get_node_labels()`),
and a selector no node satisfies is refused within seconds, before anything is reserved. The same two nodes also
carry `vidray.io/expert=low` and `high`: Wan 2.2 A14B's two experts train LoRA adapters as two worker groups, each
on its labeled node and on its side of the timestep boundary, and resume exactly (issue 29)."""

from __future__ import annotations

import time
from pathlib import Path

import pytest

from vidray.config import load_job_config
from vidray.placement import PlacementError

from tests.integration.conftest import assert_same_training_state, loopback_cluster

REPO = Path(__file__).resolve().parents[2]
pytestmark = pytest.mark.integration
STAGE = "vidray.io/stage"
EXPERT = "vidray.io/expert"


@pytest.fixture(scope="module")
def labeled_cluster():
    """Head: 0 CPUs, no labels (the driver and Ray Train's controller); `vae` node (also the low-noise expert's):
    2 CPUs; `dit` node (also the high-noise expert's): 3 CPUs."""
    with loopback_cluster([{"num_cpus": 2, "labels": {STAGE: "vae", EXPERT: "low"}},
                           {"num_cpus": 3, "labels": {STAGE: "dit", EXPERT: "high"}}]) as (cluster, _):
        yield cluster


def job(shards_dir, tmp_path, *overrides: str):
    return load_job_config(REPO / "jobs/configs/tiny_t2v.yaml", [
        f"data.shards_dir={shards_dir}", f"storage.path={tmp_path / 'runs'}", "name=placed",
        "model.text_encoder=tiny_random", "train.max_steps=3", "train.log_every_steps=1",
        "checkpoint.every_steps=3", "scaling.num_workers=2", "scaling.cpus_per_worker=1", "data.loader_cpus=0.5",
        *overrides])


def test_trainers_run_on_dit_nodes_and_decode_vae_and_text_actors_on_vae_nodes(labeled_cluster, shards_dir,
                                                                                tmp_path):
    """vae and text with different resources: two encode operators, each reporting its own node."""
    from vidray.train.trainer import run_training

    result = run_training(job(shards_dir, tmp_path, f"placement.dit.label_selector={{{STAGE}: dit}}",
                              f"placement.decode.label_selector={{{STAGE}: vae}}",
                              f"placement.vae.label_selector={{{STAGE}: vae}}",
                              f"placement.text.label_selector={{{STAGE}: vae}}", "placement.text.num_cpus=0.2",
                              f"data.latent_cache={tmp_path / 'latents'}"))
    assert result.last_step == 3
    assert [p["rank"] for p in result.placement] == [0, 1]
    for rank in result.placement:
        assert rank["trainer"]["labels"].get(STAGE) == "dit", rank
        for stage in ("loaders", "vae", "text"):
            assert rank[stage], (stage, rank)  # every micro-batch came through the stage, which said where it ran
            assert {actor["labels"].get(STAGE) for actor in rank[stage]} == {"vae"}, (stage, rank)
    assert list((tmp_path / "latents" / "vae").rglob("*.safetensors"))  # the encode actors filled the cache


def test_a_selector_no_node_satisfies_is_refused_within_seconds_naming_the_labels(labeled_cluster, shards_dir,
                                                                                   tmp_path):
    from vidray.train.trainer import run_training

    started = time.monotonic()
    with pytest.raises(PlacementError) as err:
        run_training(job(shards_dir, tmp_path, f"placement.dit.label_selector={{{STAGE}: gpu-dit}}"))
    assert time.monotonic() - started < 30
    message = str(err.value)
    assert f"no node satisfies placement.dit.label_selector={{'{STAGE}': 'gpu-dit'}}" in message
    assert f"{STAGE}=dit" in message and f"{STAGE}=vae" in message and "no labels" in message
    assert not (tmp_path / "runs" / "placed").exists() or not any((tmp_path / "runs" / "placed").iterdir())


def test_a_selector_key_no_node_carries_is_refused_on_this_labeled_joined_cluster(labeled_cluster, shards_dir,
                                                                                   tmp_path):
    # Issue 27: a key no node carries used to be dropped with a printed line (the stage ran unplaced); on a
    # cluster with labeled nodes, joined by address, it is refused before anything is reserved.
    from vidray.placement import joined_by_address
    from vidray.train.trainer import run_training

    assert joined_by_address()  # ray.init(address=...) above
    with pytest.raises(PlacementError) as err:
        run_training(job(shards_dir, tmp_path, "placement.dit.label_selector={vidray.io/zone: a}"))
    message = str(err.value)
    assert message.startswith("no node carries the label key vidray.io/zone that placement.dit.label_selector=")
    assert "a cluster joined by address" in message and "ray start --labels" in message


def test_two_expert_groups_train_on_their_labeled_nodes_each_on_its_timesteps_and_resume_exactly(labeled_cluster,
                                                                                                 shards_dir, tmp_path):
    """Wan 2.2 A14B's layout (`jobs/configs/wan_i2v_tiny.yaml`) as the real 14 B experts train (LoRA adapters on
    a base sharded with FSDP within each expert's group): one worker per expert, each placed by its expert's label
    selector, trains only its expert's adapters on timesteps of its side of 900; a run resumed from the step-2
    checkpoint repeats both experts' losses of steps 3-4 and ends with the same adapters and optimizer state; the
    export is the stock pipeline with one LoRA folder per expert, which diffusers loads into `transformer` and
    `transformer_2` and which samples as `vidray generate`'s model. Full fine-tuning of the two groups: with DDP
    in test_families_train.py, with FSDP in tests/unit/test_expert_groups.py."""
    from vidray.train.trainer import run_training

    def wan(name: str, *extra: str):
        return load_job_config(REPO / "jobs/configs/wan_i2v_tiny.yaml", [
            f"data.shards_dir={shards_dir}", f"storage.path={tmp_path / 'runs'}", f"name={name}",
            "model.text_encoder=tiny_random", "train.max_steps=4", "train.log_every_steps=1",
            "checkpoint.every_steps=2", "checkpoint.num_to_keep=null", "optim.warmup_steps=0",
            "scaling.num_workers=2", "scaling.strategy=fsdp", "scaling.cpus_per_worker=1", "data.loader_cpus=0.5",
            f"model.experts.high.label_selector={{{EXPERT}: high}}",
            f"model.experts.low.label_selector={{{EXPERT}: low}}", f"data.latent_cache={tmp_path / 'latents'}",
            "model.lora.rank=4", "optim.lr=0.01", *extra])

    straight = run_training(wan("experts"))
    assert sorted(straight.experts) == ["high", "low"] and sorted(sum(straight.experts.values(), [])) == [0, 1]
    for rank in straight.placement:
        expert = rank["expert"]
        assert rank["rank"] in straight.experts[expert]
        assert rank["trainer"]["labels"].get(EXPERT) == expert, rank  # placed by its own expert's selector
        lowest, highest = rank["timestep_range"]
        assert lowest >= 900 if expert == "high" else highest < 900, (expert, rank["timestep_range"])
    assert [s for s, _ in straight.expert_losses["high"]] == [1, 2, 3, 4]
    resumed = run_training(wan("experts-resumed",
                               f"checkpoint.resume_from={Path(straight.run_dir) / 'checkpoint_000002'}"))
    assert resumed.first_step == 3
    for expert in ("high", "low"):
        assert resumed.expert_losses[expert] == straight.expert_losses[expert][2:], expert
    assert_same_training_state(Path(resumed.run_dir) / "checkpoint_000004",
                               Path(straight.run_dir) / "checkpoint_000004")
    import torch
    from diffusers import WanImageToVideoPipeline  # both experts exported, gathered from two ranks

    from vidray.models.export import load_model

    pipe = WanImageToVideoPipeline.from_pretrained(straight.diffusers_dir, local_files_only=True)
    assert pipe.transformer_2 is not None and pipe.config.boundary_ratio == 0.9
    pipe.load_lora_weights(Path(straight.diffusers_dir) / "lora")
    pipe.load_lora_weights(Path(straight.diffusers_dir) / "lora_2", load_into_transformer_2=True)
    merged = load_model(straight.diffusers_dir).components.transformer  # what vidray generate samples with
    config = pipe.transformer.config
    generator = torch.Generator().manual_seed(0)
    inputs = {"hidden_states": torch.randn(1, config.in_channels, 3, 8, 8, generator=generator),
              "encoder_hidden_states": torch.randn(1, 16, config.text_dim, generator=generator), "return_dict": False}
    with torch.no_grad():
        for stock, timestep in ((pipe.transformer, 950.0), (pipe.transformer_2, 300.0)):
            t = torch.tensor([timestep])
            adapted = stock(timestep=t, **inputs)[0]
            torch.testing.assert_close(adapted, merged(timestep=t, **inputs)[0], atol=1e-5, rtol=1e-4)
            stock.disable_lora()  # the base alone: the trained adapters changed this expert's output
            assert (stock(timestep=t, **inputs)[0] - adapted).abs().max() > 1e-4, timestep
