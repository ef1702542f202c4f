"""A client that goes away aborts its request in the backend, streaming or not."""

from __future__ import annotations

import logging
import time

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


def wait_for_aborts(backend, ids: set[str]) -> None:
    deadline = time.monotonic() + 10
    while set(backend.aborted) != ids and time.monotonic() < deadline:
        time.sleep(0.02)
    assert set(backend.aborted) == ids


CHAT_N = {"model": MODEL, "messages": [{"role": "user", "content": "Hi"}]}
COMPLETION_N = {"model": MODEL, "prompt": "Hi"}


@pytest.mark.parametrize("path,body,n", [("/v1/chat/completions", CHAT_N, 2), ("/v1/chat/completions", CHAT_N, 3),
                                         ("/v1/completions", COMPLETION_N, 3)])
def test_stream_disconnect_aborts_every_choice(server, backend, caplog, path, body, n):
    """n > 1 streams its choices interleaved, one engine request each: a client that leaves aborts them all,
    and closing them logs no error (their readers were still running when the stream closed: "aclose():
    asynchronous generator is already running" stopped the close at the first choice, leaving the rest)."""
    for _ in range(n):
        backend.push(SLOW, chunk=1, delay_s=0.02)
    with httpx.stream("POST", f"{server.url}{path}", json={**body, "stream": True, "n": n}, timeout=30) as r:
        assert r.status_code == 200
        lines = r.iter_lines()
        assert next(line for line in lines if line.startswith("data: "))
    wait_for_aborts(backend, {req.request_id for req in backend.requests[-n:]})
    time.sleep(0.2)  # (the close's log lines, if any, come after the aborts)
    assert not [rec for rec in caplog.records if rec.levelno >= logging.ERROR], caplog.text


def test_non_stream_disconnect_aborts_every_choice(server, backend, caplog):
    for _ in range(3):
        backend.push(SLOW, chunk=1, delay_s=0.02)
    with pytest.raises(httpx.ReadTimeout):
        httpx.post(f"{server.url}/v1/chat/completions", json={**CHAT_N, "n": 3}, timeout=httpx.Timeout(30, read=0.5))
    wait_for_aborts(backend, {req.request_id for req in backend.requests[-3:]})
    time.sleep(0.2)
    assert not [rec for rec in caplog.records if rec.levelno >= logging.ERROR], caplog.text


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
