"""Where a decode replica's process spends its time: two py-spy recordings of it under load, summarized.

Through Serve at 512 streams on one GPU the decode replica's process reads ~1 CPU core busy while throughput tracks
the host's CPU speed (bench/RESULTS.md, "A third H100 instance"). Its engine thread and its asyncio loop share one
GIL, and the engine thread also spins in CUDA's synchronization (GIL released) while it waits for the GPU, so the core
count alone cannot say whether the GIL is the bound. Two recordings can:

- every thread, idle or not (`py-spy record --threads --idle`): per thread, the share of samples in each state (the
  engine thread waiting for the GPU, doing host work by engine phase, or idle; Serve's event loops (the replica's user
  code, its router, Ray's actor loop) and thread pools busy by callback, or idle);
- only the thread holding the GIL (`--gil`): the share of the wall time the GIL was held, by thread. Near 1.0 the GIL
  is the bound, and the shares say whose work to cut.

`record(pid, seconds, out_dir, stem)` runs both (one after the other) and returns `summarize(...)`'s dict;
bench/serve_launch.ServerProbe calls it for the decode replica during a load level (`python -m bench.serve_load
--py-spy SECONDS`). Run `python -m bench.pyspy_summary THREADS.txt GIL.txt RATE SECONDS` on saved recordings, and
`python -m bench.pyspy_summary --under LLMEngine._launch THREADS.txt` for what one function's samples were doing.
"""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
from collections import Counter
from pathlib import Path

RATE_HZ = 100


def parse_collapsed(text: str) -> list[tuple[str, list[str], int]]:
    """py-spy's raw output (`thread (TID): NAME;frame;...;frame COUNT` per line, outermost frame first, with
    --threads) as (thread name, [qualified function names, outermost first], count)."""
    rows = []
    for line in text.splitlines():
        stack, _, count = line.strip().rpartition(" ")
        if not stack or not count.isdigit():
            continue
        head, *frames = stack.split(";")
        thread = head.split("): ", 1)[1] if "): " in head else head
        rows.append((thread, [f.split(" (", 1)[0] for f in frames], int(count)))
    return rows


# Frames a thread sits in while it has nothing to do: its loop's or pool's own frame as the leaf (Ray Serve runs its
# asyncio loops on uvloop, whose select has no Python frame), or a wait.
_WAITING = ("_event_loop", "Thread.run", "Worker.main_loop", "_worker", "Condition.wait", "Event.wait", ".select",
            "_run_once")
# Frames below which a thread's work of the moment starts: a loop's callback, a pool's work item.
_ANCHORS = ("_event_loop", "Thread.run", "_WorkItem.run", "Handle._run", "Worker.main_loop")


def _after(frames: list[str], name: str) -> str | None:
    """The function called from the innermost `name` frame (None: no such frame, or it is the leaf)."""
    for i in range(len(frames) - 1, -1, -1):
        if frames[i] == name:
            return frames[i + 1] if i + 1 < len(frames) else None
    return None


def _thread_role(thread: str) -> str:
    """A thread's name without Python's counter: `Thread-3 (_run_router_event_loop)` -> `_run_router_event_loop`,
    `ThreadPoolExecutor-1_0` -> `ThreadPoolExecutor-1`."""
    if thread.startswith("Thread-") and "(" in thread:
        return thread[thread.index("(") + 1:].rstrip(")")
    return thread.rsplit("_", 1)[0] if thread.startswith("ThreadPoolExecutor-") else thread


def classify(thread: str, frames: list[str]) -> tuple[str, str]:
    """(role, state) of one sample: the engine thread (waiting for the GPU, host work by the engine step's phase, or
    idle), or another thread by name (idle, or busy with the callback or work item it runs)."""
    if "AsyncEngine._loop" in frames or thread == "gptoss-engine":
        if "HostTokens.wait" in frames:
            return "engine thread", "waits for the GPU (HostTokens.wait)"
        step = _after(frames, "LLMEngine._step") or _after(frames, "LLMEngine.step")
        if step is not None or "LLMEngine.step" in frames:
            return "engine thread", f"host: {step or 'LLMEngine.step'}"
        if frames and frames[-1].endswith(("Event.wait", "Condition.wait")):
            return "engine thread", "idle"
        return "engine thread", f"host: {_after(frames, 'AsyncEngine._loop') or frames[-1]}"
    frames = [f for f in frames if f != "?"]
    if not frames:
        return "threads without Python frames", "native"
    role = _thread_role(thread)
    if frames[-1].endswith(_WAITING):
        return role, "idle"
    if frames[-1].endswith(_ANCHORS):  # its work is native code (no Python frame of its own)
        return role, f"busy: native code under {frames[-1]}"
    for i in range(len(frames) - 2, -1, -1):
        if frames[i].endswith(_ANCHORS):
            return role, f"busy: {frames[i + 1]}"
    return role, f"busy: {frames[-1]}"


