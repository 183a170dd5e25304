"""Saving and loading a run's model outside training: the diffusers export, the checkpoint format's read side,
and `load_model`, which `vidray generate` and the serve plane use (neither imports training code).

A model folder is either
- a diffusers folder written at the end of training (`<run>/diffusers`, with `vidray_job.yaml` beside the
  weights recording the family, buckets, flow shift and prompt length it was trained with), or any local
  diffusers EasyAnimate or Wan 2.1 T2V folder (then prompts use the stock pipeline's 256 or 512 tokens and
  buckets must be given), or
- a training checkpoint folder (`<run>/checkpoint_000200`): components are rebuilt from the saved config and
  the transformer weights are loaded from the checkpoint.
Either may be given as a URI (`s3://bucket/runs/<name>/diffusers` when `storage.path` is on object storage): it is
copied once into a local cache (`fetch_model`: `$VIDRAY_MODEL_CACHE`, else ~/.cache/vidray/models) and reused
while its marker (`model_index.json`, `manifest.json`, uploaded last) is unchanged.

Checkpoint folders (written by `vidray.train.checkpoint.save_checkpoint`) hold named parts and `manifest.json`,
written last, with each part's size in bytes and sha256. Format versions: 3 lists the parts present in `parts`
(the required `PARTS` plus any `OPTIONAL_PARTS`) and stores the optimizer state by parameter name; 2 records
`files: {part: {size_bytes, sha256}}`; version 1 (vidray before per-file hashes) recorded only the part names and
loads with a warning. Any other version is refused. `vidray.train.checkpoint` is the write side. torch, diffusers and safetensors are imported inside the functions that need them, so
that `inspect_model` answers from config files in milliseconds.
"""

from __future__ import annotations

import hashlib
import hashlib as _hashlib
import json
import logging
import os
import shutil
import tempfile
import time
import warnings
import dataclasses
import functools
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, Callable, Literal

import yaml

from vidray.cards import all_cards, card_for_pipeline
from vidray.config import ExpertsConfig, FlowConfig, I2VConfig, JobConfig, ModelConfig, job_config_from_dict
from vidray.buckets import Bucket
from vidray.errors import UserError, UserFileNotFound
from vidray.locations import is_uri
from vidray.models.formats import (DIFFUSERS_LORA_WEIGHTS, EXPERT_LORA_DIRS, LORA_2_DIR, LORA_DIR, PEFT_WEIGHTS,
                                   CheckpointError, DamagedCheckpointError, IncompleteCheckpointError)

if TYPE_CHECKING:
    import torch

    from vidray.models.registry import Components, ModelFamily

__all__ = [
    "CheckpointError",
    "DamagedCheckpointError",
    "FORMAT_VERSION",
    "IncompleteCheckpointError",
    "JOB_FILE",
    "LoadedModel",
    "MANIFEST",
    "OPTIONAL_PARTS",
    "manifest_parts",
    "ModelFolderError",
    "ModelInfo",
    "model_config",
    "model_experts",
    "PARTS",
    "ADAPTER_PART",
    "BASE_REF",
    "BaseModelError",
    "base_fingerprint",
    "lora_export_base",
    "resolve_base",
    "write_base_reference",
    "EXPERT_LORA_DIRS",
    "LORA_2_DIR",
    "READABLE_FORMAT_VERSIONS",
    "MODEL_CACHE_ENV",
    "MODEL_INDEX",
    "ModelDownloadError",
    "export_adapters",
    "export_checkpoint",
    "export_pipeline",
    "fetch_model",
    "lora_path_problem",
    "two_experts_lora_problem",
    "model_cache_dir",
    "file_sha256",
    "inspect_model",
    "load_model",
    "load_adapter_state",
    "load_transformer_state",
    "read_job_config",
    "sharded_checkpoint_problem",
    "sharded_entries",
    "verify_checkpoint",
    "write_job_file",
]

MANIFEST = "manifest.json"
"""The checkpoint's commit marker, written last."""
PARTS = ("transformer.safetensors", "optimizer.pt", "lr_scheduler.pt", "train_state.json", "config.yaml")
"""The parts every checkpoint holds (a LoRA run's holds `ADAPTER_PART` in place of transformer.safetensors)."""
ADAPTER_PART = "adapter.safetensors"
"""A LoRA run's (`model.lora`) model part: only the adapters' tensors (`vidray.models.lora.adapter_state_dict`,
megabytes where the full transformer is gigabytes), in place of transformer.safetensors. The base weights come
from the model init that the checkpoint's config.yaml records (`model.init`, `model.pretrained_path`, the seed);
the manifest records the adapters' shape under `lora` ({rank, alpha, dropout, target_modules})."""
OPTIONAL_PARTS = ("ema.safetensors", "grad_scaler.pt", "comm_hook.pt")
"""Parts a checkpoint holds when the run has them (an EMA of the transformer, a mixed-precision grad scaler);
format 3 lists the parts present in the manifest's `parts`."""
FORMAT_VERSION = 3
READABLE_FORMAT_VERSIONS = (1, 2, 3)
_HASH_CHUNK_BYTES = 8 * 1024 * 1024
JOB_FILE = "vidray_job.yaml"
"""Name of the resolved job config written beside an exported diffusers pipeline."""
BASE_REF = "base_model.json"
"""An adapter-only LoRA export's reference to its base pipeline (`write_base_reference`, `resolve_base`): a
JSON object {"format": 1, "base": <location>, "sha256": <fingerprint>, "files": {...}}. Written last: it is the
export's commit marker, as model_index.json is a full export's."""
BASE_REF_FORMAT = 1

# Which stock pipeline classes load as which family, and which of them are image-to-video (a stock folder of one
# loads as `model.i2v: {condition: first}`), is each family card's `pipelines` (`vidray.cards`).
_PIPELINE_SUBFOLDERS = ("vae", "text_encoder", "tokenizer", "scheduler")
_DENOISER_SUBFOLDERS = ("transformer", "unet")
"""A pipeline folder holds one of these (a DiT's `transformer/`; AnimateDiff's UNetMotionModel `unet/`)."""
# The stock pipeline's default prompt length (tokens) is each family card's `text_seq_len`:
# EasyAnimatePipeline.encode_prompt's 256, WanPipeline.__call__'s 512, CogVideoXPipeline.__call__'s 226,
# AnimateDiffPipeline's CLIP tokenizer's model_max_length 77.


MODEL_INDEX = "model_index.json"
"""A diffusers folder's marker; an export to object storage is uploaded with it last
(`vidray.storage.upload_dir`)."""
MODEL_CACHE_ENV = "VIDRAY_MODEL_CACHE"
"""Environment variable: the local folder where models read from a URI are cached (default ~/.cache/vidray/models)."""


class ModelDownloadError(UserError):
    """A model URI whose store could not be reached or read (after the retries); the message names the URI."""


class ModelFolderError(UserError):
    """A model folder that is neither a complete diffusers export nor a vidray checkpoint, or holds a pipeline class
    vidray has no family for. Raised before any weights load."""


def file_sha256(path: str | Path) -> str:
    """Hex sha256 of a file's bytes, read in 8 MiB chunks."""
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        while chunk := f.read(_HASH_CHUNK_BYTES):
            digest.update(chunk)
    return digest.hexdigest()


class BaseModelError(UserError):
    """An adapter-only LoRA export whose base (`BASE_REF`) cannot be used: its reference is unreadable, the base
    folder is gone, it is a hub id (nothing loads from a hub here), or its fingerprint no longer matches the one
    recorded at export. The message names the export's `base_model.json` and how to fix it. Raised before any
    weights load."""


