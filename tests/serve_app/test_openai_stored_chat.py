"""Stored chat completions (`store: true`; list, retrieve, update, delete, messages) through the openai client against
a live uvicorn server with a MemoryResponseStore: what is kept, streamed ones too, the list's order, filters and pages,
API keys, and the 4xx answers."""

from __future__ import annotations

import uuid

import openai
import pytest

from serve_app.openai_api.stored_responses import MemoryResponseStore
from tests.serve_app.conftest import MODEL, openai_client, scripted_app
from tests.serve_app.stub_backend import ScriptedBackend

ANSWER = ("<|channel|>analysis<|message|>Greet back.<|end|><|start|>assistant<|channel|>final<|message|>Hello there!"
          "<|return|>")
MESSAGES = [{"role": "system", "content": "Be brief."},
            {"role": "user", "content": [{"type": "text", "text": "Hi "}, {"type": "text", "text": "there"}]}]


@pytest.fixture(scope="module")
def live():
    backend, store = ScriptedBackend(), MemoryResponseStore(max_responses=100)
    with scripted_app(backend, response_store=store, api_keys=["sk-a", "sk-b"]) as server:
        yield backend, server, store


@pytest.fixture
def backend(live) -> ScriptedBackend:
    live[0].reset()
    return live[0]


def client(live, key: str = "sk-a") -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{live[1].url}/v1", api_key=key, max_retries=0, timeout=30)


def tag() -> dict[str, str]:
    """Metadata unique to one test (the module's store is shared)."""
    return {"test": uuid.uuid4().hex[:12]}


def test_store_true_keeps_the_completion_and_the_request_messages(live, backend):
    api, meta = client(live), tag()
    backend.push(ANSWER)
    made = api.chat.completions.create(model=MODEL, messages=MESSAGES, store=True, metadata=meta, logprobs=True)
    got = api.chat.completions.retrieve(made.id)
    assert got.model_dump(exclude={"metadata"}) == made.model_dump(exclude={"metadata"})
    assert got.metadata == meta and got.choices[0].message.content == "Hello there!"
    assert got.choices[0].logprobs.content and got.choices[0].message.reasoning_content == "Greet back."
    messages = api.chat.completions.messages.list(made.id)
    assert [(m.id, m.role, m.content) for m in messages] == \
        [(f"{made.id}-0", "system", "Be brief."), (f"{made.id}-1", "user", "Hi there")]
    assert [(p.type, p.text) for p in messages.data[1].content_parts] == [("text", "Hi "), ("text", "there")]
    assert [m.id for m in api.chat.completions.messages.list(made.id, order="desc", limit=1).data] == [f"{made.id}-1"]
    # without store (OpenAI's default for chat) nothing is kept
    for store in (None, False):
        backend.push(ANSWER)
        kwargs = {} if store is None else {"store": store}
        plain = api.chat.completions.create(model=MODEL, messages=MESSAGES, **kwargs)
        with pytest.raises(openai.NotFoundError, match="store=true"):
            api.chat.completions.retrieve(plain.id)


def test_a_streamed_completion_is_stored_as_the_non_streamed_body(live, backend):
    api = client(live)
    for _ in range(4):
        backend.push(ANSWER)
    body = api.chat.completions.create(model=MODEL, messages=MESSAGES, store=True, n=2, seed=3)
    chunks = list(api.chat.completions.create(model=MODEL, messages=MESSAGES, store=True, stream=True, n=2, seed=3))
    streamed = api.chat.completions.retrieve(chunks[0].id)
    texts = {i: "".join(c.choices[0].delta.content or "" for c in chunks if c.choices and c.choices[0].index == i)
             for i in range(2)}
    assert [c.message.content for c in streamed.choices] == [texts[0], texts[1]] == ["Hello there!"] * 2
    assert [c.model_dump() for c in streamed.choices] == [c.model_dump() for c in body.choices]
    assert streamed.usage == body.usage and streamed.object == "chat.completion"


