"""Where a training run starts, decided on the driver before Ray reserves anything, and what the run folder's
checkpoints become around a run: the checkpoint layer's resume planning and rotation (`vidray.train.checkpoint`
names, writes, verifies and loads checkpoints; this module chooses among them).

Which checkpoint a run starts from (the precedence, decided here and passed to the workers):
1. `checkpoint.resume_from`, when set, wins over the run's own checkpoints. Checkpoints of the run folder newer
   than it (e.g. a damaged latest one) are moved to `<run>/set_aside/<time>/` with Ray Train's checkpoint list,
   so that they are neither loaded, nor overwritten, nor counted by `checkpoint.num_to_keep`. Exception: when the
   run's latest checkpoint is good and was itself trained from that same `resume_from` (the same command run
   again), the run continues from its latest checkpoint instead of rewinding.
2. Otherwise the run's latest complete checkpoint (`checkpoint_<step>` with its manifest), verified against its
   manifest; a damaged one is refused, naming the last good checkpoint and the override that resumes from it.
   (A damaged checkpoint the user deleted instead is simply gone: the newest remaining one is the latest.)
3. Otherwise the run starts at step 1.
Ray Train's own checkpoint list (`checkpoint_manager_snapshot.json`) is moved aside with them whenever it names a
folder that is gone or another latest checkpoint: Ray would otherwise refuse the run folder, or rotate away the
wrong checkpoints. Ray's rotation then knows only this `fit()`'s checkpoints, so `checkpoint.num_to_keep` is applied to
the run folder's other complete checkpoints when the run ends (`apply_num_to_keep`).
Inside the workers, a restart after a worker or node failure loads the newest checkpoint written during this `fit()`
(a step after the chosen one's; none newer is left in the folder once the above is applied): Ray Train's
`get_checkpoint()`, or the run folder's latest complete checkpoint when that is newer (a node lost after the copy
finished but before Ray registered it; `vidray.train.loop._resume_state`). A checkpoint that existed before is
loaded only when it is the one chosen above.
"""

from __future__ import annotations

import contextlib
import json
import shutil
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from vidray.config import ConfigError, JobConfig, ResumeDiff, diff_for_resume, job_config_from_dict
from vidray.errors import UserFileNotFound
from vidray.locations import absolute_location

__all__ = ["RAY_SNAPSHOT", "ResumePlan", "apply_num_to_keep", "check_resume", "interrupted_note", "plan_files",
           "plan_resume", "set_aside"]


RAY_SNAPSHOT = "checkpoint_manager_snapshot.json"
"""Ray Train V2's list of a run's reported checkpoints, in the run folder."""


@dataclass
class ResumePlan:
    """Where a run starts, as decided on the driver by `check_job_inputs`.

    checkpoint: the verified checkpoint folder to load (a Path, or a URI string on object storage), or None
    (start at step 1). step: its step (0 if none). explicit: it came from `checkpoint.resume_from`. set_aside: names
    of the run folder's checkpoints newer than it, to move aside before Ray starts. reset_ray_snapshot: move Ray
    Train's checkpoint list aside too (the run no longer continues from its own latest checkpoint);
    ray_snapshot_reason: why, when the list disagrees with the run folder. diff: config
    changes from the checkpoint's saved config. manager: the run folder's `CheckpointManager`.
    """

    checkpoint: Path | str | None = None
    step: int = 0
    explicit: bool = False
    set_aside: list[str] = field(default_factory=list)
    reset_ray_snapshot: bool = False
    ray_snapshot_reason: str = ""
    diff: ResumeDiff | None = None
    manager: Any = None


def _last_good_checkpoint(manager: Any, below: str) -> str | None:
    """The newest complete checkpoint older than `below` that passes verification, or None."""
    from vidray.train.checkpoint import CheckpointError, checkpoint_step  # heavy: torch, pyarrow, safetensors

    for candidate in reversed(manager.complete()):
        if checkpoint_step(candidate) >= checkpoint_step(below):
            continue
        try:
            manager.verify(candidate)
            return candidate
        except CheckpointError:
            continue
    return None


