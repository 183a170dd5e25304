"""LoRA on Wan 2.2 A14B's two experts (issue 29: a 14 B expert does not fit a full fine-tune, so the real A14B trains
adapters on its sharded base): the export writes one stock LoRA folder per expert (`lora/` for `transformer`,
`lora_2/` for `transformer_2`) that the stock pipeline loads with `load_lora_weights(..., load_into_transformer_2=
True)`, and that `load_model` merges into each expert; on two gloo ranks (one per expert group) each expert is
built on the meta device from its own pretrained subfolder, sharded with FSDP over its group, trains only its
adapters, checkpoints them alone (DCP) and resumes exactly; `load_model` of that checkpoint is the base with both
experts' adapters merged."""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
from tests.conftest import free_port, start_ranks
from tests.unit.test_expert_groups import expert_rank

from vidray.config import ExpertsConfig, FlowConfig, I2VConfig, LoraConfig, ModelConfig, job_config_from_dict
from vidray.buckets import Bucket
from vidray.generate import GenerateArgumentError, check_generate_args
from vidray.models.experts import EXPERT_ATTRIBUTES, EXPERTS, ExpertSlot, TwoExperts
from vidray.models.export import export_pipeline, load_model, sharded_entries, write_job_file
from vidray.models.lora import LoraLoadError, adapter_state_dict, apply_lora, has_lora
from vidray.models.registry import get_family
from vidray.train.checkpoint import CheckpointManager, TrainState, load_checkpoint, save_sharded_checkpoint
from vidray.train.expert_groups import full_expert_state, gather_experts_to_rank0
from vidray.train.parallel import _load_pretrained_shards, apply_fsdp, mixed_precision_policy
from vidray.train.step import flow_matching_step_loss, sample_generator
from vidray.train.trainer import warn_if_lora_export

FAMILY = get_family("wan")
FLOW = FlowConfig(shift=3.0)
LORA = LoraConfig(rank=4)
RAW_MODEL = {"family": "wan", "text_encoder": "tiny_random", "max_sequence_length": 8, "i2v": {},
             "experts": {"boundary_ratio": 0.9}, "lora": {"rank": 4}}
MODEL = ModelConfig(family="wan", text_encoder="tiny_random", max_sequence_length=8, i2v=I2VConfig(),
                    experts=ExpertsConfig(boundary_ratio=0.9))
NAME = "checkpoint_000002"


def _job(**model):
    return job_config_from_dict({"name": "lora-experts", "model": {**RAW_MODEL, **model},
                                 "data": {"buckets": [list(FAMILY.example_bucket)]}, "flow": {"shift": 3.0}})


def _inputs(transformer, seed: int) -> dict:
    """One call's inputs for a tiny Wan I2V transformer: (1, C_in, F, H, W) latents with the condition channels."""
    generator = torch.Generator().manual_seed(seed)
    config = transformer.config
    return {"hidden_states": torch.randn(1, config.in_channels, 3, 8, 8, generator=generator),
            "encoder_hidden_states": torch.randn(1, 8, config.text_dim, generator=generator), "return_dict": False}


