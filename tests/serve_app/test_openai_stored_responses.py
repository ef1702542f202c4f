"""Stored responses: `store`, `previous_response_id`, GET / DELETE / input_items, through the openai client
against a live uvicorn server with a MemoryResponseStore; and the store's own limits."""

from __future__ import annotations

import asyncio
import json

import httpx
import openai
import pytest

from serve_app.harmony.encoding import load_harmony_encoding
from serve_app.openai_api.stored_responses import MemoryResponseStore, StoredResponse
from tests.serve_app.conftest import MODEL, openai_client, scripted_app
from tests.serve_app.stub_backend import ScriptedBackend

ENC = load_harmony_encoding()
FIRST = "<|channel|>analysis<|message|>Greet back.<|end|><|start|>assistant<|channel|>final<|message|>Hello!<|return|>"
SECOND = "<|channel|>final<|message|>Fine, thanks.<|return|>"
LONG_ANSWER = "<|channel|>final<|message|>" + "word " * 200 + "<|return|>"
TOOLS = [{"type": "function", "name": "get_weather", "description": "Current weather",
          "parameters": {"type": "object", "properties": {"location": {"type": "string"}}, "required": ["location"]}}]
CALL = ("<|channel|>analysis<|message|>Need the weather.<|end|>"
        "<|start|>assistant to=functions.get_weather<|channel|>commentary json<|message|>{\"location\":\"Rome\"}<|call|>")


@pytest.fixture(scope="module")
def live():
    backend, store = ScriptedBackend(), MemoryResponseStore(max_responses=100)
    with scripted_app(backend, response_store=store) as server:
        yield backend, server, store


@pytest.fixture
def backend(live) -> ScriptedBackend:
    live[0].reset()
    return live[0]


@pytest.fixture
def api(live) -> openai.OpenAI:
    return openai_client(live[1].url)


def as_input(output) -> list[dict]:
    return [item.model_dump(exclude_none=True) for item in output]


def test_previous_response_id_is_resending_the_conversation(api, backend):
    """The continuation's prompt is, token for token, that of the same conversation sent whole (without the
    first request's instructions, which OpenAI does not carry over)."""
    backend.push(FIRST)
    first = api.responses.create(model=MODEL, input="Hi", instructions="Answer in one word.")
    backend.push(SECOND)
    second = api.responses.create(model=MODEL, input="How are you?", previous_response_id=first.id)
    continued = backend.requests[-1].prompt_ids
    backend.push(SECOND)
    api.responses.create(model=MODEL, store=False, input=[{"role": "user", "content": "Hi"}, *as_input(first.output),
                                                          {"role": "user", "content": "How are you?"}])
    assert continued == backend.requests[-1].prompt_ids
    assert "Answer in one word" not in ENC.decode(continued) and "Hello!" in ENC.decode(continued)
    assert (first.store, second.store, second.previous_response_id) == (True, True, first.id)
    assert second.output_text == "Fine, thanks."


def test_a_chain_of_three_and_a_tool_call_answered_by_call_id(api, backend):
    backend.push(CALL)
    first = api.responses.create(model=MODEL, input="Weather in Rome?", tools=TOOLS)
    call = next(item for item in first.output if item.type == "function_call")
    result = {"type": "function_call_output", "call_id": call.call_id, "output": "sunny"}
    backend.push(SECOND)
    second = api.responses.create(model=MODEL, input=[result], tools=TOOLS, previous_response_id=first.id)
    backend.push(SECOND)
    api.responses.create(model=MODEL, input="Thanks!", tools=TOOLS, previous_response_id=second.id)
    continued = backend.requests[-1].prompt_ids
    whole = [{"role": "user", "content": "Weather in Rome?"}, *as_input(first.output), result,
             *as_input(second.output), {"role": "user", "content": "Thanks!"}]
    backend.push(SECOND)
    api.responses.create(model=MODEL, input=whole, tools=TOOLS, store=False)
    assert continued == backend.requests[-1].prompt_ids
    assert "sunny" in ENC.decode(continued)


