"""The Grafana dashboard (serve_app/grafana.py) and the alerting rules (serve_app/alerts.py) over the app's metrics:
every query is valid PromQL, names only series the app exports (under the names Ray's metrics agent gives them) and
groups, joins or filters only by labels those series carry; every metric the app defines has a panel; the dashboard
lands where Ray's Grafana provisions dashboards from; the rule file is what Prometheus loads. A real scrape of the
same series: tests/serve_app/test_serve_e2e.py::test_engine_metrics_reach_prometheus."""

from __future__ import annotations

import json
import pathlib
import re

import promql_parser
import pytest
import yaml
from ray.util import metrics as ray_metrics

from serve_app import alerts, grafana
from serve_app.metrics import ApiMetrics, ServerMetrics

ROOT = pathlib.Path(__file__).resolve().parents[2]
DEFINED = re.compile(r'metrics\.(Gauge|Counter|Histogram)\(\s*"(gptoss_[a-z_]+)"')
SUFFIXES = {"Gauge": ("",), "Counter": ("_total",), "Histogram": ("_bucket", "_sum", "_count")}
RAY_LABELS = {"SessionName", "NodeAddress", "WorkerId", "Component", "Version", "le"}


def expressions() -> list[str]:
    """The dashboard's queries, then the alerts'."""
    return grafana.expressions() + [a.expr for a in alerts.ALERTS]


def as_promql(expr: str) -> str:
    """Grafana's variables as Prometheus would see them after substitution."""
    return expr.replace("$__rate_interval", "1m").replace("$model", ".*")


def defined_metrics() -> dict[str, str]:
    """Every ray.util.metrics metric the app's sources define: name -> kind."""
    found = {}
    for path in (ROOT / "serve_app").rglob("*.py"):
        for kind, name in DEFINED.findall(path.read_text()):
            found[name] = kind
    return found


def exported(name: str, kind: str) -> set[str]:
    return {f"ray_{name}{suffix}" for suffix in SUFFIXES[kind]}


def test_every_query_is_valid_promql():
    for expr in expressions():
        promql_parser.parse(as_promql(expr))  # raises ValueError on a syntax error
    with pytest.raises(ValueError):  # the parser does refuse broken queries
        promql_parser.parse(as_promql(expressions()[0]).replace("rate(", "rate", 1))


def test_queries_name_only_exported_series_and_every_metric_has_a_panel():
    defined = defined_metrics()
    # the metrics the README's table lists (a regex that found none would make this test vacuous)
    assert {"gptoss_ttft_seconds", "gptoss_api_tokens", "gptoss_prefix_routing",
            "gptoss_response_store_bytes"} <= set(defined)
    names = set().union(*(exported(n, k) for n, k in defined.items()))
    used = grafana.series_names()
    assert used <= names, used - names
    in_alerts = {name for a in alerts.ALERTS for name in grafana.SERIES.findall(a.expr)}
    assert len(in_alerts) >= 5 and in_alerts <= names, in_alerts - names
    for name, kind in defined.items():
        assert exported(name, kind) & used, f"no panel shows {name}"


def test_queries_use_only_labels_their_series_carry():
    """Labels in `by (...)` and selectors against the tag keys of the metric objects the replicas create."""
    objects = [o for m in (ServerMetrics("decode", "m"), ApiMetrics()) for o in vars(m).values()
               if isinstance(o, ray_metrics.Metric)]
    labels = {}
    for o in objects:
        kind = type(o).__name__
        for series in exported(o._name, kind):
            labels[series] = set(o._tag_keys) | RAY_LABELS
    assert len(objects) >= 16
    checked = 0
    for expr in expressions():
        for series, used in grafana.query_labels(expr).items():
            if series not in labels:
                continue  # the response store's and the router's: checked against a real scrape (test_serve_e2e)
            assert used <= labels[series], (series, used - labels[series])
            checked += 1
    assert checked >= 24
    assert grafana.query_labels('max by (a, b) (ray_x{c="1"}) and on (d) sum (rate(ray_y[1m]))') == {
        "ray_x": {"a", "b", "c", "d"}, "ray_y": {"d"}}


def test_dashboard_json_shape():
    d = grafana.dashboard()
    assert d["uid"] == grafana.UID and len(d["panels"]) == len(grafana.PANELS)
    ids = [p["id"] for p in d["panels"]]
    assert len(set(ids)) == len(ids)
    spots = {(p["gridPos"]["x"], p["gridPos"]["y"]) for p in d["panels"]}
    assert len(spots) == len(ids)  # no two panels on one spot
    assert {v["name"] for v in d["templating"]["list"]} == {"datasource", "model"}
    json.dumps(d)


def test_install_writes_where_rays_grafana_provisions(tmp_path, monkeypatch):
    monkeypatch.delenv("RAY_METRICS_GRAFANA_DASHBOARD_OUTPUT_DIR", raising=False)
    folder = grafana.session_dashboard_dir(tmp_path / "session_x")
    assert folder == tmp_path / "session_x" / "metrics" / "grafana" / "dashboards"
    path = grafana.install(folder)
    assert path.parent == folder and json.loads(path.read_text())["uid"] == grafana.UID
    assert [p.name for p in folder.iterdir()] == [grafana.FILE_NAME]  # no temporary file left
    monkeypatch.setenv("RAY_METRICS_GRAFANA_DASHBOARD_OUTPUT_DIR", str(tmp_path / "elsewhere"))
    assert grafana.session_dashboard_dir(tmp_path / "session_x") == tmp_path / "elsewhere"


def test_command_line(tmp_path, monkeypatch):
    monkeypatch.delenv("RAY_METRICS_GRAFANA_DASHBOARD_OUTPUT_DIR", raising=False)
    out = tmp_path / "d.json"
    assert grafana.main(["--out", str(out)]) == 0
    assert json.loads(out.read_text()) == grafana.dashboard()
    assert grafana.main(["--session-dir", str(tmp_path / "s")]) == 0
    assert (tmp_path / "s" / "metrics" / "grafana" / "dashboards" / grafana.FILE_NAME).exists()


def test_alert_rule_file(tmp_path):
    out = tmp_path / "alerts.yml"
    assert alerts.main(["--out", str(out)]) == 0
    rules = yaml.safe_load(out.read_text())
    assert rules == alerts.rules()
    (group,) = rules["groups"]
    assert [r["alert"] for r in group["rules"]] == [a.name for a in alerts.ALERTS]
    for r in group["rules"]:
        assert set(r) == {"alert", "expr", "for", "labels", "annotations"}
        assert r["labels"]["severity"] in ("critical", "warning") and re.fullmatch(r"\d+m", r["for"])
        promql_parser.parse(r["expr"])
