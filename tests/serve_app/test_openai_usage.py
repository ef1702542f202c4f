"""Usage accounting (usage.py): one record per engine request as it ends, naming the model, the endpoint, the API key
(its hash) and the outcome, with the tokens the client's usage reports; through a live server and the openai client."""

from __future__ import annotations

import threading
import time

import httpx
import openai
import pytest

from engine.request import BackendOverloaded
from serve_app.openai_api.auth import key_id
from serve_app.openai_api.stored_responses import MemoryResponseStore
from tests.serve_app.conftest import MODEL, scripted_app
from tests.serve_app.stub_backend import ScriptedBackend

KEYS = ("sk-team-a", "sk-team-b")
ANSWER = "<|channel|>analysis<|message|>Think.<|end|><|start|>assistant<|channel|>final<|message|>Fine, thanks.<|return|>"
CALL = "<|channel|>commentary to=functions.get json<|message|>{}<|call|>"
LONG = "<|channel|>final<|message|>" + "word " * 300 + "<|return|>"
HI = [{"role": "user", "content": "Hi"}]


class Sink:
    def __init__(self):
        self.records, self.lock = [], threading.Lock()

    def __call__(self, record) -> None:
        with self.lock:
            self.records.append(record)

    def take(self, n: int, timeout_s: float = 5.0) -> list:
        """The next n records (a stream's arrives just after its last chunk)."""
        deadline = time.monotonic() + timeout_s
        while True:
            with self.lock:
                if len(self.records) >= n:
                    out, self.records = self.records[:n], self.records[n:]
                    return out
            assert time.monotonic() < deadline, f"{len(self.records)} of {n} usage records"
            time.sleep(0.01)


@pytest.fixture(scope="module")
def live():
    backend, sink = ScriptedBackend(), Sink()
    with scripted_app(backend, api_keys=KEYS, usage_sink=sink, response_store=MemoryResponseStore()) as server:
        yield backend, sink, server


@pytest.fixture
def parts(live):
    backend, sink, server = live
    backend.reset()
    sink.take(len(sink.records))
    clients = [openai.OpenAI(base_url=f"{server.url}/v1", api_key=key, max_retries=0, timeout=30) for key in KEYS]
    return backend, sink, clients


def test_each_engine_request_is_recorded_with_its_key_and_usage(parts):
    backend, sink, (a, b) = parts
    backend.push(ANSWER)
    backend.push(ANSWER)
    chat = a.chat.completions.create(model=MODEL, messages=HI, n=2)
    records = sink.take(2)
    assert {(r.model, r.endpoint, r.key, r.outcome) for r in records} == \
        {(MODEL, "chat.completions", key_id(KEYS[0].encode()), "stop")}
    assert sum(r.completion_tokens for r in records) == chat.usage.completion_tokens
    assert [r.prompt_tokens for r in records] == [chat.usage.prompt_tokens] * 2  # each choice ran the prompt

    backend.push(CALL)
    tools = [{"type": "function", "name": "get", "parameters": {"type": "object", "properties": {}}}]
    called = b.responses.create(model=MODEL, input="Call it", tools=tools)
    (record,) = sink.take(1)
    assert (record.endpoint, record.key, record.outcome) == ("responses", key_id(KEYS[1].encode()), "tool_calls")
    assert (record.prompt_tokens, record.completion_tokens) == (called.usage.input_tokens, called.usage.output_tokens)

    backend.push(LONG)
    done = a.completions.create(model=MODEL, prompt="Hello", max_tokens=7)
    (record,) = sink.take(1)
    assert (record.endpoint, record.outcome, record.completion_tokens) == ("completions", "length", 7)
    assert record.prompt_tokens == done.usage.prompt_tokens


def test_cancelled_refused_failed_and_background_requests(parts, live):
    backend, sink, (a, _) = parts
    backend.push(LONG, delay_s=0.02)
    with httpx.stream("POST", f"{live[2].url}/v1/chat/completions", json={"model": MODEL, "messages": HI,
                      "stream": True}, headers={"authorization": f"Bearer {KEYS[0]}"}, timeout=30) as r:
        next(line for line in r.iter_lines() if "content" in line)  # the client leaves after its first text
    (record,) = sink.take(1)
    assert record.outcome == "cancelled" and 0 < record.completion_tokens < 300

    backend.push(ANSWER, error=BackendOverloaded("decode queue full"))
    with pytest.raises(openai.InternalServerError):
        a.chat.completions.create(model=MODEL, messages=HI)
    backend.push(LONG, fail_after=2)
    with pytest.raises(openai.InternalServerError):
        a.chat.completions.create(model=MODEL, messages=HI)
    assert [(r.outcome, r.completion_tokens) for r in sink.take(2)] == [("refused", 0), ("failed", 6)]

    backend.push(ANSWER)
    queued = a.responses.create(model=MODEL, input="Hi", background=True)
    (record,) = sink.take(1)
    assert (record.endpoint, record.key, record.outcome) == ("responses", key_id(KEYS[0].encode()), "stop")
    assert record.completion_tokens == a.responses.retrieve(queued.id).usage.output_tokens


def test_a_batchs_lines_are_recorded_as_batch_endpoints_of_its_key(parts):
    """A /v1/batches line's usage names the endpoint "batch.<endpoint>" and the batch's key, so batch load is told
    from interactive load."""
    import io
    import json

    backend, sink, (a, _) = parts
    backend.push(ANSWER)
    backend.push(ANSWER)
    lines = [{"custom_id": "c", "method": "POST", "url": "/v1/chat/completions",
              "body": {"model": MODEL, "messages": HI}},
             {"custom_id": "r", "method": "POST", "url": "/v1/responses", "body": {"model": MODEL, "input": "Hi"}}]
    for line in lines:  # one batch per endpoint
        source = a.files.create(file=("b.jsonl", io.BytesIO((json.dumps(line) + "\n").encode())), purpose="batch")
        a.batches.create(input_file_id=source.id, endpoint=line["url"], completion_window="24h")
        (record,) = sink.take(1, timeout_s=10)
        assert (record.endpoint, record.key, record.outcome) == (
            "batch." + line["url"].removeprefix("/v1/").replace("/", "."), key_id(KEYS[0].encode()), "stop")
