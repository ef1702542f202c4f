"""POST /v1/chat/completions over Harmony.

Request -> Prompt: "system"/"developer" messages are the developer instructions; an assistant message
contributes its `reasoning_content` (or `reasoning`), its text and its tool calls, in that order; a
`tool` message is matched to its call by `tool_call_id` (or by `name` when the id is unknown).

Output: `reasoning_content` from analysis, `content` from final (and commentary preambles), one
entry of `tool_calls` per `functions.NAME` message on any channel. Separate Harmony messages of the
same kind are joined by a blank line. Streaming sends the role first, then reasoning_content /
content / tool_call deltas, a finish chunk, an optional usage chunk (`stream_options.include_usage`)
and `[DONE]`. Stop strings cut the final answer only (the reasoning is not user output). Logprobs
cover the tokens of the answer text, not reasoning or tool-call tokens. `n` > 1: n engine requests of
the same prompt (GenerationGroup), choice i seeded with seed + i when a seed is given; streamed, the
choices' chunks interleave as they come (`interleave`), each carrying its index.
"""

from __future__ import annotations

import asyncio
import time
import uuid
from dataclasses import replace
from typing import Any, AsyncIterator

from starlette.requests import Request
from starlette.responses import Response

from serve_app.harmony.parse import ItemDelta, ItemKind, ItemStarted, ParseEvent
from serve_app.harmony.render import (
    AssistantReasoning,
    AssistantText,
    AssistantToolCall,
    FunctionTool,
    HistoryItem,
    Prompt,
    ToolResult,
    UserMessage,
    prompt_chars,
    render_prompt,
)
from serve_app.openai_api.auth import in_batch, requester
from serve_app.openai_api.errors import APIError, BadRequest
from serve_app.openai_api.generation import (
    Generation,
    GenerationGroup,
    IngressConfig,
    IngressContext,
    SamplingRequest,
    respond,
    sampling_params,
)
from serve_app.openai_api.output_options import (forced_tools, logprobs_json, offers,
                                                 output_constraint_off_loop, prediction_ids)
from serve_app.openai_api.protocol import ChatCompletionRequest, text_of
from serve_app.openai_api.stored_chat import keep, store_for
from serve_app.openai_api.streaming import interleave, sse
from serve_app.openai_api.usage import caller_of

SEPARATOR = "\n\n"  # between two Harmony messages that land in the same field


def chat_prompt(req: ChatCompletionRequest, config: IngressConfig) -> Prompt:
    instructions: list[str] = []
    history: list[HistoryItem] = []
    call_names: dict[str, str] = {}
    for i, msg in enumerate(req.messages):
        text = text_of(msg.content)
        if msg.role in ("system", "developer"):
            instructions.append(text)
        elif msg.role == "user":
            history.append(UserMessage(text))
        elif msg.role == "assistant":
            reasoning = msg.reasoning_content or msg.reasoning
            if reasoning:
                history.append(AssistantReasoning(reasoning))
            if text:
                history.append(AssistantText(text))
            for call in msg.tool_calls or []:
                call_names[call.id] = call.function.name
                history.append(AssistantToolCall(call.function.name, call.function.arguments))
        else:
            name = call_names.get(msg.tool_call_id or "") or msg.name
            if not name:
                raise BadRequest(
                    f"messages[{i}] is a tool result with tool_call_id {msg.tool_call_id!r}, which matches no "
                    "earlier assistant tool call; include the assistant message with that call first.",
                    param=f"messages.{i}.tool_call_id")
            history.append(ToolResult(name, text))
    tools = [FunctionTool(t.function.name, t.function.description or "", t.function.parameters)
             for t in req.tools or [] if offers(req.tool_choice, t.function.name)]
    return Prompt(
        history=history,
        instructions=SEPARATOR.join(s for s in instructions if s) or None,
        tools=tools,
        reasoning_effort=req.reasoning_effort or "medium",
        conversation_start_date=config.start_date(),
        knowledge_cutoff=config.knowledge_cutoff,
    )