def _safetensors_header(path: Path) -> bytes:
    """The first 8 + N bytes of a safetensors file: its little-endian u64 header length N and the JSON header
    (every tensor's name, dtype, shape and byte offsets). Raises ValueError for a file too short to hold it."""
    with open(path, "rb") as f:
        head = f.read(8)
        if len(head) < 8:
            raise ValueError(f"{path} is not a safetensors file (shorter than 8 bytes)")
        length = int.from_bytes(head, "little")
        body = f.read(length)
    if len(body) != length:
        raise ValueError(f"{path} is not a safetensors file (its header is cut short)")
    return head + body


def base_fingerprint(folder: str | Path) -> dict[str, Any]:
    """What an adapter-only export records of its base pipeline folder, read in milliseconds (no weight byte):
    {"sha256": hex, "files": {relative path: entry}} over `model_index.json` and every file of each component
    subfolder it names (`transformer/`, `transformer_2/`, `vae/`, `text_encoder/`, ...):
    - `*.json` (model_index.json, config.json, the weights' `*.safetensors.index.json`, tokenizer and scheduler
      configs): {"sha256": of the file's bytes, "size_bytes"};
    - `*.safetensors` (weights): {"header_sha256": of its header (`8 + N` bytes: every tensor's name, dtype,
      shape, offsets), "size_bytes"};
    - any other file: {"size_bytes"}.
    "sha256" is the sha256 of `files` as sorted compact JSON. It identifies the base's architecture, weight layout
    and file sizes (a re-saved, re-sharded or other checkpoint differs), not every weight value: hashing every
    weight byte would cost ~1 s per GB at each load. Raises BaseModelError when the folder has no readable
    model_index.json."""
    folder = Path(folder)
    try:
        index = json.loads((folder / MODEL_INDEX).read_text())
    except (OSError, ValueError) as err:
        raise BaseModelError(f"base {folder} has no readable {MODEL_INDEX} ({err}): give a diffusers folder") from None
    files: dict[str, dict[str, Any]] = {}
    paths = [folder / MODEL_INDEX]
    for name, value in sorted(index.items()):
        if isinstance(value, list) and value and value[0] is not None and (folder / name).is_dir():
            paths += sorted(p for p in (folder / name).rglob("*") if p.is_file())
    for path in paths:
        entry: dict[str, Any] = {"size_bytes": path.stat().st_size}
        if path.suffix == ".json":
            entry["sha256"] = file_sha256(path)
        elif path.suffix == ".safetensors":
            try:
                entry["header_sha256"] = hashlib.sha256(_safetensors_header(path)).hexdigest()
            except ValueError as err:
                raise BaseModelError(f"base {folder}: {err}") from None
        files[path.relative_to(folder).as_posix()] = entry
    digest = hashlib.sha256(json.dumps(files, sort_keys=True, separators=(",", ":")).encode()).hexdigest()
    return {"sha256": digest, "files": files}


def lora_export_base(job: JobConfig) -> str | None:
    """The base an adapter-only export of `job` refers to (`export_pipeline(base=...)`), or None when the run's
    export holds its own base pipeline: `model.pretrained_path` made absolute (a URI as it is) for a LoRA run with
    `model.init: pretrained`; None for a full fine-tuning run, for `init: random` (the random base exists in no
    folder: the export is where it is written once), and for a run with `model.vae_path` (its VAE is not the
    base's: the export writes the pipeline with it)."""
    model = job.model
    if model.lora is None or model.init != "pretrained" or not model.pretrained_path or model.vae_path:
        return None
    return model.pretrained_path if is_uri(model.pretrained_path) else str(Path(model.pretrained_path).resolve())


def write_base_reference(out_dir: str | Path, base: str | Path) -> Path:
    """Write `BASE_REF` into `out_dir`: {"format": 1, "base": `base` (a local folder, made absolute; an
    `s3://`/`file://` URI as given), "sha256" and "files": `base_fingerprint` of the base folder (a URI's base is
    read through the model cache, `fetch_model`)}. Returns the file. Raises BaseModelError as `resolve_base`
    does for a base that cannot be read."""
    base = str(base) if is_uri(base) else str(Path(base).resolve())
    local = fetch_model(base) if is_uri(base) else Path(base)
    if not (local / MODEL_INDEX).is_file():
        raise BaseModelError(f"base {base} is no diffusers folder ({MODEL_INDEX}): a LoRA export refers to the "
                             "pipeline folder of model.pretrained_path")
    record = {"format": BASE_REF_FORMAT, "base": base, **base_fingerprint(local)}
    out = Path(out_dir) / BASE_REF
    out.write_text(json.dumps(record, indent=1, sort_keys=True) + "\n")
    return out


def _looks_like_hub_id(location: str) -> bool:
    """`org/name` (one slash, no leading `/` or `.`): what the Hugging Face Hub names a model."""
    return not Path(location).is_absolute() and location.count("/") == 1 and not location.startswith(".")


def resolve_base(export_dir: str | Path) -> Path:
    """The local base pipeline folder of the adapter-only LoRA export `export_dir` (its `BASE_REF`), checked
    against the fingerprint recorded at export (`base_fingerprint`). `base` may be a local folder (absolute), a URI
    (`s3://...`, copied once into the model cache by `fetch_model`, which raises ModelDownloadError naming the
    credentials when the store cannot be read), or a hub id, which is refused (nothing loads from a hub here).
    Edit `base` in the file to move the base: the fingerprint must still match.

    Raises BaseModelError, one line naming `<export>/base_model.json` and the fix: an unreadable reference, a
    base folder that is gone, a hub id, a fingerprint that no longer matches (naming the first file that
    differs), or a URI base that cannot be read (`fetch_model`'s line: the store, the credentials
    AWS_ACCESS_KEY_ID / AWS_SECRET_ACCESS_KEY, AWS_ENDPOINT_URL)."""
    ref_path = Path(export_dir) / BASE_REF
    try:
        record = json.loads(ref_path.read_text())
        base, recorded = str(record["base"]), str(record["sha256"])
        recorded_files = dict(record.get("files") or {})
    except (OSError, ValueError, KeyError, TypeError) as err:
        raise BaseModelError(f"{ref_path} cannot be read ({type(err).__name__}: {err}); export the run again "
                             "(vidray export CHECKPOINT OUT_DIR)") from None
    if record.get("format") != BASE_REF_FORMAT:
        raise BaseModelError(f"{ref_path} has format {record.get('format')!r}; this vidray reads "
                             f"{BASE_REF_FORMAT}: use the vidray that wrote it")
    if is_uri(base):
        try:
            local = fetch_model(base)
        except UserError as err:  # the store's one line (credentials, endpoint), naming the reference
            raise BaseModelError(f"{ref_path}: base {err}") from None
    elif Path(base).is_dir():
        local = Path(base)
    elif _looks_like_hub_id(base):
        raise BaseModelError(f"{ref_path}: base {base!r} is a hub id, and nothing loads from a hub here: download "
                             "it (e.g. `hf download " + base + " --local-dir DIR`) and set \"base\" to that local folder")
    else:
        raise BaseModelError(f"{ref_path}: the base folder {base} is gone; set \"base\" in that file to where the "
                             "base pipeline now is (a local folder or an s3:// URI; its fingerprint must match)")
    found = base_fingerprint(local)
    if found["sha256"] != recorded:
        changed = sorted(set(found["files"]) ^ set(recorded_files)
                         | {k for k in found["files"].keys() & recorded_files.keys()
                            if found["files"][k] != recorded_files[k]})
        what = f" ({changed[0]} differs{f' among {len(changed)} files' if len(changed) > 1 else ''})" if changed else ""
        raise BaseModelError(f"{ref_path}: base {base} no longer matches the one these adapters were trained on "
                             f"(sha256 {found['sha256'][:12]}, recorded {recorded[:12]}){what}; restore that base "
                             "or point \"base\" at a copy of it; vidray never loads a different base silently")
    return local


