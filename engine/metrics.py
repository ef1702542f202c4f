"""Engine metrics: a plain-dict snapshot, and a prometheus_client collector that reads the same numbers.

The engine thread updates `EngineMetrics`; scrapers (Prometheus, Ray's metrics agent through a
deployment, the benchmark) only read. Counters are totals since start (Prometheus derives rates);
the snapshot also carries tokens/s over a recent window for humans.
"""

from __future__ import annotations

import bisect
import threading
import time
from collections import deque
from dataclasses import dataclass

TTFT_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0)
TPOT_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 1.0)


class Histogram:
    def __init__(self, bounds: tuple[float, ...]):
        self.bounds = bounds
        self.counts = [0] * (len(bounds) + 1)  # last: above every bound
        self.sum = 0.0
        self.count = 0

    def observe(self, value: float) -> None:
        self.counts[bisect.bisect_left(self.bounds, value)] += 1
        self.sum += value
        self.count += 1

    def cumulative(self) -> list[tuple[str, int]]:
        """Prometheus buckets: (upper bound, observations <= bound), ending with +Inf."""
        out, total = [], 0
        for bound, n in zip((*map(str, self.bounds), "+Inf"), self.counts):
            total += n
            out.append((bound, total))
        return out

    def snapshot(self) -> dict:
        return {"count": self.count, "sum": self.sum, "mean": self.sum / self.count if self.count else None}


@dataclass
class StepTimes:
    """Seconds spent in one step's phases. On a GPU `forward` also absorbs the wait for the device:
    the sampled ids are read once per step, after everything else is queued."""

    schedule: float = 0.0
    prepare: float = 0.0  # step metadata (host) and imported K/V writes
    forward: float = 0.0  # model forward + sampler + the one device-to-host read
    update: float = 0.0  # sequences, page freeing, deltas

    @property
    def host_overhead(self) -> float:
        return self.schedule + self.prepare + self.update


