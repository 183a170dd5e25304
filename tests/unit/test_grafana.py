"""The Grafana dashboard (`observability/grafana/`): the committed JSON is what the generator writes, every panel
has a title, a unit and queries that read only the series vidray and Ray Serve export, and the dashboard has what
Grafana needs to load it. `metric_names`, which those checks rest on, on tricky PromQL."""

from __future__ import annotations

import importlib.util
import json
import re
import shutil
import subprocess
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
GENERATOR = REPO / "observability" / "grafana" / "dashboard.py"


def _load_generator():
    spec = importlib.util.spec_from_file_location("vidray_grafana_dashboard", GENERATOR)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


grafana = _load_generator()
COMMITTED = json.loads(grafana.OUTPUT.read_text())

GRAFANA_UNITS = {"none", "short", "sci", "percentunit", "s", "ms", "bytes", "Bps", "reqps", "cps", "ops"}
"""Unit ids of Grafana's own (packages/grafana-data/src/valueFormats/categories.ts); `count:<symbol>` and
`suffix:<symbol>` are its custom units (valueFormats.ts, getValueFormat)."""


def _panels(dashboard: dict) -> list[dict]:
    return [p for p in dashboard["panels"] if p["type"] != "row"]


def test_the_committed_dashboard_is_what_the_generator_writes():
    pytest.importorskip("grafana_foundation_sdk", reason="the `dev` extra's grafana-foundation-sdk builds it")
    assert grafana.OUTPUT.read_text() == grafana.render(), (
        f"{grafana.OUTPUT.relative_to(REPO)} is out of date with observability/grafana/dashboard.py: run "
        f"`{grafana.COMMAND}` and commit the result")


def test_every_panel_has_a_title_a_unit_and_queries_of_known_series_only():
    known = grafana.queryable_names()
    panels = _panels(COMMITTED)
    assert len(panels) >= 20
    for panel in panels:
        title = panel.get("title")
        assert title, f"a panel without a title: {panel}"
        unit = panel.get("fieldConfig", {}).get("defaults", {}).get("unit")
        assert unit in GRAFANA_UNITS or re.fullmatch(r"(count|suffix):\S.*", unit or ""), (title, unit)
        exprs = [t.get("expr") for t in panel.get("targets") or []]
        assert exprs and all(exprs), f"panel {title!r} has no query"
        for expr in exprs:
            names = grafana.metric_names(expr)
            assert names, f"panel {title!r}: {expr!r} reads no series"
            assert names <= known, (f"panel {title!r} reads {sorted(names - known)}, not in SERIES (histograms: "
                                    f"_bucket and _count only): {expr}")


def test_every_series_is_on_the_dashboard():
    used = set().union(*(grafana.metric_names(expr) for _, expr in grafana.panel_queries(COMMITTED)))
    for name, kind in grafana.SERIES.items():
        forms = {f"{name}_bucket", f"{name}_count"} if kind == "histogram" else {name}
        assert used & forms, f"{name} ({kind}) is in SERIES but no panel reads it"


def test_the_issue_asks_for_these_panels():
    titles = " | ".join(p["title"] for p in _panels(COMMITTED)).lower()
    for wanted in ("loss", "step time", "samples/s", "data wait fraction", "cache hit", "bytes fetched",
                   "prefetch lead", "busy fraction", "queue", "http requests", "latency p50 / p95 / p99",
                   "batch size", "queue depth", "jobs by state"):
        assert wanted in titles, f"no panel for {wanted!r}"


def test_the_dashboard_has_what_grafana_needs_to_load_it():
    d = COMMITTED
    assert d["uid"] == "vidray" and d["title"] and isinstance(d["schemaVersion"], int) and d["schemaVersion"] >= 30
    assert d["annotations"] == {"list": []} and d["time"] == {"from": "now-1h", "to": "now"}
    variables = {v["name"]: v for v in d["templating"]["list"]}
    assert len(variables) == len(d["templating"]["list"]), "two variables with one name"
    assert all(v.get("id") in (None, v["name"]) for v in variables.values()), "Grafana 10 keys variables by id"
    assert variables["datasource"]["type"] == "datasource" and variables["datasource"]["query"] == "prometheus"
    for name in ("run", "node"):
        assert variables[name]["type"] == "query" and variables[name]["datasource"]["uid"] == "${datasource}"
        assert variables[name]["includeAll"] and variables[name]["allValue"] == ".*"
    assert variables["run"]["query"] == "label_values(ray_vidray_train_step, run)"

    ids = [p["id"] for p in d["panels"]]
    assert len(set(ids)) == len(ids) and all(isinstance(i, int) and i > 0 for i in ids), ids
    rows = [p["title"] for p in d["panels"] if p["type"] == "row"]
    assert rows == ["Training", "Data", "Stages", "Serving"]
    cells = set()
    for panel in d["panels"]:
        pos = panel["gridPos"]
        assert pos["w"] > 0 and pos["h"] > 0 and pos["x"] + pos["w"] <= 24, (panel["title"], pos)
        cell = {(x, y) for x in range(pos["x"], pos["x"] + pos["w"]) for y in range(pos["y"], pos["y"] + pos["h"])}
        assert not cell & cells, f"panel {panel['title']!r} overlaps another at {pos}"
        cells |= cell
        if panel["type"] != "row":
            assert panel["datasource"] == {"type": "prometheus", "uid": "${datasource}"}, panel["title"]
            assert [t["refId"] for t in panel["targets"]] == [chr(65 + i) for i in range(len(panel["targets"]))]


