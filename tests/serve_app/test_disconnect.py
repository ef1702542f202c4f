"""A client that goes away aborts its request in the backend, streaming or not."""

from __future__ import annotations

import httpx
import pytest

from tests.serve_app.conftest import MODEL

SLOW = "<|channel|>final<|message|>" + "word " * 200 + "<|return|>"


def wait_for_abort(backend) -> str:
    assert backend.abort_seen.wait(timeout=10), "the backend request was not aborted"
    return backend.aborted[0]


@pytest.mark.parametrize("path,body", [
    ("/v1/chat/completions", {"model": MODEL, "messages": [{"role": "user", "content": "Hi"}], "stream": True}),
    ("/v1/responses", {"model": MODEL, "input": "Hi", "stream": True}),
])
def test_stream_disconnect_aborts(server, backend, path, body):
    backend.push(SLOW, chunk=1, delay_s=0.02)
    with httpx.stream("POST", f"{server.url}{path}", json=body, timeout=30) as r:
        lines = r.iter_lines()
        assert next(line for line in lines if line.startswith("data: "))
    # leaving the block closed the connection mid-stream
    assert wait_for_abort(backend) == backend.requests[-1].request_id


def test_non_stream_disconnect_aborts(server, backend):
    backend.push(SLOW, chunk=1, delay_s=0.02)
    body = {"model": MODEL, "messages": [{"role": "user", "content": "Hi"}]}
    with pytest.raises(httpx.ReadTimeout):
        httpx.post(f"{server.url}/v1/chat/completions", json=body, timeout=httpx.Timeout(30, read=0.5))
    assert wait_for_abort(backend) == backend.requests[-1].request_id


def test_finished_requests_are_not_aborted(client, backend):
    backend.push("<|channel|>final<|message|>done<|return|>")
    client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "Hi"}])
    backend.push("<|channel|>final<|message|>done<|return|>")
    list(client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "Hi"}], stream=True))
    assert backend.aborted == []
