"""vidray's Grafana dashboard, generated with grafana-foundation-sdk: `python observability/grafana/dashboard.py`
rewrites `vidray.json` beside this file (`tests/unit/test_grafana.py` fails while the two differ).

```python
dashboard = build_dashboard()                 # the dashboard JSON as a dict (needs grafana-foundation-sdk)
for title, expr in panel_queries(dashboard):   # every panel's PromQL, Grafana variables substituted
    assert metric_names(expr) <= queryable_names()
```

Rows: train, data, stages, serve. Every query reads only the series in `SERIES`, as Ray's metrics agent exports
them (a `ray_` prefix, counters ending in `_total`). The data source is the dashboard variable `datasource` (any
Prometheus data source, as in Ray's own dashboards); `run` and `node` filter the training, data and stage panels.
MFU is not exported by vidray, so no panel shows it.

Only the builders need the SDK; `SERIES`, `queryable_names`, `metric_names` and `panel_queries` are plain Python
(the lead's integration test imports this file to send every panel's query to a real Prometheus).
"""

from __future__ import annotations

import json
import re
import sys
from pathlib import Path
from typing import Literal

__all__ = ["SERIES", "queryable_names", "build_dashboard", "render", "panel_queries", "metric_names"]

OUTPUT = Path(__file__).resolve().parent / "vidray.json"
COMMAND = "python observability/grafana/dashboard.py"
"""The command that rewrites `OUTPUT` (run from the repository root)."""

SeriesType = Literal["counter", "gauge", "histogram"]

SERIES: dict[str, SeriesType] = {
    # Training (vidray.metrics), labels run, rank, node.
    "ray_vidray_train_step": "gauge",  # steps
    "ray_vidray_train_loss": "gauge",
    "ray_vidray_train_lr": "gauge",
    "ray_vidray_train_samples_total": "counter",  # samples; rate(): samples/s
    "ray_vidray_train_step_seconds": "histogram",  # s
    "ray_vidray_data_wait_seconds": "histogram",  # s
    "ray_vidray_data_wait_fraction": "gauge",  # 0..1, over the last log window
    "ray_vidray_cache_hits_total": "counter",  # + tier (hot, warm, latent, prompt)
    "ray_vidray_cache_misses_total": "counter",  # + tier
    "ray_vidray_data_fetched_bytes_total": "counter",  # bytes
    "ray_vidray_samples_skipped_total": "counter",  # + kind (clip, shard)
    "ray_vidray_prefetch_lead_batches": "gauge",  # batches
    "ray_vidray_stage_busy_seconds_total": "counter",  # + stage (decode, vae, text, dit); rate(): busy fraction
    "ray_vidray_stage_clips_total": "counter",  # + stage
    # Serving (vidray.serve.metrics), labels deployment, replica, application.
    "ray_vidray_serve_denoise_step_seconds": "histogram",  # s
    "ray_vidray_serve_denoise_batch_size": "histogram",  # requests
    "ray_vidray_serve_denoise_steps_total": "counter",
    "ray_vidray_serve_denoise_items_stepped_total": "counter",  # requests x steps
    "ray_vidray_serve_denoise_busy_seconds_total": "counter",  # s
    "ray_vidray_serve_denoise_queue_depth": "gauge",  # requests
    "ray_vidray_serve_denoise_running": "gauge",  # requests
    "ray_vidray_serve_policy_batch_size": "gauge",  # requests
    "ray_vidray_serve_policy_wait_seconds": "gauge",  # s
    "ray_vidray_serve_transfer_seconds": "histogram",  # s
    "ray_vidray_serve_denoise_requests_total": "counter",  # + outcome
    "ray_vidray_serve_jobs_total": "counter",  # + outcome
    "ray_vidray_serve_job_seconds": "histogram",  # s
    "ray_vidray_serve_store_jobs": "gauge",  # + status
    "ray_vidray_serve_http_errors_total": "counter",  # + status, code
    # Ray Serve's own.
    "ray_serve_num_http_requests_total": "counter",  # + route, method, application, status_code
    "ray_serve_http_request_latency_ms": "histogram",  # ms
}
"""Every series the dashboard may read, as exported by Ray's metrics agent: name -> Prometheus type. A histogram
is listed by its base name and is exported as `<name>_bucket`, `<name>_count` and `<name>_sum`."""