def test_retrieve_input_items_and_delete(api, backend):
    backend.push(FIRST)
    made = api.responses.create(model=MODEL, input=[{"role": "developer", "content": "Be kind."},
                                                    {"role": "user", "content": "Hi", "id": "msg_mine"}])
    assert api.responses.retrieve(made.id).model_dump() == made.model_dump()
    items = api.responses.input_items.list(made.id)
    assert [item.id for item in items.data][0] == "msg_mine" and len(items.data) == 2  # newest first
    ascending = api.responses.input_items.list(made.id, order="asc", limit=1)
    assert [i.role for i in ascending.data] == ["developer"] and ascending.has_more
    after = api.responses.input_items.list(made.id, order="asc", after=ascending.data[0].id)
    assert [i.id for i in after.data] == ["msg_mine"] and not after.has_more
    # listed as OpenAI lists input items: string content as one input_text part, with a status
    assert [(p.type, p.text) for p in after.data[0].content] == [("input_text", "Hi")]
    assert {i.status for i in items.data} == {"completed"}

    api.responses.delete(made.id)
    for call in (lambda: api.responses.retrieve(made.id), lambda: api.responses.delete(made.id),
                 lambda: api.responses.input_items.list(made.id)):
        with pytest.raises(openai.NotFoundError) as err:
            call()
        assert err.value.code == "not_found" and made.id in err.value.message


def test_a_streamed_response_is_stored_as_its_completed_event_says(api, backend):
    backend.push(FIRST, chunk=1)
    events = list(api.responses.create(model=MODEL, input="Hi", stream=True))
    completed = events[-1]
    assert completed.type == "response.completed" and completed.response.store
    assert api.responses.retrieve(completed.response.id).model_dump() == completed.response.model_dump()


def test_store_false_unknown_ids_and_failed_responses_are_not_found(api, backend, live):
    backend.push(FIRST)
    unstored = api.responses.create(model=MODEL, input="Hi", store=False)
    assert unstored.store is False
    with pytest.raises(openai.NotFoundError):
        api.responses.retrieve(unstored.id)
    for missing in (unstored.id, "resp_nope"):
        with pytest.raises(openai.BadRequestError) as err:
            api.responses.create(model=MODEL, input="Again", previous_response_id=missing)
        assert (err.value.code, err.value.param) == ("previous_response_not_found", "previous_response_id")
        assert missing in err.value.message
    before = len(live[2])
    backend.push(FIRST, fail_after=1, chunk=1)  # the engine fails mid-answer: an error event, nothing stored
    events = list(api.responses.create(model=MODEL, input="Hi", stream=True))
    assert events[-1].type == "error"
    assert len(live[2]) == before


def test_input_items_checks_its_query(live, backend, api):
    backend.push(FIRST)
    made = api.responses.create(model=MODEL, input="Hi")
    base = f"{live[1].url}/v1/responses/{made.id}/input_items"
    for query, param in (("order=up", "order"), ("limit=0", "limit"), ("after=msg_x", "after")):
        r = httpx.get(f"{base}?{query}", timeout=10)
        assert r.status_code == 400 and r.json()["error"]["param"] == param, r.text


def test_without_a_store_responses_are_stateless(backend_and_server):
    """The default app (conftest) has no store: nothing is kept, and a continuation says why it cannot be."""
    backend, server = backend_and_server
    backend.reset()
    client = openai_client(server.url)
    backend.push(FIRST)
    made = client.responses.create(model=MODEL, input="Hi")
    assert made.store is False
    with pytest.raises(openai.NotFoundError):
        client.responses.retrieve(made.id)
    with pytest.raises(openai.BadRequestError) as err:
        client.responses.create(model=MODEL, input="Again", previous_response_id=made.id)
    assert err.value.param == "previous_response_id" and "store_max_responses" in err.value.message


# -- the store itself ----------------------------------------------------------------------------------------


def stored(text: str, previous: str | None = None, pad: int = 0) -> StoredResponse:
    return StoredResponse({"output": [{"type": "message", "role": "assistant", "content": text}], "pad": "x" * pad},
                          [{"type": "message", "role": "user", "content": f"q {text}", "id": f"msg_{text}"}],
                          previous)


def test_memory_store_drops_the_least_recently_used():
    async def run() -> None:
        store = MemoryResponseStore(max_responses=3)
        await store.put("a", stored("a"))
        await store.put("b", stored("b", "a"))
        await store.put("c", stored("c"))
        assert [item["content"] for item in await store.conversation("b")] == ["q a", "a", "q b", "b"]
        await store.put("d", stored("d"))  # "c" is the least recently used: the chain a <- b was just read
        assert await store.get("c") is None and len(store) == 3
        await store.put("e", stored("e"))  # then "b": reading a chain uses its older links last
        assert await store.get("b") is None and await store.get("a") is not None
        await store.put("f", stored("f", "a"))
        assert await store.delete("a") and not await store.delete("a")
        assert await store.get("f") is not None and await store.conversation("f") is None  # its chain is broken

    asyncio.run(run())