def _read_manifest(directory: Path) -> dict[str, Any]:
    path = directory / MANIFEST
    if not path.is_file() and (directory / "model_index.json").is_file():
        found = sorted(p.name for p in directory.parent.glob("checkpoint_*") if (p / MANIFEST).is_file())
        listing = (f"the checkpoints of {directory.parent}: {', '.join(found)}" if found
                   else f"{directory.parent} holds no finished checkpoint_* folder")
        raise IncompleteCheckpointError(
            f"{directory} is a diffusers export (model_index.json, no {MANIFEST}), not a checkpoint: resume from a checkpoint folder "
            f"instead ({listing}), or give the export to `vidray generate --model`",
            directory=directory, part=MANIFEST,
        )
    if not path.is_file():
        raise IncompleteCheckpointError(
            f"checkpoint {directory} has no {MANIFEST}: it was not finished; use an earlier checkpoint",
            directory=directory, part=MANIFEST,
        )
    try:
        manifest = json.loads(path.read_text())
    except (OSError, ValueError) as err:
        raise DamagedCheckpointError(
            f"checkpoint {directory}: {MANIFEST} cannot be read ({err}); use an earlier checkpoint",
            directory=directory, part=MANIFEST,
        ) from None
    if not isinstance(manifest, dict):
        raise DamagedCheckpointError(f"checkpoint {directory}: {MANIFEST} is not a JSON object",
                                     directory=directory, part=MANIFEST)
    version = manifest.get("format_version")
    if version not in READABLE_FORMAT_VERSIONS:
        raise CheckpointError(
            f"checkpoint {directory}: {MANIFEST} has format_version {version!r}; this vidray reads "
            f"{', '.join(map(str, READABLE_FORMAT_VERSIONS))}: use the vidray that wrote it",
            directory=directory, part=MANIFEST,
        )
    return manifest


def required_parts(adapter: bool) -> tuple[str, ...]:
    """`PARTS`, with `ADAPTER_PART` in place of transformer.safetensors for a LoRA run's checkpoint."""
    return tuple(ADAPTER_PART if adapter and p == "transformer.safetensors" else p for p in PARTS)


SHARDED_OPTIONAL_PARTS = ("grad_scaler.pt",)
"""Parts a sharded checkpoint may hold beside its DCP folder (fp16's scaler; an EMA is in the DCP folder)."""


def manifest_parts(manifest: dict[str, Any]) -> tuple[str, ...]:
    """The parts a checkpoint's manifest says it holds: `PARTS` (a LoRA checkpoint: `ADAPTER_PART` in place of
    the transformer's), plus the `OPTIONAL_PARTS` format 3 lists. Raises DamagedCheckpointError when a format 3
    manifest lacks a required part or names an unknown one."""
    if manifest.get("format_version", 0) < 3:
        return PARTS
    if manifest.get("layout") == "dcp":  # sharded (vidray.train.checkpoint.save_sharded_checkpoint)
        listed = tuple(manifest.get("parts") or ())
        required = ("lr_scheduler.pt", "train_state.json", "config.yaml", "dcp/.metadata")
        odd = [p for p in listed if p not in required + SHARDED_OPTIONAL_PARTS
               and not (p.startswith("dcp/") and ".." not in p)]
        absent = [p for p in required if p not in listed]
        if odd or absent:
            raise DamagedCheckpointError(
                f"{MANIFEST} of a sharded checkpoint lists parts {list(listed)}: "
                + (f"unknown {odd}" if odd else f"without the required {absent}") + "; use an earlier checkpoint",
                part=MANIFEST)
        return listed
    listed = tuple(manifest.get("parts") or ())
    required = required_parts(ADAPTER_PART in listed)
    unknown = [p for p in listed if p not in required + OPTIONAL_PARTS]
    absent = [p for p in required if p not in listed]
    if unknown or absent:
        raise DamagedCheckpointError(
            f"{MANIFEST} lists parts {list(listed)}: "
            + (f"unknown {unknown}" if unknown else f"without the required {absent}")
            + "; use an earlier checkpoint", part=MANIFEST,
        )
    return required + tuple(p for p in OPTIONAL_PARTS if p in listed)


def verify_checkpoint(directory: str | Path, *, hashes: bool = True) -> dict[str, Any]:
    """Check a checkpoint folder against its manifest; returns the manifest.

    Every part must exist; for format 2 each part's size in bytes must match, and with `hashes` its sha256
    (reads every byte: ~1 s per GB). Format 1 folders (no sizes or hashes) are checked for presence only and
    warn. Raises IncompleteCheckpointError (no manifest, missing part), DamagedCheckpointError (size or sha256
    differs: the message names the folder and the file) or CheckpointError (unknown format version).
    """
    directory = Path(directory)
    manifest = _read_manifest(directory)
    parts = manifest_parts(manifest)
    missing = [p for p in parts if not (directory / p).is_file()]
    if missing:
        raise IncompleteCheckpointError(
            f"checkpoint {directory} is missing {', '.join(missing)}; use an earlier checkpoint",
            directory=directory, part=missing[0],
        )
    if manifest["format_version"] == 1:
        warnings.warn(
            f"checkpoint {directory} is format 1 (no sizes or hashes): its files cannot be verified", stacklevel=2
        )
        return manifest
    files = manifest.get("files", {})
    for part in parts:
        recorded = files.get(part)
        if not recorded:
            raise DamagedCheckpointError(f"checkpoint {directory}: {MANIFEST} records nothing for {part}",
                                         directory=directory, part=part)
        size = (directory / part).stat().st_size
        if size != recorded["size_bytes"]:
            raise DamagedCheckpointError(
                f"checkpoint {directory}: {part} is {size} bytes but {recorded['size_bytes']} were written "
                "(truncated or overwritten)",
                directory=directory, part=part,
            )
        if hashes and file_sha256(directory / part) != recorded["sha256"]:
            raise DamagedCheckpointError(
                f"checkpoint {directory}: {part} does not match the sha256 recorded when it was written "
                "(its bytes changed)",
                directory=directory, part=part,
            )
    return manifest


def read_job_config(directory: str | Path) -> dict[str, Any]:
    """The resolved job config (a plain dict) saved in a checkpoint with its manifest."""
    directory = Path(directory)
    _read_manifest(directory)
    return _read_part(directory, "config.yaml", lambda p: yaml.safe_load(p.read_text())) or {}


def _read_part(directory: Path, part: str, reader) -> Any:
    path = directory / part
    if not path.is_file():
        raise IncompleteCheckpointError(f"checkpoint {directory} is missing {part}; use an earlier checkpoint",
                                        directory=directory, part=part)
    try:
        return reader(path)
    except Exception as err:  # noqa: BLE001 - any reader failure means the file is damaged: name it
        raise DamagedCheckpointError(
            f"checkpoint {directory}: {part} cannot be read ({type(err).__name__}: {err}); "
            "use an earlier checkpoint",
            directory=directory, part=part,
        ) from err


def load_transformer_state(directory: str | Path) -> "dict[str, torch.Tensor]":
    """The transformer state dict of a verified checkpoint, on CPU (sizes and hashes checked first). Raises
    CheckpointError for a LoRA run's checkpoint (it holds only adapters: `load_adapter_state`)."""
    from safetensors.torch import load_file  # heavy: torch, safetensors, numpy

    directory = Path(directory)
    manifest = verify_checkpoint(directory)
    if is_lora_checkpoint(manifest):
        part = "dcp" if manifest.get("layout") == "dcp" else ADAPTER_PART
        raise CheckpointError(f"checkpoint {directory} holds LoRA adapters only ({part}), not the whole "
                              "transformer: load it with load_model (base model + adapters)",
                              directory=directory, part=part)
    if manifest.get("layout") == "dcp":
        return sharded_entries(directory, "model")
    return _read_part(directory, "transformer.safetensors", lambda p: load_file(str(p)))


