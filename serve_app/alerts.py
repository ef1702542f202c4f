"""Prometheus alerting rules over the app's metrics (serve_app/metrics.py), beside the Grafana dashboard
(serve_app/grafana.py): what an operator pages on.

    python -m serve_app.alerts --out gptoss_alerts.yml     # then list the file under `rule_files:` in prometheus.yml

The thresholds are starting points for an H200 deployment (edit the file, or THRESHOLDS here): a request share that
fails on the server side, prompts the decode replicas had to run themselves because prefill failed, a slow p99 time
to first token, and K/V pools full while requests wait for pages. Every expression is checked as PromQL and against
the series and labels the app exports (tests/serve_app/test_grafana.py, test_serve_e2e.py).
"""

from __future__ import annotations

import argparse
from dataclasses import dataclass
from pathlib import Path

import yaml

from serve_app.grafana import rate

WINDOW = "5m"
THRESHOLDS = {
    "failed_share": 0.05,  # of the API's ended requests, failed (engine or transport errors; not 4xx, not 503s)
    "ttft_p99_s": 10.0,  # at the decode server, remote prefill and queueing included
    "kv_usage": 0.95,  # of the fullest replica's pool, while requests wait
}


@dataclass(frozen=True)
class Alert:
    name: str
    expr: str
    duration: str  # how long the condition must hold (Prometheus' `for`)
    severity: str  # critical: page; warning: look today
    summary: str


FAILED = '{outcome="failed"}'


def _rate(series: str, selector: str, by: str) -> str:
    return rate(series, selector, by, f"[{WINDOW}]")


ALERTS: tuple[Alert, ...] = (
    Alert("GptossRequestsFailing",
          f'{_rate("ray_gptoss_api_requests_total", FAILED, "model")} / '
          f'{_rate("ray_gptoss_api_requests_total", "", "model")} > {THRESHOLDS["failed_share"]}',
          "5m", "critical",
          "More than {{ $value | humanizePercentage }} of {{ $labels.model }}'s requests fail on the server side"),
    Alert("GptossPrefillFallbacks",
          f'{_rate("ray_gptoss_prefill_fallbacks_total", "", "model, reason")} > 0',
          "10m", "warning",
          "{{ $labels.model }}: decode replicas run prompts themselves ({{ $labels.reason }}): the prefill "
          "deployment is failing, overloaded or unreachable"),
    Alert("GptossSlowFirstToken",
          f'histogram_quantile(0.99, sum by (le, model) (rate(ray_gptoss_ttft_seconds_bucket[{WINDOW}]))) > '
          f'{THRESHOLDS["ttft_p99_s"]}',
          "10m", "warning",
          "{{ $labels.model }}: p99 time to first token {{ $value | humanizeDuration }}: too few prefill or decode "
          "replicas for the load"),
    Alert("GptossKvCacheFull",
          f'max by (model, deployment) (ray_gptoss_kv_usage_ratio) > {THRESHOLDS["kv_usage"]} '
          f'and on (model, deployment) sum by (model, deployment) (ray_gptoss_queue_depth) > 0',
          "10m", "warning",
          "{{ $labels.model }} {{ $labels.deployment }}: K/V pages {{ $value | humanizePercentage }} in use with "
          "requests waiting for them"),
)


def rules() -> dict:
    """The Prometheus rule file (one group)."""
    return {"groups": [{"name": "gptoss-serve", "rules": [
        {"alert": a.name, "expr": a.expr, "for": a.duration, "labels": {"severity": a.severity},
         "annotations": {"summary": a.summary}} for a in ALERTS]}]}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--out", default="gptoss_alerts.yml", help="the rule file to write")
    args = p.parse_args(argv)
    Path(args.out).write_text(yaml.safe_dump(rules(), sort_keys=False, width=120))
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
