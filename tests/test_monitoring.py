"""nanomm/serve/monitoring/: the Prometheus rules pass their promtool unit tests, and every metric that the rules and
the Grafana dashboard name is one that nanomm exports (read from the live registries of an engine's ServerMetrics,
the encoder service and the router) or one that rules.yml records."""

import json
import os
import re
import shutil
import subprocess
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
import yaml
from prometheus_client import generate_latest
from prometheus_client.parser import text_string_to_metric_families

import nanomm.serve
from nanomm.inputs.image import ImageProcessorConfig
from nanomm.serve.encoder_server import EncoderService
from nanomm.serve.metrics import ServerMetrics
from nanomm.serve.router import Router

MONITORING = Path(nanomm.serve.__file__).parent / "monitoring"


# --- promtool ---------------------------------------------------------------------------------------------------

def promtool() -> str:
    path = shutil.which("promtool")
    if path is None:
        if os.environ.get("CI"):
            pytest.fail("promtool is not on PATH; .ci/run installs it (Debian's prometheus package)")
        pytest.skip("promtool is not installed (apt-get install prometheus)")
    return path


@pytest.mark.parametrize("args", [("check", "rules", "rules.yml"), ("test", "rules", "rules_test.yml"),
                                  ("check", "config", "prometheus.yml")], ids=" ".join)
def test_promtool(args):
    result = subprocess.run([promtool(), *args], cwd=MONITORING, capture_output=True, text=True, timeout=60)
    assert result.returncode == 0, f"promtool {' '.join(args)}:\n{result.stdout}\n{result.stderr}"


# --- what nanomm exports ----------------------------------------------------------------------------------------

# The series names a metric family of each type exposes. From the family's type, not only its samples: a labelled
# counter with no child yet (nanomm_requests before the first request finishes) exposes its HELP and TYPE only.
SERIES_SUFFIXES = {"counter": ("_total",), "histogram": ("_bucket", "_sum", "_count"), "summary": ("", "_sum", "_count"),
                   "gauge": ("",), "unknown": ("",), "untyped": ("",), "info": ("_info",), "stateset": ("",),
                   "gaugehistogram": ("_bucket", "_gsum", "_gcount")}


def series_names(text: str) -> set[str]:
    names = set()
    for family in text_string_to_metric_families(text):
        base = family.name[:-len("_total")] if family.type == "counter" and family.name.endswith("_total") else family.name
        names |= {base + suffix for suffix in SERIES_SUFFIXES[family.type]}
        names |= {sample.name for sample in family.samples}
    return names


@pytest.fixture(scope="module")
def exported() -> dict[str, set[str]]:
    """Each kind of server's /metrics series names, rendered from its own registry. The engine's is given a GPU price:
    nanomm_request_cost_dollars exists only then (nanomm-serve --gpu-hourly-price)."""
    tower_less_model = SimpleNamespace(name_or_path="nanomm-monitoring-test", dtype=torch.float32)  # never called
    encoder = EncoderService(tower_less_model, ImageProcessorConfig())
    return {"engine": series_names(ServerMetrics(gpu_hourly_price=2.0).render().decode()),
            "encoder service": series_names(generate_latest(encoder.registry).decode()),
            "router": series_names(generate_latest(Router([], [], []).registry).decode())}


def load_rules() -> list[dict]:
    return [rule for group in yaml.safe_load((MONITORING / "rules.yml").read_text())["groups"]
            for rule in group["rules"]]


def recorded_names() -> set[str]:
    return {rule["record"] for rule in load_rules() if "record" in rule}


@pytest.fixture(scope="module")
def known(exported) -> set[str]:
    return set().union(*exported.values()) | recorded_names()


# --- metric names in PromQL -------------------------------------------------------------------------------------

AGGREGATIONS = {"sum", "min", "max", "avg", "group", "stddev", "stdvar", "count", "count_values", "bottomk", "topk",
                "quantile", "limitk", "limit_ratio"}
FUNCTIONS = {
    "abs", "absent", "absent_over_time", "acos", "acosh", "asin", "asinh", "atan", "atanh", "avg_over_time", "ceil",
    "changes", "clamp", "clamp_max", "clamp_min", "cos", "cosh", "count_over_time", "day_of_month", "day_of_week",
    "day_of_year", "days_in_month", "deg", "delta", "deriv", "double_exponential_smoothing", "end", "exp", "floor",
    "group_over_time", "histogram_avg", "histogram_count", "histogram_fraction", "histogram_quantile",
    "histogram_stddev", "histogram_stdvar", "histogram_sum", "holt_winters", "hour", "idelta", "increase", "irate",
    "label_join", "label_replace", "last_over_time", "ln", "log10", "log2", "mad_over_time", "max_over_time",
    "min_over_time", "minute", "month", "pi", "predict_linear", "present_over_time", "quantile_over_time", "rad",
    "rate", "resets", "round", "scalar", "sgn", "sin", "sinh", "sort", "sort_by_label", "sort_by_label_desc",
    "sort_desc", "sqrt", "start", "stddev_over_time", "stdvar_over_time", "sum_over_time", "tan", "tanh", "time",
    "timestamp", "vector", "year"}
