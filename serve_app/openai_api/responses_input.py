"""/v1/responses input: the request's items (and the stored conversation it continues) as a Harmony prompt.

Input: a string (one user message) or items: messages (user / assistant / system / developer),
`function_call`, `function_call_output` (matched to its call by `call_id`) and `reasoning` (its
`reasoning_text` content, else its summary, else our `encrypted_content`). `instructions`, system and developer
messages are the developer instructions. `truncation: "auto"` drops the oldest items that do not fit.
"""

from __future__ import annotations

import base64
import binascii
import itertools
import uuid
from dataclasses import replace
from typing import Any

from serve_app.harmony.render import (
    AssistantReasoning,
    AssistantText,
    AssistantToolCall,
    FunctionTool,
    HistoryItem,
    Prompt,
    ToolResult,
    UserMessage,
    render_prompt,
)
from serve_app.openai_api.errors import BadRequest
from serve_app.openai_api.generation import IngressConfig
from serve_app.openai_api.output_options import offers
from serve_app.openai_api.protocol import (
    CompactionItem,
    FunctionCallItem,
    FunctionCallOutputItem,
    MessageItem,
    ReasoningItem,
    ResponsesRequest,
    text_of,
)

_ID_PREFIX = {"message": "msg", "function_call": "fc", "function_call_output": "fco", "reasoning": "rs",
              "compaction": "cmp"}

ENVELOPE_PREFIX = "gptoss-reasoning-v1:"
COMPACTION_PREFIX = "gptoss-compaction-v1:"  # a compaction item's encrypted_content (compaction.py)
# How a compaction item's summary reads to the model: an assistant message where the item sits
COMPACTED_PREFACE = "Summary of the conversation so far (its earlier messages were compacted into it):\n\n"


def reasoning_envelope(text: str) -> str:
    """A reasoning item's `encrypted_content` (with include=["reasoning.encrypted_content"]): the text, base64. Not a
    secret (gpt-oss's reasoning is returned in `content` too); it lets clients that send reasoning items back with
    only `encrypted_content` (OpenAI's stateless pattern, store=false) keep the reasoning a tool call needs."""
    return ENVELOPE_PREFIX + base64.b64encode(text.encode()).decode()


def opened_envelope(value: str | None, prefix: str = ENVELOPE_PREFIX) -> str:
    """The reasoning text of our `encrypted_content` (or, with COMPACTION_PREFIX, a compaction's summary); "" for None
    or another server's (which cannot be read)."""
    if not value or not value.startswith(prefix):
        return ""
    try:
        return base64.b64decode(value[len(prefix):], validate=True).decode()
    except (binascii.Error, UnicodeDecodeError):
        return ""


def compaction_envelope(summary: str) -> str:
    """A compaction item's `encrypted_content`: the summary, base64 (not a secret; the client may read it)."""
    return COMPACTION_PREFIX + base64.b64encode(summary.encode()).decode()


def input_items(req: ResponsesRequest) -> list:
    return [MessageItem(role="user", content=req.input)] if isinstance(req.input, str) else req.input


def _is_instruction(item: Any) -> bool:
    return isinstance(item, MessageItem) and item.role in ("system", "developer")


def responses_prompt(req: ResponsesRequest, config: IngressConfig, earlier: list | None = None,
                     drop: int = 0) -> Prompt:
    """The Harmony prompt of `req`, its input after `earlier` (the items of the response it continues), less
    the `drop` oldest conversation items (every item but system and developer messages, which stay: truncation)
    and the outputs of calls dropped with them."""
    instructions = [req.instructions] if req.instructions else []
    history: list[HistoryItem] = []
    call_names: dict[str, str] = {}
    dropped_calls: set[str] = set()
    own = input_items(req)
    items = (earlier or []) + own
    for i, item in enumerate(items, start=len(own) - len(items)):  # i: the index in the request's `input`
        if drop and not _is_instruction(item):
            drop -= 1
            if isinstance(item, FunctionCallItem):
                dropped_calls.add(item.call_id)
            continue
        if isinstance(item, FunctionCallOutputItem) and item.call_id in dropped_calls:
            continue
        if isinstance(item, MessageItem):
            text = text_of(item.content)
            if item.role in ("system", "developer"):
                instructions.append(text)
            elif item.role == "user":
                history.append(UserMessage(text))
            elif text:
                history.append(AssistantText(text))
        elif isinstance(item, FunctionCallItem):
            call_names[item.call_id] = item.name
            history.append(AssistantToolCall(item.name, item.arguments))
        elif isinstance(item, FunctionCallOutputItem):
            if item.call_id not in call_names and i < 0:  # a stored item: a conversation's, its call deleted
                raise BadRequest(
                    f"item {item.id!r} of the conversation is a function_call_output for call_id {item.call_id!r}, "
                    "which matches no earlier function_call item; delete it, or add the call before it.",
                    param="conversation" if req.conversation is not None else "previous_response_id")
            if item.call_id not in call_names:
                raise BadRequest(
                    f"input[{i}] is a function_call_output for call_id {item.call_id!r}, which matches no earlier "
                    "function_call item; include the function_call item before its output.",
                    param=f"input.{i}.call_id")
            history.append(ToolResult(call_names[item.call_id], text_of(item.output)))
        elif isinstance(item, ReasoningItem):
            text = "".join(c.text for c in item.content or []) or "".join(s.text for s in item.summary) or \
                opened_envelope(item.encrypted_content)
            if text:
                history.append(AssistantReasoning(text))
        elif isinstance(item, CompactionItem):
            summary = opened_envelope(item.encrypted_content, COMPACTION_PREFIX)
            if not summary:
                raise BadRequest(f"{'input' if i >= 0 else 'a stored'} compaction item's encrypted_content is not one "
                                 "this server made (POST /v1/responses/compact here makes them)",
                                 param=f"input.{i}.encrypted_content" if i >= 0 else None)
            history.append(AssistantText(COMPACTED_PREFACE + summary))
    tools = [FunctionTool(t.name, t.description or "", t.parameters) for t in req.tools or []
             if offers(req.tool_choice, t.name)]
    return Prompt(
        history=history,
        instructions="\n\n".join(s for s in instructions if s) or None,
        tools=tools,
        reasoning_effort=(req.reasoning.effort if req.reasoning else None) or "medium",
        conversation_start_date=config.start_date(),
        knowledge_cutoff=config.knowledge_cutoff,
    )


