"""Issue 45 figures of the LoRA export (`benchmarks/memory_modes.py` runs `figures()`), measured on CPU in one run:

- `adapter_export_over_base_bytes` (goal <= 0.05): the bytes of a LoRA run's adapter-only export folder
  (`export_pipeline(..., base=...)`: `lora/` in diffusers' and peft's formats, `base_model.json`, the job file)
  over the base transformer's weight bytes.
- `merged_export_peak_rss_over_base_bytes` (goal <= 0.35): `vidray export --merge-lora`'s peak resident set
  (`vidray.models.merge.export_merged` in a fresh child process: `resource.getrusage(RUSAGE_CHILDREN).ru_maxrss`)
  minus the peak of an idle child that makes the same imports (torch, peft, safetensors, vidray's export, lora and
  merge modules), over the base transformer's weight bytes. Each child reports its own
  `getrusage(RUSAGE_SELF).ru_maxrss` (what `RUSAGE_CHILDREN` gives for that one child). What counts: every
  anonymous and file-mapped page the child held at its peak; not the kernel's page cache of the files read and
  written (no process owns it).

Set-up: a base of the Wan2.1-T2V-1.3B transformer's shape (`WAN21_1_3B`: dim 1536, 30 layers, ffn 8960, 12 heads;
1.42 B parameters) with random weights in float32 (5.7 GB: the dtype vidray trains and exports in; in bf16 the
shape is 2.8 GB, the base and each streamed tensor halved alike), written once, tensor by
tensor, as safetensors shards of at most 2 GiB with diffusers' index into a temp folder (a pipeline folder holding
the transformer alone, the other components' folders empty), removed at the end. The LoRA: `model.lora` rank 16
on the default attention projections (240 layers), with random A and B, built on the meta device (the base's
weights are never in this process's memory). About 1-3 minutes and 2 x 5.7 GB of temporary disk.
"""

from __future__ import annotations

import json
import shlex
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

WAN21_1_3B = {"patch_size": [1, 2, 2], "num_attention_heads": 12, "attention_head_dim": 128, "in_channels": 16,
              "out_channels": 16, "text_dim": 4096, "freq_dim": 256, "ffn_dim": 8960, "num_layers": 30,
              "cross_attn_norm": True, "qk_norm": "rms_norm_across_heads", "eps": 1e-6, "image_dim": None,
              "added_kv_proj_dim": None, "rope_max_seq_len": 1024}
"""diffusers' WanTransformer3DModel config of Wan2.1-T2V-1.3B."""
SHARD_BYTES = 2 * 2**30
IMPORTS = ("import torch, peft, safetensors, yaml; import vidray.models.export, vidray.models.lora, "
           "vidray.models.merge")
"""What the measured child imports before it exports, and all the idle baseline child does."""

GOALS = {"adapter_export_over_base_bytes": ("ratio", "<= 0.05"),
         "merged_export_peak_rss_over_base_bytes": ("ratio", "<= 0.35")}


def _write_base(folder: Path) -> tuple[Any, int]:
    """A random-weight 1.3B-shaped base pipeline folder (transformer only) written tensor by tensor; returns (the
    meta-device transformer, the weight bytes)."""
    import torch
    from diffusers import WanTransformer3DModel

    from vidray.models.merge import _Entry, _plan_shards, _shard_header

    with torch.device("meta"):
        transformer = WanTransformer3DModel(**WAN21_1_3B)
    entries = [_Entry(name, "F32", tuple(p.shape), Path(), 0, p.numel() * 4)
               for name, p in transformer.state_dict().items()]
    shards = _plan_shards(entries, SHARD_BYTES)
    names = [f"diffusion_pytorch_model-{i + 1:05d}-of-{len(shards):05d}.safetensors" for i in range(len(shards))]
    (folder / "transformer").mkdir(parents=True)
    generator = torch.Generator().manual_seed(0)
    for shard, name in zip(shards, names):
        with open(folder / "transformer" / name, "wb") as out:
            out.write(_shard_header(shard))
            for entry in shard:
                out.write((torch.randn(entry.shape, generator=generator) * 0.02).view(torch.uint8).numpy().data)
    total = sum(e.nbytes for e in entries)
    index = {"metadata": {"total_size": total},
             "weight_map": {e.name: name for shard, name in zip(shards, names) for e in shard}}
    (folder / "transformer/diffusion_pytorch_model.safetensors.index.json").write_text(json.dumps(index))
    transformer.save_config(folder / "transformer")
    for empty in ("vae", "text_encoder", "tokenizer"):
        (folder / empty).mkdir()
    (folder / "scheduler").mkdir()
    (folder / "scheduler/scheduler_config.json").write_text(json.dumps(
        {"_class_name": "FlowMatchEulerDiscreteScheduler", "shift": 3.0, "num_train_timesteps": 1000}))
    (folder / "model_index.json").write_text(json.dumps(
        {"_class_name": "WanPipeline", "_diffusers_version": "0.42.1", "transformer": ["diffusers",
         "WanTransformer3DModel"], "scheduler": ["diffusers", "FlowMatchEulerDiscreteScheduler"],
         "vae": [None, None], "text_encoder": [None, None], "tokenizer": [None, None]}))
    return transformer, total