KEYWORDS = {"by", "without", "on", "ignoring", "group_left", "group_right", "bool", "and", "or", "unless", "atan2",
            "offset", "inf", "nan"}

STRINGS = re.compile(r'"(?:\\.|[^"\\])*"|\'(?:\\.|[^\'\\])*\'|`[^`]*`')
GRAFANA_VARIABLES = re.compile(r"\$\{[^}]*\}|\$\w+")
LABEL_MATCHERS = re.compile(r"\{[^{}]*\}")  # strings are gone first, so no brace is left inside one
RANGES = re.compile(r"\[[^\[\]]*\]")  # [5m], [$__rate_interval], subqueries' [1h:5m]
LABEL_LISTS = re.compile(r"\b(?:by|without|on|ignoring|group_left|group_right)\s*\([^()]*\)")
MODIFIERS = re.compile(r"\boffset\s+-?(?:\d+(?:ms|[smhdwy]))+|@\s*-?[\d.]+")
NUMBERS = re.compile(r"(?<![\w:.])(?:0[xX][0-9a-fA-F]+|(?:\d+\.?\d*|\.\d+)(?:[eE][+-]?\d+)?)")
IDENTIFIER = re.compile(r"[A-Za-z_:][A-Za-z0-9_:]*")


def metric_names(expr: str) -> set[str]:
    """The metric names a PromQL expression reads: what is left once strings, Grafana's variables, label matchers,
    ranges, grouping label lists, offsets, numbers, functions, aggregations and keywords are taken out. A name
    called like a function that PromQL does not have is a ValueError (a typo such as `rat(...)` must not pass)."""
    text = STRINGS.sub(" ", expr)
    text = GRAFANA_VARIABLES.sub(" ", text)
    text = LABEL_MATCHERS.sub(" ", text)
    text = RANGES.sub(" ", text)
    text = LABEL_LISTS.sub(" ", text)
    text = MODIFIERS.sub(" ", text)
    text = NUMBERS.sub(" ", text)
    names = set()
    for match in IDENTIFIER.finditer(text):
        word = match.group()
        if word.lower() in KEYWORDS:
            continue
        if text[match.end():].lstrip().startswith("("):
            if word not in FUNCTIONS | AGGREGATIONS:
                raise ValueError(f"{word}(...) is not a PromQL function, in {expr!r}")
            continue
        names.add(word)
    return names


GRAFANA_LABEL_VALUES = re.compile(r"^\s*label_values\(\s*(?:(.*?)\s*,\s*)?[A-Za-z_]\w*\s*\)\s*$")


def dashboard_queries(dashboard: dict) -> list[tuple[str, str]]:
    """(where, PromQL) for every panel target (rows' nested panels too) and every query variable."""
    queries = []
    panels = list(dashboard.get("panels", []))
    while panels:
        panel = panels.pop(0)
        panels += panel.get("panels", [])
        for target in panel.get("targets", []):
            queries.append((f"panel {panel.get('title')!r} target {target.get('refId')}", target.get("expr", "")))
    for variable in dashboard.get("templating", {}).get("list", []):
        if variable.get("type") == "query":
            query = variable["query"]["query"] if isinstance(variable["query"], dict) else variable["query"]
            match = GRAFANA_LABEL_VALUES.match(query)  # Grafana's label_values(selector, label), not PromQL
            queries.append((f"variable {variable['name']}", (match.group(1) or "") if match else query))
    return queries


def unknown_metrics(queries: list[tuple[str, str]], known: set[str]) -> list[str]:
    """Each query's metric names that are not in `known`, as 'where: name (expr)'; and each query that is empty or
    names no metric at all."""
    problems = []
    for where, expr in queries:
        try:
            names = metric_names(expr)
        except ValueError as exc:
            problems.append(f"{where}: {exc}")
            continue
        if not names and "__name__" not in expr:
            problems.append(f"{where}: reads no metric ({expr!r})")
        problems += [f"{where}: {name} ({expr})" for name in sorted(names - known)]
    return problems


def test_metric_names_of_promql():
    assert metric_names('histogram_quantile(0.95, sum by (job, le) (rate(a_bucket{job=~"$job",le!="+Inf"}'
                        '[$__rate_interval] offset 1h)))') == {"a_bucket"}
    assert metric_names("sum without (instance) (b) / on (job) group_left (x) c > bool 0.5 and d unless e or f") \
        == {"b", "c", "d", "e", "f"}
    assert metric_names('label_replace(g{a="b{c}"}, "dst", "$1", "src", "(.*)") * 1e3 - 2.5 + 0x1F') == {"g"}
    assert metric_names("max_over_time(h[1h:5m]) @ 1700000000 + topk(5, i) @ end() + -j offset -5m != Inf") \
        == {"h", "i", "j"}
    assert metric_names("sum(k) by (job) / count(job:l:rate1m) without (instance)") == {"k", "job:l:rate1m"}
    assert metric_names('m{__name__!="x", job="by (job)"}') == {"m"}
    with pytest.raises(ValueError, match="rat"):
        metric_names("rat(n[5m])")


