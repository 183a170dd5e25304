"""Training checkpoints made of named parts, complete, verified, or refused.

A checkpoint folder holds:
- `transformer.safetensors`: the trained transformer's state dict (unwrapped from DDP),
- `optimizer.pt`, `lr_scheduler.pt`: their `state_dict()`s,
- `train_state.json`: step (1-based, the last step applied), data position (epoch, micro-batches consumed per
  bucket), world size, index hash,
- `config.yaml`: the resolved job config,
- `manifest.json`: written last; records every part's size in bytes and sha256. A folder without it is an
  unfinished write and is refused; a part whose size or hash differs from the manifest is damaged and refused.

The folder is written to a fresh temp dir and only then handed to `ray.train.report`, so a crash while writing
never replaces the previous checkpoint (torchtitan's "only resumable when complete"; STYLE.md rule 7).

Format versions: 2 (this one) records `files: {part: {size_bytes, sha256}}`. Version 1 (vidray before per-file
hashes) recorded only the part names: such checkpoints still load, checked for presence only, with a warning
that they cannot be verified. Any other version is refused.
"""

from __future__ import annotations

import hashlib
import json
import warnings
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import pyarrow.parquet as pq
import torch
import yaml
from safetensors.torch import load_file, save_file

from vidray.errors import UserError

MANIFEST = "manifest.json"
DATASET_ROWS = "dataset_rows.parquet"
PARTS = ("transformer.safetensors", "optimizer.pt", "lr_scheduler.pt", "train_state.json", "config.yaml")
FORMAT_VERSION = 2
READABLE_FORMAT_VERSIONS = (1, 2)
_HASH_CHUNK_BYTES = 8 * 1024 * 1024


@dataclass(frozen=True)
class TrainState:
    """Scalar state of a run at a checkpoint.

    step: last optimizer step applied (1-based). epoch, batch_index: the data position after that step, where the
    next step starts (`vidray.data.schedule.DataPosition`): the epoch (0-based) and the micro-batches of it consumed
    (all buckets; world-size independent). consumed_per_bucket: {"9x64x64": micro-batches consumed, ...}, the
    position itself (the loop reads it back on resume); None in checkpoints of vidray before the world-size
    independent schedule, whose epoch/batch_index counted steps of one world size (such a run resumes at the start
    of the next epoch). world_size: ranks of the run that wrote it. index_hash: content hash of the shard index (changes when the
    same sources are prepared again). dataset_hash: `vidray.data.index.dataset_hash` of the shards, the identity a
    resume checks ("" in checkpoints written before it: those compare index_hash). num_samples: samples then.
    """

    step: int
    epoch: int
    batch_index: int
    world_size: int
    index_hash: str
    consumed_per_bucket: dict[str, int] | None = None
    dataset_hash: str = ""
    num_samples: int | None = None


def dataset_mismatch(state: TrainState, shards_dir: str | Path, index: dict[str, Any],
                     current_rows: Any = None, checkpoint_dir: str | Path | None = None) -> str | None:
    """Why a checkpoint with `state` cannot resume on the prepared folder `shards_dir` (whose `index` is given), as
    the end of a sentence ("was trained on ..."), or None when it may. Checkpoints with a `dataset_hash` compare
    the dataset (`vidray.data.index.dataset_hash` of `current_rows`, the folder's `dataset_rows`, read here when
    None), so re-preparing identical sources resumes; older ones compare the index's content hash. With the
    checkpoint's folder holding `DATASET_ROWS`, the message counts the samples added, removed and changed."""
    if state.dataset_hash:
        from vidray.data.index import dataset_hash, dataset_rows, describe_dataset_change

        rows = dataset_rows(shards_dir) if current_rows is None else current_rows
        current = dataset_hash(rows)
        if current == state.dataset_hash:
            return None
        then = "" if state.num_samples is None else f" of {state.num_samples} samples"
        saved = None if checkpoint_dir is None else Path(checkpoint_dir) / DATASET_ROWS
        what = ("samples, sources, clip windows or captions differ" if saved is None or not saved.is_file()
                else describe_dataset_change(pq.read_table(saved), rows))
        return (f"was trained on another dataset ({state.dataset_hash}{then}) than {shards_dir} holds "
                f"({current} of {index.get('num_samples')} samples: {what}): re-prepare from the original sources "
                "into data.shards_dir, or start a new run under another name")
    if state.index_hash and state.index_hash != index.get("content_hash"):
        return (f"was trained on other shards (index {state.index_hash}) than {shards_dir} "
                f"({index.get('content_hash')}; this checkpoint predates dataset hashes, so any re-prepare counts as "
                "a change): use the original shards, or a new run name to start afresh")
    return None


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


