"""Engine and transfer metrics of the prefill/decode replicas, exported through `ray.util.metrics`.

Ray's metrics agent on every node serves them in Prometheus format next to Serve's own metrics
(`ray_serve_*`: request counts, latencies, replica counts); Ray prefixes each name with `ray_`, so
`gptoss_ttft_seconds` is scraped as `ray_gptoss_ttft_seconds_bucket`. Every series carries the
deployment, model and replica tags, so dashboards can sum over replicas or split by them.

The engine keeps its own counters (engine/metrics.py); `ServerMetrics.observe_engine` polls a
snapshot of them and forwards gauges and counter increments. TTFT and TPOT are measured where the
client's stream is produced, in the decode server, so they include the remote prefill and the KV
transfer.
"""

from __future__ import annotations

from engine.metrics import TPOT_BUCKETS, TTFT_BUCKETS

TRANSFER_SECONDS_BUCKETS = (0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 10.0)
TRANSFER_BYTES_BUCKETS = tuple(float(2 ** p) for p in range(10, 36, 2))  # 1 KiB .. 32 GiB


def replica_tags(deployment: str) -> dict[str, str]:
    from ray import serve
    from ray.serve.exceptions import RayServeException

    try:
        replica = serve.get_replica_context().replica_id.unique_id
    except (RuntimeError, RayServeException):  # not inside a Serve replica (a unit test, a script)
        replica = "local"
    return {"deployment": deployment, "replica": replica}


class ServerMetrics:
    """The metrics one prefill or decode replica reports."""

    def __init__(self, deployment: str, model: str):
        """deployment: `prefill` or `decode`; model: the served model name (apps may serve several)."""
        from ray.util import metrics

        self.tags = {**replica_tags(deployment), "model": model}
        keys = tuple(self.tags)
        self.queue_depth = metrics.Gauge(
            "gptoss_queue_depth", "Requests waiting for a batch slot or KV pages", tag_keys=keys)
        self.running = metrics.Gauge("gptoss_running_requests", "Requests being decoded or prefilled", tag_keys=keys)
        self.kv_usage = metrics.Gauge(
            "gptoss_kv_usage_ratio", "Share of KV pages in use, per pool (full / sliding layers)",
            tag_keys=keys + ("pool",))
        self.tokens = metrics.Counter(
            "gptoss_tokens", "Tokens computed, by phase (prefill = prompt tokens, decode = generated)",
            tag_keys=keys + ("phase",))
        self.ttft = metrics.Histogram(
            "gptoss_ttft_seconds", "Time to first token as the decode server streams it (remote prefill "
            "included)", boundaries=list(TTFT_BUCKETS), tag_keys=keys)
        self.tpot = metrics.Histogram(
            "gptoss_tpot_seconds", "Time per output token after the first, per request",
            boundaries=list(TPOT_BUCKETS), tag_keys=keys)
        self.transfer_seconds = metrics.Histogram(
            "gptoss_kv_transfer_seconds", "K/V transfer time, prefill pack + decode receive",
            boundaries=list(TRANSFER_SECONDS_BUCKETS), tag_keys=keys + ("transport", "node"))
        self.transfer_bytes = metrics.Histogram(
            "gptoss_kv_transfer_bytes", "K/V bytes per transfer", boundaries=list(TRANSFER_BYTES_BUCKETS),
            tag_keys=keys + ("transport", "node"))
        self.steps = metrics.Counter(
            "gptoss_steps", "Engine steps by launch: lookahead (launched before the previous step's tokens were "
            "read, host work hidden behind the GPU) or sync", tag_keys=keys + ("launch",))
        self.forwards = metrics.Counter(
            "gptoss_forwards", "Model forwards by how they ran: decode_graph / prefill_graph (CUDA graph replays) "
            "or eager (kernel by kernel: CPU replicas, or steps no graph bucket holds)", tag_keys=keys + ("path",))
        self.fallbacks = metrics.Counter(
            "gptoss_prefill_fallbacks", "Requests whose remote prefill or K/V transfer failed, so decode "
            "ran the prompt itself", tag_keys=keys + ("reason",))
        self.prefix_tokens = metrics.Counter(
            "gptoss_prefix_cache_tokens", "Prompt tokens of admitted requests (kind=query) and those whose K/V "
            "came from cached prefixes (kind=hit; kind=host_hit: of those, the hits the host tier made, its blocks "
            "copied back from host memory); hit / query is the prefix cache's hit rate", tag_keys=keys + ("kind",))
        self.host_pages = metrics.Counter(
            "gptoss_host_kv_pages", "The prefix cache's host tier: evicted cached pages copied to host memory "
            "(direction=stored) and host pages copied back into the GPU's pool (direction=loaded)",
            tag_keys=keys + ("direction",))
        self.drafts = metrics.Counter(
            "gptoss_draft_tokens", "Draft tokens the engine ran as extra decode rows, by kind: verified (speculative "
            "drafts from a prediction or prompt lookup), accepted (of those), forced (structured output's forced "
            "tokens: jump-forward, all accepted)", tag_keys=keys + ("kind",))
        self.stream_items = metrics.Counter(
            "gptoss_stream_items", "Token deltas the replica streamed to its callers, one Ray Serve streaming item "
            "each; decode tokens per item is what coalescing and stream_items_per_s made of the engine's steps",
            tag_keys=keys)
        for m in (self.queue_depth, self.running, self.kv_usage, self.tokens, self.ttft, self.tpot,
                  self.transfer_seconds, self.transfer_bytes, self.steps, self.forwards, self.fallbacks,
                  self.prefix_tokens, self.host_pages, self.drafts, self.stream_items):
            m.set_default_tags(self.tags)
        self._last_tokens = {"prefill": 0, "decode": 0}
        self._last_steps = {"lookahead": 0, "sync": 0}
        self._last_prefix = {"query": 0, "hit": 0, "host_hit": 0}
        self._last_host_pages = {"stored": 0, "loaded": 0}
        self._last_paths = {"decode_graph": 0, "prefill_graph": 0, "eager": 0}
        self._last_drafts = {"verified": 0, "accepted": 0, "forced": 0}
        self._last_items = 0

    def observe_engine(self, snapshot: dict) -> None:
        self.queue_depth.set(snapshot.get("num_waiting", 0))
        self.running.set(snapshot.get("num_running", 0))
        for pool in ("full", "sliding"):
            total = snapshot.get(f"{pool}_pages_total")
            if total:
                self.kv_usage.set(snapshot[f"{pool}_pages_used"] / total, tags={"pool": pool})
        for phase in ("prefill", "decode"):
            self._advance(self.tokens, self._last_tokens, "phase", phase, snapshot.get(f"{phase}_tokens_total", 0))
        for kind, key in (("query", "prefix_query_tokens"), ("hit", "prefix_hit_tokens"), ("host_hit", "host_hit_tokens")):
            self._advance(self.prefix_tokens, self._last_prefix, "kind", kind, snapshot.get(key, 0))  # (cache on)
        for direction in ("stored", "loaded"):  # (with the host tier)
            self._advance(self.host_pages, self._last_host_pages, "direction", direction,
                          snapshot.get(f"host_pages_{direction}", 0))
        ahead = snapshot.get("lookahead_steps_total", 0)
        for launch, now in (("lookahead", ahead), ("sync", snapshot.get("steps_total", 0) - ahead)):
            self._advance(self.steps, self._last_steps, "launch", launch, now)
        paths = snapshot.get("steps_by_path_total", {})
        for path in self._last_paths:
            self._advance(self.forwards, self._last_paths, "path", path, paths.get(path, 0))
        for kind, key in (("verified", "draft_tokens_total"), ("accepted", "draft_accepted_total"),
                          ("forced", "jump_forward_tokens_total")):
            self._advance(self.drafts, self._last_drafts, "kind", kind, snapshot.get(key, 0))
        items = snapshot.get("stream_items_total", 0)
        if items > self._last_items:
            self.stream_items.inc(items - self._last_items)
        self._last_items = items

    @staticmethod
    def _advance(counter, last: dict, tag: str, value: str, now: int) -> None:
        """Forward an engine total to a Ray counter as the increment since the last poll."""
        if now > last[value]:
            counter.inc(now - last[value], tags={tag: value})
        last[value] = now

    def observe_request(self, ttft_s: float | None, tpot_s: float | None) -> None:
        if ttft_s is not None:
            self.ttft.observe(ttft_s)
        if tpot_s is not None:
            self.tpot.observe(tpot_s)

    def observe_transfer(self, transport: str, nbytes: int, seconds: float, node: str) -> None:
        """node: "same" when the prefill replica ran on the decode replica's node, else "other"."""
        tags = {"transport": transport, "node": node}
        self.transfer_seconds.observe(seconds, tags=tags)
        self.transfer_bytes.observe(float(nbytes), tags=tags)

    def observe_fallback(self, reason: str) -> None:
        self.fallbacks.inc(1, tags={"reason": reason})


