"""Where a rank's training runs: the small context a `vidray.train.loop.Worker` asks instead of Ray Train.

torchtitan's `Trainer` is the model: the loop is an object built from a typed config; what the world around it
provides (rank, world size, device, the node, how a report and a checkpoint leave the rank, the data loader and the
validator) comes through one object, so the same loop runs

- under Ray Train (`RayTrainContext`, what `train_loop_per_worker` builds): ranks, device and node from
  `ray.train.get_context()`; reports go to `ray.train.report`, whose controller copies each checkpoint into the run
  folder with vidray's upload function, registers it and rotates older ones; the loader streams through Ray Data;
  validation runs in its own actor;
- in this process (`LocalContext`, what `vidray.train.local.train_in_process` and the unit tests build): one rank,
  or N ranks of a gloo group started by the caller; a checkpoint is copied into the run folder at once by the same
  `CheckpointManager.upload` (manifest last) and rotated to `checkpoint.num_to_keep` here; the loader runs the same
  decode and encode operators in this process (`vidray.data.pipeline.LocalLoader`); validation samples
  in this process between steps.

Nothing else in the loop knows which one it has.
"""

from __future__ import annotations

import shutil
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from vidray.train.validation import LocalValidations, RayValidations


class WorkerContext:
    """What `Worker` needs from where it runs (module docstring). Subclasses set `rank`, `world_size`,
    `local_world_size` (ranks on this node) and `device`, and implement the methods below."""

    rank: int
    world_size: int
    local_world_size: int
    device: torch.device
    exports_ray_metrics: bool = False
    """Whether the rank's metrics can also go through Ray's metrics agent (`train.ray_metrics`)."""
    _manager: Any = None

    def bind(self, manager: Any) -> None:
        """The run's `CheckpointManager`: what `report` hands each checkpoint to (under Ray Train, through the
        upload functions its controller calls)."""
        self._manager = manager

    def node(self) -> dict[str, Any]:
        """{"node_id", "labels"} of the node this rank runs on ({"node_id": "local", "labels": {}} in-process)."""
        raise NotImplementedError

    def restart_checkpoint(self) -> str | None:
        """The folder name of the latest checkpoint registered during this run's current attempt (a restart after
        a worker failure continues from it), or None."""
        raise NotImplementedError

    def report(self, metrics: dict[str, Any], *, checkpoint: str | Path | None = None, name: str | None = None,
               sharded: bool = False) -> None:
        """Report `metrics` (every rank, the same number of times: a barrier under Ray Train) and, with
        `checkpoint` (a finished local folder, `vidray.train.checkpoint.save_checkpoint` or one rank's part of a
        sharded one) and its folder `name`, hand it to the run folder: copied with the manifest last, then the
        local folder deleted. `sharded`: every rank reports its own part (`CheckpointManager.upload_shard`)."""
        raise NotImplementedError

    def clear_for_sharded_write(self, manager: Any, name: str) -> None:
        """Rank 0, before a sharded checkpoint's upload: remove an interrupted earlier write of `name`."""
        raise NotImplementedError

    def loader(self, *args: Any, **kwargs: Any) -> Any:
        """This rank's iterator of `TrainBatch`es: `RankLoader`'s arguments (`vidray.data.pipeline`)."""
        raise NotImplementedError

    def start_validator(self, run_dir: str, job: Any) -> Any:
        """A validation runner (`vidray.train.validation`) with `submit(step)` and `wait()`."""
        raise NotImplementedError