def _ray_snapshot_disagrees(manager: Any, chosen: str | None) -> str:
    """Why Ray Train's checkpoint list of the run cannot be kept, or "" when it can: it names a folder that is gone
    (e.g. a damaged checkpoint the user deleted: Ray would refuse the whole run folder), or a latest checkpoint other
    than `chosen` (e.g. a run stopped after `chosen`'s copy, before Ray registered it), or it cannot be read."""
    storage = manager.storage
    if not storage.is_file(RAY_SNAPSHOT):
        return ""
    try:
        snapshot = json.loads(storage.read_bytes(RAY_SNAPSHOT))
        listed = [r["checkpoint_dir_name"] for r in snapshot.get("checkpoint_results", [])]
        latest = (snapshot.get("latest_checkpoint_result") or {}).get("checkpoint_dir_name")
    except (OSError, ValueError, KeyError, TypeError, AttributeError):
        return "it cannot be read"  # Ray could not use it either
    gone = [name for name in listed if not storage.is_dir(name)]
    if gone:
        return f"it names {', '.join(gone)}, which {'is' if len(gone) == 1 else 'are'} gone"
    if latest is not None and latest != chosen:
        if chosen is None:
            return f"it names {latest} as the latest checkpoint, and the run starts at step 1"
        return (f"it names {latest} as the latest checkpoint, not {chosen} (a run stopped after {chosen}'s copy, "
                "before Ray registered it)")
    return ""


def _started_from(manager: Any, name: str, start: str) -> bool:
    """True when checkpoint `name` was written by a run whose `checkpoint.resume_from` was `start`."""
    from vidray.train.checkpoint import CheckpointError, read_job_config  # heavy: torch, pyarrow, safetensors

    try:
        with manager.fetch(name, parts=_PLAN_PARTS) as local:
            saved = (read_job_config(local).get("checkpoint") or {}).get("resume_from")
    except (CheckpointError, AttributeError):
        return False
    return bool(saved) and absolute_location(saved) == start


def _check_resume_mode(job: JobConfig, where: str, existing: list[str], latest: str | None) -> None:
    """Refuse what `checkpoint.resume` forbids (see `vidray.config.CheckpointConfig.resume`). Raises ConfigError
    naming the run folder, what it holds and the fix."""
    mode = job.checkpoint.resume
    if mode == "never":
        if job.checkpoint.resume_from:
            raise ConfigError(
                f"checkpoint.resume=never contradicts checkpoint.resume_from={job.checkpoint.resume_from}: drop one"
            )
        if existing:
            names = ", ".join(existing[-3:])
            raise ConfigError(
                f"checkpoint.resume=never but the run {where} already holds {len(existing)} checkpoint(s) ({names}): "
                f"nothing was overwritten; start under a new name (name={job.name}-2) or continue it with "
                "checkpoint.resume=auto"
            )
    elif mode == "must" and latest is None and not job.checkpoint.resume_from:
        raise ConfigError(
            f"checkpoint.resume=must but the run {where} has no complete checkpoint to resume "
            f"({'its folders: ' + ', '.join(existing) if existing else 'none written yet'}): check "
            "name and storage.path, or start it with checkpoint.resume=auto"
        )


_PLAN_PARTS = ("manifest.json", "train_state.json", "config.yaml", "dataset_rows.parquet")
"""The small files of a checkpoint the driver reads to plan a resume (remote checkpoints: only these download)."""


