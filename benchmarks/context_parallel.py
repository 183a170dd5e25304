"""Benchmark of issue 47 (context parallel and CFG parallel), one run on CPU over gloo.

Run:
    .venv/bin/python benchmarks/context_parallel.py [--steps 20] [--only train,generate]

Parts:
- train: 2 gloo processes. A Wan transformer (`WanTransformer3DModel` of the tiny preset's width, `LAYERS` blocks,
  so the blocks' activations dominate as they do in a real model) is trained through `vidray.train.parallel.
  parallelize` with `parallel.context.ulysses: 2` (DDP over both ranks, each backward scaled by the degree as
  `Worker.train_step` does), against the same model trained whole by rank 0 alone (no process group), same
  weights, samples, noise and sigmas, fp32:
  `cp2_loss_rel_diff` (<= 1e-4) and `cp2_grad_cosine` (>= 0.9999) after one step (the gradients after DDP's
  average: what the optimizer sees); `cp2_20step_loss_rel_diff` (<= 1e-3), the loss of step `--steps` after as
  many AdamW steps; `cp2_activation_bytes_ratio` (<= 0.6): tensor bytes a rank holds after the forward, beyond its
  parameters and inputs (what autograd keeps for the backward, `vidray.train.memory.TensorBytesTracker`), at
  degree 2 (the larger rank's) / degree 1; `cp2_planner_activation_error` (<= 0.15): `abs(1 - planned /
  measured)` of the planner's activation term for one rank at degree 2 (`vidray.train.plan.planned_activation_bytes`
  of the same shape) against that measurement.
- generate: the tiny Wan model (random weights, exported as a run exports it) samples one video
  (`vidray.inference.sampler.generate_video`, 4 steps, seed 7) in one process and split over 2 gloo processes
  (`vidray.inference.parallel`): `cp2_generate_psnr_db` (>= 40) without guidance, the sequence split over both
  (context degree 2); `cfg_parallel_generate_psnr_db` (>= 40) with guidance 4, one branch a process. PSNR of
  rank 0's frames against the one process's (inf when equal, reported as 100).

The last stdout line is one JSON object, `{"benchmark": "context_parallel", "figures": {...}}`; a figure that could
not be measured is a miss with its reason (`benchmarks/_figures.py`).
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import sys
import tempfile
from pathlib import Path
from typing import Any

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from benchmarks._figures import fill_misses  # noqa: E402

FIGURES = {
    "cp2_loss_rel_diff": ("ratio", "<= 1e-4"),
    "cp2_grad_cosine": ("ratio", ">= 0.9999"),
    "cp2_20step_loss_rel_diff": ("ratio", "<= 1e-3"),
    "cp2_activation_bytes_ratio": ("ratio", "<= 0.6"),
    "cp2_planner_activation_error": ("ratio", "<= 0.15"),
    "cp2_generate_psnr_db": ("dB", ">= 40"),
    "cfg_parallel_generate_psnr_db": ("dB", ">= 40"),
}
GENERATE_BUCKET = (9, 64, 64)
"""(num_frames, height, width) of the generated videos: 3 x 4 x 4 = 48 latent tokens, 24 a rank at degree 2."""
LAYERS = 8
"""Transformer blocks of the benchmark's Wan model: the tiny preset has 2, whose patch embedding, rope and output
projection (run whole on every rank) would weigh as much as the blocks; a real Wan has 30-40."""
LATENT_SHAPE = (1, 16, 5, 16, 16)
"""(B, C, F_lat, H_lat, W_lat): 2 x 8 x 8 x 5 = 320 video tokens after Wan's (1, 2, 2) patches, 160 a rank."""
TEXT_TOKENS = 16


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def _job(degree: int):
    from vidray.config import load_job_config

    return load_job_config(Path(__file__).resolve().parents[1] / "jobs/configs/wan_t2v_tiny.yaml", [
        f"scaling.num_workers={degree}", f"parallel.context.ulysses={degree}", "train.micro_batches_per_step=1",
        "optim.warmup_steps=0", f"model.max_sequence_length={TEXT_TOKENS}", "data.buckets=[[17, 128, 128]]"])


def _config() -> dict[str, Any]:
    from vidray.models.wan import TINY_TRANSFORMER

    return {**TINY_TRANSFORMER, "num_layers": LAYERS, "text_dim": 32}


def _transformer(seed: int = 0) -> torch.nn.Module:
    from diffusers import WanTransformer3DModel

    torch.manual_seed(seed)
    return WanTransformer3DModel(**_config()).float().train()


def _planned_activation_bytes(degree: int) -> int:
    from vidray.buckets import Bucket
    from vidray.shape_presets import ShapePreset
    from vidray.train.plan import planned_activation_bytes

    preset = ShapePreset("wan-benchmark", "wan", _config(), text_seq_len=TEXT_TOKENS)
    return planned_activation_bytes(preset, Bucket(17, 128, 128), degree).total


