"""Several models behind one OpenAI API: each model is its own `create_app` app, and `ModelRouter` sends a request
to the app of the `model` its body names.

- POST /v1/chat/completions, /v1/completions, /v1/responses, /v1/responses/input_tokens and /v1/responses/compact:
  the body is read (at most `max_body_bytes`, else 413) and replayed to the app of its `model`. A body naming no
  model goes to the first model's app (which answers a malformed body with its 400, and counts input tokens for
  itself); an unknown model is a 404 that lists the served ones.
- GET /v1/models lists every model; GET /v1/models/{id} asks that model's app.
- Everything else (/health, stored responses by id, their cancel and input items, /v1/conversations, stored chat
  completions, /v1/files, /v1/batches) goes to the first model's app: the apps share one response store, so any of
  them reads any stored response, conversation or chat completion (listing chat completions filters by `model` as
  asked); its batches send their lines back through the router, so each line reaches the model it names.

API keys and CORS wrap the router once (`serve_models`), so the merged model list is guarded like the rest and a
request's key (auth.requester) reaches whichever app serves it.
"""

from __future__ import annotations

import json
from typing import Any, Mapping, Sequence

from starlette.middleware.cors import CORSMiddleware
from starlette.responses import JSONResponse
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from serve_app.openai_api.app import CORS_OPTIONS
from serve_app.openai_api.auth import ApiKeyGate, app_path
from serve_app.openai_api.errors import ModelNotFound, PayloadTooLarge
from serve_app.openai_api.request_ids import RequestIdHeader

ROUTED_POSTS = frozenset({"/v1/chat/completions", "/v1/completions", "/v1/responses", "/v1/responses/input_tokens",
                          "/v1/responses/compact"})


class ModelRouter:
    def __init__(self, apps: Mapping[str, ASGIApp], max_body_bytes: int):
        if not apps:
            raise ValueError("ModelRouter needs at least one model")
        self.apps = dict(apps)
        self.default = next(iter(self.apps.values()))
        self.max_body_bytes = max_body_bytes

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":  # lifespan and anything else: the first app (the apps keep no lifespan state)
            await self.default(scope, receive, send)
            return
        path, method = app_path(scope), scope["method"]
        if method == "GET" and path == "/v1/models":
            cards = [card for app in self.apps.values() for card in (await _get_json(app, scope, path))["data"]]
            await JSONResponse({"object": "list", "data": cards})(scope, receive, send)
        elif method == "GET" and path.startswith("/v1/models/"):
            await self._to_model(path.removeprefix("/v1/models/"), scope, receive, send)
        elif method == "POST" and path in ROUTED_POSTS:
            body = await self._read_body(receive)
            if body is None:
                error = PayloadTooLarge(self.max_body_bytes)
                await JSONResponse(error.body(), status_code=error.status_code)(scope, receive, send)
                return
            await self._to_model(_model_of(body), scope, _replay(body, receive), send)
        else:
            await self.default(scope, receive, send)

    async def _to_model(self, model: str | None, scope: Scope, receive: Receive, send: Send) -> None:
        app = self.default if model is None else self.apps.get(model)
        if app is None:
            error = ModelNotFound(model, list(self.apps))
            await JSONResponse(error.body(), status_code=error.status_code)(scope, receive, send)
            return
        await app(scope, receive, send)

    async def _read_body(self, receive: Receive) -> bytes | None:
        """The whole request body, or None once it is known to exceed max_body_bytes."""
        chunks, size, more = [], 0, True
        while more:
            message = await receive()
            if message["type"] == "http.disconnect":
                break
            chunk = message.get("body", b"")
            size += len(chunk)
            if size > self.max_body_bytes:
                return None
            chunks.append(chunk)
            more = message.get("more_body", False)
        return b"".join(chunks)


def _model_of(body: bytes) -> str | None:
    """The body's `model` when it is a JSON object naming one as a string; None otherwise (the first app then
    answers the body as it is, a 400 when it is malformed)."""
    try:
        data = json.loads(body)
    except (ValueError, RecursionError):
        return None
    model = data.get("model") if isinstance(data, dict) else None
    return model if isinstance(model, str) else None


def _replay(body: bytes, receive: Receive) -> Receive:
    """`receive` for the app: the buffered body once, then the client's own messages (its disconnect)."""
    sent = False

    async def replayed() -> Message:
        nonlocal sent
        if not sent:
            sent = True
            return {"type": "http.request", "body": body, "more_body": False}
        return await receive()

    return replayed


async def _get_json(app: ASGIApp, scope: Scope, path: str) -> Any:
    """GET `path` from `app` in-process (the caller's scope, as a GET of that path) and return its JSON body."""
    inner = {**scope, "method": "GET", "path": scope.get("root_path", "") + path, "raw_path": path.encode(),
             "query_string": b""}
    status, chunks = 500, []

    async def receive() -> Message:
        return {"type": "http.request", "body": b"", "more_body": False}

    async def send(message: Message) -> None:
        nonlocal status
        if message["type"] == "http.response.start":
            status = message["status"]
        elif message["type"] == "http.response.body":
            chunks.append(message.get("body", b""))

    await app(inner, receive, send)
    if status != 200:
        raise RuntimeError(f"GET {path} from a model's app answered {status}")
    return json.loads(b"".join(chunks))


def serve_models(apps: Mapping[str, ASGIApp], *, max_body_bytes: int, api_keys: Sequence[str] = (),
                 cors_allow_origins: Sequence[str] = ()) -> ASGIApp:
    """The ASGI app for `apps` (served model name -> create_app app, built without keys or CORS): the router, then
    the API key gate, then CORS outermost (a preflight carries no key)."""
    app: ASGIApp = ModelRouter(apps, max_body_bytes)
    if api_keys:
        app = ApiKeyGate(app, api_keys)
    if cors_allow_origins:
        app = CORSMiddleware(app, allow_origins=list(cors_allow_origins), **CORS_OPTIONS)
    app = RequestIdHeader(app)
    batches = getattr(getattr(next(iter(apps.values())), "state", None), "batches", None)
    if batches is not None:  # the first app runs the batches (it gets /v1/batches); their lines come back here
        batches.target = app
    return app
