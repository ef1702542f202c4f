"""/v1/responses over Harmony: POST creates a response; GET, DELETE and GET .../input_items read stored ones;
POST .../cancel stops a background one (background.py).

The input becomes a Harmony prompt in responses_input.py. With a response store (stored_responses.py) a
response is kept unless the request says `store: false`, and `previous_response_id` puts that response's
conversation (every earlier input and output item of its chain, not its instructions) before the input; without
one, `store` is ignored and `previous_response_id` is refused. `background: true` (with a store) answers at once
with status `queued` and generates the response in a task of this replica (background.py); with `stream: true`
too, the answer is the response's event stream, read back from the store, which GET .../{id}?stream=true resumes
(starting_after). `conversation` runs it in a stored conversation (conversations.py): the conversation's items
come before the input, and its turn is appended when it ends with output.

Output: one item per Harmony message: `reasoning` (analysis), `message` (final, or a commentary
preamble with phase "commentary"), `function_call` (recipient `functions.NAME`, any channel). A
response cut by max_output_tokens has status "incomplete" and ends with `response.incomplete`.
"""

from __future__ import annotations

import logging
from dataclasses import replace
from typing import Any

from starlette.requests import Request
from starlette.responses import Response

from serve_app.harmony.constrain import HarmonySchemaSpec
from serve_app.harmony.render import prompt_chars
from serve_app.openai_api.auth import in_batch, requester
from serve_app.openai_api.background import follow_events
from serve_app.openai_api.conversations import conversation_input, list_page, listed_item
from serve_app.openai_api.errors import BadRequest, ResponseNotFound, ask_store
from serve_app.openai_api.generation import IngressContext, request_id_headers
from serve_app.openai_api.output_options import forced_tools, offers, output_constraint_off_loop
from serve_app.openai_api.protocol import INPUT_ITEMS, InputTokensRequest, ResponsesRequest
from serve_app.openai_api.response_run import ResponseRun, response_error
from serve_app.openai_api.responses_input import fitted_prompt, responses_prompt
from serve_app.openai_api.stored_responses import StoredResponse, is_unfinished
from serve_app.openai_api.streaming import EventStreamResponse
from serve_app.openai_api.usage import Caller, caller_of

log = logging.getLogger(__name__)


async def owned(ctx: IngressContext, response_id: str, owner: str | None) -> StoredResponse | None:
    """The stored response if `owner` (auth.requester) made it, else None: another API key's responses are not
    found (404), as if they did not exist."""
    stored = await ask_store(ctx.store.get(response_id)) if ctx.store is not None else None
    return stored if stored is not None and stored.owner == owner else None


async def earlier_items(req: ResponsesRequest, ctx: IngressContext, owner: str | None) -> list | None:
    """The items of the conversation `req.previous_response_id` continues, or of its `conversation` (None without
    either)."""
    if req.conversation is not None:
        if req.previous_response_id is not None:
            raise BadRequest("conversation and previous_response_id cannot both be given: a response continues "
                             "either a conversation or an earlier response", param="conversation")
        return await conversation_input(ctx, req.conversation, owner)
    if req.previous_response_id is None:
        return None
    if ctx.store is None:
        raise BadRequest("previous_response_id needs stored responses, which this server does not keep "
                         "(ingress.store_max_responses=0); send the whole conversation in `input`",
                         param="previous_response_id")
    head = await owned(ctx, req.previous_response_id, owner)
    if head is not None and is_unfinished(head):
        raise BadRequest(f"Previous response with id {req.previous_response_id!r} is still {head.response['status']}; "
                         "continue it once it has finished (GET /v1/responses/{id} shows its status).",
                         param="previous_response_id")
    items = await ask_store(ctx.store.conversation(req.previous_response_id)) if head is not None else None
    if items is None:
        raise BadRequest(f"Previous response with id {req.previous_response_id!r} not found.",
                         param="previous_response_id", code="previous_response_not_found")
    return INPUT_ITEMS.validate_python(items)


