"""bench/prefill_timeline.py's idle-gap attribution on synthetic chrome traces (pure Python: runs without a GPU)."""

from __future__ import annotations

from bench.prefill_timeline import (device_spans, forward_timeline, gap_summary, idle_gaps, launch_calls,
                                    launching_functions)


def _x(cat, name, ts, dur, corr=None, tid=1):
    e = {"ph": "X", "cat": cat, "name": name, "ts": ts, "dur": dur, "tid": tid}
    if corr is not None:
        e["args"] = {"correlation": corr}
    return e


def _trace():
    # graph launch at host t=0 runs k1 0-10 (corr 1) and k2 9-20 (corr 1, overlapping under PDL);
    # the host launches attention at t=30 (GPU idle since 20: 10 us host-late), attention runs 33-40 (3 us device);
    # a copy queued at host t=35 runs 45-46 (5 us idle, none the host's: launched before the GPU went idle at 40);
    # the last kernel is launched at t=44 through the driver API and runs 46.2-50 (a 0.2 us gap: under min_us).
    return {"traceEvents": [
        _x("cuda_runtime", "cudaGraphLaunch", 0.0, 25.0, 1),
        _x("kernel", "k1", 0.0, 10.0, 1),
        _x("kernel", "k2", 9.0, 11.0, 1),
        _x("cuda_runtime", "cudaLaunchKernel", 30.0, 2.0, 2),
        _x("kernel", "attention", 33.0, 7.0, 2),
        _x("cuda_runtime", "cudaMemcpyAsync", 35.0, 1.0, 3),
        _x("gpu_memcpy", "Memcpy HtoD", 45.0, 1.0, 3),
        _x("cuda_driver", "cuLaunchKernelEx", 44.0, 1.0, 4),
        _x("kernel", "k3", 46.2, 3.8, 4),
        {"ph": "f", "cat": "ac2g", "name": "flow", "ts": 1.0},
        _x("python_function", "engine/prefill_graphs.py(150): run", -1.0, 60.0),
        _x("python_function", "model/layers.py(40): attend", 29.0, 4.0),
        _x("python_function", "model/layers.py(40): attend", 29.0, 4.0, tid=2),  # another thread: not the launcher
        _x("python_function", "torch/nn/modules/module.py(1): _call_impl", 29.5, 3.0),  # not a project frame
    ]}


def test_spans_include_copies_and_launches_carry_their_thread():
    t = _trace()
    spans = device_spans(t)
    assert [s[2] for s in spans] == ["k1", "k2", "attention", "Memcpy HtoD", "k3"]
    assert spans[3] == (45.0, 46.0, "Memcpy HtoD", 3)
    calls = launch_calls(t)
    assert calls[1] == (0.0, "cudaGraphLaunch", 1) and calls[4] == (44.0, "cuLaunchKernelEx", 1)


def test_gaps_split_into_host_late_and_device_time():
    t = _trace()
    gaps = idle_gaps(device_spans(t), launch_calls(t), min_us=0.5)
    assert [(g["at_us"], g["us"], g["before"], g["after"]) for g in gaps] == [
        (20.0, 13.0, "k2", "attention"), (40.0, 5.0, "attention", "Memcpy HtoD")]
    first, second = gaps
    assert first["host_us"] == 10.0 and first["device_us"] == 3.0 and first["launch"] == "cudaLaunchKernel"
    assert second["host_us"] == 0.0 and second["device_us"] == 5.0  # launched at 35, before the GPU went idle
    assert len(idle_gaps(device_spans(t), launch_calls(t), min_us=0.1)) == 3  # the 0.2 us one too


def test_a_launch_later_than_the_gap_blames_the_host_for_the_whole_gap_only():
    spans = [(0.0, 10.0, "a", 1), (12.0, 13.0, "b", 2)]
    gaps = idle_gaps(spans, {2: (50.0, "cudaLaunchKernel", 1)})  # clock skew: the call "after" the kernel
    assert gaps[0]["host_us"] == 2.0 and gaps[0]["device_us"] == 0.0
    assert idle_gaps(spans, {})[0]["host_us"] == 0.0  # no launch record: nothing blamed on the host


def test_forward_timeline_totals_agree_with_the_span_accounting():
    got = forward_timeline(_trace())
    assert got["wall_us"] == 50.0 and got["kernels"] == 5
    assert got["gap_us"] == 18.0 and got["gap_host_us"] == 10.0 and got["gap_device_us"] == 8.0
    assert abs(got["idle_us"] - 18.2) < 1e-9  # step_profile also counts the 0.2 us gap below min_us
    assert got["gaps_by_next"][0] == {"after": "attention", "gaps": 1, "us": 13.0, "host_us": 10.0}
    assert [r["launch"] for r in got["gaps_by_launch"]] == ["cudaLaunchKernel", "cudaMemcpyAsync"]
    assert got["largest_gaps"][0]["after"] == "attention"


def test_gap_summary_sums_by_key_largest_first():
    gaps = [{"after": "x", "launch": "L", "us": 1.0, "host_us": 1.0},
            {"after": "y", "launch": "L", "us": 5.0, "host_us": 0.0},
            {"after": "x", "launch": "M", "us": 2.0, "host_us": 0.5}]
    assert gap_summary(gaps, "after") == [{"after": "y", "gaps": 1, "us": 5.0, "host_us": 0.0},
                                          {"after": "x", "gaps": 2, "us": 3.0, "host_us": 1.5}]
    assert gap_summary(gaps, "launch", top=1) == [{"launch": "L", "gaps": 2, "us": 6.0, "host_us": 1.0}]


def test_host_late_time_is_named_by_the_innermost_project_frame_on_the_launching_thread():
    t = _trace()
    gaps = idle_gaps(device_spans(t), launch_calls(t))
    assert launching_functions(t, gaps) == [{"function": "model/layers.py(40): attend", "gaps": 1, "host_us": 10.0}]
