"""Issue 28 figure (d): the memory planner's predicted per-rank peak over the measured one, for the tiny and medium
presets in every strategy a CPU runs (fp32 / bf16 x full, AC, LoRA, LoRA + AC), single process.

Measured: peak live tensor bytes of the second training step (forward + backward + fused AdamW step) with
`vidray.train.memory.measure_training_step` (a TorchDispatchMode counting storages, not RSS). Predicted:
`vidray.train.plan.estimate_memory` for one GPU (no DDP buckets). FSDP is not measured on CPU (arithmetic only).

    .venv/bin/python benchmarks/plan_accuracy.py        # ~30 s on 2 cores; last line: the JSON figures

`benchmarks/train_scale.py` may import `planner_vs_measured` for its figure (d).
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import torch  # noqa: E402

CASES = {"tiny": ((9, 64, 64), 2), "medium": ((9, 128, 128), 1)}
"""Preset -> (bucket, batch size) measured."""
LORA_RANK = 8
TEXT_TOKENS = 32


def planner_vs_measured(cases: dict = CASES) -> list[dict]:
    """One row per (preset, strategy): measured and predicted peak bytes and their ratio (predicted / measured)."""
    from diffusers import EasyAnimateTransformer3DModel
    from peft import LoraConfig, inject_adapter_in_model

    from vidray.buckets import Bucket
    from vidray.models.presets import get_preset
    from vidray.train.memory import measure_training_step
    from vidray.train.plan import lora_targets, Strategy, count_model, estimate_memory

    rows = []
    for name, (bucket, batch) in cases.items():
        preset, bucket = get_preset(name), Bucket(*bucket)
        counts = count_model(preset, lora_rank=LORA_RANK)
        f_lat, h_lat, w_lat = (bucket.num_frames - 1) // 4 + 1, bucket.height // 8, bucket.width // 8
        for kind in ("ddp", "lora"):
            for ac in (False, True):
                for precision in ("fp32", "bf16"):
                    strategy = Strategy(kind, ac, precision)
                    torch.manual_seed(0)
                    model = EasyAnimateTransformer3DModel(**preset.config)
                    if kind == "lora":
                        model.requires_grad_(False)
                        inject_adapter_in_model(LoraConfig(r=LORA_RANK, lora_alpha=LORA_RANK,
                                                           target_modules=list(lora_targets("easyanimate"))), model)
                    if ac:
                        model.enable_gradient_checkpointing()
                    model.train()

                    def inputs():
                        return dict(hidden_states=torch.randn(batch, 16, f_lat, h_lat, w_lat),
                                    timestep=torch.rand(batch) * 1000,
                                    encoder_hidden_states=torch.randn(batch, TEXT_TOKENS, 384))

                    measured = measure_training_step(
                        model, inputs, autocast_dtype=torch.bfloat16 if precision == "bf16" else None).peak_bytes
                    predicted = estimate_memory(preset, counts, strategy, bucket=bucket, batch_size=batch,
                                                text_tokens=TEXT_TOKENS).peak_bytes
                    rows.append({"preset": name, "bucket": str(bucket), "batch": batch, "strategy": strategy.name,
                                 "measured_bytes": measured, "predicted_bytes": predicted,
                                 "ratio": round(predicted / measured, 4)})
    return rows


def main() -> None:
    torch.set_num_threads(1)  # small steps; two threads on a shared 2-core machine ran them 10x slower
    rows = planner_vs_measured()
    print(f"{'preset':<8}{'bucket':<12}{'strategy':<14}{'measured MiB':>13}{'predicted MiB':>14}{'ratio':>8}")
    for r in rows:
        print(f"{r['preset']:<8}{r['bucket']:<12}{r['strategy']:<14}{r['measured_bytes'] / 2**20:>13.1f}"
              f"{r['predicted_bytes'] / 2**20:>14.1f}{r['ratio']:>8.3f}")
    worst = max(abs(1 - r["ratio"]) for r in rows)
    figures = {"planner_peak_abs_error": {"value": round(worst, 4), "unit": "abs(1 - predicted/measured), worst case",
                                          "goal": "<= 0.15"}}
    print(json.dumps({"benchmark": "plan_accuracy", "figures": figures, "details": {"rows": rows}}))


if __name__ == "__main__":
    main()