def check_background(req: ResponsesRequest, ctx: IngressContext) -> None:
    """400 for a background request this server cannot run: it must be stored."""
    if not req.background:
        return
    if ctx.store is None:
        raise BadRequest("background responses need stored responses, which this server does not keep "
                         "(ingress.store_max_responses=0); use stream=true", param="background")
    if req.store is False:
        raise BadRequest("a background response must be stored (it is read back with GET /v1/responses/{id}); "
                         "leave store out or set it true", param="store")


async def constraint_of(req: ResponsesRequest, ctx: IngressContext) -> tuple[HarmonySchemaSpec | None, str | None]:
    """(output constraint, the response format's text for the prompt) of a Responses request: its text format,
    strict tools and forced tool choice."""
    forced = forced_tools(req.tool_choice, [t.name for t in req.tools or []])
    offered = [t for t in req.tools or [] if offers(req.tool_choice, t.name)]
    return await output_constraint_off_loop(
        req.text.format if req.text else None, "text.format",
        # Responses' function tools are strict unless they say otherwise (OpenAI's default there; Chat's is not)
        [(t.name, t.parameters, f"tools.{i}.parameters") for i, t in enumerate(offered) if t.strict is not False],
        forced, ctx.config.forced_reasoning_budget(req.max_output_tokens))


async def prompt_of(req: ResponsesRequest, ctx: IngressContext,
                    owner: str | None) -> tuple[list[int], HarmonySchemaSpec | None]:
    """(prompt ids, output constraint) of a Responses request, as its engine request gets them: the stored
    conversation it continues, its input, tools and text format, truncated when it asks for that."""
    constraint, response_format = await constraint_of(req, ctx)
    earlier = await earlier_items(req, ctx, owner)
    chars = prompt_chars(responses_prompt(req, ctx.config, earlier, 0)) + len(response_format or "")
    return await ctx.renderer.run(chars, fitted_prompt, req, ctx.config, earlier, response_format), constraint


async def count_input_tokens(req: InputTokensRequest, http: Request, ctx: IngressContext) -> dict[str, Any]:
    """POST /v1/responses/input_tokens: the input tokens a Responses request with these fields would be charged
    (its usage.input_tokens), without running it; a prompt over the context is counted, not refused."""
    prompt_ids, _ = await prompt_of(req, ctx, requester(http))
    return {"object": "response.input_tokens", "input_tokens": len(prompt_ids)}


async def create_response(req: ResponsesRequest, http: Request, ctx: IngressContext) -> Response:
    check_background(req, ctx)
    owner = requester(http)
    prompt_ids, constraint = await prompt_of(req, ctx, owner)
    run = ResponseRun(req, ctx, owner, prompt_ids, constraint, priority=ctx.config.request_priority(
        req.priority, in_batch(http)), caller=caller_of("responses", http))
    return await run.start_background(http) if req.background else await run.answer(http)


async def resume_response(response_id: str, stored: StoredResponse, ctx: IngressContext) -> None:
    """Run here a background response another ingress replica gave back or left (BackgroundRuns.adopt): its request
    again under its own id and creation time, from the start, or, streamed, from where its stored events end (its
    prompt followed by the output tokens that made them: ResponseRun's `resume`). A request that no longer makes a
    prompt (the response it continues was deleted meanwhile), or a stream that cannot go on, ends the response
    failed (a stream with `response.failed`)."""
    rerun = stored.rerun
    stream = rerun.get("stream")
    try:
        req = ResponsesRequest.model_validate(rerun["request"])
        if req.stream and stream is None:
            raise ValueError("its stream's events are gone (the response store restarted)")
        if stream is not None and stream.get("prompt_ids"):  # goes on after the first run's prompt: not made again
            prompt_ids, constraint = list(stream["prompt_ids"]), (await constraint_of(req, ctx))[0]
        else:
            prompt_ids, constraint = await prompt_of(req, ctx, stored.owner)
        run = ResponseRun(req, ctx, stored.owner, prompt_ids, constraint, priority=rerun["priority"],
                          caller=Caller(**rerun["caller"]), response_id=response_id,
                          created=stored.response["created_at"], runs=rerun.get("runs", 1), resume=stream)
    except Exception as err:
        error = response_error(err, "Its server replica stopped and running it again failed: ")
        log.warning("background response %s: cannot run it again here (%s)", response_id, error["message"])
        failed = {**stored.response, "status": "failed", "error": error}
        if stream is not None:  # its followers' stream ends as a failed response's does
            last = stream["events"][-1]["sequence_number"] if stream["events"] else -1
            await ctx.store.append_events(response_id, [{"type": "response.failed", "sequence_number": last + 1,
                                                         "response": failed}], ctx.background.runner)
        await ctx.store.put(response_id, replace(stored, response=failed, rerun=None), ctx.background.runner)
        return
    ctx.background.start(response_id, run.run_in_background)


