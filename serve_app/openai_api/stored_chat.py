"""Stored chat completions: POST /v1/chat/completions with `store: true`, then list, read, update and delete them.

Routes, as OpenAI's: GET /v1/chat/completions (`model`, `metadata[KEY]=VALUE` filters, `after`, `limit` 1-100,
default 20, `order` asc (default) or desc by creation); GET /v1/chat/completions/{id} (the completion object, with its
`metadata`); POST /v1/chat/completions/{id} (`{"metadata": {...}}` replaces it); DELETE /v1/chat/completions/{id};
GET /v1/chat/completions/{id}/messages (the request's messages, ids `{completion id}-{i}`, oldest first by default).

Decisions: chat completions are stored only when the request says `store: true` (OpenAI's default for this endpoint
is false), streamed ones included (the object a non-streamed request would have got, assembled as the stream ends; a
stream the client left early is not stored). They live in the response store (stored_responses.py) beside responses
and conversations, within the same count and byte limits and least-recently-used order; with API keys each key sees
only its own. A server that keeps no responses (ingress.store_max_responses=0) answers `store: true` with a 400, as
it does the other stateful requests. A store that fails while storing leaves the answer standing (logged); a listing
or read it cannot answer is a 503.
"""

from __future__ import annotations

import logging
import time
from typing import Any

from starlette.requests import Request

from serve_app.openai_api.conversations import check_page, list_page, page_json
from serve_app.openai_api.errors import BadRequest, NotFound, ask_store
from serve_app.openai_api.generation import IngressContext
from serve_app.openai_api.protocol import ChatCompletionRequest, ChatMessage, Metadata, Strict
from serve_app.openai_api.stored_responses import ResponseStore, StoredChatCompletion

log = logging.getLogger(__name__)


class ChatCompletionUpdate(Strict):
    metadata: Metadata | None


class ChatCompletionNotFound(NotFound):
    def __init__(self, completion_id: str):
        super().__init__(f"No chat completion found with id {completion_id!r} (only those created with store=true "
                         "are kept, and the least recently used are dropped when the store is full).",
                         param="completion_id")


def store_for(req: ChatCompletionRequest, ctx: IngressContext) -> ResponseStore | None:
    """Where this request's completion is stored: the store when it asked for `store: true`, else None."""
    if not req.store:
        return None
    if ctx.store is None:
        raise BadRequest("store=true needs the response store, which this server does not keep "
                         "(ingress.store_max_responses=0); leave store out", param="store")
    return ctx.store


def stored_message(completion_id: str, index: int, message: ChatMessage) -> dict[str, Any]:
    """A request message as the messages list gives it: its id, its fields as sent, list content as its text in
    `content` and the parts in `content_parts`."""
    out = {"id": f"{completion_id}-{index}", **message.model_dump(exclude_none=True, mode="json")}
    if isinstance(out.get("content"), list):
        out["content_parts"] = out["content"]
        out["content"] = "".join(part.get("text") or "" for part in out["content_parts"])
    return out


async def keep(store: ResponseStore, completion: dict[str, Any], req: ChatCompletionRequest,
               owner: str | None) -> None:
    """Store a finished completion before the answer ends (the body, or the stream's [DONE]), so a GET right after
    finds it. Never raises: a store that fails is logged; the answer stands."""
    completion_id = completion["id"]
    stored = StoredChatCompletion({**completion, "metadata": req.metadata or {}},
                                  [stored_message(completion_id, i, m) for i, m in enumerate(req.messages)],
                                  owner, time.time_ns())
    try:
        if not await store.put_chat_completion(completion_id, stored):
            log.warning("chat completion %s: larger than the whole store, not stored", completion_id)
    except Exception:
        log.exception("chat completion %s: storing it failed", completion_id)


def _store(ctx: IngressContext) -> ResponseStore:
    if ctx.store is None:
        raise BadRequest("stored chat completions need the response store, which this server does not keep "
                         "(ingress.store_max_responses=0)")
    return ctx.store


async def owned(ctx: IngressContext, completion_id: str, owner: str | None) -> StoredChatCompletion:
    """The stored completion if `owner` (auth.requester) made it; else 404, as if it did not exist."""
    stored = await ask_store(_store(ctx).get_chat_completion(completion_id))
    if stored is None or stored.owner != owner:
        raise ChatCompletionNotFound(completion_id)
    return stored


def metadata_filter(request: Request) -> dict[str, str]:
    """The `metadata[KEY]=VALUE` query pairs (as the openai client sends a `metadata` dict)."""
    return {key[len("metadata["):-1]: value for key, value in request.query_params.items()
            if key.startswith("metadata[") and key.endswith("]")}


async def list_completions(ctx: IngressContext, owner: str | None, *, model: str | None, metadata: dict[str, str],
                           order: str, limit: int, after: str | None) -> dict[str, Any]:
    check_page(order, limit)
    found = await ask_store(_store(ctx).list_chat_completions(owner, model, metadata, order, limit, after))
    if found is None:
        raise BadRequest(f"after: no stored chat completion {after!r} in this list", param="after")
    return page_json(*found)


async def retrieve(ctx: IngressContext, completion_id: str, owner: str | None) -> dict[str, Any]:
    return (await owned(ctx, completion_id, owner)).completion


async def update(ctx: IngressContext, completion_id: str, req: ChatCompletionUpdate, owner: str | None) -> dict:
    await owned(ctx, completion_id, owner)
    updated = await ask_store(ctx.store.update_chat_completion(completion_id, req.metadata or {}))
    if updated is None:  # deleted (or dropped for room) meanwhile
        raise ChatCompletionNotFound(completion_id)
    return updated.completion


async def delete(ctx: IngressContext, completion_id: str, owner: str | None) -> dict[str, Any]:
    await owned(ctx, completion_id, owner)
    if not await ask_store(ctx.store.delete_chat_completion(completion_id)):
        raise ChatCompletionNotFound(completion_id)
    return {"id": completion_id, "object": "chat.completion.deleted", "deleted": True}


async def list_messages(ctx: IngressContext, completion_id: str, owner: str | None, *, order: str, limit: int,
                        after: str | None) -> dict[str, Any]:
    stored = await owned(ctx, completion_id, owner)
    return list_page(stored.messages, order=order, limit=limit, after=after, where=f"chat completion {completion_id!r}")