class ApiMetrics:
    """What the ingress reports per engine request as it ends (serve_app/openai_api/usage.py): requests by model,
    endpoint, API key and outcome, and their tokens by kind (prompt, of which cached, and completion). `key` is
    the key's auth.key_id (a hash), or `none` where the app takes no keys: usage per client, for accounting."""

    def __init__(self):
        from ray.util import metrics

        self.tags = replica_tags("ingress")
        keys = tuple(self.tags) + ("model", "endpoint", "key")
        self.requests = metrics.Counter(
            "gptoss_api_requests", "Engine requests the API ended, by outcome (the finish reason, or cancelled, "
            "refused, failed); a request with n choices counts n", tag_keys=keys + ("outcome",))
        self.tokens = metrics.Counter(
            "gptoss_api_tokens", "Tokens of the engine requests the API ended, by kind: prompt, cached (of the "
            "prompt, from the prefix cache), completion", tag_keys=keys + ("kind",))
        for m in (self.requests, self.tokens):
            m.set_default_tags(self.tags)

    def record(self, usage) -> None:
        """A usage.UsageSink."""
        tags = {**self.tags, "model": usage.model, "endpoint": usage.endpoint, "key": usage.key or "none"}
        self.requests.inc(1, tags={**tags, "outcome": usage.outcome})
        for kind, count in (("prompt", usage.prompt_tokens), ("cached", usage.cached_tokens),
                            ("completion", usage.completion_tokens)):
            if count > 0:  # Ray counters take positive increments only
                self.tokens.inc(count, tags={**tags, "kind": kind})