def queryable_names() -> set[str]:
    """The series names a query may use: `SERIES`' counters and gauges, and each histogram's `_bucket` (for
    `histogram_quantile`) and `_count` (for rates). `_sum` is left out on purpose: Ray 2.60 exports it estimated
    from the bucket midpoints (`ray/_private/telemetry/open_telemetry_metric_recorder.py`), not the observed sum."""
    names = set()
    for name, kind in SERIES.items():
        if kind == "histogram":
            names |= {f"{name}_bucket", f"{name}_count"}
        elif kind in ("counter", "gauge"):
            names.add(name)
        else:
            raise ValueError(f"SERIES[{name!r}] is {kind!r}; valid: counter, gauge, histogram")
    return names


# --- the dashboard -------------------------------------------------------------------------------------------

TRAIN = 'run=~"$run", node=~"$node"'
"""The label matchers of every training, data and stage query: the runs and nodes picked in the variables."""
HTTP = 'route!~"/-/.*"'
"""Ray Serve's HTTP series without its health and routes probes (`/-/healthz`, `/-/routes`), as Ray's dashboard."""
RATE = "$__rate_interval"
"""The window of every rate(): Grafana's rate interval (at least 4 scrape intervals of the data source)."""


def _quantiles(series: str, by: str, matchers: str = "", qs: tuple[float, ...] = (0.5, 0.95)) -> list[tuple[str, str]]:
    """(expr, legend) of `histogram_quantile(q, ...)` over `series`' buckets, per `by` group, for each q in `qs`."""
    selector = f"{series}_bucket{{{matchers}}}" if matchers else f"{series}_bucket"
    legend = " ".join(f"{{{{{label.strip()}}}}}" for label in by.split(",") if label.strip())
    return [(f"histogram_quantile({q}, sum by ({by}, le) (rate({selector}[{RATE}])))",
             f"{legend} p{round(q * 100)}".strip()) for q in qs]


