"""What prefill and decode replicas share: picking the device, loading the engine, reporting its metrics.

A replica runs one model instance. With tp_size = ep_size = 1 the engine runs in the replica's own
process. With TP/EP over N GPUs the replica process is rank 0 (it schedules, samples and broadcasts
each step) and ranks 1..N-1 are `engine.distributed.RankWorker` Ray actors pinned to bundles 1..N-1 of
the replica's STRICT_PACK placement group (`placement.start_rank_workers`), so one model instance
never spans nodes. On CPU, ranks 1..N-1 are spawned processes. Several model instances per replica
(dp_size > 1) are not built: such replicas fail at start with a message that says so.
"""

from __future__ import annotations

import asyncio
import logging

from serve_app.config import ServeAppConfig, random_model_config, tiny_model_path
from serve_app.deployment_settings import DeploymentSettings
from serve_app.harmony.constrain import HARMONY_VOCAB_SIZE, warm_up_in_background
from serve_app.metrics import ServerMetrics
from serve_app.placement import ReplicaResources, local_cuda_device, start_rank_workers

# Serve routes this logger to the replica's log file (and the dashboard's log view).
log = logging.getLogger("ray.serve")

METRICS_INTERVAL_S = 2.0


class MultiRankReplicaError(RuntimeError):
    """A replica layout the runtime does not build (dp_size > 1: several model instances per replica)."""


def replica_device(config: ServeAppConfig) -> str:
    """`cpu`, or this replica's GPU as torch numbers it."""
    device = config.resolved_device()
    return "cpu" if device == "cpu" else local_cuda_device()


def start_engine(config: ServeAppConfig, settings: DeploymentSettings, device: str):
    """Load the model and start an AsyncEngine on `device` (blocking: minutes for a real checkpoint)."""
    from engine.async_engine import AsyncEngine
    from engine.llm_engine import LLMEngine

    if config.dp_size > 1:
        raise MultiRankReplicaError(
            f"dp_size={config.dp_size} asks for {config.dp_size} model instances per replica, which is not "
            "built: use dp_size=1 and more replicas (autoscaling) instead")
    engine_config = config.engine_config(device, config.role_of(settings))
    # random:<shape>: weights drawn from config.seed, alike on every replica (prefill and decode agree)
    random_shapes = random_model_config(config.model) if config.random_model is not None else None
    folder = None if random_shapes is not None else config.model or str(tiny_model_path())
    if engine_config.world_size > 1 and device != "cpu":
        engine = _start_over_rank_actors(folder, engine_config, ReplicaResources.of(config, settings, "cuda"),
                                         random_shapes, config.seed)
    elif random_shapes is not None:
        engine = LLMEngine.with_random_weights(random_shapes, engine_config, seed=config.seed)
    else:  # one rank, or CPU ranks as spawned processes
        engine = LLMEngine.from_checkpoint(folder, engine_config)
    if config.warm_up:
        from engine.warm_up import warm_up

        report = warm_up(engine)
        log.info("engine warmed up in %.2f s: %d steps, paths %s", report["seconds"], report["steps"],
                 report["steps_by_path"])
    log.info("engine ready on %s (tp=%d, ep=%d): model %s, context %d, pages %s", device, config.tp_size,
             config.ep_size, folder or config.model, engine.max_model_len, engine.block_manager.usage())
    if engine.vocab_size == HARMONY_VOCAB_SIZE:
        warm_up_in_background()  # structured output's tokenizer, off the engine loop
    return AsyncEngine(engine, coalesce=config.stream_coalescing, health=config.health_policy(),
                       stream_items_per_s=config.stream_items_per_s)


def replica_fingerprint(config: ServeAppConfig, engine) -> str:
    """The deployment's `system_fingerprint` (engine/fingerprint.py) from its engine (an LLMEngine): its weights,
    model shapes, GPU model and the settings that change numerics; alike on every replica on like GPUs."""
    from engine.fingerprint import checkpoint_identity, engine_fingerprint

    if config.random_model is not None:
        return engine_fingerprint(engine, f"{config.model} seed {config.seed}")
    return engine_fingerprint(engine, checkpoint_identity(config.model or tiny_model_path()))


def _start_over_rank_actors(folder: str | None, engine_config, resources: ReplicaResources, random_shapes=None,
                            seed: int = 0):
    import ray

    from engine.distributed import Executor, RankWorker, local_group

    spec = local_group(engine_config.world_size, device=engine_config.device)  # localhost: STRICT_PACK = one node
    actors = start_rank_workers(ray.remote(RankWorker), resources, spec, local_cuda_device)
    return Executor.over_ray_actors(spec, actors).start_engine(folder, engine_config, owns_executor=True,
                                                               model=random_shapes, seed=seed)


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
        engine.engine.close()  # frees the K/V cache and stops rank workers, if any