def plan_resume(job: JobConfig) -> ResumePlan:
    """Decide and verify the checkpoint `job` starts from (the precedence in the module docstring). The run folder
    may be local or on object storage (`vidray.train.checkpoint.CheckpointManager`).

    Raises UserFileNotFound when `checkpoint.resume_from` is not a checkpoint folder, ConfigError for what
    `checkpoint.resume` forbids, and CheckpointError subclasses (naming the folder and the file) when the chosen
    checkpoint is incomplete or damaged; a damaged latest checkpoint's message names the last good one and the
    `checkpoint.resume_from=` override that resumes from it. Local checkpoints are verified with their sha256;
    remote ones by size here (the workers hash what they download).
    """
    from vidray.train.checkpoint import (  # heavy: torch, pyarrow, safetensors
        CheckpointError,
        CheckpointManager,
        read_train_state,
    )

    manager = CheckpointManager(f"{absolute_location(job.storage.path).rstrip('/')}/{job.name}")
    local = manager.is_local
    existing = manager.names()
    plan = ResumePlan(manager=manager)
    latest = manager.latest()
    _check_resume_mode(job, manager.location(), existing, latest)

    def step_of(name: str) -> int:
        with manager.fetch(name, parts=_PLAN_PARTS) as folder:
            return read_train_state(folder).step

    def choose(name: str) -> None:
        plan.checkpoint = Path(manager.location(name)) if local else manager.location(name)
        plan.step = step_of(name)

    if job.checkpoint.resume_from:
        start = absolute_location(job.checkpoint.resume_from)
        parent, chosen = start.rstrip("/").rsplit("/", 1)
        in_run = parent == manager.location().rstrip("/") if not local else Path(parent) == Path(manager.location())
        if latest is not None and not (in_run and latest == chosen) and _started_from(manager, latest, start):
            try:
                manager.verify(latest, hashes=local)
            except CheckpointError:
                pass  # damaged: rewind to `chosen` below
            else:  # the same command re-run: continue, do not rewind what was trained since
                print(f"[vidray] {manager.location(latest)} was trained from checkpoint.resume_from={start}: "
                      "continuing from it", flush=True)
                choose(latest)
                plan.ray_snapshot_reason = _ray_snapshot_disagrees(manager, latest)
                plan.reset_ray_snapshot = bool(plan.ray_snapshot_reason)
                return plan
        source = CheckpointManager(parent)
        source.storage.check_reachable("checkpoint.resume_from")  # an S3 fault in one line, not a traceback
        if not source.storage.is_dir(chosen):
            raise UserFileNotFound(f"checkpoint.resume_from {start} is not a folder: give a checkpoint_<step> folder")
        source.verify(chosen, hashes=source.is_local)
        plan.checkpoint = Path(start) if source.is_local else start
        plan.explicit = True
        with source.fetch(chosen, parts=_PLAN_PARTS) as folder:
            plan.step = read_train_state(folder).step
        if in_run and chosen == latest:
            plan.ray_snapshot_reason = _ray_snapshot_disagrees(manager, chosen)
            plan.reset_ray_snapshot = bool(plan.ray_snapshot_reason)
        else:
            from vidray.train.checkpoint import checkpoint_step  # heavy: torch, pyarrow, safetensors

            plan.set_aside = [n for n in existing if not (in_run and n == chosen) and checkpoint_step(n) > plan.step]
            plan.reset_ray_snapshot = manager.storage.is_file(RAY_SNAPSHOT)
        return plan
    if latest is None:
        plan.ray_snapshot_reason = _ray_snapshot_disagrees(manager, None)
        plan.reset_ray_snapshot = bool(plan.ray_snapshot_reason)
        return plan
    try:
        manager.verify(latest, hashes=local)
    except CheckpointError as err:
        good = _last_good_checkpoint(manager, latest)
        if good is None:
            raise type(err)(
                f"{err}. The run {manager.location()} has no good checkpoint before it: start afresh under a new name "
                f"(name={job.name}-2)", err.directory, err.part,
            ) from None
        raise type(err)(
            f"{err}. The last good checkpoint is {manager.location(good)}: resume from it with "
            f"checkpoint.resume_from={manager.location(good)} (newer checkpoints of the run are then moved to "
            f"{manager.location('set_aside')})", err.directory, err.part,
        ) from None
    choose(latest)
    plan.ray_snapshot_reason = _ray_snapshot_disagrees(manager, latest)
    plan.reset_ray_snapshot = bool(plan.ray_snapshot_reason)
    return plan


@contextlib.contextmanager
def plan_files(checkpoint: Path | str):
    """A local folder with the checkpoint's small files (`_PLAN_PARTS`): the folder itself when local."""
    from vidray.train.checkpoint import CheckpointManager  # heavy: torch, pyarrow, safetensors

    if isinstance(checkpoint, Path):
        yield checkpoint
        return
    parent, name = checkpoint.rstrip("/").rsplit("/", 1)
    with CheckpointManager(parent).fetch(name, parts=_PLAN_PARTS) as folder:
        yield folder


