"""Storage-dtype figures of `benchmarks/memory_modes.py` (issue 45), measured on CPU in-process:

- `dit_fp8_over_fp32_bytes`, `dit_bf16_over_fp32_bytes`: `module_storage_bytes` of a Wan2.1-T2V-1.3B-shaped
  transformer (diffusers' `WanTransformer3DModel` with the 1.3B config: 30 layers, dim 1536, 12 heads, ffn 8960;
  weights uninitialised, built on the meta device and materialised with `to_empty`: bytes do not depend on values)
  after `apply_storage_dtype(..., "fp8" | "bf16")`, over its fp32 bytes. fp8 keeps diffusers' skip patterns
  (patch embedding, condition embedder, norms) and the rope buffers as they are, so it is above 0.25.
- `lora_fp8_over_bf16_final_loss`, `lora_fp8_last_over_first_loss`, `lora_bf16_last_over_first_loss`: the tiny job
  (`jobs/configs/tiny_t2v.yaml`, tiny_random text encoder) with LoRA (rank 8) trained in this process
  (`train_in_process`, the loop's own path) on the shipped samples, its base stored in fp8 vs in bf16
  (`memory.storage_dtype`), same seed, 60 steps under bf16 autocast and full activation checkpointing: mean loss
  of the last 10 steps fp8 / bf16, and each run's last-10 mean over its first-10 mean (< 1: the loss falls).
"""

from __future__ import annotations

import time
from typing import Any

import torch

WAN_1_3B = dict(patch_size=(1, 2, 2), num_attention_heads=12, attention_head_dim=128, in_channels=16,
                out_channels=16, text_dim=4096, freq_dim=256, ffn_dim=8960, num_layers=30, cross_attn_norm=True,
                eps=1e-6, rope_max_seq_len=1024)
"""Wan-AI/Wan2.1-T2V-1.3B-Diffusers' transformer/config.json."""


def _dit_ratios() -> dict[str, Any]:
    from diffusers import WanTransformer3DModel

    from vidray.models.storage import apply_storage_dtype, module_storage_bytes

    figures: dict[str, Any] = {}
    with torch.device("meta"):
        meta = WanTransformer3DModel(**WAN_1_3B)
    model = meta.to_empty(device="cpu")  # one materialisation: 5.7 GB
    model.requires_grad_(False)
    fp32 = module_storage_bytes(model)
    figures["dit_fp32_bytes"] = {"value": fp32, "unit": "bytes", "params": sum(p.numel() for p in model.parameters())}
    for setting, goal in (("bf16", "<= 0.51"), ("fp8", "<= 0.27")):
        apply_storage_dtype(model, setting, "cpu")  # bf16 first, then fp8 from the bf16 copy (as fp8 does itself)
        figures[f"dit_{setting}_over_fp32_bytes"] = {"value": round(module_storage_bytes(model) / fp32, 4),
                                                     "unit": "ratio", "goal": goal}
    return figures


def _lora_losses(steps: int = 60) -> dict[str, Any]:
    """Two in-process runs (`vidray.train.local.train_in_process`: the loop's own path, the base stored by
    `Worker._place_frozen_base`) of the tiny job with LoRA on the shipped samples, fp8 and bf16 base."""
    import tempfile
    from pathlib import Path

    import yaml

    from vidray.config import job_config_from_dict
    from vidray.data.ingest import prepare
    from vidray.train.local import train_in_process

    repo = Path(__file__).resolve().parents[1]
    raw = yaml.safe_load((repo / "jobs/configs/tiny_t2v.yaml").read_text())
    losses = {}
    with tempfile.TemporaryDirectory() as tmp:
        shards = Path(tmp) / "shards"
        prepare(repo / "samples" / "metadata.json", shards, buckets=[tuple(b) for b in raw["data"]["buckets"]],
                fps=8.0, samples_per_shard=4)
        for setting in ("bf16", "fp8"):
            job = dict(raw, name=f"lora-{setting}", storage={"path": f"{tmp}/runs"},
                       model={**raw["model"], "text_encoder": "tiny_random", "lora": {"rank": 8, "alpha": 8.0}},
                       data={**raw["data"], "shards_dir": str(shards)},
                       optim={"lr": 3.0e-3, "warmup_steps": 5},
                       train={**raw["train"], "max_steps": steps, "mixed_precision": "bf16", "log_every_steps": 10,
                              "activation_checkpointing": "full"},
                       checkpoint={**raw["checkpoint"], "every_steps": steps},
                       memory={"storage_dtype": setting})
            result = train_in_process(job_config_from_dict(job))
            losses[setting] = [loss for _, loss in result.losses]
    first = {k: sum(v[:10]) / 10 for k, v in losses.items()}
    last = {k: sum(v[-10:]) / 10 for k, v in losses.items()}
    return {
        "lora_fp8_over_bf16_final_loss": {"value": round(last["fp8"] / last["bf16"], 4), "unit": "ratio",
                                          "goal": "<= 1.10"},
        "lora_fp8_last_over_first_loss": {"value": round(last["fp8"] / first["fp8"], 4), "unit": "ratio",
                                          "goal": "< 1.0", "first10": round(first["fp8"], 4),
                                          "last10": round(last["fp8"], 4)},
        "lora_bf16_last_over_first_loss": {"value": round(last["bf16"] / first["bf16"], 4), "unit": "ratio",
                                           "goal": "< 1.0", "first10": round(first["bf16"], 4),
                                           "last10": round(last["bf16"], 4)},
    }


def figures() -> dict[str, Any]:
    """The storage figures ({name: {"value", "unit", "goal"}}); a part that raises is a miss with its reason."""
    from benchmarks._figures import miss

    out: dict[str, Any] = {}
    parts = ((_dit_ratios, (("dit_bf16_over_fp32_bytes", "<= 0.51"), ("dit_fp8_over_fp32_bytes", "<= 0.27"))),
             (_lora_losses, (("lora_fp8_over_bf16_final_loss", "<= 1.10"),)))
    for part, names in parts:
        started = time.perf_counter()
        try:
            out.update(part())
        except Exception as err:  # noqa: BLE001 - a figure not measured is a miss, never an omission
            for name, goal in names:
                out[name] = miss(f"{type(err).__name__}: {err}", unit="ratio", goal=goal)
        out[f"{part.__name__.strip('_')}_seconds"] = {"value": round(time.perf_counter() - started, 1), "unit": "s"}
    return out