def sharded_entries(directory: str | Path, key: str) -> "dict[str, torch.Tensor]":
    """The `key` entries ("model", "ema") of a sharded checkpoint's DCP folder, every rank's shards joined, read in
    full, on CPU, in one process (no process group: what `vidray export` and validation are), never unpickling data
    from storage (`vidray.models.dcp_reader`). Raises IncompleteCheckpointError when the folder has no DCP metadata,
    DamagedCheckpointError (one line) when `.metadata` or an entry holds anything a DCP checkpoint does not."""
    from torch.distributed.checkpoint.state_dict_loader import _load_state_dict_from_keys  # heavy: torch, numpy

    from vidray.models.dcp_reader import SafeFileSystemReader, dcp_errors, read_dcp_metadata  # heavy: torch, numpy

    directory = Path(directory)
    if not (directory / "dcp/.metadata").is_file():
        raise IncompleteCheckpointError(f"checkpoint {directory} is missing dcp/.metadata; use an earlier checkpoint",
                                        directory=directory, part="dcp/.metadata")
    read_dcp_metadata(directory / "dcp/.metadata")  # restricted unpickler: a hostile file is refused unread
    reader = SafeFileSystemReader(str(directory / "dcp"))
    with warnings.catch_warnings(), dcp_errors(reader):  # one process without a process group is what export is
        warnings.filterwarnings("ignore", message=r"torch.distributed is .*uninitialized")
        state = _read_part(directory, "dcp/.metadata", lambda p: _load_state_dict_from_keys(
            keys={key}, storage_reader=reader))
    return dict(state[key].items())


def is_lora_checkpoint(manifest: dict[str, Any]) -> bool:
    """True for a LoRA run's checkpoint, which holds the adapters and not the base transformer: a full one's
    `ADAPTER_PART`, or a sharded one whose manifest records `lora`. Raises DamagedCheckpointError as
    `manifest_parts`."""
    return ADAPTER_PART in manifest_parts(manifest) or bool(manifest.get("lora"))


def load_adapter_state(directory: str | Path) -> "dict[str, torch.Tensor]":
    """The LoRA adapters of a verified LoRA-run checkpoint (`ADAPTER_PART`, `vidray.models.lora.adapter_state_dict`
    naming), on CPU. A sharded (FSDP) one holds the trainable adapters only: those of layers frozen for never
    being used (`no_grad_parameter_names`) are left out, their starting values standing. Raises CheckpointError
    when the checkpoint holds the full transformer instead."""
    from safetensors.torch import load_file  # heavy: torch, safetensors, numpy

    directory = Path(directory)
    manifest = verify_checkpoint(directory)
    if not is_lora_checkpoint(manifest):
        raise CheckpointError(f"checkpoint {directory} holds the full transformer, not LoRA adapters",
                              directory=directory, part="transformer.safetensors")
    if manifest.get("layout") == "dcp":
        from vidray.models.lora import adapter_key  # heavy: torch, numpy

        return {adapter_key(k): v for k, v in sharded_entries(directory, "model").items()}
    return _read_part(directory, ADAPTER_PART, lambda p: load_file(str(p)))


@dataclass(frozen=True)
class ModelInfo:
    """What a model folder says about itself, read from its small config files only (no weights)."""

    path: Path
    kind: Literal["checkpoint", "diffusers"]
    """`checkpoint`: a vidray training checkpoint (manifest.json); `diffusers`: a pipeline folder (model_index.json)."""
    family_name: str
    job: JobConfig | None
    """The resolved job config it was trained with (None for a stock diffusers folder without vidray_job.yaml)."""
    flow: FlowConfig
    max_sequence_length: int
    """Prompt length in tokens the model was trained with (the family card's `text_seq_len` for a stock folder)."""
    buckets: list[Bucket]
    """Training buckets (empty for a stock folder)."""
    source: str | None = None
    """The URI the model was given as (`path` is then its local cached copy, `fetch_model`), or the adapter-only
    LoRA export as given (`path` is then its base); None for a folder."""
    image_to_video: bool = False
    """Whether the model takes a first-frame image: its job's `model.i2v` is set, or a stock folder's pipeline is an
    image-to-video one (`EasyAnimateInpaintPipeline`, `WanImageToVideoPipeline`, `CogVideoXImageToVideoPipeline`).
    Read through `family.image_inputs(info)`."""
    adapters: Path | None = None
    """An adapter-only LoRA export (`BASE_REF`): its local folder, holding `lora/` (`lora_2/`) and the job file;
    `path` is then its base pipeline folder (`resolve_base`: found and fingerprint-checked). None otherwise."""

    @functools.cached_property
    def family(self) -> "ModelFamily":
        """The registered model family for this model (`ModelFamily.for_model` of `model_config`: a checkpoint's
        recorded model, a folder's own configs, no weights read), whose objective, sampler and `latent_shape` follow
        it (CogVideoX's scheduler config and 1.5's padded latent frames). Imports torch and diffusers on first use."""
        from vidray.models.registry import get_family  # heavy: torch, numpy

        return get_family(self.family_name).for_model(model_config(self)[0])

    def default_bucket(self) -> Bucket | None:
        """The first multi-frame training bucket (else the first bucket; None when none is recorded)."""
        videos = [b for b in self.buckets if b.num_frames > 1] or self.buckets
        return videos[0] if videos else None


@dataclass
class LoadedModel:
    """A model ready for sampling: family, components (eval mode), flow settings, prompt length, buckets, and its two
    experts' `boundary_ratio` (`model_experts`; None for one transformer)."""

    family: "ModelFamily"
    components: "Components"
    flow: FlowConfig
    max_sequence_length: int
    buckets: list[Bucket]
    experts: ExpertsConfig | None = None


def inspect_model(path: str | Path) -> ModelInfo:
    """Read a diffusers folder or a vidray checkpoint folder's configs (see the module docstring), loading no
    weights (a checkpoint's files are verified against its manifest).

    `path` may be a URI (`s3://bucket/runs/<name>/diffusers`, a `checkpoint_NNNNNN` folder there, `file://...`):
    the folder is first copied into the local model cache (`fetch_model`; reused while unchanged), then read
    there: `ModelInfo.path` is the local copy, `ModelInfo.source` the URI.

    Raises UserFileNotFound when `path` does not exist, ModelFolderError when it is neither kind of folder,
    is a pipeline of an unsupported class, lacks a component subfolder, or is a `vidray train-vae` checkpoint;
    ConfigError for a recorded job config that no longer validates; the checkpoint module's errors for an
    incomplete checkpoint; ModelDownloadError when a URI's store cannot be read.
    """
    if is_uri(path):
        return dataclasses.replace(_inspect_folder(fetch_model(str(path))), source=str(path))
    return _inspect_folder(Path(path))


def _inspect_folder(path: Path) -> ModelInfo:
    """`inspect_model` of a local folder."""
    _check_model_kind(path)
    if (path / BASE_REF).is_file() and not (path / MODEL_INDEX).is_file():
        return _inspect_adapter_export(path)
    if (path / MANIFEST).is_file():
        job = job_config_from_dict(read_job_config(path))
        if job.train.objective == "vae":
            raise ModelFolderError(
                f"{path} is a checkpoint of the VAE run {job.name} (train.objective: vae), not of a DiT: give the DiT "
                f"run's diffusers/ folder or one of its checkpoint_NNNNNN folders; this run's trained VAE is its "
                f"{path.parent.name}/vae folder, which a DiT job uses as model.vae_path")
        return ModelInfo(path, "checkpoint", job.model.family, job, job.flow, job.model.max_sequence_length,
                         list(job.data.buckets), image_to_video=job.model.i2v is not None)
    missing = [name for name in _PIPELINE_SUBFOLDERS if not (path / name).is_dir()]
    if not any((path / name).is_dir() for name in _DENOISER_SUBFOLDERS):
        missing.insert(0, "transformer")
    if missing:
        raise ModelFolderError(
            f"diffusers folder {path} lacks {', '.join(missing)}/: it is incomplete; re-export it"
        )
    if (path / JOB_FILE).is_file():
        job = job_config_from_dict(yaml.safe_load((path / JOB_FILE).read_text()))
        _check_folder_task(path, job)
        return ModelInfo(path, "diffusers", job.model.family, job, job.flow, job.model.max_sequence_length,
                         list(job.data.buckets), image_to_video=job.model.i2v is not None)
    try:
        class_name = json.loads((path / "model_index.json").read_text()).get("_class_name", "")
        scheduler = json.loads((path / "scheduler" / "scheduler_config.json").read_text())
    except (OSError, json.JSONDecodeError, AttributeError) as err:
        raise ModelFolderError(f"diffusers folder {path}: unreadable model_index.json or scheduler config ({err})")
    card = card_for_pipeline(class_name)
    if card is None:
        supported = sorted(name for c in all_cards() for name in c.pipelines)
        raise ModelFolderError(
            f"model {path} holds a {class_name or 'unknown'} pipeline; "
            f"supported: {', '.join(supported)}"
        )
    # FlowMatchEulerDiscreteScheduler says `shift`; the stock Wan folders' UniPCMultistepScheduler `flow_shift`.
    flow = FlowConfig(shift=float(scheduler.get("shift", scheduler.get("flow_shift", 1.0))),
                      num_train_timesteps=int(scheduler.get("num_train_timesteps", 1000)))
    return ModelInfo(path, "diffusers", card.name, None, flow, card.text_seq_len, [],
                     image_to_video=card.pipelines[class_name])


