"""Usage accounting: one record per engine request when it ends (BackendRequest.close), handed to the app's
`usage_sink` (under Serve the ingress' Prometheus counters, serve_app/metrics.ApiMetrics): which model and endpoint,
which API key (auth.key_id: a hash, never the key), how it ended, and its tokens. Choice i of an n > 1 request is its
own engine request, so its prompt counts once per choice (`cached_tokens` says how much of it came from the
prefix cache)."""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Callable

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class Caller:
    """Who asked, for the usage record: the endpoint and the request's API key (auth.requester)."""

    endpoint: str  # "chat.completions", "completions", "responses"; "batch.<that>" for a batch's line
    key: str | None = None


def caller_of(endpoint: str, http) -> Caller:
    """The caller of a request to `endpoint`: its API key, and the endpoint prefixed "batch." when the request is a
    /v1/batches line (so usage and the API metrics tell batch load from interactive load)."""
    from serve_app.openai_api.auth import in_batch, requester

    return Caller(f"batch.{endpoint}" if in_batch(http) else endpoint, requester(http))


@dataclass(frozen=True)
class UsageRecord:
    model: str
    endpoint: str
    key: str | None
    # the API's finish reason (stop, length, tool_calls), else: cancelled (the client left, or the request was
    # cancelled), refused (400, 503 before it ran), failed (the engine or its transport failed)
    outcome: str
    prompt_tokens: int
    cached_tokens: int
    completion_tokens: int


UsageSink = Callable[[UsageRecord], None]


def report(sink: UsageSink | None, record: UsageRecord) -> None:
    """Hand `record` to `sink`; a sink that fails is logged, never the request's failure."""
    if sink is None:
        return
    try:
        sink(record)
    except Exception:
        log.exception("usage sink failed on %s", record)
