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

import asyncio
import logging
import time
from dataclasses import replace
from typing import Any, AsyncIterator

from openai_harmony import HarmonyEncoding
from starlette.requests import Request
from starlette.responses import JSONResponse, Response

from engine.request import TokenLogprob
from serve_app.harmony.constrain import HarmonySchemaSpec
from serve_app.harmony.parse import ItemDelta, ItemDone, ItemKind, ItemStarted, ParseEvent
from serve_app.harmony.render import prompt_chars
from serve_app.openai_api.auth import in_batch, requester
from serve_app.openai_api.background import EventRecorder, follow_events
from serve_app.openai_api.conversations import conversation_input, list_page, listed_item, record_turn
from serve_app.openai_api.errors import APIError, BadRequest, EngineFailure, ResponseNotFound, ask_store
from serve_app.openai_api.generation import (
    Generation,
    IngressContext,
    SamplingRequest,
    Step,
    request_id_headers,
    respond,
    sampling_params,
)
from serve_app.openai_api.output_options import (forced_tools, logprobs_json, offers,
                                                 output_constraint_off_loop)
from serve_app.openai_api.protocol import INPUT_ITEMS, InputTokensRequest, ResponsesRequest
from serve_app.openai_api.responses_input import (fitted_prompt, new_id, reasoning_envelope, responses_prompt,
                                                  stored_input_items)
from serve_app.openai_api.stored_responses import StoredResponse, is_unfinished
from serve_app.openai_api.streaming import EventStreamResponse, sse
from serve_app.openai_api.usage import caller_of

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


class ResponsesAssembler:
    """Item events -> output items and stream events (the non-stream body is the same items)."""

    def __init__(self, encrypted_reasoning: bool = False, logprobs_top: int | None = None,
                 encoding: HarmonyEncoding | None = None) -> None:
        """encrypted_reasoning: give finished reasoning items `encrypted_content` (reasoning_envelope).
        logprobs_top: output_text logprobs with that many alternatives each (None: none; `encoding` names tokens)."""
        self.encrypted_reasoning = encrypted_reasoning
        self.logprobs_top = logprobs_top
        self.encoding = encoding
        self._logprobs: dict[int, list[TokenLogprob]] = {}  # parser item index -> logprobs not yet in an event
        self.output: list[dict[str, Any]] = []
        self._slot: dict[int, int] = {}  # parser item index -> output index
        self.sequence = 0

    def event(self, kind: str, **fields: Any) -> dict[str, Any]:
        self.sequence += 1
        return {"type": kind, "sequence_number": self.sequence - 1, **fields}

    def step(self, step: Step, status_when_done: str = "completed") -> list[dict[str, Any]]:
        """The stream events of one generation step (its logprobs first, then its item events)."""
        if self.logprobs_top is not None:
            for entry, index in zip(step.content_logprobs, step.content_logprob_items):
                self._logprobs.setdefault(index, []).append(entry)
        return [frame for ev in step.events for frame in self.apply(ev, status_when_done)]

    def _take_logprobs(self, part: dict[str, Any], index: int) -> list[dict[str, Any]]:
        """The item's logprobs that arrived since the last call, as JSON, also appended to its part."""
        entries = self._logprobs.pop(index, None)
        if not entries:
            return []
        out = logprobs_json(entries, self.logprobs_top, self.encoding)
        part["logprobs"] += out
        return out

    def apply(self, ev: ParseEvent, status_when_done: str = "completed") -> list[dict[str, Any]]:
        if isinstance(ev, ItemStarted):
            return self._start(ev)
        n = self._slot[ev.index]
        item = self.output[n]
        at = {"item_id": item["id"], "output_index": n}
        if isinstance(ev, ItemDelta):
            if ev.kind is ItemKind.TOOL_CALL:
                item["arguments"] += ev.text
                return [self.event("response.function_call_arguments.delta", **at, delta=ev.text)]
            item["content"][0]["text"] += ev.text
            if ev.kind is ItemKind.REASONING:
                return [self.event("response.reasoning_text.delta", **at, content_index=0, delta=ev.text)]
            logprobs = self._take_logprobs(item["content"][0], ev.index)
            return [self.event("response.output_text.delta", **at, content_index=0, delta=ev.text, logprobs=logprobs)]
        assert isinstance(ev, ItemDone)
        item["status"] = status_when_done
        if ev.kind is ItemKind.TOOL_CALL:
            events = [self.event("response.function_call_arguments.done", **at, arguments=item["arguments"],
                                 name=item["name"])]
        else:
            part = item["content"][0]
            if ev.kind is ItemKind.REASONING and self.encrypted_reasoning:
                item["encrypted_content"] = reasoning_envelope(part["text"])
            done = "response.reasoning_text.done" if ev.kind is ItemKind.REASONING else "response.output_text.done"
            if ev.kind is not ItemKind.REASONING:
                self._take_logprobs(part, ev.index)
            extra = {} if ev.kind is ItemKind.REASONING else {"logprobs": list(part["logprobs"])}
            events = [self.event(done, **at, content_index=0, text=part["text"], **extra),
                      self.event("response.content_part.done", **at, content_index=0, part=dict(part))]
        return events + [self.event("response.output_item.done", output_index=n, item=_copy(item))]

    def _start(self, ev: ItemStarted) -> list[dict[str, Any]]:
        if ev.kind is ItemKind.TOOL_CALL:
            item = {"id": new_id("fc"), "type": "function_call", "call_id": new_id("call"),
                    "name": ev.tool_name, "arguments": "", "status": "in_progress"}
            part = None
        elif ev.kind is ItemKind.REASONING:
            item = {"id": new_id("rs"), "type": "reasoning", "summary": [], "content": [], "status": "in_progress"}
            part = {"type": "reasoning_text", "text": ""}
        else:
            item = {"id": new_id("msg"), "type": "message", "role": "assistant", "content": [],
                    "status": "in_progress", "phase": "commentary" if ev.channel == "commentary" else "final_answer"}
            part = {"type": "output_text", "text": "", "annotations": [], "logprobs": []}
        n = len(self.output)
        self._slot[ev.index] = n
        events = [self.event("response.output_item.added", output_index=n, item=_copy(item))]
        self.output.append(item)
        if part is not None:
            item["content"].append(part)
            events.append(self.event("response.content_part.added", item_id=item["id"], output_index=n,
                                     content_index=0, part=dict(part)))
        return events


