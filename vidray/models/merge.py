"""A LoRA run's merged export, written tensor by tensor: `vidray export --merge-lora SOURCE OUT_DIR`.

The default export of a LoRA run is adapter-only (`vidray.models.export.export_pipeline`: `lora/` + a reference to
the base). `export_merged` writes a complete diffusers folder whose transformer holds W + scale * B @ A for every
adapted layer (scale = lora_alpha / r, or lora_alpha / sqrt(r) with rsLoRA: what peft's `merge` folds in), and
whose other components are the base's files, copied. Host memory stays near one tensor, not the model:

- each base weights file is read by its safetensors header (names, dtypes, shapes, byte offsets) and then one
  tensor at a time with plain file reads into a buffer of that tensor's size. Not `safetensors.safe_open`: it
  maps each file whole, and the mapped pages its reads touch count in the process's resident set while the file
  stays open; streaming the 5.7 GB base of `benchmarks/_memory_export.py` through it peaked at 6.4 GB of RSS
  (1.05 x the base), through plain reads at 0.23 GB above the imports (0.041 x; `docs/performance.md`);
- the output is planned from the input headers (a merged tensor keeps its dtype and shape), so each shard's
  header is written first and its tensors streamed after it: shards of at most `max_shard_bytes` (one tensor
  larger than that gets a shard of its own), named and indexed as diffusers' `save_pretrained` names them
  (`diffusion_pytorch_model-00001-of-00003.safetensors` + `diffusion_pytorch_model.safetensors.index.json`; one
  shard: `diffusion_pytorch_model.safetensors`, no index).

A `model.init: random` run's base exists in no folder: its merged export is built in memory (`load_model`, then
the family's `save_pipeline`), as small as the tiny models such runs use.
"""

from __future__ import annotations

import contextlib
import json
import math
import os
import shutil
import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, BinaryIO

from vidray.errors import UserError
from vidray.locations import is_uri

if TYPE_CHECKING:
    import torch

__all__ = ["DEFAULT_SHARD_BYTES", "MergeError", "export_merged", "merge_into_folder"]

DEFAULT_SHARD_BYTES = 2 * 2**30
"""Largest weights shard `export_merged` writes, in bytes (2 GiB; diffusers' own default is 10 GB)."""

_DTYPES = {"F64": "float64", "F32": "float32", "F16": "float16", "BF16": "bfloat16", "I64": "int64",
           "I32": "int32", "I16": "int16", "I8": "int8", "U8": "uint8", "BOOL": "bool",
           "F8_E4M3": "float8_e4m3fn", "F8_E5M2": "float8_e5m2"}
"""safetensors dtype names -> torch dtype attribute names."""


class MergeError(UserError):
    """A merged export that cannot be written: the source holds no LoRA, an adapter targets a weight the base lacks
    or has another shape, or the base's weights are not safetensors. The message names the file."""


@dataclass(frozen=True)
class _Entry:
    name: str
    dtype: str
    shape: tuple[int, ...]
    file: Path
    begin: int
    end: int

    @property
    def nbytes(self) -> int:
        return self.end - self.begin


def _read_entries(path: Path) -> list[_Entry]:
    """Every tensor of the safetensors file `path`, in the order of its bytes, from the header alone."""
    with open(path, "rb") as f:
        length = int.from_bytes(f.read(8), "little")
        header = json.loads(f.read(length))
    start = 8 + length
    entries = [_Entry(name, meta["dtype"], tuple(meta["shape"]), path, start + meta["data_offsets"][0],
                      start + meta["data_offsets"][1])
               for name, meta in header.items() if name != "__metadata__"]
    unknown = sorted({e.dtype for e in entries} - set(_DTYPES))
    if unknown:
        raise MergeError(f"{path} holds tensors of dtype {unknown[0]}, which the merged export does not read")
    return sorted(entries, key=lambda e: e.begin)


