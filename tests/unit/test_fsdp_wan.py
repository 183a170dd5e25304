"""FSDP2 on the Wan family's transformer (issue 29: the family trains at scale as EasyAnimate does): its blocks are
`blocks`, not `transformer_blocks` (`ModelFamily.block_lists`), so the run used to fail in the worker; and its
rotary embedding's buffers are in no weights file, so a pretrained Wan folder could not build on the meta device.
On two gloo processes: a sharded Wan trains the steps of the unsharded one, with activation checkpointing every 2
blocks; a pretrained folder loads shard by shard into a meta-device Wan whose forward equals the folder's model.
The config refuses FSDP for a family without blocks to shard (AnimateDiff) and a pretrained meta build where the
family has none (CogVideoX)."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
import torch.distributed as dist
from tests.conftest import free_port, join_gloo, start_ranks

from vidray.config import ConfigError, FlowConfig, ModelConfig, load_job_config
from vidray.buckets import Bucket
from vidray.models.registry import get_family
from vidray.train.parallel import (
    _load_pretrained_shards,
    apply_activation_checkpointing,
    apply_fsdp,
    device_mesh,
    mixed_precision_policy,
)
from vidray.train.step import flow_matching_step_loss, step_generator

REPO = Path(__file__).resolve().parents[2]
FAMILY = get_family("wan")
MODEL = ModelConfig(family="wan", text_encoder="tiny_random", max_sequence_length=8)
FLOW = FlowConfig(shift=5.0)


def _batch(transformer):
    bucket = Bucket(*FAMILY.example_bucket)
    g = torch.Generator().manual_seed(0)
    return (torch.randn(FAMILY.latent_shape(bucket, 2), generator=g),
            torch.randn(2, MODEL.max_sequence_length, transformer.config.text_dim, generator=g),
            torch.ones(2, MODEL.max_sequence_length, dtype=torch.bool))


def _steps(model, transformer, steps: int = 2) -> list[float]:
    """AdamW steps of one fixed batch (the same on every rank: the mean gradient is the one-process gradient)."""
    optimizer = torch.optim.AdamW([p for p in transformer.parameters() if p.requires_grad], lr=1e-3)
    latents, embeds, mask = _batch(transformer)
    losses = []
    for step in range(1, steps + 1):
        optimizer.zero_grad(set_to_none=True)
        loss = flow_matching_step_loss(FAMILY, model, latents, embeds, mask, FLOW, step_generator(0, step, 0))
        loss.backward()
        optimizer.step()
        losses.append(loss.item())
    return losses


def _full_state(model) -> dict[str, torch.Tensor]:
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

    state = get_model_state_dict(model, options=StateDictOptions(full_state_dict=True, cpu_offload=True))
    return {k: v.clone() for k, v in state.items()}


def _freeze_unused(transformer) -> None:
    no_grad = set(FAMILY.no_grad_parameter_names(transformer))
    for name, param in transformer.named_parameters():
        param.requires_grad_(name not in no_grad)


def _worker(rank: int, world: int, port: int, tmp: str) -> None:
    join_gloo(rank, world, port)
    result: dict = {}
    try:
        transformer = FAMILY.load_diffusion_models(MODEL, seed=0).transformer
        _freeze_unused(transformer)
        blocks = FAMILY.block_lists(transformer)
        result["checkpointed"] = apply_activation_checkpointing(transformer, "every_2", blocks)
        apply_fsdp(transformer, device_mesh("fsdp", device_type="cpu"), mixed_precision_policy("no"), blocks=blocks[0])
        result["losses"] = _steps(transformer, transformer)
        result["weights"] = _full_state(transformer)
        # A pretrained folder into a meta-device Wan: shards loaded file by file, the rotary buffers restored.
        cfg = ModelConfig(family="wan", text_encoder="tiny_random", init="pretrained", pretrained_path=tmp)
        built = FAMILY.load_diffusion_models(cfg, seed=0, meta=True)
        meta, folder = built.transformer, built.weights_folder
        assert next(meta.parameters()).is_meta
        apply_fsdp(meta, device_mesh("fsdp", device_type="cpu"), mixed_precision_policy("no"),
                   blocks=FAMILY.block_lists(meta)[0])
        _load_pretrained_shards(meta, folder, device=torch.device("cpu"), seed=0,
                                restore_buffers=FAMILY.restore_buffers)
        latents, embeds, mask = _batch(meta)
        with torch.no_grad():
            result["pretrained_pred"] = FAMILY.predict(meta, latents, torch.tensor([300.0, 800.0]), embeds, mask)
        result["pretrained_weights"] = _full_state(meta)
    finally:
        if rank == 0:
            torch.save(result, Path(tmp) / "result.pt")
        dist.destroy_process_group()


def test_a_sharded_wan_trains_the_unsharded_steps_and_a_pretrained_folder_loads_into_a_meta_wan(tmp_path):
    torch.set_num_threads(1)
    components = FAMILY.build(MODEL, seed=5)  # the "pretrained" folder: other weights than the trained model's
    FAMILY.save_pipeline(components, tmp_path, FLOW)
    start_ranks(_worker, (2, free_port(), str(tmp_path)), 2)
    result = torch.load(tmp_path / "result.pt", weights_only=False)
    assert result["checkpointed"] == len(range(0, len(FAMILY.block_lists(components.transformer)[0]), 2))

    plain = FAMILY.load_diffusion_models(MODEL, seed=0).transformer
    _freeze_unused(plain)
    assert result["losses"] == pytest.approx(_steps(plain, plain), abs=1e-6)
    for name, tensor in plain.state_dict().items():
        torch.testing.assert_close(result["weights"][name], tensor, atol=1e-6, rtol=1e-5, msg=name)

    reference = components.transformer.eval()
    for name, tensor in reference.state_dict().items():
        assert torch.equal(result["pretrained_weights"][name], tensor), name
    latents, embeds, mask = _batch(reference)
    with torch.no_grad():
        expected = FAMILY.predict(reference, latents, torch.tensor([300.0, 800.0]), embeds, mask)
    torch.testing.assert_close(result["pretrained_pred"], expected, atol=1e-5, rtol=1e-5)  # rotary buffers restored


def test_the_config_refuses_fsdp_where_a_family_has_no_blocks_or_no_meta_build():
    with pytest.raises(ConfigError, match="model.family animatediff has none to shard"):
        load_job_config(REPO / "jobs/configs/animatediff_t2v_tiny.yaml", ["scaling.strategy=fsdp"])
    with pytest.raises(ConfigError, match="model.init: pretrained with scaling.strategy: fsdp is not supported for "
                                          "model.family cogvideox yet"):
        load_job_config(REPO / "jobs/configs/cogvideox_t2v_tiny.yaml",
                        ["scaling.strategy=fsdp", "model.init=pretrained", f"model.pretrained_path={REPO}"])
    wan = load_job_config(REPO / "jobs/configs/wan_t2v_tiny.yaml", ["scaling.strategy=fsdp"])
    assert wan.scaling.strategy == "fsdp"