class RayTrainContext(WorkerContext):
    """A Ray Train worker's context (module docstring). `upload_async`: `checkpoint.upload: async`, the copy to
    the run folder runs beside the next steps (Ray Train's `CheckpointUploadMode.ASYNC`)."""

    exports_ray_metrics = True

    def __init__(self, *, upload_async: bool = False):
        import ray.train  # heavy: ray
        import ray.train.torch  # heavy: ray

        context = ray.train.get_context()
        self.rank, self.world_size = context.get_world_rank(), context.get_world_size()
        self.local_world_size = context.get_local_world_size()
        self.device = ray.train.torch.get_device()
        self.upload_mode = (ray.train.CheckpointUploadMode.ASYNC if upload_async
                            else ray.train.CheckpointUploadMode.SYNC)

    def node(self) -> dict[str, Any]:
        import ray  # heavy: ray

        runtime = ray.get_runtime_context()
        return {"node_id": runtime.get_node_id(), "labels": runtime.get_node_labels()}

    def restart_checkpoint(self) -> str | None:
        import ray.train  # heavy: ray

        checkpoint = ray.train.get_checkpoint()
        return None if checkpoint is None else Path(checkpoint.path).name

    def report(self, metrics: dict[str, Any], *, checkpoint: str | Path | None = None, name: str | None = None,
               sharded: bool = False) -> None:
        import ray.train  # heavy: ray

        if checkpoint is None and name is None:
            # Asynchronous mode for plain reports too: a synchronous report would wait for the copy in flight.
            ray.train.report(metrics, checkpoint_upload_mode=self.upload_mode)
            return
        upload_fn = self._manager.ray_shard_upload_fn() if sharded else self._manager.ray_upload_fn()
        ray.train.report(metrics, checkpoint=None if checkpoint is None else ray.train.Checkpoint.from_directory(
            str(checkpoint)), checkpoint_dir_name=name, checkpoint_upload_mode=self.upload_mode,
            delete_local_checkpoint_after_upload=True, checkpoint_upload_fn=upload_fn)

    def clear_for_sharded_write(self, manager: Any, name: str) -> None:
        manager.clear_for_sharded_write(name)

    def loader(self, *args: Any, **kwargs: Any) -> Any:
        from vidray.data.pipeline import RankLoader  # heavy: pyarrow

        return RankLoader(*args, **kwargs)

    def start_validator(self, run_dir: str, job: Any) -> Any:
        return RayValidations(run_dir, job)


@dataclass
class LocalContext(WorkerContext):
    """A rank run in this process (module docstring). `rank`/`world_size`: this rank of a gloo group the caller
    has initialised (`torch.distributed`), or 0/1 (the Worker then needs no group; `vidray.train.local` makes a
    one-rank group for DDP). `num_to_keep`: `checkpoint.num_to_keep`, applied after each checkpoint as Ray Train's
    rotation does. `reports`: every report's metrics, in order (with "checkpoint": its folder name when one was
    handed over); `registered`: the checkpoints written and kept, oldest first."""

    rank: int = 0
    world_size: int = 1
    device: torch.device = field(default_factory=lambda: torch.device("cpu"))
    num_to_keep: int | None = None
    reports: list[dict[str, Any]] = field(default_factory=list)
    registered: list[str] = field(default_factory=list)

    def __post_init__(self) -> None:
        self.local_world_size = self.world_size

    def node(self) -> dict[str, Any]:
        return {"node_id": "local", "labels": {}}

    def restart_checkpoint(self) -> str | None:
        return None  # an in-process run has one attempt: nothing restarts it

    def report(self, metrics: dict[str, Any], *, checkpoint: str | Path | None = None, name: str | None = None,
               sharded: bool = False) -> None:
        if checkpoint is not None:
            if sharded:
                self._manager.upload_shard(checkpoint, name)
            else:
                self._manager.upload(checkpoint, name)
            shutil.rmtree(checkpoint, ignore_errors=True)
        if name is not None and self.rank == 0:
            self.registered.append(name)
            self._rotate()
        self.reports.append({**metrics, **({"checkpoint": name} if name is not None else {})})

    def _rotate(self) -> None:
        """Delete the oldest registered checkpoints beyond `num_to_keep` (rank 0), as Ray Train's rotation does."""
        if self.num_to_keep is None:
            return
        while len(self.registered) > self.num_to_keep:
            self._manager.storage.delete_dir(self.registered.pop(0))

    def clear_for_sharded_write(self, manager: Any, name: str) -> None:
        from vidray.train.checkpoint import _clear_for_sharded_write  # heavy: pyarrow, safetensors

        _clear_for_sharded_write(name, fs=manager.storage.fs, base=manager.storage.base)

    def loader(self, *args: Any, **kwargs: Any) -> Any:
        from vidray.data.pipeline import LocalLoader  # heavy: pyarrow

        return LocalLoader(*args, **kwargs)

    def start_validator(self, run_dir: str, job: Any) -> Any:
        return LocalValidations(run_dir, job)
