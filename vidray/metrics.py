"""Training metrics of one Ray Train worker: Prometheus series (`prometheus-client`) and the figures of the log.

```python
metrics = TrainMetrics(rank=rank, run=job.name, export_to_ray=True)  # in a Ray Train worker
port = metrics.serve(job.train.metrics_port + rank)     # opt-in endpoint; 127.0.0.1 only, unless addr= says otherwise
metrics.observe_step(data_wait_s=0.004, step_s=0.31, samples=2)  # every step
metrics.add_cache("warm", hits=1)                      # from the data plane, any thread
log.info(metrics.window_summary())                     # every log window: counts since the last call
metrics.observe_window(loss=0.41, lr=1e-4, data_wait_fraction=0.02)  # every log window
metrics.write_textfile(run_dir / "metrics" / f"rank_{rank}.prom")
metrics.close()
```

Every series carries the labels `rank` (the Ray Train world rank) and `run` (the job name); values are in base
units (seconds, bytes); counters end in `_total`.

| series | type | unit | extra labels | meaning |
|---|---|---|---|---|
| `vidray_data_wait_seconds` | histogram | s | | time the trainer waited for its next batch, per step |
| `vidray_train_step_seconds` | histogram | s | | wall time of one optimizer step, data wait included |
| `vidray_cache_hits_total` | counter | shards or clips | `tier` (`hot`, `warm`, `latent`, `prompt`) | lookups served by the tier |
| `vidray_cache_misses_total` | counter | shards or clips | `tier` (`hot`, `warm`, `latent`, `prompt`) | lookups the tier could not serve |
| `vidray_data_fetched_bytes_total` | counter | bytes | | bytes fetched from the cold store (object storage) |
| `vidray_samples_skipped_total` | counter | clips or shards | `kind` (`clip`, `shard`) | bad input skipped |
| `vidray_prefetch_lead_batches` | gauge | batches | | batches ready ahead of the trainer; 0 = the trainer waits |
| `vidray_train_step` | gauge | steps | | the last optimizer step (1-based) |
| `vidray_train_loss` | gauge | | | the loss of the last log window (mean over its steps and the ranks) |
| `vidray_train_lr` | gauge | | | the learning rate after the last log window |
| `vidray_data_wait_fraction` | gauge | 0..1 | | data wait / step time over the last log window |
| `vidray_train_samples_total` | counter | samples | | batch slots this rank trained (`rate()` summed over ranks: samples/s) |
| `vidray_stage_busy_seconds_total` | counter | s | `stage` (`decode`, `vae`, `text`, `dit`) | seconds the stage worked for this rank |
| `vidray_stage_clips_total` | counter | clips | `stage` | clips the stage processed for this rank |

Histogram buckets run from 1 ms to 60 s (data wait) and to 300 s (step time). The warm tier counts shards (a
hit: the shard is on node-local disk), the hot tier counts decoded clips (a hit: the clip is in memory), the
latent and prompt tiers count clips and captions of the latent cache (a miss: encoded by the vae / text stage).
`rate(vidray_stage_busy_seconds_total[1m])` is a stage's busy fraction: the stage nearest 1 is the bottleneck,
and the queue ahead of the trainer is `vidray_prefetch_lead_batches`. The counter takes a micro-batch's seconds
when the trainer receives it (a stage running ahead shows as a burst over a short range); the log window's
`<stage>_busy_fraction` (`window_summary`) counts only the part of each stage's timestamped work inside the
window (`add_stage`), at most 1 for one stage actor. A skipped
shard failed its checksum or could not be fetched after retries; a skipped clip no longer decodes. As
prometheus-client does by default, counters and histograms also expose a `<name>_created` gauge (Unix seconds).

**Through Ray's metrics agent** (the default in a training run, `export_to_ray=True`): every series is also
recorded with `ray.util.metrics`, tagged `run`, `rank` and `node` (the worker's node IP), so each node's Ray
metrics agent exports it on the node's metrics export port (`ray start --metrics-export-port=P`) beside Ray's own
series, and a Prometheus that reads Ray's service discovery file (`<session_dir>/prom_metrics_service_discovery.json`,
`file_sd_configs`) scrapes every rank on every node, no port of vidray's own. As Ray exports any custom series, the
names gain a `ray_` prefix and counters a `_total` suffix: `ray_vidray_train_step`, `ray_vidray_cache_hits_total`,
`ray_vidray_data_wait_seconds_bucket`; `RAY_SERIES` lists them. Ray estimates a histogram's `_sum` from its bucket
midpoints: use `_bucket` for quantiles and `_count` for rates. Ray keeps a gauge ~2 report intervals after its last
set, so gauges vanish ~20 s after a run ends. `observability/grafana/vidray.json` charts these series.

**Opt-in, without Ray's agent:** each training worker serves its series on `127.0.0.1:(train.metrics_port + rank)`
(`serve`), and always writes them to `<run_dir>/metrics/rank_<N>.prom` (`write_textfile`, Prometheus text format)
at every report. A Prometheus on the same node scrapes the ports `metrics_port .. metrics_port + N - 1`. The port
follows the world rank, not the node: with N workers in all, list the whole range on every node (a port that no
worker of that node serves only shows as `up == 0`):

```yaml
scrape_configs:
  - job_name: vidray
    scrape_interval: 15s
    static_configs:
      - targets: ["127.0.0.1:9400", "127.0.0.1:9401", "127.0.0.1:9402", "127.0.0.1:9403"]  # metrics_port: 9400, 4 ranks
```

To scrape from another machine, serve on the node's IP (`serve(port, addr=<node ip>)`) and list
`<node ip>:<port>` targets, or point node_exporter's textfile collector
(`--collector.textfile.directory=<run_dir>/metrics`) at the `.prom` files. The endpoint has no authentication:
keep it on loopback or a private network.
"""