def _batch(step: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(latents (1, 16, 5, 16, 16), prompt_embeds (1, TEXT_TOKENS, 32), mask (1, TEXT_TOKENS) bool) of a step."""
    g = torch.Generator().manual_seed(1000 + step)
    return (torch.randn(LATENT_SHAPE, generator=g), torch.randn(1, TEXT_TOKENS, 32, generator=g),
            torch.ones(1, TEXT_TOKENS, dtype=torch.bool))


def _loss(family, model, job, step: int) -> torch.Tensor:
    from vidray.train.step import flow_matching_step_loss, sample_generator

    latents, embeds, mask = _batch(step)
    return flow_matching_step_loss(family, model, latents, embeds, mask, job.flow,
                                   [sample_generator(job.train.seed, step, 0)])


def _activation_bytes(family, model, job) -> int:
    """Tensor bytes held after one forward (the loss kept alive) beyond the parameters and the step's inputs."""
    from vidray.train.memory import TensorBytesTracker

    tracker = TensorBytesTracker()
    with tracker:
        tracker.track(list(model.parameters()), list(model.buffers()), _batch(1))
        before = tracker.current_bytes
        loss = _loss(family, model, job, 1)
        held = tracker.current_bytes - before
    del loss
    return held


def _grads(model: torch.nn.Module) -> torch.Tensor:
    return torch.cat([p.grad.flatten() for p in model.parameters() if p.grad is not None])


def _train_rank(rank: int, world_size: int, port: int, steps: int, out: str) -> None:
    import torch.distributed as dist

    from vidray.models import get_family
    from vidray.train.optim import build_optimizer
    from vidray.train.parallel import parallelize

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=world_size)
    try:
        job, reference_job = _job(world_size), _job(1)
        family = get_family("wan").for_model(job.model)
        result: dict[str, Any] = {}
        if rank == 0:  # the whole model, trained by this process alone (no collective)
            reference = _transformer()
            result["bytes_1"] = _activation_bytes(family, reference, reference_job)
            optimizer = build_optimizer(reference.parameters(), reference_job.optim)
            for step in range(1, steps + 1):
                optimizer.zero_grad(set_to_none=True)
                loss = _loss(family, reference, reference_job, step)
                loss.backward()
                if step == 1:
                    result["loss_1"], result["grads_1"] = loss.item(), _grads(reference).clone()
                optimizer.step()
                result["loss_last_1"] = loss.item()
        transformer = _transformer()
        model, _ = parallelize(transformer, job, family=family, device=torch.device("cpu"))
        result["bytes_2"] = _activation_bytes(family, model, job)
        optimizer = build_optimizer(transformer.parameters(), job.optim)
        degree = job.parallel.context.degree
        for step in range(1, steps + 1):
            optimizer.zero_grad(set_to_none=True)
            loss = _loss(family, model, job, step)
            (loss * degree).backward()  # as Worker.train_step: DDP's average over the group becomes its sum
            if step == 1:
                result["loss_2"], result["grads_2"] = loss.item(), _grads(transformer).clone()
            optimizer.step()
            result["loss_last_2"] = loss.item()
        if rank == 1:
            torch.save({"bytes_2": result["bytes_2"]}, out + ".rank1")
        dist.barrier()
        if rank == 0:
            result["bytes_2"] = max(result["bytes_2"], torch.load(out + ".rank1")["bytes_2"])
            torch.save(result, out)
    finally:
        dist.destroy_process_group()


def measure_train(steps: int) -> dict[str, Any]:
    """The train part's figures (module docstring), from 2 spawned gloo ranks."""
    import torch.multiprocessing as mp

    with tempfile.TemporaryDirectory(prefix="vidray-cp-") as tmp:
        out = str(Path(tmp) / "result.pt")
        mp.start_processes(_train_rank, args=(2, _free_port(), steps, out), nprocs=2, start_method="spawn")
        r = torch.load(out)
    whole, split = r["grads_1"].double(), r["grads_2"].double()
    cosine = torch.nn.functional.cosine_similarity(whole, split, dim=0).item()
    figures = {
        "cp2_loss_rel_diff": abs(r["loss_2"] / r["loss_1"] - 1),
        "cp2_grad_cosine": cosine,
        "cp2_20step_loss_rel_diff": abs(r["loss_last_2"] / r["loss_last_1"] - 1),
        "cp2_activation_bytes_ratio": r["bytes_2"] / r["bytes_1"],
        "cp2_planner_activation_error": abs(1 - _planned_activation_bytes(2) / r["bytes_2"]),
    }
    print(f"[train] planned activation bytes a rank: {_planned_activation_bytes(1):,} at degree 1, "
          f"{_planned_activation_bytes(2):,} at degree 2", flush=True)
    print(f"[train] loss {r['loss_1']:.6f} whole vs {r['loss_2']:.6f} at degree 2; step {steps}: "
          f"{r['loss_last_1']:.6f} vs {r['loss_last_2']:.6f}; activation bytes {r['bytes_1']:,} vs "
          f"{r['bytes_2']:,} a rank; gradient norm ratio {(split.norm() / whole.norm()).item():.6f}", flush=True)
    return figures