def _weights_files(folder: Path) -> tuple[str, list[Path]]:
    """(the weights' file stem, its safetensors files) of a diffusers model folder: the shards its
    `*.safetensors.index.json` names, else its one `*.safetensors`."""
    indexes = sorted(folder.glob("*.safetensors.index.json"))
    if indexes:
        weight_map = json.loads(indexes[0].read_text())["weight_map"]
        return indexes[0].name[: -len(".safetensors.index.json")], [folder / f for f in sorted(set(weight_map.values()))]
    files = sorted(p for p in folder.glob("*.safetensors"))
    if len(files) != 1:
        raise MergeError(f"{folder} holds {len(files)} .safetensors files and no .safetensors.index.json: the merged "
                         "export reads a diffusers model folder saved as safetensors (save_pretrained)")
    return files[0].name[: -len(".safetensors")], files


def _read_tensor(f: BinaryIO, entry: _Entry) -> "torch.Tensor":
    """`entry`'s tensor read from the open file `f` into a buffer of its own (no mapping of the file)."""
    import torch  # heavy: torch, numpy

    dtype = getattr(torch, _DTYPES[entry.dtype])
    if entry.nbytes == 0:
        return torch.empty(entry.shape, dtype=dtype)
    f.seek(entry.begin)
    buffer = bytearray(entry.nbytes)
    if f.readinto(buffer) != entry.nbytes:
        raise MergeError(f"{entry.file} is cut short inside {entry.name}: the base's weights are damaged")
    return torch.frombuffer(buffer, dtype=dtype).reshape(entry.shape)


def _plan_shards(entries: list[_Entry], max_shard_bytes: int) -> list[list[_Entry]]:
    shards: list[list[_Entry]] = [[]]
    size = 0
    for entry in entries:
        if shards[-1] and size + entry.nbytes > max_shard_bytes:
            shards.append([])
            size = 0
        shards[-1].append(entry)
        size += entry.nbytes
    return shards


def _shard_header(shard: list[_Entry]) -> bytes:
    header: dict[str, Any] = {"__metadata__": {"format": "pt"}}
    offset = 0
    for entry in shard:
        header[entry.name] = {"dtype": entry.dtype, "shape": list(entry.shape),
                              "data_offsets": [offset, offset + entry.nbytes]}
        offset += entry.nbytes
    raw = json.dumps(header, separators=(",", ":")).encode()
    raw += b" " * (-len(raw) % 8)  # the data starts 8-byte aligned, as safetensors writes it
    return len(raw).to_bytes(8, "little") + raw


def merge_into_folder(src: Path, dst: Path, adapters: dict[str, tuple["torch.Tensor", "torch.Tensor", float]], *,
                      max_shard_bytes: int = DEFAULT_SHARD_BYTES) -> int:
    """Write the diffusers model folder `src` (config.json + safetensors weights) into `dst` with each adapter
    folded in: `adapters` maps a module name (`blocks.0.attn1.to_q`) to (A (r x in), B (out x r), scale); its
    `<name>.weight` becomes W + (B @ A) * scale, computed in float32 and stored in W's dtype. Reads and writes
    one tensor at a time (see the module docstring). Returns the weight bytes written. Raises MergeError naming
    `src` when an adapter's weight is missing from the base or has another shape."""
    import torch  # heavy: torch, numpy

    stem, files = _weights_files(src)
    entries = [e for path in files for e in _read_entries(path)]
    by_name = {e.name: e for e in entries}
    for module, (a, b, _) in adapters.items():
        entry = by_name.get(f"{module}.weight")
        if entry is None:
            raise MergeError(f"the LoRA adapts {module}, which the base {src} lacks: these adapters were trained "
                             "on another model")
        if entry.shape != (b.shape[0], a.shape[1]):
            raise MergeError(f"the LoRA of {module} is {b.shape[0]} x {a.shape[1]} but the base {src} has "
                             f"{list(entry.shape)}: these adapters were trained on another model")
    dst.mkdir(parents=True, exist_ok=True)
    for path in src.iterdir():  # config.json and anything else that is not the weights
        if path.is_file() and not path.name.startswith(stem + "."):
            if not (path.name.startswith(stem + "-") and path.suffix == ".safetensors"):
                shutil.copy2(path, dst / path.name)
    shards = _plan_shards(entries, max_shard_bytes)
    names = ([f"{stem}.safetensors"] if len(shards) == 1
             else [f"{stem}-{i + 1:05d}-of-{len(shards):05d}.safetensors" for i in range(len(shards))])
    handles: dict[Path, BinaryIO] = {}
    total = 0
    with contextlib.ExitStack() as stack:
        for shard, name in zip(shards, names):
            with open(dst / name, "wb") as out:
                out.write(_shard_header(shard))
                for entry in shard:
                    if entry.file not in handles:
                        handles[entry.file] = stack.enter_context(open(entry.file, "rb"))
                    tensor = _read_tensor(handles[entry.file], entry)
                    module = entry.name[: -len(".weight")] if entry.name.endswith(".weight") else None
                    if module in adapters:
                        a, b, scale = adapters[module]
                        merged = tensor.float() + (b.float() @ a.float()) * scale
                        tensor = merged.to(tensor.dtype)
                    if entry.nbytes:
                        out.write(tensor.contiguous().view(torch.uint8).numpy().data)
                    total += entry.nbytes
    if len(shards) > 1:
        index = {"metadata": {"total_size": total},
                 "weight_map": {e.name: name for shard, name in zip(shards, names) for e in shard}}
        (dst / f"{stem}.safetensors.index.json").write_text(json.dumps(index, indent=2, sort_keys=True) + "\n")
    return total