def test_memory_store_byte_limit_and_accounting():
    async def run() -> None:
        one = stored("a", pad=1000).size()
        store = MemoryResponseStore(max_bytes=int(one * 2.5))
        assert one == len(json.dumps([stored("a", pad=1000).response, stored("a").input_items],
                                     separators=(",", ":")))
        for name in "abc":
            assert await store.put(name, stored(name, pad=1000))
        assert len(store) == 2 and store.bytes == 2 * one and await store.get("a") is None
        assert not await store.put("huge", stored("huge", pad=one * 3))  # larger than the store: refused whole
        assert len(store) == 2
        await store.put("b", stored("b", pad=10))  # replacing an entry counts its new size only
        assert store.bytes == one + stored("b", pad=10).size()
        with pytest.raises(ValueError):
            MemoryResponseStore(max_responses=0)

    asyncio.run(run())


class UnreachableStore(MemoryResponseStore):
    """A store whose every call fails, as the ResponseStore replica's handle does while it is gone
    (ServeResponseStore raises TimeoutError after its timeout)."""

    async def put(self, response_id, stored, runner=None):
        raise TimeoutError()

    async def get(self, response_id):
        raise TimeoutError()

    async def conversation(self, response_id):
        raise TimeoutError()

    async def delete(self, response_id):
        raise TimeoutError()


def test_an_unreachable_store_is_a_503_and_never_fails_an_answer(caplog):
    backend = ScriptedBackend()
    with scripted_app(backend, response_store=UnreachableStore()) as server:
        api = openai_client(server.url)
        backend.push(FIRST)
        assert api.responses.create(model=MODEL, input="Hi").output_text == "Hello!"  # answered; storing it failed
        backend.push(FIRST, chunk=1)
        assert list(api.responses.create(model=MODEL, input="Hi", stream=True))[-1].type == "response.completed"
        for call in (lambda: api.responses.retrieve("resp_1"), lambda: api.responses.delete("resp_1"),
                     lambda: api.responses.input_items.list("resp_1"),
                     lambda: api.responses.create(model=MODEL, input="Hi", previous_response_id="resp_1")):
            with pytest.raises(openai.InternalServerError) as err:
                call()
            assert err.value.status_code == 503 and "response store" in err.value.message
    assert "storing it failed" in caplog.text


def test_stored_responses_belong_to_the_api_key_that_made_them():
    """With API keys, another key neither reads, continues, lists, cancels nor deletes a stored response: to it
    the id does not exist (404, or 400 previous_response_not_found)."""
    backend, store = ScriptedBackend(), MemoryResponseStore()
    with scripted_app(backend, response_store=store, api_keys=["sk-alice", "sk-bob"]) as server:
        alice, bob = (openai.OpenAI(base_url=f"{server.url}/v1", api_key=key, max_retries=0, timeout=30)
                      for key in ("sk-alice", "sk-bob"))
        backend.push(FIRST)
        first = alice.responses.create(model=MODEL, input="Hi")
        backend.push(LONG_ANSWER, delay_s=0.05)
        running = alice.responses.create(model=MODEL, input="Hi", background=True)
        for call in (lambda: bob.responses.retrieve(first.id), lambda: bob.responses.delete(first.id),
                     lambda: bob.responses.input_items.list(first.id), lambda: bob.responses.cancel(running.id)):
            with pytest.raises(openai.NotFoundError):
                call()
        with pytest.raises(openai.BadRequestError) as err:
            bob.responses.create(model=MODEL, input="And?", previous_response_id=first.id)
        assert err.value.body["code"] == "previous_response_not_found"
        assert len(backend.requests) == 2  # bob's continuation never reached the engine

        assert alice.responses.retrieve(first.id).id == first.id
        assert [i.id for i in alice.responses.input_items.list(first.id).data]
        assert alice.responses.cancel(running.id).status == "cancelled"
        backend.push(SECOND)
        assert alice.responses.create(model=MODEL, input="And?", previous_response_id=first.id).output_text
        alice.responses.delete(first.id)
        assert not any(stored.owner is None for stored, _ in store._items.values())  # every one has its owner
        assert "sk-alice" not in json.dumps([stored.owner for stored, _ in store._items.values()])


