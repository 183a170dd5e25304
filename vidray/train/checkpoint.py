"""Training checkpoints made of named parts, complete, verified, or refused; and the one owner of a run's checkpoints.

A checkpoint folder `<storage.path>/<name>/checkpoint_<step:06d>` holds:
- `transformer.safetensors`: the trained transformer's state dict (unwrapped from DDP); in a LoRA run's
  (`model.lora`) checkpoint `adapter.safetensors` instead: only the adapters (`vidray.models.lora`), the base
  weights being what the config's model init gives; the manifest then records them under `lora`,
- `optimizer.pt`: the optimizer state keyed by parameter name (`torch.distributed.checkpoint.state_dict`'s
  `get_optimizer_state_dict`, so a sharded (FSDP) model saves and loads through the same helpers),
- `lr_scheduler.pt`: its `state_dict()`,
- `ema.safetensors`, `grad_scaler.pt`, `comm_hook.pt`: when the run has an EMA of the transformer, a grad scaler
  (fp16) or a DDP communication hook with state (PowerSGD: every rank's error feedback),
- `train_state.json`: step (1-based, the last step applied), data position (epoch, micro-batches consumed per
  bucket), world size, index hash,
- `config.yaml`: the resolved job config,
- `manifest.json`: written last; records every part's size in bytes and sha256. A folder without it is an
  unfinished write and is passed over; a part whose size or hash differs from the manifest is damaged and refused.

`CheckpointManager` owns everything about a run's checkpoints: the folder name of a step, which checkpoint is the
latest complete one, writing a checkpoint's parts (`save_checkpoint`), copying it to the run folder on any storage
(local or `s3://`, `CheckpointManager.upload`: parts first, manifest last, so a crash during the copy leaves the
previous checkpoint the latest complete one), fetching one for loading, and loading it back (`load_checkpoint`).
The driver (`vidray.train.resume.plan_resume`) and the workers (`vidray.train.loop`) both ask it.

Writing is two-phase: rank 0 writes the parts to a fresh local temp folder (the snapshot: the only time the step is
blocked with `checkpoint.upload: async`), then Ray Train's report calls `CheckpointManager.ray_upload_fn` (in a
background thread when asynchronous) to copy it into the run folder; Ray registers the checkpoint only once that
returns. A failed copy is retried (`UPLOAD_ATTEMPTS`), then fails the run attempt with the error; since the
manifest goes last, a failed or killed copy never looks complete (torchtitan's "only resumable when complete";
STYLE.md rule 7).

Sharded checkpoints (`scaling.strategy: fsdp | hsdp`) keep this layout with the model and optimizer in a DCP part
folder: `dcp/.metadata` and `dcp/__<rank>_0.distcp` (every rank's shards, `torch.distributed.checkpoint.save`,
synchronous) instead of `transformer.safetensors` / `optimizer.pt`, and `layout: dcp` in the manifest, which lists
every rank's file with its size and sha256 (gathered to rank 0). Every rank writes its own temp folder and reports
it to Ray Train with the same `checkpoint_dir_name` and `CheckpointManager.ray_shard_upload_fn`; rank 0's copy
writes the manifest only after every listed file is in the run folder (`save_sharded_checkpoint`,
`load_sharded_checkpoint`: DCP reshards on load, so any worker count, and a DDP run, can resume it).

Format versions: 3 (this one) lists the parts present in the manifest and stores the optimizer state by parameter
name. 2 recorded `files: {part: {size_bytes, sha256}}` with the optimizer's own `state_dict()` (parameters by index);
1 (vidray before per-file hashes) recorded only the part names: such checkpoints still load (format 1 checked for
presence only, with a warning that it cannot be verified). Any other version is refused.
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import os
import signal
import tempfile
import time
import warnings
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any, Iterator

import pyarrow.fs as pafs
import pyarrow.parquet as pq
import torch
import yaml
from safetensors.torch import load_file, save_file

from vidray.models.lora import adapter_state_dict, has_lora, load_adapter_state_dict, lora_settings
from vidray.storage import download_dir, open_storage, safe_join
from vidray.models.export import (  # the format's read side lives in the models plane (serving reads it too)
    ADAPTER_PART,
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
    manifest_parts,
    read_job_config,
    required_parts,
    verify_checkpoint,
)
from vidray.train.parallel import gather_to_rank0

__all__ = [
    "CheckpointManager", "CheckpointUploadError", "checkpoint_dir_name", "checkpoint_step", "CheckpointError", "DamagedCheckpointError", "IncompleteCheckpointError", "TrainState", "dataset_mismatch",
    "file_sha256", "load_checkpoint", "load_transformer_state", "read_job_config", "read_train_state",
    "save_checkpoint", "verify_checkpoint", "ADAPTER_PART", "DATASET_ROWS", "FORMAT_VERSION", "MANIFEST", "PARTS",
    "READABLE_FORMAT_VERSIONS", "PendingShardedCheckpoint", "save_sharded_checkpoint", "start_sharded_checkpoint",
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
        from vidray.data.index import dataset_hash, dataset_rows, describe_dataset_change  # heavy: pyarrow

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


def _state_dict_options():
    from torch.distributed.checkpoint.state_dict import StateDictOptions  # heavy: torch

    return StateDictOptions(full_state_dict=True, cpu_offload=True)


def save_checkpoint(
    directory: str | Path,
    *,
    model: torch.nn.Module,
    optimizer: torch.optim.Optimizer,
    lr_scheduler: Any,
    train_state: TrainState,
    job_config: dict[str, Any],
    dataset: Any = None,
    ema: torch.nn.Module | None = None,
    grad_scaler: Any = None,
    comm_hook_state: dict[str, Any] | None = None,
) -> Path:
    """Write every part of a checkpoint into the local folder `directory` (created if missing), then the manifest
    with each part's size and sha256. Returns the folder.

    model: the transformer (plain or DDP-wrapped: `get_model_state_dict` unwraps it; the state is gathered to CPU in
    full). A model with LoRA adapters (`vidray.models.lora.apply_lora`) saves only them, as `ADAPTER_PART` in place
    of transformer.safetensors (`_save_model_part`). optimizer: its state is saved by parameter name
    (`get_optimizer_state_dict`; a LoRA run's optimizer holds only the adapters). ema, grad_scaler: saved as
    `ema.safetensors` / `grad_scaler.pt` when given. comm_hook_state: every rank's DDP communication-hook state
    (`vidray.train.parallel.CommHook.gather_state`), saved as `comm_hook.pt` when given. `dataset`: the shards' `vidray.data.index.dataset_rows` table,
    written as `DATASET_ROWS` (optional, not a verified part: it only makes a refused resume say which samples
    differ). Raises OSError when the folder cannot be written.
    """
    from torch.distributed.checkpoint.state_dict import get_model_state_dict, get_optimizer_state_dict  # heavy: torch

    directory = Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    options = _state_dict_options()
    lora = _save_model_part(model, directory)
    torch.save(get_optimizer_state_dict(model, optimizer, options=options), directory / "optimizer.pt")
    _save_run_parts(directory, lr_scheduler=lr_scheduler, train_state=train_state, job_config=job_config,
                    dataset=dataset)
    parts = list(required_parts(lora is not None))
    if ema is not None:
        ema_state = get_model_state_dict(ema, options=options)
        save_file({k: v.detach().to("cpu").contiguous() for k, v in ema_state.items()}, str(directory / "ema.safetensors"))
        parts.append("ema.safetensors")
    if grad_scaler is not None:
        torch.save(grad_scaler.state_dict(), directory / "grad_scaler.pt")
        parts.append("grad_scaler.pt")
    if comm_hook_state is not None:
        torch.save(comm_hook_state, directory / "comm_hook.pt")
        parts.append("comm_hook.pt")
    manifest = {"format_version": FORMAT_VERSION, "parts": parts, "files": _file_records(directory, parts),
                "step": train_state.step}
    if lora is not None:
        manifest["lora"] = lora
    (directory / MANIFEST).write_text(json.dumps(manifest, indent=2))
    return directory


def _save_run_parts(directory: Path, *, lr_scheduler: Any, train_state: TrainState, job_config: dict[str, Any],
                    dataset: Any) -> None:
    """The parts every checkpoint, full or sharded, writes beside its model and optimizer state: `lr_scheduler.pt`,
    `train_state.json`, `config.yaml`, and `DATASET_ROWS` when `dataset` is given."""
    torch.save(lr_scheduler.state_dict(), directory / "lr_scheduler.pt")
    (directory / "train_state.json").write_text(json.dumps(asdict(train_state), indent=2))
    (directory / "config.yaml").write_text(yaml.safe_dump(job_config, sort_keys=False))
    if dataset is not None:
        pq.write_table(dataset, directory / DATASET_ROWS)


def _file_records(directory: Path, parts: list[str]) -> dict[str, dict[str, Any]]:
    """{part: {"size_bytes", "sha256"}} of files under `directory` (relative POSIX paths): the manifest's `files`."""
    return {part: {"size_bytes": (directory / part).stat().st_size, "sha256": file_sha256(directory / part)}
            for part in parts}


def _save_model_part(model: torch.nn.Module, directory: Path) -> dict[str, Any] | None:
    """Write the model part: `ADAPTER_PART` (the LoRA adapters only) when `model` has adapters, and return their
    shape {rank, alpha, dropout, target_modules} for the manifest; else transformer.safetensors (the full state
    dict, gathered to CPU) and None."""
    from torch.distributed.checkpoint.state_dict import get_model_state_dict  # heavy: torch

    if has_lora(model):
        save_file(adapter_state_dict(model), str(directory / ADAPTER_PART))
        return lora_settings(model)
    state = get_model_state_dict(model, options=_state_dict_options())
    save_file({k: v.detach().to("cpu").contiguous() for k, v in state.items()}, str(directory / "transformer.safetensors"))
    return None


def _load_model_part(directory: Path, parts: tuple[str, ...], transformer: torch.nn.Module, load_module) -> None:
    """Load the model part into `transformer`: the adapters of a LoRA checkpoint into a model with adapters, the
    full state dict otherwise. Refuses (CheckpointError naming `model.lora`) a LoRA checkpoint for a model without
    adapters and a full checkpoint for a model with them: neither is a resume of the same run."""
    saved = _read_part(directory, MANIFEST, lambda p: json.loads(p.read_text())).get("lora")
    _check_lora_match(directory, ADAPTER_PART in parts, saved, transformer,
                      part=ADAPTER_PART if ADAPTER_PART in parts else "transformer.safetensors")
    if ADAPTER_PART in parts:
        state = _read_part(directory, ADAPTER_PART, lambda p: load_file(str(p)))
        try:
            load_adapter_state_dict(transformer, state)
        except ValueError as err:
            raise CheckpointError(
                f"checkpoint {directory}: {ADAPTER_PART} does not fit this model ({err}); model.lora must match the "
                f"config the checkpoint was trained with (model.lora: {saved})", directory=directory, part=ADAPTER_PART,
            ) from None
        return
    load_module(transformer, "transformer.safetensors")


def _check_lora_match(directory: Path, lora_checkpoint: bool, saved: Any, transformer: torch.nn.Module, *,
                      part: str) -> None:
    """Refuse (CheckpointError naming `model.lora`) a LoRA checkpoint (`lora_checkpoint`, its manifest's `lora`
    settings `saved`) for a transformer without adapters, and a full checkpoint for one with them: neither is a
    resume of the same run. `part`: the checkpoint's model part, for the error."""
    lora_model = has_lora(transformer)
    if lora_checkpoint and not lora_model:
        raise CheckpointError(
            f"checkpoint {directory} holds LoRA adapters only ({part}, model.lora: {saved}), but this "
            "run has no model.lora: a LoRA checkpoint is not loaded as a full model; set model.lora as the "
            "checkpoint's config.yaml has it to resume it", directory=directory, part=part,
        )
    if lora_model and not lora_checkpoint:
        raise CheckpointError(
            f"checkpoint {directory} holds the full transformer (a run without model.lora), but this run has "
            "model.lora set: a full checkpoint is not resumed as a LoRA run; remove model.lora to resume it, or "
            "train LoRA on its weights as a new run (export them, then model.init: pretrained with "
            "model.pretrained_path: <run>/diffusers, under another name)",
            directory=directory, part=part,
        )


def _drop_unsaved_state(transformer: torch.nn.Module, optimizer: torch.optim.Optimizer, saved: set[str]) -> None:
    """Remove the optimizer state of every parameter of `transformer` whose name is not in `saved` (the names a
    checkpoint's optimizer state holds: parameters that had stepped), so that it starts afresh at its first
    gradient, as it would have in the run that wrote the checkpoint. Names as `get_optimizer_state_dict` gives
    them (activation-checkpoint wrappers' `_checkpoint_wrapped_module.` removed); when a saved name matches none
    of the model's (another naming), nothing is removed."""
    named = {name.replace("_checkpoint_wrapped_module.", ""): param for name, param in transformer.named_parameters()}
    if not saved <= set(named):
        return
    for name, param in named.items():
        if name not in saved:
            optimizer.state.pop(param, None)


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
    ema: torch.nn.Module | None = None,
    grad_scaler: Any = None,
    comm_hook: Any = None,
    optimizer_key: str = "optimizer",
) -> TrainState:
    """Restore transformer, optimizer and lr scheduler (and `ema` / `grad_scaler` when given and saved) in place
    from a local checkpoint folder; return its TrainState. `comm_hook(saved)`, when given, is called with the saved
    `comm_hook.pt` (None when the checkpoint has none): the DDP hook restores its rank's state from it.
    `optimizer_key`: a sharded checkpoint's key of this rank's optimizer state (`start_sharded_checkpoint`).

    The folder is always verified against its manifest first, every part's size and sha256 (~1 s per GB): a
    check on the driver cannot vouch for the bytes a worker reads later (a remote checkpoint is downloaded again
    here, `CheckpointManager.load`). Format 3 loads through `torch.distributed.checkpoint.state_dict`'s
    `set_model_state_dict` / `set_optimizer_state_dict` (optimizer state by parameter name); formats 1 and 2 hold
    the optimizer's own `state_dict()`. A LoRA checkpoint (`ADAPTER_PART`) loads into a transformer with the same
    adapters (`vidray.models.lora.apply_lora` first, on the base weights of the config's model init). Raises
    IncompleteCheckpointError / DamagedCheckpointError naming the folder and file, and CheckpointError when the
    saved transformer does not fit `transformer` (another model config), or when a LoRA checkpoint meets a model
    without adapters or a full one a model with them (naming `model.lora`).
    """
    from torch.distributed.checkpoint.state_dict import set_model_state_dict, set_optimizer_state_dict  # heavy: torch

    directory = Path(directory)
    if is_sharded_checkpoint(directory):  # a DCP folder (scaling.strategy: fsdp): loads into any strategy
        return load_sharded_checkpoint(directory, transformer=transformer, optimizer=optimizer,
                                       lr_scheduler=lr_scheduler, ema=ema, grad_scaler=grad_scaler,
                                       comm_hook=comm_hook, optimizer_key=optimizer_key)
    manifest = verify_checkpoint(directory)
    parts = manifest_parts(manifest)
    train_state = read_train_state(directory)

    def load_module(module: torch.nn.Module, part: str) -> None:
        state = _read_part(directory, part, lambda p: load_file(str(p)))
        try:
            set_model_state_dict(module, state, options=_state_dict_options())
        except (RuntimeError, KeyError, ValueError) as err:
            raise CheckpointError(
                f"checkpoint {directory}: {part} does not fit this model ({' '.join(str(err).split())[:300]}); "
                "model.* must match the config the checkpoint was trained with",
                directory=directory, part=part,
            ) from err

    _load_model_part(directory, parts, transformer, load_module)
    optimizer_state = _read_part(directory, "optimizer.pt",
                                 lambda p: torch.load(p, map_location="cpu", weights_only=True))
    if manifest["format_version"] >= 3:
        try:
            # Not strict: a parameter that never got a gradient (an expert no sample has reached yet, `model.experts`)
            # has no AdamW state. torch then gives it a fresh state at step 1, which would bias its first update;
            # it resumes with none, as in the uninterrupted run (`_drop_unsaved_state`). The model load is strict.
            set_optimizer_state_dict(transformer, optimizer, optimizer_state,
                                     options=dataclasses.replace(_state_dict_options(), strict=False))
            _drop_unsaved_state(transformer, optimizer, set(optimizer_state.get("state", {})))
        except (RuntimeError, KeyError, ValueError) as err:
            raise CheckpointError(
                f"checkpoint {directory}: optimizer.pt does not fit this model's optimizer "
                f"({' '.join(str(err).split())[:300]}); model.* and optim.name must match the checkpoint's config",
                directory=directory, part="optimizer.pt",
            ) from err
    else:
        optimizer.load_state_dict(optimizer_state)
    lr_scheduler.load_state_dict(
        _read_part(directory, "lr_scheduler.pt", lambda p: torch.load(p, weights_only=True))
    )
    if ema is not None and "ema.safetensors" in parts:
        load_module(ema, "ema.safetensors")
    if grad_scaler is not None and "grad_scaler.pt" in parts:
        grad_scaler.load_state_dict(_read_part(directory, "grad_scaler.pt", lambda p: torch.load(p, weights_only=True)))
    if comm_hook is not None:
        comm_hook(_read_part(directory, "comm_hook.pt", lambda p: torch.load(p, weights_only=True))
                  if "comm_hook.pt" in parts else None)
    return train_state


