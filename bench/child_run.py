"""One phase of a probe in a fresh process (its own kernel caches, as a new replica), bounded in time.

The child writes its record as JSON into `out` after every phase it finishes, so a child that runs into the
timeout still leaves what it measured; the child runs in a session of its own, so a timeout stops it and
everything it started (bench/warm_up_probe.py, bench/triton_precompile_probe.py)."""

from __future__ import annotations

import json
import os
import subprocess
from pathlib import Path


def run_child(cmd: list[str], env: dict, out: str | Path, timeout: float, name: dict) -> dict:
    """Run `cmd`; the record it left in `out` (or `name` alone), with "exit": its code or "timeout"."""
    proc = subprocess.Popen(cmd, env=env, start_new_session=True)
    try:
        rc = proc.wait(timeout=timeout)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, 9)
        proc.wait()
        rc = "timeout"
    out = Path(out)
    record = json.loads(out.read_text()) if out.exists() else dict(name)
    record["exit"] = rc
    return record
