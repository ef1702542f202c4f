"""The response store's file (`ingress.store_path`, store_file.py): what a store writes through, a new store on the same
file reads back (responses, conversations, the least-recently-used order, unfinished background responses watched
again), within its own limits; a file that fails leaves the store answering; and a continuation and a conversation go
on across a restart of the app's store, through the openai client."""

from __future__ import annotations

import asyncio
import logging
import sqlite3

import openai
import pytest

from serve_app.openai_api.store_file import StoreFile
from serve_app.openai_api.stored_responses import (MemoryResponseStore, StoredChatCompletion, StoredConversation,
                                                   StoredResponse)
from tests.serve_app.conftest import MODEL, openai_client, scripted_app
from tests.serve_app.stub_backend import ScriptedBackend
from tests.serve_app.test_openai_stored_responses import FIRST, SECOND


def response(rid: str, status: str = "completed", text: str = "hi") -> StoredResponse:
    return StoredResponse({"id": rid, "status": status, "output": [{"type": "message", "role": "assistant",
                                                                     "content": [{"type": "output_text", "text": text}]}]},
                          [{"type": "message", "role": "user", "content": "q", "id": f"msg_{rid}"}])


def conversation(cid: str) -> StoredConversation:
    return StoredConversation({"id": cid, "object": "conversation", "created_at": 1, "metadata": {"k": "v"}}, [], "key1")


def test_a_new_store_on_the_file_has_what_the_old_one_had(tmp_path):
    path = tmp_path / "store" / "responses.db"  # the folder is made
    now = [0.0]

    async def write() -> MemoryResponseStore:
        store = MemoryResponseStore(file=StoreFile(path), clock=lambda: now[0])
        await store.put("resp_1", response("resp_1"))
        await store.put("resp_2", StoredResponse(response("resp_2").response, [], "resp_1", "key1"))
        await store.put("resp_gone", response("resp_gone"))
        await store.delete("resp_gone")
        await store.put("resp_run", response("resp_run", status="in_progress"))
        await store.put_conversation("conv_1", conversation("conv_1"))
        await store.add_conversation_items("conv_1", [{"type": "message", "id": "m1", "content": []},
                                                      {"type": "message", "id": "m2", "content": []}])
        await store.delete_conversation_item("conv_1", "m1")
        await store.update_conversation("conv_1", {"k": "w"})
        await store.put_chat_completion("chatcmpl-1", StoredChatCompletion(
            {"id": "chatcmpl-1", "model": "m", "metadata": {}}, [{"id": "chatcmpl-1-0", "role": "user"}], "key1", 5))
        await store.update_chat_completion("chatcmpl-1", {"k": "v"})
        await store.put("resp_1", response("resp_1", text="rewritten"))  # now the most recently written
        return store

    async def read(old: MemoryResponseStore) -> None:
        store = MemoryResponseStore(file=StoreFile(path), clock=lambda: now[0])
        assert list(store._items) == ["resp_2", "resp_run", "conv_1", "chatcmpl-1", "resp_1"]  # the last writes' order
        assert {k: v[0] for k, v in store._items.items()} == {k: v[0] for k, v in old._items.items()}
        assert store.bytes == old.bytes
        assert store.counts() == {"responses": 3, "conversations": 1, "chat_completions": 1}
        chat = await store.get_chat_completion("chatcmpl-1")
        assert (chat.completion["metadata"], chat.owner, chat.created_ns) == ({"k": "v"}, "key1", 5)
        assert await store.get("resp_gone") is None
        chain = await store.conversation("resp_2")
        assert [item.get("id") for item in chain] == ["msg_resp_1", None, None]
        assert [item["content"][0]["text"] for item in chain[1:]] == ["rewritten", "hi"]
        conv = await store.get_conversation("conv_1")
        assert [item["id"] for item in conv.items] == ["m2"] and conv.conversation["metadata"] == {"k": "w"}
        assert conv.owner == "key1"
        # the unfinished one is watched again: a failed orphan unless its replica polls within orphan_after_s
        assert store.running() == 1
        now[0] = 31.0
        assert await store.sweep_orphans() == 1 and (await store.get("resp_run")).response["status"] == "failed"

    async def main() -> None:
        await read(await write())
        again = MemoryResponseStore(file=StoreFile(path))  # the orphan's failed state was written too
        assert (await again.get("resp_run")).response["status"] == "failed"

    asyncio.run(main())


def test_a_store_with_lower_limits_keeps_the_most_recently_written(tmp_path):
    path = tmp_path / "responses.db"

    async def main() -> None:
        store = MemoryResponseStore(file=StoreFile(path))
        for i in range(5):
            await store.put(f"resp_{i}", response(f"resp_{i}"))
        smaller = MemoryResponseStore(max_responses=2, file=StoreFile(path))
        assert list(smaller._items) == ["resp_3", "resp_4"]
        assert [key for key, _, _ in StoreFile(path).entries()] == ["resp_3", "resp_4"]  # the rest left the file

    asyncio.run(main())


class BrokenFile(StoreFile):
    def write(self, key, stored, body):
        raise sqlite3.OperationalError("disk I/O error")


def test_a_file_that_fails_leaves_the_store_answering(tmp_path, caplog):
    async def main() -> None:
        store = MemoryResponseStore(file=BrokenFile(tmp_path / "responses.db"))
        with caplog.at_level(logging.ERROR):
            assert await store.put("resp_1", response("resp_1"))
        assert (await store.get("resp_1")).response["id"] == "resp_1"
        assert "writing resp_1 to its file failed" in caplog.text

    asyncio.run(main())


def test_a_continuation_and_a_conversation_go_on_across_a_restart_of_the_store(tmp_path):
    """Two app lifetimes on one file: what the first stored, the second continues, token for token."""
    path = tmp_path / "responses.db"
    backend = ScriptedBackend()
    with scripted_app(backend, response_store=MemoryResponseStore(file=StoreFile(path))) as server:
        api = openai_client(server.url)
        backend.push(FIRST)
        first = api.responses.create(model=MODEL, input="Hi")
        conv = api.conversations.create(items=[{"role": "user", "content": "Remember 42."}])
        backend.push(FIRST)
        api.responses.create(model=MODEL, input="Hi", conversation=conv.id)
        backend.push(SECOND)
        api.responses.create(model=MODEL, input="How are you?", previous_response_id=first.id)
        backend.push(SECOND)
        api.responses.create(model=MODEL, input="And?", conversation=conv.id)
        before = [r.prompt_ids for r in backend.requests[-2:]]
        items_before = api.conversations.items.list(conv.id, limit=100).model_dump()
        # (the last turn was added: undo it so that the next life sends the same second turn)
        for item in api.conversations.items.list(conv.id, limit=2).data:
            api.conversations.items.delete(item.id, conversation_id=conv.id)

    backend.reset()
    with scripted_app(backend, response_store=MemoryResponseStore(file=StoreFile(path))) as server:
        api = openai_client(server.url)
        assert api.responses.retrieve(first.id).model_dump() == first.model_dump()
        backend.push(SECOND)
        api.responses.create(model=MODEL, input="How are you?", previous_response_id=first.id)
        backend.push(SECOND)
        api.responses.create(model=MODEL, input="And?", conversation=conv.id)
        assert [r.prompt_ids for r in backend.requests] == before
        after = api.conversations.items.list(conv.id, limit=100).model_dump()
        assert [item["type"] for item in after["data"]] == [item["type"] for item in items_before["data"]]
        with pytest.raises(openai.NotFoundError):
            api.responses.retrieve("resp_never")
