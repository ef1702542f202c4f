"""One backend request seen from the API: limits, sampling, parsed Harmony items, stop strings, usage.

Both front ends (chat.py, responses.py) drive a `Generation`: `start()` sends the request and waits for
the first delta, so a request the engine refuses (InvalidRequestError) still becomes a plain HTTP 400
before any streaming starts (a stream waits for it only ingress.stream_keepalive_s: see respond());
`steps()` yields parsed item events per backend delta; `close()` always runs (finally) and aborts the
backend request unless it finished on its own, whether the client disconnected, a stop string matched or
something failed.
"""

from __future__ import annotations

import asyncio
import logging
from dataclasses import dataclass, field
from datetime import datetime, timezone
from typing import Any, AsyncIterator, Awaitable, Callable

import anyio
from openai_harmony import HarmonyEncoding
from starlette.requests import Request
from starlette.responses import JSONResponse, Response

from engine.request import (
    FINISH_ABORT,
    FINISH_LENGTH,
    BackendOverloaded,
    EngineUnhealthyError,
    GenerateRequest,
    InvalidRequestError,
    SamplingParams,
    TokenBackend,
    TokenDelta,
    TokenLogprob,
)
from serve_app.harmony.parse import HarmonyOutputParser, ItemDelta, ItemDone, ItemKind, ItemStarted, ParseEvent
from serve_app.harmony.render import DEFAULT_KNOWLEDGE_CUTOFF, prompt_cache_cuts
from serve_app.harmony.render_worker import RenderWorkers
from serve_app.openai_api.errors import BadRequest, ContextLengthExceeded, EngineFailure, ServerOverloaded
from serve_app.openai_api.background import BackgroundRuns
from serve_app.openai_api.stop_strings import StopMatcher
from serve_app.openai_api.stored_responses import ResponseStore
from serve_app.openai_api.streaming import EventStreamResponse, run_unless_disconnected
from serve_app.openai_api.usage import Caller, UsageRecord, UsageSink, report

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class IngressConfig:
    model_name: str
    max_context: int  # prompt + completion tokens
    default_max_tokens: int | None = None  # when the request names none: the rest of the context, capped
    conversation_start_date: str | None = None  # None: today's UTC date at each request
    knowledge_cutoff: str = DEFAULT_KNOWLEDGE_CUTOFF
    max_body_bytes: int = 8 * 1024 * 1024
    stream_keepalive_s: float | None = 15.0  # respond(): a waiting stream starts and sends keep-alives; None: off
    allow_priority: bool = False  # honour requests' `priority` (else a non-zero one is a 400): request_priority
    isolate_prefix_cache: bool = False  # each API key its own prefix-cache namespace: cache_salt
    forced_call_reasoning_tokens: int = 2048  # a forced tool call's reasoning before it (forced_call_grammar)
    system_fingerprint: str | None = None  # the backend's configuration (engine/fingerprint.py); None: unknown
    batch_priority: int = 1  # added to the priority of a /v1/batches request (batch_runs.py)

    def request_priority(self, priority: int | None, batch: bool = False) -> int:
        """A request's engine priority (lower runs sooner, engine/scheduler.py); a batch's requests (`batch`) come
        `batch_priority` after the others. A request's own priority is off by default: any client could otherwise
        put itself ahead of everyone."""
        if priority and not self.allow_priority:
            raise BadRequest("priority is not enabled on this server (ingress.allow_priority); leave it out or "
                             "send 0", param="priority")
        return (priority or 0) + (self.batch_priority if batch else 0)

    def forced_reasoning_budget(self, max_tokens: int | None) -> int:
        """Tokens each message before a forced tool call may take (forced_call_grammar): the configured budget, and
        at most a quarter of the request's output limit (its own, else default_max_tokens), so that the analysis
        and the preamble together leave half of it to the call."""
        limit = max_tokens or self.default_max_tokens
        return min(self.forced_call_reasoning_tokens, limit // 4) if limit else self.forced_call_reasoning_tokens

    def cache_salt(self, key: str | None, client_salt: str | None) -> str:
        """The engine request's prefix-cache namespace (GenerateRequest.cache_salt): the API key's when
        isolate_prefix_cache is on (and keys are configured), then the request's own `cache_salt`; "" shares."""
        parts = ([f"key:{key}"] if self.isolate_prefix_cache and key else []) + \
            ([f"client:{client_salt}"] if client_salt else [])
        return "\0".join(parts)

    def start_date(self) -> str:
        return self.conversation_start_date or datetime.now(timezone.utc).date().isoformat()


@dataclass(frozen=True)
class IngressContext:
    backend: TokenBackend
    config: IngressConfig
    encoding: HarmonyEncoding
    renderer: RenderWorkers  # tokenizes long prompts off the event loop
    store: ResponseStore | None = None  # stored /v1/responses; None: the endpoint is stateless
    background: BackgroundRuns | None = None  # background /v1/responses this replica runs (with a store)
    usage_sink: UsageSink | None = None  # told each engine request's usage when it ends (usage.py)


@dataclass
class SamplingRequest:
    """The sampling fields both APIs share, before limits are applied."""

    max_tokens: int | None = None
    max_tokens_param: str = "max_tokens"
    temperature: float | None = None
    top_p: float | None = None
    top_k: int | None = None
    min_p: float | None = None
    seed: int | None = None
    logprobs: int | None = None
    presence_penalty: float | None = None
    frequency_penalty: float | None = None
    logit_bias: dict[str, float] | None = None


def sampling_params(req: SamplingRequest, prompt_len: int, config: IngressConfig,
                    context_param: str = "messages") -> SamplingParams:
    """Engine sampling parameters; prompts that leave no room for the completion are a 400 (naming
    `context_param`)."""
    if prompt_len >= config.max_context:
        raise ContextLengthExceeded(
            f"The prompt is {prompt_len} tokens but the context is {config.max_context} tokens; "
            "shorten the conversation.", param=context_param)
    room = config.max_context - prompt_len
    if req.max_tokens is not None and req.max_tokens > room:
        raise ContextLengthExceeded(
            f"The prompt is {prompt_len} tokens; with {req.max_tokens} more the request exceeds the "
            f"{config.max_context}-token context. Set {req.max_tokens_param} to at most {room}.",
            param=req.max_tokens_param)
    max_tokens = req.max_tokens or min(room, config.default_max_tokens or room)
    params = SamplingParams(
        temperature=1.0 if req.temperature is None else req.temperature,
        top_p=1.0 if req.top_p is None else req.top_p,
        top_k=req.top_k or 0,
        min_p=req.min_p or 0.0,
        seed=req.seed,
        max_tokens=max_tokens,
        logprobs=req.logprobs,
        presence_penalty=req.presence_penalty or 0.0,
        frequency_penalty=req.frequency_penalty or 0.0,
        logit_bias=tuple(sorted((int(k), float(v)) for k, v in (req.logit_bias or {}).items())),
    )
    params.validate()
    return params


@dataclass
class Step:
    events: list[ParseEvent]
    content_logprobs: list[TokenLogprob] = field(default_factory=list)
    content_logprob_items: list[int] = field(default_factory=list)  # the item (ParseEvent.index) of each above

    def add_logprobs(self, logprobs: list[TokenLogprob], item: int | None) -> None:
        self.content_logprobs += logprobs
        self.content_logprob_items += [-1 if item is None else item] * len(logprobs)


class BackendRequest:
    """One engine request as the ingress drives it: `start()` sends it and waits for the first delta (so a
    request the engine refuses is a plain 400 before any streaming), `_next_delta()` reads on, `close()`
    aborts it unless it finished on its own. Subclasses turn deltas into what their API returns.

    The first delta is read in a task of its own (`start_soon`), which every `start()` awaits and `close()`
    cancels: respond() may stop waiting for it (a stream then starts, with keep-alive comments) and the
    stream's `steps()` picks the wait up again, so a refusal after that arrives as an in-stream error."""

    def __init__(self, ctx: IngressContext, *, request_id: str, prompt_ids: list[int], sampling: SamplingParams,
                 priority: int = 0, caller: Caller | None = None, cache_salt: str | None = None):
        """caller: the endpoint and API key its usage record names (usage.py); cache_salt: the request's own
        (IngressConfig.cache_salt adds the key's)."""
        self.ctx = ctx
        self.caller = caller or Caller("")
        self._failure: str | None = None  # "refused" / "failed", for the usage record
        self.request_id = request_id
        self.prompt_tokens = len(prompt_ids)
        self.completion_tokens = 0
        self.cached_tokens = 0  # prompt tokens the engine took from its prefix cache
        self.draft_tokens = self.accepted_draft_tokens = 0  # speculative decoding (a prediction), totals so far
        self.finish_reason: str | None = None  # the API's finish reason, once finished
        prompt_ids = list(prompt_ids)
        self._request = GenerateRequest(request_id, prompt_ids, sampling, priority,
                                        ctx.config.cache_salt(self.caller.key, cache_salt),
                                        cache_cuts=prompt_cache_cuts(prompt_ids, ctx.encoding))
        self._backend_finish: str | None = None
        self._stream: Any = None
        self._first: TokenDelta | None = None
        self._starting: asyncio.Task | None = None  # sends the request and reads its first delta
        self._backend_done = False
        self._closed = False
        self._stopped_by_string = False  # a stop string matched: read no further deltas

    def start_soon(self) -> list[asyncio.Task]:
        """Send the request (once) in a task that reads its first delta; that task, in a list as
        GenerationGroup.start_soon returns its members'."""
        if self._starting is None:
            self._starting = asyncio.ensure_future(self._send())
        return [self._starting]

    async def start(self) -> None:
        """Send the request (once) and wait for its first delta; a refusal (BadRequest, ServerOverloaded)
        surfaces here. A caller that is cancelled leaves the task running for the next caller (close() ends it)."""
        await asyncio.shield(self.start_soon()[0])

    async def _send(self) -> None:
        self._stream = self.ctx.backend.generate(self._request).__aiter__()
        self._first = await self._next_delta()

    def refusal(self, err: InvalidRequestError) -> BadRequest:
        """The engine's refusal as this API's 400 (subclasses rename the engine's field names as their API's)."""
        return BadRequest(str(err), param=err.param)

    async def close(self) -> None:
        """Abort the backend request unless it ran to its end; safe to call more than once."""
        if self._closed:
            return
        self._closed = True
        with anyio.CancelScope(shield=True):  # runs even while the request is being cancelled
            if self._starting is not None:
                self._starting.cancel()  # a no-op once it finished; its outcome was taken by start() or ends here
                await asyncio.gather(self._starting, return_exceptions=True)
            if not self._backend_done and self._stream is not None:
                try:
                    await self.ctx.backend.abort(self.request_id)
                except Exception:  # the request is gone either way; never mask the original outcome
                    log.exception("request %s: backend abort failed", self.request_id)
            aclose = getattr(self._stream, "aclose", None)
            if aclose is not None:
                try:
                    await aclose()
                except Exception:  # aborted above already: the close only releases the stream's own resources
                    log.exception("request %s: closing the backend stream failed", self.request_id)
        report(self.ctx.usage_sink, UsageRecord(
            model=self.ctx.config.model_name, endpoint=self.caller.endpoint, key=self.caller.key,
            outcome=self._outcome(), prompt_tokens=self.prompt_tokens, cached_tokens=self.cached_tokens,
            completion_tokens=self.completion_tokens))

    def _outcome(self) -> str:
        """How it ended, for its usage record (usage.UsageRecord.outcome)."""
        if self._failure is not None:
            return self._failure
        if self.finish_reason is not None:
            return self.finish_reason
        if self._backend_done and self._backend_finish not in (None, FINISH_ABORT):
            return self._backend_finish
        return "cancelled"

    async def _next_delta(self) -> TokenDelta | None:
        try:
            delta = await self._stream.__anext__()
        except StopAsyncIteration:
            self._backend_done = True
            return None
        except InvalidRequestError as err:
            self._backend_done, self._failure = True, "refused"
            raise self.refusal(err) from None
        except BackendOverloaded as err:  # refused before it ran: a 503 with Retry-After, logged as load, not a fault
            self._backend_done, self._failure = True, "refused"
            log.info("request %s: refused, backend overloaded (%s)", self.request_id, err)
            raise ServerOverloaded(f"The server is overloaded ({err}); retry shortly.") from None
        except EngineUnhealthyError as err:  # refused before it ran by an engine about to be replaced: retry
            self._backend_done, self._failure = True, "refused"
            log.warning("request %s: refused, engine unhealthy (%s)", self.request_id, err)
            raise ServerOverloaded(f"The engine that took this request cannot serve ({err}); retry shortly.",
                                   code="engine_unavailable") from None
        except Exception as err:  # engine/transport failure: the client gets a 503, not a traceback
            self._backend_done, self._failure = True, "failed"
            log.exception("request %s: backend failed", self.request_id)
            raise EngineFailure(f"The engine failed while generating ({type(err).__name__}: {err}); retry.") from err
        if delta.finish_reason is not None:
            self._backend_done = True
            self._backend_finish = delta.finish_reason
        # (a continuation's engine prompt holds the output so far too: `continue_after`)
        self.cached_tokens = max(self.cached_tokens, min(delta.num_cached_tokens, self.prompt_tokens))
        self.draft_tokens = max(self.draft_tokens, delta.num_draft_tokens)
        self.accepted_draft_tokens = max(self.accepted_draft_tokens, delta.num_accepted_draft_tokens)
        return delta

    async def _deltas(self) -> AsyncIterator[TokenDelta]:
        """The backend's deltas (the one start() read first, then on) until the request ends or a stop
        string matched."""
        await self.start()  # at once when respond() saw the first delta; else the stream waits for it here
        delta, self._first = self._first, None
        while delta is not None and not self._stopped_by_string:
            yield delta
            delta = None if self._backend_done else await self._next_delta()

    def _check_not_aborted(self) -> None:
        if self._backend_finish == FINISH_ABORT:
            raise EngineFailure("The engine aborted the request (it may be shutting down); retry.")

    def usage(self) -> dict[str, int]:
        return {"prompt_tokens": self.prompt_tokens, "completion_tokens": self.completion_tokens,
                "total_tokens": self.prompt_tokens + self.completion_tokens,
                "reasoning_tokens": 0, "cached_tokens": self.cached_tokens,
                "accepted_prediction_tokens": self.accepted_draft_tokens,
                "rejected_prediction_tokens": self.draft_tokens - self.accepted_draft_tokens}


class Generation(BackendRequest):
    def __init__(self, ctx: IngressContext, *, request_id: str, prompt_ids: list[int],
                 sampling: SamplingParams, stop: list[str] | None = None,
                 priority: int = 0, caller: Caller | None = None, cache_salt: str | None = None):
        super().__init__(ctx, request_id=request_id, prompt_ids=list(prompt_ids),
                         sampling=sampling, priority=priority, caller=caller, cache_salt=cache_salt)
        self.reasoning_tokens = 0
        self._parser = HarmonyOutputParser(ctx.encoding, request_id=request_id)
        self._stops = list(stop or [])
        self._matcher: StopMatcher | None = None
        self._content_parts: list[str] = []
        self._content_channel: str | None = None
        self._saw_tool_call = False
        # (token id, logprob) of the tokens fed since the last one that went into an item: header and
        # control tokens, whose text may still be recovered as content (HarmonyOutputParser.take_recovered)
        self._unplaced: list[tuple[int, TokenLogprob | None]] = []
        self.output_ids: list[int] = []  # the output tokens consumed so far (a stream's resume point: background.py)

    def continue_after(self, output_ids: list[int]) -> list[ParseEvent]:
        """Make this generation the continuation of one that had produced `output_ids` (its engine request's prompt
        ends with them: the caller built it so): they are fed to the parser as output, as they were then, and
        usage counts them as output, not prompt. Their item events, as the first run saw them."""
        if self._starting is not None or self.completion_tokens or len(output_ids) >= self.prompt_tokens:
            raise ValueError("continue_after: a fresh generation whose prompt ends with the output is needed")
        self.prompt_tokens -= len(output_ids)
        return self._consume(TokenDelta(self.request_id, list(output_ids))).events

    async def steps(self) -> AsyncIterator[Step]:
        """Item events per backend delta; the last step closes open items and sets finish_reason."""
        async for delta in self._deltas():
            step = self._consume(delta)
            if step.events or step.content_logprobs:
                yield step
        events = self._finish()
        last = Step(events)
        last.add_logprobs(self._recovered_logprobs(), self._parser.current_index)
        yield last

    # -- internals ----------------------------------------------------------------------------------

    def _consume(self, delta: TokenDelta) -> Step:
        step = Step([])
        logprobs = delta.logprobs or []
        for i, token_id in enumerate(delta.token_ids):
            self.completion_tokens += 1
            self.output_ids.append(token_id)
            for event in self._parser.feed(token_id):
                self._apply_stop(event, step.events)
            step.add_logprobs(self._recovered_logprobs(), self._parser.current_index)
            kind = self._parser.last_token_kind
            lp = logprobs[i] if i < len(logprobs) else None
            if kind is None:
                self._unplaced.append((token_id, lp))
            else:
                self._unplaced.clear()
            if kind is ItemKind.REASONING:
                self.reasoning_tokens += 1
            elif kind is ItemKind.CONTENT and lp is not None:
                step.add_logprobs([lp], self._parser.current_index)
            if self._stopped_by_string:
                break
        return step

    def _recovered_logprobs(self) -> list[TokenLogprob]:
        """Logprobs of header tokens the parser just recovered as content: the newest unplaced tokens."""
        recovered = self._parser.take_recovered()
        if not recovered:
            return []
        text_tokens = [(t, lp) for t, lp in self._unplaced if not self.ctx.encoding.is_special_token(t)]
        matched = text_tokens[-len(recovered):]
        self._unplaced.clear()
        if [t for t, _ in matched] != recovered:  # cannot happen if both sides count the same tokens
            log.warning("request %s: recovered header tokens do not match the buffered ones", self.request_id)
            return []
        return [lp for _, lp in matched if lp is not None]

    def _apply_stop(self, event: ParseEvent, out: list[ParseEvent]) -> None:
        """Pass events through, cutting content at the first stop string (OpenAI leaves it out)."""
        if self._stopped_by_string:
            return
        if event.kind is ItemKind.TOOL_CALL and isinstance(event, ItemStarted):
            self._saw_tool_call = True
        if event.kind is not ItemKind.CONTENT or not self._stops:
            out.append(event)
            return
        if isinstance(event, ItemStarted):
            self._matcher, self._content_parts = StopMatcher(self._stops), []
            self._content_channel = event.channel
            out.append(event)
        elif isinstance(event, ItemDelta):
            text, hit = self._matcher.push(event.text)
            self._emit_content(event, text, out)
            if hit:
                self._stopped_by_string = True
                out.append(ItemDone(event.index, event.kind, "".join(self._content_parts), self._content_channel))
        elif isinstance(event, ItemDone):
            self._emit_content(event, self._matcher.flush(), out)
            out.append(ItemDone(event.index, event.kind, "".join(self._content_parts), event.channel))

    def _emit_content(self, event: ParseEvent, text: str, out: list[ParseEvent]) -> None:
        if text:
            self._content_parts.append(text)
            out.append(ItemDelta(event.index, ItemKind.CONTENT, text))

    def _finish(self) -> list[ParseEvent]:
        events: list[ParseEvent] = []
        if not self._stopped_by_string:
            for event in self._parser.finish():
                self._apply_stop(event, events)
        if self._stopped_by_string:
            self.finish_reason = "stop"
            return events
        self._check_not_aborted()
        if self._backend_finish == FINISH_LENGTH:
            self.finish_reason = "length"
        elif self._saw_tool_call:
            self.finish_reason = "tool_calls"
        else:
            self.finish_reason = "stop"
        return events

    def usage(self) -> dict[str, int]:
        return {**super().usage(), "reasoning_tokens": self.reasoning_tokens}


class GenerationGroup:
    """The n completions of one chat request (`n` > 1): n engine requests of one prompt, started and
    closed together; usage counts the prompt once, as OpenAI does."""

    def __init__(self, gens: list[BackendRequest]):
        self.gens = gens

    def start_soon(self) -> list[asyncio.Task]:
        # Together: first_deltas() waits for all of them; a failing one raises there and respond() closes the
        # group, aborting the others.
        return [task for gen in self.gens for task in gen.start_soon()]

    async def close(self) -> None:
        for gen in self.gens:  # each one, even if an earlier close fails (BackendRequest.close logs, never raises)
            await gen.close()

    def usage(self) -> dict[str, int]:
        parts = [g.usage() for g in self.gens]
        prompt = parts[0]["prompt_tokens"]
        completion = sum(p["completion_tokens"] for p in parts)
        return {"prompt_tokens": prompt, "completion_tokens": completion, "total_tokens": prompt + completion,
                "cached_tokens": parts[0]["cached_tokens"],
                **{key: sum(p[key] for p in parts)
                   for key in ("reasoning_tokens", "accepted_prediction_tokens", "rejected_prediction_tokens")}}


def request_id_headers(http: Request, response_id: str) -> dict[str, str] | None:
    """The answer's `x-request-id` when the request came without one (respond(): why)."""
    return None if "x-request-id" in http.headers else {"x-request-id": response_id}


async def respond(http: Request, gen: Generation | GenerationGroup, *, response_id: str, stream: bool,
                  make_stream: Callable[[Any], AsyncIterator[bytes]],
                  make_body: Callable[[Any], Awaitable[dict]], keepalive_s: float | None) -> Response:
    """Start `gen` (one generation or a group), then stream it or answer with one JSON body; the backend
    requests are aborted if the client leaves or anything fails before the generation ends.

    A refusal (400, 503) that comes before the first delta is the answer's status. A stream waits for the
    first delta only `keepalive_s` (IngressConfig.stream_keepalive_s): after that it starts (200) and sends an
    SSE comment every that many idle seconds, so a proxy or load balancer does not drop a request that waits in
    a queue (AWS ALB's idle timeout is 60 s); a refusal after that is an error event in the stream.

    A request that came without an `x-request-id` header gets `response_id` (the body's `id`; the engine's
    request ids are it or `<id>-<choice>`) as the answer's, as OpenAI's answers carry one (the openai client's
    `_request_id`). Under Serve the proxy gives every request one (or keeps the client's), tags the replicas'
    log lines of the request with it and returns it: a second value here would only be appended to it."""
    headers = request_id_headers(http, response_id)
    keepalive = keepalive_s if stream else None
    try:
        await run_unless_disconnected(http, lambda: first_deltas(gen, keepalive))
    except BaseException:
        await gen.close()
        raise
    if stream:  # the stream's own finally closes `gen`
        return EventStreamResponse(make_stream(gen), headers=headers, keepalive_s=keepalive)
    try:
        return JSONResponse(await run_unless_disconnected(http, lambda: make_body(gen)), headers=headers)
    finally:
        await gen.close()


async def first_deltas(gen: Generation | GenerationGroup, timeout_s: float | None) -> None:
    """Send `gen`'s requests and wait up to `timeout_s` (None: as long as it takes) for their first deltas; a
    refusal among those that came raises here."""
    done, _ = await asyncio.wait(gen.start_soon(), timeout=timeout_s, return_when=asyncio.FIRST_EXCEPTION)
    for task in done:
        task.result()
