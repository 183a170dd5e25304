"""Benchmark of issue 28 (training at scale), one run on the same tiny EasyAnimate transformer and synthetic batch.

Run (part (f) starts Ray, so under the machine-wide lock):
    flock /tmp/vidray-ray.lock .venv/bin/python benchmarks/train_scale.py [--only a,b,d,e,f] [--steps 200]

Parts: a (planner arithmetic), b (AC and LoRA: (b) and (c)), d (planner vs measured), e (hooks, 2 processes),
f (step times; starts Ray).

Figures (the last stdout line is one JSON object, `{"benchmark": "train_scale", "figures": {...}}`):
(a) `fsdp_over_ddp_peak_bytes`: peak training bytes per rank, FSDP / DDP at 2 workers on the medium preset (planner's
    method, `vidray.train.plan`); goal <= 0.6.
(b) `ac_over_no_ac_activation_bytes`: activation bytes of one training step with activation checkpointing (`full`) /
    without, measured with `vidray.train.memory.TensorBytes` (live tensor storages, not RSS); goal <= 0.5.
(c) LoRA rank 16 on the attention projections: `lora_trainable_fraction` (<= 0.02), `lora_optimizer_bytes_ratio`
    (<= 0.05) and `lora_checkpoint_bytes_ratio` (<= 0.05) against a full fine-tune of the medium preset.
(d) `planner_peak_error`: worst `abs(1 - predicted / measured)` of the planner's per-rank peak over the strategies
    the CPU runs (fp32/bf16 x plain/AC/LoRA) on the tiny and the medium preset; goal <= 0.15.
(e) DDP gradient compression over gloo, 2 processes x `--steps` steps of the tiny transformer: bytes a rank sends
    per step with torch's fp16 hook / without (`fp16_hook_bytes_ratio`, <= 0.51), with vidray's int4 hook / without
    (`int4_bytes_ratio`, <= 0.25) and with PowerSGD rank 4 / without (`powersgd_bytes_ratio`, <= 0.25), counted by
    wrapping torch.distributed's collectives in each process (`count_wire_bytes`; the no-hook run registers torch's
    plain `allreduce_hook`, DDP's own behaviour, so its bytes pass through Python too); and each hook's mean loss
    over the last 20 steps relative to no hook (`*_loss_rel_diff`, <= 0.02).
(f) `bf16_over_fp32_step_time`: one training step (forward, backward, AdamW) of the tiny transformer on a
    (4, 16, 3, 16, 16) latent batch under bf16 autocast / fp32, median of interleaved runs, 1 thread (reported, no
    goal: CPU bf16 speed depends on the core's AMX/AVX512-BF16 support); `ray_train_one_worker_step_ratio`: the DiT
    step of `vidray train` with ONE worker and one thread over the `torchrun` peer with one process
    (`benchmarks/train_overhead.measure`), median of 3 interleaved pairs; goal <= 1.05.
A figure that could not be measured is a miss with its reason (`benchmarks/_figures.py`).
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from benchmarks._figures import fill_misses  # noqa: E402

FIGURES = {
    "fsdp_over_ddp_peak_bytes": ("ratio", "<= 0.6"),
    "ac_over_no_ac_activation_bytes": ("ratio", "<= 0.5"),
    "lora_trainable_fraction": ("ratio", "<= 0.02"),
    "lora_optimizer_bytes_ratio": ("ratio", "<= 0.05"),
    "lora_checkpoint_bytes_ratio": ("ratio", "<= 0.05"),
    "planner_peak_error": ("ratio", "<= 0.15"),
    "fp16_hook_bytes_ratio": ("ratio", "<= 0.51"),
    "int4_bytes_ratio": ("ratio", "<= 0.25"),
    "powersgd_bytes_ratio": ("ratio", "<= 0.25"),
    "fp16_hook_loss_rel_diff": ("ratio", "<= 0.02"),
    "int4_loss_rel_diff": ("ratio", "<= 0.02"),
    "powersgd_loss_rel_diff": ("ratio", "<= 0.02"),
    "bf16_over_fp32_step_time": ("ratio", None),
    "ray_train_one_worker_step_ratio": ("ratio", "<= 1.05"),
}


def _figure(name: str, value: float) -> dict[str, Any]:
    unit, goal = FIGURES[name]
    return {"value": float(value), "unit": unit, **({"goal": goal} if goal else {})}


# ---- (a)-(d): memory, on the medium preset ----

MEDIUM_BUCKET, TEXT_TOKENS = (9, 128, 128), 32


def _medium(lora_rank: int = 0, ac: bool = False) -> torch.nn.Module:
    from diffusers import EasyAnimateTransformer3DModel

    from vidray.config import LoraConfig
    from vidray.models.lora import apply_lora
    from vidray.models.presets import get_preset

    torch.manual_seed(0)
    model = EasyAnimateTransformer3DModel(**get_preset("medium").config)
    if lora_rank:
        apply_lora(model, LoraConfig(rank=lora_rank), seed=0)
    if ac:
        model.enable_gradient_checkpointing()
    return model.train()


def _medium_inputs():
    f, h, w = MEDIUM_BUCKET
    return dict(hidden_states=torch.randn(1, 16, (f - 1) // 4 + 1, h // 8, w // 8), timestep=torch.rand(1) * 1000,
                encoder_hidden_states=torch.randn(1, TEXT_TOKENS, 384))


def measure_fsdp_planned() -> dict[str, Any]:
    """(a) by the planner's arithmetic: FSDP shards parameters, gradients and AdamW state over the ranks and holds
    one gathered block (plus the next, prefetched); DDP replicates them (and adds its gradient buckets)."""
    from vidray.buckets import Bucket
    from vidray.models.presets import get_preset
    from vidray.train.plan import Strategy, count_model, estimate_memory

    preset = get_preset("medium")
    counts = count_model(preset)
    peak = {kind: estimate_memory(preset, counts, Strategy(kind, False, "fp32"), bucket=Bucket(*MEDIUM_BUCKET),
                                  batch_size=1, text_tokens=TEXT_TOKENS, num_gpus=2).peak_bytes
            for kind in ("ddp", "fsdp")}
    return {"figures": {"fsdp_over_ddp_peak_bytes": _figure("fsdp_over_ddp_peak_bytes", peak["fsdp"] / peak["ddp"])},
            "details": {"planned_peak_bytes_2_workers": peak}}


def measure_ac_and_lora() -> dict[str, Any]:
    """(b) activation bytes at the end of the forward (its phase peak less parameters and optimizer state: the
    gradients are None then), with `enable_gradient_checkpointing` / without; (c) LoRA rank 16 on the default
    targets against a full fine-tune: trainable parameters, AdamW state bytes, and a real checkpoint's bytes
    (`save_checkpoint`: adapter.safetensors + optimizer.pt + ... against transformer.safetensors + ...)."""
    from vidray.config import OptimConfig
    from vidray.train.checkpoint import TrainState, save_checkpoint
    from vidray.train.memory import measure_training_step
    from vidray.train.optim import build_lr_scheduler, build_optimizer

    torch.set_num_threads(1)
    activations, steps = {}, {}
    for name, model in (("full", _medium()), ("ac", _medium(ac=True)), ("lora", _medium(lora_rank=16))):
        step = measure_training_step(model, _medium_inputs)
        steps[name] = step
        activations[name] = step.phase_peaks["forward"] - step.parameter_bytes - step.optimizer_bytes
    checkpoint_bytes = {}
    with tempfile.TemporaryDirectory() as tmp:
        for name, model in (("full", _medium()), ("lora", _medium(lora_rank=16))):
            optimizer = build_optimizer(model.parameters(), OptimConfig())
            for param in model.parameters():
                if param.requires_grad:
                    param.grad = torch.zeros_like(param)
            optimizer.step()  # AdamW's state exists from the first step
            folder = save_checkpoint(Path(tmp) / name, model=model, optimizer=optimizer,
                                     lr_scheduler=build_lr_scheduler(optimizer, OptimConfig()),
                                     train_state=TrainState(1, 0, 1, 1, "sha256:0"), job_config={})
            checkpoint_bytes[name] = sum(f.stat().st_size for f in folder.iterdir())
    total = sum(p.numel() for p in _medium().parameters())
    return {
        "figures": {
            "ac_over_no_ac_activation_bytes": _figure("ac_over_no_ac_activation_bytes",
                                                      activations["ac"] / activations["full"]),
            "lora_trainable_fraction": _figure("lora_trainable_fraction", steps["lora"].trainable_parameters / total),
            "lora_optimizer_bytes_ratio": _figure("lora_optimizer_bytes_ratio",
                                                  steps["lora"].optimizer_bytes / steps["full"].optimizer_bytes),
            "lora_checkpoint_bytes_ratio": _figure("lora_checkpoint_bytes_ratio",
                                                   checkpoint_bytes["lora"] / checkpoint_bytes["full"]),
        },
        "details": {"activation_bytes": activations, "checkpoint_bytes": checkpoint_bytes,
                    "peak_bytes": {k: v.peak_bytes for k, v in steps.items()},
                    "medium_bucket": MEDIUM_BUCKET, "parameters": total},
    }


def measure_planner() -> dict[str, Any]:
    """(d) `benchmarks/plan_accuracy.planner_vs_measured`: every CPU strategy on the tiny and medium presets."""
    from benchmarks.plan_accuracy import planner_vs_measured

    torch.set_num_threads(1)
    rows = planner_vs_measured()
    worst = max(rows, key=lambda r: abs(1 - r["ratio"]))
    return {"figures": {"planner_peak_error": _figure("planner_peak_error", abs(1 - worst["ratio"]))},
            "details": {"planner_rows": rows}}


# ---- (e) compression hooks ----

def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _hook_run(rank: int, world_size: int, port: int, kind: str, steps: int, out: str,
              knobs: dict[str, Any] | None = None, wrap_hook: Any = None, which: str = "tiny") -> None:
    """One process of a 2-process DDP run of `steps` AdamW steps on its fixed batch, with `comm_hook_for(kind,
    **knobs)`'s hook (default knobs: PowerSGD rank 4), wrapped in `wrap_hook(hook, optimizer)` when given (a
    module-level function: spawn pickles it by name), of the `which` transformer (`HOOK_MODELS`); rank 0 saves the
    losses and all-reduced bytes per step to `out`."""
    import torch.distributed as dist
    from torch.distributed.algorithms.ddp_comm_hooks import default_hooks

    from vidray.train.parallel import comm_hook_for, prime_buckets

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=world_size)
    sent = [0.0]
    count_wire_bytes(sent, world_size)
    transformer, batch = HOOK_MODELS[which](), _tiny_batch(seed=rank, batch_size=2, size=8)
    model = torch.nn.parallel.DistributedDataParallel(transformer)
    comm, fn = comm_hook_for(kind, **(knobs or {"powersgd_rank": 4}))
    optimizer = torch.optim.AdamW([p for p in transformer.parameters() if p.requires_grad], lr=1e-3)
    if comm.state is not None:
        prime_buckets(model, lambda m: _tiny_loss(m, batch, 0))
    fn = fn if fn is not None else default_hooks.allreduce_hook
    model.register_comm_hook(comm.state, wrap_hook(fn, optimizer) if wrap_hook is not None else fn)
    losses, counted = [], []
    for step in range(1, steps + 1):
        before = sent[0]
        optimizer.zero_grad(set_to_none=True)
        loss = _tiny_loss(model, batch, step)
        loss.backward()
        optimizer.step()
        counted.append(sent[0] - before)
        losses.append(loss.item())
    if rank == 0:
        torch.save({"losses": losses, "bytes": counted}, out)
    dist.destroy_process_group()


def count_wire_bytes(sent: list[float], world_size: int) -> None:
    """Make torch.distributed's all_reduce, all_to_all_single and all_gather_single add to `sent[0]` the bytes this
    rank sends on the wire for them (ring algorithms, `world_size` ranks): 2 (W-1)/W x the tensor for an
    all-reduce, (W-1)/W x the input for an all-to-all, (W-1) x the input for an all-gather. At 2 ranks an
    all-reduce counts its tensor's bytes. So hooks built on different collectives compare by what they send
    (the int4 hook's all-to-all and all-gather against plain all-reduce)."""
    import torch.distributed as dist

    share = (world_size - 1) / world_size
    nbytes = lambda tensor: tensor.numel() * tensor.element_size()  # noqa: E731
    all_reduce, all_to_all, all_gather = dist.all_reduce, dist.all_to_all_single, dist.all_gather_single

    def counting_all_reduce(tensor, *args, **kwargs):
        sent[0] += 2 * share * nbytes(tensor)
        return all_reduce(tensor, *args, **kwargs)

    def counting_all_to_all(output, input, *args, **kwargs):
        sent[0] += share * nbytes(input)
        return all_to_all(output, input, *args, **kwargs)

    def counting_all_gather(output, input, *args, **kwargs):
        sent[0] += (world_size - 1) * nbytes(input)
        return all_gather(output, input, *args, **kwargs)

    dist.all_reduce, dist.all_to_all_single, dist.all_gather_single = (counting_all_reduce, counting_all_to_all,
                                                                      counting_all_gather)


def run_hook(kind: str, steps: int, knobs: dict[str, Any] | None = None,
             wrap_hook: Any = None, model: str = "tiny") -> dict[str, list[float]]:
    """{"losses", "bytes"} per step of rank 0 in one 2-process `_hook_run(..., knobs, wrap_hook, model)` (spawned);
    `model`: a key of `HOOK_MODELS` (KeyError in the children otherwise)."""
    import torch.multiprocessing as mp

    with tempfile.TemporaryDirectory() as tmp:
        out = str(Path(tmp) / f"{kind}.pt")
        # spawn, not fork: a fork of a process that has run torch ops can start with a corrupt heap (SIGABRT).
        mp.start_processes(_hook_run, args=(2, _free_port(), kind, steps, out, knobs, wrap_hook, model),
                           nprocs=2, start_method="spawn")
        return torch.load(out, weights_only=True)


def steady_bytes(run: dict[str, list[float]]) -> float:
    """Mean bytes all-reduced per step after the first 5 (PowerSGD's plain warm-up steps after the 5th count)."""
    return statistics.mean(run["bytes"][5:])


def late_loss(run: dict[str, list[float]]) -> float:
    """Mean loss over the last 20 steps."""
    return statistics.mean(run["losses"][-20:])


def measure_hooks(steps: int) -> dict[str, Any]:
    runs = {kind: run_hook(kind, steps) for kind in ("none", "fp16", "int4", "powersgd")}
    steady = lambda kind: steady_bytes(runs[kind])  # noqa: E731
    late = lambda kind: late_loss(runs[kind])  # noqa: E731
    return {
        "figures": {
            "fp16_hook_bytes_ratio": _figure("fp16_hook_bytes_ratio", steady("fp16") / steady("none")),
            "int4_bytes_ratio": _figure("int4_bytes_ratio", steady("int4") / steady("none")),
            "powersgd_bytes_ratio": _figure("powersgd_bytes_ratio", steady("powersgd") / steady("none")),
            "fp16_hook_loss_rel_diff": _figure("fp16_hook_loss_rel_diff", abs(late("fp16") / late("none") - 1)),
            "int4_loss_rel_diff": _figure("int4_loss_rel_diff", abs(late("int4") / late("none") - 1)),
            "powersgd_loss_rel_diff": _figure("powersgd_loss_rel_diff", abs(late("powersgd") / late("none") - 1)),
        },
        "details": {"bytes_per_step": {k: steady(k) for k in runs}, "late_loss": {k: late(k) for k in runs},
                    "first_loss": {k: runs[k]["losses"][0] for k in runs}, "steps": steps},
    }


WIDE_TRANSFORMER = dict(num_attention_heads=8, attention_head_dim=64, num_layers=2, mmdit_layers=2, time_embed_dim=256)
"""The wide model of issue 47's PowerSGD grid (`benchmarks/_powersgd_grid.py --model wide`): the tiny EasyAnimate
transformer (`TINY_TRANSFORMER`, same class and text encoder) at the medium preset's width (8 heads x 64 = 512, time
embedding 256) with 2 MMDiT blocks (14.0 M trainable parameters, ~0.18 s a step on one core). Why: the bytes goal is
about matrix width. PowerSGD at rank r sends r (n + m) numbers for an n x m gradient, so at the tiny model's width
128 a quarter of the bytes allows rank 16 at most, while real video DiTs are 3072-5120 wide, where rank 64 costs
2-4 %. The optimizer (AdamW, lr 1e-3, no warm-up), batch and steps are part (e)'s; part (e) itself stays on the tiny
model (no PowerSGD setting met its loss goal on this one either: docs/training-at-scale.md)."""


def _wide_transformer(seed: int = 0) -> torch.nn.Module:
    """`WIDE_TRANSFORMER` laid over the tiny transformer's config, built under `seed` (the global RNG is left as it
    was), with the family's unused parameters frozen as `_tiny_transformer` does."""
    from diffusers import EasyAnimateTransformer3DModel

    from vidray.models.easyanimate import TINY_TRANSFORMER
    from vidray.models.registry import get_family
    from vidray.models.text_encoder import text_hidden_size

    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        transformer = EasyAnimateTransformer3DModel(**{**TINY_TRANSFORMER, **WIDE_TRANSFORMER},
                                                    text_embed_dim=text_hidden_size("tiny_random")).train()
    no_grad = set(get_family("easyanimate").no_grad_parameter_names(transformer))
    for name, param in transformer.named_parameters():
        param.requires_grad_(name not in no_grad)
    return transformer


# ---- shared tiny model ----

def _tiny_transformer(seed: int = 0) -> torch.nn.Module:
    from vidray.config import ModelConfig
    from vidray.models.registry import get_family

    family = get_family("easyanimate")
    transformer = family.load_diffusion_models(ModelConfig(text_encoder="tiny_random"), seed=seed).transformer
    no_grad = set(family.no_grad_parameter_names(transformer))
    for name, param in transformer.named_parameters():
        param.requires_grad_(name not in no_grad)
    return transformer


def _tiny_batch(seed: int, batch_size: int, size: int):
    g = torch.Generator().manual_seed(seed)
    latents = torch.randn(batch_size, 16, 3, size, size, generator=g)
    from vidray.models.text_encoder import text_hidden_size

    prompt_embeds = torch.randn(batch_size, 8, text_hidden_size("tiny_random"), generator=g)
    return latents, prompt_embeds, torch.ones(batch_size, 8, dtype=torch.bool)


def _tiny_loss(model, batch, step: int) -> torch.Tensor:
    from vidray.config import FlowConfig
    from vidray.models.registry import get_family
    from vidray.train.step import flow_matching_step_loss, step_generator

    latents, prompt_embeds, mask = batch
    return flow_matching_step_loss(get_family("easyanimate"), model, latents, prompt_embeds, mask, FlowConfig(),
                                   step_generator(0, step, 0))


HOOK_MODELS = {"tiny": _tiny_transformer, "wide": _wide_transformer}
"""Transformers `_hook_run` trains: part (e) runs `tiny`, the PowerSGD grid also `wide`."""


# ---- (f) step times ----

def measure_bf16_step_time(repeats: int = 5, steps: int = 10) -> dict[str, Any]:
    from vidray.train.precision import Precision

    torch.set_num_threads(1)
    batch = _tiny_batch(seed=0, batch_size=4, size=16)
    times: dict[str, list[float]] = {"no": [], "bf16": []}
    for _ in range(repeats):
        for mode in ("no", "bf16"):  # interleaved A, B, A, B
            transformer = _tiny_transformer()
            precision = Precision(mode, torch.device("cpu"))
            optimizer = torch.optim.AdamW([p for p in transformer.parameters() if p.requires_grad], lr=1e-4)
            for step in range(steps + 2):
                if step == 2:
                    start = time.perf_counter()  # 2 warm-up steps
                optimizer.zero_grad(set_to_none=True)
                with precision.autocast():
                    loss = _tiny_loss(transformer, batch, step)
                precision.backward(loss)
                precision.step(optimizer)
            times[mode].append((time.perf_counter() - start) / steps)
    ratios = [b / f for b, f in zip(times["bf16"], times["no"])]
    return {"figures": {"bf16_over_fp32_step_time": _figure("bf16_over_fp32_step_time", statistics.median(ratios))},
            "details": {"bf16_step_s": times["bf16"], "fp32_step_s": times["no"],
                        "bf16_ratio_spread": [min(ratios), max(ratios)]}}


def measure_one_worker_overhead(pairs: int = 3, steps: int = 100, warmup: int = 30) -> dict[str, Any]:
    from benchmarks.train_overhead import measure

    ratios, runs = [], []
    for _ in range(pairs):  # each measure() runs vidray, then the peer twice, interleaved
        with tempfile.TemporaryDirectory() as tmp:
            result = measure(tmp, steps=steps, warmup=warmup, num_workers=1)
        ratios.append(result["figures"]["step_time_ratio"]["value"])
        runs.append({k: v.get("value") for k, v in result["figures"].items()})
    return {"figures": {"ray_train_one_worker_step_ratio": _figure("ray_train_one_worker_step_ratio",
                                                                     statistics.median(ratios))},
            "details": {"one_worker_ratios": ratios, "one_worker_runs": runs}}


PARTS = {"a": lambda a: measure_fsdp_planned(), "b": lambda a: measure_ac_and_lora(),
         "d": lambda a: measure_planner(), "e": lambda a: measure_hooks(a.steps), "f": lambda a: {
    **_merge(measure_bf16_step_time(), measure_one_worker_overhead(pairs=a.pairs))}}


def _merge(*results: dict[str, Any]) -> dict[str, Any]:
    out: dict[str, Any] = {"figures": {}, "details": {}}
    for result in results:
        out["figures"].update(result["figures"])
        out["details"].update(result.get("details", {}))
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--only", default=",".join(PARTS), help="parts to run, comma-separated (default: all)")
    ap.add_argument("--steps", type=int, default=200, help="training steps of each hook run in (e)")
    ap.add_argument("--pairs", type=int, default=3, help="interleaved vidray/peer pairs in (f)")
    a = ap.parse_args()
    results, skipped = [], []
    for part in a.only.split(","):
        try:
            results.append(PARTS[part](a))
        except Exception as err:  # a part that fails is a miss with its reason, the others still report
            last = (str(err).strip().splitlines() or [""])[-1][:300]  # a child's traceback: its last line
            skipped.append(f"part ({part}): {type(err).__name__}: {last}")
    out = _merge(*results)
    figures = fill_misses(out["figures"], FIGURES, "; ".join(skipped) or "not run (--only)")
    print(json.dumps({"benchmark": "train_scale", "figures": figures, "details": out["details"]}))


if __name__ == "__main__":
    main()
