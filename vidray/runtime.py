"""Starting or joining Ray the way vidray needs it (see ../shared/NOTES.md, "Ray core and auth").

- `RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER=0` keeps every Ray listener of a local cluster on 127.0.0.1.
- `RAY_TRAIN_HEALTH_CHECK_INTERVAL_S=0.1` makes `ray.train.report` cost ~0.1 s instead of ~2 s.
- `RAY_TRAIN_WORKER_GROUP_START_TIMEOUT_S=60` (s) with `WORKER_GROUP_START_RETRIES`: start-up is bounded.
- Auth: vidray keeps Ray's token auth on (the default since 2.59). A new local cluster started by `ray.init()`
  writes `~/.ray/auth_token`; `ray start --head` does not: it needs `RAY_AUTH_MODE=token` and a token that exists
  already (`ray get-auth-token --generate` writes one), else it starts without auth. CLI clients (`ray start`,
  `ray job submit`, `ray list`) need `RAY_AUTH_MODE=token` exported (`CLIENT_ENV`). It is not set in-process:
  with it set after `import ray`, `ray.init` skips creating the token and the GCS then aborts for want of one.
The defaults are set with `setdefault`, so a user's own value wins. `RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER` is read
when `ray` is first imported: `import vidray` applies these defaults, so import vidray before ray.
"""

from __future__ import annotations

import math
import os
import socket
import warnings
from pathlib import Path
from typing import Any, Callable
from urllib.parse import urlsplit

from vidray.errors import UserError
from vidray.logs import apply_local_cluster_defaults, plain_worker_prefixes, ray_init_logging_level

RAY_ENV_DEFAULTS = {
    "RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER": "0",
    "RAY_TRAIN_HEALTH_CHECK_INTERVAL_S": "0.1",
    # Ray Train V2 waits this long (s) for a worker group to start (placement, actors, process group) before
    # it counts one start-up failure. vidray bounds those failures with WORKER_GROUP_START_RETRIES.
    "RAY_TRAIN_WORKER_GROUP_START_TIMEOUT_S": "60",
}
WORKER_GROUP_START_RETRIES = 2
"""Start-up failures of a worker group (timeouts, placement failures) retried before the run fails: passed as
`FailureConfig(controller_failure_limit=...)`. Ray Train's default is -1 (forever: a `use_gpu` job on a machine
without GPUs would retry its 60 s timeout without end). The driver's resource check refuses such jobs first."""
CLIENT_ENV = {**RAY_ENV_DEFAULTS, "RAY_AUTH_MODE": "token"}
"""Environment for Ray CLI subprocesses (`ray start --head`, `ray job submit`) under token auth."""


def apply_ray_env_defaults() -> None:
    """Put vidray's Ray environment defaults into `os.environ` (existing values are kept)."""
    for key, value in RAY_ENV_DEFAULTS.items():
        os.environ.setdefault(key, value)


def init_ray(*, num_cpus: int | None = None, log_to_driver: bool = True) -> bool:
    """Join the cluster named by `RAY_ADDRESS` (set by `ray job submit`) or start a new local one on 127.0.0.1
    (never the cluster a `ray start` on this machine recorded in `/tmp/ray/ray_current_cluster`: join that one with
    `RAY_ADDRESS`). Raises UserError for a `RAY_ADDRESS` where nothing answers (`check_ray_address`).

    A local cluster gets `num_cpus` logical CPUs (default: max(4, os.cpu_count())), so that 2 training workers
    plus Ray Train's controller fit on a 2-core machine. `log_to_driver=False` keeps the workers' output out of this
    process's (`vidray doctor --measure` prints a table). Returns True when this call started Ray (the caller
    then owns `ray.shutdown()`), False when Ray was already initialized.
    """
    apply_ray_env_defaults()
    import ray  # heavy: ray
    from ray._private import ray_constants  # heavy: ray

    if ray_constants.ENABLE_RAY_CLUSTER and not os.environ.get("RAY_ADDRESS"):
        warnings.warn(
            "ray was imported before vidray, so RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER=0 did not take effect: the local "
            "cluster may listen beyond 127.0.0.1. Import vidray first or export the variable.",
            stacklevel=2,
        )
    if ray.is_initialized():
        return False

    plain_worker_prefixes()
    if os.environ.get("RAY_ADDRESS"):
        check_ray_address(os.environ["RAY_ADDRESS"])
        ray.init(log_to_driver=log_to_driver, logging_level=ray_init_logging_level())
    else:  # address="local": a new cluster even when `ray start` left /tmp/ray/ray_current_cluster (a running
        # head, or a stopped one), which a bare ray.init() would join instead (ray/_private/services.py,
        # get_ray_address_from_environment), refusing num_cpus with a ValueError
        apply_local_cluster_defaults()  # one machine: no node is drained, Ray Train's preemption watcher idles
        ray.init(
            logging_level=ray_init_logging_level(),
            log_to_driver=log_to_driver,
            address="local",
            num_cpus=num_cpus or local_num_cpus(),
            include_dashboard=True,
            dashboard_host="127.0.0.1",
            _node_ip_address="127.0.0.1",
        )
    return True


