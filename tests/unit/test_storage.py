"""`memory.storage_dtype` (`vidray.models.storage`) on the tiny real transformers: frozen weights in bf16 / fp8
(diffusers' layerwise casting), LoRA adapters and trainable weights kept fp32, the bytes it saves, and training
with an fp8-stored base under bf16 autocast."""

from __future__ import annotations

import copy
from pathlib import Path

import pytest
import torch

from vidray.config import FlowConfig, LoraConfig, ModelConfig, OptimConfig
from vidray.buckets import Bucket
from vidray.models import get_family
from vidray.models.lora import apply_lora
from vidray.models.storage import (
    apply_storage_dtype,
    frozen_parameter_names,
    module_storage_bytes,
    resolve_storage_dtype,
)
from vidray.train.optim import build_optimizer
from vidray.train.step import flow_matching_step_loss

CPU = torch.device("cpu")
LORA = LoraConfig(rank=4, alpha=8.0)
FLOW = FlowConfig(shift=3.0)
BUCKET = Bucket(5, 32, 32)


def lora_transformer(family: str = "easyanimate") -> tuple[object, torch.nn.Module]:
    fam = get_family(family)
    transformer = fam.load_diffusion_models(ModelConfig(family=family, text_encoder="tiny_random"), seed=0).transformer
    return fam, apply_lora(transformer, LORA, seed=1)


def test_resolve_auto_and_bad_input():
    assert resolve_storage_dtype("auto", "cpu") == torch.float32  # CPU: the existing fp32 numerics
    assert resolve_storage_dtype("fp32", CPU) == torch.float32
    assert resolve_storage_dtype("bf16", CPU) == torch.bfloat16
    assert resolve_storage_dtype("fp8", CPU) == torch.float8_e4m3fn  # the casts run wherever torch has float8
    assert resolve_storage_dtype("auto", "cpu", mixed_precision="no") == torch.float32
    with pytest.raises(ValueError, match=r"memory.storage_dtype: fp8 .* train.mixed_precision: bf16"):
        resolve_storage_dtype("fp8", CPU, mixed_precision="no")
    with pytest.raises(ValueError, match="memory.storage_dtype must be one of auto, fp32, bf16, fp8, got 'int4'"):
        resolve_storage_dtype("int4", CPU)


@pytest.mark.parametrize("family", ["easyanimate", "wan"])
def test_fp8_casts_frozen_weights_only(family):
    _, transformer = lora_transformer(family)
    before = module_storage_bytes(transformer)
    frozen_bytes = sum(p.numel() * 4 for n, p in transformer.named_parameters() if not p.requires_grad)
    adapters = {n: p.detach().clone() for n, p in transformer.named_parameters() if p.requires_grad}
    frozen = frozen_parameter_names(transformer)
    assert adapters and all("lora_" in n for n in adapters)
    assert apply_storage_dtype(transformer, "fp8", CPU) == torch.float8_e4m3fn
    dtypes = {n: p.dtype for n, p in transformer.named_parameters()}
    for name, value in adapters.items():  # trainable adapters: untouched fp32 masters
        assert dtypes[name] == torch.float32
        assert torch.equal(dict(transformer.named_parameters())[name], value)
    fp8 = [n for n in frozen if dtypes[n] == torch.float8_e4m3fn]
    assert fp8 and all(".base_layer." in n or "lora_" not in n for n in fp8)
    assert all(dtypes[n] in (torch.float8_e4m3fn, torch.bfloat16) for n in frozen)
    assert not any("norm" in n for n in fp8)  # diffusers' default skip patterns keep norms bf16
    params = dict(transformer.named_parameters())
    assert sum(params[n].numel() * params[n].element_size() for n in frozen) < 0.5 * frozen_bytes
    assert module_storage_bytes(transformer) < before  # the tiny models' adapters and rope buffers stay as they are


def test_bf16_keeps_trainable_parameters():
    """A full fine-tune's trainable weights (requires_grad) are never cast, LoRA or not."""
    fam = get_family("easyanimate")
    transformer = fam.load_diffusion_models(ModelConfig(text_encoder="tiny_random"), seed=0).transformer
    names = [n for n, _ in transformer.named_parameters()]
    for name, param in transformer.named_parameters():
        param.requires_grad_(name in names[:4])
    apply_storage_dtype(transformer, "bf16", CPU)
    for i, (name, param) in enumerate(transformer.named_parameters()):
        assert param.dtype == (torch.float32 if i < 4 else torch.bfloat16), name


