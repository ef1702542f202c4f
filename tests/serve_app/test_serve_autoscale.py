"""Decode and ingress autoscaling on a real local Ray: 1 -> 2 replicas under load, back to 1 when it stops.

The autoscaling settings are the app's own (`decode.autoscaling.*`, `ingress.autoscaling.*` arguments), with delays shortened
so the test takes seconds instead of the production minutes.
"""

from __future__ import annotations

import asyncio
import json
import threading

import openai
import pytest
from ray import serve

from serve_app.builder import DECODE_NAME, INGRESS_NAME, build_app
from tests.serve_app.serve_helpers import running_replicas, start_ray, stop_ray, wait_until

APP = "autoscale"
ARGS = {  # no max_context: the ingress asks the decode deployment for the engine's limit at start
    "kv_cache_memory_gib": "0.0625",
    "prefill.num_replicas": "1",
    "decode.graceful_shutdown_timeout_s": "2",
    "decode.autoscaling": json.dumps({
        "min_replicas": 1, "max_replicas": 2, "target_ongoing_requests": 2,
        "upscale_delay_s": 1, "downscale_delay_s": 4, "metrics_interval_s": 0.5, "look_back_period_s": 2,
    }),
    "ingress.num_replicas": "null",  # the ingress autoscales too, on its in-flight HTTP requests
    "ingress.autoscaling": json.dumps({
        "min_replicas": 1, "max_replicas": 2, "target_ongoing_requests": 3,
        "upscale_delay_s": 1, "downscale_delay_s": 4, "metrics_interval_s": 0.5, "look_back_period_s": 2,
    }),
}


@pytest.fixture(scope="module")
def http_port():
    port = start_ray().http
    try:
        serve.run(build_app(ARGS), name=APP, route_prefix="/")
        yield port
    finally:
        stop_ray()


class Load:
    """`width` concurrent streaming chats over HTTP, restarted as they finish, until stopped."""

    def __init__(self, port: int, width: int):
        self.port, self.width = port, width
        self.stop = threading.Event()
        self.completed, self.errors = 0, []
        self.thread = threading.Thread(target=lambda: asyncio.run(self._run()), daemon=True)

    async def _one(self, api: openai.AsyncOpenAI, i: int) -> None:
        while not self.stop.is_set():
            try:
                finish = None
                async for chunk in await api.chat.completions.create(
                        model="gpt-oss", messages=[{"role": "user", "content": f"load {i}"}], temperature=0,
                        max_tokens=150, stream=True):
                    if chunk.choices and chunk.choices[0].finish_reason:
                        finish = chunk.choices[0].finish_reason
                if finish is None:
                    self.errors.append(f"stream {i} ended without a finish reason")
                self.completed += 1
            except openai.APIError as err:
                self.errors.append(repr(err))

    async def _run(self) -> None:
        api = openai.AsyncOpenAI(base_url=f"http://127.0.0.1:{self.port}/v1", api_key="unused", max_retries=0,
                                 timeout=120)
        await asyncio.gather(*(self._one(api, i) for i in range(self.width)))

    def __enter__(self) -> "Load":
        self.thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self.stop.set()
        self.thread.join(120)


def test_decode_and_ingress_scale_up_under_load_and_back_down(http_port):
    assert running_replicas(APP, DECODE_NAME) == 1 and running_replicas(APP, INGRESS_NAME) == 1
    with Load(http_port, width=8) as load:
        wait_until(lambda: running_replicas(APP, DECODE_NAME) == 2, 90, "a second decode replica")
        wait_until(lambda: running_replicas(APP, INGRESS_NAME) == 2, 90, "a second ingress replica")
        completed_at_scale_up = load.completed
        # Keep the load on until requests finish on the scaled-up deployment too.
        wait_until(lambda: load.completed >= completed_at_scale_up + 8, 90, "requests served after scaling up")
    assert not load.errors, load.errors[:3]
    wait_until(lambda: running_replicas(APP, DECODE_NAME) == 1 and
               serve.status().applications[APP].deployments[DECODE_NAME].replica_states.get("STOPPING", 0) == 0,
               90, "scale down to one decode replica")
    wait_until(lambda: running_replicas(APP, INGRESS_NAME) == 1, 90, "scale down to one ingress replica")
    # The app still answers after scaling down.
    api = openai.OpenAI(base_url=f"http://127.0.0.1:{http_port}/v1", api_key="unused", max_retries=0, timeout=60)
    reply = api.chat.completions.create(model="gpt-oss", messages=[{"role": "user", "content": "hi"}], max_tokens=4)
    assert reply.usage.completion_tokens == 4
    assert api.models.list().data[0].max_model_len == 131072  # the tiny model's context, learned from decode
