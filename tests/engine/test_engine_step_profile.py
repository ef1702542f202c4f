"""bench/engine_step_profile.py's reading of a trace: graph events by their launch, steps between replays (pure
Python: runs without a GPU)."""

from __future__ import annotations

from bench.engine_step_profile import device_events, split_steps, summarize


def _trace():
    ev = []

    def runtime(name, corr, ts):
        ev.append({"ph": "X", "cat": "cuda_runtime", "name": name, "ts": ts, "dur": 1.0, "args": {"correlation": corr}})

    def device(cat, name, corr, ts, dur):
        ev.append({"ph": "X", "cat": cat, "name": name, "ts": ts, "dur": dur, "args": {"correlation": corr}})

    for i, base in enumerate((0.0, 100.0, 200.0)):  # three replays of a two-kernel graph, 100 us apart
        runtime("cudaGraphLaunch", 10 + i, base - 5)
        device("kernel", "g1", 10 + i, base, 40.0)
        device("kernel", "g2", 10 + i, base + 38.0, 50.0)  # overlaps g1 (PDL)
        if i < 2:  # between replays: a copy and a kernel launched one by one
            runtime("cudaMemcpyAsync", 20 + i, base + 60)
            device("gpu_memcpy", "Memcpy HtoD", 20 + i, base + 90.0, 2.0)
            runtime("cudaLaunchKernel", 30 + i, base + 61)
            device("kernel", "argmax", 30 + i, base + 93.0, 4.0)
    ev.append({"ph": "i", "cat": "kernel", "name": "marker", "ts": 3.0})
    return {"traceEvents": ev}


def test_graph_events_are_told_from_the_rest_by_their_launch():
    events = device_events(_trace())
    assert [e["start"] for e in events] == sorted(e["start"] for e in events)
    assert {e["name"] for e in events if e["graph"]} == {"g1", "g2"}
    assert {e["name"] for e in events if not e["graph"]} == {"Memcpy HtoD", "argmax"}


def test_steps_run_from_one_replay_to_the_next_with_what_ran_between():
    steps = split_steps(device_events(_trace()))
    assert len(steps) == 2
    for s in steps:
        assert s["period_us"] == 100.0 and s["graph_us"] == 88.0 and s["between_us"] == 12.0
        assert s["graph_kernels"] == 2
        assert [e["name"] for e in s["outside"]] == ["Memcpy HtoD", "argmax"] and s["outside_busy_us"] == 6.0
    summary = summarize(steps)
    assert summary["median_period_us"] == 100.0 and summary["mean_outside_events"] == 2.0
    assert [r["name"] for r in summary["outside_by_name"]] == ["argmax", "Memcpy HtoD"]  # by time per step
    assert summary["outside_by_name"][0] == {"name": "argmax", "per_step": 1.0, "mean_us": 4.0}


def test_no_replays_no_steps():
    assert split_steps([]) == [] and summarize([])["steps"] == 0
