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

import json
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import pyarrow.parquet as pq
import torch
import yaml
from safetensors.torch import load_file, save_file

from vidray.models.export import (  # the format's read side lives in the models plane (serving reads it too)
    FORMAT_VERSION,
    MANIFEST,
    PARTS,
    READABLE_FORMAT_VERSIONS,
    CheckpointError,
    DamagedCheckpointError,
    IncompleteCheckpointError,
    _read_manifest,
    _read_part,
    file_sha256,
    load_transformer_state,
    read_job_config,
    verify_checkpoint,
)

__all__ = [
    "CheckpointError", "DamagedCheckpointError", "IncompleteCheckpointError", "TrainState", "dataset_mismatch",
    "file_sha256", "load_checkpoint", "load_transformer_state", "read_job_config", "read_train_state",
    "save_checkpoint", "verify_checkpoint", "DATASET_ROWS", "FORMAT_VERSION", "MANIFEST", "PARTS",
    "READABLE_FORMAT_VERSIONS",
]

DATASET_ROWS = "dataset_rows.parquet"


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


def read_train_state(directory: str | Path) -> TrainState:
    """TrainState of a checkpoint with its manifest and parts present (sizes and hashes are not checked here:
    `verify_checkpoint` does that). Raises IncompleteCheckpointError / DamagedCheckpointError."""
    directory = Path(directory)
    _read_manifest(directory)
    return TrainState(**_read_part(directory, "train_state.json", lambda p: json.loads(p.read_text())))


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
