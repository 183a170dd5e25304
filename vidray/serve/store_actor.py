"""The job store on the Ray head node: one detached actor owns the sqlite store (`vidray.serve.jobs.JobStore`) under
`store_dir` on the head's disk, and every ingress replica, on any node, reads and writes jobs through it.

Why the head (issue 31 item 4). With the store on the ingress replica's own disk, the store lived and died with
whichever node Serve put the ingress on: on the shipped KubeRay config (a head of 0 CPUs) that is an autoscaled
worker pod, so losing it lost every job record (ids answered 404, queued jobs never ran), and two ingress replicas
on two nodes kept two stores. The head is the node whose loss ends the Ray cluster anyway; Serve's own controller
lives there for the same reason, and this actor is placed as Serve places its controller (num_cpus 0, the head's
``node:__internal_head__`` resource, detached, restarted by Ray if its process dies).

Videos travel as paths, not payloads, where they can (issue 44 part 5). A replica on the head's node (a one-node
cluster, `serve run` on a laptop) writes its mp4 straight into the store's ``tmp/`` and `complete` sends the path
(the store moves it in: no copy), and a download opens ``videos/<id>.mp4`` itself and streams it. A replica on
another node has no view of the head's disk: its mp4 goes to the head as bytes in the `complete` call and comes back
in `open_video` (Ray's object store).

Concurrency. The actor is threaded (`MAX_CONCURRENCY` calls at once): a slow call (a large mp4 going in or out, a
long list) no longer holds every other replica's `get`. Each call opens its own sqlite connection (so each thread
has its own), reads run side by side on WAL snapshots, and writes are serialized by sqlite's write lock (`BEGIN
IMMEDIATE`, `vidray.serve.jobs.JobStore`), so every job operation is still linearizable: a `create` that returned
is seen by every later `get` from any replica, and a job has at most one owner (a claim is atomic). A call
returns only after its transaction committed (WAL), so an answered request survives the loss of any worker node,
and of the actor's process (Ray restarts it on the head and it reopens the same file). Losing the head loses the
cluster; the KubeRay configs keep `store_dir` on a PersistentVolumeClaim
(`cluster_configs/serve-store-pvc.yaml`), so a restarted head's store reopens the same jobs. A call in flight when
the actor's process dies is not retried (it could run twice): it raises `JobStoreUnavailableError`, which the
routes answer with 503 and `Retry-After`, and a runner's lease rule recovers any job it left half-done; a create
retried with its `Idempotency-Key` then answers the job the lost call made, if it was committed.

```python
store = head_job_store("/data/serve", max_attempts=2, retention_s=None)   # needs ray.init() (a Serve replica has it)
job = store.create(model="vidray", prompt="a red fox", size="64x64", seconds="1", params={})
store.get(job.id).status                                                   # "queued", from any node
```
"""

from __future__ import annotations

import functools
import hashlib
import io
import os
import tempfile
from pathlib import Path
from typing import Any, BinaryIO

from vidray.serve.jobs import JobStore, JobStoreUnavailableError, StoreOwnedError, new_temp_mp4, sweep_old_files

__all__ = ["FORWARDED", "HeadJobStore", "JobStoreActor", "JobStoreUnavailableError", "STORE_NAMESPACE",
           "head_job_store"]

STORE_NAMESPACE = "vidray"
"""Ray namespace of the store actors (named ``vidray-job-store-<hash>``; one per store folder)."""

FORWARDED = frozenset({
    "create", "get", "list", "delete", "counts", "claim", "heartbeat", "fail", "release", "requeue",
    "recover_expired", "sweep_expired", "read_input", "video_path", "drop_input",
})
"""`JobStore` methods a `HeadJobStore` forwards to the actor unchanged (arguments and answer as `JobStore`'s)."""

