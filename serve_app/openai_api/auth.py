"""API keys: with keys configured, every request but /health must carry one as `Authorization: Bearer KEY`.

A plain ASGI middleware (not Starlette's BaseHTTPMiddleware, which would wrap every streamed response and its
disconnect handling): refused requests get OpenAI's 401 before any route runs; /health stays open for load
balancers and Serve's own probes. The path is taken relative to the app's root (Serve's route_prefix), so an
app mounted under a prefix is guarded the same; anything else (/v1/..., unknown paths) needs a key. Keys are
compared in constant time. An accepted request's key is named in `request.state.api_key_id` (a hash, never the
key), which scopes stored responses to the key that made them.
"""

from __future__ import annotations

import hashlib
import hmac
from typing import Iterable

from starlette.responses import JSONResponse
from starlette.types import ASGIApp, Receive, Scope, Send

from serve_app.openai_api.errors import InvalidApiKey

OPEN_PATHS = frozenset({"/health"})


def app_path(scope: Scope) -> str:
    """The request's path below the app's mount point (Starlette puts the root path in `path` since 0.35)."""
    path, root = scope["path"], scope.get("root_path", "")
    return path[len(root):] or "/" if root and path.startswith(root) else path


def key_id(token: bytes) -> str:
    """A stable name for an API key that does not reveal it (what stored responses record as their owner)."""
    return hashlib.sha256(b"gptoss-api-key:" + token).hexdigest()[:24]


def requester(request) -> str | None:
    """The key_id of the request's API key; None where the app takes no keys."""
    return getattr(request.state, "api_key_id", None)


BATCH_STATE = "batch_of"  # scope["state"] key: the request is a line of a batch (batch_runs.as_batch_line)


def in_batch(request) -> bool:
    """Whether the request is a line of a /v1/batches batch, run by the server itself (batch_runs.py)."""
    return getattr(request.state, BATCH_STATE, None) is not None


def bearer_token(scope: Scope) -> bytes | None:
    """The token of the request's `Authorization: Bearer TOKEN` header (None: no such header)."""
    for name, value in scope.get("headers", ()):
        if name == b"authorization":
            scheme, _, token = value.strip().partition(b" ")
            return token.strip() if scheme.lower() == b"bearer" else None
    return None


class ApiKeyGate:
    def __init__(self, app: ASGIApp, keys: Iterable[str]):
        self.app = app
        self.keys = tuple(key.encode() for key in keys)
        if not self.keys:
            raise ValueError("ApiKeyGate needs at least one key")

        self.key_ids = {key: key_id(key) for key in self.keys}  # once, not per request

    def accepts(self, token: bytes) -> bool:
        # every key compared (no early exit), each in constant time
        return sum(hmac.compare_digest(token, key) for key in self.keys) > 0

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        # A batch's line comes from the server itself (its scope's state, which no client sets), with its key's id.
        if scope["type"] == "http" and app_path(scope) not in OPEN_PATHS and BATCH_STATE not in scope.get("state", ()):
            token = bearer_token(scope)
            if token is None or not self.accepts(token):
                err = InvalidApiKey(sent=token is not None)
                response = JSONResponse(err.body(), status_code=err.status_code, headers=err.headers())
                await response(scope, receive, send)
                return
            scope.setdefault("state", {})["api_key_id"] = self.key_ids[token]
        await self.app(scope, receive, send)
