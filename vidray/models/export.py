"""Saving and loading a run's model outside training: the diffusers export, the checkpoint format's read side,
and `load_model`, which `vidray generate` and the serve plane use (neither imports training code).

A model folder is either
- a diffusers folder written at the end of training (`<run>/diffusers`, with `vidray_job.yaml` beside the
  weights recording the family, buckets, flow shift and prompt length it was trained with), or any local
  diffusers EasyAnimate folder (then prompts use the stock pipeline's 256 tokens and buckets must be given), or
- a training checkpoint folder (`<run>/checkpoint_000200`): components are rebuilt from the saved config and
  the transformer weights are loaded from the checkpoint.

Checkpoint folders (written by `vidray.train.checkpoint.save_checkpoint`) hold named parts and `manifest.json`,
written last, with each part's size in bytes and sha256. Format versions: 2 records `files: {part: {size_bytes,
sha256}}`; version 1 (vidray before per-file hashes) recorded only the part names and loads with a warning.
Any other version is refused. torch, diffusers and safetensors are imported inside the functions that need them, so
that `inspect_model` answers from config files in milliseconds.
"""

from __future__ import annotations

import hashlib
import json
import warnings
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, Literal

import yaml

from vidray.config import FlowConfig, JobConfig, job_config_from_dict
from vidray.data.buckets import Bucket
from vidray.errors import UserError, UserFileNotFound

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
    "ModelFolderError",
    "ModelInfo",
    "PARTS",
    "READABLE_FORMAT_VERSIONS",
    "STOCK_MAX_SEQUENCE_LENGTH",
    "file_sha256",
    "inspect_model",
    "load_model",
    "load_transformer_state",
    "read_job_config",
    "verify_checkpoint",
    "write_job_file",
]

MANIFEST = "manifest.json"
"""The checkpoint's commit marker, written last."""
PARTS = ("transformer.safetensors", "optimizer.pt", "lr_scheduler.pt", "train_state.json", "config.yaml")
FORMAT_VERSION = 2
READABLE_FORMAT_VERSIONS = (1, 2)
_HASH_CHUNK_BYTES = 8 * 1024 * 1024
JOB_FILE = "vidray_job.yaml"
"""Name of the resolved job config written beside an exported diffusers pipeline."""

_PIPELINE_FAMILIES = {"EasyAnimatePipeline": "easyanimate"}
_PIPELINE_SUBFOLDERS = ("transformer", "vae", "text_encoder", "tokenizer", "scheduler")
STOCK_MAX_SEQUENCE_LENGTH = 256
"""diffusers EasyAnimatePipeline.encode_prompt's default prompt length (tokens)."""


class ModelFolderError(UserError):
    """A model folder that is neither a complete diffusers export nor a vidray checkpoint, or holds a pipeline class
    vidray has no family for. Raised before any weights load."""


class CheckpointError(UserError):
    """A checkpoint that cannot be trusted. `directory` is the folder; `part` the file at fault (or None)."""

    def __init__(self, message: str, directory: str | Path | None = None, part: str | None = None):
        super().__init__(message)
        self.directory = None if directory is None else str(directory)
        self.part = part

    def __reduce__(self):  # survives pickling from a Ray worker to the driver
        return (type(self), (str(self), self.directory, self.part))


class IncompleteCheckpointError(CheckpointError):
    """A checkpoint folder lacks its manifest or one of its parts (an interrupted write)."""


class DamagedCheckpointError(CheckpointError):
    """A part's size or sha256 differs from what the manifest recorded, or the part cannot be read."""


def file_sha256(path: str | Path) -> str:
    """Hex sha256 of a file's bytes, read in 8 MiB chunks."""
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        while chunk := f.read(_HASH_CHUNK_BYTES):
            digest.update(chunk)
    return digest.hexdigest()


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


def verify_checkpoint(directory: str | Path, *, hashes: bool = True) -> dict[str, Any]:
    """Check a checkpoint folder against its manifest; returns the manifest.

    Every part must exist; for format 2 each part's size in bytes must match, and with `hashes` its sha256
    (reads every byte: ~1 s per GB). Format 1 folders (no sizes or hashes) are checked for presence only and
    warn. Raises IncompleteCheckpointError (no manifest, missing part), DamagedCheckpointError (size or sha256
    differs: the message names the folder and the file) or CheckpointError (unknown format version).
    """
    directory = Path(directory)
    manifest = _read_manifest(directory)
    missing = [p for p in PARTS if not (directory / p).is_file()]
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
    for part in PARTS:
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
    """The transformer state dict of a verified checkpoint, on CPU (sizes and hashes checked first)."""
    from safetensors.torch import load_file

    directory = Path(directory)
    verify_checkpoint(directory)
    return _read_part(directory, "transformer.safetensors", lambda p: load_file(str(p)))


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
    """Prompt length in tokens the model was trained with (STOCK_MAX_SEQUENCE_LENGTH for a stock folder)."""
    buckets: list[Bucket]
    """Training buckets (empty for a stock folder)."""

    @property
    def family(self) -> "ModelFamily":
        """The registered model family (imports torch and diffusers on first use)."""
        from vidray.models.registry import get_family

        return get_family(self.family_name)

    def default_bucket(self) -> Bucket | None:
        """The first multi-frame training bucket (else the first bucket; None when none is recorded)."""
        videos = [b for b in self.buckets if b.num_frames > 1] or self.buckets
        return videos[0] if videos else None


