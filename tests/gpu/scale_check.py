"""Issue 28 item 9: the GPU checks of training at scale, one process, one JSON line last (`tests/gpu/run.sh`).

Parts (each reports figures or a miss with its reason, `benchmarks/_figures.py`; one failing part never hides the
others):
- `big`: a `--preset` transformer (default `easyanimate-v5-7b`: real dims, random init; built on the meta device,
  then materialised on the device) taking `--steps` bf16 + activation-checkpointing training steps on one
  `--frames`x`--height`x`--width` clip (default 49x512x512) in the strategy `vidray.train.plan` picks for one GPU of
  this device's memory (full fine-tune if it fits, else LoRA): measured peak (`torch.cuda.max_memory_allocated`)
  against the planner's prediction, step time, and MFU = model FLOPs / step time / `--peak-tflops` (989 dense bf16
  TFLOP/s for an H200). Model FLOPs of a step: 6 x trainable-path parameters x tokens for the matmuls (2 forward, 4
  backward; LoRA: 2 + 2 for frozen weights plus 6 x adapter parameters) plus 3 x 4 x layers x tokens^2 x dim for
  attention (QK^T and AV, forward and backward); activation checkpointing's recompute is not counted (MFU counts
  model FLOPs, PaLM appendix B).
- `fsdp1`: FSDP2 on one rank (`torch.distributed` with world size 1: fully_shard per block then the root, bf16
  `MixedPrecisionPolicy`) training the tiny transformer: its loss falls.
- `tiny`: the tiny job through Ray Train on the GPU with `train.mixed_precision` bf16 and fp16, text encoder
  `tiny_random` (needs Ray and the data stack: `run.sh` installs the Ray pack, `tests/gpu/raypack.py`, which carries
  MiniLM's tokenizer but not its weights; without the pack a miss naming what is missing).

Serving is not among them: `tests/gpu/ray_rows.py` (run before this script by `run.sh`) serves one request through
the Serve app on the GPU.

On CPU (`--device cpu`) it runs the same code on the tiny preset and a small bucket: `tests/unit/test_gpu_script.py`
runs it so that this script cannot rot between GPU loans.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path
from typing import Any, Callable

import torch

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO))
from benchmarks._figures import miss  # noqa: E402

H200_BF16_DENSE_TFLOPS = 989.0
"""NVIDIA H200 SXM dense bf16 tensor-core peak, TFLOP/s (NVIDIA H200 datasheet: 1,979 with sparsity)."""


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _inputs(preset, bucket, device, dtype=torch.float32) -> dict[str, torch.Tensor]:
    f, h, w = bucket
    cfg = preset.config
    return dict(hidden_states=torch.randn(1, cfg.get("in_channels", 16), (f - 1) // 4 + 1, h // 8, w // 8,
                                          device=device, dtype=dtype),
                timestep=torch.full((1,), 500.0, device=device),
                encoder_hidden_states=torch.randn(1, preset.text_seq_len if preset.name not in ("tiny", "medium")
                                                  else 32, cfg.get("text_embed_dim", cfg.get("text_dim")),  # wan: text_dim
                                                  device=device, dtype=dtype))


def part_big(args, device: torch.device) -> dict[str, Any]:
    from vidray.buckets import Bucket
    from vidray.models.presets import get_preset, meta_model
    from vidray.train.plan import Strategy, count_model, estimate_memory

    preset = get_preset(args.preset)
    bucket = Bucket(args.frames, args.height, args.width)
    text_tokens = preset.text_seq_len if preset.name not in ("tiny", "medium") else 32
    total_bytes = (torch.cuda.get_device_properties(device).total_memory if device.type == "cuda"
                   else int(args.cpu_memory_gib * 2**30))
    counts = count_model(preset)
    estimates = {kind: estimate_memory(preset, counts, Strategy(kind, True, "bf16"), bucket=bucket, batch_size=1,
                                       text_tokens=text_tokens, gpu_memory_bytes=total_bytes)
                 for kind in ("ddp", "lora")}
    kind = "ddp" if estimates["ddp"].fits else "lora"
    if not estimates[kind].fits:
        return {"figures": {"big_peak_over_planned": miss(f"the planner says neither full nor LoRA fits "
                                                          f"{total_bytes / 2**30:.0f} GiB", unit="ratio")}}
    model = _materialise(meta_model(preset), device)
    if kind == "lora":
        from vidray.config import LoraConfig
        from vidray.models.lora import apply_lora

        model.requires_grad_(False)
        apply_lora(model, LoraConfig(), seed=0)
    model.enable_gradient_checkpointing()
    model.train()
    trainable = [p for p in model.parameters() if p.requires_grad]
    optimizer = torch.optim.AdamW(trainable, lr=1e-5, fused=device.type == "cuda")
    times = []
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)
    for step in range(args.steps):
        inputs = _inputs(preset, (args.frames, args.height, args.width), device)
        _sync(device)
        start = time.perf_counter()
        optimizer.zero_grad(set_to_none=True)
        with torch.autocast(device.type, dtype=torch.bfloat16):
            out = model(**inputs, return_dict=False)[0]
        loss = (out.float() - torch.randn_like(out, dtype=torch.float32)).pow(2).mean()
        loss.backward()
        optimizer.step()
        _sync(device)
        times.append(time.perf_counter() - start)
    peak = torch.cuda.max_memory_allocated(device) if device.type == "cuda" else None
    step_s = sorted(times[1:] or times)[len(times[1:] or times) // 2]  # median after the first step
    n_video = (args.frames - 1) // 4 + 1
    n_video *= (args.height // 16) * (args.width // 16)
    tokens = n_video + text_tokens
    matmul = (6 if kind == "ddp" else 4) * counts.trainable * tokens
    matmul += 6 * counts.lora_parameters * tokens if kind == "lora" else 0
    attention = 3 * 4 * counts.num_layers * tokens**2 * counts.dim
    mfu = (matmul + attention) / step_s / (args.peak_tflops * 1e12)
    figures = {
        "big_step_time": {"value": step_s, "unit": "s"},
        "big_mfu": {"value": mfu, "unit": "ratio"},
    }
    if peak is not None:
        figures["big_peak_over_planned"] = {"value": peak / estimates[kind].peak_bytes, "unit": "ratio",
                                            "goal": ">= 0.85 and <= 1.15"}
    else:
        figures["big_peak_over_planned"] = miss("no CUDA: the peak is measured by torch.cuda.max_memory_allocated",
                                                unit="ratio", goal=">= 0.85 and <= 1.15")
    return {"figures": figures, "details": {"big": {"preset": preset.name, "strategy": f"{kind}+AC bf16",
                                                    "bucket": [args.frames, args.height, args.width],
                                                    "planned_peak_gib": estimates[kind].peak_bytes / 2**30,
                                                    "measured_peak_gib": None if peak is None else peak / 2**30,
                                                    "step_times_s": times, "tokens": tokens,
                                                    "loss": loss.item()}}}


def _materialise(model: torch.nn.Module, device: torch.device) -> torch.nn.Module:
    """A meta-device model's storage allocated on `device` and filled with N(0, 0.02) weights (norm weights 1,
    biases 0): random init of a real-sized transformer without ever building it on the CPU."""
    import copy

    model = copy.deepcopy(model).to_empty(device=device)
    with torch.no_grad():
        for name, param in model.named_parameters():
            if param.ndim == 1:
                param.fill_(1.0 if "norm" in name and name.endswith("weight") else 0.0)
            else:
                param.normal_(0.0, 0.02)
        for buffer in model.buffers():
            buffer.zero_()
    return model


def part_fsdp1(args, device: torch.device) -> dict[str, Any]:
    import os

    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import MixedPrecisionPolicy

    from vidray.models.presets import get_preset, meta_model
    from vidray.train.parallel import apply_fsdp

    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    os.environ.setdefault("MASTER_PORT", "29531")
    backend = "nccl" if device.type == "cuda" else "gloo"
    dist.init_process_group(backend, rank=0, world_size=1)
    try:
        preset = get_preset("tiny")
        model = _materialise(meta_model(preset), device)
        mesh = init_device_mesh(device.type, (1,))
        apply_fsdp(model, mesh, MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32))
        optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
        inputs = _inputs(preset, (9, 64, 64), device)
        target = torch.randn(1, 16, 3, 8, 8, device=device)
        losses = []
        for _ in range(20):
            optimizer.zero_grad(set_to_none=True)
            out = model(**inputs, return_dict=False)[0]
            loss = (out.float() - target).pow(2).mean()
            loss.backward()
            optimizer.step()
            losses.append(loss.item())
    finally:
        dist.destroy_process_group()
    return {"figures": {"fsdp1_loss_last_over_first": {"value": losses[-1] / losses[0], "unit": "ratio",
                                                       "goal": "< 1"}}}


def part_tiny(args, device: torch.device) -> dict[str, Any]:
    try:
        import ray  # noqa: F401
    except ImportError:
        return {"figures": {"tiny_bf16_last_over_first_loss": miss("ray is not installed here", unit="ratio"),
                            "tiny_fp16_last_over_first_loss": miss("ray is not installed here", unit="ratio")}}
    import tempfile

    from vidray.config import load_job_config
    from vidray.data.ingest import prepare_data
    from vidray.train.trainer import run_training

    figures = {}
    for precision in ("bf16", "fp16"):
        with tempfile.TemporaryDirectory() as tmp:
            job = load_job_config(REPO / "jobs/configs/tiny_t2v.yaml", [
                f"data.source={REPO / 'samples/metadata.json'}", f"data.shards_dir={tmp}/shards",
                f"storage.path={tmp}/runs", f"scaling.use_gpu={device.type == 'cuda'}", "scaling.num_workers=1",
                "model.text_encoder=tiny_random",
                f"train.mixed_precision={precision}", "train.max_steps=40", "train.log_every_steps=20",
                "checkpoint.every_steps=40"])
            prepare_data(job.data)
            losses = [loss for _, loss in run_training(job).losses]
        figures[f"tiny_{precision}_last_over_first_loss"] = {"value": sum(losses[-5:]) / sum(losses[:5]),
                                                             "unit": "ratio", "goal": "< 1"}
    return {"figures": figures}


PARTS: dict[str, Callable] = {"big": part_big, "fsdp1": part_fsdp1, "tiny": part_tiny}


def main(argv: list[str] | None = None) -> dict[str, Any]:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--only", default=",".join(PARTS))
    ap.add_argument("--preset", default="easyanimate-v5-7b")
    ap.add_argument("--frames", type=int, default=49)
    ap.add_argument("--height", type=int, default=512)
    ap.add_argument("--width", type=int, default=512)
    ap.add_argument("--steps", type=int, default=4)
    ap.add_argument("--peak-tflops", type=float, default=H200_BF16_DENSE_TFLOPS)
    ap.add_argument("--cpu-memory-gib", type=float, default=16.0, help="the 'GPU memory' a CPU run plans for")
    args = ap.parse_args(argv)
    device = torch.device(args.device)
    figures, details = {}, {"device": torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu",
                            "torch": torch.__version__}
    for name in args.only.split(","):
        start = time.perf_counter()
        try:
            result = PARTS[name](args, device)
        except Exception as err:  # one part's failure is its figures' miss; the others still run
            result = {"figures": {f"{name}_part": miss(f"{type(err).__name__}: {err}"[:300], unit="s")}}
        figures.update(result["figures"])
        details.update(result.get("details", {}))
        details[f"{name}_wall_s"] = time.perf_counter() - start
    out = {"benchmark": "gpu_scale", "figures": figures, "details": details}
    print(json.dumps(out), flush=True)
    return out


if __name__ == "__main__":
    main()