def _wan_folder(folder: Path) -> Path:
    """The tiny random Wan model saved as a run exports it (diffusers folder + vidray_job.yaml)."""
    from vidray.config import FlowConfig, ModelConfig, job_config_from_dict
    from vidray.generate import write_job_file
    from vidray.models import get_family

    model = {"family": "wan", "text_encoder": "tiny_random", "max_sequence_length": TEXT_TOKENS}
    family = get_family("wan")
    out = family.save_pipeline(family.build(ModelConfig(**model), seed=0), folder / "diffusers", FlowConfig(shift=3.0))
    write_job_file(out, job_config_from_dict({"name": "tiny-wan", "model": model,
                                              "data": {"buckets": [list(GENERATE_BUCKET)]}, "flow": {"shift": 3.0}}))
    return out


def _sample(folder: Path, guidance: float, parallel=None):
    """(frames (1, F, H, W, 3) uint8, or None off rank 0) of the benchmark's prompt."""
    from vidray.buckets import Bucket
    from vidray.generate import load_model
    from vidray.inference.sampler import generate_video

    model = load_model(folder)
    if parallel is not None:
        parallel.parallelize(model.components.transformer, model.family.name)
    return generate_video(model.family, model.components, ["a red ball bouncing"], Bucket(*GENERATE_BUCKET),
                          flow=model.flow, num_inference_steps=4, guidance_scale=guidance,
                          max_sequence_length=model.max_sequence_length, seed=7, parallel=parallel)


def _generate_rank(rank: int, device, folder: str, guidance: float, out: str) -> None:
    from vidray.inference.parallel import setup_generation_parallel

    parallel = setup_generation_parallel(2, rank, guidance=guidance > 1, device_type="cpu", family_name="wan")
    frames = _sample(Path(folder), guidance, parallel)
    if rank == 0:
        torch.save({"frames": frames, "context": parallel.context, "cfg": parallel.cfg}, out)


def _psnr(a, b) -> float:
    """`vidray.compare.video_psnr` of uint8 videos `a` against `b`, 100 dB when equal (JSON has no inf)."""
    from vidray.compare import video_psnr

    value = video_psnr(a, b)
    return 100.0 if value == float("inf") else value


def measure_generate() -> dict[str, Any]:
    """The generate part's figures (module docstring)."""
    from vidray.inference.parallel import run_ranks

    figures = {}
    with tempfile.TemporaryDirectory(prefix="vidray-cp-gen-") as tmp:
        folder = _wan_folder(Path(tmp))
        for name, guidance, degrees in (("cp2_generate_psnr_db", 1.0, (1, 2)),
                                        ("cfg_parallel_generate_psnr_db", 4.0, (2, 1))):
            whole = _sample(folder, guidance)
            out = str(Path(tmp) / f"{name}.pt")
            run_ranks(_generate_rank, (str(folder), guidance, out), 2, backend="gloo")
            split = torch.load(out, weights_only=False)
            assert (split["cfg"], split["context"]) == degrees, (name, split["cfg"], split["context"])
            figures[name] = _psnr(split["frames"], whole)
            print(f"[generate] guidance {guidance:g}: cfg {split['cfg']} x context {split['context']} over 2 "
                  f"processes vs 1: PSNR {figures[name]:.1f} dB", flush=True)
    return figures


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--only", default="train,generate")
    args = parser.parse_args()
    parts = set(args.only.split(","))
    figures: dict[str, Any] = {}
    reason = f"not run (--only {args.only})"
    if "train" in parts:
        try:
            values = measure_train(args.steps)
            figures.update({name: {"value": values[name], "unit": FIGURES[name][0], "goal": FIGURES[name][1]}
                            for name in values})
        except Exception as err:  # noqa: BLE001 - a miss with its reason, the other parts still run
            reason = f"the train part failed: {err!r}"[:300]
    if "generate" in parts:
        try:
            values = measure_generate()
            figures.update({name: {"value": values[name], "unit": FIGURES[name][0], "goal": FIGURES[name][1]}
                            for name in values})
        except Exception as err:  # noqa: BLE001 - a miss with its reason
            reason = f"the generate part failed: {err!r}"[:300]
    print(json.dumps({"benchmark": "context_parallel", "figures": fill_misses(figures, FIGURES, reason)}))


if __name__ == "__main__":
    main()