def test_input_tokens_counts_what_the_response_is_charged(api, backend, live):
    """POST /v1/responses/input_tokens (the openai client's responses.input_tokens.count): for each body, the count
    is the usage.input_tokens of creating the response, and nothing reaches the engine."""
    backend.push(FIRST)
    first = api.responses.create(model=MODEL, input="Hi", instructions="Answer in one word.")
    schema = {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"],
              "additionalProperties": False}
    bodies = [
        dict(input="Hello there"),
        dict(input="Weather in Rome?", instructions="Be brief.", tools=TOOLS, reasoning={"effort": "high"}),
        dict(input="Weather in Rome?", tools=TOOLS, tool_choice={"type": "function", "name": "get_weather"}),
        dict(input="Where?", text={"format": {"type": "json_schema", "name": "place", "schema": schema,
                                              "strict": True}}),
        dict(input="How are you?", previous_response_id=first.id),
        dict(input=[{"role": "user", "content": f"Part {i}: " + "word " * 500} for i in range(20)],
             truncation="auto", max_output_tokens=100),  # ~10k tokens over 8,192: counted as truncated
    ]
    for body in bodies:
        sent = len(backend.requests)
        # (max_output_tokens is not among the client's count() arguments; the server takes it, as truncation
        # leaves room for it)
        extra = {k: body[k] for k in ("max_output_tokens",) if k in body}
        counted = api.responses.input_tokens.count(model=MODEL, **{k: v for k, v in body.items() if k not in extra},
                                                   extra_body=extra or None)
        assert counted.object == "response.input_tokens" and len(backend.requests) == sent
        backend.push(SECOND)
        created = api.responses.create(model=MODEL, **body)
        assert counted.input_tokens == created.usage.input_tokens == len(backend.requests[-1].prompt_ids), body
        if body.get("truncation") == "auto":
            assert 8192 // 2 < counted.input_tokens <= 8192 - 100  # older parts dropped, room left for the output

    with pytest.raises(openai.NotFoundError):
        api.responses.input_tokens.count(model="no-such-model", input="Hi")
    with pytest.raises(openai.BadRequestError) as err:
        api.responses.input_tokens.count(input="Hi", previous_response_id="resp_missing")
    assert err.value.body["code"] == "previous_response_not_found"
    no_model = httpx.post(f"{live[1].url}/v1/responses/input_tokens", json={"input": "Hello there",
                                                                          "personality": "friendly"})
    assert no_model.json() == {"object": "response.input_tokens",
                               "input_tokens": api.responses.input_tokens.count(model=MODEL, input="Hello there")
                               .input_tokens}


THOUGHT = "<|channel|>analysis<|message|>Need the weather.<|end|><|start|>assistant"
ARGS = ' <|constrain|>json<|message|>{"location":"Rome"}<|call|>'


@pytest.mark.parametrize("output,shared", [
    (THOUGHT + " to=functions.get_weather<|channel|>commentary" + ARGS, "all"),  # recipient-first, as harmony renders
    (THOUGHT + "<|channel|>commentary to=functions.get_weather" + ARGS, THOUGHT),  # channel-first
    (FIRST, "<|channel|>"),  # a final answer: the turn's reasoning is dropped from the history
])
def test_what_of_a_turns_output_its_next_turn_prompt_repeats(api, backend, output, shared):
    """The next turn's prompt (previous_response_id) starts with the turn's prompt and then repeats its output
    token for token as far as the engine's prefix cache can serve it from the output's own blocks
    (engine/block_manager.py names them when a request ends): all of a tool-calling turn whose header came
    recipient-first, its analysis message up to the call's header when channel-first, one token of a turn that
    answered."""
    tokens = backend.tokens(output)
    backend.push(output)
    first = api.responses.create(model=MODEL, input="Weather in Rome?", tools=TOOLS)
    calls = [item for item in first.output if item.type == "function_call"]
    backend.push(SECOND)
    api.responses.create(model=MODEL, tools=TOOLS, previous_response_id=first.id, input=[
        {"type": "function_call_output", "call_id": calls[0].call_id, "output": "sunny"}] if calls else "Thanks!")
    before, after = (r.prompt_ids for r in backend.requests[-2:])
    whole = before + tokens
    n = next((i for i, (a, b) in enumerate(zip(whole, after)) if a != b), min(len(whole), len(after)))
    assert whole[len(before):n] == (tokens if shared == "all" else backend.tokens(shared)), ENC.decode(whole[n:n + 6])
