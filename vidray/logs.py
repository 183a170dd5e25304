"""What a run prints by default: vidray's own lines, warnings and errors; Ray's and the libraries' detail only with
`--verbose` (or the library's own setting, which wins: a Ray user's `RAY_DATA_LOG_LEVEL=INFO` brings Ray Data's
lines back).

Each line a new user found drowning vidray's step line is switched off where it is made, by that library's own
setting, not filtered from the text afterwards:

| line | source | setting (default run) |
|---|---|---|
| `Reporting training result N: TrainingReport(...)` | Ray Train's worker context, on a logger named by its file path (outside `ray.train`) | that logger at WARNING (`quiet_ray_train_worker`) |
| `Requesting resources`, `Started training worker group`, `Setting up process group`, `Moving model to device`, `Wrapping provided model in DistributedDataParallel` | Ray Train's `ray.train` loggers (controller and workers) | `RunConfig(logging_config=LoggingConfig(log_level="WARNING"))` (`ray_train_log_level`) |
| `core_worker.cc ... 'MapWorker(MapBatches(ClipLoader))' has constructor arguments in the object store and max_restarts > 0` | Ray Data's actors of vidray's decode and encode operators | `map_batches(max_restarts=0)` (`vidray.data.pipeline.NO_ACTOR_RESTARTS`) |
| `core_worker.cc ... 'PreemptionWatcher' has constructor arguments in the object store and max_restarts > 0` | Ray Train's node-drain watcher actor (Ray issue 53727) | `RAY_TRAIN_ENABLE_PREEMPTION_WATCHER=0` on a local cluster vidray starts itself (one machine: no node is drained); kept on a cluster |
| `Progress bars disabled. To enable...`, `Dataset ... execution finished in ...` | Ray Data's `ray.data` loggers | `RAY_DATA_LOG_LEVEL=WARNING` and the progress module's logger at ERROR (`quiet_ray_data`) |
| `Loading weights: 100%...`, `Writing model shards` | transformers' tqdm bars | `HF_HUB_DISABLE_PROGRESS_BARS=1`, `TRANSFORMERS_VERBOSITY=error` |
| `Loading pipeline components...` | diffusers' tqdm bars | `DIFFUSERS_VERBOSITY=error`, `diffusers.utils.logging.disable_progress_bar()` |
| `Started a local Ray instance`, `Generated new authentication token` | `ray.init`'s INFO lines | `ray.init(logging_level=WARNING)` (`ray_init_logging_level`) |
| `Token authentication is enabled for this Ray cluster...` | `ray.init` starting a local cluster (Ray 2.60 enables token auth there and says so at WARNING) | its module's logger at ERROR on a local cluster vidray starts (`apply_local_cluster_defaults`) |
| `reducer.cpp ... find_unused_parameters=True was specified in DDP constructor, but did not find any unused parameters` | torch's C++ DDP reducer (printed to stderr once per worker, no Python warning) with two experts on every worker (`model.experts.layout: shared`), whose DDP needs the flag | spent once at wrap time with stderr captured and that line dropped (`vidray.train.parallel.quiet_unused_parameters_warning`, `stderr_without`) |
| colour codes around `(RayTrainWorker pid=N)` in a log file or `ray job submit` | Ray's driver-side prefix of forwarded worker lines | `RAY_COLOR_PREFIX=0` when stdout is not a terminal (`plain_worker_prefixes`) |

The environment settings are put into `os.environ` when `vidray` is imported (before transformers, diffusers or
Ray Data are), so a local cluster's processes inherit them, and Ray Train's workers on a cluster get them through
`RunConfig(worker_runtime_env=...)` (`worker_env`); actors those workers start inherit their runtime env.
"""

from __future__ import annotations

import contextlib
import logging
import os
import sys
import tempfile
from collections.abc import Iterator

VERBOSE_ENV = "VIDRAY_VERBOSE"
"""`1`: keep Ray's and the libraries' own detail (what `--verbose` sets)."""

QUIET_ENV = {
    "HF_HUB_DISABLE_PROGRESS_BARS": "1",
    "TRANSFORMERS_VERBOSITY": "error",
    "DIFFUSERS_VERBOSITY": "error",
    "RAY_DATA_LOG_LEVEL": "WARNING",
}
"""Library settings of a default run (each kept when the user set it already)."""

LOCAL_CLUSTER_ENV = {"RAY_TRAIN_ENABLE_PREEMPTION_WATCHER": "0"}
"""Set before vidray starts a local cluster (one machine, where no node is drained) in a default run."""

_set_by_us: set[str] = set()


def is_verbose() -> bool:
    """True when `--verbose` (or `VIDRAY_VERBOSE=1`) asked for Ray's and the libraries' detail."""
    return os.environ.get(VERBOSE_ENV, "") == "1"


