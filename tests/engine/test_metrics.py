"""Engine metrics: counts that follow from the run, and the same numbers through a Prometheus scrape."""

from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.parser import text_string_to_metric_families

from engine.metrics import PrometheusCollector
from tests.engine.engine_testlib import greedy, random_prompt, request, run_to_end


def test_snapshot_counts_and_prometheus_scrape(make_engine):
    engine = make_engine(max_num_batched_tokens=16)
    reqs = [request(f"r{i}", random_prompt(n, i), greedy(m)) for i, (n, m) in enumerate([(5, 4), (20, 6), (9, 1)])]
    for r in reqs:
        engine.add_request(r)
    snap = engine.metrics.snapshot()
    assert snap["num_waiting"] == 3 and snap["num_running"] == 0
    engine.step()
    snap = engine.metrics.snapshot()
    assert snap["num_running"] > 0 and snap["full_pages_used"] > 0 and snap["sliding_pages_used"] > 0
    run_to_end(engine)
    snap = engine.metrics.snapshot()
    assert snap["prefill_tokens_total"] == sum(len(r.prompt_ids) for r in reqs)
    # Each request's first token comes from its prefill; every later one is a decode token.
    assert snap["decode_tokens_total"] == sum(r.sampling.max_tokens - 1 for r in reqs)
    assert snap["requests_finished_total"] == {"length": 3} and snap["ttft_seconds"]["count"] == 3
    assert snap["tpot_seconds"]["count"] == 2  # a 1-token request has no time per output token
    assert snap["full_pages_used"] == 0 and snap["full_pages_free"] == snap["full_pages_total"]
    assert snap["decode_tokens_per_s"] > 0 and all(v >= 0 for v in snap["mean_step_us"].values())
    assert snap["steps_by_path_total"] == {"eager": snap["steps_total"]}  # no CUDA graphs on the CPU

    registry = CollectorRegistry()
    registry.register(PrometheusCollector(engine.metrics, labels={"replica": "decode-0"}))
    families = {f.name: f for f in text_string_to_metric_families(generate_latest(registry).decode())}
    sample = {(s.name, tuple(sorted(s.labels.items()))): s.value for f in families.values() for s in f.samples}
    rep = (("replica", "decode-0"),)
    assert sample[("gptoss_engine_prefill_tokens_total", rep)] == snap["prefill_tokens_total"]
    assert sample[("gptoss_engine_decode_tokens_total", rep)] == snap["decode_tokens_total"]
    assert sample[("gptoss_engine_lookahead_steps_total", rep)] == snap["lookahead_steps_total"] == 0  # off on CPU
    assert sample[("gptoss_engine_num_waiting", rep)] == 0
    assert sample[("gptoss_engine_steps_by_path_total", (("path", "eager"), ("replica", "decode-0")))] \
        == snap["steps_total"]
    assert sample[("gptoss_engine_kv_pages", (("pool", "sliding"), ("replica", "decode-0"), ("state", "free")))] \
        == snap["sliding_pages_free"]
    assert sample[("gptoss_engine_requests_finished_total", (("reason", "length"), ("replica", "decode-0")))] == 3
    assert sample[("gptoss_engine_ttft_seconds_count", rep)] == 3
    assert sample[("gptoss_engine_ttft_seconds_bucket", (("le", "+Inf"), ("replica", "decode-0")))] == 3
