"""/v1/conversations: conversations kept in the response store, and the `conversation` a /v1/responses request runs in.

A conversation is an object (`conv_...` id, created_at, metadata) and its items, oldest first: the Responses API's
input item types (messages, function calls and their outputs, reasoning), each with an id (the client's, or a new
one) and a status. Message content given as a string is kept as one text part (`input_text`, or `output_text` for the
assistant), as OpenAI lists it.

Routes: POST /v1/conversations (`items`, up to 20, and `metadata`); GET, POST (new `metadata`) and DELETE
/v1/conversations/{id}; POST /v1/conversations/{id}/items (up to 20 `items`); GET .../items (`after`, `limit` 1-100,
`order` desc by default); GET and DELETE .../items/{item_id}. `include=reasoning.encrypted_content` gives reasoning
items our `encrypted_content` (responses_input.reasoning_envelope); `include=message.output_text.logprobs` gives an
assistant message the logprobs its response computed (if that response asked for them; without the include they are
listed empty); other `include` values are accepted and change nothing.

A /v1/responses request with `conversation` (an id, or `{"id": ...}`) sees the conversation's items before its input,
token for token as if they were sent in `input`. When it ends `completed` or `incomplete`, its input items and then
its output items are appended to the conversation, before the client hears it ended; a `failed` or `cancelled` one
adds nothing, so the turn can be sent again. With `previous_response_id` too it is a 400.

Decisions: conversations live in the response store (stored_responses.py), in memory, within the same count and byte
limits and least-recently-used order as responses (a conversation dropped for room, or forgotten by a restart of the
store's replica, is a 404); with API keys a conversation belongs to the key that made it, as responses do; a server
that keeps no responses (ingress.store_max_responses=0) keeps no conversations (POST is a 400).
"""

from __future__ import annotations

import logging
import time
from typing import Any

from pydantic import Field
from starlette.requests import Request

from serve_app.openai_api.errors import BadRequest, NotFound, ask_store
from serve_app.openai_api.generation import IngressContext
from serve_app.openai_api.protocol import INPUT_ITEMS, InputItem, Metadata, Strict
from serve_app.openai_api.responses_input import new_id, reasoning_envelope, stored_item_json
from serve_app.openai_api.stored_responses import StoredConversation

log = logging.getLogger(__name__)

MAX_ITEMS_PER_CALL = 20  # OpenAI: "You may add up to 20 items at a time."
ENDED_WITH_OUTPUT = ("completed", "incomplete")  # a response's states whose turn joins its conversation


class ConversationCreate(Strict):
    items: list[InputItem] | None = Field(None, max_length=MAX_ITEMS_PER_CALL)
    metadata: Metadata | None = None
    safety_identifier: str | None = None  # accepted, as on /v1/responses


class ConversationUpdate(Strict):
    metadata: Metadata


class ItemsCreate(Strict):
    items: list[InputItem] = Field(min_length=1, max_length=MAX_ITEMS_PER_CALL)


class ConversationNotFound(NotFound):
    def __init__(self, conversation_id: str, param: str | None = None):
        super().__init__(f"Conversation with id {conversation_id!r} not found (conversations are kept in memory, "
                         "and the least recently used are dropped when the store is full).", param=param)


def listed_item(data: dict[str, Any]) -> dict[str, Any]:
    """A stored item (JSON, with its id) as OpenAI lists items (a conversation's, a response's input items): string
    content as one text part, a status."""
    if data.get("type", "message") == "message" and isinstance(data.get("content"), str):
        part = "output_text" if data.get("role") == "assistant" else "input_text"
        data = {**data, "content": [{"type": part, "text": data["content"],
                                     **({"annotations": []} if part == "output_text" else {})}]}
    return {"status": "completed", **data}


def _with_includes(item: dict[str, Any], include: list[str]) -> dict[str, Any]:
    """The item as listed: reasoning with `encrypted_content` if asked for; output text with its logprobs only if
    asked for (message.output_text.logprobs; they are there when its response computed them)."""
    if item.get("type") == "reasoning" and "reasoning.encrypted_content" in include:
        text = "".join(part.get("text", "") for part in item.get("content") or [])
        return {**item, "encrypted_content": reasoning_envelope(text)}
    if item.get("type") == "message" and "message.output_text.logprobs" not in include and \
            any(part.get("logprobs") for part in item.get("content") or []):
        return {**item, "content": [{**part, "logprobs": []} if part.get("logprobs") else part
                                    for part in item["content"]]}
    return item


def _store_of(ctx: IngressContext, param: str | None = None):
    if ctx.store is None:
        raise BadRequest("conversations need stored responses, which this server does not keep "
                         "(ingress.store_max_responses=0); send the whole conversation in `input`", param=param)
    return ctx.store


async def owned_conversation(ctx: IngressContext, conversation_id: str, owner: str | None,
                             param: str | None = None) -> StoredConversation:
    """The conversation if `owner` (auth.requester) made it; else 404, as if it did not exist."""
    stored = await ask_store(ctx.store.get_conversation(conversation_id)) if ctx.store is not None else None
    if stored is None or stored.owner != owner:
        raise ConversationNotFound(conversation_id, param)
    return stored


async def conversation_input(ctx: IngressContext, conversation_id: str, owner: str | None) -> list:
    """The items a response in the conversation follows (for the prompt), validated as input items."""
    _store_of(ctx, "conversation")
    stored = await owned_conversation(ctx, conversation_id, owner, param="conversation")
    return INPUT_ITEMS.validate_python(stored.items)


