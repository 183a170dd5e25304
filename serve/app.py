"""Import path for `serve run serve/serve_config.yaml` / `serve deploy`: `serve.app:build_app`.

The application (ingress, job runner, stage deployments) lives in `vidray.serve`; see `vidray/serve/app.py`.
"""

from vidray.serve.app import build_app

__all__ = ["build_app"]
