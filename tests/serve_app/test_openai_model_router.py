"""Two models behind one API (model_router.serve_models): requests reach the backend of the model they name, the
model list is merged, unknown models are 404s naming both, keys and CORS guard the router, and the models share
stored responses; through the openai client against a live uvicorn server."""

from __future__ import annotations

import httpx
import openai
import pytest

from serve_app.openai_api.app import create_app
from serve_app.openai_api.model_router import serve_models
from serve_app.openai_api.stored_responses import MemoryResponseStore
from tests.serve_app.conftest import START_DATE, LiveServer
from tests.serve_app.stub_backend import ScriptedBackend

SMALL, LARGE = "gpt-oss-20b", "gpt-oss-120b"
KEY = "sk-router"
TEXT = {SMALL: "small here", LARGE: "large here"}
SAYS = {name: f"<|channel|>final<|message|>{text}<|return|>" for name, text in TEXT.items()}


@pytest.fixture(scope="module")
def live():
    backends = {SMALL: ScriptedBackend(max_context=4096), LARGE: ScriptedBackend(max_context=8192)}
    store = MemoryResponseStore()
    apps = {name: create_app(backend, model_name=name, max_context=backend.max_context,
                             conversation_start_date=START_DATE, response_store=store)
            for name, backend in backends.items()}
    app = serve_models(apps, max_body_bytes=64 * 1024, api_keys=[KEY], cors_allow_origins=["https://ui.example"])
    with LiveServer(app) as server:
        yield backends, server


@pytest.fixture
def backends(live):
    for backend in live[0].values():
        backend.reset()
    return live[0]


@pytest.fixture
def api(live) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{live[1].url}/v1", api_key=KEY, max_retries=0, timeout=30)


def push_both(backends) -> None:
    for name, backend in backends.items():
        backend.push(SAYS[name])


def test_each_endpoint_reaches_the_backend_of_its_model(api, backends):
    for name in (SMALL, LARGE, SMALL):
        push_both(backends)
        chat = api.chat.completions.create(model=name, messages=[{"role": "user", "content": "Hi"}])
        assert (chat.model, chat.choices[0].message.content) == (name, TEXT[name])
        push_both(backends)
        stream = api.chat.completions.create(model=name, messages=[{"role": "user", "content": "Hi"}], stream=True)
        assert "".join(c.choices[0].delta.content or "" for c in stream if c.choices) == TEXT[name]
    push_both(backends)
    assert api.responses.create(model=LARGE, input="Hi").output_text == TEXT[LARGE]
    # (each push scripts both backends; only the named model's backend takes its script)
    assert [len(b.requests) for b in backends.values()] == [4, 3]
    for backend in backends.values():
        backend.reset()
    push_both(backends)
    completion = api.completions.create(model=LARGE, prompt="Hello", max_tokens=5)
    assert completion.model == LARGE and [len(b.requests) for b in backends.values()] == [0, 1]
    counted = api.responses.input_tokens.count(model=LARGE, input="Hello there")
    push_both(backends)
    assert counted.input_tokens == api.responses.create(model=LARGE, input="Hello there").usage.input_tokens


def test_models_are_listed_together_and_unknown_ones_name_both(api, backends, live):
    listed = api.models.list().data
    assert [(m.id, m.model_extra["max_model_len"]) for m in listed] == [(SMALL, 4096), (LARGE, 8192)]
    assert api.models.retrieve(LARGE).id == LARGE
    for call in (lambda: api.models.retrieve("gpt-5"),
                 lambda: api.chat.completions.create(model="gpt-5", messages=[{"role": "user", "content": "Hi"}])):
        with pytest.raises(openai.NotFoundError) as err:
            call()
        assert err.value.body["code"] == "model_not_found"
        assert SMALL in err.value.message and LARGE in err.value.message
    assert not any(b.requests for b in backends.values())


def test_bodies_the_router_cannot_route(live, backends):
    url, headers = live[1].url, {"authorization": f"Bearer {KEY}"}
    malformed = httpx.post(f"{url}/v1/chat/completions", content=b"{not json", headers=headers)
    assert malformed.status_code == 400 and malformed.json()["error"]["type"] == "invalid_request_error"
    deep = httpx.post(f"{url}/v1/chat/completions", content=b"[" * 5000 + b"]" * 5000, headers=headers)
    assert deep.status_code == 400 and "deeper" in deep.json()["error"]["message"]
    huge = httpx.post(f"{url}/v1/chat/completions", headers=headers, json={
        "model": SMALL, "messages": [{"role": "user", "content": "x" * 70_000}]})
    assert huge.status_code == 413 and huge.json()["error"]["code"] == "request_too_large"
    assert not any(b.requests for b in backends.values())


def test_keys_and_cors_guard_the_router(live):
    url = live[1].url
    assert httpx.get(f"{url}/v1/models").status_code == 401
    assert httpx.post(f"{url}/v1/chat/completions", json={"model": SMALL, "messages": []}).status_code == 401
    assert httpx.get(f"{url}/health").json() == {"status": "ok"}
    preflight = httpx.options(f"{url}/v1/chat/completions", headers={
        "origin": "https://ui.example", "access-control-request-method": "POST",
        "access-control-request-headers": "authorization,content-type"})
    assert preflight.status_code == 200
    assert preflight.headers["access-control-allow-origin"] == "https://ui.example"


def test_the_models_share_stored_responses(api, backends):
    """A response of one model continued with the other (previous_response_id): its output is in the prompt; its key
    owns it whichever model's app stored it."""
    push_both(backends)
    first = api.responses.create(model=SMALL, input="Hi")
    push_both(backends)
    second = api.responses.create(model=LARGE, input="And you?", previous_response_id=first.id)
    assert second.output_text == "large here"
    assert "small here" in backends[LARGE].encoding.decode(backends[LARGE].requests[-1].prompt_ids)
    assert api.responses.retrieve(first.id).model == SMALL and api.responses.retrieve(second.id).model == LARGE


def test_a_batchs_lines_reach_the_model_each_names(api, backends):
    """/v1/batches goes to the first model's app, whose batch sends each line back through the router (with the
    batch's key): a line naming the second model is answered by it."""
    import io
    import json
    import time

    push_both(backends)
    lines = [{"custom_id": name, "method": "POST", "url": "/v1/chat/completions",
              "body": {"model": name, "messages": [{"role": "user", "content": "Hi"}]}} for name in (SMALL, LARGE)]
    source = api.files.create(file=("two.jsonl", io.BytesIO("".join(json.dumps(x) + "\n" for x in lines).encode())),
                              purpose="batch")
    batch = api.batches.create(input_file_id=source.id, endpoint="/v1/chat/completions", completion_window="24h")
    deadline = time.monotonic() + 30
    while (batch := api.batches.retrieve(batch.id)).status != "completed":
        assert time.monotonic() < deadline and batch.status in ("validating", "in_progress", "finalizing"), batch
        time.sleep(0.05)
    out = {x["custom_id"]: x["response"]["body"] for x in map(json.loads, api.files.content(batch.output_file_id)
                                                              .text.splitlines())}
    assert {name: body["choices"][0]["message"]["content"] for name, body in out.items()} == TEXT
    assert {name: body["model"] for name, body in out.items()} == {SMALL: SMALL, LARGE: LARGE}
    assert [r.priority for r in backends[SMALL].requests + backends[LARGE].requests] == [1, 1]
