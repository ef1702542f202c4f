"""A Grafana dashboard of the app's own metrics (serve_app/metrics.py, the prefix router's and the response store's),
generated from the panel list below, and its installation where Ray's Grafana looks for dashboards.

    python -m serve_app.grafana                 # into the local Ray session's dashboard folder (the head node)
    python -m serve_app.grafana --out gptoss.json   # or a file, to import into another Grafana

Ray writes its own dashboards into `<session>/metrics/grafana/dashboards` when the head starts, and the Grafana it
configures (`grafana-server --config <session>/metrics/grafana/grafana.ini`) provisions every JSON file there, in
its "Ray" folder, next to Ray's Serve dashboards; a file added later shows up within Grafana's provisioning poll.
An ingress replica on the head node installs it when it starts (`serve run`, `serve deploy`); the command above does
it by hand. Every query names series with Ray's prefix (`ray_`) and Prometheus' suffixes (`_total`,
`_bucket`, `_sum`), as Ray's metrics agent exports them; tests/serve_app/test_monitoring.py checks them against the
metrics the app defines, test_serve_e2e.py against a real scrape.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import re
from dataclasses import dataclass
from pathlib import Path

from serve_app.placement import HEAD_NODE_RESOURCE

log = logging.getLogger(__name__)

FILE_NAME = "gptoss_serve_grafana_dashboard.json"
UID = "gptoss-serve"
ENGINE = '{model=~"$model"}'  # engine and API series carry the served model name
RATE = "[$__rate_interval]"


def rate(series: str, selector: str = ENGINE, by: str = "", window: str = RATE) -> str:
    """sum [by (labels)] (rate(series{selector}[window]))"""
    group = f" by ({by})" if by else ""
    return f"sum{group} (rate({series}{selector}{window}))"


def quantile(q: float, histogram: str, by: str = "") -> str:
    labels = ", ".join(["le"] + ([by] if by else []))
    return f"histogram_quantile({q}, sum by ({labels}) (rate({histogram}_bucket{ENGINE}{RATE})))"


def with_label(selector: str, label: str, value: str) -> str:
    return selector[:-1] + f', {label}="{value}"}}'


@dataclass(frozen=True)
class Panel:
    title: str
    unit: str  # Grafana's unit id: short, s, percentunit, Bps, bytes, reqps
    targets: tuple[tuple[str, str], ...]  # (legend, PromQL)
    description: str = ""


def prefix_share(kind: str) -> str:
    hit = rate("ray_gptoss_prefix_cache_tokens_total", with_label(ENGINE, "kind", kind), "deployment")
    query = rate("ray_gptoss_prefix_cache_tokens_total", with_label(ENGINE, "kind", "query"), "deployment")
    return f"{hit} / {query}"


def draft_acceptance() -> str:
    accepted = rate("ray_gptoss_draft_tokens_total", with_label(ENGINE, "kind", "accepted"), "deployment")
    verified = rate("ray_gptoss_draft_tokens_total", with_label(ENGINE, "kind", "verified"), "deployment")
    return f"{accepted} / {verified}"


def lookahead_share() -> str:
    ahead = rate("ray_gptoss_steps_total", with_label(ENGINE, "launch", "lookahead"), "deployment")
    return f"{ahead} / {rate('ray_gptoss_steps_total', ENGINE, 'deployment')}"


def tokens_per_stream_item() -> str:
    decoded = rate("ray_gptoss_tokens_total", with_label(ENGINE, "phase", "decode"), "deployment")
    return f"{decoded} / {rate('ray_gptoss_stream_items_total', ENGINE, 'deployment')}"


PANELS: tuple[Panel, ...] = (
    Panel("API requests / s, by outcome", "reqps",
          (("{{outcome}}", rate("ray_gptoss_api_requests_total", by="outcome")),),
          "Engine requests the OpenAI API ended: the finish reason, or cancelled / refused / failed"),
    Panel("API tokens / s", "short", (("{{kind}}", rate("ray_gptoss_api_tokens_total", by="kind")),),
          "prompt, cached (of the prompt, from the prefix cache) and completion tokens of ended requests"),
    Panel("Time to first token", "s",
          tuple((f"p{round(q * 100)}", quantile(q, "ray_gptoss_ttft_seconds")) for q in (0.5, 0.9, 0.99)),
          "At the decode server: remote prefill and K/V transfer included"),
    Panel("Time per output token", "s",
          tuple((f"p{round(q * 100)}", quantile(q, "ray_gptoss_tpot_seconds")) for q in (0.5, 0.9, 0.99))),
    Panel("Engine tokens / s", "short",
          (("{{deployment}} {{phase}}", rate("ray_gptoss_tokens_total", by="deployment, phase")),),
          "Tokens the engines computed: prompt (prefill) and generated (decode)"),
    Panel("Requests queued and running", "short",
          (("queued {{deployment}}", f"sum by (deployment) (ray_gptoss_queue_depth{ENGINE})"),
           ("running {{deployment}}", f"sum by (deployment) (ray_gptoss_running_requests{ENGINE})")),
          "Queued: waiting in an engine for a batch slot or K/V pages"),
    Panel("K/V pages in use (fullest replica)", "percentunit",
          (("{{deployment}} {{pool}}", f"max by (deployment, pool) (ray_gptoss_kv_usage_ratio{ENGINE})"),)),
    Panel("Prefix cache hit rate", "percentunit",
          (("hit {{deployment}}", prefix_share("hit")), ("from the host tier {{deployment}}", prefix_share("host_hit"))),
          "Prompt tokens served from cached prefixes, of the prompt tokens admitted"),
    Panel("Host K/V tier pages / s", "short",
          (("{{direction}}", rate("ray_gptoss_host_kv_pages_total", by="direction")),),
          "Evicted cached pages copied to host memory (stored) and back into the GPU pool (loaded)"),
    Panel("K/V transfer time", "s",
          tuple((f"p{round(q * 100)} {{{{transport}}}} {{{{node}}}} node",
                 quantile(q, "ray_gptoss_kv_transfer_seconds", "transport, node")) for q in (0.5, 0.99)),
          "Prefill to decode: pack + receive"),
    Panel("K/V transfer bytes / s", "Bps",
          (("{{transport}} {{node}} node", rate("ray_gptoss_kv_transfer_bytes_sum", by="transport, node")),)),
    Panel("Prefill fallbacks / s", "short",
          (("{{reason}}", rate("ray_gptoss_prefill_fallbacks_total", by="reason")),),
          "Requests whose remote prefill or K/V transfer failed, so the decode replica ran the prompt itself"),
    Panel("Speculative drafts accepted", "percentunit", (("{{deployment}}", draft_acceptance()),),
          "Accepted of verified draft tokens (predicted outputs, prompt lookup)"),
    Panel("Steps launched ahead", "percentunit", (("{{deployment}}", lookahead_share()),),
          "Engine steps launched before the previous step's tokens were read"),
    Panel("Tokens per streamed item", "short", (("{{deployment}}", tokens_per_stream_item()),),
          "Decode tokens per delta a replica streams (one Ray Serve item each): about 1 when each step's tokens "
          "leave alone (a little under: a prompt's first token and a request's last, token-less delta count as "
          "items), above 1 when deltas merged (stream_coalescing) or waited out stream_items_per_s"),
    Panel("Forwards / s, by path", "short",
          (("{{deployment}} {{path}}", rate("ray_gptoss_forwards_total", by="deployment, path")),),
          "decode_graph / prefill_graph: CUDA graph replays; eager on a GPU replica: steps no graph bucket holds"),
    Panel("Prefix routing decisions / s", "short",
          (("{{deployment}} {{outcome}}", rate("ray_gptoss_prefix_routing_total", "", "deployment, outcome")),)),
    Panel("Stored responses, conversations and chat completions", "short",
          (("responses", "sum (ray_gptoss_response_store_responses)"),
           ("conversations", "sum (ray_gptoss_response_store_conversations)"),
           ("chat completions", "sum (ray_gptoss_response_store_chat_completions)"),
           ("background running", "sum (ray_gptoss_response_store_background_running)"),
           ("batches running", "sum (ray_gptoss_response_store_batches_running)"),
           ("taken over / min", "sum (increase(ray_gptoss_response_store_adopted_total[1m]))"))),
    Panel("Response store bytes", "bytes", (("stored JSON", "sum (ray_gptoss_response_store_bytes)"),
                                            ("files", "sum (ray_gptoss_response_store_file_bytes)"))),
    Panel("Completion tokens / s, by API key", "short",
          (("{{key}}", rate("ray_gptoss_api_tokens_total", with_label(ENGINE, "kind", "completion"), "key")),),
          "key: a hash of the API key (none without keys)"),
)

SERIES = re.compile(r"\bray_[a-z_]+\b")


def query_labels(expr: str) -> dict[str, set[str]]:
    """The labels a query uses of each series it names: in the series' selector, in a `by (...)` right before it,
    and in any `on (...)` join of the query."""
    joined = {g.strip() for on in re.findall(r"\bon \(([^)]*)\)", expr) for g in on.split(",")}
    used: dict[str, set[str]] = {}
    for series, selector in re.findall(r"(ray_[a-z_]+)(\{[^}]*\})?", expr):
        grouped = {g.strip() for by in re.findall(rf"by \(([^)]*)\) \(\w*\(?{series}", expr) for g in by.split(",")}
        used.setdefault(series, set()).update(set(re.findall(r"(\w+)\s*=~?", selector)) | grouped | joined)
    return used


def expressions() -> list[str]:
    """Every query of the dashboard, panel by panel."""
    return [expr for p in PANELS for _, expr in p.targets]


def series_names() -> set[str]:
    """Every exported series the dashboard's queries name."""
    return {name for expr in expressions() for name in SERIES.findall(expr)}