class EngineMetrics:
    def __init__(self, window_s: float = 10.0, clock=time.monotonic):
        self.clock = clock
        self.window_s = window_s
        self._lock = threading.Lock()
        self._zero()

    def reset(self) -> None:
        """Every counter, gauge and histogram back to where a new engine starts (after its warm-up)."""
        with self._lock:
            self._zero()

    def _zero(self) -> None:
        self.start = self.clock()
        self.prefill_tokens_total = 0
        self.decode_tokens_total = 0
        self.steps_total = 0
        self.preemptions_total = 0
        self.lookahead_steps_total = 0  # steps launched before the previous step's tokens were read
        self.draft_tokens_total = 0  # speculative decoding: draft tokens verified, and accepted
        self.draft_accepted_total = 0
        self.jump_forward_tokens_total = 0  # structured output: forced tokens run as drafts
        self.steps_by_path_total: dict[str, int] = {}  # forwards by how they ran (ModelRunner.last_path)
        self.requests_added_total = 0
        self.requests_finished_total: dict[str, int] = {}
        self.kv_exported_total = 0
        self.kv_imported_total = 0
        self.num_waiting = 0
        self.num_running = 0
        self.num_prefilled = 0
        self.pages: dict[str, int] = {}
        self.ttft = Histogram(TTFT_BUCKETS)
        self.tpot = Histogram(TPOT_BUCKETS)
        self.step_seconds = StepTimes()  # totals over all steps
        self.last_step = StepTimes()
        self._recent: deque[tuple[float, int, int]] = deque()  # (time, prefill tokens, decode tokens)

    # ---- updates (engine thread) ------------------------------------------------------------------
    def record_step(self, num_prefill: int, num_decode: int, num_preempted: int, times: StepTimes) -> None:
        now = self.clock()
        with self._lock:
            self.steps_total += 1
            self.prefill_tokens_total += num_prefill
            self.decode_tokens_total += num_decode
            self.preemptions_total += num_preempted
            self.last_step = times
            for name in ("schedule", "prepare", "forward", "update"):
                setattr(self.step_seconds, name, getattr(self.step_seconds, name) + getattr(times, name))
            self._recent.append((now, num_prefill, num_decode))
            while self._recent and self._recent[0][0] < now - self.window_s:
                self._recent.popleft()

    def record_lookahead(self) -> None:
        with self._lock:
            self.lookahead_steps_total += 1

    def record_jump_forward(self, tokens: int) -> None:
        if tokens:
            with self._lock:
                self.jump_forward_tokens_total += tokens

    def record_drafts(self, drafted: int, accepted: int) -> None:
        if drafted:
            with self._lock:
                self.draft_tokens_total += drafted
                self.draft_accepted_total += accepted

    def record_path(self, path: str) -> None:
        with self._lock:
            self.steps_by_path_total[path] = self.steps_by_path_total.get(path, 0) + 1

    def record_added(self) -> None:
        with self._lock:
            self.requests_added_total += 1

    def record_first_token(self, seconds: float) -> None:
        with self._lock:
            self.ttft.observe(seconds)

    def record_finished(self, reason: str, num_output: int, first_token_time: float | None,
                        last_token_time: float | None) -> None:
        with self._lock:
            self.requests_finished_total[reason] = self.requests_finished_total.get(reason, 0) + 1
            if num_output > 1 and first_token_time is not None and last_token_time is not None:
                self.tpot.observe((last_token_time - first_token_time) / (num_output - 1))

    def record_transfer(self, exported: bool) -> None:
        with self._lock:
            if exported:
                self.kv_exported_total += 1
            else:
                self.kv_imported_total += 1

    def set_state(self, waiting: int, running: int, prefilled: int, pages: dict[str, int]) -> None:
        with self._lock:
            self.num_waiting, self.num_running, self.num_prefilled = waiting, running, prefilled
            self.pages = dict(pages)

    # ---- reads --------------------------------------------------------------------------------------
    def snapshot(self) -> dict:
        with self._lock:
            now = self.clock()
            span = min(self.window_s, max(now - self.start, 1e-9))
            recent_prefill = sum(p for t, p, _ in self._recent if t >= now - self.window_s)
            recent_decode = sum(d for t, _, d in self._recent if t >= now - self.window_s)
            steps = max(self.steps_total, 1)
            return {
                "num_waiting": self.num_waiting,
                "num_running": self.num_running,
                "num_prefilled": self.num_prefilled,
                **self.pages,
                "prefill_tokens_total": self.prefill_tokens_total,
                "decode_tokens_total": self.decode_tokens_total,
                "prefill_tokens_per_s": recent_prefill / span,
                "decode_tokens_per_s": recent_decode / span,
                "steps_total": self.steps_total,
                "preemptions_total": self.preemptions_total,
                "lookahead_steps_total": self.lookahead_steps_total,
                "draft_tokens_total": self.draft_tokens_total,
                "draft_accepted_total": self.draft_accepted_total,
                "jump_forward_tokens_total": self.jump_forward_tokens_total,
                "steps_by_path_total": dict(self.steps_by_path_total),
                "requests_added_total": self.requests_added_total,
                "requests_finished_total": dict(self.requests_finished_total),
                "kv_exported_total": self.kv_exported_total,
                "kv_imported_total": self.kv_imported_total,
                "ttft_seconds": self.ttft.snapshot(),
                "tpot_seconds": self.tpot.snapshot(),
                "mean_step_us": {name: 1e6 * getattr(self.step_seconds, name) / steps
                                 for name in ("schedule", "prepare", "forward", "update")},
            }

    def histograms(self) -> dict[str, tuple[list[tuple[str, int]], float]]:
        with self._lock:
            return {"ttft_seconds": (self.ttft.cumulative(), self.ttft.sum),
                    "tpot_seconds": (self.tpot.cumulative(), self.tpot.sum)}


