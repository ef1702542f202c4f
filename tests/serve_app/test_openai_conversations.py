"""/v1/conversations and responses created in one, through the openai client against a live uvicorn server with a
MemoryResponseStore; and the store's own accounting of conversations."""

from __future__ import annotations

import asyncio

import httpx
import openai
import pytest
from openai.types.conversations import Conversation, ConversationItem
from pydantic import TypeAdapter

from serve_app.harmony.encoding import load_harmony_encoding
from serve_app.openai_api.stored_responses import MemoryResponseStore, StoredConversation, StoredResponse
from tests.serve_app.conftest import MODEL, openai_client, scripted_app
from tests.serve_app.stub_backend import ScriptedBackend
from tests.serve_app.test_openai_background import wait_for
from tests.serve_app.test_openai_stored_responses import (CALL, FIRST, SECOND, TOOLS, api, as_input,  # noqa: F401
                                                          backend, live)

ENC = load_harmony_encoding()
ITEM = TypeAdapter(ConversationItem)
LONG = "<|channel|>final<|message|>" + "word " * 200 + "<|return|>"


def test_a_conversation_is_created_read_updated_and_deleted(api):
    made = api.conversations.create(items=[{"role": "user", "content": "Hi"},
                                           {"type": "message", "role": "assistant", "content": "Hello!", "id": "msg_a"}],
                                    metadata={"topic": "greeting"})
    assert made.object == "conversation" and made.id.startswith("conv_") and made.metadata == {"topic": "greeting"}
    assert api.conversations.retrieve(made.id).model_dump() == made.model_dump()
    items = api.conversations.items.list(made.id, order="asc")
    assert [item.role for item in items.data] == ["user", "assistant"] and items.data[1].id == "msg_a"
    # string content is listed as one text part, with a status, as OpenAI lists it
    assert [(p.type, p.text) for p in items.data[0].content] == [("input_text", "Hi")]
    assert [(p.type, p.text) for p in items.data[1].content] == [("output_text", "Hello!")]
    assert {item.status for item in items.data} == {"completed"}

    updated = api.conversations.update(made.id, metadata={"topic": "farewell"})
    assert updated.metadata == {"topic": "farewell"} and updated.created_at == made.created_at
    deleted = api.conversations.delete(made.id)
    assert (deleted.id, deleted.object, deleted.deleted) == (made.id, "conversation.deleted", True)
    for call in (lambda: api.conversations.retrieve(made.id), lambda: api.conversations.delete(made.id),
                 lambda: api.conversations.items.list(made.id),
                 lambda: api.conversations.update(made.id, metadata={})):
        with pytest.raises(openai.NotFoundError) as err:
            call()
        assert err.value.code == "not_found" and made.id in err.value.message


def test_responses_in_a_conversation_are_the_whole_conversation_resent(api, backend):
    """Each turn's prompt is, token for token, that of the conversation sent whole in `input`; each turn that ends
    adds its input and output items to the conversation, in order."""
    conv = api.conversations.create(items=[{"role": "developer", "content": "Be brief."}])
    backend.push(FIRST)
    first = api.responses.create(model=MODEL, input="Hi", conversation=conv.id)
    backend.push(SECOND)
    second = api.responses.create(model=MODEL, input="How are you?", conversation={"id": conv.id})
    in_conversation = backend.requests[-1].prompt_ids
    backend.push(SECOND)
    api.responses.create(model=MODEL, store=False, input=[{"role": "developer", "content": "Be brief."},
                                                          {"role": "user", "content": "Hi"}, *as_input(first.output),
                                                          {"role": "user", "content": "How are you?"}])
    assert in_conversation == backend.requests[-1].prompt_ids
    assert first.conversation.id == second.conversation.id == conv.id
    items = api.conversations.items.list(conv.id, order="asc", limit=100).data
    assert [item.type for item in items] == ["message", "message", "reasoning", "message", "message", "message"]
    assert [item.id for item in items[2:4]] == [item.id for item in first.output]
    assert items[-1].id == second.output[0].id and items[-1].content[0].text == "Fine, thanks."
    assert items[4].content[0].text == "How are you?"
    for item in items:  # each validates as the openai package's conversation item
        assert ITEM.validate_python(item.model_dump()).id == item.id
    counted = api.responses.input_tokens.count(model=MODEL, input="And now?", conversation=conv.id)
    backend.push(SECOND)
    assert api.responses.create(model=MODEL, input="And now?", conversation=conv.id).usage.input_tokens == \
        counted.input_tokens