from __future__ import annotations

import math
import numbers
import threading
import time
from pathlib import Path
from typing import Callable, Literal

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, start_http_server, write_to_textfile

from vidray.errors import UserError

__all__ = ["TrainMetrics", "CACHE_TIERS", "SKIP_KINDS", "DATA_WAIT_BUCKETS_S", "STEP_BUCKETS_S", "RAY_SERIES"]

CacheTier = Literal["hot", "warm", "latent", "prompt"]
SkipKind = Literal["clip", "shard"]
CACHE_TIERS: tuple[str, ...] = ("hot", "warm", "latent", "prompt")
"""hot: decoded clips in the loader's memory; warm: shards on the node's disk; latent: clips' latents and
prompt: captions' prompt_embeds in the latent cache (`vidray.data.encode`: a miss is an encode)."""
STAGES: tuple[str, ...] = ("decode", "vae", "text", "dit")
"""The stages a micro-batch passes, whose busy seconds and clips `add_stage` counts (decode: fetch + decode in the
loader, its clips those actually decoded (not those whose cached latents it read); vae / text: the encode actors,
their clips the batch slots they served, encoded or reused; dit: the trainer's forward, backward and optimizer
step, its clips the batch slots trained; a VAE run (`train.objective: vae`) counts its trainer's step as `vae`:
`vidray.train.window.compute_stage`)."""
SKIP_KINDS: tuple[str, ...] = ("clip", "shard")

DATA_WAIT_BUCKETS_S: tuple[float, ...] = (
    0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, math.inf)
"""Upper bounds (s) of `vidray_data_wait_seconds`: 1 ms (a batch already prefetched) to 60 s (a cold fetch)."""
STEP_BUCKETS_S: tuple[float, ...] = (
    0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 120.0, 300.0, math.inf)
"""Upper bounds (s) of `vidray_train_step_seconds`: 5 ms (a tiny model on CPU) to 300 s."""

