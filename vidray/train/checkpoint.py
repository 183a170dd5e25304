"""Training checkpoints made of named parts, complete or absent.

A checkpoint folder holds:
- `transformer.safetensors`: the trained transformer's state dict (unwrapped from DDP),
- `optimizer.pt`, `lr_scheduler.pt`: their `state_dict()`s,
- `train_state.json`: step (1-based, the last step applied), data position, world size, index hash,
- `config.yaml`: the resolved job config,
- `manifest.json`: written last; lists the parts. A folder without it is an unfinished write and is refused.

The folder is written to a fresh temp dir and only then handed to `ray.train.report`, so a crash while writing
never replaces the previous checkpoint (torchtitan's "only resumable when complete"; STYLE.md rule 7).
"""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import torch
import yaml
from safetensors.torch import load_file, save_file

MANIFEST = "manifest.json"
PARTS = ("transformer.safetensors", "optimizer.pt", "lr_scheduler.pt", "train_state.json", "config.yaml")
FORMAT_VERSION = 1


@dataclass(frozen=True)
class TrainState:
    """Scalar state of a run at a checkpoint.

    step: last optimizer step applied (1-based). epoch, batch_index: data position of that step.
    world_size: ranks the schedule was dealt to. index_hash: content hash of the shard index trained on.
    """

    step: int
    epoch: int
    batch_index: int
    world_size: int
    index_hash: str


class IncompleteCheckpointError(RuntimeError):
    """A checkpoint folder lacks its manifest or one of its parts (an interrupted write)."""


def save_checkpoint(
    directory: str | Path,
    *,
    transformer_state: dict[str, torch.Tensor],
    optimizer: torch.optim.Optimizer,
    lr_scheduler: Any,
    train_state: TrainState,
    job_config: dict[str, Any],
) -> Path:
    """Write every part into `directory` (created if missing), the manifest last. Returns the folder."""
    directory = Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    state = {k: v.detach().to("cpu").contiguous() for k, v in transformer_state.items()}
    save_file(state, str(directory / "transformer.safetensors"))
    torch.save(optimizer.state_dict(), directory / "optimizer.pt")
    torch.save(lr_scheduler.state_dict(), directory / "lr_scheduler.pt")
    (directory / "train_state.json").write_text(json.dumps(asdict(train_state), indent=2))
    (directory / "config.yaml").write_text(yaml.safe_dump(job_config, sort_keys=False))
    manifest = {"format_version": FORMAT_VERSION, "parts": list(PARTS), "step": train_state.step}
    (directory / MANIFEST).write_text(json.dumps(manifest, indent=2))
    return directory


def _check_complete(directory: Path) -> None:
    if not (directory / MANIFEST).is_file():
        raise IncompleteCheckpointError(
            f"checkpoint {directory} has no {MANIFEST}: it was not finished; use an earlier checkpoint"
        )
    missing = [p for p in PARTS if not (directory / p).is_file()]
    if missing:
        raise IncompleteCheckpointError(f"checkpoint {directory} is missing {', '.join(missing)}")


def read_train_state(directory: str | Path) -> TrainState:
    """TrainState of a complete checkpoint. Raises IncompleteCheckpointError otherwise."""
    directory = Path(directory)
    _check_complete(directory)
    return TrainState(**json.loads((directory / "train_state.json").read_text()))


def read_job_config(directory: str | Path) -> dict[str, Any]:
    """The resolved job config (a plain dict) saved in a complete checkpoint."""
    directory = Path(directory)
    _check_complete(directory)
    return yaml.safe_load((directory / "config.yaml").read_text())


def load_transformer_state(directory: str | Path) -> dict[str, torch.Tensor]:
    """The transformer state dict of a complete checkpoint, on CPU."""
    directory = Path(directory)
    _check_complete(directory)
    return load_file(str(directory / "transformer.safetensors"))


def load_checkpoint(
    directory: str | Path, *, transformer: torch.nn.Module, optimizer: torch.optim.Optimizer, lr_scheduler: Any
) -> TrainState:
    """Restore transformer, optimizer and lr scheduler in place from a complete checkpoint; return its TrainState.

    Raises IncompleteCheckpointError for an unfinished folder, and RuntimeError (from torch) when the
    transformer's parameters do not match the saved ones (a different model preset).
    """
    directory = Path(directory)
    train_state = read_train_state(directory)
    transformer.load_state_dict(load_transformer_state(directory))
    optimizer.load_state_dict(torch.load(directory / "optimizer.pt", map_location="cpu", weights_only=True))
    lr_scheduler.load_state_dict(torch.load(directory / "lr_scheduler.pt", weights_only=True))
    return train_state
