"""One /v1/responses generation and the response objects it makes (responses.py creates it; a background one
adopted from another ingress replica is made again by responses.resume_response): the plain body, the event
stream, and the background run whose states go to the store (background.py).

ResponsesAssembler turns the Harmony parser's item events into output items and stream events.
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
from serve_app.openai_api.background import EventRecorder, follow_events
from serve_app.openai_api.conversations import record_turn
from serve_app.openai_api.errors import APIError, BadRequest, EngineFailure, ask_store
from serve_app.openai_api.generation import (Generation, IngressContext, SamplingRequest, Step, request_id_headers,
                                             respond, sampling_params)
from serve_app.openai_api.output_options import logprobs_json
from serve_app.openai_api.protocol import ResponsesRequest
from serve_app.openai_api.responses_input import new_id, reasoning_envelope, stored_input_items
from serve_app.openai_api.stored_responses import StoredResponse
from serve_app.openai_api.streaming import EventStreamResponse, sse
from serve_app.openai_api.usage import Caller

log = logging.getLogger(__name__)


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

    def resume(self, events: list[dict[str, Any]], replayed: list[ParseEvent]) -> None:
        """Take up a stream another run recorded: its output items as its `events` left them, its sequence numbers
        after theirs, its items' parser indices from `replayed` (the item events of the same output tokens fed to a
        fresh parser: Generation.continue_after). ValueError if the two do not tell of the same items."""
        for ev in events:
            kind, n = ev["type"], ev.get("output_index")
            if kind == "response.output_item.added":
                self.output.append(_copy(ev["item"]))
            elif kind == "response.content_part.added":
                self.output[n]["content"].append(dict(ev["part"]))
            elif kind in ("response.output_text.delta", "response.reasoning_text.delta"):
                part = self.output[n]["content"][0]
                part["text"] += ev["delta"]
                part.get("logprobs", []).extend(ev.get("logprobs") or [])
            elif kind == "response.function_call_arguments.delta":
                self.output[n]["arguments"] += ev["delta"]
            elif kind == "response.output_item.done":
                self.output[n] = _copy(ev["item"])
        started = [ev.index for ev in replayed if isinstance(ev, ItemStarted)]
        if len(started) != len(self.output):
            raise ValueError(f"the recorded stream has {len(self.output)} output items, its output tokens "
                             f"{len(started)}")
        self._slot = {index: n for n, index in enumerate(started)}
        self.sequence = events[-1]["sequence_number"] + 1 if events else 0

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
    return {"input_tokens": u["prompt_tokens"],
            "input_tokens_details": {"cached_tokens": u["cached_tokens"], "cache_write_tokens": 0},
            "output_tokens": u["completion_tokens"],
            "output_tokens_details": {"reasoning_tokens": u["reasoning_tokens"]},
            "total_tokens": u["total_tokens"]}


class ResponseRun:
    """A Responses request's generation (its prompt made by responses.prompt_of) and what it answers: `answer`
    (the JSON body or the event stream), or, for `background`, `start_background` (a `queued` response at once, the
    run in a task of this replica). `response_id` / `created`: an adopted background response's own (else new)."""

    def __init__(self, req: ResponsesRequest, ctx: IngressContext, owner: str | None, prompt_ids: list[int],
                 constraint: HarmonySchemaSpec | None, priority: int, caller: Caller, response_id: str | None = None,
                 created: float | None = None, runs: int = 1, resume: dict[str, Any] | None = None):
        """resume: a streamed background response's stored `events` and the `output_ids` that made them
        (background_store.adopt_responses): this run goes on from there, `prompt_ids` (the first run's:
        responses.resume_response) followed by that output."""
        self.req, self.ctx, self.owner = req, ctx, owner
        self.text_format = req.text.format if req.text else None
        # output_text logprobs when asked for (OpenAI: include "message.output_text.logprobs"; top_logprobs
        # alternatives)
        self.top_logprobs = (req.top_logprobs or 0) if "message.output_text.logprobs" in (req.include or []) else None
        sampling = sampling_params(SamplingRequest(
            max_tokens=req.max_output_tokens, max_tokens_param="max_output_tokens", temperature=req.temperature,
            top_p=req.top_p, top_k=req.top_k, min_p=req.min_p, seed=req.seed, logprobs=self.top_logprobs,
        ), len(prompt_ids), ctx.config)
        self.id = response_id or new_id("resp")
        self.prompt_ids = prompt_ids
        output_ids = list(resume["output_ids"]) if resume is not None else []
        if output_ids:
            if output_ids[-1] in sampling.stop_token_ids or len(output_ids) >= sampling.max_tokens:
                raise ValueError(f"its output ended ({len(output_ids)} tokens) before its replica stopped")
            sampling = replace(sampling, max_tokens=sampling.max_tokens - len(output_ids))
            constraint = replace(constraint, after=tuple(output_ids)) if constraint is not None else None
        # (a run again: its own engine request id, so nothing of the aborted first run's can meet it in an engine)
        self.gen = Generation(ctx, request_id=self.id if runs == 1 else f"{self.id}-run{runs}",
                              prompt_ids=prompt_ids + output_ids, sampling=replace(sampling, constraint=constraint),
                              priority=priority, caller=caller, cache_salt=req.cache_salt)
        replayed = self.gen.continue_after(output_ids) if output_ids else []
        self.created = created if created is not None else time.time()
        self.stored_here = ctx.store is not None and req.store is not False  # kept in the store
        self.own_items = stored_input_items(req) if self.stored_here or req.conversation is not None else []
        # a background run's writes carry this replica's runner token (background_store.py); it keeps its request
        # while unfinished, for another replica to run it again (a streamed one: to go on with it, which takes no
        # logprobs: the parser's and the assembler's logprobs in waiting are not kept)
        self.runner = ctx.background.runner if req.background and ctx.background is not None else None
        self.rerun = {"request": req.model_dump(mode="json", exclude_unset=True), "model": ctx.config.model_name,
                      "priority": priority, "caller": {"endpoint": caller.endpoint, "key": caller.key}, "runs": runs} \
            if req.background and (not req.stream or self.top_logprobs is None) else None
        # a streamed background run's events go to the store (background.EventRecorder), its stream reads them there
        self.recorder = EventRecorder(ctx.store, self.id, self.runner, self.gen.output_ids, len(output_ids)) \
            if req.background and req.stream else None
        self.background_assembler = self.new_assembler() if req.background else None
        # (a stream taken up has had its in_progress, unless its first run was given back still waiting for it)
        self.announce_progress = resume is None or all(ev["type"] != "response.in_progress" for ev in resume["events"])
        if resume is not None:
            self.background_assembler.resume(resume["events"], replayed)

    def stored(self, response: dict[str, Any]) -> StoredResponse:
        rerun = self.rerun if response["status"] in ("queued", "in_progress") else None
        return StoredResponse(response, self.own_items, self.req.previous_response_id, self.owner, rerun)

    async def keep(self, response: dict[str, Any]) -> None:
        """Store the response (and, finished, its turn in its conversation) before the client hears it finished, so
        a follow-up can name it. A background run's write that the store refuses (another replica runs the response
        now) changes nothing: its turn is not recorded either."""
        if not self.stored_here:
            if self.req.conversation is not None:
                await record_turn(self.ctx, self.req.conversation, self.own_items, response)
            return
        try:
            kept = await self.ctx.store.put(self.id, self.stored(response), self.runner)
        except Exception:  # the answer stands; only a later previous_response_id to it will fail
            log.exception("response %s: storing it failed", self.id)
            kept = True
        if self.req.conversation is not None and (kept or self.runner is None):
            await record_turn(self.ctx, self.req.conversation, self.own_items, response)

    def snapshot(self, status: str, output: list[dict[str, Any]], usage: dict | None = None,
                 error: dict | None = None) -> dict[str, Any]:
        req = self.req
        return {
            "id": self.id, "object": "response", "created_at": self.created, "model": self.ctx.config.model_name,
            "status": status, "output": output, "usage": usage, "error": error,
            "incomplete_details": {"reason": "max_output_tokens"} if status == "incomplete" else None,
            "instructions": req.instructions, "metadata": req.metadata, "user": req.user,
            "tools": [{"type": "function", "name": t.name, "description": t.description,
                       "parameters": t.parameters, "strict": t.strict} for t in req.tools or []],
            "tool_choice": req.tool_choice or "auto", "parallel_tool_calls": req.parallel_tool_calls is not False,
            "temperature": req.temperature, "top_p": req.top_p, "max_output_tokens": req.max_output_tokens,
            "reasoning": {"effort": (req.reasoning.effort if req.reasoning else None) or "medium", "summary": None},
            "text": {"format": self.text_format or {"type": "text"},
                     "verbosity": (req.text.verbosity if req.text else None) or "medium"},
            "truncation": req.truncation or "disabled", "store": self.stored_here, "top_logprobs": req.top_logprobs,
            "max_tool_calls": req.max_tool_calls, "prompt_cache_key": req.prompt_cache_key,
            "prompt_cache_retention": req.prompt_cache_retention, "safety_identifier": req.safety_identifier,
            "service_tier": "default",  # the tier it ran in: this server has one, whatever the request asked
            "completed_at": time.time() if status == "completed" else None,
            "previous_response_id": req.previous_response_id, "background": bool(req.background),
            "conversation": {"id": req.conversation} if req.conversation is not None else None,
        }

    def new_assembler(self) -> ResponsesAssembler:
        return ResponsesAssembler(encrypted_reasoning="reasoning.encrypted_content" in (self.req.include or []),
                                  logprobs_top=self.top_logprobs, encoding=self.ctx.encoding)

    def final_status(self) -> str:
        return "incomplete" if self.gen.finish_reason == "length" else "completed"

    async def frames(self, gen: Generation, assembler: ResponsesAssembler) -> AsyncIterator[list[dict[str, Any]]]:
        async for step in gen.steps():
            # Items closed by the last step were cut short when the response hit max_output_tokens.
            yield assembler.step(step, self.final_status())

    async def body(self, gen: Generation) -> dict:
        assembler = self.new_assembler()
        async for _ in self.frames(gen, assembler):
            pass
        done = self.snapshot(self.final_status(), assembler.output, usage_json(gen))
        await self.keep(done)
        return done

    async def stream(self, gen: Generation) -> AsyncIterator[bytes]:
        assembler = self.new_assembler()
        try:
            yield _frame(assembler.event("response.created", response=self.snapshot("in_progress", [])))
            yield _frame(assembler.event("response.in_progress", response=self.snapshot("in_progress", [])))
            async for batch in self.frames(gen, assembler):
                for frame in batch:
                    yield _frame(frame)
            status = self.final_status()
            done = self.snapshot(status, assembler.output, usage_json(gen))
            await self.keep(done)
            yield _frame(assembler.event(f"response.{status}", response=done))
        except APIError as err:  # mid-stream failure: OpenAI's `error` event
            yield _frame(assembler.event("error", code=err.code, message=err.message, param=err.param))
        finally:
            await gen.close()

    async def answer(self, http: Request) -> Response:
        """A foreground response: the JSON body, or the event stream."""
        return await respond(http, self.gen, response_id=self.id, stream=self.req.stream, make_stream=self.stream,
                             make_body=self.body, keepalive_s=self.ctx.config.stream_keepalive_s)

    async def start_background(self, http: Request) -> Response:
        """Store the response `queued` and start its run here; answer the `queued` response (with `stream`, the
        event stream the run records, from the store)."""
        queued = self.snapshot("queued", [])
        await ask_store(self.ctx.store.put(self.id, self.stored(queued), self.runner))
        headers = request_id_headers(http, self.id)
        if self.recorder is None:
            self.ctx.background.start(self.id, self.run_in_background)
            return JSONResponse(queued, headers=headers)
        await ask_store(self.ctx.store.append_events(self.id, [
            self.background_assembler.event("response.created", response=queued),
            self.background_assembler.event("response.queued", response=queued)], self.runner,
            prompt_ids=self.prompt_ids))
        self.ctx.background.start(self.id, self.run_in_background)
        return EventStreamResponse(follow_events(self.ctx.store, self.id, -1), headers=headers,
                                   keepalive_s=self.ctx.config.stream_keepalive_s)

    async def run_in_background(self) -> None:
        """The background run (background.py): its states go to the store, the last one whatever happens, once
        its engine request has ended (so a cancel's answer means the engine holds nothing of it); streamed, its
        events too, the last ones before the final state. Stopped because this replica stops: a response that can
        run again is given back for another replica (background_store.py) and nothing more is stored here."""
        gen, assembler, recorder = self.gen, self.background_assembler, self.recorder
        final = None
        try:
            await gen.start()
            in_progress = self.snapshot("in_progress", [])
            await self.keep(in_progress)
            if recorder is not None and self.announce_progress:
                await recorder.add([assembler.event("response.in_progress", response=in_progress)])
            async for batch in self.frames(gen, assembler):
                if recorder is not None:
                    await recorder.add(batch)
            final = self.snapshot(self.final_status(), assembler.output, usage_json(gen))
        except asyncio.CancelledError:  # POST .../cancel (or DELETE): what was generated so far stays
            if self.ctx.background.stopping:  # not the client's doing: the replica stops (BackgroundRuns.stop)
                await gen.close()  # (before the give-back: the engine holds nothing of it when another replica runs it)
                if self.rerun is not None:
                    if recorder is not None:  # its events so far, and their tokens: where the next run goes on
                        await recorder.close()
                    if await self.ctx.background.give_back(self.id):
                        return
                final = self.snapshot("failed", assembler.output, usage_json(gen), error={
                    "code": "server_error", "message": "The server replica running this background response "
                    "stopped before it finished (server_shutdown); create it again."})
            else:
                final = self.snapshot("cancelled", assembler.output, usage_json(gen))
        except Exception as err:  # a refusal or an engine failure: the response failed, with OpenAI's error
            final = self.failed(err, assembler.output)
        finally:
            await gen.close()
            if final is not None:
                if recorder is not None:
                    if final["status"] != "cancelled":  # OpenAI's stream has no event for a cancelled response
                        await recorder.add([assembler.event(f"response.{final['status']}", response=final)])
                    await recorder.close()
                await self.keep(final)

    def failed(self, err: Exception, output: list[dict[str, Any]]) -> dict[str, Any]:
        """The `failed` response for a refusal or an engine failure, with OpenAI's error."""
        if not isinstance(err, APIError):
            log.exception("background response %s failed", self.id, exc_info=err)
        return self.snapshot("failed", output, usage_json(self.gen), error=response_error(err))


def response_error(err: Exception, preface: str = "") -> dict[str, str]:
    """A failed response's `error` for `err`. OpenAI's codes there are a closed set: a refusal (400) is
    invalid_prompt, anything else server_error; ours go into the message."""
    api = err if isinstance(err, APIError) else EngineFailure(f"{type(err).__name__}: {err}")
    detail = f" ({api.code})" if api.code else ""
    return {"code": "invalid_prompt" if isinstance(api, BadRequest) else "server_error",
            "message": preface + api.message + detail}


def _frame(event: dict[str, Any]) -> bytes:
    return sse(event, event=event["type"])
