"""Where prefill and decode replicas, and the model workers inside them, run.

Each replica reserves one placement-group bundle per GPU of its model instance(s), `{CPU, GPU: 1, ...}`,
with the STRICT_PACK strategy: all bundles on one node or none, so a TP4/EP4 model never spans nodes
(its all-reduces stay on NVLink). A replica whose group cannot be placed whole waits (and, on an
autoscaling cluster, asks for a node) instead of starting split.

Rank layout inside a replica of N ranks (N = dp_size * max(tp_size, ep_size)):

    bundle 0  the replica actor itself = rank 0 (it schedules, samples and broadcasts the step)
    bundle r  a worker actor for rank r, r = 1 .. N-1, pinned there by `start_rank_workers`

Serve schedules the replica actor into bundle 0 and makes the group the default for everything the
replica starts, so workers, and any task they spawn, stay inside the reservation. With N = 1 (tp=1, the
CPU path) there are no worker actors: the model runs in the replica's process. The multi-rank worker
runtime (the rank-r actor class and its step broadcast) plugs in through `start_rank_workers`.

On CPU a replica reserves a single CPU bundle: the same code path, no GPUs.
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field
from typing import Any

from serve_app.config import ServeAppConfig
from serve_app.deployment_settings import DeploymentSettings

STRATEGY = "STRICT_PACK"
HEAD_NODE_RESOURCE = "node:__internal_head__"  # Ray's resource of the head node (ray._common.constants)
NOSET_CUDA_VISIBLE_DEVICES = "RAY_EXPERIMENTAL_NOSET_CUDA_VISIBLE_DEVICES"


class PlacementError(RuntimeError):
    """Workers were requested outside a replica's placement group, or the group is too small."""


@dataclass(frozen=True)
class ReplicaResources:
    """What one prefill or decode replica reserves."""

    num_ranks: int  # GPUs of the replica (one rank per GPU); 1 on CPU
    gpus_per_rank: int  # 1 on cuda, 0 on cpu
    cpus_per_rank: float
    extra_per_rank: dict[str, float] = field(default_factory=dict)
    memory_per_rank: int = 0  # bytes of host memory reserved (Ray's `memory` resource): the host K/V tier

    @staticmethod
    def of(config: ServeAppConfig, settings: DeploymentSettings, device: str) -> "ReplicaResources":
        gpu = device == "cuda"
        cpus = settings.cpus_per_worker
        if cpus is None:
            # GPU replicas: a core per rank for its host work. CPU replicas: half a core, so the quick
            # start's three deployments fit on a 2-core laptop (torch's threads are not capped by this).
            cpus = 1.0 if gpu else 0.5
        return ReplicaResources(config.gpus_per_replica if gpu else 1, 1 if gpu else 0, cpus,
                                dict(settings.resources_per_worker),
                                config.host_kv_bytes(config.role_of(settings)))

    def bundles(self) -> list[dict[str, float]]:
        bundle: dict[str, float] = {"CPU": self.cpus_per_rank, **self.extra_per_rank}
        if self.gpus_per_rank:
            bundle["GPU"] = float(self.gpus_per_rank)
        if self.memory_per_rank:
            bundle["memory"] = float(self.memory_per_rank)
        return [dict(bundle) for _ in range(self.num_ranks)]

    def deployment_options(self, env_vars: dict[str, str] | None = None) -> dict[str, Any]:
        """Serve deployment options: the per-replica placement group and the replica actor's share of
        bundle 0 (all of it: the replica is rank 0)."""
        actor: dict[str, Any] = {"num_cpus": self.cpus_per_rank, "num_gpus": self.gpus_per_rank}
        if self.memory_per_rank:
            actor["memory"] = self.memory_per_rank
        if self.extra_per_rank:
            actor["resources"] = dict(self.extra_per_rank)
        if env_vars:
            actor["runtime_env"] = {"env_vars": dict(env_vars)}
        return {
            "placement_group_bundles": self.bundles(),
            "placement_group_strategy": STRATEGY,
            "ray_actor_options": actor,
        }


def start_rank_workers(actor_class, resources: ReplicaResources, *args, **kwargs) -> list:
    """Start ranks 1 .. N-1 of this replica as `actor_class` actors, rank r pinned to bundle r of the
    replica's placement group. Call from inside the replica. `actor_class` is a `@ray.remote` class whose
    constructor takes `(rank, *args, **kwargs)`. Returns the actor handles, rank 1 first."""
    import ray
    from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

    if resources.num_ranks == 1:
        return []
    group = ray.util.get_current_placement_group()
    if group is None:
        raise PlacementError("start_rank_workers must run inside a replica that has a placement group "
                             "(deployment options from ReplicaResources.deployment_options)")
    if len(group.bundle_specs) < resources.num_ranks:
        raise PlacementError(f"the replica's placement group has {len(group.bundle_specs)} bundles; "
                             f"{resources.num_ranks} ranks need one each")
    workers = []
    for rank in range(1, resources.num_ranks):
        strategy = PlacementGroupSchedulingStrategy(group, placement_group_bundle_index=rank,
                                                    placement_group_capture_child_tasks=True)
        options: dict[str, Any] = {"num_cpus": resources.cpus_per_rank, "num_gpus": resources.gpus_per_rank,
                                   "scheduling_strategy": strategy}
        if resources.memory_per_rank:
            options["memory"] = resources.memory_per_rank
        if resources.extra_per_rank:
            options["resources"] = dict(resources.extra_per_rank)
        workers.append(actor_class.options(**options).remote(rank, *args, **kwargs))
    return workers


def local_cuda_device() -> str:
    """This replica's GPU as torch numbers it. Ray normally narrows CUDA_VISIBLE_DEVICES to the replica's
    GPUs (then it is cuda:0); with RAY_EXPERIMENTAL_NOSET_CUDA_VISIBLE_DEVICES, which the CUDA IPC
    transport needs to open a peer's memory, every GPU stays visible and the assigned id picks one."""
    import ray

    ids = [str(i) for i in ray.get_gpu_ids()]
    if not ids or os.environ.get(NOSET_CUDA_VISIBLE_DEVICES, "") in ("", "0"):
        return "cuda:0"
    visible = os.environ.get("CUDA_VISIBLE_DEVICES")
    if visible:
        order = [d.strip() for d in visible.split(",")]
        if ids[0] in order:
            return f"cuda:{order.index(ids[0])}"
    return f"cuda:{ids[0]}"