def _panels() -> dict[str, list[dict]]:
    """The panels of each row: title, unit (a Grafana unit id), targets [(expr, legend)], optional description,
    min and max. Plain data, so that the layout and the queries read top to bottom."""
    train = [
        dict(title="Loss", unit="none", targets=[(f"ray_vidray_train_loss{{{TRAIN}}}", "{{run}} rank {{rank}}")]),
        dict(title="Learning rate", unit="sci",
             targets=[(f"max by (run) (ray_vidray_train_lr{{{TRAIN}}})", "{{run}}")]),
        dict(title="Optimizer step", unit="short",
             targets=[(f"max by (run) (ray_vidray_train_step{{{TRAIN}}})", "{{run}}")]),
        dict(title="Step time p50 / p95", unit="s",
             description="Wall time of one optimizer step, data wait included, over all ranks of the run.",
             targets=_quantiles("ray_vidray_train_step_seconds", "run", TRAIN)),
        dict(title="Samples/s", unit="count:samples/s",
             targets=[(f"sum by (run) (rate(ray_vidray_train_samples_total{{{TRAIN}}}[{RATE}]))", "{{run}}")]),
        dict(title="Steps/s", unit="count:steps/s", description="Optimizer steps per second (every rank steps).",
             targets=[(f"avg by (run) (rate(ray_vidray_train_step_seconds_count{{{TRAIN}}}[{RATE}]))", "{{run}}")]),
    ]
    data = [
        dict(title="Data wait fraction", unit="percentunit", min=0, max=1,
             description="Share of the step time the trainer waited for its next batch, over the last log window.",
             targets=[(f"ray_vidray_data_wait_fraction{{{TRAIN}}}", "{{run}} rank {{rank}}")]),
        dict(title="Data wait p50 / p95", unit="s",
             targets=_quantiles("ray_vidray_data_wait_seconds", "run", TRAIN)),
        dict(title="Cache hit ratio by tier", unit="percentunit", min=0, max=1,
             description="hot: decoded clips in memory; warm: shards on the node's disk; latent, prompt: the latent "
                         "cache (a miss is an encode).",
             targets=[(f"sum by (run, tier) (rate(ray_vidray_cache_hits_total{{{TRAIN}}}[{RATE}])) / "
                       f"(sum by (run, tier) (rate(ray_vidray_cache_hits_total{{{TRAIN}}}[{RATE}])) + "
                       f"sum by (run, tier) (rate(ray_vidray_cache_misses_total{{{TRAIN}}}[{RATE}])))",
                       "{{run}} {{tier}}")]),
        dict(title="Cache hits and misses by tier", unit="count:lookups/s",
             targets=[(f"sum by (run, tier) (rate(ray_vidray_cache_hits_total{{{TRAIN}}}[{RATE}]))",
                       "{{run}} {{tier}} hits"),
                      (f"sum by (run, tier) (rate(ray_vidray_cache_misses_total{{{TRAIN}}}[{RATE}]))",
                       "{{run}} {{tier}} misses")]),
        dict(title="Bytes fetched from the cold store", unit="Bps",
             targets=[(f"sum by (run) (rate(ray_vidray_data_fetched_bytes_total{{{TRAIN}}}[{RATE}]))", "{{run}}")]),
        dict(title="Prefetch lead", unit="count:batches",
             description="Batches ready ahead of each trainer; 0: the trainer waits.",
             targets=[(f"ray_vidray_prefetch_lead_batches{{{TRAIN}}}", "{{run}} rank {{rank}}")]),
        dict(title="Samples skipped", unit="cps",
             description="Bad input skipped: clips that do not decode, shards that failed their checksum or fetch.",
             targets=[(f"sum by (run, kind) (rate(ray_vidray_samples_skipped_total{{{TRAIN}}}[{RATE}]))",
                       "{{run}} {{kind}}")]),
    ]
    stages = [
        dict(title="Stage busy fraction (mean over ranks)", unit="percentunit", min=0,
             description="Seconds each stage worked per second of wall time: the stage nearest 1 is the bottleneck.",
             targets=[(f"avg by (run, stage) (rate(ray_vidray_stage_busy_seconds_total{{{TRAIN}}}[{RATE}]))",
                       "{{run}} {{stage}}")]),
        dict(title="Stage throughput", unit="count:clips/s",
             targets=[(f"sum by (run, stage) (rate(ray_vidray_stage_clips_total{{{TRAIN}}}[{RATE}]))",
                       "{{run}} {{stage}}")]),
        dict(title="Queue ahead of the trainer (fewest over ranks)", unit="count:batches",
             description="The prefetch lead of the rank closest to waiting: 0 means the stages do not keep up.",
             targets=[(f"min by (run) (ray_vidray_prefetch_lead_batches{{{TRAIN}}})", "{{run}}")]),
    ]
    serve = [
        dict(title="HTTP requests/s", unit="reqps",
             targets=[(f"sum by (application, route) (rate(ray_serve_num_http_requests_total{{{HTTP}}}[{RATE}]))",
                       "{{application}} {{route}}")]),
        dict(title="HTTP latency p50 / p95 / p99", unit="ms",
             targets=_quantiles("ray_serve_http_request_latency_ms", "application", HTTP, (0.5, 0.95, 0.99))),
        dict(title="API errors by status and code", unit="reqps",
             targets=[(f"sum by (status, code) (rate(ray_vidray_serve_http_errors_total[{RATE}]))",
                       "{{status}} {{code}}")]),
        dict(title="Denoise batch size", unit="count:requests",
             description="Requests per denoising step: the mean, the p95, and the batch policy's target.",
             targets=[(f"sum by (deployment) (rate(ray_vidray_serve_denoise_items_stepped_total[{RATE}])) / "
                       f"sum by (deployment) (rate(ray_vidray_serve_denoise_steps_total[{RATE}]))",
                       "{{deployment}} mean"),
                      *_quantiles("ray_vidray_serve_denoise_batch_size", "deployment", qs=(0.95,)),
                      ("max by (deployment) (ray_vidray_serve_policy_batch_size)", "{{deployment}} policy")]),
        dict(title="Denoiser queue depth and running batch", unit="count:requests",
             targets=[("sum by (deployment) (ray_vidray_serve_denoise_queue_depth)", "{{deployment}} queued"),
                      ("sum by (deployment) (ray_vidray_serve_denoise_running)", "{{deployment}} running")]),
        dict(title="Denoiser busy fraction (mean over replicas)", unit="percentunit", min=0,
             targets=[(f"avg by (deployment) (rate(ray_vidray_serve_denoise_busy_seconds_total[{RATE}]))",
                       "{{deployment}}")]),
        dict(title="Denoising step time p50 / p95", unit="s",
             targets=_quantiles("ray_vidray_serve_denoise_step_seconds", "deployment")),
        dict(title="Transfer time p50 / p95 and policy wait", unit="s",
             description="From the caller's send to arrival at the Denoiser, and how long a fresh batch may wait.",
             targets=[*_quantiles("ray_vidray_serve_transfer_seconds", "deployment"),
                      ("max by (deployment) (ray_vidray_serve_policy_wait_seconds)", "{{deployment}} policy wait")]),
        dict(title="Jobs by state", unit="count:jobs",
             description="Jobs in the store (every ingress replica reports the same store: the max, not the sum).",
             targets=[("max by (status) (ray_vidray_serve_store_jobs)", "{{status}}")]),
        dict(title="Jobs finished by outcome", unit="count:jobs/s",
             targets=[(f"sum by (outcome) (rate(ray_vidray_serve_jobs_total[{RATE}]))", "{{outcome}}")]),
        dict(title="Denoise requests by outcome", unit="reqps",
             targets=[(f"sum by (outcome) (rate(ray_vidray_serve_denoise_requests_total[{RATE}]))", "{{outcome}}")]),
        dict(title="Job time p50 / p95 (POST to mp4)", unit="s",
             targets=_quantiles("ray_vidray_serve_job_seconds", "application")),
    ]
    return {"Training": train, "Data": data, "Stages": stages, "Serving": serve}