def test_list_orders_filters_and_pages(live, backend):
    api, meta = client(live), tag()
    ids = []
    for colour in ("red", "blue", "red"):
        backend.push(ANSWER)
        ids.append(api.chat.completions.create(model=MODEL, messages=MESSAGES, store=True,
                                               metadata={**meta, "colour": colour}).id)
    assert [c.id for c in api.chat.completions.list(metadata=meta)] == ids  # oldest first by default
    assert [c.id for c in api.chat.completions.list(metadata=meta, order="desc")] == ids[::-1]
    assert [c.id for c in api.chat.completions.list(metadata={**meta, "colour": "red"})] == [ids[0], ids[2]]
    page = api.chat.completions.list(metadata=meta, limit=2)
    assert [c.id for c in page.data] == ids[:2] and page.has_more
    assert [c.id for c in page.get_next_page().data] == ids[2:]  # `after` the page's last id
    assert [c.id for c in api.chat.completions.list(metadata=meta, limit=1)] == ids  # the client follows the pages
    assert list(api.chat.completions.list(metadata=meta, model="another-model")) == []
    assert [c.id for c in api.chat.completions.list(metadata=meta, model=MODEL)] == ids


def test_update_and_delete(live, backend):
    api, meta = client(live), tag()
    backend.push(ANSWER)
    made = api.chat.completions.create(model=MODEL, messages=MESSAGES, store=True, metadata=meta)
    updated = api.chat.completions.update(made.id, metadata={"reviewed": "yes"})
    assert updated.metadata == {"reviewed": "yes"}
    assert api.chat.completions.retrieve(made.id).metadata == {"reviewed": "yes"}
    assert list(api.chat.completions.list(metadata=meta)) == []  # the old metadata no longer matches
    deleted = api.chat.completions.delete(made.id)
    assert (deleted.id, deleted.deleted, deleted.object) == (made.id, True, "chat.completion.deleted")
    for call in (api.chat.completions.retrieve, api.chat.completions.delete, api.chat.completions.messages.list):
        with pytest.raises(openai.NotFoundError):
            call(made.id)
    with pytest.raises(openai.NotFoundError):
        api.chat.completions.update(made.id, metadata={})


def test_another_keys_completions_are_not_found(live, backend):
    mine, theirs, meta = client(live, "sk-a"), client(live, "sk-b"), tag()
    backend.push(ANSWER)
    made = mine.chat.completions.create(model=MODEL, messages=MESSAGES, store=True, metadata=meta)
    for call in (theirs.chat.completions.retrieve, theirs.chat.completions.delete,
                 theirs.chat.completions.messages.list):
        with pytest.raises(openai.NotFoundError):
            call(made.id)
    assert list(theirs.chat.completions.list(metadata=meta)) == []
    assert [c.id for c in mine.chat.completions.list(metadata=meta)] == [made.id]


def test_bad_list_parameters_and_updates_are_400s(live, backend):
    api, meta = client(live), tag()
    backend.push(ANSWER)
    made = api.chat.completions.create(model=MODEL, messages=MESSAGES, store=True, metadata=meta)
    for kwargs, param in ((dict(order="sideways"), "order"), (dict(limit=0), "limit"), (dict(limit=101), "limit"),
                          (dict(after="chatcmpl-nope"), "after")):
        with pytest.raises(openai.BadRequestError) as err:
            api.chat.completions.list(**kwargs)
        assert err.value.body["param"] == param, kwargs
    with pytest.raises(openai.BadRequestError) as err:
        api.chat.completions.messages.list(made.id, after=f"{made.id}-9")
    assert err.value.body["param"] == "after"
    with pytest.raises(openai.BadRequestError) as err:
        api.chat.completions.update(made.id, metadata={"k": "v" * 513})
    assert err.value.body["param"] == "metadata"
    with pytest.raises(openai.BadRequestError):
        api.chat.completions.update(made.id, metadata={}, extra_body={"model": MODEL})
    assert api.chat.completions.retrieve(made.id).metadata == meta  # unchanged


def test_store_true_on_a_server_without_a_store_is_a_400():
    backend = ScriptedBackend()
    with scripted_app(backend) as server:
        api = openai_client(server.url)
        with pytest.raises(openai.BadRequestError) as err:
            api.chat.completions.create(model=MODEL, messages=MESSAGES, store=True)
        assert err.value.body["param"] == "store" and not backend.requests  # refused before any generation
        with pytest.raises(openai.BadRequestError, match="store_max_responses=0"):
            api.chat.completions.list()
        backend.push(ANSWER)
        assert api.chat.completions.create(model=MODEL, messages=MESSAGES, store=False).choices
