"""Disaggregated serving across nodes (serve_app/prefix_router.py, `prefill_same_node`): on a real local Ray
cluster of two nodes (two raylets on this machine), with a prefill replica on each and the decode replica on the
first, every prompt the decode replica sends out runs on its own node's prefill replica, so its K/V never crosses
the network; the decode replica counts its transfers by node (`stats()["transfers_by_node"]`, the K/V handle
names the prefill replica's node) and says so in its per-request log line."""

from __future__ import annotations

import os
import random

import pytest
import ray
from ray import serve
from ray.cluster_utils import Cluster

from engine.request import GenerateRequest, SamplingParams
from serve_app.builder import DECODE_NAME, build_app
from tests.serve_app.serve_helpers import ROOT, collect, free_port, run_async

APP = "locality"


@pytest.fixture(scope="module")
def two_nodes():
    """Node A (head): a prefill slot and the decode replica's resource; node B: a prefill slot."""
    cluster = Cluster(initialize_head=True, head_node_args={"num_cpus": 3, "resources": {"node_a": 1, "prefill_slot": 1}})
    cluster.add_node(num_cpus=3, resources={"prefill_slot": 1})
    # Serve tries the next group of replicas when a queue-length probe misses its deadline (0.1 s, doubling),
    # as a cold replica's first answers on a 2-core machine do: the policy is under test here, not that timing.
    env = {"PYTHONPATH": str(ROOT), "GPTOSS_CACHE_DIR": os.environ["GPTOSS_CACHE_DIR"],
           "RAY_SERVE_QUEUE_LENGTH_RESPONSE_DEADLINE_S": "2"}
    try:
        ray.init(address=cluster.address, runtime_env={"env_vars": env})
        serve.start(http_options={"host": "127.0.0.1", "port": free_port()})
        serve.run(build_app({"max_context": "512", "kv_cache_memory_gib": "0.03", "warm_up": "false",
                             "prefill.num_replicas": "2", "prefill.resources_per_worker": '{"prefill_slot": 1}',
                             "decode.num_replicas": "1", "decode.resources_per_worker": '{"node_a": 1}',
                             "prefill.graceful_shutdown_timeout_s": "1", "decode.graceful_shutdown_timeout_s": "1"}),
                  name=APP, route_prefix="/locality")
        yield serve.get_deployment_handle(DECODE_NAME, APP)
    finally:
        try:
            if ray.is_initialized():
                serve.shutdown()
        finally:
            ray.shutdown()
            cluster.shutdown()


def test_prompts_run_on_the_decode_replicas_own_node(two_nodes):
    nodes = {n["NodeID"] for n in ray.nodes() if n["Alive"]}
    assert len(nodes) == 2
    seed = random.randrange(2**32)
    print(f"seed {seed}")
    rng = random.Random(seed)
    handle = two_nodes.options(stream=True)
    # distinct prompts (no shared prefix to be near): with Serve's default router half would go to node B
    for i in range(8):
        prompt = [rng.randrange(200000) for _ in range(rng.randrange(20, 90))]
        request = GenerateRequest(f"loc{i}-{seed}", prompt, SamplingParams(temperature=0.0, max_tokens=2,
                                                                           ignore_eos=True))
        deltas = run_async(collect(handle.generate.remote(request)))
        assert deltas[-1].finish_reason == "length"
    stats = two_nodes.stats.remote().result()
    assert stats["transfers"] == 8 and stats["fallbacks"] == 0, stats
    assert stats["transfers_by_node"] == {"same": 8}, stats  # all 8 by chance: 1 in 256