def test_a_tool_call_turn_and_its_output_in_the_next_turn(api, backend):
    conv = api.conversations.create()
    backend.push(CALL)
    first = api.responses.create(model=MODEL, input="Weather in Rome?", tools=TOOLS, conversation=conv.id)
    call = next(item for item in first.output if item.type == "function_call")
    backend.push(SECOND)
    api.responses.create(model=MODEL, tools=TOOLS, conversation=conv.id,
                         input=[{"type": "function_call_output", "call_id": call.call_id, "output": "sunny"}])
    prompt = ENC.decode(backend.requests[-1].prompt_ids)
    assert "functions.get_weather" in prompt and "sunny" in prompt
    items = api.conversations.items.list(conv.id, order="asc").data
    assert [item.type for item in items] == ["message", "reasoning", "function_call", "function_call_output", "message"]
    # the call deleted, its output is left without it: the next turn says which item to mend
    api.conversations.items.delete(items[2].id, conversation_id=conv.id)
    with pytest.raises(openai.BadRequestError) as err:
        api.responses.create(model=MODEL, tools=TOOLS, conversation=conv.id, input="And tomorrow?")
    assert err.value.param == "conversation" and items[3].id in err.value.message
    api.conversations.items.delete(items[3].id, conversation_id=conv.id)
    backend.push(SECOND)
    assert api.responses.create(model=MODEL, tools=TOOLS, conversation=conv.id, input="And tomorrow?").output_text


def test_items_are_added_paged_read_and_deleted(api, backend):
    conv = api.conversations.create(items=[{"role": "user", "content": f"note {i}"} for i in range(3)])
    added = api.conversations.items.create(conv.id, items=[{"role": "user", "content": "note 3"},
                                                           {"role": "user", "content": "note 4", "id": "msg_four"}])
    assert [item.content[0].text for item in added.data] == ["note 3", "note 4"]
    assert (added.first_id, added.last_id, added.has_more) == (added.data[0].id, "msg_four", False)
    newest = api.conversations.items.list(conv.id, limit=2)
    assert [item.content[0].text for item in newest.data] == ["note 4", "note 3"] and newest.has_more
    rest = api.conversations.items.list(conv.id, limit=10, after=newest.last_id)
    assert [item.content[0].text for item in rest.data] == ["note 2", "note 1", "note 0"] and not rest.has_more
    assert api.conversations.items.retrieve("msg_four", conversation_id=conv.id).content[0].text == "note 4"

    after_delete = api.conversations.items.delete("msg_four", conversation_id=conv.id)
    assert after_delete.id == conv.id and after_delete.object == "conversation"
    with pytest.raises(openai.NotFoundError) as err:
        api.conversations.items.retrieve("msg_four", conversation_id=conv.id)
    assert err.value.param == "item_id"
    with pytest.raises(openai.NotFoundError):
        api.conversations.items.delete("msg_four", conversation_id=conv.id)
    backend.push(SECOND)
    api.responses.create(model=MODEL, input="Summarize.", conversation=conv.id)
    prompt = ENC.decode(backend.requests[-1].prompt_ids)
    assert "note 3" in prompt and "note 4" not in prompt  # a deleted item is out of the next turn's prompt


def test_reasoning_items_carry_encrypted_content_when_included(api, backend):
    conv = api.conversations.create()
    backend.push(FIRST)
    api.responses.create(model=MODEL, input="Hi", conversation=conv.id)
    plain = api.conversations.items.list(conv.id, order="asc").data[1]
    included = api.conversations.items.list(conv.id, order="asc", include=["reasoning.encrypted_content"]).data[1]
    assert plain.type == included.type == "reasoning"
    assert plain.encrypted_content is None and included.encrypted_content
    # sent back with only that field, it reads as the reasoning it carries
    backend.push(SECOND)
    api.responses.create(model=MODEL, store=False, input=[
        {"role": "user", "content": "Hi"}, {"type": "reasoning", "summary": [],
                                            "encrypted_content": included.encrypted_content}])
    assert "Greet back." in ENC.decode(backend.requests[-1].prompt_ids)
    one = api.conversations.items.retrieve(included.id, conversation_id=conv.id,
                                           include=["reasoning.encrypted_content"])
    assert one.encrypted_content == included.encrypted_content