CHECKPOINT_PREFIX = "checkpoint_"
UPLOAD_ATTEMPTS = 3
"""Tries of a whole checkpoint copy (each S3 request is also retried by the SDK: `vidray.storage`)."""
UPLOAD_BACKOFF_S = 2.0
"""Wait before the second try of a copy, doubled for each further one (seconds)."""
SHARD_WAIT_S = 600.0
"""Rank 0's upload waits at most this long (seconds) for every other rank's files to reach the run folder before it
writes the manifest; then it fails (the checkpoint stays incomplete, the run keeps its previous one)."""
SHARD_POLL_S = 0.2
FAULT_ENV = "VIDRAY_FAULT_KILL_DURING_CHECKPOINT"
"""Fault injection for tests (never set in a real run): `<step>:<part>:<marker file>` makes the process copying
checkpoint `<step>` SIGKILL itself right after copying `<part>`, once: the marker file is created first, and an
existing marker disarms it. Several faults, each with its own marker, are separated by `;`."""


def checkpoint_dir_name(step: int) -> str:
    """The folder name of the checkpoint written after optimizer step `step` (1-based): `checkpoint_000200`."""
    return f"{CHECKPOINT_PREFIX}{step:06d}"


def checkpoint_step(name: str) -> int | None:
    """The step of a checkpoint folder name (`checkpoint_000200` -> 200), or None for any other name."""
    if not name.startswith(CHECKPOINT_PREFIX):
        return None
    digits = name[len(CHECKPOINT_PREFIX):]
    return int(digits) if digits.isdigit() else None


