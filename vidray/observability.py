"""A Prometheus server that scrapes a Ray cluster's metrics agents, for one node or a test.

```python
from vidray.observability import Prometheus, ray_service_discovery_file

with Prometheus(ray_service_discovery_file(session_dir), data_dir, port=9090, scrape_interval_s=15) as prom:
    prom.query('sum by (rank) (ray_vidray_train_step{run="tiny-t2v"})')   # [{"metric": {...}, "value": [t, "6"]}]
```

Every node's Ray metrics agent exports Ray's series and vidray's (`vidray.metrics.RAY_SERIES`, the serve plane's
`vidray.serve.metrics`) on the node's metrics export port. Ray's dashboard writes the list of those ports to
`<session_dir>/prom_metrics_service_discovery.json` (refreshed as nodes come and go), in the `file_sd_configs`
format, so one Prometheus reading that file scrapes every node (Ray's docs: "Collecting and monitoring metrics").
The binary is Debian's `prometheus` package (2.42 on these machines; `make test` installs it as root); Ray's own
`ray metrics launch-prometheus` downloads one instead, which needs the internet.
"""

from __future__ import annotations

import json
import shutil
import signal
import socket
import subprocess
import time
import urllib.error
import urllib.parse
import urllib.request
from pathlib import Path
from typing import Any

from vidray.errors import UserError

__all__ = ["Prometheus", "prometheus_config", "ray_service_discovery_file", "PROMETHEUS_PACKAGE_HINT"]

PROMETHEUS_PACKAGE_HINT = "install Debian's `prometheus` package (`apt-get install prometheus`; `make test` does it as root)"


def ray_service_discovery_file(session_dir: str | Path) -> Path:
    """`<session_dir>/prom_metrics_service_discovery.json`: the Ray session's list of metrics export addresses
    (`ray._private.metrics_agent.PrometheusServiceDiscoveryWriter`), written by the head's dashboard. A running
    driver's session folder is `ray._private.worker.global_worker.node.get_session_dir_path()`; `ray start`'s is
    `<temp_dir>/session_latest`."""
    return Path(session_dir) / "prom_metrics_service_discovery.json"


def prometheus_config(service_discovery_file: str | Path, *, scrape_interval_s: float = 15.0) -> str:
    """The `prometheus.yml` text of one job, `ray`, that scrapes every target listed in `service_discovery_file`
    (re-read as Ray rewrites it) every `scrape_interval_s` seconds. Raises ValueError for an interval <= 0."""
    if not scrape_interval_s > 0:
        raise ValueError(f"scrape_interval_s must be > 0 seconds, got {scrape_interval_s!r}")
    interval = f"{int(scrape_interval_s * 1000)}ms"
    config = {
        "global": {"scrape_interval": interval, "evaluation_interval": interval},
        "scrape_configs": [{"job_name": "ray", "file_sd_configs": [
            {"files": [str(service_discovery_file)], "refresh_interval": interval}]}],
    }
    return json.dumps(config, indent=2)  # JSON is YAML


