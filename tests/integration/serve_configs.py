"""The shipped Serve config (`serve/*.yaml`) pointed at a test's model and job store: the one edit that every test
serving the real application makes before `serve run` or a deploy. No pytest and no vidray import here:
`tests/gpu/ray_rows.py` uses it too, from the Ray pack's clean environment."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import yaml

REPO = Path(__file__).resolve().parents[2]


def serve_config_for(model_path: str | Path, store_dir: str | Path, *, shipped: str = "serve_config.yaml",
                     one_replica: bool = False, **args: Any) -> dict[str, Any]:
    """The Serve config `serve/<shipped>` of this repository, parsed, with its first application's `args` (the
    `ServeSettings` of `vidray/serve/app.py`) pointed at `model_path` (a diffusers folder, e.g. a run's export) and
    `store_dir`, then `args` applied on top: a dict value updates the shipped section of that name
    (`runner={"lease_s": 6.0}` keeps the other runner fields), any other value replaces or adds the key. With
    `one_replica`, every deployment runs exactly one replica (its `autoscaling_config` dropped), e.g. so that a
    placement group's bundles fit a small test cluster. Returns the whole config (`http_options` untouched: the
    caller sets the port once its cluster runs). Raises FileNotFoundError when `serve/<shipped>` does not exist."""
    config = yaml.safe_load((REPO / "serve" / shipped).read_text())
    app = config["applications"][0]
    settings = app["args"]
    settings.update(model_path=str(model_path), store_dir=str(store_dir))
    for key, value in args.items():
        if isinstance(value, dict) and isinstance(settings.get(key), dict):
            settings[key].update(value)
        else:
            settings[key] = value
    if one_replica:
        for deployment in app["deployments"]:
            deployment.pop("autoscaling_config", None)
            deployment["num_replicas"] = 1
    return config