def _inspect_adapter_export(path: Path) -> ModelInfo:
    """`inspect_model` of an adapter-only LoRA export: its base resolved and checked (`resolve_base`), read as a
    diffusers folder, with the export's job file (required) and `adapters` = the export."""
    if not (path / JOB_FILE).is_file():
        raise ModelFolderError(f"LoRA export {path} has {BASE_REF} but no {JOB_FILE}: it is incomplete; export the "
                               "run again")
    job = job_config_from_dict(yaml.safe_load((path / JOB_FILE).read_text()))
    if not any((path / name).is_dir() for name in EXPERT_LORA_DIRS.values()):
        raise ModelFolderError(f"LoRA export {path} has {BASE_REF} but no {LORA_DIR}/: it is incomplete; export "
                               "the run again")
    base = resolve_base(path)
    base_info = _inspect_folder(base)
    if base_info.kind != "diffusers" or base_info.adapters is not None:
        raise BaseModelError(f"{path / BASE_REF}: base {base} is not a diffusers pipeline folder")
    _check_folder_task(base, job)
    return ModelInfo(base, "diffusers", job.model.family, job, job.flow, job.model.max_sequence_length,
                     list(job.data.buckets), source=str(path), image_to_video=job.model.i2v is not None,
                     adapters=path)


def _check_folder_task(path: Path, job: JobConfig) -> None:
    """Raise ModelFolderError when an export's recorded `model.i2v` and its pipeline class disagree (an image-to-video
    job beside a text-to-video pipeline, or the reverse): a folder edited by hand or mixed up."""
    try:
        class_name = json.loads((path / "model_index.json").read_text()).get("_class_name", "")
    except (OSError, json.JSONDecodeError, AttributeError) as err:
        raise ModelFolderError(f"diffusers folder {path}: unreadable model_index.json ({err})") from None
    card = card_for_pipeline(class_name)
    if (card is not None and card.pipelines[class_name]) != (job.model.i2v is not None):
        recorded = "sets model.i2v" if job.model.i2v is not None else "has model.i2v null"
        raise ModelFolderError(f"diffusers folder {path} holds a {class_name} but its {JOB_FILE} {recorded}: "
                               "re-export the run, or remove the job file to load the folder as a stock pipeline")


def _check_model_kind(path: str | Path) -> None:
    """Raise unless `path` is a folder with a checkpoint manifest or a model_index.json (file checks only; for a
    URI one or two metadata requests to the store, no download)."""
    if is_uri(path):
        from vidray.storage import open_storage  # heavy: pyarrow, numpy

        _stored_model_marker(open_storage(str(path), setting="model"))
        return
    path = Path(path)
    if not path.exists():
        raise UserFileNotFound(f"model {path} does not exist; give <run>/diffusers or <run>/checkpoint_NNNNNN")
    if not any((path / marker).is_file() for marker in (MANIFEST, MODEL_INDEX, BASE_REF)):
        raise ModelFolderError(
            f"model {path} is neither a diffusers folder (model_index.json) nor a vidray checkpoint ({MANIFEST}) "
            f"nor a LoRA export ({BASE_REF}); give <run>/diffusers or <run>/checkpoint_NNNNNN"
        )


def model_cache_dir() -> Path:
    """Where models read from a URI are cached: `$VIDRAY_MODEL_CACHE`, else ~/.cache/vidray/models."""
    return Path(os.environ.get(MODEL_CACHE_ENV) or "~/.cache/vidray/models").expanduser()


def _stored_model_marker(storage) -> tuple[str, Any]:
    """(marker name, its pyarrow FileInfo) of a model folder in a `vidray.storage.Storage`: manifest.json (a
    checkpoint), model_index.json (a diffusers export) or base_model.json (an adapter-only LoRA export). Raises as
    `fetch_model` does."""
    import pyarrow.fs as pafs  # heavy: pyarrow, numpy

    where = storage.display()
    try:
        for marker in (MANIFEST, MODEL_INDEX, BASE_REF):
            info = storage.info(marker)
            if info.type == pafs.FileType.File:
                return marker, info
        holds_anything = bool(storage.list())
    except OSError as err:
        raise ModelDownloadError(
            f"model {where} cannot be read ({type(err).__name__}: {err}); check the bucket name, the credentials "
            "(AWS_ACCESS_KEY_ID, AWS_SECRET_ACCESS_KEY) and AWS_ENDPOINT_URL"
        ) from None
    if not holds_anything:
        raise UserFileNotFound(
            f"model {where} does not exist (nothing is stored under it); give <storage.path>/<name>/diffusers or "
            "<storage.path>/<name>/checkpoint_NNNNNN"
        )
    raise ModelFolderError(
        f"model {where} is neither a diffusers folder ({MODEL_INDEX}) nor a vidray checkpoint ({MANIFEST}): an "
        "export or checkpoint whose upload did not finish, or another folder; give <storage.path>/<name>/diffusers "
        "or <storage.path>/<name>/checkpoint_NNNNNN"
    )


def fetch_model(uri: str) -> Path:
    """The model folder at `uri` (a diffusers export or a vidray checkpoint on object storage, or `file://`) as a
    local folder. `file://` folders are used in place. Others are downloaded once (`vidray.storage.
    download_dir`, marker last and checked unchanged, whole download retried) into `model_cache_dir()/<key>`, key =
    sha256 of the URI and its marker's name, size and modification time: an unchanged model is reused, a
    re-exported one (its marker rewritten last) downloaded again. Old copies are not deleted (remove the cache
    folder to free the space). Concurrent callers (e.g. serve replicas on one node) each download to a temp folder
    and the first rename wins.

    Raises UserFileNotFound when nothing is stored under `uri`; ModelFolderError when it holds neither marker
    (model_index.json, manifest.json); ModelDownloadError when the store cannot be read or every download attempt
    failed; UserError for a URI that cannot be opened.
    """
    from vidray.storage import StorageTransferError, download_dir, open_storage  # heavy: pyarrow, numpy

    storage = open_storage(uri, setting="model")
    marker, info = _stored_model_marker(storage)
    if storage.is_local:
        return storage.local_path
    where = storage.display()
    key = _hashlib.sha256(f"{where}\n{marker}\n{info.size}\n{info.mtime_ns}".encode()).hexdigest()[:24]
    cache = model_cache_dir()
    target = cache / key
    if (target / marker).is_file():
        return target
    cache.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{key}.", suffix=".tmp", dir=cache))
    try:
        start = time.perf_counter()
        try:
            num_bytes = download_dir(uri, tmp, marker=marker)
        except StorageTransferError as err:
            raise ModelDownloadError(f"model {where} could not be downloaded: {err}") from None
        try:
            os.rename(tmp, target)
        except OSError:
            if not (target / marker).is_file():  # not another process that finished first
                raise
        logging.getLogger(__name__).info("downloaded model %s (%.1f MiB in %.1f s) to %s", where,
                                         num_bytes / 2**20, time.perf_counter() - start, target)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return target