def test_fp8_lora_trains_and_matches_a_dequantized_base():
    """fp8 storage = the bf16 base rounded to fp8 once: about the same loss and adapter gradients as a bf16 model
    holding
    those rounded weights, under bf16 autocast; and the adapters learn (AdamW steps lower the loss)."""
    fam, stored = lora_transformer()
    reference = copy.deepcopy(stored)
    apply_storage_dtype(stored, "fp8", CPU)
    fp8_names = {n for n, p in stored.named_parameters() if p.dtype == torch.float8_e4m3fn}
    ref_params = dict(reference.named_parameters())
    for name in frozen_parameter_names(reference):
        p = ref_params[name]
        p.data = p.data.to(torch.float8_e4m3fn if name in fp8_names else torch.bfloat16).to(torch.bfloat16)
    g = torch.Generator().manual_seed(3)
    latents = torch.randn(fam.latent_shape(BUCKET, 2), generator=g)
    prompt_embeds, mask = torch.randn(2, 6, 64, generator=g), torch.ones(2, 6, dtype=torch.bool)
    losses, grads = [], []
    for model in (stored, reference):
        with torch.autocast("cpu", dtype=torch.bfloat16):
            loss = flow_matching_step_loss(fam, model, latents, prompt_embeds, mask, FLOW,
                                           torch.Generator().manual_seed(5))
        loss.backward()
        losses.append(loss.item())
        grads.append({n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None})
    # Not bitwise: diffusers turns peft's input cast off on the cast layers (`PeftInputAutocastDisableHook`), which
    # moves a few bf16 roundings (loss equal to 1e-4, gradients to a few % of their norm).
    assert losses[0] == pytest.approx(losses[1], rel=1e-3)
    assert grads[0].keys() == grads[1].keys() and grads[0]
    flat = [torch.cat([g[name].flatten() for name in sorted(g)]) for g in grads]
    assert (flat[0] - flat[1]).norm() < 0.06 * flat[1].norm()  # bf16 noise: 3.5 % measured
    # the fp8 weights are still fp8 after the forward and backward (the hook casts them back down)
    assert all(p.dtype == torch.float8_e4m3fn for n, p in stored.named_parameters() if n in fp8_names)
    optimizer = build_optimizer([p for p in stored.parameters() if p.requires_grad], OptimConfig(lr=3e-3,
                                                                                                   weight_decay=0))
    first = last = None
    for step in range(8):
        optimizer.zero_grad()
        with torch.autocast("cpu", dtype=torch.bfloat16):
            loss = flow_matching_step_loss(fam, stored, latents, prompt_embeds, mask, FLOW,
                                           torch.Generator().manual_seed(5))
        loss.backward()
        optimizer.step()
        first = loss.item() if first is None else first
        last = loss.item()
    assert last < first


def test_module_storage_bytes_counts_dtype():
    linear = torch.nn.Linear(10, 4)  # 44 parameters
    assert module_storage_bytes(linear) == 44 * 4
    linear.to(torch.bfloat16)
    assert module_storage_bytes(linear) == 44 * 2


def test_encode_stage_storage_names_other_cache_entries(tmp_path):
    """fp8 encoders (VAE and text encoder, layerwise casting under bf16 autocast) encode close to the fp32 ones, and
    their identities (cache entry names) and memo keys differ, so fp8 latents never meet fp32 ones in the cache."""
    import dataclasses
    import json

    import numpy as np

    from vidray.data.encode import EncodeStage
    from vidray.data.identities import memo_key

    model = ModelConfig(text_encoder="tiny_random", max_sequence_length=16)
    frames = np.random.default_rng(0).integers(0, 256, (1, 5, 32, 32, 3), dtype=np.uint8)
    batch = {"i": np.array([0]), "frames": frames[None], "clip_sha": np.array([json.dumps([""])]),
             "captions": np.array([json.dumps(["a red ball"])])}
    out = {}
    for storage in ("fp32", "fp8"):
        stage = EncodeStage("vae+text", dataclasses.asdict(model), 0, max_sequence_length=16,
                            storage={"vae": storage, "text": storage})
        out[storage] = (stage(batch), stage.vae_id, stage.text_id)
        if storage == "fp8":
            assert any(p.dtype == torch.float8_e4m3fn for p in stage.vae.parameters())
            assert any(p.dtype == torch.float8_e4m3fn for p in stage.text_encoder.parameters())
    (full, vae32, text32), (low, vae8, text8) = out["fp32"], out["fp8"]
    assert vae32 != vae8 and text32 != text8
    for key in ("latents", "prompt_embeds"):
        a, b = torch.from_numpy(full[key][0]), torch.from_numpy(low[key][0]).float()
        assert a.shape == b.shape and not torch.equal(a, b)
        assert (a - b).norm() < 0.3 * a.norm()  # fp8 weights: close, not equal
    raw = dataclasses.asdict(model)
    assert memo_key("vae", raw, 0, "") == memo_key("vae", raw, 0, "", "fp32") != memo_key("vae", raw, 0, "", "fp8")


