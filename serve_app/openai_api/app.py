"""The OpenAI-compatible HTTP app: a pure function of a token backend and its configuration.

`create_app` holds no global state, so the Ray Serve ingress can wrap the very same app around a
Serve-handle backend, and tests can serve it with uvicorn around a scripted backend.
"""

from __future__ import annotations

import time
from typing import Any, Sequence

from fastapi import FastAPI, Request
from fastapi.middleware.cors import CORSMiddleware
from starlette.responses import Response

from engine.request import EngineUnhealthyError, TokenBackend
from serve_app.harmony.encoding import load_harmony_encoding
from serve_app.harmony.render import DEFAULT_KNOWLEDGE_CUTOFF
from serve_app.harmony.render_worker import RenderWorkers
from serve_app.openai_api.auth import ApiKeyGate, requester
from serve_app.openai_api.background import BackgroundRuns
from serve_app.openai_api.batch_runs import DEFAULT_CONCURRENCY, BatchRuns
from serve_app.openai_api.batches import install_batch_routes
from serve_app.openai_api.chat import create_chat_completion
from serve_app.openai_api.compaction import CompactRequest, compact
from serve_app.openai_api.completion_request import CompletionRequest
from serve_app.openai_api.completions import create_completion
from serve_app.openai_api import conversations
from serve_app.openai_api.conversations import ConversationCreate, ConversationUpdate, ItemsCreate, include_of
from serve_app.openai_api.errors import ModelNotFound, ServerOverloaded, install_error_handlers, parse_request
from serve_app.openai_api.generation import IngressConfig, IngressContext
from serve_app.openai_api.protocol import ChatCompletionRequest, InputTokensRequest, ResponsesRequest
from serve_app.openai_api.request_ids import RequestIdHeader
from serve_app.openai_api.responses import (cancel_response, count_input_tokens, create_response, delete_response,
                                            list_input_items, resume_response, retrieve_response,
                                            stream_stored_response)
from serve_app.openai_api import stored_chat
from serve_app.openai_api.stored_chat import ChatCompletionUpdate
from serve_app.openai_api.stored_responses import ResponseStore
from serve_app.openai_api.usage import UsageSink

DEFAULT_MAX_BODY_BYTES = 8 * 1024 * 1024  # ~2M tokens of text: far above any context we serve
# CORS for the allowed origins (`cors_allow_origins`): any method and header; clients may read these two headers.
CORS_OPTIONS = dict(allow_methods=["*"], allow_headers=["*"], expose_headers=["x-request-id", "retry-after"],
                    max_age=600)


