"""Shared by the Ray Serve tests: a local Ray instance, a reference engine, an HTTP server thread."""

from __future__ import annotations

import asyncio
import os
import socket
import sys
import threading
import time
from pathlib import Path
from typing import NamedTuple

import ray
from ray import serve

ROOT = Path(__file__).resolve().parents[2]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class RayPorts(NamedTuple):
    http: int
    metrics: int | None  # Ray's Prometheus export, when asked for


def start_ray(num_cpus: int = 8, http_port: int | None = None, export_metrics: bool = False,
              attempts: int = 2, **init_kwargs) -> RayPorts:
    """A local Ray instance with Serve's HTTP proxy on a free port (other test runs may hold :8000).
    Replicas see this checkout (PYTHONPATH, for test-defined deployments) and the test cache folder.

    Ports are picked right before Ray binds them (a port picked at import time can be some other
    connection's by the time the fixture runs). A start whose Ray processes die before they run (the
    proxy worker once exited during start-up on CI) is stopped whole and tried again with fresh ports;
    any other failure, or the last attempt's, is raised - after stopping the Ray it started, so one
    failed fixture does not fail every later ray.init in the session."""
    env = {"PYTHONPATH": str(ROOT), "GPTOSS_CACHE_DIR": os.environ["GPTOSS_CACHE_DIR"]}
    for attempt in range(1, attempts + 1):
        ports = RayPorts(http_port or free_port(), free_port() if export_metrics else None)
        metrics = {"_metrics_export_port": ports.metrics} if export_metrics else {}
        try:
            ray.init(num_cpus=num_cpus, include_dashboard=False, runtime_env={"env_vars": env},
                     **metrics, **init_kwargs)
            serve.start(http_options={"host": "127.0.0.1", "port": ports.http})
            return ports
        except ray.exceptions.RayActorError as e:  # a Ray process died before it ran
            stop_ray()
            if attempt == attempts:
                raise
            print(f"start_ray: attempt {attempt} of {attempts} failed ({type(e).__name__}: "
                  f"{str(e).splitlines()[0]}); starting a fresh Ray", file=sys.stderr)
        except BaseException:
            stop_ray()
            raise
    raise AssertionError("unreachable")


def stop_ray() -> None:
    if ray.is_initialized():
        try:
            serve.shutdown()
        finally:
            ray.shutdown()


def growing_conversation(rng, first: int, turns: int) -> list[list[int]]:
    """Prompts of a conversation: `first` random token ids, then `turns` more, each the previous plus 20-59 new."""
    prompts = [[rng.randrange(200000) for _ in range(first)]]
    for _ in range(turns):
        prompts.append(prompts[-1] + [rng.randrange(200000) for _ in range(rng.randrange(20, 60))])
    return prompts


def wait_until(predicate, timeout_s: float, what: str, interval_s: float = 0.5):
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        value = predicate()
        if value:
            return value
        time.sleep(interval_s)
    raise AssertionError(f"timed out after {timeout_s} s waiting for {what}")


def deployment_status(app: str, deployment: str):
    return serve.status().applications[app].deployments[deployment]


def running_replicas(app: str, deployment: str) -> int:
    return deployment_status(app, deployment).replica_states.get("RUNNING", 0)


def replica_actors(app: str, deployment: str) -> list:
    """(name, handle) of the live replica actors of a deployment (Serve names them
    SERVE_REPLICA::app#deployment#id in the "serve" namespace; no dashboard needed)."""
    prefix = f"SERVE_REPLICA::{app}#{deployment}#"
    names = sorted(a["name"] for a in ray.util.list_named_actors(all_namespaces=True)
                   if a["namespace"] == "serve" and a["name"].startswith(prefix))
    return [(name, ray.get_actor(name, namespace="serve")) for name in names]


def reference_engine(config):
    """The single-process engine the served app must agree with: same checkpoint, same engine settings."""
    import torch

    from engine.async_engine import AsyncEngine
    from engine.llm_engine import LLMEngine
    from serve_app.config import tiny_model_path

    # Replicas run with one torch thread (Ray sets OMP_NUM_THREADS from num_cpus); match their
    # reduction order so logits agree to the last bit.
    torch.set_num_threads(1)
    return AsyncEngine(LLMEngine.from_checkpoint(tiny_model_path(), config.engine_config("cpu")))


async def collect(stream) -> list:
    return [item async for item in stream]


def run_async(coro):
    return asyncio.run(coro)


class ServerThread:
    """uvicorn serving an ASGI app on 127.0.0.1:port in a background thread."""

    def __init__(self, app, port: int):
        import uvicorn

        self.port = port
        self.server = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=port, log_level="warning"))
        self.thread = threading.Thread(target=self.server.run, daemon=True)

    def __enter__(self) -> "ServerThread":
        self.thread.start()
        wait_until(lambda: self.server.started, 30, "the reference HTTP server")
        return self

    def __exit__(self, *exc) -> None:
        self.server.should_exit = True
        self.thread.join(10)