@dataclass
class LoadedModel:
    """A model ready for sampling: family, components (eval mode), flow settings, prompt length, buckets."""

    family: "ModelFamily"
    components: "Components"
    flow: FlowConfig
    max_sequence_length: int
    buckets: list[Bucket]


def inspect_model(path: str | Path) -> ModelInfo:
    """Read a diffusers folder or a vidray checkpoint folder's configs (see the module docstring), loading no
    weights (a checkpoint's files are verified against its manifest).

    Raises UserFileNotFound when `path` does not exist, ModelFolderError when it is neither kind of folder,
    is a pipeline of an unsupported class, or lacks a component subfolder; ConfigError for a recorded job config
    that no longer validates; the checkpoint module's errors for an incomplete checkpoint.
    """
    path = Path(path)
    _check_model_kind(path)
    if (path / MANIFEST).is_file():
        job = job_config_from_dict(read_job_config(path))
        return ModelInfo(path, "checkpoint", job.model.family, job, job.flow, job.model.max_sequence_length,
                         list(job.data.buckets))
    missing = [name for name in _PIPELINE_SUBFOLDERS if not (path / name).is_dir()]
    if missing:
        raise ModelFolderError(
            f"diffusers folder {path} lacks {', '.join(missing)}/: it is incomplete; re-export it"
        )
    if (path / JOB_FILE).is_file():
        job = job_config_from_dict(yaml.safe_load((path / JOB_FILE).read_text()))
        return ModelInfo(path, "diffusers", job.model.family, job, job.flow, job.model.max_sequence_length,
                         list(job.data.buckets))
    try:
        class_name = json.loads((path / "model_index.json").read_text()).get("_class_name", "")
        scheduler = json.loads((path / "scheduler" / "scheduler_config.json").read_text())
    except (OSError, json.JSONDecodeError, AttributeError) as err:
        raise ModelFolderError(f"diffusers folder {path}: unreadable model_index.json or scheduler config ({err})")
    if class_name not in _PIPELINE_FAMILIES:
        raise ModelFolderError(
            f"model {path} holds a {class_name or 'unknown'} pipeline; "
            f"supported: {', '.join(sorted(_PIPELINE_FAMILIES))}"
        )
    flow = FlowConfig(shift=float(scheduler.get("shift", 1.0)),
                      num_train_timesteps=int(scheduler.get("num_train_timesteps", 1000)))
    return ModelInfo(path, "diffusers", _PIPELINE_FAMILIES[class_name], None, flow, STOCK_MAX_SEQUENCE_LENGTH, [])


def _check_model_kind(path: Path) -> None:
    """Raise unless `path` is a folder with a checkpoint manifest or a model_index.json (file checks only)."""
    if not path.exists():
        raise UserFileNotFound(f"model {path} does not exist; give <run>/diffusers or <run>/checkpoint_NNNNNN")
    if not ((path / MANIFEST).is_file() or (path / "model_index.json").is_file()):
        raise ModelFolderError(
            f"model {path} is neither a diffusers folder (model_index.json) nor a vidray checkpoint "
            f"({MANIFEST}); give <run>/diffusers or <run>/checkpoint_NNNNNN"
        )


def load_model(path: str | Path) -> LoadedModel:
    """Load a diffusers folder or a vidray checkpoint folder for sampling (see the module docstring).

    Raises as `inspect_model` does (before any weights load).
    """
    info = inspect_model(path)
    if info.kind == "checkpoint":
        components = info.family.build(info.job.model, seed=info.job.train.seed)
        components.transformer.load_state_dict(load_transformer_state(info.path))
    else:
        components = info.family.load_pretrained(info.path)
    for module in (components.transformer, components.vae, components.text_encoder):
        module.eval()
    return LoadedModel(info.family, components, info.flow, info.max_sequence_length, list(info.buckets))


def write_job_file(diffusers_dir: str | Path, job: JobConfig) -> Path:
    """Record the resolved job config beside an exported pipeline so `load_model` samples as trained."""
    out = Path(diffusers_dir) / JOB_FILE
    out.write_text(yaml.safe_dump(job.to_dict(), sort_keys=False))
    return out