class CheckpointUploadError(CheckpointError):
    """A checkpoint could not be copied to the run folder after `UPLOAD_ATTEMPTS` tries (it is not complete there)."""


class CheckpointManager:
    """The checkpoints of one run folder `<storage.path>/<name>`, local or on object storage (`s3://...`).

    Complete means "has its manifest": the manifest is copied last (`upload`), so a folder without one is an
    unfinished write (a crash or a kill during the copy) and is never taken as the latest. A complete folder whose
    parts do not match the manifest is damaged: `verify` refuses it (it is not silently passed over).

    ```python
    manager = CheckpointManager("runs/tiny-t2v")          # or "s3://bucket/runs/tiny-t2v"
    manager.latest()                                       # 'checkpoint_000200' or None
    state = manager.load("checkpoint_000200", transformer=..., optimizer=..., lr_scheduler=...)  # verified
    with manager.fetch("checkpoint_000200") as folder:     # a local folder (downloaded when remote)
        ...
    ```
    """

    def __init__(self, run_dir: str | Path):
        self.storage = open_storage(run_dir, setting="storage.path")

    @property
    def is_local(self) -> bool:
        return self.storage.is_local

    def location(self, name: str = "") -> str:
        """A checkpoint folder (or the run folder) as a user reads it: a local path or a URI."""
        return self.storage.display(name)

    def names(self) -> list[str]:
        """Every `checkpoint_<step>` folder of the run, complete or not, oldest step first."""
        found = [n for n, is_dir in self.storage.rel_names() if is_dir and checkpoint_step(n) is not None]
        return sorted(found, key=checkpoint_step)

    def is_complete(self, name: str) -> bool:
        """The folder has its manifest (every part was copied before it)."""
        return self.storage.is_file(f"{name}/{MANIFEST}")

    def complete(self) -> list[str]:
        """The complete checkpoints, oldest first."""
        return [n for n in self.names() if self.is_complete(n)]

    def unfinished(self) -> list[str]:
        """Folders without a manifest: writes that did not finish (passed over, overwritten when the step is
        written again)."""
        return [n for n in self.names() if not self.is_complete(n)]

    def latest(self) -> str | None:
        """The newest complete checkpoint's folder name, or None when the run has none."""
        done = self.complete()
        return done[-1] if done else None

    @contextlib.contextmanager
    def fetch(self, name: str, *, parts: tuple[str, ...] | None = None) -> Iterator[Path]:
        """A local folder holding checkpoint `name`: the folder itself on local storage, else a temporary download
        (removed on exit) of every file, or only of `parts` (those present; e.g. the manifest, `train_state.json`
        and `config.yaml` to plan a resume without downloading the weights). Raises IncompleteCheckpointError when
        a remote checkpoint has no manifest."""
        if self.storage.is_local:
            yield Path(self.storage.path(name))
            return
        if not self.is_complete(name):
            raise IncompleteCheckpointError(
                f"checkpoint {self.location(name)} has no {MANIFEST}: it was not finished; use an earlier checkpoint",
                directory=self.location(name), part=MANIFEST,
            )
        with tempfile.TemporaryDirectory(prefix="vidray-ckpt-fetch-") as tmp:
            local = Path(tmp) / name
            local.mkdir()
            if parts is None:  # every key checked to stay in `local` (`download_dir`), manifest last
                folder = dataclasses.replace(self.storage, location=self.location(name), base=self.storage.path(name))
                download_dir(folder, local, marker=MANIFEST)
            else:
                for part in parts:
                    if self.storage.is_file(f"{name}/{part}"):
                        safe_join(local, part, what="checkpoint part").write_bytes(
                            self.storage.read_bytes(f"{name}/{part}"))
            yield local

    def load(self, name: str, **targets: Any) -> TrainState:
        """Load checkpoint `name` into `targets` (`load_checkpoint`'s keyword arguments: transformer, optimizer,
        lr_scheduler, ema, grad_scaler, comm_hook) and return its TrainState: the one path every training load takes
        (`checkpoint.resume_from`, the run folder's latest, Ray Train's restart checkpoint). A remote checkpoint is
        downloaded (`fetch`), then every part's size and sha256 is checked against the manifest before anything is
        loaded. Raises the `load_checkpoint` errors, naming the checkpoint's storage location (not the temp copy)
        and the part."""
        with self.fetch(name) as local, self._errors_name_location(name, local):
            return load_checkpoint(local, **targets)

    def train_state(self, name: str) -> TrainState:
        """The TrainState of checkpoint `name` (its step and data position), reading only its manifest and
        `train_state.json` (a remote checkpoint's weights are not downloaded): what a worker plans its start from
        before the model is built. Not hashed here: `load` checks every part before the weights are used. Raises
        IncompleteCheckpointError / DamagedCheckpointError naming the checkpoint's storage location."""
        with self.fetch(name, parts=(MANIFEST, "train_state.json")) as local, \
                self._errors_name_location(name, local):
            return read_train_state(local)

    @contextlib.contextmanager
    def _errors_name_location(self, name: str, local: Path) -> Iterator[None]:
        """A CheckpointError raised inside names checkpoint `name`'s storage location, not `local`, its temporary
        download (a local checkpoint's errors already name it)."""
        try:
            yield
        except CheckpointError as err:
            if self.is_local:
                raise
            where = self.location(name)
            raise type(err)(str(err).replace(str(local), where), where, err.part) from None

    def verify(self, name: str, *, hashes: bool = True) -> dict[str, Any]:
        """`verify_checkpoint` of checkpoint `name`; returns its manifest. Remote checkpoints are checked without
        downloading the parts when `hashes` is False (sizes from the listing), else fetched and hashed. Errors name
        the storage location."""
        if self.storage.is_local:
            return verify_checkpoint(self.storage.path(name), hashes=hashes)
        where = self.location(name)
        if not hashes:
            with self.fetch(name, parts=(MANIFEST,)) as local:
                manifest = _read_manifest(local)
            prefix = self.storage.path(name).rstrip("/") + "/"  # recursive: a sharded checkpoint's dcp/ files too
            sizes = {i.path[len(prefix):]: i.size for i in self.storage.list(name, recursive=True)
                     if i.type == pafs.FileType.File}
            for part in manifest_parts(manifest):
                if part not in sizes:
                    raise IncompleteCheckpointError(f"checkpoint {where} is missing {part}; use an earlier checkpoint",
                                                    directory=where, part=part)
                recorded = (manifest.get("files") or {}).get(part, {}).get("size_bytes")
                if recorded is not None and sizes[part] != recorded:
                    raise DamagedCheckpointError(
                        f"checkpoint {where}: {part} is {sizes[part]} bytes but {recorded} were written "
                        "(truncated or overwritten)", directory=where, part=part)
            return manifest
        with self.fetch(name) as local:
            try:
                return verify_checkpoint(local, hashes=hashes)
            except CheckpointError as err:
                raise type(err)(str(err).replace(str(local), where), where, err.part) from None

    def upload(self, local_dir: str | Path, name: str, *, fs: pafs.FileSystem | None = None,
               base: str | None = None) -> str:
        """Copy the finished local checkpoint folder `local_dir` to `<run>/<name>`: first remove what an earlier,
        interrupted copy of the same step left there, then copy every file but the manifest, then the manifest,
        then check each part's size at the destination. `fs`/`base`: the destination filesystem and run folder
        path in it (Ray Train's storage context); the manager's own by default. Returns the folder's path in `fs`.

        Each try that fails with OSError is retried after `UPLOAD_BACKOFF_S` (doubling), `UPLOAD_ATTEMPTS` tries in
        all; then raises CheckpointUploadError naming the folder and the last error. Until the manifest is there,
        the folder is not complete, so a failed copy is never mistaken for a checkpoint.
        """
        fs = fs or self.storage.fs
        dest = f"{(base or self.storage.base).rstrip('/')}/{name}"
        local_dir = Path(local_dir)
        files = sorted(p.name for p in local_dir.iterdir() if p.is_file())
        if MANIFEST not in files:
            raise IncompleteCheckpointError(f"{local_dir} has no {MANIFEST}: write it with save_checkpoint first",
                                            directory=local_dir, part=MANIFEST)
        ordered = [f for f in files if f != MANIFEST] + [MANIFEST]
        last_error: Exception | None = None
        for attempt in range(UPLOAD_ATTEMPTS):
            if attempt:
                time.sleep(UPLOAD_BACKOFF_S * 2 ** (attempt - 1))
            try:
                if fs.get_file_info(dest).type != pafs.FileType.NotFound:
                    fs.delete_dir(dest)
                fs.create_dir(dest, recursive=True)
                for part in ordered:
                    pafs.copy_files(str(local_dir / part), f"{dest}/{part}",
                                    source_filesystem=pafs.LocalFileSystem(), destination_filesystem=fs)
                    _maybe_inject_fault(name, part)
                for part in ordered:
                    size = fs.get_file_info(f"{dest}/{part}").size
                    if size != (local_dir / part).stat().st_size:
                        raise OSError(f"{part} is {size} bytes at the destination, {(local_dir / part).stat().st_size} locally")
                return dest
            except OSError as err:
                last_error = err
                print(f"[vidray] copying checkpoint {name} to {dest} failed (try {attempt + 1} of {UPLOAD_ATTEMPTS}): "
                      f"{err}", flush=True)
        raise CheckpointUploadError(
            f"checkpoint {name} could not be copied to {dest} after {UPLOAD_ATTEMPTS} tries ({last_error}); it is not "
            "complete there and the run keeps its previous checkpoint: check storage.path and its credentials",
            directory=dest, part=None,
        )

    def ray_upload_fn(self):
        """A `checkpoint_upload_fn` for `ray.train.report`: copies the reported local checkpoint with `upload` into
        Ray Train's run folder (its storage filesystem and experiment path) and returns the `ray.train.Checkpoint`
        there. Ray registers the checkpoint (and may rotate older ones away) only after this returns."""

        def upload_fn(checkpoint, checkpoint_dir_name: str):
            import ray.train  # heavy: ray

            storage = ray.train.get_context().get_storage()
            dest = self.upload(checkpoint.path, checkpoint_dir_name, fs=storage.storage_filesystem,
                               base=storage.experiment_fs_path)
            return ray.train.Checkpoint(dest, filesystem=storage.storage_filesystem)

        return upload_fn

    def upload_shard(self, local_dir: str | Path, name: str, *, fs: pafs.FileSystem | None = None,
                     base: str | None = None, wait_s: float = SHARD_WAIT_S) -> str:
        """Copy one rank's files of a sharded checkpoint into `<run>/<name>`; the rank holding the manifest (rank 0)
        writes it last, once every rank's files are there (`_upload_shard`). Returns the folder's path in `fs`."""
        return _upload_shard(self, local_dir, name, fs=fs or self.storage.fs, base=base or self.storage.base,
                             wait_s=wait_s)

    def clear_for_sharded_write(self, name: str) -> None:
        """Rank 0, before a sharded checkpoint's upload: remove an interrupted earlier write of `name` from Ray
        Train's run folder (every rank then waits at a barrier before copying)."""
        fs, base = _ray_storage()
        _clear_for_sharded_write(name, fs=fs, base=base)

    def ray_shard_upload_fn(self):
        """A `checkpoint_upload_fn` for `ray.train.report` of a sharded checkpoint: EVERY rank reports its own local
        folder with the same `checkpoint_dir_name` and this function; each copies its files with `upload_shard`
        into Ray Train's run folder, rank 0's writes the manifest last, after every rank's files are there. Ray
        Train 2.60 registers the checkpoint once every rank's report (each after its own upload) has arrived (its
        report handler waits for all ranks and keeps the first one's checkpoint: they name the same folder)."""
        return _ray_shard_upload_fn(self)


