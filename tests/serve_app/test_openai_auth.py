"""API keys: with keys configured, every path but /health needs `Authorization: Bearer KEY` (OpenAI's 401
otherwise), also below a mount point; streaming and the disconnect abort pass the gate unchanged. The Serve path (ingress.api_keys through the
builder to the ingress replica) is tested in test_serve_e2e.py."""

from __future__ import annotations

import httpx
import openai
import pytest

from serve_app.config import ServeAppConfig
from serve_app.config_args import ServeConfigError
from tests.serve_app.conftest import MAX_CONTEXT, MODEL, START_DATE, LiveServer
from tests.serve_app.stub_backend import ScriptedBackend

KEYS = ("sk-first-0123", "sk-second-4567")
OK = "<|channel|>final<|message|>ok<|return|>"
CHAT = {"model": MODEL, "messages": [{"role": "user", "content": "Hi"}]}


@pytest.fixture(scope="module")
def gated():
    from serve_app.openai_api.app import create_app

    backend = ScriptedBackend(max_context=MAX_CONTEXT)
    app = create_app(backend, model_name=MODEL, max_context=MAX_CONTEXT, conversation_start_date=START_DATE,
                     api_keys=KEYS)
    with LiveServer(app) as server:
        yield backend, server


def api(server, key: str) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{server.url}/v1", api_key=key, max_retries=0, timeout=30)


@pytest.mark.parametrize("key", KEYS)
def test_each_key_is_accepted(gated, key):
    backend, server = gated
    backend.reset()
    backend.push(OK)
    assert api(server, key).chat.completions.create(**CHAT).choices[0].message.content == "ok"
    assert [m.id for m in api(server, key).models.list()] == [MODEL]


@pytest.mark.parametrize("headers,sent", [
    ({}, False),
    ({"Authorization": "Bearer sk-first-012"}, True),  # a prefix of a key
    ({"Authorization": "Bearer sk-first-01234"}, True),  # a key plus a character
    ({"Authorization": "Basic sk-first-0123"}, False),  # not Bearer
    ({"Authorization": "Bearer"}, True),  # the scheme without a key
])
@pytest.mark.parametrize("method,path", [("POST", "/v1/chat/completions"), ("GET", "/v1/models"),
                                         ("POST", "/v1/responses"), ("GET", "/v1/no-such-path"),
                                         ("GET", "/openapi.json"), ("GET", "/health/"), ("GET", "/")])
def test_requests_without_a_valid_key_are_401_in_openai_shape(gated, headers, sent, method, path):
    backend, server = gated
    backend.reset()
    r = httpx.request(method, server.url + path, json=CHAT, headers=headers, timeout=30)
    assert r.status_code == 401, r.text
    assert r.headers["www-authenticate"] == "Bearer"
    error = r.json()["error"]
    assert set(error) == {"message", "type", "param", "code"}
    assert (error["type"], error["code"]) == ("invalid_request_error", "invalid_api_key")
    assert ("Incorrect" in error["message"]) == sent
    assert not backend.requests  # nothing reached the backend


def test_the_openai_client_raises_authentication_error(gated):
    _, server = gated
    with pytest.raises(openai.AuthenticationError) as err:
        api(server, "sk-wrong").chat.completions.create(**CHAT)
    assert err.value.status_code == 401 and err.value.code == "invalid_api_key"


def test_health_and_the_scheme_case(gated):
    backend, server = gated
    assert httpx.get(server.url + "/health", timeout=30).json() == {"status": "ok"}
    backend.reset()
    backend.push(OK)
    r = httpx.post(server.url + "/v1/chat/completions", json=CHAT, headers={"authorization": f"bearer {KEYS[0]}"},
                   timeout=30)
    assert r.status_code == 200 and r.json()["choices"][0]["message"]["content"] == "ok"


def test_streams_pass_the_gate_and_a_disconnect_still_aborts(gated):
    backend, server = gated
    backend.reset()
    backend.push(OK, chunk=1)
    chunks = list(api(server, KEYS[1]).chat.completions.create(**CHAT, stream=True))
    assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == "ok"
    backend.reset()
    backend.push("<|channel|>final<|message|>" + "word " * 200 + "<|return|>", chunk=1, delay_s=0.02)
    with httpx.stream("POST", server.url + "/v1/chat/completions", json={**CHAT, "stream": True},
                      headers={"Authorization": f"Bearer {KEYS[0]}"}, timeout=30) as r:
        assert r.status_code == 200
        assert next(line for line in r.iter_lines() if line.startswith("data: "))
    assert backend.abort_seen.wait(timeout=10) and backend.aborted == [backend.requests[-1].request_id]


def test_an_app_below_a_mount_point_is_guarded_the_same():
    """Serve's route_prefix mounts the app below a root path: the gate judges the path below it."""
    from fastapi import FastAPI

    from serve_app.openai_api.app import create_app

    backend = ScriptedBackend(max_context=MAX_CONTEXT)
    outer = FastAPI()
    outer.mount("/gptoss", create_app(backend, model_name=MODEL, max_context=MAX_CONTEXT, api_keys=KEYS))
    with LiveServer(outer) as server:
        assert httpx.get(server.url + "/gptoss/health", timeout=30).status_code == 200
        assert httpx.get(server.url + "/gptoss/v1/models", timeout=30).status_code == 401
        models = httpx.get(server.url + "/gptoss/v1/models", headers={"Authorization": f"Bearer {KEYS[0]}"},
                           timeout=30)
        assert models.status_code == 200 and models.json()["data"][0]["id"] == MODEL


