"""What prefill and decode replicas share: picking the device, loading the engine, reporting its metrics.

A replica runs one model instance. With tp_size = ep_size = dp_size = 1 (every CPU replica, and a GPU
replica of one GPU) the engine runs in the replica's own process. Multi-rank replicas need the worker
runtime (rank 0 here schedules and broadcasts each step to ranks 1..N-1, started by
`placement.start_rank_workers` in the replica's placement group); until it exists they fail fast with
a message that says so, at replica start rather than at the first request.
"""

from __future__ import annotations

import asyncio
import logging

from serve_app.config import ServeAppConfig, tiny_model_path
from serve_app.metrics import ServerMetrics
from serve_app.placement import local_cuda_device

# Serve routes this logger to the replica's log file (and the dashboard's log view).
log = logging.getLogger("ray.serve")

METRICS_INTERVAL_S = 2.0


class MultiRankReplicaError(RuntimeError):
    """A replica of more than one GPU was requested; the multi-process worker runtime is not built yet."""


def replica_device(config: ServeAppConfig) -> str:
    """`cpu`, or this replica's GPU as torch numbers it."""
    device = config.resolved_device()
    return "cpu" if device == "cpu" else local_cuda_device()


def start_engine(config: ServeAppConfig, device: str):
    """Load the model and start an AsyncEngine on `device` (blocking: minutes for a real checkpoint)."""
    from engine.async_engine import AsyncEngine
    from engine.llm_engine import LLMEngine

    if config.gpus_per_replica > 1:
        raise MultiRankReplicaError(
            f"tp_size={config.tp_size}, ep_size={config.ep_size}, dp_size={config.dp_size} asks for "
            f"{config.gpus_per_replica} GPUs per replica, and the multi-rank worker runtime is not available "
            "yet: use tp_size=ep_size=dp_size=1 (one GPU per replica) for now")
    folder = config.model or str(tiny_model_path())
    engine = LLMEngine.from_checkpoint(folder, config.engine_config(device))
    log.info("engine ready on %s: model %s, context %d, pages %s", device, folder, engine.max_model_len,
             engine.block_manager.usage())
    return AsyncEngine(engine)


async def report_metrics_forever(engine, metrics: ServerMetrics, interval_s: float = METRICS_INTERVAL_S) -> None:
    """Forward the engine's counters to Ray's metrics every `interval_s` (a replica background task)."""
    while True:
        metrics.observe_engine(engine.metrics())
        await asyncio.sleep(interval_s)


def engine_stats(engine) -> dict:
    """Pool usage and counters of the replica's engine (the servers' `stats` debug method)."""
    return engine.metrics()


def stop_hosting(server) -> None:
    """Stop a server's metrics reporter and its engine (from `__del__`, so attributes may be missing)."""
    reporter = getattr(server, "_reporter", None)
    if reporter is not None:
        reporter.cancel()
    engine = getattr(server, "engine", None)
    if engine is not None:
        engine.shutdown()