def _maybe_inject_fault(name: str, part: str) -> None:
    spec = os.environ.get(FAULT_ENV)
    if not spec:
        return
    for fault in filter(None, spec.split(";")):
        step, fault_part, marker = fault.split(":", 2)
        if checkpoint_step(name) == int(step) and part == fault_part and not Path(marker).exists():
            Path(marker).write_text(f"killed pid {os.getpid()} after copying {part} of {name}\n")
            os.kill(os.getpid(), signal.SIGKILL)


# Sharded checkpoints (scaling.strategy: fsdp | hsdp) ---------------------------------------------------------------

SHARDED_LAYOUT = "dcp"
"""`manifest.json`'s `layout` of a sharded checkpoint (absent in full ones)."""
DCP_DIR = "dcp"
"""The part folder holding the `torch.distributed.checkpoint` files: `.metadata` (written by rank 0) and
`__<rank>_0.distcp` (each rank's shards of the model and optimizer state)."""


def _local_files(directory: Path) -> list[str]:
    """Every file under `directory` as a POSIX path relative to it, sorted (subfolders included)."""
    return sorted(p.relative_to(directory).as_posix() for p in directory.rglob("*") if p.is_file())


class PendingShardedCheckpoint:
    """One rank's part of a sharded checkpoint, its DCP files being written (`start_sharded_checkpoint`).

    `finish()` is a collective (every rank calls it at the same point of the loop): it waits for this rank's write
    and the sha256 of its files, gathers every rank's sizes and hashes to rank 0, which writes `manifest.json`
    into its folder, and returns the folder (what the rank reports to Ray Train)."""

    def __init__(self, directory: Path, records: Future, *, step: int, rank: int, world_size: int,
                 manifest_extra: dict[str, Any] | None = None) -> None:
        self.directory = directory
        self.step = step
        self._records = records
        self._rank = rank
        self._world_size = world_size
        self._manifest_extra = manifest_extra or {}

    def done(self) -> bool:
        """True when this rank's files are written and hashed (`finish` then waits only for the other ranks)."""
        return self._records.done()

    def finish(self) -> Path:
        """Wait for the write, gather the file records, write the manifest on rank 0. Returns the folder. Raises
        the write's error (OSError, a DCP error) on the rank whose write failed, CheckpointError when two ranks
        wrote the same file."""
        everyone = gather_to_rank0(self._records.result(), self._rank, self._world_size)
        if self._rank == 0:
            files: dict[str, Any] = {}
            for r, part in enumerate(everyone):
                clash = sorted(set(files) & set(part))
                if clash:
                    raise CheckpointError(f"sharded checkpoint: rank {r} wrote {clash[0]}, which another rank wrote "
                                          "too", directory=self.directory, part=clash[0])
                files.update(part)
            manifest = {"format_version": FORMAT_VERSION, "layout": SHARDED_LAYOUT, "parts": sorted(files),
                        "files": files, "step": self.step, "world_size": self._world_size, **self._manifest_extra}
            (self.directory / MANIFEST).write_text(json.dumps(manifest, indent=2))
        return self.directory