def test_panel_queries_substitutes_every_grafana_variable():
    queries = grafana.panel_queries(COMMITTED)
    assert len(queries) == sum(len(p["targets"]) for p in _panels(COMMITTED))
    assert all("$" not in expr for _, expr in queries), [q for q in queries if "$" in q[1]]
    title, expr = next(q for q in queries if q[0] == "Samples/s")
    assert expr == 'sum by (run) (rate(ray_vidray_train_samples_total{run=~".*", node=~".*"}[1m]))'
    assert grafana.panel_queries(COMMITTED, rate_interval="30s")[0][1] == queries[0][1].replace("[1m]", "[30s]")


@pytest.mark.skipif(shutil.which("promtool") is None, reason="Prometheus's promtool is not installed")
def test_every_panel_query_parses_as_promql(tmp_path):
    rules = [{"record": f"vidray:panel:{number}", "expr": expr}
             for number, (_, expr) in enumerate(grafana.panel_queries(COMMITTED))]
    path = tmp_path / "rules.yml"
    path.write_text(json.dumps({"groups": [{"name": "vidray", "rules": rules}]}))  # JSON is YAML
    done = subprocess.run(["promtool", "check", "rules", str(path)], capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, done.stdout + done.stderr


def test_panel_queries_refuses_a_variable_it_cannot_fill():
    dashboard = {"templating": {"list": []},
                 "panels": [{"type": "timeseries", "title": "x", "targets": [{"expr": 'up{job=~"$job"}'}]}]}
    with pytest.raises(ValueError, match=r"unknown Grafana variable \$job"):
        grafana.panel_queries(dashboard)
    dashboard["templating"]["list"] = [{"name": "job", "type": "query", "includeAll": False}]
    with pytest.raises(ValueError, match="no All value"):
        grafana.panel_queries(dashboard)
    dashboard["templating"]["list"] = [{"name": "job", "type": "query", "includeAll": True, "allValue": ".+"}]
    collapsed = {"type": "row", "title": "r", "panels": dashboard["panels"]}
    assert grafana.panel_queries({**dashboard, "panels": [collapsed]}) == [("x", 'up{job=~".+"}')]


@pytest.mark.parametrize("expr,names", [
    ('histogram_quantile(0.95, sum by (le, run) (rate(ray_vidray_train_step_seconds_bucket{run=~"$run"}'
     '[$__rate_interval])))', {"ray_vidray_train_step_seconds_bucket"}),
    ("sum(rate(a_total[5m])) by (le) / on(instance) group_left(node, rank) b", {"a_total", "b"}),
    ("sum without (instance) (x) > bool 0.5 and y offset -5m unless z @ 1609746000 or w @ start()",
     {"x", "y", "z", "w"}),
    ("SUM BY (le) (x) AND Y", {"x", "Y"}),  # keywords are case-insensitive, names are not
    ("rate(rate[5m])", {"rate"}),  # a function's name is a series name when no '(' follows
    ("count_values(\"le\", foo) + topk(3, bar) + quantile(0.9, baz)", {"foo", "bar", "baz"}),
    ('label_replace(up, "dst", "rate(x) by (y)", "src", "(.*)")', {"up"}),
    ("1e-3 * NaN + Inf + -inf + 0x1F + .5 + foo[1h30m:5m] + job:foo:rate5m", {"foo", "job:foo:rate5m"}),
    ('foo{a="b\\"c{d}", e=~\'f}\', g!=`h"}`} # rate(bar)\n + baz', {"foo", "baz"}),
    ('{__name__="ray_x", le="+Inf"} / {"ray.y", "le"="0.5"}', {"ray_x", "ray.y"}),
    ("max_over_time(sum by (run) (rate(c_total[1m]))[10m:30s]) / ignoring (tier) d", {"c_total", "d"}),
    ('absent(nonexistent{job="myjob"}) or vector(1) > $threshold', {"nonexistent"}),
    ("histogram_quantile(0.9,\n  sum by (le)\n  (rate(h_bucket[${__rate_interval}])))", {"h_bucket"}),
])
def test_metric_names_finds_the_series_and_nothing_else(expr, names):
    assert grafana.metric_names(expr) == names


@pytest.mark.parametrize("expr,error", [
    ('foo{a="b', "unterminated string"),
    ('foo{a="b"', "unterminated '{'"),
    ("foo[5m", "unterminated '\\['"),
    ('{__name__=~"ray_.*"}', "cannot be checked"),
    ("foo{a}", "without a matcher"),
])
def test_metric_names_refuses_what_it_cannot_read(expr, error):
    with pytest.raises(ValueError, match=error):
        grafana.metric_names(expr)


def test_histogram_sums_are_not_queryable():
    known = grafana.queryable_names()
    assert "ray_vidray_train_step_seconds_bucket" in known and "ray_vidray_train_step_seconds_count" in known
    assert not any(name.endswith("_sum") for name in known)


def test_the_dashboards_training_series_are_those_vidray_exports():
    """SERIES's training series are `vidray.metrics.RAY_SERIES` (what the workers record through Ray's agent):
    a renamed or dropped series breaks the dashboard here, not in a user's Grafana."""
    from vidray.metrics import RAY_SERIES

    on_dashboard = {n for n in grafana.queryable_names() if not n.startswith(("ray_vidray_serve_", "ray_serve_"))}
    exported = {n for n in RAY_SERIES if not n.endswith("_sum")}
    assert on_dashboard == exported, (sorted(on_dashboard - exported), sorted(exported - on_dashboard))