def _copy(item: dict[str, Any]) -> dict[str, Any]:
    return {**item, **({"content": [dict(p) for p in item["content"]]} if "content" in item else {})}


def usage_json(gen: Generation) -> dict[str, Any]:
    u = gen.usage()
    return {"input_tokens": u["prompt_tokens"], "input_tokens_details": {"cached_tokens": u["cached_tokens"], "cache_write_tokens": 0},
            "output_tokens": u["completion_tokens"], "output_tokens_details": {"reasoning_tokens": u["reasoning_tokens"]},
            "total_tokens": u["total_tokens"]}


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


async def prompt_of(req: ResponsesRequest, ctx: IngressContext,
                    owner: str | None) -> tuple[list[int], HarmonySchemaSpec | None]:
    """(prompt ids, output constraint) of a Responses request, as its engine request gets them: the stored
    conversation it continues, its input, tools and text format, truncated when it asks for that."""
    forced = forced_tools(req.tool_choice, [t.name for t in req.tools or []])
    offered = [t for t in req.tools or [] if offers(req.tool_choice, t.name)]
    constraint, response_format = await output_constraint_off_loop(
        req.text.format if req.text else None, "text.format",
        # Responses' function tools are strict unless they say otherwise (OpenAI's default there; Chat's is not)
        [(t.name, t.parameters, f"tools.{i}.parameters") for i, t in enumerate(offered) if t.strict is not False],
        forced, ctx.config.forced_reasoning_budget(req.max_output_tokens))
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
    text_format = req.text.format if req.text else None
    # output_text logprobs when asked for (OpenAI: include "message.output_text.logprobs"; top_logprobs alternatives)
    top_logprobs = (req.top_logprobs or 0) if "message.output_text.logprobs" in (req.include or []) else None
    sampling = sampling_params(SamplingRequest(
        max_tokens=req.max_output_tokens, max_tokens_param="max_output_tokens", temperature=req.temperature,
        top_p=req.top_p, top_k=req.top_k, min_p=req.min_p, seed=req.seed, logprobs=top_logprobs,
    ), len(prompt_ids), ctx.config)
    sampling = replace(sampling, constraint=constraint)
    gen = Generation(ctx, request_id=new_id("resp"), prompt_ids=prompt_ids, sampling=sampling,
                     priority=ctx.config.request_priority(req.priority, in_batch(http)), caller=caller_of("responses", http),
                     cache_salt=req.cache_salt)
    created = time.time()
    store = ctx.store is not None and req.store is not False
    own_items = stored_input_items(req) if store or req.conversation is not None else []

    def stored(response: dict[str, Any]) -> StoredResponse:
        return StoredResponse(response, own_items, req.previous_response_id, owner)

    async def keep(response: dict[str, Any]) -> None:
        """Store the finished response (and its turn in its conversation) before the client hears it finished, so a
        follow-up can name it."""
        if req.conversation is not None:
            await record_turn(ctx, req.conversation, own_items, response)
        if not store:
            return
        try:
            await ctx.store.put(gen.request_id, stored(response))
        except Exception:  # the answer stands; only a later previous_response_id to it will fail
            log.exception("response %s: storing it failed", gen.request_id)

    def snapshot(status: str, output: list[dict[str, Any]], usage: dict | None = None,
                 error: dict | None = None) -> dict[str, Any]:
        return {
            "id": gen.request_id, "object": "response", "created_at": created, "model": ctx.config.model_name,
            "status": status, "output": output, "usage": usage, "error": error,
            "incomplete_details": {"reason": "max_output_tokens"} if status == "incomplete" else None,
            "instructions": req.instructions, "metadata": req.metadata, "user": req.user,
            "tools": [{"type": "function", "name": t.name, "description": t.description,
                       "parameters": t.parameters, "strict": t.strict} for t in req.tools or []],
            "tool_choice": req.tool_choice or "auto", "parallel_tool_calls": req.parallel_tool_calls is not False,
            "temperature": req.temperature, "top_p": req.top_p, "max_output_tokens": req.max_output_tokens,
            "reasoning": {"effort": (req.reasoning.effort if req.reasoning else None) or "medium", "summary": None},
            "text": {"format": text_format or {"type": "text"},
                     "verbosity": (req.text.verbosity if req.text else None) or "medium"},
            "truncation": req.truncation or "disabled", "store": store, "top_logprobs": req.top_logprobs,
            "max_tool_calls": req.max_tool_calls, "prompt_cache_key": req.prompt_cache_key,
            "prompt_cache_retention": req.prompt_cache_retention, "safety_identifier": req.safety_identifier,
            "service_tier": "default",  # the tier it ran in: this server has one, whatever the request asked
            "completed_at": time.time() if status == "completed" else None,
            "previous_response_id": req.previous_response_id, "background": bool(req.background),
            "conversation": {"id": req.conversation} if req.conversation is not None else None,
        }

    def new_assembler() -> ResponsesAssembler:
        return ResponsesAssembler(encrypted_reasoning="reasoning.encrypted_content" in (req.include or []),
                                  logprobs_top=top_logprobs, encoding=ctx.encoding)

    def final_status() -> str:
        return "incomplete" if gen.finish_reason == "length" else "completed"

    async def frames(gen: Generation, assembler: ResponsesAssembler) -> AsyncIterator[list[dict[str, Any]]]:
        async for step in gen.steps():
            # Items closed by the last step were cut short when the response hit max_output_tokens.
            yield assembler.step(step, final_status())

    async def body(gen: Generation) -> dict:
        assembler = new_assembler()
        async for _ in frames(gen, assembler):
            pass
        done = snapshot(final_status(), assembler.output, usage_json(gen))
        await keep(done)
        return done

    async def stream(gen: Generation) -> AsyncIterator[bytes]:
        assembler = new_assembler()
        try:
            yield _frame(assembler.event("response.created", response=snapshot("in_progress", [])))
            yield _frame(assembler.event("response.in_progress", response=snapshot("in_progress", [])))
            async for batch in frames(gen, assembler):
                for frame in batch:
                    yield _frame(frame)
            status = final_status()
            done = snapshot(status, assembler.output, usage_json(gen))
            await keep(done)
            yield _frame(assembler.event(f"response.{status}", response=done))
        except APIError as err:  # mid-stream failure: OpenAI's `error` event
            yield _frame(assembler.event("error", code=err.code, message=err.message, param=err.param))
        finally:
            await gen.close()

    # a streamed background run's events go to the store (background.EventRecorder), its stream reads them there
    recorder = EventRecorder(ctx.store, gen.request_id) if req.background and req.stream else None
    background_assembler = new_assembler() if req.background else None

    async def run_in_background() -> None:
        """The background run (background.py): its states go to the store, the last one whatever happens, once
        its engine request has ended (so a cancel's answer means the engine holds nothing of it); streamed, its
        events too, the last ones before the final state."""
        assembler = background_assembler
        final = None
        try:
            await gen.start()
            in_progress = snapshot("in_progress", [])
            await keep(in_progress)
            if recorder is not None:
                await recorder.add([assembler.event("response.in_progress", response=in_progress)])
            async for batch in frames(gen, assembler):
                if recorder is not None:
                    await recorder.add(batch)
            final = snapshot(final_status(), assembler.output, usage_json(gen))
        except asyncio.CancelledError:  # POST .../cancel (or DELETE): what was generated so far stays
            if ctx.background.stopping:  # not the client's doing: the replica stops (BackgroundRuns.stop)
                final = snapshot("failed", assembler.output, usage_json(gen), error={
                    "code": "server_error", "message": "The server replica running this background response "
                    "stopped before it finished (server_shutdown); create it again."})
            else:
                final = snapshot("cancelled", assembler.output, usage_json(gen))
        except Exception as err:  # a refusal or an engine failure: the response failed, with OpenAI's error
            api = err if isinstance(err, APIError) else EngineFailure(f"{type(err).__name__}: {err}")
            if not isinstance(err, APIError):
                log.exception("background response %s failed", gen.request_id)
            # OpenAI's codes for a response's error are a closed set: ours go into the message
            code = "invalid_prompt" if isinstance(api, BadRequest) else "server_error"
            detail = f" ({api.code})" if api.code else ""
            final = snapshot("failed", assembler.output, usage_json(gen),
                             error={"code": code, "message": api.message + detail})
        finally:
            await gen.close()
            if final is not None:
                if recorder is not None:
                    if final["status"] != "cancelled":  # OpenAI's stream has no event for a cancelled response
                        await recorder.add([assembler.event(f"response.{final['status']}", response=final)])
                    await recorder.close()
                await keep(final)

    if req.background:
        queued = snapshot("queued", [])
        await ask_store(ctx.store.put(gen.request_id, stored(queued)))
        headers = request_id_headers(http, gen.request_id)
        if recorder is None:
            ctx.background.start(gen.request_id, run_in_background)
            return JSONResponse(queued, headers=headers)
        await ask_store(ctx.store.append_events(gen.request_id, [
            background_assembler.event("response.created", response=queued),
            background_assembler.event("response.queued", response=queued)]))
        ctx.background.start(gen.request_id, run_in_background)
        return EventStreamResponse(follow_events(ctx.store, gen.request_id, -1), headers=headers,
                                   keepalive_s=ctx.config.stream_keepalive_s)
    return await respond(http, gen, response_id=gen.request_id, stream=req.stream, make_stream=stream, make_body=body,
                         keepalive_s=ctx.config.stream_keepalive_s)


def _frame(event: dict[str, Any]) -> bytes:
    return sse(event, event=event["type"])


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
