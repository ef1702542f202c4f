"""bench.serve_stream_capacity's engine stand-in behind the real AsyncEngine, without Ray: every request gets its
tokens, steps keep their pace, and a stream budget makes fewer, larger deltas of the same tokens."""

from __future__ import annotations

from types import SimpleNamespace

from bench import serve_stream_capacity as bench


def args(**over) -> SimpleNamespace:
    return SimpleNamespace(**{"device_ms": 5.0, "host_ms": 0.2, "host_us_per_seq": 1.0, "tokens": 20, **over})


def test_paced_engine_runs_every_request_to_its_length_at_its_pace():
    raw = bench.run_local(args(), streams=6, budget=0.0)
    assert raw["tokens"] == raw["made"] == 6 * 20  # every token made reached its consumer
    assert raw["items"] == raw["tokens"]  # consumers keep up: one delta per step and request
    assert raw["steps"] >= 20 and raw["step_s"] / raw["steps"] >= 0.005  # never faster than the pace
    row = bench.summarize(raw, 6, 0.0, False, args())
    assert row["tokens_per_item"] == 1.0 and 5.0 <= row["step_ms"] and row["running_per_step"] <= 6


def test_a_stream_budget_sends_the_same_tokens_in_fewer_deltas():
    raw = bench.run_local(args(tokens=40), streams=4, budget=40.0)  # 4 streams: 100 ms between a stream's deltas
    assert raw["tokens"] == 4 * 40
    assert raw["items"] < raw["tokens"] / 3