class ChatAssembler:
    """Item events -> chat deltas, accumulating the whole message (stream and non-stream agree)."""

    def __init__(self) -> None:
        self.reasoning: list[str] = []
        self.content: list[str] = []
        self.tool_calls: list[dict[str, Any]] = []
        self._call_of_item: dict[int, int] = {}

    def apply(self, event: ParseEvent) -> dict[str, Any] | None:
        if event.kind is ItemKind.TOOL_CALL:
            return self._tool_call(event)
        field, parts = ("reasoning_content", self.reasoning) if event.kind is ItemKind.REASONING \
            else ("content", self.content)
        if isinstance(event, ItemStarted) and parts:
            parts.append(SEPARATOR)
            return {field: SEPARATOR}
        if isinstance(event, ItemDelta):
            parts.append(event.text)
            return {field: event.text}
        return None

    def _tool_call(self, event: ParseEvent) -> dict[str, Any] | None:
        if isinstance(event, ItemStarted):
            self._call_of_item[event.index] = len(self.tool_calls)
            call = {"id": f"call_{uuid.uuid4().hex[:24]}", "type": "function",
                    "function": {"name": event.tool_name, "arguments": ""}}
            self.tool_calls.append(call)
            return {"tool_calls": [{"index": len(self.tool_calls) - 1, **call,
                                    "function": dict(call["function"])}]}
        if isinstance(event, ItemDelta):
            n = self._call_of_item[event.index]
            self.tool_calls[n]["function"]["arguments"] += event.text
            return {"tool_calls": [{"index": n, "function": {"arguments": event.text}}]}
        return None

    def message(self) -> dict[str, Any]:
        return {
            "role": "assistant",
            "content": "".join(self.content) if self.content else None,
            "reasoning_content": "".join(self.reasoning) if self.reasoning else None,
            "tool_calls": self.tool_calls or None,
        }


def usage_json(gen: Generation | GenerationGroup) -> dict[str, Any]:
    u = gen.usage()
    return {"prompt_tokens": u["prompt_tokens"], "completion_tokens": u["completion_tokens"],
            "total_tokens": u["total_tokens"],
            "completion_tokens_details": {key: u[key] for key in ("reasoning_tokens", "accepted_prediction_tokens",
                                                                  "rejected_prediction_tokens")},
            "prompt_tokens_details": {"cached_tokens": u["cached_tokens"]}}


def chat_tokens(prompt: Prompt, prediction: str | None) -> tuple[list[int], tuple[int, ...]]:
    """(prompt ids, the prediction's draft ids): the tokenizing of a chat request, which RenderWorkers runs
    off the event loop for long ones."""
    return render_prompt(prompt), prediction_ids(prediction)