def create_app(
    backend: TokenBackend,
    *,
    model_name: str = "gpt-oss",
    max_context: int,
    default_max_tokens: int | None = None,
    conversation_start_date: str | None = None,
    knowledge_cutoff: str = DEFAULT_KNOWLEDGE_CUTOFF,
    max_body_bytes: int = DEFAULT_MAX_BODY_BYTES,
    api_keys: Sequence[str] = (),
    stream_keepalive_s: float | None = 15.0,
    response_store: ResponseStore | None = None,
    cors_allow_origins: Sequence[str] = (),
    allow_priority: bool = False,
    isolate_prefix_cache: bool = False,
    forced_call_reasoning_tokens: int = 2048,
    usage_sink: UsageSink | None = None,
    renderer: RenderWorkers | None = None,
    system_fingerprint: str | None = None,
    batch_concurrency: int = DEFAULT_CONCURRENCY,
    batch_priority: int = 1,
    max_upload_bytes: int = 200 << 20,
) -> FastAPI:
    """Serve /v1/chat/completions, /v1/responses (GET / DELETE of stored ones, cancel of background ones, input
    token counts), /v1/conversations (and their items), /v1/completions, /v1/models and /health for `backend`.

    max_context: prompt + completion tokens per request; the backend's own `max_context` caps it.
    default_max_tokens: completion budget when a request sets none (default: the rest of the context).
    conversation_start_date: "YYYY-MM-DD" in the Harmony system message (default: today, UTC).
    api_keys: when given, requests to any path but /health must send one as `Authorization: Bearer KEY`.
    stream_keepalive_s: a stream waits this long for its first token before it starts (HTTP 200; a later
    refusal is an error event), then sends `: keep-alive` after each such idle period; None: it waits and
    stays silent as long as it takes.
    response_store: where /v1/responses keeps responses (`store`, `previous_response_id`, GET, DELETE) and
    /v1/conversations its conversations; None: the endpoints are stateless (no conversations).
    cors_allow_origins: origins whose browser pages may call the API (CORS; "*" for any); empty: none.
    allow_priority: honour requests' `priority` (lower runs sooner in the engines); off: a non-zero one is a 400.
    isolate_prefix_cache: with api_keys, each key's requests reuse only their own cached prompt blocks (the cache
    hits, visible in time to first token, then tell a key nothing of what other keys sent).
    forced_call_reasoning_tokens: a forced tool call (tool_choice) may follow an analysis message and a preamble of
    at most this many tokens each; 0: the call at once.
    usage_sink: told each engine request's model, endpoint, API key, outcome and tokens when it ends (usage.py).
    renderer: the processes that tokenize long prompts off the event loop (shared by the apps of one ingress
    replica); None: the app's own, one process, started on the first long prompt.
    system_fingerprint: the backend's configuration (engine/fingerprint.py), reported in chat and text completions;
    None: reported as null.
    batch_concurrency, batch_priority: /v1/batches requests in flight at once (all of the app's batches together), and
    the engine priority they get on top of their own (batch_runs.py); max_upload_bytes: the largest /v1/files upload
    (batches.py).
    """
    backend_limit = getattr(backend, "max_context", None)
    limit = min(max_context, backend_limit) if backend_limit else max_context
    if limit <= 0 or max_body_bytes <= 0:
        raise ValueError(f"max_context ({limit}) and max_body_bytes ({max_body_bytes}) must be positive")
    if forced_call_reasoning_tokens < 0:
        raise ValueError(f"forced_call_reasoning_tokens must be >= 0, not {forced_call_reasoning_tokens}")
    if stream_keepalive_s is not None and stream_keepalive_s <= 0:
        raise ValueError(f"stream_keepalive_s must be positive or None, not {stream_keepalive_s}")
    config = IngressConfig(model_name=model_name, max_context=limit, default_max_tokens=default_max_tokens,
                           conversation_start_date=conversation_start_date, knowledge_cutoff=knowledge_cutoff,
                           max_body_bytes=max_body_bytes, stream_keepalive_s=stream_keepalive_s,
                           allow_priority=allow_priority, isolate_prefix_cache=isolate_prefix_cache,
                           forced_call_reasoning_tokens=forced_call_reasoning_tokens,
                           system_fingerprint=system_fingerprint, batch_priority=batch_priority)
    ctx = IngressContext(backend=backend, config=config, encoding=load_harmony_encoding(), store=response_store,
                         background=BackgroundRuns(response_store, model=config.model_name)
                         if response_store is not None else None,
                         usage_sink=usage_sink, renderer=renderer if renderer is not None else RenderWorkers())
    created = int(time.time())
    app = FastAPI(title="gpt-oss OpenAI-compatible API", docs_url=None, redoc_url=None)
    app.state.background = ctx.background  # the host stops them when it shuts down (HarmonyIngress.__del__)
    if ctx.background is not None:  # and adopts those another replica gave back or left (its health check)
        ctx.background.resume = lambda response_id, stored: resume_response(response_id, stored, ctx)
    # batches' requests go to this app, or to the app around it (model_router.serve_models sets that)
    app.state.batches = BatchRuns(response_store, batch_concurrency) if response_store is not None else None
    if app.state.batches is not None:
        app.state.batches.target = app
    install_error_handlers(app)
    if api_keys:
        app.add_middleware(ApiKeyGate, keys=api_keys)
    if cors_allow_origins:  # added after the gate, so outside it: a preflight (which carries no key) is answered first
        app.add_middleware(CORSMiddleware, allow_origins=list(cors_allow_origins), **CORS_OPTIONS)
    app.add_middleware(RequestIdHeader)  # outermost: a 401 or a preflight's answer carries one too

    def model_card() -> dict[str, Any]:
        return {"id": model_name, "object": "model", "created": created, "owned_by": "gptoss-serve",
                "max_model_len": limit}

    def check_model(model: str) -> None:
        if model != model_name:
            raise ModelNotFound(model, model_name)

    @app.get("/health")
    async def health() -> dict[str, str]:
        """ok, or (a backend with `check_health`, such as an in-process AsyncEngine) a 503 saying why its
        engine cannot serve. Under Serve the ingress' backend has none: each engine replica reports its own
        health to Serve."""
        check = getattr(backend, "check_health", None)
        if check is not None:
            try:
                check()
            except EngineUnhealthyError as err:
                raise ServerOverloaded(f"The engine cannot serve ({err}).", code="engine_unavailable") from None
        return {"status": "ok"}

    @app.get("/v1/models")
    async def list_models() -> dict[str, Any]:
        return {"object": "list", "data": [model_card()]}

    @app.get("/v1/models/{model_id:path}")
    async def get_model(model_id: str) -> dict[str, Any]:
        check_model(model_id)
        return model_card()

    @app.post("/v1/chat/completions")
    async def chat_completions(request: Request) -> Response:
        req = await parse_request(request, ChatCompletionRequest, config.max_body_bytes)
        check_model(req.model)
        return await create_chat_completion(req, request, ctx)

    # Chat completions made with `store: true`, scoped to API keys as stored responses are (stored_chat.py).
    @app.get("/v1/chat/completions")
    async def list_chat_completions(request: Request, model: str | None = None, order: str = "asc", limit: int = 20,
                                    after: str | None = None) -> dict[str, Any]:
        return await stored_chat.list_completions(ctx, requester(request), model=model, order=order, limit=limit,
                                                  after=after, metadata=stored_chat.metadata_filter(request))

    @app.get("/v1/chat/completions/{completion_id}")
    async def get_chat_completion(request: Request, completion_id: str) -> dict[str, Any]:
        return await stored_chat.retrieve(ctx, completion_id, requester(request))

    @app.post("/v1/chat/completions/{completion_id}")
    async def update_chat_completion(request: Request, completion_id: str) -> dict[str, Any]:
        req = await parse_request(request, ChatCompletionUpdate, config.max_body_bytes)
        return await stored_chat.update(ctx, completion_id, req, requester(request))

    @app.delete("/v1/chat/completions/{completion_id}")
    async def delete_chat_completion(request: Request, completion_id: str) -> dict[str, Any]:
        return await stored_chat.delete(ctx, completion_id, requester(request))

    @app.get("/v1/chat/completions/{completion_id}/messages")
    async def list_chat_messages(request: Request, completion_id: str, order: str = "asc", limit: int = 20,
                                 after: str | None = None) -> dict[str, Any]:
        return await stored_chat.list_messages(ctx, completion_id, requester(request), order=order, limit=limit,
                                               after=after)

    @app.post("/v1/completions")
    async def completions(request: Request) -> Response:
        req = await parse_request(request, CompletionRequest, config.max_body_bytes)
        check_model(req.model)
        return await create_completion(req, request, ctx)

    @app.post("/v1/responses")
    async def responses(request: Request) -> Response:
        req = await parse_request(request, ResponsesRequest, config.max_body_bytes)
        check_model(req.model)
        return await create_response(req, request, ctx)

    @app.post("/v1/responses/input_tokens")
    async def input_tokens(request: Request) -> dict[str, Any]:
        req = await parse_request(request, InputTokensRequest, config.max_body_bytes)
        if req.model is not None:
            check_model(req.model)
        return await count_input_tokens(req, request, ctx)

    @app.post("/v1/responses/compact")
    async def compact_conversation(request: Request) -> dict[str, Any]:
        req = await parse_request(request, CompactRequest, config.max_body_bytes)
        check_model(req.model)
        return await compact(req, request, ctx)

    # Stored responses are scoped to the API key that made them (auth.requester; None without keys).
    @app.get("/v1/responses/{response_id}")
    async def get_response(request: Request, response_id: str, stream: bool = False,
                           starting_after: int | None = None) -> Any:
        if stream:  # a streamed background response's events (resumable)
            return await stream_stored_response(request, response_id, ctx, requester(request), starting_after)
        return await retrieve_response(response_id, ctx, requester(request))

    @app.delete("/v1/responses/{response_id}")
    async def remove_response(request: Request, response_id: str) -> dict[str, Any]:
        return await delete_response(response_id, ctx, requester(request))

    @app.post("/v1/responses/{response_id}/cancel")
    async def cancel(request: Request, response_id: str) -> dict[str, Any]:
        return await cancel_response(response_id, ctx, requester(request))

    @app.get("/v1/responses/{response_id}/input_items")
    async def get_input_items(request: Request, response_id: str, order: str = "desc", limit: int = 20,
                              after: str | None = None) -> dict[str, Any]:
        return await list_input_items(response_id, ctx, requester(request), order=order, limit=limit, after=after)

    # Conversations, scoped to API keys as stored responses are (conversations.py).
    @app.post("/v1/conversations")
    async def create_conversation(request: Request) -> dict[str, Any]:
        req = await parse_request(request, ConversationCreate, config.max_body_bytes)
        return await conversations.create_conversation(req, ctx, requester(request))

    @app.get("/v1/conversations/{conversation_id}")
    async def get_conversation(request: Request, conversation_id: str) -> dict[str, Any]:
        return (await conversations.owned_conversation(ctx, conversation_id, requester(request))).conversation

    @app.post("/v1/conversations/{conversation_id}")
    async def update_conversation(request: Request, conversation_id: str) -> dict[str, Any]:
        req = await parse_request(request, ConversationUpdate, config.max_body_bytes)
        return await conversations.update_conversation(conversation_id, req, ctx, requester(request))

    @app.delete("/v1/conversations/{conversation_id}")
    async def delete_conversation(request: Request, conversation_id: str) -> dict[str, Any]:
        return await conversations.delete_conversation(conversation_id, ctx, requester(request))

    @app.post("/v1/conversations/{conversation_id}/items")
    async def add_conversation_items(request: Request, conversation_id: str) -> dict[str, Any]:
        req = await parse_request(request, ItemsCreate, config.max_body_bytes)
        return await conversations.add_items(conversation_id, req, ctx, requester(request), include_of(request))

    @app.get("/v1/conversations/{conversation_id}/items")
    async def list_conversation_items(request: Request, conversation_id: str, order: str = "desc", limit: int = 20,
                                      after: str | None = None) -> dict[str, Any]:
        return await conversations.list_items(conversation_id, ctx, requester(request), order=order, limit=limit,
                                              after=after, include=include_of(request))

    @app.get("/v1/conversations/{conversation_id}/items/{item_id}")
    async def get_conversation_item(request: Request, conversation_id: str, item_id: str) -> dict[str, Any]:
        return await conversations.retrieve_item(conversation_id, item_id, ctx, requester(request),
                                                 include_of(request))

    @app.delete("/v1/conversations/{conversation_id}/items/{item_id}")
    async def delete_conversation_item(request: Request, conversation_id: str, item_id: str) -> dict[str, Any]:
        return await conversations.delete_item(conversation_id, item_id, ctx, requester(request))

    install_batch_routes(app, ctx, app.state.batches, max_upload_bytes)
    return app