def test_a_two_expert_lora_export_is_one_stock_lora_folder_per_expert_that_diffusers_and_load_model_merge(tmp_path,
                                                                                                         capsys):
    from diffusers import WanImageToVideoPipeline
    from safetensors import safe_open

    components = FAMILY.build(MODEL, seed=0)
    two = components.transformer
    apply_lora(two, LORA, seed=0)
    with torch.no_grad():  # adapters that change the output (B starts at zero)
        generator = torch.Generator().manual_seed(1)
        for name, param in two.named_parameters():
            if ".lora_B." in name:
                param.copy_(torch.randn(param.shape, generator=generator) * 0.1)
    out = export_pipeline(FAMILY, components, tmp_path / "diffusers", FLOW)
    write_job_file(out, _job())
    saved = adapter_state_dict(two)
    for expert, folder in (("high", "lora"), ("low", "lora_2")):
        with safe_open(str(out / folder / "pytorch_lora_weights.safetensors"), framework="pt") as f:
            keys = set(f.keys())
        prefix = EXPERT_ATTRIBUTES[expert] + "."
        assert keys == {"transformer." + k[len(prefix):] for k in saved if k.startswith(prefix)}, expert
    # The stock pipeline: its base weights, each expert's adapters loaded into its own transformer.
    pipe = WanImageToVideoPipeline.from_pretrained(out, local_files_only=True)
    pipe.load_lora_weights(out / "lora")
    pipe.load_lora_weights(out / "lora_2", load_into_transformer_2=True)
    loaded = load_model(out)  # vidray generate's and serving's model: both experts with their adapters merged
    assert isinstance(loaded.components.transformer, TwoExperts) and not has_lora(loaded.components.transformer)
    two.eval()
    with torch.no_grad():
        for expert, stock, timestep in (("high", pipe.transformer, 950.0), ("low", pipe.transformer_2, 300.0)):
            inputs = _inputs(two, seed=2)
            t = torch.tensor([timestep])
            trained = two(timestep=t, **inputs)[0]
            torch.testing.assert_close(stock(timestep=t, **inputs)[0], trained, atol=1e-5, rtol=1e-4, msg=expert)
            merged = loaded.components.transformer(timestep=t, **inputs)[0]
            torch.testing.assert_close(merged, trained, atol=1e-5, rtol=1e-4, msg=expert)
            # A serving stage of one expert loads that expert alone, with its own folder's adapters (a fresh-user
            # trial: the low-noise stage merged lora/, the high-noise expert's).
            alone = load_model(out, components=("transformer",), expert=expert).components.transformer
            torch.testing.assert_close(alone(timestep=t, **inputs)[0], trained, atol=1e-5, rtol=1e-4, msg=expert)
            base = FAMILY.build(MODEL, seed=0).transformer(timestep=t, **inputs)[0]
            assert (base - trained).abs().max() > 1e-3, expert  # the adapters changed this expert
    # An export missing one expert's adapters, or a --lora for a two-expert model: one line each, the latter
    # before any weights load (`check_generate_args`).
    with pytest.raises(LoraLoadError, match=r"has two experts \(transformer_2\), and a LoRA merges into one"):
        load_model(out, lora_path=out / "lora")
    with pytest.raises(GenerateArgumentError, match=r"^--lora: model .* has two experts \(transformer_2\)"):
        check_generate_args(out, "a fox", tmp_path / "out.mp4", lora=out / "lora")
    # Training from the export starts from its base: said in one line (a fresh-user trial: silently).
    assert warn_if_lora_export(_job(init="pretrained", pretrained_path=str(out)))
    assert "is a LoRA run's export: this run starts from its base pipeline" in capsys.readouterr().err
    shutil.rmtree(out / "lora_2")
    with pytest.raises(LoraLoadError, match=r"has two experts and lora/ but no lora_2/ \(the low-noise expert's"):
        load_model(out)


def _train(model, transformer, optimizer, sigma_range, steps: range) -> list[float]:
    """Steps of one micro-batch of 2 samples, alike on every rank (each expert trains them on its side)."""
    bucket = Bucket(*FAMILY.example_bucket)
    losses = []
    for step in steps:
        data = torch.Generator().manual_seed(step)
        latents = torch.randn(FAMILY.latent_shape(bucket, 2), generator=data)
        shape = latents.shape  # the condition (mask and first-frame latents) fills the transformer's other channels
        condition = torch.randn(2, transformer.config.in_channels - shape[1], *shape[2:], generator=data)
        embeds = torch.randn(2, 8, transformer.config.text_dim, generator=data)
        mask = torch.ones(2, 8, dtype=torch.bool)
        generators = [sample_generator(0, step, key) for key in (step, step + 100)]
        optimizer.zero_grad(set_to_none=True)
        loss = flow_matching_step_loss(FAMILY, model, latents, embeds, mask, FLOW, generators,
                                       loss_weights=torch.full((2,), 0.5), sigma_range=sigma_range,
                                       inpaint_latents=condition)
        loss.backward()
        optimizer.step()
        losses.append(loss.item())
    return losses


def _adapted_expert(groups, mesh, folder_config: ModelConfig):
    """This rank's expert as a LoRA run under FSDP builds it: on the meta device from its pretrained subfolder,
    adapters applied, sharded over its group, then its base weights read from the files and the adapters
    initialised."""
    built = FAMILY.load_diffusion_models(folder_config, seed=0, expert=groups.expert, meta=True)
    meta, folder = built.transformer, built.weights_folder
    slot = ExpertSlot(meta, groups.expert)
    apply_lora(slot, LORA, seed=0)
    slot = apply_fsdp(slot, mesh, mixed_precision_policy("no"), blocks=FAMILY.block_lists(slot)[0])
    _load_pretrained_shards(slot, folder, device=torch.device("cpu"), seed=0, restore_buffers=FAMILY.restore_buffers)
    optimizer = torch.optim.AdamW([p for p in slot.parameters() if p.requires_grad], lr=1e-2)
    return slot, optimizer, torch.optim.lr_scheduler.LambdaLR(optimizer, lambda step: 1.0)