def new_id(prefix: str) -> str:
    return f"{prefix}_{uuid.uuid4().hex}"


def stored_item_json(item: Any) -> dict[str, Any]:
    """An input item as JSON with an id (the client's, or a new one)."""
    data = item.model_dump(mode="json", exclude_none=True)
    data["id"] = data.get("id") or new_id(_ID_PREFIX[item.type])
    return data


def stored_input_items(req: ResponsesRequest) -> list[dict[str, Any]]:
    """The request's input items as JSON, each with an id."""
    return [stored_item_json(item) for item in input_items(req)]


def fitted_prompt(req: ResponsesRequest, config: IngressConfig, earlier: list | None,
                  response_format: str | None) -> list[int]:
    """The prompt's token ids. With `truncation: "auto"` a prompt that leaves too little room drops its oldest
    conversation items (responses_prompt's `drop`, the fewest that fit; the last item always stays) so that
    max_output_tokens fit after it, or the ingress' default_max_tokens, or else one token. A prompt that still
    does not fit is left to sampling_params' 400.

    Each try is a whole render (~0.1 s for a full 131k-token context, in a render worker for long prompts), so the
    search starts where the items' sizes say the cut falls (tokens in proportion to characters) and gallops
    from there (fewest_drops): 5 renders in all where the bisection over every item took 8 (121 items,
    tests/serve_app/test_openai_truncation.py); renders are kept, so none is done twice."""
    renders: dict[int, list[int]] = {}

    def render(drop: int) -> list[int]:
        if drop not in renders:
            renders[drop] = render_prompt(
                replace(responses_prompt(req, config, earlier, drop), response_format=response_format), "input")
        return renders[drop]

    ids = render(0)
    limit = config.max_context - (req.max_output_tokens or config.default_max_tokens or 1)
    if req.truncation != "auto" or len(ids) <= limit:
        return ids
    sizes = [len(item.model_dump_json()) for item in (earlier or []) + input_items(req) if not _is_instruction(item)]
    hi = len(sizes) - 1
    excess = (len(ids) - limit) / len(ids) * sum(sizes)  # characters to drop
    guess = 1 + sum(1 for total in itertools.accumulate(sizes) if total < excess)
    drop = fewest_drops(lambda d: len(render(d)) <= limit, guess, 1, hi)
    return render(drop if drop is not None else max(hi, 0))


def fewest_drops(fits, guess: int, lo: int, hi: int) -> int | None:
    """The least d in [lo, hi] with fits(d), for a predicate that stays true once true (a prompt only shrinks as
    more is dropped; lo - 1 is known not to fit); None if hi does not fit. Gallops from `guess` (doubling steps
    away from it) and then bisects: ~2 log2(distance from the guess) + 2 calls."""
    if hi < lo:
        return None
    guess = min(max(guess, lo), hi)
    if fits(guess):
        good, step = guess, 1
        while good - step >= lo and fits(good - step):
            good, step = good - step, step * 2
        bad = max(good - step, lo - 1)
    else:
        bad, step = guess, 1
        while bad + step < hi and not fits(bad + step):
            bad, step = bad + step, step * 2
        good = min(bad + step, hi)
        if good == hi and not fits(hi):
            return None
    while good - bad > 1:  # bad does not fit (or is lo - 1), good does
        mid = (good + bad) // 2
        if fits(mid):
            good = mid
        else:
            bad = mid
    return good
