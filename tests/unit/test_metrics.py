"""`vidray.metrics.TrainMetrics` on real exposition: the text format parsed with prometheus-client's own parser,
a real HTTP server on 127.0.0.1, real files."""

from __future__ import annotations

import socket
import urllib.error
import urllib.request
from pathlib import Path

import numpy as np
import pytest
from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.parser import text_string_to_metric_families

from vidray.errors import UserError
from vidray.metrics import TrainMetrics

LABELS = {"rank": "1", "run": "tiny-t2v"}


def _samples(text: str) -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
    """{(sample name, sorted labels): value} of a Prometheus text exposition."""
    return {(s.name, tuple(sorted(s.labels.items()))): s.value
            for family in text_string_to_metric_families(text) for s in family.samples}


def _value(samples: dict, name: str, **extra: str) -> float:
    return samples[(name, tuple(sorted({**LABELS, **extra}.items())))]


def _scrape(port: int, host: str = "127.0.0.1") -> str:
    with urllib.request.urlopen(f"http://{host}:{port}/metrics", timeout=5) as response:
        return response.read().decode()


def _external_ipv4() -> str | None:
    """This machine's address on its default route (not loopback), or None without one."""
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
        try:
            s.connect(("192.0.2.255", 9))  # UDP connect sends nothing; it only picks the route's source address
            address = s.getsockname()[0]
        except OSError:
            return None
    return None if address.startswith("127.") or address == "0.0.0.0" else address


@pytest.fixture
def metrics():
    m = TrainMetrics(rank=1, run="tiny-t2v")
    yield m
    m.close()


def test_counters_and_histograms_hold_the_observed_values(metrics):
    metrics.observe_step(data_wait_s=0.002, step_s=0.3, samples=2)
    metrics.observe_step(data_wait_s=2.0, step_s=2.5, samples=3)
    metrics.observe_window(loss=0.25, lr=1e-4, data_wait_fraction=0.71)
    metrics.add_cache("warm", hits=3, misses=1)
    metrics.add_cache("hot", hits=5)
    metrics.add_cache("warm", hits=np.int64(2))
    metrics.add_bytes_fetched(1_000_000)
    metrics.add_bytes_fetched(24)
    metrics.add_skipped("clip")
    metrics.add_skipped("shard", 2)
    metrics.set_prefetch_lead(4)
    metrics.set_step(2)

    s = _samples(generate_latest(metrics.registry).decode())

    assert _value(s, "vidray_data_wait_seconds_count") == 2
    assert _value(s, "vidray_data_wait_seconds_sum") == pytest.approx(2.002)
    assert _value(s, "vidray_data_wait_seconds_bucket", le="0.0025") == 1   # the 2 ms wait
    assert _value(s, "vidray_data_wait_seconds_bucket", le="1.0") == 1
    assert _value(s, "vidray_data_wait_seconds_bucket", le="2.5") == 2      # the 2 s wait
    assert _value(s, "vidray_data_wait_seconds_bucket", le="+Inf") == 2
    assert _value(s, "vidray_train_step_seconds_count") == 2
    assert _value(s, "vidray_train_step_seconds_sum") == pytest.approx(2.8)
    assert _value(s, "vidray_cache_hits_total", tier="warm") == 5
    assert _value(s, "vidray_cache_misses_total", tier="warm") == 1
    assert _value(s, "vidray_cache_hits_total", tier="hot") == 5
    assert _value(s, "vidray_cache_misses_total", tier="hot") == 0
    assert _value(s, "vidray_data_fetched_bytes_total") == 1_000_024
    assert _value(s, "vidray_samples_skipped_total", kind="clip") == 1
    assert _value(s, "vidray_samples_skipped_total", kind="shard") == 2
    assert _value(s, "vidray_prefetch_lead_batches") == 4
    assert _value(s, "vidray_train_step") == 2
    assert _value(s, "vidray_train_samples_total") == 5
    assert _value(s, "vidray_train_loss") == 0.25
    assert _value(s, "vidray_train_lr") == 1e-4
    assert _value(s, "vidray_data_wait_fraction") == 0.71


def test_every_series_is_vidray_prefixed_and_labelled_with_rank_and_run(metrics):
    families = list(text_string_to_metric_families(generate_latest(metrics.registry).decode()))

    names = {f.name for f in families}
    expected = {"vidray_data_wait_seconds", "vidray_train_step_seconds", "vidray_cache_hits", "vidray_cache_misses",
                "vidray_data_fetched_bytes", "vidray_samples_skipped", "vidray_prefetch_lead_batches",
                "vidray_train_step", "vidray_stage_busy_seconds", "vidray_stage_clips", "vidray_train_loss",
                "vidray_train_lr", "vidray_data_wait_fraction", "vidray_train_samples"}
    assert expected <= names
    assert all(n.removesuffix("_created") in expected for n in names)   # prometheus-client's creation timestamps
    for family in families:
        for sample in family.samples:
            assert {"rank": "1", "run": "tiny-t2v"}.items() <= sample.labels.items(), sample