_SUMMARY_COUNTERS = ("data_wait_s", "step_s", "steps", *(f"{t}_{k}" for t in CACHE_TIERS for k in ("hits", "misses")),
                     "bytes_fetched", "skipped_clips", "skipped_shards",
                     *(f"{s}_{k}" for s in STAGES for k in ("busy_s", "busy_in_window_s", "clips")))
"""Keys of `summary()` that add up over time (a window is the difference of two totals)."""


_SERIES: tuple[tuple[str, str, str, tuple[str, ...], tuple[float, ...] | None], ...] = (
    # (name, type, help, extra labels, histogram buckets)
    ("vidray_data_wait_seconds", "histogram", "Time the trainer waited for its next batch, per step.", (),
     DATA_WAIT_BUCKETS_S),
    ("vidray_train_step_seconds", "histogram", "Wall time of one optimizer step, data wait included.", (),
     STEP_BUCKETS_S),
    ("vidray_cache_hits", "counter", "Lookups served by a cache tier (warm: shards, hot: clips, latent/prompt: "
     "clips and captions of the latent cache).", ("tier",), None),
    ("vidray_cache_misses", "counter", "Lookups a cache tier could not serve.", ("tier",), None),
    ("vidray_data_fetched_bytes", "counter", "Bytes fetched from the cold store (object storage).", (), None),
    ("vidray_samples_skipped", "counter", "Bad input skipped (checksum, decode or fetch failure), by kind (clip or "
     "shard).", ("kind",), None),
    ("vidray_prefetch_lead_batches", "gauge", "Batches ready ahead of the trainer; 0: the trainer waits.", (), None),
    ("vidray_train_step", "gauge", "The last optimizer step (1-based).", (), None),
    ("vidray_train_loss", "gauge", "The loss of the last log window (mean over its steps and the ranks).", (), None),
    ("vidray_train_lr", "gauge", "The learning rate after the last log window.", (), None),
    ("vidray_data_wait_fraction", "gauge", "Data wait / step time over the last log window (0..1).", (), None),
    ("vidray_train_samples", "counter", "Batch slots this rank trained (rate() summed over ranks: samples/s).", (),
     None),
    ("vidray_stage_busy_seconds", "counter", "Seconds a stage spent on this rank's micro-batches (rate() over wall "
     "time: its busy fraction).", ("stage",), None),
    ("vidray_stage_clips", "counter", "Clips a stage processed for this rank (rate(): clips/s).", ("stage",), None),
)
"""Every training series: (name without a counter's `_total`, type, help, labels beyond `run`/`rank`, histogram
upper bounds in seconds)."""


def _exported_names(name: str, kind: str, prefix: str) -> list[str]:
    if kind == "counter":
        return [f"{prefix}{name}_total"]
    if kind == "histogram":
        return [f"{prefix}{name}_{suffix}" for suffix in ("bucket", "count", "sum")]
    return [f"{prefix}{name}"]


RAY_SERIES: dict[str, str] = {
    exported: kind for name, kind, _, _, _ in _SERIES for exported in _exported_names(name, kind, "ray_")}
"""The training series as Ray's metrics agent exports them (a `ray_` prefix, counters `_total`, histograms
`_bucket`/`_count`/`_sum`) -> their type: what a Prometheus scraping Ray sees, labelled `run`, `rank`, `node` and
the extra labels of `_SERIES`."""

_BASE_LABELS = ("rank", "run")
_KIND_AND_EXTRA: dict[str, tuple[str, str | None]] = {
    name: (kind, extra[0] if extra else None) for name, kind, _, extra, _ in _SERIES}
"""name -> (type, the one label beyond `run`/`rank`, or None): what recording a value needs to know."""