_CALL_TIMEOUT_S = 60.0
_START_TIMEOUT_S = 120.0
MAX_CONCURRENCY = 16
"""Calls the store actor runs at once (threads). An actor started by an older vidray keeps its own setting (one
call at a time) until it is killed (`head_job_store`'s docstring says how)."""


class JobStoreActor:
    """The actor's class: a `JobStore` on this (the head) node's disk, up to `MAX_CONCURRENCY` calls at once (threads).

    Args:
        root, max_attempts, retention_s: as `JobStore`'s. The constructor's errors (a `root` that is a file, a
            newer schema) end the actor; `head_job_store` raises them.
    """

    def __init__(self, root: str, max_attempts: int, retention_s: float | None, app: str | None = None) -> None:
        self.store = JobStore(root, max_attempts=max_attempts, retention_s=retention_s, app=app)

    def configure(self, max_attempts: int, retention_s: float | None, app: str | None = None) -> None:
        """Take the settings of the app that asked last (`head_job_store` calls it each time): one actor per store
        folder, whatever `runner.max_attempts` and `retention.hours` a redeploy gives. Raises ValueError as
        `JobStore` does for bad values, and `StoreOwnedError` (a ValueError) when `app` does not own the
        folder."""
        self.store = JobStore(self.store.root, max_attempts=max_attempts, retention_s=retention_s, app=app)

    def describe(self) -> dict:
        """``{"root", "node_id", "pid"}``: where the store runs (tests check it is the head)."""
        import ray  # heavy: ray

        return {"root": str(self.store.root), "node_id": ray.get_runtime_context().get_node_id(), "pid": os.getpid()}

    def call(self, method: str, args: tuple, kwargs: dict) -> Any:
        """`JobStore.<method>(*args, **kwargs)` for a method in `FORWARDED`. Raises AttributeError for any other."""
        if method not in FORWARDED:
            raise AttributeError(f"JobStoreActor does not forward {method!r}; "
                                 f"forwarded: {', '.join(sorted(FORWARDED))}")
        return getattr(self.store, method)(*args, **kwargs)

    def complete_file(self, job_id: str, owner: str, video_file: str) -> bool:
        """`JobStore.complete` of an mp4 a replica on this node wrote into the store's own ``tmp/`` (moved in, not
        copied). Returns False (the file stays, for the caller to remove) when `owner` no longer holds the job.
        Raises ValueError for a path outside ``tmp/`` (nothing else is moved into the store)."""
        path = Path(video_file)
        if path.parent.resolve() != self.store.tmp_dir.resolve():
            raise ValueError(f"complete_file takes an mp4 in {self.store.tmp_dir}, got {video_file}")
        return self.store.complete(job_id, owner, path)

    def complete(self, job_id: str, owner: str, video: bytes) -> bool:
        """`JobStore.complete` with the mp4's bytes (written to the store's ``tmp/`` first, then moved in), for a
        replica on another node. Returns False (nothing kept) when `owner` no longer holds the job."""
        temp = self.store.temp_video()
        done = False
        try:
            temp.write_bytes(video)
            done = self.store.complete(job_id, owner, temp)
        finally:
            if not done:
                temp.unlink(missing_ok=True)
        return done

    def read_video(self, job_id: str, client: str | None = None) -> bytes | None:
        """The finished mp4 of a ``completed`` job (of `client`, when given), or None (not completed, deleted,
        expired, another client's)."""
        path = self.store.video_path(job_id, client=client)
        try:
            return None if path is None else path.read_bytes()
        except FileNotFoundError:  # deleted between the check and the read
            return None

    def sweep_temp(self, older_than_s: float) -> list[str]:
        """`JobStore.sweep_temp` on the head's ``tmp/`` (what a `complete` that died mid-write left)."""
        return [str(path) for path in self.store.sweep_temp(older_than_s=older_than_s)]