def test_summary_reports_totals_and_data_wait_fraction(metrics):
    assert metrics.summary()["data_wait_fraction"] == 0.0   # no step yet: defined, not a division by zero
    metrics.observe_step(data_wait_s=0.1, step_s=1.0)
    metrics.observe_step(data_wait_s=0.3, step_s=1.0)
    metrics.add_cache("hot", hits=7, misses=2)
    metrics.add_cache("warm", misses=1)
    metrics.add_bytes_fetched(4096)
    metrics.add_skipped("shard")
    metrics.set_prefetch_lead(3)

    summary = metrics.summary()

    stages = {f"{stage}_{k}": 0.0 for stage in ("decode", "vae", "text", "dit")
              for k in ("busy_s", "busy_in_window_s", "clips", "busy_fraction")}
    assert summary["wall_s"] > 0.0
    del summary["wall_s"]  # wall clock since the object was made
    assert summary == pytest.approx({
        "data_wait_s": 0.4, "data_wait_fraction": 0.2, "step_s": 2.0, "steps": 2, "hot_hits": 7, "hot_misses": 2,
        "warm_hits": 0, "warm_misses": 1, "latent_hits": 0, "latent_misses": 0, "prompt_hits": 0,
        "prompt_misses": 0, "bytes_fetched": 4096, "prefetch_lead": 3, "skipped_clips": 0, "skipped_shards": 1,
        **stages})
    assert all(isinstance(v, float) for v in summary.values())


def test_window_summary_resets_each_window_while_totals_keep_counting(metrics):
    metrics.observe_step(data_wait_s=0.5, step_s=1.0)
    metrics.add_cache("warm", hits=2)
    metrics.add_bytes_fetched(100)
    metrics.set_prefetch_lead(2)

    first = metrics.window_summary()
    metrics.observe_step(data_wait_s=0.1, step_s=1.0)
    metrics.add_cache("warm", hits=1, misses=1)
    metrics.add_skipped("clip", 3)
    second = metrics.window_summary()
    third = metrics.window_summary()

    assert (first["data_wait_s"], first["data_wait_fraction"], first["warm_hits"], first["bytes_fetched"]) == \
        pytest.approx((0.5, 0.5, 2, 100))
    assert (second["data_wait_s"], second["data_wait_fraction"], second["warm_hits"], second["warm_misses"],
            second["bytes_fetched"], second["skipped_clips"], second["steps"]) == \
        pytest.approx((0.1, 0.1, 1, 1, 0, 3, 1))
    assert third["steps"] == 0 and third["data_wait_fraction"] == 0.0 and third["warm_hits"] == 0
    assert third["prefetch_lead"] == 2   # a gauge: the current value, not a difference
    total = metrics.summary()
    assert (total["data_wait_s"], total["warm_hits"], total["skipped_clips"], total["steps"]) == \
        pytest.approx((0.6, 3, 3, 2))
    assert total.keys() == first.keys()


def test_serve_answers_on_loopback_only_and_close_frees_the_port(metrics):
    metrics.observe_step(data_wait_s=0.01, step_s=0.2)
    port = metrics.serve(0)
    assert port > 0
    assert metrics._server.server_address[0] == "127.0.0.1"

    s = _samples(_scrape(port))
    assert _value(s, "vidray_train_step_seconds_count") == 1
    external = _external_ipv4()
    if external is not None:   # a socket bound to 127.0.0.1 refuses the machine's other addresses
        with pytest.raises(urllib.error.URLError):
            _scrape(port, host=external)
    with pytest.raises(RuntimeError, match="already served"):
        metrics.serve(0)

    metrics.close()
    metrics.close()   # idempotent
    with pytest.raises(urllib.error.URLError):
        _scrape(port)
    again = TrainMetrics(rank=1, run="tiny-t2v")
    try:
        assert again.serve(port) == port   # the port is free again
        assert _value(_samples(_scrape(port)), "vidray_train_step_seconds_count") == 0
    finally:
        again.close()


def test_serve_on_a_taken_port_names_the_config_key(metrics):
    with socket.socket() as holder:
        holder.bind(("127.0.0.1", 0))
        holder.listen()
        with pytest.raises(UserError, match=r"train\.metrics_port"):
            metrics.serve(holder.getsockname()[1])