def build_dashboard() -> dict:
    """The dashboard as Grafana's JSON model (a dict). Imports grafana-foundation-sdk (the `dev` extra)."""
    from grafana_foundation_sdk.builders import common as common_builders
    from grafana_foundation_sdk.builders.dashboard import Dashboard, DatasourceVariable, QueryVariable, Row
    from grafana_foundation_sdk.builders.prometheus import Dataquery
    from grafana_foundation_sdk.builders.timeseries import Panel as Timeseries
    from grafana_foundation_sdk.cog.encoder import JSONEncoder
    from grafana_foundation_sdk.models.common import LegendDisplayMode, LegendPlacement, SortOrder, TooltipDisplayMode
    from grafana_foundation_sdk.models.dashboard import (DashboardCursorSync, DataSourceRef, VariableRefresh,
                                                         VariableSort)

    # 1. The data source is a variable: any Prometheus data source of the Grafana it is loaded into. Each variable's
    #    id is its name, as Grafana 10 keys its variables on load (the SDK's default id is one zero UUID for all).
    datasource = DataSourceRef(type_val="prometheus", uid="${datasource}")

    def label_variable(name: str, query: str, description: str) -> QueryVariable:
        return (QueryVariable(name).id(name).label(name).description(description).datasource(datasource).query(query)
                .refresh(VariableRefresh.ON_TIME_RANGE_CHANGED).sort(VariableSort.ALPHABETICAL_ASC)
                .multi(True).include_all(True).all_value(".*"))

    builder = (
        Dashboard("vidray")
        .uid("vidray")
        .description("vidray training, data pipeline, stages and serving (Ray metrics agent series). MFU is not "
                     "exported and not shown.")
        .tags(["vidray", "ray"])
        .editable()
        .tooltip(DashboardCursorSync.CROSSHAIR)
        .time("now-1h", "now")
        .refresh("30s")
        .annotations([])
        .with_variable(DatasourceVariable("datasource").id("datasource").label("Data source").type("prometheus")
                       .description("The Prometheus that scrapes the Ray cluster's metrics agents."))
        # 2. Filters of the training panels.
        .with_variable(label_variable("run", "label_values(ray_vidray_train_step, run)", "Training runs (job names)."))
        .with_variable(label_variable("node", 'label_values(ray_vidray_train_step{run=~"$run"}, node)',
                                      "Nodes the picked runs train on."))
    )

    # 3. One row per plane, its panels after it, two or three to a line.
    next_id = 1
    for row_title, panels in _panels().items():
        builder.with_row(Row(row_title).id(next_id))
        next_id += 1
        width = 8 if len(panels) % 3 == 0 else 12
        for spec in panels:
            panel = (
                Timeseries().id(next_id).title(spec["title"]).unit(spec["unit"]).datasource(datasource)
                .height(8).span(width)
                .legend(common_builders.VizLegendOptions().show_legend(True).display_mode(LegendDisplayMode.LIST)
                        .placement(LegendPlacement.BOTTOM))
                .tooltip(common_builders.VizTooltipOptions().mode(TooltipDisplayMode.MULTI)
                         .sort(SortOrder.DESCENDING))
            )
            if "description" in spec:
                panel.description(spec["description"])
            if "min" in spec:
                panel.min(spec["min"])
            if "max" in spec:
                panel.max(spec["max"])
            for number, (expr, legend) in enumerate(spec["targets"]):
                panel.with_target(Dataquery().expr(expr).legend_format(legend).ref_id(chr(ord("A") + number)))
            builder.with_panel(panel)
            next_id += 1

    return json.loads(JSONEncoder().encode(builder.build()))


