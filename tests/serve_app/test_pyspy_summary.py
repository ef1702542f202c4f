"""bench/pyspy_summary.py: py-spy's collapsed stacks of a decode replica summarized per thread and per GIL holder,
on recordings written out here in py-spy's raw format (and, where py-spy can attach on this machine, on a real one)."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

import pytest

from bench.pyspy_summary import children, classify, parse_collapsed, record, summarize

BOOT = "Thread._bootstrap (threading.py:1002);Thread._bootstrap_inner (threading.py:1045);Thread.run (threading.py:982)"
ENGINE = f"thread (0x11): gptoss-engine;{BOOT};AsyncEngine._run (async_engine.py:291);AsyncEngine._loop (async_engine.py:320)"
LOOP = f"thread (0x12): Thread-1 (_run_user_code_event_loop);{BOOT};_run_user_code_event_loop (replica.py:900)"
POOL = f"thread (0x13): ThreadPoolExecutor-1_0;{BOOT};_worker (thread.py:89)"

THREADS = "\n".join([
    f"{ENGINE};LLMEngine.step (llm_engine.py:241);LLMEngine._step (llm_engine.py:260);LLMEngine._resolve "
    f"(llm_engine.py:380);HostTokens.wait (sampler.py:266) 60",
    f"{ENGINE};LLMEngine.step (llm_engine.py:241);LLMEngine._step (llm_engine.py:270);LLMEngine._launch "
    f"(llm_engine.py:292);StepArrayBuilder.build (step_arrays.py:230) 25",
    f"{ENGINE};LLMEngine.step (llm_engine.py:241);LLMEngine._step (llm_engine.py:262);LLMEngine._resolve "
    f"(llm_engine.py:400) 10",
    f"{ENGINE};Event.wait (threading.py:629) 5",
    f"{LOOP} 70",
    f"{LOOP};DecodeServer.generate (decode_server.py:80);AsyncEngine._drain (async_engine.py:230) 30",
    f"{POOL} 90",
    f"{POOL};_WorkItem.run (thread.py:58);SerializationContext.serialize (serialization.py:500) 10",
    "thread (0x14): thread (0x14);? 100",
    "a line that is not a sample",
])
GIL = "\n".join([
    f"{ENGINE};LLMEngine.step (llm_engine.py:241);LLMEngine._step (llm_engine.py:270);LLMEngine._launch "
    f"(llm_engine.py:292) 25",
    f"{LOOP};DecodeServer.generate (decode_server.py:80) 30",
    f"{POOL};_WorkItem.run (thread.py:58);SerializationContext.serialize (serialization.py:500) 5",
])


def test_parse_keeps_thread_names_frames_and_counts():
    rows = parse_collapsed(THREADS)
    assert len(rows) == 9  # the line that is not a sample is skipped
    thread, frames, count = rows[0]
    assert thread == "gptoss-engine" and count == 60
    assert frames[0] == "Thread._bootstrap" and frames[-1] == "HostTokens.wait"


def test_each_sample_gets_its_threads_role_and_state():
    states = [classify(thread, frames) for thread, frames, _ in parse_collapsed(THREADS)]
    assert states == [
        ("engine thread", "waits for the GPU (HostTokens.wait)"),
        ("engine thread", "host: LLMEngine._launch"),
        ("engine thread", "host: LLMEngine._resolve"),
        ("engine thread", "idle"),
        ("_run_user_code_event_loop", "idle"),
        ("_run_user_code_event_loop", "busy: DecodeServer.generate"),
        ("ThreadPoolExecutor-1", "idle"),
        ("ThreadPoolExecutor-1", "busy: SerializationContext.serialize"),
        ("threads without Python frames", "native"),
    ]


def test_summary_shares_per_thread_and_gil_held_over_the_wall_time():
    out = summarize(THREADS, GIL, rate_hz=100, seconds=1.0)
    engine = out["threads"]["engine thread"]
    assert engine["samples"] == 100
    assert engine["states"] == {"waits for the GPU (HostTokens.wait)": 0.6, "host: LLMEngine._launch": 0.25,
                                "host: LLMEngine._resolve": 0.1, "idle": 0.05}
    assert out["threads"]["_run_user_code_event_loop"]["states"] == {"idle": 0.7, "busy: DecodeServer.generate": 0.3}
    assert out["gil"]["held_share"] == 0.6  # 60 samples with a holder of 100 ticks
    assert out["gil"]["by_holder"] == {"_run_user_code_event_loop / busy: DecodeServer.generate": 0.3,
                                       "engine thread / host: LLMEngine._launch": 0.25,
                                       "ThreadPoolExecutor-1 / busy: SerializationContext.serialize": 0.05}


def test_children_split_a_functions_samples_by_callee():
    # the engine thread's 100 samples: 60 wait inside _resolve, 10 in _resolve itself, 25 in _launch
    assert children(THREADS, "LLMEngine._step") == {"LLMEngine._resolve": 0.7, "LLMEngine._launch": 0.25}
    assert children(THREADS, "LLMEngine._resolve") == {"HostTokens.wait": 0.6, "(self)": 0.1}
    assert children(THREADS, "LLMEngine._launch", depth=2) == {"StepArrayBuilder.build": 0.25}
    assert children(THREADS, "no such function") == {}


def _can_attach() -> bool:
    exe = shutil.which("py-spy") or shutil.which("py-spy", path=str(Path(sys.executable).parent))
    if exe is None:
        return False
    probe = subprocess.run([exe, "dump", "--pid", str(os.getpid())], capture_output=True, timeout=30)
    return probe.returncode == 0


def test_a_real_recording_of_a_busy_thread(tmp_path):
    """py-spy attached to a process whose named thread spins and whose main thread sleeps (skipped where py-spy is
    missing or may not attach: a container without ptrace)."""
    if not _can_attach():
        pytest.skip("py-spy cannot attach to a process here")
    child = subprocess.Popen([sys.executable, "-c", (
        "import threading, time\n"
        "def spin():\n"
        "    while True:\n"
        "        sum(range(1000))\n"
        "threading.Thread(target=spin, name='spinner', daemon=True).start()\n"
        "time.sleep(60)\n")])
    try:
        time.sleep(1.0)
        out = record(child.pid, 2, tmp_path, "probe", rate_hz=50)
    finally:
        child.kill()
    assert "error" not in out, out
    spinner = out["threads"]["spinner"]["states"]
    assert spinner.get("busy: spin", 0) > 0.8, spinner
    assert out["threads"]["MainThread"]["states"].get("busy: <module>", 0) > 0.8  # (time.sleep has no Python frame)
    assert out["gil"]["held_share"] > 0.5 and "spinner / busy: spin" in out["gil"]["by_holder"]
    assert (tmp_path / "probe_threads.txt").exists() and (tmp_path / "probe_gil.txt").exists()