def test_config_keys_from_the_environment_text_or_a_list(monkeypatch):
    monkeypatch.setenv("GPTOSS_API_KEYS", " sk-a , sk-b,")
    assert ServeAppConfig.from_args({}).ingress.api_key_values() == ("sk-a", "sk-b")
    assert ServeAppConfig.from_args({"ingress.api_keys": "sk-c,sk-d"}).ingress.api_key_values() == ("sk-c", "sk-d")
    assert ServeAppConfig.from_args({"ingress": {"api_keys": ["sk-e"]}}).ingress.api_key_values() == ("sk-e",)
    monkeypatch.delenv("GPTOSS_API_KEYS")
    config = ServeAppConfig.from_args({})
    assert config.ingress.api_key_values() == ()
    # kept out of reprs and JSON dumps
    keyed = ServeAppConfig.from_args({"ingress.api_keys": "sk-secret-1"})
    assert "sk-secret-1" not in repr(keyed) and "sk-secret-1" not in keyed.model_dump_json()


@pytest.mark.parametrize("value", ['["sk a"]', '[""]', '["sk\\u0001"]', "[1]"])
def test_config_refuses_unusable_keys_without_echoing_them(value):
    with pytest.raises(ServeConfigError, match="ingress.api_keys") as err:
        ServeAppConfig.from_args({"ingress.api_keys": value})
    assert "sk a" not in str(err.value)


def test_cors_preflight_passes_the_gate_and_answers_carry_the_headers():
    """ingress.cors_allow_origins: a browser's preflight (no key) is answered for an allowed origin; the answers,
    401s included, carry Access-Control-Allow-Origin and expose x-request-id; other origins get no CORS headers."""
    from serve_app.openai_api.app import create_app

    backend = ScriptedBackend(max_context=MAX_CONTEXT)
    app = create_app(backend, model_name=MODEL, max_context=MAX_CONTEXT, api_keys=KEYS,
                     cors_allow_origins=["https://app.example.com"])
    url_path = "/v1/chat/completions"
    with LiveServer(app) as server:
        url = server.url + url_path
        allowed = {"Origin": "https://app.example.com"}
        pre = httpx.options(url, headers={**allowed, "Access-Control-Request-Method": "POST",
                                          "Access-Control-Request-Headers": "authorization,content-type"}, timeout=10)
        assert pre.status_code == 200 and pre.headers["access-control-allow-origin"] == "https://app.example.com"
        assert "authorization" in pre.headers["access-control-allow-headers"].lower()
        backend.push(OK)
        r = httpx.post(url, json=CHAT, headers={**allowed, "Authorization": f"Bearer {KEYS[0]}"}, timeout=10)
        assert r.status_code == 200 and r.headers["access-control-allow-origin"] == "https://app.example.com"
        assert "x-request-id" in r.headers["access-control-expose-headers"].lower()
        denied = httpx.post(url, json=CHAT, headers=allowed, timeout=10)
        assert denied.status_code == 401 and denied.headers["access-control-allow-origin"] == "https://app.example.com"
        other = httpx.options(url, headers={"Origin": "https://evil.example", "Access-Control-Request-Method": "POST"},
                              timeout=10)
        assert other.status_code == 400 and "access-control-allow-origin" not in other.headers
    assert ServeAppConfig.from_args({"ingress.cors_allow_origins": "https://a.example, https://b.example"}) \
        .ingress.cors_allow_origins == ["https://a.example", "https://b.example"]


def test_no_cors_headers_by_default(gated):
    _, server = gated
    r = httpx.get(server.url + "/health", headers={"Origin": "https://app.example.com"}, timeout=10)
    assert r.status_code == 200 and "access-control-allow-origin" not in r.headers


def test_cache_salts_are_the_keys_with_isolation_and_the_requests_own():
    """What each engine request carries as its prefix-cache namespace: the request's `cache_salt` on every endpoint;
    with isolate_prefix_cache, the API key's (its id, never the key) before it; without keys, isolation adds nothing."""
    from serve_app.openai_api.app import create_app
    from serve_app.openai_api.auth import key_id
    from tests.serve_app.conftest import scripted_app

    answer = "<|channel|>final<|message|>Hi<|return|>"
    backend = ScriptedBackend(max_context=MAX_CONTEXT)
    app = create_app(backend, model_name=MODEL, max_context=MAX_CONTEXT, conversation_start_date=START_DATE,
                     api_keys=["sk-a"], isolate_prefix_cache=True)
    with LiveServer(app) as server:
        client = api(server, "sk-a")
        calls = [lambda **x: client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "Hi"}],
                                                            **x),
                 lambda **x: client.completions.create(model=MODEL, prompt="Hi", **x),
                 lambda **x: client.responses.create(model=MODEL, input="Hi", **x)]
        for call in calls:
            backend.push(answer)
            call()
            backend.push(answer)
            call(extra_body={"cache_salt": "mine"})
        assert [r.cache_salt for r in backend.requests] == [f"key:{key_id(b'sk-a')}",
                                                            f"key:{key_id(b'sk-a')}\0client:mine"] * 3
        assert "sk-a" not in backend.requests[0].cache_salt
    backend.reset()
    with scripted_app(backend, isolate_prefix_cache=True) as server:  # no keys: only the request's own salt
        client = openai.OpenAI(base_url=f"{server.url}/v1", api_key="unused", max_retries=0, timeout=30)
        for extra in (None, {"cache_salt": "mine"}):
            backend.push(answer)
            client.responses.create(model=MODEL, input="Hi", extra_body=extra)
        assert [r.cache_salt for r in backend.requests] == ["", "client:mine"]