def apply_quiet_defaults() -> None:
    """Put `QUIET_ENV` into `os.environ` (values the user set are kept), unless verbose. Called by `import vidray`."""
    if is_verbose():
        return
    for key, value in QUIET_ENV.items():
        if key not in os.environ:
            os.environ[key] = value
            _set_by_us.add(key)


def set_verbose() -> None:
    """`--verbose`: undo what `apply_quiet_defaults` set (not the user's own values) and mark the process (and the
    local cluster it starts) verbose. Call it before transformers, diffusers or Ray are imported."""
    os.environ[VERBOSE_ENV] = "1"
    for key in list(_set_by_us):
        os.environ.pop(key, None)
        _set_by_us.discard(key)


def apply_local_cluster_defaults() -> None:
    """Before `ray.init` starts a local cluster: `LOCAL_CLUSTER_ENV` (user values kept), and Ray's "Token
    authentication is enabled for this Ray cluster" warning off (its module's logger at ERROR: Ray 2.60 enables
    token auth for every new local cluster and says so at WARNING; `RAY_AUTH_MODE` keeps its meaning), unless
    verbose."""
    if not is_verbose():
        for key, value in LOCAL_CLUSTER_ENV.items():
            os.environ.setdefault(key, value)
        logging.getLogger("ray._private.authentication.authentication_token_setup").setLevel(logging.ERROR)


def plain_worker_prefixes() -> None:
    """Before `ray.init`: when this process's stdout is not a terminal (a log file, `ray job submit`), Ray's
    `(RayTrainWorker pid=N)` prefixes without colour codes (Ray's own `RAY_COLOR_PREFIX=0`; a value the user set
    is kept)."""
    if not sys.stdout.isatty():
        os.environ.setdefault("RAY_COLOR_PREFIX", "0")


def ray_init_logging_level() -> int:
    """`ray.init(logging_level=...)`: WARNING by default, Ray's own INFO when verbose."""
    return logging.INFO if is_verbose() else logging.WARNING


def ray_train_log_level() -> str:
    """`ray.train.LoggingConfig(log_level=...)` for Ray Train's controller and workers."""
    return "INFO" if is_verbose() else "WARNING"


def worker_env() -> dict[str, str]:
    """Environment variables for Ray Train's workers (`RunConfig(worker_runtime_env={"env_vars": ...})`): the
    quiet settings as this driver has them (the user's own values included), or only `VIDRAY_VERBOSE=1`."""
    if is_verbose():
        return {VERBOSE_ENV: "1"}
    return {key: os.environ[key] for key in QUIET_ENV if key in os.environ}


def quiet_ray_train_worker() -> None:
    """In a Ray Train worker: the `Reporting training result N: TrainingReport(...)` line of every report off,
    unless verbose. Ray 2.60 logs it from `logging.getLogger(__file__)` in `ray.train.v2._internal.execution.
    context`: a logger named by its file path, outside `ray.train`, so `LoggingConfig(log_level=)` misses it and the
    worker's root logger prints it at INFO. Its own logger is set to WARNING here."""
    if is_verbose():
        return
    from ray.train.v2._internal.execution import context  # heavy: ray, pyarrow, numpy

    logging.getLogger(context.__file__).setLevel(logging.WARNING)


def quiet_ray_data() -> None:
    """In a process that runs a Ray Data pipeline with progress bars off: Ray Data's "Progress bars disabled. To
    enable..." warning off (its progress module's logger at ERROR), unless verbose."""
    if not is_verbose():
        logging.getLogger("ray.data._internal.progress").setLevel(logging.ERROR)


def quiet_diffusers() -> None:
    """diffusers' progress bars (`Loading pipeline components...`) off in this process, unless verbose. diffusers
    reads no environment setting for its bars."""
    if is_verbose():
        return
    from diffusers.utils import logging as diffusers_logging  # heavy: torch, diffusers, safetensors

    diffusers_logging.disable_progress_bar()
    if "transformers" in sys.modules:
        from transformers.utils import logging as transformers_logging  # heavy: transformers, PIL, numpy

        transformers_logging.disable_progress_bar()


@contextlib.contextmanager
def stderr_without(text: str) -> Iterator[None]:
    """Capture this process's file descriptor 2 (C and C++ code's stderr too, not only `sys.stderr`) while the
    block runs, then write back every captured line except those containing `text`. For a line a library prints
    from native code, where no logger or warning filter reaches; keep the block short: what it prints shows only
    after it ends."""
    sys.stderr.flush()
    saved = os.dup(2)
    with tempfile.TemporaryFile() as captured:
        os.dup2(captured.fileno(), 2)
        try:
            yield
        finally:
            sys.stderr.flush()
            os.dup2(saved, 2)
            os.close(saved)
            captured.seek(0)
            kept = b"".join(line for line in captured.read().splitlines(keepends=True) if text.encode() not in line)
            while kept:
                kept = kept[os.write(2, kept):]