def _scale(config: Any, rank: int, where: str) -> float:
    """peft's scaling of an adapter of `rank`: lora_alpha / r, or lora_alpha / sqrt(r) with rsLoRA."""
    if getattr(config, "use_dora", False) or getattr(config, "rank_pattern", None) or getattr(
            config, "alpha_pattern", None):
        raise MergeError(f"LoRA {where} uses DoRA or per-layer rank/alpha patterns, which the merged export does not "
                         "fold in; merge it with peft (merge_and_unload) instead")
    alpha = float(config.lora_alpha)
    return alpha / math.sqrt(rank) if getattr(config, "use_rslora", False) else alpha / rank


def _pairs(state: dict[str, "torch.Tensor"], config: Any, where: str
           ) -> dict[str, tuple["torch.Tensor", "torch.Tensor", float]]:
    """{module: (A, B, scale)} from adapter tensors named `<module>.lora_A.weight` / `.lora_B.weight`."""
    modules = sorted({k.rsplit(".lora_", 1)[0] for k in state})
    pairs = {}
    for module in modules:
        a, b = state.get(f"{module}.lora_A.weight"), state.get(f"{module}.lora_B.weight")
        if a is None or b is None or a.dim() != 2 or b.dim() != 2:
            raise MergeError(f"LoRA {where}: {module} lacks its lora_A or lora_B matrix")
        pairs[module] = (a, b, _scale(config, a.shape[0], where))
    return pairs


