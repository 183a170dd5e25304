"""Benchmark of issue 29's model families: each registered family's tiny training step, and how much of the model
each serve stage replica holds, in one process; and Wan's two expert groups against one model, in Ray Train runs.

Run:
    flock /tmp/vidray-ray.lock .venv/bin/python benchmarks/families.py [--steps 5] [--ray-pairs 2]   # ~6 min

For each family of `vidray.models.registry.FAMILIES`, from its shipped tiny config (`jobs/configs/`: the one whose
`model.family` it is) with `model.text_encoder: tiny_random`:
- `<family>_train_step_s`, `<family>_samples_per_s` (reported): the median over `--steps` (after one warm-up) of one
  training step (the family's loss at its example bucket's latents, batch 2, backward, AdamW), 1 thread; and the
  batch over that median.
- `<family>_denoiser_over_pipeline_bytes` (goal <= 0.7), `<family>_text_over_pipeline_bytes` and
  `<family>_decoder_over_pipeline_bytes` (reported): the parameter and buffer bytes of the modules a serve stage
  replica loads (`vidray.models.export.load_model(components=...)`, as `vidray.serve.stages` does) over those of
  the whole pipeline, from the family's export. These are the modules' bytes, not a process's resident memory.
- `wan_two_experts_step_over_one_samples_per_s` (reported): the training step of Wan's two experts as one
  `TwoExperts` (`model.experts`: every worker holds both, each sample by the expert of its timestep) against one
  transformer of the same size, samples/s over samples/s, same batch and seeds.
- `wan_two_experts_denoiser_over_pipeline_bytes` (goal <= 0.7): a two-expert export's (`model.experts`) bytes that
  one expert's denoiser replica loads (`load_model(components=("transformer",), expert=...)`, as `Denoiser` and
  `LowNoiseDenoiser` do; the larger of the two) over the whole pipeline's, both experts included.
- `two_experts_over_one_samples_per_s` (goal >= 0.9): Wan 2.2 A14B's two experts in one Ray Train job
  (`model.experts` layout groups), one worker per expert, against one Wan model of the same transformer size with
  two workers, on a local Ray of 4 CPUs: samples through a transformer per second (each expert trains every sample
  of its step: G x batch per expert), from rank 0's median step time after the first; `--ray-pairs` runs of each,
  interleaved (one model, two experts, one model, ...) after a warm-up run that fills the latent cache; the median
  of the pairs' ratios, with their spread in the details. `--ray-pairs 0` leaves it a miss.

The last stdout line is one JSON object: {"benchmark": "families", "figures": {...}, "details": {...}}.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from benchmarks._figures import miss  # noqa: E402

STAGES = {"denoiser": "transformer", "text": "text_encoder", "decoder": "vae"}
"""Serve stage -> the component its replica loads (`vidray.serve.stages`)."""


def say(message: str) -> None:
    print(f"[families-bench] {message}", flush=True)


def shipped_config(family: str, *overrides: str):
    """The family's tiny text-to-video job config from jobs/configs/ (one transformer, no image condition;
    tiny_random text encoder), with `overrides` (`key=value`). Raises LookupError without one."""
    import yaml

    from vidray.config import load_job_config

    for path in sorted((REPO / "jobs" / "configs").glob("*.yaml")):
        model = yaml.safe_load(path.read_text()).get("model") or {}
        if model.get("family", "easyanimate") == family and not model.get("i2v") and not model.get("experts"):
            return path, load_job_config(path, ["model.text_encoder=tiny_random", *overrides])
    raise LookupError(f"no text-to-video config under jobs/configs/ has model.family: {family}")


def module_bytes(module) -> int:
    """Bytes of a module's parameters and buffers (0 for None)."""
    if module is None:
        return 0
    return sum(t.numel() * t.element_size() for t in [*module.parameters(), *module.buffers()])


