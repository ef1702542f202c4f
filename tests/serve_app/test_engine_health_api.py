"""An engine that cannot serve, seen through the HTTP API: the failing request is a 503, later requests are refused
with 503 `engine_unavailable` and Retry-After before they run, and /health says why (real engine, real server)."""

from __future__ import annotations

import httpx
import openai
import pytest
import torch

from tests.serve_app.conftest import LiveServer, openai_client

POISON = 1234  # a prompt holding this token id makes the injected device fault fire
MODEL = "tiny"


@pytest.fixture
def sick_server(tmp_path):
    from engine.async_engine import AsyncEngine
    from engine.config import EngineConfig
    from engine.llm_engine import LLMEngine
    from model.loader import load_model
    from model.tiny import make_tiny
    from serve_app.openai_api.app import create_app

    make_tiny(tmp_path, dtype="float32", seed=3)
    llm = LLMEngine(load_model(tmp_path, dtype="float32", progress=False),
                    EngineConfig(max_model_len=256, num_full_pages=64, num_sliding_pages=64, max_num_seqs=4,
                                 max_num_batched_tokens=256))
    real_execute = llm.runner.execute

    def execute(inputs):  # what a lost GPU looks like to the engine: every CUDA call raises this from then on
        if POISON in inputs.input_ids.tolist():
            raise torch.AcceleratorError("CUDA error: an illegal memory access was encountered")
        return real_execute(inputs)

    llm.runner.execute = execute
    engine = AsyncEngine(llm)
    with LiveServer(create_app(engine, model_name=MODEL, max_context=256,
                               conversation_start_date="2025-06-28")) as server:
        yield server, llm
    engine.shutdown()


def test_an_engine_that_cannot_serve_answers_503_and_health_says_why(sick_server):
    server, llm = sick_server
    client = openai_client(server.url)
    assert httpx.get(f"{server.url}/health").json() == {"status": "ok"}
    ok = client.completions.create(model=MODEL, prompt=[5, 6, 7], max_tokens=3)
    assert ok.choices[0].finish_reason == "length"

    with pytest.raises(openai.InternalServerError) as failed:  # the request whose step hit the fault
        client.completions.create(model=MODEL, prompt=[POISON, 8, 9], max_tokens=3)
    assert failed.value.status_code == 503 and "illegal memory access" in failed.value.message

    health = httpx.get(f"{server.url}/health")
    assert health.status_code == 503 and health.headers["retry-after"] == "1"
    error = health.json()["error"]
    assert error["code"] == "engine_unavailable" and error["type"] == "server_error"
    assert "AcceleratorError" in error["message"]

    for call in (lambda: client.completions.create(model=MODEL, prompt=[5, 6, 7], max_tokens=3),
                 lambda: client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "Hi"}]),
                 lambda: client.responses.create(model=MODEL, input="Hi")):
        with pytest.raises(openai.InternalServerError) as refused:
            call()
        assert refused.value.status_code == 503 and refused.value.response.headers["retry-after"] == "1"
        assert refused.value.body["code"] == "engine_unavailable"
    streamed = httpx.post(f"{server.url}/v1/chat/completions", json={
        "model": MODEL, "messages": [{"role": "user", "content": "Hi"}], "stream": True})
    assert streamed.status_code == 503 and streamed.json()["error"]["code"] == "engine_unavailable"
    assert not llm.seqs and llm.block_manager.usage()["full_pages_used"] == 0  # nothing was admitted or leaked