def dashboard() -> dict:
    panels = []
    for i, p in enumerate(PANELS):
        panels.append({
            "id": i + 1, "type": "timeseries", "title": p.title, "description": p.description,
            "datasource": {"type": "prometheus", "uid": "${datasource}"},
            "gridPos": {"h": 8, "w": 12, "x": 12 * (i % 2), "y": 8 * (i // 2)},
            "fieldConfig": {"defaults": {"unit": p.unit, "min": 0}, "overrides": []},
            "options": {"legend": {"displayMode": "list", "placement": "bottom"}, "tooltip": {"mode": "multi"}},
            "targets": [{"refId": chr(ord("A") + j), "expr": expr, "legendFormat": legend,
                         "datasource": {"type": "prometheus", "uid": "${datasource}"}}
                        for j, (legend, expr) in enumerate(p.targets)],
        })
    return {
        "uid": UID, "title": "gpt-oss serving", "tags": ["gptoss", "serve"], "editable": True,
        "schemaVersion": 39, "refresh": "10s", "time": {"from": "now-30m", "to": "now"},
        "templating": {"list": [
            {"name": "datasource", "type": "datasource", "query": "prometheus", "label": "Data source"},
            {"name": "model", "type": "query", "label": "Model", "includeAll": True, "multi": True, "allValue": ".*",
             "current": {"text": "All", "value": "$__all"},
             "datasource": {"type": "prometheus", "uid": "${datasource}"},
             "query": {"query": "label_values(ray_gptoss_tokens_total, model)", "refId": "model"},
             "definition": "label_values(ray_gptoss_tokens_total, model)", "refresh": 2},
        ]},
        "panels": panels,
    }


def session_dashboard_dir(session_dir: str | os.PathLike | None = None) -> Path:
    """Where Ray's Grafana provisions dashboards from: RAY_METRICS_GRAFANA_DASHBOARD_OUTPUT_DIR if set, else the
    session's metrics/grafana/dashboards (the running local Ray's session, else /tmp/ray/session_latest)."""
    override = os.environ.get("RAY_METRICS_GRAFANA_DASHBOARD_OUTPUT_DIR")
    if override:
        return Path(override)
    if session_dir is None:
        import ray

        node = getattr(ray._private.worker, "_global_node", None) if ray.is_initialized() else None
        session_dir = node.get_session_dir_path() if node is not None else "/tmp/ray/session_latest"
    return Path(session_dir) / "metrics" / "grafana" / "dashboards"


def install(folder: str | os.PathLike) -> Path:
    """Write the dashboard into `folder` (created if missing); returns the file."""
    path = Path(folder) / FILE_NAME
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")  # one per process: replicas may install at once
    tmp.write_text(json.dumps(dashboard(), indent=1))
    tmp.replace(path)  # Grafana's poll never reads half a file
    return path


def install_if_head_node() -> Path | None:
    """An ingress replica's best effort at start: on the head node (where Ray's Grafana config lives), install into
    this Ray session's folder; elsewhere nothing. Never raises (a dashboard must not stop the app)."""
    try:
        import ray

        here = ray.get_runtime_context().get_node_id()
        heads = [n["NodeID"] for n in ray.nodes() if n.get("Alive") and HEAD_NODE_RESOURCE in n.get("Resources", {})]
        if here not in heads:
            return None
        return install(session_dashboard_dir())
    except Exception as exc:  # noqa: BLE001
        log.warning("Grafana dashboard not installed: %s", exc)
        return None


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--out", help="write the dashboard JSON to this file instead")
    p.add_argument("--session-dir", help="a Ray session folder (default: /tmp/ray/session_latest)")
    args = p.parse_args(argv)
    if args.out:
        Path(args.out).write_text(json.dumps(dashboard(), indent=1))
        print(f"wrote {args.out}")
    else:
        print(f"wrote {install(session_dashboard_dir(args.session_dir or '/tmp/ray/session_latest'))}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