COMPONENTS = ("transformer", "vae", "text_encoder", "image_encoder")
"""The modules `load_model` can load; the tokenizer comes with the text encoder, the image processor with the image
encoder (None for a model that takes no image embeddings: only Wan 2.1 I2V's CLIP does)."""


def load_model(path: str | Path, *, lora_path: str | Path | None = None,
               components: tuple[str, ...] = COMPONENTS, expert: str | None = None,
               allow_sharded: bool = False) -> LoadedModel:
    """Load a diffusers folder or a vidray checkpoint folder for sampling (see the module docstring); `path` may
    be a URI (`s3://...`), read through the local model cache (`inspect_model`, `fetch_model`).

    A LoRA run's model comes back with its adapters merged into the transformer (`vidray.models.lora`): a
    checkpoint holding `ADAPTER_PART` is the base its config describes (`model.init`, the seed) plus those
    adapters; an export is its base pipeline plus the adapters in `<export>/lora/` (two experts: each expert's in
    `lora/` and `lora_2/`, `EXPERT_LORA_DIRS`). `lora_path` (a local LoRA
    folder or file, `vidray.models.lora.read_lora_weights`) is then merged in as well: what `vidray generate --lora`
    and the serve config's `lora_path` give.

    `components`: which of `COMPONENTS` to load; the others are None in `LoadedModel.components` and no byte of
    them is read (each serve stage loads only its own: the denoiser the transformer, the decoder the VAE, the text
    stage the text encoder and tokenizer). Each comes from the family's role loaders (`load_diffusion_models`,
    `load_latent_models`, `load_condition_models`) with the folder as `model.init: pretrained` (a checkpoint: its
    recorded model config and seed, then its transformer weights), equal to what the whole load gives.

    `expert`: for a two-expert model (`model_experts`), "high" or "low" loads that expert alone as the transformer
    (`ModelFamily.load_diffusion_models(expert=)`: a pipeline folder's other expert is never read; a checkpoint,
    which holds both in one file, is read whole and the other dropped once its adapters, if any, are merged; an
    export's expert takes its own adapters folder): what a serving stage of one expert loads. Needs "transformer" in
    `components`.

    `allow_sharded`: load a sharded (`layout: dcp`) training checkpoint too (validation and `export_checkpoint`
    do, through `vidray.models.dcp_reader`); serving and `vidray generate` read only safetensors, so without it such
    a checkpoint is refused (`sharded_checkpoint_problem`: export it first).

    Raises as `inspect_model` does (before any weights load); CheckpointError for a sharded checkpoint without
    `allow_sharded`; ValueError for a name not in `COMPONENTS`, or an
    `expert` for a model without experts or without "transformer" in `components`;
    CheckpointError for a LoRA checkpoint whose adapters do not fit its config;
    `vidray.models.lora.LoraLoadError` for a `lora_path` that cannot be read or does not fit the transformer.
    """
    unknown = sorted(set(components) - set(COMPONENTS))
    if unknown or not components:
        raise ValueError(f"components {list(components)}: give one or more of {', '.join(COMPONENTS)}")
    from vidray.models.experts import TwoExperts, pick_expert  # heavy: torch, numpy

    info = inspect_model(path)
    problem = None if allow_sharded else sharded_checkpoint_problem(info)
    if problem:
        raise CheckpointError(problem, directory=info.path, part=MANIFEST)
    experts = model_experts(info)
    if expert is not None and ("transformer" not in components or experts is None):
        raise ValueError(f"expert {expert!r}: model {info.source or info.path} "
                         + ("has one transformer (no model.experts / transformer_2)" if experts is None
                            else "is loaded without its transformer (add it to components)"))
    if set(components) == set(COMPONENTS) and expert is None:
        loaded = _load_all(info)
    else:
        loaded = _load_some(info, set(components), expert)
    if loaded.transformer is not None:
        _merge_adapters(loaded.transformer, info, lora_path, expert=expert)
        if expert is not None and isinstance(loaded.transformer, TwoExperts):  # a checkpoint's, read whole
            loaded.transformer = pick_expert(loaded.transformer, expert)  # after both experts' adapters merged
    for module in (loaded.transformer, loaded.vae, loaded.text_encoder, loaded.image_encoder):
        if module is not None:
            module.eval()
    return LoadedModel(info.family, loaded, info.flow, info.max_sequence_length, list(info.buckets), experts)


def _load_all(info: ModelInfo) -> "Components":
    """Every component, as the family builds (a checkpoint) or loads (a pipeline folder) the whole model."""
    if info.kind == "checkpoint":
        components = info.family.build(info.job.model, seed=info.job.train.seed)
        if not is_lora_checkpoint(_read_manifest(info.path)):
            components.transformer.load_state_dict(load_transformer_state(info.path))
        return components
    return info.family.build(model_config(info)[0], seed=0)


def _load_some(info: ModelInfo, wanted: set[str], expert: str | None = None) -> "Components":
    """The `wanted` components alone (the others None), through the family's per-component builders; the
    transformer as the one `expert` when given, from a pipeline folder (a checkpoint holds both experts in one
    file: both come back, and `load_model` picks the expert once a LoRA checkpoint's adapters are merged)."""
    from vidray.models.base import Components  # heavy: torch, numpy

    model_cfg, seed = model_config(info)
    family = info.family
    transformer = vae = text_encoder = tokenizer = image_encoder = image_processor = None
    if "transformer" in wanted:
        if expert is not None and info.kind != "checkpoint":
            transformer = family.load_diffusion_models(model_cfg, seed=seed, expert=expert).transformer
        else:
            transformer = family.load_diffusion_models(model_cfg, seed=seed).transformer  # a checkpoint's experts: both
            if info.kind == "checkpoint" and not is_lora_checkpoint(_read_manifest(info.path)):
                transformer.load_state_dict(load_transformer_state(info.path))
    if "vae" in wanted:
        vae = family.load_latent_models(model_cfg, seed=seed).vae
    if "text_encoder" in wanted:
        condition = family.load_condition_models(model_cfg, seed=seed, image=False)
        text_encoder, tokenizer = condition.text_encoder, condition.tokenizer
    if "image_encoder" in wanted:
        condition = family.load_condition_models(model_cfg, seed=seed, text=False)
        image_encoder, image_processor = condition.image_encoder, condition.image_processor
    return Components(transformer=transformer, vae=vae, text_encoder=text_encoder, tokenizer=tokenizer,
                      image_encoder=image_encoder, image_processor=image_processor)


def model_config(info: ModelInfo) -> tuple[ModelConfig, int]:
    """(the model config, the seed) that the family builds `info`'s model from, piece by piece (`load_model`) or
    for its configs (`ModelInfo.family`): a checkpoint's recorded `job.model` and `train.seed`; a diffusers folder
    as `init: pretrained` from itself (its recorded model config, else one read from its model_index.json) and 0."""
    if info.kind == "checkpoint":
        return info.job.model, info.job.train.seed
    base = info.job.model if info.job is not None else ModelConfig(
        family=info.family_name, max_sequence_length=info.max_sequence_length,
        i2v=I2VConfig(image_encoder=_folder_image_encoder(info.path)) if info.image_to_video else None,
        experts=_folder_experts(info.path))
    return dataclasses.replace(base, init="pretrained", pretrained_path=str(info.path), vae_path=None, lora=None), 0