async def retrieve_response(response_id: str, ctx: IngressContext, owner: str | None) -> dict[str, Any]:
    stored = await owned(ctx, response_id, owner)
    if stored is None:
        raise ResponseNotFound(response_id)
    return stored.response


async def stream_stored_response(http: Request, response_id: str, ctx: IngressContext, owner: str | None,
                                 starting_after: int | None) -> Response:
    """GET /v1/responses/{id}?stream=true[&starting_after=N]: a background response created with stream=true,
    its stream events after sequence number N (all without it), then live ones until it finishes."""
    stored = await owned(ctx, response_id, owner)
    if stored is None:
        raise ResponseNotFound(response_id)
    if starting_after is not None and starting_after < 0:
        raise BadRequest(f"starting_after must be a sequence number (>= 0), not {starting_after}",
                         param="starting_after")
    after = -1 if starting_after is None else starting_after
    if await ask_store(ctx.store.events_after(response_id, after)) is None:
        raise BadRequest(f"Response {response_id!r} has no event stream to read (it was not created with "
                         "background=true and stream=true, or the response store restarted since); retrieve it "
                         "without stream", param="stream")
    return EventStreamResponse(follow_events(ctx.store, response_id, after),
                               headers=request_id_headers(http, response_id), keepalive_s=ctx.config.stream_keepalive_s)


async def cancel_response(response_id: str, ctx: IngressContext, owner: str | None) -> dict[str, Any]:
    """POST /v1/responses/{id}/cancel: stop a background response; the answer is its final state (`cancelled`,
    with the output generated so far; or the state it reached first, if it finished meanwhile)."""
    stored = await owned(ctx, response_id, owner)
    if stored is None:
        raise ResponseNotFound(response_id)
    if not stored.response.get("background"):
        raise BadRequest("Only responses created with background=true can be cancelled.", param="response_id")
    if stored.response["status"] == "cancelled":
        return stored.response
    if not is_unfinished(stored):
        raise BadRequest(f"Response {response_id!r} has already finished (status {stored.response['status']!r}); "
                         "only a queued or in_progress response can be cancelled.", param="response_id")
    final = await ask_store(ctx.background.cancel(response_id))
    if final is None:  # deleted meanwhile
        raise ResponseNotFound(response_id)
    return final.response


async def delete_response(response_id: str, ctx: IngressContext, owner: str | None) -> dict[str, Any]:
    if await owned(ctx, response_id, owner) is None or not await ask_store(ctx.store.delete(response_id)):
        raise ResponseNotFound(response_id)
    return {"id": response_id, "object": "response", "deleted": True}


async def list_input_items(response_id: str, ctx: IngressContext, owner: str | None, *, order: str, limit: int,
                           after: str | None) -> dict[str, Any]:
    """GET /v1/responses/{id}/input_items: the request's own input items, newest first unless order=asc, listed as
    OpenAI lists them (string content as one text part, a status)."""
    stored = await owned(ctx, response_id, owner)
    if stored is None:
        raise ResponseNotFound(response_id)
    return list_page([listed_item(item) for item in stored.input_items], order=order, limit=limit, after=after,
                     where=f"response {response_id!r}")