def start_sharded_checkpoint(
    directory: str | Path,
    *,
    model: torch.nn.Module,
    optimizer: torch.optim.Optimizer,
    lr_scheduler: Any,
    train_state: TrainState,
    job_config: dict[str, Any],
    rank: int,
    world_size: int,
    dataset: Any = None,
    ema: torch.nn.Module | None = None,
    grad_scaler: Any = None,
    process_group: Any = None,
    executor: ThreadPoolExecutor | None = None,
    optimizer_key: str = "optimizer",
) -> PendingShardedCheckpoint:
    """Start writing this rank's part of a sharded checkpoint into its own local folder `directory`; a collective:
    every rank calls it (each with its own folder, on any node), then `finish()` on the result.

    Every rank writes `dcp/__<rank>_0.distcp` with `torch.distributed.checkpoint` of {"model":
    get_model_state_dict(model), "optimizer": get_optimizer_state_dict(model, optimizer)}: the sharded (DTensor)
    state, so no rank ever holds the full model; rank 0 also writes `dcp/.metadata` and, at once, the small parts
    (`lr_scheduler.pt`, `train_state.json`, `config.yaml`, `DATASET_ROWS`, and `grad_scaler.pt` with
    `grad_scaler`: fp16's scaler, whose state is the same on every rank).

    A model with LoRA adapters saves only its trainable parameters (the adapters; `StateDictOptions(
    ignore_frozen_params=True)`: megabytes of a 14 B model) and its manifest records their settings under `lora`,
    as a full LoRA checkpoint's does. `ema` (the EMA's `AveragedModel`, sharded like the weights) is saved in the
    same DCP folder under `ema.`; the manifest then says `"ema": true`.

    `optimizer_key`: the DCP key of this rank's optimizer state. Ranks that train different modules under
    different names (`model.experts` layout groups: `vidray.train.expert_groups`) each save and load theirs under
    a key of its own, since DCP keeps one copy of a key that several ranks hold (their `param_groups` differ);
    their model states, named apart, share the "model" key.

    With `process_group` (a gloo group of every rank, used only for checkpoints) and `executor`, the write is
    asynchronous: `dcp.async_save` copies the state to CPU memory before it returns (the only time the step waits:
    the training step may change the weights at once), then writes it in a thread, DCP's collectives going over
    `process_group` (never the training's group, whose collectives run meanwhile: as torchtitan's async
    checkpointing does); the executor then hashes this rank's files. Without both, `dcp.save` writes at once.

    Source: torch docs, "Distributed Checkpoint - torch.distributed.checkpoint" (save, async_save, FileSystemWriter).
    """
    import torch.distributed.checkpoint as dcp  # heavy: torch

    directory = Path(directory)
    (directory / DCP_DIR).mkdir(parents=True, exist_ok=True)
    state = _sharded_state(model, optimizer, ema, optimizer_key=optimizer_key)
    extra: dict[str, Any] = {}
    if has_lora(model):
        extra["lora"] = lora_settings(model)
    if ema is not None:
        extra["ema"] = True
    writer = dcp.FileSystemWriter(str(directory / DCP_DIR))
    asynchronous = process_group is not None and executor is not None
    written = dcp.async_save(state, storage_writer=writer, process_group=process_group) if asynchronous else None
    if not asynchronous:
        dcp.save(state, storage_writer=writer)
    if rank == 0:
        _save_run_parts(directory, lr_scheduler=lr_scheduler, train_state=train_state, job_config=job_config,
                        dataset=dataset)
        if grad_scaler is not None:
            torch.save(grad_scaler.state_dict(), directory / "grad_scaler.pt")

    def records() -> dict[str, Any]:
        if written is not None:
            written.result()
        return _file_records(directory, [rel for rel in _local_files(directory) if rel not in (DATASET_ROWS, MANIFEST)])

    if asynchronous:
        future = executor.submit(records)
    else:
        future = Future()
        future.set_result(records())
    return PendingShardedCheckpoint(directory, future, step=train_state.step, rank=rank, world_size=world_size,
                                    manifest_extra=extra)