def load_pipeline_folder(family: "ModelFamily", path: str | Path) -> "Components":
    """Every module of the local diffusers pipeline folder `path` (never a hub id), whatever its task: `family.build`
    of `folder_model_config`, i.e. the family's three role loaders. Raises FileNotFoundError / ValueError naming the
    folder and the fix, as the loaders do."""
    return family.build(folder_model_config(path, family.name), seed=0)


def folder_model_config(path: str | Path, family: str) -> ModelConfig:
    """The model config that `family` loads the local pipeline folder `path` from, whatever its task
    (`load_pipeline_folder`): `model_config` of the folder (its recorded job's model, else one read from its
    model_index.json: image-to-video, CLIP, experts) when it is a readable pipeline folder of `family`; else plain
    `init: pretrained` at `path`, whose load then raises the family's one-line error naming the folder."""
    plain = ModelConfig(family=family, init="pretrained", pretrained_path=str(path))
    if not (Path(path) / MODEL_INDEX).is_file():
        return plain
    try:
        info = inspect_model(path)
    except (FileNotFoundError, ValueError):  # UserError is a ValueError
        return plain  # the family's load names what is wrong with the folder
    return model_config(info)[0] if info.kind == "diffusers" and info.family_name == family else plain


def _folder_image_encoder(path: Path) -> bool:
    """`model.i2v.image_encoder` of a stock image-to-video folder: whether its model_index.json names an
    `image_encoder` (Wan 2.1 I2V's CLIP)."""
    return (json.loads((Path(path) / MODEL_INDEX).read_text()).get("image_encoder") or [None])[0] is not None


def model_experts(info: ModelInfo) -> ExpertsConfig | None:
    """A model's two experts (`model.experts`: its `boundary_ratio`), from its recorded job config or a stock
    folder's model_index.json; None for a model of one transformer. Reads configs only."""
    if info.job is not None:
        return info.job.model.experts
    return _folder_experts(info.path)


def _folder_experts(path: Path) -> ExpertsConfig | None:
    """`model.experts` of a stock pipeline folder: its model_index.json's `boundary_ratio` (two experts, diffusers'
    `transformer_2`), or None (also for a ratio outside (0, 1), which the family's load then names)."""
    ratio = json.loads((Path(path) / MODEL_INDEX).read_text()).get("boundary_ratio")
    valid = isinstance(ratio, (int, float)) and not isinstance(ratio, bool) and 0 < ratio < 1
    return ExpertsConfig(boundary_ratio=ratio) if valid else None


def _merge_adapters(transformer: "torch.nn.Module", info: ModelInfo, lora_path: str | Path | None, *,
                    expert: str | None = None) -> None:
    """A LoRA checkpoint's adapters, an export's `lora/` (`lora_2/`), then `lora_path`, merged into `transformer`
    (one `expert` of two alone when given: an export's folder of that expert's adapters)."""
    from vidray.models.experts import TwoExperts  # heavy: torch, numpy
    from vidray.models.lora import LoraLoadError, load_lora_into  # heavy: torch, numpy

    if info.kind == "checkpoint" and is_lora_checkpoint(_read_manifest(info.path)):
        _merge_checkpoint_adapters(transformer, info)
    elif info.kind != "checkpoint" and ((info.adapters or info.path) / LORA_DIR).is_dir():  # a LoRA run's export
        _merge_export_adapters(transformer, info.adapters or info.path, expert)
    if lora_path is not None:
        if isinstance(transformer, TwoExperts) or expert is not None:
            raise LoraLoadError(two_experts_lora_problem(info.path, "lora_path"))
        load_lora_into(transformer, lora_path)


def two_experts_lora_problem(model: str | Path, setting: str) -> str:
    """Why a LoRA path given as `setting` (`--lora`, `lora_path`) cannot go with the two-expert model at `model`
    (`model_experts`), in one line naming the setting: a LoRA merges into one transformer."""
    return (f"{setting}: model {model} has two experts (transformer_2), and a LoRA merges into one transformer; "
            f"remove {setting} (a two-expert LoRA run's export merges its own {LORA_DIR}/ and {LORA_2_DIR}/)")


def _merge_export_adapters(transformer: "torch.nn.Module", folder: Path, expert: str | None = None) -> None:
    """A LoRA run's export: `<folder>/lora` merged into the transformer, or, for two experts, `lora/` into the
    high-noise expert and `lora_2/` into the low-noise one (`EXPERT_LORA_DIRS`; `expert`: the transformer is that
    expert alone, a serving stage's). Raises LoraLoadError naming the folder when an expert's adapters are missing
    or do not fit it."""
    from vidray.models.experts import TwoExperts, pick_expert  # heavy: torch, numpy
    from vidray.models.lora import LoraLoadError, load_lora_into  # heavy: torch, numpy

    if expert is None and not isinstance(transformer, TwoExperts):
        load_lora_into(transformer, folder / LORA_DIR)
        return
    targets = {expert: transformer} if expert is not None else {side: pick_expert(transformer, side)
                                                                  for side in EXPERT_LORA_DIRS}
    for side, module in targets.items():
        name = EXPERT_LORA_DIRS[side]
        if not (folder / name).is_dir():
            raise LoraLoadError(f"LoRA export {folder} has two experts and {LORA_DIR}/ but no {name}/ (the "
                                f"{side}-noise expert's adapters): export the run again")
        load_lora_into(module, folder / name)


def lora_path_problem(path: str | Path) -> str | None:
    """Why `path` cannot be a LoRA to load (`vidray.models.lora.read_lora_weights`), from file checks alone (no
    torch, no read), or None: it must be a local .safetensors file, or a folder holding
    `DIFFUSERS_LORA_WEIGHTS` or `PEFT_WEIGHTS` (an export's `<run>/diffusers/lora`, or the export itself)."""
    if is_uri(path):
        return f"{path} is a URI; a LoRA must be a local folder or file (copy it here first)"
    path = Path(path)
    if not path.exists():
        return f"{path} does not exist; give the adapters' folder (<run>/diffusers/{LORA_DIR}) or a .safetensors file"
    if path.is_file():
        return None if path.suffix == ".safetensors" else f"{path} is not a .safetensors file"
    if any((path / name).is_file() for name in (DIFFUSERS_LORA_WEIGHTS, PEFT_WEIGHTS)):
        return None
    hint = f" (it has {LORA_DIR}/: give {path / LORA_DIR})" if (path / LORA_DIR).is_dir() else ""
    return f"folder {path} holds neither {DIFFUSERS_LORA_WEIGHTS} nor {PEFT_WEIGHTS}{hint}"


def _merge_checkpoint_adapters(transformer: "torch.nn.Module", info: ModelInfo) -> None:
    """Apply the checkpoint's `model.lora`, load its `ADAPTER_PART`, merge. Raises CheckpointError when its
    config has no model.lora or the adapters do not fit it."""
    from vidray.models.lora import (  # heavy: torch, numpy
        adapter_state_dict,
        apply_lora,
        load_adapter_state_dict,
        merge_lora,
    )

    if info.job.model.lora is None:
        raise CheckpointError(f"checkpoint {info.path} holds LoRA adapters ({ADAPTER_PART}) but its config.yaml has "
                              "no model.lora: it was not written by vidray", directory=info.path, part="config.yaml")
    apply_lora(transformer, info.job.model.lora, seed=info.job.train.seed)  # the run's own starting adapters
    try:  # over them, the saved ones (a sharded checkpoint leaves out adapters that never train)
        load_adapter_state_dict(transformer, {**adapter_state_dict(transformer), **load_adapter_state(info.path)})
    except ValueError as err:
        raise CheckpointError(f"checkpoint {info.path}: {ADAPTER_PART} does not fit its config's model.lora ({err})",
                              directory=info.path, part=ADAPTER_PART) from None
    merge_lora(transformer)