def _adapter_export(transformer: Any, base: Path, out: Path) -> None:
    """The LoRA run's adapter-only export: rank-16 adapters (random, materialised on CPU) on the meta base."""
    import torch

    from vidray.config import job_config_from_dict
    from vidray.models import get_family
    from vidray.models.base import Components
    from vidray.models.export import export_pipeline, lora_export_base, write_job_file
    from vidray.models.lora import apply_lora

    job = job_config_from_dict({"name": "bench-lora", "model": {
        "family": "wan", "init": "pretrained", "pretrained_path": str(base), "lora": {"rank": 16}}})
    apply_lora(transformer, job.model.lora, seed=0)
    generator = torch.Generator().manual_seed(1)
    for name, module in transformer.named_modules():
        if isinstance(module, torch.nn.Linear) and ".lora_" in name:
            module.weight = torch.nn.Parameter(torch.randn(module.weight.shape, generator=generator) * 0.01)
    family = get_family("wan")
    export_pipeline(family, Components(transformer=transformer, vae=None, text_encoder=None, tokenizer=None), out,
                    job.flow, base=lora_export_base(job))
    write_job_file(out, job)


def _child_peak_rss(code: str) -> int:
    """Peak RSS in bytes of a fresh child python running `code`: the child's own `getrusage(RUSAGE_SELF).ru_maxrss`
    (what `RUSAGE_CHILDREN` reports for it alone; read in the child so that another child of this process, e.g. a
    benchmark run before this one, cannot hide it), printed as its last line."""
    script = f"{code}\nimport resource\nprint(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss)"
    # Through `sh -c "python ...; :"`: Linux carries a process's peak RSS across execve, and a child forked (or
    # vforked) straight from this process would start its count at this process's own RSS; sh forks the python
    # from its own small memory. Measured: a child of a 1.2 GB parent reported 1.2 GB idle, through sh 0.22 GB.
    done = subprocess.run(["sh", "-c", f"{shlex.quote(sys.executable)} -c {shlex.quote(script)}; :"],
                          check=True, capture_output=True, text=True)
    return int(done.stdout.split()[-1]) * 1024  # Linux: KiB


def figures() -> dict[str, dict[str, Any]]:
    """The two export figures (see the module docstring), each {"value", "unit", "goal"}; details under
    `_details`."""
    tmp = Path(tempfile.mkdtemp(prefix="vidray-bench-export-"))
    try:
        started = time.perf_counter()
        transformer, base_bytes = _write_base(tmp / "base")
        wrote_s = time.perf_counter() - started
        _adapter_export(transformer, tmp / "base", tmp / "adapters")
        adapter_bytes = sum(p.stat().st_size for p in (tmp / "adapters").rglob("*") if p.is_file())
        idle = _child_peak_rss(IMPORTS)
        started = time.perf_counter()
        peak = _child_peak_rss(f"{IMPORTS}; from vidray.models.merge import export_merged; "
                               f"export_merged({str(tmp / 'adapters')!r}, {str(tmp / 'merged')!r})")
        merged_s = time.perf_counter() - started
        merged_bytes = sum(p.stat().st_size for p in (tmp / "merged/transformer").glob("*.safetensors"))
        return {
            "adapter_export_over_base_bytes": {"value": round(adapter_bytes / base_bytes, 5), "unit": "ratio",
                                               "goal": GOALS["adapter_export_over_base_bytes"][1]},
            "merged_export_peak_rss_over_base_bytes": {"value": round((peak - idle) / base_bytes, 5),
                                                       "unit": "ratio",
                                                       "goal": GOALS["merged_export_peak_rss_over_base_bytes"][1]},
            "_details": {"base_bytes": base_bytes, "base_dtype": "float32", "adapter_export_bytes": adapter_bytes,
                         "merged_weight_bytes": merged_bytes, "merge_child_peak_rss_bytes": peak,
                         "idle_child_peak_rss_bytes": idle, "merge_s": round(merged_s, 1),
                         "write_base_s": round(wrote_s, 1)},
        }
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


if __name__ == "__main__":
    result = figures()
    details = result.pop("_details")
    print(json.dumps({"benchmark": "memory_export", "figures": result, "details": details}))