class PrometheusCollector:
    """Register with `prometheus_client.REGISTRY.register(PrometheusCollector(metrics))` (or a registry
    of your own); every scrape reads the current numbers."""

    def __init__(self, metrics: EngineMetrics, namespace: str = "gptoss_engine",
                 labels: dict[str, str] | None = None):
        self.metrics = metrics
        self.namespace = namespace
        self.labels = dict(labels or {})

    def collect(self):
        from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, HistogramMetricFamily

        snap = self.metrics.snapshot()
        names, values = list(self.labels), list(self.labels.values())
        ns = self.namespace

        def gauge(name: str, doc: str, value: float) -> GaugeMetricFamily:
            g = GaugeMetricFamily(f"{ns}_{name}", doc, labels=names)
            g.add_metric(values, value)
            return g

        def counter(name: str, doc: str, value: float) -> CounterMetricFamily:
            c = CounterMetricFamily(f"{ns}_{name}", doc, labels=names)
            c.add_metric(values, value)
            return c

        yield gauge("num_waiting", "Requests waiting for a batch slot or KV pages", snap["num_waiting"])
        yield gauge("num_running", "Requests holding KV pages and being scheduled", snap["num_running"])
        pages = GaugeMetricFamily(f"{ns}_kv_pages", "KV pages per pool and state", labels=names + ["pool", "state"])
        for pool in ("full", "sliding"):
            for state in ("used", "free", "cached"):  # cached: named prefix blocks (prefix caching on)
                key = f"{pool}_pages_{state}"
                if key in snap:
                    pages.add_metric(values + [pool, state], snap[key])
        yield pages
        yield counter("prefill_tokens", "Prompt tokens computed (recomputation included)", snap["prefill_tokens_total"])
        yield counter("decode_tokens", "Tokens generated by decode steps", snap["decode_tokens_total"])
        yield counter("preemptions", "Sequences preempted by recompute", snap["preemptions_total"])
        if "prefix_query_tokens" in snap:  # prefix caching on
            yield counter("prefix_cache_query_tokens", "Prompt tokens of admitted requests", snap["prefix_query_tokens"])
            yield counter("prefix_cache_hit_tokens", "Prompt tokens whose K/V came from cached prefixes",
                          snap["prefix_hit_tokens"])
        if "host_hit_tokens" in snap:  # the host tier (engine/host_kv_tier.py)
            yield counter("prefix_cache_host_hit_tokens", "Prompt tokens whose K/V came from the host tier",
                          snap["host_hit_tokens"])
            yield counter("host_kv_pages_stored", "Evicted cached pages copied to host slots", snap["host_pages_stored"])
            yield counter("host_kv_pages_loaded", "Host slots copied back into GPU pages", snap["host_pages_loaded"])
            host = GaugeMetricFamily(f"{ns}_host_kv_slots", "Host tier slots per pool and state",
                                     labels=names + ["pool", "state"])
            for pool in ("full", "sliding"):
                for state in ("used", "total"):
                    if f"host_{pool}_slots_{state}" in snap:
                        host.add_metric(values + [pool, state], snap[f"host_{pool}_slots_{state}"])
            yield host
        yield counter("lookahead_steps", "Steps launched before the previous step's tokens were read",
                      snap["lookahead_steps_total"])
        yield counter("draft_tokens", "Speculative draft tokens verified", snap["draft_tokens_total"])
        yield counter("draft_accepted_tokens", "Speculative draft tokens accepted", snap["draft_accepted_total"])
        yield counter("jump_forward_tokens", "Forced tokens of structured output run as drafts (jump-forward)",
                      snap["jump_forward_tokens_total"])
        paths = CounterMetricFamily(f"{ns}_steps_by_path", "Forwards by how they ran: decode_graph, prefill_graph "
                                    "(piecewise CUDA graphs) or eager", labels=names + ["path"])
        for path, n in sorted(snap["steps_by_path_total"].items()):
            paths.add_metric(values + [path], n)
        yield paths
        finished = CounterMetricFamily(f"{ns}_requests_finished", "Finished requests by reason",
                                       labels=names + ["reason"])
        for reason, n in sorted(snap["requests_finished_total"].items()):
            finished.add_metric(values + [reason], n)
        yield finished
        for name, (buckets, total) in self.metrics.histograms().items():
            doc = "Time to first token" if name.startswith("ttft") else "Time per output token after the first"
            h = HistogramMetricFamily(f"{ns}_{name}", doc, labels=names)
            h.add_metric(values, buckets, total)
            yield h