def test_fp8_without_recomputation_keeps_bf16_weight_copies_so_the_config_refuses_it():
    """Measured: without activation checkpointing autograd saves each fp8 layer's bf16 compute copy of its weight
    for the backward (the gradient of a LoRA layer's input goes through W), so an fp8 base holds more than a bf16
    one until the backward; with `full` the saved tensors are the same as bf16's. The config refuses fp8 + LoRA
    without activation checkpointing."""
    from vidray.config import job_config_from_dict
    from vidray.train.parallel import apply_activation_checkpointing

    def saved_copies(setting: str, ac: str) -> int:
        fam, transformer = lora_transformer()
        apply_storage_dtype(transformer, setting, CPU)
        apply_activation_checkpointing(transformer, ac, fam.block_lists(transformer))
        # Hold the stored weights: fp8 layerwise casting swaps `param.data` for a bf16 copy during each forward,
        # which would free the fp8 storage and let a saved tensor take its address (and be skipped as a weight).
        stored = [p.data for p in transformer.parameters()]
        own = {t.untyped_storage().data_ptr() for t in stored}
        seen: dict[int, tuple[int, torch.Tensor]] = {}

        def pack(x):
            # Hold each saved tensor so that a storage freed mid-forward cannot hand its address to another one and
            # make two distinct saved tensors count once (an allocator-dependent count failed CI once).
            seen[x.untyped_storage().data_ptr()] = (x.untyped_storage().nbytes(), x)
            return x

        g = torch.Generator().manual_seed(3)
        latents = torch.randn(fam.latent_shape(BUCKET, 2), generator=g)
        with torch.autograd.graph.saved_tensors_hooks(pack, lambda x: x), torch.autocast("cpu", dtype=torch.bfloat16):
            flow_matching_step_loss(fam, transformer, latents, torch.randn(2, 6, 64, generator=g),
                                    torch.ones(2, 6, dtype=torch.bool), FLOW, torch.Generator().manual_seed(5))
        return sum(nbytes for k, (nbytes, _) in seen.items() if k not in own)

    _, transformer = lora_transformer()
    fp8_layers_bf16 = sum(p.numel() * 2 for n, p in transformer.named_parameters() if ".base_layer." in n)
    assert saved_copies("fp8", "none") - saved_copies("bf16", "none") > 0.5 * fp8_layers_bf16
    a, b = saved_copies("fp8", "full"), saved_copies("bf16", "full")
    assert a == b
    job = {"model": {"lora": {"rank": 4}}, "train": {"mixed_precision": "bf16"}, "memory": {"storage_dtype": "fp8"}}
    with pytest.raises(ValueError, match="memory.storage_dtype: fp8 under model.lora needs "
                                         "train.activation_checkpointing: full"):
        job_config_from_dict(job)
    job["train"]["activation_checkpointing"] = "full"
    assert job_config_from_dict(job).memory.storage_dtype == "fp8"
    with pytest.raises(ValueError, match="memory.storage_dtype: bf16 computes the frozen base in bf16"):
        job_config_from_dict({"model": {"lora": {"rank": 4}}, "memory": {"storage_dtype": "bf16"}})


def test_a_run_with_an_fp8_base_exports_its_adapters_on_the_fp32_base(shards_dir, tmp_path):
    """The loop's own path (`train_in_process`): the base is stored in fp8 while training, and the export holds
    the trained adapters on the fp32 base it was given, never the fp8-rounded copy."""
    from pathlib import Path

    from safetensors.torch import load_file

    from vidray.config import load_job_config
    from vidray.train.local import train_in_process

    repo = Path(__file__).resolve().parents[2]
    job = load_job_config(repo / "jobs/configs/tiny_t2v.yaml", [
        f"data.shards_dir={shards_dir}", f"storage.path={tmp_path}", "name=fp8", "model.text_encoder=tiny_random",
        "train.max_steps=2", "train.log_every_steps=2", "checkpoint.every_steps=2", "train.mixed_precision=bf16",
        "train.activation_checkpointing=full", "model.lora={rank: 4, alpha: 4.0}", "memory.storage_dtype=fp8"])
    result = train_in_process(job)
    assert all(loss == loss for _, loss in result.losses)  # finite
    weights = {}
    for f in sorted(Path(result.diffusers_dir, "transformer").glob("*.safetensors")):
        weights.update(load_file(f))
    assert weights and all(t.dtype == torch.float32 for t in weights.values())
    fresh = get_family("easyanimate").load_diffusion_models(job.model, seed=job.train.seed).transformer
    untouched = [n for n, _ in fresh.named_parameters() if "norm" in n and n in weights]
    assert untouched and all(torch.equal(weights[n], dict(fresh.named_parameters())[n]) for n in untouched)


@pytest.mark.parametrize("storage", ["bf16", "fp8"])
def test_a_stored_base_under_fsdp_is_refused_at_config_time(storage):
    """FSDP2 shards a LoRA run's base as fp32 (the storage dtype applies to a replicated base): asking for bf16 / fp8
    storage with scaling.strategy fsdp is a one-line error naming the fix, not a plan that counts bytes the
    trainer never saves."""
    from vidray.config import ConfigError, load_job_config

    repo = Path(__file__).resolve().parents[2]
    with pytest.raises(ConfigError, match=f"memory.storage_dtype: {storage} stores a replicated LoRA base.*"
                                          "scaling.strategy: ddp"):
        load_job_config(repo / "jobs/configs/tiny_t2v.yaml", [
            "model.lora.rank=4", "scaling.strategy=fsdp", "train.mixed_precision=bf16",
            "train.activation_checkpointing=full", f"memory.storage_dtype={storage}"])