def save_checkpoint(
    directory: str | Path,
    *,
    transformer_state: dict[str, torch.Tensor],
    optimizer: torch.optim.Optimizer,
    lr_scheduler: Any,
    train_state: TrainState,
    job_config: dict[str, Any],
    dataset: Any = None,
) -> Path:
    """Write every part into `directory` (created if missing), then the manifest with each part's size and
    sha256. Returns the folder. `dataset`: the shards' `vidray.data.index.dataset_rows` table, written as
    `DATASET_ROWS` (optional, not a verified part: it only makes a refused resume say which samples differ)."""
    directory = Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    state = {k: v.detach().to("cpu").contiguous() for k, v in transformer_state.items()}
    save_file(state, str(directory / "transformer.safetensors"))
    torch.save(optimizer.state_dict(), directory / "optimizer.pt")
    torch.save(lr_scheduler.state_dict(), directory / "lr_scheduler.pt")
    (directory / "train_state.json").write_text(json.dumps(asdict(train_state), indent=2))
    (directory / "config.yaml").write_text(yaml.safe_dump(job_config, sort_keys=False))
    if dataset is not None:
        pq.write_table(dataset, directory / DATASET_ROWS)
    files = {
        part: {"size_bytes": (directory / part).stat().st_size, "sha256": file_sha256(directory / part)}
        for part in PARTS
    }
    manifest = {"format_version": FORMAT_VERSION, "parts": list(PARTS), "files": files, "step": train_state.step}
    (directory / MANIFEST).write_text(json.dumps(manifest, indent=2))
    return directory


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


def read_train_state(directory: str | Path) -> TrainState:
    """TrainState of a checkpoint with its manifest and parts present (sizes and hashes are not checked here:
    `verify_checkpoint` does that). Raises IncompleteCheckpointError / DamagedCheckpointError."""
    directory = Path(directory)
    _read_manifest(directory)
    return TrainState(**_read_part(directory, "train_state.json", lambda p: json.loads(p.read_text())))


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


def load_transformer_state(directory: str | Path) -> dict[str, torch.Tensor]:
    """The transformer state dict of a verified checkpoint, on CPU (sizes and hashes checked first)."""
    directory = Path(directory)
    verify_checkpoint(directory)
    return _read_part(directory, "transformer.safetensors", lambda p: load_file(str(p)))


def load_checkpoint(
    directory: str | Path,
    *,
    transformer: torch.nn.Module,
    optimizer: torch.optim.Optimizer,
    lr_scheduler: Any,
    verify: bool = True,
) -> TrainState:
    """Restore transformer, optimizer and lr scheduler in place from a checkpoint; return its TrainState.

    The folder is verified against its manifest first (`verify=False` skips the hashes, e.g. when the driver
    has just verified it). Raises IncompleteCheckpointError / DamagedCheckpointError naming the folder and
    file, and CheckpointError when the saved transformer does not fit `transformer` (another model config).
    """
    directory = Path(directory)
    verify_checkpoint(directory, hashes=verify)
    train_state = read_train_state(directory)
    state = _read_part(directory, "transformer.safetensors", lambda p: load_file(str(p)))
    try:
        transformer.load_state_dict(state)
    except RuntimeError as err:
        raise CheckpointError(
            f"checkpoint {directory}: transformer.safetensors does not fit this model ({' '.join(str(err).split())[:300]}); "
            "model.* must match the config the checkpoint was trained with",
            directory=directory, part="transformer.safetensors",
        ) from err
    optimizer.load_state_dict(
        _read_part(directory, "optimizer.pt", lambda p: torch.load(p, map_location="cpu", weights_only=True))
    )
    lr_scheduler.load_state_dict(
        _read_part(directory, "lr_scheduler.pt", lambda p: torch.load(p, weights_only=True))
    )
    return train_state
