"""Streams keep idle connections alive (ingress.stream_keepalive_s).

A stream whose first token takes longer than the keep-alive period starts anyway (HTTP 200) and sends the
SSE comment `: keep-alive` after each idle period, so a load balancer's idle timeout does not cut a request
waiting in a queue; a refusal after that comes as an error event in the stream. A refusal within the period
is still the HTTP status. Real uvicorn, the real openai client, the scripted backend with set delays.
"""

from __future__ import annotations

import logging
import time

import httpx
import openai
import pytest

from engine.request import BackendOverloaded, InvalidRequestError
from tests.serve_app.conftest import MODEL, openai_client, scripted_app
from tests.serve_app.stub_backend import ScriptedBackend

KEEPALIVE_S = 0.2
OK = "<|channel|>final<|message|>Hello there<|return|>"
CHAT = {"model": MODEL, "messages": [{"role": "user", "content": "Hi"}]}
BODIES = {
    "/v1/chat/completions": CHAT,
    "/v1/completions": {"model": MODEL, "prompt": "Hi", "max_tokens": 50},
    "/v1/responses": {"model": MODEL, "input": "Hi"},
}


@pytest.fixture(scope="module")
def live():
    backend = ScriptedBackend()
    with scripted_app(backend, stream_keepalive_s=KEEPALIVE_S) as server:
        yield backend, server


@pytest.fixture
def backend(live) -> ScriptedBackend:
    live[0].reset()
    return live[0]


@pytest.fixture
def url(live) -> str:
    return live[1].url


def stream_lines(url: str, path: str, body: dict) -> tuple[int, list[tuple[float, str]]]:
    """(status, [(seconds since the request, line)]) of a streamed request, blank lines left out."""
    start = time.monotonic()
    with httpx.stream("POST", url + path, json={**body, "stream": True}, timeout=30) as r:
        return r.status_code, [(time.monotonic() - start, line) for line in r.iter_lines() if line]


@pytest.mark.parametrize("path", list(BODIES))
def test_a_stream_waiting_for_its_first_token_sends_keepalives(url, backend, path):
    backend.push(OK, first_delay_s=1.0)
    status, lines = stream_lines(url, path, BODIES[path])
    assert status == 200
    texts = [line for _, line in lines]
    first_data = next(i for i, line in enumerate(texts) if line.startswith("data: "))
    first_token = next(i for i, line in enumerate(texts) if "Hello" in line or "response.output_text.delta" in line)
    waiting = [t for t, line in lines[:first_token] if line == ": keep-alive"]
    # the first comes about 2 periods in (the first wait, then one idle period); by 1.0 s three or four
    assert len(waiting) >= 2, texts
    assert waiting[0] >= KEEPALIVE_S, waiting
    assert all(line.startswith(("data: ", "event: ", ": keep-alive")) for line in texts), texts
    assert first_data < first_token  # chat's role chunk, responses' created event: before the token, as OpenAI
    assert texts[-1] == "data: [DONE]" or '"response.completed"' in texts[-1], texts[-1]


def test_the_openai_client_reads_a_stream_with_keepalives(url, backend):
    backend.push(OK, first_delay_s=0.7, chunk=1, delay_s=0.3)  # idle before the first token and between tokens
    client = openai_client(url)
    chunks = list(client.chat.completions.create(**CHAT, stream=True))
    assert "".join(c.choices[0].delta.content or "" for c in chunks) == "Hello there"
    assert chunks[-1].choices[0].finish_reason == "stop"


def test_keepalives_also_fill_pauses_between_tokens(url, backend):
    backend.push(OK, chunk=1, delay_s=0.5)  # every delta after a pause of 2.5 periods
    status, lines = stream_lines(url, "/v1/chat/completions", CHAT)
    texts = [line for _, line in lines]
    tokens = [i for i, line in enumerate(texts) if '"content":"' in line and '"content":""' not in line]
    assert status == 200 and len(tokens) >= 2
    between = texts[tokens[0]:tokens[-1]]
    assert between.count(": keep-alive") >= len(tokens) - 1, texts


def test_a_fast_stream_sends_no_keepalive(url, backend):
    backend.push(OK, chunk=1)
    status, lines = stream_lines(url, "/v1/chat/completions", CHAT)
    assert status == 200 and lines[-1][1] == "data: [DONE]"
    assert ": keep-alive" not in [line for _, line in lines]