def test_output_logprobs_are_listed_only_when_included(api, backend):
    conv = api.conversations.create()
    backend.push(SECOND)
    made = api.responses.create(model=MODEL, input="Hi", conversation=conv.id, top_logprobs=2,
                                include=["message.output_text.logprobs"])
    computed = made.output[0].content[0].logprobs
    assert computed and len(computed[0].top_logprobs) == 2
    plain = api.conversations.items.list(conv.id).data[0]
    included = api.conversations.items.list(conv.id, include=["message.output_text.logprobs"]).data[0]
    assert plain.id == included.id == made.output[0].id and plain.content[0].logprobs == []
    assert [lp.model_dump() for lp in included.content[0].logprobs] == [lp.model_dump() for lp in computed]


def test_only_turns_that_end_with_output_join_the_conversation(api, backend):
    """completed and incomplete turns are added; a failed or cancelled one adds nothing (the client sends it again)."""
    conv = api.conversations.create()
    backend.push(LONG)
    cut = api.responses.create(model=MODEL, input="Count.", conversation=conv.id, max_output_tokens=5)
    assert cut.status == "incomplete"
    assert len(api.conversations.items.list(conv.id).data) == 2
    backend.push(LONG, fail_after=2, chunk=1)
    events = list(api.responses.create(model=MODEL, input="Again.", conversation=conv.id, stream=True))
    assert events[-1].type == "error"
    backend.push(LONG, delay_s=0.05)
    running = api.responses.create(model=MODEL, input="Slowly.", conversation=conv.id, background=True)
    assert running.conversation.id == conv.id
    assert api.responses.cancel(running.id).status == "cancelled"
    backend.push(SECOND)
    done = api.responses.create(model=MODEL, input="Fine?", conversation=conv.id, background=True)
    wait_for(api, done.id, ("completed",))
    items = api.conversations.items.list(conv.id, order="asc").data
    texts = [item.content[0].text for item in items if item.type == "message"]
    assert texts[0] == "Count." and texts[2:] == ["Fine?", "Fine, thanks."]  # nothing of "Again." or "Slowly."


def test_bad_requests_are_clear_errors(api, backend, live):
    conv = api.conversations.create()
    backend.push(FIRST)
    first = api.responses.create(model=MODEL, input="Hi")
    with pytest.raises(openai.BadRequestError) as err:
        api.responses.create(model=MODEL, input="Hi", conversation=conv.id, previous_response_id=first.id)
    assert err.value.param == "conversation"
    with pytest.raises(openai.NotFoundError) as err:
        api.responses.create(model=MODEL, input="Hi", conversation="conv_missing")
    assert err.value.param == "conversation" and "conv_missing" in err.value.message
    assert len(backend.requests) == 1  # neither reached the engine
    # a response id is not a conversation id, nor the reverse
    with pytest.raises(openai.NotFoundError):
        api.conversations.retrieve(first.id)
    with pytest.raises(openai.NotFoundError):
        api.responses.retrieve(conv.id)
    with pytest.raises(openai.NotFoundError):
        api.responses.delete(conv.id)
    assert api.conversations.retrieve(conv.id).id == conv.id

    url = f"{live[1].url}/v1/conversations"
    bodies = [({"items": [{"role": "user", "content": "x"}] * 21}, "items"),
              ({"metadata": {f"k{i}": "v" for i in range(17)}}, "metadata"),
              ({"metadata": {"k": "v" * 513}}, "metadata"),
              ({"items": [{"type": "web_search_call"}]}, "items.0"),
              ({"unknown": 1}, "unknown")]
    for body, param in bodies:
        r = httpx.post(url, json=body, timeout=10)
        assert r.status_code == 400 and r.json()["error"]["param"] == param, r.text
    for path, body, param in ((f"/{conv.id}/items", {"items": []}, "items"), (f"/{conv.id}", {}, "metadata")):
        r = httpx.post(url + path, json=body, timeout=10)
        assert r.status_code == 400 and r.json()["error"]["param"] == param, r.text
    for query, param in (("order=up", "order"), ("limit=0", "limit"), ("limit=101", "limit"), ("after=msg_x", "after")):
        r = httpx.get(f"{url}/{conv.id}/items?{query}", timeout=10)
        assert r.status_code == 400 and r.json()["error"]["param"] == param, r.text
    with pytest.raises(openai.BadRequestError) as err:  # conversation must be an id or {"id": ...}
        api.responses.create(model=MODEL, input="Hi", conversation={"name": "x"})
    assert err.value.param.startswith("conversation")