def check_resume(job: JobConfig, plan: ResumePlan, folder: Path, index: dict[str, Any]) -> ResumePlan:
    """The resume checks of `check_job_inputs` on the chosen checkpoint's files in the local `folder`."""
    from vidray.train.checkpoint import read_job_config, read_train_state  # heavy: torch, pyarrow, safetensors

    resume = plan.checkpoint
    saved = read_job_config(folder)
    plan.diff = diff = diff_for_resume(saved, job)
    if diff.fixed:
        changes = diff.fixed_summary()
        raise ConfigError(
            f"resuming from {resume} changes keys fixed for the run: {changes}. Set them back to the checkpoint's "
            f"values, or start a new run under another name (docs/training.md, 'Resume rules', lists what may change "
            f"on resume)"
        )
    state = read_train_state(folder)
    if state.step >= job.train.max_steps:
        # A train-vae run's train.max_steps is vae_training.max_steps (`vidray.train.vae.vae_training_job`).
        key = "vae_training.max_steps" if job.train.objective == "vae" else "train.max_steps"
        raise ConfigError(
            f"{resume} is already at step {state.step} >= {key} {job.train.max_steps}: raise "
            f"{key} to continue the run, or choose a new name to start afresh"
        )
    from vidray.train.checkpoint import dataset_mismatch  # heavy: torch, pyarrow, safetensors

    problem = dataset_mismatch(state, job.data.shards_dir, index, checkpoint_dir=folder)
    if problem:
        raise ConfigError(f"{resume} {problem}")
    source = "checkpoint.resume_from" if plan.explicit else "the run's latest checkpoint"
    print(f"[vidray] resuming from {resume} ({source}) at step {state.step}; changed from the checkpoint: "
          f"{diff.summary() or 'nothing'}", flush=True)
    if state.consumed_per_bucket is not None:
        workers = job.scaling.describe_workers()  # "1 worker", "2 workers", "2-4 workers (elastic)"
        if job.scaling.elastic or state.world_size != job.scaling.num_workers:
            workers += f" (was {state.world_size})"
        if job.data_parallel_workers < job.scaling.max_workers:  # model.experts layout groups: each expert's half
            workers = f"{_plural(job.data_parallel_workers, 'worker', 'workers')} per expert of {workers}"
        workers += f", {_plural(job.micro_batches_per_step, 'micro-batch', 'micro-batches')} per step"
        print(f"[vidray] data position: epoch {state.epoch}, {state.batch_index} micro-batches of it done; the rest "
              f"of the epoch is dealt to {workers}, each sample exactly once", flush=True)
        saved_g = _saved_micro_batches_per_step(saved)
        if saved_g is not None and saved_g != job.micro_batches_per_step:
            why = ""
            if job.train.micro_batches_per_step is None:
                why = " (train.micro_batches_per_step is null: it follows the max worker count"
                why += f"; set it to {saved_g} to keep the checkpoint's)" if saved_g >= job.data_parallel_workers \
                    else ")"
            print(f"[vidray] global batch: {_plural(job.micro_batches_per_step, 'micro-batch', 'micro-batches')} "
                  f"per step, was {saved_g} in the checkpoint{why}", flush=True)
    else:
        print(f"[vidray] {resume} predates the world-size-independent schedule: the run continues at the start of "
              f"epoch {state.epoch + 1}", flush=True)
    return plan


def _plural(n: int, one: str, many: str) -> str:
    """'1 micro-batch', '2 micro-batches'."""
    return f"{n} {one if n == 1 else many}"


def _saved_micro_batches_per_step(saved: dict[str, Any]) -> int | None:
    """G of a checkpoint's saved job config (`JobConfig.micro_batches_per_step`: train.micro_batches_per_step, else
    the data-parallel workers (each expert's half with `model.experts` layout groups) x grad_accumulation_steps), or
    None when the saved config does not say (older vidray: then train.micro_batches_per_step, else the max of
    scaling.num_workers)."""
    try:
        return job_config_from_dict(saved).micro_batches_per_step
    except Exception:  # noqa: BLE001 - an older config that no longer loads: read the keys themselves
        pass
    given = (saved.get("train") or {}).get("micro_batches_per_step")
    if given is not None:
        return int(given)
    workers = (saved.get("scaling") or {}).get("num_workers")
    if isinstance(workers, int) and not isinstance(workers, bool):
        return workers
    if isinstance(workers, (list, tuple)) and len(workers) == 2:
        return int(workers[1])
    return None


def set_aside(plan: ResumePlan) -> None:
    """Move the plan's `set_aside` checkpoints (and Ray Train's checkpoint list when `reset_ray_snapshot`) into
    `<run>/set_aside/<time>/`, kept but never loaded. On object storage a move is a copy, then a delete."""
    import pyarrow.fs as pafs  # heavy: pyarrow

    if not (plan.set_aside or plan.reset_ray_snapshot):
        return
    storage = plan.manager.storage
    target = f"set_aside/{time.strftime('%Y%m%d-%H%M%S')}"
    storage.fs.create_dir(storage.path(target), recursive=True)
    moved = []
    for name in plan.set_aside:
        if storage.is_local:
            shutil.move(storage.path(name), storage.path(f"{target}/{name}"))
        else:
            pafs.copy_files(storage.path(name), storage.path(f"{target}/{name}"), source_filesystem=storage.fs,
                            destination_filesystem=storage.fs)
            storage.delete_dir(name)
        moved.append(name)
    if plan.reset_ray_snapshot and storage.is_file(RAY_SNAPSHOT):
        storage.write_bytes(f"{target}/{RAY_SNAPSHOT}", storage.read_bytes(RAY_SNAPSHOT))
        storage.delete_file(RAY_SNAPSHOT)
        moved.append(RAY_SNAPSHOT)
    start = f"starting from {plan.checkpoint}" if plan.checkpoint else "starting at step 1"
    if moved == [RAY_SNAPSHOT] and not plan.explicit:  # a plain resume (e.g. after a Ctrl-C) or a fresh start
        print(f"[vidray] {start}; Ray Train's checkpoint list ({RAY_SNAPSHOT}) disagrees with the run folder: "
              f"{plan.ray_snapshot_reason or 'it was set aside'}; it was moved to {storage.display(target)}, and "
              "checkpoint.num_to_keep is applied to the run folder when this run ends", flush=True)
        return
    print(f"[vidray] {start}: moved {', '.join(moved)} to {storage.display(target)} (kept, not loaded)", flush=True)