def _lora_worker(rank: int, world: int, port: int, tmp: str) -> None:
    tmp_path = Path(tmp)
    with expert_rank(rank, world, port, tmp_path / "lora.pt") as (groups, result):
        mesh = groups.shard_mesh("cpu")
        cfg = ModelConfig(**{**MODEL.__dict__, "init": "pretrained", "pretrained_path": str(tmp_path / "pretrained"),
                             "lora": LORA})
        slot, optimizer, lr_scheduler = _adapted_expert(groups, mesh, cfg)
        first = _train(slot, slot, optimizer, groups.sigma_range, range(1, 3))
        local = tmp_path / f"snapshot-rank{rank}"
        save_sharded_checkpoint(local, model=slot, optimizer=optimizer, lr_scheduler=lr_scheduler,
                                train_state=TrainState(2, 0, 4, world, ""), job_config=_job(
                                    init="pretrained", pretrained_path=str(tmp_path / "pretrained")).to_dict(),
                                rank=rank, world_size=world, optimizer_key=groups.optimizer_key)
        CheckpointManager(tmp_path / "run").upload_shard(local, NAME)
        dist.barrier()
        # Copies: rank 0's own tensors would otherwise be views of the parameters that steps 3-4 change.
        at_checkpoint = gather_experts_to_rank0(groups, {k: v.clone() for k, v in
                                                         full_expert_state(slot.state_dict()).items()})
        after = _train(slot, slot, optimizer, groups.sigma_range, range(3, 5))
        fresh, fresh_optimizer, fresh_scheduler = _adapted_expert(groups, mesh, cfg)
        load_checkpoint(tmp_path / "run" / NAME, transformer=fresh, optimizer=fresh_optimizer,
                        lr_scheduler=fresh_scheduler, optimizer_key=groups.optimizer_key)
        resumed = _train(fresh, fresh, fresh_optimizer, groups.sigma_range, range(3, 5))
        trainable = sorted(n for n, p in slot.named_parameters() if p.requires_grad)
        everyone = [None] * world
        dist.all_gather_object(everyone, {"expert": groups.expert, "first": first, "after": after,
                                          "resumed": resumed, "trainable": trainable})
        result.update(ranks=everyone, gathered=at_checkpoint)


@pytest.mark.slow
def test_each_expert_trains_only_its_adapters_on_its_sharded_pretrained_base_and_resumes_from_them_alone(tmp_path):
    """The real A14B's setting at tiny size: each expert group builds its expert on the meta device from its own
    subfolder of a pretrained Wan 2.2 folder, applies the adapters, shards over its group (FSDP), and trains the
    adapters only; the DCP checkpoint holds the adapters of both experts and nothing else, a fresh rank resumes
    from it with the same losses, and `load_model` of the checkpoint gives the gathered trained experts merged."""
    torch.set_num_threads(1)
    components = FAMILY.build(MODEL, seed=5)
    FAMILY.save_pipeline(components, tmp_path / "pretrained", FLOW)
    start_ranks(_lora_worker, (2, free_port(), str(tmp_path)), 2)
    result = torch.load(tmp_path / "lora.pt", weights_only=False)
    assert [r["expert"] for r in result["ranks"]] == list(EXPERTS)
    for rank in result["ranks"]:
        assert rank["trainable"] and all(".lora_" in name for name in rank["trainable"]), rank["expert"]
        assert rank["resumed"] == pytest.approx(rank["after"], abs=1e-6), rank["expert"]
        assert rank["first"][0] != pytest.approx(rank["after"][-1], abs=1e-4)  # it trained
    saved = sharded_entries(tmp_path / "run" / NAME, "model")
    assert saved and all(".lora_" in name for name in saved)  # adapters only: the base is the pretrained folder's
    assert {name.split(".")[0] for name in saved} == {"transformer", "transformer_2"}
    gathered = result["gathered"]  # both experts at the checkpoint's step, on rank 0
    base = components.transformer.state_dict()
    for name, tensor in gathered.items():  # the frozen base stayed the pretrained weights
        if ".lora_" not in name:
            assert torch.equal(tensor, base[name.replace(".base_layer.", ".")]), name
    # The checkpoint as the validator (and `vidray export`) reads it: the pretrained base with both experts' adapters
    # merged (serving and generate refuse a sharded checkpoint: they take its export).
    merged = load_model(tmp_path / "run" / NAME, allow_sharded=True).components.transformer
    # A serving stage of one expert: the checkpoint holds both experts' adapters in one part (a fresh-user trial:
    # they were applied after the other expert was dropped, and did not fit).
    alone = {expert: load_model(tmp_path / "run" / NAME, components=("transformer",), expert=expert,
                                allow_sharded=True).components.transformer for expert in EXPERTS}
    trained = FAMILY.load_diffusion_models(MODEL, seed=0).transformer
    apply_lora(trained, LORA, seed=0)
    trained.load_state_dict(gathered, strict=True)
    trained.eval()
    with torch.no_grad():
        for timestep in (950.0, 300.0):
            inputs = _inputs(trained, seed=3)
            t = torch.tensor([timestep])
            expected = trained(timestep=t, **inputs)[0]
            torch.testing.assert_close(merged(timestep=t, **inputs)[0], expected, atol=1e-5, rtol=1e-4)
            expert = "high" if timestep >= 900 else "low"
            torch.testing.assert_close(alone[expert](timestep=t, **inputs)[0], expected, atol=1e-5, rtol=1e-4)
