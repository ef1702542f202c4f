"""Disaggregated serving across nodes (serve_app/prefix_router.py, `prefill_same_node`): on a real local Ray
cluster of two nodes (two raylets on this machine), each with a prefill and a decode replica, every prompt a
decode replica sends out runs on its own node's prefill replica, so its K/V never crosses the network (the K/V
handle names the prefill replica's node; the decode replica says which in its per-request log line and counts it
in `stats()["transfers_by_node"]`); and a conversation growing turn by turn goes back to the decode replica, so
to the node, whose prefill replica holds its history: every turn finds the previous prompt cached."""

from __future__ import annotations

import os
import pathlib
import random

import pytest
import ray
from ray import serve
from ray.cluster_utils import Cluster

from engine.request import GenerateRequest, SamplingParams
from serve_app.builder import DECODE_NAME, build_app
from tests.serve_app.serve_helpers import ROOT, collect, free_port, growing_conversation, run_async, wait_until

APP = "locality"
BLOCK = 16  # the engine's page size in the served config


@pytest.fixture(scope="module")
def two_nodes():
    """Two nodes, each with one prefill slot and one decode slot."""
    slots = {"prefill_slot": 1, "decode_slot": 1}
    cluster = Cluster(initialize_head=True, head_node_args={"num_cpus": 3, "resources": slots})
    cluster.add_node(num_cpus=3, resources=slots)
    # Serve tries the next group of replicas when a queue-length probe misses its deadline (0.1 s, doubling),
    # as a cold replica's first answers on a 2-core machine do: the policy is under test here, not that timing.
    env = {"PYTHONPATH": str(ROOT), "GPTOSS_CACHE_DIR": os.environ["GPTOSS_CACHE_DIR"],
           "RAY_SERVE_QUEUE_LENGTH_RESPONSE_DEADLINE_S": "10"}
    try:
        ray.init(address=cluster.address, runtime_env={"env_vars": env})
        serve.start(http_options={"host": "127.0.0.1", "port": free_port()})
        serve.run(build_app({"max_context": "1024", "kv_cache_memory_gib": "0.03", "warm_up": "false",
                             "prefill.num_replicas": "2", "prefill.resources_per_worker": '{"prefill_slot": 1}',
                             "decode.num_replicas": "2", "decode.resources_per_worker": '{"decode_slot": 1}',
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


def decode_lines(request_ids: list[str]) -> list[str]:
    """The decode replicas' per-request log lines of these requests, one each (waits for them)."""
    logs = pathlib.Path(ray._private.worker._global_node.get_logs_dir_path()) / "serve"

    def lines():
        found = [line for path in logs.glob(f"replica_{APP}_{DECODE_NAME}_*.log")
                 for line in path.read_text().splitlines() if "prompt" in line and "tokens (" in line
                 and any(f"request {rid}:" in line for rid in request_ids)]
        return found if len(found) == len(request_ids) else None
    return wait_until(lines, 20, "the decode replicas' lines for the requests")


def run(handle, rid: str, prompt: list[int]) -> int:
    """Generate 2 tokens; the prompt tokens its prefill found cached."""
    request = GenerateRequest(rid, prompt, SamplingParams(temperature=0.0, max_tokens=2, ignore_eos=True))
    deltas = run_async(collect(handle.options(stream=True).generate.remote(request)))
    assert deltas[-1].finish_reason == "length"
    return max(d.num_cached_tokens for d in deltas)


def test_prompts_run_on_the_decode_replicas_own_node(two_nodes):
    assert len({n["NodeID"] for n in ray.nodes() if n["Alive"]}) == 2
    seed = random.randrange(2**32)
    print(f"seed {seed}")
    rng = random.Random(seed)
    # distinct prompts (no shared prefix to be near): with Serve's default router half would go to the other node
    rids = [f"loc{i}-{seed}" for i in range(8)]
    for rid in rids:
        run(two_nodes, rid, [rng.randrange(200000) for _ in range(rng.randrange(20, 90))])
    lines = decode_lines(rids)
    assert all("prefill remote on this node" in line for line in lines), lines  # 8 of 8 by chance: 1 in 256
    stats = two_nodes.stats.remote().result()
    assert stats["fallbacks"] == 0 and set(stats["transfers_by_node"]) <= {"same"}, stats


def test_a_growing_conversation_returns_to_the_node_holding_its_history(two_nodes):
    seed = random.randrange(2**32)
    print(f"seed {seed}")
    rng = random.Random(seed)
    prompts = growing_conversation(rng, 100, 5)
    rids = [f"turn{t}-{seed}" for t in range(len(prompts))]
    cached = [run(two_nodes, rid, prompt) for rid, prompt in zip(rids, prompts)]
    # every whole page of the previous turn's prompt: only the prefill replica that ran it holds them, and a
    # decode replica asks its own node's (with the decode replica picked at random, 5 turns in a row would land
    # right 1 time in 32)
    assert cached == [0] + [len(p) // BLOCK * BLOCK for p in prompts[:-1]], cached
    assert all("prefill remote on this node" in line for line in decode_lines(rids))