RAY_ADDRESS_PROBE_S = 5.0
"""Seconds `check_ray_address` waits for the head's port to accept a TCP connection."""


def check_ray_address(address: str) -> None:
    """Refuse a `RAY_ADDRESS` that `ray.init` cannot join, before it tries: Ray 2.60's driver retries a GCS
    that does not answer for ever (one round every ~41 s) and ignores Ctrl-C and SIGTERM meanwhile (a new user's
    trial of `vidray doctor`).

    - `http(s)://HOST:8265` is the dashboard's job API, which `ray job submit` takes; a driver joins the GCS
      (`HOST:6379`) or the Ray client server (`ray://HOST:10001`).
    - `HOST:PORT` and `ray://HOST:PORT` must accept a TCP connection within `RAY_ADDRESS_PROBE_S` seconds.
    - Anything else (`auto`, a name without a port) is left to Ray.

    Raises UserError naming the address, what is wrong and the fix.
    """
    text = address.strip()
    scheme = text.split("://", 1)[0].lower() if "://" in text else ""
    if scheme in ("http", "https"):
        raise UserError(
            f"RAY_ADDRESS={text} is the dashboard's job API (what `ray job submit --address` takes); a driver joins "
            "the cluster at HOST:6379 (the GCS, from a node of the cluster) or ray://HOST:10001 (the Ray client "
            "server): run it on the head (`ray attach CLUSTER.yaml`, `kubectl exec`), or forward port 10001 and set "
            "RAY_ADDRESS=ray://127.0.0.1:10001"
        )
    if scheme not in ("", "ray"):
        return
    try:
        parsed = urlsplit(text if scheme else f"ray://{text}")
        host, port = parsed.hostname, parsed.port
    except ValueError:
        return
    if not host or not port:
        return
    try:
        socket.create_connection((host, port), timeout=RAY_ADDRESS_PROBE_S).close()
    except OSError as err:
        reason = err.strerror or type(err).__name__
        raise UserError(
            f"RAY_ADDRESS={text}: nothing answers at {host}:{port} ({reason}); check the address (`ray status` on "
            "the head prints it) and that the head is running, or unset RAY_ADDRESS to start a local cluster"
        ) from None


LOCAL_RAY = "the local Ray cluster vidray starts here"
"""How resource errors name the cluster `init_ray` would start (the `where` of the resource checks)."""


def local_num_cpus() -> int:
    """Logical CPUs of a local cluster `init_ray` starts: max(4, os.cpu_count())."""
    return max(4, os.cpu_count() or 1)


def local_cluster_resources() -> dict[str, float]:
    """What `init_ray` gives a new local cluster: {"CPU": `local_num_cpus()`, "GPU": the GPUs torch sees}."""
    import torch  # heavy: torch

    return {"CPU": float(local_num_cpus()), "GPU": float(torch.cuda.device_count())}


def will_start_local_ray() -> bool:
    """True when `init_ray` would start a new local cluster: Ray is not initialized in this process and no
    `RAY_ADDRESS` names a cluster to join."""
    import ray  # heavy: ray

    return not ray.is_initialized() and not os.environ.get("RAY_ADDRESS")


