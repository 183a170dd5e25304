"""Memory-mode rows of the GPU run (issue 45), storage part: block swap on CUDA. Called by the owner's run.sh
(`block_swap_rows()`), or alone: `python tests/gpu/memory_rows.py [--device cuda] [--layers 30] [--swap 20]`;
the last stdout line is `{"rows": "memory_storage", "figures": {...}}`.

The row: a Wan2.1-1.3B-shaped transformer (`WanTransformer3DModel`, dim 1536, 12 heads, ffn 8960, `--layers`
blocks, random weights) with LoRA (rank 16 on the attention projections), its base stored in bf16
(`memory.storage_dtype: bf16`), `train.activation_checkpointing: full`, bf16 autocast, one latent batch of
(1, 16, 5, 60, 104) (17 frames at 480x832), trained `--steps` AdamW steps resident, then with the last `--swap`
blocks swapped (`vidray.train.block_swap.apply_block_swap`), same seeds. Figures:
- `block_swap_peak_allocated_bytes`, `resident_peak_allocated_bytes`: `torch.cuda.max_memory_allocated` over the
  timed steps.
- `block_swap_peak_over_expected`: the swap run's peak over the expected one, goal within 15 % (0.85..1.15). The
  planner (`vidray.train.plan`) has no block-swap term on this branch, so the expected peak is computed here from
  the model's own bytes: resident peak - the swapped blocks' bytes + 2 blocks' bytes (the block in use and the one
  being copied ahead).
- `block_swap_step_time_over_resident`: median step time swapped / resident, goal <= 1.35.
- `block_swap_same_loss`: the first step's loss is the same with and without the swap (bitwise).
Without CUDA every figure is a miss saying so (`--device cpu` runs the same code on a 2-block model as a smoke
check: no stream, no timing goals).
"""

from __future__ import annotations

import argparse
import copy
import json
import statistics
import sys
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

import torch  # noqa: E402

WAN_1_3B = dict(patch_size=(1, 2, 2), num_attention_heads=12, attention_head_dim=128, in_channels=16,
                out_channels=16, text_dim=4096, freq_dim=256, ffn_dim=8960, cross_attn_norm=True, eps=1e-6,
                rope_max_seq_len=1024)


def _build(layers: int, small: bool) -> torch.nn.Module:
    from diffusers import WanTransformer3DModel

    from vidray.config import LoraConfig
    from vidray.models.lora import apply_lora
    from vidray.models.storage import apply_storage_dtype

    cfg = dict(WAN_1_3B, num_layers=layers)
    if small:
        cfg.update(num_attention_heads=2, attention_head_dim=16, ffn_dim=64, text_dim=32, freq_dim=32)
    torch.manual_seed(0)
    model = WanTransformer3DModel(**cfg)
    model.requires_grad_(False)
    model = apply_lora(model, LoraConfig(rank=16, alpha=16.0, target_modules=["to_q", "to_k", "to_v", "to_out.0"]),
                       seed=1)
    apply_storage_dtype(model, "bf16", "cpu")
    return model


def _block_bytes(block: torch.nn.Module) -> int:
    return sum(p.numel() * p.element_size() for n, p in block.named_parameters() if not p.requires_grad)


def _run(model: torch.nn.Module, device: torch.device, steps: int, small: bool) -> dict[str, Any]:
    from vidray.train.parallel import apply_activation_checkpointing

    g = torch.Generator().manual_seed(0)
    shape = (1, 16, 2, 8, 8) if small else (1, 16, 5, 60, 104)
    latents = torch.randn(shape, generator=g).to(device)
    text = torch.randn(1, 16 if small else 512, model.config.text_dim, generator=g).to(device)
    # The trainer's own full activation checkpointing: each block's recomputation calls the block itself, so the
    # swap's pre-hook brings its weights back in the backward.
    apply_activation_checkpointing(model, "full", [model.blocks])
    params = [p for p in model.parameters() if p.requires_grad]
    optimizer = torch.optim.AdamW(params, lr=1e-4)
    times, losses = [], []
    if device.type == "cuda":
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
    for step in range(steps):
        started = time.perf_counter()
        noise = torch.randn(shape, generator=torch.Generator().manual_seed(step)).to(device)
        with torch.autocast(device.type, dtype=torch.bfloat16):
            pred = model(latents + noise, torch.full((1,), 500.0, device=device), text, return_dict=False)[0]
        loss = (pred.float() - noise).square().mean()
        loss.backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        losses.append(loss.item())  # syncs
        times.append(time.perf_counter() - started)
    out = {"losses": losses, "step_s": statistics.median(times[1:] if len(times) > 1 else times)}
    if device.type == "cuda":
        out["peak"] = torch.cuda.max_memory_allocated(device)
    return out