async def create_chat_completion(req: ChatCompletionRequest, http: Request, ctx: IngressContext) -> Response:
    if req.top_logprobs and not req.logprobs:
        raise BadRequest("top_logprobs needs logprobs=true", param="top_logprobs")
    store = store_for(req, ctx)  # `store: true`: where the finished completion goes (stored_chat.py)
    forced = forced_tools(req.tool_choice, [t.function.name for t in req.tools or []])
    offered = [t for t in req.tools or [] if offers(req.tool_choice, t.function.name)]
    constraint, response_format = await output_constraint_off_loop(
        req.response_format, "response_format",
        [(t.function.name, t.function.parameters, f"tools.{i}.function.parameters")
         for i, t in enumerate(offered) if t.function.strict],
        forced, ctx.config.forced_reasoning_budget(req.max_completion_tokens or req.max_tokens))
    prompt = replace(chat_prompt(req, ctx.config), response_format=response_format)
    prediction = text_of(req.prediction.content) if req.prediction else None
    prompt_ids, draft_ids = await ctx.renderer.run(prompt_chars(prompt) + len(prediction or ""),
                                                   chat_tokens, prompt, prediction)
    max_tokens, param = (req.max_completion_tokens, "max_completion_tokens") if req.max_completion_tokens \
        else (req.max_tokens, "max_tokens")
    sampling = sampling_params(SamplingRequest(
        max_tokens=max_tokens, max_tokens_param=param, temperature=req.temperature, top_p=req.top_p,
        top_k=req.top_k, min_p=req.min_p, seed=req.seed,
        logprobs=(req.top_logprobs or 0) if req.logprobs else None,
        presence_penalty=req.presence_penalty, frequency_penalty=req.frequency_penalty, logit_bias=req.logit_bias,
    ), len(prompt_ids), ctx.config)
    sampling = replace(sampling, ignore_eos=req.ignore_eos, constraint=constraint,
                       prediction=draft_ids)
    n = req.n or 1
    priority = ctx.config.request_priority(req.priority, in_batch(http))
    request_id = f"chatcmpl-{uuid.uuid4().hex}"

    def nth(i: int) -> Generation:
        # Choice i of a seeded request draws from seed + i: reproducible, and the choices differ.
        params = sampling if i == 0 or sampling.seed is None else replace(sampling, seed=(sampling.seed + i) % 2**64)
        return Generation(ctx, request_id=request_id if n == 1 else f"{request_id}-{i}", prompt_ids=prompt_ids,
                          sampling=params, stop=req.stop, priority=priority,
                          caller=caller_of("chat.completions", http), cache_salt=req.cache_salt)

    group = GenerationGroup([nth(i) for i in range(n)])
    # service_tier: the tier it ran in (this server has one, whatever the request asked), as OpenAI reports it;
    # system_fingerprint: the backend configuration (engine/fingerprint.py)
    head = {"id": request_id, "created": int(time.time()), "model": ctx.config.model_name, "service_tier": "default",
            "system_fingerprint": ctx.config.system_fingerprint}
    top = req.top_logprobs or 0

    def finished(index: int, gen: Generation, assembler: ChatAssembler, logprobs: list) -> dict:
        return {"index": index, "message": assembler.message(), "finish_reason": gen.finish_reason,
                "logprobs": {"content": logprobs_json(logprobs, top, ctx.encoding)} if req.logprobs else None}

    async def choice(index: int, gen: Generation) -> dict:
        assembler, logprobs = ChatAssembler(), []
        async for step in gen.steps():
            for event in step.events:
                assembler.apply(event)
            logprobs += step.content_logprobs
        return finished(index, gen, assembler, logprobs)

    def completion(choices: list[dict], group: GenerationGroup) -> dict:
        return {**head, "object": "chat.completion", "choices": choices, "usage": usage_json(group)}

    async def body(group: GenerationGroup) -> dict:
        out = completion(list(await asyncio.gather(*(choice(i, g) for i, g in enumerate(group.gens)))), group)
        if store is not None:
            await keep(store, out, req, requester(http))
        return out

    include_usage = bool(req.stream_options and req.stream_options.include_usage)
    extra = {"usage": None} if include_usage else {}

    def chunk(index: int, delta: dict, finish: str | None = None, logprobs: list | None = None) -> bytes:
        out = {"index": index, "delta": delta, "logprobs": None, "finish_reason": finish}
        if logprobs is not None:
            out["logprobs"] = {"content": logprobs_json(logprobs, top, ctx.encoding)}
        return sse({**head, "object": "chat.completion.chunk", "choices": [out], **extra})

    finals: dict[int, dict] = {}  # streamed choices as they end (for `store`)

    async def choice_chunks(index: int, gen: Generation) -> AsyncIterator[bytes]:
        yield chunk(index, {"role": "assistant", "content": ""})
        assembler, pending_logprobs, all_logprobs = ChatAssembler(), [], []
        async for step in gen.steps():
            pending_logprobs += step.content_logprobs
            all_logprobs += step.content_logprobs if store is not None else []
            for delta in _merged(assembler.apply(e) for e in step.events):
                with_logprobs = req.logprobs and "content" in delta
                yield chunk(index, delta, logprobs=pending_logprobs if with_logprobs else None)
                pending_logprobs = [] if with_logprobs else pending_logprobs
        if store is not None:
            finals[index] = finished(index, gen, assembler, all_logprobs)
        yield chunk(index, {}, gen.finish_reason, pending_logprobs if req.logprobs and pending_logprobs else None)

    async def stream(group: GenerationGroup) -> AsyncIterator[bytes]:
        try:
            async for data in interleave([choice_chunks(i, g) for i, g in enumerate(group.gens)]):
                yield data
            if store is not None:  # every choice ended: the object a non-streamed request would have got
                await keep(store, completion([finals[i] for i in range(n)], group), req, requester(http))
            if include_usage:
                yield sse({**head, "object": "chat.completion.chunk", "choices": [], "usage": usage_json(group)})
            yield sse("[DONE]")
        except APIError as err:  # mid-stream failure: the openai client raises it as an APIError
            yield sse(err.body())
        finally:
            await group.close()

    return await respond(http, group, response_id=request_id, stream=req.stream, make_stream=stream, make_body=body,
                         keepalive_s=ctx.config.stream_keepalive_s)


def _merged(deltas: Any) -> list[dict[str, Any]]:
    """Join consecutive text deltas of the same field, so one backend step is one chunk per field."""
    out: list[dict[str, Any]] = []
    for delta in deltas:
        if delta is None:
            continue
        if out and "tool_calls" not in delta and out[-1].keys() == delta.keys() and "tool_calls" not in out[-1]:
            key = next(iter(delta))
            out[-1] = {key: out[-1][key] + delta[key]}
        else:
            out.append(delta)
    return out