def _sharded_state(model: torch.nn.Module, optimizer: torch.optim.Optimizer,
                   ema: torch.nn.Module | None, *, optimizer_key: str = "optimizer") -> dict[str, Any]:
    """The state a sharded checkpoint saves and loads, this rank's part of it: {"model", `optimizer_key`[, "ema"]}
    (`get_model_state_dict` / `get_optimizer_state_dict`: DTensor shards under FSDP, full tensors otherwise). A
    model with LoRA adapters gives its trainable parameters only (the base is what the config's model init gives)."""
    from torch.distributed.checkpoint.state_dict import (  # heavy: torch
        StateDictOptions,
        get_model_state_dict,
        get_optimizer_state_dict,
    )

    options = StateDictOptions(ignore_frozen_params=has_lora(model))
    state = {"model": get_model_state_dict(model, options=options),
             optimizer_key: get_optimizer_state_dict(model, optimizer, options=options)}
    if ema is not None:
        state["ema"] = get_model_state_dict(ema)
    return state


def save_sharded_checkpoint(
    directory: str | Path,
    *,
    model: torch.nn.Module,
    optimizer: torch.optim.Optimizer,
    lr_scheduler: Any,
    train_state: TrainState,
    job_config: dict[str, Any],
    rank: int,
    world_size: int,
    dataset: Any = None,
    ema: torch.nn.Module | None = None,
    grad_scaler: Any = None,
    optimizer_key: str = "optimizer",
) -> Path:
    """Write this rank's part of a sharded checkpoint into its own local folder `directory` at once and finish it
    (`start_sharded_checkpoint` without a process group, then `PendingShardedCheckpoint.finish`); a collective.
    Rank 0's folder then holds `manifest.json` listing every rank's files (sizes and sha256s); rank 0's copy
    (`CheckpointManager.upload_shard`) puts the manifest into the run folder only after every listed file is
    there: the checkpoint is complete or absent, as a full one. `optimizer_key`: as `start_sharded_checkpoint`.
    Returns the folder."""
    return start_sharded_checkpoint(
        directory, model=model, optimizer=optimizer, lr_scheduler=lr_scheduler, train_state=train_state,
        job_config=job_config, rank=rank, world_size=world_size, dataset=dataset, ema=ema, grad_scaler=grad_scaler,
        optimizer_key=optimizer_key,
    ).finish()


