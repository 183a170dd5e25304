"""Metrics of the serve plane: what the Denoiser's step-level batching and the ingress's job runner are doing, as
Prometheus series through Ray's metrics pipeline.

The series are recorded in the replicas with `ray.serve.metrics` (Ray's `ray.util.metrics` with the Serve tags
`deployment`, `replica` and `application` added), so they need no port of their own: each node's Ray metrics agent
exports them on `ray start --metrics-export-port=P` (`http://<node>:P/metrics`), beside Ray Serve's own
`ray_serve_*` series (request counts, processing latency, ongoing requests), and the Ray dashboard's Grafana reads
them from the same Prometheus. As Ray exports every custom series, the names gain a `ray_` prefix and counters a
`_total` suffix (../shared/NOTES.md, "Prometheus"); the table gives the exported names. Values are in base units.

| series | type | unit | extra labels | meaning |
|---|---|---|---|---|
| `ray_vidray_serve_denoise_step_seconds` | histogram | s | | one denoising step of a running batch |
| `ray_vidray_serve_denoise_batch_size` | histogram | requests | | requests in each denoising step |
| `ray_vidray_serve_denoise_steps_total` | counter | steps | | denoising steps run |
| `ray_vidray_serve_denoise_items_stepped_total` | counter | requests x steps | | the sum of the steps' batch sizes |
| `ray_vidray_serve_denoise_busy_seconds_total` | counter | s | | seconds spent in denoising steps |
| `ray_vidray_serve_denoise_queue_depth` | gauge | requests | | requests waiting for a slot in the running batch |
| `ray_vidray_serve_denoise_running` | gauge | requests | | requests in the running batch |
| `ray_vidray_serve_policy_batch_size` | gauge | requests | | the batch policy's batch size for the next step |
| `ray_vidray_serve_policy_wait_seconds` | gauge | s | | how long a fresh batch may wait for arrivals |
| `ray_vidray_serve_transfer_seconds` | histogram | s | | from the caller's `sent_at` to arrival at the Denoiser (the stage boundary the policy measures) |
| `ray_vidray_serve_denoise_requests_total` | counter | requests | `outcome` (`completed`, `failed`, `cancelled`) | denoise requests that left the Denoiser |
| `ray_vidray_serve_jobs_total` | counter | jobs | `outcome` (`completed`, `failed`, `retried`, `handed_back`) | jobs this ingress replica finished or gave back (`retried`: queued again after a stage replica or another replica's runner died) |
| `ray_vidray_serve_job_seconds` | histogram | s | | a completed job's time from `POST /v1/videos` to its mp4 (queue and render; `created_at` has 1 s resolution) |
| `ray_vidray_serve_store_jobs` | gauge | jobs | `status` (`queued`, `in_progress`, `completed`, `failed`) | jobs in the store (all replicas), re-read every `gauge_refresh_s()` |
| `ray_vidray_serve_http_errors_total` | counter | responses | `status` (HTTP code), `code` (the error's `code`) | error answers of the video API |

`rate(ray_vidray_serve_denoise_busy_seconds_total[1m])` is the Denoiser's busy fraction, and
`rate(..._items_stepped_total[1m]) / rate(..._steps_total[1m])` its mean batch size, to compare with
`ray_vidray_serve_policy_batch_size` (do the batches fill?). Use these counters for sums and means, the histograms
for quantiles: Ray 2.60 exports a histogram's `_sum` estimated from its bucket midpoints
(`ray/_private/telemetry/open_telemetry_metric_recorder.py`), not the exact sum of what was observed.
Gauges are set at every step and re-set every `gauge_refresh_s()` (half of Ray's metrics report interval) while
idle: Ray's metrics agent shows a gauge only for two report intervals after it was last set. Outside a Serve
replica (unit tests) the metrics record nothing anyone reads.
"""

from __future__ import annotations

import os
from typing import Mapping

__all__ = ["DenoiserMetrics", "JobMetrics", "gauge_refresh_s"]


def gauge_refresh_s() -> float:
    """Seconds between two re-sets of a replica's gauges: half of Ray's metrics report interval
    (`RAY_metrics_report_interval_ms`, default 10000 ms), within [0.25, 5] s. Ray's metrics agent exports a gauge
    only for two report intervals after it was last set (`_gauge_metric_ttl_s`,
    `ray/_private/telemetry/open_telemetry_metric_recorder.py`): re-set every 5 s with a 1 s interval, the series
    showed up in 2 s of every 5 s."""
    try:
        interval_s = float(os.environ.get("RAY_metrics_report_interval_ms", "10000")) / 1000.0
    except ValueError:
        interval_s = 10.0
    return min(5.0, max(0.25, interval_s / 2.0))

STEP_BOUNDARIES_S = [0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0]
BATCH_BOUNDARIES = [1.5, 2.5, 4.5, 8.5, 16.5, 32.5, 64.5]
"""Bucket bounds of the batch-size histogram: the buckets hold 1, 2, 3-4, 5-8, 9-16, 17-32, 33-64 requests."""
TRANSFER_BOUNDARIES_S = [0.001, 0.005, 0.01, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0]
JOB_BOUNDARIES_S = [1.0, 2.0, 5.0, 10.0, 30.0, 60.0, 120.0, 300.0, 600.0, 1800.0, 3600.0]