class HeadJobStore:
    """The `JobStore` methods an ingress replica uses, each one call on the head's `JobStoreActor`.

    The methods in `FORWARDED` take and return what `JobStore`'s do and raise its errors (`QueueFullError`,
    `LookupError`, `ValueError`, OSError, sqlite3 errors) as themselves; any of them raises
    `JobStoreUnavailableError` when the actor does not answer within 60 s or died mid-call. `temp_video` and
    `sweep_temp` work on the store's own ``tmp/`` when the actor runs on this node (`local`), else on a folder of
    this node's temp dir (the runner's mp4 before `complete` sends it); `complete` takes that file's path, as
    `JobStore.complete` does. Call from a thread, not an event loop (each call waits).

    Args:
        local: the actor runs on this node, so this process sees the store's folder: mp4s move in and are read
            by path, never sent as bytes.
    """

    def __init__(self, actor, root: str | Path, tmp_dir: str | Path, *, local: bool = False) -> None:
        self.actor = actor
        self.root = Path(root)
        self.local = local
        self.tmp_dir = self.root / "tmp" if local else Path(tmp_dir)

    def __repr__(self) -> str:
        return f"HeadJobStore(root={str(self.root)!r}, tmp_dir={str(self.tmp_dir)!r}, local={self.local})"

    def __getattr__(self, name: str):
        if name in FORWARDED:
            return functools.partial(self._forward, name)
        raise AttributeError(f"{type(self).__name__} has no attribute {name!r}")

    def _forward(self, method: str, *args, **kwargs) -> Any:
        return self._wait(self.actor.call.remote(method, args, kwargs))

    def _wait(self, ref) -> Any:
        import ray.exceptions  # heavy: ray

        try:
            return ray.get(ref, timeout=_CALL_TIMEOUT_S)
        except ray.exceptions.RayTaskError as err:  # the store's own error: raised as itself
            raise err.cause from None
        except (ray.exceptions.RayActorError, ray.exceptions.GetTimeoutError) as err:
            raise JobStoreUnavailableError(f"the job store on the Ray head ({self.root}) did not answer "
                                           f"({type(err).__name__}); retry in a few seconds") from err

    def complete(self, job_id: str, owner: str, video_file: str | Path) -> bool:
        """`JobStore.complete`: the mp4 at `video_file` (this node) goes to the head's store; the local file is
        removed when done, and stays (for the caller to remove) when False. Raises FileNotFoundError without it."""
        video_file = Path(video_file)
        if not video_file.is_file():
            raise FileNotFoundError(f"video_file {video_file} does not exist; write the mp4 before complete()")
        if self.local and video_file.parent == self.tmp_dir:  # a path: the store moves the file in
            return self._wait(self.actor.complete_file.remote(job_id, owner, str(video_file)))
        done = self._wait(self.actor.complete.remote(job_id, owner, video_file.read_bytes()))
        if done:
            video_file.unlink(missing_ok=True)
        return done

    def open_video(self, job_id: str, *, client: str | None = None) -> BinaryIO | None:
        """The finished mp4 of a ``completed`` job (of `client`, when given), or None (not completed, deleted,
        expired, another client's): on the head's node the file itself, opened here (a delete after this call
        unlinks the name; the open file still reads to its end); elsewhere an in-memory file of its bytes
        fetched from the head."""
        if self.local:
            path = self._forward("video_path", job_id, client=client)
            try:
                return None if path is None else open(path, "rb")  # noqa: SIM115 - the caller closes it
            except FileNotFoundError:  # deleted between the lookup and the open
                return None
        data = self._wait(self.actor.read_video.remote(job_id, client))
        return None if data is None else io.BytesIO(data)

    def temp_video(self) -> Path:
        """A new empty ``<tmp_dir>/<random>.mp4`` on this node for the runner to write into."""
        return new_temp_mp4(self.tmp_dir)

    def sweep_temp(self, *, older_than_s: float, now: float | None = None) -> list[Path]:
        """Remove this node's temp mp4s older than `older_than_s` (left by dead renders), and the head's."""
        local = [] if self.local else sweep_old_files(self.tmp_dir, older_than_s=older_than_s, now=now)
        return local + [Path(p) for p in self._wait(self.actor.sweep_temp.remote(older_than_s))]


