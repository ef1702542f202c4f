"""bench/decode_timeline.py's accounting of overlapping kernel spans (pure Python: runs without a GPU)."""

from __future__ import annotations

from bench.decode_timeline import kernel_spans, step_profile


def test_overlaps_idle_gaps_and_exclusive_time_are_accounted():
    # a: 0-10, b: 8-20 (overlaps a by 2, as a PDL launch does), idle 20-25, c: 25-30, a again: 30-31
    spans = [(0.0, 10.0, "a"), (8.0, 20.0, "b"), (25.0, 30.0, "c"), (30.0, 31.0, "a")]
    got = step_profile(spans)
    assert got["wall_us"] == 31.0 and got["busy_us"] == 26.0 and got["idle_us"] == 5.0
    assert got["kernel_sum_us"] == 28.0 and got["kernels"] == 4
    rows = {r["name"]: r for r in got["by_name"]}
    assert rows["a"] == {"name": "a", "calls": 2, "dur_us": 11.0, "adds_us": 11.0, "exclusive_us": 9.0,
                         "idle_before_us": 0.0}
    assert rows["b"]["adds_us"] == 10.0 and rows["c"]["adds_us"] == 10.0  # c's includes the idle before it
    assert sum(r["adds_us"] for r in got["by_name"]) == got["wall_us"]
    assert rows["b"]["exclusive_us"] == 10.0 and rows["b"]["dur_us"] == 12.0
    assert rows["c"]["idle_before_us"] == 5.0 and rows["c"]["exclusive_us"] == 5.0
    assert [r["name"] for r in got["by_name"]] == ["a", "b", "c"]  # by what each adds to the step


def test_kernel_spans_read_only_device_kernels_in_start_order():
    trace = {"traceEvents": [
        {"ph": "X", "cat": "kernel", "name": "late", "ts": 5.0, "dur": 1.0},
        {"ph": "X", "cat": "cuda_runtime", "name": "cudaGraphLaunch", "ts": 0.0, "dur": 3.0},
        {"ph": "X", "cat": "kernel", "name": "early", "ts": 1.0, "dur": 2.0},
        {"ph": "i", "cat": "kernel", "name": "marker", "ts": 2.0},
    ]}
    assert kernel_spans(trace) == [(1.0, 3.0, "early"), (5.0, 6.0, "late")]


def test_no_kernels_is_an_empty_step():
    assert step_profile([]) == {"wall_us": 0.0, "busy_us": 0.0, "idle_us": 0.0, "kernel_sum_us": 0.0, "kernels": 0,
                                "by_name": []}
