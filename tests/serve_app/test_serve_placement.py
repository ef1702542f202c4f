"""Replica placement on a simulated two-node cluster (ray.cluster_utils.Cluster, fake GPUs, device cpu).

Each node has 4 "GPUs". A replica of 4 ranks, with the deployment options the app computes for
ep_size=4 on cuda, lands whole on one node: the replica actor (rank 0) and its 3 rank workers started
by `start_rank_workers`. A replica of 6 ranks, which two nodes could only hold split, waits
(STRICT_PACK) instead of spanning them.
"""

from __future__ import annotations

import os
import time

import pytest
import ray
from ray import serve
from ray.cluster_utils import Cluster

from serve_app.config import ServeAppConfig
from serve_app.placement import STRATEGY, ReplicaResources, start_rank_workers
from tests.serve_app.serve_helpers import ROOT, deployment_status, stop_ray, wait_until


@ray.remote
class RankProbe:
    """Stands in for the model's rank-r worker: reports where Ray put it."""

    def __init__(self, rank: int):
        self.rank = rank

    def where(self) -> dict:
        return {"rank": self.rank, "node": ray.get_runtime_context().get_node_id(), "gpus": ray.get_gpu_ids()}


class ReplicaProbe:
    """Stands in for a prefill/decode replica: rank 0 itself, ranks 1..N-1 as pinned worker actors."""

    def __init__(self, resources: ReplicaResources):
        self.workers = start_rank_workers(RankProbe, resources)
        self.group = ray.util.get_current_placement_group()

    def where(self) -> dict:
        me = {"rank": 0, "node": ray.get_runtime_context().get_node_id(), "gpus": ray.get_gpu_ids()}
        table = ray.util.placement_group_table(self.group)
        return {"ranks": [me, *ray.get([w.where.remote() for w in self.workers])],
                "strategy": table["strategy"], "bundle_nodes": sorted(set(table["bundles_to_node_id"].values()))}


@pytest.fixture(scope="module")
def cluster():
    env = {"PYTHONPATH": str(ROOT), "GPTOSS_CACHE_DIR": os.environ["GPTOSS_CACHE_DIR"]}
    c = Cluster(initialize_head=True, head_node_args={"num_cpus": 2, "num_gpus": 0})
    try:
        nodes = [c.add_node(num_cpus=4, num_gpus=4) for _ in range(2)]
        c.wait_for_nodes()
        ray.init(address=c.address, runtime_env={"env_vars": env})
        serve.start(proxy_location="Disabled")
        yield nodes
    finally:
        stop_ray()  # (a failed start must not leave Ray initialized for the next module)
        c.shutdown()


def test_four_gpu_replica_lands_whole_on_one_node(cluster):
    config = ServeAppConfig.from_args({"device": "cuda", "ep_size": "4"})  # the tiny model: 4 experts
    resources = ReplicaResources.of(config, config.decode, "cuda")
    assert resources.num_ranks == 4
    probe = serve.deployment(ReplicaProbe, name="Replica4", num_replicas=1, graceful_shutdown_timeout_s=1,
                             **resources.deployment_options()).bind(resources)
    where = serve.run(probe, name="whole", route_prefix=None).where.remote().result()
    ranks = where["ranks"]
    assert [r["rank"] for r in ranks] == [0, 1, 2, 3]
    assert len({r["node"] for r in ranks}) == 1, "a replica's ranks span nodes"
    assert ranks[0]["node"] in {n.node_id for n in cluster}  # a GPU node, not the head
    gpus = [g for r in ranks for g in r["gpus"]]
    assert len(gpus) == 4 and len(set(gpus)) == 4  # one distinct GPU per rank
    assert where["strategy"] == STRATEGY and len(where["bundle_nodes"]) == 1
    serve.delete("whole")


def test_replica_larger_than_a_node_waits_instead_of_spanning(cluster):
    wait_until(lambda: ray.available_resources().get("GPU", 0) == 8, 30, "the GPUs of the previous test back")
    resources = ReplicaResources(num_ranks=6, gpus_per_rank=1, cpus_per_rank=0.5)  # 8 GPUs free, 4 per node
    probe = serve.deployment(ReplicaProbe, name="Replica6", num_replicas=1, graceful_shutdown_timeout_s=1,
                             **resources.deployment_options()).bind(resources)
    serve._run(probe, name="split", route_prefix=None, _blocking=False)
    time.sleep(8)  # long enough for a spanning placement to have happened
    status = deployment_status("split", "Replica6")
    assert status.replica_states.get("RUNNING", 0) == 0, status
    groups = [g for g in ray.util.placement_group_table().values()
              if g["strategy"] == STRATEGY and len(g["bundles"]) == 6 and g["state"] != "REMOVED"]
    assert groups and all(g["state"] == "PENDING" for g in groups), groups
    assert ray.available_resources().get("GPU", 0) == 8  # nothing was reserved piecemeal
    serve.delete("split")