def load_sharded_checkpoint(
    directory: str | Path,
    *,
    transformer: torch.nn.Module,
    optimizer: torch.optim.Optimizer,
    lr_scheduler: Any,
    ema: torch.nn.Module | None = None,
    grad_scaler: Any = None,
    comm_hook: Any = None,
    optimizer_key: str = "optimizer",
) -> TrainState:
    """Restore a sharded checkpoint (`layout: dcp`) in place; return its TrainState. Every rank calls it (a
    collective when the model is sharded), reading the same folder.

    The folder is verified against its manifest first (every file of every rank: size and sha256), then read
    without unpickling anything from storage (`vidray.models.dcp_reader`: a restricted unpickler for `.metadata`,
    `weights_only=True` for every entry). Then `torch.distributed.checkpoint.load` fills this run's own state dicts (`get_model_state_dict` /
    `get_optimizer_state_dict` of `transformer`), which DCP reshards: the checkpoint loads on any worker count and
    strategy, into an FSDP model (its shards) or a plain/DDP one (full tensors); then `set_model_state_dict` /
    `set_optimizer_state_dict` (only the adapters, for a LoRA checkpoint into a model with the same adapters:
    its base is what the config's model init gave). `ema` (an `AveragedModel`, sharded or not) is restored when the
    checkpoint holds one (manifest `"ema": true`), else left as it is; `grad_scaler` from `grad_scaler.pt` when
    saved. `comm_hook(None)` is called when given (no DDP hook state). `optimizer_key`: as `start_sharded_checkpoint`
    saved it. Raises IncompleteCheckpointError /
    DamagedCheckpointError naming the file, CheckpointError when the saved tensors do not fit this model, or when
    a LoRA checkpoint meets a model without adapters or a full one a model with them (naming `model.lora`).
    """
    import torch.distributed.checkpoint as dcp  # heavy: torch
    from torch.distributed.checkpoint.state_dict import (  # heavy: torch
        StateDictOptions,
        set_model_state_dict,
        set_optimizer_state_dict,
    )

    from vidray.models.dcp_reader import SafeFileSystemReader, dcp_errors, read_dcp_metadata  # heavy: torch

    directory = Path(directory)
    manifest = verify_checkpoint(directory)
    train_state = read_train_state(directory)
    _check_lora_match(directory, "lora" in manifest, manifest.get("lora"), transformer, part=DCP_DIR)
    with_ema = ema is not None and bool(manifest.get("ema"))
    state = _sharded_state(transformer, optimizer, ema if with_ema else None, optimizer_key=optimizer_key)
    options = StateDictOptions(strict=not manifest.get("lora"))  # LoRA: the adapters only
    read_dcp_metadata(directory / DCP_DIR / ".metadata")  # restricted unpickler: a hostile file is refused unread
    reader = SafeFileSystemReader(str(directory / DCP_DIR))
    try:
        with warnings.catch_warnings(), dcp_errors(reader):  # one process without a process group loads it too
            warnings.filterwarnings("ignore", message=r"torch.distributed is .*uninitialized")
            dcp.load(state, storage_reader=reader)
        set_model_state_dict(transformer, state["model"], options=options)
        set_optimizer_state_dict(transformer, optimizer, state[optimizer_key], options=options)
        if with_ema:
            set_model_state_dict(ema, state["ema"])
    except CheckpointError:
        raise  # refused by the safe reader (dcp_errors): already names the file
    except (RuntimeError, KeyError, ValueError) as err:
        raise CheckpointError(
            f"checkpoint {directory}: {DCP_DIR}/ does not fit this model and optimizer "
            f"({' '.join(str(err).split())[:300]}); model.* and optim.name must match the checkpoint's config",
            directory=directory, part=DCP_DIR,
        ) from err
    lr_scheduler.load_state_dict(_read_part(directory, "lr_scheduler.pt", lambda p: torch.load(p, weights_only=True)))
    if grad_scaler is not None and "grad_scaler.pt" in manifest["files"]:
        grad_scaler.load_state_dict(_read_part(directory, "grad_scaler.pt", lambda p: torch.load(p, weights_only=True)))
    if comm_hook is not None:
        comm_hook(None)
    return train_state