def render() -> str:
    """`build_dashboard()` as the text of `vidray.json`: 2-space indent, sorted keys, a final newline."""
    return json.dumps(build_dashboard(), indent=2, sort_keys=True) + "\n"


# --- reading a dashboard's queries ---------------------------------------------------------------------------

_INTERVAL_VARIABLES = ("__rate_interval", "__interval", "__range")
_VARIABLE = re.compile(r"\$(?:\{(\w+)(?::\w+)?\}|(\w+))")


def panel_queries(dashboard: dict, *, rate_interval: str = "1m") -> list[tuple[str, str]]:
    """(panel title, PromQL) of every query of every panel (rows' collapsed panels included), in order, ready to
    send to Prometheus: Grafana's variables substituted.

    - `$__rate_interval`, `$__interval`, `$__range` (also as `${...}`) -> `rate_interval`, a PromQL duration;
    - a query or custom variable of the dashboard (`$run`, `${run}`, `${run:regex}`) -> its "All" value (`allValue`,
      `.*` for `run` and `node`), the value Grafana sends when All is picked. The dashboard uses these variables
      only inside regex matchers (`run=~"$run"`), where `.*` matches every value.

    Raises ValueError on any other `$variable` (a query Grafana would fill in and Prometheus would reject), and on a
    dashboard variable without an "All" value.
    """
    values = {name: rate_interval for name in _INTERVAL_VARIABLES}
    for variable in dashboard.get("templating", {}).get("list", []):
        if variable.get("type") in ("query", "custom"):
            if not variable.get("includeAll") or variable.get("allValue") is None:
                raise ValueError(f"dashboard variable {variable.get('name')!r} has no All value (includeAll and "
                                 f"allValue); panel_queries substitutes that value")
            values[variable["name"]] = variable["allValue"]

    def substitute(match: re.Match) -> str:
        name = match.group(1) or match.group(2)
        if name not in values:
            raise ValueError(f"unknown Grafana variable ${name} in a query; known: {', '.join(sorted(values))}")
        return values[name]

    queries = []
    for panel in _iter_panels(dashboard.get("panels", [])):
        for target in panel.get("targets") or []:
            if target.get("expr"):
                queries.append((panel.get("title", ""), _VARIABLE.sub(substitute, target["expr"])))
    return queries