def test_conversations_belong_to_the_api_key_that_made_them():
    backend, store = ScriptedBackend(), MemoryResponseStore()
    with scripted_app(backend, response_store=store, api_keys=["sk-alice", "sk-bob"]) as server:
        alice, bob = (openai.OpenAI(base_url=f"{server.url}/v1", api_key=key, max_retries=0, timeout=30)
                      for key in ("sk-alice", "sk-bob"))
        conv = alice.conversations.create(items=[{"role": "user", "content": "secret"}])
        item_id = alice.conversations.items.list(conv.id).data[0].id
        for call in (lambda: bob.conversations.retrieve(conv.id), lambda: bob.conversations.delete(conv.id),
                     lambda: bob.conversations.update(conv.id, metadata={"a": "b"}),
                     lambda: bob.conversations.items.list(conv.id),
                     lambda: bob.conversations.items.create(conv.id, items=[{"role": "user", "content": "x"}]),
                     lambda: bob.conversations.items.retrieve(item_id, conversation_id=conv.id),
                     lambda: bob.conversations.items.delete(item_id, conversation_id=conv.id),
                     lambda: bob.responses.create(model=MODEL, input="Tell me.", conversation=conv.id)):
            with pytest.raises(openai.NotFoundError):
                call()
        assert backend.requests == []
        assert [item.id for item in alice.conversations.items.list(conv.id).data] == [item_id]


def test_without_a_store_there_are_no_conversations():
    backend = ScriptedBackend()
    with scripted_app(backend) as server:
        api = openai_client(server.url)
        with pytest.raises(openai.BadRequestError) as err:
            api.conversations.create()
        assert "store_max_responses" in err.value.message
        with pytest.raises(openai.BadRequestError) as err:
            api.responses.create(model=MODEL, input="Hi", conversation="conv_1")
        assert err.value.param == "conversation"
        with pytest.raises(openai.NotFoundError):
            api.conversations.retrieve("conv_1")


def test_the_store_counts_conversations_in_its_limits():
    store = MemoryResponseStore(max_responses=3, max_bytes=4000)
    conv = {"id": "conv_1", "object": "conversation", "created_at": 0, "metadata": {}}
    note = {"type": "message", "role": "user", "content": [{"type": "input_text", "text": "x" * 100}], "id": "msg_1"}

    async def main():
        assert await store.put_conversation("conv_1", StoredConversation(conv, [note]))
        size = store.bytes
        assert await store.add_conversation_items("conv_1", [{**note, "id": "msg_2"}]) == "added"
        assert store.bytes > size and store.counts()["conversations"] == 1
        assert await store.add_conversation_items("conv_1", [{**note, "id": f"m{i}"} for i in range(40)]) == \
            "too_large"
        assert len((await store.get_conversation("conv_1")).items) == 2  # nothing of a refused add
        assert await store.add_conversation_items("conv_x", [note]) == "not_found"
        assert (await store.delete_conversation_item("conv_1", "msg_1")).items[0]["id"] == "msg_2"
        assert await store.delete_conversation_item("conv_1", "msg_1") is None
        for i in range(3):  # responses push the least recently used conversation out
            await store.put(f"resp_{i}", StoredResponse({"id": f"resp_{i}", "status": "completed", "output": []}, []))
        assert await store.get_conversation("conv_1") is None and store.counts()["conversations"] == 0
        assert await store.get("conv_1") is None and not await store.delete("conv_1")
        await store.put_conversation("conv_2", StoredConversation({**conv, "id": "conv_2"}, []))
        assert not await store.delete_conversation("resp_2") and await store.get("resp_2") is not None
        assert await store.delete_conversation("conv_2") and store.counts()["conversations"] == 0

    asyncio.run(main())


def test_conversation_objects_validate_against_openai_types(api):
    made = api.conversations.create(metadata={"a": "b"})
    assert Conversation.model_validate(made.model_dump()).metadata == {"a": "b"}