class TrainMetrics:
    """The metrics of one training worker, in their own `CollectorRegistry` unless `registry` is given, and, with
    `export_to_ray`, through Ray's metrics agent too (`ray.util.metrics`).

    Thread-safe: the data plane may count from its threads while the training loop observes steps. The series
    and their labels are listed in the module docstring.
    """

    def __init__(self, *, rank: int, run: str, registry: CollectorRegistry | None = None,
                 export_to_ray: bool = False, node: str | None = None,
                 clock: Callable[[], float] = time.time) -> None:
        """`rank`: the Ray Train world rank (>= 0), `run`: the job name; both become labels of every series.
        `export_to_ray`: also record every series with `ray.util.metrics` (call it in a Ray worker), tagged `run`,
        `rank` and `node` (default: this worker's node IP). `clock`: wall-clock seconds, the clock the stages
        timestamp their work with (`add_stage`'s start and end): `time.time`.

        Raises ValueError on a negative rank or an empty run name, and prometheus-client's ValueError when
        `registry` already holds `vidray_*` series (one TrainMetrics per registry).
        """
        if isinstance(rank, bool) or not isinstance(rank, int) or rank < 0:
            raise ValueError(f"rank must be an int >= 0 (the Ray Train world rank), got {rank!r}")
        if not isinstance(run, str) or not run:
            raise ValueError(f"run must be a non-empty str (the job name), got {run!r}")
        self.rank = rank
        self.run = run
        self.registry = registry if registry is not None else CollectorRegistry()
        self._labels = {"rank": str(rank), "run": run}
        self._prom = {}
        for name, kind, doc, extra, buckets in _SERIES:
            labels = (*_BASE_LABELS, *extra)
            if kind == "histogram":
                self._prom[name] = Histogram(name, doc, labels, buckets=buckets, registry=self.registry)
            else:
                self._prom[name] = (Counter if kind == "counter" else Gauge)(name, doc, labels, registry=self.registry)
        self._ray = _ray_series(rank, run, node) if export_to_ray else {}
        # Children bound once (labels() costs a dict lookup and a lock per call); every tier, kind and stage exists
        # at 0 from the start, so a rate() over them is defined before the first hit.
        self._children: dict[tuple[str, str], object] = {}
        for name, (_, extra) in _KIND_AND_EXTRA.items():
            for value in {"tier": CACHE_TIERS, "kind": SKIP_KINDS, "stage": STAGES}.get(extra, ("",)):
                self._child(name, value)

        self._lock = threading.Lock()
        self._clock = clock
        self._totals = dict.fromkeys(_SUMMARY_COUNTERS, 0.0)
        self._window_start = dict(self._totals)
        self._opened_at = self._window_opened_at = clock()  # wall clock (s): this object's start, the window's
        self._prefetch_lead = 0
        self._server = None
        self._thread: threading.Thread | None = None

    def _child(self, name: str, value: str = ""):
        """The prometheus-client child of series `name` for this rank (and extra label `value`, if it has one)."""
        child = self._children.get((name, value))
        if child is None:
            extra = _KIND_AND_EXTRA[name][1]
            labels = {**self._labels, **({extra: value} if extra else {})}
            child = self._children[(name, value)] = self._prom[name].labels(**labels)
        return child

    def _record(self, name: str, value: float, label: str = "") -> None:
        """Add (counter), set (gauge) or observe (histogram) `value` on series `name` (with its extra label's
        value `label`, if it has one) in both registries."""
        kind, extra = _KIND_AND_EXTRA[name]
        if kind == "counter" and value <= 0:
            return  # nothing to count; Ray's Counter.inc refuses 0
        method = {"counter": "inc", "gauge": "set", "histogram": "observe"}[kind]
        getattr(self._child(name, label), method)(value)
        ray_metric = self._ray.get(name)
        if ray_metric is not None:
            getattr(ray_metric, method)(value, tags={extra: label} if extra else {})

    # --- recording -------------------------------------------------------------------------------------------

    def observe_step(self, *, data_wait_s: float, step_s: float, samples: int = 0) -> None:
        """Record one optimizer step: `data_wait_s` (s) the trainer waited for the batch, `step_s` (s) the whole
        step, data wait included, `samples` the batch slots this rank trained in it. Raises ValueError on a
        negative or non-finite time or a negative count."""
        for name, value in (("data_wait_s", data_wait_s), ("step_s", step_s)):
            if not math.isfinite(value) or value < 0:
                raise ValueError(f"{name} must be a finite number of seconds >= 0, got {value!r}")
        samples = _check_count("samples", samples)
        self._record("vidray_data_wait_seconds", data_wait_s)
        self._record("vidray_train_step_seconds", step_s)
        self._record("vidray_train_samples", samples)
        with self._lock:
            self._totals["data_wait_s"] += data_wait_s
            self._totals["step_s"] += step_s
            self._totals["steps"] += 1

    def observe_window(self, *, loss: float, lr: float, data_wait_fraction: float) -> None:
        """Set the gauges of one log window: its `loss` (mean over its steps and the ranks), the `lr` after it and
        its `data_wait_fraction` (0..1). Raises ValueError on a non-finite value or a fraction outside [0, 1]."""
        for name, value in (("loss", loss), ("lr", lr), ("data_wait_fraction", data_wait_fraction)):
            if not math.isfinite(value):
                raise ValueError(f"{name} must be finite, got {value!r}")
        if not 0.0 <= data_wait_fraction <= 1.0:
            raise ValueError(f"data_wait_fraction must be in [0, 1], got {data_wait_fraction!r}")
        self._record("vidray_train_loss", float(loss))
        self._record("vidray_train_lr", float(lr))
        self._record("vidray_data_wait_fraction", float(data_wait_fraction))

    def add_cache(self, tier: CacheTier, *, hits: int = 0, misses: int = 0) -> None:
        """Count `hits` and `misses` (>= 0) of cache `tier` (`CACHE_TIERS`). Raises ValueError on another tier or a
        negative count."""
        if tier not in CACHE_TIERS:
            raise ValueError(f"unknown cache tier {tier!r}; valid: {', '.join(CACHE_TIERS)}")
        hits = _check_count("hits", hits)
        misses = _check_count("misses", misses)
        self._record("vidray_cache_hits", hits, tier)
        self._record("vidray_cache_misses", misses, tier)
        with self._lock:
            self._totals[f"{tier}_hits"] += hits
            self._totals[f"{tier}_misses"] += misses

    def add_stage(self, stage: str, *, busy_s: float, clips: int, start: float | None = None,
                  end: float | None = None) -> None:
        """Count `busy_s` seconds (>= 0) and `clips` (>= 0) of `stage` (`STAGES`) for one micro-batch, received
        now. `start`, `end`: wall-clock seconds (`time.time()` where the stage did the work) between which the
        stage worked on it; without them the work is taken as done just now (`[now - busy_s, now]`: the trainer's
        own step). The busy fraction counts only the part of `[start, end]` inside the open window (clipped to
        `[window start, now]`): prefetched work done before the window opened was the earlier window's, so one
        stage actor, working on one micro-batch at a time, is busy at most 100 % of a window. The Prometheus
        counter `vidray_stage_busy_seconds_total` takes `busy_s` whole. Raises ValueError on another stage, a
        negative count, a negative or non-finite time, or `end` before `start` (or only one of them)."""
        if stage not in STAGES:
            raise ValueError(f"unknown stage {stage!r}; valid: {', '.join(STAGES)}")
        if not math.isfinite(busy_s) or busy_s < 0:
            raise ValueError(f"busy_s must be a finite number of seconds >= 0, got {busy_s!r}")
        if (start is None) != (end is None) or (start is not None and not (math.isfinite(start) and
                                                                          math.isfinite(end) and end >= start)):
            raise ValueError(f"start and end must be given together, wall-clock seconds with end >= start, got "
                             f"{start!r}, {end!r}")
        clips = _check_count("clips", clips)
        self._record("vidray_stage_busy_seconds", busy_s, stage)
        self._record("vidray_stage_clips", clips, stage)
        now = self._clock()
        if start is None:
            start, end = now - busy_s, now
        with self._lock:
            in_window = max(0.0, min(end, now) - max(start, self._window_opened_at))
            self._totals[f"{stage}_busy_s"] += busy_s
            self._totals[f"{stage}_busy_in_window_s"] += in_window
            self._totals[f"{stage}_clips"] += clips

    def add_bytes_fetched(self, n: int) -> None:
        """Count `n` bytes (>= 0) fetched from the cold store (object storage). Raises ValueError if negative."""
        n = _check_count("n", n)
        self._record("vidray_data_fetched_bytes", n)
        with self._lock:
            self._totals["bytes_fetched"] += n

    def add_skipped(self, kind: SkipKind, n: int = 1) -> None:
        """Count `n` (>= 0) skipped items of `kind` ("clip": a clip that does not decode, "shard": a shard that
        failed its checksum or could not be fetched). Raises ValueError on another kind or a negative count."""
        if kind not in SKIP_KINDS:
            raise ValueError(f"unknown skip kind {kind!r}; valid: {', '.join(SKIP_KINDS)}")
        n = _check_count("n", n)
        self._record("vidray_samples_skipped", n, kind)
        with self._lock:
            self._totals[f"skipped_{kind}s"] += n

    def set_prefetch_lead(self, batches: int) -> None:
        """Set the number of batches (>= 0) ready ahead of the trainer. Raises ValueError if negative."""
        batches = _check_count("batches", batches)
        self._record("vidray_prefetch_lead_batches", batches)
        with self._lock:
            self._prefetch_lead = batches

    def set_step(self, step: int) -> None:
        """Set the last optimizer step (1-based; 0 before the first). Raises ValueError if negative."""
        self._record("vidray_train_step", _check_count("step", step))

    # --- reading ---------------------------------------------------------------------------------------------

    def summary(self) -> dict[str, float]:
        """Totals since this object was made, for the training log and the end-of-run summary.

        Keys: `data_wait_s` (s, summed over steps), `data_wait_fraction` (data wait / step time, both summed;
        0.0 before any step), `step_s` (s, summed), `steps`, `<tier>_hits` and `<tier>_misses` of each
        `CACHE_TIERS`, `bytes_fetched` (bytes), `prefetch_lead` (batches, the current value), `skipped_clips`,
        `skipped_shards`, `wall_s` (s, wall clock since this object was made), and per stage of `STAGES`
        `<stage>_busy_s` (its seconds, whenever done), `<stage>_busy_in_window_s` (the part of its work inside the
        window in which the trainer received it, `add_stage`), `<stage>_clips` and `<stage>_busy_fraction`
        (`<stage>_busy_in_window_s` / `wall_s`: the share of the wall time the stage was working for this rank,
        at most 1 for one stage actor; the largest names the bottleneck).
        """
        with self._lock:
            totals, lead = dict(self._totals), self._prefetch_lead
            wall_s = self._clock() - self._opened_at
        return _with_derived(totals, lead, wall_s)

    def window_summary(self) -> dict[str, float]:
        """`summary()`'s keys counted since the previous `window_summary()` call (or since creation), which opens
        the next window: call it once per log window. `wall_s` is the window's wall time, and a stage's
        `busy_fraction` its work inside the window over it (`add_stage`). `prefetch_lead` is the current value;
        `summary()`'s totals are not reset."""
        with self._lock:
            totals = dict(self._totals)
            start, self._window_start = self._window_start, totals
            lead = self._prefetch_lead
            now = self._clock()
            wall_s, self._window_opened_at = now - self._window_opened_at, now
        return _with_derived({k: totals[k] - start[k] for k in _SUMMARY_COUNTERS}, lead, wall_s)

    # --- exposition ------------------------------------------------------------------------------------------

    def serve(self, port: int, addr: str = "127.0.0.1") -> int:
        """Serve this registry over HTTP (`GET /metrics`, Prometheus text format) on `addr:port` from a daemon
        thread, and return the bound port (`port=0` picks a free one). Stop it with `close()`.

        Raises RuntimeError when already serving, and UserError when the port cannot be bound (taken by another
        process, or a privileged port).
        """
        if self._server is not None:
            raise RuntimeError(f"metrics already served on port {self._server.server_port}; call close() first")
        if not 0 <= port <= 65535:
            raise ValueError(f"port must be in 0..65535 (0: any free port), got {port}")
        try:
            self._server, self._thread = start_http_server(port, addr=addr, registry=self.registry)
        except OSError as e:
            raise UserError(
                f"cannot serve metrics of rank {self.rank} on {addr}:{port} ({e.strerror or e}): another process "
                f"holds the port; set train.metrics_port to a free range (rank N serves on metrics_port + N) or "
                f"to null (no endpoint)") from e
        return int(self._server.server_port)

    def close(self) -> None:
        """Stop the HTTP server started by `serve()` and free its port. Idempotent; a no-op when not serving."""
        server, thread = self._server, self._thread
        self._server = self._thread = None
        if server is not None:
            server.shutdown()       # stops serve_forever; the thread then returns
            server.server_close()   # closes the listening socket
        if thread is not None:
            thread.join(timeout=5.0)

    def __enter__(self) -> TrainMetrics:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def write_textfile(self, path: str | Path) -> None:
        """Write every series to `path` in the Prometheus text format, atomically (a temp file in the same folder,
        then a rename: a reader sees the old file or the new one, never half of one). Creates the folder."""
        path = Path(path)
        path.parent.mkdir(parents=True, exist_ok=True)
        write_to_textfile(str(path), self.registry)


