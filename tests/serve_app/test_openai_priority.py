"""`priority` (vLLM's extension) through the API: off by default (a non-zero one is a 400 naming it, since any
client could put itself first); with ingress.allow_priority it reaches the engine request of every endpoint.
The engine's scheduling by priority: tests/engine/test_priority.py."""

from __future__ import annotations

import httpx
import pytest

from tests.serve_app.conftest import MODEL, scripted_app
from tests.serve_app.stub_backend import ScriptedBackend

OK = "<|channel|>final<|message|>ok<|return|>"
BODIES = {
    "/v1/chat/completions": {"model": MODEL, "messages": [{"role": "user", "content": "Hi"}]},
    "/v1/completions": {"model": MODEL, "prompt": "Hi", "max_tokens": 4},
    "/v1/responses": {"model": MODEL, "input": "Hi"},
}


@pytest.fixture(scope="module")
def apps():
    default, allowed = ScriptedBackend(), ScriptedBackend()
    with scripted_app(default) as plain, scripted_app(allowed, allow_priority=True) as trusting:
        yield (default, plain.url), (allowed, trusting.url)


@pytest.mark.parametrize("path", list(BODIES))
def test_priority_reaches_the_engine_request_when_allowed(apps, path):
    _, (backend, url) = apps
    backend.reset()
    for priority in (-7, 0, 3):
        backend.push(OK)
        r = httpx.post(url + path, json={**BODIES[path], "priority": priority}, timeout=30)
        assert r.status_code == 200, r.text
        assert backend.requests[-1].priority == priority


@pytest.mark.parametrize("path", list(BODIES))
def test_priority_is_refused_unless_allowed(apps, path):
    (backend, url), _ = apps
    backend.reset()
    r = httpx.post(url + path, json={**BODIES[path], "priority": -1}, timeout=30)
    assert r.status_code == 400 and r.json()["error"]["param"] == "priority"
    assert "ingress.allow_priority" in r.json()["error"]["message"] and not backend.requests
    backend.push(OK)
    assert httpx.post(url + path, json={**BODIES[path], "priority": 0}, timeout=30).status_code == 200
    assert backend.requests[-1].priority == 0


@pytest.mark.parametrize("value", [True, 1.5, "1", 2**31])
def test_priority_must_be_a_32_bit_integer(apps, value):
    _, (backend, url) = apps
    r = httpx.post(url + "/v1/chat/completions", json={**BODIES["/v1/chat/completions"], "priority": value},
                   timeout=30)
    assert r.status_code == 400 and r.json()["error"]["param"] == "priority", r.text
