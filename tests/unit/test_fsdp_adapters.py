"""Issue 28 items 1, 4 and 5 under FSDP2, with the real tiny transformer over gloo (2 processes): LoRA adapters on a
sharded base train like the unsharded LoRA model, and their sharded checkpoint holds the adapters alone; an EMA
is kept sharded like the weights, checkpointed in the same DCP folder and restored exactly; a meta-device
pretrained base gets its adapters' starting values after its shards load; fp16 scales with `ShardedGradScaler`,
whose state the sharded checkpoint keeps."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from tests.conftest import free_port, join_gloo, start_ranks
from tests.unit.test_fsdp import FAMILY, MODEL, NAME, _batch, _full_state, _loss, _lr_scheduler
from tests.unit.test_fsdp import _transformer as _full_transformer  # the full model, unused parameters frozen

from vidray.config import EMAConfig, LoraConfig, ModelConfig
from vidray.models.lora import adapter_state_dict, apply_lora, has_lora, init_adapters
from vidray.train.checkpoint import (
    CheckpointError,
    CheckpointManager,
    TrainState,
    load_checkpoint,
    save_sharded_checkpoint,
)
from vidray.train.ema import EMA
from vidray.train.parallel import _load_pretrained_shards, apply_fsdp, device_mesh, mixed_precision_policy
from vidray.train.precision import Precision

LORA = LoraConfig(rank=4)
EMA_CONFIG = EMAConfig(decay=0.5, update_every_steps=1)


def _lora_transformer(adapter_seed: int = 0) -> torch.nn.Module:
    """The tiny transformer (base seed 0) with adapters drawn under `adapter_seed`, the adapters of layers whose
    output the model never uses frozen (as the loop does)."""
    transformer = FAMILY.load_diffusion_models(MODEL, seed=0).transformer
    apply_lora(transformer, LORA, seed=adapter_seed)
    _freeze_no_grad(transformer)
    return transformer


def _freeze_no_grad(transformer: torch.nn.Module) -> None:
    no_grad = set(FAMILY.no_grad_parameter_names(transformer))
    for name, param in transformer.named_parameters():
        if name in no_grad:
            param.requires_grad_(False)


def _shard(transformer: torch.nn.Module, precision: str = "no") -> torch.nn.Module:
    return apply_fsdp(transformer, device_mesh("fsdp", device_type="cpu"), mixed_precision_policy(precision))


def _optimizer(model):
    return torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-2)


def _train(model, optimizer, ema: EMA | None, steps: range, precision: Precision | None = None) -> list[float]:
    """The loss of each step; every rank trains the same batch, so any process count takes the same steps."""
    losses = []
    for step in steps:
        optimizer.zero_grad(set_to_none=True)
        if precision is None:
            loss = _loss(model, _batch(step), step)
            loss.backward()
            optimizer.step()
        else:
            with precision.autocast():
                loss = _loss(model, _batch(step), step)
            precision.backward(loss)
            precision.unscale_(optimizer)
            precision.step(optimizer)
        if ema is not None:
            ema.maybe_update(step)
        losses.append(loss.item())
    return losses


def _save(tmp_path: Path, model, optimizer, ema: EMA | None, rank: int, world: int, grad_scaler=None) -> None:
    local = tmp_path / f"snapshot-rank{rank}"
    save_sharded_checkpoint(local, model=model, optimizer=optimizer, lr_scheduler=_lr_scheduler(optimizer),
                            train_state=TrainState(2, 0, 4, world, ""), job_config={"name": "t"}, rank=rank,
                            world_size=world, ema=None if ema is None else ema.averaged, grad_scaler=grad_scaler)
    CheckpointManager(tmp_path / "run").upload_shard(local, NAME)
    dist.barrier()


def _worker(rank: int, world: int, port: int, tmp: str) -> None:
    join_gloo(rank, world, port)
    tmp_path = Path(tmp)
    result: dict = {}
    try:
        # LoRA + EMA on a sharded base: steps 1-2, a checkpoint, steps 3-4.
        model = _shard(_lora_transformer())
        optimizer = _optimizer(model)
        ema = EMA(model, EMA_CONFIG)
        result["early"] = _train(model, optimizer, ema, range(1, 3))
        _save(tmp_path, model, optimizer, ema, rank, world)
        result["ema_at_2"] = ema.full_averages()
        result["late"] = _train(model, optimizer, ema, range(3, 5))
        result["adapters"] = adapter_state_dict(model)  # a collective: every rank
        result["ema"] = ema.full_averages()
        result["ema_is_sharded"] = all(type(a).__name__ == "DTensor" for a in ema.averages().values())

        # A fresh sharded LoRA model (other adapters, no EMA history) resumes it: the same steps 3-4.
        again = _shard(_lora_transformer(adapter_seed=1))
        again_optimizer = _optimizer(again)
        again_ema = EMA(again, EMA_CONFIG)
        state = load_checkpoint(tmp_path / "run" / NAME, transformer=again, optimizer=again_optimizer,
                                lr_scheduler=_lr_scheduler(again_optimizer), ema=again_ema.averaged)
        result["resumed_step"], result["resumed_updates"] = state.step, again_ema.num_updates
        result["resumed_late"] = _train(again, again_optimizer, again_ema, range(3, 5))
        result["resumed_ema"] = again_ema.full_averages()

        # Into unsharded LoRA models (scaling.strategy: ddp), where rank 0 alone keeps the EMA.
        plain = _lora_transformer(adapter_seed=1)
        plain_optimizer = _optimizer(plain)
        plain_ema = EMA(plain, EMA_CONFIG) if rank == 0 else None
        load_checkpoint(tmp_path / "run" / NAME, transformer=plain, optimizer=plain_optimizer,
                        lr_scheduler=_lr_scheduler(plain_optimizer), ema=None if plain_ema is None else plain_ema.averaged)
        result["plain_adapters"] = adapter_state_dict(plain)
        result["plain_ema"] = None if plain_ema is None else plain_ema.full_averages()

        # A meta-device pretrained base: its shards load, then the adapters get their starting values.
        cfg = ModelConfig(text_encoder="tiny_random", init="pretrained", pretrained_path=str(tmp_path / "pretrained"))
        built = FAMILY.load_diffusion_models(cfg, seed=0, meta=True)
        meta, folder = built.transformer, built.weights_folder
        apply_lora(meta, LORA, seed=0)
        _shard(meta)
        _load_pretrained_shards(meta, folder, device=torch.device("cpu"), seed=7)
        result["meta_full"] = _full_state(meta)

        # fp16 on the sharded model (torch runs it on CPU; a run refuses it there): ShardedGradScaler, checkpointed.
        half = _shard(_full_transformer(seed=0), "fp16")
        half_optimizer = _optimizer(half)
        precision = Precision("fp16", torch.device("cpu"), sharded=True, allow_cpu_fp16=True)
        result["fp16_scaler"] = type(precision.grad_scaler).__name__
        result["fp16_losses"] = _train(half, half_optimizer, None, range(1, 4), precision)
        precision.grad_scaler.update(123.0)  # a scale a fresh scaler would not have
        (tmp_path / "fp16").mkdir(exist_ok=True)
        _save(tmp_path / "fp16", half, half_optimizer, None, rank, world, grad_scaler=precision.grad_scaler)
        restored = Precision("fp16", torch.device("cpu"), sharded=True, allow_cpu_fp16=True)
        fresh = _shard(_full_transformer(seed=1), "fp16")
        fresh_optimizer = _optimizer(fresh)
        load_checkpoint(tmp_path / "fp16" / "run" / NAME, transformer=fresh, optimizer=fresh_optimizer,
                        lr_scheduler=_lr_scheduler(fresh_optimizer), grad_scaler=restored.grad_scaler)
        result["fp16_scale"] = restored.grad_scaler.get_scale()
    finally:
        if rank == 0:
            torch.save(result, tmp_path / f"result-{world}.pt")
        dist.destroy_process_group()


@pytest.fixture(scope="module")
def sharded_run(tmp_path_factory) -> tuple[dict, Path]:
    """Two ranks through every case above, once for the module's tests: (rank 0's results, the temp folder)."""
    tmp_path = tmp_path_factory.mktemp("fsdp_adapters")
    base = FAMILY.load_diffusion_models(MODEL, seed=3).transformer
    base.save_pretrained(tmp_path / "pretrained", max_shard_size="200KB")
    start_ranks(_worker, (2, free_port(), str(tmp_path)), 2)
    return torch.load(tmp_path / "result-2.pt", weights_only=False), tmp_path


def _reference() -> tuple[list[float], dict[str, torch.Tensor], dict[str, torch.Tensor]]:
    """Steps 1-4 of the unsharded LoRA model with its EMA in this process: (losses, adapters, EMA averages)."""
    torch.set_num_threads(1)
    model = _lora_transformer()
    optimizer = _optimizer(model)
    ema = EMA(model, EMA_CONFIG)
    losses = _train(model, optimizer, ema, range(1, 5))
    return losses, adapter_state_dict(model), ema.full_averages()


def test_lora_on_a_sharded_base_trains_like_the_unsharded_lora_model_with_a_sharded_ema(sharded_run):
    got, _ = sharded_run
    losses, adapters, averages = _reference()
    assert got["early"] + got["late"] == pytest.approx(losses, rel=1e-5)
    assert got["adapters"].keys() == adapters.keys()
    for name, value in adapters.items():
        torch.testing.assert_close(got["adapters"][name], value, rtol=1e-4, atol=1e-6, msg=name)
    assert got["ema_is_sharded"]  # each rank holds its shards of the average, not the whole
    assert got["ema"].keys() == averages.keys() and all(".lora_" in k for k in averages)
    for name, value in averages.items():
        torch.testing.assert_close(got["ema"][name], value, rtol=1e-4, atol=1e-6, msg=name)


def test_the_sharded_lora_checkpoint_holds_the_adapters_and_ema_and_resumes_exactly(sharded_run):
    got, tmp_path = sharded_run
    folder = tmp_path / "run" / NAME
    manifest = json.loads((folder / "manifest.json").read_text())
    assert manifest["layout"] == "dcp" and manifest["ema"] is True
    assert manifest["lora"]["rank"] == 4
    saved = dcp.FileSystemReader(str(folder / "dcp")).read_metadata().state_dict_metadata
    model_keys = [k for k in saved if k.startswith("model.")]
    assert model_keys and all(".lora_A." in k or ".lora_B." in k for k in model_keys)  # no base weight
    assert any(k.startswith("ema.") for k in saved)
    # Resumed on 2 processes from other adapters: the checkpoint's adapters, optimizer and EMA, exactly.
    assert got["resumed_step"] == 2 and got["resumed_updates"] == 2
    assert got["resumed_late"] == got["late"]
    for name, value in got["ema"].items():
        assert torch.equal(got["resumed_ema"][name], value), name

    # Into unsharded LoRA models on 2 processes (rank 0 keeps the EMA), and in one process: the same adapters and EMA.
    for name, value in got["ema_at_2"].items():
        assert torch.equal(got["plain_ema"][name], value), name
    assert all(".lora_" in k for k in got["plain_adapters"])
    plain = _lora_transformer(adapter_seed=1)
    optimizer = _optimizer(plain)
    ema = EMA(plain, EMA_CONFIG)
    load_checkpoint(folder, transformer=plain, optimizer=optimizer, lr_scheduler=_lr_scheduler(optimizer),
                    ema=ema.averaged)
    for name, value in got["ema_at_2"].items():
        assert torch.equal(ema.full_averages()[name], value), name
    assert _train(plain, optimizer, ema, range(3, 5)) == pytest.approx(got["late"], rel=1e-5)


def test_a_sharded_lora_checkpoint_is_refused_by_a_model_without_lora_and_a_full_one_by_a_lora_model(sharded_run):
    _, tmp_path = sharded_run
    full = _full_transformer(seed=0)
    optimizer = _optimizer(full)
    with pytest.raises(CheckpointError, match=r"holds LoRA adapters only .*set model.lora"):
        load_checkpoint(tmp_path / "run" / NAME, transformer=full, optimizer=optimizer,
                        lr_scheduler=_lr_scheduler(optimizer))
    lora = _lora_transformer()
    optimizer = _optimizer(lora)
    with pytest.raises(CheckpointError, match=r"holds the full transformer .*remove model.lora"):
        load_checkpoint(tmp_path / "fp16" / "run" / NAME, transformer=lora, optimizer=optimizer,
                        lr_scheduler=_lr_scheduler(optimizer))


def test_a_meta_pretrained_base_loads_its_shards_then_its_adapters_start_at_the_base_model(sharded_run):
    got, tmp_path = sharded_run
    base = FAMILY.load_diffusion_models(MODEL, seed=3).transformer.state_dict()
    expected = FAMILY.load_diffusion_models(MODEL, seed=3).transformer
    apply_lora(expected, LORA, seed=0)
    init_adapters(expected, seed=7)  # the same starting adapters, drawn on an unsharded model
    assert has_lora(expected)
    for name, value in expected.state_dict().items():
        assert torch.equal(got["meta_full"][name], value), name
        if ".base_layer." in name:
            assert torch.equal(value, base[name.replace(".base_layer", "")]), name
        if ".lora_B." in name:
            assert not value.any(), name  # B = 0: the adapted model computes what the base does


def test_fp16_under_fsdp_scales_with_the_sharded_grad_scaler_whose_state_is_checkpointed(sharded_run):
    got, _ = sharded_run
    assert got["fp16_scaler"] == "ShardedGradScaler"
    assert all(torch.isfinite(torch.tensor(got["fp16_losses"])))
    assert got["fp16_scale"] == 123.0