def is_sharded_checkpoint(directory: str | Path) -> bool:
    """True when the local checkpoint folder's manifest says `layout: dcp`. Raises as `_read_manifest`."""
    return _read_manifest(Path(directory)).get("layout") == SHARDED_LAYOUT


def _upload_shard(manager: "CheckpointManager", local_dir: str | Path, name: str, *, fs: pafs.FileSystem,
                  base: str, wait_s: float = SHARD_WAIT_S) -> str:
    """`CheckpointManager.upload_shard`'s body: copy this rank's files of sharded checkpoint `name` from `local_dir`
    to `<base>/<name>` (subfolders kept; the folder is not cleared: other ranks copy into it too, and
    `clear_for_sharded_write` cleared it before anyone started). The rank whose folder holds the manifest (rank 0)
    then waits until every file the manifest lists is at the destination with its recorded size (at most `wait_s`
    seconds), and copies the manifest last. Retried like `upload`; raises CheckpointUploadError."""
    dest = f"{base.rstrip('/')}/{name}"
    local_dir = Path(local_dir)
    ordered = [f for f in _local_files(local_dir) if f != MANIFEST]
    manifest = json.loads((local_dir / MANIFEST).read_text()) if (local_dir / MANIFEST).is_file() else None
    last_error: Exception | None = None
    for attempt in range(UPLOAD_ATTEMPTS):
        if attempt:
            time.sleep(UPLOAD_BACKOFF_S * 2 ** (attempt - 1))
        try:
            fs.create_dir(dest, recursive=True)
            for rel in ordered:
                if "/" in rel:
                    fs.create_dir(f"{dest}/{rel.rsplit('/', 1)[0]}", recursive=True)
                pafs.copy_files(str(local_dir / rel), f"{dest}/{rel}",
                                source_filesystem=pafs.LocalFileSystem(), destination_filesystem=fs)
                _maybe_inject_fault(name, rel)
                size = fs.get_file_info(f"{dest}/{rel}").size
                if size != (local_dir / rel).stat().st_size:
                    raise OSError(f"{rel} is {size} bytes at the destination, {(local_dir / rel).stat().st_size} locally")
            if manifest is not None:
                deadline = time.monotonic() + wait_s
                while True:
                    missing = [rel for rel, rec in manifest["files"].items()
                               if fs.get_file_info(f"{dest}/{rel}").size != rec["size_bytes"]]
                    if not missing:
                        break
                    if time.monotonic() > deadline:
                        raise CheckpointUploadError(
                            f"checkpoint {name}: {len(missing)} file(s) of other ranks (e.g. {missing[0]}) did not "
                            f"reach {dest} within {wait_s:.0f} s; the checkpoint is not complete there",
                            directory=dest, part=missing[0])
                    time.sleep(SHARD_POLL_S)
                pafs.copy_files(str(local_dir / MANIFEST), f"{dest}/{MANIFEST}",
                                source_filesystem=pafs.LocalFileSystem(), destination_filesystem=fs)
            return dest
        except OSError as err:
            last_error = err
            print(f"[vidray] copying checkpoint {name} to {dest} failed (try {attempt + 1} of {UPLOAD_ATTEMPTS}): "
                  f"{err}", flush=True)
    raise CheckpointUploadError(
        f"checkpoint {name} could not be copied to {dest} after {UPLOAD_ATTEMPTS} tries ({last_error}); it is not "
        "complete there and the run keeps its previous checkpoint: check storage.path and its credentials",
        directory=dest, part=None,
    )


def _clear_for_sharded_write(name: str, *, fs: pafs.FileSystem, base: str) -> None:
    """Remove what an interrupted write of checkpoint `name` left at `<base>/<name>` (rank 0, before every rank
    starts copying its files: the caller puts a barrier after it)."""
    dest = f"{base.rstrip('/')}/{name}"
    if fs.get_file_info(dest).type != pafs.FileType.NotFound:
        fs.delete_dir(dest)


def _ray_storage() -> tuple[pafs.FileSystem, str]:
    import ray.train  # heavy: ray

    storage = ray.train.get_context().get_storage()
    return storage.storage_filesystem, storage.experiment_fs_path


def _ray_shard_upload_fn(manager: "CheckpointManager"):
    """See `CheckpointManager.ray_shard_upload_fn`."""

    def upload_fn(checkpoint, checkpoint_dir_name: str):
        import ray.train  # heavy: ray

        fs, base = _ray_storage()
        dest = manager.upload_shard(checkpoint.path, checkpoint_dir_name, fs=fs, base=base)
        return ray.train.Checkpoint(dest, filesystem=fs)

    return upload_fn