# --- the dashboard ----------------------------------------------------------------------------------------------

def load_dashboard() -> dict:
    return json.loads((MONITORING / "dashboard.json").read_text())


def test_every_dashboard_query_reads_metrics_that_exist(known):
    queries = dashboard_queries(load_dashboard())
    assert len(queries) > 20
    assert unknown_metrics(queries, known) == []


def test_the_dashboard_check_catches_a_metric_nanomm_does_not_export(known):
    dashboard = load_dashboard()
    dashboard["panels"].append({"type": "row", "title": "extra", "panels": [
        {"type": "timeseries", "title": "broken", "targets": [
            {"refId": "A", "expr": 'sum by (job) (rate(nanomm_no_such_metric{job=~"$job"}[5m]))'},
            {"refId": "B", "expr": 'histogram_quantile(0.5, rate(nanomm_time_per_output_token_seconds[5m]))'},
            {"refId": "C", "expr": "job:nanomm_no_such_rule:rate1m"}]}]})
    problems = unknown_metrics(dashboard_queries(dashboard), known)
    assert [p.split(" (")[0] for p in problems] == [
        "panel 'broken' target A: nanomm_no_such_metric",
        "panel 'broken' target B: nanomm_time_per_output_token_seconds",  # a histogram is read through _bucket
        "panel 'broken' target C: job:nanomm_no_such_rule:rate1m"]


def test_the_dashboards_shape():
    dashboard = load_dashboard()
    assert 36 <= dashboard["schemaVersion"] <= 41
    variables = {v["name"]: v for v in dashboard["templating"]["list"]}
    assert variables["datasource"]["type"] == "datasource" and variables["datasource"]["query"] == "prometheus"
    assert variables["job"]["type"] == "query" and variables["job"]["multi"] and variables["job"]["includeAll"]
    panels = [p for p in dashboard["panels"] if p["type"] != "row"]
    assert len({p["id"] for p in dashboard["panels"]}) == len(dashboard["panels"])
    for panel in panels:
        assert panel["targets"], panel["title"]
        for target in [panel, *panel["targets"]]:
            assert target["datasource"] == {"type": "prometheus", "uid": "${datasource}"}, panel["title"]
        for target in panel["targets"]:
            assert 'job=~"$job"' in target["expr"], f"{panel['title']}: {target['expr']} ignores the job variable"
    # What the dashboard is for: each of these is read by some panel.
    read = set().union(*(metric_names(expr) for _, expr in dashboard_queries(dashboard)))
    wanted = {"nanomm_time_to_first_token_seconds_bucket", "nanomm_time_per_output_token_seconds_bucket",
              *(f"job:nanomm_ttft_{stage}_seconds:p95_rate5m" for stage in
                ("preprocess", "queue", "encode", "prefill", "transfer")),
              "nanomm_requests_total", "nanomm_generation_tokens_total", "job:nanomm_visual_tokens:rate1m",
              "job:nanomm_encoder_busy_seconds:avg_rate1m", "job:nanomm_lm_busy_seconds:avg_rate1m",
              "instance:nanomm_kv_blocks_used_per_total:ratio", "nanomm_kv_allocation_failures_total",
              "nanomm_prefix_cache_hit_rate", "nanomm_encoder_cache_hit_rate",
              "job:nanomm_request_visual_tokens:mean5m", "nanomm_request_visual_tokens_bucket",
              "job:nanomm_request_device_seconds:mean5m", "job:nanomm_request_cost_dollars:mean5m"}
    assert wanted - read == set()


# --- the rules --------------------------------------------------------------------------------------------------

def test_every_rule_reads_metrics_that_exist(known):
    rules = load_rules()
    queries = [(f"rule {rule.get('record') or rule.get('alert')}", rule["expr"]) for rule in rules]
    assert unknown_metrics(queries, known) == []


def test_the_rules_names_and_annotations(exported):
    rules = load_rules()
    recorded = [rule["record"] for rule in rules if "record" in rule]
    assert len(recorded) == len(set(recorded)) >= 14
    for name in recorded:  # level:metric:operations, and no clash with a name nanomm exports
        assert re.fullmatch(r"(job|instance):nanomm_[a-z0-9_]+:[a-z0-9_]+", name), name
        assert all(name not in names for names in exported.values()), name
    alerts = {rule["alert"]: rule for rule in rules if "alert" in rule}
    assert set(alerts) == {"NanommTTFTOverSLO", "NanommKVCacheNearlyFull", "NanommKVAllocationFailures"}
    for rule in alerts.values():
        assert rule["annotations"]["summary"] and rule["labels"]["severity"]
    assert re.search(r">\s*2\b", alerts["NanommTTFTOverSLO"]["expr"])  # the SLO, where rules.yml says to edit it