def block_swap_rows(device: str = "cuda", *, layers: int = 30, swap: int = 20, steps: int = 4) -> dict[str, Any]:
    """The block-swap figures (module docstring) as {name: {"value", "unit", "goal"}}; misses without CUDA."""
    from vidray.train.block_swap import apply_block_swap

    figures: dict[str, Any] = {}
    names = (("block_swap_peak_over_expected", "ratio", "0.85..1.15"),
             ("block_swap_step_time_over_resident", "ratio", "<= 1.35"))
    dev = torch.device(device)
    if dev.type == "cuda" and not torch.cuda.is_available():
        return {n: {"value": None, "unit": u, "goal": g, "miss": "no CUDA on this machine"} for n, u, g in names}
    small = dev.type != "cuda"
    if small:
        layers, swap = 2, 1
    base = _build(layers, small)
    swapped = copy.deepcopy(base)
    resident = _run(base.to(dev), dev, steps, small)
    del base
    if dev.type == "cuda":
        torch.cuda.empty_cache()
    one_block = _block_bytes(swapped.blocks[-1])
    moved = sum(_block_bytes(b) for b in swapped.blocks[len(swapped.blocks) - swap:])
    swaps = apply_block_swap(swapped, [swapped.blocks], swap, dev)
    run = _run(swapped, dev, steps, small)
    figures["block_swap_same_loss"] = {"value": run["losses"][0] == resident["losses"][0], "unit": "bool",
                                       "goal": "== true"}
    figures["block_swap_host_bytes"] = {"value": swaps[0].host_bytes(), "unit": "bytes"}
    if dev.type != "cuda":
        return {**figures, **{n: {"value": None, "unit": u, "goal": g, "miss": "no CUDA: a CPU smoke run"}
                              for n, u, g in names}}
    expected = resident["peak"] - moved + 2 * one_block
    figures.update({
        "resident_peak_allocated_bytes": {"value": resident["peak"], "unit": "bytes"},
        "block_swap_peak_allocated_bytes": {"value": run["peak"], "unit": "bytes"},
        "block_swap_expected_peak_bytes": {"value": expected, "unit": "bytes",
                                           "how": "resident peak - swapped blocks + 2 blocks (no planner term)"},
        "block_swap_peak_over_expected": {"value": round(run["peak"] / expected, 4), "unit": "ratio",
                                          "goal": "0.85..1.15"},
        "resident_step_s": {"value": round(resident["step_s"], 4), "unit": "s"},
        "block_swap_step_s": {"value": round(run["step_s"], 4), "unit": "s"},
        "block_swap_step_time_over_resident": {"value": round(run["step_s"] / resident["step_s"], 4),
                                               "unit": "ratio", "goal": "<= 1.35"},
    })
    return figures


def main(argv: list[str] | None = None) -> dict[str, Any]:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--layers", type=int, default=30)
    parser.add_argument("--swap", type=int, default=20)
    parser.add_argument("--steps", type=int, default=4)
    args = parser.parse_args(argv)
    out = {"rows": "memory_storage", "device": torch.cuda.get_device_name() if torch.cuda.is_available() else "cpu",
           "figures": block_swap_rows(args.device, layers=args.layers, swap=args.swap, steps=args.steps)}
    print(json.dumps(out))
    return out


if __name__ == "__main__":
    main()