def apply_num_to_keep(plan: ResumePlan, job: JobConfig, registered: set[str]) -> list[str]:
    """`checkpoint.num_to_keep` over the whole run folder, for the checkpoints Ray Train's rotation does not know.
    After a successful `fit()`, the folder keeps every checkpoint Ray registered (its rotation already kept
    `num_to_keep` of them) and, when Ray registered fewer than `num_to_keep`, the newest other complete checkpoints
    up to that number; every other complete checkpoint older than Ray's newest is deleted. Ray does not know:
    - a checkpoint a restart continued from before Ray registered it (Ray registers one only once every rank's
      report of it reached the controller; `vidray.train.loop._resume_state`);
    - the run's checkpoints from before this `fit()` when Ray's checkpoint list was set aside at the start (a run
      stopped by Ctrl-C between a checkpoint's copy and its registration, then resumed; a `checkpoint.resume_from`
      rewind), which Ray's rotation would otherwise keep forever.
    Checkpoints in `set_aside/` and folders without a manifest are not touched. Nothing is deleted when
    `num_to_keep` is None (keep all) or Ray kept no checkpoint. `registered`: the folder names of Ray's checkpoints
    (`Result.best_checkpoints`). Returns the deleted folder names, oldest first."""
    from vidray.train.checkpoint import checkpoint_step  # heavy: torch, pyarrow, safetensors

    keep_n = job.checkpoint.num_to_keep
    if keep_n is None or not registered:
        return []
    newest = max(checkpoint_step(name) for name in registered)
    others = [name for name in plan.manager.complete() if name not in registered and checkpoint_step(name) < newest]
    room = max(0, keep_n - len(registered))
    stale = others[:max(0, len(others) - room)]  # oldest first: the newest `room` of them stay
    for name in stale:
        plan.manager.storage.delete_dir(name)
    if stale:
        print(f"[vidray] removed {', '.join(stale)} (checkpoint.num_to_keep={keep_n}: they were not in Ray Train's "
              "checkpoint list of this run, so its rotation did not remove them)", flush=True)
    return stale


def interrupted_note(plan: ResumePlan, job: JobConfig, resume_hint: str) -> str:
    """What the driver prints after a Ctrl-C (KeyboardInterrupt) ended `fit()`. A Ctrl-C that lands while a short
    run finishes its last steps may take effect only once the run reached `train.max_steps`: then the run folder's
    latest complete checkpoint already holds the last step, a re-run would be refused ("already at step N"), and
    the note says so instead of `resume_hint`."""
    from vidray.train.checkpoint import CheckpointError, read_train_state  # heavy: torch, pyarrow, safetensors

    manager = plan.manager
    try:
        latest, step = manager.latest(), 0
        if latest:
            with manager.fetch(latest, parts=_PLAN_PARTS) as folder:
                step = read_train_state(folder).step
    except (CheckpointError, OSError, ValueError, KeyError):  # unreadable: say what a stopped run says
        latest, step = None, 0
    if latest and step >= job.train.max_steps:
        return (f"[vidray] interrupted (Ctrl-C) as the run ended: {manager.location(latest)} already holds step "
                f"{step} (train.max_steps={job.train.max_steps}), so there is nothing to resume. If the Ctrl-C cut "
                f"the export of {manager.location('diffusers')} short, `vidray generate --model "
                f"{manager.location(latest)}` samples from the checkpoint itself; to train on, raise train.max_steps")
    return (f"[vidray] interrupted (Ctrl-C): the run stopped; its checkpoints so far are kept in {manager.location()}; "
            f"{resume_hint}")