def test_write_textfile_leaves_one_parseable_file_and_no_temp_file(metrics, tmp_path: Path):
    path = tmp_path / "metrics" / "rank_1.prom"   # the folder does not exist yet
    metrics.add_bytes_fetched(512)
    metrics.write_textfile(path)
    metrics.add_bytes_fetched(512)
    metrics.write_textfile(path)   # replaces the file

    assert [p.name for p in path.parent.iterdir()] == ["rank_1.prom"]
    assert _value(_samples(path.read_text()), "vidray_data_fetched_bytes_total") == 1024


@pytest.mark.parametrize(("call", "message"), [
    (lambda m: m.add_cache("cold", hits=1), r"unknown cache tier 'cold'; valid: hot, warm"),
    (lambda m: m.add_skipped("batch"), r"unknown skip kind 'batch'; valid: clip, shard"),
    (lambda m: m.add_cache("hot", hits=-1), r"hits must be an int >= 0, got -1"),
    (lambda m: m.add_bytes_fetched(-5), r"n must be an int >= 0, got -5"),
    (lambda m: m.observe_step(data_wait_s=-0.1, step_s=1.0), r"data_wait_s must be a finite number"),
    (lambda m: m.observe_step(data_wait_s=0.1, step_s=float("nan")), r"step_s must be a finite number"),
    (lambda m: m.observe_step(data_wait_s=0.1, step_s=1.0, samples=-1), r"samples must be an int >= 0, got -1"),
    (lambda m: m.observe_window(loss=float("inf"), lr=1e-4, data_wait_fraction=0.1), r"loss must be finite"),
    (lambda m: m.observe_window(loss=0.1, lr=1e-4, data_wait_fraction=1.5), r"data_wait_fraction must be in"),
])
def test_invalid_input_raises_value_error_naming_the_valid_values(metrics, call, message):
    with pytest.raises(ValueError, match=message):
        call(metrics)
    assert metrics.summary()["steps"] == 0


def test_two_ranks_in_one_registry_is_refused_but_separate_objects_are_independent():
    registry = CollectorRegistry()
    TrainMetrics(rank=0, run="r", registry=registry)
    with pytest.raises(ValueError, match="Duplicated timeseries"):
        TrainMetrics(rank=1, run="r", registry=registry)
    a, b = TrainMetrics(rank=0, run="r"), TrainMetrics(rank=1, run="r")
    a.add_cache("hot", hits=1)
    assert (a.summary()["hot_hits"], b.summary()["hot_hits"]) == (1.0, 0.0)


class Clock:
    """Wall-clock seconds that a test sets (`TrainMetrics(clock=)`), standing for `time.time`."""

    def __init__(self, now: float = 1000.0):
        self.now = now

    def __call__(self) -> float:
        return self.now


def test_stage_busy_seconds_give_busy_fractions_and_counters():
    clock = Clock()
    metrics = TrainMetrics(rank=1, run="tiny-t2v", clock=clock)
    clock.now += 2.0
    metrics.observe_step(data_wait_s=0.0, step_s=2.0)
    metrics.add_stage("vae", busy_s=1.5, clips=4, start=clock.now - 1.75, end=clock.now - 0.25)
    metrics.add_stage("dit", busy_s=0.5, clips=0)  # no span: the trainer's own work, just done
    metrics.add_cache("latent", hits=3, misses=1)
    summary = metrics.summary()
    assert summary["wall_s"] == 2.0
    assert summary["vae_busy_fraction"] == pytest.approx(0.75) and summary["dit_busy_fraction"] == pytest.approx(0.25)
    assert summary["vae_clips"] == 4 and summary["latent_hits"] == 3
    s = _samples(generate_latest(metrics.registry).decode())
    assert _value(s, "vidray_stage_busy_seconds_total", stage="vae") == pytest.approx(1.5)
    assert _value(s, "vidray_stage_clips_total", stage="vae") == 4
    with pytest.raises(ValueError, match="unknown stage 'gpu'"):
        metrics.add_stage("gpu", busy_s=1.0, clips=1)
    with pytest.raises(ValueError, match="busy_s"):
        metrics.add_stage("vae", busy_s=-1.0, clips=1)


def test_ray_series_names_what_ray_exports_for_every_series(metrics):
    """`RAY_SERIES` is what a Prometheus scraping Ray's agent sees: the prometheus-client names with a `ray_`
    prefix (counters `_total`, histograms `_bucket`/`_count`/`_sum`). The Prometheus test in
    tests/integration/test_prometheus.py finds them through a real agent."""
    from vidray.metrics import RAY_SERIES

    local = set()
    for family in text_string_to_metric_families(generate_latest(metrics.registry).decode()):
        local |= {s.name for s in family.samples if not s.name.endswith("_created")}
    assert {f"ray_{n}" for n in local} == set(RAY_SERIES)
    assert RAY_SERIES["ray_vidray_cache_hits_total"] == "counter"
    assert RAY_SERIES["ray_vidray_data_wait_seconds_bucket"] == "histogram"
    assert RAY_SERIES["ray_vidray_train_loss"] == "gauge"