@pytest.mark.parametrize("error,status,code", [
    (BackendOverloaded("decode queue full"), 503, "server_overloaded"),
    (InvalidRequestError("the engine refuses this", "messages"), 400, None),
])
def test_a_refusal_within_the_period_is_the_http_status(url, backend, error, status, code):
    backend.push(OK, error=error)
    with httpx.stream("POST", f"{url}/v1/chat/completions", json={**CHAT, "stream": True}, timeout=30) as r:
        r.read()
    assert r.status_code == status
    assert r.json()["error"]["code"] == code
    assert (r.headers.get("retry-after") == "1") == (status == 503)


def test_a_late_refusal_is_an_error_event_the_openai_client_raises(url, backend):
    backend.push(OK, first_delay_s=0.6, error=BackendOverloaded("decode queue full"))
    client = openai_client(url)
    with pytest.raises(openai.APIError, match="overloaded"):
        for _ in client.chat.completions.create(**CHAT, stream=True):
            pass
    assert backend.requests and not backend.aborted  # it never ran: nothing to abort


def test_a_late_refusal_in_responses_is_its_error_event(url, backend):
    backend.push(OK, first_delay_s=0.6, error=InvalidRequestError("the engine refuses this", "input"))
    status, lines = stream_lines(url, "/v1/responses", BODIES["/v1/responses"])
    texts = [line for _, line in lines]
    assert status == 200 and ": keep-alive" in texts
    assert texts[-2:] == ["event: error", texts[-1]] and '"param":"input"' in texts[-1], texts[-2:]
    assert '"message":"the engine refuses this"' in texts[-1]


def test_a_late_refusal_in_completions_names_the_prompt(url, backend):
    """/v1/completions renames the engine's `prompt_ids` to the client's `prompt`, in the stream as in a 400."""
    backend.push(OK, first_delay_s=0.6, error=InvalidRequestError("prompt_ids must be below 9", "prompt_ids"))
    status, lines = stream_lines(url, "/v1/completions", BODIES["/v1/completions"])
    assert status == 200
    assert '"param":"prompt"' in lines[-1][1] and "token ids must be below 9" in lines[-1][1], lines[-1]


def test_n_choices_start_late_together(url, backend):
    backend.push(OK, first_delay_s=0.6)
    backend.push(OK, first_delay_s=0.9)
    client = openai_client(url)
    chunks = list(client.chat.completions.create(**CHAT, stream=True, n=2))
    text = {0: "", 1: ""}
    for c in chunks:
        for choice in c.choices:
            text[choice.index] += choice.delta.content or ""
    assert text == {0: "Hello there", 1: "Hello there"}


def test_leaving_while_waiting_for_the_first_token_aborts(url, backend, caplog):
    backend.push(OK, first_delay_s=5.0)
    with httpx.stream("POST", f"{url}/v1/chat/completions", json={**CHAT, "stream": True}, timeout=30) as r:
        lines = (line for line in r.iter_lines() if line)
        assert next(lines).startswith("data: ")  # the role chunk
        assert next(lines) == ": keep-alive"
    # leaving the block closed the connection while the request still waited for its first token
    assert backend.abort_seen.wait(timeout=5), "the waiting request was not aborted"
    assert backend.aborted == [backend.requests[-1].request_id]
    time.sleep(0.2)
    assert not [rec for rec in caplog.records if rec.levelno >= logging.ERROR], caplog.text


def test_non_streamed_requests_just_wait(url, backend):
    backend.push(OK, first_delay_s=0.6)
    r = httpx.post(f"{url}/v1/chat/completions", json=CHAT, timeout=30)
    assert r.status_code == 200 and r.json()["choices"][0]["message"]["content"] == "Hello there"


def test_keepalive_off_waits_silently_and_refuses_with_the_status():
    backend = ScriptedBackend()
    with scripted_app(backend, stream_keepalive_s=None) as server:
        backend.push(OK, first_delay_s=0.6)
        status, lines = stream_lines(server.url, "/v1/chat/completions", CHAT)
        assert status == 200 and ": keep-alive" not in [line for _, line in lines]
        assert lines[0][0] >= 0.6  # nothing at all before the first token
        backend.push(OK, first_delay_s=0.6, error=BackendOverloaded("decode queue full"))
        status, lines = stream_lines(server.url, "/v1/chat/completions", CHAT)
        assert status == 503


@pytest.mark.parametrize("value", [0, -1.0])
def test_a_keepalive_period_must_be_positive(value):
    from serve_app.openai_api.app import create_app

    with pytest.raises(ValueError, match="stream_keepalive_s"):
        create_app(ScriptedBackend(), model_name=MODEL, max_context=4096, stream_keepalive_s=value)