class Prometheus:
    """A `prometheus` process on `127.0.0.1:port` scraping the targets of Ray's service discovery file; stopped (by
    its PID, SIGTERM then SIGKILL) by `stop()` or at the end of a `with` block.

    Raises UserError when the binary is not on PATH (naming the package), when `port` is taken, or when the server
    exits or is not ready within `ready_timeout_s` (with the end of its log).
    """

    def __init__(self, service_discovery_file: str | Path, data_dir: str | Path, *, port: int = 9090,
                 scrape_interval_s: float = 15.0, ready_timeout_s: float = 30.0, binary: str = "prometheus") -> None:
        self.binary = shutil.which(binary)
        if self.binary is None:
            raise UserError(f"`{binary}` is not on PATH: {PROMETHEUS_PACKAGE_HINT}")
        _check_port_free(port)
        self.port = port
        self.url = f"http://127.0.0.1:{port}"
        self.data_dir = Path(data_dir)
        self.data_dir.mkdir(parents=True, exist_ok=True)
        config = self.data_dir / "prometheus.yml"
        config.write_text(prometheus_config(service_discovery_file, scrape_interval_s=scrape_interval_s))
        self.log_path = self.data_dir / "prometheus.log"
        with open(self.log_path, "w") as log:
            self.process = subprocess.Popen(
                [self.binary, f"--config.file={config}", f"--storage.tsdb.path={self.data_dir / 'tsdb'}",
                 f"--web.listen-address=127.0.0.1:{port}"], stdout=log, stderr=subprocess.STDOUT)
        try:
            self._wait_ready(ready_timeout_s)
        except BaseException:
            self.stop()
            raise

    def _wait_ready(self, timeout_s: float) -> None:
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if self.process.poll() is not None:
                raise UserError(f"prometheus exited with code {self.process.returncode} at start; its log "
                                f"({self.log_path}) ends: {self.log_path.read_text()[-500:]}")
            try:
                with urllib.request.urlopen(f"{self.url}/-/ready", timeout=2) as resp:
                    if resp.status == 200:
                        return
            except OSError:
                pass
            time.sleep(0.2)
        raise UserError(f"prometheus on {self.url} not ready after {timeout_s:.0f} s; log: {self.log_path}")

    def query(self, expr: str) -> list[dict[str, Any]]:
        """The instant vector of PromQL `expr` now (`GET /api/v1/query`): a list of {"metric": labels, "value":
        [unix time, "value"]}. Raises UserError when Prometheus refuses the expression (its error message)."""
        return self._api("query", {"query": expr}, expr)

    def query_range(self, expr: str, *, seconds: float = 600.0, step_s: float = 1.0) -> list[dict[str, Any]]:
        """PromQL `expr` evaluated every `step_s` seconds over the last `seconds` (`GET /api/v1/query_range`, what a
        Grafana panel asks): a list of {"metric": labels, "values": [[unix time, "value"], ...]}. Raises UserError
        when Prometheus refuses the expression."""
        end = time.time()
        return self._api("query_range", {"query": expr, "start": end - seconds, "end": end, "step": step_s}, expr)

    def _api(self, endpoint: str, params: dict[str, Any], expr: str) -> list[dict[str, Any]]:
        url = f"{self.url}/api/v1/{endpoint}?" + urllib.parse.urlencode(params)
        try:
            with urllib.request.urlopen(url, timeout=10) as resp:
                body = json.load(resp)
        except urllib.error.HTTPError as err:  # 400 / 422: a bad expression, with Prometheus's own error
            body = json.loads(err.read() or b"{}")
        if body.get("status") != "success":
            raise UserError(f"prometheus refused {expr!r}: {body.get('errorType')}: {body.get('error')}")
        return body["data"]["result"]

    def series_names(self) -> set[str]:
        """Every series name Prometheus holds (`GET /api/v1/label/__name__/values`)."""
        with urllib.request.urlopen(f"{self.url}/api/v1/label/__name__/values", timeout=10) as resp:
            return set(json.load(resp)["data"])

    def targets(self) -> list[dict[str, Any]]:
        """The active scrape targets (`GET /api/v1/targets`): each with `scrapeUrl`, `health` and `lastError`."""
        with urllib.request.urlopen(f"{self.url}/api/v1/targets", timeout=10) as resp:
            return json.load(resp)["data"]["activeTargets"]

    def stop(self, timeout_s: float = 10.0) -> None:
        """SIGTERM the server (it flushes its head block), SIGKILL after `timeout_s`. Idempotent."""
        if self.process.poll() is None:
            self.process.send_signal(signal.SIGTERM)
            try:
                self.process.wait(timeout=timeout_s)
            except subprocess.TimeoutExpired:
                self.process.kill()
                self.process.wait()

    def __enter__(self) -> Prometheus:
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()


def _check_port_free(port: int) -> None:
    """UserError when 127.0.0.1:`port` cannot be bound (another process listens there)."""
    with socket.socket() as sock:
        try:
            sock.bind(("127.0.0.1", port))
        except OSError as err:
            raise UserError(f"cannot start prometheus on 127.0.0.1:{port} ({err.strerror or err}): another process "
                            f"holds the port; pick a free one") from err