async def record_turn(ctx: IngressContext, conversation_id: str, input_items: list[dict[str, Any]],
                      response: dict[str, Any]) -> None:
    """Append a response's input and output items to its conversation if it ended with output (ENDED_WITH_OUTPUT).
    Never raises: the answer stands; a failure is logged (the conversation then lacks that turn)."""
    if response["status"] not in ENDED_WITH_OUTPUT:
        return
    items = [listed_item(item) for item in input_items + response["output"]]
    try:
        outcome = await ctx.store.add_conversation_items(conversation_id, items)
    except Exception:
        log.exception("response %s: adding its turn to conversation %s failed", response["id"], conversation_id)
        return
    if outcome != "added":
        log.warning("response %s: its turn was not added to conversation %s (%s)", response["id"], conversation_id,
                    outcome)


async def create_conversation(req: ConversationCreate, ctx: IngressContext, owner: str | None) -> dict[str, Any]:
    store = _store_of(ctx)
    conversation = {"id": new_id("conv"), "object": "conversation", "created_at": int(time.time()),
                    "metadata": req.metadata or {}}
    items = [listed_item(stored_item_json(item)) for item in req.items or []]
    if not await ask_store(store.put_conversation(conversation["id"], StoredConversation(conversation, items, owner))):
        raise BadRequest("the conversation's items are larger than the whole store (ingress.store_max_mib)",
                         param="items")
    return conversation


async def update_conversation(conversation_id: str, req: ConversationUpdate, ctx: IngressContext,
                              owner: str | None) -> dict[str, Any]:
    await owned_conversation(ctx, conversation_id, owner)
    updated = await ask_store(ctx.store.update_conversation(conversation_id, req.metadata))
    if updated is None:  # deleted meanwhile
        raise ConversationNotFound(conversation_id)
    return updated.conversation


async def delete_conversation(conversation_id: str, ctx: IngressContext, owner: str | None) -> dict[str, Any]:
    await owned_conversation(ctx, conversation_id, owner)
    if not await ask_store(ctx.store.delete_conversation(conversation_id)):
        raise ConversationNotFound(conversation_id)
    return {"id": conversation_id, "object": "conversation.deleted", "deleted": True}


async def add_items(conversation_id: str, req: ItemsCreate, ctx: IngressContext, owner: str | None,
                    include: list[str]) -> dict[str, Any]:
    await owned_conversation(ctx, conversation_id, owner)
    items = [listed_item(stored_item_json(item)) for item in req.items]
    outcome = await ask_store(ctx.store.add_conversation_items(conversation_id, items))
    if outcome == "not_found":
        raise ConversationNotFound(conversation_id)
    if outcome == "too_large":
        raise BadRequest("the conversation would be larger than the whole store (ingress.store_max_mib) with these "
                         "items; start a new conversation", param="items")
    data = [_with_includes(item, include) for item in items]
    return {"object": "list", "data": data, "first_id": data[0]["id"], "last_id": data[-1]["id"], "has_more": False}


async def list_items(conversation_id: str, ctx: IngressContext, owner: str | None, *, order: str, limit: int,
                     after: str | None, include: list[str]) -> dict[str, Any]:
    stored = await owned_conversation(ctx, conversation_id, owner)
    return list_page([_with_includes(item, include) for item in stored.items], order=order, limit=limit, after=after,
                     where=f"conversation {conversation_id!r}")


async def retrieve_item(conversation_id: str, item_id: str, ctx: IngressContext, owner: str | None,
                        include: list[str]) -> dict[str, Any]:
    stored = await owned_conversation(ctx, conversation_id, owner)
    for item in stored.items:
        if item["id"] == item_id:
            return _with_includes(item, include)
    raise NotFound(f"No item with id {item_id!r} in conversation {conversation_id!r}.", param="item_id")


async def delete_item(conversation_id: str, item_id: str, ctx: IngressContext, owner: str | None) -> dict[str, Any]:
    """DELETE .../items/{item_id}: the conversation object, as OpenAI answers."""
    await owned_conversation(ctx, conversation_id, owner)
    shrunk = await ask_store(ctx.store.delete_conversation_item(conversation_id, item_id))
    if shrunk is None:
        raise NotFound(f"No item with id {item_id!r} in conversation {conversation_id!r}.", param="item_id")
    return shrunk.conversation


def check_page(order: str, limit: int) -> None:
    """A list endpoint's `order` and `limit`, or a 400 naming the one that is wrong."""
    if order not in ("asc", "desc"):
        raise BadRequest(f"order must be 'asc' or 'desc', not {order!r}", param="order")
    if not 1 <= limit <= 100:
        raise BadRequest(f"limit must be between 1 and 100, not {limit}", param="limit")


def list_page(items: list[dict[str, Any]], *, order: str, limit: int, after: str | None,
              where: str) -> dict[str, Any]:
    """One page of a list endpoint (items oldest first): newest first unless order=asc, `limit` of them, after the
    item with id `after`."""
    check_page(order, limit)
    items = items if order == "asc" else items[::-1]
    if after is not None:
        ids = [item["id"] for item in items]
        if after not in ids:
            raise BadRequest(f"after: no item {after!r} in {where}", param="after")
        items = items[ids.index(after) + 1:]
    return page_json(items[:limit], has_more=len(items) > limit)


def page_json(page: list[dict[str, Any]], has_more: bool) -> dict[str, Any]:
    """A list endpoint's answer for one page of objects (each with an `id`)."""
    return {"object": "list", "data": page, "first_id": page[0]["id"] if page else None,
            "last_id": page[-1]["id"] if page else None, "has_more": has_more}


def include_of(request: Request) -> list[str]:
    """The `include` query values, repeated (`include=a&include=b`) or in brackets (`include[]=a`)."""
    return request.query_params.getlist("include") + request.query_params.getlist("include[]")