def test_prefetched_work_counts_only_inside_the_window_that_receives_it():
    """A stage that ran ahead (prefetch) delivers, in a short window, work mostly done before the window opened:
    only the overlap with the window counts, so one stage actor is never busy more than 100 % of a window."""
    clock = Clock(1000.0)
    metrics = TrainMetrics(rank=0, run="r", clock=clock)
    clock.now = 1010.0
    metrics.window_summary()                      # the window [1010, 1012] opens
    clock.now = 1012.0
    # Four micro-batches decoded back to back over [1004, 1012], all delivered in this window: 6 s of their 8 s
    # were worked before it opened. The vae stage encoded one wholly before it opened, delivered only now.
    for start in (1004.0, 1006.0, 1008.0, 1010.0):
        metrics.add_stage("decode", busy_s=2.0, clips=2, start=start, end=start + 2.0)
    metrics.add_stage("vae", busy_s=1.5, clips=2, start=1007.0, end=1008.5)
    window = metrics.window_summary()
    assert window["wall_s"] == 2.0
    assert window["decode_busy_s"] == 8.0          # the seconds worked, whenever (Prometheus' counter takes them)
    assert window["decode_busy_in_window_s"] == 2.0  # [1010, 1012] of the last batch only
    assert window["decode_busy_fraction"] == 1.0   # was 8 s / 2 s = 400 % when counted where received
    assert window["vae_busy_fraction"] == 0.0
    assert metrics.registry.get_sample_value("vidray_stage_busy_seconds_total",
                                             {"rank": "0", "run": "r", "stage": "decode"}) == 8.0

    # A span straddling the window's start: its part inside [1012, 1016] counts, 3 s of 4 s.
    clock.now = 1016.0
    metrics.add_stage("decode", busy_s=4.0, clips=2, start=1011.0, end=1015.0)
    window = metrics.window_summary()
    assert window["decode_busy_in_window_s"] == 3.0 and window["decode_busy_fraction"] == pytest.approx(0.75)
    total = metrics.summary()  # the run: 5 s in-window over 16 s of wall time, never above 1
    assert total["wall_s"] == 16.0 and total["decode_busy_fraction"] == pytest.approx(5.0 / 16.0)
    with pytest.raises(ValueError, match="start and end"):
        metrics.add_stage("decode", busy_s=1.0, clips=1, start=1016.0, end=1015.0)


def test_the_loop_hands_the_stages_timestamps_from_the_batch_to_the_window():
    """`vidray.train.loop._add_loader_stats` with a micro-batch as the loader and the encode stage leave it: the
    spans in its stats (DECODE_SPAN_KEYS, ENCODE_SPAN_KEYS) are what the window clips."""
    from vidray.buckets import Bucket
    from vidray.data.encode import ENCODE_STAT_KEYS
    from vidray.data.pipeline import STAT_KEYS, TrainBatch
    from vidray.train.loop import _add_loader_stats

    clock = Clock(2000.0)
    metrics = TrainMetrics(rank=0, run="r", clock=clock)
    clock.now = 2004.0
    stats = {**dict.fromkeys(STAT_KEYS, 0.0), **dict.fromkeys(ENCODE_STAT_KEYS, 0.0), "hot_misses": 2.0,
             "decode_s": 3.0, "decode_start_unix": 1999.0, "decode_end_unix": 2002.0,  # 2 s inside [2000, 2004]
             "vae_s": 1.0, "vae_misses": 2.0, "vae_start_unix": 2002.0, "vae_end_unix": 2003.0,
             "text_s": 0.5, "text_misses": 2.0, "text_start_unix": 1998.0, "text_end_unix": 1998.5}  # before it
    batch = TrainBatch(step=1, epoch=0, bucket=Bucket(9, 64, 64), frames=None, captions=["a", "b"],
                       sample_ids=["x", "y"], sample_keys=np.arange(2), weights=np.ones(2, np.float32),
                       total_weight=2.0, next_position=None, stats=stats)
    _add_loader_stats(metrics, batch)
    window = metrics.window_summary()
    assert window["wall_s"] == 4.0
    assert (window["decode_busy_fraction"], window["vae_busy_fraction"], window["text_busy_fraction"]) == \
        pytest.approx((0.5, 0.25, 0.0))
    assert (window["decode_busy_s"], window["text_busy_s"]) == (3.0, 0.5)
