"""Starting or joining Ray the way vidray needs it (see ../shared/NOTES.md, "Ray core and auth").

- `RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER=0` keeps every Ray listener of a local cluster on 127.0.0.1.
- `RAY_TRAIN_HEALTH_CHECK_INTERVAL_S=0.1` makes `ray.train.report` cost ~0.1 s instead of ~2 s.
- Auth: vidray keeps Ray's token auth on (the default since 2.59). A local cluster writes `~/.ray/auth_token`;
  CLI clients (`ray job submit`, `ray list`) need `RAY_AUTH_MODE=token` exported, which we set here too.
Both are set with `setdefault`, so a user's own value wins. They must be in the environment before `ray.init`.
"""

from __future__ import annotations

import os

RAY_ENV_DEFAULTS = {
    "RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER": "0",
    "RAY_TRAIN_HEALTH_CHECK_INTERVAL_S": "0.1",
    "RAY_AUTH_MODE": "token",
}


def apply_ray_env_defaults() -> None:
    """Put vidray's Ray environment defaults into `os.environ` (existing values are kept)."""
    for key, value in RAY_ENV_DEFAULTS.items():
        os.environ.setdefault(key, value)


def init_ray(*, num_cpus: int | None = None) -> bool:
    """Join the cluster named by `RAY_ADDRESS` (set by `ray job submit`) or start a local one on 127.0.0.1.

    A local cluster gets `num_cpus` logical CPUs (default: max(4, os.cpu_count())), so that 2 training workers
    plus Ray Train's controller fit on a 2-core machine. Returns True when this call started Ray (the caller
    then owns `ray.shutdown()`), False when Ray was already initialized.
    """
    import ray

    apply_ray_env_defaults()
    if ray.is_initialized():
        return False
    if os.environ.get("RAY_ADDRESS"):
        ray.init(log_to_driver=True)
    else:
        ray.init(
            num_cpus=num_cpus or max(4, os.cpu_count() or 1),
            include_dashboard=False,
            _node_ip_address="127.0.0.1",
        )
    return True