def _iter_panels(panels: list[dict]):
    """Every panel of `panels` that is not a row, with the panels held inside (collapsed) rows."""
    for panel in panels:
        if panel.get("type") == "row":
            yield from _iter_panels(panel.get("panels") or [])
        else:
            yield panel


_KEYWORDS = frozenset({
    "and", "or", "unless", "atan2", "bool", "offset",
    "sum", "avg", "count", "min", "max", "group", "stddev", "stdvar", "topk", "bottomk", "quantile", "count_values",
    "limitk", "limit_ratio",
})
"""PromQL's keywords and aggregation operators (case-insensitive): never a series name, even with no `(` after."""
_LABEL_LIST_KEYWORDS = frozenset({"by", "without", "on", "ignoring", "group_left", "group_right"})
"""Keywords followed by an optional `(label, ...)` list: what that list holds are label names."""
_NUMBER_WORDS = frozenset({"inf", "nan"})
_IDENT = re.compile(r"[A-Za-z_:][A-Za-z0-9_:]*")
_NUMBER = re.compile(r"0[xX][0-9a-fA-F_]+|(?:[0-9][0-9_]*(?:\.[0-9_]*)?|\.[0-9][0-9_]*)(?:[eE][+-]?[0-9_]+)?"
                     r"[A-Za-z0-9_]*")  # numbers and durations (1e-3, 0x1f, 5m, 1h30m)
_GRAFANA_VARIABLE = re.compile(r"\$(?:\{[^}]*\}|\w+)")
_MATCH_OP = re.compile(r"=~|!~|!=|=")


def metric_names(expr: str) -> set[str]:
    """The series names PromQL `expr` reads: bare metric names (`foo`, `job:foo:rate5m`), `{__name__="foo"}` and
    Prometheus 3's quoted names (`{"foo.bar", job="x"}`).

    Not names: functions (an identifier followed by `(`), keywords and aggregations (`by`, `sum`, `offset`, ...),
    label names in `{...}` and in `by (...)`-style lists, strings, numbers and durations (`Inf`, `5m`), range and
    subquery brackets, comments, and Grafana variables (`$run`, `${__rate_interval}`).

    Raises ValueError on an unterminated string, `{` or `[`, and on a name given by a regex (`{__name__=~"..."}`),
    which no list of names can be checked against.
    """
    names: set[str] = set()
    i, n = 0, len(expr)
    while i < n:
        c = expr[i]
        if c.isspace():
            i += 1
        elif c == "#":
            end = expr.find("\n", i)
            i = n if end < 0 else end + 1
        elif c in "\"'`":
            i = _string_end(expr, i)
        elif c == "{":
            i = _read_matchers(expr, i, names)
        elif c == "[":
            end = expr.find("]", i)
            if end < 0:
                raise ValueError(f"unterminated '[' at {i} in {expr!r}")
            i = end + 1
        elif c == "$":
            match = _GRAFANA_VARIABLE.match(expr, i)
            i = match.end() if match else i + 1
        elif match := _NUMBER.match(expr, i):
            i = match.end()
        elif match := _IDENT.match(expr, i):
            word, i = match.group(), match.end()
            after = _skip_blank(expr, i)
            if word.lower() in _LABEL_LIST_KEYWORDS:
                if after < n and expr[after] == "(":
                    end = expr.find(")", after)
                    if end < 0:
                        raise ValueError(f"unterminated '(' at {after} in {expr!r}")
                    i = end + 1
            elif word.lower() in _KEYWORDS or word.lower() in _NUMBER_WORDS:
                pass
            elif after < n and expr[after] == "(":
                pass  # a function call
            else:
                names.add(word)
        else:
            i += 1  # operators, parentheses, commas, @
    return names


