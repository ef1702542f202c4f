"""POST /v1/responses/compact: a long conversation compacted into its user messages and one `compaction` item, for the
openai client's `responses.compact` (agents call it when their context fills up).

    compacted = client.responses.compact(model="gpt-oss", input=items)  # or previous_response_id=...
    client.responses.create(model="gpt-oss", input=[*compacted.output, {"role": "user", "content": "Go on."}])

The model writes the summary: the conversation (the stored chain of `previous_response_id`, then `input`, with
`instructions`) is run as a Responses request with one more user message asking for a summary that lets the work go on
(SUMMARY_REQUEST; reasoning effort low, at most COMPACT_MAX_TOKENS output tokens or what the context leaves, not
stored). The answer is OpenAI's
`response.compaction` object: `output` holds every user message of the conversation, in order, then one compaction
item whose `encrypted_content` is the summary (base64 behind our prefix: not a secret, the client may read it); `usage`
is the summarizing request's. A later request renders a compaction item as an assistant message with the summary where
the item sits (responses_input.COMPACTED_PREFACE), so the model sees the user's messages and what it had made of the
rest; a compaction item another server made is a 400.

Decisions: the summary is the final answer's text, else (a model that ran out of tokens while reasoning) its
reasoning; neither is a 503 (try again). Nothing is stored. Fields OpenAI's endpoint takes for its own models
(`prompt_cache_*`, `service_tier`, `safety_identifier`, `image`) are accepted and ignored.
"""

from __future__ import annotations

import json
import time
from dataclasses import replace
from typing import Any, Union

from starlette.requests import Request

from serve_app.openai_api.auth import requester
from serve_app.openai_api.errors import BadRequest, EngineFailure
from serve_app.openai_api.generation import IngressContext
from serve_app.openai_api.protocol import InputItem, Lenient, MessageItem, ReasoningOptions, ResponsesRequest, text_of
from serve_app.openai_api.responses import create_response, earlier_items
from serve_app.openai_api.responses_input import compaction_envelope, input_items, new_id

COMPACT_MAX_TOKENS = 8192  # the summarizing request's output (its reasoning included)
SUMMARY_REQUEST = (
    "Your context is about to be compacted: everything but the user's messages will be replaced by what you write "
    "now. Write a summary of the conversation so far that lets you continue it without the earlier messages: the "
    "user's goals and constraints, what has been decided and done (the tool calls and results that matter, with "
    "their key values), what you learned, open questions, and the next steps. Be complete but concise; write only "
    "the summary.")


class CompactRequest(Lenient):
    model: str
    input: Union[str, list[InputItem], None] = None
    instructions: str | None = None
    previous_response_id: str | None = None


async def compact(req: CompactRequest, http: Request, ctx: IngressContext) -> dict[str, Any]:
    if not req.input and req.previous_response_id is None:
        raise BadRequest("nothing to compact: give the conversation as `input`, or `previous_response_id`",
                         param="input")
    own = [] if req.input is None else input_items(ResponsesRequest(model=req.model, input=req.input))
    # the stored chain, read once: the summarizing request gets it in its input (no second read of the store)
    earlier = [] if req.previous_response_id is None else await earlier_items(
        ResponsesRequest(model=req.model, input=[], previous_response_id=req.previous_response_id), ctx,
        requester(http))
    summarize = ResponsesRequest(model=req.model, input=[*earlier, *own,
                                                         MessageItem(role="user", content=SUMMARY_REQUEST)],
                                 instructions=req.instructions, store=False, reasoning=ReasoningOptions(effort="low"))
    # its output: at most COMPACT_MAX_TOKENS, and what the context leaves (the default of a request that sets none)
    limit = min(COMPACT_MAX_TOKENS, ctx.config.default_max_tokens or COMPACT_MAX_TOKENS)
    answer = await create_response(summarize, http, replace(ctx, config=replace(ctx.config, default_max_tokens=limit)))
    response = json.loads(answer.body)
    summary = output_text(response, "message") or output_text(response, "reasoning")
    if not summary:
        raise EngineFailure("The model wrote no summary of the conversation; try again.")
    users = [{"id": getattr(item, "id", None) or new_id("msg"), "type": "message", "role": "user",
              "status": "completed", "content": [{"type": "input_text", "text": text_of(item.content)}]}
             for item in [*earlier, *own] if isinstance(item, MessageItem) and item.role == "user"]
    return {"id": new_id("cmp"), "object": "response.compaction", "created_at": int(time.time()),
            "output": [*users, {"id": new_id("cmp"), "type": "compaction",
                                "encrypted_content": compaction_envelope(summary)}],
            "usage": response["usage"]}


def output_text(response: dict[str, Any], kind: str) -> str:
    """The text of a response's output items of `kind` ("message": output_text parts; "reasoning": its text)."""
    return "".join(part.get("text", "") for item in response["output"] if item["type"] == kind
                   for part in item.get("content") or []).strip()
