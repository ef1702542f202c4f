"""The serving layout on a real local Ray cluster: rank 0 is an actor in bundle 0 of a STRICT_PACK
placement group (as a Serve replica is), rank 1 a RankWorker actor that serve_app.placement's
start_rank_workers pins to bundle 1. The engine generates what one process does; killing the rank-1
actor surfaces on rank 0 as WorkerFailedError."""

from __future__ import annotations

import os
from pathlib import Path

import pytest
import ray
from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

from engine.llm_engine import LLMEngine
from model.loader import load_model
from tests.engine.engine_testlib import run_to_end
from tests.engine.test_parallel_engine import TINY, config, requests

ROOT = Path(__file__).resolve().parents[2]
CPUS_PER_RANK = 0.5


@ray.remote
class Replica:
    """Stands in for a prefill/decode replica: it is rank 0 and starts its other ranks as actors."""

    def __init__(self, folder: str | None, tp: int, ep: int, random_shapes=None, seed: int = 0):
        """folder None: random weights of `random_shapes` drawn from `seed` on every rank (Serve's random:)."""
        self.folder, self.tp, self.ep = folder, tp, ep
        self.random_shapes, self.seed = random_shapes, seed
        self.start()

    def start(self) -> None:
        from engine.distributed import Executor, RankWorker, local_group
        from serve_app.placement import ReplicaResources, start_rank_workers

        engine_config = config(tp_size=self.tp, ep_size=self.ep, dtype="float32")
        spec = local_group(engine_config.world_size)  # one node (STRICT_PACK): rank 0 listens on localhost
        resources = ReplicaResources(engine_config.world_size, gpus_per_rank=0, cpus_per_rank=CPUS_PER_RANK)
        self.workers = start_rank_workers(ray.remote(RankWorker), resources, spec)
        self.executor = Executor.over_ray_actors(spec, self.workers)
        self.engine = self.executor.start_engine(self.folder, engine_config, owns_executor=True,
                                                 model=self.random_shapes, seed=self.seed)

    def close(self) -> list:
        """Clean shutdown: each worker's run() returns None (no error) before its actor is killed."""
        self.engine.close()
        return ray.get(self.executor.workers.refs)

    def generate(self) -> dict[str, list[int]]:
        for r in requests():
            self.engine.add_request(r)
        return {rid: r["ids"] for rid, r in run_to_end(self.engine).items()}

    def kill_rank_1_then_step(self) -> dict:
        from engine.llm_engine import StepFailedError

        ray.kill(self.workers[0])
        for r in requests():
            self.engine.add_request(r)
        try:
            for _ in range(50):
                self.engine.step()
        except StepFailedError as exc:
            cause = exc.__cause__
            return {"type": type(cause).__name__, "rank": getattr(cause, "rank", None), "message": str(cause)}
        finally:
            self.engine.close()
        return {"type": None}


@pytest.fixture(scope="module")
def ray_cluster():
    ray.init(num_cpus=2, include_dashboard=False,
             runtime_env={"env_vars": {"PYTHONPATH": str(ROOT), "GPTOSS_CACHE_DIR": os.environ["GPTOSS_CACHE_DIR"]}})
    try:
        yield
    finally:
        ray.shutdown()


def test_rank_workers_as_ray_actors_in_a_placement_group(ray_cluster, tmp_path):
    from model.tiny import make_tiny

    make_tiny(tmp_path, **TINY)
    engine = LLMEngine(load_model(tmp_path, dtype="float32", progress=False), config())
    for r in requests():
        engine.add_request(r)
    expected = {rid: r["ids"] for rid, r in run_to_end(engine).items()}

    group = ray.util.placement_group([{"CPU": CPUS_PER_RANK}] * 2, strategy="STRICT_PACK")
    ray.get(group.ready(), timeout=60)
    replica = Replica.options(num_cpus=CPUS_PER_RANK, scheduling_strategy=PlacementGroupSchedulingStrategy(
        group, placement_group_bundle_index=0, placement_group_capture_child_tasks=True)).remote(str(tmp_path), 2, 2)
    assert ray.get(replica.generate.remote(), timeout=120) == expected
    assert ray.get(replica.close.remote(), timeout=60) == [None]
    ray.get(replica.start.remote(), timeout=120)
    failure = ray.get(replica.kill_rank_1_then_step.remote(), timeout=120)
    assert failure["type"] == "WorkerFailedError" and failure["rank"] == 1, failure
    assert "worker actor died" in failure["message"], failure
    ray.kill(replica)
    ray.util.remove_placement_group(group)


def test_random_weights_over_ray_actors_match_spawned_ranks(ray_cluster):
    """Serve's `model=random:<shape>` on a multi-GPU replica starts its ranks as Ray actors that draw their
    shards from the seed: the same shards, so the same tokens, as ranks started as processes."""
    from model.tiny import tiny_config

    shapes = tiny_config(**{k: v for k, v in TINY.items() if k not in ("dtype", "seed")})
    spawned = LLMEngine.with_random_weights(shapes, config(tp_size=2, ep_size=2, dtype="float32"), seed=5)
    try:
        for r in requests():
            spawned.add_request(r)
        expected = {rid: r["ids"] for rid, r in run_to_end(spawned).items()}
    finally:
        spawned.close()
    group = ray.util.placement_group([{"CPU": CPUS_PER_RANK}] * 2, strategy="STRICT_PACK")
    ray.get(group.ready(), timeout=60)
    replica = Replica.options(num_cpus=CPUS_PER_RANK, scheduling_strategy=PlacementGroupSchedulingStrategy(
        group, placement_group_bundle_index=0, placement_group_capture_child_tasks=True)).remote(None, 2, 2, shapes, 5)
    try:
        assert ray.get(replica.generate.remote(), timeout=120) == expected
        assert ray.get(replica.close.remote(), timeout=60) == [None]
    finally:
        ray.kill(replica)
        ray.util.remove_placement_group(group)