def check_local_ray(job: Any, check: Callable[..., None]) -> None:
    """Run a resource check against the local cluster `init_ray` would start, before it starts (and before
    anything else is touched), when it would start one: `check(job, local_cluster_resources(), where=LOCAL_RAY)`.
    `check` raises (`vidray.errors.RequestCannotBeMetError`) when the job cannot run there; a cluster that is
    joined instead is checked after joining, with its autoscaler's limit (`autoscaler_max_resources`)."""
    if will_start_local_ray():
        check(job, local_cluster_resources(), where=LOCAL_RAY)


def autoscaler_max_resources() -> dict[str, float] | None:
    """The most of each logical resource the connected cluster's autoscaler can reach ({"CPU": ..., "GPU": ...}),
    or None for a fixed cluster.

    Read from the cluster config the autoscaler reports to the GCS (`ray._private.state.state.
    get_max_resources_from_cluster_config`, a private API, so read defensively). Ray 2.60's autoscaler reports none
    (`tests/integration/test_autoscaler.py`), so without it the cluster YAML the autoscaler runs with is read
    (`autoscaler_config_path`, `cluster_yaml_max_resources`). Raises UserError for a `VIDRAY_AUTOSCALER_CONFIG`
    that names no readable cluster YAML."""
    try:
        from ray._private.state import state  # heavy: ray

        found = state.get_max_resources_from_cluster_config()
    except Exception:  # noqa: BLE001 - private API; no autoscaler info: read the cluster YAML, if any
        found = None
    if found:
        return {k: float(v) for k, v in found.items()}
    path = autoscaler_config_path()
    return cluster_yaml_max_resources(path) if path is not None else None


AUTOSCALER_CONFIG_ENV = "VIDRAY_AUTOSCALER_CONFIG"
"""A cluster YAML (Ray's launcher format: `available_node_types`) whose autoscaler runs the connected cluster."""
BOOTSTRAP_CONFIG = "~/ray_bootstrap_config.yaml"
"""Where `ray up` leaves the cluster YAML on the head (resources filled in from the instance types): a driver of
`ray job submit` runs there."""


def autoscaler_config_path() -> Path | None:
    """The cluster YAML of this cluster's autoscaler: `$VIDRAY_AUTOSCALER_CONFIG`, else `BOOTSTRAP_CONFIG` when it
    exists, else None. Raises UserError when the variable names no file."""
    named = os.environ.get(AUTOSCALER_CONFIG_ENV)
    if named:
        path = Path(named).expanduser()
        if not path.is_file():
            raise UserError(f"{AUTOSCALER_CONFIG_ENV}={named!r} names no file: point it at the cluster YAML your "
                            "autoscaler runs with, or unset it")
        return path
    bootstrap = Path(BOOTSTRAP_CONFIG).expanduser()
    return bootstrap if bootstrap.is_file() else None


def cluster_yaml_max_resources(path: str | Path) -> dict[str, float] | None:
    """The most of each resource a cluster YAML's node types add up to: the head type once, every other type
    `max_workers` times (its own, else the file's), as Ray's `_calculate_max_resource_from_cluster_config` counts
    a reported config. A worker type that lists no resources (the launcher detects them from the instance type)
    makes CPU unbounded (`inf`): its nodes may bring any number. None when the file has no node type that can add
    a node. Raises UserError naming the file when it is no YAML mapping."""
    import yaml  # heavy: yaml

    try:
        config = yaml.safe_load(Path(path).read_text())
    except (OSError, yaml.YAMLError) as err:
        raise UserError(f"cannot read the cluster YAML {str(path)!r}: {err}") from err
    if not isinstance(config, dict):
        raise UserError(f"the cluster YAML {str(path)!r} is no mapping (Ray's launcher format: available_node_types)")
    types = config.get("available_node_types") or {}
    head_type, default_max = config.get("head_node_type"), int(config.get("max_workers", 0) or 0)
    totals: dict[str, float] = {}
    grows = False
    for name, node_type in types.items():
        count = 1 if name == head_type else int(node_type.get("max_workers", default_max) or 0)
        resources = node_type.get("resources") or {}
        if name != head_type and count > 0:
            grows = True
            if not resources:
                totals["CPU"] = math.inf
        for resource, value in resources.items():
            totals[resource] = totals.get(resource, 0.0) + count * float(value)
    return totals if grows else None