def _skip_blank(expr: str, i: int) -> int:
    """The index of the next character at or after `i` that is neither white space nor in a `#` comment."""
    while i < len(expr):
        if expr[i].isspace():
            i += 1
        elif expr[i] == "#":
            end = expr.find("\n", i)
            i = len(expr) if end < 0 else end + 1
        else:
            break
    return i


def _string_end(expr: str, i: int) -> int:
    """The index just past the string literal opening at `i` (`"..."`, `'...'` with backslash escapes, or a raw
    `` `...` ``). Raises ValueError if it does not end."""
    quote, j = expr[i], i + 1
    while j < len(expr):
        if expr[j] == "\\" and quote != "`":
            j += 2
        elif expr[j] == quote:
            return j + 1
        else:
            j += 1
    raise ValueError(f"unterminated string at {i} in {expr!r}")


def _read_matchers(expr: str, i: int, names: set[str]) -> int:
    """Read the `{...}` opening at `i`, adding to `names` the metric names it gives; return the index past `}`."""
    j = i + 1
    while True:
        j = _skip_blank(expr, j)
        if j >= len(expr):
            raise ValueError(f"unterminated '{{' at {i} in {expr!r}")
        if expr[j] == "}":
            return j + 1
        if expr[j] == ",":
            j += 1
            continue
        if expr[j] in "\"'`":  # a quoted label name, or alone a quoted metric name (Prometheus 3)
            end = _string_end(expr, j)
            label, quoted = _unquote(expr[j:end]), True
        elif match := _IDENT.match(expr, j):
            end, label, quoted = match.end(), match.group(), False
        else:
            raise ValueError(f"unexpected {expr[j]!r} at {j} in the label matchers of {expr!r}")
        j = _skip_blank(expr, end)
        op = _MATCH_OP.match(expr, j)
        if op is None:
            if not quoted:
                raise ValueError(f"label {label!r} without a matcher at {j} in {expr!r}")
            names.add(label)
            continue
        j = _skip_blank(expr, op.end())
        if j >= len(expr) or expr[j] not in "\"'`":
            raise ValueError(f"expected a string after {label}{op.group()} at {j} in {expr!r}")
        end = _string_end(expr, j)
        if label == "__name__":
            if op.group() != "=":
                raise ValueError(f"a metric name given by {op.group()!r} ({expr[j:end]}) cannot be checked against "
                                 f"a list of names; name it with '=' in {expr!r}")
            names.add(_unquote(expr[j:end]))
        j = end


_ESCAPES = {"n": "\n", "t": "\t", "r": "\r"}


def _unquote(literal: str) -> str:
    """The value of a PromQL string literal: quotes removed, and in `"..."` and `'...'` the backslash escapes
    resolved (`\\n`, `\\t`, `\\r`; any other escaped character stands for itself)."""
    if literal[0] == "`":
        return literal[1:-1]
    return re.sub(r"\\(.)", lambda m: _ESCAPES.get(m.group(1), m.group(1)), literal[1:-1], flags=re.S)


def main() -> None:
    OUTPUT.write_text(render())
    print(f"wrote {OUTPUT}", file=sys.stderr)


if __name__ == "__main__":
    main()
