"""`vidray.observability`: a real Prometheus (Debian's package) started on 127.0.0.1, its config, and its errors."""

from __future__ import annotations

import json
import socket

import pytest
import yaml

from vidray.errors import UserError
from vidray.observability import Prometheus, prometheus_config, ray_service_discovery_file

from tests.conftest import free_port



def test_config_reads_rays_service_discovery_file_at_the_interval(tmp_path):
    config = yaml.safe_load(prometheus_config(ray_service_discovery_file(tmp_path), scrape_interval_s=1.5))
    assert config["global"]["scrape_interval"] == "1500ms"
    (job,) = config["scrape_configs"]
    assert job["file_sd_configs"] == [{"files": [str(tmp_path / "prom_metrics_service_discovery.json")],
                                       "refresh_interval": "1500ms"}]
    with pytest.raises(ValueError, match="scrape_interval_s must be > 0"):
        prometheus_config(tmp_path / "sd.json", scrape_interval_s=0)


def test_a_real_prometheus_scrapes_the_listed_target_and_answers_queries(tmp_path):
    """Prometheus scrapes itself, listed as Ray lists a node, and answers PromQL; a bad expression is a one-line
    UserError with Prometheus's own reason; stop() ends the process."""
    port = free_port()
    discovery = tmp_path / "prom_metrics_service_discovery.json"
    discovery.write_text(json.dumps([{"labels": {"job": "ray"}, "targets": [f"127.0.0.1:{port}"]}]))
    with Prometheus(discovery, tmp_path / "prom", port=port, scrape_interval_s=0.5) as prom:
        import time

        deadline = time.monotonic() + 20  # the first sample is queryable ~6 s after start (NOTES.md)
        while not prom.query('up{job="ray"}') and time.monotonic() < deadline:
            time.sleep(0.5)
        (up,) = prom.query('up{job="ray"}')
        assert up["value"][1] == "1" and up["metric"]["instance"] == f"127.0.0.1:{port}"
        (series,) = prom.query_range('up{job="ray"}', seconds=30, step_s=0.5)
        assert series["values"] and all(v == "1" for _, v in series["values"])
        assert "up" in prom.series_names()
        assert [t["health"] for t in prom.targets()] == ["up"]
        with pytest.raises(UserError, match=r"prometheus refused 'sum\(up': bad_data: .*parse error"):
            prom.query("sum(up")
        with pytest.raises(UserError, match=r"prometheus refused 'rate\(up\)': bad_data"):
            prom.query_range("rate(up)")
    assert prom.process.poll() is not None


def test_a_missing_binary_names_the_package_and_a_taken_port_says_so(tmp_path):
    with pytest.raises(UserError, match=r"`no-such-prometheus` is not on PATH: install Debian's `prometheus` package"):
        Prometheus(tmp_path / "sd.json", tmp_path, binary="no-such-prometheus")
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        with pytest.raises(UserError, match=rf"cannot start prometheus on 127.0.0.1:{port} .*another process holds"):
            Prometheus(tmp_path / "sd.json", tmp_path, port=port)