def _sources(source: str | Path) -> tuple[Any, Path | None, dict[str, dict[str, tuple]]]:
    """(ModelInfo, the base pipeline folder or None for a random-init base, {denoiser subfolder: its adapters
    {module: (A, B, scale)}})."""
    from vidray.models.export import (  # heavy: pydantic
        EXPERT_LORA_DIRS,
        LORA_DIR,
        _read_manifest,
        inspect_model,
        is_lora_checkpoint,
        load_adapter_state,
        lora_export_base,
    )
    from vidray.models.experts import EXPERT_ATTRIBUTES  # heavy: torch, numpy
    from vidray.models.lora import peft_lora_config, read_lora_weights  # heavy: torch, numpy

    info = inspect_model(source)
    if info.kind == "checkpoint":
        if not is_lora_checkpoint(_read_manifest(info.path)) or info.job.model.lora is None:
            raise MergeError(f"{source} is a full fine-tuning checkpoint (no LoRA adapters): export it with "
                             "`vidray export CHECKPOINT OUT_DIR`, nothing is to merge")
        base = lora_export_base(info.job)
        if base is None:
            return info, None, {}
        from vidray.models.export import fetch_model  # heavy: pydantic

        local = fetch_model(base) if is_uri(base) else Path(base)  # the run's model.pretrained_path
        state = load_adapter_state(info.path)
        config = peft_lora_config(info.job.model.lora)
        if info.job.model.experts is not None:
            adapters = {}
            for attribute in EXPERT_ATTRIBUTES.values():
                prefix = attribute + "."
                part = {k[len(prefix):]: v for k, v in state.items() if k.startswith(prefix)}
                adapters[attribute] = _pairs(part, config, str(info.path))
            return info, local, adapters
        return info, local, {"transformer": _pairs(state, config, str(info.path))}
    folder = info.adapters or info.path
    if not (folder / LORA_DIR).is_dir():
        raise MergeError(f"{source} holds no LoRA adapters ({LORA_DIR}/): it is already a full pipeline folder")
    adapters = {}
    subfolders = ({"transformer": EXPERT_LORA_DIRS["high"], "transformer_2": EXPERT_LORA_DIRS["low"]}
                  if (info.path / "transformer_2").is_dir() else {"transformer": LORA_DIR})
    for subfolder, lora_dir in subfolders.items():
        config, state = read_lora_weights(folder / lora_dir)
        adapters[subfolder] = _pairs(state, config, str(folder / lora_dir))
    return info, info.path, adapters


def export_merged(source: str | Path, out_dir: str | Path, *, max_shard_bytes: int = DEFAULT_SHARD_BYTES) -> Path:
    """`vidray export --merge-lora SOURCE OUT_DIR`: a LoRA run's model as one complete diffusers folder with the
    adapters folded into the transformer (two experts: `lora/` into `transformer/`, `lora_2/` into
    `transformer_2/`), what any stock pipeline loads with no LoRA step. `source`: an adapter-only export (its base
    found and checked, `resolve_base`), a pipeline folder with `lora/` beside it, or a LoRA run's checkpoint (the
    base its config's `model.pretrained_path` names). The base's other files are copied; the transformer is
    streamed (`merge_into_folder`: host memory near one tensor, shards of at most `max_shard_bytes`); the job file
    is written beside it. A random-init run's base exists in no folder: built in memory (`load_model`) and saved.
    Written to a temp folder beside `out_dir` and renamed. Returns `out_dir`.

    Raises MergeError for a source with no LoRA or adapters that do not fit the base; as `inspect_model` /
    `resolve_base` (BaseModelError naming base_model.json) for a base that is gone or changed."""
    from vidray.models.export import JOB_FILE, MODEL_INDEX, load_model, write_job_file  # heavy: pydantic

    info, base, adapters = _sources(source)
    out_dir = Path(out_dir)
    if out_dir.exists():
        raise MergeError(f"{out_dir} exists; give a new folder for the merged export")
    out_dir.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{out_dir.name}.", suffix=".tmp", dir=out_dir.parent))
    try:
        if base is None:  # init: random: the base is rebuilt from the seed, in memory (tiny models)
            model = load_model(source, allow_sharded=True)
            shutil.rmtree(tmp)
            info.family.save_pipeline(model.components, tmp, info.flow)
        else:
            for path in base.iterdir():
                if path.name in adapters or path.name in ("lora", "lora_2", JOB_FILE, MODEL_INDEX):
                    continue
                if path.is_dir():
                    shutil.copytree(path, tmp / path.name)
                elif path.is_file():
                    shutil.copy2(path, tmp / path.name)
            for subfolder, pairs in adapters.items():
                merge_into_folder(base / subfolder, tmp / subfolder, pairs, max_shard_bytes=max_shard_bytes)
            shutil.copy2(base / MODEL_INDEX, tmp / MODEL_INDEX)  # the marker, last
        if info.job is not None:
            write_job_file(tmp, info.job)
        os.rename(tmp, out_dir)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return out_dir