def _ray_series(rank: int, run: str, node: str | None) -> dict[str, object]:
    """`_SERIES` as `ray.util.metrics` objects, their default tags `run`, `rank` and `node` (default: this
    worker's node IP) set: Ray's metrics agent on this node exports them."""
    import ray  # heavy: ray
    from ray.util import metrics as ray_metrics  # heavy: ray

    node = node if node is not None else ray.util.get_node_ip_address()
    defaults = {"run": run, "rank": str(rank), "node": node}
    out = {}
    for name, kind, doc, extra, buckets in _SERIES:
        tag_keys = (*_BASE_LABELS, "node", *extra)
        if kind == "histogram":
            metric = ray_metrics.Histogram(name, doc, boundaries=[b for b in buckets if math.isfinite(b)],
                                           tag_keys=tag_keys)
        else:
            metric = (ray_metrics.Counter if kind == "counter" else ray_metrics.Gauge)(name, doc, tag_keys=tag_keys)
        metric.set_default_tags(defaults)
        out[name] = metric
    return out


def _with_derived(counts: dict[str, float], prefetch_lead: int, wall_s: float) -> dict[str, float]:
    """`counts` as floats plus `data_wait_fraction` (0.0 without step time), `wall_s`, each stage's
    `busy_fraction` (its in-window busy seconds / `wall_s`; 0.0 without wall time) and `prefetch_lead`."""
    out = {k: float(v) for k, v in counts.items()}
    out["data_wait_fraction"] = out["data_wait_s"] / out["step_s"] if out["step_s"] > 0 else 0.0
    out["wall_s"] = float(wall_s)
    for stage in STAGES:
        out[f"{stage}_busy_fraction"] = out[f"{stage}_busy_in_window_s"] / wall_s if wall_s > 0 else 0.0
    out["prefetch_lead"] = float(prefetch_lead)
    return out


def _check_count(name: str, value: int) -> int:
    """`value` as an int; ValueError unless it is an integer >= 0 (numpy integers count, bools do not)."""
    if isinstance(value, bool) or not isinstance(value, numbers.Integral) or value < 0:
        raise ValueError(f"{name} must be an int >= 0, got {value!r}")
    return int(value)