class DenoiserMetrics:
    """The Denoiser replica's series (see the module docstring). Create it in the replica (its Serve tags are read
    from the replica context at creation)."""

    def __init__(self) -> None:
        from ray.serve.metrics import Counter, Gauge, Histogram  # heavy: ray

        self.step_seconds = Histogram("vidray_serve_denoise_step_seconds", "One denoising step of a running batch "
                                      "(seconds).", boundaries=STEP_BOUNDARIES_S)
        self.batch_size = Histogram("vidray_serve_denoise_batch_size", "Requests in each denoising step.",
                                    boundaries=BATCH_BOUNDARIES)
        self.steps = Counter("vidray_serve_denoise_steps", "Denoising steps run.")
        self.items_stepped = Counter("vidray_serve_denoise_items_stepped", "The sum of the denoising steps' batch "
                                     "sizes (requests x steps).")
        self.busy_s = Counter("vidray_serve_denoise_busy_seconds", "Seconds spent in denoising steps.")
        self.queue_depth = Gauge("vidray_serve_denoise_queue_depth", "Requests waiting for a slot in the running "
                                 "batch.")
        self.running = Gauge("vidray_serve_denoise_running", "Requests in the running batch.")
        self.policy_batch_size = Gauge("vidray_serve_policy_batch_size", "The batch policy's batch size for the "
                                       "next step (requests).")
        self.policy_wait_s = Gauge("vidray_serve_policy_wait_seconds", "How long a fresh batch may wait for "
                                   "arrivals (seconds).")
        self.transfer_s = Histogram("vidray_serve_transfer_seconds", "From the caller's sent_at to arrival at the "
                                    "Denoiser (seconds).", boundaries=TRANSFER_BOUNDARIES_S)
        self.requests = Counter("vidray_serve_denoise_requests", "Denoise requests that left the Denoiser, by "
                                "outcome.", tag_keys=("outcome",))

    def observe_step(self, batch_size: int, seconds: float) -> None:
        """One step of `batch_size` requests took `seconds`."""
        self.step_seconds.observe(float(seconds))
        self.batch_size.observe(float(batch_size))
        self.steps.inc(1.0)
        self.items_stepped.inc(float(batch_size))
        self.busy_s.inc(float(seconds))

    def set_queue(self, *, pending: int, running: int, policy_batch_size: int | None = None,
                  policy_wait_s: float | None = None) -> None:
        """The queue and the running batch now, and the policy's last decision (kept when None)."""
        self.queue_depth.set(float(pending))
        self.running.set(float(running))
        if policy_batch_size is not None:
            self.policy_batch_size.set(float(policy_batch_size))
        if policy_wait_s is not None:
            self.policy_wait_s.set(float(policy_wait_s))

    def observe_transfer(self, seconds: float) -> None:
        self.transfer_s.observe(max(0.0, float(seconds)))

    def count_request(self, outcome: str) -> None:
        """A request left: `completed` (latents sent), `failed` (its step failed or its latents were not finite),
        `cancelled` (its caller went away first)."""
        self.requests.inc(1.0, tags={"outcome": outcome})


class JobMetrics:
    """The ingress replica's series: job outcomes, job latency, the store's jobs by status, API errors."""

    def __init__(self) -> None:
        from ray.serve.metrics import Counter, Gauge, Histogram  # heavy: ray

        self.jobs_total = Counter("vidray_serve_jobs", "Jobs this ingress replica finished or gave back, by outcome.",
                                  tag_keys=("outcome",))
        self.job_seconds = Histogram("vidray_serve_job_seconds", "A completed job's time from POST to its mp4 "
                                     "(seconds).", boundaries=JOB_BOUNDARIES_S)
        self.store_jobs = Gauge("vidray_serve_store_jobs", "Jobs in the store, by status.", tag_keys=("status",))
        self.http_errors = Counter("vidray_serve_http_errors", "Error answers of the video API, by HTTP status "
                                   "and error code.", tag_keys=("status", "code"))

    def count_job(self, outcome: str, *, seconds: float | None = None) -> None:
        """A job ended here: `completed` (with its seconds since POST), `failed`, `retried` (queued again after a
        stage replica died, or after another replica's runner lost its lease), `handed_back` (queued again as this
        replica stops)."""
        self.jobs_total.inc(1.0, tags={"outcome": outcome})
        if seconds is not None:
            self.job_seconds.observe(max(0.0, float(seconds)))

    def set_jobs(self, counts: Mapping[str, int]) -> None:
        """`JobStore.counts()`: jobs per status."""
        for status, count in counts.items():
            self.store_jobs.set(float(count), tags={"status": status})

    def count_http_error(self, status: int, code: str) -> None:
        self.http_errors.inc(1.0, tags={"status": str(int(status)), "code": str(code)})