def summarize(threads_text: str, gil_text: str, rate_hz: float, seconds: float) -> dict:
    """Per role: samples and the share of each state (`threads`, from the --idle recording); the GIL held as a
    share of the wall time, in all and by role (`gil`, from the --gil recording: one sample per tick at most)."""
    by_role: dict[str, Counter] = {}
    for thread, frames, count in parse_collapsed(threads_text):
        role, state = classify(thread, frames)
        by_role.setdefault(role, Counter())[state] += count
    threads = {}
    for role, states in sorted(by_role.items(), key=lambda kv: -sum(kv[1].values())):
        total = sum(states.values())
        threads[role] = {"samples": total, "states": {s: round(n / total, 3) for s, n in states.most_common(12)}}
    ticks = max(1.0, rate_hz * seconds)
    held = Counter()
    for thread, frames, count in parse_collapsed(gil_text):
        role, state = classify(thread, frames)
        held[f"{role} / {state}"] += count
    gil = {"held_share": round(sum(held.values()) / ticks, 3),
           "by_holder": {k: round(n / ticks, 3) for k, n in held.most_common(12)}}
    return {"rate_hz": rate_hz, "seconds": seconds, "threads": threads, "gil": gil}


def children(threads_text: str, anchor: str, depth: int = 1, thread_of=None) -> dict[str, float]:
    """What the samples inside the innermost `anchor` frame were doing: the next `depth` frames below it (joined by
    ';'; "(self)": in the anchor itself), as shares of every sample of the threads that ever run `anchor` (or of
    `thread_of`'s), most first. E.g. ("LLMEngine._launch", 2) splits the engine thread's launches by callee."""
    rows = parse_collapsed(threads_text)
    threads = {t for t, f, _ in rows if anchor in f} if thread_of is None else {thread_of}
    total = sum(c for t, _, c in rows if t in threads)
    out: Counter = Counter()
    for thread, frames, count in rows:
        if thread not in threads or anchor not in frames:
            continue
        i = len(frames) - 1 - frames[::-1].index(anchor)
        out[";".join(frames[i + 1: i + 1 + depth]) or "(self)"] += count
    return {k: round(n / max(total, 1), 3) for k, n in out.most_common()}


def record(pid: int, seconds: float, out_dir: Path, stem: str, rate_hz: float = RATE_HZ) -> dict:
    """Both recordings of `pid` (`seconds` each, one after the other), saved as OUT/STEM_{threads,gil}.txt, and
    their summary; {"error": ...} when py-spy is missing or cannot attach."""
    beside = Path(sys.executable).parent / "py-spy"  # a virtual environment's, when its bin/ is not on PATH
    exe = shutil.which("py-spy") or (str(beside) if beside.exists() else None)
    if exe is None:
        return {"error": "py-spy is not installed"}
    texts = {}
    for kind, flags in (("threads", ["--idle"]), ("gil", ["--gil"])):
        path = Path(out_dir) / f"{stem}_{kind}.txt"
        cmd = [exe, "record", "--pid", str(pid), "--duration", str(int(seconds)), "--rate", str(int(rate_hz)),
               "--threads", "--nonblocking", "--format", "raw", "-o", str(path), *flags]
        done = subprocess.run(cmd, capture_output=True, text=True, timeout=seconds + 30)
        if done.returncode != 0 or not path.exists():
            return {"error": f"py-spy {kind}: exit {done.returncode}: {(done.stderr or done.stdout)[-300:]}"}
        texts[kind] = path.read_text()
    return summarize(texts["threads"], texts["gil"], rate_hz, seconds)


def main(argv: list[str]) -> int:
    if len(argv) == 3 and argv[0] == "--under":  # --under FUNCTION THREADS.txt: what FUNCTION's samples did
        for callee, share in children(Path(argv[2]).read_text(), argv[1], depth=2).items():
            print(f"{share:7.1%}  {callee}")
        return 0
    if len(argv) != 4:
        print(__doc__.strip().splitlines()[-1])
        return 2
    threads, gil, rate, seconds = argv
    print(json.dumps(summarize(Path(threads).read_text(), Path(gil).read_text(), float(rate), float(seconds)),
                     indent=2))
    return 0


if __name__ == "__main__":
    raise SystemExit(main(sys.argv[1:]))