def train_step_seconds(family, job, steps: int) -> float:
    """Median seconds of one training step of the tiny preset at the family's example bucket, batch 2."""
    import torch

    from vidray.buckets import Bucket
    from vidray.train.step import flow_matching_step_loss

    components = family.build(job.model, seed=0)
    bucket = Bucket(*family.example_bucket)
    video = torch.rand(2, 3, bucket.num_frames, bucket.height, bucket.width, generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        latents = family.encode_video(components.vae, video * 2 - 1)
        embeds, mask = family.encode_prompt(components.text_encoder, components.tokenizer, ["a cat", "a dog"],
                                            max_sequence_length=job.model.max_sequence_length)
    optimizer = torch.optim.AdamW([p for p in components.transformer.parameters() if p.requires_grad], lr=1e-4)
    seconds = []
    for step in range(steps + 1):
        generators = [torch.Generator().manual_seed(step * 2 + i) for i in range(2)]
        start = time.perf_counter()
        loss = flow_matching_step_loss(family, components.transformer, latents, embeds, mask, job.flow, generators)
        loss.backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        if step:  # the first step warms up
            seconds.append(time.perf_counter() - start)
    return statistics.median(seconds)


def stage_bytes(family, job, tmp: Path) -> dict[str, int]:
    """{"pipeline": whole, stage: bytes of what its replica loads} from the family's export of the tiny preset."""
    from vidray.models.export import load_model, write_job_file

    folder = family.save_pipeline(family.build(job.model, seed=0), tmp / family.name, job.flow)
    write_job_file(folder, job)
    whole = load_model(folder).components
    sizes = {"pipeline": sum(module_bytes(getattr(whole, c)) for c in STAGES.values())}
    for stage, component in STAGES.items():
        sizes[stage] = module_bytes(getattr(load_model(folder, components=(component,)).components, component))
    return sizes


def expert_stage_bytes(family, job, tmp: Path) -> tuple[int, int]:
    """(bytes of the larger expert's denoiser load, bytes of the whole pipeline) of a two-expert export."""
    from vidray.models.export import load_model, write_job_file

    folder = family.save_pipeline(family.build(job.model, seed=0), tmp / "experts", job.flow)
    write_job_file(folder, job)
    whole = load_model(folder).components
    experts = [module_bytes(load_model(folder, components=("transformer",), expert=expert).components.transformer)
               for expert in ("high", "low")]
    return max(experts), sum(module_bytes(getattr(whole, c)) for c in STAGES.values())


def samples_per_s(result, job) -> float:
    """Samples through a transformer per second of a finished run: each expert group (or the one model) trains
    G x batch samples a step; rank 0's median step time (data wait + DiT) after the first step."""
    seconds = [s[1] + s[3] for s in result.step_seconds[1:]]
    groups = 2 if job.model.experts is not None and job.model.experts.layout == "groups" else 1
    return groups * job.global_batch_size / statistics.median(seconds)


def two_experts_over_one(args, tmp: Path) -> tuple[list[float], list[dict[str, Any]]]:
    """([two experts' samples/s over one model's, per interleaved pair], [each run's figures]): Ray Train runs of
    `wan_t2v_tiny.yaml` (one model, 2 workers) and the same with `model.experts` (one worker per expert)."""
    import ray

    from vidray.data.ingest import prepare
    from vidray.runtime import init_ray
    from vidray.train.trainer import run_training

    path, one_job = shipped_config("wan")
    shards = tmp / "shards"
    prepare(REPO / "samples" / "metadata.json", shards, buckets=one_job.data.buckets, fps=8.0, samples_per_shard=8)
    common = [f"data.shards_dir={shards}", f"storage.path={tmp / 'runs'}", f"data.latent_cache={tmp / 'latents'}",
              "scaling.num_workers=2", "train.log_every_steps=1", "checkpoint.every_steps=1000",
              "train.validation.every_steps=null"]

    def run(name: str, steps: int, *extra: str) -> tuple[Any, Any]:
        job = shipped_config("wan", *common, f"name={name}", f"train.max_steps={steps}", *extra)[1]
        return run_training(job), job

    started = init_ray(num_cpus=4)
    ratios, runs = [], []
    try:
        run("warm-up", 2)  # fills the latent cache both layouts read
        for pair in range(args.ray_pairs):
            one = samples_per_s(*run(f"one-{pair}", args.ray_steps))
            two = samples_per_s(*run(f"two-{pair}", args.ray_steps, "model.experts.boundary_ratio=0.9"))
            say(f"pair {pair}: one model {one:.2f} samples/s, two expert groups {two:.2f} samples/s")
            ratios.append(two / one)
            runs.append({"one_samples_per_s": round(one, 3), "two_samples_per_s": round(two, 3)})
    finally:
        if started:
            ray.shutdown()
    return ratios, runs


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--steps", type=int, default=5, help="timed training steps per family (after one warm-up)")
    parser.add_argument("--ray-pairs", type=int, default=2,
                        help="interleaved Ray Train runs of one model and of two expert groups (0: skip)")
    parser.add_argument("--ray-steps", type=int, default=8, help="training steps of each of those runs")
    args = parser.parse_args()

    import torch

    from vidray.models.registry import FAMILIES

    torch.set_num_threads(1)
    figures: dict[str, Any] = {}
    details: dict[str, Any] = {}
    with tempfile.TemporaryDirectory(prefix="vidray-families-") as tmp:
        for name, family in sorted(FAMILIES.items()):
            path, job = shipped_config(name)
            step_s = train_step_seconds(family, job, args.steps)
            sizes = stage_bytes(family, job, Path(tmp))
            say(f"{name} ({path.name}): step {step_s:.3f} s; bytes {sizes}")
            figures[f"{name}_train_step_s"] = {"value": round(step_s, 4), "unit": "s"}
            figures[f"{name}_samples_per_s"] = {"value": round(2 / step_s, 3), "unit": "samples/s"}
            for stage in STAGES:
                figure = {"value": round(sizes[stage] / sizes["pipeline"], 4), "unit": "ratio"}
                if stage == "denoiser":
                    figure["goal"] = "<= 0.7"
                figures[f"{name}_{stage}_over_pipeline_bytes"] = figure
            details[name] = {"config": str(path.relative_to(REPO)), "bucket": list(family.example_bucket),
                             "bytes": sizes}
        _, experts_job = shipped_config("wan", "model.experts.boundary_ratio=0.9")
        one_s = train_step_seconds(FAMILIES["wan"], shipped_config("wan")[1], args.steps)
        two_s = train_step_seconds(FAMILIES["wan"], experts_job, args.steps)
        say(f"wan step: one transformer {one_s:.4f} s, two experts (each sample by its expert) {two_s:.4f} s")
        figures["wan_two_experts_step_over_one_samples_per_s"] = {"value": round(one_s / two_s, 3), "unit": "ratio"}
        expert_bytes, whole_bytes = expert_stage_bytes(FAMILIES["wan"], experts_job, Path(tmp))
        say(f"wan two experts: one expert's denoiser {expert_bytes} bytes of the pipeline's {whole_bytes}")
        figures["wan_two_experts_denoiser_over_pipeline_bytes"] = {
            "value": round(expert_bytes / whole_bytes, 4), "unit": "ratio", "goal": "<= 0.7"}
        if args.ray_pairs > 0:
            ratios, runs = two_experts_over_one(args, Path(tmp))
            figures["two_experts_over_one_samples_per_s"] = {"value": round(statistics.median(ratios), 3),
                                                             "unit": "ratio", "goal": ">= 0.9"}
            details["two_experts_over_one"] = {"ratios": [round(r, 3) for r in ratios], "runs": runs}
    figures.setdefault("two_experts_over_one_samples_per_s", miss(
        "--ray-pairs 0: the Ray Train runs were skipped", unit="ratio", goal=">= 0.9"))
    print(json.dumps({"benchmark": "families", "figures": figures, "details": details}))


if __name__ == "__main__":
    main()
