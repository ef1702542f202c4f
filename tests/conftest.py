"""Shared fixtures: tiny checkpoints and OpenAI's reference implementation (fetched as a wheel)."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
CACHE = ROOT / ".cache"


@pytest.fixture(autouse=True, scope="session")
def _offline_cache(tmp_path_factory):
    # Keep the Harmony vocab and the embedded tiny model out of the user's home during tests.
    os.environ.setdefault("GPTOSS_CACHE_DIR", str(CACHE / "gptoss"))


@pytest.fixture(scope="session")
def gpt_oss_reference():
    """OpenAI's `gpt_oss.torch.model` module. Its wheel declares Python >= 3.12, so it is downloaded
    with --no-deps for 3.12 metadata and imported from the wheel file (it is pure Python)."""
    wheel_dir = CACHE / "wheels"
    wheels = sorted(wheel_dir.glob("gpt_oss-0.0.9-*.whl"))
    if not wheels:
        subprocess.run(
            [sys.executable, "-m", "pip", "download", "-q", "--no-deps", "--only-binary=:all:",
             "--python-version", "3.12", "gpt-oss==0.0.9", "-d", str(wheel_dir)],
            check=True,
        )
        wheels = sorted(wheel_dir.glob("gpt_oss-0.0.9-*.whl"))
    sys.path.insert(0, str(wheels[0]))
    from gpt_oss.torch import model

    return model


@pytest.hookimpl(trylast=True)
def pytest_unconfigure(config):
    """After everything is reported, leave without the interpreter's teardown where Ray ran in this process: its
    driver-side threads (the Serve router's loop, the core worker's) outlive ray.shutdown(), and tearing the
    interpreter down under them segfaulted after every test had passed (one fresh-clone CI run in five on
    2026-12-01; again on 2026-12-05, 997 passed, with the router loop already stopped below). The exit status is
    pytest's own."""
    if "ray" not in sys.modules:
        return
    status = getattr(config, "_gptoss_exitstatus", None)
    if status is None:
        return
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(int(status))


def pytest_sessionfinish(session, exitstatus):
    """Stop Ray Serve's router event loop if a test started one in this process. Handles called from the
    driver run on a daemon thread with an event-loop monitor that records Ray metrics every few seconds,
    and it outlives ray.shutdown(): it was the one such thread alive when the run ended (2026-12-01), and
    one CI run in five segfaulted in interpreter teardown after every test had passed."""
    import time

    session.config._gptoss_exitstatus = exitstatus  # (for pytest_unconfigure)
    router = sys.modules.get("ray.serve._private.router")
    cls = getattr(router, "SingletonThreadRouter", None)
    loop = getattr(cls, "_asyncio_loop", None)
    if loop is None or not loop.is_running():
        return
    monitor = getattr(cls, "_event_loop_monitor", None)
    if monitor is not None:
        loop.call_soon_threadsafe(monitor.stop)
    loop.call_soon_threadsafe(loop.stop)
    deadline = time.monotonic() + 5
    while loop.is_running() and time.monotonic() < deadline:
        time.sleep(0.05)