def head_job_store(root: str | Path, *, max_attempts: int, retention_s: float | None,
                   app: str | None = None) -> HeadJobStore:
    """The job store of folder `root` on the Ray head node: the named detached `JobStoreActor` of that folder,
    started if none runs yet (every replica asking gets the same one), given these settings (the last app to ask
    sets them) and checked to answer. The actor outlives `serve shutdown` (it holds the open store and nothing
    else); `ray.kill(ray.get_actor(name, namespace="vidray"))` removes it, its name `vidray-job-store-<hash>`
    as `ray list actors --filter "class_name=JobStoreActor"` shows it.

    The actor runs `MAX_CONCURRENCY` calls at once; one started by an older vidray (one call at a time) keeps
    running as it was until killed. The returned store is `local` (mp4s by path) when this process runs on the
    head's node.

    Needs a connected Ray (`ray.init`, as in every Serve replica). `root` is a path on the head's disk. `app`:
    the Serve app asking, which must own `root` (`vidray.serve.jobs.claim_store`); None skips the check.

    Raises:
        RuntimeError: Ray is not connected (serve with `store_on: replica` without Ray).
        ValueError: the store cannot be opened at `root` (a file there, a newer schema, not sqlite, another app's
            folder): the last line of `JobStore`'s error on the head, e.g. "FileExistsError: [Errno 17] File
            exists: '/data/serve'".
        JobStoreUnavailableError: the actor did not start within 120 s (no head node resource free?).
    """
    import ray  # heavy: ray
    import ray.exceptions  # heavy: ray
    from ray._common.constants import HEAD_NODE_RESOURCE_NAME  # heavy: ray; what Serve places its controller with

    if not ray.is_initialized():
        raise RuntimeError(f"the job store at {root} runs on the Ray head, and this process is not connected to "
                           "Ray; call ray.init() first, or set store_on: replica for a store on this node")
    root = str(root)
    key = hashlib.sha256(root.encode()).hexdigest()[:16]  # one actor per store folder
    actor = ray.remote(JobStoreActor).options(
        name=f"vidray-job-store-{key}", namespace=STORE_NAMESPACE, get_if_exists=True, lifetime="detached",
        num_cpus=0, resources={HEAD_NODE_RESOURCE_NAME: 0.001}, max_restarts=-1, max_task_retries=0,
        max_concurrency=MAX_CONCURRENCY,
    ).remote(root, max_attempts, retention_s, app)
    try:
        ray.get(actor.configure.remote(max_attempts, retention_s, app), timeout=_START_TIMEOUT_S)
        where = ray.get(actor.describe.remote(), timeout=_START_TIMEOUT_S)
    except ray.exceptions.RayTaskError as err:  # configure refused the settings, or another app owns the folder
        if isinstance(err.cause, StoreOwnedError):
            raise StoreOwnedError(str(err.cause)) from None
        raise ValueError(f"the job store at {root} refused its settings: {err.cause}") from None
    except ray.exceptions.RayActorError as err:
        if err.actor_init_failed:  # JobStore's own error; Ray keeps only its text, whose last line names it
            lines = [line.strip() for line in str(err).splitlines() if line.strip()]
            raise ValueError(f"the job store cannot be opened on the Ray head: {lines[-1]}") from None
        raise JobStoreUnavailableError(f"the job store at {root} did not start on the Ray head: {err}") from None
    except ray.exceptions.GetTimeoutError:
        raise JobStoreUnavailableError(f"the job store at {root} did not start on the Ray head within "
                                       f"{_START_TIMEOUT_S:.0f} s") from None
    local = where["node_id"] == ray.get_runtime_context().get_node_id()
    return HeadJobStore(actor, root, Path(tempfile.gettempdir()) / "vidray-serve" / key, local=local)