def sharded_checkpoint_problem(info: ModelInfo) -> str | None:
    """One line refusing a sharded (`layout: dcp`) training checkpoint as a model to serve or generate from (a
    DCP folder is pickle-based: serving reads the safetensors export), naming the command that exports it; None for
    any other model. Reads the manifest only."""
    if info.kind != "checkpoint" or _read_manifest(info.path).get("layout") != "dcp":
        return None
    where = info.source or info.path
    return (f"{where} is a sharded (DCP) training checkpoint, which serving and vidray generate do not load: export "
            f"it to safetensors first with `vidray export {where} OUT_DIR` and give OUT_DIR")


def export_checkpoint(checkpoint: str | Path, out_dir: str | Path) -> Path:
    """Write a training checkpoint (full or sharded, LoRA or not; a local folder or a URI) as the diffusers
    pipeline folder the end of a run writes (`export_pipeline` + `write_job_file`: safetensors, the LoRA adapters
    in `lora/`), what serving and `vidray generate` load; `vidray export CHECKPOINT OUT_DIR`. The trained weights
    are exported (not an EMA). A sharded checkpoint is read in one process without unpickling anything from
    storage (`vidray.models.dcp_reader`). Returns `out_dir`. Raises ModelFolderError for a folder that is no
    checkpoint, CheckpointError (IncompleteCheckpointError / DamagedCheckpointError naming the file) as
    `verify_checkpoint`."""
    from vidray.models.lora import adapter_state_dict, apply_lora, load_adapter_state_dict  # heavy: torch, numpy

    info = inspect_model(checkpoint)
    if info.kind != "checkpoint":
        raise ModelFolderError(f"{checkpoint} is already a pipeline folder (model_index.json): serve it as it is")
    job = info.job
    components = info.family.build(job.model, seed=job.train.seed)
    if is_lora_checkpoint(_read_manifest(info.path)):
        if job.model.lora is None:
            raise CheckpointError(f"checkpoint {info.path} holds LoRA adapters but its config.yaml has no "
                                  "model.lora: it was not written by vidray", directory=info.path, part="config.yaml")
        apply_lora(components.transformer, job.model.lora, seed=job.train.seed)
        load_adapter_state_dict(components.transformer,
                                {**adapter_state_dict(components.transformer), **load_adapter_state(info.path)})
    else:
        components.transformer.load_state_dict(load_transformer_state(info.path))
    components.transformer.eval()
    export_pipeline(info.family, components, out_dir, info.flow, base=lora_export_base(job))
    write_job_file(out_dir, job)
    return Path(out_dir)


def export_pipeline(family: "ModelFamily", components: "Components", out_dir: str | Path, flow: FlowConfig, *,
                    base: str | Path | None = None) -> Path:
    """The end-of-run diffusers export, for full and LoRA runs alike. Returns `out_dir`; write the job file
    (`write_job_file`) after this call: the folder is replaced as a whole.

    - No adapters on the transformer: `family.save_pipeline(components, out_dir, flow)` (a complete stock pipeline
      folder, written to a temp folder and renamed).
    - Adapters and `base` (`lora_export_base(job)`: a LoRA run of `model.init: pretrained`): an adapter-only
      export, never a copy of the base: the adapters in `<out_dir>/lora/` (`vidray.models.lora.save_lora_weights`:
      diffusers' `pytorch_lora_weights.safetensors` and peft's `adapter_config.json` + `adapter_model.safetensors`;
      a two-expert model (`TwoExperts`) one folder per expert, `EXPERT_LORA_DIRS`) and `BASE_REF`, the base's
      location and fingerprint (`write_base_reference`). Only the adapters of `components` are read (the other
      components may be None).
    - Adapters and no `base` (`init: random`, whose base exists in no folder, or a run with its own `vae_path`):
      the pipeline is written with the BASE transformer (adapters swapped out meanwhile, `without_lora`: nothing
      merged) and the adapters beside it in `lora/` (`lora_2/`).

    Loading it: `load_model(out_dir)` (vidray generate, serve) finds the base, checks it and merges the adapters.
    Stock diffusers: `pipe = WanPipeline.from_pretrained(base)` (the folder itself when it holds model_index.json),
    `pipe.load_lora_weights(f"{out_dir}/lora")`, and for two experts `pipe.load_lora_weights(f"{out_dir}/lora_2",
    load_into_transformer_2=True)`. diffusers 0.42.1's `EasyAnimatePipeline` has no LoRA loader: take them
    through peft, `peft.PeftModel.from_pretrained(pipe.transformer, f"{out_dir}/lora")` (injects in place).
    A merged folder on request: `vidray export --merge-lora` (`vidray.models.merge.export_merged`).
    """
    from vidray.models.experts import EXPERT_ATTRIBUTES, TwoExperts  # heavy: torch, numpy
    from vidray.models.lora import has_lora, save_lora_weights, without_lora  # heavy: torch, numpy

    if not has_lora(components.transformer):
        return family.save_pipeline(components, out_dir, flow)

    def save_adapters(folder: Path) -> None:
        if isinstance(components.transformer, TwoExperts):  # one stock LoRA folder per expert
            for expert, name in EXPERT_LORA_DIRS.items():
                save_lora_weights(components.transformer, folder / name, prefix=EXPERT_ATTRIBUTES[expert] + ".")
        else:
            save_lora_weights(components.transformer, folder / LORA_DIR)

    out_dir = Path(out_dir)
    if base is None:
        with without_lora(components.transformer):
            family.save_pipeline(components, out_dir, flow)
        save_adapters(out_dir)
        return out_dir
    return _write_adapter_export(out_dir, base, save_adapters)


def _write_adapter_export(out_dir: Path, base: str | Path, save_adapters: "Callable[[Path], None]") -> Path:
    """An adapter-only export: `save_adapters(folder)` and `BASE_REF` written into a temp folder beside `out_dir`,
    which then replaces `out_dir` as a whole."""
    out_dir = Path(out_dir)
    out_dir.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{out_dir.name}.", suffix=".tmp", dir=out_dir.parent))
    try:
        save_adapters(tmp)
        write_base_reference(tmp, base)
        if out_dir.exists():
            shutil.rmtree(out_dir)
        tmp.rename(out_dir)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return out_dir


def export_adapters(state: "dict[str, torch.Tensor]", lora_cfg: Any, base_class: type, out_dir: str | Path,
                    base: str | Path, *, experts: bool = False) -> Path:
    """The adapter-only export of `export_pipeline(..., base=...)` from the adapter tensors alone (no model in
    memory): what the end of a LoRA run writes after gathering only the adapters to rank 0 (megabytes, where the
    base is gigabytes). `state`: `vidray.models.lora.adapter_state_dict`'s naming (`...to_q.lora_A.weight`); with
    `experts`, each name under its expert's prefix (`transformer.` / `transformer_2.`, `EXPERT_ATTRIBUTES`), each
    expert's written to its folder (`EXPERT_LORA_DIRS`). `lora_cfg`: the run's `model.lora`; `base_class`: the
    adapted transformer's class. Returns `out_dir`. Raises ValueError when an expert has no adapters."""
    from vidray.models.experts import EXPERT_ATTRIBUTES  # heavy: torch, numpy
    from vidray.models.lora import save_adapter_state  # heavy: torch, numpy

    def save_adapters(folder: Path) -> None:
        if not experts:
            save_adapter_state(state, lora_cfg, base_class, folder / LORA_DIR)
            return
        for expert, name in EXPERT_LORA_DIRS.items():
            prefix = EXPERT_ATTRIBUTES[expert] + "."
            save_adapter_state({k[len(prefix):]: v for k, v in state.items() if k.startswith(prefix)}, lora_cfg,
                               base_class, folder / name)

    return _write_adapter_export(Path(out_dir), base, save_adapters)


def write_job_file(diffusers_dir: str | Path, job: JobConfig) -> Path:
    """Record the resolved job config beside an exported pipeline so `load_model` samples as trained."""
    out = Path(diffusers_dir) / JOB_FILE
    out.write_text(yaml.safe_dump(job.to_dict(), sort_keys=False))
    return out
